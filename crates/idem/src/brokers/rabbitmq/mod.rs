//! RabbitMQ (feature `rabbitmq`, AMQP 0-9-1): a [`RabbitSource`] on the source seam and a [`RabbitProducer`] with
//! publisher confirms.
//!
//! * **Acknowledgement.** Manual only: each delivery is acknowledged (`basic.ack`, one tag, never `multiple`)
//!   after the transaction holding its marker committed. Consuming with `no_ack` (auto-ack) is refused at
//!   start-up, naming the setting.
//! * **Prefetch.** `basic.qos` per consumer, the engine's batch size unless [`RabbitConfig::prefetch`] says
//!   otherwise; `prefetch = 1` is the strict-order setting (one message in flight per queue).
//! * **Partitions.** Each queue is one partition of idem's (its name is the topic, partition 0): queues are
//!   handled in parallel, each in order. For per-key order over several queues, route each key to one queue (a
//!   direct exchange with one routing key per key range, or the `x-consistent-hash` exchange), and run one
//!   consumer per queue (`x-single-active-consumer` on the queue keeps a second process as a standby).
//! * **Loss of the connection, the channel or a consumer** (a broker restart, a queue deleted, a consumer
//!   cancelled by the server): the source yields a revocation of its queues, so the engine finishes what it holds
//!   (its acknowledgements then fail on the dead channel: those messages come again, flagged `redelivered`, and
//!   are absorbed as duplicates), then connects again with backoff. A connection that dies without its consumers
//!   hearing of it is caught on the next idle second, and every request to the broker waits at most 15 s, so a
//!   request the dead connection never answers cannot stall the consumer.
//! * **Dead letters** are idem's: a message that fails for good is written to the dead-letter table in the same
//!   transaction as its marker, then acknowledged, or, with [`RabbitConfig::dead_letter_exchange`], rejected
//!   without requeue so RabbitMQ also routes it to the queue's `x-dead-letter-exchange`. That exchange still
//!   catches what RabbitMQ rejects by itself (expired messages, an overflowing queue).
//! * **Keys and offsets.** RabbitMQ has no offsets, and its delivery tags start from 1 again on each channel, so
//!   they identify no message: the `broker-id` key is refused at start-up, and a message's offset in idem (what a
//!   keyless dead letter is stored under) is derived from its `message_id` property, or from its routing key and
//!   body, the same on every delivery. The `message_id` is also the header [`MESSAGE_ID_HEADER`].
//! * **Delivery limit.** A quorum queue counts failed deliveries (`x-delivery-count`) and drops a message past its
//!   `x-delivery-limit`. Give idem the limit ([`RabbitConfig::delivery_limit`]) and the last delivery becomes a
//!   dead letter in idem's table instead of a message the broker drops (a message that crashes the consumer each
//!   time would otherwise be lost to the database).

mod consumer;
mod producer;

pub use consumer::RabbitSource;
pub use producer::RabbitProducer;

/// The header carrying a delivery's AMQP `message_id` property, when its publisher set one (idem's producer sets
/// the event id): `header:rabbitmq-message-id` keys on it.
pub const MESSAGE_ID_HEADER: &str = "rabbitmq-message-id";

use std::time::Duration;

use crate::error::Error;
use crate::source::SourceError;

/// How to reach RabbitMQ and consume its queues.
#[derive(Debug, Clone)]
pub struct RabbitConfig {
    /// The server, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`.
    pub url: String,
    /// The queues to consume; each is one partition.
    pub queues: Vec<String>,
    /// Unacknowledged deliveries per queue; `None` uses the engine's batch size. `Some(1)` keeps strict order.
    pub prefetch: Option<u16>,
    /// Consume without acknowledgements (auto-ack). Always refused: it is here so a configuration that asks for
    /// it is named in the error instead of being ignored.
    pub no_ack: bool,
    /// Return the end of the source once every queue is empty and nothing arrived for a second (demos, tests).
    pub stop_at_end: bool,
    /// Also hand each message idem dead-letters to RabbitMQ's own dead-lettering: after its dead-letter row
    /// commits, the delivery is rejected without requeue instead of acknowledged, so RabbitMQ routes it to the
    /// queue's `x-dead-letter-exchange` with an `x-death` header, where RabbitMQ-native tooling sees it. A queue
    /// without that argument drops a rejected message, which after the committed row is the same as an
    /// acknowledgement. Default `false`.
    pub dead_letter_exchange: bool,
    /// The quorum queue's `x-delivery-limit`, when it has one: a delivery whose `x-delivery-count` has reached it
    /// is RabbitMQ's last (one more failure and the broker drops or dead-letters it by itself), so idem keeps it
    /// as a dead letter without calling the handler. Catches a message that crashes the consumer on every
    /// delivery. `None` (the default) for queues without a limit.
    pub delivery_limit: Option<u32>,
}

impl RabbitConfig {
    /// A configuration with defaults: manual acknowledgement, prefetch of one batch.
    pub fn new(url: impl Into<String>, queues: &[&str]) -> Self {
        RabbitConfig {
            url: url.into(),
            queues: queues.iter().map(|q| (*q).to_owned()).collect(),
            prefetch: None,
            no_ack: false,
            stop_at_end: false,
            dead_letter_exchange: false,
            delivery_limit: None,
        }
    }

    /// Refuses what cannot work, naming the setting and the fix.
    pub fn validate(&self) -> Result<(), Error> {
        if !self.url.starts_with("amqp://") {
            return Err(Error::Config(format!(
                "rabbitmq url `{}` is not amqp://user:password@host:port/vhost (amqps:// needs TLS, which this build \
                 leaves out)",
                self.url
            )));
        }
        if self.queues.is_empty() || self.queues.iter().any(|q| q.trim().is_empty()) {
            return Err(Error::Config("rabbitmq queues: name at least one queue, none empty".into()));
        }
        if self.no_ack {
            return Err(Error::Config(
                "rabbitmq no_ack=true (auto-ack) is refused: the broker would count each message as handled when it \
                 is delivered, before the database, so a crash would lose it. Fix: remove no_ack (idem acknowledges \
                 each message after its transaction commits)"
                    .into(),
            ));
        }
        if self.prefetch == Some(0) {
            return Err(Error::Config(
                "rabbitmq prefetch 0 means no limit: every message of the queue would be in flight at once. Fix: use \
                 1 (strict order) up to a few batches"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// The longest wait for one answer of the broker (a channel, a consume, an acknowledgement, a close). A connection
/// that dies at the wrong moment can leave a request of the client library unanswered for good; past this bound
/// the request counts as failed, and the source connects again instead of waiting for ever.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(15);

/// Waits for `request` at most [`ANSWER_TIMEOUT`]; a failure or the timeout is a transient error of `context`.
pub(super) async fn answer<T, E: std::fmt::Display>(
    context: &'static str,
    request: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, SourceError> {
    match tokio::time::timeout(ANSWER_TIMEOUT, request).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(SourceError::transient(context, e)),
        Err(_) => Err(SourceError::transient(context, format!("no answer within {} s", ANSWER_TIMEOUT.as_secs()))),
    }
}

/// Connects to `url`, naming the server and the cause when it cannot (wrong address, wrong credentials, a
/// missing virtual host).
pub async fn connect(url: &str) -> Result<lapin::Connection, Error> {
    let connecting = lapin::Connection::connect(url, lapin::ConnectionProperties::default());
    match tokio::time::timeout(std::time::Duration::from_secs(10), connecting).await {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(e)) => {
            Err(Error::Connect { target: format!("rabbitmq {}", crate::error::redact_url(url)), reason: e.to_string() })
        }
        Err(_) => Err(Error::Connect {
            target: format!("rabbitmq {}", crate::error::redact_url(url)),
            reason: "timed out after 10 s".into(),
        }),
    }
}

/// What a consumer of `config` needs from the server, checked without consuming anything: the server answers to
/// these credentials, and each queue exists and may be used by this user (a passive declare). `idem check` runs
/// it; each fault is named with its fix.
pub async fn check(config: &RabbitConfig) -> Result<(), Error> {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    config.validate()?;
    let connection = connect(&config.url).await?;
    let server = crate::error::redact_url(&config.url);
    let mut problem = None;
    for queue in &config.queues {
        // A passive declaration of a missing queue closes its channel: one channel per queue.
        let channel = answer("rabbitmq channel", connection.create_channel())
            .await
            .map_err(|e| Error::Config(format!("rabbitmq {server}: cannot open a channel: {e}")))?;
        let passive = lapin::options::QueueDeclareOptions { passive: true, ..Default::default() };
        let declared = tokio::time::timeout(
            ANSWER_TIMEOUT,
            channel.queue_declare(queue.as_str().into(), passive, lapin::types::FieldTable::default()),
        )
        .await;
        let fault = match declared {
            Ok(Ok(_)) => continue,
            Err(_) => format!("the server did not answer within {} s", ANSWER_TIMEOUT.as_secs()),
            Ok(Err(e)) => match e.kind() {
                lapin::ErrorKind::ProtocolError(amqp) => match amqp.kind() {
                    AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) => format!(
                        "it does not exist on {server}: declare the queue (rabbitmqadmin declare queue \
                         name={queue} durable=true; a quorum queue for replication), or fix its name"
                    ),
                    AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => format!(
                        "this user may not use it ({}): grant the user configure and read permissions on it \
                         (rabbitmqctl set_permissions)",
                        amqp.get_message()
                    ),
                    _ => amqp.to_string(),
                },
                _ => e.to_string(),
            },
        };
        problem = Some(format!("rabbitmq queue `{queue}`: {fault}"));
        break;
    }
    // A channel that refused a declaration is closed already; the others close with the connection.
    let _ = connection.close(200, "checked".into()).await;
    problem.map_or(Ok(()), |problem| Err(Error::Config(problem)))
}

/// Declares durable queue `name` (a quorum queue when `quorum`), for demos and tests; production queues are an
/// operator's decision.
pub async fn create_queue(url: &str, name: &str, quorum: bool) -> Result<(), Error> {
    use lapin::types::{AMQPValue, FieldTable};
    let connection = connect(url).await?;
    let channel = connection.create_channel().await.map_err(|e| Error::Config(format!("rabbitmq channel: {e}")))?;
    let mut arguments = FieldTable::default();
    if quorum {
        arguments.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    }
    let options = lapin::options::QueueDeclareOptions { durable: true, ..Default::default() };
    channel
        .queue_declare(name.into(), options, arguments)
        .await
        .map_err(|e| Error::Config(format!("rabbitmq: cannot declare queue {name}: {e}")))?;
    let _ = connection.close(200, "".into()).await;
    Ok(())
}

/// Deletes queue `name`; a missing queue is not an error.
pub async fn delete_queue(url: &str, name: &str) -> Result<(), Error> {
    let connection = connect(url).await?;
    let channel = connection.create_channel().await.map_err(|e| Error::Config(format!("rabbitmq channel: {e}")))?;
    let deleted = channel.queue_delete(name.into(), lapin::options::QueueDeleteOptions::default()).await;
    let _ = connection.close(200, "".into()).await;
    match deleted {
        Ok(_) => Ok(()),
        // The server's reply code 404 (NOT_FOUND).
        Err(e) if matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 404) => Ok(()),
        Err(e) => Err(Error::Config(format!("rabbitmq: cannot delete queue {name}: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_ack_a_bad_url_no_queue_and_prefetch_0_are_refused_by_name() {
        let base = RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f", &["orders"]);
        base.validate().unwrap();
        let err = RabbitConfig { no_ack: true, ..base.clone() }.validate().unwrap_err().to_string();
        assert!(err.contains("no_ack=true") && err.contains("Fix"), "{err}");
        assert!(RabbitConfig { url: "http://x".into(), ..base.clone() }.validate().is_err());
        assert!(RabbitConfig { queues: vec![], ..base.clone() }.validate().is_err());
        let err = RabbitConfig { prefetch: Some(0), ..base.clone() }.validate().unwrap_err().to_string();
        assert!(err.contains("prefetch 0"), "{err}");
        assert!(RabbitConfig { prefetch: Some(1), ..base }.validate().is_ok());
    }

    #[test]
    fn passwords_stay_out_of_errors() {
        let redact = crate::error::redact_url;
        assert_eq!(redact("amqp://guest:secret@host:5672/%2f"), "amqp://guest:***@host:5672/%2f");
        assert_eq!(redact("amqp://host:5672"), "amqp://host:5672");
    }
}
