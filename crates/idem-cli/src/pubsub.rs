//! What the commands do with Google Cloud Pub/Sub (feature `pubsub`): the emulator's address and the demo's topic
//! and subscription. Without the feature, each says so.
//!
//! `--pubsub` takes the project; the emulator comes from `PUBSUB_EMULATOR_HOST` (without it, the real service with
//! the standard Google credentials), as Google's own tools do.

/// The emulator's `host:port` from `PUBSUB_EMULATOR_HOST`, or `None` for the real service.
pub fn emulator() -> Option<String> {
    std::env::var("PUBSUB_EMULATOR_HOST").ok().filter(|host| !host.trim().is_empty())
}

#[cfg(feature = "pubsub")]
mod enabled {
    use anyhow::Context;
    use idem::pubsub::{PubSubProducer, SubscriptionOptions};

    use super::emulator;

    /// Creates the demo's topic and its subscription (message ordering on, the ack deadline 10 s: what a killed
    /// consumer held is due again 10 s later on the service) and publishes the records.
    pub async fn write_demo_topic(
        project: &str,
        topic: &str,
        subscription: &str,
        records: &[(i64, String)],
    ) -> anyhow::Result<()> {
        let emulator = emulator();
        idem::pubsub::create_topic(emulator.as_deref(), project, topic).await?;
        let options =
            SubscriptionOptions { ordering: true, ack_deadline_seconds: 10, ..SubscriptionOptions::default() };
        idem::pubsub::create_subscription(emulator.as_deref(), project, topic, subscription, &options).await?;
        publish(project, topic, records).await
    }

    /// Publishes `records` (account, payload) to `topic`, each account an ordering key, in the order of its
    /// records.
    pub async fn publish(project: &str, topic: &str, records: &[(i64, String)]) -> anyhow::Result<()> {
        let emulator = emulator();
        let producer = std::sync::Arc::new(PubSubProducer::connect(Some(project), emulator.as_deref()).await?);
        // Senders at once, each waiting for every message it publishes: an account's messages stay in one
        // sender's order, so in the topic's.
        let senders = 32;
        let mut lanes: Vec<Vec<(String, String)>> = vec![Vec::new(); senders];
        for (account, payload) in records {
            lanes[account.unsigned_abs() as usize % senders].push((account.to_string(), payload.clone()));
        }
        let mut sends = tokio::task::JoinSet::new();
        for lane in lanes {
            let (producer, topic) = (std::sync::Arc::clone(&producer), topic.to_owned());
            sends.spawn(async move {
                for (key, payload) in lane {
                    producer.send(&topic, Some(&key), payload.as_bytes(), &[]).await?;
                }
                Ok::<_, idem::SourceError>(())
            });
        }
        while let Some(sent) = sends.join_next().await {
            sent?.context("publishing to Pub/Sub")?;
        }
        Ok(())
    }

    /// Deletes the demo's subscription and topic.
    pub async fn remove_demo(project: &str, topic: &str, subscription: &str) {
        let emulator = emulator();
        if let Err(error) = idem::pubsub::delete_subscription(emulator.as_deref(), project, subscription).await {
            eprintln!("warning: the demo's subscription {subscription} was not removed: {error}");
        }
        if let Err(error) = idem::pubsub::delete_topic(emulator.as_deref(), project, topic).await {
            eprintln!("warning: the demo's topic {topic} was not removed: {error}");
        }
    }
}

#[cfg(not(feature = "pubsub"))]
mod enabled {

    /// Without the feature: refused.
    pub async fn write_demo_topic(_: &str, _: &str, _: &str, _: &[(i64, String)]) -> anyhow::Result<()> {
        Err(crate::features::missing("pubsub", "--pubsub"))
    }

    /// Without the feature: refused.
    pub async fn publish(_: &str, _: &str, _: &[(i64, String)]) -> anyhow::Result<()> {
        Err(crate::features::missing("pubsub", "--pubsub"))
    }

    /// Without the feature: nothing to remove.
    pub async fn remove_demo(_: &str, _: &str, _: &str) {}
}

pub use enabled::*;
