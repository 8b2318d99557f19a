//! The stored HTTP responses, `{prefix}http_responses` (see [`crate::ingress`]): written in the transaction of
//! the request's marker, read when the same idempotency key comes again, pruned with the markers. The same
//! statements on every store.

use std::future::Future;

use crate::store::parking::Style;
use crate::store::{Store, Tables};

/// A response as stored: status, headers (a JSON array of `[name, value]` pairs) and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status.
    pub status: u16,
    /// The headers to send again, as `[name, value]` pairs.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

/// The stored responses of the HTTP ingress. Every store idem has implements it.
pub trait StoredResponses: Store {
    /// Stores the response to `event_id` of `group` on `conn`, the transaction holding the event's marker.
    fn store_response(
        conn: &mut Self::Connection,
        tables: &Tables,
        group: &str,
        event_id: &str,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// The response stored for `event_id` of `group`, if any.
    fn stored_response(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        group: &str,
        event_id: &str,
    ) -> impl Future<Output = Result<Option<StoredResponse>, sqlx::Error>> + Send;
    /// Deletes at most `limit` responses stored before `before_ms` (of `group`, or of every group); how many.
    fn prune_responses(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        group: Option<&str>,
        before_ms: i64,
        limit: u32,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
}

/// The three statements in a store's style: insert, select, bounded delete. The insert replaces a row already
/// there: the marker was claimed new in the same transaction, so such a row is a reply whose marker expired first
/// (pruned between the two deletes), and the new reply is the one a retry must get.
pub(crate) fn statements(tables: &Tables, style: Style) -> [String; 3] {
    let insert = match style {
        Style::MySql => {
            "INSERT INTO {t}http_responses (consumer_group, event_id, status, headers, body, stored_at_ms)
             VALUES (?, ?, ?, ?, ?, ?)
             ON DUPLICATE KEY UPDATE status = VALUES(status), headers = VALUES(headers), body = VALUES(body),
                                     stored_at_ms = VALUES(stored_at_ms)"
        }
        Style::Postgres | Style::Sqlite => {
            "INSERT INTO {t}http_responses (consumer_group, event_id, status, headers, body, stored_at_ms)
             VALUES (?, ?, ?, ?, ?, ?)
             ON CONFLICT (consumer_group, event_id) DO UPDATE SET status = excluded.status, headers = excluded.headers,
                 body = excluded.body, stored_at_ms = excluded.stored_at_ms"
        }
    };
    let select = "SELECT status, headers, body FROM {t}http_responses WHERE consumer_group = ? AND event_id = ?";
    // MySQL deletes with a LIMIT of its own (it refuses one in an IN subquery); the others pick the rows first.
    let delete = match style {
        Style::MySql => {
            "DELETE FROM {t}http_responses WHERE stored_at_ms < ? AND (? IS NULL OR consumer_group = ?) LIMIT ?"
        }
        Style::Postgres | Style::Sqlite => {
            "DELETE FROM {t}http_responses WHERE (consumer_group, event_id) IN (
               SELECT consumer_group, event_id FROM {t}http_responses
                WHERE stored_at_ms < ? AND (? IS NULL OR consumer_group = ?) LIMIT ?)"
        }
    };
    [insert, select, delete].map(|sql| style.finish(&tables.render(sql)))
}

/// The headers column's text: a JSON array of pairs.
pub(crate) fn headers_text(headers: &[(String, String)]) -> String {
    serde_json::to_string(headers).unwrap_or_else(|_| "[]".to_owned())
}

/// A response from its stored columns; headers that do not parse are dropped (the body and status stand).
pub(crate) fn response_of(status: i32, headers: &str, body: Vec<u8>) -> StoredResponse {
    StoredResponse {
        status: u16::try_from(status).unwrap_or(500),
        headers: serde_json::from_str(headers).unwrap_or_default(),
        body,
    }
}

/// Milliseconds since the Unix epoch, the `stored_at_ms` of a new response.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Implements [`StoredResponses`] for a store in its style.
macro_rules! impl_stored_responses {
    ($db:ty, $style:expr) => {
        impl $crate::store::responses::StoredResponses for $db {
            async fn store_response(
                conn: &mut <$db as sqlx::Database>::Connection,
                tables: &$crate::store::Tables,
                group: &str,
                event_id: &str,
                r: &$crate::store::responses::StoredResponse,
            ) -> Result<(), sqlx::Error> {
                let [insert, _, _] = $crate::store::responses::statements(tables, $style);
                sqlx::query(&insert)
                    .bind(group)
                    .bind(event_id)
                    .bind(i32::from(r.status))
                    .bind($crate::store::responses::headers_text(&r.headers))
                    .bind(r.body.as_slice())
                    .bind($crate::store::responses::now_ms())
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            }

            async fn stored_response(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                group: &str,
                event_id: &str,
            ) -> Result<Option<$crate::store::responses::StoredResponse>, sqlx::Error> {
                let [_, select, _] = $crate::store::responses::statements(tables, $style);
                let row: Option<(i32, String, Vec<u8>)> =
                    sqlx::query_as(&select).bind(group).bind(event_id).fetch_optional(pool).await?;
                Ok(row.map(|(status, headers, body)| $crate::store::responses::response_of(status, &headers, body)))
            }

            async fn prune_responses(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                group: Option<&str>,
                before_ms: i64,
                limit: u32,
            ) -> Result<u64, sqlx::Error> {
                let [_, _, delete] = $crate::store::responses::statements(tables, $style);
                let done = sqlx::query(&delete)
                    .bind(before_ms)
                    .bind(group)
                    .bind(group)
                    .bind(i64::from(limit))
                    .execute(pool)
                    .await?;
                Ok(done.rows_affected())
            }
        }
    };
}
pub(crate) use impl_stored_responses;
