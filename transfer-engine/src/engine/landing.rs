//! Passes over a chunk's bytes away from the decode engine's lock and progress thread.
//!
//! A decode engine that lends landing memory copies every chunk written there into the request's
//! pages, and one that verifies checksums hashes every chunk from its pages. Each is a pass over
//! every byte of the chunk; on the transport's progress thread and under the engine's lock it held
//! up every other notification, control message and call into the engine while it ran. Here they
//! run on a few worker threads of the engine's own:
//!
//! - [`Workers`] hands each job to one worker by a key (the request's id), so the jobs of one key
//!   run one at a time, in the order they were sent.
//! - [`Gate`] lets the engine take a request's pages back while a copy into them is queued or
//!   running: [`Gate::revoke`] returns once no piece of the copy runs and none will start, so pages
//!   released after it never receive a byte from an old copy.
//!
//! # Thread safety
//! Both types are `Send + Sync`. A worker takes no lock of this module while it runs a job, and a
//! piece of a copy ([`Gate::run`]) holds only its gate's lock: the engine may revoke a gate while it
//! holds its own lock, as long as nothing run under a gate takes the engine's lock.
//!
//! # Resource cleanup
//! A worker ends when its [`Workers`] is dropped and its queue is empty; nothing joins it, so the
//! last job may run after the drop returns.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

/// Whether the pages a copy writes into are still the request's.
#[derive(Debug, Default)]
pub(super) struct Gate {
    /// Set first by a revoke, so that a copier that is between two pieces stops at once rather
    /// than taking the lock again ahead of the revoke, piece after piece.
    revoked: AtomicBool,
    /// Held while a piece runs.
    piece: Mutex<()>,
}

impl Gate {
    /// Runs one piece of a copy, unless the gate was revoked; false if it was (and `piece` did not
    /// run). A revoke waits for a running piece.
    pub(super) fn run(&self, piece: impl FnOnce()) -> bool {
        if self.revoked() {
            return false;
        }
        let _running = self.piece.lock().unwrap_or_else(|e| e.into_inner());
        // A revoke that took the lock before us has returned: our lock happens after its store.
        if self.revoked() {
            return false;
        }
        piece();
        true
    }

    /// Whether [`revoke`](Self::revoke) was called.
    pub(super) fn revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }

    /// Stops every later piece; returns once a piece that was running has ended.
    pub(super) fn revoke(&self) {
        self.revoked.store(true, Ordering::Release);
        drop(self.piece.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

/// Worker threads that run jobs, those of one key in order on one thread.
pub(super) struct Workers<J> {
    queues: Vec<mpsc::Sender<J>>,
}

impl<J: Send + 'static> Workers<J> {
    /// Starts `count` workers (at least one), named `name-<i>`, each running `run` on its jobs.
    ///
    /// # Errors
    /// The OS would not start a thread; the workers started already end.
    pub(super) fn spawn(
        count: usize,
        name: &str,
        run: Arc<dyn Fn(J) + Send + Sync>,
    ) -> std::io::Result<Self> {
        let mut queues = Vec::with_capacity(count.max(1));
        for i in 0..count.max(1) {
            let (tx, rx) = mpsc::channel::<J>();
            let run = run.clone();
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        // A job that panics (a bug) is logged and the worker goes on: its keys'
                        // later jobs must still run.
                        let ran =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(job)));
                        if ran.is_err() {
                            tracing::error!(worker = i, "a job on a chunk worker panicked");
                        }
                    }
                })?;
            queues.push(tx);
        }
        Ok(Self { queues })
    }

    /// Queues `job` on the worker of `key`. Gives the job back if that worker is gone.
    pub(super) fn send(&self, key: u64, job: J) -> Result<(), J> {
        // Keys mixed first (Fibonacci hashing): callers' ids may share a stride.
        let mixed = key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        let at = usize::try_from(mixed % self.queues.len() as u64).unwrap_or(0);
        self.queues[at].send(job).map_err(|e| e.0)
    }
}

/// How many workers a decode engine copies with: one per core, at most four.
pub(super) fn worker_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
}

/// One piece of a write's copy out of landing memory: `rows` rows from `row`, of each `len` bytes
/// from `skip`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Piece {
    pub(super) row: u64,
    pub(super) rows: u64,
    pub(super) skip: u64,
    pub(super) len: u64,
}

/// The most bytes one piece copies: a piece holds its request's gate, which the engine may wait for
/// under its own lock.
pub(super) const PIECE_BYTES: u64 = 256 << 10;

/// Cuts a write of `rows` rows of `len` bytes into pieces of at most [`PIECE_BYTES`]: whole rows
/// where they fit, a row cut in parts where one does not.
pub(super) fn landing_pieces(len: u64, rows: u64) -> impl Iterator<Item = Piece> {
    let per = (PIECE_BYTES / len.max(1)).max(1);
    let parts = if len > PIECE_BYTES {
        len.div_ceil(PIECE_BYTES)
    } else {
        1
    };
    let groups = if parts > 1 { rows } else { rows.div_ceil(per) };
    (0..groups).flat_map(move |g| {
        (0..parts).map(move |p| {
            if parts > 1 {
                let skip = p * PIECE_BYTES;
                Piece {
                    row: g,
                    rows: 1,
                    skip,
                    len: PIECE_BYTES.min(len - skip),
                }
            } else {
                let row = g * per;
                Piece {
                    row,
                    rows: per.min(rows - row),
                    skip: 0,
                    len,
                }
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    #[test]
    fn a_revoke_waits_for_the_running_piece_and_stops_the_rest() {
        let gate = Arc::new(Gate::default());
        let (started_tx, started) = mpsc::channel();
        let (finish, finish_rx) = mpsc::channel::<()>();
        let ran = Arc::new(AtomicUsize::new(0));
        let copier = {
            let (gate, ran) = (gate.clone(), ran.clone());
            std::thread::spawn(move || {
                let mut done = 0;
                for _ in 0..3 {
                    let went = gate.run(|| {
                        let _ = started_tx.send(());
                        let _ = finish_rx.recv();
                        ran.fetch_add(1, Ordering::SeqCst);
                    });
                    if !went {
                        break;
                    }
                    done += 1;
                }
                done
            })
        };
        // The first piece is running: a revoke must wait for it.
        started.recv().expect("the first piece started");
        let revoker = {
            let gate = gate.clone();
            std::thread::spawn(move || gate.revoke())
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !revoker.is_finished(),
            "revoke returned with a piece running"
        );
        assert_eq!(ran.load(Ordering::SeqCst), 0);
        finish.send(()).expect("the piece waits");
        revoker.join().expect("the revoker ended");
        // Once revoke returned, no piece starts.
        assert_eq!(copier.join().expect("the copier ended"), 1);
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        assert!(gate.revoked());
        assert!(!gate.run(|| panic!("a piece ran after the revoke")));
    }

    #[test]
    fn jobs_of_one_key_run_in_order_on_one_worker() {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let run: Arc<dyn Fn((u64, u32)) + Send + Sync> = Arc::new(move |(key, n)| {
            let name = std::thread::current().name().map(str::to_owned);
            let _ = tx
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .send((key, n, name));
        });
        let workers = Workers::spawn(3, "test-land", run).expect("threads");
        for n in 0..200u32 {
            for key in 0..5u64 {
                assert!(workers.send(key, (key, n)).is_ok());
            }
        }
        drop(workers);
        let mut seen: std::collections::HashMap<u64, (u32, Option<String>)> = Default::default();
        let mut count = 0;
        while let Ok((key, n, name)) = rx.recv_timeout(Duration::from_secs(10)) {
            count += 1;
            match seen.get(&key) {
                Some((last, on)) => {
                    assert_eq!(n, last + 1, "key {key}: job {n} after {last}");
                    assert_eq!(&name, on, "key {key} moved between workers");
                }
                None => assert_eq!(n, 0),
            }
            seen.insert(key, (n, name));
            if count == 1000 {
                break;
            }
        }
        assert_eq!(count, 1000);
    }

    #[test]
    fn a_job_that_panics_leaves_its_worker_running() {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let run: Arc<dyn Fn(u32) + Send + Sync> = Arc::new(move |n| {
            assert_ne!(n, 1, "job 1 panics");
            let _ = tx.lock().unwrap_or_else(|e| e.into_inner()).send(n);
        });
        let workers = Workers::spawn(1, "test-panic", run).expect("threads");
        for n in 0..3 {
            assert!(workers.send(7, n).is_ok());
        }
        let got: Vec<u32> = (0..2)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).expect("a job ran"))
            .collect();
        assert_eq!(got, vec![0, 2]);
        assert!(workers.send(7, 3).is_ok());
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(3));
    }

    proptest::proptest! {
        /// The pieces cover every byte of every row once, in order, none over `PIECE_BYTES`.
        #[test]
        fn pieces_cover_each_row_once_in_order(len in 1u64..(1 << 21), rows in 1u64..3000) {
            let mut next = (0u64, 0u64);
            for p in landing_pieces(len, rows) {
                proptest::prop_assert!(p.rows >= 1 && p.len >= 1);
                proptest::prop_assert!(p.rows * p.len <= PIECE_BYTES.max(len.min(PIECE_BYTES)));
                proptest::prop_assert_eq!((p.row, p.skip), next);
                proptest::prop_assert!(p.skip + p.len <= len);
                proptest::prop_assert!(p.rows == 1 || (p.skip == 0 && p.len == len));
                next = if p.skip + p.len == len {
                    (p.row + p.rows, 0)
                } else {
                    (p.row, p.skip + p.len)
                };
            }
            proptest::prop_assert_eq!(next, (rows, 0));
        }
    }
}
