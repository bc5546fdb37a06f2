//! One prefill pipeline serving several decode engines over real loopback UCX: one registration of
//! each rank's pool and one vote mesh for all of them, each decode's requests written into its own
//! pool, one decode's close failing only its own requests, and a decode that aborts a request
//! another decode owns counted and ignored. Every byte is checked on poisoned destination pages;
//! every wait is bounded.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;
use transfer_engine::control::Secret;
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::{KvLayout, RegionKind};
use transfer_engine::core::tracker::FailureReason;
use transfer_engine::core::vote::Decision;
use transfer_engine::engine::{
    DecodeConfig, DecodeEngine, EngineError, LinkId, Outcome, Pool, PrefillConfig, PrefillEngine,
};
use transfer_engine::mem::{HostBuffer, HostOptions};

const LAYERS: u32 = 4;
const PP: u16 = 2;
const PAGE_TOKENS: u32 = 16;
const PAGE_BYTES: u64 = 512;
const DECODE_PAGES: u32 = 64;
const PREFILL_PAGES: u32 = 16;
const PROMPT: u32 = 64;
const CHUNK: u32 = 32;
const POISON: u8 = 0x5A;
const SECRET: &[u8] = b"links-test secret, 32 bytes.....";
const BOUND: Duration = Duration::from_secs(10);
const LONG: Duration = Duration::from_secs(20);

fn decode_layout() -> KvLayout {
    KvLayout::packed(0, LAYERS, RegionKind::Fused, PAGE_BYTES, DECODE_PAGES)
}

/// The byte at `at` of page `page` of layer `layer` in the prefill pools: no two (layer, page)
/// share a page's bytes.
fn pattern(layer: u32, page: u32, at: u64) -> u8 {
    let x = u64::from(layer) * 7919 + u64::from(page) * 104_729 + at;
    (x ^ (x >> 7)).wrapping_mul(31) as u8
}

async fn decode() -> DecodeEngine {
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, decode_layout(), PP);
    cfg.token = Some(Secret::new(SECRET));
    cfg.abort_ack_timeout = Duration::from_millis(500);
    let len = decode_layout().buffer_len as usize;
    let mut b = HostBuffer::new(len, HostOptions::default()).unwrap();
    b.as_mut_slice().fill(POISON);
    DecodeEngine::start(cfg, Pool::Owned(b)).await.unwrap()
}

/// A PP pipeline started against `first`, then linked to every decode of `more`.
async fn pipeline(
    first: &DecodeEngine,
    more: &[&DecodeEngine],
    keep_open: bool,
) -> Vec<PrefillEngine> {
    let (sockets, peers) = common::mesh_sockets(PP);
    let mut starts = Vec::new();
    for rank in 0..PP {
        let (layout, buf) =
            common::patterned_rank(LAYERS, PP, rank, PAGE_BYTES, PREFILL_PAGES, pattern);
        let mut cfg = PrefillConfig::new(
            first.local_addr(),
            rank,
            PP,
            LAYERS,
            PAGE_TOKENS,
            layout.clone(),
        );
        cfg.engine_id = format!("p-{rank}");
        cfg.backend = transfer_engine::engine::BackendConfig::default_for(
            transfer_engine::transport::BackendKind::Ucx,
            &format!("p-{rank}"),
        );
        cfg.peers = peers.clone();
        cfg.mesh_socket = Some(sockets[usize::from(rank)].clone());
        cfg.token = Some(Secret::new(SECRET));
        cfg.connect_timeout = Duration::from_secs(5);
        cfg.keep_open = keep_open;
        starts.push(tokio::spawn(PrefillEngine::start(cfg, Pool::Owned(buf))));
    }
    let mut ranks = Vec::new();
    for s in starts {
        ranks.push(s.await.unwrap().unwrap());
    }
    for (n, d) in more.iter().enumerate() {
        for r in &ranks {
            let id = r.add_decode(d.local_addr()).await.unwrap();
            assert_eq!(id, LinkId(n as u32 + 1));
            // Linking the same decode again keeps its link.
            assert_eq!(r.add_decode(d.local_addr()).await.unwrap(), id);
        }
    }
    first.wait_for_ranks(BOUND).await.unwrap();
    for d in more {
        d.wait_for_ranks(BOUND).await.unwrap();
    }
    ranks
}

async fn send_all(ranks: &[PrefillEngine], request: RequestId, src: &[u32]) {
    let last = PROMPT.div_ceil(CHUNK) - 1;
    for r in ranks {
        for chunk in 0..=last {
            r.send_chunk(request, chunk, src, chunk == last)
                .await
                .unwrap();
        }
    }
}

/// Every layer's `dst` pages in `d` hold the prefill's `src` pages.
fn assert_landed(d: &DecodeEngine, src: &[u32], dst: &[u32]) {
    let mut page = vec![0u8; PAGE_BYTES as usize];
    for layer in 0..LAYERS {
        for (&s, &t) in src.iter().zip(dst) {
            let off = (u64::from(layer) * u64::from(DECODE_PAGES) + u64::from(t)) * PAGE_BYTES;
            d.read_pool(off, &mut page).unwrap();
            let expected: Vec<u8> = (0..PAGE_BYTES).map(|at| pattern(layer, s, at)).collect();
            assert!(
                page == expected,
                "layer {layer} page {t} does not hold page {s}"
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

/// Waits (bounded) until `ok` holds.
async fn until(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + BOUND;
    while !ok() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prefill_pipeline_serves_two_decode_engines_with_one_registration() {
    let (d1, d2) = (decode().await, decode().await);
    let ranks = pipeline(&d1, &[&d2], false).await;
    for r in &ranks {
        let s = r.stats();
        assert_eq!(s.decodes, 2, "{s:?}");
        assert_eq!(
            s.registered_bytes,
            r.transport_stats().registered_bytes,
            "{s:?}"
        );
        let mut linked: Vec<_> = r.decodes().into_iter().map(|(_, a)| a).collect();
        linked.sort();
        let mut want = vec![d1.local_addr(), d2.local_addr()];
        want.sort();
        assert_eq!(linked, want);
    }
    // One registration per rank: its layout's bytes, once, for both decodes.
    let per_rank: Vec<u64> = ranks.iter().map(|r| r.stats().registered_bytes).collect();
    assert_eq!(
        per_rank,
        vec![u64::from(LAYERS / 2) * u64::from(PREFILL_PAGES) * PAGE_BYTES; 2]
    );

    // A request into each decode at once, from the same source pages into different pages.
    let (r1, r2) = (RequestId(1), RequestId(2));
    let (dst1, dst2) = ([4, 5, 6, 7], [40, 41, 42, 43]);
    let done1 = d1.expect(r1, PROMPT, CHUNK, dst1.to_vec(), LONG).unwrap();
    let done2 = d2.expect(r2, PROMPT, CHUNK, dst2.to_vec(), LONG).unwrap();
    for r in &ranks {
        let mut from = Vec::new();
        for _ in 0..2 {
            let got = bounded(r.next_request()).await.unwrap();
            from.push((got.request, got.decode));
        }
        from.sort();
        assert_eq!(from, vec![(r1, LinkId(0)), (r2, LinkId(1))]);
    }
    let src = [0, 1, 2, 3];
    tokio::join!(send_all(&ranks, r1, &src), send_all(&ranks, r2, &src));
    assert_eq!(bounded(done1).await, Outcome::Complete);
    assert_eq!(bounded(done2).await, Outcome::Complete);
    assert_landed(&d1, &src, &dst1);
    assert_landed(&d2, &src, &dst2);
    // Each decode got exactly its own request's pages.
    assert_poisoned(&d1, &dst2);
    assert_poisoned(&d2, &dst1);
    for r in &ranks {
        assert_eq!(bounded(r.decided(r1)).await, Decision::Completed);
        assert_eq!(bounded(r.decided(r2)).await, Decision::Completed);
    }
    let (a, b) = (d1.shutdown(BOUND).await, d2.shutdown(BOUND).await);
    assert!(a.pool_freed && b.pool_freed, "{a:?} {b:?}");
    assert_eq!(a.confirmed.len() + b.confirmed.len(), 4, "{a:?} {b:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_that_closes_fails_only_its_own_requests() {
    let (d1, d2) = (decode().await, decode().await);
    let ranks = pipeline(&d1, &[&d2], false).await;
    let (r1, r2) = (RequestId(11), RequestId(12));
    let (dst1, dst2) = ([4, 5, 6, 7], [40, 41, 42, 43]);
    let done1 = d1.expect(r1, PROMPT, CHUNK, dst1.to_vec(), LONG).unwrap();
    let _done2 = d2.expect(r2, PROMPT, CHUNK, dst2.to_vec(), LONG).unwrap();
    for r in &ranks {
        for _ in 0..2 {
            bounded(r.next_request()).await.unwrap();
        }
    }
    // Decode 2 goes away with its request in flight: its request fails on every rank, its link
    // is forgotten, and decode 1's request is untouched.
    let report = d2.shutdown(BOUND).await;
    assert!(report.pool_freed, "{report:?}");
    for r in &ranks {
        assert!(
            matches!(bounded(r.decided(r2)).await, Decision::Failed { .. }),
            "{:?}",
            r.stats()
        );
        until("decode 2's link is forgotten", || r.stats().decodes == 1).await;
        assert_eq!(r.decodes(), vec![(LinkId(0), d1.local_addr())]);
        assert!(matches!(
            r.send_chunk(r2, 0, &[0, 1], false).await,
            Err(EngineError::RequestFailed { .. })
        ));
    }
    let src = [8, 9, 10, 11];
    send_all(&ranks, r1, &src).await;
    assert_eq!(bounded(done1).await, Outcome::Complete);
    assert_landed(&d1, &src, &dst1);
    // Without `keep_open` the engine closes with its last decode.
    d1.shutdown(BOUND).await;
    for r in &ranks {
        assert_eq!(bounded(r.next_request()).await, None);
        assert!(matches!(
            r.add_decode(SocketAddr::from(([127, 0, 0, 1], 9))).await,
            Err(EngineError::Shutdown)
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_kept_open_serves_a_decode_that_comes_after_the_last_one_left() {
    let d1 = decode().await;
    let ranks = pipeline(&d1, &[], true).await;
    d1.shutdown(BOUND).await;
    for r in &ranks {
        until("decode 1's link is forgotten", || r.stats().decodes == 0).await;
    }
    let d2 = decode().await;
    for r in &ranks {
        assert_eq!(r.add_decode(d2.local_addr()).await.unwrap(), LinkId(1));
    }
    d2.wait_for_ranks(BOUND).await.unwrap();
    let (r, dst) = (RequestId(21), [30, 31, 32, 33]);
    let done = d2.expect(r, PROMPT, CHUNK, dst.to_vec(), LONG).unwrap();
    let src = [1, 3, 5, 7];
    send_all(&ranks, r, &src).await;
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert_landed(&d2, &src, &dst);
    d2.shutdown(BOUND).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_cannot_abort_a_request_another_decode_owns() {
    let (d1, d2) = (decode().await, decode().await);
    let ranks = pipeline(&d1, &[&d2], false).await;
    let x = RequestId(31);
    let dst1 = [4, 5, 6, 7];
    let done1 = d1.expect(x, PROMPT, CHUNK, dst1.to_vec(), LONG).unwrap();
    for r in &ranks {
        assert_eq!(bounded(r.next_request()).await.unwrap().decode, LinkId(0));
    }
    // Decode 2 asks for the same request id: every rank refuses it, decode 2 fails it and tells
    // the ranks (an Abort of request 31), which must not touch decode 1's request.
    let done2 = d2
        .expect(x, PROMPT, CHUNK, vec![40, 41, 42, 43], LONG)
        .unwrap();
    let refused = bounded(done2).await;
    assert!(
        matches!(refused, Outcome::Failed(FailureReason::PeerFailed { .. })),
        "{refused:?}"
    );
    for r in &ranks {
        until("decode 2's abort is dropped", || r.stats().refused >= 1).await;
    }
    let src = [0, 1, 2, 3];
    send_all(&ranks, x, &src).await;
    assert_eq!(bounded(done1).await, Outcome::Complete);
    assert_landed(&d1, &src, &dst1);
    assert_poisoned(&d2, &[40, 41, 42, 43]);
    for r in &ranks {
        assert_eq!(bounded(r.decided(x)).await, Decision::Completed);
        assert_eq!(r.stats().rejected_requests, 1);
    }
    d1.shutdown(BOUND).await;
    d2.shutdown(BOUND).await;
}

/// A relay on loopback in front of `target` that passes every connection through until
/// `blocked` is set; then it cuts the connections it carries and closes new ones at once, until
/// cleared.
async fn mesh_relay(target: SocketAddr) -> (SocketAddr, tokio::sync::watch::Sender<bool>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        loop {
            let Ok((mut from, _)) = listener.accept().await else {
                return;
            };
            if *rx.borrow() {
                let _ = from.shutdown().await;
                continue;
            }
            let mut blocked = rx.clone();
            tokio::spawn(async move {
                let Ok(mut to) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut from, &mut to) => {}
                    _ = blocked.wait_for(|b| *b) => {}
                }
            });
        }
    });
    (addr, tx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_starts_while_a_vote_mesh_link_is_down() {
    let d = decode().await;
    // Rank 1 reaches rank 0's mesh socket through a relay that can cut the link.
    let (sockets, real) = common::mesh_sockets(PP);
    let (relay, blocked) = mesh_relay(real[0]).await;
    let mut starts = Vec::new();
    for rank in 0..PP {
        let (layout, buf) =
            common::patterned_rank(LAYERS, PP, rank, PAGE_BYTES, PREFILL_PAGES, pattern);
        let mut cfg = PrefillConfig::new(d.local_addr(), rank, PP, LAYERS, PAGE_TOKENS, layout);
        cfg.engine_id = format!("mesh-{rank}");
        cfg.backend = transfer_engine::engine::BackendConfig::default_for(
            transfer_engine::transport::BackendKind::Ucx,
            &format!("mesh-{rank}"),
        );
        cfg.peers = if rank == 1 {
            vec![relay, real[1]]
        } else {
            real.clone()
        };
        cfg.mesh_socket = Some(sockets[usize::from(rank)].clone());
        cfg.token = Some(Secret::new(SECRET));
        cfg.connect_timeout = Duration::from_secs(5);
        starts.push(tokio::spawn(PrefillEngine::start(cfg, Pool::Owned(buf))));
    }
    let mut ranks = Vec::new();
    for s in starts {
        ranks.push(s.await.unwrap().unwrap());
    }
    d.wait_for_ranks(BOUND).await.unwrap();
    let src = [0, 1, 2, 3];
    let (r1, dst1) = (RequestId(41), [4, 5, 6, 7]);
    let done = d.expect(r1, PROMPT, CHUNK, dst1.to_vec(), LONG).unwrap();
    send_all(&ranks, r1, &src).await;
    assert_eq!(bounded(done).await, Outcome::Complete);
    for r in &ranks {
        assert_eq!(bounded(r.next_request()).await.unwrap().request, r1);
    }

    // The mesh link goes down: both ranks tell decode, which asks them for nothing new.
    blocked.send_replace(true);
    until("decode sees the ranks away", || {
        d.absences().last().is_some_and(|a| a.until.is_none())
    })
    .await;
    let (r2, dst2) = (RequestId(42), [8, 9, 10, 11]);
    let done = d.expect(r2, PROMPT, CHUNK, dst2.to_vec(), LONG).unwrap();
    for r in &ranks {
        assert!(
            tokio::time::timeout(Duration::from_millis(500), r.next_request())
                .await
                .is_err(),
            "a rank was asked for a request while its vote mesh was down"
        );
    }
    // The link comes back: the mesh forms again, the ranks say Ready, the request goes out.
    blocked.send_replace(false);
    for r in &ranks {
        assert_eq!(bounded(r.next_request()).await.unwrap().request, r2);
    }
    send_all(&ranks, r2, &src).await;
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert_landed(&d, &src, &dst2);
    d.shutdown(BOUND).await;
}

/// PP ranks whose layer ranges would leave layers of the model unwritten are refused at the
/// handshake, with a message naming the ranges: rank 0 holding layers 0..1 and rank 1 layers 2..4
/// leave layer 1 to nobody (with the check removed, both were admitted). The two start at once:
/// the layers a handshake past its check claims count for the other's check (without the claims,
/// both passed their checks now and then, and one was cut after its handshake with no reason: 1 of
/// 12 runs on 2 busy cores).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_whose_layers_leave_a_gap_are_refused() {
    let d = decode().await;
    let (sockets, peers) = common::mesh_sockets(PP);
    let mut starts = Vec::new();
    for (rank, layers) in [(0u16, 0..1u32), (1, 2..4)] {
        let layout = KvLayout::packed(
            layers.start,
            layers.len() as u32,
            RegionKind::Fused,
            PAGE_BYTES,
            PREFILL_PAGES,
        );
        let buf = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
        let mut cfg = PrefillConfig::new(
            d.local_addr(),
            rank,
            PP,
            LAYERS,
            PAGE_TOKENS,
            layout.clone(),
        );
        cfg.engine_id = format!("gap-{rank}");
        cfg.peers = peers.clone();
        cfg.mesh_socket = Some(sockets[usize::from(rank)].clone());
        cfg.token = Some(Secret::new(SECRET));
        cfg.connect_timeout = Duration::from_secs(10);
        starts.push(tokio::spawn(PrefillEngine::start(cfg, Pool::Owned(buf))));
    }
    let mut refused = Vec::new();
    let mut admitted = Vec::new();
    for s in starts {
        match s.await.unwrap() {
            Ok(p) => admitted.push(p),
            Err(e) => refused.push(e.to_string()),
        }
    }
    assert!(
        refused
            .iter()
            .any(|e| e.contains("consecutive layer ranges")),
        "a gap between the ranks' layers was admitted: refused {refused:?}"
    );
    assert!(d.wait_for_ranks(Duration::from_millis(300)).await.is_err());
    drop(admitted);
    d.shutdown(BOUND).await;
}

/// One decode linked by several calls at once (each decode request's handler asking for its
/// decode, say) gets one link: every call returns its id, and the decode admits each rank once.
/// (Without the per-address gate the calls raced past the check for an existing link: the decode
/// refused the rank's second connection, so some calls failed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_decode_linked_by_calls_at_once_gets_one_link() {
    const CALLS: usize = 4;
    let first = decode().await;
    let ranks = pipeline(&first, &[], false).await;
    let second = decode().await;
    let mut adds = Vec::new();
    for (n, r) in ranks.iter().enumerate() {
        for _ in 0..CALLS {
            let (r, addr) = (r.clone(), second.local_addr());
            adds.push((n, tokio::spawn(async move { r.add_decode(addr).await })));
        }
    }
    let mut ids = vec![Vec::new(); ranks.len()];
    for (n, a) in adds {
        ids[n].push(bounded(a).await.unwrap().unwrap());
    }
    for (n, r) in ranks.iter().enumerate() {
        ids[n].dedup();
        assert_eq!(ids[n].len(), 1, "rank {n} got links {:?}", ids[n]);
        assert_eq!(r.decodes().len(), 2, "rank {n} holds {:?}", r.decodes());
    }
    second.wait_for_ranks(BOUND).await.unwrap();
    let src: Vec<u32> = (0..PROMPT.div_ceil(PAGE_TOKENS)).collect();
    let request = RequestId(800);
    let dst: Vec<u32> = src.iter().map(|p| p + 8).collect();
    let done = second
        .expect(request, PROMPT, CHUNK, dst.clone(), LONG)
        .unwrap();
    for r in &ranks {
        assert_eq!(bounded(r.next_request()).await.unwrap().request, request);
    }
    send_all(&ranks, request, &src).await;
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert_landed(&second, &src, &dst);
    second.shutdown(BOUND).await;
    first.shutdown(BOUND).await;
}

/// Decodes linked at once, from several threads (as the decode ranks of one server announce
/// themselves together), each get a link of their own: a rank ends with one link per decode, and
/// a request of every decode lands in its pool. (With the link id read and the link inserted in two
/// steps, two concurrent calls took the same id and the second link replaced the first.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decodes_linked_concurrently_each_get_their_own_link() {
    const MORE: usize = 6;
    let first = decode().await;
    let ranks = pipeline(&first, &[], false).await;
    let mut more = Vec::new();
    for _ in 0..MORE {
        more.push(decode().await);
    }
    let mut adds = Vec::new();
    for r in &ranks {
        for d in &more {
            let (r, addr) = (r.clone(), d.local_addr());
            adds.push(tokio::spawn(async move { r.add_decode(addr).await }));
        }
    }
    for a in adds {
        bounded(a).await.unwrap().unwrap();
    }
    for (n, r) in ranks.iter().enumerate() {
        let mut ids: Vec<LinkId> = r.decodes().into_iter().map(|(id, _)| id).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(
            ids.len(),
            MORE + 1,
            "rank {n} holds links {:?}",
            r.decodes()
        );
    }
    for d in &more {
        d.wait_for_ranks(BOUND).await.unwrap();
    }
    let src: Vec<u32> = (0..PROMPT.div_ceil(PAGE_TOKENS)).collect();
    for (n, d) in more.iter().enumerate() {
        let request = RequestId(700 + n as u64);
        let dst: Vec<u32> = src.iter().map(|p| p + 8 * (n as u32 % 4)).collect();
        let done = d.expect(request, PROMPT, CHUNK, dst.clone(), LONG).unwrap();
        for r in &ranks {
            assert_eq!(bounded(r.next_request()).await.unwrap().request, request);
        }
        send_all(&ranks, request, &src).await;
        assert_eq!(bounded(done).await, Outcome::Complete);
        assert_landed(d, &src, &dst);
    }
    for d in more {
        d.shutdown(BOUND).await;
    }
    first.shutdown(BOUND).await;
}
