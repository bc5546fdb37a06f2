//! A pipelined decode (PP 2, as SGLang allows beside a prefill of PP 2) over real loopback UCX and
//! NIXL: one decode engine per stage, holding its stage's layers only, each taking them from the
//! prefill PP rank of its stage, and speaking for those layers only. Every byte is checked on
//! poisoned destination pages; every wait is bounded.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;
use transfer_engine::control::Secret;
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::{KvLayout, PpSplit, RegionKind};
use transfer_engine::engine::{
    BackendConfig, DecodeConfig, DecodeEngine, DecodeStage, EngineError, Expected, Outcome, Pool,
    PrefillConfig, PrefillEngine,
};
use transfer_engine::mem::{HostBuffer, HostOptions};
use transfer_engine::transport::BackendKind;

const LAYERS: u32 = 5;
const PP: u16 = 2;
const PAGE_TOKENS: u32 = 16;
const PAGE_BYTES: u64 = 256;
const DECODE_PAGES: u32 = 32;
const PREFILL_PAGES: u32 = 16;
const PROMPT: u32 = 80;
const CHUNK: u32 = 32;
const POISON: u8 = 0x3C;
const SECRET: &[u8] = b"decode-stages test secret, 32 b.";
const BOUND: Duration = Duration::from_secs(10);
const INSTANCE: &str = "p";

/// Stage `stage`'s layers, split as SGLang splits them (2 and 3 of 5).
fn stage_layout(stage: u16) -> KvLayout {
    let r = PpSplit::SglangEven.layer_range(LAYERS, PP, stage).unwrap();
    KvLayout::packed(
        r.start,
        r.len() as u32,
        RegionKind::Fused,
        PAGE_BYTES,
        DECODE_PAGES,
    )
}

/// Byte `at` of page `page` of layer `layer` of request `tag`'s source.
fn pattern(tag: u8, layer: u32, page: u32, at: u64) -> u8 {
    let x = u64::from(tag) * 1_000_003 + u64::from(layer) * 7919 + u64::from(page) * 104_729 + at;
    (x ^ (x >> 7)).wrapping_mul(31) as u8
}

async fn stage(backend: BackendKind, stage: u16, tag: &str) -> DecodeEngine {
    let layout = stage_layout(stage);
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout.clone(), 0);
    cfg.stage = DecodeStage {
        rank: stage,
        size: PP,
    };
    cfg.engine_id = format!("decode-stage-{stage}");
    cfg.backend = BackendConfig::default_for(backend, &format!("d{stage}-{tag}"));
    cfg.token = Some(Secret::new(SECRET));
    cfg.abort_ack_timeout = Duration::from_millis(500);
    let mut b = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
    b.as_mut_slice().fill(POISON);
    let d = DecodeEngine::start(cfg, Pool::Owned(b)).await.unwrap();
    d.add_instance(INSTANCE, PP, 1).unwrap();
    d
}

/// Prefill PP rank `rank` of the pipeline, its decode `decode`, its pool patterned with `tag`.
fn rank_config(
    backend: BackendKind,
    rank: u16,
    decode: std::net::SocketAddr,
    mesh: &(
        Vec<std::sync::Arc<transfer_engine::engine::MeshSocket>>,
        Vec<std::net::SocketAddr>,
    ),
    tag: &str,
) -> (PrefillConfig, HostBuffer) {
    let (layout, buf) =
        common::patterned_rank(LAYERS, PP, rank, PAGE_BYTES, PREFILL_PAGES, |l, p, at| {
            pattern(1, l, p, at)
        });
    let mut cfg = PrefillConfig::new(decode, rank, PP, LAYERS, PAGE_TOKENS, layout);
    cfg.instance = INSTANCE.to_owned();
    cfg.engine_id = format!("prefill-{rank}");
    cfg.backend = BackendConfig::default_for(backend, &format!("p{rank}-{tag}"));
    cfg.peers = mesh.1.clone();
    cfg.mesh_socket = mesh.0.get(usize::from(rank)).cloned();
    cfg.token = Some(Secret::new(SECRET));
    cfg.connect_timeout = Duration::from_secs(5);
    (cfg, buf)
}

/// Two decode stages and the prefill pipeline, each rank writing into the stage of its rank.
async fn pipeline(backend: BackendKind, tag: &str) -> (Vec<DecodeEngine>, Vec<PrefillEngine>) {
    let stages = vec![stage(backend, 0, tag).await, stage(backend, 1, tag).await];
    let mesh = common::mesh_sockets(PP);
    let mut starts = Vec::new();
    for rank in 0..PP {
        let (cfg, buf) = rank_config(
            backend,
            rank,
            stages[usize::from(rank)].local_addr(),
            &mesh,
            tag,
        );
        starts.push(tokio::spawn(PrefillEngine::start(cfg, Pool::Owned(buf))));
    }
    let mut ranks = Vec::new();
    for s in starts {
        ranks.push(s.await.unwrap().unwrap());
    }
    for d in &stages {
        d.wait_for_instance(INSTANCE, BOUND).await.unwrap();
    }
    (stages, ranks)
}

fn want(dst: &[u32]) -> Expected {
    Expected {
        instance: INSTANCE.into(),
        prefix_tokens: 0,
        prompt_tokens: PROMPT,
        chunk_tokens: CHUNK,
        dst_pages: dst.to_vec(),
        timeout: BOUND,
    }
}

async fn send(rank: &PrefillEngine, request: RequestId, src: &[u32]) {
    let last = PROMPT.div_ceil(CHUNK) - 1;
    for chunk in 0..=last {
        rank.send_chunk(request, chunk, src, chunk == last)
            .await
            .unwrap();
    }
}

/// Stage `s`'s `dst` pages hold the source's `src` pages in each of its layers.
fn assert_landed(d: &DecodeEngine, s: u16, src: &[u32], dst: &[u32]) {
    let layout = stage_layout(s);
    let mut page = vec![0u8; PAGE_BYTES as usize];
    for (i, layer) in layout.layers().enumerate() {
        for (&from, &to) in src.iter().zip(dst) {
            let off = (i as u64 * u64::from(DECODE_PAGES) + u64::from(to)) * PAGE_BYTES;
            d.read_pool(off, &mut page).unwrap();
            let expected: Vec<u8> = (0..PAGE_BYTES)
                .map(|at| pattern(1, layer, from, at))
                .collect();
            assert!(
                page == expected,
                "stage {s}: layer {layer} page {to} does not hold page {from}"
            );
        }
    }
}

fn assert_poisoned(d: &DecodeEngine, s: u16, dst: &[u32]) {
    let layers = stage_layout(s).num_layers;
    common::assert_poisoned(d, (layers, DECODE_PAGES, PAGE_BYTES), POISON, dst);
}

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("did not finish within the bound")
}

async fn each_stage_takes_its_layers(backend: BackendKind) {
    let tag = format!("{backend}-{}", std::process::id());
    let (stages, ranks) = pipeline(backend, &tag).await;
    // Two requests at once; each stage's pages of a request are its own (SGLang's stages
    // allocate alike, but nothing here relies on it).
    let src = [[0u32, 1, 2, 3, 4], [9, 8, 7, 6, 5]];
    let dst = [
        [[3u32, 4, 5, 6, 7], [10, 11, 12, 13, 14]],
        [[20u32, 21, 22, 23, 24], [1, 2, 25, 26, 27]],
    ];
    let requests = [RequestId(100), RequestId(200)];
    let mut done = Vec::new();
    for (r, &request) in requests.iter().enumerate() {
        for (s, d) in stages.iter().enumerate() {
            done.push((s, r, d.expect_request(request, want(&dst[s][r])).unwrap()));
        }
    }
    for (r, &request) in requests.iter().enumerate() {
        tokio::join!(
            send(&ranks[0], request, &src[r]),
            send(&ranks[1], request, &src[r])
        );
    }
    for (s, r, f) in done {
        assert_eq!(
            bounded(f).await,
            Outcome::Complete,
            "{backend}: stage {s}, request {r}"
        );
    }
    for (s, d) in stages.iter().enumerate() {
        for r in 0..2 {
            assert_landed(d, s as u16, &src[r], &dst[s][r]);
        }
        assert_poisoned(d, s as u16, &[0, 15, 16, 31]);
        assert_eq!(d.stats().connected_ranks, 1, "{backend}: stage {s}");
    }
    for s in stages {
        s.shutdown(BOUND).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_decode_stage_takes_its_layers_from_its_prefill_rank_over_ucx() {
    each_stage_takes_its_layers(BackendKind::Ucx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_decode_stage_takes_its_layers_from_its_prefill_rank_over_nixl() {
    each_stage_takes_its_layers(BackendKind::Nixl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_speaks_for_its_own_layers_only() {
    // Rank 1 fails its part: stage 1 fails the request; stage 0, whose rank wrote all of its
    // layers, completes it (the caller agrees across its stages, as SGLang's decode does).
    let tag = format!("fail-{}", std::process::id());
    let (stages, ranks) = pipeline(BackendKind::Ucx, &tag).await;
    let request = RequestId(300);
    let (src, dst) = ([0u32, 1, 2, 3, 4], [[3u32, 4, 5, 6, 7], [8, 9, 10, 11, 12]]);
    let f0 = stages[0].expect_request(request, want(&dst[0])).unwrap();
    let f1 = stages[1].expect_request(request, want(&dst[1])).unwrap();
    bounded(ranks[1].next_request()).await.unwrap();
    ranks[1].fail(request, transfer_engine::core::FailureCode::Internal);
    send(&ranks[0], request, &src).await;
    assert_eq!(bounded(f0).await, Outcome::Complete);
    assert_landed(&stages[0], 0, &src, &dst[0]);
    let outcome = bounded(f1).await;
    assert!(
        matches!(outcome, Outcome::Failed(_)),
        "stage 1: {outcome:?}"
    );
    assert_poisoned(&stages[1], 1, &dst[1]);
    for s in stages {
        s.shutdown(BOUND).await;
    }
}

/// etcd's word that a prefill PP rank is gone (`evict_in`, as `discovery::watch_decode` calls it)
/// names the rank by its PP rank: the stage that takes it evicts it, and readmits it; the other
/// stage has no such rank. Each stage lists its connected rank by its PP rank too (what
/// `discovery::reconcile_decode` hands back to `evict_in`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_evicts_and_readmits_its_rank_by_its_pp_rank() {
    let tag = format!("evict-{}", std::process::id());
    let (stages, ranks) = pipeline(BackendKind::Ucx, &tag).await;
    let inc = ranks[1].incarnation();
    for (stage, rank) in stages.iter().zip(&ranks) {
        assert_eq!(
            stage.connected_ranks(),
            vec![(INSTANCE.to_string(), rank.pp_rank(), rank.incarnation())]
        );
    }
    assert!(
        !stages[0].evict_in(INSTANCE, 1, inc),
        "stage 0 evicted stage 1's rank"
    );
    assert!(
        stages[1].evict_in(INSTANCE, 1, inc),
        "stage 1 did not evict its PP rank 1"
    );
    assert!(stages[1].readmit_in(INSTANCE, 1, inc));
    // The stage serves again.
    let request = RequestId(400);
    let (src, dst) = ([0u32, 1, 2, 3, 4], [3u32, 4, 5, 6, 7]);
    let f = stages[1].expect_request(request, want(&dst)).unwrap();
    let f0 = stages[0]
        .expect_request(request, want(&[8, 9, 10, 11, 12]))
        .unwrap();
    send(&ranks[0], request, &src).await;
    send(&ranks[1], request, &src).await;
    assert_eq!(bounded(f).await, Outcome::Complete);
    assert_eq!(bounded(f0).await, Outcome::Complete);
    assert_landed(&stages[1], 1, &src, &dst);
    for s in stages {
        s.shutdown(BOUND).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_refuses_another_stages_rank_and_another_pipeline_size() {
    let tag = format!("refuse-{}", std::process::id());
    let d = stage(BackendKind::Ucx, 0, &tag).await;
    // A pipeline of another size than the decode's stages cannot be added.
    let err = d.add_instance("three", 3, 1).unwrap_err();
    assert!(
        matches!(&err, EngineError::Config(m) if m.contains("stage 0 of 2")),
        "{err}"
    );
    // Prefill PP rank 1 pointed at stage 0 is refused at the handshake, naming both.
    let mesh = common::mesh_sockets(PP);
    let (mut cfg, buf) = rank_config(BackendKind::Ucx, 1, d.local_addr(), &mesh, &tag);
    cfg.connect_timeout = Duration::from_secs(2);
    let err = bounded(PrefillEngine::start(cfg, Pool::Owned(buf)))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("PP stage 0 of 2") && text.contains("PP rank 1 of 2"),
        "{text}"
    );
    assert_eq!(d.stats().connected_ranks, 0);
    d.shutdown(BOUND).await;
}
