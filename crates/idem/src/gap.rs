//! Lost-event detection (`idem_events_lost_total`): producers that stamp each event
//! with their id (`idem-producer-id`) and a sequence number per partition (`idem-seq`, from 1), as the Kafka
//! producer helper does, let the consumer notice a hole: a sequence that jumps ahead means events between were
//! never delivered.
//!
//! Detection is per partition worker and in memory: after a restart or a rebalance the first event of each
//! producer sets the baseline again. Redeliveries (a sequence at or below the last seen) are not gaps.

use std::collections::HashMap;

use crate::message::Message;

/// The header naming the producer instance.
pub const PRODUCER_ID_HEADER: &str = "idem-producer-id";
/// The header holding the producer's sequence number for the partition, counting from 1.
pub const SEQUENCE_HEADER: &str = "idem-seq";

/// The last sequence seen per producer on one partition.
#[derive(Debug, Default)]
pub struct SequenceGaps {
    last: HashMap<String, u64>,
}

impl SequenceGaps {
    /// Looks at the next message of the partition and returns how many events it shows as lost.
    pub fn observe(&mut self, message: &Message) -> u64 {
        let (Some(producer), Some(seq)) = (message.header(PRODUCER_ID_HEADER), message.header(SEQUENCE_HEADER)) else {
            return 0;
        };
        let (Ok(producer), Some(seq)) =
            (std::str::from_utf8(producer), std::str::from_utf8(seq).ok().and_then(|s| s.parse::<u64>().ok()))
        else {
            return 0;
        };
        match self.last.get_mut(producer) {
            None => {
                self.last.insert(producer.to_owned(), seq);
                0
            }
            Some(last) if seq > *last => {
                let lost = seq - *last - 1;
                *last = seq;
                lost
            }
            Some(_) => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamped(producer: &str, seq: u64) -> Message {
        Message::new("t", 0, 0, "x")
            .with_header(PRODUCER_ID_HEADER, producer)
            .with_header(SEQUENCE_HEADER, seq.to_string())
    }

    #[test]
    fn counts_holes_per_producer_and_ignores_redeliveries() {
        let mut gaps = SequenceGaps::default();
        let lost: u64 = [
            stamped("a", 1),
            stamped("a", 2),
            stamped("b", 7),
            stamped("a", 5),
            stamped("a", 3),
            stamped("b", 8),
            stamped("a", 6),
        ]
        .iter()
        .map(|m| gaps.observe(m))
        .sum();
        assert_eq!(lost, 2, "a: 3 and 4 missing before 5; the late 3 is a redelivery, not a gap");
        assert_eq!(gaps.observe(&Message::new("t", 0, 1, "unstamped")), 0);
    }
}
