//! The engines servers link: [`DecodeEngine`] receives a request's pages from every PP rank and says
//! when they are all there; [`PrefillEngine`] (one per PP rank) writes its layers' pages chunk by
//! chunk and agrees with its PP peers on each request's terminal state.
//!
//! Both sit on a [`Transport`] (UCX or NIXL) for the bytes and on the tokio control plane for
//! handshakes, page allocations, aborts and votes. Decisions are made by the sans-IO core
//! ([`crate::core`]); this module only feeds it and carries out what it says.

mod admission;
mod aux;
mod decode;
mod landing;
mod pools;
mod prefill;

pub use admission::{Admission, MAX_PENDING_HANDSHAKES};
pub use decode::{
    Absence, ChunkJobHook, DEFAULT_LANDING_BYTES, DEFAULT_LANDING_SLOTS, DecodeConfig,
    DecodeEngine, DecodeStage, DecodeStats, Expected, ShutdownReport,
};
pub use prefill::{
    ExternalDecode, IncomingRequest, LinkId, MAX_FOREIGN_DECISIONS, MAX_OFFERS,
    MAX_REQUESTS_PER_DECODE, MAX_UNKNOWN_ABORTS, MAX_UNREAD, MeshSocket, NotifyFormat,
    PAGES_PER_DECODE_POOL, PrefillConfig, PrefillEngine, PrefillLimits, PrefillStats,
};

use crate::control::{self, ControlError};
use crate::core::planner::{KvLayout, PlanError, RegionKind, TpMapping};
use crate::core::tracker::FailureReason;
use crate::core::vote::VoteError;
use crate::core::{FailureCode, RequestId};
pub use crate::mem::Pool;
use crate::transport::nixl::{NixlConfig, NixlTransport};
use crate::transport::ucx::{UcxConfig, UcxTransport};
use crate::transport::{BackendKind, ProgressScheduling, Sink, Transport, TransportError};
use std::sync::Arc;

/// How a request ended on the decode side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every chunk of every PP rank arrived (and matched its checksum where one was sent).
    Complete,
    /// The request failed; it will never complete.
    Failed(FailureReason),
}

/// An engine error, with the context of the operation that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The transport failed.
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    /// The control plane failed.
    #[error("control plane: {0}")]
    Control(#[from] ControlError),
    /// The layouts or page lists do not plan.
    #[error("planning request {request:?}: {source}")]
    Plan {
        /// The request.
        request: Option<RequestId>,
        /// Why.
        #[source]
        source: PlanError,
    },
    /// A configuration error.
    #[error("configuration: {0}")]
    Config(String),
    /// The decode side never sent the request's page allocation in time.
    #[error("request {0:?} unknown: decode sent no TransferRequest for it in time")]
    UnknownRequest(RequestId),
    /// The request was aborted or failed before this operation.
    #[error("request {request:?} failed: {code}")]
    RequestFailed {
        /// The request.
        request: RequestId,
        /// Why.
        code: FailureCode,
    },
    /// A chunk's writes failed.
    #[error("request {request:?} chunk {chunk}: {source}")]
    Write {
        /// The request.
        request: RequestId,
        /// The chunk.
        chunk: u32,
        /// The transport's error.
        #[source]
        source: TransportError,
    },
    /// The vote board refused an input.
    #[error("vote: {0}")]
    Vote(#[from] VoteError),
    /// The request is already being tracked, or the tracker refused it.
    #[error("tracker: {0}")]
    Tracker(String),
    /// A bound passed.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The engine is shutting down.
    #[error("engine is shut down")]
    Shutdown,
    /// A destination page is held by another request (live, awaiting its ranks' confirmation, or
    /// quarantined).
    #[error("page {page} is held by request {by:?}")]
    PageHeld {
        /// The page.
        page: u32,
        /// The request that holds it.
        by: RequestId,
    },
    /// The notification sender is already bound to a rank.
    #[error("sender {sender:?} is already bound to rank {rank}")]
    SenderTaken {
        /// The sender that was to be bound.
        sender: crate::transport::Sender,
        /// The rank it counts for.
        rank: u16,
    },
    /// A copy into or out of the pool was refused.
    #[error("pool access: {0}")]
    Memory(#[from] crate::mem::CopyError),
}

/// Which backend to build, and its settings.
#[derive(Debug, Clone)]
pub enum BackendConfig {
    /// Direct UCX.
    Ucx(UcxConfig),
    /// NIXL with its UCX plugin.
    Nixl(NixlConfig),
    /// A transport the caller builds: a wrapper such as
    /// [`FaultTransport`](crate::transport::fault::FaultTransport), or a backend of its own.
    Custom(CustomBackend),
}

/// The signature of [`CustomBackend`]'s builder: given the engine's sink, the transport.
pub type TransportFactory =
    dyn Fn(Sink) -> Result<Arc<dyn Transport>, TransportError> + Send + Sync;

/// A transport built by the caller's function, for [`BackendConfig::Custom`].
///
/// The engine calls the function once per start with the [`Sink`] it wants incoming events on; the
/// transport returned must hand every notification and peer failure to that sink. `kind` is what
/// [`BackendConfig::kind`] reports before anything is built; the engine announces the built
/// transport's own [`Transport::kind`] to its peers, so the two should agree.
#[derive(Clone)]
pub struct CustomBackend {
    kind: BackendKind,
    build: Arc<TransportFactory>,
}

impl CustomBackend {
    /// A backend of kind `kind` built by `build`.
    pub fn new(
        kind: BackendKind,
        build: impl Fn(Sink) -> Result<Arc<dyn Transport>, TransportError> + Send + Sync + 'static,
    ) -> Self {
        CustomBackend {
            kind,
            build: Arc::new(build),
        }
    }

    /// The kind it reports.
    pub fn kind(&self) -> BackendKind {
        self.kind
    }
}

impl std::fmt::Debug for CustomBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CustomBackend")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

/// How long a decode engine's UCX progress thread polls after its last event before it sleeps on
/// UCX's event fd. A decode engine waits for notifications: polling 200 µs (the UCX default)
/// after each one cost its process 6.5 ms of CPU per request of 32 chunks in `kvbench
/// --processes` against 1.4 to 1.7 ms with 10 µs, which delayed a single 4 KiB write by about
/// half a microsecond (docs/performance.md, 2026-12-06).
pub const DECODE_SPIN: std::time::Duration = std::time::Duration::from_micros(10);

impl BackendConfig {
    /// The default settings of `kind`, naming the engine `name`.
    pub fn default_for(kind: BackendKind, name: &str) -> Self {
        match kind {
            BackendKind::Nixl => BackendConfig::Nixl(NixlConfig {
                name: name.into(),
                ..NixlConfig::default()
            }),
            _ => BackendConfig::Ucx(UcxConfig {
                name: name.into(),
                ..UcxConfig::default()
            }),
        }
    }

    /// The default settings of `kind` for a decode engine, naming it `name`: as
    /// [`default_for`](Self::default_for), except that a UCX receiver sleeps on UCX's event fd as
    /// soon as it is idle ([`DECODE_SPIN`]) instead of polling for [`UcxConfig::spin`] first.
    pub fn default_for_decode(kind: BackendKind, name: &str) -> Self {
        match Self::default_for(kind, name) {
            BackendConfig::Ucx(c) => BackendConfig::Ucx(UcxConfig {
                spin: DECODE_SPIN,
                ..c
            }),
            other => other,
        }
    }

    /// This config with the backend's progress thread scheduled as `scheduling` (see
    /// [`ProgressScheduling`]: a receiver's notifications seen at once on busy cores). A
    /// [`Custom`](BackendConfig::Custom) backend is left as it is.
    #[must_use]
    pub fn with_scheduling(mut self, scheduling: ProgressScheduling) -> Self {
        match &mut self {
            BackendConfig::Ucx(c) => c.scheduling = scheduling,
            BackendConfig::Nixl(c) => c.scheduling = scheduling,
            BackendConfig::Custom(_) => {}
        }
        self
    }

    /// This config with the backend's progress thread polling for `spin` after its last event
    /// before it sleeps ([`UcxConfig::spin`], [`NixlConfig::spin`]). A
    /// [`Custom`](BackendConfig::Custom) backend is left as it is.
    #[must_use]
    pub fn with_spin(mut self, spin: std::time::Duration) -> Self {
        match &mut self {
            BackendConfig::Ucx(c) => c.spin = spin,
            BackendConfig::Nixl(c) => c.spin = spin,
            BackendConfig::Custom(_) => {}
        }
        self
    }

    /// Which backend this builds.
    pub fn kind(&self) -> BackendKind {
        match self {
            BackendConfig::Ucx(_) => BackendKind::Ucx,
            BackendConfig::Nixl(_) => BackendKind::Nixl,
            BackendConfig::Custom(c) => c.kind,
        }
    }

    /// Starts the backend (its library context, worker and progress thread), logging how long that
    /// took at info.
    fn build(&self, sink: Sink) -> Result<Arc<dyn Transport>, TransportError> {
        let t0 = std::time::Instant::now();
        let transport: Arc<dyn Transport> = match self {
            BackendConfig::Ucx(c) => Arc::new(UcxTransport::new(c.clone(), sink)?),
            BackendConfig::Nixl(c) => Arc::new(NixlTransport::new(c.clone(), sink)?),
            BackendConfig::Custom(c) => (c.build)(sink)?,
        };
        tracing::info!(
            backend = ?self.kind(),
            start_micros = crate::transport::micros_since(t0),
            "transport started"
        );
        Ok(transport)
    }
}

fn to_wire_kind(k: BackendKind) -> control::BackendKind {
    match k {
        BackendKind::Nixl => control::BackendKind::Nixl,
        _ => control::BackendKind::Ucx,
    }
}

/// A side's TP rank and size, and how its KV heads split over TP ranks (see
/// [`crate::core::topology`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpConfig {
    /// This side's TP rank.
    pub rank: u16,
    /// This side's TP size.
    pub size: u16,
    /// How the two sides' TP ranks map, which both sides must announce alike:
    /// [`control::TpMode::Identical`] (equal TP sizes, rank `i` to rank `i`, whole pages: the
    /// default), [`control::TpMode::Replicated`] (MLA: every rank holds the whole latent, any TP
    /// sizes) or [`control::TpMode::HeadSliced`] (MHA/GQA heads split over the ranks, any TP
    /// sizes; the pool's layout then carries its [`HeadLayout`](crate::core::planner::HeadLayout)
    /// and `kv_heads` the model's head count).
    pub mode: control::TpMode,
    /// The model's KV heads per layer (for [`control::TpMode::HeadSliced`]; 0 otherwise).
    pub kv_heads: u32,
}

impl Default for TpConfig {
    fn default() -> Self {
        TpConfig {
            rank: 0,
            size: 1,
            mode: control::TpMode::Identical,
            kv_heads: 0,
        }
    }
}

impl TpConfig {
    /// Checks the rank against the size, and that head-sliced TP has the heads it slices.
    fn validate(&self, layout: &KvLayout) -> Result<(), EngineError> {
        if self.rank >= self.size {
            return Err(EngineError::Config(format!(
                "TP rank {} is not below TP size {}",
                self.rank, self.size
            )));
        }
        if self.mode == control::TpMode::HeadSliced
            && (self.kv_heads == 0 || layout.heads.is_none())
        {
            return Err(EngineError::Config(
                "head-sliced TP needs the model's KV head count and the layout's head geometry"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The shape [`crate::core::topology`] maps: heads only where they are sliced.
    fn shape(&self, size: u16) -> crate::core::topology::TpShape {
        crate::core::topology::TpShape {
            tp_size: u32::from(size),
            kv_heads: match self.mode {
                control::TpMode::HeadSliced => self.kv_heads,
                _ => 0,
            },
        }
    }

    /// Every prefill TP rank that writes into decode TP rank `decode_rank`, with its heads, in
    /// the order both sides number them (a source's index is its `j` in the slot): what both
    /// sides compute alike from the two TP sizes.
    fn source_at(
        &self,
        prefill_size: u16,
        decode_size: u16,
        decode_rank: u16,
    ) -> Result<Vec<crate::core::topology::Source>, EngineError> {
        if self.mode == control::TpMode::Identical && prefill_size != decode_size {
            return Err(EngineError::Config(format!(
                "identical TP needs equal TP sizes: prefill {prefill_size}, decode {decode_size}"
            )));
        }
        crate::core::topology::sources(
            self.shape(prefill_size),
            self.shape(decode_size),
            u32::from(decode_rank),
        )
        .map_err(|e| EngineError::Config(format!("TP topology: {e}")))
    }

    /// Whether prefill TP rank `prefill_rank` of TP size `prefill_size` writes into decode TP rank
    /// `decode_rank` of TP size `decode_size` under this mapping (false for sizes it cannot map):
    /// which of the ranks a directory lists a side links with.
    pub fn writes_into(
        &self,
        (prefill_rank, prefill_size): (u16, u16),
        (decode_rank, decode_size): (u16, u16),
    ) -> bool {
        self.source_at(prefill_size, decode_size, decode_rank)
            .is_ok_and(|s| s.iter().any(|s| s.prefill_rank == u32::from(prefill_rank)))
    }

    /// Whether this mapping maps prefill TP size `prefill_size` onto decode TP size `decode_size`
    /// at all (every decode rank has its sources): where it does not, no rank writes anywhere
    /// ([`writes_into`](Self::writes_into) is false) because the sizes are wrong, not because
    /// a rank is spare.
    pub fn maps(&self, prefill_size: u16, decode_size: u16) -> bool {
        (0..decode_size).all(|d| self.source_at(prefill_size, decode_size, d).is_ok())
    }

    /// How many decode TP ranks (of `decode_size`) prefill TP rank `prefill_rank` writes into.
    fn target_count(
        &self,
        prefill_size: u16,
        decode_size: u16,
        prefill_rank: u16,
    ) -> Result<usize, EngineError> {
        if self.mode == control::TpMode::Identical {
            return Ok(1);
        }
        crate::core::topology::targets(
            self.shape(prefill_size),
            self.shape(decode_size),
            u32::from(prefill_rank),
        )
        .map(|t| t.len())
        .map_err(|e| EngineError::Config(format!("TP topology: {e}")))
    }

    /// The mapping of `source`'s writes into decode rank `decode_rank`.
    fn mapping(
        &self,
        prefill_size: u16,
        decode_size: u16,
        decode_rank: u16,
        source: &crate::core::topology::Source,
    ) -> TpMapping {
        TpMapping::for_source(
            self.shape(prefill_size),
            self.shape(decode_size),
            u32::from(decode_rank),
            source,
        )
    }
}

/// The layout as the control plane carries it.
fn layout_info(
    total_layers: u32,
    page_tokens: u32,
    layout: &KvLayout,
    tp: &TpConfig,
) -> control::LayoutInfo {
    control::LayoutInfo {
        num_layers: total_layers,
        first_layer: layout.first_layer,
        layers: layout.num_layers,
        kv_regions: layout.regions.count() as u8,
        page_tokens,
        bytes_per_token_per_layer: layout.page_bytes / u64::from(page_tokens.max(1)),
        pages: layout.num_pages,
        kv_heads: layout.heads.map(|h| h.num_heads).unwrap_or(0),
        tp_mode: tp.mode,
        model_kv_heads: tp.kv_heads,
        token_major: layout
            .heads
            .is_some_and(|h| h.order == crate::core::planner::HeadOrder::TokenMajor),
        key_column_bytes: match layout.heads.map(|h| h.order) {
            Some(crate::core::planner::HeadOrder::KeyColumns { elem_bytes }) => elem_bytes,
            _ => 0,
        },
    }
}

/// A peer's layout back from the wire: the packed layout its numbers describe, with its head
/// geometry where heads are sliced.
fn layout_from_info(info: &control::LayoutInfo) -> Result<KvLayout, EngineError> {
    let regions = match info.kv_regions {
        1 => RegionKind::Fused,
        2 => RegionKind::SplitKv,
        n => {
            return Err(EngineError::Config(format!(
                "peer layout has {n} KV regions"
            )));
        }
    };
    let page_bytes = info
        .bytes_per_token_per_layer
        .saturating_mul(u64::from(info.page_tokens));
    let layout = KvLayout::packed(
        info.first_layer,
        info.layers,
        regions,
        page_bytes,
        info.pages,
    );
    // Head geometry travels where the peer has it and it divides the token's bytes: needed to
    // slice heads, and to map pages of other sizes where heads lie head-major.
    if info.kv_heads == 0
        || !info
            .bytes_per_token_per_layer
            .is_multiple_of(u64::from(info.kv_heads))
    {
        return Ok(layout);
    }
    Ok(layout.with_heads(crate::core::planner::HeadLayout {
        num_heads: info.kv_heads,
        head_bytes: info.bytes_per_token_per_layer / u64::from(info.kv_heads),
        page_tokens: info.page_tokens,
        order: if info.token_major {
            crate::core::planner::HeadOrder::TokenMajor
        } else if info.key_column_bytes != 0 {
            crate::core::planner::HeadOrder::KeyColumns {
                elem_bytes: info.key_column_bytes,
            }
        } else {
            crate::core::planner::HeadOrder::HeadMajor
        },
    }))
}

fn remote_regions(info: &control::BackendInfo) -> Vec<crate::transport::RemoteRegion> {
    info.regions
        .iter()
        .map(|r| crate::transport::RemoteRegion {
            addr: r.addr,
            len: r.len,
            rkey: r.rkey.clone(),
        })
        .collect()
}

fn wire_regions(r: &crate::transport::RemoteRegion) -> control::RemoteRegion {
    control::RemoteRegion {
        addr: r.addr,
        len: r.len,
        rkey: r.rkey.clone(),
    }
}

/// A value for each of the most recent requests, bounded: oldest dropped first.
#[derive(Debug)]
struct Recent<V> {
    at: std::collections::HashMap<RequestId, V>,
    order: std::collections::VecDeque<RequestId>,
}

impl<V> Default for Recent<V> {
    fn default() -> Self {
        Recent {
            at: std::collections::HashMap::new(),
            order: std::collections::VecDeque::new(),
        }
    }
}

/// Instants of recent requests, for latency measurements.
type Stamps = Recent<std::time::Instant>;

impl<V> Recent<V> {
    const CAP: usize = 4096;

    fn record(&mut self, request: RequestId, value: V) {
        if self.at.insert(request, value).is_none() {
            self.order.push_back(request);
            while self.order.len() > Self::CAP {
                if let Some(old) = self.order.pop_front() {
                    self.at.remove(&old);
                }
            }
        }
    }

    fn get(&self, request: RequestId) -> Option<&V> {
        self.at.get(&request)
    }

    fn take(&mut self, request: RequestId) -> Option<V> {
        // The order entry goes stale and is dropped when it reaches the front.
        self.at.remove(&request)
    }
}

/// Drives a state machine's timer: `tick` handles the timeouts due now and returns the next deadline;
/// it runs again when that deadline passes or `wake` is notified (new work may have an earlier one).
/// Only a `Weak` to the owner is kept while asleep, so the loop ends once the engine is gone.
async fn run_timer<T>(
    owner: std::sync::Weak<T>,
    wake: Arc<tokio::sync::Notify>,
    tick: impl Fn(&T) -> Option<std::time::Instant>,
) {
    loop {
        let next = match owner.upgrade() {
            Some(o) => tick(&o),
            None => return,
        };
        let sleep = async {
            match next {
                Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
                None => tokio::time::sleep(std::time::Duration::from_secs(1)).await,
            }
        };
        tokio::select! {
            _ = sleep => {}
            _ = wake.notified() => {}
        }
    }
}

/// Counts a handshake a listener's peer failed: in `auth` where it did not prove the secret, in
/// `other` otherwise.
fn count_handshake_failure(
    e: &ControlError,
    auth: &std::sync::atomic::AtomicU64,
    other: &std::sync::atomic::AtomicU64,
) {
    let counter = if e.is_auth_failure() { auth } else { other };
    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// The default heartbeat interval of every control connection (`heartbeat` in both configs).
pub const DEFAULT_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(5);

/// Heartbeat intervals of silence after which a peer is declared lost.
pub const SILENT_INTERVALS: u32 = 3;

/// How long a peer may stay silent with heartbeats every `heartbeat` (saturating).
fn silence_bound(heartbeat: Option<std::time::Duration>) -> Option<std::time::Duration> {
    heartbeat.map(|h| {
        h.checked_mul(SILENT_INTERVALS)
            .unwrap_or(std::time::Duration::MAX)
    })
}

/// Refuses a heartbeat interval of zero (`None` is how a side sends none) or longer than a Hello
/// can announce (`u32::MAX` ms, about 49 days).
fn check_heartbeat(heartbeat: Option<std::time::Duration>) -> Result<(), EngineError> {
    match heartbeat {
        Some(h) if h.is_zero() => Err(EngineError::Config(
            "a heartbeat interval must be above 0 (None sends no heartbeats)".into(),
        )),
        Some(h) if h > std::time::Duration::from_millis(u64::from(u32::MAX)) => {
            Err(EngineError::Config(format!(
                "a heartbeat interval of {h:?} is longer than a Hello can announce ({} ms)",
                u32::MAX
            )))
        }
        _ => Ok(()),
    }
}

/// The longest a peer may leave a message this side queued for it untaken, whatever interval it
/// announced, none included: a peer cannot make what waits for it grow without end by announcing a
/// long interval, or none.
pub const MAX_STALL: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a message queued for a peer whose silence bound is `silence` may wait for the peer to
/// take it: that bound, at most [`MAX_STALL`] (`MAX_STALL` for a peer with none).
fn stall_bound(silence: Option<std::time::Duration>) -> std::time::Duration {
    silence.map_or(MAX_STALL, |b| b.min(MAX_STALL))
}

/// What the engine queues for one control connection: each message with the time it was queued,
/// which the connection's [`write_loop`] bounds.
#[derive(Clone, Debug)]
pub(crate) struct Outbox(tokio::sync::mpsc::UnboundedSender<(tokio::time::Instant, control::Msg)>);

/// The writer's end of an [`Outbox`].
pub(crate) type OutboxReader =
    tokio::sync::mpsc::UnboundedReceiver<(tokio::time::Instant, control::Msg)>;

impl Outbox {
    /// A queue for one connection, and its writer's end.
    pub(crate) fn new() -> (Self, OutboxReader) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (Self(tx), rx)
    }

    /// Queues `msg`, unless the connection's writer is gone.
    pub(crate) fn send(&self, msg: control::Msg) -> Result<(), WriterGone> {
        self.0
            .send((tokio::time::Instant::now(), msg))
            .map_err(|_| WriterGone)
    }
}

/// An [`Outbox`]'s connection ended: what was queued is dropped.
#[derive(Debug)]
pub(crate) struct WriterGone;

/// Sends what the engine queues for one control connection, and a heartbeat every `heartbeat`
/// (when given); ends after a `Close`, when the queue closes, or when a send fails. A message the
/// peer has not taken within `bound` ([`stall_bound`]) of its being queued (the peer reads nothing,
/// or reads more slowly than this side queues, so what waits for it grows) ends it too and wakes
/// the `Notify`: the connection's read loop cuts the connection, so a peer that does not keep up
/// cannot make the queue grow without end.
async fn write_loop(
    mut writer: crate::control::ControlWriter,
    mut rx: OutboxReader,
    heartbeat: Option<std::time::Duration>,
    (bound, cut): (std::time::Duration, std::sync::Arc<tokio::sync::Notify>),
) {
    use crate::control::Msg;
    let mut tick = heartbeat.map(|h| {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + h, h);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    loop {
        let next = match tick.as_mut() {
            // What is queued goes first (any message tells the peer this side is alive): a
            // heartbeat stamped now must not put off the bound of older messages behind it.
            Some(t) => tokio::select! {
                biased;
                m = rx.recv() => m,
                _ = t.tick() => Some((tokio::time::Instant::now(), Msg::Heartbeat)),
            },
            None => rx.recv().await,
        };
        let Some((queued, msg)) = next else { return };
        let last = matches!(msg, Msg::Close);
        // The send is tried even past the bound, and goes if the socket takes it: a delay on this
        // side (a busy runtime, this side's own burst) is no fault of the peer. What the socket
        // does not take by then (the peer reads nothing, or more slowly than this side queues)
        // ends the connection. Unconstrained: a send paused only for the runtime's task budget is
        // no sign of a full socket.
        let due = queued + bound;
        let send = tokio::task::unconstrained(writer.send(&msg));
        let Ok(sent) = tokio::time::timeout_at(due, send).await else {
            tracing::warn!(
                ?bound,
                "the peer did not take a message within the bound of its being queued: \
                 connection cut"
            );
            cut.notify_one();
            return;
        };
        if sent.is_err() || last {
            return;
        }
    }
}

/// Reads the Hello of the decode engine at `addr` without joining it: authenticates with `token`
/// (`None`: the empty secret) as a prefill rank would, then takes decode's Hello (its layout, its
/// PP stage and [`DecodeConfig::app`]) and leaves; decode counts it in
/// [`DecodeStats::probes`]. For a prefill that builds its pool from what decode says.
///
/// # Errors
/// [`EngineError::Control`]: decode unreachable, a failed proof either way, a Hello that
/// contradicts itself, or `timeout`.
pub async fn probe_decode(
    addr: std::net::SocketAddr,
    token: Option<&control::Secret>,
    timeout: std::time::Duration,
) -> Result<control::Hello, EngineError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let none = control::Secret::none();
    let mut conn = control::Connection::connect(addr, deadline).await?;
    let hello = control::probe(
        &mut conn,
        control::Role::Prefill,
        token.unwrap_or(&none),
        deadline,
    )
    .await?;
    if hello.role != control::Role::Decode {
        return Err(EngineError::Config(format!(
            "{addr} is a {} engine, not decode",
            hello.role
        )));
    }
    Ok(hello)
}

/// Where the last incarnation drawn on this host is kept: `KVX_INCARNATION_FILE`, else
/// `kvx-incarnation` in the temporary directory.
fn incarnation_file() -> std::path::PathBuf {
    std::env::var_os("KVX_INCARNATION_FILE").map_or_else(
        || std::env::temp_dir().join("kvx-incarnation"),
        std::path::PathBuf::from,
    )
}

/// A new incarnation: nanoseconds since the Unix epoch, or one more than the last drawn on this
/// host if that is larger, so a restart on the same host gets a larger one even after its clock
/// stepped back. The last one is kept in a file shared by the host's processes
/// (`KVX_INCARNATION_FILE`, else `kvx-incarnation` in the temporary directory), locked while it is
/// read and written; where that file cannot be used, only this process's own draws are ordered.
pub fn fresh_incarnation() -> u64 {
    next_incarnation(Some(&incarnation_file()))
}

/// The last incarnation this process drew.
static LAST_INCARNATION: std::sync::Mutex<u64> = std::sync::Mutex::new(0);

fn next_incarnation(file: Option<&std::path::Path>) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .max(1);
    let mut last = LAST_INCARNATION
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let at_least = now.max(last.saturating_add(1));
    let n = match file.map(|f| draw_in_file(f, at_least)) {
        Some(Ok(n)) => n,
        Some(Err(e)) => {
            tracing::debug!(error = %e, "cannot keep incarnations in a file; ordered in this process only");
            at_least
        }
        None => at_least,
    };
    *last = n;
    n
}

/// `at_least`, or one more than the incarnation `file` holds if that is larger; written back.
fn draw_in_file(file: &std::path::Path, at_least: u64) -> std::io::Result<u64> {
    use std::io::{Read, Seek, Write};
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(file)?;
    f.lock()?;
    let mut text = String::new();
    f.read_to_string(&mut text)?;
    let last = text.trim().parse::<u64>().unwrap_or(0);
    let n = at_least.max(last.saturating_add(1));
    f.set_len(0)?;
    f.rewind()?;
    f.write_all(n.to_string().as_bytes())?;
    // Unlocked when `f` is closed.
    Ok(n)
}

impl From<crate::core::membership::Refusal> for crate::control::RejectReason {
    fn from(r: crate::core::membership::Refusal) -> Self {
        use crate::control::RejectReason;
        use crate::core::membership::Refusal;
        match r {
            Refusal::UnknownRank { rank, pp_size } => {
                RejectReason::PpMismatch(format!("rank {rank} is not below the PP size {pp_size}"))
            }
            Refusal::Busy { rank } => RejectReason::DuplicateRank {
                pp_rank: rank,
                tp_rank: 0,
            },
            Refusal::Stale { rank, got, last } => RejectReason::StaleIncarnation {
                pp_rank: rank,
                got,
                last,
            },
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::next_incarnation;

    /// A message waits for the peer at most three of the interval it announced, and never more
    /// than `MAX_STALL`, however long the interval it announced (a Hello carries up to u32::MAX
    /// ms), or if it announced none.
    #[test]
    fn the_stall_bound_is_the_peers_silence_bound_at_most_max_stall() {
        use super::{DEFAULT_HEARTBEAT, MAX_STALL, silence_bound, stall_bound};
        use std::time::Duration;
        let ms = Duration::from_millis;
        assert_eq!(stall_bound(silence_bound(Some(ms(500)))), ms(1500));
        assert_eq!(
            stall_bound(silence_bound(Some(DEFAULT_HEARTBEAT))),
            Duration::from_secs(15)
        );
        assert_eq!(stall_bound(silence_bound(Some(ms(19_999)))), ms(59_997));
        assert_eq!(stall_bound(silence_bound(Some(ms(20_000)))), MAX_STALL);
        assert_eq!(stall_bound(silence_bound(Some(ms(20_001)))), MAX_STALL);
        assert_eq!(silence_bound(Some(Duration::MAX)), Some(Duration::MAX));
        assert_eq!(
            stall_bound(silence_bound(Some(ms(u64::from(u32::MAX))))),
            MAX_STALL
        );
        assert_eq!(stall_bound(silence_bound(None)), MAX_STALL);
    }

    #[test]
    fn incarnations_on_one_host_never_go_backwards_even_when_its_clock_does() {
        let file =
            std::env::temp_dir().join(format!("kvx-incarnation-test-{}", std::process::id()));
        // The last start on this host drew one an hour ahead of the clock now (the clock stepped
        // back since).
        let now = next_incarnation(None);
        let ahead = now + 3_600_000_000_000;
        std::fs::write(&file, ahead.to_string()).unwrap();
        let a = next_incarnation(Some(&file));
        let b = next_incarnation(Some(&file));
        assert!(a > ahead && b > a, "{ahead} then {a}, {b}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), b.to_string());
        // Without a usable file, this process's own draws still rise.
        let c = next_incarnation(Some(std::path::Path::new("/nonexistent/dir/file")));
        assert!(c > b);
        let _ = std::fs::remove_file(&file);
    }
}
