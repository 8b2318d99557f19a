//! The transaction order, written once: `BEGIN` → markers first → the handler on the new events → the check that
//! the handler left the transaction able to commit → `COMMIT`; the acknowledgement comes after, from the caller.

use std::collections::HashMap;

use sqlx::Connection;

use super::Engine;
use super::apply::Apply;
use super::batch::{Item, key_of};
use super::outcome::Outcome;
use crate::config::IdReusePolicy;
use crate::error::{HandlerError, Retry, classify};
use crate::fault::FaultPoint;
use crate::message::{Event, Message};
use crate::store::{Backend, Claim, NewDeadLetter};

/// Why one attempt at a transaction did not commit.
pub(super) enum Failure {
    /// The handler failed; `at` is the index of the item at fault when it is known.
    Handler { at: Option<usize>, error: HandlerError },
    /// idem's own statement failed.
    Database(sqlx::Error),
}

/// A dead-letter replay addressed to another consumer group: this group handled the original already.
fn replayed_for_another_group(message: &Message, group: &str) -> bool {
    message.header(crate::dead_letter::REPLAY_FOR_HEADER).is_some_and(|target| target != group.as_bytes())
}

impl<DB: Backend> Engine<DB> {
    /// `BEGIN` → markers → handler on the new events → `COMMIT`; the whole transaction order.
    pub(super) async fn transaction<A: Apply<DB>>(&self, items: &[Item], apply: &A) -> Result<Vec<Outcome>, Failure> {
        let inner = &self.inner;
        let config = &inner.config;
        let mut conn = crate::store::connect::connection(&inner.pool).await.map_err(Failure::Database)?;
        let mut tx = conn.begin().await.map_err(Failure::Database)?;

        // 1. The markers, first statement of the transaction. An id seen twice in one batch is claimed once.
        let mut first_of: HashMap<&str, &Event> = HashMap::with_capacity(items.len());
        let mut claimed: Vec<(usize, &Event)> = Vec::with_capacity(items.len());
        let mut reused_in_batch: Vec<(usize, &Event, String)> = Vec::new();
        for (index, item) in items.iter().enumerate() {
            let Item::Keyed(event) = item else { continue };
            if replayed_for_another_group(&event.message, &config.group) {
                continue;
            }
            match first_of.get(event.id.as_str()) {
                None => {
                    first_of.insert(event.id.as_str(), event);
                    claimed.push((index, event));
                }
                Some(first) if first.message.payload != event.message.payload => {
                    let m = &first.message;
                    reused_in_batch.push((index, event, format!("{}/{}/{}", m.topic, m.partition, m.offset)));
                }
                Some(_) => {}
            }
        }
        let mut outcomes = vec![Outcome::Duplicate; items.len()];
        let mut fresh: Vec<&Event> = Vec::with_capacity(claimed.len());
        let mut fresh_at: Vec<usize> = Vec::with_capacity(claimed.len());
        if !claimed.is_empty() {
            // In one order for every transaction (by id), so two batches holding common events wait on each other
            // at most one way round: concurrent duplicates across partitions never deadlock on their markers.
            // The handler still sees the new events in delivery order.
            let mut by_id: Vec<usize> = (0..claimed.len()).collect();
            by_id.sort_unstable_by(|&a, &b| claimed[a].1.id.cmp(&claimed[b].1.id));
            let events: Vec<&Event> = by_id.iter().map(|&i| claimed[i].1).collect();
            let sorted = DB::claim(&mut tx, &config.tables, &config.layout, &config.group, &events)
                .await
                .map_err(Failure::Database)?;
            let mut claims: Vec<Option<Claim>> = (0..claimed.len()).map(|_| None).collect();
            for (i, claim) in by_id.into_iter().zip(sorted) {
                claims[i] = Some(claim);
            }
            for ((index, event), claim) in claimed.iter().zip(claims.into_iter().flatten()) {
                match claim {
                    Claim::New => {
                        outcomes[*index] = Outcome::Processed;
                        fresh.push(event);
                        fresh_at.push(*index);
                    }
                    Claim::Duplicate => {}
                    Claim::Reused { first } => {
                        outcomes[*index] = Outcome::IdReused;
                        self.id_reused(&mut tx, event, &first).await.map_err(Failure::Database)?;
                    }
                }
            }
        }

        for (index, event, first) in reused_in_batch {
            outcomes[index] = Outcome::IdReused;
            self.id_reused(&mut tx, event, &first).await.map_err(Failure::Database)?;
        }

        // 2. Messages without a key cannot be deduplicated or handled: dead letters, in this transaction.
        for (index, item) in items.iter().enumerate() {
            if let Item::Unkeyed { message, reason } = item {
                let reason = reason.to_string();
                let letter = NewDeadLetter { event_id: None, message, error: &reason, attempts: 1 };
                DB::dead_letter(&mut tx, &config.tables, &config.group, &letter).await.map_err(Failure::Database)?;
                outcomes[index] = Outcome::DeadLettered;
            }
        }

        // 3. The user's effects, in the same transaction.
        if let Err((at, error)) = apply.apply(&fresh, &mut tx).await {
            let _ = tx.rollback().await;
            return Err(Failure::Handler { at: at.map(|i| fresh_at[i]), error });
        }

        // 4. COMMIT; the acknowledgement comes after, from the caller. A handler that swallowed a database
        // error can leave the transaction aborted, where PostgreSQL answers COMMIT with a silent ROLLBACK:
        // check first, so such a batch is never reported (and acknowledged) as committed.
        if !fresh.is_empty() {
            match DB::transaction_intact(&mut tx).await {
                Ok(true) => {}
                Ok(false) => {
                    let _ = tx.rollback().await;
                    return Err(Failure::Handler { at: None, error: HandlerError::ended_transaction() });
                }
                Err(error) if classify(&error) == Retry::Helps => return Err(Failure::Database(error)),
                Err(error) => {
                    let _ = tx.rollback().await;
                    return Err(Failure::Handler { at: None, error: HandlerError::left_transaction_aborted(&error) });
                }
            }
        }
        inner.faults.reached(FaultPoint::BeforeCommit);
        if let Err(error) = tx.commit().await {
            return Err(match classify(&error) {
                Retry::Helps => Failure::Database(error),
                // A deferred constraint of the handler's writes fails at COMMIT: the handler is at fault.
                Retry::Useless if !fresh.is_empty() => {
                    Failure::Handler { at: None, error: HandlerError::Permanent(format!("commit failed: {error}")) }
                }
                Retry::Useless => Failure::Database(error),
            });
        }
        let topic = items.first().map_or("", |i| i.message().topic.as_str());
        self.committed(topic, &outcomes);
        inner.faults.reached(FaultPoint::AfterCommit);
        Ok(outcomes)
    }

    /// A reused id: logged with both positions, and dead-lettered in this transaction when the policy says so.
    pub(super) async fn id_reused(
        &self,
        tx: &mut DB::Connection,
        event: &Event,
        first: &str,
    ) -> Result<(), sqlx::Error> {
        let config = &self.inner.config;
        let m = &event.message;
        tracing::warn!(event_id = %event.id, consumer_group = %config.group, topic = %m.topic, partition = m.partition,
            offset = m.offset, first_seen_at = first, outcome = Outcome::IdReused.as_str(),
            "event id reused for a different payload; not applied");
        if config.id_reuse == IdReusePolicy::DeadLetter {
            // Stored by position, not under the event id, which belongs to the first event (and may have its
            // own dead letter).
            let reason = format!(
                "{} event id {} was already used by a different payload (first seen at {first}); fix the producer \
                 and publish this event under a new id",
                crate::dead_letter::ID_REUSED_PREFIX,
                event.id
            );
            let letter = NewDeadLetter { event_id: None, message: m, error: &reason, attempts: 1 };
            DB::dead_letter(tx, &config.tables, &config.group, &letter).await?;
        }
        Ok(())
    }

    pub(super) async fn dead_letter_once(
        &self,
        item: &Item,
        reason: &str,
        attempts: u32,
    ) -> Result<Outcome, sqlx::Error> {
        let inner = &self.inner;
        let config = &inner.config;
        let mut conn = crate::store::connect::connection(&inner.pool).await?;
        let mut tx = conn.begin().await?;
        if let Item::Keyed(event) = item {
            let claims = DB::claim(&mut tx, &config.tables, &config.layout, &config.group, &[event]).await?;
            if claims.first() != Some(&Claim::New) {
                // Another consumer handled it in the meantime: nothing to dead-letter.
                tx.rollback().await?;
                self.committed(&item.message().topic, &[Outcome::Duplicate]);
                return Ok(Outcome::Duplicate);
            }
        }
        let letter = NewDeadLetter {
            event_id: key_of(item),
            message: item.message(),
            error: reason,
            attempts: i32::try_from(attempts).unwrap_or(i32::MAX),
        };
        DB::dead_letter(&mut tx, &config.tables, &config.group, &letter).await?;
        inner.faults.reached(FaultPoint::BeforeCommit);
        tx.commit().await?;
        self.committed(&item.message().topic, &[Outcome::DeadLettered]);
        inner.faults.reached(FaultPoint::AfterCommit);
        Ok(Outcome::DeadLettered)
    }
}
