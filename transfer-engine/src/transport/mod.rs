//! One transport trait, two backends: direct UCX ([`ucx`]) and NIXL (`nixl`).
//!
//! A transport registers memory, exports what a peer needs to write into it, connects to peers, posts a
//! chunk's writes followed by its notification, and hands received notifications and peer failures to a
//! [`Sink`]. The notification of a chunk is sent only after the chunk's writes are remotely complete, so
//! a receiver that sees the notification can read the bytes.

use crate::mem::{CopyError, HostBuffer, HostOptions, MemDesc, Pool, TransportMem};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub mod fault;
pub mod nixl;
mod progress;
pub mod ucx;
pub use progress::ProgressScheduling;

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

/// One write of a chunk: `rows` pieces of `len` bytes from a local registration to a peer's
/// remote region, the `i`-th from `local_offset + i * local_stride` to
/// `remote_offset + i * remote_stride`. A plain write has one row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteOp {
    /// Source registration.
    pub local: RegionId,
    /// Offset in the source registration of the first row.
    pub local_offset: u64,
    /// Index of the destination region in the list given to [`Transport::connect`].
    pub remote: u32,
    /// Offset in the destination region of the first row.
    pub remote_offset: u64,
    /// Bytes of one row.
    pub len: u64,
    /// Rows (1 for a plain write; 0 moves nothing).
    pub rows: u64,
    /// Bytes from one row to the next in the source.
    pub local_stride: u64,
    /// Bytes from one row to the next in the destination.
    pub remote_stride: u64,
}

impl WriteOp {
    /// A plain write of `len` bytes.
    pub const fn new(
        local: RegionId,
        local_offset: u64,
        remote: u32,
        remote_offset: u64,
        len: u64,
    ) -> Self {
        Self {
            local,
            local_offset,
            remote,
            remote_offset,
            len,
            rows: 1,
            local_stride: 0,
            remote_stride: 0,
        }
    }

    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.rows)
    }

    /// Whether the write fits a source of `local_len` bytes and a destination of `remote_len`
    /// bytes, with rows that do not overlap on either side (no arithmetic overflows).
    pub fn fits(&self, local_len: u64, remote_len: u64) -> bool {
        let end = |off: u64, stride: u64, len: u64| {
            if self.rows == 0 || self.len == 0 {
                return Some(off);
            }
            if self.rows > 1 && stride < self.len {
                return None;
            }
            (self.rows - 1)
                .checked_mul(stride)
                .and_then(|o| o.checked_add(off))
                .and_then(|o| o.checked_add(self.len))
                .filter(|&e| e <= len)
        };
        end(self.local_offset, self.local_stride, local_len).is_some()
            && end(self.remote_offset, self.remote_stride, remote_len).is_some()
    }

    /// The rows as `(local offset, remote offset)`, each `len` bytes long, in order. Only for a
    /// write that [`fits`](Self::fits) (its offsets do not overflow).
    pub fn pieces(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.rows).map(|i| {
            (
                self.local_offset + i * self.local_stride,
                self.remote_offset + i * self.remote_stride,
            )
        })
    }
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

/// One post of [`Transport::post_many`]: what [`Transport::post`] takes.
pub struct Post {
    /// The peer written to.
    pub peer: PeerId,
    /// The writes.
    pub writes: Vec<WriteOp>,
    /// The notification that follows them (none when empty).
    pub notification: Vec<u8>,
    /// Called once when the post is over.
    pub done: Done,
}

impl std::fmt::Debug for Post {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Post")
            .field("peer", &self.peer)
            .field("writes", &self.writes.len())
            .field("notification", &self.notification.len())
            .finish_non_exhaustive()
    }
}

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
    /// Library handles (endpoints, remote keys, memory handles, worker, context) left allocated at
    /// shutdown because operations that might use them had not finished within the bound.
    pub leaked_handles: u64,
    /// Peer regions this transport writes with its own CPU copies because the library mapped them
    /// into this process (UCX's `direct_copy`); the rest are written by the library's puts.
    pub direct_regions: u64,
    /// CPU nanoseconds (the thread's own clock) the progress thread spent making those copies
    /// itself: the CPU a sender's chunks cost in moving bytes, against what the rest of the engine
    /// costs. 0 where the library moves every byte.
    pub copy_nanos: u64,
    /// Bytes the progress thread copied into staging memory so that a write of strided rows
    /// went as one descriptor (NIXL's [`staging_bytes`](nixl::NixlConfig::staging_bytes)); 0
    /// elsewhere.
    pub staged_bytes: u64,
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
    /// The progress thread could not have the scheduling its config asks for; nothing started.
    #[error("cannot schedule the progress thread as {asked:?}: {message}")]
    Scheduling {
        /// What the config asked for.
        asked: ProgressScheduling,
        /// Why the system refused it.
        message: String,
    },
    /// Bad metadata from a peer.
    #[error("bad peer metadata: {0}")]
    BadMetadata(String),
    /// The pages of a pool the transport allocated cannot be had: no memory, or the shared-memory
    /// mount it lives on has no room for it (a write would raise SIGBUS). Nothing was registered.
    #[error("cannot populate a pool of {bytes} bytes: {message} (errno {code})")]
    Populate {
        /// The pool's length.
        bytes: u64,
        /// The operating system's error number.
        code: i32,
        /// Its description.
        message: String,
    },
    /// The transport's progress thread has stopped.
    #[error("transport is shut down")]
    Shutdown,
    /// The registration was handed to a peer that may still write into it, so its memory cannot be
    /// handed back (see [`Registration::assume_quiesced`]).
    #[error("a peer that was given this registration may still write into it")]
    MayBeWritten,
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

    /// Registers memory; returns its id and what a peer needs to write into it. [`Registration`] is
    /// the safe way to call it.
    ///
    /// # Safety
    /// `mem` must stay live memory of its kind, not freed, unmapped or reused, until
    /// [`deregister`](Self::deregister) of the returned id has returned `Ok`, and after that for as
    /// long as any peer that was given the returned [`RemoteRegion`] may still write into it (a peer
    /// that holds an address can write into a mapping that is still there even after
    /// deregistration, on shared-memory and cma transports). No Rust reference may cover the memory
    /// while a peer may write into it.
    ///
    /// # Errors
    /// The library's error.
    unsafe fn register(&self, mem: MemDesc) -> Result<(RegionId, RemoteRegion), TransportError>;

    /// Allocates `len` bytes of host memory that the transport owns, and registers it. Where the
    /// backend can, the memory is shareable: same-host peers map it and write into it with
    /// user-space copies rather than a system call per write. `Ok(None)` where the backend cannot
    /// allocate; the caller then brings its own memory. [`Registration::new`] with [`Pool::Shared`]
    /// is the way to use it: the memory lives until the registration is deregistered (which frees
    /// it) or abandoned.
    ///
    /// # Errors
    /// The library's error.
    fn allocate(
        &self,
        _len: u64,
    ) -> Result<Option<(RegionId, RemoteRegion, MemDesc)>, TransportError> {
        Ok(None)
    }

    /// Gives up a registration for good while a peer may still write into it: it is never
    /// deregistered, not even at shutdown, so memory the transport allocated is never freed. The
    /// default does nothing (a registration the caller leaks is never deregistered either).
    fn abandon(&self, _id: RegionId) {}

    /// Deregisters memory; for memory the transport allocated ([`allocate`](Self::allocate)) that
    /// frees it. While posted writes still reference it, the call waits (bounded by the transport's
    /// call bound) until they are over, counted in [`TransportStats::deferred_deregistrations`]
    /// meanwhile; past the bound it returns an error and the deregistration stays pending.
    /// [`Registration`] is the safe way to call it.
    ///
    /// # Safety
    /// `id` is the caller's own: no [`Registration`] holds it, and once the call returned `Ok`
    /// nothing reads or writes the memory through anything `register` or `allocate` returned for it
    /// (for allocated memory, the address is gone). An id that is unknown (or already deregistered)
    /// is only looked up.
    ///
    /// # Errors
    /// Unknown region.
    unsafe fn deregister(&self, id: RegionId) -> Result<(), TransportError>;

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

    /// Several posts at once, each with [`post`](Self::post)'s guarantees (its own validation,
    /// notification and `done`). A backend may make their writes together: the UCX backend copies
    /// the rows of matching writes of the posts in turn, so a source row that feeds several peers
    /// (a prefill rank's token row, sliced between decode TP ranks) is read once. The default
    /// posts them one by one.
    fn post_many(&self, posts: Vec<Post>) {
        for p in posts {
            self.post(p.peer, p.writes, p.notification, p.done);
        }
    }

    /// Counters.
    fn stats(&self) -> TransportStats;

    /// Tells the transport whether its owner expects traffic soon (a receiver with requests in
    /// flight). An active transport polls often instead of backing off when idle, so a notification
    /// is seen within microseconds instead of within its idle back-off. The default ignores the
    /// hint.
    fn set_active(&self, _active: bool) {}
}

/// Microseconds since `t`, for the start-up times the engines log (saturating at `u64::MAX`).
pub(crate) fn micros_since(t: std::time::Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// Pools whose memory was leaked rather than freed while a write could still land in it (process-wide).
static LEAKED_POOLS: AtomicU64 = AtomicU64::new(0);

/// How many pools this process leaked because it could not confirm that no write still lands in them
/// (an engine dropped without shutdown, a shutdown past its bound, a deregistration that failed).
pub fn leaked_pools() -> u64 {
    LEAKED_POOLS.load(Ordering::Relaxed)
}

/// Registered memory that owns (or, for caller memory, carries the promise of) what it registered,
/// so safe code cannot free memory while it is registered, nor while a peer may write into it.
///
/// The memory is reached only by copies ([`read_at`](Self::read_at), [`write_at`](Self::write_at)),
/// never as a slice, because peers write into it concurrently.
///
/// # Resource cleanup
/// Dropping it deregisters (waiting, bounded, for this process's writes that use it) and then frees
/// the memory, unless a peer may still write into it: once [`remote`](Self::remote) has handed out
/// what a peer needs, the memory is leaked on drop (counted in [`leaked_pools`]) until the owner
/// declares every such peer quiet ([`assume_quiesced`](Self::assume_quiesced)). A leak is safe;
/// memory freed while a peer may write into it is not. Deregistration that fails also leaks.
/// [`into_inner`](Self::into_inner) hands the memory back under the same rule.
pub struct Registration {
    transport: Arc<dyn Transport>,
    id: RegionId,
    remote: RemoteRegion,
    /// `Some` until drop or `into_inner`.
    pool: Option<Pool>,
    /// `remote` was handed out: a peer may know how to write into the memory.
    exported: AtomicBool,
    /// Every peer that was handed `remote` is known to write no more.
    quiesced: AtomicBool,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.id)
            .field("pool", &self.pool)
            .field("exported", &self.exported)
            .field("quiesced", &self.quiesced)
            .finish_non_exhaustive()
    }
}

impl Registration {
    /// Registers `pool` with `transport`.
    ///
    /// # Errors
    /// The transport's error (the pool is dropped with it).
    pub fn new(transport: &Arc<dyn Transport>, pool: Pool) -> Result<Self, TransportError> {
        let pool = match pool {
            Pool::Shared(len) => match transport.allocate(len)? {
                Some((id, remote, desc)) => {
                    return Ok(Registration {
                        transport: transport.clone(),
                        id,
                        remote,
                        pool: Some(Pool::Transport(TransportMem::new(desc))),
                        exported: AtomicBool::new(false),
                        quiesced: AtomicBool::new(false),
                    });
                }
                None => {
                    let buf = HostBuffer::new(
                        len as usize,
                        HostOptions {
                            prefault: true,
                            ..HostOptions::default()
                        },
                    )
                    .map_err(|e| TransportError::Library {
                        op: "allocating a host pool",
                        code: i64::from(e.raw_os_error().unwrap_or(0)),
                        message: e.to_string(),
                    })?;
                    Pool::Owned(buf)
                }
            },
            other => other,
        };
        // SAFETY: the registration owns the pool (or, for `Pool::Borrowed`, carries the promise of
        // `Pool::borrowed`'s caller) and frees it only after deregistration returned Ok, and only if
        // no peer was given `remote()` or the owner declared every such peer quiet
        // (`assume_quiesced`, itself `unsafe`); otherwise it leaks the pool. Nothing hands out
        // references to the memory: copies are 8-byte atomics (`Pool::read_at`).
        let (id, remote) = unsafe { transport.register(pool.desc()) }?;
        Ok(Registration {
            transport: transport.clone(),
            id,
            remote,
            pool: Some(pool),
            exported: AtomicBool::new(false),
            quiesced: AtomicBool::new(false),
        })
    }

    /// The transport's id for it, as [`WriteOp::local`] names it.
    pub fn id(&self) -> RegionId {
        self.id
    }

    /// What a peer needs to write into it. Send it only to an authenticated peer. From now on the
    /// memory is leaked rather than freed unless [`assume_quiesced`](Self::assume_quiesced) is called.
    pub fn remote(&self) -> &RemoteRegion {
        self.exported.store(true, Ordering::Release);
        &self.remote
    }

    /// Declares that no peer that was handed [`remote`](Self::remote) can write into the memory any
    /// more, so dropping (or [`into_inner`](Self::into_inner)) may free it.
    ///
    /// # Safety
    /// Every peer that learned this registration's [`RemoteRegion`] has stopped writing into it and
    /// will not write again (its writes completed and it disconnected, or its process is gone).
    pub unsafe fn assume_quiesced(&self) {
        self.mark_quiesced();
    }

    /// [`assume_quiesced`](Self::assume_quiesced), for the engine, which proves the condition itself
    /// (every rank confirmed its writes are over).
    pub(crate) fn mark_quiesced(&self) {
        self.quiesced.store(true, Ordering::Release);
    }

    fn may_be_written(&self) -> bool {
        self.exported.load(Ordering::Acquire) && !self.quiesced.load(Ordering::Acquire)
    }

    /// The memory's description.
    pub fn desc(&self) -> Option<MemDesc> {
        self.pool.as_ref().map(Pool::desc)
    }

    /// Copies bytes out; see [`Pool::read_at`].
    ///
    /// # Errors
    /// As [`Pool::read_at`].
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), CopyError> {
        match &self.pool {
            Some(p) => p.read_at(offset, dst),
            None => Err(CopyError::NotHost),
        }
    }

    /// Copies bytes in; see [`Pool::write_at`].
    ///
    /// # Errors
    /// As [`Pool::write_at`].
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), CopyError> {
        match &self.pool {
            Some(p) => p.write_at(offset, src),
            None => Err(CopyError::NotHost),
        }
    }

    /// Reads a range piece by piece; see [`Pool::read_pieces`].
    ///
    /// # Errors
    /// As [`Pool::read_pieces`].
    pub fn read_pieces(
        &self,
        offset: u64,
        len: u64,
        f: impl FnMut(&[u8]),
    ) -> Result<(), CopyError> {
        match &self.pool {
            Some(p) => p.read_pieces(offset, len, f),
            None => Err(CopyError::NotHost),
        }
    }

    /// Copies `len` bytes at `offset` into `dst`'s memory at `dst_offset`; see [`Pool::copy_to`].
    ///
    /// # Errors
    /// As [`Pool::copy_to`].
    pub fn copy_to(
        &self,
        offset: u64,
        dst: &Registration,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), CopyError> {
        match (&self.pool, &dst.pool) {
            (Some(a), Some(b)) => a.copy_to(offset, b, dst_offset, len),
            _ => Err(CopyError::NotHost),
        }
    }

    /// Copies packed rows into `dst`'s memory, strided; see [`Pool::copy_rows_to`].
    ///
    /// # Errors
    /// As [`Pool::copy_rows_to`].
    pub fn copy_rows_to(
        &self,
        offset: u64,
        dst: &Registration,
        dst_offset: u64,
        len: u64,
        rows: u64,
        dst_stride: u64,
    ) -> Result<(), CopyError> {
        match (&self.pool, &dst.pool) {
            (Some(a), Some(b)) => a.copy_rows_to(offset, b, dst_offset, len, rows, dst_stride),
            _ => Err(CopyError::NotHost),
        }
    }

    /// Sets bytes; see [`Pool::fill_at`].
    ///
    /// # Errors
    /// As [`Pool::fill_at`].
    pub fn fill_at(&self, offset: u64, len: usize, byte: u8) -> Result<(), CopyError> {
        match &self.pool {
            Some(p) => p.fill_at(offset, len, byte),
            None => Err(CopyError::NotHost),
        }
    }

    /// Deregisters and hands the memory back.
    ///
    /// # Errors
    /// [`TransportError::MayBeWritten`] if a peer was handed [`remote`](Self::remote) and not declared
    /// quiet; the deregistration's error otherwise. Either way the registration is returned with the
    /// error and still holds the memory.
    pub fn into_inner(mut self) -> Result<Pool, Box<(Self, TransportError)>> {
        if self.may_be_written() {
            return Err(Box::new((self, TransportError::MayBeWritten)));
        }
        // SAFETY: the id is this registration's own and no peer may still write into the memory
        // (checked above); on `Ok` the pool is handed back below and this registration, the only
        // holder of the id, is consumed, so nothing uses the memory through the id again (memory
        // the transport allocated and freed comes back as a request for new memory, not as its
        // address).
        if let Err(e) = unsafe { self.transport.deregister(self.id) } {
            return Err(Box::new((self, e)));
        }
        match self.pool.take() {
            // The transport freed its own memory with the deregistration: what comes back is the
            // request, which a new registration allocates afresh.
            Some(Pool::Transport(t)) => Ok(Pool::Shared(t.desc().len())),
            Some(p) => Ok(p),
            // `pool` is `Some` until drop or here; kept as an error rather than a panic.
            None => Err(Box::new((self, TransportError::Shutdown))),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let Some(pool) = self.pool.take() else { return };
        let written = self.may_be_written();
        if written && let Pool::Transport(_) = pool {
            // Deregistering would free the transport's memory: keep the registration for good.
            self.transport.abandon(self.id);
            return leak(pool, "a peer that was given it may still write into it");
        }
        // SAFETY: the id is this registration's own and it is being dropped; on `Ok` the pool is freed
        // or leaked right here and nothing else holds the id.
        let first = match unsafe { self.transport.deregister(self.id) } {
            Ok(()) if !written => return drop(pool),
            Ok(()) => return leak(pool, "a peer that was given it may still write into it"),
            Err(e) => e,
        };
        if written {
            return leak(pool, "a peer that was given it may still write into it");
        }
        // The usual cause is that the last handle to an engine went away inside one of the
        // transport's own callbacks, on its progress thread, which cannot answer itself. A helper
        // thread asks again once the callback has returned, and frees the memory only if that works.
        // The pool waits in a slot, so that a failed spawn (which drops the closure unrun) leaves it
        // to be leaked here rather than freed with the closure.
        let slot = Arc::new(std::sync::Mutex::new(Some(pool)));
        let (transport, id, theirs) = (self.transport.clone(), self.id, slot.clone());
        let spawned = std::thread::Builder::new()
            .name("kvx-dereg".into())
            .spawn(move || {
                let pool = theirs.lock().unwrap_or_else(|e| e.into_inner()).take();
                // SAFETY: the dropped registration's id, asked again; on `Ok` the pool is freed here
                // and nothing else holds the id.
                match (unsafe { transport.deregister(id) }, pool) {
                    (Ok(()), pool) => drop(pool),
                    (Err(then), Some(p)) => {
                        tracing::warn!(%first, %then, "deregistration failed");
                        leak(p, "its deregistration failed");
                    }
                    (Err(_), None) => {}
                }
            });
        if spawned.is_err()
            && let Some(p) = slot.lock().unwrap_or_else(|e| e.into_inner()).take()
        {
            leak(p, "its deregistration failed and could not be retried");
        }
    }
}

fn leak(pool: Pool, why: &str) {
    LEAKED_POOLS.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(
        bytes = pool.len(),
        why,
        "leaking registered memory instead of freeing it"
    );
    std::mem::forget(pool);
}
