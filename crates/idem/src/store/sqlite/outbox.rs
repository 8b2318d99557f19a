//! The outbox on SQLite. One relay at a time owns the whole outbox, through one lease row it renews (a relay
//! that dies lets it go when the lease runs out); relays poll.

use std::time::Duration;

use sqlx::{Row, Sqlite, SqliteConnection};

use crate::error::Error;
use crate::outbox::store::{COLUMNS, NewRow, Wakeup, destination_of, failing_condition, row_of};
use crate::outbox::{DestinationStats, OutboxConnection, OutboxMessage, OutboxStats, OutboxStore, SLOTS};
use crate::store::{Tables, encode_headers};

impl OutboxConnection for SqliteConnection {
    type Store = Sqlite;
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
