//! The memory leg: `--memory-events` (1,000,000) events preloaded on the embedded log (4 partitions, by account,
//! not timed), consumed to the end with `batch_size` 1000 and the batch handler by `idem-bench consume` in a
//! process of its own, whose peak RSS and RSS at 25, 50, 75 and 100 % of the deliveries say whether a consumer's
//! memory stays flat as the work grows.

use super::*;
use consume::{Child, ChildRuns, consume_child};

/// The leg's name before its count of events.
pub(super) const NAME: &str = "idem memory: embedded log, batched 1000, batch handler, own process";

/// The leg's name, which `--only` matches.
pub(super) fn name(events: usize) -> String {
    format!("{NAME} ({events} events)")
}

/// Runs the leg `--runs` times over one preloaded log (a fresh group and fresh tables each time).
pub(super) async fn memory_leg(pool: &PgPool, args: &BenchArgs) -> anyhow::Result<Leg> {
    const PARTITIONS: i64 = 4;
    let work = workload(args.memory_events, args.duplicates, args.accounts, args.seed ^ 0x6d65_6d6f);
    let dir = std::env::temp_dir().join(format!("idem-bench-memory-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let log = idem::embedded::EmbeddedLog::open(&dir)?;
    log.create_topic(TOPIC, PARTITIONS as i32)?;
    let producer = log.producer();
    for chunk in work.deliveries.chunks(1_000) {
        for p in chunk {
            let partition = (p.account % PARTITIONS) as i32;
            producer.send_to(TOPIC, partition, Some(p.account.to_string().as_bytes()), payload(p).as_bytes(), &[])?;
        }
        producer.flush()?;
    }
    drop((producer, log));
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let mut runs = ChildRuns::default();
    for run in 0..args.runs {
        fresh_tables(pool, args.accounts).await?;
        let group = format!("bench-memory-{nanos}-{run}");
        runs.add(&consume_child(args, Child::Log(&dir), TOPIC, &group, work.deliveries.len(), false).await?);
        check_ledger(pool, "memory", work.expected_total, work.unique as i64).await?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(runs.leg(name(args.memory_events)))
}
