//! Opening the database named by a URL: PostgreSQL or SQLite, chosen by its scheme.

use anyhow::{Context, bail};
use idem::Tables;

use crate::DbArgs;

/// An open pool of either backend.
pub enum Db {
    /// PostgreSQL.
    Postgres(sqlx::PgPool),
    /// SQLite.
    Sqlite(sqlx::SqlitePool),
}

impl Db {
    /// Opens `url` with a pool of `connections`.
    pub async fn open(url: &str, connections: u32) -> anyhow::Result<Db> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = idem::postgres::connect(url, connections)
                .await
                .with_context(|| format!("--database-url {}", redact(url)))?;
            Ok(Db::Postgres(pool))
        } else if url.starts_with("sqlite:") {
            Ok(Db::Sqlite(idem::sqlite::connect(url).await.with_context(|| format!("cannot open {url}"))?))
        } else {
            bail!("--database-url `{}` is neither postgres://… nor sqlite://…", redact(url))
        }
    }
}

impl Db {
    /// Runs SQL statements (no results).
    pub async fn execute(&self, sql: &str) -> anyhow::Result<()> {
        crate::with_pool!(self, pool => sqlx::raw_sql(sql).execute(pool).await.map(drop)?);
        Ok(())
    }

    /// Runs a query returning one integer.
    pub async fn scalar(&self, sql: &str) -> anyhow::Result<i64> {
        Ok(crate::with_pool!(self, pool => sqlx::query_scalar(sql).fetch_one(pool).await?))
    }
}

/// The table names of the arguments.
pub fn tables(args: &DbArgs) -> anyhow::Result<Tables> {
    Ok(Tables::new(args.schema.as_deref(), &args.table_prefix)?)
}

/// The URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &url[scheme + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// Runs `$body` with `$pool` bound to the open pool, whichever backend it is: the body is compiled once per
/// backend, so it can call generic library functions without naming the backend.
#[macro_export]
macro_rules! with_pool {
    ($db:expr, $pool:ident => $body:expr) => {
        match $db {
            $crate::db::Db::Postgres($pool) => $body,
            $crate::db::Db::Sqlite($pool) => $body,
        }
    };
}
