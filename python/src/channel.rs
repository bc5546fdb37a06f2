//! `ChannelHandshake` and `Channel`: the engines' encrypted channel (Noise `NNpsk0` keyed from the
//! deployment's secret) for Python side channels that move their own messages, such as the
//! connector's side channel in `kvx.vllm`. No I/O here: Python sends and reads the bytes; these
//! classes only make and check them.

use crate::errors::{self, ErrInfo};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::{Mutex, MutexGuard, PoisonError};
use transfer_engine::control::channel::{Handshake, Session};
use transfer_engine::control::{Challenge, Role, Secret, Side};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn role(name: &str) -> PyResult<Role> {
    match name {
        "prefill" => Ok(Role::Prefill),
        "decode" => Ok(Role::Decode),
        other => Err(errors::config(format!(
            "role {other:?}: expected \"prefill\" or \"decode\""
        ))),
    }
}

fn nonce(what: &str, bytes: &[u8]) -> PyResult<[u8; 32]> {
    bytes
        .try_into()
        .map_err(|_| errors::config(format!("{what} has {} bytes, not 32", bytes.len())))
}

/// One side's half of the handshake: the dialer writes the first message and reads the second,
/// the listener reads the first and writes the second; then `finish` gives the channel. Both
/// sides must have exchanged the same two 32-byte nonces (fresh for every connection, sent in
/// clear before the handshake) and use the same `label` (one per protocol).
#[pyclass(module = "kvx._kvx", frozen)]
pub(crate) struct ChannelHandshake {
    state: Mutex<Option<Handshake>>,
}

#[pymethods]
impl ChannelHandshake {
    #[new]
    #[pyo3(signature = (secret, side, label, dialer_nonce, listener_nonce, dialer_role = "decode", listener_role = "prefill"))]
    fn new(
        secret: Option<&[u8]>,
        side: &str,
        label: &str,
        dialer_nonce: &[u8],
        listener_nonce: &[u8],
        dialer_role: &str,
        listener_role: &str,
    ) -> PyResult<Self> {
        let side = match side {
            "dialer" => Side::Dialer,
            "listener" => Side::Listener,
            other => {
                return Err(errors::config(format!(
                    "side {other:?}: expected \"dialer\" or \"listener\""
                )));
            }
        };
        if label.is_empty() {
            return Err(errors::config("the channel's label is empty"));
        }
        let secret = secret.map_or_else(Secret::none, Secret::new);
        let dialer = Challenge {
            nonce: nonce("dialer_nonce", dialer_nonce)?,
            role: role(dialer_role)?,
            side: Side::Dialer,
        };
        let listener = Challenge {
            nonce: nonce("listener_nonce", listener_nonce)?,
            role: role(listener_role)?,
            side: Side::Listener,
        };
        let mut prologue = b"kvx/py/".to_vec();
        prologue.extend_from_slice(label.as_bytes());
        let hs = Handshake::labelled(&prologue, &secret, side, &dialer, &listener)
            .map_err(|e| errors::config(format!("channel handshake: {e}")))?;
        Ok(ChannelHandshake {
            state: Mutex::new(Some(hs)),
        })
    }

    /// This side's next handshake message.
    fn write<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let mut st = lock(&self.state);
        let hs = st
            .as_mut()
            .ok_or_else(|| protocol("the handshake is over"))?;
        let msg = hs
            .write()
            .map_err(|e| protocol(format!("channel handshake: {e}")))?;
        Ok(PyBytes::new(py, &msg))
    }

    /// Reads the peer's handshake message: `False` when it does not prove the secret (or the peer
    /// saw other nonces, or speaks another protocol); the handshake is then over for good.
    fn read(&self, msg: &[u8]) -> PyResult<bool> {
        let mut st = lock(&self.state);
        let hs = st
            .as_mut()
            .ok_or_else(|| protocol("the handshake is over"))?;
        let ok = hs.read(msg);
        if !ok {
            *st = None;
        }
        Ok(ok)
    }

    /// The channel, once both messages went.
    fn finish(&self) -> PyResult<Channel> {
        let hs = lock(&self.state)
            .take()
            .ok_or_else(|| protocol("the handshake is over"))?;
        let session = hs
            .into_session()
            .map_err(|e| protocol(format!("channel handshake: {e}")))?;
        Ok(Channel {
            session: Mutex::new(session),
        })
    }
}

/// Both directions of an encrypted channel: `seal` a message to send, `open` one received. A
/// message opens only whole, once and in order; once one fails to open, none does again.
#[pyclass(module = "kvx._kvx", frozen)]
pub(crate) struct Channel {
    session: Mutex<Session>,
}

#[pymethods]
impl Channel {
    /// `plain`, sealed as this side's next message.
    fn seal<'py>(&self, py: Python<'py>, plain: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let sealed = lock(&self.session)
            .seal(plain)
            .map_err(|e| protocol(e.to_string()))?;
        Ok(PyBytes::new(py, &sealed))
    }

    /// The plaintext of the peer's next message; `kvx.ProtocolError` when the bytes were changed,
    /// replayed, reordered or cut.
    fn open<'py>(&self, py: Python<'py>, sealed: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let plain = lock(&self.session)
            .open(sealed)
            .map_err(|e| protocol(e.to_string()))?;
        Ok(PyBytes::new(py, &plain))
    }
}

fn protocol(message: impl Into<String>) -> PyErr {
    ErrInfo::new("ProtocolError", "channel", message).into_pyerr()
}

/// `plain` sealed on its own under a key derived from the secret (`None`: the deployment has
/// none) and `label`, bound to `aad`: for a message with no connection to run a handshake on (an
/// HTTP body). Opens with `open_box` and the same three.
#[pyfunction]
pub(crate) fn seal_box<'py>(
    py: Python<'py>,
    secret: Option<&[u8]>,
    label: &str,
    aad: &[u8],
    plain: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    let secret = secret.map_or_else(Secret::none, Secret::new);
    let sealed = transfer_engine::control::channel::seal_box(&secret, label.as_bytes(), aad, plain)
        .map_err(|e| protocol(e.to_string()))?;
    Ok(PyBytes::new(py, &sealed))
}

/// The key of a MAC of the protocol named `label`, derived from the secret (`None`: the
/// deployment has none), stretched as the engines' keys are: for an integration's own MACs
/// (`kvx.sglang`'s directory requests), so a guess at the secret costs what it costs elsewhere.
#[pyfunction]
pub(crate) fn mac_key<'py>(
    py: Python<'py>,
    secret: Option<&[u8]>,
    label: &str,
) -> Bound<'py, PyBytes> {
    // The first stretch of a secret takes tens of milliseconds: other Python threads run.
    let key = py.detach(|| {
        secret
            .map_or_else(Secret::none, Secret::new)
            .mac_key(label.as_bytes())
    });
    PyBytes::new(py, &key)
}

/// The plaintext of a `seal_box` box; `kvx.ProtocolError` when it does not open (another secret,
/// label or `aad`, or a changed byte).
#[pyfunction]
pub(crate) fn open_box<'py>(
    py: Python<'py>,
    secret: Option<&[u8]>,
    label: &str,
    aad: &[u8],
    sealed: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    let secret = secret.map_or_else(Secret::none, Secret::new);
    let plain = transfer_engine::control::channel::open_box(&secret, label.as_bytes(), aad, sealed)
        .map_err(|e| protocol(e.to_string()))?;
    Ok(PyBytes::new(py, &plain))
}

/// The handshake places of a Python listener (a side channel), under the engines' rule
/// (`transfer_engine::engine::Admission`): at most `cap` at once, and once every place is taken a
/// new connection takes the place of the oldest of the source address holding the most, so
/// clients that connect and say nothing from one address cannot keep peers from another out.
#[pyclass(module = "kvx._kvx", frozen)]
pub(crate) struct HandshakePlaces {
    rule: Mutex<transfer_engine::engine::Admission>,
}

#[pymethods]
impl HandshakePlaces {
    #[new]
    fn new(cap: usize) -> Self {
        Self {
            rule: Mutex::new(transfer_engine::engine::Admission::new(cap)),
        }
    }

    /// A place for a connection from `ip` (an IPv4 or IPv6 address): `(place, taken)`, `taken`
    /// the place it took (the caller closes that connection) or `None`. `kvx.ConfigError` for an
    /// address that does not parse.
    fn admit(&self, ip: &str) -> PyResult<(u64, Option<u64>)> {
        let ip: std::net::IpAddr = ip
            .parse()
            .map_err(|e| errors::config(format!("address {ip:?}: {e}")))?;
        Ok(lock(&self.rule).admit(ip))
    }

    /// Gives `place` back (nothing for one already taken by a newer connection).
    fn release(&self, place: u64) {
        lock(&self.rule).release(place);
    }
}
