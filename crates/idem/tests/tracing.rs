//! OpenTelemetry traces across a real produce and consume, through the SDK's in-memory exporter: a message
//! produced inside a span is handled in a span whose parent is that span; the outbox message the handler enqueues
//! carries the handler's context through the relay, so the next consumer's span is its child: one trace from the
//! producer to the second consumer. On the embedded log, and on Kafka.

mod common;

use std::sync::OnceLock;

use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::outbox::{Outbox, OutgoingMessage, Relay, RelayConfig};
use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor, Tables};
use opentelemetry::trace::{SpanId, TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use sqlx::SqliteConnection;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

/// The process-wide subscriber of this test binary: every span to the in-memory exporter.
fn exporter() -> InMemorySpanExporter {
    static EXPORTER: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    EXPORTER
        .get_or_init(|| {
            let exporter = InMemorySpanExporter::default();
            let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
            let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("idem-test"));
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer)).expect("subscriber");
            (exporter, provider)
        })
        .0
        .clone()
}

/// The trace and span ids of `span`.
fn ids(span: &tracing::Span) -> (TraceId, SpanId) {
    let context = span.context();
    let span_context = context.span().span_context().clone();
    (span_context.trace_id(), span_context.span_id())
}

/// The finished spans named `name` whose `messaging.message.id` is `id`.
fn spans(exporter: &InMemorySpanExporter, name: &str, id: &str) -> Vec<SpanData> {
    exporter
        .get_finished_spans()
        .expect("spans")
        .into_iter()
        .filter(|s| s.name == name)
        .filter(|s| s.attributes.iter().any(|kv| kv.key.as_str() == "messaging.message.id" && kv.value.as_str() == id))
        .collect()
}

fn attribute(span: &SpanData, key: &str) -> String {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str().into_owned())
        .unwrap_or_default()
}

/// Enqueues one `Shipped` message per order, in the transaction.
struct Ship;

impl Handler<sqlx::Sqlite> for Ship {
    async fn handle(&self, event: &Event, tx: &mut SqliteConnection) -> Result<(), HandlerError> {
        let message =
            OutgoingMessage::new("shipped", event.payload().to_vec()).with_event_id(format!("{}-shipped", event.id));
        Outbox::new(Tables::default()).enqueue(&mut *tx, message).await?;
        Ok(())
    }
}

/// Does nothing.
struct Apply;

impl Handler<sqlx::Sqlite> for Apply {
    async fn handle(&self, _: &Event, _: &mut SqliteConnection) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn one_trace_from_the_producer_through_the_outbox_to_the_next_consumer_on_the_embedded_log() {
    let exporter = exporter();
    let dir = common::temp_dir();
    let db = common::sqlite().await;
    idem::migrate(&db.pool, &Tables::default()).await.expect("migrate");
    let log = EmbeddedLog::open(&dir.0).expect("log");
    log.create_topic("orders", 1).expect("topic");
    log.create_topic("shipped", 1).expect("topic");

    let checkout = tracing::info_span!("checkout");
    let (trace, checkout_id) = ids(&checkout);
    assert_ne!(trace, TraceId::INVALID, "the subscriber records spans");
    {
        let _inside = checkout.enter();
        log.producer().send("orders", Some(b"o-1"), br#"{"orderId":"o-1"}"#, &[]).expect("produce");
    }
    log.producer().flush().expect("flush");

    let key = KeyExtractor::JsonPointer("/orderId".into());
    let options = ConsumerOptions { stop_at_end: true, ..ConsumerOptions::default() };
    let first = log.consumer("shop", &["orders"], options.clone()).expect("consumer");
    Engine::new(db.pool.clone(), Config::new("shop", key))
        .expect("engine")
        .run(first, Ship, std::future::pending::<()>())
        .await
        .expect("run");
    let config = RelayConfig { stop_when_empty: true, ..RelayConfig::default() };
    Relay::new(db.pool.clone(), Tables::default(), config, log.producer())
        .expect("relay")
        .run(std::future::pending::<()>())
        .await
        .expect("relay run");
    let second = log.consumer("warehouse", &["shipped"], options).expect("consumer");
    let config = Config::new("warehouse", KeyExtractor::Header(idem::message::EVENT_ID_HEADER.into()));
    Engine::new(db.pool.clone(), config)
        .expect("engine")
        .run(second, Apply, std::future::pending::<()>())
        .await
        .expect("run");

    let processed = spans(&exporter, "process orders", "o-1");
    assert_eq!(processed.len(), 1, "one span for the one message");
    let order = &processed[0];
    assert_eq!(order.span_context.trace_id(), trace, "the consumer's span is in the producer's trace");
    assert_eq!(order.parent_span_id, checkout_id, "its parent is the span that produced the message");
    assert_eq!(attribute(order, "messaging.system"), "idem");
    assert_eq!(attribute(order, "messaging.destination.name"), "orders");
    assert_eq!(attribute(order, "messaging.consumer.group.name"), "shop");
    assert_eq!(attribute(order, "idem.outcome"), "processed");
    let shipped = spans(&exporter, "process shipped", "o-1-shipped");
    assert_eq!(
        shipped.len(),
        1,
        "{:?}",
        exporter.get_finished_spans().map(|s| s.iter().map(|s| s.name.clone()).collect::<Vec<_>>())
    );
    assert_eq!(shipped[0].span_context.trace_id(), trace, "the next consumer is in the same trace");
    assert_eq!(
        shipped[0].parent_span_id,
        order.span_context.span_id(),
        "its parent is the handler's span that enqueued it"
    );
    let batches =
        exporter.get_finished_spans().expect("spans").into_iter().filter(|s| s.name == "process orders batch").count();
    assert!(batches >= 1, "the batch has a span of its own");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_consumers_span_continues_the_producers_trace_on_kafka() {
    let exporter = exporter();
    let brokers = std::env::var("IDEM_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let topic = format!(
        "idem_trace_{}_{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() % 1_000_000_000)
    );
    idem::kafka::create_topic(&brokers, &topic, 1, 7 * 86_400_000).await.expect("topic");
    let db = common::sqlite().await;
    idem::migrate(&db.pool, &Tables::default()).await.expect("migrate");
    let checkout = tracing::info_span!("checkout");
    let (trace, checkout_id) = ids(&checkout);
    {
        let producer = idem::kafka::KafkaProducer::new(&brokers).expect("producer");
        let send = producer.send(&topic, Some(b"o-2"), br#"{"orderId":"o-2"}"#, &[]);
        tracing::Instrument::instrument(send, checkout.clone()).await.expect("produce");
    }
    // A consume that has not ended after a minute is given up and tried again in a new group: the loopback broker
    // sometimes keeps a group's first join waiting for minutes under load.
    let mut consumed = false;
    for attempt in 0..3 {
        let config = Config::new(format!("shop-{attempt}"), KeyExtractor::JsonPointer("/orderId".into()));
        let mut kafka = idem::kafka::KafkaConfig::new(brokers.as_str(), &[topic.as_str()]);
        kafka.stop_at_end = true;
        let source = idem::kafka::KafkaSource::connect(&kafka, &config).await.expect("source");
        let engine = Engine::new(db.pool.clone(), config).expect("engine");
        let run = engine.run(source, Apply, std::future::pending::<()>());
        if let Ok(result) = tokio::time::timeout(std::time::Duration::from_secs(60), run).await {
            result.expect("run");
            consumed = true;
            break;
        }
    }
    assert!(consumed, "three consumer groups in a row did not reach the end of the topic");
    let processed = spans(&exporter, &format!("process {topic}"), "o-2");
    assert!(!processed.is_empty(), "the message was handled in a span");
    for span in &processed {
        assert_eq!(span.span_context.trace_id(), trace);
        assert_eq!(span.parent_span_id, checkout_id);
        assert_eq!(attribute(span, "messaging.system"), "kafka");
    }
    let _ = idem::kafka::delete_topic(&brokers, &topic).await;
}

/// An HTTP request's `traceparent` is the parent of the span its transaction runs in (the ingress).
#[tokio::test]
async fn an_http_requests_traceparent_is_the_parent_of_its_span() {
    let exporter = exporter();
    let db = common::sqlite().await;
    idem::migrate(&db.pool, &Tables::default()).await.expect("migrate");
    let config = Config::new("traced-api", KeyExtractor::Header("Idempotency-Key".into()));
    let ingress = idem::ingress::Ingress::new(
        db.pool.clone(),
        config,
        idem::ingress::Acknowledge(Apply),
        idem::ingress::Options::default(),
    )
    .expect("ingress");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { ingress.serve(listener, "/traced", std::future::pending()).await });
    let (trace, parent) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let traceparent = format!("00-{trace}-{parent}-01");
    let headers = [("Idempotency-Key", "traced-1"), ("traceparent", traceparent.as_str())];
    let answer = common::http(addr, "POST", "/traced", &headers, "{}").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let span = spans(&exporter, "process /traced", "traced-1").pop().expect("the request's span");
    assert_eq!(attribute(&span, "messaging.system"), "http");
    assert_eq!(span.span_context.trace_id(), TraceId::from_hex(trace).expect("trace id"));
    assert_eq!(span.parent_span_id, SpanId::from_hex(parent).expect("span id"));
}
