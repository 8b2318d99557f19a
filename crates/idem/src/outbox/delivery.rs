//! How a relay delivers: [`Publish`] through a broker's [`Publisher`], [`Call`] through a function of the
//! user's (an HTTP request, an email), both behind the one [`Delivery`] seam.

use std::collections::HashMap;
use std::future::Future;

use super::OutboxMessage;
use crate::error::Retry;
use crate::source::Publisher;

/// Why a delivery failed, and whether trying again can help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct DeliveryError {
    /// What went wrong, as the broker or the service said it.
    pub reason: String,
    /// `false` for a failure that passes (a broker away, a timeout, HTTP 503): retried with backoff. `true` for
    /// one that will not (HTTP 400, a refused message): the message becomes a dead letter.
    pub permanent: bool,
}

impl DeliveryError {
    /// A failure that may pass: the message is tried again after a backoff, its key held back meanwhile.
    pub fn transient(reason: impl std::fmt::Display) -> Self {
        DeliveryError { reason: reason.to_string(), permanent: false }
    }

    /// A failure that will not pass: the message becomes a dead letter and its key goes on.
    pub fn permanent(reason: impl std::fmt::Display) -> Self {
        DeliveryError { reason: reason.to_string(), permanent: true }
    }
}

/// What became of one message a [`Delivery`] was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivered {
    /// Delivered durably (the broker confirmed it, the call succeeded): the relay deletes it.
    Done,
    /// Not delivered.
    Failed(DeliveryError),
    /// Not tried, because an earlier message of its destination and key failed: it waits for that one.
    Held,
}

/// Delivers outbox messages: the relay's seam to a broker or a service.
///
/// # Contract
/// Return one [`Delivered`] per message, in the order given. Messages of one destination and key are given in
/// order; deliver them in that order, each only after the one before it is `Done`; once one is not, the rest of
/// that key are `Held`. Different keys may be delivered concurrently. Every attempt carries the same event id
/// ([`OutboxMessage::event_id`], also in the `idem-event-id` header of [`OutboxMessage::message`]).
pub trait Delivery: Send + Sync + 'static {
    /// Delivers `messages` (see the contract above).
    fn deliver(&self, messages: &[OutboxMessage]) -> impl Future<Output = Vec<Delivered>> + Send;
}

/// What keeps its order: destination and key, or, for a message without a key, its event id (no order).
type OrderKey<'a> = (&'a str, Option<&'a [u8]>, Option<&'a str>);

/// The order key of `m`.
fn order_key(m: &OutboxMessage) -> OrderKey<'_> {
    (m.destination.as_str(), m.key.as_deref(), m.key.is_none().then_some(m.event_id.as_str()))
}

/// Runs `deliver_one` over `messages`: keys concurrently, each key's messages one after another, holding the
/// rest of a key after its first failure.
pub(super) async fn per_key<'a, F, Fut>(messages: &'a [OutboxMessage], deliver_one: F) -> Vec<Delivered>
where
    F: Fn(&'a OutboxMessage) -> Fut + Sync,
    Fut: Future<Output = Result<(), DeliveryError>> + Send,
{
    let mut keys: HashMap<OrderKey<'a>, Vec<usize>> = HashMap::new();
    for (index, m) in messages.iter().enumerate() {
        // A message without a key keeps no order: it is a key of its own.
        keys.entry(order_key(m)).or_default().push(index);
    }
    let deliver_one = &deliver_one;
    let chains = keys.into_values().map(|indexes| async move {
        let mut results = Vec::with_capacity(indexes.len());
        let mut failed = false;
        for index in indexes {
            let result = if failed {
                Delivered::Held
            } else {
                match deliver_one(&messages[index]).await {
                    Ok(()) => Delivered::Done,
                    Err(error) => {
                        failed = true;
                        Delivered::Failed(error)
                    }
                }
            };
            results.push((index, result));
        }
        results
    });
    let mut out = vec![Delivered::Held; messages.len()];
    for (index, result) in futures_util::future::join_all(chains).await.into_iter().flatten() {
        out[index] = result;
    }
    out
}

/// Delivers through a broker's [`Publisher`] (the embedded log, Kafka, NATS JetStream, RabbitMQ): each message
/// to the topic, subject or queue named by its destination, with its key and headers, confirmed by the broker
/// before it counts as delivered. A broker error that a retry can help is transient, any other permanent.
pub struct Publish<P>(pub P);

impl<P: Publisher + 'static> Delivery for Publish<P> {
    async fn deliver(&self, messages: &[OutboxMessage]) -> Vec<Delivered> {
        per_key(messages, |m| async move { self.0.publish(&m.message()).await.map_err(|e| broker_error(&e)) }).await
    }
}

/// Delivers to the embedded log: each message appended to the topic named by its destination (its partition
/// chosen by key), then the whole round made durable by one fsync. A failed append holds back the rest of its key;
/// a failed fsync fails the round (what was appended may be delivered again, with the same event ids).
impl Delivery for crate::embedded::LogProducer {
    async fn deliver(&self, messages: &[OutboxMessage]) -> Vec<Delivered> {
        // File writes and the fsync block: on a blocking thread, so the relay's reads and writes of the database
        // go on meanwhile.
        let producer = self.clone();
        let batch: Vec<crate::Message> = messages.iter().map(OutboxMessage::message).collect();
        let keys: Vec<(String, Option<Vec<u8>>, Option<String>)> = messages
            .iter()
            .map(|m| (m.destination.clone(), m.key.clone(), m.key.is_none().then(|| m.event_id.clone())))
            .collect();
        let appended = tokio::task::spawn_blocking(move || {
            let mut results = Vec::with_capacity(batch.len());
            let mut failed = std::collections::HashSet::new();
            for (message, key) in batch.iter().zip(&keys) {
                if failed.contains(key) {
                    results.push(Delivered::Held);
                    continue;
                }
                match producer.send(&message.topic, message.key.as_deref(), &message.payload, &message.headers) {
                    Ok(_) => results.push(Delivered::Done),
                    Err(error) => {
                        failed.insert(key.clone());
                        results.push(Delivered::Failed(broker_error(&error)));
                    }
                }
            }
            if let Err(error) = producer.flush() {
                let error = DeliveryError::transient(format!("the embedded log could not be made durable: {error}"));
                for result in results.iter_mut().filter(|r| **r == Delivered::Done) {
                    *result = Delivered::Failed(error.clone());
                }
            }
            results
        })
        .await;
        appended.unwrap_or_else(|panic| {
            let error = DeliveryError::transient(format!("the embedded log's writer stopped: {panic}"));
            vec![Delivered::Failed(error); messages.len()]
        })
    }
}

/// Delivers to NATS JetStream: each message published to the subject named by its destination, its event id also
/// its `Nats-Msg-Id`, so the stream's duplicate window drops a retry of what it stored already (a publish whose
/// acknowledgement was lost, a relay killed before its delete). Keys in parallel, each in order.
#[cfg(feature = "nats")]
impl Delivery for crate::nats::NatsProducer {
    async fn deliver(&self, messages: &[OutboxMessage]) -> Vec<Delivered> {
        per_key(messages, |m| async move {
            let message = m.message();
            self.send(&m.destination, &message.payload, &message.headers).await.map(drop).map_err(|e| broker_error(&e))
        })
        .await
    }
}

/// A broker's error as a delivery error: transient when a retry can help.
fn broker_error(error: &crate::source::SourceError) -> DeliveryError {
    match error.retry() {
        Retry::Helps => DeliveryError::transient(error),
        Retry::Useless => DeliveryError::permanent(error),
    }
}

/// Delivers by calling a function of the user's for each message: an HTTP request (send the event id as its
/// `Idempotency-Key`), an email, any effect outside the database. The function says whether a failure is
/// transient or permanent.
///
/// ```
/// use idem::outbox::{Call, DeliveryError, OutboxMessage};
/// let delivery = Call(|m: OutboxMessage| async move {
///     // e.g. POST the payload with header `Idempotency-Key: {m.event_id}`; map 5xx to transient, 4xx to permanent
///     if m.payload.is_empty() { Err(DeliveryError::permanent("empty body")) } else { Ok(()) }
/// });
/// ```
pub struct Call<F>(pub F);

impl<F, Fut> Delivery for Call<F>
where
    F: Fn(OutboxMessage) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), DeliveryError>> + Send,
{
    async fn deliver(&self, messages: &[OutboxMessage]) -> Vec<Delivered> {
        per_key(messages, |m| (self.0)(m.clone())).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(id: i64, key: Option<&str>) -> OutboxMessage {
        OutboxMessage {
            id,
            event_id: format!("e{id}"),
            destination: "t".into(),
            key: key.map(|k| k.as_bytes().to_vec()),
            payload: id.to_string().into_bytes(),
            headers: Vec::new(),
            slot: 0,
            attempts: 0,
            last_error: None,
            age_seconds: 0.0,
        }
    }

    #[tokio::test]
    async fn a_failure_holds_the_rest_of_its_key_and_nothing_else() {
        let messages = [message(1, Some("a")), message(2, Some("b")), message(3, Some("a")), message(4, None)];
        let tried = std::sync::Mutex::new(Vec::new());
        let results = per_key(&messages, |m| {
            tried.lock().unwrap().push(m.id);
            let id = m.id;
            async move { if id == 1 { Err(DeliveryError::transient("away")) } else { Ok(()) } }
        })
        .await;
        assert_eq!(results[0], Delivered::Failed(DeliveryError::transient("away")));
        assert_eq!(results[1], Delivered::Done);
        assert_eq!(results[2], Delivered::Held, "a later message of the failed key is not tried");
        assert_eq!(results[3], Delivered::Done);
        assert!(!tried.lock().unwrap().contains(&3));
    }
}
