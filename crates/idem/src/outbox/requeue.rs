//! A relay's dead letters back into the outbox: what `idem outbox requeue` and the console's outbox view do, with
//! one selection, so that the two never disagree.

use super::OutboxStore;
use crate::error::Error;
use crate::store::Tables;

/// The consumer group of relay `name`'s dead letters.
pub fn relay_group(name: &str) -> String {
    format!("outbox:{name}")
}

/// What a requeue did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Requeued {
    /// The dead letters chosen.
    pub chosen: Vec<i64>,
    /// Those moved back into the outbox.
    pub requeued: Vec<i64>,
    /// Those gone meanwhile (requeued or discarded by someone else).
    pub gone: Vec<i64>,
}

/// Why a requeue chose nothing, or stopped.
#[derive(Debug)]
pub enum RequeueError {
    /// Nothing named, or an id that is not a relay's dead letter: nothing done.
    Refused(String),
    /// The database failed after `done` were requeued.
    Failed {
        /// What was done before it failed.
        done: Requeued,
        /// The error.
        error: Error,
    },
}

/// Moves the dead letters `ids` (or, with `all`, every one) of relay `relay` (or of every relay) back into the
/// outbox, each in its own transaction; with `dry_run`, only says which it would take.
pub async fn requeue<DB: OutboxStore>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    ids: &[i64],
    all: bool,
    relay: Option<&str>,
    dry_run: bool,
) -> Result<Requeued, RequeueError> {
    if ids.is_empty() && !all {
        return Err(RequeueError::Refused(
            "name the dead letters to requeue (ids from `idem dead-letters list --group outbox:<relay>`) or pass --all"
                .to_owned(),
        ));
    }
    let group = relay.map(relay_group);
    let failed = |error| RequeueError::Failed { done: Requeued::default(), error };
    let letters = crate::dead_letter::list(pool, tables, group.as_deref(), i64::MAX).await.map_err(failed)?;
    let chosen: Vec<i64> = letters
        .iter()
        .filter(|l| l.consumer_group.starts_with("outbox:"))
        .filter(|l| all || ids.contains(&l.id))
        .map(|l| l.id)
        .collect();
    for id in ids {
        if !chosen.contains(id) {
            return Err(RequeueError::Refused(format!(
                "no outbox dead letter with id {id}{}; see `idem dead-letters list --group outbox:<relay>`",
                relay.map(|r| format!(" of relay {r}")).unwrap_or_default()
            )));
        }
    }
    if chosen.is_empty() {
        return Err(RequeueError::Refused(match relay {
            Some(r) => format!("relay {r} has no dead letter: nothing to requeue"),
            None => "no relay has a dead letter: nothing to requeue".to_owned(),
        }));
    }
    let mut done = Requeued { chosen: chosen.clone(), ..Requeued::default() };
    if dry_run {
        return Ok(done);
    }
    for id in chosen {
        match super::requeue_dead_letter(pool, tables, id).await {
            Ok(true) => done.requeued.push(id),
            Ok(false) => done.gone.push(id),
            Err(error) => return Err(RequeueError::Failed { done, error }),
        }
    }
    Ok(done)
}
