//! The kill switch: when the same permanent failure repeats for many messages in a row, it is not the messages'
//! fault (a dropped table, a revoked grant, a downstream rejecting everything). Dead-lettering them all would
//! empty the partitions into the dead-letter table; instead the consumer stops taking new work.
//!
//! How it behaves (compare MassTransit's kill switch, which trips on a failure rate and restarts after a delay):
//! * Every message a handler fails permanently (or that runs out of retries) counts, with its reason. A reason
//!   different from the previous one starts the count again; a committed message resets it.
//! * When [`KillSwitch::threshold`] messages in a row failed with the same reason, the switch trips: the
//!   message at hand is **not** dead-lettered, every partition stops before its next transaction, one ERROR line
//!   names the reason and the command that replays the messages dead-lettered before the trip, the gauge
//!   `idem_consumer_paused{consumer_group}` reads 1 and `/readyz` reports not ready.
//! * After [`KillSwitch::pause`] (or at once on [`crate::Engine::resume`]) the consumer tries again, starting
//!   with the message that tripped it. If it fails the same way the switch trips again at once; a success closes
//!   it. Messages held back are never acknowledged, so nothing is lost however long the pause.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// When the kill switch trips, and for how long it holds the consumer (see the [module documentation](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KillSwitch {
    /// Messages failing permanently in a row with the same reason that trip the switch; 0 turns it off.
    pub threshold: u32,
    /// How long the consumer holds before it tries again.
    pub pause: Duration,
}

impl Default for KillSwitch {
    /// Trips after 20 messages in a row fail with the same reason; tries again after 30 s.
    fn default() -> Self {
        KillSwitch { threshold: 20, pause: Duration::from_secs(30) }
    }
}

impl KillSwitch {
    /// A kill switch that never trips: every failing message is dead-lettered.
    pub fn off() -> Self {
        KillSwitch { threshold: 0, pause: Duration::ZERO }
    }
}

/// The switch's state, shared by the partitions of one engine.
#[derive(Debug)]
pub(crate) struct Breaker {
    settings: KillSwitch,
    state: Mutex<State>,
    resume: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct State {
    reason: Option<String>,
    streak: u32,
    /// When the current streak's first failure was counted.
    since: Option<Instant>,
    /// Set while tripped: until when the consumer holds.
    until: Option<Instant>,
    trips: u64,
}

/// What a failure did to the switch.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Dead-letter the message as usual.
    DeadLetter,
    /// The switch tripped (or was already open): hold, then try the message again.
    Hold,
}

impl Breaker {
    pub(crate) fn new(settings: KillSwitch) -> Self {
        Breaker { settings, state: Mutex::new(State::default()), resume: tokio::sync::Notify::new() }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts a message that failed permanently with `reason`; `true` the first time this trips the switch.
    pub(crate) fn failed(&self, reason: &str) -> (Verdict, bool) {
        if self.settings.threshold == 0 {
            return (Verdict::DeadLetter, false);
        }
        let mut state = self.state();
        if state.until.is_some() {
            return (Verdict::Hold, false);
        }
        if state.reason.as_deref() == Some(reason) && state.streak > 0 {
            state.streak += 1;
        } else {
            state.reason = Some(reason.to_owned());
            state.streak = 1;
            state.since = Some(Instant::now());
        }
        if state.streak < self.settings.threshold {
            return (Verdict::DeadLetter, false);
        }
        state.until = Some(Instant::now() + self.settings.pause);
        state.trips += 1;
        (Verdict::Hold, true)
    }

    /// A message committed in a transaction that began at `began`: the failures were the messages' own after all.
    /// A transaction that began before the streak's first failure says nothing about it (another partition's
    /// batch committing late, say), so it resets nothing.
    pub(crate) fn succeeded(&self, began: Instant) {
        if self.settings.threshold == 0 {
            return;
        }
        let mut state = self.state();
        if state.streak > 0 && state.until.is_none() && state.since.is_none_or(|since| began >= since) {
            state.streak = 0;
            state.reason = None;
            state.since = None;
        }
    }

    /// Whether the switch is open (the consumer holds).
    pub(crate) fn open(&self) -> bool {
        self.state().until.is_some()
    }

    /// How many times the switch tripped.
    pub(crate) fn trips(&self) -> u64 {
        self.state().trips
    }

    /// Closes the switch at once. The next failure with the same reason trips it again.
    pub(crate) fn resume(&self) {
        self.close();
        self.resume.notify_waiters();
    }

    fn close(&self) {
        let mut state = self.state();
        if state.until.take().is_some() {
            // One more failure of the same kind trips it again; a success clears the count.
            state.streak = self.settings.threshold.saturating_sub(1);
        }
    }

    /// Waits while the switch is open, until its pause ends, [`Breaker::resume`] is called, or `stopping` says
    /// the consumer is stopping (`false` then).
    pub(crate) async fn hold(&self, stopping: impl Fn() -> bool) -> bool {
        loop {
            let until = match self.state().until {
                None => return true,
                Some(until) => until,
            };
            if stopping() {
                return false;
            }
            let now = Instant::now();
            if now >= until {
                self.close();
                return true;
            }
            let nap = (until - now).min(Duration::from_millis(100));
            tokio::select! {
                _ = self.resume.notified() => {}
                _ = tokio::time::sleep(nap) => {}
            }
        }
    }
}

/// The broker flag with which `idem dead-letters replay` publishes the messages of a source of `system` (its
/// [`crate::Source::SYSTEM`]) again; HTTP requests need none (their keys are released).
pub(crate) fn replay_flag(system: &str) -> &'static str {
    match system {
        "kafka" => " --kafka BROKERS",
        "rabbitmq" => " --rabbitmq URL",
        "nats" => " --nats URL",
        "aws_sqs" => " --sqs ENDPOINT",
        "gcp_pubsub" => " --pubsub PROJECT",
        "http" => "",
        // The embedded log's (and a source of one's own that keeps the default).
        _ => " --log-dir DIR",
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_replay_hint_names_the_flag_of_the_source_in_use() {
        assert_eq!(super::replay_flag("rabbitmq"), " --rabbitmq URL");
        assert_eq!(super::replay_flag("aws_sqs"), " --sqs ENDPOINT");
        assert_eq!(super::replay_flag("http"), "");
        assert_eq!(super::replay_flag("idem"), " --log-dir DIR");
    }

    use super::*;

    #[test]
    fn trips_on_the_same_reason_in_a_row_only() {
        let breaker = Breaker::new(KillSwitch { threshold: 3, pause: Duration::from_secs(60) });
        assert_eq!(breaker.failed("a").0, Verdict::DeadLetter);
        assert_eq!(breaker.failed("b").0, Verdict::DeadLetter);
        assert_eq!(breaker.failed("b").0, Verdict::DeadLetter);
        let before = Instant::now();
        breaker.succeeded(Instant::now());
        assert_eq!(breaker.failed("b").0, Verdict::DeadLetter);
        breaker.succeeded(before);
        assert_eq!(breaker.failed("b").0, Verdict::DeadLetter, "a success that began before the streak resets nothing");
        assert_eq!(breaker.failed("b"), (Verdict::Hold, true));
        assert!(breaker.open());
        assert_eq!(breaker.failed("c"), (Verdict::Hold, false), "open: everything holds");
        breaker.resume();
        assert!(!breaker.open());
        assert_eq!(breaker.failed("b"), (Verdict::Hold, true), "the same failure after a resume trips at once");
        breaker.resume();
        breaker.succeeded(Instant::now());
        assert_eq!(breaker.failed("b").0, Verdict::DeadLetter);
        assert_eq!(breaker.trips(), 2);
        let off = Breaker::new(KillSwitch::off());
        assert!((0..100).all(|_| off.failed("x").0 == Verdict::DeadLetter));
    }
}
