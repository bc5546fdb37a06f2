//! Interop with NIXL's own Python API (the `nixl_cu12` wheel `scripts/provision` puts in `.deps/py`),
//! in separate processes over loopback:
//!
//! - SGLang-style prefill ranks written in Python (`tests/py/sglang_prefill.py`) write KV pages into
//!   our [`DecodeEngine`] on the NIXL backend and send SGLang's text notifications
//!   `{room}_kv_{chunk}_{is_last}_{pp_rank}`, as two PP ranks; decode reports `Complete` and every
//!   destination byte is checked (GQA-like and MLA-like layouts).
//! - The same script as rank 0 alone, LAST included: decode must not complete (one rank's LAST is not
//!   the request's), and then aborts.
//! - The other direction, at the transport level: our [`NixlTransport`] writes into a Python agent
//!   (`tests/py/nixl_receiver.py`) with a binary v1 notification and an SGLang text one; Python decodes
//!   both and checks the bytes.
//!
//! The Python side computes no pattern of its own: the Rust side writes the bytes a Python process
//! sends, or must receive, into a file with `kvbench::verify`, which also poisons and checks the Rust
//! decode's pages.
//!
//! Every wait is bounded and every Python process is killed if the test fails.
#![allow(clippy::unwrap_used)]

use kvbench::cluster::Shape;
use kvbench::verify;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transfer_engine::core::RequestId;
use transfer_engine::core::notify::{ChunkNotification, ChunkStatus, TextForm};
use transfer_engine::core::planner::{ChunkGeometry, KvLayout, PpSplit, RegionKind};
use transfer_engine::engine::{BackendConfig, DecodeConfig, DecodeEngine, Outcome, Pool};
use transfer_engine::mem::{HostBuffer, HostOptions};
use transfer_engine::transport::nixl::{NixlConfig, NixlTransport};
use transfer_engine::transport::{
    BackendKind, Registration, RemoteRegion, Sender, Transport, WriteOp,
};

/// Bound on a whole transfer, on a Python process's own waits, and on any single wait here.
const BOUND: Duration = Duration::from_secs(60);

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("kvx-pyinterop-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A Python process, killed on drop unless it was waited for; its output goes to files so it can be
/// shown when something fails.
struct Py {
    name: String,
    child: Child,
    log: PathBuf,
    status: Option<ExitStatus>,
}

impl Py {
    fn spawn(name: &str, script: &str, args: &[&Path], log: PathBuf) -> Py {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let deps = root.join(".deps/py");
        assert!(
            deps.join("nixl_cu12/_api.py").is_file(),
            "NIXL's Python package is missing from {}: run ./scripts/provision",
            deps.display()
        );
        let out = std::fs::File::create(&log).unwrap();
        let err = out.try_clone().unwrap();
        let child = Command::new("python3")
            .arg(root.join("tests/py").join(script))
            .args(args)
            .env("PYTHONPATH", &deps)
            .env("PYTHONUNBUFFERED", "1")
            // No __pycache__ left in the source tree.
            .env("PYTHONDONTWRITEBYTECODE", "1")
            // NIXL's own Python agent loads UCX's EFA module too where rdma-core is installed, and
            // crashes at exit with it, as our processes did before they kept it out.
            .env(
                "UCX_MODULES",
                std::env::var("UCX_MODULES").unwrap_or_else(|_| "^efa".into()),
            )
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start python3 for {name}: {e}"));
        Py {
            name: name.into(),
            child,
            log,
            status: None,
        }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Panics with the process's output if it has exited unsuccessfully.
    fn check_running_or_ok(&mut self) {
        if self.status.is_none() {
            self.status = self.child.try_wait().unwrap();
        }
        if let Some(st) = self.status
            && !st.success()
        {
            panic!(
                "{} exited with {st}; its output:\n{}",
                self.name,
                self.output()
            );
        }
    }

    /// Waits (bounded) for a successful exit.
    async fn wait_ok(&mut self, bound: Duration) {
        let end = Instant::now() + bound;
        while self.status.is_none() {
            self.status = self.child.try_wait().unwrap();
            if self.status.is_none() {
                assert!(
                    Instant::now() < end,
                    "{} did not exit within {bound:?}; its output:\n{}",
                    self.name,
                    self.output()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        self.check_running_or_ok();
        println!("{}:\n{}", self.name, self.output());
    }
}

impl Drop for Py {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Polls `cond` every 10 ms until it holds, checking the Python processes meanwhile.
async fn wait_until(what: &str, procs: &mut [Py], mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + BOUND;
    while !cond() {
        for p in procs.iter_mut() {
            p.check_running_or_ok();
        }
        assert!(
            Instant::now() < end,
            "{what} did not happen within {BOUND:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A request's geometry and pages, shared by both sides.
struct Workload {
    shape: Shape,
    pp: u16,
    decode_pages: u32,
    src_pool_pages: u32,
    prompt_tokens: u32,
    chunk_tokens: u32,
    src_pages: Vec<u32>,
    dst_pages: Vec<u32>,
}

impl Workload {
    /// A prompt that is a multiple of neither the page nor the chunk, chunks that end mid-page (a
    /// page goes with the chunk that computes its last token), source pages reversed and destination
    /// pages strided, so nothing lines up by accident.
    fn new(shape: Shape) -> Workload {
        let page = shape.page_tokens;
        let prompt_tokens = page * 9 + page / 2 + 1;
        let n = shape.pages_for(prompt_tokens);
        Workload {
            shape,
            pp: 2,
            decode_pages: 40,
            src_pool_pages: 16,
            prompt_tokens,
            chunk_tokens: page * 3 + page / 2,
            src_pages: (0..n).rev().map(|p| p + 3).collect(),
            dst_pages: (0..n).map(|p| 5 + 3 * p).collect(),
        }
    }

    fn page_bytes(&self) -> u64 {
        self.shape.page_bytes()
    }

    fn dst_layout(&self) -> KvLayout {
        let s = self.shape;
        KvLayout::packed(0, s.layers, s.regions, self.page_bytes(), self.decode_pages)
    }

    fn layer_range(&self, rank: u16) -> std::ops::Range<u32> {
        PpSplit::SglangEven
            .layer_range(self.shape.layers, self.pp, rank)
            .unwrap()
    }

    fn src_layout(&self, rank: u16) -> KvLayout {
        let r = self.layer_range(rank);
        KvLayout::packed(
            r.start,
            r.len() as u32,
            self.shape.regions,
            self.page_bytes(),
            self.src_pool_pages,
        )
    }

    /// Rank `rank`'s whole source pool holding `request`'s pattern in its source pages.
    fn src_bytes(&self, request: RequestId, rank: u16) -> Vec<u8> {
        let layout = self.src_layout(rank);
        let mut pool = vec![0u8; layout.buffer_len as usize];
        verify::write_source(&layout, request, rank, &self.src_pages, |at, b| {
            let at = at as usize;
            pool[at..at + b.len()].copy_from_slice(b);
            Ok::<(), std::convert::Infallible>(())
        })
        .unwrap();
        pool
    }

    /// The positions of the pages each chunk sends, as our planner assigns them.
    fn chunks(&self) -> Vec<[u64; 2]> {
        let g = ChunkGeometry::new(
            u64::from(self.prompt_tokens),
            u64::from(self.chunk_tokens),
            u64::from(self.shape.page_tokens),
        )
        .unwrap();
        (0..g.num_chunks())
            .map(|c| {
                let r = g.pages_of_chunk(c).unwrap();
                [r.start, r.end]
            })
            .collect()
    }
}

struct Decode {
    engine: DecodeEngine,
    name: String,
    md_file: PathBuf,
    region: RemoteRegion,
}

async fn start_decode(w: &Workload, tag: &str, scratch: &Scratch) -> Decode {
    let layout = w.dst_layout();
    let name = format!("kvx-decode-{}-{tag}", std::process::id());
    let mut cfg = DecodeConfig::new(w.shape.layers, w.shape.page_tokens, layout.clone(), w.pp);
    cfg.engine_id = name.clone();
    cfg.backend = BackendConfig::default_for(BackendKind::Nixl, &name);
    let pool = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
    let engine = DecodeEngine::start(cfg, Pool::Owned(pool)).await.unwrap();
    let (md, agent, region) = engine.backend_info().unwrap();
    assert_eq!(
        agent, name,
        "the NIXL backend names its agent after the config"
    );
    assert!(!md.is_empty());
    let md_file = scratch.path("decode.md");
    std::fs::write(&md_file, &md).unwrap();
    Decode {
        engine,
        name,
        md_file,
        region,
    }
}

fn agent_name(tag: &str, rank: u16) -> String {
    format!("sglang-prefill-{}-{tag}-r{rank}", std::process::id())
}

/// Writes rank `rank`'s config for `sglang_prefill.py` and starts it.
/// Writes rank `rank`'s source pool for `request` to a file `sglang_prefill.py` loads, and its
/// config, and starts it.
fn spawn_rank(
    w: &Workload,
    d: &Decode,
    tag: &str,
    scratch: &Scratch,
    request: RequestId,
    rank: u16,
    send_chunks: &[u64],
) -> (Py, PathBuf) {
    let layers = w.layer_range(rank);
    let sent = scratch.path(&format!("sent-{rank}"));
    let src_file = scratch.path(&format!("src-{rank}.bin"));
    std::fs::write(&src_file, w.src_bytes(request, rank)).unwrap();
    let cfg = serde_json::json!({
        "agent_name": agent_name(tag, rank),
        "pp_rank": rank,
        "request": request.0,
        "decode_md": d.md_file,
        "decode_name": d.name,
        "decode_addr": d.region.addr,
        "decode_len": d.region.len,
        "total_layers": w.shape.layers,
        "first_layer": layers.start,
        "num_layers": layers.len(),
        "regions": w.shape.regions.count(),
        "page_bytes": w.page_bytes(),
        "decode_pages": w.decode_pages,
        "src_pool_pages": w.src_pool_pages,
        "src_file": src_file,
        "src_pages": w.src_pages,
        "dst_pages": w.dst_pages,
        "chunks": w.chunks(),
        "send_chunks": send_chunks,
        "sent_file": sent,
        "linger_file": scratch.path("linger"),
        "timeout_s": BOUND.as_secs(),
    });
    let file = scratch.path(&format!("rank{rank}.json"));
    std::fs::write(&file, cfg.to_string()).unwrap();
    let py = Py::spawn(
        &format!("python prefill rank {rank}"),
        "sglang_prefill.py",
        &[&file],
        scratch.path(&format!("rank{rank}.log")),
    );
    (py, sent)
}

/// Both ranks send every chunk from Python; decode completes and every byte is where it belongs.
async fn two_python_ranks(shape: Shape, tag: &str) {
    let w = Workload::new(shape);
    let scratch = Scratch::new(tag);
    let d = start_decode(&w, tag, &scratch).await;
    for rank in 0..w.pp {
        d.engine
            .bind_external_rank(
                rank,
                Sender::Agent(agent_name(tag, rank)),
                &w.src_layout(rank),
            )
            .unwrap();
    }
    let request = RequestId(0x5ea1_0000 + u64::from(shape.layers));
    verify::poison(&w.dst_layout(), &w.dst_pages, |at, b| {
        d.engine.write_pool(at, b)
    })
    .unwrap();
    let done = d
        .engine
        .expect(
            request,
            w.prompt_tokens,
            w.chunk_tokens,
            w.dst_pages.clone(),
            BOUND,
        )
        .unwrap();
    let all: Vec<u64> = (0..w.chunks().len() as u64).collect();
    let mut procs = Vec::new();
    for rank in 0..w.pp {
        procs.push(spawn_rank(&w, &d, tag, &scratch, request, rank, &all).0);
    }
    let mut done = Box::pin(done);
    let end = Instant::now() + BOUND;
    let outcome = loop {
        tokio::select! {
            o = &mut done => break o,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {
                for p in procs.iter_mut() {
                    p.check_running_or_ok();
                }
                assert!(Instant::now() < end, "decode did not finish within {BOUND:?}");
            }
        }
    };
    assert_eq!(
        outcome,
        Outcome::Complete,
        "decode stats {:?}",
        d.engine.stats()
    );
    let ranks: Vec<_> = (0..w.pp).map(|r| w.layer_range(r)).collect();
    let checked = verify::check(&w.dst_layout(), &ranks, request, &w.dst_pages, |at, b| {
        d.engine.read_pool(at, b)
    })
    .unwrap();
    assert_eq!(checked, shape.request_bytes(w.prompt_tokens));
    // Nothing landed outside the request's pages.
    let mut pool = vec![0u8; w.dst_layout().buffer_len as usize];
    d.engine.read_pool(0, &mut pool).unwrap();
    let pb = w.page_bytes() as usize;
    let dst_page_of = |off: usize| (off / pb) % w.decode_pages as usize;
    let stray =
        (0..pool.len()).find(|&i| pool[i] != 0 && !w.dst_pages.contains(&(dst_page_of(i) as u32)));
    assert_eq!(
        stray, None,
        "a byte outside the destination pages was written"
    );

    let stats = d.engine.stats();
    assert_eq!(
        (stats.completed, stats.failed, stats.in_flight),
        (1, 0, 0),
        "{stats:?}"
    );
    assert_eq!(
        (stats.malformed, stats.unknown_sender, stats.refused),
        (0, 0, 0),
        "{stats:?}"
    );
    let chunks = w.chunks().len() as u64;
    assert_eq!(
        d.engine.tracker_counters().new_chunks,
        chunks * u64::from(w.pp)
    );

    std::fs::write(scratch.path("linger"), b"done\n").unwrap();
    for p in procs.iter_mut() {
        p.wait_ok(BOUND).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sglang_prefill_two_pp_ranks_into_rust_decode_gqa() {
    // 7 layers split 3 + 4 (SGLang gives the extra layer to the last rank), K and V regions.
    let shape = Shape {
        layers: 7,
        bytes_per_token: 256,
        page_tokens: 16,
        regions: RegionKind::SplitKv,
    };
    two_python_ranks(shape, "gqa").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sglang_prefill_two_pp_ranks_into_rust_decode_mla() {
    // One fused latent region of 576 bytes per token per layer, as DeepSeek's MLA.
    let shape = Shape {
        layers: 6,
        bytes_per_token: 576,
        page_tokens: 8,
        regions: RegionKind::Fused,
    };
    two_python_ranks(shape, "mla").await;
}

/// Rank 0 sends all its chunks, its LAST included; rank 1 sends nothing. SGLang's text LAST of one rank
/// must not complete a two-rank request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_rank0_last_alone_does_not_complete_rust_decode() {
    let tag = "neg";
    let shape = Shape {
        layers: 5,
        bytes_per_token: 128,
        page_tokens: 16,
        regions: RegionKind::SplitKv,
    };
    let w = Workload::new(shape);
    let scratch = Scratch::new(tag);
    let d = start_decode(&w, tag, &scratch).await;
    for rank in 0..w.pp {
        d.engine
            .bind_external_rank(
                rank,
                Sender::Agent(agent_name(tag, rank)),
                &w.src_layout(rank),
            )
            .unwrap();
    }
    let request = RequestId(0x0e9a);
    verify::poison(&w.dst_layout(), &w.dst_pages, |at, b| {
        d.engine.write_pool(at, b)
    })
    .unwrap();
    let done = d
        .engine
        .expect(
            request,
            w.prompt_tokens,
            w.chunk_tokens,
            w.dst_pages.clone(),
            BOUND,
        )
        .unwrap();
    let mut done = Box::pin(done);
    let chunks = w.chunks().len() as u64;
    let all: Vec<u64> = (0..chunks).collect();
    let (py, sent) = spawn_rank(&w, &d, tag, &scratch, request, 0, &all);
    let mut procs = [py];
    wait_until("rank 0 sending every chunk", &mut procs, || sent.exists()).await;
    // Every notification of rank 0 reached the tracker and counted as a new chunk...
    wait_until("decode counting rank 0's chunks", &mut procs, || {
        d.engine.tracker_counters().new_chunks == chunks
    })
    .await;
    // ...and still, given time, the request is not complete.
    let early = tokio::time::timeout(Duration::from_secs(1), &mut done).await;
    assert!(
        early.is_err(),
        "decode finished with only rank 0's chunks: {early:?}"
    );
    let stats = d.engine.stats();
    assert_eq!((stats.completed, stats.in_flight), (0, 1), "{stats:?}");
    assert_eq!(
        (stats.malformed, stats.unknown_sender, stats.refused),
        (0, 0, 0),
        "{stats:?}"
    );
    // Rank 0's bytes did arrive; rank 1's pages are still poisoned.
    let layout = w.dst_layout();
    let read = |at: u64, b: &mut [u8]| d.engine.read_pool(at, b);
    let checked = verify::check(&layout, &[w.layer_range(0)], request, &w.dst_pages, read).unwrap();
    assert_eq!(
        checked,
        u64::from(w.layer_range(0).len() as u32)
            * u64::from(shape.regions.count())
            * w.dst_pages.len() as u64
            * w.page_bytes()
    );
    // Rank 1's layers alone (rank 0's range left empty).
    let rank1 = verify::check(
        &layout,
        &[0..0, w.layer_range(1)],
        request,
        &w.dst_pages,
        read,
    );
    assert!(
        matches!(
            rank1,
            Err(verify::VerifyError::Mismatch {
                rank: 1,
                still_poisoned: true,
                ..
            })
        ),
        "{rank1:?}"
    );

    d.engine.abort(request);
    let outcome = tokio::time::timeout(Duration::from_secs(5), done)
        .await
        .expect("abort did not end the request");
    assert!(
        matches!(outcome, Outcome::Failed(_)),
        "after abort: {outcome:?}"
    );
    assert_eq!(d.engine.stats().completed, 0);

    std::fs::write(scratch.path("linger"), b"done\n").unwrap();
    for p in procs.iter_mut() {
        p.wait_ok(BOUND).await;
    }
}

/// The other direction, at the transport level: our `NixlTransport` writes into a Python agent's buffer
/// with a binary v1 notification, then with an SGLang text one; Python decodes both and checks the bytes.
///
/// A `PrefillEngine`-level version would need a way to give a prefill engine a decode that does not
/// speak our control plane: an out-of-band API taking the decode agent's metadata, its region and each
/// request's page allocation (what a `TransferRequest` carries today). None exists yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_nixl_transport_writes_into_python_agent() {
    let scratch = Scratch::new("recv");
    let len: u64 = 3 * 4096 + 512;
    let half = len / 2;
    let rank: u16 = 1;
    let request = RequestId(0x00c0_ffee_1234_5678);
    let name = format!("kvx-prefill-{}-recv", std::process::id());
    let md_file = scratch.path("python.md");
    // What we send, and what Python must find in its buffer.
    let mut bytes = vec![0u8; len as usize];
    verify::fill(request, rank, 0, &mut bytes);
    let expected_file = scratch.path("expected.bin");
    std::fs::write(&expected_file, &bytes).unwrap();
    let args = serde_json::json!({
        "agent_name": format!("python-decode-{}", std::process::id()),
        "len": len,
        "md_file": md_file,
        "sender": name,
        "request": request.0,
        "pp_rank": rank,
        "expected_file": expected_file,
        "timeout_s": BOUND.as_secs(),
    });
    let cfg = scratch.path("recv.json");
    std::fs::write(&cfg, args.to_string()).unwrap();
    let mut procs = [Py::spawn(
        "python receiver",
        "nixl_receiver.py",
        &[&cfg],
        scratch.path("recv.log"),
    )];
    wait_until("python writing its metadata", &mut procs, || {
        md_file.exists()
    })
    .await;
    let blob = std::fs::read(&md_file).unwrap();
    // The file is [addr u64 LE][len u64 LE][agent metadata].
    let addr = u64::from_le_bytes(blob[..8].try_into().unwrap());
    let rlen = u64::from_le_bytes(blob[8..16].try_into().unwrap());
    assert_eq!(rlen, len);
    let md = &blob[16..];

    let sink = Arc::new(|_: transfer_engine::transport::Incoming<'_>| {});
    let t = Arc::new(
        NixlTransport::new(
            NixlConfig {
                name: name.clone(),
                ..NixlConfig::default()
            },
            sink,
        )
        .unwrap(),
    );
    let mut src = HostBuffer::new(len as usize, HostOptions::default()).unwrap();
    src.as_mut_slice().copy_from_slice(&bytes);
    let dyn_t: Arc<dyn Transport> = t.clone();
    let src = Registration::new(&dyn_t, Pool::Owned(src)).unwrap();
    let local = src.id();
    let peer = t
        .connect(
            md,
            &[RemoteRegion {
                addr,
                len,
                rkey: Vec::new(),
            }],
            0,
        )
        .unwrap();
    let first = ChunkNotification::new(request, rank, 0, ChunkStatus::More).encode();
    let last = ChunkNotification::new(request, rank, 1, ChunkStatus::Last { count: 2 })
        .encode_text(TextForm::WithPpRank)
        .unwrap();
    for (i, note) in [first.to_vec(), last.into_bytes()].into_iter().enumerate() {
        let off = i as u64 * half;
        let write = WriteOp {
            local,
            local_offset: off,
            remote: 0,
            remote_offset: off,
            len: if i == 0 { half } else { len - half },
            rows: 1,
            local_stride: 0,
            remote_stride: 0,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        t.post(
            peer,
            vec![write],
            note,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        let res = tokio::task::block_in_place(|| rx.recv_timeout(BOUND));
        res.expect("post did not finish in time")
            .expect("post failed");
    }
    procs[0].wait_ok(BOUND).await;
    t.disconnect(peer);
    src.into_inner().unwrap();
    t.shutdown();
}

/// Our `PrefillEngine` (NIXL backend, SGLang notification format) writes a request into a Python
/// NIXL agent that plays an SGLang decode: the allocation comes out of band (`add_request`), the
/// agent checks both text notifications and every byte of its buffer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_prefill_engine_writes_into_python_agent() {
    use transfer_engine::engine::{ExternalDecode, NotifyFormat, PrefillConfig, PrefillEngine};
    let scratch = Scratch::new("engine");
    // Two layers of one fused region, four 1 KiB pages: 16 tokens of 64 B per page.
    let (layers, pages, page_tokens, bytes_per_token) = (2u32, 4u32, 16u32, 64u64);
    let layout = KvLayout::packed(
        0,
        layers,
        RegionKind::Fused,
        bytes_per_token * u64::from(page_tokens),
        pages,
    );
    let len = layout.buffer_len;
    let rank: u16 = 0;
    let request = RequestId(0x5eed_0000_0042);
    let name = format!("kvx-prefill-engine-{}", std::process::id());
    let md_file = scratch.path("python.md");
    // The same layout on both sides and identity page lists: prefill byte i lands at decode byte i,
    // so Python must find exactly the pool the prefill engine holds.
    let all: Vec<u32> = (0..pages).collect();
    let mut bytes = vec![0u8; len as usize];
    verify::write_source(&layout, request, rank, &all, |at, b| {
        let at = at as usize;
        bytes[at..at + b.len()].copy_from_slice(b);
        Ok::<(), std::convert::Infallible>(())
    })
    .unwrap();
    let expected_file = scratch.path("expected.bin");
    std::fs::write(&expected_file, &bytes).unwrap();
    let args = serde_json::json!({
        "agent_name": format!("python-sglang-decode-{}", std::process::id()),
        "len": len,
        "md_file": md_file,
        "sender": name,
        "request": request.0,
        "pp_rank": rank,
        "expected_file": expected_file,
        "timeout_s": BOUND.as_secs(),
        "all_text": true,
    });
    let cfg_path = scratch.path("engine.json");
    std::fs::write(&cfg_path, args.to_string()).unwrap();
    let mut procs = [Py::spawn(
        "python decode",
        "nixl_receiver.py",
        &[&cfg_path],
        scratch.path("engine.log"),
    )];
    wait_until("python writing its metadata", &mut procs, || {
        md_file.exists()
    })
    .await;
    let blob = std::fs::read(&md_file).unwrap();
    let addr = u64::from_le_bytes(blob[..8].try_into().unwrap());
    assert_eq!(u64::from_le_bytes(blob[8..16].try_into().unwrap()), len);

    let pool = HostBuffer::new(len as usize, HostOptions::default()).unwrap();
    let unused = std::net::SocketAddr::from(([127, 0, 0, 1], 9));
    let mut cfg = PrefillConfig::new(unused, rank, 1, layers, page_tokens, layout.clone());
    cfg.backend = BackendConfig::Nixl(NixlConfig {
        name: name.clone(),
        ..NixlConfig::default()
    });
    cfg.notify_format = NotifyFormat::SglangText;
    let decode = ExternalDecode {
        metadata: blob[16..].to_vec(),
        region: RemoteRegion {
            addr,
            len,
            rkey: Vec::new(),
        },
        layout,
    };
    let engine = PrefillEngine::start_external(cfg, Pool::Owned(pool), decode)
        .await
        .unwrap();
    // As a server puts a request's KV into its pages: by copies into the registered pool.
    engine.write_pool(0, &bytes).unwrap();
    let prompt = pages * page_tokens;
    // An allocation that does not fit is refused, and nothing is sent for it.
    assert!(
        engine
            .add_request(RequestId(1), prompt, prompt / 2, vec![0, 1, 2, 9])
            .is_err()
    );
    engine
        .add_request(request, prompt, prompt / 2, all.clone())
        .unwrap();
    for chunk in 0..2 {
        tokio::time::timeout(BOUND, engine.send_chunk(request, chunk, &all, chunk == 1))
            .await
            .expect("send_chunk hung")
            .unwrap();
    }
    // PP=1: this rank's own vote decides.
    let d = tokio::time::timeout(BOUND, engine.decided(request))
        .await
        .unwrap();
    assert_eq!(d, transfer_engine::core::vote::Decision::Completed);
    procs[0].wait_ok(BOUND).await;
    drop(engine);
}
