//! `idem check` consults each consumer's broker as `idem run` would meet it, without consuming: an unreachable
//! server, wrong credentials, a user without the rights, a missing queue, stream, topic or subscription, a stream
//! that does not hold the consumer's subject. Each fault makes it exit non-zero, naming the fault and the fix;
//! `--offline` checks the file alone.

#![cfg(all(feature = "kafka", feature = "nats", feature = "rabbitmq", feature = "sqs", feature = "pubsub"))]

mod service_common;

use service_common::{Db, Dir, idem, ledger_consumer_from, text, unique};

fn nats_url() -> String {
    std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

fn rabbitmq_url() -> String {
    std::env::var("IDEM_RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

fn kafka_brokers() -> String {
    std::env::var("IDEM_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

/// `idem check` of the ledger consumer on `source` (its TOML line), on a SQLite database that holds its tables;
/// `IDEM_CHECK_PASSWORD` set to `password` (a RabbitMQ URL takes its password from the environment).
async fn check(name: &str, source: &str, offline: bool, password: &str) -> (bool, String) {
    let dir = Dir::new(name);
    let db = Db::sqlite(&dir);
    db.ledger().await;
    let path = dir.write("check.toml", &(db.database_toml() + &ledger_consumer_from(&db, source, 10)));
    let mut command = idem();
    command.args(["check", "--config"]).arg(&path).env("IDEM_CHECK_PASSWORD", password);
    if offline {
        command.arg("--offline");
    }
    let output = command.output().expect("idem check");
    (output.status.success(), text(&output))
}

async fn refused(name: &str, source: &str, expected: &[&str]) {
    refused_with(name, source, "", expected).await;
}

async fn refused_with(name: &str, source: &str, password: &str, expected: &[&str]) {
    let (ok, out) = check(name, source, false, password).await;
    assert!(!ok, "{name}: accepted: {out}");
    for part in expected {
        assert!(out.contains(part), "{name}: `{part}` not said: {out}");
    }
    let (ok, out) = check(name, source, true, password).await;
    assert!(ok && out.contains("not consulted (--offline)"), "{name}: --offline still consults: {out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_faults_are_named() {
    let url = rabbitmq_url();
    // The server's URL with the user and the password taken out: `amqp://USER:${IDEM_CHECK_PASSWORD}@host…`.
    let (scheme, rest) = url.split_once("://").expect("amqp URL");
    let (credentials, server) = rest.split_once('@').expect("amqp URL with credentials");
    let (user, password) = credentials.split_once(':').expect("user:password");
    let as_user = |user: &str, server: &str| format!("{scheme}://{user}:${{IDEM_CHECK_PASSWORD}}@{server}");
    let missing = unique("idem_check_missing");
    refused_with(
        "rabbit_missing",
        &format!(r#"rabbitmq = {{ url = "{}", queues = ["{missing}"] }}"#, as_user(user, server)),
        password,
        &[&format!("rabbitmq queue `{missing}`: it does not exist"), "rabbitmqadmin declare queue", "check.toml:"],
    )
    .await;
    let source = format!(r#"rabbitmq = {{ url = "{}", queues = ["q"] }}"#, as_user(user, server));
    refused_with("rabbit_password", &source, "not-the-password", &["cannot connect to rabbitmq"]).await;
    let closed = format!(r#"rabbitmq = {{ url = "{}", queues = ["q"] }}"#, as_user(user, "127.0.0.1:1/%2f"));
    refused_with("rabbit_unreachable", &closed, password, &["cannot connect to rabbitmq", "127.0.0.1:1"]).await;

    // A user without rights on the virtual host (made with rabbitmqctl, where the test may run it). (Rights on
    // one queue show only when it is consumed: a check that takes no message cannot see them.)
    let queue = unique("idem_check_guarded");
    idem::rabbitmq::create_queue(&url, &queue, false).await.expect("queue");
    let limited = unique("idem_check_user");
    let ctl = |args: &[&str]| std::process::Command::new("rabbitmqctl").args(args).output().ok();
    if ctl(&["add_user", &limited, "pw"]).is_some_and(|o| o.status.success()) {
        let source = format!(r#"rabbitmq = {{ url = "{}", queues = ["{queue}"] }}"#, as_user(&limited, server));
        refused_with("rabbit_rights", &source, "pw", &["cannot connect to rabbitmq", "access to vhost"]).await;
        ctl(&["delete_user", &limited]);
    } else {
        eprintln!("rabbitmqctl cannot add a user here: the rights case is left out");
    }
    let good = format!(r#"rabbitmq = {{ url = "{}", queues = ["{queue}"] }}"#, as_user(user, server));
    let (ok, out) = check("rabbit_good", &good, false, password).await;
    assert!(ok, "{out}");
    let _ = idem::rabbitmq::delete_queue(&url, &queue).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_faults_are_named() {
    let url = nats_url();
    let stream = unique("idem_check");
    let subject = unique("chk");
    idem::nats::create_stream(&url, &stream, &[&format!("{subject}.>")], std::time::Duration::ZERO)
        .await
        .expect("stream");
    let missing = unique("idem_check_missing");
    refused(
        "nats_missing",
        &format!(r#"nats = {{ url = "{url}", stream = "{missing}" }}"#),
        &[&format!("nats stream {missing}"), "nats stream add"],
    )
    .await;
    refused("nats_unreachable", r#"nats = { url = "nats://127.0.0.1:1", stream = "s" }"#, &["cannot connect to nats"])
        .await;
    refused(
        "nats_subject",
        &format!(r#"nats = {{ url = "{url}", stream = "{stream}", filter_subject = "elsewhere.payments" }}"#),
        &[&format!("nats stream {stream} does not hold the subject elsewhere.payments"), &format!("{subject}.>")],
    )
    .await;
    let good = format!(r#"nats = {{ url = "{url}", stream = "{stream}", filter_subject = "{subject}.payments" }}"#);
    let (ok, out) = check("nats_good", &good, false, "").await;
    assert!(ok, "{out}");
    let _ = idem::nats::delete_stream(&url, &stream).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_faults_are_named() {
    refused(
        "kafka_unreachable",
        r#"kafka = { brokers = "127.0.0.1:1", topics = ["payments"] }"#,
        &["cannot connect to kafka 127.0.0.1:1"],
    )
    .await;
    let brokers = kafka_brokers();
    let missing = unique("idem_check_missing");
    refused(
        "kafka_missing",
        &format!(r#"kafka = {{ brokers = "{brokers}", topics = ["{missing}"] }}"#),
        &[&format!("kafka topic `{missing}`: it does not exist")],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sqs_and_pubsub_missing_queues_are_named() {
    let endpoint = std::env::var("IDEM_SQS_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:9324".to_owned());
    let missing = unique("idem_check_missing");
    refused(
        "sqs_missing",
        &format!(r#"sqs = {{ queue = "{missing}", endpoint = "{endpoint}", region = "us-east-1" }}"#),
        &[&format!("sqs queue {missing}")],
    )
    .await;
    let host = std::env::var("IDEM_PUBSUB_EMULATOR_HOST").unwrap_or_else(|_| "127.0.0.1:8681".to_owned());
    refused(
        "pubsub_missing",
        &format!(r#"pubsub = {{ subscription = "{missing}", project = "idem-test", emulator_host = "{host}" }}"#),
        &[&missing],
    )
    .await;
}
