//! What became of each message: the outcomes, the counters, the health a probe reads, what a commit reports,
//! and the metrics and log lines written for them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::Engine;
use super::batch::{Item, key_of};
use crate::store::Backend;

/// What became of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// New: the marker was inserted and the handler's effects committed with it.
    Processed,
    /// Already handled: the marker existed, nothing was applied.
    Duplicate,
    /// Failed permanently (or ran out of retries): stored in the dead-letter table with its marker.
    DeadLettered,
    /// The id was already used by an event with a different payload: the producer reused it. Not applied;
    /// logged at WARN with both positions, and dead-lettered too under [`IdReusePolicy::DeadLetter`](crate::IdReusePolicy::DeadLetter).
    IdReused,
    /// Older than the state it would change (an ordering guard, [`crate::guard::VersionGuard`]): committed with
    /// its marker, nothing applied; logged at INFO with both versions.
    Stale,
    /// Not allowed in its entity's current state (a [`crate::guard::StateMachine`] set to reject): committed
    /// with its marker, nothing applied; logged at INFO with the state.
    Rejected,
    /// Parked for a delayed retry (see [`crate::delayed_retry`]): acknowledged, tried again later, in its key's
    /// order.
    Parked,
}

impl Outcome {
    /// The label used in logs and metrics: `processed`, `duplicate`, `dead_lettered`, `id_reused`, `stale`,
    /// `rejected`, `parked`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Processed => "processed",
            Outcome::Duplicate => "duplicate",
            Outcome::DeadLettered => "dead_lettered",
            Outcome::IdReused => "id_reused",
            Outcome::Stale => "stale",
            Outcome::Rejected => "rejected",
            Outcome::Parked => "parked",
        }
    }

    /// The outcome of a fresh event the handler committed, from what it made of it.
    pub(crate) fn of_handled(handled: crate::message::Handled) -> Outcome {
        match handled {
            crate::message::Handled::Applied => Outcome::Processed,
            crate::message::Handled::AlreadyApplied => Outcome::Duplicate,
            crate::message::Handled::Stale => Outcome::Stale,
            crate::message::Handled::Rejected => Outcome::Rejected,
        }
    }
}

/// Counters of what the engine did since it was built. `retried` counts attempts that were rolled back and
/// run again (the `retried` outcome); the others count messages.
#[derive(Debug, Default)]
pub struct Stats {
    pub(super) processed: AtomicU64,
    pub(super) duplicate: AtomicU64,
    pub(super) retried: AtomicU64,
    pub(super) dead_lettered: AtomicU64,
    pub(super) id_reused: AtomicU64,
    pub(super) stale: AtomicU64,
    pub(super) rejected: AtomicU64,
    pub(super) parked: AtomicU64,
    pub(super) lost: AtomicU64,
}

/// A copy of [`Stats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StatsSnapshot {
    /// Messages processed.
    pub processed: u64,
    /// Duplicates skipped.
    pub duplicate: u64,
    /// Attempts rolled back and retried.
    pub retried: u64,
    /// Messages dead-lettered.
    pub dead_lettered: u64,
    /// Events whose id had been used by another payload.
    pub id_reused: u64,
    /// Events an ordering guard found stale.
    pub stale: u64,
    /// Events a state-machine guard rejected.
    pub rejected: u64,
    /// Messages parked for a delayed retry.
    pub parked: u64,
    /// Events never delivered, from holes in producer sequence numbers (see [`crate::gap`]).
    pub lost: u64,
}

impl Stats {
    /// Reads the counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            processed: self.processed.load(Ordering::Relaxed),
            duplicate: self.duplicate.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            id_reused: self.id_reused.load(Ordering::Relaxed),
            stale: self.stale.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            parked: self.parked.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
        }
    }

    pub(super) fn count(&self, outcome: Outcome) {
        let counter = match outcome {
            Outcome::Processed => &self.processed,
            Outcome::Duplicate => &self.duplicate,
            Outcome::DeadLettered => &self.dead_lettered,
            Outcome::IdReused => &self.id_reused,
            Outcome::Stale => &self.stale,
            Outcome::Rejected => &self.rejected,
            Outcome::Parked => &self.parked,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// The engine's state for health checks.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Health {
    /// [`Engine::run`] is consuming.
    pub running: bool,
    /// A shutdown or the end of the source is draining the in-flight batches.
    pub draining: bool,
    /// Partitions with a worker (partitions that delivered messages and were not revoked).
    pub partitions: u64,
    /// The kill switch tripped: the consumer holds, taking no new work (see [`crate::kill_switch`]).
    pub paused: bool,
    /// Partitions that hold work and have not committed for [`Config::stall_after`](crate::Config::stall_after)
    /// (a message retrying, a handler waiting). The consumer stays ready: the other partitions go on.
    pub stalled: Vec<super::Stalled>,
}

impl Health {
    /// Ready to take work: running, not draining, not paused. A stalled partition does not make the consumer
    /// unready (the others go on); it is reported in [`Health::stalled`]. (Partitions appear with the first
    /// message.)
    pub fn ready(&self) -> bool {
        self.running && !self.draining && !self.paused
    }
}

/// What one committed transaction did; given to the commit observer after `COMMIT`, before acknowledgement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Committed {
    /// Messages whose effects committed.
    pub processed: u64,
    /// Duplicates skipped.
    pub duplicate: u64,
    /// Messages dead-lettered.
    pub dead_lettered: u64,
    /// Events whose id had been used by another payload.
    pub id_reused: u64,
    /// Events an ordering guard found stale (committed, nothing applied).
    pub stale: u64,
    /// Events a state-machine guard rejected (committed, nothing applied).
    pub rejected: u64,
    /// Messages parked for a delayed retry.
    pub parked: u64,
}

impl<DB: Backend> Engine<DB> {
    /// Whether the handler ran and its transaction committed for a message of this outcome: a success that breaks
    /// a run of identical failures (the kill switch). A duplicate is one only in the natural-key mode, where the
    /// handler decided it.
    pub(super) fn handler_committed(&self, outcome: Outcome) -> bool {
        match outcome {
            Outcome::Processed | Outcome::Stale | Outcome::Rejected => true,
            Outcome::Duplicate => self.inner.config.dedup == crate::config::Dedup::NaturalKey,
            Outcome::DeadLettered | Outcome::IdReused | Outcome::Parked => false,
        }
    }

    /// Counts a committed transaction's outcomes (all of one partition, so of one topic) and tells the
    /// observer.
    pub(super) fn committed(&self, topic: &str, outcomes: &[Outcome]) {
        self.count_topic(topic);
        let mut report = Committed::default();
        for &outcome in outcomes {
            self.inner.stats.count(outcome);
            match outcome {
                Outcome::Processed => report.processed += 1,
                Outcome::Duplicate => report.duplicate += 1,
                Outcome::DeadLettered => report.dead_lettered += 1,
                Outcome::IdReused => report.id_reused += 1,
                Outcome::Stale => report.stale += 1,
                Outcome::Rejected => report.rejected += 1,
                Outcome::Parked => report.parked += 1,
            }
        }
        for (outcome, n) in [
            (Outcome::Processed, report.processed),
            (Outcome::Duplicate, report.duplicate),
            (Outcome::DeadLettered, report.dead_lettered),
            (Outcome::IdReused, report.id_reused),
            (Outcome::Stale, report.stale),
            (Outcome::Rejected, report.rejected),
            (Outcome::Parked, report.parked),
        ] {
            if n > 0 {
                metrics::counter!("idem_events_handled_total", "consumer_group" => self.inner.config.group.clone(),
                    "topic" => topic.to_owned(), "outcome" => outcome.as_str())
                .increment(n);
            }
        }
        let stored = match self.inner.config.id_reuse {
            crate::config::IdReusePolicy::DeadLetter => report.dead_lettered + report.id_reused,
            crate::config::IdReusePolicy::Skip => report.dead_lettered,
        };
        self.dead_letters_written(stored);
        let observer = self.inner.on_commit.read().ok().and_then(|slot| slot.clone());
        if let Some(observer) = observer {
            observer(&report);
        }
    }

    /// Registers the topic's outcome counters at 0 the first time one of its messages is counted, so that each
    /// outcome has a series before it first happens (`rate()` and `absent()` see it from then on).
    fn count_topic(&self, topic: &str) {
        let Ok(mut counted) = self.inner.topics_counted.lock() else { return };
        if !counted.contains(topic) {
            crate::telemetry::zero_outcomes(&self.inner.config.group, topic);
            counted.insert(topic.to_owned());
        }
    }

    pub(super) fn count_retry(&self, items: &[Item]) {
        self.inner.stats.retried.fetch_add(1, Ordering::Relaxed);
        let topic = items.first().map_or("", |i| i.message().topic.as_str());
        self.count_topic(topic);
        metrics::counter!("idem_events_handled_total", "consumer_group" => self.inner.config.group.clone(),
            "topic" => topic.to_owned(), "outcome" => "retried")
        .increment(1);
    }

    pub(super) fn log_outcomes(&self, items: &[Item], outcomes: &[Outcome], started: Instant) {
        let group = &self.inner.config.group;
        let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
        for (item, outcome) in items.iter().zip(outcomes) {
            let m = item.message();
            let event_id = key_of(item).unwrap_or("");
            match outcome {
                Outcome::Duplicate => tracing::info!(event_id, consumer_group = %group, topic = %m.topic,
                    partition = m.partition, offset = m.offset, outcome = outcome.as_str(), "duplicate skipped"),
                Outcome::DeadLettered => match (&m.dead_letter_reason, item) {
                    (Some(reason), Item::Keyed(_)) => tracing::warn!(event_id, consumer_group = %group,
                        topic = %m.topic, partition = m.partition, offset = m.offset, outcome = outcome.as_str(),
                        reason, "the broker's last delivery; dead-lettered without calling the handler"),
                    _ => tracing::warn!(event_id, consumer_group = %group, topic = %m.topic, partition = m.partition,
                        offset = m.offset, outcome = outcome.as_str(), "message has no idempotency key; dead-lettered"),
                },
                Outcome::Processed => tracing::debug!(event_id, consumer_group = %group, topic = %m.topic,
                    partition = m.partition, offset = m.offset, outcome = outcome.as_str(), batch_ms = elapsed_ms, "processed"),
                // Logged at WARN, with the first delivery's position, where it was detected; a guard's verdict
                // at INFO, with the versions or the state, by the guard.
                Outcome::IdReused | Outcome::Stale | Outcome::Rejected | Outcome::Parked => {}
            }
        }
    }
}
