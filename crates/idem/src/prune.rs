//! Pruning markers without locks: bounded `DELETE`s of at most `batch_size` rows, each sized to take about
//! [`Pruning::statement_target`], a pause between them, until a statement deletes nothing. Never an unbounded
//! `DELETE`.
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
/// most `pruning.batch_size` rows (sized to take about `pruning.statement_target`) with `pruning.pause` between
/// them, until a statement deletes nothing.
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
    let mut size = StatementSize::new(pruning);
    let mut from = None;
    loop {
        let statement = Instant::now();
        let (deleted, reached) = DB::prune_batch(pool, tables, group, retention, size.rows(), from).await?;
        from = reached.or(from);
        let took = statement.elapsed();
        size.observe(deleted, took);
        report.longest_statement = report.longest_statement.max(took);
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
    let mut size = StatementSize::new(pruning);
    loop {
        let statement = Instant::now();
        let deleted = DB::prune_responses(pool, tables, group, before_ms, size.rows()).await?;
        size.observe(deleted, statement.elapsed());
        report.responses_deleted += deleted;
        if deleted == 0 {
            break;
        }
        tokio::time::sleep(pruning.pause).await;
    }
    report.elapsed = started.elapsed();
    Ok(report)
}

/// The rows of the next `DELETE`: sized from the last statement's rows per second to take about
/// [`Pruning::statement_target`], within bounds; always `batch_size` without a target.
#[derive(Debug)]
struct StatementSize {
    rows: u32,
    smallest: u32,
    largest: u32,
    target: Option<Duration>,
}

impl StatementSize {
    /// The first statement's rows with a target: small enough to be quick on a slow server.
    const FIRST: u32 = 1_000;
    /// Fewer rows than this per statement only when `batch_size` says so.
    const SMALLEST: u32 = 100;

    fn new(pruning: &Pruning) -> Self {
        let largest = pruning.batch_size.max(1);
        let rows = if pruning.statement_target.is_some() { largest.min(Self::FIRST) } else { largest };
        StatementSize { rows, smallest: largest.min(Self::SMALLEST), largest, target: pruning.statement_target }
    }

    fn rows(&self) -> u32 {
        self.rows
    }

    /// Learns from a statement that deleted `deleted` rows in `took`.
    fn observe(&mut self, deleted: u64, took: Duration) {
        let Some(target) = self.target else { return };
        if deleted == 0 {
            return;
        }
        let per_second = deleted as f64 / took.as_secs_f64().max(1e-4);
        let ideal = per_second * target.as_secs_f64();
        let ceiling = (f64::from(self.rows) * 2.0).min(f64::from(self.largest));
        // Within [smallest, largest]: `smallest` ≤ `largest` by construction, and the float is finite.
        self.rows = ideal.round().clamp(f64::from(self.smallest), ceiling.max(f64::from(self.smallest))) as u32;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn pruning(batch_size: u32, target_ms: Option<u64>) -> Pruning {
        Pruning { batch_size, statement_target: target_ms.map(Duration::from_millis), ..Pruning::default() }
    }

    #[test]
    fn without_a_target_every_statement_takes_the_batch_size() {
        let mut size = StatementSize::new(&pruning(10_000, None));
        assert_eq!(size.rows(), 10_000);
        size.observe(10_000, Duration::from_secs(3));
        assert_eq!(size.rows(), 10_000);
    }

    #[test]
    fn fast_statements_grow_at_most_twofold_up_to_the_batch_size() {
        let mut size = StatementSize::new(&pruning(10_000, Some(100)));
        assert_eq!(size.rows(), 1_000);
        let mut seen = Vec::new();
        for _ in 0..6 {
            // 100,000 rows per second: 10,000 rows would take the 100 ms target.
            let took = Duration::from_secs_f64(f64::from(size.rows()) / 100_000.0);
            size.observe(u64::from(size.rows()), took);
            seen.push(size.rows());
        }
        assert_eq!(seen, [2_000, 4_000, 8_000, 10_000, 10_000, 10_000]);
    }

    #[test]
    fn a_slow_statement_shrinks_the_next_to_the_target_but_not_below_the_floor() {
        let mut size = StatementSize::new(&pruning(10_000, Some(100)));
        size.observe(1_000, Duration::from_millis(400));
        assert_eq!(size.rows(), 250, "2,500 rows per second for 100 ms");
        size.observe(250, Duration::from_secs(10));
        assert_eq!(size.rows(), 100);
        let mut small = StatementSize::new(&pruning(10, Some(100)));
        assert_eq!(small.rows(), 10);
        small.observe(10, Duration::from_secs(1));
        assert_eq!(small.rows(), 10, "never above the batch size, which is below the floor here");
    }

    #[test]
    fn a_statement_that_deleted_nothing_teaches_nothing() {
        let mut size = StatementSize::new(&pruning(10_000, Some(100)));
        size.observe(0, Duration::from_micros(10));
        assert_eq!(size.rows(), 1_000);
    }
}
