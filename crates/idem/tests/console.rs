//! The operator console over HTTP, on SQLite and the embedded log: the API refuses a request without a valid token
//! and a viewer who acts; an operator dry-runs and replays a failure group, the replayed letters are applied once
//! the cause is fixed, and the audit trail names the console's user; the page signs in, refuses a form without its
//! CSRF token or from another site, confirms with the count before acting, and hides payloads.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{HttpAnswer as Response, http};
use idem::console::{ConsoleConfig, Role, Users};
use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor, KillSwitch, Tables};
use serde_json::Value;

const OPERATOR: &str = "operator-token-of-alice";
const VIEWER: &str = "viewer-token-of-bob";

/// Applies a payment unless payments to account 13 are refused (until the cause is fixed).
#[derive(Clone)]
struct Ledger {
    refuse_13: Arc<AtomicBool>,
}

impl Handler<sqlx::Sqlite> for Ledger {
    async fn handle(&self, event: &Event, tx: &mut sqlx::SqliteConnection) -> Result<(), HandlerError> {
        let payment: Value = event.json()?;
        if payment["account"] == 13 && self.refuse_13.load(Ordering::SeqCst) {
            return Err(HandlerError::permanent(format!("account {} is frozen", payment["account"])));
        }
        sqlx::query("INSERT INTO ledger (event_id) VALUES (?)").bind(&event.id).execute(&mut *tx).await?;
        Ok(())
    }
}

async fn api(addr: SocketAddr, method: &str, path: &str, token: &str, body: &str) -> Response {
    let auth = format!("Bearer {token}");
    http(addr, method, path, &[("Authorization", &auth), ("Content-Type", "application/json")], body).await
}

/// A form posted as the console's own page posts it (its `Origin`), unless `extra` gives another.
async fn form(addr: SocketAddr, path: &str, cookie: &str, body: &str, extra: &[(&str, &str)]) -> Response {
    let own = format!("http://{addr}");
    let mut headers = vec![("Cookie", cookie), ("Content-Type", "application/x-www-form-urlencoded")];
    if !extra.iter().any(|(name, _)| *name == "Origin") {
        headers.push(("Origin", &own));
    }
    headers.extend_from_slice(extra);
    http(addr, "POST", path, &headers, body).await
}

/// Signs in with `token`: the session cookie and the CSRF token of its forms.
async fn sign_in(addr: SocketAddr, token: &str) -> (String, String) {
    let own = format!("http://{addr}");
    let headers = [("Content-Type", "application/x-www-form-urlencoded"), ("Origin", own.as_str())];
    let login = http(addr, "POST", "/login", &headers, &format!("token={token}")).await;
    assert_eq!(login.status, 303, "{}", login.body);
    let cookie = login.header("set-cookie").expect("a session cookie");
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"), "{cookie}");
    let cookie = cookie.split(';').next().unwrap_or_default().to_owned();
    let page = http(addr, "GET", "/", &[("Cookie", &cookie)], "").await;
    let csrf =
        page.body.split("name=\"csrf\" value=\"").nth(1).and_then(|s| s.split('"').next()).expect("a csrf token");
    (cookie, csrf.to_owned())
}

/// A log of `n` payments (every fourth to account 13, from the second on) and a SQLite database with a ledger.
struct Setup {
    dir: std::path::PathBuf,
    log: EmbeddedLog,
    producer: idem::embedded::LogProducer,
    pool: sqlx::SqlitePool,
    config: Config,
}

async fn setup(n: usize) -> Setup {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("idem-console-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = EmbeddedLog::open(dir.join("log")).unwrap();
    log.create_topic("payments", 1).unwrap();
    let producer = log.producer();
    for n in 0..n {
        let payload = format!(r#"{{"id":"p-{n}","account":{}}}"#, if n % 4 == 1 { 13 } else { n });
        producer.send("payments", None, payload.as_bytes(), &[]).unwrap();
    }
    producer.flush().unwrap();
    let url = format!("sqlite://{}/ledger.db", dir.display());
    let pool = idem::sqlite::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE ledger (event_id TEXT PRIMARY KEY)").execute(&pool).await.unwrap();
    let config = Config::new("ledger", KeyExtractor::JsonPointer("/id".into())).kill_switch(KillSwitch::off());
    idem::migrate(&pool, &config.tables).await.unwrap();
    Setup { dir, log, producer, pool, config }
}

fn ids(value: &Value, key: &str) -> Vec<i64> {
    value[key].as_array().unwrap_or_else(|| panic!("{key} in {value}")).iter().filter_map(Value::as_i64).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_acts_as_the_command_line_does_and_only_for_operators() {
    let ledger = Ledger { refuse_13: Arc::new(AtomicBool::new(true)) };
    let Setup { dir, log, producer, pool, config } = setup(10).await;
    let run = || async {
        let engine = Engine::new(pool.clone(), config.clone()).unwrap();
        let options = ConsumerOptions { stop_at_end: true, ..ConsumerOptions::default() };
        let source = log.consumer("ledger", &["payments"], options).unwrap();
        let run = engine.run(source, ledger.clone(), std::future::pending::<()>());
        tokio::time::timeout(Duration::from_secs(30), run).await.unwrap().unwrap()
    };
    assert_eq!(run().await.dead_lettered, 3, "p-1, p-5 and p-9 go to account 13");

    let users = Users::new().with_token("alice", Role::Operator, OPERATOR).with_token("bob", Role::Viewer, VIEWER);
    let console = ConsoleConfig::new(users);
    let addr = idem::console::serve(
        "127.0.0.1:0".parse().unwrap(),
        pool.clone(),
        Tables::default(),
        Some(log.producer()),
        console,
    )
    .await
    .unwrap();

    // The API: a token, a valid one, and the operator role to act.
    assert_eq!(http(addr, "GET", "/api/v1/failure-groups", &[], "").await.status, 401);
    assert_eq!(api(addr, "GET", "/api/v1/failure-groups", "forged", "").await.status, 401);
    let groups = api(addr, "GET", "/api/v1/failure-groups", VIEWER, "").await;
    assert_eq!(groups.status, 200, "{}", groups.body);
    let groups = groups.json();
    assert_eq!((groups[0]["count"].as_i64(), groups[0]["pattern"].as_str()), (Some(3), Some("account # is frozen")));
    let fingerprint = groups[0]["fingerprint"].as_str().unwrap().to_owned();
    let group_body = format!(r#"{{"fingerprint":"{fingerprint}"}}"#);
    let refused = api(addr, "POST", "/api/v1/dead-letters/replay", VIEWER, &group_body).await;
    assert_eq!(refused.status, 403, "{}", refused.body);
    assert!(refused.json()["error"].as_str().unwrap().contains("operator role"));
    let letters = api(addr, "GET", "/api/v1/dead-letters?limit=2", VIEWER, "").await.json();
    assert_eq!((letters["total"].as_i64(), letters["items"].as_array().map(Vec::len)), (Some(3), Some(2)), "{letters}");
    assert_eq!(letters["items"][0]["payload"], Value::Null, "payloads are hidden by default: {letters}");
    let after = letters["next_after"].as_i64().expect("a next page");
    let rest = api(addr, "GET", &format!("/api/v1/dead-letters?limit=2&after={after}"), VIEWER, "").await.json();
    assert_eq!((rest["items"].as_array().map(Vec::len), &rest["next_after"]), (Some(1), &Value::Null), "{rest}");
    let bad = api(addr, "POST", "/api/v1/dead-letters/replay", OPERATOR, "not json").await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    let bad = api(addr, "GET", "/api/v1/dead-letters?fingerprint=frozen", VIEWER, "").await;
    assert!(bad.status == 400 && bad.body.contains("12 hexadecimal digits"), "{}", bad.body);
    let hidden =
        api(addr, "POST", &format!("/api/v1/dead-letters/{after}/edit"), OPERATOR, r#"{"payload":"{}"}"#).await;
    assert!(
        hidden.status == 409 && hidden.body.contains("--show-payloads"),
        "payloads hidden, no edit: {}",
        hidden.body
    );
    let no_reason = api(addr, "POST", "/api/v1/dead-letters/discard", OPERATOR, &group_body).await;
    assert!(no_reason.status == 400 && no_reason.body.contains("reason"), "{}", no_reason.body);

    // A dry run says what would happen and changes nothing, nor writes the trail.
    let dry = api(
        addr,
        "POST",
        "/api/v1/dead-letters/replay",
        OPERATOR,
        &format!(r#"{{"fingerprint":"{fingerprint}","dry_run":true}}"#),
    )
    .await;
    assert_eq!(dry.status, 200, "{}", dry.body);
    let all_three = ids(&dry.json(), "would_replay");
    assert_eq!(all_three.len(), 3);
    let audit = api(addr, "GET", "/api/v1/audit", VIEWER, "").await.json()["items"].clone();
    assert_eq!(
        audit.as_array().map(Vec::len),
        Some(0),
        "requests refused before they act, and dry runs, are not actions: {audit}"
    );

    // The cause fixed, the operator replays one letter by id, then the group; the consumer applies them once.
    ledger.refuse_13.store(false, Ordering::SeqCst);
    let one =
        api(addr, "POST", "/api/v1/dead-letters/replay", OPERATOR, &format!(r#"{{"ids":[{}]}}"#, all_three[0])).await;
    assert_eq!((one.status, ids(&one.json(), "replayed")), (200, vec![all_three[0]]), "{}", one.body);
    let again =
        api(addr, "POST", "/api/v1/dead-letters/replay", OPERATOR, &format!(r#"{{"ids":[{}]}}"#, all_three[0])).await;
    assert_eq!(again.status, 409, "replayed already: {}", again.body);
    assert!(again.body.contains(&format!("no dead letter has id {}", all_three[0])), "{}", again.body);
    let rest = api(addr, "POST", "/api/v1/dead-letters/replay", OPERATOR, &group_body).await;
    assert_eq!(ids(&rest.json(), "replayed"), all_three[1..].to_vec(), "{}", rest.body);
    let entry = rest.json()["audit_id"].as_i64().expect("the action's audit entry");
    assert_eq!(run().await.processed, 3);
    let (applied,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM ledger").fetch_one(&pool).await.unwrap();
    assert_eq!(applied, 10, "every payment applied once");
    let audit = api(addr, "GET", "/api/v1/audit", VIEWER, "").await.json()["items"].clone();
    let newest = &audit[0];
    assert_eq!(newest["id"].as_i64(), Some(entry), "the answer names its audit entry: {audit}");
    assert_eq!(
        (newest["actor"].as_str(), newest["action"].as_str(), newest["count"].as_i64()),
        (Some("alice"), Some("dead-letters replay"), Some(2)),
        "{audit}"
    );
    assert!(newest["subjects"].as_str().unwrap().contains(&fingerprint), "{newest}");
    let refused_by_viewer = audit.as_array().unwrap().iter().any(|e| e["actor"] == "bob");
    assert!(!refused_by_viewer, "a viewer's request is refused before it becomes an action: {audit}");
    // The trail pages back by id and filters by actor and action; a limit out of range is refused, not clamped.
    let first = api(addr, "GET", "/api/v1/audit?limit=1", VIEWER, "").await.json();
    let before = first["next_before"].as_i64().expect("an older page");
    assert_eq!(first["items"][0]["id"].as_i64(), Some(entry), "{first}");
    let older = api(addr, "GET", &format!("/api/v1/audit?limit=1&before={before}"), VIEWER, "").await.json();
    assert!(older["items"][0]["id"].as_i64().is_some_and(|id| id < entry), "{older}");
    let nobody = api(addr, "GET", "/api/v1/audit?actor=nobody", VIEWER, "").await.json();
    assert_eq!(nobody["items"].as_array().map(Vec::len), Some(0), "{nobody}");
    let replays = api(addr, "GET", "/api/v1/audit?action=dead-letters%20replay", VIEWER, "").await.json();
    assert!(replays["items"].as_array().is_some_and(|e| e.iter().all(|e| e["action"] == "dead-letters replay")));
    for path in ["/api/v1/dead-letters?grop=ledger", "/api/v1/audit?actr=alice", "/api/v1/failure-groups?limit=3"] {
        let typo = api(addr, "GET", path, VIEWER, "").await;
        assert!(
            typo.status == 400 && typo.body.contains("is not a parameter") || typo.body.contains("unknown field"),
            "{path}: {}",
            typo.body
        );
    }
    let inbox = api(addr, "GET", "/api/v1/inbox", VIEWER, "").await;
    assert!(inbox.status == 404 && inbox.body.contains("runs on PostgreSQL"), "{}", inbox.body);
    for path in ["/api/v1/audit?limit=0", "/api/v1/dead-letters?limit=501", "/api/v1/parked?limit=-1"] {
        let refused = api(addr, "GET", path, VIEWER, "").await;
        assert_eq!(refused.status, 400, "{path}: {}", refused.body);
        assert!(refused.body.contains("limit") && refused.body.contains("out of range"), "{}", refused.body);
    }

    // The page: sign in, no action without the CSRF token or from another site, a confirmation with the count.
    let page = http(addr, "GET", "/", &[], "").await;
    assert_eq!((page.status, page.header("location").as_deref()), (303, Some("/login")));
    for header in ["content-security-policy", "x-frame-options"] {
        assert!(page.header(header).is_some(), "{header} on every response");
    }
    assert!(!page.header("content-security-policy").unwrap().contains("unsafe-inline"));
    let wrong = form(addr, "/login", "", "token=guess", &[]).await;
    assert_eq!(wrong.status, 401);
    let no_origin =
        http(addr, "POST", "/login", &[("Content-Type", "application/x-www-form-urlencoded")], "token=guess").await;
    assert!(no_origin.status == 403 && no_origin.body.contains("Origin"), "{}", no_origin.body);
    producer.send("payments", None, br#"{"id":"p-10","account":13}"#, &[]).unwrap();
    producer.flush().unwrap();
    ledger.refuse_13.store(true, Ordering::SeqCst);
    assert_eq!(run().await.dead_lettered, 1);
    let (cookie, csrf) = sign_in(addr, OPERATOR).await;
    let page = http(addr, "GET", &format!("/dead-letters?fingerprint={fingerprint}"), &[("Cookie", &cookie)], "").await;
    assert!(page.body.contains("p-10") && page.body.contains("<span id=\"total\">1</span>"), "{}", page.body);
    let discard = format!("fingerprint={fingerprint}&reason=account+closed");
    let forged = form(addr, "/actions/discard", &cookie, &discard, &[]).await;
    assert_eq!(forged.status, 403, "no CSRF token: {}", forged.body);
    let cross_site = form(
        addr,
        "/actions/discard",
        &cookie,
        &format!("{discard}&csrf={csrf}"),
        &[("Origin", "http://evil.example")],
    )
    .await;
    assert_eq!(cross_site.status, 403, "{}", cross_site.body);
    let confirm = form(addr, "/actions/discard", &cookie, &format!("{discard}&csrf={csrf}"), &[]).await;
    assert!(confirm.body.contains("<strong id=\"count\">1</strong>"), "{}", confirm.body);
    let (still,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM dead_letters").fetch_one(&pool).await.unwrap();
    assert_eq!(still, 1, "nothing is done before the confirmation");
    let id = confirm.body.split("name=\"ids\" value=\"").nth(1).and_then(|s| s.split('"').next()).unwrap().to_owned();
    let done = form(
        addr,
        "/actions/discard",
        &cookie,
        &format!("ids={id}&reason=account+closed&csrf={csrf}&confirm=yes"),
        &[],
    )
    .await;
    assert!(done.body.contains("Discarded 1"), "{}", done.body);
    let archived = idem::dead_letter::archived(&pool, &Tables::default(), None, 10).await.unwrap();
    assert_eq!((archived[0].discarded_by.as_str(), archived[0].reason.as_str()), ("alice", "account closed"));
    let twice =
        form(addr, "/actions/discard", &cookie, &format!("ids={id}&reason=again&csrf={csrf}&confirm=yes"), &[]).await;
    assert!(twice.status == 409 && twice.body.contains("was discarded by alice"), "{}", twice.body);

    // A viewer's session reads, and cannot act even with its own CSRF token.
    let (cookie, csrf) = sign_in(addr, VIEWER).await;
    let audit_page = http(addr, "GET", "/audit", &[("Cookie", &cookie)], "").await;
    assert!(audit_page.body.contains("dead-letters discard") && audit_page.body.contains("account closed"));
    let viewer = form(addr, "/actions/replay", &cookie, &format!("ids={id}&csrf={csrf}&confirm=yes"), &[]).await;
    assert_eq!(viewer.status, 403, "{}", viewer.body);
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_letter_is_dry_run_through_the_handler_then_replayed_with_the_original_archived() {
    let ledger = Ledger { refuse_13: Arc::new(AtomicBool::new(true)) };
    let Setup { dir, log, producer: _, pool, config } = setup(4).await;
    let run = || async {
        let engine = Engine::new(pool.clone(), config.clone()).unwrap();
        let options = ConsumerOptions { stop_at_end: true, ..ConsumerOptions::default() };
        let source = log.consumer("ledger", &["payments"], options).unwrap();
        let run = engine.run(source, ledger.clone(), std::future::pending::<()>());
        tokio::time::timeout(Duration::from_secs(30), run).await.unwrap().unwrap()
    };
    assert_eq!(run().await.dead_lettered, 1, "p-1 goes to account 13");
    let users = Users::new().with_token("alice", Role::Operator, OPERATOR).with_token("bob", Role::Viewer, VIEWER);
    let trial = idem::console::HandlerTrial::new(pool.clone(), "ledger", ledger.clone());
    let console = ConsoleConfig {
        show_payloads: true,
        trials: idem::console::Trials(vec![Arc::new(trial)]),
        ..ConsoleConfig::new(users)
    };
    let addr = idem::console::serve(
        "127.0.0.1:0".parse().unwrap(),
        pool.clone(),
        Tables::default(),
        Some(log.producer()),
        console,
    )
    .await
    .unwrap();
    let letter = api(addr, "GET", "/api/v1/dead-letters", VIEWER, "").await.json()["items"][0].clone();
    let id = letter["id"].as_i64().unwrap();
    assert_eq!(letter["payload_json"]["account"], 13, "payloads shown: {letter}");
    let edit = |token: &'static str, body: String| async move {
        api(addr, "POST", &format!("/api/v1/dead-letters/{id}/edit"), token, &body).await
    };
    let body = |payload: &str, dry: bool| serde_json::json!({ "payload": payload, "dry_run": dry }).to_string();

    // The dry run: the handler on the message as it is fails, on the edited one succeeds; nothing is written.
    let unedited = edit(OPERATOR, body(r#"{"id":"p-1","account":13}"#, true)).await.json();
    assert_eq!(
        (&unedited["trial"]["ok"], unedited["trial"]["error"].as_str().map(|e| e.contains("frozen"))),
        (&Value::Bool(false), Some(true)),
        "{unedited}"
    );
    let edited = r#"{"id":"p-1","account":14}"#;
    let tried = edit(OPERATOR, body(edited, true)).await.json();
    assert_eq!(tried["trial"]["ok"], true, "{tried}");
    let (rows,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM ledger").fetch_one(&pool).await.unwrap();
    assert_eq!(rows, 3, "a dry run writes nothing");
    assert_eq!(edit(VIEWER, body(edited, true)).await.status, 403);
    let not_json = edit(OPERATOR, body("account 14", true)).await;
    assert!(not_json.status == 400 && not_json.body.contains("not JSON"), "{}", not_json.body);
    let huge = edit(OPERATOR, body(&"x".repeat(2 << 20), true)).await;
    assert!(huge.status == 400 && huge.body.contains("at most"), "{}", huge.body);

    // The retry for real: the edited copy is applied once, the original is in the archive, the trail says who.
    let done = edit(OPERATOR, body(edited, false)).await;
    assert_eq!((done.status, &done.json()["replayed"]), (200, &Value::Bool(true)), "{}", done.body);
    assert_eq!(run().await.processed, 1);
    let (rows,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM ledger").fetch_one(&pool).await.unwrap();
    assert_eq!(rows, 4);
    let archived = idem::dead_letter::archived(&pool, &Tables::default(), None, 10).await.unwrap();
    assert_eq!(archived.len(), 1);
    assert!(
        archived[0].reason.contains("edited by alice") && archived[0].letter.payload.ends_with(b"13}"),
        "{archived:?}"
    );
    let again = edit(OPERATOR, body(edited, false)).await;
    assert_eq!(again.status, 404, "replayed already: {}", again.body);
    let audit = api(addr, "GET", "/api/v1/audit", VIEWER, "").await.json()["items"].clone();
    assert_eq!(
        (audit[0]["action"].as_str(), audit[0]["actor"].as_str()),
        (Some("dead-letters edit and replay"), Some("alice")),
        "{audit}"
    );
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}
