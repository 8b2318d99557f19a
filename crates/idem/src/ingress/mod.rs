//! HTTP as a source (feature `ingress`): webhooks and `Idempotency-Key` requests applied exactly once, in the
//! effect's transaction.
//!
//! Each request is a message (its body the payload, its headers the headers, its path the topic) handled by
//! the engine as any other: the marker is claimed in the transaction, the [`Respond`] code writes its effects
//! through the same connection and returns a [`Reply`], and the reply is **stored in that transaction**. The
//! response leaves only after the commit. A retry with the same key gets the stored reply again (with
//! `Idempotent-Replayed: true`), whatever happened in between: a crash after the commit, a client that gave up.
//!
//! What a client is answered (the statuses the IETF draft "The Idempotency-Key HTTP Header Field" gives):
//!
//! | Case | Status |
//! |---|---|
//! | new key, handled | the reply's status, stored |
//! | key seen before, same body | the stored reply, again |
//! | key seen before, different body | `422`, nothing applied |
//! | the same key still in progress here after [`Limits::wait_for_first`] | `409`, `Retry-After: 1` |
//! | no key | `400`, naming the header (or JSON pointer) |
//! | bad or missing signature | `401`, nothing stored |
//! | body over [`Limits::max_body_bytes`] | `413` |
//! | body not read within [`Limits::request_timeout`] | `408` |
//! | not committed within [`Limits::request_timeout`] | `503`, `Retry-After: 1`; the work goes on and a retry gets its answer |
//! | failed permanently (dead-lettered) | `422`, the same body for every retry |
//! | failed retryably more than `max_attempts` times | `503`, `Retry-After: 1`; nothing written, a retry tries again |
//! | the database did not take it | `503`, `Retry-After: 1` |
//!
//! The smallest endpoint:
//!
//! ```no_run
//! use idem::ingress::{Ingress, Options, Reply, Respond};
//! use idem::{Config, Event, HandlerError, KeyExtractor};
//! use sqlx::PgConnection;
//!
//! struct Orders;
//!
//! impl Respond<sqlx::Postgres> for Orders {
//!     async fn respond(&self, request: &Event, tx: &mut PgConnection) -> Result<Reply, HandlerError> {
//!         #[derive(serde::Deserialize)]
//!         struct Order { id: String, amount: i64 }
//!         let order: Order = request.json()?;
//!         sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, $2)")
//!             .bind(&order.id)
//!             .bind(order.amount)
//!             .execute(&mut *tx)
//!             .await?;
//!         Ok(Reply::json(201, &serde_json::json!({ "order": order.id })))
//!     }
//! }
//!
//! # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let config = Config::new("orders-api", KeyExtractor::Header("Idempotency-Key".into()));
//! let ingress = Ingress::new(pool, config, Orders, Options::default())?;
//! let app = ingress.router("/orders")?; // or .route("/orders", ingress.method_router()) in your own app
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```

pub mod signature;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, post};

pub use self::signature::{Encoding, Secret, Signature, SignatureError};
use crate::config::{Config, Dedup};
use crate::engine::{Engine, Outcome, StatsSnapshot};
use crate::error::{Error, HandlerError};
use crate::handler::Handler;
use crate::key::KeyExtractor;
use crate::message::{Event, Message};
use crate::store::responses::StoredResponse;
use crate::store::{Backend, offset_from_digest, payload_digest};

/// The header a replayed response carries (Stripe's name for it).
pub const REPLAYED: &str = "idempotent-replayed";

/// Request headers never stored with a message (they would sit in the dead letters): credentials.
const NOT_STORED: [&str; 3] = ["authorization", "proxy-authorization", "cookie"];

/// What an endpoint answers: a status, headers and a body. Stored with the marker, sent again to every retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The HTTP status (100 to 599).
    pub status: u16,
    /// Headers to send, and to send again on a replay.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Reply {
    /// A reply with `status` and no body.
    pub fn status(status: u16) -> Self {
        Reply { status, headers: Vec::new(), body: Vec::new() }
    }

    /// A JSON reply.
    pub fn json(status: u16, body: &impl serde::Serialize) -> Self {
        let body = serde_json::to_vec(body).unwrap_or_default();
        Reply { status, headers: vec![("content-type".into(), "application/json".into())], body }
    }

    /// The reply with one more header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// The code behind an endpoint: applies one request's effects through `tx`, idem's transaction (whose marker is
/// already claimed), and says what to answer. `Err` as for [`Handler`]: retryable errors are retried, permanent
/// ones roll back and dead-letter the request (answered `422`).
pub trait Respond<DB: Backend>: Send + Sync + 'static {
    /// Applies `request` and returns the reply to store and send.
    fn respond(
        &self,
        request: &Event,
        tx: &mut DB::Connection,
    ) -> impl Future<Output = Result<Reply, HandlerError>> + Send;
}

/// Any [`Handler`] as an endpoint: it answers `200` with `{"id": key, "outcome": "processed"}` (or `stale`,
/// `rejected`, as a guard decided).
#[derive(Debug, Clone)]
pub struct Acknowledge<H>(pub H);

impl<DB: Backend, H: Handler<DB>> Respond<DB> for Acknowledge<H> {
    async fn respond(&self, request: &Event, tx: &mut DB::Connection) -> Result<Reply, HandlerError> {
        self.0.handle(request, tx).await?;
        let outcome = Outcome::of_handled(request.handled()).as_str();
        Ok(Reply::json(200, &serde_json::json!({ "id": request.id, "outcome": outcome })))
    }
}

/// Bounds on one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The largest body taken; a larger one is answered `413`. Default 1 MiB.
    pub max_body_bytes: usize,
    /// How long the body may take to arrive (`408` after) and, once read, how long the client is kept waiting for
    /// the commit (`503` after, while the work goes on). Default 30 s.
    pub request_timeout: Duration,
    /// How long a request waits for another one with the same key, in progress in this process, before it is
    /// answered `409`. Default 10 s.
    pub wait_for_first: Duration,
    /// How long a connection may take to send a request's headers (a slow client's, or an idle kept-alive one's)
    /// before [`Ingress::serve`] closes it. Default 10 s.
    pub header_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 1024 * 1024,
            request_timeout: Duration::from_secs(30),
            wait_for_first: Duration::from_secs(10),
            header_timeout: Duration::from_secs(10),
        }
    }
}

/// An ingress's options: the signature it requires and its limits.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The webhook signature every request must carry; `None` takes unsigned requests.
    pub signature: Option<Signature>,
    /// Bounds on a request.
    pub limits: Limits,
}

/// An HTTP endpoint whose requests are applied exactly once. Cheap to clone.
pub struct Ingress<DB: Backend, R> {
    inner: Arc<Inner<DB, R>>,
}

impl<DB: Backend, R> Clone for Ingress<DB, R> {
    fn clone(&self) -> Self {
        Ingress { inner: self.inner.clone() }
    }
}

struct Inner<DB: Backend, R> {
    engine: Engine<DB>,
    responder: Arc<R>,
    key: KeyExtractor,
    options: Options,
    /// The keys in progress in this process, each with the lock its next request waits on.
    in_progress: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The requests' work still running, whether or not its client still waits.
    working: Arc<Working>,
}

/// Counts the requests' work tasks (a client that goes away does not cut its transaction short), so that
/// [`Ingress::serve`] returns only once each has committed or rolled back.
#[derive(Default)]
struct Working {
    tasks: AtomicUsize,
    idle: tokio::sync::Notify,
}

/// One work task's share of [`Working`], given back when the task ends (or panics).
struct WorkTask(Arc<Working>);

impl Working {
    fn start(self: &Arc<Self>) -> WorkTask {
        self.tasks.fetch_add(1, Ordering::SeqCst);
        WorkTask(self.clone())
    }

    /// Returns once no work task runs.
    async fn idle(&self) {
        loop {
            // Made before the count is read, so a task ending in between still wakes it.
            let ended = self.idle.notified();
            if self.tasks.load(Ordering::SeqCst) == 0 {
                return;
            }
            ended.await;
        }
    }
}

impl Drop for WorkTask {
    fn drop(&mut self) {
        if self.0.tasks.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl<DB: Backend, R: Respond<DB>> Ingress<DB, R> {
    /// An ingress on `pool` with `config` (its group, tables, retries and key: `header:NAME` or `json:/pointer`;
    /// header names are case-insensitive). Refused: a key from the broker's id (a request has none), natural-key
    /// dedup (a replay needs the marker's payload digest) and delayed retries (a client waits for its answer).
    pub fn new(pool: sqlx::Pool<DB>, mut config: Config, responder: R, options: Options) -> Result<Self, Error> {
        if let KeyExtractor::Header(name) = &config.key {
            config.key = KeyExtractor::Header(name.to_ascii_lowercase());
        }
        Self::on_engine(Engine::new(pool, config)?, responder, options)
    }

    /// An ingress on an engine already built (with [`Engine::on_commit`] or faults, as `idem run` builds its
    /// consumers'); its configuration is checked as by [`Ingress::new`], and a header key must be written in lower
    /// case (HTTP/1.1's header names reach it so).
    pub fn on_engine(engine: Engine<DB>, responder: R, options: Options) -> Result<Self, Error> {
        let config = engine.config();
        match &config.key {
            KeyExtractor::Header(name) if name.chars().any(|c| c.is_ascii_uppercase()) => {
                return Err(Error::Config(format!(
                    "the ingress reads header names in lower case: key it with header:{}",
                    name.to_ascii_lowercase()
                )));
            }
            KeyExtractor::Header(_) | KeyExtractor::JsonPointer(_) => {}
            KeyExtractor::BrokerId => {
                return Err(Error::Config(
                    "an HTTP request has no broker id: key the ingress with `header:Idempotency-Key` (or another \
                     header) or `json:/pointer` into the body"
                        .into(),
                ));
            }
        }
        if config.dedup != Dedup::Markers {
            return Err(Error::Config(
                "the HTTP ingress needs markers (dedup = markers): a replayed response is found through its marker"
                    .into(),
            ));
        }
        if config.delayed_retries.is_some() {
            return Err(Error::Config(
                "the HTTP ingress does not park requests for delayed retries (its client waits for the answer): \
                 remove delayed_retries; a request that keeps failing is answered 503 and retried by its client"
                    .into(),
            ));
        }
        let limits = options.limits;
        if limits.max_body_bytes == 0
            || limits.request_timeout.is_zero()
            || limits.header_timeout.is_zero()
            || limits.wait_for_first.is_zero()
        {
            return Err(Error::Config(
                "the ingress's max_body_bytes, request_timeout, header_timeout and wait_for_first must be above 0"
                    .into(),
            ));
        }
        let key = config.key.clone();
        Ok(Ingress {
            inner: Arc::new(Inner {
                engine: engine.giving_back(),
                responder: Arc::new(responder),
                key,
                options,
                in_progress: Mutex::new(HashMap::new()),
                working: Arc::default(),
            }),
        })
    }

    /// Serves the ingress at `path` on `listener` until `shutdown` completes; then answers the requests in
    /// progress, waits for the work of those whose clients went away (each commits or rolls back) and returns
    /// the engine's figures. Beside it runs the consumer's housekeeping (marker gauges and,
    /// when a retention is set, pruning of the markers and their stored replies), and [`Engine::health`] says
    /// running. A connection that has not sent a request's headers within [`Limits::header_timeout`] is closed.
    pub async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        path: &str,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<StatsSnapshot, Error> {
        let router = self.router(path)?;
        let limits = self.inner.options.limits;
        let engine = &self.inner.engine;
        let working = &self.inner.working;
        engine
            .serving("http", async move {
                let graceful = hyper_util::server::graceful::GracefulShutdown::new();
                let mut shutdown = std::pin::pin!(shutdown);
                loop {
                    let stream = tokio::select! {
                        () = &mut shutdown => break,
                        accepted = listener.accept() => match accepted {
                            Ok((stream, _)) => stream,
                            Err(error) => {
                                // Out of file descriptors, or a connection reset before it was taken: not fatal.
                                tracing::warn!(%error, "accepting a connection failed");
                                tokio::time::sleep(Duration::from_millis(50)).await;
                                continue;
                            }
                        },
                    };
                    let service = hyper_util::service::TowerToHyperService::new(router.clone());
                    let connection = hyper::server::conn::http1::Builder::new()
                        .timer(hyper_util::rt::TokioTimer::new())
                        .header_read_timeout(limits.header_timeout)
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                    let connection = graceful.watch(connection);
                    tokio::spawn(async move {
                        let _ = connection.await;
                    });
                }
                // Each request in progress is answered within its request timeout; the work of one whose client
                // went away ends with its transaction.
                let drain = limits.request_timeout + limits.wait_for_first + Duration::from_secs(1);
                let drained = async {
                    graceful.shutdown().await;
                    working.idle().await;
                };
                if tokio::time::timeout(drain, drained).await.is_err() {
                    tracing::warn!("requests still in progress after the drain; closing their connections");
                }
            })
            .await;
        Ok(engine.stats())
    }

    /// The housekeeping [`Ingress::serve`] runs beside its server, for an ingress mounted in an application of
    /// your own (`tokio::spawn(ingress.housekeeping())`): marker gauges and, when a retention is set, pruning of the
    /// markers and their stored replies. It never ends; drop or abort it with your server.
    pub fn housekeeping(&self) -> impl Future<Output = ()> + Send + 'static {
        let engine = self.inner.engine.clone();
        async move { engine.serving("http", std::future::pending::<()>()).await }
    }

    /// The engine behind the ingress: its stats, health and the operations endpoint ([`crate::http`]).
    pub fn engine(&self) -> &Engine<DB> {
        &self.inner.engine
    }

    /// A router answering `POST path`. `path` is a plain absolute path: `/webhooks/stripe`.
    pub fn router(&self, path: &str) -> Result<Router, Error> {
        check_path(path)?;
        Ok(Router::new().route(path, self.method_router()))
    }

    /// `POST` on this ingress, to mount on a route of an application of your own.
    pub fn method_router(&self) -> MethodRouter {
        post(answer::<DB, R>).with_state(self.clone())
    }

    /// Answers one request: the whole path above, for a handler of your own that already holds the request.
    pub async fn answer(&self, request: Request) -> Response {
        let (parts, body) = request.into_parts();
        let limits = self.inner.options.limits;
        if let Some(length) =
            parts.headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
            && length > limits.max_body_bytes
        {
            return too_large(limits.max_body_bytes);
        }
        let body = match tokio::time::timeout(limits.request_timeout, read_body(body, limits.max_body_bytes)).await {
            Err(_) => {
                return problem(StatusCode::REQUEST_TIMEOUT, "the body did not arrive within the request timeout");
            }
            Ok(Err(BodyError::TooLarge)) => return too_large(limits.max_body_bytes),
            Ok(Err(BodyError::Broken(e))) => {
                return problem(StatusCode::BAD_REQUEST, &format!("the body could not be read: {e}"));
            }
            Ok(Ok(body)) => body,
        };
        if let Some(signature) = &self.inner.options.signature
            && let Err(e) = signature.verify(&parts.headers, &body, SystemTime::now())
        {
            metrics::counter!("idem_http_ingress_refused_total", "consumer_group" => self.group(), "reason" => "signature")
                .increment(1);
            tracing::warn!(path = parts.uri.path(), reason = %e, "a request's signature was refused; nothing stored");
            return problem(StatusCode::UNAUTHORIZED, &format!("signature refused: {e}"));
        }
        let message = message_of(parts.uri.path(), &parts.headers, body);
        let key = match self.inner.key.extract(&message) {
            Ok(key) => key,
            Err(missing) => {
                metrics::counter!("idem_http_ingress_refused_total", "consumer_group" => self.group(), "reason" => "key")
                    .increment(1);
                return problem(StatusCode::BAD_REQUEST, &format!("{missing}: {}", self.key_fix()));
            }
        };
        let message = positioned(message, &key);
        self.answer_keyed(key, message).await
    }

    /// Waits its turn behind a request with the same key, then has the work done in a task of its own (a client
    /// that goes away does not cut a transaction short) and answers from what it left.
    async fn answer_keyed(&self, key: String, message: Message) -> Response {
        let limits = self.inner.options.limits;
        let lock = self.key_lock(&key);
        let Ok(guard) = tokio::time::timeout(limits.wait_for_first, lock.clone().lock_owned()).await else {
            self.forget(&key, &lock);
            let mut response =
                problem(StatusCode::CONFLICT, "a request with this idempotency key is in progress: retry later");
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return response;
        };
        let (done, answer) = tokio::sync::oneshot::channel();
        let ingress = self.clone();
        let task = self.inner.working.start();
        tokio::spawn(async move {
            let _task = task;
            let reply = ingress.handle(&key, message).await;
            drop(guard);
            ingress.forget(&key, &lock);
            let _ = done.send(reply);
        });
        match tokio::time::timeout(limits.request_timeout, answer).await {
            Ok(Ok(response)) => response,
            _ => {
                let mut response = problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "not committed within the request timeout; the work goes on: retry with the same key",
                );
                response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                response
            }
        }
    }

    /// The engine's transaction for one keyed request, and the response its outcome calls for.
    async fn handle(&self, key: &str, message: Message) -> Response {
        let slot = Arc::new(Mutex::new(None));
        let storing = Storing {
            responder: self.inner.responder.clone(),
            tables: self.inner.engine.config().tables.clone(),
            group: self.group(),
            slot: slot.clone(),
        };
        let outcome = self.inner.engine.process(vec![message], &storing).await;
        let fresh = slot.lock().ok().and_then(|mut s| s.take());
        let response = match outcome.as_deref() {
            Ok([Outcome::Processed | Outcome::Stale | Outcome::Rejected]) => match fresh {
                Some(reply) => to_response(reply, false),
                None => problem(StatusCode::INTERNAL_SERVER_ERROR, "the request committed without a reply"),
            },
            Ok([Outcome::Duplicate]) => self.replay(key).await,
            Ok([Outcome::IdReused]) => problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "this idempotency key was used before with a different request body; nothing was applied",
            ),
            Ok([Outcome::DeadLettered]) => dead_lettered(),
            Ok(other) => {
                tracing::error!(key, outcomes = ?other, "the ingress got an outcome it does not answer");
                problem(StatusCode::INTERNAL_SERVER_ERROR, "the request ended in an unexpected state")
            }
            Err(Error::GaveUp(reason)) => {
                tracing::warn!(
                    key,
                    reason,
                    "a request kept failing retryably; nothing written, its client is told to retry"
                );
                let mut response = problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the request failed for now and nothing of it was applied: retry with the same key",
                );
                response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                response
            }
            Err(error) => {
                tracing::warn!(key, %error, "a request was not committed; its client is told to retry");
                let mut response = problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the database did not take the request: retry with the same key",
                );
                response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                response
            }
        };
        metrics::counter!("idem_http_ingress_responses_total", "consumer_group" => self.group(),
            "status" => response.status().as_u16().to_string())
        .increment(1);
        response
    }

    /// The answer to a key already handled: its stored reply, or the dead letter's answer.
    async fn replay(&self, key: &str) -> Response {
        let config = self.inner.engine.config();
        match DB::stored_response(self.inner.engine.pool(), &config.tables, &config.group, key).await {
            Ok(Some(stored)) => {
                to_response(Reply { status: stored.status, headers: stored.headers, body: stored.body }, true)
            }
            // Handled without a stored reply: it was dead-lettered (or its reply pruned before its marker).
            Ok(None) => dead_lettered(),
            Err(error) => {
                tracing::warn!(key, %error, "a stored response could not be read; its client is told to retry");
                let mut response =
                    problem(StatusCode::SERVICE_UNAVAILABLE, "the stored response could not be read: retry");
                response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                response
            }
        }
    }

    fn group(&self) -> String {
        self.inner.engine.config().group.clone()
    }

    fn key_fix(&self) -> String {
        match &self.inner.key {
            KeyExtractor::Header(name) => format!("send the key in the {name} header"),
            KeyExtractor::JsonPointer(pointer) => format!("send a JSON body with a string or integer at {pointer}"),
            KeyExtractor::BrokerId => String::new(),
        }
    }

    fn key_lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = self.inner.in_progress.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        map.entry(key.to_owned()).or_default().clone()
    }

    /// Drops the key's lock from the map once nobody else holds or waits on it.
    fn forget(&self, key: &str, lock: &Arc<tokio::sync::Mutex<()>>) {
        let mut map = self.inner.in_progress.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // The map's copy and the caller's: nobody else waits.
        if Arc::strong_count(lock) <= 2 && map.get(key).is_some_and(|l| Arc::ptr_eq(l, lock)) {
            map.remove(key);
        }
    }
}

async fn answer<DB: Backend, R: Respond<DB>>(State(ingress): State<Ingress<DB, R>>, request: Request) -> Response {
    ingress.answer(request).await
}

/// The per-request handler: the endpoint's code, then its reply stored in the same transaction.
struct Storing<R> {
    responder: Arc<R>,
    tables: crate::store::Tables,
    group: String,
    slot: Arc<Mutex<Option<Reply>>>,
}

impl<DB: Backend, R: Respond<DB>> Handler<DB> for Storing<R> {
    async fn handle(&self, event: &Event, tx: &mut DB::Connection) -> Result<(), HandlerError> {
        let reply = self.responder.respond(event, tx).await?;
        if !(100..=599).contains(&reply.status) {
            return Err(HandlerError::Permanent(format!("the endpoint replied with status {}", reply.status)));
        }
        let stored = StoredResponse { status: reply.status, headers: reply.headers.clone(), body: reply.body.clone() };
        DB::store_response(tx, &self.tables, &self.group, &event.id, &stored).await?;
        if let Ok(mut slot) = self.slot.lock() {
            *slot = Some(reply);
        }
        Ok(())
    }
}

/// A request's message at its position: a fixed partition and an offset from its key's digest, the same on
/// every retry (as RabbitMQ's and SQS's messages get theirs).
fn positioned(mut message: Message, key: &str) -> Message {
    message.offset = offset_from_digest(&payload_digest(key.as_bytes()));
    message
}

/// A request as a message: its path the topic, its headers (credentials left out) and its body, marked as an
/// HTTP request ([`crate::dead_letter::HTTP_REQUEST_HEADER`], which a request cannot set itself).
fn message_of(path: &str, headers: &HeaderMap, body: Vec<u8>) -> Message {
    let mut message = Message::new(path, 0, 0, body);
    message.timestamp_ms = Some(crate::store::responses::now_ms());
    for (name, value) in headers {
        if !NOT_STORED.contains(&name.as_str()) && name.as_str() != crate::dead_letter::HTTP_REQUEST_HEADER {
            message.headers.push((name.as_str().to_owned(), value.as_bytes().to_vec()));
        }
    }
    message.headers.push((crate::dead_letter::HTTP_REQUEST_HEADER.to_owned(), path.as_bytes().to_vec()));
    message
}

enum BodyError {
    TooLarge,
    Broken(String),
}

async fn read_body(body: Body, limit: usize) -> Result<Vec<u8>, BodyError> {
    match axum::body::to_bytes(body, limit).await {
        Ok(bytes) => Ok(bytes.to_vec()),
        Err(e) => {
            let text = e.to_string();
            if std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>()) {
                Err(BodyError::TooLarge)
            } else {
                Err(BodyError::Broken(text))
            }
        }
    }
}

/// Checks a path an ingress may be mounted at: absolute, plain segments, nothing that could climb or be decoded.
pub fn check_path(path: &str) -> Result<(), Error> {
    let plain = |segment: &str| {
        !segment.is_empty()
            && segment != "."
            && segment != ".."
            && segment.chars().all(|c| c.is_ascii_alphanumeric() || "-_.~".contains(c))
    };
    if path.starts_with('/') && path.len() > 1 && path[1..].split('/').all(plain) {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "the ingress path `{path}` is not a plain absolute path: write it like /webhooks/stripe (letters, digits, \
             - _ . ~ between slashes; no `..`, no empty segment, no percent sign)"
        )))
    }
}

fn to_response(reply: Reply, replayed: bool) -> Response {
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, reply.body).into_response();
    let headers = response.headers_mut();
    for (name, value) in &reply.headers {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(name.as_str()), HeaderValue::try_from(value.as_str())) {
            headers.append(name, value);
        }
    }
    if replayed {
        headers.insert(REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

/// The one answer to a request that failed permanently, the same for the first try and every retry.
fn dead_lettered() -> Response {
    problem(
        StatusCode::UNPROCESSABLE_ENTITY,
        "the request failed permanently and is held as a dead letter; an operator can replay it",
    )
}

fn too_large(limit: usize) -> Response {
    problem(StatusCode::PAYLOAD_TOO_LARGE, &format!("the body is larger than the limit of {limit} bytes"))
}

/// A JSON error body: `{"error": "…"}`.
fn problem(status: StatusCode, error: &str) -> Response {
    let body = serde_json::json!({ "error": error }).to_string();
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_absolute_paths_are_taken() {
        for good in ["/webhooks/stripe", "/orders", "/a-b_c.d~e/v1"] {
            assert!(check_path(good).is_ok(), "{good}");
        }
        for bad in ["", "/", "webhooks", "/a/../b", "/a//b", "/a/./b", "/a%2e%2e/b", "/a/b/", "/{id}", "/a b"] {
            let err = check_path(bad).unwrap_err().to_string();
            assert!(err.contains("plain absolute path"), "{bad}: {err}");
        }
    }

    #[test]
    fn credentials_are_not_kept_with_the_message() {
        let mut headers = HeaderMap::new();
        headers.insert("authorization", "Bearer x".parse().unwrap());
        headers.insert("cookie", "s=1".parse().unwrap());
        headers.insert("idempotency-key", "k1".parse().unwrap());
        headers.insert(crate::dead_letter::HTTP_REQUEST_HEADER, "/forged".parse().unwrap());
        let message = message_of("/orders", &headers, b"{}".to_vec());
        assert_eq!(message.header(crate::dead_letter::HTTP_REQUEST_HEADER), Some(&b"/orders"[..]), "not the request's");
        assert_eq!(message.header("idempotency-key"), Some(&b"k1"[..]));
        assert!(message.header("authorization").is_none() && message.header("cookie").is_none());
        let a = positioned(message.clone(), "k1");
        assert_eq!(a.offset, positioned(message, "k1").offset, "a retry has the same position");
    }
}
