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
    assert_eq!(parked[0]["payload"]["id"], "e1", "a JSON payload is JSON: {parked:?}");
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

    // Every action is in the audit trail, newest first: who, what, which, how many, how it ended.
    let audit = json(&["audit", "list", "--database-url", &url, "--json"]);
    let audit = audit.as_array().unwrap();
    let actions: Vec<(&str, &str, i64)> = audit
        .iter()
        .map(|e| (e["action"].as_str().unwrap(), e["actor"].as_str().unwrap(), e["count"].as_i64().unwrap()))
        .collect();
    assert_eq!(actions[0].0, "parked discard", "{audit:?}");
    assert_eq!(actions[0].2, 0, "the second discard found nothing: {audit:?}");
    assert_eq!(actions[1], ("parked discard", "alice", 1), "{audit:?}");
    assert!(audit[1]["subjects"].as_str().unwrap().contains("bad account data"), "{audit:?}");
    assert_eq!((actions[2].0, actions[2].2), ("parked retry-now", 1), "{audit:?}");
    assert!(audit.iter().all(|e| e["outcome"] == "ok"), "{audit:?}");

    // The next run applies e2, which now heads its key; nothing stays parked.
    handler.failing.store(false, Ordering::SeqCst);
    consume(&url, &log, handler.clone(), |s| s.processed == 1).await;
    assert_eq!(handler.applied.load(Ordering::SeqCst), 2, "e3, then e2");
    let parked = json(&["parked", "list", "--database-url", &url, "--json"]);
    assert_eq!(parked.as_array().unwrap().len(), 0, "{parked:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGKILL at commits of every kind while some credits of 150 accounts fail for a few seconds: the parking of a
/// failing credit,
/// of the credits parked behind it, the releases and the last dead letters. Workers with delayed retries are
/// killed at one commit after another (before it and after it), then one runs until nothing is parked: the
/// ledger is exact, every account's credits are in production order, and nothing but the poison messages is a
/// dead letter.
#[test]
fn parking_and_releasing_survive_sigkill() {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("idem-cli-parked-kill-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/ledger.db", dir.display());
    let log_dir = dir.join("log").display().to_string();
    let run = |args: &[&str]| {
        let out = idem().args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    run(&["demo-prepare", "--database-url", &url]);
    let plan: Value = serde_json::from_str(
        run(&["demo-produce", "--log-dir", &log_dir, "--events", "2000", "--seed", "11", "--partitions", "4"]).trim(),
    )
    .unwrap();
    let now_ms =
        || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis()) as i64;
    let until = now_ms() + 8_000;
    let until_arg = until.to_string();
    // Accounts 1 to 150 (of the demo's 1,000): every fifth payment of theirs fails, the others would succeed.
    let flaky: Vec<String> = (1..=150).map(|a: i32| a.to_string()).collect();
    let flaky = flaky.join(",");
    let worker = |extra: &[&str]| {
        let mut command = idem();
        command.args(["demo-worker", "--log-dir", &log_dir, "--database-url", &url, "--batch-size", "20"]);
        command.args(["--max-attempts", "2", "--delayed-retries", "1s,1s,1s,1s,1s,1s,1s,1s,1s,1s,1s,1s,1s,1s,1s"]);
        command.args(["--flaky-accounts", &flaky]);
        command.args(["--flaky-until-ms", &until_arg]);
        command.args(extra);
        command
    };
    use std::os::unix::process::ExitStatusExt;
    let mut killed = 0;
    for point in ["after-commit:3", "before-commit:8", "after-commit:25", "after-commit:2", "before-commit:40"] {
        let status = worker(&["--fault", point]).stdout(std::process::Stdio::null()).status().unwrap();
        killed += usize::from(status.signal() == Some(9));
        assert!(status.success() || status.signal() == Some(9), "{point}: {status:?}");
    }
    assert!(killed >= 3, "the workers were killed at their fault points ({killed} of 5)");
    let parked_now = json(&["parked", "list", "--database-url", &url, "--table-prefix", "idem_demo_", "--json"]);
    assert!(!parked_now.as_array().unwrap().is_empty(), "the flaky accounts' credits are parked: {parked_now}");

    // After the accounts clear, one worker runs until every credit is applied and nothing is parked.
    while now_ms() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut last = worker(&["--follow"]).stdout(std::process::Stdio::null()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let parked = json(&["parked", "list", "--database-url", &url, "--table-prefix", "idem_demo_", "--json"]);
        let stats = json(&["stats", "--database-url", &url, "--table-prefix", "idem_demo_", "--json"]);
        let markers = stats.as_array().unwrap().iter().map(|g| g["markers"].as_i64().unwrap_or(0)).sum::<i64>();
        let expected_markers = plan["expected_entries"].as_i64().unwrap() + plan["poison_with_key"].as_i64().unwrap();
        if parked.as_array().unwrap().is_empty() && markers == expected_markers {
            break;
        }
        assert!(Instant::now() < deadline, "not settled: {parked} {stats}");
        std::thread::sleep(Duration::from_millis(200));
    }
    Command::new("kill").args(["-TERM", &last.id().to_string()]).status().unwrap();
    assert!(last.wait().unwrap().success());

    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let pool = idem::sqlite::connect(&url).await.unwrap();
        let (entries, total): (i64, i64) =
            sqlx::query_as("SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM idem_demo_ledger")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(entries, plan["expected_entries"].as_i64().unwrap(), "every credit once");
        assert_eq!(total, plan["expected_total_cents"].as_i64().unwrap(), "to the cent");
        let out_of_order: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM idem_demo_ledger a JOIN idem_demo_ledger b
                ON a.account = b.account AND a.rowid < b.rowid AND a.event_id > b.event_id",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(out_of_order, 0, "an account's credits applied out of production order");
        let flaky: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_demo_ledger WHERE account <= 150")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(flaky > 0, "the flaky accounts had credits");
        let letters: Vec<String> =
            sqlx::query_scalar("SELECT error FROM idem_demo_dead_letters").fetch_all(&pool).await.unwrap();
        assert_eq!(letters.len() as i64, plan["poison"].as_i64().unwrap(), "only the poison messages: {letters:?}");
        pool.close().await;
    });
    let _ = std::fs::remove_dir_all(&dir);
}
