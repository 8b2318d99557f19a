//! The operations endpoint of a consumer or relay process (feature `http`), on axum: `/metrics` (Prometheus
//! text), `/healthz` (the process is alive), `/readyz` (200 when ready; 503 with a JSON reason when not: the database
//! does not answer, the engine is not consuming, is draining, or its kill switch tripped) and `POST /resume` (closes a
//! tripped kill switch at once). `HEAD` answers every `GET` route, connections are kept alive.
//!
//! A consumer binary gets it with one call:
//!
//! ```no_run
//! # async fn example(engine: idem::Engine<sqlx::Postgres>) -> Result<(), idem::Error> {
//! let metrics = idem::http::install_recorder()?;
//! let bound = idem::http::serve("127.0.0.1:9464".parse().unwrap(), metrics, engine.clone()).await?;
//! # Ok(()) }
//! ```
//!
//! or mounts [`router`] into an axum application of its own.

use std::future::Future;
use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::engine::Engine;
use crate::error::Error;
use crate::store::Backend;

/// What `/readyz` says: ready or not, and why not.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Readiness {
    /// Ready to take work.
    pub ready: bool,
    /// Why not (`database unreachable`, `not consuming`, `draining`, `paused: …`); empty when ready.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// Partitions with a worker, for a consumer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partitions: Option<u64>,
    /// Partitions that hold work and have not committed for the consumer's `stall_after`: a detail, not a
    /// reason to be unready (the other partitions go on).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stalled: Vec<crate::Stalled>,
}

impl Readiness {
    fn not(reason: &str) -> Self {
        Readiness { ready: false, reason: reason.to_owned(), partitions: None, stalled: Vec::new() }
    }

    fn ready(partitions: Option<u64>) -> Self {
        Readiness { ready: true, reason: String::new(), partitions, stalled: Vec::new() }
    }
}

/// What the endpoint asks of the process it serves: a consumer's [`Engine`], or a relay's [`DatabaseProbe`].
pub trait Probe: Clone + Send + Sync + 'static {
    /// `/readyz`.
    fn readiness(&self) -> impl Future<Output = Readiness> + Send;
    /// `POST /resume` by `actor` (the `X-Idem-Actor` header or `?as=NAME`): `Some(was paused)` where there is a
    /// kill switch to close (and the audit trail records it), `None` where there is none.
    fn resume(&self, actor: &str) -> Option<bool>;
}

impl<DB: Backend> Probe for Engine<DB> {
    async fn readiness(&self) -> Readiness {
        let health = self.health();
        // Each reason names the consumer group: a process may run several.
        let not = |why: &str| Readiness::not(&format!("consumer group {}: {why}", self.config().group));
        if !self.database_reachable().await {
            return not("database unreachable");
        }
        if !health.running {
            return not("not consuming");
        }
        if health.draining {
            return not("draining");
        }
        if health.paused {
            return not("paused: the kill switch tripped (see the consumer's log); POST /resume to try again now");
        }
        Readiness { stalled: health.stalled, ..Readiness::ready(Some(health.partitions)) }
    }

    fn resume(&self, actor: &str) -> Option<bool> {
        Some(self.resume_as(actor))
    }
}

/// Several consumers of one process (`idem run` with several `[[consumer]]`): ready when every one is, the
/// reasons of those that are not joined; `POST /resume` resumes them all.
impl<P: Probe> Probe for Vec<P> {
    async fn readiness(&self) -> Readiness {
        let mut partitions = 0;
        let mut reasons = Vec::new();
        let mut stalled = Vec::new();
        for probe in self {
            let r = probe.readiness().await;
            partitions += r.partitions.unwrap_or(0);
            stalled.extend(r.stalled);
            if !r.ready {
                reasons.push(r.reason);
            }
        }
        match reasons.is_empty() {
            true => Readiness { stalled, ..Readiness::ready(Some(partitions)) },
            false => Readiness { ready: false, reason: reasons.join("; "), partitions: None, stalled },
        }
    }

    fn resume(&self, actor: &str) -> Option<bool> {
        self.iter().filter_map(|probe| probe.resume(actor)).reduce(|a, b| a || b)
    }
}

/// A probe that is ready while its database answers (the outbox relay's).
pub struct DatabaseProbe<DB: sqlx::Database>(pub sqlx::Pool<DB>);

impl<DB: sqlx::Database> Clone for DatabaseProbe<DB> {
    fn clone(&self) -> Self {
        DatabaseProbe(self.0.clone())
    }
}

impl<DB: sqlx::Database> Probe for DatabaseProbe<DB> {
    async fn readiness(&self) -> Readiness {
        let reachable = match self.0.acquire().await {
            Ok(mut conn) => sqlx::Connection::ping(&mut *conn).await.is_ok(),
            Err(_) => false,
        };
        if reachable { Readiness::ready(None) } else { Readiness::not("database unreachable") }
    }

    fn resume(&self, _actor: &str) -> Option<bool> {
        None
    }
}

/// Installs the Prometheus recorder for the `metrics` facade idem writes to, with buckets for the handling time,
/// and returns the handle `/metrics` renders.
pub fn install_recorder() -> Result<PrometheusHandle, Error> {
    let buckets = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0];
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full("idem_event_handle_duration_seconds".into()),
            &buckets,
        )
        .and_then(|builder| builder.install_recorder())
        .map_err(|e| Error::Config(format!("metrics recorder: {e}")))
}

/// The endpoint's routes, to serve ([`serve`]) or to mount in an axum application of one's own.
pub fn router<P: Probe>(metrics: PrometheusHandle, probe: P) -> Router {
    Router::new()
        .route("/metrics", get(move || async move { prometheus_text(metrics.render()) }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz::<P>))
        .route("/resume", post(resume::<P>))
        .fallback(|| async { (StatusCode::NOT_FOUND, "try /metrics, /healthz, /readyz or POST /resume\n") })
        .with_state(probe)
}

/// Binds `addr` and serves [`router`] in the background for as long as the process runs; returns the bound
/// address (port 0 picks one).
pub async fn serve<P: Probe>(addr: SocketAddr, metrics: PrometheusHandle, probe: P) -> Result<SocketAddr, Error> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Config(format!("metrics address {addr}: {e}: choose a free address or port 0")))?;
    let bound = listener.local_addr().map_err(|e| Error::Config(format!("metrics address {addr}: {e}")))?;
    tracing::info!(%bound, "serving /metrics, /healthz and /readyz");
    let app = router(metrics, probe);
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "the operations endpoint stopped");
        }
    });
    Ok(bound)
}

fn prometheus_text(body: String) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], body).into_response()
}

async fn readyz<P: Probe>(State(probe): State<P>) -> Response {
    let readiness = probe.readiness().await;
    let status = if readiness.ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = serde_json::to_string(&readiness).unwrap_or_default() + "\n";
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Who asked for a resume: the `X-Idem-Actor` header, else `?as=NAME` (percent-decoded), else `http`; at most
/// 255 characters.
fn actor(headers: &axum::http::HeaderMap, uri: &axum::http::Uri) -> String {
    let given = |name: &String| !name.trim().is_empty();
    let from_header = headers.get("x-idem-actor").and_then(|v| v.to_str().ok()).map(str::to_owned).filter(given);
    let from_query =
        || uri.query()?.split('&').find_map(|pair| pair.strip_prefix("as=")).map(percent_decoded).filter(given);
    let actor = from_header.or_else(from_query).unwrap_or_else(|| "http".to_owned());
    actor.chars().take(255).collect()
}

/// A query value with `+` as a space and `%XX` escapes decoded (invalid UTF-8 replaced).
fn percent_decoded(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = || u8::from_str_radix(std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?, 16).ok();
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if hex().is_some() => {
                out.extend(hex());
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn resume<P: Probe>(State(probe): State<P>, headers: axum::http::HeaderMap, uri: axum::http::Uri) -> Response {
    match probe.resume(&actor(&headers, &uri)) {
        Some(true) => (StatusCode::OK, "resumed\n").into_response(),
        Some(false) => (StatusCode::OK, "not paused\n").into_response(),
        None => (StatusCode::NOT_FOUND, "nothing to resume here\n").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn actor_of(header: Option<&str>, uri: &str) -> String {
        let mut headers = axum::http::HeaderMap::new();
        if let Some(value) = header {
            headers.insert("x-idem-actor", value.parse().expect("header"));
        }
        actor(&headers, &uri.parse().expect("uri"))
    }

    #[test]
    fn the_actor_comes_from_the_header_then_the_query() {
        assert_eq!(actor_of(Some("alice"), "/resume?as=bob"), "alice");
        assert_eq!(actor_of(Some("  "), "/resume?as=bob"), "bob", "a blank header does not hide the query");
        assert_eq!(actor_of(None, "/resume?x=1&as=J%C3%BCrgen+M%2E"), "Jürgen M.");
        assert_eq!(actor_of(None, "/resume?as=100%"), "100%", "a stray % stays");
        assert_eq!(actor_of(None, "/resume"), "http");
        assert_eq!(actor_of(None, &format!("/resume?as={}", "a".repeat(300))).len(), 255);
    }
}
