//! PostgreSQL: markers claimed for a whole batch with one `INSERT … SELECT FROM UNNEST … ON CONFLICT DO
//! NOTHING RETURNING`, one prepared statement whatever the batch size.

mod guards;
pub(crate) mod inbox;
mod outbox;
pub mod partitions;

use std::collections::HashSet;

use sqlx::{Connection, PgConnection, Postgres, Row};

use crate::config::MarkerLayout;
use crate::error::Error;
use crate::message::Event;
use crate::store::migrate::lock_key;
use crate::store::{
    Claim, GroupStats, IntactCommit, Migration, MigrationReport, NewDeadLetter, Operations, Store, Tables,
    judge_existing, payload_digest,
};

/// True when the transaction's time is within the window (seconds, parameter `$window`) of a boundary of the
/// partition period (parameter `$period`) on either side: the condition under which the partitioned claim takes
/// its lock, written once for both of its statements.
macro_rules! near_boundary {
    ($period:literal, $window:literal) => {
        concat!(
            "((now() AT TIME ZONE 'UTC') - date_trunc(",
            $period,
            ", now() AT TIME ZONE 'UTC') < make_interval(secs => ",
            $window,
            ") OR date_trunc(",
            $period,
            ", now() AT TIME ZONE 'UTC') + ('1 ' || ",
            $period,
            ")::interval - (now() AT TIME ZONE 'UTC') < make_interval(secs => ",
            $window,
            "))"
        )
    };
}

static MIGRATIONS: [Migration; 12] = [
    Migration { version: 1, name: "processed_events", sql: include_str!("sql/0001_processed_events.sql") },
    Migration { version: 2, name: "dead_letters", sql: include_str!("sql/0002_dead_letters.sql") },
    Migration { version: 3, name: "payload_digest", sql: include_str!("sql/0003_payload_digest.sql") },
    Migration { version: 4, name: "sequential_inbox", sql: include_str!("sql/0004_sequential_inbox.sql") },
    Migration { version: 5, name: "outbox", sql: include_str!("sql/0005_outbox.sql") },
    Migration { version: 6, name: "parked_messages", sql: include_str!("sql/0006_parked_messages.sql") },
    Migration { version: 7, name: "audit_log", sql: include_str!("sql/0007_audit_log.sql") },
    Migration { version: 8, name: "dead_letter_archive", sql: include_str!("sql/0008_dead_letter_archive.sql") },
    Migration { version: 9, name: "replay_lease", sql: include_str!("sql/0009_replay_lease.sql") },
    Migration { version: 10, name: "failure_fingerprint", sql: include_str!("sql/0010_failure_fingerprint.sql") },
    Migration { version: 11, name: "http_responses", sql: include_str!("sql/0011_http_responses.sql") },
    Migration { version: 12, name: "instance_version", sql: include_str!("sql/0012_instance_version.sql") },
];

/// A stored marker as the reuse check reads it: event id, payload digest, topic, partition, offset.
type StoredMarker = (String, Option<Vec<u8>>, String, i32, i64);

impl Store for Postgres {
    const NAME: &'static str = "postgres";
    const TABLE_EXISTS: &'static str = "SELECT CASE WHEN to_regclass($1) IS NULL THEN 0 ELSE 1 END::int8";

    fn migrations() -> &'static [Migration] {
        &MIGRATIONS
    }

    fn ledger_columns() -> &'static str {
        "version int PRIMARY KEY, name text NOT NULL, checksum bigint NOT NULL, \
         applied_at timestamptz NOT NULL DEFAULT now()"
    }

    async fn migrate(pool: &sqlx::PgPool, tables: &Tables) -> Result<MigrationReport, Error> {
        let mut conn = pool.acquire().await?;
        let mut tx = conn.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(lock_key(tables)).execute(&mut *tx).await?;
        if let Some(schema) = tables.schema() {
            let create = format!("CREATE SCHEMA IF NOT EXISTS {schema}");
            sqlx::query(&create).execute(&mut *tx).await?;
        }
        let report =
            crate::store::migrate::apply::<Postgres>(&mut tx, tables, &MIGRATIONS, Self::ledger_columns()).await?;
        tx.commit().await?;
        Ok(report)
    }

    async fn prepare_layout(pool: &sqlx::PgPool, tables: &Tables, layout: &MarkerLayout) -> Result<(), Error> {
        partitions::check_layout(pool, tables, layout).await?;
        if let MarkerLayout::Partitioned(p) = layout {
            partitions::create_ahead(pool, tables, p.period, p.create_ahead).await?;
        }
        Ok(())
    }

    async fn drop_expired_partitions(
        pool: &sqlx::PgPool,
        tables: &Tables,
        retention: std::time::Duration,
    ) -> Result<(Vec<String>, u64), Error> {
        partitions::drop_expired(pool, tables, retention).await
    }

    fn transient(error: &dyn sqlx::error::DatabaseError) -> bool {
        // serialization_failure, deadlock_detected, lock_not_available, admin/crash shutdown, cannot_connect_now,
        // too_many_connections, and the connection exceptions (class 08).
        let code = error.code();
        matches!(code.as_deref(), Some("40001" | "40P01" | "55P03" | "57P01" | "57P02" | "57P03" | "53300"))
            || code.is_some_and(|c| c.starts_with("08"))
    }

    async fn claim(
        conn: &mut PgConnection,
        tables: &Tables,
        layout: &MarkerLayout,
        group: &str,
        events: &[&Event],
    ) -> Result<Vec<Claim>, sqlx::Error> {
        let ids: Vec<&str> = events.iter().map(|e| e.id.as_str()).collect();
        let partitioning = match layout {
            MarkerLayout::Plain => None,
            MarkerLayout::Partitioned(p) => Some((p.period.as_str(), p.redelivery_window.as_secs_f64())),
        };
        let sql = match partitioning {
            // One event (batch size 1): a plain VALUES row costs the server less than unnesting arrays.
            None if events.len() == 1 => tables.render_once(
                r#"INSERT INTO {t}processed_events (consumer_group, event_id, topic, partition, "offset", payload_digest)
                   VALUES ($1, $2, $3, $4, $5, $6)
                   ON CONFLICT (consumer_group, event_id) DO NOTHING
                   RETURNING event_id, set_config('idem.claimed', '1', true)"#,
            ),
            None => tables.render_once(
                r#"INSERT INTO {t}processed_events (consumer_group, event_id, topic, partition, "offset", payload_digest)
                   SELECT $1, * FROM UNNEST($2::text[], $3::text[], $4::int[], $5::bigint[], $6::bytea[])
                   ON CONFLICT (consumer_group, event_id) DO NOTHING
                   RETURNING event_id, set_config('idem.claimed', '1', true)"#,
            ),
            Some(_) => {
                // The primary key catches duplicates within the current partition; the subquery looks into the
                // neighbouring partitions within the window: the one before, and the one after, where a delivery
                // that began after midnight but committed first can be. Each neighbour is named only when the window
                // reaches into it (else NULL), so away from a boundary run-time pruning leaves no partition to read.
                // It is a scalar subquery (`LIMIT 1`), not a `NOT EXISTS`: the planner cannot turn it into a join,
                // so each event is at most one probe of a neighbour's primary key. The `NOT EXISTS` it replaces
                // became a hash anti-join that read every marker of the current partition per claim (0.6 ms at
                // 3,000 markers, growing with them) wherever the partition's statistics said it was empty, as they
                // do for a partition filling up since its last `ANALYZE`. Near a boundary it claims nothing unless
                // the lock is held ($9): see below.
                tables.render_once(concat!(
                    r#"INSERT INTO {t}processed_events (consumer_group, event_id, topic, partition, "offset", payload_digest)
                       SELECT $1, u.* FROM UNNEST($2::text[], $3::text[], $4::int[], $5::bigint[], $6::bytea[])
                                          AS u(event_id, topic, partition, "offset", payload_digest)
                        WHERE ($9 OR NOT "#,
                    near_boundary!("$7", "$8"),
                    r#")
                          AND (SELECT true FROM {t}processed_events p
                                WHERE p.consumer_group = $1 AND p.event_id = u.event_id
                                  AND p.processed_on = ANY (ARRAY[
                                      NULLIF(date_trunc($7, (now() - make_interval(secs => $8)) AT TIME ZONE 'UTC')::date,
                                             date_trunc($7, now() AT TIME ZONE 'UTC')::date),
                                      NULLIF(date_trunc($7, (now() + make_interval(secs => $8)) AT TIME ZONE 'UTC')::date,
                                             date_trunc($7, now() AT TIME ZONE 'UTC')::date)])
                                  AND p.processed_at > now() - make_interval(secs => $8)
                                LIMIT 1) IS NULL
                       ON CONFLICT DO NOTHING
                       RETURNING event_id, set_config('idem.claimed', '1', true)"#,
                ))
            }
        };
        let topics: Vec<&str> = events.iter().map(|e| e.message.topic.as_str()).collect();
        let partitions: Vec<i32> = events.iter().map(|e| e.message.partition).collect();
        let offsets: Vec<i64> = events.iter().map(|e| e.message.offset).collect();
        let digests: Vec<Vec<u8>> = events.iter().map(|e| payload_digest(&e.message.payload)).collect();
        let rows = match partitioning {
            None if events.len() == 1 => {
                sqlx::query(&sql)
                    .bind(group)
                    .bind(ids[0])
                    .bind(topics[0])
                    .bind(partitions[0])
                    .bind(offsets[0])
                    .bind(&digests[0])
                    .fetch_all(&mut *conn)
                    .await?
            }
            None => {
                sqlx::query(&sql)
                    .bind(group)
                    .bind(&ids)
                    .bind(&topics)
                    .bind(&partitions)
                    .bind(&offsets)
                    .bind(&digests)
                    .fetch_all(&mut *conn)
                    .await?
            }
            Some((period, window)) => {
                // Near a partition boundary (within the redelivery window of either side), two deliveries of one
                // event could claim it in two partitions at once, neither seeing the other's uncommitted marker: a
                // transaction-scoped advisory lock per event id, taken in a fixed order, makes the second wait for
                // the first's outcome, and the claim must take its snapshot after that lock. So the claim claims
                // nothing near a boundary unless `locked`: away from one (most of the time) it is the only
                // statement; when it claims nothing (near a boundary, or every event a duplicate) the lock is
                // taken and the claim runs again. The transaction's `now()` decides "near" in both statements.
                let mut locked = false;
                loop {
                    let rows = sqlx::query(&sql)
                        .bind(group)
                        .bind(&ids)
                        .bind(&topics)
                        .bind(&partitions)
                        .bind(&offsets)
                        .bind(&digests)
                        .bind(period)
                        .bind(window)
                        .bind(locked)
                        .fetch_all(&mut *conn)
                        .await?;
                    if locked || !rows.is_empty() {
                        break rows;
                    }
                    lock_near_boundary(&mut *conn, group, &ids, period, window).await?;
                    locked = true;
                }
            }
        };
        let fresh: HashSet<String> = rows.iter().map(|r| r.try_get::<String, _>(0)).collect::<Result<_, _>>()?;
        if fresh.len() == events.len() {
            return Ok(vec![Claim::New; events.len()]);
        }
        // Duplicates (rare): compare their payloads with what the first delivery stored.
        let existing: Vec<&str> = ids.iter().copied().filter(|id| !fresh.contains(*id)).collect();
        let stored: Vec<StoredMarker> = sqlx::query_as(&tables.render(
            r#"SELECT event_id, payload_digest, topic, partition, "offset" FROM {t}processed_events
                WHERE consumer_group = $1 AND event_id = ANY($2) ORDER BY processed_at"#,
        ))
        .bind(group)
        .bind(&existing)
        .fetch_all(&mut *conn)
        .await?;
        let stored: std::collections::HashMap<&str, _> = stored.iter().map(|row| (row.0.as_str(), row)).collect();
        Ok(events
            .iter()
            .map(|e| {
                if fresh.contains(&e.id) {
                    return Claim::New;
                }
                match stored.get(e.id.as_str()) {
                    Some((_, digest, topic, partition, offset)) => {
                        judge_existing(digest.as_deref(), format!("{topic}/{partition}/{offset}"), e)
                    }
                    None => Claim::Duplicate,
                }
            })
            .collect())
    }

    async fn transaction_intact(conn: &mut PgConnection, idem_wrote: bool) -> Result<bool, sqlx::Error> {
        // A savepoint can only be taken in an open transaction block (25P01 once user code ended it with COMMIT or
        // ROLLBACK) that is not aborted (25P02); it holds when the transaction wrote nothing (the natural-key
        // mode's duplicate). Where idem wrote, the transaction must also still carry the claim's mark: one the
        // handler began after ending idem's does not, whatever it wrote.
        let rows = match sqlx::Executor::fetch_all(conn, INTACT).await {
            Ok(rows) => rows,
            Err(error) if sql_state(&error) == Some("25P01") => return Ok(false),
            Err(error) => return Err(error),
        };
        Ok(!idem_wrote || claimed_here(&rows))
    }

    /// The check, `COMMIT` and a `BEGIN` go out as one simple query: one round trip where a check and a
    /// `COMMIT` would take two, and the next transaction's `BEGIN` a third. PostgreSQL runs them in order and
    /// stops at the first error, so a transaction that is aborted (25P02) or no longer open (25P01 from the
    /// savepoint where idem wrote nothing; the missing mark where it did) fails the check and never reaches
    /// `COMMIT`; nor does one that lost the claim's mark (see [`CLAIMED_OR_FAIL`]), so a handler that ran
    /// `ROLLBACK; BEGIN` and wrote cannot commit its writes without idem's. sqlx still counts the
    /// transaction as open, which the trailing `BEGIN` makes true: the transaction handed back is that new, empty
    /// one (no snapshot is taken before its first statement). Dropping it queues a `ROLLBACK` that goes out with
    /// the connection's next message.
    async fn commit_intact<'c>(
        mut tx: sqlx::Transaction<'c, Postgres>,
        idem_wrote: bool,
    ) -> IntactCommit<'c, Postgres> {
        let conn: &mut PgConnection = &mut tx;
        let sql = if idem_wrote { CLAIMED_OR_FAIL } else { "SAVEPOINT idem_intact; COMMIT; BEGIN" };
        match sqlx::Executor::execute(conn, sql).await {
            Ok(_) => IntactCommit::Committed(Some(tx)),
            Err(error) if sql_state(&error) == Some("25P01") => IntactCommit::Ended,
            // The transaction is not the one idem claimed in: the check failed it, so what the handler wrote in
            // its own goes with it.
            Err(error) if sql_state(&error) == Some(DIVISION_BY_ZERO) => {
                let _ = tx.rollback().await;
                IntactCommit::Ended
            }
            Err(error) if sql_state(&error) == Some("25P02") => {
                let _ = tx.rollback().await;
                IntactCommit::Aborted(error)
            }
            Err(error) => IntactCommit::CommitFailed(error),
        }
    }

    async fn dead_letter(
        conn: &mut PgConnection,
        tables: &Tables,
        group: &str,
        letter: &NewDeadLetter<'_>,
    ) -> Result<(), sqlx::Error> {
        crate::store::dead_letter_row::write::<Postgres>(conn, tables, group, letter, "now()").await
    }
}

/// Takes and releases a savepoint (which fails outside a transaction block, 25P01, and in an aborted one, 25P02)
/// and reads the claim's mark.
const INTACT: &str =
    "SAVEPOINT idem_intact; RELEASE SAVEPOINT idem_intact; SELECT current_setting('idem.claimed', true)";

/// The mark a claim leaves in its transaction: every statement that claims (the markers' `INSERT`, the Sequential
/// Inbox's claim) sets the transaction-local setting `idem.claimed` to `'1'` when it claimed something. The
/// setting ends with the transaction that set it, so a transaction the handler began after ending idem's (with
/// `ROLLBACK; BEGIN`, or `COMMIT; BEGIN`) reads `''` or NULL there, whatever it wrote.
///
/// The check needs no savepoint before it: in an aborted transaction it fails with 25P02, and outside a
/// transaction block (the handler ran `COMMIT`) it runs in the query's own implicit transaction, where the mark is
/// missing, so it fails with [`DIVISION_BY_ZERO`] before the `COMMIT`. One statement fewer per commit.
const CLAIMED_OR_FAIL: &str =
    "SELECT 1 / (current_setting('idem.claimed', true) IS NOT DISTINCT FROM '1')::int; COMMIT; BEGIN";

/// What [`CLAIMED_OR_FAIL`] raises when the mark is missing, before `COMMIT` is reached.
const DIVISION_BY_ZERO: &str = "22012";

/// Whether the check's row says the transaction is the one idem claimed in.
fn claimed_here(rows: &[sqlx::postgres::PgRow]) -> bool {
    rows.first().and_then(|row| row.try_get::<Option<String>, _>(0).ok()).flatten().as_deref() == Some("1")
}

fn sql_state(error: &sqlx::Error) -> Option<&str> {
    match error {
        sqlx::Error::Database(db) => db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>().map(|e| e.code()),
        _ => None,
    }
}

crate::store::audit::impl_audit!(Postgres, crate::store::parking::Style::Postgres);
crate::store::archive::impl_archive!(Postgres, crate::store::parking::Style::Postgres);
crate::store::parking::impl_parking!(Postgres, crate::store::parking::Style::Postgres, array);
crate::store::letter_pages::impl_letter_pages!(Postgres, crate::store::parking::Style::Postgres);
crate::store::responses::impl_stored_responses!(Postgres, crate::store::parking::Style::Postgres);

impl Operations for Postgres {
    async fn stats(pool: &sqlx::PgPool, tables: &Tables, group: Option<&str>) -> Result<Vec<GroupStats>, Error> {
        let sql = tables.render(
            r#"WITH m AS (SELECT consumer_group, count(*) AS markers,
                                 EXTRACT(EPOCH FROM now() - min(processed_at))::float8 AS oldest
                            FROM {t}processed_events WHERE $1::text IS NULL OR consumer_group = $1 GROUP BY consumer_group),
                    d AS (SELECT consumer_group, count(*) AS dead, count(*) FILTER (WHERE error LIKE 'id_reused:%') AS reused
                            FROM {t}dead_letters WHERE $1::text IS NULL OR consumer_group = $1 GROUP BY consumer_group)
               SELECT coalesce(m.consumer_group, d.consumer_group), coalesce(m.markers, 0), m.oldest, coalesce(d.dead, 0),
                      coalesce(d.reused, 0)
                 FROM m FULL JOIN d ON m.consumer_group = d.consumer_group ORDER BY 1"#,
        );
        Ok(sqlx::query_as(&sql).bind(group).fetch_all(pool).await?)
    }

    async fn begin_replay(
        pool: &sqlx::PgPool,
        tables: &Tables,
        id: i64,
        force: bool,
        check_only: bool,
    ) -> Result<crate::store::ReplayStart, Error> {
        crate::store::replay::begin(pool, tables, crate::store::parking::Style::Postgres, id, force, check_only).await
    }

    async fn prune_batch(
        pool: &sqlx::PgPool,
        tables: &Tables,
        group: Option<&str>,
        older_than: std::time::Duration,
        limit: u32,
        from: Option<f64>,
    ) -> Result<(u64, Option<f64>), Error> {
        // Oldest first, from where the last statement stopped (`-infinity` at first): a range of the processed_at
        // index, so the entries of rows deleted before are not walked again.
        let sql = tables.render_once(
            r#"WITH gone AS (
                 DELETE FROM {t}processed_events WHERE ctid IN (
                   SELECT ctid FROM {t}processed_events
                    WHERE processed_at >= to_timestamp($4) AND processed_at < now() - make_interval(secs => $1)
                      AND ($2::text IS NULL OR consumer_group = $2)
                    ORDER BY processed_at
                    LIMIT $3)
                 RETURNING processed_at)
               SELECT count(*), extract(epoch FROM max(processed_at))::float8 FROM gone"#,
        );
        let (deleted, reached): (i64, Option<f64>) = sqlx::query_as(&sql)
            .bind(older_than.as_secs_f64())
            .bind(group)
            .bind(i64::from(limit))
            .bind(from.unwrap_or(f64::NEG_INFINITY))
            .fetch_one(pool)
            .await?;
        Ok((u64::try_from(deleted).unwrap_or(0), reached))
    }

    async fn count_expired(
        pool: &sqlx::PgPool,
        tables: &Tables,
        group: Option<&str>,
        older_than: std::time::Duration,
    ) -> Result<i64, Error> {
        let sql = tables.render(
            "SELECT COUNT(*) FROM {t}processed_events WHERE processed_at < now() - make_interval(secs => $1) \
             AND ($2::text IS NULL OR consumer_group = $2)",
        );
        Ok(sqlx::query_scalar(&sql).bind(older_than.as_secs_f64()).bind(group).fetch_one(pool).await?)
    }

    async fn abandon_replay(pool: &sqlx::PgPool, tables: &Tables, id: i64) -> Result<(), Error> {
        crate::store::replay::abandon(pool, tables, crate::store::parking::Style::Postgres, id).await
    }

    async fn finish_replay(pool: &sqlx::PgPool, tables: &Tables, id: i64) -> Result<(), Error> {
        crate::store::replay::finish(pool, tables, crate::store::parking::Style::Postgres, id).await
    }

    async fn table_exists(pool: &sqlx::PgPool, tables: &Tables, name: &str) -> Result<bool, Error> {
        Ok(crate::store::migrate::table_exists(pool, &tables.table(name)).await?)
    }

    async fn applied_migrations(pool: &sqlx::PgPool, tables: &Tables) -> Result<Vec<(i32, i64)>, Error> {
        crate::store::migrate::applied::<Postgres>(pool, tables).await
    }
}

/// Takes the advisory lock of each event id, in hash order, when the transaction's time is within `window` of a
/// partition boundary (else nothing).
async fn lock_near_boundary(
    conn: &mut PgConnection,
    group: &str,
    ids: &[&str],
    period: &str,
    window: f64,
) -> Result<(), sqlx::Error> {
    sqlx::query(concat!(
        r#"SELECT pg_advisory_xact_lock(1768187245, k.h)
             FROM (SELECT DISTINCT hashtext($1 || chr(31) || id) AS h FROM UNNEST($2::text[]) AS id ORDER BY 1) k
            WHERE "#,
        near_boundary!("$3", "$4"),
    ))
    .bind(group)
    .bind(ids)
    .bind(period)
    .bind(window)
    .execute(conn)
    .await?;
    Ok(())
}

/// Connects to PostgreSQL with a pool of `max_connections` (at least one per partition consumed at once, plus
/// one for housekeeping). Connections are not pinged before each use (a round trip per transaction): a broken
/// one fails its first statement, and the engine retries the batch on a fresh one.
///
/// One connection is made first, so that an unreachable server fails at once with the cause and the fix
/// ([`Error::Connect`]: refused, unknown host, authentication, a missing database) instead of a pool time-out.
pub async fn connect(url: &str, max_connections: u32) -> Result<sqlx::PgPool, Error> {
    use std::str::FromStr;
    let options = sqlx::postgres::PgConnectOptions::from_str(url)
        .map_err(|e| Error::Config(format!("database_url is not a PostgreSQL URL: {e}")))?;
    let target = format!(
        "PostgreSQL at {}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or(options.get_username())
    );
    crate::store::connect::probe(&options, &target).await?;
    Ok(sqlx::postgres::PgPoolOptions::new()
        .max_connections(max_connections.max(1))
        .test_before_acquire(false)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .connect_lazy_with(options))
}
