//! Amazon SQS, against a real SQS-compatible server (`IDEM_SQS_ENDPOINT`, default the local one of
//! scripts/sqs.sh, http://127.0.0.1:9324; `aws` for the standard AWS configuration's): the visibility-timeout and
//! retention guards, clear errors for a missing queue, an unreachable endpoint and the `broker-id` key, the FIFO
//! producer's deduplication id dropping a retry, visibility kept while a batch outlasts the timeout, a body that
//! is not JSON dead-lettered, and a message past `max_receive_count` kept as a dead letter without the handler.
#![cfg(feature = "sqs")]

mod common;

use std::time::Duration;

use common::config;
use idem::sqs::aws_sdk_sqs::types::QueueAttributeName;
use idem::sqs::{SqsConfig, SqsProducer, SqsSource, create_queue, delete_queue};

const DAY: Duration = Duration::from_secs(86_400);

fn endpoint() -> Option<String> {
    let endpoint = std::env::var("IDEM_SQS_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:9324".to_owned());
    (endpoint != "aws").then_some(endpoint)
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{prefix}-{}-{nanos}", std::process::id())
}

async fn client() -> idem::sqs::aws_sdk_sqs::Client {
    idem::sqs::client(endpoint().as_deref(), None).await.expect("an SQS client (is scripts/sqs.sh up?)")
}

/// A fresh queue (FIFO when `fifo`) with these settings; returns its name.
async fn queue(prefix: &str, fifo: bool, visibility: Duration, retention: Duration) -> String {
    let name = if fifo { format!("{}.fifo", unique(prefix)) } else { unique(prefix) };
    create_queue(&client().await, &name, visibility, retention).await.expect("create queue (is scripts/sqs.sh up?)");
    name
}

fn sqs(name: &str) -> SqsConfig {
    SqsConfig {
        endpoint: endpoint(),
        max_batch_time: Duration::from_secs(2),
        stop_at_end: true,
        ..SqsConfig::new(name)
    }
}

/// The engine's configuration with markers kept `days` days, in a group of its own.
fn markers_for(days: u32) -> idem::Config {
    idem::Config { group: unique("g"), ..config(10) }.marker_retention(DAY * days)
}

async fn visible_messages(name: &str) -> i64 {
    let client = client().await;
    let url = client.get_queue_url().queue_name(name).send().await.unwrap().queue_url().unwrap_or_default().to_owned();
    let attributes = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .send()
        .await
        .unwrap();
    let count = attributes.attributes().and_then(|a| a.get(&QueueAttributeName::ApproximateNumberOfMessages));
    count.and_then(|n| n.parse().ok()).unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_visibility_timeout_of_5_s_against_batches_of_30_s_is_refused() {
    let name = queue("visibility", false, Duration::from_secs(5), DAY * 4).await;
    let thirty = SqsConfig { max_batch_time: Duration::from_secs(30), ..sqs(&name) };
    let err = SqsSource::connect(&thirty, &markers_for(5)).await.err().expect("5 s against 30 s").to_string();
    assert!(err.contains("VisibilityTimeout 5 s") && err.contains("max_batch_time 30 s"), "{err}");
    assert!(err.contains("at least 30 s") && err.contains(&name), "the fix and the queue are named: {err}");
    let five = SqsConfig { max_batch_time: Duration::from_secs(5), ..sqs(&name) };
    SqsSource::connect(&five, &markers_for(5)).await.expect("5 s against 5 s passes");
    delete_queue(&client().await, &name).await.unwrap();
}

/// The queue's visible messages are the consumer's lag (read with `GetQueueAttributes`, nothing received).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queues_backlog_is_the_consumers_lag() {
    let name = queue("backlog", false, Duration::from_secs(30), DAY * 4).await;
    let producer = SqsProducer::with_client(client().await);
    for n in 0..5 {
        producer.send(&name, None, format!(r#"{{"id":"b{n}","amount":1}}"#).as_bytes(), &[]).await.unwrap();
    }
    let engine = idem::Config { group: unique("lagging"), ..markers_for(5) };
    let source = SqsSource::connect(&sqs(&name), &engine).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let lag = loop {
        if let Some(lag) = idem::lag::of(&engine.group).into_iter().find(|l| l.topic == name) {
            break lag;
        }
        assert!(std::time::Instant::now() < deadline, "no lag recorded for {name}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!((lag.messages, lag.partition), (5, None), "{lag:?}");
    drop(source);
    delete_queue(&client().await, &name).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn markers_kept_3_days_against_a_4_day_queue_are_refused() {
    let name = queue("retention", true, Duration::from_secs(30), DAY * 4).await;
    let err = SqsSource::connect(&sqs(&name), &markers_for(3)).await.err().expect("3 days against 4").to_string();
    assert!(err.contains("MessageRetentionPeriod of queue") && err.contains("3.0 days"), "{err}");
    assert!(err.contains("4.0 days") && err.contains("4.4 days"), "the queue's and the needed retention: {err}");
    SqsSource::connect(&sqs(&name), &markers_for(5)).await.expect("5 days against 4 passes");
    delete_queue(&client().await, &name).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_queue_an_unreachable_endpoint_and_the_broker_id_key_are_named() {
    let missing = unique("missing");
    let err = SqsSource::connect(&sqs(&missing), &markers_for(5)).await.err().expect("no such queue").to_string();
    assert!(err.contains(&missing) && err.contains("does not exist") && err.contains("Fix"), "{err}");

    let nowhere = SqsConfig { endpoint: Some("http://127.0.0.1:1".into()), ..sqs("orders") };
    let err = SqsSource::connect(&nowhere, &markers_for(5)).await.err().expect("nothing listens on port 1").to_string();
    assert!(err.contains("orders") && err.contains("endpoint"), "{err}");

    let by_offset = idem::Config { key: idem::KeyExtractor::BrokerId, ..markers_for(5) };
    let err = SqsSource::connect(&sqs("orders"), &by_offset).await.err().expect("broker-id").to_string();
    assert!(err.contains("broker-id") && err.contains("header:sqs-message-id"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fifo_deduplication_id_drops_a_producer_retry() {
    let name = queue("dedup", true, Duration::from_secs(30), DAY * 4).await;
    let producer = SqsProducer::with_client(client().await);
    let first = producer.send(&name, Some(b"account-1"), br#"{"id":"a","amount":1}"#, &[]).await.unwrap();
    let retry = [(idem::message::EVENT_ID_HEADER.to_owned(), first.event_id.clone().into_bytes())];
    producer.send(&name, Some(b"account-1"), br#"{"id":"a","amount":1}"#, &retry).await.unwrap();
    assert_eq!(visible_messages(&name).await, 1, "the retry with the same event id is dropped by the queue");
    producer.send(&name, Some(b"account-1"), br#"{"id":"b","amount":1}"#, &[]).await.unwrap();
    assert_eq!(visible_messages(&name).await, 2, "a new event id is a new message");
    delete_queue(&client().await, &name).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_outlasts_the_visibility_timeout_keeps_its_messages_invisible() {
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let name = queue("extend", false, Duration::from_secs(2), DAY * 4).await;
    let producer = SqsProducer::with_client(client().await);
    // Five seconds in the transaction: two and a half visibility timeouts.
    producer.send(&name, None, br#"{"id":"slow","amount":5,"sleep_ms":5000}"#, &[]).await.unwrap();
    producer.send(&name, None, br#"{"id":"other","amount":1}"#, &[]).await.unwrap();
    let engine = idem::Engine::new(db.pool.clone(), markers_for(5)).unwrap();
    // The source keeps receiving (short polls) while the batch runs: a message that reappeared would come again
    // and be counted a duplicate.
    let polling = SqsConfig { stop_at_end: false, wait_time: Duration::from_secs(1), partitions: 1, ..sqs(&name) };
    let source = SqsSource::connect(&polling, engine.config()).await.unwrap();
    let stop = tokio::time::sleep(Duration::from_secs(8));
    let stats = engine.run(source, common::Ledger::default(), stop).await.unwrap();
    assert_eq!((stats.processed, stats.duplicate), (2, 0), "nothing reappeared mid-transaction: {stats:?}");
    assert_eq!(common::ledger_total(&db.pool).await, 6);
    assert_eq!(visible_messages(&name).await, 0, "both deleted after the commit");
    delete_queue(&client().await, &name).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_json_is_dead_lettered_and_the_group_goes_on() {
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let name = queue("notjson", true, Duration::from_secs(5), DAY * 4).await;
    let producer = SqsProducer::with_client(client().await);
    producer.send(&name, Some(b"k"), b"<order id=1/>", &[]).await.unwrap();
    producer.send(&name, Some(b"k"), br#"{"id":"next","amount":3}"#, &[]).await.unwrap();
    let engine = idem::Engine::new(db.pool.clone(), markers_for(5)).unwrap();
    let source = SqsSource::connect(&sqs(&name), engine.config()).await.unwrap();
    let stats = engine.run(source, common::Ledger::default(), std::future::pending::<()>()).await.unwrap();
    assert_eq!((stats.processed, stats.dead_lettered), (1, 1), "{stats:?}");
    let reason: String = sqlx::query_scalar("SELECT error FROM dead_letters").fetch_one(&db.pool).await.unwrap();
    assert!(reason.contains("not JSON"), "{reason}");
    assert_eq!(common::ledger_total(&db.pool).await, 3);
    assert_eq!(visible_messages(&name).await, 0, "the dead letter is deleted from the queue too");
    delete_queue(&client().await, &name).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_received_more_than_max_receive_count_is_dead_lettered_without_the_handler() {
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let name = queue("receives", false, Duration::from_secs(1), DAY * 4).await;
    let producer = SqsProducer::with_client(client().await);
    producer.send(&name, None, br#"{"id":"crasher","amount":7}"#, &[]).await.unwrap();
    // The first receive is lost the way a crashed consumer loses it: taken, never deleted.
    let client = client().await;
    let url = client.get_queue_url().queue_name(&name).send().await.unwrap().queue_url().unwrap_or_default().to_owned();
    let taken = client.receive_message().queue_url(&url).wait_time_seconds(2).send().await.unwrap();
    assert_eq!(taken.messages().len(), 1);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    producer.send(&name, None, br#"{"id":"fine","amount":1}"#, &[]).await.unwrap();

    let engine = idem::Engine::new(db.pool.clone(), markers_for(5)).unwrap();
    let limited = SqsConfig { max_receive_count: Some(1), max_batch_time: Duration::from_secs(1), ..sqs(&name) };
    let source = SqsSource::connect(&limited, engine.config()).await.unwrap();
    let stats = engine.run(source, common::Ledger::default(), std::future::pending::<()>()).await.unwrap();
    assert_eq!((stats.processed, stats.dead_lettered), (1, 1), "{stats:?}");
    assert_eq!(common::ledger_rows(&db.pool, "crasher").await, 0, "the handler never applied it");
    let (reason, attempts): (String, i32) =
        sqlx::query_as("SELECT error, attempts FROM dead_letters WHERE event_id = 'crasher'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(reason.contains("received 2 times") && reason.contains("max_receive_count (1)"), "{reason}");
    assert_eq!(attempts, 0, "the handler was not tried");
    assert_eq!(visible_messages(&name).await, 0);
    delete_queue(&client, &name).await.unwrap();
}
