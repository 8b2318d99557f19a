//! A small RabbitMQ producer: persistent messages published to a queue through the default exchange, each
//! confirmed by the broker (publisher confirms), with the event id as `message_id` and in `idem-event-id`.
//! Messages are `mandatory`: one that no queue takes comes back and is an error, never dropped silently. A lost
//! connection is opened again on the next publish.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Confirmation};

use super::{answer, connect};
use crate::error::Error;
use crate::message::{EVENT_ID_HEADER, Message};
use crate::source::{Publisher, SourceError};

/// Publishes to RabbitMQ queues with publisher confirms.
pub struct RabbitProducer {
    url: String,
    /// The connection and its confirming channel; `None` after a failure, until the next publish reconnects.
    session: tokio::sync::Mutex<Option<(lapin::Connection, lapin::Channel)>>,
}

impl RabbitProducer {
    /// Connects to `url` and turns publisher confirms on.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let session = open(url).await?;
        Ok(RabbitProducer { url: url.to_owned(), session: tokio::sync::Mutex::new(Some(session)) })
    }

    /// The confirming channel, connecting again when the last one was lost.
    async fn channel(&self) -> Result<lapin::Channel, SourceError> {
        let mut session = self.session.lock().await;
        if let Some((_, channel)) = session.as_ref()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        *session = None;
        let (connection, channel) = open(&self.url).await.map_err(|e| SourceError::transient("rabbitmq connect", e))?;
        *session = Some((connection, channel.clone()));
        Ok(channel)
    }

    /// Publishes `payload` to `queue` (persistent) and waits for the broker's confirm; returns the event id: the
    /// `idem-event-id` of `headers` when there is one (a retry or a replay keeps its id), else a new UUIDv7.
    pub async fn send(
        &self,
        queue: &str,
        payload: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<String, SourceError> {
        let confirm = self.publish_only(queue, payload, headers).await?;
        let (confirm, event_id) = confirm;
        wait(confirm, queue).await?;
        Ok(event_id)
    }

    /// Publishes `messages` (queue, payload) in order without waiting for each confirm before the next publish,
    /// then waits for all of them.
    pub async fn send_in_order(&self, messages: &[(String, Vec<u8>)]) -> Result<(), SourceError> {
        let mut pending = Vec::with_capacity(messages.len());
        for (queue, payload) in messages {
            pending.push((self.publish_only(queue, payload, &[]).await?.0, queue));
        }
        for (confirm, queue) in pending {
            wait(confirm, queue).await?;
        }
        Ok(())
    }

    async fn publish_only(
        &self,
        queue: &str,
        payload: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<(lapin::PublisherConfirm, String), SourceError> {
        let headers = &*crate::propagation::with_current(headers);
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert(name.as_str().into(), AMQPValue::LongString(value.clone().into()));
        }
        let event_id = match headers.iter().find(|(n, _)| n == EVENT_ID_HEADER) {
            Some((_, id)) => String::from_utf8_lossy(id).into_owned(),
            None => {
                let id = uuid::Uuid::now_v7().to_string();
                table.insert(EVENT_ID_HEADER.into(), AMQPValue::LongString(id.clone().into()));
                id
            }
        };
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(event_id.as_str().into())
            .with_headers(table);
        let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
        let channel = self.channel().await?;
        let confirm =
            answer("rabbitmq publish", channel.basic_publish("".into(), queue.into(), options, payload, properties))
                .await?;
        Ok((confirm, event_id))
    }
}

/// A connection with a channel in confirm mode.
async fn open(url: &str) -> Result<(lapin::Connection, lapin::Channel), Error> {
    let connection = connect(url).await?;
    let channel =
        answer("rabbitmq channel", connection.create_channel()).await.map_err(|e| Error::Config(e.to_string()))?;
    answer("rabbitmq confirm.select", channel.confirm_select(ConfirmSelectOptions::default()))
        .await
        .map_err(|e| Error::Config(e.to_string()))?;
    Ok((connection, channel))
}

async fn wait(confirm: lapin::PublisherConfirm, queue: &str) -> Result<(), SourceError> {
    match answer("rabbitmq publish confirm", confirm).await? {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_returned)) => Err(SourceError::permanent(
            "rabbitmq publish",
            format!("queue {queue} does not exist: nothing took the message"),
        )),
        Confirmation::Nack(_) => {
            Err(SourceError::transient("rabbitmq publish", format!("the broker refused the message for {queue}")))
        }
        Confirmation::NotRequested => Ok(()),
    }
}

impl Publisher for RabbitProducer {
    /// Publishes to the queue the message came from (its topic).
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        self.send(&message.topic, &message.payload, &message.headers).await.map(drop)
    }
}
