//! Errors, each saying whether a retry can help.
//!
//! A [`HandlerError`] is what user code returns: [`HandlerError::Retryable`] (a serialization failure, a
//! deadlock, a lost connection, a downstream that is briefly away) is retried with capped backoff;
//! [`HandlerError::Permanent`] (a payload that does not decode, a business rule that rejects the event) sends the
//! message to the dead-letter table in the same transaction as its marker. `?` on a [`sqlx::Error`] inside a
//! handler classifies it by its SQLSTATE, never by its message text.
//!
//! An [`Error`] is what the engine itself returns when it has to stop.

use std::fmt;

/// Whether retrying the same work can succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// The failure is transient (serialization failure 40001, deadlock 40P01 or MySQL's 1213, a lock wait timeout,
    /// a lost connection, SQLite busy).
    Helps,
    /// The same input will fail the same way; retrying only delays the partition.
    Useless,
}

/// Classifies a database error: transient failures can be retried, everything else cannot. Failures of the
/// connection itself are transient whatever the database; an error the database reported is judged by the store
/// that reported it ([`crate::Store::transient`]).
pub fn classify(error: &sqlx::Error) -> Retry {
    use crate::store::Store;
    let transient = match error {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) if db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>().is_some() => {
            <sqlx::Postgres as Store>::transient(db.as_ref())
        }
        sqlx::Error::Database(db) if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() => {
            <sqlx::Sqlite as Store>::transient(db.as_ref())
        }
        sqlx::Error::Database(db) if db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().is_some() => {
            <sqlx::MySql as Store>::transient(db.as_ref())
        }
        _ => false,
    };
    if transient { Retry::Helps } else { Retry::Useless }
}

/// The error a handler returns: retryable or permanent, with a reason that ends up in logs and dead letters.
#[derive(Debug)]
pub enum HandlerError {
    /// Transient: the batch is rolled back and retried with capped backoff, up to the configured attempts;
    /// after the last attempt the message is dead-lettered.
    Retryable(String),
    /// Permanent: the message's effects are rolled back and it is dead-lettered with this reason, in the same
    /// transaction as its marker, so it is neither lost nor retried forever.
    Permanent(String),
    /// The transaction was already aborted by an earlier statement whose error a handler did not return
    /// (PostgreSQL 25P02). Not this message's fault: the batch is re-run one message per transaction to find the
    /// one that was. `?` on a `sqlx::Error` produces it.
    TransactionAborted(String),
}

impl HandlerError {
    /// A transient failure; the work is retried.
    pub fn retryable(reason: impl fmt::Display) -> Self {
        HandlerError::Retryable(reason.to_string())
    }

    /// A permanent failure; the message is dead-lettered.
    pub fn permanent(reason: impl fmt::Display) -> Self {
        HandlerError::Permanent(reason.to_string())
    }

    /// The handler committed or rolled back idem's transaction itself.
    pub(crate) fn ended_transaction() -> Self {
        HandlerError::Permanent(
            "the handler ended the transaction itself (COMMIT or ROLLBACK through tx); leave transaction control to \
             idem"
                .into(),
        )
    }

    /// The handler swallowed a database error that left the transaction aborted (`error` says which).
    pub(crate) fn left_transaction_aborted(error: &sqlx::Error) -> Self {
        HandlerError::Permanent(format!(
            "the transaction was aborted by an earlier error the handler did not return ({error}); to tolerate an \
             error inside a handler, run that statement in a savepoint (tx.begin())"
        ))
    }

    /// Whether a retry can help.
    pub fn retry(&self) -> Retry {
        match self {
            HandlerError::Retryable(_) => Retry::Helps,
            HandlerError::Permanent(_) | HandlerError::TransactionAborted(_) => Retry::Useless,
        }
    }

    /// The reason, as given.
    pub fn reason(&self) -> &str {
        match self {
            HandlerError::Retryable(r) | HandlerError::Permanent(r) | HandlerError::TransactionAborted(r) => r,
        }
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandlerError::Retryable(r) => write!(f, "retryable: {r}"),
            HandlerError::Permanent(r) => write!(f, "permanent: {r}"),
            HandlerError::TransactionAborted(r) => write!(f, "transaction aborted earlier: {r}"),
        }
    }
}

impl std::error::Error for HandlerError {}

impl From<sqlx::Error> for HandlerError {
    fn from(error: sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = &error
            && db.code().as_deref() == Some("25P02")
        {
            return HandlerError::TransactionAborted(format!("database: {error}"));
        }
        match classify(&error) {
            Retry::Helps => HandlerError::Retryable(format!("database: {error}")),
            Retry::Useless => HandlerError::Permanent(format!("database: {error}")),
        }
    }
}

impl From<serde_json::Error> for HandlerError {
    fn from(error: serde_json::Error) -> Self {
        HandlerError::Permanent(format!("payload does not decode: {error}"))
    }
}

/// Why the engine, a source or a store operation stopped.
///
/// The message of each variant already contains its cause's, so the cause is not also given as a `source()`: an
/// error chain printed with `{:#}` says each thing once.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A database error; [`Error::retry`] says whether it was transient.
    #[error("database: {0}")]
    Database(sqlx::Error),
    /// The broker or the embedded log failed.
    #[error("source: {0}")]
    Source(crate::source::SourceError),
    /// The database could not be reached at start-up; the reason names the cause and the fix.
    #[error("cannot connect to {target}: {reason}")]
    Connect {
        /// The database, its password hidden.
        target: String,
        /// Why, and what to do.
        reason: String,
    },
    /// The configuration is invalid; the message names the field and the fix.
    #[error("configuration: {0}")]
    Config(String),
    /// The database schema is not what this version of idem expects.
    #[error("schema: {0}")]
    Schema(String),
    /// A partition worker panicked (a bug in a handler or in idem).
    #[error("worker: {0}")]
    Worker(String),
    /// The consumer is stopping: a batch waiting to be retried was abandoned, unacknowledged, to be redelivered.
    #[error("stopped: the batch was left unacknowledged because the consumer is stopping")]
    Stopped,
    /// A message's retryable failures outlasted `max_attempts` where it may be neither parked nor dead-lettered (an
    /// HTTP request, whose client retries): nothing of it was written, the reason is the last failure's.
    #[error("gave up for now, nothing written: {0}")]
    GaveUp(String),
}

impl From<sqlx::Error> for Error {
    fn from(error: sqlx::Error) -> Self {
        Error::Database(error)
    }
}

impl From<crate::source::SourceError> for Error {
    fn from(error: crate::source::SourceError) -> Self {
        Error::Source(error)
    }
}

impl Error {
    /// Whether retrying the failed operation can succeed.
    pub fn retry(&self) -> Retry {
        match self {
            Error::Database(e) => classify(e),
            Error::Source(e) => e.retry(),
            Error::Connect { .. } => Retry::Helps,
            Error::Config(_) | Error::Schema(_) | Error::Worker(_) => Retry::Useless,
            Error::Stopped | Error::GaveUp(_) => Retry::Helps,
        }
    }
}

/// `url` without its password (`scheme://user:***@host…`), for logs and errors that name a server.
pub fn redact_url(url: &str) -> String {
    let Some(at) = url.rfind('@') else { return url.to_owned() };
    // The credentials start after `scheme://`, or at the start when the URL is malformed (`postgres:/u:pw@h`).
    let start = url.find("://").filter(|&s| s < at).map_or(0, |s| s + 3);
    let head = &url[start..at];
    let colon = head.char_indices().find(|&(i, c)| c == ':' && !head[i + 1..].starts_with('/')).map(|(i, _)| start + i);
    match colon {
        Some(colon) => format!("{}:***{}", &url[..colon], &url[at..]),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_is_hidden_even_in_a_malformed_url() {
        assert_eq!(redact_url("postgres://app:s3cr:et@db:5432/x"), "postgres://app:***@db:5432/x");
        assert_eq!(redact_url("postgres:/app:s3cret@db/x"), "postgres:/app:***@db/x");
        assert_eq!(redact_url("app:s3cret@db/x"), "app:***@db/x");
        assert_eq!(redact_url("postgres://app@db/x"), "postgres://app@db/x");
        assert_eq!(redact_url("sqlite:///tmp/a@b.db"), "sqlite:///tmp/a@b.db");
    }

    #[test]
    fn io_errors_are_retryable() {
        let e = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(classify(&e), Retry::Helps);
        assert_eq!(HandlerError::from(e).retry(), Retry::Helps);
        assert_eq!(classify(&sqlx::Error::RowNotFound), Retry::Useless);
    }
}
