//! The outbox legs: the cost of an enqueue per event inside a consumer's batched transaction, and the relay's
//! throughput to the embedded log (and Kafka) next to a raw producer publishing the same messages.

use super::*;
use idem::outbox::{Delivery, Outbox, OutgoingMessage, Publish, Relay, RelayConfig};

/// Where relayed messages go.
const DESTINATION: &str = "credited";

/// Credits the whole batch in one UPDATE and enqueues one `credited` event per event, in one statement.
struct CreditAllAndAnnounce;

impl BatchHandler<sqlx::Postgres> for CreditAllAndAnnounce {
    async fn handle_batch(&self, events: &[&Event], tx: &mut PgConnection) -> Result<(), HandlerError> {
        idem_legs::CreditAll.handle_batch(events, tx).await?;
        let messages: Vec<OutgoingMessage> = events
            .iter()
            .map(|e| OutgoingMessage::new(DESTINATION, e.payload().to_vec()).with_key(e.id.as_bytes()))
            .collect();
        Outbox::new(Tables::new(None, PREFIX).map_err(|e| HandlerError::permanent(e.to_string()))?)
            .enqueue_all(tx, &messages)
            .await?;
        Ok(())
    }
}

/// The batched-1000 consumer with an outbox enqueue per event (against the same leg without, run by the caller).
pub(super) async fn enqueue_leg(pool: &PgPool, args: &BenchArgs, work: &Workload) -> anyhow::Result<f64> {
    let rate = idem_legs::idem_leg_with(pool, args, work, 1_000, CreditAllAndAnnounce).await?;
    let enqueued: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_outbox").fetch_one(pool).await?;
    if enqueued != work.unique as i64 {
        bail!("outbox leg: {enqueued} messages enqueued for {} events", work.unique);
    }
    Ok(rate)
}

/// The workload's events, one message each, keyed by account, as the relay and the raw producer send them.
fn outgoing(work: &Workload) -> Vec<OutgoingMessage> {
    work.deliveries
        .iter()
        .map(|p| OutgoingMessage::new(DESTINATION, payload(p)).with_key(p.account.to_string()))
        .collect()
}

/// Fills a fresh outbox with the workload's messages (not timed), then relays them to the end: messages per
/// second from start to empty outbox.
async fn relay_leg<D: Delivery>(pool: &PgPool, args: &BenchArgs, work: &Workload, delivery: D) -> anyhow::Result<f64> {
    let tables = fresh_tables(pool, args.accounts).await?;
    let messages = outgoing(work);
    for chunk in messages.chunks(1_000) {
        let mut tx = pool.begin().await?;
        Outbox::new(tables.clone()).enqueue_all(&mut *tx, chunk).await?;
        tx.commit().await?;
    }
    sqlx::query("VACUUM ANALYZE bench_outbox").execute(pool).await?;
    let relay_pool = idem::postgres::connect(&args.database_url, 4).await?;
    let config = RelayConfig { batch_size: 1_000, stop_when_empty: true, ..RelayConfig::default() };
    let relay = Relay::new(relay_pool.clone(), tables, config, delivery)?;
    let started = Instant::now();
    let stats = relay.run(std::future::pending::<()>()).await?;
    let seconds = started.elapsed().as_secs_f64();
    relay_pool.close().await;
    if stats.delivered != messages.len() as u64 {
        bail!("relay leg: delivered {} of {} messages", stats.delivered, messages.len());
    }
    Ok(messages.len() as f64 / seconds)
}

/// The embedded log's produce limit: the same messages appended and made durable every thousand.
fn raw_log(dir: &std::path::Path, work: &Workload) -> anyhow::Result<f64> {
    let log = fresh_log(dir)?;
    let producer = log.producer();
    let messages = outgoing(work);
    let started = Instant::now();
    for chunk in messages.chunks(1_000) {
        for m in chunk {
            let id = uuid_like(m);
            let headers = [(idem::message::EVENT_ID_HEADER.to_owned(), id.into_bytes())];
            producer.send(DESTINATION, m.key.as_deref(), &m.payload, &headers)?;
        }
        producer.flush()?;
    }
    Ok(messages.len() as f64 / started.elapsed().as_secs_f64())
}

/// A header value of an event id's length, so the raw producer writes as many bytes as the relay.
fn uuid_like(m: &OutgoingMessage) -> String {
    format!("{:0>36}", m.payload.len())
}

fn fresh_log(dir: &std::path::Path) -> anyhow::Result<idem::embedded::EmbeddedLog> {
    let _ = std::fs::remove_dir_all(dir);
    let log = idem::embedded::EmbeddedLog::open(dir)?;
    log.create_topic(DESTINATION, 4)?;
    Ok(log)
}

/// Kafka's produce limit: the same messages sent a thousand at a time, each thousand awaited.
async fn raw_kafka(brokers: &str, topic: &str, work: &Workload) -> anyhow::Result<f64> {
    let producer = Arc::new(idem::kafka::KafkaProducer::new(brokers)?);
    let messages = outgoing(work);
    let started = Instant::now();
    for chunk in messages.chunks(1_000) {
        let mut sends = tokio::task::JoinSet::new();
        for m in chunk {
            let (producer, topic, m) = (Arc::clone(&producer), topic.to_owned(), m.clone());
            sends.spawn(async move { producer.send(&topic, m.key.as_deref(), &m.payload, &[]).await });
        }
        while let Some(sent) = sends.join_next().await {
            sent??;
        }
    }
    Ok(messages.len() as f64 / started.elapsed().as_secs_f64())
}

/// Every outbox leg that is wanted: the enqueue cost, the relay to the embedded log and, with `--kafka`, to Kafka.
pub(super) async fn run(
    pool: &PgPool,
    args: &BenchArgs,
    work: &Workload,
    wanted: &dyn Fn(&str) -> bool,
    progress: &dyn Fn(&str),
    notes: &mut Vec<String>,
) -> anyhow::Result<Vec<Leg>> {
    let mut legs = Vec::new();
    let name = "idem batched 1000, batch handler, with an outbox enqueue per event".to_owned();
    if wanted(&name) {
        progress(&name);
        let mut runs = Vec::new();
        for _ in 0..args.runs {
            runs.push(enqueue_leg(pool, args, work).await?);
        }
        legs.push(Leg::new(name, runs));
    }
    let dir = std::env::temp_dir().join(format!("idem-bench-relay-{}", std::process::id()));
    let (raw_name, relay_name) = ("embedded log produce limit (1,000 per fsync)", "idem relay to the embedded log");
    if wanted(raw_name) || wanted(relay_name) {
        progress("the relay to the embedded log and the log's produce limit");
        let (mut raw, mut relayed) = (Vec::new(), Vec::new());
        for _ in 0..args.runs {
            raw.push(raw_log(&dir, work)?);
            let log = fresh_log(&dir)?;
            relayed.push(relay_leg(pool, args, work, log.producer()).await?);
        }
        let _ = std::fs::remove_dir_all(&dir);
        legs.push(Leg::new(raw_name.to_owned(), raw));
        legs.push(Leg::new(relay_name.to_owned(), relayed));
    }
    let (kafka_raw_name, kafka_relay_name) = ("Kafka produce limit (1,000 awaited at a time)", "idem relay to Kafka");
    if wanted(kafka_raw_name) || wanted(kafka_relay_name) {
        match &args.kafka {
            Some(brokers) => {
                progress("the relay to Kafka and Kafka's produce limit");
                let (mut raw, mut relayed) = (Vec::new(), Vec::new());
                for run in 0..args.runs {
                    let nanos =
                        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
                    let topic = format!("bench-relay-{nanos}-{run}");
                    idem::kafka::create_topic(brokers, &topic, 4, 24 * 3_600_000).await?;
                    raw.push(raw_kafka(brokers, &topic, work).await?);
                    let producer = idem::kafka::KafkaProducer::new(brokers)?;
                    relayed.push(relay_leg(pool, args, work, Renamed { topic, inner: Publish(producer) }).await?);
                }
                legs.push(Leg::new(kafka_raw_name.to_owned(), raw));
                legs.push(Leg::new(kafka_relay_name.to_owned(), relayed));
            }
            None => notes.push("relay-to-Kafka legs skipped: no --kafka".into()),
        }
    }
    Ok(legs)
}

/// Sends every message to `topic` (a fresh one per run) whatever its destination.
struct Renamed<D> {
    topic: String,
    inner: D,
}

impl<D: Delivery> Delivery for Renamed<D> {
    async fn deliver(&self, messages: &[idem::outbox::OutboxMessage]) -> Vec<idem::outbox::Delivered> {
        let renamed: Vec<idem::outbox::OutboxMessage> = messages
            .iter()
            .map(|m| idem::outbox::OutboxMessage { destination: self.topic.clone(), ..m.clone() })
            .collect();
        self.inner.deliver(&renamed).await
    }
}
