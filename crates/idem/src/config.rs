//! Consumer configuration, validated before anything starts.

use std::time::Duration;

use crate::error::Error;
use crate::key::KeyExtractor;
use crate::store::Tables;

/// How the engine consumes: the group, the key, batching and retries.
#[derive(Debug, Clone)]
pub struct Config {
    /// The consumer group; markers are stored under it, so two groups of one topic do not shadow each other.
    pub group: String,
    /// Where the idempotency key comes from.
    pub key: KeyExtractor,
    /// Messages of one partition handled in one transaction. 1 gives the strict per-message transaction of
    /// document 000; larger batches commit less often. Default 100.
    pub batch_size: usize,
    /// Attempts for a batch that fails with a retryable handler error before the message is dead-lettered.
    /// Database outages are retried without limit (the dead-letter write would fail as well). Default 5.
    pub max_attempts: u32,
    /// First retry delay; doubles with each attempt. Default 50 ms.
    pub backoff_initial: Duration,
    /// Longest retry delay. Default 5 s.
    pub backoff_max: Duration,
    /// Table names (schema and prefix).
    pub tables: Tables,
}

impl Config {
    /// A configuration with the defaults for everything but the group and the key.
    pub fn new(group: impl Into<String>, key: KeyExtractor) -> Self {
        Config {
            group: group.into(),
            key,
            batch_size: 100,
            max_attempts: 5,
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
            tables: Tables::default(),
        }
    }

    /// Sets [`Config::batch_size`].
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Sets [`Config::max_attempts`].
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }

    /// Sets the retry delays.
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.backoff_initial = initial;
        self.backoff_max = max;
        self
    }

    /// Sets [`Config::tables`].
    pub fn tables(mut self, tables: Tables) -> Self {
        self.tables = tables;
        self
    }

    /// Refuses a configuration that cannot work, naming the field and the fix.
    pub fn validate(&self) -> Result<(), Error> {
        if self.group.trim().is_empty() || self.group.len() > 200 {
            return Err(Error::Config("group must be a non-empty name of at most 200 characters".into()));
        }
        if self.batch_size == 0 || self.batch_size > 10_000 {
            return Err(Error::Config(format!(
                "batch_size = {} is out of range: use 1 (one transaction per message) up to 10000",
                self.batch_size
            )));
        }
        if self.max_attempts == 0 {
            return Err(Error::Config("max_attempts = 0: use at least 1".into()));
        }
        if self.backoff_initial.is_zero() || self.backoff_initial > self.backoff_max {
            return Err(Error::Config(format!(
                "backoff: initial {:?} must be above zero and at most the maximum {:?}",
                self.backoff_initial, self.backoff_max
            )));
        }
        Ok(())
    }

    /// The delay before retry number `attempt` (1-based): doubling from the initial delay, capped.
    pub(crate) fn backoff_for(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.saturating_sub(1).min(20)).unwrap_or(u32::MAX);
        self.backoff_initial.saturating_mul(factor).min(self.backoff_max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config::new("g", KeyExtractor::BrokerId)
    }

    #[test]
    fn defaults_validate() {
        config().validate().unwrap();
    }

    #[test]
    fn bad_values_name_the_field() {
        assert!(config().batch_size(0).validate().unwrap_err().to_string().contains("batch_size"));
        assert!(config().max_attempts(0).validate().unwrap_err().to_string().contains("max_attempts"));
        assert!(Config::new(" ", KeyExtractor::BrokerId).validate().unwrap_err().to_string().contains("group"));
        let err = config().backoff(Duration::from_secs(9), Duration::from_secs(1)).validate().unwrap_err();
        assert!(err.to_string().contains("backoff"));
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let c = config().backoff(Duration::from_millis(10), Duration::from_millis(50));
        assert_eq!(c.backoff_for(1), Duration::from_millis(10));
        assert_eq!(c.backoff_for(2), Duration::from_millis(20));
        assert_eq!(c.backoff_for(3), Duration::from_millis(40));
        assert_eq!(c.backoff_for(4), Duration::from_millis(50));
        assert_eq!(c.backoff_for(400), Duration::from_millis(50));
    }
}
