//! A consumer process's operations surface: /metrics, /healthz, /readyz, graceful SIGTERM; and `idem prune`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn idem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_idem"))
}

fn get(addr: &str, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // Sent in two segments on purpose: the server must read the whole request head.
    stream.write_all(format!("GET {path} HTTP/1.1\r\n").as_bytes()).unwrap();
    // One request per connection: the endpoint keeps connections alive unless asked to close.
    stream.write_all(format!("Host: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

#[test]
fn metrics_health_and_prune_of_a_running_consumer() {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("idem-cli-http-{}-{nanos}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/ledger.db", dir.display());
    assert!(idem().args(["demo-prepare", "--database-url", &url]).status().unwrap().success());
    let log = idem::embedded::EmbeddedLog::open(dir.join("log")).unwrap();
    log.create_topic("payments", 1).unwrap();
    let producer = log.producer();
    for n in (0..10).chain(0..2) {
        let payload = format!(r#"{{"idempotencyKey":"h-{n}","account":{},"amount":5}}"#, n + 1);
        producer.send("payments", None, payload.as_bytes(), &[]).unwrap();
    }

    let log_dir = dir.join("log").display().to_string();
    let mut child = idem()
        .args(["demo-worker", "--log-dir", &log_dir, "--database-url", &url, "--follow"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (mut addr, mut handled) = (String::new(), 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while (addr.is_empty() || handled < 12) && Instant::now() < deadline {
        let Ok(line) = lines.recv_timeout(Duration::from_millis(200)) else { continue };
        let value: Value = serde_json::from_str(&line).unwrap_or_default();
        if let Some(a) = value["metrics_addr"].as_str() {
            addr = a.to_owned();
        }
        handled += value["processed"].as_u64().unwrap_or(0) + value["duplicate"].as_u64().unwrap_or(0);
    }
    if addr.is_empty() || handled != 12 {
        let _ = child.kill();
        panic!("addr {addr:?}, handled {handled}");
    }

    assert_eq!(get(&addr, "/healthz"), (200, "ok\n".to_owned()));
    let (status, body) = get(&addr, "/readyz");
    assert_eq!(status, 200, "{body}");
    let (status, metrics) = get(&addr, "/metrics");
    assert_eq!(status, 200);
    let labels = r#"consumer_group="demo-ledger",topic="payments""#;
    assert!(metrics.contains(&format!(r#"idem_events_handled_total{{{labels},outcome="processed"}} 10"#)), "{metrics}");
    assert!(metrics.contains(&format!(r#"idem_events_handled_total{{{labels},outcome="duplicate"}} 2"#)), "{metrics}");
    assert!(metrics.contains("idem_event_handle_duration_seconds_bucket"), "{metrics}");
    assert_eq!(get(&addr, "/nope").0, 404);

    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the consumer did not stop within 20 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "SIGTERM drains and exits cleanly: {status}");

    // idem prune: a dry run counts, a pass deletes in bounded statements.
    let db = ["--database-url", url.as_str(), "--table-prefix", "idem_demo_"];
    let out = idem().args(["prune", "--retention", "0s", "--dry-run"]).args(db).output().unwrap();
    let refused = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && refused.contains("below one hour") && refused.contains("--force"), "{refused}");
    let out = idem().args(["prune", "--retention", "0s", "--force", "--dry-run", "--json"]).args(db).output().unwrap();
    let dry: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((dry["expired"].as_i64(), dry["deleted"].as_i64()), (Some(10), Some(0)), "{dry}");
    let out = idem()
        .args(["prune", "--retention", "0s", "--force", "--batch-size", "4", "--pause-ms", "1", "--json"])
        .args(db)
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((report["deleted"].as_u64(), report["statements"].as_u64()), (Some(10), Some(4)), "{report}");
    let out = idem().args(["prune", "--retention", "8x"]).args(db).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("8d"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `idem prune --json` on the partitioned layout prints the plain layout's shape (`dry_run`, `layout`, `expired`,
/// `deleted`), with or without `--dry-run`, and names the partitions.
#[test]
fn prune_json_has_one_shape_on_the_partitioned_layout() {
    let server = std::env::var("IDEM_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let name = format!("idem_cli_prune_{}_{nanos}", std::process::id());
    let psql = |sql: &str| {
        let status = Command::new("psql")
            .args(["-q", "-v", "ON_ERROR_STOP=1", &format!("{server}/postgres"), "-c", sql])
            .status()
            .expect("psql runs");
        assert!(status.success(), "psql: {sql}");
    };
    psql(&format!("CREATE DATABASE {name}"));
    let url = format!("{server}/{name}");
    let db = ["--database-url", url.as_str()];
    assert!(idem().arg("migrate").args(db).output().unwrap().status.success());
    let out = idem().args(["markers", "convert", "--to", "partitioned", "--period", "day"]).args(db).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for dry_run in [true, false] {
        let mut command = idem();
        command.args(["prune", "--retention", "2h", "--json"]).args(db);
        if dry_run {
            command.arg("--dry-run");
        }
        let out = command.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["dry_run"], Value::Bool(dry_run), "{report}");
        assert_eq!(report["layout"], "partitioned", "{report}");
        assert_eq!((report["expired"].as_i64(), report["deleted"].as_i64()), (Some(0), Some(0)), "{report}");
    }
    psql(&format!("DROP DATABASE {name} WITH (FORCE)"));
}

/// With `--log-format json`, the error that ends the process is a JSON line too (with its fix), like every log
/// line before it; a bad `--log` level as well.
#[test]
fn a_fatal_error_is_a_json_line_under_json_logs() {
    // Tables under a prefix nobody migrated: the error, then the hint to migrate.
    let server =
        std::env::var("IDEM_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned());
    let url = format!("{server}/postgres");
    let stats = ["stats", "--database-url", &url, "--table-prefix", "never_migrated_"];
    let out = idem().args(["--log-format", "json", "--log", "info"]).args(stats).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<Value> = stderr
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}")))
        .collect();
    let fatal = lines.last().expect("an error line");
    assert_eq!(fatal["level"], "ERROR", "{stderr}");
    assert!(fatal["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')), "{stderr}");
    // The fix, in the message or in its hint.
    let said = format!("{} {}", fatal["message"].as_str().unwrap_or(""), fatal["hint"].as_str().unwrap_or(""));
    assert!(said.contains("idem migrate"), "{stderr}");

    let out = idem().args(["--log-format", "json", "--log", "loud"]).args(stats).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let line: Value = serde_json::from_slice(&out.stderr).expect("one JSON line");
    assert!(line["message"].as_str().is_some_and(|m| m.contains("--log `loud` is not a level")), "{line}");
}
