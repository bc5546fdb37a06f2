//! Mutual authentication of a control connection, before anything else crosses it.
//!
//! Each side sends a [`Challenge`]: a fresh 32-byte random nonce and its role. Each then sends a
//! [`Proof`]: BLAKE3 in keyed mode, under a key derived from the shared secret, over a transcript of
//! both challenges, both roles and which side of the TCP connection the prover is on. A side that
//! cannot check the peer's proof refuses it with [`RejectReason::AuthFailed`](super::RejectReason).
//! Only after both proofs checked does either side send its `Hello` (worker address, rkeys, agent
//! metadata).
//!
//! Why each part of the transcript is there:
//! - both nonces: a proof is fresh for this connection, so a recorded proof replays nowhere;
//! - the prover's side (dialer or listener): a proof cannot be reflected back at its author on a
//!   second connection, since the author never proves for the other side of its own connection;
//! - both roles: a peer cannot claim one role in the challenge and another in its Hello (the
//!   handshake checks the Hello against the challenge).
//!
//! What this does not do: encrypt. After the handshake the connection is plain TCP; see the README's
//! security model.

use serde::{Deserialize, Serialize};

use super::msg::Role;

/// Domain of the key derivation, so the secret's use here never collides with another use of it.
const KEY_CONTEXT: &str = "kvx control plane 2026-12 mutual authentication key v1";
/// Domain of the transcript, hashed first.
const TRANSCRIPT_LABEL: &[u8] = b"kvx/auth/v1";

/// The shared secret of a deployment. It never leaves the process: only proofs computed from it
/// do. Its `Debug` never shows it.
#[derive(Clone)]
pub struct Secret {
    key: [u8; 32],
    empty: bool,
}

impl Secret {
    /// The secret from its bytes (any length; a key is derived from them).
    pub fn new(bytes: &[u8]) -> Self {
        Secret {
            key: blake3::derive_key(KEY_CONTEXT, bytes),
            empty: bytes.is_empty(),
        }
    }

    /// The secret of a deployment that configured none. Peers still run the exchange, so a side
    /// with a secret and a side without one refuse each other; but anyone can prove it.
    pub fn none() -> Self {
        Self::new(&[])
    }

    /// From an optional configured secret.
    pub fn from_config(bytes: Option<&[u8]>) -> Self {
        Self::new(bytes.unwrap_or_default())
    }

    /// Whether this is the empty secret that everyone holds.
    pub fn is_none(&self) -> bool {
        self.empty
    }

    /// The proof that the side `prover` of a connection holds this secret.
    pub fn prove(&self, prover: Side, dialer: &Challenge, listener: &Challenge) -> Proof {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(TRANSCRIPT_LABEL);
        h.update(&[prover as u8]);
        for c in [dialer, listener] {
            h.update(&[role_byte(c.role)]);
            h.update(&c.nonce);
        }
        Proof {
            mac: *h.finalize().as_bytes(),
        }
    }

    /// Whether `proof` is the side `prover`'s proof over these challenges, compared in constant
    /// time.
    pub fn verify(
        &self,
        prover: Side,
        dialer: &Challenge,
        listener: &Challenge,
        proof: &Proof,
    ) -> bool {
        let want = blake3::Hash::from_bytes(self.prove(prover, dialer, listener).mac);
        // blake3::Hash's equality is constant-time.
        want == blake3::Hash::from_bytes(proof.mac)
    }
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

fn role_byte(r: Role) -> u8 {
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

/// The second message on a connection, from both sides: the keyed MAC over both challenges.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proof {
    /// BLAKE3 keyed hash of the transcript.
    pub mac: [u8; 32],
}
