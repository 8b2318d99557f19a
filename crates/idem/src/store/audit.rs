//! The audit trail's table, `{prefix}audit_log`: the same statements on every store (see [`crate::audit`]).

use std::future::Future;

use crate::audit::{AuditEntry, AuditQuery};
use crate::store::parking::Style;
use crate::store::{Store, Tables};

/// The audit trail: what an operator did. Every store idem has implements it.
pub trait AuditTrail: Store {
    /// Appends one entry; its id.
    fn append_audit(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        entry: &AuditEntry,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;
    /// The newest `limit` entries `query` takes, newest first.
    fn audit_entries(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        query: &AuditQuery<'_>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<AuditEntry>, sqlx::Error>> + Send;
}

/// The two statements in a store's style: the insert (returning the new id where the database can; MySQL asks
/// `LAST_INSERT_ID()` after it, on the same connection) and the select.
pub(crate) fn statements(tables: &Tables, style: Style) -> (String, String) {
    let count = if style == Style::MySql { "`count`" } else { "count" };
    let returning = if style == Style::MySql { "" } else { " RETURNING id" };
    let insert = format!(
        "INSERT INTO {{t}}audit_log (at_ms, actor, action, subjects, {count}, outcome) VALUES (?, ?, ?, ?, ?, ?)\
         {returning}"
    );
    let select = format!(
        "SELECT id, at_ms, actor, action, subjects, {count}, outcome FROM {{t}}audit_log
          WHERE (? IS NULL OR actor = ?) AND (? IS NULL OR action = ?) AND (? IS NULL OR id < ?)
          ORDER BY id DESC LIMIT ?"
    );
    (style.finish(&tables.render(&insert)), style.finish(&tables.render(&select)))
}

/// An entry from a row of any store, columns in the field order.
impl<'r, R: sqlx::Row> sqlx::FromRow<'r, R> for AuditEntry
where
    usize: sqlx::ColumnIndex<R>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        Ok(AuditEntry {
            id: row.try_get(0)?,
            at_ms: row.try_get(1)?,
            actor: row.try_get(2)?,
            action: row.try_get(3)?,
            subjects: row.try_get(4)?,
            count: row.try_get(5)?,
            outcome: row.try_get(6)?,
        })
    }
}

/// Implements [`AuditTrail`] for a store in its style.
macro_rules! impl_audit {
    ($db:ty, $style:expr) => {
        impl $crate::store::audit::AuditTrail for $db {
            async fn append_audit(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                e: &$crate::audit::AuditEntry,
            ) -> Result<i64, sqlx::Error> {
                let (insert, _) = $crate::store::audit::statements(tables, $style);
                let mut conn = pool.acquire().await?;
                let query = sqlx::query_as::<_, (i64,)>(&insert)
                    .bind(e.at_ms)
                    .bind(e.actor.as_str())
                    .bind(e.action.as_str())
                    .bind(e.subjects.as_str())
                    .bind(e.count)
                    .bind(e.outcome.as_str());
                if $style == $crate::store::parking::Style::MySql {
                    query.fetch_optional(&mut *conn).await?;
                    let (id,): (i64,) =
                        sqlx::query_as("SELECT CAST(LAST_INSERT_ID() AS SIGNED)").fetch_one(&mut *conn).await?;
                    Ok(id)
                } else {
                    Ok(query.fetch_one(&mut *conn).await?.0)
                }
            }

            async fn audit_entries(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                query: &$crate::audit::AuditQuery<'_>,
                limit: i64,
            ) -> Result<Vec<$crate::audit::AuditEntry>, sqlx::Error> {
                let (_, select) = $crate::store::audit::statements(tables, $style);
                sqlx::query_as(&select)
                    .bind(query.actor)
                    .bind(query.actor)
                    .bind(query.action)
                    .bind(query.action)
                    .bind(query.before_id)
                    .bind(query.before_id)
                    .bind(limit)
                    .fetch_all(pool)
                    .await
            }
        }
    };
}
pub(crate) use impl_audit;
