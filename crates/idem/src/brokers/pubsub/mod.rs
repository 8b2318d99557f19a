//! Google Cloud Pub/Sub (feature `pubsub`, Google's own client): a [`PubSubSource`] on the source seam (streaming
//! pull, each message acknowledged after its transaction commits) and a [`PubSubProducer`] that sets the event id
//! as an attribute and the key as the ordering key.
//!
//! * **Where.** The project comes from [`PubSubConfig::project`], else `GOOGLE_CLOUD_PROJECT`; credentials from
//!   the standard Google configuration (Application Default Credentials). With `PUBSUB_EMULATOR_HOST` set (or
//!   [`PubSubConfig::emulator_host`]), idem talks plain gRPC to that emulator without credentials, as Google's
//!   clients do.
//! * **Acknowledgement.** Only after commit, one message at a time. On a subscription with exactly-once delivery
//!   each acknowledgement's result is awaited: a refused one (an expired ack id) is counted
//!   (`idem_pubsub_ack_failed_total`) and logged, never an error that stops the consumer: the message comes again and
//!   its marker absorbs it.
//! * **Leases.** While idem holds a message (a batch, its retries, a slow handler), the client extends its ack
//!   deadline, for at most [`PubSubConfig::max_lease`]; a batch that runs several deadlines is not delivered a
//!   second time. Start-up is refused when `max_lease` is shorter than [`PubSubConfig::max_batch_time`].
//! * **Partitions and order.** A message's key is its ordering key, and its partition of idem's a hash of it
//!   ([`PubSubConfig::partitions`], CRC-32 as Kafka's producers): each key's messages are handled in order, the
//!   partitions in parallel. Messages without an ordering key are spread by message id. With
//!   [`PubSubConfig::require_ordering`], a subscription without message ordering is refused at start-up.
//! * **Position.** Pub/Sub has no offsets: a message's offset in idem is derived from its message id, the same on
//!   every delivery, so a keyless poison message keeps one dead-letter row.
//! * **Dead-letter policy.** On a subscription with one, the delivery Pub/Sub calls its last
//!   (`delivery_attempt == max_delivery_attempts`) becomes idem's dead letter without calling the handler (the
//!   message that crashes the consumer every time ends in the database, not only on the dead-letter topic).
//! * **Failures.** The client retries what may pass; a streaming pull that still fails or ends (the service
//!   away, the emulator restarted, the subscription deleted) is opened again after the engine's backoff, and the
//!   consumer goes on: what the old stream held comes again and is absorbed by the markers.
//! * **Retention.** The subscription's `messageRetentionDuration` and the topic's retention, whichever is longer,
//!   are checked against the marker retention at start-up ([`crate::retention`]).

mod consumer;
mod producer;

use std::time::Duration;

pub use consumer::{PubSubSource, check};
pub use producer::PubSubProducer;

use google_cloud_pubsub::client::{SubscriptionAdmin, TopicAdmin};

use crate::error::Error;
use crate::retention::BrokerRetention;

/// The attribute carrying a message's Pub/Sub message id on the message idem hands to handlers
/// (`header:pubsub-message-id` keys on it).
pub const MESSAGE_ID_HEADER: &str = "pubsub-message-id";

/// How the retention guard names Pub/Sub's retention.
pub const PUBSUB_SUBSCRIPTION: BrokerRetention = BrokerRetention {
    holder: "subscription",
    setting: "messageRetentionDuration",
    forever: "no limit",
    accept_forever: "accept_infinite_retention",
};

/// How to reach Pub/Sub and consume one subscription.
#[derive(Debug, Clone)]
pub struct PubSubConfig {
    /// The Google Cloud project; `None` reads `GOOGLE_CLOUD_PROJECT`.
    pub project: Option<String>,
    /// The subscription: its id in the project, or `projects/P/subscriptions/S`.
    pub subscription: String,
    /// The emulator, `host:port`; `None` reads `PUBSUB_EMULATOR_HOST`, and without it the real service is used.
    pub emulator_host: Option<String>,
    /// Partitions the messages are spread over, by a hash of their ordering key: each partition is handled in
    /// order, the partitions in parallel. Default 8.
    pub partitions: u32,
    /// The longest one batch may take from delivery to commit. Default 10 s.
    pub max_batch_time: Duration,
    /// The longest idem keeps extending a message's ack deadline while it holds it; past it the message is
    /// delivered again. Default 1 hour; at least `max_batch_time`.
    pub max_lease: Duration,
    /// Messages delivered and not yet acknowledged, at most (flow control). `None`: the client's default, 1,000.
    pub max_outstanding_messages: Option<i64>,
    /// Refuse a subscription without message ordering (per-key order is required). Default `false`.
    pub require_ordering: bool,
    /// Return the end of the source once nothing has arrived for [`PubSubConfig::idle_end`] and nothing is in
    /// hand (demos, tests): Pub/Sub does not say how many messages wait.
    pub stop_at_end: bool,
    /// The quiet time that counts as the end with `stop_at_end`. Default 3 s.
    pub idle_end: Duration,
}

impl PubSubConfig {
    /// A configuration with defaults for `subscription`.
    pub fn new(subscription: impl Into<String>) -> Self {
        PubSubConfig {
            project: None,
            subscription: subscription.into(),
            emulator_host: None,
            partitions: 8,
            max_batch_time: Duration::from_secs(10),
            max_lease: Duration::from_secs(3600),
            max_outstanding_messages: None,
            require_ordering: false,
            stop_at_end: false,
            idle_end: Duration::from_secs(3),
        }
    }

    /// Refuses what cannot work, naming the setting and the fix.
    pub fn validate(&self) -> Result<(), Error> {
        self.subscription_path()?;
        if self.partitions == 0 || self.partitions > 1024 {
            return Err(Error::Config(format!("pubsub partitions {} is out of range: use 1 to 1024", self.partitions)));
        }
        if self.max_lease < self.max_batch_time {
            return Err(Error::Config(format!(
                "pubsub max_lease {} s is shorter than max_batch_time {} s: a batch still running when idem stops \
                 extending its messages' deadlines is delivered again while its transaction is open. Fix: raise \
                 max_lease to at least {} s, or lower max_batch_time",
                self.max_lease.as_secs_f64(),
                self.max_batch_time.as_secs_f64(),
                self.max_batch_time.as_secs_f64()
            )));
        }
        if self.max_outstanding_messages.is_some_and(|n| n < 1) {
            return Err(Error::Config(
                "pubsub max_outstanding_messages lets no message through: use at least 1".into(),
            ));
        }
        Ok(())
    }

    /// The project: the configured one, else `GOOGLE_CLOUD_PROJECT`.
    pub fn project(&self) -> Result<String, Error> {
        project(self.project.as_deref())
    }

    /// The subscription's full name, `projects/P/subscriptions/S`.
    pub fn subscription_path(&self) -> Result<String, Error> {
        resource_path(self.project.as_deref(), "subscriptions", &self.subscription)
    }

    /// Where the emulator is, when idem talks to one.
    pub fn emulator(&self) -> Option<String> {
        emulator(self.emulator_host.as_deref())
    }
}

/// The project: `configured`, else `GOOGLE_CLOUD_PROJECT`; an error naming both otherwise.
pub(crate) fn project(configured: Option<&str>) -> Result<String, Error> {
    configured
        .map(str::to_owned)
        .or_else(|| std::env::var("GOOGLE_CLOUD_PROJECT").ok())
        .filter(|p| !p.trim().is_empty())
        .ok_or_else(|| {
            Error::Config(
                "pubsub project is not set: give project = \"my-project\" or set GOOGLE_CLOUD_PROJECT".to_owned(),
            )
        })
}

/// `projects/P/{kind}/{name}` from a short name (with the project) or a full one.
pub(crate) fn resource_path(project_name: Option<&str>, kind: &str, name: &str) -> Result<String, Error> {
    let name = name.trim();
    if name.starts_with("projects/") {
        let parts: Vec<&str> = name.split('/').collect();
        if parts.len() == 4 && parts[2] == kind && !parts[1].is_empty() && valid_id(parts[3]) {
            return Ok(name.to_owned());
        }
        return Err(Error::Config(format!("pubsub name `{name}` is not projects/PROJECT/{kind}/ID")));
    }
    if !valid_id(name) {
        return Err(Error::Config(format!(
            "pubsub {kind} id `{name}` is not a Pub/Sub id: 3 to 255 characters, starting with a letter, of letters, \
             digits and - _ . ~ + % (and not starting with goog)"
        )));
    }
    Ok(format!("projects/{}/{kind}/{name}", project(project_name)?))
}

/// Pub/Sub's rule for topic and subscription ids.
fn valid_id(id: &str) -> bool {
    (3..=255).contains(&id.len())
        && id.starts_with(|c: char| c.is_ascii_alphabetic())
        && !id.starts_with("goog")
        && id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.~+%".contains(c))
}

/// The last segment of `projects/P/topics/T`.
pub(crate) fn short_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// The emulator's `host:port`: `configured`, else `PUBSUB_EMULATOR_HOST`.
pub(crate) fn emulator(configured: Option<&str>) -> Option<String> {
    configured
        .map(str::to_owned)
        .or_else(|| std::env::var("PUBSUB_EMULATOR_HOST").ok())
        .filter(|h| !h.trim().is_empty())
}

/// The longest idem waits for the service at start-up before it names the endpoint it could not reach.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// What the admin and data clients are built with: the emulator's endpoint without credentials, or the real
/// service with the standard Google credentials (TLS through rustls with ring).
pub(crate) fn target(emulator: Option<&str>) -> Option<(String, google_cloud_auth::credentials::Credentials)> {
    // Google's client leaves the TLS crypto provider to the program (its HTTP client is built even for the
    // emulator); an installed one is kept.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let host = emulator?;
    let endpoint = if host.contains("://") { host.to_owned() } else { format!("http://{host}") };
    Some((endpoint, google_cloud_auth::credentials::anonymous::Builder::new().build()))
}

/// Names the endpoint idem is talking to, for errors.
pub(crate) fn endpoint_name(emulator: Option<&str>) -> String {
    match emulator {
        Some(host) => format!("the Pub/Sub emulator at {host} (PUBSUB_EMULATOR_HOST)"),
        None => "Google Cloud Pub/Sub (pubsub.googleapis.com)".to_owned(),
    }
}

/// The subscription admin client for `emulator` (or the real service).
pub(crate) async fn subscription_admin(emulator: Option<&str>) -> Result<SubscriptionAdmin, Error> {
    let mut builder = SubscriptionAdmin::builder();
    if let Some((endpoint, credentials)) = target(emulator) {
        builder = builder.with_endpoint(endpoint).with_credentials(credentials);
    }
    builder.build().await.map_err(|e| Error::Connect { target: endpoint_name(emulator), reason: e.to_string() })
}

/// The topic admin client for `emulator` (or the real service).
pub(crate) async fn topic_admin(emulator: Option<&str>) -> Result<TopicAdmin, Error> {
    let mut builder = TopicAdmin::builder();
    if let Some((endpoint, credentials)) = target(emulator) {
        builder = builder.with_endpoint(endpoint).with_credentials(credentials);
    }
    builder.build().await.map_err(|e| Error::Connect { target: endpoint_name(emulator), reason: e.to_string() })
}

/// A failed start-up call, explained: a missing resource, refused credentials, an unreachable endpoint.
pub(crate) fn explain(what: &str, emulator: Option<&str>, error: &google_cloud_pubsub::Error) -> Error {
    use google_cloud_gax::error::rpc::Code;
    match error.status().map(|s| s.code) {
        Some(Code::NotFound) => Error::Config(format!(
            "pubsub {what} does not exist on {}. Fix: create it (gcloud pubsub … create) or name an existing one",
            endpoint_name(emulator)
        )),
        Some(Code::PermissionDenied) | Some(Code::Unauthenticated) => Error::Config(format!(
            "pubsub {what}: the credentials were refused ({error}). Fix: point GOOGLE_APPLICATION_CREDENTIALS at a \
             service account with roles/pubsub.subscriber (and viewer on the subscription), or run gcloud auth \
             application-default login"
        )),
        _ => Error::Connect { target: format!("{} for {what}", endpoint_name(emulator)), reason: error.to_string() },
    }
}

/// Waits for a start-up call at most [`START_TIMEOUT`]; the timeout names the endpoint.
pub(crate) async fn at_start<T>(
    what: &str,
    emulator: Option<&str>,
    call: impl std::future::Future<Output = Result<T, google_cloud_pubsub::Error>>,
) -> Result<T, Error> {
    match tokio::time::timeout(START_TIMEOUT, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(explain(what, emulator, &e)),
        Err(_) => Err(Error::Connect {
            target: format!("{} for {what}", endpoint_name(emulator)),
            reason: format!(
                "no answer within {} s. Fix: check the address and that the service runs",
                START_TIMEOUT.as_secs()
            ),
        }),
    }
}

/// Creates topic `topic` (an id in `project`) when it is missing. For demos and tests; production topics are an
/// operator's decision.
pub async fn create_topic(emulator: Option<&str>, project: &str, topic: &str) -> Result<(), Error> {
    let path = resource_path(Some(project), "topics", topic)?;
    let admin = topic_admin(emulator).await?;
    match admin.create_topic().set_name(&path).send().await {
        Ok(_) => Ok(()),
        Err(e) if e.status().is_some_and(|s| s.code == google_cloud_gax::error::rpc::Code::AlreadyExists) => Ok(()),
        Err(e) => Err(explain(&format!("topic {path}"), emulator, &e)),
    }
}

/// What [`create_subscription`] sets up besides the topic.
#[derive(Debug, Clone, Default)]
pub struct SubscriptionOptions {
    /// Deliver each ordering key's messages in order.
    pub ordering: bool,
    /// The ack deadline in seconds (10 to 600; 0 uses 10).
    pub ack_deadline_seconds: i32,
    /// A dead-letter topic (an id in the project) and the delivery attempts before Pub/Sub moves a message there
    /// (5 to 100).
    pub dead_letter: Option<(String, i32)>,
    /// Exactly-once delivery (acknowledgements that can fail).
    pub exactly_once: bool,
}

/// Creates subscription `subscription` to `topic` (ids in `project`) when it is missing. For demos and tests.
pub async fn create_subscription(
    emulator: Option<&str>,
    project: &str,
    topic: &str,
    subscription: &str,
    options: &SubscriptionOptions,
) -> Result<(), Error> {
    let topic_path = resource_path(Some(project), "topics", topic)?;
    let path = resource_path(Some(project), "subscriptions", subscription)?;
    let admin = subscription_admin(emulator).await?;
    let mut request = admin
        .create_subscription()
        .set_name(&path)
        .set_topic(&topic_path)
        .set_enable_message_ordering(options.ordering)
        .set_enable_exactly_once_delivery(options.exactly_once)
        .set_ack_deadline_seconds(if options.ack_deadline_seconds == 0 { 10 } else { options.ack_deadline_seconds });
    if let Some((dead_letter_topic, attempts)) = &options.dead_letter {
        let dead_letter_topic = resource_path(Some(project), "topics", dead_letter_topic)?;
        request = request.set_dead_letter_policy(
            google_cloud_pubsub::model::DeadLetterPolicy::new()
                .set_dead_letter_topic(dead_letter_topic)
                .set_max_delivery_attempts(*attempts),
        );
    }
    match request.send().await {
        Ok(_) => Ok(()),
        Err(e) if e.status().is_some_and(|s| s.code == google_cloud_gax::error::rpc::Code::AlreadyExists) => Ok(()),
        Err(e) => Err(explain(&format!("subscription {path}"), emulator, &e)),
    }
}

/// Deletes subscription `subscription` of `project`; a missing one is not an error.
pub async fn delete_subscription(emulator: Option<&str>, project: &str, subscription: &str) -> Result<(), Error> {
    let path = resource_path(Some(project), "subscriptions", subscription)?;
    let admin = subscription_admin(emulator).await?;
    match admin.delete_subscription().set_subscription(&path).send().await {
        Ok(()) => Ok(()),
        Err(e) if e.status().is_some_and(|s| s.code == google_cloud_gax::error::rpc::Code::NotFound) => Ok(()),
        Err(e) => Err(explain(&format!("subscription {path}"), emulator, &e)),
    }
}

/// Deletes topic `topic` of `project`; a missing one is not an error. For demos and tests.
pub async fn delete_topic(emulator: Option<&str>, project: &str, topic: &str) -> Result<(), Error> {
    let path = resource_path(Some(project), "topics", topic)?;
    let admin = topic_admin(emulator).await?;
    match admin.delete_topic().set_topic(&path).send().await {
        Ok(()) => Ok(()),
        Err(e) if e.status().is_some_and(|s| s.code == google_cloud_gax::error::rpc::Code::NotFound) => Ok(()),
        Err(e) => Err(explain(&format!("topic {path}"), emulator, &e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_completed_with_the_project() {
        assert_eq!(resource_path(Some("p1"), "topics", "orders").unwrap(), "projects/p1/topics/orders");
        assert_eq!(
            resource_path(None, "subscriptions", "projects/x/subscriptions/s-1").unwrap(),
            "projects/x/subscriptions/s-1"
        );
        for bad in ["ab", "1abc", "goog-x", "with space", "projects/x/topics/s-1"] {
            let err = resource_path(Some("p"), "subscriptions", bad).unwrap_err().to_string();
            assert!(err.contains(bad.trim()), "{err}");
        }
        assert_eq!(short_name("projects/p/topics/orders"), "orders");
    }

    #[test]
    fn a_lease_shorter_than_a_batch_and_no_partitions_are_refused_naming_the_fix() {
        let base = PubSubConfig { project: Some("p".into()), ..PubSubConfig::new("orders-sub") };
        base.validate().unwrap();
        let err = PubSubConfig { max_lease: Duration::from_secs(5), ..base.clone() }.validate().unwrap_err();
        let err = err.to_string();
        assert!(err.contains("max_lease 5 s") && err.contains("at least 10 s"), "{err}");
        assert!(PubSubConfig { partitions: 0, ..base.clone() }.validate().is_err());
        assert!(PubSubConfig { max_outstanding_messages: Some(0), ..base }.validate().is_err());
    }
}
