//! The one backoff of idem: doubling delays from a first delay up to a cap, between the attempts of a handler,
//! after a database outage or a source failure, between the relay's deliveries, and between a source's own
//! retries of a broker call; and the one sleep that a stop cuts short.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::error::Error;

/// Doubling delays between attempts: `first` after the first failure, twice that after the second, and so on,
/// never more than `cap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The delay after the first failed attempt; above zero.
    pub first: Duration,
    /// The longest delay; at least `first`.
    pub cap: Duration,
}

impl Backoff {
    /// Delays doubling from `first` up to `cap`.
    pub const fn new(first: Duration, cap: Duration) -> Self {
        Backoff { first, cap }
    }

    /// The delay after `failures` failed attempts in a row (1-based; 0 counts as 1).
    pub fn after(&self, failures: u32) -> Duration {
        let factor = 1u32.checked_shl(failures.saturating_sub(1).min(20)).unwrap_or(u32::MAX);
        self.first.saturating_mul(factor).min(self.cap)
    }

    /// Refuses a first delay of zero or above the cap, naming `setting` (the configuration it came from).
    pub fn validate(&self, setting: &str) -> Result<(), Error> {
        if self.first.is_zero() || self.first > self.cap {
            return Err(Error::Config(format!(
                "{setting}: the first delay {:?} must be above zero and at most the cap {:?}",
                self.first, self.cap
            )));
        }
        Ok(())
    }
}

/// Sleeps for `delay` unless `stop` completes first; true when it did (the caller stops instead of retrying).
pub(crate) async fn sleep_unless_stopped<F: Future + ?Sized>(delay: Duration, stop: Pin<&mut F>) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(delay) => false,
        _ = stop => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_the_first_delay_and_stops_at_the_cap() {
        let backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(50));
        let delays: Vec<u128> = [0, 1, 2, 3, 4, 400, u32::MAX].iter().map(|n| backoff.after(*n).as_millis()).collect();
        assert_eq!(delays, [10, 10, 20, 40, 50, 50, 50]);
    }

    #[test]
    fn a_zero_or_inverted_backoff_is_refused_with_its_setting() {
        let zero = Backoff::new(Duration::ZERO, Duration::from_secs(1)).validate("relay backoff");
        assert!(zero.unwrap_err().to_string().contains("relay backoff"));
        assert!(Backoff::new(Duration::from_secs(9), Duration::from_secs(1)).validate("x").is_err());
        assert!(Backoff::new(Duration::from_secs(1), Duration::from_secs(1)).validate("x").is_ok());
    }

    #[tokio::test]
    async fn a_stop_cuts_the_sleep_short() {
        let stop = std::pin::pin!(async {});
        let started = std::time::Instant::now();
        assert!(sleep_unless_stopped(Duration::from_secs(30), stop).await);
        assert!(started.elapsed() < Duration::from_secs(5));
        let never = std::pin::pin!(std::future::pending::<()>());
        assert!(!sleep_unless_stopped(Duration::from_millis(5), never).await);
    }
}
