//! The encrypted channel of a control connection: everything after the handshake's two Noise
//! messages travels in records sealed with the keys that handshake agreed.
//!
//! The handshake is Noise `NNpsk0` (X25519, ChaCha20-Poly1305, BLAKE2s) from the `snow` crate. The
//! pre-shared key is derived from the deployment's secret, and the prologue holds both sides'
//! challenges (nonces, roles, sides), so the keys belong to this connection and these two claims:
//! a side that does not hold the secret cannot complete the handshake, and one that relays the
//! two messages between honest engines learns no key, so it can neither read nor change a byte
//! of what follows (each record's tag fails).
//!
//! A record is a 2-byte big-endian length and that many bytes of ciphertext (at most 65,535, a
//! Noise message, of which 16 are the tag). Each direction counts its records from 0 and uses the
//! count as the nonce, so a record dropped, repeated, reordered or altered fails to open. The frames
//! of [`super::frame`] are cut into records as they are sent and joined again as they are read.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::auth::{Challenge, Secret, Side};

/// The Noise protocol of every control connection.
const PARAMS: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";
/// Domain of the prologue: a decode engine's control connections.
const PROLOGUE_LABEL: &[u8] = b"kvx/channel/v1";
/// Domain of the prologue of a prefill pipeline's vote mesh: a rank's dial meant for its mesh never
/// completes with a decode's listener, nor one meant for decode with a rank's mesh listener.
pub const MESH_LABEL: &[u8] = b"kvx/mesh/v1";
/// Bytes of a record's tag.
const TAG: usize = 16;
/// Largest ciphertext of one record (a Noise message).
const MAX_RECORD: usize = 65_535;
/// Largest plaintext of one record.
const MAX_PLAIN: usize = MAX_RECORD - TAG;
/// Largest Noise handshake message we produce or accept (an ephemeral key, a tag, no payload).
pub(crate) const MAX_HANDSHAKE_MESSAGE: usize = 128;

/// Records that failed to open, in this process: a changed, dropped or forged byte on some
/// connection after its handshake.
static REFUSED_RECORDS: AtomicU64 = AtomicU64::new(0);

/// How many records failed to open in this process (each closes its connection).
pub fn refused_records() -> u64 {
    REFUSED_RECORDS.load(Ordering::Relaxed)
}

/// What went wrong on the encrypted channel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelError {
    /// A record did not open: its bytes were changed, or it is not the next record of this
    /// connection.
    #[error("a record failed authentication (record {record})")]
    Tampered {
        /// The record's number in its direction.
        record: u64,
    },
    /// A record shorter than its tag.
    #[error("a record of {len} bytes is shorter than its tag")]
    Short {
        /// Its declared length.
        len: usize,
    },
    /// The Noise library refused an operation (a key, a message out of turn).
    #[error("noise: {0}")]
    Noise(String),
    /// A direction ran out of nonces (2^64 records).
    #[error("the connection sent or read every record it may")]
    Exhausted,
    /// A sealed message ended inside a record (see [`Session::open`]).
    #[error("a sealed message ends {missing} bytes short of its last record")]
    Cut {
        /// Bytes the last record still needed.
        missing: usize,
    },
}

impl From<snow::Error> for ChannelError {
    fn from(e: snow::Error) -> Self {
        ChannelError::Noise(e.to_string())
    }
}

/// The handshake of one connection, before its keys exist. Public for tools and tests that speak
/// the protocol by hand; engines run it through [`super::handshake`].
pub struct Handshake {
    state: snow::HandshakeState,
}

impl std::fmt::Debug for Handshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Handshake")
    }
}

impl Handshake {
    /// The dialer is Noise's initiator, the listener its responder. The prologue binds both
    /// challenges, so both sides must have seen the same two.
    ///
    /// # Errors
    /// The Noise library refused the parameters (not expected).
    pub fn new(
        secret: &Secret,
        side: Side,
        dialer: &Challenge,
        listener: &Challenge,
    ) -> Result<Self, ChannelError> {
        Self::labelled(PROLOGUE_LABEL, secret, side, dialer, listener)
    }

    /// As [`new`](Self::new), for a protocol other than the control connection's: `label` goes
    /// into the prologue in place of the control connection's, so a handshake of one protocol
    /// never completes with a peer speaking another, even with the same secret.
    ///
    /// # Errors
    /// The Noise library refused the parameters (not expected).
    pub fn labelled(
        label: &[u8],
        secret: &Secret,
        side: Side,
        dialer: &Challenge,
        listener: &Challenge,
    ) -> Result<Self, ChannelError> {
        let params: snow::params::NoiseParams = PARAMS.parse()?;
        let mut prologue = label.to_vec();
        for c in [dialer, listener] {
            prologue.push(super::auth::role_byte(c.role));
            prologue.push(c.side as u8);
            prologue.extend_from_slice(&c.nonce);
        }
        let psk = secret.channel_key();
        let builder = snow::Builder::new(params)
            .prologue(&prologue)?
            .psk(0, &psk)?;
        let state = match side {
            Side::Dialer => builder.build_initiator()?,
            Side::Listener => builder.build_responder()?,
        };
        Ok(Handshake { state })
    }

    /// Our next handshake message.
    ///
    /// # Errors
    /// It is not our turn.
    pub fn write(&mut self) -> Result<Vec<u8>, ChannelError> {
        let mut out = vec![0u8; MAX_HANDSHAKE_MESSAGE];
        let n = self.state.write_message(&[], &mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// Reads the peer's handshake message: `false` when it does not authenticate (the peer does
    /// not hold the secret, or saw other challenges).
    pub fn read(&mut self, msg: &[u8]) -> bool {
        if msg.len() > MAX_HANDSHAKE_MESSAGE {
            return false;
        }
        let mut payload = [0u8; MAX_HANDSHAKE_MESSAGE];
        self.state.read_message(msg, &mut payload) == Ok(0)
    }

    /// Both directions, for a caller that moves whole messages itself, once both handshake
    /// messages went.
    ///
    /// # Errors
    /// The handshake is not over.
    pub fn into_session(self) -> Result<Session, ChannelError> {
        let (sealer, opener) = self.finish()?;
        Ok(Session { sealer, opener })
    }

    /// The two directions' ciphers, once both messages went.
    pub(crate) fn finish(self) -> Result<(Sealer, Opener), ChannelError> {
        let keys = Arc::new(self.state.into_stateless_transport_mode()?);
        Ok((
            Sealer {
                keys: keys.clone(),
                next: 0,
            },
            Opener {
                keys,
                next: 0,
                raw: Vec::new(),
            },
        ))
    }
}

/// Both directions of a channel that carries whole messages (a side channel that frames them
/// itself): each message is sealed into records as the control connection's frames are, and a
/// sealed message opens only whole, in order, once.
#[derive(Debug)]
pub struct Session {
    sealer: Sealer,
    opener: Opener,
}

impl Session {
    /// `plain`, sealed as the next message of this direction.
    ///
    /// # Errors
    /// The direction ran out of nonces.
    pub fn seal(&mut self, plain: &[u8]) -> Result<Vec<u8>, ChannelError> {
        // The message's length leads it, inside the first record: a message of several records
        // that a relay cuts after a whole record does not open as a shorter one.
        let mut framed = Vec::with_capacity(plain.len() + 8);
        framed.extend_from_slice(&(plain.len() as u64).to_be_bytes());
        framed.extend_from_slice(plain);
        let mut out = Vec::with_capacity(framed.len() + 2 + TAG);
        self.sealer.seal(&framed, &mut out)?;
        Ok(out)
    }

    /// The plaintext of the peer's next sealed message. Once a message fails to open, every later
    /// one fails too.
    ///
    /// # Errors
    /// The bytes were changed, are not the next message, or end inside a record.
    pub fn open(&mut self, sealed: &[u8]) -> Result<Vec<u8>, ChannelError> {
        self.opener.raw.extend_from_slice(sealed);
        let mut plain = Vec::with_capacity(sealed.len());
        let result = self.opener.open(&mut plain).and_then(|()| {
            if !self.opener.raw.is_empty() {
                REFUSED_RECORDS.fetch_add(1, Ordering::Relaxed);
                return Err(ChannelError::Cut {
                    missing: self.opener.read_hint(),
                });
            }
            // Whole records, but all of the message? Its sealed length says.
            let said = plain
                .first_chunk::<8>()
                .map(|b| u64::from_be_bytes(*b))
                .and_then(|n| usize::try_from(n).ok());
            match said {
                Some(n) if n == plain.len() - 8 => Ok(()),
                _ => {
                    REFUSED_RECORDS.fetch_add(1, Ordering::Relaxed);
                    Err(ChannelError::Cut {
                        missing: said
                            .map_or(8, |n| n.saturating_sub(plain.len().saturating_sub(8))),
                    })
                }
            }
        });
        if result.is_err() {
            // The message is lost, so no later one is the next: none opens again.
            self.opener.raw.clear();
            self.opener.next = u64::MAX;
        }
        result.map(|()| plain.split_off(8))
    }
}

/// Bytes of a sealed box's nonce (XChaCha20-Poly1305).
const BOX_NONCE: usize = 24;

/// `plain` sealed on its own, for a protocol with no connection to run a handshake on (one HTTP
/// request or reply): XChaCha20-Poly1305 under a key derived from the secret and `label`, with a
/// fresh random nonce in front of the ciphertext. `aad` is bound to it unencrypted (what the box
/// answers, say), so it opens only with the same `aad`. There is no forward secrecy (the key is
/// the secret's) and no replay protection beyond what the caller binds in `aad`.
///
/// # Errors
/// The cipher refused (not expected).
pub fn seal_box(
    secret: &Secret,
    label: &[u8],
    aad: &[u8],
    plain: &[u8],
) -> Result<Vec<u8>, ChannelError> {
    use chacha20poly1305::aead::{Aead, KeyInit, Payload};
    let cipher = chacha20poly1305::XChaCha20Poly1305::new(&secret.box_key(label).into());
    let nonce: [u8; BOX_NONCE] = rand::random();
    let sealed = cipher
        .encrypt(&nonce.into(), Payload { msg: plain, aad })
        .map_err(|_| ChannelError::Noise("sealing a box failed".into()))?;
    let mut out = Vec::with_capacity(BOX_NONCE + sealed.len());
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&sealed);
    Ok(out)
}

/// The plaintext of a box [`seal_box`] made with the same secret, `label` and `aad`.
///
/// # Errors
/// [`ChannelError::Tampered`] when it does not open (another secret, label or `aad`, or a changed
/// byte), counted in [`refused_records`]; [`ChannelError::Short`] when it is shorter than a nonce
/// and a tag.
pub fn open_box(
    secret: &Secret,
    label: &[u8],
    aad: &[u8],
    sealed: &[u8],
) -> Result<Vec<u8>, ChannelError> {
    use chacha20poly1305::aead::{Aead, KeyInit, Payload};
    if sealed.len() < BOX_NONCE + TAG {
        return Err(ChannelError::Short { len: sealed.len() });
    }
    let (nonce, body) = sealed.split_at(BOX_NONCE);
    let nonce: [u8; BOX_NONCE] = nonce
        .try_into()
        .map_err(|_| ChannelError::Short { len: sealed.len() })?;
    let cipher = chacha20poly1305::XChaCha20Poly1305::new(&secret.box_key(label).into());
    cipher
        .decrypt(&nonce.into(), Payload { msg: body, aad })
        .map_err(|_| {
            REFUSED_RECORDS.fetch_add(1, Ordering::Relaxed);
            ChannelError::Tampered { record: 0 }
        })
}

/// Seals what a side sends.
pub(crate) struct Sealer {
    keys: Arc<snow::StatelessTransportState>,
    next: u64,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer").field("next", &self.next).finish()
    }
}

impl Sealer {
    /// Appends `plain`, cut into records, to `out`.
    pub(crate) fn seal(&mut self, plain: &[u8], out: &mut Vec<u8>) -> Result<(), ChannelError> {
        for piece in plain.chunks(MAX_PLAIN) {
            let nonce = self.next;
            self.next = self.next.checked_add(1).ok_or(ChannelError::Exhausted)?;
            let len = piece.len() + TAG;
            let at = out.len();
            out.extend_from_slice(&(len as u16).to_be_bytes());
            out.resize(at + 2 + len, 0);
            let n = self.keys.write_message(nonce, piece, &mut out[at + 2..])?;
            debug_assert_eq!(n, len);
        }
        Ok(())
    }
}

/// Opens what a side reads.
pub(crate) struct Opener {
    keys: Arc<snow::StatelessTransportState>,
    next: u64,
    /// Bytes read and not yet opened: the start of a record.
    raw: Vec<u8>,
}

impl std::fmt::Debug for Opener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opener")
            .field("next", &self.next)
            .field("buffered", &self.raw.len())
            .finish()
    }
}

impl Opener {
    /// Where the socket's bytes go before they are opened.
    pub(crate) fn raw_mut(&mut self) -> &mut Vec<u8> {
        &mut self.raw
    }

    /// How many bytes the record being read still needs (at least 1), for the next read's
    /// reservation.
    pub(crate) fn read_hint(&self) -> usize {
        match self.raw.get(..2) {
            Some(h) => (2 + usize::from(u16::from_be_bytes([h[0], h[1]])))
                .saturating_sub(self.raw.len())
                .max(1),
            None => 2 - self.raw.len(),
        }
    }

    /// Opens every whole record buffered, appending the plaintext to `plain`. A record that does
    /// not open is counted in [`refused_records`]; nothing after it is ever opened.
    pub(crate) fn open(&mut self, plain: &mut Vec<u8>) -> Result<(), ChannelError> {
        let mut at = 0;
        let result = loop {
            let Some(h) = self.raw.get(at..at + 2) else {
                break Ok(());
            };
            let len = usize::from(u16::from_be_bytes([h[0], h[1]]));
            if len < TAG {
                break Err(ChannelError::Short { len });
            }
            let Some(record) = self.raw.get(at + 2..at + 2 + len) else {
                break Ok(());
            };
            let start = plain.len();
            plain.resize(start + len - TAG, 0);
            match self
                .keys
                .read_message(self.next, record, &mut plain[start..])
            {
                Ok(n) => plain.truncate(start + n),
                Err(_) => {
                    plain.truncate(start);
                    break Err(ChannelError::Tampered { record: self.next });
                }
            }
            self.next = match self.next.checked_add(1) {
                Some(n) => n,
                None => break Err(ChannelError::Exhausted),
            };
            at += 2 + len;
        };
        self.raw.drain(..at);
        if result.is_err() {
            REFUSED_RECORDS.fetch_add(1, Ordering::Relaxed);
            // Nothing more of this stream is read as records.
            self.raw.clear();
        }
        result
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::control::Role;

    fn pair(a: &Secret, b: &Secret) -> Option<((Sealer, Opener), (Sealer, Opener))> {
        let d = Challenge::fresh(Role::Prefill, Side::Dialer);
        let l = Challenge::fresh(Role::Decode, Side::Listener);
        let mut i = Handshake::new(a, Side::Dialer, &d, &l).unwrap();
        let mut r = Handshake::new(b, Side::Listener, &d, &l).unwrap();
        let m1 = i.write().unwrap();
        if !r.read(&m1) {
            return None;
        }
        let m2 = r.write().unwrap();
        if !i.read(&m2) {
            return None;
        }
        Some((i.finish().unwrap(), r.finish().unwrap()))
    }

    #[test]
    fn records_round_trip_across_record_boundaries() {
        let s = Secret::new(b"s");
        let ((mut seal, _), (_, mut open)) = pair(&s, &s).unwrap();
        let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let mut wire = Vec::new();
        seal.seal(&big, &mut wire).unwrap();
        seal.seal(b"tail", &mut wire).unwrap();
        assert!(!wire.windows(64).any(|w| big.windows(64).next() == Some(w)));
        let mut plain = Vec::new();
        // Fed a byte at a time: records open once whole.
        for b in &wire {
            open.raw_mut().push(*b);
            open.open(&mut plain).unwrap();
        }
        assert_eq!(&plain[..big.len()], &big[..]);
        assert_eq!(&plain[big.len()..], b"tail");
    }

    #[test]
    fn a_changed_byte_or_a_replayed_record_fails_to_open() {
        let s = Secret::new(b"s");
        let ((mut seal, _), (_, mut open)) = pair(&s, &s).unwrap();
        let mut one = Vec::new();
        seal.seal(b"hello", &mut one).unwrap();
        let before = refused_records();
        let mut flipped = one.clone();
        flipped[5] ^= 1;
        open.raw_mut().extend_from_slice(&flipped);
        let mut plain = Vec::new();
        assert!(matches!(
            open.open(&mut plain),
            Err(ChannelError::Tampered { record: 0 })
        ));
        assert!(plain.is_empty());
        assert!(refused_records() > before);

        let ((mut seal, _), (_, mut open)) = pair(&s, &s).unwrap();
        let mut one = Vec::new();
        seal.seal(b"once", &mut one).unwrap();
        open.raw_mut().extend_from_slice(&one);
        open.raw_mut().extend_from_slice(&one);
        let mut plain = Vec::new();
        assert!(matches!(
            open.open(&mut plain),
            Err(ChannelError::Tampered { record: 1 })
        ));
        assert_eq!(plain, b"once");
    }

    fn sessions(label_a: &[u8], label_b: &[u8]) -> Option<(Session, Session)> {
        let s = Secret::new(b"s");
        let d = Challenge::fresh(Role::Decode, Side::Dialer);
        let l = Challenge::fresh(Role::Prefill, Side::Listener);
        let mut i = Handshake::labelled(label_a, &s, Side::Dialer, &d, &l).unwrap();
        let mut r = Handshake::labelled(label_b, &s, Side::Listener, &d, &l).unwrap();
        if !r.read(&i.write().unwrap()) {
            return None;
        }
        if !i.read(&r.write().unwrap()) {
            return None;
        }
        Some((i.into_session().unwrap(), r.into_session().unwrap()))
    }

    #[test]
    fn a_session_opens_each_whole_message_once_and_in_order() {
        let (mut a, mut b) = sessions(b"side", b"side").unwrap();
        let big: Vec<u8> = (0..150_000u32).map(|i| (i % 253) as u8).collect();
        let one = a.seal(b"first").unwrap();
        let two = a.seal(&big).unwrap();
        assert_eq!(b.open(&one).unwrap(), b"first");
        assert_eq!(b.open(&two).unwrap(), big);
        // The other direction has its own keys and count.
        assert_eq!(a.open(&b.seal(b"back").unwrap()).unwrap(), b"back");
        // A replay, a message cut short and anything after it fail.
        assert!(matches!(b.open(&one), Err(ChannelError::Tampered { .. })));
        let (mut a, mut b) = sessions(b"side", b"side").unwrap();
        let one = a.seal(b"whole").unwrap();
        let two = a.seal(b"next").unwrap();
        assert!(matches!(
            b.open(&one[..one.len() - 1]),
            Err(ChannelError::Cut { missing: 1 })
        ));
        assert!(b.open(&two).is_err());
    }

    #[test]
    fn a_message_of_several_records_cut_after_a_whole_record_does_not_open() {
        let (mut a, mut b) = sessions(b"side", b"side").unwrap();
        let big: Vec<u8> = (0..150_000u32).map(|i| (i % 251) as u8).collect();
        let sealed = a.seal(&big).unwrap();
        // The first record whole (its 2-byte length, then a full record), the rest dropped.
        let first = 2 + MAX_RECORD;
        assert!(sealed.len() > first);
        assert!(matches!(
            b.open(&sealed[..first]),
            Err(ChannelError::Cut { .. })
        ));
        assert!(b.open(&a.seal(b"next").unwrap()).is_err());
    }

    #[test]
    fn a_box_opens_only_with_its_secret_label_and_aad() {
        let s = Secret::new(b"s");
        let sealed = seal_box(&s, b"dir", b"GET /x", b"10.0.0.1:5000").unwrap();
        assert!(!sealed.windows(8).any(|w| w == b"10.0.0.1"));
        assert_eq!(
            open_box(&s, b"dir", b"GET /x", &sealed).unwrap(),
            b"10.0.0.1:5000"
        );
        // Two boxes of the same text differ (fresh nonces).
        assert_ne!(
            sealed,
            seal_box(&s, b"dir", b"GET /x", b"10.0.0.1:5000").unwrap()
        );
        for (secret, label, aad) in [
            (Secret::new(b"t"), &b"dir"[..], &b"GET /x"[..]),
            (s.clone(), b"other", b"GET /x"),
            (s.clone(), b"dir", b"GET /y"),
        ] {
            assert!(matches!(
                open_box(&secret, label, aad, &sealed),
                Err(ChannelError::Tampered { .. })
            ));
        }
        let mut flipped = sealed.clone();
        flipped[30] ^= 1;
        assert!(open_box(&s, b"dir", b"GET /x", &flipped).is_err());
        assert!(matches!(
            open_box(&s, b"dir", b"GET /x", &sealed[..39]),
            Err(ChannelError::Short { len: 39 })
        ));
    }

    #[test]
    fn a_handshake_of_another_protocol_never_completes() {
        assert!(sessions(b"side", b"side").is_some());
        assert!(sessions(b"side", PROLOGUE_LABEL).is_none());
    }

    #[test]
    fn another_secret_or_other_challenges_never_complete_the_handshake() {
        assert!(pair(&Secret::new(b"a"), &Secret::new(b"b")).is_none());
        let s = Secret::new(b"s");
        let d = Challenge::fresh(Role::Prefill, Side::Dialer);
        let l = Challenge::fresh(Role::Decode, Side::Listener);
        let other = Challenge::fresh(Role::Decode, Side::Listener);
        let mut i = Handshake::new(&s, Side::Dialer, &d, &l).unwrap();
        let mut r = Handshake::new(&s, Side::Listener, &d, &other).unwrap();
        assert!(!r.read(&i.write().unwrap()));
    }
}
