//! The engine consuming the embedded log: order per partition, acknowledgement after commit, restart and
//! resume, batch handlers, dead-letter replay, transient PostgreSQL failures.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};

use common::{Ledger, TestPool, config, ledger_rows, ledger_total, markers, temp_dir};
use idem::dead_letter::{ReplayRisk, Replayed, Safety};
use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::{Backend, BatchHandler, Engine, Event, Handler, HandlerError, Publisher, Tables};

type Pool<DB> = sqlx::Pool<DB>;

fn until_end() -> ConsumerOptions {
    ConsumerOptions { stop_at_end: true, ..ConsumerOptions::default() }
}

fn produce(log: &EmbeddedLog, from: i64, to: i64, extra: &str) -> i64 {
    let producer = log.producer();
    let mut total = 0;
    for n in from..to {
        let payload = format!(r#"{{"id":"p{n}","amount":{n}{extra}}}"#);
        producer.send("payments", Some(format!("acct-{}", n % 13).as_bytes()), payload.as_bytes(), &[]).unwrap();
        total += n;
    }
    producer.flush().unwrap();
    total
}

/// Consumes a 4-partition log to its end with several batch sizes; a restarted consumer resumes after the
/// acknowledged offsets; a second pass over a rewound group absorbs every message as a duplicate.
async fn consume_resume_and_replay_whole_log<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    common::setup(&pool).await;
    let dir = temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 4).unwrap();
    let first_total = produce(&log, 0, 500, "");
    let engine = Engine::new(pool.clone(), config(50)).unwrap();
    let source = log.consumer("ledger-writer", &["payments"], until_end()).unwrap();
    let stats = engine.run(source, Ledger::default(), std::future::pending::<()>()).await.unwrap();
    assert_eq!(stats.processed, 500);
    assert_eq!(ledger_total(&pool).await, first_total);
    assert_eq!(log.committed("ledger-writer", "payments").unwrap(), log.end_offsets("payments").unwrap());

    // More events; a new consumer process (a new engine) starts after the committed offsets.
    let second_total = produce(&log, 500, 800, "");
    let engine = Engine::new(pool.clone(), config(1)).unwrap();
    let source = log.consumer("ledger-writer", &["payments"], until_end()).unwrap();
    let stats = engine.run(source, Ledger::default(), std::future::pending::<()>()).await.unwrap();
    assert_eq!((stats.processed, stats.duplicate), (300, 0), "only the new events are delivered");
    assert_eq!(ledger_total(&pool).await, first_total + second_total);

    // Offsets lost (a consumer reset to the earliest offset): everything comes again, nothing is applied twice.
    std::fs::remove_dir_all(dir.0.join("groups")).unwrap();
    let engine = Engine::new(pool.clone(), config(100)).unwrap();
    let source = log.consumer("ledger-writer", &["payments"], until_end()).unwrap();
    let stats = engine.run(source, Ledger::default(), std::future::pending::<()>()).await.unwrap();
    assert_eq!((stats.processed, stats.duplicate), (0, 800));
    assert_eq!(ledger_total(&pool).await, first_total + second_total);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM ledger").await, 800);
}
on_every_store!(consume_resume_and_replay_whole_log);

/// The batch handler sees only the new events of a batch, in offset order per partition.
struct BulkCredit {
    calls: AtomicUsize,
    out_of_order: AtomicUsize,
}

macro_rules! bulk_credit {
    ($db:ty, $conn:ty, $insert:literal) => {
        impl BatchHandler<$db> for BulkCredit {
            async fn handle_batch(&self, events: &[&Event], tx: &mut $conn) -> Result<(), HandlerError> {
                self.calls.fetch_add(1, Ordering::SeqCst);
                if events.windows(2).any(|w| {
                    w[0].message.partition != w[1].message.partition || w[0].message.offset >= w[1].message.offset
                }) {
                    self.out_of_order.fetch_add(1, Ordering::SeqCst);
                }
                let total: i64 = events
                    .iter()
                    .map(|e| e.json::<serde_json::Value>().map(|v| v["amount"].as_i64().unwrap_or(0)))
                    .sum::<Result<i64, _>>()?;
                sqlx::query($insert).bind(format!("bulk-{}", events[0].id)).bind(total).execute(&mut *tx).await?;
                Ok(())
            }
        }
    };
}
bulk_credit!(sqlx::Postgres, sqlx::PgConnection, "INSERT INTO ledger (event_id, amount) VALUES ($1, $2)");
bulk_credit!(sqlx::Sqlite, sqlx::SqliteConnection, "INSERT INTO ledger (event_id, amount) VALUES ($1, $2)");
bulk_credit!(sqlx::MySql, sqlx::MySqlConnection, "INSERT INTO ledger (event_id, amount) VALUES (?, ?)");

async fn batch_handler_applies_in_bulk<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    BulkCredit: BatchHandler<DB>,
{
    common::setup(&pool).await;
    let dir = temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 2).unwrap();
    let total = produce(&log, 0, 1000, "");
    produce(&log, 0, 100, ""); // producer retries: ids p0..p99 again
    let engine = Engine::new(pool.clone(), config(200)).unwrap();
    let handler = BulkCredit { calls: AtomicUsize::new(0), out_of_order: AtomicUsize::new(0) };
    let source = log.consumer("ledger-writer", &["payments"], until_end()).unwrap();
    let stats = engine.run_batched(source, handler, std::future::pending::<()>()).await.unwrap();
    assert_eq!((stats.processed, stats.duplicate), (1000, 100));
    assert_eq!(ledger_total(&pool).await, total);
    assert!(pool.scalar("SELECT COUNT(*) FROM ledger").await < 100, "effects are applied in bulk");
}
on_every_store!(batch_handler_applies_in_bulk);

/// A poison message is dead-lettered; after the cause is fixed, `replay` re-delivers the stored message and
/// it is applied once; a replay that fails again keeps its row.
async fn dead_letter_replay<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    common::setup(&pool).await;
    let dir = temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 1).unwrap();
    pool.exec("INSERT INTO blocked (id) VALUES ('p3'), ('p5')").await;
    let total = produce(&log, 0, 8, "");
    let run = || async {
        let engine = Engine::new(pool.clone(), config(10)).unwrap();
        let source = log.consumer("ledger-writer", &["payments"], until_end()).unwrap();
        engine.run(source, Ledger::default(), std::future::pending::<()>()).await.unwrap()
    };
    let stats = run().await;
    assert_eq!((stats.processed, stats.dead_lettered), (6, 2));
    assert_eq!(ledger_total(&pool).await, total - 3 - 5);

    let tables = Tables::default();
    let letters = idem::dead_letter::list(&pool, &tables, None, 10).await.unwrap();
    assert_eq!(letters.iter().map(|l| l.event_id.clone().unwrap()).collect::<Vec<_>>(), ["p3", "p5"]);
    assert!(letters[0].error.contains("blocked"));

    // The operator unblocks p3 only and replays both.
    pool.exec("DELETE FROM blocked WHERE id = 'p3'").await;
    let producer = log.producer();
    for letter in &letters {
        assert_eq!(replay(&pool, &producer, letter, Safety::Checked).await, Replayed::Published);
    }
    assert_eq!(markers(&pool, "p3").await, 0, "replay removed the marker");
    let stats = run().await;
    assert_eq!((stats.processed, stats.dead_lettered), (1, 1));
    assert_eq!(ledger_rows(&pool, "p3").await, 1);
    assert_eq!(ledger_total(&pool).await, total - 5);
    let left = idem::dead_letter::list(&pool, &tables, None, 10).await.unwrap();
    assert_eq!(left.len(), 1);
    // p5 failed again after its replay: a new dead letter, the replayed row itself is gone.
    assert_eq!((left[0].event_id.as_deref(), left[0].status.as_str()), (Some("p5"), "dead"));
    assert_ne!(left[0].id, letters[1].id);
    // Replaying a row that is gone is refused rather than publishing twice.
    assert_eq!(replay(&pool, &producer, &letters[0], Safety::Checked).await, Replayed::Gone);
}
on_every_store!(dead_letter_replay);

async fn replay<DB: Backend>(
    pool: &Pool<DB>,
    producer: &idem::embedded::LogProducer,
    letter: &idem::store::DeadLetter,
    safety: Safety,
) -> Replayed {
    idem::dead_letter::replay(pool, &Tables::default(), producer, letter, safety).await.unwrap()
}

/// A replay that could apply an effect twice is refused: a letter older than every marker its group keeps
/// (pruned markers) unless forced, a letter whose event was applied after it failed always. A replay cut
/// between its publish and its last step, replayed again, keeps the applied copy's marker: applied once.
async fn dead_letter_replay_never_applies_twice<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    common::setup(&pool).await;
    let dir = temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 1).unwrap();
    pool.exec("INSERT INTO blocked (id) VALUES ('p1'), ('p2'), ('p3')").await;
    produce(&log, 0, 5, "");
    let run = || async {
        let engine = Engine::new(pool.clone(), config(10)).unwrap();
        let source = log.consumer("ledger-writer", &["payments"], until_end()).unwrap();
        engine.run(source, Ledger::default(), std::future::pending::<()>()).await.unwrap()
    };
    assert_eq!(run().await.dead_lettered, 3);
    pool.exec("DELETE FROM blocked").await;
    let tables = Tables::default();
    let letters = idem::dead_letter::list(&pool, &tables, None, 10).await.unwrap();
    let producer = log.producer();

    // p3: its marker is newer than its failure (a copy was applied after the marker of its failure was
    // pruned): refused, forced or not.
    let aged = Pool::<DB>::TEN_DAYS_EARLIER.replace("processed_at", "last_failed_at");
    pool.exec(&format!("UPDATE dead_letters SET last_failed_at = {aged} WHERE event_id = 'p3'")).await;
    for safety in [Safety::Checked, Safety::Forced] {
        let refused = replay(&pool, &producer, &letters[2], safety).await;
        assert_eq!(refused, Replayed::Refused(ReplayRisk::AppliedSince));
    }
    assert_eq!(markers(&pool, "p3").await, 1, "a refused replay keeps the marker");

    // p1: step 1 and the publish ran, the copy was applied, the last step never ran; a second replay must not
    // delete the applied copy's marker.
    let start = DB::begin_replay(&pool, &tables, letters[0].id, false, false).await.unwrap();
    assert_eq!(start, idem::store::ReplayStart::Started);
    let mut copy = letters[0].message();
    copy.headers.push((idem::dead_letter::REPLAY_FOR_HEADER.into(), letters[0].consumer_group.clone().into_bytes()));
    producer.publish(&copy).await.unwrap();
    assert_eq!(run().await.processed, 1);
    // Within its lease the first replay is another operator's at work: nothing is done.
    assert!(matches!(replay(&pool, &producer, &letters[0], Safety::Checked).await, Replayed::Busy { .. }));
    // Its process died between its steps: once the lease ran out, a second replay resumes it.
    pool.exec("UPDATE dead_letters SET replay_started_at_ms = 1 WHERE event_id = 'p1'").await;
    assert_eq!(replay(&pool, &producer, &letters[0], Safety::Checked).await, Replayed::Published);
    assert_eq!(run().await.duplicate, 1, "the second copy is absorbed by the first copy's marker");
    assert_eq!(ledger_rows(&pool, "p1").await, 1);

    // p2: every marker of the group is gone (pruned): refused, then forced.
    pool.exec("DELETE FROM processed_events").await;
    let refused = replay(&pool, &producer, &letters[1], Safety::Checked).await;
    assert_eq!(refused, Replayed::Refused(ReplayRisk::MarkersPruned));
    assert!(ReplayRisk::MarkersPruned.explain(&letters[1]).contains("--force"));
    // A check (a dry run) says what a replay would do and changes nothing.
    let check = |safety| idem::dead_letter::check_replay(&pool, &tables, &letters[1], safety);
    assert_eq!(check(Safety::Checked).await.unwrap(), Replayed::Refused(ReplayRisk::MarkersPruned));
    assert_eq!(check(Safety::Forced).await.unwrap(), Replayed::Published);
    let still = idem::dead_letter::list(&pool, &tables, None, 10).await.unwrap();
    assert!(still.iter().any(|l| l.id == letters[1].id && l.status == "dead"), "a check leaves the row: {still:?}");
    assert_eq!(ledger_rows(&pool, "p2").await, 0);
    assert_eq!(replay(&pool, &producer, &letters[1], Safety::Forced).await, Replayed::Published);
    assert_eq!(run().await.processed, 1);
    assert_eq!(ledger_rows(&pool, "p2").await, 1);
}
on_every_store!(dead_letter_replay_never_applies_twice);

/// Serialization failures (40001), deadlocks (40P01) and a lost connection are retried, and the event is
/// applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_transient_errors_are_retried() {
    let db = common::pg().await;
    common::setup(&db.pool).await;
    struct Troubled(AtomicUsize);
    impl Handler<sqlx::Postgres> for Troubled {
        async fn handle(&self, event: &Event, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
            let trouble = match self.0.fetch_add(1, Ordering::SeqCst) {
                0 => "DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$",
                1 => "DO $$ BEGIN RAISE EXCEPTION 'deadlock' USING ERRCODE = '40P01'; END $$",
                2 => "SELECT pg_terminate_backend(pg_backend_pid())",
                _ => "SELECT 1",
            };
            sqlx::query(trouble).execute(&mut *tx).await?;
            sqlx::query("INSERT INTO ledger (event_id, amount) VALUES ($1, 1)")
                .bind(&event.id)
                .execute(&mut *tx)
                .await?;
            Ok(())
        }
    }
    let engine = Engine::new(db.pool.clone(), config(1)).unwrap();
    let outcomes =
        engine.process(vec![common::payment(0, 0, "t1", 1, "")], &Troubled(AtomicUsize::new(0))).await.unwrap();
    assert_eq!(outcomes, [idem::Outcome::Processed]);
    assert_eq!(engine.stats().retried, 3);
    assert_eq!(ledger_rows(&db.pool, "t1").await, 1);
    assert_eq!(markers(&db.pool, "t1").await, 1);
}

/// A non-retryable database error of idem's own (its tables are missing) stops the engine with an error
/// instead of acknowledging anything.
#[tokio::test]
async fn missing_tables_stop_the_engine_without_acknowledging() {
    let db = common::sqlite().await;
    let dir = temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 1).unwrap();
    produce(&log, 0, 3, "");
    let engine = Engine::new(db.pool.clone(), config(10)).unwrap();
    let source = log.consumer("ledger-writer", &["payments"], until_end()).unwrap();
    let err = engine.run(source, Ledger::default(), std::future::pending::<()>()).await.unwrap_err();
    assert!(err.to_string().contains("processed_events"), "{err}");
    assert_eq!(log.committed("ledger-writer", "payments").unwrap(), [0]);
}

/// A hole in a producer's sequence numbers is counted as lost events; redeliveries are not.
#[tokio::test]
async fn sequence_gaps_count_lost_events() {
    let db = common::sqlite().await;
    common::setup(&db.pool).await;
    let dir = temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 1).unwrap();
    let producer = log.producer();
    for seq in [1u64, 2, 3, 6, 7, 3, 8] {
        let headers = vec![
            (idem::gap::PRODUCER_ID_HEADER.to_owned(), b"producer-a".to_vec()),
            (idem::gap::SEQUENCE_HEADER.to_owned(), seq.to_string().into_bytes()),
        ];
        let payload = format!(r#"{{"id":"s{seq}","amount":1}}"#);
        producer.send("payments", None, payload.as_bytes(), &headers).unwrap();
    }
    let engine = Engine::new(db.pool.clone(), config(3)).unwrap();
    let source = log.consumer("ledger-writer", &["payments"], until_end()).unwrap();
    let stats = engine.run(source, Ledger::default(), std::future::pending::<()>()).await.unwrap();
    assert_eq!(stats.lost, 2, "4 and 5 never arrived");
    assert_eq!((stats.processed, stats.duplicate), (6, 1));
}

/// A handler that panics stops the engine with an error instead of leaving its partition silently stalled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_stops_the_engine() {
    struct Panics;
    impl Handler<sqlx::Sqlite> for Panics {
        async fn handle(&self, _event: &Event, _tx: &mut sqlx::SqliteConnection) -> Result<(), HandlerError> {
            panic!("handler bug");
        }
    }
    let db = common::sqlite().await;
    common::setup(&db.pool).await;
    let dir = temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 1).unwrap();
    produce(&log, 0, 3, "");
    let engine = Engine::new(db.pool.clone(), config(10)).unwrap();
    let source = log.consumer("ledger-writer", &["payments"], ConsumerOptions::default()).unwrap();
    let run = engine.run(source, Panics, std::future::pending::<()>());
    let err =
        tokio::time::timeout(std::time::Duration::from_secs(20), run).await.expect("the engine stops").unwrap_err();
    assert!(matches!(err, idem::Error::Worker(_)), "{err}");
    assert_eq!(log.committed("ledger-writer", "payments").unwrap(), [0], "nothing acknowledged");
}

/// A busy consumer starts each batch in the transaction its last commit opened; once it has nothing to do, those
/// transactions are rolled back within a fraction of a second, so an idle consumer leaves no connection "idle in
/// transaction", and none is left once the run returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_consumer_keeps_no_transaction_open() {
    async fn open_transactions(pool: &sqlx::PgPool) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()
                AND state LIKE 'idle in transaction%'",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    }
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let dir = temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 3).unwrap();
    let total = produce(&log, 0, 300, "");
    let pool = idem::postgres::connect(&db.url, 5).await.unwrap();
    let engine = Engine::new(pool.clone(), config(1)).unwrap();
    let source = log.consumer("ledger-writer", &["payments"], ConsumerOptions::default()).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn({
        let engine = engine.clone();
        async move { engine.run(source, Ledger::default(), stopped).await }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while ledger_total(&db.pool).await != total {
        assert!(std::time::Instant::now() < deadline, "the events were not applied");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // Still running, with nothing to do.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert!(!run.is_finished());
    assert_eq!(open_transactions(&db.pool).await, 0, "an idle consumer holds no open transaction");
    // New work after the pause is applied as before.
    let more = produce(&log, 300, 330, "");
    while ledger_total(&db.pool).await != total + more {
        assert!(std::time::Instant::now() < deadline, "the later events were not applied");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    let stats = run.await.unwrap().unwrap();
    assert_eq!(stats.processed, 330);
    assert_eq!(open_transactions(&db.pool).await, 0, "none is left once the run has returned");
    pool.close().await;
}
