//! The inbox's transaction: claim, lock, handle or buffer, release, close.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use sqlx::{Connection, PgConnection, Postgres};

use super::store::{self, Status, Waiting};
use super::{InboxOutcome, InboxTransactions, QualifiedType, Route, Sequenced, SequentialInbox};
use crate::engine::{Engine, PerMessageRef, Process};
use crate::error::{Error, HandlerError, Retry, classify};
use crate::fault::FaultPoint;
use crate::handler::Handler;
use crate::message::{Event, Message};
use crate::store::{Backend, NewDeadLetter};

/// The inbox as a partition worker's processing step.
pub(crate) struct InboxProcess<H> {
    pub inbox: SequentialInbox,
    pub handler: Arc<H>,
}

impl<H: Handler<Postgres>> Process<Postgres> for InboxProcess<H> {
    async fn process(&self, _engine: &Engine<Postgres>, batch: Vec<Message>, stop: &AtomicBool) -> Result<(), Error> {
        self.inbox.process_batch(batch, self.handler.as_ref(), stop).await.map(drop)
    }
}

/// Why one attempt did not commit.
pub(crate) enum Failure {
    /// The handler failed on the message being delivered.
    Handler(HandlerError),
    /// idem's own statement failed.
    Database(sqlx::Error),
    /// The instance was deleted between resolving it and claiming (housekeeping): resolve it again.
    InstanceGone,
}

impl From<sqlx::Error> for Failure {
    fn from(error: sqlx::Error) -> Self {
        Failure::Database(error)
    }
}

/// The claim's own errors: a foreign-key violation there means the instance was deleted after it was resolved.
fn claim_failure(error: sqlx::Error) -> Failure {
    match &error {
        sqlx::Error::Database(db) if db.code().as_deref() == Some("23503") => Failure::InstanceGone,
        _ => Failure::Database(error),
    }
}

impl SequentialInbox {
    /// Handles a batch of one partition in order: runs of unsequenced messages through the engine, each
    /// sequenced message in a transaction of its own.
    pub(crate) async fn process_batch<H: Handler<Postgres>>(
        &self,
        batch: Vec<Message>,
        handler: &H,
        stop: &AtomicBool,
    ) -> Result<Vec<InboxOutcome>, Error> {
        let mut outcomes = Vec::with_capacity(batch.len());
        let mut direct: Vec<Message> = Vec::new();
        for message in batch {
            let route = self.route(message);
            if let Route::Direct(message) = route {
                direct.push(message);
                continue;
            }
            self.process_direct(std::mem::take(&mut direct), handler, stop, &mut outcomes).await?;
            match route {
                Route::Direct(_) => {}
                Route::Sequenced(sequenced) => outcomes.push(self.process_sequenced(&sequenced, handler, stop).await?),
                Route::Refused { message, reason } => {
                    tracing::warn!(topic = %message.topic, partition = message.partition, offset = message.offset,
                        reason, "message cannot be sequenced; dead-lettered");
                    self.dead_letter(None, &message, &reason, 1, stop).await?;
                    outcomes.push(InboxOutcome::DeadLettered);
                }
            }
        }
        self.process_direct(direct, handler, stop, &mut outcomes).await?;
        Ok(outcomes)
    }

    async fn process_direct<H: Handler<Postgres>>(
        &self,
        messages: Vec<Message>,
        handler: &H,
        stop: &AtomicBool,
        outcomes: &mut Vec<InboxOutcome>,
    ) -> Result<(), Error> {
        if messages.is_empty() {
            return Ok(());
        }
        let items = self.engine.items(messages);
        let done = self.engine.process_items(&items, &PerMessageRef(handler), stop).await?;
        outcomes.extend(done.into_iter().map(InboxOutcome::Direct));
        Ok(())
    }

    /// One sequenced message, retried as the engine retries: transient database errors without limit,
    /// retryable handler errors up to `max_attempts`, then a dead letter.
    async fn process_sequenced<H: Handler<Postgres>>(
        &self,
        sequenced: &Sequenced,
        handler: &H,
        stop: &AtomicBool,
    ) -> Result<InboxOutcome, Error> {
        let config = self.engine.config();
        let sequence = &self.config.sequences[sequenced.sequence];
        self.count(Count::Consumed, sequenced.sequence, 1);
        let (mut attempts, mut outages) = (0u32, 0u32);
        loop {
            attempts += 1;
            // Separate mode holds two connections per attempt: at most half the pool's attempts run at once, so
            // the claim transactions can never take every connection the handlers need.
            let _slot = match &self.separate_slots {
                Some(slots) => Some(slots.acquire().await.map_err(|_| Error::Stopped)?),
                None => None,
            };
            let reason = match self.attempt(sequenced, handler).await {
                Ok(outcome) => {
                    self.count_outcome(sequenced, outcome);
                    return Ok(outcome);
                }
                Err(Failure::InstanceGone) => {
                    // Housekeeping deleted the instance between its lookup and the claim: look it up again.
                    attempts -= 1;
                    if stop.load(Ordering::SeqCst) {
                        return Err(Error::Stopped);
                    }
                    tokio::time::sleep(config.backoff_for(1)).await;
                    continue;
                }
                Err(Failure::Handler(HandlerError::Retryable(reason))) if attempts < config.max_attempts => {
                    if stop.load(Ordering::SeqCst) {
                        return Err(Error::Stopped);
                    }
                    let delay = config.backoff_for(attempts);
                    tracing::warn!(sequence = %sequence.name, event_id = %sequenced.event.id, reason, attempt = attempts,
                        ?delay, "retryable handler error; retrying the message");
                    tokio::time::sleep(delay).await;
                    continue;
                }
                Err(Failure::Handler(HandlerError::Retryable(reason))) => {
                    format!("gave up after {attempts} attempts: {reason}")
                }
                Err(Failure::Handler(HandlerError::Permanent(reason) | HandlerError::TransactionAborted(reason))) => {
                    reason
                }
                Err(Failure::Database(error)) if classify(&error) == Retry::Helps => {
                    attempts -= 1;
                    outages += 1;
                    if stop.load(Ordering::SeqCst) {
                        return Err(Error::Stopped);
                    }
                    let delay = config.backoff_for(outages);
                    tracing::warn!(%error, ?delay, "transient database error; retrying the message");
                    tokio::time::sleep(delay).await;
                    continue;
                }
                Err(Failure::Database(error)) => return Err(error.into()),
            };
            // The claim was rolled back with the attempt: a resend of this message can claim it again.
            let m = &sequenced.event.message;
            tracing::warn!(sequence = %sequence.name, context_id = %sequenced.context, event_id = %sequenced.event.id,
                topic = %m.topic, partition = m.partition, offset = m.offset, reason, "sequenced message dead-lettered");
            let reason =
                format!("`{}` {}: {reason}", sequence.types[sequenced.message_type].qualified, sequenced.event.id);
            self.dead_letter(None, m, &reason, attempts, stop).await?;
            self.count_outcome(sequenced, InboxOutcome::DeadLettered);
            return Ok(InboxOutcome::DeadLettered);
        }
    }

    /// One transaction: claim, lock, decide, handle or buffer, release, close, commit.
    async fn attempt<H: Handler<Postgres>>(&self, sequenced: &Sequenced, handler: &H) -> Result<InboxOutcome, Failure> {
        let tables = &self.engine.config().tables;
        let sequence = &self.config.sequences[sequenced.sequence];
        let message_type = &sequence.types[sequenced.message_type];
        let type_name = message_type.qualified.to_string();
        let event = &sequenced.event;
        let mut conn = crate::store::connect::connection(self.engine.pool()).await?;
        let instance = store::resolve_instance(
            &mut conn,
            tables,
            &sequence.name,
            &sequenced.context,
            sequence.retention.as_secs_f64(),
        )
        .await?;
        let mut tx = conn.begin().await?;
        if !store::claim(&mut tx, tables, &type_name, &event.id, instance).await.map_err(claim_failure)? {
            tx.commit().await?;
            return Ok(InboxOutcome::Duplicate);
        }
        let Some(open) = store::lock_instance(&mut tx, tables, instance).await? else {
            return Err(Failure::InstanceGone);
        };
        let state = store::state(&mut tx, tables, instance, &type_name, &event.id).await?;
        let replaces = match state.existing {
            // Stored before claims existed, or by a consumer whose claim was lost: already handled or buffered.
            Some((_, Status::Processed | Status::Waiting)) => {
                tx.commit().await?;
                return Ok(InboxOutcome::Duplicate);
            }
            Some((id, Status::Failed)) => Some(id),
            None => None,
        };
        let mut processed: HashSet<QualifiedType> =
            state.processed.iter().filter_map(|n| QualifiedType::parse(n).ok()).collect();
        let recording = sequence.recording(SystemTime::now());
        let ready = recording || message_type.release.as_ref().is_none_or(|c| c.holds(&processed));
        let outcome = if ready {
            self.handle(handler, event, &mut tx).await?;
            store::record(
                &mut tx,
                tables,
                instance,
                &type_name,
                &event.id,
                &event.message,
                Status::Processed,
                replaces,
            )
            .await?;
            processed.insert(message_type.qualified.clone());
            let released = if state.waiting == 0 {
                0
            } else {
                self.release(&mut tx, sequenced.sequence, instance, &mut processed, handler).await?
            };
            if open && sequence.types.iter().all(|t| processed.contains(&t.qualified)) {
                store::close(&mut tx, tables, instance).await?;
            }
            if recording { InboxOutcome::Recorded } else { InboxOutcome::Processed { released } }
        } else {
            store::record(&mut tx, tables, instance, &type_name, &event.id, &event.message, Status::Waiting, replaces)
                .await?;
            InboxOutcome::Buffered
        };
        self.engine.faults().reached(FaultPoint::BeforeCommit);
        if let Err(error) = tx.commit().await {
            return Err(match classify(&error) {
                Retry::Helps => Failure::Database(error),
                // A deferred constraint of the handler's writes fails at COMMIT: the handler is at fault.
                Retry::Useless if ready => Failure::Handler(HandlerError::Permanent(format!("commit failed: {error}"))),
                Retry::Useless => Failure::Database(error),
            });
        }
        self.engine.faults().reached(FaultPoint::AfterCommit);
        Ok(outcome)
    }

    /// Runs the handler for the message being delivered, in the claim transaction or in one of its own; in the
    /// claim transaction, checks that the handler left it able to commit.
    async fn handle<H: Handler<Postgres>>(
        &self,
        handler: &H,
        event: &Event,
        tx: &mut PgConnection,
    ) -> Result<(), Failure> {
        match self.config.transactions {
            InboxTransactions::Shared => {
                handler.handle(event, tx).await.map_err(Failure::Handler)?;
                check_intact(tx).await
            }
            InboxTransactions::Separate => self.handle_separately(handler, event).await,
        }
    }

    /// The handler's own transaction on a second connection, committed before the inbox state is recorded. Not
    /// getting that connection is the database's failure, retried as such, not the handler's.
    async fn handle_separately<H: Handler<Postgres>>(&self, handler: &H, event: &Event) -> Result<(), Failure> {
        let mut conn = crate::store::connect::connection(self.engine.pool()).await?;
        let mut own = conn.begin().await?;
        handler.handle(event, &mut *own).await.map_err(Failure::Handler)?;
        own.commit().await.map_err(|error| match classify(&error) {
            Retry::Helps => Failure::Database(error),
            Retry::Useless => Failure::Handler(HandlerError::Permanent(format!("commit failed: {error}"))),
        })
    }

    /// Releases, in arrival order, every WAITING message whose condition now holds (or that an operator released),
    /// repeating until none does. Returns how many were handled.
    pub(crate) async fn release<H: Handler<Postgres>>(
        &self,
        tx: &mut PgConnection,
        sequence_index: usize,
        instance: i64,
        processed: &mut HashSet<QualifiedType>,
        handler: &H,
    ) -> Result<usize, Failure> {
        let tables = &self.engine.config().tables;
        let sequence = &self.config.sequences[sequence_index];
        let mut released = 0;
        loop {
            let mut progressed = false;
            for waiting in store::waiting(tx, tables, instance).await? {
                let Ok(qualified) = QualifiedType::parse(&waiting.message_type) else { continue };
                let Some(message_type) = sequence.types.iter().find(|t| t.qualified == qualified) else { continue };
                let ready = waiting.forced || message_type.release.as_ref().is_none_or(|c| c.holds(processed));
                if !ready {
                    continue;
                }
                progressed = true;
                match self.run_released(tx, &waiting, handler).await? {
                    Ok(()) => {
                        store::mark_processed(tx, tables, waiting.id).await?;
                        processed.insert(qualified);
                        released += 1;
                    }
                    Err(reason) => {
                        let m = &waiting.message;
                        tracing::warn!(sequence = %sequence.name, instance, message_type = %waiting.message_type,
                            event_id = %waiting.idempotence_id, topic = %m.topic, partition = m.partition,
                            offset = m.offset, reason, "released message failed: marked FAILED, claim deleted; a resend retries it");
                        store::mark_failed(tx, tables, &waiting, &reason).await?;
                        self.count(Count::Failed, sequence_index, 1);
                    }
                }
            }
            if !progressed {
                return Ok(released);
            }
        }
    }

    /// Handles one released message in a savepoint (shared mode) or its own transaction (separate mode),
    /// retrying retryable errors. `Ok(Err(reason))`: it failed, and its effects were rolled back.
    async fn run_released<H: Handler<Postgres>>(
        &self,
        tx: &mut PgConnection,
        waiting: &Waiting,
        handler: &H,
    ) -> Result<Result<(), String>, Failure> {
        let config = self.engine.config();
        let event = Event { id: waiting.idempotence_id.clone(), message: waiting.message.clone() };
        let mut attempts = 0;
        loop {
            attempts += 1;
            let result = match self.config.transactions {
                InboxTransactions::Shared => {
                    let mut savepoint = tx.begin().await?;
                    match handler.handle(&event, &mut *savepoint).await {
                        Ok(()) => match Postgres::transaction_intact(&mut savepoint).await {
                            Ok(_) => savepoint.commit().await.map_err(HandlerError::from),
                            Err(error) => {
                                let _ = savepoint.rollback().await;
                                Err(HandlerError::Permanent(format!(
                                    "the handler left the transaction aborted ({error})"
                                )))
                            }
                        },
                        Err(error) => {
                            savepoint.rollback().await?;
                            Err(error)
                        }
                    }
                }
                InboxTransactions::Separate => match self.handle_separately(handler, &event).await {
                    Ok(()) => Ok(()),
                    Err(Failure::Handler(error)) => Err(error),
                    Err(other) => return Err(other),
                },
            };
            match result {
                Ok(()) => return Ok(Ok(())),
                Err(HandlerError::Retryable(reason)) if attempts < config.max_attempts => {
                    let delay = config.backoff_for(attempts);
                    tracing::warn!(event_id = %event.id, reason, attempt = attempts, ?delay,
                        "retryable error on a released message; retrying it");
                    tokio::time::sleep(delay).await;
                }
                Err(HandlerError::Retryable(reason)) => {
                    return Ok(Err(format!("gave up after {attempts} attempts: {reason}")));
                }
                Err(HandlerError::Permanent(reason) | HandlerError::TransactionAborted(reason)) => {
                    return Ok(Err(reason));
                }
            }
        }
    }

    /// Writes a dead letter in a transaction of its own (no claim: a resend can take the message over).
    async fn dead_letter(
        &self,
        event_id: Option<&str>,
        message: &Message,
        reason: &str,
        attempts: u32,
        stop: &AtomicBool,
    ) -> Result<(), Error> {
        let config = self.engine.config();
        let letter =
            NewDeadLetter { event_id, message, error: reason, attempts: i32::try_from(attempts).unwrap_or(i32::MAX) };
        let mut outages = 0;
        loop {
            let result = async {
                let mut conn = crate::store::connect::connection(self.engine.pool()).await?;
                let mut tx = conn.begin().await?;
                Postgres::dead_letter(&mut tx, &config.tables, &config.group, &letter).await?;
                tx.commit().await
            }
            .await;
            match result {
                Ok(()) => return Ok(()),
                Err(error) if classify(&error) == Retry::Helps && !stop.load(Ordering::SeqCst) => {
                    outages += 1;
                    tokio::time::sleep(config.backoff_for(outages)).await;
                }
                Err(error) => return Err(error.into()),
            }
        }
    }

    fn count_outcome(&self, sequenced: &Sequenced, outcome: InboxOutcome) {
        let sequence = sequenced.sequence;
        match outcome {
            InboxOutcome::Processed { released } => {
                self.count(Count::Processed, sequence, 1);
                self.count(Count::Released, sequence, released as u64);
            }
            InboxOutcome::Recorded => self.count(Count::Processed, sequence, 1),
            InboxOutcome::Buffered => self.count(Count::Buffered, sequence, 1),
            InboxOutcome::Duplicate => self.count(Count::Duplicates, sequence, 1),
            InboxOutcome::DeadLettered => self.count(Count::DeadLettered, sequence, 1),
            InboxOutcome::Direct(_) => {}
        }
    }

    /// Adds `n` to a counter and to its metric, labelled `{consumer_group, sequence}`.
    fn count(&self, what: Count, sequence: usize, n: u64) {
        if n == 0 {
            return;
        }
        let c = &self.counters;
        let (counter, metric) = match what {
            Count::Consumed => (&c.consumed, "inbox_consumed_total"),
            Count::Processed => (&c.processed, "inbox_processed_total"),
            Count::Released => (&c.released, "inbox_released_total"),
            Count::Buffered => (&c.buffered, "inbox_buffered_total"),
            Count::Duplicates => (&c.duplicates, "inbox_duplicates_skipped_total"),
            Count::Failed => (&c.failed, "inbox_failed_total"),
            Count::DeadLettered => (&c.dead_lettered, "inbox_dead_lettered_total"),
        };
        counter.fetch_add(n, Ordering::Relaxed);
        let sequence = self.config.sequences[sequence].name.clone();
        metrics::counter!(metric, "consumer_group" => self.engine.config().group.clone(), "sequence" => sequence)
            .increment(n);
    }
}

/// The inbox's counters.
#[derive(Clone, Copy)]
enum Count {
    Consumed,
    Processed,
    Released,
    Buffered,
    Duplicates,
    Failed,
    DeadLettered,
}

/// The same check as the engine's before `COMMIT`: a handler that swallowed an error (PostgreSQL then aborts the
/// transaction) or ended the transaction itself fails the message, with the fix in the reason.
async fn check_intact(tx: &mut PgConnection) -> Result<(), Failure> {
    match Postgres::transaction_intact(tx).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(Failure::Handler(HandlerError::ended_transaction())),
        Err(error) if classify(&error) == Retry::Helps => Err(Failure::Database(error)),
        Err(error) => Err(Failure::Handler(HandlerError::left_transaction_aborted(&error))),
    }
}
