//! The broker-neutral message and the event the handler sees.
//!
//! Every source (the embedded log, Kafka, ...) turns what it received into a [`Message`]: where it came from
//! (topic, partition, offset), its key, payload and headers. The engine extracts the idempotency key with the
//! configured [`KeyExtractor`](crate::KeyExtractor) and hands the handler an [`Event`]: the message plus its id.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::error::HandlerError;

/// A broker's own handle for acknowledging one delivery (a RabbitMQ delivery tag, an SQS receipt handle, a
/// JetStream message), carried opaquely by the [`Message`] from the source that made it back to that source's
/// [`Source::ack`](crate::Source::ack). Offset brokers (Kafka, the embedded log) need none. Cheap to clone; two
/// handles are equal when they are clones of one another.
#[derive(Clone)]
pub struct AckHandle(Arc<dyn Any + Send + Sync>);

impl AckHandle {
    /// Wraps a source's own handle.
    pub fn new<T: Any + Send + Sync>(handle: T) -> Self {
        AckHandle(Arc::new(handle))
    }

    /// The source's handle, when it is a `T`.
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }
}

impl fmt::Debug for AckHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AckHandle(..)")
    }
}

impl PartialEq for AckHandle {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for AckHandle {}

/// The header holding a producer-assigned event id, which idem's producers (Kafka, NATS) stamp on every event.
/// Consume such events with `KeyExtractor::Header("idem-event-id")`.
pub const EVENT_ID_HEADER: &str = "idem-event-id";

/// One message as a broker delivered it, independent of the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The topic (Kafka), queue or stream the message was read from.
    pub topic: String,
    /// The partition within the topic; sources without partitions use 0.
    pub partition: i32,
    /// The position of the message within its partition; strictly increasing per partition. A broker without
    /// positions (SQS) gives a number that identifies the message instead, the same on each of its deliveries.
    pub offset: i64,
    /// The message key, if the producer set one.
    pub key: Option<Vec<u8>>,
    /// The message body.
    pub payload: Vec<u8>,
    /// Headers in the order the producer wrote them; a name may repeat.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The producer's or broker's timestamp, milliseconds since the Unix epoch, when known.
    pub timestamp_ms: Option<i64>,
    /// The source's handle for acknowledging this delivery, on brokers that acknowledge each message by its own
    /// handle; `None` on offset brokers and for messages built by hand.
    pub ack_handle: Option<AckHandle>,
    /// Set by a source when the broker will not deliver this message again (its delivery limit is reached, e.g.
    /// JetStream's `max_deliver`): the engine does not call the handler; it dead-letters the message with this
    /// reason, in the transaction that writes its marker, unless the marker shows it was handled already. A
    /// message that crashes the process on every delivery is kept this way instead of being dropped by the
    /// broker. `None` for every other message.
    pub dead_letter_reason: Option<String>,
}

impl Message {
    /// A message with only a topic, partition, offset and payload; add a key or headers with the `with_` methods.
    pub fn new(topic: impl Into<String>, partition: i32, offset: i64, payload: impl Into<Vec<u8>>) -> Self {
        Message {
            topic: topic.into(),
            partition,
            offset,
            key: None,
            payload: payload.into(),
            headers: Vec::new(),
            timestamp_ms: None,
            ack_handle: None,
            dead_letter_reason: None,
        }
    }

    /// Sets the message key.
    pub fn with_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Appends a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The value of the first header called `name`, if any.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice())
    }

    /// The broker's identity of this message: `topic/partition/offset`. Stable for as long as the topic exists;
    /// a recreated topic restarts its offsets, so prefer a producer-assigned id (see [`crate::KeyExtractor`]).
    pub fn broker_id(&self) -> String {
        format!("{}/{}/{}", self.topic, self.partition, self.offset)
    }
}

/// A message with its idempotency key: what a handler receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The idempotency key the configured extractor found; the marker is stored under it.
    pub id: String,
    /// The message as delivered.
    pub message: Message,
    /// What the handler made of it (see [`Handled`]); reset before each attempt.
    handled: HandledCell,
    /// Its span while the engine handles it.
    span: SpanCell,
}

/// An event's span; not part of its equality.
#[derive(Clone, Debug)]
struct SpanCell(tracing::Span);

impl PartialEq for SpanCell {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for SpanCell {}

/// What a handler made of an event that committed, when it was not simply applied. The guards
/// ([`crate::guard`]) set it; a handler in the natural-key mode ([`crate::Dedup::NaturalKey`]) sets
/// [`Handled::AlreadyApplied`] when its own unique insert found the row. The engine counts and logs the event's
/// outcome from it: `processed`, `duplicate`, `stale` or `rejected`. The transaction commits in every case (with the
/// marker, so a redelivery is a plain duplicate).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum Handled {
    /// The effect was applied (the default).
    #[default]
    Applied = 0,
    /// The effect was found applied already (the natural-key mode's duplicate).
    AlreadyApplied = 1,
    /// An ordering guard found the event older than the state it would change; nothing was applied.
    Stale = 2,
    /// A state-machine guard found the event not allowed in the entity's current state; nothing was applied.
    Rejected = 3,
}

/// The [`Handled`] of an event, settable through `&Event`.
#[derive(Default)]
struct HandledCell(std::sync::atomic::AtomicU8);

impl HandledCell {
    fn get(&self) -> Handled {
        match self.0.load(std::sync::atomic::Ordering::Relaxed) {
            1 => Handled::AlreadyApplied,
            2 => Handled::Stale,
            3 => Handled::Rejected,
            _ => Handled::Applied,
        }
    }

    fn set(&self, handled: Handled) {
        self.0.store(handled as u8, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Clone for HandledCell {
    fn clone(&self) -> Self {
        let cell = HandledCell::default();
        cell.set(self.get());
        cell
    }
}

/// Two events are equal by id and message; what a handler made of them is not part of it.
impl PartialEq for HandledCell {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for HandledCell {}

impl fmt::Debug for HandledCell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.get(), f)
    }
}

impl Event {
    /// The event of `message` under the idempotency key `id`.
    pub fn new(id: impl Into<String>, message: Message) -> Self {
        Event { id: id.into(), message, handled: HandledCell::default(), span: SpanCell(tracing::Span::none()) }
    }

    /// The event's span while the engine handles it (`process <topic>`, a child of the producer's trace context
    /// when the message carries one); the handler runs inside it. A disabled span outside the engine.
    pub fn span(&self) -> &tracing::Span {
        &self.span.0
    }

    /// The event with `span` as its span.
    pub(crate) fn with_span(mut self, span: tracing::Span) -> Self {
        self.span = SpanCell(span);
        self
    }

    /// Records what the handler made of this event (see [`Handled`]). The last call of an attempt counts.
    pub fn mark(&self, handled: Handled) {
        self.handled.set(handled);
    }

    /// What the handler made of this event so far in this attempt.
    pub fn handled(&self) -> Handled {
        self.handled.get()
    }

    /// The message body.
    pub fn payload(&self) -> &[u8] {
        &self.message.payload
    }

    /// Decodes the payload as JSON. A payload that does not decode is a permanent error: returned with `?` from
    /// a handler, it sends the message to the dead-letter table with the decoder's reason.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, HandlerError> {
        serde_json::from_slice(&self.message.payload)
            .map_err(|e| HandlerError::permanent(format!("payload is not the expected JSON: {e}")))
    }
}
