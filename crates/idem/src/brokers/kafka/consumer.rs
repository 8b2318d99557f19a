//! The Kafka source: a librdkafka consumer polled on a thread of its own, whose messages, revocations and end
//! reach the engine through one ordered channel.
//!
//! Revocation: librdkafka calls the rebalance callback on the polling thread before it lets partitions go. The
//! callback puts a [`Received::Revoked`] into the channel (after every message already handed out) and waits
//! until the engine has drained those partitions, then commits their acknowledged offsets synchronously and
//! returns; only then are the partitions released. A consumer that lost its membership gets its late commits
//! refused by the broker; its database work is still deduplicated by the markers.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Headers, Message as _};
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use tokio::sync::mpsc;

use super::{KafkaConfig, kafka_error, topic_retention_ms};
use crate::error::Error;
use crate::message::Message;
use crate::source::{Acknowledgement, Drained, Partition, PausePartitions, Received, Source, SourceError};

type Delivery = Result<Option<Received>, SourceError>;

/// Called with the whole assignment after every rebalance.
pub type AssignmentObserver = Arc<dyn Fn(&[Partition]) + Send + Sync>;

struct Shared {
    group: String,
    tx: mpsc::Sender<Delivery>,
    stop: AtomicBool,
    closing: AtomicBool,
    stop_at_end: bool,
    drain_timeout: Duration,
    assigned: Mutex<HashSet<Partition>>,
    revoking: Mutex<HashSet<Partition>>,
    acked: Mutex<HashMap<Partition, i64>>,
    at_end: Mutex<HashSet<i32>>,
    observer: Option<AssignmentObserver>,
}

struct Context(Arc<Shared>);

impl ClientContext for Context {
    /// librdkafka's statistics (every `statistics.interval.ms`, 10 s unless set): the lag of every partition
    /// this consumer owns, in messages between the partition's end and the committed offset.
    fn stats(&self, statistics: rdkafka::Statistics) {
        let assigned = lock(&self.0.assigned);
        for (topic, stats) in &statistics.topics {
            for (&partition, p) in &stats.partitions {
                let owned = assigned.contains(&Partition { topic: topic.clone(), partition });
                if partition < 0 || !owned || p.consumer_lag < 0 {
                    continue;
                }
                crate::lag::record(&self.0.group, topic, Some(partition), p.consumer_lag);
            }
        }
    }
}

impl ConsumerContext for Context {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let shared = &self.0;
        match rebalance {
            Rebalance::Revoke(list) => {
                let partitions = partitions_of(list);
                let lost = consumer.assignment_lost();
                tracing::info!(?partitions, lost, "kafka: partitions revoked; draining");
                for p in &partitions {
                    crate::lag::forget(&shared.group, &p.topic, p.partition);
                }
                // Messages of these partitions still queued for the engine are dropped from here on: they are
                // unacknowledged, and the next owner gets them from the last commit.
                lock(&shared.revoking).extend(partitions.iter().cloned());
                if !shared.closing.load(Ordering::SeqCst) {
                    let (drained, mut done) = Drained::channel();
                    let revoked = Received::Revoked { partitions: partitions.clone(), drained };
                    if shared.tx.blocking_send(Ok(Some(revoked))).is_ok() {
                        let deadline = Instant::now() + shared.drain_timeout;
                        while done.try_recv() == Err(tokio::sync::oneshot::error::TryRecvError::Empty) {
                            if Instant::now() > deadline {
                                tracing::warn!(?partitions, "kafka: drain timed out; letting the partitions go");
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    }
                }
                if lost {
                    // The group already gave them away: a commit would be refused.
                    tracing::warn!(?partitions, "kafka: assignment lost; their in-flight work will be redelivered");
                } else {
                    commit_acked(consumer, shared, &partitions, CommitMode::Sync);
                }
                let mut assigned = lock(&shared.assigned);
                let mut acked = lock(&shared.acked);
                for p in &partitions {
                    assigned.remove(p);
                    acked.remove(p);
                    lock(&shared.at_end).remove(&p.partition);
                }
                drop((assigned, acked));
                let mut revoking = lock(&shared.revoking);
                for p in &partitions {
                    revoking.remove(p);
                }
            }
            Rebalance::Assign(list) => {
                let partitions = partitions_of(list);
                tracing::info!(?partitions, "kafka: partitions assigned");
                let mut acked = lock(&shared.acked);
                for p in &partitions {
                    // Whatever was acknowledged before an earlier revocation is stale now.
                    acked.remove(p);
                }
                drop(acked);
                lock(&shared.assigned).extend(partitions);
            }
            Rebalance::Error(error) => tracing::warn!(%error, "kafka: rebalance error"),
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, _rebalance: &Rebalance<'_>) {
        if let Some(observer) = &self.0.observer {
            let mut assigned: Vec<Partition> = lock(&self.0.assigned).iter().cloned().collect();
            assigned.sort();
            observer(&assigned);
        }
    }

    fn commit_callback(&self, result: rdkafka::error::KafkaResult<()>, offsets: &TopicPartitionList) {
        if let Err(error) = result {
            tracing::warn!(%error, offsets = ?partitions_of(offsets),
                "kafka: offset commit failed; those messages will be delivered again and absorbed as duplicates");
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn partitions_of(list: &TopicPartitionList) -> Vec<Partition> {
    list.elements().iter().map(|e| Partition { topic: e.topic().to_owned(), partition: e.partition() }).collect()
}

/// Commits the acknowledged offsets of `partitions`.
fn commit_acked(consumer: &BaseConsumer<Context>, shared: &Shared, partitions: &[Partition], mode: CommitMode) {
    let acked = lock(&shared.acked);
    let mut list = TopicPartitionList::new();
    for p in partitions {
        if let Some(&next) = acked.get(p)
            && let Err(error) = list.add_partition_offset(&p.topic, p.partition, Offset::Offset(next))
        {
            tracing::warn!(%error, "kafka: cannot build the offset list");
        }
    }
    drop(acked);
    if list.count() > 0
        && let Err(error) = consumer.commit(&list, mode)
    {
        tracing::warn!(%error, "kafka: committing drained offsets failed; they will be delivered again");
    }
}

/// Consumes Kafka topics as a [`Source`]. See the module documentation for the revocation protocol.
pub struct KafkaSource {
    consumer: Arc<BaseConsumer<Context>>,
    shared: Arc<Shared>,
    rx: tokio::sync::Mutex<mpsc::Receiver<Delivery>>,
    poller: Option<JoinHandle<()>>,
}

impl KafkaSource {
    /// Validates `config`, runs the retention guard against every topic with `engine`'s marker retention,
    /// joins `engine.group`, subscribes and starts polling.
    pub async fn connect(config: &KafkaConfig, engine: &crate::Config) -> Result<Self, Error> {
        Self::connect_observed(config, engine, None).await
    }

    /// Like [`KafkaSource::connect`], calling `observer` with the whole assignment after every rebalance.
    pub async fn connect_observed(
        config: &KafkaConfig,
        engine: &crate::Config,
        observer: Option<AssignmentObserver>,
    ) -> Result<Self, Error> {
        config.validate()?;
        engine.validate()?;
        retention_guard(config, engine).await?;

        let (tx, rx) = mpsc::channel(1024);
        let shared = Arc::new(Shared {
            group: engine.group.clone(),
            tx,
            stop: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            stop_at_end: config.stop_at_end,
            drain_timeout: config.drain_timeout,
            assigned: Mutex::new(HashSet::new()),
            revoking: Mutex::new(HashSet::new()),
            acked: Mutex::new(HashMap::new()),
            at_end: Mutex::new(HashSet::new()),
            observer,
        });
        let mut client = ClientConfig::new();
        client
            .set("bootstrap.servers", &config.brokers)
            .set("group.id", &engine.group)
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", if config.stop_at_end { "true" } else { "false" })
            .set("statistics.interval.ms", "10000");
        for (key, value) in &config.settings {
            client.set(key, value);
        }
        // Last, so nothing can turn them back on.
        client.set("enable.auto.commit", "false").set("enable.auto.offset.store", "false");
        let consumer: BaseConsumer<Context> = client
            .create_with_context(Context(Arc::clone(&shared)))
            .map_err(|e| Error::Config(format!("kafka consumer: {e}")))?;
        let topics: Vec<&str> = config.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics).map_err(|e| Error::Source(kafka_error("kafka subscribe", e)))?;
        let consumer = Arc::new(consumer);
        let poller = {
            let (consumer, shared) = (Arc::clone(&consumer), Arc::clone(&shared));
            std::thread::Builder::new()
                .name("idem-kafka-poll".into())
                .spawn(move || poll_loop(&consumer, &shared))
                .map_err(|e| Error::Config(format!("cannot start the kafka polling thread: {e}")))?
        };
        Ok(KafkaSource { consumer, shared, rx: tokio::sync::Mutex::new(rx), poller: Some(poller) })
    }

    fn revoking(&self, message: &Message) -> bool {
        let revoking = lock(&self.shared.revoking);
        !revoking.is_empty()
            && revoking.contains(&Partition { topic: message.topic.clone(), partition: message.partition })
    }

    /// The partitions assigned to this consumer now.
    pub fn assignment(&self) -> Vec<Partition> {
        let mut assigned: Vec<Partition> = lock(&self.shared.assigned).iter().cloned().collect();
        assigned.sort();
        assigned
    }
}

/// What a consumer of `config` needs from the cluster, checked without joining its group: the brokers answer
/// (with the configured security settings), each topic exists, and keeps messages longer than `engine`'s markers.
/// `idem check` runs it; [`KafkaSource::connect`] meets the same faults when it starts.
pub async fn check(config: &KafkaConfig, engine: &crate::Config) -> Result<(), Error> {
    config.validate()?;
    engine.validate()?;
    let mut client = ClientConfig::new();
    client.set("bootstrap.servers", &config.brokers);
    for (key, value) in &config.settings {
        client.set(key, value);
    }
    let probe: BaseConsumer =
        client.create().map_err(|e| Error::Config(format!("kafka client for {}: {e}", config.brokers)))?;
    let metadata = tokio::task::spawn_blocking(move || probe.fetch_metadata(None, Duration::from_secs(10)))
        .await
        .map_err(|e| Error::Config(format!("kafka metadata request: {e}")))?
        .map_err(|e| Error::Connect { target: format!("kafka {}", config.brokers), reason: e.to_string() })?;
    for topic in &config.topics {
        use rdkafka::types::RDKafkaErrorCode;
        let found = metadata.topics().iter().find(|t| t.name() == topic);
        let fault = match found.map(|t| (t.error().map(RDKafkaErrorCode::from), t.partitions().is_empty())) {
            Some((None, false)) => continue,
            None | Some((None, true) | (Some(RDKafkaErrorCode::UnknownTopicOrPartition), _)) => format!(
                "it does not exist on {}: create it (kafka-topics.sh --create --topic {topic}), or fix its name",
                config.brokers
            ),
            Some((Some(RDKafkaErrorCode::TopicAuthorizationFailed), _)) => {
                "this client may not describe it (topic authorization failed): grant it Describe and Read".into()
            }
            Some((Some(code), _)) => code.to_string(),
        };
        return Err(Error::Config(format!("kafka topic `{topic}`: {fault}")));
    }
    retention_guard(config, engine).await
}

/// The retention guard: every topic keeps its messages longer than the markers are kept.
async fn retention_guard(config: &KafkaConfig, engine: &crate::Config) -> Result<(), Error> {
    let mut retentions = Vec::with_capacity(config.topics.len());
    for topic in &config.topics {
        let retention = match topic_retention_ms(&config.brokers, topic).await {
            Ok(retention) => retention,
            Err(error) => {
                tracing::warn!(topic, %error, "kafka: cannot read the topic's retention.ms");
                None
            }
        };
        if let Some(ms) = retention.filter(|ms| *ms >= 0) {
            metrics::gauge!("idem_kafka_topic_retention_seconds", "topic" => topic.clone()).set(ms as f64 / 1000.0);
        }
        retentions.push((topic.clone(), retention));
    }
    let policy = crate::retention::RetentionPolicy {
        marker_retention: engine.pruning.retention,
        accept_infinite_retention: config.accept_infinite_topic_retention,
        broker: crate::retention::KAFKA_TOPIC,
    };
    policy.check(&retentions)?;
    Ok(())
}

fn poll_loop(consumer: &BaseConsumer<Context>, shared: &Shared) {
    while !shared.stop.load(Ordering::SeqCst) {
        let delivery = match consumer.poll(Duration::from_millis(100)) {
            None => continue,
            Some(Ok(message)) => {
                lock(&shared.at_end).remove(&message.partition());
                Ok(Some(Received::Message(owned(&message))))
            }
            Some(Err(KafkaError::PartitionEOF(partition))) => {
                if !shared.stop_at_end {
                    continue;
                }
                let mut at_end = lock(&shared.at_end);
                at_end.insert(partition);
                let assigned = lock(&shared.assigned);
                if assigned.is_empty() || !assigned.iter().all(|p| at_end.contains(&p.partition)) {
                    continue;
                }
                tracing::info!("kafka: every assigned partition is at its end");
                Ok(None)
            }
            Some(Err(error)) => {
                tracing::warn!(%error, "kafka: consumer error");
                let error = kafka_error("kafka consume", error);
                if error.retry() == crate::Retry::Helps {
                    continue;
                }
                Err(error)
            }
        };
        let end = matches!(delivery, Ok(None) | Err(_));
        if shared.tx.blocking_send(delivery).is_err() || end {
            break;
        }
    }
}

fn owned(message: &BorrowedMessage<'_>) -> Message {
    let headers = message
        .headers()
        .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec).unwrap_or_default())).collect())
        .unwrap_or_default();
    Message {
        topic: message.topic().to_owned(),
        partition: message.partition(),
        offset: message.offset(),
        key: message.key().map(<[u8]>::to_vec),
        payload: message.payload().map(<[u8]>::to_vec).unwrap_or_default(),
        headers,
        timestamp_ms: message.timestamp().to_millis(),
        ack_handle: None,
        dead_letter_reason: None,
    }
}

impl Source for KafkaSource {
    const SYSTEM: &'static str = "kafka";

    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        let mut rx = self.rx.lock().await;
        loop {
            match rx.recv().await {
                Some(Ok(Some(Received::Message(message)))) if self.revoking(&message) => continue,
                Some(delivery) => return delivery,
                None => return Ok(None),
            }
        }
    }

    fn pausing(&self) -> Option<&dyn PausePartitions> {
        Some(self)
    }

    async fn ack(&self, ack: &Acknowledgement) -> Result<(), SourceError> {
        let (topic, partition, offset) = (ack.partition.topic.as_str(), ack.partition.partition, ack.last_offset);
        let key = ack.partition.clone();
        if !lock(&self.shared.assigned).contains(&key) {
            return Err(SourceError::permanent(
                "kafka ack",
                format!(
                    "{topic}/{partition} is no longer assigned to this consumer; its new owner redelivers from the last commit"
                ),
            ));
        }
        lock(&self.shared.acked).insert(key, offset + 1);
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(topic, partition, Offset::Offset(offset + 1))
            .map_err(|e| kafka_error("kafka ack", e))?;
        self.consumer.commit(&list, CommitMode::Async).map_err(|e| kafka_error("kafka commit", e))
    }
}

/// Kafka's own pause: the client stops fetching the partitions and, on resume, fetches from the message after the
/// last one it handed out.
impl PausePartitions for KafkaSource {
    fn pause(&self, partitions: &[Partition]) -> Result<(), SourceError> {
        self.consumer.pause(&list_of(partitions)?).map_err(|e| kafka_error("kafka pause", e))
    }

    fn resume(&self, partitions: &[Partition]) -> Result<(), SourceError> {
        self.consumer.resume(&list_of(partitions)?).map_err(|e| kafka_error("kafka resume", e))
    }
}

fn list_of(partitions: &[Partition]) -> Result<TopicPartitionList, SourceError> {
    let mut list = TopicPartitionList::new();
    for p in partitions {
        list.add_partition(&p.topic, p.partition);
    }
    Ok(list)
}

impl Drop for KafkaSource {
    /// Stops polling, commits what was acknowledged, and leaves the group (the revocation this causes does not
    /// wait for an engine that is gone).
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.closing.store(true, Ordering::SeqCst);
        self.rx.get_mut().close();
        while let Ok(_undelivered) = self.rx.get_mut().try_recv() {}
        if let Some(poller) = self.poller.take() {
            let _ = poller.join();
        }
        let assigned: Vec<Partition> = lock(&self.shared.assigned).iter().cloned().collect();
        commit_acked(&self.consumer, &self.shared, &assigned, CommitMode::Sync);
    }
}
