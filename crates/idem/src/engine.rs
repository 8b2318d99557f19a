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

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use sqlx::{Connection, Pool};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::config::IdReusePolicy;
use crate::error::{Error, HandlerError, Retry, classify};
use crate::fault::{FaultPoint, Faults};
use crate::handler::{BatchHandler, Handler};
use crate::key::MissingKey;
use crate::kill_switch::{Breaker, Verdict};
use crate::message::{Event, Message};
use crate::source::{Partition, Received, Source};
use crate::store::{Backend, Claim, NewDeadLetter};

/// What became of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// New: the marker was inserted and the handler's effects committed with it.
    Processed,
    /// Already handled: the marker existed, nothing was applied.
    Duplicate,
    /// Failed permanently (or ran out of retries): stored in the dead-letter table with its marker.
    DeadLettered,
    /// The id was already used by an event with a different payload: the producer reused it. Not applied;
    /// logged at WARN with both positions, and dead-lettered too under [`IdReusePolicy::DeadLetter`].
    IdReused,
}

impl Outcome {
    /// The label used in logs and metrics: `processed`, `duplicate`, `dead_lettered`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Processed => "processed",
            Outcome::Duplicate => "duplicate",
            Outcome::DeadLettered => "dead_lettered",
            Outcome::IdReused => "id_reused",
        }
    }
}

/// Counters of what the engine did since it was built. `retried` counts attempts that were rolled back and
/// run again (the `retried` outcome); the others count messages.
#[derive(Debug, Default)]
pub struct Stats {
    processed: AtomicU64,
    duplicate: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    id_reused: AtomicU64,
    lost: AtomicU64,
}

/// A copy of [`Stats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StatsSnapshot {
    /// Messages processed.
    pub processed: u64,
    /// Duplicates skipped.
    pub duplicate: u64,
    /// Attempts rolled back and retried.
    pub retried: u64,
    /// Messages dead-lettered.
    pub dead_lettered: u64,
    /// Events whose id had been used by another payload.
    pub id_reused: u64,
    /// Events never delivered, from holes in producer sequence numbers (see [`crate::gap`]).
    pub lost: u64,
}

impl Stats {
    /// Reads the counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            processed: self.processed.load(Ordering::Relaxed),
            duplicate: self.duplicate.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            id_reused: self.id_reused.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
        }
    }

    fn count(&self, outcome: Outcome) {
        let counter = match outcome {
            Outcome::Processed => &self.processed,
            Outcome::Duplicate => &self.duplicate,
            Outcome::DeadLettered => &self.dead_lettered,
            Outcome::IdReused => &self.id_reused,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// The engine's state for health checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Health {
    /// [`Engine::run`] is consuming.
    pub running: bool,
    /// A shutdown or the end of the source is draining the in-flight batches.
    pub draining: bool,
    /// Partitions with a worker (partitions that delivered messages and were not revoked).
    pub partitions: u64,
    /// The kill switch tripped: the consumer holds, taking no new work (see [`crate::kill_switch`]).
    pub paused: bool,
}

impl Health {
    /// Ready to take work: running, not draining. (Partitions appear with the first message.)
    pub fn ready(&self) -> bool {
        self.running && !self.draining && !self.paused
    }
}

/// What one committed transaction did; given to the commit observer after `COMMIT`, before acknowledgement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Committed {
    /// Messages whose effects committed.
    pub processed: u64,
    /// Duplicates skipped.
    pub duplicate: u64,
    /// Messages dead-lettered.
    pub dead_lettered: u64,
    /// Events whose id had been used by another payload.
    pub id_reused: u64,
}

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
    partitions: AtomicU64,
    faults: Faults,
    breaker: Breaker,
    on_commit: Option<CommitObserver>,
    /// When the marker table's layout was last checked against the configuration (and partitions created ahead).
    layout_checked: tokio::sync::Mutex<Option<Instant>>,
}

/// An unsequenced unit of work: a message with its key, or a message that has none.
pub(crate) enum Item {
    Keyed(Event),
    Unkeyed { message: Message, reason: MissingKey },
}

impl Item {
    fn message(&self) -> &Message {
        match self {
            Item::Keyed(e) => &e.message,
            Item::Unkeyed { message, .. } => message,
        }
    }
}

/// Why one attempt at a transaction did not commit.
enum Failure {
    /// The handler failed; `at` is the index of the item at fault when it is known.
    Handler { at: Option<usize>, error: HandlerError },
    /// idem's own statement failed.
    Database(sqlx::Error),
}

/// Work left in a batch, in order.
enum Step {
    Range(Range<usize>),
    DeadLetter { index: usize, reason: String, attempts: u32 },
}

/// The two kinds of user code behind one interface.
pub(crate) trait Apply<DB: Backend>: Send + Sync {
    /// Applies `fresh` (the new events, in order); on failure, the index into `fresh` when it is known.
    fn apply(
        &self,
        fresh: &[&Event],
        tx: &mut DB::Connection,
    ) -> impl Future<Output = Result<(), (Option<usize>, HandlerError)>> + Send;
}

/// What a partition worker does with one batch of its partition's messages, in order; the engine's marker path
/// and the Sequential Inbox are the two implementations. `Err(Error::Stopped)` leaves the batch unacknowledged.
pub(crate) trait Process<DB: Backend>: Send + Sync + 'static {
    /// Handles `batch` to the end (committed or dead-lettered), so that it can be acknowledged.
    fn process(
        &self,
        engine: &Engine<DB>,
        batch: Vec<Message>,
        stop: &AtomicBool,
    ) -> impl Future<Output = Result<(), Error>> + Send;
}

/// The marker path: every message of the batch through [`Engine::process_items`].
struct Marked<A>(A);

impl<DB: Backend, A: Apply<DB> + 'static> Process<DB> for Marked<A> {
    async fn process(&self, engine: &Engine<DB>, batch: Vec<Message>, stop: &AtomicBool) -> Result<(), Error> {
        let items = engine.items(batch);
        engine.process_items(&items, &self.0, stop).await.map(drop)
    }
}

struct PerMessage<H>(H);
struct PerBatch<B>(B);
pub(crate) struct PerMessageRef<'h, H>(pub(crate) &'h H);
struct PerBatchRef<'h, B>(&'h B);

async fn apply_each<DB: Backend, H: Handler<DB>>(
    handler: &H,
    fresh: &[&Event],
    tx: &mut DB::Connection,
) -> Result<(), (Option<usize>, HandlerError)> {
    for (i, event) in fresh.iter().enumerate() {
        handler.handle(event, tx).await.map_err(|e| (Some(i), e))?;
    }
    Ok(())
}

async fn apply_all<DB: Backend, B: BatchHandler<DB>>(
    handler: &B,
    fresh: &[&Event],
    tx: &mut DB::Connection,
) -> Result<(), (Option<usize>, HandlerError)> {
    if fresh.is_empty() {
        return Ok(());
    }
    let at = (fresh.len() == 1).then_some(0);
    handler.handle_batch(fresh, tx).await.map_err(|e| (at, e))
}

impl<DB: Backend, H: Handler<DB>> Apply<DB> for PerMessage<H> {
    async fn apply(&self, fresh: &[&Event], tx: &mut DB::Connection) -> Result<(), (Option<usize>, HandlerError)> {
        apply_each(&self.0, fresh, tx).await
    }
}

impl<DB: Backend, H: Handler<DB>> Apply<DB> for PerMessageRef<'_, H> {
    async fn apply(&self, fresh: &[&Event], tx: &mut DB::Connection) -> Result<(), (Option<usize>, HandlerError)> {
        apply_each(self.0, fresh, tx).await
    }
}

impl<DB: Backend, B: BatchHandler<DB>> Apply<DB> for PerBatch<B> {
    async fn apply(&self, fresh: &[&Event], tx: &mut DB::Connection) -> Result<(), (Option<usize>, HandlerError)> {
        apply_all(&self.0, fresh, tx).await
    }
}

impl<DB: Backend, B: BatchHandler<DB>> Apply<DB> for PerBatchRef<'_, B> {
    async fn apply(&self, fresh: &[&Event], tx: &mut DB::Connection) -> Result<(), (Option<usize>, HandlerError)> {
        apply_all(self.0, fresh, tx).await
    }
}

impl<DB: Backend> Engine<DB> {
    /// An engine over `pool` (give it at least one connection per partition this process consumes). Reads the
    /// fault-injection switch `IDEM_FAULT` (see [`crate::fault`]); refuses an invalid configuration.
    pub fn new(pool: Pool<DB>, config: Config) -> Result<Self, Error> {
        config.validate()?;
        let faults = Faults::from_env()?;
        let breaker = Breaker::new(config.kill_switch);
        Ok(Engine {
            inner: Arc::new(Inner {
                pool,
                config,
                stats: Stats::default(),
                running: AtomicBool::new(false),
                draining: AtomicBool::new(false),
                partitions: AtomicU64::new(0),
                faults,
                breaker,
                on_commit: None,
                layout_checked: tokio::sync::Mutex::new(None),
            }),
        })
    }

    /// Calls `observer` after every `COMMIT`, before the acknowledgement (progress reporting, tests).
    /// Must be set before the engine is cloned or run.
    pub fn on_commit(mut self, observer: impl Fn(&Committed) + Send + Sync + 'static) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.on_commit = Some(Arc::new(observer));
        }
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

    /// The fault injection armed at start-up (`IDEM_FAULT`).
    pub(crate) fn faults(&self) -> &Faults {
        &self.inner.faults
    }

    /// What a readiness probe needs: whether [`Engine::run`] is consuming, draining, and on how many partitions.
    pub fn health(&self) -> Health {
        Health {
            running: self.inner.running.load(Ordering::SeqCst),
            draining: self.inner.draining.load(Ordering::SeqCst),
            partitions: self.inner.partitions.load(Ordering::SeqCst),
            paused: self.inner.breaker.open(),
        }
    }

    /// Closes a tripped kill switch at once: the consumer tries the message that tripped it again.
    pub fn resume(&self) {
        if self.inner.breaker.open() {
            tracing::info!(consumer_group = %self.inner.config.group, "kill switch closed by request; trying again");
        }
        self.inner.breaker.resume();
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
        self.process_items(&items, &PerMessageRef(handler), &AtomicBool::new(false)).await
    }

    /// Like [`Engine::process`] with a batch handler.
    pub async fn process_batched<B: BatchHandler<DB>>(
        &self,
        messages: Vec<Message>,
        handler: &B,
    ) -> Result<Vec<Outcome>, Error> {
        self.prepare_layout().await?;
        let items = self.items(messages);
        self.process_items(&items, &PerBatchRef(handler), &AtomicBool::new(false)).await
    }

    pub(crate) async fn run_with<S: Source, P: Process<DB>>(
        &self,
        source: S,
        apply: Arc<P>,
        shutdown: impl Future + Send,
    ) -> Result<StatsSnapshot, Error> {
        self.prepare_layout().await?;
        let source = Arc::new(source);
        let _housekeeping = AbortOnDrop(tokio::spawn(self.clone().housekeeping()));
        self.inner.draining.store(false, Ordering::SeqCst);
        self.inner.running.store(true, Ordering::SeqCst);
        let (fatal_tx, mut fatal_rx) = mpsc::unbounded_channel::<Error>();
        let mut workers: HashMap<Partition, Worker> = HashMap::new();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut source_failures = 0u32;
        let stop_reason: Result<(), Error> = 'poll: loop {
            tokio::select! {
                biased;
                error = fatal_rx.recv() => {
                    if let Some(error) = error { break Err(error); }
                }
                _ = &mut shutdown => {
                    tracing::info!(group = %self.inner.config.group, "shutdown requested: draining in-flight batches");
                    for worker in workers.values() { worker.stopping.store(true, Ordering::SeqCst); }
                    break Ok(());
                }
                received = source.recv() => match received {
                    Ok(Some(Received::Message(message))) => {
                        source_failures = 0;
                        let key = Partition { topic: message.topic.clone(), partition: message.partition };
                        if !workers.contains_key(&key) {
                            let worker = self.spawn_worker(key.clone(), Arc::clone(&source), Arc::clone(&apply), fatal_tx.clone());
                            workers.insert(key.clone(), worker);
                            self.inner.partitions.store(workers.len() as u64, Ordering::SeqCst);
                        }
                        let Some(worker) = workers.get(&key) else { continue };
                        tokio::select! {
                            sent = worker.queue.send(message) => {
                                if sent.is_err() {
                                    // The worker is gone: its error is on its way through fatal_rx.
                                    continue;
                                }
                            }
                            error = fatal_rx.recv() => {
                                if let Some(error) = error { break 'poll Err(error); }
                            }
                            _ = &mut shutdown => {
                                tracing::info!(group = %self.inner.config.group, "shutdown requested while a partition was full: draining");
                                for worker in workers.values() { worker.stopping.store(true, Ordering::SeqCst); }
                                break 'poll Ok(());
                            }
                        }
                    }
                    Ok(Some(Received::Revoked { partitions, drained })) => {
                        for partition in &partitions {
                            if let Some(worker) = workers.remove(partition) {
                                worker.stopping.store(true, Ordering::SeqCst);
                                if let Err(error) = worker.finish().await {
                                    break 'poll Err(error);
                                }
                            }
                        }
                        self.inner.partitions.store(workers.len() as u64, Ordering::SeqCst);
                        tracing::info!(?partitions, "revoked partitions drained");
                        drained.done();
                    }
                    Ok(None) => break Ok(()),
                    Err(error) if error.retry() == Retry::Helps => {
                        source_failures += 1;
                        let delay = self.inner.config.backoff_for(source_failures);
                        tracing::warn!(%error, ?delay, "source failed; retrying");
                        tokio::time::sleep(delay).await;
                    }
                    Err(error) => break Err(error.into()),
                },
            }
        };
        self.inner.draining.store(true, Ordering::SeqCst);
        let mut first_error = stop_reason.err();
        for (_, worker) in workers.drain() {
            if let Err(error) = worker.finish().await {
                first_error.get_or_insert(error);
            }
        }
        while let Ok(error) = fatal_rx.try_recv() {
            first_error.get_or_insert(error);
        }
        self.inner.partitions.store(0, Ordering::SeqCst);
        self.inner.running.store(false, Ordering::SeqCst);
        match first_error {
            Some(error) => Err(error),
            None => Ok(self.stats()),
        }
    }
}

/// One partition's worker: a queue in, a task that handles batches in order.
struct Worker {
    queue: mpsc::Sender<Message>,
    stopping: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Worker {
    /// Closes the queue and waits for the task: the in-flight batch finishes and is acknowledged. A worker's
    /// own errors reach the engine through its fatal channel; only a panic is returned here.
    async fn finish(self) -> Result<(), Error> {
        drop(self.queue);
        self.task.await.map_err(|join| {
            Error::Config(format!("a partition worker panicked (a bug in a handler or in idem): {join}"))
        })
    }
}

impl<DB: Backend> Engine<DB> {
    fn spawn_worker<S: Source, P: Process<DB>>(
        &self,
        partition: Partition,
        source: Arc<S>,
        apply: Arc<P>,
        fatal: mpsc::UnboundedSender<Error>,
    ) -> Worker {
        let batch_size = self.inner.config.batch_size;
        // Room for a burst of one partition while the poller feeds the others (at least 256 messages).
        let (queue, mut inbox) = mpsc::channel::<Message>((batch_size * 2).max(256));
        let stopping = Arc::new(AtomicBool::new(false));
        let engine = self.clone();
        let stop = Arc::clone(&stopping);
        let task = tokio::spawn(async move {
            let mut guard = PanicGuard { fatal: Some(fatal.clone()), partition: partition.clone() };
            let mut gaps = crate::gap::SequenceGaps::default();
            tracing::debug!(topic = %partition.topic, partition = partition.partition, "partition worker started");
            while let Some(first) = inbox.recv().await {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let mut batch = Vec::with_capacity(batch_size);
                batch.push(first);
                while batch.len() < batch_size {
                    match inbox.try_recv() {
                        Ok(message) => batch.push(message),
                        Err(_) => break,
                    }
                }
                let last = batch.last().map(|m| m.offset).unwrap_or_default();
                engine.detect_gaps(&mut gaps, &batch);
                match apply.process(&engine, batch, &stop).await {
                    Ok(_) => {}
                    Err(Error::Stopped) => break,
                    Err(error) => {
                        tracing::error!(%error, topic = %partition.topic, partition = partition.partition, "partition worker stopped");
                        let _ = fatal.send(error);
                        guard.fatal = None;
                        return;
                    }
                }
                let committed = Instant::now();
                engine.ack(source.as_ref(), &partition, last).await;
                metrics::gauge!("consumer_offset_commit_lag_seconds", "consumer_group" => engine.inner.config.group.clone(),
                    "topic" => partition.topic.clone(), "partition" => partition.partition.to_string())
                .set(committed.elapsed().as_secs_f64());
            }
            guard.fatal = None;
        });
        Worker { queue, stopping, task }
    }

    /// Counts events that producer sequence numbers show were never delivered.
    fn detect_gaps(&self, gaps: &mut crate::gap::SequenceGaps, batch: &[Message]) {
        for message in batch {
            let lost = gaps.observe(message);
            if lost > 0 {
                self.inner.stats.lost.fetch_add(lost, Ordering::Relaxed);
                metrics::counter!("events_lost_total", "consumer_group" => self.inner.config.group.clone(),
                    "topic" => message.topic.clone())
                .increment(lost);
                tracing::warn!(consumer_group = %self.inner.config.group, topic = %message.topic,
                    partition = message.partition, offset = message.offset, lost,
                    "producer sequence jumped: events were lost before this one");
            }
        }
    }

    /// Acknowledges after commit. A failed acknowledgement loses nothing: the messages come again and are
    /// absorbed as duplicates (a fenced consumer's late commit fails this way), so it is logged, not fatal.
    async fn ack<S: Source>(&self, source: &S, partition: &Partition, offset: i64) {
        if let Err(error) = source.ack(&partition.topic, partition.partition, offset).await {
            tracing::warn!(%error, topic = %partition.topic, partition = partition.partition, offset,
                "acknowledgement failed; the batch will be delivered again and absorbed as duplicates");
        }
    }

    pub(crate) fn items(&self, messages: Vec<Message>) -> Vec<Item> {
        let key = &self.inner.config.key;
        messages
            .into_iter()
            .map(|message| match key.extract(&message) {
                Ok(id) => Item::Keyed(Event { id, message }),
                Err(reason) => Item::Unkeyed { message, reason },
            })
            .collect()
    }

    /// Handles `items` in order: commits as much of them together as possible, dead-letters the failures.
    pub(crate) async fn process_items<A: Apply<DB>>(
        &self,
        items: &[Item],
        apply: &A,
        stop: &AtomicBool,
    ) -> Result<Vec<Outcome>, Error> {
        let mut outcomes = Vec::with_capacity(items.len());
        let mut steps = VecDeque::from([Step::Range(0..items.len())]);
        while let Some(step) = steps.pop_front() {
            match step {
                Step::DeadLetter { index, reason, attempts } => match self.inner.breaker.failed(&reason) {
                    (Verdict::DeadLetter, _) => {
                        outcomes.push(self.dead_letter(&items[index], &reason, attempts, stop).await?);
                    }
                    (Verdict::Hold, tripped) => {
                        if tripped {
                            self.tripped(&reason);
                        }
                        steps.push_front(Step::Range(index..index + 1));
                    }
                },
                Step::Range(range) if range.is_empty() => {}
                Step::Range(range) => {
                    match self.hold_while_tripped(stop).await?.attempt(&items[range.clone()], apply, stop).await? {
                        Ok(done) => {
                            if done.contains(&Outcome::Processed) {
                                self.inner.breaker.succeeded();
                            }
                            outcomes.extend(done)
                        }
                        Err((Some(at), reason, attempts)) => {
                            // Commit what precedes the failing message, dead-letter it, then go on after it.
                            let index = range.start + at;
                            steps.push_front(Step::Range(index + 1..range.end));
                            steps.push_front(Step::DeadLetter { index, reason, attempts });
                            steps.push_front(Step::Range(range.start..index));
                        }
                        Err((None, reason, attempts)) if range.len() == 1 => {
                            steps.push_front(Step::DeadLetter { index: range.start, reason, attempts });
                        }
                        Err((None, _, _)) => {
                            // The failure cannot be pinned on one message: one message per transaction finds it.
                            for index in range.rev() {
                                steps.push_front(Step::Range(index..index + 1));
                            }
                        }
                    }
                }
            }
        }
        Ok(outcomes)
    }

    /// Logs and publishes a trip of the kill switch.
    fn tripped(&self, reason: &str) {
        let config = &self.inner.config;
        let group = &config.group;
        metrics::gauge!("consumer_paused", "consumer_group" => group.clone()).set(1.0);
        metrics::counter!("kill_switch_trips_total", "consumer_group" => group.clone()).increment(1);
        tracing::error!(
            consumer_group = %group,
            reason,
            in_a_row = config.kill_switch.threshold,
            pause = ?config.kill_switch.pause,
            "kill switch tripped: {} messages in a row failed the same way, which is not their fault; holding every \
             partition (nothing is acknowledged) and trying again after the pause. Fix the cause, then replay the \
             messages dead-lettered before the trip: idem dead-letters replay --group {group} --matching '<part of \
             the reason>' --all (--log-dir DIR | --kafka BROKERS)",
            config.kill_switch.threshold
        );
    }

    /// Waits while the kill switch is open; `Error::Stopped` if the consumer stops meanwhile.
    async fn hold_while_tripped(&self, stop: &AtomicBool) -> Result<&Self, Error> {
        let breaker = &self.inner.breaker;
        if !breaker.open() {
            return Ok(self);
        }
        if !breaker.hold(|| stop.load(Ordering::SeqCst)).await {
            return Err(Error::Stopped);
        }
        metrics::gauge!("consumer_paused", "consumer_group" => self.inner.config.group.clone()).set(0.0);
        tracing::info!(consumer_group = %self.inner.config.group, "kill switch closed; trying again");
        Ok(self)
    }

    /// Runs one transaction over `items`, retrying what a retry can fix. `Ok(Err(..))` is a failure to isolate:
    /// the index of the message at fault when known, the reason, and the attempts made.
    async fn attempt<A: Apply<DB>>(
        &self,
        items: &[Item],
        apply: &A,
        stop: &AtomicBool,
    ) -> Result<Result<Vec<Outcome>, (Option<usize>, String, u32)>, Error> {
        let config = &self.inner.config;
        let mut attempts = 0u32;
        let mut outages = 0u32;
        loop {
            let started = Instant::now();
            attempts += 1;
            match self.transaction(items, apply).await {
                Ok(outcomes) => {
                    let topic = items.first().map_or("", |i| i.message().topic.as_str());
                    metrics::histogram!("event_handle_duration_seconds", "consumer_group" => config.group.clone(),
                        "topic" => topic.to_owned())
                    .record(started.elapsed().as_secs_f64());
                    self.log_outcomes(items, &outcomes, started);
                    return Ok(Ok(outcomes));
                }
                Err(Failure::Handler { at, error: HandlerError::Permanent(reason) }) => {
                    return Ok(Err((at, reason, attempts)));
                }
                Err(Failure::Handler { error: HandlerError::TransactionAborted(reason), .. }) => {
                    return Ok(Err((None, reason, attempts)));
                }
                Err(Failure::Handler { at, error: HandlerError::Retryable(reason) }) => {
                    if attempts >= config.max_attempts {
                        let reason = format!("gave up after {attempts} attempts: {reason}");
                        return Ok(Err((at, reason, attempts)));
                    }
                    if stop.load(Ordering::SeqCst) {
                        return Err(Error::Stopped);
                    }
                    self.count_retry(items);
                    let delay = config.backoff_for(attempts);
                    tracing::warn!(group = %config.group, reason, attempt = attempts, ?delay, "retryable handler error; retrying the batch");
                    tokio::time::sleep(delay).await;
                }
                Err(Failure::Database(error)) if classify(&error) == Retry::Helps => {
                    attempts -= 1;
                    outages += 1;
                    if stop.load(Ordering::SeqCst) {
                        return Err(Error::Stopped);
                    }
                    self.count_retry(items);
                    let delay = config.backoff_for(outages);
                    if matches!(error, sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut) {
                        tracing::warn!(group = %config.group, %error, ?delay, outages, "database unreachable; retrying the batch");
                    } else {
                        tracing::warn!(group = %config.group, %error, ?delay, "transient database error; retrying the batch");
                    }
                    tokio::time::sleep(delay).await;
                }
                Err(Failure::Database(error)) => return Err(error.into()),
            }
        }
    }

    /// `BEGIN` → markers → handler on the new events → `COMMIT`; the whole transaction order.
    async fn transaction<A: Apply<DB>>(&self, items: &[Item], apply: &A) -> Result<Vec<Outcome>, Failure> {
        let inner = &self.inner;
        let config = &inner.config;
        let mut conn = crate::store::connect::connection(&inner.pool).await.map_err(Failure::Database)?;
        let mut tx = conn.begin().await.map_err(Failure::Database)?;

        // 1. The markers, first statement of the transaction. An id seen twice in one batch is claimed once.
        let mut first_of: HashMap<&str, &Event> = HashMap::with_capacity(items.len());
        let mut claimed: Vec<(usize, &Event)> = Vec::with_capacity(items.len());
        let mut reused_in_batch: Vec<(usize, &Event, String)> = Vec::new();
        for (index, item) in items.iter().enumerate() {
            let Item::Keyed(event) = item else { continue };
            if replayed_for_another_group(&event.message, &config.group) {
                continue;
            }
            match first_of.get(event.id.as_str()) {
                None => {
                    first_of.insert(event.id.as_str(), event);
                    claimed.push((index, event));
                }
                Some(first) if first.message.payload != event.message.payload => {
                    let m = &first.message;
                    reused_in_batch.push((index, event, format!("{}/{}/{}", m.topic, m.partition, m.offset)));
                }
                Some(_) => {}
            }
        }
        let mut outcomes = vec![Outcome::Duplicate; items.len()];
        let mut fresh: Vec<&Event> = Vec::with_capacity(claimed.len());
        let mut fresh_at: Vec<usize> = Vec::with_capacity(claimed.len());
        if !claimed.is_empty() {
            // In one order for every transaction (by id), so two batches holding common events wait on each other
            // at most one way round: concurrent duplicates across partitions never deadlock on their markers.
            // The handler still sees the new events in delivery order.
            let mut by_id: Vec<usize> = (0..claimed.len()).collect();
            by_id.sort_unstable_by(|&a, &b| claimed[a].1.id.cmp(&claimed[b].1.id));
            let events: Vec<&Event> = by_id.iter().map(|&i| claimed[i].1).collect();
            let sorted = DB::claim(&mut tx, &config.tables, &config.layout, &config.group, &events)
                .await
                .map_err(Failure::Database)?;
            let mut claims: Vec<Option<Claim>> = (0..claimed.len()).map(|_| None).collect();
            for (i, claim) in by_id.into_iter().zip(sorted) {
                claims[i] = Some(claim);
            }
            for ((index, event), claim) in claimed.iter().zip(claims.into_iter().flatten()) {
                match claim {
                    Claim::New => {
                        outcomes[*index] = Outcome::Processed;
                        fresh.push(event);
                        fresh_at.push(*index);
                    }
                    Claim::Duplicate => {}
                    Claim::Reused { first } => {
                        outcomes[*index] = Outcome::IdReused;
                        self.id_reused(&mut tx, event, &first).await.map_err(Failure::Database)?;
                    }
                }
            }
        }

        for (index, event, first) in reused_in_batch {
            outcomes[index] = Outcome::IdReused;
            self.id_reused(&mut tx, event, &first).await.map_err(Failure::Database)?;
        }

        // 2. Messages without a key cannot be deduplicated or handled: dead letters, in this transaction.
        for (index, item) in items.iter().enumerate() {
            if let Item::Unkeyed { message, reason } = item {
                let reason = reason.to_string();
                let letter = NewDeadLetter { event_id: None, message, error: &reason, attempts: 1 };
                DB::dead_letter(&mut tx, &config.tables, &config.group, &letter).await.map_err(Failure::Database)?;
                outcomes[index] = Outcome::DeadLettered;
            }
        }

        // 3. The user's effects, in the same transaction.
        if let Err((at, error)) = apply.apply(&fresh, &mut tx).await {
            let _ = tx.rollback().await;
            return Err(Failure::Handler { at: at.map(|i| fresh_at[i]), error });
        }

        // 4. COMMIT; the acknowledgement comes after, from the caller. A handler that swallowed a database
        // error can leave the transaction aborted, where PostgreSQL answers COMMIT with a silent ROLLBACK:
        // check first, so such a batch is never reported (and acknowledged) as committed.
        if !fresh.is_empty() {
            match DB::transaction_intact(&mut tx).await {
                Ok(true) => {}
                Ok(false) => {
                    let _ = tx.rollback().await;
                    return Err(Failure::Handler { at: None, error: HandlerError::ended_transaction() });
                }
                Err(error) if classify(&error) == Retry::Helps => return Err(Failure::Database(error)),
                Err(error) => {
                    let _ = tx.rollback().await;
                    return Err(Failure::Handler { at: None, error: HandlerError::left_transaction_aborted(&error) });
                }
            }
        }
        inner.faults.reached(FaultPoint::BeforeCommit);
        if let Err(error) = tx.commit().await {
            return Err(match classify(&error) {
                Retry::Helps => Failure::Database(error),
                // A deferred constraint of the handler's writes fails at COMMIT: the handler is at fault.
                Retry::Useless if !fresh.is_empty() => {
                    Failure::Handler { at: None, error: HandlerError::Permanent(format!("commit failed: {error}")) }
                }
                Retry::Useless => Failure::Database(error),
            });
        }
        let topic = items.first().map_or("", |i| i.message().topic.as_str());
        self.committed(topic, &outcomes);
        inner.faults.reached(FaultPoint::AfterCommit);
        Ok(outcomes)
    }

    /// A reused id: logged with both positions, and dead-lettered in this transaction when the policy says so.
    async fn id_reused(&self, tx: &mut DB::Connection, event: &Event, first: &str) -> Result<(), sqlx::Error> {
        let config = &self.inner.config;
        let m = &event.message;
        tracing::warn!(event_id = %event.id, consumer_group = %config.group, topic = %m.topic, partition = m.partition,
            offset = m.offset, first_seen_at = first, outcome = Outcome::IdReused.as_str(),
            "event id reused for a different payload; not applied");
        if config.id_reuse == IdReusePolicy::DeadLetter {
            // Stored by position, not under the event id, which belongs to the first event (and may have its
            // own dead letter).
            let reason = format!(
                "{} event id {} was already used by a different payload (first seen at {first}); fix the producer \
                 and publish this event under a new id",
                crate::dead_letter::ID_REUSED_PREFIX,
                event.id
            );
            let letter = NewDeadLetter { event_id: None, message: m, error: &reason, attempts: 1 };
            DB::dead_letter(tx, &config.tables, &config.group, &letter).await?;
        }
        Ok(())
    }

    /// Writes the dead letter of one message in the same transaction as its marker.
    async fn dead_letter(&self, item: &Item, reason: &str, attempts: u32, stop: &AtomicBool) -> Result<Outcome, Error> {
        let config = &self.inner.config;
        let mut outages = 0u32;
        loop {
            match self.dead_letter_once(item, reason, attempts).await {
                Ok(outcome) => {
                    let m = item.message();
                    if outcome == Outcome::DeadLettered {
                        tracing::warn!(group = %config.group, topic = %m.topic, partition = m.partition, offset = m.offset,
                            event_id = ?key_of(item), reason, outcome = outcome.as_str(), "dead-lettered");
                    }
                    return Ok(outcome);
                }
                Err(_) if stop.load(Ordering::SeqCst) => return Err(Error::Stopped),
                Err(error) if classify(&error) == Retry::Helps => {
                    outages += 1;
                    let delay = config.backoff_for(outages);
                    tracing::warn!(%error, ?delay, "transient database error while dead-lettering; retrying");
                    tokio::time::sleep(delay).await;
                }
                Err(error) => return Err(error.into()),
            }
        }
    }

    async fn dead_letter_once(&self, item: &Item, reason: &str, attempts: u32) -> Result<Outcome, sqlx::Error> {
        let inner = &self.inner;
        let config = &inner.config;
        let mut conn = crate::store::connect::connection(&inner.pool).await?;
        let mut tx = conn.begin().await?;
        if let Item::Keyed(event) = item {
            let claims = DB::claim(&mut tx, &config.tables, &config.layout, &config.group, &[event]).await?;
            if claims.first() != Some(&Claim::New) {
                // Another consumer handled it in the meantime: nothing to dead-letter.
                tx.rollback().await?;
                self.committed(&item.message().topic, &[Outcome::Duplicate]);
                return Ok(Outcome::Duplicate);
            }
        }
        let letter = NewDeadLetter {
            event_id: key_of(item),
            message: item.message(),
            error: reason,
            attempts: i32::try_from(attempts).unwrap_or(i32::MAX),
        };
        DB::dead_letter(&mut tx, &config.tables, &config.group, &letter).await?;
        inner.faults.reached(FaultPoint::BeforeCommit);
        tx.commit().await?;
        self.committed(&item.message().topic, &[Outcome::DeadLettered]);
        inner.faults.reached(FaultPoint::AfterCommit);
        Ok(Outcome::DeadLettered)
    }

    /// Counts a committed transaction's outcomes (all of one partition, so of one topic) and tells the
    /// observer.
    fn committed(&self, topic: &str, outcomes: &[Outcome]) {
        let mut report = Committed::default();
        for &outcome in outcomes {
            self.inner.stats.count(outcome);
            match outcome {
                Outcome::Processed => report.processed += 1,
                Outcome::Duplicate => report.duplicate += 1,
                Outcome::DeadLettered => report.dead_lettered += 1,
                Outcome::IdReused => report.id_reused += 1,
            }
        }
        for (outcome, n) in [
            (Outcome::Processed, report.processed),
            (Outcome::Duplicate, report.duplicate),
            (Outcome::DeadLettered, report.dead_lettered),
            (Outcome::IdReused, report.id_reused),
        ] {
            if n > 0 {
                metrics::counter!("events_handled_total", "consumer_group" => self.inner.config.group.clone(),
                    "topic" => topic.to_owned(), "outcome" => outcome.as_str())
                .increment(n);
            }
        }
        if let Some(observer) = &self.inner.on_commit {
            observer(&report);
        }
    }

    fn count_retry(&self, items: &[Item]) {
        self.inner.stats.retried.fetch_add(1, Ordering::Relaxed);
        let topic = items.first().map_or("", |i| i.message().topic.as_str());
        metrics::counter!("events_handled_total", "consumer_group" => self.inner.config.group.clone(),
            "topic" => topic.to_owned(), "outcome" => "retried")
        .increment(1);
    }

    fn log_outcomes(&self, items: &[Item], outcomes: &[Outcome], started: Instant) {
        let group = &self.inner.config.group;
        let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
        for (item, outcome) in items.iter().zip(outcomes) {
            let m = item.message();
            let event_id = key_of(item).unwrap_or("");
            match outcome {
                Outcome::Duplicate => tracing::info!(event_id, consumer_group = %group, topic = %m.topic,
                    partition = m.partition, offset = m.offset, outcome = outcome.as_str(), "duplicate skipped"),
                Outcome::DeadLettered => tracing::warn!(event_id, consumer_group = %group, topic = %m.topic,
                    partition = m.partition, offset = m.offset, outcome = outcome.as_str(), "message has no idempotency key; dead-lettered"),
                Outcome::Processed => tracing::debug!(event_id, consumer_group = %group, topic = %m.topic,
                    partition = m.partition, offset = m.offset, outcome = outcome.as_str(), batch_ms = elapsed_ms, "processed"),
                // Logged at WARN, with the first delivery's position, where it was detected.
                Outcome::IdReused => {}
            }
        }
    }
}

/// A dead-letter replay addressed to another consumer group: this group handled the original already.
fn replayed_for_another_group(message: &Message, group: &str) -> bool {
    message.header(crate::dead_letter::REPLAY_FOR_HEADER).is_some_and(|target| target != group.as_bytes())
}

fn key_of(item: &Item) -> Option<&str> {
    match item {
        Item::Keyed(event) => Some(event.id.as_str()),
        Item::Unkeyed { .. } => None,
    }
}

/// Reports a worker that unwinds (a panic in a handler) as a fatal error, so the engine stops instead of
/// silently leaving the partition without a worker.
struct PanicGuard {
    fatal: Option<mpsc::UnboundedSender<Error>>,
    partition: Partition,
}

impl Drop for PanicGuard {
    fn drop(&mut self) {
        if let Some(fatal) = self.fatal.take() {
            let p = &self.partition;
            let _ = fatal.send(Error::Worker(format!(
                "the worker of {}/{} panicked (a bug in a handler or in idem); nothing of its batch was acknowledged",
                p.topic, p.partition
            )));
        }
    }
}

/// Aborts a background task when dropped, so it ends with the engine run that started it.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<DB: Backend> Engine<DB> {
    /// The consumer's background housekeeping: the marker gauges every `stats_interval` and, when a retention
    /// is set, a pruning pass every `pruning.interval`. Failures are logged and tried again next time.
    async fn housekeeping(self) {
        let config = &self.inner.config;
        let mut stats = tokio::time::interval(config.stats_interval);
        let mut prune = tokio::time::interval(config.pruning.interval);
        stats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        prune.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stats.tick() => self.publish_marker_gauges().await,
                _ = prune.tick(), if config.pruning.retention.is_some() || self.partitioned().is_some() => {
                    self.prune_once().await
                }
            }
        }
    }

    async fn publish_marker_gauges(&self) {
        let config = &self.inner.config;
        match DB::stats(&self.inner.pool, &config.tables, Some(&config.group)).await {
            Ok(groups) => {
                let mine = groups.into_iter().find(|g| g.consumer_group == config.group);
                let (rows, oldest, dead) =
                    mine.map_or((0, None, 0), |g| (g.markers, g.oldest_marker_age_seconds, g.dead_letters));
                let group = config.group.clone();
                metrics::gauge!("processed_events_row_count", "consumer_group" => group.clone()).set(rows as f64);
                metrics::gauge!("processed_events_oldest_age_seconds", "consumer_group" => group.clone())
                    .set(oldest.unwrap_or(0.0));
                metrics::gauge!("dead_letters_stored", "consumer_group" => group).set(dead as f64);
            }
            Err(error) => tracing::warn!(%error, "reading marker statistics failed"),
        }
    }

    fn partitioned(&self) -> Option<&crate::config::Partitioning> {
        match &self.inner.config.layout {
            crate::config::MarkerLayout::Partitioned(p) => Some(p),
            crate::config::MarkerLayout::Plain => None,
        }
    }

    /// Checks the marker table's layout against the configuration and creates partitions ahead: at start, and
    /// again once `pruning.interval` has passed (an engine driven by `process` has no housekeeping task).
    async fn prepare_layout(&self) -> Result<(), Error> {
        let inner = &self.inner;
        let mut checked = inner.layout_checked.lock().await;
        if checked.is_some_and(|at| at.elapsed() < inner.config.pruning.interval) {
            return Ok(());
        }
        DB::prepare_layout(&inner.pool, &inner.config.tables, &inner.config.layout).await?;
        *checked = Some(Instant::now());
        Ok(())
    }

    async fn prune_once(&self) {
        if self.partitioned().is_some() {
            return self.maintain_partitions().await;
        }
        let config = &self.inner.config;
        let Some(retention) = config.pruning.retention else { return };
        let group = config.group.clone();
        let report = crate::prune::prune(
            &self.inner.pool,
            &config.tables,
            Some(&config.group),
            retention,
            &config.pruning,
            |_| {},
        )
        .await;
        match report {
            Ok(report) => {
                metrics::counter!("processed_events_pruned_total", "consumer_group" => group.clone())
                    .increment(report.deleted);
                metrics::gauge!("processed_events_prune_longest_statement_seconds", "consumer_group" => group)
                    .set(report.longest_statement.as_secs_f64());
                tracing::info!(consumer_group = %config.group, deleted = report.deleted, statements = report.statements,
                    longest_ms = report.longest_statement.as_millis() as u64, "markers pruned");
            }
            Err(error) => tracing::warn!(%error, "pruning markers failed; trying again at the next interval"),
        }
    }

    /// The partitioned layout's pass: the layout checked again and partitions created ahead, then expired
    /// partitions dropped whole.
    async fn maintain_partitions(&self) {
        let config = &self.inner.config;
        if let Err(error) = DB::prepare_layout(&self.inner.pool, &config.tables, &config.layout).await {
            tracing::error!(%error, "the marker table no longer has the configured layout: stop this consumer");
        }
        let Some(retention) = config.pruning.retention else { return };
        match DB::drop_expired_partitions(&self.inner.pool, &config.tables, retention).await {
            Ok((dropped, markers)) => {
                metrics::counter!("processed_events_pruned_total", "consumer_group" => config.group.clone())
                    .increment(markers);
                if !dropped.is_empty() {
                    tracing::info!(consumer_group = %config.group, ?dropped, markers, "marker partitions dropped");
                }
            }
            Err(error) => {
                tracing::warn!(%error, "maintaining marker partitions failed; trying again at the next interval")
            }
        }
    }
}
