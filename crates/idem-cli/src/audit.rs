//! `idem audit list`, and the entry every operator command appends to the audit trail (see `idem::audit`).

use std::process::ExitCode;

use clap::Subcommand;
use idem::Tables;
use idem::audit::AuditEntry;

use crate::DbArgs;
use crate::db::Db;
use crate::with_pool;

/// Who acts: `--as NAME`, else the operating-system user.
#[derive(clap::Args, Debug, Default)]
pub struct Actor {
    /// Who acts, for the audit trail (default: the operating-system user).
    #[arg(long = "as", value_name = "NAME")]
    pub by: Option<String>,
}

impl Actor {
    /// The name written in the audit trail.
    pub fn name(&self) -> String {
        self.by.clone().filter(|b| !b.trim().is_empty()).unwrap_or_else(idem::audit::os_user)
    }
}

/// Appends an operator action to the audit trail, after it ran: `outcome` is what the command returns. A trail that
/// cannot be written is reported on stderr; the action's own result stands.
pub async fn note<T, E: std::fmt::Display>(
    db: &Db,
    tables: &Tables,
    actor: &str,
    action: &str,
    subjects: String,
    outcome: &Result<T, E>,
    count: i64,
) {
    let outcome = match outcome {
        Ok(_) => "ok".to_owned(),
        Err(error) => format!("failed: {error:#}"),
    };
    let entry = AuditEntry::now(actor, action, subjects, count, outcome);
    let written = with_pool!(db, pool => idem::audit::record(pool, tables, &entry).await);
    if let Err(error) = written {
        eprintln!(
            "warning: `{action}` ran, but the audit trail could not record it: {error} (run `idem migrate` to create \
             {})",
            tables.table("audit_log")
        );
    }
}

/// Text as a terminal may print it: a control character (a line break, an escape) written as its escape, so an
/// entry cannot forge another line or move the cursor.
fn printable(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

/// `idem audit …`.
#[derive(Subcommand, Debug)]
pub enum AuditCommand {
    /// The operator actions, newest first: when, who, what, which messages, how many, how it ended.
    List {
        #[command(flatten)]
        db: DbArgs,
        /// At most this many.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
        limit: i64,
        /// Only this actor's entries.
        #[arg(long)]
        actor: Option<String>,
        /// Only this action's (`--action "dead-letters replay"`).
        #[arg(long)]
        action: Option<String>,
        /// Only entries older than this id (to page back through the trail).
        #[arg(long)]
        before: Option<i64>,
        /// Print one JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// Runs an `idem audit` command.
pub async fn run(command: AuditCommand) -> anyhow::Result<ExitCode> {
    let AuditCommand::List { db, limit, actor, action, before, json } = command;
    let (pool, tables) = Db::open_with(&db, "audit_log").await?;
    let query = idem::audit::AuditQuery { actor: actor.as_deref(), action: action.as_deref(), before_id: before };
    let entries = with_pool!(&pool, pool => idem::audit::query(pool, &tables, &query, limit).await?);
    if json {
        let rows: Vec<serde_json::Value> = entries
            .iter()
            .map(|e| {
                serde_json::json!({
                    "id": e.id, "at": idem::store::rfc3339_from_ms(e.at_ms), "actor": e.actor, "action": e.action,
                    "subjects": e.subjects, "count": e.count, "outcome": e.outcome,
                })
            })
            .collect();
        println!("{}", serde_json::to_string(&rows)?);
    } else if entries.is_empty() {
        println!("no operator actions recorded");
    } else {
        // Columns as wide as their widest value; a failure's text on a line of its own under its entry.
        let width = |column: fn(&AuditEntry) -> &str, title: &str| {
            entries.iter().map(|e| column(e).chars().count()).max().unwrap_or(0).max(title.len())
        };
        let (actor, action) = (width(|e| &e.actor, "actor"), width(|e| &e.action, "action"));
        println!(
            "{:>6}  {:<24}  {:<actor$}  {:<action$}  {:>6}  {:<7} subjects",
            "id", "at", "actor", "action", "count", "outcome"
        );
        for e in &entries {
            let ok = e.outcome.starts_with("ok");
            println!(
                "{:>6}  {:<24}  {:<actor$}  {:<action$}  {:>6}  {:<7} {}",
                e.id,
                idem::store::rfc3339_from_ms(e.at_ms),
                printable(&e.actor),
                e.action,
                e.count,
                if ok { "ok" } else { "failed" },
                printable(&e.subjects)
            );
            if !ok {
                println!("{:>8}{}", "", printable(e.outcome.strip_prefix("failed: ").unwrap_or(&e.outcome)));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
