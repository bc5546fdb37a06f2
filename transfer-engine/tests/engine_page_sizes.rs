//! Pages of different sizes on the two sides, over real loopback UCX and NIXL: a prefill rank with
//! pages of `ps` tokens writes a request into a decode whose pages hold `pd`, both ways, K and V
//! with their heads token-major, head-major and head-major with K by columns, checksums on; every byte of every token lands at
//! its place in decode's pages, and pages outside the request stay poisoned.
#![allow(clippy::unwrap_used)]

use std::time::Duration;
use transfer_engine::control::Secret;
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::{HeadLayout, HeadOrder, KvLayout, RegionKind};
use transfer_engine::engine::{
    BackendConfig, DecodeConfig, DecodeEngine, Outcome, Pool, PrefillConfig, PrefillEngine,
};
use transfer_engine::mem::{HostBuffer, HostOptions};
use transfer_engine::transport::BackendKind;

const LAYERS: u32 = 3;
const HEADS: u32 = 4;
const HEAD_BYTES: u64 = 16;
const PROMPT: u32 = 100;
const CHUNK: u32 = 40;
const POOL: u32 = 24;
const POISON: u8 = 0x5A;
const SECRET: &[u8] = b"page-sizes test secret, 32 bytes";
const BOUND: Duration = Duration::from_secs(10);

fn layout(pt: u32, order: HeadOrder) -> KvLayout {
    layout_of(pt, order, POOL)
}

fn layout_of(pt: u32, order: HeadOrder, pool: u32) -> KvLayout {
    let page_bytes = u64::from(HEADS) * HEAD_BYTES * u64::from(pt);
    KvLayout::packed(0, LAYERS, RegionKind::SplitKv, page_bytes, pool).with_heads(HeadLayout {
        num_heads: HEADS,
        head_bytes: HEAD_BYTES,
        page_tokens: pt,
        order,
    })
}

/// Offset of byte `b` of head `h` of token `t` of the request (page list `pages`) in layer `l`,
/// region `r` of `layout`.
fn at(layout: &KvLayout, pages: &[u32], l: u32, r: u32, t: u32, h: u32, b: u64) -> u64 {
    let hl = layout.heads.unwrap();
    let pt = hl.page_tokens;
    let page = pages[(t / pt) as usize];
    let (t, pt, h) = (u64::from(t % pt), u64::from(pt), u64::from(h));
    let inside = match hl.order {
        HeadOrder::TokenMajor => (t * u64::from(HEADS) + h) * HEAD_BYTES + b,
        HeadOrder::HeadMajor => (h * pt + t) * HEAD_BYTES + b,
        HeadOrder::KeyColumns { elem_bytes } => {
            let (eb, half) = (u64::from(elem_bytes), HEAD_BYTES / 2);
            if b < half {
                h * pt * HEAD_BYTES + ((b / eb) * pt + t) * eb + b % eb
            } else {
                h * pt * HEAD_BYTES + pt * half + t * half + (b - half)
            }
        }
    };
    u64::from(r) * layout.region_stride
        + u64::from(l) * layout.layer_stride
        + u64::from(page) * layout.page_bytes
        + inside
}

fn value(l: u32, r: u32, t: u32, h: u32, b: u64) -> u8 {
    let x =
        u64::from(l) * 7_919 + u64::from(r) * 104_729 + u64::from(t) * 31 + u64::from(h) * 7 + b;
    ((x ^ (x >> 7)) % 251) as u8
}

/// Calls `f` for every (layer, region, token, head, byte) of the first `tokens` tokens.
fn every_byte(tokens: u32, mut f: impl FnMut(u32, u32, u32, u32, u64)) {
    for r in 0..2 {
        for l in 0..LAYERS {
            for t in 0..tokens {
                for h in 0..HEADS {
                    for b in 0..HEAD_BYTES {
                        f(l, r, t, h, b);
                    }
                }
            }
        }
    }
}

/// One request between a prefill of `ps`-token pages (a pool of `src_pool`) and a decode of
/// `pd`-token pages, checksums on.
struct Case {
    backend: BackendKind,
    ps: u32,
    pd: u32,
    order: HeadOrder,
    src_pool: u32,
    /// The prompt's tokens, whose bytes are checked in decode's pages.
    prompt: u32,
    /// The tokens decode expects (more than `prompt` where it rounds up to its pages).
    expected: u32,
    src_pages: Vec<u32>,
    dst_pages: Vec<u32>,
    /// The list prefill sends from (`src_pages`, or more where it pads).
    sent: Vec<u32>,
}

/// Runs `c` and checks every byte of the prompt in decode's pages, and that nothing outside the
/// expected tokens was written.
async fn transfer(c: Case) {
    let what = format!("{} {} -> {} {:?}", c.backend, c.ps, c.pd, c.order);
    let (src_l, dst_l) = (layout_of(c.ps, c.order, c.src_pool), layout(c.pd, c.order));
    let tag = format!("{}-{}-{}-{:?}", std::process::id(), c.ps, c.pd, c.order);
    let mut dcfg = DecodeConfig::new(LAYERS, c.pd, dst_l.clone(), 1);
    dcfg.token = Some(Secret::new(SECRET));
    dcfg.verify_checksums = true;
    dcfg.backend = BackendConfig::default_for(c.backend, &format!("d-{tag}"));
    let mut dbuf = HostBuffer::new(dst_l.buffer_len as usize, HostOptions::default()).unwrap();
    dbuf.as_mut_slice().fill(POISON);
    let d = DecodeEngine::start(dcfg, Pool::Owned(dbuf)).await.unwrap();

    let mut sbuf = HostBuffer::new(src_l.buffer_len as usize, HostOptions::default()).unwrap();
    let s = sbuf.as_mut_slice();
    every_byte(c.prompt, |l, r, t, h, b| {
        s[at(&src_l, &c.src_pages, l, r, t, h, b) as usize] = value(l, r, t, h, b);
    });
    let mut pcfg = PrefillConfig::new(d.local_addr(), 0, 1, LAYERS, c.ps, src_l.clone());
    pcfg.token = Some(Secret::new(SECRET));
    pcfg.checksums = true;
    pcfg.backend = BackendConfig::default_for(c.backend, &format!("p-{tag}"));
    let p = PrefillEngine::start(pcfg, Pool::Owned(sbuf)).await.unwrap();
    d.wait_for_ranks(BOUND).await.unwrap();

    let request = RequestId(u64::from(c.ps * 1000 + c.pd));
    let done = d
        .expect(request, c.expected, CHUNK, c.dst_pages.clone(), BOUND)
        .unwrap();
    let asked = tokio::time::timeout(BOUND, p.next_request())
        .await
        .unwrap_or_else(|_| panic!("{what}: prefill never took the request"));
    assert_eq!(asked.unwrap().request, request);
    let chunks = c.expected.div_ceil(CHUNK);
    for k in 0..chunks {
        p.send_chunk(request, k, &c.sent, k + 1 == chunks)
            .await
            .unwrap();
    }
    assert_eq!(
        tokio::time::timeout(BOUND, done).await.unwrap(),
        Outcome::Complete,
        "{what}"
    );
    let mut pool = vec![0u8; dst_l.buffer_len as usize];
    d.read_pool(0, &mut pool).unwrap();
    let mut written = vec![false; pool.len()];
    every_byte(c.expected, |l, r, t, h, b| {
        let o = at(&dst_l, &c.dst_pages, l, r, t, h, b) as usize;
        if t < c.prompt {
            assert_eq!(
                pool[o],
                value(l, r, t, h, b),
                "{what}: layer {l} region {r} token {t} head {h} byte {b}"
            );
        }
        written[o] = true;
    });
    let stray = pool
        .iter()
        .zip(&written)
        .position(|(&v, &w)| !w && v != POISON);
    assert_eq!(stray, None, "{what}: a byte outside the request");
    p.decided(request).await;
    drop(p);
    d.shutdown(BOUND).await;
}

async fn one(backend: BackendKind, ps: u32, pd: u32, order: HeadOrder) {
    // The request's pages on each side, out of order.
    let src_pages: Vec<u32> = (0..PROMPT.div_ceil(ps))
        .map(|i| (i * 5 + 3) % POOL)
        .collect();
    let dst_pages: Vec<u32> = (0..PROMPT.div_ceil(pd))
        .map(|i| (i * 7 + 2) % POOL)
        .collect();
    transfer(Case {
        backend,
        ps,
        pd,
        order,
        src_pool: POOL,
        prompt: PROMPT,
        expected: PROMPT,
        sent: src_pages.clone(),
        src_pages,
        dst_pages,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smaller_prefill_pages_into_larger_decode_pages() {
    one(BackendKind::Ucx, 16, 32, HeadOrder::TokenMajor).await;
    one(BackendKind::Ucx, 16, 48, HeadOrder::HeadMajor).await;
    one(BackendKind::Nixl, 16, 32, HeadOrder::HeadMajor).await;
    // vLLM's CPU blocks: K by columns of 4-byte elements inside a head's part.
    one(
        BackendKind::Ucx,
        32,
        64,
        HeadOrder::KeyColumns { elem_bytes: 4 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn larger_prefill_pages_into_smaller_decode_pages() {
    one(BackendKind::Ucx, 32, 16, HeadOrder::HeadMajor).await;
    one(BackendKind::Ucx, 48, 16, HeadOrder::TokenMajor).await;
    one(BackendKind::Nixl, 32, 12, HeadOrder::TokenMajor).await;
    one(
        BackendKind::Ucx,
        64,
        32,
        HeadOrder::KeyColumns { elem_bytes: 4 },
    )
    .await;
    one(
        BackendKind::Nixl,
        96,
        32,
        HeadOrder::KeyColumns { elem_bytes: 2 },
    )
    .await;
}

/// As `kvx.sglang` sends it: decode expects its whole pages (a 17-token prompt in two pages of 16 is
/// 32 tokens), prefill holds the prompt in three pages of 8, its whole pool, and repeats its last
/// page to span decode's 32 tokens. With checksums on, the request completes and the prompt's
/// tokens are in place (decode's check once replanned over more source pages than the pool holds,
/// and failed the request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_padded_source_list_into_larger_pages_with_checksums() {
    transfer(Case {
        backend: BackendKind::Ucx,
        ps: 8,
        pd: 16,
        order: HeadOrder::TokenMajor,
        src_pool: 3,
        prompt: 17,
        expected: 32,
        src_pages: vec![2, 0, 1],
        dst_pages: vec![5, 3],
        sent: vec![2, 0, 1, 1],
    })
    .await;
}
