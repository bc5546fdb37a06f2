//! Planner: every byte of a rank's layers is written exactly once, to the right place, and
//! nothing is addressed outside either buffer; checked by executing the plans on real buffers.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use transfer_engine::core::planner::{
    ChunkGeometry, HeadLayout, HeadOrder, KvLayout, PlanError, Planner, PpSplit, RegionKind, Side,
    TpMapping, Write,
};

/// A layout with gaps: padding between layers and regions, and an offset into the buffer.
fn gappy(
    first: u32,
    layers: u32,
    regions: RegionKind,
    page_bytes: u64,
    pages: u32,
    rng: &mut ChaCha8Rng,
) -> KvLayout {
    let layer_stride = page_bytes * u64::from(pages) + rng.random_range(0..3) * page_bytes;
    let region_stride = layer_stride * u64::from(layers) + rng.random_range(0..50);
    let base_offset = rng.random_range(0..100);
    let buffer_len = base_offset
        + region_stride * u64::from(regions.count() - 1)
        + layer_stride * u64::from(layers - 1)
        + page_bytes * u64::from(pages)
        + rng.random_range(0..10);
    KvLayout {
        first_layer: first,
        num_layers: layers,
        regions,
        page_bytes,
        num_pages: pages,
        layer_stride,
        region_stride,
        base_offset,
        buffer_len,
        heads: None,
    }
}

fn page_at(l: &KvLayout, global_layer: u32, region: u32, page: u32) -> u64 {
    l.base_offset
        + u64::from(region) * l.region_stride
        + u64::from(global_layer - l.first_layer) * l.layer_stride
        + u64::from(page) * l.page_bytes
}

/// Executes `writes` from `src` into `dst`, counting how often each destination byte is hit.
fn execute(writes: &[Write], src: &[u8], dst: &mut [u8], hits: &mut [u8]) -> Result<(), String> {
    for w in writes {
        if w.len == 0 || w.rows == 0 {
            return Err("empty write".into());
        }
        if w.rows > 1 && (w.src_stride < w.len || w.dst_stride < w.len) {
            return Err(format!("rows overlap: {w:?}"));
        }
        for (s, d) in w.pieces() {
            let (s, d) = (usize::try_from(s).unwrap(), usize::try_from(d).unwrap());
            let n = usize::try_from(w.len).unwrap();
            if s + n > src.len() || d + n > dst.len() {
                return Err(format!("out of bounds: {w:?}"));
            }
            dst[d..d + n].copy_from_slice(&src[s..s + n]);
            for h in &mut hits[d..d + n] {
                *h += 1;
            }
        }
    }
    Ok(())
}

/// Random pool indices for a request's pages: distinct, in a random order with some runs.
fn page_list(n: u64, pool: u32, rng: &mut ChaCha8Rng) -> Vec<u32> {
    let mut all: Vec<u32> = (0..pool).collect();
    if rng.random_bool(0.5) {
        all.shuffle(rng);
    } else {
        all.rotate_left(rng.random_range(0..pool) as usize);
    }
    all.truncate(n as usize);
    all
}

fn check_whole_pages(seed: u64) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let total_layers = rng.random_range(1..=9u32);
    let pp = rng.random_range(1..=total_layers.min(4)) as u16;
    let split = match rng.random_range(0..3) {
        0 => PpSplit::VllmEven,
        1 => PpSplit::SglangEven,
        _ => {
            // A random composition of total_layers into pp positive parts.
            let mut cuts: Vec<u32> = (1..total_layers).collect();
            cuts.shuffle(&mut rng);
            let mut cuts: Vec<u32> = cuts.into_iter().take(usize::from(pp) - 1).collect();
            cuts.sort_unstable();
            let mut counts = Vec::new();
            let mut prev = 0;
            for c in cuts.into_iter().chain([total_layers]) {
                counts.push(c - prev);
                prev = c;
            }
            PpSplit::Explicit(counts)
        }
    };
    let regions = if rng.random_bool(0.5) {
        RegionKind::Fused
    } else {
        RegionKind::SplitKv
    };
    let page_tokens = rng.random_range(1..=8u64);
    let bytes_per_token = rng.random_range(1..=6u64);
    let page_bytes = page_tokens * bytes_per_token;
    let prompt = rng.random_range(1..=100u64);
    let chunk_tokens = rng.random_range(1..=40u64);
    let geom = ChunkGeometry::new(prompt, chunk_tokens, page_tokens).unwrap();
    let needed = geom.num_pages();
    let src_pool = (needed as u32) + rng.random_range(0..5);
    let dst_pool = (needed as u32) + rng.random_range(0..5);
    let dst = gappy(0, total_layers, regions, page_bytes, dst_pool, &mut rng);
    let dst_pages = page_list(needed, dst_pool, &mut rng);
    let mut dst_buf = vec![0u8; dst.buffer_len as usize];
    let mut hits = vec![0u8; dst.buffer_len as usize];
    let mut srcs = Vec::new();
    for rank in 0..pp {
        let layers = split.layer_range(total_layers, pp, rank).unwrap();
        let src = gappy(
            layers.start,
            layers.len() as u32,
            regions,
            page_bytes,
            src_pool,
            &mut rng,
        );
        let src_pages = page_list(needed, src_pool, &mut rng);
        let mut src_buf = vec![0u8; src.buffer_len as usize];
        rng.fill_bytes(&mut src_buf);
        let mapping = if rng.random_bool(0.5) {
            TpMapping::Identical
        } else {
            TpMapping::Replicated
        };
        let planner = Planner::new(&src, &dst, mapping).unwrap();
        let mut writes = Vec::new();
        for c in 0..geom.num_chunks() {
            let before = writes.len();
            planner
                .plan_chunk(&geom, c, &src_pages, &dst_pages, &mut writes)
                .unwrap();
            // Merging never crosses chunks, and within a chunk no two writes could merge.
            for w in writes[before..].windows(2) {
                prop_assert!(
                    !(w[0].src_offset + w[0].len == w[1].src_offset
                        && w[0].dst_offset + w[0].len == w[1].dst_offset),
                    "unmerged neighbours {:?}",
                    w
                );
            }
        }
        execute(&writes, &src_buf, &mut dst_buf, &mut hits).map_err(TestCaseError::fail)?;
        srcs.push((src, src_pages, src_buf, layers));
    }
    // Every byte of every page of every layer landed exactly once, with the right content.
    let mut expected_hits = vec![0u8; hits.len()];
    for (src, src_pages, src_buf, layers) in &srcs {
        for g in layers.clone() {
            for region in 0..regions.count() {
                for i in 0..needed as usize {
                    let s = page_at(src, g, region, src_pages[i]) as usize;
                    let d = page_at(&dst, g, region, dst_pages[i]) as usize;
                    let n = page_bytes as usize;
                    prop_assert_eq!(&dst_buf[d..d + n], &src_buf[s..s + n]);
                    for h in &mut expected_hits[d..d + n] {
                        *h += 1;
                    }
                }
            }
        }
    }
    prop_assert!(expected_hits.iter().all(|&h| h <= 1));
    prop_assert_eq!(hits, expected_hits);
    Ok(())
}

fn check_head_sliced(seed: u64) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let tps = [1u32, 2, 4, 8];
    let ptp = tps[rng.random_range(0..4)];
    let dtp = tps[rng.random_range(0..4)];
    let total_heads = ptp.max(dtp) * rng.random_range(1..=2u32);
    let (order, head_bytes) = order_and_head_bytes(&mut rng, 4);
    let page_tokens = rng.random_range(1..=4u32);
    let layers = rng.random_range(1..=3u32);
    let pool = rng.random_range(1..=6u32);
    let heads = |n| HeadLayout {
        num_heads: n,
        head_bytes,
        page_tokens,
        order,
    };
    let pb = |n: u32| u64::from(n) * head_bytes * u64::from(page_tokens);
    let (hs, hd) = (total_heads / ptp, total_heads / dtp);
    let pages = rng.random_range(1..=pool);
    let src_pages = page_list(u64::from(pages), pool, &mut rng);
    let dst_pages = page_list(u64::from(pages), pool, &mut rng);
    for d in 0..dtp {
        let dst =
            KvLayout::packed(0, layers, RegionKind::SplitKv, pb(hd), pool).with_heads(heads(hd));
        let mut dst_buf = vec![0u8; dst.buffer_len as usize];
        let mut hits = vec![0u8; dst_buf.len()];
        // Each prefill rank's buffer holds byte value = global head id + 1 at every position.
        for p in 0..ptp {
            let src = KvLayout::packed(0, layers, RegionKind::SplitKv, pb(hs), pool)
                .with_heads(heads(hs));
            let mut src_buf = vec![0u8; src.buffer_len as usize];
            fill_heads(&src, p * hs, &mut src_buf);
            let planner = Planner::new(
                &src,
                &dst,
                TpMapping::HeadSliced {
                    prefill_tp: ptp,
                    decode_tp: dtp,
                    prefill_rank: p,
                    decode_rank: d,
                },
            )
            .unwrap();
            let mut writes = Vec::new();
            planner
                .plan_pages(&src_pages, &dst_pages, 0, &mut writes)
                .unwrap();
            // Coalesced: at most one write per (region, layer, page), never one per token row.
            prop_assert!(
                writes.len() as u64 <= 2 * u64::from(layers) * u64::from(pages),
                "{} writes for {} pages of {} layers",
                writes.len(),
                pages,
                layers
            );
            execute(&writes, &src_buf, &mut dst_buf, &mut hits).map_err(TestCaseError::fail)?;
        }
        let mut want = vec![0u8; dst_buf.len()];
        fill_heads(&dst, d * hd, &mut want);
        // Only the request's pages are written; everything else stays 0.
        let mut want_hits = vec![0u8; dst_buf.len()];
        for region in 0..2 {
            for l in 0..layers {
                for &pg in &dst_pages {
                    let o = page_at(&dst, l, region, pg) as usize;
                    for h in &mut want_hits[o..o + dst.page_bytes as usize] {
                        *h = 1;
                    }
                }
            }
        }
        for (i, w) in want.iter_mut().enumerate() {
            if want_hits[i] == 0 {
                *w = 0;
            }
        }
        prop_assert_eq!(&hits, &want_hits);
        prop_assert_eq!(&dst_buf, &want);
    }
    Ok(())
}

/// Writes `first_head + local head + 1` into every byte of every head slot.
fn fill_heads(l: &KvLayout, first_head: u32, buf: &mut [u8]) {
    let h = l.heads.unwrap();
    for region in 0..l.regions.count() {
        for layer in 0..l.num_layers {
            for page in 0..l.num_pages {
                let base = page_at(l, layer, region, page);
                for t in 0..u64::from(h.page_tokens) {
                    for head in 0..u64::from(h.num_heads) {
                        let v = (u64::from(first_head) + head + 1) as u8;
                        for b in 0..h.head_bytes {
                            let off = in_page(
                                h.order,
                                u64::from(h.page_tokens),
                                u64::from(h.num_heads),
                                h.head_bytes,
                                t,
                                head,
                                b,
                            );
                            buf[(base + off) as usize] = v;
                        }
                    }
                }
            }
        }
    }
}

/// Where byte `b` of head `head` (local) of token `t` (in its page) lies in a page of `pt` tokens
/// of `heads` heads of `hb` bytes, in `order`.
fn in_page(order: HeadOrder, pt: u64, heads: u64, hb: u64, t: u64, head: u64, b: u64) -> u64 {
    match order {
        HeadOrder::HeadMajor => (head * pt + t) * hb + b,
        HeadOrder::TokenMajor => (t * heads + head) * hb + b,
        HeadOrder::KeyColumns { elem_bytes } => {
            let (eb, half) = (u64::from(elem_bytes), hb / 2);
            let part = head * pt * hb;
            if b < half {
                // K: element b / eb of every token of the page, then the next element.
                part + ((b / eb) * pt + t) * eb + b % eb
            } else {
                part + pt * half + t * half + (b - half)
            }
        }
    }
}

/// One of the three orders, and head bytes that suit it (whole K and V elements for K columns).
fn order_and_head_bytes(rng: &mut ChaCha8Rng, max_head_bytes: u64) -> (HeadOrder, u64) {
    match rng.random_range(0..3) {
        0 => (HeadOrder::HeadMajor, rng.random_range(1..=max_head_bytes)),
        1 => (HeadOrder::TokenMajor, rng.random_range(1..=max_head_bytes)),
        _ => {
            let elem_bytes = rng.random_range(1..=2u32);
            let hb = 2 * u64::from(elem_bytes) * rng.random_range(1..=3u64);
            (HeadOrder::KeyColumns { elem_bytes }, hb)
        }
    }
}

/// Pages of different sizes on the two sides (whole pages or sliced heads, either order, several
/// chunks, a prefix-free prompt that ends inside a page): every destination byte of the request's
/// tokens is written once, by the bytes of the same (layer, region, token, global head), and no
/// other byte is written.
fn check_page_sizes(seed: u64) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let sizes = [1u32, 2, 3, 4, 8, 16];
    let ps = sizes[rng.random_range(0..sizes.len())];
    let mut pd = sizes[rng.random_range(0..sizes.len())];
    if pd == ps {
        pd = ps * 2;
    }
    let (order, hb) = order_and_head_bytes(&mut rng, 3);
    let (ptp, dtp) = [(1u32, 1u32), (1, 2), (2, 1), (2, 4), (4, 2)][rng.random_range(0..5)];
    let total_heads = 4u32;
    let (hs_n, hd_n) = (total_heads / ptp, total_heads / dtp);
    let layers = rng.random_range(1..=3u32);
    let regions = if rng.random_bool(0.5) {
        RegionKind::Fused
    } else {
        RegionKind::SplitKv
    };
    let prompt = rng.random_range(1..=40u64);
    let chunk = rng.random_range(1..=16u64);
    let (sp_n, dp_n) = (
        prompt.div_ceil(u64::from(ps)),
        prompt.div_ceil(u64::from(pd)),
    );
    let (src_pool, dst_pool) = (
        sp_n as u32 + rng.random_range(0..3),
        dp_n as u32 + rng.random_range(0..3),
    );
    let src_pages = page_list(sp_n, src_pool, &mut rng);
    let dst_pages = page_list(dp_n, dst_pool, &mut rng);
    let heads = |n: u32, pt: u32| HeadLayout {
        num_heads: n,
        head_bytes: hb,
        page_tokens: pt,
        order,
    };
    let pb = |n: u32, pt: u32| u64::from(n) * hb * u64::from(pt);
    // One rank on each side, token-major: half the time without head geometry (a token's bytes
    // as one row, as MLA's latent is).
    let bare = ptp == 1 && dtp == 1 && order == HeadOrder::TokenMajor && rng.random_bool(0.5);
    let with = |l: KvLayout, n: u32, pt: u32| if bare { l } else { l.with_heads(heads(n, pt)) };
    let dst = with(
        KvLayout::packed(0, layers, regions, pb(hd_n, pd), dst_pool),
        hd_n,
        pd,
    );
    let geom = ChunkGeometry::new(prompt, chunk, u64::from(pd)).unwrap();
    for d in 0..dtp {
        let mut dst_buf = vec![0u8; dst.buffer_len as usize];
        let mut hits = vec![0u8; dst_buf.len()];
        for p in 0..ptp {
            let src = with(
                KvLayout::packed(0, layers, regions, pb(hs_n, ps), src_pool),
                hs_n,
                ps,
            );
            // Source byte = a function of (layer, region, token of the request, global head, byte).
            let mut src_buf = vec![0u8; src.buffer_len as usize];
            let value = |l: u64, r: u64, t: u64, h: u64, b: u64| {
                ((l * 7 + r * 3 + t * 11 + h * 5 + b * 13) % 251 + 1) as u8
            };
            for r in 0..u64::from(regions.count()) {
                for l in 0..u64::from(layers) {
                    for t in 0..prompt {
                        let page = src_pages[(t / u64::from(ps)) as usize];
                        let base = page_at(&src, l as u32, r as u32, page);
                        for h in 0..u64::from(hs_n) {
                            for b in 0..hb {
                                let o = base
                                    + in_page(
                                        order,
                                        u64::from(ps),
                                        u64::from(hs_n),
                                        hb,
                                        t % u64::from(ps),
                                        h,
                                        b,
                                    );
                                src_buf[o as usize] = value(l, r, t, u64::from(p * hs_n) + h, b);
                            }
                        }
                    }
                }
            }
            let tp = if ptp == dtp {
                TpMapping::Identical
            } else {
                TpMapping::HeadSliced {
                    prefill_tp: ptp,
                    decode_tp: dtp,
                    prefill_rank: p,
                    decode_rank: d,
                }
            };
            let planner = match Planner::with_page_tokens(&src, &dst, tp, ps, pd) {
                Ok(pl) => pl,
                // Ranks that share no head have nothing to plan.
                Err(PlanError::HeadMismatch(_)) if ptp != dtp => continue,
                Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
            };
            let mut writes = Vec::new();
            for c in 0..geom.num_chunks() {
                planner
                    .plan_chunk(&geom, c, &src_pages, &dst_pages, &mut writes)
                    .map_err(|e| TestCaseError::fail(format!("{e}")))?;
            }
            execute(&writes, &src_buf, &mut dst_buf, &mut hits).map_err(TestCaseError::fail)?;
            // Coalesced: never more than one write per (region, layer, run of tokens in one page
            // on each side); with K by columns, two per head written (K's columns, then V).
            let per_run = match order {
                HeadOrder::KeyColumns { .. } => 2 * u64::from(hs_n.min(hd_n)),
                _ => 1,
            };
            let runs = (sp_n + dp_n) * per_run;
            prop_assert!(
                writes.len() as u64 <= u64::from(regions.count()) * u64::from(layers) * runs
            );
        }
        // Every byte of the request's tokens in decode rank d: written once, with its value.
        let mut want_hits = vec![0u8; dst_buf.len()];
        for r in 0..u64::from(regions.count()) {
            for l in 0..u64::from(layers) {
                for t in 0..prompt {
                    let page = dst_pages[(t / u64::from(pd)) as usize];
                    let base = page_at(&dst, l as u32, r as u32, page);
                    for h in 0..u64::from(hd_n) {
                        for b in 0..hb {
                            let o = (base
                                + in_page(
                                    order,
                                    u64::from(pd),
                                    u64::from(hd_n),
                                    hb,
                                    t % u64::from(pd),
                                    h,
                                    b,
                                )) as usize;
                            want_hits[o] = 1;
                            let g = u64::from(d * hd_n) + h;
                            let want = ((l * 7 + r * 3 + t * 11 + g * 5 + b * 13) % 251 + 1) as u8;
                            prop_assert_eq!(
                                dst_buf[o],
                                want,
                                "layer {} region {} token {} head {} byte {}",
                                l,
                                r,
                                t,
                                g,
                                b
                            );
                        }
                    }
                }
            }
        }
        prop_assert_eq!(hits, want_hits);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn different_page_sizes_every_byte_once(seed in any::<u64>()) {
        check_page_sizes(seed)?;
    }

    #[test]
    fn whole_pages_every_byte_once(seed in any::<u64>()) {
        check_whole_pages(seed)?;
    }

    #[test]
    fn head_sliced_every_byte_once(seed in any::<u64>()) {
        check_head_sliced(seed)?;
    }
}

/// The default MLA workload: 61 layers, 576 B/token/layer, 64-token pages, 8k prompt, PP=4,
/// 1024-token chunks. With contiguous page lists each (chunk, layer) is one write.
#[test]
fn mla_default_workload() {
    let pp = 4;
    let geom = ChunkGeometry::new(8192, 1024, 64).unwrap();
    let pages = geom.num_pages() as u32;
    assert_eq!((pages, geom.num_chunks()), (128, 8));
    let page_bytes = 64 * 576;
    let dst = KvLayout::packed(0, 61, RegionKind::Fused, page_bytes, 1024);
    let list: Vec<u32> = (100..100 + pages).collect();
    let mut total = 0u64;
    let mut writes = 0usize;
    for rank in 0..pp {
        let layers = PpSplit::VllmEven.layer_range(61, pp, rank).unwrap();
        let src = KvLayout::packed(
            layers.start,
            layers.len() as u32,
            RegionKind::Fused,
            page_bytes,
            1024,
        );
        let planner = Planner::new(&src, &dst, TpMapping::Replicated).unwrap();
        for c in 0..geom.num_chunks() {
            let mut out = Vec::new();
            planner
                .plan_chunk(&geom, c, &list, &list, &mut out)
                .unwrap();
            assert_eq!(out.len(), layers.len());
            writes += out.len();
            total += out.iter().map(|w| w.len).sum::<u64>();
        }
    }
    assert_eq!(writes, 61 * 8);
    assert_eq!(total, 61 * 8192 * 576);
}

#[test]
fn layout_and_mapping_errors() {
    let l = KvLayout::packed(0, 4, RegionKind::SplitKv, 64, 8);
    let mut short = l.clone();
    short.buffer_len -= 1;
    assert!(matches!(
        Planner::new(&l, &short, TpMapping::Identical),
        Err(PlanError::LayoutOutOfBuffer {
            side: Side::Dst,
            ..
        })
    ));
    let mut overlap = l.clone();
    overlap.layer_stride = 64 * 7;
    assert!(matches!(
        overlap.validate(Side::Src),
        Err(PlanError::InvalidLayout { .. })
    ));
    let fused = KvLayout::packed(0, 4, RegionKind::Fused, 64, 8);
    assert_eq!(
        Planner::new(&l, &fused, TpMapping::Identical).unwrap_err(),
        PlanError::RegionMismatch
    );
    let other = KvLayout::packed(0, 4, RegionKind::SplitKv, 32, 8);
    assert!(matches!(
        Planner::new(&l, &other, TpMapping::Identical),
        Err(PlanError::PageBytesMismatch { .. })
    ));
    let upper = KvLayout::packed(2, 4, RegionKind::SplitKv, 64, 8);
    assert!(matches!(
        Planner::new(&upper, &l, TpMapping::Identical),
        Err(PlanError::LayersNotCovered { .. })
    ));
    assert!(matches!(
        Planner::new(
            &l,
            &l,
            TpMapping::HeadSliced {
                prefill_tp: 1,
                decode_tp: 2,
                prefill_rank: 0,
                decode_rank: 0
            }
        ),
        Err(PlanError::HeadsRequired(Side::Src))
    ));
    let p = Planner::new(&l, &l, TpMapping::Identical).unwrap();
    let g = ChunkGeometry::new(100, 30, 16).unwrap();
    let mut out = Vec::new();
    assert!(matches!(
        p.plan_chunk(&g, 0, &[0; 3], &[0; 7], &mut out),
        Err(PlanError::PageListLength {
            side: Side::Src,
            ..
        })
    ));
    assert!(matches!(
        p.plan_chunk(
            &g,
            0,
            &[0, 1, 2, 3, 4, 5, 6],
            &[8, 1, 2, 3, 4, 5, 6],
            &mut out
        ),
        Err(PlanError::PageOutOfRange {
            side: Side::Dst,
            position: 0,
            page: 8,
            ..
        })
    ));
    assert!(out.is_empty());
    assert_eq!(ChunkGeometry::new(0, 1, 1), Err(PlanError::BadGeometry));
}
