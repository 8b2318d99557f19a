//! The Sequential Inbox's counters and gauges after a known run. Alone in its test binary: the metrics recorder
//! is global to the process.

mod common;

use common::{TestPool, pg};
use idem::inbox::{InboxConfig, SequentialInbox};
use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor, Message};
use sqlx::PgConnection;

struct Nothing;

impl Handler<sqlx::Postgres> for Nothing {
    async fn handle(&self, _event: &Event, _tx: &mut PgConnection) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn message(kind: &str, order: &str, id: &str) -> Message {
    Message::new("orders", 0, 0, format!(r#"{{"eventId":"{id}","orderId":"{order}"}}"#)).with_header("type", kind)
}

#[tokio::test]
async fn inbox_metrics_after_a_known_run() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder().expect("recorder");
    let db = pg().await;
    idem::migrate(&db.pool, &idem::Tables::default()).await.unwrap();
    let sequences = r#"
        [housekeeping]
        expiring_soon = "2d"
        [[sequence]]
        name = "order"
        retention = "1d"
        [[sequence.type]]
        name = "Created"
        context_id = "json:/orderId"
        [[sequence.type]]
        name = "Shipped"
        context_id = "json:/orderId"
        release = { predecessor = "Created" }
    "#;
    let config = Config::new("orders", KeyExtractor::JsonPointer("/eventId".into()));
    let inbox =
        SequentialInbox::new(Engine::new(db.pool.clone(), config).unwrap(), InboxConfig::from_toml(sequences).unwrap())
            .unwrap();
    // o1: shipped waits, then created releases it; o2: shipped waits for good; one duplicate.
    let messages = vec![
        message("Shipped", "o1", "a2"),
        message("Created", "o1", "a1"),
        message("Shipped", "o2", "b2"),
        message("Created", "o1", "a1"),
    ];
    inbox.process(messages, &Nothing).await.unwrap();
    db.pool
        .exec("UPDATE sequenced_message SET received_at = now() - interval '10 minutes' WHERE status = 'WAITING'")
        .await;
    inbox.housekeep(&Nothing).await.unwrap();

    let text = recorder.render();
    let labels = r#"consumer_group="orders",sequence="order""#;
    for (name, value) in [
        ("idem_inbox_consumed_total", "4"),
        ("idem_inbox_processed_total", "1"),
        ("idem_inbox_released_total", "1"),
        ("idem_inbox_buffered_total", "2"),
        ("idem_inbox_duplicates_skipped_total", "1"),
        ("idem_inbox_waiting_messages", "1"),
        ("idem_inbox_instances_expiring_soon", "2"),
        ("idem_inbox_instances_expired", "0"),
    ] {
        let line = format!("{name}{{{labels}}} {value}\n");
        assert!(text.contains(&line), "missing `{line}` in:\n{text}");
    }
    let age = text
        .lines()
        .find_map(|l| l.strip_prefix(&format!("idem_inbox_oldest_waiting_age_seconds{{{labels}}} ")))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no oldest waiting age in:\n{text}"));
    assert!((600.0..700.0).contains(&age), "oldest waiting age {age}");
}
