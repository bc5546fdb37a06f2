//! `kvbench decode` and `kvbench prefill`: the same workload with every engine in its own process.
//!
//! The decode process drives: it waits for every rank, issues the requests (`--concurrency` at a time)
//! and checks those `--verify` asks for against their pattern ([`crate::verify`]), poisoning their
//! destination pages first. A prefill process serves whatever page allocations arrive, each from
//! source pages no other request in flight uses, writing the pattern of the requests decode will
//! check before sending them; it exits when the decode process closes.
//!
//! With TP sizes (`--prefill-tp`, `--decode-tp`, [`crate::tp`]), each decode TP rank is a process
//! of its own that drives the same requests (same ids, in the same order, into pages of its own),
//! and each prefill (TP, PP) rank that writes somewhere is one too, writing every decode TP rank
//! it shares heads with; bytes are checked per head on every decode rank.

use crate::bench::{Event, Ran, Report, Tally, Workload, drive};
use crate::tp::{TpPlan, TpSpec};
use crate::verify::{self, VerifyError};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use transfer_engine::control::Secret;
use transfer_engine::core::planner::{KvLayout, PpSplit, RegionKind};
use transfer_engine::core::{FailureCode, RequestId};
use transfer_engine::discovery::{self, EngineRecord, EtcdConfig, RecordRole};
use transfer_engine::engine::{
    BackendConfig, DecodeConfig, DecodeEngine, EngineError, Outcome, Pool, PrefillConfig,
    PrefillEngine,
};
use transfer_engine::mem::{HostBuffer, HostOptions};
use transfer_engine::transport::BackendKind;

/// How long a request waits for its slot's quarantined pages before the run gives up (once the
/// spare slots are taken).
const QUARANTINE_WAIT: Duration = Duration::from_secs(60);

/// Where each of the run's `--concurrency` slots keeps its pages in decode's pool. The pool holds as
/// many spare slots again: a slot whose pages stay quarantined (its request failed without every
/// rank's confirmation, as for a rank behind a half-open link, which may still be writing) moves to
/// a spare, as a server's allocator would hand out other pages, and the held pages are never used
/// again in the run.
struct Slots {
    w: Workload,
    /// Physical slot of each logical one, and the spares not taken yet.
    state: Mutex<(Vec<u32>, Vec<u32>)>,
}

impl Slots {
    fn new(w: &Workload) -> Self {
        let n = w.concurrency.max(1);
        Slots {
            w: w.clone(),
            state: Mutex::new(((0..n).collect(), (n..2 * n).rev().collect())),
        }
    }

    /// The pages of logical slot `slot` now.
    fn pages(&self, slot: u32) -> Vec<u32> {
        let at = lock(&self.state).0[slot as usize];
        self.w.dst_pages(at)
    }

    /// Moves `slot` to a spare; its new pages, or `None` when no spare is left.
    fn replace(&self, slot: u32) -> Option<Vec<u32>> {
        let mut st = lock(&self.state);
        let spare = st.1.pop()?;
        st.0[slot as usize] = spare;
        Some(self.w.dst_pages(spare))
    }
}

/// Set in the id of every request the decode process will check: a prefill process learns nothing
/// else about a request, and writes the pattern (which costs as much as the transfer) only for
/// these, so that unchecked requests measure the transfer alone.
pub const CHECKED_REQUEST: u64 = 1 << 63;

fn ranks_of(w: &Workload) -> Result<Vec<std::ops::Range<u32>>, String> {
    (0..w.pp)
        .map(|r| {
            PpSplit::SglangEven
                .layer_range(w.shape.layers, w.pp, r)
                .map_err(|e| e.to_string())
        })
        .collect()
}

/// Where the decode role listens, and whether it registers in etcd.
#[derive(Debug, Clone)]
pub enum Place {
    /// This address; registered in etcd too when given.
    Fixed(SocketAddr, Option<EtcdConfig>),
    /// Any free loopback port, registered in etcd.
    Etcd(EtcdConfig),
}

/// How a prefill role finds decode and its PP peers.
#[derive(Debug, Clone)]
pub enum Find {
    /// Every decode instance's control address (the first one's workload is served) and every
    /// rank's vote mesh address.
    Fixed(Vec<SocketAddr>, Vec<SocketAddr>),
    /// Through etcd (the rank registers itself there too).
    Etcd(Box<EtcdConfig>),
}

/// What the decode role tells its prefill roles in its Hello ([`DecodeConfig::app`], JSON): the
/// workload a prefill rank sizes its pool by and serves, so that a prefill role needs no workload
/// flags of its own.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Served {
    /// The model's layers.
    pub layers: u32,
    /// KV bytes per token per layer.
    pub bytes_per_token: u64,
    /// Tokens per page.
    pub page_tokens: u32,
    /// K and V in regions of their own.
    pub split_kv: bool,
    /// Prefill PP size.
    pub pp: u16,
    /// Prompt length.
    pub prompt_tokens: u32,
    /// Chunked-prefill size.
    pub chunk_tokens: u32,
    /// Requests in flight at once.
    pub concurrency: u32,
    /// Per-chunk checksums.
    pub checksums: bool,
    /// The transfer library.
    pub backend: String,
    /// Prefill instances (pipelines of `pp` ranks) every decode instance serves.
    pub prefill_instances: u16,
    /// Decode instances every prefill rank serves.
    pub decode_instances: u16,
    /// TP sizes and decode's page size, where the run sets them.
    #[serde(default)]
    pub tp: Option<TpPlan>,
}

/// The name prefill instance `k` of a run with several goes by (its ranks' `instance`, the one
/// decode adds); a run of one instance uses decode's default, unnamed one.
pub fn instance_name(k: u16) -> String {
    format!("prefill-{k}")
}

impl Served {
    /// What a run of `w` on `backend` serves.
    pub fn of(w: &Workload, backend: BackendKind) -> Self {
        Served {
            layers: w.shape.layers,
            bytes_per_token: w.shape.bytes_per_token,
            page_tokens: w.shape.page_tokens,
            split_kv: w.shape.regions == RegionKind::SplitKv,
            pp: w.pp,
            prompt_tokens: w.prompt_tokens,
            chunk_tokens: w.chunk_tokens,
            concurrency: w.concurrency,
            checksums: w.checksums,
            backend: backend.to_string(),
            prefill_instances: w.prefill_instances.max(1),
            decode_instances: w.decode_instances.max(1),
            tp: w.tp,
        }
    }

    /// Each field in which `mine` (this process's flags) differs from this workload and that a
    /// flag in `given` set, named by its flag with both values.
    pub fn differences(&self, mine: &Served, given: &[&str]) -> Vec<String> {
        let set = |flags: &[&str]| flags.iter().any(|f| given.contains(f));
        let shape = [
            "--model",
            "--layers",
            "--bytes-per-token",
            "--split-kv",
            "--page-tokens",
        ];
        let fields: [(&[&str], &str, String, String); 13] = [
            (
                &shape,
                "layers",
                mine.layers.to_string(),
                self.layers.to_string(),
            ),
            (
                &shape,
                "bytes per token",
                mine.bytes_per_token.to_string(),
                self.bytes_per_token.to_string(),
            ),
            (
                &shape,
                "page tokens",
                mine.page_tokens.to_string(),
                self.page_tokens.to_string(),
            ),
            (
                &shape,
                "split K/V",
                mine.split_kv.to_string(),
                self.split_kv.to_string(),
            ),
            (
                &["--pp", "--pp-size"],
                "PP size",
                mine.pp.to_string(),
                self.pp.to_string(),
            ),
            (
                &["--prompt-tokens"],
                "--prompt-tokens",
                mine.prompt_tokens.to_string(),
                self.prompt_tokens.to_string(),
            ),
            (
                &["--chunk-tokens"],
                "--chunk-tokens",
                mine.chunk_tokens.to_string(),
                self.chunk_tokens.to_string(),
            ),
            (
                &["--concurrency"],
                "--concurrency",
                mine.concurrency.to_string(),
                self.concurrency.to_string(),
            ),
            (
                &["--checksums"],
                "--checksums",
                mine.checksums.to_string(),
                self.checksums.to_string(),
            ),
            (
                &["--backend"],
                "--backend",
                mine.backend.clone(),
                self.backend.clone(),
            ),
            (
                &["--prefill-instances"],
                "--prefill-instances",
                mine.prefill_instances.to_string(),
                self.prefill_instances.to_string(),
            ),
            (
                &["--decode-instances"],
                "--decode-instances",
                mine.decode_instances.to_string(),
                self.decode_instances.to_string(),
            ),
            (
                &[
                    "--prefill-tp",
                    "--decode-tp",
                    "--kv-heads",
                    "--decode-page-tokens",
                ],
                "TP",
                format!("{:?}", mine.tp),
                format!("{:?}", self.tp),
            ),
        ];
        fields
            .into_iter()
            .filter(|(flags, _, m, d)| set(flags) && m != d)
            .map(|(_, name, m, d)| format!("{name} {m} here, decode runs {d}"))
            .collect()
    }

    /// `w` with this workload in place of its own, and the backend.
    ///
    /// # Errors
    /// A workload no run could have (decode's own checks refuse it), or an unknown backend.
    pub fn apply(&self, w: &Workload) -> Result<(Workload, BackendKind), String> {
        let backend = match self.backend.as_str() {
            "ucx" => BackendKind::Ucx,
            "nixl" => BackendKind::Nixl,
            other => return Err(format!("decode runs backend {other:?}, unknown here")),
        };
        let regions = if self.split_kv {
            RegionKind::SplitKv
        } else {
            RegionKind::Fused
        };
        let valid = self.layers > 0
            && self.page_tokens > 0
            && self.bytes_per_token > 0
            && self
                .bytes_per_token
                .is_multiple_of(u64::from(regions.count()))
            && self.pp > 0
            && u32::from(self.pp) <= self.layers
            && self.prompt_tokens > 0
            && self.chunk_tokens > 0
            && self.concurrency > 0
            && self.prefill_instances > 0
            && self.decode_instances > 0;
        // The pool a prefill rank holds: a request's pages for each slot of every decode instance
        // and one more each, of every layer and region; a count that does not fit is no run's.
        let pages = self.prompt_tokens.div_ceil(self.page_tokens.max(1));
        let pool = self
            .concurrency
            .checked_add(1)
            .and_then(|slots| slots.checked_mul(u32::from(self.decode_instances)))
            .and_then(|slots| pages.checked_mul(slots))
            .and_then(|p| {
                (self.bytes_per_token / u64::from(regions.count()))
                    .checked_mul(u64::from(self.page_tokens))?
                    .checked_mul(u64::from(p))?
                    .checked_mul(u64::from(regions.count()))?
                    .checked_mul(u64::from(self.layers))
            });
        if !valid || pool.is_none_or(|b| usize::try_from(b).is_err()) {
            return Err(format!(
                "decode's workload is not one a run can have: {self:?}"
            ));
        }
        let mut w = w.clone();
        w.shape = crate::cluster::Shape {
            layers: self.layers,
            bytes_per_token: self.bytes_per_token,
            page_tokens: self.page_tokens,
            regions,
        };
        w.pp = self.pp;
        w.prompt_tokens = self.prompt_tokens;
        w.chunk_tokens = self.chunk_tokens;
        w.concurrency = self.concurrency;
        w.checksums = self.checksums;
        w.prefill_instances = self.prefill_instances;
        w.decode_instances = self.decode_instances;
        w.tp = self.tp;
        if let Some(plan) = self.tp {
            tp_run(&w, plan, backend)
                .map_err(|e| format!("decode's TP plan is not one a run can have: {e}"))?;
        }
        Ok((w, backend))
    }
}

/// The largest TP size, decode page and head count a run takes (a peer's plan past them is refused).
const MAX_TP: u16 = 1024;
const MAX_PAGE_TOKENS: u32 = 1 << 20;
const MAX_KV_HEADS: u32 = 1 << 16;

/// The spec of a multi-process run of `w` with TP plan `plan`, checked: requests counted (not
/// timed), contiguous pages, sizes in bounds and offsets that fit.
///
/// # Errors
/// What the run cannot do, named.
pub fn tp_run(w: &Workload, plan: TpPlan, backend: BackendKind) -> Result<TpSpec, String> {
    if w.duration.is_some() || w.scatter {
        return Err(
            "TP sizes run a count of requests in contiguous pages (no --duration, no --scatter)"
                .into(),
        );
    }
    if !(1..=MAX_TP).contains(&plan.prefill_tp)
        || !(1..=MAX_TP).contains(&plan.decode_tp)
        || plan.kv_heads > MAX_KV_HEADS
        || !(1..=MAX_PAGE_TOKENS).contains(&plan.decode_page_tokens)
    {
        return Err(format!(
            "TP sizes 1 to {MAX_TP}, at most {MAX_KV_HEADS} KV heads, decode pages of 1 to \
             {MAX_PAGE_TOKENS} tokens: {plan:?}"
        ));
    }
    let spec = TpSpec::of(w, plan, backend);
    spec.validate()?;
    // The prefill pool of those slots fits in memory's address range.
    tp_prefill_slots(w)
        .and_then(|slots| w.pages().checked_mul(slots))
        .and_then(|p| w.shape.page_bytes().checked_mul(u64::from(p)))
        .and_then(|b| b.checked_mul(u64::from(w.shape.layers)))
        .and_then(|b| b.checked_mul(u64::from(w.shape.regions.count())))
        .filter(|b| usize::try_from(*b).is_ok())
        .ok_or("a prefill rank's pool overflows")?;
    // Every head stream's offset fits (layers x regions x the span of a request x head bytes).
    let span =
        u64::from(w.prompt_tokens) + u64::from(w.shape.page_tokens.max(plan.decode_page_tokens));
    u64::from(w.shape.layers)
        .checked_mul(u64::from(w.shape.regions.count()))
        .and_then(|n| n.checked_mul(span))
        .and_then(|n| n.checked_mul(w.shape.bytes_per_token))
        .ok_or("a request's head streams overflow")?;
    Ok(spec)
}

/// Source slots of a prefill rank of a TP run: each decode instance's TP ranks drive the same
/// requests, each at its own pace, so the rank may hold one slot's worth more of every one of them.
fn tp_prefill_slots(w: &Workload) -> Option<u32> {
    w.concurrency
        .max(1)
        .checked_mul(2)?
        .checked_add(1)?
        .checked_mul(u32::from(w.decode_instances.max(1)))
}

/// How long a prefill role waits for decode to answer its probe (decode may start after it).
const PROBE_WAIT: Duration = Duration::from_secs(60);

/// The workload and backend a prefill role serves: decode's, read from its Hello with a probe
/// ([`probe_decode`](transfer_engine::engine::probe_decode), authenticated with `token`), found
/// as `find` says. `w` and `backend` are what this process's flags say; a flag in `given` that
/// says otherwise than decode is refused, naming it.
///
/// # Errors
/// Decode unreachable or unauthenticated, its workload unreadable, or a given flag that differs.
pub async fn learn_workload(
    find: &Find,
    w: &Workload,
    backend: BackendKind,
    given: &[&str],
    token: Option<&[u8]>,
) -> Result<(Workload, BackendKind), String> {
    let addr = match find {
        Find::Fixed(decodes, _) => *decodes
            .first()
            .ok_or("prefill needs a decode address to connect to")?,
        Find::Etcd(etcd) => {
            let dir = discovery::Directory::open(etcd)
                .await
                .map_err(|e| e.to_string())?;
            dir.wait_for("the decode engine", DISCOVERY_WAIT, |rs| {
                rs.iter()
                    .find(|r| r.role == RecordRole::Decode && r.tp_rank == 0)
                    .map(|r| r.address)
            })
            .await
            .map_err(|e| e.to_string())?
        }
    };
    let secret = token.map(Secret::new);
    let hello = transfer_engine::engine::probe_decode(addr, secret.as_ref(), PROBE_WAIT)
        .await
        .map_err(|e| format!("asking decode at {addr} for its workload: {e}"))?;
    let served: Served = serde_json::from_slice(&hello.app)
        .map_err(|e| format!("decode at {addr} sent a workload that cannot be read: {e}"))?;
    let differ = served.differences(&Served::of(w, backend), given);
    if !differ.is_empty() {
        return Err(format!(
            "this prefill's flags differ from decode's workload: {}",
            differ.join("; ")
        ));
    }
    served.apply(w)
}

/// How long a role waits for the rest of its cluster to register in etcd.
const DISCOVERY_WAIT: Duration = Duration::from_secs(120);

/// Runs the decode role and returns its report. Only prefill processes holding `token` (the
/// shared secret; `None` admits anyone) are let in. `heartbeat` replaces the engine's default
/// interval. `progress(done, total)` is called as requests end.
///
/// This is decode instance `index` of `w.decode_instances`, each a process of its own that drives
/// its own requests (ids apart, `index` in bits 40 and up) into the same prefill instances, in turn
/// over them. With `stamps`, every instance but the first leaves what it measured there, and the
/// first waits for those and reports the whole run. With TP sizes (`w.tp`) it is decode TP rank
/// `tp_rank` of instance `index`, driving the same requests as the instance's other ranks; every
/// rank but the first of the first instance leaves its results as another instance would, and
/// that one reports.
///
/// # Errors
/// Engine failures, as text.
#[allow(clippy::too_many_arguments)] // one role's whole description, as its flags give it
pub async fn run_decode(
    place: Place,
    index: u16,
    tp_rank: u16,
    w: &Workload,
    backend: BackendKind,
    token: Option<Vec<u8>>,
    stamps: Option<&Path>,
    heartbeat: Option<Duration>,
    progress: Option<&(dyn Fn(u64, u64) + Sync)>,
) -> Result<Report, String> {
    let spec = match w.tp {
        Some(plan) => Some(tp_run(w, plan, backend)?),
        None => None,
    };
    // The workload as decode's pages cut it (its own page size in a TP run).
    let mut dw = w.clone();
    // Each slot and a spare for it (see `Slots`).
    let slots_held = w.concurrency.max(1) * 2;
    let layout = match &spec {
        Some(s) => {
            if tp_rank >= s.decode_tp {
                return Err(format!(
                    "--tp-rank {tp_rank} is not below --decode-tp {}",
                    s.decode_tp
                ));
            }
            dw.shape.page_tokens = s.decode_page_tokens;
            s.layout_slots(
                s.decode_tp,
                0,
                w.shape.layers,
                s.decode_page_tokens,
                slots_held,
            )
        }
        None if tp_rank > 0 => return Err("--tp-rank needs --decode-tp".into()),
        None => KvLayout::packed(
            0,
            w.shape.layers,
            w.shape.regions,
            w.shape.page_bytes(),
            w.pages() * slots_held,
        ),
    };
    let instances = w.prefill_instances.max(1);
    let decodes = w.decode_instances.max(1);
    if index >= decodes {
        return Err(format!(
            "--decode-index {index} is not below --decode-instances {decodes}"
        ));
    }
    // Who reports the run, and who hands it results: decode instances, or in a TP run each
    // instance's ranks (`index * decode_tp + tp_rank`).
    let tp_size = spec.as_ref().map_or(1, |s| s.decode_tp);
    let (member, members) = decodes
        .checked_mul(tp_size)
        .map(|n| (index * tp_size + tp_rank, n))
        .ok_or("too many decode processes")?;
    // One prefill instance is decode's default one; several are named, each added below.
    let names: Vec<String> = if instances == 1 {
        vec![String::new()]
    } else {
        (0..instances).map(instance_name).collect()
    };
    let default_pp = if instances == 1 { w.pp } else { 0 };
    let mut cfg = DecodeConfig::new(
        w.shape.layers,
        dw.shape.page_tokens,
        layout.clone(),
        default_pp,
    );
    if let Some(s) = &spec {
        cfg.tp = s.tp(tp_rank, s.decode_tp);
        cfg.prefill_tp = Some(s.prefill_tp);
        cfg.landing_bytes = s.landing_bytes();
        // Prefill ranks group one request's TP legs by the decode instance's name.
        cfg.instance = format!("decode-{index}");
    }
    let (listen, etcd) = match place {
        Place::Fixed(l, etcd) => (l, etcd),
        Place::Etcd(etcd) => (SocketAddr::from(([127, 0, 0, 1], 0)), Some(etcd)),
    };
    cfg.listen = listen;
    cfg.backend = w.decode_progress.apply(BackendConfig::default_for_decode(
        backend,
        &format!("decode-{index}-{tp_rank}-{}", std::process::id()),
    ));
    cfg.verify_checksums = w.checksums;
    cfg.token = token.as_deref().map(Secret::new);
    if let Some(h) = heartbeat {
        cfg.heartbeat = Some(h);
    }
    cfg.metrics = w.metrics;
    // What the prefill roles serve, told only to those that prove the secret.
    cfg.app = serde_json::to_vec(&Served::of(w, backend)).map_err(|e| e.to_string())?;
    let pool = w
        .decode_pool
        .pool(layout.buffer_len)
        .map_err(|e| e.to_string())?;
    let decode = Arc::new(
        DecodeEngine::start(cfg, pool)
            .await
            .map_err(|e| e.to_string())?,
    );
    if instances > 1 {
        for name in &names {
            decode
                .add_instance(name, w.pp, spec.as_ref().map_or(1, |s| s.prefill_tp))
                .map_err(|e| e.to_string())?;
        }
    }
    eprintln!("kvbench decode: listening on {}", decode.local_addr());
    let membership = match &etcd {
        Some(etcd) => {
            let record = EngineRecord {
                role: RecordRole::Decode,
                engine_id: "decode".into(),
                address: decode.local_addr(),
                tp_rank,
                tp_size: spec.as_ref().map_or(1, |s| s.decode_tp),
                pp_rank: 0,
                pp_size: w.pp,
                total_layers: w.shape.layers,
                page_tokens: w.shape.page_tokens,
                first_layer: 0,
                num_layers: w.shape.layers,
                incarnation: transfer_engine::engine::fresh_incarnation(),
                // Each decode instance's record a key of its own.
                instance: if decodes > 1 {
                    format!("decode-{index}")
                } else {
                    String::new()
                },
            };
            let m = discovery::join_decode(etcd, &decode, record)
                .await
                .map_err(|e| e.to_string())?;
            eprintln!(
                "kvbench decode: registered in etcd as cluster {:?}",
                etcd.cluster
            );
            Some(m)
        }
        None => None,
    };
    if instances == 1 {
        decode
            .wait_for_ranks(Duration::from_secs(120))
            .await
            .map_err(|e| e.to_string())?;
    } else {
        for name in &names {
            decode
                .wait_for_instance(name, Duration::from_secs(120))
                .await
                .map_err(|e| e.to_string())?;
        }
    }
    // Counted once every rank is here, before any request.
    let at_start = decode.stats();
    let ranks = ranks_of(w)?;
    // When each request completed, on the wall clock: matched after the run against the instants the
    // prefill processes stamped their last writes at.
    let completed: Arc<Mutex<HashMap<u64, u128>>> = Arc::default();
    let slots = Arc::new(Slots::new(&dw));
    let layout = Arc::new(layout);
    let on = |e: Event<'_>| match e {
        Event::Ended {
            request,
            outcome,
            done,
            total,
        } => {
            match outcome {
                // Progress, for tests that inject a fault mid-run (KVBENCH_LOG=kvbench::roles=debug).
                Outcome::Complete => tracing::debug!(done, request = request.0, "request complete"),
                Outcome::Failed(reason) => eprintln!("kvbench decode: request failed: {reason:?}"),
            }
            if let Some(p) = progress {
                p(done, total);
            }
        }
        Event::VerifyFailed { request, error } => {
            let n = request.0 & !CHECKED_REQUEST;
            eprintln!("kvbench decode: verification failed: request {n}: {error}");
        }
    };
    let names = Arc::new(names);
    let tally = drive(
        w,
        |i, checked| {
            RequestId(
                (u64::from(index) << 40) | (i + 1) | if checked { CHECKED_REQUEST } else { 0 },
            )
        },
        |request, slot| {
            let t0 = Instant::now();
            let decode = decode.clone();
            let completed = completed.clone();
            let mut dst = slots.pages(slot);
            let (slots, layout) = (slots.clone(), layout.clone());
            let (prompt, chunk, timeout) = (w.prompt_tokens, w.chunk_tokens, w.request_timeout);
            // Each slot's requests come from one prefill instance, in turn over the slots.
            let instance = names[slot as usize % names.len()].clone();
            Ok(async move {
                // A slot whose last request failed without every rank's confirmation is quarantined:
                // it moves to a spare slot (poisoned first, as the drive poisoned this one), or,
                // with none left, waits (bounded) until its pages are released rather than fail
                // the run.
                let fut = loop {
                    let expected = transfer_engine::engine::Expected {
                        instance: instance.clone(),
                        prefix_tokens: 0,
                        prompt_tokens: prompt,
                        chunk_tokens: chunk,
                        dst_pages: dst.clone(),
                        timeout,
                    };
                    match decode.expect_request(request, expected) {
                        Err(EngineError::PageHeld { by, .. }) if let Some(spare) = slots.replace(slot) => {
                            eprintln!(
                                "kvbench decode: pages of request {} stay quarantined; slot {slot} moves to spare pages",
                                by.0
                            );
                            verify::poison(&layout, &spare, |at, b| decode.write_pool(at, b))
                                .map_err(|e| e.to_string())?;
                            dst = spare;
                        }
                        Err(EngineError::PageHeld { by, .. }) => {
                            eprintln!(
                                "kvbench decode: waiting for quarantined pages of request {}",
                                by.0
                            );
                            tokio::time::timeout(QUARANTINE_WAIT, decode.released(by))
                                .await
                                .map_err(|_| {
                                    format!("pages of request {} stayed quarantined", by.0)
                                })?;
                        }
                        other => break other.map_err(|e| e.to_string())?,
                    }
                };
                let outcome = fut.await;
                let latency = t0.elapsed();
                let ended = Instant::now();
                // The first absence is the start, before every rank was there.
                let during_absence = decode
                    .absences()
                    .iter()
                    .skip(1)
                    .any(|a| a.overlaps(t0, ended));
                if let Some(at) = decode.completed_at(request).and_then(wall_ns) {
                    lock(&completed).insert(request.0, at);
                }
                Ok(Ran {
                    outcome,
                    latency,
                    complete: None,
                    posted: None,
                    during_absence,
                })
            })
        },
        |_, slot| {
            verify::poison(&layout, &slots.pages(slot), |at, b| {
                decode.write_pool(at, b)
            })
            .map_err(|e| e.to_string())
        },
        |request, slot| {
            let read = |at, b: &mut [u8]| decode.read_pool(at, b);
            match &spec {
                Some(s) => s.check_rank(tp_rank, &layout, request, &slots.pages(slot), read),
                None => verify::check(&layout, &ranks, request, &slots.pages(slot), read),
            }
        },
        |e| format!("request task: {e}"),
        &on,
    )
    .await?;
    // Before shutdown, whose closing ranks would count as absences too.
    let away = decode.absences().len().saturating_sub(1);
    let decode_stats = decode.stats();
    crate::bench::linger(w, decode.metrics_addr()).await;
    // Revokes the record and lets go of the engine handle its watch held.
    if let Some(m) = membership
        && let Err(e) = m.leave().await
    {
        eprintln!("kvbench decode: leaving etcd: {e}");
    }
    let closed = decode
        .as_ref()
        .clone()
        .shutdown(crate::bench::SHUTDOWN)
        .await;
    if !closed.pool_freed {
        eprintln!("kvbench decode: pool leaked, ranks did not confirm shutdown: {closed:?}");
    }
    let mut tally = tally;
    let mut completed = std::mem::take(&mut *lock(&completed));
    let mut share = Share {
        tally: Tally::default(),
        completed: Vec::new(),
        registrations: at_start.registrations,
        connected_ranks: at_start.connected_ranks,
    };
    if let Some(dir) = stamps
        && members > 1
    {
        if member > 0 {
            // The first decode instance (or TP rank) reports the run: it gets what this one
            // measured.
            share.tally = std::mem::take(&mut tally);
            share.completed = completed.into_iter().collect();
            write_share(dir, member, &share)
                .map_err(|e| format!("writing into {}: {e}", dir.display()))?;
            return Ok(share.tally.report(w, backend));
        }
        // Each decode instance's tally: its TP ranks ran the same requests (`Tally::merge_rank`);
        // the instances' own requests add up.
        let mut instances_seen = vec![std::mem::take(&mut tally)];
        for m in 1..members {
            let other = read_share(dir, m, SHARE_WAIT).await?;
            if m % tp_size == 0 {
                instances_seen.push(other.tally);
            } else if let Some(t) = instances_seen.last_mut() {
                t.merge_rank(&other.tally);
            }
            // A request is complete when its last TP rank is.
            for (r, at) in other.completed {
                let e = completed.entry(r).or_insert(at);
                *e = (*e).max(at);
            }
            share.registrations = share.registrations.max(other.registrations);
            share.connected_ranks = share.connected_ranks.max(other.connected_ranks);
        }
        for t in instances_seen {
            tally.merge(t);
        }
    }
    // The prefill processes of each instance, in the files they leave.
    let file_ranks = match &spec {
        Some(s) => {
            let writers = u16::try_from(s.writing_ranks()?.len()).map_err(|e| e.to_string())?;
            w.pp.checked_mul(writers).ok_or("too many prefill ranks")?
        }
        None => w.pp,
    };
    if let Some(dir) = stamps {
        match read_stamps(dir, instances, file_ranks, STAMPS_WAIT).await {
            Ok(last) => tally.completes_us = complete_latencies(&completed, &last),
            Err(e) => eprintln!("kvbench decode: no last-write stamps, cmpl columns read 0: {e}"),
        }
    }
    let mut report = tally.report(w, backend);
    report.baseline = "none (multi-process)".into();
    report.decode_pool_bytes = decode_stats.registered_bytes;
    report.register_ms = decode_stats.register_micros as f64 / 1e3;
    report.prefill_instances = u64::from(instances);
    report.decode_instances = u64::from(decodes);
    report.registrations_per_process = share.registrations;
    report.connections_per_decode = share.connected_ranks;
    if let Some(s) = &spec {
        report.prefill_tp = s.prefill_tp;
        report.decode_tp = s.decode_tp;
    }
    if let Some(dir) = stamps {
        match prefill_cpu(dir, instances, file_ranks) {
            Ok(PrefillEnd {
                cpu,
                copy,
                registrations,
                decodes,
                writes,
                threads,
            }) => {
                report.registrations_per_process =
                    report.registrations_per_process.max(registrations);
                report.decodes_per_prefill_rank = decodes;
                let requests = report.requests.max(1) as f64;
                // Each rank sends every chunk of its layers.
                let chunks = requests
                    * f64::from(w.prompt_tokens.div_ceil(w.chunk_tokens))
                    * f64::from(file_ranks);
                if spec.is_some() {
                    // Counted by the prefill engines: sliced heads make their own writes.
                    report.writes_per_request = writes / report.requests.max(1);
                }
                report.prefill_cpu_us_per_request = cpu.as_secs_f64() * 1e6 / requests;
                report.prefill_copy_us_per_request = copy.as_secs_f64() * 1e6 / requests;
                report.prefill_cpu_us_per_chunk = cpu.as_secs_f64() * 1e6 / chunks.max(1.0);
                report.prefill_copy_us_per_chunk = copy.as_secs_f64() * 1e6 / chunks.max(1.0);
                let [p, r, o] = threads.map(|t| t.as_secs_f64() * 1e6 / chunks.max(1.0));
                report.prefill_progress_us_per_chunk = p;
                report.prefill_runtime_us_per_chunk = r;
                report.prefill_other_us_per_chunk = o;
            }
            Err(e) => eprintln!("kvbench decode: no prefill CPU times: {e}"),
        }
    }
    if report.failed > 0 || away > 0 {
        eprintln!(
            "kvbench decode: ranks went away {away} times after the start; {} of {} requests \
             failed, {} while a rank was away and {} outside (reasons above); {} waited for a rank \
             and completed",
            report.failed,
            report.requests,
            report.failed_during_absence,
            report.failed - report.failed_during_absence,
            report.completed_across_absence,
        );
    }
    Ok(report)
}

/// How long decode waits, after its run, for every prefill process's stamps file.
const STAMPS_WAIT: Duration = Duration::from_secs(15);

/// How long the first decode instance waits, after its run, for every other one's [`Share`]: they
/// ran as many requests side by side, so they end about when it does.
const SHARE_WAIT: Duration = Duration::from_secs(120);

/// What a decode instance other than the first hands it after its run (`decode-<index>.share` in
/// the stamps folder, JSON).
#[derive(serde::Serialize, serde::Deserialize)]
struct Share {
    tally: Tally,
    /// When each of its requests completed, wall clock nanoseconds.
    completed: Vec<(u64, u128)>,
    /// Its engine's registrations and connected ranks once every rank was there.
    registrations: u64,
    connected_ranks: u64,
}

fn share_file(dir: &Path, index: u16) -> PathBuf {
    dir.join(format!("decode-{index}.share"))
}

fn write_share(dir: &Path, index: u16, share: &Share) -> std::io::Result<()> {
    let text = serde_json::to_vec(share).map_err(std::io::Error::other)?;
    let tmp = dir.join(format!(".decode-{index}.share.{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, share_file(dir, index))
}

async fn read_share(dir: &Path, index: u16, within: Duration) -> Result<Share, String> {
    let path = share_file(dir, index);
    let deadline = Instant::now() + within;
    let bytes = loop {
        match std::fs::read(&path) {
            Ok(b) => break b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                return Err(format!(
                    "decode instance {index} left no results within {within:?}: {}: {e}",
                    path.display()
                ));
            }
        }
    };
    serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `t` on the wall clock, nanoseconds since the Unix epoch: the one clock processes on a host share
/// (an `Instant` means nothing outside its process). `None` for an instant still to come.
fn wall_ns(t: Instant) -> Option<u128> {
    let (now, wall) = (Instant::now(), SystemTime::now());
    let ago = now.checked_duration_since(t)?;
    Some(
        wall.checked_sub(ago)?
            .duration_since(UNIX_EPOCH)
            .ok()?
            .as_nanos(),
    )
}

/// The number a prefill process's files go by in its instance: its PP rank, or in a TP run
/// `i * pp + pp_rank` for the `i`-th of the TP ranks that write somewhere.
fn file_rank(spec: Option<&TpSpec>, tp_rank: u16, pp_rank: u16) -> Result<u16, String> {
    let Some(s) = spec else {
        return Ok(pp_rank);
    };
    let i = s
        .writing_ranks()?
        .iter()
        .position(|&t| t == tp_rank)
        .ok_or(format!(
            "prefill TP rank {tp_rank} writes into no decode TP rank: it runs no engine"
        ))?;
    u16::try_from(i)
        .ok()
        .and_then(|i| i.checked_mul(s.pp)?.checked_add(pp_rank))
        .ok_or("too many prefill ranks".into())
}

/// Where rank `rank` of prefill instance `instance` writes its CPU time (nanoseconds) in `dir`.
fn cpu_file(dir: &Path, instance: u16, rank: u16) -> PathBuf {
    dir.join(format!("i{instance}-rank-{rank}.cpu"))
}

/// What the prefill processes left in their CPU files: one line, `cpu_ns copy_ns registrations
/// decodes writes progress_ns runtime_ns other_ns`.
struct PrefillEnd {
    /// CPU time, summed over the processes.
    cpu: Duration,
    /// Of it, the time their progress threads spent copying, summed.
    copy: Duration,
    /// The most registrations one process's transport held.
    registrations: u64,
    /// The fewest decode instances one process was linked to once every link was up.
    decodes: u64,
    /// Writes the processes posted, summed.
    writes: u64,
    /// CPU of their progress threads, runtime threads and the rest, summed.
    threads: [Duration; 3],
}

/// Reads every prefill process's CPU file in `dir` (after their stamps, which they write last):
/// `ranks` of each instance (see [`file_rank`]).
fn prefill_cpu(dir: &Path, instances: u16, ranks: u16) -> Result<PrefillEnd, String> {
    let mut end = PrefillEnd {
        cpu: Duration::ZERO,
        copy: Duration::ZERO,
        registrations: 0,
        decodes: u64::MAX,
        writes: 0,
        threads: [Duration::ZERO; 3],
    };
    for (instance, rank) in (0..instances).flat_map(|k| (0..ranks).map(move |r| (k, r))) {
        let path = cpu_file(dir, instance, rank);
        let bad = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
        let text = std::fs::read_to_string(&path).map_err(|e| bad(&e))?;
        let fields: Vec<u64> = text
            .split_whitespace()
            .map(str::parse::<u64>)
            .collect::<Result<_, _>>()
            .map_err(|e| bad(&e))?;
        let [c, k, regs, decodes, writes, progress, runtime, other] = fields[..] else {
            return Err(bad(&format!(
                "not `cpu_ns copy_ns registrations decodes writes progress_ns runtime_ns \
                 other_ns`: {text:?}"
            )));
        };
        for (sum, ns) in end.threads.iter_mut().zip([progress, runtime, other]) {
            *sum += Duration::from_nanos(ns);
        }
        end.writes += writes;
        end.cpu += Duration::from_nanos(c);
        end.copy += Duration::from_nanos(k);
        end.registrations = end.registrations.max(regs);
        end.decodes = end.decodes.min(decodes);
    }
    Ok(end)
}

/// Where rank `rank` of prefill instance `instance` writes its stamps in `dir`.
fn stamps_file(dir: &Path, instance: u16, rank: u16) -> PathBuf {
    dir.join(format!("i{instance}-rank-{rank}.stamps"))
}

/// Writes one line per request, `request wall_ns`, to the rank's file in `dir`, atomically (a
/// reader sees the whole file or none).
fn write_stamps(
    dir: &Path,
    instance: u16,
    rank: u16,
    stamps: &[(u64, u128)],
) -> std::io::Result<()> {
    let text: String = stamps.iter().map(|(r, t)| format!("{r} {t}\n")).collect();
    let tmp = dir.join(format!(
        ".i{instance}-rank-{rank}.stamps.{}",
        std::process::id()
    ));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, stamps_file(dir, instance, rank))
}

/// Every rank's stamps, merged: for each request, the latest last write of any rank of any
/// instance (`ranks` of each, see [`file_rank`]). Waits up to `within` for the files (a prefill
/// process writes its own when its last decode closed it).
async fn read_stamps(
    dir: &Path,
    instances: u16,
    ranks: u16,
    within: Duration,
) -> Result<HashMap<u64, u128>, String> {
    let deadline = Instant::now() + within;
    let mut last: HashMap<u64, u128> = HashMap::new();
    for (instance, rank) in (0..instances).flat_map(|k| (0..ranks).map(move |r| (k, r))) {
        let path = stamps_file(dir, instance, rank);
        let text = loop {
            match std::fs::read_to_string(&path) {
                Ok(t) => break t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(format!("{}: {e}", path.display())),
            }
        };
        for line in text.lines() {
            let mut it = line.split_ascii_whitespace().map(str::parse::<u128>);
            let (Some(Ok(r)), Some(Ok(t)), None) = (it.next(), it.next(), it.next()) else {
                return Err(format!("{}: bad line {line:?}", path.display()));
            };
            let r = u64::try_from(r).map_err(|_| format!("{}: bad request id", path.display()))?;
            let e = last.entry(r).or_insert(t);
            *e = (*e).max(t);
        }
    }
    Ok(last)
}

/// Last write to Complete, µs, for every request both sides stamped. Decode can see Complete first
/// (its notification overtook the sender's own completion callback): that counts as zero, as in the
/// one-process run.
fn complete_latencies(completed: &HashMap<u64, u128>, last: &HashMap<u64, u128>) -> Vec<f64> {
    completed
        .iter()
        .filter_map(|(r, &done)| {
            let l = *last.get(r)?;
            Some(done.saturating_sub(l) as f64 / 1e3)
        })
        .collect()
}

/// Runs rank `rank` of prefill instance `instance` (of `w.prefill_instances`) until every decode
/// process it serves closed, presenting `token` (the shared secret, if any) to its peers;
/// `heartbeat` replaces the engine's default interval. One engine serves every decode instance:
/// one transport, one registration of its pool. With TP sizes (`w.tp`) it is the rank of prefill
/// TP rank `tp_rank`'s pipeline, writing the decode TP ranks it shares heads with in every decode
/// instance (`Find::Fixed` lists every decode process, instance by instance, in rank order).
///
/// # Errors
/// Engine failures, as text.
#[allow(clippy::too_many_arguments)] // one role's whole description, as its flags give it
pub async fn run_prefill(
    find: Find,
    instance: u16,
    rank: u16,
    tp_rank: u16,
    w: &Workload,
    backend: BackendKind,
    token: Option<Vec<u8>>,
    stamps: Option<&Path>,
    heartbeat: Option<Duration>,
) -> Result<(), String> {
    let ranks = ranks_of(w)?;
    let range = ranks.get(usize::from(rank)).ok_or(format!(
        "--pp-rank {rank} is not below the PP size {} decode runs",
        w.pp
    ))?;
    let instances = w.prefill_instances.max(1);
    if instance >= instances {
        return Err(format!(
            "--instance {instance} is not below the {instances} prefill instances decode serves"
        ));
    }
    let spec = match w.tp {
        Some(plan) => Some(tp_run(w, plan, backend)?),
        None if tp_rank > 0 => return Err("--tp-rank needs --prefill-tp".into()),
        None => None,
    };
    let files = file_rank(spec.as_ref(), tp_rank, rank)?;
    let pages = w.pages();
    // A rank holds a request's source pages until every rank decided it, which can be a moment
    // after decode saw it complete and issued the next one: one slot more than each decode's.
    // With a slot for every request that can be in flight, a rank never waits for one: ranks of
    // an instance may see several decodes' requests in different orders.
    let slots = match &spec {
        Some(_) => tp_prefill_slots(w),
        None => w
            .concurrency
            .max(1)
            .checked_add(1)
            .and_then(|s| s.checked_mul(u32::from(w.decode_instances.max(1)))),
    }
    .ok_or("too many request slots for one pool")?;
    let layout = match &spec {
        Some(s) => s.layout_slots(
            s.prefill_tp,
            range.start,
            range.len() as u32,
            w.shape.page_tokens,
            slots,
        ),
        None => KvLayout::packed(
            range.start,
            range.len() as u32,
            w.shape.regions,
            w.shape.page_bytes(),
            pages * slots,
        ),
    };
    let find = match (find, &spec) {
        // The decode TP ranks this one writes in every decode instance, out of all of them
        // (instance by instance, in rank order).
        (Find::Fixed(decodes, p), Some(s)) => {
            let targets = s.targets(tp_rank)?;
            let mine = (0..usize::from(w.decode_instances.max(1)))
                .flat_map(|k| {
                    targets
                        .iter()
                        .map(move |&d| k * usize::from(s.decode_tp) + usize::from(d))
                })
                .map(|i| {
                    decodes.get(i).copied().ok_or(format!(
                        "no address for decode process {i} among --connect's {}",
                        decodes.len()
                    ))
                })
                .collect::<Result<Vec<_>, _>>()?;
            Find::Fixed(mine, p)
        }
        (find, _) => find,
    };
    let (connect, more, peers, etcd) = match find {
        Find::Fixed(decodes, p) => {
            let (first, more) = decodes
                .split_first()
                .ok_or("prefill needs a decode address to connect to")?;
            (*first, more.to_vec(), p, None)
        }
        Find::Etcd(etcd) => (
            SocketAddr::from(([127, 0, 0, 1], 0)),
            Vec::new(),
            Vec::new(),
            Some(etcd),
        ),
    };
    let mut cfg = PrefillConfig::new(
        connect,
        rank,
        w.pp,
        w.shape.layers,
        w.shape.page_tokens,
        layout.clone(),
    );
    cfg.backend = BackendConfig::default_for(
        backend,
        &format!("prefill-{instance}-{tp_rank}-{rank}-{}", std::process::id()),
    );
    if instances > 1 {
        cfg.instance = instance_name(instance);
    }
    if let Some(s) = &spec {
        cfg.tp = s.tp(tp_rank, s.prefill_tp);
    }
    cfg.peers = peers;
    cfg.checksums = w.checksums;
    cfg.connect_timeout = Duration::from_secs(60);
    cfg.token = token.as_deref().map(Secret::new);
    if let Some(h) = heartbeat {
        cfg.heartbeat = Some(h);
    }
    cfg.metrics = w.metrics;
    let buf = HostBuffer::new(
        layout.buffer_len as usize,
        HostOptions {
            prefault: true,
            ..HostOptions::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let found = match &etcd {
        Some(etcd) => {
            let host = std::net::IpAddr::from([127, 0, 0, 1]);
            Some(
                discovery::find_prefill_cluster(etcd, &mut cfg, host, DISCOVERY_WAIT)
                    .await
                    .map_err(|e| e.to_string())?,
            )
        }
        None => None,
    };
    let engine = PrefillEngine::start(cfg, Pool::Owned(buf))
        .await
        .map_err(|e| e.to_string())?;
    for addr in more {
        engine.add_decode(addr).await.map_err(|e| e.to_string())?;
    }
    let membership = found.map(|(reg, dir)| discovery::join_prefill(&engine, reg, dir));
    if membership.is_some() {
        // The other decode engines (instances, and TP ranks this one writes into) come through
        // etcd: linked before any of them can finish, since each waits for every prefill rank.
        let per_instance = match &spec {
            Some(s) => s.targets(tp_rank)?.len() as u64,
            None => 1,
        };
        let deadline = Instant::now() + DISCOVERY_WAIT;
        while engine.stats().decodes < u64::from(w.decode_instances.max(1)) * per_instance
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // Counted once every decode is linked, before any request can end.
    let linked = engine.stats().decodes;
    // This process's CPU from here to its end is what serving the run cost it.
    let cpu0 = crate::bench::cpu_time();
    let threads0 = crate::bench::thread_cpu();
    let copy0 = engine.transport_stats().copy_nanos;
    // Writes a checked request's bytes into its source pages, as this rank holds them.
    let source: Source = {
        let (e, layout, layers) = (engine.clone(), layout.clone(), range.clone());
        let pp_rank = engine.pp_rank();
        Arc::new(move |request, src| {
            let write = |at, b: &[u8]| e.write_pool(at, b);
            match &spec {
                Some(s) => s.write_source(tp_rank, &layout, layers.clone(), request, src, write),
                None => verify::write_source(&layout, request, pp_rank, src, write),
            }
        })
    };
    // Free source slots, taken in the order requests arrive (the same on every rank), so a rank
    // waiting for a slot only ever waits on older requests, which never wait on it.
    let (free_tx, mut free) = tokio::sync::mpsc::unbounded_channel::<u32>();
    for slot in 0..slots {
        let _ = free_tx.send(slot);
    }
    let last_writes: Arc<Mutex<Vec<(u64, u128)>>> = Arc::default();
    while let Some(req) = engine.next_request().await {
        let Some(slot) = free.recv().await else { break };
        let (e, source, free_tx) = (engine.clone(), source.clone(), free_tx.clone());
        let last_writes = last_writes.clone();
        tokio::spawn(async move {
            let src: Vec<u32> = (slot * pages..(slot + 1) * pages).collect();
            if let Some(at) = serve(&e, source.as_ref(), &req, &src)
                .await
                .and_then(wall_ns)
            {
                lock(&last_writes).push((req.request.0, at));
            }
            let _ = free_tx.send(slot);
        });
    }
    if let Some(m) = membership
        && let Err(e) = m.leave().await
    {
        eprintln!("kvbench prefill {rank}: leaving etcd: {e}");
    }
    if let Some(dir) = stamps {
        // The CPU file first: decode reads it once the stamps file is there. The threads are read
        // before the process: what they use between the two readings counts on the process's side
        // only, so their sum stays within it.
        let threads1 = crate::bench::thread_cpu();
        let cpu = crate::bench::cpu_time().saturating_sub(cpu0);
        let [progress, runtime, other] = crate::bench::thread_cpu_since(&threads0, &threads1);
        let copy = engine.transport_stats().copy_nanos.saturating_sub(copy0);
        let regions = engine.transport_stats().regions;
        let writes = engine.stats().writes;
        let tmp = dir.join(format!(
            ".i{instance}-rank-{files}.cpu.{}",
            std::process::id()
        ));
        std::fs::write(
            &tmp,
            format!(
                "{} {copy} {regions} {linked} {writes} {progress} {runtime} {other}\n",
                cpu.as_nanos()
            ),
        )
        .and_then(|()| std::fs::rename(&tmp, cpu_file(dir, instance, files)))
        .map_err(|e| format!("writing CPU time into {}: {e}", dir.display()))?;
        write_stamps(dir, instance, files, &lock(&last_writes))
            .map_err(|e| format!("writing stamps into {}: {e}", dir.display()))?;
    }
    Ok(())
}

/// How a prefill role writes a checked request's bytes into its source pages.
type WriteSource = dyn Fn(RequestId, &[u32]) -> Result<(), VerifyError> + Send + Sync;
type Source = Arc<WriteSource>;

/// Sends one request from `src` (pages no other request in flight uses, written by `source` first
/// if decode checks it) and waits for its decision. Returns when its last chunk's writes were over
/// (stamped on the progress thread), if it sent them.
async fn serve(
    e: &PrefillEngine,
    source: &WriteSource,
    req: &transfer_engine::engine::IncomingRequest,
    src: &[u32],
) -> Option<Instant> {
    if req.request.0 & CHECKED_REQUEST != 0
        && let Err(err) = source(req.request, src)
    {
        eprintln!("kvbench prefill {}: {err}", e.pp_rank());
        e.fail(req.request, FailureCode::WriteFailed);
        return None;
    }
    let chunks = req.prompt_tokens.div_ceil(req.chunk_tokens);
    for c in 0..chunks {
        if let Err(err) = e.send_chunk(req.request, c, src, c + 1 == chunks).await {
            eprintln!("kvbench prefill {}: {err}", e.pp_rank());
            e.fail(req.request, FailureCode::WriteFailed);
            return None;
        }
    }
    let last = e.last_chunk_done_at(req.request);
    e.decided(req.request).await;
    e.release(req.request);
    last
}
