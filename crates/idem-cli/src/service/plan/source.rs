//! The consumer's source table: exactly one of embedded, kafka, nats, rabbitmq, sqs and pubsub, its values checked.

use std::time::Duration;

use super::database::literal_password;
use super::{Problems, duration, expanded};
use crate::service::file::Consumer;

/// Where a consumer reads.
#[derive(Debug, Clone)]
pub enum SourcePlan {
    /// The embedded log.
    Embedded { dir: String, topics: Vec<String> },
    /// Kafka.
    Kafka { brokers: String, topics: Vec<String>, settings: Vec<(String, String)> },
    /// NATS JetStream.
    Nats { url: String, stream: String, ack_wait: Duration, partitions: u32 },
    /// RabbitMQ.
    Rabbit { url: String, queues: Vec<String>, prefetch: Option<u16> },
    /// Amazon SQS.
    Sqs {
        queue: String,
        endpoint: Option<String>,
        region: Option<String>,
        max_batch_time: Duration,
        partitions: u32,
        max_receive_count: Option<u32>,
    },
    /// Google Cloud Pub/Sub.
    PubSub {
        subscription: String,
        project: Option<String>,
        emulator_host: Option<String>,
        partitions: u32,
        max_batch_time: Duration,
        max_lease: Duration,
        require_ordering: bool,
        max_outstanding_messages: Option<i64>,
        idle_end: Duration,
    },
}

impl SourcePlan {
    /// The broker's name when its messages have no stable offset (so `broker-id` cannot be their key).
    pub(super) fn unstable_offsets(&self) -> Option<&'static str> {
        match self {
            SourcePlan::Rabbit { .. } => Some("rabbitmq"),
            SourcePlan::Sqs { .. } => Some("sqs"),
            SourcePlan::PubSub { .. } => Some("pubsub"),
            _ => None,
        }
    }
}

/// The consumer's one source, checked, or `None` after recording why there is none.
pub(super) fn plan(
    problems: &mut Problems<'_>,
    line: usize,
    c: &Consumer,
    here: &dyn Fn(&str) -> String,
) -> Option<SourcePlan> {
    let declared = [
        c.embedded.is_some(),
        c.kafka.is_some(),
        c.nats.is_some(),
        c.rabbitmq.is_some(),
        c.sqs.is_some(),
        c.pubsub.is_some(),
    ];
    if declared.iter().filter(|d| **d).count() != 1 {
        problems.line(
            line,
            &here("source"),
            "declare exactly one source table: [consumer.embedded], \
             [consumer.kafka], [consumer.nats], [consumer.rabbitmq], [consumer.sqs] or [consumer.pubsub]",
        );
        return None;
    }
    let topics = |problems: &mut Problems<'_>, topics: &[String], what: &str| {
        if topics.is_empty() || topics.iter().any(|t| t.trim().is_empty()) {
            problems.line(line, &here(what), "list at least one, none empty");
        }
    };
    if let Some(e) = &c.embedded {
        topics(problems, &e.topics, "embedded.topics");
        let dir = expanded(problems, &e.dir, &here("embedded.dir"))?;
        return Some(SourcePlan::Embedded { dir, topics: e.topics.clone() });
    }
    if let Some(k) = &c.kafka {
        topics(problems, &k.topics, "kafka.topics");
        let brokers = expanded(problems, &k.brokers, &here("kafka.brokers"))?;
        let settings = k.settings.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        return Some(SourcePlan::Kafka { brokers, topics: k.topics.clone(), settings });
    }
    if let Some(n) = &c.nats {
        let url = expanded(problems, &n.url, &here("nats.url"))?;
        let ack_wait = match &n.ack_wait {
            Some(w) => duration(problems, w, &here("nats.ack_wait"))?,
            None => Duration::from_secs(30),
        };
        return Some(SourcePlan::Nats {
            url,
            stream: n.stream.clone(),
            ack_wait,
            partitions: n.partitions.unwrap_or(1),
        });
    }
    if let Some(q) = &c.sqs {
        if q.queue.trim().is_empty() {
            problems.line(line, &here("sqs.queue"), "name the queue (its name or URL)");
        }
        let endpoint = match &q.endpoint {
            Some(e) => Some(expanded(problems, e, &here("sqs.endpoint"))?).filter(|e| e != "aws"),
            None => None,
        };
        let max_batch_time = match &q.max_batch_time {
            Some(t) => duration(problems, t, &here("sqs.max_batch_time"))?,
            None => Duration::from_secs(30),
        };
        return Some(SourcePlan::Sqs {
            queue: q.queue.clone(),
            endpoint,
            region: q.region.clone(),
            max_batch_time,
            partitions: q.partitions.unwrap_or(8),
            max_receive_count: q.max_receive_count,
        });
    }
    if let Some(g) = &c.pubsub {
        if g.subscription.trim().is_empty() {
            problems.line(
                line,
                &here("pubsub.subscription"),
                "name the subscription (its id or projects/P/subscriptions/S)",
            );
        }
        let text = |problems: &mut Problems<'_>, value: &Option<toml::Spanned<String>>, what: &str| match value {
            Some(v) => expanded(problems, v, &here(what)).map(Some),
            None => Some(None),
        };
        let project = text(problems, &g.project, "pubsub.project")?;
        let emulator_host = text(problems, &g.emulator_host, "pubsub.emulator_host")?;
        let max_batch_time = match &g.max_batch_time {
            Some(t) => duration(problems, t, &here("pubsub.max_batch_time"))?,
            None => Duration::from_secs(10),
        };
        let max_lease = match &g.max_lease {
            Some(t) => duration(problems, t, &here("pubsub.max_lease"))?,
            None => Duration::from_secs(3600),
        };
        let idle_end = match &g.idle_end {
            Some(t) => duration(problems, t, &here("pubsub.idle_end"))?,
            None => Duration::from_secs(3),
        };
        if g.max_outstanding_messages.is_some_and(|n| n < 1) {
            problems.line(line, &here("pubsub.max_outstanding_messages"), "lets no message through: use at least 1");
        }
        return Some(SourcePlan::PubSub {
            subscription: g.subscription.clone(),
            project,
            emulator_host,
            partitions: g.partitions.unwrap_or(8),
            max_batch_time,
            max_lease,
            require_ordering: g.require_ordering.unwrap_or(false),
            max_outstanding_messages: g.max_outstanding_messages,
            idle_end,
        });
    }
    let r = c.rabbitmq.as_ref()?;
    if literal_password(r.url.get_ref()) {
        problems.at(
            &r.url,
            &here("rabbitmq.url"),
            "holds a password: write it as ${RABBITMQ_PASSWORD} (from the \
             environment), not in the file",
        );
        return None;
    }
    topics(problems, &r.queues, "rabbitmq.queues");
    let url = expanded(problems, &r.url, &here("rabbitmq.url"))?;
    Some(SourcePlan::Rabbit { url, queues: r.queues.clone(), prefetch: r.prefetch })
}
