//! `idem demo --nats`, `--rabbitmq`, `--sqs` and `--pubsub`: the demo on the real servers (`IDEM_NATS_URL`,
//! default nats://127.0.0.1:4222; `IDEM_RABBITMQ_URL`, default amqp://guest:guest@127.0.0.1:5672/%2f;
//! `IDEM_SQS_ENDPOINT`, default the local SQS server of scripts/sqs.sh, http://127.0.0.1:9324;
//! `IDEM_PUBSUB_EMULATOR_HOST`, default the Pub/Sub emulator of scripts/pubsub.sh, 127.0.0.1:8681), on SQLite and
//! on PostgreSQL, with its crashes and its exact ledger check (on the emulator: exact up to what it holds back).

#![cfg_attr(not(all(feature = "nats", feature = "rabbitmq", feature = "sqs", feature = "pubsub")), allow(dead_code))]

use std::process::Command;

use serde_json::Value;

fn nats_url() -> String {
    std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

fn rabbitmq_url() -> String {
    std::env::var("IDEM_RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

fn sqs_endpoint() -> String {
    std::env::var("IDEM_SQS_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:9324".to_owned())
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{prefix}_{}_{nanos}", std::process::id())
}

fn psql(url: &str, sql: &str) {
    let out = Command::new("psql").args([url, "-tAc", sql]).output().expect("psql");
    assert!(out.status.success(), "{sql}: {}", String::from_utf8_lossy(&out.stderr));
}

fn pubsub_emulator() -> String {
    std::env::var("IDEM_PUBSUB_EMULATOR_HOST").unwrap_or_else(|_| "127.0.0.1:8681".to_owned())
}

/// Runs `idem demo --json` with `events`, 3 crashes and `args` (the emulator's address in its environment): the
/// summary, checked to say `ok` on `database` after at least `crashes` of them.
fn run_demo(events: u64, args: &[&str], database: &str, crashes: u64) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["demo", "--json", "--events", &events.to_string(), "--crashes", "3"])
        .args(args)
        .env("PUBSUB_EMULATOR_HOST", pubsub_emulator())
        .output()
        .expect("run idem demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{e}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr)));
    assert!(out.status.success(), "{summary}");
    assert_eq!(summary["ok"], true, "{summary}");
    assert_eq!(summary["database"], database, "{summary}");
    let survived = summary["crashes_survived"].as_u64().unwrap_or(0);
    assert!((crashes..=3).contains(&survived), "{summary}");
    summary
}

/// Runs `idem demo` on `broker` (its flag and URL) with `extra` arguments and checks its summary.
fn demo(broker: [&str; 2], extra: &[&str], database: &str) {
    if broker[0] == "--pubsub" {
        return demo_on_the_pubsub_emulator(broker, extra, database);
    }
    // Fewer events on SQS: the local stand-in's sends slow down with every message its queue holds.
    let events: u64 = if broker[0] == "--sqs" { 500 } else { 2000 };
    let summary = run_demo(events, &[broker.as_slice(), extra].concat(), database, 3);
    assert_eq!(summary["ledger_entries"], events, "{summary}");
    assert_eq!(summary["distinct_ledger_events"], events, "{summary}");
    // A crash after a commit leaves its batch unacknowledged: it comes again and is absorbed.
    assert!(summary["duplicates_absorbed"].as_u64().unwrap() > summary["producer_duplicates"].as_u64().unwrap());
}

/// `idem demo --pubsub` on the emulator: it does not deliver again what a killed consumer held on an ordered
/// subscription, so the summary's figures are checked against what it held back.
fn demo_on_the_pubsub_emulator(broker: [&str; 2], extra: &[&str], database: &str) {
    // The emulator holds back for good what a killed consumer held, so a later run can reach the end of what it
    // delivers before its fault point: at least the first crash happens.
    let summary = run_demo(2000, &[broker.as_slice(), extra].concat(), database, 1);
    let number = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("not a count: {v} in {summary}"));
    let held = &summary["held_back"];
    // Each event is applied, dead-lettered or held back by the emulator: none lost, none twice.
    let applied = number(&summary["distinct_ledger_events"]);
    assert_eq!(applied, number(&summary["ledger_entries"]), "{summary}");
    let accounted = applied + number(&summary["dead_letter_rows"]) + number(&held["events"]);
    assert_eq!(accounted, number(&summary["events_produced"]), "{summary}");
    // The first consumer's commits before its crash, at least, are in the ledger.
    assert!(applied > 0 && number(&summary["processed"]) == applied, "{summary}");
}

/// Runs the demo on `broker` against a fresh PostgreSQL database.
fn demo_on_postgres(broker: [&str; 2]) {
    let server = std::env::var("IDEM_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
    let db = unique("idem_bdemo");
    psql(&format!("{server}/postgres"), &format!("CREATE DATABASE {db}"));
    demo(broker, &["--database-url", &format!("{server}/{db}")], "postgres");
    psql(&format!("{server}/postgres"), &format!("DROP DATABASE {db} WITH (FORCE)"));
}

#[cfg(feature = "nats")]
#[test]
fn demo_on_nats_and_sqlite() {
    demo(["--nats", &nats_url()], &["--crash-point", "after-commit"], "sqlite");
}

#[cfg(feature = "nats")]
#[test]
fn demo_on_nats_and_postgres() {
    demo_on_postgres(["--nats", &nats_url()]);
}

#[cfg(feature = "rabbitmq")]
#[test]
fn demo_on_rabbitmq_and_sqlite() {
    demo(["--rabbitmq", &rabbitmq_url()], &["--crash-point", "after-commit"], "sqlite");
}

#[cfg(feature = "rabbitmq")]
#[test]
fn demo_on_rabbitmq_and_postgres() {
    demo_on_postgres(["--rabbitmq", &rabbitmq_url()]);
}

#[cfg(feature = "sqs")]
#[test]
fn demo_on_sqs_and_sqlite() {
    demo(["--sqs", &sqs_endpoint()], &["--crash-point", "after-commit"], "sqlite");
}

#[cfg(feature = "sqs")]
#[test]
fn demo_on_sqs_and_postgres() {
    demo_on_postgres(["--sqs", &sqs_endpoint()]);
}

/// The demo through `idem run --config` with an `[consumer.sqs]` source.
#[cfg(feature = "sqs")]
#[test]
fn demo_on_sqs_through_the_service_mode() {
    demo(["--sqs", &sqs_endpoint()], &["--service"], "sqlite");
}

#[cfg(feature = "pubsub")]
#[test]
fn demo_on_pubsub_and_sqlite() {
    demo(["--pubsub", "idem-demo-test"], &["--crash-point", "after-commit"], "sqlite");
}

#[cfg(feature = "pubsub")]
#[test]
fn demo_on_pubsub_and_postgres() {
    demo_on_postgres(["--pubsub", "idem-demo-test"]);
}

/// The demo through `idem run --config` with a `[consumer.pubsub]` source.
#[cfg(feature = "pubsub")]
#[test]
fn demo_on_pubsub_through_the_service_mode() {
    demo(["--pubsub", "idem-demo-test"], &["--service"], "sqlite");
}
