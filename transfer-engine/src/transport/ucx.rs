//! The direct UCX backend: `ucp_put` or our own copies for the pages, an active message for the
//! notification.
//!
//! One progress thread owns the UCX context and its single-threaded worker; every other thread talks
//! to it through a command queue. Callers that need an answer (register, connect) block on a reply for
//! microseconds; posts are fire-and-forget with a [`Done`] callback.
//!
//! A chunk goes out as: every write, then `ucp_ep_flush_nbx`, whose completion means the puts are
//! remotely complete, then the notification as an active message. So the receiver never sees a
//! notification before its bytes. A write into a region that UCX mapped into this process (memory
//! the peer allocated through UCX's shared memory, [`UcxConfig::direct_copy`]) is a CPU copy made
//! right there, fenced before the flush; any other write is a `ucp_put_nbx` whose request is freed at
//! once (UCX completes it on its own).
//!
//! Idle, the thread spins for [`UcxConfig::spin`] and then sleeps. With [`UcxConfig::events`] (the
//! default) it sleeps in `poll(2)` on the worker's event fd (`UCP_FEATURE_WAKEUP`,
//! `ucp_worker_get_efd`, armed by `ucp_worker_arm`) beside a doorbell that command senders ring
//! only while it sleeps, so an arriving notification or put wakes it, and an engine waiting for
//! chunks costs no CPU while it waits. While its own writes are in flight it naps instead, as
//! without events: it parks for a time that grows from [`UcxConfig::min_sleep`] to
//! [`UcxConfig::max_sleep`], every nap [`UcxConfig::min_sleep`] while the owner expects
//! notifications (`Transport::set_active`). Asking UCX for wake-ups keeps its shared-memory
//! zero-copy transport (cma) for puts here (UCX 1.23: `UCX_PROTO_INFO=y` shows cma for
//! `ucp_put*` either way).
//!
//! This is the only module of the crate that calls UCX.

use super::progress::{Handle, ProgressScheduling, Shared};
use super::{
    BackendKind, Done, Incoming, PeerId, Post, RegionId, RemoteRegion, Sender, Sink, Transport,
    TransportError, TransportStats, WriteOp,
};
use crate::mem::{MemDesc, MemKind};
use crossbeam_channel as chan;
use std::collections::{HashMap, VecDeque};
use std::ffi::{CStr, c_void};
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use ucx_sys as ffi;

/// Active message id of chunk notifications.
const NOTIFY_AM_ID: u32 = 0x4b56;
/// Largest worker address or packed rkey accepted from a peer (UCX's are hundreds of bytes).
const MAX_PEER_BLOB: usize = 64 << 10;
/// Zeroed bytes after a peer's address or rkey, read instead of foreign memory if it lies about its
/// own length.
const PEER_BLOB_SLACK: usize = 4 << 10;

/// A copy of a peer's blob with [`PEER_BLOB_SLACK`] zeroed bytes after it.
fn padded(blob: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(blob.len() + PEER_BLOB_SLACK);
    v.extend_from_slice(blob);
    v.resize(blob.len() + PEER_BLOB_SLACK, 0);
    v
}

/// Pieces at least this large (a 4 KiB page and up) are copied with non-temporal stores (see
/// [`copy_streaming`]); smaller ones with plain copies. The destination is a peer's pool, which this
/// process never reads back, so caching its lines would only evict ours: with 4 KiB pages
/// (`kvbench --model gqa --scatter --page-tokens 2`) this threshold measured 1.59 and 1.67 million
/// writes/s against 1.14 and 1.19 million at 16 KiB, where pages took plain copies.
const STREAMING_COPY_MIN: usize = 4 << 10;

/// The shortest row of a many-row write copied with streaming stores (a few of the 64-byte blocks
/// `copy_streaming` stores).
const STREAMING_ROW_MIN: usize = 256;

/// Where UCX maps a peer's region `[addr, addr + len)` into this process, or null if it does not, or
/// if the mapping UCX made for this rkey does not hold the whole region.
///
/// `ucp_rkey_ptr` answers for shared-memory transports only (the peer's memory was allocated by
/// UCX, which attached it here when the rkey was unpacked) and checks no length: the pointer is the
/// peer's address plus an offset. So the region the peer claims must lie wholly inside one shared
/// mapping of this process that appeared while the rkey was unpacked (`before` lists the shared
/// mappings from just before): not in UCX's own queues, our pools or another peer's, which were
/// there already. Otherwise we write nothing through it.
fn mapped(rkey: ffi::ucp_rkey_h, addr: u64, len: u64, before: &[(u64, u64)]) -> *mut u8 {
    let mut local: *mut c_void = ptr::null_mut();
    // SAFETY: rkey is a live rkey this thread unpacked; UCX only writes the out pointer.
    let st = unsafe { ffi::ucp_rkey_ptr(rkey, addr, &mut local) };
    if !st.is_ok() || local.is_null() || len == 0 {
        return ptr::null_mut();
    }
    let start = local as u64;
    let Some(end) = start.checked_add(len) else {
        return ptr::null_mut();
    };
    let made = shared_mappings().is_some_and(|now| made_for_rkey(before, &now, start, end));
    if !made {
        tracing::warn!(
            addr,
            len,
            "a peer's region is not wholly inside the memory UCX mapped for its rkey; using puts"
        );
        return ptr::null_mut();
    }
    // Map every page now, so the first writes do not fault page by page; a region whose pages cannot
    // be had is left to UCX's puts rather than written by our copies.
    if let Err(e) = populate(local.cast(), len) {
        tracing::warn!(addr, len, error = %e, "cannot map a peer's region; using puts");
        return ptr::null_mut();
    }
    local.cast()
}

/// Whether `[start, end)` lies wholly inside one of the mappings in `now` that is not in `before`.
fn made_for_rkey(before: &[(u64, u64)], now: &[(u64, u64)], start: u64, end: u64) -> bool {
    now.iter()
        .any(|&(lo, hi)| lo <= start && end <= hi && !before.contains(&(lo, hi)))
}

/// The smallest page size `madvise` aligns to.
const PAGE: usize = 4096;

/// Asks the kernel to fault in `[addr, addr + len)` for writing (`MADV_POPULATE_WRITE`): pages are
/// allocated and mapped, contents are not touched. Kernels before 5.14 do not know it (`EINVAL`);
/// the pages then fault in on first write as before, which is not an error. Any other failure is:
/// the memory cannot be had (`ENOMEM`), or a write would raise SIGBUS (`EFAULT`: a shared-memory
/// mount without room for it).
fn populate(addr: *mut u8, len: u64) -> std::io::Result<()> {
    // madvise takes whole pages; the mapping holds the pages around the range too.
    let start = addr as usize & !(PAGE - 1);
    let Some(len) = usize::try_from(len)
        .ok()
        .and_then(|l| l.checked_add(addr as usize - start))
    else {
        return Err(std::io::Error::from_raw_os_error(libc::EOVERFLOW));
    };
    // Large ranges in parts on threads of their own (see `mem::part_len`).
    let part = crate::mem::part_len(len, PAGE).max(PAGE);
    crate::mem::on_threads((0..len).step_by(part), |off| {
        populate_part(start + off, part.min(len - off))
    })
}

/// [`populate`] of `[start, start + len)`, page-aligned, on this thread.
fn populate_part(start: usize, len: usize) -> std::io::Result<()> {
    let addr = start as *mut u8;
    // SAFETY: the range is part of a mapping of this process (memory UCX allocated for us, or a
    // peer's region UCX attached for its rkey, checked against our memory map), page-aligned by
    // `populate`; MADV_POPULATE_WRITE only prefaults it as a write would and never changes its
    // contents, so memory others use concurrently (and the other parts' threads) is safe.
    let rc = unsafe { libc::madvise(addr.cast(), len, libc::MADV_POPULATE_WRITE) };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EINVAL) {
        tracing::debug!(error = %e, "cannot prefault a pool; its pages fault in on first write");
        return Ok(());
    }
    Err(e)
}

/// The readable, writable, shared mappings of this process (`/proc/self/maps`), as `[start, end)`.
fn shared_mappings() -> Option<Vec<(u64, u64)>> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    Some(maps.lines().filter_map(shared_mapping).collect())
}

/// One line of `/proc/self/maps`, if it is a readable, writable, shared mapping ("rw?s").
fn shared_mapping(line: &str) -> Option<(u64, u64)> {
    let mut fields = line.split_whitespace();
    let (lo, hi) = fields.next()?.split_once('-')?;
    let perms = fields.next()?;
    if !perms.starts_with("rw") || perms.as_bytes().get(3) != Some(&b's') {
        return None;
    }
    Some((
        u64::from_str_radix(lo, 16).ok()?,
        u64::from_str_radix(hi, 16).ok()?,
    ))
}

/// Copies `len` bytes from `src` to `dst` with non-temporal (streaming) stores, which write whole
/// cache lines to memory without reading them first. The caller issues [`store_fence`] before
/// anything may tell another process that the bytes are there.
///
/// # Safety
/// `src` is readable and `dst` writable for `len` bytes, and the two ranges do not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let head = dst.align_offset(16).min(len);
    // SAFETY: every access stays within `[0, len)` of both ranges, which the caller vouches for; the
    // streaming stores go to 16-byte aligned addresses (`head` aligns dst), as `_mm_stream_si128`
    // requires; SSE2 is part of the x86_64 baseline.
    unsafe {
        ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 64 <= len {
            let s = src.add(i);
            let d = dst.add(i);
            let a = _mm_loadu_si128(s.cast::<__m128i>());
            let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
            let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
            let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
            _mm_stream_si128(d.cast::<__m128i>(), a);
            _mm_stream_si128(d.add(16).cast::<__m128i>(), b);
            _mm_stream_si128(d.add(32).cast::<__m128i>(), c);
            _mm_stream_si128(d.add(48).cast::<__m128i>(), e);
            i += 64;
        }
        ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
    }
}

/// Asks the CPU to start loading `[p, p + len)` into its caches (a hint: it reads nothing the
/// program sees and cannot fault). Rows read with a stride (a source rank's share of each token
/// row) defeat the hardware's stream detection; fetching the next row while one is copied does its
/// work.
#[cfg(target_arch = "x86_64")]
fn prefetch(p: *const u8, len: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    let mut i = 0;
    while i < len {
        // SAFETY: a prefetch is a hint that never faults and never changes memory, whatever the
        // address (Intel SDM, PREFETCHh: "does not affect program behavior"); SSE is part of the
        // x86_64 baseline.
        unsafe { _mm_prefetch(p.wrapping_add(i).cast::<i8>(), _MM_HINT_T0) };
        i += 64;
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn prefetch(_: *const u8, _: usize) {}

/// Copies row `i` of `w` from our registration at `src` to the peer's region mapped at `dst`;
/// returns whether it used streaming stores. With `prefetch_next`, the next source row is
/// fetched ahead where rows are strided (rows read in turn with other writes' rows need not).
///
/// # Safety
/// `w` was checked by `Worker::validate` against the registration at `src` and the peer's region,
/// which UCX mapped whole at `dst` (`direct_target`), and `i < w.rows`.
unsafe fn copy_row(src: u64, dst: *mut u8, w: &WriteOp, i: u64, prefetch_next: bool) -> bool {
    let len = w.len as usize;
    // Rows of a large write stream too (sliced heads: rows of a few hundred bytes that add up to
    // pages), unless they are too short for a streaming block.
    let stream = len >= STREAMING_COPY_MIN
        || (len >= STREAMING_ROW_MIN && w.bytes() >= STREAMING_COPY_MIN as u64);
    let (lo, ro) = (
        w.local_offset + i * w.local_stride,
        w.remote_offset + i * w.remote_stride,
    );
    let from = (src + lo) as *const u8;
    if prefetch_next && w.rows > 1 && w.local_stride > w.len {
        prefetch(from.wrapping_add(w.local_stride as usize), len);
    }
    // SAFETY: `dst` maps the peer's whole region (checked against the mapping UCX made for this
    // rkey when it was unpacked) and stays mapped while the rkey lives, which is longer than the
    // post; the row lies inside that region and inside our registration (`WriteOp::fits`, called
    // by `validate`). The source is our own registered host memory (device sources go through
    // puts), the destination the peer's, so both are CPU-addressable and do not overlap.
    unsafe {
        let to = dst.add(ro as usize);
        if stream {
            copy_streaming(to, from, len);
        } else {
            ptr::copy_nonoverlapping(from, to, len);
        }
    }
    stream
}

/// Other architectures copy plainly.
///
/// # Safety
/// As the x86_64 version.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: the caller vouches for both ranges.
    unsafe { ptr::copy_nonoverlapping(src, dst, len) };
}

/// The nice value a sending progress thread takes by default (see [`lower_thread_priority`]).
pub const SENDER_NICE: i32 = 10;

/// Lowers the calling thread's CPU priority to `nice` (higher is lower; only ever raised, which
/// needs no privilege). A sender's progress thread does the bulk copies of its writes: at nice 10
/// it still takes every idle cycle, but on a busy host a woken thread of normal priority (the
/// receiver's polling, a server's scheduler loop) preempts it at once instead of waiting for its
/// time slice to end at a scheduler tick. With four ranks copying on two cores, `kvbench
/// --processes` measured last write to Complete p99 of 0.14 to 2 ms this way against 2.8 to 4.4 ms at
/// nice 0, with the same throughput. Best effort: a failure changes nothing.
pub(crate) fn lower_thread_priority(nice: i32) {
    if nice <= 0 {
        return;
    }
    // SAFETY: gettid takes no arguments and cannot fail.
    let tid = unsafe { libc::gettid() };
    // SAFETY: setpriority only changes the scheduling of thread `tid` (this thread); it touches no
    // memory. On Linux, PRIO_PROCESS with a thread id applies to that thread alone.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
    if rc != 0 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "cannot lower the sending progress thread's priority"
        );
    }
}

/// Orders every streaming store before the stores that follow (the notification).
fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no memory operands; SSE is part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    std::sync::atomic::fence(Ordering::SeqCst);
}

/// How long shutdown waits for posted chunks before closing endpoints under them.
const SHUTDOWN_BOUND: Duration = Duration::from_secs(5);

/// Settings of a [`UcxTransport`].
#[derive(Clone, Debug)]
pub struct UcxConfig {
    /// How long the progress thread keeps polling after its last event before it sleeps.
    pub spin: Duration,
    /// Name of the worker, for UCX's logs.
    pub name: String,
    /// First sleep once idle.
    pub min_sleep: Duration,
    /// Longest sleep once idle: the worst added latency for a notification reaching an idle engine.
    pub max_sleep: Duration,
    /// Create endpoints with UCX's peer error handling, so a dead peer fails its writes and is
    /// reported as [`Incoming::PeerFailed`]. UCX then refuses every transport without a peer failure
    /// handler, shared memory included, and loopback traffic falls back to TCP; so it is off by
    /// default, and a dead peer is detected by the control plane (its connection closes) and by the
    /// engines' deadlines instead. Turn it on between hosts.
    pub peer_error_handling: bool,
    /// Let UCX use its native TCP put (on by default). Off, RMA over TCP runs on active messages,
    /// several times slower. `UCX_TCP_PUT_ENABLE` in the environment overrides it.
    ///
    /// Native put once crashed the receiving worker (SIGSEGV in UCX's TCP progress): the first
    /// notification that could not be sent at once made UCX resolve the remote endpoint lazily, in
    /// the middle of a put stream; the receiver then built its endpoint back to the sender and UCX's
    /// TCP transport handed the socket that was receiving a put to the new endpoint without the put's
    /// state. The transport now has UCX resolve remote endpoints when they are created
    /// (`RESOLVE_REMOTE_EP_ID`), before any put, as NIXL's endpoints do through peer error handling.
    pub tcp_native_put: bool,
    /// Write into a peer's region with our own CPU copies where UCX maps that region into this
    /// process (`ucp_rkey_ptr`: the peer allocated it through UCX's shared memory, see
    /// `Transport::allocate`), instead of `ucp_put_nbx`. Large pieces are copied with non-temporal
    /// stores, which stream through memory without first reading the destination into the cache.
    /// On by default; where UCX cannot map a region (private memory, another host), puts go
    /// through UCX as before.
    pub direct_copy: bool,
    /// The nice value the progress thread takes when it posts its first write (see
    /// [`lower_thread_priority`]); 0 leaves it as it is.
    pub sender_nice: i32,
    /// Sleep on UCX's event fd when idle, woken by arriving data (on by default); off, the idle
    /// thread naps between polls (see the module's documentation).
    pub events: bool,
    /// With [`events`](Self::events): the longest sleep, after which UCX is progressed anyway (its
    /// own timers).
    pub event_timeout: Duration,
    /// How the system schedules the progress thread (see [`ProgressScheduling`]).
    pub scheduling: ProgressScheduling,
}

impl Default for UcxConfig {
    fn default() -> Self {
        UcxConfig {
            spin: Duration::from_micros(200),
            name: "kvx".into(),
            min_sleep: Duration::from_micros(20),
            max_sleep: Duration::from_millis(1),
            peer_error_handling: false,
            tcp_native_put: true,
            direct_copy: true,
            sender_nice: SENDER_NICE,
            events: true,
            event_timeout: Duration::from_millis(100),
            scheduling: ProgressScheduling::Normal,
        }
    }
}

fn status_error(op: &'static str, status: ffi::ucs_status_t) -> TransportError {
    // SAFETY: ucs_status_string accepts any status value and returns a static NUL-terminated string.
    let msg = unsafe { CStr::from_ptr(ffi::ucs_status_string(status)) };
    TransportError::Library {
        op,
        code: i64::from(status.0),
        message: msg.to_string_lossy().into_owned(),
    }
}

/// A UCX status as a `Result`, the one place where that conversion happens.
trait StatusExt {
    fn result(self, op: &'static str) -> Result<(), TransportError>;
}

impl StatusExt for ffi::ucs_status_t {
    fn result(self, op: &'static str) -> Result<(), TransportError> {
        if self.is_ok() {
            Ok(())
        } else {
            Err(status_error(op, self))
        }
    }
}

/// The libucp files mapped into this process, one entry per distinct file.
///
/// Two different UCX libraries in one process share nothing and fight over signal handlers and memory
/// hooks; the symptom is a hang, so the engine checks before it starts UCX and after NIXL loads its
/// plugin.
pub fn loaded_ucp_libraries() -> Vec<String> {
    struct Found {
        names: Vec<String>,
    }
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> libc::c_int {
        // SAFETY: dl_iterate_phdr passes a valid info pointer for the duration of the callback, and
        // `data` is the `Found` we passed, alive for the whole iteration.
        let (info, found) = unsafe { (&*info, &mut *(data as *mut Found)) };
        if !info.dlpi_name.is_null() {
            // SAFETY: dlpi_name is a NUL-terminated string owned by the loader, valid during the callback.
            let name = unsafe { CStr::from_ptr(info.dlpi_name) }
                .to_string_lossy()
                .into_owned();
            let file = name.rsplit('/').next().unwrap_or("");
            if file.starts_with("libucp.so") || file.starts_with("libucp-") {
                found.names.push(name);
            }
        }
        0
    }
    let mut found = Found { names: Vec::new() };
    // SAFETY: the callback only reads the loader's data and writes into `found`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut found as *mut Found as *mut c_void) };
    let mut seen: Vec<(u64, u64)> = Vec::new();
    let mut out = Vec::new();
    for name in found.names {
        let id = std::fs::metadata(&name).map(|m| {
            use std::os::unix::fs::MetadataExt;
            (m.dev(), m.ino())
        });
        match id {
            Ok(id) if seen.contains(&id) => {}
            Ok(id) => {
                seen.push(id);
                out.push(name);
            }
            Err(_) => out.push(name),
        }
    }
    out
}

/// Fails when more than one distinct libucp is loaded in this process.
///
/// # Errors
/// [`TransportError::TwoUcxLibraries`] with the paths found.
pub fn check_single_ucx() -> Result<(), TransportError> {
    let libs = loaded_ucp_libraries();
    if libs.len() > 1 {
        Err(TransportError::TwoUcxLibraries(libs))
    } else {
        Ok(())
    }
}

/// UCX modules kept out of this process unless the user's own `UCX_MODULES` says otherwise.
///
/// Wherever rdma-core is installed (every RDMA host), UCX loads its EFA transport module, which in the
/// wheels we run on brings its own copy of libnl: at process exit that copy's destructor crashes
/// (SIGSEGV in `rtnl_tc_unregister`), so every process that had loaded it ended with status 139.
/// EFA devices exist only on AWS instances, which can set `UCX_MODULES` themselves.
const DEFAULT_MODULES: &std::ffi::CStr = c"^efa";

/// Prepares this process for UCX, before the first `ucp_init` (ours or NIXL's UCX plugin's): fails if
/// two UCX libraries are loaded, and sets UCX's `MODULES` option to [`DEFAULT_MODULES`] unless the
/// environment sets `UCX_MODULES`.
///
/// # Errors
/// [`TransportError::TwoUcxLibraries`].
pub(crate) fn prepare_process() -> Result<(), TransportError> {
    check_single_ucx()?;
    static MODULES: std::sync::Once = std::sync::Once::new();
    MODULES.call_once(|| {
        if std::env::var_os("UCX_MODULES").is_some() {
            return;
        }
        // SAFETY: both arguments are NUL-terminated strings that live for the call.
        // `ucs_global_opts_set_value` writes UCX's process-wide options, which UCX reads when it loads
        // its transport modules during the first context's initialisation; every path of this crate
        // into UCX (UcxTransport::new, NixlTransport::new) comes through here first, and the `Once`
        // makes any concurrent caller wait until the write is done.
        let st = unsafe {
            ffi::ucs_global_opts_set_value(c"MODULES".as_ptr(), DEFAULT_MODULES.as_ptr())
        };
        if let Err(e) = st.result("ucs_global_opts_set_value(MODULES)") {
            tracing::warn!(error = %e, "could not keep UCX's EFA module out of the process");
        }
    });
    Ok(())
}

/// The library version this process runs (not the headers' version).
pub fn library_version() -> (u32, u32, u32) {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: the three pointers are valid for writes during the call.
    unsafe { ffi::ucp_get_version(&mut major, &mut minor, &mut release) };
    (major, minor, release)
}

enum Cmd {
    Register(
        MemDesc,
        chan::Sender<Result<(RegionId, RemoteRegion), TransportError>>,
    ),
    Deregister(RegionId, chan::Sender<Result<(), TransportError>>),
    Allocate(
        u64,
        chan::Sender<Result<(RegionId, RemoteRegion), TransportError>>,
    ),
    Abandon(RegionId),
    Connect(
        Vec<u8>,
        Vec<RemoteRegion>,
        u64,
        chan::Sender<Result<PeerId, TransportError>>,
    ),
    Disconnect(PeerId),
    Post(Vec<Post>),
    Stop,
}

/// The direct UCX transport. Cheap to share behind an `Arc`; every method may be called from any thread.
pub struct UcxTransport {
    thread: Handle<Cmd>,
    address: Vec<u8>,
}

impl std::fmt::Debug for UcxTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxTransport")
            .field("stats", &self.stats())
            .finish()
    }
}

impl UcxTransport {
    /// Starts a UCX context and worker on a new progress thread. Received notifications and peer
    /// failures go to `sink`, called on that thread.
    ///
    /// # Errors
    /// Two UCX libraries in the process, or UCX failing to start.
    pub fn new(config: UcxConfig, sink: Sink) -> Result<Self, TransportError> {
        prepare_process()?;
        let name = format!("ucx-{}", config.name);
        let (thread, address) = Handle::spawn(
            name,
            config.scheduling,
            || Cmd::Stop,
            move |(shared, rx, ready)| match Worker::start(&config, sink, shared) {
                Ok(mut w) => {
                    let addr = w.address();
                    let ok = addr.is_ok();
                    let _ = ready.send(addr);
                    if ok {
                        w.run(&rx);
                    }
                    w.close();
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                }
            },
        )?;
        Ok(UcxTransport { thread, address })
    }

    fn call<T>(
        &self,
        make: impl FnOnce(chan::Sender<Result<T, TransportError>>) -> Cmd,
    ) -> Result<T, TransportError> {
        self.thread.call(make)
    }

    /// Stops the progress thread: waits (bounded) for posted chunks, then closes endpoints and frees
    /// every UCX resource. Also done on drop.
    pub fn shutdown(&self) {
        self.thread.shutdown();
    }
}

impl Transport for UcxTransport {
    fn kind(&self) -> BackendKind {
        BackendKind::Ucx
    }

    fn metadata(&self) -> Result<Vec<u8>, TransportError> {
        Ok(self.address.clone())
    }

    fn name(&self) -> String {
        String::new()
    }

    unsafe fn register(&self, mem: MemDesc) -> Result<(RegionId, RemoteRegion), TransportError> {
        // The caller's promise (`Transport::register`'s `# Safety`) travels with the command.
        self.call(|tx| Cmd::Register(mem, tx))
    }

    unsafe fn deregister(&self, id: RegionId) -> Result<(), TransportError> {
        // The caller's promise (`Transport::deregister`'s `# Safety`) travels with the command.
        self.call(|tx| Cmd::Deregister(id, tx))
    }

    fn allocate(
        &self,
        len: u64,
    ) -> Result<Option<(RegionId, RemoteRegion, MemDesc)>, TransportError> {
        let (id, remote) = self.call(|tx| Cmd::Allocate(len, tx))?;
        // The pool's pages are made now, not by the first writes into them; a pool that cannot have
        // them (a size-limited shared-memory mount) fails here rather than by SIGBUS at a write.
        // On this thread, not the progress thread: that takes time in proportion to the pool
        // (seconds for tens of GiB), past the bound on a call to the progress thread.
        if let Err(e) = populate(remote.addr as usize as *mut u8, len) {
            // SAFETY: the region was allocated just now and its id has not left this function:
            // nothing reads or writes it.
            if let Err(d) = unsafe { self.deregister(id) } {
                tracing::warn!(bytes = len, error = %d, "a pool that could not be populated stays allocated");
            }
            return Err(TransportError::Populate {
                bytes: len,
                code: e.raw_os_error().unwrap_or(0),
                message: e.to_string(),
            });
        }
        let desc = MemDesc::host_raw(remote.addr as usize as *mut u8, len as usize);
        Ok(Some((id, remote, desc)))
    }

    fn abandon(&self, id: RegionId) {
        let _ = self.thread.send(Cmd::Abandon(id));
    }

    fn connect(
        &self,
        metadata: &[u8],
        regions: &[RemoteRegion],
        key: u64,
    ) -> Result<PeerId, TransportError> {
        self.call(|tx| Cmd::Connect(metadata.to_vec(), regions.to_vec(), key, tx))
    }

    fn disconnect(&self, peer: PeerId) {
        let _ = self.thread.send(Cmd::Disconnect(peer));
    }

    fn post(&self, peer: PeerId, writes: Vec<WriteOp>, notification: Vec<u8>, done: Done) {
        self.post_many(vec![Post {
            peer,
            writes,
            notification,
            done,
        }]);
    }

    fn post_many(&self, posts: Vec<Post>) {
        if let Err(Cmd::Post(posts)) = self.thread.send(Cmd::Post(posts)) {
            for p in posts {
                (p.done)(Err(TransportError::Shutdown));
            }
        }
    }

    fn set_active(&self, active: bool) {
        self.thread.shared.set_active(active);
    }

    fn stats(&self) -> TransportStats {
        self.thread.shared.stats()
    }
}

// ---------------------------------------------------------------------------------------------------
// The progress thread's side. Nothing below leaves that thread: raw handles are not Send.

struct Region {
    memh: ffi::ucp_mem_h,
    addr: u64,
    len: u64,
    in_flight: u64,
    deregister: Option<chan::Sender<Result<(), TransportError>>>,
    /// Its owner gave it up while a peer may still write into it: never unmapped, not even at close
    /// (for memory UCX allocated, unmapping would free it).
    abandoned: bool,
    /// UCX allocated the memory (`Transport::allocate`): unmapping frees it, so only its owner's
    /// deregistration does, never the transport's close.
    allocated: bool,
    /// Host memory, which our own CPU copies may read (device memory goes through UCX's puts).
    host: bool,
}

struct RemoteKey {
    addr: u64,
    len: u64,
    rkey: ffi::ucp_rkey_h,
    /// Where UCX mapped the whole region into this process, if it did (see `UcxConfig::direct_copy`):
    /// `addr` in the peer is `direct` here. Null otherwise. Valid while `rkey` lives.
    direct: *mut u8,
}

struct Peer {
    ep: ffi::ucp_ep_h,
    key: u64,
    remote: Vec<RemoteKey>,
    failed: Option<String>,
    in_flight: u64,
    closing: bool,
    /// Whether the peers counter includes it (it was fully connected).
    counted: bool,
    /// Error-handler argument; freed after the endpoint is closed.
    err_arg: *mut ErrArg,
}

/// What UCX hands back to our callbacks: where to queue the event.
type EventQueue = std::cell::RefCell<VecDeque<Event>>;

enum Event {
    OpDone(Box<Op>, ffi::ucs_status_t),
    PeerError(u64, ffi::ucs_status_t),
}

#[derive(PartialEq, Eq)]
enum Stage {
    Flush,
    Notify,
}

/// A posted chunk, owned by UCX (through `user_data`) while a request runs, by the thread otherwise.
struct Op {
    stage: Stage,
    peer: u64,
    regions: Vec<u64>,
    /// Our sender key followed by the notification record; sent as the active message's data, so it
    /// must stay put until the send completes: it lives in this box.
    message: Vec<u8>,
    done: Option<Done>,
    error: Option<TransportError>,
    queue: *const EventQueue,
}

struct ErrArg {
    peer: u64,
    queue: *const EventQueue,
}

struct AmArg {
    sink: Sink,
    shared: Arc<Shared>,
}

struct Worker {
    ctx: ffi::ucp_context_h,
    worker: ffi::ucp_worker_h,
    spin: Duration,
    min_sleep: Duration,
    max_sleep: Duration,
    /// The worker's event fd, where the thread sleeps when idle (see [`UcxConfig::events`]).
    efd: Option<std::os::fd::RawFd>,
    event_timeout: Duration,
    peer_error_handling: bool,
    direct_copy: bool,
    sender_nice: i32,
    /// Whether `sender_nice` was applied (at the first post).
    reniced: bool,
    regions: HashMap<u64, Region>,
    peers: HashMap<u64, Peer>,
    next_id: u64,
    closes: Vec<ffi::ucs_status_ptr_t>,
    /// Boxed so the pointer UCX holds for callbacks stays put.
    queue: Box<EventQueue>,
    am_arg: *mut AmArg,
    sink: Sink,
    shared: Arc<Shared>,
}

unsafe extern "C" fn op_callback(
    request: *mut c_void,
    status: ffi::ucs_status_t,
    user_data: *mut c_void,
) {
    // Never unwind into C: a panic here would be a bug, and aborting beats undefined behaviour.
    let r = std::panic::catch_unwind(|| {
        // SAFETY: user_data is the Box<Op> we leaked when posting this request; UCX calls this callback
        // exactly once, so we take ownership back exactly once. The queue outlives every request
        // (the worker is destroyed, and all requests finished, before the queue is dropped).
        let op = unsafe { Box::from_raw(user_data as *mut Op) };
        // SAFETY: see above: the queue outlives every request.
        let queue = unsafe { &*op.queue };
        queue.borrow_mut().push_back(Event::OpDone(op, status));
        // SAFETY: `request` is the live request this callback reports on; we no longer use it.
        unsafe { ffi::ucp_request_free(request) };
    });
    if r.is_err() {
        std::process::abort();
    }
}

unsafe extern "C" fn ep_error(arg: *mut c_void, _ep: ffi::ucp_ep_h, status: ffi::ucs_status_t) {
    let r = std::panic::catch_unwind(|| {
        // SAFETY: arg is the ErrArg box owned by the peer, freed only after its endpoint is closed, so
        // it is alive whenever UCX can call this handler.
        let arg = unsafe { &*(arg as *const ErrArg) };
        // SAFETY: the queue outlives every endpoint (see op_callback).
        let queue = unsafe { &*arg.queue };
        queue
            .borrow_mut()
            .push_back(Event::PeerError(arg.peer, status));
    });
    if r.is_err() {
        std::process::abort();
    }
}

unsafe extern "C" fn am_receive(
    arg: *mut c_void,
    _header: *const c_void,
    _header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ffi::ucp_am_recv_param_t,
) -> ffi::ucs_status_t {
    let r = std::panic::catch_unwind(|| {
        // SAFETY: arg is the AmArg box the worker owns; it is freed only after the worker is destroyed.
        let arg = unsafe { &*(arg as *const AmArg) };
        // SAFETY: param is valid during the callback.
        let attr = unsafe { (*param).recv_attr };
        if attr & u64::from(ffi::ucp_am_recv_attr_t::UCP_AM_RECV_ATTR_FLAG_RNDV.0) != 0
            || data.is_null()
        {
            // A notification is a few dozen bytes; a rendezvous one is not ours. Dropping it is safe:
            // nothing completes without a valid notification.
            return;
        }
        // SAFETY: for an eager message UCX gives `length` readable bytes at `data` for the callback.
        let bytes = unsafe { std::slice::from_raw_parts(data as *const u8, length) };
        arg.shared
            .counters
            .notifications
            .fetch_add(1, Ordering::Relaxed);
        if let Some((key, record)) = bytes.split_first_chunk::<8>() {
            (arg.sink)(Incoming::Notification {
                sender: Sender::Key(u64::from_le_bytes(*key)),
                bytes: record,
            });
        } else {
            (arg.sink)(Incoming::Notification {
                sender: Sender::Key(0),
                bytes,
            });
        }
    });
    if r.is_err() {
        std::process::abort();
    }
    ffi::ucs_status_t::UCS_OK
}

impl Worker {
    fn start(
        config: &UcxConfig,
        sink: Sink,
        shared: Arc<Shared>,
    ) -> Result<Box<Worker>, TransportError> {
        shared.bind_current_thread();
        let params = ffi::ucp_params_t {
            field_mask: (ffi::ucp_params_field::UCP_PARAM_FIELD_FEATURES
                | ffi::ucp_params_field::UCP_PARAM_FIELD_MT_WORKERS_SHARED)
                .0 as u64,
            features: (ffi::ucp_feature::UCP_FEATURE_RMA | ffi::ucp_feature::UCP_FEATURE_AM).0
                as u64
                | if config.events {
                    ffi::ucp_feature::UCP_FEATURE_WAKEUP.0 as u64
                } else {
                    0
                },
            mt_workers_shared: 0,
            ..Default::default()
        };
        let mut ucx_config = ptr::null_mut();
        // SAFETY: NULL prefix and file mean UCX's defaults and environment; config is an out pointer.
        unsafe { ffi::ucp_config_read(ptr::null(), ptr::null(), &mut ucx_config) }
            .result("ucp_config_read")?;
        // See `UcxConfig::tcp_native_put`. A user's own environment setting wins.
        if !config.tcp_native_put && std::env::var_os("UCX_TCP_PUT_ENABLE").is_none() {
            // SAFETY: ucx_config is live; both strings are NUL-terminated literals.
            let st = unsafe {
                ffi::ucp_config_modify(ucx_config, c"TCP_PUT_ENABLE".as_ptr(), c"n".as_ptr())
            };
            if !st.is_ok() {
                tracing::warn!(
                    status = st.0,
                    "cannot turn off UCX's TCP put; TCP transfers may crash"
                );
            }
        }
        // Endpoints resolve their remote id when created, not lazily mid-stream (see
        // `UcxConfig::tcp_native_put`). A user's own environment setting wins.
        if std::env::var_os("UCX_RESOLVE_REMOTE_EP_ID").is_none() {
            // SAFETY: ucx_config is live; both strings are NUL-terminated literals.
            let st = unsafe {
                ffi::ucp_config_modify(ucx_config, c"RESOLVE_REMOTE_EP_ID".as_ptr(), c"y".as_ptr())
            };
            if !st.is_ok() {
                tracing::warn!(
                    status = st.0,
                    "cannot make UCX resolve remote endpoints at creation; native TCP put may crash"
                );
            }
        }
        let mut ctx = ptr::null_mut();
        let t0 = std::time::Instant::now();
        // SAFETY: params is a valid, initialised struct; ucx_config is live; ctx is a valid out pointer.
        let st = unsafe { ffi::kvx_ucp_init(&params, ucx_config, &mut ctx) };
        // SAFETY: ucx_config came from ucp_config_read and is released once; ucp_init copied what it needs.
        unsafe { ffi::ucp_config_release(ucx_config) };
        st.result("ucp_init")?;
        let wparams = ffi::ucp_worker_params_t {
            field_mask: ffi::ucp_worker_params_field::UCP_WORKER_PARAM_FIELD_THREAD_MODE.0 as u64,
            thread_mode: ffi::ucs_thread_mode_t::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let _ = &config.name;
        let init_micros = super::micros_since(t0);
        let t1 = std::time::Instant::now();
        let mut worker = ptr::null_mut();
        // SAFETY: ctx is the live context created above; wparams is initialised; worker is an out pointer.
        if let Err(e) = unsafe { ffi::ucp_worker_create(ctx, &wparams, &mut worker) }
            .result("ucp_worker_create")
        {
            // SAFETY: ctx is live and owns nothing else yet.
            unsafe { ffi::ucp_cleanup(ctx) };
            return Err(e);
        }
        tracing::debug!(
            init_micros,
            worker_micros = super::micros_since(t1),
            "UCX context and worker created"
        );
        let efd = if config.events {
            Self::event_fd(worker, &shared)
        } else {
            None
        };
        let am_arg = Box::into_raw(Box::new(AmArg {
            sink: sink.clone(),
            shared: shared.clone(),
        }));
        let w = Box::new(Worker {
            ctx,
            worker,
            spin: config.spin,
            min_sleep: config.min_sleep,
            max_sleep: config.max_sleep,
            efd,
            event_timeout: config.event_timeout,
            peer_error_handling: config.peer_error_handling,
            direct_copy: config.direct_copy,
            sender_nice: config.sender_nice,
            reniced: false,
            regions: HashMap::new(),
            peers: HashMap::new(),
            next_id: 1,
            closes: Vec::new(),
            queue: Box::new(std::cell::RefCell::new(VecDeque::new())),
            am_arg,
            sink,
            shared,
        });
        let handler = ffi::ucp_am_handler_param_t {
            field_mask: (ffi::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ID
                | ffi::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_CB
                | ffi::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ARG)
                .0 as u64,
            id: NOTIFY_AM_ID,
            cb: Some(am_receive),
            arg: am_arg as *mut c_void,
            ..Default::default()
        };
        // SAFETY: worker is live; am_arg stays alive until after the worker is destroyed (Worker::close).
        unsafe { ffi::ucp_worker_set_am_recv_handler(w.worker, &handler) }
            .result("ucp_worker_set_am_recv_handler")?;
        Ok(w)
    }

    /// The worker's event fd, with the doorbell that wakes the thread from it; `None` (the thread
    /// then naps) if either cannot be had.
    fn event_fd(worker: ffi::ucp_worker_h, shared: &Shared) -> Option<std::os::fd::RawFd> {
        let mut fd: std::os::fd::RawFd = -1;
        // SAFETY: worker is live and was created on a context with UCP_FEATURE_WAKEUP; fd is an
        // out pointer. UCX owns the fd, which stays open until the worker is destroyed.
        let st = unsafe { ffi::ucp_worker_get_efd(worker, &mut fd) };
        if let Err(e) = st.result("ucp_worker_get_efd") {
            tracing::warn!(error = %e, "no UCX event fd: the idle progress thread naps instead");
            return None;
        }
        if let Err(e) = shared.open_doorbell() {
            tracing::warn!(error = %e, "no eventfd: the idle progress thread naps instead");
            return None;
        }
        Some(fd)
    }

    fn address(&mut self) -> Result<Vec<u8>, TransportError> {
        let mut addr = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: worker is live; both out pointers are valid.
        unsafe { ffi::ucp_worker_get_address(self.worker, &mut addr, &mut len) }
            .result("ucp_worker_get_address")?;
        // SAFETY: UCX returned `len` readable bytes at `addr`, valid until released just below.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: addr came from ucp_worker_get_address on this worker and is released once.
        unsafe { ffi::ucp_worker_release_address(self.worker, addr) };
        Ok(bytes)
    }

    fn run(&mut self, rx: &chan::Receiver<Cmd>) {
        let mut last_busy = Instant::now();
        let mut nap = self.min_sleep;
        loop {
            let mut busy = false;
            while let Ok(cmd) = rx.try_recv() {
                busy = true;
                if matches!(cmd, Cmd::Stop) {
                    return;
                }
                self.handle(cmd);
            }
            // SAFETY: the worker is live and used only by this thread.
            while unsafe { ffi::ucp_worker_progress(self.worker) } != 0 {
                busy = true;
            }
            busy |= self.drain_events();
            if busy {
                last_busy = Instant::now();
                nap = self.min_sleep;
                continue;
            }
            let ours_in_flight = self.shared.counters.in_flight.load(Ordering::Relaxed) > 0
                || !self.closes.is_empty();
            // With nothing of ours in flight, spin, then sleep until something arrives.
            if let Some(efd) = self.efd
                && !ours_in_flight
                && (last_busy.elapsed() < self.spin || self.sleep_on_events(rx, efd))
            {
                continue;
            }
            if self.shared.is_active() {
                // Traffic is expected: keep polling, but let the threads that produce it run.
                self.sleep(rx, self.min_sleep);
            } else if last_busy.elapsed() >= self.spin {
                self.sleep(rx, nap);
                nap = (nap * 2).min(self.max_sleep);
            }
        }
    }

    /// Sleeps up to `nap`, or until a command arrives.
    fn sleep(&mut self, rx: &chan::Receiver<Cmd>, nap: Duration) {
        self.shared.sleep(nap, || !rx.is_empty());
    }

    /// Sleeps on the worker's event fd until data arrives, a command is queued, or
    /// [`UcxConfig::event_timeout`] passes. Returns false if it could not (the caller naps).
    fn sleep_on_events(&mut self, rx: &chan::Receiver<Cmd>, efd: std::os::fd::RawFd) -> bool {
        let worker = self.worker;
        // SAFETY: UCX keeps the worker's event fd open until the worker is destroyed, which happens
        // on this thread after the loop ends; the borrow ends with this call.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(efd) };
        let mut arm_failed = false;
        let woken = self.shared.sleep_on(
            fd,
            self.event_timeout,
            || !rx.is_empty(),
            || {
                // SAFETY: the worker is live and used only by this thread, which progressed it
                // until it reported nothing more (ucp_worker_arm's precondition).
                let st = unsafe { ffi::ucp_worker_arm(worker) };
                // BUSY: events arrived since the last progress; progress again before sleeping.
                if !st.is_ok() && st != ffi::ucs_status_t::UCS_ERR_BUSY {
                    tracing::warn!(status = st.0, "ucp_worker_arm failed: napping instead");
                    arm_failed = true;
                }
                st.is_ok()
            },
        );
        woken == super::progress::Woken::Ok && !arm_failed
    }

    fn drain_events(&mut self) -> bool {
        let mut any = false;
        loop {
            let ev = self.queue.borrow_mut().pop_front();
            let Some(ev) = ev else { break };
            any = true;
            match ev {
                Event::OpDone(op, status) => self.op_done(op, status),
                Event::PeerError(peer, status) => self.peer_error(peer, status),
            }
        }
        let before = self.closes.len();
        self.closes.retain(|&req| {
            // SAFETY: req is a live close request we keep until it completes.
            let st = unsafe { ffi::ucp_request_check_status(req) };
            if st == ffi::ucs_status_t::UCS_INPROGRESS {
                true
            } else {
                // SAFETY: completed, and we never touch it again.
                unsafe { ffi::ucp_request_free(req) };
                false
            }
        });
        any || before != self.closes.len()
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register(mem, reply) => {
                let _ = reply.send(self.register(mem));
            }
            Cmd::Deregister(id, reply) => self.deregister(id, reply),
            Cmd::Allocate(len, reply) => {
                let _ = reply.send(self.allocate(len));
            }
            Cmd::Abandon(id) => {
                if let Some(r) = self.regions.get_mut(&id.0) {
                    r.abandoned = true;
                }
            }
            Cmd::Connect(meta, regions, key, reply) => {
                let _ = reply.send(self.connect(&meta, &regions, key));
            }
            Cmd::Disconnect(peer) => {
                if let Some(p) = self.peers.get_mut(&peer.0) {
                    p.closing = true;
                }
                self.maybe_close_peer(peer.0);
            }
            Cmd::Post(posts) => self.post_many(posts),
            Cmd::Stop => {}
        }
    }

    fn register(&mut self, mem: MemDesc) -> Result<(RegionId, RemoteRegion), TransportError> {
        let mem_type = match mem.kind() {
            MemKind::Host => ffi::ucs_memory_type::UCS_MEMORY_TYPE_HOST,
            MemKind::Cuda { .. } => ffi::ucs_memory_type::UCS_MEMORY_TYPE_CUDA,
        };
        let params = ffi::ucp_mem_map_params_t {
            field_mask: (ffi::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | ffi::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | ffi::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE)
                .0 as u64,
            address: mem.addr() as *mut c_void,
            length: mem.len() as usize,
            memory_type: mem_type,
            ..Default::default()
        };
        let mut memh = ptr::null_mut();
        // SAFETY: `Transport::register`'s caller promised the range is live memory of that kind
        // for the registration's life; ctx is live; memh is an out pointer.
        unsafe { ffi::ucp_mem_map(self.ctx, &params, &mut memh) }.result("ucp_mem_map")?;
        let host = matches!(mem.kind(), MemKind::Host);
        self.add_region(memh, mem.addr(), mem.len(), false, host)
    }

    /// Has UCX allocate `len` bytes of host memory and registers it: UCX takes it from a shared-memory
    /// segment where it can, which same-host peers map and write with user-space copies instead of a
    /// system call per write.
    fn allocate(&mut self, len: u64) -> Result<(RegionId, RemoteRegion), TransportError> {
        let params = ffi::ucp_mem_map_params_t {
            field_mask: (ffi::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | ffi::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | ffi::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_FLAGS
                | ffi::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE)
                .0 as u64,
            address: ptr::null_mut(),
            length: len as usize,
            flags: ffi::UCP_MEM_MAP_ALLOCATE,
            memory_type: ffi::ucs_memory_type::UCS_MEMORY_TYPE_HOST,
            ..Default::default()
        };
        let mut memh = ptr::null_mut();
        // SAFETY: ctx is live; with ALLOCATE and a null address UCX allocates the memory itself and
        // owns it until ucp_mem_unmap; memh is an out pointer.
        unsafe { ffi::ucp_mem_map(self.ctx, &params, &mut memh) }
            .result("ucp_mem_map(ALLOCATE)")?;
        let mut attr = ffi::ucp_mem_attr_t {
            field_mask: (ffi::ucp_mem_attr_field::UCP_MEM_ATTR_FIELD_ADDRESS
                | ffi::ucp_mem_attr_field::UCP_MEM_ATTR_FIELD_LENGTH)
                .0 as u64,
            ..Default::default()
        };
        // SAFETY: memh was just mapped on this context; attr is a valid out structure.
        let st = unsafe { ffi::ucp_mem_query(memh, &mut attr) };
        if let Err(e) = st.result("ucp_mem_query") {
            // SAFETY: memh is mapped and unused; unmapping frees what UCX allocated.
            unsafe { ffi::ucp_mem_unmap(self.ctx, memh) };
            return Err(e);
        }
        if attr.address.is_null() || (attr.length as u64) < len {
            // SAFETY: as above.
            unsafe { ffi::ucp_mem_unmap(self.ctx, memh) };
            return Err(TransportError::Library {
                op: "ucp_mem_query",
                code: 0,
                message: format!(
                    "allocated {} bytes at {:p}, asked for {len}",
                    attr.length, attr.address
                ),
            });
        }
        // Its pages are made by the caller ([`UcxTransport::allocate`]), not on this thread.
        self.add_region(memh, attr.address as u64, len, true, true)
    }

    /// Records a mapped region and packs its rkey; unmaps it if packing fails.
    fn add_region(
        &mut self,
        memh: ffi::ucp_mem_h,
        addr: u64,
        len: u64,
        allocated: bool,
        host: bool,
    ) -> Result<(RegionId, RemoteRegion), TransportError> {
        let mut buf = ptr::null_mut();
        let mut rkey_len = 0usize;
        // SAFETY: memh was just mapped on this context; out pointers are valid.
        let st = unsafe { ffi::ucp_rkey_pack(self.ctx, memh, &mut buf, &mut rkey_len) };
        if let Err(e) = st.result("ucp_rkey_pack") {
            // SAFETY: memh is mapped and unused.
            unsafe { ffi::ucp_mem_unmap(self.ctx, memh) };
            return Err(e);
        }
        // SAFETY: UCX returned `rkey_len` bytes at `buf`, released right after the copy.
        let rkey = unsafe { std::slice::from_raw_parts(buf as *const u8, rkey_len) }.to_vec();
        // SAFETY: buf came from ucp_rkey_pack and is released once.
        unsafe { ffi::ucp_rkey_buffer_release(buf) };
        let id = self.next_id;
        self.next_id += 1;
        self.regions.insert(
            id,
            Region {
                memh,
                addr,
                len,
                in_flight: 0,
                deregister: None,
                abandoned: false,
                allocated,
                host,
            },
        );
        let c = &self.shared.counters;
        c.regions.fetch_add(1, Ordering::Relaxed);
        c.registered_bytes.fetch_add(len, Ordering::Relaxed);
        Ok((RegionId(id), RemoteRegion { addr, len, rkey }))
    }

    fn deregister(&mut self, id: RegionId, reply: chan::Sender<Result<(), TransportError>>) {
        let Some(region) = self.regions.get_mut(&id.0) else {
            let _ = reply.send(Err(TransportError::UnknownRegion(id)));
            return;
        };
        if region.in_flight > 0 {
            // Writes from or to it are still running: unmap when the last one is over. A caller that
            // asks again (after its bounded wait ran out) takes over the answer; it is counted once.
            if region.deregister.replace(reply).is_none() {
                self.shared
                    .counters
                    .deferred
                    .fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        let _ = reply.send(self.unmap(id.0));
    }

    fn unmap(&mut self, id: u64) -> Result<(), TransportError> {
        let Some(region) = self.regions.remove(&id) else {
            return Err(TransportError::UnknownRegion(RegionId(id)));
        };
        let c = &self.shared.counters;
        c.regions.fetch_sub(1, Ordering::Relaxed);
        c.registered_bytes.fetch_sub(region.len, Ordering::Relaxed);
        // SAFETY: memh was mapped on this context and no posted write references it (in_flight == 0).
        unsafe { ffi::ucp_mem_unmap(self.ctx, region.memh) }.result("ucp_mem_unmap")
    }

    fn connect(
        &mut self,
        meta: &[u8],
        regions: &[RemoteRegion],
        key: u64,
    ) -> Result<PeerId, TransportError> {
        // UCX parses worker addresses and packed rkeys by lengths written inside them; its API takes no
        // buffer length. These bytes come only from a peer that proved the shared secret (the control
        // handshake authenticates before any Hello), and they are bounded here and copied into buffers
        // with 4 KiB of zeroed slack, so a truncated one makes UCX read zeros of ours rather than
        // foreign memory; an embedded length that lies by more than the slack is not caught: that is
        // the trust a peer holding the secret gets.
        if meta.is_empty() || meta.len() > MAX_PEER_BLOB {
            return Err(TransportError::BadMetadata(format!(
                "UCX worker address of {} bytes (1 to {MAX_PEER_BLOB} accepted)",
                meta.len()
            )));
        }
        if let Some(r) = regions.iter().find(|r| {
            r.rkey.is_empty() || r.rkey.len() > MAX_PEER_BLOB || r.addr.checked_add(r.len).is_none()
        }) {
            return Err(TransportError::BadMetadata(format!(
                "remote region at {:#x} of {} bytes with a packed rkey of {} bytes",
                r.addr,
                r.len,
                r.rkey.len()
            )));
        }
        let meta = padded(meta);
        let id = self.next_id;
        self.next_id += 1;
        let err_arg = Box::into_raw(Box::new(ErrArg {
            peer: id,
            queue: &*self.queue,
        }));
        let params = ffi::ucp_ep_params_t {
            field_mask: (ffi::ucp_ep_params_field::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | ffi::ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | ffi::ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLER)
                .0 as u64,
            address: meta.as_ptr() as *const ffi::ucp_address_t,
            err_mode: if self.peer_error_handling {
                ffi::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_PEER
            } else {
                ffi::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_NONE
            },
            err_handler: ffi::ucp_err_handler {
                cb: Some(ep_error),
                arg: err_arg as *mut c_void,
            },
            ..Default::default()
        };
        let mut ep = ptr::null_mut();
        // SAFETY: the worker is live; `meta` is an authenticated peer's worker address, bounded and
        // zero-padded above (UCX reads it by its own embedded lengths); err_arg lives until the ep is
        // closed.
        let st = unsafe { ffi::ucp_ep_create(self.worker, &params, &mut ep) };
        if let Err(e) = st.result("ucp_ep_create") {
            // SAFETY: the endpoint was not created, so nothing else holds err_arg.
            drop(unsafe { Box::from_raw(err_arg) });
            return Err(e);
        }
        let mut peer = Peer {
            ep,
            key,
            remote: Vec::new(),
            failed: None,
            in_flight: 0,
            closing: true,
            counted: false,
            err_arg,
        };
        for r in regions {
            let packed = padded(&r.rkey);
            // What was mapped before the unpack, so that only the mapping it makes can take direct
            // copies (see `mapped`).
            let before = if self.direct_copy {
                shared_mappings()
            } else {
                None
            };
            let mut rkey = ptr::null_mut();
            // SAFETY: ep is live; the packed key is an authenticated peer's, bounded and zero-padded
            // above (UCX reads it by its own encoded lengths), and `packed` lives for the call.
            let st =
                unsafe { ffi::ucp_ep_rkey_unpack(ep, packed.as_ptr() as *const c_void, &mut rkey) };
            if let Err(e) = st.result("ucp_ep_rkey_unpack") {
                self.peers.insert(id, peer);
                self.maybe_close_peer(id);
                return Err(e);
            }
            let direct = match &before {
                Some(before) => mapped(rkey, r.addr, r.len, before),
                None => ptr::null_mut(),
            };
            if !direct.is_null() {
                self.shared
                    .counters
                    .direct_regions
                    .fetch_add(1, Ordering::Relaxed);
            }
            peer.remote.push(RemoteKey {
                addr: r.addr,
                len: r.len,
                rkey,
                direct,
            });
        }
        peer.closing = false;
        peer.counted = true;
        self.peers.insert(id, peer);
        self.shared.counters.peers.fetch_add(1, Ordering::Relaxed);
        Ok(PeerId(id))
    }

    /// Closes a peer marked closing once nothing posted to it is running.
    fn maybe_close_peer(&mut self, id: u64) {
        let Some(p) = self.peers.get(&id) else { return };
        if !p.closing || p.in_flight > 0 {
            return;
        }
        let Some(p) = self.peers.remove(&id) else {
            return;
        };
        for r in &p.remote {
            if !r.direct.is_null() {
                self.shared
                    .counters
                    .direct_regions
                    .fetch_sub(1, Ordering::Relaxed);
            }
            // SAFETY: rkey was unpacked on this ep and no posted write uses it any more (in_flight ==
            // 0); its mapping (`direct`) is not used after this.
            unsafe { ffi::ucp_rkey_destroy(r.rkey) };
        }
        let param = if self.peer_error_handling {
            ffi::ucp_request_param_t {
                op_attr_mask: ffi::ucp_op_attr_t::UCP_OP_ATTR_FIELD_FLAGS.0,
                flags: ffi::ucp_ep_close_flags_t::UCP_EP_CLOSE_FLAG_FORCE.0,
                ..Default::default()
            }
        } else {
            // A flushing close; FORCE is only valid with peer error handling.
            ffi::ucp_request_param_t::default()
        };
        // SAFETY: ep is live and closed once; FORCE is only used when it was created with peer error
        // handling.
        let req = unsafe { ffi::ucp_ep_close_nbx(p.ep, &param) };
        // SAFETY: plain pointer classification.
        if unsafe { ffi::kvx_ucs_ptr_is_ptr(req) } != 0 {
            self.closes.push(req);
        }
        // The error handler cannot fire for a closed endpoint; events it queued earlier name the peer
        // id only, so freeing its argument now is sound.
        // SAFETY: err_arg was leaked for this ep in connect and is freed once, here.
        drop(unsafe { Box::from_raw(p.err_arg) });
        if p.counted {
            self.shared.counters.peers.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Checks a post before anything of it moves: a live peer, known regions, every row inside
    /// both sides. Returns the local regions it reads and its bytes, or the error its `done` gets.
    fn validate(&self, post: &Post) -> Result<(Vec<u64>, u64), TransportError> {
        let peer = post.peer;
        let p = self
            .peers
            .get(&peer.0)
            .filter(|p| !p.closing)
            .ok_or(TransportError::UnknownPeer(peer))?;
        if let Some(reason) = &p.failed {
            return Err(TransportError::PeerFailed {
                peer,
                reason: reason.clone(),
            });
        }
        let mut regions: Vec<u64> = Vec::new();
        let mut bytes = 0u64;
        for w in &post.writes {
            let r = self
                .regions
                .get(&w.local.0)
                .ok_or(TransportError::UnknownRegion(w.local))?;
            let fits = p
                .remote
                .get(w.remote as usize)
                .is_some_and(|rr| w.fits(r.len, rr.len));
            if !fits || r.deregister.is_some() {
                return Err(TransportError::OutOfBounds(format!("{w:?}")));
            }
            if !regions.contains(&w.local.0) {
                regions.push(w.local.0);
            }
            bytes += w.bytes();
        }
        Ok((regions, bytes))
    }

    /// Where a validated write is copied by us: its source's address and the peer's region mapped
    /// here, or `None` when it goes through a put (a region UCX did not map, a device source).
    fn direct_target(&self, peer: PeerId, w: &WriteOp) -> Option<(u64, *mut u8)> {
        let r = self.regions.get(&w.local.0)?;
        let rr = self.peers.get(&peer.0)?.remote.get(w.remote as usize)?;
        (!rr.direct.is_null() && r.host).then_some((r.addr, rr.direct))
    }

    /// Makes the direct copies of validated posts. The `j`-th writes of the posts are copied
    /// together, row by row in turn, where they have the same rows and row length: a prefill
    /// rank's legs into several decode TP ranks are planned alike, and each leg's row is a slice
    /// of one source token row, so the source is read once, in order, instead of once per leg
    /// with a stride. Returns whether streaming stores were used (a fence is then due).
    fn copy_direct(&self, posts: &[&Post]) -> bool {
        // This thread's CPU time, not the wall clock: on busy cores a copy may wait for a core.
        let cpu = || rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        let started = cpu();
        let mut copied = false;
        let mut streamed = false;
        let most = posts.iter().map(|p| p.writes.len()).max().unwrap_or(0);
        let mut group: Vec<(u64, *mut u8, WriteOp)> = Vec::with_capacity(posts.len());
        for j in 0..most {
            group.clear();
            for p in posts {
                if let Some(w) = p.writes.get(j)
                    && let Some((src, dst)) = self.direct_target(p.peer, w)
                {
                    group.push((src, dst, *w));
                }
            }
            copied |= !group.is_empty();
            let together = group.len() > 1
                && group[0].2.rows > 1
                && group
                    .iter()
                    .all(|g| (g.2.rows, g.2.len) == (group[0].2.rows, group[0].2.len));
            if together {
                for i in 0..group[0].2.rows {
                    for &(src, dst, w) in &group {
                        // SAFETY: row `i < w.rows` (every write of the group has as many) of a write
                        // `validate` checked.
                        streamed |= unsafe { copy_row(src, dst, &w, i, false) };
                    }
                }
            } else {
                for &(src, dst, w) in &group {
                    for i in 0..w.rows {
                        // SAFETY: row `i < w.rows` of a write `validate` checked.
                        streamed |= unsafe { copy_row(src, dst, &w, i, true) };
                    }
                }
            }
        }
        if copied {
            let (end, start) = (cpu(), started);
            let ns = (end.tv_sec - start.tv_sec) * 1_000_000_000 + (end.tv_nsec - start.tv_nsec);
            let ns = u64::try_from(ns).unwrap_or(0);
            self.shared
                .counters
                .copy_nanos
                .fetch_add(ns, Ordering::Relaxed);
        }
        streamed
    }

    fn post_many(&mut self, posts: Vec<Post>) {
        if !self.reniced {
            self.reniced = true;
            lower_thread_priority(self.sender_nice);
        }
        // Validate each post before anything moves, so a bad write list posts nothing.
        let mut ready: Vec<(Post, Vec<u64>, u64)> = Vec::with_capacity(posts.len());
        for post in posts {
            match self.validate(&post) {
                Ok((regions, bytes)) => ready.push((post, regions, bytes)),
                Err(e) => (post.done)(Err(e)),
            }
        }
        let refs: Vec<&Post> = ready.iter().map(|(p, _, _)| p).collect();
        if self.copy_direct(&refs) {
            store_fence();
        }
        for (post, regions, bytes) in ready {
            self.put_and_flush(post, regions, bytes);
        }
    }

    /// The rest of a validated post whose direct copies are made: a put for every other row, then
    /// the flush and the notification.
    fn put_and_flush(&mut self, post: Post, regions: Vec<u64>, bytes: u64) {
        let Post {
            peer,
            writes,
            notification,
            done,
        } = post;
        let Some(p) = self.peers.get(&peer.0) else {
            done(Err(TransportError::UnknownPeer(peer)));
            return;
        };
        let mut message = Vec::with_capacity(8 + notification.len());
        message.extend_from_slice(&p.key.to_le_bytes());
        message.extend_from_slice(&notification);
        let ep = p.ep;
        let mut error = None;
        for w in &writes {
            let (Some(r), Some(rr)) = (
                self.regions.get(&w.local.0),
                p.remote.get(w.remote as usize),
            ) else {
                break;
            };
            if !rr.direct.is_null() && r.host {
                continue;
            }
            let param = ffi::ucp_request_param_t {
                op_attr_mask: ffi::ucp_op_attr_t::UCP_OP_ATTR_FIELD_MEMH.0,
                memh: r.memh,
                ..Default::default()
            };
            for (lo, ro) in w.pieces() {
                // SAFETY: every row's source and destination ranges were bounds-checked against the
                // registration and the peer's region (`validate`); the registration stays mapped
                // until this op is over (in_flight is raised below before the worker can
                // progress); rkey belongs to this ep.
                let req = unsafe {
                    ffi::ucp_put_nbx(
                        ep,
                        (r.addr + lo) as *const c_void,
                        w.len as usize,
                        rr.addr + ro,
                        rr.rkey,
                        &param,
                    )
                };
                // SAFETY: plain pointer classification of UCX's return value.
                if unsafe { ffi::kvx_ucs_ptr_is_err(req) } != 0 {
                    // SAFETY: as above.
                    error = Some(status_error("ucp_put_nbx", unsafe {
                        ffi::kvx_ucs_ptr_raw_status(req)
                    }));
                    break;
                }
                // SAFETY: as above.
                if unsafe { ffi::kvx_ucs_ptr_is_ptr(req) } != 0 {
                    // The put finishes on its own; the flush below waits for it.
                    // SAFETY: req is a live request we do not use again.
                    unsafe { ffi::ucp_request_free(req) };
                }
            }
            if error.is_some() {
                break;
            }
        }
        for id in &regions {
            if let Some(r) = self.regions.get_mut(id) {
                r.in_flight += 1;
            }
        }
        if let Some(p) = self.peers.get_mut(&peer.0) {
            p.in_flight += 1;
        }
        let c = &self.shared.counters;
        c.in_flight.fetch_add(1, Ordering::Relaxed);
        c.bytes_posted.fetch_add(bytes, Ordering::Relaxed);
        let op = Box::new(Op {
            stage: Stage::Flush,
            peer: peer.0,
            regions,
            message,
            done: Some(done),
            error,
            queue: &*self.queue,
        });
        // Even after a failed put we flush, so no write still lands when `done` reports the failure.
        self.start_flush(ep, op);
    }

    fn request_param(op: &mut Op) -> ffi::ucp_request_param_t {
        let mut param = ffi::ucp_request_param_t {
            op_attr_mask: (ffi::ucp_op_attr_t::UCP_OP_ATTR_FIELD_CALLBACK
                | ffi::ucp_op_attr_t::UCP_OP_ATTR_FIELD_USER_DATA)
                .0,
            user_data: op as *mut Op as *mut c_void,
            ..Default::default()
        };
        param.cb.send = Some(op_callback);
        param
    }

    fn start_flush(&mut self, ep: ffi::ucp_ep_h, mut op: Box<Op>) {
        let param = Self::request_param(&mut op);
        let raw = Box::into_raw(op);
        // SAFETY: ep is live; the callback takes the Box<Op> back exactly once if a request is returned.
        let req = unsafe { ffi::ucp_ep_flush_nbx(ep, &param) };
        self.after_submit(req, raw, "ucp_ep_flush_nbx");
    }

    /// Handles what a submit call returned: a request (the callback will run), or immediate completion.
    fn after_submit(&mut self, req: ffi::ucs_status_ptr_t, raw: *mut Op, op_name: &'static str) {
        // SAFETY: plain pointer classification.
        if unsafe { ffi::kvx_ucs_ptr_is_ptr(req) } != 0 {
            return;
        }
        // No request: UCX will not call the callback, so the op is ours again.
        // SAFETY: raw came from Box::into_raw just before the call, and no callback will take it.
        let op = unsafe { Box::from_raw(raw) };
        // SAFETY: plain pointer classification.
        let status = unsafe { ffi::kvx_ucs_ptr_raw_status(req) };
        let _ = op_name;
        self.op_done(op, status);
    }

    fn op_done(&mut self, mut op: Box<Op>, status: ffi::ucs_status_t) {
        if !status.is_ok() && op.error.is_none() {
            let what = if op.stage == Stage::Flush {
                "ucp_ep_flush_nbx"
            } else {
                "ucp_am_send_nbx"
            };
            op.error = Some(
                match self.peers.get(&op.peer).and_then(|p| p.failed.clone()) {
                    Some(reason) => TransportError::PeerFailed {
                        peer: PeerId(op.peer),
                        reason,
                    },
                    None => status_error(what, status),
                },
            );
        }
        // A post without a notification (only the 8-byte key) is over once its writes are.
        if op.stage == Stage::Flush && op.error.is_none() && op.message.len() > 8 {
            let Some(ep) = self.peers.get(&op.peer).map(|p| p.ep) else {
                op.error = Some(TransportError::UnknownPeer(PeerId(op.peer)));
                return self.finish(op);
            };
            op.stage = Stage::Notify;
            let mut param = Self::request_param(&mut op);
            param.op_attr_mask |= ffi::ucp_op_attr_t::UCP_OP_ATTR_FIELD_FLAGS.0;
            param.flags = ffi::ucp_send_am_flags::UCP_AM_SEND_FLAG_EAGER.0;
            let (data, len) = (op.message.as_ptr(), op.message.len());
            let raw = Box::into_raw(op);
            // SAFETY: ep is live; the message bytes live in the boxed op, which stays allocated until
            // the callback (or the immediate completion below) hands it back.
            let req = unsafe {
                ffi::ucp_am_send_nbx(
                    ep,
                    NOTIFY_AM_ID,
                    ptr::null(),
                    0,
                    data as *const c_void,
                    len,
                    &param,
                )
            };
            return self.after_submit(req, raw, "ucp_am_send_nbx");
        }
        self.finish(op);
    }

    // The op arrives boxed from UCX's callback; unboxing it would only copy it.
    #[allow(clippy::boxed_local)]
    fn finish(&mut self, mut op: Box<Op>) {
        self.shared
            .counters
            .in_flight
            .fetch_sub(1, Ordering::Relaxed);
        // The owner hears first, so a deregistration that waited for this op returns after it.
        if let Some(done) = op.done.take() {
            done(match op.error.take() {
                Some(e) => Err(e),
                None => Ok(()),
            });
        }
        let mut unmaps = Vec::new();
        for id in &op.regions {
            if let Some(r) = self.regions.get_mut(id) {
                r.in_flight -= 1;
                if r.in_flight == 0 && r.deregister.is_some() {
                    unmaps.push(*id);
                }
            }
        }
        for id in unmaps {
            let reply = self.regions.get_mut(&id).and_then(|r| r.deregister.take());
            let res = self.unmap(id);
            self.shared
                .counters
                .deferred
                .fetch_sub(1, Ordering::Relaxed);
            if let Some(reply) = reply {
                let _ = reply.send(res);
            }
        }
        if let Some(p) = self.peers.get_mut(&op.peer) {
            p.in_flight -= 1;
        }
        self.maybe_close_peer(op.peer);
    }

    fn peer_error(&mut self, peer: u64, status: ffi::ucs_status_t) {
        let reason = status_error("endpoint", status).to_string();
        if let Some(p) = self.peers.get_mut(&peer)
            && p.failed.is_none()
        {
            {
                p.failed = Some(reason.clone());
                (self.sink)(Incoming::PeerFailed {
                    peer: PeerId(peer),
                    reason,
                });
            }
        }
    }

    fn close(mut self: Box<Self>) {
        // Let posted chunks finish (bounded), so their Done callbacks run and their memory is released.
        let deadline = Instant::now() + SHUTDOWN_BOUND;
        while self.shared.counters.in_flight.load(Ordering::Relaxed) > 0
            && Instant::now() < deadline
        {
            // SAFETY: the worker is live and owned by this thread.
            unsafe { ffi::ucp_worker_progress(self.worker) };
            self.drain_events();
        }
        if self.shared.counters.in_flight.load(Ordering::Relaxed) > 0 {
            // UCX still owns operations that use our endpoints, rkeys and memory handles; destroying any
            // of them (or the worker) now is what UCX forbids. Leak them all instead.
            return self.leak("operations still in flight past the shutdown bound");
        }
        let ids: Vec<u64> = self.peers.keys().copied().collect();
        for id in ids {
            if let Some(p) = self.peers.get_mut(&id) {
                p.closing = true;
            }
            self.maybe_close_peer(id);
        }
        let deadline = Instant::now() + SHUTDOWN_BOUND;
        while !self.closes.is_empty() && Instant::now() < deadline {
            // SAFETY: as above.
            unsafe { ffi::ucp_worker_progress(self.worker) };
            self.drain_events();
        }
        if !self.closes.is_empty() {
            return self.leak("endpoint closes still pending past the shutdown bound");
        }
        let ids: Vec<u64> = self.regions.keys().copied().collect();
        for id in ids {
            if let Some(reply) = self.regions.get_mut(&id).and_then(|r| r.deregister.take()) {
                let _ = reply.send(Err(TransportError::Shutdown));
            }
            if self
                .regions
                .get(&id)
                .is_some_and(|r| r.abandoned || r.allocated)
            {
                // A peer may still write into it, or (memory UCX allocated) its owner's
                // `Registration` still reads and writes it, and unmapping would free it: its memory
                // handle and the memory stay for the rest of the process. The owner's own
                // deregistration then hears `Shutdown` and leaks its side too.
                self.shared.counters.leaked.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let _ = self.unmap(id);
        }
        // SAFETY: no operation is in flight, every endpoint is closed (its close completed) and every
        // region unmapped; the worker is destroyed once.
        unsafe { ffi::ucp_worker_destroy(self.worker) };
        // SAFETY: the worker was the last user of the AM argument.
        drop(unsafe { Box::from_raw(self.am_arg) });
        // SAFETY: the context's only worker is destroyed.
        unsafe { ffi::ucp_cleanup(self.ctx) };
    }

    /// Gives up on an orderly close: every endpoint, rkey, memory handle, the worker and the context
    /// stay allocated for the rest of the process, counted in `TransportStats::leaked_handles`.
    /// Owners waiting on a deregistration hear `Shutdown`, so they leak their memory too.
    fn leak(mut self: Box<Self>, why: &'static str) {
        let rkeys: usize = self.peers.values().map(|p| p.remote.len()).sum();
        let handles = self.peers.len() + rkeys + self.regions.len() + 2;
        self.shared
            .counters
            .leaked
            .fetch_add(handles as u64, Ordering::Relaxed);
        tracing::warn!(
            why,
            endpoints = self.peers.len(),
            rkeys,
            memory_handles = self.regions.len(),
            "leaking UCX handles instead of destroying them under possible operations"
        );
        for r in self.regions.values_mut() {
            if let Some(reply) = r.deregister.take() {
                let _ = reply.send(Err(TransportError::Shutdown));
            }
        }
        std::mem::forget(self);
    }
}

#[cfg(test)]
mod tests {
    use super::{made_for_rkey, shared_mapping};

    #[test]
    fn direct_copies_go_only_into_the_mapping_made_for_the_rkey() {
        let before = [(0x1000, 0x5000), (0x9000, 0xa000)];
        let now = [(0x1000, 0x5000), (0x6000, 0x8000), (0x9000, 0xa000)];
        // Inside the new mapping.
        assert!(made_for_rkey(&before, &now, 0x6000, 0x8000));
        assert!(made_for_rkey(&before, &now, 0x6100, 0x6200));
        // Inside a mapping that was there before the unpack (UCX's queues, our pools, another
        // peer's): refused even though it is shared and writable.
        assert!(!made_for_rkey(&before, &now, 0x2000, 0x3000));
        assert!(!made_for_rkey(&before, &now, 0x9000, 0xa000));
        // Past the new mapping's end, or across two mappings.
        assert!(!made_for_rkey(&before, &now, 0x7000, 0x8001));
        assert!(!made_for_rkey(&before, &now, 0x4000, 0x7000));
    }

    #[test]
    fn only_shared_writable_mappings_count() {
        let line = |perms: &str| format!("7f00a000-7f00c000 {perms} 00000000 00:01 42 /dev/shm/x");
        assert_eq!(
            shared_mapping(&line("rw-s")),
            Some((0x7f00_a000, 0x7f00_c000))
        );
        assert_eq!(shared_mapping(&line("rw-p")), None);
        assert_eq!(shared_mapping(&line("r--s")), None);
        assert_eq!(shared_mapping("garbage"), None);
    }
}
