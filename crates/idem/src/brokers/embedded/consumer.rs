//! The consumer side of the embedded log: a group's partitions locked by one process, read in offset order.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use super::record::{Slot, Walker, decode};
use super::{
    CONTEXT, EmbeddedLog, damaged_tail, io_error, lock, permanent, read_offset, validate_name, walk_offsets,
    write_offset,
};
use crate::message::Message;
use crate::source::{Acknowledgement, Partition, PausePartitions, Received, Source, SourceError};

/// Records read from one partition per refill, at most.
const READ_CHUNK: usize = 256;

/// Takes the group's lock on partition `p` (`<p>.lock` in `group_dir`); `None` when another process holds it.
/// The kernel releases it when the file is closed or the process dies, even by SIGKILL.
pub(super) fn lock_group_partition(group_dir: &Path, p: i32) -> Result<Option<File>, SourceError> {
    let lock_path = group_dir.join(format!("{p}.lock"));
    let lock_file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| io_error("open", &lock_path, e))?;
    match lock_file.try_lock() {
        Ok(()) => Ok(Some(lock_file)),
        Err(TryLockError::WouldBlock) => Ok(None),
        Err(TryLockError::Error(e)) => Err(io_error("lock", &lock_path, e)),
    }
}

impl EmbeddedLog {
    /// A consumer of `group` reading `topics`. It takes every partition of those topics that no other consumer of
    /// the group holds, and starts each at the group's committed offset. An error if it gets no partition at all.
    pub fn consumer(&self, group: &str, topics: &[&str], options: ConsumerOptions) -> Result<LogConsumer, SourceError> {
        validate_name("group", group)?;
        if topics.is_empty() {
            return Err(permanent(format!("consumer of group {group} needs at least one topic")));
        }
        let mut topic_list: Vec<&str> = Vec::new();
        for topic in topics {
            if !topic_list.contains(topic) {
                topic_list.push(topic);
            }
        }
        let mut parts = Vec::new();
        let mut total = 0;
        for &topic in &topic_list {
            let partitions = self.partitions(topic)?;
            let group_dir = self.group_dir(group, topic);
            fs::create_dir_all(&group_dir).map_err(|e| io_error("create directory", &group_dir, e))?;
            for p in 0..partitions {
                total += 1;
                if let Some(part) = self.claim(group, topic, p, &group_dir)? {
                    parts.push(part);
                }
            }
        }
        if parts.is_empty() {
            return Err(SourceError::transient(
                CONTEXT,
                format!(
                    "all {total} partitions of topics {} for group {group} are held by other consumers of the group",
                    topic_list.join(", ")
                ),
            ));
        }
        let assignment: Vec<Partition> = parts.iter().map(|p: &PartReader| p.partition.clone()).collect();
        tracing::debug!(consumer_group = group, ?assignment, "embedded log consumer started");
        Ok(LogConsumer {
            group: group.to_owned(),
            options,
            assignment,
            state: Mutex::new(ConsumerState {
                parts,
                buffer: VecDeque::new(),
                next_part: 0,
                pending: None,
                paused: Default::default(),
            }),
        })
    }

    /// Locks partition `p` of `topic` for `group` and positions a reader at the committed offset; `None` if
    /// another consumer holds it.
    fn claim(&self, group: &str, topic: &str, p: i32, group_dir: &Path) -> Result<Option<PartReader>, SourceError> {
        let Some(lock_file) = lock_group_partition(group_dir, p)? else { return Ok(None) };
        let offset_path = group_dir.join(format!("{p}.offset"));
        let committed = read_offset(&offset_path)?;
        let path = self.partition_path(topic, p);
        let file = File::open(&path).map_err(|e| io_error("open", &path, e))?;
        let len = file.metadata().map_err(|e| io_error("stat", &path, e))?.len();
        let walked = walk_offsets(&file, &path, 0, 0, len, Some(committed))?;
        let (count, pos) = (walked.count, walked.pos);
        if count < committed {
            if let Some(Slot::DamagedTail { pos, what }) = walked.stop {
                return Err(damaged_tail(&path, count, pos, &what));
            }
            return Err(permanent(format!(
                "group {group} committed offset {committed} of {topic}/{p}, but {} holds only {count} complete \
                 records (was the topic recreated?)",
                path.display()
            )));
        }
        Ok(Some(PartReader {
            partition: Partition { topic: topic.to_owned(), partition: p },
            path,
            group: group.to_owned(),
            log_dir: self.dir.clone(),
            file,
            pos,
            next: count,
            committed,
            idle_at: None,
            offset_path,
            _lock: lock_file,
        }))
    }
}

/// How a [`LogConsumer`] behaves at the end of its partitions.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// Return `Ok(None)` from [`Source::recv`] once every owned partition is read to its end, instead of waiting
    /// for new messages.
    pub stop_at_end: bool,
    /// How often to look for new messages when every owned partition is read to its end. Default 20 ms.
    pub poll_interval: Duration,
    /// About how many messages to read ahead into memory. Default 1024.
    pub max_buffered: usize,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        ConsumerOptions { stop_at_end: false, poll_interval: Duration::from_millis(20), max_buffered: 1024 }
    }
}

/// A consumer of one group reading the partitions it locked; a [`Source`] for the engine.
///
/// Dropping it releases its partitions. See [`EmbeddedLog::consumer`].
#[derive(Debug)]
pub struct LogConsumer {
    group: String,
    options: ConsumerOptions,
    assignment: Vec<Partition>,
    state: Mutex<ConsumerState>,
}

#[derive(Debug)]
struct ConsumerState {
    parts: Vec<PartReader>,
    buffer: VecDeque<Message>,
    /// The partition the next refill starts with.
    next_part: usize,
    /// An error met while refilling, returned once the messages read before it are delivered.
    pending: Option<SourceError>,
    /// Partitions the engine paused: not read until resumed.
    paused: std::collections::HashSet<Partition>,
}

#[derive(Debug)]
pub(super) struct PartReader {
    partition: Partition,
    group: String,
    log_dir: PathBuf,
    path: PathBuf,
    file: File,
    /// Byte position of offset `next`.
    pos: u64,
    /// The next offset to read.
    next: i64,
    /// The committed offset (the next offset to read after a restart).
    committed: i64,
    /// The file's length when the last read found nothing more: while it stays so, a poll reads nothing.
    idle_at: Option<u64>,
    offset_path: PathBuf,
    /// Holds the group's lock on the partition until dropped.
    _lock: File,
}

impl PartReader {
    /// Reads up to `limit` records into `out`. An incomplete record past the durable length is not written yet:
    /// stop there. Damage, or a record whose body does not decode, is a permanent error (after the records
    /// before it), and stays one: the reader never moves past it.
    fn read_into(&mut self, limit: usize, out: &mut VecDeque<Message>) -> Result<(), SourceError> {
        let len = self.file.metadata().map_err(|e| io_error("stat", &self.path, e))?.len();
        if self.idle_at == Some(len) {
            return Ok(());
        }
        let mut walker = Walker::new(&self.file, &self.path, self.pos, len)?;
        for _ in 0..limit {
            match walker.next_slot()? {
                Slot::Record { body, .. } => {
                    let message = decode(&body, &self.partition, self.next)
                        .map_err(|why| self.damaged(&format!("the record's body does not decode: {why}"), None))?;
                    out.push_back(message);
                    self.pos = walker.pos();
                    self.next += 1;
                }
                Slot::Damaged { end, what, .. } => return Err(self.damaged(&what, Some(end))),
                Slot::DamagedTail { pos, what } => return Err(damaged_tail(&self.path, self.next, pos, &what)),
                Slot::Incomplete { .. } | Slot::End => {
                    self.idle_at = Some(len);
                    break;
                }
            }
        }
        Ok(())
    }

    /// The error for the record at `self.next`: what is wrong, where, and how an operator moves past it.
    fn damaged(&self, what: &str, end: Option<u64>) -> SourceError {
        let Partition { topic, partition } = &self.partition;
        let range = match end {
            Some(end) => format!("bytes {}..{end}", self.pos),
            None => format!("from byte {}", self.pos),
        };
        permanent(format!(
            "damaged record in {} at offset {} ({range}): {what}. The records after it are intact and keep their \
             offsets. Inspect it with `idem log inspect --log-dir {dir} --topic {topic}`; move group {group} past it, \
             writing its bytes to the dead letters, with `idem log skip --log-dir {dir} --group {group} --topic \
             {topic} --partition {partition} --offset {} --database-url <url>`",
            self.path.display(),
            self.next,
            self.next,
            dir = self.log_dir.display(),
            group = self.group,
        ))
    }
}

impl ConsumerState {
    /// Reads up to a chunk from every owned partition, round-robin, into the (empty) buffer.
    fn refill(&mut self, max_buffered: usize) -> Result<(), SourceError> {
        let count = self.parts.len();
        let max_buffered = max_buffered.max(1);
        let chunk = (max_buffered / count).clamp(1, READ_CHUNK);
        for i in 0..count {
            if self.buffer.len() >= max_buffered {
                break;
            }
            let index = (self.next_part + i) % count;
            if self.paused.contains(&self.parts[index].partition) {
                continue;
            }
            self.parts[index].read_into(chunk, &mut self.buffer)?;
        }
        self.next_part = (self.next_part + 1) % count;
        Ok(())
    }

    /// The next buffered message, refilling if needed; an error once the messages before it are delivered.
    fn next(&mut self, max_buffered: usize) -> Result<Option<Message>, SourceError> {
        if let Some(message) = self.buffer.pop_front() {
            return Ok(Some(message));
        }
        if let Some(error) = self.pending.take() {
            return Err(error);
        }
        if let Err(error) = self.refill(max_buffered) {
            if self.buffer.is_empty() {
                return Err(error);
            }
            self.pending = Some(error);
        }
        Ok(self.buffer.pop_front())
    }
}

impl LogConsumer {
    /// The partitions this consumer owns.
    pub fn assignment(&self) -> Vec<Partition> {
        self.assignment.clone()
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.group
    }
}

/// Pausing a partition stops reading it from its file; what was read ahead is still delivered.
impl PausePartitions for LogConsumer {
    fn pause(&self, partitions: &[Partition]) -> Result<(), SourceError> {
        lock(&self.state)?.paused.extend(partitions.iter().cloned());
        Ok(())
    }

    fn resume(&self, partitions: &[Partition]) -> Result<(), SourceError> {
        let mut state = lock(&self.state)?;
        for partition in partitions {
            state.paused.remove(partition);
        }
        Ok(())
    }
}

impl Source for LogConsumer {
    /// The next message of the owned partitions, in offset order per partition. At the end of every partition,
    /// `Ok(None)` with [`ConsumerOptions::stop_at_end`] (once no partition is paused); otherwise waits for new
    /// messages.
    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        loop {
            let paused = {
                let mut state = lock(&self.state)?;
                if let Some(message) = state.next(self.options.max_buffered)? {
                    return Ok(Some(Received::Message(message)));
                }
                !state.paused.is_empty()
            };
            if self.options.stop_at_end && !paused {
                return Ok(None);
            }
            tokio::time::sleep(self.options.poll_interval).await;
        }
    }

    fn pausing(&self) -> Option<&dyn PausePartitions> {
        Some(self)
    }

    /// Persists `offset + 1` as the group's committed offset of the partition. Acknowledgements that would not
    /// move it forward are ignored; a partition this consumer does not own is an error.
    async fn ack(&self, ack: &Acknowledgement) -> Result<(), SourceError> {
        let (topic, partition, offset) = (ack.partition.topic.as_str(), ack.partition.partition, ack.last_offset);
        let mut state = lock(&self.state)?;
        let Some(part) =
            state.parts.iter_mut().find(|p| p.partition.topic == topic && p.partition.partition == partition)
        else {
            return Err(permanent(format!(
                "cannot acknowledge {topic}/{partition}: this consumer of group {} does not own it",
                self.group
            )));
        };
        if offset < 0 || offset >= part.next {
            return Err(permanent(format!(
                "cannot acknowledge offset {offset} of {topic}/{partition}: it was not delivered (next offset is {})",
                part.next
            )));
        }
        let committed = offset + 1;
        if committed <= part.committed {
            return Ok(());
        }
        write_offset(&part.offset_path, committed)?;
        part.committed = committed;
        Ok(())
    }
}
