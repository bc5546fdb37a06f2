//! The prefill side, one engine per PP rank: writes this rank's layers of each chunk into the pages the
//! decode side allocated, notifies after each chunk, and agrees with the other PP ranks on each
//! request's terminal state through the [`VoteBoard`].
//!
//! One engine serves every decode engine the rank writes into (decode instances, decode TP ranks):
//! each is a link with its own transport peer, plan, control connection and requests, over the one
//! transport, the one registration of the pool and the one vote mesh. A decode that closes fails
//! only its own requests, and its link is forgotten once its last write is over.
//!
//! A rank's vote is cast from the transfer-completion path itself (the transport's `Done` callback of
//! the LAST chunk, or of a failed one) and sent to every peer at once; nothing ever waits for a peer's
//! scheduler. A request's source pages stay owned until [`PrefillEngine::decided`] resolves.

use super::{
    BackendConfig, EngineError, Outbox, Pool, TpConfig, layout_from_info, layout_info,
    remote_regions, to_wire_kind,
};
use crate::control::{
    self, BackendInfo, Connection, Hello, Listener, Msg, RejectReason, Role, Secret,
};
use crate::core::chunkset::ChunkSet;
use crate::core::membership::Incarnations;
use crate::core::notify::{ChunkNotification, ChunkStatus, TextForm};
use crate::core::planner::{ChunkGeometry, KvLayout, Planner, Write};
use crate::core::vote::{Decision, Vote, VoteBoard, VoteConfig, VoteMessage};
use crate::core::{ChunkHasher, FailureCode, RequestId};
use crate::mem::MemKind;
use crate::transport::{PeerId, Post, Sink, Transport, TransportError, WriteOp};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, mpsc, oneshot};

/// Settings of a [`PrefillEngine`].
#[derive(Debug, Clone)]
pub struct PrefillConfig {
    /// Name in handshakes and logs.
    pub engine_id: String,
    /// The backend.
    pub backend: BackendConfig,
    /// The first decode engine's control address ([`LinkId`] 0); more come with
    /// [`PrefillEngine::add_decode`].
    pub decode: SocketAddr,
    /// Keep serving once every decode engine closed (more may come with
    /// [`PrefillEngine::add_decode`]); `false` closes the engine with its last decode, after which
    /// [`PrefillEngine::next_request`] returns `None`.
    pub keep_open: bool,
    /// The prefill instance this rank belongs to, as the decode engine named it
    /// ([`DecodeEngine::add_instance`](super::DecodeEngine::add_instance)); every PP rank of the
    /// pipeline carries the same name. `""` is the decode engine's default instance.
    pub instance: String,
    /// This rank.
    pub pp_rank: u16,
    /// This rank's TP rank and size and how TP maps ([`TpConfig`]).
    pub tp: TpConfig,
    /// PP size.
    pub pp_size: u16,
    /// Control addresses of every PP rank, in rank order, for the vote mesh (this rank listens on its
    /// own entry). Empty when `pp_size` is 1.
    pub peers: Vec<SocketAddr>,
    /// The model's total layer count.
    pub total_layers: u32,
    /// Tokens per page.
    pub page_tokens: u32,
    /// This rank's pool layout (its layers only).
    pub layout: KvLayout,
    /// The deployment's shared secret: the decode side and the PP peers must prove they hold it
    /// before this rank sends them anything else (see `control`'s handshake). `None` means the
    /// empty secret, which any peer can prove; a warning is logged at start.
    pub token: Option<Secret>,
    /// Send a checksum of each chunk's bytes (the decode side verifies it).
    pub checksums: bool,
    /// Vote board settings (the rank and size are taken from this config).
    pub vote: VoteConfig,
    /// Bound on connecting and handshakes.
    pub connect_timeout: Duration,
    /// How long `send_chunk` waits for the decode side's page allocation of a request.
    pub request_wait: Duration,
    /// How chunk notifications are encoded for the decode side.
    pub notify_format: NotifyFormat,
    /// This rank's vote mesh socket, bound before the peers' addresses were shared. `None` binds
    /// `peers[pp_rank]` at start, which races with anything else on the host that takes ports
    /// (an address picked as free can be gone by then); with a socket its port is held throughout.
    pub mesh_socket: Option<Arc<MeshSocket>>,
    /// This start of the rank, carried in its Hello: decode and the PP peers never admit a smaller
    /// one for the rank again (see [`crate::core::membership`]). [`PrefillConfig::new`] draws it
    /// with [`fresh_incarnation`](super::fresh_incarnation), so a restarted process on the same
    /// host gets a larger one, even after the host's clock stepped back.
    pub incarnation: u64,
    /// Interval of the heartbeats sent on every control connection (to each decode, to each PP
    /// peer), announced in this rank's Hello: a peer declares this rank lost when it sends nothing
    /// for [`SILENT_INTERVALS`](super::SILENT_INTERVALS) of them, as this rank does a peer by the
    /// interval the peer announced (one that announces none, never). The interval announced also
    /// bounds, the same way, how long a peer may leave this rank's messages untaken, at most
    /// [`MAX_STALL`](super::MAX_STALL) (see [`PrefillStats::stalled_connections`]). `None`: no
    /// heartbeats (TCP keepalive still runs), and `MAX_STALL` for how long this rank may leave a
    /// peer's messages untaken.
    pub heartbeat: Option<Duration>,
    /// Serve Prometheus metrics of this engine on this address (`GET /metrics`); engines of one
    /// process naming the same address share one endpoint (see [`crate::metrics`]). `None` (the
    /// default): no endpoint.
    pub metrics: Option<SocketAddr>,
    /// What one decode may make this rank hold, and how many allocations may wait unread for
    /// [`PrefillEngine::next_request`] ([`PrefillLimits::default`]: the library's constants).
    pub limits: PrefillLimits,
}

/// Bounds on what peers and a caller that does not read make a prefill rank hold. Past them an
/// allocation is refused ([`PrefillStats::rejected_requests`]) or not queued
/// ([`PrefillStats::unread_dropped`]); each must be at least 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillLimits {
    /// Undecided requests one decode may have on this rank at once (at most `u32::MAX`).
    pub requests_per_decode: usize,
    /// Destination pages one decode's undecided requests here may name together, as a multiple
    /// of its pool.
    pub pages_per_decode_pool: u64,
    /// Ready allocations that may wait for [`PrefillEngine::next_request`] at once.
    pub unread: usize,
}

impl Default for PrefillLimits {
    /// [`MAX_REQUESTS_PER_DECODE`], [`PAGES_PER_DECODE_POOL`] and [`MAX_UNREAD`].
    fn default() -> Self {
        PrefillLimits {
            requests_per_decode: MAX_REQUESTS_PER_DECODE,
            pages_per_decode_pool: PAGES_PER_DECODE_POOL,
            unread: MAX_UNREAD,
        }
    }
}

/// A listening socket for a rank's vote mesh, bound before the rank starts: bind it with port 0,
/// share [`local_addr`](Self::local_addr) with the other ranks, then start the rank with it in
/// [`PrefillConfig::mesh_socket`]. The port stays this rank's from `bind` on.
#[derive(Debug)]
pub struct MeshSocket {
    socket: std::net::TcpListener,
}

impl MeshSocket {
    /// Binds and listens on `addr` (port 0 picks a free port).
    ///
    /// # Errors
    /// The bind failed.
    pub fn bind(addr: SocketAddr) -> std::io::Result<Self> {
        Ok(MeshSocket {
            socket: std::net::TcpListener::bind(addr)?,
        })
    }

    /// The bound address (the port the kernel picked for port 0).
    ///
    /// # Errors
    /// The socket could not be queried.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    /// A listener on the same socket for the engine (the caller's handle keeps it open too).
    fn listener(&self) -> Result<Listener, EngineError> {
        let dup = self.socket.try_clone().map_err(|source| {
            EngineError::Control(crate::control::ControlError::Bind {
                addr: "the vote mesh socket".into(),
                source,
            })
        })?;
        Ok(Listener::from_std(dup)?)
    }
}

/// The encoding of chunk notifications a prefill sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum NotifyFormat {
    /// Our binary v1 record (with checksums and failure codes).
    #[default]
    Binary,
    /// SGLang's NIXL text form `{room}_kv_{chunk}_{last}_{pp_rank}`, for a decode written against
    /// SGLang (no checksum; a failure is still sent as a binary record, which SGLang ignores).
    SglangText,
}

/// A decode side that does not speak our control plane (an SGLang or plain NIXL decode): what its
/// bootstrap exchanged out of band. Page allocations then come through [`PrefillEngine::add_request`].
#[derive(Debug, Clone)]
pub struct ExternalDecode {
    /// Its backend metadata (NIXL agent metadata or UCX worker address).
    pub metadata: Vec<u8>,
    /// Its registered KV pool.
    pub region: crate::transport::RemoteRegion,
    /// Its pool layout.
    pub layout: KvLayout,
}

impl PrefillConfig {
    /// Defaults around a layout: UCX, no token, checksums on.
    pub fn new(
        decode: SocketAddr,
        pp_rank: u16,
        pp_size: u16,
        total_layers: u32,
        page_tokens: u32,
        layout: KvLayout,
    ) -> Self {
        PrefillConfig {
            engine_id: format!("prefill-{pp_rank}"),
            backend: BackendConfig::default_for(
                crate::transport::BackendKind::Ucx,
                &format!("prefill-{pp_rank}"),
            ),
            decode,
            keep_open: false,
            instance: String::new(),
            pp_rank,
            tp: TpConfig::default(),
            pp_size,
            peers: Vec::new(),
            total_layers,
            page_tokens,
            layout,
            token: None,
            checksums: true,
            vote: VoteConfig::new(pp_size, pp_rank),
            connect_timeout: Duration::from_secs(10),
            request_wait: Duration::from_secs(10),
            notify_format: NotifyFormat::Binary,
            mesh_socket: None,
            incarnation: super::fresh_incarnation(),
            heartbeat: Some(super::DEFAULT_HEARTBEAT),
            metrics: None,
            limits: PrefillLimits::default(),
        }
    }
}

/// Names one decode engine a [`PrefillEngine`] writes into: the one it started with is 0, each
/// [`PrefillEngine::add_decode`] gets the next number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LinkId(pub u32);

/// A page allocation the decode side sent for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IncomingRequest {
    /// The request.
    pub request: RequestId,
    /// The decode engine that sent it.
    pub decode: LinkId,
    /// Its prompt length.
    pub prompt_tokens: u32,
    /// Its chunk size.
    pub chunk_tokens: u32,
    /// Tokens at the start of the prompt that decode already holds: the request moves the
    /// `prompt_tokens` after them, and chunk 0 starts at that token of the prompt.
    pub prefix_tokens: u32,
}

/// Counters of a [`PrefillEngine`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefillStats {
    /// Chunks whose writes and notification completed.
    pub chunks: u64,
    /// Bytes written.
    pub bytes: u64,
    /// Chunks that failed.
    pub failed_chunks: u64,
    /// Requests decided completed.
    pub decided_completed: u64,
    /// Requests decided failed.
    pub decided_failed: u64,
    /// Requests still undecided.
    pub undecided: u64,
    /// Requests this rank holds: allocated by a decode and not yet released
    /// ([`PrefillEngine::release`]), decided or not.
    pub requests: u64,
    /// Transfer requests rejected (bad pages, duplicates, past a decode's caps in
    /// [`PrefillConfig::limits`]).
    pub rejected_requests: u64,
    /// Bytes registered by the transport.
    pub registered_bytes: u64,
    /// Writes posted (after coalescing and splitting at registration boundaries); a write of
    /// many rows (sliced heads) counts once.
    pub writes: u64,
    /// Contiguous pieces those writes are made of: a write of `n` rows counts `n`.
    pub write_rows: u64,
    /// Requests the engine posted itself from offered pages ([`PrefillEngine::offer`]): every
    /// chunk handed to the transport, or waiting for a landing range decode is still copying from
    /// (it goes when decode frees it).
    pub offers_posted: u64,
    /// Chunks that found a landing range still holding an earlier chunk decode had not copied out
    /// yet, and waited for it (the grant's slots were too few to keep this rank's writes going).
    pub landing_waits: u64,
    /// Microseconds those chunks waited, together.
    pub landing_wait_micros: u64,
    /// Decode engines connected now.
    pub decodes: u64,
    /// Control messages dropped: from a decode engine about a request another decode engine owns,
    /// and of a kind no decode engine or PP peer sends once connected.
    pub refused: u64,
    /// Vote mesh connections closed before their handshake ended because a newer one took their
    /// place ([`MAX_PENDING_HANDSHAKES`](super::MAX_PENDING_HANDSHAKES) were in progress: the
    /// oldest of the busiest source address gives way), or gone before they could be set up.
    pub refused_connections: u64,
    /// Vote mesh connections refused because the peer did not prove the shared secret (or refused
    /// our proof).
    pub auth_failures: u64,
    /// Other failed vote mesh handshakes (not a higher PP rank, a stale start, timeouts...).
    pub handshake_failures: u64,
    /// Microseconds registering the pool took at start (for a pool the transport allocates, its
    /// allocation and population too).
    pub register_micros: u64,
    /// Decisions kept for [`PrefillEngine::decided`] and not yet released: those of requests
    /// this rank holds, and at most [`MAX_FOREIGN_DECISIONS`] of requests it never held (a
    /// decode's abort of a request whose allocation never came here, a peer rank's vote).
    pub decisions_held: u64,
    /// Failed votes this rank cast for requests it never held (a decode aborted them) that are
    /// not decided yet; at most [`MAX_UNKNOWN_ABORTS`] for each decode, beyond which such an
    /// abort is answered, counted in `refused` and casts no vote.
    pub unknown_aborts: u64,
    /// Ready allocations not queued for [`PrefillEngine::next_request`] because [`PrefillLimits::unread`]
    /// waited there unread: their requests go once decided, unless the caller posts or offers
    /// them.
    pub unread_dropped: u64,
    /// Decode and vote mesh connections cut because a message this side queued was not taken within
    /// three of the peer's heartbeat intervals of its being queued, at most
    /// [`MAX_STALL`](super::MAX_STALL) (`MAX_STALL` for a peer without heartbeats; a peer that
    /// reads nothing, or more slowly than this side queues): it was lost, as a silent peer is.
    pub stalled_connections: u64,
    /// Vote mesh connections to PP peers that ended (the peer closed, was lost, or went silent;
    /// an orderly end of the pipeline counts its peers' closes too): its missing votes fail their
    /// requests, and while this rank serves, a lower peer is connected to again.
    pub peer_losses: u64,
}

/// One decode engine this rank writes into: its transport peer, what this rank writes there, the
/// slot its notifications name, and where its control messages go.
struct Link {
    id: LinkId,
    addr: SocketAddr,
    peer: PeerId,
    planner: Planner,
    /// Tokens in one of decode's pages (its requests' page lists are in these).
    dst_page_tokens: u32,
    /// The rank its notifications name: its slot at the decode TP rank (its PP rank where TP
    /// is identical).
    notify_rank: u16,
    /// Bytes of one segment of decode's pool (its whole pool when it is one registration).
    dst_seg: u64,
    /// Bytes of decode's layout: `dst_seg` covers it when decode's pool is one registration.
    dst_whole: u64,
    writer: Outbox,
    /// How long decode may stay silent before the link is lost: three of the heartbeat intervals
    /// its Hello announced (our own for a decode outside our control plane). Its
    /// [`stall_bound`](super::stall_bound) is how long a message to it may wait to be taken before
    /// the link is cut.
    silence: Option<Duration>,
    /// The decode instance (server) this decode TP rank belongs to, as its Hello names it; empty
    /// when it names none. Allocations of one request from decode ranks of one named instance
    /// are one request here, written into each of them (see [`ReqState`]).
    decode_instance: String,
    /// Decode's TP rank and size.
    decode_tp: (u16, u16),
    /// How many of its instance's decode TP ranks this rank writes into (1 without a name).
    fan_out: usize,
    /// Decode's landing memory, if it announced one: its index in the regions given to the
    /// transport (after the pool's) and its length.
    landing: Option<(u32, u64)>,
}

struct LinkState {
    link: Arc<Link>,
    /// Chunks posted to this decode and not yet over.
    posted: u32,
    /// Its connection ended: nothing more is posted to it.
    closed: bool,
    /// Our Close goes once `posted` is 0 (then the link is forgotten).
    close_pending: bool,
    /// This decode's allocations (legs) of requests not decided yet, and the destination pages
    /// they name (a leg of none counts one): bounded by [`PrefillLimits::requests_per_decode`] and
    /// [`PrefillLimits::pages_per_decode_pool`] times decode's pool.
    live: u32,
    live_pages: u64,
}

impl LinkState {
    fn new(link: Arc<Link>) -> Self {
        LinkState {
            link,
            posted: 0,
            closed: false,
            close_pending: false,
            live: 0,
            live_pages: 0,
        }
    }

    /// Why one more live allocation of `pages` destination pages is refused, if it is.
    fn over_cap(&self, pages: usize, limits: &PrefillLimits) -> Option<String> {
        let units = (pages as u64).max(1);
        let times = limits.pages_per_decode_pool;
        let cap = u64::from(self.link.planner.dst().num_pages).saturating_mul(times);
        if self.live as usize >= limits.requests_per_decode {
            Some(format!(
                "this decode has {} undecided requests here already",
                self.live
            ))
        } else if self.live_pages.saturating_add(units) > cap {
            Some(format!(
                "this decode's undecided requests here name {} pages; with {units} more they would \
                 pass {cap}, {times} times its pool",
                self.live_pages
            ))
        } else {
            None
        }
    }
}

/// What one decode TP rank asked of a request: its pages, and this rank's chunks into them.
struct Leg {
    link: Arc<Link>,
    dst_pages: Arc<Vec<u32>>,
    /// Decode's landing range for this leg's writes, if it granted one.
    landing: Option<control::Landing>,
    /// Chunks posted to it and not yet over: writes that may still land in its pages.
    posted: u32,
    /// Its decode aborted the request while chunks were posted: acknowledge once they are over.
    ack_pending: bool,
    /// Chunks posted, over or not: a chunk goes once (again, it could write into a landing range
    /// a later chunk holds by then).
    sent: ChunkSet,
    /// Chunks whose writes and notification completed.
    done: ChunkSet,
    /// Chunks decode said it copied out of their landing range (`Landed`): where the grant's
    /// ranges are reused, chunk `c` is written only once chunk `c - slots` is here.
    landed: ChunkSet,
}

impl Leg {
    /// Whether chunk `chunk` may be written now: its landing range (if its grant reuses ranges)
    /// is no longer the earlier chunk's.
    fn range_free(&self, chunk: u32) -> bool {
        let Some(g) = self.landing else {
            return true;
        };
        let Some(before) = chunk.checked_sub(g.slots.max(1)) else {
            return true;
        };
        self.landed.contains(before)
    }
}

/// A request on this rank: one leg per decode TP rank it writes into (one, unless this rank's
/// heads go to several decode ranks of one instance, which all allocate the same request id).
struct ReqState {
    geometry: ChunkGeometry,
    /// Tokens decode already holds (its first allocation's prefix).
    prefix_tokens: u32,
    /// The engine took it from an offer and posts it ([`PrefillEngine::offer`]).
    offered: bool,
    /// The caller has it: every allocation came while it had not failed and it was queued for
    /// `next_request` (not dropped there, past [`PrefillLimits::unread`]), the caller gave the allocation
    /// itself (`add_request`), or it posted a chunk of it.
    /// One it never had is forgotten once decided, unless offered: nobody would release it.
    handed: bool,
    legs: Vec<Leg>,
    /// Legs the request has once every allocation came.
    expected: usize,
    failed: Option<FailureCode>,
    voted: bool,
    /// Its legs count against their decodes' caps ([`LinkState::live`]): from each allocation
    /// to the request's decision (or its release, if that comes first).
    counted: bool,
    /// The request's span on this rank, from its first allocation to its decision (taken and
    /// closed then, with the decision recorded); its chunks' spans are its children.
    span: Option<tracing::Span>,
}

impl ReqState {
    /// Every allocation came: chunks may go.
    fn ready(&self) -> bool {
        self.legs.len() >= self.expected
    }

    fn leg_mut(&mut self, link: LinkId) -> Option<&mut Leg> {
        self.legs.iter_mut().find(|l| l.link.id == link)
    }

    fn has_leg(&self, link: LinkId) -> bool {
        self.legs.iter().any(|l| l.link.id == link)
    }

    /// Chunks posted and not yet over, on every leg.
    fn posted(&self) -> u32 {
        self.legs.iter().map(|l| l.posted).sum()
    }

    /// Takes the request's legs off their decodes' caps, once: it was decided or released, and
    /// nothing more is posted to its pages.
    fn uncount(&mut self, links: &mut std::collections::BTreeMap<LinkId, LinkState>) {
        if !std::mem::take(&mut self.counted) {
            return;
        }
        for leg in &self.legs {
            if let Some(l) = links.get_mut(&leg.link.id) {
                l.live = l.live.saturating_sub(1);
                l.live_pages = l
                    .live_pages
                    .saturating_sub((leg.dst_pages.len() as u64).max(1));
            }
        }
    }

    /// Every chunk of every leg is over.
    fn complete(&self) -> bool {
        self.ready()
            && self
                .legs
                .iter()
                .all(|l| u64::from(l.done.count()) == self.geometry.num_chunks())
    }
}

struct State {
    requests: HashMap<RequestId, ReqState>,
    arrivals: HashMap<RequestId, Vec<oneshot::Sender<()>>>,
    board: VoteBoard,
    decided: HashMap<RequestId, Decision>,
    decided_waiters: HashMap<RequestId, Vec<oneshot::Sender<Decision>>>,
    peer_writers: Vec<Option<Outbox>>,
    /// The incarnation admitted last for each PP peer.
    mesh_incarnations: Incarnations,
    /// PP peers that said (with `Ready` on the mesh) that they attached their connection to us:
    /// their boards count us for requests from then on.
    mesh_confirmed: Vec<bool>,
    last_done_at: super::Stamps,
    /// When each request's LAST chunk was handed to the transport (the last 4096).
    last_posted_at: super::Stamps,
    /// The decode engines, open and closing.
    links: std::collections::BTreeMap<LinkId, LinkState>,
    next_link: u32,
    /// The engine closed (its last decode closed, without `keep_open`): nothing more is posted and
    /// no PP peer is connected to again.
    closed: bool,
    /// Where accepted allocations go for `next_request`; dropped when the engine closes.
    incoming: Option<mpsc::UnboundedSender<IncomingRequest>>,
    /// The mesh formed once and the decodes were told (`Ready`): from then on every mesh change
    /// is announced to them (`NotReady` on a loss, `Ready` when it formed again).
    announced: bool,
    /// Source pages offered for requests whose allocation is not complete yet
    /// ([`PrefillEngine::offer`]): the read loop that completes one posts it from them.
    offers: HashMap<RequestId, Vec<u32>>,
    /// Requests this rank never held that a decode aborted, and so voted failed on, not decided
    /// yet: the decode that aborted each (at most [`MAX_UNKNOWN_ABORTS`] each).
    unknown_aborts: HashMap<RequestId, LinkId>,
    /// Decisions in `decided` of requests this rank did not hold when they came, oldest first: at
    /// most [`MAX_FOREIGN_DECISIONS`] are kept.
    foreign_decided: std::collections::VecDeque<RequestId>,
}

impl State {
    /// The offered pages of `request`, whose allocation just became complete, marking it posted
    /// by the engine ([`PrefillEngine::offer`]).
    fn take_offer(&mut self, request: RequestId) -> Option<Vec<u32>> {
        let src = self.offers.remove(&request)?;
        if let Some(r) = self.requests.get_mut(&request) {
            r.offered = true;
        }
        Some(src)
    }

    /// Forgets the offer of a request that is over (decided, failed or released): its pages
    /// are never posted from after that.
    fn drop_offer(&mut self, request: RequestId) {
        self.offers.remove(&request);
    }

    /// Takes back `request`'s offer, if it still waits; true if it did. Where no allocation of
    /// it came, nothing will decide it here, so whoever waits for its decision hears now.
    fn withdraw_offer(&mut self, request: RequestId) -> bool {
        let had = self.offers.remove(&request).is_some();
        if had && !self.requests.contains_key(&request) {
            self.decided_waiters.remove(&request);
        }
        had
    }

    /// Every PP peer is connected and said it counts us.
    fn mesh_complete(&self, me: u16) -> bool {
        (0..self.peer_writers.len()).all(|r| {
            r == usize::from(me)
                || (self.peer_writers[r].is_some() && self.mesh_confirmed.get(r) == Some(&true))
        })
    }

    /// Sends `msg` to every open decode link.
    fn tell_decodes(&self, msg: &Msg) {
        for l in self.links.values().filter(|l| !l.closed) {
            let _ = l.link.writer.send(msg.clone());
        }
    }
}

/// What a rank's completed chunks wrote into one decode.
#[derive(Default, Clone, Copy)]
struct Written {
    bytes: u64,
    writes: u64,
}

#[derive(Default)]
struct Counters {
    chunks: AtomicU64,
    bytes: AtomicU64,
    failed_chunks: AtomicU64,
    decided_completed: AtomicU64,
    decided_failed: AtomicU64,
    rejected: AtomicU64,
    writes: AtomicU64,
    write_rows: AtomicU64,
    offers_posted: AtomicU64,
    landing_waits: AtomicU64,
    landing_wait_micros: AtomicU64,
    refused: AtomicU64,
    refused_connections: AtomicU64,
    auth_failures: AtomicU64,
    handshake_failures: AtomicU64,
    unread_dropped: AtomicU64,
    stalled_connections: AtomicU64,
    peer_losses: AtomicU64,
    /// Bytes and writes of completed chunks by decode (control address), for the metrics: one
    /// entry per decode this rank ever wrote into.
    by_peer: Mutex<std::collections::BTreeMap<SocketAddr, Written>>,
}

struct Inner {
    cfg: PrefillConfig,
    secret: Secret,
    transport: Arc<dyn Transport>,
    pool: super::pools::Pools,
    /// What this rank says in every decode handshake.
    hello: Hello,
    state: Mutex<State>,
    counters: Counters,
    timer: Arc<Notify>,
    /// Counts PP peer bindings, for the mesh's first formation to wait on.
    mesh_changed: tokio::sync::watch::Sender<u64>,
    /// PP peer tasks started after the engine, stopped when it is dropped.
    mesh_tasks: TaskGuard,
    /// Where each PP peer's vote mesh listens now (a restarted peer may listen elsewhere).
    peer_addrs: Mutex<Vec<SocketAddr>>,
    /// This engine's place in the process's metrics endpoint, if `cfg.metrics` asked for one.
    metrics: std::sync::OnceLock<crate::metrics::Joined>,
    /// How long registering the pool took at start, in microseconds.
    register_micros: u64,
    /// One gate per decode address an `add_decode` is connecting to: calls for one address run
    /// one after the other, so the later ones find the first one's link. An entry goes when its
    /// last caller leaves.
    linking: Mutex<HashMap<SocketAddr, Arc<tokio::sync::Mutex<()>>>>,
    /// The runtime the engine started on: offered requests are posted on tasks of it.
    runtime: tokio::runtime::Handle,
    /// Allocations queued for `next_request` and not read yet (at most [`PrefillLimits::unread`]).
    unread: AtomicUsize,
    /// Woken when decode says it copied a chunk out of a landing range (`Landed`) and when a
    /// request fails: chunks waiting for their range look again.
    landed: Notify,
}

impl Inner {
    /// The counters and state sizes [`PrefillEngine::stats`] reports.
    fn stats(&self) -> PrefillStats {
        let c = &self.counters;
        let (undecided, decodes, requests, decisions_held, unknown_aborts) = {
            let st = lock(&self.state);
            let open = st.links.values().filter(|l| !l.closed).count();
            (
                st.board.undecided() as u64,
                open as u64,
                st.requests.len() as u64,
                st.decided.len() as u64,
                st.unknown_aborts.len() as u64,
            )
        };
        PrefillStats {
            chunks: c.chunks.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            failed_chunks: c.failed_chunks.load(Ordering::Relaxed),
            decided_completed: c.decided_completed.load(Ordering::Relaxed),
            decided_failed: c.decided_failed.load(Ordering::Relaxed),
            undecided,
            requests,
            rejected_requests: c.rejected.load(Ordering::Relaxed),
            registered_bytes: self.transport.stats().registered_bytes,
            writes: c.writes.load(Ordering::Relaxed),
            write_rows: c.write_rows.load(Ordering::Relaxed),
            offers_posted: c.offers_posted.load(Ordering::Relaxed),
            landing_waits: c.landing_waits.load(Ordering::Relaxed),
            landing_wait_micros: c.landing_wait_micros.load(Ordering::Relaxed),
            decodes,
            refused: c.refused.load(Ordering::Relaxed),
            refused_connections: c.refused_connections.load(Ordering::Relaxed),
            auth_failures: c.auth_failures.load(Ordering::Relaxed),
            handshake_failures: c.handshake_failures.load(Ordering::Relaxed),
            register_micros: self.register_micros,
            decisions_held,
            unknown_aborts,
            unread_dropped: c.unread_dropped.load(Ordering::Relaxed),
            stalled_connections: c.stalled_connections.load(Ordering::Relaxed),
            peer_losses: c.peer_losses.load(Ordering::Relaxed),
        }
    }
}

impl crate::metrics::Source for Inner {
    fn collect(&self, out: &mut crate::metrics::Samples) {
        use crate::metrics::Value::{Counter, Gauge};
        let s = self.stats();
        let labels = crate::metrics::EngineLabels::new(
            "prefill",
            &self.cfg.engine_id,
            &self.cfg.backend.kind().to_string(),
        );
        let base = || labels.base();
        let with = |k: &'static str, v: &str| labels.with(k, v);
        for (peer, w) in self
            .counters
            .by_peer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
        {
            let peer = peer.to_string();
            out.add(
                "kvx_written_bytes",
                "Bytes of completed chunks written into each decode",
                with("peer", &peer),
                Counter(w.bytes),
            );
            out.add(
                "kvx_peer_writes",
                "Writes of completed chunks into each decode (as kvx_writes counts them)",
                with("peer", &peer),
                Counter(w.writes),
            );
        }
        out.add(
            "kvx_chunks",
            "Chunks by outcome",
            with("outcome", "complete"),
            Counter(s.chunks),
        );
        out.add(
            "kvx_chunks",
            "",
            with("outcome", "failed"),
            Counter(s.failed_chunks),
        );
        out.add(
            "kvx_writes",
            "Writes posted (after coalescing and splitting)",
            base(),
            Counter(s.writes),
        );
        out.add(
            "kvx_write_rows",
            "Contiguous pieces of the writes posted (a write of n rows counts n)",
            base(),
            Counter(s.write_rows),
        );
        out.add(
            "kvx_offers_posted",
            "Requests the engine posted itself from offered pages",
            base(),
            Counter(s.offers_posted),
        );
        out.add(
            "kvx_landing_waits",
            "Chunks that waited for decode to copy an earlier chunk out of their landing range",
            base(),
            Counter(s.landing_waits),
        );
        out.add(
            "kvx_landing_wait_microseconds",
            "Microseconds chunks waited for their landing range, together",
            base(),
            Counter(s.landing_wait_micros),
        );
        out.add(
            "kvx_requests_decided",
            "Requests decided by the PP vote, by decision",
            with("decision", "complete"),
            Counter(s.decided_completed),
        );
        out.add(
            "kvx_requests_decided",
            "",
            with("decision", "failed"),
            Counter(s.decided_failed),
        );
        out.add(
            "kvx_requests_rejected",
            "Transfer requests rejected (bad pages, duplicates, past a decode's cap)",
            base(),
            Counter(s.rejected_requests),
        );
        out.add(
            "kvx_messages_refused",
            "Control messages dropped: about a request another decode owns, or of a kind no peer sends once connected",
            base(),
            Counter(s.refused),
        );
        out.add(
            "kvx_connections_refused",
            "Connections closed before their handshake ended: a newer one took their place, or gone before they could be set up",
            base(),
            Counter(s.refused_connections),
        );
        out.add(
            "kvx_auth_failures",
            "Handshakes that failed authentication",
            base(),
            Counter(s.auth_failures),
        );
        out.add(
            "kvx_handshake_failures",
            "Handshakes that failed otherwise",
            base(),
            Counter(s.handshake_failures),
        );
        let gauge = |n: u64| Gauge(i64::try_from(n).unwrap_or(i64::MAX));
        out.add(
            "kvx_requests_undecided",
            "Requests not yet decided",
            base(),
            gauge(s.undecided),
        );
        out.add(
            "kvx_requests_held",
            "Requests this rank holds",
            base(),
            gauge(s.requests),
        );
        out.add(
            "kvx_decisions_held",
            "Decisions kept for the caller and not yet released",
            base(),
            gauge(s.decisions_held),
        );
        out.add(
            "kvx_unknown_aborts",
            "Failed votes cast for requests this rank never held, not yet decided",
            base(),
            gauge(s.unknown_aborts),
        );
        out.add(
            "kvx_allocations_unread_dropped",
            "Ready allocations not queued for next_request: as many waited unread already",
            base(),
            Counter(s.unread_dropped),
        );
        out.add(
            "kvx_connections_stalled",
            "Connections cut because a message was not taken within three of the peer's heartbeat intervals (at most 60 s; 60 s for a peer without heartbeats) of its being queued",
            base(),
            Counter(s.stalled_connections),
        );
        out.add(
            "kvx_pp_peer_losses",
            "Vote mesh connections to PP peers that ended",
            base(),
            Counter(s.peer_losses),
        );
        out.add(
            "kvx_registered_bytes",
            "Bytes registered with the transport",
            base(),
            gauge(s.registered_bytes),
        );
        out.add(
            "kvx_registrations",
            "Memory registrations of this engine",
            base(),
            gauge(self.transport.stats().regions),
        );
        out.add(
            "kvx_decodes",
            "Decode engines linked now",
            base(),
            gauge(s.decodes),
        );
    }
}

/// One prefill PP rank. Cheap to clone.
#[derive(Clone)]
pub struct PrefillEngine {
    inner: Arc<Inner>,
    incoming: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<IncomingRequest>>>,
    _tasks: Arc<TaskGuard>,
}

impl std::fmt::Debug for PrefillEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillEngine")
            .field("pp_rank", &self.inner.cfg.pp_rank)
            .finish()
    }
}

struct TaskGuard(Mutex<Vec<tokio::task::JoinHandle<()>>>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        if let Ok(tasks) = self.0.lock() {
            for t in tasks.iter() {
                t.abort();
            }
        }
    }
}

fn lock_peers(inner: &Inner) -> std::sync::MutexGuard<'_, Vec<SocketAddr>> {
    inner
        .peer_addrs
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn lock_linking(
    inner: &Inner,
) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Arc<tokio::sync::Mutex<()>>>> {
    inner
        .linking
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    // Our state machines never panic mid-update, so a poisoned lock still guards whole state.
    state.lock().unwrap_or_else(|e| e.into_inner())
}

impl PrefillEngine {
    /// Registers `pool`, connects to the decode engine and to every PP peer.
    ///
    /// # Errors
    /// Transport, control-plane or layout errors; a mesh that does not form within
    /// `connect_timeout`.
    ///
    /// # Cancel safety
    /// Not cancel-safe: dropping it mid-way drops half-made connections (nothing leaks).
    pub async fn start(cfg: PrefillConfig, pool: Pool) -> Result<Self, EngineError> {
        Self::start_with(cfg, vec![pool], None).await
    }

    /// [`start`](Self::start) with the pool in several registrations: `pools` split this rank's
    /// layout into equal, consecutive segments, in order (one buffer per layer and per K and V, for
    /// instance). Writes are split at segment boundaries on both sides.
    ///
    /// # Errors
    /// As [`start`](Self::start); also pools that do not split the layout evenly.
    pub async fn start_regions(cfg: PrefillConfig, pools: Vec<Pool>) -> Result<Self, EngineError> {
        Self::start_with(cfg, pools, None).await
    }

    /// Like [`start`](Self::start), for a decode side that does not speak our control plane: writes
    /// go to `decode`'s pool, page allocations come through [`add_request`](Self::add_request), and
    /// there are no Abort or AbortAck messages (`cfg.decode` is not used). PP peers still vote.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    ///
    /// # Cancel safety
    /// As [`start`](Self::start).
    pub async fn start_external(
        cfg: PrefillConfig,
        pool: Pool,
        decode: ExternalDecode,
    ) -> Result<Self, EngineError> {
        Self::start_with(cfg, vec![pool], Some(decode)).await
    }

    async fn start_with(
        cfg: PrefillConfig,
        pools: Vec<Pool>,
        external: Option<ExternalDecode>,
    ) -> Result<Self, EngineError> {
        cfg.tp.validate(&cfg.layout)?;
        super::check_heartbeat(cfg.heartbeat)?;
        let l = cfg.limits;
        if l.requests_per_decode == 0 || l.pages_per_decode_pool == 0 || l.unread == 0 {
            return Err(EngineError::Config(format!(
                "every prefill limit must be at least 1: {l:?}"
            )));
        }
        if u32::try_from(l.requests_per_decode).is_err() {
            return Err(EngineError::Config(format!(
                "requests_per_decode {} is over {}",
                l.requests_per_decode,
                u32::MAX
            )));
        }
        if cfg.pp_rank >= cfg.pp_size {
            return Err(EngineError::Config(format!(
                "pp_rank {} not below pp_size {}",
                cfg.pp_rank, cfg.pp_size
            )));
        }
        if cfg.pp_size > 1 && cfg.peers.len() != usize::from(cfg.pp_size) {
            return Err(EngineError::Config(format!(
                "{} peer addresses for pp_size {}",
                cfg.peers.len(),
                cfg.pp_size
            )));
        }
        if let (Some(socket), true) = (&cfg.mesh_socket, cfg.pp_size > 1) {
            let port = socket.local_addr().map(|a| a.port()).unwrap_or(0);
            let listed = cfg.peers[usize::from(cfg.pp_rank)];
            if port != listed.port() {
                return Err(EngineError::Config(format!(
                    "the mesh socket is on port {port}, but peers lists {listed} for rank {}",
                    cfg.pp_rank
                )));
            }
        }
        if pools.iter().map(|p| p.desc().len()).sum::<u64>() < cfg.layout.buffer_len {
            return Err(EngineError::Config("pool smaller than its layout".into()));
        }
        super::pools::segment(
            cfg.layout.buffer_len,
            pools.len(),
            pools.iter().map(|p| p.desc().len()).min().unwrap_or(0),
        )?;
        // Prefill receives no notifications; peer failures surface as failed posts.
        let sink: Sink = Arc::new(|_| {});
        let transport = cfg.backend.build(sink)?;
        let t0 = Instant::now();
        let pool = super::pools::Pools::register_blocking(&transport, pools, cfg.layout.buffer_len)
            .await?;
        let register_micros = crate::transport::micros_since(t0);
        tracing::info!(
            pp_rank = cfg.pp_rank,
            bytes = cfg.layout.buffer_len,
            register_micros,
            "prefill pool registered"
        );
        let deadline = tokio::time::Instant::now() + cfg.connect_timeout;
        let notify_key: u64 = rand::random();

        // The vote mesh listener first, so peers can connect while we talk to decode.
        let listener = match (&cfg.mesh_socket, cfg.pp_size > 1) {
            (_, false) => None,
            (Some(socket), true) => Some(socket.listener()?),
            (None, true) => Some(Listener::bind(cfg.peers[usize::from(cfg.pp_rank)]).await?),
        };

        let secret = cfg.token.clone().unwrap_or_else(Secret::none);
        if secret.is_none() {
            tracing::warn!(
                pp_rank = cfg.pp_rank,
                "no shared secret configured: any process that reaches the PP peers' ports can forge votes"
            );
        }
        let mut hello = Hello::new(
            cfg.engine_id.clone(),
            Role::Prefill,
            layout_info(cfg.total_layers, cfg.page_tokens, &cfg.layout, &cfg.tp),
            BackendInfo {
                kind: to_wire_kind(transport.kind()),
                // Nobody connects to a prefill's transport or writes into its pool: its address and
                // registration stay in this process. NIXL names the sender of a notification itself.
                worker_or_agent: Vec::new(),
                agent_name: transport.name(),
                regions: Vec::new(),
                landing: None,
            },
        )
        .with_pp(cfg.pp_rank, cfg.pp_size)
        .with_tp(cfg.tp.rank, cfg.tp.size)
        .with_incarnation(cfg.incarnation)
        .with_instance(cfg.instance.clone())
        .with_heartbeat(cfg.heartbeat);
        hello.notify_key = notify_key;
        let (conn, link) = match external {
            None => {
                let t1 = Instant::now();
                let (conn, remote) = connect_decode(&cfg, &hello, &secret, deadline).await?;
                tracing::info!(
                    pp_rank = cfg.pp_rank,
                    decode = %cfg.decode,
                    handshake_micros = crate::transport::micros_since(t1),
                    "decode connected"
                );
                let (writer, rx) = Outbox::new();
                let link = plan_link(
                    &cfg,
                    &transport,
                    notify_key,
                    LinkId(0),
                    cfg.decode,
                    &remote,
                    writer,
                )?;
                (Some((conn, rx)), link)
            }
            // A decode outside our control plane is this rank's TP peer, byte for byte; nothing
            // reads its control messages.
            Some(x) => {
                let link = external_link(&cfg, &transport, notify_key, x)?;
                (None, link)
            }
        };

        let mut vote_cfg = cfg.vote.clone();
        vote_cfg.pp_size = cfg.pp_size;
        vote_cfg.my_rank = cfg.pp_rank;
        let board = VoteBoard::new(vote_cfg)?;
        let cfg_peers = cfg.peers.clone();
        let (itx, irx) = mpsc::unbounded_channel();
        let link = Arc::new(link);
        let mut links = std::collections::BTreeMap::new();
        links.insert(link.id, LinkState::new(link.clone()));
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                requests: HashMap::new(),
                arrivals: HashMap::new(),
                board,
                decided: HashMap::new(),
                decided_waiters: HashMap::new(),
                peer_writers: (0..cfg.pp_size).map(|_| None).collect(),
                mesh_incarnations: Incarnations::new(cfg.pp_size),
                mesh_confirmed: vec![false; usize::from(cfg.pp_size)],
                last_done_at: super::Stamps::default(),
                last_posted_at: super::Stamps::default(),
                links,
                next_link: 1,
                closed: false,
                incoming: conn.is_some().then(|| itx.clone()),
                announced: false,
                offers: HashMap::new(),
                unknown_aborts: HashMap::new(),
                foreign_decided: std::collections::VecDeque::new(),
            }),
            cfg,
            secret,
            transport,
            pool,
            hello: hello.clone(),
            counters: Counters::default(),
            timer: Arc::new(Notify::new()),
            mesh_changed: tokio::sync::watch::channel(0).0,
            mesh_tasks: TaskGuard(Mutex::new(Vec::new())),
            peer_addrs: Mutex::new(cfg_peers),
            metrics: std::sync::OnceLock::new(),
            register_micros,
            linking: Mutex::new(HashMap::new()),
            runtime: tokio::runtime::Handle::current(),
            landed: Notify::new(),
            unread: AtomicUsize::new(0),
        });
        if let Some(addr) = inner.cfg.metrics {
            let source: std::sync::Weak<dyn crate::metrics::Source> = Arc::downgrade(&inner) as _;
            let joined = crate::metrics::join(addr, source)
                .await
                .map_err(|e| EngineError::Config(format!("metrics endpoint on {addr}: {e}")))?;
            let _ = inner.metrics.set(joined);
        }
        let mut tasks = Vec::new();
        if let Some((conn, rx)) = conn {
            let (reader, writer) = conn.into_split();
            let cut = Arc::new(Notify::new());
            tasks.push(tokio::spawn(super::write_loop(
                writer,
                rx,
                inner.cfg.heartbeat,
                (super::stall_bound(link.silence), cut.clone()),
            )));
            tasks.push(tokio::spawn(decode_read_loop(
                Arc::downgrade(&inner),
                link.clone(),
                reader,
                itx,
                cut,
            )));
        } else {
            drop(itx);
        }
        tasks.extend([tokio::spawn(super::run_timer(
            Arc::downgrade(&inner),
            inner.timer.clone(),
            |i: &Inner| {
                let mut st = lock(&i.state);
                st.board.handle_timeout(Instant::now());
                i.vote_for_unheld(&mut st);
                i.flush_board(&mut st);
                st.board.poll_timeout()
            },
        ))]);
        if let Some(listener) = listener {
            match form_mesh(&inner, listener, &hello, deadline).await {
                Ok(mesh) => tasks.extend(mesh),
                Err(e) => {
                    // Nothing of a start that failed keeps running.
                    for t in &tasks {
                        t.abort();
                    }
                    return Err(e);
                }
            }
        }
        // Every PP peer is connected: decode may ask this rank for requests now.
        lock(&inner.state).announced = true;
        let _ = link.writer.send(Msg::Ready);
        Ok(PrefillEngine {
            inner,
            incoming: Arc::new(tokio::sync::Mutex::new(irx)),
            _tasks: Arc::new(TaskGuard(Mutex::new(tasks))),
        })
    }

    /// The next page allocation a decode engine sent (accepted ones only); `None` once the engine
    /// closed (its last decode closed its connection, without [`PrefillConfig::keep_open`]). A
    /// server whose scheduler already knows its requests need not call it: at most
    /// [`PrefillLimits::unread`] wait unread ([`PrefillStats::unread_dropped`]).
    ///
    /// # Cancel safety
    /// Cancel-safe: an allocation not yet returned stays queued.
    pub async fn next_request(&self) -> Option<IncomingRequest> {
        let next = self.incoming.lock().await.recv().await?;
        self.inner.unread.fetch_sub(1, Ordering::Relaxed);
        Some(next)
    }

    /// Connects to one more decode engine (another decode instance, or another decode TP rank)
    /// at `addr`: its requests come through [`next_request`](Self::next_request) beside the
    /// others', with the same pool, transport and vote mesh. A decode already connected at `addr`
    /// keeps its link, whose id is returned.
    ///
    /// # Errors
    /// The engine closed ([`EngineError::Shutdown`]), the connection or handshake failed within
    /// `connect_timeout`, or decode's layout does not fit this rank's.
    ///
    /// # Cancel safety
    /// Not cancel-safe: dropping it mid-way drops a half-made connection (nothing leaks).
    pub async fn add_decode(&self, addr: SocketAddr) -> Result<LinkId, EngineError> {
        let gate = lock_linking(&self.inner).entry(addr).or_default().clone();
        let result = {
            let _turn = gate.lock().await;
            self.link_decode(addr).await
        };
        let mut linking = lock_linking(&self.inner);
        // The map's handle and ours: no other caller waits at this gate.
        if Arc::strong_count(&gate) == 2 {
            linking.remove(&addr);
        }
        result
    }

    /// [`add_decode`](Self::add_decode), once no other call for `addr` is connecting.
    async fn link_decode(&self, addr: SocketAddr) -> Result<LinkId, EngineError> {
        let inner = &self.inner;
        {
            let st = lock(&inner.state);
            if st.closed {
                return Err(EngineError::Shutdown);
            }
            if let Some(l) = st.links.values().find(|l| !l.closed && l.link.addr == addr) {
                return Ok(l.link.id);
            }
        }
        let deadline = tokio::time::Instant::now() + inner.cfg.connect_timeout;
        let (conn, remote) =
            connect_taken(addr, &inner.hello, &inner.secret, deadline, Dialed::Decode).await?;
        let (writer, rx) = Outbox::new();
        // The id is taken now, under the lock: concurrent calls (one per decode rank, say) each
        // get their own, and none overwrites another's link when it is inserted.
        let id = {
            let mut st = lock(&inner.state);
            let id = LinkId(st.next_link);
            st.next_link = st.next_link.saturating_add(1);
            id
        };
        let link = Arc::new(plan_link(
            &inner.cfg,
            &inner.transport,
            inner.hello.notify_key,
            id,
            addr,
            &remote,
            writer,
        )?);
        let incoming = {
            let mut st = lock(&inner.state);
            match (st.closed, st.incoming.clone()) {
                (false, Some(incoming)) => {
                    st.links.insert(id, LinkState::new(link.clone()));
                    incoming
                }
                _ => {
                    drop(st);
                    inner.transport.disconnect(link.peer);
                    return Err(EngineError::Shutdown);
                }
            }
        };
        let (reader, w) = conn.into_split();
        let cut = Arc::new(Notify::new());
        let stall = (super::stall_bound(link.silence), cut.clone());
        inner.keep_task(tokio::spawn(super::write_loop(
            w,
            rx,
            inner.cfg.heartbeat,
            stall,
        )));
        inner.keep_task(tokio::spawn(decode_read_loop(
            Arc::downgrade(inner),
            link.clone(),
            reader,
            incoming,
            cut,
        )));
        // Decode may ask this rank for requests once the vote mesh is whole; if a link of it is
        // down now, the Ready goes when it formed again.
        {
            let st = lock(&inner.state);
            if st.mesh_complete(inner.cfg.pp_rank) {
                let _ = link.writer.send(Msg::Ready);
            }
        }
        tracing::info!(decode = %addr, link = id.0, "prefill rank serves one more decode engine");
        Ok(id)
    }

    /// The decode engines connected now, with their control addresses.
    pub fn decodes(&self) -> Vec<(LinkId, SocketAddr)> {
        lock(&self.inner.state)
            .links
            .values()
            .filter(|l| !l.closed)
            .map(|l| (l.link.id, l.link.addr))
            .collect()
    }

    /// This start's incarnation (as its Hello carries it).
    pub fn incarnation(&self) -> u64 {
        self.inner.cfg.incarnation
    }

    /// PP peer `rank` listens for the vote mesh at `addr` now (a restarted peer registered a new
    /// address): reconnection goes there from now on.
    pub fn set_peer_address(&self, rank: u16, addr: SocketAddr) {
        if let Some(a) = lock_peers(&self.inner).get_mut(usize::from(rank)) {
            *a = addr;
        }
    }

    /// Gives this rank a request's page allocation directly, for a decode side that does not speak
    /// our control plane (see [`start_external`](Self::start_external)).
    ///
    /// # Errors
    /// The allocation is refused (pages out of range or repeated, a count that does not fit the
    /// prompt, a request already known), as decode's TransferRequest would be.
    pub fn add_request(
        &self,
        request: RequestId,
        prompt_tokens: u32,
        chunk_tokens: u32,
        dst_pages: Vec<u32>,
    ) -> Result<(), EngineError> {
        // The first link: the external decode (or, for an engine started with our control plane,
        // the decode it started with).
        let link = lock(&self.inner.state)
            .links
            .get(&LinkId(0))
            .map(|l| l.link.clone())
            .ok_or(EngineError::Shutdown)?;
        let offered = self
            .inner
            .accept_request(
                &link,
                control::TransferRequest {
                    request: request.0,
                    prompt_tokens,
                    chunk_tokens,
                    dst_pages,
                    prefix_tokens: 0,
                    deadline_ms: 0,
                    landing: None,
                },
                None,
            )
            .map_err(|reason| {
                EngineError::Config(format!("request {} refused: {reason}", request.0))
            })?;
        if let Some(src) = offered {
            self.inner.start_offered(request, src);
        }
        Ok(())
    }

    /// This rank.
    pub fn pp_rank(&self) -> u16 {
        self.inner.cfg.pp_rank
    }

    /// This rank's TP rank, size and mapping ([`PrefillConfig::tp`]).
    pub fn tp(&self) -> TpConfig {
        self.inner.cfg.tp
    }

    /// The prefill instance this rank belongs to ([`PrefillConfig::instance`]).
    pub fn instance(&self) -> &str {
        &self.inner.cfg.instance
    }

    /// Copies `src` into this rank's pool at `offset` (host pools): how a server (or a benchmark)
    /// puts a request's KV into pages before sending them. Write only pages that no chunk in flight
    /// reads.
    ///
    /// # Errors
    /// [`EngineError::Memory`] for a range outside the pool or a device pool.
    pub fn write_pool(&self, offset: u64, src: &[u8]) -> Result<(), EngineError> {
        Ok(self.inner.pool.write_at(offset, src)?)
    }

    /// Copies `dst.len()` bytes at `offset` out of this rank's pool (host pools).
    ///
    /// # Errors
    /// [`EngineError::Memory`] for a range outside the pool or a device pool.
    pub fn read_pool(&self, offset: u64, dst: &mut [u8]) -> Result<(), EngineError> {
        Ok(self.inner.pool.read_at(offset, dst)?)
    }

    /// Writes chunk `chunk` of `request`: every layer of this rank for the pages the chunk completes
    /// (see [`crate::core::planner`]), then its notification. `src_pages` lists the request's pages in
    /// this rank's pool, one per page of the prompt (of this rank's page size: where decode's
    /// pages differ, as many as the tokens of decode's request span here, `ceil(prompt_tokens /
    /// page_tokens)`; a caller with fewer may repeat its last page, whose extra tokens land past the
    /// prompt in decode's last page). `last` marks the rank's final chunk; its
    /// completion casts this rank's vote.
    ///
    /// Waits (up to `request_wait`) for the decode side's page allocation if it has not arrived.
    /// Where decode lent landing memory whose ranges the request's chunks reuse, it also waits
    /// until decode copied chunk `chunk - slots` out of the range (`Landed`); that wait has no
    /// bound of its own: it ends when the request fails here (decode's abort, a lost link).
    ///
    /// # Errors
    /// The request failed or was aborted, the pages do not plan, or the writes failed (then the
    /// request is failed on both sides).
    ///
    /// # Cancel safety
    /// Dropping the future after the writes were posted does not cancel them: the registration stays
    /// alive until the transport reports them over, and the vote is still cast.
    pub async fn send_chunk(
        &self,
        request: RequestId,
        chunk: u32,
        src_pages: &[u32],
        last: bool,
    ) -> Result<(), EngineError> {
        send_chunk_of(&self.inner, request, chunk, src_pages, last).await
    }

    /// Offers `request`'s source pages before decode asks for it: the prompt's pages from its
    /// first token on, in token order. Once every decode rank the request goes to has sent its
    /// allocation, the engine posts every chunk itself, from the page where decode's prefix
    /// ends, on a task of its runtime spawned by the task that read the last allocation: no
    /// caller's thread has to wake between decode's request and the writes. An offered request does not come through
    /// [`next_request`](Self::next_request), except where its allocation was complete before
    /// the offer: then posting starts here, and whoever reads that allocation from
    /// `next_request` must not post it too. Pages that do not cover decode's request (fewer than
    /// its prefix and prompt span) fail it as [`FailureCode::Aborted`] on both sides; a chunk
    /// that cannot be posted fails it as [`FailureCode::WriteFailed`]. Either way the pages are
    /// the engine's until [`decided`](Self::decided) resolves, or until
    /// [`withdraw`](Self::withdraw) returns true.
    ///
    /// # Errors
    /// The engine closed ([`EngineError::Shutdown`]); the request offered or decided already,
    /// failed already ([`EngineError::RequestFailed`]), or already being posted
    /// ([`EngineError::Config`]); more than [`MAX_OFFERS`] offers waiting. An offer is dropped
    /// when its request fails, is decided or released, and when the engine closes.
    pub fn offer(&self, request: RequestId, src_pages: Vec<u32>) -> Result<(), EngineError> {
        let inner = &self.inner;
        {
            let mut st = lock(&inner.state);
            if st.closed {
                return Err(EngineError::Shutdown);
            }
            if st.offers.contains_key(&request) || st.decided.contains_key(&request) {
                return Err(EngineError::Config(format!(
                    "request {} is offered or decided already",
                    request.0
                )));
            }
            let ready = match st.requests.get_mut(&request) {
                Some(r) if r.failed.is_some() => {
                    let code = r.failed.unwrap_or(FailureCode::Aborted);
                    return Err(EngineError::RequestFailed { request, code });
                }
                Some(r)
                    if r.offered
                        || r.voted
                        || r.legs.iter().any(|l| l.posted > 0 || l.done.count() > 0) =>
                {
                    return Err(EngineError::Config(format!(
                        "request {} is being posted already",
                        request.0
                    )));
                }
                Some(r) if r.ready() => {
                    r.offered = true;
                    true
                }
                Some(_) | None => false,
            };
            if !ready {
                if st.offers.len() >= MAX_OFFERS {
                    return Err(EngineError::Config(format!(
                        "{MAX_OFFERS} offers wait for their allocations already"
                    )));
                }
                st.offers.insert(request, src_pages);
                return Ok(());
            }
        }
        inner.start_offered(request, src_pages);
        Ok(())
    }

    /// Takes back an offer that nothing was posted from: true where it still waited for its
    /// allocation (its pages are the caller's again; an allocation that completes later comes
    /// through [`next_request`](Self::next_request)), false where there is no such offer (never
    /// made, or posting started: the pages are the engine's until [`decided`](Self::decided)).
    pub fn withdraw(&self, request: RequestId) -> bool {
        lock(&self.inner.state).withdraw_offer(request)
    }

    /// Sends the decode engine of `request` a small payload beside the pages (at most
    /// [`MAX_AUX_LEN`](crate::control::MAX_AUX_LEN) bytes; decode reads it with `DecodeEngine::aux`).
    /// Send it after the request's allocation arrived and before its last chunk; it travels on the
    /// control connection.
    ///
    /// # Errors
    /// A payload over the bound, a request whose allocation has not arrived
    /// ([`EngineError::UnknownRequest`]), or a decode side without our control plane.
    pub fn send_aux(&self, request: RequestId, data: Vec<u8>) -> Result<(), EngineError> {
        if data.len() > control::MAX_AUX_LEN {
            return Err(EngineError::Config(format!(
                "aux payload of {} bytes is over {}",
                data.len(),
                control::MAX_AUX_LEN
            )));
        }
        let links: Vec<Arc<Link>> = lock(&self.inner.state)
            .requests
            .get(&request)
            .map(|r| r.legs.iter().map(|l| l.link.clone()).collect())
            .ok_or(EngineError::UnknownRequest(request))?;
        // Every decode rank the request goes to reads the payload.
        for link in links {
            link.writer
                .send(Msg::Aux(control::AuxData {
                    request: request.0,
                    data: data.clone(),
                }))
                .map_err(|_| EngineError::Shutdown)?;
        }
        Ok(())
    }

    /// Fails `request` from this rank: tells the decode side (a FAILURE notification) and votes failed.
    pub fn fail(&self, request: RequestId, code: FailureCode) {
        self.inner.fail_local(request, code);
    }

    /// Resolves once every PP rank voted on `request` (failure wins once all are terminal). Until then
    /// the request's source pages must not be reused.
    ///
    /// # Cancel safety
    /// Cancel-safe.
    pub async fn decided(&self, request: RequestId) -> Decision {
        let rx = {
            let mut st = lock(&self.inner.state);
            if let Some(d) = st.decided.get(&request) {
                return *d;
            }
            let (tx, rx) = oneshot::channel();
            st.decided_waiters.entry(request).or_default().push(tx);
            rx
        };
        rx.await.unwrap_or(Decision::Failed {
            rank: self.inner.cfg.pp_rank,
            cause: crate::core::vote::FailCause::PeerLost,
        })
    }

    /// The PP ranks' decision on `request` if they made it and this rank still keeps it, without
    /// waiting and without registering anything: a caller still waiting for the request's
    /// allocation learns this way that decode gave it up ([`DecodeEngine::abandon`]).
    ///
    /// [`DecodeEngine::abandon`]: crate::DecodeEngine::abandon
    pub fn decision(&self, request: RequestId) -> Option<Decision> {
        lock(&self.inner.state).decided.get(&request).copied()
    }

    /// Forgets a decided request's bookkeeping (call after reusing its pages).
    pub fn release(&self, request: RequestId) {
        let mut st = lock(&self.inner.state);
        st.decided.remove(&request);
        if let Some(mut r) = st.requests.remove(&request) {
            r.uncount(&mut st.links);
        }
        st.drop_offer(request);
    }

    /// When this rank's LAST chunk of `request` was over (its writes remotely complete and its
    /// notification sent), seen on the transport's progress thread; taken once, kept for the last
    /// 4096 requests.
    pub fn last_chunk_done_at(&self, request: RequestId) -> Option<Instant> {
        lock(&self.inner.state).last_done_at.take(request)
    }

    /// When this rank's LAST chunk of `request` was handed to the transport (its writes and
    /// notification posted); taken once, kept for the last 4096 requests.
    pub fn last_chunk_posted_at(&self, request: RequestId) -> Option<Instant> {
        lock(&self.inner.state).last_posted_at.take(request)
    }

    /// Counters.
    pub fn stats(&self) -> PrefillStats {
        self.inner.stats()
    }

    /// The address of the metrics endpoint this engine reports to, if its config asked for one
    /// (the bound port where it asked for port 0).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.inner.metrics.get().map(crate::metrics::Joined::addr)
    }

    /// Transport counters (in flight, registered bytes...), for resource checks.
    pub fn transport_stats(&self) -> crate::transport::TransportStats {
        self.inner.transport.stats()
    }
}

/// A request ready to send: its geometry, its legs (decode rank and destination pages) and its
/// span.
type Ready = (ChunkGeometry, Vec<LegTarget>, Option<tracing::Span>);

/// Where one leg's chunks go: the decode rank, its pages, and its landing grant.
type LegTarget = (Arc<Link>, Arc<Vec<u32>>, Option<control::Landing>);

/// One leg's share of a chunk, planned: the writes, the notification that follows them, and the
/// bytes they move.
struct LegPost {
    writes: Vec<WriteOp>,
    notification: Vec<u8>,
    bytes: u64,
}

impl Inner {
    /// The writes of `plan` (chunk `chunk` of `request` into `link`) into decode's landing range
    /// `landing`: its rows packed one after another from the chunk's place in the range.
    fn plan_landing(
        &self,
        request: RequestId,
        chunk: u32,
        link: &Link,
        landing: Option<control::Landing>,
        plan: &[Write],
        writes: &mut Vec<WriteOp>,
    ) -> Result<(), EngineError> {
        let (Some(g), Some((index, _))) = (landing, link.landing) else {
            return Err(EngineError::Config(format!(
                "request {} was granted landing memory by a decode that announced none",
                request.0
            )));
        };
        let bytes: u64 = plan.iter().map(Write::bytes).sum();
        let mut at = g
            .chunk_stride
            .checked_mul(u64::from(chunk % g.slots.max(1)))
            .and_then(|o| o.checked_add(g.offset))
            .filter(|_| bytes <= g.chunk_stride)
            .ok_or_else(|| {
                EngineError::Config(format!(
                    "chunk {chunk} of request {} ({bytes} bytes) does not fit its landing range \
                     ({} bytes a chunk)",
                    request.0, g.chunk_stride
                ))
            })?;
        match self.pool.single() {
            Some(local) => {
                for w in plan {
                    let packed = w.rows < 2 || w.src_stride == w.len;
                    writes.push(WriteOp {
                        local: local.id(),
                        local_offset: w.src_offset,
                        remote: index,
                        remote_offset: at,
                        len: if packed { w.bytes() } else { w.len },
                        rows: if packed { 1 } else { w.rows },
                        local_stride: if packed { 0 } else { w.src_stride },
                        remote_stride: if packed { 0 } else { w.len },
                    });
                    at += w.bytes();
                }
            }
            None => {
                let src_seg = self.pool.segment_len();
                for w in plan {
                    for (src, _) in w.pieces() {
                        for (si, soff, n, pos) in super::pools::split(src, w.len, src_seg) {
                            let local = self.pool.id(si).ok_or_else(|| {
                                EngineError::Config(format!("write at {src} is outside the pool"))
                            })?;
                            writes.push(WriteOp::new(local, soff, index, at + pos, n));
                        }
                        at += w.len;
                    }
                }
            }
        }
        Ok(())
    }

    /// Plans chunk `chunk` of `request` into one decode rank (`link`, whose pages are `dst_pages`).
    #[allow(clippy::too_many_arguments)]
    fn plan_leg(
        &self,
        request: RequestId,
        chunk: u32,
        status: ChunkStatus,
        geometry: &ChunkGeometry,
        link: &Link,
        dst_pages: &[u32],
        landing: Option<control::Landing>,
        src_pages: &[u32],
    ) -> Result<LegPost, EngineError> {
        let mut plan: Vec<Write> = Vec::new();
        link.planner
            .plan_chunk(geometry, u64::from(chunk), src_pages, dst_pages, &mut plan)
            .map_err(|source| EngineError::Plan {
                request: Some(request),
                source,
            })?;
        let mut n = ChunkNotification::new(request, link.notify_rank, chunk, status);
        if self.cfg.checksums && self.pool.desc().is_some_and(|d| d.kind() == MemKind::Host) {
            let mut h = ChunkHasher::new();
            for w in &plan {
                // The planner bounds-checked every range against the layout, which fits the pool.
                for (src, _) in w.pieces() {
                    self.pool.read_pieces(src, w.len, |b| h.update(b))?;
                }
            }
            n = n.with_checksum(h.finish());
        }
        // When the chunk goes to the transport, on the wall clock decode can compare with its own
        // (decode's last-post-to-Complete histogram).
        n = n.with_posted(crate::core::notify::wall_us());
        let mut writes: Vec<WriteOp> = Vec::with_capacity(plan.len());
        match (self.pool.single(), link.dst_seg >= link.dst_whole) {
            // Decode lent landing memory for this leg: the chunk's rows go there packed, in plan
            // order, and decode copies them into its pages.
            _ if landing.is_some() => {
                self.plan_landing(request, chunk, link, landing, &plan, &mut writes)?
            }
            // One registration on each side (the usual pools): the plan's offsets are the writes'.
            // Rows stay one write: the transport makes them.
            (Some(local), true) => writes.extend(plan.iter().map(|w| WriteOp {
                local: local.id(),
                local_offset: w.src_offset,
                remote: 0,
                remote_offset: w.dst_offset,
                len: w.len,
                rows: w.rows,
                local_stride: w.src_stride,
                remote_stride: w.dst_stride,
            })),
            _ => {
                let src_seg = self.pool.segment_len();
                // Pieces that lie in one segment on both sides, row by row.
                for (w, (src, dst)) in plan.iter().flat_map(|w| w.pieces().map(move |p| (w, p))) {
                    for (si, soff, n, pos) in super::pools::split(src, w.len, src_seg) {
                        let local = self.pool.id(si).ok_or_else(|| {
                            EngineError::Config(format!("write at {src} is outside the pool"))
                        })?;
                        for (di, doff, m, p) in super::pools::split(dst + pos, n, link.dst_seg) {
                            writes.push(WriteOp::new(
                                local,
                                soff + p,
                                u32::try_from(di).map_err(|_| {
                                    EngineError::Config("decode region index overflows".into())
                                })?,
                                doff,
                                m,
                            ));
                        }
                    }
                }
            }
        }
        let notification = match self.cfg.notify_format {
            NotifyFormat::SglangText => n
                .encode_text(TextForm::WithPpRank)
                .map(String::into_bytes)
                .unwrap_or_else(|_| n.encode().to_vec()),
            _ => n.encode().to_vec(),
        };
        Ok(LegPost {
            writes,
            notification,
            bytes: plan.iter().map(Write::bytes).sum(),
        })
    }

    /// The request's geometry, legs and span (until decided), once every decode rank it goes to
    /// sent its allocation (waiting up to `request_wait` for them).
    async fn wait_for_request(&self, request: RequestId) -> Result<Ready, EngineError> {
        let deadline = tokio::time::Instant::now() + self.cfg.request_wait;
        loop {
            let rx = {
                let mut st = lock(&self.state);
                if let Some(r) = st.requests.get_mut(&request) {
                    if let Some(code) = r.failed {
                        return Err(EngineError::RequestFailed { request, code });
                    }
                    if r.ready() {
                        // The caller knows it (it posts it): it releases it.
                        r.handed = true;
                        let legs = r
                            .legs
                            .iter()
                            .map(|l| (l.link.clone(), l.dst_pages.clone(), l.landing))
                            .collect();
                        return Ok((r.geometry, legs, r.span.clone()));
                    }
                }
                let (tx, rx) = oneshot::channel();
                st.arrivals.entry(request).or_default().push(tx);
                rx
            };
            match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(())) => {}
                _ => {
                    // This waiter's entry goes with it (the allocation may never come).
                    let mut st = lock(&self.state);
                    if let Some(waiting) = st.arrivals.get_mut(&request) {
                        waiting.retain(|w| !w.is_closed());
                        if waiting.is_empty() {
                            st.arrivals.remove(&request);
                        }
                    }
                    return Err(EngineError::UnknownRequest(request));
                }
            }
        }
    }

    /// A chunk's transport work is over (on the progress thread).
    fn chunk_done(
        &self,
        link: LinkId,
        request: RequestId,
        chunk: u32,
        last: bool,
        (bytes, writes): (u64, u64),
        res: &Result<(), TransportError>,
    ) {
        let (ack, close, peer) = {
            let mut st = lock(&self.state);
            let peer = st.links.get(&link).map(|l| l.link.addr);
            let close = match st.links.get_mut(&link) {
                Some(l) => {
                    l.posted = l.posted.saturating_sub(1);
                    let close = l.posted == 0 && l.close_pending;
                    if close {
                        l.close_pending = false;
                    }
                    close
                }
                None => false,
            };
            let ack = match st.requests.get_mut(&request).and_then(|r| r.leg_mut(link)) {
                Some(leg) => {
                    leg.posted = leg.posted.saturating_sub(1);
                    if res.is_ok() {
                        leg.done.insert(chunk);
                    }
                    let ack = leg.posted == 0 && leg.ack_pending;
                    if ack {
                        leg.ack_pending = false;
                    }
                    ack.then(|| leg.link.clone())
                }
                None => None,
            };
            if last && res.is_ok() {
                st.last_done_at.record(request, Instant::now());
            }
            (ack, close, peer)
        };
        if let Some(to) = ack {
            Self::ack_abort(&to, request);
        }
        match res {
            Ok(()) => {
                self.counters.chunks.fetch_add(1, Ordering::Relaxed);
                self.counters.bytes.fetch_add(bytes, Ordering::Relaxed);
                if let Some(peer) = peer {
                    let mut by_peer = self
                        .counters
                        .by_peer
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    let w = by_peer.entry(peer).or_default();
                    w.bytes += bytes;
                    w.writes += writes;
                }
                self.settle_vote(request, None);
            }
            Err(e) => {
                self.counters.failed_chunks.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(request = request.0, error = %e, "chunk failed");
                self.fail_local(request, FailureCode::WriteFailed);
            }
        }
        if close {
            // Decode closed and this was our last write into its pool: say so.
            self.finish_link(link);
        }
    }

    /// A closed decode's last write is over: our Close tells it so, its transport peer goes, and
    /// the engine closes with its last decode unless it is to stay open.
    fn finish_link(&self, id: LinkId) {
        let (gone, closed) = {
            let mut st = lock(&self.state);
            let gone = st.links.remove(&id);
            let closed = !self.cfg.keep_open && st.links.is_empty() && !st.closed;
            if closed {
                st.closed = true;
                // No allocation comes any more: the offers' pages are their callers' again.
                let offers: Vec<RequestId> = st.offers.keys().copied().collect();
                for r in offers {
                    st.withdraw_offer(r);
                }
            }
            (gone, closed)
        };
        if let Some(l) = gone {
            let _ = l.link.writer.send(Msg::Close);
            self.transport.disconnect(l.link.peer);
        }
        if closed {
            // Only after our Close is queued: a server that stops once `next_request` says the
            // engine closed lets it go out first.
            lock(&self.state).incoming = None;
            tracing::info!(
                pp_rank = self.cfg.pp_rank,
                "the last decode engine closed: prefill rank closed"
            );
        }
    }

    fn fail_local(&self, request: RequestId, code: FailureCode) {
        // The decode that owns it; every open one for a request whose allocation has not come.
        let to: Vec<Arc<Link>> = {
            let mut st = lock(&self.state);
            st.drop_offer(request);
            match st.requests.get_mut(&request) {
                Some(r) if r.failed.is_none() => {
                    r.failed = Some(code);
                    r.legs.iter().map(|l| l.link.clone()).collect()
                }
                Some(_) => Vec::new(),
                None => st
                    .links
                    .values()
                    .filter(|l| !l.closed)
                    .map(|l| l.link.clone())
                    .collect(),
            }
        };
        self.tell_failed(request, code, &to);
        self.settle_vote(request, Some(Vote::Failed(code)));
        // Its chunks waiting for a landing range stop waiting.
        self.landed.notify_waiters();
    }

    /// Tells each decode in `to` that `request` failed here, at once, not by timeout: on the data
    /// plane (ordered after this rank's earlier chunks) and on the control plane (which still works
    /// when the data plane does not); whichever arrives second changes nothing.
    fn tell_failed(&self, request: RequestId, code: FailureCode, to: &[Arc<Link>]) {
        for link in to {
            let _ = link.writer.send(Msg::Abort(control::Abort {
                request: request.0,
                reason: code.raw(),
            }));
            let n =
                ChunkNotification::new(request, link.notify_rank, 0, ChunkStatus::Failed { code });
            self.transport
                .post(link.peer, Vec::new(), n.encode().to_vec(), Box::new(|_| {}));
        }
    }

    /// Casts this rank's vote on `request` once it is terminal here (failed, or every one of its
    /// chunks is over) and none of its chunks is still posted, so a vote always means "this rank's
    /// writes are over", and Completed also "all of them arrived". `unknown` is the vote for a request this rank never got an allocation for (nothing of
    /// it was posted).
    fn settle_vote(&self, request: RequestId, unknown: Option<Vote>) {
        self.settle_vote_from(request, unknown, None);
    }

    /// [`settle_vote`](Self::settle_vote), for a request this rank does not hold that decode
    /// `aborted_by` aborted: once the vote is cast, a request the board still has undecided is
    /// counted against that decode ([`MAX_UNKNOWN_ABORTS`]) until it is decided. One already
    /// decided (an abort that comes after the rank decided and released the request, as decode's
    /// own abort of a request that failed here does) is not: no decision would end its count.
    fn settle_vote_from(
        &self,
        request: RequestId,
        unknown: Option<Vote>,
        aborted_by: Option<LinkId>,
    ) {
        let mut st = lock(&self.state);
        let vote = match st.requests.get_mut(&request) {
            Some(r) if r.voted || r.posted() > 0 => return,
            Some(r) => {
                let v = match r.failed {
                    Some(code) => Some(Vote::Failed(code)),
                    None if r.complete() => Some(Vote::Completed),
                    None => None,
                };
                r.voted = v.is_some();
                v
            }
            None => unknown,
        };
        let Some(vote) = vote else { return };
        if let Err(e) = st.board.handle_local_vote(Instant::now(), request, vote) {
            tracing::debug!(request = request.0, error = %e, "local vote refused");
        }
        self.flush_board(&mut st);
        if let Some(link) = aborted_by
            && !st.requests.contains_key(&request)
            && st.board.is_undecided(request)
            && !st.unknown_aborts.contains_key(&request)
        {
            st.unknown_aborts.insert(request, link);
        }
        drop(st);
        self.timer.notify_one();
    }

    /// Requests peers voted on that this rank never got, past their vote deadline: its part of
    /// each fails (it will not get them now), so the pipeline decides them and the board does not
    /// keep them for good (a later request of the same id would find a peer's stale vote). A
    /// request held here in any form votes as usual instead.
    fn vote_for_unheld(&self, st: &mut State) {
        while let Some(request) = st.board.poll_expired_unvoted() {
            if st.requests.contains_key(&request)
                || st.offers.contains_key(&request)
                || st.arrivals.contains_key(&request)
            {
                continue;
            }
            let vote = Vote::Failed(FailureCode::Timeout);
            if let Err(e) = st.board.handle_local_vote(Instant::now(), request, vote) {
                tracing::debug!(request = request.0, error = %e, "local vote refused");
            } else {
                tracing::info!(
                    request = request.0,
                    "a request only PP peers voted on failed here at its vote deadline"
                );
            }
        }
    }

    /// Sends what the board queued and hands out its decisions.
    fn flush_board(&self, st: &mut State) {
        while let Some((to, msg)) = st.board.poll_transmit() {
            if let Some(Some(w)) = st.peer_writers.get(usize::from(to)) {
                let _ = w.send(Msg::Vote(control::Vote {
                    bytes: msg.encode().to_vec(),
                }));
            }
        }
        while let Some((request, decision)) = st.board.poll_decision() {
            match decision {
                Decision::Completed => self
                    .counters
                    .decided_completed
                    .fetch_add(1, Ordering::Relaxed),
                Decision::Failed { .. } => {
                    self.counters.decided_failed.fetch_add(1, Ordering::Relaxed)
                }
            };
            if let Some(span) = st.requests.get_mut(&request).and_then(|r| r.span.take()) {
                match decision {
                    Decision::Completed => span.record("decision", "complete"),
                    Decision::Failed { .. } => span.record("decision", "failed"),
                };
            }
            st.unknown_aborts.remove(&request);
            let State {
                requests, links, ..
            } = &mut *st;
            if let Some(r) = requests.get_mut(&request) {
                r.uncount(links);
            }
            // A request the caller never got (some allocation never came, or it failed first)
            // posted nothing; nobody will release it, so it goes now, its decision kept as that of
            // a request this rank does not hold.
            if st
                .requests
                .get(&request)
                .is_some_and(|r| !r.handed && !r.offered && r.posted() == 0)
            {
                st.requests.remove(&request);
            }
            // A decision about a request this rank does not hold is kept for a caller that may
            // still ask about it (an offer to come), but only so many: a decode chooses them.
            let foreign = !st.requests.contains_key(&request);
            if st.decided.insert(request, decision).is_none() && foreign {
                st.foreign_decided.push_back(request);
                while st.foreign_decided.len() > MAX_FOREIGN_DECISIONS {
                    let Some(old) = st.foreign_decided.pop_front() else {
                        break;
                    };
                    if !st.requests.contains_key(&old) && !st.offers.contains_key(&old) {
                        st.decided.remove(&old);
                    }
                }
            }
            st.drop_offer(request);
            for w in st.decided_waiters.remove(&request).unwrap_or_default() {
                let _ = w.send(decision);
            }
        }
    }

    /// Records a decode's allocation, refusing it to decode if it must; the offered pages to post
    /// where it made an offered request ready.
    fn on_transfer_request(
        &self,
        link: &Arc<Link>,
        req: control::TransferRequest,
        incoming: &mpsc::UnboundedSender<IncomingRequest>,
    ) -> Option<Vec<u32>> {
        let request = req.request;
        match self.accept_request(link, req, Some(incoming)) {
            Ok(offered) => offered,
            Err(reason) => {
                let _ = link
                    .writer
                    .send(Msg::TransferReject(control::TransferReject {
                        request,
                        reason,
                    }));
                None
            }
        }
    }

    /// Validates and records a page allocation, waking `send_chunk`s waiting for it. Another
    /// decode rank's allocation of a request already known joins it as one more leg where both
    /// name the same decode instance, this rank writes into several of its ranks, and the request
    /// still waits for one of them; any other repeat is refused. A request this makes ready
    /// (every allocation came) is queued on `incoming` for the caller (`None`: the caller gave the
    /// allocation itself), or, where its pages were offered, returned with them for the engine
    /// to post.
    fn accept_request(
        &self,
        link: &Arc<Link>,
        req: control::TransferRequest,
        incoming: Option<&mpsc::UnboundedSender<IncomingRequest>>,
    ) -> Result<Option<Vec<u32>>, control::TransferRejectReason> {
        let request = RequestId(req.request);
        let next = IncomingRequest {
            request,
            decode: link.id,
            prompt_tokens: req.prompt_tokens,
            chunk_tokens: req.chunk_tokens,
            prefix_tokens: req.prefix_tokens,
        };
        // Decode's pages: its page list is in them, and the chunks send them (see the planner).
        let geometry = ChunkGeometry::after_prefix(
            u64::from(req.prompt_tokens),
            u64::from(req.chunk_tokens),
            u64::from(link.dst_page_tokens),
            u64::from(req.prefix_tokens),
        );
        let check = geometry.as_ref().ok().map(|g| {
            control::validate_transfer_request(
                &req,
                link.planner.dst().num_pages,
                g.num_pages() as usize,
            )
            // A prefix is whole pages on both sides, so the moved tokens start a page on each.
            .and_then(|()| control::validate_prefix(&req, link.dst_page_tokens))
            .and_then(|()| control::validate_prefix(&req, self.cfg.page_tokens))
            .and_then(|()| {
                control::validate_landing(&req, link.landing.map(|(_, len)| len), g.num_chunks())
            })
            // This rank's pool holds the prompt, which decode may round up to its whole pages
            // (the source list then repeats a page): that bounds what a decode's numbers make here.
            .and_then(|()| {
                let slack = u64::from(link.dst_page_tokens)
                    .div_ceil(u64::from(self.cfg.page_tokens.max(1)));
                let (needed, held) = (
                    link.planner.src_pages_needed(g),
                    u64::from(link.planner.src().num_pages),
                );
                if needed <= held.saturating_add(slack) {
                    Ok(())
                } else {
                    Err(control::TransferRejectReason::Invalid(format!(
                        "the prompt needs {needed} pages of this rank's pool, which has {held}"
                    )))
                }
            })
        });
        let mut st = lock(&self.state);
        let open = st.links.get(&link.id).is_some_and(|l| !l.closed);
        // Decided here already (a decode aborted it before this allocation came, or it was over
        // and not released): it is never served again.
        let settled = st.decided.contains_key(&request) || st.unknown_aborts.contains_key(&request);
        let over = st
            .links
            .get(&link.id)
            .and_then(|l| l.over_cap(req.dst_pages.len(), &self.cfg.limits));
        let reason = match (geometry, check) {
            (Ok(_), Some(Ok(()))) if open && settled => {
                control::TransferRejectReason::Invalid(format!(
                    "request {} was aborted or decided here already",
                    req.request
                ))
            }
            (Ok(_), Some(Ok(()))) if open && over.is_some() => {
                control::TransferRejectReason::Invalid(over.unwrap_or_default())
            }
            (Ok(g), Some(Ok(()))) if open => {
                // Chunk ids are `u32` on the wire; the count is at most the prompt's tokens, which
                // fill pages the pool holds (checked just above).
                let chunks = u32::try_from(g.num_chunks()).unwrap_or(u32::MAX);
                let units = (req.dst_pages.len() as u64).max(1);
                let leg = Leg {
                    link: link.clone(),
                    dst_pages: Arc::new(req.dst_pages),
                    landing: req.landing,
                    posted: 0,
                    ack_pending: false,
                    sent: ChunkSet::new(chunks),
                    done: ChunkSet::new(chunks),
                    landed: ChunkSet::new(chunks),
                };
                let accepted = match st.requests.get_mut(&request) {
                    None => {
                        let r = ReqState {
                            geometry: g,
                            prefix_tokens: req.prefix_tokens,
                            offered: false,
                            handed: false,
                            legs: vec![leg],
                            expected: link.fan_out.max(1),
                            failed: None,
                            voted: false,
                            counted: true,
                            span: Some(tracing::info_span!(
                                parent: None,
                                "kvx.request",
                                request = request.0,
                                role = "prefill",
                                pp_rank = self.cfg.pp_rank,
                                tp_rank = self.cfg.tp.rank,
                                decision = tracing::field::Empty,
                            )),
                        };
                        let ready = r.ready();
                        st.requests.insert(request, r);
                        Some((ready, None))
                    }
                    Some(r) if joins(r, link, &g, req.prefix_tokens) => {
                        r.legs.push(leg);
                        Some((r.ready(), r.failed))
                    }
                    Some(_) => None,
                };
                if let Some((ready, failed)) = accepted {
                    let counted = st.requests.get(&request).is_some_and(|r| r.counted);
                    if let Some(l) = st.links.get_mut(&link.id)
                        && counted
                    {
                        l.live = l.live.saturating_add(1);
                        l.live_pages = l.live_pages.saturating_add(units);
                    }
                    // Ready: posted from its offer by the engine, or queued for the caller, under
                    // this lock (nothing decides it, or sees it ready, in between).
                    let mut offered = None;
                    if ready && failed.is_none() {
                        offered = st.take_offer(request);
                        // A caller that gave the allocation itself (`add_request`) has it.
                        if offered.is_none()
                            && incoming.is_none_or(|q| self.queue_unread(q, next))
                            && let Some(r) = st.requests.get_mut(&request)
                        {
                            r.handed = true;
                        }
                    }
                    for w in st.arrivals.remove(&request).unwrap_or_default() {
                        let _ = w.send(());
                    }
                    drop(st);
                    if let Some(code) = failed {
                        // It failed before this decode rank's allocation came: tell it at once.
                        self.tell_failed(request, code, std::slice::from_ref(link));
                    }
                    return Ok(offered);
                }
                control::TransferRejectReason::DuplicateRequest {
                    request: req.request,
                }
            }
            (Ok(_), Some(Ok(()))) => {
                control::TransferRejectReason::Invalid("this decode's connection closed".into())
            }
            (_, Some(Err(e))) => e,
            (Err(e), _) => control::TransferRejectReason::Invalid(e.to_string()),
            (Ok(_), None) => control::TransferRejectReason::Invalid("no geometry".into()),
        };
        drop(st);
        self.counters.rejected.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(request = req.request, %reason, "transfer request rejected");
        Err(reason)
    }

    /// Decode `from` copied chunk `chunk` of `request` out of its landing range: the chunk that
    /// reuses that range may be written. A word about a chunk the request does not have, or from a
    /// decode the request does not go to, is counted and dropped; one about a request that is over
    /// here (the last chunks' words come after it) is dropped.
    fn on_landed(&self, from: &Arc<Link>, request: RequestId, chunk: u32) {
        let mut st = lock(&self.state);
        let Some(r) = st.requests.get_mut(&request) else {
            return;
        };
        let chunks = r.geometry.num_chunks();
        match r.leg_mut(from.id) {
            Some(leg) if u64::from(chunk) < chunks && leg.landing.is_some() => {
                leg.landed.insert(chunk);
            }
            _ => {
                drop(st);
                self.counters.refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    request = request.0,
                    chunk,
                    decode = %from.addr,
                    "landing word about a chunk this decode was not granted dropped"
                );
                return;
            }
        }
        drop(st);
        self.landed.notify_waiters();
    }

    /// Waits until every leg of `request` may take chunk `chunk`'s writes: where its landing
    /// grant reuses ranges, decode copied the chunk before it out of the range (see
    /// [`Leg::range_free`]). Returns at once for a request that failed, was decided or is gone
    /// (posting it then fails as it would have), and looks again at least every 50 ms. A wait is
    /// counted (`PrefillStats::landing_waits`, `landing_wait_micros`).
    async fn wait_for_ranges(&self, request: RequestId, chunk: u32) {
        let mut since = None;
        loop {
            let woken = self.landed.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            {
                let st = lock(&self.state);
                let free = st.requests.get(&request).is_none_or(|r| {
                    r.failed.is_some() || r.voted || r.legs.iter().all(|l| l.range_free(chunk))
                });
                if free || st.closed {
                    if let Some(t0) = since {
                        self.counters
                            .landing_wait_micros
                            .fetch_add(crate::transport::micros_since(t0), Ordering::Relaxed);
                    }
                    return;
                }
            }
            if since.is_none() {
                since = Some(Instant::now());
                self.counters.landing_waits.fetch_add(1, Ordering::Relaxed);
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), woken).await;
        }
    }

    /// Decode `from` abandoned `request`: post nothing more for it, acknowledge once every chunk
    /// already posted into `from` is over (so decode may reuse the pages), tell the request's other
    /// decode ranks, and vote failed. An abort of a request another decode owns is counted and
    /// dropped.
    fn on_abort(&self, from: &Arc<Link>, request: RequestId, code: FailureCode) {
        self.on_abort_of(from, request, code);
        // Its chunks waiting for a landing range stop waiting.
        self.landed.notify_waiters();
    }

    fn on_abort_of(&self, from: &Arc<Link>, request: RequestId, code: FailureCode) {
        let (ack_now, others, unheld) = {
            let mut st = lock(&self.state);
            match st.requests.get_mut(&request) {
                Some(r) if !r.has_leg(from.id) => {
                    drop(st);
                    self.counters.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        request = request.0,
                        decode = %from.addr,
                        "abort of another decode engine's request dropped"
                    );
                    return;
                }
                Some(r) => {
                    let newly = r.failed.is_none();
                    if newly {
                        r.failed = Some(code);
                    }
                    let others: Vec<Arc<Link>> = if newly {
                        r.legs
                            .iter()
                            .filter(|l| l.link.id != from.id)
                            .map(|l| l.link.clone())
                            .collect()
                    } else {
                        Vec::new()
                    };
                    let ack_now = match r.leg_mut(from.id) {
                        Some(leg) => {
                            leg.ack_pending = leg.posted > 0;
                            leg.posted == 0
                        }
                        None => true,
                    };
                    (ack_now, others, false)
                }
                // A vote for a request this rank never held (its allocation never came, or was
                // refused) lets the pipeline decide it before its deadline; a decode gets so many
                // of those outstanding, since each one is held by every rank until decided
                // (counted by a scan of at most that many entries per decode, on a rare path).
                None => {
                    let n = st
                        .unknown_aborts
                        .values()
                        .filter(|&&l| l == from.id)
                        .count();
                    if n >= MAX_UNKNOWN_ABORTS {
                        drop(st);
                        Self::ack_abort(from, request);
                        self.counters.refused.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            request = request.0,
                            decode = %from.addr,
                            "abort of a request this rank never held dropped: too many undecided"
                        );
                        return;
                    }
                    (true, Vec::new(), true)
                }
            }
        };
        if ack_now {
            Self::ack_abort(from, request);
        }
        self.tell_failed(request, code, &others);
        self.settle_vote_from(request, Some(Vote::Failed(code)), unheld.then_some(from.id));
    }

    fn ack_abort(to: &Link, request: RequestId) {
        let _ = to
            .writer
            .send(Msg::AbortAck(control::AbortAck { request: request.0 }));
    }

    fn on_peer_message(&self, from: u16, bytes: &[u8]) {
        let mut st = lock(&self.state);
        match VoteMessage::decode(bytes) {
            Ok(msg) => {
                if let Err(e) = st.board.handle_peer_message(Instant::now(), from, &msg) {
                    tracing::warn!(from, error = %e, "vote refused");
                }
            }
            Err(e) => tracing::warn!(from, error = %e, "malformed vote"),
        }
        self.flush_board(&mut st);
    }

    /// Whether a peer connection of `rank` with `incarnation` may bind now.
    fn mesh_admissible(&self, rank: u16, incarnation: u64) -> Result<(), RejectReason> {
        let st = lock(&self.state);
        if st.closed {
            return Err(RejectReason::Refused("this rank is closing".into()));
        }
        let busy = st
            .peer_writers
            .get(usize::from(rank))
            .is_some_and(Option::is_some);
        st.mesh_incarnations
            .check(rank, incarnation, busy)
            .map_err(RejectReason::from)
    }

    /// The engine is closing: no PP peer is connected to again.
    fn mesh_closed(&self) -> bool {
        lock(&self.state).closed
    }

    /// Posts an offered request, whose allocation is complete, on a task of its own.
    fn start_offered(self: &Arc<Self>, request: RequestId, src_pages: Vec<u32>) {
        let inner = self.clone();
        let task = self
            .runtime
            .spawn(async move { send_offered(&inner, request, src_pages).await });
        self.keep_task(task);
    }

    /// Queues a ready allocation for `next_request` (the caller then has it), unless
    /// [`PrefillLimits::unread`] wait there already (a caller that never reads it): dropped then, counted;
    /// false unless queued.
    fn queue_unread(
        &self,
        incoming: &mpsc::UnboundedSender<IncomingRequest>,
        next: IncomingRequest,
    ) -> bool {
        let cap = self.cfg.limits.unread;
        if self.unread.fetch_add(1, Ordering::Relaxed) < cap {
            if incoming.send(next).is_ok() {
                return true;
            }
            self.unread.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        self.unread.fetch_sub(1, Ordering::Relaxed);
        let dropped = self.counters.unread_dropped.fetch_add(1, Ordering::Relaxed) + 1;
        // A server that never reads would have one line per request: the count says the rest.
        if dropped.is_power_of_two() {
            tracing::warn!(
                request = next.request.0,
                dropped,
                "{cap} allocations wait unread for next_request: later ones are not queued"
            );
        }
        false
    }

    /// Keeps a task spawned after start, to be stopped with the engine.
    fn keep_task(&self, task: tokio::task::JoinHandle<()>) {
        if let Ok(mut tasks) = self.mesh_tasks.0.lock() {
            tasks.retain(|t| !t.is_finished());
            tasks.push(task);
        }
    }

    fn on_peer_lost(&self, rank: u16) {
        self.counters.peer_losses.fetch_add(1, Ordering::Relaxed);
        let mut st = lock(&self.state);
        if let Some(w) = st.peer_writers.get_mut(usize::from(rank)) {
            *w = None;
        }
        let was = st.mesh_confirmed.get(usize::from(rank)) == Some(&true);
        if let Some(ok) = st.mesh_confirmed.get_mut(usize::from(rank)) {
            *ok = false;
        }
        if st.announced && was {
            // At the end of a run every decode is closing this rank and its peers alike: their
            // links going is no news then.
            if st.links.values().any(|l| !l.closed) {
                tracing::warn!(
                    pp_rank = self.cfg.pp_rank,
                    peer = rank,
                    "vote mesh link lost: decodes told NotReady"
                );
            } else {
                tracing::debug!(
                    pp_rank = self.cfg.pp_rank,
                    peer = rank,
                    "vote mesh link closed"
                );
            }
            st.tell_decodes(&Msg::NotReady);
        }
        let _ = st.board.handle_peer_lost(Instant::now(), rank);
        self.flush_board(&mut st);
    }
}

/// [`PrefillEngine::send_chunk`] on the engine's state, for the engine's own tasks too.
async fn send_chunk_of(
    inner: &Arc<Inner>,
    request: RequestId,
    chunk: u32,
    src_pages: &[u32],
    last: bool,
) -> Result<(), EngineError> {
    let (geometry, legs, parent) = inner.wait_for_request(request).await?;
    // Only a chunk that reuses a landing range may have to wait for it.
    if legs
        .iter()
        .any(|(_, _, g)| g.is_some_and(|g| chunk >= g.slots.max(1)))
    {
        inner.wait_for_ranges(request, chunk).await;
    }
    let count = geometry.num_chunks() as u32;
    let status = match (last, chunk.checked_add(1) == Some(count)) {
        (true, true) => ChunkStatus::Last { count },
        (false, false) => ChunkStatus::More,
        (true, false) => {
            return Err(EngineError::Config(format!(
                "LAST chunk {chunk} but the prompt has {count} chunks"
            )));
        }
        // Without LAST decode would never see the request complete, while this rank voted so.
        (false, true) => {
            return Err(EngineError::Config(format!(
                "chunk {chunk} is the last of the prompt's {count}: it goes with LAST"
            )));
        }
    };
    let mut posts = Vec::with_capacity(legs.len());
    for (link, dst_pages, landing) in &legs {
        posts.push(inner.plan_leg(
            request, chunk, status, &geometry, link, dst_pages, *landing, src_pages,
        )?);
    }
    let span = tracing::trace_span!(
        parent: parent.as_ref().and_then(tracing::Span::id),
        "chunk",
        request = request.0,
        pp_rank = inner.cfg.pp_rank,
        chunk
    );
    let _g = span.enter();
    // Counted under the same lock an abort takes, so an abort either sees this chunk posted (and
    // waits for it before acknowledging) or stops it here.
    {
        let mut st = lock(&inner.state);
        if st.closed {
            return Err(EngineError::Shutdown);
        }
        let open = legs
            .iter()
            .all(|(l, _, _)| st.links.get(&l.id).is_some_and(|l| !l.closed));
        match st.requests.get_mut(&request) {
            Some(r) if r.failed.is_none() && !r.voted && open => {
                let again = legs.iter().any(|(l, _, _)| {
                    r.legs
                        .iter()
                        .any(|x| x.link.id == l.id && x.sent.contains(chunk))
                });
                if again {
                    return Err(EngineError::Config(format!(
                        "chunk {chunk} of request {} was posted on this rank already",
                        request.0
                    )));
                }
                for (link, _, _) in &legs {
                    if let Some(leg) = r.leg_mut(link.id) {
                        leg.posted += 1;
                        leg.sent.insert(chunk);
                    }
                }
            }
            // A decode of it is gone; the request fails with it (its read loop is on the way).
            Some(r) if r.failed.is_none() && !r.voted => {
                return Err(EngineError::RequestFailed {
                    request,
                    code: FailureCode::PeerLost,
                });
            }
            Some(r) if r.failed.is_none() => {
                return Err(EngineError::Config(format!(
                    "request {} already finished on this rank (its LAST chunk is over)",
                    request.0
                )));
            }
            Some(r) => {
                let code = r.failed.unwrap_or(FailureCode::Aborted);
                return Err(EngineError::RequestFailed { request, code });
            }
            None => return Err(EngineError::UnknownRequest(request)),
        }
        for (link, _, _) in &legs {
            if let Some(l) = st.links.get_mut(&link.id) {
                l.posted += 1;
            }
        }
    }
    let mut waits = Vec::with_capacity(posts.len());
    let mut batch = Vec::with_capacity(posts.len());
    for ((link, _, _), post) in legs.iter().zip(posts) {
        inner
            .counters
            .writes
            .fetch_add(post.writes.len() as u64, Ordering::Relaxed);
        inner
            .counters
            .write_rows
            .fetch_add(post.writes.iter().map(|w| w.rows).sum(), Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let weak = Arc::downgrade(inner);
        let (link_id, bytes) = (link.id, post.bytes);
        let writes = post.writes.len() as u64;
        batch.push(Post {
            peer: link.peer,
            writes: post.writes,
            notification: post.notification,
            done: Box::new(move |res: Result<(), TransportError>| {
                // Runs on the transport's progress thread: the vote is cast right here.
                if let Some(inner) = weak.upgrade() {
                    inner.chunk_done(link_id, request, chunk, last, (bytes, writes), &res);
                }
                let _ = tx.send(res);
            }),
        });
        waits.push(rx);
    }
    if last {
        lock(&inner.state)
            .last_posted_at
            .record(request, Instant::now());
    }
    // The legs go together: a backend may read a source row once for every decode rank its
    // slices go to.
    inner.transport.post_many(batch);
    let mut first_error = None;
    for rx in waits {
        let err = match rx.await {
            Ok(Ok(())) => continue,
            Ok(Err(source)) => EngineError::Write {
                request,
                chunk,
                source,
            },
            Err(_) => EngineError::Shutdown,
        };
        first_error.get_or_insert(err);
    }
    first_error.map_or(Ok(()), Err)
}

/// Polls an offered request's `posted` chunks together until fewer than `below` are left, keeping
/// the first error: a chunk waiting for its landing range posts as soon as decode frees it, not
/// after the chunks before it are over.
async fn settle_posted(
    posted: &mut Vec<std::pin::Pin<Box<impl Future<Output = Result<(), EngineError>>>>>,
    first_error: &mut Option<EngineError>,
    below: usize,
) {
    std::future::poll_fn(|cx| {
        posted.retain_mut(|f| match f.as_mut().poll(cx) {
            std::task::Poll::Ready(r) => {
                if let Err(e) = r {
                    first_error.get_or_insert(e);
                }
                false
            }
            std::task::Poll::Pending => true,
        });
        if posted.len() < below {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
}

/// Posts every chunk of an offered request whose allocation is complete, from the offered pages
/// after decode's prefix, each chunk's writes handed to the transport before the next chunk's;
/// fails the request where the pages do not cover it or a chunk cannot be posted.
async fn send_offered(inner: &Arc<Inner>, request: RequestId, src: Vec<u32>) {
    let geometry = match inner.wait_for_request(request).await {
        Ok((g, _, _)) => g,
        // Failed or forgotten meanwhile: whoever failed it told decode.
        Err(_) => return,
    };
    let Some(prefix) = lock(&inner.state)
        .requests
        .get(&request)
        .map(|r| r.prefix_tokens)
    else {
        return;
    };
    // The prefix is whole pages here (checked when the allocation came).
    let page = u64::from(inner.cfg.page_tokens.max(1));
    let (skip, want) = (
        u64::from(prefix) / page,
        geometry.prompt_tokens.div_ceil(page),
    );
    let pages = usize::try_from(skip)
        .ok()
        .zip(usize::try_from(want).ok())
        .and_then(|(skip, want)| src.get(skip..)?.get(..want));
    let Some(pages) = pages else {
        tracing::warn!(
            request = request.0,
            offered = src.len(),
            needed = skip.saturating_add(want),
            "the offered pages do not cover decode's request: failed"
        );
        inner.fail_local(request, FailureCode::Aborted);
        return;
    };
    // At most `prompt_tokens` (a u32) chunks.
    let count = u32::try_from(geometry.num_chunks()).unwrap_or(u32::MAX);
    let mut first_error = None;
    let mut posted = Vec::new();
    for chunk in 0..count {
        if posted.len() >= OFFER_CHUNKS_IN_FLIGHT {
            settle_posted(&mut posted, &mut first_error, OFFER_CHUNKS_IN_FLIGHT).await;
            if first_error.is_some() {
                break;
            }
        }
        let mut f = Box::pin(send_chunk_of(
            inner,
            request,
            chunk,
            pages,
            chunk + 1 == count,
        ));
        // The allocation is complete, so a chunk's first poll posts its writes (unless it waits
        // for a landing range decode still copies from): each chunk is handed to the transport
        // before the next, and all of them that may go before any is awaited.
        let first = f
            .as_mut()
            .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
        match first {
            std::task::Poll::Ready(Ok(())) => {}
            std::task::Poll::Ready(Err(e)) => {
                first_error = Some(e);
                break;
            }
            std::task::Poll::Pending => posted.push(f),
        }
        // Decode chose the chunk count: other tasks of the runtime run between every few.
        if chunk % OFFER_CHUNKS_PER_TURN == OFFER_CHUNKS_PER_TURN - 1 {
            tokio::task::yield_now().await;
        }
    }
    if first_error.is_none() {
        // Every chunk is with the transport, or waits for its landing range. Decode may see the
        // request complete a moment before this count (this thread can be preempted between the
        // last post and here).
        inner.counters.offers_posted.fetch_add(1, Ordering::Relaxed);
    }
    settle_posted(&mut posted, &mut first_error, 1).await;
    match first_error {
        None | Some(EngineError::RequestFailed { .. } | EngineError::Shutdown) => {}
        Some(e) => {
            tracing::warn!(request = request.0, error = %e, "posting an offered request failed");
            inner.fail_local(request, FailureCode::WriteFailed);
        }
    }
}

/// Whether `link`'s allocation of a request already known is one more leg of it: another TP rank
/// of the same named decode instance (same TP size), which this rank writes into too, for the
/// same prompt, while the request still waits for one of its legs and is not over.
fn joins(r: &ReqState, link: &Link, geometry: &ChunkGeometry, prefix_tokens: u32) -> bool {
    !link.decode_instance.is_empty()
        && !r.voted
        && !r.ready()
        && r.geometry == *geometry
        && r.prefix_tokens == prefix_tokens
        && r.legs.iter().all(|l| {
            l.link.decode_instance == link.decode_instance
                && l.link.decode_tp.1 == link.decode_tp.1
                && l.link.decode_tp.0 != link.decode_tp.0
        })
}

async fn decode_read_loop(
    inner: Weak<Inner>,
    link: Arc<Link>,
    mut reader: control::ControlReader,
    incoming: mpsc::UnboundedSender<IncomingRequest>,
    cut: Arc<Notify>,
) {
    let silence = link.silence;
    loop {
        let got = tokio::select! {
            got = reader.recv_within(silence) => got,
            () = cut.notified() => {
                // It does not keep up with what this rank sends: lost, as a silent one is.
                if let Some(i) = inner.upgrade() {
                    i.counters.stalled_connections.fetch_add(1, Ordering::Relaxed);
                }
                tracing::warn!(decode = %link.addr, "decode connection cut: it does not read what this rank sends");
                break;
            }
        };
        let msg = match got {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(decode = %link.addr, error = %e, "decode connection ended");
                break;
            }
        };
        let Some(i) = inner.upgrade() else { return };
        match msg {
            Msg::TransferRequest(r) => {
                let request = RequestId(r.request);
                if let Some(src) = i.on_transfer_request(&link, r, &incoming) {
                    // Its pages were offered: the engine posts it, not the caller.
                    i.start_offered(request, src);
                }
            }
            Msg::Abort(a) => {
                i.on_abort(&link, RequestId(a.request), FailureCode::from_raw(a.reason))
            }
            Msg::Landed(l) => i.on_landed(&link, RequestId(l.request), l.chunk),
            Msg::Close => break,
            Msg::Heartbeat => {}
            other => {
                // A kind no decode sends once connected: counted and dropped.
                i.counters.refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(decode = %link.addr, kind = ?other.kind(), "unexpected message from decode dropped");
            }
        }
    }
    // This decode closed or is gone: nothing more is posted to it, every request of it not yet
    // voted fails here, and once no write into its pool runs our Close tells it so. The other
    // decodes' requests go on.
    if let Some(i) = inner.upgrade() {
        let pending: Vec<RequestId> = {
            let mut st = lock(&i.state);
            if let Some(l) = st.links.get_mut(&link.id) {
                l.closed = true;
            }
            st.requests
                .iter()
                .filter(|(_, r)| !r.voted && r.has_leg(link.id))
                .map(|(k, _)| *k)
                .collect()
        };
        for r in pending {
            i.on_abort(&link, r, FailureCode::PeerLost);
        }
        let close_now = {
            let mut st = lock(&i.state);
            match st.links.get_mut(&link.id) {
                Some(l) => {
                    l.close_pending = l.posted > 0;
                    l.posted == 0
                }
                None => false,
            }
        };
        if close_now {
            i.finish_link(link.id);
        }
    }
    drop(incoming);
}

/// Connects to decode and runs the handshake. A restarted rank may find its previous start still
/// bound there for a moment (decode has not seen that connection end yet): it tries again until
/// `deadline` while decode says the rank is taken.
async fn connect_decode(
    cfg: &PrefillConfig,
    hello: &Hello,
    secret: &Secret,
    deadline: tokio::time::Instant,
) -> Result<(Connection, Hello), EngineError> {
    connect_taken(cfg.decode, hello, secret, deadline, Dialed::Decode).await
}

/// Whom a prefill rank dials: a decode engine's control listener, or a lower PP rank's vote-mesh
/// listener (a protocol of its own: [`control::channel::MESH_LABEL`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dialed {
    Decode,
    MeshPeer,
}

impl Dialed {
    fn role(self) -> Role {
        match self {
            Dialed::Decode => Role::Decode,
            Dialed::MeshPeer => Role::Prefill,
        }
    }
}

impl std::fmt::Display for Dialed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Dialed::Decode => "decode",
            Dialed::MeshPeer => "PP peer",
        })
    }
}

/// Connects to `addr` and runs the handshake, trying again until `deadline` while the peer says
/// this rank is still taken (it has not seen this rank's previous connection end yet). The peer
/// must be of the role `what` is: a listener of the other role that the address led to (a
/// misdirected address, a relay) is refused.
async fn connect_taken(
    addr: SocketAddr,
    hello: &Hello,
    secret: &Secret,
    deadline: tokio::time::Instant,
    what: Dialed,
) -> Result<(Connection, Hello), EngineError> {
    // The refusal an attempt cut short by the deadline stands for: what the operator must read.
    let mut refused: Option<control::ControlError> = None;
    loop {
        let attempt = async {
            let mut conn = Connection::connect(addr, deadline).await?;
            if what == Dialed::MeshPeer {
                conn.set_label(control::channel::MESH_LABEL);
            }
            let want = what.role();
            let remote = control::handshake_with(&mut conn, hello, secret, deadline, |r| {
                if r.role == want {
                    Ok(())
                } else {
                    Err(RejectReason::RoleMismatch(format!(
                        "dialed a {want} at this address, found a {}",
                        r.role
                    )))
                }
            })
            .await?;
            Ok::<_, control::ControlError>((conn, remote))
        };
        match attempt.await {
            Ok(found) => return Ok(found),
            Err(
                e @ (control::ControlError::HandshakeTimeout { .. }
                | control::ControlError::ConnectTimeout { .. }),
            ) => return Err(refused.take().unwrap_or(e).into()),
            Err(control::ControlError::PeerRejected {
                reason: RejectReason::DuplicateRank { .. },
                ..
            }) if tokio::time::Instant::now() + MESH_RETRY < deadline => {
                tracing::info!(
                    rank = hello.pp_rank,
                    peer = %what,
                    "the peer still holds this rank's previous connection; trying again"
                );
                tokio::time::sleep(MESH_RETRY).await;
            }
            Err(
                e @ control::ControlError::PeerRejected {
                    reason: RejectReason::UnknownInstance(_),
                    ..
                },
            ) if tokio::time::Instant::now() + MESH_RETRY < deadline => {
                // Decode adds an instance found through discovery when it sees its records.
                tracing::info!(
                    rank = hello.pp_rank,
                    instance = %hello.instance,
                    "decode does not serve this instance yet; trying again"
                );
                refused = Some(e);
                tokio::time::sleep(MESH_RETRY).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// The link to a decode engine that answered our Hello with `remote`: what this rank writes into
/// decode's TP rank and the slot its notifications name there (its PP rank where TP is
/// identical), as the decode side computes them too, and its transport peer.
fn plan_link(
    cfg: &PrefillConfig,
    transport: &Arc<dyn Transport>,
    notify_key: u64,
    id: LinkId,
    addr: SocketAddr,
    remote: &Hello,
    writer: Outbox,
) -> Result<Link, EngineError> {
    let dst = layout_from_info(&remote.layout)?;
    let regions = remote_regions(&remote.backend);
    link_to(
        cfg,
        transport,
        notify_key,
        Target {
            id,
            addr,
            dst,
            page_tokens: remote.layout.page_tokens,
            metadata: &remote.backend.worker_or_agent,
            regions,
            landing: remote
                .backend
                .landing
                .as_ref()
                .map(|r| crate::transport::RemoteRegion {
                    addr: r.addr,
                    len: r.len,
                    rkey: r.rkey.clone(),
                }),
            tp: (remote.tp_rank, remote.tp_size),
            staged: remote.pp_size > 1,
            heartbeat: remote.heartbeat(),
            instance: remote.instance.clone(),
        },
        writer,
    )
}

/// The link to a decode outside our control plane: this rank's TP peer, byte for byte, whose
/// control messages nobody reads.
fn external_link(
    cfg: &PrefillConfig,
    transport: &Arc<dyn Transport>,
    notify_key: u64,
    x: ExternalDecode,
) -> Result<Link, EngineError> {
    let (writer, _unread) = Outbox::new();
    link_to(
        cfg,
        transport,
        notify_key,
        Target {
            id: LinkId(0),
            addr: cfg.decode,
            dst: x.layout,
            page_tokens: cfg.page_tokens,
            metadata: &x.metadata,
            regions: vec![x.region],
            landing: None,
            tp: (cfg.tp.rank, cfg.tp.size),
            staged: false,
            heartbeat: cfg.heartbeat,
            instance: String::new(),
        },
        writer,
    )
}

/// What a link is made from.
struct Target<'a> {
    id: LinkId,
    addr: SocketAddr,
    dst: KvLayout,
    /// Tokens in one of decode's pages.
    page_tokens: u32,
    metadata: &'a [u8],
    regions: Vec<crate::transport::RemoteRegion>,
    /// Decode's landing memory, if it announced one.
    landing: Option<crate::transport::RemoteRegion>,
    /// Decode's TP rank and size.
    tp: (u16, u16),
    /// Decode is one PP stage of several, taking only this rank's stage (`check_hello` saw to
    /// it): this rank is the first, and only, PP rank in its slots.
    staged: bool,
    /// Decode's heartbeat interval.
    heartbeat: Option<Duration>,
    /// The decode instance it belongs to, as its Hello names it.
    instance: String,
}

fn link_to(
    cfg: &PrefillConfig,
    transport: &Arc<dyn Transport>,
    notify_key: u64,
    t: Target<'_>,
    writer: Outbox,
) -> Result<Link, EngineError> {
    let (decode_rank, decode_size) = t.tp;
    let sources = cfg.tp.source_at(cfg.tp.size, decode_size, decode_rank)?;
    let Some(j) = sources
        .iter()
        .position(|x| x.prefill_rank == u32::from(cfg.tp.rank))
    else {
        return Err(EngineError::Config(format!(
            "prefill TP rank {} writes nothing into decode TP rank {decode_rank}",
            cfg.tp.rank
        )));
    };
    let pp = if t.staged { 0 } else { cfg.pp_rank };
    let notify_rank = crate::core::topology::slot(pp, sources.len() as u16, j as u16)
        .ok_or_else(|| EngineError::Config("too many PP and TP ranks".into()))?;
    let mapping = cfg
        .tp
        .mapping(cfg.tp.size, decode_size, decode_rank, &sources[j]);
    if t.page_tokens != cfg.page_tokens
        && cfg.layout.heads.is_none()
        && cfg.layout.regions != crate::core::planner::RegionKind::Fused
    {
        return Err(EngineError::Config(format!(
            "decode's pages hold {} tokens and ours {}: a K/V layout needs its head geometry \
             (KvLayout::with_heads) to be written into pages of another size",
            t.page_tokens, cfg.page_tokens
        )));
    }
    let planner =
        Planner::with_page_tokens(&cfg.layout, &t.dst, mapping, cfg.page_tokens, t.page_tokens)
            .map_err(|source| EngineError::Plan {
                request: None,
                source,
            })?;
    // Decode's pool may come in several registrations too: our writes split at its segments.
    let dst_seg = super::pools::segment(
        t.dst.buffer_len,
        t.regions.len(),
        t.regions.iter().map(|r| r.len).min().unwrap_or(0),
    )?;
    // Its instance's other TP ranks that this rank writes into allocate the same requests.
    let fan_out = if t.instance.is_empty() {
        1
    } else {
        cfg.tp.target_count(cfg.tp.size, decode_size, cfg.tp.rank)?
    };
    // Decode's landing memory goes after its pool's regions.
    let mut regions = t.regions;
    let landing = match t.landing {
        Some(r) => {
            let index = u32::try_from(regions.len())
                .map_err(|_| EngineError::Config("decode announced too many regions".into()))?;
            let len = r.len;
            regions.push(r);
            Some((index, len))
        }
        None => None,
    };
    let peer = transport.connect(t.metadata, &regions, notify_key)?;
    Ok(Link {
        id: t.id,
        addr: t.addr,
        peer,
        planner,
        dst_page_tokens: t.page_tokens,
        notify_rank,
        dst_seg,
        dst_whole: t.dst.buffer_len,
        writer,
        silence: super::silence_bound(t.heartbeat),
        decode_instance: t.instance,
        decode_tp: (decode_rank, decode_size),
        fan_out,
        landing,
    })
}

/// Offers ([`PrefillEngine::offer`]) that may wait for their allocations at once.
pub const MAX_OFFERS: usize = 1 << 16;

/// Undecided requests one decode may have on this rank at once, by default
/// ([`PrefillLimits::requests_per_decode`]).
pub const MAX_REQUESTS_PER_DECODE: usize = 1 << 16;

/// Destination pages one decode's undecided requests here may name together, as a multiple of
/// its pool, by default ([`PrefillLimits::pages_per_decode_pool`]). A decode that works hands out each page to one request at a time, but it may reuse
/// a request's pages once its own side is done, before this rank decided it.
pub const PAGES_PER_DECODE_POOL: u64 = 4;

/// Allocations that may wait for [`PrefillEngine::next_request`] at once, by default
/// ([`PrefillLimits::unread`]); later ones are dropped, counted ([`PrefillStats::unread_dropped`]).
pub const MAX_UNREAD: usize = 1 << 16;

/// Chunks an offered request posts before letting the runtime's other tasks run.
const OFFER_CHUNKS_PER_TURN: u32 = 16;

/// Chunks of one offered request that may be posted and not over, or waiting for a landing
/// range, at once: a decode chooses the chunk count.
const OFFER_CHUNKS_IN_FLIGHT: usize = 256;

/// Decisions about requests this rank never held that are kept for [`PrefillEngine::decided`]
/// (the oldest go first).
pub const MAX_FOREIGN_DECISIONS: usize = 1 << 14;

/// Failed votes for requests this rank never held that one decode may have outstanding (see
/// [`PrefillStats::unknown_aborts`]).
pub const MAX_UNKNOWN_ABORTS: usize = 1 << 10;

/// How often a rank tries again to reach a lower rank whose connection ended.
const MESH_RETRY: Duration = Duration::from_millis(100);
/// Bound on one such attempt (connection and handshake).
const MESH_ATTEMPT: Duration = Duration::from_secs(2);

/// Connects to every lower rank and waits until every higher one connected; the listener keeps
/// accepting afterwards, and a lower rank whose connection ends is connected to again, so a rank
/// that restarts (a new incarnation) rejoins the mesh. Returns the tasks to stop with the engine.
async fn form_mesh(
    inner: &Arc<Inner>,
    listener: Listener,
    decode_hello: &Hello,
    deadline: tokio::time::Instant,
) -> Result<Vec<tokio::task::JoinHandle<()>>, EngineError> {
    let cfg = &inner.cfg;
    let mut hello = decode_hello.clone();
    // PP peers need no backend data: votes travel on the control connection.
    hello.backend.worker_or_agent.clear();
    hello.backend.regions.clear();
    let hello = Arc::new(hello);
    let me = cfg.pp_rank;
    let mut changed = inner.mesh_changed.subscribe();
    // Stopped if the mesh does not form: a caller may start again on the same mesh socket.
    let tasks = TaskGuard(Mutex::new(vec![tokio::spawn(mesh_accept_loop(
        Arc::downgrade(inner),
        listener,
        hello.clone(),
    ))]));
    for rank in 0..me {
        let c = connect_peer(inner, &hello, rank, deadline).await?;
        attach_peer(inner, &hello, rank, c);
    }
    loop {
        // A peer counts once both sides attached the connection: ours is in `peer_writers`, and
        // its `Ready` says its board counts us. Only then may decode ask this rank for requests.
        let missing = {
            let st = lock(&inner.state);
            st.peer_writers
                .iter()
                .zip(&st.mesh_confirmed)
                .enumerate()
                .filter(|&(r, (w, ok))| r != usize::from(me) && !(w.is_some() && *ok))
                .count()
        };
        if missing == 0 {
            break;
        }
        match tokio::time::timeout_at(deadline, changed.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(EngineError::Shutdown),
            Err(_) => {
                return Err(EngineError::Timeout(format!(
                    "{missing} PP peers did not connect"
                )));
            }
        }
    }
    // Votes cast before the mesh existed were queued by the board; send them now.
    let mut st = lock(&inner.state);
    inner.flush_board(&mut st);
    let formed = std::mem::take(&mut *tasks.0.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(formed)
}

/// Connects to the lower rank `rank` and runs the handshake; its incarnation must be new.
async fn connect_peer(
    inner: &Arc<Inner>,
    hello: &Hello,
    rank: u16,
    deadline: tokio::time::Instant,
) -> Result<(Connection, Hello), EngineError> {
    let addr = lock_peers(inner)
        .get(usize::from(rank))
        .copied()
        .ok_or_else(|| EngineError::Config(format!("no address for PP rank {rank}")))?;
    let (c, remote) = connect_taken(addr, hello, &inner.secret, deadline, Dialed::MeshPeer).await?;
    if remote.pp_rank != rank {
        return Err(EngineError::Config(format!(
            "peer at rank {rank}'s address says it is rank {}",
            remote.pp_rank
        )));
    }
    Ok((c, remote))
}

/// Accepts higher ranks for as long as the engine lives: the first start of each, then every new
/// incarnation of one whose connection ended.
async fn mesh_accept_loop(inner: Weak<Inner>, listener: Listener, hello: Arc<Hello>) {
    let places = super::admission::Places::new();
    loop {
        let (c, place) = super::admission::admit(&listener, &places, || {
            if let Some(i) = inner.upgrade() {
                i.counters
                    .refused_connections
                    .fetch_add(1, Ordering::Relaxed);
            }
        })
        .await;
        let Some(i) = inner.upgrade() else { return };
        let hello = hello.clone();
        // Each handshake on its own task: a slow or silent client holds up nobody.
        tokio::spawn(async move {
            let mut place = place;
            let mut c = c;
            c.set_label(control::channel::MESH_LABEL);
            let deadline = tokio::time::Instant::now() + i.cfg.connect_timeout;
            let me = i.cfg.pp_rank;
            let vouch = place.vouch();
            let check = |r: &Hello| -> Result<(), RejectReason> {
                // Called once the peer proved the secret.
                vouch.authenticated();
                if r.role != Role::Prefill {
                    return Err(RejectReason::RoleMismatch(format!(
                        "a vote mesh takes prefill ranks, not a {}",
                        r.role
                    )));
                }
                if r.pp_rank <= me {
                    return Err(RejectReason::PpMismatch(format!(
                        "rank {me} accepts only higher ranks, not {}",
                        r.pp_rank
                    )));
                }
                i.mesh_admissible(r.pp_rank, r.incarnation)
            };
            let shook = tokio::select! {
                r = control::handshake_with(&mut c, &hello, &i.secret, deadline, check) => r,
                // A newer connection took its place (counted in `refused_connections`).
                () = place.evicted() => return,
            };
            match shook {
                Ok(remote) => attach_peer(&i, &hello, remote.pp_rank, (c, remote)),
                Err(e) => {
                    let c = &i.counters;
                    super::count_handshake_failure(&e, &c.auth_failures, &c.handshake_failures);
                    tracing::warn!(error = %e, "PP peer handshake failed");
                }
            }
        });
    }
}

/// Binds an authenticated peer connection to `rank` (unless another won the race), and starts
/// its reader; when it ends, the rank is lost and, for a lower rank, reconnection begins.
fn attach_peer(
    inner: &Arc<Inner>,
    hello: &Arc<Hello>,
    rank: u16,
    (c, remote): (Connection, Hello),
) {
    let incarnation = remote.incarnation;
    let (mut reader, writer) = c.into_split();
    let (tx, rx) = Outbox::new();
    {
        let mut st = lock(&inner.state);
        let busy = st.peer_writers[usize::from(rank)].is_some();
        let rejoin = match st.mesh_incarnations.admit(rank, incarnation, busy) {
            Ok(previous) => previous.is_some(),
            Err(e) => {
                tracing::warn!(rank, error = %e, "PP peer not admitted");
                return;
            }
        };
        if rejoin {
            if let Err(e) = st.board.handle_peer_joined(Instant::now(), rank) {
                tracing::warn!(rank, error = %e, "PP peer not admitted");
                return;
            }
            tracing::info!(rank, incarnation, "PP peer rejoined");
        }
        // Tell the peer that our board counts it from now on.
        let _ = tx.send(Msg::Ready);
        st.peer_writers[usize::from(rank)] = Some(tx);
        inner.flush_board(&mut st);
    }
    inner.mesh_changed.send_modify(|n| *n += 1);
    // Three of the peer's own intervals, as its Hello announced them.
    let silence = super::silence_bound(remote.heartbeat());
    let cut = Arc::new(Notify::new());
    let write = tokio::spawn(super::write_loop(
        writer,
        rx,
        inner.cfg.heartbeat,
        (super::stall_bound(silence), cut.clone()),
    ));
    let weak = Arc::downgrade(inner);
    let hello = hello.clone();
    let read = tokio::spawn(async move {
        loop {
            let got = tokio::select! {
                got = reader.recv_within(silence) => got,
                () = cut.notified() => {
                    if let Some(i) = weak.upgrade() {
                        i.counters.stalled_connections.fetch_add(1, Ordering::Relaxed);
                    }
                    tracing::warn!(rank, "PP peer connection cut: it does not read what this rank sends");
                    break;
                }
            };
            match got {
                Ok(Some(Msg::Vote(v))) => match weak.upgrade() {
                    Some(i) => i.on_peer_message(rank, &v.bytes),
                    None => return,
                },
                Ok(Some(Msg::Ready)) => match weak.upgrade() {
                    Some(i) => {
                        let mut st = lock(&i.state);
                        if let Some(ok) = st.mesh_confirmed.get_mut(usize::from(rank)) {
                            *ok = true;
                        }
                        if st.announced && st.mesh_complete(i.cfg.pp_rank) {
                            tracing::info!(
                                pp_rank = i.cfg.pp_rank,
                                "vote mesh formed again: decodes told Ready"
                            );
                            st.tell_decodes(&Msg::Ready);
                        }
                        drop(st);
                        i.mesh_changed.send_modify(|n| *n += 1);
                    }
                    None => return,
                },
                Ok(Some(Msg::Close)) | Ok(None) | Err(_) => break,
                Ok(Some(Msg::Heartbeat)) => {}
                Ok(Some(other)) => {
                    // A kind no PP peer sends once connected: counted and dropped.
                    if let Some(i) = weak.upgrade() {
                        i.counters.refused.fetch_add(1, Ordering::Relaxed);
                    }
                    tracing::debug!(rank, kind = ?other.kind(), "unexpected message from a PP peer dropped");
                }
            }
        }
        let Some(i) = weak.upgrade() else { return };
        i.on_peer_lost(rank);
        if rank < i.cfg.pp_rank {
            let task = tokio::spawn(reconnect_peer(Arc::downgrade(&i), hello, rank));
            i.keep_task(task);
        }
    });
    inner.keep_task(write);
    inner.keep_task(read);
}

/// Connects to the lower rank `rank` again after its connection ended, until a new incarnation
/// of it answers or the engine closes.
async fn reconnect_peer(inner: Weak<Inner>, hello: Arc<Hello>, rank: u16) {
    loop {
        tokio::time::sleep(MESH_RETRY).await;
        let Some(i) = inner.upgrade() else { return };
        if i.mesh_closed() {
            return;
        }
        // A short attempt, so that a new address (a restarted peer on a new port) is picked up.
        let deadline = tokio::time::Instant::now() + MESH_ATTEMPT.min(i.cfg.connect_timeout);
        match connect_peer(&i, &hello, rank, deadline).await {
            Ok(c) => {
                if i.mesh_admissible(rank, c.1.incarnation).is_ok() {
                    attach_peer(&i, &hello, rank, c);
                    return;
                }
            }
            Err(e) => tracing::debug!(rank, error = %e, "PP peer not back yet"),
        }
    }
}
