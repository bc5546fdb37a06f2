//! Heterogeneous TP, without I/O: for every pair of TP sizes and head counts, every byte of every
//! decode TP rank's pages is written exactly once, by a prefill rank that holds it, with the right
//! head's bytes (MHA/GQA sliced, GQA replicated, MLA whole pages); the two sides agree on who
//! writes where.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use transfer_engine::core::planner::{
    HeadLayout, HeadOrder, KvLayout, Planner, RegionKind, TpMapping,
};
use transfer_engine::core::topology::{self, TopologyError, TpShape};

/// What a byte of a page holds, as (global head, token, byte of the head); MLA pages use head 0.
type Id = (u32, u32, u64);

struct Geometry {
    kv_heads: u32,
    head_bytes: u64,
    page_tokens: u32,
    order: HeadOrder,
}

/// One page of one layer of TP rank `rank`, as the identity of each byte.
fn page_of(g: &Geometry, shape: TpShape, rank: u32) -> Vec<Id> {
    if g.kv_heads == 0 {
        // MLA: the latent, the same on every rank.
        let len = g.head_bytes * u64::from(g.page_tokens);
        return (0..len).map(|b| (0, 0, b)).collect();
    }
    let heads = shape.heads_of(rank);
    let mut out = Vec::new();
    match g.order {
        HeadOrder::HeadMajor | HeadOrder::KeyColumns { .. } => {
            for h in heads {
                for t in 0..g.page_tokens {
                    out.extend((0..g.head_bytes).map(|b| (h, t, b)));
                }
            }
        }
        HeadOrder::TokenMajor => {
            for t in 0..g.page_tokens {
                for h in heads.clone() {
                    out.extend((0..g.head_bytes).map(|b| (h, t, b)));
                }
            }
        }
    }
    out
}

fn layout(g: &Geometry, shape: TpShape) -> KvLayout {
    let per_rank = if g.kv_heads == 0 {
        1
    } else {
        shape.heads_of(0).len() as u32
    };
    let page_bytes = u64::from(per_rank) * g.head_bytes * u64::from(g.page_tokens);
    let l = KvLayout::packed(0, 1, RegionKind::Fused, page_bytes, 1);
    if g.kv_heads == 0 {
        l
    } else {
        l.with_heads(HeadLayout {
            num_heads: per_rank,
            head_bytes: g.head_bytes,
            page_tokens: g.page_tokens,
            order: g.order,
        })
    }
}

fn tp() -> impl Strategy<Value = u32> {
    prop_oneof![Just(1u32), Just(2), Just(4), Just(8)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_decode_byte_is_written_once_by_a_rank_that_holds_it(
        prefill_tp in tp(),
        decode_tp in tp(),
        kv_heads in prop_oneof![Just(0u32), Just(1), Just(2), Just(4), Just(8), Just(16)],
        head_bytes in prop_oneof![Just(2u64), Just(8)],
        page_tokens in 1u32..4,
        token_major in any::<bool>(),
    ) {
        let g = Geometry {
            kv_heads,
            head_bytes,
            page_tokens,
            order: if token_major { HeadOrder::TokenMajor } else { HeadOrder::HeadMajor },
        };
        let p = TpShape { tp_size: prefill_tp, kv_heads };
        let d = TpShape { tp_size: decode_tp, kv_heads };
        let (src_layout, dst_layout) = (layout(&g, p), layout(&g, d));
        let mut writers_of = vec![0usize; prefill_tp as usize];
        for decode_rank in 0..decode_tp {
            let sources = topology::sources(p, d, decode_rank).unwrap();
            prop_assert!(!sources.is_empty());
            let want = page_of(&g, d, decode_rank);
            let mut got: Vec<Option<Id>> = vec![None; want.len()];
            for s in &sources {
                writers_of[s.prefill_rank as usize] += 1;
                let src = page_of(&g, p, s.prefill_rank);
                let mapping = TpMapping::for_source(p, d, decode_rank, s);
                let planner = Planner::new(&src_layout, &dst_layout, mapping).unwrap();
                let mut writes = Vec::new();
                planner.plan_pages(&[0], &[0], 0, &mut writes).unwrap();
                for w in &writes {
                    for (so, d) in w.pieces() {
                        for k in 0..w.len {
                            let at = (d + k) as usize;
                            prop_assert!(got[at].is_none(), "byte {at} of decode rank {decode_rank} written twice");
                            got[at] = Some(src[(so + k) as usize]);
                        }
                    }
                }
                // The prefill side, asking where it writes, finds the same decode rank and heads.
                let targets = topology::targets(p, d, s.prefill_rank).unwrap();
                prop_assert!(targets.contains(&(decode_rank, s.clone())));
            }
            let got: Vec<Id> = got.into_iter().map(|b| b.expect("a decode byte was never written")).collect();
            prop_assert_eq!(got, want);
            // Slots: one per (PP rank, source), all distinct.
            let fan_in = sources.len() as u16;
            let slots: std::collections::HashSet<u16> = (0..4u16)
                .flat_map(|pp| (0..fan_in).map(move |j| topology::slot(pp, fan_in, j).unwrap()))
                .collect();
            prop_assert_eq!(slots.len(), 4 * usize::from(fan_in));
        }
        // Replicated heads on the prefill side share the load: when decode has at least as many
        // ranks, every prefill rank writes somewhere.
        if decode_tp >= prefill_tp {
            prop_assert!(writers_of.iter().all(|&n| n > 0), "{writers_of:?}");
        }
    }
}

#[test]
fn shapes_that_do_not_split_or_differ_are_refused() {
    let p = TpShape {
        tp_size: 4,
        kv_heads: 6,
    };
    let d = TpShape {
        tp_size: 2,
        kv_heads: 6,
    };
    assert_eq!(
        topology::sources(p, d, 0),
        Err(TopologyError::Uneven {
            kv_heads: 6,
            tp_size: 4
        })
    );
    let p = TpShape {
        tp_size: 2,
        kv_heads: 8,
    };
    let d = TpShape {
        tp_size: 2,
        kv_heads: 4,
    };
    assert!(matches!(
        topology::sources(p, d, 0),
        Err(TopologyError::HeadsDiffer { .. })
    ));
    let d = TpShape {
        tp_size: 2,
        kv_heads: 8,
    };
    assert!(matches!(
        topology::sources(p, d, 2),
        Err(TopologyError::RankOutOfRange { .. })
    ));
    assert!(matches!(
        topology::sources(
            TpShape {
                tp_size: 0,
                kv_heads: 8
            },
            d,
            0
        ),
        Err(TopologyError::RankOutOfRange { .. })
    ));
}

#[test]
fn the_usual_layouts() {
    // Prefill TP 4 into decode TP 2 (8 heads): decode rank 1 gets heads 4..6 and 6..8.
    let p = TpShape {
        tp_size: 4,
        kv_heads: 8,
    };
    let d = TpShape {
        tp_size: 2,
        kv_heads: 8,
    };
    let s = topology::sources(p, d, 1).unwrap();
    assert_eq!(
        s.iter()
            .map(|s| (s.prefill_rank, s.heads.clone()))
            .collect::<Vec<_>>(),
        vec![(2, 4..6), (3, 6..8)]
    );
    // Prefill TP 2 into decode TP 4: prefill rank 0 writes decode ranks 0 and 1.
    let t = topology::targets(d, p, 0).unwrap();
    assert_eq!(t.iter().map(|(r, _)| *r).collect::<Vec<_>>(), vec![0, 1]);
    // GQA with 2 KV heads at decode TP 8 from prefill TP 4: decode rank 5 holds head 1, which
    // prefill ranks 2 and 3 both hold; it is decode's second replica, so prefill rank 3 writes it.
    let p = TpShape {
        tp_size: 4,
        kv_heads: 2,
    };
    let d = TpShape {
        tp_size: 8,
        kv_heads: 2,
    };
    let s = topology::sources(p, d, 5).unwrap();
    assert_eq!(s.len(), 1);
    assert_eq!((s[0].prefill_rank, s[0].heads.clone()), (3, 1..2));
    // MLA: one whole-page source per decode rank.
    let p = TpShape {
        tp_size: 2,
        kv_heads: 0,
    };
    let d = TpShape {
        tp_size: 4,
        kv_heads: 0,
    };
    let s = topology::sources(p, d, 3).unwrap();
    assert_eq!(
        (s.len(), s[0].prefill_rank, s[0].heads.is_empty()),
        (1, 1, true)
    );
}
