//! The run loop: one task polls the source and hands each partition's messages, in order, to a worker of that
//! partition (through its lane, see [`super::flow`]); workers run in parallel, each acknowledging what it
//! committed. Revocations and shutdown drain.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::Engine;
use super::apply::Process;
use super::flow::{Lane, Limits};
use super::outcome::StatsSnapshot;
use super::retry::Shutdown;
use crate::backoff::sleep_unless_stopped;
use crate::error::{Error, Retry};
use crate::message::{AckHandle, Message};
use crate::source::{Acknowledgement, BoxedSource, Partition, Received, Source};
use crate::store::Backend;

impl<DB: Backend> Engine<DB> {
    /// Runs `work` as this engine's consumer where messages are pushed to it rather than polled (the HTTP
    /// ingress's server): the metric descriptions, the housekeeping beside it (marker gauges, pruning), and
    /// [`Engine::health`] running until it ends.
    #[cfg(feature = "ingress")]
    pub(crate) async fn serving<T>(&self, system: &'static str, work: impl Future<Output = T>) -> T {
        crate::telemetry::describe();
        crate::telemetry::zero_counters(&self.inner.config.group);
        for reason in ["signature", "key"] {
            metrics::counter!("idem_http_ingress_refused_total", "consumer_group" => self.inner.config.group.clone(),
                "reason" => reason)
            .increment(0);
        }
        let _ = self.inner.system.set(system);
        metrics::gauge!("idem_consumer_paused", "consumer_group" => self.inner.config.group.clone()).set(0.0);
        let _housekeeping = AbortOnDrop(tokio::spawn(self.clone().housekeeping()));
        self.inner.draining.store(false, Ordering::SeqCst);
        self.inner.running.store(true, Ordering::SeqCst);
        let ended = work.await;
        self.inner.running.store(false, Ordering::SeqCst);
        ended
    }

    /// Consumes `source` with `apply` until it ends, `shutdown` completes or an error stops it (see
    /// [`Engine::run`]). Only this shell is generic: the run loop behind it is compiled once per database.
    pub(crate) async fn run_with<S: Source>(
        &self,
        source: S,
        apply: Arc<dyn Process<DB>>,
        shutdown: impl Future + Send,
    ) -> Result<StatsSnapshot, Error> {
        let shutdown = std::pin::pin!(async move {
            shutdown.await;
        });
        self.consume(BoxedSource::new(source), apply, shutdown).await
    }

    async fn consume(
        &self,
        source: BoxedSource,
        apply: Arc<dyn Process<DB>>,
        mut shutdown: Pin<&mut (dyn Future<Output = ()> + Send + '_)>,
    ) -> Result<StatsSnapshot, Error> {
        crate::telemetry::describe();
        crate::telemetry::zero_counters(&self.inner.config.group);
        let _ = self.inner.system.set(source.system());
        metrics::gauge!("idem_consumer_paused", "consumer_group" => self.inner.config.group.clone()).set(0.0);
        // The layout check is the run's first statement: a database that is away is waited for, as later.
        let mut outages = 0u32;
        loop {
            match self.prepare_layout().await {
                Ok(()) => break,
                Err(error) if error.retry() == Retry::Helps => {
                    outages += 1;
                    let delay = self.inner.config.backoff.after(outages);
                    tracing::warn!(consumer_group = %self.inner.config.group, %error, ?delay, outages,
                        "database unavailable before consuming; retrying");
                    if sleep_unless_stopped(delay, shutdown.as_mut()).await {
                        return Ok(self.stats());
                    }
                }
                Err(error) => return Err(error),
            }
        }
        let source = Arc::new(source);
        let _housekeeping = AbortOnDrop(tokio::spawn(self.clone().housekeeping()));
        let _expiry = AbortOnDrop(tokio::spawn(self.clone().expire_kept_transactions()));
        self.inner.draining.store(false, Ordering::SeqCst);
        self.inner.running.store(true, Ordering::SeqCst);
        let (fatal_tx, mut fatal_rx) = mpsc::unbounded_channel::<Error>();
        let limits = Limits::for_batch(self.inner.config.batch_size);
        let lanes = &self.inner.lanes;
        lanes.reset();
        let stalls = AbortOnDrop(tokio::spawn(self.clone().watch_stalls(Arc::clone(&source))));
        // Delayed retries: the parked messages are tried again beside the partitions, which never wait for them.
        let releasing = Shutdown::default();
        let release = self.inner.config.delayed_retries.is_some().then(|| {
            let (apply, engine, stop) = (Arc::clone(&apply), self.clone(), releasing.clone());
            StopOnDrop {
                stop: releasing.clone(),
                task: tokio::spawn(async move { apply.release_parked(engine, stop).await }),
            }
        });
        let mut workers: HashMap<Partition, Worker> = HashMap::new();
        let mut source_failures = 0u32;
        let stop_reason: Result<(), Error> = 'poll: loop {
            // Every lane is filled without waiting on its worker: one partition that retries or waits never keeps
            // the others from being read. Only all lanes together at the cap make the poller wait for progress.
            let full = lanes.full(&limits);
            tokio::select! {
                biased;
                error = fatal_rx.recv() => {
                    if let Some(error) = error {
                        // A worker failed for good: the others stop after the transaction in hand, without
                        // retrying what they hold. (A source's error lets them finish what was read before it.)
                        for worker in workers.values() { worker.stopping.trigger(); }
                        break Err(error);
                    }
                }
                _ = &mut shutdown => {
                    tracing::info!(consumer_group = %self.inner.config.group, "shutdown requested: draining in-flight batches");
                    for worker in workers.values() { worker.stopping.trigger(); }
                    break Ok(());
                }
                _ = lanes.progressed(), if full => {}
                _ = tokio::time::sleep(Duration::from_millis(100)), if full => {}
                received = source.recv(), if !full => match received {
                    Ok(Some(Received::Message(message))) => {
                        source_failures = 0;
                        let key = Partition { topic: message.topic.clone(), partition: message.partition };
                        let worker = match workers.entry(key) {
                            Entry::Occupied(entry) => entry.into_mut(),
                            Entry::Vacant(entry) => {
                                let worker = self.spawn_worker(entry.key().clone(), Arc::clone(&source),
                                    Arc::clone(&apply), fatal_tx.clone());
                                entry.insert(worker)
                            }
                        };
                        lanes.arrived(&worker.lane, &limits, source.pausing());
                        // A send fails only when the worker is gone: its error is on its way through fatal_rx.
                        let _ = worker.queue.send(message);
                    }
                    Ok(Some(Received::Revoked { partitions, drained })) => {
                        for partition in &partitions {
                            if let Some(worker) = workers.remove(partition) {
                                worker.stopping.trigger();
                                let finished = worker.finish().await;
                                self.close_lane(partition, source.as_ref());
                                if let Err(error) = finished {
                                    break 'poll Err(error);
                                }
                            }
                        }
                        tracing::info!(?partitions, "revoked partitions drained");
                        drained.done();
                    }
                    Ok(None) => break Ok(()),
                    Err(error) if error.retry() == Retry::Helps => {
                        source_failures += 1;
                        let delay = self.inner.config.backoff.after(source_failures);
                        tracing::warn!(consumer_group = %self.inner.config.group, %error, ?delay, "source failed; retrying");
                        // A shutdown during the backoff stops at once.
                        if sleep_unless_stopped(delay, shutdown.as_mut()).await {
                            tracing::info!(consumer_group = %self.inner.config.group, "shutdown requested: draining in-flight batches");
                            for worker in workers.values() { worker.stopping.trigger(); }
                            break Ok(());
                        }
                    }
                    Err(error) => break Err(error.into()),
                },
            }
        };
        self.inner.draining.store(true, Ordering::SeqCst);
        // The delayed retry in hand finishes (or its lease makes it due again later); none starts after this.
        if let Some(release) = release {
            release.finish().await;
        }
        let mut first_error = stop_reason.err();
        for (partition, worker) in workers.drain() {
            if let Err(error) = worker.finish().await {
                first_error.get_or_insert(error);
            }
            self.close_lane(&partition, source.as_ref());
        }
        while let Ok(error) = fatal_rx.try_recv() {
            first_error.get_or_insert(error);
        }
        // The stall watch holds the source: it is gone before `run` returns, so the source's partitions are free
        // for the next consumer (the embedded log's partition locks go with the source).
        stalls.stop().await;
        self.inner.running.store(false, Ordering::SeqCst);
        // Every worker has ended: the transactions they left open for a next batch are rolled back.
        self.inner.warm.clear().await;
        match first_error {
            Some(error) => Err(error),
            None => Ok(self.stats()),
        }
    }
}

/// One partition's worker: a queue in (never full: its lane counts what it holds), a task that handles batches
/// in order.
struct Worker {
    queue: mpsc::UnboundedSender<Message>,
    lane: Arc<Lane>,
    stopping: Shutdown,
    task: JoinHandle<()>,
}

impl Worker {
    /// Closes the queue and waits for the task: the in-flight batch finishes and is acknowledged. A worker's
    /// own errors reach the engine through its fatal channel; only a panic is returned here.
    async fn finish(self) -> Result<(), Error> {
        drop(self.queue);
        self.task.await.map_err(|join| {
            Error::Worker(format!("a partition worker panicked (a bug in a handler or in idem): {join}"))
        })
    }
}

impl<DB: Backend> Engine<DB> {
    fn spawn_worker(
        &self,
        partition: Partition,
        source: Arc<BoxedSource>,
        apply: Arc<dyn Process<DB>>,
        fatal: mpsc::UnboundedSender<Error>,
    ) -> Worker {
        let batch_size = self.inner.config.batch_size;
        let limits = Limits::for_batch(batch_size);
        let (queue, mut inbox) = mpsc::unbounded_channel::<Message>();
        let lane = self.inner.lanes.open(&partition);
        let stopping = Shutdown::default();
        let engine = self.clone();
        let stop = stopping.clone();
        let own_lane = Arc::clone(&lane);
        let task = tokio::spawn(async move {
            let lane = own_lane;
            let mut guard = PanicGuard { fatal: Some(fatal.clone()), partition: partition.clone() };
            let mut gaps = crate::gap::SequenceGaps::default();
            tracing::debug!(topic = %partition.topic, partition = partition.partition, "partition worker started");
            while let Some(first) = inbox.recv().await {
                if stop.triggered() {
                    break;
                }
                let mut batch = Vec::with_capacity(batch_size);
                batch.push(first);
                while batch.len() < batch_size {
                    match inbox.try_recv() {
                        Ok(message) => batch.push(message),
                        Err(_) => break,
                    }
                }
                let Some(mut acknowledgement) = Acknowledgement::of(&batch) else { continue };
                let taken = batch.len();
                engine.inner.lanes.started(&lane, batch[0].offset);
                let handles: Vec<Option<AckHandle>> = batch.iter().map(|m| m.ack_handle.clone()).collect();
                engine.detect_gaps(&mut gaps, &batch);
                match apply.process(&engine, batch, &stop).await {
                    Ok(dead_lettered) => {
                        acknowledgement.dead_lettered = handles
                            .into_iter()
                            .zip(dead_lettered)
                            .filter_map(|(handle, dead)| handle.filter(|_| dead))
                            .collect();
                    }
                    Err(Error::Stopped) if stop.triggered() => break,
                    Err(Error::Stopped) => {
                        // Not told to stop: the worker cannot go on with this batch, and its partition must not
                        // be left without one.
                        let _ = fatal.send(Error::Worker(format!(
                            "the worker of {}/{} stopped at offset {} without being told to; nothing of its batch \
                             was acknowledged",
                            partition.topic, partition.partition, acknowledgement.last_offset
                        )));
                        guard.fatal = None;
                        return;
                    }
                    Err(error) => {
                        tracing::error!(%error, topic = %partition.topic, partition = partition.partition, "partition worker stopped");
                        let _ = fatal.send(error);
                        guard.fatal = None;
                        return;
                    }
                }
                let committed = Instant::now();
                engine.ack(source.as_ref(), &acknowledgement).await;
                metrics::gauge!("idem_consumer_offset_commit_lag_seconds", "consumer_group" => engine.inner.config.group.clone(),
                    "topic" => partition.topic.clone(), "partition" => partition.partition.to_string())
                .set(committed.elapsed().as_secs_f64());
                engine.inner.lanes.finished(&lane, taken, &limits, source.pausing());
            }
            guard.fatal = None;
        });
        Worker { queue, lane, stopping, task }
    }

    /// Counts events that producer sequence numbers show were never delivered.
    pub(super) fn detect_gaps(&self, gaps: &mut crate::gap::SequenceGaps, batch: &[Message]) {
        for message in batch {
            let lost = gaps.observe(message);
            if lost > 0 {
                self.inner.stats.lost.fetch_add(lost, Ordering::Relaxed);
                metrics::counter!("idem_events_lost_total", "consumer_group" => self.inner.config.group.clone(),
                    "topic" => message.topic.clone())
                .increment(lost);
                tracing::warn!(consumer_group = %self.inner.config.group, topic = %message.topic,
                    partition = message.partition, offset = message.offset, lost,
                    "producer sequence jumped: events were lost before this one");
            }
        }
    }

    /// Acknowledges after commit. A failed acknowledgement loses nothing: the messages come again and are
    /// absorbed as duplicates (a fenced consumer's late commit fails this way), so it is logged, not fatal.
    pub(super) async fn ack<S: Source>(&self, source: &S, ack: &Acknowledgement) {
        if let Err(error) = source.ack(ack).await {
            tracing::warn!(consumer_group = %self.inner.config.group, %error, topic = %ack.partition.topic,
                partition = ack.partition.partition, offset = ack.last_offset,
                "acknowledgement failed; the batch will be delivered again and absorbed as duplicates");
        }
    }
}

/// Reports a worker that unwinds (a panic in a handler) as a fatal error, so the engine stops instead of
/// silently leaving the partition without a worker.
struct PanicGuard {
    fatal: Option<mpsc::UnboundedSender<Error>>,
    partition: Partition,
}

impl Drop for PanicGuard {
    fn drop(&mut self) {
        if let Some(fatal) = self.fatal.take() {
            let p = &self.partition;
            let _ = fatal.send(Error::Worker(format!(
                "the worker of {}/{} panicked (a bug in a handler or in idem); nothing of its batch was acknowledged",
                p.topic, p.partition
            )));
        }
    }
}

/// Aborts a background task when dropped, so it ends with the engine run that started it.
struct AbortOnDrop(JoinHandle<()>);

impl AbortOnDrop {
    /// Aborts the task and waits until it is gone, with everything it held.
    async fn stop(mut self) {
        self.0.abort();
        let _ = (&mut self.0).await;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Tells a background task that begins transactions on the consumers' pool to stop when dropped (a run whose
/// future is dropped), and lets it end by itself: an abort could cut its `BEGIN` short, and sqlx would then return
/// the connection to the pool inside that transaction.
struct StopOnDrop {
    stop: Shutdown,
    task: JoinHandle<()>,
}

impl StopOnDrop {
    /// Tells the task to stop and waits for it: what it has in hand finishes, nothing starts after.
    async fn finish(mut self) {
        self.stop.trigger();
        let _ = (&mut self.task).await;
    }
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.stop.trigger();
    }
}
