//! The `[database]` table: the URL (from the file or `IDEM_DATABASE_URL`), its password kept out of the file, the
//! dialect, idem's table names.

use super::{Problems, expanded};
use crate::service::file::{self, Problem};
use crate::service::sql::Dialect;
use idem::Tables;

/// The database, with its password (never printed: `shown` is what messages use).
pub struct DatabasePlan {
    /// The URL to connect with.
    pub url: String,
    /// The URL without its password.
    pub shown: String,
    /// Connections in the pool.
    pub connections: u32,
    /// idem's table names.
    pub tables: Tables,
    /// Run the migrations at start-up.
    pub migrate: bool,
    /// PostgreSQL or SQLite.
    pub dialect: Dialect,
}

impl std::fmt::Debug for DatabasePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabasePlan").field("url", &self.shown).field("connections", &self.connections).finish()
    }
}

/// Whether a URL written in the file holds a password of its own (not one from `${…}`).
pub(super) fn literal_password(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else { return false };
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    match authority.rsplit_once('@') {
        Some((userinfo, _)) => userinfo.split_once(':').is_some_and(|(_, password)| !password.contains("${")),
        None => false,
    }
}

/// The database's plan, or `None` after recording why there is none.
pub(super) fn plan(problems: &mut Problems<'_>, db: &file::Database) -> Option<DatabasePlan> {
    let key = "database.url";
    let from_env = std::env::var("IDEM_DATABASE_URL").ok();
    if from_env.is_none() && literal_password(db.url.get_ref()) {
        problems.at(
            &db.url,
            key,
            "holds a password: the file gets copied and printed; set `password_env` (or \
             `password_file`) and leave the password out of the URL, or pass the whole URL in IDEM_DATABASE_URL",
        );
        return None;
    }
    let (mut url, from_env) = match from_env {
        Some(url) => (url, true),
        None => (expanded(problems, &db.url, key)?, false),
    };
    let dialect = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Dialect::Postgres
    } else if url.starts_with("sqlite:") {
        Dialect::Sqlite
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        Dialect::Mysql
    } else {
        let message = format!(
            "`{}` is neither postgres://user@host:port/db, mysql://user@host:port/db nor sqlite://path.db",
            idem::error::redact_url(&url)
        );
        match from_env {
            true => problems.found.push(Problem { line: None, key: "environment IDEM_DATABASE_URL".into(), message }),
            false => problems.at(&db.url, key, message),
        }
        return None;
    };
    let password = match (&db.password_env, &db.password_file) {
        (Some(_), Some(_)) => {
            problems.at(&db.url, "database", "both password_env and password_file: keep one");
            return None;
        }
        (Some(var), None) => match std::env::var(var) {
            Ok(p) => Some(p),
            Err(_) => {
                problems.at(
                    &db.url,
                    "database.password_env",
                    format!("the environment variable {var} is not set: export it with the database password"),
                );
                return None;
            }
        },
        (None, Some(path)) => match std::fs::read_to_string(path) {
            Ok(p) => Some(p.trim_end_matches(['\n', '\r']).to_owned()),
            Err(e) => {
                problems.at(&db.url, "database.password_file", format!("cannot read `{path}`: {e}"));
                return None;
            }
        },
        (None, None) => None,
    };
    if let Some(password) = password {
        if dialect == Dialect::Sqlite {
            problems.at(&db.url, "database", "SQLite has no password: drop password_env / password_file");
            return None;
        }
        url = with_password(&url, &password);
    }
    let tables = match Tables::new(db.schema.as_deref(), &db.table_prefix) {
        Ok(t) => t,
        Err(e) => {
            problems.at(&db.url, "database.schema / table_prefix", e.to_string());
            return None;
        }
    };
    if db.connections == Some(0) {
        problems.at(&db.url, "database.connections", "0: use at least 2");
    }
    Some(DatabasePlan {
        shown: idem::error::redact_url(&url),
        url,
        connections: db.connections.unwrap_or(10),
        tables,
        migrate: db.migrate,
        dialect,
    })
}

/// `url` with `password` (percent-encoded) after its user name.
fn with_password(url: &str, password: &str) -> String {
    let encoded: String = password
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((user, host)) if !user.contains('/') => format!("{scheme}://{user}:{encoded}@{host}"),
            _ => url.to_owned(),
        },
        None => url.to_owned(),
    }
}
