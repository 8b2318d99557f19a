//! The outbox seam and its SQL on PostgreSQL and SQLite (MySQL's is in its wing, `store::mysql::outbox`):
//! enqueue, the relay's ownership of slots (PostgreSQL: advisory locks; MySQL: named locks; SQLite: a lease),
//! reading and settling what a relay delivered, and the operator's figures.

use std::future::Future;
use std::time::Duration;

use sqlx::{PgConnection, Postgres, Row, Sqlite, SqliteConnection};

use super::{OutboxMessage, OutgoingMessage, SLOTS};
use crate::error::Error;
use crate::store::{Backend, Tables, decode_headers, encode_headers};

/// A row about to be enqueued: the message with its event id and slot.
pub(crate) struct NewRow<'a> {
    pub(crate) event_id: String,
    pub(crate) slot: i32,
    pub(crate) message: &'a OutgoingMessage,
}

/// A connection an application enqueues through, inside its open transaction: `PgConnection`,
/// `MySqlConnection` or `SqliteConnection` (what a handler receives, or what a `sqlx::Transaction` dereferences
/// to).
pub trait OutboxConnection: Send {
    /// The store the connection belongs to.
    type Store: OutboxStore<Connection = Self>;
}

impl OutboxConnection for PgConnection {
    type Store = Postgres;
}

impl OutboxConnection for SqliteConnection {
    type Store = Sqlite;
}

/// The outbox's figures, for metrics and `idem outbox stats`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct OutboxStats {
    /// Messages waiting to be delivered.
    pub pending: i64,
    /// The age of the oldest, in seconds; `None` when there is none.
    pub oldest_age_seconds: Option<f64>,
    /// Waiting messages that failed at least once.
    pub failing: i64,
}

/// One destination's backlog, for the console's outbox view.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct DestinationStats {
    /// The destination (topic, subject, queue).
    pub destination: String,
    /// Messages waiting to be delivered there.
    pub pending: i64,
    /// The age of the oldest, in seconds.
    pub oldest_age_seconds: Option<f64>,
    /// Waiting messages that failed at least once.
    pub failing: i64,
}

/// What the relay wakes on besides its poll interval.
pub enum Wakeup {
    /// PostgreSQL: notifications from the outbox's insert trigger.
    Listener(Box<sqlx::postgres::PgListener>),
    /// Polling only.
    Poll,
}

/// The outbox on a store: PostgreSQL, MySQL/MariaDB and SQLite.
pub trait OutboxStore: Backend {
    /// Inserts `rows` in order in the open transaction, in as few statements as the store allows.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn enqueue(
        conn: &mut Self::Connection,
        tables: &Tables,
        rows: &[NewRow<'_>],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Takes this relay's share of the slots on its own connection and gives back what is above it; returns the
    /// slots it owns now. `lease` is how long a lease lasts where the store uses one.
    fn own(
        conn: &mut Self::Connection,
        tables: &Tables,
        relay: &str,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<i32>, sqlx::Error>> + Send;
    /// Gives up every slot (a relay stopping), so another relay takes them at once.
    fn release(
        conn: &mut Self::Connection,
        tables: &Tables,
        relay: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// The oldest `limit` messages of `slots`, but those of `exclude` (delivered, their delete not committed
    /// yet), in id order.
    fn fetch(
        conn: &mut Self::Connection,
        tables: &Tables,
        slots: &[i32],
        exclude: &[i64],
        limit: i64,
    ) -> impl Future<Output = Result<Vec<OutboxMessage>, sqlx::Error>> + Send;
    /// Deletes the delivered messages `ids` in the open transaction.
    fn delete(
        conn: &mut Self::Connection,
        tables: &Tables,
        ids: &[i64],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Counts a failed attempt of message `id` with its reason, in the open transaction.
    fn failed(
        conn: &mut Self::Connection,
        tables: &Tables,
        id: i64,
        reason: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// What waits, how old the oldest is, and how many failed.
    fn outbox_stats(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
    ) -> impl Future<Output = Result<OutboxStats, Error>> + Send;
    /// The same figures per destination, the largest backlog first.
    fn destinations(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
    ) -> impl Future<Output = Result<Vec<DestinationStats>, Error>> + Send;
    /// The oldest `limit` waiting messages (only those that failed at least once, with `failing_only`).
    fn list(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        failing_only: bool,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<OutboxMessage>, Error>> + Send;
    /// What wakes a relay when rows are enqueued.
    fn wakeup(pool: &sqlx::Pool<Self>, tables: &Tables) -> impl Future<Output = Result<Wakeup, Error>> + Send;
    /// Moves dead letter `id` of an outbox relay back into the outbox (same event id, a new place in line) in one
    /// transaction; false when there is no such dead letter.
    fn requeue(pool: &sqlx::Pool<Self>, tables: &Tables, id: i64) -> impl Future<Output = Result<bool, Error>> + Send;
}

/// Moves dead letter `id` (written by a relay, consumer group `outbox:<name>`) back into the outbox: it is
/// delivered again with its event id, behind what is waiting. Returns false when there is no such dead letter.
pub async fn requeue_dead_letter<DB: OutboxStore>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    id: i64,
) -> Result<bool, Error> {
    DB::requeue(pool, tables, id).await
}

/// The oldest `limit` messages waiting in the outbox in `tables` (only those that failed at least once, with
/// `failing_only`).
pub async fn list<DB: OutboxStore>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    failing_only: bool,
    limit: i64,
) -> Result<Vec<OutboxMessage>, Error> {
    DB::list(pool, tables, failing_only, limit).await
}

/// Each destination's backlog, the largest first.
pub async fn destinations<DB: OutboxStore>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
) -> Result<Vec<DestinationStats>, Error> {
    DB::destinations(pool, tables).await
}

/// The condition `list` adds for `failing_only`.
pub(crate) fn failing_condition(failing_only: bool) -> &'static str {
    if failing_only { " WHERE attempts > 0" } else { "" }
}

/// A destination's figures from a row of any store: destination, pending, oldest age, failing.
pub(crate) fn destination_of(row: (String, i64, Option<f64>, i64)) -> DestinationStats {
    let (destination, pending, oldest_age_seconds, failing) = row;
    DestinationStats { destination, pending, oldest_age_seconds, failing }
}

/// How many messages wait in the outbox in `tables`, the oldest one's age, how many failed.
pub async fn stats<DB: OutboxStore>(pool: &sqlx::Pool<DB>, tables: &Tables) -> Result<OutboxStats, Error> {
    DB::outbox_stats(pool, tables).await
}

/// The columns every store's outbox reads, in [`row_of`]'s order (MySQL quotes `key` itself).
const COLUMNS: &str = "id, event_id, destination, key, payload, headers, slot, attempts, last_error";

/// An outbox row from any store: [`COLUMNS`] in order, the age given apart.
pub(crate) fn row_of<R: Row>(row: &R, age_seconds: f64) -> Result<OutboxMessage, sqlx::Error>
where
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<Vec<u8>>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    Ok(OutboxMessage {
        id: row.try_get(0)?,
        event_id: row.try_get(1)?,
        destination: row.try_get(2)?,
        key: row.try_get(3)?,
        payload: row.try_get(4)?,
        headers: decode_headers(&row.try_get::<String, _>(5)?),
        slot: row.try_get(6)?,
        attempts: row.try_get(7)?,
        last_error: row.try_get(8)?,
        age_seconds,
    })
}

/// The advisory-lock namespace of an outbox's slots (positive, so it reads the same in `pg_locks.classid`).
fn lock_namespace(tables: &Tables) -> i32 {
    (crc32fast::hash(format!("idem-outbox:{}", tables.render("{t}")).as_bytes()) & 0x7fff_ffff) as i32
}

/// The notification channel of an outbox's insert trigger.
fn channel(tables: &Tables) -> String {
    tables.render("{p}idem_outbox")
}

impl OutboxStore for Postgres {
    #[allow(private_interfaces)]
    async fn enqueue(conn: &mut PgConnection, tables: &Tables, rows: &[NewRow<'_>]) -> Result<(), sqlx::Error> {
        let sql = tables.render(
            "INSERT INTO {t}outbox (event_id, destination, key, payload, headers, slot)
             SELECT * FROM UNNEST($1::text[], $2::text[], $3::bytea[], $4::bytea[], $5::text[], $6::int[])",
        );
        sqlx::query(&sql)
            .bind(rows.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.message.destination.as_str()).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.message.key.as_deref()).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.message.payload.as_slice()).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| encode_headers(&r.message.headers)).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.slot).collect::<Vec<_>>())
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn own(
        conn: &mut PgConnection,
        tables: &Tables,
        _relay: &str,
        _lease: Duration,
    ) -> Result<Vec<i32>, sqlx::Error> {
        // Slot s is the exclusive lock (ns, s); every relay also holds the shared lock (ns, SLOTS), so relays
        // without a slot yet count when the share is worked out. Advisory locks are per database: relays of
        // another database on the same server are not counted.
        let ns = lock_namespace(tables);
        let mine = async |conn: &mut PgConnection| -> Result<Vec<i32>, sqlx::Error> {
            sqlx::query_scalar(
                "SELECT objid::int FROM pg_locks WHERE locktype = 'advisory' AND classid = $1::int::oid
                   AND objsubid = 2 AND granted AND pid = pg_backend_pid() ORDER BY 1",
            )
            .bind(ns)
            .fetch_all(conn)
            .await
        };
        let mut owned = mine(&mut *conn).await?;
        match owned.iter().position(|&s| s == SLOTS) {
            Some(present) => {
                owned.remove(present);
            }
            None => {
                sqlx::query("SELECT pg_advisory_lock_shared($1, $2)").bind(ns).bind(SLOTS).execute(&mut *conn).await?;
            }
        }
        let relays: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' AND classid = $1::int::oid
               AND objid = $2::int::oid AND objsubid = 2 AND granted
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .bind(ns)
        .bind(SLOTS)
        .fetch_one(&mut *conn)
        .await?;
        let share = (SLOTS as usize).div_ceil(relays.max(1) as usize);
        if owned.len() > share {
            let extra: Vec<i32> = owned[share..].to_vec();
            sqlx::query("SELECT pg_advisory_unlock($1, s) FROM unnest($2::int[]) s")
                .bind(ns)
                .bind(&extra)
                .execute(&mut *conn)
                .await?;
        } else if owned.len() < share {
            // Free slots in random order, locked one by one until the share is reached: LIMIT stops the scan.
            sqlx::query(
                "SELECT s FROM (SELECT s FROM generate_series(0, $2 - 1) s WHERE s <> ALL($3) ORDER BY random()) free
                  WHERE pg_try_advisory_lock($1, free.s) LIMIT $4",
            )
            .bind(ns)
            .bind(SLOTS)
            .bind(&owned)
            .bind((share - owned.len()) as i64)
            .execute(&mut *conn)
            .await?;
        }
        Ok(mine(conn).await?.into_iter().filter(|&s| s != SLOTS).collect())
    }

    async fn release(conn: &mut PgConnection, _tables: &Tables, _relay: &str) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT pg_advisory_unlock_all()").execute(conn).await?;
        Ok(())
    }

    async fn fetch(
        conn: &mut PgConnection,
        tables: &Tables,
        slots: &[i32],
        exclude: &[i64],
        limit: i64,
    ) -> Result<Vec<OutboxMessage>, sqlx::Error> {
        // NOT IN over a subquery: a hashed anti-join, however many ids are excluded.
        let sql = tables.render(&format!(
            "SELECT {COLUMNS}, EXTRACT(EPOCH FROM now() - enqueued_at)::float8
               FROM {{t}}outbox WHERE slot = ANY($1) AND id NOT IN (SELECT unnest($2::bigint[]))
              ORDER BY id LIMIT $3"
        ));
        let rows = sqlx::query(&sql).bind(slots).bind(exclude).bind(limit).fetch_all(conn).await?;
        rows.iter().map(|r| row_of(r, r.try_get(9)?)).collect()
    }

    async fn delete(conn: &mut PgConnection, tables: &Tables, ids: &[i64]) -> Result<(), sqlx::Error> {
        sqlx::query(&tables.render("DELETE FROM {t}outbox WHERE id = ANY($1)")).bind(ids).execute(conn).await?;
        Ok(())
    }

    async fn failed(conn: &mut PgConnection, tables: &Tables, id: i64, reason: &str) -> Result<(), sqlx::Error> {
        let sql = tables.render("UPDATE {t}outbox SET attempts = attempts + 1, last_error = $2 WHERE id = $1");
        sqlx::query(&sql).bind(id).bind(reason.replace('\0', "\\0")).execute(conn).await?;
        Ok(())
    }

    async fn outbox_stats(pool: &sqlx::PgPool, tables: &Tables) -> Result<OutboxStats, Error> {
        let sql = tables.render(
            "SELECT count(*), EXTRACT(EPOCH FROM now() - min(enqueued_at))::float8, count(*) FILTER (WHERE attempts > 0)
               FROM {t}outbox",
        );
        let (pending, oldest_age_seconds, failing) = sqlx::query_as(&sql).fetch_one(pool).await?;
        Ok(OutboxStats { pending, oldest_age_seconds, failing })
    }

    async fn destinations(pool: &sqlx::PgPool, tables: &Tables) -> Result<Vec<DestinationStats>, Error> {
        let sql = tables.render(
            "SELECT destination, count(*), EXTRACT(EPOCH FROM now() - min(enqueued_at))::float8,
                    count(*) FILTER (WHERE attempts > 0)
               FROM {t}outbox GROUP BY destination ORDER BY count(*) DESC, destination",
        );
        let rows = sqlx::query_as(&sql).fetch_all(pool).await?;
        Ok(rows.into_iter().map(destination_of).collect())
    }

    async fn list(
        pool: &sqlx::PgPool,
        tables: &Tables,
        failing_only: bool,
        limit: i64,
    ) -> Result<Vec<OutboxMessage>, Error> {
        let sql = tables.render(&format!(
            "SELECT {COLUMNS}, EXTRACT(EPOCH FROM now() - enqueued_at)::float8 FROM {{t}}outbox{} ORDER BY id LIMIT $1",
            failing_condition(failing_only)
        ));
        let rows = sqlx::query(&sql).bind(limit).fetch_all(pool).await?;
        Ok(rows.iter().map(|r| row_of(r, r.try_get(9)?)).collect::<Result<_, sqlx::Error>>()?)
    }

    async fn wakeup(pool: &sqlx::PgPool, tables: &Tables) -> Result<Wakeup, Error> {
        let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
        listener.listen(&channel(tables)).await?;
        Ok(Wakeup::Listener(Box::new(listener)))
    }

    async fn requeue(pool: &sqlx::PgPool, tables: &Tables, id: i64) -> Result<bool, Error> {
        let sql = tables.render(
            r#"WITH d AS (DELETE FROM {t}dead_letters WHERE id = $1 AND consumer_group LIKE 'outbox:%' AND event_id IS NOT NULL
                          RETURNING event_id, topic, key, payload, headers, partition)
               INSERT INTO {t}outbox (event_id, destination, key, payload, headers, slot)
               SELECT event_id, topic, key, payload, headers, partition FROM d"#,
        );
        Ok(sqlx::query(&sql).bind(id).execute(pool).await?.rows_affected() == 1)
    }
}

/// SQLite's current time in milliseconds, as its outbox columns keep it.
const SQLITE_NOW_MS: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

impl OutboxStore for Sqlite {
    #[allow(private_interfaces)]
    async fn enqueue(conn: &mut SqliteConnection, tables: &Tables, rows: &[NewRow<'_>]) -> Result<(), sqlx::Error> {
        // Six parameters a row, well under SQLite's limit of 32,766 per statement.
        for chunk in rows.chunks(1000) {
            let mut builder = sqlx::QueryBuilder::<Sqlite>::new(
                tables.render("INSERT INTO {t}outbox (event_id, destination, key, payload, headers, slot) "),
            );
            builder.push_values(chunk, |mut b, r| {
                b.push_bind(r.event_id.as_str())
                    .push_bind(r.message.destination.as_str())
                    .push_bind(r.message.key.as_deref())
                    .push_bind(r.message.payload.as_slice())
                    .push_bind(encode_headers(&r.message.headers))
                    .push_bind(r.slot);
            });
            builder.build().execute(&mut *conn).await?;
        }
        Ok(())
    }

    async fn own(
        conn: &mut SqliteConnection,
        tables: &Tables,
        relay: &str,
        lease: Duration,
    ) -> Result<Vec<i32>, sqlx::Error> {
        let sql = tables.render(&format!(
            "INSERT INTO {{t}}outbox_lease (id, owner, expires_at) VALUES (1, $1, {SQLITE_NOW_MS} + $2)
             ON CONFLICT (id) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at
              WHERE {{t}}outbox_lease.owner = excluded.owner OR {{t}}outbox_lease.expires_at < {SQLITE_NOW_MS}"
        ));
        let taken = sqlx::query(&sql).bind(relay).bind(lease.as_millis() as i64).execute(conn).await?.rows_affected();
        Ok(if taken == 1 { (0..SLOTS).collect() } else { Vec::new() })
    }

    async fn release(conn: &mut SqliteConnection, tables: &Tables, relay: &str) -> Result<(), sqlx::Error> {
        sqlx::query(&tables.render("DELETE FROM {t}outbox_lease WHERE owner = $1")).bind(relay).execute(conn).await?;
        Ok(())
    }

    async fn fetch(
        conn: &mut SqliteConnection,
        tables: &Tables,
        slots: &[i32],
        exclude: &[i64],
        limit: i64,
    ) -> Result<Vec<OutboxMessage>, sqlx::Error> {
        let list = slots.iter().map(i32::to_string).collect::<Vec<_>>().join(",");
        let excluded = exclude.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        let sql = tables.render(&format!(
            "SELECT {COLUMNS}, ({SQLITE_NOW_MS} - enqueued_at) / 1000.0 FROM {{t}}outbox
              WHERE slot IN ({list}) AND id NOT IN ({excluded}) ORDER BY id LIMIT $1"
        ));
        let rows = sqlx::query(&sql).bind(limit).fetch_all(conn).await?;
        rows.iter().map(|r| row_of(r, r.try_get(9)?)).collect()
    }

    async fn delete(conn: &mut SqliteConnection, tables: &Tables, ids: &[i64]) -> Result<(), sqlx::Error> {
        for chunk in ids.chunks(1000) {
            let list = chunk.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
            sqlx::query(&tables.render(&format!("DELETE FROM {{t}}outbox WHERE id IN ({list})")))
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }

    async fn failed(conn: &mut SqliteConnection, tables: &Tables, id: i64, reason: &str) -> Result<(), sqlx::Error> {
        let sql = tables.render("UPDATE {t}outbox SET attempts = attempts + 1, last_error = $2 WHERE id = $1");
        sqlx::query(&sql).bind(id).bind(reason).execute(conn).await?;
        Ok(())
    }

    async fn outbox_stats(pool: &sqlx::SqlitePool, tables: &Tables) -> Result<OutboxStats, Error> {
        let sql = tables.render(&format!(
            "SELECT count(*), ({SQLITE_NOW_MS} - min(enqueued_at)) / 1000.0, count(*) FILTER (WHERE attempts > 0)
               FROM {{t}}outbox"
        ));
        let (pending, oldest_age_seconds, failing) = sqlx::query_as(&sql).fetch_one(pool).await?;
        Ok(OutboxStats { pending, oldest_age_seconds, failing })
    }

    async fn destinations(pool: &sqlx::SqlitePool, tables: &Tables) -> Result<Vec<DestinationStats>, Error> {
        let sql = tables.render(&format!(
            "SELECT destination, count(*), ({SQLITE_NOW_MS} - min(enqueued_at)) / 1000.0,
                    count(*) FILTER (WHERE attempts > 0)
               FROM {{t}}outbox GROUP BY destination ORDER BY count(*) DESC, destination"
        ));
        let rows = sqlx::query_as(&sql).fetch_all(pool).await?;
        Ok(rows.into_iter().map(destination_of).collect())
    }

    async fn list(
        pool: &sqlx::SqlitePool,
        tables: &Tables,
        failing_only: bool,
        limit: i64,
    ) -> Result<Vec<OutboxMessage>, Error> {
        let sql = tables.render(&format!(
            "SELECT {COLUMNS}, ({SQLITE_NOW_MS} - enqueued_at) / 1000.0 FROM {{t}}outbox{} ORDER BY id LIMIT $1",
            failing_condition(failing_only)
        ));
        let rows = sqlx::query(&sql).bind(limit).fetch_all(pool).await?;
        Ok(rows.iter().map(|r| row_of(r, r.try_get(9)?)).collect::<Result<_, sqlx::Error>>()?)
    }

    async fn wakeup(_pool: &sqlx::SqlitePool, _tables: &Tables) -> Result<Wakeup, Error> {
        Ok(Wakeup::Poll)
    }

    async fn requeue(pool: &sqlx::SqlitePool, tables: &Tables, id: i64) -> Result<bool, Error> {
        let mut tx = pool.begin().await?;
        let moved = sqlx::query(&tables.render(
            "INSERT INTO {t}outbox (event_id, destination, key, payload, headers, slot)
             SELECT event_id, topic, key, payload, headers, partition FROM {t}dead_letters
              WHERE id = $1 AND consumer_group LIKE 'outbox:%' AND event_id IS NOT NULL",
        ))
        .bind(id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        sqlx::query(&tables.render("DELETE FROM {t}dead_letters WHERE id = $1 AND consumer_group LIKE 'outbox:%'"))
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(moved == 1)
    }
}
