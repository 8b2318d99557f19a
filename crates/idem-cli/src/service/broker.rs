//! A consumer's broker as the library configures it, made from its plan in one place: `idem run` connects with
//! it, `idem check` verifies with it what the broker must hold (the server answers to the credentials, the topics,
//! streams, queues and subscriptions exist and may be read) without consuming anything.

#![cfg_attr(
    not(all(feature = "kafka", feature = "nats", feature = "rabbitmq", feature = "sqs", feature = "pubsub")),
    allow(dead_code)
)]

use anyhow::bail;

use super::plan::SourcePlan;

/// The Kafka consumer's configuration.
#[cfg(feature = "kafka")]
pub fn kafka(source: &SourcePlan, exit_at_end: bool) -> anyhow::Result<idem::kafka::KafkaConfig> {
    let SourcePlan::Kafka { brokers, topics, settings, drain_timeout, accept_infinite_topic_retention } = source else {
        bail!("not a Kafka source")
    };
    let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
    let mut kafka = idem::kafka::KafkaConfig::new(brokers.as_str(), &topics);
    for (key, value) in settings {
        kafka = kafka.set(key, value);
    }
    kafka.stop_at_end = exit_at_end;
    if let Some(timeout) = drain_timeout {
        kafka.drain_timeout = *timeout;
    }
    kafka.accept_infinite_topic_retention = *accept_infinite_topic_retention;
    Ok(kafka)
}

/// The JetStream consumer's configuration.
#[cfg(feature = "nats")]
pub fn nats(source: &SourcePlan, exit_at_end: bool) -> anyhow::Result<idem::nats::NatsConfig> {
    let SourcePlan::Nats {
        url,
        stream,
        ack_wait,
        partitions,
        filter_subject,
        max_deliver,
        durable,
        max_ack_pending,
        accept_infinite_stream_retention,
    } = source
    else {
        bail!("not a NATS source")
    };
    Ok(idem::nats::NatsConfig {
        ack_wait: *ack_wait,
        max_batch_time: (*ack_wait).min(std::time::Duration::from_secs(10)),
        stop_at_end: exit_at_end,
        partitions: *partitions,
        filter_subject: filter_subject.clone(),
        max_deliver: max_deliver.unwrap_or(-1),
        durable: durable.clone(),
        max_ack_pending: *max_ack_pending,
        accept_infinite_stream_retention: *accept_infinite_stream_retention,
        ..idem::nats::NatsConfig::new(url.as_str(), stream.as_str())
    })
}

/// The RabbitMQ consumer's configuration.
#[cfg(feature = "rabbitmq")]
pub fn rabbitmq(source: &SourcePlan, exit_at_end: bool) -> anyhow::Result<idem::rabbitmq::RabbitConfig> {
    let SourcePlan::Rabbit { url, queues, prefetch, delivery_limit, dead_letter_exchange } = source else {
        bail!("not a RabbitMQ source")
    };
    let queues: Vec<&str> = queues.iter().map(String::as_str).collect();
    Ok(idem::rabbitmq::RabbitConfig {
        prefetch: *prefetch,
        delivery_limit: *delivery_limit,
        dead_letter_exchange: *dead_letter_exchange,
        stop_at_end: exit_at_end,
        ..idem::rabbitmq::RabbitConfig::new(url.as_str(), &queues)
    })
}

/// The SQS consumer's configuration.
#[cfg(feature = "sqs")]
pub fn sqs(source: &SourcePlan, exit_at_end: bool) -> anyhow::Result<idem::sqs::SqsConfig> {
    let SourcePlan::Sqs { queue, endpoint, region, max_batch_time, partitions, max_receive_count, wait_time } = source
    else {
        bail!("not an SQS source")
    };
    let defaults = idem::sqs::SqsConfig::new(queue.as_str());
    Ok(idem::sqs::SqsConfig {
        wait_time: wait_time.unwrap_or(defaults.wait_time),
        endpoint: endpoint.clone(),
        region: region.clone(),
        max_batch_time: *max_batch_time,
        partitions: *partitions,
        max_receive_count: *max_receive_count,
        stop_at_end: exit_at_end,
        ..defaults
    })
}

/// The Pub/Sub consumer's configuration.
#[cfg(feature = "pubsub")]
pub fn pubsub(source: &SourcePlan, exit_at_end: bool) -> anyhow::Result<idem::pubsub::PubSubConfig> {
    let SourcePlan::PubSub {
        subscription,
        project,
        emulator_host,
        partitions,
        max_batch_time,
        max_lease,
        require_ordering,
        max_outstanding_messages,
        idle_end,
    } = source
    else {
        bail!("not a Pub/Sub source")
    };
    Ok(idem::pubsub::PubSubConfig {
        project: project.clone(),
        emulator_host: emulator_host.clone(),
        partitions: *partitions,
        max_batch_time: *max_batch_time,
        max_lease: *max_lease,
        require_ordering: *require_ordering,
        max_outstanding_messages: *max_outstanding_messages,
        stop_at_end: exit_at_end,
        idle_end: *idle_end,
        ..idem::pubsub::PubSubConfig::new(subscription.as_str())
    })
}

/// What `idem run` would meet at the consumer's broker, checked without consuming: `Err` names the fault and its
/// fix. The embedded log is checked apart (before the database); HTTP has no broker.
pub async fn check(source: &SourcePlan, engine: &idem::Config) -> anyhow::Result<()> {
    match source {
        SourcePlan::Embedded { .. } | SourcePlan::Http { .. } => Ok(()),
        #[cfg(feature = "kafka")]
        SourcePlan::Kafka { .. } => Ok(idem::kafka::check(&kafka(source, false)?, engine).await?),
        #[cfg(feature = "nats")]
        SourcePlan::Nats { .. } => Ok(idem::nats::check(&nats(source, false)?, engine).await?),
        #[cfg(feature = "rabbitmq")]
        SourcePlan::Rabbit { .. } => Ok(idem::rabbitmq::check(&rabbitmq(source, false)?).await?),
        #[cfg(feature = "sqs")]
        SourcePlan::Sqs { .. } => Ok(idem::sqs::check(&sqs(source, false)?, engine).await?),
        #[cfg(feature = "pubsub")]
        SourcePlan::PubSub { .. } => Ok(idem::pubsub::check(&pubsub(source, false)?, engine).await?),
        #[allow(unreachable_patterns)]
        _ => {
            let _ = engine;
            bail!("this idem is built without this consumer's source (see `idem check`)")
        }
    }
}
