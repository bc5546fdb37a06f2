//! Decode's store of the payloads prefill ranks send beside a request's pages ([`Msg::Aux`]), read
//! once by the server (`DecodeEngine::aux`). Sans-IO.
//!
//! It is bounded in entries and bytes. When a payload would pass either bound, payloads go oldest
//! first from the prefill instance (session) that holds the most of what is over: an instance that
//! sends more than its share loses its own, never a quieter instance's. A payload that is taken
//! leaves nothing behind (the first version kept its place in the eviction order for good).
//!
//! [`Msg::Aux`]: crate::control::Msg::Aux

use crate::core::RequestId;
use std::cmp::Reverse;
use std::collections::{HashMap, VecDeque};

/// A payload's key: the request and the PP rank that sent it.
pub(crate) type Key = (RequestId, u16);

/// The payloads not yet taken.
#[derive(Debug)]
pub(crate) struct AuxStore {
    max_entries: usize,
    max_bytes: usize,
    at: HashMap<Key, Held>,
    sessions: HashMap<u64, Queue>,
    bytes: usize,
    next_seq: u64,
}

#[derive(Debug)]
struct Held {
    session: u64,
    /// Its place in its session's queue (a queue entry with another is stale).
    seq: u64,
    data: Vec<u8>,
}

/// One session's payloads, oldest first; entries whose payload was taken or replaced are skipped,
/// and dropped once they are more than the live ones.
#[derive(Debug, Default)]
struct Queue {
    order: VecDeque<(u64, Key)>,
    entries: usize,
    bytes: usize,
}

impl Default for AuxStore {
    fn default() -> Self {
        AuxStore::new(AuxStore::MAX_ENTRIES, AuxStore::MAX_BYTES)
    }
}

impl AuxStore {
    /// Payloads kept at once.
    pub(crate) const MAX_ENTRIES: usize = 4096;
    /// Bytes of payloads kept at once.
    pub(crate) const MAX_BYTES: usize = 32 << 20;

    pub(crate) fn new(max_entries: usize, max_bytes: usize) -> Self {
        AuxStore {
            max_entries,
            max_bytes,
            at: HashMap::new(),
            sessions: HashMap::new(),
            bytes: 0,
            next_seq: 0,
        }
    }

    /// Keeps `data` from `session` under `key` (replacing what was there); returns how many
    /// payloads went to keep within the bounds.
    pub(crate) fn put(&mut self, session: u64, key: Key, data: Vec<u8>) -> usize {
        self.remove(key);
        let seq = self.next_seq;
        self.next_seq += 1;
        let q = self.sessions.entry(session).or_default();
        q.order.push_back((seq, key));
        q.entries += 1;
        q.bytes += data.len();
        self.bytes += data.len();
        self.at.insert(key, Held { session, seq, data });
        let mut dropped = 0;
        while self.at.len() > self.max_entries || self.bytes > self.max_bytes {
            let by_bytes = self.bytes > self.max_bytes;
            let Some(victim) = self.busiest(by_bytes) else {
                break;
            };
            if !self.drop_oldest(victim) {
                break;
            }
            dropped += 1;
        }
        dropped
    }

    /// Takes the payload under `key`, if one is kept.
    pub(crate) fn take(&mut self, key: Key) -> Option<Vec<u8>> {
        self.remove(key)
    }

    fn remove(&mut self, key: Key) -> Option<Vec<u8>> {
        let held = self.at.remove(&key)?;
        self.bytes -= held.data.len();
        if let Some(q) = self.sessions.get_mut(&held.session) {
            q.entries -= 1;
            q.bytes -= held.data.len();
            if q.entries == 0 {
                self.sessions.remove(&held.session);
            } else if q.order.len() > 2 * q.entries + 16 {
                let at = &self.at;
                q.order
                    .retain(|(seq, k)| at.get(k).is_some_and(|h| h.seq == *seq));
            }
        }
        Some(held.data)
    }

    /// The session holding the most bytes (`by_bytes`) or payloads; of equals, the one whose
    /// queue starts oldest.
    fn busiest(&self, by_bytes: bool) -> Option<u64> {
        self.sessions
            .iter()
            .max_by_key(|(_, q)| {
                let held = if by_bytes { q.bytes } else { q.entries };
                (held, Reverse(q.order.front().map(|(seq, _)| *seq)))
            })
            .map(|(s, _)| *s)
    }

    /// Drops `session`'s oldest payload; false if it has none.
    fn drop_oldest(&mut self, session: u64) -> bool {
        loop {
            let Some((seq, key)) = self
                .sessions
                .get_mut(&session)
                .and_then(|q| q.order.pop_front())
            else {
                return false;
            };
            if self.at.get(&key).is_some_and(|h| h.seq == seq) {
                self.remove(key);
                return true;
            }
        }
    }

    #[cfg(test)]
    fn check(&self) {
        assert!(self.at.len() <= self.max_entries);
        assert!(self.bytes <= self.max_bytes);
        assert_eq!(
            self.bytes,
            self.at.values().map(|h| h.data.len()).sum::<usize>()
        );
        for (s, q) in &self.sessions {
            let live: Vec<_> = self.at.values().filter(|h| h.session == *s).collect();
            assert!(q.entries > 0);
            assert_eq!(q.entries, live.len());
            assert_eq!(q.bytes, live.iter().map(|h| h.data.len()).sum::<usize>());
            assert!(
                q.order.len() <= 2 * q.entries + 17,
                "{} for {}",
                q.order.len(),
                q.entries
            );
        }
        assert!(
            self.at
                .values()
                .all(|h| self.sessions.contains_key(&h.session))
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Put {
            session: u64,
            request: u64,
            rank: u16,
            len: usize,
        },
        Take {
            request: u64,
            rank: u16,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..4, 0u64..24, 0u16..2, 0usize..120).prop_map(|(session, request, rank, len)| {
                Op::Put {
                    session,
                    request,
                    rank,
                    len,
                }
            }),
            (0u64..24, 0u16..2).prop_map(|(request, rank)| Op::Take { request, rank }),
        ]
    }

    proptest! {
        /// Within the bounds after every step, its books agree with what it holds, and a taken or
        /// replaced payload leaves at most a bounded trace. A session that held no more than its
        /// share of either bound (shared among the sessions holding payloads after the put) loses
        /// nothing to another session's put.
        #[test]
        fn payloads_stay_bounded_and_a_quiet_session_keeps_its_own(
            ops in proptest::collection::vec(op(), 1..400),
        ) {
            let (max_entries, max_bytes) = (10, 400);
            let mut store = AuxStore::new(max_entries, max_bytes);
            for op in ops {
                match op {
                    Op::Put { session, request, rank, len } => {
                        let key = (RequestId(request), rank);
                        let before: HashMap<Key, (u64, usize)> = store
                            .at
                            .iter()
                            .map(|(k, h)| (*k, (h.session, h.data.len())))
                            .collect();
                        let mut share: HashMap<u64, (usize, usize)> = HashMap::new();
                        for (s, len) in before.values() {
                            let e = share.entry(*s).or_default();
                            e.0 += 1;
                            e.1 += len;
                        }
                        // Sessions holding payloads once this one is in, before any goes.
                        let k = share.len() + usize::from(!share.contains_key(&session));
                        store.put(session, key, vec![request as u8; len]);
                        store.check();
                        for (s, (entries, bytes)) in &share {
                            if *s == session || entries * k > max_entries || bytes * k > max_bytes {
                                continue;
                            }
                            for (held, (owner, _)) in &before {
                                // A key is one instance's (decode drops an aux payload about
                                // another's request); the put's own key is replaced, not lost.
                                if owner == s && *held != key {
                                    prop_assert!(store.at.contains_key(held), "{s} lost {held:?}");
                                }
                            }
                        }
                    }
                    Op::Take { request, rank } => {
                        let key = (RequestId(request), rank);
                        let had = store.at.get(&key).map(|h| h.data.clone());
                        prop_assert_eq!(store.take(key), had);
                        prop_assert!(!store.at.contains_key(&key));
                        store.check();
                    }
                }
            }
        }
    }

    /// A server that takes every payload (but one of each instance, kept all along): nothing
    /// piles up, however many pass.
    #[test]
    fn taken_payloads_leave_nothing_behind() {
        let mut store = AuxStore::default();
        for session in 0..3 {
            store.put(session, (RequestId(u64::MAX - session), 0), vec![0; 8]);
        }
        for request in 0..100_000u64 {
            let key = (RequestId(request), 0);
            store.put(request % 3, key, vec![1; 64]);
            assert_eq!(store.take(key).unwrap().len(), 64);
        }
        store.check();
        assert_eq!(store.at.len(), 3);
        for session in 0..3 {
            assert!(store.take((RequestId(u64::MAX - session), 0)).is_some());
        }
        assert!(store.sessions.is_empty());
        // Replaced again and again before it is taken.
        for _ in 0..100_000 {
            store.put(7, (RequestId(1), 0), vec![2; 8]);
        }
        store.check();
        assert_eq!(store.sessions[&7].order.len(), 1);
    }
}
