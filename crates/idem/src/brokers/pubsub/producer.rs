//! A Pub/Sub producer: every message carries the event id as the `idem-event-id` attribute, its key as the
//! ordering key and its headers (with the W3C trace context) as attributes.

use std::collections::HashMap;

use google_cloud_pubsub::client::{BasePublisher, Publisher as TopicPublisher};

use super::{MESSAGE_ID_HEADER, endpoint_name, project, resource_path, target};
use crate::error::Error;
use crate::message::{EVENT_ID_HEADER, Message};
use crate::source::{Publisher, SourceError};

/// Publishes to Pub/Sub topics, waiting for the service to store each message.
pub struct PubSubProducer {
    base: BasePublisher,
    project: String,
    /// One publisher per topic (Google's client batches and orders per topic).
    topics: std::sync::Mutex<HashMap<String, TopicPublisher>>,
}

/// What the service said about one published message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The message id Pub/Sub gave it.
    pub message_id: String,
    /// The event id it carries (`idem-event-id`).
    pub event_id: String,
}

impl PubSubProducer {
    /// A producer for the topics of `project` (`None`: `GOOGLE_CLOUD_PROJECT`), on the emulator at
    /// `emulator_host` (`None`: `PUBSUB_EMULATOR_HOST`, else the real service).
    pub async fn connect(project_name: Option<&str>, emulator_host: Option<&str>) -> Result<Self, Error> {
        let project = project(project_name)?;
        let emulator = super::emulator(emulator_host);
        let mut builder = BasePublisher::builder();
        if let Some((endpoint, credentials)) = target(emulator.as_deref()) {
            builder = builder.with_endpoint(endpoint).with_credentials(credentials);
        }
        let base = builder
            .build()
            .await
            .map_err(|e| Error::Connect { target: endpoint_name(emulator.as_deref()), reason: e.to_string() })?;
        Ok(PubSubProducer { base, project, topics: std::sync::Mutex::default() })
    }

    fn topic(&self, topic: &str) -> Result<TopicPublisher, SourceError> {
        let path = resource_path(Some(&self.project), "topics", topic)
            .map_err(|e| SourceError::permanent("pubsub publish", e))?;
        let mut topics = self.topics.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(topics
            .entry(path.clone())
            .or_insert_with(|| {
                self.base.publisher(path).set_delay_threshold(std::time::Duration::from_millis(1)).build()
            })
            .clone())
    }

    /// Publishes `payload` to `topic` with `key` as its ordering key, and waits until the service stored it. The
    /// event id is the `idem-event-id` of `headers` when there is one (a retry or a replay keeps its id), else a
    /// new UUIDv7. Header values must be text (Pub/Sub attributes are).
    pub async fn send(
        &self,
        topic: &str,
        key: Option<&str>,
        payload: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<Published, SourceError> {
        let (attributes, event_id) = attributes(&crate::propagation::with_current(headers))?;
        let publisher = self.topic(topic)?;
        let mut message =
            google_cloud_pubsub::model::Message::new().set_data(payload.to_vec()).set_attributes(attributes);
        if let Some(key) = key.filter(|k| !k.is_empty()) {
            message = message.set_ordering_key(key);
        }
        match publisher.publish(message).await {
            Ok(message_id) => Ok(Published { message_id, event_id }),
            Err(error) => {
                // A failed publish pauses its ordering key in the client; the caller's retry must go through.
                if let Some(key) = key {
                    publisher.resume_publish(key);
                }
                Err(SourceError::transient("pubsub publish", error))
            }
        }
    }
}

/// The attributes of one message: the caller's headers (without an earlier delivery's message id), plus the
/// event id (`idem-event-id`, kept when given).
fn attributes(headers: &[(String, Vec<u8>)]) -> Result<(HashMap<String, String>, String), SourceError> {
    let mut attributes = HashMap::new();
    for (name, value) in headers.iter().filter(|(name, _)| name != MESSAGE_ID_HEADER) {
        let value = std::str::from_utf8(value).map_err(|_| {
            SourceError::permanent(
                "pubsub publish",
                format!("header {name} is not UTF-8 text, which Pub/Sub attributes need"),
            )
        })?;
        attributes.insert(name.clone(), value.to_owned());
    }
    let event_id =
        attributes.entry(EVENT_ID_HEADER.to_owned()).or_insert_with(|| uuid::Uuid::now_v7().to_string()).clone();
    Ok((attributes, event_id))
}

impl Publisher for PubSubProducer {
    /// Publishes to the message's topic with its key as the ordering key. The event id (`idem-event-id`) stays,
    /// so the markers still recognise a replayed event.
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let key = match message.key.as_deref() {
            None => None,
            Some(key) => Some(std::str::from_utf8(key).map_err(|_| {
                SourceError::permanent(
                    "pubsub publish",
                    "the message's key is not UTF-8 text, which ordering keys need",
                )
            })?),
        };
        self.send(&message.topic, key, &message.payload, &message.headers).await.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_event_id_is_kept_or_made_and_an_old_message_id_dropped() {
        let given = vec![
            (EVENT_ID_HEADER.to_owned(), b"e-1".to_vec()),
            (MESSAGE_ID_HEADER.to_owned(), b"17".to_vec()),
            ("tenant".to_owned(), b"a".to_vec()),
        ];
        let (map, id) = attributes(&given).unwrap();
        assert_eq!(id, "e-1");
        assert_eq!(map.get("tenant").map(String::as_str), Some("a"));
        assert!(!map.contains_key(MESSAGE_ID_HEADER));
        let (map, id) = attributes(&[]).unwrap();
        assert_eq!(map.get(EVENT_ID_HEADER), Some(&id));
        let err = attributes(&[("bin".to_owned(), vec![0xff])]).unwrap_err().to_string();
        assert!(err.contains("bin") && err.contains("UTF-8"), "{err}");
    }
}
