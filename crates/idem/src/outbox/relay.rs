//! The relay: owns a share of the slots, delivers their committed messages in id order, deletes what was
//! delivered, counts and backs off what failed, and dead-letters what failed for good.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::store::{OutboxStore, Wakeup};
use super::{Delivered, Delivery, OutboxMessage};
use crate::error::{Error, Retry, classify};
use crate::store::{NewDeadLetter, Tables};

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
    /// Backoff after a failed delivery: doubling from the first value, capped at the second. Default 100 ms to
    /// 30 s.
    pub backoff: (Duration, Duration),
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
            backoff: (Duration::from_millis(100), Duration::from_secs(30)),
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
        if self.backoff.0.is_zero() || self.backoff.0 > self.backoff.1 {
            return Err(Error::Config(format!(
                "relay backoff {:?}..{:?}: the first must be above 0 and at most the cap",
                self.backoff.0, self.backoff.1
            )));
        }
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

/// A slot held back after a failure, until `until`.
struct Held {
    until: Instant,
}

/// How a round of delivery ended.
enum Round {
    /// Messages were read (and settled as far as they went).
    Worked,
    /// Nothing to read in the owned, not held-back slots.
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
    /// A round in progress finishes first: what it delivered is deleted. A lost database connection is retried
    /// with backoff (the relay's slots go to the others meanwhile); a missing outbox table is an error.
    pub async fn run(&self, shutdown: impl Future + Send) -> Result<RelayStats, Error> {
        crate::telemetry::describe();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut wakeup = DB::wakeup(&self.pool, &self.tables).await.map_err(|e| self.explain(e))?;
        let mut conn: Option<DB::Connection> = None;
        let mut held: HashMap<i32, Held> = HashMap::new();
        let mut owned: Vec<i32> = Vec::new();
        let mut rebalanced: Option<Instant> = None;
        let mut outage: u32 = 0;
        let mut gauges: Option<Instant> = None;
        tracing::info!(relay = %self.config.name, id = %self.id, "outbox relay started");
        loop {
            let round = self.round(&mut conn, &mut owned, &mut rebalanced, &mut held).await;
            let wait = match round {
                Ok(Round::Worked) => {
                    outage = 0;
                    Duration::ZERO
                }
                Ok(Round::Idle) => {
                    outage = 0;
                    if self.config.stop_when_empty && self.outbox_empty().await? {
                        break;
                    }
                    gauges = None;
                    let next_held = held.values().map(|h| h.until.saturating_duration_since(Instant::now())).min();
                    next_held.map_or(self.config.poll_interval, |d| d.min(self.config.poll_interval))
                }
                Err(error) if classify(&error) == Retry::Helps => {
                    // The connection (and with it the slots) is gone: start over on a new one after a backoff.
                    conn = None;
                    owned.clear();
                    rebalanced = None;
                    outage += 1;
                    let wait = self.backoff(outage);
                    tracing::warn!(relay = %self.config.name, %error, retry_in = ?wait,
                        "outbox relay: database unavailable; its slots go to other relays meanwhile");
                    wait
                }
                Err(error) => return Err(self.explain(error.into())),
            };
            if gauges.is_none_or(|at| at.elapsed() >= GAUGES_EVERY) {
                self.outbox_empty().await?;
                gauges = Some(Instant::now());
            }
            tokio::select! {
                biased;
                _ = shutdown.as_mut() => break,
                _ = wake(&mut wakeup, wait) => {}
            }
        }
        if let Some(mut conn) = conn {
            if let Err(error) = DB::release(&mut conn, &self.tables, &self.id).await {
                tracing::warn!(relay = %self.config.name, %error, "outbox relay: could not give its slots back; they \
                    free themselves when its connection closes (PostgreSQL) or its lease expires (SQLite)");
            }
            let _ = sqlx::Connection::close(conn).await;
        }
        tracing::info!(relay = %self.config.name, stats = ?self.stats(), "outbox relay stopped");
        Ok(self.stats())
    }

    /// One round: (re)takes the share of slots, reads the oldest messages of the free ones, delivers them and
    /// settles the outcome in one transaction.
    async fn round(
        &self,
        conn: &mut Option<DB::Connection>,
        owned: &mut Vec<i32>,
        rebalanced: &mut Option<Instant>,
        held: &mut HashMap<i32, Held>,
    ) -> Result<Round, sqlx::Error> {
        let conn = match conn {
            Some(conn) => conn,
            None => conn.insert(self.pool.acquire().await?.detach()),
        };
        if rebalanced.is_none_or(|at| at.elapsed() >= self.config.poll_interval) {
            let now = DB::own(conn, &self.tables, &self.id, self.config.lease).await?;
            if now != *owned {
                tracing::info!(relay = %self.config.name, slots = now.len(), "outbox relay: slots taken");
                metrics::gauge!("outbox_relay_slots", "relay" => self.config.name.clone()).set(now.len() as f64);
            }
            *owned = now;
            *rebalanced = Some(Instant::now());
        }
        held.retain(|_, h| h.until > Instant::now());
        let free: Vec<i32> = owned.iter().copied().filter(|s| !held.contains_key(s)).collect();
        if free.is_empty() {
            return Ok(Round::Idle);
        }
        let messages = DB::fetch(conn, &self.tables, &free, self.config.batch_size as i64).await?;
        if messages.is_empty() {
            return Ok(Round::Idle);
        }
        let started = Instant::now();
        let results = self.delivery.deliver(&messages).await;
        metrics::histogram!("outbox_publish_duration_seconds", "relay" => self.config.name.clone())
            .record(started.elapsed().as_secs_f64());
        self.settle(conn, &messages, &results, held).await?;
        Ok(Round::Worked)
    }

    /// Deletes what was delivered, counts what failed (holding its slot back) and dead-letters what failed for
    /// good, in one transaction.
    async fn settle(
        &self,
        conn: &mut DB::Connection,
        messages: &[OutboxMessage],
        results: &[Delivered],
        held: &mut HashMap<i32, Held>,
    ) -> Result<(), sqlx::Error> {
        let group = self.config.dead_letter_group();
        let mut done: Vec<i64> = Vec::new();
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let mut dead = 0u64;
        let mut failed = 0u64;
        for (m, result) in messages.iter().zip(results) {
            match result {
                Delivered::Done => {
                    done.push(m.id);
                    metrics::histogram!("outbox_delivery_age_seconds", "destination" => m.destination.clone())
                        .record(m.age_seconds);
                    count(&m.destination, "delivered");
                }
                Delivered::Held => {}
                Delivered::Failed(error) => {
                    let attempts = u32::try_from(m.attempts).unwrap_or(0) + 1;
                    let exhausted = self.config.max_attempts.is_some_and(|max| attempts >= max);
                    if error.permanent || exhausted {
                        let reason = if error.permanent {
                            format!("delivery to {} failed for good: {}", m.destination, error.reason)
                        } else {
                            format!(
                                "delivery to {} failed {attempts} times (max_attempts), last: {}",
                                m.destination, error.reason
                            )
                        };
                        let message = m.message();
                        let letter = NewDeadLetter {
                            event_id: Some(&m.event_id),
                            message: &message,
                            error: &reason,
                            attempts: attempts as i32,
                        };
                        DB::dead_letter(&mut *tx, &self.tables, &group, &letter).await?;
                        done.push(m.id);
                        dead += 1;
                        count(&m.destination, "dead_lettered");
                        tracing::warn!(relay = %self.config.name, event_id = %m.event_id, destination = %m.destination,
                            outbox_id = m.id, reason, "outbox message dead-lettered; requeue it with idem outbox requeue");
                    } else {
                        DB::failed(&mut *tx, &self.tables, m.id, &error.reason).await?;
                        let wait = self.backoff(attempts);
                        held.insert(m.slot, Held { until: Instant::now() + wait });
                        failed += 1;
                        count(&m.destination, "failed");
                        tracing::warn!(relay = %self.config.name, event_id = %m.event_id, destination = %m.destination,
                            outbox_id = m.id, attempts, reason = %error.reason, retry_in = ?wait,
                            "outbox delivery failed; its key waits and is tried again");
                    }
                }
            }
        }
        DB::delete(&mut *tx, &self.tables, &done).await?;
        tx.commit().await?;
        let delivered = done.len() as u64 - dead;
        self.counters.delivered.fetch_add(delivered, Ordering::Relaxed);
        self.counters.failed.fetch_add(failed, Ordering::Relaxed);
        self.counters.dead_lettered.fetch_add(dead, Ordering::Relaxed);
        Ok(())
    }

    /// Whether the whole outbox (every relay's slots) is empty; publishes the outbox gauges on the way.
    async fn outbox_empty(&self) -> Result<bool, Error> {
        let stats = DB::outbox_stats(&self.pool, &self.tables).await?;
        let relay = self.config.name.clone();
        metrics::gauge!("outbox_pending_messages", "relay" => relay.clone()).set(stats.pending as f64);
        metrics::gauge!("outbox_oldest_pending_age_seconds", "relay" => relay)
            .set(stats.oldest_age_seconds.unwrap_or(0.0));
        Ok(stats.pending == 0)
    }

    fn backoff(&self, attempts: u32) -> Duration {
        let (first, cap) = self.config.backoff;
        first.saturating_mul(1u32 << attempts.saturating_sub(1).min(20)).min(cap)
    }

    /// Names the fix for what a relay cannot get past by itself.
    fn explain(&self, error: Error) -> Error {
        match &error {
            Error::Database(sqlx::Error::Database(db)) if db.message().contains("outbox") => Error::Schema(format!(
                "{error}: the outbox table is missing. Fix: run idem migrate (or idem::migrate) on this database"
            )),
            _ => error,
        }
    }
}

fn count(destination: &str, outcome: &'static str) {
    metrics::counter!("outbox_published_total", "destination" => destination.to_owned(), "outcome" => outcome)
        .increment(1);
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
