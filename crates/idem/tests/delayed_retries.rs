//! Delayed retries: one message whose handler fails for a while, over many keys on the embedded log. The failing
//! message is parked after its immediate retries and acknowledged, the later messages of its key (which would
//! succeed) are parked behind it, and every other key — those of its own partition too — is applied to its end
//! while it fails. Once
//! the failure clears, the key's events are applied in their order, each once, and nothing is dead-lettered. On
//! PostgreSQL, SQLite and MySQL/MariaDB.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::{Backend, Config, DelayedRetries, Engine, Event, Handler, HandlerError, KeyExtractor};

const EVENTS: usize = 600;
const KEYS: usize = 30;
const BAD_KEY: &str = "k7";

#[derive(Clone)]
struct Flaky {
    failing: Arc<AtomicBool>,
}

#[derive(serde::Deserialize)]
struct Payment {
    id: String,
    key: String,
    seq: i64,
}

impl Flaky {
    fn check(&self, event: &Event) -> Result<Payment, HandlerError> {
        let p: Payment = event.json()?;
        // Only the key's first event fails: the later ones must wait behind it, not overtake it.
        if p.key == BAD_KEY && p.seq == 1 && self.failing.load(Ordering::SeqCst) {
            return Err(HandlerError::retryable("account row locked (lock_timeout)"));
        }
        Ok(p)
    }
}

macro_rules! flaky_on {
    ($db:ty, $insert:literal) => {
        impl Handler<$db> for Flaky {
            async fn handle(
                &self,
                event: &Event,
                tx: &mut <$db as sqlx::Database>::Connection,
            ) -> Result<(), HandlerError> {
                let p = self.check(event)?;
                sqlx::query($insert).bind(&p.id).bind(&p.key).bind(p.seq).execute(&mut *tx).await?;
                Ok(())
            }
        }
    };
}
flaky_on!(sqlx::Postgres, "INSERT INTO applied (event_id, k, seq) VALUES ($1, $2, $3)");
flaky_on!(sqlx::Sqlite, "INSERT INTO applied (event_id, k, seq) VALUES ($1, $2, $3)");
flaky_on!(sqlx::MySql, "INSERT INTO applied (event_id, k, seq) VALUES (?, ?, ?)");

/// The records: the failing key's first event first, then `EVENTS` over `KEYS` keys (the failing key's later
/// events among them).
fn records() -> Vec<(String, String)> {
    let mut seq: HashMap<String, i64> = HashMap::new();
    let mut out = Vec::new();
    let mut push = |key: String, n: usize| {
        let s = seq.entry(key.clone()).or_default();
        *s += 1;
        out.push((key.clone(), format!(r#"{{"id":"e{n}","key":"{key}","seq":{s}}}"#)));
    };
    push(BAD_KEY.to_owned(), 0);
    for n in 1..=EVENTS {
        push(format!("k{}", n % KEYS), n);
    }
    out
}

async fn count<DB: Backend>(pool: &sqlx::Pool<DB>, sql: &str) -> i64
where
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    i64: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

async fn one_failing_key_is_parked_and_the_rest_flows<DB: Backend>(what: &str, pool: sqlx::Pool<DB>, create: &str)
where
    Flaky: Handler<DB>,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    i64: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let dir = common::temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 4).unwrap();
    let producer = log.producer();
    let records = records();
    for (key, payload) in &records {
        producer.send("payments", Some(key.as_bytes()), payload.as_bytes(), &[]).unwrap();
    }
    producer.flush().unwrap();
    let bad_events = records.iter().filter(|(key, _)| key == BAD_KEY).count() as i64;
    let total = records.len() as i64;

    let config = Config::new("delayed", KeyExtractor::JsonPointer("/id".into()))
        .batch_size(20)
        .max_attempts(2)
        .backoff(Duration::from_millis(10), Duration::from_millis(20))
        .delayed_retries(DelayedRetries::new(vec![Duration::from_secs(1); 120]));
    idem::migrate(&pool, &config.tables).await.unwrap();
    sqlx::raw_sql(create).execute(&pool).await.unwrap();
    let handler = Flaky { failing: Arc::new(AtomicBool::new(true)) };
    let engine = Engine::new(pool.clone(), config).unwrap();
    let source = log.consumer("delayed", &["payments"], ConsumerOptions::default()).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn({
        let (engine, handler) = (engine.clone(), handler.clone());
        async move { engine.run(source, handler, stop_rx).await }
    });

    // While the key fails: every other key is applied to its end, its own partition's included.
    let deadline = Instant::now() + Duration::from_secs(60);
    while count(&pool, "SELECT COUNT(*) FROM applied").await < total - bad_events {
        assert!(Instant::now() < deadline, "{what}: the other keys were not applied while one key failed");
        assert!(!run.is_finished(), "{what}: the engine stopped: {:?}", run.await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Give the release loop a few delayed retries of the failing key.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let sql = format!("SELECT COUNT(*) FROM applied WHERE k = '{BAD_KEY}'");
    assert_eq!(count(&pool, &sql).await, 0, "{what}: the failing key applied nothing while it failed");
    let parked = count(&pool, "SELECT COUNT(*) FROM parked_messages").await;
    assert_eq!(parked, bad_events, "{what}: the failing message and every later one of its key are parked");
    let never_tried = count(&pool, "SELECT COUNT(*) FROM parked_messages WHERE error IS NULL").await;
    assert_eq!(never_tried, bad_events - 1, "{what}: the later ones wait behind it, untried");
    let tried = count(&pool, "SELECT COUNT(*) FROM parked_messages WHERE delayed_retries >= 1").await;
    assert!(tried >= 1, "{what}: the head was tried again on its schedule");
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM dead_letters").await, 0, "{what}: nothing dead-lettered");
    assert!(engine.health().stalled.is_empty(), "{what}: no partition holds: {:?}", engine.health().stalled);

    // The failure clears: the key's events are applied, in order, each once; the parked table empties.
    handler.failing.store(false, Ordering::SeqCst);
    while count(&pool, "SELECT COUNT(*) FROM applied").await < total {
        assert!(Instant::now() < deadline + Duration::from_secs(30), "{what}: the parked key was not released");
        assert!(!run.is_finished(), "{what}: the engine stopped: {:?}", run.await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop_tx.send(());
    let stats = run.await.unwrap().unwrap();
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM applied").await, total, "{what}: every event once");
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM parked_messages").await, 0, "{what}: nothing left parked");
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM dead_letters").await, 0, "{what}: nothing dead-lettered");
    assert_eq!((stats.processed, stats.dead_lettered), (total as u64, 0), "{what}: {stats:?}");
    assert_eq!(stats.parked, bad_events as u64, "{what}: {stats:?}");
    let out_of_order =
        count(&pool, "SELECT COUNT(*) FROM applied a JOIN applied b ON a.k = b.k AND a.n < b.n AND a.seq > b.seq")
            .await;
    assert_eq!(out_of_order, 0, "{what}: a key's events applied out of order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_one_failing_key_is_parked_and_the_rest_flows() {
    let db = common::pg().await;
    let create = "CREATE TABLE applied (n BIGSERIAL PRIMARY KEY, event_id TEXT NOT NULL UNIQUE, k TEXT NOT NULL,
                                        seq BIGINT NOT NULL)";
    one_failing_key_is_parked_and_the_rest_flows("postgres", db.pool.clone(), create).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_one_failing_key_is_parked_and_the_rest_flows() {
    let db = common::sqlite().await;
    let create = "CREATE TABLE applied (n INTEGER PRIMARY KEY AUTOINCREMENT, event_id TEXT NOT NULL UNIQUE,
                                        k TEXT NOT NULL, seq INTEGER NOT NULL)";
    one_failing_key_is_parked_and_the_rest_flows("sqlite", db.pool.clone(), create).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_one_failing_key_is_parked_and_the_rest_flows() {
    let db = common::mysql().await;
    let create = "CREATE TABLE applied (n BIGINT AUTO_INCREMENT PRIMARY KEY, event_id VARCHAR(64) NOT NULL UNIQUE,
                                        k VARCHAR(64) NOT NULL, seq BIGINT NOT NULL)";
    one_failing_key_is_parked_and_the_rest_flows("mysql", db.pool.clone(), create).await;
}

/// `ParkOrder::None`: only the failing message is parked; the later messages of its key are applied while it
/// waits, and it is applied once the failure clears.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_key_order_only_the_failing_message_is_parked() {
    let db = common::sqlite().await;
    let dir = common::temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 2).unwrap();
    let producer = log.producer();
    let records = records();
    for (key, payload) in &records {
        producer.send("payments", Some(key.as_bytes()), payload.as_bytes(), &[]).unwrap();
    }
    producer.flush().unwrap();
    let total = records.len() as i64;
    let config = Config::new("unordered", KeyExtractor::JsonPointer("/id".into()))
        .max_attempts(1)
        .delayed_retries(DelayedRetries::new([Duration::from_secs(1); 60]).order(idem::ParkOrder::None));
    idem::migrate(&db.pool, &config.tables).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE applied (n INTEGER PRIMARY KEY AUTOINCREMENT, event_id TEXT NOT NULL UNIQUE, k TEXT NOT NULL,
                               seq INTEGER NOT NULL)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let handler = Flaky { failing: Arc::new(AtomicBool::new(true)) };
    let engine = Engine::new(db.pool.clone(), config).unwrap();
    let source = log.consumer("unordered", &["payments"], ConsumerOptions::default()).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn({
        let (engine, handler) = (engine.clone(), handler.clone());
        async move { engine.run(source, handler, stop_rx).await }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while count(&db.pool, "SELECT COUNT(*) FROM applied").await < total - 1 {
        assert!(Instant::now() < deadline, "every message but the failing one is applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(count(&db.pool, "SELECT COUNT(*) FROM parked_messages").await, 1, "only the failing one is parked");
    handler.failing.store(false, Ordering::SeqCst);
    while count(&db.pool, "SELECT COUNT(*) FROM applied").await < total {
        assert!(Instant::now() < deadline, "the parked message was not released");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop_tx.send(());
    let stats = run.await.unwrap().unwrap();
    assert_eq!((stats.processed, stats.parked, stats.dead_lettered), (total as u64, 1, 0), "{stats:?}");
    let first: i64 = count(&db.pool, &format!("SELECT MAX(n) FROM applied WHERE k = '{BAD_KEY}' AND seq = 1")).await;
    let later: i64 = count(&db.pool, &format!("SELECT MIN(n) FROM applied WHERE k = '{BAD_KEY}' AND seq > 1")).await;
    assert!(first > later, "the failing message was applied after its key's later ones");
}
