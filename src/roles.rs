//! `kvbench decode` and `kvbench prefill`: the same workload with every engine in its own process.
//!
//! The decode process drives: it waits for every rank, issues the requests (`--concurrency` at a time)
//! and verifies each against the pattern the prefill processes filled their pools with. A prefill
//! process serves whatever page allocations arrive, and exits when the decode process closes.

use crate::bench::{Report, Verify, Workload};
use crate::cluster::{pattern, verify_pattern};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use transfer_engine::core::planner::{KvLayout, PpSplit};
use transfer_engine::core::{FailureCode, RequestId};
use transfer_engine::engine::{
    BackendConfig, DecodeConfig, DecodeEngine, Outcome, Pool, PrefillConfig, PrefillEngine,
};
use transfer_engine::mem::{HostBuffer, HostOptions};
use transfer_engine::transport::BackendKind;

fn ranks_of(w: &Workload) -> Result<Vec<std::ops::Range<u32>>, String> {
    (0..w.pp)
        .map(|r| {
            PpSplit::SglangEven
                .layer_range(w.shape.layers, w.pp, r)
                .map_err(|e| e.to_string())
        })
        .collect()
}

/// Runs the decode role and returns its report.
///
/// # Errors
/// Engine failures, as text.
pub async fn run_decode(
    listen: SocketAddr,
    w: &Workload,
    backend: BackendKind,
) -> Result<Report, String> {
    let pages = w.pages();
    let decode_pages = pages * w.concurrency;
    let layout = KvLayout::packed(
        0,
        w.shape.layers,
        w.shape.regions,
        w.shape.page_bytes(),
        decode_pages,
    );
    let mut cfg = DecodeConfig::new(w.shape.layers, w.shape.page_tokens, layout.clone(), w.pp);
    cfg.listen = listen;
    cfg.backend = BackendConfig::default_for(backend, "decode");
    cfg.verify_checksums = w.checksums;
    let pool = HostBuffer::new(layout.buffer_len as usize, HostOptions::default())
        .map_err(|e| e.to_string())?;
    let decode = Arc::new(
        DecodeEngine::start(cfg, Pool::Owned(pool))
            .await
            .map_err(|e| e.to_string())?,
    );
    eprintln!("kvbench decode: listening on {}", decode.local_addr());
    decode
        .wait_for_ranks(Duration::from_secs(120))
        .await
        .map_err(|e| e.to_string())?;
    let ranks = ranks_of(w)?;
    let src: Vec<u32> = (0..pages).collect();
    let started = Instant::now();
    let mut latencies = Vec::new();
    let (mut failed, mut verified, mut issued) = (0u64, w.verify != Verify::None, 0u64);
    let mut after_failure = 0u64;
    let mut set = tokio::task::JoinSet::new();
    let spawn = |set: &mut tokio::task::JoinSet<_>, id: u64, slot: u32| -> Result<(), String> {
        let dst = w.dst_pages(slot);
        let t0 = Instant::now();
        let fut = decode
            .expect(
                RequestId(id + 1),
                w.prompt_tokens,
                w.chunk_tokens,
                dst,
                w.request_timeout,
            )
            .map_err(|e| e.to_string())?;
        set.spawn(async move { (slot, fut.await, t0.elapsed()) });
        Ok(())
    };
    for slot in 0..w.concurrency.min(w.requests) {
        spawn(&mut set, issued, slot)?;
        issued += 1;
    }
    while let Some(r) = set.join_next().await {
        let (slot, outcome, latency) = r.map_err(|e| e.to_string())?;
        match outcome {
            Outcome::Complete => {
                after_failure += 1;
                // Progress, for tests that inject a fault mid-run (KVBENCH_LOG=kvbench::roles=debug).
                tracing::debug!(completed = latencies.len() + 1, "request complete");
                latencies.push(latency.as_secs_f64() * 1e6);
                if w.verify != Verify::None {
                    let dst = w.dst_pages(slot);
                    if let Err(e) = verify_pattern(
                        w.shape,
                        &ranks,
                        pages,
                        &decode,
                        decode_pages,
                        w.prompt_tokens,
                        &src,
                        &dst,
                    ) {
                        eprintln!("kvbench decode: verification failed: {e}");
                        verified = false;
                    }
                }
            }
            Outcome::Failed(reason) => {
                eprintln!("kvbench decode: request failed: {reason:?}");
                failed += 1;
                after_failure = 0;
                verified = false;
            }
        }
        if issued < u64::from(w.requests) {
            spawn(&mut set, issued, slot)?;
            issued += 1;
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    let ok = (issued - failed) as f64;
    let pct = |p: f64| {
        latencies
            .get(((latencies.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    Ok(Report {
        backend: backend.to_string(),
        gbps: ok * w.shape.request_bytes(w.prompt_tokens) as f64 / elapsed / 1e9,
        baseline_gbps: 0.0,
        baseline: "none (multi-process)".into(),
        ratio: 0.0,
        stream_gbps: 0.0,
        stream_ratio: 0.0,
        memcpy_gbps: 0.0,
        requests_per_s: ok / elapsed,
        latency_p50_us: pct(0.5),
        latency_p99_us: pct(0.99),
        complete_p50_us: 0.0,
        complete_p99_us: 0.0,
        chunks_per_s: ok * f64::from(w.prompt_tokens.div_ceil(w.chunk_tokens)) * f64::from(w.pp)
            / elapsed,
        writes_per_s: ok * w.writes_per_request() as f64 / elapsed,
        baseline_msg_rate: 0.0,
        requests: issued,
        failed,
        completed_after_last_failure: after_failure,
        verified: verified && failed == 0,
    })
}

/// Runs one prefill rank until the decode process closes.
///
/// # Errors
/// Engine failures, as text.
pub async fn run_prefill(
    connect: SocketAddr,
    rank: u16,
    peers: Vec<SocketAddr>,
    w: &Workload,
    backend: BackendKind,
) -> Result<(), String> {
    let ranks = ranks_of(w)?;
    let range = ranks
        .get(usize::from(rank))
        .ok_or(format!("--pp-rank {rank} is not below --pp-size {}", w.pp))?;
    let pages = w.pages();
    let layout = KvLayout::packed(
        range.start,
        range.len() as u32,
        w.shape.regions,
        w.shape.page_bytes(),
        pages,
    );
    let mut cfg = PrefillConfig::new(
        connect,
        rank,
        w.pp,
        w.shape.layers,
        w.shape.page_tokens,
        layout.clone(),
    );
    cfg.backend =
        BackendConfig::default_for(backend, &format!("prefill-{rank}-{}", std::process::id()));
    cfg.peers = peers;
    cfg.checksums = w.checksums;
    cfg.connect_timeout = Duration::from_secs(60);
    let mut buf = HostBuffer::new(layout.buffer_len as usize, HostOptions::default())
        .map_err(|e| e.to_string())?;
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = pattern(rank, i as u64);
    }
    let engine = PrefillEngine::start(cfg, Pool::Owned(buf))
        .await
        .map_err(|e| e.to_string())?;
    let src: Arc<Vec<u32>> = Arc::new((0..pages).collect());
    while let Some(req) = engine.next_request().await {
        let (e, src) = (engine.clone(), src.clone());
        tokio::spawn(async move {
            let chunks = req.prompt_tokens.div_ceil(req.chunk_tokens);
            for c in 0..chunks {
                if let Err(err) = e.send_chunk(req.request, c, &src, c + 1 == chunks).await {
                    eprintln!("kvbench prefill {}: {err}", e.pp_rank());
                    e.fail(req.request, FailureCode::WriteFailed);
                    return;
                }
            }
            e.decided(req.request).await;
            e.release(req.request);
        });
    }
    Ok(())
}
