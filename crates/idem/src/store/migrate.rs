//! Versioned migrations embedded in the binary.
//!
//! Each backend lists its migrations; applying them takes a database-wide lock first (PostgreSQL: an advisory
//! transaction lock; SQLite: `BEGIN IMMEDIATE`), records each version with a checksum in `{prefix}idem_migrations`,
//! and refuses a database whose applied migrations were edited or come from a newer idem.

use crate::error::Error;

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
