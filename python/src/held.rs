//! An engine and what keeps its pool's memory alive, as the Python classes hold them until they stop.

use crate::errors;
use crate::memory::Keep;
use pyo3::PyResult;
use std::sync::{Mutex, MutexGuard, PoisonError};
use transfer_engine::engine::EngineError;

/// `Some` until the engine stops; then `engine()` raises `ShutdownError`.
pub(crate) struct Held<E: Clone> {
    live: Mutex<Option<(E, Keep)>>,
}

impl<E: Clone> Held<E> {
    pub(crate) fn new(engine: E, keep: Keep) -> Self {
        Held {
            live: Mutex::new(Some((engine, keep))),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<(E, Keep)>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A handle to the engine, or `ShutdownError` once it stopped.
    pub(crate) fn engine(&self) -> PyResult<E> {
        self.lock()
            .as_ref()
            .map(|(e, _)| e.clone())
            .ok_or_else(|| errors::engine(EngineError::Shutdown))
    }

    /// The engine and its memory, taken to stop it (`None` if it already stopped).
    pub(crate) fn take(&self) -> Option<(E, Keep)> {
        self.lock().take()
    }

    /// Whether the engine still runs.
    pub(crate) fn is_live(&self) -> bool {
        self.lock().is_some()
    }
}
