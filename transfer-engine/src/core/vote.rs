//! The prefill side's vote board: cross-PP-rank agreement on each request's outcome.
//!
//! Every PP rank runs one board. When a rank's own transfer of a request reaches a terminal
//! state, the engine calls [`VoteBoard::handle_local_vote`] *from that completion path*; the
//! board queues the vote for every peer ([`VoteBoard::poll_transmit`]) and the driver sends it on
//! the ordered control connection. Nothing waits on a peer's scheduler: a rank that is busy in a
//! forward pass delays only its own vote, never another rank's progress. (Waiting on peer
//! schedulers is the design that once halved throughput.)
//!
//! # Rules
//! - Each rank casts one immutable vote per request: [`Vote::Completed`] or [`Vote::Failed`].
//!   Repeating the same vote is a no-op; a different one is [`VoteError::Conflict`], counted,
//!   and the first vote stands.
//! - A request is **decided** once every rank is terminal. It is [`Decision::Completed`] iff
//!   every rank voted `Completed`; otherwise [`Decision::Failed`] naming the lowest rank that did
//!   not. Failure wins, but only once all ranks are terminal; each decision is emitted exactly
//!   once by [`VoteBoard::poll_decision`]. Boards that saw the same votes decide the same thing.
//! - The request's pages stay owned by the engine until its decision is polled: a rank that
//!   voted `Completed` may still be asked to fail, and one that voted `Failed` must not free pages
//!   a peer's decision could still depend on.
//! - A rank that will never vote becomes terminal as a failure: when the engine reports it lost
//!   ([`VoteBoard::handle_peer_lost`]), when it closed without voting, or when the request's
//!   deadline passes ([`VoteConfig::vote_timeout`], [`VoteBoard::set_deadline`]). These are
//!   local judgements, so boards on either side of a crash may decide a request differently;
//!   each still decides it once, and none decides `Completed` unless every rank's `Completed`
//!   vote reached it.
//! - The local vote is never replaced by a timeout: it is the statement that this rank's own
//!   writes are finished, and pages must not be released while they may still be read. The
//!   engine's own transfer timeout turns a stuck local transfer into a local `Failed` vote.
//! - [`VoteBoard::close`] queues a `Close` to each peer after every vote queued before it (the
//!   transport is ordered per peer, so a peer that receives `Close` has all our votes). After
//!   a peer's `Close`, anything more from it is [`VoteError::AfterClose`], and its missing votes
//!   count as failures. [`VoteBoard::shutdown`] bounds the wait and reports what was left.
//!
//! # Output order
//! Drain [`VoteBoard::poll_transmit`] after every `handle_*` call and before sleeping; drain
//! [`VoteBoard::poll_decision`] likewise. Decisions come out in the order they were made.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use foldhash::fast::FixedState;

use crate::core::{Clock, FailureCode, RequestId};

/// One rank's terminal statement about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Vote {
    /// This rank's transfer of the request completed.
    Completed,
    /// It failed.
    Failed(FailureCode),
}

/// Why a decision is `Failed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailCause {
    /// The rank voted `Failed` with this code.
    Voted(FailureCode),
    /// The engine reported the rank lost before it voted.
    PeerLost,
    /// The request's deadline passed before the rank voted.
    Timeout,
    /// The rank closed its side without voting.
    ClosedWithoutVote,
}

/// The outcome of a request, the same on every board that saw the same votes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// Every rank voted `Completed`.
    Completed,
    /// At least one rank did not.
    Failed {
        /// The lowest rank that did not vote `Completed`.
        rank: u16,
        /// What that rank's terminal state was.
        cause: FailCause,
    },
}

/// A message between boards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VoteMessage {
    /// `from_rank`'s vote on `request`.
    Vote {
        /// Sender.
        from_rank: u16,
        /// The request.
        request: RequestId,
        /// The vote.
        vote: Vote,
    },
    /// `from_rank` will send nothing more.
    Close {
        /// Sender.
        from_rank: u16,
    },
}

/// Length of an encoded [`VoteMessage`].
pub const VOTE_RECORD_LEN: usize = 24;
/// First four bytes of a vote record, little-endian: `C7 4B 56 56` (`\xC7KVV`).
pub const VOTE_MAGIC: u32 = u32::from_le_bytes([0xC7, b'K', b'V', b'V']);
/// The vote record version this code speaks.
pub const VOTE_VERSION: u8 = 1;

const KIND_VOTE: u8 = 1;
const KIND_CLOSE: u8 = 2;
const VOTE_COMPLETED: u8 = 1;
const VOTE_FAILED: u8 = 2;

/// Why bytes are not a valid vote record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VoteDecodeError {
    /// Not [`VOTE_RECORD_LEN`] bytes.
    #[error("vote record is {len} bytes, expected {VOTE_RECORD_LEN}")]
    BadLength {
        /// Bytes received.
        len: usize,
    },
    /// Not [`VOTE_MAGIC`].
    #[error("bad vote magic {found:#010x}")]
    BadMagic {
        /// Found.
        found: u32,
    },
    /// Not [`VOTE_VERSION`].
    #[error("unsupported vote version {found}")]
    BadVersion {
        /// Found.
        found: u8,
    },
    /// Message kind not 1 (vote) or 2 (close).
    #[error("unknown vote message kind {found}")]
    UnknownKind {
        /// Found.
        found: u8,
    },
    /// Vote byte not 1 (completed) or 2 (failed).
    #[error("unknown vote value {found}")]
    UnknownVote {
        /// Found.
        found: u8,
    },
    /// A failure code on a `Completed` vote.
    #[error("failure code {code} on a Completed vote")]
    CodeWithoutFailure {
        /// Found.
        code: u16,
    },
    /// A close record with a non-zero request, vote or code.
    #[error("close record carries a payload")]
    CloseWithPayload,
    /// A reserved byte is not zero.
    #[error("reserved bytes are not zero")]
    ReservedNonZero,
}

impl VoteMessage {
    /// The sender's rank.
    pub const fn from_rank(&self) -> u16 {
        match *self {
            Self::Vote { from_rank, .. } | Self::Close { from_rank } => from_rank,
        }
    }

    /// The fixed 24-byte little-endian record (layout in `docs/wire-format.md`).
    pub fn encode(&self) -> [u8; VOTE_RECORD_LEN] {
        let mut b = [0u8; VOTE_RECORD_LEN];
        b[0..4].copy_from_slice(&VOTE_MAGIC.to_le_bytes());
        b[4] = VOTE_VERSION;
        b[6..8].copy_from_slice(&self.from_rank().to_le_bytes());
        match *self {
            Self::Vote { request, vote, .. } => {
                b[5] = KIND_VOTE;
                b[8..16].copy_from_slice(&request.0.to_le_bytes());
                let (v, code) = match vote {
                    Vote::Completed => (VOTE_COMPLETED, 0),
                    Vote::Failed(c) => (VOTE_FAILED, c.raw()),
                };
                b[16] = v;
                b[18..20].copy_from_slice(&code.to_le_bytes());
            }
            Self::Close { .. } => b[5] = KIND_CLOSE,
        }
        b
    }

    /// Parses a record.
    ///
    /// # Errors
    /// [`VoteDecodeError`] for any field out of its rules. Never panics.
    pub fn decode(bytes: &[u8]) -> Result<Self, VoteDecodeError> {
        let b: &[u8; VOTE_RECORD_LEN] = bytes
            .try_into()
            .map_err(|_| VoteDecodeError::BadLength { len: bytes.len() })?;
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != VOTE_MAGIC {
            return Err(VoteDecodeError::BadMagic { found: magic });
        }
        if b[4] != VOTE_VERSION {
            return Err(VoteDecodeError::BadVersion { found: b[4] });
        }
        if b[17] != 0 || b[20..24] != [0; 4] {
            return Err(VoteDecodeError::ReservedNonZero);
        }
        let from_rank = u16::from_le_bytes([b[6], b[7]]);
        let request = u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
        let code = u16::from_le_bytes([b[18], b[19]]);
        match b[5] {
            KIND_VOTE => {
                let vote = match b[16] {
                    VOTE_COMPLETED if code != 0 => {
                        return Err(VoteDecodeError::CodeWithoutFailure { code });
                    }
                    VOTE_COMPLETED => Vote::Completed,
                    VOTE_FAILED => Vote::Failed(FailureCode::from_raw(code)),
                    found => return Err(VoteDecodeError::UnknownVote { found }),
                };
                Ok(Self::Vote {
                    from_rank,
                    request: RequestId(request),
                    vote,
                })
            }
            KIND_CLOSE if request != 0 || b[16] != 0 || code != 0 => {
                Err(VoteDecodeError::CloseWithPayload)
            }
            KIND_CLOSE => Ok(Self::Close { from_rank }),
            found => Err(VoteDecodeError::UnknownKind { found }),
        }
    }
}

/// Settings of one rank's board.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct VoteConfig {
    /// Number of PP ranks voting.
    pub pp_size: u16,
    /// This board's rank.
    pub my_rank: u16,
    /// Deadline for peers' votes, counted from when the board first hears of a request. `None`:
    /// only [`VoteBoard::set_deadline`], peer loss or close end the wait.
    pub vote_timeout: Option<Duration>,
    /// Undecided requests that peers alone may create; beyond it a peer's vote for a request
    /// this board has not heard of is refused ([`VoteError::TooManyUndecided`]). Local votes are
    /// always taken.
    pub max_undecided: usize,
    /// Decided requests remembered, to classify late votes and repeated local votes.
    pub decided_memory: usize,
    /// Seed of the request-id hash.
    pub hash_seed: u64,
}

impl VoteConfig {
    /// Defaults for rank `my_rank` of `pp_size`: 30 s vote timeout, 1<<16 undecided and decided.
    pub fn new(pp_size: u16, my_rank: u16) -> Self {
        Self {
            pp_size,
            my_rank,
            vote_timeout: Some(Duration::from_secs(30)),
            max_undecided: 1 << 16,
            decided_memory: 1 << 16,
            hash_seed: 0x0b0a_4d5e_ed00,
        }
    }
}

/// Misuse or a peer's protocol error. Every error leaves the board's decisions as they were.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VoteError {
    /// The configuration has `my_rank >= pp_size` or `pp_size == 0`.
    #[error("rank {my_rank} is not within pp_size {pp_size}")]
    BadConfig {
        /// Configured PP size.
        pp_size: u16,
        /// Configured rank.
        my_rank: u16,
    },
    /// A rank outside `0..pp_size`.
    #[error("rank {rank} out of pp_size {pp_size}")]
    UnknownRank {
        /// Rank.
        rank: u16,
        /// PP size.
        pp_size: u16,
    },
    /// A peer operation naming this board's own rank.
    #[error("rank {0} is this board's own rank")]
    OwnRank(u16),
    /// The record's sender rank is not the connection's.
    #[error("message claims rank {claimed} but came from rank {from}")]
    RankMismatch {
        /// In the message.
        claimed: u16,
        /// The connection's rank.
        from: u16,
    },
    /// A second, different vote; the first stands.
    #[error("request {request:?}: rank {rank} voted {first:?}, then {second:?}")]
    Conflict {
        /// The request.
        request: RequestId,
        /// The rank.
        rank: u16,
        /// The vote that stands.
        first: Vote,
        /// The refused one.
        second: Vote,
    },
    /// A message from a rank after its `Close`.
    #[error("message from rank {rank} after its Close")]
    AfterClose {
        /// The rank.
        rank: u16,
    },
    /// A message from a rank reported lost.
    #[error("message from rank {rank}, which was reported lost")]
    FromLostPeer {
        /// The rank.
        rank: u16,
    },
    /// A local vote after [`VoteBoard::close`].
    #[error("local vote after close")]
    Closed,
    /// A peer's vote would create one undecided request too many.
    #[error("request {request:?}: too many undecided requests")]
    TooManyUndecided {
        /// The request.
        request: RequestId,
    },
}

/// What [`VoteBoard::shutdown`] ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Every peer closed (or was lost) and every request was decided before the deadline.
    pub clean: bool,
    /// Requests left undecided, each with the ranks (possibly including this one) whose vote
    /// never arrived. Sorted by request id.
    pub undecided: Vec<(RequestId, Vec<u16>)>,
    /// Peers that neither closed nor were reported lost.
    pub ranks_not_closed: Vec<u16>,
}

/// Running totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VoteCounters {
    /// Messages queued for peers.
    pub queued: u64,
    /// Peer messages handled (accepted or not).
    pub received: u64,
    /// Repeated identical votes.
    pub duplicates: u64,
    /// Conflicting votes refused.
    pub conflicts: u64,
    /// Peer votes for requests already decided.
    pub late: u64,
    /// Peer votes that arrived after the rank had timed out on that request (ignored).
    pub after_timeout: u64,
    /// Messages refused for any other reason.
    pub rejected: u64,
    /// Requests decided `Completed`.
    pub completed: u64,
    /// Requests decided `Failed`.
    pub failed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Pending,
    Voted(Vote),
    Lost,
    TimedOut,
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerState {
    Open,
    Closed,
    Lost,
}

struct Pending {
    slots: Box<[Slot]>,
    terminal: u16,
    deadline: Option<Instant>,
    /// Created by a peer's vote and not yet confirmed by a local one; counts against
    /// `max_undecided`.
    by_peer: bool,
}

type Map<K, V> = HashMap<K, V, FixedState>;

/// One rank's vote board. See the [module docs](self) for its rules.
pub struct VoteBoard {
    cfg: VoteConfig,
    clock: Clock,
    undecided: Map<RequestId, Pending>,
    peer_created: usize,
    deadlines: BinaryHeap<Reverse<(Instant, RequestId)>>,
    /// Decided request -> this rank's vote, to judge a repeated local vote.
    decided: Map<RequestId, Option<Vote>>,
    decided_order: VecDeque<RequestId>,
    transmit: VecDeque<(u16, VoteMessage)>,
    decisions: VecDeque<(RequestId, Decision)>,
    /// Requests a peer's vote created whose deadline passed with no local vote
    /// ([`poll_expired_unvoted`](VoteBoard::poll_expired_unvoted)).
    expired_unvoted: VecDeque<RequestId>,
    peers: Vec<PeerState>,
    closed: bool,
    shutdown_at: Option<Instant>,
    report: Option<ShutdownReport>,
    reported: bool,
    counters: VoteCounters,
}

impl std::fmt::Debug for VoteBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VoteBoard")
            .field("rank", &self.cfg.my_rank)
            .field("pp_size", &self.cfg.pp_size)
            .field("undecided", &self.undecided.len())
            .field("closed", &self.closed)
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl VoteBoard {
    /// A board with nothing undecided.
    ///
    /// # Errors
    /// [`VoteError::BadConfig`] when `my_rank >= pp_size`.
    pub fn new(cfg: VoteConfig) -> Result<Self, VoteError> {
        if cfg.my_rank >= cfg.pp_size {
            return Err(VoteError::BadConfig {
                pp_size: cfg.pp_size,
                my_rank: cfg.my_rank,
            });
        }
        let seed = cfg.hash_seed;
        let mut peers = vec![PeerState::Open; usize::from(cfg.pp_size)];
        // Our own entry never changes; marking it closed keeps "all peers closed" a plain scan.
        peers[usize::from(cfg.my_rank)] = PeerState::Closed;
        Ok(Self {
            clock: Clock::new(),
            undecided: HashMap::with_hasher(FixedState::with_seed(seed)),
            peer_created: 0,
            deadlines: BinaryHeap::new(),
            decided: HashMap::with_hasher(FixedState::with_seed(seed ^ 1)),
            decided_order: VecDeque::new(),
            transmit: VecDeque::new(),
            decisions: VecDeque::new(),
            expired_unvoted: VecDeque::new(),
            peers,
            closed: false,
            shutdown_at: None,
            report: None,
            reported: false,
            counters: VoteCounters::default(),
            cfg,
        })
    }

    /// This rank's own terminal vote on `request`, from its transfer-completion path. Queues the
    /// vote for every peer not reported lost, and may decide the request.
    ///
    /// # Errors
    /// [`VoteError::Conflict`] for a second, different local vote (the first stands);
    /// [`VoteError::Closed`] after [`close`](Self::close).
    pub fn handle_local_vote(
        &mut self,
        now: Instant,
        request: RequestId,
        vote: Vote,
    ) -> Result<(), VoteError> {
        let now = self.clock.observe(now);
        let me = self.cfg.my_rank;
        if let Some(prev) = self.decided.get(&request) {
            return match *prev {
                Some(v) if v == vote => {
                    self.counters.duplicates += 1;
                    Ok(())
                }
                Some(first) => {
                    self.counters.conflicts += 1;
                    Err(VoteError::Conflict {
                        request,
                        rank: me,
                        first,
                        second: vote,
                    })
                }
                // Decided without our vote cannot happen: a decision needs the local vote.
                None => Ok(()),
            };
        }
        // After close only a repeat of a vote already cast is answered (as a no-op or conflict).
        let already = self
            .undecided
            .get(&request)
            .is_some_and(|p| matches!(p.slots[usize::from(me)], Slot::Voted(_)));
        if self.closed && !already {
            return Err(VoteError::Closed);
        }
        let p = self.entry(now, request);
        let confirm = std::mem::replace(&mut p.by_peer, false);
        match p.slots[usize::from(me)] {
            Slot::Voted(v) if v == vote => {
                self.counters.duplicates += 1;
                return Ok(());
            }
            Slot::Voted(first) => {
                self.counters.conflicts += 1;
                return Err(VoteError::Conflict {
                    request,
                    rank: me,
                    first,
                    second: vote,
                });
            }
            _ => {}
        }
        p.slots[usize::from(me)] = Slot::Voted(vote);
        p.terminal += 1;
        if confirm {
            self.peer_created -= 1;
        }
        for (rank, st) in self.peers.iter().enumerate() {
            if rank != usize::from(me) && *st != PeerState::Lost {
                self.transmit.push_back((
                    rank as u16,
                    VoteMessage::Vote {
                        from_rank: me,
                        request,
                        vote,
                    },
                ));
                self.counters.queued += 1;
            }
        }
        self.try_decide(request);
        self.check_shutdown();
        Ok(())
    }

    /// A message from the peer at `from_rank` (the rank the connection was bound to).
    ///
    /// # Errors
    /// [`VoteError`] for a rank out of range, a sender mismatch, a conflicting vote, a message
    /// after the peer's `Close` or loss, or too many undecided requests. The first vote always
    /// stands and no error changes a decision.
    pub fn handle_peer_message(
        &mut self,
        now: Instant,
        from_rank: u16,
        msg: &VoteMessage,
    ) -> Result<(), VoteError> {
        let now = self.clock.observe(now);
        self.counters.received += 1;
        let r = self.check_peer(from_rank, msg);
        if r.is_err() {
            self.counters.rejected += 1;
        }
        r?;
        match *msg {
            VoteMessage::Close { .. } => {
                self.peers[usize::from(from_rank)] = PeerState::Closed;
                self.mark_missing(from_rank, Slot::Closed);
            }
            VoteMessage::Vote { request, vote, .. } => {
                if self.decided.contains_key(&request) {
                    self.counters.late += 1;
                    return Ok(());
                }
                if !self.undecided.contains_key(&request)
                    && self.peer_created >= self.cfg.max_undecided
                {
                    self.counters.rejected += 1;
                    return Err(VoteError::TooManyUndecided { request });
                }
                let existed = self.undecided.contains_key(&request);
                let p = self.entry(now, request);
                if !existed {
                    p.by_peer = true;
                }
                let slot = &mut p.slots[usize::from(from_rank)];
                match *slot {
                    Slot::Pending => {
                        *slot = Slot::Voted(vote);
                        p.terminal += 1;
                    }
                    Slot::Voted(v) if v == vote => self.counters.duplicates += 1,
                    Slot::Voted(first) => {
                        self.counters.conflicts += 1;
                        return Err(VoteError::Conflict {
                            request,
                            rank: from_rank,
                            first,
                            second: vote,
                        });
                    }
                    Slot::TimedOut | Slot::Lost | Slot::Closed => self.counters.after_timeout += 1,
                }
                if !existed {
                    self.peer_created += 1;
                }
                self.try_decide(request);
            }
        }
        self.check_shutdown();
        Ok(())
    }

    fn check_peer(&self, from_rank: u16, msg: &VoteMessage) -> Result<(), VoteError> {
        if from_rank >= self.cfg.pp_size {
            return Err(VoteError::UnknownRank {
                rank: from_rank,
                pp_size: self.cfg.pp_size,
            });
        }
        if from_rank == self.cfg.my_rank {
            return Err(VoteError::OwnRank(from_rank));
        }
        if msg.from_rank() != from_rank {
            return Err(VoteError::RankMismatch {
                claimed: msg.from_rank(),
                from: from_rank,
            });
        }
        match self.peers[usize::from(from_rank)] {
            PeerState::Open => Ok(()),
            PeerState::Closed => Err(VoteError::AfterClose { rank: from_rank }),
            PeerState::Lost => Err(VoteError::FromLostPeer { rank: from_rank }),
        }
    }

    /// `rank` is a peer of this board: below the PP size and not this rank.
    fn check_other_rank(&self, rank: u16) -> Result<(), VoteError> {
        if rank >= self.cfg.pp_size {
            return Err(VoteError::UnknownRank {
                rank,
                pp_size: self.cfg.pp_size,
            });
        }
        if rank == self.cfg.my_rank {
            return Err(VoteError::OwnRank(rank));
        }
        Ok(())
    }

    /// The engine lost the peer at `rank` (its connection or process died). Its missing votes
    /// become terminal failures ([`FailCause::PeerLost`]), which may decide requests; nothing more
    /// is queued for it. Repeating the call is a no-op.
    ///
    /// # Errors
    /// [`VoteError::UnknownRank`] or [`VoteError::OwnRank`].
    pub fn handle_peer_lost(&mut self, now: Instant, rank: u16) -> Result<(), VoteError> {
        self.clock.observe(now);
        self.check_other_rank(rank)?;
        if self.peers[usize::from(rank)] != PeerState::Lost {
            self.peers[usize::from(rank)] = PeerState::Lost;
            self.transmit.retain(|(to, _)| *to != rank);
            self.mark_missing(rank, Slot::Lost);
        }
        self.check_shutdown();
        Ok(())
    }

    /// A new start of the peer at `rank` connected after its loss or `Close` (the engine admitted
    /// its new incarnation). Requests the board already holds keep that rank's slot as it is (an
    /// old start's missing vote stays a failure, and nothing it sent counts again); requests the
    /// board learns of from now on wait for the new start's vote. A no-op for a peer that is open.
    ///
    /// # Errors
    /// [`VoteError::UnknownRank`], [`VoteError::OwnRank`], or [`VoteError::Closed`] after
    /// [`close`](Self::close) (a closing board takes no new peers).
    pub fn handle_peer_joined(&mut self, now: Instant, rank: u16) -> Result<(), VoteError> {
        self.clock.observe(now);
        self.check_other_rank(rank)?;
        if self.closed {
            return Err(VoteError::Closed);
        }
        self.peers[usize::from(rank)] = PeerState::Open;
        Ok(())
    }

    /// Sets (or moves) the deadline for peers' votes on `request`, registering it if the board
    /// has not heard of it. Ignored for a request already decided.
    pub fn set_deadline(&mut self, now: Instant, request: RequestId, deadline: Instant) {
        let now = self.clock.observe(now);
        if self.decided.contains_key(&request) {
            return;
        }
        let p = self.entry(now, request);
        p.deadline = Some(deadline);
        self.deadlines.push(Reverse((deadline, request)));
    }

    /// Marks votes still missing at their request's deadline as [`FailCause::Timeout`], and
    /// ends a [`shutdown`](Self::shutdown) whose deadline passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now = self.clock.observe(now);
        let me = usize::from(self.cfg.my_rank);
        while let Some(&Reverse((at, id))) = self.deadlines.peek() {
            if at > now {
                break;
            }
            self.deadlines.pop();
            let Some(p) = self.undecided.get_mut(&id) else {
                continue;
            };
            if p.deadline != Some(at) {
                continue;
            }
            p.deadline = None;
            for (rank, s) in p.slots.iter_mut().enumerate() {
                if rank != me && *s == Slot::Pending {
                    *s = Slot::TimedOut;
                    p.terminal += 1;
                }
            }
            if p.by_peer {
                self.expired_unvoted.push_back(id);
            }
            self.try_decide(id);
        }
        if let Some(at) = self.shutdown_at
            && at <= now
            && !self.reported
        {
            self.finish_shutdown(false);
        }
        self.check_shutdown();
    }

    /// When [`handle_timeout`](Self::handle_timeout) next has work, if ever.
    #[must_use]
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        while let Some(&Reverse((at, id))) = self.deadlines.peek() {
            if self
                .undecided
                .get(&id)
                .is_some_and(|p| p.deadline == Some(at))
            {
                break;
            }
            self.deadlines.pop();
        }
        let a = self.deadlines.peek().map(|r| r.0.0);
        let b = self.shutdown_at.filter(|_| !self.reported);
        match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The next message to send: `(peer rank, message)`, in the order queued. Per peer, the
    /// driver must send them in this order on an ordered connection.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<(u16, VoteMessage)> {
        self.transmit.pop_front()
    }

    /// The next request a peer's vote created whose deadline passed while this rank had not voted:
    /// the board cannot decide it without the local vote, so the driver votes (failed, where it
    /// does not hold the request: it never will now) or it stays undecided for good. Each such
    /// deadline once, and only while the request is still undecided and unvoted here.
    #[must_use]
    pub fn poll_expired_unvoted(&mut self) -> Option<RequestId> {
        while let Some(id) = self.expired_unvoted.pop_front() {
            if self.undecided.get(&id).is_some_and(|p| p.by_peer) {
                return Some(id);
            }
        }
        None
    }

    /// The next decision, each request exactly once. Release the request's pages after this.
    #[must_use]
    pub fn poll_decision(&mut self) -> Option<(RequestId, Decision)> {
        self.decisions.pop_front()
    }

    /// Queues `Close` for every peer not lost, after everything queued before. Local votes are
    /// refused afterwards. Repeating the call is a no-op.
    pub fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let me = self.cfg.my_rank;
        for (rank, st) in self.peers.iter().enumerate() {
            if rank != usize::from(me) && *st != PeerState::Lost {
                self.transmit
                    .push_back((rank as u16, VoteMessage::Close { from_rank: me }));
                self.counters.queued += 1;
            }
        }
    }

    /// Starts a bounded shutdown: [`close`](Self::close), then wait until every peer closed or
    /// was lost and every request is decided, or until `deadline`. The outcome comes out of
    /// [`poll_shutdown`](Self::poll_shutdown) once.
    pub fn shutdown(&mut self, now: Instant, deadline: Instant) {
        self.clock.observe(now);
        self.close();
        if self.shutdown_at.is_none() {
            self.shutdown_at = Some(deadline);
        }
        self.check_shutdown();
    }

    /// The shutdown report, once, when shutdown finished (cleanly or by its deadline).
    #[must_use]
    pub fn poll_shutdown(&mut self) -> Option<ShutdownReport> {
        self.report.take()
    }

    /// Requests heard of and not yet decided.
    pub fn undecided(&self) -> usize {
        self.undecided.len()
    }

    /// Whether `request` is heard of and not yet decided.
    pub fn is_undecided(&self, request: RequestId) -> bool {
        self.undecided.contains_key(&request)
    }

    /// Running totals.
    pub fn counters(&self) -> VoteCounters {
        self.counters
    }

    /// This board's rank.
    pub fn rank(&self) -> u16 {
        self.cfg.my_rank
    }

    fn entry(&mut self, now: Instant, request: RequestId) -> &mut Pending {
        let n = usize::from(self.cfg.pp_size);
        let timeout = self.cfg.vote_timeout;
        let peers = &self.peers;
        let me = usize::from(self.cfg.my_rank);
        let deadlines = &mut self.deadlines;
        self.undecided.entry(request).or_insert_with(|| {
            let deadline = timeout.and_then(|t| now.checked_add(t));
            if let Some(d) = deadline {
                deadlines.push(Reverse((d, request)));
            }
            // A rank already lost or closed will never vote: start it terminal.
            let mut terminal = 0;
            let slots = (0..n)
                .map(|r| match peers[r] {
                    PeerState::Lost => {
                        terminal += 1;
                        Slot::Lost
                    }
                    PeerState::Closed if r != me => {
                        terminal += 1;
                        Slot::Closed
                    }
                    _ => Slot::Pending,
                })
                .collect();
            Pending {
                slots,
                terminal,
                deadline,
                by_peer: false,
            }
        })
    }

    fn mark_missing(&mut self, rank: u16, as_: Slot) {
        let mut hit = Vec::new();
        for (id, p) in self.undecided.iter_mut() {
            let s = &mut p.slots[usize::from(rank)];
            if *s == Slot::Pending {
                *s = as_;
                p.terminal += 1;
                hit.push(*id);
            }
        }
        // Map order depends on the hash; sort so decision order is reproducible.
        hit.sort_unstable();
        for id in hit {
            self.try_decide(id);
        }
    }

    fn try_decide(&mut self, request: RequestId) {
        let Some(p) = self.undecided.get(&request) else {
            return;
        };
        if usize::from(p.terminal) < p.slots.len() {
            return;
        }
        let mut decision = Decision::Completed;
        for (rank, s) in p.slots.iter().enumerate() {
            let cause = match *s {
                Slot::Voted(Vote::Completed) => continue,
                Slot::Voted(Vote::Failed(c)) => FailCause::Voted(c),
                Slot::Lost => FailCause::PeerLost,
                Slot::TimedOut => FailCause::Timeout,
                Slot::Closed => FailCause::ClosedWithoutVote,
                // Unreachable while `terminal` counts correctly; staying undecided is the safe
                // answer if it ever does not.
                Slot::Pending => return,
            };
            decision = Decision::Failed {
                rank: rank as u16,
                cause,
            };
            break;
        }
        let local = match p.slots[usize::from(self.cfg.my_rank)] {
            Slot::Voted(v) => Some(v),
            _ => None,
        };
        if self.undecided.remove(&request).is_some_and(|p| p.by_peer) {
            self.peer_created -= 1;
        }
        // Decided requests leave stale heap entries behind; rebuild before they dominate.
        if self.deadlines.len() > 1024 && self.deadlines.len() > 4 * self.undecided.len() {
            let live = &self.undecided;
            self.deadlines
                .retain(|Reverse((at, id))| live.get(id).is_some_and(|p| p.deadline == Some(*at)));
        }
        match decision {
            Decision::Completed => self.counters.completed += 1,
            Decision::Failed { .. } => self.counters.failed += 1,
        }
        self.decisions.push_back((request, decision));
        if self.cfg.decided_memory > 0 {
            if self.decided_order.len() >= self.cfg.decided_memory
                && let Some(old) = self.decided_order.pop_front()
            {
                self.decided.remove(&old);
            }
            self.decided.insert(request, local);
            self.decided_order.push_back(request);
        }
    }

    fn check_shutdown(&mut self) {
        if self.shutdown_at.is_none() || self.reported {
            return;
        }
        let all_closed = self.peers.iter().all(|s| *s != PeerState::Open);
        if all_closed && self.undecided.is_empty() {
            self.finish_shutdown(true);
        }
    }

    fn finish_shutdown(&mut self, clean: bool) {
        let mut undecided: Vec<(RequestId, Vec<u16>)> = self
            .undecided
            .iter()
            .map(|(id, p)| {
                let missing = p
                    .slots
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| **s == Slot::Pending)
                    .map(|(r, _)| r as u16)
                    .collect();
                (*id, missing)
            })
            .collect();
        undecided.sort_unstable();
        let ranks_not_closed = self
            .peers
            .iter()
            .enumerate()
            .filter(|(_, s)| **s == PeerState::Open)
            .map(|(r, _)| r as u16)
            .collect();
        self.reported = true;
        self.report = Some(ShutdownReport {
            clean,
            undecided,
            ranks_not_closed,
        });
    }
}
