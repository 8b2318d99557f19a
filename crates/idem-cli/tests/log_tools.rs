//! The embedded log's operator tools, as a user runs them: a record damaged in the middle of a partition stops the
//! consumer with the commands to run; `idem log inspect` shows the damage; `idem log skip` stores the record's bytes
//! as a dead letter and moves the group past it; the consumer then finishes with every other event applied once.

use std::process::{Command, Output};

use serde_json::Value;

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem")).args(args).output().expect("run idem")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[test]
fn a_damaged_record_is_inspected_skipped_into_the_dead_letters_and_the_rest_applied() {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("idem-cli-logtools-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log_dir = dir.join("log");
    let url = format!("sqlite://{}", dir.join("ledger.db").display());
    assert!(idem(&["demo-prepare", "--database-url", &url]).status.success());
    let log = idem::embedded::EmbeddedLog::open(&log_dir).unwrap();
    log.create_topic("payments", 1).unwrap();
    let producer = log.producer();
    for n in 0..300 {
        let payload = format!(r#"{{"idempotencyKey":"d-{n:04}","account":{},"amount":1}}"#, 1 + n % 10);
        producer.send("payments", None, payload.as_bytes(), &[]).unwrap();
    }
    producer.flush().unwrap();

    // The high byte of record 200's length field.
    let path = log_dir.join("topics/payments/0.log");
    let mut bytes = std::fs::read(&path).unwrap();
    let mut pos = 0usize;
    for _ in 0..200 {
        pos += 8 + u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
    }
    bytes[pos + 3] = 0x7f;
    std::fs::write(&path, &bytes).unwrap();

    let log_arg = log_dir.display().to_string();
    let worker = ["demo-worker", "--log-dir", log_arg.as_str(), "--database-url", url.as_str(), "--batch-size", "7"];
    let stopped = idem(&worker);
    let said = text(&stopped);
    assert!(!stopped.status.success(), "the consumer stops at the damage: {said}");
    assert!(said.contains("offset 200") && said.contains("idem log skip"), "{said}");

    let inspect = idem(&["log", "inspect", "--log-dir", &log_arg, "--json"]);
    assert_eq!(inspect.status.code(), Some(1), "damage found: exit 1");
    let report: Value = serde_json::from_slice(&inspect.stdout).unwrap();
    let damage = &report["partitions"][0]["damage"];
    assert_eq!((damage[0]["offset"].as_i64(), damage[0]["kind"].as_str()), (Some(200), Some("damaged")), "{report}");
    assert_eq!(report["partitions"][0]["end_offset"], 300);

    let db = ["--database-url", url.as_str(), "--table-prefix", "idem_demo_"];
    let skip_args = ["log", "skip", "--log-dir", &log_arg, "--group", "demo-ledger", "--topic", "payments"];
    let wrong = idem(&[&skip_args[..], &["--partition", "0", "--offset", "150"], &db[..]].concat());
    assert!(!wrong.status.success() && text(&wrong).contains("stands at offset 200"), "{}", text(&wrong));
    let skipped = idem(&[&skip_args[..], &["--partition", "0", "--offset", "200"], &db[..]].concat());
    assert!(skipped.status.success(), "{}", text(&skipped));

    let finished = idem(&worker);
    assert!(finished.status.success(), "{}", text(&finished));
    let list = idem(&[&["dead-letters", "list", "--json"][..], &db[..]].concat());
    let letters: Vec<Value> = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0]["offset"], "200", "a 64-bit offset is a decimal string");
    assert!(letters[0]["error"].as_str().unwrap().contains("damaged record"), "{}", letters[0]);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (entries, distinct): (i64, i64) = runtime.block_on(async {
        use sqlx::Connection;
        let mut conn = sqlx::SqliteConnection::connect(&url).await.unwrap();
        sqlx::query_as("SELECT COUNT(*), COUNT(DISTINCT event_id) FROM idem_demo_ledger")
            .fetch_one(&mut conn)
            .await
            .unwrap()
    });
    assert_eq!((entries, distinct), (299, 299), "every record but the damaged one, once");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A line that fails part-way through `idem log produce` stops it with what was appended and the line to resume
/// from; the records before it are in the log, nothing after it.
#[test]
fn a_produce_that_fails_part_way_says_what_it_appended_and_where_to_resume() {
    use std::io::Write;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("idem-cli-produce-{}-{nanos}", std::process::id()));
    let log_arg = dir.join("log").display().to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["log", "produce", "--log-dir", &log_arg, "--topic", "payments", "--key-pointer", "/account"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("idem log produce");
    let lines = [r#"{"account":1,"amount":1}"#, "", r#"{"account":2,"amount":2}"#, r#"{"account":[3]}"#, "{}"];
    let mut stdin = child.stdin.take().expect("stdin");
    for line in lines {
        writeln!(stdin, "{line}").expect("write a line");
    }
    drop(stdin);
    let out = child.wait_with_output().expect("produce");
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("line 4: /account is not a string or a number"), "{said}");
    assert!(said.contains("2 record(s) appended to payments (input lines 1 to 3)"), "{said}");
    assert!(said.contains("resume from line 4 (tail -n +4"), "{said}");
    let inspect = idem(&["log", "inspect", "--log-dir", &log_arg, "--json"]);
    let report: Value = serde_json::from_slice(&inspect.stdout).expect("inspect's JSON");
    assert_eq!(report["partitions"][0]["end_offset"], 2, "{report}");
    let _ = std::fs::remove_dir_all(&dir);
}
