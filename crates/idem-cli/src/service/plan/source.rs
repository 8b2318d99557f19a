//! The consumer's source table: exactly one of embedded, kafka, nats, rabbitmq, sqs, pubsub and http, its values
//! checked.

use std::net::SocketAddr;
use std::time::Duration;

use idem::ingress::{Encoding, Limits, Secret, Signature};

use super::database::literal_password;
use super::{Problems, duration, expanded};
use crate::service::file::{Consumer, HttpSource};

/// Where a consumer reads.
#[derive(Debug, Clone)]
pub enum SourcePlan {
    /// The embedded log.
    Embedded { dir: String, topics: Vec<String> },
    /// Kafka.
    Kafka {
        brokers: String,
        topics: Vec<String>,
        settings: Vec<(String, String)>,
        drain_timeout: Option<Duration>,
        accept_infinite_topic_retention: bool,
    },
    /// NATS JetStream.
    Nats {
        url: String,
        stream: String,
        ack_wait: Duration,
        partitions: u32,
        filter_subject: Option<String>,
        max_deliver: Option<i64>,
        durable: Option<String>,
        max_ack_pending: Option<i64>,
        accept_infinite_stream_retention: bool,
    },
    /// RabbitMQ.
    Rabbit {
        url: String,
        queues: Vec<String>,
        prefetch: Option<u16>,
        delivery_limit: Option<u32>,
        dead_letter_exchange: bool,
    },
    /// Amazon SQS.
    Sqs {
        queue: String,
        endpoint: Option<String>,
        region: Option<String>,
        max_batch_time: Duration,
        partitions: u32,
        max_receive_count: Option<u32>,
        wait_time: Option<Duration>,
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
    /// HTTP requests on an endpoint of idem's own.
    Http { listen: SocketAddr, path: String, limits: Limits, signature: Option<Signature> },
}

impl SourcePlan {
    /// The broker's name when its messages have no stable offset (so `broker-id` cannot be their key).
    pub(super) fn unstable_offsets(&self) -> Option<&'static str> {
        match self {
            SourcePlan::Rabbit { .. } => Some("rabbitmq"),
            SourcePlan::Sqs { .. } => Some("sqs"),
            SourcePlan::PubSub { .. } => Some("pubsub"),
            SourcePlan::Http { .. } => Some("http"),
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
        c.http.is_some(),
    ];
    if declared.iter().filter(|d| **d).count() != 1 {
        problems.line(
            line,
            &here("source"),
            "declare exactly one source table: [consumer.embedded], \
             [consumer.kafka], [consumer.nats], [consumer.rabbitmq], [consumer.sqs], [consumer.pubsub] or [consumer.http]",
        );
        return None;
    }
    let tables = ["embedded", "kafka", "nats", "rabbitmq", "sqs", "pubsub", "http"];
    if let Some((table, _)) = tables.iter().zip(declared).find(|(_, d)| *d)
        && crate::features::OPTIONAL.iter().any(|(feature, _)| feature == table)
        && !crate::features::built_with(table)
    {
        let refusal = crate::features::missing(table, &format!("[consumer.{table}]"));
        problems.line(line, &here(table), refusal.to_string());
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
        let drain_timeout = match &k.drain_timeout {
            Some(t) => Some(duration(problems, t, &here("kafka.drain_timeout"))?),
            None => None,
        };
        return Some(SourcePlan::Kafka {
            brokers,
            topics: k.topics.clone(),
            settings,
            drain_timeout,
            accept_infinite_topic_retention: k.accept_infinite_topic_retention.unwrap_or(false),
        });
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
            filter_subject: n.filter_subject.clone(),
            max_deliver: n.max_deliver,
            durable: n.durable.clone(),
            max_ack_pending: n.max_ack_pending,
            accept_infinite_stream_retention: n.accept_infinite_stream_retention.unwrap_or(false),
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
        let wait_time = match &q.wait_time {
            Some(t) => Some(duration(problems, t, &here("sqs.wait_time"))?),
            None => None,
        };
        return Some(SourcePlan::Sqs {
            queue: q.queue.clone(),
            endpoint,
            region: q.region.clone(),
            max_batch_time,
            partitions: q.partitions.unwrap_or(8),
            max_receive_count: q.max_receive_count,
            wait_time,
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
    if let Some(h) = &c.http {
        return http(problems, h, here);
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
    Some(SourcePlan::Rabbit {
        url,
        queues: r.queues.clone(),
        prefetch: r.prefetch,
        delivery_limit: r.delivery_limit,
        dead_letter_exchange: r.dead_letter_exchange.unwrap_or(false),
    })
}

/// `[consumer.http]`: the address, a plain path, the limits and the signature with its secret (read now, so that
/// `idem check` catches a secret that is not there).
fn http(problems: &mut Problems<'_>, h: &HttpSource, here: &dyn Fn(&str) -> String) -> Option<SourcePlan> {
    let found = problems.found.len();
    let listen = expanded(problems, &h.listen, &here("http.listen")).and_then(|value| {
        value
            .parse::<SocketAddr>()
            .map_err(|_| {
                problems.at(
                    &h.listen,
                    &here("http.listen"),
                    format!("`{value}` is not an address: write host:port with an IP, e.g. 127.0.0.1:8080"),
                )
            })
            .ok()
    });
    let path = expanded(problems, &h.path, &here("http.path"));
    if let Some(path) = &path
        && let Err(e) = idem::ingress::check_path(path)
    {
        problems.at(&h.path, &here("http.path"), e.to_string());
    }
    let defaults = Limits::default();
    let mut limit = |value: &Option<toml::Spanned<String>>, key: &str, default: Duration| match value {
        Some(v) => match duration(problems, v, &here(key)) {
            Some(d) if d.is_zero() => {
                problems.at(v, &here(key), "must be above 0");
                None
            }
            d => d,
        },
        None => Some(default),
    };
    let request_timeout = limit(&h.request_timeout, "http.request_timeout", defaults.request_timeout);
    let header_timeout = limit(&h.header_timeout, "http.header_timeout", defaults.header_timeout);
    let wait_for_first = limit(&h.wait_for_first, "http.wait_for_first", defaults.wait_for_first);
    let max_body_bytes = match &h.max_body_bytes {
        Some(n) if *n.get_ref() == 0 => {
            problems.at(n, &here("http.max_body_bytes"), "takes no body at all: use at least 1 (bytes)");
            None
        }
        Some(n) => Some(*n.get_ref()),
        None => Some(defaults.max_body_bytes),
    };
    let signature = signature(problems, h, here);
    if problems.found.len() != found {
        return None;
    }
    let limits = Limits {
        max_body_bytes: max_body_bytes?,
        request_timeout: request_timeout?,
        wait_for_first: wait_for_first?,
        header_timeout: header_timeout?,
    };
    Some(SourcePlan::Http { listen: listen?, path: path?, limits, signature: signature? })
}

/// The signature `[consumer.http]` requires, its secret read; `Some(None)` for none. A key of one form set with
/// another form (or with none) is named.
fn signature(problems: &mut Problems<'_>, h: &HttpSource, here: &dyn Fn(&str) -> String) -> Option<Option<Signature>> {
    // Each form's own keys: the key's name, whether the file sets it, and the form it belongs to (None: any form).
    let keys = [
        ("http.secret_env", h.secret_env.is_some() || h.secret_file.is_some(), None),
        ("http.tolerance", h.tolerance.is_some(), Some("stripe")),
        ("http.signature_header", h.signature_header.is_some() || h.signature_prefix.is_some(), Some("hmac")),
        ("http.signature_encoding", h.signature_encoding.is_some(), Some("hmac")),
    ];
    let Some(kind) = &h.signature else {
        for (key, _, _) in keys.iter().filter(|(_, set, _)| *set) {
            problems.line(
                line_of(problems, &h.path),
                &here(key),
                "is set without `signature`: add signature = \"stripe\", \"github\" or \"hmac\", or remove it",
            );
        }
        return Some(None);
    };
    for (key, _, form) in keys.iter().filter(|(_, set, form)| *set && form.is_some_and(|f| f != kind.get_ref())) {
        let form = form.unwrap_or_default();
        problems.at(kind, &here(key), format!("applies only to signature = \"{form}\": remove it"));
    }
    let secret = match (&h.secret_env, &h.secret_file) {
        (Some(env), None) => {
            Secret::from_env(env.get_ref()).map_err(|e| problems.at(env, &here("http.secret_env"), e.to_string())).ok()
        }
        (None, Some(file)) => {
            let path = expanded(problems, file, &here("http.secret_file"))?;
            Secret::from_file(std::path::Path::new(&path))
                .map_err(|e| problems.at(file, &here("http.secret_file"), e.to_string()))
                .ok()
        }
        _ => {
            problems.at(
                kind,
                &here("http.signature"),
                "needs its secret: set exactly one of secret_env (an environment variable's name) or secret_file",
            );
            None
        }
    };
    let signature = match kind.get_ref().as_str() {
        "stripe" => {
            let tolerance = match &h.tolerance {
                Some(t) => duration(problems, t, &here("http.tolerance"))?,
                None => Duration::from_secs(300),
            };
            Signature::Stripe { secret: secret?, tolerance }
        }
        "github" => Signature::GitHub { secret: secret? },
        "hmac" => {
            let Some(header) = &h.signature_header else {
                problems.at(kind, &here("http.signature_header"), "hmac needs the header that holds the signature");
                return None;
            };
            let encoding = match h.signature_encoding.as_ref().map(|e| (e, e.get_ref().as_str())) {
                None | Some((_, "hex")) => Encoding::Hex,
                Some((_, "base64")) => Encoding::Base64,
                Some((e, other)) => {
                    problems.at(
                        e,
                        &here("http.signature_encoding"),
                        format!("`{other}` is no encoding: use hex or base64"),
                    );
                    return None;
                }
            };
            Signature::Hmac {
                header: header.get_ref().to_ascii_lowercase(),
                prefix: h.signature_prefix.clone().unwrap_or_default(),
                encoding,
                secret: secret?,
            }
        }
        other => {
            problems.at(
                kind,
                &here("http.signature"),
                format!("`{other}` is no signature: use stripe, github or hmac"),
            );
            return None;
        }
    };
    Some(Some(signature))
}

fn line_of(problems: &Problems<'_>, at: &toml::Spanned<String>) -> usize {
    problems.text.line(at.span().start)
}
