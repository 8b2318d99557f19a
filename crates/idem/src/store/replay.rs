//! The two steps of a dead-letter replay that touch the database, written once for every store (see
//! [`crate::dead_letter::replay`] for the whole order: these two, and the publish between them).

use sqlx::{Connection, Pool};

use super::{Store, Tables};
use crate::error::Error;

/// First step, in one transaction opened with `begin` (a store's statement for a transaction that will write):
/// marks the row `replaying` and deletes its event's marker. `false` when the row is gone.
pub(crate) async fn begin<DB>(pool: &Pool<DB>, tables: &Tables, id: i64, begin: &'static str) -> Result<bool, Error>
where
    DB: Store,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    i64: sqlx::Type<DB> + for<'q> sqlx::Encode<'q, DB>,
    String: sqlx::Type<DB> + for<'q> sqlx::Encode<'q, DB>,
    (String, Option<String>): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin_with(begin).await?;
    let row: Option<(String, Option<String>)> = sqlx::query_as(
        &tables
            .render("UPDATE {t}dead_letters SET status = 'replaying' WHERE id = $1 RETURNING consumer_group, event_id"),
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((group, event_id)) = row else {
        return Ok(false);
    };
    if let Some(event_id) = event_id {
        sqlx::query(&tables.render("DELETE FROM {t}processed_events WHERE consumer_group = $1 AND event_id = $2"))
            .bind(group)
            .bind(event_id)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(true)
}

/// Last step: deletes the row if it is still `replaying` (a new failure would have set it back to `dead`, and
/// then the row stays).
pub(crate) async fn finish<DB>(pool: &Pool<DB>, tables: &Tables, id: i64) -> Result<(), Error>
where
    DB: Store,
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    i64: sqlx::Type<DB> + for<'q> sqlx::Encode<'q, DB>,
{
    sqlx::query(&tables.render("DELETE FROM {t}dead_letters WHERE id = $1 AND status = 'replaying'"))
        .bind(id)
        .execute(pool)
        .await?;
    Ok(())
}
