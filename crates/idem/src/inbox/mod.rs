//! The Sequential Inbox: messages of one business context (an order, a payment) handled in a
//! declared order, whatever order the broker delivers them in, by several consumers at once, and more than once.
//!
//! A [`Sequence`] has a name, a retention and two or more [`MessageType`]s. Each message type is a
//! [`QualifiedType`] (a type name and an optional sub-type) with a [`ContextId`] extractor (none: the message is
//! not sequenced), an optional [`Filter`] (false: handle it at once, unsequenced) and an optional release
//! [`Condition`] (`predecessor`, `all`, `any`; none: released on arrival).
//!
//! ## Processing
//! For each message, [`SequentialInbox`] resolves its qualified type (from [`InboxConfig::message_type`] and
//! [`InboxConfig::sub_type`]), applies the filter and extracts the context id. A message that is not sequenced
//! goes through the engine's ordinary path (its marker in `processed_events`, then the handler, in one
//! transaction). A sequenced one is handled in one transaction that
//! 1. claims it: `INSERT INTO sequential_inbox_idempotence … ON CONFLICT (message_type, idempotence_id) DO
//!    NOTHING`, first statement; no row inserted: a duplicate (a concurrent delivery waits here for the winner's
//!    outcome and takes over if the winner rolls back);
//! 2. locks its sequence instance (`FOR NO KEY UPDATE`): one context is handled by one worker at a time, across
//!    processes, and different contexts in parallel;
//! 3. runs the handler when the release condition holds and records the message PROCESSED, then releases every
//!    WAITING message whose condition now holds, in arrival order, until none does; otherwise stores the
//!    message WAITING with its bytes and headers; closes the instance once every type was processed.
//!
//! ## Guarantee and failures
//! With [`InboxTransactions::Shared`] (the default) the handler writes through the claim transaction, so the
//! effects, the claim and the inbox state commit together: exactly-once for what the handler writes through
//! `tx`. Effects outside the database (an HTTP call) are at-least-once, as everywhere in idem.
//! [`InboxTransactions::Separate`] is the layout where the handler commits its own transaction
//! before the inbox state is stored: a crash in between runs the handler again, so it must be idempotent itself.
//!
//! A handler that fails on a message handled at once rolls back the claim: a retry (retryable errors) or a
//! resend (after a permanent error dead-letters it) takes over. A buffered message that fails when released is
//! marked FAILED and its claim deleted in the releasing transaction (its effects undone by a savepoint), so a
//! resend retries it; `idem inbox release` re-queues it.
//!
//! ## Retention
//! Claims go with their instance: housekeeping deletes instances `expiry_delay` after `retain_until`, and a
//! duplicate arriving after that is handled as new. WAITING and FAILED messages of a deleted instance are
//! written to the dead-letter table and logged, never dropped silently.
//!
//! PostgreSQL only: the claim waits on a row lock held by the winner, which SQLite does not have.
//!
//! ```toml
//! message_type = "header:type"
//! sub_type = "header:subtype"
//!
//! [[sequence]]
//! name = "order"
//! retention = "30d"
//!
//! [[sequence.type]]
//! name = "OrderCreated"
//! context_id = "json:/orderId"
//!
//! [[sequence.type]]
//! name = "OrderValidated"
//! sub_type = "stock"
//! context_id = "json:/orderId"
//! release = { predecessor = "OrderCreated" }
//!
//! [[sequence.type]]
//! name = "OrderShipped"
//! context_id = "json:/orderId"
//! filter = { pointer = "/express", equals = false }
//! release = { all = [{ predecessor = "OrderValidated/stock" }, { predecessor = "OrderCreated" }] }
//! ```

pub use crate::store::postgres::inbox::admin;
mod housekeeping;
mod instances;
mod model;
mod process;

use crate::store::postgres::inbox as store;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use housekeeping::HousekeepingReport;
pub use model::{
    Condition, ContextId, Filter, InboxConfig, InboxHousekeeping, InboxTransactions, MessageFn, MessageType,
    QualifiedType, Sequence,
};

use crate::engine::{Engine, Outcome, StatsSnapshot};
use crate::error::Error;
use crate::handler::Handler;
use crate::message::{Event, Message};
use crate::source::Source;

/// What became of one message given to the inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxOutcome {
    /// Not sequenced (no matching type, filtered out, or no context id): handled through the engine's marker path.
    Direct(Outcome),
    /// Handled now; `released` buffered messages were handled after it.
    Processed {
        /// Buffered messages released by this one.
        released: usize,
    },
    /// Handled now without checking its release condition: the sequence is in recording mode.
    Recorded,
    /// Stored WAITING until its release condition holds.
    Buffered,
    /// Already claimed: skipped without calling the handler.
    Duplicate,
    /// Failed permanently (or ran out of retries): dead-lettered, claim rolled back so a resend can retry it.
    DeadLettered,
}

/// Counters of one inbox since it was built.
#[derive(Debug, Default)]
struct Counters {
    consumed: AtomicU64,
    processed: AtomicU64,
    released: AtomicU64,
    buffered: AtomicU64,
    duplicates: AtomicU64,
    failed: AtomicU64,
    dead_lettered: AtomicU64,
}

/// A copy of the inbox's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct InboxStats {
    /// Sequenced messages consumed (duplicates included).
    pub consumed: u64,
    /// Handled on arrival (recording mode included).
    pub processed: u64,
    /// Buffered messages handled when their condition came to hold.
    pub released: u64,
    /// Messages stored WAITING.
    pub buffered: u64,
    /// Duplicates skipped by the claim.
    pub duplicates: u64,
    /// Released messages whose handler failed (now FAILED, claim deleted).
    pub failed: u64,
    /// Messages dead-lettered on arrival.
    pub dead_lettered: u64,
}

/// Where a message goes.
enum Route {
    /// The engine's marker path.
    Direct(Message),
    /// The inbox.
    Sequenced(Sequenced),
    /// Of a sequenced type family but not fit to be sequenced: dead-lettered with the reason.
    Refused { message: Message, reason: String },
}

/// A message on its way through the inbox.
pub(crate) struct Sequenced {
    pub event: Event,
    pub sequence: usize,
    pub message_type: usize,
    pub context: String,
}

/// The Sequential Inbox over an [`Engine`] (PostgreSQL): consumes a source, sequencing the messages of the
/// declared sequences and handling the others through the engine.
///
/// ```no_run
/// use idem::inbox::{ContextId, InboxConfig, MessageType, QualifiedType, Sequence, SequentialInbox};
/// use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor};
/// use sqlx::PgConnection;
/// use std::time::Duration;
///
/// struct Orders;
///
/// impl Handler<sqlx::Postgres> for Orders {
///     async fn handle(&self, event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
///         sqlx::query("INSERT INTO order_log (id) VALUES ($1)").bind(&event.id).execute(&mut *tx).await?;
///         Ok(())
///     }
/// }
///
/// # async fn example(source: impl idem::Source) -> Result<(), idem::Error> {
/// let order = |t: &str| MessageType::new(QualifiedType::new(t), ContextId::JsonPointer("/orderId".into()));
/// let inbox = InboxConfig::new().with_sequence(
///     Sequence::new("order", Duration::from_secs(30 * 86_400))
///         .with_type(order("OrderCreated"))
///         .with_type(order("OrderShipped").after(QualifiedType::new("OrderCreated"))),
/// );
/// let pool = idem::postgres::connect("postgres://postgres@127.0.0.1/test", 8).await?;
/// let config = Config::new("orders", KeyExtractor::JsonPointer("/eventId".into()));
/// idem::migrate(&pool, &config.tables).await?;
/// let inbox = SequentialInbox::new(Engine::new(pool, config)?, inbox)?;
/// inbox.run(source, Orders, tokio::signal::ctrl_c()).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SequentialInbox {
    engine: Engine<sqlx::Postgres>,
    config: Arc<InboxConfig>,
    /// Each qualified type's (sequence, message type) indexes.
    index: Arc<HashMap<QualifiedType, (usize, usize)>>,
    counters: Arc<Counters>,
    /// Separate mode: one permit per two connections of the pool.
    separate_slots: Option<Arc<tokio::sync::Semaphore>>,
    /// The instance ids resolved so far.
    instances: Arc<instances::KnownInstances>,
}

impl SequentialInbox {
    /// An inbox over `engine`; refuses an invalid configuration with the field and the fix.
    pub fn new(engine: Engine<sqlx::Postgres>, config: InboxConfig) -> Result<Self, Error> {
        config.validate()?;
        if engine.config().dedup == crate::config::Dedup::NaturalKey {
            return Err(Error::Config(
                "the Sequential Inbox claims its own rows and cannot run in the natural-key mode: build its engine \
                 with the default marker dedup (drop `Config::natural_key`)"
                    .into(),
            ));
        }
        if engine.config().delayed_retries.is_some() {
            return Err(Error::Config(
                "the Sequential Inbox keeps its own WAITING messages and releases them in its declared order; it does \
                 not park: build its engine without `Config::delayed_retries` (a released message that fails is \
                 FAILED, and `idem inbox release` retries it)"
                    .into(),
            ));
        }
        let mut index = HashMap::new();
        for (s, sequence) in config.sequences.iter().enumerate() {
            for (t, message_type) in sequence.types.iter().enumerate() {
                index.insert(message_type.qualified.clone(), (s, t));
            }
        }
        let connections = engine.pool().options().get_max_connections() as usize;
        if config.transactions == InboxTransactions::Separate && connections < 2 {
            return Err(Error::Config(format!(
                "inbox `transactions = \"separate\"` holds two connections per message, and the pool has \
                 {connections}: give it two per partition consumed"
            )));
        }
        let separate_slots = (config.transactions == InboxTransactions::Separate)
            .then(|| Arc::new(tokio::sync::Semaphore::new(connections / 2)));
        Ok(SequentialInbox {
            separate_slots,
            engine,
            config: Arc::new(config),
            index: Arc::new(index),
            counters: Arc::new(Counters::default()),
            instances: Arc::default(),
        })
    }

    /// The engine underneath (its stats count the messages handled directly).
    pub fn engine(&self) -> &Engine<sqlx::Postgres> {
        &self.engine
    }

    /// The configuration.
    pub fn config(&self) -> &InboxConfig {
        &self.config
    }

    /// The inbox's counters.
    pub fn stats(&self) -> InboxStats {
        let c = &self.counters;
        let read = |a: &AtomicU64| a.load(Ordering::Relaxed);
        InboxStats {
            consumed: read(&c.consumed),
            processed: read(&c.processed),
            released: read(&c.released),
            buffered: read(&c.buffered),
            duplicates: read(&c.duplicates),
            failed: read(&c.failed),
            dead_lettered: read(&c.dead_lettered),
        }
    }

    /// Consumes `source` until it ends or `shutdown` completes, like [`Engine::run`], with housekeeping (and
    /// operator releases, `idem inbox release`) every [`InboxHousekeeping::interval`].
    pub async fn run<S: Source, H: Handler<sqlx::Postgres>>(
        &self,
        source: S,
        handler: H,
        shutdown: impl std::future::Future + Send,
    ) -> Result<StatsSnapshot, Error> {
        let handler = Arc::new(handler);
        let sequences = self.config.sequences.iter().map(|s| s.name.as_str());
        crate::telemetry::zero_inbox(&self.engine.config().group, sequences);
        let housekeeping = tokio::spawn(self.clone().housekeeping_loop(Arc::clone(&handler)));
        let result = self
            .engine
            .run_with(source, Arc::new(process::InboxProcess { inbox: self.clone(), handler }), shutdown)
            .await;
        housekeeping.abort();
        result
    }

    /// Handles `messages` (of one partition, in order) without a source: for custom loops and tests. Nothing is
    /// acknowledged.
    pub async fn process<H: Handler<sqlx::Postgres>>(
        &self,
        messages: Vec<Message>,
        handler: &H,
    ) -> Result<Vec<InboxOutcome>, Error> {
        self.process_batch(messages, handler, &crate::engine::Shutdown::default()).await
    }

    /// Where `message` goes: its qualified type, the filter, the context id and the idempotence id decide.
    fn route(&self, message: Message) -> Route {
        let Ok(name) = self.config.message_type.extract(&message) else { return Route::Direct(message) };
        let sub = self.config.sub_type.as_ref().and_then(|e| e.extract(&message).ok());
        let exact = sub.as_ref().map(|s| QualifiedType::with_sub_type(name.clone(), s.clone()));
        let found =
            exact.as_ref().and_then(|q| self.index.get(q)).or_else(|| self.index.get(&QualifiedType::new(&name)));
        let Some(&(s, t)) = found else {
            if let Some(family) = self.index.keys().find(|q| q.name == name && q.sub_type.is_some()) {
                let sub_field = self.config.sub_type.as_ref().map(|e| format!("{e:?}")).unwrap_or_default();
                let reason = match sub {
                    None => format!(
                        "message type `{name}` is sequenced by sub-type (e.g. `{family}`) but this message has none \
                         ({sub_field}); publish it with its sub-type"
                    ),
                    Some(sub) => format!(
                        "message type `{name}/{sub}` is not declared in the inbox, while other sub-types of \
                         `{name}` are; declare it or fix the producer"
                    ),
                };
                return Route::Refused { message, reason };
            }
            return Route::Direct(message);
        };
        let message_type = &self.config.sequences[s].types[t];
        if message_type.filter.as_ref().is_some_and(|f| !f.accepts(&message)) {
            return Route::Direct(message);
        }
        let Some(context) = message_type.context_id.extract(&message) else { return Route::Direct(message) };
        match self.engine.config().key.extract(&message) {
            Ok(id) => {
                Route::Sequenced(Sequenced { event: Event::new(id, message), sequence: s, message_type: t, context })
            }
            // The engine dead-letters a message without an idempotence id, naming the extractor.
            Err(_) => Route::Direct(message),
        }
    }
}
