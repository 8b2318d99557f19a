//! A batch of one partition, in order: as much of it committed together as possible, each failing message
//! isolated and dead-lettered (or held by the kill switch), retries with capped backoff.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::Instant;

use tracing::Instrument;

use super::Engine;
use super::apply::Apply;
use super::outcome::Outcome;
use super::retry::{Located, Retrying, Shutdown, Subject, retry};
use super::transaction::Isolate;
use crate::config::Dedup;
use crate::error::Error;
use crate::key::MissingKey;
use crate::kill_switch::Verdict;
use crate::message::{Event, Message};
use crate::store::{Backend, NewDeadLetter};

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
    DeadLetter {
        index: usize,
        reason: String,
        attempts: u32,
        retryable: bool,
    },
    /// Parked behind an earlier parked message of its key.
    Behind(usize),
}

/// A batch's retry log lines name the message at fault, or the first of the batch.
impl Subject for &[Item] {
    fn locate(&self, at: Option<usize>) -> (Located<'_>, usize) {
        let item = at.and_then(|i| self.get(i)).or_else(|| self.first());
        let located = match item {
            Some(item) => {
                let m = item.message();
                Located {
                    event_id: key_of(item).unwrap_or(""),
                    topic: &m.topic,
                    partition: m.partition,
                    offset: m.offset,
                }
            }
            None => Located { event_id: "", topic: "", partition: 0, offset: -1 },
        };
        (located, self.len())
    }
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
                Ok(id) => {
                    let span = self.message_span(&id, &message);
                    Item::Keyed(Event::new(id, message).with_span(span))
                }
                Err(reason) => Item::Unkeyed { message, reason },
            })
            .collect()
    }

    /// The span of one message (the messaging conventions' `process` span), a child of the trace context its
    /// headers carry; its outcome is recorded when it is known.
    fn message_span(&self, id: &str, m: &Message) -> tracing::Span {
        let span = tracing::info_span!(
            "idem.process",
            otel.name = format!("process {}", m.topic),
            otel.kind = "consumer",
            messaging.system = self.inner.system.get().copied().unwrap_or("idem"),
            messaging.operation.type = "process",
            messaging.destination.name = %m.topic,
            messaging.destination.partition.id = m.partition,
            messaging.kafka.offset = m.offset,
            messaging.message.id = id,
            messaging.consumer.group.name = %self.inner.config.group,
            idem.outcome = tracing::field::Empty,
        );
        crate::propagation::set_parent_from(&span, &m.headers);
        span
    }

    /// Handles `items` in order: commits as much of them together as possible, dead-letters the failures.
    pub(crate) async fn process_items(
        &self,
        items: &[Item],
        apply: &dyn Apply<DB>,
        shutdown: &Shutdown,
    ) -> Result<Vec<Outcome>, Error> {
        let mut outcomes = Vec::with_capacity(items.len());
        let mut steps = VecDeque::from([Step::Range(0..items.len())]);
        let mut parked = self.parked_keys_of(items, shutdown).await?;
        let parks = |item: &Item| self.delayed_retries().is_some() && matches!(item, Item::Keyed(_));
        while let Some(step) = steps.pop_front() {
            match step {
                Step::Behind(index) => {
                    outcomes.push(self.park(&items[index], None, 0, &mut parked, shutdown).await?);
                }
                Step::Range(range) if parked.blocks_any(&items[range.clone()]).is_some() => {
                    // Commit what comes before the first message of a parked key, park it, go on after it.
                    let at = range.start + parked.blocks_any(&items[range.clone()]).unwrap_or(0);
                    steps.push_front(Step::Range(at + 1..range.end));
                    steps.push_front(Step::Behind(at));
                    steps.push_front(Step::Range(range.start..at));
                }
                Step::DeadLetter { retryable: true, reason, .. }
                    if self.inner.gives_back.load(std::sync::atomic::Ordering::Relaxed) =>
                {
                    return Err(Error::GaveUp(reason));
                }
                Step::DeadLetter { index, reason, attempts, retryable } => match self.inner.breaker.failed(&reason) {
                    (Verdict::DeadLetter, _) if retryable && parks(&items[index]) => {
                        outcomes.push(self.park(&items[index], Some(&reason), attempts, &mut parked, shutdown).await?);
                    }
                    (Verdict::DeadLetter, _) => {
                        outcomes.push(self.dead_letter(&items[index], &reason, attempts, shutdown).await?);
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
                    match self
                        .hold_while_tripped(shutdown)
                        .await?
                        .attempt(&items[range.clone()], apply, shutdown)
                        .await?
                    {
                        Ok((done, began)) => {
                            if done.iter().any(|o| self.handler_committed(*o)) {
                                self.inner.breaker.succeeded(began);
                            }
                            outcomes.extend(done)
                        }
                        Err(Isolate { at: Some(at), reason, attempts, retryable }) => {
                            // Commit what precedes the failing message, dead-letter (or park) it, then go on
                            // after it.
                            let index = range.start + at;
                            steps.push_front(Step::Range(index + 1..range.end));
                            steps.push_front(Step::DeadLetter { index, reason, attempts, retryable });
                            steps.push_front(Step::Range(range.start..index));
                        }
                        Err(Isolate { at: None, reason, attempts, retryable }) if range.len() == 1 => {
                            steps.push_front(Step::DeadLetter { index: range.start, reason, attempts, retryable });
                        }
                        Err(Isolate { at: None, .. }) => {
                            // The failure cannot be pinned on one message: one message per transaction finds it.
                            for index in range.rev() {
                                steps.push_front(Step::Range(index..index + 1));
                            }
                        }
                    }
                }
            }
        }
        for (item, outcome) in items.iter().zip(&outcomes) {
            if let Item::Keyed(event) = item {
                event.span().record("idem.outcome", outcome.as_str());
            }
        }
        Ok(outcomes)
    }

    /// Logs and publishes a trip of the kill switch.
    pub(super) fn tripped(&self, reason: &str) {
        let config = &self.inner.config;
        let group = &config.group;
        metrics::gauge!("idem_consumer_paused", "consumer_group" => group.clone()).set(1.0);
        metrics::counter!("idem_kill_switch_trips_total", "consumer_group" => group.clone()).increment(1);
        let system = self.inner.system.get().copied().unwrap_or("idem");
        tracing::error!(
            consumer_group = %group,
            reason,
            in_a_row = config.kill_switch.threshold,
            pause = ?config.kill_switch.pause,
            "kill switch tripped: {} messages in a row failed the same way, which is not their fault; holding every \
             partition (nothing is acknowledged) and trying again after the pause. Fix the cause, then replay the \
             messages dead-lettered before the trip: idem dead-letters replay --group {group} --matching '<part of \
             the reason>' --all{}",
            config.kill_switch.threshold,
            crate::kill_switch::replay_flag(system),
        );
    }

    /// Waits while the kill switch is open; `Error::Stopped` if the consumer stops meanwhile.
    pub(super) async fn hold_while_tripped(&self, shutdown: &Shutdown) -> Result<&Self, Error> {
        let breaker = &self.inner.breaker;
        if !breaker.open() {
            return Ok(self);
        }
        if !breaker.hold(|| shutdown.triggered()).await {
            return Err(Error::Stopped);
        }
        metrics::gauge!("idem_consumer_paused", "consumer_group" => self.inner.config.group.clone()).set(0.0);
        tracing::info!(consumer_group = %self.inner.config.group, "kill switch closed; trying again");
        Ok(self)
    }

    /// Runs one transaction over `items`, retrying what a retry can fix: each message's outcome and when the
    /// committed transaction began (for the kill switch), or the failure to isolate.
    pub(super) async fn attempt(
        &self,
        items: &[Item],
        apply: &dyn Apply<DB>,
        shutdown: &Shutdown,
    ) -> Result<Result<(Vec<Outcome>, Instant), Isolate>, Error> {
        let config = &self.inner.config;
        let retrying = Retrying {
            group: &config.group,
            what: "the batch",
            subject: &items,
            on_retry: &|| self.count_retry(items),
        };
        let topic = items.first().map_or("", |i| i.message().topic.as_str());
        let batch = tracing::info_span!(
            "idem.batch",
            otel.name = format!("process {topic} batch"),
            messaging.system = self.inner.system.get().copied().unwrap_or("idem"),
            messaging.destination.name = topic,
            messaging.consumer.group.name = %config.group,
            messaging.batch.message_count = items.len(),
        );
        let result = retry(config, shutdown, &retrying, || {
            async {
                let started = Instant::now();
                self.transaction(items, apply).await.map(|outcomes| (outcomes, started))
            }
            .instrument(batch.clone())
        })
        .await;
        match result {
            Ok((outcomes, started)) => {
                let topic = items.first().map_or("", |i| i.message().topic.as_str());
                metrics::histogram!("idem_event_handle_duration_seconds", "consumer_group" => config.group.clone(),
                    "topic" => topic.to_owned())
                .record(started.elapsed().as_secs_f64());
                Ok(Ok((outcomes, started)))
            }
            Err((attempts, failure)) => failure.isolate(attempts).map(Err),
        }
    }

    /// Writes the dead letter of one message in the same transaction as its marker.
    pub(super) async fn dead_letter(
        &self,
        item: &Item,
        reason: &str,
        attempts: u32,
        shutdown: &Shutdown,
    ) -> Result<Outcome, Error> {
        let config = &self.inner.config;
        let claim = match item {
            Item::Keyed(event) if config.dedup == Dedup::Markers => Some(event),
            _ => None,
        };
        let m = item.message();
        let letter = NewDeadLetter {
            event_id: key_of(item),
            message: m,
            error: reason,
            attempts: i32::try_from(attempts).unwrap_or(i32::MAX),
        };
        let outcome = self.write_dead_letter(claim, &letter, shutdown, |o| self.committed(&m.topic, &[*o])).await?;
        if outcome == Outcome::DeadLettered {
            tracing::warn!(consumer_group = %config.group, topic = %m.topic, partition = m.partition,
                offset = m.offset, event_id = key_of(item).unwrap_or(""), reason,
                outcome = outcome.as_str(), "dead-lettered");
        }
        Ok(outcome)
    }
}
