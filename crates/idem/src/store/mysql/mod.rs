//! MySQL 8 and MariaDB 10.6+: every statement of this store, and how it reads the server's errors.
//!
//! How it differs from PostgreSQL, and why it still holds the guarantee:
//! * **Claiming markers.** MySQL has no `RETURNING` (MariaDB's only covers `INSERT`) and no `ON CONFLICT DO
//!   NOTHING` that says which rows it skipped. A batch's markers go in as one multi-row `INSERT`, in id order. When
//!   one of them is already there the statement fails with 1062 and InnoDB undoes that statement alone (the
//!   transaction goes on); the store then reads the existing markers with a locking read (`FOR UPDATE`, which
//!   waits for a concurrent transaction that holds one of them uncommitted) and inserts only the missing ones.
//!   A duplicate costs two more round trips; a new batch, one.
//! * **Isolation.** Transactions run at the session's level (InnoDB's default, `REPEATABLE READ`). Two
//!   transactions claiming the same new events can deadlock on InnoDB's gap and insert-intention locks; the
//!   server breaks the cycle (1213) and the engine retries the loser's whole transaction, as it does a
//!   PostgreSQL serialization failure. A lock wait timeout (1205) is retried the same way.
//! * **The intact check.** A deadlock or a handler's own `COMMIT` or `ROLLBACK` ends InnoDB's transaction, and
//!   later statements run in autocommit (or in a transaction the handler began). idem opens its transactions
//!   with `BEGIN; SAVEPOINT idem_txn` and commits with `RELEASE SAVEPOINT idem_txn; COMMIT` in one round trip:
//!   any end of idem's transaction removed the savepoint, the release fails (1305) and `COMMIT` is never sent.
//!   idem never acknowledges what did not commit with its marker.
//! * **Migrations.** MySQL commits each DDL statement on its own, so migrations are one `CREATE TABLE IF NOT
//!   EXISTS` each, applied under `GET_LOCK`; a migration interrupted by a crash is applied again whole.
//! * **Text** that identifies (event ids, groups, topics) compares byte for byte (`utf8mb4_bin`), as on
//!   PostgreSQL; sqlx reads such a column as binary, so every `SELECT` of one casts it to `CHAR`.
//! * **Times** are UTC `DATETIME(6)` written as `UTC_TIMESTAMP(6)`: no 2038 limit, no session time zone.
//! * **The outbox** ([`outbox`]): relays own slots with named locks (`GET_LOCK`), released by the server when a
//!   relay's session ends; relays poll (MySQL has no notifications).
//! * **Capabilities.** The partitioned marker layout and the Sequential Inbox need PostgreSQL; asking for them on
//!   MySQL is refused at start-up with the reason.

use sqlx::mysql::{MySql, MySqlConnection, MySqlDatabaseError};
use sqlx::{Connection, Executor};

use crate::config::MarkerLayout;
use crate::error::Error;
use crate::message::Event;
use crate::store::{
    Claim, GroupStats, IntactCommit, Migration, MigrationReport, NewDeadLetter, Operations, Store, Tables,
    encode_headers, judge_existing, payload_digest,
};

mod guards;
mod outbox;

static MIGRATIONS: [Migration; 9] = [
    Migration { version: 1, name: "processed_events", sql: include_str!("sql/0001_processed_events.sql") },
    Migration { version: 2, name: "dead_letters", sql: include_str!("sql/0002_dead_letters.sql") },
    Migration { version: 3, name: "outbox", sql: include_str!("sql/0003_outbox.sql") },
    Migration { version: 4, name: "parked_messages", sql: include_str!("sql/0004_parked_messages.sql") },
    Migration { version: 5, name: "audit_log", sql: include_str!("sql/0005_audit_log.sql") },
    Migration { version: 6, name: "dead_letter_archive", sql: include_str!("sql/0006_dead_letter_archive.sql") },
    Migration { version: 7, name: "replay_lease", sql: include_str!("sql/0007_replay_lease.sql") },
    Migration { version: 8, name: "failure_fingerprint", sql: include_str!("sql/0008_failure_fingerprint.sql") },
    Migration { version: 9, name: "http_responses", sql: include_str!("sql/0009_http_responses.sql") },
];

/// The oldest servers this store is written for and tested against: MySQL 8.0 and MariaDB 10.6 (recursive
/// common table expressions, generated columns in a unique key, `RELEASE_ALL_LOCKS`).
const MYSQL_MIN: (u32, u32) = (8, 0);
const MARIADB_MIN: (u32, u32) = (10, 6);

/// How many times the claim reads and inserts again when a concurrent transaction committed one of its markers
/// in between (only possible below `REPEATABLE READ`, where the locking read takes no gap locks).
const CLAIM_ROUNDS: usize = 8;

/// MySQL's error numbers idem reads.
mod code {
    /// `ER_DUP_ENTRY`: a unique key already holds the value.
    pub const DUPLICATE: u16 = 1062;
    /// `ER_SP_DOES_NOT_EXIST` for savepoints: idem's savepoint is gone with the transaction that held it.
    pub const NO_SAVEPOINT: u16 = 1305;
}

impl Store for MySql {
    const NAME: &'static str = "mysql";
    const TABLE_EXISTS: &'static str =
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?";

    fn migrations() -> &'static [Migration] {
        &MIGRATIONS
    }

    fn ledger_columns() -> &'static str {
        "version INT PRIMARY KEY, name VARCHAR(255) NOT NULL, checksum BIGINT NOT NULL, \
         applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)"
    }

    async fn migrate(pool: &sqlx::MySqlPool, tables: &Tables) -> Result<MigrationReport, Error> {
        if tables.schema().is_some() {
            return Err(Error::Config(
                "schema is PostgreSQL-only; with MySQL use table_prefix (e.g. `billing_`), or another database in \
                 the URL"
                    .into(),
            ));
        }
        let mut conn = pool.acquire().await?;
        // A named lock held by this session: a second migrating process waits here, and a crash releases it.
        let lock = format!("idem-migrate:{}", crate::store::migrate::lock_key(tables));
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 300)").bind(&lock).fetch_one(&mut *conn).await?;
        if got != Some(1) {
            return Err(Error::Schema(format!(
                "another process has held the migration lock `{lock}` for 5 minutes; is a migration stuck?"
            )));
        }
        let report =
            crate::store::migrate::apply::<MySql>(&mut conn, tables, &MIGRATIONS, Self::ledger_columns()).await;
        let _ = sqlx::query("SELECT RELEASE_LOCK(?)").bind(&lock).execute(&mut *conn).await;
        report
    }

    fn prepare_layout(
        _pool: &sqlx::MySqlPool,
        _tables: &Tables,
        layout: &MarkerLayout,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        let result = match layout {
            MarkerLayout::Plain => Ok(()),
            MarkerLayout::Partitioned(_) => Err(Error::Config(
                "layout: partitioned markers need PostgreSQL (its declarative partitions, dropped whole); on MySQL \
                 use the plain layout (the default), pruned in bounded batches"
                    .into(),
            )),
        };
        std::future::ready(result)
    }

    fn transient(error: &dyn sqlx::error::DatabaseError) -> bool {
        error.try_downcast_ref::<MySqlDatabaseError>().is_some_and(|e| is_transient(e.number()))
    }

    async fn claim(
        conn: &mut MySqlConnection,
        tables: &Tables,
        _layout: &MarkerLayout,
        group: &str,
        events: &[&Event],
    ) -> Result<Vec<Claim>, sqlx::Error> {
        // The first event of each id claims it; a later one in the same batch is its duplicate.
        let mut first_of: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for (i, e) in events.iter().enumerate() {
            first_of.entry(e.id.as_str()).or_insert(i);
        }
        let mut claimants: Vec<&Event> =
            events.iter().enumerate().filter(|(i, e)| first_of[e.id.as_str()] == *i).map(|(_, e)| *e).collect();
        claimants.sort_by(|a, b| a.id.cmp(&b.id));
        let mut stored = std::collections::HashMap::new();
        let mut rounds = 0;
        loop {
            match insert_markers(&mut *conn, tables, group, &claimants).await {
                Ok(()) => break,
                Err(error) if mysql_number(&error) == Some(code::DUPLICATE) && rounds < CLAIM_ROUNDS => {
                    rounds += 1;
                    // The statement was undone alone; read what is there (waiting for whoever holds it), and
                    // insert the rest.
                    for row in lock_existing(&mut *conn, tables, group, &claimants).await? {
                        stored.insert(row.0.clone(), row);
                    }
                    claimants.retain(|e| !stored.contains_key(&e.id));
                    if claimants.is_empty() {
                        break;
                    }
                }
                Err(error) => return Err(error),
            }
        }
        Ok(events
            .iter()
            .enumerate()
            .map(|(i, e)| {
                if first_of[e.id.as_str()] != i {
                    return Claim::Duplicate;
                }
                match stored.get(&e.id) {
                    None => Claim::New,
                    Some((_, digest, topic, partition, offset)) => {
                        judge_existing(digest.as_deref(), format!("{topic}/{partition}/{offset}"), e)
                    }
                }
            })
            .collect())
    }

    fn begin_statement() -> Option<&'static str> {
        Some("BEGIN; SAVEPOINT idem_txn")
    }

    async fn transaction_intact(conn: &mut MySqlConnection, _idem_wrote: bool) -> Result<bool, sqlx::Error> {
        match conn.execute("RELEASE SAVEPOINT idem_txn; SAVEPOINT idem_txn").await {
            Ok(_) => Ok(true),
            Err(error) if mysql_number(&error) == Some(code::NO_SAVEPOINT) => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// The check, `COMMIT` and the next transaction's `BEGIN` go out as one multi-statement query: the server
    /// stops at the first error, so a transaction that is no longer idem's (1305) never reaches `COMMIT`, which
    /// would otherwise succeed on nothing or on the handler's own transaction. The transaction handed back is the
    /// new, empty one (InnoDB takes no snapshot before its first read); dropping it rolls it back.
    async fn commit_intact<'c>(mut tx: sqlx::Transaction<'c, MySql>, _idem_wrote: bool) -> IntactCommit<'c, MySql> {
        let conn: &mut MySqlConnection = &mut tx;
        match conn.execute("RELEASE SAVEPOINT idem_txn; COMMIT; BEGIN; SAVEPOINT idem_txn").await {
            Ok(_) => IntactCommit::Committed(Some(tx)),
            Err(error) if mysql_number(&error) == Some(code::NO_SAVEPOINT) => IntactCommit::Ended,
            Err(error) => IntactCommit::CommitFailed(error),
        }
    }

    async fn dead_letter(
        conn: &mut MySqlConnection,
        tables: &Tables,
        group: &str,
        letter: &NewDeadLetter<'_>,
    ) -> Result<(), sqlx::Error> {
        let sql = tables.render(
            "INSERT INTO {t}dead_letters
               (consumer_group, event_id, topic, `partition`, `offset`, `key`, payload, headers, error, attempts,
                fingerprint, first_failed_at, last_failed_at)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))
             ON DUPLICATE KEY UPDATE
               topic = VALUES(topic), `partition` = VALUES(`partition`), `offset` = VALUES(`offset`),
               `key` = VALUES(`key`), payload = VALUES(payload), headers = VALUES(headers), error = VALUES(error),
               fingerprint = VALUES(fingerprint), attempts = attempts + VALUES(attempts), last_failed_at = UTC_TIMESTAMP(6), status = 'dead'",
        );
        let m = letter.message;
        sqlx::query(&sql)
            .bind(group)
            .bind(letter.event_id)
            .bind(m.topic.as_str())
            .bind(m.partition)
            .bind(m.offset)
            .bind(m.key.as_deref())
            .bind(m.payload.as_slice())
            .bind(encode_headers(&m.headers))
            .bind(letter.error)
            .bind(letter.attempts)
            .bind(crate::dead_letter::groups::fingerprint(group, None, letter.error))
            .execute(conn)
            .await?;
        Ok(())
    }
}

/// A stored marker as the reuse check reads it: event id, payload digest, topic, partition, offset.
type StoredMarker = (String, Option<Vec<u8>>, String, i32, i64);

/// Inserts the markers of `events` (distinct ids, in id order) in one statement.
async fn insert_markers(
    conn: &mut MySqlConnection,
    tables: &Tables,
    group: &str,
    events: &[&Event],
) -> Result<(), sqlx::Error> {
    let rows = vec!["(?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6))"; events.len()].join(", ");
    let sql = tables.render(&format!(
        "INSERT INTO {{t}}processed_events
           (consumer_group, event_id, topic, `partition`, `offset`, payload_digest, processed_at) VALUES {rows}"
    ));
    let mut query = sqlx::query(&sql);
    for e in events {
        query = query
            .bind(group)
            .bind(e.id.as_str())
            .bind(e.message.topic.as_str())
            .bind(e.message.partition)
            .bind(e.message.offset)
            .bind(payload_digest(&e.message.payload));
    }
    query.execute(conn).await?;
    Ok(())
}

/// Reads (and locks) the markers of `events` that exist, waiting for a transaction that holds one uncommitted.
async fn lock_existing(
    conn: &mut MySqlConnection,
    tables: &Tables,
    group: &str,
    events: &[&Event],
) -> Result<Vec<StoredMarker>, sqlx::Error> {
    let ids = vec!["?"; events.len()].join(", ");
    let sql = tables.render(&format!(
        "SELECT CAST(event_id AS CHAR), payload_digest, CAST(topic AS CHAR), `partition`, `offset`
           FROM {{t}}processed_events
          WHERE consumer_group = ? AND event_id IN ({ids}) ORDER BY event_id FOR UPDATE"
    ));
    let mut query = sqlx::query_as(&sql).bind(group);
    for e in events {
        query = query.bind(e.id.as_str());
    }
    query.fetch_all(conn).await
}

/// The MySQL error number of `error`, when the server reported it.
fn mysql_number(error: &sqlx::Error) -> Option<u16> {
    match error {
        sqlx::Error::Database(db) => db.try_downcast_ref::<MySqlDatabaseError>().map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// The transient error numbers: a retry can succeed once the server, a lock holder or an operator has acted.
/// 1205 lock wait timeout, 1213 deadlock, 1040 too many connections, 1053 server shutdown, 1317 query
/// interrupted (`KILL QUERY`), 1927 connection killed (MariaDB's `KILL CONNECTION`), 3572 `NOWAIT` lock, 4031
/// disconnected by the server for inactivity (MySQL 8).
fn is_transient(number: u16) -> bool {
    matches!(number, 1205 | 1213 | 1040 | 1053 | 1317 | 1927 | 3572 | 4031)
}

/// The fix for a MySQL error met while connecting, by its number; `None` when the number says nothing more than
/// the message.
pub(crate) fn connect_fix(error: &dyn sqlx::error::DatabaseError) -> Option<&'static str> {
    let number = error.try_downcast_ref::<MySqlDatabaseError>()?.number();
    Some(match number {
        1045 => "check the user and password in the URL",
        1044 | 1142 => {
            "the user lacks a grant on that database: GRANT SELECT, INSERT, UPDATE, DELETE, CREATE, INDEX, ALTER ON \
             <database>.* TO <user>"
        }
        1049 => "create the database (`CREATE DATABASE <name>`) or fix its name in the URL",
        1040 => "the server's connection limit (max_connections) is reached; close other clients or raise the limit",
        1129 => {
            "the server blocked this host after too many failed connections: `FLUSH HOSTS` (or mariadb-admin flush-hosts)"
        }
        1130 => "the server does not let this host connect: create the user for this host",
        _ => return None,
    })
}

crate::store::audit::impl_audit!(MySql, crate::store::parking::Style::MySql);
crate::store::archive::impl_archive!(MySql, crate::store::parking::Style::MySql);
crate::store::parking::impl_parking!(MySql, crate::store::parking::Style::MySql, each);
crate::store::letter_pages::impl_letter_pages!(MySql, crate::store::parking::Style::MySql);
crate::store::responses::impl_stored_responses!(MySql, crate::store::parking::Style::MySql);

impl Operations for MySql {
    async fn stats(pool: &sqlx::MySqlPool, tables: &Tables, group: Option<&str>) -> Result<Vec<GroupStats>, Error> {
        let sql = tables.render(
            "WITH m AS (SELECT consumer_group, COUNT(*) AS markers,
                               TIMESTAMPDIFF(MICROSECOND, MIN(processed_at), UTC_TIMESTAMP(6)) / 1e6 AS oldest
                          FROM {t}processed_events WHERE ? IS NULL OR consumer_group = ? GROUP BY consumer_group),
                  d AS (SELECT consumer_group, COUNT(*) AS dead,
                                CAST(SUM(error LIKE 'id_reused:%') AS SIGNED) AS reused FROM {t}dead_letters
                         WHERE ? IS NULL OR consumer_group = ? GROUP BY consumer_group),
                  g AS (SELECT consumer_group FROM m UNION SELECT consumer_group FROM d)
             SELECT CAST(g.consumer_group AS CHAR), COALESCE(m.markers, 0), m.oldest, COALESCE(d.dead, 0),
                    COALESCE(d.reused, 0)
               FROM g LEFT JOIN m ON m.consumer_group = g.consumer_group
                      LEFT JOIN d ON d.consumer_group = g.consumer_group ORDER BY 1",
        );
        Ok(sqlx::query_as(&sql).bind(group).bind(group).bind(group).bind(group).fetch_all(pool).await?)
    }

    async fn begin_replay(
        pool: &sqlx::MySqlPool,
        tables: &Tables,
        id: i64,
        force: bool,
        check_only: bool,
    ) -> Result<crate::store::ReplayStart, Error> {
        crate::store::replay::begin(pool, tables, crate::store::parking::Style::MySql, id, force, check_only).await
    }

    async fn prune_batch(
        pool: &sqlx::MySqlPool,
        tables: &Tables,
        group: Option<&str>,
        older_than: std::time::Duration,
        limit: u32,
        _from: Option<f64>,
    ) -> Result<(u64, Option<f64>), Error> {
        // A single-table DELETE takes a LIMIT; the range scan on processed_at locks only the old rows it removes
        // (and the gap next to them), far from the new markers at the other end of the index.
        let sql = tables.render(
            "DELETE FROM {t}processed_events
              WHERE processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND (? IS NULL OR consumer_group = ?)
              ORDER BY processed_at LIMIT ?",
        );
        let done = sqlx::query(&sql)
            .bind(micros(older_than))
            .bind(group)
            .bind(group)
            .bind(i64::from(limit))
            .execute(pool)
            .await?;
        Ok((done.rows_affected(), None))
    }

    async fn count_expired(
        pool: &sqlx::MySqlPool,
        tables: &Tables,
        group: Option<&str>,
        older_than: std::time::Duration,
    ) -> Result<i64, Error> {
        let sql = tables.render(
            "SELECT COUNT(*) FROM {t}processed_events
              WHERE processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND (? IS NULL OR consumer_group = ?)",
        );
        Ok(sqlx::query_scalar(&sql).bind(micros(older_than)).bind(group).bind(group).fetch_one(pool).await?)
    }

    async fn abandon_replay(pool: &sqlx::MySqlPool, tables: &Tables, id: i64) -> Result<(), Error> {
        crate::store::replay::abandon(pool, tables, crate::store::parking::Style::MySql, id).await
    }

    async fn finish_replay(pool: &sqlx::MySqlPool, tables: &Tables, id: i64) -> Result<(), Error> {
        crate::store::replay::finish(pool, tables, crate::store::parking::Style::MySql, id).await
    }

    async fn table_exists(pool: &sqlx::MySqlPool, tables: &Tables, name: &str) -> Result<bool, Error> {
        Ok(crate::store::migrate::table_exists(pool, &tables.table(name)).await?)
    }

    async fn applied_migrations(pool: &sqlx::MySqlPool, tables: &Tables) -> Result<Vec<(i32, i64)>, Error> {
        crate::store::migrate::applied::<MySql>(pool, tables).await
    }
}

/// A duration in whole microseconds, for `INTERVAL ? MICROSECOND`.
fn micros(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// Connects to MySQL or MariaDB with a pool of `max_connections` (at least one per partition consumed at once,
/// plus one for housekeeping). One connection is made first, so that an unreachable server, a refused login, a
/// missing grant or an unsupported version fails at once with the cause and the fix ([`Error::Connect`]).
pub async fn connect(url: &str, max_connections: u32) -> Result<sqlx::MySqlPool, Error> {
    use std::str::FromStr;
    let options = sqlx::mysql::MySqlConnectOptions::from_str(url)
        .map_err(|e| Error::Config(format!("database_url is not a MySQL URL (mysql://user:password@host/db): {e}")))?;
    let target = format!(
        "MySQL at {}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or("(no database)")
    );
    if options.get_database().is_none() {
        return Err(Error::Connect {
            target,
            reason: "the URL names no database: add one (mysql://user@host:3306/<database>)".into(),
        });
    }
    crate::store::connect::probe(&options, &target).await?;
    let mut conn = sqlx::ConnectOptions::connect(&options)
        .await
        .map_err(|e| Error::Connect { target: target.clone(), reason: crate::store::connect::explain(&e) })?;
    let version: String = sqlx::query_scalar("SELECT VERSION()").fetch_one(&mut conn).await?;
    let _ = conn.close().await;
    check_version(&version).map_err(|reason| Error::Connect { target, reason })?;
    Ok(sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(max_connections.max(1))
        .test_before_acquire(false)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .connect_lazy_with(options))
}

/// Refuses a server older than MySQL 8.0 or MariaDB 10.6, naming the version found and the one needed.
fn check_version(version: &str) -> Result<(), String> {
    let mariadb = version.to_ascii_lowercase().contains("mariadb");
    let mut parts = version.split(|c: char| !c.is_ascii_digit()).filter(|p| !p.is_empty());
    let major: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let minor: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let (name, needed) = if mariadb { ("MariaDB", MARIADB_MIN) } else { ("MySQL", MYSQL_MIN) };
    if (major, minor) < needed {
        return Err(format!(
            "the server runs {name} {version}; idem needs {name} {}.{} or newer: upgrade the server",
            needed.0, needed.1
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_below_the_minimum_are_refused_by_name() {
        assert!(check_version("10.11.19-MariaDB-0+deb12u1").is_ok());
        assert!(check_version("8.0.36").is_ok());
        assert!(check_version("9.1.0").is_ok());
        let old = check_version("10.5.2-MariaDB").unwrap_err();
        assert!(old.contains("MariaDB 10.6 or newer") && old.contains("10.5.2"), "{old}");
        assert!(check_version("5.7.44-log").unwrap_err().contains("MySQL 8.0 or newer"));
    }

    #[test]
    fn deadlocks_and_lock_timeouts_are_transient_a_duplicate_is_not() {
        assert!(is_transient(1213) && is_transient(1205) && is_transient(1927));
        assert!(!is_transient(code::DUPLICATE) && !is_transient(1406));
    }
}
