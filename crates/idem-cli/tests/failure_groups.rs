//! Failure groups: `idem dead-letters groups` puts dead letters that failed the same way together whatever the
//! values in their reasons, `list --fingerprint` shows one group, and `replay --fingerprint` replays that group
//! only. On SQLite and the embedded log, through the `idem` binary.

use std::process::Command;
use std::time::Duration;

use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor, KillSwitch};
use serde_json::Value;

fn idem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_idem"))
}

fn json(args: &[&str]) -> Value {
    let out = idem().args(args).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Accounts above 100 do not exist; an amount that is not a number cannot be read.
struct Ledger;

#[derive(serde::Deserialize)]
struct Payment {
    account: i64,
    amount: serde_json::Value,
}

impl Handler<sqlx::Sqlite> for Ledger {
    async fn handle(&self, event: &Event, _tx: &mut sqlx::SqliteConnection) -> Result<(), HandlerError> {
        let p: Payment = event.json()?;
        if !p.amount.is_i64() {
            return Err(HandlerError::permanent(format!(
                "amount {} of {} is not a number of cents",
                p.amount, event.id
            )));
        }
        if p.account > 100 {
            return Err(HandlerError::permanent(format!("account {} does not exist", p.account)));
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_grouped_by_how_they_failed() {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("idem-cli-groups-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/ledger.db", dir.display());
    let log_dir = dir.join("log");
    let log = EmbeddedLog::open(&log_dir).unwrap();
    log.create_topic("payments", 1).unwrap();
    let producer = log.producer();
    let mut payloads = Vec::new();
    for n in 0..12 {
        payloads.push(format!(r#"{{"id":"ok-{n}","account":{},"amount":100}}"#, n + 1));
    }
    for account in [101, 205, 3_333, 47] {
        payloads.push(format!(r#"{{"id":"missing-{account}","account":{account},"amount":100}}"#));
    }
    for (n, amount) in ["\"12.00 EUR\"", "\"9,99\""].iter().enumerate() {
        payloads.push(format!(r#"{{"id":"amount-{n}","account":1,"amount":{amount}}}"#));
    }
    for payload in &payloads {
        producer.send("payments", None, payload.as_bytes(), &[]).unwrap();
    }
    producer.flush().unwrap();

    let pool = idem::sqlite::connect(&url).await.unwrap();
    let config = Config::new("ledger", KeyExtractor::JsonPointer("/id".into())).kill_switch(KillSwitch::off());
    idem::migrate(&pool, &config.tables).await.unwrap();
    let engine = Engine::new(pool.clone(), config).unwrap();
    let options = ConsumerOptions { stop_at_end: true, ..ConsumerOptions::default() };
    let source = log.consumer("ledger", &["payments"], options).unwrap();
    let stats = tokio::time::timeout(Duration::from_secs(30), engine.run(source, Ledger, std::future::pending::<()>()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stats.dead_lettered, 5, "{stats:?}");
    pool.close().await;

    let groups = json(&["dead-letters", "groups", "--database-url", &url, "--json"]);
    let groups = groups.as_array().unwrap();
    assert_eq!(groups.len(), 2, "accounts and amounts: {groups:?}");
    assert_eq!(groups[0]["count"], 3, "the largest group first: {groups:?}");
    assert_eq!(groups[0]["pattern"], "account # does not exist");
    assert_eq!(groups[1]["count"], 2);
    assert_eq!(groups[1]["pattern"], "amount '…' of # is not a number of cents");
    let accounts = groups[0]["fingerprint"].as_str().unwrap().to_owned();

    let listed = json(&["dead-letters", "list", "--database-url", &url, "--fingerprint", &accounts, "--json"]);
    let listed: Vec<&str> = listed.as_array().unwrap().iter().map(|l| l["event_id"].as_str().unwrap()).collect();
    assert_eq!(listed, ["missing-101", "missing-205", "missing-3333"]);

    let out = idem()
        .args(["dead-letters", "replay", "--database-url", &url, "--log-dir", &log_dir.display().to_string()])
        .args(["--fingerprint", &accounts])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("3 dead letter(s) replayed"), "{stdout}");
    let groups = json(&["dead-letters", "groups", "--database-url", &url, "--json"]);
    let patterns: Vec<&str> = groups.as_array().unwrap().iter().map(|g| g["pattern"].as_str().unwrap()).collect();
    assert_eq!(patterns, ["amount '…' of # is not a number of cents"], "only the other group is left");
    let audit = json(&["audit", "list", "--database-url", &url, "--json"]);
    let entry = &audit.as_array().unwrap()[0];
    assert_eq!((entry["action"].as_str(), entry["count"].as_i64()), (Some("dead-letters replay"), Some(3)), "{audit}");
    assert!(entry["subjects"].as_str().unwrap().contains(&accounts), "the replay names its failure group: {audit}");
    let _ = std::fs::remove_dir_all(&dir);
}
