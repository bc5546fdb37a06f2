//! The decode side's completion tracker.
//!
//! For each expected request and each of its PP ranks, the tracker keeps a bitset of received
//! chunk ids and, once the rank's `LAST` arrived, the rank's chunk count. A request is
//! **complete** iff every one of its `pp_size` ranks sent `LAST` and every chunk id below that
//! rank's count is present. Chunk ids of different ranks never share a set: that sharing is the
//! bug that once let one rank's chunks complete a PP=4 transfer.
//!
//! # Rules
//! - Each rank is bound, at [`CompletionTracker::expect`], to the peer that serves it. A
//!   notification about rank `r` counts only if it came from the peer bound to `r`; anything else
//!   is dropped with [`NotifyError::WrongPeer`] and cannot complete, fail or disturb the request.
//!   A rank at or above `pp_size` has no bound peer and is dropped the same way.
//! - From the bound peer, duplicates are idempotent. A `FAILURE` fails the request. A protocol
//!   violation fails it too ([`ViolationKind`]): a second, different count; a chunk id at or above
//!   the rank's count; a chunk id or count above [`TrackerConfig::max_chunks_per_rank`].
//! - `LAST` carries the rank's chunk count and may name any chunk id below it, new or already
//!   seen, and may repeat. Senders mark whichever chunk they finish last (SGLang sets `is_last`
//!   on the chunk it sends last), and a retransmitted or re-sent `LAST` may arrive after every
//!   chunk did; what must hold is that all of them state one count. A rank is done as soon as
//!   its count is known and every chunk below it is present, whichever notification made that
//!   so; a done rank stays counted once, however often its `LAST` repeats.
//! - The deadline given to `expect` fails the request with [`FailureReason::Timeout`] at the
//!   first [`CompletionTracker::handle_timeout`] at or after it.
//! - Each request yields exactly one terminal [`TrackerEvent`]. Its id is then remembered (up to
//!   [`TrackerConfig::finished_memory`] ids, oldest forgotten first), and notifications for it are
//!   counted as late and dropped.
//! - Notifications for a request not yet expected wait in a bounded buffer (at most
//!   [`TrackerConfig::early_buffer_cap`] notifications, each for at most
//!   [`TrackerConfig::early_buffer_ttl`]) and are replayed, with the same peer check, when the
//!   request is expected. Overflow and expiry drop them and count them. A dropped notification can
//!   only delay a request (which then completes on a retransmission or times out); it can never
//!   complete one wrongly, because completion needs every chunk.
//!
//! # Output order
//! Events come out of [`CompletionTracker::poll_event`] in the order the requests finished.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use foldhash::fast::FixedState;

use crate::core::chunkset::ChunkSet;
use crate::core::notify::{ChunkNotification, ChunkStatus};
use crate::core::{Clock, FailureCode, PeerId, RequestId};

/// Limits of a [`CompletionTracker`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TrackerConfig {
    /// Largest chunk count a rank may announce (and so the largest chunk id plus one). Bounds
    /// the bitset a peer can make us allocate: `max_chunks_per_rank / 8` bytes per rank.
    pub max_chunks_per_rank: u32,
    /// Largest `pp_size` accepted by `expect`.
    pub max_pp_size: u16,
    /// Notifications that may wait for their request to be expected, in all.
    pub early_buffer_cap: usize,
    /// How long a request's early notifications may wait before they are dropped.
    pub early_buffer_ttl: Duration,
    /// Finished request ids remembered to classify late notifications.
    pub finished_memory: usize,
    /// Seed of the request-id hash; give each process a random one so peers cannot choose ids
    /// that collide.
    pub hash_seed: u64,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        Self {
            max_chunks_per_rank: 1 << 20,
            max_pp_size: 64,
            early_buffer_cap: 1 << 16,
            early_buffer_ttl: Duration::from_secs(30),
            finished_memory: 1 << 16,
            hash_seed: 0x5eed_f00d_c0de,
        }
    }
}

/// What a protocol violation was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ViolationKind {
    /// A chunk id at or above [`TrackerConfig::max_chunks_per_rank`].
    ChunkIdOverCap {
        /// Chunk id.
        chunk_id: u32,
        /// Cap.
        cap: u32,
    },
    /// A count above [`TrackerConfig::max_chunks_per_rank`].
    CountOverCap {
        /// Count.
        count: u32,
        /// Cap.
        cap: u32,
    },
    /// A `LAST` whose count does not exceed its own chunk id.
    CountNotAboveChunk {
        /// Chunk id.
        chunk_id: u32,
        /// Count.
        count: u32,
    },
    /// A second `LAST` with a different count.
    CountChanged {
        /// The count that arrived first.
        first: u32,
        /// The different one.
        second: u32,
    },
    /// A chunk id at or above the rank's count (before or after the count arrived).
    ChunkBeyondCount {
        /// Chunk id.
        chunk_id: u32,
        /// Count.
        count: u32,
    },
    /// The chunk's bytes do not hash to the checksum its notification carried. The tracker
    /// never sees bytes; the engine checks and reports this through
    /// [`CompletionTracker::fail`].
    ChecksumMismatch {
        /// Chunk id.
        chunk_id: u32,
    },
}

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureReason {
    /// [`CompletionTracker::abort`] was called.
    Aborted,
    /// The deadline passed first.
    Timeout,
    /// The rank's bound peer sent `FAILURE`.
    PeerFailed {
        /// PP rank.
        rank: u16,
        /// Code it sent.
        code: FailureCode,
    },
    /// The engine reported the rank's peer lost ([`CompletionTracker::handle_peer_lost`]).
    PeerLost {
        /// PP rank.
        rank: u16,
        /// The lost peer.
        peer: PeerId,
    },
    /// The rank's bound peer broke the protocol.
    ProtocolViolation {
        /// PP rank.
        rank: u16,
        /// What it did.
        kind: ViolationKind,
    },
    /// The rank was not connected when the request was expected, and did not connect within the
    /// wait the engine allows (the tracker never produces this: the request never reached it).
    RankUnavailable {
        /// The lowest absent PP rank.
        rank: u16,
    },
}

/// A terminal outcome, emitted exactly once per expected request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TrackerEvent {
    /// Every chunk of every rank arrived.
    Complete {
        /// The request.
        request: RequestId,
    },
    /// The request failed.
    Failed {
        /// The request.
        request: RequestId,
        /// Why.
        reason: FailureReason,
    },
}

/// What happened to an accepted notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Accepted {
    /// A chunk not seen before (it may have completed the request: see `poll_event`).
    NewChunk,
    /// The chunk was already seen. Its bitset is unchanged, but a repeated `LAST` may have
    /// supplied the rank's count and so completed the request (see `poll_event`).
    Duplicate,
    /// The request is not expected yet; the notification waits.
    Buffered,
    /// The request already finished; counted and dropped.
    Late,
    /// The rank reported failure; the request failed.
    RankFailed,
}

/// Why a notification was not accepted. Only [`NotifyError::Violation`] changes the request
/// (it fails it); every other error leaves all state as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotifyError {
    /// The rank's bound peer broke the protocol; the request has failed.
    #[error("request {request:?} rank {rank}: protocol violation {kind:?}; request failed")]
    Violation {
        /// The request.
        request: RequestId,
        /// PP rank.
        rank: u16,
        /// What.
        kind: ViolationKind,
    },
    /// Sent by a peer that is not bound to the rank it names; dropped.
    #[error("request {request:?} rank {rank}: from {from:?}, but the rank is bound to {bound:?}")]
    WrongPeer {
        /// The request.
        request: RequestId,
        /// PP rank named.
        rank: u16,
        /// Sender.
        from: PeerId,
        /// Bound peer.
        bound: PeerId,
    },
    /// Names a rank the request does not have; dropped.
    #[error("request {request:?}: rank {rank} out of pp_size {pp_size}")]
    RankOutOfRange {
        /// The request.
        request: RequestId,
        /// PP rank named.
        rank: u16,
        /// The request's PP size.
        pp_size: u16,
    },
    /// For an unknown request, and the early buffer is full; dropped.
    #[error("request {request:?} unknown and the early buffer is full")]
    BufferFull {
        /// The request.
        request: RequestId,
    },
    /// For an unknown request and invalid on its face; dropped, not buffered.
    #[error("request {request:?} unknown and the notification is invalid: {kind:?}")]
    InvalidEarly {
        /// The request.
        request: RequestId,
        /// What is wrong with it.
        kind: ViolationKind,
    },
    /// For an unknown request, naming a rank at or above [`TrackerConfig::max_pp_size`].
    #[error("request {request:?} unknown and rank {rank} exceeds the PP limit")]
    EarlyRankOverLimit {
        /// The request.
        request: RequestId,
        /// PP rank named.
        rank: u16,
    },
}

/// Misuse of [`CompletionTracker::expect`], [`CompletionTracker::abort`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TrackerError {
    /// `pp_size` of 0.
    #[error("pp_size must be at least 1")]
    ZeroPpSize,
    /// `pp_size` above [`TrackerConfig::max_pp_size`].
    #[error("pp_size {pp_size} exceeds the limit {max}")]
    PpSizeTooLarge {
        /// Given.
        pp_size: u16,
        /// Limit.
        max: u16,
    },
    /// `peers.len() != pp_size`.
    #[error("pp_size {pp_size} but {peers} peers bound")]
    PeerCountMismatch {
        /// Given.
        pp_size: u16,
        /// Peers given.
        peers: usize,
    },
    /// The request is already being tracked.
    #[error("request {0:?} is already in flight")]
    AlreadyInFlight(RequestId),
    /// The request finished recently; `forget` it first to reuse the id.
    #[error("request {0:?} already finished")]
    AlreadyFinished(RequestId),
    /// The request is not in flight.
    #[error("request {0:?} is not in flight")]
    NotInFlight(RequestId),
}

/// Running totals, for metrics and for tests that check nothing was lost silently.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Counters {
    /// Notifications handled (including replays from the early buffer).
    pub notifications: u64,
    /// New chunks recorded.
    pub new_chunks: u64,
    /// Duplicate chunks ignored.
    pub duplicates: u64,
    /// Notifications for finished requests.
    pub late: u64,
    /// Notifications for requests not (yet) expected.
    pub unknown: u64,
    /// Of those, buffered.
    pub buffered: u64,
    /// Of those, dropped because the buffer was full.
    pub buffer_overflow: u64,
    /// Buffered notifications dropped because their request was not expected in time.
    pub buffer_expired: u64,
    /// Of those, invalid on their face and not buffered.
    pub invalid_early: u64,
    /// From a peer not bound to the rank named.
    pub wrong_peer: u64,
    /// Naming a rank at or above the request's `pp_size` (or the PP limit, when unknown).
    pub rank_out_of_range: u64,
    /// Protocol violations (each failed its request).
    pub violations: u64,
    /// Requests completed.
    pub completed: u64,
    /// Requests failed (any reason).
    pub failed: u64,
    /// Of those, by deadline.
    pub timeouts: u64,
}

type Map<K, V> = HashMap<K, V, FixedState>;

struct RankState {
    peer: PeerId,
    /// 0 until `LAST` arrived (a valid count is never 0).
    count: u32,
    /// Highest chunk id seen plus one, to catch chunks beyond a count that arrives later.
    high: u32,
    /// The chunk ids seen; its bound grows with them, up to the cap.
    seen: ChunkSet,
}

struct InFlight {
    deadline: Instant,
    ranks: Box<[RankState]>,
    ranks_done: u16,
}

struct Early {
    expires: Instant,
    items: Vec<(PeerId, ChunkNotification)>,
}

enum Step {
    /// `new`: the chunk was not seen before. `done`: the request is now complete.
    Accept {
        new: bool,
        done: bool,
    },
    Fail(FailureReason, Result<Accepted, NotifyError>),
    Reject(NotifyError),
}

/// The decode side's completion tracker. See the [module docs](self) for its rules.
pub struct CompletionTracker {
    cfg: TrackerConfig,
    clock: Clock,
    in_flight: Map<RequestId, InFlight>,
    deadlines: BinaryHeap<Reverse<(Instant, RequestId)>>,
    finished: HashSet<RequestId, FixedState>,
    finished_order: VecDeque<RequestId>,
    early: Map<RequestId, Early>,
    early_order: VecDeque<(Instant, RequestId)>,
    early_total: usize,
    events: VecDeque<TrackerEvent>,
    counters: Counters,
}

impl std::fmt::Debug for CompletionTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionTracker")
            .field("in_flight", &self.in_flight.len())
            .field("early_buffered", &self.early_total)
            .field("pending_events", &self.events.len())
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl CompletionTracker {
    /// An empty tracker.
    pub fn new(cfg: TrackerConfig) -> Self {
        let seed = cfg.hash_seed;
        Self {
            clock: Clock::new(),
            in_flight: HashMap::with_hasher(FixedState::with_seed(seed)),
            deadlines: BinaryHeap::new(),
            finished: HashSet::with_hasher(FixedState::with_seed(seed ^ 1)),
            finished_order: VecDeque::new(),
            early: HashMap::with_hasher(FixedState::with_seed(seed ^ 2)),
            early_order: VecDeque::new(),
            early_total: 0,
            events: VecDeque::new(),
            counters: Counters::default(),
            cfg,
        }
    }

    /// Starts tracking `request`: `pp_size` ranks, rank `r` served by `peers[r]`, failing at
    /// `deadline`. Notifications that arrived early are replayed now, so this may already queue
    /// the request's terminal event.
    ///
    /// # Errors
    /// [`TrackerError`] for a bad `pp_size`, a peer list of the wrong length, or an id that is
    /// in flight or recently finished. Nothing changes on error.
    pub fn expect(
        &mut self,
        now: Instant,
        request: RequestId,
        pp_size: u16,
        peers: &[PeerId],
        deadline: Instant,
    ) -> Result<(), TrackerError> {
        let now = self.clock.observe(now);
        if pp_size == 0 {
            return Err(TrackerError::ZeroPpSize);
        }
        if pp_size > self.cfg.max_pp_size {
            return Err(TrackerError::PpSizeTooLarge {
                pp_size,
                max: self.cfg.max_pp_size,
            });
        }
        if peers.len() != usize::from(pp_size) {
            return Err(TrackerError::PeerCountMismatch {
                pp_size,
                peers: peers.len(),
            });
        }
        if self.in_flight.contains_key(&request) {
            return Err(TrackerError::AlreadyInFlight(request));
        }
        if self.finished.contains(&request) {
            return Err(TrackerError::AlreadyFinished(request));
        }
        let ranks = peers
            .iter()
            .map(|&peer| RankState {
                peer,
                count: 0,
                high: 0,
                seen: ChunkSet::default(),
            })
            .collect();
        self.in_flight.insert(
            request,
            InFlight {
                deadline,
                ranks,
                ranks_done: 0,
            },
        );
        self.deadlines.push(Reverse((deadline, request)));
        if let Some(early) = self.early.remove(&request) {
            self.early_total -= early.items.len();
            for (from, n) in early.items {
                // Errors are counted inside; a replayed notification is judged like a fresh one.
                let _ = self.handle_notification(now, from, &n);
            }
        }
        Ok(())
    }

    /// Handles one decoded chunk notification from `from`.
    ///
    /// # Errors
    /// [`NotifyError`]: the notification was dropped (wrong peer, rank out of range, buffer
    /// full, invalid early), or was a protocol violation that failed its request.
    pub fn handle_notification(
        &mut self,
        now: Instant,
        from: PeerId,
        n: &ChunkNotification,
    ) -> Result<Accepted, NotifyError> {
        self.counters.notifications += 1;
        let cap = self.cfg.max_chunks_per_rank;
        let Some(entry) = self.in_flight.get_mut(&n.request) else {
            let now = self.clock.observe(now);
            return self.not_in_flight(now, from, n);
        };
        match apply(entry, from, n, cap) {
            Step::Accept { new, done } => {
                if new {
                    self.counters.new_chunks += 1;
                } else {
                    self.counters.duplicates += 1;
                }
                if done {
                    self.finish(n.request, None);
                }
                Ok(if new {
                    Accepted::NewChunk
                } else {
                    Accepted::Duplicate
                })
            }
            Step::Fail(reason, ret) => {
                if matches!(reason, FailureReason::ProtocolViolation { .. }) {
                    self.counters.violations += 1;
                }
                self.finish(n.request, Some(reason));
                ret
            }
            Step::Reject(e) => {
                match e {
                    NotifyError::WrongPeer { .. } => self.counters.wrong_peer += 1,
                    NotifyError::RankOutOfRange { .. } => self.counters.rank_out_of_range += 1,
                    _ => {}
                }
                Err(e)
            }
        }
    }

    #[cold]
    fn not_in_flight(
        &mut self,
        now: Instant,
        from: PeerId,
        n: &ChunkNotification,
    ) -> Result<Accepted, NotifyError> {
        if self.finished.contains(&n.request) {
            self.counters.late += 1;
            return Ok(Accepted::Late);
        }
        self.counters.unknown += 1;
        if n.pp_rank >= self.cfg.max_pp_size {
            self.counters.rank_out_of_range += 1;
            return Err(NotifyError::EarlyRankOverLimit {
                request: n.request,
                rank: n.pp_rank,
            });
        }
        if let Some(kind) = static_violation(n, self.cfg.max_chunks_per_rank) {
            self.counters.invalid_early += 1;
            return Err(NotifyError::InvalidEarly {
                request: n.request,
                kind,
            });
        }
        if self.early_total >= self.cfg.early_buffer_cap {
            self.counters.buffer_overflow += 1;
            return Err(NotifyError::BufferFull { request: n.request });
        }
        let ttl = self.cfg.early_buffer_ttl;
        let e = self.early.entry(n.request).or_insert_with(|| {
            let expires = now.checked_add(ttl).unwrap_or(now);
            self.early_order.push_back((expires, n.request));
            Early {
                expires,
                items: Vec::new(),
            }
        });
        e.items.push((from, *n));
        self.early_total += 1;
        self.counters.buffered += 1;
        Ok(Accepted::Buffered)
    }

    /// Fails `request` with [`FailureReason::Aborted`].
    ///
    /// # Errors
    /// [`TrackerError::NotInFlight`] if it is not being tracked (nothing changes).
    pub fn abort(&mut self, request: RequestId) -> Result<(), TrackerError> {
        self.fail(request, FailureReason::Aborted)
    }

    /// Fails `request` with a reason of the engine's choosing (say, a transport error it saw).
    ///
    /// # Errors
    /// [`TrackerError::NotInFlight`] if it is not being tracked (nothing changes).
    pub fn fail(&mut self, request: RequestId, reason: FailureReason) -> Result<(), TrackerError> {
        if !self.in_flight.contains_key(&request) {
            return Err(TrackerError::NotInFlight(request));
        }
        self.finish(request, Some(reason));
        Ok(())
    }

    /// The engine lost `peer`: every in-flight request with a rank bound to it that had not
    /// delivered all of its chunks fails with [`FailureReason::PeerLost`] (naming its lowest such
    /// rank). A request whose ranks bound to `peer` had all delivered (their `LAST` and every chunk
    /// it counts) goes on: nothing of it was still to come from there. Returns how many failed.
    pub fn handle_peer_lost(&mut self, now: Instant, peer: PeerId) -> usize {
        self.handle_peer_lost_in(now, peer, |_| true)
    }

    /// [`handle_peer_lost`](Self::handle_peer_lost) for the requests `only` picks: the others are
    /// left as they are (an engine still checking some of `peer`'s notifications of them calls
    /// this again for each, once it has). Returns how many failed.
    pub fn handle_peer_lost_in(
        &mut self,
        now: Instant,
        peer: PeerId,
        only: impl Fn(RequestId) -> bool,
    ) -> usize {
        self.clock.observe(now);
        let mut hit: Vec<(RequestId, u16)> = self
            .in_flight
            .iter()
            .filter(|(id, _)| only(**id))
            .filter_map(|(id, e)| {
                e.ranks
                    .iter()
                    .position(|r| r.peer == peer && !rank_done(r))
                    .map(|r| (*id, r as u16))
            })
            .collect();
        // Map order depends on the hash; sort so event order is reproducible.
        hit.sort_unstable();
        for &(id, rank) in &hit {
            self.finish(id, Some(FailureReason::PeerLost { rank, peer }));
        }
        hit.len()
    }

    /// Fails every request whose deadline is at or before `now`, and drops early notifications
    /// that waited too long.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now = self.clock.observe(now);
        while let Some(&Reverse((at, id))) = self.deadlines.peek() {
            if at > now {
                break;
            }
            self.deadlines.pop();
            if self.in_flight.get(&id).is_some_and(|e| e.deadline == at) {
                self.counters.timeouts += 1;
                self.finish(id, Some(FailureReason::Timeout));
            }
        }
        while let Some(&(at, id)) = self.early_order.front() {
            if at > now {
                break;
            }
            self.early_order.pop_front();
            if self.early.get(&id).is_some_and(|e| e.expires == at)
                && let Some(e) = self.early.remove(&id)
            {
                self.early_total -= e.items.len();
                self.counters.buffer_expired += e.items.len() as u64;
            }
        }
    }

    /// When [`handle_timeout`](Self::handle_timeout) next has work, if ever.
    #[must_use]
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        // Drop entries of requests that finished, so the driver is not woken for nothing.
        while let Some(&Reverse((at, id))) = self.deadlines.peek() {
            if self.in_flight.get(&id).is_some_and(|e| e.deadline == at) {
                break;
            }
            self.deadlines.pop();
        }
        while let Some(&(at, id)) = self.early_order.front() {
            if self.early.get(&id).is_some_and(|e| e.expires == at) {
                break;
            }
            self.early_order.pop_front();
        }
        let a = self.deadlines.peek().map(|r| r.0.0);
        let b = self.early_order.front().map(|e| e.0);
        match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The next terminal event, oldest first.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<TrackerEvent> {
        self.events.pop_front()
    }

    /// Running totals.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Requests expected and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Notifications waiting for their request to be expected.
    pub fn early_buffered(&self) -> usize {
        self.early_total
    }

    /// Whether `request` is being tracked.
    pub fn is_in_flight(&self, request: RequestId) -> bool {
        self.in_flight.contains_key(&request)
    }

    /// Nothing in flight, nothing buffered, no event waiting: the state a driver returns to
    /// when all its requests are done. (The bounded memory of finished ids is not counted.)
    pub fn is_idle(&self) -> bool {
        self.in_flight.is_empty() && self.early_total == 0 && self.events.is_empty()
    }

    /// Drops everything known about `request`, without an event: in-flight state, early
    /// notifications and the memory that it finished (so the id may be expected again).
    /// Use [`abort`](Self::abort) instead to get the terminal event. Returns whether anything
    /// was dropped.
    pub fn forget(&mut self, request: RequestId) -> bool {
        let mut any = self.in_flight.remove(&request).is_some();
        if let Some(e) = self.early.remove(&request) {
            self.early_total -= e.items.len();
            any = true;
        }
        if self.finished.remove(&request) {
            self.finished_order.retain(|r| *r != request);
            any = true;
        }
        any
    }

    fn finish(&mut self, request: RequestId, failure: Option<FailureReason>) {
        if self.in_flight.remove(&request).is_none() {
            return;
        }
        self.events.push_back(match failure {
            None => {
                self.counters.completed += 1;
                TrackerEvent::Complete { request }
            }
            Some(reason) => {
                self.counters.failed += 1;
                TrackerEvent::Failed { request, reason }
            }
        });
        if self.cfg.finished_memory > 0 {
            if self.finished_order.len() >= self.cfg.finished_memory
                && let Some(old) = self.finished_order.pop_front()
            {
                self.finished.remove(&old);
            }
            self.finished.insert(request);
            self.finished_order.push_back(request);
        }
        // Finished requests leave stale heap entries behind; rebuild before they dominate.
        if self.deadlines.len() > 1024 && self.deadlines.len() > 4 * self.in_flight.len() {
            let live = &self.in_flight;
            self.deadlines
                .retain(|Reverse((at, id))| live.get(id).is_some_and(|e| e.deadline == *at));
        }
    }
}

/// Checks that do not need the request's state.
fn static_violation(n: &ChunkNotification, cap: u32) -> Option<ViolationKind> {
    if n.chunk_id >= cap {
        return Some(ViolationKind::ChunkIdOverCap {
            chunk_id: n.chunk_id,
            cap,
        });
    }
    if let ChunkStatus::Last { count } = n.status {
        if count > cap {
            return Some(ViolationKind::CountOverCap { count, cap });
        }
        if count <= n.chunk_id {
            return Some(ViolationKind::CountNotAboveChunk {
                chunk_id: n.chunk_id,
                count,
            });
        }
    }
    None
}

#[inline]
fn apply(e: &mut InFlight, from: PeerId, n: &ChunkNotification, cap: u32) -> Step {
    let pp_size = e.ranks.len() as u16;
    let rank = n.pp_rank;
    let Some(rs) = e.ranks.get_mut(usize::from(rank)) else {
        return Step::Reject(NotifyError::RankOutOfRange {
            request: n.request,
            rank,
            pp_size,
        });
    };
    if rs.peer != from {
        return Step::Reject(NotifyError::WrongPeer {
            request: n.request,
            rank,
            from,
            bound: rs.peer,
        });
    }
    let violation = |kind| {
        Step::Fail(
            FailureReason::ProtocolViolation { rank, kind },
            Err(NotifyError::Violation {
                request: n.request,
                rank,
                kind,
            }),
        )
    };
    if let ChunkStatus::Failed { code } = n.status {
        return Step::Fail(
            FailureReason::PeerFailed { rank, code },
            Ok(Accepted::RankFailed),
        );
    }
    if let Some(kind) = static_violation(n, cap) {
        return violation(kind);
    }
    // Taken before the count can change: a LAST that arrives after every chunk (repeating one,
    // or naming an earlier one) finishes the rank without adding a bit, so only the state before
    // the whole notification tells whether this one finished it.
    let was_done = rank_done(rs);
    let id = n.chunk_id;
    if let ChunkStatus::Last { count } = n.status {
        if rs.count == 0 {
            if rs.high > count {
                return violation(ViolationKind::ChunkBeyondCount {
                    chunk_id: rs.high - 1,
                    count,
                });
            }
            rs.count = count;
            rs.seen.grow_to(count);
        } else if rs.count != count {
            return violation(ViolationKind::CountChanged {
                first: rs.count,
                second: count,
            });
        }
    } else if rs.count != 0 && id >= rs.count {
        return violation(ViolationKind::ChunkBeyondCount {
            chunk_id: id,
            count: rs.count,
        });
    }
    if id >= rs.seen.bound() {
        // Doubling keeps growth amortised; the cap bounds it.
        let want = rs.seen.bound().saturating_mul(2).max(128);
        rs.seen.grow_to(want.min(cap).max(id + 1));
    }
    let dup = !rs.seen.insert(id);
    if !dup {
        rs.high = rs.high.max(id + 1);
    }
    let mut done = false;
    if rank_done(rs) && !was_done {
        e.ranks_done += 1;
        done = e.ranks_done == pp_size;
    }
    Step::Accept { new: !dup, done }
}

/// Every chunk below a known count is present. `seen` holds distinct ids, all below the count
/// (a larger one is a violation whether it comes before the count or after), so as many ids as
/// the count means all of `0..count`.
fn rank_done(rs: &RankState) -> bool {
    rs.count != 0 && rs.seen.count() == rs.count
}
