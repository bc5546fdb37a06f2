//! `kvbench register`: how long a decode engine takes to register a pool of a given size, for each
//! kind of pool. A pool the caller owns (a server's KV cache) is allocated and faulted in by the
//! caller, outside the engine, and only registered by it; a pool the transport allocates
//! (`Pool::Shared`, which same-host peers map) is allocated, populated and registered by the
//! engine at start. Both are timed; only the engine's part is the registration.

use crate::cluster::PoolKind;
use std::time::{Duration, Instant};
use transfer_engine::core::planner::{KvLayout, RegionKind};
use transfer_engine::engine::{
    BackendConfig, DecodeConfig, DecodeEngine, Pool, PrefillConfig, PrefillEngine,
};
use transfer_engine::mem::{HostBuffer, HostOptions};
use transfer_engine::transport::BackendKind;

/// The layout's page: a pool is whole pages of it.
const PAGE: u64 = 2 << 20;

/// One pool's registration.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RegisterReport {
    /// Backend name.
    pub backend: String,
    /// `caller` or `shared`.
    pub pool: String,
    /// Bytes registered.
    pub bytes: u64,
    /// For a caller's pool, the caller's allocation with every page faulted in, outside the
    /// engine (not part of the registration); 0 for a shared pool, whose allocation is the
    /// engine's.
    pub caller_alloc_ms: f64,
    /// The engine's registration: for a shared pool, its allocation and population too.
    pub register_ms: f64,
    /// `register_ms` per GiB.
    pub register_ms_per_gib: f64,
    /// A prefill engine's start against that decode (a pool of one page of its own): its
    /// handshake, and with UCX and a shared pool, mapping the decode's whole pool into its process
    /// and faulting every page of it in, on its progress thread.
    pub prefill_connect_ms: f64,
}

/// Starts a decode engine on `backend` with a pool of `bytes` (rounded up to whole 2 MiB pages)
/// of kind `kind`, reads how long its registration took, and shuts it down.
///
/// # Errors
/// The allocation or the engine's start fails (no memory, no room in `/dev/shm`).
pub async fn time_registration(
    backend: BackendKind,
    kind: PoolKind,
    bytes: u64,
) -> Result<RegisterReport, String> {
    let pages = u32::try_from(bytes.div_ceil(PAGE).max(1))
        .map_err(|_| format!("{bytes} bytes is too large a pool"))?;
    let layout = KvLayout::packed(0, 1, RegionKind::Fused, PAGE, pages);
    let len = layout.buffer_len;
    let (pool, caller_alloc) = match kind {
        PoolKind::Shared => (Pool::Shared(len), Duration::ZERO),
        PoolKind::Caller => {
            let t0 = Instant::now();
            let buf = HostBuffer::new(
                usize::try_from(len).map_err(|e| e.to_string())?,
                HostOptions {
                    prefault: true,
                    ..HostOptions::default()
                },
            )
            .map_err(|e| format!("allocating {len} bytes: {e}"))?;
            (Pool::Owned(buf), t0.elapsed())
        }
    };
    let mut cfg = DecodeConfig::new(1, 16, layout, 1);
    let secret: Vec<u8> = (0..32).map(|_| rand::random::<u8>()).collect();
    cfg.token = Some(transfer_engine::control::Secret::new(&secret));
    cfg.backend = BackendConfig::default_for_decode(
        backend,
        &format!("register-{}-{}", std::process::id(), rand::random::<u32>()),
    );
    let engine = DecodeEngine::start(cfg, pool)
        .await
        .map_err(|e| format!("{backend} decode engine with a {len}-byte pool: {e}"))?;
    let register_ms = engine.stats().register_micros as f64 / 1e3;
    let mut pcfg = PrefillConfig::new(
        engine.local_addr(),
        0,
        1,
        1,
        16,
        KvLayout::packed(0, 1, RegionKind::Fused, PAGE, 1),
    );
    pcfg.token = Some(transfer_engine::control::Secret::new(&secret));
    pcfg.engine_id = format!(
        "register-p-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    );
    pcfg.backend = BackendConfig::default_for(backend, &pcfg.engine_id);
    let t0 = Instant::now();
    let prefill = PrefillEngine::start(pcfg, Pool::Shared(PAGE)).await;
    let prefill_connect = t0.elapsed();
    // The prefill goes first, so that it does not see its decode leave.
    let prefill = prefill
        .map(drop)
        .map_err(|e| format!("{backend} prefill engine against it: {e}"));
    engine.shutdown(Duration::from_secs(10)).await;
    prefill?;
    let gib = len as f64 / f64::from(1u32 << 30);
    Ok(RegisterReport {
        backend: backend.to_string(),
        pool: match kind {
            PoolKind::Shared => "shared",
            PoolKind::Caller => "caller",
        }
        .into(),
        bytes: len,
        caller_alloc_ms: caller_alloc.as_secs_f64() * 1e3,
        register_ms,
        register_ms_per_gib: register_ms / gib,
        prefill_connect_ms: prefill_connect.as_secs_f64() * 1e3,
    })
}
