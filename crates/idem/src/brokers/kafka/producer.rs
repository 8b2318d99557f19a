//! A small producer helper: idempotent (`enable.idempotence=true`, `acks=all`), and every event carries a
//! producer-assigned id in the `idem-event-id` header (UUIDv7 unless the caller gives one), as the markers'
//! failure table advises. Consume such events with `KeyExtractor::Header("idem-event-id")`.
//!
//! Each event also carries the producer's id and its sequence number in the partition (`idem-producer-id`,
//! `idem-seq`), so consumers can count events that were lost on the way ([`crate::gap`]). The helper picks the
//! partition itself, as librdkafka's default partitioner does (CRC-32 of the key modulo the partition count;
//! round-robin without a key), and numbers the events of each partition in the order it enqueues them.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use super::kafka_error;
use crate::gap::{PRODUCER_ID_HEADER, SEQUENCE_HEADER};
use crate::message::Message;
use crate::source::{Publisher, SourceError};

pub use crate::message::EVENT_ID_HEADER;

/// An idempotent Kafka producer that stamps event ids and per-partition sequence numbers.
pub struct KafkaProducer {
    producer: FutureProducer,
    id: String,
    state: Mutex<Sequencing>,
}

#[derive(Default)]
struct Sequencing {
    partitions: HashMap<String, i32>,
    next: HashMap<(String, i32), u64>,
    round_robin: u32,
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
        Ok(KafkaProducer { producer, id: uuid::Uuid::now_v7().to_string(), state: Mutex::new(Sequencing::default()) })
    }

    /// This producer's id, stamped in the `idem-producer-id` header.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The topic's partition count, read from the broker once and cached.
    async fn partition_count(&self, topic: &str) -> Result<i32, SourceError> {
        if let Some(&n) = lock(&self.state).partitions.get(topic) {
            return Ok(n);
        }
        let (producer, name) = (self.producer.clone(), topic.to_owned());
        let metadata =
            tokio::task::spawn_blocking(move || producer.client().fetch_metadata(Some(&name), Duration::from_secs(10)))
                .await
                .map_err(|e| SourceError::transient("kafka metadata", e))?
                .map_err(|e| kafka_error("kafka metadata", e))?;
        let n = metadata.topics().first().map_or(0, |t| t.partitions().len() as i32);
        if n == 0 {
            return Err(SourceError::transient("kafka metadata", format!("topic {topic} has no partitions (yet)")));
        }
        lock(&self.state).partitions.insert(topic.to_owned(), n);
        Ok(n)
    }

    /// Sends one event and waits for the broker's acknowledgement. Adds an `idem-event-id` header (a new
    /// UUIDv7) unless `headers` already has one, and the producer id and sequence number unless `headers`
    /// already carry a producer id (a replayed message keeps its original stamps). Returns the partition, the
    /// offset and the event id.
    pub async fn send(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<(i32, i64, String), SourceError> {
        let headers = &*crate::propagation::with_current(headers);
        let partitions = self.partition_count(topic).await?;
        let mut owned = OwnedHeaders::new_with_capacity(headers.len() + 3);
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
        let stamped = headers.iter().any(|(n, _)| n == PRODUCER_ID_HEADER);
        let delivery = {
            // Sequence numbers are taken and the record enqueued under one lock, so numbers follow the order
            // of the partition (the idempotent producer keeps enqueue order through retries).
            let mut state = lock(&self.state);
            let partition = match key {
                Some(key) => (crc32fast::hash(key) % partitions as u32) as i32,
                None => {
                    state.round_robin = state.round_robin.wrapping_add(1);
                    (state.round_robin % partitions as u32) as i32
                }
            };
            if !stamped {
                let next = state.next.entry((topic.to_owned(), partition)).or_insert(0);
                *next += 1;
                let seq = next.to_string();
                owned = owned.insert(Header { key: PRODUCER_ID_HEADER, value: Some(&self.id) });
                owned = owned.insert(Header { key: SEQUENCE_HEADER, value: Some(&seq) });
            }
            let mut record = FutureRecord::<[u8], [u8]>::to(topic).payload(payload).headers(owned).partition(partition);
            if let Some(key) = key {
                record = record.key(key);
            }
            self.producer.send_result(record).map_err(|(error, _)| kafka_error("kafka produce", error))?
        };
        let (partition, offset) = delivery
            .await
            .map_err(|_| SourceError::transient("kafka produce", "the producer was closed before delivery"))?
            .map(|d| (d.partition, d.offset))
            .map_err(|(error, _)| kafka_error("kafka produce", error))?;
        Ok((partition, offset, event_id))
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

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
