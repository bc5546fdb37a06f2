//! kvbench: how fast the engine moves a request's KV cache, as a ratio to a raw put baseline measured
//! in the same run.
//!
//! With no arguments it runs the embedded default (a DeepSeek-R1-like MLA shape, PP=4, 8k-token
//! prompts in 1024-token chunks) on loopback, on every backend, and prints one table.

use clap::{Parser, Subcommand, ValueEnum};
use kvbench::bench::{
    Report, Verify, Workload, dies_with_us, find_perftest, inprocess_put_bw, memcpy_bw,
    perftest_put_bw, perftest_put_lat, run_workload,
};
use kvbench::cluster::{PoolKind, Shape};
use kvbench::roles;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use transfer_engine::control::Secret;
use transfer_engine::core::planner::RegionKind;
use transfer_engine::discovery::EtcdConfig;
use transfer_engine::transport::{BackendKind, ProgressScheduling};

/// The environment variable holding the roles' shared secret when `--token-file` is not given.
const TOKEN_ENV: &str = "KVX_TOKEN";

/// The largest `--request-timeout` accepted, seconds (about 11.6 days).
const MAX_REQUEST_TIMEOUT_S: f64 = 1e6;

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Model {
    /// DeepSeek-R1-like: 61 layers, 576 B/token/layer fused latent, 64-token pages.
    Mla,
    /// Llama-3-8B-like: 32 layers, 4 KiB/token/layer as K and V, 16-token pages.
    Gqa,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Backend {
    /// Direct UCX.
    Ucx,
    /// NIXL with its UCX plugin.
    Nixl,
    /// Both, side by side.
    All,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum PoolArg {
    Shared,
    Caller,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
enum VerifyArg {
    None,
    Last,
    All,
}

#[derive(Debug, Parser)]
#[command(
    name = "kvbench",
    version,
    about = "KV-cache transfer benchmark (loopback by default)"
)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    #[command(flatten)]
    opts: Opts,
}

#[derive(Debug, clap::Args, Clone)]
struct Opts {
    /// Model shape.
    #[arg(long, value_enum, default_value = "mla", global = true)]
    model: Model,
    /// Override: layers.
    #[arg(long, global = true)]
    layers: Option<u32>,
    /// Override: KV bytes per token per layer (K and V together).
    #[arg(long, global = true)]
    bytes_per_token: Option<u64>,
    /// Override: separate K and V regions (true) or one fused region (false).
    #[arg(long, global = true)]
    split_kv: Option<bool>,
    /// Prefill PP size.
    #[arg(long, default_value_t = 4, global = true)]
    pp: u16,
    /// Prefill instances (pipelines of --pp ranks each) into every decode engine: each decode's
    /// requests go to them in turn. The decode engine registers its pool once for all. With
    /// --processes every rank of every instance is a process of its own.
    #[arg(long, default_value_t = 1, global = true)]
    prefill_instances: u16,
    /// Decode engines (instances, each with its own pool): every prefill rank serves all of them
    /// from its one engine. In one process requests go to them in turn; with --processes each is a
    /// process of its own that runs --requests at --concurrency of its own, and the first reports
    /// them all. Each engine, prefill or decode, registers its pool once.
    #[arg(long, default_value_t = 1, global = true)]
    decode_instances: u16,
    /// Prefill TP size (with --decode-tp): every decode TP rank is an engine, every prefill (PP,
    /// TP) rank one engine writing into every decode rank it shares heads with, every byte of
    /// every decode rank's pages checked against the heads it holds. In one process it runs
    /// identical TP (--decode-tp on both sides) and this mapping on the same workload; with
    /// --processes every engine is a process of its own, with any number of instances.
    #[arg(long, global = true)]
    prefill_tp: Option<u16>,
    /// Decode TP size (with --prefill-tp).
    #[arg(long, global = true)]
    decode_tp: Option<u16>,
    /// Tokens in a decode page for --prefill-tp/--decode-tp (prefill's are the model's): the
    /// mapped run writes prefill's pages into decode pages of this size (the identical run keeps
    /// the model's on both sides). The prompt must be whole pages of both sizes.
    #[arg(long, global = true)]
    decode_page_tokens: Option<u32>,
    /// The model's KV heads for --prefill-tp/--decode-tp: heads are sliced over TP ranks (or
    /// replicated, with fewer heads than ranks). Default: 8 for --model gqa, none (MLA's latent,
    /// whole on every rank) for mla.
    #[arg(long, global = true)]
    kv_heads: Option<u32>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 8192, global = true)]
    prompt_tokens: u32,
    /// Chunked-prefill size in tokens.
    #[arg(long, default_value_t = 1024, global = true)]
    chunk_tokens: u32,
    /// Tokens per page (default: the model's).
    #[arg(long, global = true)]
    page_tokens: Option<u32>,
    /// Requests to run.
    #[arg(long, default_value_t = 32, global = true)]
    requests: u32,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 2, global = true)]
    concurrency: u32,
    /// Backend(s).
    #[arg(long, value_enum, default_value = "all", global = true)]
    backend: Backend,
    /// Byte-for-byte verification, each checked request with its own pattern on poisoned pages,
    /// prepared and checked outside the timed windows: none; last (the last request of each
    /// destination slot, run as a final wave); all (every request, in waves of --concurrency).
    #[arg(long, value_enum, default_value = "last", global = true)]
    verify: VerifyArg,
    /// Send and check per-chunk checksums.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, global = true)]
    checksums: bool,
    /// Keep running requests for at least this many seconds.
    #[arg(long, global = true)]
    duration: Option<f64>,
    /// Each request's deadline in seconds: a request not complete by then fails with Timeout.
    #[arg(long, default_value_t = 60.0, global = true)]
    request_timeout: f64,
    /// Also write the results as a JSON array to this file.
    #[arg(long, global = true)]
    json: Option<PathBuf>,
    /// Skip the raw baseline.
    #[arg(long, global = true)]
    no_baseline: bool,
    /// Run the workload with every engine in its own process (the deployment shape): this process
    /// starts one `kvbench decode` and one `kvbench prefill` per PP rank on loopback, with a fresh
    /// shared secret, per backend, and exits non-zero if any of them does. Decode prints the table.
    #[arg(long)]
    processes: bool,
    /// Destination pages in reverse order: no coalescing, one write per page (page-rate workload).
    #[arg(long, global = true)]
    scatter: bool,
    /// The pools: shared (allocated by the transport; with UCX, shared memory that same-host peers
    /// map and write with their own CPU copies; NIXL cannot allocate and gets private memory) or
    /// caller (private memory, as a server's own buffers; UCX writes into it with a
    /// process_vm_writev call per write).
    #[arg(long, value_enum, default_value = "shared", global = true)]
    pool: PoolArg,
    /// `decode` and `prefill`: a file holding the secret every process of a run shares (a trailing
    /// newline is not part of it), readable by its owner only (mode 600 or 400; others are refused).
    /// Without it, the `KVX_TOKEN` environment variable. The loopback
    /// run draws a fresh secret of its own.
    #[arg(long, global = true)]
    token_file: Option<PathBuf>,
    /// `decode` and `prefill` on one host: a folder they share. Each prefill process writes there,
    /// at its end, when each request's last write was over (wall clock); decode reads those after its
    /// run to report last write to Complete (the cmpl columns), which no single process can time.
    /// `--processes` makes one by itself.
    #[arg(long, global = true)]
    stamps: Option<PathBuf>,
    /// `decode` and `prefill`: seconds between heartbeats on every control connection (default 5);
    /// a peer silent for three intervals is declared lost.
    #[arg(long, global = true)]
    heartbeat: Option<f64>,
    /// Serve Prometheus metrics (`GET /metrics`, OpenMetrics text) of every engine of this process
    /// on this address while it runs. With `--processes`, the decode process serves it.
    #[arg(long, global = true)]
    metrics: Option<std::net::SocketAddr>,
    /// With `--metrics`: seconds the engines stay up after the run, serving its final counts,
    /// before they shut down (default 0). The decode side says on stderr when it begins.
    #[arg(long, global = true, default_value_t = 0.0)]
    metrics_linger: f64,
    /// Run decode engines' progress threads (the threads that see prefill's notifications arrive)
    /// under `SCHED_FIFO` at this priority (1 to 99), so a notification is seen as soon as it arrives
    /// however busy the cores are. Needs `CAP_SYS_NICE` or an `RLIMIT_RTPRIO` of at least it; the
    /// run fails to start without. With `--processes`, the decode process takes it.
    #[arg(long, global = true, value_parser = clap::value_parser!(u8).range(1..=99))]
    progress_fifo: Option<u8>,
    /// How long decode engines' progress threads keep polling after their last event before they
    /// sleep, in microseconds (default: a decode engine's, 10 with ucx, then asleep on UCX's event
    /// fd; nixl's 200). Polling catches the next notification without a wake-up, at the cost of
    /// the CPU it polls with; under `--progress-fifo` it also holds the core meanwhile.
    #[arg(long, global = true)]
    progress_spin_us: Option<u64>,
    /// `decode` and `prefill`: find each other through etcd at these endpoints (comma-separated
    /// `http://host:port`) instead of `--listen`/`--connect`/`--peers`. With `--processes`,
    /// `auto` starts a local etcd server (Debian's `etcd`) for the run.
    #[arg(long, global = true)]
    etcd: Option<String>,
    /// The cluster's name in etcd: engines under different names never see each other.
    #[arg(long, default_value = "kvbench", global = true)]
    cluster: String,
    /// Seconds an engine's etcd lease lives without renewal: a dead or stopped engine is seen gone
    /// within it.
    #[arg(long, default_value_t = 5.0, global = true)]
    lease_ttl: f64,
    /// With `--etcd`: the etcd user (an etcd with authentication enabled); its password comes from
    /// the `KVX_ETCD_PASSWORD` environment variable.
    #[arg(long, global = true)]
    etcd_user: Option<String>,
    /// With `--etcd` over `https://`: the PEM file of the certificate authority that signed etcd's
    /// certificate.
    #[arg(long, global = true)]
    etcd_ca: Option<PathBuf>,
    /// With `--etcd-ca`: this process's certificate and key (PEM), for an etcd that asks clients
    /// for one.
    #[arg(long, global = true, requires = "etcd_key")]
    etcd_cert: Option<PathBuf>,
    /// The key of `--etcd-cert`.
    #[arg(long, global = true, requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Run a decode engine that prefill processes connect to, drive the requests, print the table.
    Decode {
        /// Control address to listen on (with --etcd, default 127.0.0.1 on any free port).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// Which of --decode-instances this process is (0 first). Its request ids are its own;
        /// with --stamps, every one but the first leaves its results there and the first prints
        /// the table of them all.
        #[arg(long, default_value_t = 0)]
        decode_index: u16,
        /// With --decode-tp: which decode TP rank this process is (0 first, which reports).
        #[arg(long, default_value_t = 0)]
        tp_rank: u16,
    },
    /// Run one prefill PP rank that connects to decode processes and serves their requests.
    Prefill {
        /// The decode processes' control addresses, comma-separated, the first decode instance's
        /// first (found through --etcd otherwise). One engine serves them all.
        #[arg(long, value_delimiter = ',')]
        connect: Vec<std::net::SocketAddr>,
        /// Which of the --prefill-instances this rank belongs to (0 first).
        #[arg(long, default_value_t = 0)]
        instance: u16,
        /// This rank.
        #[arg(long)]
        pp_rank: u16,
        /// With --prefill-tp: this rank's TP rank (0 first). It connects to the decode TP ranks
        /// it shares heads with, out of --connect's (all of them, in rank order).
        #[arg(long, default_value_t = 0)]
        tp_rank: u16,
        /// PP size: decode's, which the role reads from it (given, it must equal decode's).
        #[arg(long)]
        pp_size: Option<u16>,
        /// Vote-mesh addresses of all ranks, comma-separated, in rank order (needed when PP > 1,
        /// found through --etcd otherwise).
        #[arg(long, value_delimiter = ',')]
        peers: Vec<std::net::SocketAddr>,
    },
    /// The latency of a single 4 KiB write from post to decode seeing it complete: requests of one
    /// layer's one page of 4 KiB (one write and its notification, PP 1), one at a time, in this
    /// process on every backend asked for, beside `ucx_perftest -t ucp_put_lat -s 4096` between
    /// two processes in the same run. Exits non-zero if a request fails, the last one's bytes
    /// differ, or the baseline cannot be measured.
    Latency {
        /// Requests (writes) per backend.
        #[arg(long, default_value_t = 2000)]
        writes: u32,
    },
    /// Time a decode engine's registration of a pool of `--gib` GiB on every backend asked for:
    /// a pool the caller allocated and faulted in (`--pool caller`'s kind; its allocation is timed
    /// too, apart) and one the transport allocates, populates and registers (`shared`), each in
    /// turn. Prints the time and the time per GiB; exits non-zero if a pool cannot be had.
    Register {
        /// Pool size in GiB.
        #[arg(long, default_value_t = 1.0)]
        gib: f64,
    },
    /// Run the workload (in this process, without baselines) over a grid of page sizes,
    /// concurrencies and prompt lengths on every backend asked for, and write `sweep.json` and
    /// `sweep.svg` (GB/s and p99 request latency against page size) into `--out`.
    Sweep {
        /// Folder for `sweep.json` and `sweep.svg` (made if missing).
        #[arg(long)]
        out: PathBuf,
        /// Tokens per page, comma-separated.
        #[arg(long, value_delimiter = ',', default_values_t = [16, 64, 256])]
        pages: Vec<u32>,
        /// Requests in flight at once, comma-separated.
        #[arg(long, value_delimiter = ',', default_values_t = [1, 4])]
        concurrencies: Vec<u32>,
        /// Prompt lengths in tokens, comma-separated (default: --prompt-tokens).
        #[arg(long, value_delimiter = ',')]
        prompts: Vec<u32>,
    },
}

impl Opts {
    /// Whether this is a run of the TP harness (`--prefill-tp`, `--decode-tp` or
    /// `--decode-page-tokens`).
    fn tp_run(&self) -> bool {
        self.prefill_tp.is_some() || self.decode_tp.is_some() || self.decode_page_tokens.is_some()
    }

    fn shape(&self) -> Result<Shape, String> {
        let mut s = match self.model {
            Model::Mla => Shape::MLA,
            Model::Gqa => Shape::GQA,
        };
        if let Some(l) = self.layers {
            s.layers = l;
        }
        if let Some(b) = self.bytes_per_token {
            s.bytes_per_token = b;
        }
        if let Some(split) = self.split_kv {
            s.regions = if split {
                RegionKind::SplitKv
            } else {
                RegionKind::Fused
            };
        }
        if let Some(p) = self.page_tokens {
            s.page_tokens = p;
        }
        if s.layers == 0 || s.bytes_per_token == 0 || s.page_tokens == 0 {
            return Err("layers, bytes per token and page tokens must be positive".into());
        }
        if s.bytes_per_token % u64::from(s.regions.count()) != 0 {
            return Err("bytes per token must split evenly into K and V".into());
        }
        if u32::from(self.pp) > s.layers || self.pp == 0 {
            return Err(format!(
                "--pp {} must be between 1 and the layer count {}",
                self.pp, s.layers
            ));
        }
        Ok(s)
    }

    fn workload(&self) -> Result<Workload, String> {
        if self.prompt_tokens == 0 || self.chunk_tokens == 0 {
            return Err("--prompt-tokens and --chunk-tokens must be positive".into());
        }
        if self.requests == 0 && self.duration.is_none() {
            return Err("--requests must be positive (or give --duration)".into());
        }
        let duration = match self.duration {
            Some(d) if d.is_finite() && d >= 0.0 => Some(Duration::from_secs_f64(d)),
            Some(d) => return Err(format!("--duration {d} is not a number of seconds")),
            None => None,
        };
        // Positive and finite; capped so that a deadline (now + timeout) can never overflow an Instant.
        let request_timeout = match self.request_timeout {
            t if t.is_finite() && t > 0.0 && t <= MAX_REQUEST_TIMEOUT_S => {
                Duration::from_secs_f64(t).max(Duration::from_nanos(1))
            }
            t => {
                return Err(format!(
                    "--request-timeout {t} must be a positive, finite number of seconds, at most \
                     {MAX_REQUEST_TIMEOUT_S}"
                ));
            }
        };
        let shape = self.shape()?;
        Ok(Workload {
            shape,
            pp: self.pp,
            prompt_tokens: self.prompt_tokens,
            chunk_tokens: self.chunk_tokens,
            requests: self.requests,
            concurrency: self.concurrency.max(1),
            verify: match self.verify {
                VerifyArg::None => Verify::None,
                VerifyArg::Last => Verify::Last,
                VerifyArg::All => Verify::All,
            },
            checksums: self.checksums,
            duration,
            scatter: self.scatter,
            request_timeout,
            decode_pool: match self.pool {
                PoolArg::Shared => PoolKind::Shared,
                PoolArg::Caller => PoolKind::Caller,
            },
            prefill_instances: self.prefill_instances.max(1),
            decode_instances: self.decode_instances.max(1),
            metrics: self.metrics,
            metrics_linger: Duration::try_from_secs_f64(self.metrics_linger)
                .map_err(|e| format!("--metrics-linger {}: {e}", self.metrics_linger))?,
            decode_progress: kvbench::cluster::DecodeProgress {
                scheduling: self
                    .progress_fifo
                    .map_or(ProgressScheduling::Normal, ProgressScheduling::Fifo),
                spin: self.progress_spin_us.map(Duration::from_micros),
            },
            tp: self.tp_run().then(|| self.tp_plan(shape.page_tokens)),
        })
    }

    /// The TP plan the flags give (each side TP 1, the model's page size, unless set).
    fn tp_plan(&self, page_tokens: u32) -> kvbench::tp::TpPlan {
        let decode_tp = self.decode_tp.unwrap_or(1);
        kvbench::tp::TpPlan {
            prefill_tp: self.prefill_tp.unwrap_or(decode_tp),
            decode_tp,
            kv_heads: self.kv_heads.unwrap_or(match self.model {
                Model::Gqa => 8,
                Model::Mla => 0,
            }),
            decode_page_tokens: self.decode_page_tokens.unwrap_or(page_tokens),
        }
    }

    /// The etcd settings of the multi-process roles, if `--etcd` was given; their records are
    /// authenticated with the roles' shared secret `token`.
    fn discovery(&self, token: Option<&[u8]>) -> Result<Option<EtcdConfig>, String> {
        let Some(urls) = &self.etcd else {
            return Ok(None);
        };
        if urls == "auto" {
            return Err("--etcd auto starts a server only with --processes".into());
        }
        if !(self.lease_ttl.is_finite() && (1.0..=3600.0).contains(&self.lease_ttl)) {
            return Err(format!(
                "--lease-ttl {} must be 1 to 3600 seconds",
                self.lease_ttl
            ));
        }
        let mut cfg = EtcdConfig::new(String::new(), self.cluster.clone());
        cfg.endpoints = urls.split(',').map(str::to_string).collect();
        cfg.lease_ttl = Duration::from_secs_f64(self.lease_ttl);
        cfg.secret = token.map_or_else(Secret::none, Secret::new);
        cfg.prefix().map_err(|e| e.to_string())?;
        if let Some(name) = &self.etcd_user {
            let password = std::env::var("KVX_ETCD_PASSWORD")
                .map_err(|_| "--etcd-user needs KVX_ETCD_PASSWORD".to_string())?;
            cfg.user = Some(transfer_engine::discovery::EtcdUser {
                name: name.clone(),
                password,
            });
        }
        match (&self.etcd_ca, &self.etcd_cert, &self.etcd_key) {
            (Some(ca), cert, key) => {
                cfg.tls = Some(transfer_engine::discovery::EtcdTls {
                    ca: ca.clone(),
                    identity: cert.clone().zip(key.clone()),
                    domain: None,
                });
            }
            (None, None, None) => {}
            (None, _, _) => return Err("--etcd-cert and --etcd-key need --etcd-ca".into()),
        }
        Ok(Some(cfg))
    }

    /// The shared secret of the multi-process roles: `--token-file`, else `KVX_TOKEN`, else none.
    /// Errors name where the secret came from, never the secret.
    fn token(&self) -> Result<Option<Vec<u8>>, String> {
        let (mut secret, from) = if let Some(path) = &self.token_file {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(path)
                .map_err(|e| format!("cannot read --token-file {}: {e}", path.display()))?
                .permissions()
                .mode();
            if mode & 0o077 != 0 {
                return Err(format!(
                    "--token-file {} has mode {:o}: others may read or change the secret; chmod 600 it",
                    path.display(),
                    mode & 0o777
                ));
            }
            let bytes = std::fs::read(path)
                .map_err(|e| format!("cannot read --token-file {}: {e}", path.display()))?;
            (bytes, format!("--token-file {}", path.display()))
        } else if let Some(v) = std::env::var_os(TOKEN_ENV) {
            (v.into_encoded_bytes(), TOKEN_ENV.to_string())
        } else {
            return Ok(None);
        };
        // Files written by `echo` or an editor end in a newline that is not part of the secret.
        if secret.last() == Some(&b'\n') {
            secret.pop();
            if secret.last() == Some(&b'\r') {
                secret.pop();
            }
        }
        if secret.is_empty() {
            return Err(format!("the secret from {from} is empty"));
        }
        Ok(Some(secret))
    }

    fn backends(&self) -> Vec<BackendKind> {
        match self.backend {
            Backend::Ucx => vec![BackendKind::Ucx],
            Backend::Nixl => vec![BackendKind::Nixl],
            Backend::All => vec![BackendKind::Ucx, BackendKind::Nixl],
        }
    }
}

fn print_table(w: &Workload, reports: &[Report]) {
    println!(
        "kvbench: {} layers x {} B/token/layer ({}), {}-token pages, PP={}, {}-token prompts in {}-token chunks, \
         {} B per coalesced write",
        w.shape.layers,
        w.shape.bytes_per_token,
        if w.shape.regions == RegionKind::Fused {
            "fused"
        } else {
            "K+V"
        },
        w.shape.page_tokens,
        w.pp,
        w.prompt_tokens,
        w.chunk_tokens,
        w.write_size()
    );
    if let (Some(r), Some(plan)) = (reports.first(), w.tp) {
        println!(
            "TP {} into {} ({} KV heads{}, decode pages of {} tokens), each rank a process: {} writes \
             per request (counted by the prefill engines), at most {} registration(s) per process, \
             {} prefill ranks connected to each decode TP rank",
            r.prefill_tp,
            r.decode_tp,
            plan.kv_heads,
            if plan.kv_heads == 0 {
                ", MLA latent"
            } else {
                ""
            },
            plan.decode_page_tokens,
            r.writes_per_request,
            r.registrations_per_process,
            r.connections_per_decode,
        );
    }
    if let Some(r) = reports
        .first()
        .filter(|_| w.prefill_instances > 1 || w.decode_instances > 1)
    {
        println!(
            "{} prefill instances into {} decode engine(s): at most {} registration(s) per engine's transport, \
             {} prefill ranks connected to each decode, each prefill rank linked to {} decode(s), {} writes per request",
            r.prefill_instances,
            r.decode_instances,
            r.registrations_per_process,
            r.connections_per_decode,
            r.decodes_per_prefill_rank,
            r.writes_per_request
        );
    }
    let (major, minor, release) = transfer_engine::transport::ucx::library_version();
    println!(
        "UCX library {major}.{minor}.{release} (one libucp in this process, shared with NIXL's UCX plugin)"
    );
    if let Some(r) = reports.first() {
        println!(
            "baselines: {} = {:.2} GB/s (ratio); ucx_perftest at {} B from cache = {:.2} GB/s, {:.0} msg/s; \
             in-process put streaming through {} MB = {:.2} GB/s (strm r); streaming memcpy = {:.2} GB/s",
            r.baseline,
            r.baseline_gbps,
            w.write_size(),
            r.cached_baseline_gbps,
            r.baseline_msg_rate,
            w.shape.request_bytes(w.prompt_tokens) / 1_000_000,
            r.stream_gbps,
            r.memcpy_gbps
        );
    }
    println!(
        "{:<8} {:>8} {:>9} {:>6} {:>7} {:>7} {:>9} {:>10} {:>10} {:>11} {:>11} {:>10} {:>10} {:>8}",
        "backend",
        "GB/s",
        "base GB/s",
        "ratio",
        "strm r",
        "vs nixl",
        "req/s",
        "lat p50us",
        "lat p99us",
        "cmpl p50us",
        "cmpl p99us",
        "chunks/s",
        "writes/s",
        "verified"
    );
    for r in reports {
        println!(
            "{:<8} {:>8.2} {:>9.2} {:>6.3} {:>7.3} {:>7} {:>9.2} {:>10.0} {:>10.0} {:>11.1} {:>11.1} {:>10.0} {:>10.0} {:>8}",
            r.backend,
            r.gbps,
            r.baseline_gbps,
            r.ratio,
            r.stream_ratio,
            if r.vs_nixl > 0.0 {
                format!("{:.2}", r.vs_nixl)
            } else {
                "-".into()
            },
            r.requests_per_s,
            r.latency_p50_us,
            r.latency_p99_us,
            r.complete_p50_us,
            r.complete_p99_us,
            r.chunks_per_s,
            r.writes_per_s,
            if r.verified { "yes" } else { "no" },
        );
    }
    for r in reports {
        let prefill = if r.prefill_cpu_us_per_request > 0.0 {
            format!(
                ", the prefill processes {:.0} µs ({:.0} of it copying; per chunk of a rank {:.0} \
                 µs, {:.0} of it copying; by thread {:.0} progress, {:.0} runtime, {:.0} other)",
                r.prefill_cpu_us_per_request,
                r.prefill_copy_us_per_request,
                r.prefill_cpu_us_per_chunk,
                r.prefill_copy_us_per_chunk,
                r.prefill_progress_us_per_chunk,
                r.prefill_runtime_us_per_chunk,
                r.prefill_other_us_per_chunk,
            )
        } else {
            String::new()
        };
        let gib = r.decode_pool_bytes as f64 / f64::from(1u32 << 30);
        println!(
            "{}: CPU per request {:.0} µs in this process's timed windows{prefill}; decode pool of {:.0} MB registered in {:.1} ms ({:.0} ms per GiB)",
            r.backend,
            r.cpu_us_per_request,
            r.decode_pool_bytes as f64 / 1e6,
            r.register_ms,
            if gib > 0.0 { r.register_ms / gib } else { 0.0 },
        );
    }
}

/// The raw baselines, measured before the engine runs.
struct Baselines {
    /// The headline: raw UCX put streaming through pool-sized buffers, GB/s.
    gbps: f64,
    name: String,
    /// ucx_perftest at the write size, from cache, GB/s, and its message rate.
    cached_gbps: f64,
    msg_rate: f64,
    /// Our in-process put loop streaming through a request-sized buffer, GB/s.
    stream: f64,
    /// A streaming memcpy, GB/s.
    memcpy: f64,
}

impl Baselines {
    /// None measured.
    fn skipped() -> Self {
        Baselines {
            gbps: 0.0,
            name: "skipped".to_string(),
            cached_gbps: 0.0,
            msg_rate: 0.0,
            stream: 0.0,
            memcpy: 0.0,
        }
    }

    /// Fills a report's baseline fields and ratios.
    fn apply(&self, r: &mut Report) {
        let per = |x: f64| if x > 0.0 { r.gbps / x } else { 0.0 };
        r.ratio = per(self.gbps);
        r.stream_ratio = per(self.stream);
        r.baseline_gbps = self.gbps;
        r.baseline = self.name.clone();
        r.cached_baseline_gbps = self.cached_gbps;
        r.stream_gbps = self.stream;
        r.memcpy_gbps = self.memcpy;
        r.baseline_msg_rate = self.msg_rate;
    }
}

/// `ucx_perftest` between two processes streaming through buffers as large as the decode pool (the
/// headline), and at the workload's write size (cached); the in-process put loop and a memcpy
/// streaming through a request. Without the tool, the in-process loop stands in for both.
fn baselines(w: &Workload) -> Baselines {
    let size = w.write_size();
    let span = w.shape.request_bytes(w.prompt_tokens);
    let pool = span * u64::from(w.concurrency.max(1));
    let stream = inprocess_put_bw(size, 16, span, 1.0).unwrap_or_else(|e| {
        eprintln!("kvbench: streaming put baseline failed: {e}");
        0.0
    });
    let memcpy = memcpy_bw(span, 1.0).unwrap_or(0.0);
    let tool = find_perftest();
    let cached = tool.as_ref().and_then(|t| {
        let iters = (4_000_000_000 / size.max(1)).clamp(2000, 200_000) as u32;
        perftest_put_bw(t, size, iters)
    });
    let streaming = tool.as_ref().and_then(|t| {
        // About 8 GB moved, at least 10 puts of the whole pool.
        let iters = (8_000_000_000 / pool.max(1)).clamp(10, 10_000) as u32;
        perftest_put_bw(t, pool, iters)
    });
    let (gbps, name) = match streaming {
        Some((g, _)) => (
            g,
            format!("ucx_perftest ucp_put_bw streaming {} MB", pool / 1_000_000),
        ),
        None => {
            eprintln!(
                "kvbench: ucx_perftest not found or failed; the baseline is the in-process put loop"
            );
            (
                stream,
                format!("in-process ucp_put loop streaming {} MB", span / 1_000_000),
            )
        }
    };
    let (cached_gbps, msg_rate) = cached.unwrap_or((0.0, 0.0));
    Baselines {
        gbps,
        name,
        cached_gbps,
        msg_rate,
        stream,
        memcpy,
    }
}

/// The flags of the workload a prefill role takes from decode, in `roles::Served`'s terms, that the
/// command line gave (a prefill role refuses to run another workload than its flags say).
fn given_workload_flags(m: &clap::ArgMatches) -> Vec<&'static str> {
    let m = m.subcommand_matches("prefill").unwrap_or(m);
    [
        ("model", "--model"),
        ("layers", "--layers"),
        ("bytes_per_token", "--bytes-per-token"),
        ("split_kv", "--split-kv"),
        ("page_tokens", "--page-tokens"),
        ("pp", "--pp"),
        ("pp_size", "--pp-size"),
        ("prompt_tokens", "--prompt-tokens"),
        ("chunk_tokens", "--chunk-tokens"),
        ("concurrency", "--concurrency"),
        ("checksums", "--checksums"),
        ("backend", "--backend"),
    ]
    .into_iter()
    .filter(|(id, _)| {
        m.try_get_raw(id).is_ok_and(|v| v.is_some())
            && m.value_source(id) == Some(clap::parser::ValueSource::CommandLine)
    })
    .map(|(_, flag)| flag)
    .collect()
}

fn main() -> ExitCode {
    use clap::{CommandFactory, FromArgMatches};
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    let mut given = given_workload_flags(&matches);
    if cli.opts.backend == Backend::All {
        // "Both" says nothing against decode's one backend.
        given.retain(|f| *f != "--backend");
    }
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVBENCH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let w = match cli.opts.workload() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("kvbench: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvbench: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(Role::Sweep {
        out,
        pages,
        concurrencies,
        prompts,
    }) = &cli.role
    {
        if cli.opts.processes || cli.opts.tp_run() {
            eprintln!("kvbench: sweep runs in one process, one TP size, so far");
            return ExitCode::from(2);
        }
        let grid = kvbench::sweep::Grid {
            page_tokens: pages.clone(),
            concurrency: concurrencies.clone(),
            prompt_tokens: if prompts.is_empty() {
                vec![w.prompt_tokens]
            } else {
                prompts.clone()
            },
            backends: cli.opts.backends(),
        };
        return rt.block_on(run_sweep(&w, &grid, out, cli.opts.json.is_some()));
    }
    if let Some(Role::Register { gib }) = &cli.role {
        if cli.opts.processes || cli.opts.tp_run() {
            eprintln!("kvbench: register runs in one process, one engine at a time");
            return ExitCode::from(2);
        }
        return rt.block_on(run_register(&cli.opts, *gib));
    }
    if let Some(Role::Latency { writes }) = &cli.role {
        if cli.opts.processes || cli.opts.tp_run() {
            eprintln!("kvbench: latency runs in one process, one TP size");
            return ExitCode::from(2);
        }
        return rt.block_on(run_latency(&cli.opts, &w, *writes));
    }
    let token = match cli.role {
        None => Ok(None),
        Some(_) => cli.opts.token(),
    };
    let token = match token {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvbench: {e}");
            return ExitCode::from(2);
        }
    };
    if cli.role.is_some() && token.is_none() {
        eprintln!(
            "kvbench: no --token-file or {TOKEN_ENV}: this process accepts and trusts any peer"
        );
    }
    if let Some(plan) = w.tp.filter(|_| cli.opts.processes || cli.role.is_some())
        && let Err(why) = kvbench::roles::tp_run(&w, plan, cli.opts.backends()[0])
    {
        eprintln!("kvbench: {why}");
        return ExitCode::from(2);
    }
    if cli.opts.processes {
        if cli.role.is_some() {
            eprintln!("kvbench: --processes starts the roles itself; give it no subcommand");
            return ExitCode::from(2);
        }
        return run_processes(&cli.opts, &w);
    }
    if cli.opts.tp_run() && cli.role.is_none() {
        return rt.block_on(run_tp(&cli.opts, &w));
    }
    let heartbeat = match cli.opts.heartbeat {
        None => None,
        Some(h) if h.is_finite() && (0.01..=3600.0).contains(&h) => {
            Some(Duration::from_secs_f64(h))
        }
        Some(h) => {
            eprintln!("kvbench: --heartbeat {h} must be 0.01 to 3600 seconds");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.role {
        None => rt.block_on(run_local(&cli.opts, &w)),
        Some(Role::Decode {
            listen,
            decode_index,
            tp_rank,
        }) => rt
            .block_on(async {
                let place = match (listen, cli.opts.discovery(token.as_deref())?) {
                    (Some(l), etcd) => roles::Place::Fixed(l, etcd),
                    (None, Some(etcd)) => roles::Place::Etcd(etcd),
                    (None, None) => return Err("decode needs --listen or --etcd".to_string()),
                };
                let backend = cli.opts.backends()[0];
                // A bar of the requests on a terminal (with --processes, the parent's).
                let bar = request_bar(&backend.to_string(), cli.opts.json.is_some());
                bar.set_length(u64::from(w.requests));
                let progress = |done: u64, total: u64| {
                    bar.set_length(total);
                    bar.set_position(done);
                };
                let r = roles::run_decode(
                    place,
                    decode_index,
                    tp_rank,
                    &w,
                    backend,
                    token,
                    cli.opts.stamps.as_deref(),
                    heartbeat,
                    Some(&progress),
                )
                .await;
                // Left where the run left it (finish() would fill it whatever happened).
                bar.abandon();
                r
            })
            .map(|mut r| {
                // Measured after the run, when the prefill processes have exited, so that they do
                // not compete with it; the same baselines as the one-process run. Only by the
                // decode instance that reports the run.
                if !cli.opts.no_baseline && decode_index == 0 && tp_rank == 0 {
                    baselines(&w).apply(&mut r);
                }
                vec![r]
            }),
        Some(Role::Prefill {
            connect,
            instance,
            pp_rank,
            pp_size,
            peers,
            tp_rank,
        }) => {
            let mut w = w.clone();
            w.pp = pp_size.unwrap_or(w.pp);
            rt.block_on(async {
                let find = match (connect.is_empty(), cli.opts.discovery(token.as_deref())?) {
                    (false, None) => roles::Find::Fixed(connect, peers),
                    (_, Some(etcd)) => roles::Find::Etcd(Box::new(etcd)),
                    (true, None) => return Err("prefill needs --connect or --etcd".to_string()),
                };
                // The workload is decode's; flags given here must agree with it.
                let (w, backend) = roles::learn_workload(
                    &find,
                    &w,
                    cli.opts.backends()[0],
                    &given,
                    token.as_deref(),
                )
                .await?;
                roles::run_prefill(
                    find,
                    instance,
                    pp_rank,
                    tp_rank,
                    &w,
                    backend,
                    token,
                    cli.opts.stamps.as_deref(),
                    heartbeat,
                )
                .await
            })
            .map(|_| Vec::new())
        }
        // Handled above, before the roles' checks.
        Some(Role::Sweep { .. } | Role::Latency { .. } | Role::Register { .. }) => Ok(Vec::new()),
    };
    match result {
        Ok(reports) => {
            if !reports.is_empty() {
                print_table(&w, &reports);
                if let Some(path) = &cli.opts.json {
                    let text = serde_json::to_string_pretty(&reports).unwrap_or_default();
                    if let Err(e) = std::fs::write(path, text) {
                        eprintln!("kvbench: cannot write {}: {e}", path.display());
                        return ExitCode::FAILURE;
                    }
                }
            }
            if reports.iter().all(|r| {
                // Multi-process decode excuses requests that were live while a rank was away.
                r.failed == r.failed_during_absence && (r.verified || w.verify == Verify::None)
            }) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("kvbench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The bytes of the write `kvbench latency` times.
const LATENCY_WRITE: u64 = 4096;

/// `kvbench register`: a decode engine's registration of a pool of `gib` GiB, of each kind, on
/// each backend; a table, and `--json` with the same numbers.
async fn run_register(opts: &Opts, gib: f64) -> ExitCode {
    if !(gib.is_finite() && gib > 0.0 && gib <= 1024.0) {
        eprintln!("kvbench: --gib {gib} must be above 0 and at most 1024");
        return ExitCode::from(2);
    }
    let bytes = (gib * f64::from(1u32 << 30)) as u64;
    println!(
        "kvbench register: a decode engine's pool of {gib} GiB; caller: allocated and faulted in \
         by the caller (timed apart), registered by the engine; shared: allocated, populated and \
         registered by the engine"
    );
    println!(
        "{:<8} {:<7} {:>8} {:>16} {:>13} {:>13} {:>19}",
        "backend",
        "pool",
        "GiB",
        "caller alloc ms",
        "register ms",
        "ms per GiB",
        "prefill connect ms"
    );
    let mut rows = Vec::new();
    for backend in opts.backends() {
        for kind in [PoolKind::Caller, PoolKind::Shared] {
            let r = match kvbench::register::time_registration(backend, kind, bytes).await {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("kvbench: {e}");
                    return ExitCode::FAILURE;
                }
            };
            println!(
                "{:<8} {:<7} {:>8.2} {:>16.1} {:>13.1} {:>13.1} {:>19.1}",
                r.backend,
                r.pool,
                r.bytes as f64 / f64::from(1u32 << 30),
                r.caller_alloc_ms,
                r.register_ms,
                r.register_ms_per_gib,
                r.prefill_connect_ms
            );
            rows.push(r);
        }
    }
    if let Some(path) = &opts.json {
        let text = serde_json::to_string_pretty(&rows).unwrap_or_default();
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("kvbench: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

/// `kvbench latency`: one 4 KiB write per request, one request at a time, on each backend, timed
/// from the prefill's post to decode's Complete, beside `ucx_perftest`'s put latency at the same
/// size measured in the same run; a table, and `--json` with the same numbers.
async fn run_latency(opts: &Opts, base: &Workload, writes: u32) -> ExitCode {
    if writes == 0 {
        eprintln!("kvbench: --writes must be positive");
        return ExitCode::from(2);
    }
    let mut w = base.clone();
    // One layer, one fused region, one page of 16 tokens of 256 bytes: 4 KiB, one chunk.
    w.shape = Shape {
        layers: 1,
        bytes_per_token: LATENCY_WRITE / 16,
        page_tokens: 16,
        regions: RegionKind::Fused,
    };
    w.pp = 1;
    w.prompt_tokens = 16;
    w.chunk_tokens = 16;
    w.concurrency = 1;
    w.requests = writes;
    w.duration = None;
    w.scatter = false;
    w.prefill_instances = 1;
    w.decode_instances = 1;
    let mut rows = Vec::new();
    for backend in opts.backends() {
        match run_workload(&w, backend, None).await {
            Ok(r) => rows.push(r),
            Err(e) => {
                eprintln!("kvbench: {backend}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    // After the engines are gone, so that the two processes have the cores to themselves.
    let iters = writes.saturating_mul(10).max(10_000);
    let put = find_perftest().and_then(|t| perftest_put_lat(&t, LATENCY_WRITE, iters));
    let Some((put_p50, put_avg)) = put else {
        eprintln!("kvbench: ucx_perftest ucp_put_lat could not be run: no baseline, no result");
        return ExitCode::FAILURE;
    };
    println!(
        "kvbench latency: one {LATENCY_WRITE}-byte write and its notification per request (1 layer, \
         one 16-token page, PP 1), one request at a time, {writes} requests per backend"
    );
    println!(
        "baseline: ucx_perftest -t ucp_put_lat -s {LATENCY_WRITE} between two processes, {iters} \
         iterations: p50 {put_p50:.3} us, average {put_avg:.3} us"
    );
    println!(
        "{:<8} {:>14} {:>14} {:>14} {:>16} {:>16} {:>9}",
        "backend",
        "post p50 us",
        "post p99 us",
        "p50 / put p50",
        "expect p50 us",
        "expect p99 us",
        "verified"
    );
    let mut json_rows = Vec::new();
    for r in &rows {
        let ratio = r.post_p50_us / put_p50.max(f64::MIN_POSITIVE);
        println!(
            "{:<8} {:>14.1} {:>14.1} {:>14.1} {:>16.1} {:>16.1} {:>9}",
            r.backend,
            r.post_p50_us,
            r.post_p99_us,
            ratio,
            r.latency_p50_us,
            r.latency_p99_us,
            if r.verified { "yes" } else { "no" }
        );
        json_rows.push(serde_json::json!({
            "backend": r.backend,
            "post_p50_us": r.post_p50_us,
            "post_p99_us": r.post_p99_us,
            "ratio_to_put_lat_p50": ratio,
            "latency_p50_us": r.latency_p50_us,
            "latency_p99_us": r.latency_p99_us,
            "requests": r.requests,
            "failed": r.failed,
            "verified": r.verified,
        }));
    }
    if let Some(path) = &opts.json {
        let doc = serde_json::json!({
            "write_bytes": LATENCY_WRITE,
            "put_lat_p50_us": put_p50,
            "put_lat_avg_us": put_avg,
            "put_lat_iterations": iters,
            "rows": json_rows,
        });
        if let Err(e) = std::fs::write(path, doc.to_string()) {
            eprintln!("kvbench: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if rows
        .iter()
        .all(|r| r.failed == 0 && (r.verified || w.verify == Verify::None))
    {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `kvbench sweep`: every point of `grid` on `w`, a line per point as it ends (and a bar over the
/// points on a terminal), then `sweep.json` and `sweep.svg` in `out`. Exits non-zero if a run could
/// not be made, a request failed or a checked request's bytes differed.
async fn run_sweep(w: &Workload, grid: &kvbench::sweep::Grid, out: &Path, quiet: bool) -> ExitCode {
    if grid.is_empty() || grid.page_tokens.contains(&0) || grid.prompt_tokens.contains(&0) {
        eprintln!(
            "kvbench sweep: every list needs a value, and pages and prompts must be positive"
        );
        return ExitCode::from(2);
    }
    println!(
        "kvbench sweep: {} layers x {} B/token/layer, PP={}, {}-token chunks, {} requests per point, {} points",
        w.shape.layers,
        w.shape.bytes_per_token,
        w.pp,
        w.chunk_tokens,
        w.requests,
        grid.len()
    );
    println!("backend  page tokens  concurrency  prompt tokens     GB/s  p50 ms  p99 ms  verified");
    let bar = counted_bar("sweep", "points", quiet);
    bar.set_length(grid.len() as u64);
    let points = kvbench::sweep::run(w, grid, |p| {
        let r = &p.report;
        bar.suspend(|| {
            println!(
                "{:<8} {:>11} {:>12} {:>14} {:>8.2} {:>7.2} {:>7.2} {:>9}",
                r.backend,
                p.page_tokens,
                p.concurrency,
                p.prompt_tokens,
                r.gbps,
                r.latency_p50_us / 1000.0,
                r.latency_p99_us / 1000.0,
                if r.verified { "yes" } else { "NO" }
            )
        });
        bar.inc(1);
    })
    .await;
    // Left where the run left it (finish() would fill it whatever happened).
    bar.abandon();
    let points = match points {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kvbench sweep: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = kvbench::sweep::write(&points, out) {
        eprintln!("kvbench sweep: {e}");
        return ExitCode::FAILURE;
    }
    println!(
        "wrote {} and {}",
        out.join("sweep.json").display(),
        out.join("sweep.svg").display()
    );
    let ok = points
        .iter()
        .all(|p| p.report.failed == 0 && (p.report.verified || w.verify == Verify::None));
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// A bar on stderr of one run's requests, drawn only where stderr is a terminal (indicatif draws
/// nothing elsewhere) and never with `--json`, whose output a program reads.
fn request_bar(label: &str, quiet: bool) -> indicatif::ProgressBar {
    counted_bar(label, "requests", quiet)
}

/// A bar of `unit`s, as [`request_bar`].
fn counted_bar(label: &str, unit: &str, quiet: bool) -> indicatif::ProgressBar {
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    if quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(&format!(
        "{{prefix:>5}} [{{bar:32}}] {{pos}}/{{len}} {unit}, {{elapsed}}"
    ))
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_prefix(label.to_string());
    bar
}

async fn run_local(opts: &Opts, w: &Workload) -> Result<Vec<Report>, String> {
    let b = if opts.no_baseline {
        Baselines::skipped()
    } else {
        baselines(w)
    };
    let mut reports = Vec::new();
    for backend in opts.backends() {
        let bar = request_bar(&backend.to_string(), opts.json.is_some());
        bar.set_length(u64::from(w.requests));
        let progress = |done: u64, total: u64| {
            bar.set_length(total);
            bar.set_position(done);
        };
        let r = run_workload(w, backend, Some(&progress)).await;
        // Left where the run left it (finish() would fill it whatever happened).
        bar.abandon();
        let mut r = r.map_err(|e| format!("{backend}: {e}"))?;
        b.apply(&mut r);
        reports.push(r);
    }
    // The direct backend against NIXL on the same workload, in the same process.
    let nixl = reports.iter().find(|r| r.backend == "nixl").map(|r| r.gbps);
    if let (Some(n), Some(u)) = (nixl, reports.iter_mut().find(|r| r.backend == "ucx"))
        && n > 0.0
    {
        u.vs_nixl = u.gbps / n;
    }
    Ok(reports)
}

/// `--prefill-tp N --decode-tp M`: for each backend, identical TP (M on both sides) and then N
/// into M on the same workload, in this process; prints one row each and the ratio.
async fn run_tp(opts: &Opts, w: &Workload) -> ExitCode {
    let plan = opts.tp_plan(w.shape.page_tokens);
    // What a run with each rank a process refuses, this one does too (it would ignore it).
    for backend in opts.backends() {
        if let Err(e) = kvbench::roles::tp_run(w, plan, backend) {
            eprintln!("kvbench: {e}");
            return ExitCode::from(2);
        }
    }
    let kv_heads = plan.kv_heads;
    println!(
        "kvbench TP: {} layers x {} B/token/layer, {} KV heads{}, {}-token pages, PP={}, {}-token prompts in {}-token chunks, {} requests {} at a time, {} prefill and {} decode instance(s)",
        w.shape.layers,
        w.shape.bytes_per_token,
        kv_heads,
        if kv_heads == 0 { " (MLA latent)" } else { "" },
        w.shape.page_tokens,
        w.pp,
        w.prompt_tokens,
        w.chunk_tokens,
        w.requests,
        w.concurrency,
        w.prefill_instances.max(1),
        w.decode_instances.max(1),
    );
    println!(
        "backend  prefill TP  decode TP  pages     GB/s  vs identical  writes/request  rows/request  engines  regs  verified"
    );
    let mut rows = Vec::new();
    for backend in opts.backends() {
        let mut identical = None;
        let identical_plan = plan.identical(w.shape.page_tokens);
        for run_plan in [identical_plan, plan] {
            let spec = kvbench::tp::TpSpec::of(w, run_plan, backend);
            let (p, d) = (run_plan.prefill_tp, run_plan.decode_tp);
            let run = async {
                let c = kvbench::tp::TpCluster::start(spec)
                    .await
                    .map_err(|e| e.to_string())?;
                let bar = request_bar(&format!("{backend} {p}>{d}"), opts.json.is_some());
                bar.set_length(u64::from(w.requests));
                let progress = |done: u64, total: u64| {
                    bar.set_length(total);
                    bar.set_position(done);
                };
                let r = c.run(Some(&progress)).await;
                // Left where the run left it (finish() would fill it whatever happened).
                bar.abandon();
                c.shutdown().await;
                r
            };
            let r = match run.await {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("kvbench: {backend} TP {p} into {d}: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let base = *identical.get_or_insert(r.gbps);
            println!(
                "{:<8} {:>10} {:>10} {:>6} {:>8.2} {:>13.3} {:>15} {:>13} {:>8} {:>5} {:>9}",
                r.backend,
                r.prefill_tp,
                r.decode_tp,
                format!("{}>{}", r.prefill_page_tokens, r.decode_page_tokens),
                r.gbps,
                r.gbps / base,
                r.writes_per_request,
                r.rows_per_request,
                r.engines,
                r.registrations_per_process,
                if r.verified { "yes" } else { "NO" }
            );
            rows.push(r);
            if identical_plan == plan {
                break;
            }
        }
    }
    if let Some(path) = &opts.json {
        let text = match serde_json::to_string_pretty(&rows) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("kvbench: {e}");
                return ExitCode::FAILURE;
            }
        };
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("kvbench: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

/// `--processes`: for each backend, one `kvbench decode` and one `kvbench prefill` per PP rank, each
/// in its own process on loopback, sharing a fresh secret through `KVX_TOKEN`. Decode's output (the
/// table) goes to ours; the run fails if any process does. With TP sizes, each backend runs
/// identical TP (decode's on both sides, the model's pages) and then the mapping, every rank a
/// process, and the mapping's GB/s is told against identical TP's.
fn run_processes(opts: &Opts, w: &Workload) -> ExitCode {
    if opts.json.is_some() && opts.backends().len() > 1 && w.tp.is_none() {
        eprintln!("kvbench: --processes with --json runs one backend at a time: give --backend");
        return ExitCode::from(2);
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("kvbench: cannot find this executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    let secret = match fresh_secret_hex() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvbench: drawing a secret: {e}");
            return ExitCode::FAILURE;
        }
    };
    // This process's own options, less the ones it decides for its children.
    let mut passed = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--processes" => {}
            // Only the decode process that reports the run writes the JSON (`run_set` tells it):
            // another decode instance that got it too wrote its own share there, sometimes last.
            "--backend" | "--stamps" | "--etcd" | "--cluster" | "--metrics" | "--json" => {
                let _ = args.next();
            }
            // A TP run gives each run's plan itself, and gathers the rows.
            "--prefill-tp" | "--decode-tp" | "--kv-heads" | "--decode-page-tokens"
                if w.tp.is_some() =>
            {
                let _ = args.next();
            }
            _ if [
                "--backend=",
                "--stamps=",
                "--etcd=",
                "--cluster=",
                "--metrics=",
                "--json=",
            ]
            .iter()
            .any(|p| a.starts_with(p)) => {}
            _ if w.tp.is_some()
                && [
                    "--prefill-tp=",
                    "--decode-tp=",
                    "--kv-heads=",
                    "--decode-page-tokens=",
                ]
                .iter()
                .any(|p| a.starts_with(p)) => {}
            _ => passed.push(a),
        }
    }
    // With --etcd, the roles find each other there, each backend's run under a cluster of its own.
    let mut _server = None;
    let etcd = match opts.etcd.as_deref() {
        None => None,
        Some("auto") => match kvbench::etcd_server::EtcdServer::start() {
            Ok(s) => {
                let url = s.url();
                _server = Some(s);
                Some(url)
            }
            Err(e) => {
                eprintln!("kvbench: --etcd auto: {e}");
                return ExitCode::FAILURE;
            }
        },
        Some(urls) => Some(urls.to_string()),
    };
    let kids = Children {
        exe: &exe,
        passed: &passed,
        secret: &secret,
        etcd: etcd.as_deref(),
    };
    let mut ok = true;
    let mut rows = Vec::new();
    for backend in opts.backends() {
        let Some(plan) = w.tp else {
            ok &= run_set(opts, w, &kids, backend, opts.json.as_deref());
            continue;
        };
        let identical = plan.identical(w.shape.page_tokens);
        let plans = if identical == plan {
            vec![plan]
        } else {
            vec![identical, plan]
        };
        let mut base = None;
        for p in plans {
            let json = std::env::temp_dir().join(format!(
                "kvbench-tp-{}-{backend}-{}-{}.json",
                std::process::id(),
                p.prefill_tp,
                p.decode_tp
            ));
            let mut wp = w.clone();
            wp.tp = Some(p);
            let ran = run_set(opts, &wp, &kids, backend, Some(&json));
            let row = std::fs::read(&json)
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .and_then(|v| v.get(0).cloned());
            let _ = std::fs::remove_file(&json);
            let Some(row) = row.filter(|_| ran) else {
                eprintln!(
                    "kvbench: {backend} TP {} into {} left no report",
                    p.prefill_tp, p.decode_tp
                );
                ok = false;
                break;
            };
            let gbps = row["gbps"].as_f64().unwrap_or(0.0);
            let b = *base.get_or_insert(gbps);
            println!(
                "kvbench: {backend} TP {} into {}, each rank a process: {gbps:.2} GB/s, {:.3} of \
                 identical TP {} into {} ({b:.2} GB/s) in the same run",
                p.prefill_tp,
                p.decode_tp,
                gbps / b.max(f64::MIN_POSITIVE),
                plan.decode_tp,
                plan.decode_tp,
            );
            rows.push(row);
        }
    }
    if w.tp.is_some()
        && let Some(path) = &opts.json
    {
        let text = serde_json::to_string_pretty(&rows).unwrap_or_default();
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("kvbench: cannot write {}: {e}", path.display());
            ok = false;
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// What every role process of a `--processes` run gets alike.
struct Children<'a> {
    exe: &'a Path,
    /// The parent's own options, less the ones it decides for its children.
    passed: &'a [String],
    secret: &'a str,
    etcd: Option<&'a str>,
}

/// One `--processes` run of `w` on `backend`: starts its decode and prefill processes, waits for
/// them, and says whether every one succeeded. With `json`, the reporting decode writes its row
/// there.
fn run_set(
    opts: &Opts,
    w: &Workload,
    kids: &Children<'_>,
    backend: BackendKind,
    json: Option<&Path>,
) -> bool {
    let mut ok = true;
    let instances = usize::from(w.prefill_instances.max(1));
    // Decode processes (instances, in a TP run each instance's ranks) and the prefill TP ranks
    // that write somewhere (each a pipeline of --pp processes).
    let decode_tp = usize::from(w.tp.map_or(1, |p| p.decode_tp));
    let (decodes, tp_ranks) = match w.tp {
        Some(plan) => {
            let spec = kvbench::tp::TpSpec::of(w, plan, BackendKind::Ucx);
            match spec.writing_ranks() {
                Ok(t) => (decode_tp * usize::from(w.decode_instances.max(1)), Some(t)),
                Err(e) => {
                    eprintln!("kvbench: {e}");
                    return false;
                }
            }
        }
        None => (usize::from(w.decode_instances.max(1)), None),
    };
    let pipelines: Vec<Option<u16>> = match &tp_ranks {
        Some(t) => t.iter().copied().map(Some).collect(),
        None => vec![None],
    };
    let pp = usize::from(w.pp);
    let cluster = format!("{}-{}-{backend}", opts.cluster, std::process::id());
    // Each decode process's control address, then the vote mesh of each prefill instance's
    // pipelines.
    let addrs = match kvbench::cluster::free_addrs(decodes + instances * pipelines.len() * pp) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kvbench: no free ports: {e}");
            return false;
        }
    };
    // Where the prefill processes leave their last-write stamps for decode.
    let top = match &opts.stamps {
        Some(d) => d.clone(),
        None => {
            std::env::temp_dir().join(format!("kvbench-stamps-{}-{backend}", std::process::id()))
        }
    };
    // Each TP run's own, so that none reads another's files.
    let stamps = match w.tp {
        Some(p) => top.join(format!("tp-{}-{}", p.prefill_tp, p.decode_tp)),
        None => top.clone(),
    };
    // A TP run's folder is its own: what an earlier run left there goes first.
    if w.tp.is_some() {
        let _ = std::fs::remove_dir_all(&stamps);
    }
    if let Err(e) = std::fs::create_dir_all(&stamps) {
        eprintln!("kvbench: cannot make {}: {e}", stamps.display());
        return false;
    }
    let joined = |a: &[std::net::SocketAddr]| {
        a.iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let decode_addrs = joined(&addrs[..decodes]);
    let role = |args: Vec<String>| {
        // The roles die with this process, killed by a signal or not.
        let mut c = dies_with_us(kids.exe);
        c.args(args)
            .args(kids.passed)
            .args(["--backend", &backend.to_string()])
            .arg("--stamps")
            .arg(&stamps)
            .env(TOKEN_ENV, kids.secret)
            .stdin(std::process::Stdio::null());
        if let Some(url) = kids.etcd {
            c.args(["--etcd", url, "--cluster", &cluster]);
        }
        if let Some(p) = w.tp {
            for (flag, v) in [
                ("--prefill-tp", u32::from(p.prefill_tp)),
                ("--decode-tp", u32::from(p.decode_tp)),
                ("--kv-heads", p.kv_heads),
                ("--decode-page-tokens", p.decode_page_tokens),
            ] {
                c.args([flag.to_string(), v.to_string()]);
            }
        }
        c
    };
    // The first decode instance prints the table of them all (and serves --metrics).
    let mut decode_procs = Vec::new();
    for (m, addr) in addrs[..decodes].iter().enumerate() {
        let mut decode_args = if kids.etcd.is_some() {
            vec!["decode".into()]
        } else {
            vec!["decode".into(), "--listen".into(), addr.to_string()]
        };
        decode_args.extend(["--decode-index".into(), (m / decode_tp).to_string()]);
        if tp_ranks.is_some() {
            decode_args.extend(["--tp-rank".into(), (m % decode_tp).to_string()]);
        }
        if let Some(metrics) = opts.metrics.filter(|_| m == 0) {
            decode_args.extend(["--metrics".into(), metrics.to_string()]);
        }
        if let Some(path) = json.filter(|_| m == 0) {
            decode_args.extend(["--json".into(), path.display().to_string()]);
        }
        let mut c = role(decode_args);
        if m > 0 {
            c.stdout(std::process::Stdio::null());
        }
        match c.spawn() {
            Ok(c) => decode_procs.push((m, c)),
            Err(e) => {
                eprintln!("kvbench: cannot start decode {m}: {e}");
                return false;
            }
        }
    }
    let mut prefills = Vec::new();
    for k in 0..instances {
        for (i, tp_rank) in pipelines.iter().enumerate() {
            let at = decodes + (k * pipelines.len() + i) * pp;
            let mesh = &addrs[at..at + pp];
            for rank in 0..w.pp {
                let mut args = vec![
                    "prefill".into(),
                    "--pp-rank".into(),
                    rank.to_string(),
                    "--instance".into(),
                    k.to_string(),
                ];
                if let Some(t) = tp_rank {
                    args.extend(["--tp-rank".into(), t.to_string()]);
                }
                if kids.etcd.is_none() {
                    args.extend(["--connect".into(), decode_addrs.clone()]);
                    args.extend(["--peers".into(), joined(mesh)]);
                }
                let name = match tp_rank {
                    Some(t) => format!("instance {k} TP rank {t} PP rank {rank}"),
                    None => format!("instance {k} rank {rank}"),
                };
                let mut c = role(args);
                match c.stdout(std::process::Stdio::null()).spawn() {
                    Ok(p) => prefills.push((name, p)),
                    Err(e) => {
                        eprintln!("kvbench: cannot start prefill {name}: {e}");
                        ok = false;
                    }
                }
            }
        }
    }
    let mut decode_ok = true;
    for (m, mut decode) in decode_procs {
        decode_ok &= match decode.wait() {
            Ok(s) if s.success() => true,
            Ok(s) => {
                eprintln!("kvbench: {backend} decode {m} exited with {s}");
                false
            }
            Err(e) => {
                eprintln!("kvbench: waiting for {backend} decode {m}: {e}");
                false
            }
        };
    }
    ok &= decode_ok;
    // Decode closes every rank when it is done; each exits on its own, within a bound. Without
    // decode nothing will close them: they are stopped at once.
    let bound = if decode_ok {
        Duration::from_secs(30)
    } else {
        Duration::ZERO
    };
    let deadline = std::time::Instant::now() + bound;
    for (rank, mut p) in prefills {
        let status = loop {
            match p.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                _ => {
                    let _ = p.kill();
                    let _ = p.wait();
                    break None;
                }
            }
        };
        match status {
            Some(s) if s.success() => {}
            Some(s) => {
                eprintln!("kvbench: {backend} prefill {rank} exited with {s}");
                ok = false;
            }
            None if decode_ok => {
                eprintln!(
                    "kvbench: {backend} prefill {rank} still ran {bound:?} after decode \
                     ended: stopped"
                );
                ok = false;
            }
            None => {}
        }
    }
    if opts.stamps.is_none() {
        let _ = std::fs::remove_dir_all(&top);
    }
    ok
}

/// 32 random bytes from the kernel, hex-encoded, for the processes of one `--processes` run.
fn fresh_secret_hex() -> std::io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}
