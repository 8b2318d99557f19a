//! The operator console (feature `console`): a web page and a JSON API over what failed, for the on-call
//! engineer. It reads failure groups, dead letters (one by one with headers, payload and history), parked messages
//! and the audit trail, and acts as the command line does: replay and discard, with the same selection, the same
//! safety check and the same audit entries (`idem::dead_letter::selection`), so the two never disagree.
//!
//! Off unless started (`idem console`, or [`serve`] in a consumer's own binary); binds where it is told
//! (127.0.0.1 by default on the command line). Every request is authenticated ([`auth`]): the API by
//! `Authorization: Bearer TOKEN`, the page by a session cookie opened with the token and a CSRF token in every
//! form. Viewers read; operators act. Payloads are hidden unless [`ConsoleConfig::show_payloads`] (they may hold
//! personal data). Every response carries a content security policy without inline script and refuses framing.
//!
//! ```no_run
//! # async fn example(pool: sqlx::PgPool, producer: idem::embedded::LogProducer) -> Result<(), idem::Error> {
//! use idem::console::{ConsoleConfig, Role, Users};
//! let users = Users::new().with_token("alice", Role::Operator, &std::env::var("CONSOLE_TOKEN").unwrap_or_default());
//! let config = ConsoleConfig::new(users);
//! let bound = idem::console::serve("127.0.0.1:9500".parse().unwrap(), pool, idem::Tables::default(), Some(producer), config).await?;
//! # Ok(()) }
//! ```

pub mod api;
pub mod auth;
pub mod consumers;
pub mod inbox;
pub mod markers;
pub mod openapi;
pub mod outbox;
pub mod page;
pub mod trial;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

pub use auth::{Role, User, Users};
pub use consumers::{ConsumerView, Consumers};
pub use trial::{HandlerTrial, Trial, TrialReport, Trials};

use crate::audit::AuditEntry;
use crate::error::Error;
use crate::outbox::OutboxStore;
use crate::source::Publisher;
use crate::store::Tables;

/// How the console behaves.
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// Who may sign in, and as what.
    pub users: Users,
    /// Show payloads (they may hold personal data). Default: hidden.
    pub show_payloads: bool,
    /// Reached through a reverse proxy: its `X-Forwarded-Host` is the console's host for a form's origin check,
    /// and over `X-Forwarded-Proto: https` the session cookie is `Secure`. Without it, both headers are ignored
    /// (anyone could send them). Default false.
    pub behind_proxy: bool,
    /// Where messages say their type, part of the failure groups' fingerprints (`header:NAME` or
    /// `json:/POINTER`); the same setting as the command line's `--message-type`.
    pub message_type: Option<String>,
    /// The consumers of this process, shown with their state and resumed after their kill switch tripped (none
    /// for a console started alone).
    pub consumers: Consumers,
    /// The handlers an edited dead letter's dry run goes through, by consumer group (none for a console started
    /// alone: it edits and retries, without the dry run).
    pub trials: Trials,
}

impl ConsoleConfig {
    /// A console for `users`, payloads hidden, no consumers of its own.
    pub fn new(users: Users) -> ConsoleConfig {
        ConsoleConfig {
            users,
            show_payloads: false,
            behind_proxy: false,
            message_type: None,
            consumers: Consumers::default(),
            trials: Trials::default(),
        }
    }
}

/// What the console needs of a store: the operator's tooling and the outbox ([`OutboxStore`], which is a
/// [`Backend`]), and, on a store that has it, the Sequential Inbox (PostgreSQL only).
pub trait ConsoleStore: OutboxStore {
    /// The pool to the Sequential Inbox's tables, on a store that has them.
    fn sequential_inbox(_pool: &sqlx::Pool<Self>) -> Option<&sqlx::PgPool> {
        None
    }
}

impl ConsoleStore for sqlx::Postgres {
    fn sequential_inbox(pool: &sqlx::PgPool) -> Option<&sqlx::PgPool> {
        Some(pool)
    }
}

impl ConsoleStore for sqlx::Sqlite {}

impl ConsoleStore for sqlx::MySql {}

/// What the console's handlers share.
pub struct Console<DB: ConsoleStore, P> {
    pool: sqlx::Pool<DB>,
    tables: Tables,
    publisher: Option<P>,
    config: ConsoleConfig,
    /// `config.message_type`, parsed once.
    typing: Option<crate::dead_letter::groups::MessageType>,
    sessions: auth::Sessions,
}

impl<DB: ConsoleStore, P: Publisher + 'static> Console<DB, P> {
    /// The user a bearer token names, or the status and reason that refuse the request.
    fn api_user(&self, headers: &HeaderMap, needs: Role) -> Result<User, api::Refusal> {
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.get(..7).filter(|scheme| scheme.eq_ignore_ascii_case("bearer ")).and(v.get(7..)))
            .ok_or_else(|| {
                let why = "send `Authorization: Bearer TOKEN` (a token of the console's users)";
                (StatusCode::UNAUTHORIZED, why.to_owned())
            })?;
        let user = self
            .config
            .users
            .authenticate(token)
            .ok_or_else(|| (StatusCode::UNAUTHORIZED, "this token is not one of the console's users".to_owned()))?;
        if user.role < needs {
            return Err((
                StatusCode::FORBIDDEN,
                format!("{} is a {}: acting needs the operator role", user.name, user.role.as_str()),
            ));
        }
        Ok(user)
    }

    /// Appends an action to the audit trail; its entry's id. A trail that cannot be written is logged (the action
    /// stands).
    async fn audit(
        &self,
        user: &User,
        action: &str,
        subjects: String,
        count: usize,
        outcome: &Result<(), String>,
    ) -> Option<i64> {
        let outcome = match outcome {
            Ok(()) => "ok".to_owned(),
            Err(why) => format!("failed: {why}"),
        };
        let entry = AuditEntry::now(&user.name, action, format!("{subjects} (console)"), count as i64, outcome);
        match crate::audit::record(&self.pool, &self.tables, &entry).await {
            Ok(id) => Some(id),
            Err(error) => {
                tracing::error!(%error, action, actor = %user.name, "the console acted, but the audit trail could not record it");
                None
            }
        }
    }
}

/// The console's routes: the page at `/`, the JSON API under `/api/v1/`. Mount it into an application of your own
/// or serve it with [`serve`]. `publisher` replays dead letters (each to the topic it came from); without one,
/// replays are refused with the reason.
pub fn router<DB: ConsoleStore, P: Publisher + 'static>(
    pool: sqlx::Pool<DB>,
    tables: Tables,
    publisher: Option<P>,
    config: ConsoleConfig,
) -> Result<Router, Error> {
    if config.users.is_empty() {
        return Err(Error::Config(
            "the console has no user: give it a users file (`NAME ROLE sha256:HEX` lines; `idem console token` makes \
             one) or a token in IDEM_CONSOLE_TOKEN"
                .into(),
        ));
    }
    let typing = config
        .message_type
        .as_deref()
        .map(crate::dead_letter::groups::MessageType::parse)
        .transpose()
        .map_err(|e| Error::Config(format!("message_type: {e}")))?;
    let sessions = auth::Sessions::default();
    let console = Arc::new(Console { pool, tables, publisher, config, typing, sessions });
    let router = Router::new()
        .route("/api/v1/openapi.json", get(api::openapi))
        .route("/api/v1/whoami", get(api::whoami::<DB, P>))
        .route("/api/v1/failure-groups", get(api::failure_groups::<DB, P>))
        .route("/api/v1/dead-letters", get(api::dead_letters::<DB, P>))
        .route("/api/v1/dead-letters/{id}", get(api::dead_letter::<DB, P>))
        .route("/api/v1/dead-letters/replay", post(api::replay::<DB, P>))
        .route("/api/v1/dead-letters/discard", post(api::discard::<DB, P>))
        .route("/api/v1/dead-letters/{id}/edit", post(api::edit::<DB, P>))
        .route("/api/v1/parked", get(api::parked::<DB, P>))
        .route("/api/v1/consumers", get(api::consumers::<DB, P>))
        .route("/api/v1/consumers/{group}/resume", post(api::resume::<DB, P>))
        .route("/api/v1/audit", get(api::audit::<DB, P>))
        .route("/api/v1/markers", get(markers::api::<DB, P>))
        .route("/api/v1/outbox", get(outbox::api::<DB, P>))
        .route("/api/v1/inbox", get(inbox::list_api::<DB, P>))
        .route("/api/v1/inbox/{id}", get(inbox::show_api::<DB, P>))
        .route("/api/v1/inbox/{id}/{action}", post(inbox::act_api::<DB, P>))
        .route("/api/v1/outbox/requeue", post(outbox::requeue_api::<DB, P>))
        .route("/", get(page::groups::<DB, P>))
        .route("/dead-letters", get(page::dead_letters::<DB, P>))
        .route("/dead-letters/{id}", get(page::dead_letter::<DB, P>))
        .route("/parked", get(page::parked::<DB, P>))
        .route("/consumers", get(page::consumers::<DB, P>))
        .route("/consumers/{group}/resume", post(page::resume::<DB, P>))
        .route("/audit", get(page::audit::<DB, P>))
        .route("/markers", get(markers::page::<DB, P>))
        .route("/outbox", get(outbox::page::<DB, P>))
        .route("/inbox", get(inbox::list_page::<DB, P>))
        .route("/inbox/{id}", get(inbox::show_page::<DB, P>))
        .route("/inbox/{id}/{action}", post(inbox::act_form::<DB, P>))
        .route("/outbox/requeue", post(outbox::requeue_form::<DB, P>))
        .route("/actions/{action}", post(page::act::<DB, P>))
        .route("/dead-letters/{id}/edit", post(page::edit::<DB, P>))
        .route("/login", get(page::login_form).post(page::login::<DB, P>))
        .route("/logout", post(page::logout::<DB, P>))
        .route("/static/console.css", get(page::stylesheet))
        .route("/favicon.ico", get(|| async { StatusCode::NO_CONTENT }))
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found: the console's pages start at /\n") })
        .layer(axum::middleware::from_fn(uncut))
        // Room for an edited payload at its limit, JSON-escaped; a larger body is refused before it is read.
        .layer(axum::extract::DefaultBodyLimit::max(4 * api::MAX_EDITED_PAYLOAD))
        .layer(axum::middleware::map_response(secure))
        .with_state(console);
    Ok(router)
}

/// Binds `addr` and serves [`router`] in the background for as long as the process runs; returns the bound
/// address (port 0 picks one).
pub async fn serve<DB: ConsoleStore, P: Publisher + 'static>(
    addr: SocketAddr,
    pool: sqlx::Pool<DB>,
    tables: Tables,
    publisher: Option<P>,
    config: ConsoleConfig,
) -> Result<SocketAddr, Error> {
    let app = router(pool, tables, publisher, config)?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Config(format!("console address {addr}: {e}: choose a free address or port 0")))?;
    let bound = listener.local_addr().map_err(|e| Error::Config(format!("console address {addr}: {e}")))?;
    tracing::info!(%bound, "serving the console");
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "the console stopped");
        }
    });
    Ok(bound)
}

/// Runs each request's work in a task of its own, so that a client that goes away does not cut a database
/// transaction short. sqlx (0.8) counts a transaction only once its `BEGIN` has answered: a request dropped in
/// between would hand the connection back to the pool inside that transaction, where the consumers' next
/// statements (the console shares their pool) would run and hold their locks.
async fn uncut(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    match tokio::spawn(next.run(request)).await {
        Ok(response) => response,
        Err(error) => {
            tracing::error!(%error, "a console request's task failed");
            (StatusCode::INTERNAL_SERVER_ERROR, "the request failed: see the log\n").into_response()
        }
    }
}

/// Security headers on every response: no inline script, no framing, no sniffing, no referrer to other sites, no
/// caching.
async fn secure(mut response: Response) -> Response {
    let headers = response.headers_mut();
    let set = [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; \
             base-uri 'none'",
        ),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        // Not `no-referrer`: with it a browser sends `Origin: null` on the console's own forms.
        (header::REFERRER_POLICY, "same-origin"),
        (header::CACHE_CONTROL, "no-store"),
    ];
    for (name, value) in set {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// A plain-text refusal.
fn refuse(status: StatusCode, why: &str) -> Response {
    (status, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], format!("{why}\n")).into_response()
}
