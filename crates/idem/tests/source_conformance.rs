//! The source conformance suite of `idem::testing::conformance`, in process, on the sources of this crate: the
//! embedded log always; Kafka (at `IDEM_KAFKA_BROKERS`, default 127.0.0.1:9092), NATS JetStream (at
//! `IDEM_NATS_URL`, default nats://127.0.0.1:4222) and RabbitMQ (at `IDEM_RABBITMQ_URL`, default the local
//! server) when built with their features. The same guarantees through real consumer processes killed with
//! SIGKILL are idem-cli's `tests/conformance.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::embedded::{ConsumerOptions, EmbeddedLog, LogConsumer, LogProducer};
use idem::source::{Acknowledgement, Received};
use idem::testing::conformance::{self, Broker};
use idem::{Error, Source, SourceError};

mod common;

/// A topic name no other run of this test uses.
fn fresh(prefix: &str, counter: &AtomicUsize) -> String {
    format!("{prefix}-{}-{}", common::unique_name("t"), counter.fetch_add(1, Ordering::SeqCst)).replace('.', "-")
}

struct Embedded {
    log: EmbeddedLog,
    topics: AtomicUsize,
}

impl Broker for Embedded {
    type Source = LogConsumer;
    type Publisher = LogProducer;

    fn name(&self) -> String {
        "embedded log".into()
    }

    async fn create_topic(&self) -> Result<String, Error> {
        let name = format!("payments-{}", self.topics.fetch_add(1, Ordering::SeqCst));
        self.log.create_topic(&name, 3)?;
        Ok(name)
    }

    async fn publisher(&self) -> Result<LogProducer, Error> {
        Ok(self.log.producer())
    }

    async fn consumer(&self, topic: &str, group: &str) -> Result<LogConsumer, Error> {
        Ok(self.log.consumer(group, &[topic], ConsumerOptions::default())?)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_log_passes_the_suite() {
    let db = common::sqlite().await;
    let dir = common::temp_dir();
    let broker = Embedded { log: EmbeddedLog::open(&dir.0).unwrap(), topics: AtomicUsize::new(0) };
    let report = conformance::check(&broker, &db.pool).await.unwrap();
    assert_eq!(report.checks.len(), 4);
    report.assert_passed();
}

/// A source that acknowledges each message as it hands it out (auto-ack): what a consumer held when it stopped
/// never comes again. The suite must find it out.
struct AutoAck(LogConsumer);

impl Source for AutoAck {
    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        let received = self.0.recv().await?;
        if let Some(Received::Message(m)) = &received {
            self.0.ack(&Acknowledgement::up_to(m.topic.clone(), m.partition, m.offset)).await?;
        }
        Ok(received)
    }

    async fn ack(&self, _: &Acknowledgement) -> Result<(), SourceError> {
        Ok(())
    }
}

struct AutoAcking(Embedded);

impl Broker for AutoAcking {
    type Source = AutoAck;
    type Publisher = LogProducer;

    fn name(&self) -> String {
        "embedded log with auto-ack".into()
    }

    async fn create_topic(&self) -> Result<String, Error> {
        self.0.create_topic().await
    }

    async fn publisher(&self) -> Result<LogProducer, Error> {
        self.0.publisher().await
    }

    async fn consumer(&self, topic: &str, group: &str) -> Result<AutoAck, Error> {
        Ok(AutoAck(self.0.consumer(topic, group).await?))
    }

    fn patience(&self) -> Duration {
        Duration::from_secs(5)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_acknowledges_on_receipt_fails_the_suite() {
    let db = common::sqlite().await;
    let dir = common::temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    let broker = AutoAcking(Embedded { log, topics: AtomicUsize::new(0) });
    let report = conformance::check(&broker, &db.pool).await.unwrap();
    let failed: Vec<&str> = report.checks.iter().filter(|(_, f)| f.is_some()).map(|(name, _)| *name).collect();
    assert!(failed.contains(&"redelivery of what was not acknowledged"), "{report:#?}");
    assert!(!report.passed());
}

#[cfg(feature = "kafka")]
mod kafka {
    use super::*;
    use idem::kafka::{KafkaConfig, KafkaProducer, KafkaSource, create_topic};

    struct Kafka {
        brokers: String,
        topics: AtomicUsize,
    }

    impl Broker for Kafka {
        type Source = KafkaSource;
        type Publisher = KafkaProducer;

        fn name(&self) -> String {
            "kafka".into()
        }

        async fn create_topic(&self) -> Result<String, Error> {
            let name = fresh("conformance", &self.topics);
            create_topic(&self.brokers, &name, 3, 7 * 86_400_000).await?;
            Ok(name)
        }

        async fn publisher(&self) -> Result<KafkaProducer, Error> {
            Ok(KafkaProducer::new(&self.brokers)?)
        }

        async fn consumer(&self, topic: &str, group: &str) -> Result<KafkaSource, Error> {
            let config = idem::Config::new(group, idem::KeyExtractor::JsonPointer("/id".into()));
            // A consumer that stops is noticed after 6 s, not librdkafka's default 45 s.
            let kafka = KafkaConfig::new(self.brokers.clone(), &[topic]).set("session.timeout.ms", "6000");
            KafkaSource::connect(&kafka, &config).await
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kafka_passes_the_suite() {
        let brokers = std::env::var("IDEM_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned());
        let db = common::sqlite().await;
        let report = conformance::check(&Kafka { brokers, topics: AtomicUsize::new(0) }, &db.pool).await.unwrap();
        report.assert_passed();
    }
}

#[cfg(feature = "nats")]
mod nats {
    use super::*;
    use idem::nats::{NatsConfig, NatsProducer, NatsSource, create_stream};
    use idem::{Message, Publisher};

    /// One stream per topic over `<topic>.*`, spread over three partitions by subject; AckWait 12 s, so what a
    /// stopped consumer held comes again soon.
    struct Nats {
        url: String,
        topics: AtomicUsize,
    }

    /// NATS addresses by subject, which the source keeps as the message's key: the suite's key `k3` of topic `t`
    /// is published to `t.k3` (a replayed message already carries its subject).
    struct OnStream(NatsProducer);

    impl Publisher for OnStream {
        async fn publish(&self, message: &Message) -> Result<(), SourceError> {
            let mut message = message.clone();
            let key = String::from_utf8_lossy(message.key.as_deref().unwrap_or_default()).into_owned();
            if !key.starts_with(&format!("{}.", message.topic)) {
                message.key = Some(format!("{}.{key}", message.topic).into_bytes());
            }
            self.0.publish(&message).await
        }
    }

    impl Broker for Nats {
        type Source = NatsSource;
        type Publisher = OnStream;

        fn name(&self) -> String {
            "nats jetstream".into()
        }

        async fn create_topic(&self) -> Result<String, Error> {
            let name = fresh("conformance", &self.topics);
            create_stream(&self.url, &name, &[&format!("{name}.*")], Duration::from_secs(7 * 86_400)).await?;
            Ok(name)
        }

        async fn publisher(&self) -> Result<OnStream, Error> {
            Ok(OnStream(NatsProducer::connect(&self.url).await?))
        }

        async fn consumer(&self, topic: &str, group: &str) -> Result<NatsSource, Error> {
            let config = idem::Config::new(group, idem::KeyExtractor::JsonPointer("/id".into()));
            let nats = NatsConfig {
                ack_wait: Duration::from_secs(12),
                partitions: 3,
                ..NatsConfig::new(self.url.clone(), topic)
            };
            NatsSource::connect(&nats, &config).await
        }

        /// With more than one message in flight, a redelivered message comes after later ones.
        fn orders_redeliveries(&self) -> bool {
            false
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nats_jetstream_passes_the_suite() {
        let url = std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
        let db = common::sqlite().await;
        let report = conformance::check(&Nats { url, topics: AtomicUsize::new(0) }, &db.pool).await.unwrap();
        report.assert_passed();
    }
}

#[cfg(feature = "rabbitmq")]
mod rabbitmq {
    use super::*;
    use idem::rabbitmq::{RabbitConfig, RabbitProducer, RabbitSource, create_queue};

    /// One classic queue per topic.
    struct Rabbit {
        url: String,
        topics: AtomicUsize,
    }

    impl Broker for Rabbit {
        type Source = RabbitSource;
        type Publisher = RabbitProducer;

        fn name(&self) -> String {
            "rabbitmq".into()
        }

        async fn create_topic(&self) -> Result<String, Error> {
            let name = fresh("conformance", &self.topics);
            create_queue(&self.url, &name, false).await?;
            Ok(name)
        }

        async fn publisher(&self) -> Result<RabbitProducer, Error> {
            RabbitProducer::connect(&self.url).await
        }

        async fn consumer(&self, topic: &str, group: &str) -> Result<RabbitSource, Error> {
            let config = idem::Config::new(group, idem::KeyExtractor::JsonPointer("/id".into()));
            RabbitSource::connect(&RabbitConfig::new(self.url.clone(), &[topic]), &config).await
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rabbitmq_passes_the_suite() {
        let url =
            std::env::var("IDEM_RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
        let db = common::sqlite().await;
        let report = conformance::check(&Rabbit { url, topics: AtomicUsize::new(0) }, &db.pool).await.unwrap();
        report.assert_passed();
    }
}

mod pubsub {
    use super::*;
    use idem::pubsub::{PubSubConfig, PubSubProducer, PubSubSource, SubscriptionOptions};

    /// The emulator of scripts/pubsub.sh, or the one `IDEM_PUBSUB_EMULATOR_HOST` names.
    pub fn emulator() -> String {
        std::env::var("IDEM_PUBSUB_EMULATOR_HOST").unwrap_or_else(|_| "127.0.0.1:8681".to_owned())
    }

    pub const PROJECT: &str = "idem-test";

    /// One topic with one ordered subscription per check. Pub/Sub delivers to a subscription only what was
    /// published after it existed, so the subscription is made with the topic, before the suite publishes;
    /// each check uses its own topic, so the subscription stands for the check's consumer group.
    struct PubSub {
        emulator: String,
        topics: AtomicUsize,
    }

    impl Broker for PubSub {
        type Source = PubSubSource;
        type Publisher = PubSubProducer;

        fn name(&self) -> String {
            "pubsub (emulator)".into()
        }

        async fn create_topic(&self) -> Result<String, Error> {
            let name = fresh("conformance", &self.topics);
            idem::pubsub::create_topic(Some(&self.emulator), PROJECT, &name).await?;
            let options = SubscriptionOptions { ordering: true, ..Default::default() };
            idem::pubsub::create_subscription(Some(&self.emulator), PROJECT, &name, &format!("{name}-sub"), &options)
                .await?;
            Ok(name)
        }

        async fn publisher(&self) -> Result<PubSubProducer, Error> {
            PubSubProducer::connect(Some(PROJECT), Some(&self.emulator)).await
        }

        async fn consumer(&self, topic: &str, group: &str) -> Result<PubSubSource, Error> {
            let config = idem::Config::new(group, idem::KeyExtractor::JsonPointer("/id".into()));
            let source = PubSubConfig {
                project: Some(PROJECT.into()),
                emulator_host: Some(self.emulator.clone()),
                partitions: 3,
                require_ordering: true,
                ..PubSubConfig::new(format!("{topic}-sub"))
            };
            PubSubSource::connect(&source, &config).await
        }

        /// The emulator keeps what a stopped consumer held out of reach for minutes (see the test below), so the
        /// checks after a stop wait only this long, to show what came back was applied once.
        fn patience(&self) -> Duration {
            Duration::from_secs(30)
        }
    }

    /// On Google's emulator, the suite's first check (every event applied once, in order per ordering key,
    /// despite producer duplicates and two poison messages) must pass. The checks after a stop cannot: the
    /// emulator fails on a client's cancellation of a streaming pull (a `NoSuchMethodError` in
    /// `onRstStreamRead`, logged for every stream a stopped consumer closes), so the messages that stream held
    /// stay assigned to it, for minutes (220 s measured for one unordered message) or, on an ordered
    /// subscription, for good, and a key whose messages went to that stream is held back too. What those checks
    /// then must show: whatever did come again was applied once, nothing else was applied, nothing twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pubsub_on_the_emulator_applies_once_in_order_and_never_twice_after_a_stop() {
        let db = common::sqlite().await;
        let broker = PubSub { emulator: emulator(), topics: AtomicUsize::new(0) };
        let report = conformance::check(&broker, &db.pool).await.unwrap();
        assert_eq!(report.checks.len(), 4);
        let (name, failure) = &report.checks[0];
        assert!(failure.is_none(), "{name}: {failure:?}");
        for (name, failure) in &report.checks[1..] {
            if let Some(failure) = failure {
                assert!(
                    failure.contains("not done after"),
                    "{name}: not a message held back by the emulator: {failure}"
                );
            }
        }
        let twice: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT run, id, COUNT(*) FROM idem_conformance_ledger GROUP BY run, id HAVING COUNT(*) > 1",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert!(twice.is_empty(), "applied twice: {twice:?}");
    }
}
