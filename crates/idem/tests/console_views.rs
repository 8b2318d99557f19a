//! The console's outbox, Sequential Inbox and markers views on PostgreSQL: what they show agrees with the
//! database, their actions do what `idem outbox requeue` and `idem inbox release|close` do (a dry run first, then
//! the action and its audit entry), a viewer cannot act, and an action with nothing to act on says so and touches
//! nothing.

mod common;

use std::net::SocketAddr;

use common::{TestPool, http, payment, pg};
use idem::Tables;
use idem::console::{ConsoleConfig, Role, Users};
use idem::store::NewDeadLetter;
use serde_json::Value;

const OPERATOR: &str = "operator-token-of-alice";
const VIEWER: &str = "viewer-token-of-bob";

async fn api(addr: SocketAddr, method: &str, path: &str, token: &str, body: &str) -> (u16, Value) {
    let bearer = format!("Bearer {token}");
    let headers = [("Authorization", bearer.as_str()), ("Content-Type", "application/json")];
    let answer = http(addr, method, path, &headers, body).await;
    (answer.status, serde_json::from_str(&answer.body).unwrap_or(Value::String(answer.body)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_inbox_and_markers_views_act_as_the_command_line_does() {
    let db = pg().await;
    let tables = Tables::default();
    idem::migrate(&db.pool, &tables).await.unwrap();
    let users = Users::new().with_token("alice", Role::Operator, OPERATOR).with_token("bob", Role::Viewer, VIEWER);
    let addr = idem::console::serve(
        "127.0.0.1:0".parse().unwrap(),
        db.pool.clone(),
        tables.clone(),
        None::<idem::embedded::LogProducer>,
        ConsoleConfig::new(users),
    )
    .await
    .unwrap();

    // The outbox: two destinations waiting, one row failing, two messages a relay gave up on.
    db.pool
        .exec(
            "INSERT INTO outbox (event_id, destination, payload, headers, slot, attempts, last_error)
             VALUES ('m1', 'emails', 'a', '[]', 1, 0, NULL), ('m2', 'emails', 'b', '[]', 1, 3, '503 busy'),
                    ('m3', 'invoices', 'c', '[]', 2, 0, NULL)",
        )
        .await;
    let mut conn = db.pool.acquire().await.unwrap();
    for (offset, id) in [(10, "g1"), (11, "g2")] {
        let message = payment(0, offset, id, 1, "");
        let letter =
            NewDeadLetter { event_id: Some(id), message: &message, error: "550 mailbox unavailable", attempts: 5 };
        <sqlx::Postgres as idem::Store>::dead_letter(&mut conn, &tables, "outbox:mailer", &letter).await.unwrap();
    }
    drop(conn);
    let (status, outbox) = api(addr, "GET", "/api/v1/outbox", VIEWER, "").await;
    assert_eq!(status, 200, "{outbox}");
    let destinations: Vec<(&str, i64, i64)> = outbox["destinations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["destination"].as_str().unwrap(), d["pending"].as_i64().unwrap(), d["failing"].as_i64().unwrap()))
        .collect();
    assert_eq!(destinations, [("emails", 2, 1), ("invoices", 1, 0)]);
    assert_eq!(outbox["failing"][0]["last_error"], "503 busy");
    assert_eq!(outbox["dead_letters"]["total"], 2);
    let (status, refused) = api(addr, "POST", "/api/v1/outbox/requeue", VIEWER, r#"{"all":true}"#).await;
    assert_eq!(status, 403, "a viewer cannot requeue: {refused}");
    let (status, nothing) = api(addr, "POST", "/api/v1/outbox/requeue", OPERATOR, "{}").await;
    assert_eq!(status, 400, "nothing named: {nothing}");
    let (status, stranger) = api(addr, "POST", "/api/v1/outbox/requeue", OPERATOR, r#"{"ids":[999]}"#).await;
    assert!(status == 409 && stranger["error"].as_str().unwrap().contains("999"), "{stranger}");
    let (_, dry) = api(addr, "POST", "/api/v1/outbox/requeue", OPERATOR, r#"{"all":true,"dry_run":true}"#).await;
    assert_eq!((dry["chosen"].as_array().map(Vec::len), &dry["audit_id"]), (Some(2), &Value::Null), "{dry}");
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM outbox").await, 3, "a dry run moves nothing");
    // A relay's letter is never replayed to a consumer: it goes back into the outbox.
    let first = outbox["dead_letters"]["items"][0]["id"].as_i64().unwrap();
    let (status, replay) =
        api(addr, "POST", "/api/v1/dead-letters/replay", OPERATOR, &format!(r#"{{"ids":[{first}],"dry_run":true}}"#))
            .await;
    assert_eq!((status, replay["refused"][0]["risk"].as_str()), (200, Some("relay_letter")), "{replay}");
    assert!(replay["refused"][0]["why"].as_str().unwrap().contains("idem outbox requeue"), "{replay}");
    // One named letter gone meanwhile does not stop the others.
    let (status, one) =
        api(addr, "POST", "/api/v1/outbox/requeue", OPERATOR, &format!(r#"{{"ids":[{first},999999]}}"#)).await;
    assert_eq!(
        (status, &one["requeued"], &one["gone"]),
        (200, &serde_json::json!([first]), &serde_json::json!([999999])),
        "{one}"
    );
    let (status, gone) =
        api(addr, "POST", "/api/v1/outbox/requeue", OPERATOR, &format!(r#"{{"ids":[{first}]}}"#)).await;
    assert!(status == 409 && gone["error"].as_str().unwrap().contains("any more"), "{gone}");
    let (status, done) =
        api(addr, "POST", "/api/v1/outbox/requeue", OPERATOR, r#"{"all":true,"relay":"mailer"}"#).await;
    assert_eq!((status, done["requeued"].as_array().map(Vec::len)), (200, Some(1)), "{done}");
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM outbox").await, 5);
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM dead_letters").await, 0);
    let audit = done["audit_id"].as_i64().expect("an audit entry");
    let (_, trail) = api(addr, "GET", "/api/v1/audit?action=outbox%20requeue", VIEWER, "").await;
    assert_eq!((trail["items"][0]["id"].as_i64(), trail["items"][0]["actor"].as_str()), (Some(audit), Some("alice")));

    // The Sequential Inbox: an instance holding a message that waits for its predecessor.
    db.pool
        .exec(
            "INSERT INTO sequence_instance (sequence_name, context_id, retain_until) VALUES ('order', 'o1', now() + interval '1 day');
             INSERT INTO sequenced_message (sequence_instance_id, message_type, idempotence_id, status, topic, partition, \"offset\", headers)
             SELECT id, 'OrderShipped', 'w1', 'WAITING', 'orders', 0, 7, '[]' FROM sequence_instance;",
        )
        .await;
    let (status, stuck) = api(addr, "GET", "/api/v1/inbox?stuck=true", VIEWER, "").await;
    assert_eq!(status, 200, "{stuck}");
    let instance = &stuck["items"][0];
    assert_eq!((instance["context_id"].as_str(), instance["waiting"].as_i64()), (Some("o1"), Some(1)), "{stuck}");
    let id = instance["id"].as_i64().unwrap();
    let (status, bad) = api(addr, "GET", "/api/v1/inbox?status=HALF", VIEWER, "").await;
    assert!(status == 400 && bad["error"].as_str().unwrap().contains("OPEN or CLOSED"), "{bad}");
    let (status, _) = api(addr, "POST", &format!("/api/v1/inbox/{id}/release"), VIEWER, "{}").await;
    assert_eq!(status, 403);
    let release = format!("/api/v1/inbox/{id}/release");
    let (_, dry) = api(addr, "POST", &release, OPERATOR, r#"{"dry_run":true}"#).await;
    assert_eq!((dry["released"].as_i64(), &dry["audit_id"]), (Some(1), &Value::Null), "{dry}");
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequenced_message WHERE force_release").await, 0);
    let (status, done) = api(addr, "POST", &release, OPERATOR, "{}").await;
    assert_eq!((status, done["released"].as_i64()), (200, Some(1)), "{done}");
    assert!(done["audit_id"].as_i64().is_some());
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequenced_message WHERE force_release").await, 1);
    let (status, again) = api(addr, "POST", &release, OPERATOR, "{}").await;
    assert_eq!(status, 409, "released already, nothing to do: {again}");
    let (status, _) =
        api(addr, "POST", &format!("/api/v1/inbox/{id}/release"), OPERATOR, r#"{"message":424242}"#).await;
    assert_eq!(status, 404);
    let (status, closed) = api(addr, "POST", &format!("/api/v1/inbox/{id}/close"), OPERATOR, "{}").await;
    assert_eq!((status, &closed["closed"]), (200, &Value::Bool(true)), "{closed}");
    let (status, _) = api(addr, "POST", &format!("/api/v1/inbox/{id}/close"), OPERATOR, "{}").await;
    assert_eq!(status, 409, "closed already");
    let (_, shown) = api(addr, "GET", &format!("/api/v1/inbox/{id}"), VIEWER, "").await;
    assert_eq!(
        (shown["instance"]["status"].as_str(), shown["messages"][0]["force_release"].as_bool()),
        (Some("CLOSED"), Some(true))
    );
    let (_, trail) = api(addr, "GET", "/api/v1/audit?actor=alice", VIEWER, "").await;
    let actions: Vec<&str> = trail["items"].as_array().unwrap().iter().map(|e| e["action"].as_str().unwrap()).collect();
    assert_eq!(
        actions,
        [
            "inbox close",
            "inbox close",
            "inbox release",
            "inbox release",
            "inbox release",
            "outbox requeue",
            "outbox requeue",
            "outbox requeue",
            "outbox requeue",
            "outbox requeue"
        ],
        "refused actions are in the trail too"
    );

    // The markers: per group, with a prune dry run that deletes nothing.
    db.pool
        .exec(
            "INSERT INTO processed_events (consumer_group, event_id, topic, partition, \"offset\", processed_at)
             SELECT 'ledger', 'e' || n, 'payments', 0, n, now() - make_interval(days => n) FROM generate_series(1, 10) n",
        )
        .await;
    let (status, markers) = api(addr, "GET", "/api/v1/markers?retention=5d12h", VIEWER, "").await;
    assert_eq!(status, 200, "{markers}");
    assert_eq!(
        (markers["groups"][0]["consumer_group"].as_str(), markers["groups"][0]["markers"].as_i64()),
        (Some("ledger"), Some(10))
    );
    assert_eq!(markers["prune"]["would_delete"], 5, "days 6 to 10: {markers}");
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM processed_events").await, 10);
    let (status, bad) = api(addr, "GET", "/api/v1/markers?retention=soon", VIEWER, "").await;
    assert!(status == 400 && bad["error"].as_str().unwrap().starts_with("retention"), "{bad}");
}

/// One HTTP/1.1 exchange with these headers: the status and the raw head and body.
async fn exchange(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let answer = http(addr, method, path, headers, body).await;
    (answer.status, answer.raw())
}

fn cookie_of(raw: &str) -> Option<String> {
    raw.lines().find_map(|l| l.strip_prefix("set-cookie: ")).map(|c| c.trim().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_proxy_the_forwarded_host_is_the_origin_and_a_changed_users_file_is_followed() {
    let db = pg().await;
    let tables = Tables::default();
    idem::migrate(&db.pool, &tables).await.unwrap();
    let dir = std::env::temp_dir().join(common::unique_name("users"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("users.txt");
    let line = |name: &str, role: &str, token: &str| {
        format!("{name} {role} {}\n", idem::console::auth::token_line_hash(token))
    };
    std::fs::write(&file, line("alice", "operator", OPERATOR)).unwrap();
    let users = Users::from_file(&file).unwrap();
    let serve = |behind_proxy: bool| {
        let config = ConsoleConfig { behind_proxy, ..ConsoleConfig::new(users.clone()) };
        idem::console::serve(
            "127.0.0.1:0".parse().unwrap(),
            db.pool.clone(),
            tables.clone(),
            None::<idem::embedded::LogProducer>,
            config,
        )
    };
    let (proxied, direct) = (serve(true).await.unwrap(), serve(false).await.unwrap());
    let form = [
        ("Content-Type", "application/x-www-form-urlencoded"),
        ("Origin", "https://console.example.com"),
        ("X-Forwarded-Host", "console.example.com"),
        ("X-Forwarded-Proto", "https"),
    ];
    let body = format!("token={OPERATOR}");
    let (status, raw) = exchange(proxied, "POST", "/login", &form, &body).await;
    assert_eq!(status, 303, "{raw}");
    let cookie = cookie_of(&raw).expect("a session cookie");
    assert!(cookie.contains("; Secure"), "over https through the proxy the cookie is Secure: {cookie}");
    let (status, raw) = exchange(direct, "POST", "/login", &form, &body).await;
    assert_eq!(status, 403, "without --behind-proxy the forwarded host is not believed: {raw}");
    let own = format!("http://{direct}");
    let plain = [("Content-Type", "application/x-www-form-urlencoded"), ("Origin", own.as_str())];
    let (_, raw) = exchange(direct, "POST", "/login", &plain, &body).await;
    assert!(!cookie_of(&raw).expect("a cookie").contains("Secure"), "{raw}");

    // The users file changes while the console runs: a new user signs in, a removed one's session ends.
    let session = cookie.split(';').next().unwrap().to_owned();
    let (status, _) = exchange(proxied, "GET", "/audit", &[("Cookie", &session)], "").await;
    assert_eq!(status, 200);
    std::fs::write(&file, line("bob", "viewer", VIEWER)).unwrap();
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(2);
    std::fs::File::options().append(true).open(&file).unwrap().set_modified(later).unwrap();
    let (status, _) = api(direct, "GET", "/api/v1/whoami", VIEWER, "").await;
    assert_eq!(status, 200, "bob was added");
    let (status, _) = api(direct, "GET", "/api/v1/whoami", OPERATOR, "").await;
    assert_eq!(status, 401, "alice was removed");
    let (status, raw) = exchange(proxied, "GET", "/audit", &[("Cookie", &session)], "").await;
    assert!(status == 303 && raw.contains("location: /login"), "alice's session ended: {raw}");
    let _ = std::fs::remove_dir_all(&dir);
}
