//! The source conformance suite: one set of checks that every source passes, run here on the embedded log and on
//! Kafka (at `IDEM_KAFKA_BROKERS`, default 127.0.0.1:9092), through real consumer processes (`idem demo-worker`)
//! writing to a SQLite ledger:
//!
//! * order within a partition (events of one key are applied in the order they were produced);
//! * exactly one effect per event, with producer duplicates and a poison message that does not block its
//!   partition;
//! * acknowledgement only after commit, and redelivery of what was not acknowledged, across SIGKILL before and
//!   after the commit and a restart;
//! * SIGTERM acknowledges what committed and nothing more (the next consumer sees no duplicate and misses none);
//! * a revocation drains the batch in hand (sources that revoke: Kafka, when a second consumer joins).
//!
//! A new source adds a [`Broker`] and runs the same functions.

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Events per run, spread over `KEYS` keys (the demo's accounts) and `PARTITIONS` partitions.
const EVENTS: usize = 600;
const KEYS: usize = 12;
const PARTITIONS: i32 = 3;

/// A source under test: where its messages are produced and how a consumer process reaches them.
trait Broker {
    fn name(&self) -> &'static str;
    /// Creates a fresh topic and produces `records` (key, payload) in order; returns the consumer's arguments.
    fn produce(&self, dir: &Path, records: &[(String, String)]) -> Vec<String>;
    /// Whether the source revokes partitions when another consumer of the group joins.
    fn revokes(&self) -> bool;
}

struct Embedded;

impl Broker for Embedded {
    fn name(&self) -> &'static str {
        "embedded log"
    }

    fn produce(&self, dir: &Path, records: &[(String, String)]) -> Vec<String> {
        let log = idem::embedded::EmbeddedLog::open(dir.join("log")).unwrap();
        log.create_topic("payments", PARTITIONS).unwrap();
        let producer = log.producer();
        for (key, payload) in records {
            producer.send("payments", Some(key.as_bytes()), payload.as_bytes(), &[]).unwrap();
        }
        producer.flush().unwrap();
        vec!["--log-dir".into(), dir.join("log").display().to_string()]
    }

    fn revokes(&self) -> bool {
        false
    }
}

struct Kafka;

fn brokers() -> String {
    std::env::var("IDEM_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

impl Broker for Kafka {
    fn name(&self) -> &'static str {
        "kafka"
    }

    fn produce(&self, dir: &Path, records: &[(String, String)]) -> Vec<String> {
        let name = dir.file_name().unwrap().to_string_lossy().replace('.', "-");
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            idem::kafka::create_topic(&brokers(), &name, PARTITIONS, 7 * 86_400_000).await.unwrap();
            let producer = idem::kafka::KafkaProducer::new(&brokers()).unwrap();
            for (key, payload) in records {
                producer.send(&name, Some(key.as_bytes()), payload.as_bytes(), &[]).await.unwrap();
            }
            producer.flush().unwrap();
        });
        vec![
            "--kafka".into(),
            brokers(),
            "--topic".into(),
            name.clone(),
            "--group".into(),
            name,
            "--kafka-setting".into(),
            "session.timeout.ms=6000".into(),
        ]
    }

    fn revokes(&self) -> bool {
        true
    }
}

fn sources() -> Vec<Box<dyn Broker>> {
    vec![Box::new(Embedded), Box::new(Kafka)]
}

/// A directory and SQLite ledger of one run, removed at the end.
struct Run {
    dir: PathBuf,
    url: String,
    worker_args: Vec<String>,
    /// Distinct events with a valid payload.
    expected: usize,
    /// Records the producer sent a second time (retries): the duplicates a consumer must absorb.
    retries: u64,
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Produces `EVENTS` payments (every 25th sent again later, one poison message) and prepares the ledger.
fn run(broker: &dyn Broker, test: &str) -> Run {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("idem-conf-{test}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut records = Vec::new();
    let mut retries = 0;
    for n in 0..EVENTS {
        let account = 1 + n % KEYS;
        let payload = format!(r#"{{"idempotencyKey":"c-{n:06}","account":{account},"amount":{}}}"#, 1 + n % 7);
        records.push((account.to_string(), payload.clone()));
        if n % 25 == 0 {
            records.push((account.to_string(), payload)); // a producer retry
            retries += 1;
        }
        if n == EVENTS / 2 {
            records.push(("3".into(), r#"{"idempotencyKey":"poison","account":3,"amount":"x"}"#.into()));
        }
    }
    let worker_args = broker.produce(&dir, &records);
    let url = format!("sqlite://{}", dir.join("ledger.db").display());
    let out = idem(&["demo-prepare", "--database-url", &url]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Run { dir, url, worker_args, expected: EVENTS, retries }
}

fn idem(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_idem")).args(args).output().expect("run idem")
}

/// A consumer process and what it reported.
struct Worker {
    child: Child,
    lines: mpsc::Receiver<Value>,
    processed: u64,
    duplicate: u64,
}

impl Worker {
    fn start(run: &Run, fault: Option<&str>, follow: bool, batch: usize) -> Worker {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
        command.args(["--log", "error", "demo-worker"]).args(&run.worker_args);
        command.args(["--database-url", &run.url, "--batch-size", &batch.to_string()]);
        if follow {
            command.arg("--follow");
        }
        match fault {
            Some(fault) => command.env("IDEM_FAULT", fault),
            None => command.env_remove("IDEM_FAULT"),
        };
        let mut child = command.stdout(Stdio::piped()).stdin(Stdio::null()).spawn().expect("start a consumer");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(value) = serde_json::from_str::<Value>(&line) {
                    let _ = tx.send(value);
                }
            }
        });
        Worker { child, lines, processed: 0, duplicate: 0 }
    }

    fn absorb(&mut self) {
        while let Ok(value) = self.lines.try_recv() {
            self.processed += value["processed"].as_u64().unwrap_or(0);
            self.duplicate += value["duplicate"].as_u64().unwrap_or(0);
        }
    }

    /// Waits for the process to exit (at most 120 s) and reads what it reported.
    fn wait(mut self) -> (std::process::ExitStatus, u64, u64) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(50));
                self.absorb();
                return (status, self.processed, self.duplicate);
            }
            assert!(Instant::now() < deadline, "a consumer did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn until_processed(&mut self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.processed < n {
            assert!(Instant::now() < deadline, "the consumer processed only {} of {n}", self.processed);
            assert!(self.child.try_wait().unwrap().is_none(), "the consumer exited early");
            std::thread::sleep(Duration::from_millis(20));
            self.absorb();
        }
    }

    fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on a child we own.
        unsafe {
            libc::kill(self.child.id() as i32, signal);
        }
    }
}

/// Runs a consumer to the end of the log; its status must be success.
fn finish(run: &Run) -> (u64, u64) {
    let (status, processed, duplicate) = Worker::start(run, None, false, 20).wait();
    assert!(status.success(), "the finishing consumer failed: {status}");
    (processed, duplicate)
}

fn scalar(run: &Run, sql: &str) -> i64 {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        use sqlx::Connection;
        let mut conn = sqlx::SqliteConnection::connect(&run.url).await.unwrap();
        sqlx::query_scalar(sql).fetch_one(&mut conn).await.unwrap_or_else(|e| panic!("{sql}: {e}"))
    })
}

/// Every event applied exactly once, the poison message dead-lettered, and each key's events applied in the
/// order they were produced.
fn assert_exactly_once_in_order(run: &Run, source: &str) {
    let expected = run.expected as i64;
    assert_eq!(scalar(run, "SELECT COUNT(*) FROM idem_demo_ledger"), expected, "{source}: ledger entries");
    assert_eq!(scalar(run, "SELECT COUNT(DISTINCT event_id) FROM idem_demo_ledger"), expected, "{source}: doubled");
    assert_eq!(scalar(run, "SELECT COUNT(*) FROM idem_demo_dead_letters"), 1, "{source}: the poison message");
    let out_of_order = "SELECT COUNT(*) FROM idem_demo_ledger a JOIN idem_demo_ledger b \
                        ON a.account = b.account AND a.rowid < b.rowid AND a.event_id > b.event_id";
    assert_eq!(scalar(run, out_of_order), 0, "{source}: events of one key applied out of order");
}

#[test]
fn order_exactly_once_and_a_poison_message_that_does_not_block() {
    for broker in sources() {
        let run = run(broker.as_ref(), "order");
        let (processed, _) = finish(&run);
        assert_eq!(processed as usize, run.expected, "{}", broker.name());
        assert_exactly_once_in_order(&run, broker.name());
    }
}

/// SIGKILL before and after a commit, then a restart: what was not acknowledged comes again; what committed is
/// a duplicate; what did not commit is applied.
#[test]
fn unacknowledged_messages_come_again_after_sigkill() {
    for broker in sources() {
        for fault in ["before-commit:3", "after-commit:3"] {
            let run = run(broker.as_ref(), "kill");
            let (status, _, _) = Worker::start(&run, Some(fault), false, 10).wait();
            assert_eq!(status.signal(), Some(libc::SIGKILL), "{}: {fault}", broker.name());
            let (_, duplicate) = finish(&run);
            if fault.starts_with("after") {
                assert!(duplicate >= 1, "{}: the committed, unacknowledged batch comes again", broker.name());
            }
            assert_exactly_once_in_order(&run, broker.name());
        }
    }
}

/// SIGTERM in the middle of the log: the consumer finishes the batch in hand, acknowledges what committed and
/// exits 0; the next consumer sees none of it again and misses nothing.
#[test]
fn sigterm_acknowledges_what_committed_and_nothing_more() {
    for broker in sources() {
        let run = run(broker.as_ref(), "term");
        let mut worker = Worker::start(&run, None, true, 5);
        worker.until_processed(100);
        worker.signal(libc::SIGTERM);
        let (status, first, first_duplicates) = worker.wait();
        assert!(status.success(), "{}: a drained shutdown exits 0: {status}", broker.name());
        let (second, second_duplicates) = finish(&run);
        // Only the producer's retries come twice: nothing committed was left unacknowledged.
        assert_eq!(first_duplicates + second_duplicates, run.retries, "{}: duplicates", broker.name());
        assert_eq!((first + second) as usize, run.expected, "{}", broker.name());
        assert_exactly_once_in_order(&run, broker.name());
    }
}

/// A second consumer joins mid-run: the source revokes partitions from the first, which drains its batch in hand
/// before they move; every event is still applied once.
#[test]
fn a_revocation_drains_the_batch_in_hand() {
    for broker in sources().into_iter().filter(|b| b.revokes()) {
        let run = run(broker.as_ref(), "revoke");
        let mut first = Worker::start(&run, None, true, 5);
        first.until_processed(50);
        let mut second = Worker::start(&run, None, true, 5);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            first.absorb();
            second.absorb();
            if (first.processed + second.processed) as usize >= run.expected {
                break;
            }
            assert!(Instant::now() < deadline, "{}: the two consumers did not finish", broker.name());
            std::thread::sleep(Duration::from_millis(50));
        }
        first.signal(libc::SIGTERM);
        second.signal(libc::SIGTERM);
        assert!(first.wait().0.success() && second.wait().0.success());
        assert_exactly_once_in_order(&run, broker.name());
    }
}
