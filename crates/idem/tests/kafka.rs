//! Kafka, against a real broker (`IDEM_KAFKA_BROKERS`, default 127.0.0.1:9092; `scripts/kafka.sh up` starts
//! one): the retention guard, the auto-commit refusal, committed offsets surviving a restart, the Sequential Inbox.
#![cfg(feature = "kafka")]

mod common;

use std::time::Duration;

use common::{Ledger, TestPool, config, ledger_total};
use idem::kafka::{KafkaConfig, KafkaProducer, KafkaSource, create_topic};
use idem::{Engine, Outcome};

const WEEK_MS: i64 = 7 * 86_400_000;
const DAY: Duration = Duration::from_secs(86_400);

fn brokers() -> String {
    std::env::var("IDEM_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{prefix}-{}-{nanos}", std::process::id())
}

/// The engine's configuration with markers kept `days` days, in a group of its own.
fn markers_for(days: u64) -> idem::Config {
    idem::Config { group: unique("g"), ..config(10) }.marker_retention(DAY * days as u32)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_guard_refuses_3_days_against_7_and_passes_8() {
    let topic = unique("retention");
    create_topic(&brokers(), &topic, 1, WEEK_MS).await.expect("create topic (is the broker up? scripts/kafka.sh up)");
    assert_eq!(idem::kafka::topic_retention_ms(&brokers(), &topic).await.unwrap(), Some(WEEK_MS));

    let kafka = KafkaConfig::new(brokers(), &[&topic]);
    let err =
        KafkaSource::connect(&kafka, &markers_for(3)).await.err().expect("3 days against 7 is refused").to_string();
    assert!(err.contains("3.0 days") && err.contains("7.0 days") && err.contains("Fix"), "{err}");
    let source = KafkaSource::connect(&kafka, &markers_for(8)).await.expect("8 days against 7 passes");
    drop(source);
    let unpruned = idem::Config { group: unique("g"), ..config(10) };
    drop(KafkaSource::connect(&kafka, &unpruned).await.expect("markers never pruned pass"));

    let infinite = unique("forever");
    create_topic(&brokers(), &infinite, 1, -1).await.unwrap();
    let mut pruned = KafkaConfig::new(brokers(), &[&infinite]);
    let err =
        KafkaSource::connect(&pruned, &markers_for(30)).await.err().expect("pruned markers against -1").to_string();
    assert!(err.contains("retention.ms=-1"), "{err}");
    pruned.accept_infinite_topic_retention = true;
    drop(KafkaSource::connect(&pruned, &markers_for(30)).await.expect("explicit override"));
}

#[tokio::test]
async fn auto_commit_is_refused_at_start_up() {
    let kafka = KafkaConfig::new(brokers(), &["t"]).set("enable.auto.commit", "true");
    let err = KafkaSource::connect(&kafka, &config(10)).await.err().expect("refused").to_string();
    assert!(err.contains("enable.auto.commit=true"), "{err}");
}

/// Committed offsets survive a consumer restart; what was handed out but not acknowledged comes again and is
/// absorbed by the markers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn committed_offsets_survive_a_restart_and_the_rest_is_redelivered() {
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let topic = unique("restart");
    let group = unique("ledger");
    create_topic(&brokers(), &topic, 2, WEEK_MS).await.unwrap();
    let producer = KafkaProducer::new(&brokers()).unwrap();
    let mut expected = 0;
    for n in 0..200i64 {
        let payload = format!(r#"{{"id":"k{n}","amount":{n}}}"#);
        producer.send(&topic, Some(format!("{}", n % 7).as_bytes()), payload.as_bytes(), &[]).await.unwrap();
        expected += n;
    }
    let consume = |stop_at_end: bool| {
        let mut kafka = KafkaConfig::new(brokers(), &[&topic]).set("session.timeout.ms", "6000");
        kafka.stop_at_end = stop_at_end;
        kafka
    };

    // First consumer: all 200, acknowledged and committed, then it leaves the group.
    let engine_config = idem::Config { group: group.clone(), ..config(20) };
    let source = KafkaSource::connect(&consume(true), &engine_config).await.unwrap();
    let engine = Engine::new(db.pool.clone(), engine_config.clone()).unwrap();
    let stats = engine.run(source, Ledger::default(), std::future::pending::<()>()).await.unwrap();
    assert_eq!(stats.processed, 200);
    assert_eq!(ledger_total(&db.pool).await, expected);

    // 100 more; a consumer takes 60 of them but "crashes" without acknowledging (its engine never acks).
    for n in 200..300i64 {
        let payload = format!(r#"{{"id":"k{n}","amount":{n}}}"#);
        producer.send(&topic, Some(format!("{}", n % 7).as_bytes()), payload.as_bytes(), &[]).await.unwrap();
        expected += n;
    }
    {
        use idem::{Received, Source};
        let source = KafkaSource::connect(&consume(false), &engine_config).await.unwrap();
        let mut taken = Vec::new();
        while taken.len() < 60 {
            match tokio::time::timeout(Duration::from_secs(30), source.recv()).await.expect("messages arrive") {
                Ok(Some(Received::Message(m))) => taken.push(m),
                Ok(Some(Received::Revoked { drained, .. })) => drained.done(),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(taken.iter().all(|m| m.offset >= 0));
        let outcomes = engine.process(taken, &Ledger::default()).await.unwrap();
        assert!(outcomes.iter().all(|o| *o == Outcome::Processed), "committed offsets were respected: {outcomes:?}");
        // Dropped here without acknowledging: as after a kill between commit and acknowledgement.
    }

    // A restarted consumer resumes at the committed offsets: the 60 come again (duplicates), the rest is new.
    let source = KafkaSource::connect(&consume(true), &engine_config).await.unwrap();
    let engine = Engine::new(db.pool.clone(), engine_config).unwrap();
    let stats = engine.run(source, Ledger::default(), std::future::pending::<()>()).await.unwrap();
    assert_eq!((stats.processed, stats.duplicate), (40, 60));
    assert_eq!(stats.lost, 0, "the producer helper's sequence numbers show no hole");
    assert_eq!(ledger_total(&db.pool).await, expected);
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM ledger").await, 300);
}

/// The Sequential Inbox over Kafka: each order's events published scrambled, keyed by event so they spread over
/// both partitions (two workers at once), some twice; every order is handled once per step, in its order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sequential_inbox_orders_what_kafka_delivers_out_of_order() {
    use idem::inbox::{InboxConfig, SequentialInbox};

    let db = common::pg().await;
    idem::migrate(&db.pool, &idem::Tables::default()).await.unwrap();
    common::create_order_history(&db.pool).await;
    let topic = unique("orders");
    create_topic(&brokers(), &topic, 2, WEEK_MS).await.unwrap();
    let producer = KafkaProducer::new(&brokers()).unwrap();
    let orders = 10;
    let steps = [("OrderShipped", None, 4), ("OrderValidated", Some("payment"), 2), ("OrderCreated", None, 1)];
    for n in 0..orders {
        let mut events = steps.to_vec();
        events.insert(1, ("OrderValidated", Some("stock"), 3));
        events.push(("OrderShipped", None, 4)); // a redelivery
        for (kind, sub_type, step) in events {
            let mut headers = vec![("type".to_owned(), kind.as_bytes().to_vec())];
            if let Some(sub) = sub_type {
                headers.push(("subtype".to_owned(), sub.as_bytes().to_vec()));
            }
            let id = format!("o{n}-{step}");
            let payload = format!(r#"{{"eventId":"{id}","orderId":"o{n}","step":{step}}}"#);
            producer.send(&topic, Some(id.as_bytes()), payload.as_bytes(), &headers).await.unwrap();
        }
    }

    let key = idem::KeyExtractor::JsonPointer("/eventId".into());
    let config = idem::Config { group: unique("history"), key, ..config(10) };
    let mut kafka = KafkaConfig::new(brokers(), &[&topic]).set("session.timeout.ms", "6000");
    kafka.stop_at_end = true;
    let source = KafkaSource::connect(&kafka, &config).await.unwrap();
    let sequences = InboxConfig::from_toml(include_str!("../examples/order_sequence.toml")).unwrap();
    let inbox = SequentialInbox::new(Engine::new(db.pool.clone(), config).unwrap(), sequences).unwrap();
    let direct = inbox.run(source, common::OrderHistory, std::future::pending::<()>()).await.unwrap();
    assert_eq!(direct.processed + direct.dead_lettered, 0, "every message was sequenced");

    let stats = inbox.stats();
    assert_eq!((stats.consumed, stats.duplicates), (orders * 5, orders), "{stats:?}");
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM history").await, orders as i64 * 4);
    assert_eq!(common::order_steps_out_of_order(&db.pool).await, 0, "no step before its predecessors");
    let closed = db.pool.scalar("SELECT COUNT(*) FROM sequence_instance WHERE status = 'CLOSED'").await;
    assert_eq!(closed, orders as i64);
}
