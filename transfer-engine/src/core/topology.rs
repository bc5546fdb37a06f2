//! Which prefill TP ranks write which KV heads of which decode TP rank, when the two sides run
//! different TP sizes.
//!
//! A model has `kv_heads` KV heads per layer, or none apart (`kv_heads == 0`: MLA, whose latent
//! every TP rank holds whole). With at least as many heads as TP ranks, rank `r` of `tp` holds the
//! `kv_heads / tp` heads from `r * kv_heads / tp` on; with fewer, each rank holds one head and
//! `tp / kv_heads` consecutive ranks hold the same one (rank `r` holds head
//! `r / (tp / kv_heads)`), which is how SGLang and vLLM replicate GQA heads.
//!
//! [`sources`] names, for one decode TP rank, every prefill TP rank that writes into it and the
//! heads it writes. Every head the decode rank holds is written by exactly one prefill rank that
//! holds it: where several prefill ranks hold a head (replicated), the decode rank's position
//! among its own replicas picks one, so the replicas share the load. For MLA each decode rank has
//! one source, whole pages: prefill rank `decode_rank % prefill_tp`.
//!
//! A decode rank numbers its sources' connections as *slots*: slot `pp_rank * fan_in + j` for the
//! `j`-th source of PP rank `pp_rank` ([`slot`]). Both sides compute it from the same numbers, so
//! a prefill rank's notifications name the slot the decode side expects.

use std::ops::Range;

/// One side's TP size and the model's KV head count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TpShape {
    /// TP size.
    pub tp_size: u32,
    /// KV heads of the model per layer (not per rank); 0 for MLA.
    pub kv_heads: u32,
}

/// What makes two TP shapes unmappable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// A TP size of 0, or a rank at or past it.
    #[error("TP rank {rank} is not below TP size {tp_size}")]
    RankOutOfRange {
        /// The rank.
        rank: u32,
        /// The TP size.
        tp_size: u32,
    },
    /// Heads that do not split evenly over the ranks (or ranks over the heads).
    #[error("{kv_heads} KV heads do not split evenly over TP size {tp_size}")]
    Uneven {
        /// Heads.
        kv_heads: u32,
        /// TP size.
        tp_size: u32,
    },
    /// The two sides describe different models.
    #[error("prefill has {prefill} KV heads, decode {decode}: not the same model")]
    HeadsDiffer {
        /// Prefill's model heads.
        prefill: u32,
        /// Decode's model heads.
        decode: u32,
    },
}

/// A prefill TP rank that writes into a decode TP rank, and what it writes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Source {
    /// The prefill TP rank.
    pub prefill_rank: u32,
    /// The global heads it writes (empty for MLA: whole pages).
    pub heads: Range<u32>,
}

impl TpShape {
    /// Whether heads and ranks split evenly.
    ///
    /// # Errors
    /// [`TopologyError::RankOutOfRange`] for a TP size of 0; [`TopologyError::Uneven`].
    pub fn validate(&self) -> Result<(), TopologyError> {
        if self.tp_size == 0 {
            return Err(TopologyError::RankOutOfRange {
                rank: 0,
                tp_size: 0,
            });
        }
        let (h, t) = (self.kv_heads, self.tp_size);
        let even = h == 0 || (h >= t && h % t == 0) || (h < t && t % h == 0);
        if even {
            Ok(())
        } else {
            Err(TopologyError::Uneven {
                kv_heads: h,
                tp_size: t,
            })
        }
    }

    /// The global heads TP rank `rank` holds (empty for MLA). Assumes a validated shape and a rank
    /// below the TP size.
    pub fn heads_of(&self, rank: u32) -> Range<u32> {
        let (h, t) = (self.kv_heads, self.tp_size);
        if h == 0 {
            0..0
        } else if h >= t {
            let per = h / t;
            rank * per..(rank + 1) * per
        } else {
            let head = rank / (t / h);
            head..head + 1
        }
    }

    /// The ranks that hold global head `head`.
    fn holders(&self, head: u32) -> Range<u32> {
        let (h, t) = (self.kv_heads, self.tp_size);
        if h >= t {
            let r = head / (h / t);
            r..r + 1
        } else {
            let rep = t / h;
            head * rep..(head + 1) * rep
        }
    }
}

/// Every prefill TP rank that writes into decode TP rank `decode_rank`, in ascending prefill
/// rank, with the heads it writes (see the module's docs).
///
/// # Errors
/// Shapes that do not validate, that describe different models, or a rank out of range.
pub fn sources(
    prefill: TpShape,
    decode: TpShape,
    decode_rank: u32,
) -> Result<Vec<Source>, TopologyError> {
    prefill.validate()?;
    decode.validate()?;
    if prefill.kv_heads != decode.kv_heads {
        return Err(TopologyError::HeadsDiffer {
            prefill: prefill.kv_heads,
            decode: decode.kv_heads,
        });
    }
    if decode_rank >= decode.tp_size {
        return Err(TopologyError::RankOutOfRange {
            rank: decode_rank,
            tp_size: decode.tp_size,
        });
    }
    if decode.kv_heads == 0 {
        return Ok(vec![Source {
            prefill_rank: decode_rank % prefill.tp_size,
            heads: 0..0,
        }]);
    }
    // Which of the decode ranks holding these heads this one is: it picks the same replica
    // position among the prefill ranks holding each head.
    let mine = decode.heads_of(decode_rank);
    let position = decode_rank - decode.holders(mine.start).start;
    let mut out: Vec<Source> = Vec::new();
    for head in mine {
        let holders = prefill.holders(head);
        let rank = holders.start + position % holders.len() as u32;
        match out.last_mut() {
            Some(s) if s.prefill_rank == rank && s.heads.end == head => s.heads.end += 1,
            _ => out.push(Source {
                prefill_rank: rank,
                heads: head..head + 1,
            }),
        }
    }
    out.sort_by_key(|s| s.prefill_rank);
    Ok(out)
}

/// The decode TP ranks prefill TP rank `prefill_rank` writes into, each with what it writes there.
///
/// # Errors
/// As [`sources`]; a prefill rank out of range.
pub fn targets(
    prefill: TpShape,
    decode: TpShape,
    prefill_rank: u32,
) -> Result<Vec<(u32, Source)>, TopologyError> {
    if prefill_rank >= prefill.tp_size {
        return Err(TopologyError::RankOutOfRange {
            rank: prefill_rank,
            tp_size: prefill.tp_size,
        });
    }
    let mut out = Vec::new();
    for d in 0..decode.tp_size {
        for s in sources(prefill, decode, d)? {
            if s.prefill_rank == prefill_rank {
                out.push((d, s));
            }
        }
    }
    Ok(out)
}

/// The slot of (PP rank `pp_rank`, `j`-th source) at a decode rank with `fan_in` sources per PP
/// rank.
pub fn slot(pp_rank: u16, fan_in: u16, j: u16) -> Option<u16> {
    pp_rank.checked_mul(fan_in)?.checked_add(j)
}
