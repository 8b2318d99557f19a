//! Flow control per partition: each partition's worker has a lane the poller fills without ever waiting on it,
//! so a partition that retries or waits never stops the others from being read and applied. A lane that holds
//! more than its share is paused at the source where the source can pause ([`PausePartitions`]) and resumed once
//! its worker has caught up; on a source without a pause, the broker's own in-flight limit bounds it, and a cap
//! over all lanes bounds memory. The stall watch reports a lane that holds work and has not committed for
//! [`Config::stall_after`](crate::Config::stall_after).

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::Engine;
use crate::source::{Partition, PausePartitions, Source};
use crate::store::Backend;

/// No message in hand.
const NONE: i64 = -1;

/// One partition's lane: how much its worker holds, when it last moved, and whether the source is paused for it.
pub(crate) struct Lane {
    partition: Partition,
    /// Messages handed to the worker and not yet acknowledged (the batch in hand included).
    queued: AtomicUsize,
    /// When the lane last moved (a commit, or work arriving at an idle lane), in ms since the engine's epoch.
    moved_at: AtomicU64,
    /// The offset of the first message of the batch in hand, `NONE` between batches.
    in_hand: AtomicI64,
    /// Whether the source is paused for this partition; pause and resume happen under this lock.
    paused: Mutex<bool>,
    /// Whether the stall watch has reported this lane as stalled (so it logs once each way).
    reported: Mutex<bool>,
    /// Whether a failed pause was logged (so a source that cannot pause is not logged once per message).
    pause_failed: std::sync::atomic::AtomicBool,
}

/// A partition that holds work and has not committed for [`Config::stall_after`](crate::Config::stall_after).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Stalled {
    /// The consumer group.
    pub consumer_group: String,
    /// The topic (queue, stream, subject partition).
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// Seconds since its last commit (or since work arrived, when it had none to commit).
    pub seconds: u64,
    /// Messages waiting in it, the batch in hand included.
    pub waiting: usize,
    /// The offset of the first message of the batch in hand, when a batch is in hand.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<i64>,
}

/// Every lane of a running engine, and the limits the poller keeps.
pub(crate) struct Lanes {
    epoch: Instant,
    lanes: Mutex<HashMap<Partition, Arc<Lane>>>,
    /// Messages held over all lanes.
    total: AtomicUsize,
    /// Woken whenever a worker finishes a batch (the poller waits on it at the cap).
    progress: Notify,
}

impl Default for Lanes {
    fn default() -> Self {
        Lanes {
            epoch: Instant::now(),
            lanes: Mutex::new(HashMap::new()),
            total: AtomicUsize::new(0),
            progress: Notify::new(),
        }
    }
}

/// The lane sizes for a batch size: a lane above `high` is paused, resumed at `low` or below; the poller waits
/// for progress while all lanes together hold `cap` (which, on a source with a pause, only a great many
/// partitions reach).
pub(crate) struct Limits {
    pub(crate) high: usize,
    pub(crate) low: usize,
    pub(crate) cap: usize,
}

impl Limits {
    pub(crate) fn for_batch(batch_size: usize) -> Self {
        let high = (batch_size * 2).max(256);
        Limits { high, low: high / 2, cap: high * 16 }
    }
}

impl Lanes {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<Partition, Arc<Lane>>> {
        self.lanes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lane of `partition`, new and empty.
    pub(crate) fn open(&self, partition: &Partition) -> Arc<Lane> {
        let lane = Arc::new(Lane {
            partition: partition.clone(),
            queued: AtomicUsize::new(0),
            moved_at: AtomicU64::new(self.now_ms()),
            in_hand: AtomicI64::new(NONE),
            paused: Mutex::new(false),
            reported: Mutex::new(false),
            pause_failed: std::sync::atomic::AtomicBool::new(false),
        });
        self.map().insert(partition.clone(), Arc::clone(&lane));
        lane
    }

    /// Forgets the lane of `partition` (revoked, or the run ended), resuming it at the source if it was paused:
    /// a partition assigned again starts unpaused.
    /// Says whether there was a lane to close.
    pub(crate) fn close(&self, partition: &Partition, pausing: Option<&dyn PausePartitions>) -> bool {
        let Some(lane) = self.map().remove(partition) else { return false };
        self.total.fetch_sub(lane.queued.swap(0, Ordering::SeqCst), Ordering::SeqCst);
        let mut paused = lane.paused.lock().unwrap_or_else(PoisonError::into_inner);
        if *paused && let Some(pausing) = pausing {
            let _ = pausing.resume(std::slice::from_ref(partition));
        }
        *paused = false;
        self.progress.notify_waiters();
        true
    }

    /// Forgets every lane (a new run starts with none, whatever an earlier run left behind).
    pub(crate) fn reset(&self) {
        self.map().clear();
        self.total.store(0, Ordering::SeqCst);
    }

    /// How many partitions have a lane.
    pub(crate) fn count(&self) -> usize {
        self.map().len()
    }

    /// Counts one message into `lane`; pauses its partition at the source when the lane holds `high` or more.
    pub(crate) fn arrived(&self, lane: &Lane, limits: &Limits, pausing: Option<&dyn PausePartitions>) {
        if lane.queued.fetch_add(1, Ordering::SeqCst) == 0 {
            lane.moved_at.store(self.now_ms(), Ordering::SeqCst);
        }
        self.total.fetch_add(1, Ordering::SeqCst);
        let Some(pausing) = pausing else { return };
        if lane.queued.load(Ordering::SeqCst) < limits.high {
            return;
        }
        let mut paused = lane.paused.lock().unwrap_or_else(PoisonError::into_inner);
        if !*paused && lane.queued.load(Ordering::SeqCst) >= limits.high {
            match pausing.pause(std::slice::from_ref(&lane.partition)) {
                Ok(()) => {
                    *paused = true;
                    tracing::debug!(topic = %lane.partition.topic, partition = lane.partition.partition,
                        waiting = lane.queued.load(Ordering::SeqCst), "partition behind: paused at the source");
                }
                Err(error) if !lane.pause_failed.swap(true, Ordering::SeqCst) => {
                    tracing::warn!(topic = %lane.partition.topic, partition = lane.partition.partition, %error,
                        "pausing a partition that is behind failed; its messages are held in memory")
                }
                Err(_) => {}
            }
        }
    }

    /// Whether the poller must wait for progress before it reads more: all lanes together hold the cap.
    pub(crate) fn full(&self, limits: &Limits) -> bool {
        self.total.load(Ordering::SeqCst) >= limits.cap
    }

    /// Resolves when a worker finished a batch (or a lane closed) after this call.
    pub(crate) fn progressed(&self) -> tokio::sync::futures::Notified<'_> {
        self.progress.notified()
    }

    /// The worker took a batch starting at `offset`.
    pub(crate) fn started(&self, lane: &Lane, offset: i64) {
        lane.in_hand.store(offset, Ordering::SeqCst);
    }

    /// The worker committed and acknowledged `n` messages; resumes the partition at the source when it was paused
    /// and the lane is down to `low`. (A batch abandoned at a stop or a revocation is accounted for by
    /// [`Lanes::close`].)
    pub(crate) fn finished(&self, lane: &Lane, n: usize, limits: &Limits, pausing: Option<&dyn PausePartitions>) {
        lane.in_hand.store(NONE, Ordering::SeqCst);
        lane.moved_at.store(self.now_ms(), Ordering::SeqCst);
        let before = lane.queued.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| Some(q.saturating_sub(n)));
        let taken = n.min(before.unwrap_or(0));
        let _ = self.total.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| Some(t.saturating_sub(taken)));
        self.progress.notify_waiters();
        self.resume_if_caught_up(lane, limits, pausing);
    }

    /// Resumes `lane`'s partition at the source when it is paused and down to `low`; a failed resume is tried
    /// again by the next batch or by the stall watch (every second), so a partition never stays paused.
    fn resume_if_caught_up(&self, lane: &Lane, limits: &Limits, pausing: Option<&dyn PausePartitions>) {
        let Some(pausing) = pausing else { return };
        let mut paused = lane.paused.lock().unwrap_or_else(PoisonError::into_inner);
        if *paused && lane.queued.load(Ordering::SeqCst) <= limits.low {
            match pausing.resume(std::slice::from_ref(&lane.partition)) {
                Ok(()) => *paused = false,
                Err(error) => tracing::warn!(topic = %lane.partition.topic, partition = lane.partition.partition,
                    %error, "resuming a paused partition failed; trying again within a second"),
            }
        }
    }

    /// The lanes that hold work and have not moved for `after`.
    pub(crate) fn stalled(&self, group: &str, after: Duration) -> Vec<Stalled> {
        let now = self.now_ms();
        let after = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        let mut stalled: Vec<Stalled> = self
            .map()
            .values()
            .filter_map(|lane| {
                let waiting = lane.queued.load(Ordering::SeqCst);
                let idle = now.saturating_sub(lane.moved_at.load(Ordering::SeqCst));
                (waiting > 0 && idle >= after).then(|| Stalled {
                    consumer_group: group.to_owned(),
                    topic: lane.partition.topic.clone(),
                    partition: lane.partition.partition,
                    seconds: idle / 1000,
                    waiting,
                    offset: Some(lane.in_hand.load(Ordering::SeqCst)).filter(|o| *o != NONE),
                })
            })
            .collect();
        stalled.sort_by(|a, b| (&a.topic, a.partition).cmp(&(&b.topic, b.partition)));
        stalled
    }
}

impl<DB: Backend> Engine<DB> {
    /// Every second while the engine runs: the gauges of each lane (`idem_partition_stalled_seconds`,
    /// `idem_partition_waiting_messages`), a WARN when a lane stalls, an INFO when it moves again, and a resume of a
    /// paused lane that caught up while its last resume failed. The gauges are written under the lanes' lock, so
    /// a lane closed meanwhile keeps the zeros [`Engine::close_lane`] wrote.
    pub(super) async fn watch_stalls<S: Source>(self, source: Arc<S>) {
        let config = &self.inner.config;
        let lanes = &self.inner.lanes;
        let limits = Limits::for_batch(config.batch_size);
        let stall_after = u64::try_from(config.stall_after.as_millis()).unwrap_or(u64::MAX);
        let mut tick = tokio::time::interval(Duration::from_secs(1).min(config.stall_after));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = lanes.now_ms();
            let all = lanes.map();
            for lane in all.values() {
                lanes.resume_if_caught_up(lane, &limits, source.pausing());
                let waiting = lane.queued.load(Ordering::SeqCst);
                let idle = now.saturating_sub(lane.moved_at.load(Ordering::SeqCst));
                let stalled = waiting > 0 && idle >= stall_after;
                let (topic, partition) = (lane.partition.topic.clone(), lane.partition.partition.to_string());
                metrics::gauge!("idem_partition_stalled_seconds", "consumer_group" => config.group.clone(),
                    "topic" => topic.clone(), "partition" => partition.clone())
                .set(if stalled { idle as f64 / 1000.0 } else { 0.0 });
                metrics::gauge!("idem_partition_waiting_messages", "consumer_group" => config.group.clone(),
                    "topic" => topic, "partition" => partition)
                .set(waiting as f64);
                let mut reported = lane.reported.lock().unwrap_or_else(PoisonError::into_inner);
                let in_hand = lane.in_hand.load(Ordering::SeqCst);
                if stalled && !*reported {
                    *reported = true;
                    tracing::warn!(consumer_group = %config.group, topic = %lane.partition.topic,
                        partition = lane.partition.partition, offset = in_hand, waiting, seconds = idle / 1000,
                        "partition stalled: it holds work and has not committed for {:?}; the other partitions go \
                         on. The retry warnings name the event at fault; /readyz lists the partition",
                        config.stall_after);
                } else if !stalled && *reported {
                    *reported = false;
                    tracing::info!(consumer_group = %config.group, topic = %lane.partition.topic,
                        partition = lane.partition.partition, "partition moving again");
                }
            }
        }
    }
}

impl<DB: Backend> Engine<DB> {
    /// Closes the lane of `partition` and clears its gauges (where it had a lane).
    pub(super) fn close_lane<S: Source>(&self, partition: &Partition, source: &S) {
        if !self.inner.lanes.close(partition, source.pausing()) {
            return;
        }
        let group = self.inner.config.group.clone();
        let (topic, number) = (partition.topic.clone(), partition.partition.to_string());
        metrics::gauge!("idem_partition_stalled_seconds", "consumer_group" => group.clone(), "topic" => topic.clone(),
            "partition" => number.clone())
        .set(0.0);
        metrics::gauge!("idem_partition_waiting_messages", "consumer_group" => group, "topic" => topic,
            "partition" => number)
        .set(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the calls a source's pause gets.
    #[derive(Default)]
    struct Recorded(Mutex<Vec<(&'static str, Partition)>>);

    impl PausePartitions for Recorded {
        fn pause(&self, partitions: &[Partition]) -> Result<(), crate::SourceError> {
            self.0.lock().unwrap().extend(partitions.iter().map(|p| ("pause", p.clone())));
            Ok(())
        }

        fn resume(&self, partitions: &[Partition]) -> Result<(), crate::SourceError> {
            self.0.lock().unwrap().extend(partitions.iter().map(|p| ("resume", p.clone())));
            Ok(())
        }
    }

    #[test]
    fn a_lane_is_paused_at_its_high_mark_once_and_resumed_at_its_low_mark() {
        let (lanes, limits, source) = (Lanes::default(), Limits::for_batch(10), Recorded::default());
        let p = Partition { topic: "t".into(), partition: 3 };
        let lane = lanes.open(&p);
        for _ in 0..limits.high + 50 {
            lanes.arrived(&lane, &limits, Some(&source));
        }
        assert_eq!(*source.0.lock().unwrap(), vec![("pause", p.clone())], "paused once, at the high mark");
        lanes.finished(&lane, 10, &limits, Some(&source));
        assert_eq!(source.0.lock().unwrap().len(), 1, "still above the low mark");
        lanes.finished(&lane, limits.high + 40 - limits.low, &limits, Some(&source));
        assert_eq!(source.0.lock().unwrap().last(), Some(&("resume", p.clone())));
        assert_eq!(lane.queued.load(Ordering::SeqCst), limits.low);

        // A lane with work and no commit for the stall time is stalled; an empty one never is.
        assert!(lanes.stalled("g", Duration::from_secs(3600)).is_empty());
        let stalled = lanes.stalled("g", Duration::ZERO);
        assert_eq!(stalled.len(), 1);
        assert_eq!((stalled[0].partition, stalled[0].waiting), (3, limits.low));
        lanes.finished(&lane, limits.low, &limits, Some(&source));
        assert!(lanes.stalled("g", Duration::ZERO).is_empty());

        // Closing a paused lane resumes it, and the cap counts every lane.
        for _ in 0..limits.high {
            lanes.arrived(&lane, &limits, Some(&source));
        }
        assert!(lanes.close(&p, Some(&source)));
        assert_eq!(source.0.lock().unwrap().last(), Some(&("resume", p.clone())));
        assert_eq!(lanes.total.load(Ordering::SeqCst), 0);
        assert_eq!(lanes.count(), 0);
    }

    #[test]
    fn without_a_pause_the_lanes_fill_up_to_the_cap() {
        let (lanes, limits) = (Lanes::default(), Limits::for_batch(100));
        let lane = lanes.open(&Partition { topic: "t".into(), partition: 0 });
        for _ in 0..limits.cap - 1 {
            lanes.arrived(&lane, &limits, None);
        }
        assert!(!lanes.full(&limits));
        lanes.arrived(&lane, &limits, None);
        assert!(lanes.full(&limits));
        lanes.finished(&lane, 100, &limits, None);
        assert!(!lanes.full(&limits));
    }
}
