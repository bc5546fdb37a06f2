//! The range allocator that lends out NIXL's staging memory and a decode's landing memory: ranges
//! taken never overlap, lie inside the buffer, start at multiples of 64, and come back when given.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use transfer_engine::core::ranges::Ranges;

#[derive(Debug, Clone)]
enum Op {
    Take(u64),
    /// Give back the `i`-th live range (modulo their number), or an offset never taken.
    Give(usize),
    GiveUnknown(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u64..5000).prop_map(Op::Take),
        any::<usize>().prop_map(Op::Give),
        any::<u64>().prop_map(Op::GiveUnknown),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn ranges_never_overlap_and_stay_inside(cap in 0u64..20_000, ops in proptest::collection::vec(op(), 0..64)) {
        let mut r = Ranges::new(cap);
        let mut live: Vec<(u64, u64)> = Vec::new();
        for op in ops {
            match op {
                Op::Take(len) => {
                    let got = r.take(len);
                    if let Some(off) = got {
                        prop_assert!(len > 0);
                        prop_assert_eq!(off % 64, 0);
                        prop_assert!(off + len <= cap);
                        for &(o, l) in &live {
                            prop_assert!(off + len <= o || o + l <= off, "{off}+{len} overlaps {o}+{l}");
                        }
                        live.push((off, len));
                    } else if len > 0 {
                        // Refused only when no gap (at a multiple of 64) holds it.
                        let mut sorted = live.clone();
                        sorted.sort_unstable();
                        let mut at = 0u64;
                        let mut fits = false;
                        for &(o, l) in &sorted {
                            fits |= o >= at && o - at >= len;
                            at = (o + l).next_multiple_of(64);
                        }
                        fits |= cap >= at && cap - at >= len;
                        prop_assert!(!fits, "{len} refused with a gap free");
                    }
                }
                Op::Give(i) if !live.is_empty() => {
                    let (off, _) = live.remove(i % live.len());
                    prop_assert!(r.give(off));
                }
                Op::Give(_) => {}
                Op::GiveUnknown(off) => {
                    let known = live.iter().any(|&(o, _)| o == off);
                    prop_assert_eq!(r.give(off), known);
                    live.retain(|&(o, _)| o != off);
                }
            }
            prop_assert_eq!(r.count(), live.len());
            prop_assert_eq!(r.taken(), live.iter().map(|&(_, l)| l).sum::<u64>());
        }
    }
}
