//! The smallest consumer, runnable: payments from the embedded log credit accounts in SQLite, with a producer
//! retry that must not credit twice.
//!
//! `cargo run -p idem --example credit`

use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor, Tables};
use sqlx::SqliteConnection;

/// Credits the payment's account, in idem's transaction.
pub struct Credit;

#[derive(serde::Deserialize)]
struct Payment {
    account: i64,
    amount: i64,
}

impl Handler<sqlx::Sqlite> for Credit {
    async fn handle(&self, event: &Event, tx: &mut SqliteConnection) -> Result<(), HandlerError> {
        let p: Payment = event.json()?;
        sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
            .bind(p.amount)
            .bind(p.account)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("idem-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let pool = idem::sqlite::connect(&format!("sqlite://{}/ledger.db", dir.display())).await?;
    idem::migrate(&pool, &Tables::default()).await?;
    sqlx::raw_sql(
        "CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL); INSERT INTO accounts VALUES (7, 0);",
    )
    .execute(&pool)
    .await?;

    // Three deliveries, two of them the same payment (a producer retry).
    let log = EmbeddedLog::open(dir.join("log"))?;
    log.create_topic("payments", 1)?;
    let producer = log.producer();
    for (key, amount) in [("pay-1", 4500), ("pay-2", 500), ("pay-1", 4500)] {
        let payload = format!(r#"{{"idempotencyKey":"{key}","account":7,"amount":{amount}}}"#);
        producer.send("payments", Some(b"7"), payload.as_bytes(), &[])?;
    }

    let config = Config::new("ledger-writer", KeyExtractor::JsonPointer("/idempotencyKey".into()));
    let source =
        log.consumer("ledger-writer", &["payments"], ConsumerOptions { stop_at_end: true, ..Default::default() })?;
    let stats = Engine::new(pool.clone(), config)?.run(source, Credit, std::future::pending::<()>()).await?;
    let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = 7").fetch_one(&pool).await?;
    println!("processed {}, duplicates {}, balance {balance} (expected 5000)", stats.processed, stats.duplicate);
    std::fs::remove_dir_all(&dir)?;
    if balance == 5000 { Ok(()) } else { Err("balance mismatch".into()) }
}
