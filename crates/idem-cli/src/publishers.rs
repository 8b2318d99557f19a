//! One publisher for whichever broker the flags name ([`BrokerTarget`]): what dead-letter replays go through, from
//! the command line and from the console.

use anyhow::bail;
use idem::{Message, Publisher, SourceError};

use crate::commands::BrokerTarget;

/// A producer of the broker a [`BrokerTarget`] names.
pub enum AnyPublisher {
    /// The embedded log.
    Log(idem::embedded::LogProducer),
    /// Kafka.
    #[cfg(feature = "kafka")]
    Kafka(idem::kafka::KafkaProducer),
    /// NATS JetStream.
    #[cfg(feature = "nats")]
    Nats(idem::nats::NatsProducer),
    /// RabbitMQ.
    #[cfg(feature = "rabbitmq")]
    Rabbitmq(idem::rabbitmq::RabbitProducer),
    /// Amazon SQS.
    #[cfg(feature = "sqs")]
    Sqs(idem::sqs::SqsProducer),
    /// Google Cloud Pub/Sub.
    #[cfg(feature = "pubsub")]
    PubSub(idem::pubsub::PubSubProducer),
}

impl Publisher for AnyPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        match self {
            AnyPublisher::Log(p) => p.publish(message).await,
            #[cfg(feature = "kafka")]
            AnyPublisher::Kafka(p) => p.publish(message).await,
            #[cfg(feature = "nats")]
            AnyPublisher::Nats(p) => p.publish(message).await,
            #[cfg(feature = "rabbitmq")]
            AnyPublisher::Rabbitmq(p) => p.publish(message).await,
            #[cfg(feature = "sqs")]
            AnyPublisher::Sqs(p) => p.publish(message).await,
            #[cfg(feature = "pubsub")]
            AnyPublisher::PubSub(p) => p.publish(message).await,
        }
    }
}

impl BrokerTarget {
    /// Connects to the broker; a broker this idem is built without is refused, naming the feature.
    pub async fn publisher(&self) -> anyhow::Result<AnyPublisher> {
        Ok(match self {
            BrokerTarget::Log(dir) => {
                if !dir.join("topics").is_dir() {
                    bail!("--log-dir {}: there is no embedded log there (it holds a topics/ folder)", dir.display());
                }
                AnyPublisher::Log(idem::embedded::EmbeddedLog::open(dir)?.producer())
            }
            #[cfg(feature = "kafka")]
            BrokerTarget::Kafka(brokers) => AnyPublisher::Kafka(idem::kafka::KafkaProducer::new(brokers)?),
            #[cfg(feature = "nats")]
            BrokerTarget::Nats(url) => AnyPublisher::Nats(idem::nats::NatsProducer::connect(url).await?),
            #[cfg(feature = "rabbitmq")]
            BrokerTarget::Rabbitmq(url) => AnyPublisher::Rabbitmq(idem::rabbitmq::RabbitProducer::connect(url).await?),
            #[cfg(feature = "sqs")]
            BrokerTarget::Sqs(endpoint) => AnyPublisher::Sqs(crate::sqs::producer(endpoint).await?.0),
            #[cfg(feature = "pubsub")]
            BrokerTarget::PubSub(project) => {
                AnyPublisher::PubSub(idem::pubsub::PubSubProducer::connect(Some(project), None).await?)
            }
            #[allow(unreachable_patterns)]
            other => return Err(other.unavailable()),
        })
    }

    /// The cargo feature that builds this broker's client in (none for the embedded log).
    pub fn feature(&self) -> Option<&'static str> {
        match self {
            BrokerTarget::Log(_) => None,
            BrokerTarget::Kafka(_) => Some("kafka"),
            BrokerTarget::Nats(_) => Some("nats"),
            BrokerTarget::Rabbitmq(_) => Some("rabbitmq"),
            BrokerTarget::Sqs(_) => Some("sqs"),
            BrokerTarget::PubSub(_) => Some("pubsub"),
        }
    }

    /// Refuses this broker when this idem is built without its feature (before a command reads or writes
    /// anything).
    pub fn check_built(&self) -> anyhow::Result<()> {
        match self.feature() {
            Some(feature) => crate::features::require(feature, self.flag()),
            None => Ok(()),
        }
    }

    fn unavailable(&self) -> anyhow::Error {
        crate::features::missing(self.feature().unwrap_or("none"), self.flag())
    }

    /// The flag that names this broker.
    pub fn flag(&self) -> &'static str {
        match self {
            BrokerTarget::Log(_) => "--log-dir",
            BrokerTarget::Kafka(_) => "--kafka",
            BrokerTarget::Nats(_) => "--nats",
            BrokerTarget::Rabbitmq(_) => "--rabbitmq",
            BrokerTarget::Sqs(_) => "--sqs",
            BrokerTarget::PubSub(_) => "--pubsub",
        }
    }
}
