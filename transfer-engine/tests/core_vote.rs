//! Vote board: rules one by one, close and shutdown, and properties over any order, duplication
//! and loss of votes for PP sizes up to 16.
#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use transfer_engine::core::vote::{
    Decision, FailCause, ShutdownReport, Vote, VoteBoard, VoteConfig, VoteDecodeError, VoteError,
    VoteMessage,
};
use transfer_engine::core::{FailureCode, RequestId};

fn boards(pp: u16, timeout: Option<Duration>) -> Vec<VoteBoard> {
    (0..pp)
        .map(|r| {
            let mut c = VoteConfig::new(pp, r);
            c.vote_timeout = timeout;
            VoteBoard::new(c).unwrap()
        })
        .collect()
}

/// Delivers every queued message, in order, until nothing is left.
fn pump(bs: &mut [VoteBoard], now: Instant) {
    loop {
        let mut any = false;
        for from in 0..bs.len() {
            while let Some((to, msg)) = bs[from].poll_transmit() {
                any = true;
                bs[usize::from(to)]
                    .handle_peer_message(now, from as u16, &msg)
                    .unwrap();
            }
        }
        if !any {
            return;
        }
    }
}

fn decisions(b: &mut VoteBoard) -> Vec<(RequestId, Decision)> {
    std::iter::from_fn(|| b.poll_decision()).collect()
}

#[test]
fn decides_once_when_all_voted_and_failure_wins_last() {
    let t0 = Instant::now();
    let mut bs = boards(3, None);
    let r = RequestId(1);
    bs[0].handle_local_vote(t0, r, Vote::Completed).unwrap();
    bs[1]
        .handle_local_vote(t0, r, Vote::Failed(FailureCode::WriteFailed))
        .unwrap();
    pump(&mut bs, t0);
    // Rank 1 failed, but rank 2 has not voted: nobody decides yet.
    for b in &mut bs {
        assert_eq!(b.poll_decision(), None);
    }
    bs[2].handle_local_vote(t0, r, Vote::Completed).unwrap();
    pump(&mut bs, t0);
    for b in &mut bs {
        assert_eq!(
            decisions(b),
            vec![(
                r,
                Decision::Failed {
                    rank: 1,
                    cause: FailCause::Voted(FailureCode::WriteFailed)
                }
            )]
        );
        assert_eq!(b.undecided(), 0);
    }
    // Repeating a vote after the decision is a no-op; changing it is an error.
    bs[0].handle_local_vote(t0, r, Vote::Completed).unwrap();
    assert!(matches!(
        bs[0].handle_local_vote(t0, r, Vote::Failed(FailureCode::Aborted)),
        Err(VoteError::Conflict { .. })
    ));
    assert_eq!(bs[0].poll_decision(), None);
}

#[test]
fn pp1_decides_on_local_vote() {
    let t0 = Instant::now();
    let mut bs = boards(1, None);
    bs[0]
        .handle_local_vote(t0, RequestId(5), Vote::Completed)
        .unwrap();
    assert_eq!(bs[0].poll_transmit(), None);
    assert_eq!(
        decisions(&mut bs[0]),
        vec![(RequestId(5), Decision::Completed)]
    );
}

#[test]
fn duplicate_and_conflicting_peer_votes() {
    let t0 = Instant::now();
    let mut b = boards(2, None).remove(0);
    let r = RequestId(3);
    let v = VoteMessage::Vote {
        from_rank: 1,
        request: r,
        vote: Vote::Completed,
    };
    b.handle_peer_message(t0, 1, &v).unwrap();
    b.handle_peer_message(t0, 1, &v).unwrap();
    let conflict = VoteMessage::Vote {
        from_rank: 1,
        request: r,
        vote: Vote::Failed(FailureCode::Internal),
    };
    assert_eq!(
        b.handle_peer_message(t0, 1, &conflict),
        Err(VoteError::Conflict {
            request: r,
            rank: 1,
            first: Vote::Completed,
            second: Vote::Failed(FailureCode::Internal)
        })
    );
    assert_eq!(
        b.handle_peer_message(t0, 2, &v),
        Err(VoteError::UnknownRank {
            rank: 2,
            pp_size: 2
        })
    );
    assert_eq!(b.handle_peer_message(t0, 0, &v), Err(VoteError::OwnRank(0)));
    let c = b.counters();
    assert_eq!((c.duplicates, c.conflicts), (1, 1));
    b.handle_local_vote(t0, r, Vote::Completed).unwrap();
    assert_eq!(decisions(&mut b), vec![(r, Decision::Completed)]);
}

#[test]
fn rank_mismatch_is_refused() {
    let t0 = Instant::now();
    let mut b = boards(3, None).remove(0);
    let v = VoteMessage::Vote {
        from_rank: 2,
        request: RequestId(1),
        vote: Vote::Completed,
    };
    assert_eq!(
        b.handle_peer_message(t0, 1, &v),
        Err(VoteError::RankMismatch {
            claimed: 2,
            from: 1
        })
    );
    assert_eq!(b.undecided(), 0);
}

#[test]
fn peer_lost_and_deadline_end_the_wait() {
    let t0 = Instant::now();
    let mut bs = boards(3, Some(Duration::from_secs(5)));
    bs[0]
        .handle_local_vote(t0, RequestId(1), Vote::Completed)
        .unwrap();
    bs[0]
        .handle_local_vote(t0, RequestId(2), Vote::Completed)
        .unwrap();
    bs[1]
        .handle_local_vote(t0, RequestId(1), Vote::Completed)
        .unwrap();
    pump(&mut bs, t0);
    // Rank 2 dies before voting on request 1.
    bs[0].handle_peer_lost(t0, 2).unwrap();
    assert_eq!(
        decisions(&mut bs[0]),
        vec![(
            RequestId(1),
            Decision::Failed {
                rank: 2,
                cause: FailCause::PeerLost
            }
        )]
    );
    // Request 2: rank 1 never votes; the deadline decides it.
    assert_eq!(bs[0].poll_timeout(), Some(t0 + Duration::from_secs(5)));
    bs[0].handle_timeout(t0 + Duration::from_secs(5));
    assert_eq!(
        decisions(&mut bs[0]),
        vec![(
            RequestId(2),
            Decision::Failed {
                rank: 1,
                cause: FailCause::Timeout
            }
        )]
    );
    // A lost peer's later messages are refused.
    let late = VoteMessage::Vote {
        from_rank: 2,
        request: RequestId(1),
        vote: Vote::Completed,
    };
    assert_eq!(
        bs[0].handle_peer_message(t0, 2, &late),
        Err(VoteError::FromLostPeer { rank: 2 })
    );
    assert_eq!(bs[0].handle_peer_lost(t0, 0), Err(VoteError::OwnRank(0)));
}

#[test]
fn deadline_never_replaces_the_local_vote() {
    let t0 = Instant::now();
    let mut bs = boards(2, Some(Duration::from_secs(1)));
    bs[1]
        .handle_local_vote(t0, RequestId(1), Vote::Completed)
        .unwrap();
    pump(&mut bs, t0);
    bs[0].handle_timeout(t0 + Duration::from_secs(10));
    assert_eq!(
        bs[0].poll_decision(),
        None,
        "decided without the local vote"
    );
    bs[0]
        .handle_local_vote(t0 + Duration::from_secs(11), RequestId(1), Vote::Completed)
        .unwrap();
    assert_eq!(
        decisions(&mut bs[0]),
        vec![(RequestId(1), Decision::Completed)]
    );
}

/// A request only a peer voted on is reported once at its deadline, for the driver to vote on;
/// one this rank voted on, or one decided meanwhile, is not.
#[test]
fn a_request_only_peers_voted_on_is_reported_at_its_deadline() {
    let t0 = Instant::now();
    let mut bs = boards(3, Some(Duration::from_secs(1)));
    let (only_peer, both) = (RequestId(1), RequestId(2));
    bs[1]
        .handle_local_vote(t0, only_peer, Vote::Completed)
        .unwrap();
    bs[1].handle_local_vote(t0, both, Vote::Completed).unwrap();
    bs[0].handle_local_vote(t0, both, Vote::Completed).unwrap();
    pump(&mut bs, t0);
    assert_eq!(bs[0].poll_expired_unvoted(), None, "before the deadline");
    bs[0].handle_timeout(t0 + Duration::from_secs(2));
    assert_eq!(bs[0].poll_expired_unvoted(), Some(only_peer));
    assert_eq!(
        bs[0].poll_expired_unvoted(),
        None,
        "once, and not the voted one"
    );
    // The driver's vote decides it and the board forgets it.
    bs[0]
        .handle_local_vote(
            t0 + Duration::from_secs(2),
            only_peer,
            Vote::Failed(FailureCode::Timeout),
        )
        .unwrap();
    assert!(!bs[0].is_undecided(only_peer));
    assert!(
        decisions(&mut bs[0])
            .iter()
            .any(|&(r, d)| r == only_peer && matches!(d, Decision::Failed { .. }))
    );
}

#[test]
fn close_is_ordered_after_votes_and_shutdown_reports() {
    let t0 = Instant::now();
    let mut bs = boards(3, None);
    bs[0]
        .handle_local_vote(t0, RequestId(1), Vote::Completed)
        .unwrap();
    bs[0].close();
    let sent: Vec<_> = std::iter::from_fn(|| bs[0].poll_transmit()).collect();
    // Per peer: the vote, then Close.
    for peer in [1u16, 2] {
        let to_peer: Vec<_> = sent.iter().filter(|(to, _)| *to == peer).collect();
        assert!(matches!(to_peer[0].1, VoteMessage::Vote { .. }));
        assert_eq!(to_peer[1].1, VoteMessage::Close { from_rank: 0 });
        assert_eq!(to_peer.len(), 2);
    }
    assert_eq!(
        bs[0].handle_local_vote(t0, RequestId(2), Vote::Completed),
        Err(VoteError::Closed)
    );
    for (to, msg) in sent {
        bs[usize::from(to)]
            .handle_peer_message(t0, 0, &msg)
            .unwrap();
    }
    // After Close, anything more from rank 0 is refused.
    let more = VoteMessage::Vote {
        from_rank: 0,
        request: RequestId(9),
        vote: Vote::Completed,
    };
    assert_eq!(
        bs[1].handle_peer_message(t0, 0, &more),
        Err(VoteError::AfterClose { rank: 0 })
    );
    // Rank 1 votes and shuts down; rank 2 never answers: bounded, with a report.
    bs[1]
        .handle_local_vote(t0, RequestId(1), Vote::Completed)
        .unwrap();
    bs[1].shutdown(t0, t0 + Duration::from_secs(30));
    assert_eq!(bs[1].poll_timeout(), Some(t0 + Duration::from_secs(30)));
    assert_eq!(bs[1].poll_shutdown(), None);
    bs[1].handle_timeout(t0 + Duration::from_secs(30));
    assert_eq!(
        bs[1].poll_shutdown(),
        Some(ShutdownReport {
            clean: false,
            undecided: vec![(RequestId(1), vec![2])],
            ranks_not_closed: vec![2],
        })
    );
    assert_eq!(bs[1].poll_shutdown(), None);
}

#[test]
fn clean_shutdown_of_all_ranks() {
    let t0 = Instant::now();
    let mut bs = boards(4, None);
    for b in &mut bs {
        b.handle_local_vote(t0, RequestId(7), Vote::Completed)
            .unwrap();
        b.shutdown(t0, t0 + Duration::from_secs(1));
    }
    pump(&mut bs, t0);
    for b in &mut bs {
        assert_eq!(decisions(b), vec![(RequestId(7), Decision::Completed)]);
        assert_eq!(
            b.poll_shutdown(),
            Some(ShutdownReport {
                clean: true,
                undecided: vec![],
                ranks_not_closed: vec![],
            })
        );
    }
}

#[test]
fn close_without_vote_counts_as_failure() {
    let t0 = Instant::now();
    let mut bs = boards(2, None);
    bs[0]
        .handle_local_vote(t0, RequestId(1), Vote::Completed)
        .unwrap();
    bs[1].close();
    pump(&mut bs, t0);
    assert_eq!(
        decisions(&mut bs[0]),
        vec![(
            RequestId(1),
            Decision::Failed {
                rank: 1,
                cause: FailCause::ClosedWithoutVote
            }
        )]
    );
}

#[test]
fn too_many_undecided_from_peers() {
    let t0 = Instant::now();
    let mut c = VoteConfig::new(2, 0);
    c.max_undecided = 2;
    let mut b = VoteBoard::new(c).unwrap();
    let v = |r| VoteMessage::Vote {
        from_rank: 1,
        request: RequestId(r),
        vote: Vote::Completed,
    };
    b.handle_peer_message(t0, 1, &v(1)).unwrap();
    b.handle_peer_message(t0, 1, &v(2)).unwrap();
    assert_eq!(
        b.handle_peer_message(t0, 1, &v(3)),
        Err(VoteError::TooManyUndecided {
            request: RequestId(3)
        })
    );
    // Local votes are always taken, and they free peer-created room once decided.
    b.handle_local_vote(t0, RequestId(1), Vote::Completed)
        .unwrap();
    b.handle_peer_message(t0, 1, &v(3)).unwrap();
    assert_eq!(b.undecided(), 2);
}

#[test]
fn vote_wire_round_trip_and_errors() {
    let msgs = [
        VoteMessage::Vote {
            from_rank: 15,
            request: RequestId(u64::MAX),
            vote: Vote::Failed(FailureCode::Other(4242)),
        },
        VoteMessage::Vote {
            from_rank: 0,
            request: RequestId(0),
            vote: Vote::Completed,
        },
        VoteMessage::Close { from_rank: 3 },
    ];
    for m in msgs {
        assert_eq!(VoteMessage::decode(&m.encode()), Ok(m));
    }
    let hex: String = msgs[2]
        .encode()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(hex, "c74b56560102030000000000000000000000000000000000");
    let mut b = msgs[1].encode();
    b[16] = 9;
    assert_eq!(
        VoteMessage::decode(&b),
        Err(VoteDecodeError::UnknownVote { found: 9 })
    );
    let mut b = msgs[1].encode();
    b[18] = 1;
    assert_eq!(
        VoteMessage::decode(&b),
        Err(VoteDecodeError::CodeWithoutFailure { code: 1 })
    );
    let mut b = msgs[2].encode();
    b[8] = 1;
    assert_eq!(
        VoteMessage::decode(&b),
        Err(VoteDecodeError::CloseWithPayload)
    );
    let mut b = msgs[2].encode();
    b[5] = 3;
    assert_eq!(
        VoteMessage::decode(&b),
        Err(VoteDecodeError::UnknownKind { found: 3 })
    );
    let mut b = msgs[2].encode();
    b[23] = 1;
    assert_eq!(
        VoteMessage::decode(&b),
        Err(VoteDecodeError::ReservedNonZero)
    );
    assert_eq!(
        VoteMessage::decode(&b[..3]),
        Err(VoteDecodeError::BadLength { len: 3 })
    );
}

/// Votes on a few requests cast by every rank, delivered in any order, some duplicated, some
/// lost, some answered by a forged conflicting vote; then a deadline. Checks every board.
fn run_votes(pp: u16, seed: u64, loss: f64, dup: f64, fail_p: f64) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let t0 = Instant::now();
    let timeout = Duration::from_secs(10);
    let mut bs = boards(pp, Some(timeout));
    let n_req = 3u64;
    let mut votes: HashMap<(u64, u16), Vote> = HashMap::new();
    let mut pending_local: Vec<(u64, u16)> = Vec::new();
    for r in 0..n_req {
        for rank in 0..pp {
            let v = if rng.random_bool(fail_p) {
                Vote::Failed(FailureCode::from_raw(rng.random_range(0..10)))
            } else {
                Vote::Completed
            };
            votes.insert((r, rank), v);
            pending_local.push((r, rank));
        }
    }
    // (to, from, msg)
    let mut wire: Vec<(u16, u16, VoteMessage)> = Vec::new();
    // What each board has received (plus its own), per request.
    let mut heard: Vec<HashMap<u64, HashSet<u16>>> = vec![HashMap::new(); usize::from(pp)];
    let mut lost_any: Vec<HashSet<u64>> = vec![HashSet::new(); usize::from(pp)];
    let mut decided: Vec<HashMap<u64, Decision>> = vec![HashMap::new(); usize::from(pp)];
    let mut now = t0;
    let collect = |bs: &mut [VoteBoard],
                   decided: &mut Vec<HashMap<u64, Decision>>,
                   heard: &Vec<HashMap<u64, HashSet<u16>>>,
                   timed_out: bool|
     -> Result<(), TestCaseError> {
        for (i, b) in bs.iter_mut().enumerate() {
            while let Some((req, d)) = b.poll_decision() {
                prop_assert!(
                    decided[i].insert(req.0, d).is_none(),
                    "decided twice on board {}",
                    i
                );
                let h = heard[i].get(&req.0).map_or(0, HashSet::len);
                // Before any deadline, a decision needs a terminal vote from every rank.
                prop_assert!(timed_out || h == usize::from(pp), "early decision");
            }
        }
        Ok(())
    };
    while !pending_local.is_empty() || !wire.is_empty() {
        now += Duration::from_millis(1);
        let take_local = !pending_local.is_empty() && (wire.is_empty() || rng.random_bool(0.3));
        if take_local {
            let i = rng.random_range(0..pending_local.len());
            let (r, rank) = pending_local.swap_remove(i);
            bs[usize::from(rank)]
                .handle_local_vote(now, RequestId(r), votes[&(r, rank)])
                .unwrap();
            heard[usize::from(rank)].entry(r).or_default().insert(rank);
            while let Some((to, msg)) = bs[usize::from(rank)].poll_transmit() {
                // Through the byte codec, as a driver would.
                let msg = VoteMessage::decode(&msg.encode()).unwrap();
                wire.push((to, rank, msg));
            }
        } else {
            let i = rng.random_range(0..wire.len());
            let (to, from, msg) = wire.swap_remove(i);
            let VoteMessage::Vote { request, .. } = msg else {
                unreachable!()
            };
            if rng.random_bool(loss) {
                lost_any[usize::from(to)].insert(request.0);
                continue;
            }
            if rng.random_bool(dup) {
                wire.push((to, from, msg));
            }
            let b = &mut bs[usize::from(to)];
            let first_time = heard[usize::from(to)]
                .entry(request.0)
                .or_default()
                .insert(from);
            let res = b.handle_peer_message(now, from, &msg);
            prop_assert!(res.is_ok(), "{:?}", res);
            if first_time && rng.random_bool(0.1) {
                // A forged, conflicting vote after the real one: refused, first stands.
                let forged = VoteMessage::Vote {
                    from_rank: from,
                    request,
                    vote: match votes[&(request.0, from)] {
                        Vote::Completed => Vote::Failed(FailureCode::Internal),
                        Vote::Failed(_) => Vote::Completed,
                    },
                };
                let res = b.handle_peer_message(now, from, &forged);
                // Already decided (and forgotten as a late vote) or refused as a conflict.
                prop_assert!(
                    matches!(res, Ok(()) | Err(VoteError::Conflict { .. })),
                    "{:?}",
                    res
                );
            }
        }
        collect(&mut bs, &mut decided, &heard, false)?;
    }
    // Whatever is left waits for the deadline.
    for b in bs.iter_mut() {
        b.handle_timeout(now + timeout + Duration::from_secs(1));
    }
    collect(&mut bs, &mut decided, &heard, true)?;
    for (i, b) in bs.iter().enumerate() {
        prop_assert_eq!(b.undecided(), 0);
        for r in 0..n_req {
            let d = decided[i].get(&r).copied();
            prop_assert!(d.is_some(), "board {} never decided {}", i, r);
            let all_completed = (0..pp).all(|k| votes[&(r, k)] == Vote::Completed);
            let complete = d == Some(Decision::Completed);
            // Completed iff every rank voted Completed and every vote reached this board.
            if complete {
                prop_assert!(all_completed);
            }
            if !lost_any[i].contains(&r) {
                prop_assert_eq!(complete, all_completed);
                // Full information: the lowest failing rank and its code, on every such board.
                if let Some(k) = (0..pp).find(|k| votes[&(r, *k)] != Vote::Completed) {
                    let Vote::Failed(code) = votes[&(r, k)] else {
                        unreachable!()
                    };
                    prop_assert_eq!(
                        d,
                        Some(Decision::Failed {
                            rank: k,
                            cause: FailCause::Voted(code)
                        })
                    );
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn votes_any_order_dup_loss(pp in 1u16..=16, seed in any::<u64>(),
        loss in prop_oneof![Just(0.0), 0.0..0.2], dup in 0.0..0.3f64,
        fail_p in prop_oneof![Just(0.0), 0.0..0.5]) {
        run_votes(pp, seed, loss, dup, fail_p)?;
    }
}

// Rejoin: a new start of a peer after its loss or Close.

fn vote_from(rank: u16, request: u64, vote: Vote) -> VoteMessage {
    VoteMessage::Vote {
        from_rank: rank,
        request: RequestId(request),
        vote,
    }
}

/// The ranks each queued vote is addressed to, in order of first appearance per request.
fn queued_to(b: &mut VoteBoard) -> Vec<(u64, Vec<u16>)> {
    let mut out: Vec<(u64, Vec<u16>)> = Vec::new();
    while let Some((to, msg)) = b.poll_transmit() {
        let VoteMessage::Vote { request, .. } = msg else {
            continue;
        };
        match out.iter_mut().find(|(r, _)| *r == request.0) {
            Some((_, tos)) => tos.push(to),
            None => out.push((request.0, vec![to])),
        }
    }
    out
}

#[test]
fn rejoined_peer_cannot_complete_a_request_held_before_its_loss() {
    let t0 = Instant::now();
    let mut b = boards(3, None).remove(0);
    // Request 0 has every vote but rank 2's; request 1 lacks ours and rank 2's.
    b.handle_local_vote(t0, RequestId(0), Vote::Completed)
        .unwrap();
    b.handle_peer_message(t0, 1, &vote_from(1, 0, Vote::Completed))
        .unwrap();
    b.handle_peer_message(t0, 1, &vote_from(1, 1, Vote::Completed))
        .unwrap();
    b.handle_peer_lost(t0, 2).unwrap();
    let lost = Decision::Failed {
        rank: 2,
        cause: FailCause::PeerLost,
    };
    assert_eq!(decisions(&mut b), vec![(RequestId(0), lost)]);
    // Request 2 is first heard of while rank 2 is lost.
    b.handle_peer_message(t0, 1, &vote_from(1, 2, Vote::Completed))
        .unwrap();
    b.handle_peer_joined(t0, 2).unwrap();
    // The new start votes Completed on all three: accepted, and none of it counts.
    for r in 0..3 {
        b.handle_peer_message(t0, 2, &vote_from(2, r, Vote::Completed))
            .unwrap();
    }
    assert_eq!(b.counters().late, 1);
    assert_eq!(b.counters().after_timeout, 2);
    assert_eq!(b.poll_decision(), None);
    for r in [1, 2] {
        b.handle_local_vote(t0, RequestId(r), Vote::Completed)
            .unwrap();
    }
    assert_eq!(
        decisions(&mut b),
        vec![(RequestId(1), lost), (RequestId(2), lost)]
    );
    assert_eq!(b.counters().completed, 0);
}

#[test]
fn rejoined_peer_cannot_complete_a_request_held_before_its_close() {
    let t0 = Instant::now();
    let mut b = boards(3, None).remove(0);
    b.handle_peer_message(t0, 1, &vote_from(1, 1, Vote::Completed))
        .unwrap();
    b.handle_peer_message(t0, 2, &VoteMessage::Close { from_rank: 2 })
        .unwrap();
    b.handle_peer_joined(t0, 2).unwrap();
    b.handle_peer_message(t0, 2, &vote_from(2, 1, Vote::Completed))
        .unwrap();
    b.handle_local_vote(t0, RequestId(1), Vote::Completed)
        .unwrap();
    assert_eq!(
        decisions(&mut b),
        vec![(
            RequestId(1),
            Decision::Failed {
                rank: 2,
                cause: FailCause::ClosedWithoutVote
            }
        )]
    );
}

#[test]
fn request_heard_after_rejoin_waits_for_the_new_start() {
    let t0 = Instant::now();
    let timeout = Duration::from_secs(5);
    let mut b = boards(3, Some(timeout)).remove(0);
    b.handle_peer_lost(t0, 2).unwrap();
    // While rank 2 is lost, nothing waits for it, and nothing is queued for it.
    b.handle_local_vote(t0, RequestId(1), Vote::Completed)
        .unwrap();
    assert_eq!(queued_to(&mut b), vec![(1, vec![1])]);
    b.handle_peer_message(t0, 1, &vote_from(1, 1, Vote::Completed))
        .unwrap();
    assert_eq!(
        decisions(&mut b),
        vec![(
            RequestId(1),
            Decision::Failed {
                rank: 2,
                cause: FailCause::PeerLost
            }
        )]
    );
    let t1 = t0 + Duration::from_secs(1);
    b.handle_peer_joined(t1, 2).unwrap();
    // After the join, a new request waits for the new start's vote, which decides it.
    b.handle_local_vote(t1, RequestId(2), Vote::Completed)
        .unwrap();
    assert_eq!(queued_to(&mut b), vec![(2, vec![1, 2])]);
    b.handle_peer_message(t1, 1, &vote_from(1, 2, Vote::Completed))
        .unwrap();
    assert_eq!(b.poll_decision(), None, "decided without the new start");
    b.handle_peer_message(t1, 2, &vote_from(2, 2, Vote::Completed))
        .unwrap();
    assert_eq!(decisions(&mut b), vec![(RequestId(2), Decision::Completed)]);
    // Without its vote, a new request stays undecided until its deadline.
    b.handle_local_vote(t1, RequestId(3), Vote::Completed)
        .unwrap();
    b.handle_peer_message(t1, 1, &vote_from(1, 3, Vote::Completed))
        .unwrap();
    assert_eq!(b.poll_timeout(), Some(t1 + timeout));
    b.handle_timeout(t1 + timeout - Duration::from_millis(1));
    assert_eq!(b.poll_decision(), None);
    b.handle_timeout(t1 + timeout);
    assert_eq!(
        decisions(&mut b),
        vec![(
            RequestId(3),
            Decision::Failed {
                rank: 2,
                cause: FailCause::Timeout
            }
        )]
    );
}

#[test]
fn peer_joined_refusals_and_no_op_when_open() {
    let t0 = Instant::now();
    let mut b = boards(3, None).remove(1);
    assert_eq!(b.handle_peer_joined(t0, 1), Err(VoteError::OwnRank(1)));
    assert_eq!(
        b.handle_peer_joined(t0, 3),
        Err(VoteError::UnknownRank {
            rank: 3,
            pp_size: 3
        })
    );
    // Joining a rank that is open keeps the vote it already cast.
    b.handle_peer_message(t0, 0, &vote_from(0, 1, Vote::Completed))
        .unwrap();
    b.handle_peer_joined(t0, 0).unwrap();
    b.handle_local_vote(t0, RequestId(1), Vote::Completed)
        .unwrap();
    b.handle_peer_message(t0, 2, &vote_from(2, 1, Vote::Completed))
        .unwrap();
    assert_eq!(decisions(&mut b), vec![(RequestId(1), Decision::Completed)]);
    // A closing board takes no new start, and the lost peer stays lost.
    b.handle_peer_lost(t0, 2).unwrap();
    b.close();
    assert_eq!(b.handle_peer_joined(t0, 2), Err(VoteError::Closed));
    assert_eq!(b.handle_peer_joined(t0, 0), Err(VoteError::Closed));
    assert_eq!(
        b.handle_peer_message(t0, 2, &vote_from(2, 5, Vote::Completed)),
        Err(VoteError::FromLostPeer { rank: 2 })
    );
}

/// One step of [`rejoin_interleavings`], on the board of rank [`ME`].
#[derive(Debug, Clone, Copy)]
enum Op {
    Lose(u16),
    Join(u16),
    /// The peer's `Close`.
    PeerClose(u16),
    /// The request is an offset into a window that moves on at each [`Op::Advance`], so that
    /// requests keep arriving after losses and joins.
    Local(u64, Vote),
    /// As [`Op::Local`], for the request.
    Peer(u16, u64, Vote),
    /// Time moves on by this many seconds, then `handle_timeout`.
    Advance(u64),
    /// This board's `close()`.
    CloseBoard,
}

const ME: u16 = 0;
const REJOIN_TIMEOUT: Duration = Duration::from_secs(10);

fn op(pp: u16) -> impl Strategy<Value = Op> {
    let vote = prop_oneof![
        9 => Just(Vote::Completed),
        1 => Just(Vote::Failed(FailureCode::WriteFailed)),
    ];
    let request = 0u64..3;
    prop_oneof![
        6 => (0..pp).prop_map(Op::Lose),
        10 => (0..pp).prop_map(Op::Join),
        4 => (0..pp).prop_map(Op::PeerClose),
        30 => (request.clone(), vote.clone()).prop_map(|(r, v)| Op::Local(r, v)),
        60 => (0..pp, request, vote).prop_map(|(k, r, v)| Op::Peer(k, r, v)),
        10 => (0u64..4).prop_map(Op::Advance),
        1 => Just(Op::CloseBoard),
    ]
}

fn rejoin_scenario() -> impl Strategy<Value = (u16, Vec<Op>)> {
    (3u16..=4).prop_flat_map(|pp| (Just(pp), prop::collection::vec(op(pp), 1..100)))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerModel {
    Open,
    Closed,
    Lost,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotModel {
    Pending,
    Voted(Vote),
    Ended(FailCause),
}

/// What the model knows of one request.
#[derive(Debug)]
struct Held {
    at: Instant,
    slots: Vec<SlotModel>,
    deadline_passed: bool,
    /// Per rank, the start (join count) that was open when the board first heard of the
    /// request; `None` for this rank and for a peer closed or lost then.
    start: Vec<Option<u32>>,
    /// Per rank, the first vote that start delivered while the request was undecided (for
    /// this rank, its local vote).
    delivered: Vec<Option<Vote>>,
}

/// The board's rules, slot by slot, for the board of rank [`ME`].
struct Model {
    peers: Vec<PeerModel>,
    joins: Vec<u32>,
    closed: bool,
    undecided: HashMap<u64, Held>,
    decided: HashMap<u64, Held>,
    made: Vec<(u64, Decision)>,
}

impl Model {
    fn new(pp: u16) -> Self {
        Self {
            peers: vec![PeerModel::Open; usize::from(pp)],
            joins: vec![0; usize::from(pp)],
            closed: false,
            undecided: HashMap::new(),
            decided: HashMap::new(),
            made: Vec::new(),
        }
    }

    /// The start of `rank` open now.
    fn open_start(&self, rank: usize) -> Option<u32> {
        (rank != usize::from(ME) && self.peers[rank] == PeerModel::Open).then(|| self.joins[rank])
    }

    fn hear(&mut self, now: Instant, request: u64) -> &mut Held {
        let n = self.peers.len();
        let start: Vec<_> = (0..n).map(|k| self.open_start(k)).collect();
        let slots = (0..n)
            .map(|k| match self.peers[k] {
                _ if k == usize::from(ME) => SlotModel::Pending,
                PeerModel::Open => SlotModel::Pending,
                PeerModel::Closed => SlotModel::Ended(FailCause::ClosedWithoutVote),
                PeerModel::Lost => SlotModel::Ended(FailCause::PeerLost),
            })
            .collect();
        self.undecided.entry(request).or_insert_with(|| Held {
            at: now,
            slots,
            deadline_passed: false,
            start,
            delivered: vec![None; n],
        })
    }

    fn decide(&mut self, request: u64) {
        let Some(h) = self.undecided.get(&request) else {
            return;
        };
        if h.slots.contains(&SlotModel::Pending) {
            return;
        }
        let failed = h.slots.iter().enumerate().find_map(|(k, s)| match *s {
            SlotModel::Voted(Vote::Completed) | SlotModel::Pending => None,
            SlotModel::Voted(Vote::Failed(c)) => Some((k, FailCause::Voted(c))),
            SlotModel::Ended(cause) => Some((k, cause)),
        });
        let d = match failed {
            None => Decision::Completed,
            Some((k, cause)) => Decision::Failed {
                rank: k as u16,
                cause,
            },
        };
        let h = self.undecided.remove(&request).unwrap();
        self.decided.insert(request, h);
        self.made.push((request, d));
    }

    fn end_missing(&mut self, rank: u16, cause: FailCause) {
        let mut hit = Vec::new();
        for (r, h) in &mut self.undecided {
            let s = &mut h.slots[usize::from(rank)];
            if *s == SlotModel::Pending {
                *s = SlotModel::Ended(cause);
                hit.push(*r);
            }
        }
        for r in hit {
            self.decide(r);
        }
    }

    fn check_peer(&self, rank: u16) -> Result<(), VoteError> {
        if rank == ME {
            return Err(VoteError::OwnRank(rank));
        }
        match self.peers[usize::from(rank)] {
            PeerModel::Open => Ok(()),
            PeerModel::Closed => Err(VoteError::AfterClose { rank }),
            PeerModel::Lost => Err(VoteError::FromLostPeer { rank }),
        }
    }

    fn timeout(&mut self, now: Instant) {
        let mut hit = Vec::new();
        for (r, h) in &mut self.undecided {
            if h.deadline_passed || now < h.at + REJOIN_TIMEOUT {
                continue;
            }
            h.deadline_passed = true;
            for (k, s) in h.slots.iter_mut().enumerate() {
                if k != usize::from(ME) && *s == SlotModel::Pending {
                    *s = SlotModel::Ended(FailCause::Timeout);
                }
            }
            hit.push(*r);
        }
        for r in hit {
            self.decide(r);
        }
    }

    fn apply(&mut self, now: Instant, op: Op) -> Result<(), VoteError> {
        match op {
            Op::Lose(k) => {
                if k == ME {
                    return Err(VoteError::OwnRank(k));
                }
                if self.peers[usize::from(k)] != PeerModel::Lost {
                    self.peers[usize::from(k)] = PeerModel::Lost;
                    self.end_missing(k, FailCause::PeerLost);
                }
            }
            Op::Join(k) => {
                if k == ME {
                    return Err(VoteError::OwnRank(k));
                }
                if self.closed {
                    return Err(VoteError::Closed);
                }
                if self.peers[usize::from(k)] != PeerModel::Open {
                    self.peers[usize::from(k)] = PeerModel::Open;
                    self.joins[usize::from(k)] += 1;
                }
            }
            Op::PeerClose(k) => {
                self.check_peer(k)?;
                self.peers[usize::from(k)] = PeerModel::Closed;
                self.end_missing(k, FailCause::ClosedWithoutVote);
            }
            Op::Local(r, v) => {
                let me = usize::from(ME);
                let first = match self.decided.get(&r) {
                    Some(h) => h.delivered[me],
                    None if self.closed => match self.undecided.get(&r) {
                        Some(h) if h.delivered[me].is_some() => h.delivered[me],
                        _ => return Err(VoteError::Closed),
                    },
                    None => self.undecided.get(&r).and_then(|h| h.delivered[me]),
                };
                match first {
                    Some(first) if first == v => {}
                    Some(first) => {
                        return Err(VoteError::Conflict {
                            request: RequestId(r),
                            rank: ME,
                            first,
                            second: v,
                        });
                    }
                    None => {
                        let h = self.hear(now, r);
                        h.slots[me] = SlotModel::Voted(v);
                        h.delivered[me] = Some(v);
                        self.decide(r);
                    }
                }
            }
            Op::Peer(k, r, v) => {
                self.check_peer(k)?;
                if self.decided.contains_key(&r) {
                    return Ok(());
                }
                let open = self.open_start(usize::from(k));
                let h = self.hear(now, r);
                let slot = &mut h.slots[usize::from(k)];
                match *slot {
                    SlotModel::Pending => *slot = SlotModel::Voted(v),
                    SlotModel::Voted(first) if first != v => {
                        return Err(VoteError::Conflict {
                            request: RequestId(r),
                            rank: k,
                            first,
                            second: v,
                        });
                    }
                    SlotModel::Voted(_) | SlotModel::Ended(_) => {}
                }
                let d = &mut h.delivered[usize::from(k)];
                if h.start[usize::from(k)] == open && d.is_none() {
                    *d = Some(v);
                }
                self.decide(r);
            }
            Op::Advance(_) => self.timeout(now),
            Op::CloseBoard => self.closed = true,
        }
        Ok(())
    }
}

/// Losses, joins, Closes, local and peer votes and deadlines in any order on one board.
fn run_rejoins(pp: u16, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut c = VoteConfig::new(pp, ME);
    c.vote_timeout = Some(REJOIN_TIMEOUT);
    let mut b = VoteBoard::new(c).unwrap();
    let mut m = Model::new(pp);
    let mut now = Instant::now();
    let mut seen: HashSet<u64> = HashSet::new();
    let mut window = 0;
    for &op in ops {
        let op = match op {
            Op::Local(r, v) => Op::Local(window + r, v),
            Op::Peer(k, r, v) => Op::Peer(k, window + r, v),
            Op::Advance(_) => {
                window += 1;
                op
            }
            op => op,
        };
        let got = match op {
            Op::Lose(k) => b.handle_peer_lost(now, k),
            Op::Join(k) => b.handle_peer_joined(now, k),
            Op::PeerClose(k) => b.handle_peer_message(now, k, &VoteMessage::Close { from_rank: k }),
            Op::Local(r, v) => b.handle_local_vote(now, RequestId(r), v),
            Op::Peer(k, r, v) => b.handle_peer_message(now, k, &vote_from(k, r, v)),
            Op::Advance(s) => {
                now += Duration::from_secs(s);
                b.handle_timeout(now);
                Ok(())
            }
            Op::CloseBoard => {
                b.close();
                Ok(())
            }
        };
        let want = m.apply(now, op);
        prop_assert_eq!(got, want, "{:?}", op);
        while b.poll_transmit().is_some() {}
        let made: Vec<(u64, Decision)> = std::iter::from_fn(|| b.poll_decision())
            .map(|(r, d)| (r.0, d))
            .collect();
        for &(r, d) in &made {
            prop_assert!(seen.insert(r), "request {} decided twice", r);
            let h = m.decided.get(&r).or_else(|| m.undecided.get(&r));
            prop_assert!(h.is_some(), "request {} decided, never heard of", r);
            let h = h.unwrap();
            prop_assert!(
                h.delivered[usize::from(ME)].is_some(),
                "decided without the local vote"
            );
            // Completed only on a Completed vote from every rank, each delivered by the start
            // that was open when the board first heard of the request.
            if d == Decision::Completed {
                for k in 0..pp {
                    prop_assert_eq!(
                        h.delivered[usize::from(k)],
                        Some(Vote::Completed),
                        "rank {}",
                        k
                    );
                }
            }
            // Before its deadline, a request waits for each such start's vote or its end.
            if now < h.at + REJOIN_TIMEOUT {
                for k in (0..usize::from(pp)).filter(|&k| k != usize::from(ME)) {
                    let ended = h.start[k].is_none() || h.start[k] != m.open_start(k);
                    prop_assert!(
                        h.delivered[k].is_some() || ended,
                        "request {} decided {:?} without rank {}'s vote",
                        r,
                        d,
                        k
                    );
                }
            }
        }
        // The same decisions as the model; within one step, in any order.
        let made: HashMap<u64, Decision> = made.into_iter().collect();
        let want: HashMap<u64, Decision> = m.made.drain(..).collect();
        prop_assert_eq!(made, want, "after {:?}", op);
        prop_assert_eq!(b.undecided(), m.undecided.len());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn rejoin_interleavings((pp, ops) in rejoin_scenario()) {
        run_rejoins(pp, &ops)?;
    }
}
