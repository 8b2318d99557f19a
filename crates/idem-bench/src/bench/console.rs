//! The console's list pages at scale: `--console-rows` dead letters (200 failure patterns over 4 consumer groups)
//! and as many markers, loaded by SQL (not timed), then each list page of the JSON API and of the web page asked
//! for in turn through a running console, over HTTP, as an operator's browser would. The figure is each page's
//! answer time in milliseconds, the median of `--runs` × 5 requests (and the slowest).

use std::time::Instant;

use anyhow::{Context, bail};
use idem::console::{ConsoleConfig, Role, Users};
use idem::dead_letter::groups::fingerprint;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

const CONSOLE_PREFIX: &str = "bench_console_";
const TOKEN: &str = "bench-console-token";
const PATTERNS: i64 = 200;
const GROUPS: [&str; 4] = ["ledger", "billing", "mailer", "search"];

/// One page's answer times.
#[derive(serde::Serialize)]
pub(super) struct PageTiming {
    /// The page and its query.
    pub page: String,
    /// Median answer time, ms.
    pub median_ms: f64,
    /// Slowest answer, ms.
    pub max_ms: f64,
}

/// Loads the rows and times the pages; `rows` of each.
pub(super) async fn run(pool: &PgPool, rows: i64, runs: usize) -> anyhow::Result<Vec<PageTiming>> {
    let tables = load(pool, rows).await?;
    let users = Users::new().with_token("bench", Role::Operator, TOKEN);
    let console = ConsoleConfig::new(users);
    let addr = idem::console::serve(
        "127.0.0.1:0".parse().context("address")?,
        pool.clone(),
        tables.clone(),
        None::<idem::embedded::LogProducer>,
        console,
    )
    .await?;
    let cookie = sign_in(addr).await?;
    let middle: i64 =
        sqlx::query_scalar(&format!("SELECT id FROM {CONSOLE_PREFIX}dead_letters ORDER BY id OFFSET $1 LIMIT 1"))
            .bind(rows / 2)
            .fetch_one(pool)
            .await?;
    let busiest = fingerprint(GROUPS[0], None, &reason(0).replace('N', "17"));
    let pages = [
        ("API", "/api/v1/failure-groups".to_owned()),
        ("API", "/api/v1/dead-letters?limit=50".to_owned()),
        ("API", format!("/api/v1/dead-letters?limit=50&after={middle}")),
        ("API", format!("/api/v1/dead-letters?limit=50&fingerprint={busiest}")),
        ("API", format!("/api/v1/dead-letters?limit=50&fingerprint={busiest}&after={middle}")),
        ("API", "/api/v1/dead-letters?limit=50&group=billing".to_owned()),
        ("API", "/api/v1/dead-letters?limit=50&older_than=1d".to_owned()),
        ("API", "/api/v1/dead-letters?limit=50&matching=deadlock".to_owned()),
        ("API", "/api/v1/dead-letters?limit=50&matching=no+such+reason".to_owned()),
        ("API", "/api/v1/markers".to_owned()),
        ("API", "/api/v1/audit".to_owned()),
        ("API", "/api/v1/parked".to_owned()),
        ("page", "/".to_owned()),
        ("page", "/dead-letters".to_owned()),
        ("page", format!("/dead-letters?fingerprint={busiest}&after={middle}")),
        ("page", "/markers".to_owned()),
        ("page", "/audit".to_owned()),
    ];
    let mut timings = Vec::new();
    for (kind, path) in pages {
        let mut times = Vec::new();
        for _ in 0..runs.max(1) * 5 {
            let started = Instant::now();
            let status = match kind {
                "API" => get(addr, &path, &format!("Authorization: Bearer {TOKEN}")).await?,
                _ => get(addr, &path, &format!("Cookie: {cookie}")).await?,
            };
            times.push(started.elapsed().as_secs_f64() * 1000.0);
            if status != 200 {
                bail!("console {path}: answered {status}");
            }
        }
        times.sort_by(f64::total_cmp);
        timings.push(PageTiming {
            page: format!("{kind} {path}"),
            median_ms: (times[times.len() / 2] * 10.0).round() / 10.0,
            max_ms: (times[times.len() - 1] * 10.0).round() / 10.0,
        });
    }
    Ok(timings)
}

/// The reason of pattern `k` as stored, `N` the part that differs from letter to letter (the account): each
/// pattern its own failure group.
fn reason(k: i64) -> String {
    let word: String = [k / 26 % 26, k % 26].iter().map(|&c| char::from(b'a' + c as u8)).collect();
    match k % 4 {
        0 => format!("account N of kind {word} does not exist"),
        1 => format!("relation ledger_{word} does not exist (N)"),
        2 => format!("deadlock detected (40P01) in step {word} of N"),
        _ => format!("invalid input syntax for type bigint: \"N EUR\" (rule {word})"),
    }
}

/// Fresh console tables holding `rows` dead letters and `rows` markers.
async fn load(pool: &PgPool, rows: i64) -> anyhow::Result<Tables> {
    for table in [
        "processed_events",
        "dead_letters",
        "dead_letter_archive",
        "idem_migrations",
        "outbox",
        "outbox_lease",
        "parked_messages",
        "audit_log",
        "sequence_instance",
        "sequenced_message",
        "sequential_inbox_idempotence",
    ] {
        sqlx::query(&format!("DROP TABLE IF EXISTS {CONSOLE_PREFIX}{table} CASCADE")).execute(pool).await?;
    }
    let tables = Tables::new(None, CONSOLE_PREFIX)?;
    idem::migrate(pool, &tables).await?;
    sqlx::query("DROP TABLE IF EXISTS bench_console_patterns").execute(pool).await?;
    sqlx::query(
        "CREATE TABLE bench_console_patterns (k bigint PRIMARY KEY, consumer_group text, error text, fingerprint text)",
    )
    .execute(pool)
    .await?;
    for k in 0..PATTERNS {
        let group = GROUPS[(k % 4) as usize];
        let error = reason(k);
        let stored = error.replace('N', "17");
        sqlx::query("INSERT INTO bench_console_patterns VALUES ($1, $2, $3, $4)")
            .bind(k)
            .bind(group)
            .bind(&error)
            .bind(fingerprint(group, None, &stored))
            .execute(pool)
            .await?;
    }
    // Half the letters have pattern 0 (one failing dependency), the others spread over the 200 patterns.
    sqlx::query(&format!(
        r#"INSERT INTO {CONSOLE_PREFIX}dead_letters (consumer_group, event_id, topic, partition, "offset", key, payload,
             headers, error, attempts, first_failed_at, last_failed_at, status, fingerprint)
           SELECT p.consumer_group, 'evt-' || i, 'payments', (i % 4)::int, i, NULL,
                  convert_to('{{"id":"evt-' || i || '","account":' || (i % 10000) || ',"amount":' || (i % 977) || ',"note":"a payment of the benchmark"}}', 'UTF8'),
                  '[["content-type","application/json"]]', replace(p.error, 'N', (i % 10000)::text), 5,
                  now() - make_interval(secs => ($1 - i) * 2), now() - make_interval(secs => ($1 - i) * 2), 'dead',
                  p.fingerprint
             FROM generate_series(1, $1) i
             JOIN bench_console_patterns p ON p.k = CASE WHEN i % 2 = 0 THEN 0 ELSE (i / 2 * 7919) % {PATTERNS} END"#
    ))
    .bind(rows)
    .execute(pool)
    .await
    .context("loading the dead letters")?;
    sqlx::query(&format!(
        r#"INSERT INTO {CONSOLE_PREFIX}processed_events (consumer_group, event_id, topic, partition, "offset", processed_at)
           SELECT (ARRAY['ledger','billing','mailer','search'])[1 + i % 4], 'evt-' || i, 'payments', (i % 4)::int, i,
                  now() - make_interval(secs => ($1 - i))
             FROM generate_series(1, $1) i"#
    ))
    .bind(rows)
    .execute(pool)
    .await
    .context("loading the markers")?;
    sqlx::query("DROP TABLE bench_console_patterns").execute(pool).await?;
    for table in ["dead_letters", "processed_events"] {
        sqlx::query(&format!("VACUUM ANALYZE {CONSOLE_PREFIX}{table}")).execute(pool).await?;
    }
    Ok(tables)
}

/// Signs in to the page with the token; the session cookie.
async fn sign_in(addr: std::net::SocketAddr) -> anyhow::Result<String> {
    let body = format!("token={TOKEN}");
    let request = format!(
        "POST /login HTTP/1.1\r\nHost: {addr}\r\nOrigin: http://{addr}\r\nContent-Type: application/x-www-form-urlencoded\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = exchange(addr, &request).await?;
    answer
        .lines()
        .find_map(|line| line.strip_prefix("set-cookie: ").or_else(|| line.strip_prefix("Set-Cookie: ")))
        .and_then(|cookie| cookie.split(';').next())
        .map(str::to_owned)
        .with_context(|| format!("the console's sign-in set no cookie: {answer}"))
}

/// `GET path` with one more header line; the status.
async fn get(addr: std::net::SocketAddr, path: &str, header: &str) -> anyhow::Result<u16> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{header}\r\nConnection: close\r\n\r\n");
    let answer = exchange(addr, &request).await?;
    answer
        .split(' ')
        .nth(1)
        .and_then(|status| status.parse().ok())
        .with_context(|| format!("the console's answer to {path} has no status"))
}

async fn exchange(addr: std::net::SocketAddr, request: &str) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}
