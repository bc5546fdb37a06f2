//! A decode engine and a prefill engine in one process, over UCX on loopback: decode allocates
//! pages for a request, prefill writes its pages into them chunk by chunk, decode sees the
//! request complete and reads the bytes back.
//!
//! ```sh
//! cargo run --release --example quickstart
//! ```
//!
//! In a real deployment the two engines live in different processes (or hosts): decode listens on
//! a routable address, prefill ranks connect to it, and every process holds the same secret.

use std::time::Duration;
use transfer_engine::control::Secret;
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::{KvLayout, RegionKind};
use transfer_engine::engine::{
    DecodeConfig, DecodeEngine, Outcome, Pool, PrefillConfig, PrefillEngine,
};
use transfer_engine::mem::{HostBuffer, HostOptions};

/// A small model: 4 layers, 16-token pages of 64 bytes per token and layer.
const LAYERS: u32 = 4;
const PAGE_TOKENS: u32 = 16;
const PAGE_BYTES: u64 = 16 * 64;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Both sides hold the same secret (32 random bytes from a file, in practice).
    let secret = Secret::new(b"quickstart: use 32 random bytes!");

    // Decode: a pool of 64 pages per layer, layer-major, registered once.
    let dlayout = KvLayout::packed(0, LAYERS, RegionKind::Fused, PAGE_BYTES, 64);
    let mut dcfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, dlayout.clone(), 1);
    dcfg.token = Some(secret.clone());
    let dpool = HostBuffer::new(dlayout.buffer_len as usize, HostOptions::default())?;
    let decode = DecodeEngine::start(dcfg, Pool::Owned(dpool)).await?;

    // Prefill: one PP rank holding every layer, a pool of 16 pages per layer, filled with a
    // pattern that stands for the KV cache the model computed.
    let playout = KvLayout::packed(0, LAYERS, RegionKind::Fused, PAGE_BYTES, 16);
    let mut pbuf = HostBuffer::new(playout.buffer_len as usize, HostOptions::default())?;
    for (i, b) in pbuf.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let mut pcfg = PrefillConfig::new(decode.local_addr(), 0, 1, LAYERS, PAGE_TOKENS, playout);
    pcfg.token = Some(secret);
    let prefill = PrefillEngine::start(pcfg, Pool::Owned(pbuf)).await?;
    decode.wait_for_ranks(Duration::from_secs(10)).await?;

    // A 64-token prompt in chunks of 32 tokens: 4 pages, from prefill's pages 0..4 into decode's
    // pages 10..14.
    let request = RequestId(1);
    let (src, dst) = (vec![0, 1, 2, 3], vec![10, 11, 12, 13]);
    let done = decode.expect(request, 64, 32, dst.clone(), Duration::from_secs(10))?;
    let incoming = prefill.next_request().await.ok_or("prefill closed")?;
    let chunks = incoming.prompt_tokens.div_ceil(incoming.chunk_tokens);
    for chunk in 0..chunks {
        // The engine takes each chunk's pages from `src` by the chunk's token range.
        prefill
            .send_chunk(request, chunk, &src, chunk + 1 == chunks)
            .await?;
    }
    match done.await {
        Outcome::Complete => {}
        failed => return Err(format!("request failed: {failed:?}").into()),
    }

    // Every layer's destination pages hold the source pages' bytes (packed layouts are
    // layer-major: a layer's pages one after another).
    let offset = |pages: u64, layer: u32, page: u32| {
        (u64::from(layer) * pages + u64::from(page)) * PAGE_BYTES
    };
    let (mut got, mut want) = (
        vec![0u8; PAGE_BYTES as usize],
        vec![0u8; PAGE_BYTES as usize],
    );
    for layer in 0..LAYERS {
        for (&s, &d) in src.iter().zip(&dst) {
            decode.read_pool(offset(64, layer, d), &mut got)?;
            prefill.read_pool(offset(16, layer, s), &mut want)?;
            if got != want {
                return Err(format!("layer {layer} page {d} differs").into());
            }
        }
    }
    println!(
        "request {} complete: {} bytes moved, every byte checked",
        request.0,
        prefill.stats().bytes
    );
    decode.shutdown(Duration::from_secs(5)).await;
    Ok(())
}
