//! Outbox messages delivered as HTTP requests (feature `http-delivery`): the destination is the URL, the payload
//! the body, the event id the `Idempotency-Key` header, so the receiver can drop a request the relay repeats.
//!
//! A message's headers go with the request, but for `idem-http-method` (the method, default `POST`). A 2xx answer
//! is delivered; 408, 425, 429, 5xx, a timeout or a failed connection is transient (retried); any other answer is
//! permanent (after the relay's `max_attempts`, a dead letter with the status and the start of the body).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, Uri};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::{self, pki_types::ServerName};

use super::OutboxMessage;
use super::delivery::{Delivered, Delivery, DeliveryError, per_key};

/// The header of an outbox message that names its HTTP method.
pub const METHOD_HEADER: &str = "idem-http-method";

/// Whether `destination` is delivered over HTTP (`http://…` or `https://…`).
pub fn is_http(destination: &str) -> bool {
    destination.starts_with("http://") || destination.starts_with("https://")
}

/// Delivers each message as one HTTP/1.1 request to the URL its destination names; keys in parallel, each key in
/// order.
#[derive(Debug, Clone)]
pub struct HttpDelivery {
    /// How long one request may take, connecting included (default 30 s): longer is a transient failure.
    pub timeout: Duration,
}

impl Default for HttpDelivery {
    fn default() -> Self {
        HttpDelivery { timeout: Duration::from_secs(30) }
    }
}

impl Delivery for HttpDelivery {
    async fn deliver(&self, messages: &[OutboxMessage]) -> Vec<Delivered> {
        per_key(messages, |m| async move {
            match tokio::time::timeout(self.timeout, call(m)).await {
                Ok(result) => result,
                Err(_) => {
                    Err(DeliveryError::transient(format!("{} did not answer within {:?}", m.destination, self.timeout)))
                }
            }
        })
        .await
    }
}

/// HTTP destinations through [`HttpDelivery`], every other through `D` (a broker): one relay for both.
pub struct HttpOr<D>(pub HttpDelivery, pub D);

impl<D: Delivery> Delivery for HttpOr<D> {
    async fn deliver(&self, messages: &[OutboxMessage]) -> Vec<Delivered> {
        let (http, other): (Vec<usize>, Vec<usize>) =
            (0..messages.len()).partition(|&i| is_http(&messages[i].destination));
        // All to one side (the usual case): handed on as they are, without copies.
        if messages.is_empty() {
            return Vec::new();
        }
        if http.is_empty() {
            return self.1.deliver(messages).await;
        }
        if other.is_empty() {
            return self.0.deliver(messages).await;
        }
        let pick = |indexes: &[usize]| indexes.iter().map(|&i| messages[i].clone()).collect::<Vec<_>>();
        let (to_http, to_other) = (pick(&http), pick(&other));
        let (http_results, other_results) = tokio::join!(self.0.deliver(&to_http), self.1.deliver(&to_other));
        let mut results = vec![Delivered::Held; messages.len()];
        for (i, r) in http.into_iter().zip(http_results).chain(other.into_iter().zip(other_results)) {
            results[i] = r;
        }
        results
    }
}

trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// The TLS settings: the system's trusted roots, loaded once.
fn tls() -> Result<Arc<rustls::ClientConfig>, DeliveryError> {
    static CONFIG: OnceLock<Result<Arc<rustls::ClientConfig>, String>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let mut roots = rustls::RootCertStore::empty();
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                return Err("no trusted root certificates found on this system (install ca-certificates)".into());
            }
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map(|b| Arc::new(b.with_root_certificates(roots).with_no_client_auth()))
                .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(DeliveryError::permanent)
}

/// One request for `m`.
async fn call(m: &OutboxMessage) -> Result<(), DeliveryError> {
    let url = &m.destination;
    let uri: Uri =
        url.parse().map_err(|e| DeliveryError::permanent(format!("destination `{url}` is not a URL: {e}")))?;
    let https = uri.scheme_str() == Some("https");
    let host = uri.host().ok_or_else(|| DeliveryError::permanent(format!("destination `{url}` has no host")))?;
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let method = match m.headers.iter().find(|(name, _)| name.eq_ignore_ascii_case(METHOD_HEADER)) {
        Some((_, value)) => Method::from_bytes(value).map_err(|_| {
            DeliveryError::permanent(format!("{METHOD_HEADER} `{}` is no method", String::from_utf8_lossy(value)))
        })?,
        None => Method::POST,
    };
    let tcp = TcpStream::connect((host, port))
        .await
        .map_err(|e| DeliveryError::transient(format!("cannot connect to {host}:{port}: {e}")))?;
    let _ = tcp.set_nodelay(true);
    let stream: Box<dyn Stream> = if https {
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| DeliveryError::permanent(format!("`{host}` is no TLS server name: {e}")))?;
        let tls = TlsConnector::from(tls()?)
            .connect(name, tcp)
            .await
            .map_err(|e| DeliveryError::transient(format!("TLS with {host}:{port}: {e}")))?;
        Box::new(tls)
    } else {
        Box::new(tcp)
    };
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| DeliveryError::transient(format!("HTTP with {host}:{port}: {e}")))?;
    tokio::spawn(connection);
    let authority = uri.authority().map(|a| a.as_str().to_owned()).unwrap_or_else(|| host.to_owned());
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut request = Request::builder().method(method).uri(path).header(hyper::header::HOST, authority);
    request = request.header("idempotency-key", &m.event_id);
    let mut typed = false;
    for (name, value) in m.headers.iter().filter(|(name, _)| !name.eq_ignore_ascii_case(METHOD_HEADER)) {
        typed |= name.eq_ignore_ascii_case("content-type");
        request = request.header(name.as_str(), value.as_slice());
    }
    if !typed {
        request = request.header(hyper::header::CONTENT_TYPE, "application/json");
    }
    let request = request
        .body(Full::new(Bytes::from(m.payload.clone())))
        .map_err(|e| DeliveryError::permanent(format!("the request to {url} cannot be built: {e}")))?;
    let response = sender.send_request(request).await.map_err(|e| DeliveryError::transient(format!("{url}: {e}")))?;
    let status = response.status();
    if status.is_success() {
        return Ok(());
    }
    let body = response.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let start = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
    let reason = format!("{url} answered {status}: {start}");
    match status.as_u16() {
        408 | 425 | 429 | 500..=599 => Err(DeliveryError::transient(reason)),
        _ => Err(DeliveryError::permanent(reason)),
    }
}
