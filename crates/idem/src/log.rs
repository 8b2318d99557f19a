//! The embedded log: a file-backed, partitioned, append-only log with consumer groups, for local use, tests and
//! `idem demo`.
//!
//! Layout under the log directory:
//! * `topics/<topic>/meta.json` holds `{"partitions": N}`; `topics/<topic>/<p>.log` is partition `p`.
//! * `groups/<group>/<topic>/<p>.offset` holds the group's committed offset (the next offset to read);
//!   `groups/<group>/<topic>/<p>.lock` is locked by the consumer of the group that owns partition `p`.
//!
//! A record is `u32 LE body_len | u32 LE crc32(body) | body`, with body = `i64 LE timestamp_ms | u32 LE key_len
//! (u32::MAX = no key) | key | u16 LE header_count | (u16 LE name_len, name, u32 LE value_len, value)* | payload`.
//! A record's offset is its index in the partition file.
//!
//! Guarantees:
//! * Appends from any number of processes are serialized by an exclusive lock on the partition file, and each
//!   record is written with a single write. A record cut short by a crashed writer is never delivered; the next
//!   append truncates it away. [`LogProducer::flush`] and [`Publisher::publish`] fsync.
//! * A partition is owned by at most one consumer of a group at a time: an OS file lock on its `.lock` file,
//!   released by the kernel when the process dies, even by SIGKILL. Several processes of one group split the
//!   partitions between them. Ownership never moves while a consumer lives, so the log never yields
//!   [`Received::Revoked`].
//! * Committed offsets are replaced atomically (write, fsync, rename). Messages not acknowledged are delivered
//!   again to the next consumer of the partition. A complete record whose checksum does not match is a permanent
//!   error, never skipped.
//!
//! All file I/O is short, synchronous and done on the calling thread.

use std::collections::{HashMap, VecDeque};
use std::fmt::Display;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::message::Message;
use crate::source::{Partition, Publisher, Received, Source, SourceError};

const CONTEXT: &str = "embedded log";
/// `u32 body_len | u32 crc32`.
const HEADER_LEN: u64 = 8;
/// `i64 timestamp | u32 key_len | u16 header_count`.
const MIN_BODY_LEN: usize = 8 + 4 + 2;
const NO_KEY: u32 = u32::MAX;
/// Records read from one partition per refill, at most.
const READ_CHUNK: usize = 256;
const MAX_NAME_LEN: usize = 200;

fn permanent(message: impl Display) -> SourceError {
    SourceError::permanent(CONTEXT, message)
}

/// An I/O failure on `path`, transient when the error kind says a retry may help.
fn io_error(what: &str, path: &Path, e: io::Error) -> SourceError {
    let message = format!("cannot {what} {}: {e}", path.display());
    match e.kind() {
        io::ErrorKind::Interrupted
        | io::ErrorKind::WouldBlock
        | io::ErrorKind::TimedOut
        | io::ErrorKind::StorageFull
        | io::ErrorKind::QuotaExceeded => SourceError::transient(CONTEXT, message),
        _ => permanent(message),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> Result<MutexGuard<'_, T>, SourceError> {
    mutex.lock().map_err(|_| permanent("internal state poisoned by an earlier panic"))
}

/// Topic and group names: `[A-Za-z0-9._-]+`, not `.` or `..`, at most 200 characters.
fn validate_name(kind: &str, name: &str) -> Result<(), SourceError> {
    let valid = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if valid {
        Ok(())
    } else {
        Err(permanent(format!(
            "invalid {kind} name {name:?}: use 1 to {MAX_NAME_LEN} characters of [A-Za-z0-9._-], not . or .."
        )))
    }
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)).unwrap_or(0)
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Meta {
    partitions: i32,
}

/// An embedded, file-backed, partitioned log rooted at a directory (see the [module documentation](self)).
///
/// Cheap to clone; any number of handles, in any number of processes, may use the same directory.
#[derive(Debug, Clone)]
pub struct EmbeddedLog {
    dir: PathBuf,
}

impl EmbeddedLog {
    /// Opens the log in `dir`, creating the directory if needed.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, SourceError> {
        let dir = dir.as_ref().to_path_buf();
        for sub in ["topics", "groups"] {
            let path = dir.join(sub);
            fs::create_dir_all(&path).map_err(|e| io_error("create directory", &path, e))?;
        }
        Ok(EmbeddedLog { dir })
    }

    /// The directory the log lives in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn topic_dir(&self, topic: &str) -> PathBuf {
        self.dir.join("topics").join(topic)
    }

    fn partition_path(&self, topic: &str, partition: i32) -> PathBuf {
        self.topic_dir(topic).join(format!("{partition}.log"))
    }

    fn group_dir(&self, group: &str, topic: &str) -> PathBuf {
        self.dir.join("groups").join(group).join(topic)
    }

    /// Creates `topic` with `partitions` partitions. Idempotent when the topic exists with the same count; an
    /// error when it exists with a different one.
    pub fn create_topic(&self, topic: &str, partitions: i32) -> Result<(), SourceError> {
        validate_name("topic", topic)?;
        if partitions < 1 {
            return Err(permanent(format!("topic {topic} needs at least 1 partition, not {partitions}")));
        }
        let dir = self.topic_dir(topic);
        if let Some(existing) = self.read_meta(topic)? {
            return self.check_count(topic, existing, partitions);
        }
        fs::create_dir_all(&dir).map_err(|e| io_error("create directory", &dir, e))?;
        for p in 0..partitions {
            let path = self.partition_path(topic, p);
            OpenOptions::new().create(true).append(true).open(&path).map_err(|e| io_error("create", &path, e))?;
        }
        // Publish meta.json only if no one else did: write a private file, then hard-link it into place, which
        // fails if the name exists. Readers never see a half-written meta.json.
        static UNIQUE: AtomicU64 = AtomicU64::new(0);
        let tmp = dir.join(format!("meta.json.{}.{}.tmp", std::process::id(), UNIQUE.fetch_add(1, Ordering::Relaxed)));
        let meta_path = dir.join("meta.json");
        let body = serde_json::to_vec(&Meta { partitions }).map_err(permanent)?;
        let written = File::create(&tmp)
            .and_then(|mut f| f.write_all(&body).and_then(|()| f.sync_all()))
            .map_err(|e| io_error("write", &tmp, e))
            .and_then(|()| match fs::hard_link(&tmp, &meta_path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
                Err(e) => Err(io_error("create", &meta_path, e)),
            });
        let _ = fs::remove_file(&tmp);
        written?;
        // Someone may have created the topic concurrently.
        match self.read_meta(topic)? {
            Some(existing) => self.check_count(topic, existing, partitions),
            None => Err(permanent(format!("{} vanished while creating topic {topic}", meta_path.display()))),
        }
    }

    fn check_count(&self, topic: &str, existing: i32, wanted: i32) -> Result<(), SourceError> {
        if existing == wanted {
            Ok(())
        } else {
            Err(permanent(format!(
                "topic {topic} already exists in {} with {existing} partitions, not {wanted}",
                self.dir.display()
            )))
        }
    }

    fn read_meta(&self, topic: &str) -> Result<Option<i32>, SourceError> {
        let path = self.topic_dir(topic).join("meta.json");
        let text = match fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_error("read", &path, e)),
        };
        match serde_json::from_slice::<Meta>(&text) {
            Ok(meta) if meta.partitions >= 1 => Ok(Some(meta.partitions)),
            Ok(meta) => Err(permanent(format!("{} is corrupt: {} partitions", path.display(), meta.partitions))),
            Err(e) => Err(permanent(format!("{} is corrupt: {e}", path.display()))),
        }
    }

    /// The number of partitions of `topic`; an error if the topic does not exist.
    pub fn partitions(&self, topic: &str) -> Result<i32, SourceError> {
        validate_name("topic", topic)?;
        self.read_meta(topic)?.ok_or_else(|| {
            permanent(format!(
                "topic {topic} does not exist in {}: create it with EmbeddedLog::create_topic first",
                self.dir.display()
            ))
        })
    }

    /// The end offset (the number of complete records) of every partition of `topic`, indexed by partition.
    pub fn end_offsets(&self, topic: &str) -> Result<Vec<i64>, SourceError> {
        let partitions = self.partitions(topic)?;
        (0..partitions)
            .map(|p| {
                let path = self.partition_path(topic, p);
                let file = File::open(&path).map_err(|e| io_error("open", &path, e))?;
                let len = file.metadata().map_err(|e| io_error("stat", &path, e))?.len();
                let (count, _) = skip_records(&file, 0, 0, len, None).map_err(|e| io_error("read", &path, e))?;
                Ok(count)
            })
            .collect()
    }

    /// The committed offset (the next offset to read) of `group` for every partition of `topic`, indexed by
    /// partition; 0 where the group never acknowledged anything.
    pub fn committed(&self, group: &str, topic: &str) -> Result<Vec<i64>, SourceError> {
        validate_name("group", group)?;
        let partitions = self.partitions(topic)?;
        let dir = self.group_dir(group, topic);
        (0..partitions).map(|p| read_offset(&dir.join(format!("{p}.offset")))).collect()
    }

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
        tracing::debug!(group, ?assignment, "embedded log consumer started");
        Ok(LogConsumer {
            group: group.to_owned(),
            options,
            assignment,
            state: Mutex::new(ConsumerState { parts, buffer: VecDeque::new(), next_part: 0, pending: None }),
        })
    }

    /// Locks partition `p` of `topic` for `group` and positions a reader at the committed offset; `None` if
    /// another consumer holds it.
    fn claim(&self, group: &str, topic: &str, p: i32, group_dir: &Path) -> Result<Option<PartReader>, SourceError> {
        let lock_path = group_dir.join(format!("{p}.lock"));
        let lock_file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| io_error("open", &lock_path, e))?;
        match lock_file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Ok(None),
            Err(TryLockError::Error(e)) => return Err(io_error("lock", &lock_path, e)),
        }
        let offset_path = group_dir.join(format!("{p}.offset"));
        let committed = read_offset(&offset_path)?;
        let path = self.partition_path(topic, p);
        let file = File::open(&path).map_err(|e| io_error("open", &path, e))?;
        let len = file.metadata().map_err(|e| io_error("stat", &path, e))?.len();
        let (count, pos) = skip_records(&file, 0, 0, len, Some(committed)).map_err(|e| io_error("read", &path, e))?;
        if count < committed {
            return Err(permanent(format!(
                "group {group} committed offset {committed} of {topic}/{p}, but {} holds only {count} complete \
                 records (was the topic recreated?)",
                path.display()
            )));
        }
        Ok(Some(PartReader {
            partition: Partition { topic: topic.to_owned(), partition: p },
            path,
            reader: BufReader::new(file),
            pos,
            next: count,
            committed,
            offset_path,
            _lock: lock_file,
        }))
    }
}

/// Skips complete records starting at byte `pos`, the position of record number `count`, without reading past
/// `len` bytes and stopping once `until` records are counted. Returns the record count and the byte position
/// after the last complete record.
fn skip_records(file: &File, mut pos: u64, mut count: i64, len: u64, until: Option<i64>) -> io::Result<(i64, u64)> {
    let mut reader = BufReader::new(file);
    reader.seek(SeekFrom::Start(pos))?;
    let mut header = [0u8; HEADER_LEN as usize];
    while until.is_none_or(|until| count < until) && pos + HEADER_LEN <= len {
        match reader.read_exact(&mut header) {
            Ok(()) => {}
            // Shrunk under us (a torn tail truncated by a producer): what we counted is complete.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e),
        }
        let body_len = u64::from(u32::from_le_bytes([header[0], header[1], header[2], header[3]]));
        if pos + HEADER_LEN + body_len > len {
            break;
        }
        // `body_len` < 2^32, so it fits an i64.
        reader.seek_relative(body_len as i64)?;
        pos += HEADER_LEN + body_len;
        count += 1;
    }
    Ok((count, pos))
}

/// Reads a committed offset; 0 if the file does not exist.
fn read_offset(path: &Path) -> Result<i64, SourceError> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(io_error("read", path, e)),
    };
    match text.trim().parse::<i64>() {
        Ok(offset) if offset >= 0 => Ok(offset),
        _ => Err(permanent(format!("{} is corrupt: {:?} is not an offset", path.display(), text.trim()))),
    }
}

/// Replaces a committed offset atomically: write `<p>.offset.tmp`, fsync, rename over `<p>.offset`.
fn write_offset(path: &Path, offset: i64) -> Result<(), SourceError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    File::create(&tmp)
        .and_then(|mut f| f.write_all(format!("{offset}\n").as_bytes()).and_then(|()| f.sync_all()))
        .map_err(|e| io_error("write", &tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| io_error("replace", path, e))
}

/// Encodes one record: header and body.
fn encode(
    timestamp_ms: i64,
    key: Option<&[u8]>,
    payload: &[u8],
    headers: &[(String, Vec<u8>)],
) -> Result<Vec<u8>, SourceError> {
    let too_large = |what: &str| permanent(format!("{what} is too large for the embedded log"));
    let key_len = match key {
        None => NO_KEY,
        Some(key) => u32::try_from(key.len()).ok().filter(|&len| len != NO_KEY).ok_or_else(|| too_large("key"))?,
    };
    let header_count = u16::try_from(headers.len()).map_err(|_| too_large("the header count"))?;
    let size = HEADER_LEN as usize
        + MIN_BODY_LEN
        + key.map_or(0, <[u8]>::len)
        + headers.iter().map(|(n, v)| 6 + n.len() + v.len()).sum::<usize>()
        + payload.len();
    let mut record = Vec::with_capacity(size);
    record.extend_from_slice(&[0; HEADER_LEN as usize]);
    record.extend_from_slice(&timestamp_ms.to_le_bytes());
    record.extend_from_slice(&key_len.to_le_bytes());
    record.extend_from_slice(key.unwrap_or_default());
    record.extend_from_slice(&header_count.to_le_bytes());
    for (name, value) in headers {
        let name_len = u16::try_from(name.len()).map_err(|_| too_large("a header name"))?;
        let value_len = u32::try_from(value.len()).map_err(|_| too_large("a header value"))?;
        record.extend_from_slice(&name_len.to_le_bytes());
        record.extend_from_slice(name.as_bytes());
        record.extend_from_slice(&value_len.to_le_bytes());
        record.extend_from_slice(value);
    }
    record.extend_from_slice(payload);
    let body = &record[HEADER_LEN as usize..];
    let body_len = u32::try_from(body.len()).map_err(|_| too_large("the message"))?;
    let crc = crc32fast::hash(body);
    record[0..4].copy_from_slice(&body_len.to_le_bytes());
    record[4..8].copy_from_slice(&crc.to_le_bytes());
    Ok(record)
}

/// A cursor over a record body; every read fails with `None` past the end.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }
}

/// Decodes a record body whose checksum matched; `None` if its lengths are inconsistent.
fn decode(body: &[u8], partition: &Partition, offset: i64) -> Option<Message> {
    let mut cursor = Cursor(body);
    let timestamp_ms = i64::from_le_bytes(cursor.array()?);
    let key = match u32::from_le_bytes(cursor.array()?) {
        NO_KEY => None,
        len => Some(cursor.take(usize::try_from(len).ok()?)?.to_vec()),
    };
    let header_count = u16::from_le_bytes(cursor.array()?);
    let mut headers = Vec::with_capacity(usize::from(header_count));
    for _ in 0..header_count {
        let name_len = u16::from_le_bytes(cursor.array()?);
        let name = String::from_utf8(cursor.take(usize::from(name_len))?.to_vec()).ok()?;
        let value_len = u32::from_le_bytes(cursor.array()?);
        let value = cursor.take(usize::try_from(value_len).ok()?)?.to_vec();
        headers.push((name, value));
    }
    Some(Message {
        topic: partition.topic.clone(),
        partition: partition.partition,
        offset,
        key,
        payload: cursor.0.to_vec(),
        headers,
        timestamp_ms: Some(timestamp_ms),
    })
}

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
    /// Appends one encoded record under the exclusive file lock; returns its offset.
    fn append(&mut self, record: &[u8], sync: bool) -> Result<i64, SourceError> {
        self.file.lock().map_err(|e| io_error("lock", &self.path, e))?;
        let _guard = FileLockGuard(&self.file);
        let len = self.file.metadata().map_err(|e| io_error("stat", &self.path, e))?.len();
        let (count, end) = match self.known {
            Some((count, known_len)) if known_len == len => (count, len),
            // Another process appended since: count its records.
            Some((count, known_len)) if known_len < len => {
                skip_records(&self.file, known_len, count, len, None).map_err(|e| io_error("read", &self.path, e))?
            }
            _ => skip_records(&self.file, 0, 0, len, None).map_err(|e| io_error("read", &self.path, e))?,
        };
        if end < len {
            // Under the lock no one else is writing: an incomplete record is the tail of a crashed writer.
            tracing::warn!(
                path = %self.path.display(),
                offset = count,
                bytes = len - end,
                "truncating a torn record left by a crashed writer"
            );
            self.file.set_len(end).map_err(|e| io_error("truncate", &self.path, e))?;
        }
        self.known = None;
        (&self.file).write_all(record).map_err(|e| io_error("append to", &self.path, e))?;
        self.dirty = true;
        self.known = Some((count + 1, end + record.len() as u64));
        if sync {
            self.file.sync_data().map_err(|e| io_error("fsync", &self.path, e))?;
            self.dirty = false;
        }
        Ok(count)
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
                writer.file.sync_data().map_err(|e| io_error("fsync", &writer.path, e))?;
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
        let record = encode(now_ms(), key, payload, headers)?;
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
}

#[derive(Debug)]
struct PartReader {
    partition: Partition,
    path: PathBuf,
    reader: BufReader<File>,
    /// Byte position of record `next`.
    pos: u64,
    /// The next offset to read.
    next: i64,
    /// The committed offset (the next offset to read after a restart).
    committed: i64,
    offset_path: PathBuf,
    /// Holds the group's lock on the partition until dropped.
    _lock: File,
}

impl PartReader {
    /// Reads up to `limit` complete records into `out`. A record running past the end of the file is not
    /// written yet: stop there.
    fn read_into(&mut self, limit: usize, out: &mut VecDeque<Message>) -> Result<(), SourceError> {
        let len = self.reader.get_ref().metadata().map_err(|e| io_error("stat", &self.path, e))?.len();
        if self.pos + HEADER_LEN > len {
            return Ok(());
        }
        // Seeking discards the buffer, so bytes read past `len` last time are never trusted.
        self.reader.seek(SeekFrom::Start(self.pos)).map_err(|e| io_error("seek", &self.path, e))?;
        let mut header = [0u8; HEADER_LEN as usize];
        for _ in 0..limit {
            if self.pos + HEADER_LEN > len {
                break;
            }
            match self.reader.read_exact(&mut header) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
                Err(e) => return Err(io_error("read", &self.path, e)),
            }
            let body_len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
            let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
            if self.pos + HEADER_LEN + u64::from(body_len) > len {
                break;
            }
            let mut body = vec![0; body_len as usize];
            match self.reader.read_exact(&mut body) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
                Err(e) => return Err(io_error("read", &self.path, e)),
            }
            if crc32fast::hash(&body) != crc {
                return Err(self.corrupt("checksum mismatch"));
            }
            if body.len() < MIN_BODY_LEN {
                return Err(self.corrupt("body too short"));
            }
            let message = decode(&body, &self.partition, self.next).ok_or_else(|| self.corrupt("malformed body"))?;
            out.push_back(message);
            self.pos += HEADER_LEN + u64::from(body_len);
            self.next += 1;
        }
        Ok(())
    }

    fn corrupt(&self, what: &str) -> SourceError {
        permanent(format!(
            "corrupt record in {} at offset {} (byte {}): {what}",
            self.path.display(),
            self.next,
            self.pos
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

impl Source for LogConsumer {
    /// The next message of the owned partitions, in offset order per partition. At the end of every partition,
    /// `Ok(None)` with [`ConsumerOptions::stop_at_end`]; otherwise waits for new messages.
    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        loop {
            {
                let mut state = lock(&self.state)?;
                if let Some(message) = state.next(self.options.max_buffered)? {
                    return Ok(Some(Received::Message(message)));
                }
            }
            if self.options.stop_at_end {
                return Ok(None);
            }
            tokio::time::sleep(self.options.poll_interval).await;
        }
    }

    /// Persists `offset + 1` as the group's committed offset of the partition. Acknowledgements that would not
    /// move it forward are ignored; a partition this consumer does not own is an error.
    async fn ack(&self, topic: &str, partition: i32, offset: i64) -> Result<(), SourceError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Retry;
    use std::collections::BTreeMap;
    use std::sync::atomic::AtomicUsize;

    /// A unique directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
            let dir = std::env::temp_dir().join(format!(
                "idem-log-{name}-{}-{}-{nanos}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn to_end() -> ConsumerOptions {
        ConsumerOptions { stop_at_end: true, ..ConsumerOptions::default() }
    }

    async fn drain(consumer: &LogConsumer) -> Vec<Message> {
        let mut out = Vec::new();
        while let Some(received) = consumer.recv().await.unwrap() {
            match received {
                Received::Message(m) => out.push(m),
                Received::Revoked { .. } => panic!("the embedded log never revokes"),
            }
        }
        out
    }

    fn payloads(messages: &[Message]) -> Vec<String> {
        messages.iter().map(|m| String::from_utf8(m.payload.clone()).unwrap()).collect()
    }

    #[tokio::test]
    async fn produce_and_consume_round_trip() {
        let tmp = TempDir::new("roundtrip");
        let log = EmbeddedLog::open(&tmp.0).unwrap();
        log.create_topic("orders", 3).unwrap();
        let producer = log.producer();
        let mut sent = BTreeMap::new();
        for i in 0..10 {
            let key = format!("key-{i}");
            let headers = vec![("n".to_owned(), vec![i as u8]), ("n".to_owned(), b"again".to_vec())];
            let (partition, _) =
                producer.send("orders", Some(key.as_bytes()), format!("payload-{i}").as_bytes(), &headers).unwrap();
            assert_eq!(partition, (crc32fast::hash(key.as_bytes()) % 3) as i32);
            sent.insert(key, (partition, i, headers));
        }
        producer.flush().unwrap();
        assert_eq!(log.end_offsets("orders").unwrap().iter().sum::<i64>(), 10);

        let consumer = log.consumer("g", &["orders"], to_end()).unwrap();
        assert_eq!(consumer.assignment().len(), 3);
        let received = drain(&consumer).await;
        assert_eq!(received.len(), 10);
        let mut last: HashMap<i32, i64> = HashMap::new();
        for m in &received {
            let key = String::from_utf8(m.key.clone().unwrap()).unwrap();
            let (partition, i, headers) = &sent[&key];
            assert_eq!(m.topic, "orders");
            assert_eq!(m.partition, *partition);
            assert_eq!(m.payload, format!("payload-{i}").into_bytes());
            assert_eq!(&m.headers, headers);
            assert!(m.timestamp_ms.unwrap() > 0);
            let previous = last.insert(m.partition, m.offset);
            assert!(previous.is_none_or(|p| p < m.offset), "offsets must increase per partition");
        }

        // The Publisher side: durable, partitioned by key, and keyless messages are fine too.
        let message = Message::new("orders", 0, 0, b"published".to_vec()).with_key("key-1").with_header("h", "v");
        producer.publish(&message).await.unwrap();
        producer.publish(&Message::new("orders", 0, 0, b"no key".to_vec())).await.unwrap();
        let more = drain(&consumer).await;
        assert_eq!(payloads(&more).len(), 2);
        let published = more.iter().find(|m| m.payload == b"published").unwrap();
        assert_eq!(published.partition, sent["key-1"].0);
        assert_eq!(published.header("h"), Some(&b"v"[..]));
        assert!(more.iter().any(|m| m.payload == b"no key" && m.key.is_none()));
    }

    #[tokio::test]
    async fn resumes_after_acknowledged_offsets() {
        let tmp = TempDir::new("resume");
        let log = EmbeddedLog::open(&tmp.0).unwrap();
        log.create_topic("t", 2).unwrap();
        let producer = log.producer();
        for i in 0..10 {
            // Keyless: round-robin, so partition 0 gets m0, m2, ..., partition 1 gets m1, m3, ...
            let (partition, offset) = producer.send("t", None, format!("m{i}").as_bytes(), &[]).unwrap();
            assert_eq!((partition, offset), (i % 2, i64::from(i / 2)));
        }
        let consumer = log.consumer("g", &["t"], to_end()).unwrap();
        assert_eq!(drain(&consumer).await.len(), 10);
        consumer.ack("t", 0, 1).await.unwrap();
        consumer.ack("t", 0, 2).await.unwrap();
        consumer.ack("t", 0, 1).await.unwrap(); // backwards: ignored
        consumer.ack("t", 1, 4).await.unwrap();
        assert!(consumer.ack("t", 2, 0).await.is_err(), "not an owned partition");
        assert!(consumer.ack("t", 0, 5).await.is_err(), "never delivered");
        assert_eq!(log.committed("g", "t").unwrap(), vec![3, 5]);
        drop(consumer);

        let consumer = log.consumer("g", &["t"], to_end()).unwrap();
        let redelivered = drain(&consumer).await;
        assert_eq!(payloads(&redelivered), vec!["m6", "m8"]);
        assert_eq!(redelivered.iter().map(|m| (m.partition, m.offset)).collect::<Vec<_>>(), vec![(0, 3), (0, 4)]);
        // Another group starts from the beginning.
        let other = log.consumer("other", &["t"], to_end()).unwrap();
        assert_eq!(drain(&other).await.len(), 10);
        assert_eq!(log.committed("other", "t").unwrap(), vec![0, 0]);
    }

    #[tokio::test]
    async fn one_consumer_per_partition_and_group() {
        let tmp = TempDir::new("exclusive");
        let log = EmbeddedLog::open(&tmp.0).unwrap();
        log.create_topic("t", 2).unwrap();
        let first = log.consumer("g", &["t"], to_end()).unwrap();
        assert_eq!(
            first.assignment(),
            vec![Partition { topic: "t".into(), partition: 0 }, Partition { topic: "t".into(), partition: 1 }]
        );
        let error = log.consumer("g", &["t"], to_end()).unwrap_err();
        assert!(error.to_string().contains("held by other consumers"), "{error}");
        assert_eq!(error.retry(), Retry::Helps);
        // Another group is independent.
        log.consumer("h", &["t"], to_end()).unwrap();
        drop(first);
        let second = log.consumer("g", &["t"], to_end()).unwrap();
        assert_eq!(second.assignment().len(), 2);
    }

    #[tokio::test]
    async fn torn_tail_is_not_delivered_and_is_truncated_by_the_next_append() {
        let tmp = TempDir::new("torn");
        let log = EmbeddedLog::open(&tmp.0).unwrap();
        log.create_topic("t", 1).unwrap();
        let producer = log.producer();
        for i in 0..3 {
            producer.send_to("t", 0, None, format!("m{i}").as_bytes(), &[]).unwrap();
        }
        // A writer that crashed halfway: a header announcing 100 bytes, then 10 of them.
        let path = tmp.0.join("topics/t/0.log");
        let clean_len = fs::metadata(&path).unwrap().len();
        let mut torn = Vec::new();
        torn.extend_from_slice(&100u32.to_le_bytes());
        torn.extend_from_slice(&0xdead_beefu32.to_le_bytes());
        torn.extend_from_slice(&[7; 10]);
        OpenOptions::new().append(true).open(&path).unwrap().write_all(&torn).unwrap();

        let consumer = log.consumer("g", &["t"], to_end()).unwrap();
        assert_eq!(payloads(&drain(&consumer).await), vec!["m0", "m1", "m2"]);
        assert_eq!(log.end_offsets("t").unwrap(), vec![3]);
        let waiting = log.consumer("w", &["t"], ConsumerOptions::default()).unwrap();
        assert_eq!(drain_n(&waiting, 3).await.len(), 3);
        assert!(tokio::time::timeout(Duration::from_millis(100), waiting.recv()).await.is_err(), "must wait");

        // The producer knew the file before the torn tail appeared; it must notice, truncate and append.
        assert_eq!(producer.send_to("t", 0, None, b"m3", &[]).unwrap(), 3);
        assert!(fs::metadata(&path).unwrap().len() > clean_len);
        // A fresh producer counts from scratch.
        assert_eq!(log.producer().send_to("t", 0, None, b"m4", &[]).unwrap(), 4);
        assert_eq!(payloads(&drain(&consumer).await), vec!["m3", "m4"]);
        assert_eq!(payloads(&drain_n(&waiting, 2).await), vec!["m3", "m4"]);
        let fresh = log.consumer("fresh", &["t"], to_end()).unwrap();
        assert_eq!(payloads(&drain(&fresh).await), vec!["m0", "m1", "m2", "m3", "m4"]);
    }

    async fn drain_n(consumer: &LogConsumer, n: usize) -> Vec<Message> {
        let mut out = Vec::new();
        while out.len() < n {
            match tokio::time::timeout(Duration::from_secs(5), consumer.recv()).await {
                Ok(Ok(Some(Received::Message(m)))) => out.push(m),
                other => panic!("expected a message, got {other:?}"),
            }
        }
        out
    }

    #[tokio::test]
    async fn sees_messages_appended_after_it_started() {
        let tmp = TempDir::new("tail");
        let log = EmbeddedLog::open(&tmp.0).unwrap();
        log.create_topic("t", 2).unwrap();
        log.producer().send("t", Some(b"a"), b"before", &[]).unwrap();
        let consumer = log.consumer("g", &["t"], ConsumerOptions::default()).unwrap();
        assert_eq!(payloads(&drain_n(&consumer, 1).await), vec!["before"]);

        // Another handle (as another process would) appends later, to both partitions.
        let dir = tmp.0.clone();
        let writer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let producer = EmbeddedLog::open(&dir).unwrap().producer();
            for i in 0..4 {
                producer.send("t", None, format!("after-{i}").as_bytes(), &[]).unwrap();
            }
            producer.flush().unwrap();
        });
        let mut after = payloads(&drain_n(&consumer, 4).await);
        after.sort();
        assert_eq!(after, vec!["after-0", "after-1", "after-2", "after-3"]);
        writer.await.unwrap();
    }

    #[tokio::test]
    async fn corrupt_checksum_is_a_permanent_error() {
        let tmp = TempDir::new("crc");
        let log = EmbeddedLog::open(&tmp.0).unwrap();
        log.create_topic("t", 1).unwrap();
        let producer = log.producer();
        producer.send_to("t", 0, None, b"good", &[]).unwrap();
        producer.send_to("t", 0, None, b"flipped", &[]).unwrap();
        let path = tmp.0.join("topics/t/0.log");
        let mut bytes = fs::read(&path).unwrap();
        *bytes.last_mut().unwrap() ^= 0xff;
        fs::write(&path, &bytes).unwrap();

        let consumer = log.consumer("g", &["t"], to_end()).unwrap();
        match consumer.recv().await.unwrap() {
            Some(Received::Message(m)) => assert_eq!(m.payload, b"good"),
            other => panic!("expected the good message, got {other:?}"),
        }
        let error = consumer.recv().await.unwrap_err();
        let text = error.to_string();
        assert!(text.contains("0.log") && text.contains("offset 1") && text.contains("checksum"), "{text}");
        assert_eq!(error.retry(), Retry::Useless);
        // It stays an error: the record is never skipped.
        assert!(consumer.recv().await.is_err());
    }

    #[test]
    fn topics_are_validated_and_not_silently_redefined() {
        let tmp = TempDir::new("topics");
        let log = EmbeddedLog::open(&tmp.0).unwrap();
        log.create_topic("orders.v1_x-y", 3).unwrap();
        log.create_topic("orders.v1_x-y", 3).unwrap();
        assert_eq!(log.partitions("orders.v1_x-y").unwrap(), 3);
        let error = log.create_topic("orders.v1_x-y", 4).unwrap_err().to_string();
        assert!(error.contains("orders.v1_x-y") && error.contains("3 partitions"), "{error}");
        assert_eq!(log.partitions("orders.v1_x-y").unwrap(), 3);
        for bad in ["", ".", "..", "a/b", "../x", "sp ace", "é"] {
            assert!(log.create_topic(bad, 1).is_err(), "{bad:?} must be refused");
        }
        assert!(log.create_topic("zero", 0).is_err());
        let missing = log.partitions("missing").unwrap_err().to_string();
        assert!(missing.contains("missing does not exist") && missing.contains("create"), "{missing}");
        assert!(log.consumer("g", &["missing"], to_end()).is_err());
        assert!(log.consumer("bad/group", &["orders.v1_x-y"], to_end()).is_err());
        assert!(log.producer().send("missing", None, b"x", &[]).is_err());
        assert!(log.producer().send_to("orders.v1_x-y", 3, None, b"x", &[]).is_err());
    }
}
