//! The parked messages of delayed retries ([`crate::delayed_retry`]): one table, `{prefix}parked_messages`, the
//! same statements on every store. They are written with `?` and numbered for PostgreSQL ([`numbered`]); times are
//! milliseconds since the epoch that idem passes in, so no store's clock functions are needed.

use std::future::Future;

use crate::error::Error;
use crate::message::Message;
use crate::store::{Store, Tables, decode_headers};

/// A message about to be parked.
#[derive(Debug)]
pub struct NewParked<'a> {
    /// Its event id (a message without one is dead-lettered, never parked).
    pub event_id: &'a str,
    /// The digest of its broker key, whose later messages wait behind it; `None` parks it alone.
    pub order_key: Option<&'a [u8]>,
    /// The message as delivered.
    pub message: &'a Message,
    /// Handler attempts made so far.
    pub attempts: i32,
    /// Why the last attempt failed; `None` for a message parked behind its key, never tried.
    pub error: Option<&'a str>,
    /// What happened so far, as JSON lines an operator reads (see [`ParkedMessage::history`]).
    pub history: &'a str,
    /// Now, in milliseconds since the epoch.
    pub now_ms: i64,
    /// When it is due, in milliseconds since the epoch.
    pub due_ms: i64,
}

/// A parked message as stored.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ParkedMessage {
    /// Row id: the arrival order (a key's head is its lowest id).
    pub id: i64,
    /// The consumer group that parked it.
    pub consumer_group: String,
    /// The event id.
    pub event_id: String,
    /// Topic of the original delivery.
    pub topic: String,
    /// Partition of the original delivery.
    pub partition: i32,
    /// Offset of the original delivery.
    pub offset: i64,
    /// The broker key.
    pub key: Option<Vec<u8>>,
    /// The payload.
    pub payload: Vec<u8>,
    /// The headers, as stored (JSON).
    pub headers: String,
    /// The broker's timestamp, when it gave one.
    pub timestamp_ms: Option<i64>,
    /// Handler attempts made so far, immediate and delayed.
    pub attempts: i32,
    /// Delayed retries begun so far (the next delay is the schedule's entry at this index).
    pub delayed_retries: i32,
    /// Why the last attempt failed; `None` while it waits behind its key, never tried.
    pub error: Option<String>,
    /// One JSON object per line: `{"at_ms", "attempts", "error"}` for each failure.
    pub history: String,
    /// When it was parked, in milliseconds since the epoch.
    pub parked_at: i64,
    /// When it is due, in milliseconds since the epoch.
    pub due_at: i64,
}

impl ParkedMessage {
    /// The message as it was delivered (without an acknowledgement handle: it was acknowledged when parked).
    pub fn message(&self) -> Message {
        let mut message = Message::new(self.topic.clone(), self.partition, self.offset, self.payload.clone());
        message.key = self.key.clone();
        message.headers = decode_headers(&self.headers);
        message.timestamp_ms = self.timestamp_ms;
        message
    }
}

/// A parked message from a row of any store, columns in the field order: the one row mapping.
impl<'r, R: sqlx::Row> sqlx::FromRow<'r, R> for ParkedMessage
where
    usize: sqlx::ColumnIndex<R>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Option<Vec<u8>>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        Ok(ParkedMessage {
            id: row.try_get(0)?,
            consumer_group: row.try_get(1)?,
            event_id: row.try_get(2)?,
            topic: row.try_get(3)?,
            partition: row.try_get(4)?,
            offset: row.try_get(5)?,
            key: row.try_get(6)?,
            payload: row.try_get(7)?,
            headers: row.try_get(8)?,
            timestamp_ms: row.try_get(9)?,
            attempts: row.try_get(10)?,
            delayed_retries: row.try_get(11)?,
            error: row.try_get(12)?,
            history: row.try_get(13)?,
            parked_at: row.try_get(14)?,
            due_at: row.try_get(15)?,
        })
    }
}

/// A line of a parked message's history.
pub(crate) fn history_line(at_ms: i64, attempts: i32, error: &str) -> String {
    let mut line = serde_json::json!({ "at_ms": at_ms, "attempts": attempts, "error": error }).to_string();
    line.push('\n');
    line
}

/// Parked messages and their figures: what delayed retries need of a store. Every store idem has implements it.
pub trait Parking: Store {
    /// Parks a message in the open transaction; `false` when its event is parked already (a redelivery).
    fn park(
        conn: &mut Self::Connection,
        tables: &Tables,
        group: &str,
        parked: &NewParked<'_>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
    /// Which of `order_keys` have a parked message.
    fn parked_keys(
        conn: &mut Self::Connection,
        tables: &Tables,
        group: &str,
        order_keys: &[Vec<u8>],
    ) -> impl Future<Output = Result<Vec<Vec<u8>>, sqlx::Error>> + Send;
    /// The ids of at most `limit` parked messages that are due at `now_ms` and head their key, oldest due first.
    fn due_parked(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        group: &str,
        now_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<i64>, sqlx::Error>> + Send;
    /// Leases a due parked message: moves its due time to `until_ms` (and counts a delayed retry when `counted`)
    /// unless another consumer leased it first; returns it leased, or `None`.
    fn lease_parked(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        id: i64,
        now_ms: i64,
        until_ms: i64,
        counted: bool,
    ) -> impl Future<Output = Result<Option<ParkedMessage>, sqlx::Error>> + Send;
    /// Removes a parked message in the open transaction (the one that applies or dead-letters it); `false` when
    /// it is gone already.
    fn unpark(
        conn: &mut Self::Connection,
        tables: &Tables,
        id: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
    /// Records a failed delayed retry: the attempts, the reason, the history.
    fn record_parked_failure(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        id: i64,
        attempts: i32,
        error: &str,
        history: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Parked messages in arrival order (of `group` only, when given), at most `limit`.
    fn parked(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        group: Option<&str>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<ParkedMessage>, Error>> + Send;
    /// Parked message `id`, read in the open transaction (and locked where the store locks rows).
    fn parked_by_id(
        conn: &mut Self::Connection,
        tables: &Tables,
        id: i64,
    ) -> impl Future<Output = Result<Option<ParkedMessage>, sqlx::Error>> + Send;
    /// Makes parked messages due at `now_ms` (`id`, or every one of `group`, or every one): the release loop tries
    /// them at its next look, each key still in order. Returns how many.
    fn retry_parked_now(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        group: Option<&str>,
        id: Option<i64>,
        now_ms: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
    /// How many messages `group` has parked, and when the oldest was parked (milliseconds since the epoch).
    fn parked_figures(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        group: &str,
    ) -> impl Future<Output = Result<(i64, Option<i64>), sqlx::Error>> + Send;
}

/// `sql` with its `?` placeholders numbered `$1`, `$2`, … (PostgreSQL's form).
pub(crate) fn numbered(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut n = 0;
    for c in sql.chars() {
        if c == '?' {
            n += 1;
            out.push('$');
            out.push_str(&n.to_string());
        } else {
            out.push(c);
        }
    }
    out
}

/// `(?, ?, …)` with `n` placeholders (at least one, so that an empty list stays valid SQL).
fn placeholders(n: usize) -> String {
    let mut list = vec!["?"; n.max(1)].join(", ");
    list.insert(0, '(');
    list.push(')');
    list
}

const COLUMNS: &str = r#"id, consumer_group, event_id, topic, partition, "offset", key, payload, headers, timestamp_ms,
    attempts, delayed_retries, error, history, parked_at, due_at"#;

/// The statements, each a function of the table names and the store's quoting (`quote` turns the `"offset"`,
/// `partition` and `key` identifiers into the store's form) and placeholder style.
pub(crate) struct Statements {
    pub exists: String,
    pub park: String,
    pub due: String,
    pub lease: String,
    pub lease_counted: String,
    pub select_one: String,
    pub unpark: String,
    pub record_failure: String,
    pub list: String,
    pub by_id: String,
    pub retry_now: String,
    pub figures: String,
}

impl Statements {
    /// The statements for a store: `mysql` quotes identifiers with backticks and keeps `?`; the others use double
    /// quotes, PostgreSQL with numbered placeholders.
    pub(crate) fn new(tables: &Tables, style: Style) -> Statements {
        let render = |sql: &str| style.finish(&tables.render(sql));
        // MySQL reports text columns of a binary collation as bytes: read back as text.
        let columns = match style {
            Style::MySql => COLUMNS.replacen(
                "id, consumer_group, event_id, topic,",
                "id, CAST(consumer_group AS CHAR), CAST(event_id AS CHAR), CAST(topic AS CHAR),",
                1,
            ),
            Style::Postgres | Style::Sqlite => COLUMNS.to_owned(),
        };
        // Two consumers parking one redelivered event at once: the second's insert does nothing.
        let conflict = match style {
            Style::MySql => "ON DUPLICATE KEY UPDATE id = id",
            Style::Postgres | Style::Sqlite => "ON CONFLICT (consumer_group, event_id) DO NOTHING",
        };
        Statements {
            exists: render("SELECT COUNT(*) FROM {t}parked_messages WHERE consumer_group = ? AND event_id = ?"),
            park: render(&format!(
                r#"INSERT INTO {{t}}parked_messages (consumer_group, event_id, order_key, topic, partition, "offset",
                     key, payload, headers, timestamp_ms, attempts, delayed_retries, error, history, parked_at, due_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?) {conflict}"#
            )),
            due: render(
                "SELECT p.id FROM {t}parked_messages p
                  WHERE p.consumer_group = ? AND p.due_at <= ?
                    AND NOT EXISTS (SELECT 1 FROM {t}parked_messages q WHERE q.consumer_group = p.consumer_group
                                       AND q.order_key = p.order_key AND q.id < p.id)
                  ORDER BY p.due_at, p.id LIMIT ?",
            ),
            lease: render("UPDATE {t}parked_messages SET due_at = ? WHERE id = ? AND due_at <= ?"),
            lease_counted: render(
                "UPDATE {t}parked_messages SET due_at = ?, delayed_retries = delayed_retries + 1 WHERE id = ? AND due_at <= ?",
            ),
            select_one: render(&format!("SELECT {columns} FROM {{t}}parked_messages WHERE id = ?")),
            unpark: render("DELETE FROM {t}parked_messages WHERE id = ?"),
            record_failure: render("UPDATE {t}parked_messages SET attempts = ?, error = ?, history = ? WHERE id = ?"),
            list: render(&format!(
                "SELECT {columns} FROM {{t}}parked_messages WHERE (? IS NULL OR consumer_group = ?) ORDER BY id LIMIT ?"
            )),
            by_id: render(&format!(
                "SELECT {columns} FROM {{t}}parked_messages WHERE id = ?{}",
                if style == Style::Sqlite { "" } else { " FOR UPDATE" }
            )),
            retry_now: render(
                "UPDATE {t}parked_messages SET due_at = ?
                  WHERE (? IS NULL OR consumer_group = ?) AND (? IS NULL OR id = ?) AND due_at > ?",
            ),
            figures: render("SELECT COUNT(*), MIN(parked_at) FROM {t}parked_messages WHERE consumer_group = ?"),
        }
    }
}

/// How a store writes identifiers and placeholders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Style {
    Postgres,
    Sqlite,
    MySql,
}

impl Style {
    pub(crate) fn finish(self, sql: &str) -> String {
        match self {
            Style::Postgres => numbered(sql),
            Style::Sqlite => sql.to_owned(),
            Style::MySql => {
                sql.replace(r#""offset""#, "`offset`").replace("partition,", "`partition`,").replace(" key,", " `key`,")
            }
        }
    }
}

/// Implements [`Parking`] for a store over [`Statements`] in its style; the SQL is the same for every store.
macro_rules! impl_parking {
    ($db:ty, $style:expr, $keys:ident) => {
        impl $crate::store::parking::Parking for $db {
            async fn park(
                conn: &mut <$db as sqlx::Database>::Connection,
                tables: &$crate::store::Tables,
                group: &str,
                p: &$crate::store::parking::NewParked<'_>,
            ) -> Result<bool, sqlx::Error> {
                let statements = $crate::store::parking::Statements::new(tables, $style);
                let m = p.message;
                // A redelivery of a parked event finds its row: nothing is written, the delivery is acknowledged.
                let found: i64 =
                    sqlx::query_scalar(&statements.exists).bind(group).bind(p.event_id).fetch_one(&mut *conn).await?;
                if found > 0 {
                    return Ok(false);
                }
                sqlx::query(&statements.park)
                    .bind(group)
                    .bind(p.event_id)
                    .bind(p.order_key)
                    .bind(m.topic.as_str())
                    .bind(m.partition)
                    .bind(m.offset)
                    .bind(m.key.as_deref())
                    .bind(m.payload.as_slice())
                    .bind($crate::store::encode_headers(&m.headers))
                    .bind(m.timestamp_ms)
                    .bind(p.attempts)
                    .bind(p.error)
                    .bind(p.history)
                    .bind(p.now_ms)
                    .bind(p.due_ms)
                    .execute(&mut *conn)
                    .await?;
                Ok(true)
            }

            async fn parked_keys(
                conn: &mut <$db as sqlx::Database>::Connection,
                tables: &$crate::store::Tables,
                group: &str,
                order_keys: &[Vec<u8>],
            ) -> Result<Vec<Vec<u8>>, sqlx::Error> {
                if order_keys.is_empty() {
                    return Ok(Vec::new());
                }
                let sql = $crate::store::parking::parked_keys_sql(tables, $style, order_keys.len());
                $crate::store::parking::bind_keys!($keys, sqlx::query_scalar(&sql).bind(group), order_keys)
                    .fetch_all(&mut *conn)
                    .await
            }

            async fn due_parked(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                group: &str,
                now_ms: i64,
                limit: i64,
            ) -> Result<Vec<i64>, sqlx::Error> {
                let sql = $crate::store::parking::Statements::new(tables, $style).due;
                sqlx::query_scalar(&sql).bind(group).bind(now_ms).bind(limit).fetch_all(pool).await
            }

            async fn lease_parked(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                id: i64,
                now_ms: i64,
                until_ms: i64,
                counted: bool,
            ) -> Result<Option<$crate::store::parking::ParkedMessage>, sqlx::Error> {
                let statements = $crate::store::parking::Statements::new(tables, $style);
                let lease = if counted { &statements.lease_counted } else { &statements.lease };
                let done = sqlx::query(lease).bind(until_ms).bind(id).bind(now_ms).execute(pool).await?;
                if done.rows_affected() != 1 {
                    return Ok(None);
                }
                sqlx::query_as(&statements.select_one).bind(id).fetch_optional(pool).await
            }

            async fn unpark(
                conn: &mut <$db as sqlx::Database>::Connection,
                tables: &$crate::store::Tables,
                id: i64,
            ) -> Result<bool, sqlx::Error> {
                let sql = $crate::store::parking::Statements::new(tables, $style).unpark;
                Ok(sqlx::query(&sql).bind(id).execute(&mut *conn).await?.rows_affected() == 1)
            }

            async fn record_parked_failure(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                id: i64,
                attempts: i32,
                error: &str,
                history: &str,
            ) -> Result<(), sqlx::Error> {
                let sql = $crate::store::parking::Statements::new(tables, $style).record_failure;
                sqlx::query(&sql).bind(attempts).bind(error).bind(history).bind(id).execute(pool).await?;
                Ok(())
            }

            async fn parked(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                group: Option<&str>,
                limit: i64,
            ) -> Result<Vec<$crate::store::parking::ParkedMessage>, $crate::error::Error> {
                let sql = $crate::store::parking::Statements::new(tables, $style).list;
                Ok(sqlx::query_as(&sql).bind(group).bind(group).bind(limit).fetch_all(pool).await?)
            }

            async fn parked_by_id(
                conn: &mut <$db as sqlx::Database>::Connection,
                tables: &$crate::store::Tables,
                id: i64,
            ) -> Result<Option<$crate::store::parking::ParkedMessage>, sqlx::Error> {
                let sql = $crate::store::parking::Statements::new(tables, $style).by_id;
                sqlx::query_as(&sql).bind(id).fetch_optional(&mut *conn).await
            }

            async fn retry_parked_now(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                group: Option<&str>,
                id: Option<i64>,
                now_ms: i64,
            ) -> Result<u64, sqlx::Error> {
                let sql = $crate::store::parking::Statements::new(tables, $style).retry_now;
                let done = sqlx::query(&sql)
                    .bind(now_ms)
                    .bind(group)
                    .bind(group)
                    .bind(id)
                    .bind(id)
                    .bind(now_ms)
                    .execute(pool)
                    .await?;
                Ok(done.rows_affected())
            }

            async fn parked_figures(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                group: &str,
            ) -> Result<(i64, Option<i64>), sqlx::Error> {
                let sql = $crate::store::parking::Statements::new(tables, $style).figures;
                sqlx::query_as(&sql).bind(group).fetch_one(pool).await
            }
        }
    };
}
pub(crate) use impl_parking;

/// Binds the order keys of [`Parking::parked_keys`]: one array on PostgreSQL, one placeholder each elsewhere.
macro_rules! bind_keys {
    (array, $query:expr, $keys:expr) => {
        $query.bind($keys.to_vec())
    };
    (each, $query:expr, $keys:expr) => {{
        let mut query = $query;
        for key in $keys {
            query = query.bind(key.as_slice());
        }
        query
    }};
}
pub(crate) use bind_keys;

/// [`Parking::parked_keys`]'s statement for `n` order keys: one array on PostgreSQL, a placeholder each elsewhere.
/// Rendered on its own, since it runs for every batch.
pub(crate) fn parked_keys_sql(tables: &Tables, style: Style, n: usize) -> String {
    match style {
        Style::Postgres => tables.render(
            "SELECT DISTINCT order_key FROM {t}parked_messages WHERE consumer_group = $1 AND order_key = ANY($2)",
        ),
        Style::Sqlite | Style::MySql => tables.render(&format!(
            "SELECT DISTINCT order_key FROM {{t}}parked_messages WHERE consumer_group = ? AND order_key IN {}",
            placeholders(n)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_numbered_for_postgres() {
        assert_eq!(numbered("a = ? AND b IN (?, ?)"), "a = $1 AND b IN ($2, $3)");
        assert_eq!(placeholders(0), "(?)");
        assert_eq!(placeholders(3), "(?, ?, ?)");
        let mysql = Style::MySql.finish(r#"SELECT topic, partition, "offset", key, payload"#);
        assert_eq!(mysql, "SELECT topic, `partition`, `offset`, `key`, payload");
    }
}
