//! The source conformance suite: one set of checks that every source passes, run here on the embedded log, on
//! Kafka (at `IDEM_KAFKA_BROKERS`, default 127.0.0.1:9092) and on NATS JetStream (at `IDEM_NATS_URL`, default
//! nats://127.0.0.1:4222; with the default and with the strict-order setting), through real consumer processes
//! (`idem demo-worker`) writing to a SQLite ledger (`IDEM_CONFORMANCE_ONLY=nats` runs the sources whose name
//! contains `nats`):
//!
//! * order within a partition (events of one key are applied in the order they were produced);
//! * exactly one effect per event, with producer duplicates and a poison message that does not block its
//!   partition;
//! * acknowledgement only after commit, and redelivery of what was not acknowledged, across SIGKILL before and
//!   after the commit and a restart;
//! * SIGTERM acknowledges what committed and nothing more (the next consumer sees no duplicate and misses none);
//! * a revocation drains the batch in hand (sources that revoke: Kafka, when a second consumer joins);
//! * a replayed dead letter comes back through the source it came from.
//!
//! Order after a redelivery is checked on the sources that keep it ([`Broker::orders_redeliveries`]); NATS
//! JetStream keeps it only with one message in flight. Beside the suite: a NATS server of the test's own killed
//! and restarted mid-run.
//!
//! Amazon SQS runs it on a FIFO and a standard queue (at `IDEM_SQS_ENDPOINT`, default the local server of
//! scripts/sqs.sh). Beside the suite: the SQS server cut off mid-run.
//!
//! A new source adds a [`Broker`] and runs the same functions.

#![cfg(all(feature = "kafka", feature = "nats", feature = "rabbitmq", feature = "sqs", feature = "pubsub"))]

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
use common::OwnNatsServer;

/// Events per run, spread over `KEYS` keys (the demo's accounts) and `PARTITIONS` partitions.
const EVENTS: usize = 600;
const KEYS: usize = 12;
const PARTITIONS: i32 = 3;

/// A source under test: where its messages are produced and how a consumer process reaches them.
trait Broker: Send + Sync {
    fn name(&self) -> &'static str;
    /// Creates a fresh topic and produces `records` (key, payload) in order; returns the consumer's arguments.
    fn produce(&self, dir: &Path, records: &[(String, String)]) -> Vec<String>;
    /// Whether the source revokes partitions when another consumer of the group joins.
    fn revokes(&self) -> bool;
    /// Events per run.
    fn events(&self) -> usize {
        EVENTS
    }
    /// Whether the source delivers each key's messages in the order they were produced (SQS standard queues
    /// promise no order).
    fn orders(&self) -> bool {
        true
    }
    /// Whether a message delivered again (after a crash or a stop) still comes before later messages of its
    /// partition. Where it does not, the checks after a crash or a stop hold the source to exactly-once only.
    fn orders_redeliveries(&self) -> bool {
        true
    }
    /// Removes what `produce` created on the broker, given the consumer's arguments.
    fn remove(&self, _worker_args: &[String]) {}
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

/// NATS JetStream; `strict` runs with one message in flight (`--strict-order`), the setting that keeps order
/// across redelivery.
struct Nats {
    strict: bool,
    url: String,
}

fn nats_url() -> String {
    std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

impl Broker for Nats {
    fn name(&self) -> &'static str {
        if self.strict { "nats jetstream, strict order" } else { "nats jetstream" }
    }

    /// A stream of its own over `<name>.*`, each event published to `<name>.<key>`; AckWait 2 s, so what a killed
    /// consumer held comes again quickly.
    fn produce(&self, dir: &Path, records: &[(String, String)]) -> Vec<String> {
        let name = dir.file_name().unwrap().to_string_lossy().replace('.', "-");
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let url = &self.url;
            idem::nats::create_stream(url, &name, &[&format!("{name}.*")], Duration::from_secs(7 * 86_400))
                .await
                .unwrap();
            let producer = idem::nats::NatsProducer::connect(url).await.unwrap();
            for (key, payload) in records {
                let published = producer.send(&format!("{name}.{key}"), payload.as_bytes(), &[]).await.unwrap();
                assert!(!published.duplicate, "each send has its own message id");
            }
        });
        let mut args = vec![
            "--nats".into(),
            self.url.clone(),
            "--topic".into(),
            name.clone(),
            "--group".into(),
            name,
            "--ack-wait-secs".into(),
            "2".into(),
        ];
        if self.strict {
            args.push("--strict-order".into());
        } else {
            // The subjects spread over partitions: handled in parallel, each subject in order.
            args.extend(["--nats-partitions".into(), PARTITIONS.to_string()]);
        }
        args
    }

    fn revokes(&self) -> bool {
        false
    }

    fn orders_redeliveries(&self) -> bool {
        self.strict
    }

    fn remove(&self, worker_args: &[String]) {
        if let Some(name) = worker_args.iter().skip_while(|a| *a != "--topic").nth(1) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let _ = runtime.block_on(idem::nats::delete_stream(&self.url, name));
        }
    }
}

/// RabbitMQ: one queue per partition, each key's events published to one of them (so each key keeps its order);
/// classic queues, or quorum queues. The consumer reaches the server at `consumer_url` (a proxy of the test's own)
/// when one is given.
struct Rabbit {
    quorum: bool,
    consumer_url: Option<String>,
}

fn rabbitmq_url() -> String {
    std::env::var("IDEM_RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

impl Rabbit {
    fn queues(name: &str) -> Vec<String> {
        (0..PARTITIONS).map(|p| format!("{name}-{p}")).collect()
    }
}

impl Broker for Rabbit {
    fn name(&self) -> &'static str {
        if self.quorum { "rabbitmq-quorum" } else { "rabbitmq" }
    }

    /// A classic queue puts back what a stopped consumer held at its place. The quorum queues of the RabbitMQ here
    /// (3.10) do not always: in about one run of fifteen, a few of the messages a consumer held when it stopped
    /// came back after messages published later. So after a crash or a stop, the suite holds quorum queues to
    /// exactly-once only.
    fn orders_redeliveries(&self) -> bool {
        !self.quorum
    }

    fn produce(&self, dir: &Path, records: &[(String, String)]) -> Vec<String> {
        let name = dir.file_name().unwrap().to_string_lossy().replace('.', "-");
        let queues = Rabbit::queues(&name);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let url = rabbitmq_url();
            for queue in &queues {
                idem::rabbitmq::create_queue(&url, queue, self.quorum).await.unwrap();
            }
            let producer = idem::rabbitmq::RabbitProducer::connect(&url).await.unwrap();
            let messages: Vec<(String, Vec<u8>)> = records
                .iter()
                .map(|(key, payload)| {
                    let queue = &queues[key.parse::<usize>().unwrap_or(0) % queues.len()];
                    (queue.clone(), payload.clone().into_bytes())
                })
                .collect();
            producer.send_in_order(&messages).await.unwrap();
        });
        let consumer_url = self.consumer_url.clone().unwrap_or_else(rabbitmq_url);
        let mut args = vec!["--rabbitmq".into(), consumer_url, "--group".into(), name];
        for queue in queues {
            args.push("--queue".into());
            args.push(queue);
        }
        args
    }

    fn revokes(&self) -> bool {
        false
    }

    fn remove(&self, worker_args: &[String]) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        for pair in worker_args.windows(2).filter(|w| w[0] == "--queue") {
            let _ = runtime.block_on(idem::rabbitmq::delete_queue(&rabbitmq_url(), &pair[1]));
        }
    }
}

/// Amazon SQS, at `IDEM_SQS_ENDPOINT` (default the project's local server, http://127.0.0.1:9324; `aws` for the
/// standard AWS configuration's). A FIFO queue (each key a message group, the groups spread over partitions) or a
/// standard one (no order promised). Visibility timeout 10 s: what a killed consumer held reappears 10 s later,
/// and the consumer extends what it holds well before that even when the local server answers slowly (it shares
/// two cores with every test here).
/// The consumer reaches the server at `consumer_endpoint` (a proxy of the test's own) when one is given.
struct Sqs {
    fifo: bool,
    endpoint: String,
    consumer_endpoint: Option<String>,
}

const SQS_VISIBILITY: Duration = Duration::from_secs(10);

fn sqs_endpoint() -> String {
    std::env::var("IDEM_SQS_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:9324".to_owned())
}

fn sqs_client(endpoint: &str) -> idem::sqs::aws_sdk_sqs::Client {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(idem::sqs::client((endpoint != "aws").then_some(endpoint), None)).unwrap()
}

impl Broker for Sqs {
    fn name(&self) -> &'static str {
        if self.fifo { "sqs fifo" } else { "sqs standard" }
    }

    fn produce(&self, dir: &Path, records: &[(String, String)]) -> Vec<String> {
        let stem = dir.file_name().unwrap().to_string_lossy().replace('.', "-");
        let name = if self.fifo { format!("{stem}.fifo") } else { stem };
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let client =
                idem::sqs::client((self.endpoint != "aws").then_some(self.endpoint.as_str()), None).await.unwrap();
            idem::sqs::create_queue(&client, &name, SQS_VISIBILITY, Duration::from_secs(4 * 86_400)).await.unwrap();
            let producer = idem::sqs::SqsProducer::with_client(client);
            let messages: Vec<idem::sqs::Outgoing> = records
                .iter()
                .map(|(key, payload)| idem::sqs::Outgoing {
                    key: Some(key.clone().into_bytes()),
                    payload: payload.clone().into_bytes(),
                    headers: Vec::new(),
                })
                .collect();
            producer.send_in_order(&name, &messages).await.unwrap();
        });
        let endpoint = self.consumer_endpoint.clone().unwrap_or_else(|| self.endpoint.clone());
        vec![
            "--sqs".into(),
            endpoint,
            "--topic".into(),
            name.clone(),
            "--group".into(),
            name,
            "--max-batch-secs".into(),
            SQS_VISIBILITY.as_secs().to_string(),
            "--sqs-partitions".into(),
            PARTITIONS.to_string(),
        ]
    }

    fn revokes(&self) -> bool {
        false
    }

    /// Fewer: the local stand-in's sends slow down with every message its queue holds (each one counts the
    /// queue), so a run of 600 would spend most of its time producing.
    fn events(&self) -> usize {
        300
    }

    fn orders(&self) -> bool {
        self.fifo
    }

    /// SQS keeps a FIFO group's order across a redelivery. The local stand-in (moto 5.2.1) does not: after the
    /// visibility timeout it hands out the group's last in-flight message first and holds the others back until
    /// that one is deleted, so the suite holds SQS to exactly-once only after a crash or a stop.
    fn orders_redeliveries(&self) -> bool {
        false
    }

    fn remove(&self, worker_args: &[String]) {
        if let Some(name) = worker_args.iter().skip_while(|a| *a != "--topic").nth(1) {
            let client = sqs_client(&self.endpoint);
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let _ = runtime.block_on(idem::sqs::delete_queue(&client, name));
        }
    }
}

/// Every source, or those whose name contains `IDEM_CONFORMANCE_ONLY` when it is set.
fn sources() -> Vec<Arc<dyn Broker>> {
    let all: Vec<Arc<dyn Broker>> = vec![
        Arc::new(Embedded),
        Arc::new(Kafka),
        Arc::new(Nats { strict: false, url: nats_url() }),
        Arc::new(Nats { strict: true, url: nats_url() }),
        Arc::new(Rabbit { quorum: false, consumer_url: None }),
        Arc::new(Rabbit { quorum: true, consumer_url: None }),
        Arc::new(Sqs { fifo: true, endpoint: sqs_endpoint(), consumer_endpoint: None }),
        Arc::new(Sqs { fifo: false, endpoint: sqs_endpoint(), consumer_endpoint: None }),
    ];
    let only = std::env::var("IDEM_CONFORMANCE_ONLY").unwrap_or_default();
    all.into_iter().filter(|b| b.name().contains(only.as_str())).collect()
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
    /// The source, which removes what it created for the run.
    broker: Arc<dyn Broker>,
}

impl Drop for Run {
    fn drop(&mut self) {
        self.broker.remove(&self.worker_args);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Produces the source's number of payments (every 25th sent again later, one poison message) and prepares the
/// ledger.
fn run(broker: &Arc<dyn Broker>, test: &str) -> Run {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("idem-conf-{test}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut records = Vec::new();
    let mut retries = 0;
    let events = broker.events();
    for n in 0..events {
        let account = 1 + n % KEYS;
        let payload = format!(r#"{{"idempotencyKey":"c-{n:06}","account":{account},"amount":{}}}"#, 1 + n % 7);
        records.push((account.to_string(), payload.clone()));
        if n % 25 == 0 {
            records.push((account.to_string(), payload)); // a producer retry
            retries += 1;
        }
        if n == events / 2 {
            records.push(("3".into(), r#"{"idempotencyKey":"poison","account":3,"amount":"x"}"#.into()));
        }
    }
    let worker_args = broker.produce(&dir, &records);
    let url = format!("sqlite://{}", dir.join("ledger.db").display());
    let out = idem(&["demo-prepare", "--database-url", &url]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Run { dir, url, worker_args, expected: events, retries, broker: Arc::clone(broker) }
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
    dead_lettered: u64,
    /// The partitions it reported after each rebalance (Kafka only).
    assignments: Vec<Vec<i64>>,
    /// Where the process's standard error goes, shown when it ends badly.
    stderr: PathBuf,
}

/// How a consumer process ended.
struct Ended {
    status: std::process::ExitStatus,
    processed: u64,
    duplicate: u64,
    dead_lettered: u64,
    stderr: String,
}

impl Ended {
    /// Asserts a clean exit, showing the process's standard error otherwise.
    fn assert_success(&self, what: &str) {
        assert!(self.status.success(), "{what}: {}\n{}", self.status, self.stderr);
    }
}

/// Numbers the consumer processes of this test binary, for their stderr files.
static WORKERS: AtomicUsize = AtomicUsize::new(0);

impl Worker {
    fn start(run: &Run, fault: Option<&str>, follow: bool, batch: usize) -> Worker {
        Self::start_with(run, fault, follow, batch, &[])
    }

    /// Like [`Worker::start`], with more `demo-worker` arguments.
    fn start_with(run: &Run, fault: Option<&str>, follow: bool, batch: usize, extra: &[&str]) -> Worker {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
        command.args(["--log", "warn", "demo-worker"]).args(&run.worker_args).args(extra);
        command.args(["--database-url", &run.url, "--batch-size", &batch.to_string()]);
        if follow {
            command.arg("--follow");
        }
        if let Some(fault) = fault {
            command.args(["--fault", fault]);
        }
        let stderr_path = run.dir.join(format!("worker-{}.err", WORKERS.fetch_add(1, Ordering::Relaxed)));
        let stderr = std::fs::File::create(&stderr_path).expect("a worker's stderr file");
        let mut child =
            command.stdout(Stdio::piped()).stderr(stderr).stdin(Stdio::null()).spawn().expect("start a consumer");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(value) = serde_json::from_str::<Value>(&line) {
                    let _ = tx.send(value);
                }
            }
        });
        Worker {
            child,
            lines,
            processed: 0,
            duplicate: 0,
            dead_lettered: 0,
            assignments: Vec::new(),
            stderr: stderr_path,
        }
    }

    fn absorb(&mut self) {
        while let Ok(value) = self.lines.try_recv() {
            self.processed += value["processed"].as_u64().unwrap_or(0);
            self.duplicate += value["duplicate"].as_u64().unwrap_or(0);
            self.dead_lettered += value["dead_lettered"].as_u64().unwrap_or(0);
            if let Some(assigned) = value["assigned"].as_array() {
                self.assignments.push(assigned.iter().filter_map(Value::as_i64).collect());
            }
        }
    }

    /// Waits for the process to exit (at most 120 s) and reads what it reported.
    fn wait(mut self) -> Ended {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(50));
                self.absorb();
                let stderr = std::fs::read_to_string(&self.stderr).unwrap_or_default();
                return Ended {
                    status,
                    processed: self.processed,
                    duplicate: self.duplicate,
                    dead_lettered: self.dead_lettered,
                    stderr,
                };
            }
            assert!(Instant::now() < deadline, "a consumer did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn until_processed(&mut self, n: u64) {
        // Generous: the local SQS server slows down while the other tests run beside it.
        let deadline = Instant::now() + Duration::from_secs(300);
        while self.processed < n {
            if Instant::now() >= deadline {
                panic!("the consumer processed only {} of {n}; its log:\n{}", self.processed, self.log());
            }
            if self.child.try_wait().unwrap().is_some() {
                panic!("the consumer exited early; its log:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
            self.absorb();
        }
    }

    /// The last 80 lines of the process's standard error.
    fn log(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(80)..].join("\n")
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
    let ended = Worker::start(run, None, false, 20).wait();
    ended.assert_success("the finishing consumer");
    (ended.processed, ended.duplicate)
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
/// order they were produced (after a redelivery, only on sources that keep order across one).
fn assert_exactly_once_in_order(run: &Run, source: &str, redelivered: bool) {
    let expected = run.expected as i64;
    assert_eq!(scalar(run, "SELECT COUNT(*) FROM idem_demo_ledger"), expected, "{source}: ledger entries");
    assert_eq!(scalar(run, "SELECT COUNT(DISTINCT event_id) FROM idem_demo_ledger"), expected, "{source}: doubled");
    assert_eq!(scalar(run, "SELECT COUNT(*) FROM idem_demo_dead_letters"), 1, "{source}: the poison message");
    if !run.broker.orders() || (redelivered && !run.broker.orders_redeliveries()) {
        return;
    }
    let out_of_order = "SELECT COUNT(*) FROM idem_demo_ledger a JOIN idem_demo_ledger b \
                        ON a.account = b.account AND a.rowid < b.rowid AND a.event_id > b.event_id";
    assert_eq!(scalar(run, out_of_order), 0, "{source}: events of one key applied out of order");
}

#[test]
fn order_exactly_once_and_a_poison_message_that_does_not_block() {
    for broker in sources() {
        let run = run(&broker, "order");
        let (processed, _) = finish(&run);
        assert_eq!(processed as usize, run.expected, "{}", broker.name());
        assert_exactly_once_in_order(&run, broker.name(), false);
    }
}

/// SIGKILL before and after a commit, then a restart: what was not acknowledged comes again; what committed is
/// a duplicate; what did not commit is applied.
#[test]
fn unacknowledged_messages_come_again_after_sigkill() {
    for broker in sources() {
        for fault in ["before-commit:3", "after-commit:3"] {
            let run = run(&broker, "kill");
            let ended = Worker::start(&run, Some(fault), false, 10).wait();
            assert_eq!(ended.status.signal(), Some(libc::SIGKILL), "{}: {fault}\n{}", broker.name(), ended.stderr);
            let (_, duplicate) = finish(&run);
            if fault.starts_with("after") {
                assert!(duplicate >= 1, "{}: the committed, unacknowledged batch comes again", broker.name());
            }
            assert_exactly_once_in_order(&run, broker.name(), true);
        }
    }
}

/// SIGTERM in the middle of the log: the consumer finishes the batch in hand, acknowledges what committed and
/// exits 0; the next consumer sees none of it again and misses nothing.
#[test]
fn sigterm_acknowledges_what_committed_and_nothing_more() {
    for broker in sources() {
        let run = run(&broker, "term");
        let mut worker = Worker::start(&run, None, true, 5);
        worker.until_processed(100);
        worker.signal(libc::SIGTERM);
        let first = worker.wait();
        first.assert_success(&format!("{}: a drained shutdown exits 0", broker.name()));
        let (second, second_duplicates) = finish(&run);
        // Only the producer's retries come twice: nothing committed was left unacknowledged.
        assert_eq!(first.duplicate + second_duplicates, run.retries, "{}: duplicates", broker.name());
        assert_eq!((first.processed + second) as usize, run.expected, "{}", broker.name());
        assert_exactly_once_in_order(&run, broker.name(), true);
    }
}

/// A second consumer joins mid-run: the source revokes partitions from the first, which drains its batch in hand
/// before they move; every event is still applied once. The handlers wait 10 ms per event, so the first consumer
/// is still busy when the second joins.
#[test]
fn a_revocation_drains_the_batch_in_hand() {
    let slow = ["--handler-delay-ms", "10"];
    for broker in sources().into_iter().filter(|b| b.revokes()) {
        let name = broker.name();
        let run = run(&broker, "revoke");
        let mut first = Worker::start_with(&run, None, true, 5, &slow);
        first.until_processed(50);
        let mut second = Worker::start_with(&run, None, true, 5, &slow);
        let deadline = Instant::now() + Duration::from_secs(120);
        // The group rebalances: the second consumer gets partitions, the first gives some up.
        loop {
            first.absorb();
            second.absorb();
            let joined = second.assignments.last().is_some_and(|p| !p.is_empty());
            let revoked = first.assignments.last().is_some_and(|p| p.len() < PARTITIONS as usize);
            if joined && revoked {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{name}: no rebalance: {:?} / {:?}",
                first.assignments,
                second.assignments
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        while ((first.processed + second.processed) as usize) < run.expected {
            assert!(Instant::now() < deadline, "{name}: the two consumers did not finish");
            std::thread::sleep(Duration::from_millis(50));
            first.absorb();
            second.absorb();
        }
        first.signal(libc::SIGTERM);
        second.signal(libc::SIGTERM);
        first.wait().assert_success(&format!("{name}: the first consumer"));
        second.wait().assert_success(&format!("{name}: the second consumer"));
        assert_exactly_once_in_order(&run, name, true);
    }
}

/// `idem dead-letters replay` publishes a dead letter back to the source it came from (the first two consumer
/// arguments name it: `--log-dir D`, `--kafka B`, `--nats U`): the next consumer gets it again. The poison message
/// fails again, so it is dead-lettered a second time, and nothing else is applied twice.
#[test]
fn a_replayed_dead_letter_comes_back_through_its_source() {
    for broker in sources() {
        let run = run(&broker, "replay");
        finish(&run);
        let out = idem(&[
            "dead-letters",
            "replay",
            &run.worker_args[0],
            &run.worker_args[1],
            "--all",
            "--database-url",
            &run.url,
            "--table-prefix",
            "idem_demo_",
        ]);
        assert!(out.status.success(), "{}: {}", broker.name(), String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("1 dead letter(s) replayed"), "{}", broker.name());
        let again = Worker::start(&run, None, false, 20).wait();
        again.assert_success(&format!("{}: the consumer after the replay", broker.name()));
        assert_eq!(again.dead_lettered, 1, "{}: the replayed poison message came back", broker.name());
        assert_eq!(again.processed, 0, "{}: nothing else is applied again", broker.name());
        assert_eq!(scalar(&run, "SELECT COUNT(*) FROM idem_demo_ledger"), run.expected as i64, "{}", broker.name());
    }
}

/// NATS: the server dies (SIGKILL) mid-run and comes back on the same port and store: the consumer reconnects,
/// resumes from its durable consumer, and every event is applied exactly once.
#[test]
fn nats_a_server_restart_mid_run_loses_nothing() {
    let mut server = OwnNatsServer::start();
    let broker: Arc<dyn Broker> = Arc::new(Nats { strict: false, url: server.url() });
    let run = run(&broker, "restart");
    let mut worker = Worker::start_with(&run, None, true, 5, &["--handler-delay-ms", "5"]);
    worker.until_processed(100);
    assert!((worker.processed as usize) < run.expected, "the server must die mid-run");
    server.kill();
    std::thread::sleep(Duration::from_secs(1));
    server.restart();
    worker.until_processed(run.expected as u64);
    worker.signal(libc::SIGTERM);
    worker.wait().assert_success("the consumer after the restart");
    assert_exactly_once_in_order(&run, broker.name(), true);
}

/// A TCP proxy of the test's own in front of a shared server, so a test can cut its connections (and refuse new
/// ones) without touching the server.
struct CuttableProxy {
    port: u16,
    open: Arc<std::sync::atomic::AtomicBool>,
    streams: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl CuttableProxy {
    fn start(target: &'static str) -> CuttableProxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let open = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let streams: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>> = Arc::default();
        let (accepting, kept) = (Arc::clone(&open), Arc::clone(&streams));
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                if !accepting.load(Ordering::SeqCst) {
                    continue; // dropped: refused while cut
                }
                let Ok(server) = std::net::TcpStream::connect(target) else { continue };
                let mut kept = kept.lock().unwrap();
                for (from, to) in [(&client, &server), (&server, &client)] {
                    let (mut from, mut to) = (from.try_clone().unwrap(), to.try_clone().unwrap());
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
                kept.push(client);
                kept.push(server);
            }
        });
        CuttableProxy { port, open, streams }
    }

    /// Closes every proxied connection and refuses new ones.
    fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        for stream in self.streams.lock().unwrap().drain(..) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }

    fn heal(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

/// RabbitMQ: the consumer's connection is cut mid-run (through a proxy of the test's own, the shared server
/// untouched) and refused for two seconds: the consumer drains, reconnects, and every event is applied exactly
/// once, in order per key (the broker puts back what the dead channel held).
#[test]
fn rabbitmq_a_cut_connection_mid_run_loses_nothing() {
    let proxy = CuttableProxy::start("127.0.0.1:5672");
    let broker: Arc<dyn Broker> = Arc::new(Rabbit {
        quorum: false,
        consumer_url: Some(format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port)),
    });
    let run = run(&broker, "cut");
    let mut worker = Worker::start_with(&run, None, true, 5, &["--handler-delay-ms", "5"]);
    worker.until_processed(100);
    assert!((worker.processed as usize) < run.expected, "the connection must be cut mid-run");
    proxy.cut();
    std::thread::sleep(Duration::from_secs(2));
    proxy.heal();
    worker.until_processed(run.expected as u64);
    worker.signal(libc::SIGTERM);
    worker.wait().assert_success("the consumer after the cut");
    assert_exactly_once_in_order(&run, broker.name(), true);
}

/// SQS: the server is cut off mid-run for three seconds (every connection closed, new ones refused, through a
/// proxy of the test's own; the local server keeps its queues in memory, so stopping it would empty them): the
/// consumer's receives, deletes and visibility extensions fail, it retries with backoff, and every event is still
/// applied exactly once.
#[test]
fn sqs_the_server_cut_off_mid_run_loses_nothing() {
    let endpoint = sqs_endpoint();
    let Some(target) = endpoint.strip_prefix("http://").map(|t| t.trim_end_matches('/').to_owned()) else {
        eprintln!("IDEM_SQS_ENDPOINT={endpoint} is not a plain http:// server: the cut-off test needs a local one");
        return;
    };
    let proxy = CuttableProxy::start(Box::leak(target.into_boxed_str()));
    let broker: Arc<dyn Broker> =
        Arc::new(Sqs { fifo: true, endpoint, consumer_endpoint: Some(format!("http://127.0.0.1:{}", proxy.port)) });
    let run = run(&broker, "cutoff");
    let mut worker = Worker::start_with(&run, None, true, 5, &["--handler-delay-ms", "5"]);
    worker.until_processed(100);
    assert!((worker.processed as usize) < run.expected, "the server must be cut off mid-run");
    proxy.cut();
    std::thread::sleep(Duration::from_secs(3));
    proxy.heal();
    worker.until_processed(run.expected as u64);
    worker.signal(libc::SIGTERM);
    worker.wait().assert_success("the consumer after the cut-off");
    assert_exactly_once_in_order(&run, broker.name(), true);
}
