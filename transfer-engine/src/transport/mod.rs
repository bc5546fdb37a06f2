//! One transport trait, two backends: direct UCX ([`ucx`]) and NIXL (`nixl`).
//!
//! A transport registers memory, exports what a peer needs to write into it, connects to peers, posts a
//! chunk's writes followed by its notification, and hands received notifications and peer failures to a
//! [`Sink`]. The notification of a chunk is sent only after the chunk's writes are remotely complete, so
//! a receiver that sees the notification can read the bytes.

use crate::mem::MemDesc;
use std::sync::Arc;

pub mod fault;
pub mod nixl;
mod progress;
pub mod ucx;

/// Which library moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendKind {
    /// UCX `ucp_put` and active messages.
    Ucx,
    /// A NIXL agent with its UCX plugin.
    Nixl,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::Ucx => "ucx",
            BackendKind::Nixl => "nixl",
        })
    }
}

/// A local registration, named by the transport that made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u64);

/// A connected peer, named by the local transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

/// What a peer needs to write into one of our registrations: plain data that travels in a Hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Packed remote key (UCX) or empty (NIXL, whose metadata carries registrations).
    pub rkey: Vec<u8>,
}

/// One write of a chunk: `len` bytes from a local registration to a peer's remote region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteOp {
    /// Source registration.
    pub local: RegionId,
    /// Offset in the source registration.
    pub local_offset: u64,
    /// Index of the destination region in the list given to [`Transport::connect`].
    pub remote: u32,
    /// Offset in the destination region.
    pub remote_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Who sent a notification, as the transport can tell.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Sender {
    /// The 64-bit key the receiver gave the sender at handshake, carried with every notification.
    Key(u64),
    /// A NIXL agent name (NIXL tells the receiver who sent a notification).
    Agent(String),
}

/// What a transport reports to its owner, from its progress thread.
#[derive(Debug)]
#[non_exhaustive]
pub enum Incoming<'a> {
    /// A chunk notification arrived. Its writes are already in place.
    Notification {
        /// Who sent it.
        sender: Sender,
        /// The notification record, undecoded.
        bytes: &'a [u8],
    },
    /// A connected peer failed (its process died, its network went away).
    PeerFailed {
        /// The peer.
        peer: PeerId,
        /// The transport's reason.
        reason: String,
    },
}

/// Receives [`Incoming`] events on the transport's progress thread; must not block.
pub type Sink = Arc<dyn Fn(Incoming<'_>) + Send + Sync>;

/// Called once when a posted chunk is over: its writes and its notification are complete, or failed.
pub type Done = Box<dyn FnOnce(Result<(), TransportError>) + Send>;

/// Counters a transport keeps, for tests that check resources return to their baseline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransportStats {
    /// Live registrations.
    pub regions: u64,
    /// Bytes registered.
    pub registered_bytes: u64,
    /// Live peers.
    pub peers: u64,
    /// Posted chunks not yet over.
    pub in_flight: u64,
    /// Deregistrations waiting for writes to finish.
    pub deferred_deregistrations: u64,
    /// Notifications received.
    pub notifications: u64,
    /// Bytes posted.
    pub bytes_posted: u64,
}

/// A transport error, keeping the library's raw status where there is one.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportError {
    /// The library returned an error status.
    #[error("{op}: {message} (status {code})")]
    Library {
        /// The failing call.
        op: &'static str,
        /// The library's raw status code.
        code: i64,
        /// The library's description of it.
        message: String,
    },
    /// The process holds two different UCX libraries, which would hang or corrupt UCX's state.
    #[error(
        "two different UCX libraries are loaded in this process: {0:?}; link ucx-sys against the UCX NIXL's plugin uses (scripts/provision does)"
    )]
    TwoUcxLibraries(Vec<String>),
    /// A write addresses outside its registration or the peer's region.
    #[error("write out of bounds: {0}")]
    OutOfBounds(String),
    /// No such registration.
    #[error("unknown region {0:?}")]
    UnknownRegion(RegionId),
    /// No such peer, or it was disconnected.
    #[error("unknown peer {0:?}")]
    UnknownPeer(PeerId),
    /// The peer failed before the chunk was over.
    #[error("peer {peer:?} failed: {reason}")]
    PeerFailed {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
    /// Bad metadata from a peer.
    #[error("bad peer metadata: {0}")]
    BadMetadata(String),
    /// The transport's progress thread has stopped.
    #[error("transport is shut down")]
    Shutdown,
    /// A fault injected by a test wrapper.
    #[error("injected fault: {0}")]
    Injected(String),
}

/// The operations every backend offers. All methods may be called from any thread.
pub trait Transport: Send + Sync + 'static {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;

    /// What a peer needs to connect to us: the UCX worker address, or the NIXL agent's metadata.
    ///
    /// # Errors
    /// When the library cannot produce it.
    fn metadata(&self) -> Result<Vec<u8>, TransportError>;

    /// A name peers can use for us (NIXL agent name; empty for UCX).
    fn name(&self) -> String;

    /// Registers memory; returns its id and what a peer needs to write into it.
    ///
    /// # Errors
    /// The library's error.
    fn register(&self, mem: MemDesc) -> Result<(RegionId, RemoteRegion), TransportError>;

    /// Deregisters memory. While posted writes still reference it, the deregistration is deferred
    /// until they are over; the memory must stay valid until [`TransportStats::deferred_deregistrations`]
    /// no longer counts it (the engine owns buffers inside registrations to make that automatic).
    ///
    /// # Errors
    /// Unknown region.
    fn deregister(&self, id: RegionId) -> Result<(), TransportError>;

    /// Connects to a peer from its metadata; `regions` are the peer's registrations we will write to.
    /// `key` is carried with every notification we send to this peer (see [`Sender::Key`]).
    ///
    /// # Errors
    /// Bad metadata or a library error.
    fn connect(
        &self,
        metadata: &[u8],
        regions: &[RemoteRegion],
        key: u64,
    ) -> Result<PeerId, TransportError>;

    /// Forgets a peer; posted chunks to it fail if not over.
    fn disconnect(&self, peer: PeerId);

    /// Posts a chunk: every write, then, once they are remotely complete, `notification`. `done` runs
    /// once, on the progress thread, when that is over or failed. Registrations named by `writes` are
    /// kept (deregistration deferred) until then.
    fn post(&self, peer: PeerId, writes: Vec<WriteOp>, notification: Vec<u8>, done: Done);

    /// Counters.
    fn stats(&self) -> TransportStats;

    /// Tells the transport whether its owner expects traffic soon (a receiver with requests in
    /// flight). An active transport keeps polling instead of sleeping when idle, so a notification is
    /// seen within microseconds instead of within its idle back-off; it yields the core between
    /// polls. The default ignores the hint.
    fn set_active(&self, _active: bool) {}
}
