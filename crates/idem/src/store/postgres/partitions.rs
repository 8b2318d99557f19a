//! The partitioned marker layout (PostgreSQL): `processed_events` range-partitioned by UTC day or month on a
//! `processed_on` column, partitions created ahead of time and dropped whole once they pass the retention.
//! See [`crate::config::Partitioning`] for the cost and how the claim covers it.
//!
//! The layout is recorded in the table's comment (`idem:partitioned:day`), so that a consumer configured for
//! one layout refuses to start on the other, and `idem prune` knows which pruning applies.

use std::time::Duration;

use sqlx::{Connection, PgPool};

use crate::config::{MarkerLayout, PartitionPeriod};
use crate::error::Error;
use crate::store::Tables;
use crate::store::migrate::lock_key;

/// What a maintenance pass did to the partitions.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct PartitionReport {
    /// Partitions created (schema-qualified names).
    pub created: Vec<String>,
    /// Partitions dropped because every marker in them is older than the retention.
    pub dropped: Vec<String>,
    /// Markers that went with the dropped partitions.
    pub markers_dropped: u64,
}

/// A partition whose whole range is older than the retention.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ExpiredPartition {
    /// Schema-qualified name.
    pub name: String,
    /// Markers in it.
    pub markers: i64,
}

const COMMENT_PREFIX: &str = "idem:partitioned:";

/// The layout the marker table has in the database: `None` for plain, or the partition period.
pub async fn stored_period(pool: &PgPool, tables: &Tables) -> Result<Option<PartitionPeriod>, Error> {
    let sql = tables.render(
        "SELECT c.relkind::text, obj_description(c.oid, 'pg_class') FROM pg_class c \
          WHERE c.oid = to_regclass('{t}processed_events')",
    );
    // Through idem's checkout: a database refusing connections is an outage a starting consumer waits out.
    let mut conn = crate::store::connect::connection(pool).await?;
    let row: Option<(String, Option<String>)> = sqlx::query_as(&sql).fetch_optional(&mut *conn).await?;
    let Some((kind, comment)) = row else {
        return Err(Error::Schema(format!(
            "{} does not exist: run `idem migrate` first",
            tables.table("processed_events")
        )));
    };
    if kind != "p" {
        return Ok(None);
    }
    let period = comment.as_deref().and_then(|c| c.strip_prefix(COMMENT_PREFIX)).unwrap_or("");
    PartitionPeriod::parse(period).map(Some).map_err(|_| {
        Error::Schema(format!(
            "{} is partitioned but not by idem (its comment should read `{COMMENT_PREFIX}day` or `…month`)",
            tables.table("processed_events")
        ))
    })
}

/// Refuses to run a consumer whose configured layout differs from the table's, naming the fix.
pub async fn check_layout(pool: &PgPool, tables: &Tables, layout: &MarkerLayout) -> Result<(), Error> {
    let table = tables.table("processed_events");
    match (layout, stored_period(pool, tables).await?) {
        (MarkerLayout::Plain, None) => Ok(()),
        (MarkerLayout::Partitioned(p), Some(stored)) if p.period == stored => Ok(()),
        (MarkerLayout::Partitioned(p), None) => Err(Error::Config(format!(
            "layout: the configuration asks for {period} partitions but {table} is a plain table: stop the \
             consumers and run `idem markers convert --to partitioned --period {period}`",
            period = p.period.as_str()
        ))),
        (MarkerLayout::Partitioned(p), Some(stored)) => Err(Error::Config(format!(
            "layout: the configuration asks for {} partitions but {table} is partitioned by {}: configure that \
             period, or convert the table",
            p.period.as_str(),
            stored.as_str()
        ))),
        (MarkerLayout::Plain, Some(stored)) => Err(Error::Config(format!(
            "layout: {table} is partitioned by {period}, but the configuration asks for the plain layout: \
             configure `Config::partitioned(PartitionPeriod::{name}, redelivery_window)`, or run \
             `idem markers convert --to plain`",
            period = stored.as_str(),
            name = if stored == PartitionPeriod::Day { "Day" } else { "Month" }
        ))),
    }
}

/// Creates the partition of the current period and `ahead` more, under the migration lock (several consumers
/// may do it at once). Returns the names of the partitions it created.
pub async fn create_ahead(
    pool: &PgPool,
    tables: &Tables,
    period: PartitionPeriod,
    ahead: u32,
) -> Result<Vec<String>, Error> {
    let mut conn = crate::store::connect::connection(pool).await?;
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(lock_key(tables)).execute(&mut *tx).await?;
    let created = create_ahead_in(&mut tx, tables, period, ahead).await?;
    tx.commit().await?;
    Ok(created)
}

async fn create_ahead_in(
    tx: &mut sqlx::PgConnection,
    tables: &Tables,
    period: PartitionPeriod,
    ahead: u32,
) -> Result<Vec<String>, Error> {
    let wanted: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT to_char(d, $2), d::date::text, (d + ('1 ' || $1)::interval)::date::text
           FROM generate_series(date_trunc($1, now() AT TIME ZONE 'UTC'),
                                date_trunc($1, now() AT TIME ZONE 'UTC') + ($3 || ' ' || $1)::interval,
                                ('1 ' || $1)::interval) AS d",
    )
    .bind(period.as_str())
    .bind(suffix_format(period))
    .bind(i64::from(ahead).to_string())
    .fetch_all(&mut *tx)
    .await?;
    let mut created = Vec::new();
    for span in wanted {
        if let Some(name) = create_partition(tx, tables, span).await? {
            created.push(name);
        }
    }
    Ok(created)
}

/// Creates the partition `(suffix, from, to)` unless it exists; returns its name when it created it.
async fn create_partition(
    tx: &mut sqlx::PgConnection,
    tables: &Tables,
    (suffix, from, to): (String, String, String),
) -> Result<Option<String>, Error> {
    let name = tables.table(&format!("processed_events_p{suffix}"));
    let exists: Option<String> =
        sqlx::query_scalar("SELECT to_regclass($1)::text").bind(&name).fetch_one(&mut *tx).await?;
    if exists.is_some() {
        return Ok(None);
    }
    let create = format!(
        "CREATE TABLE {name} PARTITION OF {parent} FOR VALUES FROM ('{from}') TO ('{to}')",
        parent = tables.table("processed_events")
    );
    sqlx::query(&create).execute(&mut *tx).await?;
    Ok(Some(name))
}

/// The partitions whose whole range ends at least `retention` ago, with their marker counts (for a dry run).
pub async fn expired(pool: &PgPool, tables: &Tables, retention: Duration) -> Result<Vec<ExpiredPartition>, Error> {
    let mut conn = crate::store::connect::connection(pool).await?;
    expired_on(&mut conn, tables, retention).await
}

async fn expired_on(
    conn: &mut sqlx::PgConnection,
    tables: &Tables,
    retention: Duration,
) -> Result<Vec<ExpiredPartition>, Error> {
    let names = expired_names(&mut *conn, tables, retention).await?;
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let markers: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {name}")).fetch_one(&mut *conn).await?;
        out.push(ExpiredPartition { name, markers });
    }
    Ok(out)
}

/// Drops every partition whose whole range ends at least `retention` ago: detached first without blocking
/// the consumers (`DETACH PARTITION … CONCURRENTLY`), then dropped. Never touches a partition holding a marker
/// younger than the retention.
pub async fn drop_expired(pool: &PgPool, tables: &Tables, retention: Duration) -> Result<(Vec<String>, u64), Error> {
    // One pruner at a time (several consumers run housekeeping): a session lock on one connection, which the
    // detaches run on too (CONCURRENTLY cannot run in a transaction block).
    let mut conn = crate::store::connect::connection(pool).await?;
    let key = lock_key(tables) ^ PRUNE_LOCK;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)").bind(key).fetch_one(&mut *conn).await?;
    if !locked {
        tracing::debug!("another process is dropping marker partitions");
        return Ok((Vec::new(), 0));
    }
    let result = drop_expired_locked(&mut conn, tables, retention).await;
    if let Err(error) = sqlx::query("SELECT pg_advisory_unlock($1)").bind(key).execute(&mut *conn).await {
        // The lock ends with the session: close it rather than return it to the pool holding the lock.
        tracing::warn!(%error, "releasing the partition pruning lock failed; closing its connection");
        let _ = conn.detach().close().await;
    }
    result
}

/// Distinguishes the pruning lock from the migration lock of the same tables.
const PRUNE_LOCK: i64 = 0x7072_756e_6500;

async fn drop_expired_locked(
    conn: &mut sqlx::PgConnection,
    tables: &Tables,
    retention: Duration,
) -> Result<(Vec<String>, u64), Error> {
    let parent = tables.table("processed_events");
    // A detach interrupted earlier leaves its partition pending: finish it first, whatever else happens.
    let pending: Vec<String> = sqlx::query_scalar(&tables.render(
        "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) FROM pg_inherits i
           JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE i.inhparent = '{t}processed_events'::regclass AND i.inhdetachpending",
    ))
    .fetch_all(&mut *conn)
    .await?;
    for name in &pending {
        tracing::warn!(partition = %name, "finishing an interrupted detach of a marker partition");
        sqlx::query(&format!("ALTER TABLE {parent} DETACH PARTITION {name} FINALIZE")).execute(&mut *conn).await?;
    }
    let mut dropped = Vec::new();
    let mut markers = 0u64;
    for ExpiredPartition { name, markers: count } in expired_on(conn, tables, retention).await? {
        if !pending.contains(&name) {
            sqlx::query(&format!("ALTER TABLE {parent} DETACH PARTITION {name} CONCURRENTLY"))
                .execute(&mut *conn)
                .await?;
        }
        sqlx::query(&format!("DROP TABLE {name}")).execute(&mut *conn).await?;
        tracing::info!(partition = %name, markers = count, "marker partition dropped");
        markers += count.max(0) as u64;
        dropped.push(name);
    }
    Ok((dropped, markers))
}

/// One maintenance pass of the partitioned layout: partitions created ahead, expired ones dropped.
pub async fn maintain(
    pool: &PgPool,
    tables: &Tables,
    period: PartitionPeriod,
    ahead: u32,
    retention: Option<Duration>,
) -> Result<PartitionReport, Error> {
    let created = create_ahead(pool, tables, period, ahead).await?;
    let (dropped, markers_dropped) = match retention {
        Some(retention) => drop_expired(pool, tables, retention).await?,
        None => (Vec::new(), 0),
    };
    Ok(PartitionReport { created, dropped, markers_dropped })
}

/// Every partition with its bound (`FOR VALUES FROM … TO …`) and marker count, oldest first.
pub async fn list(pool: &PgPool, tables: &Tables) -> Result<Vec<(String, String, i64)>, Error> {
    let sql = tables.render(
        r#"SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname), pg_get_expr(c.relpartbound, c.oid)
             FROM pg_inherits i
             JOIN pg_class c ON c.oid = i.inhrelid
             JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE i.inhparent = '{t}processed_events'::regclass
            ORDER BY c.relname"#,
    );
    let partitions: Vec<(String, String)> = sqlx::query_as(&sql).fetch_all(pool).await?;
    let mut out = Vec::with_capacity(partitions.len());
    for (name, bound) in partitions {
        let markers: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {name}")).fetch_one(pool).await?;
        out.push((name, bound, markers));
    }
    Ok(out)
}

async fn expired_names(
    conn: &mut sqlx::PgConnection,
    tables: &Tables,
    retention: Duration,
) -> Result<Vec<String>, Error> {
    let sql = tables.render(
        r#"SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname)
             FROM pg_inherits i
             JOIN pg_class c ON c.oid = i.inhrelid
             JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE i.inhparent = '{t}processed_events'::regclass
              AND (substring(pg_get_expr(c.relpartbound, c.oid) FROM $$TO \('([0-9-]+)'\)$$)::date
                     ::timestamp AT TIME ZONE 'UTC') <= now() - make_interval(secs => $1)
            ORDER BY c.relname"#,
    );
    Ok(sqlx::query_scalar(&sql).bind(retention.as_secs_f64()).fetch_all(conn).await?)
}

fn suffix_format(period: PartitionPeriod) -> &'static str {
    match period {
        PartitionPeriod::Day => "YYYYMMDD",
        PartitionPeriod::Month => "YYYYMM",
    }
}

/// Converts the marker table between the plain and the partitioned layout, in one transaction, keeping every
/// marker. Stop the consumers first: the table is locked for the copy. Returns how many markers were copied.
pub async fn convert(
    pool: &PgPool,
    tables: &Tables,
    target: Option<PartitionPeriod>,
    create_ahead_count: u32,
) -> Result<u64, Error> {
    let current = stored_period(pool, tables).await?;
    if current == target {
        return Ok(0);
    }
    let parent = tables.table("processed_events");
    let old = tables.table("processed_events_old");
    let old_bare = format!("{}processed_events_old", tables.prefix());
    let mut conn = crate::store::connect::connection(pool).await?;
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(lock_key(tables)).execute(&mut *tx).await?;
    let statements = vec![
        format!("LOCK TABLE {parent} IN ACCESS EXCLUSIVE MODE"),
        format!("ALTER TABLE {parent} RENAME TO {old_bare}"),
    ];
    for s in statements {
        sqlx::query(&s).execute(&mut *tx).await?;
    }
    // Index names are per schema: give the old table's indexes out of the way.
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT quote_ident(n.nspname) || '.' || quote_ident(i.relname) FROM pg_index x
           JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_namespace n ON n.oid = i.relnamespace
          WHERE x.indrelid = $1::regclass",
    )
    .bind(&old)
    .fetch_all(&mut *tx)
    .await?;
    for (n, index) in indexes.iter().enumerate() {
        let renamed = format!("{}processed_events_old_{n}", tables.prefix());
        sqlx::query(&format!("ALTER INDEX {index} RENAME TO {renamed}")).execute(&mut *tx).await?;
    }
    let columns = r#"consumer_group, event_id, topic, partition, "offset", processed_at, payload_digest"#;
    let copied = match target {
        Some(period) => {
            let unit = period.as_str();
            let create = tables.render(&format!(
                // The columns the migrations gave the table, whatever they are, taken from it; a partitioned table
                // has the partition key already.
                "CREATE TABLE {{t}}processed_events (LIKE {old} INCLUDING DEFAULTS,{key}
                   PRIMARY KEY (consumer_group, event_id, processed_on)
                 ) PARTITION BY RANGE (processed_on)",
                key = if current.is_some() { "" } else { " processed_on date NOT NULL," }
            ));
            sqlx::query(&create).execute(&mut *tx).await?;
            sqlx::query(&format!(
                "ALTER TABLE {parent} ALTER COLUMN processed_on
                   SET DEFAULT date_trunc('{unit}', now() AT TIME ZONE 'UTC')::date"
            ))
            .execute(&mut *tx)
            .await?;
            sqlx::query(&format!("COMMENT ON TABLE {parent} IS '{COMMENT_PREFIX}{unit}'")).execute(&mut *tx).await?;
            // Partitions for every period the old markers span, then the current one and those ahead.
            let spans: Vec<(String, String, String)> = sqlx::query_as(&format!(
                "SELECT DISTINCT to_char(d, $2), d::date::text, (d + ('1 ' || $1)::interval)::date::text
                   FROM (SELECT date_trunc($1, processed_at AT TIME ZONE 'UTC') AS d FROM {old}) s"
            ))
            .bind(unit)
            .bind(suffix_format(period))
            .fetch_all(&mut *tx)
            .await?;
            for span in spans {
                create_partition(&mut tx, tables, span).await?;
            }
            create_ahead_in(&mut tx, tables, period, create_ahead_count).await?;
            create_indexes(&mut tx, tables).await?;
            // An event marked in two old partitions that fall into one new partition keeps its first marker.
            sqlx::query(&format!(
                "INSERT INTO {parent} ({columns}, processed_on)
                 SELECT DISTINCT ON (consumer_group, event_id, bucket) {columns}, bucket
                   FROM (SELECT *, date_trunc('{unit}', processed_at AT TIME ZONE 'UTC')::date AS bucket FROM {old}) o
                  ORDER BY consumer_group, event_id, bucket, processed_at"
            ))
            .execute(&mut *tx)
            .await?
            .rows_affected()
        }
        None => {
            // The columns of the partitioned table, taken from it, less the partition key it added.
            let create = tables.render(&format!(
                "CREATE TABLE {{t}}processed_events (LIKE {old} INCLUDING DEFAULTS, PRIMARY KEY (consumer_group, event_id))"
            ));
            sqlx::query(&create).execute(&mut *tx).await?;
            sqlx::query(&format!("ALTER TABLE {parent} DROP COLUMN IF EXISTS processed_on")).execute(&mut *tx).await?;
            create_indexes(&mut tx, tables).await?;
            // An event marked in two partitions keeps its first marker.
            sqlx::query(&format!(
                "INSERT INTO {parent} ({columns})
                 SELECT DISTINCT ON (consumer_group, event_id) {columns} FROM {old}
                  ORDER BY consumer_group, event_id, processed_at"
            ))
            .execute(&mut *tx)
            .await?
            .rows_affected()
        }
    };
    sqlx::query(&format!("DROP TABLE {old}")).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(copied)
}

async fn create_indexes(tx: &mut sqlx::PgConnection, tables: &Tables) -> Result<(), Error> {
    for sql in [
        "CREATE INDEX {p}processed_events_processed_at ON {t}processed_events (processed_at)",
        "CREATE INDEX {p}processed_events_group_time ON {t}processed_events (consumer_group, processed_at)",
    ] {
        sqlx::query(&tables.render(sql)).execute(&mut *tx).await?;
    }
    Ok(())
}
