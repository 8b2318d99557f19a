//! The demo's events: payments with producer retries and poison messages, generated from a seed, written into
//! the embedded log or a Kafka topic; `idem demo-produce` for harnesses that run `demo-worker` themselves.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use idem::embedded::EmbeddedLog;

use super::worker::report_line;
use super::{ACCOUNTS, TOPIC, validate_events};

/// Arguments of `idem demo-produce`: the demo's events written into an embedded log, for harnesses that run
/// `demo-worker` themselves.
#[derive(clap::Args, Debug)]
pub struct ProduceArgs {
    /// The embedded log's directory; it must not exist yet or be empty.
    #[arg(long, required_unless_present = "kafka", conflicts_with = "kafka")]
    log_dir: Option<PathBuf>,
    /// Produce to these Kafka brokers (host:port) instead, into a new topic --topic.
    #[arg(long)]
    kafka: Option<String>,
    /// The topic.
    #[arg(long, default_value = TOPIC)]
    topic: String,
    /// Payment events to produce.
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Partitions of the payments topic.
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Seed of the event generator.
    #[arg(long)]
    seed: u64,
    /// Percentage of events the producer sends twice (producer retries), 0 to 50.
    #[arg(long, default_value_t = 2.0)]
    duplicates: f64,
}

/// What the producer wrote, and so what the ledger must hold.
#[derive(Debug, Default, Clone)]
pub(super) struct Plan {
    pub(super) events: u64,
    pub(super) producer_duplicates: u64,
    pub(super) records: u64,
    pub(super) poison: u64,
    pub(super) poison_with_key: u64,
    pub(super) expected_total: i64,
    pub(super) expected_entries: i64,
}

/// SplitMix64: a small, seedable generator, enough for a demo.
pub struct Rng(pub u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

/// The events: each payment once, some a second time a little later (a producer retry), and three poison
/// messages: one that does not decode, one for an unknown account, one without an idempotency key. Each record
/// is (account, payload); the account is the message key.
pub(super) fn generate(events: u64, duplicates: f64, seed: u64) -> (Plan, Vec<(i64, String)>) {
    let mut rng = Rng(seed);
    let mut plan = Plan::default();
    let mut records = Vec::with_capacity(events as usize + events as usize / 20);
    let mut retries: Vec<(u64, i64, String)> = Vec::new();
    let duplicate_per_million = (duplicates * 10_000.0) as u64;
    let poison_at = [events / 4, events / 2, events * 3 / 4];
    for n in 0..events {
        let account = 1 + rng.below(ACCOUNTS as u64) as i64;
        let amount = 1 + rng.below(100_000) as i64;
        let payload = format!(r#"{{"idempotencyKey":"pay-{n:09}","account":{account},"amount":{amount}}}"#);
        records.push((account, payload.clone()));
        plan.events += 1;
        plan.expected_total += amount;
        plan.expected_entries += 1;
        if rng.below(1_000_000) < duplicate_per_million {
            retries.push((n + rng.below(50), account, payload));
            plan.producer_duplicates += 1;
        }
        records.extend(drain_due(&mut retries, n).into_iter().map(|(_, account, payload)| (account, payload)));
        if let Some(which) = poison_at.iter().position(|&at| at == n) {
            let poison = match which {
                0 => format!(r#"{{"idempotencyKey":"poison-{n}","account":1,"amount":"12.00 EUR"}}"#),
                1 => format!(r#"{{"idempotencyKey":"poison-{n}","account":{},"amount":100}}"#, ACCOUNTS + 7),
                _ => r#"{"account":1,"amount":100}"#.to_owned(),
            };
            records.push((1, poison));
            plan.events += 1;
            plan.poison += 1;
            plan.poison_with_key += u64::from(which < 2);
        }
    }
    records.extend(retries.into_iter().map(|(_, account, payload)| (account, payload)));
    plan.records = records.len() as u64;
    (plan, records)
}

pub(super) fn write_embedded(log_dir: &Path, partitions: i32, records: &[(i64, String)]) -> anyhow::Result<()> {
    let log = EmbeddedLog::open(log_dir)?;
    log.create_topic(TOPIC, partitions)?;
    let producer = log.producer();
    let progress = indicatif::ProgressBar::new(records.len() as u64);
    progress.set_style(
        indicatif::ProgressStyle::with_template("{spinner} producing {bar:40} {pos}/{len} records {rate}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .with_key("rate", crate::commands::rate),
    );
    for (n, (account, payload)) in records.iter().enumerate() {
        producer.send(TOPIC, Some(account.to_string().as_bytes()), payload.as_bytes(), &[])?;
        if n % 4096 == 0 {
            progress.set_position(n as u64);
        }
    }
    producer.flush()?;
    progress.finish_and_clear();
    Ok(())
}

/// Creates a Kafka topic of the demo's (explicit 7-day retention).
#[cfg(feature = "kafka")]
pub async fn create_kafka_topic(brokers: &str, topic: &str, partitions: i32) -> anyhow::Result<()> {
    Ok(idem::kafka::create_topic(brokers, topic, partitions, 7 * 24 * 3_600_000).await?)
}

/// Without the `kafka` feature: refused.
#[cfg(not(feature = "kafka"))]
pub async fn create_kafka_topic(_: &str, _: &str, _: i32) -> anyhow::Result<()> {
    Err(crate::features::missing("kafka", "--kafka"))
}

/// Without the `kafka` feature: refused.
#[cfg(not(feature = "kafka"))]
pub async fn write_kafka(_: &str, _: &str, _: i32, _: &[(i64, String)]) -> anyhow::Result<()> {
    Err(crate::features::missing("kafka", "--kafka"))
}

/// Produces to a fresh topic (explicit 7-day retention) through the idempotent producer helper, many sends in
/// flight at once.
#[cfg(feature = "kafka")]
pub async fn write_kafka(brokers: &str, topic: &str, partitions: i32, records: &[(i64, String)]) -> anyhow::Result<()> {
    create_kafka_topic(brokers, topic, partitions).await?;
    let producer = std::sync::Arc::new(idem::kafka::KafkaProducer::new(brokers)?);
    for chunk in records.chunks(2000) {
        let mut sends = tokio::task::JoinSet::new();
        for (account, payload) in chunk {
            let (producer, topic, account, payload) =
                (std::sync::Arc::clone(&producer), topic.to_owned(), *account, payload.clone());
            sends.spawn(async move {
                producer.send(&topic, Some(account.to_string().as_bytes()), payload.as_bytes(), &[]).await
            });
        }
        while let Some(sent) = sends.join_next().await {
            sent??;
        }
    }
    Ok(())
}

/// Creates stream `stream` over `<stream>.*` and publishes the records to `<stream>.<account>`, in order.
#[cfg(feature = "nats")]
pub async fn write_nats(url: &str, stream: &str, records: &[(i64, String)]) -> anyhow::Result<()> {
    idem::nats::create_stream(url, stream, &[&format!("{stream}.*")], std::time::Duration::from_secs(7 * 86_400))
        .await?;
    let producer = idem::nats::NatsProducer::connect(url).await?;
    for chunk in records.chunks(2000) {
        let messages: Vec<(String, Vec<u8>)> = chunk
            .iter()
            .map(|(account, payload)| (format!("{stream}.{account}"), payload.clone().into_bytes()))
            .collect();
        producer.send_in_order(&messages).await?;
    }
    Ok(())
}

/// Without the `nats` feature: refused.
#[cfg(not(feature = "nats"))]
pub async fn write_nats(_: &str, _: &str, _: &[(i64, String)]) -> anyhow::Result<()> {
    Err(crate::features::missing("nats", "--nats"))
}

/// Declares `queues` (durable) and publishes each record to the queue of its account, in order.
#[cfg(feature = "rabbitmq")]
pub async fn write_rabbitmq(url: &str, queues: &[String], records: &[(i64, String)]) -> anyhow::Result<()> {
    for queue in queues {
        idem::rabbitmq::create_queue(url, queue, false).await?;
    }
    let producer = idem::rabbitmq::RabbitProducer::connect(url).await?;
    for chunk in records.chunks(2000) {
        let messages: Vec<(String, Vec<u8>)> = chunk
            .iter()
            .map(|(account, payload)| {
                let queue = &queues[account.rem_euclid(queues.len() as i64) as usize];
                (queue.clone(), payload.clone().into_bytes())
            })
            .collect();
        producer.send_in_order(&messages).await?;
    }
    Ok(())
}

/// Without the `rabbitmq` feature: refused.
#[cfg(not(feature = "rabbitmq"))]
pub async fn write_rabbitmq(_: &str, _: &[String], _: &[(i64, String)]) -> anyhow::Result<()> {
    Err(crate::features::missing("rabbitmq", "--rabbitmq"))
}

fn drain_due(retries: &mut Vec<(u64, i64, String)>, n: u64) -> Vec<(u64, i64, String)> {
    let (due, later): (Vec<_>, Vec<_>) = std::mem::take(retries).into_iter().partition(|(at, _, _)| *at <= n);
    *retries = later;
    due
}

/// `idem demo-produce`: writes the demo's events into a fresh embedded log (or Kafka topic) and prints the plan (what the ledger
/// must hold once they are consumed) as one JSON line.
pub async fn produce(args: ProduceArgs) -> anyhow::Result<ExitCode> {
    validate_events(args.events, args.duplicates, args.partitions)?;
    crate::features::require_flags(&[("kafka", args.kafka.is_some())])?;
    let (plan, records) = generate(args.events, args.duplicates, args.seed);
    match (&args.kafka, &args.log_dir) {
        (Some(brokers), _) => write_kafka(brokers, &args.topic, args.partitions, &records)
            .await
            .context("producing the events to Kafka")?,
        (None, Some(dir)) => {
            if args.topic != TOPIC {
                bail!("--topic is for --kafka; the embedded log's topic is {TOPIC}");
            }
            if std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_some()) {
                bail!("--log-dir {} is not empty: give a new directory", dir.display());
            }
            write_embedded(dir, args.partitions, &records).context("producing the events")?;
        }
        (None, None) => bail!("give --log-dir or --kafka"),
    }
    report_line(serde_json::json!({
        "events": plan.events,
        "records": plan.records,
        "producer_duplicates": plan.producer_duplicates,
        "poison": plan.poison,
        "poison_with_key": plan.poison_with_key,
        "expected_total_cents": plan.expected_total,
        "expected_entries": plan.expected_entries,
    }));
    Ok(ExitCode::SUCCESS)
}
