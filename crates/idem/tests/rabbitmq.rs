//! RabbitMQ, against a real server (`IDEM_RABBITMQ_URL`, default amqp://guest:guest@127.0.0.1:5672/%2f): clear
//! errors at start-up for wrong credentials, an unreachable server and a missing queue; the producer's confirms;
//! dead letters handed to the queue's dead-letter exchange; a quorum queue's last delivery kept as a dead letter;
//! the outbox relayed to a queue; keyless dead letters of two connections; the `broker-id` key refused.
#![cfg(feature = "rabbitmq")]

mod common;

use common::config;
use idem::Source;
use idem::rabbitmq::{RabbitConfig, RabbitProducer, RabbitSource, create_queue, delete_queue};
use idem::source::{Acknowledgement, Received};

fn url() -> String {
    std::env::var("IDEM_RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{prefix}-{}-{nanos}", std::process::id())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_an_unreachable_server_and_a_missing_queue_are_named() {
    let engine = config(10);
    let queue = unique("q");
    let wrong = RabbitConfig::new("amqp://guest:nope@127.0.0.1:5672/%2f", &[queue.as_str()]);
    let err = RabbitSource::connect(&wrong, &engine).await.err().expect("wrong password").to_string();
    assert!(err.contains("rabbitmq amqp://guest:***@127.0.0.1:5672") && !err.contains("nope"), "{err}");
    let away = RabbitConfig::new("amqp://guest:guest@127.0.0.1:1/%2f", &[queue.as_str()]);
    let err = RabbitSource::connect(&away, &engine).await.err().expect("nothing on port 1").to_string();
    assert!(err.contains("127.0.0.1:1"), "{err}");
    let missing = RabbitConfig::new(url(), &[queue.as_str()]);
    let err = RabbitSource::connect(&missing, &engine).await.err().expect("no such queue").to_string();
    assert!(err.contains(&queue) && err.contains("declare the queue"), "{err}");
    // Deleting a queue that is not there is not an error (known by the server's reply code, 404).
    idem::rabbitmq::delete_queue(&url(), &queue).await.expect("a missing queue is already deleted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_comes_with_its_handle_and_is_gone_once_acknowledged() {
    let queue = unique("acked");
    create_queue(&url(), &queue, false).await.unwrap();
    let producer = RabbitProducer::connect(&url()).await.unwrap();
    let event_id = producer.send(&queue, b"{}", &[]).await.unwrap();
    let source = RabbitSource::connect(
        &RabbitConfig { stop_at_end: true, ..RabbitConfig::new(url(), &[queue.as_str()]) },
        &config(10),
    )
    .await
    .unwrap();
    let Some(Received::Message(message)) = source.recv().await.unwrap() else { panic!("a message") };
    assert_eq!(message.topic, queue);
    assert_eq!(message.header(idem::message::EVENT_ID_HEADER), Some(event_id.as_bytes()));
    source.ack(&Acknowledgement::of(std::slice::from_ref(&message)).unwrap()).await.unwrap();
    assert!(source.recv().await.unwrap().is_none(), "acknowledged: the queue is empty");
    drop(source);
    delete_queue(&url(), &queue).await.unwrap();
}

/// A queue's backlog (its ready messages, read with a passive declaration) is the consumer's lag: five waiting,
/// at most one of them in this consumer's hand (prefetch 1), so at least four behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queues_backlog_is_the_consumers_lag() {
    let queue = unique("backlog");
    create_queue(&url(), &queue, false).await.unwrap();
    let producer = RabbitProducer::connect(&url()).await.unwrap();
    for n in 0..5 {
        producer.send(&queue, format!(r#"{{"n":{n}}}"#).as_bytes(), &[]).await.unwrap();
    }
    let engine = idem::Config { group: unique("lagging"), ..config(10) };
    let rabbit = RabbitConfig { prefetch: Some(1), ..RabbitConfig::new(url(), &[queue.as_str()]) };
    let source = RabbitSource::connect(&rabbit, &engine).await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let lag = loop {
        if let Some(lag) = idem::lag::of(&engine.group).into_iter().find(|l| l.topic == queue) {
            break lag;
        }
        assert!(std::time::Instant::now() < deadline, "no lag recorded for {queue}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert!((4..=5).contains(&lag.messages), "{lag:?}");
    assert_eq!(lag.partition, None);
    drop(source);
    delete_queue(&url(), &queue).await.unwrap();
}

/// Delivery tags start from 1 on each channel: two keyless poison messages, each the first delivery of its own
/// connection, are two dead letters, not one overwriting the other; and `broker-id` is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyless_dead_letters_of_two_connections_keep_a_row_each_and_broker_id_is_refused() {
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let queue = unique("keyless");
    create_queue(&url(), &queue, false).await.unwrap();
    let producer = RabbitProducer::connect(&url()).await.unwrap();
    let rabbit = RabbitConfig { stop_at_end: true, ..RabbitConfig::new(url(), &[queue.as_str()]) };
    for body in [r#"{"amount":1,"first":true}"#, r#"{"amount":2,"second":true}"#] {
        producer.send(&queue, body.as_bytes(), &[]).await.unwrap();
        let engine = idem::Engine::new(db.pool.clone(), config(10)).unwrap();
        let source = RabbitSource::connect(&rabbit, engine.config()).await.unwrap();
        let stats = engine.run(source, common::Ledger::default(), std::future::pending::<()>()).await.unwrap();
        assert_eq!(stats.dead_lettered, 1);
    }
    let rows: Vec<(Option<String>, Vec<u8>, i64)> =
        sqlx::query_as(r#"SELECT event_id, payload, "offset" FROM dead_letters ORDER BY id"#)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 2, "one row each: {rows:?}");
    assert!(rows.iter().all(|(id, _, _)| id.is_none()));
    assert!(
        String::from_utf8_lossy(&rows[0].1).contains("first") && String::from_utf8_lossy(&rows[1].1).contains("second")
    );
    assert_ne!(rows[0].2, rows[1].2);

    let by_tag = idem::Config::new("by-tag", idem::KeyExtractor::BrokerId);
    let err = RabbitSource::connect(&rabbit, &by_tag).await.err().expect("refused").to_string();
    assert!(err.contains("broker-id key is refused") && err.contains("header:rabbitmq-message-id"), "{err}");
    delete_queue(&url(), &queue).await.unwrap();
}

/// Declares `name` with `arguments` (and a durable queue for each `also`), through a connection of its own.
async fn declare(name: &str, arguments: lapin::types::FieldTable, also: &[&str]) -> lapin::Channel {
    let connection = idem::rabbitmq::connect(&url()).await.unwrap();
    let channel = connection.create_channel().await.unwrap();
    let options = lapin::options::QueueDeclareOptions { durable: true, ..Default::default() };
    channel.queue_declare(name.into(), options, arguments).await.unwrap();
    for other in also {
        channel.queue_declare((*other).into(), options, lapin::types::FieldTable::default()).await.unwrap();
    }
    std::mem::forget(connection); // the channel lives as long as the test
    channel
}

async fn dead_letters(db: &common::TestPg) -> Vec<(Option<String>, String, i32)> {
    sqlx::query_as("SELECT event_id, error, attempts FROM dead_letters ORDER BY id").fetch_all(&db.pool).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_is_also_routed_to_the_queues_dead_letter_exchange_when_asked() {
    use lapin::types::{AMQPValue, FieldTable};
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let queue = unique("dlx");
    let parked = format!("{queue}.parked");
    let mut arguments = FieldTable::default();
    arguments.insert("x-dead-letter-exchange".into(), AMQPValue::LongString("".into()));
    arguments.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(parked.as_str().into()));
    let channel = declare(&queue, arguments, &[&parked]).await;
    let producer = RabbitProducer::connect(&url()).await.unwrap();
    for payload in [r#"{"id":"a","amount":1}"#, r#"{"id":"b","amount":2,"poison":true}"#, r#"{"id":"c","amount":4}"#] {
        producer.send(&queue, payload.as_bytes(), &[]).await.unwrap();
    }
    let rabbit = RabbitConfig { stop_at_end: true, dead_letter_exchange: true, ..RabbitConfig::new(url(), &[&queue]) };
    let engine = idem::Engine::new(db.pool.clone(), config(10)).unwrap();
    let source = RabbitSource::connect(&rabbit, engine.config()).await.unwrap();
    let stats = engine.run(source, common::Ledger::default(), std::future::pending::<()>()).await.unwrap();
    assert_eq!((stats.processed, stats.dead_lettered), (2, 1));
    assert_eq!(common::ledger_total(&db.pool).await, 5, "the poison payment's entry rolled back");
    let letters = dead_letters(&db).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].0.as_deref(), Some("b"));

    // RabbitMQ routed the rejected delivery to the parking queue, with its own record of why.
    let got = channel
        .basic_get(parked.as_str().into(), lapin::options::BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the dead letter reached the queue's dead-letter exchange");
    assert!(String::from_utf8_lossy(&got.delivery.data).contains(r#""id":"b""#));
    let headers = got.delivery.properties.headers().clone().unwrap_or_default();
    assert!(headers.inner().contains_key("x-death"), "{headers:?}");
    let nothing_else = channel.basic_get(parked.as_str().into(), lapin::options::BasicGetOptions { no_ack: true });
    assert!(nothing_else.await.unwrap().is_none(), "only the dead letter was rejected; the rest acknowledged");
    for q in [&queue, &parked] {
        delete_queue(&url(), q).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_delivery_a_quorum_queue_allows_is_dead_lettered_without_the_handler() {
    use lapin::types::{AMQPValue, FieldTable};
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let queue = unique("limit");
    let mut arguments = FieldTable::default();
    arguments.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    arguments.insert("x-delivery-limit".into(), AMQPValue::LongInt(2));
    let channel = declare(&queue, arguments, &[]).await;
    let producer = RabbitProducer::connect(&url()).await.unwrap();
    producer.send(&queue, br#"{"id":"crasher","amount":7}"#, &[]).await.unwrap();
    producer.send(&queue, br#"{"id":"fine","amount":1}"#, &[]).await.unwrap();

    // Two deliveries of the first message fail the way a crashing consumer does: returned to the queue.
    for _ in 0..2 {
        let got = channel
            .basic_get(queue.as_str().into(), lapin::options::BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .expect("the first message");
        assert!(String::from_utf8_lossy(&got.delivery.data).contains("crasher"));
        got.delivery
            .acker
            .nack(lapin::options::BasicNackOptions { requeue: true, ..Default::default() })
            .await
            .unwrap();
    }

    let rabbit = RabbitConfig { stop_at_end: true, delivery_limit: Some(2), ..RabbitConfig::new(url(), &[&queue]) };
    let engine = idem::Engine::new(db.pool.clone(), config(10)).unwrap();
    let source = RabbitSource::connect(&rabbit, engine.config()).await.unwrap();
    let stats = engine.run(source, common::Ledger::default(), std::future::pending::<()>()).await.unwrap();
    assert_eq!((stats.processed, stats.dead_lettered), (1, 1));
    assert_eq!(common::ledger_rows(&db.pool, "crasher").await, 0, "the handler never applied the last delivery");
    assert_eq!(common::ledger_total(&db.pool).await, 1);
    let letters = dead_letters(&db).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!((letters[0].0.as_deref(), letters[0].2), (Some("crasher"), 0));
    assert!(letters[0].1.contains("delivery limit (2)") && letters[0].1.contains("replay"), "{}", letters[0].1);
    assert_eq!(common::markers(&db.pool, "crasher").await, 1, "a redelivery is now a plain duplicate");
    delete_queue(&url(), &queue).await.unwrap();
}

/// The outbox relayed to RabbitMQ: each message reaches the queue its destination names, with its event id; a
/// message for a queue that does not exist comes back (published `mandatory`) and is dead-lettered, not dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_relayed_to_a_queue_and_a_missing_queue_dead_lettered() {
    use idem::outbox::{Outbox, OutgoingMessage, Publish, Relay, RelayConfig};
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let queue = unique("relayed");
    let missing = unique("no-such-queue");
    create_queue(&url(), &queue, true).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let messages = [
        OutgoingMessage::new(queue.as_str(), r#"{"n":1}"#).with_key("a"),
        OutgoingMessage::new(missing.as_str(), r#"{"n":2}"#).with_key("b"),
        OutgoingMessage::new(queue.as_str(), r#"{"n":3}"#).with_key("a"),
    ];
    let ids = Outbox::default().enqueue_all(&mut *tx, &messages).await.unwrap();
    tx.commit().await.unwrap();

    let producer = RabbitProducer::connect(&url()).await.unwrap();
    let relaying = RelayConfig { stop_when_empty: true, ..RelayConfig::default() };
    let relay = Relay::new(db.pool.clone(), idem::Tables::default(), relaying, Publish(producer)).unwrap();
    let stats = relay.run(std::future::pending::<()>()).await.unwrap();
    assert_eq!((stats.delivered, stats.dead_lettered), (2, 1), "{stats:?}");
    let letters = sqlx::query_as::<_, (String, String)>("SELECT event_id, error FROM dead_letters").fetch_all(&db.pool);
    let letters = letters.await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].0, ids[1]);
    assert!(letters[0].1.contains(&missing), "{}", letters[0].1);

    let source = RabbitSource::connect(
        &RabbitConfig { stop_at_end: true, ..RabbitConfig::new(url(), &[queue.as_str()]) },
        &config(10),
    )
    .await
    .unwrap();
    let mut got = Vec::new();
    while let Some(Received::Message(m)) = source.recv().await.unwrap() {
        let event_id = String::from_utf8(m.header(idem::message::EVENT_ID_HEADER).unwrap().to_vec()).unwrap();
        got.push((String::from_utf8(m.payload.clone()).unwrap(), event_id));
        source.ack(&Acknowledgement::of(std::slice::from_ref(&m)).unwrap()).await.unwrap();
    }
    assert_eq!(got, vec![(r#"{"n":1}"#.to_owned(), ids[0].clone()), (r#"{"n":3}"#.to_owned(), ids[2].clone())]);
    drop(source);
    delete_queue(&url(), &queue).await.unwrap();
}
