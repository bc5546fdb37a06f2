//! Completion tracker: the seed regression, rules one by one, and properties over any order,
//! duplication, loss and corruption of notifications, with `LAST` on any chunk, repeated, and
//! after the rest.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use transfer_engine::core::notify::{ChunkNotification, ChunkStatus};
use transfer_engine::core::tracker::{
    Accepted, CompletionTracker, FailureReason, NotifyError, TrackerConfig, TrackerError,
    TrackerEvent, ViolationKind,
};
use transfer_engine::core::{FailureCode, PeerId, RequestId};

fn peers(pp: u16) -> Vec<PeerId> {
    (0..pp).map(|r| PeerId(100 + u64::from(r))).collect()
}

fn chunk(req: u64, rank: u16, id: u32, count: u32) -> ChunkNotification {
    let status = if id + 1 == count {
        ChunkStatus::Last { count }
    } else {
        ChunkStatus::More
    };
    ChunkNotification::new(RequestId(req), rank, id, status)
}

fn drain(t: &mut CompletionTracker) -> Vec<TrackerEvent> {
    std::iter::from_fn(|| t.poll_event()).collect()
}

/// The bug this tracker exists to prevent: PP=4, every rank sends chunk ids 0..n, rank 0 first
/// (all of it, including LAST). One shared set of chunk ids would call it complete there.
#[test]
fn seed_regression_pp4_not_complete_until_all_ranks() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new(TrackerConfig::default());
    let p = peers(4);
    let n = 8;
    t.expect(t0, RequestId(1), 4, &p, t0 + Duration::from_secs(10))
        .unwrap();
    for rank in 0..4u16 {
        for id in 0..n {
            assert_eq!(
                t.poll_event(),
                None,
                "complete early at rank {rank} chunk {id}"
            );
            let a = t
                .handle_notification(t0, p[usize::from(rank)], &chunk(1, rank, id, n))
                .unwrap();
            assert_eq!(a, Accepted::NewChunk);
        }
        if rank < 3 {
            assert!(t.is_in_flight(RequestId(1)));
        }
    }
    assert_eq!(
        drain(&mut t),
        vec![TrackerEvent::Complete {
            request: RequestId(1)
        }]
    );
    assert!(t.is_idle());
}

#[test]
fn last_first_then_the_rest() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new(TrackerConfig::default());
    let p = peers(2);
    t.expect(t0, RequestId(9), 2, &p, t0 + Duration::from_secs(1))
        .unwrap();
    for rank in [1u16, 0] {
        for id in (0..5).rev() {
            t.handle_notification(t0, p[usize::from(rank)], &chunk(9, rank, id, 5))
                .unwrap();
        }
    }
    assert_eq!(drain(&mut t).len(), 1);
    // Anything after the end is late.
    assert_eq!(
        t.handle_notification(t0, p[0], &chunk(9, 0, 0, 5)),
        Ok(Accepted::Late)
    );
    assert_eq!(t.counters().late, 1);
}

fn last(req: u64, rank: u16, id: u32, count: u32) -> ChunkNotification {
    ChunkNotification::new(RequestId(req), rank, id, ChunkStatus::Last { count })
}

fn more(req: u64, rank: u16, id: u32) -> ChunkNotification {
    ChunkNotification::new(RequestId(req), rank, id, ChunkStatus::More)
}

/// Issue 10, item 5: every chunk `0..count` arrived as `More`, and only then a `LAST` came that
/// names a chunk already present (a repeat of chunk 2, or chunk 0 carrying the count). The rank
/// is done at that point; it once never became done, and the request timed out.
#[test]
fn last_after_every_chunk_completes_once() {
    let t0 = Instant::now();
    let dl = t0 + Duration::from_secs(1);
    let p = peers(1);
    for (req, last_id) in [(1u64, 2u32), (2, 0), (3, 1)] {
        let mut t = CompletionTracker::new(TrackerConfig::default());
        t.expect(t0, RequestId(req), 1, &p, dl).unwrap();
        for id in 0..3 {
            assert_eq!(
                t.handle_notification(t0, p[0], &more(req, 0, id)),
                Ok(Accepted::NewChunk)
            );
        }
        assert_eq!(t.poll_event(), None, "complete before any LAST");
        assert_eq!(
            t.handle_notification(t0, p[0], &last(req, 0, last_id, 3)),
            Ok(Accepted::Duplicate),
            "LAST on chunk {last_id}"
        );
        assert_eq!(
            drain(&mut t),
            vec![TrackerEvent::Complete {
                request: RequestId(req)
            }],
            "LAST on chunk {last_id}"
        );
        assert_eq!(
            t.handle_notification(t0, p[0], &last(req, 0, last_id, 3)),
            Ok(Accepted::Late)
        );
        t.handle_timeout(dl);
        assert_eq!(t.poll_event(), None, "a second terminal event");
        let c = t.counters();
        assert_eq!((c.new_chunks, c.duplicates, c.late), (3, 1, 1), "{c:?}");
        assert!(t.is_idle());
    }
}

/// The same with PP=2, plus the other side of the fix: a rank that is already done stays counted
/// once however often its `LAST` repeats, so repeats cannot stand in for a missing rank.
#[test]
fn repeated_last_counts_a_rank_once() {
    let t0 = Instant::now();
    let dl = t0 + Duration::from_secs(1);
    let mut t = CompletionTracker::new(TrackerConfig::default());
    let p = peers(2);
    t.expect(t0, RequestId(7), 2, &p, dl).unwrap();
    for id in 0..3 {
        t.handle_notification(t0, p[0], &chunk(7, 0, id, 3))
            .unwrap();
    }
    for id in [2, 0, 1, 2] {
        assert_eq!(
            t.handle_notification(t0, p[0], &last(7, 0, id, 3)),
            Ok(Accepted::Duplicate)
        );
    }
    assert_eq!(t.poll_event(), None, "rank 0 alone completed it");
    for id in [1, 0, 2] {
        t.handle_notification(t0, p[1], &more(7, 1, id)).unwrap();
    }
    assert_eq!(t.poll_event(), None, "complete before rank 1's LAST");
    assert_eq!(
        t.handle_notification(t0, p[1], &last(7, 1, 0, 3)),
        Ok(Accepted::Duplicate)
    );
    assert_eq!(
        drain(&mut t),
        vec![TrackerEvent::Complete {
            request: RequestId(7)
        }]
    );
    t.handle_timeout(dl);
    assert_eq!(t.poll_event(), None);
    assert!(t.is_idle());
}

/// `LAST` may name any chunk below its count, new or not; the count must still agree and still
/// bound every chunk.
#[test]
fn last_on_an_earlier_chunk() {
    let t0 = Instant::now();
    let dl = t0 + Duration::from_secs(1);
    let mut t = CompletionTracker::new(TrackerConfig::default());
    let p = peers(1);
    for r in 1..=3 {
        t.expect(t0, RequestId(r), 1, &p, dl).unwrap();
    }
    // 1: the count comes first, on chunk 0; chunks 1 and 2 finish the rank.
    assert_eq!(
        t.handle_notification(t0, p[0], &last(1, 0, 0, 3)),
        Ok(Accepted::NewChunk)
    );
    t.handle_notification(t0, p[0], &more(1, 0, 2)).unwrap();
    assert_eq!(t.poll_event(), None);
    t.handle_notification(t0, p[0], &more(1, 0, 1)).unwrap();
    assert_eq!(
        drain(&mut t),
        vec![TrackerEvent::Complete {
            request: RequestId(1)
        }]
    );
    // 2: a LAST on an earlier chunk whose count is below a chunk already seen.
    t.handle_notification(t0, p[0], &more(2, 0, 3)).unwrap();
    assert!(matches!(
        t.handle_notification(t0, p[0], &last(2, 0, 1, 3)),
        Err(NotifyError::Violation {
            kind: ViolationKind::ChunkBeyondCount {
                chunk_id: 3,
                count: 3
            },
            ..
        })
    ));
    // 3: a repeat of the LAST with a different count.
    for id in 0..3 {
        t.handle_notification(t0, p[0], &more(3, 0, id)).unwrap();
    }
    assert!(t.handle_notification(t0, p[0], &last(3, 0, 1, 4)).is_ok());
    assert!(matches!(
        t.handle_notification(t0, p[0], &last(3, 0, 2, 3)),
        Err(NotifyError::Violation {
            kind: ViolationKind::CountChanged {
                first: 4,
                second: 3
            },
            ..
        })
    ));
    let ev = drain(&mut t);
    assert_eq!(ev.len(), 2, "{ev:?}");
    assert!(ev.iter().all(|e| matches!(e, TrackerEvent::Failed { .. })));
}

#[test]
fn wrong_peer_cannot_complete_or_fail() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new(TrackerConfig::default());
    let p = peers(2);
    let evil = PeerId(666);
    t.expect(t0, RequestId(3), 2, &p, t0 + Duration::from_secs(1))
        .unwrap();
    // Rank 0's peer speaks for rank 1, and an unbound peer speaks for both.
    for (from, rank) in [(p[0], 1u16), (evil, 0), (evil, 1)] {
        let e = t.handle_notification(t0, from, &chunk(3, rank, 0, 1));
        assert!(matches!(e, Err(NotifyError::WrongPeer { .. })), "{e:?}");
        let fail = ChunkNotification::new(
            RequestId(3),
            rank,
            0,
            ChunkStatus::Failed {
                code: FailureCode::WriteFailed,
            },
        );
        assert!(t.handle_notification(t0, from, &fail).is_err());
    }
    // Out-of-range rank, even from a bound peer, is dropped without failing anything.
    assert!(matches!(
        t.handle_notification(t0, p[0], &chunk(3, 2, 0, 1)),
        Err(NotifyError::RankOutOfRange { .. })
    ));
    assert_eq!(t.poll_event(), None);
    assert_eq!(t.counters().wrong_peer, 6);
    t.handle_notification(t0, p[0], &chunk(3, 0, 0, 1)).unwrap();
    t.handle_notification(t0, p[1], &chunk(3, 1, 0, 1)).unwrap();
    assert_eq!(
        drain(&mut t),
        vec![TrackerEvent::Complete {
            request: RequestId(3)
        }]
    );
}

#[test]
fn violations_fail_only_their_request() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new(TrackerConfig::default());
    let p = peers(1);
    let dl = t0 + Duration::from_secs(1);
    for r in 1..=5 {
        t.expect(t0, RequestId(r), 1, &p, dl).unwrap();
    }
    t.expect(t0, RequestId(99), 1, &p, dl).unwrap();
    // 1: count changes.
    t.handle_notification(t0, p[0], &chunk(1, 0, 3, 4)).unwrap();
    let e = t.handle_notification(
        t0,
        p[0],
        &ChunkNotification::new(RequestId(1), 0, 4, ChunkStatus::Last { count: 5 }),
    );
    assert!(matches!(
        e,
        Err(NotifyError::Violation {
            kind: ViolationKind::CountChanged {
                first: 4,
                second: 5
            },
            ..
        })
    ));
    // 2: chunk beyond a known count.
    t.handle_notification(t0, p[0], &chunk(2, 0, 1, 2)).unwrap();
    assert!(t.handle_notification(t0, p[0], &chunk(2, 0, 2, 9)).is_err());
    // 3: chunk beyond a count that arrives later.
    t.handle_notification(t0, p[0], &chunk(3, 0, 7, 100))
        .unwrap();
    assert!(t.handle_notification(t0, p[0], &chunk(3, 0, 2, 3)).is_err());
    // 4: chunk id over the cap.
    assert!(
        t.handle_notification(
            t0,
            p[0],
            &ChunkNotification::new(RequestId(4), 0, u32::MAX, ChunkStatus::More)
        )
        .is_err()
    );
    // 5: FAILURE.
    let fail = ChunkNotification::new(
        RequestId(5),
        0,
        0,
        ChunkStatus::Failed {
            code: FailureCode::Other(77),
        },
    );
    assert_eq!(
        t.handle_notification(t0, p[0], &fail),
        Ok(Accepted::RankFailed)
    );
    let ev = drain(&mut t);
    assert_eq!(ev.len(), 5);
    assert!(ev.iter().all(|e| matches!(e, TrackerEvent::Failed { .. })));
    assert_eq!(
        ev[4],
        TrackerEvent::Failed {
            request: RequestId(5),
            reason: FailureReason::PeerFailed {
                rank: 0,
                code: FailureCode::Other(77)
            }
        }
    );
    assert_eq!(t.counters().violations, 4);
    assert!(t.is_in_flight(RequestId(99)));
    t.handle_notification(t0, p[0], &chunk(99, 0, 0, 1))
        .unwrap();
    assert_eq!(
        drain(&mut t),
        vec![TrackerEvent::Complete {
            request: RequestId(99)
        }]
    );
}

#[test]
fn deadline_and_timeouts() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new(TrackerConfig::default());
    let p = peers(1);
    t.expect(t0, RequestId(1), 1, &p, t0 + Duration::from_secs(2))
        .unwrap();
    t.expect(t0, RequestId(2), 1, &p, t0 + Duration::from_secs(1))
        .unwrap();
    assert_eq!(t.poll_timeout(), Some(t0 + Duration::from_secs(1)));
    t.handle_notification(t0, p[0], &chunk(2, 0, 0, 1)).unwrap();
    // Request 2 finished; its deadline no longer wakes anybody.
    assert_eq!(t.poll_timeout(), Some(t0 + Duration::from_secs(2)));
    t.handle_timeout(t0 + Duration::from_millis(1999));
    assert_eq!(drain(&mut t).len(), 1);
    t.handle_timeout(t0 + Duration::from_secs(2));
    assert_eq!(
        drain(&mut t),
        vec![TrackerEvent::Failed {
            request: RequestId(1),
            reason: FailureReason::Timeout
        }]
    );
    // Time going backwards never un-fires or re-fires anything.
    t.handle_timeout(t0);
    assert_eq!(t.poll_event(), None);
    assert_eq!(t.poll_timeout(), None);
    assert!(t.is_idle());
}

#[test]
fn early_notifications_wait_bounded_and_expire() {
    let t0 = Instant::now();
    let mut cfg = TrackerConfig::default();
    cfg.early_buffer_cap = 3;
    cfg.early_buffer_ttl = Duration::from_secs(1);
    let mut t = CompletionTracker::new(cfg);
    let p = peers(2);
    assert_eq!(
        t.handle_notification(t0, p[0], &chunk(1, 0, 0, 1)),
        Ok(Accepted::Buffered)
    );
    // From the wrong peer: buffered too, but judged (and dropped) at replay.
    assert_eq!(
        t.handle_notification(t0, p[0], &chunk(1, 1, 0, 1)),
        Ok(Accepted::Buffered)
    );
    assert_eq!(
        t.handle_notification(t0, p[1], &chunk(2, 1, 0, 1)),
        Ok(Accepted::Buffered)
    );
    assert!(matches!(
        t.handle_notification(t0, p[1], &chunk(1, 1, 0, 1)),
        Err(NotifyError::BufferFull { .. })
    ));
    assert_eq!(t.counters().buffer_overflow, 1);
    t.expect(t0, RequestId(1), 2, &p, t0 + Duration::from_secs(5))
        .unwrap();
    assert_eq!(t.counters().wrong_peer, 1);
    assert_eq!(t.poll_event(), None);
    t.handle_notification(t0, p[1], &chunk(1, 1, 0, 1)).unwrap();
    assert_eq!(drain(&mut t).len(), 1);
    // Request 2's early note expires.
    assert_eq!(t.early_buffered(), 1);
    assert_eq!(t.poll_timeout(), Some(t0 + Duration::from_secs(1)));
    t.handle_timeout(t0 + Duration::from_secs(1));
    assert_eq!(t.early_buffered(), 0);
    assert_eq!(t.counters().buffer_expired, 1);
    assert!(t.is_idle());
}

#[test]
fn expect_errors_and_forget() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new(TrackerConfig::default());
    let p = peers(2);
    let dl = t0 + Duration::from_secs(1);
    assert_eq!(
        t.expect(t0, RequestId(1), 0, &[], dl),
        Err(TrackerError::ZeroPpSize)
    );
    assert_eq!(
        t.expect(t0, RequestId(1), 3, &p, dl),
        Err(TrackerError::PeerCountMismatch {
            pp_size: 3,
            peers: 2
        })
    );
    assert!(matches!(
        t.expect(t0, RequestId(1), 1000, &p, dl),
        Err(TrackerError::PpSizeTooLarge { .. })
    ));
    t.expect(t0, RequestId(1), 2, &p, dl).unwrap();
    assert_eq!(
        t.expect(t0, RequestId(1), 2, &p, dl),
        Err(TrackerError::AlreadyInFlight(RequestId(1)))
    );
    t.abort(RequestId(1)).unwrap();
    assert_eq!(
        t.abort(RequestId(1)),
        Err(TrackerError::NotInFlight(RequestId(1)))
    );
    assert_eq!(
        t.expect(t0, RequestId(1), 2, &p, dl),
        Err(TrackerError::AlreadyFinished(RequestId(1)))
    );
    assert!(t.forget(RequestId(1)));
    t.expect(t0, RequestId(1), 2, &p, dl).unwrap();
    assert_eq!(t.handle_peer_lost(t0, p[1]), 1);
    assert_eq!(
        drain(&mut t),
        vec![
            TrackerEvent::Failed {
                request: RequestId(1),
                reason: FailureReason::Aborted
            },
            TrackerEvent::Failed {
                request: RequestId(1),
                reason: FailureReason::PeerLost {
                    rank: 1,
                    peer: p[1]
                }
            }
        ]
    );
}

/// One scenario: what each rank would send, then what the network did to it.
#[derive(Debug, Clone)]
struct Scenario {
    pp: u16,
    counts: Vec<u32>,
    seed: u64,
    loss: f64,
    dup: f64,
    corrupt: f64,
    wrong_peer: f64,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (1u16..=16)
        .prop_flat_map(|pp| {
            (
                Just(pp),
                // Up to 1024 chunks a rank, but keep the total small enough for debug builds.
                proptest::collection::vec(
                    prop_oneof![1u32..=8, 1u32..=64, 1000u32..=1024],
                    usize::from(pp),
                ),
                any::<u64>(),
                prop_oneof![Just(0.0), 0.0..0.05],
                0.0..0.5f64,
                prop_oneof![Just(0.0), 0.0..0.02],
                prop_oneof![Just(0.0), 0.0..0.1],
            )
        })
        .prop_filter("bounded size", |s| {
            s.1.iter().map(|&c| u64::from(c)).sum::<u64>() <= 6000
        })
        .prop_map(
            |(pp, counts, seed, loss, dup, corrupt, wrong_peer)| Scenario {
                pp,
                counts,
                seed,
                loss,
                dup,
                corrupt,
                wrong_peer,
            },
        )
}

/// Delivers the scenario's notifications in a shuffled order with loss, duplication, corruption
/// and wrong-peer traffic, and checks the tracker's invariants.
fn run(s: &Scenario) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(s.seed);
    let t0 = Instant::now();
    let mut t = CompletionTracker::new(TrackerConfig::default());
    let p = peers(s.pp);
    let req = 42;
    // A bystander request must never be disturbed.
    let bystander = 43;
    t.expect(
        t0,
        RequestId(bystander),
        1,
        &[PeerId(1)],
        t0 + Duration::from_secs(60),
    )
    .unwrap();
    let expect_at = rng.random_range(0..4usize);
    let mut msgs: Vec<(PeerId, ChunkNotification)> = Vec::new();
    // Sent after every other notification of every rank, so they find ranks (and the request)
    // already done, or bring the count only once every chunk is there.
    let mut trailing: Vec<(PeerId, ChunkNotification)> = Vec::new();
    for rank in 0..s.pp {
        let count = s.counts[usize::from(rank)];
        let from = p[usize::from(rank)];
        let with_count = |id| last(req, rank, id, count);
        // Where the count travels: on the final chunk's own notification (the usual sender), on
        // any other chunk's, only in separate LASTs mixed in with the chunks, or only in LASTs
        // sent after everything else (issue 10, item 5). LASTs of the first two kinds may repeat.
        let style = rng.random_range(0..4u8);
        let marked = match style {
            0 => Some(count - 1),
            1 => Some(rng.random_range(0..count)),
            _ => None,
        };
        for id in 0..count {
            let n = if marked == Some(id) {
                with_count(id)
            } else {
                more(req, rank, id)
            };
            msgs.push((from, n));
        }
        let (mixed, after) = match style {
            2 => (rng.random_range(1..=3), rng.random_range(0..=1)),
            3 => (0, rng.random_range(1..=2)),
            _ => (rng.random_range(0..=2), rng.random_range(0..=1)),
        };
        for _ in 0..mixed {
            msgs.push((from, with_count(rng.random_range(0..count))));
        }
        for _ in 0..after {
            trailing.push((from, with_count(rng.random_range(0..count))));
        }
    }
    msgs.shuffle(&mut rng);
    trailing.shuffle(&mut rng);
    msgs.extend(trailing);
    let mut delivered: Vec<HashSet<u32>> = vec![HashSet::new(); usize::from(s.pp)];
    // Whether an intact LAST (so the rank's true count) got through, per rank.
    let mut count_delivered = vec![false; usize::from(s.pp)];
    // What the tracker was actually told by bound peers (real or corrupted), per rank.
    let mut told: Vec<HashSet<u32>> = vec![HashSet::new(); usize::from(s.pp)];
    let mut first_count: Vec<Option<u32>> = vec![None; usize::from(s.pp)];
    let mut corrupted_any = false;
    let mut expected = false;
    let mut events = Vec::new();
    let total = msgs.len();
    for (i, (from, mut n)) in msgs.into_iter().enumerate() {
        if !expected && i * 4 >= total * expect_at {
            t.expect(t0, RequestId(req), s.pp, &p, t0 + Duration::from_secs(60))
                .unwrap();
            expected = true;
        }
        if rng.random_bool(s.wrong_peer) {
            // Someone else's peer speaks for this rank, or names the bystander.
            let liar = PeerId(rng.random_range(1000..1010));
            let _ = t.handle_notification(t0, liar, &n);
            let mut b = n;
            b.request = RequestId(bystander);
            let _ = t.handle_notification(t0, liar, &b);
        }
        if rng.random_bool(s.loss) {
            continue;
        }
        let copies = if rng.random_bool(s.dup) { 2 } else { 1 };
        if rng.random_bool(s.corrupt) {
            // A corrupted record that still decodes: a different chunk id, maybe a bogus count.
            corrupted_any = true;
            n.chunk_id = rng.random_range(0..2048);
            if rng.random_bool(0.5) {
                n.status = ChunkStatus::Last {
                    count: rng.random_range(1..2048),
                };
            }
        } else {
            delivered[usize::from(n.pp_rank)].insert(n.chunk_id);
            if matches!(n.status, ChunkStatus::Last { .. }) {
                count_delivered[usize::from(n.pp_rank)] = true;
            }
        }
        let r = usize::from(n.pp_rank);
        told[r].insert(n.chunk_id);
        if let ChunkStatus::Last { count } = n.status {
            // One invalid on its face is dropped unseen if it comes early, so it cannot be the
            // count the tracker went by.
            if count > n.chunk_id {
                first_count[r].get_or_insert(count);
            }
        }
        for _ in 0..copies {
            let _ = t.handle_notification(t0, from, &n);
        }
        events.extend(std::iter::from_fn(|| t.poll_event()));
    }
    if !expected {
        t.expect(t0, RequestId(req), s.pp, &p, t0 + Duration::from_secs(60))
            .unwrap();
    }
    events.extend(std::iter::from_fn(|| t.poll_event()));
    t.handle_timeout(t0 + Duration::from_secs(61));
    events.extend(std::iter::from_fn(|| t.poll_event()));

    let mine: Vec<_> = events
        .iter()
        .filter(|e| {
            matches!(e, TrackerEvent::Complete { request } | TrackerEvent::Failed { request, .. }
                if *request == RequestId(req))
        })
        .collect();
    prop_assert_eq!(mine.len(), 1, "exactly one terminal event: {:?}", events);
    let all_delivered = (0..usize::from(s.pp))
        .all(|r| count_delivered[r] && delivered[r].len() == s.counts[r] as usize);
    match mine[0] {
        TrackerEvent::Complete { .. } => {
            // A corrupted record that still decodes is a claim the tracker cannot tell from a
            // true one (integrity is the transport's and the checksum's job). What it must
            // never do is complete beyond what bound peers claimed.
            for r in 0..usize::from(s.pp) {
                let c = first_count[r];
                prop_assert!(c.is_some(), "complete without LAST of rank {}", r);
                let c = c.unwrap_or(0);
                prop_assert!(
                    (0..c).all(|id| told[r].contains(&id)),
                    "rank {} incomplete",
                    r
                );
            }
            if !corrupted_any {
                prop_assert!(all_delivered, "complete without every chunk");
            }
        }
        TrackerEvent::Failed { reason, .. } => {
            // Failure with everything delivered intact is only possible through corruption.
            prop_assert!(
                !all_delivered || corrupted_any,
                "failed although all arrived intact: {:?}",
                reason
            );
            if !corrupted_any {
                prop_assert_eq!(*reason, FailureReason::Timeout);
            }
        }
    }
    if all_delivered && !corrupted_any {
        let complete = matches!(mine[0], TrackerEvent::Complete { .. });
        prop_assert!(complete);
    }
    // The bystander (timed out, as nobody served it) failed only by its deadline.
    let by: Vec<_> = events
        .iter()
        .copied()
        .filter(|e| matches!(e, TrackerEvent::Failed { request, .. } | TrackerEvent::Complete { request } if *request == RequestId(bystander)))
        .collect();
    prop_assert_eq!(
        by,
        vec![TrackerEvent::Failed {
            request: RequestId(bystander),
            reason: FailureReason::Timeout
        }]
    );
    prop_assert!(t.is_idle());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn any_order_dup_loss_corruption(s in scenario()) {
        run(&s)?;
    }

    /// Without loss or corruption, every order and duplication completes.
    #[test]
    fn lossless_always_completes(pp in 1u16..=16, seed in any::<u64>(), n in 1u32..=40) {
        let s = Scenario { pp, counts: vec![n; usize::from(pp)], seed, loss: 0.0, dup: 0.3,
            corrupt: 0.0, wrong_peer: 0.1 };
        run(&s)?;
    }
}

#[test]
fn a_lost_peer_fails_only_the_requests_it_had_not_delivered() {
    let t0 = Instant::now();
    let dl = t0 + Duration::from_secs(10);
    let mut t = CompletionTracker::new(TrackerConfig::default());
    let p = [PeerId(10), PeerId(11)];
    // Request 1: rank 1 delivered both its chunks; request 2: rank 1 delivered one of two.
    for r in [1, 2] {
        t.expect(t0, RequestId(r), 2, &p, dl).unwrap();
        t.handle_notification(
            t0,
            p[1],
            &ChunkNotification::new(RequestId(r), 1, 0, ChunkStatus::More),
        )
        .unwrap();
    }
    t.handle_notification(
        t0,
        p[1],
        &ChunkNotification::new(RequestId(1), 1, 1, ChunkStatus::Last { count: 2 }),
    )
    .unwrap();
    assert_eq!(t.handle_peer_lost(t0, p[1]), 1);
    assert_eq!(
        drain(&mut t),
        vec![TrackerEvent::Failed {
            request: RequestId(2),
            reason: FailureReason::PeerLost {
                rank: 1,
                peer: p[1]
            }
        }]
    );
    // Request 1 completes once rank 0 delivers.
    t.handle_notification(
        t0,
        p[0],
        &ChunkNotification::new(RequestId(1), 0, 0, ChunkStatus::Last { count: 1 }),
    )
    .unwrap();
    assert_eq!(
        drain(&mut t),
        vec![TrackerEvent::Complete {
            request: RequestId(1)
        }]
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Losing a peer in parts (the requests `only` picks, then each of the rest on its own, as an
    /// engine does for requests whose notifications it is still checking) fails exactly the
    /// requests, with exactly the reasons, that losing it at once does; picking none changes
    /// nothing. Requests of up to 4 ranks bound to any of 3 peers, each rank having delivered
    /// any part of its chunks (its count or not).
    #[test]
    fn a_peer_lost_in_parts_fails_what_it_fails_at_once(
        requests in proptest::collection::vec(
            proptest::collection::vec((0usize..3, 0u32..=3, any::<bool>()), 1..=4),
            1..=6,
        ),
        lost in 0usize..3,
        first in proptest::collection::vec(any::<bool>(), 6),
    ) {
        let t0 = Instant::now();
        let dl = t0 + Duration::from_secs(10);
        let pool = [PeerId(10), PeerId(11), PeerId(12)];
        let build = || {
            let mut t = CompletionTracker::new(TrackerConfig::default());
            for (i, ranks) in requests.iter().enumerate() {
                let id = RequestId(i as u64);
                let peers: Vec<PeerId> = ranks.iter().map(|r| pool[r.0]).collect();
                t.expect(t0, id, ranks.len() as u16, &peers, dl).unwrap();
                for (rank, &(peer, sent, counted)) in ranks.iter().enumerate() {
                    // Two chunks a rank: `sent` of them delivered (0 to 2, the count with the
                    // second when `counted`; 3: both as More, then the count in a LAST repeating
                    // chunk 0 when `counted`).
                    for c in 0..sent.min(2) {
                        let status = if c == 1 && counted && sent == 2 {
                            ChunkStatus::Last { count: 2 }
                        } else {
                            ChunkStatus::More
                        };
                        let n = ChunkNotification::new(id, rank as u16, c, status);
                        let _ = t.handle_notification(t0, pool[peer], &n);
                    }
                    if sent == 3 && counted {
                        let _ = t.handle_notification(t0, pool[peer], &last(i as u64, rank as u16, 0, 2));
                    }
                }
            }
            drain(&mut t);
            t
        };
        let mut at_once = build();
        let failed = at_once.handle_peer_lost(t0, pool[lost]);
        let mut want = drain(&mut at_once);
        want.sort_by_key(|e| format!("{e:?}"));

        let mut parts = build();
        prop_assert_eq!(parts.handle_peer_lost_in(t0, pool[lost], |_| false), 0);
        prop_assert_eq!(drain(&mut parts), vec![]);
        let picked = |id: RequestId| first[id.0 as usize];
        let mut n = parts.handle_peer_lost_in(t0, pool[lost], picked);
        for i in 0..requests.len() as u64 {
            if !picked(RequestId(i)) {
                n += parts.handle_peer_lost_in(t0, pool[lost], |id| id == RequestId(i));
            }
        }
        let mut got = drain(&mut parts);
        got.sort_by_key(|e| format!("{e:?}"));
        prop_assert_eq!(n, failed);
        prop_assert_eq!(got, want);
    }
}
