//! The two steps of a dead-letter replay that touch the database, written once for every store (see
//! [`crate::dead_letter::replay`] for the whole order: these two, and the publish between them).

use sqlx::{Connection, Pool};

use super::Tables;
use super::parking::Style;
use crate::error::Error;

/// How the first step of a replay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayStart {
    /// The row is `replaying` and its event's marker is gone: publish the copy.
    Started,
    /// No dead letter has that id any more (replayed or discarded since).
    Gone,
    /// Another replay of it began less than [`REPLAY_LEASE`] ago (another operator's, at work): nothing done.
    Busy {
        /// When that replay began, ms since the epoch.
        since_ms: i64,
    },
    /// Refused: replaying could apply the effect twice.
    Refused(ReplayRisk),
}

/// How long a replay holds its dead letter: a second replay within it is refused as another's at work
/// ([`ReplayStart::Busy`]); after it, the first is taken for cut short (its process died between its steps) and the
/// second resumes it.
pub const REPLAY_LEASE: std::time::Duration = std::time::Duration::from_secs(60);

/// Why a replay could apply an effect twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayRisk {
    /// The consumer group keeps no marker as old as the letter's last failure: the markers of its time have
    /// been pruned, so a copy the broker delivered since could have been applied and its marker pruned too.
    /// `--force` (or [`crate::dead_letter::Safety::Forced`]) replays anyway. A group on natural keys keeps no
    /// markers at all (its unique key absorbs a second copy): its replays need the force. Letters without an
    /// event id are not checked.
    MarkersPruned,
    /// The event's marker was written after the letter failed: a later copy of the event was applied. Replaying
    /// it would apply it a second time; this is refused even when forced.
    AppliedSince,
    /// The letter is an event whose id another event had used: a copy under the same id would be refused again
    /// (checked before the database, see [`crate::dead_letter::ID_REUSED_PREFIX`]); never replayed.
    IdReused,
    /// The letter is a message an outbox relay gave up on (consumer group `outbox:<relay>`): it goes back into the
    /// outbox (`idem outbox requeue`), not to a consumer.
    RelayLetter,
    /// The letter is an HTTP request and the replay an edited one: its client sends the request, so it is only
    /// replayed unedited (which releases its key, [`crate::dead_letter::Replayed::Released`]).
    HttpRequest,
}

/// First step, in one transaction: marks the row `replaying` and deletes its event's marker, unless the row is
/// already `replaying` (an earlier replay deleted that marker; any marker there now is the replayed copy's, and
/// must stay so that a second copy is absorbed). Unless `force`, a keyed letter older than every marker of its
/// group is refused ([`ReplayRisk::MarkersPruned`]); a `dead` letter whose event's marker is newer than its
/// failure is always refused ([`ReplayRisk::AppliedSince`]). A marker and its dead letter are written in one
/// transaction, the marker first, so the letter's own marker is never newer than its failure. With
/// `check_only`, the checks run and nothing changes: `Started` then says the replay would start.
pub(crate) async fn begin<DB>(
    pool: &Pool<DB>,
    tables: &Tables,
    style: Style,
    id: i64,
    force: bool,
    check_only: bool,
) -> Result<ReplayStart, Error>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    i64: sqlx::Type<DB> + for<'q> sqlx::Encode<'q, DB> + for<'r> sqlx::Decode<'r, DB>,
    String: sqlx::Type<DB> + for<'q> sqlx::Encode<'q, DB>,
    (String, Option<String>, String, Option<i64>): for<'r> sqlx::FromRow<'r, DB::Row>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let render = |sql: &str| style.finish(&tables.render(sql));
    // A check only reads: no write lock, so a dry run never holds up the consumers.
    let (open, lock) = match (style, check_only) {
        (_, true) => ("BEGIN", ""),
        (Style::Postgres | Style::MySql, false) => ("BEGIN", " FOR UPDATE"),
        (Style::Sqlite, false) => ("BEGIN IMMEDIATE", ""),
    };
    let text = |column: &str| match style {
        Style::MySql => format!("CAST({column} AS CHAR)"),
        Style::Postgres | Style::Sqlite => column.to_owned(),
    };
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin_with(open).await?;
    let row: Option<(String, Option<String>, String, Option<i64>)> = sqlx::query_as(&render(&format!(
        "SELECT {}, {}, status, replay_started_at_ms FROM {{t}}dead_letters WHERE id = ?{lock}",
        text("consumer_group"),
        text("event_id")
    )))
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((group, event_id, status, replay_started_at_ms)) = row else {
        return Ok(ReplayStart::Gone);
    };
    let now = crate::engine::now_ms();
    let lease = i64::try_from(REPLAY_LEASE.as_millis()).unwrap_or(i64::MAX);
    if let (true, Some(since_ms)) = (status == "replaying", replay_started_at_ms)
        && now.saturating_sub(since_ms) < lease
    {
        return Ok(ReplayStart::Busy { since_ms });
    }
    let count = |condition: &str| {
        render(&format!(
            "SELECT COUNT(*) FROM (SELECT 1 FROM {{t}}processed_events p, {{t}}dead_letters d
              WHERE d.id = ? AND p.consumer_group = d.consumer_group AND {condition} LIMIT 1) x"
        ))
    };
    let dead = status != "replaying";
    if dead && event_id.is_some() {
        let (applied_since,): (i64,) =
            sqlx::query_as(&count("p.event_id = d.event_id AND p.processed_at > d.last_failed_at"))
                .bind(id)
                .fetch_one(&mut *tx)
                .await?;
        if applied_since > 0 {
            return Ok(ReplayStart::Refused(ReplayRisk::AppliedSince));
        }
    }
    if !force && event_id.is_some() {
        let (kept,): (i64,) =
            sqlx::query_as(&count("p.processed_at <= d.last_failed_at")).bind(id).fetch_one(&mut *tx).await?;
        if kept == 0 {
            return Ok(ReplayStart::Refused(ReplayRisk::MarkersPruned));
        }
    }
    if check_only {
        tx.rollback().await?;
        return Ok(ReplayStart::Started);
    }
    if dead && let Some(event_id) = event_id {
        sqlx::query(&render("DELETE FROM {t}processed_events WHERE consumer_group = ? AND event_id = ?"))
            .bind(group)
            .bind(event_id)
            .execute(&mut *tx)
            .await?;
    }
    // This replay holds the letter from now (a replay cut short, resumed, takes it over).
    sqlx::query(&render("UPDATE {t}dead_letters SET status = 'replaying', replay_started_at_ms = ? WHERE id = ?"))
        .bind(now)
        .bind(id)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(ReplayStart::Started)
}

/// After a publish that failed: the row is `dead` again and no replay holds it, so the next replay starts at once
/// (the copy may still have reached the broker: its marker then absorbs the next one, which step 1 refuses as
/// applied since).
pub(crate) async fn abandon<DB>(pool: &Pool<DB>, tables: &Tables, style: Style, id: i64) -> Result<(), Error>
where
    DB: sqlx::Database,
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    i64: sqlx::Type<DB> + for<'q> sqlx::Encode<'q, DB>,
{
    let sql =
        "UPDATE {t}dead_letters SET status = 'dead', replay_started_at_ms = NULL WHERE id = ? AND status = 'replaying'";
    sqlx::query(&style.finish(&tables.render(sql))).bind(id).execute(pool).await?;
    Ok(())
}

/// Last step: deletes the row if it is still `replaying` (a new failure would have set it back to `dead`, and
/// then the row stays).
pub(crate) async fn finish<DB>(pool: &Pool<DB>, tables: &Tables, style: Style, id: i64) -> Result<(), Error>
where
    DB: sqlx::Database,
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    i64: sqlx::Type<DB> + for<'q> sqlx::Encode<'q, DB>,
{
    sqlx::query(&style.finish(&tables.render("DELETE FROM {t}dead_letters WHERE id = ? AND status = 'replaying'")))
        .bind(id)
        .execute(pool)
        .await?;
    Ok(())
}
