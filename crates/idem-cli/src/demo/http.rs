//! `idem demo --http`: the payments ledger fed by HTTP clients that retry aggressively, against `idem run` serving
//! `[consumer.http]` while it is killed with SIGKILL.
//!
//! Each payment is `POST`ed with its `Idempotency-Key`. The clients give up on their first try of a payment after
//! a few milliseconds (shorter than a commit under load), send some payments again after their answer, and send
//! some three times at once. The server is killed at its fault points (between the commit and the answer, and
//! before the commit) and at random moments, and started again on the same address; the clients retry until each
//! payment has its answer. At the end the ledger must be exact, and every answer a client got for a key the same
//! status and body as every other answer for that key.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use super::events::{Plan, Rng};
use super::summary::Summary;
use super::{DemoArgs, GROUP};
use crate::db::Db;

/// Clients sending at once.
const CLIENTS: usize = 16;
/// The endpoint's path.
const PATH: &str = "/payments";
/// How long the clients may take to get every payment answered.
const DEADLINE: Duration = Duration::from_secs(600);

/// What the clients and the server went through.
#[derive(Debug, Default, Serialize, Clone)]
pub(super) struct HttpFigures {
    /// Requests sent, every retry counted.
    pub(super) requests: u64,
    /// Requests the client gave up on before their answer (its timeout, shorter than a commit under load).
    pub(super) client_timeouts: u64,
    /// Requests that found no server, or lost it before the answer (it was killed).
    pub(super) connections_lost: u64,
    /// `503` answers (not committed in time, or the database away), retried.
    pub(super) unavailable: u64,
    /// `409` answers (the key in progress), retried.
    pub(super) conflicts: u64,
    /// Answers marked `Idempotent-Replayed`: the stored answer of an earlier request.
    pub(super) replayed: u64,
    /// Payments sent three times at once.
    pub(super) concurrent_keys: u64,
    /// Payments sent again after their answer.
    pub(super) sent_again: u64,
    /// Final answers compared with an earlier answer of the same key (all equal, or a mismatch).
    pub(super) answers_compared: u64,
    /// Final answers by status.
    pub(super) statuses: std::collections::BTreeMap<u16, u64>,
    /// Times the server was killed at a random moment (beside the fault points).
    pub(super) random_kills: u32,
}

impl HttpFigures {
    /// The summary's lines.
    pub(super) fn lines(&self) -> Vec<String> {
        let statuses: Vec<String> = self.statuses.iter().map(|(s, n)| format!("{s}: {n}")).collect();
        vec![
            format!(
                "  http requests          {:>12}  ({} given up by the client, {} lost with the server, {} 503, {} 409)",
                self.requests, self.client_timeouts, self.connections_lost, self.unavailable, self.conflicts
            ),
            format!(
                "  answers replayed       {:>12}  ({} keys sent 3 at once, {} sent again; {} answers compared, all equal)",
                self.replayed, self.concurrent_keys, self.sent_again, self.answers_compared
            ),
            format!("  final answers          {:>12}", statuses.join(", ")),
            format!(
                "  server killed at random {:>11}  times (beside the crashes at its fault points)",
                self.random_kills
            ),
        ]
    }
}

/// One request's end: its status, whether it was a replay, its body; `None` when no answer came.
struct Answer {
    status: u16,
    replayed: bool,
    body: String,
}

/// The clients' shared state: the payments still to send, the answers, the figures.
struct Shared {
    queue: Mutex<VecDeque<String>>,
    answers: Mutex<HashMap<String, (u16, String)>>,
    figures: Mutex<HttpFigures>,
    mismatches: Mutex<Vec<String>>,
}

/// `idem demo --http`: the server's file written into `dir`, the clients run against it while it is killed, the
/// ledger checked. A payment without a key is refused with `400` and stored nowhere, so the dead letters expected
/// are the poison payments that have one.
pub(super) async fn demo(
    args: &DemoArgs,
    db: &Db,
    url: &str,
    dir: &Path,
    plan: &Plan,
    records: &[(i64, String)],
    seed: u64,
) -> anyhow::Result<Summary> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("cannot find a free port for the HTTP server")?
        .port();
    let addr = format!("127.0.0.1:{port}");
    let config = dir.join("idem.toml");
    std::fs::write(&config, self::config(&addr, CLIENTS as i32 + 2))
        .with_context(|| format!("cannot write {}", config.display()))?;
    if !args.json {
        eprintln!(
            "{} payments from {CLIENTS} clients to http://{addr}{PATH}, served by idem run ({}) killed {} time(s)…",
            records.len(),
            config.display(),
            args.crashes
        );
    }
    let consumer = "idem run serving [consumer.http] (effects declared as SQL)";
    let mut summary = Summary::planned(db.name(), consumer, plan);
    let figures = run(args, &config, url, &addr, records, seed, &mut summary).await?;
    let stored = Plan { poison: plan.poison_with_key, ..plan.clone() };
    super::verify(db, &stored, &mut summary).await?;
    if plan.poison > plan.poison_with_key && !figures.statuses.contains_key(&400) {
        summary.mismatches.push("the payment without a key was not refused with 400".into());
    }
    if figures.answers_compared == 0 {
        summary.mismatches.push("no answer was compared with another of its key".into());
    }
    summary.ok = summary.mismatches.is_empty();
    summary.throughput_per_second = summary.deliveries as f64 / summary.consume_seconds.max(1e-9);
    summary.http = Some(figures);
    Ok(summary)
}

/// Runs the clients against `idem run` with `config` (the demo's ledger on `[consumer.http]`) at `addr`, killing
/// it `args.crashes` times; fills `summary` with what happened.
async fn run(
    args: &DemoArgs,
    config: &Path,
    url: &str,
    addr: &str,
    records: &[(i64, String)],
    seed: u64,
    summary: &mut Summary,
) -> anyhow::Result<HttpFigures> {
    let shared = Arc::new(Shared {
        queue: Mutex::new(records.iter().map(|(_, payload)| payload.clone()).collect()),
        answers: Mutex::new(HashMap::new()),
        figures: Mutex::new(HttpFigures::default()),
        mismatches: Mutex::new(Vec::new()),
    });
    let (done_tx, done) = watch::channel(false);
    let server =
        tokio::spawn(supervise(args.crashes, records.len() as u64, config.to_owned(), url.to_owned(), seed, done));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|n| tokio::spawn(client(shared.clone(), addr.to_owned(), seed ^ (n as u64 + 1).wrapping_mul(0x9E37))))
        .collect();
    let started = Instant::now();
    let mut failed = None;
    for client in clients {
        if let Err(e) = client.await.context("a client task failed")? {
            failed.get_or_insert(e);
        }
    }
    done_tx.send_replace(true);
    let kills = server.await.context("the server's supervisor failed")??;
    if let Some(e) = failed {
        return Err(e);
    }
    summary.consume_seconds = started.elapsed().as_secs_f64();
    summary.consumer_runs = kills.runs;
    summary.crashes_after_commit = kills.after_commit;
    summary.crashes_before_commit = kills.before_commit;
    let mut figures = shared.figures.lock().map_err(|_| anyhow::anyhow!("figures lock"))?.clone();
    figures.random_kills = kills.random;
    summary.crashes_survived = kills.after_commit + kills.before_commit + kills.random;
    summary.duplicates_absorbed = figures.replayed;
    summary.mismatches.extend(shared.mismatches.lock().map_err(|_| anyhow::anyhow!("mismatches lock"))?.drain(..));
    Ok(figures)
}

/// One client: takes payments off the queue and sends each until it has its answer; some at once three times,
/// some again after their answer.
async fn client(shared: Arc<Shared>, addr: String, seed: u64) -> anyhow::Result<()> {
    let mut rng = Rng(seed);
    let deadline = Instant::now() + DEADLINE;
    loop {
        let Some(payload) = shared.queue.lock().map_err(|_| anyhow::anyhow!("queue lock"))?.pop_front() else {
            return Ok(());
        };
        let key = serde_json::from_str::<serde_json::Value>(&payload)
            .ok()
            .and_then(|v| v.get("idempotencyKey").and_then(|k| k.as_str()).map(str::to_owned));
        let answers = if rng.below(100) < 5 {
            shared.figures.lock().map_err(|_| anyhow::anyhow!("figures lock"))?.concurrent_keys += 1;
            let sends = (0..3).map(|i| {
                let (shared, addr, payload, key) = (shared.clone(), addr.clone(), payload.clone(), key.clone());
                let seed = rng.below(u64::MAX) ^ i;
                tokio::spawn(async move {
                    send_until_answered(&shared, &addr, key.as_deref(), &payload, seed, deadline).await
                })
            });
            let mut answers = Vec::new();
            for send in sends.collect::<Vec<_>>() {
                answers.push(send.await.context("a concurrent send failed")??);
            }
            answers
        } else {
            vec![send_until_answered(&shared, &addr, key.as_deref(), &payload, rng.below(u64::MAX), deadline).await?]
        };
        let mut answers = answers;
        if rng.below(100) < 10 {
            shared.figures.lock().map_err(|_| anyhow::anyhow!("figures lock"))?.sent_again += 1;
            answers.push(
                send_until_answered(&shared, &addr, key.as_deref(), &payload, rng.below(u64::MAX), deadline).await?,
            );
        }
        for answer in answers {
            record(&shared, key.as_deref().unwrap_or("(no key)"), answer)?;
        }
    }
}

/// Keeps the first answer of each key, and compares every later one with it.
fn record(shared: &Shared, key: &str, answer: Answer) -> anyhow::Result<()> {
    let mut figures = shared.figures.lock().map_err(|_| anyhow::anyhow!("figures lock"))?;
    *figures.statuses.entry(answer.status).or_default() += 1;
    figures.replayed += u64::from(answer.replayed);
    let mut answers = shared.answers.lock().map_err(|_| anyhow::anyhow!("answers lock"))?;
    match answers.get(key) {
        Some((status, body)) => {
            figures.answers_compared += 1;
            if (*status, body.as_str()) != (answer.status, answer.body.as_str()) {
                let mismatch = format!("key {key}: answered {status} {body}, then {} {}", answer.status, answer.body);
                shared.mismatches.lock().map_err(|_| anyhow::anyhow!("mismatches lock"))?.push(mismatch);
            }
        }
        None => {
            answers.insert(key.to_owned(), (answer.status, answer.body));
        }
    }
    Ok(())
}

/// Sends one payment until an answer that is final (2xx, or 4xx: a refusal that a retry cannot change): the first
/// try with a timeout of a few milliseconds, later ones longer; lost connections, `503` and `409` retried.
async fn send_until_answered(
    shared: &Shared,
    addr: &str,
    key: Option<&str>,
    payload: &str,
    seed: u64,
    deadline: Instant,
) -> anyhow::Result<Answer> {
    let mut rng = Rng(seed);
    for attempt in 0u32.. {
        if Instant::now() > deadline {
            bail!("payment {key:?} got no answer within {DEADLINE:?}");
        }
        let timeout = match attempt {
            0 => Duration::from_millis(2 + rng.below(30)),
            n => Duration::from_millis((50 * u64::from(n)).min(3000)),
        };
        shared.figures.lock().map_err(|_| anyhow::anyhow!("figures lock"))?.requests += 1;
        let answer = tokio::time::timeout(timeout, post(addr, key, payload)).await;
        let pause = match answer {
            Err(_) => {
                shared.figures.lock().map_err(|_| anyhow::anyhow!("figures lock"))?.client_timeouts += 1;
                Duration::from_millis(5)
            }
            Ok(Err(_)) => {
                shared.figures.lock().map_err(|_| anyhow::anyhow!("figures lock"))?.connections_lost += 1;
                Duration::from_millis(50)
            }
            Ok(Ok(answer)) if answer.status == 503 || answer.status == 409 => {
                let mut figures = shared.figures.lock().map_err(|_| anyhow::anyhow!("figures lock"))?;
                if answer.status == 503 {
                    figures.unavailable += 1;
                } else {
                    figures.conflicts += 1;
                }
                Duration::from_millis(20)
            }
            Ok(Ok(answer)) if answer.status < 500 => return Ok(answer),
            Ok(Ok(answer)) => bail!("payment {key:?} was answered {}: {}", answer.status, answer.body),
        };
        tokio::time::sleep(pause).await;
    }
    unreachable!("the loop above returns")
}

/// One `POST` on a connection of its own.
async fn post(addr: &str, key: Option<&str>, payload: &str) -> std::io::Result<Answer> {
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    let key = key.map(|k| format!("Idempotency-Key: {k}\r\n")).unwrap_or_default();
    let request = format!(
        "POST {PATH} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n{key}\
         Content-Length: {}\r\n\r\n{payload}",
        payload.len()
    );
    conn.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).await?;
    let raw = String::from_utf8_lossy(&raw);
    let Some((head, body)) = raw.split_once("\r\n\r\n") else {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the answer ended in its head"));
    };
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let replayed = head.lines().any(|l| l.to_ascii_lowercase().starts_with("idempotent-replayed: true"));
    Ok(Answer { status, replayed, body: body.to_owned() })
}

/// How the server's runs ended.
#[derive(Debug, Default)]
struct Kills {
    runs: u32,
    after_commit: u32,
    before_commit: u32,
    random: u32,
}

/// Runs `idem run` until the clients are done: the first `crashes` runs are killed (at the fault point after the
/// commit, at a random moment, before the commit, in turn), the last one is stopped with SIGTERM.
async fn supervise(
    crashes: u32,
    payments: u64,
    config: std::path::PathBuf,
    url: String,
    seed: u64,
    mut done: watch::Receiver<bool>,
) -> anyhow::Result<Kills> {
    let exe = std::env::current_exe().context("cannot find the idem executable to run the server")?;
    let mut rng = Rng(seed ^ 0x4854_5450);
    let mut kills = Kills::default();
    loop {
        let crash = kills.after_commit + kills.before_commit + kills.random;
        let kind = (crash < crashes).then_some(crash % 3);
        let mut command = tokio::process::Command::new(&exe);
        command.args(["--log", "error", "run", "--config"]).arg(&config).env("IDEM_DATABASE_URL", &url);
        // Spread so that the crashes come before the clients are done (a restarted server counts its commits anew).
        let spread = (payments / u64::from(2 * crashes.max(1) + 2)).max(2);
        match kind {
            Some(0) => command.args(["--fault", &format!("after-commit:{}", 1 + rng.below(spread))]),
            Some(2) => command.args(["--fault", &format!("before-commit:{}", 1 + rng.below(spread))]),
            _ => &mut command,
        };
        command.stdin(Stdio::null()).stdout(Stdio::null()).kill_on_drop(true);
        let mut child = command.spawn().context("cannot start idem run")?;
        kills.runs += 1;
        let random_kill = async {
            match kind {
                Some(1) => tokio::time::sleep(Duration::from_millis(50 + rng.below(300))).await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            status = child.wait() => {
                let status = status?;
                use std::os::unix::process::ExitStatusExt;
                match (status.signal(), kind) {
                    (Some(libc::SIGKILL), Some(0)) => kills.after_commit += 1,
                    (Some(libc::SIGKILL), Some(2)) => kills.before_commit += 1,
                    _ => bail!("idem run (the HTTP server) ended by itself ({status}); see its errors above"),
                }
            }
            () = random_kill => {
                child.start_kill()?;
                child.wait().await?;
                kills.random += 1;
            }
            () = async { let _ = done.wait_for(|done| *done).await; } => {
                // SAFETY: signalling our own child.
                if let Some(pid) = child.id() {
                    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
                }
                let status = child.wait().await?;
                if !status.success() {
                    bail!("idem run (the HTTP server) did not stop cleanly on SIGTERM ({status})");
                }
                return Ok(kills);
            }
        }
        if kills.runs > crashes + 3 {
            bail!("the server was started {} times for {crashes} crashes", kills.runs);
        }
    }
}

/// The demo's ledger served over HTTP at `addr`.
pub(super) fn config(addr: &str, connections: i32) -> String {
    let source = format!(
        "http = {{ listen = \"{addr}\", path = \"{PATH}\", request_timeout = \"5s\", wait_for_first = \"2s\" }}"
    );
    super::service::ledger("header:Idempotency-Key", GROUP, &source, 1, connections)
}
