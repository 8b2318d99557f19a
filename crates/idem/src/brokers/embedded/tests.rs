use super::*;
use crate::error::Retry;
use crate::message::Message;
use crate::source::{Acknowledgement, Partition, Publisher, Received, Source};
use std::collections::{BTreeMap, HashMap};
use std::fs::OpenOptions;
use std::io::Write;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A unique directory under the system temp dir, removed on drop.
pub(super) struct TempDir(pub(super) PathBuf);

impl TempDir {
    pub(super) fn new(name: &str) -> Self {
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
    consumer.ack(&Acknowledgement::up_to("t", 0, 1)).await.unwrap();
    consumer.ack(&Acknowledgement::up_to("t", 0, 2)).await.unwrap();
    consumer.ack(&Acknowledgement::up_to("t", 0, 1)).await.unwrap(); // backwards: ignored
    consumer.ack(&Acknowledgement::up_to("t", 1, 4)).await.unwrap();
    assert!(consumer.ack(&Acknowledgement::up_to("t", 2, 0)).await.is_err(), "not an owned partition");
    assert!(consumer.ack(&Acknowledgement::up_to("t", 0, 5)).await.is_err(), "never delivered");
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

/// Writes `n` records `r0..r{n-1}` to partition 0 of topic `t` and flushes them; returns the byte position of
/// every record.
fn fill(log: &EmbeddedLog, n: usize) -> Vec<u64> {
    log.create_topic("t", 1).unwrap();
    let producer = log.producer();
    for i in 0..n {
        producer.send_to("t", 0, Some(b"k"), format!("r{i}").as_bytes(), &[]).unwrap();
    }
    producer.flush().unwrap();
    let bytes = fs::read(log.partition_path("t", 0)).unwrap();
    let mut positions = Vec::new();
    let mut pos = 0usize;
    while pos < bytes.len() {
        positions.push(pos as u64);
        pos += 8 + u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
    }
    assert_eq!(positions.len(), n);
    positions
}

/// Reads until the consumer reports an error; returns the messages before it and the error's text.
async fn drain_until_error(consumer: &LogConsumer) -> (Vec<Message>, String) {
    let mut out = Vec::new();
    loop {
        match consumer.recv().await {
            Ok(Some(Received::Message(m))) => out.push(m),
            Ok(other) => panic!("expected an error after {} messages, got {other:?}", out.len()),
            Err(e) => {
                assert_eq!(e.retry(), Retry::Useless, "{e}");
                return (out, e.to_string());
            }
        }
    }
}

fn set_byte(path: &Path, at: u64, value: u8) {
    let mut bytes = fs::read(path).unwrap();
    bytes[at as usize] = value;
    fs::write(path, bytes).unwrap();
}

#[tokio::test]
async fn a_damaged_length_field_stops_the_reader_and_nothing_after_it_is_lost() {
    let tmp = TempDir::new("midlength");
    let log = EmbeddedLog::open(&tmp.0).unwrap();
    let positions = fill(&log, 300);
    let path = log.partition_path("t", 0);
    let len = fs::metadata(&path).unwrap().len();
    // The length field's high byte of record 200: it now announces ~2 GB.
    set_byte(&path, positions[200] + 3, 0x7f);

    let consumer = log.consumer("g", &["t"], to_end()).unwrap();
    let (before, error) = drain_until_error(&consumer).await;
    assert_eq!(before.len(), 200, "every record before the damage is delivered");
    assert!(error.contains("0.log") && error.contains("offset 200"), "{error}");
    assert!(error.contains(&format!("bytes {}..{}", positions[200], positions[201])), "{error}");
    assert!(error.contains("idem log skip") && error.contains("--offset 200"), "{error}");
    assert!(consumer.recv().await.is_err(), "it stays an error");

    // An append neither truncates nor hides anything: the file only grows, later records keep their offsets.
    assert_eq!(log.producer().send_to("t", 0, None, b"after", &[]).unwrap(), 300);
    assert!(fs::metadata(&path).unwrap().len() > len);
    let report = &log.inspect("t", false).unwrap()[0];
    assert_eq!((report.end_offset, report.records), (301, 300));
    assert_eq!(report.damage.len(), 1);
    assert_eq!(
        (report.damage[0].offset, report.damage[0].start, report.damage[0].end),
        (200, positions[200], positions[201])
    );
    assert_eq!(report.damage[0].kind, "damaged");

    // The group moves past it only by an operator's decision, at the offset it stands at.
    consumer.ack(&Acknowledgement::up_to("t", 0, 199)).await.unwrap();
    assert!(log.prepare_skip("g", "t", 0, 200).unwrap_err().to_string().contains("stop it first"));
    drop(consumer);
    assert!(log.prepare_skip("g", "t", 0, 201).unwrap_err().to_string().contains("stands at offset 200"));
    assert!(
        log.prepare_skip("g", "t", 0, 200).is_ok_and(|skip| skip.bytes.len() as u64 == positions[201] - positions[200])
    );
    log.prepare_skip("g", "t", 0, 200).unwrap().commit().unwrap();
    let consumer = log.consumer("g", &["t"], to_end()).unwrap();
    let rest = drain(&consumer).await;
    assert_eq!(rest.len(), 100);
    assert_eq!((rest[0].offset, rest[0].payload.as_slice()), (201, &b"r201"[..]));
    assert_eq!((rest[99].offset, rest[99].payload.as_slice()), (300, &b"after"[..]));
    assert!(log.prepare_skip("other", "t", 0, 0).unwrap_err().to_string().contains("intact record"));
}

#[tokio::test]
async fn damage_at_the_end_of_the_fsynced_part_refuses_appends_until_set_aside() {
    let tmp = TempDir::new("tail-damage");
    let log = EmbeddedLog::open(&tmp.0).unwrap();
    let positions = fill(&log, 50);
    let path = log.partition_path("t", 0);
    let len = fs::metadata(&path).unwrap().len();
    set_byte(&path, positions[49] + 2, 0x01); // the last record's length now runs past the end

    let consumer = log.consumer("g", &["t"], to_end()).unwrap();
    let (before, error) = drain_until_error(&consumer).await;
    assert_eq!(before.len(), 49);
    assert!(error.contains("damaged tail") && error.contains("offset 49") && error.contains("fsynced"), "{error}");
    drop(consumer);
    let refused = log.producer().send_to("t", 0, None, b"x", &[]).unwrap_err().to_string();
    assert!(refused.contains("damaged tail") && refused.contains("idem log repair"), "{refused}");
    assert!(refused.contains("--topic t --partition 0"), "the command is filled in: {refused}");
    assert_eq!(fs::metadata(&path).unwrap().len(), len, "nothing truncated");

    let repaired = log.repair_tail("t", 0).unwrap().unwrap();
    assert_eq!((repaired.start, repaired.bytes), (positions[49], len - positions[49]));
    let side = repaired.saved_to.unwrap();
    assert_eq!(fs::read(&side).unwrap().len() as u64, len - positions[49]);
    assert_eq!(log.repair_tail("t", 0).unwrap(), None);
    assert_eq!(log.producer().send_to("t", 0, None, b"x", &[]).unwrap(), 49);
}

#[tokio::test]
async fn a_file_cut_inside_its_fsynced_part_is_damage_not_a_torn_tail() {
    for cut_inside_a_record in [true, false] {
        let tmp = TempDir::new("cut");
        let log = EmbeddedLog::open(&tmp.0).unwrap();
        let positions = fill(&log, 40);
        let path = log.partition_path("t", 0);
        let cut = if cut_inside_a_record { positions[20] + 5 } else { positions[20] };
        OpenOptions::new().write(true).open(&path).unwrap().set_len(cut).unwrap();
        let consumer = log.consumer("g", &["t"], to_end()).unwrap();
        let (before, error) = drain_until_error(&consumer).await;
        assert_eq!(before.len(), 20, "cut inside a record: {cut_inside_a_record}");
        assert!(error.contains("fsynced") && error.contains("offset 20"), "{error}");
        assert!(log.producer().send_to("t", 0, None, b"x", &[]).is_err(), "no append over lost records");
        assert_eq!(fs::metadata(&path).unwrap().len(), cut);
    }
}

#[tokio::test]
async fn a_torn_tail_past_the_fsynced_part_is_still_truncated() {
    let tmp = TempDir::new("torn-durable");
    let log = EmbeddedLog::open(&tmp.0).unwrap();
    fill(&log, 5);
    let path = log.partition_path("t", 0);
    // A writer killed in the middle of its write: a prefix of a real record.
    let record = record::encode(1, None, b"never finished", &[]).unwrap();
    OpenOptions::new().append(true).open(&path).unwrap().write_all(&record[..record.len() - 3]).unwrap();
    let consumer = log.consumer("g", &["t"], to_end()).unwrap();
    assert_eq!(drain(&consumer).await.len(), 5);
    assert_eq!(
        log.inspect("t", false).unwrap()[0].torn_tail_at,
        Some(fs::metadata(&path).unwrap().len() - record.len() as u64 + 3)
    );
    assert_eq!(log.producer().send_to("t", 0, None, b"next", &[]).unwrap(), 5);
    assert_eq!(payloads(&drain(&consumer).await), vec!["next"]);
}

#[tokio::test]
async fn an_undecodable_record_with_a_good_checksum_can_be_skipped() {
    let tmp = TempDir::new("undecodable");
    let log = EmbeddedLog::open(&tmp.0).unwrap();
    fill(&log, 3);
    let path = log.partition_path("t", 0);
    // A record whose header name is not UTF-8, with a checksum that matches.
    let mut record = record::encode(1, None, b"payload", &[("ab".into(), b"v".to_vec())]).unwrap();
    let name_at = 8 + 8 + 4 + 2 + 2;
    record[name_at..name_at + 2].copy_from_slice(&[0xff, 0xfe]);
    let crc = crc32fast::hash(&record[8..]);
    record[4..8].copy_from_slice(&crc.to_le_bytes());
    OpenOptions::new().append(true).open(&path).unwrap().write_all(&record).unwrap();
    log.producer().send_to("t", 0, None, b"after", &[]).unwrap();

    let consumer = log.consumer("g", &["t"], to_end()).unwrap();
    let (before, error) = drain_until_error(&consumer).await;
    assert_eq!(before.len(), 3);
    assert!(error.contains("offset 3") && error.contains("not UTF-8") && error.contains("idem log skip"), "{error}");
    consumer.ack(&Acknowledgement::up_to("t", 0, 2)).await.unwrap();
    drop(consumer);
    let report = &log.inspect("t", true).unwrap()[0];
    assert_eq!(report.damage[0].kind, "undecodable");
    assert_eq!(report.entries.len(), 4);
    let skip = log.prepare_skip("g", "t", 0, 3).unwrap();
    assert_eq!(skip.bytes, record);
    skip.commit().unwrap();
    let consumer = log.consumer("g", &["t"], to_end()).unwrap();
    assert_eq!(payloads(&drain(&consumer).await), vec!["after"]);
}

#[test]
fn a_meta_json_with_fewer_partitions_than_files_is_refused() {
    let tmp = TempDir::new("meta");
    let log = EmbeddedLog::open(&tmp.0).unwrap();
    log.create_topic("t", 4).unwrap();
    fs::write(tmp.0.join("topics/t/meta.json"), br#"{"partitions": 2}"#).unwrap();
    let error = log.consumer("g", &["t"], to_end()).unwrap_err().to_string();
    assert!(error.contains("declares 2 partitions") && error.contains("back to 4"), "{error}");
    assert!(log.producer().send("t", None, b"x", &[]).is_err());
}
