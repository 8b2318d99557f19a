//! RabbitMQ, against a real server (`IDEM_RABBITMQ_URL`, default amqp://guest:guest@127.0.0.1:5672/%2f): clear
//! errors at start-up for wrong credentials, an unreachable server and a missing queue; the producer's confirms.
#![cfg(feature = "rabbitmq")]

mod common;

use common::config;
use idem::Source;
use idem::rabbitmq::{RabbitConfig, RabbitProducer, RabbitSource, create_queue, delete_queue};
use idem::source::{Acknowledgement, Received};

fn url() -> String {
    std::env::var("IDEM_RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{prefix}-{}-{nanos}", std::process::id())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_an_unreachable_server_and_a_missing_queue_are_named() {
    let engine = config(10);
    let queue = unique("q");
    let wrong = RabbitConfig::new("amqp://guest:nope@127.0.0.1:5672/%2f", &[queue.as_str()]);
    let err = RabbitSource::connect(&wrong, &engine).await.err().expect("wrong password").to_string();
    assert!(err.contains("rabbitmq amqp://guest:***@127.0.0.1:5672") && !err.contains("nope"), "{err}");
    let away = RabbitConfig::new("amqp://guest:guest@127.0.0.1:1/%2f", &[queue.as_str()]);
    let err = RabbitSource::connect(&away, &engine).await.err().expect("nothing on port 1").to_string();
    assert!(err.contains("127.0.0.1:1"), "{err}");
    let missing = RabbitConfig::new(url(), &[queue.as_str()]);
    let err = RabbitSource::connect(&missing, &engine).await.err().expect("no such queue").to_string();
    assert!(err.contains(&queue) && err.contains("declare the queue"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_comes_with_its_handle_and_is_gone_once_acknowledged() {
    let queue = unique("acked");
    create_queue(&url(), &queue, false).await.unwrap();
    let producer = RabbitProducer::connect(&url()).await.unwrap();
    let event_id = producer.send(&queue, b"{}", &[]).await.unwrap();
    let source = RabbitSource::connect(
        &RabbitConfig { stop_at_end: true, ..RabbitConfig::new(url(), &[queue.as_str()]) },
        &config(10),
    )
    .await
    .unwrap();
    let Some(Received::Message(message)) = source.recv().await.unwrap() else { panic!("a message") };
    assert_eq!(message.topic, queue);
    assert_eq!(message.header(idem::message::EVENT_ID_HEADER), Some(event_id.as_bytes()));
    source.ack(&Acknowledgement::of(std::slice::from_ref(&message)).unwrap()).await.unwrap();
    assert!(source.recv().await.unwrap().is_none(), "acknowledged: the queue is empty");
    drop(source);
    delete_queue(&url(), &queue).await.unwrap();
}
