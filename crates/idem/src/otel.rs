//! OpenTelemetry traces (feature `otel`): a span per handled message and per batch, linked across the broker by
//! the W3C trace context headers, exported over OTLP as the standard `OTEL_*` environment variables say.
//!
//! idem writes its spans with `tracing`; [`layer`] turns them into OpenTelemetry spans. A consumer program adds
//! it to its subscriber:
//!
//! ```no_run
//! use tracing_subscriber::layer::SubscriberExt;
//! # fn main() -> Result<(), idem::Error> {
//! let otel = idem::otel::OtlpTracing::from_env()?; // OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, …
//! let subscriber = tracing_subscriber::registry().with(otel.layer());
//! tracing::subscriber::set_global_default(subscriber).expect("one subscriber");
//! // … run the engine; at exit:
//! otel.shutdown();
//! # Ok(()) }
//! ```
//!
//! Each message's span (`process <topic>`, kind consumer) carries `messaging.system`,
//! `messaging.destination.name`, `messaging.destination.partition.id`, `messaging.message.id` (the idempotency
//! key), `messaging.consumer.group.name`, `messaging.kafka.offset` and `idem.outcome` (`processed`, `duplicate`,
//! `dead_lettered`, `stale`, …); the handler runs inside it, so its own spans are children. A batch's transaction
//! has a span of its own (`idem.batch`, with `messaging.batch.message_count`).

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::error::Error;

struct Headers<'a>(&'a [(String, Vec<u8>)]);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.iter().find(|(name, _)| name.eq_ignore_ascii_case(key)).and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| name.as_str()).collect()
    }
}

struct HeadersMut<'a>(&'a mut Vec<(String, Vec<u8>)>);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.retain(|(name, _)| !name.eq_ignore_ascii_case(key));
        // An empty `tracestate` (the usual case) says nothing, and SQS refuses a message attribute without a value.
        if !value.is_empty() {
            self.0.push((key.to_owned(), value.into_bytes()));
        }
    }
}

pub(crate) fn set_parent_from(span: &tracing::Span, headers: &[(String, Vec<u8>)]) {
    if span.is_disabled() {
        return;
    }
    let context = TraceContextPropagator::new().extract(&Headers(headers));
    if context.span().span_context().is_valid() {
        let _ = span.set_parent(context);
    }
}

/// The current span's context, when it belongs to a valid trace.
pub(crate) fn current() -> Option<opentelemetry::Context> {
    let context = tracing::Span::current().context();
    context.span().span_context().is_valid().then_some(context)
}

/// The trace context `headers` carry (`traceparent`, `tracestate`), for a program's own spans.
pub fn extract(headers: &[(String, Vec<u8>)]) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&Headers(headers))
}

/// Writes `context` into `headers` as `traceparent` and `tracestate`, for a program's own producers.
pub fn inject(context: &opentelemetry::Context, headers: &mut Vec<(String, Vec<u8>)>) {
    TraceContextPropagator::new().inject_context(context, &mut HeadersMut(headers));
}

/// An OTLP exporter (HTTP, protobuf) and its tracer provider, configured by the standard environment variables:
/// `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), `OTEL_EXPORTER_OTLP_HEADERS`,
/// `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, and the batch processor's
/// `OTEL_BSP_*`.
pub struct OtlpTracing {
    provider: SdkTracerProvider,
}

impl OtlpTracing {
    /// Builds the exporter and the provider from the environment.
    pub fn from_env() -> Result<Self, Error> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()
            .map_err(|e| Error::Config(format!("OpenTelemetry OTLP exporter: {e} (check OTEL_EXPORTER_OTLP_*)")))?;
        let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).build();
        Ok(OtlpTracing { provider })
    }

    /// The `tracing` layer that turns idem's spans (and the program's) into OpenTelemetry spans.
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S> + Send + Sync + 'static
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span> + Send + Sync,
    {
        tracing_opentelemetry::layer().with_tracer(self.provider.tracer("idem"))
    }

    /// Exports what is buffered and stops the exporter; call it before the process exits.
    pub fn shutdown(self) {
        let _ = self.provider.shutdown();
    }
}

/// Whether the environment asks for OTLP traces: `OTEL_EXPORTER_OTLP_ENDPOINT` or
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set, and `OTEL_TRACES_EXPORTER` is not `none` (`OTEL_SDK_DISABLED=true`
/// turns it off too).
pub fn requested_by_env() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
        || std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v.eq_ignore_ascii_case("none"));
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}
