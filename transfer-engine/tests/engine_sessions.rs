//! One decode engine serving several prefill instances over real loopback UCX: one registration of
//! the pool, each instance's requests completed by its own ranks only, one instance's loss or
//! removal failing only its own requests, and a rank that speaks about another instance's request
//! counted and ignored; requests offered to the prefill ranks before decode asks, posted by the
//! ranks themselves. Every byte is checked on poisoned destination pages; every wait is bounded.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use transfer_engine::control::{
    self, BackendInfo, BackendKind as WireKind, Connection, Hello, LayoutInfo, Msg, RejectReason,
    Role, Secret, TpMode,
};
use transfer_engine::core::planner::{KvLayout, RegionKind};
use transfer_engine::core::tracker::FailureReason;
use transfer_engine::core::vote::Decision;
use transfer_engine::core::{FailureCode, RequestId};
use transfer_engine::engine::{
    DecodeConfig, DecodeEngine, EngineError, Expected, MeshSocket, Outcome, Pool, PrefillConfig,
    PrefillEngine,
};
use transfer_engine::mem::{HostBuffer, HostOptions};

const LAYERS: u32 = 4;
const PAGE_TOKENS: u32 = 16;
const PAGE_BYTES: u64 = 512;
const DECODE_PAGES: u32 = 64;
const PREFILL_PAGES: u32 = 16;
const PROMPT: u32 = 64;
const CHUNK: u32 = 32;
const POISON: u8 = 0xA5;
const SECRET: &[u8] = b"sessions-test secret, 32 bytes..";
const BOUND: Duration = Duration::from_secs(10);
const LONG: Duration = Duration::from_secs(20);

fn decode_layout() -> KvLayout {
    KvLayout::packed(0, LAYERS, RegionKind::Fused, PAGE_BYTES, DECODE_PAGES)
}

/// The byte at `at` of page `page` of layer `layer` in instance `tag`'s pools: no two
/// (instance, layer, page) share a page's bytes.
fn pattern(tag: u8, layer: u32, page: u32, at: u64) -> u8 {
    let x = u64::from(tag) * 1_000_003 + u64::from(layer) * 7919 + u64::from(page) * 104_729 + at;
    (x ^ (x >> 7)).wrapping_mul(31) as u8
}

async fn decode() -> DecodeEngine {
    // No default instance: every instance is added by name.
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, decode_layout(), 0);
    cfg.token = Some(Secret::new(SECRET));
    cfg.abort_ack_timeout = Duration::from_millis(500);
    let len = decode_layout().buffer_len as usize;
    let mut b = HostBuffer::new(len, HostOptions::default()).unwrap();
    b.as_mut_slice().fill(POISON);
    DecodeEngine::start(cfg, Pool::Owned(b)).await.unwrap()
}

/// The PP ranks of prefill instance `name` (pattern `tag`), connected to `d`.
async fn instance(d: &DecodeEngine, name: &str, tag: u8, pp: u16) -> Vec<PrefillEngine> {
    instance_meshed(d, name, tag, pp, common::mesh_sockets(pp)).await
}

/// [`instance`] whose vote mesh listens on `sockets` (one per rank), at `peers`.
async fn instance_meshed(
    d: &DecodeEngine,
    name: &str,
    tag: u8,
    pp: u16,
    mesh: (Vec<Arc<MeshSocket>>, Vec<SocketAddr>),
) -> Vec<PrefillEngine> {
    instance_configured(d, name, tag, pp, mesh, |_| {}).await
}

/// [`instance_meshed`] with each rank's configuration changed by `tweak` before it starts.
async fn instance_configured(
    d: &DecodeEngine,
    name: &str,
    tag: u8,
    pp: u16,
    (sockets, peers): (Vec<Arc<MeshSocket>>, Vec<SocketAddr>),
    tweak: impl Fn(&mut PrefillConfig),
) -> Vec<PrefillEngine> {
    let mut starts = Vec::new();
    for rank in 0..pp {
        let (layout, buf) =
            common::patterned_rank(LAYERS, pp, rank, PAGE_BYTES, PREFILL_PAGES, |l, p, at| {
                pattern(tag, l, p, at)
            });
        let mut cfg = PrefillConfig::new(
            d.local_addr(),
            rank,
            pp,
            LAYERS,
            PAGE_TOKENS,
            layout.clone(),
        );
        cfg.instance = name.to_owned();
        cfg.engine_id = format!("{name}-{rank}");
        cfg.backend = transfer_engine::engine::BackendConfig::default_for(
            transfer_engine::transport::BackendKind::Ucx,
            &format!("{name}-{rank}"),
        );
        cfg.peers = peers.clone();
        cfg.mesh_socket = sockets.get(usize::from(rank)).cloned();
        cfg.token = Some(Secret::new(SECRET));
        cfg.connect_timeout = Duration::from_secs(5);
        tweak(&mut cfg);
        starts.push(tokio::spawn(PrefillEngine::start(cfg, Pool::Owned(buf))));
    }
    let mut ranks = Vec::new();
    for s in starts {
        ranks.push(s.await.unwrap().unwrap());
    }
    d.wait_for_instance(name, BOUND).await.unwrap();
    ranks
}

fn want(instance: &str, dst: &[u32]) -> Expected {
    Expected {
        instance: instance.into(),
        prefix_tokens: 0,
        prompt_tokens: PROMPT,
        chunk_tokens: CHUNK,
        dst_pages: dst.to_vec(),
        timeout: LONG,
    }
}

async fn send_all(ranks: &[PrefillEngine], request: RequestId, src: &[u32]) {
    for r in ranks {
        let r = r.clone();
        let src = src.to_vec();
        let last = PROMPT.div_ceil(CHUNK) - 1;
        for chunk in 0..=last {
            r.send_chunk(request, chunk, &src, chunk == last)
                .await
                .unwrap();
        }
    }
}

/// Every layer's `dst` pages hold instance `tag`'s `src` pages.
fn assert_landed(d: &DecodeEngine, tag: u8, src: &[u32], dst: &[u32]) {
    let mut page = vec![0u8; PAGE_BYTES as usize];
    for layer in 0..LAYERS {
        for (&s, &t) in src.iter().zip(dst) {
            let off = (u64::from(layer) * u64::from(DECODE_PAGES) + u64::from(t)) * PAGE_BYTES;
            d.read_pool(off, &mut page).unwrap();
            let expected: Vec<u8> = (0..PAGE_BYTES)
                .map(|at| pattern(tag, layer, s, at))
                .collect();
            assert!(
                page == expected,
                "layer {layer} page {t} does not hold instance {tag}'s page {s}"
            );
        }
    }
}

/// Every layer's `dst` pages still hold the poison.
fn assert_poisoned(d: &DecodeEngine, dst: &[u32]) {
    common::assert_poisoned(d, (LAYERS, DECODE_PAGES, PAGE_BYTES), POISON, dst);
}

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("did not finish within the bound")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_decode_engine_serves_several_prefill_instances_with_one_registration() {
    let d = decode().await;
    d.add_instance("a", 2, 1).unwrap();
    d.add_instance("b", 1, 1).unwrap();
    // Adding again with the same PP size is a no-op; another PP size is refused.
    d.add_instance("a", 2, 1).unwrap();
    assert!(matches!(
        d.add_instance("a", 3, 1),
        Err(EngineError::Config(_))
    ));
    let a = instance(&d, "a", 1, 2).await;
    let b = instance(&d, "b", 2, 1).await;
    let s = d.stats();
    assert_eq!(
        (s.instances, s.connected_ranks, s.registered_bytes),
        (2, 3, decode_layout().buffer_len),
        "one registration of the pool for every instance: {s:?}"
    );
    assert_eq!(d.instances(), vec![("a".into(), 2), ("b".into(), 1)]);

    // Both instances' requests in flight at once, into pages of their own.
    let (ra, rb) = (RequestId(10), RequestId(20));
    let (src_a, dst_a) = ([0, 1, 2, 3], [4, 5, 6, 7]);
    let (src_b, dst_b) = ([8, 9, 10, 11], [20, 21, 22, 23]);
    let done_a = d.expect_request(ra, want("a", &dst_a)).unwrap();
    let done_b = d.expect_request(rb, want("b", &dst_b)).unwrap();
    tokio::join!(send_all(&a, ra, &src_a), send_all(&b, rb, &src_b));
    assert_eq!(bounded(done_a).await, Outcome::Complete);
    assert_eq!(bounded(done_b).await, Outcome::Complete);
    assert_landed(&d, 1, &src_a, &dst_a);
    assert_landed(&d, 2, &src_b, &dst_b);

    // A request of an instance the engine does not serve is refused, not left waiting.
    assert!(matches!(
        d.expect_request(RequestId(30), want("nobody", &[30, 31, 32, 33])),
        Err(EngineError::Config(_))
    ));
    let report = d.shutdown(BOUND).await;
    assert!(report.pool_freed, "{report:?}");
    let mut confirmed = report.confirmed.clone();
    confirmed.sort();
    assert_eq!(
        confirmed,
        vec![("a".into(), 0), ("a".into(), 1), ("b".into(), 0)],
        "{report:?}"
    );
}

/// A rank's vote mesh listener counts the handshakes it refuses: one without the secret, and one
/// that proves it but is no higher PP rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vote_mesh_counts_the_handshakes_it_refuses() {
    use transfer_engine::control::channel::MESH_LABEL;
    let d = decode().await;
    d.add_instance("a", 2, 1).unwrap();
    let (sockets, peers) = common::mesh_sockets(2);
    let a = instance_meshed(&d, "a", 1, 2, (sockets, peers.clone())).await;
    let dial = |secret: Secret, rank: u16| {
        let (addr, hello) = (peers[0], raw_hello("a").with_pp(rank, 2));
        async move {
            let deadline = tokio::time::Instant::now() + BOUND;
            let mut c = Connection::connect(addr, deadline).await.unwrap();
            c.set_label(MESH_LABEL);
            transfer_engine::control::handshake(&mut c, &hello, &secret, deadline).await
        }
    };
    assert!(
        dial(Secret::new(b"not the deployment's secret....."), 1)
            .await
            .is_err()
    );
    // Rank 0 takes only higher ranks.
    assert!(dial(Secret::new(SECRET), 0).await.is_err());
    let until = tokio::time::Instant::now() + BOUND;
    while (a[0].stats().auth_failures, a[0].stats().handshake_failures) != (1, 1) {
        assert!(tokio::time::Instant::now() < until, "{:?}", a[0].stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The mesh is untouched: a request goes through.
    let r = RequestId(16);
    let done = d.expect_request(r, want("a", &[4, 5, 6, 7])).unwrap();
    send_all(&a, r, &[0, 1, 2, 3]).await;
    assert_eq!(bounded(done).await, Outcome::Complete);
    d.shutdown(BOUND).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instances_loss_fails_only_its_own_requests() {
    let d = decode().await;
    d.add_instance("a", 2, 1).unwrap();
    d.add_instance("b", 1, 1).unwrap();
    let a = instance(&d, "a", 1, 2).await;
    let b = instance(&d, "b", 2, 1).await;
    let (ra, rb) = (RequestId(11), RequestId(21));
    let (dst_a, dst_b) = ([4, 5, 6, 7], [20, 21, 22, 23]);
    let done_a = d.expect_request(ra, want("a", &dst_a)).unwrap();
    let done_b = d.expect_request(rb, want("b", &dst_b)).unwrap();
    // Instance a's ranks go away (their process ends) before sending anything.
    drop(a);
    let lost = bounded(done_a).await;
    assert!(
        matches!(lost, Outcome::Failed(FailureReason::PeerLost { .. })),
        "{lost:?}"
    );
    // b's request is untouched and completes afterwards.
    send_all(&b, rb, &[8, 9, 10, 11]).await;
    assert_eq!(bounded(done_b).await, Outcome::Complete);
    assert_landed(&d, 2, &[8, 9, 10, 11], &dst_b);
    assert_poisoned(&d, &dst_a);
    let s = d.stats();
    assert_eq!(
        (s.failed, s.failed_peer_lost, s.completed),
        (1, 1, 1),
        "{s:?}"
    );
    // Their connections ended without a Close: for all decode knows, the ranks are alive and
    // write until they notice, so the failed request's pages stay held meanwhile.
    assert_eq!(s.unclean_ends, 2, "{s:?}");
    assert!(matches!(
        d.expect_request(RequestId(15), want("a", &dst_a)),
        Err(EngineError::PageHeld { .. })
    ));
    // Instance a's new start joins its session again and is served.
    let a = instance(&d, "a", 3, 2).await;
    let (ra2, dst_a2) = (RequestId(12), [40, 41, 42, 43]);
    let done = d.expect_request(ra2, want("a", &dst_a2)).unwrap();
    send_all(&a, ra2, &[0, 1, 2, 3]).await;
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert_landed(&d, 3, &[0, 1, 2, 3], &dst_a2);
    // Shutdown waits within its bound for the held pages (15.5 s after the loss with the
    // default heartbeat), so this one leaks the pool.
    let report = d.shutdown(Duration::from_millis(500)).await;
    assert!(!report.pool_freed, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_instance_fails_its_requests_and_is_forgotten() {
    let d = decode().await;
    d.add_instance("a", 1, 1).unwrap();
    d.add_instance("b", 1, 1).unwrap();
    let a = instance(&d, "a", 1, 1).await;
    let b = instance(&d, "b", 2, 1).await;
    let (ra, rb) = (RequestId(13), RequestId(23));
    let done_a = d.expect_request(ra, want("a", &[4, 5, 6, 7])).unwrap();
    let done_b = d.expect_request(rb, want("b", &[20, 21, 22, 23])).unwrap();
    assert!(d.remove_instance("a"));
    assert_eq!(
        bounded(done_a).await,
        Outcome::Failed(FailureReason::Aborted)
    );
    // Its rank confirmed the abort and answered Close: nothing of the instance is left.
    let deadline = tokio::time::Instant::now() + BOUND;
    while d.stats().connected_ranks != 1 {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", d.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(d.instances(), vec![("b".into(), 1)]);
    assert!(matches!(
        d.expect_request(RequestId(14), want("a", &[8, 9, 10, 11])),
        Err(EngineError::Config(_))
    ));
    // The removed instance's pages are free again; b never noticed.
    send_all(&b, rb, &[8, 9, 10, 11]).await;
    assert_eq!(bounded(done_b).await, Outcome::Complete);
    let again = d
        .expect_request(RequestId(24), want("b", &[4, 5, 6, 7]))
        .unwrap();
    send_all(&b, RequestId(24), &[0, 1, 2, 3]).await;
    assert_eq!(bounded(again).await, Outcome::Complete);
    assert_landed(&d, 2, &[0, 1, 2, 3], &[4, 5, 6, 7]);
    drop(a);
    d.shutdown(BOUND).await;
}

/// The ranks' decision on `request`, waited for within the bound.
async fn decided(rank: &PrefillEngine, request: RequestId) -> Decision {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        if let Some(d) = rank.decision(request) {
            return d;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "rank {} never decided {request:?}",
            rank.pp_rank()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A request this rank never got that a PP peer voted on (its caller failed an id nobody held) is
/// decided here too once the vote deadline passed: the board does not keep the peer's vote for
/// good, where a later request of the same id would find it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_only_a_peer_voted_on_is_decided_here_at_the_vote_deadline() {
    let d = decode().await;
    d.add_instance("lone", 2, 1).unwrap();
    let ranks = instance_configured(&d, "lone", 6, 2, common::mesh_sockets(2), |c| {
        c.vote.vote_timeout = Some(Duration::from_millis(300));
    })
    .await;
    let r = RequestId(4242);
    ranks[1].fail(r, FailureCode::Aborted);
    assert!(matches!(
        decided(&ranks[1], r).await,
        Decision::Failed { .. }
    ));
    assert!(matches!(
        decided(&ranks[0], r).await,
        Decision::Failed { .. }
    ));
    for rank in &ranks {
        assert_eq!(rank.stats().undecided, 0, "{:?}", rank.stats());
    }
    d.shutdown(BOUND).await;
}

/// PP ranks configured with different heartbeat intervals (rank 0 sends none, rank 1 every
/// 500 ms): each reads the other with the bound the other announced, so after an idle 3.2 s (more
/// than twice three of rank 1's intervals) the mesh is whole and a request lands through both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pp_ranks_with_different_heartbeat_intervals_keep_their_mesh() {
    let d = decode().await;
    d.add_instance("beats", 2, 1).unwrap();
    let ranks = instance_configured(&d, "beats", 8, 2, common::mesh_sockets(2), |c| {
        c.heartbeat = (c.pp_rank == 1).then_some(Duration::from_millis(500));
    })
    .await;
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let (r, src, dst) = (RequestId(808), [1, 2, 3, 4], [9, 10, 11, 12]);
    let done = d.expect_request(r, want("beats", &dst)).unwrap();
    bounded(send_all(&ranks, r, &src)).await;
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert_landed(&d, 8, &src, &dst);
    for rank in &ranks {
        let s = rank.stats();
        assert_eq!((s.peer_losses, s.handshake_failures), (0, 0), "{s:?}");
    }
    d.shutdown(BOUND).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_given_up_before_it_was_expected_is_decided_failed_by_its_instances_ranks() {
    let d = decode().await;
    d.add_instance("a", 2, 1).unwrap();
    d.add_instance("b", 1, 1).unwrap();
    let a = instance(&d, "a", 1, 2).await;
    let b = instance(&d, "b", 2, 1).await;
    // Decode gives up request 31 of instance a before it asked for it: both of a's ranks (one
    // of which a server could be waiting on for its allocation) decide it failed at once.
    let given_up = RequestId(31);
    d.abandon(given_up, "a").unwrap();
    for rank in &a {
        let decision = decided(rank, given_up).await;
        assert!(matches!(decision, Decision::Failed { .. }), "{decision:?}");
    }
    // Instance b heard nothing of it; an instance the engine does not serve is an error.
    assert_eq!(b[0].decision(given_up), None);
    assert!(matches!(
        d.abandon(RequestId(32), "c"),
        Err(EngineError::Config(_))
    ));
    // The ranks' confirmations are taken as instance a's, not counted as strays.
    let deadline = tokio::time::Instant::now() + BOUND;
    while a.iter().any(|r| r.stats().unknown_aborts > 0) {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let s = d.stats();
    assert_eq!((s.refused, s.abandoned, s.failed), (0, 1, 0), "{s:?}");
    // A request that was expected is aborted instead.
    let dst = [4, 5, 6, 7];
    let done = d.expect_request(RequestId(33), want("a", &dst)).unwrap();
    d.abandon(RequestId(33), "a").unwrap();
    assert_eq!(bounded(done).await, Outcome::Failed(FailureReason::Aborted));
    // Both instances are served as before.
    bounded(d.released(RequestId(33))).await;
    let (ra, rb) = (RequestId(34), RequestId(35));
    let done_a = d.expect_request(ra, want("a", &dst)).unwrap();
    let done_b = d.expect_request(rb, want("b", &[20, 21, 22, 23])).unwrap();
    // Instance a cannot give up instance b's request.
    assert!(matches!(d.abandon(rb, "a"), Err(EngineError::Config(_))));
    send_all(&a, ra, &[0, 1, 2, 3]).await;
    send_all(&b, rb, &[8, 9, 10, 11]).await;
    assert_eq!(bounded(done_a).await, Outcome::Complete);
    assert_eq!(bounded(done_b).await, Outcome::Complete);
    assert_landed(&d, 1, &[0, 1, 2, 3], &dst);
    assert_landed(&d, 2, &[8, 9, 10, 11], &[20, 21, 22, 23]);
    d.shutdown(BOUND).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_of_an_unknown_instance_is_refused_at_the_handshake() {
    let d = decode().await;
    d.add_instance("a", 1, 1).unwrap();
    let mut cfg = PrefillConfig::new(
        d.local_addr(),
        0,
        1,
        LAYERS,
        PAGE_TOKENS,
        KvLayout::packed(0, LAYERS, RegionKind::Fused, PAGE_BYTES, PREFILL_PAGES),
    );
    cfg.instance = "stranger".into();
    cfg.token = Some(Secret::new(SECRET));
    cfg.connect_timeout = Duration::from_secs(3);
    let pool = Pool::Owned(
        HostBuffer::new(cfg.layout.buffer_len as usize, HostOptions::default()).unwrap(),
    );
    let err = PrefillEngine::start(cfg, pool).await.unwrap_err();
    assert!(
        matches!(
            &err,
            EngineError::Control(control::ControlError::PeerRejected {
                reason: RejectReason::UnknownInstance(_),
                ..
            })
        ),
        "{err}"
    );
    // Refused at every attempt until the rank's connect deadline.
    assert!(d.stats().handshake_failures >= 1, "{:?}", d.stats());
    d.shutdown(BOUND).await;
}

/// A raw, authenticated prefill rank of instance `instance` (no transport behind it).
async fn raw_rank(d: &DecodeEngine, instance: &str) -> Connection {
    raw_rank_saying(d, &raw_hello(instance)).await
}

/// A raw, authenticated prefill rank that says `hello`.
async fn raw_rank_saying(d: &DecodeEngine, hello: &Hello) -> Connection {
    let deadline = tokio::time::Instant::now() + BOUND;
    let mut conn = Connection::connect(d.local_addr(), deadline).await.unwrap();
    let secret = Secret::new(SECRET);
    control::handshake(&mut conn, hello, &secret, deadline)
        .await
        .unwrap();
    conn
}

/// A rank that keeps sending (its heartbeats) but reads nothing, while decode has more for it than
/// the socket's buffers hold (an allocation naming three million pages, a 12 MiB message): decode
/// cuts the rank (the message not taken within three of the rank's announced intervals; the test
/// waits up to its bound), counts it, fails the request and keeps its pages quarantined (the rank
/// may still be writing), as for a silent rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_reads_nothing_is_cut_and_its_pages_stay_held() {
    const PAGES: u32 = 3 << 20;
    // A byte per token and layer: 192 MiB of pool for the pages.
    let layout = KvLayout::packed(0, LAYERS, RegionKind::Fused, u64::from(PAGE_TOKENS), PAGES);
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout.clone(), 0);
    cfg.token = Some(Secret::new(SECRET));
    cfg.abort_ack_timeout = Duration::from_millis(500);
    let b = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
    let d = DecodeEngine::start(cfg, Pool::Owned(b)).await.unwrap();
    d.add_instance("deaf", 1, 1).unwrap();
    let mut hello = raw_hello("deaf").with_heartbeat(Some(Duration::from_millis(500)));
    hello.layout.bytes_per_token_per_layer = 1;
    hello.layout.pages = PAGES;
    let mut rank = raw_rank_saying(&d, &hello).await;
    rank.send(&Msg::Ready).await.unwrap();
    bounded(d.wait_for_instance("deaf", BOUND)).await.unwrap();
    let r = RequestId(77);
    let done = d
        .expect_request(
            r,
            Expected {
                instance: "deaf".into(),
                prefix_tokens: 0,
                prompt_tokens: PAGES * PAGE_TOKENS,
                chunk_tokens: 1 << 22,
                dst_pages: (0..PAGES).collect(),
                timeout: LONG,
            },
        )
        .unwrap();
    let until = tokio::time::Instant::now() + BOUND;
    while d.stats().stalled == 0 {
        assert!(tokio::time::Instant::now() < until, "{:?}", d.stats());
        // Never silent.
        let _ = rank.send(&Msg::Heartbeat).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(matches!(bounded(done).await, Outcome::Failed(_)));
    assert_eq!(d.quarantined(), vec![r], "{:?}", d.stats());
    assert_eq!(d.stats().silent, 0, "{:?}", d.stats());
    drop(rank);
    d.shutdown(BOUND).await;
}

/// The Hello of a raw prefill rank of instance `instance`, PP rank 0 of 1.
fn raw_hello(instance: &str) -> Hello {
    let layout = LayoutInfo {
        num_layers: LAYERS,
        first_layer: 0,
        layers: LAYERS,
        kv_regions: 1,
        page_tokens: PAGE_TOKENS,
        bytes_per_token_per_layer: PAGE_BYTES / u64::from(PAGE_TOKENS),
        pages: PREFILL_PAGES,
        kv_heads: 0,
        tp_mode: TpMode::Identical,
        model_kv_heads: 0,
        token_major: false,
        key_column_bytes: 0,
    };
    let mut hello = Hello::new(
        "raw",
        Role::Prefill,
        layout,
        BackendInfo {
            kind: WireKind::Ucx,
            worker_or_agent: Vec::new(),
            agent_name: String::new(),
            regions: Vec::new(),
            landing: None,
        },
    )
    .with_instance(instance)
    .with_incarnation(1);
    hello.notify_key = 0x5e55_1005;
    hello
}

/// A rank that sends kinds of message no rank sends once connected (a Hello again, an allocation,
/// a Vote, a Landed): each is counted and dropped, and the rank stays connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_a_kind_no_rank_sends_are_counted_and_dropped() {
    let d = decode().await;
    d.add_instance("m", 1, 1).unwrap();
    let mut m = raw_rank(&d, "m").await;
    m.send(&Msg::Ready).await.unwrap();
    d.wait_for_instance("m", BOUND).await.unwrap();
    let unexpected = [
        Msg::Hello(raw_hello("m")),
        Msg::TransferRequest(control::TransferRequest {
            request: 9,
            prompt_tokens: PROMPT,
            chunk_tokens: CHUNK,
            dst_pages: vec![0, 1, 2, 3],
            prefix_tokens: 0,
            deadline_ms: 1000,
            landing: None,
        }),
        Msg::Vote(control::Vote { bytes: vec![0; 8] }),
        Msg::Landed(control::Landed {
            request: 9,
            chunk: 0,
        }),
    ];
    let n = unexpected.len() as u64;
    for msg in unexpected {
        m.send(&msg).await.unwrap();
    }
    let until = tokio::time::Instant::now() + BOUND;
    while d.stats().refused != n {
        assert!(tokio::time::Instant::now() < until, "{:?}", d.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(d.stats().connected_ranks, 1, "{:?}", d.stats());
    d.wait_for_instance("m", BOUND).await.unwrap();
    drop(m);
    d.shutdown(BOUND).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_cannot_fail_confirm_or_feed_another_instances_request() {
    let d = decode().await;
    d.add_instance("a", 1, 1).unwrap();
    d.add_instance("m", 1, 1).unwrap();
    let a = instance(&d, "a", 1, 1).await;
    let mut m = raw_rank(&d, "m").await;
    m.send(&Msg::Ready).await.unwrap();
    d.wait_for_instance("m", BOUND).await.unwrap();
    let ra = RequestId(15);
    let done = d.expect_request(ra, want("a", &[4, 5, 6, 7])).unwrap();
    // m's rank learns nothing of a's request, but guesses its id: its abort, its confirmation
    // and its payload for it are dropped and counted.
    let before = d.stats().refused;
    for msg in [
        Msg::Abort(control::Abort {
            request: ra.0,
            reason: FailureCode::Aborted.raw(),
        }),
        Msg::TransferReject(control::TransferReject {
            request: ra.0,
            reason: control::TransferRejectReason::Invalid("forged".into()),
        }),
        Msg::AbortAck(control::AbortAck { request: ra.0 }),
        Msg::Aux(control::AuxData {
            request: ra.0,
            data: b"forged".to_vec(),
        }),
    ] {
        m.send(&msg).await.unwrap();
    }
    let deadline = tokio::time::Instant::now() + BOUND;
    while d.stats().refused < before + 4 {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", d.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    send_all(&a, ra, &[0, 1, 2, 3]).await;
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert_landed(&d, 1, &[0, 1, 2, 3], &[4, 5, 6, 7]);
    assert_eq!(
        d.aux(ra, 0),
        None,
        "m's payload must not count for a's request"
    );
    d.shutdown(BOUND).await;
}

/// Whether any rank hands out an allocation through `next_request` within a moment (for a check
/// that none does; [`each_hands_out`] waits for one that is due).
async fn handed_out(ranks: &[PrefillEngine]) -> Vec<RequestId> {
    let mut out = Vec::new();
    for r in ranks {
        if let Ok(Some(inc)) =
            tokio::time::timeout(Duration::from_millis(300), r.next_request()).await
        {
            out.push(inc.request);
        }
    }
    out
}

/// The allocation each rank hands out through `next_request` next (each waited for, bounded).
async fn each_hands_out(ranks: &[PrefillEngine]) -> Vec<RequestId> {
    let mut out = Vec::new();
    for r in ranks {
        out.push(bounded(r.next_request()).await.unwrap().request);
    }
    out
}

/// Decode asks instance a's ranks for `request` into `dst`: each rank hands the allocation out
/// (nothing of theirs posts it), and failing it there fails it at decode with `dst` untouched.
async fn asked_handed_out_and_failed(
    d: &DecodeEngine,
    a: &[PrefillEngine],
    request: RequestId,
    dst: &[u32],
) {
    let done = d.expect_request(request, want("a", dst)).unwrap();
    assert_eq!(each_hands_out(a).await, vec![request; a.len()]);
    assert_poisoned(d, dst);
    for r in a {
        r.fail(request, FailureCode::Aborted);
    }
    assert!(matches!(bounded(done).await, Outcome::Failed(_)));
    assert_poisoned(d, dst);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offered_requests_are_posted_by_the_ranks_themselves() {
    let d = decode().await;
    d.add_instance("a", 2, 1).unwrap();
    let a = instance(&d, "a", 4, 2).await;
    let src = [0u32, 1, 2, 3];

    // Offered before decode asks: every rank posts it on its own, nothing is handed out.
    let r1 = RequestId(40);
    for r in &a {
        r.offer(r1, src.to_vec()).unwrap();
        assert!(
            matches!(r.offer(r1, src.to_vec()), Err(EngineError::Config(_))),
            "a second offer of one request is refused"
        );
    }
    let dst1 = [4, 5, 6, 7];
    let done = d.expect_request(r1, want("a", &dst1)).unwrap();
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert_landed(&d, 4, &src, &dst1);
    for r in &a {
        assert_eq!(
            bounded(r.decided(r1)).await,
            transfer_engine::core::vote::Decision::Completed
        );
        assert!(!r.withdraw(r1), "nothing to withdraw once posted");
    }
    assert!(handed_out(&a).await.is_empty());

    // Decode holds the first page (its prefix): the ranks send the offered pages after it.
    let r2 = RequestId(41);
    for r in &a {
        r.offer(r2, src.to_vec()).unwrap();
    }
    let dst2 = [8, 9, 10];
    let mut asked = want("a", &dst2);
    asked.prefix_tokens = PAGE_TOKENS;
    asked.prompt_tokens = PROMPT - PAGE_TOKENS;
    let done = d.expect_request(r2, asked).unwrap();
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert_landed(&d, 4, &src[1..], &dst2);

    // Offered once the allocation came: posted at once; the allocation, handed out before the
    // offer, is not posted a second time by anyone.
    let r3 = RequestId(42);
    let dst3 = [12, 13, 14, 15];
    let done = d.expect_request(r3, want("a", &dst3)).unwrap();
    assert_eq!(each_hands_out(&a).await, vec![r3, r3]);
    for r in &a {
        r.offer(r3, src.to_vec()).unwrap();
    }
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert_landed(&d, 4, &src, &dst3);

    // Withdrawn before decode asks: the allocation is handed out and nothing is posted.
    let r4 = RequestId(43);
    for r in &a {
        r.offer(r4, src.to_vec()).unwrap();
        assert!(r.withdraw(r4));
        assert!(!r.withdraw(r4));
    }
    asked_handed_out_and_failed(&d, &a, r4, &[16, 17, 18, 19]).await;

    // Fewer pages offered than decode asks for: failed on both sides, nothing written.
    let r5 = RequestId(44);
    for r in &a {
        r.offer(r5, src[..3].to_vec()).unwrap();
    }
    let dst5 = [20, 21, 22, 23];
    let done = d.expect_request(r5, want("a", &dst5)).unwrap();
    let got = bounded(done).await;
    assert!(matches!(got, Outcome::Failed(_)), "{got:?}");
    assert_poisoned(&d, &dst5);
    for r in &a {
        assert!(matches!(
            bounded(r.decided(r5)).await,
            transfer_engine::core::vote::Decision::Failed { .. }
        ));
        assert!(
            matches!(r.offer(r5, src.to_vec()), Err(EngineError::Config(_))),
            "a decided request is not offered again"
        );
    }
    // Failed before decode asks: the offer goes with the decision and is never posted from; the
    // allocation that comes later is handed out.
    let r6 = RequestId(45);
    for r in &a {
        r.offer(r6, src.to_vec()).unwrap();
        r.fail(r6, FailureCode::Aborted);
    }
    for r in &a {
        assert!(matches!(
            bounded(r.decided(r6)).await,
            transfer_engine::core::vote::Decision::Failed { .. }
        ));
        assert!(!r.withdraw(r6), "the decision took the offer");
        r.release(r6);
    }
    asked_handed_out_and_failed(&d, &a, r6, &[24, 25, 26, 27]).await;
    let s = d.stats();
    assert_eq!((s.completed, s.failed), (3, 3), "{s:?}");
    for r in &a {
        assert_eq!(r.stats().offers_posted, 3, "r1, r2 and r3");
    }
    d.shutdown(BOUND).await;
}
