//! What a `kvbench prefill` role takes from decode's Hello (`roles::Served`), without I/O: every
//! workload a peer can send is either refused with a message or one the role can size its pool
//! by without overflow, and flags given on the prefill's command line that differ are named.
#![allow(clippy::unwrap_used)]

use kvbench::bench::{Verify, Workload};
use kvbench::cluster::{PoolKind, Shape};
use kvbench::roles::Served;
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
    )
        .prop_map(
            |(
                (layers, bytes_per_token),
                (page_tokens, split_kv, pp),
                (prompt_tokens, chunk_tokens, concurrency),
                (checksums, backend),
                (prefill_instances, decode_instances),
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
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// Whatever decode says, the role refuses it with a message or can lay out every rank's pool.
    #[test]
    fn any_workload_a_peer_sends_is_refused_or_laid_out(s in arb_served()) {
        let given = ["--model", "--pp", "--prompt-tokens", "--chunk-tokens", "--concurrency",
                     "--checksums", "--backend", "--prefill-instances", "--decode-instances"];
        let _ = s.differences(&Served::of(&defaults(), BackendKind::Ucx), &given);
        match s.apply(&defaults()) {
            Err(e) => prop_assert!(!e.is_empty()),
            Ok((w, _)) => {
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

    /// Bytes that are not a workload are an error, never a panic.
    #[test]
    fn bytes_from_a_peer_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = serde_json::from_slice::<Served>(&bytes);
    }
}
