//! The outbox on PostgreSQL. A relay owns slots with advisory locks held by its session (a relay that dies lets
//! them go at once), counts the relays sharing the outbox by their shared lock, and is woken by the insert
//! trigger's notification.

use std::time::Duration;

use sqlx::{PgConnection, Postgres, Row};

use crate::error::Error;
use crate::outbox::store::{COLUMNS, NewRow, Wakeup, destination_of, failing_condition, row_of};
use crate::outbox::{DestinationStats, OutboxConnection, OutboxMessage, OutboxStats, OutboxStore, SLOTS};
use crate::store::{Tables, encode_headers};

impl OutboxConnection for PgConnection {
    type Store = Postgres;
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
