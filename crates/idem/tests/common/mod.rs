//! Shared test fixtures: a fresh PostgreSQL database or SQLite file per test, a ledger handler, helpers.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::{Backend, Config, Event, Handler, HandlerError, KeyExtractor, Message};
use sqlx::{Connection, PgConnection, SqliteConnection};

/// The server tests run against; each test gets a database of its own on it.
pub fn pg_server() -> String {
    std::env::var("IDEM_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

pub fn unique_name(kind: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    format!("idem_{kind}_{}_{}_{nanos}", std::process::id(), COUNTER.fetch_add(1, Ordering::SeqCst))
}

/// A fresh PostgreSQL database, dropped when the value is dropped.
pub struct TestPg {
    pub pool: sqlx::PgPool,
    pub url: String,
    name: String,
}

pub async fn pg() -> TestPg {
    let server = pg_server();
    let name = unique_name("t");
    let mut admin =
        PgConnection::connect(&format!("{server}/postgres")).await.expect("PostgreSQL must run on 127.0.0.1:5432");
    sqlx::raw_sql(&format!("CREATE DATABASE {name}")).execute(&mut admin).await.expect("create test database");
    let url = format!("{server}/{name}");
    let pool = idem::postgres::connect(&url, 8).await.expect("connect to test database");
    TestPg { pool, url, name }
}

impl Drop for TestPg {
    fn drop(&mut self) {
        let server = pg_server();
        let name = self.name.clone();
        let pool = self.pool.clone();
        // Drop runs outside async code: a short-lived runtime on its own thread drops the database.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            rt.block_on(async move {
                // The pool's connections belong to the test's runtime, blocked in this drop: closing them from
                // here could wait forever for a connection that runtime was about to return. FORCE ends them.
                let _ = tokio::time::timeout(Duration::from_millis(200), pool.close()).await;
                if let Ok(mut admin) = PgConnection::connect(&format!("{server}/postgres")).await {
                    let _ = sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .execute(&mut admin)
                        .await;
                }
            });
        })
        .join();
    }
}

/// A fresh SQLite file, removed when the value is dropped.
pub struct TestSqlite {
    pub pool: sqlx::SqlitePool,
    pub path: std::path::PathBuf,
}

pub async fn sqlite() -> TestSqlite {
    let path = std::env::temp_dir().join(format!("{}.db", unique_name("s")));
    let pool = idem::sqlite::connect(&format!("sqlite://{}", path.display())).await.expect("open sqlite");
    TestSqlite { pool, path }
}

impl Drop for TestSqlite {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.path.display()));
        }
    }
}

/// The MySQL or MariaDB server tests run against; each test gets a database of its own on it.
pub fn mysql_server() -> String {
    std::env::var("IDEM_TEST_MYSQL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".to_owned())
}

/// A fresh MySQL database, dropped when the value is dropped.
pub struct TestMysql {
    pub pool: sqlx::MySqlPool,
    pub url: String,
    name: String,
}

pub async fn mysql() -> TestMysql {
    let server = mysql_server();
    let name = unique_name("m");
    let mut admin = sqlx::MySqlConnection::connect(&format!("{server}/mysql"))
        .await
        .expect("MySQL or MariaDB must run on 127.0.0.1:3306 (user root, no password), or at IDEM_TEST_MYSQL");
    sqlx::raw_sql(&format!("CREATE DATABASE {name}")).execute(&mut admin).await.expect("create test database");
    let url = format!("{server}/{name}");
    let pool = idem::mysql::connect(&url, 8).await.expect("connect to test database");
    TestMysql { pool, url, name }
}

impl Drop for TestMysql {
    fn drop(&mut self) {
        let server = mysql_server();
        let name = self.name.clone();
        let pool = self.pool.clone();
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            rt.block_on(async move {
                let _ = tokio::time::timeout(Duration::from_millis(200), pool.close()).await;
                if let Ok(mut admin) = sqlx::MySqlConnection::connect(&format!("{server}/mysql")).await {
                    let _ = sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {name}")).execute(&mut admin).await;
                }
            });
        })
        .join();
    }
}

/// A temporary directory for an embedded log.
pub struct TempDir(pub std::path::PathBuf);

pub fn temp_dir() -> TempDir {
    let path = std::env::temp_dir().join(unique_name("log"));
    std::fs::create_dir_all(&path).expect("create temp dir");
    TempDir(path)
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Queries that read the same on every store.
pub trait TestPool: Send + Sync {
    /// The column type of a text primary key (MySQL needs a length).
    const TEXT_KEY: &'static str = "TEXT";
    /// How this store ages a `processed_at` by ten days, in an `UPDATE … SET processed_at = …`.
    const TEN_DAYS_EARLIER: &'static str = "processed_at - interval '10 days'";
    fn exec(&self, sql: &str) -> impl Future<Output = ()> + Send;
    fn scalar(&self, sql: &str) -> impl Future<Output = i64> + Send;
    fn scalar_text(&self, sql: &str) -> impl Future<Output = String> + Send;
}

impl TestPool for sqlx::PgPool {
    async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sql).execute(self).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(self).await.unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
    async fn scalar_text(&self, sql: &str) -> String {
        sqlx::query_scalar(sql).fetch_one(self).await.unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

impl TestPool for sqlx::SqlitePool {
    const TEN_DAYS_EARLIER: &'static str = "processed_at - 864000000";
    async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sql).execute(self).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(self).await.unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
    async fn scalar_text(&self, sql: &str) -> String {
        sqlx::query_scalar(sql).fetch_one(self).await.unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

impl TestPool for sqlx::MySqlPool {
    const TEXT_KEY: &'static str = "VARCHAR(255)";
    const TEN_DAYS_EARLIER: &'static str = "processed_at - INTERVAL 10 DAY";
    async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sql).execute(self).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    async fn scalar(&self, sql: &str) -> i64 {
        // The shared queries cast to BIGINT, which MySQL spells SIGNED.
        let sql = sql.replace("AS BIGINT)", "AS SIGNED)");
        sqlx::query_scalar(&sql).fetch_one(self).await.unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
    async fn scalar_text(&self, sql: &str) -> String {
        sqlx::query_scalar(sql).fetch_one(self).await.unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

/// idem's tables and the test ledger: `ledger(event_id, amount)` with no unique constraint, so a double
/// application shows as two rows; `blocked(id)` makes the ledger refuse an event until it is unblocked.
pub async fn setup<DB: Backend>(pool: &sqlx::Pool<DB>)
where
    sqlx::Pool<DB>: TestPool,
{
    idem::migrate(pool, &idem::Tables::default()).await.expect("migrate");
    let key = <sqlx::Pool<DB> as TestPool>::TEXT_KEY;
    pool.exec(&format!(
        "CREATE TABLE ledger (event_id TEXT NOT NULL, amount BIGINT NOT NULL); CREATE TABLE blocked (id {key} PRIMARY KEY);"
    ))
    .await;
}

pub fn config(batch_size: usize) -> Config {
    Config::new("ledger-writer", KeyExtractor::JsonPointer("/id".into()))
        .batch_size(batch_size)
        .backoff(Duration::from_millis(5), Duration::from_millis(20))
}

/// A payment message: `{"id": id, "amount": amount}` plus extra JSON fields.
pub fn payment(partition: i32, offset: i64, id: &str, amount: i64, extra: &str) -> Message {
    let extra = if extra.is_empty() { String::new() } else { format!(",{extra}") };
    Message::new("payments", partition, offset, format!(r#"{{"id":"{id}","amount":{amount}{extra}}}"#))
}

pub async fn ledger_rows<P: TestPool>(pool: &P, id: &str) -> i64 {
    pool.scalar(&format!("SELECT COUNT(*) FROM ledger WHERE event_id = '{id}'")).await
}

pub async fn ledger_rows_total<P: TestPool>(pool: &P) -> i64 {
    pool.scalar("SELECT COUNT(*) FROM ledger").await
}

pub async fn ledger_total<P: TestPool>(pool: &P) -> i64 {
    pool.scalar("SELECT CAST(COALESCE(SUM(amount), 0) AS BIGINT) FROM ledger").await
}

pub async fn markers<P: TestPool>(pool: &P, id: &str) -> i64 {
    pool.scalar(&format!("SELECT COUNT(*) FROM processed_events WHERE event_id = '{id}'")).await
}

/// The payload's instructions to the test handler.
#[derive(serde::Deserialize)]
struct Payment {
    amount: i64,
    /// Sleep this long inside the transaction, after writing the entry.
    #[serde(default)]
    sleep_ms: u64,
    /// Fail this many times with a retryable error before succeeding.
    #[serde(default)]
    flaky: u32,
    /// Fail permanently after writing the entry.
    #[serde(default)]
    poison: bool,
    /// Fail permanently the first time this handler sees the id (after sleeping), succeed afterwards.
    #[serde(default)]
    fail_first: bool,
    /// End idem's transaction and write the entry again in one of its own (`ROLLBACK`, `BEGIN`, the insert).
    #[serde(default)]
    restart: bool,
}

/// The test handler: writes a ledger entry, then does what the payload asks.
#[derive(Default)]
pub struct Ledger {
    attempts: Mutex<HashMap<String, u32>>,
    pub calls: AtomicUsize,
}

impl Ledger {
    fn attempt(&self, id: &str) -> u32 {
        let mut attempts = self.attempts.lock().expect("attempts lock");
        let n = attempts.entry(id.to_owned()).or_default();
        *n += 1;
        *n
    }
}

macro_rules! ledger_handler {
    ($db:ty, $conn:ty, $insert:literal, $blocked:literal, $retryable:expr) => {
        impl Handler<$db> for Ledger {
            async fn handle(&self, event: &Event, tx: &mut $conn) -> Result<(), HandlerError> {
                self.calls.fetch_add(1, Ordering::SeqCst);
                let p: Payment = event.json()?;
                sqlx::query($insert).bind(&event.id).bind(p.amount).execute(&mut *tx).await?;
                if p.restart {
                    sqlx::query("ROLLBACK").execute(&mut *tx).await?;
                    sqlx::query("BEGIN").execute(&mut *tx).await?;
                    sqlx::query($insert).bind(&event.id).bind(p.amount).execute(&mut *tx).await?;
                }
                let blocked: i64 = sqlx::query_scalar($blocked).bind(&event.id).fetch_one(&mut *tx).await?;
                if blocked > 0 {
                    return Err(HandlerError::permanent(format!("event {} is blocked", event.id)));
                }
                if p.sleep_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(p.sleep_ms)).await;
                }
                if p.poison {
                    return Err(HandlerError::permanent("poison payment"));
                }
                if p.fail_first && self.attempt(&format!("fail-first-{}", event.id)) == 1 {
                    return Err(HandlerError::permanent("failing the first delivery"));
                }
                if p.flaky > 0 && self.attempt(&event.id) <= p.flaky {
                    let retryable: fn() -> Result<(), HandlerError> = $retryable;
                    return retryable();
                }
                Ok(())
            }
        }
    };
}

ledger_handler!(
    sqlx::Postgres,
    PgConnection,
    "INSERT INTO ledger (event_id, amount) VALUES ($1, $2)",
    "SELECT COUNT(*) FROM blocked WHERE id = $1",
    || Err(HandlerError::retryable("flaky"))
);
ledger_handler!(
    sqlx::Sqlite,
    SqliteConnection,
    "INSERT INTO ledger (event_id, amount) VALUES ($1, $2)",
    "SELECT COUNT(*) FROM blocked WHERE id = $1",
    || Err(HandlerError::retryable("flaky"))
);
ledger_handler!(
    sqlx::MySql,
    sqlx::MySqlConnection,
    "INSERT INTO ledger (event_id, amount) VALUES (?, ?)",
    "SELECT COUNT(*) FROM blocked WHERE id = ?",
    || Err(HandlerError::retryable("flaky"))
);

/// Runs `$test::<backend>` once on a fresh PostgreSQL database and once on a fresh SQLite file.
#[macro_export]
macro_rules! on_both {
    ($name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                let db = $crate::common::pg().await;
                super::$name(db.pool.clone()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                let db = $crate::common::sqlite().await;
                super::$name(db.pool.clone()).await;
            }
        }
    };
}

/// The store conformance suite's runner: `$test::<store>` once on a fresh PostgreSQL database, once on a fresh
/// SQLite file and once on a fresh MySQL/MariaDB database.
#[macro_export]
macro_rules! on_every_store {
    ($name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                let db = $crate::common::pg().await;
                super::$name(db.pool.clone()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                let db = $crate::common::sqlite().await;
                super::$name(db.pool.clone()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn mysql() {
                let db = $crate::common::mysql().await;
                super::$name(db.pool.clone()).await;
            }
        }
    };
}

/// The order-history handler of the Sequential Inbox tests: appends `{"orderId", "step"}` to `history`.
pub struct OrderHistory;

/// Creates the `history` table [`OrderHistory`] writes to.
pub async fn create_order_history(pool: &sqlx::PgPool) {
    pool.exec("CREATE TABLE history (n bigserial, order_id text NOT NULL, step int NOT NULL)").await;
}

/// Steps handled before a step they come after (1 created, 2 and 3 the validations in either order, 4 shipped).
pub async fn order_steps_out_of_order(pool: &sqlx::PgPool) -> i64 {
    pool.scalar(
        "SELECT COUNT(*) FROM history h JOIN history e ON e.order_id = h.order_id AND e.n < h.n \
         WHERE e.step > h.step AND NOT (e.step IN (2, 3) AND h.step IN (2, 3))",
    )
    .await
}

impl Handler<sqlx::Postgres> for OrderHistory {
    async fn handle(&self, event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
        #[derive(serde::Deserialize)]
        struct Step {
            #[serde(rename = "orderId")]
            order_id: String,
            step: i32,
        }
        let s: Step = event.json()?;
        sqlx::query("INSERT INTO history (order_id, step) VALUES ($1, $2)")
            .bind(&s.order_id)
            .bind(s.step)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// An HTTP/1.1 answer: its status (0 when none came), head and body.
pub struct HttpAnswer {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl HttpAnswer {
    /// The value of the header `name` (case-insensitive), if the head has it.
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    }

    /// The body as JSON (a test failure when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The head and body as they came.
    pub fn raw(&self) -> String {
        format!("{}\r\n\r\n{}", self.head, self.body)
    }
}

/// One HTTP/1.1 exchange on a connection of its own, `Content-Length` set from the body.
pub async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> HttpAnswer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    conn.write_all(request.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).await.expect("read");
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    HttpAnswer { status, head: head.to_owned(), body: body.to_owned() }
}
