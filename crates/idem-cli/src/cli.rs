//! The `idem` command line: its arguments, and the dispatch of each subcommand to one function of
//! [`crate::commands`], [`crate::demo`] or [`crate::service`].
//!
//! It lives in the library, not in the binary, so that the command's whole async call graph is compiled once,
//! here, in parallel codegen units: an `async fn` is compiled in the crate that polls it, and a binary that polled
//! the library's futures would compile them all again, alone, at the end of the build.

use std::process::ExitCode;

use crate::{
    DbArgs, audit, commands, console, dead_letters, demo, embedded_log, inbox, migrations, outbox, parked, service,
};
use clap::{Parser, Subcommand};

/// Exactly-once effects over at-least-once message delivery.
#[derive(Parser)]
#[command(name = "idem", version = crate::features::VERSION.as_str(), about, long_about = None)]
struct Cli {
    /// Log level: error, warn, info, debug or trace.
    #[arg(long, global = true, env = "IDEM_LOG", default_value = "warn")]
    log: String,
    /// Log format: `text` (human-readable) or `json` (one object per line).
    #[arg(long, global = true, env = "IDEM_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or upgrade idem's tables (processed_events, dead_letters, the outbox and, on PostgreSQL, the Sequential
    /// Inbox's); safe to run twice and concurrently. `idem migrate info` lists applied and pending migrations with
    /// their checksums; `--print-sql` prints the SQL for your own migration tool instead of applying it.
    Migrate {
        /// `info`: list every migration with its state (applied, pending, changed, unknown) and checksums.
        #[arg(value_enum)]
        action: Option<migrations::MigrateAction>,
        #[command(flatten)]
        db: DbArgs,
        /// Print the migrations as one SQL script (with their ledger rows) for Flyway, Liquibase or sqlx-cli,
        /// without connecting; the dialect follows --database-url's scheme. `--print-sql=N` prints only those
        /// after version N (the last one applied, after an upgrade of idem).
        #[arg(long, conflicts_with = "action", num_args = 0..=1, default_missing_value = "0", value_name = "AFTER")]
        print_sql: Option<i32>,
        /// With `info`: one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Run the consumers declared in a configuration file (effects as SQL, no code) until SIGINT or SIGTERM.
    Run(service::RunArgs),
    /// Check a configuration file without consuming: keys, parameters, and (against the database) every
    /// statement and guard; each problem with its line and the fix.
    Check(service::CheckArgs),
    /// Run the payments-ledger demo: produce events with duplicates, consume them while killing the consumer,
    /// and check the ledger to the cent.
    Demo(demo::DemoArgs),
    /// Hidden: one consumer process of the demo.
    #[command(hide = true)]
    DemoWorker(demo::WorkerArgs),
    /// Hidden: recreate the demo's tables.
    #[command(hide = true)]
    DemoPrepare {
        /// The database.
        #[arg(long)]
        database_url: String,
    },
    /// Hidden: write the demo's events into an embedded log (or a Kafka topic) and print the plan as JSON.
    #[command(hide = true)]
    DemoProduce(demo::ProduceArgs),
    /// Show marker rows, the oldest marker's age and dead letters, per consumer group.
    Stats {
        #[command(flatten)]
        db: DbArgs,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Dead-lettered messages: list them, group them by failure, replay them, discard them into the archive.
    #[command(subcommand)]
    DeadLetters(dead_letters::DeadLetterCommand),
    /// The operator console: a web page and a JSON API over failure groups, dead letters, parked messages and the
    /// audit trail, with users, roles and the same replay and discard as `dead-letters` (127.0.0.1:9500 by
    /// default). `idem console token NAME --role operator` makes a user.
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Console(console::ConsoleArgs),
    /// Messages parked for delayed retries: list them, make them due now, discard them into the dead letters.
    #[command(subcommand)]
    Parked(parked::ParkedCommand),
    /// The audit trail: every operator action (replay, discard, retry now, requeue, inbox release and close).
    #[command(subcommand)]
    Audit(audit::AuditCommand),
    /// Delete markers older than the retention, in bounded batches (one pass); --dry-run only counts them.
    Prune {
        #[command(flatten)]
        db: DbArgs,
        /// Keep markers this long: e.g. 8d, 36h, 1h30m, or ISO 8601 (P8D, PT36H). Keep it above how long the broker
        /// can redeliver; below one hour is refused without --force.
        #[arg(long)]
        retention: String,
        /// Accept a retention below one hour, or an archive expiry below one day.
        #[arg(long)]
        force: bool,
        /// Only this consumer group's markers (default: every group's).
        #[arg(long)]
        group: Option<String>,
        /// Rows per DELETE statement, at most.
        #[arg(long, default_value_t = 10_000)]
        batch_size: u32,
        /// How long one DELETE should take, in milliseconds: each statement's rows follow from the last one's
        /// speed (the first deletes at most 1,000). 0: every statement deletes --batch-size rows.
        #[arg(long, default_value_t = 100)]
        statement_target_ms: u64,
        /// Pause between statements, in milliseconds.
        #[arg(long, default_value_t = 200)]
        pause_ms: u64,
        /// Count what would be deleted, delete nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Partitioned layout: partitions to create ahead of the current one.
        #[arg(long, default_value_t = 7)]
        create_ahead: u32,
        /// Discarded dead letters (`idem dead-letters archived`) older than this are deleted too; below one day
        /// is refused without --force.
        #[arg(long, default_value = "30d", value_name = "DURATION")]
        archive_expiry: String,
        #[command(flatten)]
        actor: audit::Actor,
    },
    /// The marker table's layout: show it, or convert between plain and partitioned (PostgreSQL).
    #[command(subcommand)]
    Markers(MarkersCommand),
    /// The Sequential Inbox: list, show, close or release sequence instances (PostgreSQL).
    #[command(subcommand)]
    Inbox(inbox::InboxCommand),
    /// The embedded log: inspect it, move a consumer group past a damaged record, set a damaged tail aside.
    #[command(subcommand)]
    Log(embedded_log::LogCommand),
    /// Deliver the outbox's committed messages to a broker, in order per key, until stopped (SIGINT/SIGTERM).
    /// Run several: they share the work.
    Relay(outbox::RelayArgs),
    /// The outbox: list or count what waits, requeue dead-lettered messages.
    #[command(subcommand)]
    Outbox(outbox::OutboxCommand),
}

#[derive(Subcommand)]
enum MarkersCommand {
    /// Show the layout and, when partitioned, the partitions with their marker counts.
    Layout {
        #[command(flatten)]
        db: DbArgs,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Convert the marker table, keeping every marker, in one transaction. Stop the consumers first.
    Convert {
        #[command(flatten)]
        db: DbArgs,
        /// `partitioned` (range partitions by --period, dropped whole by pruning) or `plain`.
        #[arg(long, value_parser = ["partitioned", "plain"])]
        to: String,
        /// Partition span: `day` or `month` (with --to partitioned).
        #[arg(long, default_value = "day", value_parser = ["day", "month"])]
        period: String,
        /// Partitions to create ahead of the current one.
        #[arg(long, default_value_t = 7)]
        create_ahead: u32,
    },
}

/// What to do about an error whose fix the message alone does not say.
fn hint(error: &anyhow::Error) -> Option<&'static str> {
    let database = error.chain().find_map(|cause| match cause.downcast_ref::<idem::Error>() {
        Some(idem::Error::Database(e)) => Some(e),
        _ => cause.downcast_ref::<sqlx::Error>(),
    })?;
    let db = database.as_database_error()?;
    // By code: PostgreSQL's undefined_table, MySQL's 42S02 (1146). SQLite has no code of its own for it: the
    // commands ask the catalog before their first query (`Db::open_with`).
    let missing_table = matches!(db.code().as_deref(), Some("42P01" | "42S02"));
    missing_table.then_some(
        "idem's tables are not in this database under these names: run `idem migrate` with the same \
         --database-url, or pass the --table-prefix (and --schema) the consumers were configured with",
    )
}

/// Parses the command line, runs the command and returns the process's exit code.
pub fn main() -> ExitCode {
    // Output piped into `head` ends quietly, as other Unix tools do, instead of panicking on EPIPE.
    // SAFETY: setting a signal disposition to its default before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let json = cli.log_format == "json";
    let level = match cli.log.parse::<tracing::Level>() {
        Ok(level) => level,
        Err(_) => {
            let message = format!("--log `{}` is not a level: use error, warn, info, debug or trace", cli.log);
            crate::fatal(json, &message, None);
            return ExitCode::from(2);
        }
    };
    let tracing = match crate::logging::init(level, json) {
        Ok(tracing) => tracing,
        Err(e) => {
            crate::fatal(json, &format!("{e:#}"), None);
            return ExitCode::from(2);
        }
    };
    let code = crate::run_to_exit(
        async {
            match cli.command {
                Command::Migrate { action, db, print_sql, json } => {
                    migrations::migrate(&db, action, print_sql, json).await
                }
                Command::Run(args) => service::run(args).await,
                Command::Check(args) => service::check(args).await,
                Command::Demo(args) => demo::run(args).await,
                Command::DemoWorker(args) => demo::worker(args).await,
                Command::DemoPrepare { database_url } => demo::prepare_only(&database_url).await,
                Command::DemoProduce(args) => demo::produce(args).await,
                Command::Stats { db, json } => commands::stats(&db, json).await,
                Command::Prune {
                    db,
                    retention,
                    force,
                    group,
                    batch_size,
                    statement_target_ms,
                    pause_ms,
                    dry_run,
                    json,
                    create_ahead,
                    archive_expiry,
                    actor,
                } => {
                    let archive_expiry =
                        idem::duration::parse(&archive_expiry).map_err(|e| crate::flag_error("--archive-expiry", e))?;
                    let pruning = idem::Pruning {
                        batch_size,
                        statement_target: (statement_target_ms > 0)
                            .then(|| std::time::Duration::from_millis(statement_target_ms)),
                        pause: std::time::Duration::from_millis(pause_ms),
                        ..idem::Pruning::default()
                    };
                    let options = commands::PruneOptions {
                        group: group.as_deref(),
                        pruning,
                        dry_run,
                        json,
                        create_ahead,
                        force,
                        archive_expiry,
                        actor: actor.name(),
                    };
                    commands::prune(&db, &retention, &options).await
                }
                Command::Inbox(command) => inbox::run(command).await,
                Command::Log(command) => embedded_log::run(command).await,
                Command::Relay(args) => outbox::relay(args).await,
                Command::Outbox(command) => outbox::command(command).await,
                Command::Parked(command) => parked::run(command).await,
                Command::Audit(command) => audit::run(command).await,
                Command::Markers(MarkersCommand::Layout { db, json }) => commands::markers_layout(&db, json).await,
                Command::Markers(MarkersCommand::Convert { db, to, period, create_ahead }) => {
                    let period = (to == "partitioned").then_some(period);
                    commands::markers_convert(&db, period.as_deref(), create_ahead).await
                }
                Command::DeadLetters(command) => dead_letters::run(command).await,
                Command::Console(args) => console::run(args).await,
            }
        },
        hint,
        json,
    );
    tracing.shutdown();
    code
}
