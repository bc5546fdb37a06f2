//! Mutual authentication of a control connection, before anything else crosses it.
//!
//! Each side sends a [`Challenge`]: a fresh 32-byte random nonce, its role and its side of the TCP
//! connection. Then the two sides run a Noise `NNpsk0` handshake ([`super::channel`]): the dialer
//! sends the first message, the listener answers only if it authenticated, each carried in a
//! [`Proof`]. The pre-shared key is derived from the deployment's secret and the handshake's
//! prologue holds both challenges. A side whose handshake message does not authenticate is refused
//! with [`RejectReason::AuthFailed`](super::RejectReason). Only after both messages checked does
//! either side send its `Hello` (worker address, rkeys, agent metadata), and from then on every byte
//! is sealed under the keys the handshake agreed.
//!
//! Why each part is there:
//! - both nonces (in the prologue) and the ephemeral keys: the keys are fresh for this connection,
//!   so nothing recorded on another connection replays here;
//! - the sides and roles (in the prologue): a peer cannot claim one role in the challenge and
//!   another in its Hello (the handshake checks the Hello against the challenge), and a message
//!   cannot be reflected back at its author on a second connection;
//! - the ephemeral Diffie-Hellman: a relay that forwards both messages between two honest engines
//!   learns no key; it can carry their sealed records or drop them, never read or change them.

use serde::{Deserialize, Serialize};

use super::msg::Role;

/// Domain of the key derivation, so the secret's use here never collides with another use of it.
const KEY_CONTEXT: &str = "kvx control plane 2026-12 mutual authentication key v1";
/// Salt of the secret's stretching (one per protocol, not per deployment: the secret is the only
/// input the deployment chooses).
const STRETCH_SALT: &[u8] = b"kvx control plane secret, argon2id, v1";
/// Domain of the channel's pre-shared key, derived from the secret's key.
const CHANNEL_KEY_LABEL: &[u8] = b"kvx/channel/psk/v1";
/// Domain of the sealed boxes' keys ([`super::channel::seal_box`]), before the protocol's label.
const BOX_KEY_LABEL: &[u8] = b"kvx/box/v1/";
/// Domain of the key that authenticates discovery records (`crate::discovery`).
const RECORD_KEY_LABEL: &[u8] = b"kvx/etcd-record/v1";
/// Domain of the MAC keys handed to the integrations ([`Secret::mac_key`]), before their label.
const MAC_KEY_LABEL: &[u8] = b"kvx/mac/v1/";

/// The shared secret of a deployment. It never leaves the process: only proofs computed from it
/// do. Its `Debug` never shows it.
#[derive(Clone)]
pub struct Secret {
    key: [u8; 32],
    empty: bool,
}

impl Secret {
    /// The secret from its bytes (any length; a key is derived from them, with Argon2id at its
    /// default cost, 19 MiB and two passes, so that each guess at a weak secret tried against a
    /// recorded handshake costs that much; the same bytes are stretched once per process). The
    /// empty secret, which everyone holds, is not stretched.
    pub fn new(bytes: &[u8]) -> Self {
        let fast = blake3::derive_key(KEY_CONTEXT, bytes);
        Secret {
            key: if bytes.is_empty() {
                fast
            } else {
                stretched(&fast)
            },
            empty: bytes.is_empty(),
        }
    }

    /// The secret of a deployment that configured none. Peers still run the exchange, so a side
    /// with a secret and a side without one refuse each other; but anyone can prove it.
    pub fn none() -> Self {
        Self::new(&[])
    }

    /// Whether this is the empty secret that everyone holds.
    pub fn is_none(&self) -> bool {
        self.empty
    }

    /// The channel's pre-shared key (Noise's `psk`), derived from the secret's key.
    pub(crate) fn channel_key(&self) -> [u8; 32] {
        *blake3::keyed_hash(&self.key, CHANNEL_KEY_LABEL).as_bytes()
    }

    /// A key for a MAC of the protocol named `label` (an integration's own messages, such as
    /// `kvx.sglang`'s directory requests), derived from the secret's key: a guess at the secret
    /// checked against such a MAC costs the secret's stretching.
    pub fn mac_key(&self, label: &[u8]) -> [u8; 32] {
        let mut input = MAC_KEY_LABEL.to_vec();
        input.extend_from_slice(label);
        *blake3::keyed_hash(&self.key, &input).as_bytes()
    }

    /// The key that authenticates the engines' discovery records, derived from the secret's key.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn record_key(&self) -> [u8; 32] {
        *blake3::keyed_hash(&self.key, RECORD_KEY_LABEL).as_bytes()
    }

    /// The key of the sealed boxes of the protocol named `label`, derived from the secret's key.
    pub(crate) fn box_key(&self, label: &[u8]) -> [u8; 32] {
        let mut input = BOX_KEY_LABEL.to_vec();
        input.extend_from_slice(label);
        *blake3::keyed_hash(&self.key, &input).as_bytes()
    }
}

/// `fast` (the secret's bytes, hashed) stretched with Argon2id; each distinct input once per
/// process.
fn stretched(fast: &[u8; 32]) -> [u8; 32] {
    static DONE: std::sync::Mutex<Vec<([u8; 32], [u8; 32])>> = std::sync::Mutex::new(Vec::new());
    let done = || {
        DONE.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    if let Some((_, key)) = done().iter().find(|(f, _)| f == fast) {
        return *key;
    }
    // Stretched without the lock: another thread's look-up of a stretched secret does not wait.
    let mut key = [0u8; 32];
    let argon = argon2::Argon2::new(
        argon2::Algorithm::Argon2id,
        argon2::Version::V0x13,
        argon2::Params::default(),
    );
    // A 32-byte input and output and this salt are within Argon2's bounds: it cannot fail. Were it
    // to, the unstretched key is still the secret's.
    let key = match argon.hash_password_into(fast, STRETCH_SALT, &mut key) {
        Ok(()) => key,
        Err(e) => {
            tracing::error!(error = %e, "stretching the secret failed: its key is not stretched");
            *fast
        }
    };
    // A process holds a handful of secrets (a wrong one in a test, say): bounded all the same.
    let mut done = done();
    if !done.iter().any(|(f, _)| f == fast) {
        if done.len() >= 64 {
            done.remove(0);
        }
        done.push((*fast, key));
    }
    key
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.empty {
            "Secret(<none>)"
        } else {
            "Secret(<redacted>)"
        })
    }
}

pub(crate) fn role_byte(r: Role) -> u8 {
    match r {
        Role::Prefill => 1,
        Role::Decode => 2,
    }
}

/// Which end of a TCP connection a side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum Side {
    /// It connected.
    Dialer = 1,
    /// It accepted.
    Listener = 2,
}

impl Side {
    /// The other end.
    pub fn peer(self) -> Side {
        match self {
            Side::Dialer => Side::Listener,
            Side::Listener => Side::Dialer,
        }
    }
}

/// The first message on a connection, from both sides: nothing secret or addressable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Challenge {
    /// Fresh random bytes, new for every connection.
    pub nonce: [u8; 32],
    /// The role the sender will claim in its Hello.
    pub role: Role,
    /// Which end of the connection the sender is.
    pub side: Side,
}

impl Challenge {
    /// A fresh challenge from the operating system's randomness (through `rand`'s CSPRNG).
    pub fn fresh(role: Role, side: Side) -> Self {
        Challenge {
            nonce: rand::random(),
            role,
            side,
        }
    }
}

/// A Noise handshake message of the channel ([`super::channel::Handshake`]): the dialer's first,
/// then the listener's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proof {
    /// The Noise message (an ephemeral public key and a tag).
    pub msg: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key is BLAKE3's derivation stretched with Argon2id at its default cost (a change would
    /// also part engines of different builds), and the same bytes give the same key again.
    #[test]
    fn the_secrets_key_is_stretched_with_argon2id() {
        let fast = blake3::derive_key(KEY_CONTEXT, b"a weak secret");
        let mut want = [0u8; 32];
        argon2::Argon2::new(
            argon2::Algorithm::Argon2id,
            argon2::Version::V0x13,
            argon2::Params::new(19 * 1024, 2, 1, Some(32)).unwrap_or_default(),
        )
        .hash_password_into(&fast, STRETCH_SALT, &mut want)
        .unwrap_or_default();
        assert_ne!(want, [0u8; 32]);
        assert_eq!(Secret::new(b"a weak secret").key, want);
        assert_eq!(Secret::new(b"a weak secret").key, want);
        assert_ne!(Secret::new(b"another weak secret").key, want);
    }
}
