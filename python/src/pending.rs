//! `Pending`: the end of something the engine does in the background (a request's outcome, a chunk's
//! writes, the PP ranks' decision), to wait for with the interpreter detached, to poll, or to await.

use crate::errors::{self, ErrInfo};
use pyo3::prelude::*;
use std::future::Future;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;
use transfer_engine::core::vote::Decision;
use transfer_engine::engine::Outcome as EngineOutcome;

/// How something ended.
#[derive(Debug, Clone)]
pub(crate) enum Done {
    /// A decode request's outcome.
    Outcome {
        request: u64,
        outcome: EngineOutcome,
    },
    /// The PP ranks' decision on a request.
    Decision { request: u64, decision: Decision },
    /// It finished with nothing to report (a chunk's writes are over).
    Unit,
    /// It failed.
    Error(ErrInfo),
}

#[derive(Default)]
struct State {
    done: Option<Done>,
    callbacks: Vec<Py<PyAny>>,
}

#[derive(Default)]
struct Slot {
    state: Mutex<State>,
    cv: Condvar,
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn finish(&self, done: Done) {
        let callbacks = {
            let mut st = self.lock();
            st.done = Some(done);
            std::mem::take(&mut st.callbacks)
        };
        self.cv.notify_all();
        if !callbacks.is_empty() {
            // Not on an engine thread: the interpreter lock may be held for a while by another thread.
            std::thread::spawn(move || {
                Python::attach(|py| {
                    for cb in callbacks {
                        if let Err(e) = cb.call0(py) {
                            e.write_unraisable(py, Some(cb.bind(py)));
                        }
                    }
                });
            });
        }
    }
}

/// The end of a background operation of the engine.
#[pyclass(module = "kvx._kvx", frozen)]
pub(crate) struct Pending {
    slot: Arc<Slot>,
    what: String,
}

impl Pending {
    /// Runs `fut` on the engine runtime; its result ends this.
    pub(crate) fn spawn(
        rt: &tokio::runtime::Runtime,
        what: String,
        fut: impl Future<Output = Done> + Send + 'static,
    ) -> Pending {
        let slot = Arc::new(Slot::default());
        let s = slot.clone();
        rt.spawn(async move { s.finish(fut.await) });
        Pending { slot, what }
    }

    /// Already ended with `done`.
    pub(crate) fn ready(what: String, done: Done) -> Pending {
        let slot = Arc::new(Slot::default());
        slot.finish(done);
        Pending { slot, what }
    }
}

fn value(py: Python<'_>, done: &Done) -> PyResult<Py<PyAny>> {
    match done {
        Done::Outcome { request, outcome } => {
            let o = match outcome {
                EngineOutcome::Complete => Outcome::complete(*request),
                EngineOutcome::Failed(reason) => {
                    Outcome::failed(*request, errors::failure(*request, reason))
                }
            };
            Ok(Py::new(py, o)?.into_any())
        }
        Done::Decision { request, decision } => {
            let o = match errors::decision_failure(*request, decision) {
                None => Outcome::complete(*request),
                Some(e) => Outcome::failed(*request, e),
            };
            Ok(Py::new(py, o)?.into_any())
        }
        Done::Unit => Ok(py.None()),
        Done::Error(e) => Err(e.to_pyerr(py)),
    }
}

#[pymethods]
impl Pending {
    /// Whether it ended.
    fn done(&self) -> bool {
        self.slot.lock().done.is_some()
    }

    /// Waits up to `timeout` seconds (for ever with `None`) with the interpreter detached, then
    /// returns the result or raises the error; raises `kvx.Timeout` if it has not ended by then.
    #[pyo3(signature = (timeout = None))]
    pub(crate) fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let bound = timeout.map(|t| crate::seconds("timeout", t)).transpose()?;
        let done = py.detach(|| {
            let deadline = bound.map(|b| Instant::now() + b);
            let mut st = self.slot.lock();
            loop {
                if let Some(d) = &st.done {
                    return Some(d.clone());
                }
                match deadline {
                    None => {
                        st = self
                            .slot
                            .cv
                            .wait(st)
                            .unwrap_or_else(PoisonError::into_inner);
                    }
                    Some(d) => {
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return None;
                        }
                        st = self
                            .slot
                            .cv
                            .wait_timeout(st, left)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                    }
                }
            }
        });
        match done {
            Some(d) => value(py, &d),
            None => Err(errors::timeout(format!(
                "{} did not end within {} s",
                self.what,
                timeout.unwrap_or_default()
            ))),
        }
    }

    /// Calls `callback()` (no arguments) once this ended: at once if it has, otherwise from a thread of
    /// its own. Exceptions it raises are reported as unraisable.
    fn add_done_callback(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        {
            let mut st = self.slot.lock();
            if st.done.is_none() {
                st.callbacks.push(callback);
                return Ok(());
            }
        }
        callback.call0(py)?;
        Ok(())
    }

    /// `await pending`: the same result as `wait()`, without blocking the event loop.
    fn __await__(slf: Py<Self>, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let coro = py
            .import("kvx._aio")?
            .getattr("wait_async")?
            .call1((slf,))?;
        Ok(coro.call_method0("__await__")?.unbind())
    }

    fn __repr__(&self) -> String {
        let state = if self.done() { "done" } else { "pending" };
        format!("<kvx.Pending {}: {state}>", self.what)
    }
}

/// How a request ended: `complete`, or the typed reason it failed.
#[pyclass(module = "kvx._kvx", frozen)]
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    /// The request.
    #[pyo3(get)]
    request: u64,
    /// Whether every byte of every PP rank arrived (decode), or every rank completed (prefill).
    #[pyo3(get)]
    complete: bool,
    error: Option<ErrInfo>,
}

impl Outcome {
    pub(crate) fn complete(request: u64) -> Self {
        Outcome {
            request,
            complete: true,
            error: None,
        }
    }

    pub(crate) fn failed(request: u64, e: ErrInfo) -> Self {
        Outcome {
            request,
            complete: false,
            error: Some(e),
        }
    }
}

#[pymethods]
impl Outcome {
    /// Why it failed: `aborted`, `timeout`, `peer_failed`, `peer_lost`, `protocol_violation` or
    /// `closed_without_vote`; `None` when complete.
    #[getter]
    fn reason(&self) -> Option<String> {
        self.error.as_ref().and_then(|e| e.attr_str("reason"))
    }

    /// The PP rank that failed it, where one did.
    #[getter]
    fn rank(&self) -> Option<u64> {
        self.error.as_ref().and_then(|e| e.attr_int("rank"))
    }

    /// The failure code that rank sent, where it sent one.
    #[getter]
    fn code(&self) -> Option<String> {
        self.error.as_ref().and_then(|e| e.attr_str("code"))
    }

    /// The failure as a `kvx.TransferFailed` exception (not raised), or `None` when complete.
    fn error(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.error
            .as_ref()
            .map(|e| e.to_pyerr(py).into_value(py).into_any())
    }

    /// Raises the failure as `kvx.TransferFailed`; returns `None` when complete.
    fn raise_for_failure(&self, py: Python<'_>) -> PyResult<()> {
        match &self.error {
            Some(e) => Err(e.to_pyerr(py)),
            None => Ok(()),
        }
    }

    fn __bool__(&self) -> bool {
        self.complete
    }

    fn __repr__(&self) -> String {
        match self.reason() {
            None => format!("Outcome(request={}, complete=True)", self.request),
            Some(r) => format!(
                "Outcome(request={}, complete=False, reason={r:?}, rank={:?}, code={:?})",
                self.request,
                self.rank(),
                self.code()
            ),
        }
    }
}
