//! `kvx.DecodeEngine`: the decode side, receiving every PP rank's pages of a request.

use crate::errors;
use crate::held::Held;
use crate::memory::Memory;
use crate::pending::{Done, Pending};
use crate::{Layout, runtime, seconds};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::net::SocketAddr;
use transfer_engine::core::RequestId;
use transfer_engine::engine::{self, DecodeConfig, EngineError, Expected};
use transfer_engine::transport::ProgressScheduling;

/// The decode side of the engine: listens for the prefill ranks, receives every rank's pages of a
/// request into its pool and says when they all arrived.
#[pyclass(module = "kvx._kvx", frozen)]
pub(crate) struct DecodeEngine {
    held: Held<engine::DecodeEngine>,
    address: String,
    pool_len: u64,
}

impl DecodeEngine {
    fn engine(&self) -> PyResult<engine::DecodeEngine> {
        self.held.engine()
    }
}

impl Drop for DecodeEngine {
    fn drop(&mut self) {
        // Not shut down: a rank may still write into the pool, which the engine leaks, and with it
        // the reference to the memory's owner that the pool holds.
        drop(self.held.take());
    }
}

pub(crate) fn stats_dict<'py>(
    py: Python<'py>,
    fields: &[(&str, u64)],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in fields {
        d.set_item(*k, *v)?;
    }
    Ok(d)
}

#[pymethods]
impl DecodeEngine {
    /// Registers `memory` as the pool (`layout` says where each layer's pages are; it holds every
    /// layer), starts the backend and listens on `listen` for the prefill ranks, which must prove
    /// they hold `secret`. `pp_size` ranks form the default instance (`""`); with `pp_size=0`
    /// there is none, and every prefill instance is added by name (`add_instance`): one engine
    /// serves any number of them, with one registration of the pool. A request expected while a rank is away (dead, restarting) waits
    /// up to `rank_wait` seconds (at most its own timeout) for it, then fails with
    /// `TransferFailed(reason="rank_unavailable")`. Every rank connection carries a heartbeat each
    /// way every `heartbeat` seconds (decode's; each rank announces its own), and a rank silent for
    /// three of the intervals it announced is lost (`None`: no heartbeats; 0 is refused); a rank
    /// that leaves decode's messages untaken as long (at most 60 s, and 60 s for one without
    /// heartbeats) is cut, its pages held as a silent rank's. `tp_rank`/`tp_size` are
    /// this decode rank's TP place; `tp_mode` says how prefill TP ranks map onto it (`"identical"`,
    /// `"replicated"` for MLA, `"head_sliced"` with the model's `kv_heads` and a `layout` with head
    /// geometry), and `add_instance`'s `tp_size` each prefill instance's TP size.
    /// `decode_instance` names the decode server this rank belongs to, alike on all its TP ranks: a
    /// prefill rank that writes into several of them (prefill TP smaller than decode's) then serves
    /// their allocations of one request as one, from its one engine.
    /// `pp_stage=(rank, size)` is this decode's own PP stage where decode is pipelined too: its
    /// `layout` then holds that stage's layers only, it takes them from prefill PP rank `rank` of
    /// pipelines of `size` ranks, and its outcomes speak for its layers only. `progress_fifo`
    /// runs the backend's progress thread, which sees prefill's notifications arrive, under
    /// `SCHED_FIFO` at that priority (1 to 99): seen at once however busy the cores are. It needs
    /// `CAP_SYS_NICE` or an `RLIMIT_RTPRIO` of at least it; without, the engine does not start.
    /// `progress_spin_us` is how long that thread polls after its last event before it sleeps
    /// (`None`: a decode engine's default, 10 µs with UCX, whose thread then sleeps on UCX's
    /// event fd, and 200 µs with NIXL); 0 leaves a busy host's cores to others at once.
    /// `landing_bytes` is the landing memory a NIXL engine with a host pool and `head_sliced`
    /// lends prefill ranks whose rows land strided in its pages (`None`: 256 MiB; 0: none);
    /// `landing_slots` how many chunks of one rank's share of a request it holds at once, reused
    /// in turn (`None`: 2; at least 1).
    #[new]
    #[pyo3(signature = (
        *, layout, total_layers, page_tokens, pp_size, memory, listen = "127.0.0.1:0",
        secret = None, backend = "ucx", engine_id = None, device = "cpu", checksums = false,
        abort_ack_timeout = 5.0, handshake_timeout = 10.0, rank_wait = 10.0, heartbeat = Some(5.0),
        tp_rank = 0, tp_size = 1, tp_mode = "identical", kv_heads = 0,
        decode_instance = String::new(), metrics = None, pp_stage = (0, 1), progress_fifo = None,
        progress_spin_us = None, landing_bytes = None, landing_slots = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        layout: &Layout,
        total_layers: u32,
        page_tokens: u32,
        pp_size: u16,
        memory: &Bound<'_, PyAny>,
        listen: &str,
        secret: Option<&Bound<'_, PyAny>>,
        backend: &str,
        engine_id: Option<String>,
        device: &str,
        checksums: bool,
        abort_ack_timeout: f64,
        handshake_timeout: f64,
        rank_wait: f64,
        heartbeat: Option<f64>,
        tp_rank: u16,
        tp_size: u16,
        tp_mode: &str,
        kv_heads: u32,
        decode_instance: String,
        metrics: Option<&str>,
        pp_stage: (u16, u16),
        progress_fifo: Option<u8>,
        progress_spin_us: Option<u64>,
        landing_bytes: Option<u64>,
        landing_slots: Option<u32>,
    ) -> PyResult<Self> {
        let tp = crate::tp_config(tp_rank, tp_size, tp_mode, kv_heads)?;
        let listen: SocketAddr = listen
            .parse()
            .map_err(|e| errors::config(format!("listen address {listen:?}: {e}")))?;
        if page_tokens == 0 || total_layers == 0 {
            return Err(errors::config(
                "page_tokens and total_layers must be positive",
            ));
        }
        let mem = Memory::from_py(memory, device)?;
        if mem.len() < layout.inner.buffer_len {
            return Err(errors::config(format!(
                "memory holds {} bytes, the layout needs {}",
                mem.len(),
                layout.inner.buffer_len
            )));
        }
        let name = engine_id.unwrap_or_else(|| format!("decode-{}", std::process::id()));
        let mut cfg = DecodeConfig::new(total_layers, page_tokens, layout.inner.clone(), pp_size);
        cfg.engine_id = name.clone();
        cfg.listen = listen;
        let mut b = crate::backend(backend, &name, true)?.with_scheduling(
            progress_fifo.map_or(ProgressScheduling::Normal, ProgressScheduling::Fifo),
        );
        if let Some(us) = progress_spin_us {
            b = b.with_spin(std::time::Duration::from_micros(us));
        }
        cfg.backend = b;
        cfg.token = crate::secret(secret)?;
        cfg.verify_checksums = checksums;
        cfg.abort_ack_timeout = seconds("abort_ack_timeout", abort_ack_timeout)?;
        cfg.handshake_timeout = seconds("handshake_timeout", handshake_timeout)?;
        cfg.rank_wait = seconds("rank_wait", rank_wait)?;
        cfg.heartbeat = heartbeat.map(|h| seconds("heartbeat", h)).transpose()?;
        cfg.tp = tp;
        cfg.stage = transfer_engine::engine::DecodeStage {
            rank: pp_stage.0,
            size: pp_stage.1,
        };
        cfg.instance = decode_instance;
        if let Some(bytes) = landing_bytes {
            cfg.landing_bytes = bytes;
        }
        match landing_slots {
            Some(0) => return Err(errors::config("landing_slots must be at least 1")),
            Some(n) => cfg.landing_slots = n,
            None => {}
        }
        cfg.metrics = metrics
            .map(|m| {
                m.parse()
                    .map_err(|e| errors::config(format!("metrics address {m:?}: {e}")))
            })
            .transpose()?;
        let pool_len = mem.len();
        let pools = mem.into_pools();
        let rt = runtime()?;
        match py.detach(|| rt.block_on(engine::DecodeEngine::start_regions(cfg, pools))) {
            Ok(engine) => Ok(DecodeEngine {
                address: engine.local_addr().to_string(),
                held: Held::new(engine),
                pool_len,
            }),
            // A pool whose registration had to be leaked keeps its memory's owner with it.
            Err(e) => Err(errors::engine(e)),
        }
    }

    /// The control address prefill ranks connect to (`"ip:port"`).
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// The address of the Prometheus endpoint this engine reports to (`"ip:port"`, the bound
    /// port where `metrics` asked for port 0), or None without one.
    #[getter]
    fn metrics_address(&self) -> PyResult<Option<String>> {
        Ok(self.engine()?.metrics_addr().map(|a| a.to_string()))
    }

    /// Waits (interpreter detached) until every PP rank of `instance` (the default one unless
    /// named) connected, or raises `kvx.Timeout`.
    #[pyo3(signature = (timeout = 60.0, instance = String::new()))]
    fn wait_for_ranks(&self, py: Python<'_>, timeout: f64, instance: String) -> PyResult<()> {
        let t = seconds("timeout", timeout)?;
        let e = self.engine()?;
        let rt = runtime()?;
        py.detach(|| rt.block_on(e.wait_for_instance(&instance, t)))
            .map_err(errors::engine)
    }

    /// Adds prefill instance `instance`, a pipeline of `pp_size` ranks at TP size `tp_size`: its
    /// ranks may connect (`PrefillEngine(instance=...)`) and requests may be expected from it.
    /// Again with the same sizes: a no-op; with others: `kvx.ConfigError`.
    #[pyo3(signature = (instance, pp_size, tp_size = 1))]
    fn add_instance(&self, instance: &str, pp_size: u16, tp_size: u16) -> PyResult<()> {
        self.engine()?
            .add_instance(instance, pp_size, tp_size)
            .map_err(errors::engine)
    }

    /// Stops serving prefill instance `instance`: its requests fail (`aborted`), its ranks are
    /// closed, and its state is forgotten once no write of it can still land. Others are not
    /// touched. Returns whether it was served.
    fn remove_instance(&self, instance: &str) -> PyResult<bool> {
        Ok(self.engine()?.remove_instance(instance))
    }

    /// The prefill instances served, as `(name, pp_size)` pairs.
    fn instances(&self) -> PyResult<Vec<(String, u16)>> {
        Ok(self.engine()?.instances())
    }

    /// Starts receiving `request`: `dst_pages` are the pool pages its prompt fills, in order; every
    /// PP rank is sent them. Returns a `Pending` whose result is the request's `Outcome`; it fails
    /// with `timeout` if not complete within `timeout` seconds. `prefix_tokens` (whole pages) are
    /// tokens before the prompt's moved ones that this side already holds: the ranks are told, and
    /// `prompt_tokens` and `dst_pages` cover only the tokens after them. `instance` names the
    /// prefill instance whose ranks send it (the default one unless named).
    #[pyo3(signature = (
        request, prompt_tokens, chunk_tokens, dst_pages, timeout = 60.0, prefix_tokens = 0,
        instance = String::new(),
    ))]
    #[allow(clippy::too_many_arguments)]
    fn expect(
        &self,
        request: u64,
        prompt_tokens: u32,
        chunk_tokens: u32,
        dst_pages: Vec<u32>,
        timeout: f64,
        prefix_tokens: u32,
        instance: String,
    ) -> PyResult<Pending> {
        let t = seconds("timeout", timeout)?;
        if t.is_zero() {
            return Err(errors::config("timeout must be positive"));
        }
        let e = self.engine()?;
        let fut = e
            .expect_request(
                RequestId(request),
                Expected {
                    instance,
                    prefix_tokens,
                    prompt_tokens,
                    chunk_tokens,
                    dst_pages,
                    timeout: t,
                },
            )
            .map_err(errors::engine)?;
        Ok(Pending::spawn(
            runtime()?,
            format!("request {request}"),
            async move {
                Done::Outcome {
                    request,
                    outcome: fut.await,
                }
            },
        ))
    }

    /// The payload PP rank `rank` sent beside its pages of `request` (`PrefillEngine.send_aux`),
    /// taken once; `None` if it has not arrived (it can come a moment after the request completed).
    fn aux(
        &self,
        py: Python<'_>,
        request: u64,
        rank: u16,
    ) -> PyResult<Option<Py<pyo3::types::PyBytes>>> {
        Ok(self
            .engine()?
            .aux(RequestId(request), rank)
            .map(|d| pyo3::types::PyBytes::new(py, &d).unbind()))
    }

    /// Fails `request` (if it had not ended) and tells every prefill rank.
    fn abort(&self, request: u64) -> PyResult<()> {
        self.engine()?.abort(RequestId(request));
        Ok(())
    }

    /// Gives up `request` of prefill instance `instance` before `expect` (the server dropped it
    /// while it waited for pages): the instance's ranks are told, so a prefill waiting for its
    /// allocation fails it now. An expected request is aborted instead.
    fn abandon(&self, request: u64, instance: &str) -> PyResult<()> {
        self.engine()?
            .abandon(RequestId(request), instance)
            .map_err(errors::engine)
    }

    /// Failed requests whose pages are quarantined until their ranks confirm their writes are over.
    fn quarantined(&self) -> PyResult<Vec<u64>> {
        Ok(self
            .engine()?
            .quarantined()
            .into_iter()
            .map(|r| r.0)
            .collect())
    }

    /// Ends (result `None`) once no write of `request`'s ranks can still land in its pages.
    fn released(&self, request: u64) -> PyResult<Pending> {
        let fut = self.engine()?.released(RequestId(request));
        Ok(Pending::spawn(
            runtime()?,
            format!("release of request {request}"),
            async move {
                fut.await;
                Done::Unit
            },
        ))
    }

    /// Whether no write of `request`'s ranks can still land in its pages (true for a request the
    /// engine does not hold): `released(request)` without waiting.
    fn is_released(&self, request: u64) -> PyResult<bool> {
        Ok(self.engine()?.is_released(RequestId(request)))
    }

    /// Copies `length` bytes at `offset` out of the pool (host memory).
    fn read(
        &self,
        py: Python<'_>,
        offset: u64,
        length: usize,
    ) -> PyResult<Py<pyo3::types::PyBytes>> {
        let mut buf = vec![0u8; length];
        self.engine()?
            .read_pool(offset, &mut buf)
            .map_err(errors::engine)?;
        Ok(pyo3::types::PyBytes::new(py, &buf).unbind())
    }

    /// Copies `data` into the pool at `offset` (host memory).
    fn write(&self, offset: u64, data: Vec<u8>) -> PyResult<()> {
        self.engine()?
            .write_pool(offset, &data)
            .map_err(errors::engine)
    }

    /// Bytes of the pool.
    #[getter]
    fn pool_len(&self) -> u64 {
        self.pool_len
    }

    /// Counters, as a dict of integers.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.engine()?.stats();
        stats_dict(
            py,
            &[
                ("completed", s.completed),
                ("failed", s.failed),
                ("failed_aborted", s.failed_aborted),
                ("failed_timeout", s.failed_timeout),
                ("failed_peer_failed", s.failed_peer_failed),
                ("failed_peer_lost", s.failed_peer_lost),
                ("failed_violation", s.failed_violation),
                ("failed_rank_unavailable", s.failed_rank_unavailable),
                ("rejoins", s.rejoins),
                ("malformed", s.malformed),
                ("unknown_sender", s.unknown_sender),
                ("refused", s.refused),
                ("checksum_mismatch", s.checksum_mismatch),
                ("in_flight", s.in_flight),
                ("requests", s.requests),
                ("instances", s.instances),
                ("connected_ranks", s.connected_ranks),
                ("waiting_for_rank", s.waiting_for_rank),
                ("awaiting_abort_ack", s.awaiting_abort_ack),
                ("abort_ack_timeouts", s.abort_ack_timeouts),
                ("quarantined", s.quarantined),
                ("registered_bytes", s.registered_bytes),
                ("auth_failures", s.auth_failures),
                ("handshake_failures", s.handshake_failures),
                ("probes", s.probes),
                ("abandoned", s.abandoned),
                ("unclean_ends", s.unclean_ends),
            ],
        )
    }

    /// Stops the engine: live requests fail, every rank is closed, and the pool's memory is handed
    /// back only if every rank confirmed within `timeout` seconds that its writes are over (it is
    /// leaked otherwise). Returns `{"confirmed", "gone", "unconfirmed", "pool_freed"}`, the first
    /// three lists of `(instance, rank)` pairs.
    #[pyo3(signature = (timeout = 10.0))]
    fn shutdown<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        let t = seconds("timeout", timeout)?;
        let Some(engine) = self.held.take() else {
            return Err(errors::engine(EngineError::Shutdown));
        };
        let rt = runtime()?;
        let report = py.detach(|| rt.block_on(engine.shutdown(t)));
        let d = PyDict::new(py);
        d.set_item("confirmed", report.confirmed)?;
        d.set_item("gone", report.gone)?;
        d.set_item("unconfirmed", report.unconfirmed)?;
        d.set_item("pool_freed", report.pool_freed)?;
        Ok(d)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        if self.held.is_live() {
            self.shutdown(py, 10.0)?;
        }
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!("<kvx.DecodeEngine on {}>", self.address)
    }
}
