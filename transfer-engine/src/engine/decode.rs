//! The decode side: registers the KV pool once, serves any number of prefill instances (each a
//! PP pipeline: one connection per rank) on one transport and one listener, hands each request's
//! destination pages to every rank of the instance it comes from, and turns their notifications
//! into one outcome per request through the [`CompletionTracker`].
//!
//! Each instance is a session of its own: its ranks, their starts, the requests that wait for an
//! absent rank and its absences. One instance's ranks can neither complete, fail nor confirm
//! another instance's requests, and its loss fails only its own.
//!
//! Notifications are handled on the transport's progress thread, straight into the tracker (one short
//! lock per notification, no hop through another thread), so a request's completion is seen as soon as
//! its last notification is. The exceptions are chunks that need a pass over their bytes: a chunk in
//! landing memory (copied into the pages) and a chunk whose checksum is verified (hashed from the
//! pages). Those chunks, and their request's notifications behind them, go through a chunk worker
//! ([`super::landing`]), which copies and hashes without the lock and then hands each notification to
//! the tracker in the order it came.

use super::aux::AuxStore;
use super::landing::{Gate, Workers, landing_pieces};
use super::{
    EngineError, Outbox, Outcome, Pool, TpConfig, layout_from_info, layout_info, to_wire_kind,
    wire_regions,
};
use crate::control::{
    self, BackendInfo, Connection, Hello, Listener, Msg, RejectReason, Role, TransferRequest,
};
use crate::core::chunkset::ChunkSet;
use crate::core::membership::Incarnations;
use crate::core::notify::{self, Notification};
use crate::core::planner::{ChunkGeometry, KvLayout, Planner, TpMapping, Write};
use crate::core::tracker::{
    CompletionTracker, FailureReason, TrackerConfig, TrackerEvent, ViolationKind,
};
use crate::core::{ChunkHasher, FailureCode, PeerId, RequestId};
use crate::engine::BackendConfig;
use crate::mem::MemKind;
use crate::transport::{Incoming, Sender, Sink, Transport};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, oneshot, watch};

/// Settings of a [`DecodeEngine`].
#[derive(Debug, Clone)]
pub struct DecodeConfig {
    /// Name in handshakes and logs.
    pub engine_id: String,
    /// Control-plane address to listen on (port 0 picks one; see [`DecodeEngine::local_addr`]).
    pub listen: SocketAddr,
    /// The backend.
    pub backend: BackendConfig,
    /// The model's total layer count.
    pub total_layers: u32,
    /// Tokens per page.
    pub page_tokens: u32,
    /// The pool's layout (all layers).
    pub layout: KvLayout,
    /// PP size of the default prefill instance (named `""`, which [`DecodeEngine::expect`] and
    /// the other methods without an instance use): a request is complete when this many ranks
    /// delivered. 0 starts the engine without it; instances are added with
    /// [`DecodeEngine::add_instance`].
    pub pp_size: u16,
    /// This decode rank's TP rank and size and how TP maps ([`TpConfig`]).
    pub tp: TpConfig,
    /// This decode's own PP stage: 0 of 1 (the default) holds every layer and takes every rank of
    /// each prefill pipeline; stage `r` of `s` holds its layers only (`layout`) and takes only
    /// prefill PP rank `r`, of pipelines of `s` ranks (see [`DecodeStage`]).
    pub stage: DecodeStage,
    /// The default instance's TP size; `None`: the same as this side's.
    pub prefill_tp: Option<u16>,
    /// The decode instance (server) this TP rank belongs to, carried in its Hello: every TP rank
    /// of one decode server names the same one, so a prefill rank that writes into several of
    /// them (prefill TP smaller than decode's) serves their allocations of one request as one
    /// request, from its one engine. Empty: none (such a prefill rank refuses the second
    /// allocation of a request id).
    pub instance: String,
    /// What this side's application tells every authenticated peer in its Hello (at most
    /// [`MAX_APP_INFO`](crate::control::MAX_APP_INFO) bytes), opaque to the engine; a peer that
    /// must know it before it can start reads it with [`probe_decode`](super::probe_decode).
    pub app: Vec<u8>,
    /// The deployment's shared secret: a prefill must prove it holds it before this side sends
    /// anything but a challenge (see `control`'s handshake). `None` means the empty secret, which
    /// any peer can prove: a warning is logged at start, since any process that reaches the
    /// control port can then write into the pool.
    pub token: Option<crate::control::Secret>,
    /// Verify each chunk's checksum against the bytes in the pool before counting it.
    pub verify_checksums: bool,
    /// Tracker settings.
    pub tracker: TrackerConfig,
    /// Bound on each handshake.
    pub handshake_timeout: Duration,
    /// How long a failed request waits for every connected rank to confirm (AbortAck) that none of
    /// its writes into the request's pages still runs, before its future resolves anyway (counted in
    /// [`DecodeStats::abort_ack_timeouts`]).
    pub abort_ack_timeout: Duration,
    /// How long a request expected while a rank is not connected (a rank that died and has not
    /// rejoined yet) waits for it, at most its own timeout; then it fails with
    /// [`FailureReason::RankUnavailable`].
    pub rank_wait: Duration,
    /// Interval of the heartbeats sent to every prefill rank, announced in decode's Hello. A rank
    /// that sends nothing for [`SILENT_INTERVALS`](super::SILENT_INTERVALS) of the intervals *it*
    /// announced is declared lost (its slot freed, its requests failed, their pages held: it may
    /// still be writing); one that announces none is noticed only by TCP keepalive (or cut if it
    /// stops reading, below). Above 0 and at most `u32::MAX` ms (refused at start). The interval
    /// announced also bounds, the same way, how long a rank may leave decode's messages untaken,
    /// at most [`MAX_STALL`](super::MAX_STALL) (see [`DecodeStats::stalled`]). `None`: no
    /// heartbeats from here, and `MAX_STALL` for how long this side may leave a rank's messages
    /// untaken.
    pub heartbeat: Option<Duration>,
    /// Serve Prometheus metrics of this engine on this address (`GET /metrics`); engines of one
    /// process naming the same address share one endpoint (see [`crate::metrics`]). `None` (the
    /// default): no endpoint.
    pub metrics: Option<SocketAddr>,
    /// Bytes of landing memory: registered host memory outside the pool that a prefill rank whose
    /// rows would land strided in the pages (heads sliced with prefill TP above this side's, say)
    /// writes into packed instead, [`landing_slots`](Self::landing_slots) chunks' worth per
    /// request it writes (lent until the request's pages are released), from which this engine
    /// copies each chunk into the pages when its notification comes. Only with NIXL, a host pool
    /// and [`control::TpMode::HeadSliced`]: NIXL makes every strided row a descriptor of its own.
    /// A rank's share that does not fit what is free, even in one slot, is written into the pages
    /// directly (`DecodeStats::landing_full`). Size it to `landing_slots` chunks of each rank's
    /// share of the requests in flight. 0: none.
    pub landing_bytes: u64,
    /// Chunks of one rank's share of a request that landing memory holds at once (at least 1): a
    /// request of more chunks reuses them in turn, each rank writing chunk `c` only after this
    /// engine copied chunk `c - landing_slots` out (told with `Landed`). 1 gives the least memory
    /// and makes each of a rank's chunks wait for the copy of the one before; 2 (the default)
    /// lets a rank write a chunk while the one before is copied. A slot count that does not fit
    /// what is free is tried again with 1.
    pub landing_slots: u32,
    /// Called on the chunk worker at the start of each of its jobs, with the job's request, before
    /// the job copies, hashes or counts anything. For tests that must end a request while a job
    /// of it waits; `None` (the default) everywhere else.
    #[doc(hidden)]
    pub chunk_job_hook: Option<ChunkJobHook>,
}

/// See [`DecodeConfig::chunk_job_hook`].
#[doc(hidden)]
#[derive(Clone)]
pub struct ChunkJobHook(pub Arc<dyn Fn(RequestId) + Send + Sync>);

impl std::fmt::Debug for ChunkJobHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChunkJobHook")
    }
}

/// [`DecodeConfig::landing_slots`] by default.
pub const DEFAULT_LANDING_SLOTS: u32 = 2;

/// [`DecodeConfig::landing_bytes`] by default.
pub const DEFAULT_LANDING_BYTES: u64 = 256 << 20;

impl DecodeConfig {
    /// Defaults around a layout: UCX, loopback port 0, no token, checksums verified.
    pub fn new(total_layers: u32, page_tokens: u32, layout: KvLayout, pp_size: u16) -> Self {
        DecodeConfig {
            engine_id: "decode".into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            backend: BackendConfig::default_for_decode(
                crate::transport::BackendKind::Ucx,
                "decode",
            ),
            total_layers,
            page_tokens,
            layout,
            pp_size,
            tp: TpConfig::default(),
            stage: DecodeStage::default(),
            prefill_tp: None,
            instance: String::new(),
            app: Vec::new(),
            token: None,
            verify_checksums: true,
            tracker: TrackerConfig::default(),
            handshake_timeout: Duration::from_secs(10),
            abort_ack_timeout: Duration::from_secs(5),
            rank_wait: Duration::from_secs(10),
            heartbeat: Some(super::DEFAULT_HEARTBEAT),
            metrics: None,
            landing_bytes: DEFAULT_LANDING_BYTES,
            landing_slots: DEFAULT_LANDING_SLOTS,
            chunk_job_hook: None,
        }
    }
}

/// A decode side's own PP stage. A pipelined decode server (SGLang allows the prefill's PP size)
/// runs one engine per stage; each holds its stage's layers and takes them from the prefill PP
/// rank of the same stage. A stage's outcome speaks for its layers only: Complete once its rank
/// delivered them, whatever another stage's rank did. The request as a whole is complete when
/// every stage says so, which the caller agrees across its stages (SGLang's decode all-reduces its
/// stages' polls and fails the request on every stage where one failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeStage {
    /// This stage.
    pub rank: u16,
    /// The decode's PP size.
    pub size: u16,
}

impl Default for DecodeStage {
    fn default() -> Self {
        DecodeStage { rank: 0, size: 1 }
    }
}

/// What [`DecodeEngine::expect_request`] asks of a prefill instance for one request.
#[derive(Debug, Clone)]
pub struct Expected {
    /// The prefill instance whose ranks send it (`""`: the default instance).
    pub instance: String,
    /// Tokens before the moved ones that this side already holds (whole pages).
    pub prefix_tokens: u32,
    /// Tokens moved (after the prefix).
    pub prompt_tokens: u32,
    /// Tokens per prefill chunk.
    pub chunk_tokens: u32,
    /// The pool pages the moved tokens fill, in order.
    pub dst_pages: Vec<u32>,
    /// Bound on the whole transfer.
    pub timeout: Duration,
}

/// Counters of a [`DecodeEngine`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Requests that completed.
    pub completed: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Of those, by reason: aborted by this side.
    pub failed_aborted: u64,
    /// ... past their deadline.
    pub failed_timeout: u64,
    /// ... a rank reported failure (FAILURE notification, rejected allocation, abort from prefill).
    pub failed_peer_failed: u64,
    /// ... a rank's connection was lost.
    pub failed_peer_lost: u64,
    /// ... a rank broke the protocol (conflicting counts, bad checksum, ...).
    pub failed_violation: u64,
    /// ... a rank was absent and did not connect within `rank_wait`.
    pub failed_rank_unavailable: u64,
    /// Ranks admitted again after their connection ended (a new incarnation).
    pub rejoins: u64,
    /// Notifications that did not decode.
    pub malformed: u64,
    /// Notifications from a sender no rank is bound to.
    pub unknown_sender: u64,
    /// Notifications the tracker refused (wrong peer, unknown request, violation...), and control
    /// messages a rank may not send: about another instance's request, an aux payload over the
    /// bound, a kind no rank sends once connected.
    pub refused: u64,
    /// Aux payloads dropped before the server took them, to keep the store within 4096 payloads
    /// and 32 MiB: the oldest of the prefill instance that holds the most.
    pub aux_dropped: u64,
    /// Rank connections whose channel refused a record (a changed or forged byte on the way):
    /// each was closed, and its requests' pages stay quarantined.
    pub tampered: u64,
    /// Rank connections declared lost after a silence of three heartbeat intervals: each was
    /// closed, and its requests' pages stay quarantined.
    pub silent: u64,
    /// Rank connections cut because a message this side queued was not taken within three of the
    /// rank's heartbeat intervals of its being queued, at most [`MAX_STALL`](super::MAX_STALL)
    /// (`MAX_STALL` for a rank without heartbeats; a rank that reads nothing, or more slowly than
    /// this side queues): each was closed, and its requests' pages stay quarantined, as for a
    /// silent rank.
    pub stalled: u64,
    /// Rank connections that ended without the rank's Close (its process died, or a reset on the
    /// way cut it off): the pages of its failed requests stay held until it must have noticed
    /// (three of this side's heartbeat intervals, then `abort_ack_timeout`).
    pub unclean_ends: u64,
    /// Connections closed before their handshake ended because a newer one took their place
    /// ([`MAX_PENDING_HANDSHAKES`](super::MAX_PENDING_HANDSHAKES) were in progress: the oldest of
    /// the busiest source address gives way), or gone before they could be set up.
    pub refused_connections: u64,
    /// Chunks whose checksum did not match the pool's bytes.
    pub checksum_mismatch: u64,
    /// Requests still tracked.
    pub in_flight: u64,
    /// Requests the engine keeps anything of: expected and not over, or over with a rank's
    /// acknowledgement still awaited.
    pub requests: u64,
    /// Prefill instances the engine serves (added and not yet forgotten).
    pub instances: u64,
    /// Prefill ranks connected now, over every instance.
    pub connected_ranks: u64,
    /// Requests expected while a rank of their instance was absent, waiting for it (at most
    /// `rank_wait`): their pages are held and no rank was asked for them yet.
    pub waiting_for_rank: u64,
    /// Jobs on the chunk workers, waiting or running: notifications whose chunks are not yet
    /// copied, hashed or counted, dropped ones not yet reached, and lost ranks waiting behind a
    /// request's notifications.
    pub jobs_queued: u64,
    /// Failed requests whose future waits for ranks to confirm their writes are over.
    pub awaiting_abort_ack: u64,
    /// Failed requests resolved without every rank's confirmation, after `abort_ack_timeout`.
    pub abort_ack_timeouts: u64,
    /// Failed requests whose outcome went out without every rank's confirmation and whose pages
    /// are therefore still quarantined.
    pub quarantined: u64,
    /// Bytes of the pool registered by the transport (landing memory is `landing_bytes`).
    pub registered_bytes: u64,
    /// Registrations of the pool the transport holds (once, whatever the number of instances;
    /// landing memory, where there is some, is one more, not counted here).
    pub registrations: u64,
    /// Control connections refused because the peer did not prove the shared secret (or refused
    /// our proof).
    pub auth_failures: u64,
    /// Other failed handshakes (mismatched layouts, a rank or sender already bound, timeouts...).
    pub handshake_failures: u64,
    /// Authenticated peers that read this side's Hello and left ([`probe_decode`](super::probe_decode)).
    pub probes: u64,
    /// Microseconds registering the pool took at start (for a pool the transport allocates, its
    /// allocation and population too).
    pub register_micros: u64,
    /// Bytes of landing memory registered ([`DecodeConfig::landing_bytes`]; 0 where none is).
    pub landing_bytes: u64,
    /// Bytes of landing memory lent now: to requests in flight, and to failed ones until their
    /// pages are released (a quarantined request keeps its ranges).
    pub landing_lent: u64,
    /// Legs of requests (one prefill rank's share) that were granted landing memory.
    pub landing_grants: u64,
    /// Legs that would have been granted landing memory but found too little free: their rows
    /// went into the pages directly.
    pub landing_full: u64,
    /// Chunks copied from landing memory into the pages.
    pub landing_chunks: u64,
    /// Notifications dropped on a chunk worker (a copy out of landing memory, a checksum to
    /// verify): their request ended (its pages released, or it failed) while they waited, or more
    /// were queued for it than its chunks can account for.
    pub jobs_dropped: u64,
    /// Requests given up before they were expected ([`DecodeEngine::abandon`]), their instance's
    /// ranks told.
    pub abandoned: u64,
}

struct RankConn {
    peer: PeerId,
    writer: Outbox,
    planner: Planner,
    /// Bound with `bind_external_rank`: no control connection, so it never confirms by itself.
    external: bool,
    /// The rank said its vote mesh is formed ([`Msg::Ready`]); requests go to it only then.
    ready: bool,
    /// The start of the rank this connection belongs to.
    incarnation: u64,
    /// An outside liveness signal (its etcd lease ended) says this start is gone while its
    /// connection is up: no requests go to it until it is readmitted, and a later start of the
    /// rank takes its slot (its connection is then cut).
    evicted: bool,
    /// Cuts the connection (its read loop ends) when a later start takes the slot of this evicted
    /// one.
    cut: Arc<Notify>,
    /// The layers it writes.
    layers: std::ops::Range<u32>,
}

/// A rank's connection that ended without its Close: its process died, or a reset on the way cut
/// off a live rank, which goes on writing until it notices. It notices when this side's heartbeats
/// stop (three intervals, its silence bound for this side) and then posts nothing more; what it
/// had posted is over within `abort_ack_timeout`, the bound a connected rank has to confirm an
/// abort. Until then, a failed request that was live when the connection ended keeps its pages.
struct LostConn {
    rank: u16,
    peer: PeerId,
    /// When the connection ended.
    at: Instant,
    /// When its writes are over; `None` without heartbeats (the rank may never notice): until the
    /// server confirms for it ([`DecodeEngine::confirm_stopped`]).
    until: Option<Instant>,
}

impl LostConn {
    /// Whether a failed `request` (expected at `started`) waits for this connection at `now`.
    fn holds(&self, started: Instant, now: Instant) -> bool {
        started <= self.at && self.until.is_none_or(|u| u > now)
    }
}

impl RankConn {
    /// Whether requests go to this rank.
    fn serving(&self) -> bool {
        self.ready && !self.evicted
    }

    /// Whether a start with `incarnation` may take this connection's slot: this start was
    /// evicted (it is gone, or stopped with its sockets open) and the other is a later one.
    fn replaceable_by(&self, incarnation: u64) -> bool {
        self.evicted && !self.external && self.incarnation < incarnation
    }
}

struct ReqInfo {
    /// The instance whose ranks send it.
    session: SessionId,
    geometry: ChunkGeometry,
    dst_pages: Arc<Vec<u32>>,
    /// Tokens before the moved ones that this side already holds (told to the ranks).
    prefix_tokens: u32,
    /// When `expect` took it (the start of its duration in the metrics).
    started: Instant,
    /// The latest instant a rank of its instance said it posted a chunk of it (microseconds since
    /// the Unix epoch on that rank's wall clock): the start of its last-post-to-Complete time.
    last_posted_us: Option<u64>,
}

/// Landing memory lent to one rank (by its slot) for one request.
struct Grant {
    slot: u16,
    landing: control::Landing,
    /// Chunks copied out of it: each is copied once (a duplicate of its notification may come
    /// after a later chunk reused its range).
    landed: ChunkSet,
}

impl Grant {
    /// Marks chunk `chunk` copied; false if it was already (or is not the request's).
    fn first_landing(&mut self, chunk: u32) -> bool {
        self.landed.insert(chunk)
    }
}

/// A chunk's copy out of landing memory into its request's pages, planned under the engine's lock.
struct LandingCopy {
    /// Where the chunk's rows start in the landing memory.
    from: u64,
    /// The chunk's writes in the request's pages, in the order its rows lie in the landing range.
    writes: Vec<Write>,
    /// The rank reuses the range: it waits for `Landed` before it writes a later chunk there.
    tell: bool,
    /// The chunk's checksum, to check the pages against once it is copied (with the same plan).
    checksum: Option<u64>,
}

/// What a chunk worker does with a chunk before its notification is counted.
enum Work {
    /// Copies it out of landing memory (and hashes it, with the copy's plan, if it has a checksum).
    Copy(LandingCopy),
    /// Hashes the chunk's `writes` from the pages against its checksum `sum`.
    Hash { writes: Vec<Write>, sum: u64 },
    /// Nothing: the notification only waits for its request's jobs queued before it.
    Count,
}

/// A chunk notification handled on a chunk worker: its chunk's copy or hash, then what the
/// progress thread does for any notification ([`Inner::account`]).
struct ChunkJob {
    session: SessionId,
    rank: u16,
    peer: PeerId,
    request: RequestId,
    /// When the notification came (or the peer was lost).
    now: Instant,
    what: Job,
    /// The request's gate when the job was queued.
    gate: Arc<Gate>,
}

/// What a chunk worker's job is about.
enum Job {
    /// A chunk notification of the request, and what to do with its chunk first.
    Chunk {
        n: notify::ChunkNotification,
        work: Work,
    },
    /// The peer was lost while notifications of the request were queued: the tracker hears of it
    /// for this request after them, so that a rank whose last chunks were still being checked
    /// counts as having delivered them.
    PeerLost,
}

/// Counts a chunk job over when dropped, however the job ends (a panic too).
struct JobOver<'a>(&'a AtomicU64);

impl Drop for JobOver<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A landed chunk's copy, planned.
enum Planned {
    Copy(LandingCopy),
    /// The chunk's writes do not fit its landing stride.
    TooLarge,
}

/// How a copy out of landing memory ended.
enum Copied {
    Done,
    /// A copy call refused its ranges (a bug).
    Failed,
    /// The request's pages were released first.
    Revoked,
}

/// A request with notifications queued on a chunk worker.
struct Queued {
    /// Jobs of the request sent and not yet over.
    queued: u32,
    /// Of them, notifications (what [`queue_bound`] bounds).
    notifications: u32,
    /// Peers whose loss waits in the queue (one job each).
    lost: Vec<PeerId>,
    gate: Arc<Gate>,
}

/// A prefill instance's key in the engine's state; callers name instances by string.
type SessionId = u64;

/// The name of the instance [`DecodeEngine::expect`] and the other methods without an instance use.
const DEFAULT_INSTANCE: &str = "";

/// One prefill instance (one PP pipeline) the engine serves.
struct Session {
    name: String,
    /// The instance's PP size.
    pp_size: u16,
    /// The instance's PP ranks that write into this decode: `pp_first..pp_first + pp_count`
    /// (every one, or the one of this decode's own stage); slots count from `pp_first`.
    pp_first: u16,
    pp_count: u16,
    /// The instance's TP size.
    prefill_tp: u16,
    /// The prefill TP ranks that write into this decode TP rank (one for identical TP), in
    /// order: with `fan_in` of them, PP rank `p`'s `j`-th source counts as slot
    /// `p * fan_in + j` ([`crate::core::topology::slot`]), and `ranks` holds every slot.
    sources: Vec<crate::core::topology::Source>,
    ranks: Vec<Option<RankConn>>,
    /// The incarnation admitted last for each rank.
    incarnations: Incarnations,
    /// Ranks whose connection ended with their Close: their writes are over.
    closed_ranks: std::collections::HashSet<u16>,
    /// Rank connections that ended without their Close, while their ranks may still write.
    lost: Vec<LostConn>,
    /// Requests expected while a rank was absent, in `expect` order: their pages are held, no rank
    /// was asked for them yet.
    parked: std::collections::VecDeque<Parked>,
    /// When some rank was not ready, oldest first (the last one open while a rank is away).
    absences: std::collections::VecDeque<Absence>,
    /// [`DecodeEngine::remove_instance`] was called: no new requests; the session is forgotten
    /// once none of its ranks is connected and none of its requests holds pages.
    leaving: bool,
    /// Layers claimed by handshakes past their check and not yet admitted or failed: two ranks
    /// whose layers leave a gap, arriving at once, cannot both pass the check (the later one is
    /// refused in its handshake, with the reason, instead of cut after it).
    claims: Vec<Claim>,
}

/// Layers a rank's handshake claimed for `slot`, until it is admitted or fails.
struct Claim {
    id: u64,
    slot: u16,
    layers: std::ops::Range<u32>,
}

impl Session {
    fn new(
        name: String,
        pp_size: u16,
        (pp_first, pp_count): (u16, u16),
        prefill_tp: u16,
        sources: Vec<crate::core::topology::Source>,
        now: Instant,
    ) -> Self {
        let slots = pp_count.saturating_mul(sources.len() as u16);
        Session {
            name,
            pp_size,
            pp_first,
            pp_count,
            prefill_tp,
            sources,
            ranks: (0..slots).map(|_| None).collect(),
            incarnations: Incarnations::new(slots),
            closed_ranks: std::collections::HashSet::new(),
            lost: Vec::new(),
            parked: std::collections::VecDeque::new(),
            absences: std::collections::VecDeque::from([Absence {
                from: now,
                until: None,
            }]),
            leaving: false,
            claims: Vec::new(),
        }
    }

    /// Whether a rank in `slot` writing `layers` keeps the PP ranks' layers a tiling of decode's
    /// layers `want` (the model's, or its stage's): the first rank starts at `want.start`, the last
    /// ends at `want.end`, and each rank starts where the one before it ends (TP sources of one PP
    /// rank hold the same layers). Checked against the ranks connected now, so once every rank is
    /// there no layer decode holds is left unwritten (a request would otherwise complete with those
    /// layers never written) and none is written twice.
    fn layers_fit(
        &self,
        slot: u16,
        layers: &std::ops::Range<u32>,
        want: &std::ops::Range<u32>,
    ) -> Result<(), String> {
        let fan = (self.sources.len() as u16).max(1);
        let pp = slot / fan;
        let named = self.pp_first.saturating_add(pp);
        if pp == 0 && layers.start != want.start {
            return Err(format!(
                "PP rank {named} holds layers {layers:?}: layers {}..{} would never be written",
                want.start, layers.start
            ));
        }
        if pp + 1 == self.pp_count && layers.end != want.end {
            return Err(format!(
                "the last PP rank, {named}, holds layers {layers:?} of {want:?}: layers {}..{} would never be written",
                layers.end, want.end
            ));
        }
        let connected = self
            .ranks
            .iter()
            .enumerate()
            .filter_map(|(other, r)| Some((other as u16, &r.as_ref()?.layers)));
        let claimed = self.claims.iter().map(|c| (c.slot, &c.layers));
        for (other, theirs) in connected.chain(claimed) {
            if other == slot {
                continue;
            }
            let op = other / fan;
            let fits = match op.cmp(&pp) {
                std::cmp::Ordering::Equal => theirs == layers,
                std::cmp::Ordering::Less if op + 1 == pp => theirs.end == layers.start,
                std::cmp::Ordering::Less => theirs.end <= layers.start,
                std::cmp::Ordering::Greater if pp + 1 == op => layers.end == theirs.start,
                std::cmp::Ordering::Greater => layers.end <= theirs.start,
            };
            if !fits {
                let other = self.pp_first.saturating_add(op);
                return Err(format!(
                    "PP rank {named} holds layers {layers:?}, but PP rank {other} holds {theirs:?}: the ranks must hold consecutive layer ranges, each starting where the one before ends"
                ));
            }
        }
        Ok(())
    }

    /// The slot of PP rank `pp_rank`'s source (of any TP rank) whose start is `incarnation`, as
    /// connected now: what an outside liveness signal that names a rank by its PP rank and its
    /// start addresses.
    fn slot_of_start(&self, pp_rank: u16, incarnation: u64) -> Option<u16> {
        (0..self.sources.len())
            .filter_map(|j| self.slot(pp_rank, j))
            .find(|slot| {
                self.ranks
                    .get(usize::from(*slot))
                    .and_then(Option::as_ref)
                    .is_some_and(|r| r.incarnation == incarnation)
            })
    }

    /// The PP rank (of the instance) whose source holds `slot`.
    fn pp_rank_of(&self, slot: u16) -> u16 {
        let fan = (self.sources.len() as u16).max(1);
        self.pp_first.saturating_add(slot / fan)
    }

    /// Slot of PP rank `pp_rank`'s `j`-th source.
    fn slot(&self, pp_rank: u16, j: usize) -> Option<u16> {
        let pp = pp_rank
            .checked_sub(self.pp_first)
            .filter(|p| *p < self.pp_count)?;
        if j >= self.sources.len() {
            return None;
        }
        crate::core::topology::slot(pp, self.sources.len() as u16, j as u16)
    }

    /// The lowest rank that is not connected, or else the lowest connected one that does not
    /// serve (its vote mesh is not whole, or it is evicted), if any: a request that waited in
    /// vain names the rank that is gone before those waiting for it.
    fn first_absent(&self) -> Option<u16> {
        self.ranks
            .iter()
            .position(Option::is_none)
            .or_else(|| {
                self.ranks
                    .iter()
                    .position(|r| !r.as_ref().is_some_and(RankConn::serving))
            })
            .map(|r| r as u16)
    }

    fn rank(&self, rank: u16) -> Option<&RankConn> {
        self.ranks.get(usize::from(rank)).and_then(Option::as_ref)
    }

    fn rank_mut(&mut self, rank: u16) -> Option<&mut RankConn> {
        self.ranks
            .get_mut(usize::from(rank))
            .and_then(Option::as_mut)
    }
}

struct State {
    tracker: CompletionTracker,
    waiters: HashMap<RequestId, oneshot::Sender<Outcome>>,
    requests: HashMap<RequestId, ReqInfo>,
    sessions: HashMap<SessionId, Session>,
    /// Instance names to their sessions.
    names: HashMap<String, SessionId>,
    next_session: SessionId,
    /// Which instance sent each recent request (kept past its end: its ranks' payloads can come
    /// a moment after it completed).
    owners: super::Recent<SessionId>,
    senders: HashMap<Sender, (SessionId, u16, PeerId)>,
    next_peer: u64,
    /// Id of the next handshake's layer [`Claim`].
    next_claim: u64,
    completed_at: super::Stamps,
    /// Failed requests whose pages wait until the ranks named confirm their writes are over; the
    /// outcome is held until then, or until the deadline, after which the pages are quarantined.
    unacked: HashMap<RequestId, Unacked>,
    /// Every page a live, unacknowledged or quarantined request holds: `expect` refuses them.
    held_pages: HashMap<u32, RequestId>,
    /// Waiters for a quarantined request's pages to become safe.
    released_waiters: HashMap<RequestId, Vec<oneshot::Sender<()>>>,
    /// `shutdown` began: no new requests.
    closing: bool,
    /// Payloads ranks sent beside their pages ([`DecodeEngine::aux`]), oldest dropped first.
    aux: AuxStore,
    /// Ranges of the landing memory lent out (capacity 0 without landing memory).
    landing: crate::core::ranges::Ranges,
    /// Each request's landing grants, by rank slot: lent until its pages are released.
    grants: HashMap<RequestId, Vec<Grant>>,
    /// Requests with notifications on a chunk worker; their gates are revoked when their pages are
    /// released.
    queued: HashMap<RequestId, Queued>,
}

impl State {
    /// Whether a write of `request`'s ranks may still land in its pages: it is live, or failed and
    /// not yet confirmed by every rank ([`DecodeEngine::released`] waits for that).
    fn may_be_written(&self, request: RequestId) -> bool {
        self.requests.contains_key(&request) || self.unacked.contains_key(&request)
    }

    fn session_named(&self, instance: &str) -> Option<SessionId> {
        self.names.get(instance).copied()
    }

    /// Whether `request` is a request of `session` (live, failed and held, or recent).
    fn owned_by(&self, request: RequestId, session: SessionId) -> bool {
        self.requests
            .get(&request)
            .map(|r| r.session)
            .or_else(|| self.unacked.get(&request).map(|u| u.session))
            .or_else(|| self.owners.get(request).copied())
            == Some(session)
    }

    /// Forgets a leaving session once nothing of it is left.
    fn forget_if_left(&mut self, session: SessionId) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        let idle = s.leaving
            && s.ranks.iter().all(Option::is_none)
            && s.parked.is_empty()
            && !self.requests.values().any(|r| r.session == session)
            && !self.unacked.values().any(|u| u.session == session);
        if idle {
            let name = s.name.clone();
            self.sessions.remove(&session);
            self.names.remove(&name);
            tracing::info!(instance = %name, "prefill instance forgotten");
        }
    }
}

/// A time during which at least one PP rank was not connected and ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Absence {
    /// When the first rank went away (or the engine started).
    pub from: Instant,
    /// When every rank was back; `None` while one is still away.
    pub until: Option<Instant>,
}

impl Absence {
    /// Whether any part of `from..=until` falls in this absence.
    pub fn overlaps(&self, from: Instant, until: Instant) -> bool {
        self.from <= until && self.until.is_none_or(|u| u >= from)
    }
}

/// How many absences an engine remembers.
const ABSENCES_KEPT: usize = 1024;

fn absence_begins(s: &mut Session, now: Instant) {
    if s.absences.back().is_some_and(|a| a.until.is_none()) {
        return;
    }
    if s.absences.len() == ABSENCES_KEPT {
        s.absences.pop_front();
    }
    s.absences.push_back(Absence {
        from: now,
        until: None,
    });
}

fn absence_ends(s: &mut Session, now: Instant) {
    if s.first_absent().is_none()
        && let Some(a) = s.absences.back_mut()
        && a.until.is_none()
    {
        a.until = Some(now);
    }
}

/// A request waiting for its absent ranks.
struct Parked {
    request: RequestId,
    prompt_tokens: u32,
    chunk_tokens: u32,
    /// The transfer's deadline (from `expect`).
    deadline: Instant,
    /// When it fails with `RankUnavailable` unless every rank is connected.
    wait_until: Instant,
}

struct Unacked {
    /// The instance whose ranks are named.
    session: SessionId,
    /// Connected ranks whose confirmation (AbortAck, or their connection ending with their Close)
    /// the outcome waits for, each with the connection that must confirm: a later start of the rank knows nothing of
    /// the earlier one's writes and confirms nothing for it.
    ranks: Vec<(u16, PeerId)>,
    /// Ranks that cannot confirm by themselves: the pages stay quarantined until the server
    /// confirms for them (`confirm_stopped`), or, for a connection (`Some`: an evicted rank, one
    /// whose connection ended without its Close or is ending), until its Close, its AbortAck, or
    /// the bound after an end without Close ([`LostConn`]).
    external: Vec<(u16, Option<PeerId>)>,
    /// `None` once the outcome was handed out (the request is quarantined).
    outcome: Option<Outcome>,
    deadline: Instant,
    pages: Arc<Vec<u32>>,
}

/// What [`DecodeEngine::shutdown`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Ranks, as (instance, PP rank), that confirmed (by their Close) that none of their writes
    /// into the pool still runs.
    pub confirmed: Vec<(String, u16)>,
    /// Ranks whose connection was gone, or went away, instead: they write nothing more either.
    pub gone: Vec<(String, u16)>,
    /// Ranks that did not confirm before the deadline, and external ranks (bound with
    /// [`DecodeEngine::bind_external_rank`]), which cannot: while any is listed, the pool is leaked
    /// rather than freed.
    pub unconfirmed: Vec<(String, u16)>,
    /// Whether the pool will be freed when the last handle to the engine is dropped: every rank
    /// confirmed or is gone, no request is quarantined (a rank cut by tampering or silence may still
    /// write into its pages), and [`DecodeEngine::backend_info`] never handed the pool out of band.
    pub pool_freed: bool,
}

struct Counters {
    completed: AtomicU64,
    failed: AtomicU64,
    /// By reason, in the order of `DecodeStats`'s `failed_*` fields.
    failed_by: [AtomicU64; 6],
    rejoins: AtomicU64,
    malformed: AtomicU64,
    unknown_sender: AtomicU64,
    refused: AtomicU64,
    tampered: AtomicU64,
    silent: AtomicU64,
    stalled: AtomicU64,
    aux_dropped: AtomicU64,
    unclean_ends: AtomicU64,
    refused_connections: AtomicU64,
    checksum_mismatch: AtomicU64,
    abort_ack_timeouts: AtomicU64,
    auth_failures: AtomicU64,
    handshake_failures: AtomicU64,
    probes: AtomicU64,
    landing_grants: AtomicU64,
    landing_full: AtomicU64,
    landing_chunks: AtomicU64,
    jobs_dropped: AtomicU64,
    abandoned: AtomicU64,
    /// Jobs sent to a chunk worker and not yet over.
    jobs_queued: AtomicU64,
    /// Seconds from `expect` to the outcome, of requests that completed and that failed.
    seconds_complete: prometheus_client::metrics::histogram::Histogram,
    seconds_failed: prometheus_client::metrics::histogram::Histogram,
    /// Seconds from the last post any rank stamped on a completed request's chunks to its
    /// Complete, on decode's wall clock.
    seconds_last_post: prometheus_client::metrics::histogram::Histogram,
    /// Completed requests whose last post stamp lay after their Complete on decode's clock (the
    /// clocks are out of step): observed as 0 above.
    last_post_ahead: AtomicU64,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            completed: AtomicU64::default(),
            failed: AtomicU64::default(),
            failed_by: Default::default(),
            rejoins: AtomicU64::default(),
            malformed: AtomicU64::default(),
            unknown_sender: AtomicU64::default(),
            refused: AtomicU64::default(),
            tampered: AtomicU64::default(),
            silent: AtomicU64::default(),
            stalled: AtomicU64::default(),
            aux_dropped: AtomicU64::default(),
            unclean_ends: AtomicU64::default(),
            refused_connections: AtomicU64::default(),
            checksum_mismatch: AtomicU64::default(),
            abort_ack_timeouts: AtomicU64::default(),
            auth_failures: AtomicU64::default(),
            handshake_failures: AtomicU64::default(),
            probes: AtomicU64::default(),
            landing_grants: AtomicU64::default(),
            landing_full: AtomicU64::default(),
            landing_chunks: AtomicU64::default(),
            jobs_dropped: AtomicU64::default(),
            abandoned: AtomicU64::default(),
            jobs_queued: AtomicU64::default(),
            seconds_complete: crate::metrics::seconds_histogram(),
            seconds_failed: crate::metrics::seconds_histogram(),
            seconds_last_post: crate::metrics::seconds_histogram(),
            last_post_ahead: AtomicU64::default(),
        }
    }
}

impl Counters {
    /// Records a request's duration from `expect` to its outcome.
    fn observe(&self, complete: bool, started: Instant) {
        let h = if complete {
            &self.seconds_complete
        } else {
            &self.seconds_failed
        };
        h.observe(started.elapsed().as_secs_f64());
    }

    /// Records a completed request's last post (wall clock µs) to now.
    fn observe_last_post(&self, posted_us: u64) {
        let now = crate::core::notify::wall_us();
        if now < posted_us {
            self.last_post_ahead.fetch_add(1, Ordering::Relaxed);
        }
        self.seconds_last_post
            .observe(now.saturating_sub(posted_us) as f64 / 1e6);
    }
}

struct Inner {
    cfg: DecodeConfig,
    secret: crate::control::Secret,
    state: Mutex<State>,
    counters: Counters,
    timer: Arc<tokio::sync::Notify>,
    /// Bumped whenever a rank connects, becomes ready, is evicted or readmitted, or its connection
    /// ends: waiters look at the state again.
    changed: watch::Sender<u64>,
    /// Set once, after the transport exists (its sink needs a Weak to us first).
    transport: std::sync::OnceLock<Arc<dyn Transport>>,
    pool: std::sync::OnceLock<super::pools::Pools>,
    /// Landing memory ([`DecodeConfig::landing_bytes`]), where this engine has some.
    landing: std::sync::OnceLock<crate::transport::Registration>,
    /// The threads that copy chunks out of landing memory and verify checksums: started with the
    /// landing memory, or for a host pool whose checksums this engine verifies.
    workers: std::sync::OnceLock<Workers<ChunkJob>>,
    /// `backend_info` handed the pool's registration to someone outside the control plane, who can
    /// never confirm that it stopped writing.
    exported_out_of_band: AtomicBool,
    /// Every peer that could write into the pool confirmed it stopped (`shutdown`): the pool may be
    /// freed.
    pool_safe: AtomicBool,
    /// This engine's place in the process's metrics endpoint, if `cfg.metrics` asked for one.
    metrics: std::sync::OnceLock<crate::metrics::Joined>,
    /// How long registering the pool took at start, in microseconds.
    register_micros: AtomicU64,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Only a shutdown that every rank confirmed makes the pool safe to free; otherwise the
        // registration, which handed out the pool's address, leaks it.
        if let Some(pool) = self.pool.get_mut() {
            if self.pool_safe.load(Ordering::Acquire) {
                pool.mark_quiesced();
                if let Some(l) = self.landing.get() {
                    l.mark_quiesced();
                }
            } else {
                tracing::warn!(
                    "decode engine dropped without a shutdown that every rank confirmed: its KV pool is leaked if a peer could know it"
                );
            }
        }
    }
}

impl Inner {
    /// The counters and state sizes [`DecodeEngine::stats`] reports.
    fn stats(&self) -> DecodeStats {
        let landing_bytes = self
            .landing
            .get()
            .and_then(crate::transport::Registration::desc)
            .map_or(0, |d| d.len());
        let c = &self.counters;
        let (
            in_flight,
            requests,
            awaiting_abort_ack,
            quarantined,
            instances,
            connected_ranks,
            waiting,
            landing_lent,
        ) = {
            let st = self.lock();
            let held = st.unacked.values().filter(|u| u.outcome.is_some()).count() as u64;
            let quarantined = st.unacked.len() as u64 - held;
            let instances = st.sessions.values().filter(|s| !s.leaving).count() as u64;
            let connected = st
                .sessions
                .values()
                .map(|s| s.ranks.iter().flatten().count() as u64)
                .sum();
            let waiting = st.sessions.values().map(|s| s.parked.len() as u64).sum();
            (
                st.tracker.in_flight() as u64,
                st.requests.len() as u64,
                held,
                quarantined,
                instances,
                connected,
                waiting,
                st.landing.taken(),
            )
        };
        DecodeStats {
            completed: c.completed.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            failed_aborted: c.failed_by[0].load(Ordering::Relaxed),
            failed_timeout: c.failed_by[1].load(Ordering::Relaxed),
            failed_peer_failed: c.failed_by[2].load(Ordering::Relaxed),
            failed_peer_lost: c.failed_by[3].load(Ordering::Relaxed),
            failed_violation: c.failed_by[4].load(Ordering::Relaxed),
            failed_rank_unavailable: c.failed_by[5].load(Ordering::Relaxed),
            rejoins: c.rejoins.load(Ordering::Relaxed),
            malformed: c.malformed.load(Ordering::Relaxed),
            unknown_sender: c.unknown_sender.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            tampered: c.tampered.load(Ordering::Relaxed),
            silent: c.silent.load(Ordering::Relaxed),
            stalled: c.stalled.load(Ordering::Relaxed),
            aux_dropped: c.aux_dropped.load(Ordering::Relaxed),
            unclean_ends: c.unclean_ends.load(Ordering::Relaxed),
            refused_connections: c.refused_connections.load(Ordering::Relaxed),
            checksum_mismatch: c.checksum_mismatch.load(Ordering::Relaxed),
            in_flight,
            requests,
            instances,
            connected_ranks,
            waiting_for_rank: waiting,
            jobs_queued: c.jobs_queued.load(Ordering::Relaxed),
            awaiting_abort_ack,
            abort_ack_timeouts: c.abort_ack_timeouts.load(Ordering::Relaxed),
            quarantined,
            auth_failures: c.auth_failures.load(Ordering::Relaxed),
            handshake_failures: c.handshake_failures.load(Ordering::Relaxed),
            probes: c.probes.load(Ordering::Relaxed),
            register_micros: self.register_micros.load(Ordering::Relaxed),
            landing_bytes,
            landing_lent,
            landing_grants: c.landing_grants.load(Ordering::Relaxed),
            landing_full: c.landing_full.load(Ordering::Relaxed),
            landing_chunks: c.landing_chunks.load(Ordering::Relaxed),
            jobs_dropped: c.jobs_dropped.load(Ordering::Relaxed),
            abandoned: c.abandoned.load(Ordering::Relaxed),
            registered_bytes: self
                .transport
                .get()
                .map(|t| t.stats().registered_bytes)
                .unwrap_or(0)
                .saturating_sub(landing_bytes),
            registrations: self
                .transport
                .get()
                .map(|t| t.stats().regions)
                .unwrap_or(0)
                .saturating_sub(u64::from(landing_bytes > 0)),
        }
    }
}

impl crate::metrics::Source for Inner {
    fn collect(&self, out: &mut crate::metrics::Samples) {
        use crate::metrics::Value::{Counter, Gauge, Histogram};
        let s = self.stats();
        let labels = crate::metrics::EngineLabels::new(
            "decode",
            &self.cfg.engine_id,
            &self.cfg.backend.kind().to_string(),
        );
        let base = || labels.base();
        let with = |k: &'static str, v: &str| labels.with(k, v);
        let c = &self.counters;
        out.add(
            "kvx_requests",
            "Requests that ended, by outcome and, for failures, cause",
            with("outcome", "complete"),
            Counter(s.completed),
        );
        for (cause, n) in [
            ("aborted", s.failed_aborted),
            ("timeout", s.failed_timeout),
            ("peer_failed", s.failed_peer_failed),
            ("peer_lost", s.failed_peer_lost),
            ("violation", s.failed_violation),
            ("rank_unavailable", s.failed_rank_unavailable),
        ] {
            let mut l = with("outcome", "failed");
            l.push(("cause", cause.to_string()));
            out.add("kvx_requests", "", l, Counter(n));
        }
        out.add(
            "kvx_request_duration_seconds",
            "Seconds from expect to the request's outcome",
            with("outcome", "complete"),
            Histogram(c.seconds_complete.clone()),
        );
        out.add(
            "kvx_request_duration_seconds",
            "",
            with("outcome", "failed"),
            Histogram(c.seconds_failed.clone()),
        );
        out.add(
            "kvx_last_post_to_complete_seconds",
            "Seconds from the last chunk post any prefill rank stamped on a completed request (its \
             wall clock, carried in the notification) to its Complete (decode's wall clock)",
            base(),
            Histogram(c.seconds_last_post.clone()),
        );
        out.add(
            "kvx_last_post_ahead",
            "Completed requests whose last post stamp lay after their Complete on decode's clock \
             (clocks out of step; observed as 0 seconds)",
            base(),
            Counter(c.last_post_ahead.load(Ordering::Relaxed)),
        );
        let gauge = |n: u64| Gauge(i64::try_from(n).unwrap_or(i64::MAX));
        for (name, help, v) in [
            (
                "kvx_requests_in_flight",
                "Requests expected and not yet decided",
                s.in_flight,
            ),
            (
                "kvx_requests_held",
                "Requests whose pages this engine holds",
                s.requests,
            ),
            (
                "kvx_requests_quarantined",
                "Ended requests whose pages stay held until every rank confirms it stopped writing",
                s.quarantined,
            ),
            (
                "kvx_requests_waiting_for_rank",
                "Requests expected while a rank of their instance was absent, waiting for it",
                s.waiting_for_rank,
            ),
            (
                "kvx_chunk_jobs_queued",
                "Jobs on the chunk workers, waiting or running: notifications (a copy out of landing memory, a checksum to verify) and lost ranks waiting behind them",
                s.jobs_queued,
            ),
            (
                "kvx_requests_awaiting_abort_ack",
                "Failed requests whose outcome waits for the ranks' acknowledgement",
                s.awaiting_abort_ack,
            ),
            ("kvx_instances", "Prefill instances served", s.instances),
            (
                "kvx_connected_ranks",
                "Prefill ranks connected",
                s.connected_ranks,
            ),
            (
                "kvx_registered_bytes",
                "Bytes of the pool registered with the transport (landing memory: kvx_landing_bytes)",
                s.registered_bytes,
            ),
            (
                "kvx_registrations",
                "Registrations of this engine's pool (landing memory not counted)",
                s.registrations,
            ),
            (
                "kvx_landing_bytes",
                "Bytes of landing memory registered for rows that would land strided in the pages",
                s.landing_bytes,
            ),
            (
                "kvx_landing_lent_bytes",
                "Bytes of landing memory lent to requests now (failed ones keep theirs until their pages are released)",
                s.landing_lent,
            ),
        ] {
            out.add(name, help, base(), gauge(v));
        }
        for (name, help, v) in [
            (
                "kvx_rank_rejoins",
                "Ranks admitted again after their connection ended",
                s.rejoins,
            ),
            (
                "kvx_notifications_malformed",
                "Notifications that did not decode",
                s.malformed,
            ),
            (
                "kvx_notifications_unknown_sender",
                "Notifications from a sender no rank is bound to",
                s.unknown_sender,
            ),
            (
                "kvx_notifications_refused",
                "Notifications the tracker refused",
                s.refused,
            ),
            (
                "kvx_aux_dropped",
                "Aux payloads dropped before the server took them (the store was full)",
                s.aux_dropped,
            ),
            (
                "kvx_channel_refused",
                "Rank connections closed because the channel refused a record",
                s.tampered,
            ),
            (
                "kvx_heartbeat_losses",
                "Rank connections lost after three missed heartbeat intervals",
                s.silent,
            ),
            (
                "kvx_connections_stalled",
                "Rank connections cut because a message was not taken within three of the rank's heartbeat intervals (at most 60 s; 60 s for a rank without heartbeats) of its being queued",
                s.stalled,
            ),
            (
                "kvx_unclean_ends",
                "Rank connections that ended without the rank's Close",
                s.unclean_ends,
            ),
            (
                "kvx_connections_refused",
                "Connections closed before their handshake ended: a newer one took their place, or gone before they could be set up",
                s.refused_connections,
            ),
            (
                "kvx_checksum_mismatches",
                "Chunks whose checksum did not match",
                s.checksum_mismatch,
            ),
            (
                "kvx_abort_ack_timeouts",
                "Aborts no rank acknowledged in time",
                s.abort_ack_timeouts,
            ),
            (
                "kvx_auth_failures",
                "Handshakes that failed authentication",
                s.auth_failures,
            ),
            (
                "kvx_handshake_failures",
                "Handshakes that failed otherwise",
                s.handshake_failures,
            ),
            (
                "kvx_landing_grants",
                "Requests' legs granted landing memory",
                s.landing_grants,
            ),
            (
                "kvx_landing_full",
                "Requests' legs written into the pages directly because too little landing memory was free",
                s.landing_full,
            ),
            (
                "kvx_landing_chunks",
                "Chunks copied from landing memory into the pages",
                s.landing_chunks,
            ),
            (
                "kvx_chunk_jobs_dropped",
                "Notifications dropped on a chunk worker: their request ended while they waited, or too many were queued for it",
                s.jobs_dropped,
            ),
            (
                "kvx_abandoned",
                "Requests given up before they were expected, their prefill ranks told",
                s.abandoned,
            ),
            (
                "kvx_probes",
                "Authenticated peers that read this side's Hello and left",
                s.probes,
            ),
        ] {
            out.add(name, help, base(), Counter(v));
        }
    }
}

/// The decode side of the engine. Cheap to clone.
#[derive(Clone)]
pub struct DecodeEngine {
    inner: Arc<Inner>,
    local_addr: SocketAddr,
    _tasks: Arc<TaskGuard>,
}

impl std::fmt::Debug for DecodeEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeEngine")
            .field("local_addr", &self.local_addr)
            .finish()
    }
}

struct TaskGuard(Vec<tokio::task::JoinHandle<()>>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

impl DecodeEngine {
    /// Registers `pool`, starts the transport and listens for prefill ranks.
    ///
    /// # Errors
    /// Transport or listener failures, a pool smaller than the layout, or a layout that is not
    /// packed (`KvLayout::packed`: prefill ranks learn only its packed numbers from the Hello).
    pub async fn start(cfg: DecodeConfig, pool: Pool) -> Result<Self, EngineError> {
        Self::start_regions(cfg, vec![pool]).await
    }

    /// [`start`](Self::start) with the pool in several registrations: `pools` split the layout's
    /// buffer into equal, consecutive segments, in order (for a server that keeps one buffer per
    /// layer and per K and V: `2 * layers` pools of one layer's pages each). Prefill ranks learn
    /// every segment's registration and split their writes at segment boundaries.
    ///
    /// # Errors
    /// As [`start`](Self::start); also pools that do not split the layout evenly, or of different
    /// kinds of memory.
    pub async fn start_regions(cfg: DecodeConfig, pools: Vec<Pool>) -> Result<Self, EngineError> {
        let l = &cfg.layout;
        let packed = KvLayout::packed(
            l.first_layer,
            l.num_layers,
            l.regions,
            l.page_bytes,
            l.num_pages,
        );
        if (l.layer_stride, l.region_stride, l.base_offset)
            != (
                packed.layer_stride,
                packed.region_stride,
                packed.base_offset,
            )
        {
            // Prefill ranks rebuild our layout from the Hello's numbers, which describe only a packed
            // one: any other stride or offset would put their writes at the wrong places.
            return Err(EngineError::Config(format!(
                "the decode layout must be packed ([region][layer][page] from offset 0): layer stride {} (packed {}), region stride {} (packed {}), base offset {} (packed 0)",
                l.layer_stride,
                packed.layer_stride,
                l.region_stride,
                packed.region_stride,
                l.base_offset
            )));
        }
        cfg.tp.validate(&cfg.layout)?;
        super::check_heartbeat(cfg.heartbeat)?;
        if cfg.app.len() > crate::control::MAX_APP_INFO {
            return Err(EngineError::Config(format!(
                "the application's part of the Hello is {} bytes, more than {}",
                cfg.app.len(),
                crate::control::MAX_APP_INFO
            )));
        }
        if cfg.stage.size == 0 || cfg.stage.rank >= cfg.stage.size {
            return Err(EngineError::Config(format!(
                "decode PP stage {} is not below its PP size {}",
                cfg.stage.rank, cfg.stage.size
            )));
        }
        if cfg.layout.layers().end > cfg.total_layers {
            return Err(EngineError::Config(format!(
                "the decode layout holds layers {:?}, past the model's {}",
                cfg.layout.layers(),
                cfg.total_layers
            )));
        }
        if cfg
            .token
            .as_ref()
            .is_none_or(crate::control::Secret::is_none)
        {
            tracing::warn!(
                listen = %cfg.listen,
                "no shared secret configured: any process that reaches the control port can write into the KV pool"
            );
        }
        let total: u64 = pools.iter().map(|p| p.desc().len()).sum();
        if total < cfg.layout.buffer_len {
            return Err(EngineError::Config(format!(
                "pool of {total} bytes is smaller than its layout ({} bytes)",
                cfg.layout.buffer_len
            )));
        }
        super::pools::segment(
            cfg.layout.buffer_len,
            pools.len(),
            pools.iter().map(|p| p.desc().len()).min().unwrap_or(0),
        )?;
        let mut state = State {
            tracker: CompletionTracker::new(cfg.tracker.clone()),
            waiters: HashMap::new(),
            requests: HashMap::new(),
            sessions: HashMap::new(),
            names: HashMap::new(),
            next_session: 0,
            owners: super::Recent::default(),
            senders: HashMap::new(),
            next_peer: 1,
            next_claim: 0,
            completed_at: super::Stamps::default(),
            unacked: HashMap::new(),
            held_pages: HashMap::new(),
            released_waiters: HashMap::new(),
            closing: false,
            aux: AuxStore::default(),
            landing: crate::core::ranges::Ranges::new(0),
            grants: HashMap::new(),
            queued: HashMap::new(),
        };
        if cfg.pp_size > 0 {
            let prefill_tp = cfg.prefill_tp.unwrap_or(cfg.tp.size);
            add_session(
                &mut state,
                &cfg,
                DEFAULT_INSTANCE,
                cfg.pp_size,
                prefill_tp,
                Instant::now(),
            )?;
        }
        let inner = Arc::new(Inner {
            state: Mutex::new(state),
            secret: cfg
                .token
                .clone()
                .unwrap_or_else(crate::control::Secret::none),
            cfg,
            counters: Counters::default(),
            timer: Arc::new(tokio::sync::Notify::new()),
            changed: watch::channel(0).0,
            transport: std::sync::OnceLock::new(),
            pool: std::sync::OnceLock::new(),
            landing: std::sync::OnceLock::new(),
            workers: std::sync::OnceLock::new(),
            exported_out_of_band: AtomicBool::new(false),
            pool_safe: AtomicBool::new(false),
            metrics: std::sync::OnceLock::new(),
            register_micros: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&inner);
        let sink: Sink = Arc::new(move |ev| {
            if let Some(inner) = weak.upgrade() {
                inner.on_incoming(ev);
            }
        });
        let transport = inner.cfg.backend.build(sink)?;
        let t0 = Instant::now();
        let _ = inner.pool.set(
            super::pools::Pools::register_blocking(&transport, pools, inner.cfg.layout.buffer_len)
                .await?,
        );
        inner
            .register_micros
            .store(crate::transport::micros_since(t0), Ordering::Relaxed);
        let host = inner
            .pool
            .get()
            .and_then(super::pools::Pools::desc)
            .is_some_and(|d| d.kind() == MemKind::Host);
        let lands = inner.cfg.landing_bytes > 0
            && host
            && transport.kind() == crate::transport::BackendKind::Nixl
            && inner.cfg.tp.mode == control::TpMode::HeadSliced;
        // Workers for the passes over a chunk's bytes this engine makes: copies out of landing
        // memory, hashes of a host pool's pages.
        if lands || (host && inner.cfg.verify_checksums) {
            let weak = Arc::downgrade(&inner);
            let workers = Workers::spawn(
                super::landing::worker_count(),
                "kvx-chunk",
                Arc::new(move |job| {
                    if let Some(inner) = weak.upgrade() {
                        inner.run_chunk_job(job);
                    }
                }),
            )
            .map_err(|e| {
                EngineError::Config(format!("threads for chunk copies and hashes: {e}"))
            })?;
            let _ = inner.workers.set(workers);
        }
        if lands {
            let len = usize::try_from(inner.cfg.landing_bytes)
                .map_err(|_| EngineError::Config("landing_bytes does not fit memory".into()))?;
            let buf = crate::mem::HostBuffer::new(
                len,
                crate::mem::HostOptions {
                    huge_pages: false,
                    prefault: true,
                },
            )
            .map_err(|e| EngineError::Config(format!("landing memory of {len} bytes: {e}")))?;
            let reg =
                crate::transport::Registration::new(&transport, crate::mem::Pool::Owned(buf))?;
            inner.lock().landing =
                crate::core::ranges::Ranges::new(reg.desc().map_or(0, |d| d.len()));
            let _ = inner.landing.set(reg);
        }
        let _ = inner.transport.set(transport);
        if let Some(addr) = inner.cfg.metrics {
            let source: std::sync::Weak<dyn crate::metrics::Source> = Arc::downgrade(&inner) as _;
            let joined = crate::metrics::join(addr, source)
                .await
                .map_err(|e| EngineError::Config(format!("metrics endpoint on {addr}: {e}")))?;
            let _ = inner.metrics.set(joined);
        }
        let listener = Listener::bind(inner.cfg.listen).await?;
        let local_addr = listener.local_addr();
        let accept = tokio::spawn(accept_loop(Arc::downgrade(&inner), listener));
        let timer = tokio::spawn(super::run_timer(
            Arc::downgrade(&inner),
            inner.timer.clone(),
            |i: &Inner| {
                let mut st = i.lock();
                let now = Instant::now();
                st.tracker.handle_timeout(now);
                i.drain(&mut st);
                let acks = i.expire_unacked(&mut st, now);
                let lost = i.expire_lost(&mut st, now);
                let parked = i.unpark(&mut st, now);
                [st.tracker.poll_timeout(), acks, lost, parked]
                    .into_iter()
                    .flatten()
                    .min()
            },
        ));
        Ok(DecodeEngine {
            inner,
            local_addr,
            _tasks: Arc::new(TaskGuard(vec![accept, timer])),
        })
    }

    /// The control-plane address prefill ranks connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// This decode TP rank's rank, size and mapping ([`DecodeConfig::tp`]).
    pub fn tp(&self) -> TpConfig {
        self.inner.cfg.tp
    }

    /// Waits until every PP rank of the default instance is connected and ready, or `timeout`
    /// passes.
    ///
    /// # Errors
    /// [`EngineError::Timeout`].
    ///
    /// # Cancel safety
    /// Cancel-safe: it only watches.
    pub async fn wait_for_ranks(&self, timeout: Duration) -> Result<(), EngineError> {
        self.wait_for_instance(DEFAULT_INSTANCE, timeout).await
    }

    /// Waits until every PP rank of `instance` is connected and ready, or `timeout` passes.
    ///
    /// # Errors
    /// [`EngineError::Timeout`]; [`EngineError::Config`] for an instance never added.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only watches.
    pub async fn wait_for_instance(
        &self,
        instance: &str,
        timeout: Duration,
    ) -> Result<(), EngineError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changes = self.inner.changed.subscribe();
        loop {
            {
                let st = self.inner.lock();
                let id = st
                    .session_named(instance)
                    .ok_or_else(|| unknown_instance(instance))?;
                if st
                    .sessions
                    .get(&id)
                    .is_some_and(|s| s.first_absent().is_none())
                {
                    return Ok(());
                }
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(EngineError::Shutdown),
                Err(_) => {
                    return Err(EngineError::Timeout(format!(
                        "the prefill ranks of instance {instance:?} did not all connect"
                    )));
                }
            }
        }
    }

    /// Adds prefill instance `instance`, a pipeline of `pp_size` ranks: its ranks may connect
    /// (their Hello names the instance) and requests may be expected from it
    /// ([`expect_request`](Self::expect_request)). Adding an instance again with the same PP size
    /// is a no-op (and takes back a [`remove_instance`](Self::remove_instance) whose ranks are
    /// still there).
    ///
    /// # Errors
    /// [`EngineError::Config`] for a PP size of 0 or another PP size than the instance has;
    /// [`EngineError::Shutdown`] once [`shutdown`](Self::shutdown) began.
    pub fn add_instance(
        &self,
        instance: &str,
        pp_size: u16,
        tp_size: u16,
    ) -> Result<(), EngineError> {
        if pp_size == 0 || tp_size == 0 {
            return Err(EngineError::Config(
                "an instance needs at least one PP and one TP rank".into(),
            ));
        }
        let mut st = self.inner.lock();
        if st.closing {
            return Err(EngineError::Shutdown);
        }
        match st.session_named(instance) {
            Some(id) => {
                let s = st.sessions.get_mut(&id).ok_or(EngineError::Shutdown)?;
                if (s.pp_size, s.prefill_tp) != (pp_size, tp_size) {
                    return Err(EngineError::Config(format!(
                        "prefill instance {instance:?} has PP size {} and TP size {}, not {pp_size} and {tp_size}",
                        s.pp_size, s.prefill_tp
                    )));
                }
                s.leaving = false;
            }
            None => {
                add_session(
                    &mut st,
                    &self.inner.cfg,
                    instance,
                    pp_size,
                    tp_size,
                    Instant::now(),
                )?;
                tracing::info!(instance, pp_size, tp_size, "prefill instance added");
            }
        }
        Ok(())
    }

    /// Stops serving prefill instance `instance` (it left the deployment): its live and waiting
    /// requests fail (`Aborted`; its ranks are told), no new request may be expected from it, and
    /// its ranks are sent Close. Its state is forgotten once none of its ranks is connected and
    /// none of its failed requests still holds pages (their ranks confirm, or their connections
    /// end: with their Close, or without it and the bound after it passed). Other instances are
    /// not touched. Returns whether the instance was served.
    pub fn remove_instance(&self, instance: &str) -> bool {
        let mut st = self.inner.lock();
        let Some(id) = st.session_named(instance) else {
            return false;
        };
        let parked = match st.sessions.get_mut(&id) {
            Some(s) => {
                s.leaving = true;
                std::mem::take(&mut s.parked)
            }
            None => return false,
        };
        for p in parked {
            self.inner
                .fail_unlaunched(&mut st, p.request, FailureReason::Aborted);
        }
        let live: Vec<RequestId> = st
            .requests
            .iter()
            .filter(|(_, r)| r.session == id)
            .map(|(r, _)| *r)
            .collect();
        for request in live {
            let _ = st.tracker.abort(request);
        }
        self.inner.drain(&mut st);
        if let Some(s) = st.sessions.get(&id) {
            for r in s.ranks.iter().flatten() {
                let _ = r.writer.send(Msg::Close);
            }
        }
        st.forget_if_left(id);
        drop(st);
        self.inner.timer.notify_one();
        true
    }

    /// The prefill instances the engine serves, with their PP sizes.
    pub fn instances(&self) -> Vec<(String, u16)> {
        let st = self.inner.lock();
        let mut out: Vec<(String, u16)> = st
            .sessions
            .values()
            .filter(|s| !s.leaving)
            .map(|s| (s.name.clone(), s.pp_size))
            .collect();
        out.sort();
        out
    }

    /// Every prefill rank connected now over a control connection and not evicted, as
    /// `(instance, PP rank, incarnation)`: what an outside liveness signal may find gone (where
    /// several prefill TP ranks write into this decode TP rank, a PP rank is listed once per
    /// start).
    pub fn connected_ranks(&self) -> Vec<(String, u16, u64)> {
        let st = self.inner.lock();
        let mut out: Vec<(String, u16, u64)> = st
            .sessions
            .values()
            .flat_map(|s| {
                s.ranks.iter().enumerate().filter_map(|(slot, r)| {
                    r.as_ref()
                        .filter(|r| !r.external && !r.evicted)
                        .map(|r| (s.name.clone(), s.pp_rank_of(slot as u16), r.incarnation))
                })
            })
            .collect();
        out.sort();
        out
    }

    /// Asks every prefill rank for `request`'s KV, to be written into `dst_pages` of the pool (one
    /// page index per page of the prompt), and returns a future that resolves once the request is
    /// complete or failed. `timeout` bounds the whole transfer.
    ///
    /// The pages belong to the transfer until the future resolves, and `expect` refuses them to any
    /// other request meanwhile. A `Failed` outcome normally resolves only once every connected rank
    /// confirmed that none of its writes into the pages still runs (its AbortAck, or its connection
    /// ended). If a rank does not confirm within `abort_ack_timeout`, the outcome resolves anyway
    /// and the pages stay **quarantined**: [`quarantined`](Self::quarantined) lists such requests,
    /// `expect` keeps refusing their pages, and [`released`](Self::released) resolves once the late
    /// confirmation (or the rank's disconnection) makes them safe.
    ///
    /// While a rank is not connected and ready (it died and has not come back, or was evicted),
    /// the request holds its pages and waits for it, at most [`DecodeConfig::rank_wait`] and at
    /// most `timeout`; no rank is asked for it meanwhile. Then it fails with
    /// [`FailureReason::RankUnavailable`] naming the lowest absent rank.
    ///
    /// # Errors
    /// A request id already tracked, a page list that does not fit the prompt or the pool, a page
    /// another request holds ([`EngineError::PageHeld`]), or [`EngineError::Shutdown`] once
    /// [`shutdown`](Self::shutdown) began.
    ///
    /// # Cancel safety
    /// The returned future may be dropped: the request stays tracked until it ends (or
    /// [`abort`](Self::abort)); its outcome is then counted and dropped.
    pub fn expect(
        &self,
        request: RequestId,
        prompt_tokens: u32,
        chunk_tokens: u32,
        dst_pages: Vec<u32>,
        timeout: Duration,
    ) -> Result<impl std::future::Future<Output = Outcome> + Send + 'static, EngineError> {
        self.expect_after_prefix(request, 0, prompt_tokens, chunk_tokens, dst_pages, timeout)
    }

    /// [`expect`](Self::expect) for a request whose first `prefix_tokens` tokens this side already
    /// holds (a prefix cache of the server's own): the ranks are asked for the `prompt_tokens`
    /// tokens after them, into `dst_pages` (one page per page of those tokens), and told the
    /// prefix, so they send from that token on. The prefix is whole pages.
    ///
    /// # Errors
    /// As [`expect`](Self::expect); [`EngineError::Config`] for a prefix that is not whole pages.
    pub fn expect_after_prefix(
        &self,
        request: RequestId,
        prefix_tokens: u32,
        prompt_tokens: u32,
        chunk_tokens: u32,
        dst_pages: Vec<u32>,
        timeout: Duration,
    ) -> Result<impl std::future::Future<Output = Outcome> + Send + 'static, EngineError> {
        self.expect_request(
            request,
            Expected {
                instance: DEFAULT_INSTANCE.into(),
                prefix_tokens,
                prompt_tokens,
                chunk_tokens,
                dst_pages,
                timeout,
            },
        )
    }

    /// [`expect`](Self::expect) from the ranks of prefill instance `want.instance` (added with
    /// [`add_instance`](Self::add_instance)), after `want.prefix_tokens` this side holds: only
    /// that instance's ranks are asked, and only their notifications count for the request.
    ///
    /// # Errors
    /// As [`expect_after_prefix`](Self::expect_after_prefix); [`EngineError::Config`] for an
    /// instance never added or being removed.
    pub fn expect_request(
        &self,
        request: RequestId,
        want: Expected,
    ) -> Result<impl std::future::Future<Output = Outcome> + Send + 'static, EngineError> {
        let Expected {
            instance,
            prefix_tokens,
            prompt_tokens,
            chunk_tokens,
            dst_pages,
            timeout,
        } = want;
        // One span per request, from here to its outcome (the future's end): what a trace
        // follows. `outcome` is recorded when it is known.
        let span = tracing::info_span!(
            "kvx.request",
            request = request.0,
            role = "decode",
            instance = %instance,
            prompt_tokens,
            outcome = tracing::field::Empty,
        );
        let _in = span.enter();
        let cfg = &self.inner.cfg;
        let geometry = ChunkGeometry::after_prefix(
            u64::from(prompt_tokens),
            u64::from(chunk_tokens),
            u64::from(cfg.page_tokens),
            u64::from(prefix_tokens),
        )
        .map_err(|source| EngineError::Plan {
            request: Some(request),
            source,
        })?;
        let check = TransferRequest {
            request: request.0,
            prompt_tokens,
            chunk_tokens,
            dst_pages: dst_pages.clone(),
            prefix_tokens,
            deadline_ms: 0,
            landing: None,
        };
        control::validate_transfer_request(
            &check,
            cfg.layout.num_pages,
            geometry.num_pages() as usize,
        )
        .and_then(|()| control::validate_prefix(&check, cfg.page_tokens))
        .map_err(|e| EngineError::Config(e.to_string()))?;
        let now = Instant::now();
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.inner.lock();
            if st.closing {
                return Err(EngineError::Shutdown);
            }
            let session = st
                .session_named(&instance)
                .filter(|id| st.sessions.get(id).is_some_and(|s| !s.leaving))
                .ok_or_else(|| unknown_instance(&instance))?;
            // A failed request's id stays taken while its pages are held (its outcome may still be
            // on its way), whatever the tracker has forgotten.
            if st.unacked.contains_key(&request) || st.waiters.contains_key(&request) {
                return Err(EngineError::Tracker(format!(
                    "request {} is still held by the engine",
                    request.0
                )));
            }
            if let Some((&page, &by)) = dst_pages
                .iter()
                .find_map(|p| st.held_pages.get_key_value(p))
            {
                return Err(EngineError::PageHeld { page, by });
            }
            let deadline = now + timeout;
            for &p in &dst_pages {
                st.held_pages.insert(p, request);
            }
            st.owners.record(request, session);
            st.requests.insert(
                request,
                ReqInfo {
                    session,
                    geometry,
                    dst_pages: Arc::new(dst_pages),
                    prefix_tokens,
                    started: now,
                    last_posted_us: None,
                },
            );
            st.waiters.insert(request, tx);
            let serving = st
                .sessions
                .get(&session)
                .is_some_and(|s| s.first_absent().is_none());
            if serving {
                let launched =
                    self.inner
                        .launch(&mut st, request, prompt_tokens, chunk_tokens, now, deadline);
                if let Err(e) = launched {
                    st.waiters.remove(&request);
                    if let Some(info) = st.requests.remove(&request) {
                        release_pages(&mut st, request, &info.dst_pages);
                    }
                    return Err(e);
                }
            } else {
                // A rank is away (dead, restarting): the request waits for it, pages held.
                let wait_until = now + self.inner.cfg.rank_wait.min(timeout);
                if let Some(s) = st.sessions.get_mut(&session) {
                    s.parked.push_back(Parked {
                        request,
                        prompt_tokens,
                        chunk_tokens,
                        deadline,
                        wait_until,
                    });
                }
            }
            self.inner.drain(&mut st);
        }
        self.inner.timer.notify_one();
        drop(_in);
        let traced = span.clone();
        let ended = async move {
            let outcome = rx.await.unwrap_or(Outcome::Failed(FailureReason::Aborted));
            match &outcome {
                Outcome::Complete => traced.record("outcome", "complete"),
                Outcome::Failed(reason) => traced.record("outcome", tracing::field::debug(reason)),
            };
            outcome
        };
        Ok(tracing::Instrument::instrument(ended, span))
    }

    /// Gives up `request` of prefill instance `instance` before it was expected (the server
    /// dropped it while it waited for pages, say): every connected rank of the instance is told,
    /// as for an abort, so a prefill rank that holds the request, or waits for its allocation,
    /// decides it failed now instead of at its own deadline. Nothing of the request is held here,
    /// so nothing waits for their confirmations (which are taken as this instance's). A request
    /// that was expected is aborted ([`abort`](Self::abort)); one that failed already is left as it
    /// is, its ranks told then.
    ///
    /// # Errors
    /// The engine is shut down, does not serve `instance`, or holds `request` for another
    /// instance.
    pub fn abandon(&self, request: RequestId, instance: &str) -> Result<(), EngineError> {
        let mut st = self.inner.lock();
        if st.closing {
            return Err(EngineError::Shutdown);
        }
        let session = st
            .session_named(instance)
            .ok_or_else(|| unknown_instance(instance))?;
        // An id held for another instance is that instance's request: not ours to end.
        let held_by = st
            .requests
            .get(&request)
            .map(|r| r.session)
            .or_else(|| st.unacked.get(&request).map(|u| u.session));
        match held_by {
            Some(s) if s != session => {
                return Err(EngineError::Config(format!(
                    "request {} belongs to another prefill instance than {instance:?}",
                    request.0
                )));
            }
            // Expected: aborted as any request. Failed already: its ranks were told then.
            Some(_) => {
                let live = st.requests.contains_key(&request);
                drop(st);
                if live {
                    self.abort(request);
                }
                return Ok(());
            }
            None if st.waiters.contains_key(&request) => return Ok(()),
            None => {}
        }
        // Their AbortAcks are about this instance's request, not strays to count as refused
        // (an id another instance used lately keeps its owner).
        if st.owners.get(request).is_none() {
            st.owners.record(request, session);
        }
        let msg = Msg::Abort(control::Abort {
            request: request.0,
            reason: FailureCode::Aborted.raw(),
        });
        let told = st.sessions.get(&session).map_or(0, |s| {
            s.ranks
                .iter()
                .flatten()
                .filter(|r| !r.external && r.writer.send(msg.clone()).is_ok())
                .count()
        });
        self.inner
            .counters
            .abandoned
            .fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            request = request.0,
            instance,
            told,
            "request given up before it was expected"
        );
        Ok(())
    }

    /// Aborts `request`: it fails with `Aborted` (if it had not ended) and every prefill rank is told.
    pub fn abort(&self, request: RequestId) {
        let mut st = self.inner.lock();
        let session = st.requests.get(&request).map(|r| r.session);
        let parked = session
            .and_then(|id| st.sessions.get_mut(&id))
            .and_then(|s| {
                let at = s.parked.iter().position(|p| p.request == request)?;
                s.parked.remove(at)
            });
        if parked.is_some() {
            // No rank was asked for it: nobody to tell, nothing can have been written.
            self.inner
                .fail_unlaunched(&mut st, request, FailureReason::Aborted);
            return;
        }
        // The ranks are told by `drain`, as for every other failure.
        let _ = st.tracker.abort(request);
        self.inner.drain(&mut st);
    }

    /// Failed requests whose pages are quarantined: a rank did not confirm, within
    /// `abort_ack_timeout`, that its writes into them are over. Their pages are not reusable until
    /// [`released`](Self::released) resolves.
    pub fn quarantined(&self) -> Vec<RequestId> {
        let st = self.inner.lock();
        st.unacked
            .iter()
            .filter(|(_, u)| u.outcome.is_none())
            .map(|(r, _)| *r)
            .collect()
    }

    /// Tells the engine that `rank` has stopped writing into `request`'s pages for good, for ranks
    /// that cannot say so themselves (bound with [`bind_external_rank`](Self::bind_external_rank):
    /// the server learned it out of band, for instance from SGLang's abort acknowledgement). Once
    /// every rank of a failed request is confirmed, its pages are released. Confirming a rank that
    /// may still write lets a new request's pages receive its late bytes.
    pub fn confirm_stopped(&self, rank: u16, request: RequestId) {
        let mut st = self.inner.lock();
        if let Some(session) = st.unacked.get(&request).map(|u| u.session) {
            self.inner.acked(&mut st, session, request, rank, None);
        }
    }

    /// Resolves once no page of `request` is held any more: the request completed, or failed and
    /// every rank confirmed its writes are over: its AbortAck, its Close, the bound after its
    /// connection ended without a Close, or [`confirm_stopped`](Self::confirm_stopped). At once for a request the engine does
    /// not hold.
    ///
    /// # Cancel safety
    /// Cancel-safe.
    pub fn released(
        &self,
        request: RequestId,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let rx = {
            let mut st = self.inner.lock();
            if st.may_be_written(request) {
                let (tx, rx) = oneshot::channel();
                let waiters = st.released_waiters.entry(request).or_default();
                // Waiters that gave up (a dropped future) go as new ones come.
                waiters.retain(|w| !w.is_closed());
                waiters.push(tx);
                Some(rx)
            } else {
                None
            }
        };
        async move {
            if let Some(rx) = rx {
                let _ = rx.await;
            }
        }
    }

    /// Whether [`released`](Self::released) would resolve at once: no write of `request`'s ranks
    /// can still land in its pages (true for a request the engine does not hold). Registers
    /// nothing, so a caller may ask on every pass of its loop.
    pub fn is_released(&self, request: RequestId) -> bool {
        !self.inner.lock().may_be_written(request)
    }

    /// Stops the engine and decides whether its pool may be freed.
    ///
    /// Every live request fails (`Aborted`, its ranks are told), no new request is accepted, and
    /// every connected rank is sent Close. A prefill rank answers Close with its own Close once none
    /// of its writes into the pool still runs and it will post no more. The pool is freed (when the
    /// last handle to the engine is dropped) only if every rank confirmed or its connection ended
    /// before `timeout`; otherwise it is leaked, and counted in
    /// [`leaked_pools`](crate::transport::leaked_pools), since a write could still land in it. An
    /// engine dropped without `shutdown` leaks its pool the same way once a peer could have learned
    /// its address.
    ///
    /// # Cancel safety
    /// Cancel-safe in effect: dropping the future leaves the engine closing and its pool leaked.
    pub async fn shutdown(self, timeout: Duration) -> ShutdownReport {
        let deadline = tokio::time::Instant::now() + timeout;
        // (session, its name, rank) of every rank asked to close.
        let mut pending: Vec<(SessionId, String, u16)> = Vec::new();
        let mut unconfirmed = Vec::new();
        let mut changes = self.inner.changed.subscribe();
        {
            let mut st = self.inner.lock();
            st.closing = true;
            let parked: Vec<Parked> = st
                .sessions
                .values_mut()
                .flat_map(|s| std::mem::take(&mut s.parked))
                .collect();
            for p in parked {
                self.inner
                    .fail_unlaunched(&mut st, p.request, FailureReason::Aborted);
            }
            let live: Vec<RequestId> = st.requests.keys().copied().collect();
            for request in live {
                let _ = st.tracker.abort(request);
            }
            self.inner.drain(&mut st);
            for (&id, s) in &st.sessions {
                for (rank, r) in s.ranks.iter().enumerate() {
                    if let Some(r) = r {
                        // An external rank's channel has no reader: it cannot confirm anything.
                        if r.writer.send(Msg::Close).is_ok() {
                            pending.push((id, s.name.clone(), rank as u16));
                        } else {
                            unconfirmed.push((s.name.clone(), rank as u16));
                        }
                    }
                }
            }
        }
        let still_there = |st: &State, id: SessionId, rank: u16| {
            st.sessions.get(&id).and_then(|s| s.rank(rank)).is_some()
        };
        loop {
            let waiting = {
                let st = self.inner.lock();
                pending.iter().any(|(id, _, r)| still_there(&st, *id, *r))
            };
            if !waiting {
                break;
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => break,
            }
        }
        let (mut confirmed, mut gone) = (Vec::new(), Vec::new());
        {
            let st = self.inner.lock();
            for (id, name, r) in pending {
                if still_there(&st, id, r) {
                    unconfirmed.push((name, r));
                } else if st
                    .sessions
                    .get(&id)
                    .is_some_and(|s| s.closed_ranks.contains(&r))
                {
                    confirmed.push((name, r));
                } else {
                    gone.push((name, r));
                }
            }
        }
        // Pages held for a rank whose connection ended without its Close come back at its bound:
        // wait for that, within the deadline.
        loop {
            let held = {
                let st = self.inner.lock();
                st.unacked.values().any(|u| {
                    st.sessions.get(&u.session).is_some_and(|s| {
                        s.lost.iter().any(|l| {
                            l.until.is_some() && u.external.contains(&(l.rank, Some(l.peer)))
                        })
                    })
                })
            };
            if !held {
                break;
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => break,
            }
        }
        let out_of_band = self.inner.exported_out_of_band.load(Ordering::Acquire);
        // A request still held (quarantined) waits for a rank that may still write into its pages:
        // one whose connection was cut by tampering or silence, or that never confirmed.
        let quarantined = !self.inner.lock().unacked.is_empty();
        let pool_freed = unconfirmed.is_empty() && !out_of_band && !quarantined;
        if pool_freed {
            self.inner.pool_safe.store(true, Ordering::Release);
        } else {
            tracing::warn!(
                ?unconfirmed,
                quarantined,
                "ranks did not confirm shutdown, or requests stay quarantined: the KV pool will be leaked"
            );
        }
        ShutdownReport {
            confirmed,
            gone,
            unconfirmed,
            pool_freed,
        }
    }

    /// Counters.
    pub fn stats(&self) -> DecodeStats {
        self.inner.stats()
    }

    /// The address of the metrics endpoint this engine reports to, if its config asked for one
    /// (the bound port where it asked for port 0).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.inner.metrics.get().map(crate::metrics::Joined::addr)
    }

    /// An outside liveness signal says that start `incarnation` of `rank` is gone (its etcd lease
    /// ended: the process died, or is stopped with its sockets open). If that start is connected,
    /// its live requests fail with `PeerLost` at once, even those whose delivered chunks still
    /// wait on a chunk worker (their outcomes do not wait for its confirmation), every rank is
    /// told, and requests wait for the rank as for an absent one.
    /// Its connection stays open: a stopped process may still write when it resumes, so the
    /// failed requests' pages stay quarantined until it confirms (its AbortAck) or its connection
    /// ends (with its Close; without, they wait the bound after the end as well), and the same start may be readmitted. A later start of the rank is admitted at once in
    /// its place: the evicted start's connection is then cut, and its failed requests' pages stay
    /// quarantined for good (nothing of it can confirm any more). `rank` is the PP rank; where
    /// several prefill TP ranks write into this decode TP rank, the start tells which of them.
    /// Returns whether the rank was evicted now.
    pub fn evict(&self, rank: u16, incarnation: u64) -> bool {
        self.evict_in(DEFAULT_INSTANCE, rank, incarnation)
    }

    /// [`evict`](Self::evict) for a rank of prefill instance `instance`.
    pub fn evict_in(&self, instance: &str, rank: u16, incarnation: u64) -> bool {
        let mut st = self.inner.lock();
        let Some(id) = st.session_named(instance) else {
            return false;
        };
        let Some(s) = st.sessions.get_mut(&id) else {
            return false;
        };
        // PP rank `rank`'s source of that start (several prefill TP ranks may write into this
        // decode TP rank; on a pipelined decode, slots count from its stage's rank).
        let Some(slot) = s.slot_of_start(rank, incarnation) else {
            return false;
        };
        let Some(r) = s.rank_mut(slot) else {
            return false;
        };
        if r.evicted || r.external {
            return false;
        }
        r.evicted = true;
        let peer = r.peer;
        let now = Instant::now();
        absence_begins(s, now);
        // At once, not behind the requests' queued chunks (as for a rank cut for tampering): a
        // later start may take the slot before those chunks are done, and a failure that came
        // after that would no longer find this start in the slot, marked evicted, and would hand
        // back pages it may still write into when it resumes.
        let _ = st.tracker.handle_peer_lost(now, peer);
        self.inner.drain(&mut st);
        drop(st);
        self.inner.changed.send_modify(|n| *n += 1);
        self.inner.timer.notify_one();
        true
    }

    /// Undoes [`evict`](Self::evict) for the same start of `rank` (it registered again: it was
    /// stopped, not dead, or etcd lost its record). Returns whether it was readmitted now.
    pub fn readmit(&self, rank: u16, incarnation: u64) -> bool {
        self.readmit_in(DEFAULT_INSTANCE, rank, incarnation)
    }

    /// [`readmit`](Self::readmit) for a rank of prefill instance `instance`.
    pub fn readmit_in(&self, instance: &str, rank: u16, incarnation: u64) -> bool {
        let mut st = self.inner.lock();
        let Some(id) = st.session_named(instance) else {
            return false;
        };
        let Some(s) = st.sessions.get_mut(&id) else {
            return false;
        };
        let Some(r) = s
            .slot_of_start(rank, incarnation)
            .and_then(|slot| s.rank_mut(slot))
        else {
            return false;
        };
        if !r.evicted {
            return false;
        }
        r.evicted = false;
        let now = Instant::now();
        absence_ends(s, now);
        self.inner.unpark(&mut st, now);
        drop(st);
        self.inner.changed.send_modify(|n| *n += 1);
        self.inner.timer.notify_one();
        true
    }

    /// The times at least one PP rank of the default instance was not connected and ready,
    /// oldest first (the last 1024; the first from the engine's start until every rank was
    /// there). A server or benchmark can tell failures a rank's absence explains from others
    /// with [`Absence::overlaps`].
    pub fn absences(&self) -> Vec<Absence> {
        self.absences_of(DEFAULT_INSTANCE)
    }

    /// [`absences`](Self::absences) of prefill instance `instance` (none for an unknown one).
    pub fn absences_of(&self, instance: &str) -> Vec<Absence> {
        let st = self.inner.lock();
        st.session_named(instance)
            .and_then(|id| st.sessions.get(&id))
            .map(|s| s.absences.iter().copied().collect())
            .unwrap_or_default()
    }

    /// When the tracker saw `request` complete (on the transport's progress thread, as the last
    /// notification was handled), for latency measurements; taken once, kept for the last 4096.
    pub fn completed_at(&self, request: RequestId) -> Option<Instant> {
        self.inner.lock().completed_at.take(request)
    }

    /// The payload PP rank `rank` sent beside its pages of `request` (its `send_aux`), taken once.
    /// A rank sends it before its last chunk, over the control connection, so it can arrive a moment
    /// after the request completed. At most 4096 payloads (32 MiB) are kept: past that the oldest
    /// of the prefill instance that holds the most go ([`DecodeStats::aux_dropped`]).
    pub fn aux(&self, request: RequestId, rank: u16) -> Option<Vec<u8>> {
        self.inner.lock().aux.take((request, rank))
    }

    /// The tracker's own counters (duplicates, late, unknown, violations...).
    pub fn tracker_counters(&self) -> crate::core::tracker::Counters {
        self.inner.lock().tracker.counters()
    }

    /// Copies `dst.len()` bytes at `offset` out of the pool (host pools), for callers that verify
    /// what arrived. Read a request's pages after its outcome resolved: before that, its ranks may
    /// still be writing them.
    ///
    /// # Errors
    /// [`EngineError::Memory`] for a range outside the pool or a device pool.
    pub fn read_pool(&self, offset: u64, dst: &mut [u8]) -> Result<(), EngineError> {
        let pool = self.inner.pool.get().ok_or(EngineError::Shutdown)?;
        Ok(pool.read_at(offset, dst)?)
    }

    /// Copies `src` into the pool at `offset` (host pools), for instance to poison pages before
    /// handing them to [`expect`](Self::expect). Write only pages that no live request holds.
    ///
    /// # Errors
    /// [`EngineError::Memory`] for a range outside the pool or a device pool.
    pub fn write_pool(&self, offset: u64, src: &[u8]) -> Result<(), EngineError> {
        let pool = self.inner.pool.get().ok_or(EngineError::Shutdown)?;
        Ok(pool.write_at(offset, src)?)
    }

    /// What a prefill that does not speak our control plane needs to write into the pool: the
    /// backend's metadata (UCX worker address or NIXL agent metadata), its name (NIXL agent name) and
    /// the pool's registration.
    ///
    /// # Errors
    /// The transport cannot export its metadata; a pool of several registrations
    /// ([`start_regions`](Self::start_regions)), which this cannot describe.
    pub fn backend_info(
        &self,
    ) -> Result<(Vec<u8>, String, crate::transport::RemoteRegion), EngineError> {
        let t = self.inner.transport.get().ok_or(EngineError::Shutdown)?;
        let pool = self.inner.pool.get().ok_or(EngineError::Shutdown)?;
        let pool = pool.single().ok_or_else(|| {
            EngineError::Config(
                "the pool has several registrations: no single region to export".into(),
            )
        })?;
        self.inner
            .exported_out_of_band
            .store(true, Ordering::Release);
        Ok((t.metadata()?, t.name(), pool.remote().clone()))
    }

    /// Binds PP rank `rank` to a prefill that does not speak our control plane (for instance a
    /// Python NIXL agent sending SGLang's text notifications), identified by how the transport names
    /// its notifications, and holding `src` (its layers). Its notifications then count for that rank
    /// exactly as a connected rank's do; it gets no TransferRequest or Abort messages.
    ///
    /// # Errors
    /// [`EngineError::SenderTaken`] if `sender` already counts for a rank (a second binding would
    /// let one peer's notifications count for another rank); [`EngineError::Config`] if the rank is
    /// out of range or taken; [`EngineError::Plan`] if its layout does not plan against the pool.
    pub fn bind_external_rank(
        &self,
        rank: u16,
        sender: Sender,
        src: &KvLayout,
    ) -> Result<(), EngineError> {
        let planner =
            Planner::new(src, &self.inner.cfg.layout, TpMapping::Identical).map_err(|source| {
                EngineError::Plan {
                    request: None,
                    source,
                }
            })?;
        let mut st = self.inner.lock();
        if st.closing {
            return Err(EngineError::Shutdown);
        }
        if let Some(&(_, bound, _)) = st.senders.get(&sender) {
            return Err(EngineError::SenderTaken {
                sender,
                rank: bound,
            });
        }
        let id = st
            .session_named(DEFAULT_INSTANCE)
            .ok_or_else(|| unknown_instance(DEFAULT_INSTANCE))?;
        match st
            .sessions
            .get(&id)
            .map(|s| (s.ranks.get(usize::from(rank)), s))
        {
            Some((Some(None), s)) => s
                .layers_fit(rank, &src.layers(), &decode_layers(&self.inner.cfg))
                .map_err(EngineError::Config)?,
            Some((Some(Some(_)), _)) => {
                return Err(EngineError::Config(format!("rank {rank} is already bound")));
            }
            _ => {
                return Err(EngineError::Config(format!(
                    "rank {rank} is not below pp_size"
                )));
            }
        }
        // It writes into the pool by what its server learned out of band, and can never confirm
        // at shutdown that its writes are over: from now on the pool is leaked rather than freed,
        // at shutdown and at drop.
        if let Some(pool) = self.inner.pool.get() {
            pool.mark_exported();
        }
        let peer = PeerId(st.next_peer);
        st.next_peer += 1;
        st.senders.insert(sender, (id, rank, peer));
        // Nobody reads this channel: an external rank learns its pages out of band.
        let (tx, _rx) = Outbox::new();
        let now = Instant::now();
        if let Some(s) = st.sessions.get_mut(&id) {
            s.ranks[usize::from(rank)] = Some(RankConn {
                peer,
                writer: tx,
                planner,
                external: true,
                ready: true,
                incarnation: 0,
                evicted: false,
                cut: Arc::new(Notify::new()),
                layers: src.layers(),
            });
            absence_ends(s, now);
        }
        self.inner.unpark(&mut st, now);
        drop(st);
        self.inner.changed.send_modify(|n| *n += 1);
        self.inner.timer.notify_one();
        Ok(())
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock is a bug elsewhere; the tracker's state is still whole
        // (it never panics mid-update), so keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers an expected request with the tracker and asks every rank for it. Every rank must
    /// be connected.
    fn launch(
        &self,
        st: &mut State,
        request: RequestId,
        prompt_tokens: u32,
        chunk_tokens: u32,
        now: Instant,
        deadline: Instant,
    ) -> Result<(), EngineError> {
        let (session, dst_pages, prefix_tokens) = st
            .requests
            .get(&request)
            .map(|r| (r.session, r.dst_pages.clone(), r.prefix_tokens))
            .ok_or_else(|| EngineError::Tracker(format!("request {} is not held", request.0)))?;
        let s = st
            .sessions
            .get(&session)
            .ok_or_else(|| EngineError::Config("the request's prefill instance is gone".into()))?;
        let slots = s.ranks.len() as u16;
        let peers = s
            .ranks
            .iter()
            .map(|r| r.as_ref().filter(|r| r.serving()).map(|r| r.peer))
            .collect::<Option<Vec<PeerId>>>()
            .ok_or_else(|| EngineError::Config("a prefill rank is not connected".into()))?;
        st.tracker
            .expect(now, request, slots, &peers, deadline)
            .map_err(|e| EngineError::Tracker(e.to_string()))?;
        let left = deadline.saturating_duration_since(now);
        let msg = TransferRequest {
            request: request.0,
            prompt_tokens,
            chunk_tokens,
            dst_pages: dst_pages.to_vec(),
            prefix_tokens,
            deadline_ms: left.as_millis().min(u128::from(u32::MAX)) as u32,
            landing: None,
        };
        let grants = self.grant_landing(st, session, request);
        if let Some(s) = st.sessions.get(&session) {
            for (slot, r) in s.ranks.iter().enumerate() {
                let Some(r) = r else { continue };
                let landing = grants
                    .iter()
                    .find(|g| usize::from(g.slot) == slot)
                    .map(|g| g.landing);
                let _ = r.writer.send(Msg::TransferRequest(TransferRequest {
                    landing,
                    ..msg.clone()
                }));
            }
        }
        // A request is asked for once (`expect` refuses an id it holds; a parked one is launched
        // once), so it holds no ranges yet.
        if !grants.is_empty() {
            st.grants.insert(request, grants);
        }
        Ok(())
    }

    /// Lends landing memory to each rank of `session` whose rows would land strided in
    /// `request`'s pages, where enough is free: a range of one stride per chunk, the stride the
    /// largest chunk's bytes.
    fn grant_landing(&self, st: &mut State, session: SessionId, request: RequestId) -> Vec<Grant> {
        if self.landing.get().is_none() {
            return Vec::new();
        }
        let (Some(info), Some(s)) = (st.requests.get(&request), st.sessions.get(&session)) else {
            return Vec::new();
        };
        let chunks = info.geometry.num_chunks();
        let mut wanted = Vec::new();
        for (slot, r) in s.ranks.iter().enumerate() {
            let Some(r) = r.as_ref().filter(|r| !r.external) else {
                continue;
            };
            let src = stand_in_src(&r.planner, info);
            let (mut stride, mut strided) = (0u64, false);
            let mut writes = Vec::new();
            for chunk in 0..chunks {
                writes.clear();
                if r.planner
                    .plan_chunk(&info.geometry, chunk, &src, &info.dst_pages, &mut writes)
                    .is_err()
                {
                    strided = false;
                    break;
                }
                strided |= writes.iter().any(|w| w.rows > 1 && w.dst_stride != w.len);
                stride = stride.max(writes.iter().map(|w| w.bytes()).sum());
            }
            if strided && stride > 0 {
                wanted.push((slot as u16, stride.next_multiple_of(64)));
            }
        }
        let mut grants = Vec::with_capacity(wanted.len());
        // Ranges for `landing_slots` chunks, or for one where those do not fit.
        let most = u32::try_from(chunks)
            .unwrap_or(u32::MAX)
            .min(self.cfg.landing_slots.max(1));
        for (slot, stride) in wanted {
            let taken = [most, 1].into_iter().find_map(|slots| {
                let len = stride.checked_mul(u64::from(slots))?;
                Some((st.landing.take(len)?, slots))
            });
            match taken {
                Some((offset, slots)) => {
                    self.counters.landing_grants.fetch_add(1, Ordering::Relaxed);
                    grants.push(Grant {
                        slot,
                        landing: control::Landing {
                            offset,
                            chunk_stride: stride,
                            slots,
                        },
                        landed: ChunkSet::new(u32::try_from(chunks).unwrap_or(u32::MAX)),
                    });
                }
                None => {
                    self.counters.landing_full.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        grants
    }

    /// Plans the copy of chunk `n` of `rank` out of its landing range `g` into the request's pages:
    /// `None` where there is nothing to copy (a request or rank gone, a chunk the request does not
    /// have: the tracker refuses its notification), [`Planned::TooLarge`] where the chunk does not
    /// fit its stride (the ranges are the engine's own and the planner's, so only a bug does that).
    fn plan_landing(
        &self,
        st: &State,
        session: SessionId,
        rank: u16,
        n: &notify::ChunkNotification,
        g: control::Landing,
    ) -> Option<Planned> {
        let (info, conn) = (
            st.requests.get(&n.request)?,
            st.sessions.get(&session).and_then(|s| s.rank(rank))?,
        );
        self.pool.get()?;
        self.landing.get()?;
        let writes = chunk_writes(conn, info, n.chunk_id).ok()?;
        let total: u64 = writes.iter().map(|w| w.bytes()).sum();
        let from = g
            .chunk_stride
            .checked_mul(u64::from(n.chunk_id % g.slots.max(1)))
            .and_then(|o| o.checked_add(g.offset))
            .filter(|_| total <= g.chunk_stride);
        Some(match from {
            Some(from) => Planned::Copy(LandingCopy {
                from,
                writes,
                tell: u64::from(g.slots) < info.geometry.num_chunks(),
                checksum: n.checksum.filter(|_| self.cfg.verify_checksums),
            }),
            None => Planned::TooLarge,
        })
    }

    /// Copies a planned chunk out of landing memory into its request's pages, piece by piece under
    /// the request's gate, without the engine's lock.
    fn copy_landed(&self, c: &LandingCopy, gate: &Gate) -> Copied {
        let (Some(pool), Some(landing)) = (self.pool.get(), self.landing.get()) else {
            return Copied::Failed;
        };
        // The landing range holds the chunk's rows back to back, in plan order.
        let mut at = c.from;
        for w in &c.writes {
            for p in landing_pieces(w.len, w.rows) {
                let (from, dst) = (
                    at + p.row * w.len + p.skip,
                    w.dst_offset + p.row * w.dst_stride + p.skip,
                );
                let mut copied = Ok(());
                let went = gate.run(|| {
                    copied = match pool.single() {
                        // One registration: the piece's rows in one call.
                        Some(reg) => {
                            landing.copy_rows_to(from, reg, dst, p.len, p.rows, w.dst_stride)
                        }
                        None => (0..p.rows).try_for_each(|i| {
                            pool.copy_from(dst + i * w.dst_stride, landing, from + i * w.len, p.len)
                        }),
                    };
                });
                if !went {
                    return Copied::Revoked;
                }
                if copied.is_err() {
                    return Copied::Failed;
                }
            }
            at += w.bytes();
        }
        Copied::Done
    }

    /// Fails `n`'s request (`Aborted`) for a bug of ours in moving its chunk out of landing memory,
    /// logged with `why`.
    fn landing_bug(&self, st: &mut State, n: &notify::ChunkNotification, why: &str) {
        tracing::error!(
            request = n.request.0,
            rank = n.pp_rank,
            chunk = n.chunk_id,
            "{why}"
        );
        let _ = st.tracker.fail(n.request, FailureReason::Aborted);
        self.drain(st);
    }

    /// Runs a queued notification on a chunk worker: its chunk's copy out of landing memory or its
    /// hash (where it has either) without the engine's lock, then, under it, what the progress
    /// thread does for any notification.
    fn run_chunk_job(&self, job: ChunkJob) {
        let _over = JobOver(&self.counters.jobs_queued);
        if let Some(hook) = &self.cfg.chunk_job_hook {
            (hook.0)(job.request);
        }
        let (copied, hashed) = match &job.what {
            Job::Chunk {
                work: Work::Copy(c),
                ..
            } => {
                let copied = self.copy_landed(c, &job.gate);
                // Hashed from the pages as any chunk is, with the copy's plan.
                let hashed = match copied {
                    Copied::Done => c
                        .checksum
                        .map(|sum| self.hash_pages(&c.writes) == Some(sum)),
                    _ => None,
                };
                (Some(copied), hashed)
            }
            // Read only: pages released meanwhile (and written by someone else) give a hash that
            // is dropped below with the job.
            Job::Chunk {
                work: Work::Hash { writes, sum },
                ..
            } => (None, Some(self.hash_pages(writes) == Some(*sum))),
            Job::Chunk {
                work: Work::Count, ..
            }
            | Job::PeerLost => (None, None),
        };
        let mut st = self.lock();
        if let Some(q) = st.queued.get_mut(&job.request)
            && Arc::ptr_eq(&q.gate, &job.gate)
        {
            q.queued = q.queued.saturating_sub(1);
            if matches!(job.what, Job::Chunk { .. }) {
                q.notifications = q.notifications.saturating_sub(1);
            }
            if q.queued == 0 {
                st.queued.remove(&job.request);
            }
        }
        if job.gate.revoked() || matches!(copied, Some(Copied::Revoked)) {
            // The request ended while this waited (revocation happens under the engine's lock, so
            // this answer holds while we hold it): its id may name a new request by now, which
            // nothing of this one may touch.
            if matches!(job.what, Job::Chunk { .. }) {
                self.counters.jobs_dropped.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        let (n, work) = match job.what {
            Job::Chunk { n, work } => (n, work),
            Job::PeerLost => {
                let request = job.request;
                st.tracker
                    .handle_peer_lost_in(job.now, job.peer, |id| id == request);
                self.drain(&mut st);
                return;
            }
        };
        match copied {
            Some(Copied::Failed) => {
                self.landing_bug(&mut st, &n, "copy from landing memory failed");
                return;
            }
            Some(Copied::Done) => {
                self.counters.landing_chunks.fetch_add(1, Ordering::Relaxed);
                // The range is free for the chunk that reuses it: the rank waits for this word.
                if matches!(&work, Work::Copy(c) if c.tell)
                    && let Some(conn) = st
                        .sessions
                        .get(&job.session)
                        .and_then(|s| s.rank(job.rank))
                        .filter(|c| c.peer == job.peer)
                {
                    let _ = conn.writer.send(Msg::Landed(control::Landed {
                        request: n.request.0,
                        chunk: n.chunk_id,
                    }));
                }
            }
            Some(Copied::Revoked) | None => {}
        }
        self.account(
            &mut st,
            (job.session, job.rank, job.peer),
            &n,
            job.now,
            hashed,
        );
    }

    /// Ends a request that no rank was asked for (parked): its pages are free at once.
    fn fail_unlaunched(&self, st: &mut State, request: RequestId, reason: FailureReason) {
        if let Some(info) = st.requests.get(&request) {
            self.counters.observe(false, info.started);
        }
        self.counters.failed.fetch_add(1, Ordering::Relaxed);
        self.counters.failed_by[reason_index(reason)].fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            request = request.0,
            ?reason,
            "request failed before any rank was asked"
        );
        if let Some(info) = st.requests.remove(&request) {
            release_pages(st, request, &info.dst_pages);
        }
        if let Some(w) = st.waiters.remove(&request) {
            let _ = w.send(Outcome::Failed(reason));
        }
    }

    /// Launches each instance's parked requests once every rank of it is connected; otherwise
    /// fails those whose wait is over. Returns the next wait to end.
    fn unpark(&self, st: &mut State, now: Instant) -> Option<Instant> {
        let waiting: Vec<SessionId> = st
            .sessions
            .iter()
            .filter(|(_, s)| !s.parked.is_empty())
            .map(|(id, _)| *id)
            .collect();
        let mut next: Option<Instant> = None;
        let mut launched = false;
        for id in waiting {
            let Some(s) = st.sessions.get_mut(&id) else {
                continue;
            };
            match s.first_absent() {
                None => {
                    let parked = std::mem::take(&mut s.parked);
                    launched = true;
                    for p in parked {
                        let result = self.launch(
                            st,
                            p.request,
                            p.prompt_tokens,
                            p.chunk_tokens,
                            now,
                            p.deadline,
                        );
                        if let Err(e) = result {
                            tracing::warn!(request = p.request.0, error = %e, "parked request not launched");
                            self.fail_unlaunched(st, p.request, FailureReason::Aborted);
                        }
                    }
                }
                Some(rank) => {
                    let (due, keep): (Vec<Parked>, Vec<Parked>) =
                        s.parked.drain(..).partition(|p| p.wait_until <= now);
                    s.parked = keep.into();
                    if let Some(t) = s.parked.iter().map(|p| p.wait_until).min() {
                        next = Some(next.map_or(t, |n| n.min(t)));
                    }
                    for p in due {
                        self.fail_unlaunched(
                            st,
                            p.request,
                            FailureReason::RankUnavailable { rank },
                        );
                    }
                }
            }
        }
        if launched {
            self.drain(st);
        }
        next
    }

    /// Hands every terminal event to its waiter, and tells every rank about each failure.
    fn drain(&self, st: &mut State) {
        while let Some(ev) = st.tracker.poll_event() {
            let (id, complete) = match &ev {
                TrackerEvent::Complete { request } => (*request, true),
                TrackerEvent::Failed { request, .. } => (*request, false),
            };
            if let Some(info) = st.requests.get(&id) {
                self.counters.observe(complete, info.started);
                if let (true, Some(posted)) = (complete, info.last_posted_us) {
                    self.counters.observe_last_post(posted);
                }
            }
            let (request, outcome) = match ev {
                TrackerEvent::Complete { request } => {
                    self.counters.completed.fetch_add(1, Ordering::Relaxed);
                    st.completed_at.record(request, Instant::now());
                    (request, Outcome::Complete)
                }
                TrackerEvent::Failed { request, reason } => {
                    // Its pages may be held a while longer (until the ranks confirm), but nothing
                    // more is copied into them.
                    if let Some(q) = st.queued.remove(&request) {
                        q.gate.revoke();
                    }
                    self.counters.failed.fetch_add(1, Ordering::Relaxed);
                    self.counters.failed_by[reason_index(reason)].fetch_add(1, Ordering::Relaxed);
                    tracing::info!(request = request.0, ?reason, "request failed");
                    // Whatever failed it (an abort, the deadline, one rank's FAILURE, a lost rank, a
                    // bad checksum), the other ranks must stop writing into pages the caller may now
                    // reuse, and vote so their boards decide; without this only `abort` told them, and
                    // healthy ranks kept writing until their vote timeout.
                    let code = match reason {
                        FailureReason::Timeout => FailureCode::Timeout,
                        FailureReason::PeerFailed { code, .. } => code,
                        FailureReason::PeerLost { .. } | FailureReason::RankUnavailable { .. } => {
                            FailureCode::PeerLost
                        }
                        FailureReason::Aborted | FailureReason::ProtocolViolation { .. } => {
                            FailureCode::Aborted
                        }
                    };
                    let msg = Msg::Abort(control::Abort {
                        request: request.0,
                        reason: code.raw(),
                    });
                    // The pages belong to the transfer until every rank says none of its writes into
                    // them still runs: connected ranks answer the Abort; external ranks cannot, so
                    // their pages stay quarantined until the server confirms for them.
                    let (mut ranks, mut external) = (Vec::new(), Vec::new());
                    let session = st.requests.get(&request).map(|r| r.session);
                    let conns = session
                        .and_then(|id| st.sessions.get(&id))
                        .map(|s| s.ranks.as_slice())
                        .unwrap_or_default();
                    for (rank, r) in conns.iter().enumerate() {
                        match r {
                            Some(r) if r.external => external.push((rank as u16, None)),
                            // An evicted rank (lease ended: stopped or dead) is told, but the
                            // outcome does not wait for it; its pages do, as for an external one.
                            Some(r) if r.evicted => {
                                let _ = r.writer.send(msg.clone());
                                external.push((rank as u16, Some(r.peer)));
                            }
                            Some(r) if r.writer.send(msg.clone()).is_ok() => {
                                ranks.push((rank as u16, r.peer))
                            }
                            // Its connection is ending (its writer is gone) and not yet handled:
                            // its end decides, as for a rank asked (`peer_lost`).
                            Some(r) => external.push((rank as u16, Some(r.peer))),
                            None => {}
                        }
                    }
                    // A rank whose connection ended without its Close may still be writing into
                    // the pages of a request it had then: the outcome does not wait for it, the
                    // pages do (until it must have noticed).
                    let started = st.requests.get(&request).map(|r| r.started);
                    let lost = session
                        .and_then(|id| st.sessions.get(&id))
                        .map(|s| s.lost.as_slice())
                        .unwrap_or_default();
                    if let Some(started) = started {
                        let now = Instant::now();
                        for l in lost.iter().filter(|l| l.holds(started, now)) {
                            if !external.contains(&(l.rank, Some(l.peer))) {
                                external.push((l.rank, Some(l.peer)));
                            }
                        }
                    }
                    let outcome = Outcome::Failed(reason);
                    if let (Some(session), false) =
                        (session, ranks.is_empty() && external.is_empty())
                    {
                        let deadline = Instant::now() + self.cfg.abort_ack_timeout;
                        let pages = st
                            .requests
                            .remove(&request)
                            .map(|r| r.dst_pages)
                            .unwrap_or_default();
                        // Nobody to wait for before the outcome: it goes out now, the pages stay held.
                        let held = if ranks.is_empty() {
                            if let Some(w) = st.waiters.remove(&request) {
                                let _ = w.send(outcome);
                            }
                            None
                        } else {
                            Some(outcome)
                        };
                        st.unacked.insert(
                            request,
                            Unacked {
                                session,
                                ranks,
                                external,
                                outcome: held,
                                deadline,
                                pages,
                            },
                        );
                        // The timer must learn this deadline.
                        self.timer.notify_one();
                        continue;
                    }
                    (request, outcome)
                }
            };
            if let Some(info) = st.requests.remove(&request) {
                release_pages(st, request, &info.dst_pages);
            }
            if let Some(w) = st.waiters.remove(&request) {
                let _ = w.send(outcome);
            }
        }
        // Poll for notifications without sleeping exactly while some request waits for them.
        if let Some(t) = self.transport.get() {
            t.set_active(st.tracker.in_flight() > 0);
        }
    }

    /// Called on the transport's progress thread.
    fn on_incoming(&self, ev: Incoming<'_>) {
        // Decode connects to no prefill at the transport level; a prefill's death is seen on its
        // control connection, so only notifications matter here.
        if let Incoming::Notification { sender, bytes } = ev {
            self.on_notification(sender, bytes);
        }
    }

    fn on_notification(&self, sender: Sender, bytes: &[u8]) {
        let n = match notify::decode(bytes) {
            Ok(Notification::Chunk(n)) => n,
            Ok(_) => return, // aux/state text messages carry nothing the tracker needs
            Err(e) => {
                self.counters.malformed.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "malformed notification dropped");
                return;
            }
        };
        let now = Instant::now();
        let mut st = self.lock();
        let Some(&(session, rank, peer)) = st.senders.get(&sender) else {
            self.counters.unknown_sender.fetch_add(1, Ordering::Relaxed);
            return;
        };
        // A rank lent landing memory for the request wrote the chunk there: into the pages with it
        // before it is hashed or counted, while the request is live (its pages its own), once (a
        // duplicate of the notification may come after a later chunk reused the range).
        let copy = if rank == n.pp_rank
            && !matches!(n.status, notify::ChunkStatus::Failed { .. })
            && st
                .requests
                .get(&n.request)
                .is_some_and(|r| r.session == session)
            && let Some(g) = st
                .grants
                .get_mut(&n.request)
                .and_then(|v| v.iter_mut().find(|g| g.slot == rank))
                .and_then(|g| g.first_landing(n.chunk_id).then_some(g.landing))
        {
            self.plan_landing(&st, session, rank, &n, g)
        } else {
            None
        };
        let work = match copy {
            Some(Planned::Copy(c)) => Work::Copy(c),
            Some(Planned::TooLarge) => {
                let why = "a chunk does not fit the stride of its landing range";
                self.landing_bug(&mut st, &n, why);
                return;
            }
            None => match self.plan_hash(&st, (session, rank), &n) {
                Some((writes, sum)) => Work::Hash { writes, sum },
                None => Work::Count,
            },
        };
        // A copy or a hash goes to a worker; so does every later notification of a request with
        // jobs queued from its own instance, so that a request's notifications are counted in the
        // order they came. Another instance's (which the tracker refuses, in any order) take no
        // place in the request's queue.
        let own = st
            .requests
            .get(&n.request)
            .is_some_and(|r| r.session == session);
        if !matches!(work, Work::Count) || (own && st.queued.contains_key(&n.request)) {
            let Some(bound) = queue_bound(&st, session, n.request) else {
                // The request is gone (a job is planned only for a live one): the tracker
                // answers for it.
                self.account(&mut st, (session, rank, peer), &n, now, None);
                return;
            };
            let Some(workers) = self.workers.get() else {
                // Workers are started with landing memory and for hashing, the only jobs planned;
                // a request is queued only after a job of it was.
                self.landing_bug(&mut st, &n, "no worker to copy or hash a chunk");
                return;
            };
            let q = st.queued.entry(n.request).or_insert_with(|| Queued {
                queued: 0,
                notifications: 0,
                lost: Vec::new(),
                gate: Arc::new(Gate::default()),
            });
            if q.notifications >= bound {
                // More than its chunks can account for: a peer repeating itself. Dropped, so that
                // the queue stays bounded; the request's own chunks are queued already.
                self.counters.jobs_dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            q.queued += 1;
            q.notifications += 1;
            let job = ChunkJob {
                session,
                rank,
                peer,
                request: n.request,
                now,
                what: Job::Chunk { n, work },
                gate: q.gate.clone(),
            };
            if !self.send_job(workers, job) {
                self.landing_bug(&mut st, &n, "the worker for a chunk is gone");
            }
            return;
        }
        self.account(&mut st, (session, rank, peer), &n, now, None);
    }

    /// Queues `job` on its request's worker, counted in [`DecodeStats::jobs_queued`] until it is
    /// over. False if that worker is gone.
    fn send_job(&self, workers: &Workers<ChunkJob>, job: ChunkJob) -> bool {
        self.counters.jobs_queued.fetch_add(1, Ordering::Relaxed);
        let sent = workers.send(job.request.0, job).is_ok();
        if !sent {
            self.counters.jobs_queued.fetch_sub(1, Ordering::Relaxed);
        }
        sent
    }

    /// The tracker hears that `peer`, a rank of `session`, is lost: each request it had not
    /// delivered fails. For a request of the session with notifications queued on a chunk worker
    /// (possibly the rank's last ones), that happens on the worker once they are counted; for the
    /// others at once. Returns how many failed at once and how many wait.
    fn lose_peer(
        &self,
        st: &mut State,
        (session, rank, peer): (SessionId, u16, PeerId),
        now: Instant,
    ) -> (usize, usize) {
        let later: std::collections::HashSet<RequestId> = st
            .queued
            .keys()
            .copied()
            .filter(|id| st.requests.get(id).is_some_and(|r| r.session == session))
            .collect();
        let failed = st
            .tracker
            .handle_peer_lost_in(now, peer, |id| !later.contains(&id));
        let waiting = later.len();
        for request in later {
            let queued = match (st.queued.get_mut(&request), self.workers.get()) {
                // Once per peer: a guard, should one connection's end be seen twice.
                (Some(q), _) if q.lost.contains(&peer) => true,
                (Some(q), Some(workers)) => {
                    q.queued += 1;
                    q.lost.push(peer);
                    let job = ChunkJob {
                        session,
                        rank,
                        peer,
                        request,
                        now,
                        what: Job::PeerLost,
                        gate: q.gate.clone(),
                    };
                    let sent = self.send_job(workers, job);
                    if !sent && let Some(q) = st.queued.get_mut(&request) {
                        q.queued -= 1;
                        q.lost.retain(|p| *p != peer);
                        if q.queued == 0 {
                            st.queued.remove(&request);
                        }
                    }
                    sent
                }
                _ => false,
            };
            if !queued {
                // No worker to wait behind (a bug): the loss counts now.
                st.tracker
                    .handle_peer_lost_in(now, peer, |id| id == request);
            }
        }
        (failed, waiting)
    }

    /// Plans the hash of `rank`'s chunk `n` in the pages, for a chunk worker: its writes and
    /// checksum, where the engine verifies checksums, the chunk has one and the request is the
    /// sender's instance's, in a host pool. `None` leaves the check to [`Self::account`] (which
    /// fails a chunk it cannot plan, or passes one it has nothing to hash in).
    fn plan_hash(
        &self,
        st: &State,
        (session, rank): (SessionId, u16),
        n: &notify::ChunkNotification,
    ) -> Option<(Vec<Write>, u64)> {
        let sum = n.checksum.filter(|_| self.cfg.verify_checksums)?;
        let (info, conn) = (
            st.requests
                .get(&n.request)
                .filter(|r| r.session == session && rank == n.pp_rank)?,
            st.sessions.get(&session).and_then(|s| s.rank(rank))?,
        );
        self.workers.get()?;
        Some((chunk_writes(conn, info, n.chunk_id).ok()?, sum))
    }

    /// Checks a chunk notification's checksum (unless a chunk worker did: `hashed`, whether it
    /// matched) and hands it to the tracker, under the engine's lock: what every notification goes
    /// through once its chunk is in the request's pages.
    fn account(
        &self,
        st: &mut State,
        (session, rank, peer): (SessionId, u16, PeerId),
        n: &notify::ChunkNotification,
        now: Instant,
        hashed: Option<bool>,
    ) {
        // Only a request of the sender's own instance is hashed (and failed on a mismatch); any
        // other goes to the tracker, which refuses a peer the request is not bound to.
        if let (Some(sum), true) = (n.checksum, self.cfg.verify_checksums)
            && rank == n.pp_rank
            && st
                .requests
                .get(&n.request)
                .is_some_and(|r| r.session == session)
            && !hashed.unwrap_or_else(|| self.checksum_matches(st, session, rank, n, sum))
        {
            self.counters
                .checksum_mismatch
                .fetch_add(1, Ordering::Relaxed);
            let kind = ViolationKind::ChecksumMismatch {
                chunk_id: n.chunk_id,
            };
            let _ = st
                .tracker
                .fail(n.request, FailureReason::ProtocolViolation { rank, kind });
            self.drain(st);
            return;
        }
        if st.tracker.handle_notification(now, peer, n).is_err() {
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
        } else if let Some(low) = n.posted_us
            && let Some(info) = st
                .requests
                .get_mut(&n.request)
                .filter(|r| r.session == session)
        {
            // Taken only from a rank the tracker accepted for the request.
            let posted = notify::posted_near(low, notify::wall_us());
            info.last_posted_us = Some(info.last_posted_us.map_or(posted, |p| p.max(posted)));
        }
        self.drain(st);
    }

    /// Hashes what `rank` wrote for `n`'s chunk, in the order the prefill hashed it.
    fn checksum_matches(
        &self,
        st: &State,
        session: SessionId,
        rank: u16,
        n: &crate::core::notify::ChunkNotification,
        sum: u64,
    ) -> bool {
        let (Some(info), Some(conn), Some(_)) = (
            st.requests.get(&n.request),
            st.sessions.get(&session).and_then(|s| s.rank(rank)),
            self.pool
                .get()
                .filter(|p| p.desc().is_some_and(|d| d.kind() == MemKind::Host)),
        ) else {
            // Unknown request (the tracker counts it) or a device pool we cannot read: nothing to hash.
            return true;
        };
        chunk_writes(conn, info, n.chunk_id)
            .is_ok_and(|writes| self.hash_pages(&writes) == Some(sum))
    }

    /// Hashes what `writes` put into the pool, in their order (`None` for a device pool or a
    /// range outside it).
    fn hash_pages(&self, writes: &[Write]) -> Option<u64> {
        let pool = self
            .pool
            .get()
            .filter(|p| p.desc().is_some_and(|d| d.kind() == MemKind::Host))?;
        let mut h = ChunkHasher::new();
        for w in writes {
            for (_, dst) in w.pieces() {
                pool.read_pieces(dst, w.len, |b| h.update(b)).ok()?;
            }
        }
        Some(h.finish())
    }

    /// `rank`'s writes for `request` are over: connection `from` of it acknowledged the Abort,
    /// closed, or ended without its Close and the bound after that passed, or (`None`) the server
    /// confirmed for the rank.
    fn acked(
        &self,
        st: &mut State,
        session: SessionId,
        request: RequestId,
        rank: u16,
        from: Option<PeerId>,
    ) {
        let Some(u) = st
            .unacked
            .get_mut(&request)
            .filter(|u| u.session == session)
        else {
            return;
        };
        let confirms = |r: u16, p: Option<PeerId>| r == rank && from.is_none_or(|f| p == Some(f));
        u.ranks.retain(|&(r, p)| !confirms(r, Some(p)));
        u.external.retain(|&(r, p)| !confirms(r, p));
        let settled = u.ranks.is_empty() && u.external.is_empty();
        hand_out_once_confirmed(st, request);
        if settled {
            self.settle(st, request);
            st.forget_if_left(session);
        }
    }

    /// No write into `request`'s pages can land any more: its outcome goes out if still held, and
    /// its pages become free.
    fn settle(&self, st: &mut State, request: RequestId) {
        let Some(u) = st.unacked.remove(&request) else {
            return;
        };
        // Released before the outcome goes out: a caller may reuse the pages once it has it.
        release_pages(st, request, &u.pages);
        match u.outcome {
            Some(outcome) => {
                if let Some(w) = st.waiters.remove(&request) {
                    let _ = w.send(outcome);
                }
            }
            None => tracing::info!(request = request.0, "quarantined pages released"),
        }
    }

    /// Hands out the outcome of failed requests whose ranks did not confirm in time, keeping their
    /// pages quarantined; returns the next such deadline.
    fn expire_unacked(&self, st: &mut State, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut late = Vec::new();
        for (request, u) in st.unacked.iter_mut() {
            if u.outcome.is_none() {
                continue;
            }
            if u.deadline <= now {
                late.push((*request, u.outcome.take()));
            } else {
                next = Some(next.map_or(u.deadline, |n| n.min(u.deadline)));
            }
        }
        for (request, outcome) in late {
            self.counters
                .abort_ack_timeouts
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                request = request.0,
                "ranks did not confirm the abort in time: the request's pages are quarantined"
            );
            if let (Some(o), Some(w)) = (outcome, st.waiters.remove(&request)) {
                let _ = w.send(o);
            }
        }
        next
    }

    /// `rank` of `session` (its connection `peer`) formed its vote mesh: requests may go to it,
    /// and those that waited for it go out if it was the last rank missing.
    fn on_ready(&self, session: SessionId, rank: u16, peer: PeerId) {
        let mut st = self.lock();
        let Some(s) = st.sessions.get_mut(&session) else {
            return;
        };
        let Some(r) = s.rank_mut(rank) else {
            return;
        };
        if r.peer != peer || r.ready {
            return;
        }
        r.ready = true;
        if r.evicted {
            return;
        }
        let now = Instant::now();
        absence_ends(s, now);
        self.unpark(&mut st, now);
        drop(st);
        self.changed.send_modify(|n| *n += 1);
        self.timer.notify_one();
    }

    /// `rank` of `session`'s vote mesh lost a link: no new request goes to the session until its
    /// next `Ready` (requests expected meanwhile wait, as for an absent rank).
    fn on_not_ready(&self, session: SessionId, rank: u16, peer: PeerId) {
        let mut st = self.lock();
        let Some(s) = st.sessions.get_mut(&session) else {
            return;
        };
        let Some(r) = s.rank_mut(rank) else {
            return;
        };
        if r.peer != peer || !r.ready {
            return;
        }
        r.ready = false;
        absence_begins(s, Instant::now());
        drop(st);
        tracing::info!(
            rank,
            "prefill rank's vote mesh lost a link: no new requests until it is back"
        );
        self.changed.send_modify(|n| *n += 1);
    }

    /// `rank` of `session`'s connection ended: with its Close (its writes are over), without, or
    /// cut by a tampered channel (its writes may go on).
    fn peer_lost(&self, session: SessionId, rank: u16, peer: PeerId, sender: &Sender, end: End) {
        let closed = end == End::Closed;
        let tampered = end == End::Tampered;
        let unclean = end == End::Lost;
        // One instant for the failures and the absence they belong to: a request that failed here
        // ended inside the absence, whenever its waiter reads the clock. Read under the lock: a
        // request expected before it (`expect` reads its clock before locking) was launched while
        // the connection held the slot, and is held for it.
        let mut st = self.lock();
        let now = Instant::now();
        let mut name = String::new();
        if tampered {
            // Failed as for a lost rank, but counted like an evicted one while its requests fail:
            // the outcome does not wait for it, their pages do (it cannot confirm any more).
            if let Some(r) = st
                .sessions
                .get_mut(&session)
                .and_then(|s| s.rank_mut(rank))
                .filter(|r| r.peer == peer)
            {
                r.evicted = true;
            }
            // At once, not behind the request's queued chunks: the failures must find the rank in
            // its slot, marked evicted, so that its pages stay held (it may still write).
            let _ = st.tracker.handle_peer_lost(now, peer);
            self.drain(&mut st);
        }
        if let Some(s) = st.sessions.get_mut(&session) {
            name.clone_from(&s.name);
            if closed {
                s.closed_ranks.insert(rank);
            }
            if unclean {
                // Before the failures below: they must find it.
                s.lost.push(LostConn {
                    rank,
                    peer,
                    at: now,
                    until: self.lost_bound().and_then(|b| now.checked_add(b)),
                });
                self.counters.unclean_ends.fetch_add(1, Ordering::Relaxed);
            }
            if s.rank(rank).is_some_and(|r| r.peer == peer) {
                s.ranks[usize::from(rank)] = None;
                absence_begins(s, now);
                st.senders.remove(sender);
                // Always a change: `shutdown` waits on it for every rank's slot to clear.
                self.changed.send_modify(|n| *n += 1);
            }
        }
        let (failed, waiting) = self.lose_peer(&mut st, (session, rank, peer), now);
        if closed && (st.closing || st.sessions.get(&session).is_some_and(|s| s.leaving)) {
            tracing::info!(rank, instance = %name, "prefill rank closed");
        } else {
            // `waiting`: requests whose loss waits behind their queued chunks (they fail then if it
            // had not delivered them).
            tracing::warn!(
                rank,
                instance = %name,
                failed,
                waiting,
                "prefill rank lost"
            );
        }
        self.drain(&mut st);
        // A rank that closed writes nothing more; that includes one evicted earlier, whose
        // confirmations were pending beside the outcome. One whose connection ended without its
        // Close may write until it notices: the outcome no longer waits for it, the pages do. A
        // rank cut by tampering may still write: nothing of it counts as confirmed.
        let waiting: Vec<RequestId> = st
            .unacked
            .iter()
            .filter(|(_, u)| {
                !tampered
                    && u.session == session
                    && (u.ranks.contains(&(rank, peer)) || u.external.contains(&(rank, Some(peer))))
            })
            .map(|(r, _)| *r)
            .collect();
        for request in waiting {
            if unclean {
                self.await_lost(&mut st, request, rank, peer);
            } else {
                self.acked(&mut st, session, request, rank, Some(peer));
            }
        }
        st.forget_if_left(session);
        drop(st);
        if unclean {
            self.timer.notify_one();
        }
    }

    /// How long a rank whose connection ended without its Close may still write: until it noticed
    /// (this side's heartbeats stopped for three intervals, as it counts them) and what it had
    /// posted is over. `None` without heartbeats.
    fn lost_bound(&self) -> Option<Duration> {
        // The interval as this side's Hello announced it (the rank counts that one).
        let announced = control::Hello::announced_heartbeat(self.cfg.heartbeat)?;
        announced
            .checked_mul(super::SILENT_INTERVALS)?
            .checked_add(self.cfg.abort_ack_timeout)
    }

    /// `request` waited for the confirmation of `rank`'s connection `peer`, which ended without
    /// its Close: its outcome waits no longer, its pages wait for the connection's bound.
    fn await_lost(&self, st: &mut State, request: RequestId, rank: u16, peer: PeerId) {
        let Some(u) = st.unacked.get_mut(&request) else {
            return;
        };
        if u.ranks.contains(&(rank, peer)) {
            u.ranks.retain(|&c| c != (rank, peer));
            u.external.push((rank, Some(peer)));
        }
        hand_out_once_confirmed(st, request);
    }

    /// Releases the pages held for rank connections that ended without their Close once their
    /// bound passed, and forgets those no request can wait for any more; returns the next bound.
    fn expire_lost(&self, st: &mut State, now: Instant) -> Option<Instant> {
        let mut over = Vec::new();
        let mut next: Option<Instant> = None;
        let requests = &st.requests;
        for (&id, s) in st.sessions.iter_mut() {
            s.lost.retain(|l| match l.until {
                Some(u) if u <= now => {
                    over.push((id, l.rank, l.peer));
                    false
                }
                Some(u) => {
                    next = Some(next.map_or(u, |n| n.min(u)));
                    true
                }
                // No bound: kept while a live request may still fail and wait for it.
                None => requests
                    .values()
                    .any(|r| r.session == id && r.started <= l.at),
            });
        }
        if !over.is_empty() {
            // `shutdown` may wait for these pages.
            self.changed.send_modify(|n| *n += 1);
        }
        for (session, rank, peer) in over {
            let held: Vec<RequestId> = st
                .unacked
                .iter()
                .filter(|(_, u)| u.session == session && u.external.contains(&(rank, Some(peer))))
                .map(|(r, _)| *r)
                .collect();
            for request in held {
                self.acked(st, session, request, rank, Some(peer));
            }
            st.forget_if_left(session);
        }
        next
    }
}

/// Adds a session for `instance` (which has none), whose TP size is `prefill_tp`.
fn add_session(
    st: &mut State,
    cfg: &DecodeConfig,
    instance: &str,
    pp_size: u16,
    prefill_tp: u16,
    now: Instant,
) -> Result<SessionId, EngineError> {
    let sources = cfg.tp.source_at(prefill_tp, cfg.tp.size, cfg.tp.rank)?;
    let stage = cfg.stage;
    let ranks = if stage.size <= 1 {
        (0, pp_size)
    } else if pp_size == stage.size {
        (stage.rank, 1)
    } else {
        return Err(EngineError::Config(format!(
            "decode is PP stage {} of {}: it takes prefill pipelines of {} ranks only, not {pp_size}",
            stage.rank, stage.size, stage.size
        )));
    };
    if usize::from(pp_size) * sources.len() > usize::from(u16::MAX) {
        return Err(EngineError::Config(format!(
            "{pp_size} PP ranks of {} sources each are too many",
            sources.len()
        )));
    }
    let id = st.next_session;
    st.next_session = st.next_session.wrapping_add(1);
    st.sessions.insert(
        id,
        Session::new(
            instance.to_owned(),
            pp_size,
            ranks,
            prefill_tp,
            sources,
            now,
        ),
    );
    st.names.insert(instance.to_owned(), id);
    Ok(id)
}

/// The layers this decode holds, which its prefill ranks must tile: the model's, or its stage's.
fn decode_layers(cfg: &DecodeConfig) -> std::ops::Range<u32> {
    if cfg.stage.size > 1 {
        cfg.layout.layers()
    } else {
        0..cfg.total_layers
    }
}

fn unknown_instance(instance: &str) -> EngineError {
    EngineError::Config(format!(
        "prefill instance {instance:?} is not served by this engine (add_instance)"
    ))
}

/// `reason`'s slot in `Counters::failed_by` (the order of `DecodeStats`'s `failed_*` fields).
fn reason_index(reason: FailureReason) -> usize {
    match reason {
        FailureReason::Aborted => 0,
        FailureReason::Timeout => 1,
        FailureReason::PeerFailed { .. } => 2,
        FailureReason::PeerLost { .. } => 3,
        FailureReason::ProtocolViolation { .. } => 4,
        FailureReason::RankUnavailable { .. } => 5,
    }
}

/// Source pages to plan a request's chunks with on this side. The source side's page numbers only
/// affect merging, not which destination bytes are written or their order, so any pages of its
/// pool do: as many as the moved tokens span there (a caller may have padded its list with a page
/// it repeats, so they may be more than its pool holds).
fn stand_in_src(planner: &Planner, info: &ReqInfo) -> Vec<u32> {
    let src_len = planner
        .src_pages_needed(&info.geometry)
        .max(info.dst_pages.len() as u64);
    let src_pool = u64::from(planner.src().num_pages.max(1));
    (0..src_len).map(|i| (i % src_pool) as u32).collect()
}

/// The writes `conn`'s rank makes for chunk `chunk` of the request `info`, in its plan's order
/// (the order the prefill hashes them in), from stand-in source pages.
fn chunk_writes(
    conn: &RankConn,
    info: &ReqInfo,
    chunk: u32,
) -> Result<Vec<Write>, crate::core::planner::PlanError> {
    let mut writes = Vec::new();
    conn.planner.plan_chunk(
        &info.geometry,
        u64::from(chunk),
        &stand_in_src(&conn.planner, info),
        &info.dst_pages,
        &mut writes,
    )?;
    Ok(writes)
}

/// How many notifications of `request` may wait on a chunk worker: two for each chunk of each rank
/// of its instance (a duplicate of each may come), and some slack. `None` for a request gone.
fn queue_bound(st: &State, session: SessionId, request: RequestId) -> Option<u32> {
    let info = st.requests.get(&request)?;
    let ranks = st
        .sessions
        .get(&session)
        .map_or(1, |s| s.ranks.len() as u64);
    let chunks = info.geometry.num_chunks();
    Some(
        u32::try_from(
            chunks
                .saturating_mul(ranks)
                .saturating_mul(2)
                .saturating_add(16),
        )
        .unwrap_or(u32::MAX),
    )
}

/// Frees `request`'s pages (and the landing memory lent for it) for new requests and wakes
/// whoever waits for that.
fn release_pages(st: &mut State, request: RequestId, pages: &[u32]) {
    // A copy out of landing memory into them stops first (waiting for a piece that runs).
    if let Some(q) = st.queued.remove(&request) {
        q.gate.revoke();
    }
    for g in st.grants.remove(&request).unwrap_or_default() {
        st.landing.give(g.landing.offset);
    }
    for p in pages {
        if st.held_pages.get(p) == Some(&request) {
            st.held_pages.remove(p);
        }
    }
    for w in st.released_waiters.remove(&request).unwrap_or_default() {
        let _ = w.send(());
    }
}

/// Once every connected rank of `request` confirmed that its writes are over, its held outcome
/// goes out (its pages may stay held for ranks without a connection to confirm on).
fn hand_out_once_confirmed(st: &mut State, request: RequestId) {
    if let Some(u) = st.unacked.get_mut(&request)
        && u.ranks.is_empty()
        && let Some(outcome) = u.outcome.take()
        && let Some(w) = st.waiters.remove(&request)
    {
        let _ = w.send(outcome);
    }
}

async fn accept_loop(inner: Weak<Inner>, listener: Listener) {
    let places = super::admission::Places::new();
    loop {
        let (conn, place) = super::admission::admit(&listener, &places, || {
            if let Some(i) = inner.upgrade() {
                i.counters
                    .refused_connections
                    .fetch_add(1, Ordering::Relaxed);
            }
        })
        .await;
        let Some(i) = inner.upgrade() else { return };
        tokio::spawn(serve_rank(Arc::downgrade(&i), conn, place));
    }
}

fn local_hello(inner: &Inner) -> Result<Hello, EngineError> {
    let t = inner.transport.get().ok_or(EngineError::Shutdown)?;
    let pool = inner.pool.get().ok_or(EngineError::Shutdown)?;
    let cfg = &inner.cfg;
    let hello = Hello::new(
        cfg.engine_id.clone(),
        Role::Decode,
        layout_info(cfg.total_layers, cfg.page_tokens, &cfg.layout, &cfg.tp),
        BackendInfo {
            kind: to_wire_kind(t.kind()),
            worker_or_agent: t.metadata()?,
            agent_name: t.name(),
            regions: pool.remotes().iter().map(wire_regions).collect(),
            landing: inner.landing.get().map(|r| wire_regions(r.remote())),
        },
    )
    // Its own PP stage (0 of 1 unless decode is pipelined).
    .with_pp(cfg.stage.rank, cfg.stage.size)
    .with_tp(cfg.tp.rank, cfg.tp.size)
    .with_heartbeat(cfg.heartbeat);
    Ok(Hello {
        instance: cfg.instance.clone(),
        app: cfg.app.clone(),
        ..hello
    })
}

async fn serve_rank(inner: Weak<Inner>, mut conn: Connection, mut place: super::admission::Place) {
    let (hello, deadline) = {
        let Some(i) = inner.upgrade() else { return };
        match local_hello(&i) {
            Ok(h) => (h, tokio::time::Instant::now() + i.cfg.handshake_timeout),
            Err(e) => {
                tracing::warn!(error = %e, "cannot build hello");
                return;
            }
        }
    };
    let mut bound = None;
    let vouch = place.vouch();
    let taken = |remote: &Hello| -> Result<(), RejectReason> {
        // Called once the peer proved the secret.
        vouch.authenticated();
        let Some(i) = inner.upgrade() else {
            return Err(RejectReason::Refused("shutting down".into()));
        };
        if remote.role != Role::Prefill {
            return Err(RejectReason::RoleMismatch(
                "decode accepts only prefill ranks".into(),
            ));
        }
        let src = layout_from_info(&remote.layout)
            .map_err(|e| RejectReason::LayoutMismatch(e.to_string()))?;
        let sender = match remote.backend.kind {
            control::BackendKind::Nixl => Sender::Agent(remote.backend.agent_name.clone()),
            _ => Sender::Key(remote.notify_key),
        };
        let mut st = i.lock();
        if st.closing {
            return Err(RejectReason::Refused("decode is shutting down".into()));
        }
        let Some((id, s)) = st
            .session_named(&remote.instance)
            .and_then(|id| Some((id, st.sessions.get(&id)?)))
            .filter(|(_, s)| !s.leaving)
        else {
            return Err(RejectReason::UnknownInstance(remote.instance.clone()));
        };
        if remote.pp_size != s.pp_size {
            return Err(RejectReason::PpMismatch(format!(
                "decode expects pp_size {} for instance {:?}, peer says {}",
                s.pp_size, remote.instance, remote.pp_size
            )));
        }
        if remote.tp_size != s.prefill_tp {
            return Err(RejectReason::TpMismatch(format!(
                "decode expects TP size {} for instance {:?}, peer says {}",
                s.prefill_tp, remote.instance, remote.tp_size
            )));
        }
        let tp = &i.cfg.tp;
        let Some(j) = s
            .sources
            .iter()
            .position(|x| x.prefill_rank == u32::from(remote.tp_rank))
        else {
            return Err(RejectReason::TpMismatch(format!(
                "prefill TP rank {} writes nothing into decode TP rank {}",
                remote.tp_rank, tp.rank
            )));
        };
        let mapping = tp.mapping(s.prefill_tp, tp.size, tp.rank, &s.sources[j]);
        let planner = Planner::with_page_tokens(
            &src,
            &i.cfg.layout,
            mapping,
            remote.layout.page_tokens,
            i.cfg.page_tokens,
        )
        .map_err(|e| RejectReason::LayoutMismatch(e.to_string()))?;
        let slot = s
            .slot(remote.pp_rank, j)
            .ok_or_else(|| RejectReason::PpMismatch("PP rank out of range".into()))?;
        s.layers_fit(slot, &src.layers(), &decode_layers(&i.cfg))
            .map_err(RejectReason::LayoutMismatch)?;
        let busy = s
            .rank(slot)
            .is_some_and(|r| !r.replaceable_by(remote.incarnation));
        s.incarnations
            .check(slot, remote.incarnation, busy)
            .map_err(RejectReason::from)?;
        if st.senders.contains_key(&sender) {
            return Err(RejectReason::DuplicateSender(format!("{sender:?}")));
        }
        let claim = st.next_claim;
        st.next_claim += 1;
        if let Some(s) = st.sessions.get_mut(&id) {
            s.claims.push(Claim {
                id: claim,
                slot,
                layers: src.layers(),
            });
        }
        bound = Some((id, slot, planner, sender, claim));
        Ok(())
    };
    let secret = match inner.upgrade() {
        Some(i) => i.secret.clone(),
        None => return,
    };
    let result = tokio::select! {
        r = control::handshake_serving_probes(&mut conn, &hello, &secret, deadline, taken) => Some(r),
        // A newer connection took its place (counted in `refused_connections`).
        () = place.evicted() => None,
    };
    // The handshake is over: its place goes to the next connection.
    drop(place);
    let Some(i) = inner.upgrade() else { return };
    if !matches!(result, Some(Ok(_)))
        && let Some((session, _, _, _, claim)) = &bound
        && let Some(s) = i.lock().sessions.get_mut(session)
    {
        s.claims.retain(|c| c.id != *claim);
    }
    let Some(result) = result else { return };
    let (remote, (session, slot, planner, sender, claim)) = match (result, bound) {
        (Ok(r), Some(b)) => (r, b),
        (Ok(_), None) => return,
        (Err(control::ControlError::Probed { peer }), _) => {
            i.counters.probes.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%peer, "probed by an authenticated peer");
            return;
        }
        (Err(e), _) => {
            let c = &i.counters;
            super::count_handshake_failure(&e, &c.auth_failures, &c.handshake_failures);
            tracing::warn!(error = %e, "prefill handshake failed");
            return;
        }
    };
    // The rank's slot: its PP rank where every decode TP rank has one source per PP rank.
    let rank = slot;
    let (reader, writer) = conn.into_split();
    let (tx, rx) = Outbox::new();
    let cut = Arc::new(Notify::new());
    let peer = {
        let mut st = i.lock();
        let sender_free = !st.senders.contains_key(&sender);
        let peer = PeerId(st.next_peer);
        // The session may have been removed, or the slot taken, since the handshake's check.
        let mut replaced = None;
        let layers = remote.layout.first_layer
            ..remote
                .layout
                .first_layer
                .saturating_add(remote.layout.layers);
        let want = decode_layers(&i.cfg);
        // The claim ends here: the rank is admitted in its place, or refused.
        if let Some(s) = st.sessions.get_mut(&session) {
            s.claims.retain(|c| c.id != claim);
        }
        let admitted = st
            .sessions
            .get_mut(&session)
            .filter(|s| !s.leaving && sender_free)
            .and_then(|s| {
                let busy = s
                    .rank(rank)
                    .is_some_and(|r| !r.replaceable_by(remote.incarnation));
                // A neighbour may have arrived since the handshake's check.
                s.layers_fit(rank, &layers, &want).ok()?;
                let previous = s.incarnations.admit(rank, remote.incarnation, busy).ok()?;
                s.closed_ranks.remove(&rank);
                replaced = s.ranks[usize::from(rank)].replace(RankConn {
                    peer,
                    writer: tx,
                    planner,
                    external: false,
                    ready: false,
                    incarnation: remote.incarnation,
                    evicted: false,
                    cut: cut.clone(),
                    layers: layers.clone(),
                });
                Some(previous)
            });
        if let Some(old) = replaced {
            // An evicted start whose slot this later one took: its connection is cut, and its
            // failed requests' pages stay quarantined (it may be stopped, not dead, and write when it
            // resumes), since nothing of it counts as confirmed any more.
            st.senders.retain(|_, (_, _, p)| *p != old.peer);
            old.cut.notify_one();
            tracing::warn!(
                rank,
                instance = %remote.instance,
                incarnation = old.incarnation,
                "an evicted start's slot taken by a later one: its connection is cut"
            );
        }
        let Some(previous) = admitted else {
            // Lost a race with another connection for the same rank or sender.
            i.counters
                .handshake_failures
                .fetch_add(1, Ordering::Relaxed);
            return;
        };
        if let Some(previous) = previous {
            i.counters.rejoins.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                rank,
                instance = %remote.instance,
                previous,
                incarnation = remote.incarnation,
                "prefill rank rejoined"
            );
        }
        st.next_peer += 1;
        st.senders.insert(sender.clone(), (session, rank, peer));
        peer
    };
    i.changed.send_modify(|n| *n += 1);
    tracing::info!(rank, instance = %remote.instance, peer = peer.0, "prefill rank connected");
    let heartbeat = i.cfg.heartbeat;
    drop(i);
    // Three of the rank's own intervals, as its Hello announced them.
    let silence = super::silence_bound(remote.heartbeat());
    let stalled = Arc::new(Notify::new());
    let write_task = tokio::spawn(super::write_loop(
        writer,
        rx,
        heartbeat,
        (super::stall_bound(silence), stalled.clone()),
    ));
    let end = read_loop(
        &inner,
        reader,
        session,
        rank,
        peer,
        silence,
        Cuts { cut, stalled },
    )
    .await;
    write_task.abort();
    if let Some(i) = inner.upgrade() {
        i.peer_lost(session, rank, peer, &sender, end);
    }
}

/// How a rank's control connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// With the rank's Close: none of its writes into the pool still runs.
    Closed,
    /// Without it: the rank's process (or its connection) is gone.
    Lost,
    /// The channel refused a record (a changed or forged byte on the way), or the rank sent
    /// nothing for three heartbeat intervals: its process may be alive and still writing, so its
    /// requests' pages are not handed back (quarantined until [`DecodeEngine::confirm_stopped`]).
    /// Also a connection cut because a later start took the slot of its evicted one, or because
    /// a message to the rank was not taken within its [`stall_bound`](super::stall_bound) of its
    /// being queued ([`DecodeStats::stalled`]).
    Tampered,
}

/// What ends a rank's connection from this side besides what it sends.
struct Cuts {
    /// A later start of the rank took its slot.
    cut: Arc<Notify>,
    /// A message this side queued was not taken within the rank's
    /// [`stall_bound`](super::stall_bound) of its queueing.
    stalled: Arc<Notify>,
}

/// Handles a rank's messages until its connection ends, and says how it ended.
async fn read_loop(
    inner: &Weak<Inner>,
    mut reader: control::ControlReader,
    session: SessionId,
    rank: u16,
    peer: PeerId,
    silence: Option<Duration>,
    cuts: Cuts,
) -> End {
    loop {
        let got = tokio::select! {
            got = reader.recv_within(silence) => got,
            () = cuts.cut.notified() => return End::Tampered,
            () = cuts.stalled.notified() => {
                // Alive, perhaps, and writing: its pages stay held, as a silent rank's do.
                tracing::error!(rank, "prefill rank does not read what decode sends: lost, its pages stay held");
                if let Some(i) = inner.upgrade() {
                    i.counters.stalled.fetch_add(1, Ordering::Relaxed);
                }
                return End::Tampered;
            }
        };
        let msg = match got {
            Ok(Some(m)) => m,
            Ok(None) => return End::Lost,
            Err(e @ control::ControlError::Silent { .. }) => {
                tracing::error!(rank, error = %e, "prefill rank silent: lost, its pages stay held");
                if let Some(i) = inner.upgrade() {
                    i.counters.silent.fetch_add(1, Ordering::Relaxed);
                }
                return End::Tampered;
            }
            Err(e @ control::ControlError::Channel { .. }) => {
                tracing::error!(rank, error = %e, "control channel tampered with: the rank's pages stay held");
                if let Some(i) = inner.upgrade() {
                    i.counters.tampered.fetch_add(1, Ordering::Relaxed);
                }
                return End::Tampered;
            }
            Err(e) => {
                tracing::warn!(rank, error = %e, "control connection failed");
                return End::Lost;
            }
        };
        let Some(i) = inner.upgrade() else {
            return End::Lost;
        };
        // A rank speaks only for its own instance's requests: anything about another's is
        // counted and dropped, so one instance can never fail, confirm or feed another's.
        let about = match &msg {
            Msg::TransferReject(r) => Some(r.request),
            Msg::Abort(a) => Some(a.request),
            Msg::AbortAck(a) => Some(a.request),
            Msg::Aux(a) => Some(a.request),
            _ => None,
        };
        if let Some(request) = about
            && !i.lock().owned_by(RequestId(request), session)
        {
            i.counters.refused.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                rank,
                request,
                "message about another instance's request dropped"
            );
            continue;
        }
        match msg {
            Msg::TransferReject(r) => {
                tracing::warn!(rank, request = r.request, reason = %r.reason, "prefill rejected a transfer request");
                let mut st = i.lock();
                let code = crate::core::FailureCode::OutOfResources;
                let _ = st.tracker.fail(
                    RequestId(r.request),
                    FailureReason::PeerFailed { rank, code },
                );
                i.drain(&mut st);
            }
            Msg::Abort(a) => {
                let mut st = i.lock();
                let code = crate::core::FailureCode::from_raw(a.reason);
                let _ = st.tracker.fail(
                    RequestId(a.request),
                    FailureReason::PeerFailed { rank, code },
                );
                i.drain(&mut st);
            }
            Msg::AbortAck(a) => {
                let mut st = i.lock();
                i.acked(&mut st, session, RequestId(a.request), rank, Some(peer));
            }
            Msg::Aux(a) if a.data.len() <= control::MAX_AUX_LEN => {
                let dropped = i
                    .lock()
                    .aux
                    .put(session, (RequestId(a.request), rank), a.data);
                i.counters
                    .aux_dropped
                    .fetch_add(dropped as u64, Ordering::Relaxed);
            }
            Msg::Aux(a) => {
                tracing::warn!(
                    rank,
                    request = a.request,
                    len = a.data.len(),
                    "aux payload over the bound, dropped"
                );
                i.counters.refused.fetch_add(1, Ordering::Relaxed);
            }
            Msg::Ready => i.on_ready(session, rank, peer),
            Msg::NotReady => i.on_not_ready(session, rank, peer),
            Msg::Close => return End::Closed,
            Msg::Heartbeat => {}
            other => {
                // A kind no rank sends once connected: counted and dropped.
                i.counters.refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(rank, kind = ?other.kind(), "unexpected message from a prefill rank dropped");
            }
        }
    }
}
