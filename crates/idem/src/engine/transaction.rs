//! The transaction order, written once ([`Engine::in_transaction`]): a connection and `BEGIN` (or a transaction
//! left open by the last commit, [`super::warm`]), the body (whose first
//! statement is the claim: markers, or the Sequential Inbox's claim), the fault point, the check that user code
//! left the transaction able to commit and `COMMIT` (one round trip on PostgreSQL, [`crate::store::Store::commit_intact`]) with
//! their failures mapped, the report of what committed,
//! the fault point after it; the acknowledgement comes after, from the caller. The marker path
//! ([`Engine::transaction`]), the dead-letter path and the Sequential Inbox all run through it.

use std::collections::HashMap;

use sqlx::pool::PoolConnection;

use super::Engine;
use super::apply::Apply;
use super::batch::Item;
use super::outcome::Outcome;
use super::retry::{One, Retrying, Shutdown, retry};
use crate::config::{Dedup, IdReusePolicy};
use crate::error::{Error, HandlerError, Retry, classify};
use crate::fault::FaultPoint;
use crate::message::{Event, Handled, Message};
use crate::store::{Backend, Claim, IntactCommit, NewDeadLetter};

/// Why one attempt at a transaction did not commit: what the retry loop ([`super::retry::retry`]) retries, or
/// returns when a retry cannot help.
pub(crate) enum Failure {
    /// The handler failed; `at` is the index of the item at fault when it is known.
    Handler { at: Option<usize>, error: HandlerError },
    /// idem's own statement failed.
    Database(sqlx::Error),
    /// The state the attempt read changed under it (a Sequential Inbox instance deleted by housekeeping): run
    /// it again.
    Again,
    /// User code ended the transaction itself (`COMMIT` or `ROLLBACK` through `tx`): the handler's failure, of
    /// the whole transaction, never of a savepoint inside it.
    Ended,
    /// The consumer was told to stop during a retry inside the transaction: it is rolled back, unacknowledged.
    Stopped,
}

impl From<sqlx::Error> for Failure {
    fn from(error: sqlx::Error) -> Self {
        Failure::Database(error)
    }
}

impl Failure {
    /// A handler's failure, its message not known.
    pub(crate) fn handler(error: HandlerError) -> Self {
        Failure::Handler { at: None, error }
    }

    /// What a failure the retry loop gave up on after `attempts` means, written once for every way of claiming:
    /// a message's failure to isolate and dead-letter (or park), or an error that stops the consumer (idem's own
    /// statement failed for good, or the consumer was told to stop).
    pub(crate) fn isolate(self, attempts: u32) -> Result<Isolate, Error> {
        match self {
            Failure::Handler { error: HandlerError::TransactionAborted(reason), .. } => {
                // Not the failing message's fault: a batch is re-run one message per transaction.
                Ok(Isolate { at: None, reason, attempts, retryable: false })
            }
            Failure::Handler { at, error } => {
                let retryable = matches!(error, HandlerError::Retryable(_));
                Ok(Isolate { at, reason: error.reason().to_owned(), attempts, retryable })
            }
            Failure::Ended => {
                let reason = HandlerError::ended_transaction().reason().to_owned();
                Ok(Isolate { at: None, reason, attempts, retryable: false })
            }
            Failure::Database(error) => Err(error.into()),
            // `Stopped`: the consumer stops. `Again` is never final: the retry loop runs it again.
            Failure::Again | Failure::Stopped => Err(Error::Stopped),
        }
    }
}

/// A failure to isolate: the message at fault when known (its index in the attempt's items), the reason, the
/// attempts made.
pub(crate) struct Isolate {
    pub(crate) at: Option<usize>,
    pub(crate) reason: String,
    pub(crate) attempts: u32,
    /// The failure was retryable (the immediate retries ran out): a delayed retry may help.
    pub(crate) retryable: bool,
}

/// How a transaction body ends.
pub(crate) enum End<T> {
    /// Keep its work.
    Commit {
        /// What the transaction did.
        value: T,
        /// User code wrote through the transaction: a `COMMIT` that fails for good is its fault (a deferred
        /// constraint), not idem's.
        user_writes: bool,
        /// Commit through [`crate::store::Store::commit_intact`]: the intact check (see [`check_intact`]) in the
        /// round trip of `COMMIT`, which also opens the next transaction. Wanted when user code ran last, and by a
        /// body that wants its successor kept.
        check_intact: bool,
        /// idem wrote in the transaction (markers): one without a transaction id is not idem's any more.
        idem_wrote: bool,
    },
    /// Nothing to keep (the work turned out to be done already).
    Rollback(T),
}

/// Whether user code left the transaction able to commit. A handler that swallowed a database error leaves a
/// PostgreSQL transaction aborted, where `COMMIT` answers with a silent `ROLLBACK`; one that ran `COMMIT` or
/// `ROLLBACK` itself ended it. Either is the handler's failure, with the fix in the reason; never reported (or
/// acknowledged) as committed.
pub(crate) async fn check_intact<DB: Backend>(conn: &mut DB::Connection, idem_wrote: bool) -> Result<(), Failure> {
    match DB::transaction_intact(conn, idem_wrote).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(Failure::Ended),
        Err(error) => Err(aborted(error)),
    }
}

/// The failure of a `COMMIT` that failed: the database's when a retry can help; else, after user writes, the
/// handler's (a deferred constraint of its writes), and idem's own otherwise.
pub(crate) fn commit_failed(error: sqlx::Error, user_writes: bool) -> Failure {
    match classify(&error) {
        Retry::Helps => Failure::Database(error),
        Retry::Useless if user_writes => Failure::handler(HandlerError::Permanent(format!("commit failed: {error}"))),
        Retry::Useless => Failure::Database(error),
    }
}

/// The failure of a transaction found aborted: the database's, when a retry can help; else the handler's.
fn aborted(error: sqlx::Error) -> Failure {
    if classify(&error) == Retry::Helps {
        Failure::Database(error)
    } else {
        Failure::handler(HandlerError::left_transaction_aborted(&error))
    }
}

impl<DB: Backend> Engine<DB> {
    /// Runs `body` in a transaction on `conn` and ends it the one way idem ends transactions; `report` sees what
    /// the transaction did once it is committed (or rolled back by the body's choice), before the after-commit
    /// fault point and before the caller acknowledges anything.
    pub(crate) async fn in_transaction<T>(
        &self,
        conn: &mut PoolConnection<DB>,
        body: impl AsyncFnOnce(&mut DB::Connection) -> Result<End<T>, Failure>,
        report: impl FnOnce(&T),
    ) -> Result<T, Failure> {
        let tx = sqlx::Transaction::begin(&mut **conn, DB::begin_statement().map(Into::into)).await?;
        // The next transaction the store may have opened is not wanted here: dropping it rolls it back.
        self.in_open_transaction(tx, body, report).await.map(|(value, _next)| value)
    }

    /// [`Engine::in_transaction`] in a transaction already open (nothing run in it yet). Also returns the next
    /// transaction the store opened on the same connection while committing, if it did.
    async fn in_open_transaction<'c, T>(
        &self,
        mut tx: sqlx::Transaction<'c, DB>,
        body: impl AsyncFnOnce(&mut DB::Connection) -> Result<End<T>, Failure>,
        report: impl FnOnce(&T),
    ) -> Result<(T, Option<sqlx::Transaction<'c, DB>>), Failure> {
        let end = match body(&mut *tx).await {
            Ok(end) => end,
            Err(failure) => {
                let _ = tx.rollback().await;
                return Err(failure);
            }
        };
        let (value, ending) = match end {
            End::Rollback(value) => (value, None),
            End::Commit { value, user_writes, check_intact, idem_wrote } => {
                (value, Some(Ending { user_writes, check_intact, idem_wrote }))
            }
        };
        let committed = ending.is_some();
        let next = self.end_transaction(tx, ending).await?;
        report(&value);
        if let Some(faults) = self.inner.faults.get().filter(|_| committed) {
            faults.reached(FaultPoint::AfterCommit);
        }
        Ok((value, next))
    }

    /// Ends a transaction whose body succeeded: rolled back when `ending` is `None`, else committed (with the
    /// fault point before it and the intact check in its round trip when asked). Not generic over what the body
    /// returns, so it is compiled once.
    async fn end_transaction<'c>(
        &self,
        tx: sqlx::Transaction<'c, DB>,
        ending: Option<Ending>,
    ) -> Result<Option<sqlx::Transaction<'c, DB>>, Failure> {
        let Some(Ending { user_writes, check_intact, idem_wrote }) = ending else {
            tx.rollback().await?;
            return Ok(None);
        };
        if let Some(faults) = self.inner.faults.get() {
            faults.reached(FaultPoint::BeforeCommit);
        }
        let ended = if check_intact {
            DB::commit_intact(tx, idem_wrote).await
        } else {
            tx.commit().await.map_or_else(IntactCommit::CommitFailed, |()| IntactCommit::Committed(None))
        };
        match ended {
            IntactCommit::Committed(next) => Ok(next),
            IntactCommit::Ended => Err(Failure::Ended),
            IntactCommit::Aborted(error) => Err(aborted(error)),
            IntactCommit::CommitFailed(error) => Err(commit_failed(error, user_writes)),
        }
    }
}

/// How a body that keeps its work wants its transaction committed (the fields of [`End::Commit`]).
struct Ending {
    user_writes: bool,
    check_intact: bool,
    idem_wrote: bool,
}

/// A dead-letter replay addressed to another consumer group: this group handled the original already.
fn replayed_for_another_group(message: &Message, group: &str) -> bool {
    message.header(crate::dead_letter::REPLAY_FOR_HEADER).is_some_and(|target| target != group.as_bytes())
}

impl<DB: Backend> Engine<DB> {
    /// The marker path: markers first, duplicates skipped, the handler on the new events.
    /// In the run loop, after a transaction of one message, the transaction a store opened while committing waits
    /// for the next batch (see [`super::warm`]), which takes it instead of a connection and a `BEGIN`.
    pub(super) async fn transaction(&self, items: &[Item], apply: &dyn Apply<DB>) -> Result<Vec<Outcome>, Failure> {
        let started = std::time::Instant::now();
        let topic = items.first().map_or("", |i| i.message().topic.as_str());
        self.in_kept_transaction(
            items.len(),
            async |tx| self.claim_and_apply(&mut *tx, items, apply).await,
            // Counted and logged as soon as the transaction ends, before the acknowledgement: a process killed
            // between the two still leaves each event's line.
            |outcomes| {
                self.committed(topic, outcomes);
                self.log_outcomes(items, outcomes, started);
            },
        )
        .await
    }

    /// [`Engine::in_transaction`] in the transaction the last one of one message left open ([`super::warm`]), or
    /// on a connection of the pool; a transaction of `messages` = 1 that commits while the engine runs leaves its
    /// successor open for the next. (A body that ends with `check_intact: false` commits without a successor.)
    pub(crate) async fn in_kept_transaction<T>(
        &self,
        messages: usize,
        body: impl AsyncFnOnce(&mut DB::Connection) -> Result<End<T>, Failure>,
        report: impl FnOnce(&T),
    ) -> Result<T, Failure> {
        let tx = match self.inner.warm.take() {
            Some(tx) => tx,
            None => {
                let conn = crate::store::connect::connection(&self.inner.pool).await?;
                sqlx::Transaction::begin(conn, DB::begin_statement().map(Into::into)).await?
            }
        };
        let (value, next) = self.in_open_transaction(tx, body, report).await?;
        if let Some(next) = next
            && messages == 1
            && self.inner.running.load(std::sync::atomic::Ordering::SeqCst)
        {
            self.inner.warm.keep(next);
        }
        Ok(value)
    }

    pub(super) async fn claim_and_apply(
        &self,
        tx: &mut DB::Connection,
        items: &[Item],
        apply: &dyn Apply<DB>,
    ) -> Result<End<Vec<Outcome>>, Failure> {
        let config = &self.inner.config;

        // 1. The markers, first statement of the transaction. An id seen twice in one batch is claimed once.
        let mut first_of: HashMap<&str, &Event> = HashMap::with_capacity(items.len());
        let mut claimed: Vec<(usize, &Event)> = Vec::with_capacity(items.len());
        let mut reused_in_batch: Vec<(usize, &Event, String)> = Vec::new();
        for (index, item) in items.iter().enumerate() {
            let Item::Keyed(event) = item else { continue };
            if replayed_for_another_group(&event.message, &config.group) {
                continue;
            }
            if config.dedup == Dedup::NaturalKey {
                // Every message to the handler: two events may share the key the extractor reads (an order id)
                // and still differ; the handler's unique insert tells them apart.
                claimed.push((index, event));
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
            let claims = match config.dedup {
                // No marker: every event goes to the handler, whose own unique insert decides.
                Dedup::NaturalKey => vec![Claim::New; claimed.len()],
                Dedup::Markers => self.claim_markers(&mut *tx, &claimed).await?,
            };
            for ((index, event), claim) in claimed.iter().zip(claims) {
                match claim {
                    Claim::New if event.message.dead_letter_reason.is_some() => {
                        // The broker's last delivery: kept as a dead letter, not handled (see `Message`).
                        let reason = event.message.dead_letter_reason.as_deref().unwrap_or_default();
                        let letter = NewDeadLetter {
                            event_id: Some(&event.id),
                            message: &event.message,
                            error: reason,
                            attempts: 0,
                        };
                        DB::dead_letter(&mut *tx, &config.tables, &config.group, &letter)
                            .await
                            .map_err(Failure::Database)?;
                        outcomes[*index] = Outcome::DeadLettered;
                    }
                    Claim::New => {
                        fresh.push(event);
                        fresh_at.push(*index);
                    }
                    Claim::Duplicate => {}
                    Claim::Reused { first } => {
                        outcomes[*index] = Outcome::IdReused;
                        self.id_reused(&mut *tx, event, &first).await.map_err(Failure::Database)?;
                    }
                }
            }
        }

        for (index, event, first) in reused_in_batch {
            outcomes[index] = Outcome::IdReused;
            self.id_reused(&mut *tx, event, &first).await.map_err(Failure::Database)?;
        }

        // 2. Messages without a key cannot be deduplicated or handled: dead letters, in this transaction.
        for (index, item) in items.iter().enumerate() {
            if let Item::Unkeyed { message, reason } = item {
                let reason = reason.to_string();
                let letter = NewDeadLetter { event_id: None, message, error: &reason, attempts: 1 };
                DB::dead_letter(&mut *tx, &config.tables, &config.group, &letter).await.map_err(Failure::Database)?;
                outcomes[index] = Outcome::DeadLettered;
            }
        }

        // 3. The user's effects, in the same transaction; checked intact before COMMIT. What the handler made of
        // each event (applied, stale, …) is read afresh in every attempt.
        for event in &fresh {
            event.mark(Handled::Applied);
        }
        if let Err((at, error)) = apply.apply(&fresh, &mut *tx).await {
            return Err(Failure::Handler { at: at.map(|i| fresh_at[i]), error });
        }
        for (event, &index) in fresh.iter().zip(&fresh_at) {
            outcomes[index] = Outcome::of_handled(event.handled());
        }
        let user_code = !fresh.is_empty();
        let idem_wrote = config.dedup == Dedup::Markers;
        Ok(End::Commit { value: outcomes, user_writes: user_code, check_intact: user_code, idem_wrote })
    }

    /// Inserts the markers of `claimed` and returns their claims in the same order. The markers go in by id, the
    /// same order for every transaction, so two batches holding common events wait on each other at most one way
    /// round: concurrent duplicates across partitions never deadlock on their markers.
    async fn claim_markers(&self, tx: &mut DB::Connection, claimed: &[(usize, &Event)]) -> Result<Vec<Claim>, Failure> {
        let config = &self.inner.config;
        let mut by_id: Vec<usize> = (0..claimed.len()).collect();
        by_id.sort_unstable_by(|&a, &b| claimed[a].1.id.cmp(&claimed[b].1.id));
        let events: Vec<&Event> = by_id.iter().map(|&i| claimed[i].1).collect();
        let sorted =
            DB::claim(tx, &config.tables, &config.layout, &config.group, &events).await.map_err(Failure::Database)?;
        let mut claims: Vec<Option<Claim>> = (0..claimed.len()).map(|_| None).collect();
        for (i, claim) in by_id.into_iter().zip(sorted) {
            claims[i] = Some(claim);
        }
        Ok(claims.into_iter().flatten().collect())
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
            DB::dead_letter(&mut *tx, &config.tables, &config.group, &letter).await?;
        }
        Ok(())
    }

    /// One dead letter in a transaction of its own; with `claim`, together with that event's marker (`Duplicate`
    /// when someone else handled it meanwhile, and nothing is written). `report` sees the outcome once committed.
    async fn dead_letter_once(
        &self,
        claim: Option<&Event>,
        letter: &NewDeadLetter<'_>,
        report: impl FnOnce(&Outcome),
    ) -> Result<Outcome, Failure> {
        let config = &self.inner.config;
        let mut conn = crate::store::connect::connection(&self.inner.pool).await?;
        let body = async |tx: &mut DB::Connection| {
            if let Some(event) = claim {
                let claims = DB::claim(&mut *tx, &config.tables, &config.layout, &config.group, &[event]).await?;
                if claims.first() != Some(&Claim::New) {
                    return Ok(End::Rollback(Outcome::Duplicate));
                }
            }
            DB::dead_letter(&mut *tx, &config.tables, &config.group, letter).await?;
            Ok(End::Commit { value: Outcome::DeadLettered, user_writes: false, check_intact: false, idem_wrote: true })
        };
        self.in_transaction(&mut conn, body, report).await
    }

    /// Writes a dead letter through the retry loop (see `dead_letter_once`): the one way the batch, the kill
    /// switch's aftermath and the Sequential Inbox store a dead letter. A database error no retry helps stops the
    /// consumer; so does a stop.
    pub(crate) async fn write_dead_letter(
        &self,
        claim: Option<&Event>,
        letter: &NewDeadLetter<'_>,
        shutdown: &Shutdown,
        report: impl Fn(&Outcome) + Sync,
    ) -> Result<Outcome, crate::error::Error> {
        let config = &self.inner.config;
        let subject = One { event_id: letter.event_id, message: letter.message };
        let retrying = Retrying { group: &config.group, what: "the dead letter", subject: &subject, on_retry: &|| {} };
        match retry(config, shutdown, &retrying, || self.dead_letter_once(claim, letter, &report)).await {
            Ok(outcome) => Ok(outcome),
            Err((_, Failure::Database(error))) => Err(error.into()),
            Err(_) => Err(crate::error::Error::Stopped),
        }
    }
}
