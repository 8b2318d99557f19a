//! Opening the database named by a URL: PostgreSQL, MySQL/MariaDB or SQLite, chosen by its scheme.

use anyhow::{Context, bail};
use idem::Tables;

use crate::DbArgs;

/// An open pool of either backend.
pub enum Db {
    /// PostgreSQL.
    Postgres(sqlx::PgPool),
    /// SQLite.
    Sqlite(sqlx::SqlitePool),
    /// MySQL or MariaDB.
    Mysql(sqlx::MySqlPool),
}

impl Db {
    /// Opens the existing database at `url` with a pool of `connections`; a SQLite file that does not exist is an
    /// error, never created.
    pub async fn open(url: &str, connections: u32) -> anyhow::Result<Db> {
        Self::connect(url, connections, false, "--database-url").await
    }

    /// [`Db::open`], the URL named as `what` says in messages (a configuration file's key).
    pub async fn open_as(url: &str, connections: u32, what: &str) -> anyhow::Result<Db> {
        Self::connect(url, connections, false, what).await
    }

    /// Opens `url`, creating a SQLite file that does not exist yet (`idem migrate`, the demo).
    pub async fn create(url: &str, connections: u32) -> anyhow::Result<Db> {
        Self::connect(url, connections, true, "--database-url").await
    }

    async fn connect(url: &str, connections: u32, create: bool, what: &str) -> anyhow::Result<Db> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool =
                idem::postgres::connect(url, connections).await.with_context(|| format!("{what} {}", redact(url)))?;
            Ok(Db::Postgres(pool))
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            let url = url.replacen("mariadb://", "mysql://", 1);
            let pool =
                idem::mysql::connect(&url, connections).await.with_context(|| format!("{what} {}", redact(&url)))?;
            Ok(Db::Mysql(pool))
        } else if url.starts_with("sqlite:") {
            let pool =
                if create { idem::sqlite::connect(url).await } else { idem::sqlite::connect_existing(url).await };
            Ok(Db::Sqlite(pool.with_context(|| format!("{what} {url}"))?))
        } else {
            bail!("{what} `{}` is neither postgres://…, mysql://… nor sqlite://…", redact(url))
        }
    }
}

impl Db {
    /// The store's name: `postgres`, `mysql` or `sqlite`.
    pub fn name(&self) -> &'static str {
        match self {
            Db::Postgres(_) => "postgres",
            Db::Sqlite(_) => "sqlite",
            Db::Mysql(_) => "mysql",
        }
    }

    /// Refuses a capability this store does not have, naming it, the stores that have it, and the fix.
    pub fn lacks(&self, capability: &str, stores: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "--database-url: {capability} needs {stores}; {} does not have it in this version of idem: point \
             --database-url at {stores}",
            self.name()
        )
    }

    /// `SUM(expr)` (0 over no rows) as a 64-bit integer in this store's SQL: PostgreSQL and MySQL sum integers as
    /// decimals, and spell the cast differently.
    pub fn integer_sum(&self, expr: &str) -> String {
        match self {
            Db::Mysql(_) => format!("CAST(COALESCE(SUM({expr}), 0) AS SIGNED)"),
            Db::Postgres(_) | Db::Sqlite(_) => format!("CAST(COALESCE(SUM({expr}), 0) AS BIGINT)"),
        }
    }

    /// Opens the existing database of `args` and checks that idem's table `table` is there (asked of the catalog),
    /// so that a command run against the wrong database or prefix says so instead of failing on its first query.
    pub async fn open_with(args: &DbArgs, table: &str) -> anyhow::Result<(Db, Tables)> {
        let tables = tables(args)?;
        let db = Db::open(&args.database_url, 1).await?;
        let exists = crate::with_pool!(&db, pool => idem::Operations::table_exists(pool, &tables, table).await?);
        if !exists {
            bail!(
                "{} is not in this database: run `idem migrate` with the same --database-url, or pass the \
                 --table-prefix (and --schema) the consumers were configured with",
                tables.table(table)
            );
        }
        Ok((db, tables))
    }

    /// Runs SQL statements (no results).
    pub async fn execute(&self, sql: &str) -> anyhow::Result<()> {
        crate::with_pool!(self, pool => sqlx::raw_sql(sql).execute(pool).await.map(drop)?);
        Ok(())
    }

    /// Runs a query returning one integer; again on a new connection while the failure is one it can fix
    /// ([`reconnecting`]).
    pub async fn scalar(&self, sql: &str) -> anyhow::Result<i64> {
        Ok(reconnecting(|| async { crate::with_pool!(self, pool => sqlx::query_scalar(sql).fetch_one(pool).await) })
            .await?)
    }
}

/// How many times [`reconnecting`] tries, and the delays between the tries (about 20 s in all).
const RECONNECTING_ATTEMPTS: u32 = 10;
const RECONNECTING_BACKOFF: idem::Backoff =
    idem::Backoff::new(std::time::Duration::from_millis(100), std::time::Duration::from_secs(4));

/// Runs `work` (a read, or work that can run again from its start) again while it fails in a way a new connection
/// can fix: a session terminated by an administrator, a refused connection, a restarting server, a deadlock. Each
/// retry is logged at WARN; after the last try, or on any other error, its error is returned.
pub async fn reconnecting<T, E: Transient + std::fmt::Display, F: std::future::Future<Output = Result<T, E>>>(
    mut work: impl FnMut() -> F,
) -> Result<T, E> {
    let mut failures = 0;
    loop {
        match work().await {
            Ok(value) => return Ok(value),
            Err(error) if failures + 1 < RECONNECTING_ATTEMPTS && error.transient() => {
                failures += 1;
                let delay = RECONNECTING_BACKOFF.after(failures);
                tracing::warn!(error = %error, attempt = failures, ?delay,
                    "the database failed for now; trying again on a new connection");
                tokio::time::sleep(delay).await;
            }
            Err(error) => return Err(error),
        }
    }
}

/// An error that says whether a new attempt, on a new connection, can get past it.
pub trait Transient {
    /// True for a database failure of the moment (see [`idem::error::classify`]).
    fn transient(&self) -> bool;
}

impl Transient for sqlx::Error {
    fn transient(&self) -> bool {
        idem::error::classify(self) == idem::error::Retry::Helps
    }
}

impl Transient for idem::Error {
    fn transient(&self) -> bool {
        matches!(self, idem::Error::Database(e) if e.transient())
    }
}

impl Transient for anyhow::Error {
    fn transient(&self) -> bool {
        self.chain().any(|cause| {
            cause.downcast_ref::<idem::Error>().is_some_and(Transient::transient)
                || cause.downcast_ref::<sqlx::Error>().is_some_and(Transient::transient)
        })
    }
}

/// The table names of the arguments.
pub fn tables(args: &DbArgs) -> anyhow::Result<Tables> {
    Ok(Tables::new(args.schema.as_deref(), &args.table_prefix)?)
}

/// The URL without its password, for messages.
pub fn redact(url: &str) -> String {
    idem::error::redact_url(url)
}

/// Runs `$body` with `$pool` bound to the open pool, whichever store it is: the body is compiled once per
/// store, so it can call generic library functions (those of [`idem::Backend`]) without naming the store.
#[macro_export]
macro_rules! with_pool {
    ($db:expr, $pool:ident => $body:expr) => {
        match $db {
            $crate::db::Db::Postgres($pool) => $body,
            $crate::db::Db::Sqlite($pool) => $body,
            $crate::db::Db::Mysql($pool) => $body,
        }
    };
}
