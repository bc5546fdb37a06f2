//! Transfer planning: which bytes of which pages each chunk of each PP rank writes, and where.
//!
//! Inputs are both sides' [`KvLayout`]s, the PP layer split ([`PpSplit`]), the TP mapping
//! ([`TpMapping`]) and a request's page lists; the output is a list of [`Write`]s (offset in the
//! local source buffer, offset in the remote destination buffer, length) with neighbours merged.
//!
//! # Which pages a chunk sends
//! A prompt of `T` tokens fills `ceil(T / page_tokens)` pages and is computed in
//! `ceil(T / chunk_tokens)` chunks. Page `p` holds tokens `[p*page_tokens, min((p+1)*page_tokens,
//! T))` and is sent by the chunk that computes its *last* token. So every page is sent exactly
//! once, never before all its tokens exist, and the final, partial page goes with the final chunk.
//! Chunk `c` sends pages `floor(c*chunk_tokens / page_tokens) .. floor((c+1)*chunk_tokens /
//! page_tokens)` (the end is `ceil(T / page_tokens)` for the last chunk). A chunk shorter than a
//! page may send no page at all; it is still a chunk and is still notified.
//!
//! # Address of a page
//! In a layout, the bytes of (local layer `l`, region `r`, page `p`) start at
//! `base_offset + r*region_stride + l*layer_stride + p*page_bytes` and run for `page_bytes`.
//! Region 0 is K (or the fused latent for MLA), region 1 is V.

use std::ops::Range;

/// Whether K and V are separate regions or one fused region (MLA's latent cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegionKind {
    /// One region per layer.
    Fused,
    /// K (region 0) and V (region 1).
    SplitKv,
}

impl RegionKind {
    /// Number of regions.
    pub const fn count(self) -> u32 {
        match self {
            Self::Fused => 1,
            Self::SplitKv => 2,
        }
    }
}

/// How heads lie inside one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeadOrder {
    /// `[head][token][head_bytes]`: one head's tokens are contiguous.
    HeadMajor,
    /// `[token][head][head_bytes]`: one token's heads are contiguous (SGLang, vLLM default).
    TokenMajor,
    /// Head-major, and inside a head's part of the page first K, then V, `head_bytes / 2` of
    /// each per token: K by columns (`[element][token]`, `elem_bytes` per element), V by rows
    /// (`[token][head_bytes / 2]`). vLLM's CPU attention keeps its blocks so (its `vec` kernels).
    /// A head's part is contiguous, as in [`HeadMajor`](Self::HeadMajor); only a run of tokens
    /// inside it is not.
    KeyColumns {
        /// Bytes of one element of K.
        elem_bytes: u32,
    },
}

impl HeadOrder {
    /// Whether one head's tokens lie together in a page (its part is contiguous).
    pub const fn head_major(self) -> bool {
        !matches!(self, Self::TokenMajor)
    }
}

/// Head geometry of a page, needed only for head-sliced TP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeadLayout {
    /// KV heads held by this TP rank.
    pub num_heads: u32,
    /// Bytes of one head for one token.
    pub head_bytes: u64,
    /// Tokens per page.
    pub page_tokens: u32,
    /// Order inside a page.
    pub order: HeadOrder,
}

/// One side's KV cache pool in its registered buffer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Global index of the first layer held.
    pub first_layer: u32,
    /// Layers held.
    pub num_layers: u32,
    /// Fused or K/V.
    pub regions: RegionKind,
    /// Bytes of one page of one layer in one region (`page_tokens * bytes per token`).
    pub page_bytes: u64,
    /// Pages in the pool.
    pub num_pages: u32,
    /// Bytes from one layer's pool to the next, within a region.
    pub layer_stride: u64,
    /// Bytes from region 0 to region 1 (ignored when fused).
    pub region_stride: u64,
    /// Offset of (layer 0, region 0, page 0) in the buffer.
    pub base_offset: u64,
    /// Length of the registered buffer; nothing may be addressed past it.
    pub buffer_len: u64,
    /// Head geometry, for head-sliced TP.
    pub heads: Option<HeadLayout>,
}

impl KvLayout {
    /// The usual packed layout `[region][layer][page]` at offset 0 of a buffer of exactly its
    /// size.
    pub fn packed(
        first_layer: u32,
        num_layers: u32,
        regions: RegionKind,
        page_bytes: u64,
        num_pages: u32,
    ) -> Self {
        let layer_stride = page_bytes.saturating_mul(u64::from(num_pages));
        let region_stride = layer_stride.saturating_mul(u64::from(num_layers));
        Self {
            first_layer,
            num_layers,
            regions,
            page_bytes,
            num_pages,
            layer_stride,
            region_stride,
            base_offset: 0,
            buffer_len: region_stride.saturating_mul(u64::from(regions.count())),
            heads: None,
        }
    }

    /// The same layout with head geometry.
    #[must_use]
    pub fn with_heads(mut self, heads: HeadLayout) -> Self {
        self.heads = Some(heads);
        self
    }

    /// Global layers held.
    pub fn layers(&self) -> Range<u32> {
        self.first_layer..self.first_layer.saturating_add(self.num_layers)
    }

    /// Offset of (local layer, region, page); assumes a validated layout and indices in range.
    fn offset(&self, layer: u32, region: u32, page: u32) -> u64 {
        self.base_offset
            + u64::from(region) * self.region_stride
            + u64::from(layer) * self.layer_stride
            + u64::from(page) * self.page_bytes
    }

    /// Checks that the layout is self-consistent: non-empty, no two (layer, region) pools
    /// overlap, everything inside `buffer_len`, heads (if any) fill a page exactly.
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] or [`PlanError::LayoutOutOfBuffer`], naming `side`.
    pub fn validate(&self, side: Side) -> Result<(), PlanError> {
        let bad = |what| Err(PlanError::InvalidLayout { side, what });
        if self.num_layers == 0 {
            return bad("no layers");
        }
        if self.num_layers > MAX_LAYERS {
            return bad("more than 65536 layers");
        }
        if self.page_bytes == 0 || self.num_pages == 0 {
            return bad("empty pages or pool");
        }
        if self.first_layer.checked_add(self.num_layers).is_none() {
            return bad("layer range overflows");
        }
        let span = self
            .page_bytes
            .checked_mul(u64::from(self.num_pages))
            .ok_or(PlanError::InvalidLayout {
                side,
                what: "pool size overflows",
            })?;
        let overflow = PlanError::InvalidLayout {
            side,
            what: "offsets overflow",
        };
        let mut starts = Vec::with_capacity((self.num_layers * self.regions.count()) as usize);
        for r in 0..self.regions.count() {
            for l in 0..self.num_layers {
                let s = u64::from(r)
                    .checked_mul(self.region_stride)
                    .and_then(|a| {
                        u64::from(l)
                            .checked_mul(self.layer_stride)
                            .and_then(|b| a.checked_add(b))
                    })
                    .and_then(|o| o.checked_add(self.base_offset))
                    .ok_or(overflow)?;
                starts.push(s);
            }
        }
        starts.sort_unstable();
        for w in starts.windows(2) {
            if w[0] + span > w[1] {
                return bad("layer or region pools overlap");
            }
        }
        let end = starts
            .last()
            .and_then(|s| s.checked_add(span))
            .ok_or(overflow)?;
        if end > self.buffer_len {
            return Err(PlanError::LayoutOutOfBuffer {
                side,
                needed: end,
                buffer_len: self.buffer_len,
            });
        }
        if let Some(h) = self.heads {
            let bytes = u64::from(h.num_heads)
                .checked_mul(h.head_bytes)
                .and_then(|b| b.checked_mul(u64::from(h.page_tokens)));
            if h.num_heads == 0 || bytes != Some(self.page_bytes) {
                return bad("heads * head_bytes * page_tokens != page_bytes");
            }
            if let HeadOrder::KeyColumns { elem_bytes } = h.order
                && (elem_bytes == 0 || !h.head_bytes.is_multiple_of(2 * u64::from(elem_bytes)))
            {
                return bad("K columns: head bytes are not whole elements of K and V");
            }
        }
        Ok(())
    }
}

const MAX_LAYERS: u32 = 1 << 16;

/// Which side of a transfer an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The local (prefill) source.
    Src,
    /// The remote (decode) destination.
    Dst,
}

/// How layers are split across PP ranks.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PpSplit {
    /// vLLM's even split (`get_pp_indices` without `VLLM_PP_LAYER_PARTITION`): each rank gets
    /// `L / P`; the `L % P` extra layers go one each to the ranks just before the last (ranks
    /// `P-2, P-3, ...`), since the last rank also carries the final norm and head.
    VllmEven,
    /// SGLang's even split (without `SGLANG_PP_LAYER_PARTITION`): the extra layers go one each
    /// to the last `L % P` ranks.
    SglangEven,
    /// Layer counts per rank, in rank order (what both `*_PP_LAYER_PARTITION` variables say).
    Explicit(Vec<u32>),
}

impl PpSplit {
    /// Layer count of every rank.
    ///
    /// # Errors
    /// [`PlanError::ZeroPpSize`], [`PlanError::SplitMismatch`] (explicit list of the wrong length
    /// or sum), [`PlanError::EmptyRank`] (a rank with no layers).
    pub fn counts(&self, total_layers: u32, pp_size: u16) -> Result<Vec<u32>, PlanError> {
        if pp_size == 0 {
            return Err(PlanError::ZeroPpSize);
        }
        let p = u32::from(pp_size);
        let counts = match self {
            Self::VllmEven | Self::SglangEven => {
                let (base, extra) = (total_layers / p, total_layers % p);
                let mut c = vec![base; usize::from(pp_size)];
                for i in 0..extra {
                    let idx = match self {
                        // 1 <= extra <= p-1, so p-2-i stays in range.
                        Self::VllmEven => p - 2 - i,
                        _ => p - 1 - i,
                    };
                    c[idx as usize] += 1;
                }
                c
            }
            Self::Explicit(v) => {
                let sum = v.iter().try_fold(0u32, |a, &b| a.checked_add(b));
                if v.len() != usize::from(pp_size) || sum != Some(total_layers) {
                    return Err(PlanError::SplitMismatch {
                        pp_size,
                        total_layers,
                    });
                }
                v.clone()
            }
        };
        if let Some(r) = counts.iter().position(|&c| c == 0) {
            return Err(PlanError::EmptyRank { rank: r as u16 });
        }
        Ok(counts)
    }

    /// Global layers `[start, end)` of `rank`.
    ///
    /// # Errors
    /// As [`counts`](Self::counts), and [`PlanError::RankOutOfRange`].
    pub fn layer_range(
        &self,
        total_layers: u32,
        pp_size: u16,
        rank: u16,
    ) -> Result<Range<u32>, PlanError> {
        let counts = self.counts(total_layers, pp_size)?;
        if rank >= pp_size {
            return Err(PlanError::RankOutOfRange { rank, pp_size });
        }
        let start: u32 = counts[..usize::from(rank)].iter().sum();
        Ok(start..start + counts[usize::from(rank)])
    }
}

/// How prefill TP ranks map onto decode TP ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TpMapping {
    /// Same TP size and head split on both sides: whole pages, rank `i` to rank `i`.
    Identical,
    /// MLA: every decode TP rank holds the whole latent, so whole pages go to each of them.
    Replicated,
    /// KV heads split differently: this prefill rank writes the heads it shares with the decode
    /// rank. Both layouts need [`HeadLayout`]s of the same order, head size and page tokens.
    HeadSliced {
        /// Prefill TP size.
        prefill_tp: u32,
        /// Decode TP size.
        decode_tp: u32,
        /// This prefill TP rank.
        prefill_rank: u32,
        /// The decode TP rank written to.
        decode_rank: u32,
    },
    /// Global KV heads `first..first + count`, from a source rank whose first held head is
    /// `src_first` to a destination rank whose first held head is `dst_first` (what
    /// [`crate::core::topology::sources`] names, replicated GQA heads included). Both layouts need
    /// [`HeadLayout`]s of the same order, head size and page tokens.
    Heads {
        /// First global head the source rank holds.
        src_first: u32,
        /// First global head the destination rank holds.
        dst_first: u32,
        /// First global head written.
        first: u32,
        /// Heads written.
        count: u32,
    },
}

impl TpMapping {
    /// The mapping for `source` (from [`crate::core::topology::sources`]) between the prefill and
    /// decode shapes: whole pages for MLA, identical when the source writes every head of both
    /// ranks, heads otherwise.
    pub fn for_source(
        prefill: crate::core::topology::TpShape,
        decode: crate::core::topology::TpShape,
        decode_rank: u32,
        source: &crate::core::topology::Source,
    ) -> Self {
        if source.heads.is_empty() {
            return if prefill.tp_size == 1 && decode.tp_size == 1 {
                TpMapping::Identical
            } else {
                TpMapping::Replicated
            };
        }
        let (s, d) = (
            prefill.heads_of(source.prefill_rank),
            decode.heads_of(decode_rank),
        );
        if s == source.heads && d == source.heads {
            return TpMapping::Identical;
        }
        TpMapping::Heads {
            src_first: s.start,
            dst_first: d.start,
            first: source.heads.start,
            count: source.heads.len() as u32,
        }
    }
}

/// One write: `rows` pieces of `len` bytes, the `i`-th from `src_offset + i * src_stride` of the
/// local buffer to `dst_offset + i * dst_stride` of the remote. A plain write has one row (its
/// strides are then 0); sliced heads in token-major pages are one write of many rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Write {
    /// Offset in the local source buffer of the first row.
    pub src_offset: u64,
    /// Offset in the remote destination buffer of the first row.
    pub dst_offset: u64,
    /// Bytes of one row.
    pub len: u64,
    /// Rows, at least 1.
    pub rows: u64,
    /// Bytes from one row to the next in the source (0 with one row).
    pub src_stride: u64,
    /// Bytes from one row to the next in the destination (0 with one row).
    pub dst_stride: u64,
}

impl Write {
    /// One contiguous piece.
    pub const fn contiguous(src_offset: u64, dst_offset: u64, len: u64) -> Self {
        Self {
            src_offset,
            dst_offset,
            len,
            rows: 1,
            src_stride: 0,
            dst_stride: 0,
        }
    }

    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.len * self.rows
    }

    /// The rows as `(src offset, dst offset)`, each `len` bytes long, in order.
    pub fn pieces(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.rows).map(|i| {
            (
                self.src_offset + i * self.src_stride,
                self.dst_offset + i * self.dst_stride,
            )
        })
    }
}

/// A prompt's token geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkGeometry {
    /// Prompt length in tokens.
    pub prompt_tokens: u64,
    /// Tokens per prefill chunk.
    pub chunk_tokens: u64,
    /// Tokens per page.
    pub page_tokens: u64,
}

impl ChunkGeometry {
    /// # Errors
    /// [`PlanError::BadGeometry`] when any value is 0.
    pub fn new(prompt_tokens: u64, chunk_tokens: u64, page_tokens: u64) -> Result<Self, PlanError> {
        if prompt_tokens == 0 || chunk_tokens == 0 || page_tokens == 0 {
            return Err(PlanError::BadGeometry);
        }
        Ok(Self {
            prompt_tokens,
            chunk_tokens,
            page_tokens,
        })
    }

    /// The geometry of a request that moves the `prompt_tokens` after a prefix of `prefix_tokens`
    /// that the receiver already holds. When the receiver holds the whole prompt (no token to
    /// move after a non-empty prefix), the request is one chunk of no pages: its notification
    /// alone tells that the rank is done (and what rides beside it, such as metadata rows, is
    /// in place).
    ///
    /// # Errors
    /// [`PlanError::BadGeometry`] when the chunk or page size is 0, or nothing is moved and
    /// there is no prefix either.
    pub fn after_prefix(
        prompt_tokens: u64,
        chunk_tokens: u64,
        page_tokens: u64,
        prefix_tokens: u64,
    ) -> Result<Self, PlanError> {
        if prompt_tokens == 0 && prefix_tokens > 0 && chunk_tokens > 0 && page_tokens > 0 {
            return Ok(Self {
                prompt_tokens,
                chunk_tokens,
                page_tokens,
            });
        }
        Self::new(prompt_tokens, chunk_tokens, page_tokens)
    }

    /// Pages the prompt fills.
    pub fn num_pages(&self) -> u64 {
        self.prompt_tokens.div_ceil(self.page_tokens.max(1))
    }

    /// Chunks the prompt is computed in (the count each rank announces with `LAST`); one, of no
    /// pages, when nothing is moved (see [`after_prefix`](Self::after_prefix)).
    pub fn num_chunks(&self) -> u64 {
        self.prompt_tokens.div_ceil(self.chunk_tokens.max(1)).max(1)
    }

    /// Positions (into the request's page lists) of the pages chunk `chunk` sends.
    ///
    /// # Errors
    /// [`PlanError::BadGeometry`], [`PlanError::ChunkOutOfRange`].
    pub fn pages_of_chunk(&self, chunk: u64) -> Result<Range<u64>, PlanError> {
        if self.chunk_tokens == 0 || self.page_tokens == 0 {
            return Err(PlanError::BadGeometry);
        }
        let n = self.num_chunks();
        if chunk >= n {
            return Err(PlanError::ChunkOutOfRange {
                chunk,
                num_chunks: n,
            });
        }
        // chunk < n keeps these products below prompt_tokens + chunk_tokens.
        let first_tok = u128::from(chunk) * u128::from(self.chunk_tokens);
        let end_tok = first_tok + u128::from(self.chunk_tokens);
        let pt = u128::from(self.page_tokens);
        let start = (first_tok / pt) as u64;
        let end = if end_tok >= u128::from(self.prompt_tokens) {
            self.num_pages()
        } else {
            (end_tok / pt) as u64
        };
        Ok(start..end)
    }
}

/// Why a plan cannot be made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// A layout breaks its own rules.
    #[error("{side:?} layout invalid: {what}")]
    InvalidLayout {
        /// Which side.
        side: Side,
        /// What is wrong.
        what: &'static str,
    },
    /// A layout addresses past its buffer.
    #[error("{side:?} layout needs {needed} bytes, buffer has {buffer_len}")]
    LayoutOutOfBuffer {
        /// Which side.
        side: Side,
        /// Bytes needed.
        needed: u64,
        /// Bytes registered.
        buffer_len: u64,
    },
    /// One side fused, the other split K/V.
    #[error("source and destination disagree on K/V regions")]
    RegionMismatch,
    /// Whole-page mappings need equal page sizes.
    #[error("page bytes differ: source {src}, destination {dst}")]
    PageBytesMismatch {
        /// Source page bytes.
        src: u64,
        /// Destination page bytes.
        dst: u64,
    },
    /// The destination does not hold every layer the source sends.
    #[error(
        "source layers {src_first}..{src_end} not all held by destination {dst_first}..{dst_end}"
    )]
    LayersNotCovered {
        /// Source first layer.
        src_first: u32,
        /// Source end layer.
        src_end: u32,
        /// Destination first layer.
        dst_first: u32,
        /// Destination end layer.
        dst_end: u32,
    },
    /// Head-sliced TP without head geometry on a side.
    #[error("head-sliced TP needs head geometry on the {0:?} side")]
    HeadsRequired(Side),
    /// Head geometry that does not line up (order, head bytes, page tokens, total heads).
    #[error("head geometry mismatch: {0}")]
    HeadMismatch(&'static str),
    /// A TP rank outside its TP size (or a TP size of 0).
    #[error("TP rank out of range")]
    TpRankOutOfRange,
    /// PP size 0.
    #[error("pp_size must be at least 1")]
    ZeroPpSize,
    /// A PP rank outside `0..pp_size`.
    #[error("PP rank {rank} out of pp_size {pp_size}")]
    RankOutOfRange {
        /// Rank.
        rank: u16,
        /// PP size.
        pp_size: u16,
    },
    /// An explicit split of the wrong length or sum.
    #[error("explicit PP split does not give {pp_size} ranks summing to {total_layers} layers")]
    SplitMismatch {
        /// PP size.
        pp_size: u16,
        /// Layers.
        total_layers: u32,
    },
    /// A PP rank would hold no layer.
    #[error("PP rank {rank} would hold no layer")]
    EmptyRank {
        /// Rank.
        rank: u16,
    },
    /// A zero in the chunk geometry.
    #[error("prompt, chunk and page tokens must be non-zero")]
    BadGeometry,
    /// A chunk past the prompt.
    #[error("chunk {chunk} out of {num_chunks}")]
    ChunkOutOfRange {
        /// Chunk.
        chunk: u64,
        /// Chunks in the prompt.
        num_chunks: u64,
    },
    /// A page list shorter than the prompt's pages.
    #[error("{side:?} page list has {len} pages, prompt needs {needed}")]
    PageListLength {
        /// Which side.
        side: Side,
        /// Pages given.
        len: usize,
        /// Pages needed.
        needed: u64,
    },
    /// Pages of different sizes that do not line up.
    #[error("page tokens differ and {0}")]
    PageTokensMismatch(&'static str),
    /// A page index outside the side's pool.
    #[error("{side:?} page index {page} (at position {position}) outside pool of {num_pages}")]
    PageOutOfRange {
        /// Which side.
        side: Side,
        /// Position in the page list.
        position: u64,
        /// Page index there.
        page: u32,
        /// Pool size.
        num_pages: u32,
    },
}

/// A validated pair of layouts and a TP mapping; plans writes for one PP rank to one decode
/// rank.
#[derive(Debug, Clone)]
pub struct Planner {
    src: KvLayout,
    dst: KvLayout,
    dst_layer_shift: u32,
    /// What one page sends, as writes relative to the page's start on each side (pages of equal
    /// tokens on both sides).
    segments: Vec<Write>,
    /// Pages of different tokens on the two sides: how a run of tokens maps.
    tokens: Option<TokenMap>,
}

/// How a run of tokens of one source page maps into one destination page, for pages that hold
/// different numbers of tokens on the two sides. A page is `[token][head][head_bytes]`
/// (token-major; a layout without head geometry is one "head" of a token's bytes) or
/// `[head][token][head_bytes]` (head-major, or head-major with K by columns,
/// [`HeadOrder::KeyColumns`]); the heads written are the source's local heads
/// `src_head..src_head + heads`, the destination's `dst_head..`.
#[derive(Debug, Clone, Copy)]
struct TokenMap {
    src_pt: u64,
    dst_pt: u64,
    order: HeadOrder,
    head_bytes: u64,
    src_heads: u64,
    dst_heads: u64,
    src_head: u64,
    dst_head: u64,
    heads: u64,
}

impl TokenMap {
    /// The writes of `n` tokens from token `ts` of a source page to token `td` of a destination
    /// page, relative to the pages' starts, handed to `emit` in order: one write, or for
    /// [`HeadOrder::KeyColumns`] two per head (K's columns as rows of a strided write, then V).
    fn runs(&self, ts: u64, td: u64, n: u64, mut emit: impl FnMut(Write)) {
        let hb = self.head_bytes;
        let mut put = |w: Write| {
            emit(if w.rows == 1 {
                Write::contiguous(w.src_offset, w.dst_offset, w.len)
            } else if w.len == w.src_stride && w.len == w.dst_stride {
                Write::contiguous(w.src_offset, w.dst_offset, w.len * w.rows)
            } else {
                w
            });
        };
        match self.order {
            HeadOrder::TokenMajor => {
                let (row_s, row_d) = (self.src_heads * hb, self.dst_heads * hb);
                put(Write {
                    src_offset: ts * row_s + self.src_head * hb,
                    dst_offset: td * row_d + self.dst_head * hb,
                    len: self.heads * hb,
                    rows: n,
                    src_stride: row_s,
                    dst_stride: row_d,
                });
            }
            HeadOrder::HeadMajor => put(Write {
                src_offset: self.src_head * self.src_pt * hb + ts * hb,
                dst_offset: self.dst_head * self.dst_pt * hb + td * hb,
                len: n * hb,
                rows: self.heads,
                src_stride: self.src_pt * hb,
                dst_stride: self.dst_pt * hb,
            }),
            HeadOrder::KeyColumns { elem_bytes } => {
                let (eb, half) = (u64::from(elem_bytes), hb / 2);
                for i in 0..self.heads {
                    let s0 = (self.src_head + i) * self.src_pt * hb;
                    let d0 = (self.dst_head + i) * self.dst_pt * hb;
                    // K: one column of the run per element, a column being a page's tokens.
                    put(Write {
                        src_offset: s0 + ts * eb,
                        dst_offset: d0 + td * eb,
                        len: n * eb,
                        rows: half / eb,
                        src_stride: self.src_pt * eb,
                        dst_stride: self.dst_pt * eb,
                    });
                    // V: the run's rows, after the page's K.
                    put(Write::contiguous(
                        s0 + self.src_pt * half + ts * half,
                        d0 + self.dst_pt * half + td * half,
                        n * half,
                    ));
                }
            }
        }
    }
}

impl Planner {
    /// Validates both layouts and the mapping.
    ///
    /// # Errors
    /// Any [`PlanError`] about layouts, layers or TP.
    pub fn new(src: &KvLayout, dst: &KvLayout, tp: TpMapping) -> Result<Self, PlanError> {
        src.validate(Side::Src)?;
        dst.validate(Side::Dst)?;
        if src.regions != dst.regions {
            return Err(PlanError::RegionMismatch);
        }
        let (s, d) = (src.layers(), dst.layers());
        if s.start < d.start || s.end > d.end {
            return Err(PlanError::LayersNotCovered {
                src_first: s.start,
                src_end: s.end,
                dst_first: d.start,
                dst_end: d.end,
            });
        }
        let segments = match tp {
            TpMapping::Identical | TpMapping::Replicated => {
                if src.page_bytes != dst.page_bytes {
                    return Err(PlanError::PageBytesMismatch {
                        src: src.page_bytes,
                        dst: dst.page_bytes,
                    });
                }
                vec![Write::contiguous(0, 0, src.page_bytes)]
            }
            TpMapping::HeadSliced {
                prefill_tp,
                decode_tp,
                prefill_rank,
                decode_rank,
            } => head_segments(src, dst, prefill_tp, decode_tp, prefill_rank, decode_rank)?,
            TpMapping::Heads {
                src_first,
                dst_first,
                first,
                count,
            } => {
                let (hs, hd) = head_layouts(src, dst)?;
                let (a, b) = (u64::from(first), u64::from(first) + u64::from(count));
                let (s0, d0) = (u64::from(src_first), u64::from(dst_first));
                if count == 0
                    || a < s0
                    || b > s0 + u64::from(hs.num_heads)
                    || a < d0
                    || b > d0 + u64::from(hd.num_heads)
                {
                    return Err(PlanError::HeadMismatch(
                        "the heads written are not all held by both ranks",
                    ));
                }
                slice_segments(hs, hd, s0, d0, a, b)
            }
        };
        Ok(Self {
            src: src.clone(),
            dst: dst.clone(),
            dst_layer_shift: s.start - d.start,
            segments,
            tokens: None,
        })
    }

    /// As [`new`](Self::new), for pages of `src_page_tokens` tokens on the source side and
    /// `dst_page_tokens` on the destination side. Where they differ, chunks are planned by runs
    /// of tokens that lie in one page on each side ([`plan_chunk`](Self::plan_chunk)); a layout
    /// without head geometry is taken as token-major rows of `page_bytes / page_tokens` bytes,
    /// which must be the same on both sides.
    ///
    /// # Errors
    /// As [`new`](Self::new); [`PlanError::PageTokensMismatch`] where the pages do not line up
    /// (bytes that are not whole tokens, heads whose page tokens differ from the ones given, a
    /// token's bytes that differ).
    pub fn with_page_tokens(
        src: &KvLayout,
        dst: &KvLayout,
        tp: TpMapping,
        src_page_tokens: u32,
        dst_page_tokens: u32,
    ) -> Result<Self, PlanError> {
        if src_page_tokens == dst_page_tokens {
            return Self::new(src, dst, tp);
        }
        let bad = |what| PlanError::PageTokensMismatch(what);
        let (ps, pd) = (u64::from(src_page_tokens), u64::from(dst_page_tokens));
        if ps == 0 || pd == 0 {
            return Err(bad("a page of no tokens"));
        }
        // The layouts, layers and regions are checked as for equal pages, by a planner of the
        // mapping on layouts whose pages are made the same size.
        let mut same = dst.clone();
        same.page_bytes = dst.page_bytes / pd * ps;
        same.heads = dst.heads.map(|h| HeadLayout {
            page_tokens: src_page_tokens,
            ..h
        });
        let (hs, hd) = (src.heads, dst.heads);
        if !src.page_bytes.is_multiple_of(ps) || !dst.page_bytes.is_multiple_of(pd) {
            return Err(bad("page bytes are not whole tokens"));
        }
        dst.validate(Side::Dst)?;
        let mut base = Self::new(src, &packed_like(&same), tp)?;
        let map = match (hs, hd) {
            (Some(hs), Some(hd)) => {
                if u64::from(hs.page_tokens) != ps || u64::from(hd.page_tokens) != pd {
                    return Err(bad("head geometry's page tokens differ from the pages'"));
                }
                let (s0, d0, a, b) = heads_written(hs, hd, tp)?;
                TokenMap {
                    src_pt: ps,
                    dst_pt: pd,
                    order: hs.order,
                    head_bytes: hs.head_bytes,
                    src_heads: u64::from(hs.num_heads),
                    dst_heads: u64::from(hd.num_heads),
                    src_head: a - s0,
                    dst_head: a - d0,
                    heads: b - a,
                }
            }
            (None, None) => {
                let (ts, td) = (src.page_bytes / ps, dst.page_bytes / pd);
                if ts != td {
                    return Err(bad("a token's bytes differ"));
                }
                TokenMap {
                    src_pt: ps,
                    dst_pt: pd,
                    order: HeadOrder::TokenMajor,
                    head_bytes: ts,
                    src_heads: 1,
                    dst_heads: 1,
                    src_head: 0,
                    dst_head: 0,
                    heads: 1,
                }
            }
            _ => {
                return Err(PlanError::HeadsRequired(if hs.is_none() {
                    Side::Src
                } else {
                    Side::Dst
                }));
            }
        };
        base.dst = dst.clone();
        base.segments.clear();
        base.tokens = Some(map);
        Ok(base)
    }

    /// Appends to `out` the writes of chunk `chunk`: every layer this rank holds, every region,
    /// every page the chunk sends (see the module docs), merged where both sides are contiguous.
    /// `src_pages[i]` and `dst_pages[i]` are the pool indices of the request's `i`-th page.
    ///
    /// # Errors
    /// [`PlanError`] for a chunk out of range, short page lists or a page index outside either
    /// pool. On error `out` is as it was.
    pub fn plan_chunk(
        &self,
        geom: &ChunkGeometry,
        chunk: u64,
        src_pages: &[u32],
        dst_pages: &[u32],
        out: &mut Vec<Write>,
    ) -> Result<(), PlanError> {
        let range = geom.pages_of_chunk(chunk)?;
        if let Some(tm) = self.tokens {
            if geom.page_tokens != tm.dst_pt {
                return Err(PlanError::PageTokensMismatch(
                    "the request's pages are not the destination's",
                ));
            }
            let end = (range.end * tm.dst_pt).min(geom.prompt_tokens);
            let tokens = (range.start * tm.dst_pt).min(end)..end;
            let need = |pt: u64| geom.prompt_tokens.div_ceil(pt);
            for (side, list, n) in [
                (Side::Src, src_pages, need(tm.src_pt)),
                (Side::Dst, dst_pages, need(tm.dst_pt)),
            ] {
                if (list.len() as u64) < n {
                    return Err(PlanError::PageListLength {
                        side,
                        len: list.len(),
                        needed: n,
                    });
                }
            }
            return self.plan_tokens(&tm, src_pages, dst_pages, tokens, out);
        }
        let needed = geom.num_pages();
        for (side, list) in [(Side::Src, src_pages), (Side::Dst, dst_pages)] {
            if (list.len() as u64) < needed {
                return Err(PlanError::PageListLength {
                    side,
                    len: list.len(),
                    needed,
                });
            }
        }
        let (a, b) = (range.start as usize, range.end as usize);
        self.plan_pages(&src_pages[a..b], &dst_pages[a..b], range.start, out)
    }

    /// Appends the writes for pages `src_pages[i] -> dst_pages[i]` (all layers, all regions).
    /// `first_position` only labels errors. The two lists must be of equal length (the shorter
    /// one bounds the plan otherwise). With page sizes that differ
    /// ([`with_page_tokens`](Self::with_page_tokens)) the lists pair tokens instead: token `t`
    /// of the run lies in `src_pages[t / src_page_tokens]` and `dst_pages[t / dst_page_tokens]`,
    /// up to the tokens the shorter side spans, and errors name positions in these lists.
    ///
    /// # Errors
    /// [`PlanError::PageOutOfRange`]; on error `out` is as it was.
    pub fn plan_pages(
        &self,
        src_pages: &[u32],
        dst_pages: &[u32],
        first_position: u64,
        out: &mut Vec<Write>,
    ) -> Result<(), PlanError> {
        if let Some(tm) = self.tokens {
            let end = (src_pages.len() as u64 * tm.src_pt).min(dst_pages.len() as u64 * tm.dst_pt);
            return self.plan_tokens(&tm, src_pages, dst_pages, 0..end, out);
        }
        let n = src_pages.len().min(dst_pages.len());
        for (side, list, pool) in [
            (Side::Src, src_pages, self.src.num_pages),
            (Side::Dst, dst_pages, self.dst.num_pages),
        ] {
            if let Some(i) = list[..n].iter().position(|&p| p >= pool) {
                return Err(PlanError::PageOutOfRange {
                    side,
                    position: first_position + i as u64,
                    page: list[i],
                    num_pages: pool,
                });
            }
        }
        let base = out.len();
        out.reserve(n.min(64));
        for region in 0..self.src.regions.count() {
            for layer in 0..self.src.num_layers {
                let dl = layer + self.dst_layer_shift;
                for i in 0..n {
                    let so = self.src.offset(layer, region, src_pages[i]);
                    let d0 = self.dst.offset(dl, region, dst_pages[i]);
                    for seg in &self.segments {
                        push_merged(
                            out,
                            base,
                            Write {
                                src_offset: so + seg.src_offset,
                                dst_offset: d0 + seg.dst_offset,
                                ..*seg
                            },
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Appends the writes of tokens `tokens` (positions in the request, whose pages are
    /// `src_pages` of the source's page size and `dst_pages` of the destination's), every layer and
    /// region, one run of tokens per (source page, destination page) they share, merged where
    /// runs continue each other.
    ///
    /// # Errors
    /// [`PlanError::PageOutOfRange`] (or a list too short for the tokens); on error `out` is as
    /// it was.
    fn plan_tokens(
        &self,
        tm: &TokenMap,
        src_pages: &[u32],
        dst_pages: &[u32],
        tokens: Range<u64>,
        out: &mut Vec<Write>,
    ) -> Result<(), PlanError> {
        if tokens.is_empty() {
            return Ok(());
        }
        // Every page position the tokens touch, checked before anything is planned.
        for (side, list, pt, pool) in [
            (Side::Src, src_pages, tm.src_pt, self.src.num_pages),
            (Side::Dst, dst_pages, tm.dst_pt, self.dst.num_pages),
        ] {
            let (a, b) = (tokens.start / pt, (tokens.end - 1) / pt + 1);
            if (list.len() as u64) < b {
                return Err(PlanError::PageListLength {
                    side,
                    len: list.len(),
                    needed: b,
                });
            }
            for i in a..b {
                let page = list[i as usize];
                if page >= pool {
                    return Err(PlanError::PageOutOfRange {
                        side,
                        position: i,
                        page,
                        num_pages: pool,
                    });
                }
            }
        }
        let base = out.len();
        for region in 0..self.src.regions.count() {
            for layer in 0..self.src.num_layers {
                let dl = layer + self.dst_layer_shift;
                let mut t = tokens.start;
                while t < tokens.end {
                    let (sp, ts) = (t / tm.src_pt, t % tm.src_pt);
                    let (dp, td) = (t / tm.dst_pt, t % tm.dst_pt);
                    let n = (tm.src_pt - ts).min(tm.dst_pt - td).min(tokens.end - t);
                    let so = self.src.offset(layer, region, src_pages[sp as usize]);
                    let d0 = self.dst.offset(dl, region, dst_pages[dp as usize]);
                    tm.runs(ts, td, n, |w| {
                        push_merged(
                            out,
                            base,
                            Write {
                                src_offset: so + w.src_offset,
                                dst_offset: d0 + w.dst_offset,
                                ..w
                            },
                        );
                    });
                    t += n;
                }
            }
        }
        Ok(())
    }

    /// Source pages a request of `geom` (in the destination's pages) needs.
    pub fn src_pages_needed(&self, geom: &ChunkGeometry) -> u64 {
        match self.tokens {
            Some(tm) => geom.prompt_tokens.div_ceil(tm.src_pt),
            None => geom.num_pages(),
        }
    }

    /// The source layout.
    pub fn src(&self) -> &KvLayout {
        &self.src
    }

    /// The destination layout.
    pub fn dst(&self) -> &KvLayout {
        &self.dst
    }
}

/// Appends `w` to `out`, or extends the last write (if it is past `base`) when `w` continues it:
/// a contiguous write that ends where `w` starts on both sides, or a run of rows whose next row
/// would be `w`'s first.
#[inline]
fn push_merged(out: &mut Vec<Write>, base: usize, w: Write) {
    if out.len() > base
        && let Some(last) = out.last_mut()
    {
        if last.rows == 1
            && w.rows == 1
            && last.src_offset + last.len == w.src_offset
            && last.dst_offset + last.len == w.dst_offset
        {
            last.len += w.len;
            return;
        }
        if last.rows > 1
            && w.len == last.len
            && (w.rows == 1 || (w.src_stride, w.dst_stride) == (last.src_stride, last.dst_stride))
            && last.src_offset + last.rows * last.src_stride == w.src_offset
            && last.dst_offset + last.rows * last.dst_stride == w.dst_offset
        {
            last.rows += w.rows;
            return;
        }
    }
    out.push(w);
}

fn head_segments(
    src: &KvLayout,
    dst: &KvLayout,
    prefill_tp: u32,
    decode_tp: u32,
    prefill_rank: u32,
    decode_rank: u32,
) -> Result<Vec<Write>, PlanError> {
    let (hs, hd) = head_layouts(src, dst)?;
    if prefill_rank >= prefill_tp || decode_rank >= decode_tp {
        return Err(PlanError::TpRankOutOfRange);
    }
    let total_s = u64::from(hs.num_heads) * u64::from(prefill_tp);
    let total_d = u64::from(hd.num_heads) * u64::from(decode_tp);
    if total_s != total_d {
        return Err(PlanError::HeadMismatch("total heads differ"));
    }
    // Global head ranges of the two ranks, and what they share.
    let s0 = u64::from(prefill_rank) * u64::from(hs.num_heads);
    let d0 = u64::from(decode_rank) * u64::from(hd.num_heads);
    let a = s0.max(d0);
    let b = (s0 + u64::from(hs.num_heads)).min(d0 + u64::from(hd.num_heads));
    if a >= b {
        return Ok(Vec::new());
    }
    Ok(slice_segments(hs, hd, s0, d0, a, b))
}

/// `same` packed into a buffer of exactly its size: the layout the equal-pages checks are run on
/// (the real destination layout was validated already).
fn packed_like(same: &KvLayout) -> KvLayout {
    let mut l = same.clone();
    let span = l.page_bytes.saturating_mul(u64::from(l.num_pages));
    l.layer_stride = span;
    l.region_stride = span.saturating_mul(u64::from(l.num_layers));
    l.base_offset = 0;
    l.buffer_len = l.region_stride.saturating_mul(u64::from(l.regions.count()));
    l
}

/// The global heads a source rank writes into a destination rank under `tp`, as `(first head of
/// the source rank, first head of the destination rank, first written, end written)`.
fn heads_written(
    hs: HeadLayout,
    hd: HeadLayout,
    tp: TpMapping,
) -> Result<(u64, u64, u64, u64), PlanError> {
    if hs.order != hd.order {
        return Err(PlanError::HeadMismatch("head order differs"));
    }
    if hs.head_bytes != hd.head_bytes {
        return Err(PlanError::HeadMismatch("head bytes differ"));
    }
    let (ns, nd) = (u64::from(hs.num_heads), u64::from(hd.num_heads));
    match tp {
        TpMapping::Identical | TpMapping::Replicated => {
            if ns != nd {
                return Err(PlanError::HeadMismatch("whole pages with different heads"));
            }
            Ok((0, 0, 0, ns))
        }
        TpMapping::HeadSliced {
            prefill_tp,
            decode_tp,
            prefill_rank,
            decode_rank,
        } => {
            if prefill_rank >= prefill_tp || decode_rank >= decode_tp {
                return Err(PlanError::TpRankOutOfRange);
            }
            let s0 = u64::from(prefill_rank) * ns;
            let d0 = u64::from(decode_rank) * nd;
            let (a, b) = (s0.max(d0), (s0 + ns).min(d0 + nd));
            if a >= b {
                return Err(PlanError::HeadMismatch("the two ranks share no head"));
            }
            Ok((s0, d0, a, b))
        }
        TpMapping::Heads {
            src_first,
            dst_first,
            first,
            count,
        } => {
            let (s0, d0) = (u64::from(src_first), u64::from(dst_first));
            let (a, b) = (u64::from(first), u64::from(first) + u64::from(count));
            if count == 0 || a < s0 || b > s0 + ns || a < d0 || b > d0 + nd {
                return Err(PlanError::HeadMismatch(
                    "the heads written are not all held by both ranks",
                ));
            }
            Ok((s0, d0, a, b))
        }
    }
}

/// Both sides' head geometry, checked to line up.
fn head_layouts(src: &KvLayout, dst: &KvLayout) -> Result<(HeadLayout, HeadLayout), PlanError> {
    let hs = src.heads.ok_or(PlanError::HeadsRequired(Side::Src))?;
    let hd = dst.heads.ok_or(PlanError::HeadsRequired(Side::Dst))?;
    if hs.order != hd.order {
        return Err(PlanError::HeadMismatch("head order differs"));
    }
    if hs.head_bytes != hd.head_bytes {
        return Err(PlanError::HeadMismatch("head bytes differ"));
    }
    if hs.page_tokens != hd.page_tokens {
        return Err(PlanError::HeadMismatch("page tokens differ"));
    }
    Ok((hs, hd))
}

/// The writes inside one page that carry global heads `a..b`, from a source rank whose first
/// head is `s0` to a destination rank whose first head is `d0`: one contiguous write where the
/// heads lie together on both sides (head-major pages, or token rows that hold only these heads),
/// one write of a row per token otherwise.
fn slice_segments(hs: HeadLayout, hd: HeadLayout, s0: u64, d0: u64, a: u64, b: u64) -> Vec<Write> {
    let hb = hs.head_bytes;
    let pt = u64::from(hs.page_tokens);
    match hs.order {
        // A head's part of the page moves whole, whatever its inside.
        HeadOrder::HeadMajor | HeadOrder::KeyColumns { .. } => vec![Write::contiguous(
            (a - s0) * pt * hb,
            (a - d0) * pt * hb,
            (b - a) * pt * hb,
        )],
        HeadOrder::TokenMajor => {
            let (row_s, row_d) = (u64::from(hs.num_heads) * hb, u64::from(hd.num_heads) * hb);
            let (s, d, len) = ((a - s0) * hb, (a - d0) * hb, (b - a) * hb);
            if pt == 1 || (len == row_s && len == row_d) {
                vec![Write::contiguous(s, d, len * pt)]
            } else {
                vec![Write {
                    src_offset: s,
                    dst_offset: d,
                    len,
                    rows: pt,
                    src_stride: row_s,
                    dst_stride: row_d,
                }]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn pp_splits_match_vllm_and_sglang() {
        assert_eq!(
            PpSplit::VllmEven.counts(61, 4).unwrap(),
            vec![15, 15, 16, 15]
        );
        assert_eq!(
            PpSplit::SglangEven.counts(61, 4).unwrap(),
            vec![15, 15, 15, 16]
        );
        assert_eq!(
            PpSplit::VllmEven.counts(62, 4).unwrap(),
            vec![15, 16, 16, 15]
        );
        assert_eq!(
            PpSplit::SglangEven.counts(62, 4).unwrap(),
            vec![15, 15, 16, 16]
        );
        assert_eq!(
            PpSplit::VllmEven.counts(63, 4).unwrap(),
            vec![16, 16, 16, 15]
        );
        assert_eq!(PpSplit::VllmEven.counts(32, 4).unwrap(), vec![8; 4]);
        assert_eq!(PpSplit::VllmEven.counts(7, 1).unwrap(), vec![7]);
        assert_eq!(PpSplit::VllmEven.layer_range(61, 4, 2).unwrap(), 30..46);
        assert_eq!(PpSplit::SglangEven.layer_range(61, 4, 3).unwrap(), 45..61);
        assert_eq!(
            PpSplit::Explicit(vec![4, 6, 6, 4])
                .layer_range(20, 4, 1)
                .unwrap(),
            4..10
        );
        assert!(PpSplit::Explicit(vec![4, 6]).counts(20, 4).is_err());
        assert_eq!(
            PpSplit::VllmEven.counts(3, 4),
            Err(PlanError::EmptyRank { rank: 3 })
        );
        assert_eq!(PpSplit::VllmEven.counts(3, 0), Err(PlanError::ZeroPpSize));
    }

    #[test]
    fn chunk_pages() {
        let g = ChunkGeometry::new(100, 24, 16).unwrap();
        let got: Vec<_> = (0..g.num_chunks())
            .map(|c| g.pages_of_chunk(c).unwrap())
            .collect();
        assert_eq!(got, vec![0..1, 1..3, 3..4, 4..6, 6..7]);
        let g = ChunkGeometry::new(40, 8, 16).unwrap();
        let got: Vec<_> = (0..g.num_chunks())
            .map(|c| g.pages_of_chunk(c).unwrap())
            .collect();
        assert_eq!(got, vec![0..0, 0..1, 1..1, 1..2, 2..3]);
        assert!(g.pages_of_chunk(5).is_err());
    }

    #[test]
    fn a_prompt_held_whole_is_one_chunk_of_no_pages() {
        let g = ChunkGeometry::after_prefix(0, 64, 16, 128).unwrap();
        assert_eq!((g.num_pages(), g.num_chunks()), (0, 1));
        assert_eq!(g.pages_of_chunk(0).unwrap(), 0..0);
        assert!(g.pages_of_chunk(1).is_err());
        // Nothing to move and no prefix, or a zero size, is no request.
        assert_eq!(
            ChunkGeometry::after_prefix(0, 64, 16, 0),
            Err(PlanError::BadGeometry)
        );
        assert!(ChunkGeometry::after_prefix(0, 0, 16, 128).is_err());
        assert!(ChunkGeometry::after_prefix(0, 64, 0, 128).is_err());
        // A prefix changes nothing about the moved tokens' chunks.
        assert_eq!(
            ChunkGeometry::after_prefix(100, 24, 16, 32),
            ChunkGeometry::new(100, 24, 16)
        );
    }

    #[test]
    fn coalesces_consecutive_pages() {
        let l = KvLayout::packed(0, 2, RegionKind::Fused, 100, 10);
        let p = Planner::new(&l, &l, TpMapping::Identical).unwrap();
        let mut out = Vec::new();
        p.plan_pages(&[3, 4, 5, 9], &[0, 1, 2, 3], 0, &mut out)
            .unwrap();
        assert_eq!(
            out,
            vec![
                Write::contiguous(300, 0, 300),
                Write::contiguous(900, 300, 100),
                Write::contiguous(1300, 1000, 300),
                Write::contiguous(1900, 1300, 100),
            ]
        );
        let err = p.plan_pages(&[3, 10], &[0, 1], 5, &mut out).unwrap_err();
        assert_eq!(
            err,
            PlanError::PageOutOfRange {
                side: Side::Src,
                position: 6,
                page: 10,
                num_pages: 10
            }
        );
        assert_eq!(out.len(), 4);
    }

    #[test]
    fn head_sliced_prefill_tp1_to_decode_tp2() {
        let h = |n| HeadLayout {
            num_heads: n,
            head_bytes: 4,
            page_tokens: 2,
            order: HeadOrder::TokenMajor,
        };
        let src = KvLayout::packed(0, 1, RegionKind::SplitKv, 4 * 4 * 2, 4).with_heads(h(4));
        let dst = KvLayout::packed(0, 1, RegionKind::SplitKv, 2 * 4 * 2, 4).with_heads(h(2));
        let p = Planner::new(
            &src,
            &dst,
            TpMapping::HeadSliced {
                prefill_tp: 1,
                decode_tp: 2,
                prefill_rank: 0,
                decode_rank: 1,
            },
        )
        .unwrap();
        let mut out = Vec::new();
        p.plan_pages(&[1], &[2], 0, &mut out).unwrap();
        // Page 1 of K: heads 2..4 of token 0 at 32+8, of token 1 at 32+16+8, into dst page 2 of
        // K: one write of two rows. V likewise, a region further on both sides.
        let k = Write {
            src_offset: 32 + 8,
            dst_offset: 32,
            len: 8,
            rows: 2,
            src_stride: 16,
            dst_stride: 8,
        };
        let v = Write {
            src_offset: 32 + 8 + 4 * 32,
            dst_offset: 32 + 4 * 16,
            ..k
        };
        assert_eq!(out, vec![k, v]);
        assert_eq!(k.pieces().collect::<Vec<_>>(), vec![(40, 32), (56, 40)]);
        // Two consecutive pages on both sides continue the rows: still one write per region.
        out.clear();
        p.plan_pages(&[1, 2], &[2, 3], 0, &mut out).unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!((out[0].rows, out[0].bytes()), (4, 32));
    }
}
