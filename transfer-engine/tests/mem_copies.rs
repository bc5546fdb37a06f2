//! Pool copies (8-byte atomic words, partial words merged) against a plain byte model: any offset,
//! any length, bytes outside the range untouched, bounds and kinds refused with typed errors.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use transfer_engine::mem::{CopyError, HostBuffer, HostOptions, MemDesc, Pool};

const LEN: usize = 1024;

fn pool() -> Pool {
    Pool::Owned(HostBuffer::new(LEN, HostOptions::default()).unwrap())
}

fn snapshot(p: &Pool) -> Vec<u8> {
    let mut v = vec![0u8; LEN];
    p.read_at(0, &mut v).unwrap();
    v
}

#[derive(Debug, Clone)]
enum Op {
    Write(u64, Vec<u8>),
    Fill(u64, usize, u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..LEN as u64, proptest::collection::vec(any::<u8>(), 0..40))
            .prop_map(|(o, b)| Op::Write(o, b)),
        (0..LEN as u64, 0..40usize, any::<u8>()).prop_map(|(o, n, b)| Op::Fill(o, n, b)),
    ]
}

proptest! {
    #[test]
    fn copies_match_a_byte_model(ops in proptest::collection::vec(op(), 1..64), at in 0..LEN as u64, n in 0..64usize) {
        let p = pool();
        let mut model = vec![0u8; LEN];
        for o in ops {
            let (off, bytes) = match o {
                Op::Write(off, b) => (off, b),
                Op::Fill(off, n, b) => (off, vec![b; n]),
            };
            let fits = off as usize + bytes.len() <= LEN;
            let r = p.write_at(off, &bytes);
            prop_assert_eq!(r.is_ok(), fits, "{:?}", r);
            if fits {
                model[off as usize..off as usize + bytes.len()].copy_from_slice(&bytes);
            } else {
                let refused = matches!(r, Err(CopyError::OutOfBounds { .. }));
                prop_assert!(refused);
            }
            prop_assert_eq!(&snapshot(&p), &model);
        }
        let mut out = vec![0u8; n];
        match p.read_at(at, &mut out) {
            Ok(()) => prop_assert_eq!(&out[..], &model[at as usize..at as usize + n]),
            Err(e) => {
                prop_assert!(at as usize + n > LEN, "{:?}", e);
            }
        }
        let mut pieces = Vec::new();
        p.read_pieces(0, LEN as u64, |b| pieces.extend_from_slice(b)).unwrap();
        prop_assert_eq!(&pieces, &model);
    }
}

#[test]
fn rows_whose_span_overflows_are_refused_before_any_copy() {
    let (src, dst) = (pool(), pool());
    dst.fill_at(0, LEN, 0x5A).unwrap();
    // Three rows of 8 bytes 2^63 apart: the last row's end overflows u64.
    for (stride, rows) in [(1u64 << 63, 3u64), (u64::MAX, 2), (u64::MAX / 2, 3)] {
        assert!(matches!(
            src.copy_rows_to(0, &dst, 0, 8, rows, stride),
            Err(CopyError::OutOfBounds { .. })
        ));
    }
    // Rows whose packed source length overflows.
    assert!(matches!(
        src.copy_rows_to(0, &dst, 0, u64::MAX, 2, u64::MAX),
        Err(CopyError::OutOfBounds { .. })
    ));
    assert_eq!(snapshot(&dst), vec![0x5A; LEN]);
}

#[test]
fn partial_words_leave_their_neighbours_alone() {
    let p = pool();
    p.fill_at(0, 24, 0xAA).unwrap();
    p.write_at(3, &[1, 2, 3]).unwrap();
    p.write_at(13, &[9; 6]).unwrap();
    let mut v = [0u8; 24];
    p.read_at(0, &mut v).unwrap();
    let mut want = [0xAAu8; 24];
    want[3..6].copy_from_slice(&[1, 2, 3]);
    want[13..19].copy_from_slice(&[9; 6]);
    assert_eq!(v, want);
}

#[test]
fn device_and_unaligned_pools_are_refused_before_any_access() {
    let mut b = vec![0u64; 4];
    let base = b.as_mut_ptr().cast::<u8>();
    // SAFETY: `b` outlives both pools, which are only asked to copy and refuse before touching it.
    let odd = unsafe { Pool::borrowed(MemDesc::host_raw(base.wrapping_add(1), 16)) };
    assert!(matches!(
        odd.read_at(0, &mut [0u8; 4]),
        Err(CopyError::Unaligned { .. })
    ));
    // SAFETY: as above; a device description of host memory is never dereferenced by copies.
    let dev = unsafe { Pool::borrowed(MemDesc::cuda_raw(base as u64, 32, 0)) };
    assert_eq!(dev.write_at(0, &[1]), Err(CopyError::NotHost));
    assert_eq!(b, [0; 4]);
}

proptest! {
    /// Copies from one pool into another (a decode's landing memory into its pages) match the
    /// byte model: packed rows from the source, each to its place in the destination, nothing
    /// else changed; any range outside either pool refused before anything is copied.
    #[test]
    fn rows_copied_between_pools_match_a_byte_model(
        seed in proptest::collection::vec(any::<u8>(), LEN..=LEN),
        from in 0..LEN as u64 + 16, to in 0..LEN as u64 + 16,
        len in 0..48u64, rows in 0..12u64, gap in 0..24u64, words in any::<bool>(),
    ) {
        // Half the cases in whole words, which take the word-by-word path.
        let w = |x: u64| if words { x / 8 * 8 } else { x };
        let (from, to, len, gap) = (w(from), w(to), w(len), w(gap));
        let (src, dst) = (pool(), pool());
        src.write_at(0, &seed).unwrap();
        dst.fill_at(0, LEN, 0x5A).unwrap();
        let mut model = vec![0x5Au8; LEN];
        let stride = len + gap;
        let fits = from + len * rows <= LEN as u64
            && to + rows.saturating_sub(1) * stride + len.min(rows * len) <= LEN as u64;
        let r = src.copy_rows_to(from, &dst, to, len, rows, stride);
        prop_assert_eq!(r.is_ok(), fits, "{:?}", r);
        if fits {
            for i in 0..rows {
                let (s, d) = ((from + i * len) as usize, (to + i * stride) as usize);
                model[d..d + len as usize].copy_from_slice(&seed[s..s + len as usize]);
            }
        }
        prop_assert_eq!(&snapshot(&dst), &model);
        // One row, with `copy_to`.
        let fits = from + len <= LEN as u64 && to + len <= LEN as u64;
        let r = src.copy_to(from, &dst, to, len);
        prop_assert_eq!(r.is_ok(), fits, "{:?}", r);
        if fits {
            model[to as usize..(to + len) as usize]
                .copy_from_slice(&seed[from as usize..(from + len) as usize]);
        }
        prop_assert_eq!(&snapshot(&dst), &model);
    }
}
