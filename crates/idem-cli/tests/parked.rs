//! `idem parked`: the operator's view of delayed retries. A consumer parks a failing message and the later one
//! of its key; `list` shows both in order, `retry-now` makes the waiting head due, `discard` turns it into a dead
//! letter that names who discarded it and why, and the next consumer run applies the message that waited behind
//! it. On SQLite, through the `idem` binary.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::{Config, DelayedRetries, Engine, Event, Handler, HandlerError, KeyExtractor};
use serde_json::Value;

fn idem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_idem"))
}

/// Fails retryably for key `k1` while `failing` is set; counts what it applied.
#[derive(Clone)]
struct Flaky {
    failing: Arc<AtomicBool>,
    applied: Arc<AtomicU64>,
}

impl Handler<sqlx::Sqlite> for Flaky {
    async fn handle(&self, event: &Event, _tx: &mut sqlx::SqliteConnection) -> Result<(), HandlerError> {
        if event.message.key.as_deref() == Some(b"k1") && self.failing.load(Ordering::SeqCst) {
            return Err(HandlerError::retryable("account row locked"));
        }
        self.applied.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// Runs a consumer over the log until `done` holds for its stats, then stops it.
async fn consume(url: &str, log: &EmbeddedLog, handler: Flaky, done: impl Fn(&idem::StatsSnapshot) -> bool) {
    let pool = idem::sqlite::connect(url).await.unwrap();
    let config = Config::new("ledger", KeyExtractor::JsonPointer("/id".into()))
        .max_attempts(1)
        .delayed_retries(DelayedRetries::new([Duration::from_secs(3_600)]));
    idem::migrate(&pool, &config.tables).await.unwrap();
    let engine = Engine::new(pool.clone(), config).unwrap();
    let source = log.consumer("ledger", &["payments"], ConsumerOptions::default()).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn({
        let engine = engine.clone();
        async move { engine.run(source, handler, stop_rx).await }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done(&engine.stats()) {
        assert!(Instant::now() < deadline, "the consumer did not get there: {:?}", engine.stats());
        assert!(!run.is_finished(), "the engine stopped: {:?}", run.await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop_tx.send(());
    run.await.unwrap().unwrap();
    pool.close().await;
}

fn json(args: &[&str]) -> Value {
    let out = idem().args(args).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_retry_now_and_discard_parked_messages() {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("idem-cli-parked-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/ledger.db", dir.display());
    let log = EmbeddedLog::open(dir.join("log")).unwrap();
    log.create_topic("payments", 1).unwrap();
    let producer = log.producer();
    for (key, id) in [("k1", "e1"), ("k1", "e2"), ("k2", "e3")] {
        producer.send("payments", Some(key.as_bytes()), format!(r#"{{"id":"{id}"}}"#).as_bytes(), &[]).unwrap();
    }
    producer.flush().unwrap();

    // e1 fails and is parked for an hour, e2 waits behind it, e3 (another key) is applied.
    let handler = Flaky { failing: Arc::new(AtomicBool::new(true)), applied: Arc::new(AtomicU64::new(0)) };
    consume(&url, &log, handler.clone(), |s| s.parked == 2 && s.processed == 1).await;

    let parked = json(&["parked", "list", "--database-url", &url, "--json"]);
    let parked = parked.as_array().unwrap();
    let ids: Vec<&str> = parked.iter().map(|p| p["event_id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["e1", "e2"], "in arrival order: {parked:?}");
    assert!(parked[0]["error"].as_str().unwrap().contains("account row locked"), "{parked:?}");
    assert!(parked[1]["error"].is_null(), "e2 was never tried: {parked:?}");
    assert_eq!(parked[0]["history"].as_array().unwrap().len(), 1, "{parked:?}");
    let head = parked[0]["id"].as_i64().unwrap().to_string();

    // Without ids or --all: refused, naming the fix.
    let out = idem().args(["parked", "retry-now", "--database-url", &url]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--all"), "{}", String::from_utf8_lossy(&out.stderr));
    // Only e1 was waiting for its delay; e2 is due already (it follows e1).
    let out = idem().args(["parked", "retry-now", "--all", "--database-url", &url]).output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("1 parked message(s) due now"));

    // Discarded: a dead letter that says who, why, and what happened before.
    let out = idem()
        .args(["parked", "discard", &head, "--reason", "bad account data", "--as", "alice", "--database-url", &url])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let letters = json(&["dead-letters", "list", "--database-url", &url, "--json"]);
    let letters = letters.as_array().unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    let error = letters[0]["error"].as_str().unwrap();
    assert!(error.contains("discarded from the parked messages by alice: bad account data"), "{error}");
    assert!(error.contains("account row locked"), "{error}");
    assert_eq!(letters[0]["event_id"], "e1");
    let out = idem().args(["parked", "discard", &head, "--reason", "again", "--database-url", &url]).output().unwrap();
    assert!(!out.status.success(), "a message discarded already is not parked any more");

    // The next run applies e2, which now heads its key; nothing stays parked.
    handler.failing.store(false, Ordering::SeqCst);
    consume(&url, &log, handler.clone(), |s| s.processed == 1).await;
    assert_eq!(handler.applied.load(Ordering::SeqCst), 2, "e3, then e2");
    let parked = json(&["parked", "list", "--database-url", &url, "--json"]);
    assert_eq!(parked.as_array().unwrap().len(), 0, "{parked:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
