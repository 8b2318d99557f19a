//! What a relay writes back after a delivery: delivered rows deleted, failures counted on their rows, messages
//! that failed for good moved to the dead letters, all in one transaction.

use std::collections::HashMap;
use std::time::Instant;

use super::store::OutboxStore;
use super::{Delivered, OutboxMessage, RelayConfig};
use crate::store::{NewDeadLetter, Tables};

/// The outcome of one delivered batch, planned in memory, written by [`Settlement::write`].
#[derive(Default)]
pub(super) struct Settlement {
    /// Delivered: (id, destination, age in seconds).
    done: Vec<(i64, String, f64)>,
    /// Failed for a while: (id, destination, reason).
    failed: Vec<(i64, String, String)>,
    /// Failed for good: the message, the reason, the attempts.
    dead: Vec<(OutboxMessage, String, i32)>,
    /// Not tried, behind a failed message of their key.
    held: usize,
}

/// What a written settlement adds to the relay's counters.
pub(super) struct Settled {
    pub(super) delivered: u64,
    pub(super) failed: u64,
    pub(super) dead_lettered: u64,
}

impl Settlement {
    /// Plans the settlement of `messages` from their `results`: a slot whose message failed for a while is held
    /// back in `held` until its backoff passes.
    pub(super) fn plan(
        config: &RelayConfig,
        messages: &[OutboxMessage],
        results: &[Delivered],
        held: &mut HashMap<i32, Instant>,
    ) -> Self {
        let mut plan = Settlement::default();
        for (m, result) in messages.iter().zip(results) {
            let error = match result {
                Delivered::Done => {
                    plan.done.push((m.id, m.destination.clone(), m.age_seconds));
                    continue;
                }
                Delivered::Held => {
                    plan.held += 1;
                    continue;
                }
                Delivered::Failed(error) => error,
            };
            let attempts = u32::try_from(m.attempts).unwrap_or(0) + 1;
            if error.permanent || config.max_attempts.is_some_and(|max| attempts >= max) {
                let reason = if error.permanent {
                    format!("delivery to {} failed for good: {}", m.destination, error.reason)
                } else {
                    format!(
                        "delivery to {} failed {attempts} times (max_attempts), last: {}",
                        m.destination, error.reason
                    )
                };
                tracing::warn!(relay = %config.name, event_id = %m.event_id, destination = %m.destination,
                    outbox_id = m.id, reason, "outbox message dead-lettered; requeue it with idem outbox requeue");
                plan.dead.push((m.clone(), reason, attempts as i32));
            } else {
                let wait = config.backoff.after(attempts);
                held.insert(m.slot, Instant::now() + wait);
                tracing::warn!(relay = %config.name, event_id = %m.event_id, destination = %m.destination,
                    outbox_id = m.id, attempts, reason = %error.reason, retry_in = ?wait,
                    "outbox delivery failed; its key waits and is tried again");
                plan.failed.push((m.id, m.destination.clone(), error.reason.clone()));
            }
        }
        plan
    }

    /// Whether every message of the batch leaves the outbox (delivered or dead-lettered): none stays behind.
    pub(super) fn all_gone(&self) -> bool {
        self.failed.is_empty() && self.held == 0
    }

    /// The ids this settlement deletes.
    pub(super) fn gone(&self) -> Vec<i64> {
        self.done.iter().map(|(id, ..)| *id).chain(self.dead.iter().map(|(m, ..)| m.id)).collect()
    }

    /// Writes the settlement in one transaction on `conn`.
    pub(super) async fn write<DB: OutboxStore>(
        self,
        conn: &mut DB::Connection,
        tables: &Tables,
        group: &str,
    ) -> Result<Settled, sqlx::Error> {
        if self.done.is_empty() && self.failed.is_empty() && self.dead.is_empty() {
            return Ok(Settled { delivered: 0, failed: 0, dead_lettered: 0 });
        }
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        for (m, reason, attempts) in &self.dead {
            let message = m.message();
            let letter =
                NewDeadLetter { event_id: Some(&m.event_id), message: &message, error: reason, attempts: *attempts };
            DB::dead_letter(&mut *tx, tables, group, &letter).await?;
        }
        for (id, _, reason) in &self.failed {
            DB::failed(&mut *tx, tables, *id, reason).await?;
        }
        DB::delete(&mut *tx, tables, &self.gone()).await?;
        tx.commit().await?;
        for (_, destination, age) in &self.done {
            metrics::histogram!("idem_outbox_delivery_age_seconds", "destination" => destination.clone()).record(*age);
            count(destination, "delivered");
        }
        for (_, destination, _) in &self.failed {
            count(destination, "failed");
        }
        for (m, ..) in &self.dead {
            count(&m.destination, "dead_lettered");
        }
        Ok(Settled {
            delivered: self.done.len() as u64,
            failed: self.failed.len() as u64,
            dead_lettered: self.dead.len() as u64,
        })
    }
}

/// The outcomes of `idem_outbox_published_total`.
const OUTCOMES: [&str; 3] = ["delivered", "failed", "dead_lettered"];

/// Counts one delivery attempt. The first time this process meets a destination, each of its outcomes is
/// registered at 0 first, so that `increase(…{outcome="dead_lettered"})` sees the first dead letter too.
fn count(destination: &str, outcome: &'static str) {
    static MET: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<String>>> = std::sync::OnceLock::new();
    if let Ok(mut met) = MET.get_or_init(Default::default).lock()
        && !met.contains(destination)
    {
        for outcome in OUTCOMES {
            metrics::counter!("idem_outbox_published_total", "destination" => destination.to_owned(),
                "outcome" => outcome)
            .increment(0);
        }
        met.insert(destination.to_owned());
    }
    metrics::counter!("idem_outbox_published_total", "destination" => destination.to_owned(), "outcome" => outcome)
        .increment(1);
}
