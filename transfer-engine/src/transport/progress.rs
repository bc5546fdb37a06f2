//! What both backends' progress threads share: their counters, and the handshake that lets the thread
//! sleep when idle while the threads queueing commands wake it only when it really sleeps (a busy
//! engine pays no system call per command).

use super::TransportStats;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::Thread;
use std::time::Duration;

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
}

/// State shared between a progress thread and the threads that talk to it.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    sleeping: AtomicBool,
    active: AtomicBool,
    thread: OnceLock<Thread>,
    pub(crate) counters: Counters,
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

    /// Wakes the progress thread if it sleeps. Called after queueing a command.
    pub(crate) fn ring(&self) {
        // Pairs with the fence in `sleep`: either the thread sees the command before it sleeps, or we
        // see it asleep and unpark it (an unpark before its park makes that park return at once).
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst)
            && let Some(t) = self.thread.get()
        {
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
            notifications: c.notifications.load(Ordering::Relaxed),
            bytes_posted: c.bytes_posted.load(Ordering::Relaxed),
        }
    }
}
