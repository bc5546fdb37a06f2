//! Which start of a PP rank an engine admits when the rank connects.
//!
//! Every engine start draws an *incarnation* (the engine uses the clock, so a restart draws a
//! larger one) and carries it in its Hello.
//! Decode admits a prefill rank, and a PP rank admits a peer rank, only when
//! - no connection of that rank is bound (the old one must be gone first: while it is bound, its
//!   writes and votes may still arrive, and a second binding would let them count for the new
//!   start), and
//! - the incarnation is not below the last one admitted for that rank: an older start (a process
//!   that was thought dead, or a delayed connection attempt of one) never binds again. The same
//!   start may bind again once its connection is gone (a PP peer's vote mesh connection that broke
//!   while both processes live).
//!
//! Requests, votes, notifications and acknowledgements are keyed by the connection they came on,
//! which ends with the old start: nothing of it counts after the new one is admitted.

/// Why a rank's connection is not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The rank is not below the PP size.
    #[error("rank {rank} is not below the PP size {pp_size}")]
    UnknownRank {
        /// The rank announced.
        rank: u16,
        /// The PP size.
        pp_size: u16,
    },
    /// A connection of the rank is still bound.
    #[error("rank {rank} is still connected")]
    Busy {
        /// The rank.
        rank: u16,
    },
    /// The incarnation is below the last one admitted for the rank.
    #[error("rank {rank} announced incarnation {got}, already admitted the later {last}")]
    Stale {
        /// The rank.
        rank: u16,
        /// The incarnation announced.
        got: u64,
        /// The last incarnation admitted.
        last: u64,
    },
}

/// The incarnations an engine admitted, one entry per PP rank.
#[derive(Debug, Clone)]
pub struct Incarnations {
    last: Vec<Option<u64>>,
}

impl Incarnations {
    /// Nothing admitted yet for any of `pp_size` ranks.
    pub fn new(pp_size: u16) -> Self {
        Incarnations {
            last: vec![None; usize::from(pp_size)],
        }
    }

    /// Whether `rank` may bind with incarnation `got`; `busy` says whether a connection of the
    /// rank is bound now. Changes nothing: call [`admit`](Self::admit) once it binds.
    ///
    /// # Errors
    /// [`Refusal`] says why not.
    pub fn check(&self, rank: u16, got: u64, busy: bool) -> Result<(), Refusal> {
        let Some(last) = self.last.get(usize::from(rank)) else {
            return Err(Refusal::UnknownRank {
                rank,
                pp_size: u16::try_from(self.last.len()).unwrap_or(u16::MAX),
            });
        };
        if busy {
            return Err(Refusal::Busy { rank });
        }
        match *last {
            Some(last) if got < last => Err(Refusal::Stale { rank, got, last }),
            _ => Ok(()),
        }
    }

    /// [`check`](Self::check), then records `got` as `rank`'s incarnation. Returns the previous
    /// one (`Some` when this is a rejoin: a new start, or the same one connecting again).
    ///
    /// # Errors
    /// As [`check`](Self::check); nothing is recorded then.
    pub fn admit(&mut self, rank: u16, got: u64, busy: bool) -> Result<Option<u64>, Refusal> {
        self.check(rank, got, busy)?;
        let slot = &mut self.last[usize::from(rank)];
        Ok(slot.replace(got))
    }

    /// The last incarnation admitted for `rank`.
    pub fn last(&self, rank: u16) -> Option<u64> {
        self.last.get(usize::from(rank)).copied().flatten()
    }
}
