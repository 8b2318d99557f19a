//! What the commands do with Amazon SQS (feature `sqs`): the `--sqs ENDPOINT` flag's meaning, the producer for
//! replays and relays, and the demo's queue. Without the feature, each says so.
//!
//! `--sqs` takes an SQS-compatible endpoint (`http://127.0.0.1:9324`) or `aws`, which leaves the endpoint to the
//! standard AWS configuration (the region's SQS). Region and credentials always come from that configuration.

/// The endpoint override a `--sqs` value names: `None` for `aws`.
pub fn endpoint(flag: &str) -> Option<&str> {
    (flag != "aws").then_some(flag)
}

#[cfg(feature = "sqs")]
mod enabled {
    use std::time::Duration;

    use idem::outbox::Publish;
    use idem::sqs::{Outgoing, SqsProducer};

    use super::endpoint;

    /// A producer for `idem dead-letters replay --sqs` and `idem relay --sqs`.
    pub async fn producer(flag: &str) -> anyhow::Result<Publish<SqsProducer>> {
        Ok(Publish(SqsProducer::connect(endpoint(flag), None).await?))
    }

    /// Creates the demo's FIFO queue (visibility timeout `visibility`, SQS's default retention of 4 days) and
    /// sends the records to it, each account a message group in the order of its records.
    pub async fn write_demo_queue(
        flag: &str,
        queue: &str,
        visibility: Duration,
        records: &[(i64, String)],
    ) -> anyhow::Result<()> {
        let client = idem::sqs::client(endpoint(flag), None).await?;
        idem::sqs::create_queue(&client, queue, visibility, Duration::from_secs(4 * 86_400)).await?;
        let producer = SqsProducer::with_client(client);
        let messages: Vec<Outgoing> = records
            .iter()
            .map(|(account, payload)| Outgoing {
                key: Some(account.to_string().into_bytes()),
                payload: payload.clone().into_bytes(),
                headers: Vec::new(),
            })
            .collect();
        // Requests in flight at once, each a batch of ten; every account's messages stay in one sender's order.
        let senders = 8;
        let producer = std::sync::Arc::new(producer);
        let mut lanes: Vec<Vec<Outgoing>> = vec![Vec::new(); senders];
        for message in messages {
            let key = message.key.as_deref().unwrap_or_default();
            let lane = key.iter().fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(usize::from(*b)));
            lanes[lane % senders].push(message);
        }
        let mut sends = tokio::task::JoinSet::new();
        for lane in lanes {
            let (producer, queue) = (std::sync::Arc::clone(&producer), queue.to_owned());
            sends.spawn(async move { producer.send_in_order(&queue, &lane).await });
        }
        while let Some(sent) = sends.join_next().await {
            sent??;
        }
        Ok(())
    }

    /// Deletes the demo's queue.
    pub async fn remove_demo_queue(flag: &str, queue: &str) {
        let removed = match idem::sqs::client(endpoint(flag), None).await {
            Ok(client) => idem::sqs::delete_queue(&client, queue).await,
            Err(error) => Err(error),
        };
        if let Err(error) = removed {
            eprintln!("warning: the demo's queue {queue} was not removed: {error}");
        }
    }
}

#[cfg(not(feature = "sqs"))]
mod enabled {
    use std::time::Duration;

    use idem::outbox::Publish;

    /// Without the `sqs` feature: refused.
    pub async fn producer(_: &str) -> anyhow::Result<Publish<idem::embedded::LogProducer>> {
        Err(crate::features::missing("sqs", "--sqs"))
    }

    /// Without the `sqs` feature: refused.
    pub async fn write_demo_queue(_: &str, _: &str, _: Duration, _: &[(i64, String)]) -> anyhow::Result<()> {
        Err(crate::features::missing("sqs", "--sqs"))
    }

    /// Without the `sqs` feature: nothing to remove.
    pub async fn remove_demo_queue(_: &str, _: &str) {}
}

pub use enabled::{producer, remove_demo_queue, write_demo_queue};
