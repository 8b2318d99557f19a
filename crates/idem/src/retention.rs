//! The retention guard: markers must outlive the broker's retention, or a
//! consumer reset to the earliest offset replays events whose markers are gone and applies them again. One guard
//! for every broker that keeps messages for a while (Kafka's topics, NATS JetStream's streams), each named as its
//! broker names it ([`BrokerRetention`]).

use std::time::Duration;

use crate::error::Error;

/// The margin markers must keep over the broker's retention.
pub const MARGIN: f64 = 1.1;

/// How a broker names what it keeps and for how long, so the guard's messages speak its language.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BrokerRetention {
    /// What keeps messages: `topic`, `stream`.
    pub holder: &'static str,
    /// The setting that says for how long: `retention.ms`, `max_age`.
    pub setting: &'static str,
    /// How the setting reads when messages are kept forever: `retention.ms=-1`, `max_age=0`.
    pub forever: &'static str,
    /// The idem setting that accepts pruned markers against such a holder.
    pub accept_forever: &'static str,
}

/// Kafka's topics.
pub const KAFKA_TOPIC: BrokerRetention = BrokerRetention {
    holder: "topic",
    setting: "retention.ms",
    forever: "retention.ms=-1",
    accept_forever: "accept_infinite_topic_retention",
};

/// NATS JetStream's streams.
pub const JETSTREAM_STREAM: BrokerRetention = BrokerRetention {
    holder: "stream",
    setting: "max_age",
    forever: "max_age=0",
    accept_forever: "accept_infinite_stream_retention",
};

/// What the guard compares against the broker: the engine's marker retention
/// ([`crate::config::Pruning::retention`]) and an explicit override for topics that keep messages forever.
#[derive(Debug, Clone)]
pub struct RetentionPolicy {
    /// How long markers are kept before pruning; `None` means they are never pruned.
    pub marker_retention: Option<Duration>,
    /// Accept pruned markers against a topic or stream that keeps messages forever. Logged at WARN.
    pub accept_infinite_retention: bool,
    /// How the broker names its retention.
    pub broker: BrokerRetention,
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        RetentionPolicy { marker_retention: None, accept_infinite_retention: false, broker: KAFKA_TOPIC }
    }
}

/// The guard's verdict on one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Safe.
    Pass,
    /// Allowed, but an operator should know (unknown retention, overridden infinite retention).
    Warn(String),
    /// Refused: start-up stops with this message.
    Refuse(String),
}

impl RetentionPolicy {
    /// Judges `name` (a topic, a stream) whose retention is `broker_ms` milliseconds (negative: forever;
    /// `None`: the broker did not say).
    pub fn judge(&self, name: &str, broker_ms: Option<i64>) -> Verdict {
        let BrokerRetention { holder, setting, forever, accept_forever } = self.broker;
        let markers = self.marker_retention;
        let Some(broker_ms) = broker_ms else {
            return Verdict::Warn(format!(
                "{holder} {name}: the broker did not report {setting}, so marker retention ({}) cannot be checked \
                 against it; set {setting} on the {holder} explicitly",
                describe(markers)
            ));
        };
        if broker_ms < 0 {
            return match markers {
                None => Verdict::Pass,
                Some(_) if self.accept_infinite_retention => Verdict::Warn(format!(
                    "{holder} {name} keeps messages forever ({forever}) but markers are pruned after {}: a reset \
                     to the earliest message would re-apply older events (accepted by override)",
                    describe(markers)
                )),
                Some(_) => Verdict::Refuse(format!(
                    "{holder} {name} keeps messages forever ({forever}) but markers are pruned after {}: a reset \
                     to the earliest message would re-apply every older event. Fix: never prune markers \
                     (marker_retention = none), give the {holder} a finite {setting}, or accept the risk explicitly \
                     ({accept_forever})",
                    describe(markers)
                )),
            };
        }
        let broker = Duration::from_millis(broker_ms as u64);
        match markers {
            None => Verdict::Pass,
            Some(kept) if kept.as_secs_f64() >= broker.as_secs_f64() * MARGIN => Verdict::Pass,
            Some(kept) => {
                let needed = Duration::from_secs_f64(broker.as_secs_f64() * MARGIN);
                Verdict::Refuse(format!(
                    "marker retention {} is below {MARGIN} × the {setting} of {holder} {name} ({}): a consumer reset \
                     to the earliest message would replay events whose markers were pruned and apply them twice. \
                     Fix: keep markers at least {} (or shorten the {holder}'s {setting})",
                    human(kept),
                    human(broker),
                    human(needed)
                ))
            }
        }
    }

    /// Judges every topic or stream: the first refusal is an error; warnings are logged.
    pub fn check(&self, holders: &[(String, Option<i64>)]) -> Result<(), Error> {
        for (name, broker_ms) in holders {
            match self.judge(name, *broker_ms) {
                Verdict::Pass => tracing::info!(name, broker_retention_ms = ?broker_ms, "retention guard passed"),
                Verdict::Warn(message) => tracing::warn!(name, "{message}"),
                Verdict::Refuse(message) => return Err(Error::Config(format!("retention guard: {message}"))),
            }
        }
        Ok(())
    }
}

fn describe(markers: Option<Duration>) -> String {
    markers.map_or("never pruned".to_owned(), human)
}

fn human(d: Duration) -> String {
    let hours = d.as_secs_f64() / 3600.0;
    if hours >= 48.0 { format!("{:.1} days", hours / 24.0) } else { format!("{hours:.1} hours") }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: u64 = 86_400;
    const WEEK_MS: i64 = 7 * 86_400_000;

    fn policy(days: Option<u64>) -> RetentionPolicy {
        RetentionPolicy { marker_retention: days.map(|d| Duration::from_secs(d * DAY)), ..Default::default() }
    }

    #[test]
    fn three_days_against_seven_is_refused_with_both_values_and_the_fix() {
        let Verdict::Refuse(message) = policy(Some(3)).judge("payments", Some(WEEK_MS)) else { panic!() };
        assert!(
            message.contains("3.0 days") && message.contains("7.0 days") && message.contains("7.7 days"),
            "{message}"
        );
    }

    #[test]
    fn eight_days_against_seven_passes() {
        assert_eq!(policy(Some(8)).judge("payments", Some(WEEK_MS)), Verdict::Pass);
        assert!(matches!(policy(Some(7)).judge("payments", Some(WEEK_MS)), Verdict::Refuse(_)), "7 < 7.7");
    }

    #[test]
    fn infinite_topic_retention_needs_unpruned_markers_or_an_override() {
        assert_eq!(policy(None).judge("t", Some(-1)), Verdict::Pass);
        assert!(matches!(policy(Some(30)).judge("t", Some(-1)), Verdict::Refuse(m) if m.contains("retention.ms=-1")));
        let mut overridden = policy(Some(30));
        overridden.accept_infinite_retention = true;
        assert!(matches!(overridden.judge("t", Some(-1)), Verdict::Warn(_)));
    }

    #[test]
    fn a_stream_is_judged_in_jetstream_words() {
        let stream = RetentionPolicy { broker: JETSTREAM_STREAM, ..policy(Some(3)) };
        let Verdict::Refuse(message) = stream.judge("orders", Some(WEEK_MS)) else { panic!() };
        assert!(message.contains("max_age of stream orders") && message.contains("7.7 days"), "{message}");
        let Verdict::Refuse(message) = stream.judge("orders", Some(-1)) else { panic!() };
        assert!(message.contains("max_age=0") && message.contains("accept_infinite_stream_retention"), "{message}");
        assert_eq!(
            RetentionPolicy { broker: JETSTREAM_STREAM, ..policy(Some(8)) }.judge("o", Some(WEEK_MS)),
            Verdict::Pass
        );
    }

    #[test]
    fn unknown_retention_is_a_warning() {
        assert!(matches!(policy(Some(8)).judge("t", None), Verdict::Warn(m) if m.contains("retention.ms")));
        assert!(policy(Some(8)).check(&[("t".into(), None)]).is_ok());
        assert!(policy(Some(3)).check(&[("t".into(), Some(WEEK_MS))]).is_err());
    }
}
