//! One failing key: the per-event workload on the embedded log over 4 partitions (by account), batched 100, where
//! the account of the first event fails retryably (a locked row) until the events counted are applied, against
//! the same run without the failure. Without delayed retries the figure is the other partitions' rate (a
//! partition that retries must not slow the others down); with them, the other keys' rate, the failing key's own
//! partition included (its message is parked, its partition goes on).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::idem_legs::Credit;
use super::*;

const PARTITIONS: i32 = 4;
const BATCH: usize = 100;

/// What a run of the leg does and counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// The key fails, immediate retries only: its partition waits; the other partitions are counted.
    Held,
    /// No failure: the same partitions counted.
    HeldControl,
    /// The key fails, with delayed retries: it is parked; every other key is counted.
    Parked,
    /// No failure: every key but that one counted.
    ParkedControl,
}

impl Mode {
    /// The leg's name.
    pub(super) fn name(self) -> &'static str {
        match self {
            Mode::Held => FAILING,
            Mode::HeldControl => CONTROL,
            Mode::Parked => PARKED,
            Mode::ParkedControl => PARKED_CONTROL,
        }
    }

    fn fails(self) -> bool {
        matches!(self, Mode::Held | Mode::Parked)
    }

    fn by_key(self) -> bool {
        matches!(self, Mode::Parked | Mode::ParkedControl)
    }
}

/// Credits an account; fails retryably for `account` while `failing` is set. Counts the events it applied that
/// the run counts (they never roll back: only the failing account fails).
struct LockedAccount {
    account: i64,
    held: i32,
    by_key: bool,
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
        let counted = if self.by_key { c.account != self.account } else { event.message.partition != self.held };
        if counted {
            self.others_applied.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

/// The leg's names: with the failure, and the control run.
pub(super) const FAILING: &str = "one key failing, rate of the other partitions (embedded log)";
pub(super) const CONTROL: &str = "no key failing, rate of the same partitions (embedded log)";
pub(super) const PARKED: &str = "one key failing with delayed retries, rate of the other keys (embedded log)";
pub(super) const PARKED_CONTROL: &str = "no key failing, rate of the same keys (embedded log)";

/// One run: the other partitions' events per second, and (for the check) the whole ledger applied at the end.
pub(super) async fn failing_key_leg(
    pool: &PgPool,
    args: &BenchArgs,
    work: &Workload,
    mode: Mode,
) -> anyhow::Result<f64> {
    let fail = mode.fails();
    let tables = fresh_tables(pool, args.accounts).await?;
    let dir = std::env::temp_dir().join(format!("idem-bench-failing-{}-{mode:?}", std::process::id()));
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
        if (mode.by_key() && p.account != account) || (!mode.by_key() && partition != held) {
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
        .backoff(Duration::from_millis(50), Duration::from_secs(1));
    let config = if mode.by_key() {
        // Parked after three attempts; tried again every second until the failure clears.
        config.max_attempts(3).delayed_retries(idem::DelayedRetries::new(vec![Duration::from_secs(1); 600]))
    } else {
        config.max_attempts(1_000_000)
    };
    let engine = Engine::new(engine_pool.clone(), config)?;
    // With delayed retries the end of the log is not the end of the run: the parked key is released after it, by
    // a running consumer, which is stopped once everything is applied.
    let options = idem::embedded::ConsumerOptions { stop_at_end: !mode.by_key(), ..Default::default() };
    let source = log.consumer(GROUP, &[TOPIC], options)?;
    let failing = Arc::new(AtomicBool::new(fail));
    let others_applied = Arc::new(AtomicU64::new(0));
    let handler = LockedAccount {
        account,
        held,
        by_key: mode.by_key(),
        failing: Arc::clone(&failing),
        others_applied: Arc::clone(&others_applied),
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let run = tokio::spawn({
        let engine = engine.clone();
        async move { engine.run(source, handler, stop_rx).await }
    });
    // The other partitions' events applied: the rate is taken there; then the failure clears.
    let deadline = started + Duration::from_secs(600);
    while others_applied.load(Ordering::SeqCst) < others_unique {
        if run.is_finished() || Instant::now() > deadline {
            bail!("{}: the events counted were not applied", mode.name());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    failing.store(false, Ordering::SeqCst);
    // Kept until the run ends: a dropped sender would stop it.
    let mut stop = Some(stop_tx);
    if mode.by_key() {
        let engine = engine.clone();
        let wait = async move {
            while engine.stats().processed < work.unique {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(120), wait)
            .await
            .map_err(|_| anyhow::anyhow!("{}: the parked key was not released", mode.name()))?;
        if let Some(stop) = stop.take() {
            let _ = stop.send(());
        }
    }
    let stats = run.await??;
    drop(stop);
    engine_pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
    if stats.processed != work.unique {
        bail!("failing-key leg: processed {} of {} events", stats.processed, work.unique);
    }
    check_ledger(pool, "failing-key leg", work.expected_total, work.unique as i64).await?;
    Ok(others_deliveries as f64 / seconds)
}
