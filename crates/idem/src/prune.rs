//! Pruning markers without locks: bounded `DELETE`s of at most `batch_size` rows,
//! a pause between them, until a statement deletes nothing. Never an unbounded `DELETE`.
//!
//! The consumer runs it in the background whenever [`Pruning::retention`] is set; `idem prune` runs one pass.

use std::time::{Duration, Instant};

use crate::config::Pruning;
use crate::error::Error;
use crate::store::{Backend, Tables};

/// The shortest retention an operator's prune takes without being forced: below it, markers go while a broker can
/// still redeliver their events (`idem prune` refuses it without `--force`; the console's dry run says so).
pub const RETENTION_FLOOR: Duration = Duration::from_secs(3_600);

/// What one pruning pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PruneReport {
    /// Markers deleted.
    pub deleted: u64,
    /// Stored HTTP responses deleted with them (see [`crate::ingress`]): those older than the same retention.
    pub responses_deleted: u64,
    /// `DELETE` statements run (the last one deleted nothing).
    pub statements: u32,
    /// The longest single statement.
    pub longest_statement: Duration,
    /// Wall time of the pass, pauses included.
    pub elapsed: Duration,
}

/// Deletes the markers older than `retention` (of `group`, or of every group when `None`), in statements of at
/// most `pruning.batch_size` rows with `pruning.pause` between them, until a statement deletes nothing.
/// `progress` is called after every statement with the total deleted so far.
pub async fn prune<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    group: Option<&str>,
    retention: Duration,
    pruning: &Pruning,
    mut progress: impl FnMut(u64),
) -> Result<PruneReport, Error> {
    let started = Instant::now();
    let mut report = PruneReport::default();
    loop {
        let statement = Instant::now();
        let deleted = DB::prune_batch(pool, tables, group, retention, pruning.batch_size).await?;
        report.longest_statement = report.longest_statement.max(statement.elapsed());
        report.statements += 1;
        report.deleted += deleted;
        progress(report.deleted);
        if deleted == 0 {
            break;
        }
        tokio::time::sleep(pruning.pause).await;
    }
    // The HTTP ingress's stored responses go with their markers: a retry past the retention is a new request.
    let before_ms =
        crate::store::responses::now_ms().saturating_sub(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX));
    loop {
        let deleted = DB::prune_responses(pool, tables, group, before_ms, pruning.batch_size).await?;
        report.responses_deleted += deleted;
        if deleted == 0 {
            break;
        }
        tokio::time::sleep(pruning.pause).await;
    }
    report.elapsed = started.elapsed();
    Ok(report)
}

/// How many markers a prune with `retention` would delete (`idem prune --dry-run`).
pub async fn count_expired<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    group: Option<&str>,
    retention: Duration,
) -> Result<i64, Error> {
    DB::count_expired(pool, tables, group, retention).await
}
