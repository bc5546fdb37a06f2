//! A write that silently never lands while its chunk's notification still arrives (a
//! [`SendFault::DropWrite`] under one prefill rank, over real loopback UCX): the notification path
//! alone cannot tell, so the two checks that can must each catch it.
//!
//! - Checksums on: decode fails the request with a checksum mismatch naming the rank and chunk, and
//!   a healthy request alongside completes with every byte right.
//! - Checksums off: the request completes, and the byte check kvbench uses (`kvbench::verify`, on
//!   destination pages poisoned beforehand and reused from an earlier request) reports the page the
//!   write should have filled, still poisoned.
//!
//! Every wait is bounded.
#![allow(clippy::unwrap_used)]

mod common;

use common::small::*;
use kvbench::cluster::{Cluster, ClusterSpec, PoolKind};
use kvbench::verify::VerifyError;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::ChunkGeometry;
use transfer_engine::core::tracker::{FailureReason, ViolationKind};
use transfer_engine::engine::{BackendConfig, CustomBackend, Outcome};
use transfer_engine::transport::fault::{FaultPlan, FaultTransport, Match, Rule, SendFault};
use transfer_engine::transport::ucx::{UcxConfig, UcxTransport};
use transfer_engine::transport::{BackendKind, Transport, TransportError};

/// The rank and chunk whose first write is dropped (from B; A stays healthy).
const RANK: u16 = 1;
const DROPPED_CHUNK: u32 = 1;

/// A cluster whose prefill ranks each run on a fault transport around a real UCX transport.
struct Faulty {
    c: Cluster,
    prefill: Vec<Arc<FaultTransport>>,
}

async fn start(checksums: bool) -> Faulty {
    let spec = ClusterSpec {
        shape: SHAPE,
        pp: PP,
        decode_pages: 16,
        prefill_pages: 8,
        backend: BackendKind::Ucx,
        checksums,
        decode_pool: PoolKind::Shared,
        metrics: None,
        decode_progress: Default::default(),
    };
    let mut slots: Vec<Arc<OnceLock<Arc<FaultTransport>>>> = Vec::new();
    let c = tokio::time::timeout(
        Duration::from_secs(30),
        Cluster::start_with(spec, |rank, name| {
            let cfg = UcxConfig {
                name: format!("verify-fails-{name}"),
                ..UcxConfig::default()
            };
            if rank.is_none() {
                return BackendConfig::Ucx(cfg);
            }
            let slot = Arc::new(OnceLock::new());
            slots.push(slot.clone());
            BackendConfig::Custom(CustomBackend::new(BackendKind::Ucx, move |sink| {
                let cfg = cfg.clone();
                let ft = FaultTransport::new(FaultPlan::new(11), sink, move |s| {
                    Ok(Arc::new(UcxTransport::new(cfg, s)?) as Arc<dyn Transport>)
                })?;
                slot.set(ft.clone())
                    .map_err(|_| TransportError::Injected("backend built twice".into()))?;
                Ok(ft as Arc<dyn Transport>)
            }))
        }),
    )
    .await
    .expect("cluster did not start within 30 s")
    .unwrap();
    let prefill = slots.iter().map(|s| s.get().cloned().unwrap()).collect();
    Faulty { c, prefill }
}

/// Prepares `request` (its own pattern into `src`, poison into `dst`), runs it on every rank and
/// returns decode's outcome once every rank decided.
async fn run(f: &Faulty, request: RequestId, src: &[u32], dst: &[u32]) -> Outcome {
    f.c.prepare(request, src, dst).unwrap();
    let outcome =
        f.c.decode
            .expect(request, PROMPT, CHUNK, dst.to_vec(), LONG)
            .unwrap();
    let sends: Vec<_> = (0..PP)
        .map(|rank| {
            let (p, src) = (f.c.prefill[usize::from(rank)].clone(), src.to_vec());
            tokio::spawn(async move {
                for c in 0..CHUNKS {
                    // A chunk whose write was dropped still posts fine: only decode can tell.
                    p.send_chunk(request, c, &src, c + 1 == CHUNKS).await?;
                }
                Ok::<_, transfer_engine::engine::EngineError>(())
            })
        })
        .collect();
    let outcome = tokio::time::timeout(BOUND, outcome)
        .await
        .unwrap_or_else(|_| panic!("{request:?} did not end"));
    for (rank, s) in sends.into_iter().enumerate() {
        let sent = tokio::time::timeout(BOUND, s)
            .await
            .unwrap_or_else(|_| panic!("rank {rank}'s sends of {request:?} hung"))
            .unwrap();
        // Decode may fail the request (and abort it) before a rank's last chunk went out.
        if outcome == Outcome::Complete {
            sent.unwrap();
        }
    }
    for p in &f.c.prefill {
        tokio::time::timeout(BOUND, p.decided(request))
            .await
            .unwrap_or_else(|_| panic!("rank {} never decided {request:?}", p.pp_rank()));
        p.release(request);
    }
    outcome
}

/// Drops the first write of `RANK`'s chunk `DROPPED_CHUNK` of B, once; the notification still goes.
fn drop_one_write(f: &Faulty) {
    f.prefill[usize::from(RANK)].add_send(
        Rule::new(
            Match::request(B).rank(RANK).chunk(DROPPED_CHUNK),
            SendFault::DropWrite { index: 0 },
        )
        .times(1),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_write_fails_the_checksum() {
    let f = start(true).await;
    drop_one_write(&f);
    let (a, b) = tokio::join!(run(&f, A, &SRC_A, &DST_A), run(&f, B, &SRC_B, &DST_B));
    assert_eq!(f.prefill[usize::from(RANK)].counters().dropped_writes, 1);
    assert_eq!(
        b,
        Outcome::Failed(FailureReason::ProtocolViolation {
            rank: RANK,
            kind: ViolationKind::ChecksumMismatch {
                chunk_id: DROPPED_CHUNK
            },
        }),
        "the request that lost a write"
    );
    assert_eq!(a, Outcome::Complete, "the healthy request");
    assert_eq!(f.c.verify(A, &DST_A).unwrap(), SHAPE.request_bytes(PROMPT));
    let s = f.c.decode.stats();
    assert_eq!(
        (s.completed, s.failed, s.checksum_mismatch),
        (1, 1, 1),
        "{s:?}"
    );
    f.c.wait_quiescent(BOUND).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_write_without_checksums_completes_but_fails_verification() {
    let f = start(false).await;
    // B's pages first carry a healthy request, so a check that read stale bytes could pass.
    let earlier = RequestId(3);
    assert_eq!(run(&f, earlier, &SRC_B, &DST_B).await, Outcome::Complete);
    assert_eq!(
        f.c.verify(earlier, &DST_B).unwrap(),
        SHAPE.request_bytes(PROMPT)
    );

    drop_one_write(&f);
    let (a, b) = tokio::join!(run(&f, A, &SRC_A, &DST_A), run(&f, B, &SRC_B, &DST_B));
    assert_eq!(f.prefill[usize::from(RANK)].counters().dropped_writes, 1);
    assert_eq!(a, Outcome::Complete, "the healthy request");
    assert_eq!(
        b,
        Outcome::Complete,
        "nothing on the notification path shows the lost write"
    );
    assert_eq!(f.c.verify(A, &DST_A).unwrap(), SHAPE.request_bytes(PROMPT));
    let chunk_pages = ChunkGeometry::new(
        u64::from(PROMPT),
        u64::from(CHUNK),
        u64::from(SHAPE.page_tokens),
    )
    .unwrap()
    .pages_of_chunk(u64::from(DROPPED_CHUNK))
    .unwrap();
    match f.c.verify(B, &DST_B) {
        Err(VerifyError::Mismatch {
            rank,
            layer,
            page,
            dst_page,
            still_poisoned,
            ..
        }) => {
            assert_eq!(rank, RANK);
            assert!(
                f.c.layers[usize::from(RANK)].contains(&layer),
                "layer {layer}"
            );
            assert!(
                chunk_pages.contains(&(page as u64)),
                "page {page} not in {chunk_pages:?}"
            );
            assert_eq!(dst_page, DST_B[page]);
            assert!(
                still_poisoned,
                "the missing page should still hold the poison"
            );
        }
        other => panic!("verification of B did not report the lost write: {other:?}"),
    }
    let s = f.c.decode.stats();
    assert_eq!(
        (s.completed, s.failed, s.checksum_mismatch),
        (3, 0, 0),
        "{s:?}"
    );
    f.c.wait_quiescent(BOUND).await.unwrap();
}
