//! End to end over real loopback UCX and NIXL in one process: four prefill PP engines and one decode
//! engine, MLA and GQA shapes, prompts that are and are not multiples of the page and chunk sizes,
//! concurrent requests, and every destination byte checked.
#![allow(clippy::unwrap_used)]

use kvbench::cluster::{Cluster, ClusterSpec, PoolKind, Shape};
use std::time::Duration;
use transfer_engine::core::RequestId;
use transfer_engine::engine::Outcome;
use transfer_engine::transport::BackendKind;

fn spec(shape: Shape, backend: BackendKind) -> ClusterSpec {
    ClusterSpec {
        shape,
        pp: 4,
        // The three prompts below use destination pages 7..61 and source pages 0..28; the pools are
        // kept near that so the pattern fill stays cheap in debug builds.
        decode_pages: 64,
        prefill_pages: 32,
        backend,
        checksums: true,
        decode_pool: PoolKind::Shared,
        metrics: None,
        decode_progress: Default::default(),
    }
}

/// Runs three prompt lengths concurrently with scattered destination pages, then checks every byte.
async fn three_prompts(shape: Shape, backend: BackendKind) {
    let c = tokio::time::timeout(
        Duration::from_secs(30),
        Cluster::start(spec(shape, backend)),
    )
    .await
    .expect("cluster did not start within 30 s")
    .unwrap();
    let chunk = shape.page_tokens * 4;
    // A multiple of the chunk, a multiple of the page only, and neither.
    let prompts = [
        chunk * 3,
        shape.page_tokens * 5,
        chunk * 2 + shape.page_tokens / 2 + 3,
    ];
    let mut runs = Vec::new();
    let mut pages = Vec::new();
    let (mut next_src, mut next_dst) = (1u32, 7u32);
    for (i, &tokens) in prompts.iter().enumerate() {
        let n = shape.pages_for(tokens);
        // Source pages in reverse and destination pages strided, so nothing lines up by accident;
        // no two requests share a source page, since each writes its own pattern into them while
        // the others are in flight.
        let src: Vec<u32> = (0..n).rev().map(|p| next_src + p).collect();
        let dst: Vec<u32> = (0..n).map(|p| next_dst + 2 * p).collect();
        next_src += n;
        next_dst += 2 * n + 1;
        let request = RequestId(100 + i as u64);
        pages.push((request, tokens, dst.clone()));
        let c = &c;
        // run_request writes each request's own pattern and poisons its pages first.
        runs.push(async move { c.run_request(request, tokens, chunk, &src, &dst).await });
    }
    let outcomes = tokio::time::timeout(Duration::from_secs(30), futures::future::join_all(runs))
        .await
        .expect("three requests did not end within 30 s");
    for (o, (request, tokens, dst)) in outcomes.into_iter().zip(&pages) {
        assert_eq!(o.unwrap(), Outcome::Complete);
        let checked = c.verify(*request, dst).unwrap();
        assert_eq!(checked, shape.request_bytes(*tokens));
    }
    let stats = c.decode.stats();
    assert_eq!(stats.completed, 3);
    assert_eq!(stats.failed, 0);
    assert_eq!(stats.checksum_mismatch, 0);
    assert_eq!(stats.in_flight, 0);
    for p in &c.prefill {
        assert_eq!(p.stats().decided_completed, 3);
        assert_eq!(p.stats().undecided, 0);
        assert_eq!(p.transport_stats().in_flight, 0);
    }
    c.wait_quiescent(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mla_four_pp_ranks_ucx() {
    three_prompts(Shape::MLA, BackendKind::Ucx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gqa_four_pp_ranks_ucx() {
    three_prompts(Shape::GQA, BackendKind::Ucx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mla_four_pp_ranks_nixl() {
    three_prompts(Shape::MLA, BackendKind::Nixl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gqa_four_pp_ranks_nixl() {
    three_prompts(Shape::GQA, BackendKind::Nixl).await;
}

/// `kvbench --prefill-instances N --decode-instances M`: N prefill pipelines of PP 2 into M decode
/// engines, requests to each pair in turn, every request verified on poisoned pages; every engine's
/// transport holds one registration for all its peers, every decode has every prefill rank
/// connected, every prefill rank is linked to every decode.
async fn grid(backend: BackendKind, instances: u16, decodes: u16) {
    use kvbench::bench::{Verify, Workload, run_workload};
    // Small, so that the debug build's pattern fills and checks stay quick beside other tests.
    let shape = Shape {
        layers: 8,
        bytes_per_token: 1024,
        page_tokens: 16,
        regions: transfer_engine::core::planner::RegionKind::SplitKv,
    };
    let w = Workload {
        shape,
        pp: 2,
        prompt_tokens: 128,
        chunk_tokens: 64,
        requests: 2 * u32::from(instances * decodes),
        concurrency: u32::from(instances * decodes),
        verify: Verify::All,
        checksums: true,
        duration: None,
        scatter: false,
        request_timeout: Duration::from_secs(30),
        decode_pool: PoolKind::Shared,
        prefill_instances: instances,
        decode_instances: decodes,
        metrics: None,
        metrics_linger: Duration::ZERO,
        decode_progress: Default::default(),
        tp: None,
    };
    let r = tokio::time::timeout(Duration::from_secs(120), run_workload(&w, backend, None))
        .await
        .expect("the run did not end within 120 s")
        .unwrap();
    assert!(r.verified && r.failed == 0, "{r:?}");
    assert_eq!(
        r.verified_requests,
        2 * u64::from(instances * decodes),
        "{r:?}"
    );
    eprintln!(
        "{instances} prefill instances x {decodes} decodes: {} registration(s) per engine at most, \
         {} prefill ranks per decode, {} decodes per prefill rank",
        r.registrations_per_process, r.connections_per_decode, r.decodes_per_prefill_rank
    );
    assert_eq!(
        (
            r.prefill_instances,
            r.decode_instances,
            r.registrations_per_process,
            r.connections_per_decode,
            r.decodes_per_prefill_rank
        ),
        (
            u64::from(instances),
            u64::from(decodes),
            1,
            2 * u64::from(instances),
            u64::from(decodes)
        ),
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_prefill_instances_into_one_decode_engine_ucx() {
    grid(BackendKind::Ucx, 3, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_prefill_instances_into_one_decode_engine_nixl() {
    grid(BackendKind::Nixl, 3, 1).await;
}

/// The scale test: four prefill instances at PP 2 and two decode instances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_prefill_instances_and_two_decode_instances_ucx() {
    grid(BackendKind::Ucx, 4, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_prefill_instances_and_two_decode_instances_nixl() {
    grid(BackendKind::Nixl, 2, 2).await;
}

/// `kvbench --prefill-tp/--decode-tp`: GQA heads sliced from prefill TP 2 into decode TP 1 and
/// from 1 into 2 at PP 2, and MLA latents from TP 2 into 1, every byte of every decode rank's
/// pages checked against the heads it holds.
async fn tp_run(
    prefill_tp: u16,
    decode_tp: u16,
    kv_heads: u32,
    backend: BackendKind,
    decode_page_tokens: u32,
) {
    tp_grid(
        prefill_tp,
        decode_tp,
        kv_heads,
        backend,
        decode_page_tokens,
        (1, 1),
    )
    .await;
}

/// [`tp_run`] with `instances` (prefill, decode) instances, requests going to each pair in turn.
async fn tp_grid(
    prefill_tp: u16,
    decode_tp: u16,
    kv_heads: u32,
    backend: BackendKind,
    decode_page_tokens: u32,
    (prefill_instances, decode_instances): (u16, u16),
) {
    use kvbench::tp::{TpCluster, TpSpec};
    let shape = Shape {
        layers: 4,
        bytes_per_token: if kv_heads == 0 { 576 } else { 1024 },
        page_tokens: 16,
        regions: if kv_heads == 0 {
            transfer_engine::core::planner::RegionKind::Fused
        } else {
            transfer_engine::core::planner::RegionKind::SplitKv
        },
    };
    let spec = TpSpec {
        shape,
        kv_heads,
        pp: 2,
        prefill_tp,
        decode_tp,
        decode_page_tokens,
        // Whole pages of every size used where the sizes differ (so every page is checked whole).
        prompt_tokens: if decode_page_tokens == 16 { 100 } else { 96 },
        chunk_tokens: 32,
        concurrency: 2,
        // Every (prefill, decode) pair at least once.
        requests: 4.max(u32::from(prefill_instances * decode_instances)),
        prefill_instances,
        decode_instances,
        backend,
        decode_progress: Default::default(),
    };
    let run = async {
        let c = TpCluster::start(spec).await.unwrap();
        let r = c.run(None).await;
        c.shutdown().await;
        r
    };
    let r = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the run did not end within 120 s")
        .unwrap();
    let requests = 4.max(u64::from(prefill_instances * decode_instances));
    assert!(r.verified && r.requests == requests, "{r:?}");
    // One engine per decode TP rank and per prefill (PP, TP) rank that writes (with MLA, one
    // prefill rank writes each decode rank's latent), each pool registered once.
    let writers = if kv_heads == 0 {
        prefill_tp.min(decode_tp)
    } else {
        prefill_tp
    };
    assert_eq!(
        r.engines,
        u64::from(decode_instances * decode_tp + prefill_instances * 2 * writers),
        "{r:?}"
    );
    assert_eq!(r.registrations_per_process, 1, "{r:?}");
    // Sliced heads are writes of many rows (a page's tokens at least, consecutive pages
    // continuing the rows), not a write per row.
    if kv_heads > 0 {
        let rows = u64::from(decode_page_tokens.min(16));
        assert!(r.rows_per_request >= rows * r.writes_per_request, "{r:?}");
    }
    assert_eq!(
        (r.prefill_page_tokens, r.decode_page_tokens),
        (16, decode_page_tokens)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvbench_tp_runs_check_every_decode_ranks_heads() {
    tp_run(2, 1, 4, BackendKind::Ucx, 16).await;
    tp_run(1, 2, 4, BackendKind::Ucx, 16).await;
    tp_run(2, 1, 0, BackendKind::Nixl, 16).await;
}

/// `--prefill-instances 2 --decode-instances 2` with TP sizes that differ, in one process: every
/// prefill rank serves the ranks it writes into of both decode instances from its one engine, and
/// every decode rank serves both prefill instances; each pair's requests are checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvbench_tp_runs_serve_several_instances_of_each_side() {
    tp_grid(2, 1, 4, BackendKind::Ucx, 16, (2, 2)).await;
    tp_grid(1, 2, 4, BackendKind::Nixl, 16, (2, 2)).await;
}

/// `--decode-page-tokens`: prefill's 16-token pages into decode pages of 32 and of 8, with TP
/// sliced both ways and MLA's latent rows, every decode byte checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvbench_tp_runs_map_pages_of_other_sizes() {
    tp_run(2, 1, 4, BackendKind::Ucx, 32).await;
    tp_run(1, 2, 4, BackendKind::Nixl, 8).await;
    tp_run(1, 1, 0, BackendKind::Ucx, 48).await;
}

/// What the TP run cannot do (it counts requests in contiguous pages) is refused in one process as
/// with `--processes`, not ignored.
#[test]
fn a_tp_run_refuses_duration_and_scatter() {
    for extra in ["--duration 1", "--scatter"] {
        let args = format!("--model gqa --prefill-tp 2 --decode-tp 1 --requests 1 {extra}");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvbench"))
            .args(args.split_whitespace())
            .env("UCX_MODULES", "^efa")
            .output()
            .expect("kvbench runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra}: {stderr}");
        assert!(stderr.contains("no --duration, no --scatter"), "{stderr}");
    }
}
