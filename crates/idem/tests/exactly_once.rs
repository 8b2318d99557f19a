//! The guarantee itself, on every store (PostgreSQL, SQLite, MySQL/MariaDB): duplicates, rollbacks, poison messages,
//! missing keys, concurrent deliveries, batches. With consume.rs, kill_switch.rs and operations.rs: the store
//! conformance suite (`on_every_store!`).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Ledger, TestPool, config, ledger_rows, ledger_total, markers, payment, setup};
use idem::{Backend, Engine, Handler, Message, Outcome};

type Pool<DB> = sqlx::Pool<DB>;

/// The first test: the same message twice credits once.
async fn duplicate_does_not_double_apply<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let engine = Engine::new(pool.clone(), config(1)).unwrap();
    let ledger = Ledger::default();
    let first = engine.process(vec![payment(0, 0, "pay-1", 100, "")], &ledger).await.unwrap();
    let again = engine.process(vec![payment(0, 0, "pay-1", 100, "")], &ledger).await.unwrap();
    assert_eq!(first, [Outcome::Processed]);
    assert_eq!(again, [Outcome::Duplicate]);
    assert_eq!(ledger_total(&pool).await, 100, "balance must be 100, not 200");
    assert_eq!(ledger_rows(&pool, "pay-1").await, 1);
    assert_eq!(markers(&pool, "pay-1").await, 1);
    // The same id twice inside one batch, and a redelivery from another partition and offset.
    let batch = vec![payment(0, 1, "pay-2", 5, ""), payment(0, 2, "pay-2", 5, ""), payment(3, 9, "pay-1", 100, "")];
    let outcomes = engine.process(batch, &ledger).await.unwrap();
    assert_eq!(outcomes, [Outcome::Processed, Outcome::Duplicate, Outcome::Duplicate]);
    assert_eq!(ledger_total(&pool).await, 105);
    let stats = engine.stats();
    assert_eq!((stats.processed, stats.duplicate), (2, 3));
}
on_every_store!(duplicate_does_not_double_apply);

/// A handler that ends idem's transaction and writes again in one of its own (`ROLLBACK; BEGIN; INSERT`) cannot
/// commit that write without the marker: the check before `COMMIT` finds a transaction that is not idem's (on
/// PostgreSQL it lacks the claim's mark, on MySQL and SQLite idem's savepoint) and rolls it back. The message is
/// dead-lettered with the reason and its effect is absent, alone or in a batch; a later delivery finds the dead
/// letter's marker, never applying it a second time.
async fn a_handler_that_ends_the_transaction_and_writes_in_its_own_commits_nothing<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let engine = Engine::new(pool.clone(), config(10)).unwrap();
    let ledger = Ledger::default();
    let restart = r#""restart":true"#;
    let mut outcomes = Vec::new();
    for (offset, (id, extra)) in [("a", ""), ("bad1", restart), ("c", "")].into_iter().enumerate() {
        outcomes.extend(engine.process(vec![payment(0, offset as i64, id, 1, extra)], &ledger).await.unwrap());
    }
    assert_eq!(outcomes, [Outcome::Processed, Outcome::DeadLettered, Outcome::Processed]);
    let batch = vec![payment(0, 3, "d", 1, ""), payment(0, 4, "bad2", 1, restart), payment(0, 5, "e", 1, "")];
    assert_eq!(
        engine.process(batch, &ledger).await.unwrap(),
        [Outcome::Processed, Outcome::DeadLettered, Outcome::Processed]
    );
    for id in ["bad1", "bad2"] {
        assert_eq!(ledger_rows(&pool, id).await, 0, "{id}: the handler's own transaction was not committed");
    }
    for id in ["a", "c", "d", "e"] {
        assert_eq!(ledger_rows(&pool, id).await, 1, "{id}");
    }
    let reason: String = pool.scalar_text("SELECT error FROM dead_letters WHERE event_id = 'bad1'").await;
    assert!(reason.contains("ended the transaction"), "{reason}");
    let again = engine.process(vec![payment(0, 1, "bad1", 1, restart)], &ledger).await.unwrap();
    assert_eq!(again, [Outcome::Duplicate]);
    assert_eq!(ledger_rows(&pool, "bad1").await, 0);
}
on_every_store!(a_handler_that_ends_the_transaction_and_writes_in_its_own_commits_nothing);

/// A retryable failure rolls the marker back with the effect: the retry applies the event exactly once.
/// If the marker were committed apart from the effect, the retry would see a duplicate and the credit would
/// be lost.
async fn failed_attempt_rolls_back_marker_and_effect_together<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let engine = Engine::new(pool.clone(), config(10)).unwrap();
    let ledger = Ledger::default();
    let batch = vec![payment(0, 0, "a", 1, ""), payment(0, 1, "b", 10, r#""flaky":2"#), payment(0, 2, "c", 100, "")];
    let outcomes = engine.process(batch, &ledger).await.unwrap();
    assert_eq!(outcomes, [Outcome::Processed; 3]);
    assert_eq!(ledger_total(&pool).await, 111);
    for id in ["a", "b", "c"] {
        assert_eq!(ledger_rows(&pool, id).await, 1, "{id}");
        assert_eq!(markers(&pool, id).await, 1, "{id}");
    }
    assert_eq!(engine.stats().retried, 2);
}
on_every_store!(failed_attempt_rolls_back_marker_and_effect_together);

/// A retryable failure that never passes is dead-lettered after max_attempts, with the attempts recorded.
async fn retries_are_bounded<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let engine = Engine::new(pool.clone(), config(5).max_attempts(3)).unwrap();
    let outcomes = engine
        .process(vec![payment(0, 0, "x", 7, r#""flaky":99"#), payment(0, 1, "y", 1, "")], &Ledger::default())
        .await
        .unwrap();
    assert_eq!(outcomes, [Outcome::DeadLettered, Outcome::Processed]);
    assert_eq!(ledger_rows(&pool, "x").await, 0);
    let letters = idem::dead_letter::list(&pool, &idem::Tables::default(), None, 10).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].attempts, 3);
    assert!(letters[0].error.contains("gave up after 3 attempts"), "{}", letters[0].error);
}
on_every_store!(retries_are_bounded);

/// One poisoned message in a batch: the others commit, the poison is dead-lettered with its reason, its
/// marker written with its dead letter, and its own effect rolled back.
async fn poison_in_a_batch_is_isolated<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let engine = Engine::new(pool.clone(), config(100)).unwrap();
    let mut batch: Vec<Message> = (0..10).map(|i| payment(1, i, &format!("e{i}"), 1, "")).collect();
    batch[4] = payment(1, 4, "e4", 1, r#""poison":true"#);
    batch[7] = Message::new("payments", 1, 7, r#"{"id":"e7","amount":"twelve"}"#);
    let redelivery = batch.clone();
    let outcomes = engine.process(batch, &Ledger::default()).await.unwrap();
    let mut expected = [Outcome::Processed; 10];
    expected[4] = Outcome::DeadLettered;
    expected[7] = Outcome::DeadLettered;
    assert_eq!(outcomes, expected);
    assert_eq!(ledger_total(&pool).await, 8);
    assert_eq!(ledger_rows(&pool, "e4").await, 0, "the poison's own write is rolled back");
    assert_eq!(markers(&pool, "e4").await, 1, "the poison's marker is written with its dead letter");
    let letters = idem::dead_letter::list(&pool, &idem::Tables::default(), Some("ledger-writer"), 10).await.unwrap();
    let reasons: Vec<(&str, &str)> =
        letters.iter().map(|l| (l.event_id.as_deref().unwrap_or(""), l.error.as_str())).collect();
    assert_eq!(reasons.len(), 2);
    assert_eq!(reasons[0], ("e4", "poison payment"));
    assert!(reasons[1].1.contains("payload is not the expected JSON"), "{reasons:?}");
    assert_eq!((letters[0].partition, letters[0].offset), (1, 4));
    // A redelivery of the whole batch: everything is a duplicate, nothing more is dead-lettered.
    let outcomes = engine.process(redelivery, &Ledger::default()).await.unwrap();
    assert_eq!(outcomes, [Outcome::Duplicate; 10]);
    assert_eq!(idem::dead_letter::list(&pool, &idem::Tables::default(), None, 10).await.unwrap().len(), 2);
}
on_every_store!(poison_in_a_batch_is_isolated);

/// A batch handler's failure cannot name the message at fault: the batch is re-run one message at a time.
async fn batch_handler_failure_isolates_the_message<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let engine = Engine::new(pool.clone(), config(100)).unwrap();
    let handler = EachAsBatch(Ledger::default());
    let mut batch: Vec<Message> = (0..6).map(|i| payment(0, i, &format!("b{i}"), 10, "")).collect();
    batch[2] = payment(0, 2, "b2", 10, r#""poison":true"#);
    let outcomes = engine.process_batched(batch, &handler).await.unwrap();
    assert_eq!(outcomes.iter().filter(|o| **o == Outcome::DeadLettered).count(), 1);
    assert_eq!(outcomes[2], Outcome::DeadLettered);
    assert_eq!(ledger_total(&pool).await, 50);
}
on_every_store!(batch_handler_failure_isolates_the_message);

/// A batch handler that applies each event through the per-event ledger handler.
struct EachAsBatch(Ledger);

impl<DB: Backend> idem::BatchHandler<DB> for EachAsBatch
where
    Ledger: Handler<DB>,
{
    async fn handle_batch(&self, events: &[&idem::Event], tx: &mut DB::Connection) -> Result<(), idem::HandlerError> {
        for event in events {
            self.0.handle(event, tx).await?;
        }
        Ok(())
    }
}

/// A message without a key is dead-lettered with a reason naming the extractor, and the partition goes on.
async fn missing_key_is_dead_lettered_and_does_not_block<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let engine = Engine::new(pool.clone(), config(10)).unwrap();
    let batch = vec![
        Message::new("payments", 0, 0, r#"{"amount":5}"#),
        Message::new("payments", 0, 1, "not json at all"),
        payment(0, 2, "k", 5, ""),
    ];
    let outcomes = engine.process(batch.clone(), &Ledger::default()).await.unwrap();
    assert_eq!(outcomes, [Outcome::DeadLettered, Outcome::DeadLettered, Outcome::Processed]);
    let letters = idem::dead_letter::list(&pool, &idem::Tables::default(), None, 10).await.unwrap();
    assert_eq!(letters.len(), 2);
    for letter in &letters {
        assert!(letter.error.contains("json:/id"), "{}", letter.error);
        assert_eq!(letter.event_id, None);
    }
    // Redelivered: the keyless messages are recognised by position, not stored twice.
    engine.process(batch, &Ledger::default()).await.unwrap();
    assert_eq!(idem::dead_letter::list(&pool, &idem::Tables::default(), None, 10).await.unwrap().len(), 2);
    assert_eq!(ledger_total(&pool).await, 5);
}
on_every_store!(missing_key_is_dead_lettered_and_does_not_block);

/// Two connections deliver the same message at once: exactly one effect; the loser waits for the winner's
/// commit and then sees a duplicate.
async fn concurrent_duplicates_apply_once<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let engine = Engine::new(pool.clone(), config(1)).unwrap();
    let ledger = Arc::new(Ledger::default());
    let slow = payment(0, 0, "same", 42, r#""sleep_ms":400"#);
    let first = {
        let (engine, ledger, slow) = (engine.clone(), Arc::clone(&ledger), slow.clone());
        tokio::spawn(async move { engine.process(vec![slow], ledger.as_ref()).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    // The same event, redelivered from another partition and offset (same payload).
    let again = Message { partition: 2, offset: 17, ..slow.clone() };
    let second = engine.process(vec![again], ledger.as_ref()).await.unwrap();
    let waited = started.elapsed();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first, [Outcome::Processed]);
    assert_eq!(second, [Outcome::Duplicate]);
    assert!(waited >= Duration::from_millis(200), "the loser must wait for the winner, waited {waited:?}");
    assert_eq!(ledger_rows(&pool, "same").await, 1);
    assert_eq!(ledger.calls.load(std::sync::atomic::Ordering::SeqCst), 1, "the loser must not run the handler");
}
on_every_store!(concurrent_duplicates_apply_once);

/// The winner rolls back: the waiting loser takes over and the effect is applied once, by the loser.
/// PostgreSQL wakes the waiting insert as soon as the winner rolls back. SQLite has no queue for its write lock:
/// the failed winner may take it again first to write its dead letter, and then the loser sees a duplicate;
/// either way the event ends up in exactly one place.
async fn winner_rollback_lets_the_loser_take_over<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let engine = Engine::new(pool.clone(), config(1)).unwrap();
    let ledger = Arc::new(Ledger::default());
    // Both deliveries carry the same payload; the handler fails the first call for this id only.
    let failing = payment(0, 0, "contested", 9, r#""sleep_ms":300,"fail_first":true"#);
    let redelivered = failing.clone();
    let first = {
        let (engine, ledger) = (engine.clone(), Arc::clone(&ledger));
        tokio::spawn(async move { engine.process(vec![failing], ledger.as_ref()).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = engine.process(vec![redelivered], ledger.as_ref()).await.unwrap();
    let first = first.await.unwrap().unwrap();
    let letters = idem::dead_letter::list(&pool, &idem::Tables::default(), None, 10).await.unwrap().len() as i64;
    let rows = ledger_rows(&pool, "contested").await;
    assert_eq!(rows + letters, 1, "applied once or dead-lettered once, never both, never neither");
    assert_eq!(markers(&pool, "contested").await, 1);
    if <DB as Backend>::NAME == "postgres" {
        assert_eq!(second, [Outcome::Processed]);
        assert_eq!(first, [Outcome::Duplicate], "the failed winner finds the event handled and dead-letters nothing");
        assert_eq!(rows, 1);
    } else {
        let mut outcomes = [first[0], second[0]];
        outcomes.sort_by_key(|o| o.as_str());
        assert!(
            outcomes == [Outcome::DeadLettered, Outcome::Duplicate]
                || outcomes == [Outcome::Duplicate, Outcome::Processed],
            "{outcomes:?}"
        );
    }
}
on_every_store!(winner_rollback_lets_the_loser_take_over);

/// Many concurrent deliveries of the same ids from separate connections: each applied once.
async fn many_concurrent_deliveries<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let engine = Engine::new(pool.clone(), config(20)).unwrap();
    let ledger = Arc::new(Ledger::default());
    let mut tasks = Vec::new();
    for worker in 0..6 {
        let (engine, ledger) = (engine.clone(), Arc::clone(&ledger));
        tasks.push(tokio::spawn(async move {
            // Each worker sends the same 40 ids, in an order of its own.
            let mut ids: Vec<i64> = (0..40).collect();
            ids.rotate_left(worker * 7);
            let batch = ids.iter().map(|i| payment(0, *i, &format!("c{i}"), 1, "")).collect();
            engine.process(batch, ledger.as_ref()).await.unwrap()
        }));
    }
    let mut processed = 0;
    for task in tasks {
        processed += task.await.unwrap().iter().filter(|o| **o == Outcome::Processed).count();
    }
    assert_eq!(processed, 40);
    assert_eq!(ledger_total(&pool).await, 40);
    assert_eq!(pool.scalar("SELECT COUNT(DISTINCT event_id) FROM ledger").await, 40);
}
on_every_store!(many_concurrent_deliveries);

/// A producer that reuses an event id for a different payload: the marker's digest tells it from a redelivery;
/// it is not applied, counted as `id_reused`, and dead-lettered under that policy.
async fn reused_ids_are_detected<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let engine = Engine::new(pool.clone(), config(10)).unwrap();
    let ledger = Ledger::default();
    let first = engine.process(vec![payment(0, 0, "r1", 10, "")], &ledger).await.unwrap();
    let again = engine.process(vec![payment(0, 0, "r1", 10, ""), payment(0, 5, "r1", 99, "")], &ledger).await.unwrap();
    assert_eq!(first, [Outcome::Processed]);
    assert_eq!(again, [Outcome::Duplicate, Outcome::IdReused]);
    assert_eq!(ledger_total(&pool).await, 10);
    assert_eq!(engine.stats().id_reused, 1);
    assert!(idem::dead_letter::list(&pool, &idem::Tables::default(), None, 10).await.unwrap().is_empty());

    let strict = Engine::new(pool.clone(), config(10).id_reuse(idem::IdReusePolicy::DeadLetter)).unwrap();
    strict.process(vec![payment(1, 0, "r2", 1, "")], &ledger).await.unwrap();
    let reused = strict.process(vec![payment(1, 9, "r2", 2, "")], &ledger).await.unwrap();
    assert_eq!(reused, [Outcome::IdReused]);
    let letters = idem::dead_letter::list(&pool, &idem::Tables::default(), None, 10).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert!(letters[0].error.contains("reused") && letters[0].error.contains("payments/1/0"), "{}", letters[0].error);
    assert_eq!(letters[0].offset, 9);
    assert_eq!(ledger_total(&pool).await, 11);
    // `idem stats` counts it apart from the other dead letters.
    let stats = idem::store::stats(&pool, &idem::Tables::default(), None).await.unwrap();
    assert_eq!((stats[0].dead_letters, stats[0].id_reused), (1, 1), "{stats:?}");
    // Its replay is refused, checked or forced, dry or not, and names the way out.
    let tables = idem::Tables::default();
    let forced = idem::dead_letter::Safety::Forced;
    let checked = idem::dead_letter::check_replay(&pool, &tables, &letters[0], forced).await.unwrap();
    let refused = idem::dead_letter::Replayed::Refused(idem::dead_letter::ReplayRisk::IdReused);
    assert_eq!(checked, refused);
    let dir = tempfile_dir();
    let log = idem::embedded::EmbeddedLog::open(&dir).unwrap();
    let replayed = idem::dead_letter::replay(&pool, &tables, &log.producer(), &letters[0], forced).await.unwrap();
    assert_eq!(replayed, refused);
    assert!(idem::dead_letter::ReplayRisk::IdReused.explain(&letters[0]).contains("new id"));
    let _ = std::fs::remove_dir_all(&dir);
}
on_every_store!(reused_ids_are_detected);

fn tempfile_dir() -> std::path::PathBuf {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!("idem-reused-{}-{nanos}", std::process::id()))
}

/// A handler that swallows a database error leaves a PostgreSQL transaction aborted, where COMMIT silently
/// rolls back: the engine must notice, never report that batch as committed, and isolate the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swallowed_error_is_not_reported_as_committed() {
    struct Swallow;
    impl Handler<sqlx::Postgres> for Swallow {
        async fn handle(&self, event: &idem::Event, tx: &mut sqlx::PgConnection) -> Result<(), idem::HandlerError> {
            sqlx::query("INSERT INTO ledger (event_id, amount) VALUES ($1, 1)")
                .bind(&event.id)
                .execute(&mut *tx)
                .await?;
            if event.id == "bad" {
                let _ = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await; // error ignored: tx is now aborted
            }
            Ok(())
        }
    }
    let db = common::pg().await;
    setup(&db.pool).await;
    let engine = Engine::new(db.pool.clone(), config(10)).unwrap();
    let batch = vec![payment(0, 0, "a", 1, ""), payment(0, 1, "bad", 1, ""), payment(0, 2, "c", 1, "")];
    let outcomes = engine.process(batch, &Swallow).await.unwrap();
    assert_eq!(outcomes, [Outcome::Processed, Outcome::DeadLettered, Outcome::Processed]);
    assert_eq!(ledger_rows(&db.pool, "a").await + ledger_rows(&db.pool, "c").await, 2, "the others committed");
    assert_eq!(markers(&db.pool, "a").await + markers(&db.pool, "c").await, 2);
    let letters = idem::dead_letter::list(&db.pool, &idem::Tables::default(), None, 10).await.unwrap();
    assert!(letters[0].error.contains("aborted"), "{}", letters[0].error);
}

/// A handler that ends the transaction itself (`COMMIT` through the connection) is caught at the engine's
/// `COMMIT`: the message is not reported as processed (its own `COMMIT` took the marker with it, so the retry
/// finds a duplicate), every effect is there once, and no connection is left inside a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_commits_itself_is_caught() {
    struct CommitsItself;
    impl Handler<sqlx::Postgres> for CommitsItself {
        async fn handle(&self, event: &idem::Event, tx: &mut sqlx::PgConnection) -> Result<(), idem::HandlerError> {
            sqlx::query("INSERT INTO ledger (event_id, amount) VALUES ($1, 1)")
                .bind(&event.id)
                .execute(&mut *tx)
                .await?;
            if event.id == "bad" {
                sqlx::query("COMMIT").execute(&mut *tx).await?;
            }
            Ok(())
        }
    }
    let db = common::pg().await;
    setup(&db.pool).await;
    let engine = Engine::new(db.pool.clone(), config(1)).unwrap();
    let mut outcomes = Vec::new();
    for (offset, id) in ["a", "bad", "c"].into_iter().enumerate() {
        outcomes.extend(engine.process(vec![payment(0, offset as i64, id, 1, "")], &CommitsItself).await.unwrap());
    }
    assert_eq!(outcomes, [Outcome::Processed, Outcome::Duplicate, Outcome::Processed]);
    for id in ["a", "bad", "c"] {
        assert_eq!(ledger_rows(&db.pool, id).await, 1, "{id}");
        assert_eq!(markers(&db.pool, id).await, 1, "{id}");
    }
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(open, 0, "no connection is left inside a transaction");
}

/// A handler that rolls idem's transaction back and begins one of its own (`ROLLBACK; BEGIN` through the
/// connection) took the marker and its effects with it: the engine's check finds a transaction that is not idem's,
/// and the message is never reported processed (it is dead-lettered with the reason, its effect absent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_rolls_back_and_begins_again_is_caught() {
    struct RollsBack;
    impl Handler<sqlx::Postgres> for RollsBack {
        async fn handle(&self, event: &idem::Event, tx: &mut sqlx::PgConnection) -> Result<(), idem::HandlerError> {
            sqlx::query("INSERT INTO ledger (event_id, amount) VALUES ($1, 1)")
                .bind(&event.id)
                .execute(&mut *tx)
                .await?;
            if event.id == "bad" {
                sqlx::query("ROLLBACK").execute(&mut *tx).await?;
                sqlx::query("BEGIN").execute(&mut *tx).await?;
            }
            Ok(())
        }
    }
    let db = common::pg().await;
    setup(&db.pool).await;
    let engine = Engine::new(db.pool.clone(), config(1)).unwrap();
    let mut outcomes = Vec::new();
    for (offset, id) in ["a", "bad", "c"].into_iter().enumerate() {
        outcomes.extend(engine.process(vec![payment(0, offset as i64, id, 1, "")], &RollsBack).await.unwrap());
    }
    assert_eq!(outcomes, [Outcome::Processed, Outcome::DeadLettered, Outcome::Processed]);
    assert_eq!(ledger_rows(&db.pool, "bad").await, 0);
    for id in ["a", "c"] {
        assert_eq!(ledger_rows(&db.pool, id).await, 1, "{id}");
    }
    let reason: String =
        sqlx::query_scalar("SELECT error FROM dead_letters WHERE event_id = 'bad'").fetch_one(&db.pool).await.unwrap();
    assert!(reason.contains("ended the transaction"), "{reason}");
}

/// A deferred constraint that the handler's writes break fails at `COMMIT`: the handler's fault, dead-lettered
/// with the database's reason; neither its effect nor its marker stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_constraint_failing_at_commit_is_the_handlers() {
    struct Orphan;
    impl Handler<sqlx::Postgres> for Orphan {
        async fn handle(&self, event: &idem::Event, tx: &mut sqlx::PgConnection) -> Result<(), idem::HandlerError> {
            let parent = if event.id == "bad" { 999 } else { 1 };
            sqlx::query("INSERT INTO ledger (event_id, amount) VALUES ($1, 1)")
                .bind(&event.id)
                .execute(&mut *tx)
                .await?;
            sqlx::query("INSERT INTO child (parent) VALUES ($1)").bind(parent).execute(&mut *tx).await?;
            Ok(())
        }
    }
    let db = common::pg().await;
    setup(&db.pool).await;
    for sql in [
        "CREATE TABLE parent (id int PRIMARY KEY)",
        "INSERT INTO parent VALUES (1)",
        "CREATE TABLE child (parent int REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)",
    ] {
        sqlx::query(sql).execute(&db.pool).await.unwrap();
    }
    let engine = Engine::new(db.pool.clone(), config(1)).unwrap();
    let batch = vec![payment(0, 0, "a", 1, ""), payment(0, 1, "bad", 1, "")];
    let outcomes = engine.process(batch, &Orphan).await.unwrap();
    assert_eq!(outcomes, [Outcome::Processed, Outcome::DeadLettered]);
    assert_eq!(ledger_rows(&db.pool, "bad").await, 0, "the effect rolled back");
    let letters = idem::dead_letter::list(&db.pool, &idem::Tables::default(), None, 10).await.unwrap();
    assert!(
        letters[0].error.contains("commit failed") && letters[0].error.contains("foreign key"),
        "{}",
        letters[0].error
    );
}

/// A replayed dead letter is addressed to its group: other groups on the topic skip it.
async fn replays_for_another_group_are_skipped<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let engine = Engine::new(pool.clone(), config(10)).unwrap();
    let for_other = payment(0, 0, "x1", 5, "").with_header(idem::dead_letter::REPLAY_FOR_HEADER, "billing");
    let for_us = payment(0, 1, "x2", 7, "").with_header(idem::dead_letter::REPLAY_FOR_HEADER, "ledger-writer");
    let outcomes = engine.process(vec![for_other, for_us], &Ledger::default()).await.unwrap();
    assert_eq!(outcomes, [Outcome::Duplicate, Outcome::Processed]);
    assert_eq!(ledger_total(&pool).await, 7);
}
on_every_store!(replays_for_another_group_are_skipped);
