//! Dead letters: see them and replay them.
//!
//! A replay must neither lose the message nor apply it twice. It runs in three steps: (1) one transaction
//! deletes the event's marker and marks the row `replaying`; (2) the stored message is published again (with
//! its original headers and payload, so it carries the same event id); (3) the row is deleted if it is still
//! `replaying`. A crash between the steps leaves the row in place, and replaying it again is safe: the marker
//! absorbs a second copy. If the replayed message fails again, the engine sets the row back to `dead` and
//! step 3 leaves it.
//!
//! The copy carries the header `idem-replay-for: <group>`: other consumer groups of the topic skip it (it was
//! delivered to them the first time), so a replay re-runs one group's handler only.

pub mod groups;

use crate::error::Error;
use crate::source::Publisher;
use crate::store::{Backend, DeadLetter, Tables};

/// The header that addresses a replayed copy to one consumer group.
pub const REPLAY_FOR_HEADER: &str = "idem-replay-for";

/// How the reason of an id-reuse dead letter starts.
pub const ID_REUSED_PREFIX: &str = "id_reused:";

/// Dead letters, oldest first, of one group or of all.
pub async fn list<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    group: Option<&str>,
    limit: i64,
) -> Result<Vec<DeadLetter>, Error> {
    DB::dead_letters(pool, tables, group, limit).await
}

/// Replays one dead letter through `publisher`. Returns false when no replayable row has that id.
pub async fn replay<DB: Backend, P: Publisher>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    publisher: &P,
    letter: &DeadLetter,
) -> Result<bool, Error> {
    if letter.error.starts_with(ID_REUSED_PREFIX) {
        return Err(Error::Config(format!(
            "dead letter {} is an event whose id was already used by another event: replaying it under the same id \
             would be refused again. Fix the producer, and publish it under a new id",
            letter.id
        )));
    }
    if !DB::begin_replay(pool, tables, letter.id).await? {
        return Ok(false);
    }
    let mut copy = letter.message();
    copy.headers.retain(|(name, _)| name != REPLAY_FOR_HEADER);
    copy.headers.push((REPLAY_FOR_HEADER.to_owned(), letter.consumer_group.clone().into_bytes()));
    publisher.publish(&copy).await?;
    DB::finish_replay(pool, tables, letter.id).await?;
    tracing::info!(id = letter.id, consumer_group = %letter.consumer_group, event_id = letter.event_id.as_deref().unwrap_or(""), topic = %letter.topic, "dead letter replayed");
    Ok(true)
}
