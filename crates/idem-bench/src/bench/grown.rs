//! Cost as the work grows: the per-event and batch-handler legs on a marker table that already holds
//! `--grown-markers` markers of the same consumer group (10,000,000 by default), in the plain and the partitioned
//! layout, against the same legs on an empty table of the same layout. The two tables sit side by side (`bench_`
//! and `bench_grown_`) and the runs alternate between them, so the machine's noise falls on both alike.
//!
//! The markers are loaded untimed with `generate_series`, the table's indexes dropped for the load and built
//! again after it (from their own definitions). Their ids have the live events' shape (`pay-` then 32 hex
//! digits), so the live claims land among them in the primary key; their times spread over the last ten days, so
//! the partitioned layout holds them in ten daily partitions.

use std::time::{Duration, Instant};

use anyhow::bail;
use idem::{Config, Engine, KeyExtractor, PartitionPeriod, Tables};
use sqlx::PgPool;

use super::idem_legs::{CreditAll, CreditEach, MemorySource, messages};
use super::{BenchArgs, GROUP, Leg, PREFIX, Workload, fresh_tables};

/// The grown table's prefix.
const GROWN: &str = "bench_grown_";

/// A layout of the marker table.
#[derive(Clone, Copy)]
enum Layout {
    Plain,
    Partitioned,
}

impl Layout {
    fn label(self) -> &'static str {
        match self {
            Layout::Plain => "plain",
            Layout::Partitioned => "partitioned by day",
        }
    }
}

/// What a leg runs: one transaction per event, or batches of 1,000 to the batch handler.
#[derive(Clone, Copy)]
enum Path {
    PerEvent,
    Batched,
}

impl Path {
    fn label(self) -> &'static str {
        match self {
            Path::PerEvent => "per-event (1 partition)",
            Path::Batched => "batched 1000 (batch handler)",
        }
    }
}

/// The name of a leg: its path and layout, on the empty table (`grown` false) or the grown one. No name contains
/// the name of a leg on the usual tables (`idem per-event, 1 partition(s)`), so that `--only` picks either alone.
pub(super) fn name(path: &str, layout: &str, grown: Option<u64>) -> String {
    match grown {
        Some(markers) => format!("grown: idem {path}, {layout} markers, {markers} already there"),
        None => format!("grown: idem {path}, {layout} markers, empty"),
    }
}

/// The (grown, empty) leg name pairs, for the ratios.
pub(super) fn pairs(markers: u64) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for layout in [Layout::Plain, Layout::Partitioned] {
        for path in [Path::PerEvent, Path::Batched] {
            out.push((
                format!("{} on {} markers ÷ empty, {}", path.label(), markers, layout.label()),
                name(path.label(), layout.label(), Some(markers)),
                name(path.label(), layout.label(), None),
            ));
        }
    }
    out
}

/// Runs the wanted legs of both layouts; each layout's grown table is loaded once.
pub(super) async fn run(
    pool: &PgPool,
    args: &BenchArgs,
    work: &Workload,
    wanted: &dyn Fn(&str) -> bool,
    progress: &dyn Fn(&str),
) -> anyhow::Result<Vec<Leg>> {
    let markers = args.grown_markers;
    let mut legs = Vec::new();
    for layout in [Layout::Plain, Layout::Partitioned] {
        let paths: Vec<Path> = [Path::PerEvent, Path::Batched]
            .into_iter()
            .filter(|p| {
                wanted(&name(p.label(), layout.label(), Some(markers)))
                    || wanted(&name(p.label(), layout.label(), None))
            })
            .collect();
        if paths.is_empty() {
            continue;
        }
        progress(&format!("grown: loading {markers} markers, {} layout", layout.label()));
        let (empty, grown, loaded_at) = prepare(pool, args, layout, markers).await?;
        for path in paths {
            let empty_name = name(path.label(), layout.label(), None);
            let grown_name = name(path.label(), layout.label(), Some(markers));
            progress(&format!("{empty_name} / {grown_name}"));
            let (mut empty_runs, mut grown_runs) = (Vec::new(), Vec::new());
            for _ in 0..args.runs {
                empty_runs.push(leg(pool, args, work, &empty, layout, path, None).await?);
                grown_runs.push(leg(pool, args, work, &grown, layout, path, Some(loaded_at)).await?);
            }
            legs.push(Leg::new(empty_name, empty_runs));
            legs.push(Leg::new(grown_name, grown_runs));
        }
        drop_grown(pool).await?;
    }
    Ok(legs)
}

/// The empty table (`bench_`) and the grown one (`bench_grown_`) in `layout`; returns both and the time the
/// load's markers end at (every marker a leg writes is later).
async fn prepare(
    pool: &PgPool,
    args: &BenchArgs,
    layout: Layout,
    markers: u64,
) -> anyhow::Result<(Tables, Tables, f64)> {
    let empty = fresh_tables(pool, args.accounts).await?;
    drop_grown(pool).await?;
    let grown = Tables::new(None, GROWN)?;
    idem::migrate(pool, &grown).await?;
    if let Layout::Partitioned = layout {
        // One marker on each of the last eleven days (the load spans ten days back from now, so eleven UTC dates),
        // so that the conversion makes their partitions.
        sqlx::query(&format!(
            r#"INSERT INTO {GROWN}processed_events (consumer_group, event_id, topic, partition, "offset", processed_at)
               SELECT $1, 'seed-' || d, 'payments', -1, d, now() - make_interval(days => d) FROM generate_series(0, 10) d"#
        ))
        .bind(GROUP)
        .execute(pool)
        .await?;
        for tables in [&empty, &grown] {
            idem::store::partitions::convert(pool, tables, Some(PartitionPeriod::Day), 7).await?;
        }
    }
    let indexes = drop_indexes(pool).await?;
    let started = Instant::now();
    let loaded_at: f64 = sqlx::query_scalar("SELECT extract(epoch FROM now())::float8").fetch_one(pool).await?;
    let partition_key = match layout {
        Layout::Plain => ("", ""),
        Layout::Partitioned => (", processed_on", ", (t AT TIME ZONE 'UTC')::date"),
    };
    sqlx::query(&format!(
        r#"INSERT INTO {GROWN}processed_events
             (consumer_group, event_id, topic, partition, "offset", processed_at{})
           SELECT $1, 'pay-' || md5(i::text), 'payments', -1, i, t{}
             FROM generate_series(1, $2) i,
                  LATERAL (SELECT to_timestamp($3) - make_interval(secs => (i % 863000) + 1) AS t) s"#,
        partition_key.0, partition_key.1
    ))
    .bind(GROUP)
    .bind(i64::try_from(markers)?)
    .bind(loaded_at)
    .execute(pool)
    .await?;
    for statement in indexes {
        sqlx::query(&statement).execute(pool).await?;
    }
    sqlx::query(&format!("VACUUM ANALYZE {GROWN}processed_events")).execute(pool).await?;
    sqlx::query("CHECKPOINT").execute(pool).await?;
    eprintln!("bench: {markers} markers loaded in {:.0} s (untimed)", started.elapsed().as_secs_f64());
    Ok((empty, grown, loaded_at))
}

/// Drops the grown table's indexes and key; returns the statements that build them again.
async fn drop_indexes(pool: &PgPool) -> anyhow::Result<Vec<String>> {
    let table = format!("{GROWN}processed_events");
    let found: Vec<(String, String, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT x.indexrelid::regclass::text, pg_get_indexdef(x.indexrelid), c.conname::text,
                pg_get_constraintdef(c.oid)
           FROM pg_index x LEFT JOIN pg_constraint c ON c.conindid = x.indexrelid AND c.conrelid = x.indrelid
          WHERE x.indrelid = $1::regclass",
    )
    .bind(&table)
    .fetch_all(pool)
    .await?;
    let mut rebuild = Vec::new();
    for (index, definition, constraint, constraint_definition) in found {
        match (constraint, constraint_definition) {
            (Some(constraint), Some(definition)) => {
                sqlx::query(&format!("ALTER TABLE {table} DROP CONSTRAINT {constraint}")).execute(pool).await?;
                rebuild.push(format!("ALTER TABLE {table} ADD CONSTRAINT {constraint} {definition}"));
            }
            _ => {
                sqlx::query(&format!("DROP INDEX {index}")).execute(pool).await?;
                // A partitioned table's index reads `ON ONLY`: built again on every partition.
                rebuild.push(definition.replace(" ON ONLY ", " ON "));
            }
        }
    }
    if rebuild.is_empty() {
        bail!("grown: {table} has no index to drop and build again");
    }
    Ok(rebuild)
}

/// Drops every table of the grown prefix (idem's tables and the partitions).
async fn drop_grown(pool: &PgPool) -> anyhow::Result<()> {
    let tables: Vec<String> = sqlx::query_scalar("SELECT tablename::text FROM pg_tables WHERE tablename LIKE $1")
        .bind(format!("{}%", GROWN.replace('_', "\\_")))
        .fetch_all(pool)
        .await?;
    for table in tables {
        sqlx::query(&format!("DROP TABLE IF EXISTS {table} CASCADE")).execute(pool).await?;
    }
    Ok(())
}

/// One run on `tables`: the markers a run before wrote are deleted (on the grown table, those after
/// `loaded_at`), the accounts zeroed; then the engine consumes the workload and the ledger is checked.
async fn leg(
    pool: &PgPool,
    args: &BenchArgs,
    work: &Workload,
    tables: &Tables,
    layout: Layout,
    path: Path,
    loaded_at: Option<f64>,
) -> anyhow::Result<f64> {
    let markers = tables.table("processed_events");
    match loaded_at {
        Some(at) => {
            sqlx::query(&format!("DELETE FROM {markers} WHERE processed_at > to_timestamp($1)"))
                .bind(at)
                .execute(pool)
                .await?;
        }
        None => {
            sqlx::query(&format!("TRUNCATE {markers}")).execute(pool).await?;
        }
    }
    sqlx::query(&format!("UPDATE {PREFIX}accounts SET balance = 0")).execute(pool).await?;
    sqlx::query(&format!("VACUUM ANALYZE {markers}, {PREFIX}accounts")).execute(pool).await?;
    sqlx::query("CHECKPOINT").execute(pool).await?;

    let engine_pool = idem::postgres::connect(&args.database_url, 3).await?;
    let batch_size = match path {
        Path::PerEvent => 1,
        Path::Batched => 1_000,
    };
    let mut config =
        Config::new(GROUP, KeyExtractor::JsonPointer("/id".into())).batch_size(batch_size).tables(tables.clone());
    if let Layout::Partitioned = layout {
        config = config.partitioned(PartitionPeriod::Day, Duration::from_secs(3_600));
    }
    let engine = Engine::new(engine_pool.clone(), config)?;
    let source = MemorySource(std::sync::Mutex::new(messages(work, 1)));
    let before = ServerWork::read(pool).await?;
    let started = Instant::now();
    let stats = match path {
        Path::PerEvent => engine.run(source, CreditEach, std::future::pending::<()>()).await?,
        Path::Batched => engine.run_batched(source, CreditAll, std::future::pending::<()>()).await?,
    };
    let seconds = started.elapsed().as_secs_f64();
    engine_pool.close().await;
    // The engine's sessions report their statistics as they end.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = ServerWork::read(pool).await?;
    if stats.processed != work.unique {
        bail!("grown leg: processed {} of {} events", stats.processed, work.unique);
    }
    let n = work.deliveries.len() as f64;
    eprintln!(
        "bench: {}: per event {:.0} WAL bytes, {:.2} full-page images, {:.2} blocks read from outside shared buffers",
        name(path.label(), layout.label(), loaded_at.map(|_| args.grown_markers)),
        (after.wal_bytes - before.wal_bytes) / n,
        (after.wal_fpi - before.wal_fpi) as f64 / n,
        (after.blocks_read - before.blocks_read) as f64 / n,
    );
    let total: i64 = sqlx::query_scalar(&format!("SELECT COALESCE(sum(balance), 0)::bigint FROM {PREFIX}accounts"))
        .fetch_one(pool)
        .await?;
    let written: i64 =
        sqlx::query_scalar(&format!("SELECT count(*) FROM {markers} WHERE consumer_group = $1 AND partition >= 0"))
            .bind(GROUP)
            .fetch_one(pool)
            .await?;
    if total != work.expected_total || written != work.unique as i64 {
        bail!(
            "grown leg: ledger total {total} (expected {}), markers written {written} (expected {})",
            work.expected_total,
            work.unique
        );
    }
    Ok(work.deliveries.len() as f64 / seconds)
}

/// The server's running totals a leg's work is read from: WAL written (bytes, full-page images) and blocks read
/// into shared buffers (from the OS or the disk).
struct ServerWork {
    wal_bytes: f64,
    wal_fpi: i64,
    blocks_read: i64,
}

impl ServerWork {
    async fn read(pool: &PgPool) -> anyhow::Result<Self> {
        let (wal_bytes, wal_fpi, blocks_read): (f64, i64, i64) = sqlx::query_as(
            "SELECT w.wal_bytes::float8, w.wal_fpi, d.blks_read
               FROM pg_stat_wal w, pg_stat_database d WHERE d.datname = current_database()",
        )
        .fetch_one(pool)
        .await?;
        Ok(ServerWork { wal_bytes, wal_fpi, blocks_read })
    }
}
