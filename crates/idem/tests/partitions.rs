//! The partitioned marker layout (PostgreSQL only): conversion, partitions created ahead and dropped whole,
//! duplicates caught across a partition boundary within the redelivery window, and the layout guards.

mod common;

use std::sync::Mutex;
use std::time::Duration;

use common::{Ledger, TestPool, config, ledger_rows, payment};
use idem::store::partitions;
use idem::{Engine, Error, Event, Handler, HandlerError, Outcome, PartitionPeriod, Tables};
use sqlx::PgConnection;

const HOUR: Duration = Duration::from_secs(3_600);

async fn partition_exists(pool: &sqlx::PgPool, name: &str) -> bool {
    let found: Option<String> =
        sqlx::query_scalar("SELECT to_regclass($1)::text").bind(name).fetch_one(pool).await.unwrap();
    found.is_some()
}

async fn utc_day(pool: &sqlx::PgPool, days_from_today: i32) -> String {
    sqlx::query_scalar("SELECT to_char((now() AT TIME ZONE 'UTC')::date + $1, 'YYYYMMDD')")
        .bind(days_from_today)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A consumer configured for partitions refuses a plain table (and the other way round), naming the command
/// that converts it; the conversion keeps every marker, so duplicates are still caught afterwards.
#[tokio::test]
async fn conversion_keeps_markers_and_the_layout_is_checked_at_start() {
    let db = common::pg().await;
    let pool = &db.pool;
    common::setup(pool).await;
    let plain = Engine::new(pool.clone(), config(10)).unwrap();
    let before: Vec<_> = (0..20).map(|i| payment(0, i, &format!("e-{i}"), 1, "")).collect();
    plain.process(before.clone(), &Ledger::default()).await.unwrap();

    let partitioned = || Engine::new(pool.clone(), config(10).partitioned(PartitionPeriod::Day, HOUR)).unwrap();
    let refused = partitioned().process(before.clone(), &Ledger::default()).await.unwrap_err();
    assert!(matches!(&refused, Error::Config(m) if m.contains("idem markers convert --to partitioned")), "{refused}");

    let tables = Tables::default();
    assert_eq!(partitions::convert(pool, &tables, Some(PartitionPeriod::Day), 3).await.unwrap(), 20);
    assert_eq!(partitions::stored_period(pool, &tables).await.unwrap(), Some(PartitionPeriod::Day));
    for day in 0..=3 {
        assert!(partition_exists(pool, &format!("processed_events_p{}", utc_day(pool, day).await)).await);
    }

    let engine = partitioned();
    let outcomes = engine.process(before, &Ledger::default()).await.unwrap();
    assert!(outcomes.iter().all(|o| *o == idem::Outcome::Duplicate), "{outcomes:?}");
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM ledger").await, 20);
    engine.process(vec![payment(0, 20, "e-20", 1, "")], &Ledger::default()).await.unwrap();
    assert_eq!(ledger_rows(pool, "e-20").await, 1);

    let refused = Engine::new(pool.clone(), config(10)).unwrap().process(vec![], &Ledger::default()).await;
    assert!(matches!(&refused, Err(Error::Config(m)) if m.contains("partitioned by day")), "{refused:?}");

    // And back: one marker per event, the layout plain again.
    assert_eq!(partitions::convert(pool, &tables, None, 3).await.unwrap(), 21);
    assert_eq!(partitions::stored_period(pool, &tables).await.unwrap(), None);
    let outcomes = plain.process(vec![payment(0, 20, "e-20", 1, "")], &Ledger::default()).await.unwrap();
    assert_eq!(outcomes, [idem::Outcome::Duplicate]);
}

/// A marker in the previous day's partition that is younger than the redelivery window catches the
/// redelivery; one older than the window does not (the layout's documented limit).
#[tokio::test]
async fn duplicates_are_caught_across_the_boundary_within_the_window() {
    let db = common::pg().await;
    let pool = &db.pool;
    common::setup(pool).await;
    partitions::convert(pool, &Tables::default(), Some(PartitionPeriod::Day), 2).await.unwrap();
    // Yesterday's partition, and two markers in it: one second before midnight, and one a day before that.
    let yesterday = utc_day(pool, -1).await;
    pool.exec(&format!(
        "CREATE TABLE processed_events_p{yesterday} PARTITION OF processed_events
           FOR VALUES FROM ((now() AT TIME ZONE 'UTC')::date - 1) TO ((now() AT TIME ZONE 'UTC')::date)"
    ))
    .await;
    pool.exec(
        "INSERT INTO processed_events (consumer_group, event_id, topic, partition, \"offset\", processed_at, processed_on)
         VALUES ('ledger-writer', 'late', 'payments', 0, 1,
                 date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - interval '1 second',
                 (now() AT TIME ZONE 'UTC')::date - 1),
                ('ledger-writer', 'too-late', 'payments', 0, 2,
                 date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - interval '25 hours',
                 (now() AT TIME ZONE 'UTC')::date - 1)",
    )
    .await;
    // A delivery that began after midnight and committed first has its marker in tomorrow's partition.
    pool.exec(
        "INSERT INTO processed_events (consumer_group, event_id, topic, partition, \"offset\", processed_on)
         VALUES ('ledger-writer', 'early', 'payments', 0, 3, (now() AT TIME ZONE 'UTC')::date + 1)",
    )
    .await;
    // A window of just under a day reaches over midnight either way whatever the time of day (bar 2 s of it).
    let window = Duration::from_secs(86_399);
    let engine = Engine::new(pool.clone(), config(10).partitioned(PartitionPeriod::Day, window)).unwrap();
    let deliveries =
        vec![payment(0, 1, "late", 1, ""), payment(0, 2, "too-late", 1, ""), payment(0, 3, "early", 1, "")];
    let outcomes = engine.process(deliveries, &Ledger::default()).await.unwrap();
    assert_eq!(outcomes, [idem::Outcome::Duplicate, idem::Outcome::Processed, idem::Outcome::Duplicate]);
    assert_eq!(ledger_rows(pool, "early").await, 0);
    assert_eq!(ledger_rows(pool, "late").await, 0);
    assert_eq!(ledger_rows(pool, "too-late").await, 1, "older than the window: not caught, as documented");
}

/// Near a boundary the claim takes a lock per event id: concurrent deliveries of one event from separate
/// connections still apply it once.
#[tokio::test]
async fn concurrent_deliveries_near_a_boundary_apply_once() {
    let db = common::pg().await;
    let pool = &db.pool;
    common::setup(pool).await;
    partitions::convert(pool, &Tables::default(), Some(PartitionPeriod::Day), 2).await.unwrap();
    let window = Duration::from_secs(86_399);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let engine = Engine::new(pool.clone(), config(10).partitioned(PartitionPeriod::Day, window)).unwrap();
        tasks.push(tokio::spawn(async move {
            engine.process(vec![payment(0, 1, "once", 5, "")], &Ledger::default()).await.unwrap()
        }));
    }
    let mut processed = 0;
    for task in tasks {
        processed += task.await.unwrap().iter().filter(|o| **o == idem::Outcome::Processed).count();
    }
    assert_eq!(processed, 1);
    assert_eq!(ledger_rows(pool, "once").await, 1);
}

/// A handler that records how many advisory locks its transaction holds when it runs.
#[derive(Default)]
struct LocksHeld(Mutex<Vec<i64>>);

impl Handler<sqlx::Postgres> for LocksHeld {
    async fn handle(&self, _event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let held: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()")
                .fetch_one(&mut *tx)
                .await?;
        self.0.lock().unwrap().push(held);
        Ok(())
    }
}

/// Away from a boundary the claim is one statement and takes no lock, duplicates included; within the window of
/// a boundary it takes the lock of every event id of the batch before claiming. The handler's transaction shows
/// which.
#[tokio::test]
async fn the_claim_takes_its_locks_only_near_a_boundary() {
    let db = common::pg().await;
    let pool = &db.pool;
    common::setup(pool).await;
    partitions::convert(pool, &Tables::default(), Some(PartitionPeriod::Day), 2).await.unwrap();

    // A window of just under a day: always near a boundary.
    let near =
        Engine::new(pool.clone(), config(10).partitioned(PartitionPeriod::Day, Duration::from_secs(86_399))).unwrap();
    let handler = LocksHeld::default();
    let outcomes = near.process(vec![payment(0, 1, "n1", 1, ""), payment(0, 2, "n2", 1, "")], &handler).await.unwrap();
    assert_eq!(outcomes, [Outcome::Processed, Outcome::Processed]);
    assert_eq!(*handler.0.lock().unwrap(), [2, 2], "one lock per event id of the batch");
    let outcomes = near.process(vec![payment(0, 1, "n1", 1, "")], &handler).await.unwrap();
    assert_eq!(outcomes, [Outcome::Duplicate]);

    // A window of a minute: away from a boundary, unless this runs within two minutes of midnight (UTC).
    let from_midnight: f64 = sqlx::query_scalar(
        "SELECT least(EXTRACT(EPOCH FROM (now() AT TIME ZONE 'UTC') - date_trunc('day', now() AT TIME ZONE 'UTC')),
                      EXTRACT(EPOCH FROM date_trunc('day', now() AT TIME ZONE 'UTC') + interval '1 day'
                                         - (now() AT TIME ZONE 'UTC')))::float8",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    if from_midnight < 120.0 {
        eprintln!("skipped: {from_midnight:.0} s from midnight (UTC), within the window");
        return;
    }
    let away =
        Engine::new(pool.clone(), config(10).partitioned(PartitionPeriod::Day, Duration::from_secs(60))).unwrap();
    let handler = LocksHeld::default();
    let outcomes = away.process(vec![payment(0, 3, "a1", 1, "")], &handler).await.unwrap();
    assert_eq!(outcomes, [Outcome::Processed]);
    // Every event a duplicate: the claim claims nothing, and is run again (still no lock) to be sure.
    let outcomes = away.process(vec![payment(0, 3, "a1", 1, "")], &handler).await.unwrap();
    assert_eq!(outcomes, [Outcome::Duplicate]);
    let outcomes = away.process(vec![payment(0, 4, "a2", 1, ""), payment(0, 3, "a1", 1, "")], &handler).await.unwrap();
    assert_eq!(outcomes, [Outcome::Processed, Outcome::Duplicate]);
    assert_eq!(*handler.0.lock().unwrap(), [0, 0], "no lock away from a boundary");
}

/// Pruning the partitioned layout drops whole partitions past the retention and keeps the others intact;
/// a dry run drops nothing.
#[tokio::test]
async fn pruning_drops_whole_partitions_past_the_retention() {
    let db = common::pg().await;
    let pool = &db.pool;
    common::setup(pool).await;
    pool.exec(
        "INSERT INTO processed_events (consumer_group, event_id, topic, partition, \"offset\", processed_at)
         SELECT 'g', 'e-' || i, 't', 0, i, now() - (i % 20) * interval '1 day' FROM generate_series(1, 400) i",
    )
    .await;
    let tables = Tables::default();
    partitions::convert(pool, &tables, Some(PartitionPeriod::Day), 2).await.unwrap();
    let week = Duration::from_secs(7 * 86_400);
    let expired = partitions::expired(pool, &tables, week).await.unwrap();
    // Days 8 to 19 back end at least a week ago; day 7 back ends less than a week ago.
    assert_eq!(expired.len(), 12, "{expired:?}");
    assert_eq!(expired.iter().map(|p| p.markers).sum::<i64>(), 12 * 20);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM processed_events").await, 400, "a dry run drops nothing");

    let report = partitions::maintain(pool, &tables, PartitionPeriod::Day, 4, Some(week)).await.unwrap();
    assert_eq!(report.dropped.len(), 12);
    assert_eq!(report.markers_dropped, 240);
    assert_eq!(report.created.len(), 2, "days 3 and 4 ahead");
    assert!(!partition_exists(pool, &format!("processed_events_p{}", utc_day(pool, -8).await)).await);
    assert!(partition_exists(pool, &format!("processed_events_p{}", utc_day(pool, -7).await)).await);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM processed_events").await, 160);
    let young = "SELECT COUNT(*) FROM processed_events WHERE processed_at > now() - interval '7 days'";
    assert_eq!(pool.scalar(young).await, 140, "no marker younger than the retention went");
}

/// An event marked on two days (a redelivery later than the window) converts to month partitions: the
/// conversion keeps one marker per partition instead of failing on the primary key.
#[tokio::test]
async fn converting_days_to_months_keeps_one_marker_per_month() {
    let db = common::pg().await;
    let pool = &db.pool;
    common::setup(pool).await;
    let tables = Tables::default();
    partitions::convert(pool, &tables, Some(PartitionPeriod::Day), 2).await.unwrap();
    // Two consecutive days of one month among today and the two days ahead (whose partitions exist).
    pool.exec(
        "WITH t AS (SELECT (now() AT TIME ZONE 'UTC')::date AS d),
              first AS (SELECT CASE WHEN date_trunc('month', d) = date_trunc('month', d + 1) THEN d ELSE d + 1 END AS d
                          FROM t)
         INSERT INTO processed_events (consumer_group, event_id, topic, partition, \"offset\", processed_on)
         SELECT 'g', 'twice', 't', 0, n, first.d + n FROM first, generate_series(0, 1) n",
    )
    .await;
    partitions::convert(pool, &tables, Some(PartitionPeriod::Month), 2).await.unwrap();
    assert_eq!(partitions::stored_period(pool, &tables).await.unwrap(), Some(PartitionPeriod::Month));
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM processed_events WHERE event_id = 'twice'").await, 1);
}

/// A retention not longer than the redelivery window, or a prefix too long for partition names, is refused.
#[test]
fn partitioned_configuration_is_checked() {
    let short = config(10).partitioned(PartitionPeriod::Day, HOUR).marker_retention(HOUR);
    let err = short.validate().unwrap_err().to_string();
    assert!(err.contains("redelivery_window"), "{err}");
    let long = config(10).tables(Tables::new(None, &"p".repeat(38)).unwrap()).partitioned(PartitionPeriod::Day, HOUR);
    assert!(long.validate().unwrap_err().to_string().contains("table_prefix"));
}

/// SQLite has no partitions: the layout is refused at start with a reason.
#[tokio::test]
async fn sqlite_refuses_the_partitioned_layout() {
    let db = common::sqlite().await;
    common::setup(&db.pool).await;
    let engine = Engine::new(db.pool.clone(), config(10).partitioned(PartitionPeriod::Day, HOUR)).unwrap();
    let refused = engine.process(vec![payment(0, 1, "x", 1, "")], &Ledger::default()).await.unwrap_err();
    assert!(matches!(&refused, Error::Config(m) if m.contains("PostgreSQL")), "{refused}");
}
