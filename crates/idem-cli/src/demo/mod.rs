//! `idem demo`: a payments ledger consumed with exactly-once effects while the consumer is killed.
//!
//! The parent process produces payment events into the embedded log (with producer retries, i.e. duplicates,
//! and a few poison messages), then runs consumer child processes (`idem demo-worker`) one after the other.
//! Each planned crash arms the fault injection of one child (`--fault`), which kills itself with SIGKILL
//! between the database commit and the acknowledgement (or before the commit); the next child resumes from
//! the last acknowledged offsets. At the end the ledger is checked to the cent against what was produced.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use idem::Tables;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::db::Db;
use crate::with_pool;

mod chain;
mod events;
mod held;
mod http;
mod service;
mod summary;
mod transport;
mod worker;

use events::{Plan, generate};
pub use events::{ProduceArgs, Rng, produce, write_kafka, write_nats, write_rabbitmq};
use summary::{Summary, print_summary};
use transport::Transport;
use worker::CommitReport;
pub(crate) use worker::faults;
pub use worker::{WorkerArgs, report_commit, worker};

const TOPIC: &str = "payments";
const GROUP: &str = "demo-ledger";
const PREFIX: &str = "idem_demo_";
const ACCOUNTS: i64 = 1000;
/// The visibility timeout of the demo's SQS queue: what a killed consumer held reappears this much later.
const SQS_VISIBILITY: Duration = Duration::from_secs(3);

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
    /// Use the NATS JetStream server at this URL (nats://host:port) instead of the embedded log: a fresh stream
    /// and durable consumer per run (its subjects spread over the partitions), the stream removed at the end.
    #[arg(long, conflicts_with = "kafka")]
    nats: Option<String>,
    /// Use the RabbitMQ server at this URL (amqp://user:password@host:port/vhost) instead of the embedded log: a
    /// fresh queue per partition (each account's events in one of them), removed at the end.
    #[arg(long, conflicts_with_all = ["kafka", "nats"])]
    rabbitmq: Option<String>,
    /// Use Amazon SQS instead of the embedded log: an SQS-compatible endpoint (http://127.0.0.1:9324) or `aws`
    /// (region and credentials from the standard AWS configuration). A fresh FIFO queue per run, each account a
    /// message group, with a visibility timeout of 3 s (what a killed consumer held reappears 3 s later); the
    /// queue is removed at the end.
    #[arg(long, conflicts_with_all = ["kafka", "nats", "rabbitmq"])]
    sqs: Option<String>,
    /// Use Google Cloud Pub/Sub in this project instead of the embedded log: the emulator at
    /// `PUBSUB_EMULATOR_HOST`, else the real service with the standard Google credentials. A fresh topic and
    /// ordered subscription per run (ack deadline 10 s), each account an ordering key, removed at the end. The
    /// emulator does not deliver again what a killed consumer held on an ordered subscription: the keys it holds
    /// stay stalled, and the demo checks that everything before each stall was applied exactly once and nothing
    /// after it.
    #[arg(long, conflicts_with_all = ["kafka", "nats", "rabbitmq", "sqs"])]
    pubsub: Option<String>,
    /// The chain: each credit also enqueues a `PaymentCredited` event in the outbox (same transaction); relays
    /// (killed with SIGKILL at random points) deliver them to a second topic; a second consumer group (killed too)
    /// applies them to a second ledger. Both ledgers are checked to the cent, and each account's order in the
    /// second. Embedded log or Kafka.
    #[arg(long, conflicts_with_all = ["nats", "rabbitmq", "sqs", "pubsub"])]
    chain: bool,
    /// Consume through `idem run --config`: the ledger's effects declared as SQL in a configuration file (written
    /// beside the log, printed with --dir) instead of the demo's Rust handler; the same crashes and checks.
    #[arg(long, conflicts_with = "chain")]
    service: bool,
    /// Feed the ledger over HTTP instead of a broker: `idem run` serves `[consumer.http]` (written beside the
    /// database) and is killed --crashes times (between the commit and the answer, at a random moment, before the
    /// commit); 16 clients send each payment with its Idempotency-Key, give up on their first try after a few
    /// milliseconds, send some again after their answer and some three times at once, and retry until answered.
    /// The ledger must be exact and every answer of a key the same.
    #[arg(long, conflicts_with_all = ["kafka", "nats", "rabbitmq", "sqs", "pubsub", "chain", "service"])]
    http: bool,
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
    // Made again from the start if the database drops the connection meanwhile.
    crate::db::reconnecting(|| prepare(&db, &tables)).await?;

    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64)
    });
    if !args.json {
        eprintln!("generating {} payment events (seed {seed}) and producing them…", args.events);
    }
    let (plan, records) = generate(args.events, args.duplicates, seed);
    if args.http {
        let summary = http::demo(&args, &db, &url, &dir, &plan, &records, seed).await;
        if temporary {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let summary = summary?;
        print_summary(&summary, args.json)?;
        return Ok(if summary.ok { ExitCode::SUCCESS } else { ExitCode::FAILURE });
    }
    let run_id = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let transport = Transport::produce(&args, run_id, &log_dir, &records).await?;
    if !args.json {
        eprintln!(
            "produced {} events ({} sent twice by the producer, {} poison) into {} partitions; consuming with {} crash(es)…",
            plan.events, plan.producer_duplicates, plan.poison, args.partitions, args.crashes
        );
    }

    let started = Instant::now();
    let announce = args.chain.then(|| chain::topic(&transport));
    let extra: Vec<String> = announce.iter().flat_map(|t| ["--announce".to_owned(), t.clone()]).collect();
    let service = match args.service {
        true => Some(service::write(&dir, &transport, args.batch_size, args.partitions + 2)?),
        false => None,
    };
    let consumer =
        if service.is_some() { "idem run --config (effects declared as SQL)" } else { "demo's Rust handler" };
    let mut summary = Summary::planned(db.name(), consumer, &plan);
    let mut consumed =
        consume(&args, &transport, &url, plan.records, seed, &extra, service.as_deref(), &mut summary).await;
    summary.consume_seconds = started.elapsed().as_secs_f64();
    if let (Some(topic), Ok(())) = (&announce, &consumed) {
        consumed = chain::relay_and_apply(&args, &transport, topic, &url, &plan, seed, &mut summary).await;
    }
    transport.remove().await;
    // The summary is printed whatever failed: what failed is one of its mismatches.
    let consumed = consumed.map_err(|error| format!("consuming did not finish: {error:#}"));
    // The emulator does not deliver again what a killed consumer held on an ordered subscription.
    let held_back = matches!(transport, Transport::PubSub { .. }) && crate::pubsub::emulator().is_some();
    let verified = async {
        match held_back {
            true => verify_held(&db, &records, &mut summary).await?,
            false => verify(&db, &plan, &mut summary).await?,
        }
        if args.chain {
            chain::verify(&db, &plan, &mut summary).await?;
        }
        anyhow::Ok(())
    }
    .await;
    let verified = verified.map_err(|error| format!("the outcome could not be read from the database: {error:#}"));
    for failed in [consumed.err(), verified.err()].into_iter().flatten() {
        summary.mismatches.insert(0, failed);
        summary.ok = false;
    }
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
    crate::features::require_flags(&[
        ("kafka", args.kafka.is_some()),
        ("nats", args.nats.is_some()),
        ("rabbitmq", args.rabbitmq.is_some()),
        ("sqs", args.sqs.is_some()),
        ("pubsub", args.pubsub.is_some()),
    ])
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
    let tables_of_the_demo = [
        "processed_events",
        "dead_letters",
        "outbox",
        "outbox_lease",
        "idem_migrations",
        "accounts",
        "ledger",
        "accounts2",
        "ledger2",
    ];
    for table in tables_of_the_demo {
        db.execute(&format!("DROP TABLE IF EXISTS {}", tables.table(table))).await?;
    }
    with_pool!(db, pool => idem::migrate(pool, tables).await?);
    // The accounts as one VALUES list: the same SQL on every store.
    let ids: Vec<String> = (1..=ACCOUNTS).map(|id| format!("({id}, 0)")).collect();
    let create = format!(
        "CREATE TABLE {accounts} (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL, credits BIGINT NOT NULL DEFAULT 0);
         CREATE TABLE {ledger} (event_id TEXT NOT NULL, account BIGINT NOT NULL, amount BIGINT NOT NULL);
         INSERT INTO {accounts} (id, balance) VALUES {values};
         CREATE TABLE {accounts2} (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL, last_seq BIGINT NOT NULL DEFAULT 0,
                                   out_of_order BIGINT NOT NULL DEFAULT 0);
         CREATE TABLE {ledger2} (event_id TEXT NOT NULL, account BIGINT NOT NULL, amount BIGINT NOT NULL);
         INSERT INTO {accounts2} (id, balance) SELECT id, 0 FROM {accounts};",
        accounts = tables.table("accounts"),
        ledger = tables.table("ledger"),
        accounts2 = tables.table("accounts2"),
        ledger2 = tables.table("ledger2"),
        values = ids.join(", "),
    );
    db.execute(&create).await
}

/// Runs consumer processes until one finishes the log; the planned ones are killed at their fault point.
/// `service`: the configuration file `idem run` consumes with, instead of `idem demo-worker`.
#[allow(clippy::too_many_arguments)]
async fn consume(
    args: &DemoArgs,
    transport: &Transport,
    url: &str,
    records: u64,
    seed: u64,
    extra: &[String],
    service: Option<&Path>,
    summary: &mut Summary,
) -> anyhow::Result<()> {
    let progress = indicatif::ProgressBar::new(records);
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
            let left = records.saturating_sub(summary.deliveries);
            let batches_left = left / (args.batch_size as u64).max(1);
            let at = 1 + rng.below((batches_left / u64::from(crashes_left + 1)).max(1));
            format!("{point}:{at}")
        });
        let mut command = tokio::process::Command::new(&exe);
        command.arg("--log").arg("error");
        match service {
            Some(config) => {
                command.args(["run", "--exit-at-end", "--report-commits", "--config"]).arg(config);
                command.env("IDEM_DATABASE_URL", url);
                if let Some(broker) = service::broker_url(transport) {
                    command.env(service::BROKER_URL_ENV, broker);
                }
            }
            None => {
                command
                    .arg("demo-worker")
                    .args(transport.worker_args())
                    .arg("--database-url")
                    .arg(url)
                    .arg("--batch-size")
                    .arg(args.batch_size.to_string())
                    .arg("--connections")
                    .arg((args.partitions + 1).to_string())
                    .args(extra);
            }
        }
        command.stdout(Stdio::piped()).stdin(Stdio::null()).kill_on_drop(true);
        if let Some(fault) = &fault {
            command.arg("--fault").arg(fault);
        }
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
                summary.deliveries += report.processed + report.duplicate + report.dead_lettered + report.id_reused;
                progress.set_position(summary.deliveries.min(records));
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

/// Reads what the database holds into the summary.
async fn read_outcome(db: &Db, tables: &Tables, summary: &mut Summary) -> anyhow::Result<()> {
    let (accounts, ledger) = (tables.table("accounts"), tables.table("ledger"));
    summary.actual_total_cents = db.scalar(&format!("SELECT {} FROM {accounts}", db.integer_sum("balance"))).await?;
    summary.ledger_entries = db.scalar(&format!("SELECT COUNT(*) FROM {ledger}")).await?;
    summary.distinct_ledger_events = db.scalar(&format!("SELECT COUNT(DISTINCT event_id) FROM {ledger}")).await?;
    // The first consumer group's markers (the chain's second group is `…-second`).
    summary.markers = db
        .scalar(&format!(
            "SELECT COUNT(*) FROM {} WHERE consumer_group NOT LIKE '%-second'",
            tables.table("processed_events")
        ))
        .await?;
    summary.dead_letter_rows = db.scalar(&format!("SELECT COUNT(*) FROM {}", tables.table("dead_letters"))).await?;
    // What committed, from the database: a consumer killed while another of its workers commits can lose that
    // commit's report line, never the commit. Duplicates stay as the consumers reported them.
    summary.processed = u64::try_from(summary.distinct_ledger_events).unwrap_or(0);
    summary.dead_lettered = u64::try_from(summary.dead_letter_rows).unwrap_or(0);
    summary.deliveries = summary.processed + summary.duplicates_absorbed + summary.dead_lettered;
    Ok(())
}

/// On a broker that holds messages back for good (Pub/Sub's emulator): each key's events applied exactly once up
/// to its stall, none after it.
async fn verify_held(db: &Db, records: &[(i64, String)], summary: &mut Summary) -> anyhow::Result<()> {
    let tables = Tables::new(None, PREFIX)?;
    read_outcome(db, &tables, summary).await?;
    summary.held_back = Some(held::verify(db, &tables, records, summary).await?);
    if summary.crashes_survived == 0 && summary.consumer_runs > 1 {
        summary.mismatches.push("no crash happened".into());
    }
    summary.ok = summary.mismatches.is_empty();
    Ok(())
}

/// Compares the database with the plan; every difference is a mismatch.
async fn verify(db: &Db, plan: &Plan, summary: &mut Summary) -> anyhow::Result<()> {
    let tables = Tables::new(None, PREFIX)?;
    read_outcome(db, &tables, summary).await?;
    let (actual_total, entries, distinct) =
        (summary.actual_total_cents, summary.ledger_entries, summary.distinct_ledger_events);
    let (markers, dead) = (summary.markers, summary.dead_letter_rows);
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
