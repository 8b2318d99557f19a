//! `idem run --config` and `idem check --config` from outside, as a team without Rust uses them: events produced
//! with `idem log produce` (or a Kafka producer), effects declared as SQL, the ledger checked against what was
//! produced after SIGKILL crashes; the bulk form, a guard and an outbox emit from configuration, SIGTERM's drain,
//! values that try SQL injection, and `idem check` on good and bad files.

mod service_common;

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use service_common::*;

async fn ledger_exact_after_crashes(db: Db, dir: &Dir) {
    db.ledger().await;
    let (lines, total) = payments(400);
    let log = dir.path("log");
    produce(&log, "payments", 3, &lines);
    let config = dir.write("idem.toml", &(db.database_toml() + &ledger_consumer(&db, &log, 20)));
    let mut killed = 0;
    for fault in ["after-commit:2", "before-commit:3", "after-commit:4", "after-commit:1"] {
        let output = run(&config, Some(fault));
        assert_eq!(output.status.signal(), Some(9), "{fault} was not reached: {}", text(&output));
        killed += 1;
    }
    let output = run(&config, None);
    assert!(output.status.success(), "{}", text(&output));
    assert_eq!(killed, 4);
    let p = &db.prefix;
    assert_eq!(db.scalar(&format!("SELECT COUNT(*) FROM {p}ledger")).await, 400);
    assert_eq!(db.scalar(&format!("SELECT CAST(SUM(balance) AS BIGINT) FROM {p}accounts")).await, total);
    assert_eq!(db.scalar(&format!("SELECT COUNT(*) FROM {p}processed_events")).await, 400);
    assert_eq!(db.scalar(&format!("SELECT COUNT(*) FROM {p}dead_letters")).await, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_ledger_is_exact_after_sigkill_crashes_on_postgres() {
    let dir = Dir::new("svc_crash_pg");
    ledger_exact_after_crashes(Db::postgres("svc_crash"), &dir).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_ledger_is_exact_after_sigkill_crashes_on_mysql() {
    let dir = Dir::new("svc_crash_mysql");
    ledger_exact_after_crashes(Db::mysql("svc_crash"), &dir).await;
}

/// No environment variable arms fault injection: `IDEM_FAULT=after-commit:1` in the environment leaves `idem run`
/// running to the end.
#[tokio::test(flavor = "multi_thread")]
async fn no_environment_variable_makes_idem_run_kill_itself() {
    let dir = Dir::new("svc_no_env_fault");
    let db = Db::sqlite(&dir);
    idem::sqlite::connect(&db.url).await.expect("create the file").close().await;
    db.ledger().await;
    let (lines, total) = payments(50);
    let log = dir.path("log");
    produce(&log, "payments", 1, &lines);
    let config = dir.write("idem.toml", &(db.database_toml() + &ledger_consumer(&db, &log, 5)));
    let output = idem()
        .args(["run", "--exit-at-end", "--config"])
        .arg(&config)
        .env("IDEM_FAULT", "after-commit:1")
        .output()
        .expect("idem run");
    assert!(output.status.success(), "{}", text(&output));
    let p = &db.prefix;
    assert_eq!(db.scalar(&format!("SELECT CAST(SUM(balance) AS BIGINT) FROM {p}accounts")).await, total);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_ledger_is_exact_after_sigkill_crashes_on_sqlite() {
    let dir = Dir::new("svc_crash_sqlite");
    let db = Db::sqlite(&dir);
    idem::sqlite::connect(&db.url).await.expect("create the file").close().await;
    ledger_exact_after_crashes(db, &dir).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_value_that_does_not_convert_is_dead_lettered_and_injection_is_inert() {
    let dir = Dir::new("svc_values");
    let db = Db::postgres("svc_values");
    db.ledger().await;
    let p = &db.prefix;
    let log = dir.path("log");
    let injection = format!("'); DROP TABLE {p}accounts; --");
    let lines = vec![
        serde_json::json!({"idempotencyKey": "a", "account": 1, "amount": 5, "note": "fine"}).to_string(),
        serde_json::json!({"idempotencyKey": "b", "account": 1, "amount": "5x", "note": "bad amount"}).to_string(),
        serde_json::json!({"idempotencyKey": "c", "account": 1, "amount": 7}).to_string(),
        serde_json::json!({"idempotencyKey": "d", "account": 1, "amount": 11, "note": injection}).to_string(),
        serde_json::json!({"idempotencyKey": "e", "account": 1, "amount": 13, "note": "after"}).to_string(),
    ];
    produce(&log, "payments", 1, &lines);
    let config = dir.write("idem.toml", &(db.database_toml() + &ledger_consumer(&db, &log, 10)));
    let output = run(&config, None);
    assert!(output.status.success(), "{}", text(&output));
    assert_eq!(db.scalar(&format!("SELECT balance FROM {p}accounts WHERE id = 1")).await, 5 + 11 + 13);
    let stored: String = {
        let pool = sqlx::PgPool::connect(&db.url).await.expect("postgres");
        sqlx::query_scalar(&format!("SELECT note FROM {p}ledger WHERE event_id = 'd'"))
            .fetch_one(&pool)
            .await
            .expect("d")
    };
    assert_eq!(stored, injection, "the value is stored as written, never run");
    let dead = idem()
        .args(["dead-letters", "list", "--json", "--database-url", &db.url, "--table-prefix", p])
        .output()
        .expect("list");
    let dead: serde_json::Value = serde_json::from_slice(&dead.stdout).expect("json");
    let reasons: Vec<&str> = dead.as_array().expect("array").iter().filter_map(|d| d["error"].as_str()).collect();
    assert_eq!(reasons.len(), 2, "{dead}");
    assert!(
        reasons.iter().any(|r| r.contains("parameter `amount` (integer, from json:/amount): \"5x\" is not an integer")),
        "{dead}"
    );
    assert!(reasons.iter().any(|r| r.contains("parameter `note`") && r.contains("has no such value")), "{dead}");
}

/// An effect whose sum overflows a 64-bit integer: PostgreSQL refuses it (`bigint out of range`); SQLite's own
/// arithmetic would turn it into a REAL without a word, which a STRICT table refuses. Both dead-letter the event and
/// keep the balance as it was.
#[tokio::test(flavor = "multi_thread")]
async fn an_integer_overflow_is_dead_lettered_on_postgres_and_on_a_strict_sqlite_table() {
    let dir = Dir::new("svc_overflow");
    for db in [Db::postgres("svc_overflow"), Db::sqlite(&dir)] {
        let p = &db.prefix;
        // A STRICT table takes SQLite's own type names only.
        let (strict, int) = if db.url.starts_with("sqlite:") { (" STRICT", "INTEGER") } else { ("", "BIGINT") };
        db.exec(&format!(
            "CREATE TABLE {p}accounts (id {int} PRIMARY KEY, balance {int} NOT NULL DEFAULT 0){strict};
             INSERT INTO {p}accounts (id, balance) VALUES (1, 9223372036854775000);
             CREATE TABLE {p}ledger (event_id TEXT PRIMARY KEY, account {int} NOT NULL, amount {int} NOT NULL,
                                     note TEXT NOT NULL){strict}"
        ))
        .await;
        let log = dir.path(&format!("log-{}", if strict.is_empty() { "pg" } else { "sqlite" }));
        let lines = vec![
            serde_json::json!({"idempotencyKey": "big", "account": 1, "amount": 5000, "note": "overflows"}).to_string(),
        ];
        produce(&log, "payments", 1, &lines);
        let config = dir.write("idem.toml", &(db.database_toml() + &ledger_consumer(&db, &log, 10)));
        let output = run(&config, None);
        assert!(output.status.success(), "{}", text(&output));
        assert_eq!(db.scalar(&format!("SELECT balance FROM {p}accounts WHERE id = 1")).await, 9223372036854775000);
        assert_eq!(db.scalar(&format!("SELECT COUNT(*) FROM {p}ledger")).await, 0, "rolled back with the event");
        assert_eq!(db.scalar(&format!("SELECT COUNT(*) FROM {p}dead_letters WHERE event_id = 'big'")).await, 1);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_bulk_form_applies_a_batch_in_one_statement_per_effect() {
    let dir = Dir::new("svc_bulk");
    let db = Db::postgres("svc_bulk");
    db.ledger().await;
    let p = &db.prefix;
    let (mut lines, total) = payments(500);
    lines.insert(
        100,
        serde_json::json!({"idempotencyKey": "poison", "account": "x", "amount": 1, "note": "-"}).to_string(),
    );
    let log = dir.path("log");
    produce(&log, "payments", 2, &lines);
    let consumer = format!(
        r#"
[[consumer]]
name = "ledger-bulk"
key = "json:/idempotencyKey"
batch_size = 100
embedded = {{ dir = "{log}", topics = ["payments"] }}
{LEDGER_PARAMS}
[[consumer.bulk]]
sql = """
INSERT INTO {p}ledger (event_id, account, amount, note)
SELECT * FROM UNNEST(:id, :account, :amount, :note)"""

[[consumer.bulk]]
sql = """
UPDATE {p}accounts a SET balance = a.balance + d.total
  FROM (SELECT account, SUM(amount) AS total FROM UNNEST(:account, :amount) AS t(account, amount) GROUP BY account) d
 WHERE a.id = d.account"""
"#,
        log = log.display()
    );
    let config = dir.write("idem.toml", &(db.database_toml() + &consumer));
    let output = run(&config, Some("after-commit:2"));
    assert_eq!(output.status.signal(), Some(9), "{}", text(&output));
    let output = run(&config, None);
    assert!(output.status.success(), "{}", text(&output));
    assert_eq!(db.scalar(&format!("SELECT COUNT(*) FROM {p}ledger")).await, 500);
    assert_eq!(db.scalar(&format!("SELECT CAST(SUM(balance) AS BIGINT) FROM {p}accounts")).await, total);
    assert_eq!(db.scalar(&format!("SELECT COUNT(*) FROM {p}dead_letters WHERE event_id = 'poison'")).await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_version_guard_and_an_outbox_emit_from_configuration() {
    let dir = Dir::new("svc_compose");
    let db = Db::postgres("svc_compose");
    let p = &db.prefix;
    db.exec(&format!("CREATE TABLE {p}orders (id TEXT PRIMARY KEY, version BIGINT NOT NULL, status TEXT)")).await;
    let log = dir.path("log");
    let events = [("a", 1, "created"), ("a", 3, "shipped"), ("a", 2, "paid"), ("b", 1, "created"), ("b", 1, "again")];
    let lines: Vec<String> = events
        .iter()
        .enumerate()
        .map(|(n, (order, version, status))| {
            serde_json::json!({"eventId": format!("e{n}"), "account": order, "order": order, "version": version,
                               "status": status, "amount": "12.50"})
            .to_string()
        })
        .collect();
    produce(&log, "orders", 1, &lines);
    let consumer = format!(
        r#"
[[consumer]]
name = "orders"
key = "json:/eventId"
embedded = {{ dir = "{log}", topics = ["orders"] }}
version_guard = {{ table = "{p}orders", version_column = "version", entity = "json:/order", version = "json:/version" }}

[consumer.params]
order  = {{ from = "json:/order", type = "text" }}
status = {{ from = "json:/status", type = "text" }}
amount = {{ from = "json:/amount", type = "numeric" }}

[[consumer.effect]]
sql = "UPDATE {p}orders SET status = :status WHERE id = :order"

[[consumer.emit]]
destination = "order-status"
key = ":order"
payload = {{ order = ":order", status = ":status", amount = ":amount", by = "idem", literal = "::kept" }}
headers = {{ type = "OrderStatusChanged" }}

[[consumer.emit]]
when = {{ param = "status", in = ["shipped", "lost"] }}
destination = "orders.:status::v1.:order"
payload = ":order"
"#,
        log = log.display()
    );
    let config = dir.write("idem.toml", &(db.database_toml() + &consumer));
    let output = run(&config, None);
    assert!(output.status.success(), "{}", text(&output));
    let pool = sqlx::PgPool::connect(&db.url).await.expect("postgres");
    let orders: Vec<(String, i64, String)> =
        sqlx::query_as(&format!("SELECT id, version, status FROM {p}orders ORDER BY id"))
            .fetch_all(&pool)
            .await
            .expect("orders");
    assert_eq!(orders, vec![("a".into(), 3, "shipped".into()), ("b".into(), 1, "created".into())]);
    let emitted: Vec<(String, Vec<u8>)> =
        sqlx::query_as(&format!("SELECT destination, payload FROM {p}outbox ORDER BY id"))
            .fetch_all(&pool)
            .await
            .expect("outbox");
    let destinations: Vec<&str> = emitted.iter().map(|(d, _)| d.as_str()).collect();
    // One message per applied event (none for the stale ones), and the conditional one for the shipped order only,
    // to the destination its template makes.
    assert_eq!(destinations, ["order-status", "order-status", "orders.shipped:v1.a", "order-status"]);
    let first: serde_json::Value = serde_json::from_slice(&emitted[0].1).expect("json payload");
    assert_eq!(
        first,
        serde_json::json!({"order": "a", "status": "created", "amount": 12.50, "by": "idem", "literal": ":kept"})
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_and_acknowledges_what_committed() {
    let dir = Dir::new("svc_drain");
    let db = Db::postgres("svc_drain");
    db.ledger().await;
    let p = &db.prefix;
    let (lines, total) = payments(3000);
    let log = dir.path("log");
    produce(&log, "payments", 2, &lines);
    let config = dir.write("idem.toml", &(db.database_toml() + &ledger_consumer(&db, &log, 1)));
    // Without --exit-at-end: it runs until the signal.
    let child = idem()
        .args(["run", "--report-commits", "--config"])
        .arg(&config)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("idem run");
    let deadline = Instant::now() + Duration::from_secs(60);
    while db.scalar(&format!("SELECT COUNT(*) FROM {p}ledger")).await < 50 {
        assert!(Instant::now() < deadline, "nothing committed within a minute");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let output = child.wait_with_output().expect("exit");
    assert!(output.status.success(), "SIGTERM ends the run with status 0: {}", text(&output));
    let applied = db.scalar(&format!("SELECT COUNT(*) FROM {p}ledger")).await;
    assert!(applied < 3000, "the signal came before the end ({applied} applied)");
    // What committed was acknowledged: the next run redoes nothing of it.
    let output = run(&config, None);
    assert!(output.status.success(), "{}", text(&output));
    assert_eq!(db.scalar(&format!("SELECT COUNT(*) FROM {p}ledger")).await, 3000);
    assert_eq!(db.scalar(&format!("SELECT CAST(SUM(balance) AS BIGINT) FROM {p}accounts")).await, total);
    let duplicates = db.scalar(&format!("SELECT COUNT(*) FROM {p}processed_events")).await;
    assert_eq!(duplicates, 3000);
}

/// `idem check` on a file, with an environment.
fn check(dir: &Dir, content: &str, env: &[(&str, &str)]) -> (bool, String) {
    let path = dir.write("check.toml", content);
    let mut command = idem();
    command.args(["check", "--config"]).arg(&path);
    for (k, v) in env {
        command.env(k, v);
    }
    let output = command.output().expect("idem check");
    (output.status.success(), text(&output))
}

#[tokio::test(flavor = "multi_thread")]
async fn check_accepts_a_good_file_and_names_each_bad_one_with_its_line() {
    let dir = Dir::new("svc_check");
    let db = Db::postgres("svc_check");
    db.ledger().await;
    let p = &db.prefix;
    db.exec(&format!("CREATE TABLE {p}orders (id TEXT PRIMARY KEY, version BIGINT NOT NULL)")).await;
    let log = dir.path("log");
    produce(&log, "payments", 1, &payments(1).0[..1]);
    let good = db.database_toml() + &ledger_consumer(&db, &log, 10);
    let (ok, out) = check(&dir, &good, &[]);
    assert!(ok && out.contains("ok (1 consumer: ledger)"), "{out}");
    let line_of = |needle: &str, content: &str| content.lines().position(|l| l.contains(needle)).map(|n| n + 1);

    let cases: Vec<(String, &str)> = vec![
        (good.replace("batch_size", "batch_sise"), "unknown field `batch_sise`"),
        (good.replace("type = \"integer\" }\nnote", "type = \"int\" }\nnote"), "unknown variant `int`"),
        (good.replace("VALUES (:id,", "VALUES (:ident,"), "`:ident` names no parameter"),
        (good.replace("balance = balance +", "balance = balanse +"), "the database refuses it: column \"balanse\" does not exist"),
        (good.replace("127.0.0.1:5432", "${IDEM_TEST_NO_SUCH_HOST}"), "IDEM_TEST_NO_SUCH_HOST is not set"),
        (good.replace("postgres@", "postgres:secret@"), "holds a password"),
        (good.replace("\"event-id\"", "\"event_id\""), "`event_id` is no value of the event"),
        (good.replace("key = \"json:/idempotencyKey\"", "key = \"json:idempotencyKey\""), "invalid key extractor"),
        (
            good.replace("[consumer.params]", &format!(
                "version_guard = {{ table = \"{p}orders\", version_column = \"revision\", entity = \"json:/o\", version = \"json:/v\" }}\n\n[consumer.params]"
            )), "revision"
        ),
        (
            good.replace("[[consumer.effect]]\nsql = \"UPDATE", "[[consumer.bulk]]\nsql = \"UPDATE"), "either [[consumer.effect]]"
        ),
        (db.database_toml(), "declares no [[consumer]]"),
        (good.replace("topics = [\"payments\"]", "topics = [\"nosuch\"]"), "the topic `nosuch` does not exist"),
        (good.replace("batch_size = 10", "batch_size = \"10\""), "batch_size: invalid type: string \"10\", expected a whole number"),
        (good.clone() + "\n[[consumer.emit]]\nhttp = { url = \"ftp://x\" }\npayload = \":id\"\n", "not an http:// or https:// URL"),
        (good.clone() + "\n[[consumer.emit]]\npayload = \":nothing\"\n", "declare destination"),
        (good.clone() + "\n[[consumer.emit]]\ndestination = \"t.:nope\"\npayload = \":id\"\n", "`:nope` names no parameter"),
        (
            good.clone() + "\n[[consumer.emit]]\ndestination = \"t\"\nwhen = { param = \"id\" }\npayload = \":id\"\n",
            "exactly one of equals = VALUE or in = [VALUES…]",
        ),
        ("[database\nurl = 1".into(), ""),
        (good.replace("name = \"ledger\"", "name = \"ledger\"\ngroup = \"ledger\\nv2\""), "holds a line break"),
        (good.replace("batch_size = 10", "batch_size = 10\nstall_after = \"0s\""), "stall_after: 0 would call every partition"),
        (good.replace("batch_size = 10", "batch_size = 10\nstall_after = \"soon\""), "stall_after"),
    ];
    for (content, expected) in cases {
        let (ok, out) = check(&dir, &content, &[]);
        assert!(!ok, "accepted: {content}");
        assert!(out.contains(expected), "expected `{expected}` in:\n{out}");
        assert!(out.contains("nothing was consumed"), "{out}");
        if let Some(key) = ["batch_sise", ":ident", "balanse", "event_id\"", "revision", "stall_after"]
            .iter()
            .find(|k| content.contains(**k))
        {
            let line = line_of(key, &content).expect("line");
            assert!(out.contains(&format!("check.toml:{line}:")), "line {line} of `{key}` not named:\n{out}");
        }
    }
    // Brokers whose messages have no stable offset cannot key on it.
    for source in
        [r#"rabbitmq = { url = "amqp://guest@127.0.0.1:5672/%2f", queues = ["q"] }"#, r#"sqs = { queue = "q" }"#]
    {
        let file = db.database_toml()
            + &ledger_consumer_from(&db, source, 10).replace("key = \"json:/idempotencyKey\"", "key = \"broker-id\"");
        let (ok, out) = check(&dir, &file, &[]);
        assert!(!ok && out.contains("broker-id is refused on"), "{out}");
        let line = line_of("broker-id", &file).expect("line");
        assert!(out.contains(&format!("check.toml:{line}:")), "line {line} not named:\n{out}");
    }
    // A password from the environment is accepted, and never printed.
    let from_env = good.replace("table_prefix", "password_env = \"IDEM_TEST_PG_PASSWORD\"\ntable_prefix");
    let (ok, out) = check(&dir, &from_env, &[("IDEM_TEST_PG_PASSWORD", "s3cr3t!")]);
    assert!(ok, "{out}");
    assert!(!out.contains("s3cr3t"), "{out}");
}

/// `IDEM_…__…` variables set single keys; their problems name the variable, and their values are never printed.
#[tokio::test(flavor = "multi_thread")]
async fn environment_variables_override_single_keys() {
    let dir = Dir::new("svc_env");
    let db = Db::postgres("svc_env");
    db.ledger().await;
    let log = dir.path("log");
    produce(&log, "payments", 1, &payments(1).0[..1]);
    let good = db.database_toml() + &ledger_consumer(&db, &log, 10);

    // An override reaches the checks: the topic it names is looked for.
    let (ok, out) = check(&dir, &good, &[("IDEM_CONSUMER__LEDGER__EMBEDDED__TOPICS", r#"["nosuch"]"#)]);
    assert!(!ok && out.contains("the topic `nosuch` does not exist"), "{out}");
    assert!(out.contains("(with IDEM_CONSUMER__LEDGER__EMBEDDED__TOPICS from the environment)"), "{out}");
    // `idem run` refuses it too, before it touches the database.
    let config = dir.write("run.toml", &good.replace(&db.prefix, "svc_env_untouched_"));
    let output = idem()
        .args(["run", "--exit-at-end", "--config"])
        .arg(&config)
        .env("IDEM_CONSUMER__LEDGER__EMBEDDED__TOPICS", r#"["nosuch"]"#)
        .output()
        .expect("idem run");
    assert!(!output.status.success(), "{}", text(&output));
    assert!(
        text(&output).contains("(with IDEM_CONSUMER__LEDGER__EMBEDDED__TOPICS from the environment)"),
        "{}",
        text(&output)
    );
    let touched = db.scalar("SELECT COUNT(*) FROM pg_tables WHERE tablename LIKE 'svc_env_untouched_%'").await;
    assert_eq!(touched, 0, "no table was created");
    let (ok, out) = check(&dir, &good, &[("IDEM_DATABASE__CONNECTIONS", "0")]);
    assert!(
        !ok && out.contains("(with IDEM_DATABASE__CONNECTIONS from the environment): database.connections"),
        "{out}"
    );
    // It mends a bad value of the file, and `check` says which variables it used (never their values).
    let bad = good.replace("batch_size = 10", "batch_size = \"ten\"");
    let (ok, out) =
        check(&dir, &bad, &[("IDEM_CONSUMER__LEDGER__BATCH_SIZE", "10"), ("IDEM_DATABASE__CONNECTIONS", "3")]);
    assert!(ok, "{out}");
    assert!(
        out.contains("from the environment: IDEM_CONSUMER__LEDGER__BATCH_SIZE, IDEM_DATABASE__CONNECTIONS"),
        "{out}"
    );

    // `migrate = false` leaves idem's tables to someone else: until they are there, the file is refused.
    let (ok, out) = check(&dir, &good, &[("IDEM_DATABASE__MIGRATE", "false")]);
    assert!(
        !ok && out.contains(
            "(with IDEM_DATABASE__MIGRATE from the environment): database.migrate: is false, but idem's migrations 1 ("
        ),
        "{out}"
    );
    assert!(out.contains("pending"), "{out}");
    let migrated = idem()
        .args(["migrate", "--database-url", &db.url, "--table-prefix", &db.prefix])
        .output()
        .expect("idem migrate");
    assert!(migrated.status.success(), "{}", text(&migrated));
    let (ok, out) = check(&dir, &good, &[("IDEM_DATABASE__MIGRATE", "false")]);
    assert!(ok, "{out}");

    let cases: [(&str, &str, &str); 8] = [
        ("IDEM_CONSUMER__LEDGER__KEY", "json:/idempotencyKey\n", "holds a line break"),
        ("IDEM_CONSUMER__LEDGER__EFFECT", r#"[{sql = "DELETE FROM x"}]"#, "`effect` declares what each event does"),
        ("IDEM_DATABASE_CONNECTIONS", "3", "is no key path: parts are joined by `__`"),
        ("IDEM_CONSUMER__LEDGER__BATCH_SIZE", "many", "invalid type: string \"many\", expected a whole number"),
        ("IDEM_CONSUMER__LEDGER__BATCH_SISE", "5", "unknown field `batch_sise`"),
        ("IDEM_CONSUMER__LEGDER__BATCH_SIZE", "5", "no consumer is named `legder` (the file's consumers: ledger)"),
        ("IDEM_DATABASE__URL__HOST", "x", "`url` is not a table"),
        ("IDEM_OPERATIONS__LISTEN", "nowhere", "`nowhere` is not an address"),
    ];
    for (var, value, expected) in cases {
        let (ok, out) = check(&dir, &good, &[(var, value)]);
        assert!(!ok, "{var}={value} accepted: {out}");
        assert!(out.contains(&format!("environment {var}: ")), "the variable is not named:\n{out}");
        assert!(out.contains(expected), "expected `{expected}` in:\n{out}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn check_refuses_the_bulk_form_on_sqlite() {
    let dir = Dir::new("svc_check_sqlite");
    let db = Db::sqlite(&dir);
    idem::sqlite::connect(&db.url).await.expect("create the file").close().await;
    db.ledger().await;
    let content = (db.database_toml() + &ledger_consumer(&db, &dir.path("log"), 10))
        .replace("[[consumer.effect]]", "[[consumer.bulk]]");
    let (ok, out) = check(&dir, &content, &[]);
    assert!(!ok);
    assert!(out.contains("the bulk form binds arrays (UNNEST), which SQLite lacks"), "{out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn check_refuses_the_bulk_form_and_the_inbox_on_mysql() {
    let dir = Dir::new("svc_check_mysql");
    let db = Db::mysql("svc_check");
    db.ledger().await;
    let content = (db.database_toml() + &ledger_consumer(&db, &dir.path("log"), 10))
        .replace("[[consumer.effect]]", "[[consumer.bulk]]");
    let (ok, out) = check(&dir, &content, &[]);
    assert!(!ok);
    assert!(out.contains("the bulk form binds arrays (UNNEST), which MySQL lacks"), "{out}");
    // The same file with per-event effects passes, the database consulted.
    let good = db.database_toml() + &ledger_consumer(&db, &dir.path("log"), 10);
    std::fs::create_dir_all(dir.path("log")).expect("log dir");
    produce(&dir.path("log"), "payments", 1, &payments(1).0);
    let (ok, out) = check(&dir, &good, &[]);
    assert!(ok, "{out}");
}

/// What a small HTTP server received: method, path, `Idempotency-Key`, body.
type Requests = std::sync::Arc<std::sync::Mutex<Vec<(String, String, String, String)>>>;

/// An HTTP/1.1 server on a free port that records each request and answers 503 to the first one, 200 after.
async fn http_server() -> (String, Requests) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/credits?source=idem", listener.local_addr().expect("addr"));
    let requests: Requests = Default::default();
    let seen = requests.clone();
    tokio::spawn(async move {
        let answered = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        while let Ok((mut socket, _)) = listener.accept().await {
            let (seen, answered) = (seen.clone(), answered.clone());
            tokio::spawn(async move {
                let mut data = Vec::new();
                let mut buf = [0u8; 4096];
                let (head, body) = loop {
                    let n = socket.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    data.extend_from_slice(&buf[..n]);
                    if let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&data[..end]).into_owned();
                        let length = head
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_owned())
                            })
                            .and_then(|v| v.parse::<usize>().ok())
                            .unwrap_or(0);
                        while data.len() < end + 4 + length {
                            let n = socket.read(&mut buf).await.unwrap_or(0);
                            if n == 0 {
                                break;
                            }
                            data.extend_from_slice(&buf[..n]);
                        }
                        break (head, String::from_utf8_lossy(&data[end + 4..]).into_owned());
                    }
                };
                let mut first = head.lines().next().unwrap_or("").split(' ');
                let (method, path) = (first.next().unwrap_or("").to_owned(), first.next().unwrap_or("").to_owned());
                let key = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase().starts_with("idempotency-key:").then(|| l[16..].trim().to_owned())
                    })
                    .unwrap_or_default();
                seen.lock().expect("lock").push((method, path, key, body));
                let status = if answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                    "503 Service Unavailable"
                } else {
                    "200 OK"
                };
                let _ = socket
                    .write_all(
                        format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").as_bytes(),
                    )
                    .await;
            });
        }
    });
    (url, requests)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_http_call_as_an_outbox_delivery_carries_the_event_id_as_idempotency_key() {
    let dir = Dir::new("svc_http");
    let db = Db::postgres("svc_http");
    db.ledger().await;
    let p = &db.prefix;
    let log = dir.path("log");
    let (lines, _) = payments(20);
    produce(&log, "payments", 1, &lines);
    let (url, requests) = http_server().await;
    let consumer = ledger_consumer(&db, &log, 10)
        + &format!(
            r#"
[[consumer.emit]]
http = {{ url = "{url}", method = "put" }}
key = ":account"
payload = {{ account = ":account", amount = ":amount", payment = ":id" }}
"#
        );
    let config = dir.write("idem.toml", &(db.database_toml() + &consumer));
    let output = run(&config, None);
    assert!(output.status.success(), "{}", text(&output));
    let relay = idem()
        .args(["relay", "--until-empty", "--poll-interval-ms", "100", "--database-url", &db.url, "--table-prefix", p])
        .output()
        .expect("idem relay");
    assert!(relay.status.success(), "{}", text(&relay));
    let requests = requests.lock().expect("lock").clone();
    let ids: Vec<String> = {
        let pool = sqlx::PgPool::connect(&db.url).await.expect("postgres");
        sqlx::query_scalar(&format!("SELECT event_id FROM {p}outbox")).fetch_all(&pool).await.expect("outbox")
    };
    assert!(ids.is_empty(), "the outbox is empty once delivered: {ids:?}");
    assert_eq!(requests.len(), 21, "20 payments, the first request answered 503 and sent again: {requests:?}");
    let keys: std::collections::HashSet<&str> = requests.iter().map(|r| r.2.as_str()).collect();
    assert_eq!(keys.len(), 20, "each message's requests carry one Idempotency-Key of its own");
    assert!(requests.iter().all(|(m, path, _, _)| m == "PUT" && path == "/credits?source=idem"), "{requests:?}");
    let body: serde_json::Value = serde_json::from_str(&requests[1].3).expect("json body");
    assert!(body["account"].is_i64() && body["payment"].as_str().is_some_and(|p| p.starts_with("pay-")), "{body}");
}

/// Lines of order events: (event id, order, type).
fn order_events(events: &[(&str, &str, &str)]) -> Vec<String> {
    events
        .iter()
        .map(|(id, order, kind)| {
            serde_json::json!({"eventId": id, "account": order, "orderId": order, "type": kind}).to_string()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_state_machine_and_the_sequential_inbox_from_configuration() {
    let dir = Dir::new("svc_machine");
    let db = Db::postgres("svc_machine");
    let p = &db.prefix;
    db.exec(&format!(
        "CREATE TABLE {p}orders (id TEXT PRIMARY KEY, status TEXT);
         CREATE TABLE {p}applied (event_id TEXT PRIMARY KEY, order_id TEXT NOT NULL, kind TEXT NOT NULL,
                                  position BIGINT NOT NULL)"
    ))
    .await;
    let log = dir.path("log");
    // Order a: cancelled, then a payment that the machine refuses. Order b: shipped before it was created.
    let lines = order_events(&[
        ("e1", "a", "OrderCreated"),
        ("e2", "a", "OrderCancelled"),
        ("e3", "a", "OrderPaid"),
        ("e4", "b", "OrderShipped"),
        ("e5", "b", "OrderCreated"),
    ]);
    produce(&log, "orders", 1, &lines[..3]);
    produce(&log, "shipments", 1, &lines[3..]);
    let effect = format!(
        r#"
[consumer.params]
id    = {{ from = "event-id", type = "text" }}
order = {{ from = "json:/orderId", type = "text" }}
kind  = {{ from = "json:/type", type = "text" }}

[[consumer.effect]]
sql = """
INSERT INTO {p}applied (event_id, order_id, kind, position)
SELECT :id, :order, :kind, COUNT(*) FROM {p}applied WHERE order_id = :order"""
"#
    );
    let consumers = format!(
        r#"
[[consumer]]
name = "orders"
key = "json:/eventId"
embedded = {{ dir = "{log}", topics = ["orders"] }}
{effect}
[consumer.state_machine]
table = "{p}orders"
state_column = "status"
entity = "json:/orderId"
event_type = "json:/type"
states = ["created", "paid", "cancelled"]
types = ["OrderCreated", "OrderPaid", "OrderCancelled"]
on_disallowed = "reject"

[[consumer.state_machine.transition]]
from = "none"
on = "OrderCreated"
to = "created"

[[consumer.state_machine.transition]]
from = "created"
on = "OrderPaid"
to = "paid"

[[consumer.state_machine.transition]]
from = "created"
on = "OrderCancelled"
to = "cancelled"

[[consumer.state_machine.transition]]
from = "paid"
on = "OrderCancelled"
to = "cancelled"

[[consumer]]
name = "shipments"
key = "json:/eventId"
embedded = {{ dir = "{log}", topics = ["shipments"] }}
{effect}
[consumer.inbox]
message_type = "json:/type"

[[consumer.inbox.sequence]]
name = "order"
retention = "1d"

[[consumer.inbox.sequence.type]]
name = "OrderCreated"
context_id = "json:/orderId"

[[consumer.inbox.sequence.type]]
name = "OrderShipped"
context_id = "json:/orderId"
release = {{ predecessor = "OrderCreated" }}
"#,
        log = log.display()
    );
    let config = dir.write("idem.toml", &(db.database_toml() + &consumers));
    let (ok, out) = check(&dir, &std::fs::read_to_string(&config).expect("read"), &[]);
    assert!(ok && out.contains("ok (2 consumers: orders, shipments)"), "{out}");
    let output = run(&config, None);
    assert!(output.status.success(), "{}", text(&output));
    let pool = sqlx::PgPool::connect(&db.url).await.expect("postgres");
    let applied: Vec<(String, String, i64)> =
        sqlx::query_as(&format!("SELECT order_id, kind, position FROM {p}applied ORDER BY order_id, position"))
            .fetch_all(&pool)
            .await
            .expect("applied");
    let expected =
        [("a", "OrderCreated", 0), ("a", "OrderCancelled", 1), ("b", "OrderCreated", 0), ("b", "OrderShipped", 1)];
    let expected: Vec<(String, String, i64)> =
        expected.iter().map(|(o, k, n)| (o.to_string(), k.to_string(), *n)).collect();
    assert_eq!(applied, expected, "the refused payment is not applied; the shipment waits for its creation");
    let status: String =
        sqlx::query_scalar(&format!("SELECT status FROM {p}orders WHERE id = 'a'")).fetch_one(&pool).await.expect("a");
    assert_eq!(status, "cancelled");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_during_start_up_ends_the_run_once_start_up_is_over() {
    let dir = Dir::new("svc_early_term");
    let db = Db::postgres("svc_early_term");
    db.ledger().await;
    let p = &db.prefix;
    let log = dir.path("log");
    produce(&log, "payments", 1, &payments(50).0);
    let config = dir.write("idem.toml", &(db.database_toml() + &ledger_consumer(&db, &log, 10)));
    // A lock on the accounts holds the start-up's statement check until the transaction ends.
    let pool = sqlx::PgPool::connect(&db.url).await.expect("postgres");
    let mut lock = pool.begin().await.expect("begin");
    sqlx::query(&format!("LOCK TABLE {p}accounts IN ACCESS EXCLUSIVE MODE")).execute(&mut *lock).await.expect("lock");
    let mut child = idem().args(["run", "--config"]).arg(&config).stderr(Stdio::piped()).spawn().expect("idem run");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    tokio::time::sleep(Duration::from_millis(500)).await;
    lock.rollback().await.expect("release");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("SIGTERM received during start-up was lost: the run did not end");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(status.success(), "{status}");
}

/// A collector stand-in: answers every request with 200 and keeps each request's first line.
#[cfg(feature = "otel")]
fn collector() -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream);
            loop {
                let mut first = String::new();
                if reader.read_line(&mut first).unwrap_or(0) == 0 {
                    break;
                }
                let mut length = 0;
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
                        break;
                    }
                    if let Some((name, value)) = header.split_once(':')
                        && name.eq_ignore_ascii_case("content-length")
                    {
                        length = value.trim().parse().unwrap_or(0);
                    }
                }
                let mut body = vec![0; length];
                if reader.read_exact(&mut body).is_err() {
                    break;
                }
                record.lock().expect("lock").push(first.trim().to_owned());
                let answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                if reader.get_mut().write_all(answer).is_err() {
                    break;
                }
            }
        }
    });
    (url, seen)
}

/// With `OTEL_EXPORTER_OTLP_ENDPOINT` set, `idem run` posts its spans to the collector; a collector that cannot be
/// reached is logged, not silently dropped, and costs the run nothing.
#[cfg(feature = "otel")]
#[tokio::test(flavor = "multi_thread")]
async fn traces_go_to_the_otlp_collector_and_an_unreachable_one_is_logged() {
    let dir = Dir::new("svc_otlp");
    let db = Db::postgres("svc_otlp");
    db.ledger().await;
    let p = &db.prefix;
    let (lines, _) = payments(40);
    let log = dir.path("log");
    produce(&log, "payments", 1, &lines[..20]);
    let config = dir.write("idem.toml", &(db.database_toml() + &ledger_consumer(&db, &log, 10)));
    let traced = |endpoint: &str| {
        idem()
            .args(["run", "--exit-at-end", "--config"])
            .arg(&config)
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
            .output()
            .expect("idem run")
    };

    let (url, seen) = collector();
    let output = traced(&url);
    assert!(output.status.success(), "{}", text(&output));
    assert!(seen.lock().expect("lock").iter().any(|l| l.starts_with("POST /v1/traces ")), "{:?}", seen);

    // A port nobody listens on.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("http://{}", listener.local_addr().expect("address"))
    };
    produce(&log, "payments", 1, &lines[20..]);
    let output = traced(&closed);
    assert!(output.status.success(), "{}", text(&output));
    let logs = text(&output);
    assert!(logs.contains("ExportError"), "the failed export is not logged:\n{logs}");
    assert_eq!(db.scalar(&format!("SELECT COUNT(*) FROM {p}ledger")).await, 40);
}

/// One HTTP/1.1 exchange with a bearer token; the status and the body.
fn console_request(addr: &str, method: &str, path: &str, token: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut conn) = std::net::TcpStream::connect(addr) else { return (0, String::new()) };
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).expect("write");
    let mut raw = String::new();
    conn.read_to_string(&mut raw).expect("read");
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    (head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0), body.to_owned())
}

/// A token and its users-file line, from `idem console token`.
fn console_user(name: &str, role: &str) -> (String, String) {
    let out = idem().args(["console", "token", name, "--role", role]).output().expect("idem console token");
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    let field = |label: &str| out.lines().find_map(|l| l.strip_prefix(label)).expect(label).to_owned();
    (field("token: "), field("users-file line: "))
}

#[tokio::test(flavor = "multi_thread")]
async fn idem_run_serves_the_console_with_its_consumers_and_replays_through_their_broker() {
    let dir = Dir::new("svc_console");
    let db = Db::sqlite(&dir);
    db.ledger().await;
    let p = &db.prefix;
    db.exec(&format!("DELETE FROM {p}accounts WHERE id = 3")).await;
    let (lines, total) = payments(200);
    let log = dir.path("log");
    produce(&log, "payments", 2, &lines);
    let (alice, alice_line) = console_user("alice", "operator");
    let (bob, bob_line) = console_user("bob", "viewer");
    let users = dir.write("users.txt", &format!("{alice_line}\n{bob_line}\n"));
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    let addr = format!("127.0.0.1:{port}");
    let console = format!("\n[console]\nlisten = \"{addr}\"\nusers = \"{}\"\nshow_payloads = true\n", users.display());
    let base = db.database_toml() + &ledger_consumer(&db, &log, 10);
    let config = dir.write("idem.toml", &(base.clone() + &console));

    // A users file that names nobody, and a bad address, are refused before anything runs.
    let empty = dir.write("nobody.txt", "# no users yet\n");
    let (ok, out) = check(
        &dir,
        &(base.clone() + &console.replace(&users.display().to_string(), &empty.display().to_string())),
        &[],
    );
    assert!(!ok && out.contains("console.users") && out.contains("names no user"), "{out}");
    let (ok, out) = check(&dir, &(base + &console.replace(&addr, "localhost")), &[]);
    assert!(!ok && out.contains("console.listen"), "{out}");

    let mut child = idem()
        .args(["run", "--config"])
        .arg(&config)
        .env_remove("IDEM_CONSOLE_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("idem run");
    let deadline = Instant::now() + Duration::from_secs(60);
    let dead = loop {
        let (status, body) = console_request(&addr, "GET", "/api/v1/dead-letters", &bob, "");
        if status == 200 {
            let page: serde_json::Value = serde_json::from_str(&body).expect("json");
            if page["total"] == 20 {
                break page;
            }
        }
        assert!(Instant::now() < deadline, "the console did not show the 20 payments to account 3: {status} {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(dead["items"][0]["consumer_group"], "ledger");

    // The consumers of the process, and the kill switch's resume: operators only, audited by the consumer.
    let (status, body) = console_request(&addr, "GET", "/api/v1/consumers", &bob, "");
    let consumers: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(
        (status, &consumers[0]["group"], &consumers[0]["running"]),
        (200, &"ledger".into(), &true.into()),
        "{body}"
    );
    assert_eq!(console_request(&addr, "POST", "/api/v1/consumers/ledger/resume", &bob, "").0, 403);
    let (status, body) = console_request(&addr, "POST", "/api/v1/consumers/ledger/resume", &alice, "");
    assert!(status == 200 && body.contains("\"was_paused\":false"), "{status} {body}");
    assert_eq!(console_request(&addr, "POST", "/api/v1/consumers/nobody/resume", &alice, "").0, 404);

    // One letter edited: the dry run runs the consumer's effects and rolls back, showing each statement's rows;
    // the retry publishes the edited copy, which the running consumer applies.
    let first = &dead["items"][0];
    let (id, payload) = (first["id"].as_i64().unwrap(), first["payload"].as_str().unwrap().to_owned());
    let edit_path = format!("/api/v1/dead-letters/{id}/edit");
    let edit = |payload: &str, dry: bool| {
        let body = serde_json::json!({ "payload": payload, "dry_run": dry }).to_string();
        let (status, body) = console_request(&addr, "POST", &edit_path, &alice, &body);
        (status, serde_json::from_str::<serde_json::Value>(&body).unwrap_or_else(|_| body.into()))
    };
    let (_, unedited) = edit(&payload, true);
    let rows: Vec<i64> =
        unedited["trial"]["statements"].as_array().unwrap().iter().map(|s| s["rows"].as_i64().unwrap()).collect();
    assert_eq!(rows, [1, 0], "the insert, then the update of a missing account: {unedited}");
    assert!(unedited["trial"]["error"].as_str().unwrap().contains("expect_rows"), "{unedited}");
    let moved = payload.replace("\"account\":3", "\"account\":4");
    assert_ne!(moved, payload);
    let (_, tried) = edit(&moved, true);
    assert_eq!(tried["trial"]["ok"], true, "{tried}");
    let (status, done) = edit(&moved, false);
    assert_eq!((status, &done["replayed"]), (200, &true.into()), "{done}");

    // The cause fixed, the console replays the group through the consumer's own log; the running consumer applies it.
    db.exec(&format!("INSERT INTO {p}accounts (id) VALUES (3)")).await;
    let (status, body) = console_request(&addr, "POST", "/api/v1/dead-letters/replay", &alice, r#"{"all": true}"#);
    let replayed: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!((status, replayed["replayed"].as_array().map(Vec::len)), (200, Some(19)), "the 19 others: {body}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while db.scalar(&format!("SELECT COUNT(*) FROM {p}ledger")).await < 200 {
        assert!(Instant::now() < deadline, "the replayed payments were not applied");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(db.scalar(&format!("SELECT CAST(SUM(balance) AS BIGINT) FROM {p}accounts")).await, total);
    let (_, audit) = console_request(&addr, "GET", "/api/v1/audit", &bob, "");
    assert!(audit.contains("\"actor\":\"alice (console)\"") && audit.contains("\"action\":\"resume\""), "{audit}");
    assert!(audit.contains("\"action\":\"dead-letters replay\""), "{audit}");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().expect("exit");
    assert!(status.success(), "{status:?}");
}
