//! The metrics of docs/METRICS.md after a known run. Alone in its test binary: the metrics recorder
//! is global to the process.

mod common;

use std::time::Duration;

use common::{Ledger, config};
use idem::Engine;

/// After 100 processed, 5 duplicates, 1 dead letter and 1 retry, the Prometheus text has every checklist name
/// with those values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_after_a_known_run() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder().expect("recorder");
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let mut config = config(50);
    config.stats_interval = Duration::from_millis(20);
    let engine = Engine::new(db.pool.clone(), config).unwrap();
    let dir = common::temp_dir();
    let log = idem::embedded::EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 1).unwrap();
    let producer = log.producer();
    for n in 0..100 {
        let extra = if n == 7 { r#","flaky":1"# } else { "" };
        producer.send("payments", None, format!(r#"{{"id":"m{n}","amount":1{extra}}}"#).as_bytes(), &[]).unwrap();
    }
    for n in 0..5 {
        producer.send("payments", None, format!(r#"{{"id":"m{n}","amount":1}}"#).as_bytes(), &[]).unwrap();
    }
    producer.send("payments", None, br#"{"id":"bad","amount":"x"}"#, &[]).unwrap();
    let options = idem::embedded::ConsumerOptions { stop_at_end: true, ..Default::default() };
    let source = log.consumer("ledger-writer", &["payments"], options).unwrap();
    let stats = engine.run(source, Ledger::default(), tokio::time::sleep(Duration::from_secs(60))).await.unwrap();
    assert_eq!((stats.processed, stats.duplicate, stats.dead_lettered, stats.retried), (100, 5, 1, 1));

    // Let the housekeeping task publish the gauges once more.
    let options = idem::embedded::ConsumerOptions { stop_at_end: false, ..Default::default() };
    let idle = log.consumer("ledger-writer", &["payments"], options).unwrap();
    engine.run(idle, Ledger::default(), tokio::time::sleep(Duration::from_millis(200))).await.unwrap();

    let text = recorder.render();
    let labels = r#"consumer_group="ledger-writer",topic="payments""#;
    for (outcome, value) in [("processed", 100), ("duplicate", 5), ("dead_lettered", 1), ("retried", 1)] {
        let line = format!(r#"idem_events_handled_total{{{labels},outcome="{outcome}"}} {value}"#);
        assert!(text.contains(&line), "missing `{line}` in:\n{text}");
    }
    assert!(text.contains(r#"idem_processed_events_rows{consumer_group="ledger-writer"} 101"#), "{text}");
    assert!(text.contains(r#"idem_dead_letters_stored{consumer_group="ledger-writer"} 1"#), "{text}");
    assert!(
        text.contains(r#"idem_immediate_retries_total{consumer_group="ledger-writer",cause="handler"} 1"#),
        "{text}"
    );
    for name in [
        "idem_processed_events_oldest_age_seconds",
        "idem_event_handle_duration_seconds",
        "idem_consumer_offset_commit_lag_seconds",
    ] {
        assert!(text.contains(name), "missing {name} in:\n{text}");
    }
    assert!(
        text.contains(
            r#"idem_consumer_offset_commit_lag_seconds{consumer_group="ledger-writer",topic="payments",partition="0"}"#
        ),
        "{text}"
    );
    // Every metric is described (`# HELP`), and the kill switch's gauge is published from the start.
    for name in [
        "idem_events_handled_total",
        "idem_processed_events_rows",
        "idem_dead_letters_stored",
        "idem_consumer_paused",
        "idem_immediate_retries_total",
    ] {
        assert!(text.contains(&format!("# HELP {name} ")), "no HELP for {name} in:\n{text}");
    }
    assert!(text.contains(r#"idem_consumer_paused{consumer_group="ledger-writer"} 0"#), "{text}");
    // What has not happened is there at 0, so that rate() and absent() have a series from the start.
    for outcome in ["id_reused", "stale", "rejected", "parked"] {
        let line = format!(r#"idem_events_handled_total{{{labels},outcome="{outcome}"}} 0"#);
        assert!(text.contains(&line), "missing `{line}` in:\n{text}");
    }
    for line in [
        r#"idem_events_lost_total{consumer_group="ledger-writer",topic="payments"} 0"#,
        r#"idem_kill_switch_trips_total{consumer_group="ledger-writer"} 0"#,
        r#"idem_immediate_retries_total{consumer_group="ledger-writer",cause="database"} 0"#,
        r#"idem_delayed_retries_total{consumer_group="ledger-writer",result="dead_lettered"} 0"#,
    ] {
        assert!(text.contains(line), "missing `{line}` in:\n{text}");
    }
    // Every name follows Prometheus' rules: idem's prefix, and no gauge named like a histogram's part.
    for line in text.lines().filter(|line| line.starts_with("# TYPE ")) {
        let mut words = line.split_whitespace().skip(2);
        let (name, kind) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
        assert!(name.starts_with("idem_"), "{name} has no idem_ prefix");
        if kind != "histogram" && kind != "summary" {
            assert!(!name.ends_with("_count") && !name.ends_with("_sum") && !name.ends_with("_bucket"), "{name}");
        }
        if kind == "counter" {
            assert!(name.ends_with("_total"), "the counter {name} does not end in _total");
        }
    }
}
