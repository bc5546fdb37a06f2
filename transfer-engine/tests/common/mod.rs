//! Helpers the engine tests share: a pipeline's vote mesh sockets and a prefill rank's pool
//! filled with a pattern.
#![allow(clippy::unwrap_used, dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::{KvLayout, PpSplit, RegionKind};
use transfer_engine::engine::{ChunkJobHook, MeshSocket};
use transfer_engine::mem::{HostBuffer, HostOptions};

/// The loopback vote mesh sockets of `pp` ranks and their addresses (none for one rank).
pub fn mesh_sockets(pp: u16) -> (Vec<Arc<MeshSocket>>, Vec<SocketAddr>) {
    if pp < 2 {
        return (Vec::new(), Vec::new());
    }
    (0..pp)
        .map(|_| {
            let s = MeshSocket::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
            let a = s.local_addr().unwrap();
            (Arc::new(s), a)
        })
        .unzip()
}

/// PP rank `rank`'s layout of `layers` split as SGLang splits them, and its pool of `pages` pages
/// of `page_bytes` per layer, every byte `pattern(layer, page, at)`.
pub fn patterned_rank(
    layers: u32,
    pp: u16,
    rank: u16,
    page_bytes: u64,
    pages: u32,
    pattern: impl Fn(u32, u32, u64) -> u8,
) -> (KvLayout, HostBuffer) {
    let range = PpSplit::SglangEven.layer_range(layers, pp, rank).unwrap();
    let layout = KvLayout::packed(
        range.start,
        range.len() as u32,
        RegionKind::Fused,
        page_bytes,
        pages,
    );
    let mut buf = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
    let per_layer = u64::from(pages) * page_bytes;
    for (i, x) in buf.as_mut_slice().iter_mut().enumerate() {
        let i = i as u64;
        let layer = range.start + (i / per_layer) as u32;
        let page = ((i % per_layer) / page_bytes) as u32;
        *x = pattern(layer, page, i % page_bytes);
    }
    (layout, buf)
}

/// Every layer's `dst` pages in `d` (a pool of `decode_pages` pages of `page_bytes` per layer)
/// still hold `poison`.
pub fn assert_poisoned(
    d: &transfer_engine::engine::DecodeEngine,
    (layers, decode_pages, page_bytes): (u32, u32, u64),
    poison: u8,
    dst: &[u32],
) {
    let mut page = vec![0u8; page_bytes as usize];
    for layer in 0..layers {
        for &t in dst {
            let off = (u64::from(layer) * u64::from(decode_pages) + u64::from(t)) * page_bytes;
            d.read_pool(off, &mut page).unwrap();
            assert!(
                page.iter().all(|&b| b == poison),
                "layer {layer} page {t} was written"
            );
        }
    }
}

/// A decode config's hook that holds the first chunk job of `request` on its worker until the
/// returned sender is used (or `bound` passes), and a receiver that hears when that job is held.
pub fn hold_first_job(
    request: RequestId,
    bound: Duration,
) -> (
    ChunkJobHook,
    std::sync::mpsc::Receiver<()>,
    std::sync::mpsc::Sender<()>,
) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (held_tx, held_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    let first = AtomicBool::new(true);
    let hook = ChunkJobHook(Arc::new(move |r| {
        if r == request && first.swap(false, Ordering::SeqCst) {
            let _ = held_tx.send(());
            let _ = go_rx.lock().unwrap().recv_timeout(bound);
        }
    }));
    (hook, held_rx, go_tx)
}

/// Waits (within `bound`) until the hook of [`hold_first_job`] holds its job.
pub async fn until_held(held_rx: std::sync::mpsc::Receiver<()>, bound: Duration) {
    tokio::task::spawn_blocking(move || held_rx.recv_timeout(bound))
        .await
        .unwrap()
        .expect("no chunk job started");
}
