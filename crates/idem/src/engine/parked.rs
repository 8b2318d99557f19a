//! Delayed retries in the engine (see [`crate::delayed_retry`]): parking a message that ran out of immediate
//! retries, parking the later messages of its key behind it, and the release loop that tries parked messages
//! again through the same transaction order as fresh ones.

use std::collections::HashSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::Engine;
use super::apply::Apply;
use super::batch::Item;
use super::outcome::Outcome;
use super::retry::{One, Retrying, Shutdown, retry};
use super::transaction::{End, Failure};
use crate::config::Dedup;
use crate::delayed_retry::{DelayedRetries, ParkOrder};
use crate::error::{Error, HandlerError};
use crate::message::Event;
use crate::store::parking::{NewParked, ParkedMessage, history_line};
use crate::store::{Backend, Claim, NewDeadLetter, payload_digest};

/// How often the release loop looks for due parked messages when the last look found none.
const POLL: Duration = Duration::from_secs(1);
/// How long the last delayed retry of a message is leased: a process killed during it leaves the message due
/// again after this.
const LAST_LEASE: Duration = Duration::from_secs(60);
/// Parked messages tried per look.
const PER_LOOK: i64 = 64;

/// Now, in milliseconds since the epoch: the clock of the parked table.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// The digest a message's broker key is parked under: the same key, the same digest.
fn order_key(item: &Item) -> Option<Vec<u8>> {
    match item {
        Item::Keyed(event) => event.message.key.as_deref().map(payload_digest),
        Item::Unkeyed { .. } => None,
    }
}

/// A jitter seed that differs between messages and between retries of one.
fn seed(event_id: &str, attempt: i64) -> u64 {
    let digest = payload_digest(event_id.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first) ^ (attempt as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The keys of a batch that have parked messages, grown as the batch parks more: a message whose key is in it
/// is parked behind the key's earlier ones.
#[derive(Default)]
pub(super) struct ParkedKeys(HashSet<Vec<u8>>);

impl ParkedKeys {
    /// The index of the first of `items` that must wait behind a parked message of its key.
    pub(super) fn blocks_any(&self, items: &[Item]) -> Option<usize> {
        if self.0.is_empty() {
            return None;
        }
        items.iter().position(|item| order_key(item).is_some_and(|key| self.0.contains(&key)))
    }
}

impl<DB: Backend> Engine<DB> {
    /// The delayed retries of this consumer, if it has them.
    pub(super) fn delayed_retries(&self) -> Option<&DelayedRetries> {
        self.inner.config.delayed_retries.as_ref()
    }

    /// The keys among `items` that have parked messages (none without per-key order); a database outage is
    /// waited for, as for any statement of the batch.
    pub(super) async fn parked_keys_of(&self, items: &[Item], shutdown: &Shutdown) -> Result<ParkedKeys, Error> {
        if self.delayed_retries().is_none_or(|d| d.order != ParkOrder::Key) {
            return Ok(ParkedKeys::default());
        }
        let keys: Vec<Vec<u8>> = items.iter().filter_map(order_key).collect::<HashSet<_>>().into_iter().collect();
        if keys.is_empty() {
            return Ok(ParkedKeys::default());
        }
        let config = &self.inner.config;
        let retrying =
            Retrying { group: &config.group, what: "the parked-key check", subject: &items, on_retry: &|| {} };
        let result = retry(config, shutdown, &retrying, || async {
            let mut conn = crate::store::connect::connection(&self.inner.pool).await?;
            Ok(DB::parked_keys(&mut conn, &config.tables, &config.group, &keys).await?)
        })
        .await;
        match result {
            Ok(found) => Ok(ParkedKeys(found.into_iter().collect())),
            Err((_, Failure::Database(error))) => Err(error.into()),
            Err(_) => Err(Error::Stopped),
        }
    }

    /// Parks `item`: after its immediate retries (`error`, due after the schedule's first delay), or behind its
    /// key's parked message (`error` is `None`; due at once, released when it heads its key). Its key joins
    /// `keys`. A redelivery of an event parked already writes nothing and is a duplicate.
    pub(super) async fn park(
        &self,
        item: &Item,
        error: Option<&str>,
        attempts: u32,
        keys: &mut ParkedKeys,
        shutdown: &Shutdown,
    ) -> Result<Outcome, Error> {
        let (config, Some(retries)) = (&self.inner.config, self.delayed_retries()) else {
            return Err(Error::Config("a message was parked without delayed retries configured".into()));
        };
        let Item::Keyed(event) = item else {
            return Err(Error::Config("a message without an event id cannot be parked".into()));
        };
        let order = match retries.order {
            ParkOrder::Key => order_key(item),
            ParkOrder::None => None,
        };
        let now = now_ms();
        let (due, history) = match error {
            Some(reason) => {
                let delay = retries.next_delay(0, seed(&event.id, 0)).unwrap_or(POLL);
                (now + ms(delay), history_line(now, attempts as i32, reason))
            }
            None => (now, String::new()),
        };
        let parked = NewParked {
            event_id: &event.id,
            order_key: order.as_deref(),
            message: &event.message,
            attempts: i32::try_from(attempts).unwrap_or(i32::MAX),
            error,
            history: &history,
            now_ms: now,
            due_ms: due,
        };
        let subject = One { event_id: Some(&event.id), message: &event.message };
        let retrying = Retrying { group: &config.group, what: "the parking", subject: &subject, on_retry: &|| {} };
        let topic = event.message.topic.clone();
        let result = retry(config, shutdown, &retrying, || async {
            let mut conn = crate::store::connect::connection(&self.inner.pool).await?;
            let body = async |tx: &mut DB::Connection| {
                let parked = DB::park(&mut *tx, &config.tables, &config.group, &parked).await?;
                let value = if parked { Outcome::Parked } else { Outcome::Duplicate };
                Ok(End::Commit { value, user_writes: false, check_intact: false, idem_wrote: true })
            };
            self.in_transaction(&mut conn, body, |o| self.committed(&topic, &[*o])).await
        })
        .await;
        let outcome = match result {
            Ok(outcome) => outcome,
            Err((_, Failure::Database(error))) => return Err(error.into()),
            Err(_) => return Err(Error::Stopped),
        };
        if let Some(key) = order {
            keys.0.insert(key);
        }
        let m = &event.message;
        match (outcome, error) {
            (Outcome::Parked, Some(reason)) => tracing::warn!(consumer_group = %config.group, event_id = %event.id,
                topic = %m.topic, partition = m.partition, offset = m.offset, reason, attempts,
                due_in = ?Duration::from_millis(u64::try_from(due - now).unwrap_or(0)),
                delayed_retries = retries.schedule.len(),
                "parked after its immediate retries: the partition goes on; later messages of its key wait behind it"),
            (Outcome::Parked, None) => tracing::info!(consumer_group = %config.group, event_id = %event.id,
                topic = %m.topic, partition = m.partition, offset = m.offset,
                "parked behind an earlier parked message of its key"),
            _ => tracing::info!(consumer_group = %config.group, event_id = %event.id, topic = %m.topic,
                partition = m.partition, offset = m.offset, "already parked; this delivery is a duplicate"),
        }
        Ok(outcome)
    }

    /// The release loop of a run: tries due parked messages, one transaction each, until `shutdown`. Every
    /// failure is logged and left for the next look.
    pub(super) async fn release_parked(self, apply: &dyn Apply<DB>, shutdown: Shutdown) {
        let config = &self.inner.config;
        loop {
            if self.inner.breaker.open() {
                // A tripped kill switch holds every partition; the parked messages wait as well.
                if shutdown.sleep(POLL).await.is_err() {
                    return;
                }
                continue;
            }
            let due = match DB::due_parked(&self.inner.pool, &config.tables, &config.group, now_ms(), PER_LOOK).await {
                Ok(due) => due,
                Err(error) => {
                    tracing::warn!(consumer_group = %config.group, %error, "reading the due parked messages failed");
                    Vec::new()
                }
            };
            let mut released = 0;
            for id in due {
                if shutdown.triggered() {
                    return;
                }
                match self.release_one(id, apply, &shutdown).await {
                    Ok(true) => released += 1,
                    Ok(false) => {}
                    Err(Error::Stopped) => return,
                    Err(error) => tracing::warn!(consumer_group = %config.group, parked_id = id, %error,
                        "a delayed retry failed; it is tried again at its next due time"),
                }
            }
            self.publish_parked_gauges().await;
            // A key's next message heads it as soon as the one before is gone: look again at once.
            if released == 0 && shutdown.sleep(POLL).await.is_err() {
                return;
            }
        }
    }

    /// Leases parked message `id` and tries it once; `true` when it left the table (applied, a duplicate, or
    /// dead-lettered).
    async fn release_one(&self, id: i64, apply: &dyn Apply<DB>, shutdown: &Shutdown) -> Result<bool, Error> {
        let (config, Some(retries)) = (&self.inner.config, self.delayed_retries()) else { return Ok(false) };
        let now = now_ms();
        let pool = &self.inner.pool;
        // Its next due time first: if this try fails, or the process dies in it, the message is due again then.
        let parked = {
            // Leased without knowing its state yet: read it, then count the retry if it had failed before.
            let probe = DB::lease_parked(pool, &config.tables, id, now, now + ms(LAST_LEASE), false).await?;
            let Some(parked) = probe else { return Ok(false) };
            let tried = parked.error.is_some();
            let begun = if tried { parked.delayed_retries + 1 } else { parked.delayed_retries };
            let next =
                retries.next_delay(u32::try_from(begun).unwrap_or(u32::MAX), seed(&parked.event_id, begun.into()));
            let until = now + next.map_or(ms(LAST_LEASE), ms);
            // The due time is ours now (it is in the future): move it to the next delay and count the retry.
            match DB::lease_parked(pool, &config.tables, id, now + ms(LAST_LEASE), until, tried).await? {
                Some(parked) => parked,
                None => return Ok(false),
            }
        };
        let last = parked.error.is_some() && parked.delayed_retries as usize >= retries.schedule.len();
        let message = parked.message();
        let event = Event::new(parked.event_id.clone(), message);
        let items = [Item::Keyed(event)];
        let once = crate::config::Config { max_attempts: 1, ..config.clone() };
        let retrying =
            Retrying { group: &config.group, what: "the delayed retry", subject: &&items[..], on_retry: &|| {} };
        let topic = parked.topic.clone();
        let result = retry(&once, shutdown, &retrying, || async {
            let mut conn = crate::store::connect::connection(pool).await?;
            let body = async |tx: &mut DB::Connection| {
                if !DB::unpark(&mut *tx, &config.tables, id).await? {
                    return Ok(End::Rollback(vec![Outcome::Duplicate]));
                }
                match self.claim_and_apply(&mut *tx, &items, apply).await? {
                    // Nothing of the message's own to keep: the parked row still goes.
                    End::Rollback(value) => {
                        Ok(End::Commit { value, user_writes: false, check_intact: false, idem_wrote: true })
                    }
                    end => Ok(end),
                }
            };
            self.in_transaction(&mut conn, body, |outcomes| self.committed(&topic, outcomes)).await
        })
        .await;
        let m = &parked;
        match result {
            Ok(outcomes) => {
                let outcome = outcomes.first().copied().unwrap_or(Outcome::Duplicate);
                tracing::info!(consumer_group = %config.group, event_id = %m.event_id, topic = %m.topic,
                    partition = m.partition, offset = m.offset, outcome = outcome.as_str(),
                    delayed_retries = m.delayed_retries, "parked message released");
                metrics::counter!("idem_delayed_retries_total", "consumer_group" => config.group.clone(),
                    "result" => "released")
                .increment(1);
                Ok(true)
            }
            Err((_, Failure::Handler { error, .. })) => {
                self.parked_failed(&parked, &items[0], error, last, shutdown).await
            }
            Err((_, Failure::Ended)) => {
                self.parked_failed(&parked, &items[0], HandlerError::ended_transaction(), last, shutdown).await
            }
            Err((_, Failure::Database(error))) => Err(error.into()),
            Err(_) => Err(Error::Stopped),
        }
    }

    /// A delayed retry failed: recorded for the next one, or, when it was the last or the failure is permanent,
    /// the message is dead-lettered with its history and leaves the parked table in the same transaction.
    async fn parked_failed(
        &self,
        parked: &ParkedMessage,
        item: &Item,
        error: HandlerError,
        last: bool,
        shutdown: &Shutdown,
    ) -> Result<bool, Error> {
        let config = &self.inner.config;
        let now = now_ms();
        let attempts = parked.attempts.saturating_add(1);
        let reason = error.reason().to_owned();
        let history = format!("{}{}", parked.history, history_line(now, attempts, &reason));
        let retryable = matches!(error, HandlerError::Retryable(_));
        if retryable && !last {
            DB::record_parked_failure(&self.inner.pool, &config.tables, parked.id, attempts, &reason, &history).await?;
            metrics::counter!("idem_delayed_retries_total", "consumer_group" => config.group.clone(), "result" => "failed")
                .increment(1);
            tracing::warn!(consumer_group = %config.group, event_id = %parked.event_id, topic = %parked.topic,
                partition = parked.partition, offset = parked.offset, reason, attempts,
                delayed_retries = parked.delayed_retries, "a delayed retry failed; the message stays parked");
            return Ok(false);
        }
        let Item::Keyed(event) = item else { return Ok(false) };
        let failures = history.lines().count();
        let dead_reason = format!(
            "{reason} (parked at {}; {} delayed retries, {attempts} attempts; history: {})",
            crate::store::rfc3339_from_ms(parked.parked_at),
            parked.delayed_retries,
            history.trim_end().replace('\n', " ")
        );
        let letter =
            NewDeadLetter { event_id: Some(&event.id), message: &event.message, error: &dead_reason, attempts };
        let subject = One { event_id: Some(&event.id), message: &event.message };
        let retrying = Retrying { group: &config.group, what: "the dead letter", subject: &subject, on_retry: &|| {} };
        let topic = parked.topic.clone();
        let result = retry(config, shutdown, &retrying, || async {
            let mut conn = crate::store::connect::connection(&self.inner.pool).await?;
            let body = async |tx: &mut DB::Connection| {
                if !DB::unpark(&mut *tx, &config.tables, parked.id).await? {
                    return Ok(End::Rollback(Outcome::Duplicate));
                }
                if config.dedup == Dedup::Markers {
                    let claims = DB::claim(&mut *tx, &config.tables, &config.layout, &config.group, &[event]).await?;
                    if claims.first() != Some(&Claim::New) {
                        return Ok(End::Commit {
                            value: Outcome::Duplicate,
                            user_writes: false,
                            check_intact: false,
                            idem_wrote: true,
                        });
                    }
                }
                DB::dead_letter(&mut *tx, &config.tables, &config.group, &letter).await?;
                Ok(End::Commit {
                    value: Outcome::DeadLettered,
                    user_writes: false,
                    check_intact: false,
                    idem_wrote: true,
                })
            };
            self.in_transaction(&mut conn, body, |o| self.committed(&topic, &[*o])).await
        })
        .await;
        match result {
            Ok(outcome) => {
                metrics::counter!("idem_delayed_retries_total", "consumer_group" => config.group.clone(),
                    "result" => "dead_lettered")
                .increment(1);
                tracing::warn!(consumer_group = %config.group, event_id = %parked.event_id, topic = %parked.topic,
                    partition = parked.partition, offset = parked.offset, reason, failures,
                    outcome = outcome.as_str(),
                    "the delayed retries are used up (or the failure is permanent): dead-lettered with its history; \
                     the next message of its key goes on");
                Ok(true)
            }
            Err((_, Failure::Database(error))) => Err(error.into()),
            Err(_) => Err(Error::Stopped),
        }
    }

    /// Sets the gauges of parked messages: how many, and the age of the oldest.
    pub(super) async fn publish_parked_gauges(&self) {
        let config = &self.inner.config;
        match DB::parked_figures(&self.inner.pool, &config.tables, &config.group).await {
            Ok((count, oldest)) => {
                let group = config.group.clone();
                metrics::gauge!("idem_parked_messages", "consumer_group" => group.clone()).set(count as f64);
                let age = oldest.map_or(0.0, |at| (now_ms() - at).max(0) as f64 / 1000.0);
                metrics::gauge!("idem_parked_oldest_age_seconds", "consumer_group" => group).set(age);
            }
            Err(error) => tracing::warn!(consumer_group = %config.group, %error, "reading the parked figures failed"),
        }
    }
}
