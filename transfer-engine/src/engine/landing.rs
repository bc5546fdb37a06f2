//! Copying chunks out of landing memory away from the decode engine's lock and progress thread.
//!
//! A decode engine that lends landing memory copies every chunk written there into the request's
//! pages. That copy is a pass over every byte of the chunk; on the transport's progress thread and
//! under the engine's lock it held up every other notification, control message and call into the
//! engine while it ran. Here it runs on a few worker threads of the engine's own:
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
                        run(job);
                    }
                })?;
            queues.push(tx);
        }
        Ok(Self { queues })
    }

    /// Queues `job` on the worker of `key`. Gives the job back if that worker is gone (it panicked).
    pub(super) fn send(&self, key: u64, job: J) -> Result<(), J> {
        let at = usize::try_from(key % self.queues.len() as u64).unwrap_or(0);
        self.queues[at].send(job).map_err(|e| e.0)
    }
}

/// How many workers a decode engine copies with: one per core, at most four.
pub(super) fn worker_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
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
}
