//! `idem inbox`: inspect sequence instances and act on a stuck one (PostgreSQL).

use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Subcommand;
use idem::inbox::admin;

use crate::DbArgs;
use crate::db::{self, Db};

/// The `inbox` subcommands.
#[derive(Subcommand)]
pub enum InboxCommand {
    /// List sequence instances, oldest first, with their processed, waiting and failed messages.
    List {
        #[command(flatten)]
        db: DbArgs,
        /// Only this sequence.
        #[arg(long)]
        sequence: Option<String>,
        /// Only instances in this state.
        #[arg(long, value_parser = ["open", "closed"])]
        status: Option<String>,
        /// Only instances holding WAITING or FAILED messages.
        #[arg(long)]
        stuck: bool,
        /// At most this many.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
        limit: i64,
        /// Print one JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one instance and its messages, in arrival order: by id, or by --sequence and --context.
    Show {
        #[command(flatten)]
        db: DbArgs,
        #[command(flatten)]
        instance: InstanceArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Close an instance by hand; its WAITING messages stay, and are dead-lettered when it expires.
    Close {
        #[command(flatten)]
        db: DbArgs,
        #[command(flatten)]
        instance: InstanceArgs,
        #[command(flatten)]
        actor: crate::audit::Actor,
    },
    /// Release an instance's WAITING messages whatever their condition, and re-queue its FAILED ones: the
    /// running consumer handles them at its next housekeeping pass.
    Release {
        #[command(flatten)]
        db: DbArgs,
        #[command(flatten)]
        instance: InstanceArgs,
        /// Only this message (its id in `show`).
        #[arg(long)]
        message: Option<i64>,
        #[command(flatten)]
        actor: crate::audit::Actor,
    },
}

/// Which instance.
#[derive(clap::Args)]
pub struct InstanceArgs {
    /// The instance id (see `list`).
    #[arg(required_unless_present = "sequence")]
    id: Option<i64>,
    /// The sequence name, with --context instead of an id.
    #[arg(long, requires = "context", conflicts_with = "id")]
    sequence: Option<String>,
    /// The context id (an order id, a payment id), with --sequence.
    #[arg(long, requires = "sequence")]
    context: Option<String>,
}

/// Runs one `inbox` subcommand.
pub async fn run(command: InboxCommand) -> anyhow::Result<ExitCode> {
    match command {
        InboxCommand::List { db, sequence, status, stuck, limit, json } => {
            let (pool, tables) = open(&db).await?;
            let filter = admin::ListFilter { sequence, status: status.map(|s| s.to_uppercase()), stuck };
            let instances = admin::list(&pool, &tables, &filter, limit).await?;
            if json {
                println!("{}", serde_json::to_string(&instances)?);
            } else if instances.is_empty() {
                println!("no sequence instances");
            } else {
                println!(
                    "{:>8} {:<16} {:<24} {:<6} {:>9} {:>7} {:>6}  retain_until",
                    "id", "sequence", "context_id", "status", "processed", "waiting", "failed"
                );
                for i in &instances {
                    println!(
                        "{:>8} {:<16} {:<24} {:<6} {:>9} {:>7} {:>6}  {}",
                        i.id, i.sequence_name, i.context_id, i.status, i.processed, i.waiting, i.failed, i.retain_until
                    );
                }
            }
        }
        InboxCommand::Show { db, instance, json } => {
            let (pool, tables) = open(&db).await?;
            let id = resolve(&pool, &tables, &instance).await?;
            let (summary, messages) = existing(&pool, &tables, id).await?;
            if json {
                println!("{}", serde_json::json!({ "instance": summary, "messages": messages }));
            } else {
                println!(
                    "instance {} of `{}` for `{}`: {}, created {}, retained until {}",
                    summary.id,
                    summary.sequence_name,
                    summary.context_id,
                    summary.status,
                    summary.created_at,
                    summary.retain_until
                );
                for m in &messages {
                    let forced = if m.force_release { " (released by an operator)" } else { "" };
                    let error = m.error.as_deref().map(|e| format!(": {e}")).unwrap_or_default();
                    let handled = m.processed_at.as_deref().map(|at| format!(", handled {at}")).unwrap_or_default();
                    println!(
                        "  {:>8} {:<9} {:<28} {:<24} {}  arrived {}{handled}{forced}{error}",
                        m.id, m.status, m.message_type, m.idempotence_id, m.position, m.received_at
                    );
                }
            }
        }
        InboxCommand::Close { db, instance, actor } => {
            let (pool, tables) = open(&db).await?;
            let id = resolve(&pool, &tables, &instance).await?;
            let (summary, _) = existing(&pool, &tables, id).await?;
            if summary.waiting > 0 {
                eprintln!(
                    "warning: instance {id} holds {} WAITING message(s); closing does not handle them: they stay, and \
                     are dead-lettered when the instance expires (`idem inbox release {id}` handles them instead)",
                    summary.waiting
                );
            }
            let closed = admin::close(&pool, &tables, id).await.map_err(anyhow::Error::from);
            let audited = Db::Postgres(pool.clone());
            let count = i64::from(closed.as_ref().is_ok_and(|c| *c));
            crate::audit::note(
                &audited,
                &tables,
                &actor.name(),
                "inbox close",
                format!("instance {id}"),
                &closed,
                count,
            )
            .await;
            if closed? {
                println!("instance {id} closed");
            } else {
                println!("instance {id} was already closed");
            }
        }
        InboxCommand::Release { db, instance, message, actor } => {
            let (pool, tables) = open(&db).await?;
            let id = resolve(&pool, &tables, &instance).await?;
            let (_, messages) = existing(&pool, &tables, id).await?;
            if let Some(message) = message
                && !messages.iter().any(|m| m.id == message)
            {
                bail!("instance {id} has no message {message}; see `idem inbox show {id}`");
            }
            let released = admin::release(&pool, &tables, id, message).await.map_err(anyhow::Error::from);
            let subjects = match message {
                Some(m) => format!("instance {id}, message {m}"),
                None => format!("instance {id}"),
            };
            let count = released.as_ref().map_or(0, |n| i64::try_from(*n).unwrap_or(i64::MAX));
            let audited = Db::Postgres(pool.clone());
            crate::audit::note(&audited, &tables, &actor.name(), "inbox release", subjects, &released, count).await;
            let released = released?;
            println!(
                "{released} message(s) of instance {id} released; the running consumer handles them at its next \
                 housekeeping pass"
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn open(args: &DbArgs) -> anyhow::Result<(sqlx::PgPool, idem::Tables)> {
    let tables = db::tables(args)?;
    match Db::open(&args.database_url, 1).await? {
        Db::Postgres(pool) => Ok((pool, tables)),
        db @ (Db::Sqlite(_) | Db::Mysql(_)) => Err(db.lacks("the Sequential Inbox", "PostgreSQL")),
    }
}

/// The instance and its messages; not found is an error.
async fn existing(
    pool: &sqlx::PgPool,
    tables: &idem::Tables,
    id: i64,
) -> anyhow::Result<(admin::InstanceSummary, Vec<admin::StoredMessage>)> {
    admin::show(pool, tables, id).await?.with_context(|| format!("no sequence instance {id}; see `idem inbox list`"))
}

async fn resolve(pool: &sqlx::PgPool, tables: &idem::Tables, args: &InstanceArgs) -> anyhow::Result<i64> {
    match (&args.id, &args.sequence, &args.context) {
        (Some(id), _, _) => Ok(*id),
        (None, Some(sequence), Some(context)) => admin::find(pool, tables, sequence, context)
            .await?
            .with_context(|| format!("no instance of sequence `{sequence}` for context `{context}`")),
        _ => bail!("give an instance id, or --sequence and --context"),
    }
}
