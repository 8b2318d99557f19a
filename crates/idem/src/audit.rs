//! The audit trail: every operator action (a replay, a discard, a retry now, a requeue, a release or close of a
//! Sequential Inbox instance) appends one entry to `{prefix}audit_log`: who (`--as NAME`, else the
//! operating-system user), what, which messages, how many, when, and how it ended. `idem audit list` shows them.

use crate::error::Error;
use crate::store::{Backend, Tables};

/// One operator action.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AuditEntry {
    /// Row id (0 before it is written).
    pub id: i64,
    /// When, in milliseconds since the epoch.
    pub at_ms: i64,
    /// Who: `--as NAME`, else the operating-system user.
    pub actor: String,
    /// What: the command, e.g. `dead-letters replay`.
    pub action: String,
    /// Which messages: ids, a filter, an instance.
    pub subjects: String,
    /// How many messages the action took.
    pub count: i64,
    /// How it ended: `ok`, or the error.
    pub outcome: String,
}

impl AuditEntry {
    /// An entry made now.
    pub fn now(
        actor: &str,
        action: &str,
        subjects: impl Into<String>,
        count: i64,
        outcome: impl Into<String>,
    ) -> AuditEntry {
        AuditEntry {
            id: 0,
            at_ms: crate::engine::now_ms(),
            actor: actor.to_owned(),
            action: action.to_owned(),
            subjects: subjects.into(),
            count,
            outcome: outcome.into(),
        }
    }
}

/// Appends `entry` to the audit trail.
pub async fn record<DB: Backend>(pool: &sqlx::Pool<DB>, tables: &Tables, entry: &AuditEntry) -> Result<(), Error> {
    Ok(DB::append_audit(pool, tables, entry).await?)
}

/// The newest `limit` entries, newest first.
pub async fn list<DB: Backend>(pool: &sqlx::Pool<DB>, tables: &Tables, limit: i64) -> Result<Vec<AuditEntry>, Error> {
    Ok(DB::audit_entries(pool, tables, limit).await?)
}

/// The operating-system user running this process, for an entry's actor when none is given.
pub fn os_user() -> String {
    std::env::var("USER").or_else(|_| std::env::var("LOGNAME")).unwrap_or_else(|_| "unknown".to_owned())
}
