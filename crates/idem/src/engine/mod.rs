//! The engine: the transaction order, written once.
//!
//! For each batch of one partition: `BEGIN` → insert the markers first (`ON CONFLICT DO NOTHING`; the row count
//! decides) → duplicates are skipped → the handler runs on the new events in the same transaction → `COMMIT` →
//! only then the broker acknowledgement. A permanent failure of one message rolls the batch back; the messages
//! before it are committed again without it, the failing message is dead-lettered (its dead-letter row written
//! in the same transaction as its marker) and the rest go on. A batch handler's failure cannot name the message
//! at fault, so that batch is re-run one message per transaction.
//!
//! [`Engine::run`] consumes a [`Source`]: one task polls it and hands each partition's messages, in order, to a
//! worker of that partition; workers of different partitions run in parallel, each on its own connection.

mod apply;
mod batch;
mod flow;
mod housekeeping;
mod outcome;
mod parked;
mod retry;
mod run;
mod transaction;
mod warm;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use sqlx::Pool;

use crate::config::Config;
use crate::error::Error;
use crate::fault::Faults;
use crate::handler::{BatchHandler, Handler};
use crate::kill_switch::Breaker;
use crate::message::Message;
use crate::source::Source;
use crate::store::Backend;
use apply::{Marked, PerBatch, PerBatchRef, PerMessage};
pub(crate) use apply::{PerMessageRef, Process};
pub use flow::Stalled;
pub use outcome::{Committed, Health, Outcome, Stats, StatsSnapshot};
pub(crate) use parked::now_ms;
pub(crate) use retry::{One, Retrying, Shutdown, retry};
pub(crate) use transaction::{End, Failure, Isolate, check_intact, commit_failed};

type CommitObserver = Arc<dyn Fn(&Committed) + Send + Sync>;

/// Consumes messages into a database with exactly-once effects. Cheap to clone; clones share counters.
pub struct Engine<DB: Backend> {
    inner: Arc<Inner<DB>>,
}

impl<DB: Backend> Clone for Engine<DB> {
    fn clone(&self) -> Self {
        Engine { inner: Arc::clone(&self.inner) }
    }
}

struct Inner<DB: Backend> {
    pool: Pool<DB>,
    config: Config,
    stats: Stats,
    running: AtomicBool,
    draining: AtomicBool,
    /// Each partition's lane: what its worker holds, its pause, its stall.
    lanes: flow::Lanes,
    /// A fault armed by [`Engine::with_faults`] (crash tests and the demo only).
    faults: std::sync::OnceLock<Faults>,
    breaker: Breaker,
    /// Shared by every clone.
    on_commit: std::sync::RwLock<Option<CommitObserver>>,
    /// When the marker table's layout was last checked against the configuration (and partitions created ahead).
    layout_checked: tokio::sync::Mutex<Option<Instant>>,
    /// Open, empty transactions waiting for the next batch while the run loop is busy.
    warm: warm::Warm<DB>,
    /// The broker of the running source, for traces (`Source::SYSTEM`).
    system: std::sync::OnceLock<&'static str>,
    /// Set by [`Engine::giving_back`]: a message whose retryable failures outlast `max_attempts` is returned as
    /// [`Error::GaveUp`] instead of dead-lettered.
    gives_back: AtomicBool,
    /// The topics whose outcome counters are registered at 0 (`telemetry::zero_outcomes`).
    topics_counted: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl<DB: Backend> Engine<DB> {
    /// An engine over `pool` (give it at least one connection per partition this process consumes); refuses an
    /// invalid configuration.
    pub fn new(pool: Pool<DB>, config: Config) -> Result<Self, Error> {
        config.validate()?;
        let breaker = Breaker::new(config.kill_switch);
        Ok(Engine {
            inner: Arc::new(Inner {
                pool,
                config,
                stats: Stats::default(),
                running: AtomicBool::new(false),
                draining: AtomicBool::new(false),
                lanes: flow::Lanes::default(),
                faults: std::sync::OnceLock::new(),
                breaker,
                on_commit: std::sync::RwLock::new(None),
                layout_checked: tokio::sync::Mutex::new(None),
                warm: warm::Warm::default(),
                system: std::sync::OnceLock::new(),
                gives_back: AtomicBool::new(false),
                topics_counted: std::sync::Mutex::new(std::collections::HashSet::new()),
            }),
        })
    }

    /// The engine of a source whose sender retries on its own (HTTP): a message whose retryable failures outlast
    /// `max_attempts` is given back as [`Error::GaveUp`], nothing of it written, instead of dead-lettered under
    /// its marker (which would answer every later retry with the dead letter). Only for one message per
    /// [`Engine::process`] call: the outcomes of a batch's earlier messages are not returned with the error.
    #[cfg(feature = "ingress")]
    pub(crate) fn giving_back(self) -> Self {
        self.inner.gives_back.store(true, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// Arms a fault (see [`crate::fault`]): the process kills itself at its point of the transaction order. Only
    /// with the `fault-injection` feature, for crash tests and the demo; the first call arms, later ones are
    /// ignored. Every clone of the engine shares it.
    #[cfg(feature = "fault-injection")]
    pub fn with_faults(self, faults: Faults) -> Self {
        let _ = self.inner.faults.set(faults);
        self
    }

    /// Calls `observer` after every `COMMIT`, before the acknowledgement (progress reporting, tests), in place of
    /// any observer set before. Every clone of the engine shares it, whenever it is set.
    pub fn on_commit(self, observer: impl Fn(&Committed) + Send + Sync + 'static) -> Self {
        let mut slot = self.inner.on_commit.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        *slot = Some(Arc::new(observer));
        drop(slot);
        self
    }

    /// The counters of this engine.
    pub fn stats(&self) -> StatsSnapshot {
        self.inner.stats.snapshot()
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The pool the engine's transactions run on.
    pub(crate) fn pool(&self) -> &Pool<DB> {
        &self.inner.pool
    }

    /// What a readiness probe needs: whether [`Engine::run`] is consuming, draining, and on how many partitions.
    pub fn health(&self) -> Health {
        Health {
            running: self.inner.running.load(Ordering::SeqCst),
            draining: self.inner.draining.load(Ordering::SeqCst),
            partitions: self.inner.lanes.count() as u64,
            paused: self.inner.breaker.open(),
            stalled: self.inner.lanes.stalled(&self.inner.config.group, self.inner.config.stall_after),
        }
    }

    /// Closes a tripped kill switch at once: the consumer tries the message that tripped it again.
    pub fn resume(&self) {
        if self.inner.breaker.open() {
            tracing::info!(consumer_group = %self.inner.config.group, "kill switch closed by request; trying again");
        }
        self.inner.breaker.resume();
    }

    /// [`Engine::resume`] on an operator's request, written to the audit trail (who, the consumer group, whether
    /// it was paused) by a task of its own, so that a slow or failing database never delays the resume. A trail
    /// that cannot be written is logged; the resume stands. Returns whether it was paused.
    pub fn resume_as(&self, actor: &str) -> bool {
        let paused = self.health().paused;
        self.resume();
        let (pool, config) = (self.inner.pool.clone(), &self.inner.config);
        let tables = config.tables.clone();
        let subjects = format!("consumer group {}", config.group);
        let outcome = if paused { "ok: resumed" } else { "ok: was not paused" };
        let entry = crate::audit::AuditEntry::now(actor, "resume", subjects, i64::from(paused), outcome);
        tokio::spawn(async move {
            if let Err(error) = crate::audit::record(&pool, &tables, &entry).await {
                tracing::warn!(%error, actor = %entry.actor, "resumed, but the audit trail could not record it (run `idem migrate`)");
            }
        });
        paused
    }

    /// How many times the kill switch tripped since the engine was built.
    pub fn kill_switch_trips(&self) -> u64 {
        self.inner.breaker.trips()
    }

    /// Checks that the database answers (`SELECT 1` on a pooled connection).
    pub async fn database_reachable(&self) -> bool {
        match self.inner.pool.acquire().await {
            Ok(mut conn) => sqlx::Connection::ping(&mut *conn).await.is_ok(),
            Err(_) => false,
        }
    }

    /// Consumes `source` with a per-message handler until the source ends, `shutdown` completes, or a
    /// non-retryable error stops it. On shutdown, in-flight batches finish and are acknowledged; messages not yet
    /// started are left unacknowledged, to be delivered again.
    pub async fn run<S: Source, H: Handler<DB>>(
        &self,
        source: S,
        handler: H,
        shutdown: impl Future + Send,
    ) -> Result<StatsSnapshot, Error> {
        self.run_with(source, Arc::new(Marked(PerMessage(handler))), shutdown).await
    }

    /// Like [`Engine::run`] with a batch handler, which receives all new events of a batch at once.
    pub async fn run_batched<S: Source, B: BatchHandler<DB>>(
        &self,
        source: S,
        handler: B,
        shutdown: impl Future + Send,
    ) -> Result<StatsSnapshot, Error> {
        self.run_with(source, Arc::new(Marked(PerBatch(handler))), shutdown).await
    }

    /// Handles `messages` (of one partition, in order) as one batch with a per-message handler, without a
    /// source: for custom loops and tests. Returns each message's outcome; nothing is acknowledged.
    pub async fn process<H: Handler<DB>>(&self, messages: Vec<Message>, handler: &H) -> Result<Vec<Outcome>, Error> {
        self.prepare_layout().await?;
        let items = self.items(messages);
        self.process_items(&items, &PerMessageRef(handler), &Shutdown::default()).await
    }

    /// Like [`Engine::process`] with a batch handler.
    pub async fn process_batched<B: BatchHandler<DB>>(
        &self,
        messages: Vec<Message>,
        handler: &B,
    ) -> Result<Vec<Outcome>, Error> {
        self.prepare_layout().await?;
        let items = self.items(messages);
        self.process_items(&items, &PerBatchRef(handler), &Shutdown::default()).await
    }
}
