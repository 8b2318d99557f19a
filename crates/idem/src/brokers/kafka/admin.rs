//! Topic administration used by the retention guard, the demo and the tests.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::DefaultClientContext;

use super::kafka_error;
use crate::source::SourceError;

fn admin(brokers: &str) -> Result<AdminClient<DefaultClientContext>, SourceError> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| SourceError::permanent("kafka admin client", e))
}

fn options() -> AdminOptions {
    AdminOptions::new().request_timeout(Some(Duration::from_secs(15))).operation_timeout(Some(Duration::from_secs(15)))
}

/// Creates `topic` with `partitions` and an explicit `retention.ms` (an already existing topic is left as it is).
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32, retention_ms: i64) -> Result<(), SourceError> {
    let retention = retention_ms.to_string();
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1)).set("retention.ms", &retention);
    let results =
        admin(brokers)?.create_topics([&new], &options()).await.map_err(|e| kafka_error("create topic", e))?;
    for result in results {
        match result {
            Ok(_) => {}
            Err((_, rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => return Err(SourceError::permanent("create topic", format!("{name}: {code}"))),
        }
    }
    Ok(())
}

/// Deletes `topic` (benchmarks and tests clean up after themselves); a missing topic is not an error.
pub async fn delete_topic(brokers: &str, topic: &str) -> Result<(), SourceError> {
    let results =
        admin(brokers)?.delete_topics(&[topic], &options()).await.map_err(|e| kafka_error("delete topic", e))?;
    for result in results {
        match result {
            Ok(_) | Err((_, rdkafka::types::RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
            Err((name, code)) => return Err(SourceError::permanent("delete topic", format!("{name}: {code}"))),
        }
    }
    Ok(())
}

/// The topic's `retention.ms` as the broker reports it through DescribeConfigs; `None` when it does not say.
pub async fn topic_retention_ms(brokers: &str, topic: &str) -> Result<Option<i64>, SourceError> {
    let resources = [ResourceSpecifier::Topic(topic)];
    let results = admin(brokers)?
        .describe_configs(&resources, &options())
        .await
        .map_err(|e| kafka_error("describe configs", e))?;
    for result in results {
        let resource = result.map_err(|code| SourceError::transient("describe configs", format!("{topic}: {code}")))?;
        if let Some(entry) = resource.entries.iter().find(|e| e.name == "retention.ms") {
            return Ok(entry.value.as_deref().and_then(|v| v.trim().parse::<i64>().ok()));
        }
    }
    Ok(None)
}
