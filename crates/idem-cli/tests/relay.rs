//! `idem relay` as a process: killed with SIGKILL at random points (two at a time, too) while it delivers an
//! outbox to an embedded log, its database connections cut under it; afterwards every message is in the log,
//! each key's messages in commit order, a repeat only ever with the same event id. Then `idem outbox stats`, and
//! the relay's metrics endpoint; and a broker (NATS, a server of the test's own) away for a while under a relay.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::outbox::{Outbox, OutgoingMessage};

mod common;

const KEYS: usize = 30;
const PER_KEY: i64 = 200;

fn fresh_postgres() -> String {
    let server = std::env::var("IDEM_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let name = format!("idem_relay_{}_{nanos}", std::process::id());
    let status = Command::new("psql")
        .args([&format!("{server}/postgres"), "-qc", &format!("CREATE DATABASE {name}")])
        .status()
        .expect("psql");
    assert!(status.success(), "create database {name}");
    format!("{server}/{name}")
}

/// A relay process, killed with SIGKILL when dropped (so a failing test leaves none behind).
struct RelayProcess(Option<Child>);

impl RelayProcess {
    /// Waits for the process to end by itself and returns its output.
    fn finish(mut self) -> std::process::Output {
        self.0.take().expect("running").wait_with_output().expect("wait for idem relay")
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill(); // SIGKILL
            let _ = child.wait();
        }
    }
}

fn relay(url: &str, dir: &std::path::Path, extra: &[&str]) -> RelayProcess {
    let child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["relay", "--database-url", url, "--log-dir"])
        .arg(dir)
        .args(["--batch-size", "40", "--poll-interval-ms", "50", "--name", "chaos"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start idem relay");
    RelayProcess(Some(child))
}

/// A pseudo-random number from a counter (no dependency on a random crate).
fn jitter(n: u64, below: u64) -> u64 {
    (n.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407) >> 33) % below
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_killed_at_random_lose_nothing_and_keep_each_keys_order() {
    let url = fresh_postgres();
    // One connection: the cut below spares only the connection that runs it, so a second one the pool opened
    // during a round would be cut too.
    let pool = idem::postgres::connect(&url, 1).await.unwrap();
    idem::migrate(&pool, &idem::Tables::default()).await.unwrap();
    let dir = std::env::temp_dir().join(format!("idem-relay-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let log = EmbeddedLog::open(&dir).unwrap();
    log.create_topic("shipments", 1).unwrap();

    // Enqueued in transactions of 40: key k's message n is committed before its message n + 1.
    let mut enqueued: HashMap<(String, i64), String> = HashMap::new();
    let order: Vec<(String, i64)> = (0..PER_KEY).flat_map(|n| (0..KEYS).map(move |k| (format!("k{k}"), n))).collect();
    for chunk in order.chunks(40) {
        let mut tx = pool.begin().await.unwrap();
        let messages: Vec<OutgoingMessage> = chunk
            .iter()
            .map(|(key, n)| OutgoingMessage::new("shipments", format!(r#"{{"n":{n}}}"#)).with_key(key.as_str()))
            .collect();
        let ids = Outbox::default().enqueue_all(&mut *tx, &messages).await.unwrap();
        tx.commit().await.unwrap();
        for ((key, n), id) in chunk.iter().zip(ids) {
            enqueued.insert((key.clone(), *n), id);
        }
    }

    // Relays killed at random points, one or two at a time, their connections cut now and then.
    let started = Instant::now();
    let waiting =
        || async { sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox").fetch_one(&pool).await.unwrap() };
    for round in 0..8u64 {
        let spawned: String = sqlx::query_scalar("SELECT now()::text").fetch_one(&pool).await.unwrap();
        let before = waiting().await;
        let mut running = vec![relay(&url, &dir, &[])];
        if round % 3 == 1 {
            running.push(relay(&url, &dir, &[]));
        }
        // Killed mid-work: once a few hundred messages (a different number each round) went out.
        let target = before - 200 - jitter(round, 300) as i64;
        let deadline = Instant::now() + Duration::from_secs(20);
        while waiting().await > target && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if round % 4 == 2 {
            // The relays' own connections (younger than this round), not the test's.
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                  WHERE datname = current_database() AND backend_start >= $1::timestamptz
                    AND pid <> pg_backend_pid()",
            )
            .bind(&spawned)
            .execute(&pool)
            .await
            .unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        drop(running); // SIGKILL
    }
    assert!(waiting().await > 0, "the kills came too late to test anything: raise PER_KEY");

    // One last relay, run to the end.
    let last = relay(&url, &dir, &["--until-empty", "--json"]).finish();
    assert!(last.status.success(), "{}", String::from_utf8_lossy(&last.stderr));
    assert_eq!(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox").fetch_one(&pool).await.unwrap(), 0);

    // Everything arrived; each key in order of first arrival; repeats carry their event id.
    let reader = log.consumer("check", &["shipments"], ConsumerOptions { stop_at_end: true, ..Default::default() });
    let reader = reader.unwrap();
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut repeats = 0;
    while let Some(idem::source::Received::Message(m)) = idem::Source::recv(&reader).await.unwrap() {
        let key = String::from_utf8(m.key.clone().unwrap()).unwrap();
        let body: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        let n = body["n"].as_i64().unwrap();
        let event_id = String::from_utf8(m.header("idem-event-id").unwrap().to_vec()).unwrap();
        assert_eq!(enqueued[&(key.clone(), n)], event_id, "{key}/{n} carries the id it was enqueued with");
        let expected = next.entry(key.clone()).or_default();
        if n == *expected {
            *expected += 1;
        } else {
            assert!(n < *expected, "{key}: {n} arrived before {expected}");
            repeats += 1;
        }
    }
    assert_eq!(next.len(), KEYS);
    assert!(next.values().all(|&n| n == PER_KEY), "every message arrived: {next:?}");
    eprintln!("{} messages, {repeats} repeats, {:?}", KEYS as i64 * PER_KEY, started.elapsed());

    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["outbox", "stats", "--json", "--database-url", &url])
        .output()
        .unwrap();
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(stats["pending"], 0, "{stats}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `idem relay --metrics-addr`: the outbox gauges on /metrics, /readyz while the database answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_serves_its_metrics() {
    use std::io::{Read, Write};
    let url = fresh_postgres();
    let pool = idem::postgres::connect(&url, 2).await.unwrap();
    idem::migrate(&pool, &idem::Tables::default()).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    Outbox::default().enqueue(&mut *tx, OutgoingMessage::new("nowhere-yet", "x").with_key("k")).await.unwrap();
    Outbox::default().enqueue(&mut *tx, OutgoingMessage::new("nowhere-yet", r#"{"n":7}"#).with_key("k")).await.unwrap();
    tx.commit().await.unwrap();
    // `outbox list --json` shows a JSON payload as JSON, any other as its text.
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["outbox", "list", "--json", "--database-url", &url])
        .output()
        .unwrap();
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["payload"], "x", "{listed}");
    assert_eq!(listed[1]["payload"]["n"], 7, "{listed}");
    let dir = std::env::temp_dir().join(format!("idem-relay-metrics-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    EmbeddedLog::open(&dir).unwrap().create_topic("nowhere-yet", 1).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let _relay = relay(&url, &dir, &["--metrics-addr", &format!("127.0.0.1:{port}")]);
    let get = |path: &str| -> Option<String> {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        // One request per connection: the endpoint keeps connections alive unless asked to close.
        write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
        let mut body = String::new();
        stream.read_to_string(&mut body).ok()?;
        Some(body)
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let metrics = loop {
        let delivered = r#"idem_outbox_published_total{destination="nowhere-yet",outcome="delivered"} 2"#;
        if let Some(body) = get("/metrics").filter(|b| b.contains(delivered)) {
            break body;
        }
        assert!(Instant::now() < deadline, "no outbox metrics on /metrics: {:?}", get("/metrics"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(metrics.contains("idem_outbox_pending_messages"), "{metrics}");
    // The outcomes that have not happened are there at 0, for increase() and absent().
    for outcome in ["failed", "dead_lettered"] {
        let line = format!(r#"idem_outbox_published_total{{destination="nowhere-yet",outcome="{outcome}"}} 0"#);
        assert!(metrics.contains(&line), "missing `{line}` in:\n{metrics}");
    }
    assert!(get("/readyz").unwrap().starts_with("HTTP/1.1 200"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The broker dies under a running relay (SIGKILL of the test's own nats-server) and comes back two seconds later:
/// the relay waits on its publishes or retries them with backoff, then delivers the rest; every message is in the stream once (the producer's
/// `Nats-Msg-Id` is the event id, so the server drops a retry of what it already had), each key in order.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_away_for_a_while_delays_the_relay_and_loses_nothing() {
    use idem::outbox::{Relay, RelayConfig};
    let mut server = common::OwnNatsServer::start();
    let day = Duration::from_secs(86_400);
    idem::nats::create_stream(&server.url(), "shipments", &["shipments.>"], day).await.unwrap();
    let url = fresh_postgres();
    let pool = idem::postgres::connect(&url, 4).await.unwrap();
    idem::migrate(&pool, &idem::Tables::default()).await.unwrap();
    for n in 0..50 {
        let mut tx = pool.begin().await.unwrap();
        let messages: Vec<OutgoingMessage> = (0..12)
            .map(|k| {
                OutgoingMessage::new(format!("shipments.k{k}"), format!(r#"{{"n":{n}}}"#)).with_key(format!("k{k}"))
            })
            .collect();
        Outbox::default().enqueue_all(&mut *tx, &messages).await.unwrap();
        tx.commit().await.unwrap();
    }
    let config = RelayConfig {
        batch_size: 10,
        poll_interval: Duration::from_millis(50),
        backoff: idem::Backoff::new(Duration::from_millis(20), Duration::from_millis(300)),
        ..RelayConfig::default()
    };
    let producer = idem::nats::NatsProducer::connect(&server.url()).await.unwrap();
    let relay = Relay::new(pool.clone(), idem::Tables::default(), config, producer).unwrap();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(async move {
        relay
            .run(async move {
                let _ = stopped.wait_for(|s| *s).await;
            })
            .await
    });
    let waiting =
        || async { sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox").fetch_one(&pool).await.unwrap() };
    let deadline = Instant::now() + Duration::from_secs(30);
    while waiting().await > 450 {
        assert!(Instant::now() < deadline, "the relay did not start delivering");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let left_during_outage = waiting().await;
    assert!(left_during_outage > 0, "the outage must come mid-run");
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(60);
    while waiting().await > 0 {
        assert!(Instant::now() < deadline, "the relay did not finish after the broker came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(true).unwrap();
    let stats = running.await.unwrap().unwrap();
    assert_eq!(stats.dead_lettered, 0, "an outage is not a reason to dead-letter: {stats:?}");

    let nats = idem::nats::NatsConfig { stop_at_end: true, ..idem::nats::NatsConfig::new(server.url(), "shipments") };
    let engine = idem::Config::new("check", idem::KeyExtractor::Header("idem-event-id".into()));
    let source = idem::nats::NatsSource::connect(&nats, &engine).await.unwrap();
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut ids = std::collections::HashSet::new();
    while let Some(idem::source::Received::Message(m)) = idem::Source::recv(&source).await.unwrap() {
        let subject = String::from_utf8(m.key.clone().unwrap()).unwrap();
        let n = serde_json::from_slice::<serde_json::Value>(&m.payload).unwrap()["n"].as_i64().unwrap();
        assert!(ids.insert(m.header("idem-event-id").unwrap().to_vec()), "{subject}/{n} stored twice");
        let expected = next.entry(subject.clone()).or_default();
        assert_eq!(n, *expected, "{subject}: out of order");
        *expected += 1;
        idem::Source::ack(&source, &idem::Acknowledgement::of(std::slice::from_ref(&m)).unwrap()).await.unwrap();
    }
    assert_eq!(next.len(), 12);
    assert!(next.values().all(|&n| n == 50), "{next:?}");
}

/// A relay to NATS whose destination no stream holds says so when it starts, naming the subject and the command
/// that fixes it; its messages wait (nothing is dead-lettered), and once the stream is created they are delivered.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_no_stream_holds_is_named_and_waits_for_its_stream() {
    let nats = std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let stream = format!("idem_relay_nostream_{}_{nanos}", std::process::id());
    let subject = format!("{stream}.orders");
    let dir = std::env::temp_dir().join(&stream);
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/outbox.db", dir.display());
    let pool = idem::sqlite::connect(&url).await.unwrap();
    idem::migrate(&pool, &idem::Tables::default()).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let messages: Vec<OutgoingMessage> =
        (0..3).map(|n| OutgoingMessage::new(subject.clone(), format!(r#"{{"n":{n}}}"#))).collect();
    Outbox::default().enqueue_all(&mut *tx, &messages).await.unwrap();
    tx.commit().await.unwrap();
    pool.close().await;

    let stderr = std::fs::File::create(dir.join("relay.err")).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["relay", "--database-url", &url, "--nats", &nats, "--until-empty", "--poll-interval-ms", "50"])
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("start idem relay");
    let running = RelayProcess(Some(child));
    let deadline = Instant::now() + Duration::from_secs(30);
    let said = loop {
        let said = std::fs::read_to_string(dir.join("relay.err")).unwrap_or_default();
        if said.contains("no JetStream stream holds the subject") {
            break said;
        }
        assert!(Instant::now() < deadline, "the relay did not name the missing stream:\n{said}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        said.contains(&subject) && said.contains(&format!("nats stream add NAME --subjects '{subject}'")),
        "{said}"
    );
    idem::nats::create_stream(&nats, &stream, &[&format!("{stream}.>")], Duration::ZERO).await.unwrap();
    let out = running.finish();
    assert!(out.status.success(), "{}", std::fs::read_to_string(dir.join("relay.err")).unwrap_or_default());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("delivered 3") && stdout.contains("dead-lettered 0"), "{stdout}");
    idem::nats::delete_stream(&nats, &stream).await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
