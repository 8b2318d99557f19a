//! `idem migrate`: apply idem's migrations, list them (`info`), or print them for another migration tool
//! (`--print-sql`).

use std::process::ExitCode;

use anyhow::bail;
use idem::Tables;
use idem::store::MigrationState;

use crate::db::{self, Db};
use crate::{DbArgs, with_pool};

/// What `idem migrate` does besides applying.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MigrateAction {
    /// List every migration with its state and checksums.
    Info,
}

/// `idem migrate`, `idem migrate info`, `idem migrate --print-sql`.
pub async fn migrate(
    args: &DbArgs,
    action: Option<MigrateAction>,
    print_sql: Option<i32>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let tables = db::tables(args)?;
    if let Some(after) = print_sql {
        let url = args.database_url.as_str();
        let script = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            idem::store::migration_script::<sqlx::Postgres>(&tables, after)?
        } else if url.starts_with("sqlite:") {
            idem::store::migration_script::<sqlx::Sqlite>(&tables, after)?
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            idem::store::migration_script::<sqlx::MySql>(&tables, after)?
        } else {
            bail!(
                "--database-url `{url}` is neither postgres://…, mysql://… nor sqlite://…: it names the SQL dialect to \
                 print"
            )
        };
        print!("{script}");
        return Ok(ExitCode::SUCCESS);
    }
    if action == Some(MigrateAction::Info) {
        return migrate_info(args, &tables, json).await;
    }
    let db = Db::create(&args.database_url, 1).await?;
    let report = with_pool!(&db, pool => idem::migrate(pool, &tables).await?);
    if report.applied.is_empty() {
        println!("schema is current (version {})", report.version);
    } else {
        println!("applied migrations {:?}; schema version {}", report.applied, report.version);
    }
    Ok(ExitCode::SUCCESS)
}

/// `idem migrate info`: reads only (a database never migrated lists every migration pending).
async fn migrate_info(args: &DbArgs, tables: &Tables, json: bool) -> anyhow::Result<ExitCode> {
    let db = Db::open(&args.database_url, 1).await?;
    let status = with_pool!(&db, pool => idem::store::migration_status(pool, tables).await?);
    let count = |state| status.iter().filter(|m| m.state == state).count();
    let (pending, changed, unknown) =
        (count(MigrationState::Pending), count(MigrationState::Changed), count(MigrationState::Unknown));
    if json {
        let body =
            serde_json::json!({ "migrations": status, "pending": pending, "changed": changed, "unknown": unknown });
        println!("{body}");
    } else {
        println!("{:>7}  {:<9}  {:>10}  {:>10}  name", "version", "state", "checksum", "in db");
        for m in &status {
            let state = match m.state {
                MigrationState::Applied => "applied",
                MigrationState::Pending => "pending",
                MigrationState::Changed => "CHANGED",
                MigrationState::Unknown => "UNKNOWN",
            };
            let recorded = m.applied_checksum.map_or("-".to_owned(), |c| c.to_string());
            println!("{:>7}  {state:<9}  {:>10}  {recorded:>10}  {}", m.version, m.checksum, m.name);
        }
        if changed + unknown > 0 {
            println!(
                "{changed} changed after they were applied, {unknown} from a newer idem: `idem migrate` refuses this \
                 database; restore the original migrations or upgrade idem"
            );
        } else if pending > 0 {
            println!("{pending} pending: `idem migrate` applies them");
        } else {
            println!("schema is current");
        }
    }
    // Pending migrations are work to do, not an error; a database idem would refuse is.
    Ok(if changed + unknown == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
