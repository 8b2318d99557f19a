//! # idem: exactly-once effects over at-least-once delivery
//!
//! A broker hands the same event over more than once: after a crash, a rebalance, a redelivery. idem makes every
//! duplicate harmless: it inserts a dedup marker in the **same database transaction** as your handler's effect,
//! first statement of that transaction, and acknowledges to the broker only after that transaction committed.
//!
//! The smallest consumer: credit an account for each payment event read from the embedded log, in SQLite.
//!
//! ```no_run
//! use idem::embedded::{ConsumerOptions, EmbeddedLog};
//! use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor};
//! use sqlx::SqliteConnection;
//!
//! struct Credit;
//!
//! impl Handler<sqlx::Sqlite> for Credit {
//!     async fn handle(&self, event: &Event, tx: &mut SqliteConnection) -> Result<(), HandlerError> {
//!         #[derive(serde::Deserialize)]
//!         struct Payment { account: i64, amount: i64 }
//!         let p: Payment = event.json()?; // a payload that does not decode is dead-lettered
//!         sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
//!             .bind(p.amount)
//!             .bind(p.account)
//!             .execute(&mut *tx) // the transaction idem opened; the marker is already in it
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn example() -> Result<(), idem::Error> {
//! let pool = idem::sqlite::connect("sqlite://ledger.db").await?;
//! let config = Config::new("ledger-writer", KeyExtractor::JsonPointer("/idempotencyKey".into()));
//! idem::migrate(&pool, &config.tables).await?;
//! let log = EmbeddedLog::open("events")?;
//! let source = log.consumer("ledger-writer", &["payments"], ConsumerOptions::default())?;
//! Engine::new(pool, config)?.run(source, Credit, tokio::signal::ctrl_c()).await?;
//! # Ok(()) }
//! ```
//!
//! ## Layout
//! * [`engine`]: the transaction order, batches, retries, dead letters, the per-partition workers.
//! * [`handler`]: the traits user code implements ([`Handler`], [`BatchHandler`]).
//! * [`message`] and [`key`]: the broker-neutral [`Message`], the [`Event`] a handler sees, and where its
//!   idempotency key comes from ([`KeyExtractor`]).
//! * [`store`]: the database seam by capability ([`Store`], the hot path; [`Operations`], the tooling; the
//!   partitioned layout in `store::partitions`, PostgreSQL only) with its PostgreSQL and SQLite modules.
//! * [`source`]: the broker seam ([`Source`], [`Publisher`]) and its contract; [`embedded`]: the embedded log.
//!   Brokers, each behind its feature: `kafka`, `nats` (NATS JetStream), `rabbitmq`, `sqs` (Amazon SQS),
//!   `pubsub` (Google Cloud Pub/Sub).
//! * [`retention`]: the retention guard, markers against what a broker keeps, in each broker's words.
//! * [`inbox`]: the Sequential Inbox (PostgreSQL): per-context ordering with buffering and a concurrent-safe claim.
//! * [`gap`]: lost-event detection from producer sequence numbers.
//! * [`guard`]: ordering guards a handler calls in idem's transaction: a [`guard::VersionGuard`] (newer versions
//!   only) and a [`guard::StateMachine`] (declared transitions). [`Dedup::NaturalKey`] lets the handler's own
//!   unique insert replace the marker.
//! * [`duration`]: durations as people write them (`8d`, `1h30m`, ISO 8601 `P2D`), one parser for every setting.
//! * [`prune`]: bounded, lock-friendly pruning of markers. [`kill_switch`]: holding the consumer when every
//!   message fails the same way.
//! * [`outbox`]: the transactional outbox: enqueue in the caller's transaction, a [`outbox::Relay`] that delivers
//!   committed messages in order per key through a broker or a call of yours.
//! * [`dead_letter`]: listing and replaying dead letters. [`fault`]: crash injection for tests and the demo.
//! * `otel` (feature `otel`): OpenTelemetry traces, a span per message and per batch linked across brokers by the
//!   W3C trace context headers (extracted from each message, injected by idem's producers and the outbox), OTLP
//!   export from the `OTEL_*` environment.
//! * `http` (feature `http`): the operations endpoint (`/metrics`, `/healthz`, `/readyz`, `POST /resume`) on axum.
//! * `testing` (feature `testing`): the duplicate test kit, every handler's exactly-once check in a few lines.
//! * [`error`]: errors that say whether a retry can help. [`telemetry`]: the metric catalogue.
//! * `kafka` (feature `kafka`): the Kafka source, the producer helper, topic admin.
//! * `nats` (feature `nats`): the NATS JetStream source (a durable pull consumer), the producer with
//!   `Nats-Msg-Id`, the AckWait and acknowledgement-policy guards.
//! * `rabbitmq` (feature `rabbitmq`): the RabbitMQ source (manual acknowledgement, a queue per partition) and the
//!   producer with publisher confirms.
//! * `sqs` (feature `sqs`): the Amazon SQS source (standard and FIFO queues, deleted after commit, visibility
//!   kept while in hand), the producer with `MessageDeduplicationId` and `MessageGroupId`, the visibility-timeout
//!   and retention guards.
//! * `pubsub` (feature `pubsub`): the Google Cloud Pub/Sub source (streaming pull, acknowledged after commit,
//!   leases extended while in hand, ordering keys as keys, the dead-letter policy's last delivery kept), the
//!   producer with the event id attribute and the ordering key, the retention guard; the emulator through
//!   `PUBSUB_EMULATOR_HOST`.
#![warn(missing_docs)]

pub mod audit;
pub mod backoff;
mod brokers;
pub mod config;
pub mod dead_letter;
pub mod delayed_retry;
#[cfg(doctest)]
pub mod doc_snippets;
pub mod duration;
pub use brokers::embedded;
#[cfg(feature = "console")]
pub mod console;
pub mod engine;
pub mod error;
pub mod fault;
pub mod gap;
pub mod guard;
pub mod handler;
#[cfg(feature = "http")]
pub mod http;
pub mod inbox;
#[cfg(feature = "ingress")]
pub mod ingress;
#[cfg(feature = "kafka")]
pub use brokers::kafka;
pub mod key;
pub mod kill_switch;
pub mod lag;
pub mod message;
#[cfg(feature = "nats")]
pub use brokers::nats;
#[cfg(feature = "otel")]
pub mod otel;
pub mod outbox;
mod propagation;
pub mod prune;
#[cfg(feature = "pubsub")]
pub use brokers::pubsub;
#[cfg(feature = "rabbitmq")]
pub use brokers::rabbitmq;
pub mod retention;
pub mod source;
#[cfg(feature = "sqs")]
pub use brokers::sqs;
pub mod store;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;

pub use backoff::Backoff;
pub use config::{Config, Dedup, IdReusePolicy, MarkerLayout, PartitionPeriod, Partitioning, Pruning};
pub use delayed_retry::{DelayedRetries, ParkOrder};
pub use engine::{Committed, Engine, Health, Outcome, Stalled, StatsSnapshot};
pub use error::{Error, HandlerError, Retry};
pub use handler::{BatchHandler, Handler};
pub use key::{KeyExtractor, MissingKey};
pub use kill_switch::KillSwitch;
pub use message::{AckHandle, Event, Handled, Message};
pub use source::{Acknowledgement, BoxedSource, PausePartitions, Publisher, Received, Source, SourceError};
/// The sqlx version idem is built with; handlers use its `PgConnection`, `MySqlConnection` and `SqliteConnection`.
pub use sqlx;
pub use sqlx::{MySql, Postgres, Sqlite};
pub use store::{Backend, IntactCommit, Operations, Store, Tables, mysql, postgres, sqlite};

/// Applies the missing migrations of `pool`'s database for `tables`; safe to run twice and from two processes.
pub async fn migrate<DB: Backend>(pool: &sqlx::Pool<DB>, tables: &Tables) -> Result<store::MigrationReport, Error> {
    let report = DB::migrate(pool, tables).await?;
    // Dead letters written before their failure group was stored with them get it now.
    DB::fill_fingerprints(pool, tables).await?;
    Ok(report)
}
