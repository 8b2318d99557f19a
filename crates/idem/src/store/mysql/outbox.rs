//! The outbox on MySQL and MariaDB. A relay owns slots with named locks (`GET_LOCK`), held by its own session:
//! a relay that dies, or whose connection is cut, lets them go at once, as PostgreSQL's advisory locks do. Every
//! relay also holds one presence lock of a numbered few, so that relays without a slot yet count when the share
//! is worked out. Named locks are server-wide: their names carry a checksum of the database and the table prefix.

use std::time::Duration;

use sqlx::mysql::{MySql, MySqlConnection};
use sqlx::{Connection, Row};

use crate::error::Error;
use crate::outbox::store::{NewRow, Wakeup, destination_of, failing_condition, row_of};
use crate::outbox::{DestinationStats, OutboxConnection, OutboxMessage, OutboxStats, OutboxStore, SLOTS};
use crate::store::{Tables, encode_headers};

impl OutboxConnection for MySqlConnection {
    type Store = MySql;
}

/// The outbox's columns in `row_of`'s order, then the row's age in seconds.
const SELECT: &str = "SELECT id, CAST(event_id AS CHAR), CAST(destination AS CHAR), `key`, payload, headers, slot, \
                      attempts, last_error, TIMESTAMPDIFF(MICROSECOND, enqueued_at, UTC_TIMESTAMP(6)) / 1e6";

/// The numbers 0 to SLOTS - 1 as a derived table `n(s)` (a recursive CTE well under MySQL's depth limit).
const NUMBERS: &str = "WITH RECURSIVE n(s) AS (SELECT 0 UNION ALL SELECT s + 1 FROM n WHERE s < 63)";

/// The prefix of this outbox's lock names: `idem-outbox:<crc of database and prefix>:`, computed by the server.
const LOCK_PREFIX: &str = "CONCAT('idem-outbox:', CRC32(CONCAT(DATABASE(), ':', ?)), ':')";

impl OutboxStore for MySql {
    #[allow(private_interfaces)]
    async fn enqueue(conn: &mut MySqlConnection, tables: &Tables, rows: &[NewRow<'_>]) -> Result<(), sqlx::Error> {
        // Six parameters a row, well under MySQL's 65,535 per statement.
        for chunk in rows.chunks(1000) {
            let mut builder =
                sqlx::QueryBuilder::<MySql>::new(tables.render(
                    "INSERT INTO {t}outbox (event_id, destination, `key`, payload, headers, slot, enqueued_at) ",
                ));
            builder.push_values(chunk, |mut b, r| {
                b.push_bind(r.event_id.as_str())
                    .push_bind(r.message.destination.as_str())
                    .push_bind(r.message.key.as_deref())
                    .push_bind(r.message.payload.as_slice())
                    .push_bind(encode_headers(&r.message.headers))
                    .push_bind(r.slot)
                    .push("UTC_TIMESTAMP(6)");
            });
            builder.build().execute(&mut *conn).await?;
        }
        Ok(())
    }

    async fn own(
        conn: &mut MySqlConnection,
        tables: &Tables,
        _relay: &str,
        _lease: Duration,
    ) -> Result<Vec<i32>, sqlx::Error> {
        let prefix = tables.prefix();
        // Presence: the lowest free of SLOTS numbered locks `…:r<k>`, taken once and held.
        let present: i64 = sqlx::query_scalar(&format!(
            "{NUMBERS} SELECT COUNT(*) FROM n WHERE IS_USED_LOCK(CONCAT({LOCK_PREFIX}, 'r', s)) = CONNECTION_ID()"
        ))
        .bind(prefix)
        .fetch_one(&mut *conn)
        .await?;
        if present == 0 {
            for k in 0..SLOTS {
                let got: Option<i64> =
                    sqlx::query_scalar(&format!("SELECT GET_LOCK(CONCAT({LOCK_PREFIX}, 'r', ?), 0)"))
                        .bind(prefix)
                        .bind(k)
                        .fetch_one(&mut *conn)
                        .await?;
                if got == Some(1) {
                    break;
                }
            }
        }
        let relays: i64 = sqlx::query_scalar(&format!(
            "{NUMBERS} SELECT COUNT(*) FROM n WHERE IS_USED_LOCK(CONCAT({LOCK_PREFIX}, 'r', s)) IS NOT NULL"
        ))
        .bind(prefix)
        .fetch_one(&mut *conn)
        .await?;
        let share = (SLOTS as usize).div_ceil(relays.max(1) as usize);
        let mut owned = owned_slots(&mut *conn, prefix).await?;
        if owned.len() > share {
            for slot in owned.split_off(share) {
                sqlx::query(&format!("SELECT RELEASE_LOCK(CONCAT({LOCK_PREFIX}, 's', ?))"))
                    .bind(prefix)
                    .bind(slot)
                    .execute(&mut *conn)
                    .await?;
            }
        } else if owned.len() < share {
            // Free slots in random order, taken one by one (without waiting) until the share is reached.
            let free: Vec<i64> = sqlx::query_scalar(&format!(
                "{NUMBERS} SELECT s FROM n WHERE IS_FREE_LOCK(CONCAT({LOCK_PREFIX}, 's', s)) = 1 ORDER BY RAND()"
            ))
            .bind(prefix)
            .fetch_all(&mut *conn)
            .await?;
            let mut wanted = share - owned.len();
            for slot in free {
                if wanted == 0 {
                    break;
                }
                let got: Option<i64> =
                    sqlx::query_scalar(&format!("SELECT GET_LOCK(CONCAT({LOCK_PREFIX}, 's', ?), 0)"))
                        .bind(prefix)
                        .bind(slot)
                        .fetch_one(&mut *conn)
                        .await?;
                if got == Some(1) {
                    wanted -= 1;
                }
            }
            owned = owned_slots(&mut *conn, prefix).await?;
        }
        Ok(owned)
    }

    async fn release(conn: &mut MySqlConnection, _tables: &Tables, _relay: &str) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT RELEASE_ALL_LOCKS()").execute(conn).await?;
        Ok(())
    }

    async fn fetch(
        conn: &mut MySqlConnection,
        tables: &Tables,
        slots: &[i32],
        exclude: &[i64],
        limit: i64,
    ) -> Result<Vec<OutboxMessage>, sqlx::Error> {
        if slots.is_empty() {
            return Ok(Vec::new());
        }
        let list = slots.iter().map(i32::to_string).collect::<Vec<_>>().join(",");
        // MySQL refuses an empty IN list.
        let excluded = match exclude {
            [] => String::new(),
            ids => format!(" AND id NOT IN ({})", ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",")),
        };
        let sql =
            tables.render(&format!("{SELECT} FROM {{t}}outbox WHERE slot IN ({list}){excluded} ORDER BY id LIMIT ?"));
        let rows = sqlx::query(&sql).bind(limit).fetch_all(conn).await?;
        rows.iter().map(|r| row_of(r, r.try_get(9)?)).collect()
    }

    async fn delete(conn: &mut MySqlConnection, tables: &Tables, ids: &[i64]) -> Result<(), sqlx::Error> {
        for chunk in ids.chunks(1000) {
            let list = chunk.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
            sqlx::query(&tables.render(&format!("DELETE FROM {{t}}outbox WHERE id IN ({list})")))
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }

    async fn failed(conn: &mut MySqlConnection, tables: &Tables, id: i64, reason: &str) -> Result<(), sqlx::Error> {
        let sql = tables.render("UPDATE {t}outbox SET attempts = attempts + 1, last_error = ? WHERE id = ?");
        sqlx::query(&sql).bind(reason).bind(id).execute(conn).await?;
        Ok(())
    }

    async fn outbox_stats(pool: &sqlx::MySqlPool, tables: &Tables) -> Result<OutboxStats, Error> {
        let sql = tables.render(
            "SELECT COUNT(*), TIMESTAMPDIFF(MICROSECOND, MIN(enqueued_at), UTC_TIMESTAMP(6)) / 1e6,
                    COUNT(CASE WHEN attempts > 0 THEN 1 END)
               FROM {t}outbox",
        );
        let (pending, oldest_age_seconds, failing) = sqlx::query_as(&sql).fetch_one(pool).await?;
        Ok(OutboxStats { pending, oldest_age_seconds, failing })
    }

    async fn destinations(pool: &sqlx::MySqlPool, tables: &Tables) -> Result<Vec<DestinationStats>, Error> {
        let sql = tables.render(
            "SELECT CAST(destination AS CHAR), COUNT(*), TIMESTAMPDIFF(MICROSECOND, MIN(enqueued_at), UTC_TIMESTAMP(6)) / 1e6,
                    COUNT(CASE WHEN attempts > 0 THEN 1 END)
               FROM {t}outbox GROUP BY destination ORDER BY COUNT(*) DESC, destination",
        );
        let rows = sqlx::query_as(&sql).fetch_all(pool).await?;
        Ok(rows.into_iter().map(destination_of).collect())
    }

    async fn list(
        pool: &sqlx::MySqlPool,
        tables: &Tables,
        failing_only: bool,
        limit: i64,
    ) -> Result<Vec<OutboxMessage>, Error> {
        let sql =
            tables.render(&format!("{SELECT} FROM {{t}}outbox{} ORDER BY id LIMIT ?", failing_condition(failing_only)));
        let rows = sqlx::query(&sql).bind(limit).fetch_all(pool).await?;
        Ok(rows.iter().map(|r| row_of(r, r.try_get(9)?)).collect::<Result<_, sqlx::Error>>()?)
    }

    /// MySQL has no notifications: relays poll.
    async fn wakeup(_pool: &sqlx::MySqlPool, _tables: &Tables) -> Result<Wakeup, Error> {
        Ok(Wakeup::Poll)
    }

    async fn requeue(pool: &sqlx::MySqlPool, tables: &Tables, id: i64) -> Result<bool, Error> {
        let mut conn = pool.acquire().await?;
        let mut tx = conn.begin().await?;
        let moved = sqlx::query(&tables.render(
            "INSERT INTO {t}outbox (event_id, destination, `key`, payload, headers, slot, enqueued_at)
             SELECT event_id, topic, `key`, payload, headers, `partition`, UTC_TIMESTAMP(6) FROM {t}dead_letters
              WHERE id = ? AND consumer_group LIKE 'outbox:%' AND event_id IS NOT NULL",
        ))
        .bind(id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        sqlx::query(&tables.render("DELETE FROM {t}dead_letters WHERE id = ? AND consumer_group LIKE 'outbox:%'"))
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(moved == 1)
    }
}

/// The slots this session holds, in order.
async fn owned_slots(conn: &mut MySqlConnection, prefix: &str) -> Result<Vec<i32>, sqlx::Error> {
    let slots: Vec<i64> = sqlx::query_scalar(&format!(
        "{NUMBERS} SELECT s FROM n WHERE IS_USED_LOCK(CONCAT({LOCK_PREFIX}, 's', s)) = CONNECTION_ID() ORDER BY s"
    ))
    .bind(prefix)
    .fetch_all(conn)
    .await?;
    Ok(slots.into_iter().filter_map(|s| i32::try_from(s).ok()).collect())
}
