//! `[consumer.http]` in `idem run`, from outside: webhooks signed as GitHub signs them go into configured SQL
//! effects, each applied once; a retry gets the first answer, another body under the key 422, a bad signature 401;
//! `idem check` names what an HTTP consumer cannot have; SIGTERM ends the server with status 0.

mod service_common;

use std::io::{Read, Write};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime};

use idem::ingress::{Secret, Signature};
use service_common::*;

const SECRET_ENV: &str = "IDEM_TEST_WEBHOOK_SECRET";
const SECRET: &str = "whsec-test-secret";

/// One HTTP/1.1 `POST`; the status, the head and the body. Status 0 when nothing listens.
fn post(addr: &str, headers: &[(&str, &str)], body: &str) -> (u16, String, String) {
    let Ok(mut conn) = std::net::TcpStream::connect(addr) else { return (0, String::new(), String::new()) };
    let mut request = format!("POST /webhooks/payments HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    conn.write_all(request.as_bytes()).expect("write");
    let mut raw = String::new();
    conn.read_to_string(&mut raw).expect("read");
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_owned())
}

fn signed(body: &str) -> String {
    let github = Signature::GitHub { secret: Secret::new(SECRET) };
    idem::ingress::signature::sign(&github, body.as_bytes(), SystemTime::now())
}

fn payment(key: &str, account: i64, amount: i64) -> String {
    format!(r#"{{"account":{account},"amount":{amount},"note":"webhook {key}"}}"#)
}

fn http_consumer(db: &Db, addr: &str) -> String {
    let source = format!(
        "http = {{ listen = \"{addr}\", path = \"/webhooks/payments\", signature = \"github\", secret_env = \"{SECRET_ENV}\" }}"
    );
    ledger_consumer_from(db, &source, 1).replace("json:/idempotencyKey", "header:X-GitHub-Delivery")
}

#[tokio::test(flavor = "multi_thread")]
async fn idem_run_applies_each_webhook_once_and_answers_its_retries_the_same() {
    let dir = Dir::new("svc_http");
    let db = Db::sqlite(&dir);
    db.ledger().await;
    let p = &db.prefix;
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    let addr = format!("127.0.0.1:{port}");
    let config = dir.write("idem.toml", &(db.database_toml() + &http_consumer(&db, &addr)));
    let child = idem()
        .args(["run", "--config"])
        .arg(&config)
        .env(SECRET_ENV, SECRET)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("idem run");

    let first_body = payment("d-1", 2, 40);
    let first_headers = [("X-GitHub-Delivery", "d-1"), ("X-Hub-Signature-256", &signed(&first_body))];
    let deadline = Instant::now() + Duration::from_secs(60);
    let first = loop {
        let answer = post(&addr, &first_headers, &first_body);
        if answer.0 != 0 {
            break answer;
        }
        assert!(Instant::now() < deadline, "idem run did not listen on {addr} within a minute");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(first.0, 200, "{first:?}");
    assert!(first.2.contains(r#""outcome":"processed""#) && first.2.contains(r#""id":"d-1""#), "{first:?}");

    let again = post(&addr, &first_headers, &first_body);
    assert_eq!((again.0, &again.2), (200, &first.2), "a retry gets the first answer");
    assert!(again.1.contains("idempotent-replayed: true"), "{}", again.1);
    let other_body = payment("d-1", 2, 4000);
    let other =
        post(&addr, &[("X-GitHub-Delivery", "d-1"), ("X-Hub-Signature-256", &signed(&other_body))], &other_body);
    assert_eq!(other.0, 422, "{other:?}");
    let unsigned = post(&addr, &[("X-GitHub-Delivery", "d-2")], &payment("d-2", 3, 5));
    assert_eq!(unsigned.0, 401, "{unsigned:?}");
    let keyless_body = payment("none", 3, 5);
    let keyless = post(&addr, &[("X-Hub-Signature-256", &signed(&keyless_body))], &keyless_body);
    assert!(keyless.0 == 400 && keyless.2.contains("x-github-delivery"), "{keyless:?}");
    // A value the effects refuse (an account that does not exist) is a dead letter, answered 422 every time.
    let missing_body = payment("d-3", 99, 5);
    let missing_headers = [("X-GitHub-Delivery", "d-3"), ("X-Hub-Signature-256", &signed(&missing_body))];
    let missing = post(&addr, &missing_headers, &missing_body);
    assert_eq!(missing.0, 422, "{missing:?}");
    assert_eq!(post(&addr, &missing_headers, &missing_body).2, missing.2);

    assert_eq!(db.scalar(&format!("SELECT COUNT(*) FROM {p}ledger")).await, 1);
    assert_eq!(db.scalar(&format!("SELECT balance FROM {p}accounts WHERE id = 2")).await, 40);
    assert_eq!(db.scalar(&format!("SELECT COUNT(*) FROM {p}dead_letters")).await, 1);

    // The cause fixed (account 99 opened), the request's replay releases its key without a broker flag, and the
    // sender's next retry is applied.
    db.exec(&format!("INSERT INTO {p}accounts (id) VALUES (99)")).await;
    let url = db.url.clone();
    let replay = idem()
        .args(["dead-letters", "replay", "--all", "--database-url", &url, "--table-prefix", p.as_str()])
        .output()
        .expect("idem dead-letters replay");
    let out = text(&replay);
    assert!(replay.status.success() && out.contains("released") && out.contains("1 HTTP request(s)"), "{out}");
    let retried = post(&addr, &missing_headers, &missing_body);
    assert_eq!(retried.0, 200, "{retried:?}");
    assert_eq!(db.scalar(&format!("SELECT balance FROM {p}accounts WHERE id = 99")).await, 5);

    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let output = child.wait_with_output().expect("exit");
    assert!(output.status.success(), "SIGTERM ends the run with status 0: {}", text(&output));
    assert!(!text(&output).contains(SECRET), "the secret is never logged");
}

/// The file with one more key in `[consumer.http]`'s table.
fn with_source_key(content: &str, key: &str) -> String {
    let end = format!("{SECRET_ENV}\" }}");
    content.replace(&end, &format!("{SECRET_ENV}\", {key} }}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn check_names_what_an_http_consumer_cannot_have() {
    let dir = Dir::new("svc_http_check");
    let db = Db::sqlite(&dir);
    db.ledger().await;
    let good = db.database_toml() + &http_consumer(&db, "127.0.0.1:18080");
    let check = |content: &str, env: &[(&str, &str)]| {
        let path = dir.write("check.toml", content);
        let mut command = idem();
        command.args(["check", "--config"]).arg(&path).env_remove(SECRET_ENV);
        for (k, v) in env {
            command.env(k, v);
        }
        let output = command.output().expect("idem check");
        (output.status.success(), text(&output))
    };
    let (ok, out) = check(&good, &[(SECRET_ENV, SECRET)]);
    assert!(ok, "{out}");
    let cases: Vec<(String, &str)> = vec![
        (good.clone(), "IDEM_TEST_WEBHOOK_SECRET is not set"),
        (good.replace("/webhooks/payments", "/webhooks/../admin"), "not a plain absolute path"),
        (good.replace("/webhooks/payments", "webhooks"), "not a plain absolute path"),
        (good.replace("header:X-GitHub-Delivery", "broker-id"), "an HTTP request has no broker id"),
        (good.replace("\"github\"", "\"gitlab\""), "`gitlab` is no signature"),
        (good.replace(&format!(", secret_env = \"{SECRET_ENV}\""), ""), "needs its secret"),
        (good.replace("127.0.0.1:18080", "localhost:18080"), "is not an address"),
        (good.replace("batch_size = 1", "batch_size = 1\ndelayed_retries = { schedule = [\"1m\"] }"), "not parked"),
        (with_source_key(&good, "tolerance = \"5m\""), "applies only to signature = \"stripe\""),
        (with_source_key(&good, "request_timeout = \"0s\""), "must be above 0"),
    ];
    for (content, expected) in cases {
        let (ok, out) = check(&content, &[(SECRET_ENV, SECRET)]);
        let (ok, out) = if expected.contains("is not set") { check(&content, &[]) } else { (ok, out) };
        assert!(!ok, "accepted: {content}");
        assert!(out.contains(expected), "expected `{expected}` in:\n{out}");
    }
}
