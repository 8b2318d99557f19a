//! One failing key: the per-event workload on the embedded log over 4 partitions (by account), batched 100, where
//! the account of the first event fails retryably (a locked row) until every other partition is applied, against
//! the same run without the failure. The figure is the other partitions' rate: a partition that retries must
//! not slow the others down.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::idem_legs::Credit;
use super::*;

const PARTITIONS: i32 = 4;
const BATCH: usize = 100;

/// Credits an account; fails retryably for `account` while `failing` is set. Counts the events it applied in
/// partitions other than `held` (they never roll back: only the held partition fails).
struct LockedAccount {
    account: i64,
    held: i32,
    failing: Arc<AtomicBool>,
    others_applied: Arc<AtomicU64>,
}

impl Handler<sqlx::Postgres> for LockedAccount {
    async fn handle(&self, event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let c: Credit = event.json()?;
        if c.account == self.account && self.failing.load(Ordering::SeqCst) {
            return Err(HandlerError::retryable("canceling statement due to lock timeout (55P03)"));
        }
        sqlx::query("UPDATE bench_accounts SET balance = balance + $1 WHERE id = $2")
            .bind(c.amount)
            .bind(c.account)
            .execute(&mut *tx)
            .await?;
        if event.message.partition != self.held {
            self.others_applied.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

/// The leg's names: with the failure, and the control run.
pub(super) const FAILING: &str = "one key failing, rate of the other partitions (embedded log)";
pub(super) const CONTROL: &str = "no key failing, rate of the same partitions (embedded log)";

/// One run: the other partitions' events per second, and (for the check) the whole ledger applied at the end.
pub(super) async fn failing_key_leg(
    pool: &PgPool,
    args: &BenchArgs,
    work: &Workload,
    fail: bool,
) -> anyhow::Result<f64> {
    let tables = fresh_tables(pool, args.accounts).await?;
    let dir = std::env::temp_dir().join(format!("idem-bench-failing-{}-{fail}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let log = idem::embedded::EmbeddedLog::open(&dir)?;
    log.create_topic(TOPIC, PARTITIONS)?;
    let producer = log.producer();
    let account = work.deliveries.first().map_or(0, |p| p.account);
    let held = (account % i64::from(PARTITIONS)) as i32;
    let mut others = HashSet::new();
    let mut others_deliveries = 0u64;
    for p in &work.deliveries {
        let partition = (p.account % i64::from(PARTITIONS)) as i32;
        producer.send_to(TOPIC, partition, Some(p.account.to_string().as_bytes()), payload(p).as_bytes(), &[])?;
        if partition != held {
            others.insert(p.id.clone());
            others_deliveries += 1;
        }
    }
    producer.flush()?;
    let others_unique = others.len() as u64;

    let engine_pool = idem::postgres::connect(&args.database_url, PARTITIONS as u32 + 2).await?;
    let config = Config::new(GROUP, KeyExtractor::JsonPointer("/id".into()))
        .batch_size(BATCH)
        .tables(tables)
        .max_attempts(1_000_000)
        .backoff(Duration::from_millis(50), Duration::from_secs(1));
    let engine = Engine::new(engine_pool.clone(), config)?;
    let options = idem::embedded::ConsumerOptions { stop_at_end: true, ..Default::default() };
    let source = log.consumer(GROUP, &[TOPIC], options)?;
    let failing = Arc::new(AtomicBool::new(fail));
    let others_applied = Arc::new(AtomicU64::new(0));
    let handler =
        LockedAccount { account, held, failing: Arc::clone(&failing), others_applied: Arc::clone(&others_applied) };
    let started = Instant::now();
    let run = tokio::spawn({
        let engine = engine.clone();
        async move { engine.run(source, handler, std::future::pending::<()>()).await }
    });
    // The other partitions' events applied: the rate is taken there; then the failure clears.
    let deadline = started + Duration::from_secs(600);
    while others_applied.load(Ordering::SeqCst) < others_unique {
        if run.is_finished() || Instant::now() > deadline {
            bail!("{}: the other partitions were not applied", if fail { FAILING } else { CONTROL });
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    failing.store(false, Ordering::SeqCst);
    let stats = run.await??;
    engine_pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
    if stats.processed != work.unique {
        bail!("failing-key leg: processed {} of {} events", stats.processed, work.unique);
    }
    check_ledger(pool, "failing-key leg", work.expected_total, work.unique as i64).await?;
    Ok(others_deliveries as f64 / seconds)
}
