//! Operator tools for a damaged partition: what is in it ([`EmbeddedLog::inspect`]), moving one consumer group
//! past a damaged record ([`EmbeddedLog::prepare_skip`], whose bytes the caller stores as a dead letter before
//! [`Skip::commit`]), and setting a damaged tail aside so that appends can go on ([`EmbeddedLog::repair_tail`]).
//!
//! Recovery, step by step (the `idem log` commands wrap these):
//! 1. The consumer stops with an error naming the file, the offset and the byte range.
//! 2. `idem log inspect --log-dir D --topic T` lists every damaged range and undecodable record of every
//!    partition, with the durable length and the torn tail, if any.
//! 3. Damage in the middle of a file: `idem log skip … --group G --offset N` writes the damaged bytes to
//!    `dead_letters` (with the reason), then moves the group's committed offset to N + 1. The records after the
//!    damage keep their offsets; other groups are moved one by one, each by its own decision.
//! 4. Damage at the end of a file (nothing valid after it) refuses appends: `idem log repair … --partition P`
//!    copies the damaged bytes to `<p>.damaged-<byte>.bin` beside the partition file, then truncates them.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;

use super::record::{Slot, Walker, decode, write_durable};
use super::{EmbeddedLog, io_error, permanent, read_offset, validate_name, walk_offsets, write_offset};
use crate::source::{Partition, SourceError};

/// One damaged range or undecodable record of a partition.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Damage {
    /// The offset it takes.
    pub offset: i64,
    /// Its first byte.
    pub start: u64,
    /// The byte after its last one.
    pub end: u64,
    /// `damaged` (bytes that are no record), `undecodable` (a record whose checksum matches but whose body does
    /// not decode) or `damaged_tail` (damage at the end of the file, refusing appends).
    pub kind: &'static str,
    /// What is wrong.
    pub what: String,
}

/// One record, as `idem log inspect --records` lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RecordEntry {
    /// Its offset.
    pub offset: i64,
    /// The byte position of its header.
    pub start: u64,
    /// Its length with the header.
    pub length: u64,
    /// Its CRC-32 (which matched).
    pub checksum: u32,
    /// Its key, lossily as UTF-8.
    pub key: Option<String>,
    /// Its header count.
    pub headers: usize,
    /// Its payload's length.
    pub payload_bytes: usize,
}

/// What [`EmbeddedLog::inspect`] found in one partition file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PartitionReport {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The partition file.
    pub path: PathBuf,
    /// Its length in bytes.
    pub bytes: u64,
    /// The length up to which producers fsynced it (0 when never recorded).
    pub durable_bytes: u64,
    /// Offsets in it (records and damaged ranges).
    pub end_offset: i64,
    /// Records whose checksum matches.
    pub records: i64,
    /// The damaged ranges and undecodable records, in order.
    pub damage: Vec<Damage>,
    /// Where a torn tail starts (an incomplete record a crashed writer left, truncated by the next append).
    pub torn_tail_at: Option<u64>,
    /// Every record, when asked for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub entries: Vec<RecordEntry>,
}

impl PartitionReport {
    /// Whether the partition reads to its end without damage.
    pub fn healthy(&self) -> bool {
        self.damage.is_empty()
    }
}

/// A consumer group held before a damaged record, ready to move past it: store [`Skip::bytes`] first, then
/// [`Skip::commit`]. Holds the group's lock on the partition, so no consumer of the group reads it meanwhile.
#[derive(Debug)]
pub struct Skip {
    /// The partition.
    pub partition: Partition,
    /// The offset skipped.
    pub offset: i64,
    /// The first byte skipped.
    pub start: u64,
    /// The byte after the last one skipped.
    pub end: u64,
    /// What is wrong with it.
    pub what: String,
    /// The skipped bytes, header included.
    pub bytes: Vec<u8>,
    offset_path: PathBuf,
    _lock: File,
}

impl Skip {
    /// Moves the group's committed offset past the damaged record.
    pub fn commit(self) -> Result<(), SourceError> {
        write_offset(&self.offset_path, self.offset + 1)
    }
}

/// A damaged tail set aside by [`EmbeddedLog::repair_tail`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repaired {
    /// Where the damaged tail started; the file's new length.
    pub start: u64,
    /// The bytes moved aside.
    pub bytes: u64,
    /// The side file holding them (`None` when the file had lost bytes rather than gained damaged ones).
    pub saved_to: Option<PathBuf>,
    /// What was wrong.
    pub what: String,
}

impl EmbeddedLog {
    /// Reads every partition of `topic` to its end and reports its records, damage and torn tail; `entries`
    /// also lists every record.
    pub fn inspect(&self, topic: &str, entries: bool) -> Result<Vec<PartitionReport>, SourceError> {
        let partitions = self.partitions(topic)?;
        (0..partitions).map(|p| self.inspect_partition(topic, p, entries)).collect()
    }

    fn inspect_partition(&self, topic: &str, p: i32, with_entries: bool) -> Result<PartitionReport, SourceError> {
        let path = self.partition_path(topic, p);
        let file = File::open(&path).map_err(|e| io_error("open", &path, e))?;
        let len = file.metadata().map_err(|e| io_error("stat", &path, e))?.len();
        let partition = Partition { topic: topic.to_owned(), partition: p };
        let mut report = PartitionReport {
            topic: topic.to_owned(),
            partition: p,
            path: path.clone(),
            bytes: len,
            durable_bytes: super::record::read_durable(&path)?,
            end_offset: 0,
            records: 0,
            damage: Vec::new(),
            torn_tail_at: None,
            entries: Vec::new(),
        };
        let mut walker = Walker::new(&file, &path, 0, len)?;
        loop {
            let offset = report.end_offset;
            match walker.next_slot()? {
                Slot::Record { pos, body } => {
                    report.records += 1;
                    match decode(&body, &partition, offset) {
                        Ok(message) if with_entries => report.entries.push(RecordEntry {
                            offset,
                            start: pos,
                            length: walker.pos() - pos,
                            checksum: crc32fast::hash(&body),
                            key: message.key.as_deref().map(|k| String::from_utf8_lossy(k).into_owned()),
                            headers: message.headers.len(),
                            payload_bytes: message.payload.len(),
                        }),
                        Ok(_) => {}
                        Err(what) => report.damage.push(Damage {
                            offset,
                            start: pos,
                            end: walker.pos(),
                            kind: "undecodable",
                            what: format!("the record's body does not decode: {what}"),
                        }),
                    }
                }
                Slot::Damaged { pos, end, what } => {
                    report.damage.push(Damage { offset, start: pos, end, kind: "damaged", what });
                }
                Slot::DamagedTail { pos, what } => {
                    report.damage.push(Damage { offset, start: pos, end: len, kind: "damaged_tail", what });
                    break;
                }
                Slot::Incomplete { pos } => {
                    report.torn_tail_at = Some(pos);
                    break;
                }
                Slot::End => break,
            }
            report.end_offset += 1;
        }
        Ok(report)
    }

    /// Holds `group` at `offset` of `topic`/`partition`, which must be damaged or undecodable and where the
    /// group's committed offset must stand. Refused while a consumer of the group owns the partition.
    pub fn prepare_skip(&self, group: &str, topic: &str, partition: i32, offset: i64) -> Result<Skip, SourceError> {
        validate_name("group", group)?;
        let partitions = self.partitions(topic)?;
        if !(0..partitions).contains(&partition) {
            return Err(permanent(format!(
                "topic {topic} has {partitions} partitions, there is no partition {partition}"
            )));
        }
        let group_dir = self.group_dir(group, topic);
        fs::create_dir_all(&group_dir).map_err(|e| io_error("create directory", &group_dir, e))?;
        let Some(lock) = super::consumer::lock_group_partition(&group_dir, partition)? else {
            return Err(permanent(format!(
                "a consumer of group {group} is reading {topic}/{partition}: stop it first, then skip"
            )));
        };
        let offset_path = group_dir.join(format!("{partition}.offset"));
        let committed = read_offset(&offset_path)?;
        if committed != offset {
            return Err(permanent(format!(
                "group {group} stands at offset {committed} of {topic}/{partition}, not {offset}: only the record a \
                 group is stopped at can be skipped, so that no other record is skipped with it"
            )));
        }
        let path = self.partition_path(topic, partition);
        let mut file = File::open(&path).map_err(|e| io_error("open", &path, e))?;
        let len = file.metadata().map_err(|e| io_error("stat", &path, e))?.len();
        let walked = walk_offsets(&file, &path, 0, 0, len, Some(offset))?;
        if walked.count < offset {
            return Err(permanent(format!("{topic}/{partition} has no offset {offset} (it ends at {})", walked.count)));
        }
        let subject = Partition { topic: topic.to_owned(), partition };
        let mut walker = Walker::new(&file, &path, walked.pos, len)?;
        let (start, end, what) = match walker.next_slot()? {
            Slot::Damaged { pos, end, what } => (pos, end, what),
            Slot::Record { pos, body } => match decode(&body, &subject, offset) {
                Ok(_) => {
                    return Err(permanent(format!(
                        "offset {offset} of {topic}/{partition} is an intact record: there is nothing to skip"
                    )));
                }
                Err(what) => (pos, walker.pos(), format!("the record's body does not decode: {what}")),
            },
            Slot::DamagedTail { what, .. } => {
                return Err(permanent(format!(
                    "offset {offset} of {topic}/{partition} is a damaged tail ({what}): no record follows it, so \
                     there is nothing to move to; set it aside with `idem log repair`"
                )));
            }
            Slot::Incomplete { .. } | Slot::End => {
                return Err(permanent(format!("{topic}/{partition} has no record at offset {offset} yet")));
            }
        };
        let mut bytes = vec![0; usize::try_from(end - start).map_err(permanent)?];
        file.seek(SeekFrom::Start(start))
            .and_then(|_| file.read_exact(&mut bytes))
            .map_err(|e| io_error("read", &path, e))?;
        Ok(Skip { partition: subject, offset, start, end, what, bytes, offset_path, _lock: lock })
    }

    /// Sets a damaged tail of `topic`/`partition` aside: copies its bytes to `<p>.damaged-<byte>.bin` beside
    /// the partition file (fsynced), then truncates the file there. `None` when the file has no damaged tail.
    /// Holds the partition's write lock, so producers wait.
    pub fn repair_tail(&self, topic: &str, partition: i32) -> Result<Option<Repaired>, SourceError> {
        let partitions = self.partitions(topic)?;
        if !(0..partitions).contains(&partition) {
            return Err(permanent(format!(
                "topic {topic} has {partitions} partitions, there is no partition {partition}"
            )));
        }
        let path = self.partition_path(topic, partition);
        let mut file = OpenOptions::new().read(true).write(true).open(&path).map_err(|e| io_error("open", &path, e))?;
        file.lock().map_err(|e| io_error("lock", &path, e))?;
        let len = file.metadata().map_err(|e| io_error("stat", &path, e))?.len();
        let walked = walk_offsets(&file, &path, 0, 0, len, None)?;
        let Some(Slot::DamagedTail { pos, what }) = walked.stop else {
            return Ok(None);
        };
        let mut saved_to = None;
        if pos < len {
            let mut bytes = Vec::new();
            file.seek(SeekFrom::Start(pos))
                .and_then(|_| file.read_to_end(&mut bytes))
                .map_err(|e| io_error("read", &path, e))?;
            let side = path.with_extension(format!("damaged-{pos}.bin"));
            File::create(&side)
                .and_then(|mut f| f.write_all(&bytes).and_then(|()| f.sync_all()))
                .map_err(|e| io_error("write", &side, e))?;
            file.set_len(pos).map_err(|e| io_error("truncate", &path, e))?;
            file.sync_all().map_err(|e| io_error("fsync", &path, e))?;
            saved_to = Some(side);
        }
        // The operator accepted what is missing: the durable length is the file's again.
        write_durable(&path, pos)?;
        let _ = file.unlock();
        tracing::warn!(path = %path.display(), start = pos, bytes = len - pos, what, "damaged tail set aside");
        Ok(Some(Repaired { start: pos, bytes: len - pos, saved_to, what }))
    }
}
