//! What only MySQL and MariaDB need proven (the shared guarantee is the store conformance suite's,
//! `on_every_store!`): the intact check without an aborted-transaction state, migrations without transactional
//! DDL, start-up refusals that name the cause, and the capabilities this store does not have.

mod common;

use common::{TestPool, config, ledger_rows, markers, payment, setup};
use idem::{Engine, Handler, Outcome, Tables};

/// A handler that runs `action` through idem's connection when it handles the event `bad`, after its insert.
struct Meddles(&'static [&'static str]);

impl Handler<sqlx::MySql> for Meddles {
    async fn handle(&self, event: &idem::Event, tx: &mut sqlx::MySqlConnection) -> Result<(), idem::HandlerError> {
        sqlx::query("INSERT INTO ledger (event_id, amount) VALUES (?, 1)").bind(&event.id).execute(&mut *tx).await?;
        if event.id == "bad" {
            for statement in self.0 {
                sqlx::Executor::execute(&mut *tx, *statement).await?;
            }
        }
        Ok(())
    }
}

async fn three_events(pool: &sqlx::MySqlPool, handler: &Meddles) -> Vec<Outcome> {
    let engine = Engine::new(pool.clone(), config(1)).unwrap();
    let mut outcomes = Vec::new();
    for (offset, id) in ["a", "bad", "c"].into_iter().enumerate() {
        outcomes.extend(engine.process(vec![payment(0, offset as i64, id, 1, "")], handler).await.unwrap());
    }
    outcomes
}

/// A handler's own `COMMIT` committed the marker with its effect: the engine finds its transaction gone, never
/// reports the message processed by a `COMMIT` of nothing, and the retry sees the duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_commits_itself_is_caught() {
    let db = common::mysql().await;
    setup(&db.pool).await;
    let outcomes = three_events(&db.pool, &Meddles(&["COMMIT"])).await;
    assert_eq!(outcomes, [Outcome::Processed, Outcome::Duplicate, Outcome::Processed]);
    for id in ["a", "bad", "c"] {
        assert_eq!(ledger_rows(&db.pool, id).await, 1, "{id}");
        assert_eq!(markers(&db.pool, id).await, 1, "{id}");
    }
}

/// `ROLLBACK; BEGIN` through the connection took the marker and the effect with it, and left a transaction that
/// is not idem's (MySQL has no transaction id to compare): the savepoint idem took at `BEGIN` is gone, so the
/// message is dead-lettered with the reason, never acknowledged as processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_rolls_back_and_begins_again_is_caught() {
    let db = common::mysql().await;
    setup(&db.pool).await;
    let outcomes = three_events(&db.pool, &Meddles(&["ROLLBACK", "BEGIN"])).await;
    assert_eq!(outcomes, [Outcome::Processed, Outcome::DeadLettered, Outcome::Processed]);
    assert_eq!(ledger_rows(&db.pool, "bad").await, 0);
    let reason = db.pool.scalar_text("SELECT error FROM dead_letters WHERE event_id = 'bad'").await;
    assert!(reason.contains("ended the transaction"), "{reason}");
}

/// Statements after a `ROLLBACK` run in autocommit: the handler's second insert commits on its own, outside
/// idem's transaction. The message is still not reported processed: it is dead-lettered, its marker committed with
/// its dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_after_a_rollback_in_autocommit_are_not_taken_for_idems() {
    let db = common::mysql().await;
    setup(&db.pool).await;
    let outcomes = three_events(&db.pool, &Meddles(&["ROLLBACK", "INSERT INTO blocked (id) VALUES ('x')"])).await;
    assert_eq!(outcomes, [Outcome::Processed, Outcome::DeadLettered, Outcome::Processed]);
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM dead_letters WHERE event_id = 'bad'").await, 1);
    assert_eq!(markers(&db.pool, "bad").await, 1, "the dead letter's marker");
}

/// Six processes migrating at once: one applies, the others wait on the named lock and find the schema current;
/// the ledger holds each migration once, and a changed migration is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrations_run_twice_and_concurrently() {
    let db = common::mysql().await;
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let url = db.url.clone();
        tasks.push(tokio::spawn(async move {
            let pool = idem::mysql::connect(&url, 1).await.unwrap();
            let report = idem::migrate(&pool, &Tables::default()).await.unwrap();
            pool.close().await;
            report
        }));
    }
    let mut applied_by = 0;
    for task in tasks {
        let report = task.await.unwrap();
        assert_eq!(report.version, 9);
        applied_by += usize::from(!report.applied.is_empty());
    }
    assert_eq!(applied_by, 1, "exactly one migrator applies, the others find the schema current");
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM idem_migrations").await, 9);
    let status = idem::store::migration_status(&db.pool, &Tables::default()).await.unwrap();
    assert!(status.iter().all(|m| m.state == idem::store::MigrationState::Applied), "{status:?}");
    db.pool.exec("UPDATE idem_migrations SET checksum = 1 WHERE version = 1").await;
    let err = idem::migrate(&db.pool, &Tables::default()).await.unwrap_err();
    assert!(err.to_string().contains("was changed after it was applied"), "{err}");
    // A prefix keeps two services apart in one database; a schema is refused with the fix.
    let billing = Tables::new(None, "billing_").unwrap();
    assert_eq!(idem::migrate(&db.pool, &billing).await.unwrap().applied, [1, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM billing_processed_events").await, 0);
    let err = idem::migrate(&db.pool, &Tables::new(Some("billing"), "").unwrap()).await.unwrap_err();
    assert!(err.to_string().contains("table_prefix"), "{err}");
}

/// An unknown database, a wrong password, a closed port and a URL without a database are refused at start-up,
/// each naming the cause and the fix.
#[tokio::test]
async fn start_up_refusals_name_the_cause_and_the_fix() {
    let server = common::mysql_server();
    let refused = |url: String| async move { idem::mysql::connect(&url, 1).await.unwrap_err().to_string() };
    let missing = refused(format!("{server}/idem_no_such_database")).await;
    assert!(missing.contains("1049") && missing.contains("CREATE DATABASE"), "{missing}");
    let password = refused("mysql://idem_no_such_user:wrong@127.0.0.1:3306/test".into()).await;
    assert!(password.contains("1045") && password.contains("user and password"), "{password}");
    let closed = refused("mysql://root@127.0.0.1:1/test".into()).await;
    assert!(closed.contains("connection refused"), "{closed}");
    let no_db = refused(server.clone()).await;
    assert!(no_db.contains("names no database"), "{no_db}");
}

/// The partitioned layout is PostgreSQL's: asking for it on MySQL is refused before anything is consumed.
#[tokio::test]
async fn the_partitioned_layout_is_refused_with_the_reason() {
    let db = common::mysql().await;
    setup(&db.pool).await;
    let partitioned = config(10).partitioned(idem::PartitionPeriod::Day, std::time::Duration::from_secs(3600));
    let engine = Engine::new(db.pool.clone(), partitioned).unwrap();
    let dir = common::temp_dir();
    let log = idem::embedded::EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 1).unwrap();
    let source = log.consumer("ledger-writer", &["payments"], idem::embedded::ConsumerOptions::default()).unwrap();
    let handler = Meddles(&[]);
    let err = engine.run(source, handler, std::future::pending::<()>()).await.unwrap_err();
    assert!(err.to_string().contains("partitioned markers need PostgreSQL"), "{err}");
}

/// idem's longest key (512 bytes) fits MySQL's marker and dead-letter keys: claimed once, its redelivery a
/// duplicate, its failure a dead letter under its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_key_fits() {
    let db = common::mysql().await;
    setup(&db.pool).await;
    let engine = Engine::new(db.pool.clone(), config(1)).unwrap();
    let long = "k".repeat(idem::key::MAX_KEY_LEN);
    let ledger = common::Ledger::default();
    let first = engine.process(vec![payment(0, 0, &long, 5, "")], &ledger).await.unwrap();
    let again = engine.process(vec![payment(0, 1, &long, 5, "")], &ledger).await.unwrap();
    assert_eq!([first[0], again[0]], [Outcome::Processed, Outcome::Duplicate]);
    let poison = "p".repeat(idem::key::MAX_KEY_LEN);
    let dead = engine.process(vec![payment(0, 2, &poison, 5, r#""poison":true"#)], &ledger).await.unwrap();
    assert_eq!(dead, [Outcome::DeadLettered]);
    let stored = db.pool.scalar("SELECT MAX(CHAR_LENGTH(event_id)) FROM dead_letters").await;
    assert_eq!(stored, idem::key::MAX_KEY_LEN as i64);
}
