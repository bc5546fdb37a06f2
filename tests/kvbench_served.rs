//! What a `kvbench prefill` role takes from decode's Hello (`roles::Served`), without I/O: every
//! workload a peer can send is either refused with a message or one the role can size its pool
//! by without overflow, and flags given on the prefill's command line that differ are named.
#![allow(clippy::unwrap_used)]

use kvbench::bench::{Verify, Workload};
use kvbench::cluster::{PoolKind, Shape};
use kvbench::roles::Served;
use kvbench::tp::TpPlan;
use proptest::prelude::*;
use std::time::Duration;
use transfer_engine::core::planner::{KvLayout, PpSplit};
use transfer_engine::transport::BackendKind;

/// kvbench's defaults, as a prefill role started with no workload flags has them.
fn defaults() -> Workload {
    Workload {
        shape: Shape::MLA,
        pp: 4,
        prompt_tokens: 8192,
        chunk_tokens: 1024,
        requests: 32,
        concurrency: 2,
        verify: Verify::Last,
        checksums: false,
        duration: None,
        scatter: false,
        request_timeout: Duration::from_secs(60),
        decode_pool: PoolKind::Shared,
        prefill_instances: 1,
        decode_instances: 1,
        metrics: None,
        metrics_linger: Duration::ZERO,
        decode_progress: Default::default(),
        tp: None,
    }
}

fn gqa_run() -> Served {
    let mut w = defaults();
    w.shape = Shape::GQA;
    w.pp = 2;
    w.prompt_tokens = 1000;
    w.chunk_tokens = 256;
    w.checksums = true;
    Served::of(&w, BackendKind::Nixl)
}

#[test]
fn a_prefill_without_flags_takes_decodes_workload_whole() {
    let decode = gqa_run();
    let mine = Served::of(&defaults(), BackendKind::Ucx);
    // Nothing given on the command line: nothing differs, whatever the defaults say.
    assert!(decode.differences(&mine, &[]).is_empty());
    let (w, backend) = decode.apply(&defaults()).unwrap();
    assert_eq!(Served::of(&w, backend), decode);
    assert_eq!(backend, BackendKind::Nixl);
}

#[test]
fn flags_given_that_differ_are_named_and_equal_ones_pass() {
    let decode = gqa_run();
    let mine = Served::of(&defaults(), BackendKind::Ucx);
    let said = decode.differences(&mine, &["--prompt-tokens", "--backend", "--verify"]);
    assert_eq!(
        said,
        vec![
            "--prompt-tokens 8192 here, decode runs 1000".to_string(),
            "--backend ucx here, decode runs nixl".to_string(),
        ]
    );
    // --model names the whole shape.
    let said = decode.differences(&mine, &["--model"]);
    assert!(
        said.iter().any(|s| s == "layers 61 here, decode runs 32"),
        "{said:?}"
    );
    // The same values given again are no difference.
    assert!(
        decode
            .differences(&decode, &["--prompt-tokens", "--pp"])
            .is_empty()
    );
}

fn arb_tp() -> impl Strategy<Value = TpPlan> {
    // Mostly sizes that map (powers of two, heads that split), sometimes anything.
    let size = || prop_oneof![4 => (0u32..4).prop_map(|k| 1u16 << k), 1 => any::<u16>()];
    (
        size(),
        size(),
        prop_oneof![4 => (0u32..5).prop_map(|k| (1u32 << k) & !1), 1 => any::<u32>()],
        prop_oneof![4 => (4u32..7).prop_map(|k| 1u32 << k), 1 => any::<u32>()],
    )
        .prop_map(
            |(prefill_tp, decode_tp, kv_heads, decode_page_tokens)| TpPlan {
                prefill_tp,
                decode_tp,
                kv_heads,
                decode_page_tokens,
            },
        )
}

/// With TP sizes: the pool of the first and last prefill TP rank that writes (a few PP ranks of
/// each), with a slot for twice each decode rank's requests and one more, fits in memory.
fn tp_pools_fit(w: &Workload, backend: BackendKind) -> Result<(), TestCaseError> {
    let Some(plan) = w.tp else {
        return Ok(());
    };
    let spec = kvbench::roles::tp_run(w, plan, backend).unwrap();
    let writers = spec.writing_ranks().unwrap();
    prop_assert!(!writers.is_empty());
    let slots = w
        .concurrency
        .checked_mul(2)
        .unwrap()
        .checked_add(1)
        .unwrap();
    prop_assert!(w.pages().checked_mul(slots).is_some());
    for t in [writers.first(), writers.last()].into_iter().flatten() {
        prop_assert!(!spec.targets(*t).unwrap().is_empty());
        for rank in [0, w.pp / 2, w.pp - 1] {
            let r = PpSplit::SglangEven
                .layer_range(w.shape.layers, w.pp, rank)
                .unwrap();
            let l = spec.layout_slots(
                plan.prefill_tp,
                r.start,
                r.len() as u32,
                w.shape.page_tokens,
                slots,
            );
            prop_assert!(usize::try_from(l.buffer_len).is_ok());
        }
    }
    Ok(())
}

fn arb_served() -> impl Strategy<Value = Served> {
    let small = prop_oneof![0u32..4, 1u32..100_000, any::<u32>()];
    (
        (
            small.clone(),
            prop_oneof![0u64..8, 1u64..10_000, any::<u64>()],
        ),
        (
            small.clone(),
            any::<bool>(),
            prop_oneof![0u16..8, any::<u16>()],
        ),
        (small.clone(), small.clone(), small),
        (
            any::<bool>(),
            prop_oneof![Just("ucx".to_string()), Just("nixl".to_string()), ".{0,8}"],
        ),
        (
            prop_oneof![0u16..4, any::<u16>()],
            prop_oneof![0u16..4, any::<u16>()],
        ),
        prop_oneof![Just(None), arb_tp().prop_map(Some)],
    )
        .prop_map(
            |(
                (layers, bytes_per_token),
                (page_tokens, split_kv, pp),
                (prompt_tokens, chunk_tokens, concurrency),
                (checksums, backend),
                (prefill_instances, decode_instances),
                tp,
            )| Served {
                layers,
                bytes_per_token,
                page_tokens,
                split_kv,
                pp,
                prompt_tokens,
                chunk_tokens,
                concurrency,
                checksums,
                backend,
                prefill_instances,
                decode_instances,
                tp,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// Whatever decode says, the role refuses it with a message or can lay out every rank's pool.
    #[test]
    fn any_workload_a_peer_sends_is_refused_or_laid_out(s in arb_served()) {
        let given = ["--model", "--pp", "--prompt-tokens", "--chunk-tokens", "--concurrency",
                     "--checksums", "--backend", "--prefill-instances", "--decode-instances",
                     "--prefill-tp", "--decode-tp"];
        let _ = s.differences(&Served::of(&defaults(), BackendKind::Ucx), &given);
        match s.apply(&defaults()) {
            Err(e) => prop_assert!(!e.is_empty()),
            Ok((w, backend)) => {
                tp_pools_fit(&w, backend)?;
                prop_assert!(w.prefill_instances > 0 && w.decode_instances > 0);
                // A slot for each request every decode instance can have in flight, and one more.
                let slots = w.concurrency.checked_add(1).unwrap()
                    .checked_mul(u32::from(w.decode_instances)).unwrap();
                let pages = w.pages().checked_mul(slots).unwrap();
                // Any rank's pool (the split is linear in the PP size, so a few ranks of each).
                for rank in [0, w.pp / 2, w.pp - 1] {
                    let r = PpSplit::SglangEven.layer_range(w.shape.layers, w.pp, rank).unwrap();
                    let l = KvLayout::packed(r.start, r.len() as u32, w.shape.regions,
                                             w.shape.page_bytes(), pages);
                    prop_assert!(usize::try_from(l.buffer_len).is_ok());
                }
            }
        }
    }

    /// A TP plan on a workload decode could run (GQA or MLA, any prompt, concurrency and page
    /// size): refused with a message, or every writing rank's pool laid out.
    #[test]
    fn any_tp_plan_a_peer_sends_is_refused_or_laid_out(
        tp in arb_tp(),
        mla in any::<bool>(),
        prompt_tokens in prop_oneof![4 => (1u32..80).prop_map(|k| k * 64), 1 => any::<u32>()],
        concurrency in prop_oneof![1u32..9, any::<u32>()],
        page_tokens in prop_oneof![Just(16u32), Just(32), 1u32..100],
    ) {
        let mut s = gqa_run();
        if mla {
            s.layers = 61;
            s.bytes_per_token = 576;
            s.split_kv = false;
        }
        s.prompt_tokens = prompt_tokens;
        s.concurrency = concurrency;
        s.page_tokens = page_tokens;
        s.tp = Some(tp);
        match s.apply(&defaults()) {
            Err(e) => prop_assert!(!e.is_empty()),
            Ok((w, backend)) => {
                prop_assert_eq!(w.tp, Some(tp));
                tp_pools_fit(&w, backend)?;
            }
        }
    }

    /// Bytes that are not a workload are an error, never a panic.
    #[test]
    fn bytes_from_a_peer_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = serde_json::from_slice::<Served>(&bytes);
    }
}
