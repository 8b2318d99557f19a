//! Amazon SQS (feature `sqs`, the official `aws-sdk-sqs`): an [`SqsSource`] on the source seam for standard and
//! FIFO queues, an [`SqsProducer`] that sets `MessageDeduplicationId` and `MessageGroupId`, and the two start-up
//! guards idem keeps for every broker.
//!
//! * **Where the queue is.** Endpoint, region and credentials come from the standard AWS configuration (the
//!   `AWS_*` variables, `~/.aws/config` and its profiles, web identity, the instance's role), as every AWS tool
//!   reads them. [`SqsConfig::endpoint`] (or `IDEM_SQS_ENDPOINT` in the command) points at an SQS-compatible
//!   server instead; on a loopback endpoint without configured credentials, idem signs with placeholder ones (a
//!   local stand-in does not check them) and defaults the region to `us-east-1`.
//! * **Receiving.** Long polling (`WaitTimeSeconds`, 20 s by default), up to ten messages per request.
//! * **Deleting after commit.** A message is deleted (`DeleteMessageBatch`, ten per request) only after the
//!   transaction holding its marker committed. A consumer killed between the commit and the delete leaves the
//!   message in the queue: it reappears after the visibility timeout and is counted `duplicate`.
//! * **FIFO queues.** A message's group (`MessageGroupId`) is its key, and groups are spread over
//!   [`SqsConfig::partitions`] partitions by a hash of the group: each partition is handled in order, the
//!   partitions in parallel, so every group keeps its order. SQS itself hands out no later message of a group
//!   while one is in flight. **Standard queues** promise no order; the marker table does the deduplication.
//! * **The visibility-timeout guard.** Start-up is refused when the queue's `VisibilityTimeout` is shorter than
//!   [`SqsConfig::max_batch_time`], the longest a batch may take from receipt to commit: the message would
//!   reappear, to this or another consumer, while its transaction is still open. While a message is in hand
//!   longer than half the timeout, its visibility is extended (`ChangeMessageVisibilityBatch`), so a slow batch
//!   never lets it reappear mid-transaction.
//! * **The retention guard.** The queue's `MessageRetentionPeriod` is checked against the marker retention with
//!   the rules of the Kafka guard ([`crate::retention`]): markers must be kept at least 1.1 × as long.
//! * **Receive count.** `ApproximateReceiveCount` is kept on each message as the header `sqs-receive-count`.
//!   With [`SqsConfig::max_receive_count`], a message received more often than that is not handed to the
//!   handler: idem writes it to its dead-letter table (with the count in the reason) in the transaction with
//!   its marker, then deletes it. The alternative is the queue's own redrive policy (`maxReceiveCount` with a
//!   dead-letter queue): SQS then moves such a message to the dead-letter queue by itself, without idem seeing
//!   it; keep the queue's limit above idem's if both are set, or idem never gets to record it.
//! * **Idempotency keys.** SQS assigns each message a `MessageId` that stays the same across its redeliveries;
//!   the source gives it as the header `sqs-message-id`. A message has no offset that survives redelivery, so
//!   the `broker-id` key is refused: use the producer's event id (`header:idem-event-id`), a business key in the
//!   payload, or `header:sqs-message-id`.
//! * **Offsets.** SQS has no positions: a message's offset is a number derived from its `MessageId`, the same on
//!   each delivery, so a message without a key is recognised as the same dead letter when it comes again.
//! * **Message attributes** become headers (String and Number as their text, Binary as bytes). Bodies are text,
//!   as SQS requires; a body that is not the JSON the key or the handler expects is dead-lettered with the reason.

mod consumer;
mod producer;

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_sqs::types::QueueAttributeName;

/// The SDK, so a program can name the client [`client`] returns.
pub use aws_sdk_sqs;
pub use consumer::{SqsSource, check};
pub use producer::{Outgoing, Published, SqsProducer};

use crate::error::Error;
use crate::retention::BrokerRetention;

/// The header holding the `MessageId` SQS gave the message (the same on every redelivery).
pub const MESSAGE_ID_HEADER: &str = "sqs-message-id";
/// The header holding `ApproximateReceiveCount`: 1 on the first delivery.
pub const RECEIVE_COUNT_HEADER: &str = "sqs-receive-count";

/// SQS queues, in the retention guard's messages.
pub const SQS_QUEUE: BrokerRetention = BrokerRetention {
    holder: "queue",
    setting: "MessageRetentionPeriod",
    forever: "no limit",
    accept_forever: "accept_infinite_retention",
};

/// How to reach an SQS queue and consume it.
#[derive(Debug, Clone)]
pub struct SqsConfig {
    /// The queue's name (`orders`, `orders.fifo`) or its URL.
    pub queue: String,
    /// An SQS-compatible endpoint instead of the region's (`http://127.0.0.1:9324`); `None` for AWS itself.
    pub endpoint: Option<String>,
    /// The region; `None` reads it from the standard AWS configuration (`AWS_REGION`, the profile).
    pub region: Option<String>,
    /// Long-polling wait per receive request, 0 to 20 s. Default 20 s (the most SQS allows: fewest empty
    /// receives).
    pub wait_time: Duration,
    /// The longest one batch may take from receipt to commit. Start-up is refused when the queue's
    /// `VisibilityTimeout` is shorter. Default 30 s, SQS's default timeout.
    pub max_batch_time: Duration,
    /// Partitions the messages are spread over: by a hash of the message group on FIFO queues (each group keeps
    /// its order), of the message id on standard queues. Default 8.
    pub partitions: u32,
    /// Receives after which idem dead-letters a message instead of handing it to the handler (`None`: no limit,
    /// the default; the queue's redrive policy may still have one).
    pub max_receive_count: Option<u32>,
    /// Return the end of the source once the queue holds nothing, visible or in flight, but what this consumer
    /// has in hand (demos, tests).
    pub stop_at_end: bool,
}

impl SqsConfig {
    /// A configuration with defaults: the standard AWS configuration, long polling of 20 s, batches of at most
    /// 30 s, 8 partitions.
    pub fn new(queue: impl Into<String>) -> Self {
        SqsConfig {
            queue: queue.into(),
            endpoint: None,
            region: None,
            wait_time: Duration::from_secs(20),
            max_batch_time: Duration::from_secs(30),
            partitions: 8,
            max_receive_count: None,
            stop_at_end: false,
        }
    }

    /// Refuses what cannot work, naming the setting and the fix.
    pub fn validate(&self) -> Result<(), Error> {
        if self.queue.trim().is_empty() {
            return Err(Error::Config("sqs queue is empty: give the queue's name or URL".into()));
        }
        if let Some(endpoint) = &self.endpoint
            && !(endpoint.starts_with("http://") || endpoint.starts_with("https://"))
        {
            return Err(Error::Config(format!(
                "sqs endpoint `{endpoint}` is not an http:// or https:// URL (for example http://127.0.0.1:9324)"
            )));
        }
        if self.wait_time > Duration::from_secs(20) {
            return Err(Error::Config(format!(
                "sqs wait_time {} s is longer than SQS allows: use 0 to 20 s (20 s polls least)",
                self.wait_time.as_secs()
            )));
        }
        if self.partitions == 0 || self.partitions > 1024 {
            return Err(Error::Config(format!("sqs partitions {} is out of range: use 1 to 1024", self.partitions)));
        }
        if self.max_receive_count == Some(0) {
            return Err(Error::Config(
                "sqs max_receive_count 0 would dead-letter every message: use at least 1, or leave it out".into(),
            ));
        }
        if self.max_batch_time.is_zero() {
            return Err(Error::Config("sqs max_batch_time 0: give the longest a batch may take, e.g. 30 s".into()));
        }
        Ok(())
    }
}

/// The visibility-timeout guard: a message whose timeout expires while its batch still runs reappears, to this
/// or another consumer, while its transaction is open.
pub fn visibility_guard(queue: &str, visibility_timeout: Duration, max_batch_time: Duration) -> Result<(), Error> {
    if visibility_timeout < max_batch_time {
        return Err(Error::Config(format!(
            "sqs queue {queue}: VisibilityTimeout {} is shorter than the maximum handling time of a batch \
             (max_batch_time {}): a message still in its transaction when the timeout expires reappears and is \
             handled again beside it. Fix: raise the queue's VisibilityTimeout to at least {} (aws sqs \
             set-queue-attributes --attributes VisibilityTimeout={}), or lower max_batch_time",
            seconds(visibility_timeout),
            seconds(max_batch_time),
            seconds(max_batch_time),
            max_batch_time.as_secs_f64().ceil() as u64
        )));
    }
    Ok(())
}

fn seconds(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// Whether an endpoint is on this machine (a local stand-in, never AWS itself).
fn is_loopback(endpoint: &str) -> bool {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, rest)| rest);
    let host = rest.split(['/', '?']).next().unwrap_or_default();
    let host = host.rsplit_once('@').map_or(host, |(_, host)| host);
    let host = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host.split(':').next().unwrap_or_default(),
    };
    matches!(host, "localhost" | "::1") || host.starts_with("127.")
}

/// An SQS client from the standard AWS configuration, with `endpoint` and `region` when given; TLS through
/// rustls with ring. Connecting waits at most 5 s and each request attempt 45 s (past the 20 s long poll).
pub async fn client(endpoint: Option<&str>, region: Option<&str>) -> Result<aws_sdk_sqs::Client, Error> {
    use aws_config::{BehaviorVersion, Region};
    use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};

    let http =
        aws_smithy_http_client::Builder::new().tls_provider(tls::Provider::Rustls(CryptoMode::Ring)).build_https();
    // Every request is bounded: a connection that dies without a word (no reset, no close) would otherwise hold a
    // receive, a delete or a visibility extension for good. The attempt timeout lies well past the longest long
    // poll (20 s); the SDK retries a timed-out attempt.
    let timeouts = aws_config::timeout::TimeoutConfig::builder()
        .connect_timeout(std::time::Duration::from_secs(5))
        .operation_attempt_timeout(std::time::Duration::from_secs(45))
        .build();
    let mut loader = aws_config::defaults(BehaviorVersion::latest()).http_client(http).timeout_config(timeouts);
    if let Some(endpoint) = endpoint {
        loader = loader.endpoint_url(endpoint);
    }
    let local = endpoint.is_some_and(is_loopback);
    let region_set = ["AWS_REGION", "AWS_DEFAULT_REGION"].iter().any(|name| std::env::var_os(name).is_some());
    match region {
        Some(region) => loader = loader.region(Region::new(region.to_owned())),
        // A local stand-in answers in any region; without one set, the default chain would ask the instance
        // metadata service first.
        None if local && !region_set => loader = loader.region(Region::new("us-east-1")),
        None => {}
    }
    let credentials_set = ["AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE"]
        .iter()
        .any(|name| std::env::var_os(name).is_some());
    if local && !credentials_set {
        // A local stand-in does not check signatures; without this, the default chain would wait on the
        // instance metadata service before failing.
        loader = loader.credentials_provider(aws_sdk_sqs::config::Credentials::new(
            "idem-local",
            "idem-local",
            None,
            None,
            "idem",
        ));
    }
    let shared = loader.load().await;
    if shared.region().is_none() {
        return Err(Error::Config(
            "sqs: no AWS region is configured. Fix: set AWS_REGION (or a region in ~/.aws/config, or the consumer's \
             region setting)"
                .into(),
        ));
    }
    Ok(aws_sdk_sqs::Client::new(&shared))
}

/// Where a queue is and how it is set up, read at start-up.
#[derive(Debug, Clone)]
pub struct QueueInfo {
    /// The queue's URL.
    pub url: String,
    /// Its name (the last part of the URL).
    pub name: String,
    /// Whether it is a FIFO queue.
    pub fifo: bool,
    /// `VisibilityTimeout`.
    pub visibility_timeout: Duration,
    /// `MessageRetentionPeriod`, when the server reports it.
    pub retention: Option<Duration>,
    /// The redrive policy's `maxReceiveCount`, when the queue has one.
    pub redrive_max_receive_count: Option<u32>,
}

/// Finds `queue` (a name or a URL) and reads its attributes; a missing queue, a wrong region or bad credentials
/// are named with the fix.
pub async fn queue_info(client: &aws_sdk_sqs::Client, queue: &str) -> Result<QueueInfo, Error> {
    let url = if queue.starts_with("http://") || queue.starts_with("https://") {
        queue.to_owned()
    } else {
        let found = client.get_queue_url().queue_name(queue).send().await.map_err(|e| {
            explain(e, &format!("sqs queue {queue}"), "create the queue or name an existing one (its name or URL)")
        })?;
        found.queue_url().unwrap_or_default().to_owned()
    };
    let attributes =
        client.get_queue_attributes().queue_url(&url).attribute_names(QueueAttributeName::All).send().await.map_err(
            |e| explain(e, &format!("sqs queue {queue}"), "check the queue's URL and the credentials' rights"),
        )?;
    let empty = HashMap::new();
    let attributes = attributes.attributes().unwrap_or(&empty);
    let seconds_of = |name: QueueAttributeName| {
        attributes.get(&name).and_then(|v| v.trim().parse::<u64>().ok()).map(Duration::from_secs)
    };
    let redrive = attributes
        .get(&QueueAttributeName::RedrivePolicy)
        .and_then(|policy| serde_json::from_str::<serde_json::Value>(policy).ok())
        .and_then(|policy| match &policy["maxReceiveCount"] {
            serde_json::Value::Number(n) => n.as_u64(),
            serde_json::Value::String(s) => s.parse().ok(),
            _ => None,
        })
        .map(|n| n.min(u64::from(u32::MAX)) as u32);
    let name = url.rsplit('/').next().unwrap_or(queue).to_owned();
    Ok(QueueInfo {
        fifo: attributes.get(&QueueAttributeName::FifoQueue).is_some_and(|v| v == "true") || name.ends_with(".fifo"),
        visibility_timeout: seconds_of(QueueAttributeName::VisibilityTimeout).unwrap_or(Duration::from_secs(30)),
        retention: seconds_of(QueueAttributeName::MessageRetentionPeriod),
        redrive_max_receive_count: redrive,
        name,
        url,
    })
}

/// A start-up failure of the SQS API as a configuration error naming what, why and the fix.
fn explain<E, R>(error: aws_sdk_sqs::error::SdkError<E, R>, what: &str, fix: &str) -> Error
where
    E: aws_sdk_sqs::error::ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug,
{
    use aws_sdk_sqs::error::SdkError;
    let reason = match &error {
        SdkError::ServiceError(service) => {
            let e = service.err();
            let code = e.code().unwrap_or("error");
            match code {
                "AWS.SimpleQueueService.NonExistentQueue" | "QueueDoesNotExist" => {
                    format!("the queue does not exist in this account and region ({code}). Fix: {fix}")
                }
                "InvalidClientTokenId" | "SignatureDoesNotMatch" | "UnrecognizedClientException" => format!(
                    "the credentials were refused ({code}: {}). Fix: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY \
                     or the profile",
                    e.message().unwrap_or_default()
                ),
                "AccessDenied" | "AccessDeniedException" => format!(
                    "access denied ({}). Fix: allow sqs:GetQueueUrl, GetQueueAttributes, ReceiveMessage, \
                     DeleteMessage and ChangeMessageVisibility on the queue",
                    e.message().unwrap_or_default()
                ),
                _ => format!("{code}: {}. Fix: {fix}", e.message().unwrap_or_default()),
            }
        }
        other => {
            format!(
                "{}. Fix: check the endpoint (the `endpoint` setting, `--sqs`) and the region (AWS_REGION)",
                describe(other)
            )
        }
    };
    Error::Config(format!("{what}: {reason}"))
}

/// An SDK error with its sources, which the SDK's own `Display` leaves out ("dispatch failure").
pub(crate) fn describe(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Creates queue `name` (FIFO when it ends in `.fifo`) with `visibility_timeout` and `retention`, and returns
/// its URL. For demos and tests; production queues are an operator's decision.
pub async fn create_queue(
    client: &aws_sdk_sqs::Client,
    name: &str,
    visibility_timeout: Duration,
    retention: Duration,
) -> Result<String, Error> {
    let mut request = client
        .create_queue()
        .queue_name(name)
        .attributes(QueueAttributeName::VisibilityTimeout, visibility_timeout.as_secs().to_string())
        .attributes(QueueAttributeName::MessageRetentionPeriod, retention.as_secs().to_string());
    if name.ends_with(".fifo") {
        request = request.attributes(QueueAttributeName::FifoQueue, "true");
    }
    let created = request
        .send()
        .await
        .map_err(|e| Error::Config(format!("sqs: cannot create queue {name}: {}", describe(&e))))?;
    Ok(created.queue_url().unwrap_or_default().to_owned())
}

/// Deletes queue `name` (a name or URL); a missing queue is not an error.
pub async fn delete_queue(client: &aws_sdk_sqs::Client, queue: &str) -> Result<(), Error> {
    let url = match queue_info(client, queue).await {
        Ok(info) => info.url,
        Err(_) => return Ok(()),
    };
    client
        .delete_queue()
        .queue_url(url)
        .send()
        .await
        .map_err(|e| Error::Config(format!("sqs: cannot delete queue {queue}: {}", describe(&e))))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_visibility_timeout_shorter_than_a_batch_is_refused_with_both_values_and_the_fix() {
        let err = visibility_guard("orders", Duration::from_secs(5), Duration::from_secs(30)).unwrap_err().to_string();
        assert!(err.contains("VisibilityTimeout 5 s") && err.contains("max_batch_time 30 s"), "{err}");
        assert!(err.contains("at least 30 s") && err.contains("VisibilityTimeout=30"), "{err}");
        assert!(visibility_guard("orders", Duration::from_secs(30), Duration::from_secs(30)).is_ok());
    }

    #[test]
    fn settings_out_of_range_are_refused_by_name() {
        let base = SqsConfig::new("orders");
        base.validate().unwrap();
        let cases = [
            (SqsConfig { queue: " ".into(), ..base.clone() }, "queue is empty"),
            (SqsConfig { endpoint: Some("127.0.0.1:9324".into()), ..base.clone() }, "endpoint"),
            (SqsConfig { wait_time: Duration::from_secs(21), ..base.clone() }, "wait_time"),
            (SqsConfig { partitions: 0, ..base.clone() }, "partitions"),
            (SqsConfig { max_receive_count: Some(0), ..base.clone() }, "max_receive_count"),
            (SqsConfig { max_batch_time: Duration::ZERO, ..base.clone() }, "max_batch_time"),
        ];
        for (config, named) in cases {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(named), "{named}: {err}");
        }
    }

    #[test]
    fn only_this_machine_counts_as_a_local_endpoint() {
        for local in ["http://127.0.0.1:9324", "http://localhost:4566/", "http://[::1]:9324", "http://127.0.1.1"] {
            assert!(is_loopback(local), "{local}");
        }
        for remote in ["https://sqs.eu-west-1.amazonaws.com", "http://10.0.0.5:9324", "http://localhost.example.com"] {
            assert!(!is_loopback(remote), "{remote}");
        }
    }

    #[test]
    fn retention_below_the_margin_is_refused_in_sqs_words() {
        use crate::retention::{RetentionPolicy, Verdict};
        let day = 86_400_000;
        let policy = RetentionPolicy {
            marker_retention: Some(Duration::from_secs(3 * 86_400)),
            accept_infinite_retention: false,
            broker: SQS_QUEUE,
        };
        let Verdict::Refuse(message) = policy.judge("orders", Some(4 * day)) else { panic!("4 d against 3 d") };
        assert!(message.contains("MessageRetentionPeriod of queue orders"), "{message}");
        assert!(message.contains("4.4 days") || message.contains("4.4"), "{message}");
    }
}
