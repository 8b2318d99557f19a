//! Kafka's per-partition consumer lag (`idem_consumer_lag_messages`), against a real broker. Alone in its test
//! binary: the metrics recorder is global to the process.
#![cfg(feature = "kafka")]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem::kafka::{KafkaConfig, KafkaProducer, KafkaSource, create_topic};
use idem::{Engine, Event, Handler, HandlerError};
use sqlx::PgConnection;

/// A slow handler, so that a backlog is there for the statistics to see.
struct Slow;

impl Handler<sqlx::Postgres> for Slow {
    async fn handle(&self, _event: &Event, _tx: &mut PgConnection) -> Result<(), HandlerError> {
        tokio::time::sleep(Duration::from_millis(40)).await;
        Ok(())
    }
}

fn lag_of(text: &str, topic: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with("idem_consumer_lag_messages{") && l.contains(&format!("topic=\"{topic}\"")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// While a backlog is consumed the gauge shows it, per partition; once everything is committed it reads 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_lag_per_partition_follows_the_backlog() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder().expect("recorder");
    let brokers = std::env::var("IDEM_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let topic = format!("lag-{nanos}");
    let db = common::pg().await;
    common::setup(&db.pool).await;
    create_topic(&brokers, &topic, 1, 7 * 86_400_000).await.unwrap();
    let producer = KafkaProducer::new(&brokers).unwrap();
    for n in 0..80 {
        producer.send(&topic, None, format!(r#"{{"id":"l{n}"}}"#).as_bytes(), &[]).await.unwrap();
    }
    let kafka = KafkaConfig::new(brokers.clone(), &[&topic]).set("statistics.interval.ms", "200");
    let config = idem::Config { group: format!("lag-group-{nanos}"), ..common::config(1) };
    let source = KafkaSource::connect(&kafka, &config).await.unwrap();
    let engine = Engine::new(db.pool.clone(), config).unwrap();

    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (recorder, topic, done) = (recorder.clone(), topic.clone(), Arc::clone(&done));
        tokio::spawn(async move {
            let mut highest: f64 = 0.0;
            while !done.load(Ordering::SeqCst) {
                highest = highest.max(lag_of(&recorder.render(), &topic).unwrap_or(0.0));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            highest
        })
    };
    let finished = {
        let (engine, recorder, topic) = (engine.clone(), recorder.clone(), topic.clone());
        async move {
            while engine.stats().processed < 80 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // Offsets are committed asynchronously and the statistics come every 200 ms: wait for the gauge to
            // see the last commit (at most 30 s; the assertion below reports a gauge that never does).
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while lag_of(&recorder.render(), &topic) != Some(0.0) && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let lag = idem::lag::of(&format!("lag-group-{nanos}"));
            lag.into_iter().map(|l| (l.topic, l.partition, l.messages)).collect::<Vec<_>>()
        }
    };
    let (seen_by_console, finished) = {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (rx, async move {
            let _ = tx.send(finished.await);
        })
    };
    let stats = engine.run(source, Slow, finished).await.unwrap();
    done.store(true, Ordering::SeqCst);
    let highest = watcher.await.unwrap();
    let seen_by_console = seen_by_console.await.unwrap();
    assert_eq!(stats.processed, 80);
    assert!(highest >= 20.0, "the backlog showed: highest lag {highest}");
    let text = recorder.render();
    let line = text.lines().find(|l| l.starts_with("idem_consumer_lag_messages{") && l.contains(&topic)).unwrap();
    assert!(line.contains("partition=\"0\"") && line.contains("consumer_group=\"lag-group-"), "{line}");
    assert_eq!(lag_of(&text, &topic), Some(0.0), "caught up: {line}");
    assert_eq!(seen_by_console, [(topic.clone(), Some(0), 0)], "the console's consumers view reads the same figure");
    assert!(idem::lag::of(&format!("lag-group-{nanos}")).is_empty(), "a partition given up has no lag any more");
}
