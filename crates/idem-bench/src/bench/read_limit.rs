//! A broker's read limit, read the way idem reads: the same source with the same settings (prefetch, batch,
//! partitions), one worker per partition that takes what has arrived, up to a batch, and acknowledges it (awaited)
//! before taking the next, as the engine's workers do after each commit; no database. Its rate is the broker's
//! share of an end-to-end leg's ceiling.

use std::collections::HashMap;

use tokio::sync::mpsc;

use super::*;

/// What one read to the end measured.
pub(super) struct ReadLimit {
    /// Messages read.
    pub count: u64,
    /// Messages per second, from the first message received to the last acknowledgement done (the wait that
    /// tells the end is not counted).
    pub per_second: f64,
}

/// Reads `source` to its end as idem does, batches of up to `batch_size` per partition.
pub(super) async fn read_as_idem_does<S: Source>(source: S, batch_size: usize) -> anyhow::Result<ReadLimit> {
    let source = Arc::new(source);
    let mut lanes: HashMap<(String, i32), mpsc::UnboundedSender<Message>> = HashMap::new();
    let mut workers = tokio::task::JoinSet::new();
    let (mut count, mut first) = (0u64, None::<Instant>);
    loop {
        match source.recv().await? {
            Some(Received::Message(m)) => {
                first.get_or_insert_with(Instant::now);
                count += 1;
                let lane = lanes.entry((m.topic.clone(), m.partition)).or_insert_with(|| {
                    let (tx, rx) = mpsc::unbounded_channel();
                    workers.spawn(worker(Arc::clone(&source), rx, batch_size));
                    tx
                });
                // A worker that stopped has failed: its error comes out when it is joined below.
                let _ = lane.send(m);
            }
            Some(Received::Revoked { drained, .. }) => drained.done(),
            None => break,
        }
    }
    drop(lanes);
    let first = first.context("nothing was read")?;
    let mut last = first;
    while let Some(done) = workers.join_next().await {
        if let Some(at) = done.context("a partition's reader panicked")?? {
            last = last.max(at);
        }
    }
    let span = last.duration_since(first).as_secs_f64().max(1e-3);
    Ok(ReadLimit { count, per_second: count as f64 / span })
}

/// One partition's worker: a batch of what has arrived, acknowledged, then the next; returns when its last
/// acknowledgement was done.
async fn worker<S: Source>(
    source: Arc<S>,
    mut arrivals: mpsc::UnboundedReceiver<Message>,
    batch_size: usize,
) -> anyhow::Result<Option<Instant>> {
    let (mut batch, mut last) = (Vec::with_capacity(batch_size), None);
    while arrivals.recv_many(&mut batch, batch_size).await > 0 {
        if let Some(ack) = Acknowledgement::of(&batch) {
            source.ack(&ack).await?;
        }
        last = Some(Instant::now());
        batch.clear();
    }
    Ok(last)
}
