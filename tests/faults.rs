#![allow(clippy::unwrap_used)]
//! Faults over real loopback UCX in one process (DESIGN.md §7): one decode engine and four prefill PP
//! ranks, each on a [`FaultTransport`] around a real `UcxTransport`, plugged in through
//! `BackendConfig::Custom`.
//!
//! Every scenario runs a faulted request B beside a healthy request A and checks that: B completes
//! only if every chunk of every rank arrived (and then its bytes are right); decode reports exactly one
//! terminal outcome per request; B ends by its deadline plus [`SLACK`]; a failure carries its typed
//! cause; A completes with the right bytes; and afterwards decode tracks nothing, no rank has an
//! undecided request or a chunk in flight, and every transport registers exactly its pool.
//!
//! Every wait is bounded; nothing sleeps and then asserts.

mod common;

use common::small::*;
use futures::FutureExt;
use kvbench::cluster::{Cluster, ClusterSpec, PoolKind};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use transfer_engine::core::notify;
use transfer_engine::core::tracker::FailureReason;
use transfer_engine::core::vote::Decision;
use transfer_engine::core::{FailureCode, RequestId};
use transfer_engine::engine::{BackendConfig, CustomBackend, EngineError, Outcome, PrefillEngine};
use transfer_engine::transport::fault::{
    Corruption, FaultPlan, FaultTransport, Match, NotifyKind, RecvFault, Rule, SendFault,
};
use transfer_engine::transport::ucx::{UcxConfig, UcxTransport};
use transfer_engine::transport::{BackendKind, Sender, Transport, TransportError};

/// The faulted request's deadline where it is expected to time out.
const SHORT: Duration = Duration::from_secs(2);
/// How far past its deadline a request may end: the decode timer, a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(1500);
/// How soon a FAILURE must fail a request whose deadline is [`LONG`].
const PROMPTLY: Duration = Duration::from_millis(1500);

/// A cluster whose every engine runs on a fault transport.
struct Faulty {
    c: Cluster,
    decode: Arc<FaultTransport>,
    prefill: Vec<Arc<FaultTransport>>,
}

/// A `Custom` backend wrapping a UCX transport in a fault transport with no rules yet, and where to
/// find that fault transport once the engine built it.
fn faulty_backend(name: String) -> (BackendConfig, Arc<OnceLock<Arc<FaultTransport>>>) {
    let slot = Arc::new(OnceLock::new());
    let s2 = slot.clone();
    let cfg = UcxConfig {
        name,
        ..UcxConfig::default()
    };
    let backend = CustomBackend::new(BackendKind::Ucx, move |sink| {
        let cfg = cfg.clone();
        let ft = FaultTransport::new(FaultPlan::new(7), sink, move |s| {
            Ok(Arc::new(UcxTransport::new(cfg, s)?) as Arc<dyn Transport>)
        })?;
        s2.set(ft.clone())
            .map_err(|_| TransportError::Injected("backend built twice".into()))?;
        Ok(ft as Arc<dyn Transport>)
    });
    (BackendConfig::Custom(backend), slot)
}

/// What `kvbench::cluster::Cluster::start` does, with fault transports under every engine.
async fn start() -> Faulty {
    tokio::time::timeout(Duration::from_secs(30), try_start())
        .await
        .expect("cluster did not start within 30 s")
        .unwrap()
}

async fn try_start() -> Result<Faulty, EngineError> {
    let spec = ClusterSpec {
        shape: SHAPE,
        pp: PP,
        decode_pages: 16,
        prefill_pages: 8,
        backend: BackendKind::Ucx,
        checksums: true,
        decode_pool: PoolKind::Shared,
        metrics: None,
        decode_progress: Default::default(),
    };
    let (mut dslot, mut slots) = (None, Vec::new());
    let c = Cluster::start_with(spec, |rank, name| {
        let (backend, slot) = faulty_backend(format!("faults-{name}"));
        match rank {
            None => dslot = Some(slot),
            Some(_) => slots.push(slot),
        }
        backend
    })
    .await?;
    let get = |s: &Arc<OnceLock<Arc<FaultTransport>>>| s.get().cloned().unwrap();
    Ok(Faulty {
        decode: get(&dslot.unwrap()),
        prefill: slots.iter().map(get).collect(),
        c,
    })
}

type SendTask = tokio::task::JoinHandle<Result<(), EngineError>>;
type OutcomeFut = Pin<Box<dyn Future<Output = Outcome> + Send>>;

/// Sends `request`'s chunks from `p`, one after the other, stopping at the first error; when
/// `fail_after` names a chunk, sends chunks up to it and then fails the request with that code.
fn spawn_sender(
    p: &PrefillEngine,
    request: RequestId,
    src: &'static [u32],
    fail_after: Option<(u32, FailureCode)>,
) -> SendTask {
    let p = p.clone();
    tokio::spawn(async move {
        for c in 0..CHUNKS {
            p.send_chunk(request, c, src, c + 1 == CHUNKS).await?;
            if let Some((after, code)) = fail_after
                && after == c
            {
                p.fail(request, code);
                return Ok(());
            }
        }
        Ok(())
    })
}

/// A and B in flight: both expected, every rank sending both.
struct Pair {
    a: OutcomeFut,
    b: OutcomeFut,
    t0: Instant,
    b_deadline: Duration,
    a_sends: Vec<SendTask>,
    b_sends: Vec<SendTask>,
}

/// Expects A (deadline [`LONG`]) and B (`b_deadline`) and starts every rank's senders for both; rank
/// `fail.0` fails B with `fail.1` right after its chunk 0.
fn start_pair(f: &Faulty, b_deadline: Duration, fail: Option<(u16, FailureCode)>) -> Pair {
    let d = &f.c.decode;
    f.c.prepare(A, &SRC_A, &DST_A).unwrap();
    f.c.prepare(B, &SRC_B, &DST_B).unwrap();
    let a = d
        .expect(A, PROMPT, CHUNK, DST_A.to_vec(), LONG)
        .unwrap()
        .boxed();
    let t0 = Instant::now();
    let b = d
        .expect(B, PROMPT, CHUNK, DST_B.to_vec(), b_deadline)
        .unwrap()
        .boxed();
    let a_sends =
        f.c.prefill
            .iter()
            .map(|p| spawn_sender(p, A, &SRC_A, None))
            .collect();
    let b_sends =
        f.c.prefill
            .iter()
            .map(|p| {
                let fail_after = fail.filter(|(r, _)| *r == p.pp_rank()).map(|(_, c)| (0, c));
                spawn_sender(p, B, &SRC_B, fail_after)
            })
            .collect();
    Pair {
        a,
        b,
        t0,
        b_deadline,
        a_sends,
        b_sends,
    }
}

impl Pair {
    /// B's outcome and how long after `expect` it came; panics past its deadline plus [`SLACK`].
    async fn b_outcome(&mut self) -> (Outcome, Duration) {
        let bound = self.b_deadline + SLACK;
        let o = tokio::time::timeout(bound.saturating_sub(self.t0.elapsed()), &mut self.b)
            .await
            .unwrap_or_else(|_| panic!("request B outlived its deadline plus {SLACK:?}"));
        (o, self.t0.elapsed())
    }

    /// Every rank's send result for B.
    async fn b_sends(&mut self) -> Vec<Result<(), EngineError>> {
        let mut out = Vec::new();
        for s in self.b_sends.drain(..) {
            out.push(
                tokio::time::timeout(BOUND, s)
                    .await
                    .expect("a sender of B hung")
                    .unwrap(),
            );
        }
        out
    }

    /// A completes with the right bytes and every rank sent all of it.
    async fn a_complete(&mut self, f: &Faulty) {
        let o = tokio::time::timeout(BOUND, &mut self.a)
            .await
            .expect("healthy request A did not end");
        assert_eq!(o, Outcome::Complete, "healthy request A");
        for s in self.a_sends.drain(..) {
            tokio::time::timeout(BOUND, s)
                .await
                .expect("a sender of A hung")
                .unwrap()
                .unwrap();
        }
        let checked = f.c.verify(A, &DST_A).unwrap();
        assert_eq!(checked, SHAPE.request_bytes(PROMPT));
    }
}

/// Waits for every rank's decision on A and B, releases them, and checks nothing is left over.
/// Returns each rank's decision on B.
async fn settle(f: &Faulty) -> Vec<Decision> {
    let mut b = Vec::new();
    for p in &f.c.prefill {
        let da = tokio::time::timeout(BOUND, p.decided(A))
            .await
            .expect("A undecided");
        assert_eq!(da, Decision::Completed, "rank {} on A", p.pp_rank());
        b.push(
            tokio::time::timeout(BOUND, p.decided(B))
                .await
                .expect("B undecided"),
        );
        p.release(A);
        p.release(B);
    }
    f.c.wait_quiescent(Duration::from_secs(5)).await.unwrap();
    b
}

/// Decode reported exactly one outcome per request: `completed` completions and `failed` failures.
fn one_outcome_each(f: &Faulty, completed: u64, failed: u64) {
    let s = f.c.decode.stats();
    let t = f.c.decode.tracker_counters();
    assert_eq!((s.completed, s.failed), (completed, failed), "{s:?}");
    assert_eq!((t.completed, t.failed), (completed, failed), "{t:?}");
    assert_eq!(s.in_flight, 0);
    assert_eq!(s.checksum_mismatch, 0);
}

/// Polls `cond` every few milliseconds for up to [`BOUND`].
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + BOUND;
    while !cond() {
        assert!(Instant::now() < end, "not within {BOUND:?}: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// B times out by its deadline when one receive-side notification of it is dropped.
async fn dropped_times_out(when: Match) {
    let f = start().await;
    f.decode.add_recv(Rule::new(when, RecvFault::Drop));
    let mut p = start_pair(&f, SHORT, None);
    let (o, took) = p.b_outcome().await;
    assert_eq!(o, Outcome::Failed(FailureReason::Timeout));
    assert!(
        took >= SHORT,
        "B failed after {took:?}, before its deadline"
    );
    // Every rank delivered everything it knows of; only decode missed one notification.
    for r in p.b_sends().await {
        r.unwrap();
    }
    p.a_complete(&f).await;
    settle(&f).await;
    one_outcome_each(&f, 1, 1);
    assert_eq!(f.decode.counters().dropped, 1);
    assert_eq!(f.c.decode.tracker_counters().timeouts, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_chunk_notification_times_out() {
    dropped_times_out(Match::request(B).rank(1).chunk(0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_last_notification_times_out() {
    dropped_times_out(Match::request(B).rank(2).last()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicated_notifications_complete_once() {
    let f = start().await;
    f.decode
        .add_recv(Rule::new(Match::request(B), RecvFault::Duplicate));
    let mut p = start_pair(&f, LONG, None);
    let (o, _) = p.b_outcome().await;
    assert_eq!(o, Outcome::Complete);
    for r in p.b_sends().await {
        r.unwrap();
    }
    p.a_complete(&f).await;
    let checked = f.c.verify(B, &DST_B).unwrap();
    assert_eq!(checked, SHAPE.request_bytes(PROMPT));
    let decisions = settle(&f).await;
    assert!(decisions.iter().all(|d| *d == Decision::Completed));
    one_outcome_each(&f, 2, 0);
    let n = u64::from(PP) * u64::from(CHUNKS);
    assert_eq!(f.decode.counters().duplicated, n);
    // The copy of B's final notification may come after B completed (then it is late, not
    // duplicate), or wait behind the final one on decode's chunk worker, which drops it once B's
    // pages are released (`jobs_dropped`: the id may name a new request by then); and it may still
    // be on its way when B's outcome is seen: wait for it, bounded.
    let handled = || {
        let t = f.c.decode.tracker_counters();
        t.duplicates + t.late + f.c.decode.stats().jobs_dropped
    };
    eventually("every copy handled", || handled() == n).await;
    let t = f.c.decode.tracker_counters();
    assert!(t.duplicates >= n - 1, "{t:?}");
    assert_eq!(handled(), n, "{t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reordered_and_delayed_across_ranks_complete() {
    let f = start().await;
    // Rank 2's LAST waits for a release call; every chunk-0 notification of B is held back and
    // delivered after the next one.
    f.decode.add_recv(Rule::new(
        Match::request(B).rank(2).last(),
        RecvFault::Delay { after: None },
    ));
    f.decode.add_recv(Rule::new(
        Match::request(B).kind(NotifyKind::More),
        RecvFault::Reorder,
    ));
    let mut p = start_pair(&f, LONG, None);
    for r in p.b_sends().await {
        r.unwrap();
    }
    p.a_complete(&f).await;
    // Every notification of A and B reached decode's transport; rank 2's LAST is still held.
    let all = 2 * u64::from(PP) * u64::from(CHUNKS);
    eventually("all notifications received", || {
        f.decode.counters().received >= all
    })
    .await;
    assert!(f.decode.held() >= 1);
    assert!(
        (&mut p.b).now_or_never().is_none(),
        "B ended while rank 2's LAST was held"
    );
    assert!(f.decode.release_held() >= 1);
    let (o, _) = p.b_outcome().await;
    assert_eq!(o, Outcome::Complete);
    let checked = f.c.verify(B, &DST_B).unwrap();
    assert_eq!(checked, SHAPE.request_bytes(PROMPT));
    settle(&f).await;
    one_outcome_each(&f, 2, 0);
    let c = f.decode.counters();
    assert_eq!(c.reordered, u64::from(PP));
    assert_eq!(c.delayed, 1);
    assert_eq!(c.released_held, c.reordered + c.delayed);
    assert_eq!(f.decode.held(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_notifications_are_counted_and_harmless() {
    let f = start().await;
    // Flip the magic of rank 3's chunk 0 of B: it no longer decodes, so B cannot complete.
    f.decode.add_recv(Rule::new(
        Match::request(B).rank(3).chunk(0),
        RecvFault::Corrupt(Corruption::Flip(vec![0])),
    ));
    let garbage: [&[u8]; 4] = [&[], &[1, 2, 3], &[0xFF; 48], b"not_a_kv_notification"];
    for g in garbage {
        assert!(notify::decode(g).is_err(), "{g:?} decodes");
    }
    let mut p = start_pair(&f, SHORT, None);
    // Garbage from an unknown sender and from a sender key a rank might hold.
    for (i, g) in garbage.iter().enumerate() {
        f.decode.inject(Sender::Key(i as u64), g);
    }
    let (o, took) = p.b_outcome().await;
    assert_eq!(o, Outcome::Failed(FailureReason::Timeout));
    assert!(took >= SHORT);
    for r in p.b_sends().await {
        r.unwrap();
    }
    p.a_complete(&f).await;
    settle(&f).await;
    one_outcome_each(&f, 1, 1);
    let c = f.decode.counters();
    assert_eq!((c.corrupted, c.injected), (1, garbage.len() as u64));
    assert_eq!(f.c.decode.stats().malformed, 1 + garbage.len() as u64);
    assert_eq!(f.c.decode.stats().refused, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_flag_from_one_rank_fails_at_once() {
    let f = start().await;
    let mut p = start_pair(&f, LONG, Some((1, FailureCode::Internal)));
    let (o, took) = p.b_outcome().await;
    assert_eq!(
        o,
        Outcome::Failed(FailureReason::PeerFailed {
            rank: 1,
            code: FailureCode::Internal
        })
    );
    assert!(took < PROMPTLY, "B failed only after {took:?}");
    for (rank, r) in p.b_sends().await.into_iter().enumerate() {
        // The others may have finished B before the abort reached them, or been refused after.
        if let Err(e) = r {
            assert!(
                matches!(e, EngineError::RequestFailed { request: B, .. }),
                "rank {rank}: {e}"
            );
        }
    }
    p.a_complete(&f).await;
    let decisions = settle(&f).await;
    assert!(
        decisions
            .iter()
            .all(|d| matches!(d, Decision::Failed { .. })),
        "{decisions:?}"
    );
    one_outcome_each(&f, 1, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_post_fails_promptly_with_write_failed() {
    let f = start().await;
    f.prefill[2].add_send(
        Rule::new(
            Match::request(B).rank(2).chunk(1).last(),
            SendFault::FailPost,
        )
        .times(1),
    );
    let mut p = start_pair(&f, LONG, None);
    let (o, took) = p.b_outcome().await;
    assert_eq!(
        o,
        Outcome::Failed(FailureReason::PeerFailed {
            rank: 2,
            code: FailureCode::WriteFailed
        })
    );
    assert!(took < PROMPTLY, "B failed only after {took:?}");
    let sends = p.b_sends().await;
    match &sends[2] {
        Err(EngineError::Write {
            request: B,
            chunk: 1,
            source: TransportError::Injected(_),
        }) => {}
        other => panic!("rank 2's send of B: {other:?}"),
    }
    p.a_complete(&f).await;
    let decisions = settle(&f).await;
    assert!(
        decisions
            .iter()
            .all(|d| matches!(d, Decision::Failed { .. })),
        "{decisions:?}"
    );
    one_outcome_each(&f, 1, 1);
    assert_eq!(f.prefill[2].counters().failed_posts, 1);
    assert_eq!(f.c.prefill[2].stats().failed_chunks, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stuck_transfer_times_out_and_its_late_notification_changes_nothing() {
    let f = start().await;
    f.prefill[3].add_send(Rule::new(Match::request(B).rank(3).last(), SendFault::Stuck).times(1));
    let mut p = start_pair(&f, SHORT, None);
    // B times out, but its pages stay the transfer's while rank 3's writes may still land: decode
    // holds B's outcome until every rank acknowledged the abort, and rank 3 cannot while stuck.
    eventually("B failed and waiting for acknowledgements", || {
        f.c.decode.stats().awaiting_abort_ack == 1
    })
    .await;
    assert!(p.t0.elapsed() >= SHORT);
    assert_eq!(f.c.decode.stats().failed_timeout, 1);
    assert!(
        futures::FutureExt::now_or_never(&mut p.b).is_none(),
        "B resolved while rank 3's writes were still in flight"
    );
    p.a_complete(&f).await;
    // Rank 3's LAST is stuck: its send has not returned and its transport counts it in flight.
    let stuck_sender = p.b_sends.pop().unwrap();
    assert!(!stuck_sender.is_finished());
    assert_eq!(f.prefill[3].stuck(), 1);
    assert_eq!(f.c.prefill[3].transport_stats().in_flight, 1);
    // Rank 3 cannot vote while its write is posted (a vote means "this rank's writes are over"), so
    // no rank has decided B: every rank keeps B's source pages.
    for pr in &f.c.prefill {
        assert!(
            tokio::time::timeout(Duration::from_millis(200), pr.decided(B))
                .await
                .is_err(),
            "B decided on rank {} while rank 3's write was still posted",
            pr.pp_rank()
        );
    }
    assert!(futures::FutureExt::now_or_never(&mut p.b).is_none());
    let late = f.c.decode.tracker_counters().late;
    assert_eq!(f.prefill[3].release_stuck(), 1);
    tokio::time::timeout(BOUND, stuck_sender)
        .await
        .expect("stuck send did not return after release")
        .unwrap()
        .unwrap();
    // Rank 3's writes are over: it votes, and the abort decode sent on the timeout decides B on
    // every rank.
    for pr in &f.c.prefill {
        let d = tokio::time::timeout(BOUND, pr.decided(B))
            .await
            .expect("B undecided after the stuck write ended");
        assert!(matches!(d, Decision::Failed { .. }), "{d:?}");
    }
    // Rank 3 acknowledged too: B's outcome arrives, the one it always had.
    let o = tokio::time::timeout(BOUND, &mut p.b)
        .await
        .expect("B never resolved after release");
    assert_eq!(o, Outcome::Failed(FailureReason::Timeout));
    assert_eq!(f.c.decode.stats().abort_ack_timeouts, 0);
    eventually("late LAST counted", || {
        f.c.decode.tracker_counters().late == late + 1
    })
    .await;
    for r in p.b_sends().await {
        r.unwrap();
    }
    settle(&f).await;
    one_outcome_each(&f, 1, 1);
    assert_eq!(f.prefill[3].counters().released_stuck, 1);
    // The stuck writes went out without a notification (a post with an empty notification sends
    // none), so decode saw nothing malformed.
    assert_eq!(f.c.decode.stats().malformed, 0);
}
