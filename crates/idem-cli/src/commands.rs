//! The operator's commands: stats, pruning, the brokers replays and relays publish to, the marker layout (`idem migrate` is in `migrations`).

use idem::prune::RETENTION_FLOOR;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use idem::Tables;
use idem::store::GroupStats;

use crate::db::{self, Db};
use crate::{DbArgs, with_pool};

/// `idem stats`.
pub async fn stats(args: &DbArgs, json: bool) -> anyhow::Result<ExitCode> {
    let (db, tables) = Db::open_with(args, "processed_events").await?;
    let stats = with_pool!(&db, pool => idem::store::stats(pool, &tables, None).await?);
    print_stats(&stats, json)?;
    Ok(ExitCode::SUCCESS)
}

fn print_stats(stats: &[GroupStats], json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(stats)?);
        return Ok(());
    }
    if stats.is_empty() {
        println!("no markers and no dead letters");
        return Ok(());
    }
    println!(
        "{:<32} {:>12} {:>18} {:>12} {:>10}",
        "consumer_group", "markers", "oldest_marker_age", "dead_letters", "id_reused"
    );
    for s in stats {
        let age = s.oldest_marker_age_seconds.map_or("-".to_owned(), human_duration);
        println!("{:<32} {:>12} {:>18} {:>12} {:>10}", s.consumer_group, s.markers, age, s.dead_letters, s.id_reused);
    }
    Ok(())
}

/// A progress bar's rate as a person writes it: `5234/s`.
pub fn rate(state: &indicatif::ProgressState, out: &mut dyn std::fmt::Write) {
    let _ = write!(out, "{:.0}/s", state.per_sec());
}

/// A configured duration as it would be written: in the largest unit it is a whole number of (`30d`, `90m`).
fn exact_duration(d: std::time::Duration) -> String {
    let ms = d.as_millis();
    [(86_400_000, "d"), (3_600_000, "h"), (60_000, "m"), (1_000, "s")]
        .into_iter()
        .find(|(unit, _)| ms >= *unit && ms.is_multiple_of(*unit))
        .map_or_else(|| format!("{ms}ms"), |(unit, name)| format!("{}{name}", ms / unit))
}

fn human_duration(seconds: f64) -> String {
    match seconds {
        s if s < 120.0 => format!("{s:.0}s"),
        s if s < 7200.0 => format!("{:.0}m", s / 60.0),
        s if s < 172_800.0 => format!("{:.1}h", s / 3600.0),
        s => format!("{:.1}d", s / 86_400.0),
    }
}

/// Where messages are published (replayed dead letters, relayed outbox messages): one broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BrokerTarget {
    /// An embedded log directory.
    Log(PathBuf),
    /// Kafka brokers.
    Kafka(String),
    /// A NATS JetStream server.
    Nats(String),
    /// A RabbitMQ server.
    Rabbitmq(String),
    /// Amazon SQS: an endpoint, or `aws`.
    Sqs(String),
    /// Google Cloud Pub/Sub: the project (the emulator from `PUBSUB_EMULATOR_HOST`).
    PubSub(String),
}

/// At most one broker, or none: `idem relay` (none when every destination is a URL; a destination is a topic,
/// subject, queue's name or URL, and a message's key its partition key, FIFO group or ordering key) and `idem
/// console` (none: replays are refused).
#[derive(clap::Args, Debug)]
pub struct OptionalBrokerFlags {
    /// The embedded log (its directory).
    #[arg(long, conflicts_with_all = ["kafka", "nats", "rabbitmq", "sqs", "pubsub"])]
    pub log_dir: Option<PathBuf>,
    /// Kafka brokers (host:port).
    #[arg(long, conflicts_with_all = ["nats", "rabbitmq", "sqs", "pubsub"])]
    pub kafka: Option<String>,
    /// A NATS JetStream server (nats://host:port).
    #[arg(long, conflicts_with_all = ["rabbitmq", "sqs", "pubsub"])]
    pub nats: Option<String>,
    /// A RabbitMQ server (amqp://user:password@host:port/vhost).
    #[arg(long, conflicts_with_all = ["sqs", "pubsub"])]
    pub rabbitmq: Option<String>,
    /// Amazon SQS: an SQS-compatible endpoint (http://host:port) or `aws` (the standard AWS configuration's).
    #[arg(long, conflicts_with = "pubsub")]
    pub sqs: Option<String>,
    /// Google Cloud Pub/Sub: the project (the emulator from PUBSUB_EMULATOR_HOST).
    #[arg(long)]
    pub pubsub: Option<String>,
}

/// What a command that publishes says when no broker flag names where.
pub const NO_BROKER: &str = "where to publish: give --log-dir DIR, --kafka BROKERS, --nats URL, --rabbitmq URL, --sqs \
     ENDPOINT or --pubsub PROJECT (each message goes back to the topic, subject or queue it came from)";

impl OptionalBrokerFlags {
    /// The broker the flags name, where a command needs one (`idem dead-letters replay`).
    pub fn required(self) -> anyhow::Result<BrokerTarget> {
        self.target()?.ok_or_else(|| anyhow::anyhow!(NO_BROKER))
    }

    /// The broker the flags name, if one; a broker this idem is built without is refused, naming its feature.
    pub fn target(self) -> anyhow::Result<Option<BrokerTarget>> {
        let target = self.named();
        if let Some(target) = &target {
            target.check_built()?;
        }
        Ok(target)
    }

    fn named(self) -> Option<BrokerTarget> {
        Some(match self {
            OptionalBrokerFlags { kafka: Some(brokers), .. } => BrokerTarget::Kafka(brokers),
            OptionalBrokerFlags { nats: Some(url), .. } => BrokerTarget::Nats(url),
            OptionalBrokerFlags { rabbitmq: Some(url), .. } => BrokerTarget::Rabbitmq(url),
            OptionalBrokerFlags { sqs: Some(endpoint), .. } => BrokerTarget::Sqs(endpoint),
            OptionalBrokerFlags { pubsub: Some(project), .. } => BrokerTarget::PubSub(project),
            OptionalBrokerFlags { log_dir: Some(dir), .. } => BrokerTarget::Log(dir),
            _ => return None,
        })
    }
}

/// The options of `idem prune`.
pub struct PruneOptions<'a> {
    /// Only this group's markers (plain layout only).
    pub group: Option<&'a str>,
    /// Batch size and pause.
    pub pruning: idem::Pruning,
    /// Count, delete nothing.
    pub dry_run: bool,
    /// JSON output.
    pub json: bool,
    /// Partitions to create ahead (partitioned layout).
    pub create_ahead: u32,
    /// Accept a retention below [`RETENTION_FLOOR`].
    pub force: bool,
    /// Discarded dead letters older than this leave the archive.
    pub archive_expiry: std::time::Duration,
    /// Who prunes, for the audit trail.
    pub actor: String,
}

/// The shortest archive expiry `idem prune` accepts without `--force`: the archive is the record of what was
/// discarded, by whom and why.
const ARCHIVE_EXPIRY_FLOOR: std::time::Duration = std::time::Duration::from_secs(86_400);

/// What a prune did to (or, dry, would do to) the dead-letter archive.
#[derive(Default)]
struct ArchivePrune {
    expired: i64,
    deleted: u64,
    /// Why the archive was not pruned, when it was not (the markers are pruned all the same).
    failed: Option<String>,
}

impl ArchivePrune {
    /// The report's fields for the archive.
    fn json(&self) -> serde_json::Value {
        serde_json::json!({ "expired": self.expired, "deleted": self.deleted, "error": self.failed })
    }
}

/// `idem prune`: batched deletes on the plain layout; whole partitions dropped (and new ones created ahead) on
/// the partitioned one.
pub async fn prune(args: &DbArgs, retention: &str, options: &PruneOptions<'_>) -> anyhow::Result<ExitCode> {
    let PruneOptions { group, dry_run, json, force, archive_expiry, ref actor, .. } = *options;
    let retention_text = retention.trim();
    let retention = idem::duration::parse(retention).map_err(|e| crate::flag_error("--retention", e))?;
    if retention < RETENTION_FLOOR && !force {
        bail!(
            "--retention {retention_text} is below one hour: markers would go while the broker can still redeliver \
             their events, and a redelivery after that is applied twice; keep markers longer than the broker's \
             retention (Kafka: retention.ms), or pass --force if you mean it"
        );
    }
    if archive_expiry < ARCHIVE_EXPIRY_FLOOR && !force {
        bail!(
            "--archive-expiry {} is below one day: the archive is the record of which dead letters were discarded, \
             by whom and why; keep it at least a day (default 30d), or pass --force if you mean it",
            exact_duration(archive_expiry)
        );
    }
    if options.pruning.batch_size == 0 {
        anyhow::bail!("--batch-size 0: use at least 1 (default 10000)");
    }
    let (db, tables) = Db::open_with(args, "processed_events").await?;
    let period = match &db {
        Db::Postgres(pool) => idem::store::partitions::stored_period(pool, &tables).await?,
        Db::Sqlite(_) | Db::Mysql(_) => None,
    };
    if period.is_some() && group.is_some() {
        bail!(
            "--group: the partitioned marker table holds every group's markers in each partition, so one group's \
             cannot be pruned alone; prune without --group, or give each group its own --table-prefix"
        );
    }
    let archive = prune_archive(&db, &tables, options).await;
    if let Some(failed) = &archive.failed {
        // The markers are pruned whatever becomes of the archive.
        eprintln!("warning: the dead-letter archive was not pruned: {failed} (run `idem migrate`)");
    } else if !json && dry_run {
        println!(
            "{} archived dead letter(s) discarded over {} ago would be deleted",
            archive.expired,
            exact_duration(archive_expiry)
        );
    } else if !json {
        println!(
            "deleted {} archived dead letter(s) discarded over {} ago",
            archive.deleted,
            exact_duration(archive_expiry)
        );
    }
    let subjects = format!(
        "markers older than {retention_text}{}; archived dead letters older than {} ({} deleted){}",
        group.map(|g| format!(" of group {g}")).unwrap_or_default(),
        exact_duration(archive_expiry),
        archive.deleted,
        if force { ", forced" } else { "" }
    );
    let pruned = prune_markers(&db, &tables, period, retention, retention_text, options, &archive).await;
    if !dry_run {
        let count = pruned.as_ref().map_or(0, |deleted| i64::try_from(*deleted).unwrap_or(i64::MAX));
        let outcome = match (&pruned, &archive.failed) {
            (Ok(_), None) => Ok(()),
            (Ok(_), Some(failed)) => Err(format!("the markers were pruned, the archive was not: {failed}")),
            (Err(e), _) => Err(format!("{e:#}")),
        };
        crate::audit::note(&db, &tables, actor, "prune", subjects, &outcome, count).await;
    }
    pruned?;
    Ok(ExitCode::SUCCESS)
}

/// Prunes (or, dry, counts) the dead-letter archive; an archive that cannot be pruned is reported, not fatal.
async fn prune_archive(db: &Db, tables: &Tables, options: &PruneOptions<'_>) -> ArchivePrune {
    let (group, expiry, batch) = (options.group, options.archive_expiry, options.pruning.batch_size);
    let counted = with_pool!(db, pool => idem::dead_letter::count_archive_expired(pool, tables, group, expiry).await);
    let expired = match counted {
        Ok(expired) => expired,
        Err(error) => return ArchivePrune { failed: Some(error.to_string()), ..ArchivePrune::default() },
    };
    if options.dry_run {
        return ArchivePrune { expired, ..ArchivePrune::default() };
    }
    match with_pool!(db, pool => idem::dead_letter::prune_archive(pool, tables, group, expiry, batch).await) {
        Ok(deleted) => ArchivePrune { expired, deleted, failed: None },
        Err(error) => ArchivePrune { expired, deleted: 0, failed: Some(error.to_string()) },
    }
}

/// Prunes (or, dry, counts) the markers and prints the report; how many markers went.
async fn prune_markers(
    db: &Db,
    tables: &Tables,
    period: Option<idem::PartitionPeriod>,
    retention: std::time::Duration,
    retention_text: &str,
    options: &PruneOptions<'_>,
    archive: &ArchivePrune,
) -> anyhow::Result<u64> {
    let PruneOptions { group, ref pruning, dry_run, json, create_ahead, .. } = *options;
    if let (Db::Postgres(pool), Some(period)) = (db, period) {
        let partitioned = Partitioned { period, retention, create_ahead: create_ahead.max(1), dry_run, json };
        return prune_partitions(pool, tables, &partitioned, archive).await;
    }
    let expired = with_pool!(db, pool => idem::prune::count_expired(pool, tables, group, retention).await?);
    if dry_run {
        if json {
            println!(
                "{}",
                serde_json::json!({ "dry_run": true, "layout": "plain", "expired": expired, "deleted": 0,
                    "archive": archive.json() })
            );
        } else {
            println!("{expired} marker(s) older than {retention_text} would be deleted");
        }
        return Ok(0);
    }
    let bar = indicatif::ProgressBar::new(u64::try_from(expired).unwrap_or(0));
    if json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} pruning {bar:40} {pos}/{len} markers {rate}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .with_key("rate", rate),
    );
    let report = with_pool!(db, pool => idem::prune::prune(pool, tables, group, retention, pruning, |done| bar.set_position(done)).await?);
    bar.finish_and_clear();
    if json {
        println!(
            "{}",
            serde_json::json!({
                "dry_run": false,
                "layout": "plain",
                "expired": expired,
                "deleted": report.deleted,
                "statements": report.statements,
                "longest_statement_ms": report.longest_statement.as_secs_f64() * 1000.0,
                "seconds": report.elapsed.as_secs_f64(),
                "archive": archive.json(),
            })
        );
    } else {
        println!(
            "deleted {} marker(s) in {} statement(s) over {:.1} s; longest statement {:.1} ms",
            report.deleted,
            report.statements,
            report.elapsed.as_secs_f64(),
            report.longest_statement.as_secs_f64() * 1000.0
        );
    }
    Ok(report.deleted)
}

/// What a prune of the partitioned layout does.
struct Partitioned {
    period: idem::PartitionPeriod,
    retention: std::time::Duration,
    create_ahead: u32,
    dry_run: bool,
    json: bool,
}

async fn prune_partitions(
    pool: &sqlx::PgPool,
    tables: &Tables,
    how: &Partitioned,
    archive: &ArchivePrune,
) -> anyhow::Result<u64> {
    use idem::store::partitions;
    let Partitioned { period, retention, create_ahead, dry_run, json } = *how;
    if dry_run {
        let expired = partitions::expired(pool, tables, retention).await?;
        if json {
            let markers: i64 = expired.iter().map(|p| p.markers).sum();
            println!(
                "{}",
                serde_json::json!({ "dry_run": true, "layout": "partitioned", "expired": markers, "deleted": 0,
                    "partitions_to_drop": expired, "archive": archive.json() })
            );
        } else if expired.is_empty() {
            println!("no partition is wholly older than the retention");
        } else {
            for p in &expired {
                println!("would drop {} ({} marker(s))", p.name, p.markers);
            }
        }
        return Ok(0);
    }
    let started = std::time::Instant::now();
    let report = partitions::maintain(pool, tables, period, create_ahead, Some(retention)).await?;
    if json {
        // The plain layout's shape (`dry_run`, `layout`, `expired`, `deleted`, …), with the partitions named.
        println!(
            "{}",
            serde_json::json!({
                "dry_run": false,
                "layout": "partitioned",
                "expired": report.markers_dropped,
                "deleted": report.markers_dropped,
                "partitions_dropped": report.dropped,
                "partitions_created": report.created,
                "seconds": started.elapsed().as_secs_f64(),
                "archive": archive.json(),
            })
        );
    } else {
        println!(
            "created {} partition(s); dropped {} partition(s) holding {} marker(s){}",
            report.created.len(),
            report.dropped.len(),
            report.markers_dropped,
            if report.dropped.is_empty() { String::new() } else { format!(": {}", report.dropped.join(", ")) }
        );
    }
    Ok(report.markers_dropped)
}

/// `idem markers layout`.
pub async fn markers_layout(args: &DbArgs, json: bool) -> anyhow::Result<ExitCode> {
    let tables = db::tables(args)?;
    let db = Db::open(&args.database_url, 1).await?;
    let table = tables.table("processed_events");
    let (period, partitions) = match &db {
        Db::Sqlite(_) | Db::Mysql(_) => (None, Vec::new()),
        Db::Postgres(pool) => match idem::store::partitions::stored_period(pool, &tables).await? {
            None => (None, Vec::new()),
            Some(period) => (Some(period), idem::store::partitions::list(pool, &tables).await?),
        },
    };
    if json {
        let partitions: Vec<_> = partitions
            .iter()
            .map(|(name, bound, markers)| serde_json::json!({ "name": name, "range": bound, "markers": markers }))
            .collect();
        let layout = if period.is_some() { "partitioned" } else { "plain" };
        println!(
            "{}",
            serde_json::json!({ "table": table, "layout": layout, "period": period.map(|p| p.as_str()),
                "partitions": partitions })
        );
        return Ok(ExitCode::SUCCESS);
    }
    match period {
        None if matches!(db, Db::Sqlite(_)) => println!("plain (SQLite has only the plain layout): {table}"),
        None if matches!(db, Db::Mysql(_)) => println!("plain (MySQL has only the plain layout): {table}"),
        None => println!("plain: {table}"),
        Some(period) => {
            println!("partitioned by {}: {table}", period.as_str());
            for (name, bound, markers) in &partitions {
                println!("  {name}  {bound}  {markers} marker(s)");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `idem markers convert`.
pub async fn markers_convert(args: &DbArgs, period: Option<&str>, create_ahead: u32) -> anyhow::Result<ExitCode> {
    let tables = db::tables(args)?;
    let db = Db::open(&args.database_url, 1).await?;
    let Db::Postgres(pool) = &db else {
        bail!("--database-url: partitioned markers need PostgreSQL; {} keeps the plain layout", db.name());
    };
    let target = period.map(idem::PartitionPeriod::parse).transpose()?;
    let copied = idem::store::partitions::convert(pool, &tables, target, create_ahead.max(1)).await?;
    let layout = target.map_or("plain".to_owned(), |p| format!("partitioned by {}", p.as_str()));
    println!("{} is {layout}; {copied} marker(s) copied", tables.table("processed_events"));
    Ok(ExitCode::SUCCESS)
}
