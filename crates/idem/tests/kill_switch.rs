//! The kill switch: the handler's table dropped mid-run makes every message fail the same way; the consumer holds
//! after a few dead letters instead of dead-lettering the whole log, and resumes once told.

mod common;

use std::time::{Duration, Instant};

use common::{Ledger, TestPool};
use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::{Engine, KillSwitch};

const EVENTS: i64 = 600;
const THRESHOLD: u32 = 5;

async fn wait_for(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn kill_switch_holds_a_storm<DB: idem::Backend>(pool: sqlx::Pool<DB>)
where
    sqlx::Pool<DB>: TestPool,
    Ledger: idem::Handler<DB>,
{
    common::setup(&pool).await;
    let dir = common::temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 2).unwrap();
    let producer = log.producer();
    let send = |range: std::ops::Range<i64>| {
        for i in range {
            producer.send("payments", None, format!(r#"{{"id":"e{i}","amount":1}}"#).as_bytes(), &[]).unwrap();
        }
        producer.flush().unwrap();
    };
    send(0..EVENTS / 3);

    let config = common::config(20).kill_switch(KillSwitch { threshold: THRESHOLD, pause: Duration::from_secs(3600) });
    let engine = Engine::new(pool.clone(), config).unwrap();
    let source = log.consumer("ledger-writer", &["payments"], ConsumerOptions::default()).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn({
        let engine = engine.clone();
        async move { engine.run(source, Ledger::default(), stopped).await }
    });
    wait_for("a third of the events", async || pool.scalar("SELECT COUNT(*) FROM ledger").await >= EVENTS / 3).await;

    // The handler's table goes away under the consumer: every message after it fails with the same reason.
    pool.exec("ALTER TABLE ledger RENAME TO ledger_away").await;
    send(EVENTS / 3..EVENTS);
    wait_for("the kill switch to trip", async || engine.health().paused).await;
    assert!(!engine.health().ready(), "a tripped consumer is not ready");
    assert_eq!(engine.kill_switch_trips(), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let dead = pool.scalar("SELECT COUNT(*) FROM dead_letters").await;
    assert_eq!(dead, i64::from(THRESHOLD) - 1, "the storm stops at the threshold, not at the end of the log");
    assert_eq!(pool.scalar("SELECT COUNT(DISTINCT error) FROM dead_letters").await, 1);
    assert!(!run.is_finished(), "the consumer holds; it does not exit");

    // Resumed while the cause is still there: it trips again at once, without another dead letter.
    engine.resume();
    wait_for("the switch to trip again", async || engine.kill_switch_trips() == 2).await;
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM dead_letters").await, dead);

    // Fixed, then resumed: everything else is applied once.
    pool.exec("ALTER TABLE ledger_away RENAME TO ledger").await;
    assert!(engine.resume_as("alice"), "it was paused");
    let audited = "SELECT COUNT(*) FROM audit_log WHERE actor = 'alice' AND action = 'resume' \
                   AND subjects = 'consumer group ledger-writer' AND outcome = 'ok: resumed'";
    wait_for("the audit trail to say who resumed which consumer", async || pool.scalar(audited).await == 1).await;
    let applied = EVENTS - dead;
    wait_for("the rest of the log", async || pool.scalar("SELECT COUNT(*) FROM ledger").await >= applied).await;
    assert!(!engine.health().paused);
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM ledger").await, applied);
    assert_eq!(pool.scalar("SELECT COUNT(DISTINCT event_id) FROM ledger").await, applied);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM processed_events").await, EVENTS);
}

on_every_store!(kill_switch_holds_a_storm);
