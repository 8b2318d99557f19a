//! The producer side of the embedded log: appends serialized by a file lock, one write per record.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::record::{Slot, encode, read_durable, write_durable};
use super::{EmbeddedLog, damaged_tail, io_error, lock, permanent, walk_offsets};
use crate::engine::now_ms;
use crate::message::Message;
use crate::source::{Publisher, SourceError};

/// Appends messages to an [`EmbeddedLog`]'s topics; safe to use from several processes at once.
///
/// Cheap to clone; clones share open files and the round-robin position.
#[derive(Debug, Clone)]
pub struct LogProducer {
    inner: Arc<ProducerInner>,
}

#[derive(Debug)]
struct ProducerInner {
    log: EmbeddedLog,
    /// Partition count and next round-robin partition per topic.
    topics: Mutex<HashMap<String, TopicState>>,
    writers: Mutex<HashMap<(String, i32), SharedWriter>>,
}

type SharedWriter = Arc<Mutex<PartWriter>>;

#[derive(Debug)]
struct TopicState {
    partitions: i32,
    next: i32,
}

#[derive(Debug)]
struct PartWriter {
    path: PathBuf,
    /// Opened for read and append.
    file: File,
    /// Record count and byte length after our last append; `None` before the first one or after a failed write.
    known: Option<(i64, u64)>,
    /// Written since the last fsync.
    dirty: bool,
}

/// Unlocks a file on drop.
struct FileLockGuard<'a>(&'a File);

impl Drop for FileLockGuard<'_> {
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

impl PartWriter {
    /// Appends one encoded record under the exclusive file lock; returns its offset. A torn tail is truncated
    /// first; damage at the end of the file refuses the append (nothing is truncated).
    fn append(&mut self, record: &[u8], sync: bool) -> Result<i64, SourceError> {
        self.file.lock().map_err(|e| io_error("lock", &self.path, e))?;
        let _guard = FileLockGuard(&self.file);
        let len = self.file.metadata().map_err(|e| io_error("stat", &self.path, e))?.len();
        let (count, end) = match self.known {
            Some((count, known_len)) if known_len == len => (count, len),
            // Another process appended since (or nothing is known yet): count what is there.
            known => {
                let (count, pos) = known.filter(|&(_, known_len)| known_len < len).unwrap_or((0, 0));
                let walked = walk_offsets(&self.file, &self.path, pos, count, len, None)?;
                match walked.stop {
                    Some(Slot::DamagedTail { pos, what }) => {
                        return Err(damaged_tail(&self.path, walked.count, pos, &what));
                    }
                    Some(Slot::Incomplete { pos }) => {
                        // Under the lock no one else is writing, and the bytes are past the durable length with
                        // nothing valid after them: the tail of a writer that crashed.
                        tracing::warn!(
                            path = %self.path.display(),
                            offset = walked.count,
                            bytes = len - pos,
                            "truncating a torn record left by a crashed writer"
                        );
                        self.file.set_len(pos).map_err(|e| io_error("truncate", &self.path, e))?;
                    }
                    _ => {}
                }
                (walked.count, walked.pos)
            }
        };
        self.known = None;
        (&self.file).write_all(record).map_err(|e| io_error("append to", &self.path, e))?;
        self.dirty = true;
        self.known = Some((count + 1, end + record.len() as u64));
        if sync {
            sync_and_record(&self.file, &self.path, self.known)?;
            self.dirty = false;
        }
        Ok(count)
    }
}

/// Fsyncs `file` and records its durable length: the end of this writer's last append (`known`), a record
/// boundary it counted itself. The caller holds the file lock, so two processes never lower each other's record.
fn sync_and_record(file: &File, path: &Path, known: Option<(i64, u64)>) -> Result<(), SourceError> {
    file.sync_data().map_err(|e| io_error("fsync", path, e))?;
    if let Some((_, end)) = known
        && read_durable(path)? < end
    {
        write_durable(path, end)?;
    }
    Ok(())
}

impl EmbeddedLog {
    /// A producer appending to this log's topics.
    pub fn producer(&self) -> LogProducer {
        LogProducer {
            inner: Arc::new(ProducerInner {
                log: self.clone(),
                topics: Mutex::new(HashMap::new()),
                writers: Mutex::new(HashMap::new()),
            }),
        }
    }
}

impl LogProducer {
    /// The log this producer appends to.
    pub fn log(&self) -> &EmbeddedLog {
        &self.inner.log
    }

    /// Appends a message to `topic` and returns its partition and offset. The partition is `crc32(key) %
    /// partitions` when a key is given, round-robin otherwise. Not durable until [`LogProducer::flush`].
    pub fn send(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<(i32, i64), SourceError> {
        let partition = self.choose_partition(topic, key)?;
        let offset = self.append(topic, partition, key, payload, headers, false)?;
        Ok((partition, offset))
    }

    /// Appends a message to `partition` of `topic` and returns its offset. Not durable until
    /// [`LogProducer::flush`].
    pub fn send_to(
        &self,
        topic: &str,
        partition: i32,
        key: Option<&[u8]>,
        payload: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<i64, SourceError> {
        let partitions = self.with_topic(topic, |state| state.partitions)?;
        if !(0..partitions).contains(&partition) {
            return Err(permanent(format!(
                "topic {topic} has {partitions} partitions, there is no partition {partition}"
            )));
        }
        self.append(topic, partition, key, payload, headers, false)
    }

    /// Fsyncs every partition file written since the last flush.
    pub fn flush(&self) -> Result<(), SourceError> {
        let writers: Vec<SharedWriter> = lock(&self.inner.writers)?.values().cloned().collect();
        for writer in writers {
            let mut writer = lock(&writer)?;
            if writer.dirty {
                writer.file.lock().map_err(|e| io_error("lock", &writer.path, e))?;
                let synced = sync_and_record(&writer.file, &writer.path, writer.known);
                let _ = writer.file.unlock();
                synced?;
                writer.dirty = false;
            }
        }
        Ok(())
    }

    fn with_topic<R>(&self, topic: &str, f: impl FnOnce(&mut TopicState) -> R) -> Result<R, SourceError> {
        let mut topics = lock(&self.inner.topics)?;
        if let Some(state) = topics.get_mut(topic) {
            return Ok(f(state));
        }
        let partitions = self.inner.log.partitions(topic)?;
        let state = topics.entry(topic.to_owned()).or_insert(TopicState { partitions, next: 0 });
        Ok(f(state))
    }

    fn choose_partition(&self, topic: &str, key: Option<&[u8]>) -> Result<i32, SourceError> {
        self.with_topic(topic, |state| match key {
            // partitions >= 1 and the remainder < partitions, so both casts are lossless.
            Some(key) => (crc32fast::hash(key) % state.partitions as u32) as i32,
            None => {
                let partition = state.next;
                state.next = (state.next + 1) % state.partitions;
                partition
            }
        })
    }

    fn append(
        &self,
        topic: &str,
        partition: i32,
        key: Option<&[u8]>,
        payload: &[u8],
        headers: &[(String, Vec<u8>)],
        sync: bool,
    ) -> Result<i64, SourceError> {
        let headers = crate::propagation::with_current(headers);
        let record = encode(now_ms(), key, payload, &headers)?;
        let writer = {
            let mut writers = lock(&self.inner.writers)?;
            match writers.get(&(topic.to_owned(), partition)) {
                Some(writer) => writer.clone(),
                None => {
                    let path = self.inner.log.partition_path(topic, partition);
                    let file = OpenOptions::new()
                        .read(true)
                        .append(true)
                        .open(&path)
                        .map_err(|e| io_error("open", &path, e))?;
                    let writer = Arc::new(Mutex::new(PartWriter { path, file, known: None, dirty: false }));
                    writers.insert((topic.to_owned(), partition), writer.clone());
                    writer
                }
            }
        };
        let mut writer = lock(&writer)?;
        writer.append(&record, sync)
    }
}

impl Publisher for LogProducer {
    /// Appends `message` to `message.topic` (partition by key, round-robin without) and fsyncs it.
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let key = message.key.as_deref();
        let partition = self.choose_partition(&message.topic, key)?;
        self.append(&message.topic, partition, key, &message.payload, &message.headers, true)?;
        Ok(())
    }
}
