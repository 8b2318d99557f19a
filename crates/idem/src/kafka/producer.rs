//! A small producer helper: idempotent (`enable.idempotence=true`, `acks=all`), and every event carries a
//! producer-assigned id in the `idem-event-id` header (UUIDv7 unless the caller gives one), as document 000's
//! failure table advises. Consume such events with `KeyExtractor::Header("idem-event-id")`.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use super::kafka_error;
use crate::message::Message;
use crate::source::{Publisher, SourceError};

/// The header holding the producer-assigned event id.
pub const EVENT_ID_HEADER: &str = "idem-event-id";

/// An idempotent Kafka producer that stamps event ids.
pub struct KafkaProducer {
    producer: FutureProducer,
}

impl KafkaProducer {
    /// Connects to `brokers` with idempotence on.
    pub fn new(brokers: &str) -> Result<Self, SourceError> {
        Self::with_settings(brokers, &BTreeMap::new())
    }

    /// Connects with further librdkafka settings; idempotence cannot be turned off.
    pub fn with_settings(brokers: &str, settings: &BTreeMap<String, String>) -> Result<Self, SourceError> {
        if settings.get("enable.idempotence").is_some_and(|v| v.trim() == "false") {
            return Err(SourceError::permanent(
                "kafka producer",
                "enable.idempotence=false is refused: producer retries would write duplicates; remove the setting",
            ));
        }
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", brokers).set("enable.idempotence", "true").set("acks", "all");
        for (key, value) in settings {
            config.set(key, value);
        }
        let producer = config.create().map_err(|e| SourceError::permanent("kafka producer", e))?;
        Ok(KafkaProducer { producer })
    }

    /// Sends one event and waits for the broker's acknowledgement. Adds an `idem-event-id` header (a new
    /// UUIDv7) unless `headers` already has one. Returns the partition, the offset and the event id.
    pub async fn send(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<(i32, i64, String), SourceError> {
        let mut owned = OwnedHeaders::new_with_capacity(headers.len() + 1);
        for (name, value) in headers {
            owned = owned.insert(Header { key: name, value: Some(value) });
        }
        let event_id = match headers.iter().find(|(n, _)| n == EVENT_ID_HEADER) {
            Some((_, id)) => String::from_utf8_lossy(id).into_owned(),
            None => {
                let id = uuid::Uuid::now_v7().to_string();
                owned = owned.insert(Header { key: EVENT_ID_HEADER, value: Some(&id) });
                id
            }
        };
        let mut record = FutureRecord::<[u8], [u8]>::to(topic).payload(payload).headers(owned);
        if let Some(key) = key {
            record = record.key(key);
        }
        let delivery = self
            .producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(error, _)| kafka_error("kafka produce", error))?;
        Ok((delivery.partition, delivery.offset, event_id))
    }

    /// Waits until every queued message is acknowledged.
    pub fn flush(&self) -> Result<(), SourceError> {
        self.producer.flush(Duration::from_secs(30)).map_err(|e| kafka_error("kafka flush", e))
    }
}

impl Publisher for KafkaProducer {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        self.send(&message.topic, message.key.as_deref(), &message.payload, &message.headers).await.map(drop)
    }
}
