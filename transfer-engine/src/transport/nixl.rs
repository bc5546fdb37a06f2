//! The NIXL backend: a NIXL agent with its UCX plugin writes the pages, NIXL's own notification follows.
//!
//! One progress thread owns the agent, created there without NIXL's progress thread (which halves
//! throughput on small machines); every other thread talks to it through a command queue. Callers that
//! need an answer (register, metadata, connect, deregister) block on a bounded reply; posts are
//! fire-and-forget with a [`Done`] callback, run on the progress thread.
//!
//! A chunk goes out as one NIXL `WRITE` request whose optional arguments carry the notification bytes,
//! exactly as given (a Python NIXL peer sees them unchanged). NIXL sends the notification once the
//! request's writes are complete, so the receiver never sees a notification before its bytes. A chunk
//! with no bytes to move but a notification goes out as `gen_notif`; an empty notification means "no
//! notification" (NIXL cannot tell an empty message from none to a Python peer either).
//!
//! Without its progress thread NIXL moves only when polled, and every agent involved must be polled,
//! the target as well as the initiator, or not even connection setup completes. So the thread polls
//! every in-flight request (`get_xfer_status`) and the agent's notifications (`get_notifs`) on each
//! turn, and keeps polling while idle: it spins for [`NixlConfig::spin`] after the last event, then
//! parks for a time growing from [`NixlConfig::min_sleep`] to [`NixlConfig::max_sleep`]. NIXL gives
//! no event fd to wake on, so the sleep is bounded; command senders unpark the thread only when it is
//! asleep, so a busy engine pays no system call per command. While requests of ours are in flight,
//! every nap is [`NixlConfig::min_sleep`], because their completion is only seen by polling; while
//! the owner says notifications are expected (`Transport::set_active`), naps grow only to
//! [`NixlConfig::expecting_max_sleep`].
//!
//! NIXL's metadata carries the agent's registrations, so a peer must fetch [`Transport::metadata`]
//! after registering the regions it will be written into; [`Transport::connect`] checks that the
//! metadata covers every region it is given and learns each region's memory kind and device from it.
//!
//! This is the only module of the crate that calls NIXL.

use super::progress::{Handle, ProgressScheduling, Shared};
use super::{
    BackendKind, Done, Incoming, PeerId, RegionId, RemoteRegion, Sender, Sink, Transport,
    TransportError, TransportStats, WriteOp,
};
use crate::mem::{MemDesc, MemKind};
use crossbeam_channel as chan;
use nixl_sys as ffi;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_void};
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a blocking call waits for the progress thread before calling it dead.
/// How long shutdown waits for posted chunks before releasing their requests under them.
const SHUTDOWN_BOUND: Duration = Duration::from_secs(5);
/// The plugin every agent of this transport uses.
const UCX_PLUGIN: &CStr = c"UCX";
/// CUDA device ordinals tried when learning which device a peer's VRAM region lives on.
const MAX_PROBED_DEVICES: u64 = 64;

/// Settings of a [`NixlTransport`].
#[derive(Clone, Debug)]
pub struct NixlConfig {
    /// The agent's name. Peers see it as the sender of our notifications and it must be unique among
    /// the agents that load each other's metadata. The default is `kvx-<host>-<pid>-<n>`.
    pub name: String,
    /// How long the progress thread keeps polling after its last event before it starts sleeping.
    pub spin: Duration,
    /// First sleep of an idle progress thread.
    pub min_sleep: Duration,
    /// Longest sleep of an idle progress thread: the worst extra latency an idle transport adds to a
    /// notification or to a peer's connection setup.
    pub max_sleep: Duration,
    /// Longest sleep while the owner expects notifications and no transfer of ours is in flight:
    /// naps grow from [`min_sleep`](Self::min_sleep) to this while nothing arrives, so an engine that
    /// waits for a prefill's compute does not poll NIXL tens of thousands of times a second.
    pub expecting_max_sleep: Duration,
    /// Parameters of the UCX backend that replace the plugin's defaults (for instance
    /// `("num_workers", "2")`).
    pub backend_params: Vec<(String, String)>,
    /// The nice value the progress thread takes when it posts its first write, as the UCX backend's
    /// [`UcxConfig::sender_nice`](super::ucx::UcxConfig::sender_nice); 0 leaves it as it is.
    pub sender_nice: i32,
    /// How the system schedules the progress thread (see [`ProgressScheduling`]).
    pub scheduling: ProgressScheduling,
    /// Bytes of host memory, allocated and registered with the agent at the first write that needs
    /// them, into which the progress thread copies a write's rows when they are strided in host
    /// memory here and contiguous at the peer: the write is then one descriptor instead of one
    /// per row (NIXL's descriptors are contiguous ranges). A write that finds no room left goes row
    /// by row. 0: never.
    pub staging_bytes: u64,
}

/// [`NixlConfig::staging_bytes`] by default.
pub const STAGING_BYTES: u64 = 128 << 20;

impl Default for NixlConfig {
    fn default() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let mut host = [0u8; 64];
        // SAFETY: gethostname writes at most `host.len()` bytes into the live local buffer.
        let rc = unsafe { libc::gethostname(host.as_mut_ptr() as *mut libc::c_char, host.len()) };
        let host = if rc == 0 {
            let end = host.iter().position(|&b| b == 0).unwrap_or(host.len());
            String::from_utf8_lossy(&host[..end]).into_owned()
        } else {
            "host".into()
        };
        NixlConfig {
            name: format!(
                "kvx-{host}-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ),
            spin: Duration::from_micros(200),
            min_sleep: Duration::from_micros(20),
            max_sleep: Duration::from_millis(1),
            expecting_max_sleep: Duration::from_micros(250),
            backend_params: Vec::new(),
            sender_nice: super::ucx::SENDER_NICE,
            scheduling: ProgressScheduling::Normal,
            staging_bytes: STAGING_BYTES,
        }
    }
}

/// What NIXL's C API means by a status; it has no string function of its own.
fn status_message(status: ffi::nixl_capi_status_t) -> &'static str {
    match status {
        ffi::NIXL_CAPI_SUCCESS => "success",
        ffi::NIXL_CAPI_IN_PROG => "in progress",
        ffi::NIXL_CAPI_ERROR_INVALID_PARAM => "invalid parameter",
        ffi::NIXL_CAPI_ERROR_BACKEND => {
            "NIXL error (the C API folds backend, remote-disconnect, mismatch and other errors into this code)"
        }
        ffi::NIXL_CAPI_ERROR_INVALID_STATE => "invalid state",
        ffi::NIXL_CAPI_ERROR_EXCEPTION => "exception",
        ffi::NIXL_CAPI_ERROR_NO_TELEMETRY => "no telemetry",
        ffi::NIXL_CAPI_ERROR_NOT_FOUND => {
            "not found (remote metadata not loaded, or no backend serves the request)"
        }
        _ => "unknown NIXL status",
    }
}

fn status_error(op: &'static str, status: ffi::nixl_capi_status_t) -> TransportError {
    TransportError::Library {
        op,
        code: i64::from(status),
        message: status_message(status).to_owned(),
    }
}

/// A NIXL status as a `Result`, the one place where that conversion happens. `IN_PROG` is not an
/// error, but no call that can return it goes through here.
trait StatusExt {
    fn result(self, op: &'static str) -> Result<(), TransportError>;
}

impl StatusExt for ffi::nixl_capi_status_t {
    fn result(self, op: &'static str) -> Result<(), TransportError> {
        if self == ffi::NIXL_CAPI_SUCCESS {
            Ok(())
        } else {
            Err(status_error(op, self))
        }
    }
}

/// Whether a failed call names a problem of the peer (or of our link to it) rather than our own misuse.
fn blames_peer(err: &TransportError) -> bool {
    matches!(err, TransportError::Library { code, .. } if *code != i64::from(ffi::NIXL_CAPI_ERROR_INVALID_PARAM))
}

enum Cmd {
    Register(
        MemDesc,
        chan::Sender<Result<(RegionId, RemoteRegion), TransportError>>,
    ),
    Deregister(RegionId, chan::Sender<Result<(), TransportError>>),
    Metadata(chan::Sender<Result<Vec<u8>, TransportError>>),
    Connect(
        Vec<u8>,
        Vec<RemoteRegion>,
        chan::Sender<Result<PeerId, TransportError>>,
    ),
    Disconnect(PeerId),
    Post(PeerId, Vec<WriteOp>, Vec<u8>, Done),
    Stop,
}

impl Cmd {
    /// Answers a command the progress thread will never run.
    fn refuse(self) {
        match self {
            Cmd::Register(_, r) => drop(r.send(Err(TransportError::Shutdown))),
            Cmd::Deregister(_, r) => drop(r.send(Err(TransportError::Shutdown))),
            Cmd::Metadata(r) => drop(r.send(Err(TransportError::Shutdown))),
            Cmd::Connect(_, _, r) => drop(r.send(Err(TransportError::Shutdown))),
            Cmd::Post(_, _, _, done) => done(Err(TransportError::Shutdown)),
            Cmd::Disconnect(_) | Cmd::Stop => {}
        }
    }
}

/// The NIXL transport. Cheap to share behind an `Arc`; every method may be called from any thread.
pub struct NixlTransport {
    thread: Handle<Cmd>,
    name: String,
}

impl std::fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransport")
            .field("name", &self.name)
            .field("stats", &self.stats())
            .finish()
    }
}

impl NixlTransport {
    /// Starts a NIXL agent named [`NixlConfig::name`] with a UCX backend on a new progress thread.
    /// Received notifications and peer failures go to `sink`, called on that thread.
    ///
    /// # Errors
    /// The agent or its UCX backend failing to start (with NIXL's status), a name with a NUL byte, or
    /// two different UCX libraries loaded in the process once NIXL's UCX plugin is in
    /// ([`TransportError::TwoUcxLibraries`]).
    pub fn new(config: NixlConfig, sink: Sink) -> Result<Self, TransportError> {
        // Before NIXL starts its UCX: with a second UCX already loaded, the plugin's ucp_init spins
        // for ever, so the check after the plugin is in would never be reached.
        super::ucx::prepare_process()?;
        let name = config.name.clone();
        let thread_name = format!("nixl-{}", config.name);
        let (thread, ()) = Handle::spawn(
            thread_name,
            config.scheduling,
            || Cmd::Stop,
            move |(shared, rx, ready)| {
                match Worker::start(&config, sink, shared) {
                    Ok(mut w) => {
                        let _ = ready.send(Ok(()));
                        w.run(&rx);
                        w.close();
                        // Whatever was queued after Stop is answered, so no caller waits for nothing.
                        while let Ok(cmd) = rx.try_recv() {
                            cmd.refuse();
                        }
                    }
                    Err(e) => {
                        let _ = ready.send(Err(e));
                    }
                }
            },
        )?;
        Ok(NixlTransport { thread, name })
    }

    fn call<T>(
        &self,
        make: impl FnOnce(chan::Sender<Result<T, TransportError>>) -> Cmd,
    ) -> Result<T, TransportError> {
        self.thread.call(make)
    }

    /// Stops the progress thread: waits (bounded) for posted chunks, then releases every request,
    /// forgets every peer, deregisters every region and destroys the agent. Also done on drop.
    pub fn shutdown(&self) {
        self.thread.shutdown();
    }
}

impl Transport for NixlTransport {
    fn kind(&self) -> BackendKind {
        BackendKind::Nixl
    }

    /// The agent's metadata, fetched fresh: it lists the registrations made so far.
    fn metadata(&self) -> Result<Vec<u8>, TransportError> {
        self.call(Cmd::Metadata)
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    unsafe fn register(&self, mem: MemDesc) -> Result<(RegionId, RemoteRegion), TransportError> {
        // The caller's promise (`Transport::register`'s `# Safety`) travels with the command.
        self.call(|tx| Cmd::Register(mem, tx))
    }

    unsafe fn deregister(&self, id: RegionId) -> Result<(), TransportError> {
        // The caller's promise (`Transport::deregister`'s `# Safety`) travels with the command.
        self.call(|tx| Cmd::Deregister(id, tx))
    }

    /// `key` is not used: NIXL names the sender of every notification ([`Sender::Agent`]).
    fn connect(
        &self,
        metadata: &[u8],
        regions: &[RemoteRegion],
        _key: u64,
    ) -> Result<PeerId, TransportError> {
        self.call(|tx| Cmd::Connect(metadata.to_vec(), regions.to_vec(), tx))
    }

    fn disconnect(&self, peer: PeerId) {
        let _ = self.thread.send(Cmd::Disconnect(peer));
    }

    fn post(&self, peer: PeerId, writes: Vec<WriteOp>, notification: Vec<u8>, done: Done) {
        if let Err(cmd) = self
            .thread
            .send(Cmd::Post(peer, writes, notification, done))
        {
            cmd.refuse();
        }
    }

    fn stats(&self) -> TransportStats {
        self.thread.shared.stats()
    }

    fn set_active(&self, active: bool) {
        self.thread.shared.set_active(active);
    }
}

// ---------------------------------------------------------------------------------------------------
// The progress thread's side. Nothing below leaves that thread: NIXL handles are raw pointers, so the
// types holding them are neither Send nor Sync, and the agent runs with THREAD_SYNC_NONE (no locks),
// which is sound because only this thread ever calls it.

/// Owners of NIXL's small heap objects, each destroyed once on drop.
macro_rules! owned_handle {
    ($(#[$doc:meta])* $name:ident: $raw:ty => $destroy:path) => {
        $(#[$doc])*
        struct $name($raw);

        impl Drop for $name {
            fn drop(&mut self) {
                if !self.0.is_null() {
                    // SAFETY: the handle was returned by NIXL's matching create call, this value is its
                    // only owner, and drop runs once; every call that borrowed it has returned.
                    unsafe { $destroy(self.0) };
                }
            }
        }
    };
}

owned_handle!(
    /// A transfer descriptor list.
    XferList: ffi::nixl_capi_xfer_dlist_t => ffi::nixl_capi_destroy_xfer_dlist
);
owned_handle!(
    /// A registration descriptor list; kept with its region to deregister the same memory.
    RegList: ffi::nixl_capi_reg_dlist_t => ffi::nixl_capi_destroy_reg_dlist
);
owned_handle!(
    /// Optional arguments.
    OptArgs: ffi::nixl_capi_opt_args_t => ffi::nixl_capi_destroy_opt_args
);
owned_handle!(
    /// A notification map.
    NotifMap: ffi::nixl_capi_notif_map_t => ffi::nixl_capi_destroy_notif_map
);
owned_handle!(
    /// A parameter map.
    Params: ffi::nixl_capi_params_t => ffi::nixl_capi_destroy_params
);
owned_handle!(
    /// A memory-kind list.
    MemList: ffi::nixl_capi_mem_list_t => ffi::nixl_capi_destroy_mem_list
);

impl XferList {
    fn new(kind: ffi::nixl_capi_mem_type_t) -> Result<XferList, TransportError> {
        let mut raw = ptr::null_mut();
        // SAFETY: raw is a valid out pointer; the list is owned by the returned value.
        unsafe { ffi::nixl_capi_create_xfer_dlist(kind, &mut raw) }
            .result("nixl_capi_create_xfer_dlist")?;
        Ok(XferList(raw))
    }

    fn add(&mut self, addr: u64, len: u64, dev_id: u64) -> Result<(), TransportError> {
        // SAFETY: the list is live; add_desc records the numbers and touches no memory.
        unsafe { ffi::nixl_capi_xfer_dlist_add_desc(self.0, addr as usize, len as usize, dev_id) }
            .result("nixl_capi_xfer_dlist_add_desc")
    }
}

impl OptArgs {
    /// Arguments naming our one backend, so NIXL never has to choose.
    fn for_backend(backend: ffi::nixl_capi_backend_t) -> Result<OptArgs, TransportError> {
        let mut raw = ptr::null_mut();
        // SAFETY: raw is a valid out pointer; the arguments are owned by the returned value.
        unsafe { ffi::nixl_capi_create_opt_args(&mut raw) }.result("nixl_capi_create_opt_args")?;
        let args = OptArgs(raw);
        // SAFETY: both handles are live; the backend handle outlives every use of these arguments (the
        // worker destroys all of them before the agent's backend handle).
        unsafe { ffi::nixl_capi_opt_args_add_backend(args.0, backend) }
            .result("nixl_capi_opt_args_add_backend")?;
        Ok(args)
    }
}

/// The agent and its UCX backend handle; destroyed on drop, backend handle first.
struct Agent {
    raw: ffi::nixl_capi_agent_t,
    backend: ffi::nixl_capi_backend_t,
}

impl Agent {
    fn new(name: &CStr, config: &NixlConfig) -> Result<Agent, TransportError> {
        let cfg = ffi::nixl_capi_agent_config_t {
            // Off: on a small machine it halves throughput, and this thread polls anyway.
            enable_prog_thread: false,
            enable_listen_thread: false,
            listen_port: 0,
            // Only the progress thread calls the agent.
            thread_sync: ffi::NIXL_CAPI_THREAD_SYNC_NONE,
            num_workers: 1,
            pthr_delay_us: 0,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
        };
        let mut raw = ptr::null_mut();
        // SAFETY: name is NUL-terminated and cfg a live local, both copied by the call; raw is a valid
        // out pointer.
        unsafe { ffi::nixl_capi_create_configured_agent(name.as_ptr(), &cfg, &mut raw) }
            .result("nixl_capi_create_configured_agent")?;
        let mut agent = Agent {
            raw,
            backend: ptr::null_mut(),
        };

        let (mut mems, mut params) = (ptr::null_mut(), ptr::null_mut());
        // SAFETY: the agent is live; the plugin name is NUL-terminated; the out pointers are valid and
        // what they receive is owned by the guards just below.
        let st = unsafe {
            ffi::nixl_capi_get_plugin_params(agent.raw, UCX_PLUGIN.as_ptr(), &mut mems, &mut params)
        };
        let (_mems, params) = (MemList(mems), Params(params));
        st.result("nixl_capi_get_plugin_params(UCX)")?;
        for (k, v) in &config.backend_params {
            let bad = |_| TransportError::Library {
                op: "nixl_capi_params_add",
                code: i64::from(ffi::NIXL_CAPI_ERROR_INVALID_PARAM),
                message: format!("backend parameter {k:?}={v:?} contains a NUL byte"),
            };
            let (k, v) = (
                CString::new(k.as_str()).map_err(bad)?,
                CString::new(v.as_str()).map_err(bad)?,
            );
            // SAFETY: params is live; key and value are NUL-terminated and copied by the call.
            unsafe { ffi::nixl_capi_params_add(params.0, k.as_ptr(), v.as_ptr()) }
                .result("nixl_capi_params_add")?;
        }
        let mut backend = ptr::null_mut();
        // SAFETY: the agent and params are live; params is copied; backend is a valid out pointer.
        unsafe {
            ffi::nixl_capi_create_backend(agent.raw, UCX_PLUGIN.as_ptr(), params.0, &mut backend)
        }
        .result("nixl_capi_create_backend(UCX)")?;
        agent.backend = backend;
        Ok(agent)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if !self.backend.is_null() {
            // SAFETY: the handle came from create_backend and is freed once; the backend itself stays
            // with the agent until the agent goes.
            let st = unsafe { ffi::nixl_capi_destroy_backend(self.backend) };
            if let Err(e) = st.result("nixl_capi_destroy_backend") {
                tracing::warn!("{e}");
            }
        }
        // SAFETY: the agent was created by Agent::new and is destroyed once, after every request,
        // list and argument naming it was released (Worker drops its other fields first).
        let st = unsafe { ffi::nixl_capi_destroy_agent(self.raw) };
        if let Err(e) = st.result("nixl_capi_destroy_agent") {
            tracing::warn!("{e}");
        }
    }
}

struct Region {
    kind: ffi::nixl_capi_mem_type_t,
    dev_id: u64,
    addr: u64,
    len: u64,
    reg: RegList,
    in_flight: u64,
    deregister: Option<chan::Sender<Result<(), TransportError>>>,
}

/// A peer's region, as its metadata describes it.
struct RemoteDesc {
    addr: u64,
    len: u64,
    kind: ffi::nixl_capi_mem_type_t,
    dev_id: u64,
}

struct Peer {
    name: CString,
    remote: Vec<RemoteDesc>,
    failed: Option<String>,
    in_flight: u64,
    closing: bool,
}

/// A posted chunk.
struct Op {
    /// The NIXL request; null for a notification-only chunk.
    req: ffi::nixl_capi_xfer_req_t,
    peer: u64,
    regions: Vec<u64>,
    /// Offsets of the staging ranges its writes read from, held until it is over.
    staged: Vec<u64>,
    done: Option<Done>,
}

/// Registered host memory that strided source rows are copied into ([`NixlConfig::staging_bytes`]).
/// It is freed only by [`Worker::close`] after deregistration; dropped otherwise, it is leaked.
struct Staging {
    /// The memory, owned through `base` (from `Box::into_raw`) so that no reference to it exists
    /// while the agent reads it.
    base: *mut u8,
    len: usize,
    /// Its registration with the agent.
    reg: RegList,
    /// Ranges held by requests in flight.
    live: crate::core::ranges::Ranges,
}

impl Staging {
    /// The lowest free range of `len` bytes (at an offset that is a multiple of 64), taken; `None`
    /// when none is free.
    fn take(&mut self, len: u64) -> Option<u64> {
        self.live.take(len)
    }

    /// Frees the range taken at `off`.
    fn give(&mut self, off: u64) {
        self.live.give(off);
    }

    fn addr(&self) -> u64 {
        self.base as u64
    }
}

struct Worker {
    // Field order is drop order: everything naming the agent goes before it.
    regions: HashMap<u64, Region>,
    peers: HashMap<u64, Peer>,
    active: Vec<Op>,
    /// Chunks whose request NIXL would not release: it may still move their bytes, so they stay
    /// posted for good (their `Done` never runs, their regions and peer stay in use).
    stuck: Vec<Op>,
    next_id: u64,
    /// Optional arguments naming the backend, for registrations.
    args: OptArgs,
    notifs: NotifMap,
    spin: Duration,
    min_sleep: Duration,
    max_sleep: Duration,
    expecting_max_sleep: Duration,
    sender_nice: i32,
    /// Whether `sender_nice` was applied (at the first post).
    reniced: bool,
    /// Staging memory, once a write needed it; `staging_bytes` 0 once it could not be had.
    staging: Option<Staging>,
    staging_bytes: u64,
    sink: Sink,
    shared: Arc<Shared>,
    agent: Agent,
}

impl Worker {
    fn start(
        config: &NixlConfig,
        sink: Sink,
        shared: Arc<Shared>,
    ) -> Result<Box<Worker>, TransportError> {
        shared.bind_current_thread();
        let name = CString::new(config.name.as_str()).map_err(|_| TransportError::Library {
            op: "nixl_capi_create_configured_agent",
            code: i64::from(ffi::NIXL_CAPI_ERROR_INVALID_PARAM),
            message: format!("agent name {:?} contains a NUL byte", config.name),
        })?;
        let agent = Agent::new(&name, config)?;
        // NIXL's UCX plugin is loaded now: if it brought a UCX of its own next to ucx-sys's, stop here.
        super::ucx::check_single_ucx()?;
        let args = OptArgs::for_backend(agent.backend)?;
        let mut map = ptr::null_mut();
        // SAFETY: map is a valid out pointer; the map is owned by the NotifMap guard.
        unsafe { ffi::nixl_capi_create_notif_map(&mut map) }
            .result("nixl_capi_create_notif_map")?;
        Ok(Box::new(Worker {
            regions: HashMap::new(),
            peers: HashMap::new(),
            active: Vec::new(),
            stuck: Vec::new(),
            next_id: 1,
            args,
            notifs: NotifMap(map),
            spin: config.spin,
            min_sleep: config.min_sleep.max(Duration::from_micros(1)),
            max_sleep: config.max_sleep.max(config.min_sleep),
            expecting_max_sleep: config.expecting_max_sleep.max(config.min_sleep),
            sender_nice: config.sender_nice,
            reniced: false,
            staging: None,
            staging_bytes: config.staging_bytes,
            sink,
            shared,
            agent,
        }))
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
            busy |= self.poll_transfers();
            busy |= self.poll_notifications();
            if busy {
                last_busy = Instant::now();
                nap = self.min_sleep;
                continue;
            }
            if last_busy.elapsed() < self.spin {
                continue;
            }
            if !self.active.is_empty() {
                // A completion is only seen by polling: poll again after the shortest nap, which
                // (unlike yielding) lets the thread back on a busy core ahead of the threads that
                // keep it busy.
                self.sleep(rx, self.min_sleep);
            } else {
                // Idle, or waiting for notifications (only seen by polling too): naps grow while
                // nothing arrives, less far while notifications are expected.
                let cap = if self.shared.is_active() {
                    self.expecting_max_sleep
                } else {
                    self.max_sleep
                };
                self.sleep(rx, nap.min(cap));
                nap = (nap * 2).min(cap);
            }
        }
    }

    /// Sleeps for `nap` or until a command arrives.
    fn sleep(&mut self, rx: &chan::Receiver<Cmd>, nap: Duration) {
        self.shared.sleep(nap, || !rx.is_empty());
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register(mem, reply) => {
                let _ = reply.send(self.register(mem));
            }
            Cmd::Deregister(id, reply) => self.deregister(id, reply),
            Cmd::Metadata(reply) => {
                let _ = reply.send(self.metadata());
            }
            Cmd::Connect(meta, regions, reply) => {
                let _ = reply.send(self.connect(&meta, &regions));
            }
            Cmd::Disconnect(peer) => {
                if let Some(p) = self.peers.get_mut(&peer.0) {
                    p.closing = true;
                }
                self.maybe_close_peer(peer.0);
            }
            Cmd::Post(peer, writes, notification, done) => {
                self.post(peer, writes, notification, done)
            }
            Cmd::Stop => {}
        }
    }

    fn metadata(&mut self) -> Result<Vec<u8>, TransportError> {
        let (mut data, mut len) = (ptr::null_mut(), 0usize);
        // SAFETY: the agent is live; both out pointers are valid.
        unsafe { ffi::nixl_capi_get_local_md(self.agent.raw, &mut data, &mut len) }
            .result("nixl_capi_get_local_md")?;
        let bytes = if data.is_null() {
            Vec::new()
        } else {
            // SAFETY: NIXL returned `len` readable bytes at `data`, ours until freed just below.
            unsafe { std::slice::from_raw_parts(data as *const u8, len) }.to_vec()
        };
        // SAFETY: the buffer was malloc'd by get_local_md for us and is freed once (free(NULL) is a no-op).
        unsafe { libc::free(data) };
        Ok(bytes)
    }

    /// A registration list of one range.
    fn reg_list(
        kind: ffi::nixl_capi_mem_type_t,
        addr: u64,
        len: u64,
        dev_id: u64,
    ) -> Result<RegList, TransportError> {
        let mut raw = ptr::null_mut();
        // SAFETY: raw is a valid out pointer; the list is owned by the RegList guard.
        unsafe { ffi::nixl_capi_create_reg_dlist(kind, &mut raw) }
            .result("nixl_capi_create_reg_dlist")?;
        let reg = RegList(raw);
        // SAFETY: the list is live; add_desc records the numbers (no per-descriptor metadata).
        unsafe {
            ffi::nixl_capi_reg_dlist_add_desc(
                reg.0,
                addr as usize,
                len as usize,
                dev_id,
                ptr::null(),
                0,
            )
        }
        .result("nixl_capi_reg_dlist_add_desc")?;
        Ok(reg)
    }

    fn register(&mut self, mem: MemDesc) -> Result<(RegionId, RemoteRegion), TransportError> {
        let (kind, dev_id) = match mem.kind() {
            MemKind::Host => (ffi::NIXL_CAPI_MEM_DRAM, 0),
            MemKind::Cuda { device } => (ffi::NIXL_CAPI_MEM_VRAM, u64::from(device)),
        };
        let reg = Self::reg_list(kind, mem.addr(), mem.len(), dev_id)?;
        // SAFETY: `Transport::register`'s caller promised the range is live memory of that kind
        // (on that device) for the registration's life; the agent, list and arguments are live.
        unsafe { ffi::nixl_capi_register_mem(self.agent.raw, reg.0, self.args.0) }
            .result("nixl_capi_register_mem")?;
        let id = self.next_id;
        self.next_id += 1;
        self.regions.insert(
            id,
            Region {
                kind,
                dev_id,
                addr: mem.addr(),
                len: mem.len(),
                reg,
                in_flight: 0,
                deregister: None,
            },
        );
        let c = &self.shared.counters;
        c.regions.fetch_add(1, Ordering::Relaxed);
        c.registered_bytes.fetch_add(mem.len(), Ordering::Relaxed);
        Ok((
            RegionId(id),
            RemoteRegion {
                addr: mem.addr(),
                len: mem.len(),
                rkey: Vec::new(),
            },
        ))
    }

    /// Allocates and registers the staging memory; on failure says why once and stages nothing
    /// from then on.
    fn open_staging(&mut self) -> Option<Staging> {
        let len = usize::try_from(self.staging_bytes).ok()?;
        let base = Box::into_raw(vec![0u8; len].into_boxed_slice()) as *mut u8;
        let free = |base: *mut u8| {
            // SAFETY: `base` came from `Box::into_raw` of a boxed slice of `len` bytes above and is
            // given back once, unregistered.
            drop(unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(base, len)) });
        };
        let reg = match Self::reg_list(ffi::NIXL_CAPI_MEM_DRAM, base as u64, len as u64, 0) {
            Ok(reg) => reg,
            Err(e) => {
                tracing::warn!(error = %e, "no staging memory: strided writes go row by row");
                self.staging_bytes = 0;
                free(base);
                return None;
            }
        };
        // SAFETY: the range is live host memory owned by the staging, freed only after it is
        // deregistered (`close`); the agent, list and arguments are live.
        let st = unsafe { ffi::nixl_capi_register_mem(self.agent.raw, reg.0, self.args.0) }
            .result("nixl_capi_register_mem");
        if let Err(e) = st {
            tracing::warn!(error = %e, "no staging memory: strided writes go row by row");
            self.staging_bytes = 0;
            drop(reg);
            free(base);
            return None;
        }
        Some(Staging {
            base,
            len,
            reg,
            live: crate::core::ranges::Ranges::new(len as u64),
        })
    }

    /// For each of `writes` (validated), the staging address its rows were copied to where they
    /// are strided in host memory here and contiguous at the peer and staging had room, `None`
    /// for the others; and the staging ranges taken.
    fn stage(&mut self, writes: &[WriteOp]) -> (Vec<Option<u64>>, Vec<u64>) {
        let mut at = vec![None; writes.len()];
        let mut taken = Vec::new();
        for (i, w) in writes.iter().enumerate() {
            if w.rows < 2 || w.remote_stride != w.len || w.local_stride == w.len || w.bytes() == 0 {
                continue;
            }
            if self.staging.is_none() && self.staging_bytes > 0 {
                self.staging = self.open_staging();
            }
            let (Some(st), Some(r)) = (self.staging.as_mut(), self.regions.get(&w.local.0)) else {
                break;
            };
            if r.kind != ffi::NIXL_CAPI_MEM_DRAM {
                continue;
            }
            let Some(off) = st.take(w.bytes()) else {
                continue;
            };
            for (k, (lo, _)) in w.pieces().enumerate() {
                // SAFETY: the source row lies inside region `r` (`WriteOp::fits`, checked by
                // `post`), host memory that `Transport::register`'s caller keeps live and
                // unchanged while a write from it is in flight; the destination lies inside the
                // range just taken from the staging memory (`take`: `bytes()` from `off`, inside
                // its `len`), which no request in flight reads and which is not the caller's.
                unsafe {
                    ptr::copy_nonoverlapping(
                        (r.addr + lo) as *const u8,
                        st.base.add(off as usize + k * w.len as usize),
                        w.len as usize,
                    );
                }
            }
            at[i] = Some(st.addr() + off);
            taken.push(off);
            self.shared
                .counters
                .staged_bytes
                .fetch_add(w.bytes(), Ordering::Relaxed);
        }
        (at, taken)
    }

    /// Gives back staging ranges taken by [`stage`](Self::stage).
    fn unstage(&mut self, taken: &mut Vec<u64>) {
        if let Some(st) = self.staging.as_mut() {
            for off in taken.drain(..) {
                st.give(off);
            }
        }
    }

    fn deregister(&mut self, id: RegionId, reply: chan::Sender<Result<(), TransportError>>) {
        let Some(region) = self.regions.get_mut(&id.0) else {
            let _ = reply.send(Err(TransportError::UnknownRegion(id)));
            return;
        };
        if region.deregister.is_some() {
            let _ = reply.send(Err(TransportError::UnknownRegion(id)));
            return;
        }
        if region.in_flight > 0 {
            // Writes from it are still running: deregister when the last one is over.
            region.deregister = Some(reply);
            self.shared
                .counters
                .deferred
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        let _ = reply.send(self.unregister(id.0));
    }

    fn unregister(&mut self, id: u64) -> Result<(), TransportError> {
        let Some(region) = self.regions.remove(&id) else {
            return Err(TransportError::UnknownRegion(RegionId(id)));
        };
        let c = &self.shared.counters;
        c.regions.fetch_sub(1, Ordering::Relaxed);
        c.registered_bytes.fetch_sub(region.len, Ordering::Relaxed);
        // SAFETY: the list describes exactly the memory registered with it on this agent, and no
        // request reads from it any more (in_flight == 0).
        unsafe { ffi::nixl_capi_deregister_mem(self.agent.raw, region.reg.0, self.args.0) }
            .result("nixl_capi_deregister_mem")
    }

    fn connect(&mut self, meta: &[u8], regions: &[RemoteRegion]) -> Result<PeerId, TransportError> {
        if meta.is_empty() {
            return Err(TransportError::BadMetadata("empty NIXL metadata".into()));
        }
        let mut raw_name = ptr::null_mut();
        // SAFETY: the agent is live; `meta` is readable for its length and copied (NIXL parses it and
        // reports malformed input as an error status); raw_name is a valid out pointer.
        let st = unsafe {
            ffi::nixl_capi_load_remote_md(
                self.agent.raw,
                meta.as_ptr() as *const c_void,
                meta.len(),
                &mut raw_name,
            )
        };
        if st != ffi::NIXL_CAPI_SUCCESS {
            return Err(TransportError::BadMetadata(
                status_error("nixl_capi_load_remote_md", st).to_string(),
            ));
        }
        if raw_name.is_null() {
            return Err(TransportError::BadMetadata(
                "NIXL loaded the metadata but returned no agent name".into(),
            ));
        }
        // SAFETY: on success raw_name is a NUL-terminated strdup'd string, ours to copy and free once.
        let name = unsafe { CStr::from_ptr(raw_name) }.to_owned();
        // SAFETY: as above; not used after this.
        unsafe { libc::free(raw_name as *mut c_void) };

        let mut remote = Vec::with_capacity(regions.len());
        for (i, r) in regions.iter().enumerate() {
            match self.probe_remote(&name, r) {
                Ok(Some((kind, dev_id))) => remote.push(RemoteDesc {
                    addr: r.addr,
                    len: r.len,
                    kind,
                    dev_id,
                }),
                Ok(None) => {
                    self.forget_remote(&name);
                    return Err(TransportError::BadMetadata(format!(
                        "the metadata of agent {name:?} does not cover region {i} ({:#x}, {} bytes): it must be \
                         fetched after the region is registered",
                        r.addr, r.len
                    )));
                }
                Err(e) => {
                    self.forget_remote(&name);
                    return Err(e);
                }
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.peers.insert(
            id,
            Peer {
                name,
                remote,
                failed: None,
                in_flight: 0,
                closing: false,
            },
        );
        self.shared.counters.peers.fetch_add(1, Ordering::Relaxed);
        Ok(PeerId(id))
    }

    /// Which memory kind and device a peer's region has, as its loaded metadata says: host memory
    /// first, then each device in turn. `None` if the metadata covers it under none of them.
    fn probe_remote(
        &self,
        name: &CStr,
        r: &RemoteRegion,
    ) -> Result<Option<(ffi::nixl_capi_mem_type_t, u64)>, TransportError> {
        let candidates = std::iter::once((ffi::NIXL_CAPI_MEM_DRAM, 0))
            .chain((0..MAX_PROBED_DEVICES).map(|d| (ffi::NIXL_CAPI_MEM_VRAM, d)));
        for (kind, dev_id) in candidates {
            let mut list = XferList::new(kind)?;
            list.add(r.addr, r.len, dev_id)?;
            // SAFETY: the agent and list are live; name is NUL-terminated; the call only compares
            // descriptors with the loaded metadata.
            match unsafe { ffi::nixl_capi_check_remote_md(self.agent.raw, name.as_ptr(), list.0) } {
                ffi::NIXL_CAPI_SUCCESS => return Ok(Some((kind, dev_id))),
                ffi::NIXL_CAPI_ERROR_NOT_FOUND => {}
                st => return Err(status_error("nixl_capi_check_remote_md", st)),
            }
        }
        Ok(None)
    }

    /// Drops a peer agent's metadata unless another live peer id still uses it.
    fn forget_remote(&mut self, name: &CStr) {
        if self.peers.values().any(|p| p.name.as_c_str() == name) {
            return;
        }
        // SAFETY: the agent is live, the name NUL-terminated; no request to that agent is in flight
        // (no peer id refers to it any more, and each request holds its peer's in_flight count).
        let st = unsafe { ffi::nixl_capi_invalidate_remote_md(self.agent.raw, name.as_ptr()) };
        if let Err(e) = st.result("nixl_capi_invalidate_remote_md") {
            tracing::debug!("{e} for agent {name:?}");
        }
    }

    /// Forgets a peer marked closing once nothing posted to it is running.
    fn maybe_close_peer(&mut self, id: u64) {
        let Some(p) = self.peers.get(&id) else { return };
        if !p.closing || p.in_flight > 0 {
            return;
        }
        let Some(p) = self.peers.remove(&id) else {
            return;
        };
        self.forget_remote(&p.name);
        self.shared.counters.peers.fetch_sub(1, Ordering::Relaxed);
    }

    fn post(&mut self, peer: PeerId, writes: Vec<WriteOp>, notification: Vec<u8>, done: Done) {
        if !self.reniced {
            self.reniced = true;
            super::ucx::lower_thread_priority(self.sender_nice);
        }
        let Some(p) = self.peers.get(&peer.0).filter(|p| !p.closing) else {
            done(Err(TransportError::UnknownPeer(peer)));
            return;
        };
        if let Some(reason) = &p.failed {
            done(Err(TransportError::PeerFailed {
                peer,
                reason: reason.clone(),
            }));
            return;
        }
        // Validate everything before building anything, so a bad write list posts nothing.
        let mut regions: Vec<u64> = Vec::new();
        let mut bytes = 0u64;
        let (mut local_kind, mut remote_kind) = (None, None);
        for w in &writes {
            let Some(r) = self.regions.get(&w.local.0) else {
                done(Err(TransportError::UnknownRegion(w.local)));
                return;
            };
            let rr = p
                .remote
                .get(w.remote as usize)
                .filter(|rr| w.fits(r.len, rr.len));
            let (Some(rr), false) = (rr, r.deregister.is_some()) else {
                done(Err(TransportError::OutOfBounds(format!("{w:?}"))));
                return;
            };
            if w.bytes() == 0 {
                continue;
            }
            // One request has one memory kind per side; a chunk mixing host and device memory on one
            // side is refused rather than split (which would lose the notification's ordering).
            if *local_kind.get_or_insert(r.kind) != r.kind
                || *remote_kind.get_or_insert(rr.kind) != rr.kind
            {
                done(Err(TransportError::Library {
                    op: "nixl_capi_create_xfer_req",
                    code: i64::from(ffi::NIXL_CAPI_ERROR_INVALID_PARAM),
                    message: "a chunk's writes mix host and device memory on one side".into(),
                }));
                return;
            }
            if !regions.contains(&w.local.0) {
                regions.push(w.local.0);
            }
            bytes += w.bytes();
        }

        // Rows strided here and contiguous at the peer go through staging memory: one descriptor.
        let (staged_at, mut staged) = match local_kind {
            Some(ffi::NIXL_CAPI_MEM_DRAM) if self.staging_bytes > 0 => self.stage(&writes),
            _ => (vec![None; writes.len()], Vec::new()),
        };
        let Some(p) = self.peers.get(&peer.0) else {
            self.unstage(&mut staged);
            done(Err(TransportError::UnknownPeer(peer)));
            return;
        };
        let req = match (local_kind, remote_kind) {
            (Some(lk), Some(rk)) => {
                match self.create_request(p, lk, rk, &writes, &staged_at, &notification) {
                    Ok(req) => req,
                    Err(e) => {
                        self.unstage(&mut staged);
                        self.peer_error(peer.0, &e);
                        done(Err(e));
                        return;
                    }
                }
            }
            _ => {
                // No bytes to move: the notification, if any, goes alone.
                let res = if notification.is_empty() {
                    Ok(())
                } else {
                    // SAFETY: the agent is live, the peer's name NUL-terminated and its metadata loaded;
                    // the message is readable for its length and copied by the call.
                    unsafe {
                        ffi::nixl_capi_gen_notif(
                            self.agent.raw,
                            p.name.as_ptr(),
                            notification.as_ptr() as *const c_void,
                            notification.len(),
                            self.args.0,
                        )
                    }
                    .result("nixl_capi_gen_notif")
                };
                if let Err(e) = &res {
                    self.peer_error(peer.0, e);
                }
                done(res);
                return;
            }
        };

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
        let op = Op {
            req,
            peer: peer.0,
            regions,
            staged,
            done: Some(done),
        };

        // SAFETY: the agent and request are live; the request's memory is registered and bounds-checked
        // above and stays registered until the request is over (its regions' in_flight is raised);
        // null extra arguments keep the notification set at creation.
        let st = unsafe { ffi::nixl_capi_post_xfer_req(self.agent.raw, op.req, ptr::null_mut()) };
        match st {
            ffi::NIXL_CAPI_IN_PROG => self.active.push(op),
            ffi::NIXL_CAPI_SUCCESS => self.finish(op, Ok(())),
            st => self.finish(op, Err(status_error("nixl_capi_post_xfer_req", st))),
        }
    }

    /// Builds the descriptor lists of a validated chunk and creates its WRITE request.
    fn create_request(
        &self,
        p: &Peer,
        local_kind: ffi::nixl_capi_mem_type_t,
        remote_kind: ffi::nixl_capi_mem_type_t,
        writes: &[WriteOp],
        staged_at: &[Option<u64>],
        notification: &[u8],
    ) -> Result<ffi::nixl_capi_xfer_req_t, TransportError> {
        let mut local = XferList::new(local_kind)?;
        let mut remote = XferList::new(remote_kind)?;
        // NIXL's descriptor lists are contiguous ranges: a write of many rows is one descriptor
        // per row, unless its rows were staged (then contiguous on both sides).
        for (i, w) in writes.iter().enumerate().filter(|(_, w)| w.bytes() > 0) {
            let (Some(r), Some(rr)) = (
                self.regions.get(&w.local.0),
                p.remote.get(w.remote as usize),
            ) else {
                return Err(TransportError::UnknownRegion(w.local));
            };
            if let Some(at) = staged_at.get(i).copied().flatten() {
                local.add(at, w.bytes(), 0)?;
                remote.add(rr.addr + w.remote_offset, w.bytes(), rr.dev_id)?;
                continue;
            }
            for (lo, ro) in w.pieces() {
                local.add(r.addr + lo, w.len, r.dev_id)?;
                remote.add(rr.addr + ro, w.len, rr.dev_id)?;
            }
        }
        let args = OptArgs::for_backend(self.agent.backend)?;
        if !notification.is_empty() {
            // SAFETY: the arguments are live; the message is readable for its length and copied.
            unsafe {
                ffi::nixl_capi_opt_args_set_notif_msg(
                    args.0,
                    notification.as_ptr() as *const c_void,
                    notification.len(),
                )
            }
            .result("nixl_capi_opt_args_set_notif_msg")?;
            // SAFETY: the arguments are live.
            unsafe { ffi::nixl_capi_opt_args_set_has_notif(args.0, true) }
                .result("nixl_capi_opt_args_set_has_notif")?;
        }
        let mut req = ptr::null_mut();
        // SAFETY: the agent, both lists and the arguments are live and copied by the call; the peer's name
        // is NUL-terminated and its metadata loaded; req is a valid out pointer. The lists and arguments
        // are destroyed when this function returns, which NIXL allows once the call has returned.
        unsafe {
            ffi::nixl_capi_create_xfer_req(
                self.agent.raw,
                ffi::NIXL_CAPI_XFER_OP_WRITE,
                local.0,
                remote.0,
                p.name.as_ptr(),
                &mut req,
                args.0,
            )
        }
        .result("nixl_capi_create_xfer_req")?;
        Ok(req)
    }

    /// Polls every request in flight; finishes those that are over. True if any was.
    fn poll_transfers(&mut self) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.active.len() {
            // SAFETY: the agent and the request are live; polling also progresses the agent.
            let st = unsafe { ffi::nixl_capi_get_xfer_status(self.agent.raw, self.active[i].req) };
            if st == ffi::NIXL_CAPI_IN_PROG {
                i += 1;
                continue;
            }
            any = true;
            let op = self.active.remove(i);
            let res = if st == ffi::NIXL_CAPI_SUCCESS {
                Ok(())
            } else {
                Err(status_error("nixl_capi_get_xfer_status", st))
            };
            self.finish(op, res);
        }
        any
    }

    /// Progresses the agent and hands every received notification to the sink. True if any came.
    fn poll_notifications(&mut self) -> bool {
        let map = self.notifs.0;
        // SAFETY: the agent and map are live and only used by this thread; get_notifs appends, so the
        // map is cleared first.
        let st = unsafe {
            ffi::nixl_capi_notif_map_clear(map);
            ffi::nixl_capi_get_notifs(self.agent.raw, map, ptr::null_mut())
        };
        if st != ffi::NIXL_CAPI_SUCCESS {
            tracing::debug!("{}", status_error("nixl_capi_get_notifs", st));
            return false;
        }
        let mut senders = 0usize;
        // SAFETY: the map is live; senders is a valid out pointer.
        if unsafe { ffi::nixl_capi_notif_map_size(map, &mut senders) } != ffi::NIXL_CAPI_SUCCESS
            || senders == 0
        {
            return false;
        }
        // Names and messages are borrowed from the map, which nothing changes until the next turn: the
        // sink sees NIXL's bytes without a copy.
        for a in 0..senders {
            let mut name = ptr::null();
            // SAFETY: the map is live and unchanged; name is a valid out pointer.
            if unsafe { ffi::nixl_capi_notif_map_get_agent_at(map, a, &mut name) }
                != ffi::NIXL_CAPI_SUCCESS
                || name.is_null()
            {
                continue;
            }
            // SAFETY: a non-null name from the map is NUL-terminated and valid while the map is unchanged.
            let sender = unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned();
            let mut count = 0usize;
            // SAFETY: the map is live; name is the map's own key; count is a valid out pointer.
            if unsafe { ffi::nixl_capi_notif_map_get_notifs_size(map, name, &mut count) }
                != ffi::NIXL_CAPI_SUCCESS
            {
                continue;
            }
            for i in 0..count {
                let (mut data, mut len) = (ptr::null(), 0usize);
                // SAFETY: as above; data and len are valid out pointers.
                if unsafe { ffi::nixl_capi_notif_map_get_notif(map, name, i, &mut data, &mut len) }
                    != ffi::NIXL_CAPI_SUCCESS
                {
                    continue;
                }
                let bytes: &[u8] = if data.is_null() || len == 0 {
                    &[]
                } else {
                    // SAFETY: NIXL lends `len` readable bytes at `data` until the map next changes, which
                    // is after the sink returns.
                    unsafe { std::slice::from_raw_parts(data as *const u8, len) }
                };
                self.shared
                    .counters
                    .notifications
                    .fetch_add(1, Ordering::Relaxed);
                (self.sink)(Incoming::Notification {
                    sender: Sender::Agent(sender.clone()),
                    bytes,
                });
            }
        }
        true
    }

    /// Ends a posted chunk: frees its request, releases what it held and runs its `Done`.
    fn finish(&mut self, mut op: Op, mut res: Result<(), TransportError>) {
        let mut released = true;
        if !op.req.is_null() {
            // The request is over (complete or failed), so releasing it cancels nothing.
            // SAFETY: the agent and request are live; the request is released once.
            let st = unsafe { ffi::nixl_capi_release_xfer_req(self.agent.raw, op.req) };
            if st == ffi::NIXL_CAPI_SUCCESS {
                // SAFETY: released just above; destroyed once and never used again.
                unsafe { ffi::nixl_capi_destroy_xfer_req(op.req) };
            } else {
                // An unreleased handle cannot be destroyed: it is leaked, which is safe.
                tracing::warn!(
                    "{} (request leaked; its chunk stays posted)",
                    status_error("nixl_capi_release_xfer_req", st)
                );
                released = false;
            }
            op.req = ptr::null_mut();
        }
        if !released {
            // The library may still move this chunk's bytes: reporting it over would let the
            // engine acknowledge an abort (decode reuses the pages) or decide the request (the
            // caller reuses its source pages), and a deferred deregistration unregister the pool.
            // So it stays posted, with its staging ranges, for the rest of the process.
            self.shared.counters.leaked.fetch_add(1, Ordering::Relaxed);
            self.stuck.push(op);
            return;
        }
        let mut staged = std::mem::take(&mut op.staged);
        // The agent reads no staged row of it any more.
        self.unstage(&mut staged);
        // The failure that marks the peer failed keeps the library's status; later ones to a peer
        // already failed say so.
        if let Err(e) = &res
            && !self.peer_error(op.peer, e)
            && !matches!(e, TransportError::Shutdown)
            && let Some(reason) = self.peers.get(&op.peer).and_then(|p| p.failed.clone())
        {
            res = Err(TransportError::PeerFailed {
                peer: PeerId(op.peer),
                reason,
            });
        }
        let mut deregs = Vec::new();
        for id in &op.regions {
            if let Some(r) = self.regions.get_mut(id) {
                r.in_flight -= 1;
                if r.in_flight == 0 && r.deregister.is_some() {
                    deregs.push(*id);
                }
            }
        }
        if let Some(p) = self.peers.get_mut(&op.peer) {
            p.in_flight -= 1;
        }
        self.shared
            .counters
            .in_flight
            .fetch_sub(1, Ordering::Relaxed);
        // `done` runs before a deferred deregistration returns, so whoever waits on that sees it ran.
        if let Some(done) = op.done.take() {
            done(res);
        }
        for id in deregs {
            let reply = self.regions.get_mut(&id).and_then(|r| r.deregister.take());
            let res = self.unregister(id);
            self.shared
                .counters
                .deferred
                .fetch_sub(1, Ordering::Relaxed);
            if let Some(reply) = reply {
                let _ = reply.send(res);
            }
        }
        self.maybe_close_peer(op.peer);
    }

    /// Marks a peer failed after a library error on a request to it (once), and tells the sink. True
    /// if this call marked it.
    fn peer_error(&mut self, peer: u64, err: &TransportError) -> bool {
        if !blames_peer(err) {
            return false;
        }
        let Some(p) = self.peers.get_mut(&peer) else {
            return false;
        };
        if p.failed.is_some() {
            return false;
        }
        let reason = format!("agent {:?}: {err}", p.name);
        p.failed = Some(reason.clone());
        (self.sink)(Incoming::PeerFailed {
            peer: PeerId(peer),
            reason,
        });
        true
    }

    fn close(mut self: Box<Self>) {
        // Let posted chunks finish (bounded), so their Done callbacks run and their memory is released.
        let deadline = Instant::now() + SHUTDOWN_BOUND;
        while !self.active.is_empty() && Instant::now() < deadline {
            self.poll_transfers();
            self.poll_notifications();
        }
        if !self.active.is_empty() || !self.stuck.is_empty() {
            // The agent may still be moving bytes for these requests, from our registrations to the
            // peers' memory: releasing the requests, unregistering the memory or destroying the agent
            // under them is not safe. Leak it all instead.
            let handles = self.active.len() + self.peers.len() + self.regions.len() + 1;
            self.shared
                .counters
                .leaked
                .fetch_add(handles as u64, Ordering::Relaxed);
            tracing::warn!(
                requests = self.active.len(),
                regions = self.regions.len(),
                "transfers still active past the shutdown bound: leaking the NIXL agent, its requests and registrations"
            );
            for r in self.regions.values_mut() {
                if let Some(reply) = r.deregister.take() {
                    let _ = reply.send(Err(TransportError::Shutdown));
                }
            }
            std::mem::forget(self);
            return;
        }
        let ids: Vec<u64> = self.peers.keys().copied().collect();
        for id in ids {
            if let Some(p) = self.peers.get_mut(&id) {
                p.closing = true;
                p.in_flight = 0;
            }
            self.maybe_close_peer(id);
        }
        let ids: Vec<u64> = self.regions.keys().copied().collect();
        for id in ids {
            let reply = self.regions.get_mut(&id).and_then(|r| r.deregister.take());
            if reply.is_some() {
                self.shared
                    .counters
                    .deferred
                    .fetch_sub(1, Ordering::Relaxed);
            }
            let res = self.unregister(id);
            if let Err(e) = &res {
                tracing::warn!("{e}");
            }
            if let Some(reply) = reply {
                let _ = reply.send(res.and(Err(TransportError::Shutdown)));
            }
        }
        if let Some(st) = self.staging.take() {
            // SAFETY: no request is active, so the agent reads none of it; the list describes
            // exactly the memory registered with it on this agent.
            let res =
                unsafe { ffi::nixl_capi_deregister_mem(self.agent.raw, st.reg.0, self.args.0) }
                    .result("nixl_capi_deregister_mem");
            match res {
                Ok(()) => {
                    // SAFETY: `base` came from `Box::into_raw` of a boxed slice of `len` bytes
                    // (`open_staging`), now unregistered, and is given back only here (`Staging`
                    // has no drop of its own).
                    drop(unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(st.base, st.len)) });
                }
                // Still registered: leaked rather than freed.
                Err(e) => tracing::warn!("{e} (staging memory leaked)"),
            }
            let Staging { reg, .. } = st;
            drop(reg);
        }
        // Dropping the worker destroys the arguments and the map, then the agent.
    }
}
