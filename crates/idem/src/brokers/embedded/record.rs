//! The record format, and the walk over a partition file that tells records, damage and a torn tail apart.
//!
//! A record is `u32 LE body_len | u32 LE crc32(body) | body`, with body = `i64 LE timestamp_ms | u32 LE key_len
//! (u32::MAX = no key) | key | u16 LE header_count | (u16 LE name_len, name, u32 LE value_len, value)* | payload`.
//! A record's offset is its index in the partition file.
//!
//! Beside each partition file `<p>.log`, `<p>.durable` holds the byte length up to which the file was fsynced by a
//! producer (written after the fsync, never ahead of it). It is what tells a torn tail from damage:
//!
//! * A **torn tail** is what a writer killed in the middle of its one `write` leaves: a prefix of a record (or,
//!   after a power cut, zeros) at the end of the file, past the durable length, with no valid record after it.
//!   It is never delivered, and the next append truncates it.
//! * Anything else is **damage**: a checksum that does not match, a length field larger than any record idem
//!   writes, an incomplete record inside the durable length or followed by a valid record, a file shorter than
//!   its durable length. Damage is never truncated and never skipped silently. The walk looks for the next valid
//!   record after it (a header whose length fits and whose checksum matches its body): the damaged bytes between
//!   take **one offset**, so the offsets of the records after them do not move, and the reader stops there with
//!   an error naming the file, the offset, the byte range and the commands that inspect it and move past it.
//!
//! A file without `<p>.durable` (written before it existed, or never flushed) has a durable length of 0: an
//! incomplete last record is then taken for a torn tail only when no valid record follows it.

use std::fs::{self, File};
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::{io_error, permanent};
use crate::message::Message;
use crate::source::{Partition, SourceError};

/// `u32 body_len | u32 crc32`.
pub(super) const HEADER_LEN: u64 = 8;
/// `i64 timestamp | u32 key_len | u16 header_count`.
pub(super) const MIN_BODY_LEN: usize = 8 + 4 + 2;
/// The largest body idem writes: a length field above it is damage, never a record being written.
pub const MAX_BODY_LEN: u32 = 64 * 1024 * 1024;
const NO_KEY: u32 = u32::MAX;

/// Encodes one record: header and body.
pub(super) fn encode(
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
    let body_len = u32::try_from(body.len()).ok().filter(|&len| len <= MAX_BODY_LEN).ok_or_else(|| {
        permanent(format!(
            "the message is too large for the embedded log: its record would exceed {MAX_BODY_LEN} bytes"
        ))
    })?;
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

/// Decodes a record body whose checksum matched; the error says which field is inconsistent.
pub(super) fn decode(body: &[u8], partition: &Partition, offset: i64) -> Result<Message, String> {
    let short = |field: &str| format!("the body ends inside the {field}");
    let mut cursor = Cursor(body);
    let timestamp_ms = i64::from_le_bytes(cursor.array().ok_or_else(|| short("timestamp"))?);
    let key = match u32::from_le_bytes(cursor.array().ok_or_else(|| short("key length"))?) {
        NO_KEY => None,
        len => Some(cursor.take(len as usize).ok_or_else(|| short("key"))?.to_vec()),
    };
    let header_count = u16::from_le_bytes(cursor.array().ok_or_else(|| short("header count"))?);
    let mut headers = Vec::with_capacity(usize::from(header_count).min(body.len() / 6));
    for n in 0..header_count {
        let name_len = u16::from_le_bytes(cursor.array().ok_or_else(|| short("header name length"))?);
        let name = cursor.take(usize::from(name_len)).ok_or_else(|| short("header name"))?;
        let name = String::from_utf8(name.to_vec()).map_err(|_| format!("header {n}'s name is not UTF-8"))?;
        let value_len = u32::from_le_bytes(cursor.array().ok_or_else(|| short("header value length"))?);
        let value = cursor.take(value_len as usize).ok_or_else(|| short("header value"))?.to_vec();
        headers.push((name, value));
    }
    Ok(Message {
        topic: partition.topic.clone(),
        partition: partition.partition,
        offset,
        key,
        payload: cursor.0.to_vec(),
        headers,
        timestamp_ms: Some(timestamp_ms),
        ack_handle: None,
        dead_letter_reason: None,
    })
}

/// The durable-length file of partition file `log_path` (`<p>.log` → `<p>.durable`).
pub(super) fn durable_path(log_path: &Path) -> PathBuf {
    log_path.with_extension("durable")
}

/// The byte length up to which `log_path` is known to be fsynced; 0 when never recorded.
pub(super) fn read_durable(log_path: &Path) -> Result<u64, SourceError> {
    let path = durable_path(log_path);
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(io_error("read", &path, e)),
    };
    text.trim().parse::<u64>().map_err(|_| {
        permanent(format!(
            "{} is damaged: {:?} is not a byte length; delete it to stop checking the partition's durable length",
            path.display(),
            text.trim()
        ))
    })
}

/// Records `len` as the durable length of `log_path` (write a private file, rename it into place). Callers hold
/// the partition's file lock and have fsynced the file up to `len`.
pub(super) fn write_durable(log_path: &Path, len: u64) -> Result<(), SourceError> {
    let path = durable_path(log_path);
    let tmp = log_path.with_extension("durable.tmp");
    fs::write(&tmp, format!("{len}\n")).map_err(|e| io_error("write", &tmp, e))?;
    fs::rename(&tmp, &path).map_err(|e| io_error("replace", &path, e))
}

/// What the walk finds at one position of a partition file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slot {
    /// A complete record whose checksum matches (its body may still not decode).
    Record {
        /// Byte position of its header.
        pos: u64,
        /// The body.
        body: Vec<u8>,
    },
    /// Damaged bytes `pos..end`, followed by a valid record at `end`; they take one offset.
    Damaged {
        /// First damaged byte.
        pos: u64,
        /// The byte after the last damaged one: where the next valid record starts.
        end: u64,
        /// What is wrong.
        what: String,
    },
    /// Damage at the end of the file with no valid record after it (or a file shorter than its durable length).
    DamagedTail {
        /// First damaged byte (or the end of a truncated file).
        pos: u64,
        /// What is wrong.
        what: String,
    },
    /// An incomplete record past the durable length with nothing valid after it: a record being written, or the
    /// torn tail of a writer that crashed.
    Incomplete {
        /// Where it starts.
        pos: u64,
    },
    /// The end of the file.
    End,
}

/// Walks the slots of a partition file from a record boundary, reading no further than a fixed length.
pub(super) struct Walker<'a> {
    reader: BufReader<&'a File>,
    path: &'a Path,
    pos: u64,
    len: u64,
    durable: Option<u64>,
}

impl<'a> Walker<'a> {
    /// A walk of `file` (at `path`) from byte `pos`, a record boundary, up to byte `len`.
    pub(super) fn new(file: &'a File, path: &'a Path, pos: u64, len: u64) -> Result<Self, SourceError> {
        let mut reader = BufReader::with_capacity(64 * 1024, file);
        reader.seek(SeekFrom::Start(pos)).map_err(|e| io_error("seek", path, e))?;
        Ok(Walker { reader, path, pos, len, durable: None })
    }

    /// The byte position of the next slot.
    pub(super) fn pos(&self) -> u64 {
        self.pos
    }

    fn durable(&mut self) -> Result<u64, SourceError> {
        if let Some(durable) = self.durable {
            return Ok(durable);
        }
        let durable = read_durable(self.path)?;
        self.durable = Some(durable);
        Ok(durable)
    }

    /// The next slot; a [`Slot::Record`] or [`Slot::Damaged`] moves the walk past it, the others leave it there.
    pub(super) fn next_slot(&mut self) -> Result<Slot, SourceError> {
        let (pos, len) = (self.pos, self.len);
        if pos >= len {
            let durable = self.durable()?;
            if pos < durable {
                return Ok(Slot::DamagedTail {
                    pos,
                    what: format!(
                        "the file ends at byte {pos} but was fsynced up to byte {durable}: {} bytes of records are \
                         missing (the file was truncated or replaced)",
                        durable - pos
                    ),
                });
            }
            return Ok(Slot::End);
        }
        if len - pos < HEADER_LEN {
            return self.incomplete(pos, "the file ends inside a record header");
        }
        let mut header = [0u8; HEADER_LEN as usize];
        self.read_exact(&mut header)?;
        let body_len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
        if body_len > MAX_BODY_LEN {
            return self.damaged(pos, format!("length field {body_len} exceeds the largest record ({MAX_BODY_LEN})"));
        }
        if pos + HEADER_LEN + u64::from(body_len) > len {
            return self.incomplete(pos, "the record runs past the end of the file");
        }
        let mut body = vec![0; body_len as usize];
        self.read_exact(&mut body)?;
        if crc32fast::hash(&body) != crc {
            return self.damaged(pos, "checksum mismatch".into());
        }
        if body.len() < MIN_BODY_LEN {
            return self.damaged(pos, format!("a {body_len}-byte body is shorter than any record's"));
        }
        self.pos = pos + HEADER_LEN + u64::from(body_len);
        Ok(Slot::Record { pos, body })
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), SourceError> {
        self.reader.read_exact(buf).map_err(|e| match e.kind() {
            // The file shrank under the walk: only a torn tail is ever truncated, so this is its end.
            io::ErrorKind::UnexpectedEof => SourceError::transient(
                super::CONTEXT,
                format!("{} shrank while it was read (a torn tail was truncated); reading again", self.path.display()),
            ),
            _ => io_error("read", self.path, e),
        })
    }

    /// An incomplete record at `pos`: a torn tail or a record being written when it is past the durable length,
    /// all-zero or a prefix, and nothing valid follows; damage otherwise.
    fn incomplete(&mut self, pos: u64, what: &str) -> Result<Slot, SourceError> {
        let durable = self.durable()?;
        match self.resync(pos)? {
            Some(end) => {
                Ok(Slot::Damaged { pos, end, what: format!("{what}, yet a valid record follows at byte {end}") })
            }
            None if pos >= durable => Ok(Slot::Incomplete { pos }),
            None => Ok(Slot::DamagedTail {
                pos,
                what: format!("{what}, inside the {durable} bytes the file was fsynced up to"),
            }),
        }
    }

    /// Damage at `pos`: the bytes up to the next valid record take one offset.
    fn damaged(&mut self, pos: u64, what: String) -> Result<Slot, SourceError> {
        match self.resync(pos)? {
            Some(end) => Ok(Slot::Damaged { pos, end, what }),
            None if pos >= self.durable()? && self.all_zero(pos)? => Ok(Slot::Incomplete { pos }),
            None => Ok(Slot::DamagedTail { pos, what }),
        }
    }

    /// The position of the first valid record after byte `pos`, if any; leaves the walk there.
    fn resync(&mut self, pos: u64) -> Result<Option<u64>, SourceError> {
        let rest = self.read_from(pos + 1)?;
        let found = find_record(&rest).map(|at| pos + 1 + at as u64);
        if let Some(end) = found {
            self.reader.seek(SeekFrom::Start(end)).map_err(|e| io_error("seek", self.path, e))?;
            self.pos = end;
        }
        Ok(found)
    }

    fn all_zero(&mut self, pos: u64) -> Result<bool, SourceError> {
        Ok(self.read_from(pos)?.iter().all(|&b| b == 0))
    }

    /// The bytes from `from` to the walk's length.
    fn read_from(&mut self, from: u64) -> Result<Vec<u8>, SourceError> {
        let mut rest = Vec::new();
        if from < self.len {
            self.reader.seek(SeekFrom::Start(from)).map_err(|e| io_error("seek", self.path, e))?;
            (&mut self.reader)
                .take(self.len - from)
                .read_to_end(&mut rest)
                .map_err(|e| io_error("read", self.path, e))?;
        }
        Ok(rest)
    }
}

/// The index of the first valid record in `bytes`: a header whose length fits and whose checksum matches.
pub(super) fn find_record(bytes: &[u8]) -> Option<usize> {
    let header = HEADER_LEN as usize;
    (0..bytes.len().saturating_sub(header - 1)).find(|&at| {
        let field =
            |i: usize| u32::from_le_bytes([bytes[at + i], bytes[at + i + 1], bytes[at + i + 2], bytes[at + i + 3]]);
        let body_len = field(0) as usize;
        let start = at + header;
        body_len >= MIN_BODY_LEN
            && body_len <= MAX_BODY_LEN as usize
            && start + body_len <= bytes.len()
            && crc32fast::hash(&bytes[start..start + body_len]) == field(4)
    })
}
