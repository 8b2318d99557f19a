//! The one retry loop: an attempt is run again while a retry can help (a retryable handler error, up to
//! `max_attempts`; a database outage, without limit), with the consumer's doubling [`crate::Backoff`], and stops
//! at once when the consumer is told to stop, even in the middle of a backoff sleep.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::transaction::Failure;
use crate::config::Config;
use crate::error::{Error, HandlerError, Retry, classify};

/// Tells a consumer's workers to stop: they finish the transaction in hand, abandon any retry (unacknowledged,
/// so the work is delivered again) and wake from any backoff sleep. Cheap to clone; clones share the state.
#[derive(Debug, Clone, Default)]
pub(crate) struct Shutdown(Arc<ShutdownState>);

#[derive(Debug, Default)]
struct ShutdownState {
    triggered: AtomicBool,
    wake: tokio::sync::Notify,
}

impl Shutdown {
    /// Tells every holder of a clone to stop.
    pub(crate) fn trigger(&self) {
        self.0.triggered.store(true, Ordering::SeqCst);
        self.0.wake.notify_waiters();
    }

    /// Whether [`Shutdown::trigger`] was called.
    pub(crate) fn triggered(&self) -> bool {
        self.0.triggered.load(Ordering::SeqCst)
    }

    /// Sleeps for `delay`; [`Error::Stopped`] at once when told to stop, before or during the sleep.
    pub(crate) async fn sleep(&self, delay: Duration) -> Result<(), Error> {
        let woken = self.0.wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        if self.triggered() {
            return Err(Error::Stopped);
        }
        tokio::select! {
            _ = woken => Err(Error::Stopped),
            _ = tokio::time::sleep(delay) => Ok(()),
        }
    }
}

/// What is retried, for the log lines and the `retried` counter.
pub(crate) struct Retrying<'a> {
    /// The consumer group.
    pub group: &'a str,
    /// What an attempt does, as a log line says it: "the batch", "the message", "the dead letter".
    pub what: &'static str,
    /// The messages the attempt works on, named by every retry log line.
    pub subject: &'a dyn Subject,
    /// Called before each retry (the `retried` outcome's counter).
    pub on_retry: &'a (dyn Fn() + Sync),
}

/// The messages an attempt works on, as its log lines name them.
pub(crate) trait Subject: Sync {
    /// Message `at` of the attempt (the first when `None` or out of range), and how many the attempt holds.
    fn locate(&self, at: Option<usize>) -> (Located<'_>, usize);
}

/// Where one message is: its event id (empty when it has none), topic, partition and offset.
pub(crate) struct Located<'a> {
    pub event_id: &'a str,
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
}

/// One message and its event id, when it has one.
pub(crate) struct One<'a> {
    pub event_id: Option<&'a str>,
    pub message: &'a crate::message::Message,
}

impl Subject for One<'_> {
    fn locate(&self, _: Option<usize>) -> (Located<'_>, usize) {
        let m = self.message;
        let located = Located {
            event_id: self.event_id.unwrap_or(""),
            topic: &m.topic,
            partition: m.partition,
            offset: m.offset,
        };
        (located, 1)
    }
}

/// No message (a unit test's attempt).
#[cfg(test)]
impl Subject for () {
    fn locate(&self, _: Option<usize>) -> (Located<'_>, usize) {
        (Located { event_id: "", topic: "", partition: 0, offset: -1 }, 0)
    }
}

/// Runs `attempt` until it succeeds, a retry cannot help, or the consumer stops. What each [`Failure`] gets:
///
/// * a retryable handler error: retried up to `max_attempts`, then returned, still retryable (for the delayed
///   tier), as "gave up after N attempts: …";
/// * a transient error of idem's own statements (an outage): retried without limit, never counted against the
///   message;
/// * `Again` (the state the attempt read changed under it): run again at once, uncounted;
/// * anything else: returned as it is, with the attempts made. A stop, before or during a backoff sleep, returns
///   `Failure::Stopped`.
pub(crate) async fn retry<T, F>(
    config: &Config,
    shutdown: &Shutdown,
    retrying: &Retrying<'_>,
    mut attempt: impl FnMut() -> F,
) -> Result<T, (u32, Failure)>
where
    F: Future<Output = Result<T, Failure>>,
{
    // Only the call of the attempt is generic: what a failure gets, its log line and the sleep are written (and
    // compiled) once for every kind of attempt.
    let mut attempts = Attempts { config, shutdown, retrying, made: 0, outages: 0 };
    loop {
        attempts.made += 1;
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(failure) => attempts.after(failure).await?,
        }
    }
}

/// The count of one [`retry`]'s attempts and outages, and what it does after a failed attempt.
struct Attempts<'a> {
    config: &'a Config,
    shutdown: &'a Shutdown,
    retrying: &'a Retrying<'a>,
    made: u32,
    outages: u32,
}

impl Attempts<'_> {
    /// After the failed attempt: waits out the backoff when a retry can help, else returns what to give up with.
    async fn after(&mut self, failure: Failure) -> Result<(), (u32, Failure)> {
        let delay = self.delay(failure)?;
        if self.shutdown.triggered() {
            return Err((self.made, Failure::Stopped));
        }
        (self.retrying.on_retry)();
        if self.shutdown.sleep(delay).await.is_err() {
            return Err((self.made, Failure::Stopped));
        }
        Ok(())
    }

    /// How long to wait before the next attempt, or what to give up with.
    fn delay(&mut self, failure: Failure) -> Result<Duration, (u32, Failure)> {
        let (config, retrying) = (self.config, self.retrying);
        match failure {
            Failure::Again => {
                self.made -= 1;
                Ok(config.backoff.after(1))
            }
            Failure::Handler { at, error: HandlerError::Retryable(reason) } => {
                let attempts = self.made;
                if attempts >= config.max_attempts {
                    // Still retryable: a second tier (delayed retries) may take it from here.
                    let reason = format!("gave up after {attempts} attempts: {reason}");
                    return Err((attempts, Failure::Handler { at, error: HandlerError::Retryable(reason) }));
                }
                let delay = config.backoff.after(attempts);
                immediate_retry(retrying.group, "handler");
                let (at, messages) = retrying.subject.locate(at);
                tracing::warn!(
                    consumer_group = retrying.group,
                    event_id = at.event_id,
                    topic = at.topic,
                    partition = at.partition,
                    offset = at.offset,
                    messages,
                    reason,
                    attempt = attempts,
                    max_attempts = config.max_attempts,
                    ?delay,
                    "retryable handler error; retrying {} (its partition waits)",
                    retrying.what
                );
                Ok(delay)
            }
            Failure::Database(error) if classify(&error) == Retry::Helps => {
                self.made -= 1;
                self.outages += 1;
                let (delay, outages) = (config.backoff.after(self.outages), self.outages);
                immediate_retry(retrying.group, "database");
                let (at, messages) = retrying.subject.locate(None);
                tracing::warn!(
                    consumer_group = retrying.group,
                    event_id = at.event_id,
                    topic = at.topic,
                    partition = at.partition,
                    offset = at.offset,
                    messages,
                    %error,
                    ?delay,
                    outages,
                    "database unavailable; retrying {}",
                    retrying.what
                );
                Ok(delay)
            }
            failure => Err((self.made, failure)),
        }
    }
}

/// Counts one retry of the first tier: `idem_immediate_retries_total{consumer_group, cause}` (`handler`: a retryable
/// handler error; `database`: the database unavailable).
fn immediate_retry(group: &str, cause: &'static str) {
    metrics::counter!("idem_immediate_retries_total", "consumer_group" => group.to_owned(), "cause" => cause)
        .increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KeyExtractor;
    use std::time::Instant;

    fn config() -> Config {
        Config::new("g", KeyExtractor::BrokerId).max_attempts(3).backoff(Duration::from_secs(5), Duration::from_secs(5))
    }

    const QUIET: Retrying<'static> = Retrying { group: "g", what: "the test", subject: &(), on_retry: &|| {} };

    #[tokio::test]
    async fn a_stop_cuts_a_backoff_sleep_short() {
        let shutdown = Shutdown::default();
        let stopper = shutdown.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            stopper.trigger();
        });
        let started = Instant::now();
        let result: Result<(), _> =
            retry(&config(), &shutdown, &QUIET, || async { Err(Failure::Database(sqlx::Error::PoolTimedOut)) }).await;
        assert!(matches!(result, Err((_, Failure::Stopped))));
        assert!(started.elapsed() < Duration::from_secs(2), "stopped during a 5 s backoff: {:?}", started.elapsed());
    }

    #[tokio::test(start_paused = true)]
    async fn retryable_failures_are_capped_and_outages_are_not() {
        let shutdown = Shutdown::default();
        let mut calls = 0;
        let result: Result<(), _> = retry(&config(), &shutdown, &QUIET, || {
            calls += 1;
            let calls = calls;
            async move {
                // Two outages between the retryable failures: never counted against the message.
                if calls % 2 == 0 {
                    Err(Failure::Database(sqlx::Error::PoolTimedOut))
                } else {
                    Err(Failure::Handler { at: None, error: HandlerError::retryable("flaky") })
                }
            }
        })
        .await;
        match result {
            Err((attempts, Failure::Handler { error: HandlerError::Retryable(reason), .. })) => {
                assert_eq!(attempts, 3);
                assert!(reason.starts_with("gave up after 3 attempts"), "{reason}");
            }
            _ => panic!("expected to give up"),
        }
        assert_eq!(calls, 5);
    }
}
