//! `idem log`: inspect the embedded log, move a consumer group past a damaged record, set a damaged tail aside.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use idem::embedded::EmbeddedLog;
use idem::embedded::repair::PartitionReport;
use idem::store::NewDeadLetter;
use idem::{Backend, Message};

use crate::DbArgs;
use crate::db::{self, Db};
use crate::with_pool;

/// The `idem log` subcommands.
#[derive(clap::Subcommand)]
pub enum LogCommand {
    /// Read every partition to its end: records, offsets, the durable length, damaged ranges and undecodable
    /// records, a torn tail. Exits 1 when it finds damage.
    Inspect {
        /// The embedded log's directory.
        #[arg(long)]
        log_dir: PathBuf,
        /// Only this topic (default: every topic).
        #[arg(long)]
        topic: Option<String>,
        /// Also list every record (offset, byte position, length, checksum, key, headers, payload size).
        #[arg(long)]
        records: bool,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Move a consumer group past the damaged or undecodable record it is stopped at, writing the record's bytes
    /// to the dead letters first. Stop the group's consumer of that partition first.
    Skip {
        /// The embedded log's directory.
        #[arg(long)]
        log_dir: PathBuf,
        /// The consumer group to move.
        #[arg(long)]
        group: String,
        /// The topic.
        #[arg(long)]
        topic: String,
        /// The partition.
        #[arg(long)]
        partition: i32,
        /// The damaged record's offset: the offset the group stands at (named in the consumer's error).
        #[arg(long)]
        offset: i64,
        #[command(flatten)]
        db: DbArgs,
    },
    /// Append messages read from stdin, one per line (JSON lines, typically), then fsync: the embedded log's
    /// producer for scripts and other languages. Prints `{"produced": N}`.
    Produce {
        /// The embedded log's directory (created if missing).
        #[arg(long)]
        log_dir: PathBuf,
        /// The topic (created with --partitions if missing).
        #[arg(long)]
        topic: String,
        /// Partitions of a topic created here (default 1); for an existing topic, checked against its count.
        #[arg(long)]
        partitions: Option<i32>,
        /// The message key, read from each line's JSON at this pointer (e.g. /account): one key's messages go to
        /// one partition, in order. Without it, messages go round-robin.
        #[arg(long)]
        key_pointer: Option<String>,
        /// A header for every message, NAME=VALUE; repeatable.
        #[arg(long = "header")]
        headers: Vec<String>,
    },
    /// Move the damaged tail of a partition (damage no valid record follows, which refuses appends) to a side file
    /// `<p>.damaged-<byte>.bin` beside it, then truncate it. Producers wait meanwhile.
    Repair {
        /// The embedded log's directory.
        #[arg(long)]
        log_dir: PathBuf,
        /// The topic.
        #[arg(long)]
        topic: String,
        /// The partition.
        #[arg(long)]
        partition: i32,
    },
}

/// Runs one `idem log` subcommand.
pub async fn run(command: LogCommand) -> anyhow::Result<ExitCode> {
    match command {
        LogCommand::Inspect { log_dir, topic, records, json } => inspect(&log_dir, topic.as_deref(), records, json),
        LogCommand::Skip { log_dir, group, topic, partition, offset, db } => {
            skip(&log_dir, &group, &topic, partition, offset, &db).await
        }
        LogCommand::Repair { log_dir, topic, partition } => repair(&log_dir, &topic, partition),
        LogCommand::Produce { log_dir, topic, partitions, key_pointer, headers } => {
            produce(&log_dir, &topic, partitions, key_pointer.as_deref(), &headers)
        }
    }
}

/// Opens an existing log; never creates one.
fn open_existing(dir: &Path) -> anyhow::Result<EmbeddedLog> {
    if !dir.join("topics").is_dir() {
        bail!("there is no embedded log in {}: --log-dir names the directory given to the producer", dir.display());
    }
    Ok(EmbeddedLog::open(dir)?)
}

fn inspect(dir: &Path, topic: Option<&str>, records: bool, json: bool) -> anyhow::Result<ExitCode> {
    let log = open_existing(dir)?;
    let topics = match topic {
        Some(topic) => vec![topic.to_owned()],
        None => log.topics()?,
    };
    let mut reports: Vec<PartitionReport> = Vec::new();
    for topic in &topics {
        reports.extend(log.inspect(topic, records).with_context(|| format!("inspecting topic {topic}"))?);
    }
    let healthy = reports.iter().all(PartitionReport::healthy);
    if json {
        println!("{}", serde_json::json!({ "log_dir": dir, "healthy": healthy, "partitions": reports }));
    } else {
        println!(
            "{:<24} {:>9} {:>12} {:>12} {:>10} {:>8}  state",
            "topic/partition", "offsets", "bytes", "durable", "records", "damage"
        );
        for r in &reports {
            let state = match (r.healthy(), r.torn_tail_at) {
                (false, _) => "DAMAGED".to_owned(),
                (true, Some(at)) => format!("torn tail at byte {at} (truncated by the next append)"),
                (true, None) => "ok".to_owned(),
            };
            let name = format!("{}/{}", r.topic, r.partition);
            println!(
                "{name:<24} {:>9} {:>12} {:>12} {:>10} {:>8}  {state}",
                r.end_offset,
                r.bytes,
                r.durable_bytes,
                r.records,
                r.damage.len()
            );
            for d in &r.damage {
                println!("    offset {} (bytes {}..{}) {}: {}", d.offset, d.start, d.end, d.kind, d.what);
            }
            for e in &r.entries {
                println!(
                    "    offset {:>8}  byte {:>10}  length {:>7}  crc {:08x}  key {:?}  headers {}  payload {} bytes",
                    e.offset, e.start, e.length, e.checksum, e.key, e.headers, e.payload_bytes
                );
            }
        }
        if !healthy {
            println!(
                "damage found: `idem log skip` moves a consumer group past a damaged record in the middle of a file; \
                 `idem log repair` sets a damaged tail aside"
            );
        }
    }
    Ok(if healthy { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

async fn skip(
    dir: &Path,
    group: &str,
    topic: &str,
    partition: i32,
    offset: i64,
    args: &DbArgs,
) -> anyhow::Result<ExitCode> {
    let log = open_existing(dir)?;
    let skip = log.prepare_skip(group, topic, partition, offset)?;
    let tables = db::tables(args)?;
    let database = Db::open(&args.database_url, 1).await?;
    let reason = format!(
        "damaged record in the embedded log at {}: {topic}/{partition} offset {offset}, bytes {}..{}: {}; moved past \
         with `idem log skip`; the payload holds the record's raw bytes, header included",
        dir.display(),
        skip.start,
        skip.end,
        skip.what
    );
    let message = Message::new(topic, partition, offset, skip.bytes.clone());
    let letter = NewDeadLetter { event_id: None, message: &message, error: &reason, attempts: 1 };
    with_pool!(&database, pool => store_letter(pool, &tables, group, &letter).await?);
    let (start, end) = (skip.start, skip.end);
    skip.commit()?;
    println!(
        "group {group} moved past {topic}/{partition} offset {offset} (bytes {start}..{end}, {} bytes kept in the dead \
         letters); it resumes at offset {}",
        end - start,
        offset + 1
    );
    Ok(ExitCode::SUCCESS)
}

/// Stores one dead letter in its own transaction (a second skip of the same offset updates the same row).
async fn store_letter<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &idem::Tables,
    group: &str,
    letter: &NewDeadLetter<'_>,
) -> anyhow::Result<()> {
    use sqlx::Connection;
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin().await?;
    DB::dead_letter(&mut tx, tables, group, letter)
        .await
        .with_context(|| "cannot write the dead letter (run `idem migrate` with the same --table-prefix first?)")?;
    tx.commit().await?;
    Ok(())
}

fn repair(dir: &Path, topic: &str, partition: i32) -> anyhow::Result<ExitCode> {
    let log = open_existing(dir)?;
    match log.repair_tail(topic, partition)? {
        None => println!("{topic}/{partition} has no damaged tail: nothing to do"),
        Some(repaired) => {
            println!("{topic}/{partition}: {} ({} bytes from byte {})", repaired.what, repaired.bytes, repaired.start);
            match &repaired.saved_to {
                Some(side) => println!("the damaged bytes were moved to {}; appends can go on", side.display()),
                None => println!("no bytes were left to move; the durable length now matches the file"),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `idem log produce`: stdin's lines, one message each, appended and made durable.
fn produce(
    dir: &Path,
    topic: &str,
    partitions: Option<i32>,
    key_pointer: Option<&str>,
    headers: &[String],
) -> anyhow::Result<ExitCode> {
    use std::io::BufRead;
    let headers: Vec<(String, Vec<u8>)> = headers
        .iter()
        .map(|h| match h.split_once('=') {
            Some((name, value)) if !name.is_empty() => Ok((name.to_owned(), value.as_bytes().to_vec())),
            _ => Err(anyhow::anyhow!("--header `{h}` is not NAME=VALUE")),
        })
        .collect::<anyhow::Result<_>>()?;
    if let Some(pointer) = key_pointer
        && !pointer.starts_with('/')
    {
        anyhow::bail!("--key-pointer `{pointer}` is not a JSON pointer: write it with a leading slash, e.g. /account");
    }
    let log = EmbeddedLog::open(dir)?;
    match partitions {
        Some(n) => log.create_topic(topic, n)?,
        None if log.partitions(topic).is_ok() => {}
        None => log.create_topic(topic, 1)?,
    }
    let producer = log.producer();
    let mut produced = 0u64;
    // The line of the last record sent, and of the first one not appended when a line fails.
    let mut last_sent = 0usize;
    let appended = (|| -> anyhow::Result<()> {
        for (n, line) in std::io::stdin().lock().lines().enumerate() {
            let line = line.with_context(|| format!("line {}: reading stdin", n + 1))?;
            if line.trim().is_empty() {
                continue;
            }
            let key = match key_pointer {
                Some(pointer) => {
                    let doc: serde_json::Value = serde_json::from_str(&line)
                        .with_context(|| format!("line {}: not JSON, so --key-pointer finds no key", n + 1))?;
                    let key = match doc.pointer(pointer) {
                        Some(serde_json::Value::String(s)) => s.clone(),
                        Some(v @ serde_json::Value::Number(_)) => v.to_string(),
                        _ => anyhow::bail!("line {}: {pointer} is not a string or a number", n + 1),
                    };
                    Some(key)
                }
                None => None,
            };
            producer
                .send(topic, key.as_deref().map(str::as_bytes), line.as_bytes(), &headers)
                .with_context(|| format!("line {}: appending it", n + 1))?;
            produced += 1;
            last_sent = n + 1;
            if produced.is_multiple_of(10_000) {
                producer.flush()?;
            }
        }
        Ok(())
    })();
    let flushed = producer.flush();
    if let Err(error) = appended {
        let resume = last_sent + 1;
        return Err(match flushed {
            Ok(()) => error.context(format!(
                "{produced} record(s) appended to {topic} (input lines 1 to {last_sent}), nothing after: fix the \
                 line, then resume from line {resume} (tail -n +{resume} FILE | idem log produce ...)"
            )),
            Err(flush) => error.context(format!(
                "at most {produced} record(s) sent to {topic} (input lines 1 to {last_sent}), and their flush \
                 failed too ({flush}): count what the topic holds (idem log read) before resuming"
            )),
        });
    }
    flushed?;
    println!("{}", serde_json::json!({ "produced": produced }));
    Ok(ExitCode::SUCCESS)
}
