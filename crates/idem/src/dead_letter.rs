//! Dead letters: see them and replay them.
//!
//! A replay must neither lose the message nor apply it twice. It runs in three steps: (1) one transaction
//! deletes the event's marker and marks the row `replaying`; (2) the stored message is published again (with
//! its original headers and payload, so it carries the same event id); (3) the row is deleted if it is still
//! `replaying`. A crash between the steps leaves the row in place, and replaying it again is safe: the marker
//! absorbs a second copy. If the replayed message fails again, the engine sets the row back to `dead` and
//! step 3 leaves it.

use crate::error::Error;
use crate::source::Publisher;
use crate::store::{Backend, DeadLetter, Tables};

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
    if !DB::begin_replay(pool, tables, letter.id).await? {
        return Ok(false);
    }
    publisher.publish(&letter.message()).await?;
    DB::finish_replay(pool, tables, letter.id).await?;
    tracing::info!(id = letter.id, event_id = ?letter.event_id, topic = %letter.topic, "dead letter replayed");
    Ok(true)
}
