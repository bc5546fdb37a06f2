//! A loopback cluster in one process: one decode engine and `pp` prefill engines, whose requests are
//! prepared and checked byte for byte with [`crate::verify`]: each request's sources hold its own
//! pattern and its destination pages are poisoned before it starts.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use transfer_engine::control::Secret;
use transfer_engine::core::planner::{KvLayout, PpSplit, RegionKind};
use transfer_engine::core::{FailureCode, RequestId};
use transfer_engine::engine::{
    BackendConfig, DecodeConfig, DecodeEngine, EngineError, MeshSocket, Outcome, Pool,
    PrefillConfig, PrefillEngine,
};
use transfer_engine::mem::{HostBuffer, HostOptions};
use transfer_engine::transport::{BackendKind, ProgressScheduling};

use crate::verify::{self, VerifyError};

/// A model's KV geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Layers.
    pub layers: u32,
    /// Bytes of KV per token per layer (K and V together).
    pub bytes_per_token: u64,
    /// Tokens per page.
    pub page_tokens: u32,
    /// Fused (MLA latent) or split K and V.
    pub regions: RegionKind,
}

impl Shape {
    /// DeepSeek-R1-like MLA: 61 layers, 576 bytes per token per layer, 64-token pages.
    pub const MLA: Shape = Shape {
        layers: 61,
        bytes_per_token: 576,
        page_tokens: 64,
        regions: RegionKind::Fused,
    };
    /// Llama-3-8B-like GQA: 32 layers, 4 KiB per token per layer (K and V), 16-token pages.
    pub const GQA: Shape = Shape {
        layers: 32,
        bytes_per_token: 4096,
        page_tokens: 16,
        regions: RegionKind::SplitKv,
    };

    /// Bytes of one page of one layer in one region.
    pub fn page_bytes(&self) -> u64 {
        self.bytes_per_token / u64::from(self.regions.count()) * u64::from(self.page_tokens)
    }

    /// Pages a prompt fills.
    pub fn pages_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.page_tokens)
    }

    /// KV bytes of a prompt (all layers, whole pages).
    pub fn request_bytes(&self, tokens: u32) -> u64 {
        u64::from(self.pages_for(tokens))
            * self.page_bytes()
            * u64::from(self.regions.count())
            * u64::from(self.layers)
    }
}

/// How decode engines' progress threads (the threads that see prefill's notifications arrive)
/// run: `--progress-fifo` and `--progress-spin-us`.
#[derive(Debug, Clone, Copy, Default)]
pub struct DecodeProgress {
    /// Their scheduling policy.
    pub scheduling: ProgressScheduling,
    /// How long they poll after their last event before sleeping; `None`: the backend's default.
    pub spin: Option<Duration>,
}

impl DecodeProgress {
    /// `backend` with these settings.
    pub fn apply(&self, backend: BackendConfig) -> BackendConfig {
        let b = backend.with_scheduling(self.scheduling);
        match self.spin {
            Some(spin) => b.with_spin(spin),
            None => b,
        }
    }
}

/// How to build a cluster.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// The model.
    pub shape: Shape,
    /// Prefill PP size.
    pub pp: u16,
    /// Pages in the decode pool.
    pub decode_pages: u32,
    /// Pages in each prefill pool.
    pub prefill_pages: u32,
    /// Backend.
    pub backend: BackendKind,
    /// Checksums sent and verified.
    pub checksums: bool,
    /// Where the pools come from (decode's and, for `Shared`, the prefill ranks' too).
    pub decode_pool: PoolKind,
    /// Where every engine of the cluster serves its Prometheus metrics, if anywhere.
    pub metrics: Option<std::net::SocketAddr>,
    /// How the decode engines' progress threads run.
    pub decode_progress: DecodeProgress,
}

/// Where a cluster's pools come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PoolKind {
    /// Allocated by the transport (`Pool::Shared`): with UCX, shared memory that same-host peers
    /// map (UCX still picks cma for large puts unless `UCX_ZCOPY_THRESH` says otherwise).
    Shared,
    /// Private memory, as a server's own pool (`Pool::Owned`): UCX writes into it with a
    /// `process_vm_writev` call per write (cma).
    #[default]
    Caller,
}

impl PoolKind {
    /// A decode pool of `len` bytes of this kind.
    ///
    /// # Errors
    /// The mapping fails (caller pools).
    pub fn pool(self, len: u64) -> std::io::Result<Pool> {
        Ok(match self {
            PoolKind::Shared => Pool::Shared(len),
            PoolKind::Caller => Pool::Owned(HostBuffer::new(
                len as usize,
                HostOptions {
                    prefault: true,
                    ..HostOptions::default()
                },
            )?),
        })
    }
}

/// A running cluster.
#[derive(Debug)]
pub struct Cluster {
    /// The spec it was built from.
    pub spec: ClusterSpec,
    /// The decode engine (the first one, with [`start_grid`](Self::start_grid)).
    pub decode: DecodeEngine,
    /// The decode engines after the first: every prefill rank serves each of them too (one engine,
    /// one registration of its pool, one link per decode).
    pub other_decodes: Vec<DecodeEngine>,
    /// The prefill engines, by rank (of the first instance, with [`start_instances`]).
    ///
    /// [`start_instances`]: Self::start_instances
    pub prefill: Vec<PrefillEngine>,
    /// Every prefill instance's name, as decode serves it (`""`: decode's default instance).
    pub instance_names: Vec<String>,
    /// The ranks of the instances after the first (whose ranks are `prefill`, held only there,
    /// so that taking a rank out of `prefill` drops its engine).
    others: Vec<Vec<PrefillEngine>>,
    /// Each rank's global layer range.
    pub layers: Vec<std::ops::Range<u32>>,
    /// Each rank's settings, to start it again ([`restart_rank`](Self::restart_rank)).
    configs: Vec<PrefillConfig>,
}

/// The loopback vote mesh sockets of a pipeline of `pp` ranks and their addresses (none for one
/// rank). Each is bound before the addresses are shared, so no port can be taken in between.
///
/// # Errors
/// A socket cannot be bound.
pub fn mesh_sockets(pp: u16) -> Result<(Vec<Arc<MeshSocket>>, Vec<SocketAddr>), EngineError> {
    let (mut sockets, mut peers) = (Vec::new(), Vec::new());
    if pp > 1 {
        for _ in 0..pp {
            let socket = MeshSocket::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
                .map_err(|e| EngineError::Config(format!("mesh socket: {e}")))?;
            peers.push(
                socket
                    .local_addr()
                    .map_err(|e| EngineError::Config(format!("mesh socket: {e}")))?,
            );
            sockets.push(Arc::new(socket));
        }
    }
    Ok((sockets, peers))
}

/// One pipeline's ranks, their layer ranges and settings.
type PipelineParts = (
    Vec<PrefillEngine>,
    Vec<std::ops::Range<u32>>,
    Vec<PrefillConfig>,
);

static CLUSTER_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A fresh 32-byte secret from the kernel's generator, for the engines of one cluster: on loopback
/// too, any local process could otherwise connect to a listening engine and write into its pool.
fn fresh_secret() -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut secret = vec![0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut secret)?;
    Ok(secret)
}

/// `n` loopback addresses whose ports were free a moment ago, for engines in other processes (which
/// bind them later).
///
/// The ports are drawn below the kernel's ephemeral range (`ip_local_port_range`): the kernel
/// hands out ports from that range to every `connect` and every bind to port 0 on the host, so a
/// port taken from it and released can be given to someone else's connection before our engine
/// binds it. Below the range only another explicit bind can take it.
///
/// # Errors
/// No free ports were found.
pub fn free_addrs(n: usize) -> std::io::Result<Vec<SocketAddr>> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (first, last) = (10_000u16, low.saturating_sub(1).max(10_001));
    let mut held: Vec<std::net::TcpListener> = Vec::with_capacity(n);
    for _ in 0..n.saturating_mul(64) {
        if held.len() == n {
            break;
        }
        let port = rand::random_range(first..=last);
        // A port we already hold cannot be bound again, so `held` has no duplicates.
        if let Ok(s) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            held.push(s);
        }
    }
    if held.len() < n {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            format!("found {} of {n} free ports in {first}..={last}", held.len()),
        ));
    }
    held.iter().map(std::net::TcpListener::local_addr).collect()
}

impl Cluster {
    /// Starts the decode engine and every prefill rank, sharing a secret drawn for this cluster. The
    /// pools start zeroed: a request's bytes are written by [`prepare`](Self::prepare).
    ///
    /// # Errors
    /// Any engine start failure.
    pub async fn start(spec: ClusterSpec) -> Result<Cluster, EngineError> {
        let kind = spec.backend;
        Self::start_with(spec, |rank, name| match rank {
            None => BackendConfig::default_for_decode(kind, name),
            Some(_) => BackendConfig::default_for(kind, name),
        })
        .await
    }

    /// [`start`](Self::start) with each engine's backend chosen by `backend(rank, name)`: `rank` is
    /// `None` for decode, the PP rank for prefill; `name` is unique in the process (NIXL agents are
    /// known by it). Called for decode first, then for ranks in order. Tests use it to put engines
    /// on fault-injecting transports.
    ///
    /// # Errors
    /// Any engine start failure.
    pub async fn start_with(
        spec: ClusterSpec,
        backend: impl FnMut(Option<u16>, &str) -> BackendConfig,
    ) -> Result<Cluster, EngineError> {
        Self::start_inner(spec, 1, 1, backend).await
    }

    /// [`start`](Self::start) with `instances` prefill instances (each a pipeline of `spec.pp`
    /// ranks, named `prefill-<k>`) into the one decode engine, each a session of it. With one
    /// instance, that is decode's default instance, as [`start`](Self::start) makes it.
    ///
    /// # Errors
    /// Any engine start failure.
    pub async fn start_instances(
        spec: ClusterSpec,
        instances: u16,
    ) -> Result<Cluster, EngineError> {
        Self::start_grid(spec, instances, 1).await
    }

    /// [`start_instances`](Self::start_instances) with `decodes` decode engines, each with its own
    /// pool: every rank of every prefill instance serves all of them from its one engine
    /// ([`PrefillEngine::add_decode`]), and every decode serves every instance.
    ///
    /// # Errors
    /// Any engine start failure.
    pub async fn start_grid(
        spec: ClusterSpec,
        instances: u16,
        decodes: u16,
    ) -> Result<Cluster, EngineError> {
        let kind = spec.backend;
        Self::start_inner(spec, instances, decodes, |rank, name| match rank {
            None => BackendConfig::default_for_decode(kind, name),
            Some(_) => BackendConfig::default_for(kind, name),
        })
        .await
    }

    async fn start_inner(
        mut spec: ClusterSpec,
        instances: u16,
        decodes: u16,
        mut backend: impl FnMut(Option<u16>, &str) -> BackendConfig,
    ) -> Result<Cluster, EngineError> {
        let s = spec.shape;
        let page_bytes = s.page_bytes();
        let dst_layout = KvLayout::packed(0, s.layers, s.regions, page_bytes, spec.decode_pages);
        let instances = instances.max(1);
        // One instance is decode's default one; several are named sessions.
        let names: Vec<String> = if instances == 1 {
            vec![String::new()]
        } else {
            (0..instances).map(|k| format!("prefill-{k}")).collect()
        };
        let default_pp = if instances == 1 { spec.pp } else { 0 };
        // Names unique in the process: tests build several clusters side by side, and a NIXL agent's
        // name is how its peers know it.
        let tag = CLUSTER_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("{}-{tag}", std::process::id());
        let secret =
            fresh_secret().map_err(|e| EngineError::Config(format!("drawing a secret: {e}")))?;
        let mut all_decodes = Vec::new();
        for m in 0..decodes.max(1) {
            let mut dcfg =
                DecodeConfig::new(s.layers, s.page_tokens, dst_layout.clone(), default_pp);
            let name = if m == 0 {
                format!("decode-{tag}")
            } else {
                format!("decode{m}-{tag}")
            };
            dcfg.backend = spec.decode_progress.apply(backend(None, &name));
            dcfg.verify_checksums = spec.checksums;
            dcfg.token = Some(Secret::new(&secret));
            dcfg.metrics = spec.metrics;
            let dpool = spec
                .decode_pool
                .pool(dst_layout.buffer_len)
                .map_err(|e| EngineError::Config(format!("decode pool: {e}")))?;
            let decode = DecodeEngine::start(dcfg, dpool).await?;
            // Every later engine joins the first decode's endpoint (a port 0 asked for bound
            // one of its own: asked for again, it would bind another).
            spec.metrics = decode.metrics_addr().or(spec.metrics);
            if instances > 1 {
                for name in &names {
                    decode.add_instance(name, spec.pp, 1)?;
                }
            }
            all_decodes.push(decode);
        }
        let mut all_decodes = all_decodes.into_iter();
        let decode = all_decodes
            .next()
            .ok_or_else(|| EngineError::Config("no decode engine".into()))?;
        let other_decodes: Vec<DecodeEngine> = all_decodes.collect();
        let split = PpSplit::SglangEven;
        let mut pipelines = Vec::new();
        let (mut layers, mut configs) = (Vec::new(), Vec::new());
        for (k, name) in names.iter().enumerate() {
            let (ranks, l, c) = Self::start_pipeline(
                &spec,
                &decode,
                name,
                &format!("{tag}-{k}"),
                &secret,
                split.clone(),
                &mut backend,
            )
            .await?;
            if k == 0 {
                (layers, configs) = (l, c);
            }
            for d in &other_decodes {
                for r in &ranks {
                    r.add_decode(d.local_addr()).await?;
                }
            }
            pipelines.push((name.clone(), ranks));
        }
        for d in std::iter::once(&decode).chain(&other_decodes) {
            for (name, _) in &pipelines {
                d.wait_for_instance(name, Duration::from_secs(10)).await?;
            }
        }
        let instance_names = pipelines.iter().map(|(n, _)| n.clone()).collect();
        let mut ranks = pipelines.into_iter().map(|(_, r)| r);
        let prefill = ranks.next().unwrap_or_default();
        Ok(Cluster {
            spec,
            decode,
            other_decodes,
            prefill,
            instance_names,
            others: ranks.collect(),
            layers,
            configs,
        })
    }

    /// Starts one prefill pipeline of instance `instance` into `decode`.
    async fn start_pipeline(
        spec: &ClusterSpec,
        decode: &DecodeEngine,
        instance: &str,
        tag: &str,
        secret: &[u8],
        split: PpSplit,
        backend: &mut impl FnMut(Option<u16>, &str) -> BackendConfig,
    ) -> Result<PipelineParts, EngineError> {
        let s = spec.shape;
        let page_bytes = s.page_bytes();
        let (sockets, peers) = mesh_sockets(spec.pp)?;
        let mut layers = Vec::new();
        let mut starts = Vec::new();
        let mut configs = Vec::new();
        for rank in 0..spec.pp {
            let range = split
                .layer_range(s.layers, spec.pp, rank)
                .map_err(|source| EngineError::Plan {
                    request: None,
                    source,
                })?;
            let layout = KvLayout::packed(
                range.start,
                range.len() as u32,
                s.regions,
                page_bytes,
                spec.prefill_pages,
            );
            let mut cfg = PrefillConfig::new(
                decode.local_addr(),
                rank,
                spec.pp,
                s.layers,
                s.page_tokens,
                layout.clone(),
            );
            cfg.backend = backend(Some(rank), &format!("prefill-{rank}-{tag}"));
            cfg.instance = instance.to_owned();
            cfg.peers = peers.clone();
            cfg.mesh_socket = sockets.get(usize::from(rank)).cloned();
            cfg.checksums = spec.checksums;
            cfg.token = Some(Secret::new(secret));
            cfg.metrics = spec.metrics;
            let buf = spec
                .decode_pool
                .pool(layout.buffer_len)
                .map_err(|e| EngineError::Config(format!("prefill pool: {e}")))?;
            layers.push(range);
            configs.push(cfg.clone());
            starts.push(tokio::spawn(PrefillEngine::start(cfg, buf)));
        }
        let mut prefill = Vec::new();
        for s in starts {
            prefill.push(
                s.await
                    .map_err(|e| EngineError::Config(format!("prefill start task: {e}")))??,
            );
        }
        Ok((prefill, layers, configs))
    }

    /// Runs one request: [`prepare`](Self::prepare)s it, decode expects it, every rank sends every
    /// chunk; waits for the outcome and every rank's decision.
    ///
    /// # Errors
    /// Engine errors on either side, or a page list outside a pool.
    pub async fn run_request(
        &self,
        request: RequestId,
        prompt_tokens: u32,
        chunk_tokens: u32,
        src_pages: &[u32],
        dst_pages: &[u32],
    ) -> Result<Outcome, EngineError> {
        self.prepare(request, src_pages, dst_pages)
            .map_err(|e| EngineError::Config(format!("preparing {request:?}: {e}")))?;
        let done = self.decode.expect(
            request,
            prompt_tokens,
            chunk_tokens,
            dst_pages.to_vec(),
            Duration::from_secs(30),
        )?;
        let chunks = prompt_tokens.div_ceil(chunk_tokens);
        let mut sends = Vec::new();
        for p in &self.prefill {
            let p = p.clone();
            let src = src_pages.to_vec();
            sends.push(tokio::spawn(async move {
                for c in 0..chunks {
                    if let Err(e) = p.send_chunk(request, c, &src, c + 1 == chunks).await {
                        p.fail(request, FailureCode::WriteFailed);
                        return Err(e);
                    }
                }
                p.decided(request).await;
                p.release(request);
                Ok(())
            }));
        }
        let outcome = done.await;
        for s in sends {
            s.await
                .map_err(|e| EngineError::Config(format!("send task: {e}")))??;
        }
        Ok(outcome)
    }

    /// Takes prefill rank `rank`'s engine out of the cluster; dropping it ends its connections, as
    /// when its process dies. Until [`start_rank`](Self::start_rank) puts a new start back,
    /// `prefill` lacks the rank (the ranks above it sit one place lower).
    pub fn take_rank(&mut self, rank: u16) -> PrefillEngine {
        self.prefill.remove(usize::from(rank))
    }

    /// Starts prefill rank `rank` again, after [`take_rank`](Self::take_rank), with a fresh pool,
    /// the same secret and vote mesh port, and `incarnation` (a fresh one for `None`); returns the
    /// incarnation.
    ///
    /// # Errors
    /// The start failed (the rank then stays out of `prefill`).
    pub async fn start_rank(
        &mut self,
        rank: u16,
        incarnation: Option<u64>,
    ) -> Result<u64, EngineError> {
        let i = usize::from(rank);
        let mut cfg = self
            .configs
            .get(i)
            .cloned()
            .ok_or_else(|| EngineError::Config(format!("no rank {rank}")))?;
        cfg.incarnation = incarnation.unwrap_or_else(transfer_engine::engine::fresh_incarnation);
        let pool = self
            .spec
            .decode_pool
            .pool(cfg.layout.buffer_len)
            .map_err(|e| EngineError::Config(format!("prefill pool: {e}")))?;
        let inc = cfg.incarnation;
        let engine = PrefillEngine::start(cfg, pool).await?;
        self.prefill.insert(i.min(self.prefill.len()), engine);
        Ok(inc)
    }

    /// Instance `k`'s name (as decode serves it) and ranks.
    pub fn pipeline(&self, k: usize) -> Option<(&str, &[PrefillEngine])> {
        let name = self.instance_names.get(k)?;
        let ranks = match k {
            0 => &self.prefill,
            k => self.others.get(k - 1)?,
        };
        Some((name.as_str(), ranks.as_slice()))
    }

    /// The decode pool's layout.
    pub fn decode_layout(&self) -> KvLayout {
        let s = self.spec.shape;
        KvLayout::packed(
            0,
            s.layers,
            s.regions,
            s.page_bytes(),
            self.spec.decode_pages,
        )
    }

    /// Rank `rank`'s pool layout.
    ///
    /// # Panics
    /// `rank` is not below the PP size.
    pub fn prefill_layout(&self, rank: u16) -> KvLayout {
        let s = self.spec.shape;
        let range = &self.layers[usize::from(rank)];
        KvLayout::packed(
            range.start,
            range.len() as u32,
            s.regions,
            s.page_bytes(),
            self.spec.prefill_pages,
        )
    }

    /// Bytes of the decode pool (what the decode transport registers).
    pub fn decode_pool_len(&self) -> u64 {
        self.decode_layout().buffer_len
    }

    /// Bytes of rank `rank`'s pool (what its transport registers).
    pub fn prefill_pool_len(&self, rank: u16) -> u64 {
        self.prefill_layout(rank).buffer_len
    }

    /// Readies `request` for sending: every rank writes the request's pattern into its `src_pages`
    /// (one per page of the prompt), and decode poisons `dst_pages`. Call it before decode's
    /// `expect`, while no chunk in flight reads those source pages and no live request holds those
    /// destination pages.
    ///
    /// # Errors
    /// A page outside a pool.
    pub fn prepare(
        &self,
        request: RequestId,
        src_pages: &[u32],
        dst_pages: &[u32],
    ) -> Result<(), VerifyError> {
        self.prepare_in(0, request, src_pages, dst_pages)
    }

    /// [`prepare`](Self::prepare) on the ranks of instance `instance` (an index into
    /// [`instances`](Self::instances)).
    ///
    /// # Errors
    /// A page outside a pool, or no such instance.
    pub fn prepare_in(
        &self,
        instance: usize,
        request: RequestId,
        src_pages: &[u32],
        dst_pages: &[u32],
    ) -> Result<(), VerifyError> {
        self.prepare_at(instance, 0, request, src_pages, dst_pages)
    }

    /// Decode engine `m`: 0 is [`decode`](Self::decode), then [`other_decodes`](Self::other_decodes).
    pub fn decode_at(&self, m: usize) -> Option<&DecodeEngine> {
        match m {
            0 => Some(&self.decode),
            _ => self.other_decodes.get(m - 1),
        }
    }

    /// Every decode engine, the first one first.
    pub fn decodes(&self) -> impl Iterator<Item = &DecodeEngine> {
        std::iter::once(&self.decode).chain(&self.other_decodes)
    }

    /// [`prepare_in`](Self::prepare_in) with the destination in decode engine `decode`
    /// ([`decode_at`](Self::decode_at)).
    ///
    /// # Errors
    /// A page outside a pool, or no such instance or decode.
    pub fn prepare_at(
        &self,
        instance: usize,
        decode: usize,
        request: RequestId,
        src_pages: &[u32],
        dst_pages: &[u32],
    ) -> Result<(), VerifyError> {
        let (_, ranks) = self
            .pipeline(instance)
            .ok_or_else(|| VerifyError::Pages(format!("no prefill instance {instance}")))?;
        let d = self
            .decode_at(decode)
            .ok_or_else(|| VerifyError::Pages(format!("no decode engine {decode}")))?;
        for (rank, p) in ranks.iter().enumerate() {
            let layout = self.prefill_layout(rank as u16);
            verify::write_source(&layout, request, rank as u16, src_pages, |at, b| {
                p.write_pool(at, b)
            })?;
        }
        verify::poison(&self.decode_layout(), dst_pages, |at, b| {
            d.write_pool(at, b)
        })
    }

    /// Sends chunks `chunks` of `request` from `rank`, one after the other, marking chunk
    /// `total - 1` LAST. Stops at the first error and returns it with the chunk it failed on.
    ///
    /// # Errors
    /// The first `send_chunk` error.
    pub async fn send_chunks(
        &self,
        rank: u16,
        request: RequestId,
        chunks: std::ops::Range<u32>,
        total: u32,
        src_pages: &[u32],
    ) -> Result<(), (u32, EngineError)> {
        let p = &self.prefill[usize::from(rank)];
        for c in chunks {
            p.send_chunk(request, c, src_pages, c + 1 == total)
                .await
                .map_err(|e| (c, e))?;
        }
        Ok(())
    }

    /// Waits up to `within` until nothing is left over: no request tracked by decode, none undecided
    /// on any rank, no chunk in flight in any transport, and every transport's registered bytes back
    /// to exactly its pool. Returns what was still left at the bound.
    ///
    /// # Errors
    /// A description of every counter that had not settled.
    pub async fn wait_quiescent(&self, within: Duration) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let left = self.leftovers();
            if left.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(left.join("; "));
            }
            // Counters settle on the transports' progress threads; poll them.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn leftovers(&self) -> Vec<String> {
        let mut left = Vec::new();
        let d = self.decode.stats();
        if d.in_flight != 0 {
            left.push(format!("decode tracks {} requests", d.in_flight));
        }
        if d.registered_bytes != self.decode_pool_len() {
            left.push(format!(
                "decode registers {} bytes, its pool is {}",
                d.registered_bytes,
                self.decode_pool_len()
            ));
        }
        for (rank, p) in self.prefill.iter().enumerate() {
            let (s, t) = (p.stats(), p.transport_stats());
            let want = self.prefill_pool_len(rank as u16);
            if s.undecided != 0 {
                left.push(format!("rank {rank}: {} undecided", s.undecided));
            }
            if t.in_flight != 0 {
                left.push(format!("rank {rank}: {} chunks in flight", t.in_flight));
            }
            if t.registered_bytes != want || s.registered_bytes != want {
                left.push(format!(
                    "rank {rank} registers {} bytes, its pool is {want}",
                    t.registered_bytes
                ));
            }
        }
        left
    }

    /// Checks every byte of a completed request in `dst_pages` of the decode pool against the pattern
    /// [`prepare`](Self::prepare) wrote for it, copying the pages out. Returns the bytes checked.
    ///
    /// # Errors
    /// The first page that differs.
    pub fn verify(&self, request: RequestId, dst_pages: &[u32]) -> Result<u64, VerifyError> {
        self.verify_at(0, request, dst_pages)
    }

    /// [`verify`](Self::verify) in decode engine `decode` ([`decode_at`](Self::decode_at)).
    ///
    /// # Errors
    /// The first page that differs, or no such decode.
    pub fn verify_at(
        &self,
        decode: usize,
        request: RequestId,
        dst_pages: &[u32],
    ) -> Result<u64, VerifyError> {
        let d = self
            .decode_at(decode)
            .ok_or_else(|| VerifyError::Pages(format!("no decode engine {decode}")))?;
        verify::check(
            &self.decode_layout(),
            &self.layers,
            request,
            dst_pages,
            |at, b| d.read_pool(at, b),
        )
    }
}
