//! The consumer's background housekeeping: marker gauges, pruning, the partitioned layout's upkeep.

use std::time::Instant;

use super::Engine;
use crate::error::Error;
use crate::store::Backend;

impl<DB: Backend> Engine<DB> {
    /// The consumer's background housekeeping: the marker gauges every `stats_interval`, and every
    /// `pruning.interval` the expired archived dead letters and, when a retention is set, the expired markers. Failures are logged and tried again next time.
    pub(super) async fn housekeeping(self) {
        let config = &self.inner.config;
        let mut stats = tokio::time::interval(config.stats_interval);
        let mut prune = tokio::time::interval(config.pruning.interval);
        stats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        prune.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stats.tick() => self.publish_marker_gauges().await,
                _ = prune.tick() => self.prune_once().await,
            }
        }
    }

    /// Rolls back, every half [`super::warm::KEPT_FOR`], the kept transactions no batch took in time. A task of
    /// its own: a slow gauge query or pruning pass never delays it.
    pub(super) async fn expire_kept_transactions(self) {
        let mut tick = tokio::time::interval(super::warm::KEPT_FOR / 2);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.inner.warm.expire().await;
        }
    }

    pub(super) async fn publish_marker_gauges(&self) {
        let config = &self.inner.config;
        match DB::stats(&self.inner.pool, &config.tables, Some(&config.group)).await {
            Ok(groups) => {
                let mine = groups.into_iter().find(|g| g.consumer_group == config.group);
                let (rows, oldest, dead) =
                    mine.map_or((0, None, 0), |g| (g.markers, g.oldest_marker_age_seconds, g.dead_letters));
                let group = config.group.clone();
                metrics::gauge!("idem_processed_events_rows", "consumer_group" => group.clone()).set(rows as f64);
                metrics::gauge!("idem_processed_events_oldest_age_seconds", "consumer_group" => group.clone())
                    .set(oldest.unwrap_or(0.0));
                metrics::gauge!("idem_dead_letters_stored", "consumer_group" => group).set(dead as f64);
            }
            Err(error) => tracing::warn!(%error, "reading marker statistics failed"),
        }
    }

    /// Moves the `idem_dead_letters_stored` gauge by `n` dead letters just committed, so it shows them at once; the
    /// next count (every `stats_interval`) sets it again from the table, replays and deletions included.
    pub(crate) fn dead_letters_written(&self, n: u64) {
        if n > 0 {
            metrics::gauge!("idem_dead_letters_stored", "consumer_group" => self.inner.config.group.clone())
                .increment(n as f64);
        }
    }

    pub(super) fn partitioned(&self) -> Option<&crate::config::Partitioning> {
        match &self.inner.config.layout {
            crate::config::MarkerLayout::Partitioned(p) => Some(p),
            crate::config::MarkerLayout::Plain => None,
        }
    }

    /// Checks the marker table's layout against the configuration and creates partitions ahead: at start, and
    /// again once `pruning.interval` has passed (an engine driven by `process` has no housekeeping task).
    pub(super) async fn prepare_layout(&self) -> Result<(), Error> {
        let inner = &self.inner;
        let mut checked = inner.layout_checked.lock().await;
        if checked.is_some_and(|at| at.elapsed() < inner.config.pruning.interval) {
            return Ok(());
        }
        DB::prepare_layout(&inner.pool, &inner.config.tables, &inner.config.layout).await?;
        *checked = Some(Instant::now());
        Ok(())
    }

    pub(super) async fn prune_once(&self) {
        self.prune_archive().await;
        if self.partitioned().is_some() {
            return self.maintain_partitions().await;
        }
        let config = &self.inner.config;
        let Some(retention) = config.pruning.retention else { return };
        let group = config.group.clone();
        let report = crate::prune::prune(
            &self.inner.pool,
            &config.tables,
            Some(&config.group),
            retention,
            &config.pruning,
            |_| {},
        )
        .await;
        match report {
            Ok(report) => {
                metrics::counter!("idem_processed_events_pruned_total", "consumer_group" => group.clone())
                    .increment(report.deleted);
                metrics::gauge!("idem_processed_events_prune_longest_statement_seconds", "consumer_group" => group)
                    .set(report.longest_statement.as_secs_f64());
                tracing::info!(consumer_group = %config.group, deleted = report.deleted, statements = report.statements,
                    longest_ms = report.longest_statement.as_millis() as u64, "markers pruned");
            }
            Err(error) => tracing::warn!(%error, "pruning markers failed; trying again at the next interval"),
        }
    }

    /// Deletes the group's discarded dead letters older than `pruning.archive_expiry`.
    async fn prune_archive(&self) {
        let config = &self.inner.config;
        let (pool, pruning) = (&self.inner.pool, &config.pruning);
        let group = Some(config.group.as_str());
        match crate::dead_letter::prune_archive(pool, &config.tables, group, pruning.archive_expiry, pruning.batch_size)
            .await
        {
            Ok(0) => {}
            Ok(deleted) => tracing::info!(consumer_group = %config.group, deleted, "archived dead letters expired"),
            Err(error) => {
                tracing::warn!(%error, "pruning the dead-letter archive failed; trying again at the next interval")
            }
        }
    }

    /// The partitioned layout's pass: the layout checked again and partitions created ahead, then expired
    /// partitions dropped whole.
    pub(super) async fn maintain_partitions(&self) {
        let config = &self.inner.config;
        if let Err(error) = DB::prepare_layout(&self.inner.pool, &config.tables, &config.layout).await {
            tracing::error!(%error, "the marker table no longer has the configured layout: stop this consumer");
        }
        let Some(retention) = config.pruning.retention else { return };
        match DB::drop_expired_partitions(&self.inner.pool, &config.tables, retention).await {
            Ok((dropped, markers)) => {
                metrics::counter!("idem_processed_events_pruned_total", "consumer_group" => config.group.clone())
                    .increment(markers);
                if !dropped.is_empty() {
                    tracing::info!(consumer_group = %config.group, ?dropped, markers, "marker partitions dropped");
                }
            }
            Err(error) => {
                tracing::warn!(%error, "maintaining marker partitions failed; trying again at the next interval")
            }
        }
    }
}
