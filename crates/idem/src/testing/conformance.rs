//! The source conformance suite, callable from any crate (feature `testing`): what every [`Source`] and its
//! [`Publisher`] must do for idem's guarantee to hold, checked on a real broker through a real [`Engine`] writing
//! to a SQLite ledger.
//!
//! A source's crate describes its broker with a [`Broker`] (how to make a fresh topic, a publisher and a new
//! consumer) and calls [`check`]:
//!
//! ```no_run
//! # use idem::testing::conformance::{self, Broker};
//! # async fn test<B: Broker>(my_broker: B, pool: sqlx::SqlitePool) -> Result<(), idem::Error> {
//! let report = conformance::check(&my_broker, &pool).await?;
//! report.assert_passed();
//! # Ok(()) }
//! ```
//!
//! The checks, each on a fresh topic and consumer group:
//!
//! 1. **once, in order**: every event applied exactly once although the producer sent some twice, each key's
//!    events in the order they were produced, and two poison messages (one without a key, one its handler
//!    refuses) dead-lettered without holding up the rest of their partition;
//! 2. **redelivery of what was not acknowledged**: a consumer whose last acknowledgements never reach the broker
//!    (a crash between the commit and the acknowledgement) stops; a new consumer of the group receives every
//!    message the first one did not acknowledge, and applies none of them twice;
//! 3. **a stop acknowledges what committed**: a consumer shut down mid-stream acknowledges every committed message,
//!    so the next consumer of the group meets no duplicate and misses no event;
//! 4. **replay**: the refused message, replayed from the dead letters through the [`Publisher`], comes back
//!    through the source and is applied once.
//!
//! A crash here is a consumer dropped with acknowledgements withheld, in the same process: the suite proves what
//! the source promises to the engine. Killing whole processes at every point of the transaction order is the demo
//! and chaos harness's part (`idem demo`, `scripts/chaos.sh`), built on these same sources.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::SqlitePool;

use crate::config::Config;
use crate::engine::{Engine, StatsSnapshot};
use crate::error::{Error, HandlerError};
use crate::handler::Handler;
use crate::key::KeyExtractor;
use crate::message::{AckHandle, Event, Message};
use crate::source::{Acknowledgement, Partition, PausePartitions, Publisher, Received, Source, SourceError};
use crate::store::Tables;

/// A broker under test: how the suite makes a fresh topic, publishes to it and consumes it.
pub trait Broker: Send + Sync {
    /// The consumer this broker's module provides.
    type Source: Source;
    /// The producer this broker's module provides.
    type Publisher: Publisher;

    /// The broker's name in the report.
    fn name(&self) -> String;

    /// Creates a topic (queue, stream) no earlier run used, with several partitions where the broker has them,
    /// and returns the name [`Message::topic`] carries to publish to it.
    fn create_topic(&self) -> impl Future<Output = Result<String, Error>> + Send;

    /// A publisher onto the broker: the suite produces with it and replays dead letters through it. The suite's
    /// messages name the topic [`Broker::create_topic`] returned and carry their key (`k0` to `k7`) in
    /// [`Message::key`]; a broker that addresses by something else (a NATS subject) maps it here.
    fn publisher(&self) -> impl Future<Output = Result<Self::Publisher, Error>> + Send;

    /// A new consumer of `topic` in consumer group `group`, as a restarted process would create it. Where the
    /// broker redelivers an unacknowledged message only after a timeout (an ack wait, a visibility timeout), set
    /// it short (a few seconds): the suite waits for those redeliveries.
    fn consumer(&self, topic: &str, group: &str) -> impl Future<Output = Result<Self::Source, Error>> + Send;

    /// Whether the broker delivers each key's messages in the order they were produced (an SQS standard queue
    /// promises no order).
    fn orders(&self) -> bool {
        true
    }

    /// Whether a message delivered again (after a crash or a stop) still comes before later messages of its key.
    /// Where it does not, the checks after a crash or a stop hold the source to exactly-once only.
    fn orders_redeliveries(&self) -> bool {
        true
    }

    /// Events per check. Default 240.
    fn events(&self) -> usize {
        240
    }

    /// How long one check may wait for its deliveries. Default 90 s.
    fn patience(&self) -> Duration {
        Duration::from_secs(90)
    }
}

/// What the suite found: each check and, where it failed, why.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// The broker's name.
    pub broker: String,
    /// Each check's name and its failure, `None` when it passed.
    pub checks: Vec<(&'static str, Option<String>)>,
}

impl Report {
    /// Whether every check passed.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|(_, failure)| failure.is_none())
    }

    /// Panics, naming each failed check and its reason, unless every check passed.
    #[track_caller]
    pub fn assert_passed(&self) {
        let failures: Vec<String> = self
            .checks
            .iter()
            .filter_map(|(name, failure)| failure.as_ref().map(|why| format!("  {name}: {why}")))
            .collect();
        assert!(failures.is_empty(), "{} fails the source conformance suite:\n{}", self.broker, failures.join("\n"));
    }
}

/// Keys the events are spread over.
const KEYS: usize = 8;
/// The id of the message the handler refuses until it is replayed.
const REFUSED: u64 = 1_000_000;
/// The ledger the suite's handler writes to, one row per applied event.
const LEDGER: &str = "idem_conformance_ledger";

/// Runs every check against `broker`, on `pool` (a SQLite database of the suite's own: it migrates idem's
/// tables and adds a ledger table). An `Err` is a failure of the database or of setting the broker up; what the
/// source does wrong is in the [`Report`].
pub async fn check<B: Broker>(broker: &B, pool: &SqlitePool) -> Result<Report, Error> {
    crate::migrate(pool, &Tables::default()).await?;
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {LEDGER} (seq INTEGER PRIMARY KEY AUTOINCREMENT, run TEXT NOT NULL, \
         id INTEGER NOT NULL, key TEXT NOT NULL, n INTEGER NOT NULL)"
    ))
    .execute(pool)
    .await?;
    let suite = Suite { broker, pool, healed: Arc::new(AtomicBool::new(false)) };
    let mut report = Report { broker: broker.name(), checks: Vec::new() };
    let first = suite.once_in_order().await?;
    report.checks.push(("once, in order", first.failure));
    report.checks.push(("redelivery of what was not acknowledged", suite.redelivers_unacknowledged().await?));
    report.checks.push(("a stop acknowledges what committed", suite.stop_acknowledges_committed().await?));
    report.checks.push(("replay", suite.replay(&first.topic).await?));
    Ok(report)
}

struct Suite<'a, B> {
    broker: &'a B,
    pool: &'a SqlitePool,
    /// Whether the handler accepts the refused message (set before it is replayed).
    healed: Arc<AtomicBool>,
}

/// One event the suite produces: its id, its key and its place among its key's events.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
struct Payment {
    id: u64,
    key: usize,
    n: u64,
}

struct First {
    topic: String,
    failure: Option<String>,
}

impl<B: Broker> Suite<'_, B> {
    async fn once_in_order(&self) -> Result<First, Error> {
        let events = self.broker.events();
        let topic = self.broker.create_topic().await?;
        let mut messages = Vec::new();
        for payment in payments(events) {
            let message = message(&topic, &payment);
            if payment.id % 25 == 7 {
                messages.push(message.clone());
            }
            messages.push(message);
            if payment.id as usize == events / 2 {
                messages.push(Message::new(&topic, 0, 0, "not json").with_key("k0"));
                messages.push(self::message(&topic, &Payment { id: REFUSED, key: 1, n: u64::MAX }));
            }
        }
        self.publish(&messages).await?;
        let group = format!("{topic}-once");
        let run = self.run(&topic, &group, Until::Applied { events, dead_letters: 2 }, Cut::None).await?;
        let mut failure = run.failure;
        if failure.is_none() {
            failure = self.ledger_failure(&topic, events, self.broker.orders()).await?;
        }
        if failure.is_none() {
            let letters = crate::dead_letter::list(self.pool, &Tables::default(), Some(&group), 10).await?;
            if letters.len() != 2 {
                failure = Some(format!(
                    "{} dead letters, expected 2 (the message without a key, the refused one)",
                    letters.len()
                ));
            }
        }
        Ok(First { topic, failure })
    }

    async fn redelivers_unacknowledged(&self) -> Result<Option<String>, Error> {
        let events = self.broker.events();
        let topic = self.broker.create_topic().await?;
        self.publish(&payments(events).iter().map(|p| message(&topic, p)).collect::<Vec<_>>()).await?;
        let group = format!("{topic}-crash");
        let first = self.run(&topic, &group, Until::Acknowledged(3), Cut::AfterAcks(3)).await?;
        if let Some(failure) = first.failure {
            return Ok(Some(format!("before the crash: {failure}")));
        }
        let owed = first.seen.unacknowledged();
        if owed.is_empty() {
            return Ok(Some(
                "the first consumer was acknowledged for everything it received: nothing was left to redeliver".into(),
            ));
        }
        let second = self.run(&topic, &group, Until::Redelivered { events, owed: owed.clone() }, Cut::None).await?;
        if let Some(failure) = second.failure {
            return Ok(Some(format!("after the crash ({} messages unacknowledged): {failure}", owed.len())));
        }
        self.ledger_failure(&topic, events, self.broker.orders() && self.broker.orders_redeliveries()).await
    }

    async fn stop_acknowledges_committed(&self) -> Result<Option<String>, Error> {
        let events = self.broker.events();
        let topic = self.broker.create_topic().await?;
        self.publish(&payments(events).iter().map(|p| message(&topic, p)).collect::<Vec<_>>()).await?;
        let group = format!("{topic}-stop");
        let first = self.run(&topic, &group, Until::Applied { events: events / 3, dead_letters: 0 }, Cut::None).await?;
        if let Some(failure) = first.failure {
            return Ok(Some(format!("before the stop: {failure}")));
        }
        let second = self.run(&topic, &group, Until::Applied { events, dead_letters: 0 }, Cut::None).await?;
        if let Some(failure) = second.failure {
            return Ok(Some(format!("after the stop: {failure}")));
        }
        if second.stats.duplicate > 0 {
            return Ok(Some(format!(
                "the consumer after the stop met {} duplicates: the stopped one left committed messages \
                 unacknowledged",
                second.stats.duplicate
            )));
        }
        self.ledger_failure(&topic, events, self.broker.orders() && self.broker.orders_redeliveries()).await
    }

    async fn replay(&self, topic: &str) -> Result<Option<String>, Error> {
        let group = format!("{topic}-once");
        let tables = Tables::default();
        let letters = crate::dead_letter::list(self.pool, &tables, Some(&group), 10).await?;
        let Some(refused) = letters.iter().find(|letter| letter.message().payload != b"not json") else {
            return Ok(Some("the refused message is not among the dead letters".into()));
        };
        self.healed.store(true, Ordering::SeqCst);
        let publisher = self.broker.publisher().await?;
        if crate::dead_letter::replay(self.pool, &tables, &publisher, refused, crate::dead_letter::Safety::Checked)
            .await?
            != crate::dead_letter::Replayed::Published
        {
            return Ok(Some("the dead letter could not be replayed".into()));
        }
        let run = self.run(topic, &group, Until::Refused, Cut::None).await?;
        if let Some(failure) = run.failure {
            return Ok(Some(format!("the replayed message did not come back: {failure}")));
        }
        let left = crate::dead_letter::list(self.pool, &tables, Some(&group), 10).await?;
        if left.iter().any(|letter| letter.id == refused.id) {
            return Ok(Some("the replayed dead letter is still listed after its message was applied".into()));
        }
        let applied: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {LEDGER} WHERE run = ? AND id = ?"))
            .bind(topic)
            .bind(REFUSED as i64)
            .fetch_one(self.pool)
            .await?;
        Ok((applied != 1).then(|| format!("the replayed message was applied {applied} times")))
    }

    async fn publish(&self, messages: &[Message]) -> Result<(), Error> {
        let publisher = self.broker.publisher().await?;
        for message in messages {
            publisher.publish(message).await?;
        }
        Ok(())
    }

    /// Consumes `topic` as `group` until `until` holds (or the broker's patience runs out), then stops.
    async fn run(&self, topic: &str, group: &str, until: Until, cut: Cut) -> Result<Run, Error> {
        let seen = Arc::new(Seen::default());
        let source = Watched { inner: self.broker.consumer(topic, group).await?, seen: seen.clone(), cut };
        let config = Config::new(group, KeyExtractor::JsonPointer("/id".into()))
            .batch_size(8)
            .max_attempts(2)
            .backoff(Duration::from_millis(10), Duration::from_millis(50));
        let engine = Engine::new(self.pool.clone(), config)?;
        let handler = Ledger { run: topic.to_owned(), healed: self.healed.clone() };
        let deadline = Instant::now() + self.broker.patience();
        let reached = Arc::new(AtomicBool::new(false));
        let until = Arc::new(until);
        let watch = {
            let (pool, reached, seen, topic, group, until) =
                (self.pool.clone(), reached.clone(), seen.clone(), topic.to_owned(), group.to_owned(), until.clone());
            async move {
                while Instant::now() < deadline {
                    if until.holds(&pool, &topic, &group, &seen).await.unwrap_or(false) {
                        reached.store(true, Ordering::SeqCst);
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        let stats = engine.run(source, handler, watch).await?;
        let reached = reached.load(Ordering::SeqCst) || until.holds(self.pool, topic, group, &seen).await?;
        let failure = (!reached).then(|| {
            format!(
                "not done after {:?}: {} messages received, {stats:?}",
                self.broker.patience(),
                seen.received.lock().map(|r| r.len()).unwrap_or(0)
            )
        });
        Ok(Run { stats, failure, seen })
    }

    /// What is wrong with the ledger of `run`: an event missing or applied twice, or (when `ordered`) a key's
    /// events applied out of order.
    async fn ledger_failure(&self, run: &str, events: usize, ordered: bool) -> Result<Option<String>, Error> {
        let rows: Vec<(i64, String, i64)> =
            sqlx::query_as(&format!("SELECT id, key, n FROM {LEDGER} WHERE run = ? AND id < ? ORDER BY seq"))
                .bind(run)
                .bind(REFUSED as i64)
                .fetch_all(self.pool)
                .await?;
        let mut applied: HashMap<i64, usize> = HashMap::new();
        let mut last: HashMap<String, i64> = HashMap::new();
        for (id, key, n) in &rows {
            *applied.entry(*id).or_default() += 1;
            let previous = last.insert(key.clone(), *n);
            if ordered && previous.is_some_and(|previous| previous >= *n) {
                return Ok(Some(format!("key {key}: event {n} applied after event {}", previous.unwrap_or(0))));
            }
        }
        if let Some((id, times)) = applied.iter().find(|(_, times)| **times > 1) {
            return Ok(Some(format!("event {id} applied {times} times")));
        }
        let missing = (0..events as i64).filter(|id| !applied.contains_key(id)).count();
        Ok((missing > 0).then(|| format!("{missing} of {events} events never applied")))
    }
}

/// `events` payments over [`KEYS`] keys, numbered per key.
fn payments(events: usize) -> Vec<Payment> {
    let mut per_key = [0u64; KEYS];
    (0..events as u64)
        .map(|id| {
            let key = (id as usize * 7 + id as usize / KEYS) % KEYS;
            per_key[key] += 1;
            Payment { id, key, n: per_key[key] }
        })
        .collect()
}

fn message(topic: &str, payment: &Payment) -> Message {
    let payload = serde_json::to_vec(payment).unwrap_or_default();
    Message::new(topic, 0, 0, payload).with_key(format!("k{}", payment.key))
}

/// When a consumer's run is over.
enum Until {
    /// `events` events of the run applied and `dead_letters` dead letters in the group.
    Applied { events: usize, dead_letters: i64 },
    /// Every event applied and every message of `owed` received again.
    Redelivered { events: usize, owed: HashSet<u64> },
    /// The refused message applied.
    Refused,
    /// This many acknowledgements went through (the run's crash point).
    Acknowledged(u64),
}

impl Until {
    async fn holds(&self, pool: &SqlitePool, run: &str, group: &str, seen: &Seen) -> Result<bool, Error> {
        let applied = |below: u64| async move {
            sqlx::query_scalar::<_, i64>(&format!("SELECT COUNT(DISTINCT id) FROM {LEDGER} WHERE run = ? AND id < ?"))
                .bind(run)
                .bind(below as i64)
                .fetch_one(pool)
                .await
        };
        Ok(match self {
            Until::Applied { events, dead_letters } => {
                let letters = crate::dead_letter::list(pool, &Tables::default(), Some(group), 10).await?;
                applied(REFUSED).await? >= *events as i64 && letters.len() as i64 >= *dead_letters
            }
            Until::Redelivered { events, owed } => {
                let received = seen.ids();
                applied(REFUSED).await? >= *events as i64 && owed.iter().all(|id| received.contains(id))
            }
            Until::Refused => applied(REFUSED + 1).await? > applied(REFUSED).await?,
            Until::Acknowledged(n) => seen.acks.load(Ordering::SeqCst) >= *n,
        })
    }
}

struct Run {
    stats: StatsSnapshot,
    failure: Option<String>,
    seen: Arc<Seen>,
}

/// The suite's handler: one ledger row per event; the refused message is refused until the suite heals it.
struct Ledger {
    run: String,
    healed: Arc<AtomicBool>,
}

impl Handler<sqlx::Sqlite> for Ledger {
    async fn handle(&self, event: &Event, tx: &mut sqlx::SqliteConnection) -> Result<(), HandlerError> {
        let payment: Payment = event.json()?;
        if payment.id == REFUSED && !self.healed.load(Ordering::SeqCst) {
            return Err(HandlerError::permanent("refused until replayed (the conformance suite's poison message)"));
        }
        sqlx::query(&format!("INSERT INTO {LEDGER} (run, id, key, n) VALUES (?, ?, ?, ?)"))
            .bind(&self.run)
            .bind(payment.id as i64)
            .bind(format!("k{}", payment.key))
            .bind(payment.n as i64)
            .execute(tx)
            .await
            .map_err(HandlerError::retryable)?;
        Ok(())
    }
}

/// How a consumer's run ends.
#[derive(Debug, Clone, Copy)]
enum Cut {
    /// Normally: acknowledgements go through, the run ends at its shutdown.
    None,
    /// As at a crash after this many acknowledgements: later ones never reach the broker and the source ends.
    AfterAcks(usize),
}

/// One message a consumer received.
struct Delivered {
    partition: Partition,
    offset: i64,
    handle: Option<AckHandle>,
    /// The suite's event id, when the payload is one of its events.
    id: Option<u64>,
}

/// What a consumer received and what of it reached the broker's acknowledgement.
#[derive(Default)]
struct Seen {
    received: Mutex<Vec<Delivered>>,
    acked_handles: Mutex<Vec<AckHandle>>,
    acked_offsets: Mutex<BTreeMap<Partition, i64>>,
    acks: AtomicU64,
}

impl Seen {
    fn ids(&self) -> HashSet<u64> {
        self.received.lock().map(|r| r.iter().filter_map(|d| d.id).collect()).unwrap_or_default()
    }

    /// The event ids of the received messages no acknowledgement covered.
    fn unacknowledged(&self) -> HashSet<u64> {
        let (Ok(received), Ok(handles), Ok(offsets)) =
            (self.received.lock(), self.acked_handles.lock(), self.acked_offsets.lock())
        else {
            return HashSet::new();
        };
        received
            .iter()
            .filter(|d| match &d.handle {
                Some(handle) => !handles.contains(handle),
                None => offsets.get(&d.partition).is_none_or(|acked| d.offset > *acked),
            })
            .filter_map(|d| d.id)
            .collect()
    }
}

/// The broker's source, watched: what it yields and what of its acknowledgements go through.
struct Watched<S> {
    inner: S,
    seen: Arc<Seen>,
    cut: Cut,
}

impl<S> Watched<S> {
    fn crashed(&self) -> bool {
        matches!(self.cut, Cut::AfterAcks(n) if self.seen.acks.load(Ordering::SeqCst) >= n as u64)
    }
}

impl<S: Source> Source for Watched<S> {
    const SYSTEM: &'static str = S::SYSTEM;

    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        if self.crashed() {
            return Ok(None);
        }
        let received = self.inner.recv().await?;
        if let Some(Received::Message(message)) = &received
            && let Ok(mut seen) = self.seen.received.lock()
        {
            let id = serde_json::from_slice::<Payment>(&message.payload).ok().map(|p| p.id);
            seen.push(Delivered {
                partition: Partition { topic: message.topic.clone(), partition: message.partition },
                offset: message.offset,
                handle: message.ack_handle.clone(),
                id,
            });
        }
        Ok(received)
    }

    async fn ack(&self, ack: &Acknowledgement) -> Result<(), SourceError> {
        if self.crashed() {
            return Ok(());
        }
        self.inner.ack(ack).await?;
        self.seen.acks.fetch_add(1, Ordering::SeqCst);
        if let Ok(mut handles) = self.seen.acked_handles.lock() {
            handles.extend(ack.handles.iter().cloned());
        }
        if ack.handles.is_empty()
            && let Ok(mut offsets) = self.seen.acked_offsets.lock()
        {
            let acked = offsets.entry(ack.partition.clone()).or_insert(ack.last_offset);
            *acked = (*acked).max(ack.last_offset);
        }
        Ok(())
    }

    fn pausing(&self) -> Option<&dyn PausePartitions> {
        self.inner.pausing()
    }

    fn system(&self) -> &'static str {
        self.inner.system()
    }
}
