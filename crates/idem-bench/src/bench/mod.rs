//! `idem-bench`: idem side by side with PostgreSQL's own limit and a reference handler in Python, on one
//! PostgreSQL, over the same payment events, each leg on fresh tables, each leg checking its ledger total.
//!
//! Legs: pgbench running the per-event transaction; the Python reference handler; idem with one transaction per
//! event at 1, 2 and 4 partitions; idem batched (100 and 1,000; per-message and batch handler); the batched SQL
//! limit (a raw loop: one multi-row claim and one UPDATE per batch); end to end from Kafka, NATS JetStream,
//! RabbitMQ and Google Pub/Sub (on the emulator: the emulator's figures) next to their read limits; a consumer's
//! memory over 1,000,000 events in a process of its own; the outbox (an enqueue per event, the relay next to the
//! produce limits); one key failing for a while against the same run without it (the other partitions' rate);
//! with `--mysql`, idem per-event and batched against raw SQL loops on MySQL/MariaDB.

use std::collections::{HashSet, VecDeque};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use idem::source::SourceError;
use idem::{
    Acknowledgement, BatchHandler, Config, Engine, Event, Handler, HandlerError, KeyExtractor, Message, Received,
    Source, Tables,
};
use sqlx::{Connection, PgConnection, PgPool};

use idem_cli::demo::Rng;

mod brokers;
mod compare;
mod configured;
mod console;
mod consume;
mod failing_key;
mod grown;
mod http;
mod idem_legs;
mod kafka;
mod memory;
mod mysql;
mod outbox;
mod ratios;
mod read_limit;

pub use consume::{ConsumeArgs, consume};
use idem_legs::{CreditAll, HandlerKind, idem_leg, inbox_leg, raw_batched};
use kafka::kafka_leg;
use ratios::ratios;

const PREFIX: &str = "bench_";
const GROUP: &str = "bench";
const TOPIC: &str = "payments";

/// Consumer settings of the Kafka legs (before any `--kafka-setting`): a quick group join.
const KAFKA_DEFAULTS: [&str; 2] = ["session.timeout.ms=6000", "heartbeat.interval.ms=1000"];

/// Arguments of `idem-bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// The PostgreSQL database (tables prefixed `bench_` are recreated for every leg).
    #[arg(long, env = "IDEM_DATABASE_URL", default_value = "postgres://postgres@127.0.0.1:5432/test")]
    database_url: String,
    /// Events per leg (duplicates included).
    #[arg(long, default_value_t = 200_000)]
    events: usize,
    /// Share of deliveries that are duplicates of an earlier event.
    #[arg(long, default_value_t = 0.01)]
    duplicates: f64,
    /// Accounts the payments credit.
    #[arg(long, default_value_t = 10_000)]
    accounts: i64,
    /// Runs per leg; the median is reported, with min–max.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// A small version for CI: 2,000 events, one run, 2,000 from Kafka. Checks totals, never speeds.
    #[arg(long)]
    quick: bool,
    /// Python interpreter with psycopg 3 for the reference handler (`bench/run.sh` installs one); without it
    /// the reference leg is skipped.
    #[arg(long, env = "IDEM_BENCH_PYTHON")]
    python: Option<PathBuf>,
    /// The reference handler (default: the copy built into this program, from bench/reference/reference.py).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// A MySQL or MariaDB database for the MySQL legs (skipped without), e.g. mysql://root@127.0.0.1:3306/test
    /// (tables prefixed `bench_` are recreated for every leg).
    #[arg(long, env = "IDEM_BENCH_MYSQL")]
    mysql: Option<String>,
    /// Kafka brokers for the end-to-end leg (skipped without).
    #[arg(long)]
    kafka: Option<String>,
    /// Events preloaded on the 4-partition topic for the Kafka leg.
    #[arg(long, default_value_t = 1_000_000)]
    kafka_events: usize,
    /// A librdkafka consumer setting for the Kafka leg (KEY=VALUE, repeatable), e.g. fetch.wait.max.ms=10.
    #[arg(long = "kafka-setting")]
    kafka_settings: Vec<String>,
    /// NATS JetStream server for its read-limit and end-to-end legs (skipped without), e.g. nats://127.0.0.1:4222.
    #[arg(long)]
    nats: Option<String>,
    /// RabbitMQ server for its read-limit and end-to-end legs (skipped without), e.g.
    /// amqp://guest:guest@127.0.0.1:5672/%2f.
    #[arg(long)]
    rabbitmq: Option<String>,
    /// A Google Cloud Pub/Sub project for its read-limit and end-to-end legs (skipped without): the emulator at
    /// `PUBSUB_EMULATOR_HOST`, else the real service with the standard Google credentials. On the emulator they
    /// measure the emulator (a Java process on the same cores), not Pub/Sub.
    #[arg(long)]
    pubsub: Option<String>,
    /// Events loaded into NATS, RabbitMQ and Pub/Sub for their legs.
    #[arg(long, default_value_t = 100_000)]
    broker_events: usize,
    /// Only the legs whose name contains one of these (semicolon-separated), e.g. `pgbench;per-event`.
    #[arg(long)]
    only: Option<String>,
    /// Markers already in the table for the `grown:` legs (per-event and batch handler, plain and partitioned
    /// layouts, each against the same leg on an empty table).
    #[arg(long, default_value_t = 10_000_000)]
    grown_markers: u64,
    /// Open Sequential Inbox instances already there (each with one processed message and its claim) for the
    /// inbox leg's grown twin, against the same leg on empty tables.
    #[arg(long, default_value_t = 1_000_000)]
    open_instances: u64,
    /// Events preloaded on the embedded log for the memory leg: one consumer in a process of its own, whose peak
    /// RSS and RSS at each quarter of the deliveries are reported.
    #[arg(long, default_value_t = 1_000_000)]
    memory_events: usize,
    /// Dead letters and markers loaded for the console's leg (each), whose list pages are timed.
    #[arg(long, default_value_t = 1_000_000)]
    console_rows: i64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Another `idem-bench` binary, built from the commit before a change: both run the chosen legs in turn,
    /// `--rounds` times, one run each, and each leg is reported as this ÷ other with its spread over the rounds.
    #[arg(long, value_name = "OTHER_IDEM_BENCH")]
    compare: Option<PathBuf>,
    /// Rounds of `--compare`.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Seed of the event generator.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

/// One payment.
#[derive(Clone)]
struct Payment {
    id: String,
    account: i64,
    amount: i64,
}

/// The events of a leg: the delivery order, duplicates included.
struct Workload {
    deliveries: Vec<Payment>,
    unique: u64,
    expected_total: i64,
}

fn workload(events: usize, duplicates: f64, accounts: i64, seed: u64) -> Workload {
    let mut rng = Rng(seed);
    let dups = ((events as f64) * duplicates.clamp(0.0, 0.5)).round() as usize;
    let unique = events - dups;
    let base: Vec<Payment> = (0..unique)
        .map(|i| Payment {
            id: format!("pay-{i}"),
            account: rng.below(accounts as u64) as i64,
            amount: 1 + rng.below(10_000) as i64,
        })
        .collect();
    let expected_total = base.iter().map(|p| p.amount).sum();
    // A duplicate comes up to 1,000 deliveries after its original, as a redelivery would.
    let mut keyed: Vec<(u64, Payment)> = base.iter().enumerate().map(|(i, p)| (2 * i as u64, p.clone())).collect();
    for _ in 0..dups {
        let original = rng.below(unique as u64);
        let later = (original + 1 + rng.below(1_000)).min(unique as u64);
        keyed.push((2 * later + 1, base[original as usize].clone()));
    }
    keyed.sort_by_key(|(k, _)| *k);
    Workload { deliveries: keyed.into_iter().map(|(_, p)| p).collect(), unique: unique as u64, expected_total }
}

fn payload(p: &Payment) -> String {
    format!(r#"{{"id":"{}","account":{},"amount":{}}}"#, p.id, p.account, p.amount)
}

/// A leg's figures.
#[derive(serde::Serialize)]
struct Leg {
    name: String,
    /// Events per second of each run (deliveries, duplicates included).
    runs: Vec<f64>,
    median: f64,
    min: f64,
    max: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_rss_mib: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rss_mib_at_quarters: Option<Vec<f64>>,
}

/// The legs measured so far. Each is echoed on standard error as it ends (unless `--json`), so that a run cut short
/// (a broker that stalls, an interrupt) still leaves every figure it took.
struct Measured {
    legs: Vec<Leg>,
    echo: bool,
}

impl Measured {
    fn push(&mut self, leg: Leg) {
        if self.echo {
            eprintln!("bench: {}: {:.0} events/s ({:.0}–{:.0})", leg.name, leg.median, leg.min, leg.max);
        }
        self.legs.push(leg);
    }

    fn extend(&mut self, legs: impl IntoIterator<Item = Leg>) {
        legs.into_iter().for_each(|leg| self.push(leg));
    }

    fn has(&self, name: &str) -> bool {
        self.legs.iter().any(|l| l.name == name)
    }
}

impl Leg {
    fn new(name: String, mut runs: Vec<f64>) -> Leg {
        let Spread { median, min, max } = Spread::of(&runs);
        runs.iter_mut().for_each(|r| *r = r.round());
        Leg {
            name,
            runs,
            median: median.round(),
            min: min.round(),
            max: max.round(),
            peak_rss_mib: None,
            rss_mib_at_quarters: None,
        }
    }
}

/// The median, the least and the greatest of some figures (all 0 for none).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

impl Spread {
    fn of(values: &[f64]) -> Spread {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let at = |i: Option<&f64>| i.copied().unwrap_or(0.0);
        Spread { median: at(sorted.get(sorted.len() / 2)), min: at(sorted.first()), max: at(sorted.last()) }
    }
}

/// `idem-bench`: every leg, then the table of rates and ratios.
pub async fn run(mut args: BenchArgs) -> anyhow::Result<ExitCode> {
    if let Some(other) = &args.compare {
        return compare::run(&args, other, args.rounds).await;
    }
    if args.quick {
        args.events = args.events.min(2_000);
        args.runs = 1;
        args.kafka_events = args.kafka_events.min(2_000);
        args.broker_events = args.broker_events.min(2_000);
        args.console_rows = args.console_rows.min(2_000);
        args.grown_markers = args.grown_markers.min(20_000);
        args.open_instances = args.open_instances.min(20_000);
        args.memory_events = args.memory_events.min(2_000);
    }
    if args.runs == 0 || args.events == 0 || args.accounts <= 0 {
        bail!("--runs, --events and --accounts must be above zero");
    }
    let pool = idem::postgres::connect(&args.database_url, 8)
        .await
        .with_context(|| format!("--database-url: cannot connect to {}", idem_cli::db::redact(&args.database_url)))?;
    let work = workload(args.events, args.duplicates, args.accounts, args.seed);
    let wanted = |name: &str| args.only.as_deref().is_none_or(|only| only.split(';').any(|w| name.contains(w.trim())));
    let mut legs = Measured { legs: Vec::new(), echo: !args.json };
    let mut notes: Vec<String> = Vec::new();
    let progress = |name: &str| {
        if !args.json {
            eprintln!("bench: {name}…");
        }
    };

    for clients in [1usize, 2, 4] {
        let name = format!("pgbench per-event, {clients} client(s)");
        if wanted(&name) {
            progress(&name);
            let mut runs = Vec::new();
            for _ in 0..args.runs {
                runs.push(pgbench(&pool, &args, clients).await?);
            }
            legs.push(Leg::new(name, runs));
        }
    }
    let name = "reference handler (Python, psycopg 3)".to_owned();
    if wanted(&name) {
        match &args.python {
            Some(python) => {
                progress(&name);
                let file = write_events_file(&work)?;
                let mut runs = Vec::new();
                for _ in 0..args.runs {
                    runs.push(reference(&pool, &args, python, &file, &work).await?);
                }
                let _ = std::fs::remove_file(&file);
                legs.push(Leg::new(name, runs));
            }
            None => notes.push("reference leg skipped: no --python (bench/run.sh installs psycopg 3)".into()),
        }
    }
    for partitions in [1i32, 2, 4] {
        let name = format!("idem per-event, {partitions} partition(s)");
        if wanted(&name) {
            progress(&name);
            let mut runs = Vec::new();
            for _ in 0..args.runs {
                runs.push(idem_leg(&pool, &args, &work, 1, partitions, HandlerKind::PerMessage).await?);
            }
            legs.push(Leg::new(name, runs));
        }
    }
    use failing_key::Mode;
    for mode in [Mode::Held, Mode::HeldControl, Mode::Parked, Mode::ParkedControl] {
        let name = mode.name();
        if wanted(name) {
            progress(name);
            let mut runs = Vec::new();
            for _ in 0..args.runs {
                runs.push(failing_key::failing_key_leg(&pool, &args, &work, mode).await?);
            }
            legs.push(Leg::new(name.to_owned(), runs));
        }
    }
    let name = "idem configured per-event (idem run), 1 partition(s)".to_owned();
    if wanted(&name) {
        progress(&name);
        let mut runs = Vec::new();
        for _ in 0..args.runs {
            runs.push(configured::configured_leg(&pool, &args, &work, 1, 1, false).await?);
        }
        legs.push(Leg::new(name, runs));
    }
    for open in [0, args.open_instances] {
        let name = idem_legs::inbox_name(open);
        if wanted(&name) && !legs.has(&name) {
            progress(&name);
            let mut runs = Vec::new();
            for _ in 0..args.runs {
                runs.push(inbox_leg(&pool, &args, &work, 4, open).await?);
            }
            legs.push(Leg::new(name, runs));
        }
    }
    for batch in [100usize, 1_000] {
        for kind in [HandlerKind::PerMessage, HandlerKind::Batch] {
            let name = format!("idem batched {batch}, {}", kind.label());
            if wanted(&name) {
                progress(&name);
                let mut runs = Vec::new();
                for _ in 0..args.runs {
                    runs.push(idem_leg(&pool, &args, &work, batch, 1, kind).await?);
                }
                legs.push(Leg::new(name, runs));
            }
        }
        let name = format!("idem configured bulk (idem run), batched {batch}");
        if wanted(&name) {
            progress(&name);
            let mut runs = Vec::new();
            for _ in 0..args.runs {
                runs.push(configured::configured_leg(&pool, &args, &work, batch, 1, true).await?);
            }
            legs.push(Leg::new(name, runs));
        }
        let name = format!("batched SQL limit {batch}");
        if wanted(&name) {
            progress(&name);
            let mut runs = Vec::new();
            for _ in 0..args.runs {
                runs.push(raw_batched(&pool, &args, &work, batch).await?);
            }
            legs.push(Leg::new(name, runs));
        }
    }
    legs.extend(grown::run(&pool, &args, &work, &wanted, &progress).await?);
    let name = brokers::end_to_end_name("Kafka", args.kafka_events);
    if wanted(&name) || wanted(&brokers::read_limit_name("Kafka", args.kafka_events)) {
        match &args.kafka {
            Some(brokers) => {
                progress(&name);
                let (read, consume) = kafka_leg(&pool, &args, brokers, name).await?;
                legs.push(read);
                legs.push(consume);
            }
            None => notes.push("Kafka leg skipped: no --kafka".into()),
        }
    }

    let name = memory::name(args.memory_events);
    if wanted(&name) {
        progress(&name);
        legs.push(memory::memory_leg(&pool, &args).await?);
    }

    legs.extend(brokers::run(&pool, &args, &wanted, &progress, &mut notes).await?);
    legs.extend(outbox::run(&pool, &args, &work, &wanted, &progress, &mut notes).await?);
    legs.extend(mysql::run(&args, &work, &wanted, &progress, &mut notes).await?);
    legs.extend(http::run(&args, &wanted, &progress, &mut notes).await?);

    let mut pages = Vec::new();
    let name = format!("console list pages at {} dead letters and {} markers", args.console_rows, args.console_rows);
    if wanted(&name) {
        progress(&name);
        pages = console::run(&pool, args.console_rows, args.runs).await?;
    }

    let legs = legs.legs;
    let ratios = ratios(&legs, args.grown_markers, args.open_instances);
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "events": args.events, "duplicates": args.duplicates, "accounts": args.accounts, "runs": args.runs,
                "legs": legs, "ratios": ratios, "console_pages": pages, "notes": notes,
            })
        );
    } else {
        println!(
            "{} events ({:.1}% duplicates), {} accounts, median of {} run(s)\n",
            args.events,
            args.duplicates * 100.0,
            args.accounts,
            args.runs
        );
        println!("{:<66} {:>10} {:>21}", "leg", "events/s", "min–max");
        for leg in &legs {
            let rss = leg.peak_rss_mib.map(|m| format!("  peak RSS {m:.0} MiB")).unwrap_or_default();
            println!("{:<66} {:>10.0} {:>10.0}–{:<10.0}{rss}", leg.name, leg.median, leg.min, leg.max);
            if let Some(quarters) = &leg.rss_mib_at_quarters {
                println!("{:<66} RSS at 25/50/75/100%: {quarters:?} MiB", "");
            }
        }
        println!();
        for (name, value) in &ratios {
            println!("{name:<66} {value:>6.2}");
        }
        if !pages.is_empty() {
            println!("\n{name}\n{:<90} {:>10} {:>10}", "page", "median ms", "max ms");
            for page in &pages {
                println!("{:<90} {:>10.1} {:>10.1}", page.page, page.median_ms, page.max_ms);
            }
        }
        for note in &notes {
            println!("note: {note}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Recreates the leg's tables: accounts at zero, idem's marker tables empty.
async fn fresh_tables(pool: &PgPool, accounts: i64) -> anyhow::Result<Tables> {
    for sql in [
        "DROP TABLE IF EXISTS bench_processed_events, bench_dead_letters, bench_idem_migrations, bench_accounts, \
         bench_sequence_instance, bench_sequenced_message, bench_sequential_inbox_idempotence, bench_outbox, \
         bench_outbox_lease, bench_http_responses CASCADE",
        "DROP SEQUENCE IF EXISTS bench_seq",
        "CREATE SEQUENCE bench_seq",
        "CREATE TABLE bench_accounts (id bigint PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)",
    ] {
        sqlx::query(sql).execute(pool).await?;
    }
    sqlx::query("INSERT INTO bench_accounts SELECT i, 0 FROM generate_series(0, $1 - 1) i")
        .bind(accounts)
        .execute(pool)
        .await?;
    let tables = Tables::new(None, PREFIX)?;
    idem::migrate(pool, &tables).await?;
    sqlx::query("VACUUM ANALYZE bench_accounts").execute(pool).await?;
    sqlx::query("CHECKPOINT").execute(pool).await?;
    Ok(tables)
}

async fn check_ledger(pool: &PgPool, leg: &str, expected_total: i64, expected_markers: i64) -> anyhow::Result<()> {
    let total: i64 =
        sqlx::query_scalar("SELECT COALESCE(sum(balance), 0)::bigint FROM bench_accounts").fetch_one(pool).await?;
    let markers: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_processed_events").fetch_one(pool).await?;
    if total != expected_total || markers != expected_markers {
        bail!(
            "{leg}: ledger total {total} (expected {expected_total}), markers {markers} (expected {expected_markers})"
        );
    }
    Ok(())
}

/// pgbench running exactly the per-event transaction (BEGIN; INSERT marker; UPDATE account; COMMIT), prepared
/// statements, `clients` connections. Each transaction credits 1, so the total is the transaction count.
async fn pgbench(pool: &PgPool, args: &BenchArgs, clients: usize) -> anyhow::Result<f64> {
    fresh_tables(pool, args.accounts).await?;
    let script = std::env::temp_dir().join(format!("idem-bench-{}.sql", std::process::id()));
    std::fs::write(
        &script,
        format!(
            "\\set account random(0, {})\n\
             BEGIN;\n\
             INSERT INTO bench_processed_events (consumer_group, event_id, topic, partition, \"offset\", payload_digest) \
             VALUES ('{GROUP}', 'pgb-' || nextval('bench_seq'), '{TOPIC}', 0, 0, '\\x000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f'::bytea) \
             ON CONFLICT (consumer_group, event_id) DO NOTHING;\n\
             UPDATE bench_accounts SET balance = balance + 1 WHERE id = :account;\n\
             COMMIT;\n",
            args.accounts - 1
        ),
    )?;
    let per_client = args.events.div_ceil(clients);
    let output = tokio::process::Command::new("pgbench")
        .args(["-n", "-M", "prepared", "-f"])
        .arg(&script)
        .args(["-c", &clients.to_string(), "-j", &clients.to_string(), "-t", &per_client.to_string()])
        .arg(&args.database_url)
        .output()
        .await
        .context("pgbench: not found (Debian: apt-get install postgresql-client)")?;
    let _ = std::fs::remove_file(&script);
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!("pgbench failed: {}{}", stdout, String::from_utf8_lossy(&output.stderr));
    }
    let tps = stdout
        .lines()
        .find(|l| l.starts_with("tps = ") && l.contains("without initial connection time"))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|v| v.parse::<f64>().ok())
        .with_context(|| format!("pgbench: no tps in its output: {stdout}"))?;
    let transactions = (per_client * clients) as i64;
    check_ledger(pool, "pgbench", transactions, transactions).await?;
    Ok(tps)
}

fn write_events_file(work: &Workload) -> anyhow::Result<PathBuf> {
    use std::io::Write;
    let path = std::env::temp_dir().join(format!("idem-bench-events-{}.jsonl", std::process::id()));
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path)?);
    for p in &work.deliveries {
        writeln!(file, "{}", payload(p))?;
    }
    file.flush()?;
    Ok(path)
}

/// The reference handler's source, built in so that the benchmark runs from any directory.
const REFERENCE: &str = include_str!("../../../../bench/reference/reference.py");

/// The reference handler: the marker pattern by hand, in Python with psycopg 3.
async fn reference(
    pool: &PgPool,
    args: &BenchArgs,
    python: &PathBuf,
    events: &PathBuf,
    work: &Workload,
) -> anyhow::Result<f64> {
    fresh_tables(pool, args.accounts).await?;
    let script = match &args.reference {
        Some(path) => path.clone(),
        None => {
            let path = std::env::temp_dir().join(format!("idem-bench-reference-{}.py", std::process::id()));
            std::fs::write(&path, REFERENCE).with_context(|| format!("cannot write {}", path.display()))?;
            path
        }
    };
    let output = tokio::process::Command::new(python)
        .arg(&script)
        .arg(&args.database_url)
        .arg(events)
        .output()
        .await
        .with_context(|| format!("--python {}: cannot run {}", python.display(), script.display()));
    if args.reference.is_none() {
        let _ = std::fs::remove_file(&script);
    }
    let output = output?;
    if !output.status.success() {
        bail!("reference handler failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).context("reference handler output")?;
    let seconds = report["seconds"].as_f64().context("reference handler: no seconds")?;
    check_ledger(pool, "reference", work.expected_total, work.unique as i64).await?;
    Ok(work.deliveries.len() as f64 / seconds)
}
