//! Incarnations: the refusals one by one, and a property over any sequence of connection
//! attempts against a map of the last incarnation admitted per rank.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;

use proptest::prelude::*;
use transfer_engine::core::membership::{Incarnations, Refusal};

#[test]
fn refusals_in_order_unknown_busy_stale() {
    let mut inc = Incarnations::new(2);
    assert_eq!(inc.last(0), None);
    assert_eq!(inc.admit(0, 5, false), Ok(None));
    assert_eq!(inc.last(0), Some(5));
    // An unknown rank is refused as such even when busy.
    assert_eq!(
        inc.check(2, 9, true),
        Err(Refusal::UnknownRank {
            rank: 2,
            pp_size: 2
        })
    );
    // Busy is checked before staleness.
    assert_eq!(inc.check(0, 3, true), Err(Refusal::Busy { rank: 0 }));
    assert_eq!(
        inc.admit(0, 4, false),
        Err(Refusal::Stale {
            rank: 0,
            got: 4,
            last: 5
        })
    );
    // The same start binds again once its connection is gone (a broken mesh connection).
    assert_eq!(inc.admit(0, 5, false), Ok(Some(5)));
    assert_eq!(inc.admit(0, 6, false), Ok(Some(5)));
    assert_eq!(inc.last(0), Some(6));
    // Rank 1 is independent of rank 0, and 0 is a valid first incarnation.
    assert_eq!(inc.admit(1, 0, false), Ok(None));
    assert_eq!(inc.last(1), Some(0));
    assert_eq!(inc.last(7), None);
}

#[test]
fn nothing_is_above_u64_max() {
    let mut inc = Incarnations::new(1);
    assert_eq!(inc.admit(0, u64::MAX, false), Ok(None));
    assert_eq!(
        inc.check(0, u64::MAX - 1, false),
        Err(Refusal::Stale {
            rank: 0,
            got: u64::MAX - 1,
            last: u64::MAX
        })
    );
    assert_eq!(inc.check(0, u64::MAX, false), Ok(()));
}

#[derive(Debug, Clone, Copy)]
struct Attempt {
    rank: u16,
    got: u64,
    busy: bool,
}

/// Ranks up to two past the PP size; incarnations from a small set so repeats and decreases are
/// common, with the extremes now and then.
fn attempt(pp: u16) -> impl Strategy<Value = Attempt> {
    let got = prop_oneof![
        8 => 1u64..8,
        1 => Just(0u64),
        1 => Just(u64::MAX),
    ];
    (0..pp + 2, got, prop::bool::weighted(0.25)).prop_map(|(rank, got, busy)| Attempt {
        rank,
        got,
        busy,
    })
}

fn attempts() -> impl Strategy<Value = (u16, Vec<Attempt>)> {
    (1u16..=8).prop_flat_map(|pp| (Just(pp), prop::collection::vec(attempt(pp), 0..80)))
}

/// What the rules say about `a`, given the last incarnation admitted per rank.
fn expected(pp: u16, model: &HashMap<u16, u64>, a: Attempt) -> Result<Option<u64>, Refusal> {
    if a.rank >= pp {
        return Err(Refusal::UnknownRank {
            rank: a.rank,
            pp_size: pp,
        });
    }
    if a.busy {
        return Err(Refusal::Busy { rank: a.rank });
    }
    match model.get(&a.rank) {
        Some(&last) if a.got < last => Err(Refusal::Stale {
            rank: a.rank,
            got: a.got,
            last,
        }),
        prev => Ok(prev.copied()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn admits_as_the_model_does((pp, seq) in attempts(), check_first in prop::collection::vec(any::<bool>(), 80)) {
        let mut inc = Incarnations::new(pp);
        let mut model: HashMap<u16, u64> = HashMap::new();
        for (i, a) in seq.iter().copied().enumerate() {
            let want = expected(pp, &model, a);
            if check_first[i] {
                // `check` answers as `admit` will, and changes nothing.
                let before: Vec<_> = (0..pp + 2).map(|r| inc.last(r)).collect();
                prop_assert_eq!(inc.check(a.rank, a.got, a.busy), want.map(|_| ()));
                let after: Vec<_> = (0..pp + 2).map(|r| inc.last(r)).collect();
                prop_assert_eq!(before, after);
            }
            let got = inc.admit(a.rank, a.got, a.busy);
            prop_assert_eq!(got, want, "attempt {:?}", a);
            if a.busy {
                prop_assert!(got.is_err(), "busy admitted: {:?}", a);
            }
            if let Ok(prev) = got {
                // Never decreasing per rank: no older start binds after a newer one.
                prop_assert!(prev.is_none_or(|p| p <= a.got));
                model.insert(a.rank, a.got);
            }
            for r in 0..pp + 2 {
                prop_assert_eq!(inc.last(r), model.get(&r).copied());
            }
        }
    }
}
