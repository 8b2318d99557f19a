//! The relay: owns a share of the slots, delivers their committed messages in id order, deletes what was
//! delivered, counts and backs off what failed, and dead-letters what failed for good.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::settlement::Settlement;
use super::store::{OutboxStore, Wakeup};
use super::{Delivery, OutboxMessage};
use crate::backoff::Backoff;
use crate::error::{Error, Retry, classify};
use crate::store::Tables;

/// How often the outbox gauges are refreshed while the relay is busy (an idle relay refreshes them each poll).
const GAUGES_EVERY: Duration = Duration::from_secs(5);

/// How a relay runs.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The relay's name: its dead letters are kept under the consumer group `outbox:<name>`. Relays sharing an
    /// outbox may share a name. Default `relay`.
    pub name: String,
    /// Messages read and delivered per round. Default 500.
    pub batch_size: usize,
    /// How often an idle relay looks for work without a notification (PostgreSQL) or at all (SQLite). Default
    /// 1 s.
    pub poll_interval: Duration,
    /// Backoff after a failed delivery (per key) and after a database outage. Default 100 ms doubling to 30 s.
    pub backoff: Backoff,
    /// Failed attempts after which a message becomes a dead letter even when its failures were transient. `None`
    /// (the default): retried until delivered, as a broker that is away for a while needs.
    pub max_attempts: Option<u32>,
    /// How long a SQLite relay's lease lasts without renewal (it renews every round). Default 15 s.
    pub lease: Duration,
    /// Return once the outbox is empty (demos, tests) instead of waiting for more.
    pub stop_when_empty: bool,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            name: "relay".into(),
            batch_size: 500,
            poll_interval: Duration::from_secs(1),
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(30)),
            max_attempts: None,
            lease: Duration::from_secs(15),
            stop_when_empty: false,
        }
    }
}

impl RelayConfig {
    /// Refuses what cannot work, naming the field and the fix.
    pub fn validate(&self) -> Result<(), Error> {
        if self.name.trim().is_empty() {
            return Err(Error::Config("relay name is empty: give it a name (the dead letters' group)".into()));
        }
        if self.batch_size == 0 || self.batch_size > 10_000 {
            return Err(Error::Config(format!("relay batch_size {} is out of range: use 1 to 10000", self.batch_size)));
        }
        if self.poll_interval.is_zero() {
            return Err(Error::Config("relay poll_interval is 0: use at least a few milliseconds".into()));
        }
        self.backoff.validate("relay backoff")?;
        if self.max_attempts == Some(0) {
            return Err(Error::Config("relay max_attempts 0 would dead-letter without trying: use 1 or more".into()));
        }
        if self.lease < self.poll_interval * 3 {
            return Err(Error::Config(format!(
                "relay lease {:?} is shorter than three poll intervals ({:?}): another relay would take it over from \
                 a live one. Raise the lease or shorten the poll interval",
                self.lease, self.poll_interval
            )));
        }
        Ok(())
    }

    /// The consumer group of this relay's dead letters.
    pub fn dead_letter_group(&self) -> String {
        format!("outbox:{}", self.name)
    }
}

/// What a relay did since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RelayStats {
    /// Messages delivered and deleted.
    pub delivered: u64,
    /// Failed attempts (each retried later).
    pub failed: u64,
    /// Messages moved to the dead letters.
    pub dead_lettered: u64,
}

#[derive(Default)]
struct Counters {
    delivered: AtomicU64,
    failed: AtomicU64,
    dead_lettered: AtomicU64,
}

/// Delivers an outbox's committed messages through a [`Delivery`]. Run several, in one process or many: they
/// share the slots (see [`crate::outbox`]).
pub struct Relay<DB: OutboxStore, D: Delivery> {
    pool: sqlx::Pool<DB>,
    tables: Tables,
    config: RelayConfig,
    delivery: D,
    id: String,
    counters: Arc<Counters>,
}

/// What a running relay keeps between steps.
struct Pipeline<DB: OutboxStore> {
    /// The connection that owns the slots (PostgreSQL: the advisory locks are its session's) and reads.
    reader: Option<DB::Connection>,
    /// The connection settlements are written on, while the next batch is delivered.
    writer: Option<DB::Connection>,
    owned: Vec<i32>,
    rebalanced: Option<Instant>,
    /// Slots held back after a failure, until their backoff passes.
    held: HashMap<i32, Instant>,
    /// The last delivered batch's settlement, written during the next delivery, and the ids it deletes.
    unsettled: Option<(Settlement, Vec<i64>)>,
    /// The next batch, read during the last delivery (from the oldest message, leaving out what was in flight).
    prefetched: Option<Vec<OutboxMessage>>,
}

impl<DB: OutboxStore> Default for Pipeline<DB> {
    fn default() -> Self {
        Pipeline {
            reader: None,
            writer: None,
            owned: Vec::new(),
            rebalanced: None,
            held: HashMap::new(),
            unsettled: None,
            prefetched: None,
        }
    }
}

/// How a step of the relay ended.
enum Step {
    /// A batch was delivered.
    Worked,
    /// Nothing to deliver in the owned, not held-back slots; everything delivered is settled.
    Idle,
}

impl<DB: OutboxStore, D: Delivery> Relay<DB, D> {
    /// A relay over the outbox in `tables` on `pool`, delivering through `delivery`.
    pub fn new(pool: sqlx::Pool<DB>, tables: Tables, config: RelayConfig, delivery: D) -> Result<Self, Error> {
        config.validate()?;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let id = format!("{}-{}-{nanos}", config.name, std::process::id());
        Ok(Relay { pool, tables, config, delivery, id, counters: Arc::default() })
    }

    /// What the relay did so far.
    pub fn stats(&self) -> RelayStats {
        RelayStats {
            delivered: self.counters.delivered.load(Ordering::Relaxed),
            failed: self.counters.failed.load(Ordering::Relaxed),
            dead_lettered: self.counters.dead_lettered.load(Ordering::Relaxed),
        }
    }

    /// Relays until `shutdown` completes (or, with [`RelayConfig::stop_when_empty`], until the outbox is empty).
    /// A batch in delivery finishes first and what it delivered is deleted. A lost database connection is retried
    /// with backoff (the relay's slots go to the others meanwhile); a missing outbox table is an error.
    pub async fn run(&self, shutdown: impl Future + Send) -> Result<RelayStats, Error> {
        crate::telemetry::describe();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut wakeup = match DB::wakeup(&self.pool, &self.tables).await {
            Ok(wakeup) => wakeup,
            Err(error) => return Err(self.explain(error).await),
        };
        let mut pipeline = Pipeline::<DB>::default();
        let mut outage: u32 = 0;
        let mut gauges: Option<Instant> = None;
        tracing::info!(relay = %self.config.name, id = %self.id, "outbox relay started");
        loop {
            let wait = match self.step(&mut pipeline).await {
                Ok(Step::Worked) => {
                    outage = 0;
                    Duration::ZERO
                }
                Ok(Step::Idle) => {
                    outage = 0;
                    if self.config.stop_when_empty && self.outbox_empty().await? {
                        break;
                    }
                    gauges = None;
                    let now = Instant::now();
                    let next_held = pipeline.held.values().map(|until| until.saturating_duration_since(now)).min();
                    next_held.map_or(self.config.poll_interval, |d| d.min(self.config.poll_interval))
                }
                Err(error) if classify(&error) == Retry::Helps => {
                    // The connections (and with them the slots) are gone: start over on new ones after a backoff.
                    // What was delivered and not yet deleted is delivered again, with the same event ids.
                    pipeline = Pipeline { held: std::mem::take(&mut pipeline.held), ..Pipeline::default() };
                    outage += 1;
                    let wait = self.config.backoff.after(outage);
                    tracing::warn!(relay = %self.config.name, %error, retry_in = ?wait,
                        "outbox relay: database unavailable; its slots go to other relays meanwhile");
                    wait
                }
                Err(error) => return Err(self.explain(error.into()).await),
            };
            if gauges.is_none_or(|at| at.elapsed() >= GAUGES_EVERY) {
                if let Err(error) = self.outbox_empty().await {
                    return Err(self.explain(error).await);
                }
                gauges = Some(Instant::now());
            }
            tokio::select! {
                biased;
                _ = shutdown.as_mut() => break,
                _ = wake(&mut wakeup, wait) => {}
            }
        }
        self.stop(pipeline).await;
        tracing::info!(relay = %self.config.name, stats = ?self.stats(), "outbox relay stopped");
        Ok(self.stats())
    }

    /// One step: (re)takes the share of slots when due, reads the oldest messages of the free slots and delivers
    /// them while the last batch's settlement is written on the other connection. Reading from the oldest every
    /// time (never from a cursor) keeps each key's order even when transactions commit out of id order.
    async fn step(&self, p: &mut Pipeline<DB>) -> Result<Step, sqlx::Error> {
        if p.reader.is_none() {
            p.reader = Some(self.pool.acquire().await?.detach());
        }
        if p.writer.is_none() {
            p.writer = Some(self.pool.acquire().await?.detach());
        }
        let (Some(reader), Some(writer)) = (p.reader.as_mut(), p.writer.as_mut()) else { return Ok(Step::Idle) };
        if p.rebalanced.is_none_or(|at| at.elapsed() >= self.config.poll_interval) {
            // Slots are given back only with nothing of theirs delivered and not settled, or read ahead.
            self.settle(writer, p.unsettled.take()).await?;
            p.prefetched = None;
            let now = DB::own(reader, &self.tables, &self.id, self.config.lease).await?;
            if now != p.owned {
                tracing::info!(relay = %self.config.name, slots = now.len(), "outbox relay: slots taken");
                metrics::gauge!("idem_outbox_relay_slots", "relay" => self.config.name.clone()).set(now.len() as f64);
            }
            p.owned = now;
            p.rebalanced = Some(Instant::now());
        }
        let now = Instant::now();
        p.held.retain(|_, until| *until > now);
        let free: Vec<i32> = p.owned.iter().copied().filter(|s| !p.held.contains_key(s)).collect();
        if free.is_empty() {
            self.settle(writer, p.unsettled.take()).await?;
            return Ok(Step::Idle);
        }
        let limit = self.config.batch_size as i64;
        let mut batch: Vec<OutboxMessage> =
            p.prefetched.take().unwrap_or_default().into_iter().filter(|m| free.contains(&m.slot)).collect();
        if batch.is_empty() {
            if p.unsettled.as_ref().is_some_and(|(plan, _)| !plan.all_gone()) {
                // A failed message stays, with its attempt counted: written before it can be read again.
                self.settle(writer, p.unsettled.take()).await?;
            }
            // What the last batch delivered may not be deleted yet: it is left out.
            let gone: &[i64] = p.unsettled.as_ref().map_or(&[], |(_, gone)| gone.as_slice());
            batch = DB::fetch(reader, &self.tables, &free, gone, limit).await?;
        }
        if batch.is_empty() {
            self.settle(writer, p.unsettled.take()).await?;
            return Ok(Step::Idle);
        }
        let in_flight: Vec<i64> =
            batch.iter().map(|m| m.id).chain(p.unsettled.iter().flat_map(|(_, gone)| gone.iter().copied())).collect();
        let started = Instant::now();
        let (results, settled, next) = tokio::join!(
            self.delivery.deliver(&batch),
            self.settle(writer, p.unsettled.take()),
            DB::fetch(reader, &self.tables, &free, &in_flight, limit),
        );
        settled?;
        metrics::histogram!("idem_outbox_publish_duration_seconds", "relay" => self.config.name.clone())
            .record(started.elapsed().as_secs_f64());
        let plan = Settlement::plan(&self.config, &batch, &results, &mut p.held);
        // The next batch left this one out: after a message that stays (failed, or held behind one that did), it
        // could hold that key's later messages without it. Read again instead.
        p.prefetched = if plan.all_gone() { Some(next?) } else { None };
        let gone = plan.gone();
        p.unsettled = Some((plan, gone));
        Ok(Step::Worked)
    }

    /// Writes `settlement` (when there is one) and counts it.
    async fn settle(
        &self,
        writer: &mut DB::Connection,
        settlement: Option<(Settlement, Vec<i64>)>,
    ) -> Result<(), sqlx::Error> {
        let Some((settlement, _)) = settlement else { return Ok(()) };
        let settled = settlement.write::<DB>(writer, &self.tables, &self.config.dead_letter_group()).await?;
        self.counters.delivered.fetch_add(settled.delivered, Ordering::Relaxed);
        self.counters.failed.fetch_add(settled.failed, Ordering::Relaxed);
        self.counters.dead_lettered.fetch_add(settled.dead_lettered, Ordering::Relaxed);
        Ok(())
    }

    /// Writes what is unsettled, gives the slots back and closes the connections.
    async fn stop(&self, mut p: Pipeline<DB>) {
        if let Some(writer) = p.writer.as_mut()
            && let Err(error) = self.settle(writer, p.unsettled.take()).await
        {
            tracing::warn!(relay = %self.config.name, %error,
                "outbox relay: the last batch was delivered but not deleted; it will be delivered again");
        }
        if let Some(mut reader) = p.reader.take() {
            if let Err(error) = DB::release(&mut reader, &self.tables, &self.id).await {
                tracing::warn!(relay = %self.config.name, %error, "outbox relay: could not give its slots back; they \
                    free themselves when its connection closes (PostgreSQL) or its lease expires (SQLite)");
            }
            let _ = sqlx::Connection::close(reader).await;
        }
        if let Some(writer) = p.writer.take() {
            let _ = sqlx::Connection::close(writer).await;
        }
    }

    /// Whether the whole outbox (every relay's slots) is empty; publishes the outbox gauges on the way.
    async fn outbox_empty(&self) -> Result<bool, Error> {
        let stats = DB::outbox_stats(&self.pool, &self.tables).await?;
        let relay = self.config.name.clone();
        metrics::gauge!("idem_outbox_pending_messages", "relay" => relay.clone()).set(stats.pending as f64);
        metrics::gauge!("idem_outbox_oldest_pending_age_seconds", "relay" => relay)
            .set(stats.oldest_age_seconds.unwrap_or(0.0));
        Ok(stats.pending == 0)
    }

    /// Names the fix for what a relay cannot get past by itself: a database error where the outbox table is
    /// missing (asked of the catalog, not read from the error's text) is a schema error.
    async fn explain(&self, error: Error) -> Error {
        if !matches!(&error, Error::Database(sqlx::Error::Database(_))) {
            return error;
        }
        match DB::table_exists(&self.pool, &self.tables, "outbox").await {
            Ok(false) => Error::Schema(format!(
                "{error}: the outbox table {} is missing. Fix: run idem migrate (or idem::migrate) on this database",
                self.tables.table("outbox")
            )),
            _ => error,
        }
    }
}

/// Waits `wait`, or less when the wakeup says rows were enqueued.
async fn wake(wakeup: &mut Wakeup, wait: Duration) {
    if wait.is_zero() {
        return;
    }
    let deadline = tokio::time::Instant::now() + wait;
    match wakeup {
        Wakeup::Listener(listener) => {
            // A failed listener reconnects by itself on a later call; until the deadline, polling covers the gap.
            if let Ok(Err(_)) = tokio::time::timeout_at(deadline, listener.try_recv()).await {
                tokio::time::sleep_until(deadline).await;
            }
        }
        Wakeup::Poll => tokio::time::sleep_until(deadline).await,
    }
}
