//! Delayed retries: the second tier of retry, after the immediate one.
//!
//! A message whose handler still fails with a retryable error after `max_attempts` immediate retries is not
//! dead-lettered at once when the consumer has a [`DelayedRetries`] schedule: it is **parked**, a row in idem's
//! `parked_messages` table written in one transaction, and acknowledged, so its partition goes on. Each delay of
//! the schedule later (with ±10 % jitter) the parked message goes through the same pipeline as a fresh one
//! (marker claim, handler, commit) and leaves the table in the transaction that applies it. After the last delay
//! it becomes a dead letter whose reason carries its history.
//!
//! **Order per key.** While a message key has a parked message, the later messages of that key are parked behind
//! it in arrival order and released in that order once it succeeds (or is dead-lettered); other keys flow at full
//! speed. A message without a broker key parks alone. [`ParkOrder::None`] parks only the failing message, for
//! consumers that do not need per-key order.
//!
//! Consumers of one group on several processes share the parked work: a parked message is leased (its next due
//! time written first, in a transaction of its own) before it is tried, so two schedulers never try it at once,
//! and a process killed during a try leaves it due again at its next delay. The marker decides, as everywhere,
//! that it is applied once.

use std::time::Duration;

use crate::error::Error;
use crate::store::parking::ParkedMessage;
use crate::store::{Backend, NewDeadLetter, Tables};

/// The delays of the second retry tier and whether later messages of a parked key wait behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DelayedRetries {
    /// The delay before each delayed retry, in order (for example 10 s, 1 min, 10 min, 1 h); each is applied with
    /// ±10 % jitter. After the last one fails, the message is dead-lettered.
    pub schedule: Vec<Duration>,
    /// Whether the later messages of a parked message's key wait behind it (the default) or flow on.
    pub order: ParkOrder,
}

/// Whether later messages of a key wait behind its parked message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ParkOrder {
    /// Later messages with the same broker key are parked behind it and released in arrival order (the default).
    #[default]
    Key,
    /// Only the failing message is parked; later messages of its key are applied before it.
    None,
}

impl ParkOrder {
    /// Parses `key` or `none`, as a configuration file writes it.
    pub fn parse(text: &str) -> Result<Self, Error> {
        match text.trim() {
            "key" => Ok(ParkOrder::Key),
            "none" => Ok(ParkOrder::None),
            other => Err(Error::Config(format!(
                "delayed_retries.order = `{other}`: use \"key\" (later messages of a parked key wait behind it) or \
                 \"none\""
            ))),
        }
    }
}

/// The longest single delay: a message parked longer than this is better dead-lettered and replayed.
const LONGEST: Duration = Duration::from_secs(7 * 86_400);

impl DelayedRetries {
    /// A schedule in the default order (per key).
    pub fn new(schedule: impl IntoIterator<Item = Duration>) -> Self {
        DelayedRetries { schedule: schedule.into_iter().collect(), order: ParkOrder::Key }
    }

    /// Parses delays as a configuration file writes them (`["10s", "1m", "10m", "1h"]`).
    pub fn parse<S: AsRef<str>>(schedule: &[S]) -> Result<Self, Error> {
        let delays = schedule
            .iter()
            .map(|text| {
                crate::duration::parse(text.as_ref())
                    .map_err(|e| Error::Config(format!("delayed_retries.schedule: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let retries = DelayedRetries::new(delays);
        retries.validate()?;
        Ok(retries)
    }

    /// Sets [`DelayedRetries::order`].
    pub fn order(mut self, order: ParkOrder) -> Self {
        self.order = order;
        self
    }

    /// Refuses an empty schedule and delays under a second or over a week.
    pub fn validate(&self) -> Result<(), Error> {
        if self.schedule.is_empty() {
            return Err(Error::Config(
                "delayed_retries.schedule is empty: give at least one delay, e.g. [\"10s\", \"1m\", \"10m\", \"1h\"], or \
                 leave delayed retries out"
                    .into(),
            ));
        }
        for delay in &self.schedule {
            if *delay < Duration::from_secs(1) || *delay > LONGEST {
                return Err(Error::Config(format!(
                    "delayed_retries.schedule has {delay:?}: each delay must be from 1s to 7d (the immediate retries \
                     cover shorter waits; dead-letter and replay what needs longer)"
                )));
            }
        }
        Ok(())
    }

    /// The delay before delayed retry number `done + 1` (`done` made so far), jittered by ±10 % with `seed`;
    /// `None` when the schedule is used up.
    pub fn next_delay(&self, done: u32, seed: u64) -> Option<Duration> {
        let base = *self.schedule.get(usize::try_from(done).ok()?)?;
        // A cheap, well-spread number in [0, 1) from the seed (splitmix64's finaliser).
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let unit = (z >> 11) as f64 / (1u64 << 53) as f64;
        Some(base.mul_f64(0.9 + 0.2 * unit))
    }
}

/// Parked messages, in arrival order (of `group` only, when given), at most `limit`: `idem parked list`.
pub async fn list<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    group: Option<&str>,
    limit: i64,
) -> Result<Vec<ParkedMessage>, Error> {
    DB::parked(pool, tables, group, limit).await
}

/// Makes parked messages due now (`id`, or every one of `group`, or every one): a running consumer tries them at
/// its next look, each key still in order (only a key's first parked message is tried; the others follow it).
/// Returns how many were made due. `idem parked retry-now`.
pub async fn retry_now<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    group: Option<&str>,
    id: Option<i64>,
) -> Result<u64, Error> {
    Ok(DB::retry_parked_now(pool, tables, group, id, crate::engine::now_ms()).await?)
}

/// Discards parked message `id`: in one transaction it leaves the parked table and becomes a dead letter whose
/// reason says who discarded it and why, with its last error and history (kept, listed and replayable like any
/// dead letter; never deleted silently). The next message of its key goes on. `false` when it is gone already.
/// `idem parked discard`.
pub async fn discard<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    id: i64,
    by: &str,
    why: &str,
) -> Result<bool, Error> {
    let mut tx = pool.begin().await?;
    let Some(parked) = DB::parked_by_id(&mut tx, tables, id).await? else {
        return Ok(false);
    };
    let reason = format!(
        "discarded from the parked messages by {by}: {why} (last error: {}; {} attempts, {} delayed retries; \
         history: {})",
        parked.error.as_deref().unwrap_or("none, it waited behind its key"),
        parked.attempts,
        parked.delayed_retries,
        parked.history.trim_end().replace('\n', " ")
    );
    let message = parked.message();
    let letter = NewDeadLetter {
        event_id: Some(&parked.event_id),
        message: &message,
        error: &reason,
        attempts: parked.attempts,
    };
    DB::unpark(&mut tx, tables, id).await?;
    DB::dead_letter(&mut tx, tables, &parked.consumer_group, &letter).await?;
    tx.commit().await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_parses_and_bad_ones_name_the_fix() {
        let retries = DelayedRetries::parse(&["10s", "1m", "1h"]).expect("valid");
        assert_eq!(retries.schedule, [10, 60, 3_600].map(Duration::from_secs));
        let empty: [&str; 0] = [];
        assert!(DelayedRetries::parse(&empty).unwrap_err().to_string().contains("is empty"));
        assert!(DelayedRetries::parse(&["10"]).unwrap_err().to_string().contains("delayed_retries.schedule"));
        assert!(DelayedRetries::parse(&["100ms"]).unwrap_err().to_string().contains("from 1s to 7d"));
        assert!(DelayedRetries::parse(&["8d"]).unwrap_err().to_string().contains("from 1s to 7d"));
        assert!(ParkOrder::parse("per-key").unwrap_err().to_string().contains("\"key\""));
    }

    #[test]
    fn delays_are_jittered_within_ten_percent_and_run_out() {
        let retries = DelayedRetries::new([Duration::from_secs(100), Duration::from_secs(1_000)]);
        let mut seen = std::collections::HashSet::new();
        for seed in 0..500 {
            let first = retries.next_delay(0, seed).expect("first");
            assert!(first >= Duration::from_secs(90) && first <= Duration::from_secs(110), "{first:?}");
            seen.insert(first.as_millis() / 1_000);
            let second = retries.next_delay(1, seed).expect("second");
            assert!(second >= Duration::from_secs(900) && second <= Duration::from_secs(1_100), "{second:?}");
        }
        assert!(seen.len() > 10, "the jitter spreads the delays: {seen:?}");
        assert_eq!(retries.next_delay(2, 7), None);
    }
}
