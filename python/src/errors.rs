//! Engine errors as the Python exceptions of `kvx.errors`, each with its typed cause.
//!
//! The exception classes are Python classes (so that, for example, `kvx.ConfigError` is also a
//! `ValueError` and `kvx.Timeout` a `TimeoutError`); an error is kept as plain Rust data until it is
//! raised, since it may be made on a thread that does not hold the interpreter.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use transfer_engine::core::FailureCode;
use transfer_engine::core::tracker::FailureReason;
use transfer_engine::core::vote::{Decision, FailCause};
use transfer_engine::engine::EngineError;

/// An attribute value on a raised exception.
#[derive(Debug, Clone)]
pub(crate) enum Attr {
    Int(u64),
    Str(String),
}

/// An error to raise: its `kvx.errors` class, message, and attributes (always `cause`).
#[derive(Debug, Clone)]
pub(crate) struct ErrInfo {
    class: &'static str,
    message: String,
    attrs: Vec<(&'static str, Attr)>,
}

impl ErrInfo {
    pub(crate) fn new(class: &'static str, cause: &str, message: impl Into<String>) -> Self {
        ErrInfo {
            class,
            message: message.into(),
            attrs: vec![("cause", Attr::Str(cause.into()))],
        }
    }

    pub(crate) fn with(mut self, name: &'static str, value: Attr) -> Self {
        self.attrs.push((name, value));
        self
    }

    pub(crate) fn attr_str(&self, name: &str) -> Option<String> {
        self.attrs.iter().find_map(|(n, v)| match v {
            Attr::Str(s) if *n == name => Some(s.clone()),
            _ => None,
        })
    }

    pub(crate) fn attr_int(&self, name: &str) -> Option<u64> {
        self.attrs.iter().find_map(|(n, v)| match v {
            Attr::Int(i) if *n == name => Some(*i),
            _ => None,
        })
    }

    /// The exception, built under the interpreter.
    pub(crate) fn to_pyerr(&self, py: Python<'_>) -> PyErr {
        let build = || -> PyResult<PyErr> {
            let class = py.import("kvx.errors")?.getattr(self.class)?;
            let exc = class.call1((self.message.clone(),))?;
            for (name, value) in &self.attrs {
                match value {
                    Attr::Int(i) => exc.setattr(*name, *i)?,
                    Attr::Str(s) => exc.setattr(*name, s.as_str())?,
                }
            }
            Ok(PyErr::from_value(exc))
        };
        build().unwrap_or_else(|e| {
            PyRuntimeError::new_err(format!(
                "{} (and kvx.errors.{} could not be raised: {e})",
                self.message, self.class
            ))
        })
    }

    pub(crate) fn into_pyerr(self) -> PyErr {
        Python::attach(|py| self.to_pyerr(py))
    }
}

/// A bad argument or configuration.
pub(crate) fn config(message: impl Into<String>) -> PyErr {
    ErrInfo::new("ConfigError", "config", message).into_pyerr()
}

/// A wait that ran out of time.
pub(crate) fn timeout(message: impl Into<String>) -> PyErr {
    ErrInfo::new("Timeout", "timeout", message).into_pyerr()
}

/// The stable name of a failure code.
pub(crate) fn code_name(code: FailureCode) -> String {
    match code {
        FailureCode::Unspecified => "unspecified".into(),
        FailureCode::WriteFailed => "write_failed".into(),
        FailureCode::Aborted => "aborted".into(),
        FailureCode::Timeout => "timeout".into(),
        FailureCode::PeerLost => "peer_lost".into(),
        FailureCode::OutOfResources => "out_of_resources".into(),
        FailureCode::Internal => "internal".into(),
        FailureCode::Other(n) => format!("other_{n}"),
        other => format!("other_{}", other.raw()),
    }
}

/// A failure code from its name (as [`code_name`] writes it).
pub(crate) fn code_from_name(name: &str) -> PyResult<FailureCode> {
    Ok(match name {
        "unspecified" => FailureCode::Unspecified,
        "write_failed" => FailureCode::WriteFailed,
        "aborted" => FailureCode::Aborted,
        "timeout" => FailureCode::Timeout,
        "peer_lost" => FailureCode::PeerLost,
        "out_of_resources" => FailureCode::OutOfResources,
        "internal" => FailureCode::Internal,
        other => {
            return Err(config(format!(
                "failure code must be one of unspecified, write_failed, aborted, timeout, peer_lost, out_of_resources, internal; not {other:?}"
            )));
        }
    })
}

impl From<EngineError> for ErrInfo {
    fn from(e: EngineError) -> Self {
        let message = e.to_string();
        match e {
            EngineError::Transport(_) => ErrInfo::new("TransportError", "transport", message),
            EngineError::Control(c) if c.is_auth_failure() => {
                ErrInfo::new("AuthError", "auth", message)
            }
            // A Hello refused for good (a layout, a configuration, a version that differ): trying
            // again cannot help, unlike a connection that failed.
            EngineError::Control(c) if c.is_permanent_refusal() => {
                ErrInfo::new("ControlError", "refused", message)
            }
            EngineError::Control(_) => ErrInfo::new("ControlError", "control", message),
            EngineError::Plan { .. } => ErrInfo::new("ConfigError", "plan", message),
            EngineError::Config(_) => ErrInfo::new("ConfigError", "config", message),
            EngineError::UnknownRequest(r) => {
                ErrInfo::new("UnknownRequest", "unknown_request", message)
                    .with("request", Attr::Int(r.0))
            }
            EngineError::RequestFailed { request, code } => {
                ErrInfo::new("RequestFailed", "request_failed", message)
                    .with("request", Attr::Int(request.0))
                    .with("code", Attr::Str(code_name(code)))
            }
            EngineError::Write { request, chunk, .. } => {
                ErrInfo::new("TransportError", "write", message)
                    .with("request", Attr::Int(request.0))
                    .with("chunk", Attr::Int(u64::from(chunk)))
            }
            EngineError::Vote(_) => ErrInfo::new("ProtocolError", "vote", message),
            EngineError::Tracker(_) => ErrInfo::new("ConfigError", "tracker", message),
            EngineError::Timeout(_) => ErrInfo::new("Timeout", "timeout", message),
            EngineError::Shutdown => ErrInfo::new("ShutdownError", "shutdown", message),
            EngineError::PageHeld { page, by } => ErrInfo::new("PageHeld", "page_held", message)
                .with("page", Attr::Int(u64::from(page)))
                .with("by", Attr::Int(by.0)),
            EngineError::SenderTaken { .. } => ErrInfo::new("ConfigError", "sender_taken", message),
            EngineError::Memory(_) => ErrInfo::new("ConfigError", "memory", message),
            _ => ErrInfo::new("KvxError", "other", message),
        }
    }
}

/// Raises an engine error.
pub(crate) fn engine(e: EngineError) -> PyErr {
    ErrInfo::from(e).into_pyerr()
}

/// Why a request failed on the decode side: `reason` (`aborted`, `timeout`, `peer_failed`,
/// `peer_lost`, `protocol_violation`, `rank_unavailable`), with the rank and code where there are.
pub(crate) fn failure(request: u64, reason: &FailureReason) -> ErrInfo {
    let (name, rank, code) = match reason {
        FailureReason::Aborted => ("aborted", None, None),
        FailureReason::Timeout => ("timeout", None, None),
        FailureReason::PeerFailed { rank, code } => ("peer_failed", Some(*rank), Some(*code)),
        FailureReason::PeerLost { rank, .. } => ("peer_lost", Some(*rank), None),
        FailureReason::ProtocolViolation { rank, .. } => ("protocol_violation", Some(*rank), None),
        FailureReason::RankUnavailable { rank } => ("rank_unavailable", Some(*rank), None),
        _ => ("other", None, None),
    };
    let mut e = ErrInfo::new(
        "TransferFailed",
        name,
        format!("request {request} failed: {reason:?}"),
    )
    .with("request", Attr::Int(request))
    .with("reason", Attr::Str(name.into()));
    if let Some(r) = rank {
        e = e.with("rank", Attr::Int(u64::from(r)));
    }
    if let Some(c) = code {
        e = e.with("code", Attr::Str(code_name(c)));
    }
    e
}

/// Why the PP ranks decided a request failed, on the prefill side.
pub(crate) fn decision_failure(request: u64, d: &Decision) -> Option<ErrInfo> {
    let Decision::Failed { rank, cause } = d else {
        return None;
    };
    let (name, code) = match cause {
        FailCause::Voted(c) => ("peer_failed", Some(*c)),
        FailCause::PeerLost => ("peer_lost", None),
        FailCause::Timeout => ("timeout", None),
        FailCause::ClosedWithoutVote => ("closed_without_vote", None),
        _ => ("other", None),
    };
    let mut e = ErrInfo::new(
        "TransferFailed",
        name,
        format!("request {request} failed on PP rank {rank}: {cause:?}"),
    )
    .with("request", Attr::Int(request))
    .with("reason", Attr::Str(name.into()))
    .with("rank", Attr::Int(u64::from(*rank)));
    if let Some(c) = code {
        e = e.with("code", Attr::Str(code_name(c)));
    }
    Some(e)
}
