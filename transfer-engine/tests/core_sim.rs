//! A seeded, deterministic simulated cluster: four prefill PP ranks and one decode, exchanging
//! chunk notifications (delayed, reordered, lost, duplicated) and PP votes (delayed, ordered
//! per peer) on a virtual clock, with rank failures and crashes. Thousands of seeds; invariants
//! are checked after each.
#![allow(clippy::unwrap_used)]

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use transfer_engine::core::notify::{self, ChunkNotification, ChunkStatus, Notification, TextForm};
use transfer_engine::core::tracker::{
    CompletionTracker, FailureReason, TrackerConfig, TrackerEvent,
};
use transfer_engine::core::vote::{Decision, Vote, VoteBoard, VoteConfig, VoteMessage};
use transfer_engine::core::{FailureCode, PeerId, RequestId};

const PP: u16 = 4;

#[derive(Debug, Clone)]
enum Ev {
    Expect { req: u64 },
    Chunk { rank: u16, req: u64, chunk: u32 },
    Notif { rank: u16, bytes: Vec<u8> },
    Vote { to: u16, from: u16, bytes: Vec<u8> },
    Crash { rank: u16 },
    LossNotice { rank: u16 },
}

struct Sim {
    rng: ChaCha8Rng,
    t0: Instant,
    now_ms: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: HashMap<u64, Ev>,
    /// Per (from, to): the latest delivery time, so vote delivery stays in order per peer.
    vote_fifo: HashMap<(u16, u16), u64>,
    loss: f64,
    dup: f64,
    text: bool,
}

impl Sim {
    fn at(&self, ms: u64) -> Instant {
        self.t0 + Duration::from_millis(ms)
    }

    fn schedule(&mut self, at_ms: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((at_ms, self.seq)));
        self.events.insert(self.seq, ev);
    }

    /// The data plane: may lose, duplicate and reorder.
    fn send_notif(&mut self, rank: u16, n: &ChunkNotification) {
        let bytes = match (self.text, n.status) {
            (true, ChunkStatus::More | ChunkStatus::Last { .. }) => {
                n.encode_text(TextForm::WithPpRank).unwrap().into_bytes()
            }
            _ => n.encode().to_vec(),
        };
        if self.rng.random_bool(self.loss) {
            return;
        }
        let copies = if self.rng.random_bool(self.dup) { 2 } else { 1 };
        for _ in 0..copies {
            let d = self.rng.random_range(0..30);
            self.schedule(
                self.now_ms + d,
                Ev::Notif {
                    rank,
                    bytes: bytes.clone(),
                },
            );
        }
    }

    /// The control plane: reliable and ordered per (from, to), with delay up to 20 ms.
    fn send_vote(&mut self, from: u16, to: u16, msg: &VoteMessage) {
        let d = self.rng.random_range(0..20);
        let last = self.vote_fifo.get(&(from, to)).copied().unwrap_or(0);
        let at = (self.now_ms + d).max(last);
        self.vote_fifo.insert((from, to), at);
        self.schedule(
            at,
            Ev::Vote {
                to,
                from,
                bytes: msg.encode().to_vec(),
            },
        );
    }
}

#[derive(Default, Debug)]
struct Plan {
    counts: Vec<u32>,
    /// rank -> chunk at which it fails the request.
    fail_at: HashMap<u16, u32>,
}

/// Outcome counts of one seed, to check that the seeds reach every path.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Stats {
    complete: u64,
    timeout: u64,
    peer_failed: u64,
    peer_lost: u64,
    decided_failed: u64,
}

fn run_seed(seed: u64) -> Result<Stats, String> {
    let mut stats = Stats::default();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let loss = [0.0, 0.0, 0.01, 0.1][rng.random_range(0..4)];
    let dup = [0.0, 0.1, 0.5][rng.random_range(0..3)];
    let text = rng.random_bool(0.25);
    let crash = rng.random_bool(0.15).then(|| rng.random_range(0..PP));
    let n_req = rng.random_range(1..=4u64);
    let t0 = Instant::now();
    let mut sim = Sim {
        rng: ChaCha8Rng::seed_from_u64(seed ^ 0xA5A5),
        t0,
        now_ms: 0,
        seq: 0,
        queue: BinaryHeap::new(),
        events: HashMap::new(),
        vote_fifo: HashMap::new(),
        loss,
        dup,
        text,
    };
    let deadline_ms = 3_000;
    let mut tracker = CompletionTracker::new(TrackerConfig::default());
    let mut boards: Vec<VoteBoard> = (0..PP)
        .map(|r| {
            let mut c = VoteConfig::new(PP, r);
            c.vote_timeout = Some(Duration::from_millis(deadline_ms));
            VoteBoard::new(c).unwrap()
        })
        .collect();
    let peers: Vec<PeerId> = (0..PP).map(|r| PeerId(10 + u64::from(r))).collect();
    let mut plans: BTreeMap<u64, Plan> = BTreeMap::new();
    for req in 0..n_req {
        let mut p = Plan::default();
        for rank in 0..PP {
            let count = rng.random_range(1..=8u32);
            p.counts.push(count);
            if rng.random_bool(0.05) {
                p.fail_at.insert(rank, rng.random_range(0..count));
            }
            sim.schedule(
                rng.random_range(0..10),
                Ev::Chunk {
                    rank,
                    req,
                    chunk: 0,
                },
            );
        }
        // Sometimes the decode side registers the request after the first notifications.
        sim.schedule(rng.random_range(0..15), Ev::Expect { req });
        plans.insert(req, p);
    }
    let crash_at = rng.random_range(0..60);
    if let Some(rank) = crash {
        sim.schedule(crash_at, Ev::Crash { rank });
    }
    let mut crashed: HashSet<u16> = HashSet::new();
    // What actually reached the decode side intact, per (req, rank).
    let mut delivered: HashMap<(u64, u16), HashSet<u32>> = HashMap::new();
    let mut voted: HashMap<(u64, u16), Vote> = HashMap::new();
    let mut tracker_events: Vec<TrackerEvent> = Vec::new();
    let mut decisions: Vec<HashMap<u64, Decision>> = vec![HashMap::new(); usize::from(PP)];

    while let Some(Reverse((at, seq))) = sim.queue.pop() {
        sim.now_ms = at;
        let now = sim.at(at);
        let ev = sim.events.remove(&seq).unwrap();
        match ev {
            Ev::Expect { req } => {
                tracker
                    .expect(now, RequestId(req), PP, &peers, sim.at(at + deadline_ms))
                    .map_err(|e| format!("expect: {e}"))?;
            }
            Ev::Chunk { rank, req, chunk } => {
                if crashed.contains(&rank) {
                    continue;
                }
                let plan = &plans[&req];
                let count = plan.counts[usize::from(rank)];
                let fail = plan.fail_at.get(&rank) == Some(&chunk);
                let status = if fail {
                    ChunkStatus::Failed {
                        code: FailureCode::WriteFailed,
                    }
                } else if chunk + 1 == count {
                    ChunkStatus::Last { count }
                } else {
                    ChunkStatus::More
                };
                let n = ChunkNotification::new(RequestId(req), rank, chunk, status);
                sim.send_notif(rank, &n);
                let vote = if fail {
                    Some(Vote::Failed(FailureCode::WriteFailed))
                } else if chunk + 1 == count {
                    Some(Vote::Completed)
                } else {
                    let d = sim.rng.random_range(1..6);
                    sim.schedule(
                        at + d,
                        Ev::Chunk {
                            rank,
                            req,
                            chunk: chunk + 1,
                        },
                    );
                    None
                };
                if let Some(v) = vote {
                    // Voted from the transfer-completion path itself.
                    voted.insert((req, rank), v);
                    boards[usize::from(rank)]
                        .handle_local_vote(now, RequestId(req), v)
                        .map_err(|e| format!("local vote: {e}"))?;
                }
            }
            Ev::Notif { rank, bytes } => {
                let Ok(Notification::Chunk(n)) = notify::decode(&bytes) else {
                    return Err("undecodable notification".into());
                };
                if !matches!(n.status, ChunkStatus::Failed { .. }) {
                    delivered
                        .entry((n.request.0, rank))
                        .or_default()
                        .insert(n.chunk_id);
                }
                let _ = tracker.handle_notification(now, peers[usize::from(rank)], &n);
            }
            Ev::Vote { to, from, bytes } => {
                if crashed.contains(&to) {
                    continue;
                }
                let msg = VoteMessage::decode(&bytes).map_err(|e| format!("vote decode: {e}"))?;
                boards[usize::from(to)]
                    .handle_peer_message(now, from, &msg)
                    .map_err(|e| format!("peer message {from}->{to}: {e}"))?;
            }
            Ev::Crash { rank } => {
                crashed.insert(rank);
                // Detected after every message it sent has arrived (longest delay is 30 ms).
                sim.schedule(at + 50, Ev::LossNotice { rank });
            }
            Ev::LossNotice { rank } => {
                tracker.handle_peer_lost(now, peers[usize::from(rank)]);
                for (r, b) in boards.iter_mut().enumerate() {
                    if r != usize::from(rank) && !crashed.contains(&(r as u16)) {
                        b.handle_peer_lost(now, rank).map_err(|e| e.to_string())?;
                    }
                }
            }
        }
        // The driver's loop: timers, then drain every output.
        tracker.handle_timeout(now);
        tracker_events.extend(std::iter::from_fn(|| tracker.poll_event()));
        for r in 0..PP {
            let b = &mut boards[usize::from(r)];
            b.handle_timeout(now);
            let out: Vec<_> = std::iter::from_fn(|| b.poll_transmit()).collect();
            let ds: Vec<_> = std::iter::from_fn(|| b.poll_decision()).collect();
            if crashed.contains(&r) {
                continue;
            }
            for (to, msg) in out {
                sim.send_vote(r, to, &msg);
            }
            for (req, d) in ds {
                if decisions[usize::from(r)].insert(req.0, d).is_some() {
                    return Err(format!("rank {r} decided {req:?} twice"));
                }
            }
        }
    }
    // Let every deadline pass.
    let end = sim.at(sim.now_ms + 2 * deadline_ms + 10);
    tracker.handle_timeout(end);
    tracker_events.extend(std::iter::from_fn(|| tracker.poll_event()));
    for r in 0..PP {
        let b = &mut boards[usize::from(r)];
        b.handle_timeout(end);
        let ds: Vec<_> = std::iter::from_fn(|| b.poll_decision()).collect();
        if !crashed.contains(&r) {
            for (req, d) in ds {
                if decisions[usize::from(r)].insert(req.0, d).is_some() {
                    return Err(format!("rank {r} decided {req:?} twice"));
                }
            }
        }
    }

    // Decode: exactly one terminal event per request; Complete only if everything arrived.
    if !tracker.is_idle() {
        return Err("tracker not idle at the end".into());
    }
    for (&req, plan) in &plans {
        let evs: Vec<_> = tracker_events
            .iter()
            .filter(|e| match e {
                TrackerEvent::Complete { request } | TrackerEvent::Failed { request, .. } => {
                    request.0 == req
                }
            })
            .collect();
        if evs.len() != 1 {
            return Err(format!("request {req}: {} terminal events", evs.len()));
        }
        let all_arrived = (0..PP).all(|r| {
            !plan.fail_at.contains_key(&r)
                && delivered
                    .get(&(req, r))
                    .is_some_and(|s| s.len() == plan.counts[usize::from(r)] as usize)
        });
        match evs[0] {
            TrackerEvent::Complete { .. } if !all_arrived => {
                return Err(format!("request {req} complete without every chunk"));
            }
            TrackerEvent::Failed { reason, .. } => {
                match reason {
                    FailureReason::Timeout => stats.timeout += 1,
                    FailureReason::PeerFailed { .. } => stats.peer_failed += 1,
                    FailureReason::PeerLost { .. } => stats.peer_lost += 1,
                    _ => {}
                }
                let explained = match reason {
                    FailureReason::PeerFailed { rank, .. } => plan.fail_at.contains_key(rank),
                    FailureReason::PeerLost { rank, .. } => crash == Some(*rank),
                    FailureReason::Timeout => !all_arrived,
                    _ => false,
                };
                if !explained {
                    return Err(format!("request {req} failed with {reason:?} unexplained"));
                }
                if all_arrived && crash.is_none() {
                    return Err(format!("request {req} failed although all arrived"));
                }
            }
            TrackerEvent::Complete { .. } => stats.complete += 1,
        }
    }

    // Prefill: every live rank decides every request once; Completed only if every rank voted
    // Completed; with no crash, all ranks agree.
    for r in 0..PP {
        if crashed.contains(&r) {
            continue;
        }
        if boards[usize::from(r)].undecided() != 0 {
            return Err(format!("rank {r} left requests undecided"));
        }
        for &req in plans.keys() {
            let Some(d) = decisions[usize::from(r)].get(&req) else {
                return Err(format!("rank {r} never decided {req}"));
            };
            let all_completed = (0..PP).all(|k| voted.get(&(req, k)) == Some(&Vote::Completed));
            if *d != Decision::Completed {
                stats.decided_failed += 1;
            }
            if *d == Decision::Completed && !all_completed {
                return Err(format!("rank {r} completed {req} without all votes"));
            }
            if crash.is_none() && (*d == Decision::Completed) != all_completed {
                return Err(format!("rank {r} decided {req} {d:?} against the votes"));
            }
        }
    }
    if crash.is_none() {
        for &req in plans.keys() {
            let first = decisions[0][&req];
            if (1..usize::from(PP)).any(|r| decisions[r][&req] != first) {
                return Err(format!("ranks disagree on {req}"));
            }
            // Decode complete implies every rank voted completed, so prefill decided Completed.
            let decode_complete = tracker_events
                .iter()
                .any(|e| matches!(e, TrackerEvent::Complete { request } if request.0 == req));
            if decode_complete && first != Decision::Completed {
                return Err(format!(
                    "decode complete but prefill decided {first:?} on {req}"
                ));
            }
        }
    }
    Ok(stats)
}

#[test]
fn simulated_cluster_many_seeds() {
    let seeds = 3000u64;
    let results: Vec<Result<Stats, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u64)
            .map(|part| {
                s.spawn(move || {
                    (0..seeds)
                        .filter(|i| i % 2 == part)
                        .map(|seed| run_seed(seed).map_err(|e| format!("seed {seed}: {e}")))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let failures: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failures.is_empty(),
        "{} failing seeds, first: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    let total = results
        .iter()
        .flatten()
        .fold(Stats::default(), |a, b| Stats {
            complete: a.complete + b.complete,
            timeout: a.timeout + b.timeout,
            peer_failed: a.peer_failed + b.peer_failed,
            peer_lost: a.peer_lost + b.peer_lost,
            decided_failed: a.decided_failed + b.decided_failed,
        });
    // Every path was taken by some seed.
    assert!(
        total.complete > 1000
            && total.timeout > 50
            && total.peer_failed > 50
            && total.peer_lost > 50
            && total.decided_failed > 100,
        "{total:?}"
    );
}

#[test]
fn simulation_is_deterministic() {
    // Same seed, same outcome (the run has no hidden source of randomness or time).
    for seed in [1u64, 77, 4242] {
        assert_eq!(run_seed(seed), run_seed(seed));
    }
}
