//! `idem demo --service`: the same payments ledger, consumed by `idem run` from a configuration file instead of
//! the demo's Rust handler. The file is written beside the log; its effects are the handler's, as SQL.

use std::path::Path;

use super::{GROUP, PREFIX, Transport};

/// The environment variable the file takes the broker URL from (so a password in it stays out of the file).
pub(super) const BROKER_URL_ENV: &str = "IDEM_DEMO_BROKER_URL";

/// The demo's consumer as a configuration file, for `transport`.
pub(super) fn config(transport: &Transport, batch_size: usize, connections: i32) -> String {
    let q = |s: &str| serde_json::to_string(s).unwrap_or_default();
    let (group, source) = match transport {
        Transport::Embedded(dir) => (
            GROUP.to_owned(),
            format!("embedded = {{ dir = {}, topics = [\"payments\"] }}", q(&dir.display().to_string())),
        ),
        Transport::Kafka { topic, group, .. } => (
            group.clone(),
            format!(
                "kafka = {{ brokers = \"${{{BROKER_URL_ENV}}}\", topics = [{}], settings = {{ \"session.timeout.ms\" = \"6000\" }} }}",
                q(topic)
            ),
        ),
        Transport::Nats { stream, group, partitions, .. } => (
            group.clone(),
            format!(
                "nats = {{ url = \"${{{BROKER_URL_ENV}}}\", stream = {}, ack_wait = \"3s\", partitions = {partitions} }}",
                q(stream)
            ),
        ),
        Transport::Rabbitmq { queues, group, .. } => {
            let queues: Vec<String> = queues.iter().map(|queue| q(queue)).collect();
            (
                group.clone(),
                format!("rabbitmq = {{ url = \"${{{BROKER_URL_ENV}}}\", queues = [{}] }}", queues.join(", ")),
            )
        }
        Transport::Sqs { queue, group, partitions, .. } => (
            group.clone(),
            format!(
                "sqs = {{ endpoint = \"${{{BROKER_URL_ENV}}}\", queue = {}, max_batch_time = \"3s\", partitions = {partitions} }}",
                q(queue)
            ),
        ),
        Transport::PubSub { project, subscription, group, partitions, outstanding, .. } => (
            group.clone(),
            format!(
                "pubsub = {{ project = {}, subscription = {}, partitions = {partitions}, max_batch_time = \"3s\", \
                 max_outstanding_messages = {outstanding}, require_ordering = true, idle_end = \"{}s\" }}",
                q(project),
                q(subscription),
                super::transport::pubsub_idle_end().as_secs()
            ),
        ),
    };
    ledger("json:/idempotencyKey", &group, &source, batch_size, connections)
}

/// The ledger's consumer keyed by `key`, in `group`, reading from `source` (its TOML line).
pub(super) fn ledger(key: &str, group: &str, source: &str, batch_size: usize, connections: i32) -> String {
    let q = |s: &str| serde_json::to_string(s).unwrap_or_default();
    format!(
        r#"# The payments ledger of `idem demo`, as configuration: `idem run --config` applies each payment once.
[database]
url = "${{IDEM_DATABASE_URL}}"
table_prefix = "{PREFIX}"
connections = {connections}

[[consumer]]
name = "ledger"
group = {group}
key = {key}
batch_size = {batch_size}
{source}

[consumer.params]
id      = {{ from = "event-id", type = "text" }}
account = {{ from = "json:/account", type = "integer" }}
amount  = {{ from = "json:/amount", type = "integer" }}

[[consumer.effect]]
sql = "INSERT INTO {PREFIX}ledger (event_id, account, amount) VALUES (:id, :account, :amount)"

[[consumer.effect]]
sql = "UPDATE {PREFIX}accounts SET balance = balance + :amount, credits = credits + 1 WHERE id = :account"
expect_rows = 1   # an unknown account is dead-lettered, not silently skipped
"#,
        group = q(group),
        key = q(key),
    )
}

/// The broker URL of `transport`, for [`BROKER_URL_ENV`].
pub(super) fn broker_url(transport: &Transport) -> Option<&str> {
    match transport {
        Transport::Embedded(_) | Transport::PubSub { .. } => None,
        Transport::Kafka { brokers, .. } => Some(brokers),
        Transport::Nats { url, .. } | Transport::Rabbitmq { url, .. } => Some(url),
        Transport::Sqs { endpoint, .. } => Some(endpoint),
    }
}

/// Writes the file into `dir`; returns its path.
pub(super) fn write(
    dir: &Path,
    transport: &Transport,
    batch_size: usize,
    connections: i32,
) -> anyhow::Result<std::path::PathBuf> {
    let path = dir.join("idem.toml");
    std::fs::write(&path, config(transport, batch_size, connections))
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}
