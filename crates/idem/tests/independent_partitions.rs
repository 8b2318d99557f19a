//! Partitions are independent: one key whose handler fails retryably for a while holds its own partition only.
//! The other partitions are read and applied to their end while it fails (before, the poller waited on the
//! failing partition's full queue and every partition stopped), the held partition is reported as stalled, and
//! once the failure clears the held key's events are applied in their order, each once. Run on the embedded log
//! and Kafka (both pause a partition at the source), on RabbitMQ (each queue a partition, held to its prefetch)
//! and on NATS JetStream (partitions hashed over one consumer, within its `max_ack_pending`), against
//! PostgreSQL.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor, Source};
use sqlx::PgConnection;

/// Events after the failing one, over `KEYS` keys: enough that the failing key's partition holds several hundred
/// messages behind it (more than a partition's lane, 256).
const EVENTS: usize = 2400;
const KEYS: usize = 40;
const BAD_KEY: &str = "k7";

/// Applies an event as a row; fails retryably for `BAD_KEY` while `failing` is set, noting its partition.
#[derive(Clone)]
struct Flaky {
    failing: Arc<AtomicBool>,
    held: Arc<Mutex<Option<(String, i32)>>>,
}

#[derive(serde::Deserialize)]
struct Payment {
    id: String,
    key: String,
    seq: i64,
}

impl Handler<sqlx::Postgres> for Flaky {
    async fn handle(&self, event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let p: Payment = event.json()?;
        if p.key == BAD_KEY && self.failing.load(Ordering::SeqCst) {
            let at = (event.message.topic.clone(), event.message.partition);
            *self.held.lock().unwrap() = Some(at);
            return Err(HandlerError::retryable("account row locked (lock_timeout)"));
        }
        sqlx::query("INSERT INTO applied (event_id, key, seq, topic, part) VALUES ($1, $2, $3, $4, $5)")
            .bind(&p.id)
            .bind(&p.key)
            .bind(p.seq)
            .bind(&event.message.topic)
            .bind(event.message.partition)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// The records to produce: (key, payload), the failing key's first event first.
fn records() -> Vec<(String, String)> {
    let mut seq: HashMap<String, i64> = HashMap::new();
    let mut out = Vec::with_capacity(EVENTS + 1);
    let mut push = |key: String, n: usize| {
        let s = seq.entry(key.clone()).or_default();
        *s += 1;
        let payload = format!(r#"{{"id":"e{n}","key":"{key}","seq":{s}}}"#);
        out.push((key, payload));
    };
    push(BAD_KEY.to_owned(), 0);
    for n in 1..=EVENTS {
        push(format!("k{}", n % KEYS), n);
    }
    out
}

/// Sends the records to `queues` by key (a key's events go to one queue, in order).
#[cfg(feature = "rabbitmq")]
async fn to_queues(url: &str, queues: &[String]) {
    let producer = idem::rabbitmq::RabbitProducer::connect(url).await.unwrap();
    let messages: Vec<(String, Vec<u8>)> = records()
        .into_iter()
        .map(|(key, payload)| {
            let n: usize = key.trim_start_matches('k').parse().unwrap();
            (queues[n % queues.len()].clone(), payload.into_bytes())
        })
        .collect();
    producer.send_in_order(&messages).await.unwrap();
}

/// Rows applied per (topic, partition).
async fn per_partition(pool: &sqlx::PgPool) -> HashMap<(String, i32), i64> {
    let rows: Vec<(String, i32, i64)> =
        sqlx::query_as("SELECT topic, part, COUNT(*) FROM applied GROUP BY topic, part").fetch_all(pool).await.unwrap();
    rows.into_iter().map(|(t, p, n)| ((t, p), n)).collect()
}

/// Whether every key applied outside the `held` partition has all its events applied: the others are at their
/// end, not merely quiet for a while (a busy machine can hold a consumer back for seconds).
async fn others_at_their_end(pool: &sqlx::PgPool, held: &(String, i32)) -> bool {
    let mut expected: HashMap<String, i64> = HashMap::new();
    for (key, _) in records() {
        *expected.entry(key).or_default() += 1;
    }
    let rows: Vec<(String, String, i32, i64)> =
        sqlx::query_as("SELECT key, topic, part, COUNT(*) FROM applied GROUP BY key, topic, part")
            .fetch_all(pool)
            .await
            .unwrap();
    rows.iter()
        .filter(|(_, topic, part, _)| (topic, *part) != (&held.0, held.1))
        .all(|(key, _, _, n)| expected.get(key) == Some(n))
}

async fn applied(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM applied").fetch_one(pool).await.unwrap()
}

/// The consumer group of a run (unique, so a broker's committed offsets of an earlier run play no part).
fn group(what: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("independent-{what}-{}-{nanos}", std::process::id())
}

/// Runs `source` (of consumer group `group`) with the failing key held, then released, and checks what the module
/// documentation says. `fills_lane`: the source hands the held partition more than a lane holds (256), as the
/// embedded log and Kafka do; a broker's own limit (RabbitMQ's prefetch) or a partition hash that varies from run
/// to run (NATS) may hand it fewer.
async fn one_failing_key_holds_only_its_partition<S: Source>(what: &str, group: String, source: S, fills_lane: bool) {
    let db = common::pg().await;
    let config = Config::new(group, KeyExtractor::JsonPointer("/id".into()))
        .batch_size(20)
        .max_attempts(1_000_000)
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .stall_after(Duration::from_secs(1));
    idem::migrate(&db.pool, &config.tables).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE applied (n BIGSERIAL PRIMARY KEY, event_id TEXT NOT NULL UNIQUE, key TEXT NOT NULL,
                               seq BIGINT NOT NULL, topic TEXT NOT NULL, part INT NOT NULL)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let handler = Flaky { failing: Arc::new(AtomicBool::new(true)), held: Arc::new(Mutex::new(None)) };
    let engine = Engine::new(db.pool.clone(), config).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn({
        let (engine, handler) = (engine.clone(), handler.clone());
        async move { engine.run(source, handler, stop_rx).await }
    });

    // While the key fails: everything that can be applied is, then nothing moves but the failing key's retries.
    let deadline = Instant::now() + Duration::from_secs(120);
    let (mut last, mut since) = (-1, Instant::now());
    loop {
        let now = applied(&db.pool).await;
        if now != last {
            (last, since) = (now, Instant::now());
        } else if now > 0 && since.elapsed() > Duration::from_secs(3) && !engine.health().stalled.is_empty() {
            let held = handler.held.lock().unwrap().clone();
            if let Some(held) = held
                && others_at_their_end(&db.pool, &held).await
            {
                break;
            }
            // Shown if the test fails: the other partitions were quiet for a while before their end.
            eprintln!("{what}: {now} applied, quiet for {:?}, the other partitions not at their end", since.elapsed());
        }
        assert!(Instant::now() < deadline, "{what}: the consumer applied {now} and did not settle");
        assert!(!run.is_finished(), "{what}: the engine stopped: {:?}", run.await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let held = handler.held.lock().unwrap().clone().expect("the failing key was tried");
    let health = engine.health();
    assert_eq!(health.stalled.len(), 1, "{what}: only the failing key's partition is stalled: {:?}", health.stalled);
    let stalled = (health.stalled[0].topic.clone(), health.stalled[0].partition);
    assert_eq!(stalled, held, "{what}: {:?}", health.stalled);
    assert!(health.ready(), "{what}: a stalled partition is a detail: the consumer stays ready");
    let during = per_partition(&db.pool).await;
    let stats = engine.stats();
    assert_eq!(stats.dead_lettered, 0, "{what}: nothing dead-lettered while retrying");

    // The failure clears: everything is applied, each once, each key in its order.
    handler.failing.store(false, Ordering::SeqCst);
    let total = (EVENTS + 1) as i64;
    while applied(&db.pool).await < total {
        assert!(Instant::now() < deadline + Duration::from_secs(60), "{what}: the held partition did not catch up");
        assert!(!run.is_finished(), "{what}: the engine stopped: {:?}", run.await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop_tx.send(());
    let stats = run.await.unwrap().unwrap();
    assert_eq!(applied(&db.pool).await, total, "{what}: every event once");
    assert_eq!((stats.processed, stats.dead_lettered), (total as u64, 0), "{what}: {stats:?}");
    let out_of_order: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM applied a JOIN applied b ON a.key = b.key AND a.n < b.n AND a.seq > b.seq",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(out_of_order, 0, "{what}: a key's events applied out of order");

    let after = per_partition(&db.pool).await;
    assert!(after.len() > 1, "{what}: the events spread over several partitions: {after:?}");
    for (partition, n) in &after {
        let before = during.get(partition).copied().unwrap_or(0);
        if *partition == held {
            assert!(
                !fills_lane || n - before > 256,
                "{what}: the held partition had {} events behind the failing one, too few to fill its lane",
                n - before
            );
        } else {
            assert_eq!(before, *n, "{what}: {partition:?} was not applied to its end while another partition failed");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn embedded_log_one_failing_key_holds_only_its_partition() {
    use idem::embedded::{ConsumerOptions, EmbeddedLog};
    let dir = common::temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 4).unwrap();
    let producer = log.producer();
    for (key, payload) in records() {
        producer.send("payments", Some(key.as_bytes()), payload.as_bytes(), &[]).unwrap();
    }
    producer.flush().unwrap();
    let group = group("embedded");
    let source = log.consumer(&group, &["payments"], ConsumerOptions::default()).unwrap();
    one_failing_key_holds_only_its_partition("embedded log", group, source, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_one_failing_key_holds_only_its_partition() {
    use idem::kafka::{KafkaConfig, KafkaProducer, KafkaSource, create_topic};
    let brokers = std::env::var("IDEM_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let topic = format!("independent-{}-{nanos}", std::process::id());
    create_topic(&brokers, &topic, 4, 7 * 86_400_000).await.unwrap();
    let producer = KafkaProducer::new(&brokers).unwrap();
    for (key, payload) in records() {
        producer.send(&topic, Some(key.as_bytes()), payload.as_bytes(), &[]).await.unwrap();
    }
    let kafka = KafkaConfig::new(brokers, &[&topic]).set("session.timeout.ms", "6000");
    let group = group("kafka");
    let config = Config::new(group.clone(), KeyExtractor::JsonPointer("/id".into()));
    let source = KafkaSource::connect(&kafka, &config).await.unwrap();
    one_failing_key_holds_only_its_partition("kafka", group, source, true).await;
}

#[cfg(feature = "rabbitmq")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_one_failing_key_holds_only_its_queue() {
    use idem::rabbitmq::{RabbitConfig, RabbitSource, create_queue, delete_queue};
    let url = std::env::var("IDEM_RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let queues: Vec<String> = (0..4).map(|q| format!("independent-{}-{nanos}-{q}", std::process::id())).collect();
    for queue in &queues {
        create_queue(&url, queue, false).await.unwrap();
    }
    to_queues(&url, &queues).await;
    let names: Vec<&str> = queues.iter().map(String::as_str).collect();
    let group = group("rabbitmq");
    let config = Config::new(group.clone(), KeyExtractor::JsonPointer("/id".into())).batch_size(20);
    let source = RabbitSource::connect(&RabbitConfig::new(url.clone(), &names), &config).await.unwrap();
    one_failing_key_holds_only_its_partition("rabbitmq", group, source, false).await;
    for queue in &queues {
        delete_queue(&url, queue).await.unwrap();
    }
}

/// JetStream: one consumer, its partitions a hash of the subject (which keys share the failing key's partition
/// changes with the stream's name). The held partition keeps what it was handed, within the consumer's
/// `max_ack_pending` (set above the whole run here), and the others go on.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_one_failing_key_holds_only_its_partition() {
    use idem::nats::{NatsConfig, NatsProducer, NatsSource, create_stream};
    let url = std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let stream = format!("independent-{}-{nanos}", std::process::id());
    create_stream(&url, &stream, &[&format!("{stream}.>")], Duration::from_secs(7 * 86_400)).await.unwrap();
    let producer = NatsProducer::connect(&url).await.unwrap();
    let messages: Vec<(String, Vec<u8>)> =
        records().into_iter().map(|(key, payload)| (format!("{stream}.{key}"), payload.into_bytes())).collect();
    producer.send_in_order(&messages).await.unwrap();
    let nats =
        NatsConfig { partitions: 4, max_ack_pending: Some(10_000), ..NatsConfig::new(url.clone(), stream.as_str()) };
    let group = group("nats");
    let config = Config::new(group.clone(), KeyExtractor::JsonPointer("/id".into())).batch_size(20);
    let source = NatsSource::connect(&nats, &config).await.unwrap();
    one_failing_key_holds_only_its_partition("nats", group, source, false).await;
    idem::nats::delete_stream(&url, &stream).await.unwrap();
}
