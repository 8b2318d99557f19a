//! The Pub/Sub source: a streaming pull read by [`Source::recv`], each message acknowledged through its own
//! handler after its transaction commits, its lease extended by the client while idem holds it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use google_cloud_pubsub::client::Subscriber;
use google_cloud_pubsub::subscriber::handler::Handler;
use google_cloud_pubsub::subscriber::{MessageStream, ShutdownBehavior};

use super::{MESSAGE_ID_HEADER, PUBSUB_SUBSCRIPTION, PubSubConfig, at_start, endpoint_name, short_name, target};
use crate::error::Error;
use crate::message::{AckHandle, Message};
use crate::retention::RetentionPolicy;
use crate::source::{Acknowledgement, Received, Source, SourceError};

/// How often `recv` checks, while nothing arrives, whether the source is at its end (with `stop_at_end`).
const IDLE_CHECK: Duration = Duration::from_millis(500);

/// Consumes one Pub/Sub subscription through a streaming pull, as a [`Source`]. See the module documentation of
/// [`crate::pubsub`] for the guarantees.
pub struct PubSubSource {
    /// The streaming pull; taken out when the source is dropped (see [`PubSubSource::drop`]).
    messages: tokio::sync::Mutex<Option<MessageStream>>,
    /// How to open it again after it failed.
    pull: Pull,
    /// The topic's id: what [`Message::topic`] carries, so a replayed dead letter goes back to it.
    topic: String,
    subscription: String,
    partitions: u32,
    /// The subscription's dead-letter policy's `max_delivery_attempts`, when it has one.
    max_delivery_attempts: Option<i32>,
    stop_at_end: bool,
    idle_end: Duration,
    /// Messages handed out and neither acknowledged nor dropped.
    in_hand: Arc<AtomicUsize>,
}

/// What a consumer of `config` needs from Pub/Sub, checked without pulling anything: the credentials and the
/// endpoint answer, the subscription exists, is a pull subscription (with message ordering when required) and
/// keeps messages longer than `engine`'s markers. [`PubSubSource::connect`] starts with the same; `idem check` runs
/// it alone.
pub async fn check(config: &PubSubConfig, engine: &crate::Config) -> Result<(), Error> {
    open_subscription(config, engine).await.map(drop)
}

/// The subscription's path and description, with the checks of [`check`].
async fn open_subscription(
    config: &PubSubConfig,
    engine: &crate::Config,
) -> Result<(String, google_cloud_pubsub::model::Subscription), Error> {
    config.validate()?;
    engine.validate()?;
    if engine.key == crate::KeyExtractor::BrokerId {
        return Err(Error::Config(format!(
            "pubsub: the broker-id key is refused: a Pub/Sub message has no position of its own (idem's \
             partition depends on the partitions setting, and a republished event gets a new message id). Fix: \
             key on the producer's event id (header:idem-event-id), a business key in the payload (json:/…), or \
             the message id (header:{MESSAGE_ID_HEADER})"
        )));
    }
    let path = config.subscription_path()?;
    let emulator = config.emulator();
    let emulator = emulator.as_deref();
    let admin = super::subscription_admin(emulator).await?;
    let what = format!("subscription {path}");
    let subscription = at_start(&what, emulator, admin.get_subscription().set_subscription(&path).send()).await?;
    if config.require_ordering && !subscription.enable_message_ordering {
        return Err(Error::Config(format!(
            "pubsub subscription {path} does not have message ordering, and require_ordering is set: each key's \
             messages could be delivered out of order. Fix: create the subscription with \
             --enable-message-ordering (ordering cannot be switched on later), or unset require_ordering"
        )));
    }
    if subscription.push_config.as_ref().is_some_and(|p| !p.push_endpoint.is_empty()) {
        return Err(Error::Config(format!(
            "pubsub subscription {path} is a push subscription: idem pulls. Fix: use a pull subscription"
        )));
    }
    let kept_ms = [
        subscription.message_retention_duration.as_ref().map(|d| d.seconds() * 1000 + i64::from(d.nanos()) / 1_000_000),
        subscription
            .topic_message_retention_duration
            .as_ref()
            .map(|d| d.seconds() * 1000 + i64::from(d.nanos()) / 1_000_000),
    ]
    .into_iter()
    .flatten()
    .max()
    // A subscription that states no retention keeps unacknowledged messages for Pub/Sub's default, 7 days.
    .unwrap_or(7 * 24 * 3600 * 1000);
    metrics::gauge!("idem_pubsub_subscription_retention_seconds", "subscription" => path.clone())
        .set(kept_ms as f64 / 1000.0);
    RetentionPolicy {
        marker_retention: engine.pruning.retention,
        accept_infinite_retention: false,
        broker: PUBSUB_SUBSCRIPTION,
    }
    .check(&[(path.clone(), Some(kept_ms))])?;
    Ok((path, subscription))
}

impl PubSubSource {
    /// Validates `config` (refusing the `broker-id` key), reads the subscription (refusing a missing one, a subscription without ordering when
    /// `require_ordering`, a push subscription), runs the retention guard with `engine`'s marker retention, and
    /// opens the streaming pull.
    pub async fn connect(config: &PubSubConfig, engine: &crate::Config) -> Result<Self, Error> {
        let (path, subscription) = open_subscription(config, engine).await?;
        let emulator = config.emulator();
        let emulator = emulator.as_deref();
        let max_delivery_attempts =
            subscription.dead_letter_policy.as_ref().map(|p| p.max_delivery_attempts).filter(|n| *n > 0);

        let mut builder = Subscriber::builder();
        if let Some((endpoint, credentials)) = target(emulator) {
            builder = builder.with_endpoint(endpoint).with_credentials(credentials);
        }
        let subscriber = builder
            .build()
            .await
            .map_err(|e| Error::Connect { target: endpoint_name(emulator), reason: e.to_string() })?;
        let pull = Pull {
            subscriber,
            subscription: path.clone(),
            max_lease: config.max_lease,
            // What a message not acknowledged when this process dies waits before it comes again.
            lease_extension: Duration::from_secs(subscription.ack_deadline_seconds.clamp(10, 600) as u64),
            max_outstanding_messages: config.max_outstanding_messages,
        };
        tracing::info!(subscription = %path, topic = %subscription.topic, ordering = subscription.enable_message_ordering,
            exactly_once = subscription.enable_exactly_once_delivery, ?max_delivery_attempts, "pubsub: consuming");
        Ok(PubSubSource {
            messages: tokio::sync::Mutex::new(Some(pull.open())),
            pull,
            topic: short_name(&subscription.topic).to_owned(),
            subscription: path,
            partitions: config.partitions,
            max_delivery_attempts,
            stop_at_end: config.stop_at_end,
            idle_end: config.idle_end,
            in_hand: Arc::default(),
        })
    }

    fn to_message(&self, message: google_cloud_pubsub::model::Message, handler: Handler) -> Message {
        let attempt = handler.delivery_attempt();
        if attempt.is_some_and(|n| n > 1) {
            metrics::counter!("idem_pubsub_redelivered_total", "subscription" => self.subscription.clone())
                .increment(1);
        }
        let offset = offset_of(&message.message_id);
        let key = (!message.ordering_key.is_empty()).then(|| message.ordering_key.as_bytes().to_vec());
        let partition = match self.partitions {
            0 | 1 => 0,
            n => {
                let spread_by =
                    if message.ordering_key.is_empty() { &message.message_id } else { &message.ordering_key };
                (crc32fast::hash(spread_by.as_bytes()) % n) as i32
            }
        };
        let mut headers: Vec<(String, Vec<u8>)> =
            message.attributes.iter().map(|(k, v)| (k.clone(), v.as_bytes().to_vec())).collect();
        headers.push((MESSAGE_ID_HEADER.to_owned(), message.message_id.as_bytes().to_vec()));
        headers.sort();
        let timestamp_ms = message.publish_time.as_ref().map(|t| t.seconds() * 1000 + i64::from(t.nanos()) / 1_000_000);
        self.in_hand.fetch_add(1, Ordering::SeqCst);
        let delivery = Delivery { handler: std::sync::Mutex::new(Some(handler)), in_hand: Arc::clone(&self.in_hand) };
        Message {
            topic: self.topic.clone(),
            partition,
            offset,
            key,
            payload: message.data.to_vec(),
            headers,
            timestamp_ms,
            ack_handle: Some(AckHandle::new(delivery)),
            dead_letter_reason: self.last_delivery(attempt),
        }
    }

    /// The reason to dead-letter a delivery Pub/Sub calls its last.
    fn last_delivery(&self, attempt: Option<i32>) -> Option<String> {
        let (attempt, max) = (attempt?, self.max_delivery_attempts?);
        (attempt >= max).then(|| {
            format!(
                "delivery attempt {attempt}, the subscription's max_delivery_attempts ({max}): Pub/Sub would move it \
                 to the dead-letter topic after this delivery, so idem kept it as a dead letter instead of calling \
                 the handler (a message that crashes the consumer ends here). Replay it with idem dead-letters \
                 replay once the cause is fixed"
            )
        })
    }
}

/// The settings of the streaming pull, to open it again after it ended (the service or the emulator restarted,
/// the subscription deleted and made again).
struct Pull {
    subscriber: Subscriber,
    subscription: String,
    max_lease: Duration,
    lease_extension: Duration,
    max_outstanding_messages: Option<i64>,
}

impl Pull {
    fn open(&self) -> MessageStream {
        let mut subscribe = self
            .subscriber
            .subscribe(self.subscription.clone())
            .set_max_lease(self.max_lease)
            .set_max_lease_extension(self.lease_extension)
            .set_shutdown_behavior(ShutdownBehavior::NackImmediately);
        if let Some(n) = self.max_outstanding_messages {
            subscribe = subscribe.set_max_outstanding_messages(n);
        }
        subscribe.build()
    }
}

/// The offset of the message with Pub/Sub id `id`: Pub/Sub has no positions, so the offset identifies the message
/// instead, the same on every delivery (its numeric id, or 63 bits of its id's SHA-256).
fn offset_of(id: &str) -> i64 {
    match id.parse::<i64>() {
        Ok(n) if n >= 0 => n,
        _ => {
            use sha2::Digest;
            crate::store::offset_from_digest(&sha2::Sha256::digest(id.as_bytes()))
        }
    }
}

/// The handle of one delivery: the client's handler, taken when idem settles the message. Dropped unsettled
/// (the engine gave the message up), the handler returns it to Pub/Sub at once (a nack).
struct Delivery {
    handler: std::sync::Mutex<Option<Handler>>,
    in_hand: Arc<AtomicUsize>,
}

impl Delivery {
    fn take(&self) -> Option<Handler> {
        self.handler.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        self.in_hand.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Source for PubSubSource {
    const SYSTEM: &'static str = "gcp_pubsub";

    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        let mut messages = self.messages.lock().await;
        let Some(messages) = messages.as_mut() else { return Ok(None) };
        let mut quiet = Duration::ZERO;
        loop {
            match tokio::time::timeout(IDLE_CHECK, messages.next()).await {
                Ok(Some(Ok((message, handler)))) => {
                    return Ok(Some(Received::Message(self.to_message(message, handler))));
                }
                // The client retries what may pass by itself; what reaches here ended the stream. It is opened
                // again, and the engine's backoff paces the attempts (a subscription that is gone may be made
                // again; what this stream held comes again and is absorbed by the markers).
                Ok(Some(Err(error))) => {
                    *messages = self.pull.open();
                    let fix = if error.status().is_some_and(|s| s.code == google_cloud_gax::error::rpc::Code::NotFound)
                    {
                        " (the subscription is gone: make it again, or stop this consumer)"
                    } else {
                        ""
                    };
                    return Err(SourceError::transient("pubsub streaming pull", format!("{error}{fix}")));
                }
                Ok(None) => {
                    *messages = self.pull.open();
                    return Err(SourceError::transient("pubsub streaming pull", "the stream ended; opened again"));
                }
                Err(_idle) => {
                    quiet += IDLE_CHECK;
                    if self.stop_at_end && quiet >= self.idle_end && self.in_hand.load(Ordering::SeqCst) == 0 {
                        tracing::info!(subscription = %self.subscription, "pubsub: nothing arrived; at the end");
                        return Ok(None);
                    }
                }
            }
        }
    }

    async fn ack(&self, ack: &Acknowledgement) -> Result<(), SourceError> {
        for handle in &ack.handles {
            let Some(delivery) = handle.get::<Delivery>() else {
                return Err(SourceError::permanent("pubsub ack", "a handle that is not a Pub/Sub delivery"));
            };
            match delivery.take() {
                Some(Handler::ExactlyOnce(handler)) => {
                    if let Err(error) = handler.confirmed_ack().await {
                        // The message comes again and its marker absorbs it.
                        metrics::counter!("idem_pubsub_ack_failed_total", "subscription" => self.subscription.clone())
                            .increment(1);
                        tracing::warn!(%error, subscription = %self.subscription,
                            "pubsub: an acknowledgement was refused; the message will come again as a duplicate");
                    }
                }
                Some(handler) => handler.ack(),
                None => {}
            }
        }
        Ok(())
    }
}

impl Drop for PubSubSource {
    /// Shuts the streaming pull down while it is still open: the client sends the acknowledgements it holds and
    /// returns (nacks) every message still in hand, and only then is the stream closed, so nothing committed is
    /// left unacknowledged. (The emulator still holds what a closed stream had: see docs/brokers.md.)
    fn drop(&mut self) {
        let Some(stream) = self.messages.get_mut().take() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let token = stream.shutdown_token();
        runtime.spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(10), token.shutdown()).await;
            drop(stream);
        });
    }
}
