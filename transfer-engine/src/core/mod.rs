//! The sans-IO protocol core: wire formats, the completion tracker, the PP vote board and the
//! transfer planner. Nothing here does I/O or reads a clock; time comes in as an argument.
//!
//! Every state machine follows one shape (after quinn-proto): inputs arrive through
//! `handle_*(now, ...)`, outputs leave through `#[must_use] poll_*()` calls, and the driver sleeps
//! until `poll_timeout()`. `now` may repeat but must not go backwards; a machine that is handed an
//! earlier instant than one it already saw treats it as the latest one it saw, so a non-monotonic
//! caller can delay a timeout but never fire one early.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use transfer_engine::core::notify::{self, ChunkNotification, ChunkStatus, Notification};
//! use transfer_engine::core::tracker::{CompletionTracker, TrackerConfig, TrackerEvent};
//! use transfer_engine::core::{PeerId, RequestId};
//!
//! let now = Instant::now();
//! let mut tracker = CompletionTracker::new(TrackerConfig::default());
//! let request = RequestId(7);
//! tracker.expect(now, request, 1, &[PeerId(1)], now + Duration::from_secs(5))?;
//!
//! // What the prefill side sends once the chunk's writes are remotely complete.
//! let wire = ChunkNotification::new(request, 0, 0, ChunkStatus::Last { count: 1 }).encode();
//! let Notification::Chunk(n) = notify::decode(&wire)? else { unreachable!() };
//! tracker.handle_notification(now, PeerId(1), &n)?;
//! assert_eq!(tracker.poll_event(), Some(TrackerEvent::Complete { request }));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Library dependency
//! None: this module links nothing and runs anywhere.
//!
//! # Thread safety
//! Every type is plain owned data (`Send + Sync`); a machine is meant to be owned by one task.
//!
//! # Resource cleanup
//! Nothing to release. [`tracker::CompletionTracker::is_idle`] and
//! [`vote::VoteBoard::undecided`] let a driver check that its state is back to baseline.

pub mod chunkset;
mod hash;
pub mod membership;
pub mod notify;
pub mod planner;
pub mod ranges;
pub mod topology;
pub mod tracker;
pub mod vote;

pub use hash::{ChunkHasher, checksum};

/// Identifies one request across prefill and decode (SGLang calls it the bootstrap room).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// The engine's name for one transport peer (a prefill process seen from decode).
///
/// The core never interprets it; it only compares it with the peer bound to a PP rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

/// Why a rank or a peer reported failure, as carried on the wire (a `u16`).
///
/// Unknown numbers are kept in [`FailureCode::Other`] rather than rejected, so a newer peer's
/// reason still fails the request and still reaches the log with its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureCode {
    /// 0: the sender gave no reason.
    Unspecified,
    /// 1: an RDMA write (or its completion) failed.
    WriteFailed,
    /// 2: the request was aborted by its owner.
    Aborted,
    /// 3: the sender timed out waiting on something.
    Timeout,
    /// 4: the sender lost a peer it needed.
    PeerLost,
    /// 5: the sender could not get memory or pages.
    OutOfResources,
    /// 6: an internal error on the sender.
    Internal,
    /// Any other number, kept as sent.
    Other(u16),
}

impl FailureCode {
    /// Maps a wire number to a code; never fails.
    pub const fn from_raw(raw: u16) -> Self {
        match raw {
            0 => Self::Unspecified,
            1 => Self::WriteFailed,
            2 => Self::Aborted,
            3 => Self::Timeout,
            4 => Self::PeerLost,
            5 => Self::OutOfResources,
            6 => Self::Internal,
            n => Self::Other(n),
        }
    }

    /// The wire number. `Other(n)` gives back `n` even when `n` has a name of its own.
    pub const fn raw(self) -> u16 {
        match self {
            Self::Unspecified => 0,
            Self::WriteFailed => 1,
            Self::Aborted => 2,
            Self::Timeout => 3,
            Self::PeerLost => 4,
            Self::OutOfResources => 5,
            Self::Internal => 6,
            Self::Other(n) => n,
        }
    }
}

impl std::fmt::Display for FailureCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Other(n) => write!(f, "code {n}"),
            named => write!(f, "{named:?} (code {})", named.raw()),
        }
    }
}

/// Clamps time so that it never runs backwards inside one machine.
#[derive(Debug, Clone, Copy)]
struct Clock {
    latest: Option<std::time::Instant>,
}

impl Clock {
    const fn new() -> Self {
        Self { latest: None }
    }

    fn observe(&mut self, now: std::time::Instant) -> std::time::Instant {
        let t = match self.latest {
            Some(l) if l > now => l,
            _ => now,
        };
        self.latest = Some(t);
        t
    }
}
