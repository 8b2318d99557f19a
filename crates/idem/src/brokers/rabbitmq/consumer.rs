//! The RabbitMQ source: one connection and channel, one consumer per queue, deliveries merged into one channel
//! of their own; each delivery acknowledged by its own tag after its transaction commits, its offset derived from
//! the message (`stable_offset`), never from the tag.

use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use tokio::sync::mpsc;

use super::{MESSAGE_ID_HEADER, RabbitConfig, answer, connect};
use crate::error::Error;
use crate::message::{AckHandle, Message};
use crate::source::{Acknowledgement, Drained, Partition, Received, Source, SourceError};

/// How long `recv` waits for a delivery before it checks whether the queues are empty (with `stop_at_end`) and
/// whether the connection is still up.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// What a queue's consumer task hands on.
enum Arrival {
    Delivery(String, Box<Delivery>),
    /// The consumer stream failed or ended: the connection, the channel or the consumer is gone.
    Lost(String),
}

/// A channel, where its consumers' deliveries arrive, and the consumers' tasks.
type Consuming = (lapin::Channel, mpsc::Receiver<Arrival>, Vec<tokio::task::JoinHandle<()>>);

/// A connection with its channel and the consumers of every queue.
struct Session {
    connection: lapin::Connection,
    channel: lapin::Channel,
    arrivals: mpsc::Receiver<Arrival>,
    consumers: Vec<tokio::task::JoinHandle<()>>,
}

impl Session {
    /// Stops the consumers and closes the connection.
    async fn close(self) {
        for consumer in &self.consumers {
            consumer.abort();
        }
        close(&self.connection).await;
    }

    /// Why the connection or the channel is no longer usable, if it is not.
    fn broken(&self) -> Option<String> {
        if !self.connection.status().connected() {
            return Some("the connection is no longer open".to_owned());
        }
        if !self.channel.status().connected() {
            return Some("the channel is no longer open".to_owned());
        }
        None
    }
}

/// Closes `connection` when it is still up (a dead one is left to drop: asking it to close could wait for an
/// answer that never comes).
async fn close(connection: &lapin::Connection) {
    if connection.status().connected() {
        let _ = answer("rabbitmq close", connection.close(200, "idem: reconnecting".into())).await;
    }
}

/// Consumes RabbitMQ queues as a [`Source`]. See the module documentation of [`crate::rabbitmq`].
pub struct RabbitSource {
    config: RabbitConfig,
    prefetch: u16,
    session: tokio::sync::Mutex<Option<Session>>,
    /// Reads each queue's backlog every [`BACKLOG_EVERY`] into [`crate::lag`].
    backlog: tokio::task::JoinHandle<()>,
}

/// How often the queues' backlog (their ready messages) is read.
const BACKLOG_EVERY: Duration = Duration::from_secs(15);

/// Records the ready messages of each queue as consumer group `group`'s lag, on a connection of its own (a
/// passive declaration, which takes nothing), every [`BACKLOG_EVERY`], until aborted.
async fn watch_backlog(url: String, queues: Vec<String>, group: String) {
    let mut connection: Option<lapin::Connection> = None;
    loop {
        if connection.as_ref().is_none_or(|c| !c.status().connected()) {
            connection = connect(&url).await.ok();
        }
        if let Some(open) = &connection
            && let Ok(channel) = answer("rabbitmq channel", open.create_channel()).await
        {
            for queue in &queues {
                let options = QueueDeclareOptions { passive: true, ..Default::default() };
                let declaring = channel.queue_declare(queue.as_str().into(), options, FieldTable::default());
                if let Ok(declared) = answer("rabbitmq queue.declare", declaring).await {
                    crate::lag::record(&group, queue, None, i64::from(declared.message_count()));
                }
            }
            let _ = answer("rabbitmq channel close", channel.close(200, "".into())).await;
        }
        tokio::time::sleep(BACKLOG_EVERY).await;
    }
}

impl RabbitSource {
    /// Validates `config`, connects (naming the server and the cause when it cannot), checks that every queue
    /// exists (naming the missing one) and starts consuming with manual acknowledgement.
    pub async fn connect(config: &RabbitConfig, engine: &crate::Config) -> Result<Self, Error> {
        config.validate()?;
        engine.validate()?;
        if engine.key == crate::KeyExtractor::BrokerId {
            return Err(Error::Config(format!(
                "rabbitmq: the broker-id key is refused: RabbitMQ numbers deliveries per channel, from 1 again on \
                 each connection, so two different messages would share an id and the second would be skipped as a \
                 duplicate. Fix: key on the producer's event id (header:idem-event-id), a business key in the payload \
                 (json:/…), or the message's `message_id` property (header:{MESSAGE_ID_HEADER})"
            )));
        }
        super::check(config).await?;
        let prefetch = config.prefetch.unwrap_or_else(|| engine.batch_size.clamp(1, usize::from(u16::MAX)) as u16);
        let backlog = tokio::spawn(watch_backlog(config.url.clone(), config.queues.clone(), engine.group.clone()));
        let source = RabbitSource { config: config.clone(), prefetch, session: tokio::sync::Mutex::new(None), backlog };
        let session = source.open().await.map_err(|e| Error::Config(e.to_string()))?;
        *source.session.lock().await = Some(session);
        tracing::info!(queues = ?config.queues, prefetch, "rabbitmq: consuming");
        Ok(source)
    }

    /// Connects, sets the prefetch and starts a consumer on every queue.
    async fn open(&self) -> Result<Session, SourceError> {
        let connection = connect(&self.config.url).await.map_err(|e| SourceError::transient("rabbitmq connect", e))?;
        match self.consume(&connection).await {
            Ok((channel, arrivals, consumers)) => Ok(Session { connection, channel, arrivals, consumers }),
            Err(error) => {
                // Its consumers, if some started, end with the connection.
                close(&connection).await;
                Err(error)
            }
        }
    }

    /// On `connection`: a channel with the prefetch, and a consumer on every queue feeding one channel of arrivals.
    async fn consume(&self, connection: &lapin::Connection) -> Result<Consuming, SourceError> {
        let channel = answer("rabbitmq channel", connection.create_channel()).await?;
        answer("rabbitmq basic.qos", channel.basic_qos(self.prefetch, BasicQosOptions { global: false })).await?;
        let (tx, arrivals) = mpsc::channel(usize::from(self.prefetch) * self.config.queues.len() + 16);
        let mut consumers = Vec::with_capacity(self.config.queues.len());
        for queue in &self.config.queues {
            let options = BasicConsumeOptions { no_ack: false, ..Default::default() };
            let consuming = channel.basic_consume(queue.as_str().into(), "".into(), options, FieldTable::default());
            let mut consumer =
                answer("rabbitmq basic.consume", async { consuming.await.map_err(|e| format!("queue {queue}: {e}")) })
                    .await?;
            let (tx, queue) = (tx.clone(), queue.clone());
            consumers.push(tokio::spawn(async move {
                while let Some(delivery) = consumer.next().await {
                    let arrival = match delivery {
                        Ok(delivery) => Arrival::Delivery(queue.clone(), Box::new(delivery)),
                        Err(e) => Arrival::Lost(format!("queue {queue}: {e}")),
                    };
                    let lost = matches!(arrival, Arrival::Lost(_));
                    if tx.send(arrival).await.is_err() || lost {
                        return;
                    }
                }
                let _ = tx.send(Arrival::Lost(format!("the consumer of queue {queue} was cancelled"))).await;
            }));
        }
        Ok((channel, arrivals, consumers))
    }

    /// Whether every queue is empty (ready messages; what this consumer holds is drained by the engine).
    async fn all_empty(&self, session: &Session) -> Result<bool, SourceError> {
        for queue in &self.config.queues {
            let options = QueueDeclareOptions { passive: true, ..Default::default() };
            let declaring = session.channel.queue_declare(queue.as_str().into(), options, FieldTable::default());
            let declared = answer("rabbitmq queue.declare", declaring).await?;
            if declared.message_count() > 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn partitions(&self) -> Vec<Partition> {
        self.config.queues.iter().map(|q| Partition { topic: q.clone(), partition: 0 }).collect()
    }
}

fn to_message(queue: String, delivery: Delivery, delivery_limit: Option<u32>) -> Message {
    if delivery.redelivered {
        metrics::counter!("idem_rabbitmq_redelivered_total", "queue" => queue.clone()).increment(1);
    }
    let mut headers = delivery.properties.headers().as_ref().map(header_pairs).unwrap_or_default();
    let message_id = delivery.properties.message_id().as_ref().map(|id| id.as_str().to_owned());
    let offset = stable_offset(message_id.as_deref(), &delivery.routing_key, &delivery.data);
    if let Some(id) = message_id {
        headers.push((MESSAGE_ID_HEADER.to_owned(), id.into_bytes()));
    }
    let timestamp_ms = delivery.properties.timestamp().map(|seconds| (seconds as i64).saturating_mul(1000));
    let dead_letter_reason = last_delivery(&headers, delivery_limit);
    Message {
        topic: queue,
        partition: 0,
        offset,
        key: Some(delivery.routing_key.as_str().as_bytes().to_vec()),
        payload: delivery.data,
        headers,
        timestamp_ms,
        ack_handle: Some(AckHandle::new(delivery.acker)),
        dead_letter_reason,
    }
}

/// A message's offset, the same on every delivery of it: RabbitMQ has no offsets, and its delivery tags start
/// again from 1 on each channel. 63 bits of SHA-256 of the `message_id` property, or, without one, of the routing
/// key and the body. A keyless message that fails for good thus keeps one dead-letter row however often it comes
/// back, and two different ones never share a row.
fn stable_offset(message_id: Option<&str>, routing_key: &lapin::types::ShortString, body: &[u8]) -> i64 {
    use sha2::Digest;
    let digest = match message_id {
        Some(id) => sha2::Sha256::new().chain_update(b"id:").chain_update(id.as_bytes()).finalize(),
        None => sha2::Sha256::new()
            .chain_update(b"body:")
            .chain_update(routing_key.as_str().as_bytes())
            .chain_update([0u8])
            .chain_update(body)
            .finalize(),
    };
    crate::store::offset_from_digest(&digest)
}

/// The reason to dead-letter a delivery whose `x-delivery-count` (a quorum queue's count of earlier failed
/// deliveries) has reached the queue's delivery limit: one more failure and RabbitMQ drops it.
fn last_delivery(headers: &[(String, Vec<u8>)], delivery_limit: Option<u32>) -> Option<String> {
    let limit = delivery_limit?;
    let (_, count) = headers.iter().find(|(name, _)| name == "x-delivery-count")?;
    let count: u64 = std::str::from_utf8(count).ok()?.parse().ok()?;
    (count >= u64::from(limit)).then(|| {
        format!(
            "delivered {} times, past the queue's delivery limit ({limit}): RabbitMQ would drop it on the next \
             failure, so idem kept it as a dead letter instead of calling the handler (a message that crashes the \
             consumer ends here). Replay it with idem dead-letters replay --rabbitmq URL once the cause is fixed",
            count + 1
        )
    })
}

/// The headers that carry text or bytes, as (name, bytes); numbers and booleans as their text.
fn header_pairs(table: &FieldTable) -> Vec<(String, Vec<u8>)> {
    table
        .inner()
        .iter()
        .filter_map(|(name, value)| {
            let bytes = match value {
                AMQPValue::LongString(s) => s.as_bytes().to_vec(),
                AMQPValue::ShortString(s) => s.as_str().as_bytes().to_vec(),
                AMQPValue::ByteArray(b) => b.as_slice().to_vec(),
                AMQPValue::Boolean(b) => b.to_string().into_bytes(),
                AMQPValue::LongLongInt(n) => n.to_string().into_bytes(),
                AMQPValue::LongInt(n) => n.to_string().into_bytes(),
                AMQPValue::LongUInt(n) => n.to_string().into_bytes(),
                _ => return None,
            };
            Some((name.as_str().to_owned(), bytes))
        })
        .collect()
}

impl Source for RabbitSource {
    const SYSTEM: &'static str = "rabbitmq";

    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        let mut session = self.session.lock().await;
        loop {
            let current = match session.as_mut() {
                Some(current) => current,
                None => {
                    let opened = self.open().await?;
                    tracing::info!(queues = ?self.config.queues, "rabbitmq: connected again, consuming");
                    session.insert(opened)
                }
            };
            let lost = match tokio::time::timeout(IDLE_CHECK, current.arrivals.recv()).await {
                Ok(Some(Arrival::Delivery(queue, delivery))) => {
                    return Ok(Some(Received::Message(to_message(queue, *delivery, self.config.delivery_limit))));
                }
                Ok(Some(Arrival::Lost(reason))) => reason,
                Ok(None) => "every consumer ended".to_owned(),
                Err(_idle) => match current.broken() {
                    // A connection can die without its consumers hearing of it: checked on every idle second.
                    Some(reason) => reason,
                    None if self.config.stop_at_end && self.all_empty(current).await? => {
                        tracing::info!(queues = ?self.config.queues, "rabbitmq: every queue is empty");
                        return Ok(None);
                    }
                    None => continue,
                },
            };
            tracing::warn!(reason = %lost, "rabbitmq: connection, channel or consumer lost; draining, then connecting again");
            if let Some(old) = session.take() {
                old.close().await;
            }
            // The engine drains these partitions before it asks for the next message; the broker has put back
            // what this channel held, so nothing waits on the drain here.
            let (drained, _done) = Drained::channel();
            return Ok(Some(Received::Revoked { partitions: self.partitions(), drained }));
        }
    }

    async fn ack(&self, ack: &Acknowledgement) -> Result<(), SourceError> {
        for handle in &ack.handles {
            let Some(acker) = handle.get::<lapin::Acker>() else {
                return Err(SourceError::permanent("rabbitmq ack", "a handle that is not a RabbitMQ delivery"));
            };
            let sent = if self.config.dead_letter_exchange && ack.dead_lettered.contains(handle) {
                // Rejected without requeue: RabbitMQ routes it to the queue's x-dead-letter-exchange (or drops it
                // when the queue has none), after idem's own dead-letter row committed.
                answer("rabbitmq reject", acker.reject(BasicRejectOptions { requeue: false })).await?
            } else {
                answer("rabbitmq ack", acker.ack(BasicAckOptions { multiple: false })).await?
            };
            if !sent {
                return Err(SourceError::transient(
                    "rabbitmq ack",
                    "the channel that delivered the message is gone; RabbitMQ delivers it again",
                ));
            }
        }
        Ok(())
    }
}

impl Drop for RabbitSource {
    fn drop(&mut self) {
        self.backlog.abort();
        if let Some(session) = self.session.get_mut().take() {
            for consumer in &session.consumers {
                consumer.abort();
            }
        }
    }
}
