//! `idem demo --http`: clients that give up early, send again and send one key three times at once, against
//! `idem run` serving `[consumer.http]` while it is killed with SIGKILL (at its fault points and at random
//! moments); on SQLite, PostgreSQL and MariaDB the ledger is exact and every answer of a key the same.

use std::process::Command;

use serde_json::Value;

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{prefix}_{}_{}", std::process::id(), nanos % 1_000_000_000)
}

fn run_demo(extra: &[&str], database: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["demo", "--http", "--json", "--events", "1500", "--crashes", "4", "--seed", "11"])
        .args(extra)
        .output()
        .expect("run idem demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{e}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr)));
    assert!(out.status.success(), "{summary}");
    assert_eq!((&summary["ok"], summary["database"].as_str()), (&Value::Bool(true), Some(database)), "{summary}");
    assert_eq!(summary["ledger_entries"], 1500, "{summary}");
    assert_eq!(summary["distinct_ledger_events"], 1500, "{summary}");
    let count = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("not a count: {v} in {summary}"));
    assert!(count(&summary["crashes_survived"]) >= 3, "the server was not killed: {summary}");
    let http = &summary["http"];
    // The cases the demo is there for happened: clients gave up and retried, answers were replayed and compared.
    for figure in ["client_timeouts", "connections_lost", "replayed", "concurrent_keys", "answers_compared"] {
        assert!(count(&http[figure]) > 0, "no {figure}: {summary}");
    }
    assert!(count(&http["statuses"]["422"]) >= 2, "the two poison payments with a key: {summary}");
}

#[test]
fn demo_http_on_sqlite() {
    run_demo(&[], "sqlite");
}

#[test]
fn demo_http_on_postgres() {
    let server = std::env::var("IDEM_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
    let db = unique("idem_hdemo");
    let psql = |sql: &str| {
        let out = Command::new("psql").args([&format!("{server}/postgres"), "-tAc", sql]).output().expect("psql");
        assert!(out.status.success(), "{sql}: {}", String::from_utf8_lossy(&out.stderr));
    };
    psql(&format!("CREATE DATABASE {db}"));
    run_demo(&["--database-url", &format!("{server}/{db}")], "postgres");
    psql(&format!("DROP DATABASE {db} WITH (FORCE)"));
}

#[test]
fn demo_http_on_mysql() {
    let server = std::env::var("IDEM_TEST_MYSQL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".into());
    run_demo(&["--database-url", &format!("{server}/test")], "mysql");
}
