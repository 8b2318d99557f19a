//! The operations endpoint on axum: GET and HEAD, keep-alive, /readyz 503 with a JSON reason, POST /resume, 404
//! and 405; against a real engine on SQLite.

mod common;

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// One response read off a kept-alive connection: status, headers (lower-case names), body.
async fn exchange(conn: &mut BufReader<TcpStream>, method: &str, path: &str) -> (u16, Vec<(String, String)>, String) {
    let request = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n");
    conn.get_mut().write_all(request.as_bytes()).await.expect("write");
    let mut status_line = String::new();
    conn.read_line(&mut status_line).await.expect("status line");
    let status = status_line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        conn.read_line(&mut line).await.expect("header");
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
        }
    }
    let length: usize =
        headers.iter().find(|(n, _)| n == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
    let mut body = vec![0; if method == "HEAD" { 0 } else { length }];
    conn.read_exact(&mut body).await.expect("body");
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn the_endpoint_answers_get_head_and_not_ready_with_a_reason() {
    let db = common::sqlite().await;
    common::setup(&db.pool).await;
    let engine = idem::Engine::new(db.pool.clone(), common::config(10)).expect("engine");
    metrics::counter!("idem_events_handled_total", "outcome" => "processed").increment(0);
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder().handle();
    let addr = idem::http::serve("127.0.0.1:0".parse().expect("addr"), handle, engine.clone()).await.expect("serve");

    // Every request on one connection: kept alive.
    let mut conn = BufReader::new(TcpStream::connect(addr).await.expect("connect"));
    let (status, _, body) = exchange(&mut conn, "GET", "/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok\n"));

    let (status, headers, _) = exchange(&mut conn, "HEAD", "/healthz").await;
    assert_eq!(status, 200);
    assert!(headers.iter().any(|(n, v)| n == "content-length" && v == "3"), "{headers:?}");

    // Not consuming yet: 503 with the reason as JSON.
    let (status, headers, body) = exchange(&mut conn, "GET", "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(headers.iter().any(|(n, v)| n == "content-type" && v == "application/json"), "{headers:?}");
    let readiness: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(readiness["ready"], false);
    assert!(readiness["reason"].as_str().is_some_and(|r| r.ends_with(": not consuming")), "{readiness}");

    let (status, headers, _) = exchange(&mut conn, "GET", "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        headers.iter().any(|(n, v)| n == "content-type" && v.starts_with("text/plain; version=0.0.4")),
        "{headers:?}"
    );

    assert_eq!(exchange(&mut conn, "GET", "/resume").await.0, 405);
    let (status, _, body) = exchange(&mut conn, "POST", "/resume?as=bob").await;
    assert_eq!((status, body.as_str()), (200, "not paused\n"));
    // The audit entry is written beside the resume, not before it: wait for it.
    let mut audited: Option<(String, String, String)> = None;
    for _ in 0..250 {
        audited = sqlx::query_as("SELECT actor, subjects, outcome FROM audit_log ORDER BY id DESC LIMIT 1")
            .fetch_optional(&db.pool)
            .await
            .expect("audit");
        if audited.is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let expected = ("bob".to_owned(), "consumer group ledger-writer".to_owned(), "ok: was not paused".to_owned());
    assert_eq!(audited, Some(expected));
    assert_eq!(exchange(&mut conn, "GET", "/nope").await.0, 404);

    // Consuming: ready, with its partitions.
    let log_dir = common::temp_dir();
    let log = idem::embedded::EmbeddedLog::open(&log_dir.0).expect("log");
    log.create_topic("payments", 1).expect("topic");
    let source = log.consumer("ledger-writer", &["payments"], Default::default()).expect("consumer");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn({
        let engine = engine.clone();
        async move { engine.run(source, common::Ledger::default(), stopped).await }
    });
    let mut ready = serde_json::Value::Null;
    for _ in 0..100 {
        let (status, _, body) = exchange(&mut conn, "GET", "/readyz").await;
        ready = serde_json::from_str(&body).expect("json");
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ready["ready"], true, "{ready}");
    let _ = stop.send(());
    run.await.expect("join").expect("run");
}
