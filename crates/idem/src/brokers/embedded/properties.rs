//! Property tests of the record decoder and the walk over untrusted bytes: no panic, no endless loop, damage
//! never taken for the end of the log. `PROPTEST_CASES` raises the case count for long runs.

use super::tests::TempDir;
use super::*;
use crate::source::Partition;
use proptest::prelude::*;

/// Walks `bytes` as a partition file whose durable length is `durable`; every slot until the walk stops.
fn walk(bytes: &[u8], durable: Option<u64>) -> Vec<Slot> {
    let tmp = TempDir::new("prop");
    let path = tmp.0.join("0.log");
    fs::write(&path, bytes).unwrap();
    if let Some(durable) = durable {
        record::write_durable(&path, durable).unwrap();
    }
    let file = File::open(&path).unwrap();
    let mut walker = record::Walker::new(&file, &path, 0, bytes.len() as u64).unwrap();
    let mut slots = Vec::new();
    loop {
        let before = walker.pos();
        let slot = walker.next_slot().unwrap();
        let stop = !matches!(slot, Slot::Record { .. } | Slot::Damaged { .. });
        assert!(stop || walker.pos() > before, "the walk must move forward");
        slots.push(slot);
        if stop {
            return slots;
        }
    }
}

fn record_of(key: &Option<Vec<u8>>, payload: &[u8], headers: &[(String, Vec<u8>)]) -> Vec<u8> {
    record::encode(7, key.as_deref(), payload, headers).unwrap()
}

/// Key, payload and headers of one record.
type Parts = (Option<Vec<u8>>, Vec<u8>, Vec<(String, Vec<u8>)>);

fn records() -> impl Strategy<Value = Vec<Parts>> {
    let header = ("[a-z-]{0,8}", prop::collection::vec(any::<u8>(), 0..12));
    let record = (
        prop::option::of(prop::collection::vec(any::<u8>(), 0..16)),
        prop::collection::vec(any::<u8>(), 0..64),
        prop::collection::vec(header, 0..3),
    );
    prop::collection::vec(record, 1..12)
}

proptest! {
    #[test]
    fn decoding_any_body_never_panics(body in prop::collection::vec(any::<u8>(), 0..200)) {
        let partition = Partition { topic: "t".into(), partition: 0 };
        let _ = record::decode(&body, &partition, 0);
    }

    #[test]
    fn records_round_trip(records in records()) {
        let partition = Partition { topic: "t".into(), partition: 0 };
        let bytes: Vec<u8> = records.iter().flat_map(|(k, p, h)| record_of(k, p, h)).collect();
        let slots = walk(&bytes, Some(bytes.len() as u64));
        prop_assert_eq!(slots.len(), records.len() + 1);
        prop_assert_eq!(slots.last(), Some(&Slot::End));
        for (slot, (key, payload, headers)) in slots.iter().zip(&records) {
            let Slot::Record { body, .. } = slot else { panic!("expected a record, got {slot:?}") };
            let message = record::decode(body, &partition, 0).unwrap();
            prop_assert_eq!(&message.key, key);
            prop_assert_eq!(&message.payload, payload);
            prop_assert_eq!(&message.headers, headers);
        }
    }

    #[test]
    fn walking_any_bytes_never_panics_and_ends(bytes in prop::collection::vec(any::<u8>(), 0..600), durable in 0u64..700) {
        walk(&bytes, Some(durable));
        walk(&bytes, None);
    }

    /// One byte changed anywhere in a fully fsynced file is always reported as damage; the records before it
    /// are read intact, and the walk never stops early as if the log ended there.
    #[test]
    fn a_changed_byte_is_always_damage(records in records(), at in any::<prop::sample::Index>(), flip in 1u8..=255) {
        let bytes: Vec<u8> = records.iter().flat_map(|(k, p, h)| record_of(k, p, h)).collect();
        let at = at.index(bytes.len());
        let mut damaged = bytes.clone();
        damaged[at] ^= flip;
        let slots = walk(&damaged, Some(bytes.len() as u64));
        prop_assert!(
            slots.iter().any(|s| matches!(s, Slot::Damaged { .. } | Slot::DamagedTail { .. })),
            "byte {} changed, not reported: {:?}", at, slots
        );
        let incomplete = slots.iter().any(|s| matches!(s, Slot::Incomplete { .. }));
        prop_assert!(!incomplete, "taken for a torn tail: {:?}", slots);
    }

    /// A file cut anywhere inside its fsynced part is damage; cut past it, a torn tail.
    #[test]
    fn a_cut_file_is_damage_inside_the_fsynced_part(records in records(), cut in any::<prop::sample::Index>()) {
        let bytes: Vec<u8> = records.iter().flat_map(|(k, p, h)| record_of(k, p, h)).collect();
        let cut = cut.index(bytes.len());
        let slots = walk(&bytes[..cut], Some(bytes.len() as u64));
        prop_assert!(matches!(slots.last(), Some(Slot::DamagedTail { .. })), "{:?}", slots);
        let torn = walk(&bytes[..cut], Some(0));
        prop_assert!(matches!(torn.last(), Some(Slot::Incomplete { .. } | Slot::End)), "{:?}", torn);
    }
}
