//! The bytes kvbench and the workspace tests move, and how a destination is checked against them.
//!
//! Every byte of a request's KV cache is named by the request, the PP rank that sends it and its
//! position in the request, so a byte left over from an earlier request, sent by the wrong rank or
//! written to the wrong page never matches. A prefill writes a request's pattern into the source pages
//! just before sending it ([`write_source`]); decode poisons the destination pages just before
//! `expect` ([`poison`]) and checks them by copying them out after `Complete` ([`check`]). A write that
//! never arrived leaves poison behind, which no pattern page equals.
//!
//! A request's position space is its pages as if packed `[layer][region][page]` over all layers:
//! the byte `b` of page `i` (of `n`) of region `g` of global layer `l` is at
//! `((l * regions + g) * n + i) * page_bytes + b`. It depends neither on where the pages sit in
//! either pool nor on which process writes them, so a decode process can check a request that a
//! prefill process in another address space (or another language) wrote.

use std::fmt;
use std::ops::Range;
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::KvLayout;

/// The byte destination pages hold until a request's writes land. A whole page of it is never a
/// pattern page (the pattern is pseudo-random), so a page still full of it is a write that never
/// arrived.
pub const POISON: u8 = 0xA5;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output function: a bijection on u64 that mixes every input bit into every output bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The stream of a (request, rank) pair: splitmix64 seeded from both, so each pair gets its own.
fn seed(request: RequestId, rank: u16) -> u64 {
    mix(request.0 ^ mix(u64::from(rank).wrapping_add(GOLDEN)))
}

/// Word `k` of a stream: splitmix64's `k`-th output, computed directly so any offset costs the same.
fn word(seed: u64, k: u64) -> u64 {
    mix(seed.wrapping_add(k.wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// The pattern byte at `offset` of what `rank` sends for `request`.
pub fn pattern(request: RequestId, rank: u16, offset: u64) -> u8 {
    word(seed(request, rank), offset / 8).to_le_bytes()[(offset % 8) as usize]
}

/// Fills `out` with the pattern bytes `offset..offset + out.len()` of (`request`, `rank`).
pub fn fill(request: RequestId, rank: u16, offset: u64, out: &mut [u8]) {
    let s = seed(request, rank);
    // Up to the next multiple of 8, then whole words, then the tail: one mix per 8 bytes.
    let head = ((8 - offset % 8) % 8).min(out.len() as u64) as usize;
    let (first, rest) = out.split_at_mut(head);
    for (i, b) in first.iter_mut().enumerate() {
        *b = pattern(request, rank, offset + i as u64);
    }
    let mut k = (offset + head as u64) / 8;
    let mut words = rest.chunks_exact_mut(8);
    for w in &mut words {
        w.copy_from_slice(&word(s, k).to_le_bytes());
        k += 1;
    }
    let tail = words.into_remainder();
    let last = word(s, k).to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// The first index where `got` differs from the pattern bytes at `offset` of (`request`, `rank`).
pub fn first_difference(request: RequestId, rank: u16, offset: u64, got: &[u8]) -> Option<usize> {
    let mut want = [0u8; 4096];
    let mut at = 0;
    for piece in got.chunks(want.len()) {
        let want = &mut want[..piece.len()];
        fill(request, rank, offset + at as u64, want);
        // Slice equality first: it stays fast in debug builds, where a byte loop does not.
        if piece != want {
            return piece
                .iter()
                .zip(want.iter())
                .position(|(a, b)| a != b)
                .map(|j| at + j);
        }
        at += piece.len();
    }
    None
}

/// Why a check failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum VerifyError {
    /// The pool refused a copy (a range outside it, device memory).
    Pool(String),
    /// A page list does not match the request's page count, or a layer is outside the layout.
    Pages(String),
    /// A destination byte differs from its pattern.
    Mismatch {
        /// The rank whose layer it is.
        rank: u16,
        /// Global layer.
        layer: u32,
        /// Region (0, or 1 for V).
        region: u32,
        /// Index of the page in the request.
        page: usize,
        /// The page in the decode pool.
        dst_page: u32,
        /// Offset of the first differing byte in the page.
        byte: usize,
        /// The whole page still holds [`POISON`]: its write never landed.
        still_poisoned: bool,
    },
    /// A head's bytes for one token differ from their pattern (a run whose two sides' TP sizes
    /// or page sizes may differ, [`crate::tp`]).
    Head {
        /// The decode TP rank.
        rank: u16,
        /// The global KV head (0 for MLA's latent).
        head: u32,
        /// Where in that rank's pool.
        offset: u64,
        /// They still hold [`POISON`]: their write never landed.
        still_poisoned: bool,
    },
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VerifyError::Pool(e) => write!(f, "pool copy failed: {e}"),
            VerifyError::Pages(e) => write!(f, "bad page list: {e}"),
            VerifyError::Mismatch {
                rank,
                layer,
                region,
                page,
                dst_page,
                byte,
                still_poisoned,
            } => {
                write!(
                    f,
                    "rank {rank} layer {layer} region {region} page {page} (decode page {dst_page}) \
                     differs at byte {byte}"
                )?;
                if *still_poisoned {
                    f.write_str(": the page is still poisoned, its write never landed")?;
                }
                Ok(())
            }
            VerifyError::Head {
                rank,
                head,
                offset,
                still_poisoned,
            } => {
                write!(
                    f,
                    "decode TP rank {rank}, head {head}: bytes at pool offset {offset} differ"
                )?;
                if *still_poisoned {
                    f.write_str(" (still poisoned, their write never landed)")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for VerifyError {}

/// Position of (global `layer`, `region`, page `i` of `n`) in the request's position space.
fn position(layout: &KvLayout, layer: u32, region: u32, i: usize, n: usize) -> u64 {
    let regions = u64::from(layout.regions.count());
    ((u64::from(layer) * regions + u64::from(region)) * n as u64 + i as u64) * layout.page_bytes
}

/// Offset in a pool of (global `layer`, `region`, pool page `page`).
fn pool_offset(layout: &KvLayout, layer: u32, region: u32, page: u32) -> Result<u64, VerifyError> {
    if !layout.layers().contains(&layer) || page >= layout.num_pages {
        return Err(VerifyError::Pages(format!(
            "layer {layer} page {page} is outside the layout (layers {:?}, {} pages)",
            layout.layers(),
            layout.num_pages
        )));
    }
    Ok(layout.base_offset
        + u64::from(region) * layout.region_stride
        + u64::from(layer - layout.first_layer) * layout.layer_stride
        + u64::from(page) * layout.page_bytes)
}

/// Every (global layer, region) of `layout`.
fn layer_regions(layout: &KvLayout) -> impl Iterator<Item = (u32, u32)> + '_ {
    layout
        .layers()
        .flat_map(|l| (0..layout.regions.count()).map(move |g| (l, g)))
}

/// Writes `request`'s pattern, as PP rank `rank` sends it, into `src_pages` (one per page of the
/// prompt) of every layer of the rank's pool `layout`, through `write(offset, bytes)` (for an
/// engine, `PrefillEngine::write_pool`). Call it only while no chunk in flight reads those pages.
///
/// # Errors
/// A page outside the layout, or the first error `write` returns.
pub fn write_source<E: fmt::Display>(
    layout: &KvLayout,
    request: RequestId,
    rank: u16,
    src_pages: &[u32],
    mut write: impl FnMut(u64, &[u8]) -> Result<(), E>,
) -> Result<(), VerifyError> {
    let mut page = vec![0u8; layout.page_bytes as usize];
    for (layer, region) in layer_regions(layout) {
        for (i, &p) in src_pages.iter().enumerate() {
            let at = pool_offset(layout, layer, region, p)?;
            fill(
                request,
                rank,
                position(layout, layer, region, i, src_pages.len()),
                &mut page,
            );
            write(at, &page).map_err(|e| VerifyError::Pool(e.to_string()))?;
        }
    }
    Ok(())
}

/// Fills `dst_pages` of every layer of the decode pool `layout` with [`POISON`] through
/// `write(offset, bytes)` (for an engine, `DecodeEngine::write_pool`). Call it only for pages no live
/// request holds, before handing them to `expect`.
///
/// # Errors
/// A page outside the layout, or the first error `write` returns.
pub fn poison<E: fmt::Display>(
    layout: &KvLayout,
    dst_pages: &[u32],
    mut write: impl FnMut(u64, &[u8]) -> Result<(), E>,
) -> Result<(), VerifyError> {
    let page = vec![POISON; layout.page_bytes as usize];
    for (layer, region) in layer_regions(layout) {
        for &p in dst_pages {
            write(pool_offset(layout, layer, region, p)?, &page)
                .map_err(|e| VerifyError::Pool(e.to_string()))?;
        }
    }
    Ok(())
}

/// Checks `dst_pages` of the decode pool `layout` against `request`'s pattern, copying each page out
/// through `read(offset, buffer)` (for an engine, `DecodeEngine::read_pool`): the layers of each rank
/// in `ranks` (indexed by rank, global layer ranges) must hold that rank's pattern. Returns the bytes
/// checked.
///
/// # Errors
/// The first page that differs ([`VerifyError::Mismatch`]), a page or layer outside the layout, or
/// the first error `read` returns.
pub fn check<E: fmt::Display>(
    layout: &KvLayout,
    ranks: &[Range<u32>],
    request: RequestId,
    dst_pages: &[u32],
    mut read: impl FnMut(u64, &mut [u8]) -> Result<(), E>,
) -> Result<u64, VerifyError> {
    let n = dst_pages.len();
    let mut page = vec![0u8; layout.page_bytes as usize];
    let mut checked = 0;
    for (rank, layers) in ranks.iter().enumerate() {
        let rank = u16::try_from(rank).map_err(|_| VerifyError::Pages("too many ranks".into()))?;
        for layer in layers.clone() {
            for region in 0..layout.regions.count() {
                for (i, &p) in dst_pages.iter().enumerate() {
                    read(pool_offset(layout, layer, region, p)?, &mut page)
                        .map_err(|e| VerifyError::Pool(e.to_string()))?;
                    let at = position(layout, layer, region, i, n);
                    if let Some(byte) = first_difference(request, rank, at, &page) {
                        return Err(VerifyError::Mismatch {
                            rank,
                            layer,
                            region,
                            page: i,
                            dst_page: p,
                            byte,
                            still_poisoned: page.iter().all(|&b| b == POISON),
                        });
                    }
                    checked += page.len() as u64;
                }
            }
        }
    }
    Ok(checked)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use transfer_engine::core::planner::RegionKind;

    #[test]
    fn fill_matches_pattern_at_any_alignment() {
        let r = RequestId(42);
        for offset in 0..17u64 {
            for len in [0usize, 1, 7, 8, 9, 23, 64] {
                let mut b = vec![0u8; len];
                fill(r, 3, offset, &mut b);
                for (i, &x) in b.iter().enumerate() {
                    assert_eq!(x, pattern(r, 3, offset + i as u64), "{offset} {len} {i}");
                }
                assert_eq!(first_difference(r, 3, offset, &b), None);
            }
        }
    }

    #[test]
    fn requests_and_ranks_get_different_bytes() {
        let mut a = [0u8; 256];
        let mut b = [0u8; 256];
        fill(RequestId(1), 0, 0, &mut a);
        fill(RequestId(2), 0, 0, &mut b);
        assert_ne!(a, b);
        fill(RequestId(1), 1, 0, &mut b);
        assert_ne!(a, b);
        fill(RequestId(1), 0, 8, &mut b);
        assert_ne!(a, b);
        assert_eq!(first_difference(RequestId(2), 0, 0, &a), Some(0));
        assert_ne!(a, [POISON; 256]);
    }

    #[test]
    fn a_poisoned_page_or_another_requests_page_fails_the_check() {
        let layout = KvLayout::packed(0, 2, RegionKind::SplitKv, 64, 4);
        let mut pool = vec![0u8; layout.buffer_len as usize];
        let ranks = [0..1, 1..2];
        let dst = [3, 1];
        let write = |pool: &mut Vec<u8>, at: u64, b: &[u8]| {
            pool[at as usize..at as usize + b.len()].copy_from_slice(b);
            Ok::<(), String>(())
        };
        poison(&layout, &dst, |at, b| write(&mut pool, at, b)).unwrap();
        // What two ranks write: each its own layer, its own pattern, at its own position.
        for (rank, layers) in ranks.iter().enumerate() {
            let src = KvLayout::packed(layers.start, 1, RegionKind::SplitKv, 64, 4);
            let mut spool = vec![0u8; src.buffer_len as usize];
            write_source(&src, RequestId(9), rank as u16, &[0, 2], |at, b| {
                write(&mut spool, at, b)
            })
            .unwrap();
            for region in 0..2 {
                for (i, p) in [0u32, 2].iter().enumerate() {
                    let s = pool_offset(&src, layers.start, region, *p).unwrap() as usize;
                    let d = pool_offset(&layout, layers.start, region, dst[i]).unwrap() as usize;
                    pool[d..d + 64].copy_from_slice(&spool[s..s + 64]);
                }
            }
        }
        let read = |pool: &Vec<u8>, at: u64, b: &mut [u8]| {
            b.copy_from_slice(&pool[at as usize..at as usize + b.len()]);
            Ok::<(), String>(())
        };
        let ok = check(&layout, &ranks, RequestId(9), &dst, |at, b| {
            read(&pool, at, b)
        });
        assert_eq!(ok, Ok(2 * 2 * 2 * 64));
        // Another request's check of the same bytes fails at once.
        assert!(matches!(
            check(&layout, &ranks, RequestId(10), &dst, |at, b| read(
                &pool, at, b
            )),
            Err(VerifyError::Mismatch {
                still_poisoned: false,
                ..
            })
        ));
        // One page poisoned again: its write "never landed".
        let at = pool_offset(&layout, 1, 1, 1).unwrap() as usize;
        pool[at..at + 64].fill(POISON);
        assert_eq!(
            check(&layout, &ranks, RequestId(9), &dst, |at, b| read(
                &pool, at, b
            )),
            Err(VerifyError::Mismatch {
                rank: 1,
                layer: 1,
                region: 1,
                page: 1,
                dst_page: 1,
                byte: 0,
                still_poisoned: true
            })
        );
    }
}
