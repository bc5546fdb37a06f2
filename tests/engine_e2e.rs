//! End-to-end scenarios over real loopback UCX and NIXL in one process, four prefill PP engines and
//! one decode engine each: the completion rule when one rank finishes long before the others, an
//! abort in the middle of a transfer, and a rank that reports failure. Every scenario ends by checking
//! that nothing is left over (no tracked or undecided request, no chunk in flight, registered bytes
//! back to the pools' sizes).
#![allow(clippy::unwrap_used)]

use kvbench::cluster::{Cluster, ClusterSpec, PoolKind, Shape};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::time::timeout;
use transfer_engine::core::planner::RegionKind;
use transfer_engine::core::tracker::FailureReason;
use transfer_engine::core::vote::{Decision, FailCause};
use transfer_engine::core::{FailureCode, RequestId};
use transfer_engine::engine::{EngineError, Outcome};
use transfer_engine::transport::BackendKind;

/// The MLA geometry with 8 layers (2 per rank): the point here is the protocol, not the size.
const MLA8: Shape = Shape {
    layers: 8,
    bytes_per_token: 576,
    page_tokens: 64,
    regions: RegionKind::Fused,
};

/// The GQA geometry with 8 layers.
const GQA8: Shape = Shape {
    layers: 8,
    bytes_per_token: 4096,
    page_tokens: 16,
    regions: RegionKind::SplitKv,
};

/// A prompt that is a multiple of neither the page (16 or 64 tokens) nor the chunk.
const PROMPT: u32 = 1000;
/// Bound on every single wait that should end quickly.
const BOUND: Duration = Duration::from_secs(10);
/// How long a future that must still be pending is polled for.
const PENDING: Duration = Duration::from_millis(50);

async fn start(shape: Shape, backend: BackendKind) -> Arc<Cluster> {
    let spec = ClusterSpec {
        shape,
        pp: 4,
        decode_pages: 2 * shape.pages_for(PROMPT) + 2,
        prefill_pages: 2 * shape.pages_for(PROMPT),
        backend,
        checksums: true,
        decode_pool: PoolKind::Shared,
        metrics: None,
        decode_progress: Default::default(),
    };
    let c = timeout(Duration::from_secs(30), Cluster::start(spec))
        .await
        .expect("cluster did not start within 30 s")
        .unwrap();
    for rank in 0..4 {
        assert_eq!(
            c.prefill[usize::from(rank)]
                .transport_stats()
                .registered_bytes,
            c.prefill_pool_len(rank)
        );
    }
    assert_eq!(c.decode.stats().registered_bytes, c.decode_pool_len());
    Arc::new(c)
}

/// Source and destination pages of request slot `slot` (0 or 1): sources reversed, destinations
/// offset by one page, so a write to the wrong page shows.
fn pages(shape: Shape, slot: u32) -> (Vec<u32>, Vec<u32>) {
    let n = shape.pages_for(PROMPT);
    let src = (slot * n..(slot + 1) * n).rev().collect();
    let dst = (1 + slot * n..1 + (slot + 1) * n).collect();
    (src, dst)
}

/// Waits (bounded) for every rank's decision on `request`, releases it, and returns the decisions.
async fn decisions(c: &Cluster, request: RequestId) -> Vec<Decision> {
    let mut out = Vec::new();
    for p in &c.prefill {
        let d = timeout(BOUND, p.decided(request))
            .await
            .unwrap_or_else(|_| panic!("rank {} never decided {request:?}", p.pp_rank()));
        p.release(request);
        out.push(d);
    }
    out
}

async fn join<T>(task: tokio::task::JoinHandle<T>) -> T {
    timeout(BOUND, task)
        .await
        .expect("a rank's task did not end in time")
        .unwrap()
}

/// The seed scenario: rank 0 sends every chunk, LAST included, before any other rank sends anything.
/// Decode must not call the request complete on rank 0's LAST (nor on three ranks' LAST), only once
/// every rank delivered every chunk.
async fn last_of_one_rank_is_not_completion(backend: BackendKind) {
    let shape = MLA8;
    let c = start(shape, backend).await;
    let (request, chunk_tokens) = (RequestId(7), 256);
    let chunks = PROMPT.div_ceil(chunk_tokens);
    let (src, dst) = pages(shape, 0);
    c.prepare(request, &src, &dst).unwrap();
    let fut = c
        .decode
        .expect(
            request,
            PROMPT,
            chunk_tokens,
            dst.clone(),
            Duration::from_secs(30),
        )
        .unwrap();
    let mut fut = Box::pin(fut);

    // Ranks 1 to 3 wait until the count of released ranks passes their rank.
    let (go, _) = tokio::sync::watch::channel(1u16);
    let mut held = Vec::new();
    for rank in 1..4u16 {
        let (c, src, mut rx) = (c.clone(), src.clone(), go.subscribe());
        held.push(tokio::spawn(async move {
            rx.wait_for(|&n| n > rank).await.unwrap();
            c.send_chunks(rank, request, 0..chunks, chunks, &src).await
        }));
    }

    timeout(BOUND, c.send_chunks(0, request, 0..chunks, chunks, &src))
        .await
        .expect("rank 0's chunks did not go out in time")
        .unwrap();
    assert!(
        timeout(PENDING, &mut fut).await.is_err(),
        "decode resolved the request on rank 0's LAST alone"
    );
    assert!(
        timeout(PENDING, c.prefill[0].decided(request))
            .await
            .is_err(),
        "rank 0 decided without the other ranks' votes"
    );
    assert_eq!(c.decode.stats().in_flight, 1);

    // Ranks 1 and 2 now send everything; rank 3 is still held.
    go.send_replace(3);
    let mut held = held.into_iter();
    for t in held.by_ref().take(2) {
        join(t).await.unwrap();
    }
    assert!(
        timeout(PENDING, &mut fut).await.is_err(),
        "decode resolved the request without rank 3"
    );

    go.send_replace(4);
    for t in held {
        join(t).await.unwrap();
    }
    let outcome = timeout(BOUND, &mut fut)
        .await
        .expect("decode did not resolve after every rank sent everything");
    assert_eq!(outcome, Outcome::Complete);
    assert_eq!(
        decisions(&c, request).await,
        vec![Decision::Completed; 4],
        "every rank decides Completed"
    );
    let checked = c.verify(request, &dst).unwrap();
    assert_eq!(checked, shape.request_bytes(PROMPT));
    let s = c.decode.stats();
    assert_eq!((s.completed, s.failed, s.checksum_mismatch), (1, 0, 0));
    c.wait_quiescent(BOUND).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_of_one_rank_is_not_completion_ucx() {
    last_of_one_rank_is_not_completion(BackendKind::Ucx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_of_one_rank_is_not_completion_nixl() {
    last_of_one_rank_is_not_completion(BackendKind::Nixl).await;
}

/// Two concurrent requests; decode aborts one after every rank sent part of it. The aborted one
/// resolves `Failed(Aborted)` on decode, every rank decides it failed (each rank's own vote is the
/// abort's) and refuses further chunks of it; the other request completes with every byte right.
async fn abort_leaves_other_requests_intact(backend: BackendKind) {
    let shape = GQA8;
    let c = start(shape, backend).await;
    let chunk_tokens = 128;
    let chunks = PROMPT.div_ceil(chunk_tokens);
    let sent_before_abort = 3;
    let (aborted, kept) = (RequestId(20), RequestId(21));
    let (a_src, a_dst) = pages(shape, 0);
    let (k_src, k_dst) = pages(shape, 1);
    c.prepare(aborted, &a_src, &a_dst).unwrap();
    c.prepare(kept, &k_src, &k_dst).unwrap();
    let a_fut = c
        .decode
        .expect(
            aborted,
            PROMPT,
            chunk_tokens,
            a_dst,
            Duration::from_secs(30),
        )
        .unwrap();
    let k_fut = c
        .decode
        .expect(
            kept,
            PROMPT,
            chunk_tokens,
            k_dst.clone(),
            Duration::from_secs(30),
        )
        .unwrap();

    let (sent_tx, mut sent_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut a_tasks = Vec::new();
    let mut k_tasks = Vec::new();
    for rank in 0..4u16 {
        let (c2, src, sent) = (c.clone(), a_src.clone(), sent_tx.clone());
        a_tasks.push(tokio::spawn(async move {
            c2.send_chunks(rank, aborted, 0..sent_before_abort, chunks, &src)
                .await
                .unwrap();
            sent.send(rank).unwrap();
            // Once every rank decided, this rank has seen the abort: its next chunk must be refused.
            let p = &c2.prefill[usize::from(rank)];
            let decision = timeout(BOUND, p.decided(aborted))
                .await
                .expect("aborted request never decided");
            let next = p.send_chunk(aborted, sent_before_abort, &src, false).await;
            p.release(aborted);
            (decision, next)
        }));
        let (c2, src) = (c.clone(), k_src.clone());
        k_tasks.push(tokio::spawn(async move {
            c2.send_chunks(rank, kept, 0..chunks, chunks, &src).await
        }));
    }
    for _ in 0..4 {
        timeout(BOUND, sent_rx.recv())
            .await
            .expect("ranks did not send their first chunks in time")
            .unwrap();
    }
    c.decode.abort(aborted);
    let outcome = timeout(BOUND, a_fut).await.expect("abort did not resolve");
    assert_eq!(outcome, Outcome::Failed(FailureReason::Aborted));

    for t in a_tasks {
        let (decision, next) = join(t).await;
        // Every rank voted Failed(Aborted) on the abort, so the lowest such rank, 0, is named.
        assert_eq!(
            decision,
            Decision::Failed {
                rank: 0,
                cause: FailCause::Voted(FailureCode::Aborted)
            }
        );
        assert!(
            matches!(
                next,
                Err(EngineError::RequestFailed { request, code: FailureCode::Aborted })
                    if request == aborted
            ),
            "a chunk after the abort was not refused: {next:?}"
        );
    }
    for t in k_tasks {
        join(t).await.unwrap();
    }
    let outcome = timeout(BOUND, k_fut)
        .await
        .expect("the other request did not resolve");
    assert_eq!(outcome, Outcome::Complete);
    assert_eq!(decisions(&c, kept).await, vec![Decision::Completed; 4]);
    assert_eq!(c.verify(kept, &k_dst).unwrap(), shape.request_bytes(PROMPT));
    let s = c.decode.stats();
    assert_eq!((s.completed, s.failed, s.checksum_mismatch), (1, 1, 0));
    for p in &c.prefill {
        assert_eq!(p.stats().decided_completed, 1);
        assert_eq!(p.stats().decided_failed, 1);
    }
    c.wait_quiescent(BOUND).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_leaves_other_requests_intact_ucx() {
    abort_leaves_other_requests_intact(BackendKind::Ucx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_leaves_other_requests_intact_nixl() {
    abort_leaves_other_requests_intact(BackendKind::Nixl).await;
}

/// Rank 2 reports failure in the middle of a request while the other ranks are part-way through.
/// Decode fails the request at once with rank 2's reason (its deadline is 30 s, the wait is bounded
/// at 5 s), the other ranks are told and stop, every rank decides it failed, and a healthy request
/// running alongside completes with every byte right.
async fn failed_rank_fails_request_at_once(backend: BackendKind) {
    let shape = MLA8;
    let c = start(shape, backend).await;
    let chunk_tokens = 128;
    let chunks = PROMPT.div_ceil(chunk_tokens);
    let sent_before = 2;
    let (failing, healthy) = (RequestId(30), RequestId(31));
    let (f_src, f_dst) = pages(shape, 0);
    let (h_src, h_dst) = pages(shape, 1);
    c.prepare(failing, &f_src, &f_dst).unwrap();
    c.prepare(healthy, &h_src, &h_dst).unwrap();
    let f_fut = c
        .decode
        .expect(
            failing,
            PROMPT,
            chunk_tokens,
            f_dst,
            Duration::from_secs(30),
        )
        .unwrap();
    let h_fut = c
        .decode
        .expect(
            healthy,
            PROMPT,
            chunk_tokens,
            h_dst.clone(),
            Duration::from_secs(30),
        )
        .unwrap();
    let mut h_tasks = Vec::new();
    for rank in 0..4u16 {
        let (c2, src) = (c.clone(), h_src.clone());
        h_tasks.push(tokio::spawn(async move {
            c2.send_chunks(rank, healthy, 0..chunks, chunks, &src).await
        }));
    }
    // Every rank is part-way through the failing request (none sent LAST) when rank 2 fails it.
    for rank in 0..4u16 {
        timeout(
            BOUND,
            c.send_chunks(rank, failing, 0..sent_before, chunks, &f_src),
        )
        .await
        .expect("first chunks did not go out in time")
        .unwrap();
    }
    let t0 = Instant::now();
    c.prefill[2].fail(failing, FailureCode::Internal);
    let outcome = timeout(Duration::from_secs(5), f_fut)
        .await
        .expect("decode did not fail the request within 5 s of rank 2's failure");
    assert_eq!(
        outcome,
        Outcome::Failed(FailureReason::PeerFailed {
            rank: 2,
            code: FailureCode::Internal
        })
    );
    let took = t0.elapsed();

    // The ranks that did not fail are told by decode (an abort carrying rank 2's code) and vote on
    // it, so every board decides, identically; then every rank refuses the request's next chunk.
    let mut ds = Vec::new();
    for p in &c.prefill {
        let d = timeout(BOUND, p.decided(failing))
            .await
            .unwrap_or_else(|_| panic!("rank {} never decided the failed request", p.pp_rank()));
        let next = p.send_chunk(failing, sent_before, &f_src, false).await;
        assert!(
            matches!(
                next,
                Err(EngineError::RequestFailed { request, code: FailureCode::Internal })
                    if request == failing
            ),
            "rank {} took a chunk of the failed request: {next:?}",
            p.pp_rank()
        );
        p.release(failing);
        ds.push(d);
    }
    assert!(
        matches!(
            ds[0],
            Decision::Failed {
                cause: FailCause::Voted(FailureCode::Internal),
                ..
            }
        ),
        "{ds:?}"
    );
    assert!(ds.iter().all(|d| *d == ds[0]), "boards disagree: {ds:?}");
    for t in h_tasks {
        join(t).await.unwrap();
    }
    let outcome = timeout(BOUND, h_fut)
        .await
        .expect("the healthy request did not resolve");
    assert_eq!(outcome, Outcome::Complete);
    assert_eq!(decisions(&c, healthy).await, vec![Decision::Completed; 4]);
    assert_eq!(
        c.verify(healthy, &h_dst).unwrap(),
        shape.request_bytes(PROMPT)
    );
    let s = c.decode.stats();
    assert_eq!((s.completed, s.failed, s.checksum_mismatch), (1, 1, 0));
    for p in &c.prefill {
        // The healthy request's chunks plus the failing one's first chunks, nothing after them.
        assert_eq!(p.stats().chunks, u64::from(chunks + sent_before));
        assert_eq!(p.stats().decided_failed, 1);
    }
    c.wait_quiescent(BOUND).await.unwrap();
    assert!(took < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_rank_fails_request_at_once_ucx() {
    failed_rank_fails_request_at_once(BackendKind::Ucx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_rank_fails_request_at_once_nixl() {
    failed_rank_fails_request_at_once(BackendKind::Nixl).await;
}
