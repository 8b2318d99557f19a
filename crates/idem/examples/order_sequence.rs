//! The Sequential Inbox, runnable: order events arrive out of order and twice on the embedded log, and are
//! handled per order in the declared order, created → validated (stock and payment) → shipped, each once.
//!
//! Needs PostgreSQL (the inbox's claim waits on row locks): `IDEM_DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`. Its tables live in the schema `idem_order_example`, recreated
//! at each run.
//!
//! `cargo run -p idem --example order_sequence`

use std::time::Duration;

use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::inbox::{InboxConfig, SequentialInbox};
use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor, Tables};
use sqlx::PgConnection;

/// The sequence, as a deployment would keep it in a file.
pub const SEQUENCES: &str = include_str!("order_sequence.toml");

/// Appends each handled event to the order's history, in the inbox's transaction.
pub struct History;

impl Handler<sqlx::Postgres> for History {
    async fn handle(&self, event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
        #[derive(serde::Deserialize)]
        struct Order {
            #[serde(rename = "orderId")]
            order_id: String,
            step: String,
        }
        let order: Order = event.json()?;
        sqlx::query("INSERT INTO idem_order_example.order_history (order_id, step) VALUES ($1, $2)")
            .bind(&order.order_id)
            .bind(&order.step)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// A message's headers.
pub type Headers = Vec<(String, Vec<u8>)>;

/// One order's events in a scrambled order, with two redeliveries: `(headers, payload)`.
pub fn events(order: &str) -> Vec<(Headers, String)> {
    let events = [
        ("OrderShipped", None, "shipped", "4"),
        ("OrderValidated", Some("payment"), "payment validated", "3"),
        ("OrderValidated", Some("stock"), "stock validated", "2"),
        ("OrderShipped", None, "shipped", "4"),
        ("OrderCreated", None, "created", "1"),
        ("OrderValidated", Some("stock"), "stock validated", "2"),
    ];
    events
        .into_iter()
        .map(|(kind, sub_type, step, n)| {
            let mut headers = vec![("type".to_owned(), kind.as_bytes().to_vec())];
            if let Some(sub_type) = sub_type {
                headers.push(("subtype".to_owned(), sub_type.as_bytes().to_vec()));
            }
            (headers, format!(r#"{{"eventId":"{order}-{n}","orderId":"{order}","step":"{step}"}}"#))
        })
        .collect()
}

/// Publishes one order's events.
fn publish(producer: &idem::embedded::LogProducer, order: &str) -> Result<(), idem::SourceError> {
    for (headers, payload) in events(order) {
        producer.send("orders", Some(order.as_bytes()), payload.as_bytes(), &headers)?;
    }
    producer.flush()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url =
        std::env::var("IDEM_DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = idem::postgres::connect(&url, 8).await?;
    sqlx::raw_sql("DROP SCHEMA IF EXISTS idem_order_example CASCADE").execute(&pool).await?;
    let tables = Tables::new(Some("idem_order_example"), "")?;
    idem::migrate(&pool, &tables).await?;
    sqlx::raw_sql("CREATE TABLE idem_order_example.order_history (n bigserial, order_id text, step text)")
        .execute(&pool)
        .await?;

    let dir = std::env::temp_dir().join(format!("idem-order-example-{}", std::process::id()));
    let log = EmbeddedLog::open(&dir)?;
    log.create_topic("orders", 2)?;
    for order in ["order-17", "order-42"] {
        publish(&log.producer(), order)?;
    }

    let config = Config::new("order-history", KeyExtractor::JsonPointer("/eventId".into())).tables(tables);
    let inbox = SequentialInbox::new(Engine::new(pool.clone(), config)?, InboxConfig::from_toml(SEQUENCES)?)?;
    let options = ConsumerOptions { stop_at_end: true, poll_interval: Duration::from_millis(10), ..Default::default() };
    let source = log.consumer("order-history", &["orders"], options)?;
    inbox.run(source, History, std::future::pending::<()>()).await?;

    let stats = inbox.stats();
    println!(
        "consumed {}, handled on arrival {}, buffered {}, released {}, duplicates skipped {}",
        stats.consumed, stats.processed, stats.buffered, stats.released, stats.duplicates
    );
    let mut ok = true;
    for order in ["order-17", "order-42"] {
        let steps: Vec<String> =
            sqlx::query_scalar("SELECT step FROM idem_order_example.order_history WHERE order_id = $1 ORDER BY n")
                .bind(order)
                .fetch_all(&pool)
                .await?;
        let status: String = sqlx::query_scalar(
            "SELECT status FROM idem_order_example.sequence_instance WHERE sequence_name = 'order' AND context_id = $1",
        )
        .bind(order)
        .fetch_one(&pool)
        .await?;
        println!("{order}: {} ({status})", steps.join(" → "));
        ok &= steps == ["created", "payment validated", "stock validated", "shipped"] && status == "CLOSED";
    }
    std::fs::remove_dir_all(&dir)?;
    if ok { Ok(()) } else { Err("an order was not handled in its declared order exactly once".into()) }
}
