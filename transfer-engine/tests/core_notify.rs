//! Notification codec: round trips, SGLang compatibility, and "never panics" on any bytes,
//! including a ten-million-input seeded fuzz run.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use transfer_engine::core::notify::{
    self, ChunkNotification, ChunkStatus, DecodeError, MAGIC, Notification, RECORD_LEN, TextForm,
};
use transfer_engine::core::vote::VoteMessage;
use transfer_engine::core::{FailureCode, RequestId};

fn status() -> impl Strategy<Value = ChunkStatus> {
    prop_oneof![
        Just(ChunkStatus::More),
        any::<u32>().prop_map(|c| ChunkStatus::Last { count: c }),
        any::<u16>().prop_map(|c| ChunkStatus::Failed {
            code: FailureCode::from_raw(c)
        }),
    ]
}

fn notification() -> impl Strategy<Value = ChunkNotification> {
    (
        any::<u64>(),
        any::<u16>(),
        any::<u32>(),
        status(),
        any::<Option<u64>>(),
        any::<Option<u32>>(),
    )
        .prop_map(|(r, p, c, s, sum, posted)| {
            let mut n = ChunkNotification::new(RequestId(r), p, c, s);
            // Keep the generated value valid: a LAST count above the id, no checksum on failure.
            if let ChunkStatus::Last { count } = &mut n.status {
                *count = (*count).max(c.saturating_add(1));
                if c == u32::MAX {
                    n.status = ChunkStatus::More;
                }
            }
            if !matches!(n.status, ChunkStatus::Failed { .. }) {
                n.checksum = sum;
            }
            n.posted_us = posted;
            n
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn binary_round_trip(n in notification()) {
        let bytes = n.encode();
        prop_assert_eq!(notify::decode(&bytes), Ok(Notification::Chunk(n)));
        prop_assert_eq!(notify::decode_binary(&bytes), Ok(n));
    }

    /// A stamp read on a clock within 35 minutes of the sender's (either way) gives back the
    /// sender's whole instant, whatever the instant.
    #[test]
    fn a_posted_stamp_is_found_whole_near_the_readers_clock(
        posted in (1u64 << 32)..u64::MAX - (1 << 32),
        ahead in -(1i64 << 31) + 1..(1i64 << 31),
    ) {
        let now = posted.checked_add_signed(ahead).unwrap();
        let n = ChunkNotification::new(RequestId(1), 0, 0, ChunkStatus::More).with_posted(posted);
        let got = notify::decode_binary(&n.encode()).unwrap().posted_us.unwrap();
        prop_assert_eq!(notify::posted_near(got, now), posted);
    }

    #[test]
    fn text_round_trip(req in any::<u64>(), rank in any::<u16>(), id in 0u32..u32::MAX, last in any::<bool>()) {
        let status = if last { ChunkStatus::Last { count: id + 1 } } else { ChunkStatus::More };
        let n = ChunkNotification::new(RequestId(req), rank, id, status);
        let s = n.encode_text(TextForm::WithPpRank).unwrap();
        prop_assert_eq!(notify::decode(s.as_bytes()), Ok(Notification::Chunk(n)));
        let legacy = ChunkNotification { pp_rank: 0, ..n };
        let s = legacy.encode_text(TextForm::Legacy).unwrap();
        prop_assert_eq!(notify::decode(s.as_bytes()), Ok(Notification::Chunk(legacy)));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
        let _ = notify::decode(&bytes);
        let _ = notify::decode_binary(&bytes);
        let _ = VoteMessage::decode(&bytes);
    }

    #[test]
    fn any_single_byte_change_is_caught_or_changes_a_field(n in notification(), pos in 0usize..RECORD_LEN, x in 1u8..=255) {
        let mut b = n.encode();
        b[pos] ^= x;
        // Either rejected, or a decoded value that differs (never silently the same).
        if let Ok(m) = notify::decode(&b) {
            prop_assert_ne!(m, Notification::Chunk(n));
        }
    }

    #[test]
    fn text_like_strings_never_panic(s in "[0-9_kvauxstTrueFalse]{0,100}") {
        let _ = notify::decode(s.as_bytes());
    }
}

#[test]
fn binary_record_is_stable() {
    // A fixed record, so an accidental layout change fails loudly (layout in docs/wire-format.md).
    let n = ChunkNotification::new(
        RequestId(0x1122334455667788),
        3,
        5,
        ChunkStatus::Last { count: 6 },
    )
    .with_checksum(0xAABBCCDDEEFF0011);
    let hex: String = n.encode().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        hex,
        "c74b564e01000500887766554433221105000000060000001100ffeeddccbbaa0300000000000000"
    );
    assert_eq!(
        u32::from_le_bytes(n.encode()[..4].try_into().unwrap()),
        MAGIC
    );
}

#[test]
fn sglang_true_false_and_legacy() {
    assert_eq!(
        notify::decode(b"5_kv_0_True"),
        Ok(Notification::Chunk(ChunkNotification::new(
            RequestId(5),
            0,
            0,
            ChunkStatus::Last { count: 1 }
        )))
    );
    assert!(matches!(
        notify::decode(b"5_kv_0_true"),
        Err(DecodeError::TextBadField { .. })
    ));
    assert!(notify::decode(b"5_kv_0_1_2_").is_err());
    assert!(notify::decode(b"_kv_0_1").is_err());
    assert!(notify::decode(&[b'1'; 200]).is_err());
}

/// Small, fast generator for the fuzz loop; ChaCha seeds it and fills the byte pool.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn fuzz_worker(seed: u64, iterations: u64) -> [u64; 3] {
    let mut chacha = ChaCha8Rng::seed_from_u64(seed);
    let mut pool = vec![0u8; 1 << 20];
    chacha.fill_bytes(&mut pool);
    let mut rng = SplitMix(chacha.next_u64());
    let templates: Vec<[u8; RECORD_LEN]> = vec![
        ChunkNotification::new(RequestId(1), 0, 0, ChunkStatus::More).encode(),
        ChunkNotification::new(
            RequestId(u64::MAX),
            15,
            1023,
            ChunkStatus::Last { count: 1024 },
        )
        .with_checksum(7)
        .encode(),
        ChunkNotification::new(
            RequestId(9),
            2,
            3,
            ChunkStatus::Failed {
                code: FailureCode::Timeout,
            },
        )
        .encode(),
    ];
    let texts: [&[u8]; 6] = [
        b"123_kv_4_0",
        b"123_kv_4_1_3",
        b"18446744073709551615_kv_4294967294_True_65535",
        b"77_aux",
        b"77_state_2",
        b"0_kv_0_False",
    ];
    let alphabet = b"0123456789_kvauxstateTrueFals\xC7\x00\xFF";
    let mut buf = [0u8; 128];
    let mut ok = [0u64; 3];
    for _ in 0..iterations {
        let kind = rng.below(10);
        let len = match kind {
            // Pure random bytes, any length up to 96.
            0..=3 => {
                let len = rng.below(97) as usize;
                let off = rng.below((pool.len() - len) as u64) as usize;
                buf[..len].copy_from_slice(&pool[off..off + len]);
                if kind == 3 && len >= 8 {
                    // Valid magic and version, so the field checks are reached.
                    buf[..4].copy_from_slice(&MAGIC.to_le_bytes());
                    buf[4..6].copy_from_slice(&1u16.to_le_bytes());
                }
                len
            }
            // A valid record with one to four random byte changes, sometimes resized.
            4..=6 => {
                let t = &templates[rng.below(templates.len() as u64) as usize];
                buf[..RECORD_LEN].copy_from_slice(t);
                for _ in 0..=rng.below(4) {
                    let pos = rng.below(RECORD_LEN as u64) as usize;
                    buf[pos] ^= 1 + rng.below(255) as u8;
                }
                match rng.below(8) {
                    0 => rng.below(RECORD_LEN as u64) as usize,
                    1 => RECORD_LEN + 1 + rng.below(40) as usize,
                    _ => RECORD_LEN,
                }
            }
            // A valid text form with edits from a text-like alphabet.
            _ => {
                let t = texts[rng.below(texts.len() as u64) as usize];
                let mut len = t.len();
                buf[..len].copy_from_slice(t);
                for _ in 0..=rng.below(3) {
                    let c = alphabet[rng.below(alphabet.len() as u64) as usize];
                    let pos = rng.below(len as u64 + 1) as usize;
                    match rng.below(3) {
                        0 if pos < len => buf[pos] = c,
                        1 if len < buf.len() => {
                            buf.copy_within(pos..len, pos + 1);
                            buf[pos] = c;
                            len += 1;
                        }
                        _ if pos < len => {
                            buf.copy_within(pos + 1..len, pos);
                            len -= 1;
                        }
                        _ => {}
                    }
                }
                len
            }
        };
        let input = &buf[..len];
        let bucket = (kind.min(7) / 4) as usize + usize::from(kind >= 7);
        if notify::decode(input).is_ok() {
            ok[bucket] += 1;
        }
        let _ = VoteMessage::decode(input);
    }
    ok
}

/// Ten million seeded inputs: random bytes, mutated binary records, mutated text records. The
/// assertion is that nothing panics; the counts show each family reached the decoder's depths.
#[test]
fn ten_million_random_inputs_never_panic() {
    const TOTAL: u64 = 10_000_000;
    let threads = 2u64;
    let results: Vec<[u64; 3]> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|i| s.spawn(move || fuzz_worker(0xF022 + i, TOTAL / threads)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok = results
        .iter()
        .fold([0u64; 3], |a, b| [a[0] + b[0], a[1] + b[1], a[2] + b[2]]);
    // Mutated records and texts must sometimes still decode (the mutations are not all fatal)
    // and mostly not: a sanity check that the fuzz reaches both outcomes.
    assert!(ok[1] > 0 && ok[1] < TOTAL * 3 / 10, "binary ok {}", ok[1]);
    assert!(ok[2] > 0 && ok[2] < TOTAL * 3 / 10, "text ok {}", ok[2]);
}
