//! `kvx.PrefillEngine`: one PP rank of the prefill side, writing its layers' pages chunk by chunk.

use crate::decode::stats_dict;
use crate::errors::{self, ErrInfo};
use crate::held::Held;
use crate::memory::Memory;
use crate::pending::{Done, Outcome, Pending};
use crate::{Layout, runtime, seconds};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use transfer_engine::core::RequestId;
use transfer_engine::engine::{self, ExternalDecode, NotifyFormat, PrefillConfig};
use transfer_engine::transport::RemoteRegion;

/// A page allocation decode sent: the request, the tokens to move and the chunk size, and the
/// tokens before them that decode already holds (its own prefix cache; the moved tokens start
/// there).
#[pyclass(module = "kvx._kvx", frozen, get_all)]
#[derive(Debug, Clone)]
pub(crate) struct IncomingRequest {
    request: u64,
    /// The decode engine that sent it: 0 for the one the rank started with, then in
    /// `add_decode` order.
    decode: u32,
    prompt_tokens: u32,
    chunk_tokens: u32,
    prefix_tokens: u32,
}

#[pymethods]
impl IncomingRequest {
    /// Chunks the prompt is sent in.
    #[getter]
    fn chunks(&self) -> u32 {
        // One chunk of no pages when decode holds the whole prompt (its prefix).
        self.prompt_tokens.div_ceil(self.chunk_tokens.max(1)).max(1)
    }

    fn __repr__(&self) -> String {
        format!(
            "IncomingRequest(request={}, decode={}, prompt_tokens={}, chunk_tokens={}, prefix_tokens={})",
            self.request, self.decode, self.prompt_tokens, self.chunk_tokens, self.prefix_tokens
        )
    }
}

/// A rank's vote mesh socket, bound and listening before the rank starts, so that its address can
/// be shared with the other ranks first and its port cannot be taken in between. Give it to the
/// rank as `mesh_socket`, with its `address` in every rank's `peers`.
#[pyclass(module = "kvx._kvx", frozen)]
pub(crate) struct MeshSocket {
    socket: std::sync::Arc<engine::MeshSocket>,
    address: SocketAddr,
}

#[pymethods]
impl MeshSocket {
    /// Binds `address`, `host:port` (port 0 lets the kernel pick a free port).
    #[new]
    #[pyo3(signature = (address = "127.0.0.1:0"))]
    fn new(address: &str) -> PyResult<Self> {
        use std::net::ToSocketAddrs;
        let want = address
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| errors::config(format!("mesh address {address:?} does not resolve")))?;
        let bound = engine::MeshSocket::bind(want)
            .and_then(|s| Ok((s.local_addr()?, s)))
            .map_err(|e| errors::config(format!("binding the mesh socket {want}: {e}")))?;
        Ok(MeshSocket {
            address: bound.0,
            socket: std::sync::Arc::new(bound.1),
        })
    }

    /// The bound address, `host:port`, for the other ranks' `peers`.
    #[getter]
    fn address(&self) -> String {
        self.address.to_string()
    }

    fn __repr__(&self) -> String {
        format!("MeshSocket({:?})", self.address.to_string())
    }
}

/// One PP rank of the prefill side: connects to decode and to its PP peers, writes its layers' pages
/// of each request, chunk by chunk, and agrees with its peers on how each request ended.
#[pyclass(module = "kvx._kvx", frozen)]
pub(crate) struct PrefillEngine {
    held: Held<engine::PrefillEngine>,
    pp_rank: u16,
    closed: AtomicBool,
}

impl PrefillEngine {
    fn engine(&self) -> PyResult<engine::PrefillEngine> {
        self.held.engine()
    }

    fn started(engine: engine::PrefillEngine, pp_rank: u16) -> Self {
        PrefillEngine {
            held: Held::new(engine),
            pp_rank,
            closed: AtomicBool::new(false),
        }
    }
}

impl Drop for PrefillEngine {
    fn drop(&mut self) {
        // The pool's memory outlives this handle while a pending chunk's handle may still post reads
        // from it: the pool holds its owner until its registration is over.
        drop(self.held.take());
    }
}

fn addr(what: &str, s: &str) -> PyResult<SocketAddr> {
    s.parse()
        .map_err(|e| errors::config(format!("{what} {s:?}: {e}")))
}

#[pymethods]
impl PrefillEngine {
    /// Registers `memory` as this rank's pool (`layout` holds this rank's layers only), connects to
    /// the decode engine at `decode` and, when `pp_size > 1`, to its PP peers (`peers`: every rank's
    /// vote address in rank order, this rank listening on its own), proving `secret` to each.
    /// `instance` names the prefill instance (the pipeline) this rank belongs to, as the decode
    /// engine added it (`DecodeEngine.add_instance`); `""` is its default instance. More decode
    /// engines are served with `add_decode`; `keep_open` keeps the rank serving once every decode
    /// closed (otherwise it closes with its last one). Every control connection carries a
    /// heartbeat each way every `heartbeat` seconds (this rank's; each peer announces its own), and
    /// a peer silent for three of the intervals it announced is lost (`None`: no heartbeats; 0 is
    /// refused). A peer that leaves this rank's messages untaken as long (at most 60 s, and 60 s
    /// for one without heartbeats) is cut.
    /// `tp_rank`/`tp_size` are this rank's TP place and `tp_mode` how it maps onto decode's TP ranks
    /// (as `DecodeEngine`'s); each decode engine it links to must be one this rank writes into.
    #[new]
    #[pyo3(signature = (
        *, decode, pp_rank, pp_size, layout, total_layers, page_tokens, memory, peers = Vec::new(),
        mesh_socket = None, secret = None, backend = "ucx", engine_id = None, device = "cpu", checksums = false,
        connect_timeout = 60.0, request_wait = 10.0, instance = String::new(), keep_open = false,
        heartbeat = Some(5.0), tp_rank = 0, tp_size = 1, tp_mode = "identical", kv_heads = 0,
        metrics = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        decode: &str,
        pp_rank: u16,
        pp_size: u16,
        layout: &Layout,
        total_layers: u32,
        page_tokens: u32,
        memory: &Bound<'_, PyAny>,
        peers: Vec<String>,
        mesh_socket: Option<Bound<'_, MeshSocket>>,
        secret: Option<&Bound<'_, PyAny>>,
        backend: &str,
        engine_id: Option<String>,
        device: &str,
        checksums: bool,
        connect_timeout: f64,
        request_wait: f64,
        instance: String,
        keep_open: bool,
        heartbeat: Option<f64>,
        tp_rank: u16,
        tp_size: u16,
        tp_mode: &str,
        kv_heads: u32,
        metrics: Option<&str>,
    ) -> PyResult<Self> {
        let tp = crate::tp_config(tp_rank, tp_size, tp_mode, kv_heads)?;
        let decode = addr("decode address", decode)?;
        let metrics = metrics.map(|m| addr("metrics address", m)).transpose()?;
        let (mut cfg, mem) = config(
            decode,
            pp_rank,
            pp_size,
            layout,
            total_layers,
            page_tokens,
            memory,
            peers,
            mesh_socket.map(|m| m.get().socket.clone()),
            secret,
            backend,
            engine_id,
            device,
            checksums,
            connect_timeout,
            request_wait,
        )?;
        cfg.instance = instance;
        cfg.keep_open = keep_open;
        cfg.tp = tp;
        cfg.heartbeat = heartbeat.map(|h| seconds("heartbeat", h)).transpose()?;
        cfg.metrics = metrics;
        let pools = mem.into_pools();
        let rt = runtime()?;
        let engine = py
            .detach(|| rt.block_on(engine::PrefillEngine::start_regions(cfg, pools)))
            .map_err(errors::engine)?;
        Ok(Self::started(engine, pp_rank))
    }

    /// A rank whose decode side does not speak kvx's control plane (a NIXL agent, an SGLang decode
    /// on its own backend): its agent metadata (`decode_metadata`, NIXL backend) or worker address
    /// (UCX backend), its registered pool (`decode_region`: `(address, length)`, plus the packed
    /// rkey for UCX) and `decode_layout` come from its own bootstrap. Page allocations are given with
    /// `add_request`. `notify` is `"binary"` (kvx's record) or `"sglang"` (SGLang's NIXL text form).
    #[staticmethod]
    #[pyo3(signature = (
        *, decode_metadata, decode_region, decode_layout, pp_rank, pp_size, layout, total_layers,
        page_tokens, memory, peers = Vec::new(), mesh_socket = None, secret = None, backend = "nixl",
        engine_id = None, device = "cpu", checksums = false, connect_timeout = 60.0, request_wait = 10.0,
        notify = "binary",
    ))]
    #[allow(clippy::too_many_arguments)]
    fn external(
        py: Python<'_>,
        decode_metadata: Vec<u8>,
        decode_region: &Bound<'_, PyAny>,
        decode_layout: &Layout,
        pp_rank: u16,
        pp_size: u16,
        layout: &Layout,
        total_layers: u32,
        page_tokens: u32,
        memory: &Bound<'_, PyAny>,
        peers: Vec<String>,
        mesh_socket: Option<Bound<'_, MeshSocket>>,
        secret: Option<&Bound<'_, PyAny>>,
        backend: &str,
        engine_id: Option<String>,
        device: &str,
        checksums: bool,
        connect_timeout: f64,
        request_wait: f64,
        notify: &str,
    ) -> PyResult<Self> {
        let region = if let Ok((addr, len)) = decode_region.extract::<(u64, u64)>() {
            RemoteRegion {
                addr,
                len,
                rkey: Vec::new(),
            }
        } else {
            let (addr, len, rkey) =
                decode_region
                    .extract::<(u64, u64, Vec<u8>)>()
                    .map_err(|_| {
                        errors::config(
                            "decode_region must be (address, length) or (address, length, rkey)",
                        )
                    })?;
            RemoteRegion { addr, len, rkey }
        };
        let unused: SocketAddr = ([127, 0, 0, 1], 0).into();
        let (mut cfg, mem) = config(
            unused,
            pp_rank,
            pp_size,
            layout,
            total_layers,
            page_tokens,
            memory,
            peers,
            mesh_socket.map(|m| m.get().socket.clone()),
            secret,
            backend,
            engine_id,
            device,
            checksums,
            connect_timeout,
            request_wait,
        )?;
        cfg.notify_format = match notify {
            "binary" => NotifyFormat::Binary,
            "sglang" => NotifyFormat::SglangText,
            other => {
                return Err(errors::config(format!(
                    "notify must be \"binary\" or \"sglang\", not {other:?}"
                )));
            }
        };
        let decode = ExternalDecode {
            metadata: decode_metadata,
            region,
            layout: decode_layout.inner.clone(),
        };
        let mut pools = mem.into_pools();
        if pools.len() != 1 {
            return Err(errors::config(
                "an external decode takes this rank's pool as one region",
            ));
        }
        let pool = pools.remove(0);
        let rt = runtime()?;
        let engine = py
            .detach(|| rt.block_on(engine::PrefillEngine::start_external(cfg, pool, decode)))
            .map_err(errors::engine)?;
        Ok(Self::started(engine, pp_rank))
    }

    /// Gives an external decode's page allocation of `request` (see `external`).
    fn add_request(
        &self,
        request: u64,
        prompt_tokens: u32,
        chunk_tokens: u32,
        dst_pages: Vec<u32>,
    ) -> PyResult<()> {
        self.engine()?
            .add_request(RequestId(request), prompt_tokens, chunk_tokens, dst_pages)
            .map_err(errors::engine)
    }

    /// This rank.
    #[getter]
    fn pp_rank(&self) -> u16 {
        self.pp_rank
    }

    /// Serves one more decode engine (another decode instance or TP rank) at `decode`,
    /// `host:port`, with this rank's pool, transport and vote mesh; returns its number (as
    /// `IncomingRequest.decode` carries it). A decode already served at that address keeps its
    /// number. Interpreter detached while it connects.
    fn add_decode(&self, py: Python<'_>, decode: &str) -> PyResult<u32> {
        let decode = addr("decode address", decode)?;
        let e = self.engine()?;
        let rt = runtime()?;
        py.detach(|| rt.block_on(e.add_decode(decode)))
            .map(|id| id.0)
            .map_err(errors::engine)
    }

    /// The decode engines served now, as `(number, "host:port")`.
    #[getter]
    fn decodes(&self) -> PyResult<Vec<(u32, String)>> {
        Ok(self
            .engine()?
            .decodes()
            .into_iter()
            .map(|(id, a)| (id.0, a.to_string()))
            .collect())
    }

    /// Whether this rank closed (its last decode closed it, without `keep_open`): `next_request`
    /// then returns `None` for ever.
    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// The next page allocation decode sent, waiting up to `timeout` seconds (for ever with `None`;
    /// interpreter detached); `None` if none came by then, or once decode closed (see `closed`).
    /// The address of the Prometheus endpoint this rank reports to (`"ip:port"`, the bound port
    /// where `metrics` asked for port 0), or None without one.
    #[getter]
    fn metrics_address(&self) -> PyResult<Option<String>> {
        Ok(self.engine()?.metrics_addr().map(|a| a.to_string()))
    }

    #[pyo3(signature = (timeout = None))]
    fn next_request(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
    ) -> PyResult<Option<IncomingRequest>> {
        let t = timeout.map(|t| seconds("timeout", t)).transpose()?;
        let e = self.engine()?;
        let rt = runtime()?;
        let got = py.detach(|| {
            rt.block_on(async {
                match t {
                    None => Some(e.next_request().await),
                    Some(t) => tokio::time::timeout(t, e.next_request()).await.ok(),
                }
            })
        });
        Ok(match got {
            Some(Some(r)) => Some(IncomingRequest {
                request: r.request.0,
                decode: r.decode.0,
                prompt_tokens: r.prompt_tokens,
                chunk_tokens: r.chunk_tokens,
                prefix_tokens: r.prefix_tokens,
            }),
            Some(None) => {
                self.closed.store(true, Ordering::Relaxed);
                None
            }
            None => None,
        })
    }

    /// Posts chunk `chunk` of `request` from `src_pages` (all of the request's pages in this rank's
    /// pool, in prompt order, as many as `prompt_tokens` span in this rank's pages, which may differ
    /// in size from decode's; the chunk takes its own from them) and returns a `Pending` that ends (result `None`) when its writes are over, or raises
    /// why they failed. The writes are posted before this returns, in call order, unless the chunk
    /// waits for decode's allocation or for a landing range decode is still copying from (then it
    /// posts once that comes); `last` marks the request's final chunk.
    #[pyo3(signature = (request, chunk, src_pages, last))]
    fn post_chunk(
        &self,
        request: u64,
        chunk: u32,
        src_pages: Vec<u32>,
        last: bool,
    ) -> PyResult<Pending> {
        let e = self.engine()?;
        let rt = runtime()?;
        let what = format!("request {request} chunk {chunk}");
        let mut fut = Box::pin(async move {
            match e
                .send_chunk(RequestId(request), chunk, &src_pages, last)
                .await
            {
                Ok(()) => Done::Unit,
                Err(err) => Done::Error(ErrInfo::from(err)),
            }
        });
        // Polled once here, so that the writes are posted now, in the caller's order; whatever is
        // left (waiting for their completion) runs on the engine runtime.
        let _guard = rt.enter();
        let mut cx = Context::from_waker(Waker::noop());
        Ok(match fut.as_mut().poll(&mut cx) {
            Poll::Ready(done) => Pending::ready(what, done),
            Poll::Pending => Pending::spawn(rt, what, fut),
        })
    }

    /// `post_chunk(...).wait()`: sends a chunk and waits (interpreter detached) for its writes.
    #[pyo3(signature = (request, chunk, src_pages, last))]
    fn send_chunk(
        &self,
        py: Python<'_>,
        request: u64,
        chunk: u32,
        src_pages: Vec<u32>,
        last: bool,
    ) -> PyResult<()> {
        self.post_chunk(request, chunk, src_pages, last)?
            .wait(py, None)
            .map(|_| ())
    }

    /// Sends decode a payload of at most 64 KiB for `request` beside its pages (SGLang's metadata
    /// row, for instance), before the request's last chunk; decode reads it with `aux`.
    fn send_aux(&self, request: u64, data: Vec<u8>) -> PyResult<()> {
        self.engine()?
            .send_aux(RequestId(request), data)
            .map_err(errors::engine)
    }

    /// Offers `request`'s source pages (the prompt's pages from its first token on) before decode
    /// asks for it: once its allocation is complete the engine posts every chunk itself, from
    /// the page where decode's prefix ends, with no Python thread between decode's request and
    /// the writes. Such a request does not come through `next_request`, except where its
    /// allocation was complete before the offer: then posting starts here, and the caller must
    /// not post it too. The pages are the engine's until `decided(request)` ends, or until
    /// `withdraw(request)` returns True.
    fn offer(&self, request: u64, src_pages: Vec<u32>) -> PyResult<()> {
        let e = self.engine()?;
        e.offer(RequestId(request), src_pages)
            .map_err(errors::engine)
    }

    /// Takes back an offer nothing was posted from: True where it still waited for its
    /// allocation (the pages are the caller's again; an allocation that completes later comes
    /// through `next_request`), False where there is none (never made, or posting started:
    /// wait for `decided`).
    fn withdraw(&self, request: u64) -> PyResult<bool> {
        Ok(self.engine()?.withdraw(RequestId(request)))
    }

    /// Fails `request` from this rank (decode and the PP peers are told), with a failure code:
    /// `aborted` (default), `write_failed`, `timeout`, `peer_lost`, `out_of_resources`, `internal`
    /// or `unspecified`.
    #[pyo3(signature = (request, code = "aborted"))]
    fn fail(&self, request: u64, code: &str) -> PyResult<()> {
        let code = errors::code_from_name(code)?;
        self.engine()?.fail(RequestId(request), code);
        Ok(())
    }

    /// A `Pending` whose result is the PP ranks' decision on `request`, as an `Outcome`: until it
    /// ends, the request's source pages must not be reused.
    fn decided(&self, request: u64) -> PyResult<Pending> {
        let e = self.engine()?;
        Ok(Pending::spawn(
            runtime()?,
            format!("decision on request {request}"),
            async move {
                Done::Decision {
                    request,
                    decision: e.decided(RequestId(request)).await,
                }
            },
        ))
    }

    /// The PP ranks' decision on `request` as an `Outcome`, if they made it (and this rank keeps
    /// it), else None: it neither waits nor registers anything, so a caller can ask it on every
    /// poll (decode may give a request up before its allocation was sent: `DecodeEngine.abandon`).
    fn decision(&self, request: u64) -> PyResult<Option<Outcome>> {
        Ok(self.engine()?.decision(RequestId(request)).map(|d| {
            match errors::decision_failure(request, &d) {
                None => Outcome::complete(request),
                Some(e) => Outcome::failed(request, e),
            }
        }))
    }

    /// Forgets a decided request (after its pages are reused).
    fn release(&self, request: u64) -> PyResult<()> {
        self.engine()?.release(RequestId(request));
        Ok(())
    }

    /// Copies `data` into the pool at `offset` (host memory).
    fn write(&self, offset: u64, data: Vec<u8>) -> PyResult<()> {
        self.engine()?
            .write_pool(offset, &data)
            .map_err(errors::engine)
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

    /// Counters, as a dict of integers.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.engine()?.stats();
        stats_dict(
            py,
            &[
                ("chunks", s.chunks),
                ("bytes", s.bytes),
                ("failed_chunks", s.failed_chunks),
                ("decided_completed", s.decided_completed),
                ("decided_failed", s.decided_failed),
                ("undecided", s.undecided),
                ("requests", s.requests),
                ("rejected_requests", s.rejected_requests),
                ("registered_bytes", s.registered_bytes),
                ("writes", s.writes),
                ("offers_posted", s.offers_posted),
                ("landing_waits", s.landing_waits),
                ("landing_wait_micros", s.landing_wait_micros),
                ("decodes", s.decodes),
                ("refused", s.refused),
                ("refused_connections", s.refused_connections),
                ("auth_failures", s.auth_failures),
                ("handshake_failures", s.handshake_failures),
            ],
        )
    }

    /// Stops this rank (interpreter detached while its backend shuts down).
    fn close(&self, py: Python<'_>) {
        // Posts still pending hold engine handles of their own; the pool (and the memory's owner it
        // holds) goes only with the last of them, once its writes are over.
        if let Some(engine) = self.held.take() {
            py.detach(move || drop(engine));
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("<kvx.PrefillEngine rank {}>", self.pp_rank)
    }
}

/// A prefill rank's settings and pool memory from Python's arguments.
#[allow(clippy::too_many_arguments)]
fn config(
    decode: SocketAddr,
    pp_rank: u16,
    pp_size: u16,
    layout: &Layout,
    total_layers: u32,
    page_tokens: u32,
    memory: &Bound<'_, PyAny>,
    peers: Vec<String>,
    mesh_socket: Option<std::sync::Arc<engine::MeshSocket>>,
    secret: Option<&Bound<'_, PyAny>>,
    backend: &str,
    engine_id: Option<String>,
    device: &str,
    checksums: bool,
    connect_timeout: f64,
    request_wait: f64,
) -> PyResult<(PrefillConfig, Memory)> {
    if pp_size == 0 || pp_rank >= pp_size {
        return Err(errors::config(format!(
            "pp_rank {pp_rank} must be below pp_size {pp_size}"
        )));
    }
    if pp_size > 1 && peers.len() != usize::from(pp_size) {
        return Err(errors::config(format!(
            "peers must list all {pp_size} ranks' vote addresses, in rank order (got {})",
            peers.len()
        )));
    }
    let peers = peers
        .iter()
        .map(|p| addr("peer address", p))
        .collect::<PyResult<Vec<_>>>()?;
    let mem = Memory::from_py(memory, device)?;
    if mem.len() < layout.inner.buffer_len {
        return Err(errors::config(format!(
            "memory holds {} bytes, the layout needs {}",
            mem.len(),
            layout.inner.buffer_len
        )));
    }
    let name = engine_id.unwrap_or_else(|| format!("prefill-{pp_rank}-{}", std::process::id()));
    let mut cfg = PrefillConfig::new(
        decode,
        pp_rank,
        pp_size,
        total_layers,
        page_tokens,
        layout.inner.clone(),
    );
    cfg.engine_id = name.clone();
    cfg.backend = crate::backend(backend, &name, false)?;
    cfg.peers = peers;
    cfg.mesh_socket = mesh_socket;
    cfg.token = crate::secret(secret)?;
    cfg.checksums = checksums;
    cfg.connect_timeout = seconds("connect_timeout", connect_timeout)?;
    cfg.request_wait = seconds("request_wait", request_wait)?;
    Ok((cfg, mem))
}
