//! Chunk notifications: the binary v1 record and SGLang's NIXL text forms.
//!
//! A notification is sent after a chunk's writes are remotely complete, so it never overtakes its
//! data. [`decode`] takes any byte string a transport hands over and returns a typed
//! [`Notification`] or a typed [`DecodeError`]; it never panics. The byte layout is in
//! `docs/wire-format.md`.
//!
//! # Validation rules of the binary record
//! - exactly [`RECORD_LEN`] bytes, magic [`MAGIC`], version [`VERSION`];
//! - no flag bits other than [`flags::LAST`], [`flags::FAILURE`], [`flags::HAS_CHECKSUM`];
//! - `LAST` requires `chunk_count > chunk_id` (so a count of 0 is rejected); without `LAST` the
//!   count field must be 0 (a count announced early could disagree with the final one);
//! - `FAILURE` excludes `LAST` and `HAS_CHECKSUM` (a failed chunk has no final count and no
//!   bytes to vouch for); without `FAILURE` the failure code must be 0;
//! - without `HAS_CHECKSUM` the checksum field must be 0; without `POSTED` the `posted_us` field
//!   must be 0.
//!
//! Every zero-unless rule keeps one encoding per notification, so a record that was corrupted in
//! an unused field is caught instead of silently accepted.

use crate::core::{FailureCode, RequestId};

/// Length of the binary v1 record in bytes.
pub const RECORD_LEN: usize = 40;
/// First four bytes of every binary record: `C7 4B 56 4E` (`\xC7KVN`), read as a little-endian
/// `u32`. The first byte is not ASCII, so a record can never be mistaken for a text form.
pub const MAGIC: u32 = u32::from_le_bytes([0xC7, b'K', b'V', b'N']);
/// The only binary version this decoder accepts.
pub const VERSION: u16 = 1;
/// Longest text notification accepted; SGLang's longest form is well under half of this.
pub const MAX_TEXT_LEN: usize = 96;

/// Flag bits of the binary record.
pub mod flags {
    /// The chunk is this rank's last; `chunk_count` is valid.
    pub const LAST: u16 = 1 << 0;
    /// The rank failed the request; `failure_code` says why.
    pub const FAILURE: u16 = 1 << 1;
    /// `checksum` holds the xxh3-64 of the chunk's bytes.
    pub const HAS_CHECKSUM: u16 = 1 << 2;
    /// `posted_us` holds when the sender posted the chunk (see
    /// [`ChunkNotification::posted_us`](super::ChunkNotification::posted_us)).
    pub const POSTED: u16 = 1 << 3;
    /// Every bit a v1 decoder understands.
    pub const ALL: u16 = LAST | FAILURE | HAS_CHECKSUM | POSTED;
}

/// The v1 record as it lies on the wire. Every field is little-endian bytes, so the struct has
/// alignment 1 and can be viewed in place from any byte slice on any host.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct WireRecordV1 {
    /// [`MAGIC`], little-endian.
    pub magic: [u8; 4],
    /// [`VERSION`], little-endian.
    pub version: [u8; 2],
    /// [`flags`] bits.
    pub flags: [u8; 2],
    /// Request id.
    pub request_id: [u8; 8],
    /// Chunk id within this PP rank's chunks.
    pub chunk_id: [u8; 4],
    /// The rank's total chunk count (with `LAST`), else 0.
    pub chunk_count: [u8; 4],
    /// xxh3-64 of the chunk's bytes (with `HAS_CHECKSUM`), else 0.
    pub checksum: [u8; 8],
    /// Sending PP rank.
    pub pp_rank: [u8; 2],
    /// [`FailureCode`] number (with `FAILURE`), else 0.
    pub failure_code: [u8; 2],
    /// With `POSTED`, the low 32 bits of the sender's wall clock in microseconds since the Unix
    /// epoch when it posted the chunk's writes; else 0.
    pub posted_us: [u8; 4],
}

const _: () = assert!(std::mem::size_of::<WireRecordV1>() == RECORD_LEN);

/// What a rank says about one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChunkStatus {
    /// The chunk arrived; more may follow.
    More,
    /// The chunk arrived and was the rank's last; the rank sends `count` chunks in all.
    Last {
        /// Total chunks of this rank (ids `0..count`).
        count: u32,
    },
    /// The rank failed the request; `chunk_id` names the chunk it was on (informational).
    Failed {
        /// Why.
        code: FailureCode,
    },
}

/// One decoded chunk notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkNotification {
    /// The request.
    pub request: RequestId,
    /// Sending PP rank.
    pub pp_rank: u16,
    /// Chunk id within the rank's chunks.
    pub chunk_id: u32,
    /// More, last, or failed.
    pub status: ChunkStatus,
    /// xxh3-64 of the chunk's bytes, when the sender computed it.
    pub checksum: Option<u64>,
    /// When the sender posted the chunk's writes: the low 32 bits of its wall clock in
    /// microseconds since the Unix epoch (they wrap every 71.6 minutes; a receiver whose clock is
    /// within half of that of the sender's finds the whole instant, [`posted_near`]).
    pub posted_us: Option<u32>,
}

/// The wall clock now, in microseconds since the Unix epoch (0 for a clock set before it).
pub fn wall_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The instant (microseconds since the Unix epoch) whose low 32 bits are `low` that lies nearest
/// to `now_us`: a [`ChunkNotification::posted_us`] read on a clock within 35 minutes of the
/// sender's.
pub fn posted_near(low: u32, now_us: u64) -> u64 {
    const WRAP: u64 = 1 << 32;
    let base = (now_us & !(WRAP - 1)) | u64::from(low);
    [base.checked_sub(WRAP), Some(base), base.checked_add(WRAP)]
        .into_iter()
        .flatten()
        .min_by_key(|c| c.abs_diff(now_us))
        .unwrap_or(base)
}

/// Anything [`decode`] recognises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Notification {
    /// A chunk of KV pages (binary record, or SGLang `{room}_kv_...`).
    Chunk(ChunkNotification),
    /// SGLang `{room}_aux`: the auxiliary (metadata) buffer of the request was written.
    Aux {
        /// The request.
        request: RequestId,
    },
    /// SGLang `{room}_state_{pp_rank}`: a rank's state buffers (e.g. Mamba) were written.
    State {
        /// The request.
        request: RequestId,
        /// Sending PP rank.
        pp_rank: u16,
    },
}

/// Which text field failed to parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TextField {
    /// The leading room (request id).
    Room,
    /// The chunk id after `_kv_`.
    ChunkId,
    /// The is-last marker (`0`, `1`, `True`, `False`).
    IsLast,
    /// The trailing PP rank.
    PpRank,
}

/// Why a byte string is not a valid notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Empty input.
    #[error("empty notification")]
    Empty,
    /// A binary record (it starts with the magic) of the wrong length.
    #[error("binary notification is {len} bytes, expected {expected}")]
    BadLength {
        /// Bytes received.
        len: usize,
        /// [`RECORD_LEN`].
        expected: usize,
    },
    /// Neither the binary magic nor a text form (text starts with a decimal digit).
    #[error("unrecognised notification (first bytes {found:#010x})")]
    BadMagic {
        /// The first up-to-four bytes, little-endian.
        found: u32,
    },
    /// Binary record of a version this decoder does not speak.
    #[error("unsupported notification version {found}")]
    BadVersion {
        /// Version in the record.
        found: u16,
    },
    /// Flag bits v1 does not define.
    #[error("unknown notification flag bits {bits:#06x}")]
    UnknownFlags {
        /// The unknown bits only.
        bits: u16,
    },
    /// `LAST` with a chunk count that does not exceed the chunk id (including 0).
    #[error("chunk count {count} must exceed last chunk id {chunk_id}")]
    CountNotAboveChunk {
        /// Chunk id.
        chunk_id: u32,
        /// Count sent.
        count: u32,
    },
    /// A non-zero count without `LAST`.
    #[error("chunk count {count} without the LAST flag")]
    CountWithoutLast {
        /// Count sent.
        count: u32,
    },
    /// `FAILURE` together with `LAST`.
    #[error("FAILURE and LAST flags together")]
    FailureWithLast,
    /// `FAILURE` together with `HAS_CHECKSUM`.
    #[error("FAILURE and HAS_CHECKSUM flags together")]
    FailureWithChecksum,
    /// A non-zero failure code without `FAILURE`.
    #[error("failure code {code} without the FAILURE flag")]
    CodeWithoutFailure {
        /// Code sent.
        code: u16,
    },
    /// A non-zero checksum without `HAS_CHECKSUM`.
    #[error("checksum without the HAS_CHECKSUM flag")]
    ChecksumWithoutFlag,
    /// The `posted_us` field is not zero and `POSTED` is not set.
    #[error("posted_us field is {value:#x} without the POSTED flag, must be 0")]
    ReservedNonZero {
        /// Value found.
        value: u32,
    },
    /// Text longer than [`MAX_TEXT_LEN`].
    #[error("text notification of {len} bytes exceeds {max}")]
    TextTooLong {
        /// Bytes received.
        len: usize,
        /// [`MAX_TEXT_LEN`].
        max: usize,
    },
    /// A text field is not a number in range.
    #[error("text notification field {field:?} is not valid")]
    TextBadField {
        /// Which field.
        field: TextField,
    },
    /// A text kind other than `kv`, `aux`, `state`.
    #[error("unknown text notification kind")]
    TextUnknownKind,
    /// A known text kind with the wrong number of `_`-separated fields.
    #[error("text notification has {found} fields, not a known form")]
    TextFieldCount {
        /// Fields found.
        found: usize,
    },
    /// Text `LAST` on chunk id `u32::MAX`, whose count would not fit.
    #[error("text LAST notification on chunk id {chunk_id} has no representable count")]
    TextCountOverflow {
        /// Chunk id.
        chunk_id: u32,
    },
}

/// Why a notification has no text form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TextEncodeError {
    /// SGLang's text forms carry no failure.
    #[error("SGLang text notifications cannot carry a failure")]
    Failure,
    /// The text form implies `count = chunk_id + 1`; a different count cannot be written.
    #[error("text LAST implies count {implied}, notification says {count}")]
    CountNotImplied {
        /// `chunk_id + 1`.
        implied: u64,
        /// The count in the notification.
        count: u32,
    },
    /// The legacy form has no PP rank field, so it can only speak for rank 0.
    #[error("legacy text form cannot carry pp_rank {pp_rank}")]
    LegacyNeedsRankZero {
        /// The rank in the notification.
        pp_rank: u16,
    },
}

/// Which SGLang text form to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TextForm {
    /// `{room}_kv_{chunk_id}_{0|1}`: before SGLang's PP fix; rank 0 only.
    Legacy,
    /// `{room}_kv_{chunk_id}_{0|1}_{pp_rank}`: after it.
    WithPpRank,
}

impl ChunkNotification {
    /// A notification without checksum.
    pub const fn new(request: RequestId, pp_rank: u16, chunk_id: u32, status: ChunkStatus) -> Self {
        Self {
            request,
            pp_rank,
            chunk_id,
            status,
            checksum: None,
            posted_us: None,
        }
    }

    /// The same notification saying it was posted at `wall_us` (microseconds since the Unix epoch
    /// on the sender's wall clock; the record keeps the low 32 bits).
    #[must_use]
    pub const fn with_posted(mut self, wall_us: u64) -> Self {
        self.posted_us = Some(wall_us as u32);
        self
    }

    /// The same notification carrying `checksum` (see [`crate::core::checksum`]).
    #[must_use]
    pub const fn with_checksum(mut self, checksum: u64) -> Self {
        self.checksum = Some(checksum);
        self
    }

    /// The binary v1 record.
    ///
    /// Encoding does not validate: a notification that breaks the rules above (say `Last` with
    /// a count not above the chunk id, or `Failed` with a checksum) encodes to a record that
    /// [`decode`] rejects, which is what a test of the decoder wants.
    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let (mut fl, count, code) = match self.status {
            ChunkStatus::More => (0, 0, 0),
            ChunkStatus::Last { count } => (flags::LAST, count, 0),
            ChunkStatus::Failed { code } => (flags::FAILURE, 0, code.raw()),
        };
        if self.checksum.is_some() {
            fl |= flags::HAS_CHECKSUM;
        }
        if self.posted_us.is_some() {
            fl |= flags::POSTED;
        }
        let rec = WireRecordV1 {
            magic: MAGIC.to_le_bytes(),
            version: VERSION.to_le_bytes(),
            flags: fl.to_le_bytes(),
            request_id: self.request.0.to_le_bytes(),
            chunk_id: self.chunk_id.to_le_bytes(),
            chunk_count: count.to_le_bytes(),
            checksum: self.checksum.unwrap_or(0).to_le_bytes(),
            pp_rank: self.pp_rank.to_le_bytes(),
            failure_code: code.to_le_bytes(),
            posted_us: self.posted_us.unwrap_or(0).to_le_bytes(),
        };
        bytemuck::cast(rec)
    }

    /// The SGLang text form, for a Python decode peer.
    ///
    /// # Errors
    /// [`TextEncodeError`] when the notification says something the text cannot: a failure, a
    /// last count other than `chunk_id + 1`, or a non-zero rank in the legacy form. The checksum
    /// is dropped (the text has no field for it).
    pub fn encode_text(&self, form: TextForm) -> Result<String, TextEncodeError> {
        use std::fmt::Write as _;
        let last = match self.status {
            ChunkStatus::More => 0,
            ChunkStatus::Last { count } => {
                let implied = u64::from(self.chunk_id) + 1;
                if u64::from(count) != implied {
                    return Err(TextEncodeError::CountNotImplied { implied, count });
                }
                1
            }
            ChunkStatus::Failed { .. } => return Err(TextEncodeError::Failure),
        };
        let mut s = String::with_capacity(48);
        // Writing into a String cannot fail.
        let _ = write!(s, "{}_kv_{}_{}", self.request.0, self.chunk_id, last);
        match form {
            TextForm::Legacy if self.pp_rank != 0 => {
                return Err(TextEncodeError::LegacyNeedsRankZero {
                    pp_rank: self.pp_rank,
                });
            }
            TextForm::Legacy => {}
            TextForm::WithPpRank => {
                let _ = write!(s, "_{}", self.pp_rank);
            }
        }
        Ok(s)
    }
}

/// SGLang's `{room}_aux` notification.
pub fn encode_aux_text(request: RequestId) -> String {
    format!("{}_aux", request.0)
}

/// SGLang's `{room}_state_{pp_rank}` notification.
pub fn encode_state_text(request: RequestId, pp_rank: u16) -> String {
    format!("{}_state_{}", request.0, pp_rank)
}

/// Decodes any notification: the binary record or one of the SGLang text forms.
///
/// # Errors
/// A [`DecodeError`] naming the first rule the input breaks. Never panics, on any input.
pub fn decode(bytes: &[u8]) -> Result<Notification, DecodeError> {
    match bytes.first() {
        None => Err(DecodeError::Empty),
        Some(b) if b.is_ascii_digit() => decode_text(bytes),
        Some(_) => decode_binary(bytes).map(Notification::Chunk),
    }
}

/// Decodes the binary record only (the hot path when both sides are this engine).
///
/// # Errors
/// As [`decode`]; text input gives [`DecodeError::BadMagic`].
#[inline]
pub fn decode_binary(bytes: &[u8]) -> Result<ChunkNotification, DecodeError> {
    let Ok(rec) = bytemuck::try_from_bytes::<WireRecordV1>(bytes) else {
        let mut head = [0u8; 4];
        let n = bytes.len().min(4);
        head[..n].copy_from_slice(&bytes[..n]);
        let found = u32::from_le_bytes(head);
        return Err(if found == MAGIC {
            DecodeError::BadLength {
                len: bytes.len(),
                expected: RECORD_LEN,
            }
        } else {
            DecodeError::BadMagic { found }
        });
    };
    let magic = u32::from_le_bytes(rec.magic);
    if magic != MAGIC {
        return Err(DecodeError::BadMagic { found: magic });
    }
    let version = u16::from_le_bytes(rec.version);
    if version != VERSION {
        return Err(DecodeError::BadVersion { found: version });
    }
    let fl = u16::from_le_bytes(rec.flags);
    if fl & !flags::ALL != 0 {
        return Err(DecodeError::UnknownFlags {
            bits: fl & !flags::ALL,
        });
    }
    let chunk_id = u32::from_le_bytes(rec.chunk_id);
    let count = u32::from_le_bytes(rec.chunk_count);
    let code = u16::from_le_bytes(rec.failure_code);
    let sum = u64::from_le_bytes(rec.checksum);
    let posted = u32::from_le_bytes(rec.posted_us);
    let has_posted = fl & flags::POSTED != 0;
    if !has_posted && posted != 0 {
        return Err(DecodeError::ReservedNonZero { value: posted });
    }
    let last = fl & flags::LAST != 0;
    let failed = fl & flags::FAILURE != 0;
    let has_sum = fl & flags::HAS_CHECKSUM != 0;
    let status = if failed {
        if last {
            return Err(DecodeError::FailureWithLast);
        }
        if has_sum {
            return Err(DecodeError::FailureWithChecksum);
        }
        if count != 0 {
            return Err(DecodeError::CountWithoutLast { count });
        }
        ChunkStatus::Failed {
            code: FailureCode::from_raw(code),
        }
    } else {
        if code != 0 {
            return Err(DecodeError::CodeWithoutFailure { code });
        }
        if last {
            if count <= chunk_id {
                return Err(DecodeError::CountNotAboveChunk { chunk_id, count });
            }
            ChunkStatus::Last { count }
        } else {
            if count != 0 {
                return Err(DecodeError::CountWithoutLast { count });
            }
            ChunkStatus::More
        }
    };
    if !has_sum && sum != 0 {
        return Err(DecodeError::ChecksumWithoutFlag);
    }
    Ok(ChunkNotification {
        request: RequestId(u64::from_le_bytes(rec.request_id)),
        pp_rank: u16::from_le_bytes(rec.pp_rank),
        chunk_id,
        status,
        checksum: has_sum.then_some(sum),
        posted_us: has_posted.then_some(posted),
    })
}

/// Parses a plain decimal number: digits only, no sign, no spaces, no overflow.
fn parse_dec(field: &[u8], max: u64, which: TextField) -> Result<u64, DecodeError> {
    let bad = DecodeError::TextBadField { field: which };
    if field.is_empty() || field.len() > 20 {
        return Err(bad);
    }
    let mut v: u64 = 0;
    for &b in field {
        if !b.is_ascii_digit() {
            return Err(bad);
        }
        v = v
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(b - b'0')))
            .ok_or(bad)?;
    }
    if v > max {
        return Err(bad);
    }
    Ok(v)
}

fn decode_text(bytes: &[u8]) -> Result<Notification, DecodeError> {
    if bytes.len() > MAX_TEXT_LEN {
        return Err(DecodeError::TextTooLong {
            len: bytes.len(),
            max: MAX_TEXT_LEN,
        });
    }
    // At most six fields matter; a seventh means the form is unknown.
    let mut fields: [&[u8]; 6] = [&[]; 6];
    let mut n = 0usize;
    for part in bytes.split(|&b| b == b'_') {
        if n == fields.len() {
            return Err(DecodeError::TextFieldCount { found: n + 1 });
        }
        fields[n] = part;
        n += 1;
    }
    let request = RequestId(parse_dec(fields[0], u64::MAX, TextField::Room)?);
    match (fields[1], n) {
        (b"kv", 4 | 5) => {
            let chunk_id = parse_dec(fields[2], u64::from(u32::MAX), TextField::ChunkId)? as u32;
            let last = match fields[3] {
                b"0" | b"False" => false,
                b"1" | b"True" => true,
                _ => {
                    return Err(DecodeError::TextBadField {
                        field: TextField::IsLast,
                    });
                }
            };
            let pp_rank = if n == 5 {
                parse_dec(fields[4], u64::from(u16::MAX), TextField::PpRank)? as u16
            } else {
                0
            };
            let status = if last {
                let count = chunk_id
                    .checked_add(1)
                    .ok_or(DecodeError::TextCountOverflow { chunk_id })?;
                ChunkStatus::Last { count }
            } else {
                ChunkStatus::More
            };
            Ok(Notification::Chunk(ChunkNotification::new(
                request, pp_rank, chunk_id, status,
            )))
        }
        (b"aux", 2) => Ok(Notification::Aux { request }),
        (b"state", 3) => {
            let pp_rank = parse_dec(fields[2], u64::from(u16::MAX), TextField::PpRank)? as u16;
            Ok(Notification::State { request, pp_rank })
        }
        (b"kv" | b"aux" | b"state", found) => Err(DecodeError::TextFieldCount { found }),
        _ => Err(DecodeError::TextUnknownKind),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn chunk(n: Notification) -> ChunkNotification {
        match n {
            Notification::Chunk(c) => c,
            other => panic!("not a chunk: {other:?}"),
        }
    }

    #[test]
    fn binary_round_trip() {
        let cases = [
            ChunkNotification::new(RequestId(u64::MAX), 15, 0, ChunkStatus::More),
            ChunkNotification::new(RequestId(1), 3, 9, ChunkStatus::Last { count: 10 })
                .with_checksum(0xdead_beef_0000_0001),
            ChunkNotification::new(
                RequestId(42),
                0,
                7,
                ChunkStatus::Failed {
                    code: FailureCode::Other(999),
                },
            ),
        ];
        for c in cases {
            assert_eq!(chunk(decode(&c.encode()).unwrap()), c);
            assert_eq!(decode_binary(&c.encode()).unwrap(), c);
        }
    }

    #[test]
    fn byte_layout_is_little_endian() {
        let c = ChunkNotification::new(RequestId(0x0102_0304_0506_0708), 0x0A0B, 0x1122_3344, {
            ChunkStatus::Last { count: 0x1122_3345 }
        });
        let b = c.encode();
        assert_eq!(&b[0..4], &[0xC7, b'K', b'V', b'N']);
        assert_eq!(&b[4..6], &[1, 0]);
        assert_eq!(&b[6..8], &[1, 0]);
        assert_eq!(&b[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[16..20], &[0x44, 0x33, 0x22, 0x11]);
        assert_eq!(&b[20..24], &[0x45, 0x33, 0x22, 0x11]);
        assert_eq!(&b[32..34], &[0x0B, 0x0A]);
    }

    #[test]
    fn binary_rules() {
        let base = ChunkNotification::new(RequestId(5), 1, 4, ChunkStatus::More).encode();
        let with = |f: &dyn Fn(&mut WireRecordV1)| {
            let mut r: WireRecordV1 = bytemuck::cast(base);
            f(&mut r);
            decode(bytemuck::bytes_of(&r))
        };
        assert_eq!(
            with(&|r| r.version = 2u16.to_le_bytes()),
            Err(DecodeError::BadVersion { found: 2 })
        );
        assert_eq!(
            with(&|r| r.flags = 0x10u16.to_le_bytes()),
            Err(DecodeError::UnknownFlags { bits: 0x10 })
        );
        assert_eq!(
            with(&|r| r.flags = flags::LAST.to_le_bytes()),
            Err(DecodeError::CountNotAboveChunk {
                chunk_id: 4,
                count: 0
            })
        );
        assert_eq!(
            with(&|r| {
                r.flags = flags::LAST.to_le_bytes();
                r.chunk_count = 4u32.to_le_bytes();
            }),
            Err(DecodeError::CountNotAboveChunk {
                chunk_id: 4,
                count: 4
            })
        );
        assert_eq!(
            with(&|r| r.chunk_count = 9u32.to_le_bytes()),
            Err(DecodeError::CountWithoutLast { count: 9 })
        );
        assert_eq!(
            with(&|r| r.flags = (flags::LAST | flags::FAILURE).to_le_bytes()),
            Err(DecodeError::FailureWithLast)
        );
        assert_eq!(
            with(&|r| r.flags = (flags::HAS_CHECKSUM | flags::FAILURE).to_le_bytes()),
            Err(DecodeError::FailureWithChecksum)
        );
        assert_eq!(
            with(&|r| r.failure_code = 3u16.to_le_bytes()),
            Err(DecodeError::CodeWithoutFailure { code: 3 })
        );
        assert_eq!(
            with(&|r| r.checksum = 1u64.to_le_bytes()),
            Err(DecodeError::ChecksumWithoutFlag)
        );
        assert_eq!(
            with(&|r| r.posted_us = 1u32.to_le_bytes()),
            Err(DecodeError::ReservedNonZero { value: 1 })
        );
        assert_eq!(
            decode(&base[..39]),
            Err(DecodeError::BadLength {
                len: 39,
                expected: 40
            })
        );
        assert_eq!(
            decode(&[0xC7, b'K']),
            Err(DecodeError::BadMagic { found: 0x4BC7 })
        );
        assert_eq!(decode(&[]), Err(DecodeError::Empty));
    }

    #[test]
    fn sglang_text_forms() {
        let c = chunk(decode(b"123_kv_4_0").unwrap());
        assert_eq!(
            c,
            ChunkNotification::new(RequestId(123), 0, 4, ChunkStatus::More)
        );
        let c = chunk(decode(b"123_kv_4_1_3").unwrap());
        assert_eq!(
            c,
            ChunkNotification::new(RequestId(123), 3, 4, ChunkStatus::Last { count: 5 })
        );
        let c = chunk(decode(b"18446744073709551615_kv_0_True").unwrap());
        assert_eq!(c.request, RequestId(u64::MAX));
        assert_eq!(c.status, ChunkStatus::Last { count: 1 });
        assert_eq!(
            chunk(decode(b"9_kv_2_False_1").unwrap()).status,
            ChunkStatus::More
        );
        assert_eq!(
            decode(b"77_aux").unwrap(),
            Notification::Aux {
                request: RequestId(77)
            }
        );
        assert_eq!(
            decode(b"77_state_2").unwrap(),
            Notification::State {
                request: RequestId(77),
                pp_rank: 2
            }
        );
        let bad: &[(&[u8], DecodeError)] = &[
            (
                b"18446744073709551616_aux",
                DecodeError::TextBadField {
                    field: TextField::Room,
                },
            ),
            (
                b"1_kv_4294967296_0",
                DecodeError::TextBadField {
                    field: TextField::ChunkId,
                },
            ),
            (
                b"1_kv_4294967295_1",
                DecodeError::TextCountOverflow { chunk_id: u32::MAX },
            ),
            (
                b"1_kv_1_2",
                DecodeError::TextBadField {
                    field: TextField::IsLast,
                },
            ),
            (
                b"1_kv_1_1_65536",
                DecodeError::TextBadField {
                    field: TextField::PpRank,
                },
            ),
            (b"1_kv_1", DecodeError::TextFieldCount { found: 3 }),
            (b"1_kv_1_1_1_1", DecodeError::TextFieldCount { found: 6 }),
            (b"1_a_b_c_d_e_f", DecodeError::TextFieldCount { found: 7 }),
            (b"1_xx", DecodeError::TextUnknownKind),
            (
                b"1_kv_+1_0",
                DecodeError::TextBadField {
                    field: TextField::ChunkId,
                },
            ),
            (
                b"1 _aux",
                DecodeError::TextBadField {
                    field: TextField::Room,
                },
            ),
        ];
        for (input, want) in bad {
            assert_eq!(
                decode(input),
                Err(*want),
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn text_encoders() {
        let more = ChunkNotification::new(RequestId(5), 2, 3, ChunkStatus::More);
        assert_eq!(
            more.encode_text(TextForm::WithPpRank).unwrap(),
            "5_kv_3_0_2"
        );
        assert_eq!(
            more.encode_text(TextForm::Legacy),
            Err(TextEncodeError::LegacyNeedsRankZero { pp_rank: 2 })
        );
        let last = ChunkNotification::new(RequestId(5), 0, 3, ChunkStatus::Last { count: 4 });
        assert_eq!(last.encode_text(TextForm::Legacy).unwrap(), "5_kv_3_1");
        let wrong = ChunkNotification::new(RequestId(5), 0, 3, ChunkStatus::Last { count: 9 });
        assert!(wrong.encode_text(TextForm::Legacy).is_err());
        for s in [
            last.encode_text(TextForm::Legacy).unwrap(),
            more.encode_text(TextForm::WithPpRank).unwrap(),
        ] {
            decode(s.as_bytes()).unwrap();
        }
        assert_eq!(encode_aux_text(RequestId(9)), "9_aux");
        assert_eq!(encode_state_text(RequestId(9), 1), "9_state_1");
    }
}
