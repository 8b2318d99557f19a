//! Versioned migrations embedded in the binary.
//!
//! Each backend lists its migrations; applying them takes a database-wide lock first (PostgreSQL: an advisory
//! transaction lock; SQLite: `BEGIN IMMEDIATE`), records each version with a checksum in `{prefix}idem_migrations`,
//! and refuses a database whose applied migrations were edited or come from a newer idem.

use crate::error::Error;
use crate::store::Tables;

/// One embedded migration.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Version, starting at 1, without gaps.
    pub version: i32,
    /// Short name.
    pub name: &'static str,
    /// SQL template (`{t}`, `{p}`; see [`crate::store::Tables::render`]).
    pub sql: &'static str,
}

impl Migration {
    /// A checksum of the template, recorded when it is applied.
    pub fn checksum(&self) -> i64 {
        i64::from(crc32fast::hash(self.sql.as_bytes()))
    }
}

/// What a migration run did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MigrationReport {
    /// Versions applied by this run (empty when the schema was current).
    pub applied: Vec<i32>,
    /// The schema version after the run.
    pub version: i32,
}

/// Checks the already-applied versions against the embedded ones and returns the migrations still to apply.
pub(crate) fn pending(known: &'static [Migration], applied: &[(i32, i64)]) -> Result<Vec<Migration>, Error> {
    let newest = known.last().map_or(0, |m| m.version);
    for &(version, checksum) in applied {
        match known.iter().find(|m| m.version == version) {
            None => {
                return Err(Error::Schema(format!(
                    "the database has migration {version}, newer than this idem knows (up to {newest}): upgrade idem"
                )));
            }
            Some(m) if m.checksum() != checksum => {
                return Err(Error::Schema(format!(
                    "migration {version} ({}) was changed after it was applied; restore the original migration",
                    m.name
                )));
            }
            Some(_) => {}
        }
    }
    Ok(known.iter().filter(|m| !applied.iter().any(|&(v, _)| v == m.version)).copied().collect())
}

/// The advisory-lock key of a table set, so two services with different prefixes do not wait for each other.
pub(crate) fn lock_key(tables: &crate::store::Tables) -> i64 {
    i64::from(crc32fast::hash(format!("idem-migrate:{}", tables.render("{t}")).as_bytes()))
}

/// Splits a migration into its statements at semicolons that end a line (the migrations hold no procedural
/// code), dropping comment-only pieces.
pub(crate) fn split_statements(sql: &str) -> Vec<&str> {
    sql.split(";\n")
        .map(str::trim)
        .map(|s| s.trim_end_matches(';'))
        .filter(|s| s.lines().any(|l| !l.trim().is_empty() && !l.trim_start().starts_with("--")))
        .collect()
}

/// Applies the pending `migrations` in the open transaction `tx` (the caller holds its store's migration lock):
/// creates the ledger with `ledger_columns` if missing, checks what was applied against [`pending`], runs each
/// pending migration's statements and records it. Returns the report; the caller commits.
pub(crate) async fn apply<DB>(
    tx: &mut DB::Connection,
    tables: &Tables,
    migrations: &'static [Migration],
    ledger_columns: &str,
) -> Result<MigrationReport, Error>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    (i32, i64): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let ledger = tables.table("idem_migrations");
    sqlx::query(&format!("CREATE TABLE IF NOT EXISTS {ledger} ({ledger_columns})")).execute(&mut *tx).await?;
    let applied: Vec<(i32, i64)> =
        sqlx::query_as(&format!("SELECT version, checksum FROM {ledger}")).fetch_all(&mut *tx).await?;
    let todo = pending(migrations, &applied)?;
    for m in &todo {
        let sql = tables.render(m.sql);
        for statement in split_statements(&sql) {
            sqlx::query(statement).execute(&mut *tx).await?;
        }
        sqlx::query(&ledger_row(&ledger, m)).execute(&mut *tx).await?;
    }
    Ok(MigrationReport { applied: todo.iter().map(|m| m.version).collect(), version: migrations.len() as i32 })
}

/// The ledger's row for `m`, as a statement with its values written out (the same on every store).
fn ledger_row(ledger: &str, m: &Migration) -> String {
    format!(
        "INSERT INTO {ledger} (version, name, checksum) VALUES ({}, '{}', {})",
        m.version,
        m.name.replace('\'', "''"),
        m.checksum()
    )
}

/// Reads the ledger's `(version, checksum)` rows; none when the ledger does not exist (a database never migrated).
pub(crate) async fn applied<DB>(pool: &sqlx::Pool<DB>, tables: &Tables) -> Result<Vec<(i32, i64)>, Error>
where
    DB: crate::store::Store,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'q> String: sqlx::Type<DB> + sqlx::Encode<'q, DB>,
    (i32, i64): for<'r> sqlx::FromRow<'r, DB::Row>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let ledger = tables.table("idem_migrations");
    if !table_exists(pool, &ledger).await? {
        return Ok(Vec::new());
    }
    Ok(sqlx::query_as(&format!("SELECT version, checksum FROM {ledger} ORDER BY version")).fetch_all(pool).await?)
}

/// Whether the table `name` (as [`Tables::table`] names it) exists, asked of the store's catalog
/// ([`crate::store::Store::TABLE_EXISTS`]).
pub(crate) async fn table_exists<DB>(pool: &sqlx::Pool<DB>, name: &str) -> Result<bool, sqlx::Error>
where
    DB: crate::store::Store,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'q> String: sqlx::Type<DB> + sqlx::Encode<'q, DB>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let (found,): (i64,) = sqlx::query_as(DB::TABLE_EXISTS).bind(name.to_owned()).fetch_one(pool).await?;
    Ok(found > 0)
}

/// Where one migration stands in a database.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationState {
    /// Recorded in the ledger with the checksum this idem embeds.
    Applied,
    /// Not applied yet: `idem migrate` would apply it.
    Pending,
    /// Recorded with another checksum: the migration was edited after it was applied (`idem migrate` refuses).
    Changed,
    /// Recorded, but this idem does not know it: the database was migrated by a newer idem.
    Unknown,
}

/// One migration, as `idem migrate info` lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MigrationStatus {
    /// Its version.
    pub version: i32,
    /// Its name (empty for a version this idem does not know).
    pub name: &'static str,
    /// The checksum this idem embeds (0 for an unknown version).
    pub checksum: i64,
    /// The checksum recorded in the database, when it is applied.
    pub applied_checksum: Option<i64>,
    /// Where it stands.
    pub state: MigrationState,
}

/// Every migration of `DB` with its state in the database behind `pool`: applied, pending, changed after it was
/// applied, or unknown to this idem. Reads only: a database never migrated shows every migration pending.
pub async fn migration_status<DB: crate::store::Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
) -> Result<Vec<MigrationStatus>, Error> {
    let applied = DB::applied_migrations(pool, tables).await?;
    let mut status: Vec<MigrationStatus> = DB::migrations()
        .iter()
        .map(|m| {
            let recorded = applied.iter().find(|(v, _)| *v == m.version).map(|&(_, c)| c);
            let state = match recorded {
                None => MigrationState::Pending,
                Some(c) if c == m.checksum() => MigrationState::Applied,
                Some(_) => MigrationState::Changed,
            };
            MigrationStatus {
                version: m.version,
                name: m.name,
                checksum: m.checksum(),
                applied_checksum: recorded,
                state,
            }
        })
        .collect();
    for &(version, checksum) in &applied {
        if !DB::migrations().iter().any(|m| m.version == version) {
            status.push(MigrationStatus {
                version,
                name: "",
                checksum: 0,
                applied_checksum: Some(checksum),
                state: MigrationState::Unknown,
            });
        }
    }
    Ok(status)
}

/// The SQL of every migration of `DB` for `tables`, as one script for teams that apply migrations with their own
/// tool (Flyway, Liquibase, sqlx-cli): each migration's statements, then its row in the ledger, so that idem sees
/// it as applied and `idem migrate` later applies only what comes after. Only the migrations past version `after`
/// are included (0 for all; after an upgrade of idem, the last version applied). Run it in one transaction.
pub fn migration_script<DB: crate::store::Store>(tables: &Tables, after: i32) -> Result<String, Error> {
    let ledger = tables.table("idem_migrations");
    let apply = if <DB as crate::store::Store>::NAME == "mysql" {
        "Apply in order (MySQL commits each DDL statement by itself; every statement is safe to run again)"
    } else {
        "Apply in one transaction"
    };
    let mut out = format!(
        "-- idem's migrations for {} (tables {}), generated by `idem migrate --print-sql`.\n\
         -- {apply}; each migration records itself in {ledger}, which `idem migrate` and\n\
         -- `idem migrate info` read.\n\n",
        <DB as crate::store::Store>::NAME,
        tables.render("{t}*"),
    );
    if let Some(schema) = tables.schema() {
        if <DB as crate::store::Store>::NAME != "postgres" {
            return Err(Error::Config(format!(
                "schema `{schema}` is PostgreSQL-only; with {} use a table prefix",
                <DB as crate::store::Store>::NAME
            )));
        }
        out.push_str(&format!("CREATE SCHEMA IF NOT EXISTS {schema};\n\n"));
    }
    out.push_str(&format!("CREATE TABLE IF NOT EXISTS {ledger} ({});\n", DB::ledger_columns()));
    for m in DB::migrations().iter().filter(|m| m.version > after) {
        out.push_str(&format!("\n-- migration {}: {} (checksum {})\n", m.version, m.name, m.checksum()));
        for statement in split_statements(&tables.render(m.sql)) {
            out.push_str(statement);
            out.push_str(";\n");
        }
        out.push_str(&ledger_row(&ledger, m));
        out.push_str(";\n");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    static KNOWN: [Migration; 2] =
        [Migration { version: 1, name: "a", sql: "create a" }, Migration { version: 2, name: "b", sql: "create b" }];

    #[test]
    fn pending_skips_applied_and_refuses_surprises() {
        assert_eq!(pending(&KNOWN, &[]).unwrap().len(), 2);
        let applied = [(1, KNOWN[0].checksum())];
        assert_eq!(pending(&KNOWN, &applied).unwrap()[0].version, 2);
        assert!(pending(&KNOWN, &[(3, 0)]).unwrap_err().to_string().contains("upgrade idem"));
        assert!(pending(&KNOWN, &[(1, 7)]).unwrap_err().to_string().contains("was changed"));
    }
}
