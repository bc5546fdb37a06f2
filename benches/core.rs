//! Benchmarks of the sans-IO core: notification codec, completion tracker throughput, vote
//! board and planner, on the default workloads of DESIGN.md section 6.
//!
//! Run: `cargo bench --bench core -- --warm-up-time 1 --measurement-time 3`.
// `criterion_group!` generates undocumented public functions.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use transfer_engine::core::notify::{self, ChunkNotification, ChunkStatus, TextForm};
use transfer_engine::core::planner::{
    ChunkGeometry, KvLayout, Planner, PpSplit, RegionKind, TpMapping,
};
use transfer_engine::core::tracker::{CompletionTracker, TrackerConfig, TrackerEvent};
use transfer_engine::core::vote::{Vote, VoteBoard, VoteConfig};
use transfer_engine::core::{PeerId, RequestId};

fn codec(c: &mut Criterion) {
    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Elements(1));
    let n = ChunkNotification::new(
        RequestId(0x1234_5678_9abc),
        3,
        41,
        ChunkStatus::Last { count: 42 },
    )
    .with_checksum(0xfeed);
    let bin = n.encode();
    let text = n.encode_text(TextForm::WithPpRank).unwrap_or_default();
    g.bench_function("encode_binary", |b| {
        b.iter(|| black_box(black_box(&n).encode()))
    });
    g.bench_function("decode_binary", |b| {
        b.iter(|| black_box(notify::decode_binary(black_box(&bin[..]))))
    });
    g.bench_function("decode_any_binary", |b| {
        b.iter(|| black_box(notify::decode(black_box(&bin[..]))))
    });
    g.bench_function("encode_text", |b| {
        b.iter(|| black_box(black_box(&n).encode_text(TextForm::WithPpRank)))
    });
    g.bench_function("decode_text", |b| {
        b.iter(|| black_box(notify::decode(black_box(text.as_bytes()))))
    });
    g.finish();
}

const PP: u16 = 4;
const CHUNKS: u32 = 64;
const REQUESTS: u64 = 10_000;

/// Every notification of every request, interleaved so that all requests stay in flight until
/// the last round: chunk-major, then rank, then request.
fn workload() -> Vec<(PeerId, ChunkNotification)> {
    let mut v = Vec::with_capacity((REQUESTS * u64::from(PP) * u64::from(CHUNKS)) as usize);
    for chunk in 0..CHUNKS {
        for rank in 0..PP {
            for req in 0..REQUESTS {
                let status = if chunk + 1 == CHUNKS {
                    ChunkStatus::Last { count: CHUNKS }
                } else {
                    ChunkStatus::More
                };
                v.push((
                    PeerId(u64::from(rank)),
                    ChunkNotification::new(RequestId(req), rank, chunk, status),
                ));
            }
        }
    }
    v
}

fn fresh_tracker() -> CompletionTracker {
    let now = Instant::now();
    let mut t = CompletionTracker::new(TrackerConfig::default());
    let peers: Vec<PeerId> = (0..PP).map(|r| PeerId(u64::from(r))).collect();
    for req in 0..REQUESTS {
        let _ = t.expect(
            now,
            RequestId(req),
            PP,
            &peers,
            now + Duration::from_secs(60),
        );
    }
    t
}

fn tracker(c: &mut Criterion) {
    let work = workload();
    let wire: Vec<(PeerId, [u8; notify::RECORD_LEN])> =
        work.iter().map(|(p, n)| (*p, n.encode())).collect();
    let mut g = c.benchmark_group("tracker");
    g.throughput(Throughput::Elements(work.len() as u64));
    g.sample_size(10);
    g.bench_function("pp4_64chunks_10k_inflight", |b| {
        b.iter_batched(
            fresh_tracker,
            |mut t| {
                let now = Instant::now();
                for (p, n) in &work {
                    let _ = black_box(t.handle_notification(now, *p, n));
                }
                let mut done = 0;
                while let Some(e) = t.poll_event() {
                    done += u64::from(matches!(e, TrackerEvent::Complete { .. }));
                }
                assert_eq!(done, REQUESTS);
                t
            },
            BatchSize::PerIteration,
        )
    });
    g.bench_function("pp4_64chunks_10k_inflight_with_decode", |b| {
        b.iter_batched(
            fresh_tracker,
            |mut t| {
                let now = Instant::now();
                for (p, bytes) in &wire {
                    if let Ok(n) = notify::decode_binary(bytes) {
                        let _ = black_box(t.handle_notification(now, *p, &n));
                    }
                }
                let mut done = 0;
                while let Some(e) = t.poll_event() {
                    done += u64::from(matches!(e, TrackerEvent::Complete { .. }));
                }
                assert_eq!(done, REQUESTS);
                t
            },
            BatchSize::PerIteration,
        )
    });
    g.throughput(Throughput::Elements(REQUESTS));
    g.bench_function("expect_10k", |b| b.iter(|| black_box(fresh_tracker())));
    g.finish();
}

fn votes(c: &mut Criterion) {
    let mut g = c.benchmark_group("vote");
    let n_req = 10_000u64;
    g.throughput(Throughput::Elements(n_req));
    g.bench_function("pp4_10k_requests_all_ranks", |b| {
        b.iter(|| {
            let now = Instant::now();
            let mut boards: Vec<VoteBoard> = (0..PP)
                .filter_map(|r| VoteBoard::new(VoteConfig::new(PP, r)).ok())
                .collect();
            for req in 0..n_req {
                for r in 0..usize::from(PP) {
                    let _ = boards[r].handle_local_vote(now, RequestId(req), Vote::Completed);
                    while let Some((to, msg)) = boards[r].poll_transmit() {
                        let _ = boards[usize::from(to)].handle_peer_message(now, r as u16, &msg);
                    }
                }
                for b in &mut boards {
                    while let Some(d) = b.poll_decision() {
                        black_box(d);
                    }
                }
            }
            boards
        })
    });
    g.finish();
}

fn planner(c: &mut Criterion) {
    // DeepSeek-R1-like MLA: 61 layers, 576 B per token per layer, 64-token pages, 8k prompt,
    // PP=4 prefill, 1024-token chunks.
    let geom = match ChunkGeometry::new(8192, 1024, 64) {
        Ok(g) => g,
        Err(e) => panic!("geometry: {e}"),
    };
    let page_bytes = 64 * 576;
    let pool = 4096;
    let dst = KvLayout::packed(0, 61, RegionKind::Fused, page_bytes, pool);
    let planners: Vec<Planner> = (0..PP)
        .filter_map(|r| {
            let l = PpSplit::VllmEven.layer_range(61, PP, r).ok()?;
            let src =
                KvLayout::packed(l.start, l.len() as u32, RegionKind::Fused, page_bytes, pool);
            Planner::new(&src, &dst, TpMapping::Replicated).ok()
        })
        .collect();
    assert_eq!(planners.len(), usize::from(PP));
    let n = geom.num_pages() as u32;
    // Contiguous lists coalesce to one write per (chunk, layer); scattered ones cannot.
    let contiguous: Vec<u32> = (0..n).collect();
    let scattered: Vec<u32> = (0..n).map(|i| (i * 37) % pool).collect();
    let mut g = c.benchmark_group("planner");
    g.throughput(Throughput::Elements(61 * u64::from(n)));
    for (name, src_pages, dst_pages) in [
        ("mla_61l_8k_pp4_contiguous", &contiguous, &contiguous),
        ("mla_61l_8k_pp4_scattered", &contiguous, &scattered),
    ] {
        g.bench_function(name, |b| {
            let mut out = Vec::with_capacity(8192);
            b.iter(|| {
                let mut writes = 0;
                for p in &planners {
                    for chunk in 0..geom.num_chunks() {
                        out.clear();
                        let _ = p.plan_chunk(&geom, chunk, src_pages, dst_pages, &mut out);
                        writes += out.len();
                    }
                }
                black_box(writes)
            })
        });
    }
    g.throughput(Throughput::Elements(u64::from(PP)));
    g.bench_function("planner_new_4_ranks", |b| {
        b.iter(|| {
            (0..PP)
                .filter_map(|r| {
                    let l = PpSplit::VllmEven.layer_range(61, PP, r).ok()?;
                    let src = KvLayout::packed(
                        l.start,
                        l.len() as u32,
                        RegionKind::Fused,
                        page_bytes,
                        pool,
                    );
                    Planner::new(&src, &dst, TpMapping::Replicated).ok()
                })
                .count()
        })
    });
    g.finish();
}

criterion_group!(benches, codec, tracker, votes, planner);
criterion_main!(benches);
