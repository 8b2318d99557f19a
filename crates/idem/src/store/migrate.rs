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
    i32: sqlx::Type<DB> + for<'q> sqlx::Encode<'q, DB>,
    i64: sqlx::Type<DB> + for<'q> sqlx::Encode<'q, DB>,
    for<'a> &'a str: sqlx::Type<DB> + sqlx::Encode<'a, DB>,
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
        sqlx::query(&format!("INSERT INTO {ledger} (version, name, checksum) VALUES ($1, $2, $3)"))
            .bind(m.version)
            .bind(m.name)
            .bind(m.checksum())
            .execute(&mut *tx)
            .await?;
    }
    Ok(MigrationReport { applied: todo.iter().map(|m| m.version).collect(), version: migrations.len() as i32 })
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
