//! The embedded log: a file-backed, partitioned, append-only log with consumer groups, for local use, tests and
//! `idem demo`.
//!
//! Layout under the log directory:
//! * `topics/<topic>/meta.json` holds `{"partitions": N}`; `topics/<topic>/<p>.log` is partition `p`.
//! * `groups/<group>/<topic>/<p>.offset` holds the group's committed offset (the next offset to read);
//!   `groups/<group>/<topic>/<p>.lock` is locked by the consumer of the group that owns partition `p`.
//!
//! * `topics/<topic>/<p>.durable` holds the byte length up to which `<p>.log` was fsynced.
//!
//! The record format, and how a torn tail is told from damage, are in [`record`]; [`repair`] has the operator's
//! tools: inspecting a partition, moving a consumer group past a damaged record, setting a damaged tail aside.
//!
//! Guarantees:
//! * Appends from any number of processes are serialized by an exclusive lock on the partition file, and each
//!   record is written with a single write. A record cut short by a crashed writer (a torn tail) is never
//!   delivered; the next append truncates it away. [`LogProducer::flush`] and [`Publisher::publish`](crate::source::Publisher::publish) fsync and
//!   record the durable length.
//! * A partition is owned by at most one consumer of a group at a time: an OS file lock on its `.lock` file,
//!   released by the kernel when the process dies, even by SIGKILL. Several processes of one group split the
//!   partitions between them. Ownership never moves while a consumer lives, so the log never yields
//!   [`Received::Revoked`](crate::source::Received::Revoked).
//! * Committed offsets are replaced atomically (write, fsync, rename). Messages not acknowledged are delivered
//!   again to the next consumer of the partition.
//! * Damage (a checksum that does not match, a length field that cannot be, bytes missing from the fsynced part
//!   of a file) is a permanent error naming the file, the offset, the byte range and what to do; it is never
//!   truncated and never skipped silently. The records after it keep their offsets.
//!
//! All file I/O is short, synchronous and done on the calling thread.

use std::fmt::Display;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::source::SourceError;

mod consumer;
mod producer;
pub mod record;
pub mod repair;

pub use consumer::{ConsumerOptions, LogConsumer};
pub use producer::LogProducer;
use record::{Slot, Walker};

const CONTEXT: &str = "embedded log";
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
            Ok(meta) if meta.partitions >= 1 => self.check_partition_files(topic, meta.partitions).map(Some),
            Ok(meta) => Err(permanent(format!("{} is corrupt: {} partitions", path.display(), meta.partitions))),
            Err(e) => Err(permanent(format!("{} is corrupt: {e}", path.display()))),
        }
    }

    /// Refuses a `meta.json` that declares fewer partitions than the topic has files for: consuming it would
    /// silently leave the other partitions unread.
    fn check_partition_files(&self, topic: &str, partitions: i32) -> Result<i32, SourceError> {
        let dir = self.topic_dir(topic);
        let entries = fs::read_dir(&dir).map_err(|e| io_error("list", &dir, e))?;
        let mut highest: Option<i32> = None;
        for entry in entries {
            let entry = entry.map_err(|e| io_error("list", &dir, e))?;
            let name = entry.file_name();
            if let Some(p) = name.to_str().and_then(|n| n.strip_suffix(".log")).and_then(|n| n.parse::<i32>().ok()) {
                highest = highest.max(Some(p));
            }
        }
        if let Some(highest) = highest.filter(|&p| p >= partitions) {
            return Err(permanent(format!(
                "{} declares {partitions} partitions, but partition file {highest}.log exists: meta.json was edited \
                 or damaged; set \"partitions\" back to {}, the number of <p>.log files",
                dir.join("meta.json").display(),
                highest + 1
            )));
        }
        Ok(partitions)
    }

    /// The number of partitions of `topic`; an error if the topic does not exist.
    pub fn partitions(&self, topic: &str) -> Result<i32, SourceError> {
        validate_name("topic", topic)?;
        self.read_meta(topic)?.ok_or_else(|| {
            permanent(format!(
                "topic {topic} does not exist in {}: check the log directory and the topic name (a producer \
                 creates the topic before it sends)",
                self.dir.display()
            ))
        })
    }

    /// The topics of this log, sorted.
    pub fn topics(&self) -> Result<Vec<String>, SourceError> {
        let dir = self.dir.join("topics");
        let mut topics = Vec::new();
        for entry in fs::read_dir(&dir).map_err(|e| io_error("list", &dir, e))? {
            let entry = entry.map_err(|e| io_error("list", &dir, e))?;
            if entry.path().join("meta.json").is_file() {
                topics.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
        topics.sort();
        Ok(topics)
    }

    /// The end offset (the number of offsets, a damaged range counting as one) of every partition of `topic`,
    /// indexed by partition. Damage at the end of a partition is an error.
    pub fn end_offsets(&self, topic: &str) -> Result<Vec<i64>, SourceError> {
        let partitions = self.partitions(topic)?;
        (0..partitions)
            .map(|p| {
                let path = self.partition_path(topic, p);
                let file = File::open(&path).map_err(|e| io_error("open", &path, e))?;
                let len = file.metadata().map_err(|e| io_error("stat", &path, e))?.len();
                let walked = walk_offsets(&file, &path, 0, 0, len, None)?;
                if let Some(Slot::DamagedTail { pos, what }) = walked.stop {
                    return Err(damaged_tail(&path, walked.count, pos, &what));
                }
                Ok(walked.count)
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
}

/// Where [`walk_offsets`] stopped.
struct Walked {
    /// Offsets counted (a damaged range counts as one).
    count: i64,
    /// The byte position of offset `count`.
    pos: u64,
    /// What stopped the walk before `until`: the end, an incomplete record or a damaged tail.
    stop: Option<Slot>,
}

/// Counts offsets from byte `pos` (the position of offset `count`) up to byte `len`, stopping once `until`
/// offsets are counted. Records and damaged ranges count one each; checksums are verified.
fn walk_offsets(
    file: &File,
    path: &Path,
    pos: u64,
    count: i64,
    len: u64,
    until: Option<i64>,
) -> Result<Walked, SourceError> {
    let mut walker = Walker::new(file, path, pos, len)?;
    let mut count = count;
    while until.is_none_or(|until| count < until) {
        match walker.next_slot()? {
            Slot::Record { .. } | Slot::Damaged { .. } => count += 1,
            stop => return Ok(Walked { count, pos: walker.pos(), stop: Some(stop) }),
        }
    }
    Ok(Walked { count, pos: walker.pos(), stop: None })
}

/// The error for damage at the end of a partition file that no valid record follows, with the commands that
/// inspect and repair it filled in from the file's place in the log (`<dir>/topics/<topic>/<partition>.log`).
fn damaged_tail(path: &Path, offset: i64, pos: u64, what: &str) -> SourceError {
    let partition = path.file_stem().map_or_else(|| "<p>".into(), |s| s.to_string_lossy().into_owned());
    let topic_dir = path.parent();
    let topic = topic_dir.and_then(Path::file_name).map_or_else(|| "<t>".into(), |s| s.to_string_lossy().into_owned());
    let dir = topic_dir
        .and_then(Path::parent)
        .and_then(Path::parent)
        .map_or_else(|| "<dir>".into(), |d| d.display().to_string());
    permanent(format!(
        "damaged tail in {} at offset {offset} (from byte {pos}): {what}. Nothing was truncated. See it with \
         `idem log inspect --log-dir {dir}`; `idem log repair --log-dir {dir} --topic {topic} --partition \
         {partition}` moves the damaged bytes to a side file so that appends can go on",
        path.display()
    ))
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

#[cfg(test)]
mod properties;
#[cfg(test)]
mod tests;
