//! What both backends' progress threads share: their counters, and the handshake that lets the thread
//! sleep when idle while the threads queueing commands wake it only when it really sleeps (a busy
//! engine pays no system call per command).
//!
//! A thread sleeps in one of two ways: parked for a timed nap ([`Shared::sleep`]), or in `poll(2)`
//! on its library's event fd beside a doorbell, an eventfd that command senders write
//! ([`Shared::sleep_on`]): then it wakes when data arrives, not when a timer says so.

use super::TransportStats;
use rustix::event::{EventfdFlags, PollFd, PollFlags, Timespec};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::Thread;
use std::time::Duration;

/// How the operating system schedules a backend's progress thread, the thread that sees a peer's
/// notifications arrive.
///
/// Where the cores are busy (prefill copies, the caller's own threads), a progress thread woken by
/// a notification under the default policy waits for the running threads' time slices, which is
/// milliseconds: the tail of last-write-to-Complete. Under `SCHED_FIFO` it runs as soon as it is
/// woken. Asking for it takes `CAP_SYS_NICE` or an `RLIMIT_RTPRIO` of at least the priority (for
/// example `ulimit -r 1`, or `docker run --ulimit rtprio=1`); a backend that cannot have it fails to
/// start ([`TransportError::Scheduling`](super::TransportError::Scheduling)).
///
/// A realtime thread holds its core while it polls: for the backend's `spin` after each event, then
/// it sleeps. Where cores are few and the threads whose data it waits for need them, a shorter spin
/// (zero) leaves them the core, at the price of a wake-up for each notification where cores are
/// idle. It is meant for receivers (decode), whose progress thread sleeps until data arrives; on a
/// sender whose progress thread copies, it would hold a core for the length of each copy (Linux's
/// realtime throttling, `sched_rt_runtime_us`, leaves the others 5% of each second by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProgressScheduling {
    /// The process's default policy (`SCHED_OTHER` unless the caller changed it).
    #[default]
    Normal,
    /// `SCHED_FIFO` at this priority, 1 (lowest) to 99.
    Fifo(u8),
}

impl ProgressScheduling {
    /// Applies it to the calling thread.
    fn apply(self) -> Result<(), super::TransportError> {
        use thread_priority::{
            RealtimeThreadSchedulePolicy, ThreadPriority, ThreadPriorityValue,
            ThreadSchedulePolicy, set_thread_priority_and_policy, thread_native_id,
        };
        let ProgressScheduling::Fifo(priority) = self else {
            return Ok(());
        };
        let refused = |message: String| super::TransportError::Scheduling {
            asked: self,
            message,
        };
        if priority == 0 {
            return Err(refused("realtime priorities run from 1 to 99".into()));
        }
        let value = ThreadPriorityValue::try_from(priority)
            .map_err(|e| refused(format!("priority out of range: {e}")))?;
        set_thread_priority_and_policy(
            thread_native_id(),
            ThreadPriority::Crossplatform(value),
            ThreadSchedulePolicy::Realtime(RealtimeThreadSchedulePolicy::Fifo),
        )
        .map_err(|e| match e {
            thread_priority::Error::OS(code) if code == libc::EPERM => refused(format!(
                "not permitted (needs CAP_SYS_NICE or an RLIMIT_RTPRIO of at least {priority})"
            )),
            thread_priority::Error::OS(code) => {
                refused(std::io::Error::from_raw_os_error(code).to_string())
            }
            other => refused(format!("{other:?}")),
        })
    }
}

/// Counters a backend keeps on its progress thread and reports through `Transport::stats`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) regions: AtomicU64,
    pub(crate) registered_bytes: AtomicU64,
    pub(crate) peers: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    pub(crate) deferred: AtomicU64,
    pub(crate) notifications: AtomicU64,
    pub(crate) bytes_posted: AtomicU64,
    pub(crate) leaked: AtomicU64,
    pub(crate) direct_regions: AtomicU64,
    pub(crate) copy_nanos: AtomicU64,
    pub(crate) staged_bytes: AtomicU64,
}

/// State shared between a progress thread and the threads that talk to it.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    sleeping: AtomicBool,
    active: AtomicBool,
    thread: OnceLock<Thread>,
    /// The eventfd that wakes a thread sleeping in [`sleep_on`](Self::sleep_on); set once, by
    /// [`open_doorbell`](Self::open_doorbell), on threads that sleep that way.
    doorbell: OnceLock<OwnedFd>,
    pub(crate) counters: Counters,
}

/// How a [`Shared::sleep_on`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Woken {
    /// The library's fd, the doorbell, or the timeout ended the sleep, or there was no need to
    /// sleep (a command queued, the library not armed because events were pending).
    Ok,
    /// `poll(2)` failed with something other than an interruption: the caller naps instead.
    Failed,
}

impl Shared {
    /// Names the calling thread as the progress thread; called by it before it first sleeps.
    pub(crate) fn bind_current_thread(&self) {
        let _ = self.thread.set(std::thread::current());
    }

    /// Whether the caller is the progress thread itself (an owner dropped from inside a callback):
    /// then nothing may wait for the thread, which cannot answer while it runs the caller.
    pub(crate) fn on_progress_thread(&self) -> bool {
        self.thread
            .get()
            .is_some_and(|t| t.id() == std::thread::current().id())
    }

    /// Gives the thread a doorbell, so that [`sleep_on`](Self::sleep_on) can be woken by commands.
    /// Called by the progress thread before it first sleeps that way.
    ///
    /// # Errors
    /// The eventfd could not be made (the caller sleeps with timed naps instead).
    pub(crate) fn open_doorbell(&self) -> std::io::Result<()> {
        if self.doorbell.get().is_none() {
            let fd = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
            let _ = self.doorbell.set(fd);
        }
        Ok(())
    }

    /// Wakes the progress thread if it sleeps. Called after queueing a command.
    pub(crate) fn ring(&self) {
        // Pairs with the fence in `sleep` and `sleep_on`: either the thread sees the command before
        // it sleeps, or we see it asleep and wake it (an unpark before its park makes that park
        // return at once; a doorbell rung before its poll leaves the eventfd readable).
        std::sync::atomic::fence(Ordering::SeqCst);
        if !self.sleeping.load(Ordering::SeqCst) {
            return;
        }
        if let Some(bell) = self.doorbell.get() {
            // An eventfd adds what is written; a full counter (never, at one per command) or any
            // other failure leaves the thread to its sleep's timeout.
            let _ = rustix::io::write(bell, &1u64.to_ne_bytes());
        }
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// Sleeps the progress thread for up to `nap`, unless `pending` says a command is already queued.
    pub(crate) fn sleep(&self, nap: Duration, pending: impl FnOnce() -> bool) {
        self.sleeping.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        if !pending() {
            std::thread::park_timeout(nap);
        }
        self.sleeping.store(false, Ordering::SeqCst);
    }

    /// Sleeps the progress thread until `fd` (the library's event fd) is readable, a command rings
    /// the doorbell, or `timeout` passes; not at all if `pending` says a command is queued, or if
    /// `arm` (which tells the library to signal `fd` on its next event) says events are already
    /// there. Needs [`open_doorbell`](Self::open_doorbell) first.
    pub(crate) fn sleep_on(
        &self,
        fd: BorrowedFd<'_>,
        timeout: Duration,
        pending: impl FnOnce() -> bool,
        arm: impl FnOnce() -> bool,
    ) -> Woken {
        let Some(bell) = self.doorbell.get() else {
            return Woken::Failed;
        };
        self.sleeping.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        let mut woken = Woken::Ok;
        if !pending() && arm() {
            let mut fds = [
                PollFd::new(&fd, PollFlags::IN),
                PollFd::new(bell, PollFlags::IN),
            ];
            let t = Timespec {
                tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
                tv_nsec: i64::from(timeout.subsec_nanos()),
            };
            match rustix::event::poll(&mut fds, Some(&t)) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(_) => woken = Woken::Failed,
            }
        }
        self.sleeping.store(false, Ordering::SeqCst);
        // Empties the doorbell (nonblocking: nothing to read is fine), so the next poll waits again.
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(bell, &mut buf);
        woken
    }

    /// Records the owner's hint (see `Transport::set_active`), waking the thread when it turns on.
    pub(crate) fn set_active(&self, active: bool) {
        if self.active.swap(active, Ordering::Relaxed) != active && active {
            self.ring();
        }
    }

    /// Whether the owner expects traffic.
    pub(crate) fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// The counters, as the trait reports them.
    pub(crate) fn stats(&self) -> TransportStats {
        let c = &self.counters;
        TransportStats {
            regions: c.regions.load(Ordering::Relaxed),
            registered_bytes: c.registered_bytes.load(Ordering::Relaxed),
            peers: c.peers.load(Ordering::Relaxed),
            in_flight: c.in_flight.load(Ordering::Relaxed),
            deferred_deregistrations: c.deferred.load(Ordering::Relaxed),
            leaked_handles: c.leaked.load(Ordering::Relaxed),
            notifications: c.notifications.load(Ordering::Relaxed),
            bytes_posted: c.bytes_posted.load(Ordering::Relaxed),
            direct_regions: c.direct_regions.load(Ordering::Relaxed),
            copy_nanos: c.copy_nanos.load(Ordering::Relaxed),
            staged_bytes: c.staged_bytes.load(Ordering::Relaxed),
        }
    }
}

/// How long a blocking call waits for the progress thread before calling it dead.
pub(crate) const CALL_BOUND: Duration = Duration::from_secs(10);

/// The callers' side of a progress thread: its command queue, the shared state and the join handle.
/// Dropping it stops the thread (see [`Handle::shutdown`]).
pub(crate) struct Handle<C: Send + 'static> {
    tx: crossbeam_channel::Sender<C>,
    pub(crate) shared: std::sync::Arc<Shared>,
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
    stop: fn() -> C,
}

/// What a progress thread's body gets: the shared state, its command queue, and where to say that
/// it started (`Ok` with a value for the caller) or why it could not.
pub(crate) type Start<C, T> = (
    std::sync::Arc<Shared>,
    crossbeam_channel::Receiver<C>,
    crossbeam_channel::Sender<Result<T, super::TransportError>>,
);

impl<C: Send + 'static> Handle<C> {
    /// Starts a thread named `name` under `scheduling` running `body`, and waits (bounded) for it
    /// to report that it started. `body` must return once it receives `stop()`.
    pub(crate) fn spawn<T: Send + 'static>(
        name: String,
        scheduling: ProgressScheduling,
        stop: fn() -> C,
        body: impl FnOnce(Start<C, T>) + Send + 'static,
    ) -> Result<(Self, T), super::TransportError> {
        let shared = std::sync::Arc::new(Shared::default());
        let (tx, rx) = crossbeam_channel::unbounded();
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || match scheduling.apply() {
                Ok(()) => body((s, rx, ready_tx)),
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| super::TransportError::Library {
                op: "spawn",
                code: 0,
                message: e.to_string(),
            })?;
        match ready_rx.recv_timeout(CALL_BOUND) {
            Ok(Ok(v)) => Ok((
                Handle {
                    tx,
                    shared,
                    thread: std::sync::Mutex::new(Some(thread)),
                    stop,
                },
                v,
            )),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            // The thread is stuck inside the library; it is left running rather than joined forever.
            Err(_) => Err(super::TransportError::Shutdown),
        }
    }

    /// Queues a command and wakes the thread if it sleeps; gives the command back if the thread is
    /// gone.
    pub(crate) fn send(&self, cmd: C) -> Result<(), C> {
        self.tx.send(cmd).map_err(|e| e.0)?;
        self.shared.ring();
        Ok(())
    }

    /// Queues the command `make` builds around a reply channel and waits (bounded) for the reply.
    pub(crate) fn call<T>(
        &self,
        make: impl FnOnce(crossbeam_channel::Sender<Result<T, super::TransportError>>) -> C,
    ) -> Result<T, super::TransportError> {
        if self.shared.on_progress_thread() {
            // Called from inside one of our own callbacks: the thread cannot answer until the caller
            // returns, so waiting would only run into the bound.
            return Err(super::TransportError::Shutdown);
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.send(make(tx))
            .map_err(|_| super::TransportError::Shutdown)?;
        rx.recv_timeout(CALL_BOUND)
            .map_err(|_| super::TransportError::Shutdown)?
    }

    /// Stops the thread and waits for it (the thread's own shutdown is bounded).
    pub(crate) fn shutdown(&self) {
        let handle = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(handle) = handle {
            let _ = self.send((self.stop)());
            // From the progress thread itself (the owner dropped inside a callback) the thread stops
            // on its own once the callback returns; joining it would deadlock.
            if !self.shared.on_progress_thread() {
                let _ = handle.join();
            }
        }
    }
}

impl<C: Send + 'static> Drop for Handle<C> {
    fn drop(&mut self) {
        self.shutdown();
    }
}
