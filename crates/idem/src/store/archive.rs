//! The dead-letter archive, `{prefix}dead_letter_archive`: discarded dead letters kept whole, with who discarded
//! them, when and why, until an expiry. The same statements on every store (see [`crate::dead_letter::discard`]).

use std::future::Future;

use crate::store::parking::Style;
use crate::store::{DeadLetter, Store, Tables};

/// A discarded dead letter.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ArchivedLetter {
    /// The dead letter as it was (its `id` is the dead letter's; `status` reads `archived`).
    #[serde(flatten)]
    pub letter: DeadLetter,
    /// When it was discarded, ms since the epoch.
    #[serde(rename = "discarded_at", serialize_with = "crate::store::rfc3339")]
    pub discarded_at_ms: i64,
    /// Who discarded it.
    pub discarded_by: String,
    /// Why.
    pub reason: String,
}

/// Who discards what, and why.
#[derive(Debug, Clone, Copy)]
pub struct Discard<'a> {
    /// The operator.
    pub actor: &'a str,
    /// The reason given.
    pub reason: &'a str,
    /// When, ms since the epoch.
    pub at_ms: i64,
}

/// The archive: every store idem has implements it.
pub trait Archive: Store {
    /// In one transaction, archives the dead letter as it is now and deletes it, if it is still `dead` (not under
    /// replay).
    /// `false` when there was no such row.
    fn archive_dead_letter(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        letter: &DeadLetter,
        discard: &Discard<'_>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
    /// Archives a copy of the dead letter as it is now, leaving it in place, if it is still `dead` (the original of
    /// an edited letter, kept before the edited copy is replayed). `false` when there was no such row.
    fn archive_copy(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        letter: &DeadLetter,
        discard: &Discard<'_>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
    /// The newest `limit` archived letters (of `group`, or of every group), newest first.
    fn archived_letters(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        group: Option<&str>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<ArchivedLetter>, sqlx::Error>> + Send;
    /// The archived letter that was dead letter `id`, if the archive still holds it.
    fn archived_letter(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        id: i64,
    ) -> impl Future<Output = Result<Option<ArchivedLetter>, sqlx::Error>> + Send;
    /// Counts the archived letters (of `group`, or of every group) discarded before `before_ms`: what a prune
    /// would delete.
    fn count_archive_expired(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        group: Option<&str>,
        before_ms: i64,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;
    /// Deletes at most `limit` archived letters (of `group`, or of every group) discarded before `before_ms`;
    /// how many went.
    fn prune_archive_batch(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        group: Option<&str>,
        before_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
}

/// The archive's statements in a store's style.
pub(crate) struct Statements {
    pub remove: String,
    pub insert: String,
    pub select: String,
    pub select_one: String,
    pub count_expired: String,
    pub prune: String,
}

impl Statements {
    pub(crate) fn new(tables: &Tables, style: Style) -> Statements {
        let render = |sql: &str| style.finish(&tables.render(sql));
        let text = |column: &str| match style {
            Style::MySql => format!("CAST({column} AS CHAR)"),
            Style::Postgres | Style::Sqlite => column.to_owned(),
        };
        let whose = "COALESCE(?, consumer_group) = consumer_group";
        let ms = |column: &str| match style {
            Style::Postgres => format!("(EXTRACT(EPOCH FROM {column}) * 1000)::bigint"),
            Style::Sqlite => column.to_owned(),
            Style::MySql => format!("TIMESTAMPDIFF(MICROSECOND, '1970-01-01', {column}) DIV 1000"),
        };
        let columns = format!(
            r#"SELECT dead_letter_id, {}, {}, {}, partition, "offset", key, payload, headers, error, attempts,
                 first_failed_at_ms, last_failed_at_ms, 'archived', discarded_at_ms, discarded_by, discard_reason
               FROM {{t}}dead_letter_archive"#,
            text("consumer_group"),
            text("event_id"),
            text("topic")
        );
        Statements {
            remove: render("DELETE FROM {t}dead_letters WHERE id = ? AND status = 'dead'"),
            // The row as it is now, not as the operator listed it: a redelivery may have failed it again since.
            insert: render(&format!(
                r#"INSERT INTO {{t}}dead_letter_archive (dead_letter_id, consumer_group, event_id, topic, partition,
                     "offset", key, payload, headers, error, attempts, first_failed_at_ms, last_failed_at_ms,
                     discarded_at_ms, discarded_by, discard_reason)
                   SELECT id, consumer_group, event_id, topic, partition, "offset", key, payload, headers, error,
                          attempts, {}, {}, ?, ?, ?
                     FROM {{t}}dead_letters WHERE id = ? AND status = 'dead'"#,
                ms("first_failed_at"),
                ms("last_failed_at")
            )),
            select: render(&format!("{columns} WHERE {whose} ORDER BY id DESC LIMIT ?")),
            select_one: render(&format!("{columns} WHERE dead_letter_id = ? ORDER BY id DESC LIMIT 1")),
            count_expired: render(&format!(
                "SELECT COUNT(*) FROM {{t}}dead_letter_archive WHERE {whose} AND discarded_at_ms < ?"
            )),
            prune: render(&match style {
                Style::MySql => {
                    format!(
                        "DELETE FROM {{t}}dead_letter_archive WHERE {whose} AND discarded_at_ms < ? ORDER BY id LIMIT ?"
                    )
                }
                Style::Postgres | Style::Sqlite => format!(
                    "DELETE FROM {{t}}dead_letter_archive WHERE id IN (SELECT id FROM {{t}}dead_letter_archive
                      WHERE {whose} AND discarded_at_ms < ? LIMIT ?)"
                ),
            }),
        }
    }
}

/// An archived letter from a row of any store: the dead letter's columns, then when, who and why.
impl<'r, R: sqlx::Row> sqlx::FromRow<'r, R> for ArchivedLetter
where
    DeadLetter: sqlx::FromRow<'r, R>,
    usize: sqlx::ColumnIndex<R>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        Ok(ArchivedLetter {
            letter: DeadLetter::from_row(row)?,
            discarded_at_ms: row.try_get(14)?,
            discarded_by: row.try_get(15)?,
            reason: row.try_get(16)?,
        })
    }
}

/// Implements [`Archive`] for a store in its style.
macro_rules! impl_archive {
    ($db:ty, $style:expr) => {
        impl $crate::store::archive::Archive for $db {
            async fn archive_dead_letter(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                l: &$crate::store::DeadLetter,
                d: &$crate::store::archive::Discard<'_>,
            ) -> Result<bool, sqlx::Error> {
                use sqlx::Connection;
                let statements = $crate::store::archive::Statements::new(tables, $style);
                let open = if $style == $crate::store::parking::Style::Sqlite { "BEGIN IMMEDIATE" } else { "BEGIN" };
                let mut conn = pool.acquire().await?;
                let mut tx = conn.begin_with(open).await?;
                let archived = sqlx::query(&statements.insert)
                    .bind(d.at_ms)
                    .bind(d.actor)
                    .bind(d.reason)
                    .bind(l.id)
                    .execute(&mut *tx)
                    .await?;
                if archived.rows_affected() == 0 {
                    return Ok(false);
                }
                sqlx::query(&statements.remove).bind(l.id).execute(&mut *tx).await?;
                tx.commit().await?;
                Ok(true)
            }

            async fn archived_letters(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                group: Option<&str>,
                limit: i64,
            ) -> Result<Vec<$crate::store::archive::ArchivedLetter>, sqlx::Error> {
                let statements = $crate::store::archive::Statements::new(tables, $style);
                sqlx::query_as(&statements.select).bind(group).bind(limit).fetch_all(pool).await
            }

            async fn archive_copy(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                l: &$crate::store::DeadLetter,
                d: &$crate::store::archive::Discard<'_>,
            ) -> Result<bool, sqlx::Error> {
                let statements = $crate::store::archive::Statements::new(tables, $style);
                let copied = sqlx::query(&statements.insert)
                    .bind(d.at_ms)
                    .bind(d.actor)
                    .bind(d.reason)
                    .bind(l.id)
                    .execute(pool)
                    .await?;
                Ok(copied.rows_affected() > 0)
            }

            async fn archived_letter(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                id: i64,
            ) -> Result<Option<$crate::store::archive::ArchivedLetter>, sqlx::Error> {
                let statements = $crate::store::archive::Statements::new(tables, $style);
                sqlx::query_as(&statements.select_one).bind(id).fetch_optional(pool).await
            }

            async fn count_archive_expired(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                group: Option<&str>,
                before_ms: i64,
            ) -> Result<i64, sqlx::Error> {
                let statements = $crate::store::archive::Statements::new(tables, $style);
                let (count,): (i64,) =
                    sqlx::query_as(&statements.count_expired).bind(group).bind(before_ms).fetch_one(pool).await?;
                Ok(count)
            }

            async fn prune_archive_batch(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                group: Option<&str>,
                before_ms: i64,
                limit: i64,
            ) -> Result<u64, sqlx::Error> {
                let statements = $crate::store::archive::Statements::new(tables, $style);
                let done = sqlx::query(&statements.prune).bind(group).bind(before_ms).bind(limit).execute(pool).await?;
                Ok(done.rows_affected())
            }
        }
    };
}
pub(crate) use impl_archive;
