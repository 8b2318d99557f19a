//! SQLite: the embedded default. Markers are claimed row by row (no round trips in-process); a database file is
//! opened in WAL mode with a busy timeout, so a second writer waits instead of failing.

mod guards;
mod outbox;

use sqlx::{Connection, Sqlite, SqliteConnection};

use crate::config::MarkerLayout;
use crate::error::Error;
use crate::message::Event;
use crate::store::{
    Claim, GroupStats, IntactCommit, Migration, MigrationReport, NewDeadLetter, Operations, Store, Tables,
    judge_existing, payload_digest,
};

static MIGRATIONS: [Migration; 10] = [
    Migration { version: 1, name: "processed_events", sql: include_str!("sql/0001_processed_events.sql") },
    Migration { version: 2, name: "dead_letters", sql: include_str!("sql/0002_dead_letters.sql") },
    Migration { version: 3, name: "payload_digest", sql: include_str!("sql/0003_payload_digest.sql") },
    Migration { version: 4, name: "outbox", sql: include_str!("sql/0004_outbox.sql") },
    Migration { version: 5, name: "parked_messages", sql: include_str!("sql/0005_parked_messages.sql") },
    Migration { version: 6, name: "audit_log", sql: include_str!("sql/0006_audit_log.sql") },
    Migration { version: 7, name: "dead_letter_archive", sql: include_str!("sql/0007_dead_letter_archive.sql") },
    Migration { version: 8, name: "replay_lease", sql: include_str!("sql/0008_replay_lease.sql") },
    Migration { version: 9, name: "failure_fingerprint", sql: include_str!("sql/0009_failure_fingerprint.sql") },
    Migration { version: 10, name: "http_responses", sql: include_str!("sql/0010_http_responses.sql") },
];

impl Store for Sqlite {
    const NAME: &'static str = "sqlite";
    const TABLE_EXISTS: &'static str = "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = $1";

    fn migrations() -> &'static [Migration] {
        &MIGRATIONS
    }

    fn ledger_columns() -> &'static str {
        "version INTEGER PRIMARY KEY, name TEXT NOT NULL, checksum INTEGER NOT NULL, \
         applied_at INTEGER NOT NULL DEFAULT (unixepoch())"
    }

    async fn migrate(pool: &sqlx::SqlitePool, tables: &Tables) -> Result<MigrationReport, Error> {
        if tables.schema().is_some() {
            return Err(Error::Config(
                "schema is PostgreSQL-only; with SQLite use table_prefix (e.g. `billing_`)".into(),
            ));
        }
        let mut conn = pool.acquire().await?;
        // BEGIN IMMEDIATE takes the write lock up front: a second migrating process waits here.
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        let report =
            crate::store::migrate::apply::<Sqlite>(&mut tx, tables, &MIGRATIONS, Self::ledger_columns()).await?;
        tx.commit().await?;
        Ok(report)
    }

    /// SQLite's transient primary codes (the low byte of an extended code): SQLITE_BUSY (5), SQLITE_LOCKED (6),
    /// SQLITE_IOERR (10), SQLITE_FULL (13, the disk is full), SQLITE_CANTOPEN (14). The database file is there
    /// again, or has room again, after an operator acts: an outage, retried without limit.
    fn transient(error: &dyn sqlx::error::DatabaseError) -> bool {
        error.code().is_some_and(|code| is_sqlite_busy(&code))
    }

    async fn claim(
        conn: &mut SqliteConnection,
        tables: &Tables,
        _layout: &MarkerLayout,
        group: &str,
        events: &[&Event],
    ) -> Result<Vec<Claim>, sqlx::Error> {
        let insert = tables.render(
            r#"INSERT INTO {t}processed_events (consumer_group, event_id, topic, partition, "offset", payload_digest)
               VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (consumer_group, event_id) DO NOTHING"#,
        );
        let lookup = tables.render(
            r#"SELECT payload_digest, topic, partition, "offset" FROM {t}processed_events
                WHERE consumer_group = $1 AND event_id = $2"#,
        );
        let mut claims = Vec::with_capacity(events.len());
        for e in events {
            let done = sqlx::query(&insert)
                .bind(group)
                .bind(&e.id)
                .bind(&e.message.topic)
                .bind(e.message.partition)
                .bind(e.message.offset)
                .bind(payload_digest(&e.message.payload))
                .execute(&mut *conn)
                .await?;
            if done.rows_affected() == 1 {
                claims.push(Claim::New);
                continue;
            }
            let stored: Option<(Option<Vec<u8>>, String, i32, i64)> =
                sqlx::query_as(&lookup).bind(group).bind(&e.id).fetch_optional(&mut *conn).await?;
            claims.push(match stored {
                Some((digest, topic, partition, offset)) => {
                    judge_existing(digest.as_deref(), format!("{topic}/{partition}/{offset}"), e)
                }
                None => Claim::Duplicate,
            });
        }
        Ok(claims)
    }

    /// idem's transactions begin with a savepoint of their own, which any end of the transaction removes: a
    /// handler that ran `ROLLBACK; BEGIN` (or `COMMIT; BEGIN`) through its connection leaves a transaction
    /// without it. (SQLite has no aborted-transaction state: a failed statement is undone alone, and `COMMIT`
    /// outside a transaction fails loudly.)
    fn begin_statement() -> Option<&'static str> {
        Some("BEGIN; SAVEPOINT idem_txn")
    }

    async fn transaction_intact(conn: &mut SqliteConnection, _idem_wrote: bool) -> Result<bool, sqlx::Error> {
        match sqlx::Executor::execute(conn, "RELEASE SAVEPOINT idem_txn; SAVEPOINT idem_txn").await {
            Ok(_) => Ok(true),
            Err(error) if no_such_savepoint(&error) => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// Releases idem's savepoint, then commits: a transaction that is no longer idem's fails the release and is
    /// rolled back, so what a handler wrote in a transaction of its own is never committed as the message's
    /// effect. (In-process, the two steps cost no round trip.)
    async fn commit_intact<'c>(mut tx: sqlx::Transaction<'c, Sqlite>, _idem_wrote: bool) -> IntactCommit<'c, Sqlite> {
        match sqlx::Executor::execute(&mut *tx, "RELEASE SAVEPOINT idem_txn").await {
            Ok(_) => {}
            Err(error) if no_such_savepoint(&error) => {
                let _ = tx.rollback().await;
                return IntactCommit::Ended;
            }
            Err(error) => return IntactCommit::CommitFailed(error),
        }
        match tx.commit().await {
            Ok(()) => IntactCommit::Committed(None),
            Err(error) => IntactCommit::CommitFailed(error),
        }
    }

    async fn dead_letter(
        conn: &mut SqliteConnection,
        tables: &Tables,
        group: &str,
        letter: &NewDeadLetter<'_>,
    ) -> Result<(), sqlx::Error> {
        crate::store::dead_letter_row::write::<Sqlite>(
            conn,
            tables,
            group,
            letter,
            "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
        )
        .await
    }
}

crate::store::audit::impl_audit!(Sqlite, crate::store::parking::Style::Sqlite);
crate::store::archive::impl_archive!(Sqlite, crate::store::parking::Style::Sqlite);
crate::store::parking::impl_parking!(Sqlite, crate::store::parking::Style::Sqlite, each);
crate::store::letter_pages::impl_letter_pages!(Sqlite, crate::store::parking::Style::Sqlite);
crate::store::responses::impl_stored_responses!(Sqlite, crate::store::parking::Style::Sqlite);

impl Operations for Sqlite {
    async fn stats(pool: &sqlx::SqlitePool, tables: &Tables, group: Option<&str>) -> Result<Vec<GroupStats>, Error> {
        let sql = tables.render(
            r#"WITH m AS (SELECT consumer_group, count(*) AS markers,
                                 (CAST(unixepoch('subsec') * 1000 AS INTEGER) - min(processed_at)) / 1000.0 AS oldest
                            FROM {t}processed_events WHERE $1 IS NULL OR consumer_group = $1 GROUP BY consumer_group),
                    d AS (SELECT consumer_group, count(*) AS dead, count(*) FILTER (WHERE error LIKE 'id_reused:%') AS reused
                            FROM {t}dead_letters WHERE $1 IS NULL OR consumer_group = $1 GROUP BY consumer_group),
                    g AS (SELECT consumer_group FROM m UNION SELECT consumer_group FROM d)
               SELECT g.consumer_group, coalesce(m.markers, 0), m.oldest, coalesce(d.dead, 0), coalesce(d.reused, 0)
                 FROM g LEFT JOIN m ON m.consumer_group = g.consumer_group
                        LEFT JOIN d ON d.consumer_group = g.consumer_group ORDER BY 1"#,
        );
        Ok(sqlx::query_as(&sql).bind(group).fetch_all(pool).await?)
    }

    async fn begin_replay(
        pool: &sqlx::SqlitePool,
        tables: &Tables,
        id: i64,
        force: bool,
        check_only: bool,
    ) -> Result<crate::store::ReplayStart, Error> {
        crate::store::replay::begin(pool, tables, crate::store::parking::Style::Sqlite, id, force, check_only).await
    }

    async fn prune_batch(
        pool: &sqlx::SqlitePool,
        tables: &Tables,
        group: Option<&str>,
        older_than: std::time::Duration,
        limit: u32,
        _from: Option<f64>,
    ) -> Result<(u64, Option<f64>), Error> {
        let sql = tables.render(
            r#"DELETE FROM {t}processed_events WHERE rowid IN (
                 SELECT rowid FROM {t}processed_events
                  WHERE processed_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - $1
                    AND ($2 IS NULL OR consumer_group = $2)
                  LIMIT $3)"#,
        );
        let millis = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let done = sqlx::query(&sql).bind(millis).bind(group).bind(i64::from(limit)).execute(pool).await?;
        Ok((done.rows_affected(), None))
    }

    async fn count_expired(
        pool: &sqlx::SqlitePool,
        tables: &Tables,
        group: Option<&str>,
        older_than: std::time::Duration,
    ) -> Result<i64, Error> {
        let sql = tables.render(
            "SELECT COUNT(*) FROM {t}processed_events WHERE processed_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - $1 \
             AND ($2 IS NULL OR consumer_group = $2)",
        );
        let millis = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        Ok(sqlx::query_scalar(&sql).bind(millis).bind(group).fetch_one(pool).await?)
    }

    async fn abandon_replay(pool: &sqlx::SqlitePool, tables: &Tables, id: i64) -> Result<(), Error> {
        crate::store::replay::abandon(pool, tables, crate::store::parking::Style::Sqlite, id).await
    }

    async fn finish_replay(pool: &sqlx::SqlitePool, tables: &Tables, id: i64) -> Result<(), Error> {
        crate::store::replay::finish(pool, tables, crate::store::parking::Style::Sqlite, id).await
    }

    async fn table_exists(pool: &sqlx::SqlitePool, tables: &Tables, name: &str) -> Result<bool, Error> {
        Ok(crate::store::migrate::table_exists(pool, &tables.table(name)).await?)
    }

    async fn applied_migrations(pool: &sqlx::SqlitePool, tables: &Tables) -> Result<Vec<(i32, i64)>, Error> {
        crate::store::migrate::applied::<Sqlite>(pool, tables).await
    }
}

/// Opens (creating if missing) a SQLite database for idem: WAL journal, `synchronous = FULL` (a committed
/// transaction survives a power cut, so the offset acknowledged after it never runs ahead), a 30 s busy timeout
/// so that concurrent writers wait instead of failing, and foreign keys on. `url` is `sqlite://path` or a path.
pub async fn connect(url: &str) -> Result<sqlx::SqlitePool, Error> {
    open(url, true).await
}

/// Like [`connect`], but an error naming the path when the database file does not exist: for tools that only read
/// or change an existing database, which must not leave an empty one behind a mistyped path.
pub async fn connect_existing(url: &str) -> Result<sqlx::SqlitePool, Error> {
    open(url, false).await
}

async fn open(url: &str, create: bool) -> Result<sqlx::SqlitePool, Error> {
    use std::str::FromStr;
    let url = if url.starts_with("sqlite:") { url.to_owned() } else { format!("sqlite://{url}") };
    let options = sqlx::sqlite::SqliteConnectOptions::from_str(&url)
        .map_err(|e| Error::Config(format!("database_url `{url}` is not a SQLite URL: {e}")))?;
    let path = options.get_filename().to_path_buf();
    if !create && path.as_os_str() != ":memory:" && !path.exists() {
        return Err(Error::Connect {
            target: format!("SQLite at {}", path.display()),
            reason: "no database file there: check --database-url (`idem migrate` creates one)".into(),
        });
    }
    let options = options
        .create_if_missing(create)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
        .busy_timeout(std::time::Duration::from_secs(30))
        .foreign_keys(true);
    Ok(sqlx::sqlite::SqlitePoolOptions::new().max_connections(4).connect_with(options).await?)
}

/// Whether releasing idem's savepoint failed because there is none: SQLITE_ERROR (1), the only result code the
/// `RELEASE` of a savepoint by its name has for "no such savepoint" (a busy or full database has its own codes).
fn no_such_savepoint(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db.code().is_some_and(|code| code.parse::<i32>().is_ok_and(|c| c & 0xff == 1)),
        _ => false,
    }
}

/// Whether a SQLite result code (extended or primary) is one of the transient ones of [`Store::transient`].
fn is_sqlite_busy(code: &str) -> bool {
    code.parse::<i32>().map(|c| matches!(c & 0xff, 5 | 6 | 10 | 13 | 14)).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_busy_codes() {
        assert!(is_sqlite_busy("5"));
        assert!(is_sqlite_busy("517")); // SQLITE_BUSY_SNAPSHOT
        assert!(is_sqlite_busy("6"));
        assert!(!is_sqlite_busy("2067")); // SQLITE_CONSTRAINT_UNIQUE
        assert!(!is_sqlite_busy("40001"));
    }
}
