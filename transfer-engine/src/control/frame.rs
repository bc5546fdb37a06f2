//! Length-prefixed frames: a fixed 12-byte header, then a postcard-encoded payload.
//!
//! ```text
//! offset  size  field
//!      0     4  magic      b"KVCP"
//!      4     4  length     payload bytes, u32 little-endian, at most the receiver's cap
//!      8     2  version    protocol version, u16 little-endian
//!     10     1  kind       message kind (see MsgKind)
//!     11     1  reserved   must be 0
//!     12     n  payload    postcard encoding of the message body (empty for Close, Ready,
//!                          Heartbeat, NotReady and Probe)
//! ```
//!
//! The header layout and the `Reject` kind number are frozen across protocol versions, so a peer
//! that speaks another version can still read why it was turned away.

use super::auth::{Challenge, Proof};
use super::msg::{
    Abort, AbortAck, AuxData, Hello, HelloAck, Landed, Msg, Reject, TransferReject,
    TransferRequest, Vote,
};

/// First four bytes of every frame; catches a peer that is not speaking this protocol at all.
pub const MAGIC: [u8; 4] = *b"KVCP";

/// Size of the fixed frame header in bytes.
pub const HEADER_LEN: usize = 12;

/// The protocol version this build speaks (header field and [`Hello::protocol_version`]).
pub const PROTOCOL_VERSION: u16 = 16;

/// Default cap on one frame's payload: 16 MiB, far above any Hello with a few thousand rkeys.
pub const DEFAULT_MAX_FRAME_LEN: u32 = 16 << 20;

/// The kind byte of a frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum MsgKind {
    /// [`Msg::Hello`].
    Hello = 1,
    /// [`Msg::HelloAck`].
    HelloAck = 2,
    /// [`Msg::Reject`]; the number is frozen across versions.
    Reject = 3,
    /// [`Msg::TransferRequest`].
    TransferRequest = 4,
    /// [`Msg::TransferReject`].
    TransferReject = 5,
    /// [`Msg::Abort`].
    Abort = 6,
    /// [`Msg::Vote`].
    Vote = 7,
    /// [`Msg::Close`].
    Close = 8,
    /// [`Msg::AbortAck`].
    AbortAck = 9,
    /// [`Msg::Challenge`].
    Challenge = 10,
    /// [`Msg::Proof`].
    Proof = 11,
    /// [`Msg::Aux`] (protocol version 3).
    Aux = 12,
    /// [`Msg::Ready`] (protocol version 4).
    Ready = 13,
    /// [`Msg::Heartbeat`] (protocol version 7).
    Heartbeat = 14,
    /// [`Msg::NotReady`] (protocol version 7).
    NotReady = 15,
    /// [`Msg::Probe`] (protocol version 11).
    Probe = 16,
    /// [`Msg::Landed`] (protocol version 15).
    Landed = 17,
}

impl MsgKind {
    /// Maps a header byte to a kind, `None` for a number this version does not know.
    pub fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Hello,
            2 => Self::HelloAck,
            3 => Self::Reject,
            4 => Self::TransferRequest,
            5 => Self::TransferReject,
            6 => Self::Abort,
            7 => Self::Vote,
            8 => Self::Close,
            9 => Self::AbortAck,
            10 => Self::Challenge,
            11 => Self::Proof,
            12 => Self::Aux,
            13 => Self::Ready,
            14 => Self::Heartbeat,
            15 => Self::NotReady,
            16 => Self::Probe,
            17 => Self::Landed,
            _ => return None,
        })
    }

    /// The header byte of this kind.
    pub fn as_u8(self) -> u8 {
        self as u8
    }
}

impl std::fmt::Display for MsgKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// Why bytes could not be turned into (or made from) a frame.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The first bytes are not [`MAGIC`]: the peer speaks another protocol, or the stream is
    /// out of step.
    #[error("bad frame magic {got:02x?}, expected {MAGIC:02x?}")]
    BadMagic {
        /// The bytes seen where the magic should be (fewer than four if that is all that came).
        got: Vec<u8>,
    },
    /// The header names a protocol version this build does not speak.
    #[error("unsupported protocol version {got}, this side speaks {supported}")]
    UnsupportedVersion {
        /// Version in the header.
        got: u16,
        /// Version this build speaks.
        supported: u16,
    },
    /// The header's kind byte is not a message this version knows.
    #[error("unknown message kind {kind} (protocol version {version})")]
    UnknownKind {
        /// The kind byte.
        kind: u8,
        /// The header's version.
        version: u16,
    },
    /// The reserved header byte is not zero.
    #[error("reserved header byte is {got:#04x}, must be 0")]
    ReservedByte {
        /// Its value.
        got: u8,
    },
    /// The declared payload length exceeds the cap; the body was neither read nor allocated.
    #[error("{kind} frame declares {len} payload bytes, above the cap of {max}")]
    TooLarge {
        /// Kind of the frame (or of the message being encoded).
        kind: MsgKind,
        /// Declared (or encoded) payload length.
        len: u64,
        /// The cap in force.
        max: u32,
    },
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame: {got} of {needed} bytes")]
    Truncated {
        /// Bytes the frame needs (header, or header and payload once the header is known).
        needed: usize,
        /// Bytes that arrived.
        got: usize,
    },
    /// The payload does not decode as the message its header names.
    #[error("malformed {kind} payload of {len} bytes")]
    Payload {
        /// Kind from the header.
        kind: MsgKind,
        /// Payload length.
        len: u32,
        /// The codec's complaint.
        #[source]
        source: postcard::Error,
    },
    /// The payload decoded but left bytes over (the peer's encoder disagrees with ours).
    #[error("{kind} payload has {extra} trailing bytes")]
    TrailingBytes {
        /// Kind from the header.
        kind: MsgKind,
        /// Bytes left after the message.
        extra: usize,
    },
    /// A message could not be encoded (only for values the codec cannot represent).
    #[error("cannot encode {kind} message")]
    Encode {
        /// Kind being encoded.
        kind: MsgKind,
        /// The codec's complaint.
        #[source]
        source: postcard::Error,
    },
}

impl FrameError {
    /// Whether the stream is out of step after this error, so no later frame can be trusted.
    ///
    /// Payload errors leave the stream aligned (the whole frame was consumed); header errors do
    /// not, because the frame's extent is unknown or was refused.
    pub fn is_fatal(&self) -> bool {
        !matches!(
            self,
            Self::Payload { .. } | Self::TrailingBytes { .. } | Self::Encode { .. }
        )
    }
}

/// A decoded, validated frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Payload length in bytes.
    pub len: u32,
    /// Protocol version.
    pub version: u16,
    /// Message kind.
    pub kind: MsgKind,
}

impl FrameHeader {
    /// The 12 header bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4..8].copy_from_slice(&self.len.to_le_bytes());
        h[8..10].copy_from_slice(&self.version.to_le_bytes());
        h[10] = self.kind.as_u8();
        h
    }

    /// Validates a header, in the order magic, version, kind, reserved byte, length cap.
    ///
    /// # Errors
    /// [`FrameError::BadMagic`], [`FrameError::UnsupportedVersion`], [`FrameError::UnknownKind`],
    /// [`FrameError::ReservedByte`] or [`FrameError::TooLarge`].
    pub fn decode(h: &[u8; HEADER_LEN], max_len: u32) -> Result<Self, FrameError> {
        if h[0..4] != MAGIC {
            return Err(FrameError::BadMagic {
                got: h[0..4].to_vec(),
            });
        }
        let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        let version = u16::from_le_bytes([h[8], h[9]]);
        // Version before kind: a newer peer's new kinds are reported as a version problem.
        if version != PROTOCOL_VERSION {
            return Err(FrameError::UnsupportedVersion {
                got: version,
                supported: PROTOCOL_VERSION,
            });
        }
        let kind = MsgKind::from_u8(h[10]).ok_or(FrameError::UnknownKind {
            kind: h[10],
            version,
        })?;
        if h[11] != 0 {
            return Err(FrameError::ReservedByte { got: h[11] });
        }
        if len > max_len {
            return Err(FrameError::TooLarge {
                kind,
                len: u64::from(len),
                max: max_len,
            });
        }
        Ok(Self { len, version, kind })
    }
}

/// Appends one frame carrying `msg` to `out`.
///
/// On error `out` is left as it was.
///
/// # Errors
/// [`FrameError::TooLarge`] if the payload would exceed `max_len` (the receiver would refuse it),
/// [`FrameError::Encode`] if the codec fails.
pub fn encode_frame(msg: &Msg, max_len: u32, out: &mut Vec<u8>) -> Result<(), FrameError> {
    let kind = msg.kind();
    let start = out.len();
    out.extend_from_slice(&[0u8; HEADER_LEN]);
    let body = match msg {
        Msg::Hello(m) => postcard::to_extend(m, Sink(out)),
        Msg::HelloAck(m) => postcard::to_extend(m, Sink(out)),
        Msg::Reject(m) => postcard::to_extend(m, Sink(out)),
        Msg::TransferRequest(m) => postcard::to_extend(m, Sink(out)),
        Msg::TransferReject(m) => postcard::to_extend(m, Sink(out)),
        Msg::Abort(m) => postcard::to_extend(m, Sink(out)),
        Msg::Vote(m) => postcard::to_extend(m, Sink(out)),
        Msg::AbortAck(m) => postcard::to_extend(m, Sink(out)),
        Msg::Challenge(m) => postcard::to_extend(m, Sink(out)),
        Msg::Proof(m) => postcard::to_extend(m, Sink(out)),
        Msg::Aux(m) => postcard::to_extend(m, Sink(out)),
        Msg::Landed(m) => postcard::to_extend(m, Sink(out)),
        Msg::Close | Msg::Ready | Msg::Heartbeat | Msg::NotReady | Msg::Probe => Ok(Sink(out)),
    };
    if let Err(source) = body {
        out.truncate(start);
        return Err(FrameError::Encode { kind, source });
    }
    let len = out.len() - start - HEADER_LEN;
    let fits = u32::try_from(len).ok().filter(|&l| l <= max_len);
    let Some(len32) = fits else {
        out.truncate(start);
        return Err(FrameError::TooLarge {
            kind,
            len: len as u64,
            max: max_len,
        });
    };
    let header = FrameHeader {
        len: len32,
        version: PROTOCOL_VERSION,
        kind,
    };
    out[start..start + HEADER_LEN].copy_from_slice(&header.encode());
    Ok(())
}

/// Lets postcard append to a borrowed buffer, so a failed encode can be rolled back.
struct Sink<'a>(&'a mut Vec<u8>);

impl Extend<u8> for Sink<'_> {
    fn extend<I: IntoIterator<Item = u8>>(&mut self, iter: I) {
        self.0.extend(iter);
    }
}

/// Encodes `msg` as one frame in a fresh buffer.
///
/// # Errors
/// As [`encode_frame`].
pub fn encode_to_vec(msg: &Msg, max_len: u32) -> Result<Vec<u8>, FrameError> {
    let mut out = Vec::new();
    encode_frame(msg, max_len, &mut out)?;
    Ok(out)
}

/// Decodes a payload whose header was already validated.
///
/// # Errors
/// [`FrameError::Payload`] or [`FrameError::TrailingBytes`].
pub fn decode_payload(kind: MsgKind, payload: &[u8]) -> Result<Msg, FrameError> {
    fn body<'a, T: serde::Deserialize<'a>>(kind: MsgKind, p: &'a [u8]) -> Result<T, FrameError> {
        let len = u32::try_from(p.len()).unwrap_or(u32::MAX);
        let (v, rest) = postcard::take_from_bytes(p).map_err(|source| FrameError::Payload {
            kind,
            len,
            source,
        })?;
        if !rest.is_empty() {
            return Err(FrameError::TrailingBytes {
                kind,
                extra: rest.len(),
            });
        }
        Ok(v)
    }
    Ok(match kind {
        MsgKind::Hello => Msg::Hello(body::<Hello>(kind, payload)?),
        MsgKind::HelloAck => Msg::HelloAck(body::<HelloAck>(kind, payload)?),
        MsgKind::Reject => Msg::Reject(body::<Reject>(kind, payload)?),
        MsgKind::TransferRequest => Msg::TransferRequest(body::<TransferRequest>(kind, payload)?),
        MsgKind::TransferReject => Msg::TransferReject(body::<TransferReject>(kind, payload)?),
        MsgKind::Abort => Msg::Abort(body::<Abort>(kind, payload)?),
        MsgKind::Vote => Msg::Vote(body::<Vote>(kind, payload)?),
        MsgKind::AbortAck => Msg::AbortAck(body::<AbortAck>(kind, payload)?),
        MsgKind::Challenge => Msg::Challenge(body::<Challenge>(kind, payload)?),
        MsgKind::Proof => Msg::Proof(body::<Proof>(kind, payload)?),
        MsgKind::Aux => Msg::Aux(body::<AuxData>(kind, payload)?),
        MsgKind::Landed => Msg::Landed(body::<Landed>(kind, payload)?),
        MsgKind::Close
        | MsgKind::Ready
        | MsgKind::Heartbeat
        | MsgKind::NotReady
        | MsgKind::Probe => {
            if !payload.is_empty() {
                return Err(FrameError::TrailingBytes {
                    kind,
                    extra: payload.len(),
                });
            }
            match kind {
                MsgKind::Close => Msg::Close,
                MsgKind::Ready => Msg::Ready,
                MsgKind::NotReady => Msg::NotReady,
                MsgKind::Probe => Msg::Probe,
                _ => Msg::Heartbeat,
            }
        }
    })
}

/// Where the bytes at the front of a buffer stand.
enum Parse {
    /// Not a whole frame yet; `needed` bytes in all would settle the next step.
    Incomplete { needed: usize },
    /// A whole frame: its header, and its total length (header plus payload).
    Frame { header: FrameHeader, total: usize },
}

fn parse(buf: &[u8], max_len: u32) -> Result<Parse, FrameError> {
    // Check the magic on whatever prefix has arrived, so garbage is refused at its first byte
    // instead of after twelve.
    let seen = buf.len().min(MAGIC.len());
    if buf[..seen] != MAGIC[..seen] {
        return Err(FrameError::BadMagic {
            got: buf[..seen].to_vec(),
        });
    }
    let Some(h) = buf.first_chunk::<HEADER_LEN>() else {
        return Ok(Parse::Incomplete { needed: HEADER_LEN });
    };
    let header = FrameHeader::decode(h, max_len)?;
    // Cannot overflow: len <= u32::MAX and usize is at least 32 bits on supported targets, but
    // saturate anyway so a 32-bit build refuses rather than wraps.
    let total = HEADER_LEN.saturating_add(header.len as usize);
    if buf.len() < total {
        return Ok(Parse::Incomplete { needed: total });
    }
    Ok(Parse::Frame { header, total })
}

/// A buffer that turns a byte stream, arriving in any pieces, into messages.
///
/// Partial frames stay in the buffer, so feeding bytes one at a time or all at once gives the
/// same messages. A header error poisons the decoder (the stream is out of step) and is returned
/// again on every later call; a payload error consumes its frame and the next frame decodes
/// normally.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    max_len: u32,
    poisoned: bool,
}

/// Above this the buffer is shrunk once empty, so one large frame does not pin its memory for
/// the connection's life.
const SHRINK_ABOVE: usize = 1 << 20;
/// Most bytes reserved ahead of one read, so a declared length (peer-controlled) is never
/// allocated up front.
pub(crate) const READ_CHUNK: usize = 64 << 10;

impl FrameDecoder {
    /// A decoder that refuses payloads above `max_len` bytes.
    pub fn new(max_len: u32) -> Self {
        Self {
            buf: Vec::new(),
            max_len,
            poisoned: false,
        }
    }

    /// The payload cap in force.
    pub fn max_len(&self) -> u32 {
        self.max_len
    }

    /// Changes the payload cap; frames whose header is already buffered are judged by the new
    /// cap when next decoded.
    pub fn set_max_len(&mut self, max_len: u32) {
        self.max_len = max_len;
    }

    /// Appends bytes from the stream.
    ///
    /// Ignored once the decoder is poisoned: nothing after a header error can be decoded, so
    /// keeping it would only grow the buffer.
    pub fn extend(&mut self, bytes: &[u8]) {
        if !self.poisoned {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// Bytes received but not yet decoded.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Whether an earlier header error put the stream out of step.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// The next whole message, or `None` if more bytes are needed.
    ///
    /// # Errors
    /// Any [`FrameError`]; see the type's docs for which ones poison the decoder.
    pub fn decode_next(&mut self) -> Result<Option<Msg>, FrameError> {
        if self.buf.is_empty() {
            self.maybe_shrink();
            return Ok(None);
        }
        let parsed = match parse(&self.buf, self.max_len) {
            Ok(p) => p,
            Err(e) => {
                self.poisoned = true;
                return Err(e);
            }
        };
        match parsed {
            Parse::Incomplete { .. } => Ok(None),
            Parse::Frame { header, total } => {
                let msg = decode_payload(header.kind, &self.buf[HEADER_LEN..total]);
                self.buf.drain(..total);
                self.maybe_shrink();
                msg.map(Some)
            }
        }
    }

    /// The error for a stream that ended now: `None` at a frame boundary, else
    /// [`FrameError::Truncated`] (or the header error, if the prefix is already bad).
    pub fn finish(&self) -> Option<FrameError> {
        if self.buf.is_empty() {
            return None;
        }
        match parse(&self.buf, self.max_len) {
            Err(e) => Some(e),
            Ok(Parse::Incomplete { needed }) => Some(FrameError::Truncated {
                needed,
                got: self.buf.len(),
            }),
            // A whole frame still buffered is not truncation; decode_next will return it.
            Ok(Parse::Frame { .. }) => None,
        }
    }

    /// How many more bytes are worth reserving before the next read: what the current frame
    /// still needs, bounded by [`READ_CHUNK`].
    pub(crate) fn read_hint(&self) -> usize {
        let needed = match parse(&self.buf, self.max_len) {
            Ok(Parse::Incomplete { needed }) => needed.saturating_sub(self.buf.len()),
            _ => 0,
        };
        needed.clamp(HEADER_LEN, READ_CHUNK)
    }

    /// The buffer, for a reader that appends to it directly.
    pub(crate) fn buf_mut(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    fn maybe_shrink(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > SHRINK_ABOVE {
            self.buf = Vec::new();
        }
    }
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_FRAME_LEN)
    }
}
