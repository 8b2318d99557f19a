//! The SQS source: long-polled receives into a small buffer, each message deleted by its receipt handle after
//! its transaction commits, and the visibility of what is in hand extended while it is in hand.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry, MessageSystemAttributeName,
    QueueAttributeName,
};

use super::{MESSAGE_ID_HEADER, QueueInfo, RECEIVE_COUNT_HEADER, SQS_QUEUE, SqsConfig, describe, visibility_guard};
use crate::backoff::Backoff;
use crate::error::Error;
use crate::key::KeyExtractor;
use crate::message::{AckHandle, Message};
use crate::retention::RetentionPolicy;
use crate::source::{Acknowledgement, Received, Source, SourceError};

/// SQS's limit of messages per receive, delete or visibility request.
const PER_REQUEST: usize = 10;
/// How long `recv` polls when the source should end at the queue's end, so the end is noticed soon.
const END_POLL: Duration = Duration::from_secs(1);
/// Attempts at deleting a batch's messages before leaving them to reappear (and be absorbed as duplicates).
const DELETE_ATTEMPTS: u32 = 4;
/// The pause between the attempts of one delete request.
const DELETE_BACKOFF: Backoff = Backoff::new(Duration::from_millis(400), Duration::from_secs(2));

/// A message received and not yet deleted: its receipt handle and until when it is invisible.
struct Held {
    receipt: String,
    visible_at: Instant,
}

/// What this consumer received and has not deleted, by message id.
type InHand = Arc<Mutex<HashMap<String, Held>>>;

/// The handle of one delivery: the receipt handle SQS deletes it by, and its message id.
#[derive(Debug)]
struct Receipt {
    message_id: String,
    handle: String,
}

/// Consumes one SQS queue (standard or FIFO) as a [`Source`]. See the module documentation of [`crate::sqs`].
pub struct SqsSource {
    client: aws_sdk_sqs::Client,
    queue: QueueInfo,
    config: SqsConfig,
    /// Messages per receive request: the engine's batch size, at most ten.
    per_receive: i32,
    buffer: tokio::sync::Mutex<VecDeque<Message>>,
    in_hand: InHand,
    extender: tokio::task::JoinHandle<()>,
    /// Reads the queue's backlog every [`BACKLOG_EVERY`] into [`crate::lag`].
    backlog: tokio::task::JoinHandle<()>,
}

/// How often the queue's backlog (`ApproximateNumberOfMessages`) is read.
const BACKLOG_EVERY: Duration = Duration::from_secs(15);

/// Records the messages waiting in the queue (visible ones, SQS's approximate count) as consumer group `group`'s
/// lag every [`BACKLOG_EVERY`], until aborted.
async fn watch_backlog(client: aws_sdk_sqs::Client, queue: QueueInfo, group: String) {
    loop {
        let attributes = client
            .get_queue_attributes()
            .queue_url(&queue.url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .send()
            .await;
        let waiting = attributes.ok().and_then(|a| {
            a.attributes()?.get(&QueueAttributeName::ApproximateNumberOfMessages)?.trim().parse::<i64>().ok()
        });
        if let Some(waiting) = waiting {
            crate::lag::record(&group, &queue.name, None, waiting);
        }
        tokio::time::sleep(BACKLOG_EVERY).await;
    }
}

/// What a consumer of `config` needs from SQS, checked without receiving anything: the credentials and the
/// endpoint answer, the queue exists, its visibility timeout covers a batch and it keeps messages longer than
/// `engine`'s markers. [`SqsSource::connect`] starts with the same; `idem check` runs it alone.
pub async fn check(config: &SqsConfig, engine: &crate::Config) -> Result<(), Error> {
    open_queue(config, engine).await.map(drop)
}

/// The client and the queue, with the checks of [`check`].
async fn open_queue(config: &SqsConfig, engine: &crate::Config) -> Result<(aws_sdk_sqs::Client, QueueInfo), Error> {
    config.validate()?;
    engine.validate()?;
    if engine.key == KeyExtractor::BrokerId {
        return Err(Error::Config(format!(
            "sqs: the broker-id key is refused: an SQS message has no offset that survives its redelivery, so \
             each delivery would look new. Fix: key on the producer's event id (header:idem-event-id), a \
             business key in the payload (json:/…), or the id SQS keeps across redeliveries \
             (header:{MESSAGE_ID_HEADER})"
        )));
    }
    let client = super::client(config.endpoint.as_deref(), config.region.as_deref()).await?;
    let queue = super::queue_info(&client, &config.queue).await?;
    visibility_guard(&queue.name, queue.visibility_timeout, config.max_batch_time)?;
    metrics::gauge!("idem_sqs_queue_retention_seconds", "queue" => queue.name.clone())
        .set(queue.retention.map_or(0.0, |r| r.as_secs_f64()));
    RetentionPolicy { marker_retention: engine.pruning.retention, accept_infinite_retention: false, broker: SQS_QUEUE }
        .check(&[(queue.name.clone(), queue.retention.map(|r| r.as_millis() as i64))])?;
    if let (Some(ours), Some(queues)) = (config.max_receive_count, queue.redrive_max_receive_count)
        && queues <= ours
    {
        tracing::warn!(queue = %queue.name, max_receive_count = ours, redrive_max_receive_count = queues,
            "sqs: the queue's redrive policy moves a message to its dead-letter queue after {queues} receives, \
             before idem's max_receive_count ({ours}) is reached: such messages leave without a dead-letter row \
             in the database. Raise the queue's maxReceiveCount above {ours} to have idem record them");
    }
    Ok((client, queue))
}

impl SqsSource {
    /// Validates `config` (and refuses the `broker-id` key, which SQS cannot keep stable), builds the client
    /// from the standard AWS configuration, finds the queue, runs the visibility-timeout and retention guards
    /// against its attributes, and starts extending the visibility of what is in hand.
    pub async fn connect(config: &SqsConfig, engine: &crate::Config) -> Result<Self, Error> {
        let (client, queue) = open_queue(config, engine).await?;
        tracing::info!(queue = %queue.name, fifo = queue.fifo, visibility_timeout = ?queue.visibility_timeout,
            retention = ?queue.retention, partitions = config.partitions, "sqs: consuming");
        let in_hand: InHand = Arc::default();
        let extender = tokio::spawn(keep_invisible(
            client.clone(),
            queue.url.clone(),
            Arc::clone(&in_hand),
            queue.visibility_timeout,
        ));
        let backlog = tokio::spawn(watch_backlog(client.clone(), queue.clone(), engine.group.clone()));
        Ok(SqsSource {
            backlog,
            client,
            per_receive: engine.batch_size.clamp(1, PER_REQUEST) as i32,
            queue,
            config: config.clone(),
            buffer: tokio::sync::Mutex::new(VecDeque::new()),
            in_hand,
            extender,
        })
    }

    /// The queue as read at start-up.
    pub fn queue(&self) -> &QueueInfo {
        &self.queue
    }

    /// One long-polled receive into `buffer`; how many messages came.
    async fn receive(&self, buffer: &mut VecDeque<Message>) -> Result<usize, SourceError> {
        let wait = if self.config.stop_at_end { self.config.wait_time.min(END_POLL) } else { self.config.wait_time };
        let received = self
            .client
            .receive_message()
            .queue_url(&self.queue.url)
            .max_number_of_messages(self.per_receive)
            .wait_time_seconds(wait.as_secs() as i32)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .map_err(|e| failure("sqs receive", &e))?;
        let messages = received.messages();
        for message in messages {
            buffer.push_back(self.to_message(message)?);
        }
        Ok(messages.len())
    }

    fn to_message(&self, message: &aws_sdk_sqs::types::Message) -> Result<Message, SourceError> {
        let (Some(id), Some(receipt)) = (message.message_id(), message.receipt_handle()) else {
            return Err(SourceError::permanent("sqs receive", "a message without a MessageId or receipt handle"));
        };
        let attribute = |name: MessageSystemAttributeName| message.attributes().and_then(|a| a.get(&name));
        let group = attribute(MessageSystemAttributeName::MessageGroupId).cloned();
        let receive_count: u32 =
            attribute(MessageSystemAttributeName::ApproximateReceiveCount).and_then(|n| n.parse().ok()).unwrap_or(1);
        if receive_count > 1 {
            metrics::counter!("idem_sqs_redelivered_total", "queue" => self.queue.name.clone()).increment(1);
        }
        let mut headers: Vec<(String, Vec<u8>)> = message
            .message_attributes()
            .map(|attributes| {
                attributes
                    .iter()
                    .filter_map(|(name, value)| {
                        let bytes = match (value.string_value(), value.binary_value()) {
                            (Some(text), _) => text.as_bytes().to_vec(),
                            (None, Some(blob)) => blob.as_ref().to_vec(),
                            (None, None) => return None,
                        };
                        Some((name.clone(), bytes))
                    })
                    .collect()
            })
            .unwrap_or_default();
        headers.sort();
        headers.push((MESSAGE_ID_HEADER.to_owned(), id.as_bytes().to_vec()));
        headers.push((RECEIVE_COUNT_HEADER.to_owned(), receive_count.to_string().into_bytes()));
        let spread_by = group.as_deref().unwrap_or(id);
        let partition = match self.config.partitions {
            0 | 1 => 0,
            n => (crc32fast::hash(spread_by.as_bytes()) % n) as i32,
        };
        let now = Instant::now();
        lock(&self.in_hand).insert(
            id.to_owned(),
            Held { receipt: receipt.to_owned(), visible_at: now + self.queue.visibility_timeout },
        );
        Ok(Message {
            topic: self.queue.name.clone(),
            partition,
            offset: offset_of(id),
            key: group.map(String::into_bytes),
            payload: message.body().unwrap_or_default().as_bytes().to_vec(),
            headers,
            timestamp_ms: attribute(MessageSystemAttributeName::SentTimestamp).and_then(|t| t.parse().ok()),
            ack_handle: Some(AckHandle::new(Receipt { message_id: id.to_owned(), handle: receipt.to_owned() })),
            dead_letter_reason: self.past_limit(receive_count),
        })
    }

    /// The reason to dead-letter a message received `count` times, past [`SqsConfig::max_receive_count`].
    fn past_limit(&self, count: u32) -> Option<String> {
        let limit = self.config.max_receive_count?;
        (count > limit).then(|| {
            format!(
                "received {count} times, more than max_receive_count ({limit}): idem kept it as a dead letter instead \
                 of calling the handler again (a message that crashes or stalls the consumer ends here). Replay it \
                 with idem dead-letters replay --sqs ENDPOINT once the cause is fixed"
            )
        })
    }

    /// Whether the queue holds nothing, visible, delayed or in flight, but what this consumer has in hand (a
    /// crashed consumer's messages come back after the visibility timeout, so they count).
    async fn at_end(&self) -> Result<bool, SourceError> {
        let attributes = self
            .client
            .get_queue_attributes()
            .queue_url(&self.queue.url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
            .send()
            .await
            .map_err(|e| failure("sqs queue attributes", &e))?;
        let count = |name: QueueAttributeName| {
            attributes.attributes().and_then(|a| a.get(&name)).and_then(|n| n.parse::<usize>().ok()).unwrap_or(0)
        };
        let ours = lock(&self.in_hand).len();
        Ok(count(QueueAttributeName::ApproximateNumberOfMessages) == 0
            && count(QueueAttributeName::ApproximateNumberOfMessagesDelayed) == 0
            && count(QueueAttributeName::ApproximateNumberOfMessagesNotVisible) <= ours)
    }

    /// Deletes `receipts` (at most ten); the ids SQS did not delete, with why.
    async fn delete(&self, receipts: &[&Receipt]) -> Result<Vec<(String, String)>, SourceError> {
        let entries: Vec<DeleteMessageBatchRequestEntry> = receipts
            .iter()
            .enumerate()
            .map(|(n, r)| DeleteMessageBatchRequestEntry::builder().id(n.to_string()).receipt_handle(&r.handle).build())
            .collect::<Result<_, _>>()
            .map_err(|e| SourceError::permanent("sqs delete", e))?;
        let deleted = self
            .client
            .delete_message_batch()
            .queue_url(&self.queue.url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| failure("sqs delete", &e))?;
        Ok(deleted
            .failed()
            .iter()
            .map(|f| {
                let id = f.id().parse::<usize>().ok().and_then(|n| receipts.get(n)).map(|r| r.message_id.clone());
                (id.unwrap_or_default(), format!("{}: {}", f.code(), f.message().unwrap_or_default()))
            })
            .collect())
    }
}

/// The offset of the message with SQS id `id`. SQS has no positions, so the offset identifies the message
/// instead: the same on every delivery of it (63 bits of its id's SHA-256), so a message without a key is
/// recognised as the same dead letter when it comes again.
fn offset_of(id: &str) -> i64 {
    use sha2::Digest;
    crate::store::offset_from_digest(&sha2::Sha256::digest(id.as_bytes()))
}

/// A failed call while consuming: gone queues and refused rights do not pass by retrying; the rest may.
fn failure<E, R>(context: &'static str, error: &aws_sdk_sqs::error::SdkError<E, R>) -> SourceError
where
    E: aws_sdk_sqs::error::ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    use aws_sdk_sqs::error::ProvideErrorMetadata;
    let code = error.code().unwrap_or_default();
    let text = match error.message() {
        Some(message) => format!("{code}: {message}"),
        None => describe(error),
    };
    match code {
        "AWS.SimpleQueueService.NonExistentQueue" | "QueueDoesNotExist" | "AccessDenied" | "AccessDeniedException" => {
            SourceError::permanent(context, text)
        }
        _ => SourceError::transient(context, text),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Extends the visibility of every message in hand whose timeout is less than half away, back to the queue's
/// full timeout, so nothing reappears while its batch runs.
async fn keep_invisible(client: aws_sdk_sqs::Client, url: String, in_hand: InHand, timeout: Duration) {
    let mut tick = tokio::time::interval((timeout / 4).max(Duration::from_millis(100)));
    let seconds = timeout.as_secs().max(1) as i32;
    loop {
        tick.tick().await;
        let now = Instant::now();
        let due: Vec<(String, String)> = lock(&in_hand)
            .iter()
            .filter(|(_, held)| held.visible_at.saturating_duration_since(now) < timeout / 2)
            .map(|(id, held)| (id.clone(), held.receipt.clone()))
            .collect();
        for chunk in due.chunks(PER_REQUEST) {
            let entries: Result<Vec<_>, _> = chunk
                .iter()
                .enumerate()
                .map(|(n, (_, receipt))| {
                    ChangeMessageVisibilityBatchRequestEntry::builder()
                        .id(n.to_string())
                        .receipt_handle(receipt)
                        .visibility_timeout(seconds)
                        .build()
                })
                .collect();
            let Ok(entries) = entries else { continue };
            match client.change_message_visibility_batch().queue_url(&url).set_entries(Some(entries)).send().await {
                Ok(changed) => {
                    let mut held = lock(&in_hand);
                    for entry in changed.successful() {
                        let id = entry.id().parse::<usize>().ok().and_then(|n| chunk.get(n));
                        if let Some(message) = id.and_then(|(id, _)| held.get_mut(id)) {
                            message.visible_at = now + timeout;
                        }
                    }
                    metrics::counter!("idem_sqs_visibility_extended_total")
                        .increment(changed.successful().len() as u64);
                    for failed in changed.failed() {
                        tracing::warn!(
                            code = failed.code(),
                            message = failed.message().unwrap_or_default(),
                            "sqs: the visibility of a message in hand could not be extended; it may reappear and be \
                             absorbed as a duplicate"
                        );
                    }
                }
                Err(error) => {
                    tracing::warn!(error = %describe(&error), "sqs: extending the visibility of messages in hand failed")
                }
            }
        }
    }
}

impl Source for SqsSource {
    const SYSTEM: &'static str = "aws_sqs";

    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        let mut buffer = self.buffer.lock().await;
        loop {
            if let Some(message) = buffer.pop_front() {
                return Ok(Some(Received::Message(message)));
            }
            if self.receive(&mut buffer).await? == 0 && self.config.stop_at_end && self.at_end().await? {
                tracing::info!(queue = %self.queue.name, "sqs: nothing left in the queue");
                return Ok(None);
            }
        }
    }

    /// Deletes the acknowledged messages, ten per request, retrying a failed request a few times; what still
    /// fails reappears after the visibility timeout and is absorbed as a duplicate.
    async fn ack(&self, ack: &Acknowledgement) -> Result<(), SourceError> {
        let mut receipts = Vec::with_capacity(ack.handles.len());
        for handle in &ack.handles {
            let Some(receipt) = handle.get::<Receipt>() else {
                return Err(SourceError::permanent("sqs delete", "a handle that is not an SQS receipt"));
            };
            receipts.push(receipt);
        }
        let mut result = Ok(());
        for chunk in receipts.chunks(PER_REQUEST) {
            let mut attempt = 0;
            let outcome = loop {
                attempt += 1;
                match self.delete(chunk).await {
                    Err(error) if attempt < DELETE_ATTEMPTS && error.retry() == crate::Retry::Helps => {
                        tokio::time::sleep(DELETE_BACKOFF.after(attempt)).await;
                    }
                    other => break other,
                }
            };
            match outcome {
                Ok(failed) if failed.is_empty() => {}
                Ok(failed) => {
                    result = Err(SourceError::transient(
                        "sqs delete",
                        format!("{} of {} messages not deleted: {:?}", failed.len(), chunk.len(), failed),
                    ))
                }
                Err(error) => result = Err(error),
            }
            // Deleted or not, they are no longer kept invisible: what was not deleted reappears.
            let mut held = lock(&self.in_hand);
            for receipt in chunk {
                held.remove(&receipt.message_id);
            }
        }
        result
    }
}

impl Drop for SqsSource {
    fn drop(&mut self) {
        self.extender.abort();
        self.backlog.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::offset_of;

    #[test]
    fn a_message_has_the_same_offset_on_every_delivery_and_distinct_messages_differ() {
        let id = "5fea7756-0ea4-451a-a703-a558b933e274";
        assert_eq!(offset_of(id), offset_of(id));
        assert!(offset_of(id) >= 0 && offset_of("other") >= 0);
        assert_ne!(offset_of(id), offset_of("5fea7756-0ea4-451a-a703-a558b933e275"));
    }
}
