//! NATS JetStream, against a real server (`IDEM_NATS_URL`, default nats://127.0.0.1:4222): the retention guard on
//! a stream's `max_age`, the AckWait guard and the acknowledgement-policy refusal on an existing consumer, clear
//! errors for a wrong URL, wrong credentials or a missing stream, the producer's message id dropping a retry, and the last delivery
//! `max_deliver` allows kept as a dead letter and terminated.
#![cfg(feature = "nats")]

mod common;

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, pull};
use common::config;
use futures_util::StreamExt;
use idem::nats::{NatsConfig, NatsProducer, NatsSource, create_stream, delete_stream};

const DAY: Duration = Duration::from_secs(86_400);

fn url() -> String {
    std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{prefix}-{}-{nanos}", std::process::id())
}

/// The engine's configuration with markers kept `days` days (`None`: never pruned), in a group of its own.
fn markers_for(days: Option<u64>) -> idem::Config {
    let engine = idem::Config { group: unique("g"), ..config(10) };
    match days {
        Some(days) => engine.marker_retention(DAY * days as u32),
        None => engine,
    }
}

async fn stream(prefix: &str, max_age: Duration) -> String {
    let name = unique(prefix);
    create_stream(&url(), &name, &[&format!("{name}.>")], max_age).await.expect("create stream (is nats-server up?)");
    name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_guard_refuses_3_days_against_a_7_day_stream_and_passes_8() {
    let name = stream("retention", DAY * 7).await;
    let nats = NatsConfig::new(url(), name.as_str());
    let err = NatsSource::connect(&nats, &markers_for(Some(3))).await.err().expect("3 days against 7").to_string();
    assert!(err.contains("max_age of stream") && err.contains("3.0 days") && err.contains("7.7 days"), "{err}");
    NatsSource::connect(&nats, &markers_for(Some(8))).await.expect("8 days against 7 passes");
    delete_stream(&url(), &name).await.unwrap();
    // Deleting it again is not an error (known by JetStream's error code for a missing stream).
    delete_stream(&url(), &name).await.expect("a missing stream is already deleted");

    // A stream that keeps messages forever needs markers that are never pruned, or the override.
    let forever = stream("forever", Duration::ZERO).await;
    let nats = NatsConfig::new(url(), forever.as_str());
    let err = NatsSource::connect(&nats, &markers_for(Some(30))).await.err().expect("forever").to_string();
    assert!(err.contains("max_age=0") && err.contains("accept_infinite_stream_retention"), "{err}");
    NatsSource::connect(&nats, &markers_for(None)).await.expect("never-pruned markers pass");
    let accepted = NatsConfig { accept_infinite_stream_retention: true, ..nats };
    NatsSource::connect(&accepted, &markers_for(Some(30))).await.expect("the override passes");
    delete_stream(&url(), &forever).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_consumer_with_a_short_ack_wait_or_another_policy_is_refused() {
    let name = stream("ackwait", DAY).await;
    let client = async_nats::connect(url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(&name).await.unwrap();
    for (durable, ack_policy, ack_wait) in
        [("short", AckPolicy::Explicit, Duration::from_secs(1)), ("all", AckPolicy::All, Duration::from_secs(60))]
    {
        let consumer = pull::Config { durable_name: Some(durable.into()), ack_policy, ack_wait, ..Default::default() };
        stream.create_consumer(consumer).await.unwrap();
    }
    let nats = NatsConfig {
        durable: Some("short".into()),
        max_batch_time: Duration::from_secs(30),
        ..NatsConfig::new(url(), name.as_str())
    };
    let err = NatsSource::connect(&nats, &markers_for(Some(2))).await.err().expect("AckWait 1 s").to_string();
    assert!(
        err.contains("AckWait 1 s") && err.contains("max_batch_time 30 s") && err.contains("at least 30 s"),
        "{err}"
    );
    let all = NatsConfig { durable: Some("all".into()), ..nats };
    let err = NatsSource::connect(&all, &markers_for(Some(2))).await.err().expect("AckPolicy::All").to_string();
    assert!(err.contains("ack_policy=all") && err.contains("ack_policy=explicit"), "{err}");
    delete_stream(&url(), &name).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_url_or_a_missing_stream_is_named() {
    let err = NatsSource::connect(&NatsConfig::new("nats://127.0.0.1:1", "s"), &markers_for(Some(2)))
        .await
        .err()
        .expect("nothing listens on port 1")
        .to_string();
    assert!(err.contains("nats://127.0.0.1:1"), "{err}");
    let missing = unique("missing");
    let err = NatsSource::connect(&NatsConfig::new(url(), missing.as_str()), &markers_for(Some(2)))
        .await
        .err()
        .expect("no such stream")
        .to_string();
    assert!(err.contains(&missing) && err.contains("nats stream add"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_are_named_without_the_password() {
    // A server of the test's own that asks for a user and password (the shared one asks for none).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let binary = std::env::var("IDEM_NATS_SERVER").unwrap_or_else(|_| "/usr/sbin/nats-server".to_owned());
    let mut server = std::process::Command::new(&binary)
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "--user", "idem", "--pass", "right"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {binary} (set IDEM_NATS_SERVER): {e}"));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(std::time::Instant::now() < deadline, "the test's nats-server did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let wrong = NatsConfig::new(format!("nats://idem:wrong@127.0.0.1:{port}"), "s");
    let err = NatsSource::connect(&wrong, &markers_for(Some(2))).await.err().map(|e| e.to_string());
    let _ = server.kill();
    let _ = server.wait();
    let err = err.expect("a wrong password is refused");
    assert!(err.contains(&format!("nats://idem:***@127.0.0.1:{port}")) && !err.contains("wrong"), "{err}");
    assert!(err.to_lowercase().contains("authori"), "the cause is named: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_producer_message_id_drops_a_retry_within_the_duplicate_window() {
    let name = stream("dedup", DAY).await;
    let producer = NatsProducer::connect(&url()).await.unwrap();
    let subject = format!("{name}.a");
    let first = producer.send(&subject, b"x", &[]).await.unwrap();
    assert!(!first.duplicate);
    let retry = [(idem::message::EVENT_ID_HEADER.to_owned(), first.event_id.clone().into_bytes())];
    let again = producer.send(&subject, b"x", &retry).await.unwrap();
    assert!(again.duplicate, "the same id within the window is dropped by the server");
    assert_eq!(again.sequence, first.sequence);
    let other = producer.send(&subject, b"x", &[]).await.unwrap();
    assert!(!other.duplicate && other.sequence > first.sequence);
    delete_stream(&url(), &name).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_delivery_max_deliver_allows_is_dead_lettered_without_the_handler_and_terminated() {
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let name = stream("limit", DAY).await;
    let producer = NatsProducer::connect(&url()).await.unwrap();
    producer.send(&format!("{name}.a"), br#"{"id":"crasher","amount":7}"#, &[]).await.unwrap();
    producer.send(&format!("{name}.a"), br#"{"id":"fine","amount":1}"#, &[]).await.unwrap();
    let engine = idem::Engine::new(db.pool.clone(), markers_for(Some(2))).unwrap();
    let nats = NatsConfig {
        max_deliver: 2,
        ack_wait: Duration::from_secs(1),
        max_batch_time: Duration::from_secs(1),
        max_ack_pending: Some(1),
        stop_at_end: true,
        ..NatsConfig::new(url(), name.as_str())
    };

    // The first delivery is lost the way a hung consumer loses it: taken, never acknowledged.
    let crashed = NatsSource::connect(&nats, engine.config()).await.unwrap();
    drop(crashed); // creates the durable consumer with the settings above
    let js = async_nats::jetstream::new(async_nats::connect(url()).await.unwrap());
    let consumer: async_nats::jetstream::consumer::PullConsumer =
        js.get_stream(&name).await.unwrap().get_consumer(&engine.config().group).await.unwrap();
    let mut batch = consumer.fetch().max_messages(1).messages().await.unwrap();
    let first = batch.next().await.expect("a message").unwrap();
    assert!(String::from_utf8_lossy(&first.payload).contains("crasher"));
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let advisories = async_nats::connect(url()).await.unwrap();
    let advisory = format!("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{name}.{}", engine.config().group);
    let mut terminated = advisories.subscribe(advisory).await.unwrap();
    advisories.flush().await.unwrap();
    let source = NatsSource::connect(&nats, engine.config()).await.unwrap();
    let stats = engine.run(source, common::Ledger::default(), std::future::pending::<()>()).await.unwrap();
    assert_eq!((stats.processed, stats.dead_lettered), (1, 1));
    let notice = tokio::time::timeout(Duration::from_secs(5), terminated.next()).await.expect("a termination advisory");
    let notice = String::from_utf8_lossy(&notice.expect("advisory").payload).into_owned();
    assert!(notice.contains(r#""stream_seq":1"#), "the dead letter was terminated, not acknowledged: {notice}");
    assert_eq!(common::ledger_rows(&db.pool, "crasher").await, 0, "the handler never applied the last delivery");
    assert_eq!(common::ledger_total(&db.pool).await, 1);
    assert_eq!(common::markers(&db.pool, "crasher").await, 1, "a redelivery would be a plain duplicate");
    let (reason, attempts): (String, i32) =
        sqlx::query_as("SELECT error, attempts FROM dead_letters WHERE event_id = 'crasher'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(reason.contains("max_deliver (2)") && reason.contains("replay"), "{reason}");
    assert_eq!(attempts, 0, "the handler was not tried");

    // Settled on the server (+TERM): nothing pending, nothing awaiting acknowledgement, nothing comes again.
    let mut consumer = consumer;
    let info = consumer.info().await.unwrap();
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0), "{info:?}");
    delete_stream(&url(), &name).await.unwrap();
}

/// A publish to a subject no stream holds (a relay whose destination stream was never created) says so and how
/// to fix it, as a retryable error: the stream may be created meanwhile, and the next publish is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_to_a_subject_no_stream_holds_names_the_fix() {
    let producer = NatsProducer::connect(&url()).await.unwrap();
    let name = unique("nostream");
    let subject = format!("{name}.orders");
    let error = producer.send(&subject, b"{}", &[]).await.expect_err("no stream holds the subject");
    let text = error.to_string();
    assert!(text.contains(&format!("no JetStream stream holds the subject {subject}")), "{text}");
    assert!(text.contains(&format!("nats stream add NAME --subjects '{subject}'")), "{text}");
    assert_eq!(error.retry(), idem::Retry::Helps, "retried until the stream exists: {text}");
    create_stream(&url(), &name, &[&format!("{name}.>")], Duration::ZERO).await.unwrap();
    let published = producer.send(&subject, b"{}", &[]).await.expect("stored once the stream exists");
    assert_eq!(published.sequence, 1);
    delete_stream(&url(), &name).await.unwrap();
}
