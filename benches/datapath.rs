//! The loopback data path through the whole engine (four prefill PP engines, one decode engine, real
//! UCX, notifications and tracker) at two page sizes, as request throughput in bytes.
//!
//! Run: `cargo bench --bench datapath -- --warm-up-time 1 --measurement-time 5`.
#![allow(missing_docs)]

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvbench::bench::{Verify, Workload, run_workload};
use kvbench::cluster::Shape;
use std::time::Duration;
use transfer_engine::core::planner::RegionKind;
use transfer_engine::transport::BackendKind;

/// GQA-like: 32 layers, 4 KiB per token per layer, as K and V; `page_tokens` sets the page size.
fn shape(page_tokens: u32) -> Shape {
    Shape {
        layers: 32,
        bytes_per_token: 4096,
        page_tokens,
        regions: RegionKind::SplitKv,
    }
}

fn datapath(c: &mut Criterion) {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => panic!("tokio runtime: {e}"),
    };
    let mut g = c.benchmark_group("datapath");
    g.sample_size(10);
    // Pages of 4 KiB (2 tokens x 2 KiB) and 64 KiB (32 tokens x 2 KiB) per layer and region,
    // scattered so that every page is a write of its own.
    for page_tokens in [2u32, 32] {
        let w = Workload {
            shape: shape(page_tokens),
            pp: 4,
            prompt_tokens: 2048,
            chunk_tokens: 512,
            requests: 4,
            concurrency: 2,
            verify: Verify::None,
            checksums: false,
            duration: None,
            scatter: true,
            request_timeout: Duration::from_secs(60),
            decode_pool: kvbench::cluster::PoolKind::Shared,
            prefill_instances: 1,
            decode_instances: 1,
            metrics: None,
            metrics_linger: Duration::ZERO,
            decode_progress: Default::default(),
            tp: None,
        };
        let page_kib = shape(page_tokens).page_bytes() / 1024;
        g.throughput(Throughput::Bytes(
            w.shape.request_bytes(w.prompt_tokens) * u64::from(w.requests),
        ));
        g.bench_function(format!("ucx_{page_kib}KiB_pages_4_requests"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let r = match rt.block_on(run_workload(&w, BackendKind::Ucx, None)) {
                        Ok(r) => r,
                        Err(e) => panic!("workload failed: {e}"),
                    };
                    assert_eq!(r.failed, 0);
                    let bytes = w.shape.request_bytes(w.prompt_tokens) as f64 * r.requests as f64;
                    total += Duration::from_secs_f64(bytes / (r.gbps * 1e9));
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group!(benches, datapath);
criterion_main!(benches);
