//! The instance ids this process has resolved, by sequence and context: a message of a context seen before skips
//! the lookup that would precede its transaction. An id is a hint, never trusted alone: the claim (a foreign key to
//! the instance) and the instance lock both find an instance that housekeeping deleted meanwhile, the attempt ends
//! with [`Failure::Again`](crate::engine::Failure::Again), and the id is forgotten and resolved anew. Ids are never
//! reused, so a remembered id that still exists is the instance of its context.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

/// How many ids are remembered before the whole map is dropped: memory stays bounded with any number of open
/// contexts, and the cost of a drop is one lookup per context, as before the map.
const REMEMBERED: usize = 100_000;

/// Instance ids by sequence (its index in the configuration), then by context id.
#[derive(Default)]
pub(crate) struct KnownInstances {
    ids: Mutex<Ids>,
}

/// The map, and how many ids it holds over all sequences.
#[derive(Default)]
struct Ids {
    by_sequence: HashMap<usize, HashMap<String, i64>>,
    len: usize,
}

impl KnownInstances {
    fn ids(&self) -> std::sync::MutexGuard<'_, Ids> {
        self.ids.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The id remembered for `context` of `sequence`.
    pub(crate) fn get(&self, sequence: usize, context: &str) -> Option<i64> {
        self.ids().by_sequence.get(&sequence)?.get(context).copied()
    }

    /// Remembers `id` as the instance of `context` of `sequence`.
    pub(crate) fn remember(&self, sequence: usize, context: &str, id: i64) {
        let mut ids = self.ids();
        if ids.len >= REMEMBERED {
            *ids = Ids::default();
        }
        if ids.by_sequence.entry(sequence).or_default().insert(context.to_owned(), id).is_none() {
            ids.len += 1;
        }
    }

    /// Forgets the id of `context` of `sequence` (its instance was not found where the id said).
    pub(crate) fn forget(&self, sequence: usize, context: &str) {
        let mut ids = self.ids();
        if ids.by_sequence.get_mut(&sequence).and_then(|of| of.remove(context)).is_some() {
            ids.len -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_remembered_per_sequence_and_context_until_forgotten() {
        let known = KnownInstances::default();
        known.remember(0, "order-1", 7);
        known.remember(1, "order-1", 8);
        assert_eq!(
            (known.get(0, "order-1"), known.get(1, "order-1"), known.get(0, "order-2")),
            (Some(7), Some(8), None)
        );
        known.forget(0, "order-1");
        assert_eq!((known.get(0, "order-1"), known.get(1, "order-1")), (None, Some(8)));
    }

    #[test]
    fn the_map_is_bounded() {
        let known = KnownInstances::default();
        for n in 0..=REMEMBERED {
            known.remember(0, &n.to_string(), n as i64);
        }
        assert_eq!(known.get(0, &REMEMBERED.to_string()), Some(REMEMBERED as i64));
        assert_eq!(known.get(0, "0"), None, "the map was dropped when it was full");
        assert!(known.ids().len <= REMEMBERED);
    }
}
