//! A batch of one partition, in order: as much of it committed together as possible, each failing message
//! isolated and dead-lettered (or held by the kill switch), retries with capped backoff.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::Engine;
use super::apply::Apply;
use super::outcome::Outcome;
use super::transaction::Failure;
use crate::error::{Error, HandlerError, Retry, classify};
use crate::key::MissingKey;
use crate::kill_switch::Verdict;
use crate::message::{Event, Message};
use crate::store::Backend;

/// An unsequenced unit of work: a message with its key, or a message that has none.
pub(crate) enum Item {
    Keyed(Event),
    Unkeyed { message: Message, reason: MissingKey },
}

impl Item {
    pub(super) fn message(&self) -> &Message {
        match self {
            Item::Keyed(e) => &e.message,
            Item::Unkeyed { message, .. } => message,
        }
    }
}

/// Work left in a batch, in order.
enum Step {
    Range(Range<usize>),
    DeadLetter { index: usize, reason: String, attempts: u32 },
}

pub(super) fn key_of(item: &Item) -> Option<&str> {
    match item {
        Item::Keyed(event) => Some(event.id.as_str()),
        Item::Unkeyed { .. } => None,
    }
}

impl<DB: Backend> Engine<DB> {
    pub(crate) fn items(&self, messages: Vec<Message>) -> Vec<Item> {
        let key = &self.inner.config.key;
        messages
            .into_iter()
            .map(|message| match key.extract(&message) {
                Ok(id) => Item::Keyed(Event { id, message }),
                Err(reason) => Item::Unkeyed { message, reason },
            })
            .collect()
    }

    /// Handles `items` in order: commits as much of them together as possible, dead-letters the failures.
    pub(crate) async fn process_items<A: Apply<DB>>(
        &self,
        items: &[Item],
        apply: &A,
        stop: &AtomicBool,
    ) -> Result<Vec<Outcome>, Error> {
        let mut outcomes = Vec::with_capacity(items.len());
        let mut steps = VecDeque::from([Step::Range(0..items.len())]);
        while let Some(step) = steps.pop_front() {
            match step {
                Step::DeadLetter { index, reason, attempts } => match self.inner.breaker.failed(&reason) {
                    (Verdict::DeadLetter, _) => {
                        outcomes.push(self.dead_letter(&items[index], &reason, attempts, stop).await?);
                    }
                    (Verdict::Hold, tripped) => {
                        if tripped {
                            self.tripped(&reason);
                        }
                        steps.push_front(Step::Range(index..index + 1));
                    }
                },
                Step::Range(range) if range.is_empty() => {}
                Step::Range(range) => {
                    match self.hold_while_tripped(stop).await?.attempt(&items[range.clone()], apply, stop).await? {
                        Ok(done) => {
                            if done.contains(&Outcome::Processed) {
                                self.inner.breaker.succeeded();
                            }
                            outcomes.extend(done)
                        }
                        Err((Some(at), reason, attempts)) => {
                            // Commit what precedes the failing message, dead-letter it, then go on after it.
                            let index = range.start + at;
                            steps.push_front(Step::Range(index + 1..range.end));
                            steps.push_front(Step::DeadLetter { index, reason, attempts });
                            steps.push_front(Step::Range(range.start..index));
                        }
                        Err((None, reason, attempts)) if range.len() == 1 => {
                            steps.push_front(Step::DeadLetter { index: range.start, reason, attempts });
                        }
                        Err((None, _, _)) => {
                            // The failure cannot be pinned on one message: one message per transaction finds it.
                            for index in range.rev() {
                                steps.push_front(Step::Range(index..index + 1));
                            }
                        }
                    }
                }
            }
        }
        Ok(outcomes)
    }

    /// Logs and publishes a trip of the kill switch.
    pub(super) fn tripped(&self, reason: &str) {
        let config = &self.inner.config;
        let group = &config.group;
        metrics::gauge!("consumer_paused", "consumer_group" => group.clone()).set(1.0);
        metrics::counter!("kill_switch_trips_total", "consumer_group" => group.clone()).increment(1);
        tracing::error!(
            consumer_group = %group,
            reason,
            in_a_row = config.kill_switch.threshold,
            pause = ?config.kill_switch.pause,
            "kill switch tripped: {} messages in a row failed the same way, which is not their fault; holding every \
             partition (nothing is acknowledged) and trying again after the pause. Fix the cause, then replay the \
             messages dead-lettered before the trip: idem dead-letters replay --group {group} --matching '<part of \
             the reason>' --all (--log-dir DIR | --kafka BROKERS)",
            config.kill_switch.threshold
        );
    }

    /// Waits while the kill switch is open; `Error::Stopped` if the consumer stops meanwhile.
    pub(super) async fn hold_while_tripped(&self, stop: &AtomicBool) -> Result<&Self, Error> {
        let breaker = &self.inner.breaker;
        if !breaker.open() {
            return Ok(self);
        }
        if !breaker.hold(|| stop.load(Ordering::SeqCst)).await {
            return Err(Error::Stopped);
        }
        metrics::gauge!("consumer_paused", "consumer_group" => self.inner.config.group.clone()).set(0.0);
        tracing::info!(consumer_group = %self.inner.config.group, "kill switch closed; trying again");
        Ok(self)
    }

    /// Runs one transaction over `items`, retrying what a retry can fix. `Ok(Err(..))` is a failure to isolate:
    /// the index of the message at fault when known, the reason, and the attempts made.
    pub(super) async fn attempt<A: Apply<DB>>(
        &self,
        items: &[Item],
        apply: &A,
        stop: &AtomicBool,
    ) -> Result<Result<Vec<Outcome>, (Option<usize>, String, u32)>, Error> {
        let config = &self.inner.config;
        let mut attempts = 0u32;
        let mut outages = 0u32;
        loop {
            let started = Instant::now();
            attempts += 1;
            match self.transaction(items, apply).await {
                Ok(outcomes) => {
                    let topic = items.first().map_or("", |i| i.message().topic.as_str());
                    metrics::histogram!("event_handle_duration_seconds", "consumer_group" => config.group.clone(),
                        "topic" => topic.to_owned())
                    .record(started.elapsed().as_secs_f64());
                    self.log_outcomes(items, &outcomes, started);
                    return Ok(Ok(outcomes));
                }
                Err(Failure::Handler { at, error: HandlerError::Permanent(reason) }) => {
                    return Ok(Err((at, reason, attempts)));
                }
                Err(Failure::Handler { error: HandlerError::TransactionAborted(reason), .. }) => {
                    return Ok(Err((None, reason, attempts)));
                }
                Err(Failure::Handler { at, error: HandlerError::Retryable(reason) }) => {
                    if attempts >= config.max_attempts {
                        let reason = format!("gave up after {attempts} attempts: {reason}");
                        return Ok(Err((at, reason, attempts)));
                    }
                    if stop.load(Ordering::SeqCst) {
                        return Err(Error::Stopped);
                    }
                    self.count_retry(items);
                    let delay = config.backoff_for(attempts);
                    tracing::warn!(group = %config.group, reason, attempt = attempts, ?delay, "retryable handler error; retrying the batch");
                    tokio::time::sleep(delay).await;
                }
                Err(Failure::Database(error)) if classify(&error) == Retry::Helps => {
                    attempts -= 1;
                    outages += 1;
                    if stop.load(Ordering::SeqCst) {
                        return Err(Error::Stopped);
                    }
                    self.count_retry(items);
                    let delay = config.backoff_for(outages);
                    if matches!(error, sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut) {
                        tracing::warn!(group = %config.group, %error, ?delay, outages, "database unreachable; retrying the batch");
                    } else {
                        tracing::warn!(group = %config.group, %error, ?delay, "transient database error; retrying the batch");
                    }
                    tokio::time::sleep(delay).await;
                }
                Err(Failure::Database(error)) => return Err(error.into()),
            }
        }
    }

    /// Writes the dead letter of one message in the same transaction as its marker.
    pub(super) async fn dead_letter(
        &self,
        item: &Item,
        reason: &str,
        attempts: u32,
        stop: &AtomicBool,
    ) -> Result<Outcome, Error> {
        let config = &self.inner.config;
        let mut outages = 0u32;
        loop {
            match self.dead_letter_once(item, reason, attempts).await {
                Ok(outcome) => {
                    let m = item.message();
                    if outcome == Outcome::DeadLettered {
                        tracing::warn!(group = %config.group, topic = %m.topic, partition = m.partition, offset = m.offset,
                            event_id = ?key_of(item), reason, outcome = outcome.as_str(), "dead-lettered");
                    }
                    return Ok(outcome);
                }
                Err(_) if stop.load(Ordering::SeqCst) => return Err(Error::Stopped),
                Err(error) if classify(&error) == Retry::Helps => {
                    outages += 1;
                    let delay = config.backoff_for(outages);
                    tracing::warn!(%error, ?delay, "transient database error while dead-lettering; retrying");
                    tokio::time::sleep(delay).await;
                }
                Err(error) => return Err(error.into()),
            }
        }
    }
}
