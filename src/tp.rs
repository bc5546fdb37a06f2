//! kvbench's run with different TP sizes on the two sides, in one process: one decode engine per
//! decode TP rank of each decode instance, and one engine per prefill (PP, TP) rank of each
//! prefill instance, which writes into every decode TP rank it shares heads with
//! (`core::topology::targets`), of every decode instance, from its one registration. GQA heads are
//! sliced (or replicated, with fewer KV heads than ranks); MLA latents go whole. Requests go to
//! the (prefill instance, decode instance) pairs in turn.
//!
//! A request's bytes are named by the request and the global KV head (0 for MLA's latent): the
//! bytes of head `h` for token `t` of region `g` of layer `l` are the pattern of stream (request,
//! `h`) at `((l * regions + g) * span + t) * head_bytes`, `span` the tokens a request's pages span
//! on either side. So every decode TP rank's pages are checked against exactly the heads it holds,
//! whichever prefill rank wrote them and whatever the page sizes on the two sides. Sources are
//! written and destinations poisoned before a
//! wave, and checked after it, outside the timed window.

use crate::cluster::Shape;
use crate::verify::{self, POISON, VerifyError};
use std::time::{Duration, Instant};
use transfer_engine::control::Secret;
use transfer_engine::control::TpMode;
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::{HeadLayout, HeadOrder, KvLayout, PpSplit};
use transfer_engine::core::topology::{self, TpShape};
use transfer_engine::engine::{
    BackendConfig, DecodeConfig, DecodeEngine, EngineError, Expected, Outcome, Pool, PrefillConfig,
    PrefillEngine, TpConfig,
};
use transfer_engine::transport::BackendKind;

/// The TP part of a workload (`--prefill-tp`, `--decode-tp`, `--kv-heads`,
/// `--decode-page-tokens`): what a multi-process run's decode tells its prefill roles beside the
/// rest of the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TpPlan {
    /// Prefill TP size.
    pub prefill_tp: u16,
    /// Decode TP size.
    pub decode_tp: u16,
    /// The model's KV heads (0 for MLA).
    pub kv_heads: u32,
    /// Tokens in a decode page.
    pub decode_page_tokens: u32,
}

impl TpPlan {
    /// The identical-TP run a mapping is measured against: decode's TP size on both sides, the
    /// model's `page_tokens` on decode too.
    pub fn identical(self, page_tokens: u32) -> TpPlan {
        TpPlan {
            prefill_tp: self.decode_tp,
            decode_page_tokens: page_tokens,
            ..self
        }
    }
}

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct TpSpec {
    /// The model (for GQA, `bytes_per_token` is the whole model's, all heads).
    pub shape: Shape,
    /// The model's KV heads (0 for MLA).
    pub kv_heads: u32,
    /// Prefill PP size.
    pub pp: u16,
    /// Prefill TP size.
    pub prefill_tp: u16,
    /// Decode TP size.
    pub decode_tp: u16,
    /// Tokens in a decode page (the shape's `page_tokens` are prefill's); where they differ, the
    /// prompt must be whole pages on both sides.
    pub decode_page_tokens: u32,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Chunk tokens.
    pub chunk_tokens: u32,
    /// Requests in flight at once (each in its own pages).
    pub concurrency: u32,
    /// Requests.
    pub requests: u32,
    /// Prefill instances (each `pp` × `prefill_tp` ranks; 0 counts as 1).
    pub prefill_instances: u16,
    /// Decode instances (each `decode_tp` ranks; 0 counts as 1).
    pub decode_instances: u16,
    /// Backend.
    pub backend: BackendKind,
    /// How the decode engines' progress threads run.
    pub decode_progress: crate::cluster::DecodeProgress,
}

/// What a run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TpReport {
    /// Backend name.
    pub backend: String,
    /// Prefill TP size.
    pub prefill_tp: u16,
    /// Decode TP size.
    pub decode_tp: u16,
    /// Tokens in a prefill page.
    pub prefill_page_tokens: u32,
    /// Tokens in a decode page.
    pub decode_page_tokens: u32,
    /// The model's KV bytes of each request (every head of every layer, counted once: MLA's
    /// copies in several decode TP ranks count once), over the timed windows, GB/s.
    pub gbps: f64,
    /// Requests run (all completed and verified, or the run fails).
    pub requests: u64,
    /// Writes of one request, all prefill engines together, after coalescing (a write of many
    /// rows, as sliced heads in token-major pages are, counts once).
    pub writes_per_request: u64,
    /// The contiguous pieces those writes are made of (a write of `n` rows counts `n`).
    pub rows_per_request: u64,
    /// Chunks, all prefill engines together, that waited for decode to free their landing range
    /// (`PrefillStats::landing_waits`), over the run.
    pub landing_waits: u64,
    /// Prefill instances.
    pub prefill_instances: u16,
    /// Decode instances.
    pub decode_instances: u16,
    /// Engines in this process: decode TP ranks plus prefill (PP, TP) ranks, of every instance.
    pub engines: u64,
    /// The most registrations any engine's transport holds (1: each pool registered once).
    pub registrations_per_process: u64,
    /// Every byte of every decode rank's pages of every request matched.
    pub verified: bool,
}

impl TpSpec {
    /// The spec of `w` with its TP part `plan`, on `backend`.
    pub fn of(w: &crate::bench::Workload, plan: TpPlan, backend: BackendKind) -> Self {
        TpSpec {
            shape: w.shape,
            kv_heads: plan.kv_heads,
            pp: w.pp,
            prefill_tp: plan.prefill_tp,
            decode_tp: plan.decode_tp,
            decode_page_tokens: plan.decode_page_tokens,
            prompt_tokens: w.prompt_tokens,
            chunk_tokens: w.chunk_tokens,
            concurrency: w.concurrency,
            requests: w.requests,
            prefill_instances: w.prefill_instances,
            decode_instances: w.decode_instances,
            backend,
            decode_progress: w.decode_progress,
        }
    }

    /// The prefill instances' names as decode serves them: `""` (decode's default instance)
    /// where there is one.
    fn prefill_names(&self) -> Vec<String> {
        match self.prefill_instances {
            0 | 1 => vec![String::new()],
            n => (0..n).map(|k| format!("prefill-{k}")).collect(),
        }
    }

    /// The (prefill instance, decode instance) pair request `n` (counted from 0) goes to: every
    /// pair in turn.
    pub fn pair_of(&self, n: u32) -> (usize, usize) {
        let (p, d) = (
            u32::from(self.prefill_instances.max(1)),
            u32::from(self.decode_instances.max(1)),
        );
        let k = n % (p * d);
        ((k / d) as usize, (k % d) as usize)
    }

    fn mode(&self) -> TpMode {
        if self.kv_heads == 0 {
            TpMode::Replicated
        } else {
            TpMode::HeadSliced
        }
    }

    fn shape(&self, tp: u16) -> TpShape {
        TpShape {
            tp_size: u32::from(tp),
            kv_heads: self.kv_heads,
        }
    }

    /// The TP settings of rank `rank` of a side of TP size `size`.
    pub fn tp(&self, rank: u16, size: u16) -> TpConfig {
        TpConfig {
            rank,
            size,
            mode: self.mode(),
            kv_heads: self.kv_heads,
        }
    }

    /// Bytes of one head for one token in one region (MLA: the whole latent).
    fn head_bytes(&self) -> u64 {
        let per_region = self.shape.bytes_per_token / u64::from(self.shape.regions.count());
        per_region / u64::from(self.kv_heads.max(1))
    }

    /// The global heads rank `rank` of a side of TP size `tp` holds (MLA: the one latent, 0).
    pub fn held(&self, tp: u16, rank: u16) -> std::ops::Range<u32> {
        if self.kv_heads == 0 {
            0..1
        } else {
            self.shape(tp).heads_of(u32::from(rank))
        }
    }

    /// Pages of `page_tokens` a prompt fills.
    pub fn pages(&self, page_tokens: u32) -> u32 {
        self.prompt_tokens.div_ceil(page_tokens.max(1))
    }

    /// The tokens a request's pages span on either side (the head streams' length per layer and
    /// region).
    fn span(&self) -> u64 {
        [self.shape.page_tokens, self.decode_page_tokens]
            .into_iter()
            .map(|pt| u64::from(self.pages(pt)) * u64::from(pt))
            .max()
            .unwrap_or(0)
    }

    /// Landing memory a decode rank lends (NIXL, rows sliced in its pages: see
    /// `DecodeConfig::landing_bytes`) to `concurrency` requests at once, none where prefill TP is
    /// not above decode's (MLA, or rows whole at decode): each leg takes one stride per slot
    /// (`DEFAULT_LANDING_SLOTS`, or the prompt's chunks if fewer), a whole chunk's bytes of its
    /// rows (64-byte aligned), so a rank takes its share of that many chunks of `concurrency`
    /// prompts, and the alignment of every leg's slots.
    pub fn landing_bytes(&self) -> u64 {
        // Rows land strided only where each decode rank takes parts of them from several ranks.
        if self.kv_heads == 0 || self.prefill_tp <= self.decode_tp {
            return 0;
        }
        // Each leg holds the engine's default slot count of chunks (its chunks, if fewer).
        let slots = self
            .prompt_tokens
            .div_ceil(self.chunk_tokens.max(1))
            .min(transfer_engine::engine::DEFAULT_LANDING_SLOTS);
        let per_rank = self
            .shape
            .request_bytes(slots.saturating_mul(self.chunk_tokens))
            / u64::from(self.decode_tp.max(1));
        let legs = u64::from(self.prefill_tp) * u64::from(self.pp);
        (per_rank + legs * u64::from(slots) * 64) * u64::from(self.concurrency.max(1))
    }

    /// The layout of a rank at TP size `tp` holding `layers` from `first`, in pages of
    /// `page_tokens`, `concurrency` requests' pages.
    fn layout(&self, tp: u16, first: u32, layers: u32, page_tokens: u32) -> KvLayout {
        self.layout_slots(tp, first, layers, page_tokens, self.concurrency.max(1))
    }

    /// [`layout`](Self::layout) with room for `slots` requests' pages.
    pub fn layout_slots(
        &self,
        tp: u16,
        first: u32,
        layers: u32,
        page_tokens: u32,
        slots: u32,
    ) -> KvLayout {
        let held = self.held(tp, 0).len() as u64;
        let page_bytes = held * self.head_bytes() * u64::from(page_tokens);
        let l = KvLayout::packed(
            first,
            layers,
            self.shape.regions,
            page_bytes,
            self.pages(page_tokens) * slots,
        );
        if self.kv_heads == 0 {
            return l;
        }
        l.with_heads(HeadLayout {
            num_heads: held as u32,
            head_bytes: self.head_bytes(),
            page_tokens,
            order: HeadOrder::TokenMajor,
        })
    }

    /// Checks what topology needs of the spec.
    ///
    /// # Errors
    /// Heads that do not split over a TP size, an empty size, bytes that do not split into heads.
    pub fn validate(&self) -> Result<(), String> {
        for tp in [self.prefill_tp, self.decode_tp] {
            self.shape(tp).validate().map_err(|e| e.to_string())?;
        }
        let per_region = self.shape.bytes_per_token / u64::from(self.shape.regions.count());
        if self.kv_heads > 0 && !per_region.is_multiple_of(u64::from(self.kv_heads)) {
            return Err(format!(
                "{per_region} bytes per token and region do not split into {} heads",
                self.kv_heads
            ));
        }
        if self.prompt_tokens == 0 || self.chunk_tokens == 0 || self.requests == 0 {
            return Err("prompt, chunk and request counts must be positive".into());
        }
        let (ps, pd) = (self.shape.page_tokens, self.decode_page_tokens);
        if pd == 0 {
            return Err("decode pages of 0 tokens".into());
        }
        if ps != pd
            && !(self.prompt_tokens.is_multiple_of(ps) && self.prompt_tokens.is_multiple_of(pd))
        {
            return Err(format!(
                "a {}-token prompt is not whole pages of {ps} and of {pd} tokens: with page sizes \
                 that differ, every page is checked whole",
                self.prompt_tokens
            ));
        }
        Ok(())
    }
}

impl TpSpec {
    /// The decode TP ranks prefill TP rank `t` writes into, in rank order (none: MLA's latent
    /// has one writer per decode rank, so some prefill ranks write nowhere).
    ///
    /// # Errors
    /// A rank or shape topology refuses.
    pub fn targets(&self, t: u16) -> Result<Vec<u16>, String> {
        let targets = topology::targets(
            self.shape(self.prefill_tp),
            self.shape(self.decode_tp),
            u32::from(t),
        )
        .map_err(|e| e.to_string())?;
        targets
            .into_iter()
            .map(|(d, _)| u16::try_from(d).map_err(|_| format!("decode rank {d}")))
            .collect()
    }

    /// The prefill TP ranks that write somewhere: the ones a run starts.
    ///
    /// # Errors
    /// As [`targets`](Self::targets).
    pub fn writing_ranks(&self) -> Result<Vec<u16>, String> {
        let mut out = Vec::new();
        for t in 0..self.prefill_tp {
            if !self.targets(t)?.is_empty() {
                out.push(t);
            }
        }
        Ok(out)
    }

    /// Writes `request`'s bytes, as prefill TP rank `t` holding `layers` has them, into `pages`
    /// of its pool `layout` through `write(offset, bytes)`. Call it only while no chunk in flight
    /// reads those pages.
    ///
    /// # Errors
    /// The first error `write` returns.
    pub fn write_source<E: std::fmt::Display>(
        &self,
        t: u16,
        layout: &KvLayout,
        layers: std::ops::Range<u32>,
        request: RequestId,
        pages: &[u32],
        mut write: impl FnMut(u64, &[u8]) -> Result<(), E>,
    ) -> Result<(), VerifyError> {
        let mut buf = vec![0u8; self.head_bytes() as usize];
        for_each_head_run(
            self,
            self.shape.page_tokens,
            layout,
            self.held(self.prefill_tp, t),
            layers,
            pages,
            |at, head, off, len| {
                verify::fill(request, stream(head), off, &mut buf[..len]);
                write(at, &buf[..len]).map_err(|e| VerifyError::Pool(e.to_string()))
            },
        )
    }

    /// Checks decode TP rank `d`'s `pages` of its pool `layout` against `request`'s bytes of the
    /// heads it holds, reading through `read(offset, buffer)`; returns the bytes checked.
    ///
    /// # Errors
    /// The first head that differs ([`VerifyError::Head`]), or the first error `read` returns.
    pub fn check_rank<E: std::fmt::Display>(
        &self,
        d: u16,
        layout: &KvLayout,
        request: RequestId,
        pages: &[u32],
        mut read: impl FnMut(u64, &mut [u8]) -> Result<(), E>,
    ) -> Result<u64, VerifyError> {
        let hb = self.head_bytes() as usize;
        let (mut got, mut want) = (vec![0u8; hb], vec![0u8; hb]);
        let mut checked = 0;
        for_each_head_run(
            self,
            self.decode_page_tokens,
            layout,
            self.held(self.decode_tp, d),
            0..self.shape.layers,
            pages,
            |at, head, off, len| {
                read(at, &mut got[..len]).map_err(|e| VerifyError::Pool(e.to_string()))?;
                verify::fill(request, stream(head), off, &mut want[..len]);
                if got[..len] != want[..len] {
                    return Err(VerifyError::Head {
                        rank: d,
                        head,
                        offset: at,
                        still_poisoned: got[..len].iter().all(|&b| b == POISON),
                    });
                }
                checked += len as u64;
                Ok(())
            },
        )?;
        Ok(checked)
    }
}

/// Where (region, layer, token) of a request lies in a head's stream: the same on both sides,
/// whatever their page sizes.
fn stream_offset(s: &TpSpec, region: u32, layer: u32, token: u64) -> u64 {
    ((u64::from(layer) * u64::from(s.shape.regions.count()) + u64::from(region)) * s.span() + token)
        * s.head_bytes()
}

/// The stream id of global head `head` (the pattern's "rank").
fn stream(head: u32) -> u16 {
    head as u16
}

/// Writes (`write`) or checks (`check`) a rank's pages of one request (pages of `page_tokens`):
/// for every region, layer of `layers`, page position and token, the held heads' bytes.
fn for_each_head_run<E>(
    s: &TpSpec,
    page_tokens: u32,
    layout: &KvLayout,
    held: std::ops::Range<u32>,
    layers: std::ops::Range<u32>,
    pages: &[u32],
    mut run: impl FnMut(u64, u32, u64, usize) -> Result<(), E>,
) -> Result<(), E> {
    let hb = s.head_bytes();
    let n_held = held.len() as u64;
    for region in 0..s.shape.regions.count() {
        for layer in layers.clone() {
            let local = layer - layout.first_layer;
            for (pos, &page) in pages.iter().enumerate() {
                let base = layout.base_offset
                    + u64::from(region) * layout.region_stride
                    + u64::from(local) * layout.layer_stride
                    + u64::from(page) * layout.page_bytes;
                let first = pos as u64 * u64::from(page_tokens);
                for t in 0..u64::from(page_tokens) {
                    let origin = stream_offset(s, region, layer, first + t);
                    for (k, head) in held.clone().enumerate() {
                        let at = base + (t * n_held + k as u64) * hb;
                        run(at, head, origin, hb as usize)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// A running heterogeneous-TP cluster.
#[derive(Debug)]
pub struct TpCluster {
    spec: TpSpec,
    /// By decode instance, then decode TP rank.
    decodes: Vec<Vec<DecodeEngine>>,
    /// By prefill instance, its ranks.
    prefills: Vec<Vec<PrefillRank>>,
    /// The prefill instances' names, as decode serves them ([`TpSpec::prefill_names`]).
    names: Vec<String>,
}

/// (PP rank, prefill TP rank, its layer range, engine).
type PrefillRank = (u16, u16, std::ops::Range<u32>, PrefillEngine);

impl TpCluster {
    /// Starts every engine.
    ///
    /// # Errors
    /// Any engine start failure, or a spec that does not map.
    pub async fn start(spec: TpSpec) -> Result<Self, EngineError> {
        spec.validate().map_err(EngineError::Config)?;
        let secret: Vec<u8> = (0..32).map(|_| rand::random::<u8>()).collect();
        let tag = format!("{}-tp{}", std::process::id(), rand::random::<u32>());
        let s = spec.shape;
        let names = spec.prefill_names();
        // One prefill instance is decode's default one; several are named sessions.
        let default_pp = if names.len() == 1 { spec.pp } else { 0 };
        let mut decodes = Vec::new();
        for j in 0..spec.decode_instances.max(1) {
            let mut ranks = Vec::new();
            for rank in 0..spec.decode_tp {
                let layout = spec.layout(spec.decode_tp, 0, s.layers, spec.decode_page_tokens);
                let mut cfg = DecodeConfig::new(
                    s.layers,
                    spec.decode_page_tokens,
                    layout.clone(),
                    default_pp,
                );
                cfg.tp = spec.tp(rank, spec.decode_tp);
                cfg.prefill_tp = Some(spec.prefill_tp);
                cfg.landing_bytes = spec.landing_bytes();
                cfg.token = Some(Secret::new(&secret));
                cfg.verify_checksums = false;
                cfg.instance = format!("decode-{j}");
                cfg.backend = spec
                    .decode_progress
                    .apply(BackendConfig::default_for_decode(
                        spec.backend,
                        &format!("d{j}-{rank}-{tag}"),
                    ));
                let d = DecodeEngine::start(cfg, Pool::Shared(layout.buffer_len)).await?;
                if names.len() > 1 {
                    for name in &names {
                        d.add_instance(name, spec.pp, spec.prefill_tp)?;
                    }
                }
                ranks.push(d);
            }
            decodes.push(ranks);
        }
        let mut starts = Vec::new();
        for (k, name) in names.iter().enumerate() {
            for t in 0..spec.prefill_tp {
                let targets = spec.targets(t).map_err(EngineError::Config)?;
                // A rank that writes nowhere (MLA: one rank writes each decode rank's latent) runs
                // no engine.
                let mut addrs = decodes
                    .iter()
                    .flat_map(|ranks| targets.iter().map(|d| ranks[usize::from(*d)].local_addr()));
                let Some(first) = addrs.next() else {
                    continue;
                };
                let rest: Vec<_> = addrs.collect();
                let (sockets, peers) = crate::cluster::mesh_sockets(spec.pp)?;
                for pp in 0..spec.pp {
                    let range = PpSplit::SglangEven
                        .layer_range(s.layers, spec.pp, pp)
                        .map_err(|source| EngineError::Plan {
                            request: None,
                            source,
                        })?;
                    let layout = spec.layout(
                        spec.prefill_tp,
                        range.start,
                        range.len() as u32,
                        s.page_tokens,
                    );
                    let mut cfg = PrefillConfig::new(
                        first,
                        pp,
                        spec.pp,
                        s.layers,
                        s.page_tokens,
                        layout.clone(),
                    );
                    cfg.tp = spec.tp(t, spec.prefill_tp);
                    cfg.engine_id = format!("p{k}-{pp}-t{t}-{tag}");
                    cfg.instance = name.clone();
                    cfg.backend = BackendConfig::default_for(spec.backend, &cfg.engine_id);
                    cfg.peers = peers.clone();
                    cfg.mesh_socket = sockets.get(usize::from(pp)).cloned();
                    cfg.token = Some(Secret::new(&secret));
                    cfg.checksums = false;
                    let pool = Pool::Shared(layout.buffer_len);
                    let start = tokio::spawn(PrefillEngine::start(cfg, pool));
                    starts.push((k, pp, t, range, start, rest.clone()));
                }
            }
        }
        let mut prefills: Vec<Vec<_>> = names.iter().map(|_| Vec::new()).collect();
        for (k, pp, t, range, s, rest) in starts {
            let e = s
                .await
                .map_err(|e| EngineError::Config(format!("prefill start task: {e}")))??;
            for addr in rest {
                e.add_decode(addr).await?;
            }
            prefills[k].push((pp, t, range, e));
        }
        for d in decodes.iter().flatten() {
            for name in &names {
                d.wait_for_instance(name, Duration::from_secs(30)).await?;
            }
        }
        Ok(TpCluster {
            spec,
            decodes,
            prefills,
            names,
        })
    }

    /// Writes `request`'s bytes into prefill instance `k`'s engines' `slot` pages and poisons
    /// decode instance `j`'s ranks'.
    fn prepare(&self, request: RequestId, slot: u32, (k, j): (usize, usize)) -> Result<(), String> {
        let s = &self.spec;
        let (pages, dst_pages) = (self.src_pages(slot), self.dst_pages(slot));
        for (_, t, range, e) in &self.prefills[k] {
            let layout = s.layout(
                s.prefill_tp,
                range.start,
                range.len() as u32,
                s.shape.page_tokens,
            );
            s.write_source(*t, &layout, range.clone(), request, &pages, |at, b| {
                e.write_pool(at, b)
            })
            .map_err(|e| e.to_string())?;
        }
        let dst = s.layout(s.decode_tp, 0, s.shape.layers, s.decode_page_tokens);
        for d in &self.decodes[j] {
            verify::poison(&dst, &dst_pages, |at, b| d.write_pool(at, b))
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Checks decode instance `j`'s ranks' `slot` pages against the heads each holds.
    fn check(&self, request: RequestId, slot: u32, j: usize) -> Result<(), String> {
        let s = &self.spec;
        let pages = self.dst_pages(slot);
        let layout = s.layout(s.decode_tp, 0, s.shape.layers, s.decode_page_tokens);
        for (rank, d) in self.decodes[j].iter().enumerate() {
            s.check_rank(rank as u16, &layout, request, &pages, |at, b| {
                d.read_pool(at, b)
            })
            .map_err(|e| format!("request {}: {e}", request.0))?;
        }
        Ok(())
    }

    /// A slot's pages on prefill.
    fn src_pages(&self, slot: u32) -> Vec<u32> {
        let n = self.spec.pages(self.spec.shape.page_tokens);
        (slot * n..(slot + 1) * n).collect()
    }

    /// A slot's pages on decode.
    fn dst_pages(&self, slot: u32) -> Vec<u32> {
        let n = self.spec.pages(self.spec.decode_page_tokens);
        (slot * n..(slot + 1) * n).collect()
    }

    /// Runs one request in `slot` from prefill instance `k` into decode instance `j`: every rank
    /// of that decode expects it, every engine of that prefill sends every chunk; returns once
    /// every decode rank's outcome is in.
    async fn one(
        &self,
        request: RequestId,
        slot: u32,
        (k, j): (usize, usize),
    ) -> Result<(), String> {
        let s = &self.spec;
        let (pages, dst_pages) = (self.src_pages(slot), self.dst_pages(slot));
        let instance = &self.names[k];
        let mut outcomes = Vec::new();
        for d in &self.decodes[j] {
            let want = Expected {
                instance: instance.clone(),
                prefix_tokens: 0,
                prompt_tokens: s.prompt_tokens,
                chunk_tokens: s.chunk_tokens,
                dst_pages: dst_pages.clone(),
                timeout: Duration::from_secs(60),
            };
            outcomes.push(d.expect_request(request, want).map_err(|e| e.to_string())?);
        }
        let chunks = s.prompt_tokens.div_ceil(s.chunk_tokens);
        let mut sends = tokio::task::JoinSet::new();
        for (_, _, _, e) in &self.prefills[k] {
            let (e, pages) = (e.clone(), pages.clone());
            sends.spawn(async move {
                for c in 0..chunks {
                    e.send_chunk(request, c, &pages, c + 1 == chunks).await?;
                }
                e.decided(request).await;
                e.release(request);
                Ok::<(), EngineError>(())
            });
        }
        for o in outcomes {
            if let Outcome::Failed(r) = o.await {
                return Err(format!("request {} failed: {r:?}", request.0));
            }
        }
        while let Some(r) = sends.join_next().await {
            r.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Runs the spec's requests in waves of `concurrency`, each wave prepared before and checked
    /// after its timed window; `progress` (if any) hears (requests done, requests) after each wave.
    ///
    /// # Errors
    /// A failed request or a byte that differs.
    pub async fn run(
        &self,
        progress: Option<&(dyn Fn(u64, u64) + Sync)>,
    ) -> Result<TpReport, String> {
        let s = &self.spec;
        let c = s.concurrency.max(1);
        let mut timed = Duration::ZERO;
        let mut done = 0u32;
        let counts = |p: &Self| {
            p.prefills
                .iter()
                .flatten()
                .fold((0u64, 0u64, 0u64), |(w, r, l), e| {
                    let st = e.3.stats();
                    (w + st.writes, r + st.write_rows, l + st.landing_waits)
                })
        };
        let before = counts(self);
        while done < s.requests {
            // Each request of a wave in a slot of its own, whichever pair it goes to.
            let wave: Vec<(RequestId, u32, (usize, usize))> = (0..c.min(s.requests - done))
                .map(|k| (RequestId(u64::from(done + k) + 1), k, s.pair_of(done + k)))
                .collect();
            for &(r, slot, pair) in &wave {
                self.prepare(r, slot, pair)?;
            }
            let t0 = Instant::now();
            let runs = wave.iter().map(|&(r, slot, pair)| self.one(r, slot, pair));
            for r in futures::future::join_all(runs).await {
                r?;
            }
            timed += t0.elapsed();
            for &(r, slot, (_, j)) in &wave {
                self.check(r, slot, j)?;
            }
            done += wave.len() as u32;
            if let Some(p) = progress {
                p(u64::from(done), u64::from(s.requests));
            }
        }
        let after = counts(self);
        let (writes, rows) = (after.0 - before.0, after.1 - before.1);
        let landing_waits = after.2 - before.2;
        let bytes = s.shape.request_bytes(s.prompt_tokens) * u64::from(s.requests);
        Ok(TpReport {
            backend: s.backend.to_string(),
            prefill_tp: s.prefill_tp,
            decode_tp: s.decode_tp,
            prefill_page_tokens: s.shape.page_tokens,
            decode_page_tokens: s.decode_page_tokens,
            gbps: bytes as f64 / timed.as_secs_f64().max(1e-9) / 1e9,
            requests: u64::from(s.requests),
            writes_per_request: writes / u64::from(s.requests),
            rows_per_request: rows / u64::from(s.requests),
            landing_waits,
            prefill_instances: s.prefill_instances.max(1),
            decode_instances: s.decode_instances.max(1),
            engines: (self.decodes.iter().flatten().count()
                + self.prefills.iter().flatten().count()) as u64,
            registrations_per_process: self
                .decodes
                .iter()
                .flatten()
                .map(|d| d.stats().registrations)
                .chain(
                    self.prefills
                        .iter()
                        .flatten()
                        .map(|p| p.3.transport_stats().regions),
                )
                .max()
                .unwrap_or(0),
            verified: true,
        })
    }

    /// Shuts every decode engine down.
    pub async fn shutdown(self) {
        for d in self.decodes.into_iter().flatten() {
            d.shutdown(Duration::from_secs(10)).await;
        }
    }
}
