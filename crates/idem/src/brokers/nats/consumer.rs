//! The JetStream source: a durable pull consumer fetched from by [`Source::recv`], each message acknowledged by
//! its own reply subject after its transaction commits, and in-progress acknowledgements for what is in hand.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::Subject;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use futures_util::StreamExt;

use super::{NatsConfig, ack_wait_guard, connect, refused_ack_policy};
use crate::error::Error;
use crate::message::{AckHandle, Message};
use crate::retention::{JETSTREAM_STREAM, RetentionPolicy};
use crate::source::{Acknowledgement, Received, Source, SourceError};

/// How long `recv` waits for a message before it checks whether the source is at its end (with `stop_at_end`).
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// What this consumer handed out and has not acknowledged: stream sequence → reply subject.
type InHand = Arc<Mutex<HashMap<u64, Subject>>>;

/// Consumes a JetStream stream through a durable pull consumer, as a [`Source`]. See the module documentation
/// of [`crate::nats`] for the guarantees.
pub struct NatsSource {
    client: async_nats::Client,
    consumer: tokio::sync::Mutex<PullConsumer>,
    stream: String,
    stop_at_end: bool,
    /// Partitions the messages are spread over by subject.
    partitions: u32,
    /// Messages per pull request.
    batch: usize,
    /// The pull stream: the client keeps one pull request of up to a batch outstanding and refills it.
    messages: tokio::sync::Mutex<pull::Stream>,
    in_hand: InHand,
    progress: tokio::task::JoinHandle<()>,
    /// The consumer's `max_deliver` (`-1` or `0`: no limit): a message on its last delivery is dead-lettered.
    max_deliver: i64,
    /// The consumer group, under which the consumer's pending count is recorded ([`crate::lag`]).
    group: String,
}

/// What a consumer of `config` needs from the server, checked without creating or reading anything: the server
/// answers, the stream exists and keeps messages longer than `engine`'s markers, and it holds the consumer's
/// filter subject. [`NatsSource::connect`] starts with the same; `idem check` runs it alone.
pub async fn check(config: &NatsConfig, engine: &crate::Config) -> Result<(), Error> {
    open_stream(config, engine).await.map(drop)
}

/// Connects and opens the stream, with the checks of [`check`].
async fn open_stream(
    config: &NatsConfig,
    engine: &crate::Config,
) -> Result<(async_nats::Client, async_nats::jetstream::stream::Stream), Error> {
    config.validate()?;
    engine.validate()?;
    let client = connect(&config.url).await?;
    let js = async_nats::jetstream::new(client.clone());
    let mut stream = js.get_stream(&config.stream).await.map_err(|e| {
        Error::Config(format!(
            "nats stream {}: {e}. Fix: create the stream (nats stream add {} --subjects …) or name an existing \
             one",
            config.stream, config.stream
        ))
    })?;
    let info = stream
        .info()
        .await
        .map_err(|e| Error::Config(format!("nats stream {}: cannot read its configuration: {e}", config.stream)))?;
    // max_age 0 means forever, which the guard spells as a negative retention.
    let max_age = info.config.max_age;
    let retention_ms = if max_age.is_zero() { -1 } else { max_age.as_millis() as i64 };
    metrics::gauge!("idem_nats_stream_max_age_seconds", "stream" => config.stream.clone()).set(max_age.as_secs_f64());
    RetentionPolicy {
        marker_retention: engine.pruning.retention,
        accept_infinite_retention: config.accept_infinite_stream_retention,
        broker: JETSTREAM_STREAM,
    }
    .check(&[(config.stream.clone(), Some(retention_ms))])?;

    if let Some(filter) = config.filter_subject.as_deref().filter(|f| !f.is_empty())
        && !info.config.subjects.iter().any(|subject| subject_covers(subject, filter))
    {
        return Err(Error::Config(format!(
            "nats stream {} does not hold the subject {filter} (its subjects: {}): add it to the stream (nats stream \
             edit {} --subjects …), or fix filter_subject",
            config.stream,
            info.config.subjects.join(", "),
            config.stream
        )));
    }
    Ok((client, stream))
}

/// Whether a stream's subject (`orders.>`, `orders.*.created`) takes every message of `filter`.
fn subject_covers(subject: &str, filter: &str) -> bool {
    let mut pattern = subject.split('.');
    let mut tokens = filter.split('.');
    loop {
        match (pattern.next(), tokens.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(token)) if token != ">" => {}
            (Some(p), Some(t)) if p == t => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

impl NatsSource {
    /// Validates `config`, connects, runs the retention guard against the stream's `max_age` with `engine`'s
    /// marker retention, finds or creates the durable consumer (named after `engine.group` unless
    /// [`NatsConfig::durable`] says otherwise), checks its acknowledgement policy and AckWait, and starts the
    /// in-progress acknowledgements.
    pub async fn connect(config: &NatsConfig, engine: &crate::Config) -> Result<Self, Error> {
        let (client, stream) = open_stream(config, engine).await?;

        let durable = config.durable.clone().unwrap_or_else(|| durable_name(&engine.group));
        let wanted = pull::Config {
            durable_name: Some(durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: config.ack_wait,
            max_deliver: config.max_deliver,
            filter_subject: config.filter_subject.clone().unwrap_or_default(),
            max_ack_pending: config.max_ack_pending.unwrap_or_default(),
            ..Default::default()
        };
        let mut consumer: PullConsumer = stream.get_or_create_consumer(&durable, wanted).await.map_err(|e| {
            Error::Config(format!(
                "nats stream {}: cannot create or open durable consumer {durable}: {e}",
                config.stream
            ))
        })?;
        let existing = consumer
            .info()
            .await
            .map_err(|e| Error::Config(format!("nats consumer {durable}: cannot read its configuration: {e}")))?
            .config
            .clone();
        match existing.ack_policy {
            AckPolicy::Explicit => {}
            AckPolicy::None => return Err(refused_ack_policy("none")),
            AckPolicy::All => return Err(refused_ack_policy("all")),
        }
        ack_wait_guard(existing.ack_wait, config.max_batch_time)?;
        if let Some(wanted) = config.max_ack_pending
            && existing.max_ack_pending != wanted
        {
            return Err(Error::Config(format!(
                "nats consumer {durable} has max_ack_pending {} where {wanted} is asked for: edit the consumer \
                 (nats consumer edit {} {durable} --max-pending {wanted}) or delete it so idem creates it",
                existing.max_ack_pending, config.stream
            )));
        }
        tracing::info!(stream = %config.stream, consumer = %durable, ack_wait = ?existing.ack_wait,
            max_deliver = existing.max_deliver, "nats: consuming");

        let batch = engine.batch_size.max(1);
        let messages = open_pull(&consumer, batch)
            .await
            .map_err(|e| Error::Config(format!("nats consumer {durable}: cannot start pulling: {e}")))?;
        let in_hand: InHand = Arc::default();
        let progress = tokio::spawn(keep_in_progress(client.clone(), Arc::clone(&in_hand), existing.ack_wait / 3));
        Ok(NatsSource {
            client,
            consumer: tokio::sync::Mutex::new(consumer),
            stream: config.stream.clone(),
            stop_at_end: config.stop_at_end,
            partitions: config.partitions,
            batch,
            messages: tokio::sync::Mutex::new(messages),
            in_hand,
            progress,
            max_deliver: existing.max_deliver,
            group: engine.group.clone(),
        })
    }

    /// A new pull stream, after the old one failed or ended.
    async fn reopen(&self) -> Result<pull::Stream, SourceError> {
        let consumer = self.consumer.lock().await;
        open_pull(&consumer, self.batch).await.map_err(|e| SourceError::transient("nats pull", e))
    }

    /// Whether nothing is left for this consumer: nothing undelivered, and nothing awaiting acknowledgement
    /// but what this process holds (a crashed consumer's messages come again after AckWait, so they count).
    async fn at_end(&self) -> Result<bool, SourceError> {
        let mut consumer = self.consumer.lock().await;
        let info = consumer.info().await.map_err(|e| SourceError::transient("nats consumer info", e))?;
        let ours = lock(&self.in_hand).len();
        Ok(info.num_pending == 0 && info.num_ack_pending <= ours)
    }

    fn to_message(&self, message: async_nats::jetstream::Message) -> Result<Message, SourceError> {
        let info = message.info().map_err(|e| SourceError::permanent("nats message", e))?;
        let (sequence, delivered) = (info.stream_sequence, info.delivered);
        crate::lag::record(&self.group, &self.stream, None, i64::try_from(info.pending).unwrap_or(i64::MAX));
        let timestamp_ms = Some((info.published.unix_timestamp_nanos() / 1_000_000) as i64);
        if delivered > 1 {
            metrics::counter!("idem_nats_redelivered_total", "stream" => self.stream.clone()).increment(1);
        }
        let message = message.message;
        let reply =
            message.reply.clone().ok_or_else(|| SourceError::permanent("nats message", "no reply subject to ack"))?;
        lock(&self.in_hand).insert(sequence, reply.clone());
        let headers = message
            .headers
            .as_ref()
            .map(|h| {
                let mut pairs: Vec<(String, Vec<u8>)> = h
                    .iter()
                    .flat_map(|(name, values)| {
                        values.iter().map(move |v| (name.to_string(), v.as_str().as_bytes().to_vec()))
                    })
                    .collect();
                pairs.sort();
                pairs
            })
            .unwrap_or_default();
        let partition = match self.partitions {
            0 | 1 => 0,
            n => (crc32fast::hash(message.subject.as_str().as_bytes()) % n) as i32,
        };
        Ok(Message {
            topic: self.stream.clone(),
            partition,
            offset: sequence as i64,
            key: Some(message.subject.as_str().as_bytes().to_vec()),
            payload: message.payload.to_vec(),
            headers,
            timestamp_ms,
            ack_handle: Some(AckHandle::new(Delivery { sequence, reply })),
            dead_letter_reason: self.last_delivery(delivered),
        })
    }
}

impl NatsSource {
    /// The reason to dead-letter a message delivered `delivered` times, when the server will not deliver it again.
    fn last_delivery(&self, delivered: i64) -> Option<String> {
        (self.max_deliver > 0 && delivered >= self.max_deliver).then(|| {
            format!(
                "delivered {delivered} times, the consumer's max_deliver ({}): JetStream will not deliver it again, so \
                 idem kept it as a dead letter instead of calling the handler (a message that crashes the consumer \
                 ends here). Replay it with idem dead-letters replay --nats URL once the cause is fixed",
                self.max_deliver
            )
        })
    }
}

/// Opens a pull stream: one outstanding request of up to `batch` messages, refilled as they are taken, with
/// heartbeats so a lost connection is noticed. At most a batch waits in the client, so what is delivered is soon
/// in hand and kept in progress.
async fn open_pull(consumer: &PullConsumer, batch: usize) -> Result<pull::Stream, async_nats::Error> {
    Ok(consumer.stream().max_messages_per_batch(batch).heartbeat(Duration::from_secs(5)).messages().await?)
}

/// The handle of one delivery: its stream sequence and the subject its acknowledgement goes to.
struct Delivery {
    sequence: u64,
    reply: Subject,
}

/// A durable consumer's name from a consumer group: characters JetStream refuses become `_`.
fn durable_name(group: &str) -> String {
    group.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Every `every`, tells the server that each message in hand is still being worked on (`+WPI`), which restarts
/// its AckWait.
async fn keep_in_progress(client: async_nats::Client, in_hand: InHand, every: Duration) {
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(100)));
    tick.tick().await;
    loop {
        tick.tick().await;
        let replies: Vec<Subject> = lock(&in_hand).values().cloned().collect();
        for reply in replies {
            if let Err(error) = client.publish(reply, "+WPI".into()).await {
                tracing::warn!(%error, "nats: in-progress acknowledgement failed");
            }
        }
    }
}

impl Source for NatsSource {
    const SYSTEM: &'static str = "nats";

    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        let mut messages = self.messages.lock().await;
        loop {
            match tokio::time::timeout(IDLE_CHECK, messages.next()).await {
                Ok(Some(Ok(message))) => return self.to_message(message).map(|m| Some(Received::Message(m))),
                Ok(Some(Err(error))) => {
                    // The client reconnects by itself; a pull that failed meanwhile is opened again.
                    tracing::warn!(%error, stream = %self.stream, "nats: pull failed; pulling again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    *messages = self.reopen().await?;
                }
                Ok(None) => *messages = self.reopen().await?,
                Err(_idle) if self.stop_at_end && self.at_end().await? => {
                    tracing::info!(stream = %self.stream, "nats: nothing left to deliver");
                    return Ok(None);
                }
                Err(_idle) => {}
            }
        }
    }

    async fn ack(&self, ack: &Acknowledgement) -> Result<(), SourceError> {
        for handle in &ack.handles {
            let Some(delivery) = handle.get::<Delivery>() else {
                return Err(SourceError::permanent("nats ack", "a handle that is not a NATS delivery"));
            };
            // A dead letter is settled with +TERM: the server stops redelivering it and reports it terminated.
            let settle = if ack.dead_lettered.contains(handle) { "+TERM" } else { "+ACK" };
            self.client
                .publish(delivery.reply.clone(), settle.into())
                .await
                .map_err(|e| SourceError::transient("nats ack", e))?;
            lock(&self.in_hand).remove(&delivery.sequence);
        }
        // The acknowledgements are on the wire before the engine moves on.
        self.client.flush().await.map_err(|e| SourceError::transient("nats ack flush", e))
    }
}

impl Drop for NatsSource {
    fn drop(&mut self) {
        self.progress.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::subject_covers;

    #[test]
    fn a_stream_subject_covers_what_its_wildcards_match() {
        assert!(subject_covers("orders.>", "orders.created"));
        assert!(subject_covers("orders.>", "orders.>"));
        assert!(subject_covers("orders.*.created", "orders.eu.created"));
        assert!(subject_covers("orders", "orders"));
        assert!(!subject_covers("orders.*", "orders.>"));
        assert!(!subject_covers("orders.*", "orders.eu.created"));
        assert!(!subject_covers("orders", "orders.created"));
        assert!(!subject_covers("payments.>", "orders.created"));
    }
}
