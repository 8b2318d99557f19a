//! A small JetStream producer: every message carries `Nats-Msg-Id`, so the server's duplicate window drops a
//! producer's retry of the same message (JetStream's counterpart of Kafka's idempotent producer), and the same
//! id in `idem-event-id`, so consumers can use `KeyExtractor::Header("idem-event-id")`.

use async_nats::HeaderMap;

use super::connect;
use crate::error::Error;
use crate::message::{EVENT_ID_HEADER, Message};
use crate::source::{Publisher, SourceError};

/// The header JetStream deduplicates on within the stream's duplicate window.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// Publishes to JetStream with a message id on every message, waiting for the server's acknowledgement.
pub struct NatsProducer {
    js: async_nats::jetstream::Context,
}

/// What the server said about one published message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The message's sequence in its stream.
    pub sequence: u64,
    /// The event id it carries (`Nats-Msg-Id` and `idem-event-id`).
    pub event_id: String,
    /// The server had this id already within the duplicate window and did not store the message again.
    pub duplicate: bool,
}

impl NatsProducer {
    /// Connects to `url`.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Ok(NatsProducer { js: async_nats::jetstream::new(connect(url).await?) })
    }

    /// The stream that holds `subject`, or why none can: no stream holds it (with the fix), or the subject is not
    /// a valid one. A relay asks this of the destinations waiting in the outbox when it starts, so a missing
    /// stream is said before the first delivery fails.
    pub async fn stream_holding(&self, subject: &str) -> Result<String, SourceError> {
        use async_nats::jetstream::context::GetStreamByNameErrorKind;
        self.js.stream_by_subject(subject).await.map_err(|error| match error.kind() {
            GetStreamByNameErrorKind::NotFound => SourceError::permanent("nats stream", no_stream_holds(subject)),
            GetStreamByNameErrorKind::InvalidSubject => {
                SourceError::permanent("nats stream", format!("{subject} is not a valid NATS subject"))
            }
            _ => SourceError::transient("nats stream", error),
        })
    }

    /// Publishes `payload` to `subject` and waits until the stream stored it. The event id is the
    /// `idem-event-id` of `headers` when there is one (a retry or a replay keeps its id), else a new UUIDv7.
    /// Header values must be text (NATS headers are).
    pub async fn send(
        &self,
        subject: &str,
        payload: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<Published, SourceError> {
        let (map, event_id) = stamp(&crate::propagation::with_current(headers))?;
        let ack = self
            .js
            .publish_with_headers(subject.to_owned(), map, payload.to_vec().into())
            .await
            .map_err(|e| publish_error(subject, e))?
            .await
            .map_err(|e| publish_error(subject, e))?;
        Ok(Published { sequence: ack.sequence, event_id, duplicate: ack.duplicate })
    }

    /// Publishes `messages` (subject, payload) in order, without waiting for each acknowledgement before the next
    /// publish, then waits for all of them: the stream holds them in this order.
    pub async fn send_in_order(&self, messages: &[(String, Vec<u8>)]) -> Result<Vec<Published>, SourceError> {
        let mut pending = Vec::with_capacity(messages.len());
        for (subject, payload) in messages {
            let (map, event_id) = stamp(&[])?;
            let ack = self
                .js
                .publish_with_headers(subject.clone(), map, payload.clone().into())
                .await
                .map_err(|e| publish_error(subject, e))?;
            pending.push((ack, subject, event_id));
        }
        let mut published = Vec::with_capacity(pending.len());
        for (ack, subject, event_id) in pending {
            let ack = ack.await.map_err(|e| publish_error(subject, e))?;
            published.push(Published { sequence: ack.sequence, event_id, duplicate: ack.duplicate });
        }
        Ok(published)
    }
}

/// A failed publish to `subject`, said with its fix where there is one: no stream holds the subject (the
/// server has nowhere to store it) is named so, and still retried, since the stream may be created meanwhile.
fn publish_error(subject: &str, error: async_nats::jetstream::context::PublishError) -> SourceError {
    use async_nats::jetstream::context::PublishErrorKind;
    match error.kind() {
        PublishErrorKind::StreamNotFound => {
            SourceError::transient("nats publish", format!("{}; retrying meanwhile", no_stream_holds(subject)))
        }
        _ => SourceError::transient("nats publish", error),
    }
}

/// That no stream holds `subject`, with the fix.
fn no_stream_holds(subject: &str) -> String {
    format!(
        "no JetStream stream holds the subject {subject}: create one that does (nats stream add NAME --subjects \
         '{subject}'), or add the subject to an existing stream"
    )
}

/// The headers of one message: the caller's, plus the event id (`idem-event-id`, kept when given) as
/// `Nats-Msg-Id` unless that is given too.
fn stamp(headers: &[(String, Vec<u8>)]) -> Result<(HeaderMap, String), SourceError> {
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        let value = std::str::from_utf8(value).map_err(|_| {
            SourceError::permanent("nats publish", format!("header {name} is not UTF-8 text, which NATS headers need"))
        })?;
        map.append(name.as_str(), value);
    }
    let event_id = match headers.iter().find(|(n, _)| n == EVENT_ID_HEADER) {
        Some((_, id)) => String::from_utf8_lossy(id).into_owned(),
        None => {
            let id = uuid::Uuid::now_v7().to_string();
            map.insert(EVENT_ID_HEADER, id.as_str());
            id
        }
    };
    if !headers.iter().any(|(n, _)| n == MSG_ID_HEADER) {
        map.insert(MSG_ID_HEADER, event_id.as_str());
    }
    Ok((map, event_id))
}

impl Publisher for NatsProducer {
    /// Publishes to the message's subject, which the NATS source keeps in [`Message::key`], under a new
    /// `Nats-Msg-Id`: a replay is a deliberate second publication, which the server's duplicate window must not
    /// drop. The event id (`idem-event-id`) stays, so the markers still recognise the event.
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let subject = message.key.as_deref().and_then(|k| std::str::from_utf8(k).ok()).ok_or_else(|| {
            SourceError::permanent("nats publish", "the message has no subject (its key): it did not come from NATS")
        })?;
        let mut headers: Vec<(String, Vec<u8>)> =
            message.headers.iter().filter(|(name, _)| name != MSG_ID_HEADER).cloned().collect();
        headers.push((MSG_ID_HEADER.to_owned(), uuid::Uuid::now_v7().to_string().into_bytes()));
        self.send(subject, &message.payload, &headers).await.map(drop)
    }
}
