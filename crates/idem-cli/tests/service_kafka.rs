//! `idem run` on Kafka, alone in its test binary (the loopback broker's group joins are slow under load): the
//! ledger exact after SIGKILL crashes between commit and offset commit, and before the commit.

#![cfg(feature = "kafka")]

mod service_common;

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use service_common::*;

fn kafka_brokers() -> String {
    std::env::var("IDEM_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_ledger_is_exact_after_sigkill_crashes_on_kafka() {
    let dir = Dir::new("svc_kafka");
    let db = Db::postgres("svc_kafka");
    db.ledger().await;
    let p = &db.prefix;
    let topic = unique("svc_payments");
    idem::kafka::create_topic(&kafka_brokers(), &topic, 3, 7 * 86_400_000).await.expect("create the topic");
    let producer = idem::kafka::KafkaProducer::new(&kafka_brokers()).expect("producer");
    let (lines, total) = payments(300);
    for line in &lines {
        let account: serde_json::Value = serde_json::from_str(line).expect("json");
        let key = account["account"].to_string();
        producer.send(&topic, Some(key.as_bytes()), line.as_bytes(), &[]).await.expect("produce");
    }
    let source = format!(
        "group = \"{topic}-group\"\nkafka = {{ brokers = \"${{IDEM_TEST_KAFKA}}\", topics = [\"{topic}\"], settings = {{ \"session.timeout.ms\" = \"6000\" }} }}"
    );
    let consumer = ledger_consumer_from(&db, &source, 10);
    let config = dir.write("idem.toml", &(db.database_toml() + &consumer));
    // Each run has a deadline: one that has not ended by then is killed with SIGKILL, which is one more crash for
    // idem (the loopback broker sometimes keeps a group's join waiting for minutes under load).
    let run_kafka = |fault: Option<&str>| -> (Option<i32>, bool, String) {
        let log = dir.path("run.log");
        let mut command = idem();
        command.args(["run", "--exit-at-end", "--config"]).arg(&config).env("IDEM_TEST_KAFKA", kafka_brokers());
        if let Some(fault) = fault {
            command.args(["--fault", fault]);
        }
        let stderr = std::fs::File::create(&log).expect("log file");
        let mut child = command.stdout(Stdio::null()).stderr(stderr).spawn().expect("idem run");
        let deadline = Instant::now() + Duration::from_secs(90);
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait") {
                break Some(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let logs = std::fs::read_to_string(&log).unwrap_or_default();
        match status {
            Some(status) => (status.signal(), status.success(), logs),
            None => (Some(9), false, format!("killed at the deadline\n{logs}")),
        }
    };
    for fault in ["after-commit:3", "before-commit:2"] {
        let (signal, _, logs) = run_kafka(Some(fault));
        assert_eq!(signal, Some(9), "{fault} was not reached: {logs}");
    }
    let mut finished = false;
    for _ in 0..3 {
        let (_, success, logs) = run_kafka(None);
        if success {
            finished = true;
            break;
        }
        assert!(logs.starts_with("killed at the deadline"), "{logs}");
    }
    assert!(finished, "three runs in a row did not reach the end of the topic");
    assert_eq!(db.scalar(&format!("SELECT COUNT(*) FROM {p}ledger")).await, 300);
    assert_eq!(db.scalar(&format!("SELECT CAST(SUM(balance) AS BIGINT) FROM {p}accounts")).await, total);
    let _ = idem::kafka::delete_topic(&kafka_brokers(), &topic).await;
}
