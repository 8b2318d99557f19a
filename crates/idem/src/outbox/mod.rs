//! The transactional outbox: effects on other systems, made exactly once end to end.
//!
//! A handler (or any application transaction) cannot publish to a broker or call an API without risking a lost
//! or doubled effect: the call is not part of the transaction. Instead it **enqueues** the outgoing message in
//! the same transaction as its other writes ([`enqueue`], [`Outbox::enqueue_all`]); the message exists exactly
//! when the transaction committed. A [`Relay`] then delivers committed messages and deletes each one once it is
//! delivered. Between the delivery and the delete a relay can crash, so a message can be delivered more than
//! once, always with the same event id: it is given a UUIDv7 at enqueue and carried as the `idem-event-id`
//! header on every attempt, so a downstream idem consumer (`KeyExtractor::Header("idem-event-id")`) applies it
//! once, and an API that takes an idempotency key receives the same key each time.
//!
//! * **Order.** Messages of one destination and key are delivered in the order their transactions committed
//!   (a message enqueued after another one's transaction committed is never delivered before it), across relay
//!   restarts and with several relays: each (destination, key) hashes to one of [`SLOTS`] slots, and a slot is
//!   relayed by one relay at a time, in id order. A message that fails holds back its slot (with capped backoff)
//!   until it is delivered or dead-lettered. Messages without a key are spread over the slots and keep no order.
//! * **Sharing the work.** On PostgreSQL the relays split the slots between them with session advisory locks,
//!   each taking a fair share of what is free and giving back what is above it as relays come and go; a relay
//!   that dies (SIGKILL, a lost connection) releases its slots with its connection. On SQLite one relay at a time
//!   holds a lease (renewed each round, taken over when it expires); the others wait.
//! * **Waking.** On PostgreSQL a trigger notifies the relays when rows are inserted (`LISTEN`); they also poll
//!   every [`RelayConfig::poll_interval`] as a fallback. On SQLite they poll. An idle relay makes one cheap query
//!   per poll interval.
//! * **Failures.** A [`Delivery`] reports each message delivered, failed for a while (retried with backoff, without
//!   limit unless [`RelayConfig::max_attempts`] is set) or failed for good: then the row moves to the dead-letter
//!   table (consumer group `outbox:<relay name>`, topic the destination, offset the outbox id) in the
//!   transaction that deletes it, and [`requeue_dead_letter`] puts it back.

mod delivery;
#[cfg(feature = "http-delivery")]
mod http;
mod relay;
pub mod requeue;
mod settlement;
pub(crate) mod store;

pub use delivery::{Call, Delivered, Delivery, DeliveryError, Publish};
#[cfg(feature = "http-delivery")]
pub use http::{HttpDelivery, HttpOr, METHOD_HEADER, is_http};
pub use relay::{Relay, RelayConfig, RelayStats};
pub use store::{
    DestinationStats, OutboxConnection, OutboxStats, OutboxStore, destinations, list, requeue_dead_letter, stats,
};

use crate::message::{EVENT_ID_HEADER, Message};
use crate::store::Tables;

/// The slots (key groups) a relay owns: each (destination, key) hashes to one, relayed by one relay at a time.
pub const SLOTS: i32 = 64;

/// A message to deliver once the transaction that enqueues it commits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// Where it goes: a Kafka topic, an embedded-log topic, a NATS subject, a RabbitMQ queue, or the name a
    /// [`Call`] delivery dispatches on.
    pub destination: String,
    /// The message key; messages of one destination and key are delivered in order. `None`: no order.
    pub key: Option<Vec<u8>>,
    /// The body.
    pub payload: Vec<u8>,
    /// Headers, delivered with the message; idem adds `idem-event-id`.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The event id; `None` gives it a new UUIDv7 at enqueue. Set it to derive the id from the event being
    /// handled when the same effect must carry the same id even if it is enqueued again.
    pub event_id: Option<String>,
}

impl OutgoingMessage {
    /// A message to `destination` with `payload`, no key, no headers, a new event id.
    pub fn new(destination: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        OutgoingMessage {
            destination: destination.into(),
            key: None,
            payload: payload.into(),
            headers: Vec::new(),
            event_id: None,
        }
    }

    /// Sets the key (the unit of order).
    pub fn with_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Appends a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets the event id instead of a new UUIDv7.
    pub fn with_event_id(mut self, event_id: impl Into<String>) -> Self {
        self.event_id = Some(event_id.into());
        self
    }

    /// The slot of this message: a hash of destination and key, or of the event id for a message without a key.
    fn slot(&self, event_id: &str) -> i32 {
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(self.destination.as_bytes());
        hasher.update(&[0]);
        match &self.key {
            Some(key) => hasher.update(key),
            None => hasher.update(event_id.as_bytes()),
        }
        (hasher.finalize() % SLOTS as u32) as i32
    }
}

/// A message waiting in the outbox, as a relay reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxMessage {
    /// The row's id: the order of enqueueing.
    pub id: i64,
    /// The event id, also in the `idem-event-id` header of [`OutboxMessage::message`].
    pub event_id: String,
    /// The destination.
    pub destination: String,
    /// The key.
    pub key: Option<Vec<u8>>,
    /// The body.
    pub payload: Vec<u8>,
    /// The headers as enqueued.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The slot.
    pub slot: i32,
    /// Failed delivery attempts so far.
    pub attempts: i32,
    /// The last failure's reason.
    pub last_error: Option<String>,
    /// How long it has waited, in seconds.
    pub age_seconds: f64,
}

impl OutboxMessage {
    /// The message to publish: topic the destination, the key, the payload, the headers with `idem-event-id`
    /// first. Its partition and offset are the slot and the outbox id (a broker chooses its own).
    pub fn message(&self) -> Message {
        let mut headers = Vec::with_capacity(self.headers.len() + 1);
        headers.push((EVENT_ID_HEADER.to_owned(), self.event_id.clone().into_bytes()));
        headers.extend(self.headers.iter().filter(|(name, _)| name != EVENT_ID_HEADER).cloned());
        Message {
            topic: self.destination.clone(),
            partition: self.slot,
            offset: self.id,
            key: self.key.clone(),
            payload: self.payload.clone(),
            headers,
            timestamp_ms: None,
            ack_handle: None,
            dead_letter_reason: None,
        }
    }
}

/// Where an application's outbox lives: its tables (schema and prefix, as the consumer's).
#[derive(Debug, Clone, Default)]
pub struct Outbox {
    tables: Tables,
}

impl Outbox {
    /// The outbox in `tables`.
    pub fn new(tables: Tables) -> Self {
        Outbox { tables }
    }

    /// The tables.
    pub fn tables(&self) -> &Tables {
        &self.tables
    }

    /// Enqueues `message` in the open transaction on `conn`; returns its event id. Delivered only if the
    /// transaction commits.
    pub async fn enqueue<C: OutboxConnection>(
        &self,
        conn: &mut C,
        message: OutgoingMessage,
    ) -> Result<String, sqlx::Error> {
        let mut ids = self.enqueue_all(conn, std::slice::from_ref(&message)).await?;
        Ok(ids.pop().unwrap_or_default())
    }

    /// Enqueues `messages` in order, in one statement, in the open transaction on `conn`; returns their event
    /// ids in the same order.
    pub async fn enqueue_all<C: OutboxConnection>(
        &self,
        conn: &mut C,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<String>, sqlx::Error> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        // The trace context of the enqueuing span travels with each message, so the relay's delivery continues it.
        let traced: Vec<OutgoingMessage>;
        let messages = match crate::propagation::with_current(&[]) {
            std::borrow::Cow::Owned(context) => {
                traced = messages
                    .iter()
                    .map(|m| {
                        let mut m = m.clone();
                        m.headers.retain(|(name, _)| !context.iter().any(|(c, _)| c.eq_ignore_ascii_case(name)));
                        m.headers.extend(context.iter().cloned());
                        m
                    })
                    .collect();
                &traced[..]
            }
            std::borrow::Cow::Borrowed(_) => messages,
        };
        let rows: Vec<store::NewRow<'_>> = messages
            .iter()
            .map(|m| {
                let event_id = m.event_id.clone().unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
                store::NewRow { slot: m.slot(&event_id), event_id, message: m }
            })
            .collect();
        <C::Store as OutboxStore>::enqueue(conn, &self.tables, &rows).await?;
        Ok(rows.into_iter().map(|r| r.event_id).collect())
    }
}

/// Enqueues `message` in the open transaction on `conn`, in the default tables; returns its event id. See
/// [`Outbox::enqueue`].
///
/// ```no_run
/// # async fn credit(tx: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
/// use idem::outbox::{OutgoingMessage, enqueue};
/// sqlx::query("UPDATE accounts SET balance = balance + 10 WHERE id = 7").execute(&mut *tx).await?;
/// let event = OutgoingMessage::new("payment-credited", r#"{"account":7,"amount":10}"#).with_key("7");
/// enqueue(&mut *tx, event).await?; // published by the relay once this transaction commits
/// # Ok(()) }
/// ```
pub async fn enqueue<C: OutboxConnection>(conn: &mut C, message: OutgoingMessage) -> Result<String, sqlx::Error> {
    Outbox::default().enqueue(conn, message).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_keeps_its_slot_and_keyless_messages_spread() {
        let a = OutgoingMessage::new("t", "x").with_key("k");
        assert_eq!(a.slot("1"), a.slot("2"), "the slot of a keyed message ignores the event id");
        assert_ne!(a.slot("1"), OutgoingMessage::new("u", "x").with_key("k").slot("1"), "destinations differ");
        let slots: std::collections::HashSet<i32> =
            (0..200).map(|i| OutgoingMessage::new("t", "x").slot(&i.to_string())).collect();
        assert!(slots.len() > SLOTS as usize / 2, "{}", slots.len());
        assert!(slots.iter().all(|s| (0..SLOTS).contains(s)));
    }

    #[test]
    fn the_published_message_carries_the_event_id_once_and_first() {
        let row = OutboxMessage {
            id: 9,
            event_id: "e1".into(),
            destination: "t".into(),
            key: Some(b"k".to_vec()),
            payload: b"p".to_vec(),
            headers: vec![(EVENT_ID_HEADER.into(), b"forged".to_vec()), ("a".into(), b"1".to_vec())],
            slot: 3,
            attempts: 0,
            last_error: None,
            age_seconds: 0.0,
        };
        let m = row.message();
        assert_eq!(m.header(EVENT_ID_HEADER), Some(&b"e1"[..]));
        assert_eq!(m.headers.len(), 2);
        assert_eq!((m.topic.as_str(), m.partition, m.offset), ("t", 3, 9));
    }
}
