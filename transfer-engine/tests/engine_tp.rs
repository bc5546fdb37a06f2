//! Different TP sizes on the two sides, over real loopback UCX: prefill TP 4 into decode TP 2 and
//! 2 into 4 (heads sliced), GQA with fewer KV heads than decode ranks (replicas), and MLA (whole
//! latent pages), all at PP 2. Every decode TP rank is one engine; every prefill (PP, TP) rank runs
//! one engine per decode rank it writes into, or (where the decode ranks name their instance) one
//! engine for all of them, which may be offered the request before decode asks. Each byte of
//! every decode rank's pages is checked against the head it must hold, on poisoned pages; every
//! wait is bounded.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use transfer_engine::control::Secret;
use transfer_engine::control::TpMode;
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::{HeadLayout, HeadOrder, KvLayout, PpSplit, RegionKind};
use transfer_engine::core::topology::{self, TpShape};
use transfer_engine::engine::CustomBackend;
use transfer_engine::engine::{
    BackendConfig, ChunkJobHook, DecodeConfig, DecodeEngine, DecodeStats, EngineError, MeshSocket,
    Outcome, Pool, PrefillConfig, PrefillEngine, TpConfig,
};
use transfer_engine::mem::{HostBuffer, HostOptions};
use transfer_engine::transport::fault::{
    FaultPlan, FaultTransport, Match, RecvFault, Rule, SendFault,
};
use transfer_engine::transport::nixl::{NixlConfig, NixlTransport};
use transfer_engine::transport::{BackendKind, Transport};

const LAYERS: u32 = 4;
const PP: u16 = 2;
const PAGE_TOKENS: u32 = 4;
const HEAD_BYTES: u64 = 8;
const PAGES: u32 = 16;
const PROMPT: u32 = 12;
const CHUNK: u32 = 8;
const SRC: [u32; 3] = [2, 5, 7];
const DST: [u32; 3] = [9, 3, 11];
const POISON: u8 = 0x5A;
const SECRET: &[u8] = b"tp-test secret, 32 bytes long...";
const BOUND: Duration = Duration::from_secs(15);

/// One deployment's TP shape.
#[derive(Clone, Copy)]
struct Case {
    prefill_tp: u16,
    decode_tp: u16,
    /// Model KV heads; 0 for MLA.
    kv_heads: u32,
}

/// How prefill ranks that write into several decode ranks are run.
#[derive(Clone, Copy, PartialEq)]
enum Engines {
    /// One engine per (prefill rank, decode rank it writes into).
    PerTarget,
    /// One engine per prefill rank, serving every decode rank it writes into (the decode ranks
    /// name their instance, so their allocations of one request are one request there).
    PerRank,
    /// As `PerRank`, each rank offered the request's pages before decode asks
    /// (`PrefillEngine::offer`): the engine posts it once every decode rank's allocation came.
    Offered,
}

impl Engines {
    fn per_rank(self) -> bool {
        self != Engines::PerTarget
    }
}

impl Case {
    fn mode(&self) -> TpMode {
        if self.kv_heads == 0 {
            TpMode::Replicated
        } else {
            TpMode::HeadSliced
        }
    }
    fn shape(&self, tp: u16) -> TpShape {
        TpShape {
            tp_size: u32::from(tp),
            kv_heads: self.kv_heads,
        }
    }
    fn tp(&self, rank: u16, size: u16) -> TpConfig {
        TpConfig {
            rank,
            size,
            mode: self.mode(),
            kv_heads: self.kv_heads,
        }
    }
    /// Heads one rank holds (1 for MLA: one latent "head").
    fn held(&self, tp: u16) -> u32 {
        if self.kv_heads == 0 {
            1
        } else {
            self.shape(tp).heads_of(0).len() as u32
        }
    }
    /// The layout of a rank of TP size `tp` holding `layers` from `first`.
    fn layout(&self, tp: u16, first: u32, layers: u32) -> KvLayout {
        let held = self.held(tp);
        let page_bytes = u64::from(held) * HEAD_BYTES * u64::from(PAGE_TOKENS);
        let l = KvLayout::packed(first, layers, RegionKind::SplitKv, page_bytes, PAGES);
        if self.kv_heads == 0 {
            return l;
        }
        l.with_heads(HeadLayout {
            num_heads: held,
            head_bytes: HEAD_BYTES,
            page_tokens: PAGE_TOKENS,
            order: HeadOrder::TokenMajor,
        })
    }
    /// The byte at `at` of page `page` of (region, layer) at a rank of TP size `tp`, rank
    /// `rank`: a function of the global head (0 for MLA), so the same head is the same bytes on
    /// every rank that holds it. `page` is the request's page position (not the pool index).
    fn byte(&self, tp: u16, rank: u16, region: u32, layer: u32, page: u32, at: u64) -> u8 {
        let held = u64::from(self.held(tp));
        let token = at / (held * HEAD_BYTES);
        let in_token = at % (held * HEAD_BYTES);
        let head = if self.kv_heads == 0 {
            0
        } else {
            u64::from(self.shape(tp).heads_of(u32::from(rank)).start) + in_token / HEAD_BYTES
        };
        let b = in_token % HEAD_BYTES;
        let x = u64::from(region) * 7_919
            + u64::from(layer) * 104_729
            + u64::from(page) * 1_299_709
            + token * 15_485_863
            + head * 32_452_843
            + b;
        (x ^ (x >> 11)).wrapping_mul(2_654_435_761) as u8
    }
}

/// A prefill pool of TP rank `t` (layout `layout`) whose pages SRC hold the request's bytes of the
/// heads the rank holds.
fn source(case: &Case, t: u16, layout: &KvLayout) -> HostBuffer {
    let mut buf = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
    let bytes = buf.as_mut_slice();
    for region in 0..2u32 {
        for l in 0..layout.num_layers {
            for (pos, &page) in SRC.iter().enumerate() {
                let base = u64::from(region) * layout.region_stride
                    + u64::from(l) * layout.layer_stride
                    + u64::from(page) * layout.page_bytes;
                for at in 0..layout.page_bytes {
                    bytes[(base + at) as usize] = case.byte(
                        case.prefill_tp,
                        t,
                        region,
                        layout.first_layer + l,
                        pos as u32,
                        at,
                    );
                }
            }
        }
    }
    buf
}

/// Decode TP rank `rank` holds exactly its heads of the request in pages `dst`, every layer and
/// region.
fn check_heads(case: &Case, d: &DecodeEngine, rank: u16, dst: &[u32]) {
    check_heads_from(case, d, rank, dst, 0);
}

/// As `check_heads`, `dst` holding the request's pages from its page `first` on.
fn check_heads_from(case: &Case, d: &DecodeEngine, rank: u16, dst: &[u32], first: u32) {
    let layout = case.layout(case.decode_tp, 0, LAYERS);
    let mut page = vec![0u8; layout.page_bytes as usize];
    for region in 0..2u32 {
        for layer in 0..LAYERS {
            for (pos, &p) in dst.iter().enumerate() {
                let off = u64::from(region) * layout.region_stride
                    + u64::from(layer) * layout.layer_stride
                    + u64::from(p) * layout.page_bytes;
                d.read_pool(off, &mut page).unwrap();
                for (at, &got) in page.iter().enumerate() {
                    let want = case.byte(
                        case.decode_tp,
                        rank,
                        region,
                        layer,
                        first + pos as u32,
                        at as u64,
                    );
                    assert_eq!(
                        got, want,
                        "decode rank {rank} region {region} layer {layer} page {p} byte {at}"
                    );
                }
            }
        }
    }
}

async fn run(case: Case) -> Vec<usize> {
    run_with(case, Engines::PerTarget).await
}

async fn run_with(case: Case, engines: Engines) -> Vec<usize> {
    run_on(case, engines, BackendKind::Ucx, None).await.0
}

/// As `run_with`, on `backend`, decode engines with `landing` bytes of landing memory (`None`:
/// the default); also returns every decode engine's stats.
async fn run_on(
    case: Case,
    engines: Engines,
    backend: BackendKind,
    landing: Option<u64>,
) -> (Vec<usize>, Vec<DecodeStats>) {
    let request = RequestId(77);
    // Decode TP ranks: one engine each, poisoned pools.
    let mut decodes = Vec::new();
    for rank in 0..case.decode_tp {
        let layout = case.layout(case.decode_tp, 0, LAYERS);
        let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout.clone(), PP);
        cfg.tp = case.tp(rank, case.decode_tp);
        cfg.prefill_tp = Some(case.prefill_tp);
        cfg.token = Some(Secret::new(SECRET));
        cfg.backend = BackendConfig::default_for_decode(backend, &format!("d{rank}"));
        if let Some(bytes) = landing {
            cfg.landing_bytes = bytes;
        }
        if engines.per_rank() {
            cfg.instance = "decode-server".into();
        }
        let mut b = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
        b.as_mut_slice().fill(POISON);
        decodes.push(DecodeEngine::start(cfg, Pool::Owned(b)).await.unwrap());
    }
    // Prefill pipelines of PP ranks, each with its own mesh: one per (TP rank, decode rank it
    // writes into), or one per TP rank serving all of them.
    let mut starts = Vec::new();
    let mut more: Vec<Vec<SocketAddr>> = Vec::new();
    for t in 0..case.prefill_tp {
        let targets: Vec<SocketAddr> = topology::targets(
            case.shape(case.prefill_tp),
            case.shape(case.decode_tp),
            u32::from(t),
        )
        .unwrap()
        .into_iter()
        .map(|(d, _)| decodes[d as usize].local_addr())
        .collect();
        let pipelines: Vec<(SocketAddr, Vec<SocketAddr>)> = match engines {
            Engines::PerTarget => targets.iter().map(|&d| (d, Vec::new())).collect(),
            Engines::PerRank | Engines::Offered => {
                vec![(targets[0], targets[1..].to_vec())]
            }
        };
        for (first, rest) in pipelines {
            let d = first;
            let mut peers = Vec::new();
            let mut sockets = Vec::new();
            for _ in 0..PP {
                let s = MeshSocket::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
                peers.push(s.local_addr().unwrap());
                sockets.push(Arc::new(s));
            }
            for pp in 0..PP {
                let range = PpSplit::SglangEven.layer_range(LAYERS, PP, pp).unwrap();
                let layout = case.layout(case.prefill_tp, range.start, range.len() as u32);
                let buf = source(&case, t, &layout);
                let mut cfg = PrefillConfig::new(d, pp, PP, LAYERS, PAGE_TOKENS, layout);
                cfg.tp = case.tp(t, case.prefill_tp);
                cfg.engine_id = format!("p{pp}-t{t}-d{d}");
                cfg.backend = BackendConfig::default_for(backend, &cfg.engine_id);
                cfg.peers = peers.clone();
                cfg.mesh_socket = Some(sockets[usize::from(pp)].clone());
                cfg.token = Some(Secret::new(SECRET));
                cfg.connect_timeout = Duration::from_secs(10);
                starts.push(tokio::spawn(PrefillEngine::start(cfg, Pool::Owned(buf))));
                more.push(rest.clone());
            }
        }
    }
    let mut prefills = Vec::new();
    for (s, rest) in starts.into_iter().zip(more) {
        let p = s.await.unwrap().unwrap();
        for d in rest {
            p.add_decode(d).await.unwrap();
        }
        prefills.push(p);
    }
    if engines.per_rank() {
        // One engine per prefill (PP, TP) rank, whatever it writes into.
        assert_eq!(prefills.len(), usize::from(case.prefill_tp * PP));
    }
    if engines == Engines::Offered {
        for p in &prefills {
            p.offer(request, SRC.to_vec()).unwrap();
        }
    }
    let mut outcomes = Vec::new();
    for d in &decodes {
        d.wait_for_ranks(BOUND).await.unwrap();
        outcomes.push(
            d.expect(request, PROMPT, CHUNK, DST.to_vec(), BOUND)
                .unwrap(),
        );
    }
    if engines != Engines::Offered {
        for p in &prefills {
            let chunks = PROMPT.div_ceil(CHUNK);
            for c in 0..chunks {
                p.send_chunk(request, c, &SRC, c + 1 == chunks)
                    .await
                    .unwrap();
            }
        }
    }
    for o in outcomes {
        assert_eq!(
            tokio::time::timeout(BOUND, o).await.unwrap(),
            Outcome::Complete
        );
    }
    if engines == Engines::Offered {
        // Posted once, by each engine, for all of its decode ranks (counted just after the last
        // post, which decode may see complete first).
        let deadline = tokio::time::Instant::now() + BOUND;
        while prefills.iter().any(|p| p.stats().offers_posted < 1) {
            assert!(tokio::time::Instant::now() < deadline, "offers not counted");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for p in &prefills {
            assert_eq!(p.stats().offers_posted, 1);
        }
    }
    // Coalesced: at most one write per (decode rank written, layer, region, page), however the
    // heads are sliced; sliced token rows are rows of those writes.
    let layers_per_rank = u64::from(LAYERS / u32::from(PP));
    for p in &prefills {
        let st = p.stats();
        let bound = st.decodes * layers_per_rank * 2 * SRC.len() as u64;
        assert!(
            st.writes <= bound,
            "{} writes ({} rows) into {} decode ranks",
            st.writes,
            st.write_rows,
            st.decodes
        );
        assert!(st.write_rows >= st.writes);
    }
    // Every decode rank holds exactly its heads of every page, layer and region.
    let mut sources_per_rank = Vec::new();
    for (rank, d) in decodes.iter().enumerate() {
        check_heads(&case, d, rank as u16, &DST);
        sources_per_rank.push(d.stats().connected_ranks as usize);
    }
    let stats = decodes.iter().map(DecodeEngine::stats).collect();
    for d in decodes {
        d.shutdown(BOUND).await;
    }
    (sources_per_rank, stats)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_tp_4_into_decode_tp_2_heads_sliced() {
    let fan_in = run(Case {
        prefill_tp: 4,
        decode_tp: 2,
        kv_heads: 8,
    })
    .await;
    // Two prefill TP ranks of each of the 2 PP ranks write into every decode rank.
    assert_eq!(fan_in, vec![4, 4]);
}

/// NIXL makes each row strided in the destination a descriptor of its own: where prefill TP is
/// above decode's, decode lends each prefill rank landing memory to write its rows into packed,
/// and copies them into the pages chunk by chunk. Each decode rank here takes 2 TP ranks of each
/// of 2 PP ranks, one leg each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_rows_sliced_in_the_destination_land_packed_and_are_copied_into_the_pages() {
    let case = Case {
        prefill_tp: 4,
        decode_tp: 2,
        kv_heads: 8,
    };
    let (fan_in, stats) = run_on(case, Engines::PerTarget, BackendKind::Nixl, None).await;
    assert_eq!(fan_in, vec![4, 4]);
    for s in &stats {
        assert_eq!(
            s.landing_bytes,
            transfer_engine::engine::DEFAULT_LANDING_BYTES
        );
        assert_eq!((s.landing_grants, s.landing_full), (4, 0));
        // Two chunks from each of the 4 legs.
        assert_eq!(s.landing_chunks, 8);
        // Every range back once the request completed.
        assert_eq!(s.landing_lent, 0);
    }
    // Landing memory too small for any leg: the rows go into the pages directly, as before.
    let (_, stats) = run_on(case, Engines::PerRank, BackendKind::Nixl, Some(64)).await;
    for s in &stats {
        assert_eq!(
            (s.landing_grants, s.landing_full, s.landing_chunks),
            (0, 4, 0)
        );
    }
    // Rows contiguous in the destination (prefill TP below decode's) need none.
    let case = Case {
        prefill_tp: 2,
        decode_tp: 4,
        kv_heads: 8,
    };
    let (_, stats) = run_on(case, Engines::PerRank, BackendKind::Nixl, None).await;
    for s in &stats {
        assert_eq!(
            (s.landing_grants, s.landing_full, s.landing_chunks),
            (0, 0, 0)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_tp_2_into_decode_tp_4_heads_sliced() {
    assert_eq!(
        run(Case {
            prefill_tp: 2,
            decode_tp: 4,
            kv_heads: 8,
        })
        .await,
        vec![2; 4]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gqa_with_fewer_kv_heads_than_decode_ranks_writes_each_replica_once() {
    assert_eq!(
        run(Case {
            prefill_tp: 1,
            decode_tp: 4,
            kv_heads: 2,
        })
        .await,
        vec![2; 4]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mla_latent_pages_go_whole_to_every_decode_rank() {
    assert_eq!(
        run(Case {
            prefill_tp: 2,
            decode_tp: 4,
            kv_heads: 0,
        })
        .await,
        vec![2; 4]
    );
}

/// Prefill TP smaller than decode's, each prefill rank one engine: decode ranks that share a
/// request's id (they all allocate it) are one request on the rank, written into each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prefill_engine_per_rank_writes_into_every_decode_rank_of_a_request() {
    for case in [
        Case {
            prefill_tp: 2,
            decode_tp: 4,
            kv_heads: 8,
        },
        // Replicas: every decode rank holds one of the 2 heads, from the one prefill rank.
        Case {
            prefill_tp: 1,
            decode_tp: 4,
            kv_heads: 2,
        },
        Case {
            prefill_tp: 2,
            decode_tp: 4,
            kv_heads: 0,
        },
    ] {
        let fan_in = run_with(case, Engines::PerRank).await;
        assert_eq!(fan_in, vec![usize::from(PP); 4]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offered_request_is_posted_once_every_decode_rank_asked() {
    // Prefill TP 2 into decode TP 4: each prefill rank's request has two legs, whose allocations
    // come on two connections; the offer is posted once both came, every byte in place.
    let case = Case {
        prefill_tp: 2,
        decode_tp: 4,
        kv_heads: 8,
    };
    let fan_in = run_with(case, Engines::Offered).await;
    assert_eq!(fan_in, vec![usize::from(PP); 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_rank_that_writes_nothing_into_a_decode_rank_is_refused() {
    let case = Case {
        prefill_tp: 4,
        decode_tp: 2,
        kv_heads: 8,
    };
    let layout = case.layout(2, 0, LAYERS);
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout.clone(), 1);
    cfg.tp = case.tp(0, 2);
    cfg.prefill_tp = Some(4);
    cfg.token = Some(Secret::new(SECRET));
    let pool =
        Pool::Owned(HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap());
    let d = DecodeEngine::start(cfg, pool).await.unwrap();
    // Prefill TP rank 3 holds heads 6..8; decode rank 0 holds 0..4.
    let layout = case.layout(4, 0, LAYERS);
    let mut cfg = PrefillConfig::new(d.local_addr(), 0, 1, LAYERS, PAGE_TOKENS, layout.clone());
    cfg.tp = case.tp(3, 4);
    cfg.token = Some(Secret::new(SECRET));
    cfg.connect_timeout = Duration::from_secs(3);
    let pool =
        Pool::Owned(HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap());
    let err = PrefillEngine::start(cfg, pool).await.unwrap_err();
    assert!(matches!(err, EngineError::Control(_)), "{err}");
    assert!(err.to_string().contains("writes nothing"), "{err}");
    d.shutdown(BOUND).await;
}

/// A request one prefill engine writes into two decode ranks of one instance fails as a whole:
/// one decode rank's abort reaches the other decode rank through the prefill rank at once (not by
/// its timeout), the rank's decision is failed, and the next request completes on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_decode_ranks_abort_fails_the_request_on_every_decode_rank() {
    let case = Case {
        prefill_tp: 1,
        decode_tp: 2,
        kv_heads: 2,
    };
    let mut decodes = Vec::new();
    for rank in 0..2 {
        let layout = case.layout(2, 0, LAYERS);
        let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout.clone(), 1);
        cfg.tp = case.tp(rank, 2);
        cfg.prefill_tp = Some(1);
        cfg.instance = "decode-server".into();
        cfg.token = Some(Secret::new(SECRET));
        let pool = Pool::Owned(
            HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap(),
        );
        decodes.push(DecodeEngine::start(cfg, pool).await.unwrap());
    }
    let layout = case.layout(1, 0, LAYERS);
    let mut cfg = PrefillConfig::new(
        decodes[0].local_addr(),
        0,
        1,
        LAYERS,
        PAGE_TOKENS,
        layout.clone(),
    );
    cfg.tp = case.tp(0, 1);
    cfg.token = Some(Secret::new(SECRET));
    let pool =
        Pool::Owned(HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap());
    let p = PrefillEngine::start(cfg, pool).await.unwrap();
    p.add_decode(decodes[1].local_addr()).await.unwrap();
    for d in &decodes {
        d.wait_for_ranks(BOUND).await.unwrap();
    }
    let long = Duration::from_secs(60);
    // A request only one decode rank asks for never reaches the caller; once that rank gives it
    // up, the prefill rank forgets it (nobody would release it) and keeps only its decision.
    let lone = decodes[0]
        .expect(RequestId(4), PROMPT, CHUNK, DST.to_vec(), long)
        .unwrap();
    let until = tokio::time::Instant::now() + BOUND;
    while p.stats().requests == 0 {
        assert!(tokio::time::Instant::now() < until, "{:?}", p.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    decodes[0].abort(RequestId(4));
    let outcome = tokio::time::timeout(BOUND, lone).await.unwrap();
    assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
    assert!(matches!(
        tokio::time::timeout(BOUND, p.decided(RequestId(4)))
            .await
            .unwrap(),
        transfer_engine::core::vote::Decision::Failed { .. }
    ));
    assert_eq!(p.stats().requests, 0, "{:?}", p.stats());
    tokio::time::timeout(BOUND, decodes[0].released(RequestId(4)))
        .await
        .unwrap();
    let a = decodes[0]
        .expect(RequestId(5), PROMPT, CHUNK, DST.to_vec(), long)
        .unwrap();
    let b = decodes[1]
        .expect(RequestId(5), PROMPT, CHUNK, DST.to_vec(), long)
        .unwrap();
    // Served once, when both allocations came.
    let got = tokio::time::timeout(BOUND, p.next_request())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.request, RequestId(5));
    decodes[0].abort(RequestId(5));
    let started = std::time::Instant::now();
    for o in [a, b] {
        let outcome = tokio::time::timeout(BOUND, o).await.unwrap();
        assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the other decode rank learnt of the abort by its timeout"
    );
    assert!(matches!(
        tokio::time::timeout(BOUND, p.decided(RequestId(5)))
            .await
            .unwrap(),
        transfer_engine::core::vote::Decision::Failed { .. }
    ));
    p.release(RequestId(5));
    // The next request goes to both and completes.
    let outs: Vec<_> = decodes
        .iter()
        .map(|d| {
            d.expect(RequestId(6), PROMPT, CHUNK, DST.to_vec(), BOUND)
                .unwrap()
        })
        .collect();
    let got = tokio::time::timeout(BOUND, p.next_request())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.request, RequestId(6));
    let chunks = PROMPT.div_ceil(CHUNK);
    for c in 0..chunks {
        p.send_chunk(RequestId(6), c, &SRC, c + 1 == chunks)
            .await
            .unwrap();
    }
    for o in outs {
        assert_eq!(
            tokio::time::timeout(BOUND, o).await.unwrap(),
            Outcome::Complete
        );
    }
    assert_eq!(p.stats().requests, 1, "request 6 is held until released");
    for d in decodes {
        d.shutdown(BOUND).await;
    }
}

/// A NIXL transport inside a fault transport with no rules; the handle lets the test add some.
fn faulty_nixl(
    name: &str,
) -> (
    BackendConfig,
    Arc<std::sync::Mutex<Option<Arc<FaultTransport>>>>,
) {
    let slot: Arc<std::sync::Mutex<Option<Arc<FaultTransport>>>> = Arc::default();
    let s2 = slot.clone();
    let name = name.to_owned();
    let backend = CustomBackend::new(BackendKind::Nixl, move |sink| {
        let cfg = NixlConfig {
            name: name.clone(),
            ..NixlConfig::default()
        };
        let t = FaultTransport::new(FaultPlan::new(3), sink, |inner| {
            Ok(Arc::new(NixlTransport::new(cfg, inner)?) as Arc<dyn Transport>)
        })?;
        *s2.lock().unwrap() = Some(t.clone());
        Ok(t as Arc<dyn Transport>)
    });
    (BackendConfig::Custom(backend), slot)
}

/// Prefill TP 2 into decode TP 1: each prefill rank holds half of every token row of decode's.
const TWO_INTO_ONE: Case = Case {
    prefill_tp: 2,
    decode_tp: 1,
    kv_heads: 8,
};

/// A NIXL decode engine of TP 1 (poisoned pool, aborts unacknowledged after 300 ms) and its two
/// prefill TP ranks at PP 1, each NIXL inside a fault transport (returned too), connected.
async fn two_into_one_nixl(
    name: &str,
) -> (DecodeEngine, Vec<PrefillEngine>, Vec<Arc<FaultTransport>>) {
    two_into_one_nixl_in(name, 1, 2).await
}

/// `buf` in `n` equal consecutive registrations of its bytes (a pool per layer and per K and V
/// where `n` is twice the layers).
fn segments(buf: &HostBuffer, n: usize) -> Vec<Pool> {
    let len = buf.as_slice().len() / n;
    buf.as_slice()
        .chunks(len)
        .map(|c| {
            let mut b = HostBuffer::new(len, HostOptions::default()).unwrap();
            b.as_mut_slice().copy_from_slice(c);
            Pool::Owned(b)
        })
        .collect()
}

/// As `two_into_one_nixl`, every side's pool in `n` registrations (`start_regions`; 1: one pool),
/// decode lending `slots` chunks of landing memory per rank and request. Decode's NIXL is inside a
/// fault transport too: its handle comes last, after the two ranks'.
async fn two_into_one_nixl_in(
    name: &str,
    n: usize,
    slots: u32,
) -> (DecodeEngine, Vec<PrefillEngine>, Vec<Arc<FaultTransport>>) {
    two_into_one_nixl_with(name, n, slots, None).await
}

/// As `two_into_one_nixl_in`, decode running `hook` at the start of each chunk job.
async fn two_into_one_nixl_with(
    name: &str,
    n: usize,
    slots: u32,
    hook: Option<ChunkJobHook>,
) -> (DecodeEngine, Vec<PrefillEngine>, Vec<Arc<FaultTransport>>) {
    let case = TWO_INTO_ONE;
    let layout = case.layout(1, 0, LAYERS);
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout.clone(), 1);
    cfg.tp = case.tp(0, 1);
    cfg.prefill_tp = Some(2);
    cfg.token = Some(Secret::new(SECRET));
    cfg.backend = BackendConfig::default_for_decode(BackendKind::Nixl, &format!("{name}-d"));
    cfg.abort_ack_timeout = Duration::from_millis(300);
    cfg.landing_slots = slots;
    cfg.chunk_job_hook = hook;
    let (backend, decode_fault) = faulty_nixl(&format!("{name}-d"));
    cfg.backend = backend;
    let mut b = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
    b.as_mut_slice().fill(POISON);
    let d = DecodeEngine::start_regions(cfg, segments(&b, n))
        .await
        .unwrap();
    let (mut ranks, mut faults) = (Vec::new(), Vec::new());
    for t in 0..2u16 {
        let layout = case.layout(2, 0, LAYERS);
        let buf = source(&case, t, &layout);
        let mut cfg = PrefillConfig::new(d.local_addr(), 0, 1, LAYERS, PAGE_TOKENS, layout);
        cfg.tp = case.tp(t, 2);
        cfg.engine_id = format!("{name}-p{t}");
        let (backend, slot) = faulty_nixl(&cfg.engine_id);
        cfg.backend = backend;
        cfg.token = Some(Secret::new(SECRET));
        cfg.connect_timeout = Duration::from_secs(10);
        ranks.push(
            PrefillEngine::start_regions(cfg, segments(&buf, n))
                .await
                .unwrap(),
        );
        faults.push(slot.lock().unwrap().clone().unwrap());
    }
    d.wait_for_ranks(BOUND).await.unwrap();
    faults.push(decode_fault.lock().unwrap().clone().unwrap());
    (d, ranks, faults)
}

/// A request that ends while the copy of its first landed chunk waits on decode's chunk worker:
/// once its pages are released and a new request holds them, the old copy runs and is dropped. It
/// writes nothing into the pages (still poisoned) and counts nothing, and the new request
/// completes with its own bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_whose_request_ended_while_it_waited_writes_and_counts_nothing() {
    let case = TWO_INTO_ONE;
    let request = RequestId(31);
    // The first job of the first request waits in the hook until the test lets it go; every later
    // job of that id is queued behind it on the same worker.
    let (hook, held_rx, go_tx) = common::hold_first_job(request, BOUND);
    let (d, ranks, _faults) = two_into_one_nixl_with("held", 1, 2, Some(hook)).await;
    for p in &ranks {
        p.offer(request, SRC.to_vec()).unwrap();
    }
    let done = d
        .expect(request, PROMPT, PAGE_TOKENS, DST.to_vec(), BOUND)
        .unwrap();
    common::until_held(held_rx, BOUND).await;
    d.abort(request);
    assert_eq!(
        tokio::time::timeout(BOUND, done).await.unwrap(),
        Outcome::Failed(transfer_engine::core::tracker::FailureReason::Aborted)
    );
    tokio::time::timeout(BOUND, d.released(request))
        .await
        .expect("the aborted request's pages were never released");
    // The same pages for a new request (the tracker refuses an id it finished), not offered yet:
    // nothing may write into them.
    let next = RequestId(32);
    let again = d
        .expect(next, PROMPT, PAGE_TOKENS, DST.to_vec(), BOUND)
        .unwrap();
    let before = d.stats().jobs_dropped;
    go_tx.send(()).unwrap();
    until_stats(&d, "dropped the held job", |s| s.jobs_dropped > before).await;
    // Every job of the old request ran (the new one has none before it is offered).
    until_stats(&d, "emptied the queue", |s| s.jobs_queued == 0).await;
    let layout = case.layout(case.decode_tp, 0, LAYERS);
    let mut pool = vec![0u8; layout.buffer_len as usize];
    d.read_pool(0, &mut pool).unwrap();
    let written = pool.iter().filter(|&&b| b != POISON).count();
    assert_eq!(written, 0, "bytes written by a copy of the ended request");
    assert_eq!(d.stats().landing_chunks, 0, "{:?}", d.stats());
    for p in &ranks {
        p.offer(next, SRC.to_vec()).unwrap();
    }
    assert_eq!(
        tokio::time::timeout(BOUND, again).await.unwrap(),
        Outcome::Complete
    );
    check_heads(&case, &d, 0, &DST);
    d.shutdown(BOUND).await;
}

/// Once `queued` jobs wait on decode's worker, ends rank 1 (the last of `ranks`) and checks that
/// its loss waits behind them as one more job.
async fn lose_rank_1_behind(d: &DecodeEngine, ranks: &mut Vec<PrefillEngine>, queued: u64) {
    until_stats(d, "the chunks queued", |s| s.jobs_queued == queued).await;
    drop(ranks.pop());
    until_stats(d, "rank 1 lost", |s| s.connected_ranks == 1).await;
    assert_eq!(d.stats().jobs_queued, queued + 1, "{:?}", d.stats());
}

/// Waits (bounded) until `f` holds of decode's stats.
async fn until_stats(d: &DecodeEngine, what: &str, f: impl Fn(&DecodeStats) -> bool) {
    let deadline = tokio::time::Instant::now() + BOUND;
    while !f(&d.stats()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never {what}: {:?}",
            d.stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A rank that delivered every chunk of a request and then went away while decode still had
/// those chunks queued on its chunk worker (not yet copied or counted) fails nothing: its loss
/// reaches the tracker behind its chunks, and the request completes with every byte right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_lost_while_its_delivered_chunks_wait_on_a_worker_fails_nothing() {
    let case = TWO_INTO_ONE;
    let request = RequestId(33);
    let (hook, held_rx, go_tx) = common::hold_first_job(request, BOUND);
    // Three slots for three chunks: no rank waits for a copy before it writes.
    let (d, mut ranks, _faults) = two_into_one_nixl_with("lost", 1, 3, Some(hook)).await;
    for p in &ranks {
        p.offer(request, SRC.to_vec()).unwrap();
    }
    let done = d
        .expect(request, PROMPT, PAGE_TOKENS, DST.to_vec(), BOUND)
        .unwrap();
    common::until_held(held_rx, BOUND).await;
    // Both ranks' three chunks arrived: one held, five queued behind it.
    lose_rank_1_behind(&d, &mut ranks, 6).await;
    go_tx.send(()).unwrap();
    assert_eq!(
        tokio::time::timeout(BOUND, done).await.unwrap(),
        Outcome::Complete
    );
    check_heads(&case, &d, 0, &DST);
    // The loss's job ends after the outcome went out (dropped: the request ended).
    until_stats(&d, "emptied the queue", |s| s.jobs_queued == 0).await;
    let s = d.stats();
    assert_eq!((s.jobs_dropped, s.failed), (0, 0), "{s:?}");
    d.shutdown(BOUND).await;
}

/// A rank lost before it delivered every chunk of a request fails it, also while decode still
/// has chunks of the request queued on its chunk worker: the loss waits behind them, then fails
/// the request as `PeerLost` naming that rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_lost_before_it_delivered_fails_the_request_behind_its_queued_chunks() {
    use transfer_engine::core::tracker::FailureReason;
    let request = RequestId(34);
    let (hook, held_rx, go_tx) = common::hold_first_job(request, BOUND);
    let (d, mut ranks, _faults) = two_into_one_nixl_with("short", 1, 3, Some(hook)).await;
    let done = d
        .expect(request, PROMPT, PAGE_TOKENS, DST.to_vec(), BOUND)
        .unwrap();
    // Rank 0 sends all three chunks, rank 1 only its first.
    for c in 0..3 {
        ranks[0].send_chunk(request, c, &SRC, c == 2).await.unwrap();
    }
    ranks[1].send_chunk(request, 0, &SRC, false).await.unwrap();
    common::until_held(held_rx, BOUND).await;
    lose_rank_1_behind(&d, &mut ranks, 4).await;
    go_tx.send(()).unwrap();
    let outcome = tokio::time::timeout(BOUND, done).await.unwrap();
    assert!(
        matches!(
            outcome,
            Outcome::Failed(FailureReason::PeerLost { rank: 1, .. })
        ),
        "{outcome:?}"
    );
    until_stats(&d, "emptied the queue", |s| s.jobs_queued == 0).await;
    d.shutdown(BOUND).await;
}

/// With a prefix decode already holds, the ranks' packed rows start at the first page after it,
/// and decode copies each chunk to the right pages: the moved pages hold their own tokens' heads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn landed_rows_after_a_prefix_decode_holds_go_to_their_own_pages() {
    let case = TWO_INTO_ONE;
    let (d, ranks, _faults) = two_into_one_nixl("prefix").await;
    let request = RequestId(9);
    for p in &ranks {
        p.offer(request, SRC.to_vec()).unwrap();
    }
    // Decode holds the first page; the other two move, in chunks of one page each.
    let dst = vec![0, 6];
    let done = d
        .expect_after_prefix(
            request,
            PAGE_TOKENS,
            PROMPT - PAGE_TOKENS,
            PAGE_TOKENS,
            dst.clone(),
            BOUND,
        )
        .unwrap();
    assert_eq!(
        tokio::time::timeout(BOUND, done).await.unwrap(),
        Outcome::Complete
    );
    check_heads_from(&case, &d, 0, &dst, 1);
    let s = d.stats();
    assert_eq!(
        (s.landing_grants, s.landing_chunks, s.landing_lent),
        (2, 4, 0)
    );
    d.shutdown(BOUND).await;
}

/// Pools in several registrations on both sides (one per layer and per K and V): each rank's packed
/// rows are read out of its segments into landing memory, and decode copies each chunk out of
/// landing memory into its segments; every byte of the moved pages is its head's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn landed_rows_go_from_and_into_pools_in_several_registrations() {
    let case = TWO_INTO_ONE;
    let n = 2 * LAYERS as usize;
    let (d, ranks, _faults) = two_into_one_nixl_in("segments", n, 2).await;
    assert_eq!(d.stats().registrations, n as u64);
    let request = RequestId(12);
    let done = d
        .expect(request, PROMPT, CHUNK, DST.to_vec(), BOUND)
        .unwrap();
    let chunks = PROMPT.div_ceil(CHUNK);
    for p in &ranks {
        for c in 0..chunks {
            p.send_chunk(request, c, &SRC, c + 1 == chunks)
                .await
                .unwrap();
        }
    }
    landed_whole(&case, &d, done, chunks).await;
    d.shutdown(BOUND).await;
}

/// The 2-into-1 request into DST completes, every byte of its pages its head's, both ranks' legs
/// granted landing memory and every one of their `chunks` copied out of it, none lent any more.
async fn landed_whole(
    case: &Case,
    d: &DecodeEngine,
    done: impl std::future::Future<Output = Outcome>,
    chunks: u32,
) {
    assert_eq!(
        tokio::time::timeout(BOUND, done).await.unwrap(),
        Outcome::Complete
    );
    check_heads(case, d, 0, &DST);
    let s = d.stats();
    assert_eq!(
        (s.landing_grants, s.landing_chunks, s.landing_lent),
        (2, 2 * u64::from(chunks), 0)
    );
}

/// With one landing slot per rank, a request of three chunks reuses each rank's range: a rank
/// writes chunk `c` only once decode copied chunk `c - 1` out (its `Landed`). A rank whose chunk 0
/// is stuck in its transport (written, not yet notified) writes nothing more meanwhile, though its
/// request was offered (each chunk posted as soon as it may be), while the other rank's three
/// chunks land; released, every chunk of both lands in its own pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_landing_range_is_written_only_after_decode_copied_the_chunk_before() {
    let case = TWO_INTO_ONE;
    let (d, ranks, faults) = two_into_one_nixl_in("slots", 1, 1).await;
    let request = RequestId(21);
    faults[0].add_send(Rule::new(
        Match::request(request).chunk(0),
        SendFault::Stuck,
    ));
    for p in &ranks {
        p.offer(request, SRC.to_vec()).unwrap();
    }
    let chunks = PROMPT / PAGE_TOKENS;
    let done = d
        .expect(request, PROMPT, PAGE_TOKENS, DST.to_vec(), BOUND)
        .unwrap();
    let deadline = tokio::time::Instant::now() + BOUND;
    while faults[0].counters().stuck < 1 || d.stats().landing_chunks < u64::from(chunks) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "rank 0's chunk 0 stuck, rank 1's chunks landed: {:?}",
            d.stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Rank 1's three chunks went through the one range; rank 0 wrote its chunk 0 only.
    let written = ranks[0].stats().writes;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        ranks[0].stats().writes,
        written,
        "rank 0 wrote into a range still in use"
    );
    assert_eq!(d.stats().landing_chunks, u64::from(chunks));
    assert_eq!(faults[0].release_stuck(), 1);
    landed_whole(&case, &d, done, chunks).await;
    assert_eq!(ranks[0].stats().writes, 3 * written);
    // Its chunks 1 and 2 waited (together, from when they were offered), the 300 ms at least.
    let s = ranks[0].stats();
    assert_eq!(s.landing_waits, 2, "{s:?}");
    assert!(s.landing_wait_micros >= 2 * 300_000, "{s:?}");
    d.shutdown(BOUND).await;
}

/// A landed chunk is hashed from the pages once it is copied there, as any chunk is: with one of
/// rank 0's writes of chunk 0 lost on the way (the notification says it is in place), the copy
/// carries the landing range's old bytes into the pages and the request fails as a checksum
/// mismatch of that chunk, not Complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_landed_chunk_that_does_not_match_its_checksum_fails_the_request() {
    use transfer_engine::core::tracker::{FailureReason, ViolationKind};
    let (d, ranks, faults) = two_into_one_nixl("sum").await;
    let request = RequestId(27);
    faults[0].add_send(Rule::new(
        Match::request(request).chunk(0),
        SendFault::DropWrite { index: 0 },
    ));
    for p in &ranks {
        p.offer(request, SRC.to_vec()).unwrap();
    }
    let done = d
        .expect(request, PROMPT, PAGE_TOKENS, DST.to_vec(), BOUND)
        .unwrap();
    let outcome = tokio::time::timeout(BOUND, done).await.unwrap();
    assert_eq!(
        outcome,
        Outcome::Failed(FailureReason::ProtocolViolation {
            rank: 0,
            kind: ViolationKind::ChecksumMismatch { chunk_id: 0 },
        })
    );
    let s = d.stats();
    assert_eq!(s.checksum_mismatch, 1, "{s:?}");
    assert!(s.landing_chunks >= 1, "{s:?}");
    d.shutdown(BOUND).await;
}

/// A rank waiting for decode to free a landing range waits no longer than decode's request: with
/// its chunk 0 stuck in its transport (written, not notified), decode never copies it, the request
/// times out there, and the rank's wait to write chunk 1 into the range ends in an error, not a
/// hang, while chunk 0 is still stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_a_landing_range_ends_when_decode_times_the_request_out() {
    let (d, ranks, faults) = two_into_one_nixl_in("bound", 1, 1).await;
    let request = RequestId(25);
    faults[0].add_send(Rule::new(
        Match::request(request).chunk(0),
        SendFault::Stuck,
    ));
    let done = d
        .expect(
            request,
            PROMPT,
            PAGE_TOKENS,
            DST.to_vec(),
            // Longer than the rank takes to post chunk 0 on a loaded machine.
            Duration::from_secs(3),
        )
        .unwrap();
    let send = |c: u32| {
        let p = ranks[0].clone();
        tokio::spawn(async move { p.send_chunk(request, c, &SRC, false).await })
    };
    let first = send(0);
    let deadline = tokio::time::Instant::now() + BOUND;
    while faults[0].counters().stuck < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "chunk 0 never posted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let second = send(1);
    assert_eq!(
        tokio::time::timeout(BOUND, done).await.unwrap(),
        Outcome::Failed(transfer_engine::core::tracker::FailureReason::Timeout)
    );
    let sent = tokio::time::timeout(BOUND, second)
        .await
        .expect("chunk 1 still waits for its range after decode timed the request out")
        .unwrap();
    assert!(
        matches!(sent, Err(EngineError::RequestFailed { .. })),
        "{sent:?}"
    );
    assert!(!first.is_finished(), "chunk 0 was meant to be still stuck");
    assert_eq!(faults[0].release_stuck(), 1);
    let _ = tokio::time::timeout(BOUND, first).await.unwrap();
    d.shutdown(BOUND).await;
}

/// A duplicate of a chunk's notification that comes after a later chunk reused the chunk's landing
/// range is not copied again (it would put the later chunk's rows into the earlier chunk's pages):
/// decode copies each chunk once. One slot, three chunks; the first chunk 0 notification decode
/// receives comes again after four more, by when its rank's chunk 1 was written into the range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_duplicate_notification_does_not_copy_a_reused_range_again() {
    let case = TWO_INTO_ONE;
    let (d, ranks, faults) = two_into_one_nixl_in("replay", 1, 1).await;
    let request = RequestId(23);
    faults[2].add_recv(
        Rule::new(
            Match::request(request).chunk(0),
            RecvFault::Replay { after: 4 },
        )
        .times(1),
    );
    let chunks = PROMPT / PAGE_TOKENS;
    let done = d
        .expect(request, PROMPT, PAGE_TOKENS, DST.to_vec(), BOUND)
        .unwrap();
    let sending: Vec<_> = ranks
        .iter()
        .map(|p| {
            let p = p.clone();
            tokio::spawn(async move {
                for c in 0..chunks {
                    p.send_chunk(request, c, &SRC, c + 1 == chunks).await?;
                }
                Ok::<(), EngineError>(())
            })
        })
        .collect();
    assert_eq!(
        tokio::time::timeout(BOUND, done).await.unwrap(),
        Outcome::Complete
    );
    for s in sending {
        s.await.unwrap().unwrap();
    }
    // The copy came, and changed nothing.
    let deadline = tokio::time::Instant::now() + BOUND;
    while faults[2].counters().released_held < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the duplicate never came"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    check_heads(&case, &d, 0, &DST);
    assert_eq!(d.stats().landing_chunks, 2 * u64::from(chunks));
    d.shutdown(BOUND).await;
}

/// Landing memory lent for a request stays lent while a rank may still write into it: a request
/// aborted while one prefill rank's chunk is stuck in its transport keeps its ranges through its
/// quarantine (another request meanwhile gets ranges of its own and lands whole), and they come
/// back once the rank's writes are over and it acknowledged the abort.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn landing_memory_stays_lent_until_every_rank_confirmed_its_writes_are_over() {
    let case = TWO_INTO_ONE;
    let (d, ranks, faults) = two_into_one_nixl("landing").await;
    d.wait_for_ranks(BOUND).await.unwrap();
    let chunks = PROMPT.div_ceil(CHUNK);
    let send = |p: &PrefillEngine, r: RequestId| {
        let p = p.clone();
        tokio::spawn(async move {
            for c in 0..chunks {
                let _ = p.send_chunk(r, c, &SRC, c + 1 == chunks).await;
            }
        })
    };
    // Rank 0's first chunk of request 6 stays in its transport: its writes land, its
    // notification and completion wait for `release_stuck`.
    let stuck = RequestId(6);
    faults[0].add_send(Rule::new(Match::request(stuck).chunk(0), SendFault::Stuck));
    let done = d.expect(stuck, PROMPT, CHUNK, DST.to_vec(), BOUND).unwrap();
    let lent = d.stats().landing_lent;
    assert!(lent > 0, "{:?}", d.stats());
    let sending: Vec<_> = ranks.iter().map(|p| send(p, stuck)).collect();
    let deadline = tokio::time::Instant::now() + BOUND;
    while faults[0].counters().stuck < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "rank 0's chunk never got stuck"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    d.abort(stuck);
    assert!(matches!(
        tokio::time::timeout(BOUND, done).await.unwrap(),
        Outcome::Failed(_)
    ));
    // Rank 0 cannot acknowledge yet: the request is quarantined and keeps its ranges.
    assert_eq!(d.quarantined(), vec![stuck]);
    assert_eq!(d.stats().landing_lent, lent);
    // Another request, into other pages, meanwhile: ranges of its own, every byte in place.
    let other = RequestId(7);
    let dst: Vec<u32> = vec![1, 2, 4];
    let done = d.expect(other, PROMPT, CHUNK, dst.clone(), BOUND).unwrap();
    assert_eq!(d.stats().landing_lent, 2 * lent);
    for p in &ranks {
        send(p, other).await.unwrap();
    }
    assert_eq!(
        tokio::time::timeout(BOUND, done).await.unwrap(),
        Outcome::Complete
    );
    check_heads(&case, &d, 0, &dst);
    assert_eq!(d.stats().landing_lent, lent);
    // Rank 0's writes end; it acknowledges; the ranges come back with the pages.
    assert_eq!(faults[0].release_stuck(), 1);
    tokio::time::timeout(BOUND, d.released(stuck))
        .await
        .unwrap();
    assert_eq!(d.stats().landing_lent, 0);
    assert!(d.quarantined().is_empty());
    for s in sending {
        let _ = tokio::time::timeout(BOUND, s).await;
    }
    d.shutdown(BOUND).await;
}
