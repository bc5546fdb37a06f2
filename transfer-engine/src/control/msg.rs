//! Control messages and the checks a receiver applies to them.
//!
//! These are the control plane's own wire structs; the engine converts them to and from the
//! core's types, so this module depends on nothing else in the crate.

use serde::{Deserialize, Serialize};

use super::frame::{MsgKind, PROTOCOL_VERSION};

/// Which side of disaggregated serving an engine is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Role {
    /// Runs prompts and writes KV pages out.
    Prefill,
    /// Allocates pages, receives KV pages, generates tokens.
    Decode,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        })
    }
}

/// How KV heads are spread over TP ranks; both sides must agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum TpMode {
    /// Same TP size on both sides; rank i writes to rank i, byte for byte.
    Identical,
    /// Every TP rank holds the whole KV (MLA latent): any TP sizes, same bytes per token.
    Replicated,
    /// Heads are sliced over TP ranks: TP sizes may differ, but the model's total bytes per token
    /// per layer (`bytes_per_token_per_layer * tp_size`) must agree.
    HeadSliced,
}

/// A heartbeat interval in whole milliseconds, rounded up (at least 1); 0 for none.
fn heartbeat_ms(every: Option<std::time::Duration>) -> u32 {
    every.map_or(0, |d| {
        u32::try_from(d.as_micros().div_ceil(1000))
            .unwrap_or(u32::MAX)
            .max(1)
    })
}

/// The KV cache layout one side registered, as far as the peer needs it to plan writes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayoutInfo {
    /// Layers in the whole model.
    pub num_layers: u32,
    /// First layer this side holds.
    pub first_layer: u32,
    /// Number of layers this side holds, from `first_layer`.
    pub layers: u32,
    /// KV regions per layer: 1 for fused KV (or MLA latent), 2 for split K and V.
    pub kv_regions: u8,
    /// Tokens per page.
    pub page_tokens: u32,
    /// Bytes of one token in one layer held by this TP rank (all regions together).
    pub bytes_per_token_per_layer: u64,
    /// Pages this side registered per layer and region; valid page indices are `0..pages`.
    pub pages: u32,
    /// KV heads held by this TP rank, 0 where heads do not apply (MLA).
    pub kv_heads: u32,
    /// How heads map across TP ranks.
    pub tp_mode: TpMode,
    /// KV heads of the whole model per layer (protocol version 6), for head-sliced TP: 0 where
    /// heads do not apply. With fewer heads than TP ranks, ranks hold replicas (see
    /// [`crate::core::topology`]).
    pub model_kv_heads: u32,
    /// Inside a page, one token's heads are contiguous (`[token][head][bytes]`, SGLang's and
    /// vLLM's order) rather than one head's tokens (protocol version 6).
    pub token_major: bool,
    /// Where heads lie head-major with K by columns inside a head's part (vLLM's CPU blocks,
    /// [`HeadOrder::KeyColumns`](crate::core::planner::HeadOrder::KeyColumns)): the bytes of one
    /// element of K; 0 otherwise (protocol version 12).
    pub key_column_bytes: u32,
}

/// Which transfer library a side uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum BackendKind {
    /// Direct UCP.
    Ucx,
    /// A NIXL agent.
    Nixl,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Ucx => "UCX",
            Self::Nixl => "NIXL",
        })
    }
}

/// One registered region as the peer must name it to write into it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Remote virtual (or device) address of the region's start.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Packed remote key (UCX `ucp_rkey_pack` output); empty for NIXL, whose metadata carries it.
    pub rkey: Vec<u8>,
}

/// What the peer needs to reach this side's memory.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BackendInfo {
    /// The library.
    pub kind: BackendKind,
    /// UCX worker address, or NIXL agent metadata.
    pub worker_or_agent: Vec<u8>,
    /// NIXL agent name; empty for UCX.
    pub agent_name: String,
    /// Registered regions, in the order the layout numbers them.
    pub regions: Vec<RemoteRegion>,
    /// A decode's landing memory (since version 14): registered host memory outside its pool that
    /// a [`TransferRequest::landing`] grant lends to a rank, whose rows the decode then copies into
    /// its pages. `None` from a prefill rank and from a decode without one.
    pub landing: Option<RemoteRegion>,
}

/// The first message after authentication, sent by both sides: everything the peer needs to talk
/// to this side, backend metadata included, so it travels only to a peer that proved the secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Protocol version the sender speaks ([`PROTOCOL_VERSION`]).
    pub protocol_version: u16,
    /// The sender's engine name, for logs and for telling peers apart.
    pub engine_id: String,
    /// Prefill or decode.
    pub role: Role,
    /// Pipeline-parallel rank: a prefill rank's place in its pipeline, or a decode side's own PP
    /// stage (0 of 1 unless decode is pipelined too).
    pub pp_rank: u16,
    /// Pipeline-parallel size (of the prefill pipeline, or of the decode's own stages).
    pub pp_size: u16,
    /// Tensor-parallel rank.
    pub tp_rank: u16,
    /// Tensor-parallel size.
    pub tp_size: u16,
    /// The sender's KV layout.
    pub layout: LayoutInfo,
    /// The sender's transfer library and its metadata.
    pub backend: BackendInfo,
    /// A random 64-bit key the prefill side carries with every UCX notification it sends, so the
    /// decode side can tell which connection (and so which PP rank) sent it. Zero when unused.
    pub notify_key: u64,
    /// Which start of the sender's engine this is: larger for a later start of the same rank
    /// (see [`crate::core::membership`]). A peer never admits an incarnation below the last one it
    /// admitted for that rank, so an older start cannot bind again.
    pub incarnation: u64,
    /// A prefill's Hello: the prefill instance (one PP pipeline) the sender belongs to, as the
    /// decode side named it when it added the instance (protocol version 6): one decode engine
    /// serves many instances, and every PP rank of one pipeline carries the same name; empty for
    /// the decode engine's default instance. A decode's Hello: the decode instance (server) the
    /// sending TP rank belongs to (protocol version 9), which its other TP ranks name alike;
    /// empty when it names none.
    pub instance: String,
    /// Milliseconds between the heartbeats the sender sends on this connection, 0 if it sends none
    /// (protocol version 8). The receiver declares the sender lost after
    /// [`SILENT_INTERVALS`](crate::engine::SILENT_INTERVALS) of the sender's own interval, so sides
    /// configured with different intervals never take each other for silent.
    pub heartbeat_ms: u32,
    /// What the sender's application tells every authenticated peer, opaque to the engine (at
    /// most [`MAX_APP_INFO`] bytes; protocol version 11): `kvbench`'s decode role puts its
    /// workload here, which its prefill roles read with a [`probe`](super::probe).
    pub app: Vec<u8>,
}

/// The most bytes a Hello's [`app`](Hello::app) may hold.
pub const MAX_APP_INFO: usize = 16 * 1024;

impl Hello {
    /// A Hello at this build's protocol version, rank 0 of 1 in PP and TP, without a token.
    pub fn new(
        engine_id: impl Into<String>,
        role: Role,
        layout: LayoutInfo,
        backend: BackendInfo,
    ) -> Self {
        Self {
            protocol_version: PROTOCOL_VERSION,
            engine_id: engine_id.into(),
            role,
            pp_rank: 0,
            pp_size: 1,
            tp_rank: 0,
            tp_size: 1,
            layout,
            backend,
            notify_key: 0,
            incarnation: 0,
            instance: String::new(),
            heartbeat_ms: 0,
            app: Vec::new(),
        }
    }

    /// Sets the interval of the heartbeats the sender sends (`None`: it sends none). Intervals
    /// round up to whole milliseconds.
    #[must_use]
    pub fn with_heartbeat(mut self, every: Option<std::time::Duration>) -> Self {
        self.heartbeat_ms = heartbeat_ms(every);
        self
    }

    /// The interval a Hello made [`with_heartbeat`](Self::with_heartbeat)`(every)` announces.
    pub fn announced_heartbeat(every: Option<std::time::Duration>) -> Option<std::time::Duration> {
        let ms = heartbeat_ms(every);
        (ms > 0).then(|| std::time::Duration::from_millis(u64::from(ms)))
    }

    /// The interval of the sender's heartbeats, `None` if it sends none.
    pub fn heartbeat(&self) -> Option<std::time::Duration> {
        (self.heartbeat_ms > 0)
            .then(|| std::time::Duration::from_millis(u64::from(self.heartbeat_ms)))
    }

    /// Sets what the sender's application tells its authenticated peers.
    #[must_use]
    pub fn with_app(mut self, app: Vec<u8>) -> Self {
        self.app = app;
        self
    }

    /// Sets the prefill instance the sender belongs to.
    #[must_use]
    pub fn with_instance(mut self, instance: impl Into<String>) -> Self {
        self.instance = instance.into();
        self
    }

    /// Sets the incarnation.
    #[must_use]
    pub fn with_incarnation(mut self, incarnation: u64) -> Self {
        self.incarnation = incarnation;
        self
    }

    /// Sets the PP rank and size.
    #[must_use]
    pub fn with_pp(mut self, rank: u16, size: u16) -> Self {
        self.pp_rank = rank;
        self.pp_size = size;
        self
    }

    /// Sets the TP rank and size.
    #[must_use]
    pub fn with_tp(mut self, rank: u16, size: u16) -> Self {
        self.tp_rank = rank;
        self.tp_size = size;
        self
    }
}

/// Acceptance of the peer's Hello.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloAck {
    /// The accepting side's engine id.
    pub engine_id: String,
}

/// Why a Hello was refused, explained for the operator who reads the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum RejectReason {
    /// The sides speak different protocol versions.
    #[error("protocol version mismatch: this side speaks {local}, the peer {remote}")]
    VersionMismatch {
        /// Version of the side that rejects.
        local: u16,
        /// Version the peer announced.
        remote: u16,
    },
    /// The roles cannot talk to each other (two decode servers).
    #[error("role mismatch: {0}")]
    RoleMismatch(String),
    /// The KV layouts cannot be mapped onto each other.
    #[error("KV layout mismatch: {0}")]
    LayoutMismatch(String),
    /// The pipeline-parallel configuration is inconsistent.
    #[error("pipeline-parallel mismatch: {0}")]
    PpMismatch(String),
    /// The tensor-parallel configuration is inconsistent.
    #[error("tensor-parallel mismatch: {0}")]
    TpMismatch(String),
    /// The sides use different transfer libraries.
    #[error("backend mismatch: this side uses {local}, the peer {remote}")]
    BackendMismatch {
        /// Backend of the side that rejects.
        local: BackendKind,
        /// Backend the peer announced.
        remote: BackendKind,
    },
    /// Another connection already holds this rank.
    #[error("duplicate rank: pp_rank {pp_rank} tp_rank {tp_rank} is already connected")]
    DuplicateRank {
        /// PP rank announced.
        pp_rank: u16,
        /// TP rank announced.
        tp_rank: u16,
    },
    /// Another connection is already bound to the notification sender this peer announced (its
    /// notify key or NIXL agent name); a second binding would let one peer's notifications count
    /// for another's rank.
    #[error("duplicate sender: {0} is already bound to a connected rank")]
    DuplicateSender(String),
    /// The rank announced an incarnation below the last one this side admitted for it: an older
    /// start of the rank.
    #[error(
        "stale incarnation: pp_rank {pp_rank} announced incarnation {got}, this side already admitted the later {last}"
    )]
    StaleIncarnation {
        /// PP rank announced.
        pp_rank: u16,
        /// Incarnation announced.
        got: u64,
        /// Last incarnation admitted for the rank.
        last: u64,
    },
    /// The peer did not prove that it holds this side's shared secret (a wrong secret, or one side
    /// has a secret and the other none).
    #[error("authentication failed: the peer does not hold this side's shared secret")]
    AuthFailed,
    /// The Hello contradicts itself (a rank not below its size, layers past the model's end).
    #[error("invalid hello: {0}")]
    InvalidHello(String),
    /// The peer sent something other than the handshake expects.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// Refused by the application for its own reason.
    #[error("refused: {0}")]
    Refused(String),
    /// The decode side serves no prefill instance of that name (yet: an instance found through
    /// discovery is added when its records appear, so a rank tries again until its deadline).
    /// Protocol version 6.
    #[error("this decode serves no prefill instance {0:?}")]
    UnknownInstance(String),
}

/// Refusal of the peer's Hello.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reject {
    /// Why.
    pub reason: RejectReason,
}

/// Decode asks one prefill rank to write a request's KV into these pages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferRequest {
    /// Request id (SGLang's bootstrap room).
    pub request: u64,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Prefill chunk size in tokens.
    pub chunk_tokens: u32,
    /// Destination page indices on the decode side, in token order.
    pub dst_pages: Vec<u32>,
    /// Tokens at the start of the prompt that decode already holds (a prefix cache of its own):
    /// the request moves the `prompt_tokens` tokens after them. Whole pages.
    pub prefix_tokens: u32,
    /// Milliseconds, from receipt, within which the transfer must finish.
    pub deadline_ms: u32,
    /// Where the rank must write instead of the pages (since version 14): a range of the decode's
    /// landing memory, which the decode copies into the pages as each chunk's notification comes.
    /// Each rank gets its own.
    pub landing: Option<Landing>,
}

/// A grant of decode's landing memory ([`BackendInfo::landing`]) to one rank for one request:
/// `slots` ranges of `chunk_stride` bytes from `offset`. Chunk `c`'s writes go, packed one after
/// another in the order the planner gives them, to `offset + (c % slots) * chunk_stride`; no
/// chunk's writes may take more than `chunk_stride` bytes. Where `slots` is below the request's
/// chunk count the ranges are reused: the rank posts chunk `c >= slots` only once decode said
/// ([`Msg::Landed`]) that it copied chunk `c - slots` out of that range (since version 15).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Landing {
    /// Offset in the landing memory of the first range's first byte.
    pub offset: u64,
    /// Bytes from one range to the next.
    pub chunk_stride: u64,
    /// How many ranges (at least 1).
    pub slots: u32,
}

/// Decode copied a chunk out of the landing range it was written into ([`Landing`]): the rank
/// may write the chunk that reuses that range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Landed {
    /// Request id.
    pub request: u64,
    /// The chunk copied.
    pub chunk: u32,
}

/// Why a transfer request was refused. Only that request is affected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum TransferRejectReason {
    /// A destination page index is not below the number of registered pages.
    #[error("page {page} at position {position} is outside the {registered} registered pages")]
    PageOutOfRange {
        /// Position in `dst_pages`.
        position: u32,
        /// The page index.
        page: u32,
        /// Pages registered.
        registered: u32,
    },
    /// The request lists a different number of pages than its prompt needs.
    #[error("request lists {got} pages, its prompt needs {expected}")]
    PageCountMismatch {
        /// Pages the prompt needs.
        expected: u64,
        /// Pages listed.
        got: u64,
    },
    /// The same destination page appears twice.
    #[error("page {page} is listed twice")]
    DuplicatePage {
        /// The page index.
        page: u32,
    },
    /// The request id is not known to the receiver.
    #[error("unknown request {request}")]
    UnknownRequest {
        /// Request id.
        request: u64,
    },
    /// The request id is already in flight.
    #[error("request {request} is already in flight")]
    DuplicateRequest {
        /// Request id.
        request: u64,
    },
    /// A field holds a value that cannot be right.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The request grants landing memory the decode did not announce, or a range outside it
    /// (since version 14).
    #[error(
        "the request's landing range is outside the landing memory announced ({announced} bytes)"
    )]
    LandingOutOfRange {
        /// Bytes of landing memory the decode announced (0 for none).
        announced: u64,
    },
}

/// Refusal of one transfer request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferReject {
    /// Request id.
    pub request: u64,
    /// Why.
    pub reason: TransferRejectReason,
}

/// Abandon one request on every side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Abort {
    /// Request id.
    pub request: u64,
    /// Why, as a failure code the core interprets (unknown codes are kept, not refused).
    pub reason: u16,
}

/// A prefill rank's answer to an [`Abort`]: none of its writes into the request's pages is still
/// running, and none will be posted. Only then may the decode side reuse the pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortAck {
    /// Request id.
    pub request: u64,
}

/// Most bytes of one [`AuxData`] message.
pub const MAX_AUX_LEN: usize = 64 << 10;

/// A prefill rank's small per-request payload beside the KV pages (for an SGLang server: the
/// metadata row with the first output token and its logprobs), sent before its last chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuxData {
    /// Request id.
    pub request: u64,
    /// The bytes, at most [`MAX_AUX_LEN`].
    pub data: Vec<u8>,
}

/// One PP rank's vote record, opaque here: the core encodes and checks it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vote {
    /// The encoded vote.
    pub bytes: Vec<u8>,
}

/// Any control message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Msg {
    /// Opening of the handshake.
    Hello(Hello),
    /// The peer's Hello was accepted.
    HelloAck(HelloAck),
    /// The peer's Hello was refused.
    Reject(Reject),
    /// Decode asks a prefill rank for a request's KV.
    TransferRequest(TransferRequest),
    /// A transfer request was refused.
    TransferReject(TransferReject),
    /// A request is abandoned.
    Abort(Abort),
    /// A PP vote record.
    Vote(Vote),
    /// The sender will send nothing more.
    Close,
    /// A prefill rank's writes for an aborted request are over.
    AbortAck(AbortAck),
    /// Opening of the authentication: a nonce and a role.
    Challenge(super::auth::Challenge),
    /// Proof of the shared secret over both challenges.
    Proof(super::auth::Proof),
    /// A prefill rank's per-request payload beside the KV pages.
    Aux(AuxData),
    /// A prefill rank's vote mesh is formed (every PP peer connected): decode asks it for requests
    /// only from then on, so no PP peer's board starts a request without it.
    Ready,
    /// The sender is alive; sent every heartbeat interval on every control connection, so that a
    /// peer that goes silent (its host gone, its link half-open) is declared lost within a bound.
    Heartbeat,
    /// A prefill rank's vote mesh lost a link: decode asks it for no new request until its next
    /// `Ready` (the mesh formed again), so no request starts on a board that cannot decide it.
    NotReady,
    /// Sent by an authenticated dialer in place of its Hello: it only wanted the listener's Hello
    /// (its [`app`](Hello::app) above all), and both sides close ([`probe`](super::probe)).
    Probe,
    /// Decode copied a chunk out of a reused landing range (see [`Landing`]).
    Landed(Landed),
}

impl Msg {
    /// The frame kind that carries this message.
    pub fn kind(&self) -> MsgKind {
        match self {
            Self::Hello(_) => MsgKind::Hello,
            Self::HelloAck(_) => MsgKind::HelloAck,
            Self::Reject(_) => MsgKind::Reject,
            Self::TransferRequest(_) => MsgKind::TransferRequest,
            Self::TransferReject(_) => MsgKind::TransferReject,
            Self::Abort(_) => MsgKind::Abort,
            Self::AbortAck(_) => MsgKind::AbortAck,
            Self::Vote(_) => MsgKind::Vote,
            Self::Close => MsgKind::Close,
            Self::Challenge(_) => MsgKind::Challenge,
            Self::Proof(_) => MsgKind::Proof,
            Self::Aux(_) => MsgKind::Aux,
            Self::Ready => MsgKind::Ready,
            Self::Heartbeat => MsgKind::Heartbeat,
            Self::NotReady => MsgKind::NotReady,
            Self::Probe => MsgKind::Probe,
            Self::Landed(_) => MsgKind::Landed,
        }
    }
}

fn layer_range(l: &LayoutInfo) -> std::ops::Range<u64> {
    let first = u64::from(l.first_layer);
    first..first + u64::from(l.layers)
}

/// Checks that a Hello does not contradict itself.
pub(crate) fn check_self_consistent(h: &Hello) -> Result<(), RejectReason> {
    let bad = |s: String| Err(RejectReason::InvalidHello(s));
    if h.app.len() > MAX_APP_INFO {
        return bad(format!(
            "its application's part is {} bytes, more than {MAX_APP_INFO}",
            h.app.len()
        ));
    }
    if h.pp_size == 0 || h.pp_rank >= h.pp_size {
        return bad(format!(
            "pp_rank {} is not below pp_size {}",
            h.pp_rank, h.pp_size
        ));
    }
    if h.tp_size == 0 || h.tp_rank >= h.tp_size {
        return bad(format!(
            "tp_rank {} is not below tp_size {}",
            h.tp_rank, h.tp_size
        ));
    }
    let l = &h.layout;
    if l.layers == 0 || layer_range(l).end > u64::from(l.num_layers) {
        return bad(format!(
            "holds layers {}..{} of a {}-layer model",
            l.first_layer,
            layer_range(l).end,
            l.num_layers
        ));
    }
    if !(1..=2).contains(&l.kv_regions) {
        return bad(format!(
            "kv_regions is {}, must be 1 (fused) or 2 (split K, V)",
            l.kv_regions
        ));
    }
    if l.page_tokens == 0 || l.bytes_per_token_per_layer == 0 {
        return bad(format!(
            "page_tokens {} and bytes_per_token_per_layer {} must both be positive",
            l.page_tokens, l.bytes_per_token_per_layer
        ));
    }
    if l.key_column_bytes != 0
        && (l.kv_heads == 0
            || l.token_major
            || !l
                .bytes_per_token_per_layer
                .is_multiple_of(u64::from(l.kv_heads))
            || !(l.bytes_per_token_per_layer / u64::from(l.kv_heads))
                .is_multiple_of(2 * u64::from(l.key_column_bytes)))
    {
        return bad(format!(
            "K by columns of {} bytes needs head-major heads of whole K and V elements ({} heads, {} bytes per token)",
            l.key_column_bytes, l.kv_heads, l.bytes_per_token_per_layer
        ));
    }
    Ok(())
}

/// Checks that the TP layouts of a prefill and a decode side map onto each other.
fn check_tp(local: &Hello, remote: &Hello) -> Result<(), RejectReason> {
    let (l, r) = (&local.layout, &remote.layout);
    if l.key_column_bytes != r.key_column_bytes {
        return Err(RejectReason::LayoutMismatch(format!(
            "K lies by columns of {} bytes inside a head's part on this side, of {} at the peer (0: not by columns)",
            l.key_column_bytes, r.key_column_bytes
        )));
    }
    if l.tp_mode != r.tp_mode {
        return Err(RejectReason::TpMismatch(format!(
            "this side maps TP as {:?}, the peer as {:?}",
            l.tp_mode, r.tp_mode
        )));
    }
    match l.tp_mode {
        TpMode::Identical | TpMode::Replicated => {
            if l.tp_mode == TpMode::Identical && local.tp_size != remote.tp_size {
                return Err(RejectReason::TpMismatch(format!(
                    "identical TP mapping needs equal TP sizes, this side has {}, the peer {}",
                    local.tp_size, remote.tp_size
                )));
            }
            if l.bytes_per_token_per_layer != r.bytes_per_token_per_layer {
                return Err(RejectReason::LayoutMismatch(format!(
                    "this side stores {} bytes per token per layer, the peer {}",
                    l.bytes_per_token_per_layer, r.bytes_per_token_per_layer
                )));
            }
        }
        TpMode::HeadSliced => {
            if l.model_kv_heads == 0 || l.model_kv_heads != r.model_kv_heads {
                return Err(RejectReason::LayoutMismatch(format!(
                    "head-sliced TP needs the same model KV head count on both sides: this side {}, the peer {}",
                    l.model_kv_heads, r.model_kv_heads
                )));
            }
            for (side, hello) in [("this side", local), ("the peer", remote)] {
                let shape = crate::core::topology::TpShape {
                    tp_size: u32::from(hello.tp_size),
                    kv_heads: hello.layout.model_kv_heads,
                };
                shape
                    .validate()
                    .map_err(|e| RejectReason::TpMismatch(format!("{side}: {e}")))?;
                let held = shape.heads_of(0).len() as u32;
                if hello.layout.kv_heads != held
                    || hello.layout.bytes_per_token_per_layer % u64::from(held.max(1)) != 0
                {
                    return Err(RejectReason::LayoutMismatch(format!(
                        "{side} holds {} KV heads of {} bytes per token; at TP {} of a {}-head model a rank holds {held}",
                        hello.layout.kv_heads,
                        hello.layout.bytes_per_token_per_layer,
                        hello.tp_size,
                        hello.layout.model_kv_heads
                    )));
                }
            }
            let (lh, rh) = (
                l.bytes_per_token_per_layer / u64::from(l.kv_heads),
                r.bytes_per_token_per_layer / u64::from(r.kv_heads),
            );
            if lh != rh {
                return Err(RejectReason::LayoutMismatch(format!(
                    "a KV head holds {lh} bytes per token on this side, {rh} at the peer"
                )));
            }
            if l.token_major != r.token_major {
                return Err(RejectReason::LayoutMismatch(
                    "the sides order heads and tokens differently inside a page".into(),
                ));
            }
        }
    }
    Ok(())
}

/// Decides whether this side (`local`) may talk to the peer that sent `remote`.
///
/// Rules, in the order checked (the first failure is returned):
/// 1. same protocol version;
/// 2. the remote Hello is self-consistent (ranks below sizes, layers inside the model,
///    1 or 2 KV regions, positive page size);
/// 3. roles: prefill with decode, or two prefill ranks of one pipeline (same `pp_size` and
///    `tp_size`, different ranks, disjoint layers); two decode sides never;
/// 4. same model layer count and number of KV regions, and between PP peers the same page size
///    (prefill and decode pages may differ in size: the planner maps runs of tokens); same
///    backend;
/// 5. prefill to decode: the prefill rank's layers lie within the decode side's; a decode of
///    several PP stages takes only the prefill PP rank of its own stage, from a pipeline of as many
///    stages; and the TP layouts map (see [`TpMode`]).
///
/// # Errors
/// The [`RejectReason`] for the first rule broken, with the numbers in words.
pub fn check_hello(local: &Hello, remote: &Hello) -> Result<(), RejectReason> {
    if local.protocol_version != remote.protocol_version {
        return Err(RejectReason::VersionMismatch {
            local: local.protocol_version,
            remote: remote.protocol_version,
        });
    }
    check_self_consistent(remote)?;
    let (l, r) = (&local.layout, &remote.layout);
    let pp_peers = match (local.role, remote.role) {
        (Role::Decode, Role::Decode) => {
            return Err(RejectReason::RoleMismatch(
                "both sides are decode; decode talks only to prefill".to_owned(),
            ));
        }
        (Role::Prefill, Role::Prefill) => true,
        _ => false,
    };
    if l.num_layers != r.num_layers {
        return Err(RejectReason::LayoutMismatch(format!(
            "this side's model has {} layers, the peer's {}",
            l.num_layers, r.num_layers
        )));
    }
    // Prefill and decode pages may differ in size (the planner maps runs of tokens); the ranks
    // of one pipeline share theirs.
    if pp_peers && l.page_tokens != r.page_tokens {
        return Err(RejectReason::LayoutMismatch(format!(
            "this side's pages hold {} tokens, the peer's {}",
            l.page_tokens, r.page_tokens
        )));
    }
    if l.kv_regions != r.kv_regions {
        return Err(RejectReason::LayoutMismatch(format!(
            "this side has {} KV regions per layer, the peer {} (fused vs split K,V)",
            l.kv_regions, r.kv_regions
        )));
    }
    if local.backend.kind != remote.backend.kind {
        return Err(RejectReason::BackendMismatch {
            local: local.backend.kind,
            remote: remote.backend.kind,
        });
    }
    if pp_peers {
        if local.instance != remote.instance {
            return Err(RejectReason::PpMismatch(format!(
                "this prefill rank is in instance {:?}, the peer in {:?}",
                local.instance, remote.instance
            )));
        }
        if local.pp_size != remote.pp_size {
            return Err(RejectReason::PpMismatch(format!(
                "this prefill rank is in a pipeline of {} ranks, the peer in one of {}",
                local.pp_size, remote.pp_size
            )));
        }
        if local.tp_size != remote.tp_size {
            return Err(RejectReason::TpMismatch(format!(
                "prefill ranks of one pipeline disagree on TP size: {} here, {} at the peer",
                local.tp_size, remote.tp_size
            )));
        }
        if local.pp_rank == remote.pp_rank && local.tp_rank == remote.tp_rank {
            return Err(RejectReason::DuplicateRank {
                pp_rank: remote.pp_rank,
                tp_rank: remote.tp_rank,
            });
        }
        let (lr, rr) = (layer_range(l), layer_range(r));
        if local.pp_rank != remote.pp_rank && lr.start < rr.end && rr.start < lr.end {
            return Err(RejectReason::PpMismatch(format!(
                "PP rank {} holds layers {}..{} and PP rank {} holds {}..{}: they overlap",
                local.pp_rank, lr.start, lr.end, remote.pp_rank, rr.start, rr.end
            )));
        }
        if local.pp_rank == remote.pp_rank && lr != rr {
            return Err(RejectReason::PpMismatch(format!(
                "TP ranks of PP rank {} disagree on its layers: {}..{} here, {}..{} at the peer",
                local.pp_rank, lr.start, lr.end, rr.start, rr.end
            )));
        }
        if l.bytes_per_token_per_layer != r.bytes_per_token_per_layer {
            return Err(RejectReason::LayoutMismatch(format!(
                "prefill ranks disagree on bytes per token per layer: {} here, {} at the peer",
                l.bytes_per_token_per_layer, r.bytes_per_token_per_layer
            )));
        }
        return Ok(());
    }
    let (prefill, decode) = if local.role == Role::Prefill {
        (local, remote)
    } else {
        (remote, local)
    };
    if decode.pp_size > 1 && (decode.pp_size, decode.pp_rank) != (prefill.pp_size, prefill.pp_rank)
    {
        return Err(RejectReason::PpMismatch(format!(
            "decode is PP stage {} of {} and takes only the prefill PP rank of its stage from a \
             pipeline of as many; this prefill rank is PP rank {} of {}",
            decode.pp_rank, decode.pp_size, prefill.pp_rank, prefill.pp_size
        )));
    }
    let (pr, dr) = (layer_range(&prefill.layout), layer_range(&decode.layout));
    if pr.start < dr.start || pr.end > dr.end {
        return Err(RejectReason::LayoutMismatch(format!(
            "prefill PP rank {} holds layers {}..{}, outside the decode side's {}..{}",
            prefill.pp_rank, pr.start, pr.end, dr.start, dr.end
        )));
    }
    check_tp(local, remote)
}

/// Bounds-checks a transfer request against what this side registered.
///
/// `registered_pages` is the number of pages this side registered (valid indices are below it);
/// `expected_pages` is how many pages the request's prompt needs, as the receiver computes it.
/// Nothing outside the request is read or changed, so a bad request affects only itself.
///
/// # Errors
/// [`TransferRejectReason::Invalid`] for a zero prompt or chunk size,
/// [`TransferRejectReason::PageCountMismatch`], [`TransferRejectReason::PageOutOfRange`] (the
/// first offending position) or [`TransferRejectReason::DuplicatePage`].
pub fn validate_transfer_request(
    req: &TransferRequest,
    registered_pages: u32,
    expected_pages: usize,
) -> Result<(), TransferRejectReason> {
    // Nothing to move is a request only after a prefix decode holds (its metadata still moves).
    if (req.prompt_tokens == 0 && req.prefix_tokens == 0) || req.chunk_tokens == 0 {
        return Err(TransferRejectReason::Invalid(format!(
            "prompt_tokens {} (after a prefix of {}) and chunk_tokens {} must be positive",
            req.prompt_tokens, req.prefix_tokens, req.chunk_tokens
        )));
    }
    if req.prefix_tokens.checked_add(req.prompt_tokens).is_none() {
        return Err(TransferRejectReason::Invalid(format!(
            "a prefix of {} tokens and {} more do not fit a u32",
            req.prefix_tokens, req.prompt_tokens
        )));
    }
    if req.dst_pages.len() != expected_pages {
        return Err(TransferRejectReason::PageCountMismatch {
            expected: expected_pages as u64,
            got: req.dst_pages.len() as u64,
        });
    }
    if let Some((position, &page)) = req
        .dst_pages
        .iter()
        .enumerate()
        .find(|&(_, &p)| p >= registered_pages)
    {
        return Err(TransferRejectReason::PageOutOfRange {
            // The list fits a frame, so its length fits u32; saturate rather than trust that.
            position: u32::try_from(position).unwrap_or(u32::MAX),
            page,
            registered: registered_pages,
        });
    }
    // Sorting a copy costs O(n log n) in the request's own size, never in the registered size.
    let mut sorted = req.dst_pages.clone();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(TransferRejectReason::DuplicatePage { page: w[0] });
    }
    Ok(())
}

/// Checks that a transfer request's decode-side prefix is whole pages of `page_tokens` tokens, so
/// the moved tokens start on a page boundary on both sides.
///
/// # Errors
/// [`TransferRejectReason::Invalid`] naming the prefix and the page size.
pub fn validate_prefix(
    req: &TransferRequest,
    page_tokens: u32,
) -> Result<(), TransferRejectReason> {
    if page_tokens == 0 || !req.prefix_tokens.is_multiple_of(page_tokens) {
        return Err(TransferRejectReason::Invalid(format!(
            "a decode-side prefix of {} tokens is not whole pages of {page_tokens} tokens",
            req.prefix_tokens
        )));
    }
    Ok(())
}

/// Checks a transfer request's landing grant against the landing memory the decode announced
/// (`announced`, its length; `None` for none): every range the request's `chunks` use lies inside
/// it. A request without a grant passes.
///
/// # Errors
/// [`TransferRejectReason::LandingOutOfRange`]; [`TransferRejectReason::Invalid`] for a stride or
/// a slot count of 0.
pub fn validate_landing(
    req: &TransferRequest,
    announced: Option<u64>,
    chunks: u64,
) -> Result<(), TransferRejectReason> {
    let Some(g) = req.landing else {
        return Ok(());
    };
    if g.chunk_stride == 0 || g.slots == 0 {
        return Err(TransferRejectReason::Invalid(
            "a landing grant's chunk stride or slot count is 0".into(),
        ));
    }
    let end = g
        .chunk_stride
        .checked_mul(chunks.min(u64::from(g.slots)))
        .and_then(|b| b.checked_add(g.offset));
    match (announced, end) {
        (Some(len), Some(end)) if end <= len => Ok(()),
        _ => Err(TransferRejectReason::LandingOutOfRange {
            announced: announced.unwrap_or(0),
        }),
    }
}
