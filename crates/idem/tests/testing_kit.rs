//! The duplicate test kit against a correct handler (passes) and a handler that writes outside idem's transaction
//! (fails, naming the event), on PostgreSQL and SQLite.

mod common;

use std::sync::{Arc, Mutex};

use common::TestPool;
use idem::testing::DuplicateKit;
use idem::{BatchHandler, Config, Event, Handler, HandlerError, KeyExtractor, Message};

#[derive(serde::Deserialize)]
struct Payment {
    account: i64,
    amount: i64,
}

fn payments() -> Vec<Message> {
    (0..12)
        .map(|i| {
            let payload = format!(r#"{{"id":"p-{i}","account":{},"amount":{}}}"#, i % 3, 10 + i);
            Message::new("payments", 0, i, payload)
        })
        .collect()
}

fn config() -> Config {
    Config::new("ledger-writer", KeyExtractor::JsonPointer("/id".into())).batch_size(1)
}

/// Credits in idem's transaction: exactly once.
struct Credit;

/// Credits, and also notifies outside idem's transaction: a crash before the commit leaves the notification
/// behind, and the redelivery sends it again. On PostgreSQL it counts the notification in a table through a
/// connection of its own; on SQLite (one writer at a time, so a second connection would wait for idem's
/// transaction) in memory, as an e-mail sent.
struct CreditAndNotify<N>(N);

/// Notifications sent outside the database, per account.
#[derive(Clone, Default)]
struct Sent(Arc<Mutex<[i64; 3]>>);

impl Sent {
    fn reset(&self) {
        *self.0.lock().expect("sent") = [0; 3];
    }
    fn read(&self) -> [i64; 3] {
        *self.0.lock().expect("sent")
    }
}

/// Credits with one statement per batch.
struct CreditAll;

macro_rules! handlers {
    ($db:ty, $conn:ty, $notifier:ty, $notify:expr) => {
        impl Handler<$db> for Credit {
            async fn handle(&self, event: &Event, tx: &mut $conn) -> Result<(), HandlerError> {
                let p: Payment = event.json()?;
                sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
                    .bind(p.amount)
                    .bind(p.account)
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            }
        }

        impl Handler<$db> for CreditAndNotify<$notifier> {
            async fn handle(&self, event: &Event, tx: &mut $conn) -> Result<(), HandlerError> {
                <Credit as Handler<$db>>::handle(&Credit, event, tx).await?;
                let p: Payment = event.json()?;
                // Outside the transaction: the mistake the kit is there to catch.
                ($notify)(&self.0, p.account).await?;
                Ok(())
            }
        }

        impl BatchHandler<$db> for CreditAll {
            async fn handle_batch(&self, events: &[&Event], tx: &mut $conn) -> Result<(), HandlerError> {
                for event in events {
                    <Credit as Handler<$db>>::handle(&Credit, event, tx).await?;
                }
                Ok(())
            }
        }
    };
}
handlers!(sqlx::Postgres, sqlx::PgConnection, sqlx::PgPool, async |pool: &sqlx::PgPool, account: i64| {
    sqlx::query("UPDATE notifications SET sent = sent + 1 WHERE account = $1")
        .bind(account)
        .execute(pool)
        .await
        .map(|_| ())
});
handlers!(sqlx::Sqlite, sqlx::SqliteConnection, Sent, async |sent: &Sent, account: i64| {
    sent.0.lock().expect("sent")[account as usize] += 1;
    Ok::<(), sqlx::Error>(())
});

async fn prepared<DB: idem::Backend>(pool: &sqlx::Pool<DB>)
where
    sqlx::Pool<DB>: TestPool,
{
    idem::migrate(pool, &idem::Tables::default()).await.expect("migrate");
    pool.exec(
        "CREATE TABLE accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL);
         CREATE TABLE notifications (account BIGINT PRIMARY KEY, sent BIGINT NOT NULL)",
    )
    .await;
}

macro_rules! kit {
    ($pool:expr, $sent:expr) => {
        DuplicateKit::new(
            $pool.clone(),
            config(),
            async |conn| {
                $sent.reset();
                sqlx::raw_sql(
                    "DELETE FROM accounts; DELETE FROM notifications;
                     INSERT INTO accounts VALUES (0, 0), (1, 0), (2, 0);
                     INSERT INTO notifications VALUES (0, 0), (1, 0), (2, 0)",
                )
                .execute(conn)
                .await
                .map(|_| ())
            },
            async |conn| {
                sqlx::query_as::<_, (i64, i64, i64)>(
                    "SELECT a.id, a.balance, n.sent FROM accounts a JOIN notifications n ON n.account = a.id ORDER BY a.id",
                )
                .fetch_all(conn)
                .await
                .map(|rows| (rows, $sent.read()))
            },
        )
    };
}

macro_rules! notifier {
    (pg, $pool:expr, $sent:expr) => {
        $pool.clone()
    };
    (sqlite, $pool:expr, $sent:expr) => {
        $sent.clone()
    };
}

macro_rules! both {
    ($($db:ident),*) => {$(
        mod $db {
            use super::*;

            #[tokio::test]
            async fn a_handler_in_the_transaction_passes_every_scenario() {
                let db = common::$db().await;
                prepared(&db.pool).await;
                let sent = Sent::default();
                let kit = kit!(db.pool, sent).shuffle_by(KeyExtractor::JsonPointer("/account".into()));
                let report = kit.check(&Credit, &payments()).await.expect("kit");
                report.assert_exactly_once();
                assert_eq!(report.scenarios.len(), 5, "{report}");
                // Credits commute: the order of one account's events does not change its balance.
                assert!(report.notes.is_empty(), "{report}");
                let report = kit.check_batched(&CreditAll, &payments()).await.expect("kit");
                report.assert_exactly_once();
            }

            #[tokio::test]
            async fn a_handler_writing_outside_the_transaction_fails_naming_the_event() {
                let db = common::$db().await;
                prepared(&db.pool).await;
                let sent = Sent::default();
                let report = kit!(db.pool, sent).check(&CreditAndNotify(notifier!($db, db.pool, sent)), &payments()).await.expect("kit");
                println!("{report}");
                assert!(!report.passed());
                assert_eq!(report.failures.len(), 1, "{report}");
                let finding = &report.failures[0];
                assert!(finding.scenario.contains("crash before commit"), "{report}");
                assert_eq!((finding.index, finding.event.as_str()), (0, "p-0"));
                assert!(finding.diff.contains("- ") && finding.diff.contains("+ "), "{}", finding.diff);
                let text = report.to_string();
                assert!(text.contains("NOT exactly once") && text.contains("after event 0 (id \"p-0\")"), "{text}");
            }
        }
    )*};
}
both!(pg, sqlite);

/// A handler whose outcome depends on the order of one key's events (the last status wins) is reported in a
/// note, not failed.
#[tokio::test]
async fn order_dependence_is_a_note() {
    struct SetStatus;
    impl Handler<sqlx::Sqlite> for SetStatus {
        async fn handle(&self, event: &Event, tx: &mut sqlx::SqliteConnection) -> Result<(), HandlerError> {
            #[derive(serde::Deserialize)]
            struct S {
                account: i64,
                amount: i64,
            }
            let s: S = event.json()?;
            sqlx::query("UPDATE accounts SET balance = $1 WHERE id = $2")
                .bind(s.amount)
                .bind(s.account)
                .execute(&mut *tx)
                .await?;
            Ok(())
        }
    }
    let db = common::sqlite().await;
    prepared(&db.pool).await;
    let sent = Sent::default();
    let report = kit!(db.pool, sent)
        .shuffle_by(KeyExtractor::JsonPointer("/account".into()))
        .check(&SetStatus, &payments())
        .await
        .expect("kit");
    report.assert_exactly_once();
    assert_eq!(report.notes.len(), 1, "{report}");
    assert!(report.notes[0].contains("json:/account"), "{report}");
}

/// A handler that fails every event permanently proves nothing: the kit fails rather than compare empty states.
#[tokio::test]
async fn a_clean_run_that_dead_letters_everything_fails() {
    struct Refuses;
    impl Handler<sqlx::Sqlite> for Refuses {
        async fn handle(&self, _: &Event, _: &mut sqlx::SqliteConnection) -> Result<(), HandlerError> {
            Err(HandlerError::permanent("no such account"))
        }
    }
    let db = common::sqlite().await;
    prepared(&db.pool).await;
    let config = config().kill_switch(idem::KillSwitch::off());
    let kit = DuplicateKit::new(
        db.pool.clone(),
        config,
        async |conn| {
            sqlx::raw_sql("DELETE FROM accounts; INSERT INTO accounts VALUES (0, 0), (1, 0), (2, 0)")
                .execute(conn)
                .await
                .map(drop)
        },
        async |conn| {
            sqlx::query_as::<_, (i64, i64)>("SELECT id, balance FROM accounts ORDER BY id").fetch_all(conn).await
        },
    );
    let report = kit.check(&Refuses, &payments()).await.expect("kit");
    assert!(!report.passed(), "{report}");
    assert!(report.to_string().contains("the clean run applies the events"), "{report}");
    // Twice on the same database: each run's groups are new, so the second is not all duplicates of the first and
    // a handler writing outside the transaction is caught both times.
    let sent = Sent::default();
    let kit = kit!(db.pool, sent);
    for run in 0..2 {
        let report = kit.check(&CreditAndNotify(sent.clone()), &payments()).await.expect("kit");
        assert_eq!(report.failures.len(), 1, "run {run}: {report}");
    }
}
