//! Where the demo's events travel: the embedded log or a broker, the events produced into it, and what the demo
//! created there removed at the end.

use std::path::{Path, PathBuf};

use anyhow::Context;

use super::events::{write_embedded, write_kafka, write_nats, write_rabbitmq};
use super::{DemoArgs, GROUP, SQS_VISIBILITY};

/// Where the demo's events travel.
pub(super) enum Transport {
    Embedded(PathBuf),
    Kafka {
        brokers: String,
        topic: String,
        group: String,
    },
    Nats {
        url: String,
        stream: String,
        group: String,
        partitions: i32,
    },
    Rabbitmq {
        url: String,
        queues: Vec<String>,
        group: String,
    },
    Sqs {
        endpoint: String,
        queue: String,
        group: String,
        partitions: i32,
    },
    /// A topic and its ordered subscription of this run's own; `outstanding` bounds what one consumer holds.
    PubSub {
        project: String,
        topic: String,
        subscription: String,
        group: String,
        partitions: i32,
        outstanding: i64,
    },
}

impl Transport {
    /// Produces `records` into the transport `args` name (a queue, topic or stream of this run's own), removing
    /// what it created when producing fails.
    pub(super) async fn produce(
        args: &DemoArgs,
        run_id: u128,
        log_dir: &Path,
        records: &[(i64, String)],
    ) -> anyhow::Result<Transport> {
        Ok(match (&args.kafka, &args.nats) {
            (None, None) if args.sqs.is_some() => {
                let endpoint = args.sqs.clone().unwrap_or_default();
                let (queue, group) = (format!("idem-demo-{run_id}.fifo"), format!("{GROUP}-{run_id}"));
                let written = crate::sqs::write_demo_queue(&endpoint, &queue, SQS_VISIBILITY, records)
                    .await
                    .context("producing the events to SQS");
                if let Err(error) = written {
                    crate::sqs::remove_demo_queue(&endpoint, &queue).await;
                    return Err(error);
                }
                Transport::Sqs { endpoint, queue, group, partitions: args.partitions }
            }
            (None, None) if args.pubsub.is_some() => {
                let project = args.pubsub.clone().unwrap_or_default();
                let topic = format!("idem-demo-{run_id}");
                let (subscription, group) = (format!("{topic}-ledger"), format!("{GROUP}-{run_id}"));
                let written = crate::pubsub::write_demo_topic(&project, &topic, &subscription, records)
                    .await
                    .context("producing the events to Pub/Sub");
                if let Err(error) = written {
                    crate::pubsub::remove_demo(&project, &topic, &subscription).await;
                    return Err(error);
                }
                let outstanding = args.batch_size as i64 * i64::from(args.partitions);
                Transport::PubSub { project, topic, subscription, group, partitions: args.partitions, outstanding }
            }
            (None, None) if args.rabbitmq.is_some() => {
                let url = args.rabbitmq.clone().unwrap_or_default();
                let queues: Vec<String> = (0..args.partitions).map(|p| format!("idem-demo-{run_id}-{p}")).collect();
                let group = format!("{GROUP}-{run_id}");
                let written = write_rabbitmq(&url, &queues, records).await.context("producing the events to RabbitMQ");
                if let Err(error) = written {
                    remove_rabbitmq_queues(&url, &queues).await;
                    return Err(error);
                }
                Transport::Rabbitmq { url, queues, group }
            }
            (Some(brokers), _) => {
                let (topic, group) = (format!("idem-demo-{run_id}"), format!("{GROUP}-{run_id}"));
                write_kafka(brokers, &topic, args.partitions, records)
                    .await
                    .context("producing the events to Kafka")?;
                Transport::Kafka { brokers: brokers.clone(), topic, group }
            }
            (None, Some(url)) => {
                let (stream, group) = (format!("idem-demo-{run_id}"), format!("{GROUP}-{run_id}"));
                write_nats(url, &stream, records).await.context("producing the events to NATS JetStream")?;
                Transport::Nats { url: url.clone(), stream, group, partitions: args.partitions }
            }
            (None, None) => {
                write_embedded(log_dir, args.partitions, records).context("producing the events")?;
                Transport::Embedded(log_dir.to_path_buf())
            }
        })
    }

    /// Removes the stream or queues the demo created (a Kafka topic and the embedded log stay).
    pub(super) async fn remove(&self) {
        match self {
            Transport::Nats { url, stream, .. } => remove_nats_stream(url, stream).await,
            Transport::Rabbitmq { url, queues, .. } => remove_rabbitmq_queues(url, queues).await,
            Transport::Sqs { endpoint, queue, .. } => crate::sqs::remove_demo_queue(endpoint, queue).await,
            Transport::PubSub { project, topic, subscription, .. } => {
                crate::pubsub::remove_demo(project, topic, subscription).await
            }
            Transport::Embedded(_) | Transport::Kafka { .. } => {}
        }
    }

    /// The `idem demo-worker` arguments that consume from here.
    pub(super) fn worker_args(&self) -> Vec<String> {
        match self {
            Transport::Embedded(dir) => vec!["--log-dir".into(), dir.display().to_string()],
            Transport::Kafka { brokers, topic, group } => vec![
                "--kafka".into(),
                brokers.clone(),
                "--topic".into(),
                topic.clone(),
                "--group".into(),
                group.clone(),
                "--kafka-setting".into(),
                "session.timeout.ms=6000".into(),
            ],
            // AckWait 3 s: what a killed consumer held comes again 3 s later.
            Transport::Nats { url, stream, group, partitions } => vec![
                "--nats".into(),
                url.clone(),
                "--topic".into(),
                stream.clone(),
                "--group".into(),
                group.clone(),
                "--ack-wait-secs".into(),
                "3".into(),
                "--nats-partitions".into(),
                partitions.to_string(),
            ],
            // Batches of at most 3 s: the queue's visibility timeout.
            Transport::Sqs { endpoint, queue, group, partitions } => vec![
                "--sqs".into(),
                endpoint.clone(),
                "--topic".into(),
                queue.clone(),
                "--group".into(),
                group.clone(),
                "--max-batch-secs".into(),
                SQS_VISIBILITY.as_secs().to_string(),
                "--sqs-partitions".into(),
                partitions.to_string(),
            ],
            // Batches of at most 3 s; the end is 12 s without a message on the service (what a killed consumer
            // held is due again after the 10 s ack deadline), 3 s on the emulator (which does not deliver it again).
            Transport::PubSub { project, subscription, group, partitions, outstanding, .. } => vec![
                "--pubsub".into(),
                project.clone(),
                "--topic".into(),
                subscription.clone(),
                "--group".into(),
                group.clone(),
                "--pubsub-partitions".into(),
                partitions.to_string(),
                "--pubsub-outstanding".into(),
                outstanding.to_string(),
                "--idle-end-secs".into(),
                pubsub_idle_end().as_secs().to_string(),
            ],
            Transport::Rabbitmq { url, queues, group } => {
                let mut args = vec!["--rabbitmq".into(), url.clone(), "--group".into(), group.clone()];
                for queue in queues {
                    args.extend(["--queue".to_owned(), queue.clone()]);
                }
                args
            }
        }
    }
}

/// The quiet time that ends a Pub/Sub consumer of the demo: longer than the ack deadline on the service, so what a
/// killed consumer held comes back first; short on the emulator, which does not deliver that again.
pub(super) fn pubsub_idle_end() -> std::time::Duration {
    match crate::pubsub::emulator() {
        Some(_) => std::time::Duration::from_secs(3),
        None => std::time::Duration::from_secs(12),
    }
}

#[cfg(feature = "nats")]
async fn remove_nats_stream(url: &str, stream: &str) {
    if let Err(error) = idem::nats::delete_stream(url, stream).await {
        eprintln!("warning: the demo's stream {stream} was not removed: {error}");
    }
}

#[cfg(not(feature = "nats"))]
async fn remove_nats_stream(_: &str, _: &str) {}

#[cfg(feature = "rabbitmq")]
async fn remove_rabbitmq_queues(url: &str, queues: &[String]) {
    for queue in queues {
        if let Err(error) = idem::rabbitmq::delete_queue(url, queue).await {
            eprintln!("warning: the demo's queue {queue} was not removed: {error}");
        }
    }
}

#[cfg(not(feature = "rabbitmq"))]
async fn remove_rabbitmq_queues(_: &str, _: &[String]) {}
