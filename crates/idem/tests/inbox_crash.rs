//! The Sequential Inbox across SIGKILL: a consumer process killed before and after its commits, restarted until
//! it reaches the end of the log, leaves every order handled once, in its declared order.
//!
//! The test re-runs its own binary as the consumer process (`consumer_process`, inert unless the test sets its
//! environment), killed by the fault it arms from `IDEM_INBOX_CRASH_FAULT`.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::Duration;

use common::{OrderHistory, TestPool, create_order_history, order_steps_out_of_order, pg, temp_dir};
use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::inbox::{InboxConfig, SequentialInbox};
use idem::{Config, Engine, KeyExtractor};

const LOG_ENV: &str = "IDEM_INBOX_CRASH_LOG";
const DB_ENV: &str = "IDEM_INBOX_CRASH_DB";
const FAULT_ENV: &str = "IDEM_INBOX_CRASH_FAULT";

const SEQUENCES: &str = include_str!("../examples/order_sequence.toml");

/// The consumer process's engine, with the fault its environment names armed.
fn engine(pool: sqlx::PgPool, config: Config) -> Engine<sqlx::Postgres> {
    let engine = Engine::new(pool, config).unwrap();
    match std::env::var(FAULT_ENV) {
        Ok(fault) => engine.with_faults(idem::fault::Faults::parse(&fault).unwrap()),
        Err(_) => engine,
    }
}

/// The consumer process: runs the inbox over the log to its end. Does nothing when run as an ordinary test.
#[tokio::test]
async fn consumer_process() {
    let (Ok(dir), Ok(url)) = (std::env::var(LOG_ENV), std::env::var(DB_ENV)) else { return };
    let pool = idem::postgres::connect(&url, 4).await.unwrap();
    let config = Config::new("history", KeyExtractor::JsonPointer("/eventId".into()));
    let inbox = SequentialInbox::new(engine(pool, config), InboxConfig::from_toml(SEQUENCES).unwrap()).unwrap();
    let log = EmbeddedLog::open(&dir).unwrap();
    let options = ConsumerOptions { stop_at_end: true, poll_interval: Duration::from_millis(5), ..Default::default() };
    let source = log.consumer("history", &["orders"], options).unwrap();
    inbox.run(source, OrderHistory, std::future::pending::<()>()).await.unwrap();
}

#[tokio::test]
async fn killed_consumers_leave_every_order_handled_once_in_order() {
    if std::env::var(LOG_ENV).is_ok() {
        return;
    }
    let db = pg().await;
    idem::migrate(&db.pool, &idem::Tables::default()).await.unwrap();
    create_order_history(&db.pool).await;
    let dir = temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("orders", 2).unwrap();
    let producer = log.producer();
    // Per order: shipped, payment, stock, created, then two redeliveries; step numbers give the declared order
    // (the two validations may go either way).
    let scrambled =
        [("OrderShipped", None, 4), ("OrderValidated", Some("payment"), 2), ("OrderValidated", Some("stock"), 3)];
    let orders = 40;
    for n in 0..orders {
        let order = format!("o{n}");
        let mut events = scrambled.to_vec();
        events.push(("OrderCreated", None, 1));
        events.push(("OrderShipped", None, 4));
        events.push(("OrderCreated", None, 1));
        for (kind, sub_type, step) in events {
            let mut headers = vec![("type".to_owned(), kind.as_bytes().to_vec())];
            if let Some(sub) = sub_type {
                headers.push(("subtype".to_owned(), sub.as_bytes().to_vec()));
            }
            let payload = format!(r#"{{"eventId":"{order}-{step}","orderId":"{order}","step":{step}}}"#);
            producer.send("orders", Some(order.as_bytes()), payload.as_bytes(), &headers).unwrap();
        }
    }
    producer.flush().unwrap();

    let exe = std::env::current_exe().unwrap();
    let mut kills = 0;
    for fault in ["before-commit:7", "after-commit:11", "before-commit:23", "after-commit:5", "after-commit:31", ""] {
        let mut command = Command::new(&exe);
        command.args(["consumer_process", "--exact", "--nocapture"]).env(LOG_ENV, &dir.0).env(DB_ENV, &db.url);
        if !fault.is_empty() {
            command.env(FAULT_ENV, fault);
        }
        let status = command.status().unwrap();
        if status.signal() == Some(9) {
            kills += 1;
        } else {
            assert!(status.success(), "consumer failed with {status} (fault {fault:?})");
        }
    }
    assert!(kills >= 4, "the faults killed only {kills} consumer(s): the test did not test crashes");

    let per_order =
        db.pool.scalar("SELECT COUNT(*) FROM (SELECT order_id FROM history GROUP BY 1 HAVING COUNT(*) = 4) x");
    assert_eq!(per_order.await, orders, "every order handled once per step");
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM history").await, orders * 4, "no step handled twice");
    assert_eq!(order_steps_out_of_order(&db.pool).await, 0, "no step before its predecessors");
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequence_instance WHERE status = 'CLOSED'").await, orders);
}
