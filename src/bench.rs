//! The measurements `kvbench` makes: a workload through the engine, and raw baselines to divide by.

use crate::cluster::{Cluster, ClusterSpec, Shape};
use crate::verify::VerifyError;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transfer_engine::core::{FailureCode, RequestId};
use transfer_engine::engine::{DecodeEngine, EngineError, Outcome};
use transfer_engine::mem::{HostBuffer, HostOptions, Pool};
use transfer_engine::transport::ucx::{UcxConfig, UcxTransport};
use transfer_engine::transport::{BackendKind, Registration, Transport, WriteOp};

/// Which requests `kvbench` checks byte for byte.
///
/// A checked request is prepared before its timed window opens (each rank writes the request's own
/// pattern into its source pages, decode poisons the destination pages; see [`crate::verify`]) and
/// checked, by copies out of the decode pool, after the window closed; neither is timed. Requests
/// that are not checked run without either, streaming through `concurrency` slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// Nothing is written or checked.
    None,
    /// The last request of every slot is checked: the others stream, then the last `concurrency`
    /// requests run as one prepared, timed and checked wave.
    Last,
    /// Every request is checked: requests run in waves of `concurrency`, each prepared before and
    /// checked after its timed window. The gaps between waves (a slot idles until its whole wave is
    /// over) are not timed, but a wave's tail is, so this measures a little below `None`.
    All,
}

/// A workload.
#[derive(Debug, Clone)]
pub struct Workload {
    /// The model.
    pub shape: Shape,
    /// Prefill PP size.
    pub pp: u16,
    /// Prompt length.
    pub prompt_tokens: u32,
    /// Chunked-prefill size.
    pub chunk_tokens: u32,
    /// Requests to run (at least; `duration` may add more).
    pub requests: u32,
    /// Requests in flight at once.
    pub concurrency: u32,
    /// Which requests to verify byte for byte.
    pub verify: Verify,
    /// Send and check per-chunk checksums.
    pub checksums: bool,
    /// Keep issuing requests until this much time passed.
    pub duration: Option<Duration>,
    /// Destination pages in reverse order, so no two pages coalesce into one write: every page is a
    /// write of its own (the page-rate workload).
    pub scatter: bool,
    /// Each request's deadline (given to decode's `expect`): a request not complete by then fails
    /// with `Timeout`.
    pub request_timeout: Duration,
    /// Where decode's pool comes from.
    pub decode_pool: crate::cluster::PoolKind,
    /// Prefill instances (pipelines of `pp` ranks each) into the one decode engine; requests go
    /// to them in turn, by destination slot.
    pub prefill_instances: u16,
    /// Decode engines (each with a pool of its own), every prefill rank serving all of them from
    /// its one engine; destination slots go to them in turn after the prefill instances.
    pub decode_instances: u16,
    /// Where every engine of the run serves its Prometheus metrics, if anywhere.
    pub metrics: Option<std::net::SocketAddr>,
    /// How long the engines stay up, serving those metrics, after the last request ended and
    /// before they shut down (so that a scraper reads the run's final counts).
    pub metrics_linger: Duration,
    /// How decode engines' progress threads run (`--progress-fifo`, `--progress-spin-us`).
    pub decode_progress: crate::cluster::DecodeProgress,
    /// TP sizes (and decode page size) of the two sides, where a run sets them
    /// ([`crate::tp`]); `None`: TP 1 on both, one page size.
    pub tp: Option<crate::tp::TpPlan>,
}

impl Workload {
    /// Pages of one request.
    pub fn pages(&self) -> u32 {
        self.shape.pages_for(self.prompt_tokens)
    }

    /// Writes one request takes once coalesced (pages, layers and regions when scattered).
    pub fn writes_per_request(&self) -> u64 {
        let per_layer_region = if self.scatter {
            u64::from(self.pages())
        } else {
            u64::from(self.prompt_tokens.div_ceil(self.chunk_tokens))
        };
        per_layer_region * u64::from(self.shape.layers) * u64::from(self.shape.regions.count())
    }

    /// The destination pages of the request in `slot`.
    pub fn dst_pages(&self, slot: u32) -> Vec<u32> {
        let pages = self.pages();
        if self.scatter {
            (0..pages).rev().map(|i| slot * pages + i).collect()
        } else {
            (slot * pages..(slot + 1) * pages).collect()
        }
    }

    /// Size of one coalesced write when a chunk's pages are contiguous on both sides: one layer's
    /// pages of one chunk.
    pub fn write_size(&self) -> u64 {
        if self.scatter {
            return self.shape.page_bytes();
        }
        let pages_per_chunk = u64::from(self.chunk_tokens.div_ceil(self.shape.page_tokens));
        pages_per_chunk.min(u64::from(self.pages())) * self.shape.page_bytes()
    }
}

/// One backend's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// Backend name.
    pub backend: String,
    /// Whole-request bandwidth, GB/s (10^9).
    pub gbps: f64,
    /// Baseline bandwidth, GB/s: raw UCX put between two processes streaming through buffers as
    /// large as the workload's decode pool (`ucx_perftest -t ucp_put_bw -s <pool bytes>`, whose
    /// buffers UCX allocates), the same amount of memory the engine's writes stream through.
    pub baseline_gbps: f64,
    /// Where the baseline came from.
    pub baseline: String,
    /// gbps / baseline_gbps.
    pub ratio: f64,
    /// `ucx_perftest` at the workload's coalesced write size, one buffer put again and again (so it
    /// runs from cache): for information, not the same work.
    pub cached_baseline_gbps: f64,
    /// On the ucx row when nixl ran in the same process too: gbps / nixl's gbps (0 otherwise).
    pub vs_nixl: f64,
    /// The same put loop streaming through buffers as large as the workload's pools (what the
    /// engine's writes really touch), GB/s.
    pub stream_gbps: f64,
    /// gbps / stream_gbps.
    pub stream_ratio: f64,
    /// A plain streaming memcpy of the same size in this process, GB/s: the memory bandwidth bound.
    pub memcpy_gbps: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Request latency percentiles (decode's expect to Complete), µs.
    pub latency_p50_us: f64,
    /// p99 of the above.
    pub latency_p99_us: f64,
    /// Last rank's final chunk done to decode seeing Complete, p50, µs.
    pub complete_p50_us: f64,
    /// p99 of the above.
    pub complete_p99_us: f64,
    /// Last rank's final chunk handed to the transport (its writes and notification posted) to
    /// decode seeing Complete, p50, µs: with one chunk of one write, a write's latency from post
    /// to the receiver's notification. Measured in one process only (0 otherwise).
    pub post_p50_us: f64,
    /// p99 of the above.
    pub post_p99_us: f64,
    /// Requests the two columns above are over: every completed one in one process; across processes,
    /// those whose last-write stamps decode read from the prefill processes (`--stamps`).
    pub complete_samples: u64,
    /// Chunks per second (all ranks).
    pub chunks_per_s: f64,
    /// Writes per second (all ranks), after coalescing; with `--scatter`, pages per second.
    pub writes_per_s: f64,
    /// ucx_perftest's message rate at the workload's write size (0 when not measured).
    pub baseline_msg_rate: f64,
    /// Requests run.
    pub requests: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Of those, requests that were live while a PP rank was away (its process died or was
    /// restarting): failures the loss explains. Only the multi-process decode tells them apart.
    pub failed_during_absence: u64,
    /// Requests that were live while a PP rank was away and completed all the same (they waited
    /// for it to come back). Only the multi-process decode counts them.
    pub completed_across_absence: u64,
    /// Requests that completed after the last failed one, counted in the order their outcomes
    /// arrived (every completed request when none failed): shows that a run recovered from a fault.
    pub completed_after_last_failure: u64,
    /// Every byte of every checked request matched, at least one was checked, and none failed but
    /// while a rank was away (false with `--verify none`).
    pub verified: bool,
    /// Requests checked byte for byte.
    pub verified_requests: u64,
    /// Prefill instances the decode engine served.
    pub prefill_instances: u64,
    /// Decode engines every prefill rank served.
    pub decode_instances: u64,
    /// Prefill TP size (1 unless the run sets TP sizes).
    pub prefill_tp: u16,
    /// Decode TP size (1 unless the run sets TP sizes).
    pub decode_tp: u16,
    /// The most registrations any engine's transport held, decode or prefill: one for its pool,
    /// however many peers it served.
    pub registrations_per_process: u64,
    /// The most prefill ranks connected to one decode engine (its control connections).
    pub connections_per_decode: u64,
    /// The fewest decode engines one prefill rank was linked to (all of them, when every link
    /// came up).
    pub decodes_per_prefill_rank: u64,
    /// Writes of one request, all ranks, after coalescing.
    pub writes_per_request: u64,
    /// CPU time (user and system, every thread) of the process that drove the run, in its timed
    /// windows, per request: every engine of the run in one process; decode's alone with
    /// `kvbench decode`.
    pub cpu_us_per_request: f64,
    /// `kvbench decode` only: the prefill processes' CPU time from their engines' start to their
    /// end, summed over the ranks, per request of the run (0 where not measured).
    pub prefill_cpu_us_per_request: f64,
    /// `kvbench decode` only: of that, the time the prefill ranks' progress threads spent copying
    /// bytes into decode's pool themselves (UCX's direct copies; 0 where the library moves them).
    pub prefill_copy_us_per_request: f64,
    /// `kvbench decode` only: the prefill processes' CPU time per chunk of one rank (each rank
    /// sends every chunk of its layers), and of that the copying.
    pub prefill_cpu_us_per_chunk: f64,
    /// See [`prefill_cpu_us_per_chunk`](Self::prefill_cpu_us_per_chunk).
    pub prefill_copy_us_per_chunk: f64,
    /// `kvbench decode` only: the prefill processes' CPU per chunk of a rank by thread, from each
    /// thread's own clock (`/proc/self/task/*/schedstat`): the transport's progress threads (their
    /// copies included), the async runtime's threads, and the rest (the main thread, blocking
    /// pools). Threads that ended within the window are not counted.
    pub prefill_progress_us_per_chunk: f64,
    /// See [`prefill_progress_us_per_chunk`](Self::prefill_progress_us_per_chunk).
    pub prefill_runtime_us_per_chunk: f64,
    /// See [`prefill_progress_us_per_chunk`](Self::prefill_progress_us_per_chunk).
    pub prefill_other_us_per_chunk: f64,
    /// The decode pool's bytes, and how long registering it took at start (for a pool the
    /// transport allocates, its allocation and population too).
    pub decode_pool_bytes: u64,
    /// Milliseconds to register the decode pool.
    pub register_ms: f64,
}

/// CPU time this process used so far, every thread, user and system (`CLOCK_PROCESS_CPUTIME_ID`).
pub fn cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

/// The threads of this process: each one's id, what it is ([`ThreadKind`], by its name), and the
/// CPU time it has used (nanoseconds, from `/proc/self/task/<tid>/schedstat`). Threads whose files
/// cannot be read (one that just ended) are left out.
pub fn thread_cpu() -> Vec<(u64, ThreadKind, u64)> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let tid = t.file_name().to_str()?.parse::<u64>().ok()?;
            let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
            let stat = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
            let ns = stat.split_whitespace().next()?.parse::<u64>().ok()?;
            Some((tid, ThreadKind::of(comm.trim()), ns))
        })
        .collect()
}

/// What a thread of a kvbench process is, by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadKind {
    /// A transport's progress thread (`ucx-…`, `nixl-…`) or a thread NIXL's library started.
    Progress,
    /// A thread of the async runtime (`tokio-rt-worker`).
    Runtime,
    /// Anything else: the main thread, blocking pools, the engine's chunk workers.
    Other,
}

impl ThreadKind {
    fn of(name: &str) -> Self {
        if name.starts_with("ucx-") || name.starts_with("nixl") {
            Self::Progress
        } else if name.starts_with("tokio-rt-worker") {
            Self::Runtime
        } else {
            Self::Other
        }
    }
}

/// CPU each kind of thread used between two [`thread_cpu`] readings (threads in both), in
/// nanoseconds: progress, runtime, other.
pub fn thread_cpu_since(
    before: &[(u64, ThreadKind, u64)],
    after: &[(u64, ThreadKind, u64)],
) -> [u64; 3] {
    let mut out = [0u64; 3];
    for &(tid, kind, ns) in after {
        let was = before.iter().find(|b| b.0 == tid).map_or(0, |b| b.2);
        let at = match kind {
            ThreadKind::Progress => 0,
            ThreadKind::Runtime => 1,
            ThreadKind::Other => 2,
        };
        out[at] += ns.saturating_sub(was);
    }
    out
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// How one request ended, as [`drive`] records it.
#[derive(Debug)]
pub(crate) struct Ran {
    pub outcome: Outcome,
    /// Decode's `expect` to its outcome.
    pub latency: Duration,
    /// Last rank's final chunk over to decode seeing Complete, where measured.
    pub complete: Option<Duration>,
    /// Last rank's final chunk posted to decode seeing Complete, where measured.
    pub posted: Option<Duration>,
    /// The request was live while a PP rank was away (its process died or restarted): a failure
    /// that the absence explains, or a request that waited for the rank and completed.
    pub during_absence: bool,
}

/// What [`drive`] tells its caller as it happens (for logs a test may be watching).
#[derive(Debug)]
pub(crate) enum Event<'a> {
    /// A request ended; `done` requests have ended so far, of `total` (at least) to run.
    Ended {
        request: RequestId,
        outcome: &'a Outcome,
        done: u64,
        total: u64,
    },
    /// A completed request's bytes are wrong.
    VerifyFailed {
        request: RequestId,
        error: &'a VerifyError,
    },
}

/// What a run measured. With `kvbench --processes` and several decode instances, each decode
/// process but the first hands its own to the first ([`merge`](Self::merge)) as JSON.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct Tally {
    pub latencies_us: Vec<f64>,
    pub completes_us: Vec<f64>,
    pub posts_us: Vec<f64>,
    pub done: u64,
    pub failed: u64,
    /// Of `failed`, those a rank's absence explains.
    pub failed_during_absence: u64,
    /// Completed requests that were live while a rank was away (they waited for it).
    pub completed_across_absence: u64,
    pub after_failure: u64,
    pub verified_requests: u64,
    pub mismatches: u64,
    /// The timed windows, summed: preparing and checking requests are outside them.
    pub timed: Duration,
    /// CPU time of this whole process (user and system, every thread) in the timed windows.
    pub cpu: Duration,
}

impl Tally {
    fn record(
        &mut self,
        request: RequestId,
        ran: &Ran,
        on: &(dyn Fn(Event<'_>) + Sync),
        total: u64,
    ) {
        self.done += 1;
        match ran.outcome {
            Outcome::Complete => {
                self.after_failure += 1;
                self.completed_across_absence += u64::from(ran.during_absence);
                self.latencies_us.push(ran.latency.as_secs_f64() * 1e6);
                if let Some(c) = ran.complete {
                    self.completes_us.push(c.as_secs_f64() * 1e6);
                }
                if let Some(p) = ran.posted {
                    self.posts_us.push(p.as_secs_f64() * 1e6);
                }
            }
            Outcome::Failed(_) => {
                self.failed += 1;
                self.failed_during_absence += u64::from(ran.during_absence);
                self.after_failure = 0;
            }
        }
        on(Event::Ended {
            request,
            outcome: &ran.outcome,
            done: self.done,
            total,
        });
    }

    /// Adds what another decode process measured over the same span: its samples and counts join
    /// these, and the timed span is the longer of the two (the processes ran side by side, so the
    /// bytes of both went by in that time).
    pub(crate) fn merge(&mut self, other: Tally) {
        self.latencies_us.extend(other.latencies_us);
        self.completes_us.extend(other.completes_us);
        self.posts_us.extend(other.posts_us);
        self.done += other.done;
        self.failed += other.failed;
        self.failed_during_absence += other.failed_during_absence;
        self.completed_across_absence += other.completed_across_absence;
        self.after_failure += other.after_failure;
        self.verified_requests += other.verified_requests;
        self.mismatches += other.mismatches;
        self.timed = self.timed.max(other.timed);
        self.cpu += other.cpu;
    }

    /// Adds what another decode TP rank saw of the same requests: failures as the most any rank
    /// saw (a lower bound on the requests that failed somewhere), mismatches summed over the ranks
    /// (a request that differs on two ranks counts twice), requests verified as the fewest any rank
    /// verified; the timed window is the longer one and CPU time adds up (each rank is a process),
    /// while latencies stay this rank's.
    pub(crate) fn merge_rank(&mut self, other: &Tally) {
        self.failed = self.failed.max(other.failed);
        self.failed_during_absence = self.failed_during_absence.max(other.failed_during_absence);
        self.mismatches += other.mismatches;
        self.verified_requests = self.verified_requests.min(other.verified_requests);
        self.timed = self.timed.max(other.timed);
        self.cpu += other.cpu;
    }

    /// What was measured, as a report whose baseline fields are left at zero.
    pub(crate) fn report(mut self, w: &Workload, backend: BackendKind) -> Report {
        let secs = self.timed.as_secs_f64().max(f64::MIN_POSITIVE);
        let ok = self.done.saturating_sub(self.failed) as f64;
        self.latencies_us.sort_by(f64::total_cmp);
        self.completes_us.sort_by(f64::total_cmp);
        self.posts_us.sort_by(f64::total_cmp);
        let chunks = w.prompt_tokens.div_ceil(w.chunk_tokens);
        Report {
            backend: backend.to_string(),
            gbps: ok * w.shape.request_bytes(w.prompt_tokens) as f64 / secs / 1e9,
            baseline_gbps: 0.0,
            baseline: String::new(),
            ratio: 0.0,
            cached_baseline_gbps: 0.0,
            vs_nixl: 0.0,
            stream_gbps: 0.0,
            stream_ratio: 0.0,
            memcpy_gbps: 0.0,
            requests_per_s: ok / secs,
            latency_p50_us: percentile(&self.latencies_us, 0.5),
            latency_p99_us: percentile(&self.latencies_us, 0.99),
            complete_p50_us: percentile(&self.completes_us, 0.5),
            complete_p99_us: percentile(&self.completes_us, 0.99),
            post_p50_us: percentile(&self.posts_us, 0.5),
            post_p99_us: percentile(&self.posts_us, 0.99),
            complete_samples: self.completes_us.len() as u64,
            chunks_per_s: ok * f64::from(chunks) * f64::from(w.pp) / secs,
            writes_per_s: ok * w.writes_per_request() as f64 / secs,
            baseline_msg_rate: 0.0,
            requests: self.done,
            failed: self.failed,
            failed_during_absence: self.failed_during_absence,
            completed_across_absence: self.completed_across_absence,
            completed_after_last_failure: self.after_failure,
            verified: self.verified_requests > 0
                && self.mismatches == 0
                && self.failed == self.failed_during_absence,
            verified_requests: self.verified_requests,
            prefill_instances: 1,
            decode_instances: 1,
            prefill_tp: 1,
            decode_tp: 1,
            registrations_per_process: 0,
            connections_per_decode: 0,
            decodes_per_prefill_rank: 0,
            writes_per_request: w.writes_per_request(),
            cpu_us_per_request: self.cpu.as_secs_f64() * 1e6 / (self.done.max(1) as f64),
            prefill_cpu_us_per_request: 0.0,
            prefill_copy_us_per_request: 0.0,
            prefill_cpu_us_per_chunk: 0.0,
            prefill_copy_us_per_chunk: 0.0,
            prefill_progress_us_per_chunk: 0.0,
            prefill_runtime_us_per_chunk: 0.0,
            prefill_other_us_per_chunk: 0.0,
            decode_pool_bytes: 0,
            register_ms: 0.0,
        }
    }
}

/// The driver both the in-process run and the decode role share: issues `w`'s requests through
/// `start(request, slot)` (which begins a request in destination slot `slot` and returns the future
/// of its end), `concurrency` slots at a time, and checks those [`Verify`] asks for: `prepare` before
/// and `check` after their timed window. `id(index, checked)` names the `index`-th request.
///
/// # Errors
/// The first error `start`, `prepare` or a request's future returns, or a request task's panic
/// (through `join_err`).
pub(crate) async fn drive<E, Fut>(
    w: &Workload,
    id: impl Fn(u64, bool) -> RequestId,
    mut start: impl FnMut(RequestId, u32) -> Result<Fut, E>,
    mut prepare: impl FnMut(RequestId, u32) -> Result<(), E>,
    mut check: impl FnMut(RequestId, u32) -> Result<u64, VerifyError>,
    join_err: impl Fn(tokio::task::JoinError) -> E,
    on: &(dyn Fn(Event<'_>) + Sync),
) -> Result<Tally, E>
where
    E: Send + 'static,
    Fut: std::future::Future<Output = Result<Ran, E>> + Send + 'static,
{
    let slots = w.concurrency.max(1);
    let total = u64::from(w.requests);
    let started = Instant::now();
    let running = || w.duration.is_some_and(|d| started.elapsed() < d);
    let mut t = Tally::default();
    let mut issued = 0u64;

    // Unchecked requests stream: a slot takes its next request as soon as its last one ended. With
    // `Last`, the final wave's requests are held back for the checked wave below.
    if w.verify != Verify::All {
        let held = if w.verify == Verify::Last {
            u64::from(slots).min(total.max(1))
        } else {
            0
        };
        let more = |issued: u64| issued + held < total || running();
        let mut set = tokio::task::JoinSet::new();
        let t0 = Instant::now();
        let c0 = cpu_time();
        for slot in 0..slots {
            if !more(issued) {
                break;
            }
            let request = id(issued, false);
            let fut = start(request, slot)?;
            set.spawn(async move { (slot, request, fut.await) });
            issued += 1;
        }
        while let Some(r) = set.join_next().await {
            let (slot, request, ran) = r.map_err(&join_err)?;
            t.record(request, &ran?, on, total.max(issued + held));
            if more(issued) {
                let request = id(issued, false);
                let fut = start(request, slot)?;
                set.spawn(async move { (slot, request, fut.await) });
                issued += 1;
            }
        }
        t.timed += t0.elapsed();
        t.cpu += cpu_time().saturating_sub(c0);
        if held == 0 {
            return Ok(t);
        }
    }

    // Checked requests run in waves: prepared, timed, then checked.
    let mut first = true;
    while first || (w.verify == Verify::All && (issued < total || running())) {
        first = false;
        let k = if issued < total {
            (total - issued).min(u64::from(slots))
        } else {
            u64::from(slots)
        };
        let wave: Vec<(u32, RequestId)> =
            (0..k).map(|i| (i as u32, id(issued + i, true))).collect();
        issued += k;
        for &(slot, request) in &wave {
            prepare(request, slot)?;
        }
        let mut set = tokio::task::JoinSet::new();
        let t0 = Instant::now();
        let c0 = cpu_time();
        for &(slot, request) in &wave {
            let fut = start(request, slot)?;
            set.spawn(async move { (slot, request, fut.await) });
        }
        let mut ended = Vec::with_capacity(wave.len());
        while let Some(r) = set.join_next().await {
            ended.push(r.map_err(&join_err)?);
        }
        t.timed += t0.elapsed();
        t.cpu += cpu_time().saturating_sub(c0);
        for (slot, request, ran) in ended {
            let ran = ran?;
            t.record(request, &ran, on, total.max(issued));
            if ran.outcome != Outcome::Complete {
                continue;
            }
            match check(request, slot) {
                Ok(_) => t.verified_requests += 1,
                Err(error) => {
                    t.mismatches += 1;
                    on(Event::VerifyFailed {
                        request,
                        error: &error,
                    });
                }
            }
        }
    }
    Ok(t)
}

/// Runs `w` on a fresh in-process cluster of `backend`.
///
/// Each destination slot has its own source pages on every rank, so that preparing a slot's next
/// request never writes pages a chunk in flight reads.
///
/// # Errors
/// Engine errors.
pub async fn run_workload(
    w: &Workload,
    backend: BackendKind,
    progress: Option<&(dyn Fn(u64, u64) + Sync)>,
) -> Result<Report, EngineError> {
    let pages = w.pages();
    let slots = w.concurrency.max(1);
    let spec = ClusterSpec {
        shape: w.shape,
        pp: w.pp,
        decode_pages: pages * slots,
        prefill_pages: pages * slots,
        backend,
        checksums: w.checksums,
        decode_pool: w.decode_pool,
        metrics: w.metrics,
        decode_progress: w.decode_progress,
    };
    let instances = w.prefill_instances.max(1);
    let decodes = w.decode_instances.max(1);
    let cluster = Arc::new(Cluster::start_grid(spec, instances, decodes).await?);
    // Counted once every link is up, before any request.
    let mut registrations = 0;
    let mut connections = 0;
    for d in cluster.decodes() {
        let s = d.stats();
        registrations = registrations.max(s.registrations);
        connections = connections.max(s.connected_ranks);
    }
    let mut links = u64::MAX;
    for k in 0..cluster.instance_names.len() {
        for p in cluster.pipeline(k).map(|(_, r)| r).unwrap_or_default() {
            registrations = registrations.max(p.transport_stats().regions);
            links = links.min(p.stats().decodes);
        }
    }
    // Each destination slot's requests come from one instance and go to one decode, in turn.
    let instance_of = |slot: u32| (slot % u32::from(instances)) as usize;
    let decode_of = |slot: u32| ((slot / u32::from(instances)) % u32::from(decodes)) as usize;
    let src = |slot: u32| -> Vec<u32> { (slot * pages..(slot + 1) * pages).collect() };
    let chunks = w.prompt_tokens.div_ceil(w.chunk_tokens);
    let on = |e: Event<'_>| match e {
        Event::Ended {
            outcome,
            done,
            total,
            ..
        } => {
            if let Outcome::Failed(reason) = outcome {
                tracing::warn!(?reason, "request failed");
            }
            if let Some(p) = progress {
                p(done, total);
            }
        }
        Event::VerifyFailed { request, error } => {
            tracing::error!(%error, ?request, "verification failed");
        }
    };
    let tally = drive(
        w,
        |i, _| RequestId(i + 1),
        |request, slot| {
            Ok(one_request(
                cluster.clone(),
                (instance_of(slot), decode_of(slot)),
                request,
                src(slot),
                w.dst_pages(slot),
                w.prompt_tokens,
                w.chunk_tokens,
                chunks,
                w.request_timeout,
            ))
        },
        |request, slot| {
            cluster
                .prepare_at(
                    instance_of(slot),
                    decode_of(slot),
                    request,
                    &src(slot),
                    &w.dst_pages(slot),
                )
                .map_err(|e| EngineError::Config(format!("preparing {request:?}: {e}")))
        },
        |request, slot| cluster.verify_at(decode_of(slot), request, &w.dst_pages(slot)),
        |e| EngineError::Config(format!("request task: {e}")),
        &on,
    )
    .await?;
    linger(
        w,
        cluster
            .decodes()
            .next()
            .and_then(DecodeEngine::metrics_addr),
    )
    .await;
    let (pool_bytes, register_ms) = cluster.decodes().next().map_or((0, 0.0), |d| {
        let s = d.stats();
        (s.registered_bytes, s.register_micros as f64 / 1e3)
    });
    // Frees each decode's pool only once every rank confirmed its writes are over.
    for d in cluster.decodes() {
        let closed = d.clone().shutdown(SHUTDOWN).await;
        if !closed.pool_freed {
            eprintln!("kvbench: decode pool leaked, ranks did not confirm shutdown: {closed:?}");
        }
    }
    let mut report = tally.report(w, backend);
    report.decode_pool_bytes = pool_bytes;
    report.register_ms = register_ms;
    report.prefill_instances = u64::from(instances);
    report.decode_instances = u64::from(decodes);
    report.registrations_per_process = registrations;
    report.connections_per_decode = connections;
    report.decodes_per_prefill_rank = if links == u64::MAX { 0 } else { links };
    Ok(report)
}

/// How long a finished run waits for every rank to confirm that its writes are over.
pub const SHUTDOWN: Duration = Duration::from_secs(10);

#[allow(clippy::too_many_arguments)] // one request's whole description, passed to a spawned task
async fn one_request(
    cluster: Arc<Cluster>,
    (instance, decode): (usize, usize),
    request: RequestId,
    src: Vec<u32>,
    dst: Vec<u32>,
    prompt_tokens: u32,
    chunk_tokens: u32,
    chunks: u32,
    timeout: Duration,
) -> Result<Ran, EngineError> {
    let src = Arc::new(src);
    let t0 = Instant::now();
    let (name, pipeline) = cluster
        .pipeline(instance)
        .ok_or_else(|| EngineError::Config(format!("no prefill instance {instance}")))?;
    let outcome = cluster
        .decode_at(decode)
        .ok_or_else(|| EngineError::Config(format!("no decode engine {decode}")))?
        .expect_request(
            request,
            transfer_engine::engine::Expected {
                instance: name.to_owned(),
                prefix_tokens: 0,
                prompt_tokens,
                chunk_tokens,
                dst_pages: dst,
                timeout,
            },
        )?;
    let mut ranks = tokio::task::JoinSet::new();
    for p in pipeline {
        let p = p.clone();
        let src = src.clone();
        ranks.spawn(async move {
            for c in 0..chunks {
                if let Err(e) = p.send_chunk(request, c, &src, c + 1 == chunks).await {
                    p.fail(request, FailureCode::WriteFailed);
                    return Err(e);
                }
            }
            // Stamped on the progress thread when the LAST chunk's writes were remotely complete,
            // and by send_chunk when it handed them to the transport.
            let last_done = p.last_chunk_done_at(request);
            let last_posted = p.last_chunk_posted_at(request);
            p.decided(request).await;
            p.release(request);
            Ok((last_done, last_posted))
        });
    }
    let outcome = outcome.await;
    let latency = t0.elapsed();
    let (mut last_done, mut last_posted) = (t0, None);
    while let Some(r) = ranks.join_next().await {
        let (done, posted) = r.map_err(|e| EngineError::Config(format!("rank task: {e}")))??;
        last_done = last_done.max(done.unwrap_or(t0));
        last_posted = last_posted.max(posted);
    }
    // Both instants come from the progress threads: the last rank's final chunk over, and the
    // decode tracker emitting Complete. Decode can see it first (its notification overtook the
    // sender's own completion callback): that counts as zero.
    let completed = cluster
        .decode_at(decode)
        .and_then(|d| d.completed_at(request));
    let complete = completed
        .map(|t| t.saturating_duration_since(last_done))
        .unwrap_or_default();
    // No sample where no rank stamped its post (a request that failed before it).
    let posted = completed
        .zip(last_posted)
        .map(|(t, p)| t.saturating_duration_since(p));
    Ok(Ran {
        outcome,
        latency,
        complete: Some(complete),
        posted,
        during_absence: false,
    })
}

/// Where `ucx_perftest` is: `KVBENCH_UCX_PERFTEST`, else the provisioned copy next to the build.
pub fn find_perftest() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("KVBENCH_UCX_PERFTEST") {
        return Some(PathBuf::from(p)).filter(|p| p.exists());
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join(".deps/ucx/bin/ucx_perftest");
    here.exists().then_some(here)
}

/// A command for a helper process that must not outlive the thread that starts it: the kernel kills
/// it (SIGKILL) when that thread ends, also when this process is killed by a signal, through
/// util-linux's `setpriv --pdeathsig KILL` where it is installed (a plain command otherwise). Start it
/// from a thread that lives as long as the helper is needed (the main thread, or the one that waits
/// for it).
pub fn dies_with_us(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let setpriv = Path::new("/usr/bin/setpriv");
    if setpriv.exists() {
        let mut c = Command::new(setpriv);
        c.args(["--pdeathsig", "KILL", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// A command for one of UCX's own tools, keeping UCX's EFA module out of it as the engine keeps it out
/// of its own processes (it crashes at exit wherever rdma-core is installed), unless the environment
/// sets `UCX_MODULES`. It dies with us ([`dies_with_us`]).
fn ucx_tool(tool: &Path) -> Command {
    let mut c = dies_with_us(tool);
    if std::env::var_os("UCX_MODULES").is_none() {
        c.env("UCX_MODULES", "^efa");
    }
    c
}

/// `ucx_perftest` between two processes on loopback: a server, then a client with `args` retried
/// until it connects or a minute passes. The client's `Final:` line split into columns, `None`
/// when the tool fails.
fn perftest_final(tool: &Path, args: &[String]) -> Option<Vec<String>> {
    let port = crate::cluster::free_addrs(1).ok()?.first()?.port();
    let mut server = ucx_tool(tool)
        .args(["-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out = None;
    // The server needs a moment to listen; the client retries until it connects or the deadline.
    while Instant::now() < deadline {
        let o = ucx_tool(tool)
            .args(["127.0.0.1", "-p", &port.to_string()])
            .args(args)
            .output()
            .ok()?;
        if o.status.success() {
            out = Some(String::from_utf8_lossy(&o.stdout).into_owned());
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = server.kill();
    let _ = server.wait();
    let out = out?;
    let line = out.lines().find(|l| l.starts_with("Final:"))?;
    Some(line.split_whitespace().map(str::to_owned).collect())
}

/// `ucx_perftest -t ucp_put_bw` at `size` bytes between two processes on loopback: GB/s (10^9) and
/// messages per second.
/// `None` when the tool fails; the reason is logged.
pub fn perftest_put_bw(tool: &Path, size: u64, iters: u32) -> Option<(f64, f64)> {
    let warmup = (iters / 10).max(10);
    let args = [
        "-t",
        "ucp_put_bw",
        "-s",
        &size.to_string(),
        "-n",
        &iters.to_string(),
    ]
    .into_iter()
    .map(str::to_owned)
    .chain(["-w".to_owned(), warmup.to_string()])
    .collect::<Vec<_>>();
    let cols = perftest_final(tool, &args)?;
    // Final: iterations, 3 overheads, bandwidth average and overall (MB/s, 2^20), message rates.
    let mbs: f64 = cols.get(6)?.parse().ok()?;
    let rate: f64 = cols.get(8)?.parse().ok()?;
    Some((mbs * 1048576.0 / 1e9, rate))
}

/// `ucx_perftest -t ucp_put_lat` at `size` bytes between two processes on loopback, `iters`
/// iterations: the median and the average latency, µs, as the tool reports them (half a round
/// trip of puts, each side polling memory for the other's). `None` when the tool fails.
pub fn perftest_put_lat(tool: &Path, size: u64, iters: u32) -> Option<(f64, f64)> {
    let args = [
        "-t",
        "ucp_put_lat",
        "-s",
        &size.to_string(),
        "-n",
        &iters.to_string(),
    ]
    .map(str::to_owned);
    let cols = perftest_final(tool, &args)?;
    // Final: iterations, latency median, average and overall (µs), then bandwidths and rates.
    Some((cols.get(2)?.parse().ok()?, cols.get(3)?.parse().ok()?))
}

/// An in-process put baseline: one UCX transport putting `size`-byte writes into another, `batch`
/// writes per post (two posts in flight, like two pipelined chunks), cycling through buffers of
/// `span` bytes, for about `secs` seconds. With `span` equal to one write batch the buffers stay in
/// cache, as `ucx_perftest`'s do; with `span` as large as a request they stream through memory, as the
/// engine's writes do. GB/s (10^9).
///
/// # Errors
/// Transport failures.
pub fn inprocess_put_bw(size: u64, batch: u32, span: u64, secs: f64) -> Result<f64, EngineError> {
    let step = size * u64::from(batch);
    let slots = (span / step).max(2);
    let len = (step * slots) as usize;
    let opts = HostOptions {
        prefault: true,
        ..Default::default()
    };
    let dst = HostBuffer::new(len, opts).map_err(|e| EngineError::Config(e.to_string()))?;
    let mut src = HostBuffer::new(len, opts).map_err(|e| EngineError::Config(e.to_string()))?;
    src.as_mut_slice().fill(1);
    let rx: Arc<dyn Transport> =
        Arc::new(UcxTransport::new(UcxConfig::default(), Arc::new(|_| {}))?);
    let tx: Arc<dyn Transport> =
        Arc::new(UcxTransport::new(UcxConfig::default(), Arc::new(|_| {}))?);
    let dst = Registration::new(&rx, Pool::Owned(dst))?;
    let src = Registration::new(&tx, Pool::Owned(src))?;
    let s = src.id();
    let peer = tx.connect(&rx.metadata()?, &[dst.remote().clone()], 0)?;
    let batch_at = |slot: u64| -> Vec<WriteOp> {
        (0..u64::from(batch))
            .map(|i| {
                let off = slot * step + i * size;
                WriteOp {
                    local: s,
                    local_offset: off,
                    remote: 0,
                    remote_offset: off,
                    len: size,
                    rows: 1,
                    local_stride: 0,
                    remote_stride: 0,
                }
            })
            .collect()
    };
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let post = |slot: u64| {
        let d = done_tx.clone();
        tx.post(
            peer,
            batch_at(slot % slots),
            Vec::new(),
            Box::new(move |r| {
                let _ = d.send(r);
            }),
        );
    };
    let start = Instant::now();
    let mut bytes = 0u64;
    let mut next = 0u64;
    for _ in 0..2 {
        post(next);
        next += 1;
    }
    while start.elapsed().as_secs_f64() < secs {
        done_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| EngineError::Timeout("baseline put".into()))??;
        bytes += step;
        post(next);
        next += 1;
    }
    let gbps = bytes as f64 / start.elapsed().as_secs_f64() / 1e9;
    let mut over = 0;
    for _ in 0..2 {
        over += usize::from(done_rx.recv_timeout(Duration::from_secs(10)).is_ok());
    }
    tx.disconnect(peer);
    if over == 2 {
        // SAFETY: the only peer given `dst`'s registration is `tx`, whose two last posts have
        // ended (their Done ran) and which is disconnected: nothing writes into `dst` any more.
        unsafe { dst.assume_quiesced() };
    }
    Ok(gbps)
}

/// A plain copy streaming through two buffers of `span` bytes, for about `secs` seconds. GB/s.
///
/// # Errors
/// The buffers cannot be allocated.
pub fn memcpy_bw(span: u64, secs: f64) -> Result<f64, EngineError> {
    let opts = HostOptions {
        prefault: true,
        ..Default::default()
    };
    let mut dst =
        HostBuffer::new(span as usize, opts).map_err(|e| EngineError::Config(e.to_string()))?;
    let mut src =
        HostBuffer::new(span as usize, opts).map_err(|e| EngineError::Config(e.to_string()))?;
    src.as_mut_slice().fill(1);
    let start = Instant::now();
    let mut bytes = 0u64;
    while start.elapsed().as_secs_f64() < secs {
        dst.as_mut_slice().copy_from_slice(src.as_slice());
        std::hint::black_box(dst.as_slice());
        bytes += span;
    }
    Ok(bytes as f64 / start.elapsed().as_secs_f64() / 1e9)
}

/// With `--metrics` and `--metrics-linger`: says on stderr that the run is over and keeps the
/// engines (and their endpoint at `addr`) up for the linger.
pub async fn linger(w: &Workload, addr: Option<std::net::SocketAddr>) {
    if let Some(addr) = addr
        && !w.metrics_linger.is_zero()
    {
        eprintln!(
            "kvbench: run over; metrics stay on http://{addr}/metrics for {:.1} s",
            w.metrics_linger.as_secs_f64()
        );
        tokio::time::sleep(w.metrics_linger).await;
    }
}
