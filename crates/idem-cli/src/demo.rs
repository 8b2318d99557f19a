//! `idem demo`: a payments ledger consumed with exactly-once effects while the consumer is killed.
//!
//! The parent process produces payment events into the embedded log (with producer retries, i.e. duplicates,
//! and a few poison messages), then runs consumer child processes (`idem demo-worker`) one after the other.
//! Each planned crash arms the fault injection of one child (`IDEM_FAULT`), which kills itself with SIGKILL
//! between the database commit and the acknowledgement (or before the commit); the next child resumes from
//! the last acknowledged offsets. At the end the ledger is checked to the cent against what was produced.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::{Backend, Committed, Config, Engine, Event, Handler, HandlerError, KeyExtractor, Tables};
use serde::Serialize;
use sqlx::{PgConnection, SqliteConnection};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::db::Db;
use crate::with_pool;

const TOPIC: &str = "payments";
const GROUP: &str = "demo-ledger";
const PREFIX: &str = "idem_demo_";
const ACCOUNTS: i64 = 1000;

/// Arguments of `idem demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Payment events to produce.
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Percentage of events the producer sends twice (producer retries), 0 to 50.
    #[arg(long, default_value_t = 2.0)]
    duplicates: f64,
    /// Times the consumer is killed with SIGKILL (every third one before the commit, the others between the
    /// commit and the acknowledgement).
    #[arg(long, default_value_t = 4)]
    crashes: u32,
    /// Where the crashes happen: `mixed` (every third before the commit, the others after it),
    /// `after-commit` (between the commit and the acknowledgement) or `before-commit`.
    #[arg(long, default_value = "mixed", value_parser = ["mixed", "after-commit", "before-commit"])]
    crash_point: String,
    /// Messages per transaction (1: one transaction per message).
    #[arg(long, default_value_t = 100)]
    batch_size: usize,
    /// Partitions of the payments topic; one worker and one connection each.
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Run against this database instead of a fresh SQLite file (postgres://… or sqlite://…). The demo's tables
    /// are named idem_demo_* and are recreated.
    #[arg(long, env = "IDEM_DATABASE_URL")]
    database_url: Option<String>,
    /// Use the Kafka brokers at this address (host:port) instead of the embedded log: a fresh topic and group
    /// per run.
    #[arg(long)]
    kafka: Option<String>,
    /// Keep the log (and SQLite file) in this directory instead of a temporary one removed at the end.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Seed of the event generator, for a reproducible run.
    #[arg(long)]
    seed: Option<u64>,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
}

/// Arguments of one consumer process of the demo.
#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// The embedded log's directory.
    #[arg(long, required_unless_present = "kafka")]
    log_dir: Option<PathBuf>,
    /// Kafka brokers (instead of the embedded log).
    #[arg(long)]
    kafka: Option<String>,
    /// Extra librdkafka setting, KEY=VALUE; repeatable.
    #[arg(long = "kafka-setting")]
    kafka_settings: Vec<String>,
    /// The topic.
    #[arg(long, default_value = TOPIC)]
    topic: String,
    /// The consumer group.
    #[arg(long, default_value = GROUP)]
    group: String,
    /// Keep consuming at the end of the log instead of exiting (until SIGINT or SIGTERM).
    #[arg(long)]
    follow: bool,
    /// Serve /metrics, /healthz and /readyz on this address (e.g. 127.0.0.1:9464).
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// The database.
    #[arg(long, env = "IDEM_DATABASE_URL")]
    database_url: String,
    /// Messages per transaction.
    #[arg(long, default_value_t = 100)]
    batch_size: usize,
    /// Connections in the pool.
    #[arg(long, default_value_t = 5)]
    connections: u32,
}

/// Arguments of `idem demo-produce`: the demo's events written into an embedded log, for harnesses that run
/// `demo-worker` themselves.
#[derive(clap::Args, Debug)]
pub struct ProduceArgs {
    /// The embedded log's directory; it must not exist yet or be empty.
    #[arg(long, required_unless_present = "kafka", conflicts_with = "kafka")]
    log_dir: Option<PathBuf>,
    /// Produce to these Kafka brokers (host:port) instead, into a new topic --topic.
    #[arg(long)]
    kafka: Option<String>,
    /// The topic.
    #[arg(long, default_value = TOPIC)]
    topic: String,
    /// Payment events to produce.
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Partitions of the payments topic.
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Seed of the event generator.
    #[arg(long)]
    seed: u64,
    /// Percentage of events the producer sends twice (producer retries), 0 to 50.
    #[arg(long, default_value_t = 2.0)]
    duplicates: f64,
}

/// Where the demo's events travel.
enum Transport {
    Embedded(PathBuf),
    Kafka { brokers: String, topic: String, group: String },
}

impl Transport {
    fn worker_args(&self) -> Vec<String> {
        match self {
            Transport::Embedded(dir) => vec!["--log-dir".into(), dir.display().to_string()],
            Transport::Kafka { brokers, topic, group } => vec![
                "--kafka".into(),
                brokers.clone(),
                "--topic".into(),
                topic.clone(),
                "--group".into(),
                group.clone(),
                "--kafka-setting".into(),
                "session.timeout.ms=6000".into(),
            ],
        }
    }
}

/// What the demo reports.
#[derive(Debug, Default, Serialize)]
struct Summary {
    ok: bool,
    database: &'static str,
    events_produced: u64,
    producer_duplicates: u64,
    log_records: u64,
    deliveries: u64,
    processed: u64,
    duplicates_absorbed: u64,
    dead_lettered: u64,
    crashes_survived: u32,
    crashes_after_commit: u32,
    crashes_before_commit: u32,
    consumer_runs: u32,
    expected_total_cents: i64,
    actual_total_cents: i64,
    expected_ledger_entries: i64,
    ledger_entries: i64,
    distinct_ledger_events: i64,
    markers: i64,
    dead_letter_rows: i64,
    consume_seconds: f64,
    throughput_per_second: f64,
    mismatches: Vec<String>,
}

/// What the producer wrote, and so what the ledger must hold.
#[derive(Debug, Default)]
struct Plan {
    events: u64,
    producer_duplicates: u64,
    records: u64,
    poison: u64,
    poison_with_key: u64,
    expected_total: i64,
    expected_entries: i64,
}

/// SplitMix64: a small, seedable generator, enough for a demo.
pub struct Rng(pub u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

/// `idem demo`.
pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    validate(&args)?;
    let (dir, temporary) = match &args.dir {
        Some(dir) => (dir.clone(), false),
        None => (std::env::temp_dir().join(format!("idem-demo-{}", std::process::id())), true),
    };
    let log_dir = dir.join("log");
    if !args.json && !dir.exists() {
        eprintln!("creating {}", dir.display());
    }
    reset_dir(&dir, &log_dir)?;
    let url = match &args.database_url {
        Some(url) => url.clone(),
        None => format!("sqlite://{}", dir.join("ledger.db").display()),
    };
    let db = Db::create(&url, 2).await?;
    let tables = Tables::new(None, PREFIX)?;
    prepare(&db, &tables).await?;

    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64)
    });
    if !args.json {
        eprintln!("generating {} payment events (seed {seed}) and producing them…", args.events);
    }
    let (plan, records) = generate(args.events, args.duplicates, seed);
    let transport = match &args.kafka {
        None => {
            write_embedded(&log_dir, args.partitions, &records).context("producing the events")?;
            Transport::Embedded(log_dir.clone())
        }
        Some(brokers) => {
            let run = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
            let (topic, group) = (format!("idem-demo-{run}"), format!("{GROUP}-{run}"));
            write_kafka(brokers, &topic, args.partitions, &records).await.context("producing the events to Kafka")?;
            Transport::Kafka { brokers: brokers.clone(), topic, group }
        }
    };
    if !args.json {
        eprintln!(
            "produced {} events ({} sent twice by the producer, {} poison) into {} partitions; consuming with {} crash(es)…",
            plan.events, plan.producer_duplicates, plan.poison, args.partitions, args.crashes
        );
    }

    let mut summary = Summary {
        database: if matches!(db, Db::Postgres(_)) { "postgres" } else { "sqlite" },
        events_produced: plan.events,
        producer_duplicates: plan.producer_duplicates,
        log_records: plan.records,
        expected_total_cents: plan.expected_total,
        expected_ledger_entries: plan.expected_entries,
        ..Summary::default()
    };
    let started = Instant::now();
    consume(&args, &transport, &url, &plan, seed, &mut summary).await?;
    summary.consume_seconds = started.elapsed().as_secs_f64();
    verify(&db, &plan, &mut summary).await?;
    summary.throughput_per_second = summary.deliveries as f64 / summary.consume_seconds.max(1e-9);
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    print_summary(&summary, args.json)?;
    Ok(if summary.ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn validate(args: &DemoArgs) -> anyhow::Result<()> {
    validate_events(args.events, args.duplicates, args.partitions)?;
    if args.batch_size == 0 || args.batch_size > 10_000 {
        bail!("--batch-size {} is out of range: use 1 to 10000", args.batch_size);
    }
    Ok(())
}

fn reset_dir(dir: &Path, log_dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    if log_dir.exists() {
        std::fs::remove_dir_all(log_dir).with_context(|| format!("cannot clear {}", log_dir.display()))?;
    }
    for file in ["ledger.db", "ledger.db-wal", "ledger.db-shm"] {
        let path = dir.join(file);
        if path.exists() {
            std::fs::remove_file(&path).with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    Ok(())
}

/// Recreates the demo's tables: idem's (under the idem_demo_ prefix), the accounts and the ledger. The ledger has
/// no unique constraint on purpose: a double application must show, not be hidden by the ledger itself.
async fn prepare(db: &Db, tables: &Tables) -> anyhow::Result<()> {
    for table in ["processed_events", "dead_letters", "idem_migrations", "accounts", "ledger"] {
        db.execute(&format!("DROP TABLE IF EXISTS {}", tables.table(table))).await?;
    }
    with_pool!(db, pool => idem::migrate(pool, tables).await?);
    let create = format!(
        "CREATE TABLE {accounts} (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL);
         CREATE TABLE {ledger} (event_id TEXT NOT NULL, account BIGINT NOT NULL, amount BIGINT NOT NULL);
         WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < {ACCOUNTS})
         INSERT INTO {accounts} (id, balance) SELECT x, 0 FROM n;",
        accounts = tables.table("accounts"),
        ledger = tables.table("ledger"),
    );
    db.execute(&create).await
}

/// The events: each payment once, some a second time a little later (a producer retry), and three poison
/// messages: one that does not decode, one for an unknown account, one without an idempotency key. Each record
/// is (account, payload); the account is the message key.
fn generate(events: u64, duplicates: f64, seed: u64) -> (Plan, Vec<(i64, String)>) {
    let mut rng = Rng(seed);
    let mut plan = Plan::default();
    let mut records = Vec::with_capacity(events as usize + events as usize / 20);
    let mut retries: Vec<(u64, i64, String)> = Vec::new();
    let duplicate_per_million = (duplicates * 10_000.0) as u64;
    let poison_at = [events / 4, events / 2, events * 3 / 4];
    for n in 0..events {
        let account = 1 + rng.below(ACCOUNTS as u64) as i64;
        let amount = 1 + rng.below(100_000) as i64;
        let payload = format!(r#"{{"idempotencyKey":"pay-{n:09}","account":{account},"amount":{amount}}}"#);
        records.push((account, payload.clone()));
        plan.events += 1;
        plan.expected_total += amount;
        plan.expected_entries += 1;
        if rng.below(1_000_000) < duplicate_per_million {
            retries.push((n + rng.below(50), account, payload));
            plan.producer_duplicates += 1;
        }
        records.extend(drain_due(&mut retries, n).into_iter().map(|(_, account, payload)| (account, payload)));
        if let Some(which) = poison_at.iter().position(|&at| at == n) {
            let poison = match which {
                0 => format!(r#"{{"idempotencyKey":"poison-{n}","account":1,"amount":"12.00 EUR"}}"#),
                1 => format!(r#"{{"idempotencyKey":"poison-{n}","account":{},"amount":100}}"#, ACCOUNTS + 7),
                _ => r#"{"account":1,"amount":100}"#.to_owned(),
            };
            records.push((1, poison));
            plan.events += 1;
            plan.poison += 1;
            plan.poison_with_key += u64::from(which < 2);
        }
    }
    records.extend(retries.into_iter().map(|(_, account, payload)| (account, payload)));
    plan.records = records.len() as u64;
    (plan, records)
}

fn write_embedded(log_dir: &Path, partitions: i32, records: &[(i64, String)]) -> anyhow::Result<()> {
    let log = EmbeddedLog::open(log_dir)?;
    log.create_topic(TOPIC, partitions)?;
    let producer = log.producer();
    let progress = indicatif::ProgressBar::new(records.len() as u64);
    progress.set_style(
        indicatif::ProgressStyle::with_template("{spinner} producing {bar:40} {pos}/{len} records {rate}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .with_key("rate", crate::commands::rate),
    );
    for (n, (account, payload)) in records.iter().enumerate() {
        producer.send(TOPIC, Some(account.to_string().as_bytes()), payload.as_bytes(), &[])?;
        if n % 4096 == 0 {
            progress.set_position(n as u64);
        }
    }
    producer.flush()?;
    progress.finish_and_clear();
    Ok(())
}

/// Produces to a fresh topic (explicit 7-day retention) through the idempotent producer helper, many sends in
/// flight at once.
pub async fn write_kafka(brokers: &str, topic: &str, partitions: i32, records: &[(i64, String)]) -> anyhow::Result<()> {
    idem::kafka::create_topic(brokers, topic, partitions, 7 * 24 * 3_600_000).await?;
    let producer = std::sync::Arc::new(idem::kafka::KafkaProducer::new(brokers)?);
    for chunk in records.chunks(2000) {
        let mut sends = tokio::task::JoinSet::new();
        for (account, payload) in chunk {
            let (producer, topic, account, payload) =
                (std::sync::Arc::clone(&producer), topic.to_owned(), *account, payload.clone());
            sends.spawn(async move {
                producer.send(&topic, Some(account.to_string().as_bytes()), payload.as_bytes(), &[]).await
            });
        }
        while let Some(sent) = sends.join_next().await {
            sent??;
        }
    }
    Ok(())
}

fn drain_due(retries: &mut Vec<(u64, i64, String)>, n: u64) -> Vec<(u64, i64, String)> {
    let (due, later): (Vec<_>, Vec<_>) = std::mem::take(retries).into_iter().partition(|(at, _, _)| *at <= n);
    *retries = later;
    due
}

/// Runs consumer processes until one finishes the log; the planned ones are killed at their fault point.
async fn consume(
    args: &DemoArgs,
    transport: &Transport,
    url: &str,
    plan: &Plan,
    seed: u64,
    summary: &mut Summary,
) -> anyhow::Result<()> {
    let progress = indicatif::ProgressBar::new(plan.records);
    if args.json {
        progress.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    progress.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} deliveries {rate} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .with_key("rate", crate::commands::rate),
    );
    let exe = std::env::current_exe().context("cannot find the idem executable to run consumers")?;
    let mut rng = Rng(seed ^ 0x5eed);
    let mut crashes_left = args.crashes;
    loop {
        let fault = (crashes_left > 0).then(|| {
            let crash = args.crashes - crashes_left;
            let point = match args.crash_point.as_str() {
                "mixed" if crash % 3 == 2 => "before-commit",
                "mixed" => "after-commit",
                fixed => fixed,
            };
            let left = plan.records.saturating_sub(summary.deliveries);
            let batches_left = left / (args.batch_size as u64).max(1);
            let at = 1 + rng.below((batches_left / u64::from(crashes_left + 1)).max(1));
            format!("{point}:{at}")
        });
        let mut command = tokio::process::Command::new(&exe);
        command
            .arg("--log")
            .arg("error")
            .arg("demo-worker")
            .args(transport.worker_args())
            .arg("--database-url")
            .arg(url)
            .arg("--batch-size")
            .arg(args.batch_size.to_string())
            .arg("--connections")
            .arg((args.partitions + 1).to_string())
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        match &fault {
            Some(fault) => command.env(idem::fault::FAULT_ENV, fault),
            None => command.env_remove(idem::fault::FAULT_ENV),
        };
        let mut child = command.spawn().context("cannot start a consumer process")?;
        summary.consumer_runs += 1;
        progress.set_message(format!(
            "consumer run {} ({})",
            summary.consumer_runs,
            fault.as_deref().unwrap_or("no fault")
        ));
        let stdout = child.stdout.take().context("consumer has no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        while let Some(line) = lines.next_line().await? {
            if let Ok(report) = serde_json::from_str::<CommitReport>(&line) {
                summary.processed += report.processed;
                summary.duplicates_absorbed += report.duplicate;
                summary.dead_lettered += report.dead_lettered;
                summary.deliveries += report.processed + report.duplicate + report.dead_lettered;
                progress.set_position(summary.deliveries.min(plan.records));
            }
        }
        let status = child.wait().await?;
        match (status.signal(), status.code()) {
            (Some(libc::SIGKILL), _) if fault.is_some() => {
                crashes_left -= 1;
                summary.crashes_survived += 1;
                if fault.as_deref().is_some_and(|f| f.starts_with("before")) {
                    summary.crashes_before_commit += 1;
                } else {
                    summary.crashes_after_commit += 1;
                }
                progress.println(format!(
                    "consumer killed with SIGKILL at {}; restarting",
                    fault.as_deref().unwrap_or("?")
                ));
            }
            // The log ended (before the fault point, if one was armed): done.
            (_, Some(0)) => break,
            _ => bail!("a consumer process failed ({status}); see its errors above"),
        }
        if summary.consumer_runs > args.crashes + 3 {
            bail!("the consumers did not finish the log after {} runs", summary.consumer_runs);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    progress.finish_and_clear();
    Ok(())
}

/// One line of a consumer's stdout: what one transaction committed.
#[derive(Debug, Serialize, serde::Deserialize)]
struct CommitReport {
    processed: u64,
    duplicate: u64,
    dead_lettered: u64,
}

/// Compares the database with the plan; every difference is a mismatch.
async fn verify(db: &Db, plan: &Plan, summary: &mut Summary) -> anyhow::Result<()> {
    let tables = Tables::new(None, PREFIX)?;
    let (accounts, ledger) = (tables.table("accounts"), tables.table("ledger"));
    let actual_total = db.scalar(&format!("SELECT CAST(COALESCE(SUM(balance), 0) AS BIGINT) FROM {accounts}")).await?;
    let entries = db.scalar(&format!("SELECT COUNT(*) FROM {ledger}")).await?;
    let distinct = db.scalar(&format!("SELECT COUNT(DISTINCT event_id) FROM {ledger}")).await?;
    let markers = db.scalar(&format!("SELECT COUNT(*) FROM {}", tables.table("processed_events"))).await?;
    let dead = db.scalar(&format!("SELECT COUNT(*) FROM {}", tables.table("dead_letters"))).await?;

    summary.actual_total_cents = actual_total;
    summary.ledger_entries = entries;
    summary.distinct_ledger_events = distinct;
    summary.markers = markers;
    summary.dead_letter_rows = dead;
    // What committed, from the database: a consumer killed while another of its workers commits can lose that
    // commit's report line, never the commit. Duplicates stay as the consumers reported them.
    summary.processed = u64::try_from(distinct).unwrap_or(0);
    summary.dead_lettered = u64::try_from(dead).unwrap_or(0);
    summary.deliveries = summary.processed + summary.duplicates_absorbed + summary.dead_lettered;
    let mut check = |ok: bool, what: String| {
        if !ok {
            summary.mismatches.push(what);
        }
    };
    check(
        actual_total == plan.expected_total,
        format!("ledger total {actual_total} != expected {}", plan.expected_total),
    );
    check(entries == plan.expected_entries, format!("{entries} ledger entries != expected {}", plan.expected_entries));
    check(distinct == entries, format!("{} events applied more than once", entries - distinct));
    let expected_markers = plan.expected_entries + plan.poison_with_key as i64;
    check(markers == expected_markers, format!("{markers} markers != expected {expected_markers}"));
    check(dead == plan.poison as i64, format!("{dead} dead letters != expected {}", plan.poison));
    check(summary.crashes_survived > 0 || summary.consumer_runs == 1, "no crash happened".into());
    summary.ok = summary.mismatches.is_empty();
    Ok(())
}

fn print_summary(s: &Summary, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
        return Ok(());
    }
    println!("idem demo: payments ledger on {}", s.database);
    println!(
        "  events produced        {:>12}  ({} sent twice by the producer)",
        s.events_produced, s.producer_duplicates
    );
    println!("  deliveries             {:>12}  (log records: {})", s.deliveries, s.log_records);
    println!("  processed              {:>12}", s.processed);
    println!("  duplicates absorbed    {:>12}", s.duplicates_absorbed);
    println!("  dead-lettered          {:>12}  (poison messages)", s.dead_lettered);
    println!(
        "  crashes survived       {:>12}  ({} between commit and ack, {} before commit; {} consumer runs)",
        s.crashes_survived, s.crashes_after_commit, s.crashes_before_commit, s.consumer_runs
    );
    println!("  expected ledger total  {:>12}  cents in {} entries", s.expected_total_cents, s.expected_ledger_entries);
    println!("  actual ledger total    {:>12}  cents in {} entries", s.actual_total_cents, s.ledger_entries);
    println!("  throughput             {:>12.0}  deliveries/s ({:.1} s)", s.throughput_per_second, s.consume_seconds);
    if s.ok {
        println!("OK: every event applied exactly once");
    } else {
        for m in &s.mismatches {
            println!("MISMATCH: {m}");
        }
    }
    Ok(())
}

/// `idem demo-worker`: consumes the demo's events until their end (or, with `--follow`, until a signal),
/// printing one line per commit (and, on Kafka, one per assignment).
pub async fn worker(args: WorkerArgs) -> anyhow::Result<ExitCode> {
    // Arguments first, before anything is opened: a mistake is named at once.
    if args.connections == 0 {
        bail!("--connections 0: the consumer needs at least one connection per partition it consumes, plus one");
    }
    if args.batch_size == 0 {
        bail!("--batch-size 0: use at least 1");
    }
    if let Some(setting) = args.kafka_settings.iter().find(|s| !s.contains('=')) {
        bail!("--kafka-setting `{setting}` is not KEY=VALUE (for example session.timeout.ms=6000)");
    }
    if args.kafka.is_none() && !args.kafka_settings.is_empty() {
        bail!("--kafka-setting applies to Kafka only: give --kafka BROKERS, or leave the settings out");
    }
    let config = Config::new(args.group.clone(), KeyExtractor::JsonPointer("/idempotencyKey".into()))
        .batch_size(args.batch_size)
        .tables(Tables::new(None, PREFIX)?);
    let db = Db::open(&args.database_url, args.connections).await?;
    match (&args.kafka, &args.log_dir) {
        (Some(brokers), _) => {
            let mut kafka = idem::kafka::KafkaConfig::new(brokers.as_str(), &[args.topic.as_str()]);
            for setting in &args.kafka_settings {
                let Some((key, value)) = setting.split_once('=') else {
                    bail!("--kafka-setting `{setting}` is not KEY=VALUE");
                };
                kafka = kafka.set(key, value);
            }
            kafka.stop_at_end = !args.follow;
            let observer: idem::kafka::consumer::AssignmentObserver = std::sync::Arc::new(report_assignment);
            let source = idem::kafka::KafkaSource::connect_observed(&kafka, &config, Some(observer)).await?;
            with_pool!(db, pool => consume_with(pool, source, config, Credit, args.metrics_addr).await?);
        }
        (None, Some(dir)) => {
            let log = EmbeddedLog::open(dir)?;
            let options = ConsumerOptions { stop_at_end: !args.follow, ..ConsumerOptions::default() };
            let source = log.consumer(&args.group, &[args.topic.as_str()], options)?;
            with_pool!(db, pool => consume_with(pool, source, config, Credit, args.metrics_addr).await?);
        }
        (None, None) => bail!("give --log-dir or --kafka"),
    }
    Ok(ExitCode::SUCCESS)
}

/// The event counts of `demo` and `demo-produce`, checked before anything is created.
fn validate_events(events: u64, duplicates: f64, partitions: i32) -> anyhow::Result<()> {
    if events == 0 || events > 100_000_000 {
        bail!("--events {events} is out of range: use 1 to 100000000");
    }
    if !(0.0..=50.0).contains(&duplicates) {
        bail!("--duplicates {duplicates} is out of range: a percentage from 0 to 50");
    }
    if !(1..=64).contains(&partitions) {
        bail!("--partitions {partitions} is out of range: use 1 to 64");
    }
    Ok(())
}

/// `idem demo-prepare`: recreates the demo's tables (for tests that drive `demo-worker` themselves).
pub async fn prepare_only(database_url: &str) -> anyhow::Result<ExitCode> {
    let db = Db::create(database_url, 1).await?;
    prepare(&db, &Tables::new(None, PREFIX)?).await?;
    Ok(ExitCode::SUCCESS)
}

/// `idem demo-produce`: writes the demo's events into a fresh embedded log (or Kafka topic) and prints the plan (what the ledger
/// must hold once they are consumed) as one JSON line.
pub async fn produce(args: ProduceArgs) -> anyhow::Result<ExitCode> {
    validate_events(args.events, args.duplicates, args.partitions)?;
    let (plan, records) = generate(args.events, args.duplicates, args.seed);
    match (&args.kafka, &args.log_dir) {
        (Some(brokers), _) => write_kafka(brokers, &args.topic, args.partitions, &records)
            .await
            .context("producing the events to Kafka")?,
        (None, Some(dir)) => {
            if args.topic != TOPIC {
                bail!("--topic is for --kafka; the embedded log's topic is {TOPIC}");
            }
            if std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_some()) {
                bail!("--log-dir {} is not empty: give a new directory", dir.display());
            }
            write_embedded(dir, args.partitions, &records).context("producing the events")?;
        }
        (None, None) => bail!("give --log-dir or --kafka"),
    }
    report_line(serde_json::json!({
        "events": plan.events,
        "records": plan.records,
        "producer_duplicates": plan.producer_duplicates,
        "poison": plan.poison,
        "poison_with_key": plan.poison_with_key,
        "expected_total_cents": plan.expected_total,
        "expected_entries": plan.expected_entries,
    }));
    Ok(ExitCode::SUCCESS)
}

fn report_assignment(partitions: &[idem::source::Partition]) {
    let numbers: Vec<i32> = partitions.iter().map(|p| p.partition).collect();
    report_line(serde_json::json!({ "assigned": numbers }));
}

async fn consume_with<DB: Backend, S: idem::Source, H: Handler<DB>>(
    pool: sqlx::Pool<DB>,
    source: S,
    config: Config,
    handler: H,
    metrics_addr: Option<std::net::SocketAddr>,
) -> anyhow::Result<()> {
    let engine = Engine::new(pool, config)?.on_commit(report_commit);
    if let Some(addr) = metrics_addr {
        let recorder = crate::http::install_recorder()?;
        let bound = crate::http::serve(addr, recorder, engine.clone()).await?;
        report_line(serde_json::json!({ "metrics_addr": bound.to_string() }));
    }
    engine.run(source, handler, shutdown_signal()).await?;
    Ok(())
}

fn report_line(value: serde_json::Value) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{value}");
    let _ = out.flush();
}

/// Writes the commit to stdout before the acknowledgement (and before the after-commit fault point), so the
/// parent's counts include every committed transaction even when the process is killed right after.
fn report_commit(committed: &Committed) {
    use std::io::Write;
    let report = CommitReport {
        processed: committed.processed,
        duplicate: committed.duplicate,
        dead_lettered: committed.dead_lettered,
    };
    if let Ok(line) = serde_json::to_string(&report) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

/// Completes on SIGINT or SIGTERM: the engine then finishes the batch in hand, acknowledges it and returns.
async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// The demo's handler: one ledger entry and one balance update per payment.
struct Credit;

#[derive(serde::Deserialize)]
struct Payment {
    account: i64,
    amount: i64,
}

const INSERT_ENTRY: &str = "INSERT INTO idem_demo_ledger (event_id, account, amount) VALUES ($1, $2, $3)";
const CREDIT: &str = "UPDATE idem_demo_accounts SET balance = balance + $1 WHERE id = $2";

fn unknown_account(p: &Payment) -> HandlerError {
    HandlerError::permanent(format!("account {} does not exist", p.account))
}

impl Handler<sqlx::Postgres> for Credit {
    async fn handle(&self, event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let p: Payment = event.json()?;
        sqlx::query(INSERT_ENTRY).bind(&event.id).bind(p.account).bind(p.amount).execute(&mut *tx).await?;
        let credited = sqlx::query(CREDIT).bind(p.amount).bind(p.account).execute(&mut *tx).await?;
        if credited.rows_affected() != 1 {
            return Err(unknown_account(&p));
        }
        Ok(())
    }
}

impl Handler<sqlx::Sqlite> for Credit {
    async fn handle(&self, event: &Event, tx: &mut SqliteConnection) -> Result<(), HandlerError> {
        let p: Payment = event.json()?;
        sqlx::query(INSERT_ENTRY).bind(&event.id).bind(p.account).bind(p.amount).execute(&mut *tx).await?;
        let credited = sqlx::query(CREDIT).bind(p.amount).bind(p.account).execute(&mut *tx).await?;
        if credited.rows_affected() != 1 {
            return Err(unknown_account(&p));
        }
        Ok(())
    }
}
