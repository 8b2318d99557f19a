//! The inbox's transaction: claim, lock, handle or buffer, release, close.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

use futures_util::future::BoxFuture;
use sqlx::{Connection, PgConnection, Postgres};

use super::store::{self, Status, Waiting};
use super::{InboxOutcome, InboxTransactions, QualifiedType, Route, Sequenced, SequentialInbox};
pub(crate) use crate::engine::Failure;
use crate::engine::{
    End, Engine, Isolate, One, Outcome, PerMessageRef, Process, Retrying, Shutdown, check_intact, commit_failed, retry,
};
use crate::error::{Error, HandlerError};
use crate::handler::Handler;
use crate::message::{Event, Message};
use crate::store::NewDeadLetter;

/// The inbox as a partition worker's processing step.
pub(crate) struct InboxProcess<H> {
    pub inbox: SequentialInbox,
    pub handler: Arc<H>,
}

impl<H: Handler<Postgres>> Process<Postgres> for InboxProcess<H> {
    fn process<'a>(
        &'a self,
        _engine: &'a Engine<Postgres>,
        batch: Vec<Message>,
        shutdown: &'a Shutdown,
    ) -> BoxFuture<'a, Result<Vec<bool>, Error>> {
        Box::pin(async move {
            let outcomes = self.inbox.process_batch(batch, self.handler.as_ref(), shutdown).await?;
            Ok(outcomes
                .into_iter()
                .map(|o| matches!(o, InboxOutcome::DeadLettered | InboxOutcome::Direct(Outcome::DeadLettered)))
                .collect())
        })
    }
}

/// The claim's own errors: a foreign-key violation there means the instance was deleted after it was resolved
/// (by housekeeping): resolve it again.
fn claim_failure(error: sqlx::Error) -> Failure {
    match &error {
        sqlx::Error::Database(db) if db.kind() == sqlx::error::ErrorKind::ForeignKeyViolation => Failure::Again,
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
        shutdown: &Shutdown,
    ) -> Result<Vec<InboxOutcome>, Error> {
        let mut outcomes = Vec::with_capacity(batch.len());
        let mut direct: Vec<Message> = Vec::new();
        for message in batch {
            let route = self.route(message);
            if let Route::Direct(message) = route {
                direct.push(message);
                continue;
            }
            self.process_direct(std::mem::take(&mut direct), handler, shutdown, &mut outcomes).await?;
            match route {
                Route::Direct(_) => {}
                Route::Sequenced(sequenced) => {
                    outcomes.push(self.process_sequenced(&sequenced, handler, shutdown).await?)
                }
                Route::Refused { message, reason } => {
                    tracing::warn!(topic = %message.topic, partition = message.partition, offset = message.offset,
                        reason, "message cannot be sequenced; dead-lettered");
                    self.dead_letter(None, &message, &reason, 1, shutdown).await?;
                    self.engine.dead_letters_written(1);
                    outcomes.push(InboxOutcome::DeadLettered);
                }
            }
        }
        self.process_direct(direct, handler, shutdown, &mut outcomes).await?;
        Ok(outcomes)
    }

    async fn process_direct<H: Handler<Postgres>>(
        &self,
        messages: Vec<Message>,
        handler: &H,
        shutdown: &Shutdown,
        outcomes: &mut Vec<InboxOutcome>,
    ) -> Result<(), Error> {
        if messages.is_empty() {
            return Ok(());
        }
        let items = self.engine.items(messages);
        let done = self.engine.process_items(&items, &PerMessageRef(handler), shutdown).await?;
        outcomes.extend(done.into_iter().map(InboxOutcome::Direct));
        Ok(())
    }

    /// One sequenced message, retried as the engine retries: transient database errors without limit,
    /// retryable handler errors up to `max_attempts`, then a dead letter.
    async fn process_sequenced<H: Handler<Postgres>>(
        &self,
        sequenced: &Sequenced,
        handler: &H,
        shutdown: &Shutdown,
    ) -> Result<InboxOutcome, Error> {
        let config = self.engine.config();
        let sequence = &self.config.sequences[sequenced.sequence];
        self.count(Count::Consumed, sequenced.sequence, 1);
        let subject = One { event_id: Some(&sequenced.event.id), message: &sequenced.event.message };
        let retrying =
            Retrying { group: &config.group, what: "the sequenced message", subject: &subject, on_retry: &|| {} };
        let result = retry(config, shutdown, &retrying, || async {
            // Separate mode holds two connections per attempt: at most half the pool's attempts run at once, so
            // the claim transactions can never take every connection the handlers need.
            let _slot = match &self.separate_slots {
                Some(slots) => Some(slots.acquire().await.map_err(|_| Failure::Stopped)?),
                None => None,
            };
            self.attempt(sequenced, handler, shutdown).await
        })
        .await;
        let Isolate { reason, attempts, .. } = match result {
            Ok(outcome) => {
                self.count_outcome(sequenced, outcome);
                return Ok(outcome);
            }
            Err((attempts, failure)) => failure.isolate(attempts)?,
        };
        // The claim was rolled back with the attempt: a resend of this message can claim it again.
        let m = &sequenced.event.message;
        tracing::warn!(consumer_group = %config.group, sequence = %sequence.name, context_id = %sequenced.context,
            event_id = %sequenced.event.id, topic = %m.topic, partition = m.partition, offset = m.offset, reason,
            "sequenced message dead-lettered");
        let reason = format!("`{}` {}: {reason}", sequence.types[sequenced.message_type].qualified, sequenced.event.id);
        self.dead_letter(None, m, &reason, attempts, shutdown).await?;
        self.count_outcome(sequenced, InboxOutcome::DeadLettered);
        Ok(InboxOutcome::DeadLettered)
    }

    /// One transaction: claim, lock, decide, handle or buffer, release, close, commit (the engine's transaction
    /// order), in the transaction the last one left open when there is one (as the per-event path does). The
    /// instance is the one remembered for the context, or found or created at the start of that transaction (so
    /// a new context costs no commit of its own, and an attempt rolled back leaves no instance behind); it is
    /// remembered once the transaction committed. An instance that is gone ends the attempt with `Again`, and its
    /// id is forgotten.
    async fn attempt<H: Handler<Postgres>>(
        &self,
        sequenced: &Sequenced,
        handler: &H,
        shutdown: &Shutdown,
    ) -> Result<InboxOutcome, Failure> {
        let tables = &self.engine.config().tables;
        let sequence = &self.config.sequences[sequenced.sequence];
        let known = self.instances.get(sequenced.sequence, &sequenced.context);
        let mut resolved = None;
        let body = async |tx: &mut PgConnection| {
            let instance = match known {
                Some(id) => id,
                None => {
                    let id = store::resolve_instance(
                        &mut *tx,
                        tables,
                        &sequence.name,
                        &sequenced.context,
                        sequence.retention.as_secs_f64(),
                    )
                    .await?;
                    resolved = Some(id);
                    id
                }
            };
            self.decide(tx, sequenced, instance, handler, shutdown).await
        };
        let result = self.engine.in_kept_transaction(1, body, |_| {}).await;
        match (&result, resolved) {
            (Err(Failure::Again), _) => self.instances.forget(sequenced.sequence, &sequenced.context),
            (Ok(_), Some(id)) => self.instances.remember(sequenced.sequence, &sequenced.context, id),
            _ => {}
        }
        result
    }

    /// The body of [`SequentialInbox::attempt`]: the claim, when won the instance lock, and the instance's state
    /// (with the message recorded, for a type always released) in one statement, then everything under the lock.
    async fn decide<H: Handler<Postgres>>(
        &self,
        tx: &mut PgConnection,
        sequenced: &Sequenced,
        instance: i64,
        handler: &H,
        shutdown: &Shutdown,
    ) -> Result<End<InboxOutcome>, Failure> {
        let tables = &self.engine.config().tables;
        let sequence = &self.config.sequences[sequenced.sequence];
        let message_type = &sequence.types[sequenced.message_type];
        let type_name = message_type.qualified.to_string();
        let event = &sequenced.event;
        let duplicate =
            End::Commit { value: InboxOutcome::Duplicate, user_writes: false, check_intact: false, idem_wrote: true };
        // A type without a release condition is always released: its PROCESSED row goes in with the state read.
        let always_released = message_type.release.is_none();
        let record = always_released.then_some(&event.message);
        let (open, state) = match store::claim_lock_and_read(&mut *tx, tables, &type_name, &event.id, instance, record)
            .await
            .map_err(claim_failure)?
        {
            store::Claim::Won { open, state } => (open, state),
            store::Claim::Duplicate => return Ok(duplicate),
            store::Claim::Gone => return Err(Failure::Again),
        };
        // Read before the lock was granted, while another holder of it committed: read again, under the lock.
        let state = match state {
            Some(state) => state,
            None if always_released => {
                store::state_and_record_processed(&mut *tx, tables, instance, &type_name, &event.id, &event.message)
                    .await?
            }
            None => store::state(&mut *tx, tables, instance, &type_name, &event.id).await?,
        };
        let replaces = match state.existing {
            // Stored before claims existed, or by a consumer whose claim was lost: already handled or buffered.
            Some((_, Status::Processed | Status::Waiting)) => return Ok(duplicate),
            Some((id, Status::Failed)) => Some(id),
            None => None,
        };
        let mut processed: HashSet<QualifiedType> =
            state.processed.iter().filter_map(|n| QualifiedType::parse(n).ok()).collect();
        let recording = sequence.recording(SystemTime::now());
        let ready = recording || message_type.release.as_ref().is_none_or(|c| c.holds(&processed));
        if !ready {
            store::record(&mut *tx, tables, instance, &type_name, &event.id, &event.message, Status::Waiting, replaces)
                .await?;
            return Ok(End::Commit {
                value: InboxOutcome::Buffered,
                user_writes: false,
                check_intact: true,
                idem_wrote: true,
            });
        }
        // Recorded before the handler runs, so that in the common case (nothing waiting, the instance not
        // complete) none of idem's statements follows the handler's and its intact check rides on COMMIT; when a
        // release or a close follows, the handler's work is checked intact before them.
        if !always_released {
            store::record(
                &mut *tx,
                tables,
                instance,
                &type_name,
                &event.id,
                &event.message,
                Status::Processed,
                replaces,
            )
            .await?;
        }
        processed.insert(message_type.qualified.clone());
        let completes = sequence.types.iter().all(|t| processed.contains(&t.qualified));
        self.handle(handler, event, &mut *tx, state.waiting > 0 || (open && completes)).await?;
        let released = if state.waiting == 0 {
            0
        } else {
            self.release(&mut *tx, sequenced.sequence, instance, &mut processed, handler, shutdown).await?
        };
        if open && sequence.types.iter().all(|t| processed.contains(&t.qualified)) {
            store::close(&mut *tx, tables, instance).await?;
        }
        let value = if recording { InboxOutcome::Recorded } else { InboxOutcome::Processed { released } };
        // The handler's writes share this transaction in shared mode (checked intact before any of idem's own
        // statements that follow it): a COMMIT failing for good is then theirs.
        let user_writes = self.config.transactions == InboxTransactions::Shared;
        // Checked intact in the round trip of COMMIT, which opens the next message's transaction.
        Ok(End::Commit { value, user_writes, check_intact: true, idem_wrote: true })
    }

    /// Runs the handler for the message being delivered, in the claim transaction or in one of its own; in the
    /// claim transaction, when idem's statements follow (`followed`), checks that the handler left it able to run
    /// them (else the check comes with `COMMIT`).
    async fn handle<H: Handler<Postgres>>(
        &self,
        handler: &H,
        event: &Event,
        tx: &mut PgConnection,
        followed: bool,
    ) -> Result<(), Failure> {
        match self.config.transactions {
            InboxTransactions::Shared => {
                handler.handle(event, tx).await.map_err(Failure::handler)?;
                if followed { check_intact::<Postgres>(tx, true).await } else { Ok(()) }
            }
            InboxTransactions::Separate => self.handle_separately(handler, event).await,
        }
    }

    /// The handler's own transaction on a second connection, committed before the inbox state is recorded. Not
    /// getting that connection is the database's failure, retried as such, not the handler's.
    async fn handle_separately<H: Handler<Postgres>>(&self, handler: &H, event: &Event) -> Result<(), Failure> {
        let mut conn = crate::store::connect::connection(self.engine.pool()).await?;
        let mut own = conn.begin().await?;
        handler.handle(event, &mut *own).await.map_err(Failure::handler)?;
        // The handler's own transaction: nothing of idem's in it, so one that wrote nothing is intact too.
        if let Err(failure) = check_intact::<Postgres>(&mut own, false).await {
            let _ = own.rollback().await;
            return Err(failure);
        }
        own.commit().await.map_err(|error| commit_failed(error, true))
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
        shutdown: &Shutdown,
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
                match self.run_released(tx, &waiting, handler, shutdown).await? {
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
    /// retrying retryable errors through the engine's retry loop (a stop cuts its backoff short and rolls the
    /// releasing transaction back). `Ok(Err(reason))`: it failed, and its effects were rolled back.
    async fn run_released<H: Handler<Postgres>>(
        &self,
        tx: &mut PgConnection,
        waiting: &Waiting,
        handler: &H,
        shutdown: &Shutdown,
    ) -> Result<Result<(), String>, Failure> {
        let config = self.engine.config();
        let event = Event::new(waiting.idempotence_id.clone(), waiting.message.clone());
        let subject = One { event_id: Some(&waiting.idempotence_id), message: &waiting.message };
        let retrying =
            Retrying { group: &config.group, what: "the released message", subject: &subject, on_retry: &|| {} };
        // Every attempt runs on the releasing transaction, one at a time. An attempt's value is `Err` when the
        // releasing transaction cannot go on (the retry loop must not run the savepoint again on it); its error
        // is the message's own failure, retried when the handler says a retry can help.
        let tx = tokio::sync::Mutex::new(tx);
        let result = retry(config, shutdown, &retrying, || async {
            let handled = match self.config.transactions {
                InboxTransactions::Shared => {
                    match self.handle_in_savepoint(&mut **tx.lock().await, &event, handler).await {
                        Ok(handled) => handled,
                        Err(fatal) => return Ok(Err(fatal)),
                    }
                }
                InboxTransactions::Separate => match self.handle_separately(handler, &event).await {
                    Ok(()) => Ok(()),
                    Err(Failure::Handler { error, .. }) => Err(error),
                    Err(fatal) => return Ok(Err(fatal)),
                },
            };
            handled.map(Ok).map_err(Failure::handler)
        })
        .await;
        match result {
            Ok(Ok(())) => Ok(Ok(())),
            Ok(Err(Failure::Ended)) => Err(Failure::handler(HandlerError::Permanent(format!(
                "while releasing `{}` {}: {}",
                waiting.message_type,
                event.id,
                HandlerError::ended_transaction().reason()
            )))),
            Ok(Err(fatal)) => Err(fatal),
            // Its permanent failure, or its retryable one after `max_attempts`: only its effects were rolled back.
            Err((_, Failure::Handler { error, .. })) => Ok(Err(error.reason().to_owned())),
            Err((_, other)) => Err(other),
        }
    }

    /// The handler in a savepoint of the releasing transaction, checked as the engine checks a batch. A failure
    /// of the message (`Ok(Err(..))`) rolls the savepoint back, the handler's effects only. A handler that ended
    /// the transaction itself (`COMMIT` or `ROLLBACK` through `tx`) took the releasing transaction with it: that
    /// fails the whole attempt (`Err`), never reported as committed.
    async fn handle_in_savepoint<H: Handler<Postgres>>(
        &self,
        tx: &mut PgConnection,
        event: &Event,
        handler: &H,
    ) -> Result<Result<(), HandlerError>, Failure> {
        let mut savepoint = tx.begin().await?;
        if let Err(error) = handler.handle(event, &mut savepoint).await {
            savepoint.rollback().await?;
            return Ok(Err(error));
        }
        match check_intact::<Postgres>(&mut savepoint, true).await {
            Ok(()) => Ok(savepoint.commit().await.map_err(HandlerError::from)),
            Err(Failure::Handler { error, .. }) => {
                savepoint.rollback().await?;
                Ok(Err(error))
            }
            Err(other) => Err(other),
        }
    }

    /// Writes a dead letter in a transaction of its own (no claim: a resend can take the message over).
    async fn dead_letter(
        &self,
        event_id: Option<&str>,
        message: &Message,
        reason: &str,
        attempts: u32,
        shutdown: &Shutdown,
    ) -> Result<(), Error> {
        let letter =
            NewDeadLetter { event_id, message, error: reason, attempts: i32::try_from(attempts).unwrap_or(i32::MAX) };
        self.engine.write_dead_letter(None, &letter, shutdown, |_| {}).await.map(|_| ())
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
            InboxOutcome::DeadLettered => {
                self.engine.dead_letters_written(1);
                self.count(Count::DeadLettered, sequence, 1)
            }
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
            Count::Consumed => (&c.consumed, "idem_inbox_consumed_total"),
            Count::Processed => (&c.processed, "idem_inbox_processed_total"),
            Count::Released => (&c.released, "idem_inbox_released_total"),
            Count::Buffered => (&c.buffered, "idem_inbox_buffered_total"),
            Count::Duplicates => (&c.duplicates, "idem_inbox_duplicates_skipped_total"),
            Count::Failed => (&c.failed, "idem_inbox_failed_total"),
            Count::DeadLettered => (&c.dead_lettered, "idem_inbox_dead_lettered_total"),
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
