//! A set of chunk ids with a bound: which chunks of one request (or one rank's part of it) a
//! machine has seen.
//!
//! The ids come from a peer, so nothing here panics on one out of range: [`ChunkSet::insert`]
//! answers `false` and leaves the set as it was.

use fixedbitset::FixedBitSet;

/// Chunk ids `0..bound()`, each in or out, with the count of those in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChunkSet {
    bits: FixedBitSet,
    count: u32,
}

impl ChunkSet {
    /// An empty set of ids below `bound`.
    pub fn new(bound: u32) -> Self {
        Self {
            bits: FixedBitSet::with_capacity(bound as usize),
            count: 0,
        }
    }

    /// Adds `id`; true if it was not in the set and lies below the bound.
    pub fn insert(&mut self, id: u32) -> bool {
        let i = id as usize;
        if i >= self.bits.len() || self.bits.put(i) {
            return false;
        }
        self.count += 1;
        true
    }

    /// Whether `id` is in the set (an id at or above the bound never is).
    pub fn contains(&self, id: u32) -> bool {
        self.bits.contains(id as usize)
    }

    /// How many ids are in the set.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// The first id that [`ChunkSet::insert`] refuses.
    pub fn bound(&self) -> u32 {
        // `bits` only ever grows to a `u32` bound, so its length fits.
        u32::try_from(self.bits.len()).unwrap_or(u32::MAX)
    }

    /// Raises the bound to `bound` (a lower one changes nothing); the ids in the set stay.
    pub fn grow_to(&mut self, bound: u32) {
        self.bits.grow(bound as usize);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        /// Against a `BTreeSet` filtered by the bound: the same answers to every insert, the same
        /// members and count, whatever ids (in range, beyond it, repeated) and growth come.
        #[test]
        fn matches_a_set_of_the_ids_below_its_bound(
            bound in 0u32..300,
            ops in prop::collection::vec(
                prop_oneof![
                    4 => (0u32..400).prop_map(Ok),
                    1 => (0u32..400).prop_map(Err),
                ],
                0..200,
            ),
        ) {
            let mut set = ChunkSet::new(bound);
            let mut model = BTreeSet::new();
            let mut limit = bound;
            for op in ops {
                match op {
                    Ok(id) => {
                        let want = id < limit && model.insert(id);
                        prop_assert_eq!(set.insert(id), want);
                    }
                    Err(grow) => {
                        set.grow_to(grow);
                        limit = limit.max(grow);
                    }
                }
                prop_assert_eq!(set.bound(), limit);
                prop_assert_eq!(set.count() as usize, model.len());
            }
            for id in 0..420 {
                prop_assert_eq!(set.contains(id), model.contains(&id));
            }
            prop_assert!(!set.insert(u32::MAX));
        }
    }
}
