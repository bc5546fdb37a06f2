#![allow(clippy::unwrap_used)]
//! More faults over real loopback UCX in one process (DESIGN.md §7), on the cluster of
//! `tests/faults.rs`: one decode engine and four prefill PP ranks, each on a [`FaultTransport`] around
//! a real `UcxTransport`.
//!
//! - a rank dies (its engine is dropped) before voting;
//! - engines are dropped while requests are in flight;
//! - security: a wrong or missing token, forged notifications, out-of-range pages.
//!
//! Each checks that decode reports exactly one terminal outcome per request, that nothing outlives its
//! bound, that a failure carries its typed cause, and that the counters of the engines that survive
//! return to their baseline. Every wait is bounded; nothing sleeps and then asserts.

mod common;

use common::small::*;
use futures::FutureExt;
use kvbench::cluster::{Cluster, ClusterSpec, PoolKind};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};
use transfer_engine::control::{ControlError, RejectReason};
use transfer_engine::core::notify::{self, ChunkNotification, ChunkStatus};
use transfer_engine::core::planner::{KvLayout, PpSplit};
use transfer_engine::core::tracker::FailureReason;
use transfer_engine::core::vote::{Decision, FailCause};
use transfer_engine::core::{FailureCode, RequestId};
use transfer_engine::engine::{
    BackendConfig, CustomBackend, DecodeConfig, DecodeEngine, EngineError, Outcome, Pool,
    PrefillConfig, PrefillEngine,
};
use transfer_engine::mem::{HostBuffer, HostOptions, MemDesc};
use transfer_engine::transport::fault::{FaultPlan, FaultTransport, Match, RecvFault, Rule};
use transfer_engine::transport::ucx::{UcxConfig, UcxTransport};
use transfer_engine::transport::{
    BackendKind, Done, Incoming, PeerId, RegionId, RemoteRegion, Sender, Sink, Transport,
    TransportError, TransportStats, WriteOp,
};

/// Pages in decode's pool.
const DECODE_PAGES: u32 = 16;
/// How soon a lost rank must fail a request whose deadline is [`LONG`].
const PROMPTLY: Duration = Duration::from_millis(1500);

/// The sender each PP rank's real notifications arrive from, as decode's transport saw them.
type Senders = Arc<Mutex<HashMap<u16, Sender>>>;

/// A cluster whose every engine runs on a fault transport.
struct Faulty {
    c: Cluster,
    decode: Arc<FaultTransport>,
    prefill: Vec<Arc<FaultTransport>>,
    /// Filled by decode's sink as real notifications arrive (first sender seen per rank).
    senders: Senders,
}

/// A `Custom` backend wrapping a UCX transport in a fault transport with no rules yet (and, for
/// decode, a sink that records which sender each rank's notifications come from).
fn faulty_backend(
    name: String,
    record: Option<Senders>,
    gate: Option<Arc<GateCtl>>,
) -> (BackendConfig, Arc<OnceLock<Arc<FaultTransport>>>) {
    let slot = Arc::new(OnceLock::new());
    let s2 = slot.clone();
    let cfg = UcxConfig {
        name,
        ..UcxConfig::default()
    };
    let backend = CustomBackend::new(BackendKind::Ucx, move |sink: Sink| {
        let cfg = cfg.clone();
        let sink = match record.clone() {
            None => sink,
            Some(rec) => Arc::new(move |ev: Incoming<'_>| {
                if let Incoming::Notification { sender, bytes } = &ev
                    && let Ok(n) = notify::decode_binary(bytes)
                {
                    let mut m = rec.lock().unwrap();
                    m.entry(n.pp_rank).or_insert_with(|| sender.clone());
                }
                sink(ev)
            }) as Sink,
        };
        let ft = FaultTransport::new(FaultPlan::new(7), sink, move |s| {
            Ok(Arc::new(UcxTransport::new(cfg, s)?) as Arc<dyn Transport>)
        })?;
        s2.set(ft.clone())
            .map_err(|_| TransportError::Injected("backend built twice".into()))?;
        Ok(match gate.clone() {
            None => ft as Arc<dyn Transport>,
            Some(g) => Arc::new(Gate {
                inner: ft as Arc<dyn Transport>,
                g,
            }) as Arc<dyn Transport>,
        })
    });
    (BackendConfig::Custom(backend), slot)
}

fn tag() -> String {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("faults-more-{}-{n}", std::process::id())
}

fn spec() -> ClusterSpec {
    ClusterSpec {
        shape: SHAPE,
        pp: PP,
        decode_pages: DECODE_PAGES,
        prefill_pages: 8,
        backend: BackendKind::Ucx,
        checksums: true,
        decode_pool: PoolKind::Shared,
        metrics: None,
        decode_progress: Default::default(),
    }
}

fn decode_layout() -> KvLayout {
    KvLayout::packed(
        0,
        SHAPE.layers,
        SHAPE.regions,
        SHAPE.page_bytes(),
        DECODE_PAGES,
    )
}

fn rank_layout(rank: u16, pp: u16) -> (std::ops::Range<u32>, KvLayout) {
    let range = PpSplit::SglangEven
        .layer_range(SHAPE.layers, pp, rank)
        .unwrap();
    let layout = KvLayout::packed(
        range.start,
        range.len() as u32,
        SHAPE.regions,
        SHAPE.page_bytes(),
        8,
    );
    (range, layout)
}

fn zeroed_pool(layout: &KvLayout) -> Pool {
    Pool::Owned(HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap())
}

/// What `kvbench::cluster::Cluster::start` does, with fault transports under every engine.
async fn start() -> Faulty {
    start_gated(None).await
}

/// [`start`], with rank `gate.0`'s transport behind a [`Gate`].
async fn start_gated(gate: Option<(u16, Arc<GateCtl>)>) -> Faulty {
    tokio::time::timeout(Duration::from_secs(30), try_start(gate))
        .await
        .expect("cluster did not start within 30 s")
        .unwrap()
}

async fn try_start(gate: Option<(u16, Arc<GateCtl>)>) -> Result<Faulty, EngineError> {
    let senders: Senders = Arc::default();
    let (mut dslot, mut slots) = (None, Vec::new());
    let c = Cluster::start_with(spec(), |rank, name| {
        let name = format!("more-{name}");
        match rank {
            None => {
                let (backend, slot) = faulty_backend(name, Some(senders.clone()), None);
                dslot = Some(slot);
                backend
            }
            Some(rank) => {
                let g = gate
                    .as_ref()
                    .filter(|(r, _)| *r == rank)
                    .map(|(_, g)| g.clone());
                let (backend, slot) = faulty_backend(name, None, g);
                slots.push(slot);
                backend
            }
        }
    })
    .await?;
    let get = |s: &OnceLock<Arc<FaultTransport>>| s.get().cloned().unwrap();
    Ok(Faulty {
        decode: get(&dslot.unwrap()),
        prefill: slots.iter().map(|s| get(s)).collect(),
        senders,
        c,
    })
}

type SendTask = tokio::task::JoinHandle<Result<(), EngineError>>;
type OutcomeFut = Pin<Box<dyn Future<Output = Outcome> + Send>>;

/// Sends every chunk of `request` from `p`, one after the other, stopping at the first error.
fn spawn_sender(p: &PrefillEngine, request: RequestId, src: &'static [u32]) -> SendTask {
    let p = p.clone();
    tokio::spawn(async move {
        for c in 0..CHUNKS {
            p.send_chunk(request, c, src, c + 1 == CHUNKS).await?;
        }
        Ok(())
    })
}

async fn join_sends(sends: Vec<SendTask>, what: &str) -> Vec<Result<(), EngineError>> {
    let mut out = Vec::new();
    for s in sends {
        out.push(
            tokio::time::timeout(BOUND, s)
                .await
                .unwrap_or_else(|_| panic!("a sender of {what} hung"))
                .unwrap(),
        );
    }
    out
}

/// Runs `request` on every rank of `prefill` to completion and checks its bytes.
async fn run_healthy(f: &Faulty, request: RequestId, src: &'static [u32], dst: &[u32]) {
    f.c.prepare(request, src, dst).unwrap();
    let o =
        f.c.decode
            .expect(request, PROMPT, CHUNK, dst.to_vec(), LONG)
            .unwrap();
    let sends =
        f.c.prefill
            .iter()
            .map(|p| spawn_sender(p, request, src))
            .collect();
    let o = tokio::time::timeout(BOUND, o)
        .await
        .expect("healthy request did not end");
    assert_eq!(o, Outcome::Complete, "healthy request {request:?}");
    for r in join_sends(sends, "a healthy request").await {
        r.unwrap();
    }
    assert_eq!(
        f.c.verify(request, dst).unwrap(),
        SHAPE.request_bytes(PROMPT)
    );
    for p in &f.c.prefill {
        let d = tokio::time::timeout(BOUND, p.decided(request))
            .await
            .expect("healthy request undecided");
        assert_eq!(d, Decision::Completed, "rank {}", p.pp_rank());
        p.release(request);
    }
}

/// Polls `cond` every few milliseconds for up to `within`.
async fn eventually(within: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < end, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// What is left over on the engines still in `c` (ranks named by `pp_rank`, so a cluster that lost a
/// rank is checked too): decode tracks nothing, no rank has an undecided request or a chunk in flight,
/// every transport registers exactly its pool.
fn leftovers(c: &Cluster) -> Vec<String> {
    let mut left = Vec::new();
    let d = c.decode.stats();
    if d.in_flight != 0 {
        left.push(format!("decode tracks {}", d.in_flight));
    }
    if d.registered_bytes != c.decode_pool_len() {
        left.push(format!("decode registers {}", d.registered_bytes));
    }
    for p in &c.prefill {
        let rank = p.pp_rank();
        let (s, t) = (p.stats(), p.transport_stats());
        let want = c.prefill_pool_len(rank);
        if s.undecided != 0 {
            left.push(format!("rank {rank}: {} undecided", s.undecided));
        }
        if t.in_flight != 0 {
            left.push(format!("rank {rank}: {} in flight", t.in_flight));
        }
        if t.registered_bytes != want || s.registered_bytes != want {
            left.push(format!("rank {rank} registers {}", t.registered_bytes));
        }
    }
    left
}

async fn quiescent(c: &Cluster) {
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        let left = leftovers(c);
        if left.is_empty() {
            return;
        }
        assert!(Instant::now() < end, "not quiescent: {}", left.join("; "));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Decode reported exactly one outcome per request: `completed` completions and `failed` failures.
fn one_outcome_each(d: &DecodeEngine, completed: u64, failed: u64) {
    let s = d.stats();
    let t = d.tracker_counters();
    assert_eq!((s.completed, s.failed), (completed, failed), "{s:?}");
    assert_eq!((t.completed, t.failed), (completed, failed), "{t:?}");
    assert_eq!(s.in_flight, 0);
    assert_eq!(s.checksum_mismatch, 0);
}

/// Drops `x` on a blocking thread and fails the test if that takes longer than [`BOUND`] (a hang or a
/// self-join in an engine's or transport's `Drop`). Returns how long it took.
async fn drop_bounded<T: Send + 'static>(x: T, what: &str) -> Duration {
    let t = Instant::now();
    let h = tokio::task::spawn_blocking(move || drop(x));
    tokio::time::timeout(BOUND, h)
        .await
        .unwrap_or_else(|_| panic!("dropping {what} did not return within {BOUND:?}"))
        .unwrap_or_else(|e| panic!("dropping {what} panicked: {e}"));
    t.elapsed()
}

// ---------------------------------------------------------------------------------------------------
// 1. A rank dies before voting.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_dies_before_voting_fails_promptly_everywhere() {
    let mut f = start().await;
    run_healthy(&f, A, &SRC_A, &DST_A).await;
    let t0 = Instant::now();
    let mut b =
        f.c.decode
            .expect(B, PROMPT, CHUNK, DST_B.to_vec(), LONG)
            .unwrap()
            .boxed();
    // Every rank but 2 sends B's first chunk (not LAST): nobody has voted on B yet.
    for p in f.c.prefill.iter().filter(|p| p.pp_rank() != 2) {
        tokio::time::timeout(BOUND, p.send_chunk(B, 0, &SRC_B, false))
            .await
            .expect("chunk 0 of B hung")
            .unwrap();
    }
    assert!((&mut b).now_or_never().is_none(), "B ended early");
    assert_eq!(f.c.prefill[2].stats().undecided, 0);

    // Rank 2 dies: its engine (every clone) and its transport go; its control connections close.
    let dead = (f.c.prefill.remove(2), f.prefill.remove(2));
    let killed = Instant::now();
    let took = drop_bounded(dead, "rank 2").await;
    eprintln!("dropping rank 2 took {took:?}");

    let o = tokio::time::timeout(PROMPTLY, &mut b)
        .await
        .expect("decode did not fail B promptly after rank 2 died");
    let lost_after = killed.elapsed();
    assert!(
        matches!(o, Outcome::Failed(FailureReason::PeerLost { rank: 2, .. })),
        "{o:?}"
    );
    assert!(
        t0.elapsed() < LONG / 4,
        "B failed only after {:?}",
        t0.elapsed()
    );
    eprintln!("B failed {lost_after:?} after rank 2 was dropped");

    // Every surviving rank decides B failed, with rank 2 lost or a failure vote as its cause.
    for p in &f.c.prefill {
        let d = tokio::time::timeout(PROMPTLY, p.decided(B))
            .await
            .unwrap_or_else(|_| panic!("rank {} did not decide B", p.pp_rank()));
        assert!(
            matches!(
                d,
                Decision::Failed {
                    cause: FailCause::PeerLost | FailCause::Voted(_),
                    ..
                }
            ),
            "rank {}: {d:?}",
            p.pp_rank()
        );
        // And refuses to send more of it.
        let r = tokio::time::timeout(BOUND, p.send_chunk(B, 1, &SRC_B, true))
            .await
            .expect("send after the decision hung");
        assert!(
            matches!(r, Err(EngineError::RequestFailed { request: B, .. })),
            "rank {}: {r:?}",
            p.pp_rank()
        );
        p.release(B);
    }
    assert!(killed.elapsed() < 2 * PROMPTLY + took);

    // Decode's one outcome per request holds. A new request waits for rank 2 (at most its own
    // timeout here), no rank is asked for it, and it fails naming the absent rank.
    one_outcome_each(&f.c.decode, 1, 1);
    let s = f.c.decode.stats();
    assert_eq!(s.failed_peer_lost, 1, "{s:?}");
    let wait = Duration::from_millis(300);
    let t = Instant::now();
    let o =
        f.c.decode
            .expect(RequestId(3), PROMPT, CHUNK, DST_A.to_vec(), wait)
            .unwrap();
    let o = tokio::time::timeout(BOUND, o).await.unwrap();
    assert_eq!(
        o,
        Outcome::Failed(FailureReason::RankUnavailable { rank: 2 })
    );
    assert!(t.elapsed() >= wait, "{:?}", t.elapsed());
    quiescent(&f.c).await;
    let s = f.c.decode.stats();
    assert_eq!((s.failed, s.failed_rank_unavailable), (2, 1), "{s:?}");
    // The tracker never saw it: it was never launched.
    assert_eq!(f.c.decode.tracker_counters().failed, 1);
    // Its pages are free again. B's stay held: rank 2's connection ended without its Close, and
    // for all decode knows a reset cut off a rank that still writes until it notices.
    assert_eq!(f.c.decode.quarantined(), vec![B]);
    assert_eq!(f.c.decode.stats().unclean_ends, 1);
}

// ---------------------------------------------------------------------------------------------------
// 2. Shutdown during traffic.

/// Expects `n` requests (ids from 10; their bytes are not checked) on pages that no other request
/// holds (B keeps `DST_B`; `expect` refuses a held page), and starts every rank's senders for them.
fn start_traffic(f: &Faulty, n: u64) -> (Vec<OutcomeFut>, Vec<SendTask>) {
    let free: Vec<u32> = (0..DECODE_PAGES).filter(|p| !DST_B.contains(p)).collect();
    assert!(
        n as usize * DST_A.len() <= free.len(),
        "not enough free pages for {n} requests"
    );
    let mut outs = Vec::new();
    let mut sends = Vec::new();
    for (i, dst) in free.chunks(DST_A.len()).take(n as usize).enumerate() {
        let i = i as u64;
        let r = RequestId(10 + i);
        outs.push(
            f.c.decode
                .expect(r, PROMPT, CHUNK, dst.to_vec(), LONG)
                .unwrap()
                .boxed(),
        );
        for p in &f.c.prefill {
            sends.push(spawn_sender(
                p,
                r,
                if i.is_multiple_of(2) { &SRC_A } else { &SRC_B },
            ));
        }
    }
    (outs, sends)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_decode_mid_traffic_ends_everything_within_bound() {
    let f = start().await;
    run_healthy(&f, A, &SRC_A, &DST_A).await;
    // B's LAST from rank 1 is held by decode's transport, so B is certainly in flight at the drop.
    f.decode.add_recv(Rule::new(
        Match::request(B).rank(1).last(),
        RecvFault::Delay { after: None },
    ));
    let b =
        f.c.decode
            .expect(B, PROMPT, CHUNK, DST_B.to_vec(), LONG)
            .unwrap();
    let b_sends: Vec<SendTask> =
        f.c.prefill
            .iter()
            .map(|p| spawn_sender(p, B, &SRC_B))
            .collect();
    for r in join_sends(b_sends, "B").await {
        r.unwrap();
    }
    eventually(BOUND, "rank 1's LAST of B held", || f.decode.held() == 1).await;
    let (outs, sends) = start_traffic(&f, 3);

    // Drop decode (the engine and the test's handle on its transport) with all that in flight.
    let Faulty {
        c,
        decode: d_transport,
        prefill,
        ..
    } = f;
    let Cluster {
        decode: d_engine,
        prefill: engines,
        ..
    } = c;
    let t = Instant::now();
    let took = drop_bounded((d_engine, d_transport), "the decode engine").await;
    eprintln!("dropping decode took {took:?}");

    // Every pending future resolves, failed.
    let o = tokio::time::timeout(BOUND, b)
        .await
        .expect("B's future hung after decode was dropped");
    assert!(matches!(o, Outcome::Failed(_)), "B: {o:?}");
    for (i, o) in outs.into_iter().enumerate() {
        let o = tokio::time::timeout(BOUND, o)
            .await
            .unwrap_or_else(|_| panic!("request {i}'s future hung after decode was dropped"));
        // A request may have completed before the drop; none may hang.
        eprintln!("traffic request {i}: {o:?}");
    }
    // Every send returns (done before the drop, or failed: decode's transport is gone).
    for r in join_sends(sends, "the traffic").await {
        if let Err(e) = r {
            eprintln!("send: {e}");
        }
    }
    eprintln!("everything ended {:?} after the drop", t.elapsed());
    // The prefill ranks then shut down within bound too, transports and all.
    let took = drop_bounded((engines, prefill), "the prefill engines").await;
    eprintln!("dropping the prefill ranks took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_every_engine_mid_traffic_ends_within_bound() {
    let f = start().await;
    run_healthy(&f, A, &SRC_A, &DST_A).await;
    let (outs, sends) = start_traffic(&f, 3);
    let t = Instant::now();
    // Every handle the test holds goes at once; the senders still hold clones of the prefill engines
    // until their sends return.
    let took = drop_bounded(f, "every engine").await;
    eprintln!("dropping every engine took {took:?}");
    for (i, o) in outs.into_iter().enumerate() {
        let o = tokio::time::timeout(BOUND, o)
            .await
            .unwrap_or_else(|_| panic!("request {i}'s future hung after the engines were dropped"));
        eprintln!("traffic request {i}: {o:?}");
    }
    // Each sender's last clone drops on a runtime worker once its send returns: that must not hang.
    for r in join_sends(sends, "the traffic").await {
        if let Err(e) = r {
            eprintln!("send: {e}");
        }
    }
    assert!(t.elapsed() < 2 * BOUND);
}

/// After decode's engine is gone, a prefill rank should learn it: `next_request()` ends (`None`)
/// once the allocations queued before are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_learns_when_decode_engine_is_dropped() {
    let f = start().await;
    run_healthy(&f, A, &SRC_A, &DST_A).await;
    let Faulty {
        c, decode, prefill, ..
    } = f;
    let Cluster {
        decode: d,
        prefill: engines,
        ..
    } = c;
    drop_bounded((d, decode), "the decode engine").await;
    let end = tokio::time::Instant::now() + BOUND;
    for p in &engines {
        // Allocations queued before the drop (A's) come first; then the stream must end.
        loop {
            match tokio::time::timeout_at(end, p.next_request()).await {
                Ok(None) => break,
                Ok(Some(_)) => continue,
                Err(_) => panic!(
                    "rank {}: decode's engine was dropped {BOUND:?} ago and its control connection is still open",
                    p.pp_rank()
                ),
            }
        }
    }
    drop_bounded((engines, prefill), "the prefill engines").await;
}

// ---------------------------------------------------------------------------------------------------
// 3. Security.

/// Starts a decode engine with `pp_size` 1 requiring `token`, on plain UCX.
async fn decode_with_token(token: Option<&[u8]>) -> DecodeEngine {
    let mut cfg = DecodeConfig::new(SHAPE.layers, SHAPE.page_tokens, decode_layout(), 1);
    cfg.backend = BackendConfig::default_for(BackendKind::Ucx, &format!("decode-{}", tag()));
    cfg.token = token.map(transfer_engine::control::Secret::new);
    let pool =
        HostBuffer::new(decode_layout().buffer_len as usize, HostOptions::default()).unwrap();
    tokio::time::timeout(BOUND, DecodeEngine::start(cfg, Pool::Owned(pool)))
        .await
        .unwrap()
        .unwrap()
}

/// Starts the one prefill rank of a `pp_size` 1 cluster, presenting `token`.
async fn prefill_with_token(
    decode: &DecodeEngine,
    token: Option<&[u8]>,
) -> Result<PrefillEngine, EngineError> {
    let (_, layout) = rank_layout(0, 1);
    let mut cfg = PrefillConfig::new(
        decode.local_addr(),
        0,
        1,
        SHAPE.layers,
        SHAPE.page_tokens,
        layout.clone(),
    );
    cfg.backend = BackendConfig::default_for(BackendKind::Ucx, &format!("prefill-{}", tag()));
    cfg.token = token.map(transfer_engine::control::Secret::new);
    cfg.connect_timeout = Duration::from_secs(5);
    tokio::time::timeout(BOUND, PrefillEngine::start(cfg, zeroed_pool(&layout)))
        .await
        .expect("prefill start hung")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_token_is_rejected_and_binds_nothing() {
    let d = decode_with_token(Some(b"the right secret")).await;
    for (what, token) in [("wrong", Some(&b"a wrong secret"[..])), ("missing", None)] {
        let t = Instant::now();
        let e = prefill_with_token(&d, token)
            .await
            .err()
            .unwrap_or_else(|| panic!("a prefill with a {what} token started"));
        let msg = e.to_string();
        // Decode, the listener, checks the prefill's proof first and refuses it.
        assert!(
            matches!(
                e,
                EngineError::Control(ControlError::PeerRejected {
                    reason: RejectReason::AuthFailed,
                    ..
                })
            ),
            "{what} token: {e:?}"
        );
        assert!(msg.contains("authentication"), "{what} token: {msg}");
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "rejection took {:?}",
            t.elapsed()
        );
        // Decode bound no rank: a request waits for rank 0 and fails naming it.
        let o = d
            .expect(A, PROMPT, CHUNK, DST_A.to_vec(), Duration::from_millis(200))
            .unwrap();
        assert_eq!(
            tokio::time::timeout(BOUND, o).await.unwrap(),
            Outcome::Failed(FailureReason::RankUnavailable { rank: 0 }),
            "decode bound a rank that presented a {what} token"
        );
    }
    // The right token still gets in, and a request completes.
    let p = prefill_with_token(&d, Some(b"the right secret"))
        .await
        .unwrap();
    d.wait_for_ranks(BOUND).await.unwrap();
    let o = d.expect(A, PROMPT, CHUNK, DST_A.to_vec(), LONG).unwrap();
    for c in 0..CHUNKS {
        p.send_chunk(A, c, &SRC_A, c + 1 == CHUNKS).await.unwrap();
    }
    let o = tokio::time::timeout(BOUND, o).await.unwrap();
    assert_eq!(o, Outcome::Complete);
    let s = d.stats();
    // The two requests that waited for a rank failed before any rank was asked for them.
    assert_eq!(
        (s.completed, s.failed, s.failed_rank_unavailable),
        (1, 2, 2),
        "{s:?}"
    );
    assert_eq!(d.tracker_counters().failed, 0);
    assert_eq!(s.unknown_sender, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_notifications_change_nothing() {
    let f = start().await;
    // A first: every rank's real sender is then known.
    run_healthy(&f, A, &SRC_A, &DST_A).await;
    let senders = f.senders.lock().unwrap().clone();
    assert_eq!(senders.len(), usize::from(PP), "{senders:?}");
    let rank0 = senders[&0].clone();
    let unknown = (0u64..)
        .map(Sender::Key)
        .find(|s| !senders.values().any(|v| v == s))
        .unwrap();

    f.c.prepare(B, &SRC_B, &DST_B).unwrap();
    let mut b =
        f.c.decode
            .expect(B, PROMPT, CHUNK, DST_B.to_vec(), LONG)
            .unwrap()
            .boxed();
    let before = f.c.decode.stats();
    let tbefore = f.c.decode.tracker_counters();
    // Every chunk of every rank of B, LAST included, and a FAILURE, from a key no rank holds.
    let mut forged_unknown = 0u64;
    for rank in 0..PP {
        for c in 0..CHUNKS {
            let status = if c + 1 == CHUNKS {
                ChunkStatus::Last { count: CHUNKS }
            } else {
                ChunkStatus::More
            };
            let n = ChunkNotification::new(B, rank, c, status);
            f.decode.inject(unknown.clone(), &n.encode());
            forged_unknown += 1;
        }
        let fail = ChunkNotification::new(
            B,
            rank,
            0,
            ChunkStatus::Failed {
                code: FailureCode::Internal,
            },
        );
        f.decode.inject(unknown.clone(), &fail.encode());
        forged_unknown += 1;
    }
    // Rank 1's chunks, LAST and a FAILURE, sent with rank 0's sender.
    let claims = [
        ChunkNotification::new(B, 1, 0, ChunkStatus::More),
        ChunkNotification::new(B, 1, 1, ChunkStatus::Last { count: CHUNKS }),
        ChunkNotification::new(
            B,
            1,
            0,
            ChunkStatus::Failed {
                code: FailureCode::Internal,
            },
        ),
    ];
    for n in &claims {
        f.decode.inject(rank0.clone(), &n.encode());
    }
    let after = f.c.decode.stats();
    let tafter = f.c.decode.tracker_counters();
    assert_eq!(after.unknown_sender - before.unknown_sender, forged_unknown);
    assert_eq!(after.refused - before.refused, claims.len() as u64);
    assert_eq!(tafter.wrong_peer - tbefore.wrong_peer, claims.len() as u64);
    assert_eq!(
        tafter.new_chunks, tbefore.new_chunks,
        "a forged chunk counted"
    );
    assert_eq!((after.completed, after.failed), (1, 0), "{after:?}");
    assert_eq!(after.in_flight, 1);
    assert!(
        (&mut b).now_or_never().is_none(),
        "a forged notification ended B"
    );
    assert_eq!(
        f.decode.counters().injected,
        forged_unknown + claims.len() as u64
    );

    // B then completes normally, with the right bytes.
    let sends =
        f.c.prefill
            .iter()
            .map(|p| spawn_sender(p, B, &SRC_B))
            .collect();
    let o = tokio::time::timeout(BOUND, b).await.expect("B did not end");
    assert_eq!(o, Outcome::Complete);
    for r in join_sends(sends, "B").await {
        r.unwrap();
    }
    assert_eq!(f.c.verify(B, &DST_B).unwrap(), SHAPE.request_bytes(PROMPT));
    for p in &f.c.prefill {
        let d = tokio::time::timeout(BOUND, p.decided(B)).await.unwrap();
        assert_eq!(d, Decision::Completed);
        p.release(B);
    }
    quiescent(&f.c).await;
    one_outcome_each(&f.c.decode, 2, 0);
    assert_eq!(f.c.decode.stats().malformed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_pages_are_refused_before_anything_is_sent() {
    let f = start().await;
    let d = &f.c.decode;
    let bad: [(&str, Vec<u32>); 4] = [
        ("page == pool pages", vec![1, 2, 3, DECODE_PAGES]),
        ("page far past the pool", vec![u32::MAX, 0, 1, 2]),
        ("too few pages", vec![1, 2, 3]),
        ("a page twice", vec![1, 2, 2, 3]),
    ];
    for (what, pages) in bad {
        match d.expect(A, PROMPT, CHUNK, pages, LONG) {
            Err(e @ EngineError::Config(_)) => eprintln!("{what}: {e}"),
            Err(e) => panic!("{what}: {e:?}"),
            Ok(_) => panic!("{what}: expect accepted it"),
        }
    }
    let s = d.stats();
    assert_eq!((s.in_flight, s.completed, s.failed), (0, 0, 0), "{s:?}");
    // Nothing reached a rank: the first allocation each rank sees is the valid request that follows
    // (same id, so the refused ones were not tracked either), and no rank rejected anything.
    f.c.prepare(A, &SRC_A, &DST_A).unwrap();
    let o = d.expect(A, PROMPT, CHUNK, DST_A.to_vec(), LONG).unwrap();
    for p in &f.c.prefill {
        let n = tokio::time::timeout(BOUND, p.next_request())
            .await
            .expect("no allocation arrived")
            .unwrap();
        assert_eq!(n.request, A, "rank {}", p.pp_rank());
        assert_eq!(p.stats().rejected_requests, 0);
    }
    let sends =
        f.c.prefill
            .iter()
            .map(|p| spawn_sender(p, A, &SRC_A))
            .collect();
    assert_eq!(
        tokio::time::timeout(BOUND, o).await.unwrap(),
        Outcome::Complete
    );
    for r in join_sends(sends, "A").await {
        r.unwrap();
    }
    assert_eq!(f.c.verify(A, &DST_A).unwrap(), SHAPE.request_bytes(PROMPT));
    for p in &f.c.prefill {
        assert_eq!(
            tokio::time::timeout(BOUND, p.decided(A)).await.unwrap(),
            Decision::Completed
        );
        p.release(A);
        assert_eq!(p.stats().rejected_requests, 0);
    }
    quiescent(&f.c).await;
    one_outcome_each(d, 1, 0);
}

// ---------------------------------------------------------------------------------------------------
// 2b. The last reference to a prefill engine dropped on its transport's progress thread.

/// Steers a [`Gate`].
#[derive(Default)]
struct GateCtl {
    /// The request whose data posts the gate fails (as a real write error would, on the progress
    /// thread) and whose FAILURE notification post it holds until `go`.
    armed: Mutex<Option<RequestId>>,
    entered: tokio::sync::Notify,
    go: (Mutex<bool>, Condvar),
    log: Mutex<Vec<String>>,
}

impl GateCtl {
    fn note(&self, what: String) {
        self.log.lock().unwrap().push(what);
    }
}

fn thread_name() -> String {
    std::thread::current()
        .name()
        .unwrap_or("<unnamed>")
        .to_string()
}

/// A transport wrapper that widens one race window: a failed chunk's completion runs the engine's
/// `chunk_done` on the progress thread, which posts the FAILURE notification through this wrapper;
/// the wrapper holds that call until the test says go, so the test can drop every other reference to
/// the engine meanwhile. It logs the thread `deregister` and `drop` run on.
struct Gate {
    inner: Arc<dyn Transport>,
    g: Arc<GateCtl>,
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.g.note(format!("drop on {}", thread_name()));
    }
}

impl Transport for Gate {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }
    fn metadata(&self) -> Result<Vec<u8>, TransportError> {
        self.inner.metadata()
    }
    fn name(&self) -> String {
        self.inner.name()
    }
    unsafe fn register(&self, mem: MemDesc) -> Result<(RegionId, RemoteRegion), TransportError> {
        // SAFETY: our caller made `Transport::register`'s promise for `mem`; we pass it on unchanged.
        unsafe { self.inner.register(mem) }
    }
    unsafe fn deregister(&self, id: RegionId) -> Result<(), TransportError> {
        let t = Instant::now();
        // SAFETY: our caller made `Transport::deregister`'s promise for `id`; passed on unchanged.
        let r = unsafe { self.inner.deregister(id) };
        self.g.note(format!(
            "deregister on {} took {:?}: {r:?}",
            thread_name(),
            t.elapsed()
        ));
        r
    }
    fn connect(
        &self,
        metadata: &[u8],
        regions: &[RemoteRegion],
        key: u64,
    ) -> Result<PeerId, TransportError> {
        self.inner.connect(metadata, regions, key)
    }
    fn disconnect(&self, peer: PeerId) {
        self.inner.disconnect(peer);
    }
    fn post(&self, peer: PeerId, writes: Vec<WriteOp>, notification: Vec<u8>, done: Done) {
        let armed = *self.g.armed.lock().unwrap();
        let n = notify::decode_binary(&notification).ok();
        match n {
            Some(n)
                if Some(n.request) == armed && matches!(n.status, ChunkStatus::Failed { .. }) =>
            {
                self.g
                    .note(format!("failure notification posted on {}", thread_name()));
                self.g.entered.notify_one();
                let (m, cv) = &self.g.go;
                let go = m.lock().unwrap();
                let _ = cv
                    .wait_timeout_while(go, Duration::from_secs(5), |go| !*go)
                    .unwrap();
                self.inner.post(peer, writes, notification, done);
            }
            Some(n) if Some(n.request) == armed && !writes.is_empty() => {
                self.inner.post(
                    peer,
                    writes,
                    Vec::new(),
                    Box::new(move |_| {
                        done(Err(TransportError::Injected("write failed (gate)".into())))
                    }),
                );
            }
            _ => self.inner.post(peer, writes, notification, done),
        }
    }
    fn stats(&self) -> TransportStats {
        self.inner.stats()
    }
    fn set_active(&self, active: bool) {
        self.inner.set_active(active);
    }
}

/// A chunk's failed completion upgrades the engine's `Weak` on the progress thread; when the server
/// drops its last handle meanwhile, that upgraded `Arc` is the last one, and the engine (its
/// registration, its transport) is dropped on the progress thread itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_prefill_reference_dropped_on_progress_thread() {
    let g = Arc::new(GateCtl::default());
    let mut f = start_gated(Some((1, g.clone()))).await;
    run_healthy(&f, A, &SRC_A, &DST_A).await;
    *g.armed.lock().unwrap() = Some(B);
    let _b =
        f.c.decode
            .expect(B, PROMPT, CHUNK, DST_B.to_vec(), LONG)
            .unwrap();
    let sender = {
        let p = f.c.prefill[1].clone();
        tokio::spawn(async move { p.send_chunk(B, 0, &SRC_B, false).await })
    };
    tokio::time::timeout(BOUND, g.entered.notified())
        .await
        .expect("rank 1's failed chunk never reached the gate");
    // The progress thread is inside chunk_done, holding an upgraded Arc to rank 1's engine. Drop
    // every other reference: the sender's future (cancel-safe), the test's engine handle, the test's
    // handle on its fault transport.
    sender.abort();
    let _ = tokio::time::timeout(BOUND, sender)
        .await
        .expect("abort hung");
    drop_bounded(
        (f.c.prefill.remove(1), f.prefill.remove(1)),
        "rank 1's handles",
    )
    .await;
    {
        let (m, cv) = &g.go;
        *m.lock().unwrap() = true;
        cv.notify_all();
    }
    eventually(
        Duration::from_secs(20),
        "rank 1's transport dropped",
        || {
            g.log
                .lock()
                .unwrap()
                .iter()
                .any(|l| l.starts_with("drop on"))
        },
    )
    .await;
    let log = g.log.lock().unwrap().clone();
    eprintln!("{log:#?}");
    // Tearing down on the progress thread itself neither hangs nor self-joins (the transport checks
    // for that). The progress thread cannot deregister the pool from inside its own callback, so the
    // engine asks again from a helper thread and frees the pool only once that succeeded: the last
    // deregistration of the pool must have succeeded, off the progress thread.
    eventually(Duration::from_secs(20), "the pool deregistered", || {
        g.log
            .lock()
            .unwrap()
            .iter()
            .rfind(|l| l.starts_with("deregister on"))
            .is_some_and(|l| l.ends_with("Ok(())"))
    })
    .await;
    let log = g.log.lock().unwrap().clone();
    let last = log
        .iter()
        .rfind(|l| l.starts_with("deregister on"))
        .unwrap();
    assert!(last.starts_with("deregister on kvx-dereg"), "{log:#?}");
}
