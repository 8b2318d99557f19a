//! Inbox housekeeping: close complete instances, run operator releases, delete expired instances (their claims
//! go by cascade) after reporting what they still held, and publish the gauges. Every step works in bounded
//! batches and skips rows a consumer holds.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use sqlx::{Connection, PgConnection, Postgres};

use super::SequentialInbox;
use super::process::Failure;
use super::store;
use crate::engine::End;
use crate::error::Error;
use crate::handler::Handler;
use crate::store::{NewDeadLetter, Store};

/// What one housekeeping pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct HousekeepingReport {
    /// Instances closed because every message type was processed.
    pub closed: u64,
    /// Messages an operator released (`idem inbox release`) that were handled.
    pub released: u64,
    /// Expired instances deleted, with their claims and messages.
    pub deleted: u64,
    /// WAITING or FAILED messages of deleted instances written to the dead-letter table.
    pub reported: u64,
}

impl SequentialInbox {
    /// One housekeeping pass; `handler` handles the messages an operator released.
    pub async fn housekeep<H: Handler<Postgres>>(&self, handler: &H) -> Result<HousekeepingReport, Error> {
        self.housekeeping_pass(handler, true).await
    }

    /// One pass; `close_complete`: also close the OPEN instances whose every type was processed. Only a change of
    /// the declared types (a restart with another configuration) leaves such an instance open: the claim
    /// transaction closes the instance it completes, and so does an operator's release. So a run looks for them
    /// in its first pass only, rather than scanning every open instance every interval (2.3 s at 1,000,000 open
    /// instances).
    async fn housekeeping_pass<H: Handler<Postgres>>(
        &self,
        handler: &H,
        close_complete: bool,
    ) -> Result<HousekeepingReport, Error> {
        let closed = if close_complete { self.close_complete().await? } else { 0 };
        let released = self.release_forced(handler).await?;
        let (deleted, reported) = self.delete_expired().await?;
        self.publish_gauges().await?;
        Ok(HousekeepingReport { closed, released, deleted, reported })
    }

    /// Runs a housekeeping pass at once (so the gauges are right from the start, and instances a change of the
    /// declared types completed are closed) and then every interval; failures are logged and tried again next
    /// time.
    pub(super) async fn housekeeping_loop<H: Handler<Postgres>>(self, handler: Arc<H>) {
        let mut first = true;
        let mut closed_complete = false;
        loop {
            if !std::mem::take(&mut first) {
                tokio::time::sleep(self.config.housekeeping.interval).await;
            }
            match self.housekeeping_pass(handler.as_ref(), !closed_complete).await {
                Ok(report) => {
                    closed_complete = true;
                    if report != HousekeepingReport::default() {
                        tracing::info!(?report, "inbox housekeeping");
                    }
                }
                Err(error) => tracing::warn!(%error, "inbox housekeeping failed; trying again next interval"),
            }
        }
    }

    /// Closes OPEN instances whose every type was processed (an operator release can complete one).
    async fn close_complete(&self) -> Result<u64, Error> {
        let tables = &self.engine.config().tables;
        let batch = i64::from(self.config.housekeeping.batch_size);
        let mut closed = 0;
        for sequence in &self.config.sequences {
            let types: Vec<String> = sequence.types.iter().map(|t| t.qualified.to_string()).collect();
            loop {
                let done = store::close_complete(self.engine.pool(), tables, &sequence.name, &types, batch).await?;
                closed += done;
                if done < batch as u64 {
                    break;
                }
            }
        }
        Ok(closed)
    }

    /// Handles the WAITING messages an operator released, instance by instance, under the instance lock.
    async fn release_forced<H: Handler<Postgres>>(&self, handler: &H) -> Result<u64, Error> {
        let tables = &self.engine.config().tables;
        let limit = i64::from(self.config.housekeeping.batch_size);
        let rows = store::instances_with_forced(self.engine.pool(), tables, limit).await?;
        let mut released = 0;
        for (instance, name) in rows {
            let Some(sequence) = self.config.sequences.iter().position(|s| s.name == name) else {
                tracing::warn!(instance, sequence = %name, "released messages of a sequence this consumer does not declare; left waiting");
                continue;
            };
            let mut conn = crate::store::connect::connection(self.engine.pool()).await?;
            let shared = self.config.transactions == super::InboxTransactions::Shared;
            let body = async |tx: &mut sqlx::PgConnection| {
                let Some(open) = store::lock_instance(&mut *tx, tables, instance).await? else {
                    return Ok(End::Rollback(0));
                };
                let names = store::processed_types(&mut *tx, tables, instance).await?;
                let mut processed: HashSet<_> =
                    names.iter().filter_map(|n| super::QualifiedType::parse(n).ok()).collect();
                // Housekeeping is not stopped mid-pass: its task ends with the run.
                let count =
                    self.release(&mut *tx, sequence, instance, &mut processed, handler, &Default::default()).await?;
                let types = &self.config.sequences[sequence].types;
                if open && types.iter().all(|t| processed.contains(&t.qualified)) {
                    store::close(&mut *tx, tables, instance).await?;
                }
                Ok(End::Commit {
                    value: count,
                    user_writes: shared && count > 0,
                    check_intact: false,
                    idem_wrote: true,
                })
            };
            let count = match self.engine.in_transaction(&mut conn, body, |_| {}).await {
                Ok(count) => count,
                Err(Failure::Database(error)) => return Err(error.into()),
                Err(_) => continue,
            };
            released += count as u64;
        }
        Ok(released)
    }

    /// Deletes instances past `retain_until` + `expiry_delay`, a batch per transaction; what they still held
    /// WAITING or FAILED goes to the dead-letter table first, in the same transaction.
    async fn delete_expired(&self) -> Result<(u64, u64), Error> {
        let tables = &self.engine.config().tables;
        let housekeeping = &self.config.housekeeping;
        let (mut deleted, mut reported) = (0u64, 0u64);
        loop {
            let mut conn = crate::store::connect::connection(self.engine.pool()).await?;
            let mut tx = conn.begin().await?;
            let delay = housekeeping.expiry_delay.as_secs_f64();
            let ids = store::lock_expired(&mut tx, tables, delay, i64::from(housekeeping.batch_size)).await?;
            if ids.is_empty() {
                return Ok((deleted, reported));
            }
            reported += self.report_leftovers(&mut tx, &ids).await?;
            deleted += store::delete_instances(&mut tx, tables, &ids).await?;
            tx.commit().await?;
            if ids.len() < housekeeping.batch_size as usize {
                return Ok((deleted, reported));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Writes every WAITING or FAILED message of `instances` to the dead-letter table, with a log line each.
    async fn report_leftovers(&self, tx: &mut PgConnection, instances: &[i64]) -> Result<u64, Error> {
        let config = self.engine.config();
        let leftovers = store::leftovers(&mut *tx, &config.tables, instances).await?;
        for store::Leftover {
            sequence,
            context,
            retain_until: until,
            message_type,
            idempotence_id: id,
            status,
            error,
            message,
        } in &leftovers
        {
            let reason = match (status.as_str(), error.as_deref()) {
                ("FAILED", Some(error)) => format!(
                    "`{message_type}` {id}: sequence `{sequence}` instance `{context}` expired (retain_until \
                     {until}) holding this message FAILED: {error}"
                ),
                _ => format!(
                    "`{message_type}` {id}: sequence `{sequence}` instance `{context}` expired (retain_until \
                     {until}) while this message was still WAITING for its release condition"
                ),
            };
            tracing::warn!(sequence = %sequence, context_id = %context, message_type = %message_type, event_id = %id,
                topic = %message.topic, partition = message.partition, offset = message.offset, status = %status,
                "expired inbox instance still held this message: written to the dead-letter table");
            // Stored by position: ids are unique per message type only, and two types' leftovers must not
            // overwrite each other's row.
            let letter = NewDeadLetter { event_id: None, message, error: &reason, attempts: 0 };
            Postgres::dead_letter(tx, &config.tables, &config.group, &letter).await?;
        }
        Ok(leftovers.len() as u64)
    }

    /// Sets the gauges: waiting messages, oldest waiting age, instances expiring soon and expired, per sequence.
    async fn publish_gauges(&self) -> Result<(), Error> {
        let config = self.engine.config();
        let pool = self.engine.pool();
        let waiting = store::waiting_by_sequence(pool, &config.tables).await?;
        let soon = self.config.housekeeping.expiring_soon.as_secs_f64();
        let expiring = store::expiring_by_sequence(pool, &config.tables, soon).await?;
        for sequence in &self.config.sequences {
            let labels = [("consumer_group", config.group.clone()), ("sequence", sequence.name.clone())];
            let (count, oldest) = waiting.iter().find(|w| w.0 == sequence.name).map_or((0, 0.0), |w| (w.1, w.2));
            let (soon, expired) = expiring.iter().find(|e| e.0 == sequence.name).map_or((0, 0), |e| (e.1, e.2));
            metrics::gauge!("idem_inbox_waiting_messages", &labels).set(count as f64);
            metrics::gauge!("idem_inbox_oldest_waiting_age_seconds", &labels).set(oldest);
            metrics::gauge!("idem_inbox_instances_expiring_soon", &labels).set(soon as f64);
            metrics::gauge!("idem_inbox_instances_expired", &labels).set(expired as f64);
        }
        Ok(())
    }
}
