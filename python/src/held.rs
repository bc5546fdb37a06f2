//! An engine as the Python classes hold it until they stop. The pool's memory is not held here: each
//! pool holds what keeps its memory alive (see `memory`), for as long as any handle to the engine
//! (a pending chunk's, too) or a peer's writes may still use it.

use crate::errors;
use pyo3::PyResult;
use std::sync::{Mutex, MutexGuard, PoisonError};
use transfer_engine::engine::EngineError;

/// `Some` until the engine stops; then `engine()` raises `ShutdownError`.
pub(crate) struct Held<E: Clone> {
    live: Mutex<Option<E>>,
}

impl<E: Clone> Held<E> {
    pub(crate) fn new(engine: E) -> Self {
        Held {
            live: Mutex::new(Some(engine)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<E>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A handle to the engine, or `ShutdownError` once it stopped.
    pub(crate) fn engine(&self) -> PyResult<E> {
        self.lock()
            .clone()
            .ok_or_else(|| errors::engine(EngineError::Shutdown))
    }

    /// The engine, taken to stop it (`None` if it already stopped).
    pub(crate) fn take(&self) -> Option<E> {
        self.lock().take()
    }

    /// Whether the engine still runs.
    pub(crate) fn is_live(&self) -> bool {
        self.lock().is_some()
    }
}
