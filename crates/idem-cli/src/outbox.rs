//! `idem relay` (deliver an outbox's committed messages to a broker) and `idem outbox list|stats|requeue`.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use idem::Tables;
use idem::embedded::EmbeddedLog;
use idem::outbox::{Delivery, HttpDelivery, HttpOr, OutboxStore, Publish, Relay, RelayConfig};

use crate::commands::{BrokerTarget, OptionalBrokerFlags};
use crate::db::{self, Db};
use crate::{DbArgs, with_pool};

/// `idem relay`: where the outbox is, where its messages go, how the relay runs.
#[derive(Args, Debug)]
pub struct RelayArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Where to deliver: each message to the topic, subject or queue its destination names (an embedded log's
    /// topic is created, with one partition, when missing). Destinations that are URLs (`http://…`, `https://…`)
    /// are HTTP requests, with or without a broker.
    #[command(flatten)]
    to: OptionalBrokerFlags,
    /// The relay's name (its dead letters' consumer group is `outbox:<name>`).
    #[arg(long, default_value = "relay")]
    name: String,
    /// Messages per round.
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
    /// How often to look for work without a notification, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    poll_interval_ms: u64,
    /// Failed attempts after which a message becomes a dead letter (default: retried until delivered).
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Stop once the outbox is empty instead of waiting for more.
    #[arg(long)]
    until_empty: bool,
    /// Print what the relay did as JSON when it stops.
    #[arg(long)]
    json: bool,
    /// Serve /metrics, /healthz and /readyz on this address (e.g. 127.0.0.1:9465).
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
}

/// `idem outbox …`.
#[derive(Subcommand, Debug)]
pub enum OutboxCommand {
    /// Messages waiting in the outbox, oldest first, with their attempts and last error.
    List {
        #[command(flatten)]
        db: DbArgs,
        /// At most this many.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
        limit: i64,
        /// Only the messages that failed at least once.
        #[arg(long)]
        failing: bool,
        /// Print one JSON array instead of a table (a JSON payload as JSON, any other as text).
        #[arg(long)]
        json: bool,
    },
    /// How many messages wait, the oldest one's age, how many failed at least once; per destination with
    /// --by-destination.
    Stats {
        #[command(flatten)]
        db: DbArgs,
        /// The figures of each destination.
        #[arg(long)]
        by_destination: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Put dead-lettered outbox messages (consumer group `outbox:<relay>`, see `idem dead-letters list`) back into
    /// the outbox, with their event ids, to be delivered again.
    Requeue {
        #[command(flatten)]
        db: DbArgs,
        /// Dead-letter ids.
        ids: Vec<i64>,
        /// Every outbox dead letter (of --relay, if given).
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// Only this relay's dead letters (with --all).
        #[arg(long)]
        relay: Option<String>,
        #[command(flatten)]
        actor: crate::audit::Actor,
    },
}

/// What a relay without a broker does with a destination that is not a URL: it stays in the outbox, its error
/// naming the fix.
struct NoBroker;

impl Delivery for NoBroker {
    async fn deliver(&self, messages: &[idem::outbox::OutboxMessage]) -> Vec<idem::outbox::Delivered> {
        messages
            .iter()
            .map(|m| {
                idem::outbox::Delivered::Failed(idem::outbox::DeliveryError::permanent(format!(
                    "destination `{}` is no URL and this relay has no broker: run it with --log-dir, --kafka, \
                     --nats, --rabbitmq or --sqs",
                    m.destination
                )))
            })
            .collect()
    }
}

/// Runs `idem relay` until SIGINT/SIGTERM (or, with `--until-empty`, until the outbox is empty).
pub async fn relay(args: RelayArgs) -> anyhow::Result<ExitCode> {
    let target = args.to.target()?;
    let signals = crate::signals::Signals::install()?;
    let config = RelayConfig {
        name: args.name.clone(),
        batch_size: args.batch_size,
        poll_interval: Duration::from_millis(args.poll_interval_ms),
        max_attempts: args.max_attempts,
        stop_when_empty: args.until_empty,
        ..RelayConfig::default()
    };
    config.validate()?;
    let tables = db::tables(&args.db)?;
    let db = Db::open(&args.db.database_url, 2).await?;
    if let Some(addr) = args.metrics_addr {
        let recorder = idem::http::install_recorder()?;
        let bound =
            with_pool!(&db, pool => idem::http::serve(addr, recorder, idem::http::DatabaseProbe(pool.clone())).await?);
        tracing::info!(%bound, "outbox relay: serving /metrics");
    }
    let shutdown = signals.received();
    let http = HttpDelivery::default();
    let stats = match target {
        Some(BrokerTarget::Kafka(brokers)) => {
            let producer = HttpOr(http, kafka_producer(&brokers)?);
            with_pool!(&db, pool => run(pool, &tables, config, producer, shutdown).await?)
        }
        Some(BrokerTarget::Nats(url)) => {
            let waiting = with_pool!(&db, pool => idem::outbox::destinations(pool, &tables).await?);
            let producer = HttpOr(http, nats_producer(&url, &waiting).await?);
            with_pool!(&db, pool => run(pool, &tables, config, producer, shutdown).await?)
        }
        Some(BrokerTarget::Rabbitmq(url)) => {
            let producer = HttpOr(http, rabbitmq_producer(&url).await?);
            with_pool!(&db, pool => run(pool, &tables, config, producer, shutdown).await?)
        }
        Some(BrokerTarget::Sqs(endpoint)) => {
            let producer = HttpOr(http, crate::sqs::producer(&endpoint).await?);
            with_pool!(&db, pool => run(pool, &tables, config, producer, shutdown).await?)
        }
        Some(BrokerTarget::PubSub(project)) => {
            let producer = HttpOr(http, pubsub_producer(&project).await?);
            with_pool!(&db, pool => run(pool, &tables, config, producer, shutdown).await?)
        }
        Some(BrokerTarget::Log(dir)) => {
            let log = EmbeddedLog::open(&dir).with_context(|| format!("--log-dir {}", dir.display()))?;
            let producer = HttpOr(http, AutoTopics { producer: log.producer(), log });
            with_pool!(&db, pool => run(pool, &tables, config, producer, shutdown).await?)
        }
        None => {
            with_pool!(&db, pool => run(pool, &tables, config, HttpOr(http, NoBroker), shutdown).await?)
        }
    };
    if args.json {
        println!("{}", serde_json::to_string(&stats)?);
    } else {
        println!(
            "delivered {}, failed attempts {}, dead-lettered {}",
            stats.delivered, stats.failed, stats.dead_lettered
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn run<DB: OutboxStore, D: Delivery>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    config: RelayConfig,
    delivery: D,
    shutdown: impl std::future::Future + Send,
) -> anyhow::Result<idem::outbox::RelayStats> {
    let relay = Relay::new(pool.clone(), tables.clone(), config, delivery)?;
    Ok(relay.run(shutdown).await?)
}

/// The embedded log's delivery, creating a destination's topic (one partition) the first time it is written.
struct AutoTopics {
    log: EmbeddedLog,
    producer: idem::embedded::LogProducer,
}

impl Delivery for AutoTopics {
    async fn deliver(&self, messages: &[idem::outbox::OutboxMessage]) -> Vec<idem::outbox::Delivered> {
        for m in messages {
            if self.log.partitions(&m.destination).is_err()
                && let Err(error) = self.log.create_topic(&m.destination, 1)
            {
                tracing::warn!(%error, topic = %m.destination, "cannot create the destination's topic");
            }
        }
        self.producer.deliver(messages).await
    }
}

#[cfg(feature = "kafka")]
fn kafka_producer(brokers: &str) -> anyhow::Result<Publish<idem::kafka::KafkaProducer>> {
    Ok(Publish(idem::kafka::KafkaProducer::new(brokers)?))
}

#[cfg(not(feature = "kafka"))]
fn kafka_producer(_: &str) -> anyhow::Result<Publish<idem::embedded::LogProducer>> {
    Err(crate::features::missing("kafka", "--kafka"))
}

#[cfg(feature = "nats")]
async fn nats_producer(
    url: &str,
    waiting: &[idem::outbox::DestinationStats],
) -> anyhow::Result<idem::nats::NatsProducer> {
    let producer = idem::nats::NatsProducer::connect(url).await?;
    // A destination no stream holds is said before its first delivery fails (and again with each failure).
    for destination in waiting.iter().filter(|d| !idem::outbox::is_http(&d.destination)) {
        if let Err(error) = producer.stream_holding(&destination.destination).await {
            tracing::warn!(destination = %destination.destination, pending = destination.pending,
                "outbox relay: {error}; its messages wait until one does");
        }
    }
    Ok(producer)
}

#[cfg(not(feature = "nats"))]
async fn nats_producer(
    _: &str,
    _: &[idem::outbox::DestinationStats],
) -> anyhow::Result<Publish<idem::embedded::LogProducer>> {
    Err(crate::features::missing("nats", "--nats"))
}

#[cfg(feature = "pubsub")]
async fn pubsub_producer(project: &str) -> anyhow::Result<Publish<idem::pubsub::PubSubProducer>> {
    Ok(Publish(idem::pubsub::PubSubProducer::connect(Some(project), None).await?))
}

#[cfg(not(feature = "pubsub"))]
async fn pubsub_producer(_: &str) -> anyhow::Result<Publish<idem::embedded::LogProducer>> {
    Err(crate::features::missing("pubsub", "--pubsub"))
}

#[cfg(feature = "rabbitmq")]
async fn rabbitmq_producer(url: &str) -> anyhow::Result<Publish<idem::rabbitmq::RabbitProducer>> {
    Ok(Publish(idem::rabbitmq::RabbitProducer::connect(url).await?))
}

#[cfg(not(feature = "rabbitmq"))]
async fn rabbitmq_producer(_: &str) -> anyhow::Result<Publish<idem::embedded::LogProducer>> {
    Err(crate::features::missing("rabbitmq", "--rabbitmq"))
}

/// Runs an `idem outbox` command.
pub async fn command(command: OutboxCommand) -> anyhow::Result<ExitCode> {
    match command {
        OutboxCommand::List { db, limit, failing, json } => {
            let (pool, tables) = Db::open_with(&db, "outbox").await?;
            let messages = with_pool!(&pool, pool => idem::outbox::list(pool, &tables, failing, limit).await?);
            if json {
                let rows: Vec<serde_json::Value> = messages
                    .iter()
                    .map(|m| {
                        serde_json::json!({
                            "id": m.id, "event_id": m.event_id, "destination": m.destination,
                            "key": m.key.as_deref().map(String::from_utf8_lossy),
                            "payload": crate::json_payload(&m.payload), "attempts": m.attempts,
                            "last_error": m.last_error, "age_seconds": m.age_seconds,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string(&rows)?);
            } else {
                println!(
                    "{:>8}  {:<36}  {:<20}  {:>8}  {:>9}  last error",
                    "id", "event id", "destination", "attempts", "age"
                );
                for m in &messages {
                    println!(
                        "{:>8}  {:<36}  {:<20}  {:>8}  {:>8.1}s  {}",
                        m.id,
                        m.event_id,
                        m.destination,
                        m.attempts,
                        m.age_seconds,
                        m.last_error.as_deref().unwrap_or("")
                    );
                }
            }
        }
        OutboxCommand::Stats { db, by_destination: true, json } => {
            let (pool, tables) = Db::open_with(&db, "outbox").await?;
            let destinations = with_pool!(&pool, pool => idem::outbox::destinations(pool, &tables).await?);
            if json {
                println!("{}", serde_json::to_string(&destinations)?);
            } else if destinations.is_empty() {
                println!("the outbox is empty");
            } else {
                for d in &destinations {
                    let oldest = d.oldest_age_seconds.map_or("-".to_owned(), |s| format!("{s:.1}s"));
                    println!("{}: pending {}, oldest {oldest}, failing {}", d.destination, d.pending, d.failing);
                }
            }
        }
        OutboxCommand::Stats { db, by_destination: false, json } => {
            let (pool, tables) = Db::open_with(&db, "outbox").await?;
            let stats = with_pool!(&pool, pool => idem::outbox::stats(pool, &tables).await?);
            if json {
                println!("{}", serde_json::to_string(&stats)?);
            } else {
                let oldest = stats.oldest_age_seconds.map_or("-".to_owned(), |s| format!("{s:.1}s"));
                println!("pending {}, oldest {oldest}, failing {}", stats.pending, stats.failing);
            }
        }
        OutboxCommand::Requeue { db, ids, all, relay, actor } => {
            use idem::outbox::requeue::{RequeueError, Requeued, requeue};
            let (pool, tables) = Db::open_with(&db, "outbox").await?;
            let done = with_pool!(&pool, pool => requeue(pool, &tables, &ids, all, relay.as_deref(), false).await);
            let join = idem::dead_letter::selection::join;
            let (done, outcome): (Requeued, anyhow::Result<()>) = match done {
                Ok(done) => (done, Ok(())),
                Err(RequeueError::Refused(why)) => {
                    let named = match (all, relay.as_deref()) {
                        (true, Some(r)) => format!("all of relay {r}"),
                        (true, None) => "all".to_owned(),
                        (false, _) if ids.is_empty() => "nothing named".to_owned(),
                        (false, _) => format!("dead letters {}", join(&ids)),
                    };
                    let refused: anyhow::Result<()> = Err(anyhow::anyhow!("{why}"));
                    crate::audit::note(&pool, &tables, &actor.name(), "outbox requeue", named, &refused, 0).await;
                    bail!(why)
                }
                Err(RequeueError::Failed { done, error }) => (done, Err(error.into())),
            };
            for id in &done.requeued {
                println!("requeued {id}");
            }
            if !done.gone.is_empty() {
                eprintln!("gone meanwhile (requeued since?), left out: {}", join(&done.gone));
            }
            let subjects = format!("dead letters {}", join(&done.chosen));
            let count = done.requeued.len() as i64;
            crate::audit::note(&pool, &tables, &actor.name(), "outbox requeue", subjects, &outcome, count).await;
            outcome?;
            println!("{} dead letter(s) back in the outbox", done.requeued.len());
        }
    }
    Ok(ExitCode::SUCCESS)
}
