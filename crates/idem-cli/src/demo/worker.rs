//! `idem demo-worker`: one consumer process of the demo, with the payments handler, printing one line per commit.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::{Backend, Committed, Config, Engine, Event, Handler, HandlerError, KeyExtractor, Tables};
use serde::Serialize;
use sqlx::{PgConnection, SqliteConnection};

use crate::db::Db;
use crate::signals::Signals;
use crate::with_pool;

use super::{GROUP, PREFIX, TOPIC};

/// Arguments of one consumer process of the demo.
#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// The embedded log's directory.
    #[arg(long, required_unless_present_any = ["kafka", "nats", "rabbitmq", "sqs", "pubsub"])]
    log_dir: Option<PathBuf>,
    /// Google Cloud Pub/Sub (instead of the embedded log): the project; the topic is the subscription. The
    /// emulator through `PUBSUB_EMULATOR_HOST`, else the real service with the standard Google credentials.
    #[arg(long, conflicts_with_all = ["kafka", "log_dir", "nats", "rabbitmq", "sqs"])]
    pubsub: Option<String>,
    /// Pub/Sub: partitions the messages are spread over by ordering key, each handled in order.
    #[arg(long, default_value_t = 8)]
    pubsub_partitions: u32,
    /// Pub/Sub: messages delivered and not yet acknowledged, at most (default: the client's, 1000).
    #[arg(long)]
    pubsub_outstanding: Option<i64>,
    /// Pub/Sub: seconds without a message that count as the end of the subscription (without --follow).
    #[arg(long, default_value_t = 3)]
    idle_end_secs: u64,
    /// Amazon SQS (instead of the embedded log): an SQS-compatible endpoint (http://127.0.0.1:9324) or `aws`
    /// for the standard AWS configuration's; the topic is the queue's name or URL.
    #[arg(long, conflicts_with_all = ["kafka", "log_dir", "nats", "rabbitmq"])]
    sqs: Option<String>,
    /// SQS: the longest a batch may take from receipt to commit, in seconds; start-up is refused when the queue's
    /// visibility timeout is shorter.
    #[arg(long, default_value_t = 30)]
    max_batch_secs: u64,
    /// SQS: partitions the messages are spread over (by message group on FIFO queues), each handled in order.
    #[arg(long, default_value_t = 8)]
    sqs_partitions: u32,
    /// SQS: receives after which a message is dead-lettered instead of handled again.
    #[arg(long)]
    max_receive_count: Option<u32>,
    /// RabbitMQ server (instead of the embedded log), amqp://user:password@host:port/vhost: consumes every
    /// `--queue`, each one partition.
    #[arg(long, conflicts_with_all = ["kafka", "log_dir", "nats"])]
    rabbitmq: Option<String>,
    /// RabbitMQ: a queue to consume; repeatable (default: the topic).
    #[arg(long = "queue")]
    queues: Vec<String>,
    /// RabbitMQ: unacknowledged deliveries per queue (default: the batch size; 1 keeps strict order).
    #[arg(long)]
    prefetch: Option<u16>,
    /// NATS server (instead of the embedded log): the topic is the JetStream stream, the group its durable
    /// consumer.
    #[arg(long, conflicts_with_all = ["kafka", "log_dir"])]
    nats: Option<String>,
    /// NATS: AckWait of the durable consumer when it is created, in seconds; batches may take at most this long.
    #[arg(long, default_value_t = 30)]
    ack_wait_secs: u64,
    /// NATS: partitions the stream's messages are spread over by subject (each in order, in parallel).
    #[arg(long, default_value_t = 1)]
    nats_partitions: u32,
    /// NATS: one message in flight (max_ack_pending 1), so order holds across redeliveries.
    #[arg(long)]
    strict_order: bool,
    /// Kafka brokers (instead of the embedded log).
    #[arg(long)]
    kafka: Option<String>,
    /// Extra librdkafka setting, KEY=VALUE; repeatable.
    #[arg(long = "kafka-setting")]
    kafka_settings: Vec<String>,
    /// The topic.
    #[arg(long, default_value = TOPIC)]
    topic: String,
    /// The consumer group.
    #[arg(long, default_value = GROUP)]
    group: String,
    /// Keep consuming at the end of the log instead of exiting (until SIGINT or SIGTERM).
    #[arg(long)]
    follow: bool,
    /// Kill this process with SIGKILL at a point of the transaction order: `before-commit:N` or
    /// `after-commit:N` (the demo's planned crashes, the crash tests).
    #[arg(long, hide = true)]
    fault: Option<String>,
    /// Serve /metrics, /healthz and /readyz on this address (e.g. 127.0.0.1:9464).
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// The database.
    #[arg(long, env = "IDEM_DATABASE_URL")]
    database_url: String,
    /// Messages per transaction.
    #[arg(long, default_value_t = 100)]
    batch_size: usize,
    /// Connections in the pool.
    #[arg(long, default_value_t = 5)]
    connections: u32,
    /// The chain demo's first stage: with each credit, enqueue a `PaymentCredited` event for this topic in the
    /// outbox, in the same transaction.
    #[arg(long, conflicts_with = "second_ledger")]
    announce: Option<String>,
    /// The chain demo's second stage: apply `PaymentCredited` events (keyed by their `idem-event-id` header) to
    /// the second ledger, checking each account's sequence.
    #[arg(long)]
    second_ledger: bool,
    /// Milliseconds the handler waits before each event, so a batch stays in hand for a while (the revocation
    /// test uses it).
    #[arg(long, default_value_t = 0, hide = true)]
    handler_delay_ms: u64,
    /// Attempts of a batch that fails retryably before its message is dead-lettered (or parked).
    #[arg(long, default_value_t = 10)]
    max_attempts: u32,
    /// Delayed retries after the immediate ones, as a schedule (`1s,5s,30s`): a message that still fails is
    /// parked and its partition goes on (see `idem parked`).
    #[arg(long, value_delimiter = ',')]
    delayed_retries: Vec<String>,
    /// Accounts some of whose credits (every fifth payment) fail retryably, as if a row they reference had not
    /// arrived yet, until --flaky-until-ms; their other credits succeed (the delayed retries' tests and the chaos
    /// harness).
    #[arg(long, value_delimiter = ',', hide = true)]
    flaky_accounts: Vec<i64>,
    /// When the flaky accounts clear, in milliseconds since the epoch: the same moment for every worker process.
    #[arg(long, default_value_t = 0, hide = true)]
    flaky_until_ms: i64,
}

/// One line of a consumer's stdout: what one transaction committed.
#[derive(Debug, Serialize, serde::Deserialize)]
pub(super) struct CommitReport {
    pub(super) processed: u64,
    pub(super) duplicate: u64,
    pub(super) dead_lettered: u64,
    /// Events whose id came again with another payload.
    #[serde(default)]
    pub(super) id_reused: u64,
}

/// `idem demo-worker`: consumes the demo's events until their end (or, with `--follow`, until a signal),
/// printing one line per commit (and, on Kafka, one per assignment).
pub async fn worker(args: WorkerArgs) -> anyhow::Result<ExitCode> {
    // Registered before anything else, so a signal during start-up ends the run cleanly once it begins.
    let signals = Signals::install()?;
    // Arguments first, before anything is opened: a mistake is named at once.
    if args.connections == 0 {
        bail!("--connections 0: the consumer needs at least one connection per partition it consumes, plus one");
    }
    if args.batch_size == 0 {
        bail!("--batch-size 0: use at least 1");
    }
    if let Some(setting) = args.kafka_settings.iter().find(|s| !s.contains('=')) {
        bail!("--kafka-setting `{setting}` is not KEY=VALUE (for example session.timeout.ms=6000)");
    }
    if args.kafka.is_none() && !args.kafka_settings.is_empty() {
        bail!("--kafka-setting applies to Kafka only: give --kafka BROKERS, or leave the settings out");
    }
    crate::features::require_flags(&[
        ("kafka", args.kafka.is_some()),
        ("nats", args.nats.is_some()),
        ("rabbitmq", args.rabbitmq.is_some()),
        ("sqs", args.sqs.is_some()),
        ("pubsub", args.pubsub.is_some()),
    ])?;
    let key = if args.second_ledger {
        KeyExtractor::Header(idem::message::EVENT_ID_HEADER.into())
    } else {
        KeyExtractor::JsonPointer("/idempotencyKey".into())
    };
    let mut config =
        Config::new(args.group.clone(), key).batch_size(args.batch_size).tables(Tables::new(None, PREFIX)?);
    config = config.max_attempts(args.max_attempts);
    if !args.delayed_retries.is_empty() {
        config = config.delayed_retries(idem::DelayedRetries::parse(&args.delayed_retries)?);
    }
    let db = Db::open(&args.database_url, args.connections).await?;
    let stage = match (&args.announce, args.second_ledger) {
        (Some(topic), _) => Stage::Announce(topic.clone()),
        (None, true) => Stage::Second,
        (None, false) => Stage::Credit,
    };
    let flaky = Flaky { accounts: args.flaky_accounts.clone(), until_ms: args.flaky_until_ms };
    let credit = Credit { delay: std::time::Duration::from_millis(args.handler_delay_ms), stage, flaky };
    if let Some(url) = &args.nats {
        return nats(url, &args, config, db, credit, signals).await;
    }
    if let Some(url) = &args.rabbitmq {
        return rabbitmq(url, &args, config, db, credit, signals).await;
    }
    if let Some(endpoint) = &args.sqs {
        return sqs(endpoint, &args, config, db, credit, signals).await;
    }
    if let Some(project) = &args.pubsub {
        return pubsub(project, &args, config, db, credit, signals).await;
    }
    match (&args.kafka, &args.log_dir) {
        (Some(brokers), _) => kafka(brokers, &args, config, db, credit, signals).await,
        (None, Some(dir)) => {
            let log = EmbeddedLog::open(dir)?;
            let options = ConsumerOptions { stop_at_end: !args.follow, ..ConsumerOptions::default() };
            let source = log.consumer(&args.group, &[args.topic.as_str()], options)?;
            consume(source, &args, config, db, credit, signals).await
        }
        (None, None) => bail!("give --log-dir, --kafka, --nats, --rabbitmq, --sqs or --pubsub"),
    }
}

/// Runs the demo's handler on `source` to its end (or until a signal). The source is boxed: the engine is compiled
/// once per database, not once per broker and database.
async fn consume(
    source: impl idem::Source,
    args: &WorkerArgs,
    config: Config,
    db: Db,
    credit: Credit,
    signals: Signals,
) -> anyhow::Result<ExitCode> {
    let faults = faults(args.fault.as_deref())?;
    let source = idem::BoxedSource::new(source);
    with_pool!(db, pool => consume_with(pool, source, config, credit, args.metrics_addr, faults, signals).await?);
    Ok(ExitCode::SUCCESS)
}

#[cfg(feature = "kafka")]
async fn kafka(
    brokers: &str,
    args: &WorkerArgs,
    config: Config,
    db: Db,
    credit: Credit,
    signals: Signals,
) -> anyhow::Result<ExitCode> {
    let mut kafka = idem::kafka::KafkaConfig::new(brokers, &[args.topic.as_str()]);
    for setting in &args.kafka_settings {
        let Some((key, value)) = setting.split_once('=') else {
            bail!("--kafka-setting `{setting}` is not KEY=VALUE");
        };
        kafka = kafka.set(key, value);
    }
    kafka.stop_at_end = !args.follow;
    let observer: idem::kafka::consumer::AssignmentObserver = std::sync::Arc::new(report_assignment);
    let source = idem::kafka::KafkaSource::connect_observed(&kafka, &config, Some(observer)).await?;
    consume(source, args, config, db, credit, signals).await
}

#[cfg(not(feature = "kafka"))]
async fn kafka(_: &str, _: &WorkerArgs, _: Config, _: Db, _: Credit, _: Signals) -> anyhow::Result<ExitCode> {
    Err(crate::features::missing("kafka", "--kafka"))
}

#[cfg(feature = "nats")]
async fn nats(
    url: &str,
    args: &WorkerArgs,
    config: Config,
    db: Db,
    credit: Credit,
    signals: Signals,
) -> anyhow::Result<ExitCode> {
    let ack_wait = std::time::Duration::from_secs(args.ack_wait_secs);
    let nats = idem::nats::NatsConfig {
        ack_wait,
        max_batch_time: ack_wait.min(std::time::Duration::from_secs(10)),
        stop_at_end: !args.follow,
        max_ack_pending: args.strict_order.then_some(1),
        partitions: args.nats_partitions,
        ..idem::nats::NatsConfig::new(url, args.topic.as_str())
    };
    let source = idem::nats::NatsSource::connect(&nats, &config).await?;
    consume(source, args, config, db, credit, signals).await
}

#[cfg(feature = "rabbitmq")]
async fn rabbitmq(
    url: &str,
    args: &WorkerArgs,
    config: Config,
    db: Db,
    credit: Credit,
    signals: Signals,
) -> anyhow::Result<ExitCode> {
    let queues: Vec<&str> = match args.queues.is_empty() {
        true => vec![args.topic.as_str()],
        false => args.queues.iter().map(String::as_str).collect(),
    };
    let rabbit = idem::rabbitmq::RabbitConfig {
        prefetch: args.prefetch,
        stop_at_end: !args.follow,
        ..idem::rabbitmq::RabbitConfig::new(url, &queues)
    };
    let source = idem::rabbitmq::RabbitSource::connect(&rabbit, &config).await?;
    consume(source, args, config, db, credit, signals).await
}

#[cfg(feature = "sqs")]
async fn sqs(
    endpoint: &str,
    args: &WorkerArgs,
    config: Config,
    db: Db,
    credit: Credit,
    signals: Signals,
) -> anyhow::Result<ExitCode> {
    let sqs = idem::sqs::SqsConfig {
        endpoint: crate::sqs::endpoint(endpoint).map(str::to_owned),
        max_batch_time: std::time::Duration::from_secs(args.max_batch_secs),
        partitions: args.sqs_partitions,
        max_receive_count: args.max_receive_count,
        stop_at_end: !args.follow,
        ..idem::sqs::SqsConfig::new(args.topic.as_str())
    };
    let source = idem::sqs::SqsSource::connect(&sqs, &config).await?;
    consume(source, args, config, db, credit, signals).await
}

#[cfg(feature = "pubsub")]
async fn pubsub(
    project: &str,
    args: &WorkerArgs,
    config: Config,
    db: Db,
    credit: Credit,
    signals: Signals,
) -> anyhow::Result<ExitCode> {
    let pubsub = idem::pubsub::PubSubConfig {
        project: Some(project.to_owned()),
        partitions: args.pubsub_partitions,
        max_batch_time: std::time::Duration::from_secs(3),
        max_outstanding_messages: args.pubsub_outstanding,
        require_ordering: true,
        stop_at_end: !args.follow,
        idle_end: std::time::Duration::from_secs(args.idle_end_secs),
        ..idem::pubsub::PubSubConfig::new(args.topic.as_str())
    };
    let source = idem::pubsub::PubSubSource::connect(&pubsub, &config).await?;
    consume(source, args, config, db, credit, signals).await
}

#[cfg(not(feature = "pubsub"))]
async fn pubsub(_: &str, _: &WorkerArgs, _: Config, _: Db, _: Credit, _: Signals) -> anyhow::Result<ExitCode> {
    Err(crate::features::missing("pubsub", "--pubsub"))
}

#[cfg(not(feature = "sqs"))]
async fn sqs(_: &str, _: &WorkerArgs, _: Config, _: Db, _: Credit, _: Signals) -> anyhow::Result<ExitCode> {
    Err(crate::features::missing("sqs", "--sqs"))
}

#[cfg(not(feature = "rabbitmq"))]
async fn rabbitmq(_: &str, _: &WorkerArgs, _: Config, _: Db, _: Credit, _: Signals) -> anyhow::Result<ExitCode> {
    Err(crate::features::missing("rabbitmq", "--rabbitmq"))
}

#[cfg(not(feature = "nats"))]
async fn nats(_: &str, _: &WorkerArgs, _: Config, _: Db, _: Credit, _: Signals) -> anyhow::Result<ExitCode> {
    Err(crate::features::missing("nats", "--nats"))
}

#[cfg(feature = "kafka")]
fn report_assignment(partitions: &[idem::source::Partition]) {
    let numbers: Vec<i32> = partitions.iter().map(|p| p.partition).collect();
    report_line(serde_json::json!({ "assigned": numbers }));
}

/// The fault a consumer process of the demo arms (`--fault`), if any.
pub(crate) fn faults(spec: Option<&str>) -> anyhow::Result<Option<idem::fault::Faults>> {
    Ok(spec.map(idem::fault::Faults::parse).transpose()?)
}

async fn consume_with<DB: Backend, H: Handler<DB>>(
    pool: sqlx::Pool<DB>,
    source: idem::BoxedSource,
    config: Config,
    handler: H,
    metrics_addr: Option<std::net::SocketAddr>,
    faults: Option<idem::fault::Faults>,
    signals: Signals,
) -> anyhow::Result<()> {
    let mut engine = Engine::new(pool, config)?.on_commit(report_commit);
    if let Some(faults) = faults {
        engine = engine.with_faults(faults);
    }
    if let Some(addr) = metrics_addr {
        let recorder = idem::http::install_recorder()?;
        let bound = idem::http::serve(addr, recorder, engine.clone()).await?;
        report_line(serde_json::json!({ "metrics_addr": bound.to_string() }));
    }
    engine.run(source, handler, signals.received()).await?;
    Ok(())
}

pub(super) fn report_line(value: serde_json::Value) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{value}");
    let _ = out.flush();
}

/// Writes the commit to stdout before the acknowledgement (and before the after-commit fault point), so the
/// parent's counts include every committed transaction even when the process is killed right after.
pub fn report_commit(committed: &Committed) {
    use std::io::Write;
    let report = CommitReport {
        processed: committed.processed,
        duplicate: committed.duplicate,
        dead_lettered: committed.dead_lettered,
        id_reused: committed.id_reused,
    };
    if let Ok(line) = serde_json::to_string(&report) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

/// The demo's handler: one ledger entry and one balance update per payment.
struct Credit {
    /// How long to wait before each event (zero but in tests).
    delay: std::time::Duration,
    /// Which of the chain demo's stages this consumer is (or the plain demo's).
    stage: Stage,
    /// Accounts that fail for a while (none but in tests).
    flaky: Flaky,
}

/// Accounts some of whose credits fail retryably until a moment every worker process agrees on: those whose
/// payment number (`pay-000000045`) is a multiple of five.
#[derive(Default)]
struct Flaky {
    accounts: Vec<i64>,
    until_ms: i64,
}

impl Flaky {
    fn check(&self, account: i64, event_id: &str) -> Result<(), HandlerError> {
        if !self.accounts.contains(&account) {
            return Ok(());
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        let number = event_id.trim_start_matches("pay-").parse::<u64>().unwrap_or(1);
        if number % 5 == 0 && (now as i64) < self.until_ms {
            return Err(HandlerError::retryable(format!(
                "payment {event_id} of account {account} references a row not there yet (the demo's flaky accounts)"
            )));
        }
        Ok(())
    }
}

/// What a demo consumer does with an event.
enum Stage {
    /// The plain demo: credit the account.
    Credit,
    /// The chain's first stage: credit the account and enqueue a `PaymentCredited` event for this topic.
    Announce(String),
    /// The chain's second stage: apply a `PaymentCredited` event to the second ledger.
    Second,
}

impl Credit {
    async fn pause(&self) {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
    }
}

#[derive(serde::Deserialize)]
struct Payment {
    account: i64,
    amount: i64,
}

/// The chain's event: a payment was credited; `seq` numbers the credits of the account, in commit order.
#[derive(serde::Serialize, serde::Deserialize)]
struct PaymentCredited {
    account: i64,
    amount: i64,
    seq: i64,
    payment: String,
}

const INSERT_ENTRY: &str = "INSERT INTO idem_demo_ledger (event_id, account, amount) VALUES ($1, $2, $3)";
const CREDIT: &str =
    "UPDATE idem_demo_accounts SET balance = balance + $1, credits = credits + 1 WHERE id = $2 RETURNING credits";
const INSERT_SECOND: &str = "INSERT INTO idem_demo_ledger2 (event_id, account, amount) VALUES ($1, $2, $3)";
/// Applies a credit to the second ledger and counts it out of order unless it follows the account's last one.
const APPLY_SECOND: &str = "UPDATE idem_demo_accounts2 SET balance = balance + $1, last_seq = $3,
       out_of_order = out_of_order + CASE WHEN last_seq = $3 - 1 THEN 0 ELSE 1 END
     WHERE id = $2";

fn unknown_account(account: i64) -> HandlerError {
    HandlerError::permanent(format!("account {account} does not exist"))
}

/// The handler over either store: the statements are the same, the connection type differs.
macro_rules! credit_handler {
    ($db:ty, $conn:ty) => {
        impl Handler<$db> for Credit {
            async fn handle(&self, event: &Event, tx: &mut $conn) -> Result<(), HandlerError> {
                self.pause().await;
                if let Stage::Second = self.stage {
                    let c: PaymentCredited = event.json()?;
                    sqlx::query(INSERT_SECOND).bind(&event.id).bind(c.account).bind(c.amount).execute(&mut *tx).await?;
                    let applied =
                        sqlx::query(APPLY_SECOND).bind(c.amount).bind(c.account).bind(c.seq).execute(&mut *tx).await?;
                    if applied.rows_affected() != 1 {
                        return Err(unknown_account(c.account));
                    }
                    return Ok(());
                }
                let p: Payment = event.json()?;
                self.flaky.check(p.account, &event.id)?;
                sqlx::query(INSERT_ENTRY).bind(&event.id).bind(p.account).bind(p.amount).execute(&mut *tx).await?;
                let seq: Option<i64> =
                    sqlx::query_scalar(CREDIT).bind(p.amount).bind(p.account).fetch_optional(&mut *tx).await?;
                let Some(seq) = seq else { return Err(unknown_account(p.account)) };
                if let Stage::Announce(topic) = &self.stage {
                    let credited =
                        PaymentCredited { account: p.account, amount: p.amount, seq, payment: event.id.clone() };
                    let body = serde_json::to_vec(&credited).map_err(|e| HandlerError::permanent(e.to_string()))?;
                    let message =
                        idem::outbox::OutgoingMessage::new(topic.as_str(), body).with_key(p.account.to_string());
                    idem::outbox::Outbox::new(
                        Tables::new(None, PREFIX).map_err(|e| HandlerError::permanent(e.to_string()))?,
                    )
                    .enqueue(&mut *tx, message)
                    .await?;
                }
                Ok(())
            }
        }
    };
}

credit_handler!(sqlx::Postgres, PgConnection);
credit_handler!(sqlx::Sqlite, SqliteConnection);

/// The demo's handler on MySQL: its placeholders are `?`, its `UPDATE` returns nothing (the credit count is read
/// back under the row lock the update took), and the second stage counts out-of-order credits before it moves
/// `last_seq` (MySQL assigns left to right, each assignment seeing the ones before it).
impl Handler<sqlx::MySql> for Credit {
    async fn handle(&self, event: &Event, tx: &mut sqlx::MySqlConnection) -> Result<(), HandlerError> {
        self.pause().await;
        if let Stage::Second = self.stage {
            let c: PaymentCredited = event.json()?;
            sqlx::query("INSERT INTO idem_demo_ledger2 (event_id, account, amount) VALUES (?, ?, ?)")
                .bind(&event.id)
                .bind(c.account)
                .bind(c.amount)
                .execute(&mut *tx)
                .await?;
            let applied = sqlx::query(
                "UPDATE idem_demo_accounts2 SET balance = balance + ?,
                        out_of_order = out_of_order + CASE WHEN last_seq = ? - 1 THEN 0 ELSE 1 END, last_seq = ?
                  WHERE id = ?",
            )
            .bind(c.amount)
            .bind(c.seq)
            .bind(c.seq)
            .bind(c.account)
            .execute(&mut *tx)
            .await?;
            if applied.rows_affected() != 1 {
                return Err(unknown_account(c.account));
            }
            return Ok(());
        }
        let p: Payment = event.json()?;
        self.flaky.check(p.account, &event.id)?;
        sqlx::query("INSERT INTO idem_demo_ledger (event_id, account, amount) VALUES (?, ?, ?)")
            .bind(&event.id)
            .bind(p.account)
            .bind(p.amount)
            .execute(&mut *tx)
            .await?;
        let updated =
            sqlx::query("UPDATE idem_demo_accounts SET balance = balance + ?, credits = credits + 1 WHERE id = ?")
                .bind(p.amount)
                .bind(p.account)
                .execute(&mut *tx)
                .await?;
        if updated.rows_affected() != 1 {
            return Err(unknown_account(p.account));
        }
        if let Stage::Announce(topic) = &self.stage {
            let seq: i64 = sqlx::query_scalar("SELECT credits FROM idem_demo_accounts WHERE id = ?")
                .bind(p.account)
                .fetch_one(&mut *tx)
                .await?;
            let credited = PaymentCredited { account: p.account, amount: p.amount, seq, payment: event.id.clone() };
            let body = serde_json::to_vec(&credited).map_err(|e| HandlerError::permanent(e.to_string()))?;
            let message = idem::outbox::OutgoingMessage::new(topic.as_str(), body).with_key(p.account.to_string());
            idem::outbox::Outbox::new(Tables::new(None, PREFIX).map_err(|e| HandlerError::permanent(e.to_string()))?)
                .enqueue(&mut *tx, message)
                .await?;
        }
        Ok(())
    }
}

/// The demo's handler under the duplicate test kit: every scenario leaves the ledger and the balances as one clean
/// delivery does, on SQLite, PostgreSQL and MySQL.
#[cfg(test)]
mod kit {
    use idem::testing::DuplicateKit;
    use idem::{Config, KeyExtractor, Message, Tables};

    use super::{Credit, Flaky, PREFIX, Stage};
    use crate::db::Db;

    fn payments() -> Vec<Message> {
        (0..20)
            .map(|i| {
                let payload = format!(r#"{{"id":"pay-{i}","account":{},"amount":{}}}"#, 1 + i % 4, 100 + i);
                Message::new("payments", 0, i, payload)
            })
            .collect()
    }

    const RESET: &str = "DELETE FROM idem_demo_ledger; UPDATE idem_demo_accounts SET balance = 0, credits = 0";
    const SNAPSHOT: &str =
        "SELECT a.id, a.balance, a.credits, (SELECT count(*) FROM idem_demo_ledger l WHERE l.account = a.id)
                              FROM idem_demo_accounts a WHERE a.id <= 4 ORDER BY a.id";

    macro_rules! kit_test {
        ($name:ident, $db:ident, $url:expr) => {
            #[tokio::test]
            async fn $name() {
                let url = $url;
                let db = Db::open(&url, 8).await.expect("database");
                let tables = Tables::new(None, PREFIX).expect("tables");
                super::super::prepare(&db, &tables).await.expect("demo tables");
                let Db::$db(pool) = db else { unreachable!() };
                let config = Config::new("demo-kit", KeyExtractor::JsonPointer("/id".into())).tables(tables);
                let kit = DuplicateKit::new(
                    pool.clone(),
                    config,
                    async |conn| sqlx::raw_sql(RESET).execute(conn).await.map(drop),
                    async |conn| sqlx::query_as::<_, (i64, i64, i64, i64)>(SNAPSHOT).fetch_all(conn).await,
                )
                .shuffle_by(KeyExtractor::JsonPointer("/account".into()));
                let handler =
                    Credit { delay: std::time::Duration::ZERO, stage: Stage::Credit, flaky: Flaky::default() };
                let report = kit.check(&handler, &payments()).await.expect("kit");
                pool.close().await;
                drop_database(&url).await;
                report.assert_exactly_once();
            }
        };
    }

    async fn drop_database(url: &str) {
        match url.rsplit_once('/') {
            Some((server, name)) if url.starts_with("postgres") => {
                if let Ok(admin) = Db::open(&format!("{server}/postgres"), 1).await {
                    let _ = admin.execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
                }
            }
            Some((server, name)) if url.starts_with("mysql") => {
                if let Ok(admin) = Db::open(&format!("{server}/mysql"), 1).await {
                    let _ = admin.execute(&format!("DROP DATABASE IF EXISTS {name}")).await;
                }
            }
            _ => {
                let _ = std::fs::remove_file(url.trim_start_matches("sqlite://"));
            }
        }
    }

    kit_test!(the_demo_handler_is_exactly_once_on_sqlite, Sqlite, {
        let path = std::env::temp_dir().join(format!("idem-demo-kit-{}.db", std::process::id()));
        let _ = std::fs::remove_file(&path);
        std::fs::File::create(&path).expect("sqlite file");
        format!("sqlite://{}", path.display())
    });
    kit_test!(the_demo_handler_is_exactly_once_on_postgres, Postgres, {
        // A database of its own, so that no other test's demo tables are touched.
        let server =
            std::env::var("IDEM_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
        let name = format!("idem_demo_kit_{}", std::process::id());
        let admin = Db::open(&format!("{server}/postgres"), 1).await.expect("PostgreSQL");
        admin.execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await.expect("drop");
        admin.execute(&format!("CREATE DATABASE {name}")).await.expect("create");
        format!("{server}/{name}")
    });
    kit_test!(the_demo_handler_is_exactly_once_on_mysql, Mysql, {
        let server = std::env::var("IDEM_TEST_MYSQL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".into());
        let name = format!("idem_demo_kit_{}", std::process::id());
        let admin = Db::open(&format!("{server}/mysql"), 1).await.expect("MySQL or MariaDB");
        admin.execute(&format!("DROP DATABASE IF EXISTS {name}")).await.expect("drop");
        admin.execute(&format!("CREATE DATABASE {name}")).await.expect("create");
        format!("{server}/{name}")
    });
}
