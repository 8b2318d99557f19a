//! Real crashes: the `idem` binary's consumer processes are killed with SIGKILL at the fault points, and the
//! ledger must still be exact. Runs `idem demo` on SQLite and on a fresh PostgreSQL database.

use std::process::Command;

use serde_json::Value;

fn idem(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem")).args(args).output().expect("run idem");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn demo(extra: &[&str]) -> Value {
    let mut args = vec!["demo", "--json", "--seed", "42"];
    args.extend_from_slice(extra);
    let (ok, stdout, stderr) = idem(&args);
    let summary: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"));
    assert!(ok, "idem demo failed: {summary}\n{stderr}");
    assert_eq!(summary["ok"], true, "{summary}");
    assert_eq!(summary["mismatches"].as_array().map(Vec::len), Some(0), "{summary}");
    summary
}

fn fresh_postgres() -> Option<String> {
    let server = std::env::var("IDEM_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
    let name = format!(
        "idem_cli_{}_{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?.subsec_nanos()
    );
    let status = Command::new("psql")
        .args([&format!("{server}/postgres"), "-qc", &format!("CREATE DATABASE {name}")])
        .status()
        .ok()?;
    status.success().then(|| format!("{server}/{name}"))
}

/// `idem demo --chain` on the embedded default: both ledgers exact, every account's order kept in the second,
/// with the consumers and the relays killed.
#[test]
fn chain_demo_on_the_embedded_log() {
    let s = demo(&["--chain", "--events", "1500", "--crashes", "2"]);
    let chain = &s["chain"];
    assert_eq!(chain["relays_killed"], 2, "{s}");
    assert_eq!(chain["second_crashes_survived"], 2, "{s}");
    assert_eq!(chain["second_total_cents"], s["expected_total_cents"], "{s}");
    assert_eq!(chain["second_ledger_entries"], 1500, "{s}");
    assert_eq!((chain["out_of_order"].as_i64(), chain["outbox_left"].as_i64()), (Some(0), Some(0)), "{s}");
}

/// SIGKILL between the commit and the acknowledgement: the committed message comes again and is a duplicate.
#[test]
fn kill_after_commit_redelivers_as_duplicate() {
    let s = demo(&[
        "--events",
        "300",
        "--duplicates",
        "0",
        "--batch-size",
        "1",
        "--partitions",
        "1",
        "--crashes",
        "1",
        "--crash-point",
        "after-commit",
    ]);
    assert_eq!(s["crashes_after_commit"], 1, "{s}");
    assert_eq!(s["duplicates_absorbed"], 1, "exactly the one committed-but-unacknowledged message: {s}");
    assert_eq!(s["ledger_entries"], 300);
}

/// SIGKILL before the commit: nothing of the batch committed; it comes again and is applied once.
#[test]
fn kill_before_commit_applies_once() {
    let s = demo(&[
        "--events",
        "300",
        "--duplicates",
        "0",
        "--batch-size",
        "1",
        "--partitions",
        "1",
        "--crashes",
        "1",
        "--crash-point",
        "before-commit",
    ]);
    assert_eq!(s["crashes_before_commit"], 1, "{s}");
    assert_eq!(s["duplicates_absorbed"], 0, "{s}");
    assert_eq!(s["processed"], 300, "{s}");
    assert_eq!(s["ledger_entries"], 300);
}

/// The README's demo, smaller: several crashes of both kinds, batches, producer duplicates, poison messages.
#[test]
fn demo_on_sqlite_survives_crashes() {
    let s = demo(&["--events", "5000", "--crashes", "3"]);
    assert_eq!(s["crashes_survived"], 3, "{s}");
    assert!(s["duplicates_absorbed"].as_u64().unwrap() >= s["producer_duplicates"].as_u64().unwrap());
    assert!(s["producer_duplicates"].as_u64().unwrap() >= 50, "at least 1% duplicates: {s}");
    assert_eq!(s["dead_lettered"], 3);
}

#[test]
fn demo_on_postgres_survives_crashes() {
    let url = fresh_postgres().expect("PostgreSQL must run on 127.0.0.1:5432 (psql on PATH)");
    let s = demo(&["--events", "5000", "--crashes", "3", "--database-url", &url]);
    assert_eq!(s["database"], "postgres");
    assert_eq!(s["crashes_survived"], 3, "{s}");
    let db = url.rsplit('/').next().unwrap_or_default().to_owned();
    let server = url.trim_end_matches(&format!("/{db}")).to_owned();
    let _ = Command::new("psql")
        .args([&format!("{server}/postgres"), "-qc", &format!("DROP DATABASE {db} WITH (FORCE)")])
        .status();
}

/// The operator's commands on what the demo left: stats, dead letters, replay.
#[test]
fn operator_commands_on_a_kept_demo() {
    let dir = std::env::temp_dir().join(format!("idem-cli-ops-{}", std::process::id()));
    let dir_arg = dir.display().to_string();
    demo(&["--events", "500", "--crashes", "1", "--dir", &dir_arg]);
    let url = format!("sqlite://{}/ledger.db", dir.display());
    let db = ["--database-url", url.as_str(), "--table-prefix", "idem_demo_"];

    let (ok, out, err) = idem(&[&["migrate"][..], &db].concat());
    assert!(ok && out.contains("schema is current"), "{out}{err}");
    let (ok, out, err) = idem(&[&["stats", "--json"][..], &db].concat());
    assert!(ok, "{err}");
    let stats: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(stats[0]["consumer_group"], "demo-ledger");
    assert_eq!(stats[0]["markers"], 502);
    assert_eq!(stats[0]["dead_letters"], 3);

    let (ok, out, err) = idem(&[&["dead-letters", "list", "--json"][..], &db].concat());
    assert!(ok, "{err}");
    let letters: Vec<Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(letters.len(), 3);
    assert!(letters.iter().any(|l| l["error"].as_str().unwrap().contains("json:/idempotencyKey")), "{out}");
    assert!(letters.iter().any(|l| l["error"].as_str().unwrap().contains("does not exist")), "{out}");

    let log_dir = format!("{}/log", dir.display());
    let (ok, out, err) = idem(&[&["dead-letters", "replay", "--all", "--log-dir", &log_dir][..], &db].concat());
    assert!(ok && out.contains("3 dead letter(s) replayed"), "{out}{err}");
    let (ok, out, _) = idem(&[&["dead-letters", "replay", "999999", "--log-dir", &log_dir][..], &db].concat());
    assert!(!ok, "an unknown id is refused: {out}");
    let (ok, _, err) = idem(&["migrate", "--database-url", "mysql://nope"]);
    assert!(!ok && err.contains("--database-url"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A worker killed right after a commit, before its acknowledgement, has already written each committed event's
/// log line (and its commit report): the lines are written where the kill cannot drop them.
#[test]
fn a_kill_after_the_commit_keeps_each_events_log_line() {
    use std::os::unix::process::ExitStatusExt;
    let dir = std::env::temp_dir().join(format!("idem-cli-killed-lines-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let url = format!("sqlite://{}/ledger.db", dir.display());
    let log_dir = format!("{}/log", dir.display());
    std::fs::create_dir_all(&dir).unwrap();
    let (ok, _, err) = idem(&["demo-prepare", "--database-url", &url]);
    assert!(ok, "{err}");
    let (ok, _, err) = idem(&["demo-produce", "--log-dir", &log_dir, "--events", "200", "--seed", "5"]);
    assert!(ok, "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--log", "debug", "--log-format", "json", "demo-worker", "--log-dir", &log_dir])
        .args(["--database-url", &url, "--batch-size", "25", "--fault", "after-commit:2"])
        .output()
        .unwrap();
    assert_eq!(out.status.signal(), Some(9), "killed at its fault point: {:?}", out.status);
    let reports: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|r| r.get("processed").is_some())
        .collect();
    let count = |field: &str| reports.iter().map(|r| r[field].as_u64().unwrap_or(0)).sum::<u64>();
    let (processed, duplicate) = (count("processed"), count("duplicate"));
    assert!(reports.len() == 2 && processed >= 2, "two transactions committed: {reports:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines = |outcome: &str| {
        stderr
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|l| l["outcome"] == outcome && l["event_id"].is_string())
            .count() as u64
    };
    assert_eq!((lines("processed"), lines("duplicate")), (processed, duplicate), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `idem demo --service` on PostgreSQL while every session of its database is terminated again and again
/// (`pg_terminate_backend`, the demo's own and its consumers'): the consumers and the demo's own queries connect
/// again, the ledger is exact and the summary is printed.
#[test]
fn demo_survives_its_sessions_being_terminated() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let url = fresh_postgres().expect("PostgreSQL must run on 127.0.0.1:5432 (psql on PATH)");
    let db = url.rsplit('/').next().unwrap_or_default().to_owned();
    let server = url.trim_end_matches(&format!("/{db}")).to_owned();
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let terminated = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let terminator = {
        let (stop, terminated, server, db) = (stop.clone(), terminated.clone(), server.clone(), db.clone());
        std::thread::spawn(move || {
            let sql = format!(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = '{db}' AND pid <> pg_backend_pid()"
            );
            while !stop.load(Ordering::SeqCst) {
                let out = Command::new("psql").args([&format!("{server}/postgres"), "-tAc", &sql]).output();
                if let Ok(out) = out {
                    let n = String::from_utf8_lossy(&out.stdout).trim().parse::<u64>().unwrap_or(0);
                    terminated.fetch_add(n, Ordering::SeqCst);
                }
                std::thread::sleep(std::time::Duration::from_millis(150));
            }
        })
    };
    let summary = demo(&["--events", "3000", "--crashes", "2", "--service", "--database-url", &url]);
    stop.store(true, Ordering::SeqCst);
    terminator.join().unwrap();
    assert_eq!(summary["crashes_survived"], 2, "{summary}");
    assert!(terminated.load(Ordering::SeqCst) > 0, "no session was terminated");
    let _ = Command::new("psql")
        .args([&format!("{server}/postgres"), "-qc", &format!("DROP DATABASE {db} WITH (FORCE)")])
        .status();
}
