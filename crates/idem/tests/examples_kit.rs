//! The examples' handlers under the duplicate test kit: the smallest consumer's, the Sequential Inbox's and the
//! guarded orders'.

mod common;

#[allow(dead_code)]
#[path = "../examples/credit.rs"]
mod credit;
#[allow(dead_code)]
#[path = "../examples/order_sequence.rs"]
mod order_sequence;
#[allow(dead_code)]
#[path = "../examples/orders_guarded.rs"]
mod orders_guarded;

use common::TestPool;
use idem::testing::DuplicateKit;
use idem::{Config, KeyExtractor, Message};

#[tokio::test]
async fn the_smallest_consumer() {
    let db = common::sqlite().await;
    idem::migrate(&db.pool, &idem::Tables::default()).await.expect("migrate");
    db.pool.exec("CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL)").await;
    let payments: Vec<Message> = (0..10)
        .map(|i| {
            let payload = format!(r#"{{"idempotencyKey":"pay-{i}","account":{},"amount":{}}}"#, 7 + i % 2, 100 * i);
            Message::new("payments", 0, i, payload)
        })
        .collect();
    let config = Config::new("ledger-writer", KeyExtractor::JsonPointer("/idempotencyKey".into()));
    let kit = DuplicateKit::new(
        db.pool.clone(),
        config,
        async |conn| {
            sqlx::raw_sql("DELETE FROM accounts; INSERT INTO accounts VALUES (7, 0), (8, 0)")
                .execute(conn)
                .await
                .map(drop)
        },
        async |conn| {
            sqlx::query_as::<_, (i64, i64)>("SELECT id, balance FROM accounts ORDER BY id").fetch_all(conn).await
        },
    );
    kit.check(&credit::Credit, &payments).await.expect("kit").assert_exactly_once();
}

#[tokio::test]
async fn the_sequential_inbox_example() {
    let db = common::pg().await;
    let tables = idem::Tables::new(Some("idem_order_example"), "").expect("tables");
    idem::migrate(&db.pool, &tables).await.expect("migrate");
    db.pool.exec("CREATE TABLE idem_order_example.order_history (n bigserial, order_id text, step text)").await;
    let messages: Vec<Message> = ["order-17", "order-42"]
        .iter()
        .flat_map(|order| order_sequence::events(order))
        .enumerate()
        .map(|(offset, (headers, payload))| {
            headers.into_iter().fold(Message::new("orders", 0, offset as i64, payload), |m, (k, v)| m.with_header(k, v))
        })
        .collect();
    let config = Config::new("order-history", KeyExtractor::JsonPointer("/eventId".into())).tables(tables);
    let kit = DuplicateKit::new(
        db.pool.clone(),
        config,
        async |conn| sqlx::raw_sql("DELETE FROM idem_order_example.order_history").execute(conn).await.map(drop),
        async |conn| {
            sqlx::query_as::<_, (String, String)>(
                "SELECT order_id, step FROM idem_order_example.order_history ORDER BY order_id, n",
            )
            .fetch_all(conn)
            .await
        },
    );
    let inbox = idem::inbox::InboxConfig::from_toml(order_sequence::SEQUENCES).expect("sequence");
    let report = kit.check_inbox(&order_sequence::History, &inbox, &messages).await.expect("kit");
    report.assert_exactly_once();
}

macro_rules! guarded {
    ($name:ident, $db:ident) => {
        #[tokio::test]
        async fn $name() {
            let db = common::$db().await;
            idem::migrate(&db.pool, &idem::Tables::default()).await.expect("migrate");
            db.pool.exec(orders_guarded::SCHEMA).await;
            let messages: Vec<Message> = orders_guarded::scrambled(20, 3)
                .into_iter()
                .chain(orders_guarded::late_payments(20, 3))
                .enumerate()
                .map(|(offset, (kind, payload))| {
                    Message::new("orders", 0, offset as i64, payload).with_header("type", kind)
                })
                .collect();
            let config = Config::new("order-states", KeyExtractor::JsonPointer("/eventId".into()));
            let kit = DuplicateKit::new(
                db.pool.clone(),
                config,
                async |conn| sqlx::raw_sql("DELETE FROM orders").execute(conn).await.map(drop),
                async |conn| {
                    sqlx::query_as::<_, (String, String, i64, i64)>(
                        "SELECT id, status, version, total FROM orders ORDER BY id",
                    )
                    .fetch_all(conn)
                    .await
                },
            );
            let guard = idem::guard::StateMachine::from_toml(&db.pool, orders_guarded::MACHINE).await.expect("guard");
            let report = kit.check(&orders_guarded::Orders { guard }, &messages).await.expect("kit");
            report.assert_exactly_once();
        }
    };
}
guarded!(the_guarded_orders_example_on_sqlite, sqlite);
