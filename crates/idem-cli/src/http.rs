//! The operations endpoint of a consumer or relay process: `/metrics` (Prometheus text), `/healthz` (the process
//! is alive), `/readyz` (the database answers and, for a consumer, the engine is consuming, not draining, and its
//! kill switch is closed) and `POST /resume` (closes a consumer's tripped kill switch at once). A deliberately small HTTP/1.1 responder: one
//! request per connection.

use std::net::SocketAddr;

use idem::{Backend, Engine};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Installs the Prometheus recorder for the `metrics` facade the library writes to.
pub fn install_recorder() -> anyhow::Result<PrometheusHandle> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full("event_handle_duration_seconds".into()),
            &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0],
        )?
        .install_recorder()?;
    Ok(handle)
}

/// What the endpoint asks of the process it serves: a consumer's engine, or a relay.
pub trait Probe: Clone + Send + Sync + 'static {
    /// `/readyz`: the status line and the body.
    fn readiness(&self) -> impl std::future::Future<Output = (&'static str, String)> + Send;
    /// `POST /resume`: `Some(was paused)` where there is a kill switch to close, `None` where there is none.
    fn resume(&self) -> Option<bool>;
}

impl<DB: Backend> Probe for Engine<DB> {
    async fn readiness(&self) -> (&'static str, String) {
        readiness(self).await
    }

    fn resume(&self) -> Option<bool> {
        let paused = self.health().paused;
        Engine::resume(self);
        Some(paused)
    }
}

/// A relay's probe: ready while its database answers.
pub struct DatabaseProbe<DB: sqlx::Database>(pub sqlx::Pool<DB>);

impl<DB: sqlx::Database> Clone for DatabaseProbe<DB> {
    fn clone(&self) -> Self {
        DatabaseProbe(self.0.clone())
    }
}

impl<DB: sqlx::Database> Probe for DatabaseProbe<DB> {
    async fn readiness(&self) -> (&'static str, String) {
        let reachable = match self.0.acquire().await {
            Ok(mut conn) => sqlx::Connection::ping(&mut *conn).await.is_ok(),
            Err(_) => false,
        };
        if reachable {
            ("200 OK", "ready\n".into())
        } else {
            ("503 Service Unavailable", "database unreachable\n".into())
        }
    }

    fn resume(&self) -> Option<bool> {
        None
    }
}

/// Binds `addr` and serves the endpoints in the background for as long as the process runs.
pub async fn serve<P: Probe>(addr: SocketAddr, metrics: PrometheusHandle, engine: P) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("--metrics-addr {addr}: {e}"))?;
    let bound = listener.local_addr()?;
    tracing::info!(%bound, "serving /metrics, /healthz and /readyz");
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else { continue };
            let (metrics, engine) = (metrics.clone(), engine.clone());
            tokio::spawn(async move {
                let Some(request) = read_request_head(&mut stream).await else { return };
                let line = String::from_utf8_lossy(&request);
                let mut words = line.split_whitespace();
                let method = words.next().unwrap_or("GET");
                let path = words.next().unwrap_or("/");
                let (status, body) = match (method, path) {
                    ("POST", "/resume") => match engine.resume() {
                        Some(true) => ("200 OK", "resumed\n".to_owned()),
                        Some(false) => ("200 OK", "not paused\n".to_owned()),
                        None => ("404 Not Found", "nothing to resume here\n".to_owned()),
                    },
                    (_, "/resume") => ("405 Method Not Allowed", "use POST /resume\n".to_owned()),
                    (_, path) => match path {
                        "/metrics" => ("200 OK", metrics.render()),
                        "/healthz" => ("200 OK", "ok\n".to_owned()),
                        "/readyz" => engine.readiness().await,
                        _ => ("404 Not Found", "try /metrics, /healthz, /readyz or POST /resume\n".to_owned()),
                    },
                };
                let response = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            });
        }
    });
    Ok(bound)
}

/// Reads until the end of the request head (a request may arrive in several segments); gives up on a head
/// over 8 KiB, a closed connection or 5 s of silence.
async fn read_request_head(stream: &mut tokio::net::TcpStream) -> Option<Vec<u8>> {
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), stream.read(&mut buf)).await.ok()?.ok()?;
        if n == 0 || head.len() + n > 8192 {
            return None;
        }
        head.extend_from_slice(&buf[..n]);
    }
    Some(head)
}

async fn readiness<DB: Backend>(engine: &Engine<DB>) -> (&'static str, String) {
    let health = engine.health();
    if !engine.database_reachable().await {
        return ("503 Service Unavailable", "database unreachable\n".into());
    }
    if !health.running {
        return ("503 Service Unavailable", "not consuming\n".into());
    }
    if health.draining {
        return ("503 Service Unavailable", "draining\n".into());
    }
    if health.paused {
        return (
            "503 Service Unavailable",
            "paused: the kill switch tripped (see the consumer's log); POST /resume to try again now\n".into(),
        );
    }
    ("200 OK", format!("ready: {} partition(s) active\n", health.partitions))
}
