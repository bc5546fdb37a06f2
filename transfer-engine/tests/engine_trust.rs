//! Trust at the boundary, over real loopback UCX: what an unauthenticated peer gets, bindings that
//! cannot be taken twice, layouts that cannot be described, and memory that a peer may still write
//! (shutdown, quarantine, votes). One decode engine and one prefill rank, each on a fault transport
//! around a real `UcxTransport`. Every wait is bounded.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use transfer_engine::control::Secret;
use transfer_engine::control::{FrameDecoder, Msg};
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::{KvLayout, RegionKind};
use transfer_engine::core::tracker::FailureReason;
use transfer_engine::core::vote::Decision;
use transfer_engine::engine::{
    BackendConfig, CustomBackend, DecodeConfig, DecodeEngine, EngineError, Outcome, Pool,
    PrefillConfig, PrefillEngine, probe_decode,
};
use transfer_engine::mem::{HostBuffer, HostOptions};
use transfer_engine::transport::fault::{FaultPlan, FaultTransport, Match, Rule, SendFault};
use transfer_engine::transport::ucx::{UcxConfig, UcxTransport};
use transfer_engine::transport::{BackendKind, Sender, Transport, leaked_pools};

const LAYERS: u32 = 2;
const PAGE_TOKENS: u32 = 16;
const PAGE_BYTES: u64 = 1024;
const PAGES: u32 = 16;
const PROMPT: u32 = 64;
const CHUNK: u32 = 32;
const SRC: [u32; 4] = [0, 1, 2, 3];
const DST: [u32; 4] = [4, 5, 6, 7];
const SECRET: &[u8] = b"trust-test secret, 32 bytes long";
const BOUND: Duration = Duration::from_secs(10);
const LONG: Duration = Duration::from_secs(20);

/// The tests read the process-wide leak counter, so they run one at a time.
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

fn layout() -> KvLayout {
    KvLayout::packed(0, LAYERS, RegionKind::Fused, PAGE_BYTES, PAGES)
}

fn pool() -> Pool {
    let mut b = HostBuffer::new(layout().buffer_len as usize, HostOptions::default()).unwrap();
    for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
        *x = (i % 251) as u8;
    }
    Pool::Owned(b)
}

/// A UCX transport inside a fault transport with no rules; the handle lets the test add some.
fn faulty(name: &str) -> (BackendConfig, Arc<Mutex<Option<Arc<FaultTransport>>>>) {
    let slot: Arc<Mutex<Option<Arc<FaultTransport>>>> = Arc::default();
    let s2 = slot.clone();
    let name = name.to_owned();
    let backend = CustomBackend::new(BackendKind::Ucx, move |sink| {
        let cfg = UcxConfig {
            name: name.clone(),
            ..UcxConfig::default()
        };
        let t = FaultTransport::new(FaultPlan::new(7), sink, |inner| {
            Ok(Arc::new(UcxTransport::new(cfg, inner)?) as Arc<dyn Transport>)
        })?;
        *s2.lock().unwrap() = Some(t.clone());
        Ok(t as Arc<dyn Transport>)
    });
    (BackendConfig::Custom(backend), slot)
}

async fn decode(secret: Option<&[u8]>, pp: u16) -> DecodeEngine {
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout(), pp);
    cfg.token = secret.map(Secret::new);
    cfg.abort_ack_timeout = Duration::from_millis(300);
    DecodeEngine::start(cfg, pool()).await.unwrap()
}

async fn prefill(
    d: &DecodeEngine,
    secret: Option<&[u8]>,
) -> Result<(PrefillEngine, Arc<FaultTransport>), EngineError> {
    let mut cfg = PrefillConfig::new(d.local_addr(), 0, 1, LAYERS, PAGE_TOKENS, layout());
    let (backend, slot) = faulty("trust-prefill");
    cfg.backend = backend;
    cfg.token = secret.map(Secret::new);
    cfg.connect_timeout = Duration::from_secs(3);
    let p = PrefillEngine::start(cfg, pool()).await?;
    let t = slot.lock().unwrap().clone().unwrap();
    Ok((p, t))
}

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("did not finish within the bound")
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// A decode engine and its one prefill rank, connected with the shared secret.
async fn connected() -> (DecodeEngine, PrefillEngine, Arc<FaultTransport>) {
    let d = decode(Some(SECRET), 1).await;
    let (p, t) = prefill(&d, Some(SECRET)).await.unwrap();
    d.wait_for_ranks(BOUND).await.unwrap();
    (d, p, t)
}

/// Runs `request` on DST to completion.
async fn complete(d: &DecodeEngine, p: &PrefillEngine, request: RequestId) {
    let done = d
        .expect(request, PROMPT, CHUNK, DST.to_vec(), LONG)
        .unwrap();
    send_all(p, request).await;
    assert_eq!(bounded(done).await, Outcome::Complete);
}

/// Sends both chunks of `request` from the prefill rank.
async fn send_all(p: &PrefillEngine, request: RequestId) {
    p.send_chunk(request, 0, &SRC, false).await.unwrap();
    p.send_chunk(request, 1, &SRC, true).await.unwrap();
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + BOUND;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Decode expects `r`; the rank sends its chunk 0, whose writes land but whose completion the fault
/// transport holds: the chunk stays posted until `release_stuck`.
async fn expect_with_chunk_0_stuck(
    d: &DecodeEngine,
    p: &PrefillEngine,
    t: &FaultTransport,
    r: RequestId,
) -> (
    std::pin::Pin<Box<dyn std::future::Future<Output = Outcome> + Send>>,
    tokio::task::JoinHandle<Result<(), EngineError>>,
) {
    t.add_send(Rule::new(Match::request(r).chunk(0), SendFault::Stuck));
    let outcome = d.expect(r, PROMPT, CHUNK, DST.to_vec(), LONG).unwrap();
    let p2 = p.clone();
    let sending = tokio::spawn(async move { p2.send_chunk(r, 0, &SRC, false).await });
    wait_until("chunk 0 is stuck", || t.stuck() == 1).await;
    (Box::pin(outcome), sending)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_client_gets_only_a_challenge_and_a_wrong_secret_binds_nothing() {
    let _s = serial().await;
    let d = decode(Some(SECRET), 1).await;
    // A raw TCP client that says nothing.
    let mut raw = TcpStream::connect(d.local_addr()).await.unwrap();
    // Read until decode's first message (bounded), then 300 ms more: nothing may follow it.
    let (mut bytes, mut msgs) = (Vec::new(), Vec::new());
    let mut frames = FrameDecoder::default();
    let mut until = tokio::time::Instant::now() + BOUND;
    let mut buf = [0u8; 4096];
    while let Ok(Ok(n @ 1..)) = tokio::time::timeout_at(until, raw.read(&mut buf)).await {
        bytes.extend_from_slice(&buf[..n]);
        frames.extend(&buf[..n]);
        let first = msgs.is_empty();
        while let Ok(Some(m)) = frames.decode_next() {
            msgs.push(m);
        }
        if first && !msgs.is_empty() {
            until = tokio::time::Instant::now() + Duration::from_millis(300);
        }
    }
    assert!(matches!(msgs.as_slice(), [Msg::Challenge(_)]), "{msgs:?}");
    let (worker, _, region) = d.backend_info().unwrap();
    assert!(!contains(&bytes, SECRET), "the secret left the process");
    assert!(
        !contains(&bytes, &worker[..16]),
        "the worker address went out"
    );
    assert!(
        !contains(&bytes, &region.rkey[..16.min(region.rkey.len())]),
        "the rkey went out"
    );
    drop(raw);

    // A real prefill with a wrong secret, and one with none: refused, counted, nothing bound.
    for secret in [Some(&b"not the secret"[..]), None] {
        let e = prefill(&d, secret)
            .await
            .expect_err("a prefill without the secret started");
        match &e {
            EngineError::Control(c) => assert!(c.is_auth_failure(), "{e:?}"),
            other => panic!("{other:?}"),
        }
    }
    // Decode counts a refusal once its Reject is out, which the prefill may read first.
    wait_until("both refusals counted", || d.stats().auth_failures >= 2).await;
    assert!(d.wait_for_ranks(Duration::from_millis(200)).await.is_err());
    // The right secret gets in and a request completes.
    let (p, _t) = prefill(&d, Some(SECRET)).await.unwrap();
    d.wait_for_ranks(BOUND).await.unwrap();
    complete(&d, &p, RequestId(1)).await;
    // The rank confirms, but `backend_info` handed the pool out of band above, to someone who can
    // never confirm: the pool is leaked, not freed.
    let before = leaked_pools();
    let report = bounded(d.shutdown(BOUND)).await;
    assert_eq!(report.confirmed, vec![(String::new(), 0)], "{report:?}");
    assert!(!report.pool_freed, "{report:?}");
    // The engine's tasks may hold it a moment longer; the pool goes with the last of them.
    wait_until("the pool leaked", || leaked_pools() == before + 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_reads_what_decode_says_only_with_the_secret_and_binds_nothing() {
    let _s = serial().await;
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout(), 1);
    cfg.token = Some(Secret::new(SECRET));
    cfg.app = b"{\"prompt_tokens\": 64}".to_vec();
    let d = DecodeEngine::start(cfg, pool()).await.unwrap();
    // Without the secret: an authentication failure, and nothing of decode's Hello.
    for secret in [Some(Secret::new(b"not the secret")), None] {
        let e = probe_decode(d.local_addr(), secret.as_ref(), BOUND)
            .await
            .expect_err("a probe without the secret read decode's Hello");
        match &e {
            EngineError::Control(c) => assert!(c.is_auth_failure(), "{e:?}"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(d.stats().probes, 0, "{:?}", d.stats());
    // With it: decode's layout and what its application says, and decode counts the probe.
    let hello = probe_decode(d.local_addr(), Some(&Secret::new(SECRET)), BOUND)
        .await
        .unwrap();
    assert_eq!(hello.app, b"{\"prompt_tokens\": 64}");
    assert_eq!(hello.layout.num_layers, LAYERS);
    assert_eq!(hello.layout.page_tokens, PAGE_TOKENS);
    wait_until("the probe counted", || d.stats().probes == 1).await;
    assert_eq!(d.stats().handshake_failures, 0, "{:?}", d.stats());
    // The probe bound nothing: a prefill rank joins after it and a request completes.
    assert!(d.wait_for_ranks(Duration::from_millis(200)).await.is_err());
    let (p, _t) = prefill(&d, Some(SECRET)).await.unwrap();
    d.wait_for_ranks(BOUND).await.unwrap();
    complete(&d, &p, RequestId(1)).await;
    drop(p);
    bounded(d.shutdown(BOUND)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_part_past_its_bound_is_refused_at_start() {
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout(), 1);
    cfg.app = vec![b'x'; transfer_engine::control::MAX_APP_INFO + 1];
    let e = DecodeEngine::start(cfg, pool())
        .await
        .expect_err("an oversized application part started");
    assert!(matches!(e, EngineError::Config(_)), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_is_bound_once() {
    let _s = serial().await;
    let d = decode(None, 2).await;
    // Each of the two PP ranks holds its half of the layers.
    let half = |rank: u32| {
        let n = LAYERS / 2;
        KvLayout::packed(rank * n, n, RegionKind::Fused, PAGE_BYTES, PAGES)
    };
    d.bind_external_rank(0, Sender::Key(5), &half(0)).unwrap();
    match d.bind_external_rank(1, Sender::Key(5), &half(1)) {
        Err(EngineError::SenderTaken { rank: 0, .. }) => {}
        other => panic!("{other:?}"),
    }
    let name = Sender::Agent("agent-a".into());
    d.bind_external_rank(1, name.clone(), &half(1)).unwrap();
    assert!(matches!(
        d.bind_external_rank(1, name, &half(1)),
        Err(EngineError::SenderTaken { rank: 1, .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_layout_that_the_hello_cannot_describe_is_refused() {
    let _s = serial().await;
    let mut l = layout();
    l.base_offset = 4096;
    l.buffer_len += 4096;
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, l.clone(), 1);
    cfg.token = Some(Secret::new(SECRET));
    let buf = HostBuffer::new(l.buffer_len as usize, HostOptions::default()).unwrap();
    match DecodeEngine::start(cfg, Pool::Owned(buf)).await {
        Err(EngineError::Config(m)) => assert!(m.contains("packed"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_is_freed_only_once_every_rank_confirmed_and_leaked_otherwise() {
    let _s = serial().await;
    // A clean shutdown: the rank confirms with its Close, the pool is freed, nothing is leaked.
    let (d, p, _t) = connected().await;
    complete(&d, &p, RequestId(1)).await;
    let before = leaked_pools();
    let report = bounded(d.shutdown(BOUND)).await;
    assert_eq!(report.confirmed, vec![(String::new(), 0)], "{report:?}");
    assert!(
        report.pool_freed && report.unconfirmed.is_empty(),
        "{report:?}"
    );
    drop(p);
    // A leak would come with the last handle, which the engine's tasks may hold a moment longer.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        leaked_pools(),
        before,
        "a confirmed shutdown leaked its pool"
    );

    // A rank whose write is stuck in flight cannot confirm: the pool is leaked, not freed.
    let (d, p, t) = connected().await;
    t.add_send(Rule::new(
        Match::request(RequestId(2)).chunk(0),
        SendFault::Stuck,
    ));
    let _outcome = d
        .expect(RequestId(2), PROMPT, CHUNK, DST.to_vec(), LONG)
        .unwrap();
    let p2 = p.clone();
    let sending = tokio::spawn(async move { p2.send_chunk(RequestId(2), 0, &SRC, false).await });
    wait_until("the chunk is stuck", || t.stuck() == 1).await;
    let before = leaked_pools();
    let report = bounded(d.shutdown(Duration::from_millis(400))).await;
    assert_eq!(report.unconfirmed, vec![(String::new(), 0)], "{report:?}");
    assert!(!report.pool_freed, "{report:?}");
    wait_until("the pool leaked", || leaked_pools() == before + 1).await;
    t.release_stuck();
    let _ = bounded(sending).await;

    // An engine dropped without shutdown, once a peer could know its pool, leaks it.
    let (d, p, _t) = connected().await;
    let before = leaked_pools();
    drop(d);
    wait_until("a dropped engine leaked its pool", || {
        leaked_pools() == before + 1
    })
    .await;
    drop(p);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_whose_ranks_do_not_confirm_are_quarantined_until_they_do() {
    let _s = serial().await;
    let (d, p, t) = connected().await;
    let r = RequestId(3);
    let (outcome, sending) = expect_with_chunk_0_stuck(&d, &p, &t, r).await;
    d.abort(r);
    // The outcome waits for the rank's confirmation, then gives up at abort_ack_timeout (300 ms).
    assert_eq!(
        bounded(outcome).await,
        Outcome::Failed(FailureReason::Aborted)
    );
    assert_eq!(d.stats().abort_ack_timeouts, 1);
    assert_eq!(d.quarantined(), vec![r]);
    assert_eq!(d.stats().quarantined, 1);
    // Its pages are not handed to another request while the write may still land.
    match d.expect(RequestId(4), PROMPT, CHUNK, vec![9, 10, 11, DST[2]], LONG) {
        Err(EngineError::PageHeld { page, by }) => assert_eq!((page, by), (DST[2], r)),
        other => panic!("quarantined page handed out: {:?}", other.map(|_| ())),
    }
    let released = d.released(r);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), d.released(r))
            .await
            .is_err(),
        "released before the rank confirmed"
    );
    // The write ends; the rank's late acknowledgement releases the pages.
    assert_eq!(t.release_stuck(), 1);
    let _ = bounded(sending).await;
    bounded(released).await;
    assert!(d.quarantined().is_empty());
    complete(&d, &p, RequestId(5)).await;
    assert!(bounded(d.shutdown(BOUND)).await.pool_freed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_votes_only_once_none_of_its_chunks_is_posted() {
    let _s = serial().await;
    let (d, p, t) = connected().await;
    let r = RequestId(6);
    let (outcome, first) = expect_with_chunk_0_stuck(&d, &p, &t, r).await;
    // The LAST chunk is over while chunk 0 is still posted: no vote yet.
    bounded(p.send_chunk(r, 1, &SRC, true)).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), p.decided(r))
            .await
            .is_err(),
        "the rank voted while one of its chunks was still posted"
    );
    assert_eq!(t.release_stuck(), 1);
    bounded(first).await.unwrap().unwrap();
    assert_eq!(bounded(p.decided(r)).await, Decision::Completed);
    assert_eq!(bounded(outcome).await, Outcome::Complete);
    assert!(bounded(d.shutdown(BOUND)).await.pool_freed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_votes_completed_only_once_every_chunk_is_over() {
    let _s = serial().await;
    let (d, p, _t) = connected().await;
    let r = RequestId(7);
    let outcome = d.expect(r, PROMPT, CHUNK, DST.to_vec(), LONG).unwrap();
    // The LAST chunk first: the rank's writes are over, but chunk 0 was never sent.
    bounded(p.send_chunk(r, 1, &SRC, true)).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), p.decided(r))
            .await
            .is_err(),
        "the rank voted Completed before sending every chunk"
    );
    bounded(p.send_chunk(r, 0, &SRC, false)).await.unwrap();
    assert_eq!(bounded(p.decided(r)).await, Decision::Completed);
    assert_eq!(bounded(outcome).await, Outcome::Complete);
    assert!(bounded(d.shutdown(BOUND)).await.pool_freed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_ranks_pages_stay_quarantined_until_the_server_confirms() {
    let _s = serial().await;
    let d = decode(Some(SECRET), 1).await;
    d.bind_external_rank(0, Sender::Key(77), &layout()).unwrap();
    let r = RequestId(8);
    let outcome = d.expect(r, PROMPT, CHUNK, DST.to_vec(), LONG).unwrap();
    d.abort(r);
    // Nobody can confirm by itself: the outcome goes out at once, the pages stay held.
    assert_eq!(
        bounded(outcome).await,
        Outcome::Failed(FailureReason::Aborted)
    );
    assert_eq!(d.quarantined(), vec![r]);
    assert!(matches!(
        d.expect(RequestId(9), PROMPT, CHUNK, DST.to_vec(), LONG),
        Err(EngineError::PageHeld { by, .. }) if by == r
    ));
    // Its id stays taken too while its pages are held.
    assert!(matches!(
        d.expect(r, PROMPT, CHUNK, vec![0, 1, 2, 3], LONG),
        Err(EngineError::Tracker(_))
    ));
    let released = d.released(r);
    d.confirm_stopped(0, r);
    bounded(released).await;
    assert!(d.quarantined().is_empty());
    let pending = d
        .expect(RequestId(9), PROMPT, CHUNK, DST.to_vec(), LONG)
        .unwrap();
    // Shutdown: the external rank can never confirm, so the pool is not freed; and nothing binds
    // once shutdown began.
    let late = d.clone();
    let before = leaked_pools();
    let report = bounded(d.shutdown(Duration::from_millis(300))).await;
    assert_eq!(report.unconfirmed, vec![(String::new(), 0)], "{report:?}");
    assert!(!report.pool_freed);
    assert!(matches!(
        late.bind_external_rank(0, Sender::Key(78), &layout()),
        Err(EngineError::Shutdown)
    ));
    // Nothing here handed the pool out, but the external rank writes into it by what its server
    // learned: with the last handle the pool is leaked, not freed.
    drop((late, pending));
    wait_until("the pool leaked", || leaked_pools() == before + 1).await;
}

/// A configuration printed with `{:?}` (into a log, a panic message) never shows its secret, in any
/// rendering of its bytes.
#[test]
fn configs_never_print_their_secret() {
    let addr = "127.0.0.1:1".parse().unwrap();
    let mut p = PrefillConfig::new(addr, 0, 1, LAYERS, PAGE_TOKENS, layout());
    p.token = Some(Secret::new(SECRET));
    let mut d = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout(), 1);
    d.token = Some(Secret::new(SECRET));
    let text = String::from_utf8_lossy(SECRET).into_owned();
    let bytes = format!("{SECRET:?}");
    let numbers = bytes.trim_matches(['[', ']']).to_string();
    for printed in [
        format!("{p:?}"),
        format!("{d:?}"),
        format!("{p:#?}"),
        format!("{d:#?}"),
    ] {
        assert!(printed.contains("<redacted>"), "{printed}");
        for secret in [&text, &bytes, &numbers] {
            assert!(!printed.contains(secret.as_str()), "{printed}");
        }
    }
}
