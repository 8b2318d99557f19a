//! A small SQS producer: every message carries an event id (`idem-event-id`, UUIDv7, kept when given), which on
//! FIFO queues is also its `MessageDeduplicationId`, so the queue's five-minute deduplication drops a producer's
//! retry; the key is the FIFO `MessageGroupId`. Headers travel as message attributes.

use std::collections::HashMap;

use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};

use super::{MESSAGE_ID_HEADER, QueueInfo, RECEIVE_COUNT_HEADER, describe};
use crate::error::Error;
use crate::message::{EVENT_ID_HEADER, Message};
use crate::source::{Publisher, SourceError};

/// SQS's limit of message attributes per message.
const MAX_ATTRIBUTES: usize = 10;

/// Sends to SQS queues with an event id on every message.
pub struct SqsProducer {
    client: aws_sdk_sqs::Client,
    /// Queue name → its URL and whether it is FIFO, found once.
    queues: tokio::sync::Mutex<HashMap<String, (String, bool)>>,
}

/// What SQS said about one sent message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The id SQS gave it.
    pub message_id: String,
    /// The event id it carries (`idem-event-id`; on FIFO queues also its `MessageDeduplicationId`).
    pub event_id: String,
}

/// One message to send: its key (the FIFO message group), body and headers.
#[derive(Debug, Clone, Default)]
pub struct Outgoing {
    /// The FIFO `MessageGroupId`; without one a FIFO message is a group of its own (no order with others).
    /// Standard queues ignore it.
    pub key: Option<Vec<u8>>,
    /// The body, which SQS requires to be text.
    pub payload: Vec<u8>,
    /// Headers, sent as message attributes (at most ten in all, with the event id).
    pub headers: Vec<(String, Vec<u8>)>,
}

impl SqsProducer {
    /// A producer from the standard AWS configuration, with `endpoint` and `region` when given.
    pub async fn connect(endpoint: Option<&str>, region: Option<&str>) -> Result<Self, Error> {
        Ok(Self::with_client(super::client(endpoint, region).await?))
    }

    /// A producer on an existing client.
    pub fn with_client(client: aws_sdk_sqs::Client) -> Self {
        SqsProducer { client, queues: tokio::sync::Mutex::new(HashMap::new()) }
    }

    async fn resolve(&self, queue: &str) -> Result<(String, bool), SourceError> {
        let mut queues = self.queues.lock().await;
        if let Some(found) = queues.get(queue) {
            return Ok(found.clone());
        }
        let QueueInfo { url, fifo, .. } =
            super::queue_info(&self.client, queue).await.map_err(|e| SourceError::permanent("sqs send", e))?;
        queues.insert(queue.to_owned(), (url.clone(), fifo));
        Ok((url, fifo))
    }

    /// Sends `payload` to `queue` (a name or URL) and returns once SQS stored it. The event id is the
    /// `idem-event-id` of `headers` when there is one (a retry keeps its id, and a FIFO queue drops it within its
    /// deduplication window), else a new UUIDv7.
    pub async fn send(
        &self,
        queue: &str,
        key: Option<&[u8]>,
        payload: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<Published, SourceError> {
        let outgoing = Outgoing {
            key: key.map(<[u8]>::to_vec),
            payload: payload.to_vec(),
            headers: crate::propagation::with_current(headers).into_owned(),
        };
        self.send_one(queue, &outgoing, None).await
    }

    /// Sends one message to `queue`; `dedup` overrides its FIFO deduplication id.
    async fn send_one(
        &self,
        queue: &str,
        outgoing: &Outgoing,
        dedup: Option<String>,
    ) -> Result<Published, SourceError> {
        let (url, fifo) = self.resolve(queue).await?;
        let (entry, event_id) = entry("0", outgoing, fifo, dedup)?;
        let sent = self
            .client
            .send_message()
            .queue_url(url)
            .message_body(entry.message_body())
            .set_message_attributes(entry.message_attributes().cloned())
            .set_message_group_id(entry.message_group_id().map(str::to_owned))
            .set_message_deduplication_id(entry.message_deduplication_id().map(str::to_owned))
            .send()
            .await
            .map_err(|e| SourceError::transient("sqs send", describe(&e)))?;
        Ok(Published { message_id: sent.message_id().unwrap_or_default().to_owned(), event_id })
    }

    /// Sends `messages` to `queue` in order, ten per request (`SendMessageBatch`); a FIFO queue keeps their order
    /// within each group.
    pub async fn send_in_order(&self, queue: &str, messages: &[Outgoing]) -> Result<Vec<Published>, SourceError> {
        let (url, fifo) = self.resolve(queue).await?;
        let mut published = Vec::with_capacity(messages.len());
        for chunk in messages.chunks(10) {
            let mut entries = Vec::with_capacity(chunk.len());
            let mut ids = Vec::with_capacity(chunk.len());
            for (n, outgoing) in chunk.iter().enumerate() {
                let (entry, event_id) = entry(&n.to_string(), outgoing, fifo, None)?;
                entries.push(entry);
                ids.push(event_id);
            }
            let sent = self
                .client
                .send_message_batch()
                .queue_url(&url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| SourceError::transient("sqs send", describe(&e)))?;
            if let Some(failed) = sent.failed().first() {
                return Err(SourceError::transient(
                    "sqs send",
                    format!(
                        "{} of a batch not sent: {}: {}",
                        sent.failed().len(),
                        failed.code(),
                        failed.message().unwrap_or_default()
                    ),
                ));
            }
            let mut by_entry: Vec<(usize, String)> = sent
                .successful()
                .iter()
                .map(|s| (s.id().parse().unwrap_or(usize::MAX), s.message_id().to_owned()))
                .collect();
            by_entry.sort();
            for (n, message_id) in by_entry {
                let event_id = ids.get(n).cloned().unwrap_or_default();
                published.push(Published { message_id, event_id });
            }
        }
        Ok(published)
    }
}

/// One message as a batch entry with id `id`, and its event id. `dedup` overrides the FIFO deduplication id
/// (a replay's fresh one).
fn entry(
    id: &str,
    outgoing: &Outgoing,
    fifo: bool,
    dedup: Option<String>,
) -> Result<(SendMessageBatchRequestEntry, String), SourceError> {
    let body = std::str::from_utf8(&outgoing.payload).map_err(|_| {
        SourceError::permanent(
            "sqs send",
            "the payload is not UTF-8 text, which SQS bodies must be: encode it (base64)",
        )
    })?;
    let event_id = match outgoing.headers.iter().find(|(n, _)| n == EVENT_ID_HEADER) {
        Some((_, id)) => String::from_utf8_lossy(id).into_owned(),
        None => uuid::Uuid::now_v7().to_string(),
    };
    let mut attributes = HashMap::new();
    for (name, value) in &outgoing.headers {
        // What the source adds on receipt is not sent again.
        if name == MESSAGE_ID_HEADER || name == RECEIVE_COUNT_HEADER {
            continue;
        }
        let attribute = match std::str::from_utf8(value) {
            Ok(text) => MessageAttributeValue::builder().data_type("String").string_value(text),
            Err(_) => MessageAttributeValue::builder().data_type("Binary").binary_value(Blob::new(value.clone())),
        };
        attributes.insert(name.clone(), attribute.build().map_err(|e| SourceError::permanent("sqs send", e))?);
    }
    if !attributes.contains_key(EVENT_ID_HEADER) {
        let value = MessageAttributeValue::builder().data_type("String").string_value(&event_id).build();
        attributes.insert(EVENT_ID_HEADER.to_owned(), value.map_err(|e| SourceError::permanent("sqs send", e))?);
    }
    if attributes.len() > MAX_ATTRIBUTES {
        return Err(SourceError::permanent(
            "sqs send",
            format!(
                "{} headers with the event id: SQS carries at most {MAX_ATTRIBUTES} message attributes. Fix: send \
                 fewer headers, or put them in the body",
                attributes.len()
            ),
        ));
    }
    let mut entry =
        SendMessageBatchRequestEntry::builder().id(id).message_body(body).set_message_attributes(Some(attributes));
    if fifo {
        let group = match &outgoing.key {
            Some(key) => String::from_utf8(key.clone()).map_err(|_| {
                SourceError::permanent("sqs send", "the key (the FIFO MessageGroupId) is not UTF-8 text")
            })?,
            None => event_id.clone(),
        };
        entry = entry.message_group_id(group).message_deduplication_id(dedup.unwrap_or_else(|| event_id.clone()));
    }
    let entry = entry.build().map_err(|e| SourceError::permanent("sqs send", e))?;
    Ok((entry, event_id))
}

impl Publisher for SqsProducer {
    /// Sends to the message's queue (its topic) in its group (its key), under a new deduplication id: a replay is
    /// a deliberate second sending, which the queue's deduplication must not drop. The event id
    /// (`idem-event-id`) stays, so the markers still recognise the event.
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let outgoing =
            Outgoing { key: message.key.clone(), payload: message.payload.clone(), headers: message.headers.clone() };
        self.send_one(&message.topic, &outgoing, Some(uuid::Uuid::now_v7().to_string())).await.map(drop)
    }
}
