//! The rebalance test, automated on a real Kafka broker and PostgreSQL: two consumer processes share a
//! 3-partition topic; consumer A is killed with SIGKILL right after a database commit and before its offset
//! commit; the group rebalances, B receives A's partitions and replays; every event id has exactly one ledger
//! entry and one marker, and the replay is counted as `duplicate`.

#![cfg(feature = "kafka")]

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

fn brokers() -> String {
    std::env::var("IDEM_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{prefix}_{}_{nanos}", std::process::id())
}

/// A consumer process and what it has reported so far.
struct Consumer {
    child: Child,
    lines: mpsc::Receiver<Value>,
    assigned: Vec<i64>,
    processed: u64,
    duplicate: u64,
}

impl Consumer {
    fn spawn(topic: &str, group: &str, url: &str, fault: Option<&str>) -> Consumer {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
        command.args(["--log", "warn", "demo-worker", "--kafka", &brokers(), "--topic", topic, "--group", group]);
        command.args(["--database-url", url, "--batch-size", "5", "--follow"]);
        command.args(["--kafka-setting", "session.timeout.ms=6000"]);
        if let Some(fault) = fault {
            command.args(["--fault", fault]);
        }
        let mut child = command.stdout(Stdio::piped()).spawn().expect("start a consumer");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(value) = serde_json::from_str::<Value>(&line) {
                    let _ = tx.send(value);
                }
            }
        });
        Consumer { child, lines, assigned: Vec::new(), processed: 0, duplicate: 0 }
    }

    /// Reads what the process reported until `done` holds or `timeout` passes.
    fn until(&mut self, timeout: Duration, done: impl Fn(&Consumer) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if done(self) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.min(Duration::from_millis(200))) {
                Ok(value) => self.absorb(&value),
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(_) => return done(self),
            }
        }
    }

    fn absorb(&mut self, value: &Value) {
        if let Some(assigned) = value["assigned"].as_array() {
            self.assigned = assigned.iter().filter_map(Value::as_i64).collect();
        }
        self.processed += value["processed"].as_u64().unwrap_or(0);
        self.duplicate += value["duplicate"].as_u64().unwrap_or(0);
    }
}

fn psql(url: &str, sql: &str) -> String {
    let out = Command::new("psql").args([url, "-tAc", sql]).output().expect("psql");
    assert!(out.status.success(), "{sql}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_between_commits_then_rebalance_replays_as_duplicates() {
    let server = std::env::var("IDEM_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
    let db = unique("idem_rebalance");
    psql(&format!("{server}/postgres"), &format!("CREATE DATABASE {db}"));
    let url = format!("{server}/{db}");
    let prepared = Command::new(env!("CARGO_BIN_EXE_idem")).args(["demo-prepare", "--database-url", &url]).status();
    assert!(prepared.expect("demo-prepare").success());

    let topic = unique("rebalance").replace('_', "-");
    let group = unique("ledger-writer");
    idem::kafka::create_topic(&brokers(), &topic, 3, 7 * 86_400_000)
        .await
        .expect("create the topic (is the broker up? scripts/kafka.sh up)");

    let mut b = Consumer::spawn(&topic, &group, &url, None);
    assert!(b.until(Duration::from_secs(60), |c| c.assigned.len() == 3), "B never got the 3 partitions");
    let mut a = Consumer::spawn(&topic, &group, &url, Some("after-commit:2"));
    assert!(a.until(Duration::from_secs(60), |c| !c.assigned.is_empty()), "A never joined");
    assert!(b.until(Duration::from_secs(60), |c| c.assigned.len() < 3), "B never gave partitions to A");
    let a_partitions = a.assigned.clone();

    let producer = idem::kafka::KafkaProducer::new(&brokers()).unwrap();
    let mut expected_total = 0;
    for n in 0..300i64 {
        let payload = format!(r#"{{"idempotencyKey":"rb-{n}","account":{},"amount":{}}}"#, 1 + n % 997, n + 1);
        producer.send(&topic, Some(n.to_string().as_bytes()), payload.as_bytes(), &[]).await.unwrap();
        expected_total += n + 1;
    }

    // A dies at its second commit, before acknowledging it.
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = a.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "A was never killed by its fault point");
        a.until(Duration::from_millis(100), |_| false);
    };
    a.until(Duration::from_millis(500), |_| false);
    assert_eq!(status.signal(), Some(libc::SIGKILL), "A must die by SIGKILL: {status}");
    assert!(a.processed > 0, "A committed work before dying");

    // The group rebalances: B takes A's partitions and replays A's committed but unacknowledged batch. The
    // database says when every event is in: a report line of A's can die with it (another of its workers may
    // commit in the instant of the kill), never a commit.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        b.until(Duration::from_secs(1), |c| c.assigned.len() == 3 && c.duplicate > 0);
        let done =
            b.assigned.len() == 3 && b.duplicate > 0 && psql(&url, "SELECT COUNT(*) FROM idem_demo_ledger") == "300";
        if done {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "B did not finish: assigned {:?}, processed {} + {}, duplicates {}",
            b.assigned,
            b.processed,
            a.processed,
            b.duplicate
        );
    }
    unsafe {
        libc::kill(b.child.id() as i32, libc::SIGTERM);
    }
    let b_status = b.child.wait().unwrap();
    assert!(b_status.success(), "B shuts down cleanly on SIGTERM: {b_status}");

    assert_eq!(psql(&url, "SELECT COUNT(*) FROM idem_demo_ledger"), "300", "one ledger entry per event");
    assert_eq!(psql(&url, "SELECT COUNT(DISTINCT event_id) FROM idem_demo_ledger"), "300");
    assert_eq!(psql(&url, "SELECT COUNT(*) FROM idem_demo_processed_events"), "300", "one marker per event");
    assert_eq!(psql(&url, "SELECT SUM(balance) FROM idem_demo_accounts"), expected_total.to_string());
    assert!(a.processed + b.processed <= 300, "no event reported processed twice");
    assert!(b.duplicate >= 1, "B's replay of A's last batch counted as duplicate");
    eprintln!(
        "A owned {a_partitions:?}, processed {}; B processed {}, absorbed {} duplicates",
        a.processed, b.processed, b.duplicate
    );
    psql(&format!("{server}/postgres"), &format!("DROP DATABASE {db} WITH (FORCE)"));
}

/// `idem demo --kafka --chain`: the demo on the real broker and PostgreSQL, with its crashes, and the chain after
/// it: the credits' outbox relayed to a second topic by relays killed at random, applied by a second group.
#[test]
fn chain_demo_on_kafka_and_postgres() {
    let server = std::env::var("IDEM_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
    let db = unique("idem_kdemo");
    psql(&format!("{server}/postgres"), &format!("CREATE DATABASE {db}"));
    let url = format!("{server}/{db}");
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["demo", "--json", "--chain", "--events", "2000", "--crashes", "2", "--kafka", &brokers()])
        .args(["--database-url", &url])
        .output()
        .expect("run idem demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{e}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr)));
    assert!(out.status.success(), "{summary}");
    assert_eq!(summary["ok"], true, "{summary}");
    assert_eq!(summary["crashes_survived"], 2, "{summary}");
    assert_eq!(summary["ledger_entries"], 2000);
    // Restarts resume at the committed offsets: far fewer redeliveries than a replay from the start.
    let redelivered = summary["deliveries"].as_u64().unwrap() - summary["log_records"].as_u64().unwrap();
    assert!(redelivered < 1000, "{summary}");
    let chain = &summary["chain"];
    assert_eq!(chain["relays_killed"], 2, "{summary}");
    assert_eq!(chain["second_total_cents"], summary["expected_total_cents"], "{summary}");
    assert_eq!(chain["second_ledger_entries"], 2000, "{summary}");
    assert_eq!(chain["out_of_order"], 0, "{summary}");
    psql(&format!("{server}/postgres"), &format!("DROP DATABASE {db} WITH (FORCE)"));
}
