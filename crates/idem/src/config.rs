//! Consumer configuration, validated before anything starts.

use std::time::Duration;

use crate::backoff::Backoff;
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
    /// the marker; larger batches commit less often. Default 100.
    pub batch_size: usize,
    /// Attempts for a batch that fails with a retryable handler error before the message is dead-lettered.
    /// Database outages are retried without limit (the dead-letter write would fail as well). Default 10
    /// (about 16 s of backoff with the default delays, so lock contention passes before anything is dead-lettered).
    pub max_attempts: u32,
    /// Delays between attempts, after a database outage and after a source failure: doubling from 50 ms up to
    /// 5 s by default.
    pub backoff: Backoff,
    /// Table names (schema and prefix).
    pub tables: Tables,
    /// How markers are pruned.
    pub pruning: Pruning,
    /// What to do with an event whose id was already used by a different payload. Default: skip it.
    pub id_reuse: IdReusePolicy,
    /// How often the consumer refreshes the marker gauges (`idem_processed_events_rows`,
    /// `idem_processed_events_oldest_age_seconds`, `idem_dead_letters_stored`) with a count. Default 60 s.
    pub stats_interval: Duration,
    /// How the marker table is laid out: one plain table (the default) or day/month partitions (PostgreSQL).
    pub layout: MarkerLayout,
    /// When a run of identical permanent failures holds the consumer instead of dead-lettering (default: 20 in a
    /// row, 30 s pause; see [`crate::kill_switch`]).
    pub kill_switch: crate::kill_switch::KillSwitch,
    /// What decides that an event was applied already: idem's marker (the default) or the handler's own unique
    /// insert ([`Dedup::NaturalKey`]).
    pub dedup: Dedup,
    /// How long a partition may hold work without a commit before it counts as stalled: logged at WARN, shown by
    /// the gauge `idem_partition_stalled_seconds` and by [`crate::Engine::health`] (and `/readyz`). Default 60 s.
    pub stall_after: Duration,
    /// The second retry tier: after `max_attempts` immediate attempts, a message still failing with a retryable
    /// error is parked in the database and acknowledged, and tried again on this schedule (see
    /// [`crate::delayed_retry`]). `None` (the default): it is dead-lettered at once.
    pub delayed_retries: Option<crate::delayed_retry::DelayedRetries>,
}

/// What decides that an event was applied already.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dedup {
    /// A marker row per event in `processed_events`, inserted first in the handler's transaction.
    #[default]
    Markers,
    /// No marker: the handler's effect is itself an insert under a fixed id ("natural key
    /// idempotency"), for example `INSERT INTO orders (id, …) VALUES (…) ON CONFLICT (id) DO NOTHING`. The handler
    /// marks the event [`crate::Handled::AlreadyApplied`] when its insert found the row, so the event is counted
    /// `duplicate`; acknowledgement still comes after the commit. Safe only when the whole effect is that one
    /// insert (or writes that can run twice): a second delivery runs the handler again, so an `UPDATE … SET
    /// balance = balance + 1` beside the insert would be applied twice. Not for the Sequential Inbox (which
    /// claims its own rows) and without `id_reused` detection (there is no stored payload digest).
    NaturalKey,
}

/// The layout of the marker table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MarkerLayout {
    /// One table with the primary key `(consumer_group, event_id)`: a duplicate is caught however late it comes.
    #[default]
    Plain,
    /// Range partitions by day or month (PostgreSQL only), dropped whole when they pass the retention
    /// See [`Partitioning`] for what it costs.
    Partitioned(Partitioning),
}

/// The partitioned marker layout. The primary key becomes `(consumer_group, event_id, processed_on)`, so
/// a partition alone catches duplicates only within itself; the claim also looks into the partition before
/// for markers younger than `redelivery_window`. A redelivery later than the window after the first delivery
/// is not caught: use this layout only when the broker cannot redeliver later than that (a consumer reset to
/// the earliest offset can: the plain layout catches such replays, this one does not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partitioning {
    /// One partition per UTC day or month.
    pub period: PartitionPeriod,
    /// The longest time between two deliveries of one event. Must be shorter than one partition.
    pub redelivery_window: Duration,
    /// Partitions created ahead of the current one, by the consumer and by `idem prune`. Default 7.
    pub create_ahead: u32,
}

/// The span of one marker partition, in UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartitionPeriod {
    /// One partition per day.
    Day,
    /// One partition per calendar month.
    Month,
}

impl PartitionPeriod {
    /// `day` or `month`: the unit PostgreSQL's `date_trunc` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            PartitionPeriod::Day => "day",
            PartitionPeriod::Month => "month",
        }
    }

    /// The shortest partition of this period (a day; February's 28 days).
    pub fn shortest(self) -> Duration {
        match self {
            PartitionPeriod::Day => Duration::from_secs(86_400),
            PartitionPeriod::Month => Duration::from_secs(28 * 86_400),
        }
    }

    /// Parses `day` or `month`.
    pub fn parse(text: &str) -> Result<Self, Error> {
        match text {
            "day" => Ok(PartitionPeriod::Day),
            "month" => Ok(PartitionPeriod::Month),
            other => Err(Error::Config(format!("partition period `{other}`: use `day` or `month`"))),
        }
    }
}

/// The handling of a producer's reused event id (the same id for a different event): the marker keeps a digest of the
/// payload, and a "duplicate" whose payload differs is a different event under the same id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IdReusePolicy {
    /// Do not apply it; count it (`id_reused`) and log it at WARN with both positions.
    #[default]
    Skip,
    /// Also store it in the dead-letter table, where an operator can replay it to apply it.
    DeadLetter,
}

/// How markers are pruned: in bounded batches, never in one unbounded `DELETE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pruning {
    /// Markers older than this are deleted; `None` (the default) keeps them forever. Must exceed how long the
    /// broker can redeliver: on Kafka, the retention guard refuses to start below 1.1 × the topic's
    /// `retention.ms`.
    pub retention: Option<Duration>,
    /// How often the consumer's background pruner runs (it runs whenever a retention is set). Default 5 min.
    pub interval: Duration,
    /// Rows deleted per statement, at most. Default 10,000.
    pub batch_size: u32,
    /// How long one statement should take: each statement's size follows from the last one's rows per second,
    /// so that no statement holds its rows' locks and the server's write path much longer than this while a
    /// consumer runs beside it. The first deletes at most 1,000 rows, a size at most doubles from one statement to
    /// the next, and it stays within 100 (or `batch_size`, if lower) and `batch_size`. Default 100 ms; `None`:
    /// every statement deletes up to `batch_size`.
    pub statement_target: Option<Duration>,
    /// Pause between two statements, so the consumer keeps the table. Default 200 ms.
    pub pause: Duration,
    /// Discarded dead letters stay in the archive this long, then the background pruner deletes them
    /// (`idem prune --archive-expiry` in one pass). Default 30 days; under a day is refused.
    pub archive_expiry: Duration,
}

impl Default for Pruning {
    fn default() -> Self {
        Pruning {
            retention: None,
            interval: Duration::from_secs(300),
            batch_size: 10_000,
            statement_target: Some(Duration::from_millis(100)),
            pause: Duration::from_millis(200),
            archive_expiry: Duration::from_secs(30 * 86_400),
        }
    }
}

impl Config {
    /// A configuration with the defaults for everything but the group and the key.
    pub fn new(group: impl Into<String>, key: KeyExtractor) -> Self {
        Config {
            group: group.into(),
            key,
            batch_size: 100,
            max_attempts: 10,
            backoff: Backoff::new(Duration::from_millis(50), Duration::from_secs(5)),
            tables: Tables::default(),
            pruning: Pruning::default(),
            stats_interval: Duration::from_secs(60),
            id_reuse: IdReusePolicy::Skip,
            layout: MarkerLayout::Plain,
            kill_switch: crate::kill_switch::KillSwitch::default(),
            dedup: Dedup::Markers,
            stall_after: Duration::from_secs(60),
            delayed_retries: None,
        }
    }

    /// Lets the handler's own unique insert decide what was applied, without a marker row (see
    /// [`Dedup::NaturalKey`] for when this is safe).
    pub fn natural_key(mut self) -> Self {
        self.dedup = Dedup::NaturalKey;
        self
    }

    /// Uses the partitioned marker layout (PostgreSQL): one partition per `period`, duplicates caught across a
    /// partition boundary up to `redelivery_window` (see [`Partitioning`]). The table is converted with
    /// `idem markers convert --to partitioned`.
    pub fn partitioned(mut self, period: PartitionPeriod, redelivery_window: Duration) -> Self {
        self.layout = MarkerLayout::Partitioned(Partitioning { period, redelivery_window, create_ahead: 7 });
        self
    }

    /// Sets the kill switch ([`crate::KillSwitch::off`] dead-letters every failing message, however many).
    pub fn kill_switch(mut self, kill_switch: crate::kill_switch::KillSwitch) -> Self {
        self.kill_switch = kill_switch;
        self
    }

    /// Keeps markers for `retention`, pruning older ones in the background (see [`Pruning`]).
    pub fn marker_retention(mut self, retention: Duration) -> Self {
        self.pruning.retention = Some(retention);
        self
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
        self.backoff = Backoff::new(initial, max);
        self
    }

    /// Sets [`Config::stall_after`].
    pub fn stall_after(mut self, after: Duration) -> Self {
        self.stall_after = after;
        self
    }

    /// Parks a message that still fails after the immediate retries and tries it again on `retries`' schedule,
    /// keeping its key's order (see [`crate::delayed_retry`]).
    pub fn delayed_retries(mut self, retries: crate::delayed_retry::DelayedRetries) -> Self {
        self.delayed_retries = Some(retries);
        self
    }

    /// Sets [`Config::id_reuse`].
    pub fn id_reuse(mut self, policy: IdReusePolicy) -> Self {
        self.id_reuse = policy;
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
        if self.stall_after.is_zero() {
            return Err(Error::Config(
                "stall_after = 0 would call every partition with work stalled: use a duration such as 60s".into(),
            ));
        }
        if self.max_attempts == 0 {
            return Err(Error::Config("max_attempts = 0: use at least 1".into()));
        }
        self.backoff.validate("backoff")?;
        if let Some(retries) = &self.delayed_retries {
            retries.validate()?;
        }
        if self.pruning.retention.is_some_and(|r| r < Duration::from_secs(60)) {
            return Err(Error::Config(
                "pruning.retention is under a minute: keep markers longer than the broker can redeliver (e.g. 8 days)"
                    .into(),
            ));
        }
        if self.pruning.archive_expiry < Duration::from_secs(86_400) {
            return Err(Error::Config(
                "pruning.archive_expiry (dead_letter_archive_expiry) is under a day: the archive is the record of \
                 which dead letters were discarded, by whom and why; keep it at least a day (default 30 days)"
                    .into(),
            ));
        }
        if self.pruning.batch_size == 0 || self.pruning.batch_size > 1_000_000 {
            return Err(Error::Config(format!(
                "pruning.batch_size = {} is out of range: use 1 to 1000000 (default 10000)",
                self.pruning.batch_size
            )));
        }
        if self.stats_interval.is_zero() {
            return Err(Error::Config("stats_interval is zero: use e.g. 60 seconds".into()));
        }
        if self.pruning.interval.is_zero() {
            return Err(Error::Config("pruning.interval is zero: use e.g. 5 minutes".into()));
        }
        if let MarkerLayout::Partitioned(p) = self.layout {
            p.validate()?;
            if self.pruning.retention.is_some_and(|r| r <= p.redelivery_window) {
                return Err(Error::Config(
                    "pruning.retention is not longer than layout.redelivery_window: the claim looks into partitions \
                     the pruning would drop. Keep markers longer than the broker can redeliver"
                        .into(),
                ));
            }
            if self.tables.prefix().len() > 37 {
                return Err(Error::Config(format!(
                    "table_prefix `{}` is too long for partition names (processed_events_pYYYYMMDD after it must fit \
                     PostgreSQL's 63 characters): use at most 37 characters",
                    self.tables.prefix()
                )));
            }
        }
        Ok(())
    }
}

impl Partitioning {
    /// Refuses a window that is not shorter than one partition, and a partition count out of range.
    pub fn validate(&self) -> Result<(), Error> {
        let period = self.period.as_str();
        if self.redelivery_window.is_zero() || self.redelivery_window >= self.period.shortest() {
            return Err(Error::Config(format!(
                "layout: redelivery_window {}s is not shorter than one {period} partition ({}s): the claim looks into \
                 the neighbouring partitions only, so a later redelivery would not be caught. Use month partitions, or \
                 the plain layout",
                self.redelivery_window.as_secs(),
                self.period.shortest().as_secs()
            )));
        }
        if self.create_ahead == 0 || self.create_ahead > 366 {
            return Err(Error::Config(format!(
                "layout: create_ahead = {} is out of range: use 1 to 366 partitions (default 7)",
                self.create_ahead
            )));
        }
        Ok(())
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
        let mut short = config();
        short.pruning.archive_expiry = Duration::from_secs(60);
        assert!(short.validate().unwrap_err().to_string().contains("archive_expiry"));
    }

    #[test]
    fn partitions_must_be_longer_than_the_redelivery_window() {
        let hour = Duration::from_secs(3_600);
        config().partitioned(PartitionPeriod::Day, hour).validate().unwrap();
        let err = config().partitioned(PartitionPeriod::Day, 24 * hour).validate().unwrap_err().to_string();
        assert!(err.contains("redelivery_window") && err.contains("day"), "{err}");
        config().partitioned(PartitionPeriod::Month, 24 * hour).validate().unwrap();
        assert!(config().partitioned(PartitionPeriod::Month, 28 * 24 * hour).validate().is_err());
        assert!(config().partitioned(PartitionPeriod::Day, Duration::ZERO).validate().is_err());
    }
}
