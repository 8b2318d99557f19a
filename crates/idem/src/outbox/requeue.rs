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
    // A letter named that is not there was requeued (or discarded) meanwhile: the others go ahead. One that is
    // there but is not a relay's (of `relay`) refuses the whole.
    let mut gone = Vec::new();
    for &id in ids {
        if chosen.contains(&id) {
            continue;
        }
        let query =
            crate::store::letter_pages::LetterQuery { id: Some(id), ..crate::store::letter_pages::LetterQuery::ALL };
        match DB::letter_page(pool, tables, &query, 1).await.map_err(failed)?.pop() {
            Some(letter) => {
                return Err(RequeueError::Refused(format!(
                    "dead letter {id} is consumer group {}'s, not {}: requeue takes a relay's dead letters (replay \
                     a consumer's with `idem dead-letters replay {id}`)",
                    letter.consumer_group,
                    relay.map_or_else(|| "a relay's".to_owned(), |r| format!("relay {r}'s"))
                )));
            }
            None => gone.push(id),
        }
    }
    if chosen.is_empty() && !gone.is_empty() {
        return Err(RequeueError::Refused(format!(
            "no dead letter has id {} any more (requeued meanwhile?): nothing to requeue",
            crate::dead_letter::selection::join(&gone)
        )));
    }
    if chosen.is_empty() {
        return Err(RequeueError::Refused(match relay {
            Some(r) => format!("relay {r} has no dead letter: nothing to requeue"),
            None => "no relay has a dead letter: nothing to requeue".to_owned(),
        }));
    }
    let mut done = Requeued { chosen: chosen.clone(), gone, ..Requeued::default() };
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
