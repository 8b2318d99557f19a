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

/// Appends `entry` to the audit trail; its id.
pub async fn record<DB: Backend>(pool: &sqlx::Pool<DB>, tables: &Tables, entry: &AuditEntry) -> Result<i64, Error> {
    Ok(DB::append_audit(pool, tables, entry).await?)
}

/// Which entries to read: every field narrows, `None` does not.
#[derive(Debug, Clone, Copy, Default)]
pub struct AuditQuery<'a> {
    /// Only this actor's.
    pub actor: Option<&'a str>,
    /// Only this action (`dead-letters replay`).
    pub action: Option<&'a str>,
    /// Only entries older than this id: the previous page's last.
    pub before_id: Option<i64>,
}

/// The newest `limit` entries, newest first.
pub async fn list<DB: Backend>(pool: &sqlx::Pool<DB>, tables: &Tables, limit: i64) -> Result<Vec<AuditEntry>, Error> {
    query(pool, tables, &AuditQuery::default(), limit).await
}

/// The newest `limit` entries `query` takes, newest first.
pub async fn query<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    query: &AuditQuery<'_>,
    limit: i64,
) -> Result<Vec<AuditEntry>, Error> {
    Ok(DB::audit_entries(pool, tables, query, limit).await?)
}

/// The operating-system user running this process, for an entry's actor when none is given: `$USER`, else
/// `$LOGNAME`, else the name the password database gives the process's user id (`uid N` when it has none).
pub fn os_user() -> String {
    let named = |var: &str| std::env::var(var).ok().filter(|name| !name.trim().is_empty());
    named("USER").or_else(|| named("LOGNAME")).unwrap_or_else(user_of_uid)
}

/// The login name of the process's real user id, read from `/etc/passwd` (no lookup through NSS, so a directory
/// user is shown as `uid N`).
fn user_of_uid() -> String {
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    passwd
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(':');
            let name = fields.next()?;
            let id = fields.nth(1)?.parse::<u32>().ok()?;
            (id == uid).then(|| name.to_owned())
        })
        .next()
        .unwrap_or_else(|| format!("uid {uid}"))
}
