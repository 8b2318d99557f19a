//! Kafka (feature `kafka`): a [`KafkaSource`] on the source seam, a [`KafkaProducer`] for users and tests, and
//! the retention guard.
//!
//! The source always runs with `enable.auto.commit=false` and `enable.auto.offset.store=false`: offsets are
//! committed by idem, per partition, only up to messages whose database transaction committed. A setting that
//! turns auto-commit on is refused at start-up (a crash would lose what was committed to Kafka but not to the database). On revocation (eager or
//! cooperative) the partitions are drained through the engine before they go: in-flight work finishes, its
//! offsets are committed synchronously, then the partitions are released.

mod admin;
pub mod consumer;
mod producer;

use std::collections::BTreeMap;
use std::time::Duration;

pub use admin::{create_topic, delete_topic, topic_retention_ms};
pub use consumer::{KafkaSource, check};
pub use producer::{EVENT_ID_HEADER, KafkaProducer};

use crate::error::Error;

/// How to reach Kafka and consume from it.
#[derive(Debug, Clone)]
pub struct KafkaConfig {
    /// `bootstrap.servers`, e.g. `127.0.0.1:9092`.
    pub brokers: String,
    /// Topics to subscribe to.
    pub topics: Vec<String>,
    /// Further librdkafka settings (`session.timeout.ms`, `partition.assignment.strategy`, security…).
    /// Settings that would let offsets be committed before the database are refused.
    pub settings: BTreeMap<String, String>,
    /// Return the end of the source once every assigned partition reached its end (demos, batch jobs).
    /// Needs exactly one topic.
    pub stop_at_end: bool,
    /// How long a revocation waits for in-flight batches before letting the partitions go anyway (their work is
    /// then redelivered to the new owner and absorbed by the markers). Default 30 s.
    pub drain_timeout: Duration,
    /// Accept pruned markers against a topic that keeps messages forever (`retention.ms=-1`); logged at WARN.
    pub accept_infinite_topic_retention: bool,
}

impl KafkaConfig {
    /// A configuration with defaults: a new group starts at the earliest offset. The consumer group
    /// (`group.id`) and the marker retention come from the engine's [`crate::Config`], given to
    /// [`KafkaSource::connect`], so markers and offsets are always kept under the same group.
    pub fn new(brokers: impl Into<String>, topics: &[&str]) -> Self {
        KafkaConfig {
            brokers: brokers.into(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            settings: BTreeMap::new(),
            stop_at_end: false,
            drain_timeout: Duration::from_secs(30),
            accept_infinite_topic_retention: false,
        }
    }

    /// Adds a librdkafka setting.
    pub fn set(mut self, key: &str, value: &str) -> Self {
        self.settings.insert(key.to_owned(), value.to_owned());
        self
    }

    /// Refuses what cannot work, naming the setting and the fix.
    pub fn validate(&self) -> Result<(), Error> {
        if self.brokers.trim().is_empty() {
            return Err(Error::Config("kafka brokers is empty: give host:port[,host:port…]".into()));
        }
        if self.topics.is_empty() {
            return Err(Error::Config("kafka topics is empty: subscribe to at least one topic".into()));
        }
        if self.stop_at_end && self.topics.len() != 1 {
            return Err(Error::Config("stop_at_end needs exactly one topic".into()));
        }
        for (key, forbidden, why) in [
            ("enable.auto.commit", "true", "offsets would be committed before the database transaction"),
            ("enable.auto.offset.store", "true", "offsets would be stored before the database transaction"),
        ] {
            if self.settings.get(key).is_some_and(|v| v.trim().eq_ignore_ascii_case(forbidden)) {
                return Err(Error::Config(format!(
                    "kafka setting {key}={forbidden} is refused: {why}, so a crash would lose events; \
                     remove it (idem commits offsets itself, after each commit)"
                )));
            }
        }
        for key in ["group.id", "bootstrap.servers"] {
            if self.settings.contains_key(key) {
                return Err(Error::Config(format!(
                    "kafka setting {key} is set by idem: the group is the engine's Config::group, the brokers KafkaConfig::brokers"
                )));
            }
        }
        Ok(())
    }
}

fn kafka_error(context: &'static str, error: rdkafka::error::KafkaError) -> crate::source::SourceError {
    use rdkafka::error::KafkaError;
    let transient = match &error {
        KafkaError::MessageConsumptionFatal(_) | KafkaError::ClientCreation(_) | KafkaError::ClientConfig(..) => false,
        other => other.rdkafka_error_code().is_none_or(|code| {
            !matches!(
                code,
                rdkafka::types::RDKafkaErrorCode::UnknownMemberId
                    | rdkafka::types::RDKafkaErrorCode::IllegalGeneration
                    | rdkafka::types::RDKafkaErrorCode::Fenced
                    | rdkafka::types::RDKafkaErrorCode::TopicAuthorizationFailed
                    | rdkafka::types::RDKafkaErrorCode::GroupAuthorizationFailed
            )
        }),
    };
    if transient {
        crate::source::SourceError::transient(context, error)
    } else {
        crate::source::SourceError::permanent(context, error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_commit_is_refused_by_name() {
        let base = KafkaConfig::new("127.0.0.1:9092", &["t"]);
        base.validate().unwrap();
        let err = base.clone().set("enable.auto.commit", "true").validate().unwrap_err().to_string();
        assert!(err.contains("enable.auto.commit=true"), "{err}");
        let err = base.clone().set("enable.auto.offset.store", "TRUE").validate().unwrap_err().to_string();
        assert!(err.contains("enable.auto.offset.store"), "{err}");
        base.clone().set("enable.auto.commit", "false").validate().unwrap();
        assert!(base.clone().set("group.id", "x").validate().is_err());
        let mut two = KafkaConfig::new("b", &["a", "b"]);
        two.stop_at_end = true;
        assert!(two.validate().is_err());
    }
}
