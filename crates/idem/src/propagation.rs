//! Trace context across the broker: the W3C `traceparent` and `tracestate` headers of an incoming message become
//! the parent of its span, and idem's producers and the outbox write the current span's context into the headers
//! they send. Real with the feature `otel` (through `tracing-opentelemetry`); without it, both are no-ops.

/// Makes `span` a child of the trace context carried by `headers`, if they carry a valid one.
pub(crate) fn set_parent_from(span: &tracing::Span, headers: &[(String, Vec<u8>)]) {
    #[cfg(feature = "otel")]
    crate::otel::set_parent_from(span, headers);
    #[cfg(not(feature = "otel"))]
    let _ = (span, headers);
}

/// `headers` with the current span's trace context written in (replacing one already there) when there is a valid
/// one; `headers` as they are otherwise (a relay with no span of its own keeps the context stored with a message).
pub(crate) fn with_current(headers: &[(String, Vec<u8>)]) -> std::borrow::Cow<'_, [(String, Vec<u8>)]> {
    #[cfg(feature = "otel")]
    if let Some(context) = crate::otel::current() {
        let mut owned = headers.to_vec();
        crate::otel::inject(&context, &mut owned);
        return std::borrow::Cow::Owned(owned);
    }
    std::borrow::Cow::Borrowed(headers)
}
