//! `idem-bench`: idem side by side with PostgreSQL's own limit and the reference handler of document 000, on one
//! PostgreSQL, over the same payment events, each leg on fresh tables, each leg checking its ledger total.
//!
//! Legs: pgbench running the per-event transaction; the Python reference handler; idem with one transaction per
//! event at 1, 2 and 4 partitions; idem batched (100 and 1,000; per-message and batch handler); the batched SQL
//! limit (a raw loop: one multi-row claim and one UPDATE per batch); end to end from Kafka.

use std::collections::{HashSet, VecDeque};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use idem::source::SourceError;
use idem::{
    BatchHandler, Config, Engine, Event, Handler, HandlerError, KeyExtractor, Message, Received, Source, Tables,
};
use sqlx::{Connection, PgConnection, PgPool};

use idem_cli::demo::Rng;

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
    /// Kafka brokers for the end-to-end leg (skipped without).
    #[arg(long)]
    kafka: Option<String>,
    /// Events preloaded on the 4-partition topic for the Kafka leg.
    #[arg(long, default_value_t = 1_000_000)]
    kafka_events: usize,
    /// A librdkafka consumer setting for the Kafka leg (KEY=VALUE, repeatable), e.g. fetch.wait.max.ms=10.
    #[arg(long = "kafka-setting")]
    kafka_settings: Vec<String>,
    /// Only the legs whose name contains one of these (semicolon-separated), e.g. `pgbench;per-event`.
    #[arg(long)]
    only: Option<String>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Seed of the event generator.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

/// Arguments of the hidden `idem-bench consume`: the Kafka leg's consumer, in a process of its own so that its
/// memory is measured alone.
#[derive(clap::Args, Debug)]
pub struct ConsumeArgs {
    #[arg(long)]
    database_url: String,
    #[arg(long)]
    kafka: String,
    #[arg(long)]
    topic: String,
    #[arg(long)]
    group: String,
    #[arg(long)]
    batch_size: usize,
    /// Deliveries expected (for the memory samples at 25, 50, 75 and 100 %).
    #[arg(long)]
    deliveries: u64,
    /// librdkafka consumer settings, KEY=VALUE.
    #[arg(long = "kafka-setting")]
    kafka_settings: Vec<String>,
    /// Read and acknowledge only, no database: the broker's own delivery rate.
    #[arg(long)]
    read_only: bool,
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

impl Leg {
    fn new(name: String, mut runs: Vec<f64>) -> Leg {
        let mut sorted = runs.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
        let (min, max) = (sorted.first().copied().unwrap_or(0.0), sorted.last().copied().unwrap_or(0.0));
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

/// `idem-bench`: every leg, then the table of rates and ratios.
pub async fn run(mut args: BenchArgs) -> anyhow::Result<ExitCode> {
    if args.quick {
        args.events = args.events.min(2_000);
        args.runs = 1;
        args.kafka_events = args.kafka_events.min(2_000);
    }
    if args.runs == 0 || args.events == 0 || args.accounts <= 0 {
        bail!("--runs, --events and --accounts must be above zero");
    }
    let pool = idem::postgres::connect(&args.database_url, 8)
        .await
        .with_context(|| format!("--database-url: cannot connect to {}", idem_cli::db::redact(&args.database_url)))?;
    let work = workload(args.events, args.duplicates, args.accounts, args.seed);
    let wanted = |name: &str| args.only.as_deref().is_none_or(|only| only.split(';').any(|w| name.contains(w.trim())));
    let mut legs: Vec<Leg> = Vec::new();
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
    let name = "idem Sequential Inbox, 4 partition(s), released on arrival".to_owned();
    if wanted(&name) {
        progress(&name);
        let mut runs = Vec::new();
        for _ in 0..args.runs {
            runs.push(inbox_leg(&pool, &args, &work, 4).await?);
        }
        legs.push(Leg::new(name, runs));
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
    let name = format!("idem end to end from Kafka, batched 1000, 4 partitions ({} events)", args.kafka_events);
    if wanted("kafka") {
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

    let ratios = ratios(&legs);
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "events": args.events, "duplicates": args.duplicates, "accounts": args.accounts, "runs": args.runs,
                "legs": legs, "ratios": ratios, "notes": notes,
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
        for note in &notes {
            println!("note: {note}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The ratios of the issue's targets, from the medians.
fn ratios(legs: &[Leg]) -> Vec<(String, f64)> {
    let median = |name: &str| legs.iter().find(|l| l.name == name).map(|l| l.median).filter(|m| *m > 0.0);
    let mut out = Vec::new();
    let mut ratio = |label: String, a: Option<f64>, b: Option<f64>| {
        if let (Some(a), Some(b)) = (a, b) {
            out.push((label, (a / b * 100.0).round() / 100.0));
        }
    };
    for n in [1, 2, 4] {
        ratio(
            format!("idem per-event ÷ pgbench, {n}"),
            median(&format!("idem per-event, {n} partition(s)")),
            median(&format!("pgbench per-event, {n} client(s)")),
        );
    }
    ratio(
        "idem Sequential Inbox ÷ idem per-event, 4".into(),
        median("idem Sequential Inbox, 4 partition(s), released on arrival"),
        median("idem per-event, 4 partition(s)"),
    );
    let reference = median("reference handler (Python, psycopg 3)");
    for batch in [100, 1_000] {
        let per_message = median(&format!("idem batched {batch}, per-message handler"));
        let batch_handler = median(&format!("idem batched {batch}, batch handler"));
        ratio(format!("idem batched {batch} (batch handler) ÷ reference"), batch_handler, reference);
        ratio(format!("idem batched {batch} (per-message handler) ÷ reference"), per_message, reference);
        ratio(
            format!("idem batched {batch} (batch handler) ÷ batched SQL limit"),
            batch_handler,
            median(&format!("batched SQL limit {batch}")),
        );
    }
    let kafka = legs.iter().find(|l| l.name.starts_with("idem end to end from Kafka")).map(|l| l.median);
    let read = legs.iter().find(|l| l.name.starts_with("Kafka read limit")).map(|l| l.median);
    ratio("idem from Kafka ÷ batched SQL limit 1000".into(), kafka, median("batched SQL limit 1000"));
    ratio("idem from Kafka ÷ Kafka read limit".into(), kafka, read);
    out
}

/// Recreates the leg's tables: accounts at zero, idem's marker tables empty.
async fn fresh_tables(pool: &PgPool, accounts: i64) -> anyhow::Result<Tables> {
    for sql in [
        "DROP TABLE IF EXISTS bench_processed_events, bench_dead_letters, bench_idem_migrations, bench_accounts, \
         bench_sequence_instance, bench_sequenced_message, bench_sequential_inbox_idempotence CASCADE",
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
const REFERENCE: &str = include_str!("../../../bench/reference/reference.py");

/// The reference handler of document 000 step 2, in Python with psycopg 3.
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

#[derive(Clone, Copy, PartialEq, Eq)]
enum HandlerKind {
    PerMessage,
    Batch,
}

impl HandlerKind {
    fn label(self) -> &'static str {
        match self {
            HandlerKind::PerMessage => "per-message handler",
            HandlerKind::Batch => "batch handler",
        }
    }
}

#[derive(serde::Deserialize)]
struct Credit {
    account: i64,
    amount: i64,
}

#[derive(serde::Deserialize)]
struct RawPayment {
    id: String,
    account: i64,
    amount: i64,
}

/// One UPDATE per event.
struct CreditEach;

impl Handler<sqlx::Postgres> for CreditEach {
    async fn handle(&self, event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let c: Credit = event.json()?;
        sqlx::query("UPDATE bench_accounts SET balance = balance + $1 WHERE id = $2")
            .bind(c.amount)
            .bind(c.account)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// One UPDATE for the whole batch.
struct CreditAll;

impl BatchHandler<sqlx::Postgres> for CreditAll {
    async fn handle_batch(&self, events: &[&Event], tx: &mut PgConnection) -> Result<(), HandlerError> {
        let mut accounts = Vec::with_capacity(events.len());
        let mut amounts = Vec::with_capacity(events.len());
        for event in events {
            let c: Credit = event.json()?;
            accounts.push(c.account);
            amounts.push(c.amount);
        }
        credit_all(tx, &accounts, &amounts).await?;
        Ok(())
    }
}

async fn credit_all(tx: &mut PgConnection, accounts: &[i64], amounts: &[i64]) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE bench_accounts a SET balance = a.balance + d.amount
           FROM (SELECT account, sum(amount)::bigint AS amount FROM UNNEST($1::bigint[], $2::bigint[]) AS t(account, amount)
                  GROUP BY account) d
          WHERE a.id = d.account",
    )
    .bind(accounts)
    .bind(amounts)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Preloaded messages handed out in order; acknowledgements are not needed here.
struct MemorySource(Mutex<VecDeque<Message>>);

impl Source for MemorySource {
    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        let next = self.0.lock().map_err(|_| SourceError::permanent("bench source", "poisoned"))?.pop_front();
        Ok(next.map(Received::Message))
    }

    async fn ack(&self, _ack: &idem::Acknowledgement) -> Result<(), SourceError> {
        Ok(())
    }
}

/// The workload as messages over `partitions` partitions (by account), interleaved as a broker would.
fn messages(work: &Workload, partitions: i32) -> VecDeque<Message> {
    let mut offsets = vec![0i64; partitions as usize];
    work.deliveries
        .iter()
        .map(|p| {
            let partition = (p.account % i64::from(partitions)) as i32;
            let offset = &mut offsets[partition as usize];
            *offset += 1;
            Message::new(TOPIC, partition, *offset - 1, payload(p).into_bytes())
        })
        .collect()
}

async fn idem_leg(
    pool: &PgPool,
    args: &BenchArgs,
    work: &Workload,
    batch_size: usize,
    partitions: i32,
    kind: HandlerKind,
) -> anyhow::Result<f64> {
    let tables = fresh_tables(pool, args.accounts).await?;
    let engine_pool = idem::postgres::connect(&args.database_url, partitions as u32 + 2).await?;
    let config = Config::new(GROUP, KeyExtractor::JsonPointer("/id".into())).batch_size(batch_size).tables(tables);
    let engine = Engine::new(engine_pool.clone(), config)?;
    let source = MemorySource(Mutex::new(messages(work, partitions)));
    let started = Instant::now();
    let stats = match kind {
        HandlerKind::PerMessage => engine.run(source, CreditEach, std::future::pending::<()>()).await?,
        HandlerKind::Batch => engine.run_batched(source, CreditAll, std::future::pending::<()>()).await?,
    };
    let seconds = started.elapsed().as_secs_f64();
    engine_pool.close().await;
    if stats.processed != work.unique {
        bail!("idem leg: processed {} of {} events", stats.processed, work.unique);
    }
    check_ledger(pool, "idem", work.expected_total, work.unique as i64).await?;
    Ok(work.deliveries.len() as f64 / seconds)
}

/// The Sequential Inbox on the same events: each payment is a `Credit` of the sequence of its account, released
/// on arrival, so every event pays the inbox's whole path (instance, claim, lock, lookup, record, release scan).
async fn inbox_leg(pool: &PgPool, args: &BenchArgs, work: &Workload, partitions: i32) -> anyhow::Result<f64> {
    let tables = fresh_tables(pool, args.accounts).await?;
    let engine_pool = idem::postgres::connect(&args.database_url, partitions as u32 + 2).await?;
    let config = Config::new(GROUP, KeyExtractor::JsonPointer("/id".into())).batch_size(1).tables(tables);
    let sequences = r#"
        [[sequence]]
        name = "account"
        retention = "1d"
        [[sequence.type]]
        name = "Credit"
        context_id = "json:/account"
        [[sequence.type]]
        name = "AccountClosed"
        context_id = "json:/account"
        release = { predecessor = "Credit" }
    "#;
    let inbox = idem::inbox::SequentialInbox::new(
        Engine::new(engine_pool.clone(), config)?,
        idem::inbox::InboxConfig::from_toml(sequences)?,
    )?;
    let messages = messages(work, partitions).into_iter().map(|m| m.with_header("type", "Credit")).collect();
    let source = MemorySource(Mutex::new(messages));
    let started = Instant::now();
    inbox.run(source, CreditEach, std::future::pending::<()>()).await?;
    let seconds = started.elapsed().as_secs_f64();
    engine_pool.close().await;
    let stats = inbox.stats();
    if stats.processed != work.unique {
        bail!("inbox leg: processed {} of {} events", stats.processed, work.unique);
    }
    check_ledger(pool, "inbox", work.expected_total, 0).await?;
    let claims: i64 =
        sqlx::query_scalar("SELECT count(*) FROM bench_sequential_inbox_idempotence").fetch_one(pool).await?;
    if claims != work.unique as i64 {
        bail!("inbox leg: {claims} claims for {} events", work.unique);
    }
    Ok(work.deliveries.len() as f64 / seconds)
}

/// The batched SQL limit: per batch, one multi-row `INSERT … ON CONFLICT DO NOTHING RETURNING`, one UPDATE for
/// the new events, one commit; one connection, nothing else.
async fn raw_batched(pool: &PgPool, args: &BenchArgs, work: &Workload, batch: usize) -> anyhow::Result<f64> {
    fresh_tables(pool, args.accounts).await?;
    let mut conn = PgConnection::connect(&args.database_url).await?;
    let messages: Vec<Message> = messages(work, 1).into();
    let started = Instant::now();
    for chunk in messages.chunks(batch) {
        // What a consumer has to do anyway: read each payload.
        let payments: Vec<RawPayment> =
            chunk.iter().map(|m| serde_json::from_slice(&m.payload)).collect::<Result<_, _>>()?;
        let ids: Vec<&str> = payments.iter().map(|p| p.id.as_str()).collect();
        let offsets: Vec<i64> = chunk.iter().map(|m| m.offset).collect();
        let digests: Vec<Vec<u8>> = chunk.iter().map(|m| idem::store::payload_digest(&m.payload)).collect();
        let mut tx = conn.begin().await?;
        let fresh: Vec<String> = sqlx::query_scalar(
            r#"INSERT INTO bench_processed_events (consumer_group, event_id, topic, partition, "offset", payload_digest)
               SELECT $1, id, $2, 0, o, d FROM UNNEST($3::text[], $4::bigint[], $5::bytea[]) AS u(id, o, d)
               ON CONFLICT (consumer_group, event_id) DO NOTHING RETURNING event_id"#,
        )
        .bind(GROUP)
        .bind(TOPIC)
        .bind(&ids)
        .bind(&offsets)
        .bind(&digests)
        .fetch_all(&mut *tx)
        .await?;
        let mut fresh: HashSet<String> = fresh.into_iter().collect();
        let (mut accounts, mut amounts) = (Vec::new(), Vec::new());
        for p in &payments {
            if fresh.remove(&p.id) {
                accounts.push(p.account);
                amounts.push(p.amount);
            }
        }
        credit_all(&mut tx, &accounts, &amounts).await?;
        tx.commit().await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    check_ledger(pool, "batched SQL limit", work.expected_total, work.unique as i64).await?;
    Ok(work.deliveries.len() as f64 / seconds)
}

/// Preloads the topic once, then consumes it `runs` times (a fresh group and fresh tables each time) in a child
/// process whose memory is sampled.
async fn kafka_leg(pool: &PgPool, args: &BenchArgs, brokers: &str, name: String) -> anyhow::Result<(Leg, Leg)> {
    let work = workload(args.kafka_events, args.duplicates, args.accounts, args.seed ^ 0x006b_6166_6b61);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let topic = format!("bench-{nanos}");
    let records: Vec<(i64, String)> = work.deliveries.iter().map(|p| (p.account, payload(p))).collect();
    idem_cli::demo::write_kafka(brokers, &topic, 4, &records).await?;
    drop(records);
    let mut runs = Vec::new();
    let mut peak: f64 = 0.0;
    let mut quarters = Vec::new();
    let mut reads = Vec::new();
    for run in 0..args.runs {
        let deliveries = work.deliveries.len();
        let report =
            consume_child(args, brokers, &topic, &format!("bench-read-{nanos}-{run}"), deliveries, true).await?;
        reads.push(report["per_second"].as_f64().unwrap_or(0.0));

        fresh_tables(pool, args.accounts).await?;
        let report = consume_child(args, brokers, &topic, &format!("bench-{nanos}-{run}"), deliveries, false).await?;
        check_ledger(pool, "Kafka", work.expected_total, work.unique as i64).await?;
        runs.push(report["per_second"].as_f64().unwrap_or(0.0));
        peak = peak.max(report["peak_rss_mib"].as_f64().unwrap_or(0.0));
        quarters = report["rss_mib_at_quarters"]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
            .unwrap_or_default();
    }
    if std::env::var_os("IDEM_BENCH_KEEP_TOPIC").is_some() {
        eprintln!("bench: topic {topic} kept");
    } else if let Err(error) = idem::kafka::delete_topic(brokers, &topic).await {
        tracing::warn!(%error, topic, "bench: could not delete the topic");
    }
    let mut leg = Leg::new(name, runs);
    leg.peak_rss_mib = Some((peak * 10.0).round() / 10.0);
    leg.rss_mib_at_quarters = Some(quarters);
    let read = Leg::new(
        format!("Kafka read limit: read and acknowledge only, no database ({} events)", args.kafka_events),
        reads,
    );
    Ok((read, leg))
}

/// Runs `idem-bench consume` (reading only, or into the database) and returns its JSON report.
async fn consume_child(
    args: &BenchArgs,
    brokers: &str,
    topic: &str,
    group: &str,
    deliveries: usize,
    read_only: bool,
) -> anyhow::Result<serde_json::Value> {
    let settings = KAFKA_DEFAULTS.iter().copied().chain(args.kafka_settings.iter().map(String::as_str));
    let output = tokio::process::Command::new(std::env::current_exe()?)
        .args(["consume", "--database-url", &args.database_url, "--kafka", brokers, "--topic", topic])
        .args(["--group", group, "--batch-size", "1000", "--deliveries", &deliveries.to_string()])
        .args(read_only.then_some("--read-only"))
        .args(settings.flat_map(|s| ["--kafka-setting", s]))
        .stderr(std::process::Stdio::inherit())
        .output()
        .await?;
    if !output.status.success() {
        bail!("the Kafka consumer process failed (exit {:?})", output.status.code());
    }
    serde_json::from_slice(&output.stdout).context("the consumer process's output")
}

fn rss_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| (kib / 1024.0 * 10.0).round() / 10.0)
}

/// `idem-bench consume`: consumes the topic to its end with the batch handler; prints its rate (from the first
/// commit to the last, so the group join is not counted) and its memory.
pub async fn consume(args: ConsumeArgs) -> anyhow::Result<ExitCode> {
    let pool = idem::postgres::connect(&args.database_url, 6).await?;
    let config = Config::new(args.group.clone(), KeyExtractor::JsonPointer("/id".into()))
        .batch_size(args.batch_size)
        .tables(Tables::new(None, PREFIX)?);
    let mut kafka = idem::kafka::KafkaConfig::new(args.kafka.clone(), &[args.topic.as_str()]);
    kafka.stop_at_end = true;
    for setting in &args.kafka_settings {
        let (key, value) =
            setting.split_once('=').with_context(|| format!("--kafka-setting `{setting}`: use KEY=VALUE"))?;
        kafka = kafka.set(key, value);
    }
    let source = idem::kafka::KafkaSource::connect(&kafka, &config).await?;
    if args.read_only {
        return read_only(source).await;
    }
    let progress = Arc::new(Mutex::new(Progress::default()));
    let observer = {
        let (progress, deliveries) = (Arc::clone(&progress), args.deliveries);
        move |c: &idem::Committed| {
            if let Ok(mut p) = progress.lock() {
                p.record(c.processed + c.duplicate + c.dead_lettered + c.id_reused, deliveries);
            }
        }
    };
    let engine = Engine::new(pool, config)?.on_commit(observer);
    let stats = engine.run_batched(source, CreditAll, std::future::pending::<()>()).await?;
    let p = progress.lock().map_err(|_| anyhow::anyhow!("progress lock poisoned"))?;
    let (first, last) = (p.first.context("nothing was consumed")?, p.last.context("nothing was consumed")?);
    let span = last.duration_since(first).max(Duration::from_millis(1));
    println!(
        "{}",
        serde_json::json!({
            "processed": stats.processed,
            "duplicate": stats.duplicate,
            "per_second": (p.count - p.first_batch) as f64 / span.as_secs_f64(),
            "peak_rss_mib": rss_mib("VmHWM:"),
            "rss_mib_at_quarters": p.quarters,
        })
    );
    Ok(ExitCode::SUCCESS)
}

/// Reads the topic to its end, acknowledging every message, and prints the rate from the first to the last.
async fn read_only(source: idem::kafka::KafkaSource) -> anyhow::Result<ExitCode> {
    let (mut count, mut first, mut last) = (0u64, None, Instant::now());
    loop {
        match source.recv().await? {
            Some(Received::Message(m)) => {
                first.get_or_insert_with(Instant::now);
                last = Instant::now();
                count += 1;
                source.ack(&idem::Acknowledgement::up_to(m.topic.clone(), m.partition, m.offset)).await?;
            }
            Some(Received::Revoked { drained, .. }) => drained.done(),
            None => break,
        }
    }
    let first = first.context("nothing was consumed")?;
    let span = last.duration_since(first).max(Duration::from_millis(1));
    println!("{}", serde_json::json!({ "read": count, "per_second": count as f64 / span.as_secs_f64() }));
    Ok(ExitCode::SUCCESS)
}

#[derive(Default)]
struct Progress {
    first: Option<Instant>,
    first_batch: u64,
    last: Option<Instant>,
    count: u64,
    quarters: Vec<f64>,
}

impl Progress {
    fn record(&mut self, n: u64, deliveries: u64) {
        let now = Instant::now();
        if self.first.is_none() {
            self.first = Some(now);
            self.first_batch = n;
        }
        self.last = Some(now);
        self.count += n;
        let quarter = (self.quarters.len() as u64 + 1) * deliveries / 4;
        if self.quarters.len() < 4 && self.count >= quarter {
            self.quarters.push(rss_mib("VmRSS:"));
        }
    }
}
