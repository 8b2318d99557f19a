//! NATS JetStream (feature `nats`): a [`NatsSource`] on the source seam (a durable pull consumer, explicit
//! acknowledgement after commit), a [`NatsProducer`] that sets `Nats-Msg-Id` so the server's duplicate window drops
//! a producer's retries, and the two start-up guards.
//!
//! * **Acknowledgement.** Only `AckPolicy::Explicit`: each message is acknowledged by its own handle once the
//!   transaction holding its marker committed. A durable consumer created with `none` or `all` is refused at
//!   start-up, naming the policy.
//! * **AckWait.** While a batch runs, the source sends in-progress acknowledgements (`+WPI`) every third of
//!   AckWait for every message it handed out and has not acknowledged, so AckWait never expires mid-transaction.
//!   As a second line, start-up is refused when AckWait is shorter than [`NatsConfig::max_batch_time`], the
//!   longest a batch may take (as SQS's visibility timeout must, on JetStream).
//! * **Retention.** The stream's `max_age` is checked against the marker retention at start-up, with the rules
//!   of the Kafka guard ([`crate::retention`]): `max_age=0` (forever) needs markers that are never pruned or an
//!   explicit, logged override.
//! * **Mapping.** The stream is the message's topic, the stream sequence its offset and the subject its key. With
//!   [`NatsConfig::partitions`] at 1 (the default) everything is partition 0, handled in stream order; above 1,
//!   a message's partition is a hash of its subject, so subjects are handled in parallel and each keeps its order.
//!   Several processes sharing the durable consumer split its messages between them, so per-key order across
//!   processes needs one stream (or one filtered consumer) per key range.
//! * **Delivery limit.** With `max_deliver` set, the delivery the server calls its last (`delivered ==
//!   max_deliver`) is not handed to the handler: the engine writes its dead letter in the transaction with its
//!   marker (see [`Message::dead_letter_reason`](crate::Message::dead_letter_reason)), and the source settles it
//!   with `+TERM`, so JetStream stops and reports it. Any other dead letter is terminated the same way.
//! * **Retries stay in hand.** A retryable failure is retried while the message is kept in progress, never
//!   `Nak`ed: a negative acknowledgement would let later messages of the subject overtake it.
//! * **Order across redelivery.** A message that a crashed consumer held comes again after AckWait, behind later
//!   messages, unless [`NatsConfig::max_ack_pending`] is 1 (strict order, one message per round trip).

mod consumer;
mod producer;

use std::time::Duration;

pub use consumer::{NatsSource, check};
pub use producer::{MSG_ID_HEADER, NatsProducer};

use crate::error::Error;

/// How to reach NATS JetStream and consume a stream.
#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// The server, e.g. `nats://127.0.0.1:4222`.
    pub url: String,
    /// The stream to consume.
    pub stream: String,
    /// The durable consumer's name; `None` uses the engine's consumer group, so markers and the consumer's
    /// position are kept under one name. Created when missing.
    pub durable: Option<String>,
    /// Only the stream's subjects matching this filter; `None` for all of them.
    pub filter_subject: Option<String>,
    /// The acknowledgement policy of a consumer idem creates; only `explicit` is accepted.
    pub ack_policy: String,
    /// AckWait of a consumer idem creates: how long the server waits for an acknowledgement before delivering a
    /// message again. Default 30 s.
    pub ack_wait: Duration,
    /// The longest one batch may take from delivery to commit. Start-up is refused when the consumer's AckWait is
    /// shorter. Default 10 s.
    pub max_batch_time: Duration,
    /// Deliveries after which the server stops delivering a message (`-1`: no limit, the default). idem
    /// dead-letters its own failures long before; the limit catches a message that crashes or hangs the process:
    /// its last delivery is kept as a dead letter, without calling the handler, and terminated.
    pub max_deliver: i64,
    /// Partitions the stream's messages are spread over, by a hash of their subject (CRC-32, as Kafka's
    /// producers hash keys): each partition is handled in order, the partitions in parallel, so the messages of
    /// one subject keep their order. Default 1: the whole stream in stream order, one batch at a time.
    pub partitions: u32,
    /// Messages handed out and not yet acknowledged, at most (`None`: the server's default, 1,000). `Some(1)` is
    /// the strict-order setting (one message in flight, as RabbitMQ's `prefetch = 1`): a message a crashed consumer held is delivered
    /// again before any later one, at the price of one message per round trip. With more in flight, messages
    /// come in stream order until one is redelivered: after a crash it comes after later ones, and only the
    /// markers (not the order) still hold.
    pub max_ack_pending: Option<i64>,
    /// Return the end of the source once nothing is left to deliver or awaiting acknowledgement (demos, tests).
    pub stop_at_end: bool,
    /// Accept pruned markers against a stream that keeps messages forever (`max_age=0`); logged at WARN.
    pub accept_infinite_stream_retention: bool,
}

impl NatsConfig {
    /// A configuration with defaults: explicit acknowledgement, AckWait 30 s, batches of at most 10 s.
    pub fn new(url: impl Into<String>, stream: impl Into<String>) -> Self {
        NatsConfig {
            url: url.into(),
            stream: stream.into(),
            durable: None,
            filter_subject: None,
            ack_policy: "explicit".into(),
            ack_wait: Duration::from_secs(30),
            max_batch_time: Duration::from_secs(10),
            max_deliver: -1,
            max_ack_pending: None,
            partitions: 1,
            stop_at_end: false,
            accept_infinite_stream_retention: false,
        }
    }

    /// Refuses what cannot work, naming the setting and the fix.
    pub fn validate(&self) -> Result<(), Error> {
        if self.url.trim().is_empty() {
            return Err(Error::Config("nats url is empty: give nats://host:port".into()));
        }
        if let Some(bad) = [("stream", Some(&self.stream)), ("durable", self.durable.as_ref())]
            .into_iter()
            .find_map(|(field, name)| name.filter(|n| !valid_name(n)).map(|n| (field, n)))
        {
            return Err(Error::Config(format!(
                "nats {} `{}` is not a JetStream name: use letters, digits, `-` and `_` (no spaces, `.`, `*` or `>`)",
                bad.0, bad.1
            )));
        }
        match self.ack_policy.trim().to_ascii_lowercase().as_str() {
            "explicit" => {}
            other => return Err(refused_ack_policy(other)),
        }
        ack_wait_guard(self.ack_wait, self.max_batch_time)?;
        if self.max_deliver == 0 || self.max_deliver < -1 {
            return Err(Error::Config(format!(
                "nats max_deliver {} is not a limit: use -1 (no limit) or at least 1",
                self.max_deliver
            )));
        }
        if self.partitions == 0 || self.partitions > 1024 {
            return Err(Error::Config(format!("nats partitions {} is out of range: use 1 to 1024", self.partitions)));
        }
        if self.max_ack_pending.is_some_and(|n| n < 1) {
            return Err(Error::Config(format!(
                "nats max_ack_pending {:?} lets no message through: use at least 1 (1 keeps strict order)",
                self.max_ack_pending.unwrap_or_default()
            )));
        }
        Ok(())
    }
}

/// JetStream names: no whitespace, `.`, `*`, `>`, path separators; not empty.
fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn refused_ack_policy(policy: &str) -> Error {
    Error::Config(format!(
        "nats ack_policy={policy} is refused: {}, so a crash would lose events. Fix: use ack_policy=explicit \
         (idem acknowledges each message after its transaction commits)",
        match policy {
            "none" => "the server would count every message as handled on delivery, before the database",
            "all" => "one acknowledgement would cover earlier messages still in other transactions",
            _ => "only explicit acknowledgement is supported",
        }
    ))
}

/// The AckWait guard: a batch still running when AckWait expires is delivered again, to this or another
/// consumer, while its transaction is open.
pub fn ack_wait_guard(ack_wait: Duration, max_batch_time: Duration) -> Result<(), Error> {
    if ack_wait < max_batch_time {
        return Err(Error::Config(format!(
            "nats AckWait {} is shorter than max_batch_time {}: a batch still running when AckWait expires is \
             delivered again while its transaction is open. Fix: raise the consumer's ack_wait to at least {} \
             (nats consumer edit, or delete the consumer so idem creates it), or lower max_batch_time",
            seconds(ack_wait),
            seconds(max_batch_time),
            seconds(max_batch_time)
        )));
    }
    Ok(())
}

fn seconds(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// Connects to `url`, naming the server and the cause when it cannot.
pub async fn connect(url: &str) -> Result<async_nats::Client, Error> {
    async_nats::ConnectOptions::new()
        .name("idem")
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .map_err(|e| Error::Connect {
            target: format!("nats {}", crate::error::redact_url(url)),
            reason: e.to_string(),
        })
}

/// Creates (or replaces) a file-backed stream `name` over `subjects`, keeping messages `max_age` (zero: forever)
/// with a duplicate window of 2 minutes. For demos and tests; production streams are an operator's decision.
pub async fn create_stream(url: &str, name: &str, subjects: &[&str], max_age: Duration) -> Result<(), Error> {
    let js = async_nats::jetstream::new(connect(url).await?);
    let _ = js.delete_stream(name).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.to_owned(),
        subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
        max_age,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .map_err(|e| Error::Config(format!("nats: cannot create stream {name}: {e}")))?;
    Ok(())
}

/// Deletes stream `name` (and its consumers); a missing stream is not an error.
pub async fn delete_stream(url: &str, name: &str) -> Result<(), Error> {
    let js = async_nats::jetstream::new(connect(url).await?);
    match js.delete_stream(name).await {
        Ok(_) => Ok(()),
        Err(e)
            if matches!(e.kind(), async_nats::jetstream::context::DeleteStreamErrorKind::JetStream(js)
                if js.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND) =>
        {
            Ok(())
        }
        Err(e) => Err(Error::Config(format!("nats: cannot delete stream {name}: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_policies_other_than_explicit_are_refused_by_name() {
        let base = NatsConfig::new("nats://127.0.0.1:4222", "orders");
        base.validate().unwrap();
        for policy in ["none", "all", "All"] {
            let err = NatsConfig { ack_policy: policy.into(), ..base.clone() }.validate().unwrap_err().to_string();
            assert!(err.contains(&format!("ack_policy={}", policy.to_ascii_lowercase())), "{err}");
            assert!(err.contains("ack_policy=explicit"), "{err}");
        }
    }

    #[test]
    fn an_ack_wait_shorter_than_a_batch_is_refused_with_both_values_and_the_fix() {
        let config = NatsConfig {
            ack_wait: Duration::from_secs(1),
            max_batch_time: Duration::from_secs(30),
            ..NatsConfig::new("nats://x", "s")
        };
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("AckWait 1 s") && err.contains("max_batch_time 30 s") && err.contains("at least 30 s"),
            "{err}"
        );
        assert!(ack_wait_guard(Duration::from_secs(30), Duration::from_secs(30)).is_ok());
    }

    #[test]
    fn names_and_limits_are_checked() {
        let base = NatsConfig::new("nats://x", "orders");
        assert!(NatsConfig { stream: "a.b".into(), ..base.clone() }.validate().is_err());
        assert!(NatsConfig { durable: Some("with space".into()), ..base.clone() }.validate().is_err());
        assert!(NatsConfig { url: " ".into(), ..base.clone() }.validate().is_err());
        assert!(NatsConfig { max_deliver: 0, ..base.clone() }.validate().is_err());
        assert!(NatsConfig { max_deliver: 5, ..base }.validate().is_ok());
    }
}
