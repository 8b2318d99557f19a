//! How far behind each consumer is, where its source tells: Kafka's statistics (the messages between each owned
//! partition's end and the committed offset, every `statistics.interval.ms`), JetStream's pending count on each
//! delivery, each RabbitMQ queue's ready messages and each SQS queue's approximate count of visible messages
//! (every 15 s). Kept in this process for the console's consumers view, and exported as the gauge
//! `idem_consumer_lag_messages`. A source that does not tell (Pub/Sub, the embedded log) has none.

use std::collections::{BTreeMap, HashMap};
use std::sync::{LazyLock, Mutex};

/// One partition's (or, without partitions, one consumer's) lag.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Lag {
    /// The topic, stream or queue.
    pub topic: String,
    /// The partition; none where the source counts for the whole consumer (JetStream).
    pub partition: Option<i32>,
    /// Messages behind.
    pub messages: i64,
    /// When the source said so, ms since the epoch (RFC 3339 in JSON).
    #[serde(rename = "at", serialize_with = "crate::store::rfc3339")]
    pub at_ms: i64,
}

type Lags = HashMap<String, BTreeMap<(String, Option<i32>), (i64, i64)>>;

static LAGS: LazyLock<Mutex<Lags>> = LazyLock::new(|| Mutex::new(HashMap::new()));

fn lags() -> std::sync::MutexGuard<'static, Lags> {
    LAGS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Records that consumer group `group` is `messages` behind on `topic` (`partition`).
pub fn record(group: &str, topic: &str, partition: Option<i32>, messages: i64) {
    let label = partition.map_or_else(|| "all".to_owned(), |p| p.to_string());
    metrics::gauge!("idem_consumer_lag_messages", "consumer_group" => group.to_owned(), "topic" => topic.to_owned(),
        "partition" => label)
    .set(messages as f64);
    let at = crate::engine::now_ms();
    lags().entry(group.to_owned()).or_default().insert((topic.to_owned(), partition), (messages, at));
}

/// Forgets `group`'s lag on a partition it no longer owns.
pub fn forget(group: &str, topic: &str, partition: i32) {
    if let Some(of_group) = lags().get_mut(group) {
        of_group.remove(&(topic.to_owned(), Some(partition)));
    }
}

/// Consumer group `group`'s lags, by topic and partition.
pub fn of(group: &str) -> Vec<Lag> {
    lags()
        .get(group)
        .map(|of_group| {
            of_group
                .iter()
                .map(|((topic, partition), &(messages, at_ms))| Lag {
                    topic: topic.clone(),
                    partition: *partition,
                    messages,
                    at_ms,
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lags_are_kept_per_group_and_forgotten_with_the_partition() {
        record("lag-test", "payments", Some(1), 40);
        record("lag-test", "payments", Some(0), 7);
        record("lag-test", "payments", Some(1), 12);
        let seen: Vec<(Option<i32>, i64)> = of("lag-test").iter().map(|l| (l.partition, l.messages)).collect();
        assert_eq!(seen, [(Some(0), 7), (Some(1), 12)]);
        forget("lag-test", "payments", 0);
        assert_eq!(of("lag-test").len(), 1);
        assert!(of("nobody").is_empty());
    }
}
