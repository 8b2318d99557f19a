//! Helpers of the `idem run` tests: events produced with `idem log produce`, a database's tables, the ledger's
//! consumer as configuration, running `idem`.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

pub fn idem() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    command.env_remove("IDEM_DATABASE_URL").env_remove("IDEM_CONFIG");
    command
}

pub fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

pub fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{prefix}_{}_{}", std::process::id(), nanos % 1_000_000_000)
}

pub fn pg_url() -> String {
    let server = std::env::var("IDEM_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
    format!("{server}/test")
}

/// A directory of the test's own, removed at the end.
pub struct Dir(pub PathBuf);

impl Dir {
    pub fn new(name: &str) -> Dir {
        let dir = std::env::temp_dir().join(unique(name));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Dir(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    pub fn write(&self, name: &str, content: &str) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, content).expect("write");
        path
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Appends `lines` to `topic` of the embedded log in `dir`, keyed by `/account`.
pub fn produce(log: &Path, topic: &str, partitions: i32, lines: &[String]) {
    let mut child = idem()
        .args(["log", "produce", "--log-dir"])
        .arg(log)
        .args(["--topic", topic, "--partitions", &partitions.to_string(), "--key-pointer", "/account"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("idem log produce");
    let mut stdin = child.stdin.take().expect("stdin");
    for line in lines {
        writeln!(stdin, "{line}").expect("write a line");
    }
    drop(stdin);
    let output = child.wait_with_output().expect("produce");
    assert!(output.status.success(), "{}", text(&output));
    assert!(text(&output).contains(&format!("\"produced\":{}", lines.len())), "{}", text(&output));
}

/// Payments: `events` distinct ones over 10 accounts, every fifth sent twice, amounts in cents.
pub fn payments(events: usize) -> (Vec<String>, i64) {
    let mut lines = Vec::new();
    let mut total = 0;
    for i in 0..events {
        let amount = (i % 97 + 1) as i64;
        total += amount;
        let line = serde_json::json!({
            "idempotencyKey": format!("pay-{i}"), "account": i % 10 + 1, "amount": amount,
            "at": "2026-12-02T10:00:00Z", "note": format!("payment {i}")
        })
        .to_string();
        if i % 5 == 0 {
            lines.push(line.clone());
        }
        lines.push(line);
    }
    (lines, total)
}

/// The database side of a test: its own tables, the SQL to make and read them.
pub struct Db {
    pub url: String,
    pub prefix: String,
}

impl Db {
    pub fn postgres(name: &str) -> Db {
        Db { url: pg_url(), prefix: format!("{}_", unique(name)) }
    }

    /// Tables of its own (a unique prefix) in the MySQL/MariaDB database at `IDEM_TEST_MYSQL` (default the
    /// machine's, database `test`).
    pub fn mysql(name: &str) -> Db {
        let server = std::env::var("IDEM_TEST_MYSQL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".into());
        Db { url: format!("{server}/test"), prefix: format!("{}_", unique(name)) }
    }

    fn is_mysql(&self) -> bool {
        self.url.starts_with("mysql:")
    }

    pub fn sqlite(dir: &Dir) -> Db {
        Db { url: format!("sqlite://{}", dir.path("ledger.db").display()), prefix: "svc_".into() }
    }

    pub async fn exec(&self, sql: &str) {
        if self.is_mysql() {
            let pool = sqlx::MySqlPool::connect(&self.url).await.expect("mysql");
            sqlx::raw_sql(sql).execute(&pool).await.expect(sql);
            pool.close().await;
        } else if self.url.starts_with("sqlite:") {
            let pool = idem::sqlite::connect(&self.url).await.expect("sqlite");
            sqlx::raw_sql(sql).execute(&pool).await.expect(sql);
            pool.close().await;
        } else {
            let pool = sqlx::PgPool::connect(&self.url).await.expect("postgres");
            sqlx::raw_sql(sql).execute(&pool).await.expect(sql);
            pool.close().await;
        }
    }

    pub async fn scalar(&self, sql: &str) -> i64 {
        if self.is_mysql() {
            // The shared queries cast to BIGINT, which MySQL spells SIGNED.
            let sql = sql.replace("AS BIGINT)", "AS SIGNED)");
            let pool = sqlx::MySqlPool::connect(&self.url).await.expect("mysql");
            let v: i64 = sqlx::query_scalar(&sql).fetch_one(&pool).await.expect(&sql);
            pool.close().await;
            v
        } else if self.url.starts_with("sqlite:") {
            let pool = idem::sqlite::connect(&self.url).await.expect("sqlite");
            let v: i64 = sqlx::query_scalar(sql).fetch_one(&pool).await.expect(sql);
            pool.close().await;
            v
        } else {
            let pool = sqlx::PgPool::connect(&self.url).await.expect("postgres");
            let v: i64 = sqlx::query_scalar(sql).fetch_one(&pool).await.expect(sql);
            pool.close().await;
            v
        }
    }

    /// Accounts 1..=10 at zero and an empty ledger.
    pub async fn ledger(&self) {
        let p = &self.prefix;
        let key = if self.is_mysql() { "VARCHAR(255)" } else { "TEXT" };
        self.exec(&format!(
            "CREATE TABLE {p}accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL DEFAULT 0);
             INSERT INTO {p}accounts (id) VALUES (1),(2),(3),(4),(5),(6),(7),(8),(9),(10);
             CREATE TABLE {p}ledger (event_id {key} PRIMARY KEY, account BIGINT NOT NULL, amount BIGINT NOT NULL,
                                     note TEXT NOT NULL)"
        ))
        .await;
    }

    pub fn database_toml(&self) -> String {
        format!("[database]\nurl = \"{}\"\ntable_prefix = \"{}\"\n", self.url, self.prefix)
    }
}

/// The parameters of the ledger's consumers.
pub const LEDGER_PARAMS: &str = r#"
[consumer.params]
id      = { from = "event-id", type = "text" }
account = { from = "json:/account", type = "integer" }
amount  = { from = "json:/amount", type = "integer" }
note    = { from = "json:/note", type = "text" }
"#;

/// A consumer of the payments topic of the embedded log at `log`, crediting each account, one event at a time.
pub fn ledger_consumer(db: &Db, log: &Path, batch_size: usize) -> String {
    let source = format!("embedded = {{ dir = \"{}\", topics = [\"payments\"] }}", log.display());
    ledger_consumer_from(db, &source, batch_size)
}

/// The same consumer on any source (its TOML line).
pub fn ledger_consumer_from(db: &Db, source: &str, batch_size: usize) -> String {
    let p = &db.prefix;
    format!(
        r#"
[[consumer]]
name = "ledger"
key = "json:/idempotencyKey"
batch_size = {batch_size}
{source}
{LEDGER_PARAMS}
[[consumer.effect]]
sql = "INSERT INTO {p}ledger (event_id, account, amount, note) VALUES (:id, :account, :amount, :note)"

[[consumer.effect]]
sql = "UPDATE {p}accounts SET balance = balance + :amount WHERE id = :account"
expect_rows = 1
"#
    )
}

pub fn run(config: &Path, fault: Option<&str>) -> Output {
    let mut command = idem();
    command.args(["run", "--exit-at-end", "--config"]).arg(config);
    if let Some(fault) = fault {
        command.args(["--fault", fault]);
    }
    command.output().expect("idem run")
}
