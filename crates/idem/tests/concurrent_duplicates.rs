//! The same events in every partition, in slightly different orders, consumed at once (PostgreSQL): batches that
//! hold common events wait on each other's markers one way round only, so there is no deadlock, and every event
//! is applied once.

mod common;

use common::{Ledger, TestPool};
use idem::Engine;
use idem::embedded::{ConsumerOptions, EmbeddedLog};
use sqlx::{Connection, PgConnection};

const EVENTS: usize = 3000;
const PARTITIONS: i32 = 8;

/// Each of `partitions` partitions gets events 0..EVENTS, every window of 20 shuffled differently.
fn produce(dir: &std::path::Path, partitions: i32) -> EmbeddedLog {
    let log = EmbeddedLog::open(dir).unwrap();
    log.create_topic("payments", partitions).unwrap();
    let producer = log.producer();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for p in 0..partitions {
        let mut order: Vec<usize> = (0..EVENTS).collect();
        for window in order.chunks_mut(20) {
            for i in (1..window.len()).rev() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                window.swap(i, (state % (i as u64 + 1)) as usize);
            }
        }
        for n in order {
            producer
                .send_to("payments", p, None, format!(r#"{{"id":"e{n}","amount":{}}}"#, n % 13 + 1).as_bytes(), &[])
                .unwrap();
        }
    }
    producer.flush().unwrap();
    log
}

/// Consumes `partitions` copies of the events on a fresh database; returns it, the stats and the seconds taken.
async fn consume(partitions: i32) -> (common::TestPg, idem::StatsSnapshot, f64) {
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let dir = common::temp_dir();
    let log = produce(&dir.0, partitions);
    let pool = idem::postgres::connect(&db.url, partitions as u32 + 2).await.unwrap();
    let source = log
        .consumer("ledger-writer", &["payments"], ConsumerOptions { stop_at_end: true, ..Default::default() })
        .unwrap();
    let started = std::time::Instant::now();
    let stats = Engine::new(pool.clone(), common::config(100))
        .unwrap()
        .run(source, Ledger::default(), std::future::pending::<()>())
        .await
        .unwrap();
    let seconds = started.elapsed().as_secs_f64();
    pool.close().await;
    (db, stats, seconds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_across_partitions_never_deadlock() {
    let (db, stats, seconds) = consume(PARTITIONS).await;
    // For the record (not a check: speeds belong to the benchmark), the time against one partition alone.
    let (_, _, alone) = consume(1).await;
    eprintln!(
        "{PARTITIONS} partitions of the same {EVENTS} events: {seconds:.2} s; one partition: {alone:.2} s; ratio {:.2}",
        seconds / alone
    );

    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM ledger").await, EVENTS as i64);
    assert_eq!(db.pool.scalar("SELECT COUNT(DISTINCT event_id) FROM ledger").await, EVENTS as i64);
    assert_eq!(stats.processed, EVENTS as u64);
    assert_eq!(stats.duplicate, (EVENTS * (PARTITIONS as usize - 1)) as u64);
    assert_eq!(stats.retried, 0, "no transaction was rolled back and retried");
    // The backends exited with the pool, so their statistics are flushed.
    let name = db.url.rsplit('/').next().unwrap().to_owned();
    let mut admin = PgConnection::connect(&format!("{}/postgres", common::pg_server())).await.unwrap();
    let deadlocks: i64 = sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = $1")
        .bind(&name)
        .fetch_one(&mut admin)
        .await
        .unwrap();
    assert_eq!(deadlocks, 0, "deadlocks reported by pg_stat_database");
}
