//! Google Cloud Pub/Sub against Google's emulator (`IDEM_PUBSUB_EMULATOR_HOST`, default scripts/pubsub.sh's
//! 127.0.0.1:8681): the lease extension that keeps a batch running several ack deadlines from being delivered
//! twice (and its mutant without it), a late acknowledgement refused on an exactly-once subscription counted while
//! the consumer goes on, the delivery the subscription's dead-letter policy calls last kept as a
//! dead letter without the handler, and the start-up refusals (a missing subscription, an unreachable endpoint,
//! a subscription without ordering where order is required, a marker retention shorter than the subscription's,
//! the `broker-id` key, no project).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::pubsub::{
    MESSAGE_ID_HEADER, PubSubConfig, PubSubProducer, PubSubSource, SubscriptionOptions, create_subscription,
    create_topic,
};
use idem::source::{Acknowledgement, Received};
use idem::{Error, Source, SourceError};

const PROJECT: &str = "idem-test";
const DAY: Duration = Duration::from_secs(86_400);

fn emulator() -> String {
    std::env::var("IDEM_PUBSUB_EMULATOR_HOST").unwrap_or_else(|_| "127.0.0.1:8681".to_owned())
}

/// A topic and a subscription to it, named for this test.
async fn topic(prefix: &str, options: &SubscriptionOptions) -> (String, String) {
    let name = common::unique_name(prefix).replace('.', "-");
    create_topic(Some(&emulator()), PROJECT, &name).await.expect("create topic (is scripts/pubsub.sh up?)");
    let subscription = format!("{name}-sub");
    create_subscription(Some(&emulator()), PROJECT, &name, &subscription, options).await.expect("subscription");
    (name, subscription)
}

fn source_config(subscription: &str) -> PubSubConfig {
    PubSubConfig {
        project: Some(PROJECT.into()),
        emulator_host: Some(emulator()),
        stop_at_end: true,
        ..PubSubConfig::new(subscription)
    }
}

async fn publish(topic: &str, key: &str, payloads: &[&str]) {
    let producer = PubSubProducer::connect(Some(PROJECT), Some(&emulator())).await.unwrap();
    for payload in payloads {
        producer.send(topic, Some(key), payload.as_bytes(), &[]).await.unwrap();
    }
}

/// Deliveries per Pub/Sub message id.
type Deliveries = Arc<Mutex<HashMap<String, usize>>>;

/// A source that counts the deliveries of each Pub/Sub message.
struct Counting {
    inner: PubSubSource,
    deliveries: Deliveries,
}

impl Source for Counting {
    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        let received = self.inner.recv().await?;
        if let Some(Received::Message(m)) = &received {
            let id = String::from_utf8_lossy(m.header(MESSAGE_ID_HEADER).unwrap_or_default()).into_owned();
            *self.deliveries.lock().unwrap().entry(id).or_default() += 1;
        }
        Ok(received)
    }

    async fn ack(&self, ack: &Acknowledgement) -> Result<(), SourceError> {
        self.inner.ack(ack).await
    }
}

/// Runs one message whose handler takes 25 s (two and a half ack deadlines of 10 s) and two quick ones through a
/// source with `config`; returns the most deliveries of one message, and checks the ledger is exact either way.
async fn slow_batch(prefix: &str, config: impl FnOnce(PubSubConfig) -> PubSubConfig) -> usize {
    let options = SubscriptionOptions { ordering: true, ack_deadline_seconds: 10, ..Default::default() };
    slow_batch_on(prefix, &options, config).await.0
}

/// [`slow_batch`] on a subscription with `options`; also returns the subscription's id.
async fn slow_batch_on(
    prefix: &str,
    options: &SubscriptionOptions,
    config: impl FnOnce(PubSubConfig) -> PubSubConfig,
) -> (usize, String) {
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let (name, subscription) = topic(prefix, options).await;
    publish(&name, "k", &[r#"{"id":"slow","amount":1,"sleep_ms":25000}"#, r#"{"id":"a","amount":2}"#]).await;
    publish(&name, "k", &[r#"{"id":"b","amount":4}"#]).await;
    let engine = idem::Engine::new(db.pool.clone(), common::config(10)).unwrap();
    let source = PubSubSource::connect(&config(source_config(&subscription)), engine.config()).await.unwrap();
    let deliveries = Deliveries::default();
    let counting = Counting { inner: source, deliveries: Arc::clone(&deliveries) };
    let stats = engine.run(counting, common::Ledger::default(), std::future::pending::<()>()).await.unwrap();
    assert_eq!(stats.processed, 3, "{stats:?}");
    assert_eq!(common::ledger_total(&db.pool).await, 7, "each payment applied once, whatever came twice");
    assert_eq!(common::ledger_rows(&db.pool, "slow").await, 1);
    let most = deliveries.lock().unwrap().values().copied().max().unwrap_or(0);
    (most, subscription)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_running_several_ack_deadlines_is_delivered_once() {
    let most = slow_batch("lease", |c| c).await;
    assert_eq!(most, 1, "the lease was extended while the batch ran: nothing was delivered twice");
}

/// The mutant: idem stops extending after 1 s, so the slow message's deadline passes mid-transaction and Pub/Sub
/// delivers it again. The test above fails on such a source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lease_extension_the_slow_batch_is_delivered_again() {
    let most = slow_batch("nolease", |c| PubSubConfig {
        max_lease: Duration::from_secs(1),
        max_batch_time: Duration::from_secs(1),
        ..c
    })
    .await;
    assert!(most >= 2, "without the extension the slow message must come again; it came {most} time(s)");
}

/// On a subscription with exactly-once delivery, the acknowledgement of the slow message's first delivery comes
/// after its deadline passed (the mutant's 1 s lease): Pub/Sub refuses it. idem counts it
/// (`idem_pubsub_ack_failed_total`), the consumer goes on, and the redelivery is absorbed by the marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_an_exactly_once_subscription_a_refused_ack_is_counted_and_the_consumer_goes_on() {
    let metrics = idem::http::install_recorder().expect("the test binary's one recorder");
    let options =
        SubscriptionOptions { ordering: true, ack_deadline_seconds: 10, exactly_once: true, ..Default::default() };
    let (most, subscription) = slow_batch_on("eod", &options, |c| PubSubConfig {
        max_lease: Duration::from_secs(1),
        max_batch_time: Duration::from_secs(1),
        ..c
    })
    .await;
    assert!(most >= 2, "the slow message must come again; it came {most} time(s)");
    let rendered = metrics.render();
    let refused: f64 = rendered
        .lines()
        .filter(|line| line.starts_with("idem_pubsub_ack_failed_total") && line.contains(&subscription))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(refused >= 1.0, "the late acknowledgement was refused and counted:\n{rendered}");
}

/// A source that drops every delivery that is not the last the dead-letter policy allows, as a consumer crashing
/// on the message would lose it.
struct Crashing {
    inner: PubSubSource,
    dropped: Deliveries,
}

impl Source for Crashing {
    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        loop {
            match self.inner.recv().await? {
                Some(Received::Message(m)) if m.dead_letter_reason.is_none() => {
                    let id = String::from_utf8_lossy(m.header(MESSAGE_ID_HEADER).unwrap_or_default()).into_owned();
                    *self.dropped.lock().unwrap().entry(id).or_default() += 1;
                }
                other => return Ok(other),
            }
        }
    }

    async fn ack(&self, ack: &Acknowledgement) -> Result<(), SourceError> {
        self.inner.ack(ack).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delivery_the_dead_letter_policy_calls_last_is_kept_without_the_handler() {
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let dead = common::unique_name("dlq").replace('.', "-");
    create_topic(Some(&emulator()), PROJECT, &dead).await.unwrap();
    let options = SubscriptionOptions {
        ordering: false,
        ack_deadline_seconds: 10,
        dead_letter: Some((dead.clone(), 5)),
        exactly_once: false,
    };
    let (name, subscription) = topic("policy", &options).await;
    publish(&name, "", &[r#"{"id":"crasher","amount":7}"#]).await;
    let engine = idem::Engine::new(db.pool.clone(), common::config(10).marker_retention(DAY * 8)).unwrap();

    // The first four deliveries are lost the way a crashing consumer loses them: taken, never acknowledged
    // (returned to Pub/Sub at once, which counts them as attempts).
    let source = PubSubSource::connect(&source_config(&subscription), engine.config()).await.unwrap();
    let crashing = Crashing { inner: source, dropped: Deliveries::default() };
    let dropped = Arc::clone(&crashing.dropped);
    let ledger = common::Ledger::default();
    let stats = engine.run(crashing, ledger, std::future::pending::<()>()).await.unwrap();
    assert_eq!(stats.dead_lettered, 1, "{stats:?}");
    assert_eq!(dropped.lock().unwrap().values().sum::<usize>(), 4, "four deliveries before the last");
    assert_eq!(common::ledger_rows(&db.pool, "crasher").await, 0, "the handler never applied the last delivery");
    let (reason, attempts): (String, i32) =
        sqlx::query_as("SELECT error, attempts FROM dead_letters WHERE event_id = 'crasher'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(reason.contains("max_delivery_attempts (5)") && reason.contains("replay"), "{reason}");
    assert_eq!(attempts, 0, "the handler was not tried");
}

fn config_error(result: Result<PubSubSource, Error>) -> String {
    match result {
        Ok(_) => panic!("start-up was accepted"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_refuses_what_cannot_work_naming_the_cause_and_the_fix() {
    let engine = common::config(10).marker_retention(DAY * 8);
    let missing = config_error(PubSubSource::connect(&source_config("no-such-subscription"), &engine).await);
    assert!(missing.contains("no-such-subscription") && missing.contains("does not exist"), "{missing}");

    let (_, unordered) = topic("unordered", &SubscriptionOptions::default()).await;
    let required = PubSubConfig { require_ordering: true, ..source_config(&unordered) };
    let err = config_error(PubSubSource::connect(&required, &engine).await);
    assert!(err.contains("message ordering") && err.contains("--enable-message-ordering"), "{err}");

    // Pub/Sub keeps unacknowledged messages 7 days by default: markers kept 3 days are refused, 8 pass.
    let short = config_error(
        PubSubSource::connect(&source_config(&unordered), &common::config(10).marker_retention(DAY * 3)).await,
    );
    assert!(short.contains("retention guard") && short.contains(&unordered), "{short}");
    PubSubSource::connect(&source_config(&unordered), &engine).await.unwrap();

    let nowhere = PubSubConfig { emulator_host: Some("127.0.0.1:9".into()), ..source_config(&unordered) };
    let err = config_error(PubSubSource::connect(&nowhere, &engine).await);
    assert!(err.contains("127.0.0.1:9"), "{err}");

    let by_position = idem::Config { key: idem::KeyExtractor::BrokerId, ..engine.clone() };
    let err = config_error(PubSubSource::connect(&source_config(&unordered), &by_position).await);
    assert!(err.contains("broker-id") && err.contains("header:pubsub-message-id"), "{err}");

    let no_project = PubSubConfig { project: None, ..source_config(&unordered) };
    if std::env::var_os("GOOGLE_CLOUD_PROJECT").is_none() {
        let err = config_error(PubSubSource::connect(&no_project, &engine).await);
        assert!(err.contains("GOOGLE_CLOUD_PROJECT"), "{err}");
    }
}

/// An emulator of the test's own, on a free port.
struct OwnEmulator {
    port: u16,
    child: std::process::Child,
}

impl OwnEmulator {
    fn start(port: u16) -> OwnEmulator {
        let launcher = std::process::Command::new("scripts/pubsub.sh")
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .arg("bin")
            .output()
            .expect("scripts/pubsub.sh bin");
        let launcher = String::from_utf8_lossy(&launcher.stdout).trim().to_owned();
        let child = std::process::Command::new(&launcher)
            .args(["--host=127.0.0.1", &format!("--port={port}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start the emulator");
        // Owned from here: dropped (killed and waited for) on every path, the panic below included.
        let emulator = OwnEmulator { port, child };
        for _ in 0..120 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return emulator;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        panic!("the emulator did not come up on port {port}");
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// SIGKILL: the emulator keeps everything in memory, so its topics, subscriptions and messages go with it.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for OwnEmulator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The emulator killed with SIGKILL mid-run and started again: the consumer does not stop, nothing it applied
/// is applied again, and what is published after the restart is applied once. (The emulator keeps nothing across
/// a restart, so the topic and subscription are made again, as an operator would.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_emulator_killed_and_restarted_mid_run_loses_the_consumer_nothing_and_doubles_nothing() {
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut emulator = OwnEmulator::start(port);
    let host = emulator.host();
    let name = common::unique_name("restart").replace('.', "-");
    let subscription = format!("{name}-sub");
    let make = |host: String| {
        let (name, subscription) = (name.clone(), subscription.clone());
        async move {
            create_topic(Some(&host), PROJECT, &name).await.expect("topic");
            let options = SubscriptionOptions { ordering: true, ..Default::default() };
            create_subscription(Some(&host), PROJECT, &name, &subscription, &options).await.expect("subscription");
        }
    };
    let publish_range = |host: String, range: std::ops::Range<usize>| {
        let name = name.clone();
        async move {
            let producer = PubSubProducer::connect(Some(PROJECT), Some(&host)).await.unwrap();
            for i in range {
                let payload = format!(r#"{{"id":"p{i}","amount":{}}}"#, i + 1);
                producer.send(&name, Some(&format!("k{}", i % 4)), payload.as_bytes(), &[]).await.unwrap();
            }
        }
    };
    make(host.clone()).await;
    publish_range(host.clone(), 0..50).await;

    let engine = idem::Engine::new(db.pool.clone(), common::config(10).marker_retention(DAY * 8)).unwrap();
    let config = PubSubConfig { emulator_host: Some(host.clone()), stop_at_end: false, ..source_config(&subscription) };
    let source = PubSubSource::connect(&config, engine.config()).await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run =
        tokio::spawn(
            async move { engine.run(source, common::Ledger::default(), async move { drop(stopped.await) }).await },
        );
    let applied = |n: i64| {
        let pool = db.pool.clone();
        async move {
            for _ in 0..240 {
                if common::ledger_rows_total(&pool).await >= n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            panic!("fewer than {n} payments applied after 120 s");
        }
    };
    applied(50).await;

    emulator.kill();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let restarted = OwnEmulator::start(port);
    make(restarted.host()).await;
    publish_range(restarted.host(), 50..80).await;
    applied(80).await;
    let _ = stop.send(());
    let stats = tokio::time::timeout(Duration::from_secs(60), run).await.expect("the run ends").unwrap().unwrap();
    assert_eq!(common::ledger_rows_total(&db.pool).await, 80, "{stats:?}");
    assert_eq!(common::ledger_total(&db.pool).await, (1..=80).sum::<i64>(), "each payment applied once");
}
