//! The HTTP ingress under load: `wrk` (Debian's package) `POST`s payments with a fresh `Idempotency-Key` each, over
//! 16 kept-alive connections for a fixed time, first to an endpoint that runs the handler's transaction alone
//! (`BEGIN; UPDATE the account; COMMIT`, then `200`: the limit), then to the same handler behind
//! `idem::ingress` (the marker claimed, the reply stored, in that transaction). Requests per second of each; after
//! the ingress's leg, every marker's credit is in the ledger once.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use idem::ingress::{Ingress, Options, Reply, Respond};
use idem::{Config, Event, HandlerError, KeyExtractor};
use sqlx::PgConnection;

use super::*;

/// The raw transaction's leg.
pub(super) const RAW: &str = "HTTP: the handler's transaction alone (wrk, 16 connections)";
/// The ingress's leg.
pub(super) const INGRESS: &str = "HTTP: idem ingress, same handler (wrk, 16 connections)";
const CONNECTIONS: u32 = 16;
const PATH: &str = "/payments";

/// wrk's script: each request a payment with a key of its own (the thread's number, then a counter).
const SCRIPT: &str = r#"
local threads = 0
function setup(thread)
  thread:set("prefix", "t" .. threads)
  threads = threads + 1
end
local n = 0
function request()
  n = n + 1
  local body = '{"account":' .. (n % ACCOUNTS) .. ',"amount":1}'
  local headers = { ["Content-Type"] = "application/json", ["Idempotency-Key"] = prefix .. "-" .. n }
  return wrk.format("POST", "/payments", headers, body)
end
"#;

#[derive(serde::Deserialize)]
struct Credit {
    account: i64,
    amount: i64,
}

/// The handler behind the ingress: the credit, then `201`.
struct Credits;

impl Respond<sqlx::Postgres> for Credits {
    async fn respond(&self, request: &Event, tx: &mut PgConnection) -> Result<Reply, HandlerError> {
        let credit: Credit = request.json()?;
        credit_account(tx, &credit).await?;
        Ok(Reply::json(201, &serde_json::json!({ "id": request.id })))
    }
}

async fn credit_account(tx: &mut PgConnection, credit: &Credit) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE bench_accounts SET balance = balance + $1 WHERE id = $2")
        .bind(credit.amount)
        .bind(credit.account)
        .execute(&mut *tx)
        .await
        .map(drop)
}

/// Both legs, or a note saying why they were skipped.
pub(super) async fn run(
    args: &BenchArgs,
    wanted: &dyn Fn(&str) -> bool,
    progress: &dyn Fn(&str),
    notes: &mut Vec<String>,
) -> anyhow::Result<Vec<Leg>> {
    if !wanted(RAW) && !wanted(INGRESS) {
        return Ok(Vec::new());
    }
    if Command::new("wrk").arg("--version").output().is_err() {
        notes.push("HTTP legs skipped: no wrk (apt-get install wrk)".into());
        return Ok(Vec::new());
    }
    let seconds = if args.quick { 2 } else { 10 };
    let pool = idem::postgres::connect(&args.database_url, CONNECTIONS + 2).await?;
    let script = std::env::temp_dir().join(format!("idem-bench-wrk-{}.lua", std::process::id()));
    std::fs::write(&script, SCRIPT.replace("ACCOUNTS", &args.accounts.to_string()))
        .with_context(|| format!("cannot write {}", script.display()))?;
    let mut legs = Vec::new();
    for name in [RAW, INGRESS] {
        if !wanted(name) {
            continue;
        }
        progress(name);
        let mut runs = Vec::new();
        for _ in 0..args.runs {
            fresh_tables(&pool, args.accounts).await?;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let shutdown = async {
                let _ = stopped.await;
            };
            let server = if name == RAW {
                let app = axum::Router::new().route(PATH, axum::routing::post(raw)).with_state(pool.clone());
                tokio::spawn(async move {
                    axum::serve(listener, app)
                        .with_graceful_shutdown(shutdown)
                        .await
                        .map(drop)
                        .map_err(anyhow::Error::from)
                })
            } else {
                let config = Config::new(GROUP, KeyExtractor::Header("idempotency-key".into()))
                    .tables(Tables::new(None, PREFIX)?);
                let ingress = Ingress::new(pool.clone(), config, Credits, Options::default())?;
                tokio::spawn(async move {
                    ingress.serve(listener, PATH, shutdown).await.map(drop).map_err(anyhow::Error::from)
                })
            };
            let rate = wrk(&script, &format!("http://{addr}{PATH}"), seconds).await;
            let _ = stop.send(());
            tokio::time::timeout(Duration::from_secs(30), server).await.context("the server did not stop")???;
            runs.push(rate?);
            if name == INGRESS {
                let markers: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM bench_processed_events").fetch_one(&pool).await?;
                check_ledger(&pool, name, markers, markers).await?;
            }
        }
        legs.push(Leg::new(name.to_owned(), runs));
    }
    let _ = std::fs::remove_file(&script);
    Ok(legs)
}

/// The handler's transaction alone: `BEGIN; UPDATE; COMMIT`, then `200`.
async fn raw(
    axum::extract::State(pool): axum::extract::State<PgPool>,
    body: axum::body::Bytes,
) -> (axum::http::StatusCode, String) {
    let Ok(credit) = serde_json::from_slice::<Credit>(&body) else {
        return (axum::http::StatusCode::BAD_REQUEST, "not a credit".into());
    };
    // In a task of its own, as the ingress does its work: a client that goes away drops this handler's future,
    // and sqlx (0.8) returns a connection whose `BEGIN` was cut short to the pool inside that transaction, where
    // the next leg's statements would run and hold their locks.
    let applied = tokio::spawn(async move {
        let mut tx = pool.begin().await?;
        credit_account(&mut tx, &credit).await?;
        tx.commit().await
    });
    match applied.await {
        Ok(Ok(())) => (axum::http::StatusCode::OK, r#"{"ok":true}"#.into()),
        Ok(Err(e)) => (axum::http::StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        Err(e) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// Runs wrk for `seconds` on `url` with the script; its requests per second. Any answer other than 2xx fails the
/// leg.
async fn wrk(script: &std::path::Path, url: &str, seconds: u32) -> anyhow::Result<f64> {
    let connections = CONNECTIONS.to_string();
    let duration = format!("{seconds}s");
    let script = script.display().to_string();
    let url = url.to_owned();
    let output = tokio::task::spawn_blocking(move || {
        Command::new("wrk").args(["-t", "2", "-c", &connections, "-d", &duration, "-s", &script, &url]).output()
    })
    .await?
    .context("cannot run wrk")?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        bail!("wrk failed: {text}{}", String::from_utf8_lossy(&output.stderr));
    }
    if let Some(line) = text.lines().find(|l| l.contains("Non-2xx") || l.contains("Socket errors")) {
        bail!("wrk saw failed requests ({}):\n{text}", line.trim());
    }
    text.lines()
        .find_map(|l| l.strip_prefix("Requests/sec:").and_then(|v| v.trim().parse::<f64>().ok()))
        .with_context(|| format!("wrk printed no Requests/sec:\n{text}"))
}
