//! Failure groups: `idem dead-letters groups` puts dead letters that failed the same way together whatever the
//! values in their reasons, `list --fingerprint` shows one group, and `replay --fingerprint` replays that group
//! only; `discard` moves letters to the archive with who, when and why, `prune` expires the archive, and a replay
//! older than the markers kept is refused without `--force`. On SQLite and the embedded log, through the `idem`
//! binary.

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

/// Twelve payments applied and five dead-lettered (three to accounts that do not exist, typed `payment` once and
/// `refund` twice in a `type` header; two with amounts that are not numbers); the database URL and the log.
async fn dead_lettered(name: &str) -> (std::path::PathBuf, String, std::path::PathBuf) {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("idem-cli-{name}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/ledger.db", dir.display());
    let log_dir = dir.join("log");
    let log = EmbeddedLog::open(&log_dir).unwrap();
    log.create_topic("payments", 1).unwrap();
    let producer = log.producer();
    let mut payloads = Vec::new();
    for n in 0..12 {
        payloads.push((format!(r#"{{"id":"ok-{n}","account":{},"amount":100}}"#, n + 1), "payment"));
    }
    for (account, kind) in [(101, "payment"), (205, "refund"), (3_333, "refund"), (47, "payment")] {
        payloads.push((format!(r#"{{"id":"missing-{account}","account":{account},"amount":100}}"#), kind));
    }
    for (n, amount) in ["\"12.00 EUR\"", "\"9,99\""].iter().enumerate() {
        payloads.push((format!(r#"{{"id":"amount-{n}","account":1,"amount":{amount}}}"#), "payment"));
    }
    for (payload, kind) in &payloads {
        producer.send("payments", None, payload.as_bytes(), &[("type".to_owned(), kind.as_bytes().to_vec())]).unwrap();
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
    (dir, url, log_dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_grouped_by_how_they_failed() {
    let (dir, url, log_dir) = dead_lettered("groups").await;
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

fn ids(letters: &Value) -> Vec<&str> {
    letters.as_array().unwrap().iter().map(|l| l["event_id"].as_str().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discarded_letters_are_archived_and_old_ones_replay_only_when_forced() {
    let (dir, url, log_dir) = dead_lettered("discard").await;
    let db = ["--database-url", url.as_str()];

    // The message type splits the accounts' group in two.
    let typed = json(&[&["dead-letters", "groups", "--message-type", "header:type", "--json"], &db[..]].concat());
    let typed = typed.as_array().unwrap();
    assert_eq!(typed.len(), 3, "{typed:?}");
    let refunds = typed.iter().find(|g| g["message_type"] == "refund").unwrap();
    assert_eq!((refunds["count"].as_i64(), refunds["pattern"].as_str()), (Some(2), Some("account # does not exist")));
    let refunds = refunds["fingerprint"].as_str().unwrap();
    let bad = idem().args(["dead-letters", "groups", "--message-type", "type"]).args(db).output().unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("header:NAME"), "{bad:?}");

    // The fingerprint of a typed group, asked for without the type setting: nothing matches, said so.
    let untyped =
        idem().args(["dead-letters", "discard", "--fingerprint", refunds, "--reason", "x"]).args(db).output().unwrap();
    assert!(!untyped.status.success());
    assert!(String::from_utf8_lossy(&untyped.stderr).contains("without --message-type"), "{untyped:?}");
    // A fingerprint is twelve hex digits; one narrowed away by another filter says so.
    let malformed = idem().args(["dead-letters", "list", "--fingerprint", "refunds"]).args(db).output().unwrap();
    assert!(String::from_utf8_lossy(&malformed.stderr).contains("12 hexadecimal digits"), "{malformed:?}");
    let narrowed = idem()
        .args(["dead-letters", "discard", "--fingerprint", &refunds.to_uppercase(), "--message-type", "header:type"])
        .args(["--older-than", "1h", "--reason", "x"])
        .args(db)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&narrowed.stderr);
    assert!(stderr.contains("has 2 dead letter(s), but the other filters"), "{stderr}");
    // A discard names what it takes and says why; the refusal is in the audit trail.
    let out = idem().args(["dead-letters", "discard", "--reason", "x"]).args(db).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("name the dead letters to discard"), "{out:?}");
    let audit = json(&[&["audit", "list", "--json"], &db[..]].concat());
    let entry = &audit.as_array().unwrap()[0];
    assert_eq!((entry["action"].as_str(), entry["count"].as_i64()), (Some("dead-letters discard"), Some(0)));
    assert!(entry["outcome"].as_str().unwrap().contains("name the dead letters"), "{entry}");
    // A dry run says what it would take and changes nothing (nor writes the trail).
    let dry = json(
        &[&["dead-letters", "discard", "--matching", "cents", "--reason", "x", "--dry-run", "--json"], &db[..]]
            .concat(),
    );
    assert_eq!(dry["would_discard"].as_array().map(Vec::len), Some(2), "{dry}");
    assert_eq!(json(&[&["audit", "list", "--json"], &db[..]].concat()), audit, "a dry run is not audited");
    let out = idem()
        .args(["dead-letters", "discard", "--failure-group", refunds, "--message-type", "header:type"])
        .args(db)
        .args(["--reason", "refunds re-issued by hand", "--as", "alice"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let archived = json(&[&["dead-letters", "archived", "--json"], &db[..]].concat());
    let mut discarded = ids(&archived);
    discarded.sort_unstable();
    assert_eq!(discarded, ["missing-205", "missing-3333"]);
    let first = &archived.as_array().unwrap()[0];
    assert_eq!(
        (first["discarded_by"].as_str(), first["reason"].as_str()),
        (Some("alice"), Some("refunds re-issued by hand"))
    );
    assert!(first["error"].as_str().unwrap().contains("does not exist"), "the letter is kept whole: {first}");
    let left = json(&[&["dead-letters", "list", "--json"], &db[..]].concat());
    assert_eq!(ids(&left), ["missing-101", "amount-0", "amount-1"]);
    let audit = json(&[&["audit", "list", "--json"], &db[..]].concat());
    let entry = &audit.as_array().unwrap()[0];
    assert_eq!(
        (entry["action"].as_str(), entry["actor"].as_str(), entry["count"].as_i64()),
        (Some("dead-letters discard"), Some("alice"), Some(2))
    );
    let subjects = entry["subjects"].as_str().unwrap();
    assert!(subjects.contains(&format!("ids {}", first["id"])) || subjects.contains(&format!(", {}", first["id"])));
    // A letter discarded already: who did it, and when.
    let again = idem()
        .args(["dead-letters", "discard", &first["id"].to_string(), "--reason", "twice"])
        .args(db)
        .output()
        .unwrap();
    assert!(!again.status.success());
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(stderr.contains("was discarded by alice at"), "{stderr}");
    let none = json(&[&["dead-letters", "list", "--older-than", "1h", "--json"], &db[..]].concat());
    assert_eq!(ids(&none), Vec::<&str>::new(), "every letter failed within the hour");

    // The archive outlives a prune within its expiry, not one past it; an expiry below a day needs --force; a dry
    // run counts what would go; a prune is audited.
    let prune = |expiry: &str, more: &[&str]| {
        let out = idem().args(["prune", "--retention", "8d", "--archive-expiry", expiry]).args(more).args(db).output();
        let out = out.unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        json(&[&["dead-letters", "archived", "--json"], &db[..]].concat()).as_array().unwrap().len()
    };
    assert_eq!(prune("30d", &[]), 2);
    let floor = idem().args(["prune", "--retention", "8d", "--archive-expiry", "0s"]).args(db).output().unwrap();
    let stderr = String::from_utf8_lossy(&floor.stderr);
    assert!(!floor.status.success() && stderr.contains("below one day") && stderr.contains("--force"), "{stderr}");
    let dry = json(
        &[&["prune", "--retention", "8d", "--archive-expiry", "1ms", "--force", "--dry-run", "--json"], &db[..]]
            .concat(),
    );
    assert_eq!((dry["archive"]["expired"].as_i64(), dry["archive"]["deleted"].as_i64()), (Some(2), Some(0)), "{dry}");
    assert_eq!(prune("1ms", &["--force", "--as", "bob"]), 0);
    let audit = json(&[&["audit", "list", "--json"], &db[..]].concat());
    let entry = &audit.as_array().unwrap()[0];
    assert_eq!((entry["action"].as_str(), entry["actor"].as_str()), (Some("prune"), Some("bob")), "{entry}");

    // Every marker pruned: a replay is refused unless forced.
    let pool = idem::sqlite::connect(&url).await.unwrap();
    sqlx::query("DELETE FROM processed_events").execute(&pool).await.unwrap();
    pool.close().await;
    let replay = |force: bool| {
        let mut command = idem();
        command.args(["dead-letters", "replay", "--matching", "account", "--log-dir"]).arg(&log_dir).args(db);
        if force {
            command.arg("--force");
        }
        command.output().unwrap()
    };
    let log = log_dir.to_str().unwrap();
    let dry_replay = ["dead-letters", "replay", "--matching", "account", "--dry-run", "--json", "--log-dir", log];
    let checked = json(&[&dry_replay[..], &db[..]].concat());
    assert_eq!(checked["refused"][0]["risk"], "markers_pruned", "{checked}");
    assert_eq!(checked["would_replay"].as_array().map(Vec::len), Some(0), "{checked}");
    let refused = replay(false);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("refused") && stderr.contains("--force") && stderr.contains("pruned"), "{stderr}");
    assert_eq!(ids(&json(&[&["dead-letters", "list", "--json"], &db[..]].concat())).len(), 3, "nothing replayed");
    let forced = replay(true);
    assert!(forced.status.success(), "{}", String::from_utf8_lossy(&forced.stderr));
    assert!(String::from_utf8_lossy(&forced.stdout).contains("1 dead letter(s) replayed"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A 64-bit offset (a Pub/Sub message id, an SQS message's digest) survives `jq` and JavaScript: `list --json` and
/// `archived --json` write it as a decimal string, exact where a JSON number would be rounded beyond 2^53.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_bit_offset_is_exact_in_json() {
    let (dir, url, _log_dir) = dead_lettered("offsets").await;
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::query("UPDATE dead_letters SET \"offset\" = ? WHERE event_id = 'missing-101'")
        .bind(i64::MAX)
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    let db = ["--database-url", url.as_str()];
    let listed = json(&[&["dead-letters", "list", "--json"], &db[..]].concat());
    let letter = listed.as_array().unwrap().iter().find(|l| l["event_id"] == "missing-101").unwrap().clone();
    assert_eq!(letter["offset"], "9223372036854775807", "{letter}");
    let id = letter["id"].as_i64().unwrap().to_string();
    let out = idem().args(["dead-letters", "discard", &id, "--reason", "offset check"]).args(db).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let archived = json(&[&["dead-letters", "archived", "--json"], &db[..]].concat());
    assert_eq!(archived[0]["offset"], "9223372036854775807", "{archived}");
    let _ = std::fs::remove_dir_all(&dir);
}
