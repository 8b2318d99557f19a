//! Ordering guards: what idempotency alone does not give.
//!
//! A marker makes a redelivery harmless, but two *different* events of one entity can still arrive out of order
//! (two partitions, a producer retry, a replay), and applying each once still leaves the wrong final state. The
//! guards run inside idem's transaction, from a handler, under a lock on the entity's row:
//!
//! * [`VersionGuard`]: "apply only if this event's version is newer than the row's". The common case is one
//!   statement; an older event is [`Outcome::Stale`](crate::Outcome::Stale) (committed with its marker, nothing
//!   applied, logged at INFO with both versions); a jump of more than one version is a [`Gap`], reported to a hook
//!   that chooses to apply it, dead-letter it or retry it later.
//! * [`StateMachine`]: declared transitions (state × event type → next state, in code or TOML); an event not
//!   allowed in the entity's current state is [`Outcome::Rejected`](crate::Outcome::Rejected) or dead-lettered,
//!   as configured. With a version column it also skips stale events.
//!
//! Both are built against the database ([`VersionGuard::new`], [`StateMachine::new`]): a missing table or
//! column, a column of the wrong type or an id column without a unique constraint is an error at start-up, not
//! at the first event. Values come from the event through a [`Field`] (`json:/pointer` or `header:NAME`); a
//! value that is missing or does not parse dead-letters the event with the field named.
//!
//! ```no_run
//! use idem::guard::{Field, VersionGuard};
//! use idem::{Event, Handler, HandlerError};
//! use sqlx::PgConnection;
//!
//! struct Orders { guard: VersionGuard<sqlx::Postgres> }
//!
//! impl Handler<sqlx::Postgres> for Orders {
//!     async fn handle(&self, event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
//!         if self.guard.check(event, tx).await?.skip() {
//!             return Ok(()); // stale: counted and logged, its marker commits
//!         }
//!         #[derive(serde::Deserialize)]
//!         struct Order { id: i64, status: String }
//!         let o: Order = event.json()?;
//!         sqlx::query("UPDATE orders SET status = $1 WHERE id = $2").bind(o.status).bind(o.id).execute(&mut *tx).await?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn example(pool: sqlx::PgPool) -> Result<(), idem::Error> {
//! let guard = VersionGuard::new(&pool, "orders", "id", "version", Field::json("/id"), Field::json("/version")).await?;
//! let handler = Orders { guard };
//! # Ok(()) }
//! ```

pub(crate) mod schema;
mod state;
mod version;

use std::fmt;
use std::str::FromStr;

pub use schema::GuardStore;
pub use state::{Disallowed, StateMachine, StateMachineSpec, Transition};
pub use version::{Gap, GapDecision, VersionGuard};

use crate::error::{Error, HandlerError};
use crate::message::Event;

/// Where a guard reads a value of the event: a JSON pointer into the payload or a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Field {
    /// A JSON pointer (RFC 6901) into the payload, for example `/version`.
    Json(String),
    /// A header's value, which must be UTF-8.
    Header(String),
}

impl Field {
    /// The field at a JSON pointer of the payload.
    pub fn json(pointer: impl Into<String>) -> Self {
        Field::Json(pointer.into())
    }

    /// The field in a header.
    pub fn header(name: impl Into<String>) -> Self {
        Field::Header(name.into())
    }

    /// The value as text: a JSON string or number, or the header. A missing value dead-letters the event.
    pub fn text(&self, event: &Event, what: &str) -> Result<String, HandlerError> {
        match self {
            Field::Header(name) => {
                let value = event.message.header(name).ok_or_else(|| self.bad(what, "is absent"))?;
                Ok(std::str::from_utf8(value).map_err(|_| self.bad(what, "is not UTF-8"))?.to_owned())
            }
            Field::Json(pointer) => match json(event, self, what)?.pointer(pointer) {
                None | Some(serde_json::Value::Null) => Err(self.bad(what, "points at nothing")),
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                Some(serde_json::Value::Number(n)) => Ok(n.to_string()),
                Some(serde_json::Value::Bool(b)) => Ok(b.to_string()),
                Some(_) => Err(self.bad(what, "points at an object or an array")),
            },
        }
    }

    /// The value as a 64-bit integer: a JSON integer, or a string (or header) holding one. Anything else
    /// dead-letters the event, with the field and the value in the reason.
    pub fn integer(&self, event: &Event, what: &str) -> Result<i64, HandlerError> {
        if let Field::Json(pointer) = self
            && let Some(serde_json::Value::Number(n)) = json(event, self, what)?.pointer(pointer)
        {
            return n.as_i64().ok_or_else(|| self.bad(what, &format!("is {n}, not a 64-bit integer")));
        }
        let text = self.text(event, what)?;
        text.trim().parse().map_err(|_| self.bad(what, &format!("is {text:?}, not an integer")))
    }

    fn bad(&self, what: &str, problem: &str) -> HandlerError {
        HandlerError::permanent(format!("{what} ({self}) {problem}"))
    }
}

fn json(event: &Event, field: &Field, what: &str) -> Result<serde_json::Value, HandlerError> {
    serde_json::from_slice(event.payload())
        .map_err(|e| HandlerError::permanent(format!("{what} ({field}): the payload is not JSON ({e})")))
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Field::Json(pointer) => write!(f, "json:{pointer}"),
            Field::Header(name) => write!(f, "header:{name}"),
        }
    }
}

impl FromStr for Field {
    type Err = Error;

    /// `json:/pointer` or `header:NAME`.
    fn from_str(spec: &str) -> Result<Self, Error> {
        match spec.split_once(':') {
            Some(("json", pointer)) if pointer.starts_with('/') => Ok(Field::Json(pointer.to_owned())),
            Some(("header", name)) if !name.is_empty() => Ok(Field::Header(name.to_owned())),
            _ => Err(Error::Config(format!(
                "field `{spec}`: use `json:/pointer` (e.g. json:/version) or `header:NAME` (e.g. header:type)"
            ))),
        }
    }
}

impl<'de> serde::Deserialize<'de> for Field {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let spec = String::deserialize(deserializer)?;
        spec.parse().map_err(serde::de::Error::custom)
    }
}

/// What a guard decided: apply the event's effect, or skip it (the guard has counted and logged why).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a skipped event must not be applied: return Ok(()) when `skip()` is true"]
pub enum Decision {
    /// Apply the effect: the guard has already moved the row's version or state.
    Apply,
    /// Apply nothing and return `Ok(())`: the event is stale or rejected ([`crate::Handled`]), and commits with its
    /// marker so that a redelivery is a plain duplicate.
    Skip,
}

impl Decision {
    /// Whether the handler must skip the event's effect.
    pub fn skip(self) -> bool {
        self == Decision::Skip
    }
}
