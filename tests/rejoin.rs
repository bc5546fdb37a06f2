//! A prefill rank that dies and starts again, in one process over real UCX and NIXL: decode and the
//! PP peers admit the new start (a new incarnation) and refuse an old one, the request the dead start
//! held fails with PeerLost, a request expected while the rank is away waits for it and completes
//! byte for byte once it is back, and one that waits too long fails with RankUnavailable.
#![allow(clippy::unwrap_used)]

use kvbench::cluster::{Cluster, ClusterSpec, PoolKind, Shape};
use std::time::Duration;
use tokio::time::timeout;
use transfer_engine::control::{ControlError, RejectReason};
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::RegionKind;
use transfer_engine::core::tracker::FailureReason;
use transfer_engine::engine::{EngineError, Outcome};
use transfer_engine::transport::BackendKind;

const SHAPE: Shape = Shape {
    layers: 8,
    bytes_per_token: 576,
    page_tokens: 64,
    regions: RegionKind::Fused,
};
const PROMPT: u32 = 1000;
const CHUNK: u32 = 256;
/// Bound on every wait that should end quickly.
const BOUND: Duration = Duration::from_secs(20);
/// How long a future that must still be pending is polled for.
const PENDING: Duration = Duration::from_millis(200);

fn pages(slot: u32) -> (Vec<u32>, Vec<u32>) {
    let n = SHAPE.pages_for(PROMPT);
    let src = (slot * n..(slot + 1) * n).rev().collect();
    let dst = (1 + slot * n..1 + (slot + 1) * n).collect();
    (src, dst)
}

async fn rank_rejoins(backend: BackendKind) {
    let spec = ClusterSpec {
        shape: SHAPE,
        pp: 4,
        decode_pages: 3 * SHAPE.pages_for(PROMPT) + 2,
        prefill_pages: 3 * SHAPE.pages_for(PROMPT),
        backend,
        checksums: true,
        decode_pool: PoolKind::Shared,
        metrics: None,
        decode_progress: Default::default(),
    };
    let mut c = timeout(BOUND, Cluster::start(spec)).await.unwrap().unwrap();
    let first = c.prefill[2].incarnation();

    // A request whose rank 2 part never comes: its process dies holding it.
    let (src, dst) = pages(0);
    c.prepare(RequestId(1), &src, &dst).unwrap();
    let held = c
        .decode
        .expect(RequestId(1), PROMPT, CHUNK, dst.clone(), BOUND)
        .unwrap();
    let chunks = PROMPT.div_ceil(CHUNK);
    for rank in [0u16, 1, 3] {
        c.send_chunks(rank, RequestId(1), 0..chunks, chunks, &src)
            .await
            .unwrap();
    }
    drop(c.take_rank(2));
    let o = timeout(BOUND, held).await.unwrap();
    assert!(
        matches!(o, Outcome::Failed(FailureReason::PeerLost { rank: 2, .. })),
        "{o:?}"
    );

    // Expected while rank 2 is away: it waits, nobody is asked for it.
    let (src, dst) = pages(1);
    let waiting = c
        .decode
        .expect(RequestId(2), PROMPT, CHUNK, dst.clone(), BOUND)
        .unwrap();
    let mut waiting = Box::pin(waiting);
    assert!(timeout(PENDING, waiting.as_mut()).await.is_err());
    for p in &c.prefill {
        assert!(p.transport_stats().in_flight == 0);
    }

    // An older start of rank 2 is refused, even though no connection of the rank is bound now.
    match c.start_rank(2, Some(first - 1)).await {
        Err(EngineError::Control(ControlError::PeerRejected {
            reason: RejectReason::StaleIncarnation { pp_rank: 2, .. },
            ..
        })) => {}
        other => panic!("an older start of rank 2 was not refused as stale: {other:?}"),
    }
    assert_eq!(c.decode.stats().rejoins, 0);

    // A new start is admitted by decode and by its PP peers; the waiting request goes out.
    let second = timeout(BOUND, c.start_rank(2, None))
        .await
        .unwrap()
        .unwrap();
    assert!(second > first);
    assert_eq!(c.decode.stats().rejoins, 1);
    c.prepare(RequestId(2), &src, &dst).unwrap();
    let mut sends = Vec::new();
    for rank in 0..4u16 {
        let p = c.prefill[usize::from(rank)].clone();
        let src = src.clone();
        sends.push(tokio::spawn(async move {
            for ch in 0..chunks {
                p.send_chunk(RequestId(2), ch, &src, ch + 1 == chunks)
                    .await
                    .unwrap();
            }
            timeout(BOUND, p.decided(RequestId(2))).await.unwrap()
        }));
    }
    assert_eq!(timeout(BOUND, waiting).await.unwrap(), Outcome::Complete);
    for s in sends {
        // Every rank's board, the new start's and its peers', decided it complete.
        let d = timeout(BOUND, s).await.unwrap().unwrap();
        assert_eq!(d, transfer_engine::core::vote::Decision::Completed);
    }
    c.verify(RequestId(2), &dst).unwrap();

    // And one more, end to end, after the rejoin.
    let (src, dst) = pages(2);
    let o = c
        .run_request(RequestId(3), PROMPT, CHUNK, &src, &dst)
        .await
        .unwrap();
    assert_eq!(o, Outcome::Complete);
    c.verify(RequestId(3), &dst).unwrap();

    // Rank 2 away again (once decode has seen its connection end): a request that waits longer
    // than its own timeout fails naming it.
    drop(c.take_rank(2));
    let seen = tokio::time::Instant::now() + BOUND;
    while c
        .decode
        .absences()
        .last()
        .is_some_and(|a| a.until.is_some())
    {
        assert!(
            tokio::time::Instant::now() < seen,
            "decode never saw rank 2 go"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let o = c
        .decode
        .expect(RequestId(4), PROMPT, CHUNK, dst.clone(), PENDING)
        .unwrap();
    assert_eq!(
        timeout(BOUND, o).await.unwrap(),
        Outcome::Failed(FailureReason::RankUnavailable { rank: 2 })
    );
    let s = c.decode.stats();
    assert_eq!(
        (s.completed, s.failed_peer_lost, s.failed_rank_unavailable),
        (2, 1, 1),
        "{s:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_rank_rejoins_ucx() {
    rank_rejoins(BackendKind::Ucx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_rank_rejoins_nixl() {
    rank_rejoins(BackendKind::Nixl).await;
}
