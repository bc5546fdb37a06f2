//! Every engine in its own process over loopback: four `kvbench prefill` processes (PP=4) write into
//! one `kvbench decode` process, which checks every byte of every request against the pattern the
//! prefill processes filled their pools with and exits non-zero otherwise. Run over UCX and NIXL.
//!
//! Every wait is bounded; children are killed (and reaped) when a test fails or panics.
#![allow(clippy::unwrap_used)]

mod common;

use common::procs::{Children, read};
use kvbench::cluster::free_addrs;
use std::time::{Duration, Instant};

/// A small workload: 8 GQA-shaped layers (K and V regions, 16-token pages) at 512 B per token per layer
/// (the debug-built decode process checks every byte against the pattern, so bytes cost time here), a
/// prompt that is a multiple of neither page nor chunk, two requests in flight at a time, every byte
/// verified, checksums on.
const WORKLOAD: &[&str] = &[
    "--model",
    "gqa",
    "--layers",
    "8",
    "--bytes-per-token",
    "512",
    "--pp",
    "4",
    "--prompt-tokens",
    "1000",
    "--chunk-tokens",
    "256",
    "--concurrency",
    "2",
    "--verify",
    "all",
    "--checksums",
    "true",
];

/// WORKLOAD with the values of `set` (flag, value) in place of its own.
fn workload_with(set: &[(&str, &'static str)]) -> Vec<&'static str> {
    let mut w = WORKLOAD.to_vec();
    for (flag, value) in set {
        let at = w.iter().position(|a| a == flag).unwrap();
        w[at + 1] = value;
    }
    w
}

/// Runs `kvbench --processes` with `args`, its JSON into a file of its own; asserts that it
/// succeeded (naming `what`) and returns its stdout and the JSON.
fn processes_json(args: &[&str], what: &str) -> (String, serde_json::Value) {
    static RUN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let json = std::env::temp_dir().join(format!(
        "kvbench-processes-{}-{}.json",
        std::process::id(),
        RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(args)
        .args(["--processes", "--json"])
        .arg(&json)
        .env_remove("KVX_TOKEN")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what}: kvbench --processes ended with {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&json).unwrap();
    let _ = std::fs::remove_file(&json);
    (stdout, serde_json::from_str(&text).unwrap())
}

/// Bound on the decode process, from spawn to exit (debug builds, five processes on two cores).
const DECODE_BOUND: Duration = Duration::from_secs(90);
/// Bound on each prefill process's exit once the decode process is gone.
const PREFILL_EXIT_BOUND: Duration = Duration::from_secs(20);

/// Runs `requests` requests of [`WORKLOAD`] on `backend` with `envs` in every process's environment.
async fn four_prefill_processes_one_decode(backend: &str, requests: u32, envs: &[(&str, &str)]) {
    let mut kids = Children::new(&format!("multiprocess-{backend}"));
    let dir = kids.dir.clone();
    // The decode listener and the four ranks' vote-mesh listeners.
    let addrs = free_addrs(5).unwrap();
    let (decode, peers) = (addrs[0], &addrs[1..]);
    let peers = peers
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let common: Vec<String> = WORKLOAD
        .iter()
        .map(|s| s.to_string())
        .chain(["--backend".into(), backend.into()])
        .chain(["--requests".into(), requests.to_string()])
        .collect();
    let json = dir.join("report.json");

    let started = Instant::now();
    let mut args: Vec<String> = vec!["decode".into(), "--listen".into(), decode.to_string()];
    args.extend(common.iter().cloned());
    args.extend(["--json".into(), json.display().to_string()]);
    kids.spawn("decode", &[], &args, envs);
    for rank in 0..4 {
        // No workload flags: a prefill role serves decode's workload, which it reads from decode's
        // Hello (the shape, PP size, prompt, chunks, concurrency, checksums and backend all differ
        // from kvbench's defaults here).
        let args: Vec<String> = vec![
            "prefill".into(),
            "--connect".into(),
            decode.to_string(),
            "--pp-rank".into(),
            rank.to_string(),
            "--peers".into(),
            peers.clone(),
        ];
        kids.spawn(&format!("prefill-{rank}"), &[], &args, envs);
    }

    let Some(status) = kids.wait(0, started + DECODE_BOUND) else {
        panic!(
            "the decode process did not finish within {DECODE_BOUND:?}\n{}",
            kids.logs()
        );
    };
    assert!(
        status.success(),
        "decode exited with {status}\nstdout:\n{}\n{}",
        read(&dir.join("decode.out")),
        kids.logs()
    );

    // The table: the backend's row says verified yes.
    let table = read(&dir.join("decode.out"));
    let row = table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(backend))
        .unwrap_or_else(|| panic!("no {backend} row in the table:\n{table}"));
    assert!(
        row.split_whitespace().any(|w| w == "yes") && !row.split_whitespace().any(|w| w == "no"),
        "the {backend} row does not say verified yes: {row}"
    );
    // The same numbers as JSON, which name their fields.
    let report: serde_json::Value = serde_json::from_str(&read(&json)).unwrap();
    let r = &report[0];
    assert_eq!(r["backend"], backend);
    assert_eq!(r["verified"], true, "{r}");
    assert_eq!(r["failed"], 0, "{r}");
    assert_eq!(r["requests"], u64::from(requests), "{r}");

    // With the decode process gone, every prefill process sees its connection close and exits.
    let closed = Instant::now();
    for i in 1..kids.procs.len() {
        let Some(status) = kids.wait(i, closed + PREFILL_EXIT_BOUND) else {
            panic!(
                "{} did not exit within {PREFILL_EXIT_BOUND:?} of the decode process\n{}",
                kids.procs[i].0,
                kids.logs()
            );
        };
        assert!(
            status.success(),
            "{} exited with {status}\n{}",
            kids.procs[i].0,
            kids.logs()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_prefill_processes_one_decode_ucx() {
    four_prefill_processes_one_decode("ucx", 4, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_prefill_processes_one_decode_nixl() {
    four_prefill_processes_one_decode("nixl", 4, &[]).await;
}

/// UCX's native TCP put across processes, the configuration that crashed the decode process in
/// `uct_tcp_iface_progress` until endpoints resolved their remote id at creation: 100 requests,
/// every byte verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_prefill_processes_one_decode_ucx_native_tcp_put() {
    four_prefill_processes_one_decode(
        "ucx",
        100,
        &[("UCX_TLS", "tcp,self"), ("UCX_TCP_PUT_ENABLE", "y")],
    )
    .await;
}

/// The roles admit only processes holding the run's secret: a prefill whose `KVX_TOKEN` is wrong is
/// refused and exits non-zero saying so, while decode waits on; one whose `--token-file` holds the
/// secret (with a trailing newline, and a wrong `KVX_TOKEN` beside it: the file wins) gets in and the
/// run completes, verified. No process prints the secret.
#[test]
fn roles_admit_only_the_shared_secret() {
    let mut kids = Children::new("token");
    let dir = kids.dir.clone();
    let decode = free_addrs(1).unwrap()[0].to_string();
    let mut workload: Vec<String> = WORKLOAD.iter().map(|s| s.to_string()).collect();
    let at = workload.iter().position(|a| a == "--pp").unwrap();
    workload[at + 1] = "1".into();
    workload.extend(["--backend".into(), "ucx".into()]);
    let json = dir.join("report.json");
    let started = Instant::now();

    let mut args: Vec<String> = vec!["decode".into(), "--listen".into(), decode.clone()];
    args.extend(workload.iter().cloned());
    args.extend(["--json".into(), json.display().to_string()]);
    kids.spawn("decode", &[], &args, &[]);
    let mut prefill: Vec<String> = vec!["prefill".into(), "--connect".into(), decode];
    prefill.extend(["--pp-rank", "0", "--pp-size", "1"].map(String::from));
    prefill.extend(workload.iter().cloned());

    // A prefill whose flags say another workload than decode runs is refused before it starts,
    // naming the flag; decode waits on.
    let mut other = prefill.clone();
    let at = other.iter().position(|a| a == "--prompt-tokens").unwrap();
    other[at + 1] = "512".into();
    kids.spawn("prefill-other-workload", &[], &other, &[]);
    let Some(status) = kids.wait(1, started + DECODE_BOUND) else {
        panic!(
            "a prefill with another workload is still running\n{}",
            kids.logs()
        );
    };
    assert!(
        !status.success()
            && kids
                .stderr(1)
                .contains("--prompt-tokens 512 here, decode runs 1000"),
        "a prefill with another workload exited with {status} without naming it\n{}",
        kids.logs()
    );

    let wrong = [("KVX_TOKEN", "not the secret")];
    kids.spawn("prefill-wrong", &[], &prefill, &wrong);
    let Some(status) = kids.wait(2, started + DECODE_BOUND) else {
        panic!(
            "a prefill with a wrong secret is still running\n{}",
            kids.logs()
        );
    };
    let refused = kids.stderr(2).to_lowercase();
    assert!(
        !status.success() && (refused.contains("token") || refused.contains("auth")),
        "a prefill with a wrong secret exited with {status} without saying it was refused\n{}",
        kids.logs()
    );
    assert!(
        kids.procs[0].1.try_wait().unwrap().is_none(),
        "decode did not wait on after refusing a rank\n{}",
        kids.logs()
    );

    // A token file that others may read is refused before anything is sent.
    let file = dir.join("token");
    std::fs::write(&file, format!("{}\n", kids.token)).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut args = prefill.clone();
    args.extend(["--token-file".into(), file.display().to_string()]);
    kids.spawn("prefill-open-file", &[], &args, &wrong);
    let Some(status) = kids.wait(3, Instant::now() + PREFILL_EXIT_BOUND) else {
        panic!(
            "a prefill with an open token file is still running\n{}",
            kids.logs()
        );
    };
    let said = kids.stderr(3);
    assert!(
        !status.success() && said.contains("644") && said.contains("chmod 600"),
        "a token file others can read was accepted ({status})\n{}",
        kids.logs()
    );
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    kids.spawn("prefill", &[], &args, &wrong);
    let Some(status) = kids.wait(0, started + DECODE_BOUND) else {
        panic!(
            "decode did not finish within {DECODE_BOUND:?}\n{}",
            kids.logs()
        );
    };
    assert!(
        status.success(),
        "decode exited with {status}\n{}",
        kids.logs()
    );
    let report: serde_json::Value = serde_json::from_str(&read(&json)).unwrap();
    assert_eq!(report[0]["verified"], true, "{report}");
    let Some(status) = kids.wait(4, Instant::now() + PREFILL_EXIT_BOUND) else {
        panic!("the admitted prefill did not exit\n{}", kids.logs());
    };
    assert!(
        status.success(),
        "the admitted prefill exited with {status}\n{}",
        kids.logs()
    );
    for i in 0..kids.procs.len() {
        let out = kids.stdout(i) + &kids.stderr(i);
        assert!(
            !out.contains(&kids.token),
            "{} printed the secret",
            kids.procs[i].0
        );
    }
}

/// `kvbench --processes` runs the deployment shape from one command: it starts decode and the four
/// prefill ranks itself (with a fresh secret) and exits 0 once decode printed a verified table, with
/// last write to Complete measured for every request from the prefill processes' stamps.
#[test]
fn one_command_runs_every_engine_in_its_own_process() {
    let json = std::env::temp_dir().join(format!("kvbench-processes-{}.json", std::process::id()));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(WORKLOAD)
        .args([
            "--requests",
            "4",
            "--backend",
            "ucx",
            "--no-baseline",
            "--processes",
            "--json",
        ])
        .arg(&json)
        .env_remove("KVX_TOKEN")
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kvbench --processes ended with {}\n{table}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let row = table
        .lines()
        .find(|l| l.starts_with("ucx "))
        .unwrap_or_else(|| panic!("no ucx row:\n{table}"));
    assert!(row.ends_with("yes"), "{row}");
    // A decode process of its own said where it listened.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("kvbench decode: listening on"), "{err}");
    let text = std::fs::read_to_string(&json).unwrap();
    let _ = std::fs::remove_file(&json);
    let report: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(report[0]["complete_samples"], 4, "{text}");
    // CPU per request of decode's process and of the prefill processes (from the files they
    // leave beside their stamps), and the decode pool's registration time, are measured.
    for key in [
        "cpu_us_per_request",
        "prefill_cpu_us_per_request",
        "register_ms",
    ] {
        let v = report[0][key].as_f64().unwrap_or(0.0);
        assert!(v > 0.0, "{key} = {v} in {text}");
    }
    // Of the prefill processes' CPU, their progress threads' own copies into decode's pool (UCX
    // maps it: the ranks copy with their CPUs) are a part, and per chunk of a rank is per request
    // over 4 chunks (1000 tokens in 256) times 4 ranks.
    let field = |k: &str| report[0][k].as_f64().unwrap_or(-1.0);
    let (cpu, copy) = (
        field("prefill_cpu_us_per_request"),
        field("prefill_copy_us_per_request"),
    );
    assert!(
        copy > 0.0 && copy < cpu,
        "copy {copy} of cpu {cpu} in {text}"
    );
    for (per_chunk, per_request) in [
        (field("prefill_cpu_us_per_chunk"), cpu),
        (field("prefill_copy_us_per_chunk"), copy),
    ] {
        assert!(
            (per_chunk * 16.0 - per_request).abs() <= 1e-6 * per_request,
            "{per_chunk} per chunk, {per_request} per request in {text}"
        );
    }
    // By thread: the copies are the progress threads' own, and the threads' clocks add up to the
    // processes' CPU (less threads that ended in the window, and the moments between readings).
    let (progress, runtime, other) = (
        field("prefill_progress_us_per_chunk"),
        field("prefill_runtime_us_per_chunk"),
        field("prefill_other_us_per_chunk"),
    );
    let (cpu_chunk, copy_chunk) = (cpu / 16.0, copy / 16.0);
    assert!(
        progress >= copy_chunk && runtime > 0.0 && other >= 0.0,
        "progress {progress}, runtime {runtime}, other {other}, copy {copy_chunk} in {text}"
    );
    let threads = progress + runtime + other;
    assert!(
        threads <= cpu_chunk * 1.05 && threads >= cpu_chunk * 0.5,
        "threads {threads} of cpu {cpu_chunk} per chunk in {text}"
    );
    assert!(
        report[0]["decode_pool_bytes"].as_u64().unwrap_or(0) > 0,
        "{text}"
    );
}

/// `kvbench --processes` with two prefill instances (PP 2 each) and two decode instances: six
/// processes, one engine each. Every prefill rank serves both decodes from its one engine (one
/// registration of its pool), each decode drives its own requests into both instances in turn,
/// and the first decode reports them all, every byte of every request verified, on each backend.
/// Once more on UCX with the processes finding each other through etcd (a local server): each
/// prefill rank serves every decode instance registered there, and its PP peers are its own
/// instance's ranks.
#[test]
fn instances_in_processes_serve_every_decode_from_one_engine() {
    for (backend, etcd) in [("ucx", false), ("nixl", false), ("ucx", true)] {
        let mut args = workload_with(&[("--pp", "2")]);
        args.extend([
            "--requests",
            "4",
            "--prefill-instances",
            "2",
            "--decode-instances",
            "2",
            "--backend",
            backend,
            "--no-baseline",
        ]);
        if etcd {
            args.extend(["--etcd", "auto"]);
        }
        let (_, report) = processes_json(&args, &format!("{backend} (etcd {etcd})"));
        let text = report.to_string();
        let r = &report[0];
        // Each decode ran its 4 requests, all checked (--verify all) and stamped by the ranks.
        for (key, want) in [
            ("requests", 8),
            ("failed", 0),
            ("verified_requests", 8),
            ("complete_samples", 8),
            ("prefill_instances", 2),
            ("decode_instances", 2),
            ("registrations_per_process", 1),
            // Both instances' two ranks connected to each decode.
            ("connections_per_decode", 4),
            ("decodes_per_prefill_rank", 2),
        ] {
            assert_eq!(r[key], want, "{backend}: {key} in {text}");
        }
        assert_eq!(r["verified"], true, "{backend}: {text}");
        assert!(r["writes_per_request"].as_u64().unwrap_or(0) > 0, "{text}");
    }
}

/// One `--processes` TP run of the test below.
struct TpCase {
    backend: &'static str,
    flags: Vec<&'static str>,
    /// Prefill ranks connected to each decode TP rank: identical TP, the mapping.
    connected: (u64, u64),
    /// Requests of the whole run.
    requests: u64,
    /// The processes find each other through etcd (a local server), not by address.
    etcd: bool,
}

/// GQA, 4 heads: prefill TP 2 into decode TP 4, decode pages of 32 tokens.
const TWO_INTO_FOUR: &[&str] = &[
    "--prefill-tp",
    "2",
    "--decode-tp",
    "4",
    "--kv-heads",
    "4",
    "--decode-page-tokens",
    "32",
];

/// GQA, 8 heads: prefill TP 2 into decode TP 1, two instances of each side.
const TWO_INTO_ONE_INSTANCES: &[&str] = &[
    "--prefill-tp",
    "2",
    "--decode-tp",
    "1",
    "--prefill-instances",
    "2",
    "--decode-instances",
    "2",
];

/// `kvbench --processes` with TP sizes: every decode TP rank and every prefill (TP, PP) rank that
/// writes somewhere is a process of its own. Each backend runs identical TP and then the mapping,
/// every byte of every decode rank's pages checked against the heads it holds; the rows carry the
/// TP sizes, the writes the prefill engines counted and one registration per process. Once with
/// two prefill and two decode instances: each decode instance's requests (4 each) are checked on
/// its TP ranks, and every prefill rank serves both. Twice more with the processes finding each
/// other through etcd, each rank linking with the ranks of the other side it maps onto.
#[test]
fn tp_sizes_that_differ_run_with_every_rank_in_its_own_process() {
    let runs = [
        // GQA, 4 heads: prefill TP 2 into decode TP 4, decode pages twice prefill's. Each decode
        // rank's one head comes from one prefill TP rank's pipeline of 2.
        TpCase {
            backend: "ucx",
            flags: TWO_INTO_FOUR.to_vec(),
            connected: (2, 2),
            requests: 4,
            etcd: false,
        },
        // The same through etcd, with two decode instances: each prefill rank finds the two
        // decode TP ranks it writes into of each instance among the four decode records and
        // serves all four from its one engine.
        TpCase {
            backend: "ucx",
            flags: [TWO_INTO_FOUR, &["--decode-instances", "2"]].concat(),
            connected: (2, 2),
            requests: 8,
            etcd: true,
        },
        // MLA into fewer decode ranks: prefill TP 2 into decode TP 1, only prefill TP rank 0
        // writes (one writer per destination), so its pipeline of 2 is all decode sees.
        TpCase {
            backend: "nixl",
            flags: vec!["--model", "mla", "--prefill-tp", "2", "--decode-tp", "1"],
            connected: (2, 2),
            requests: 4,
            etcd: false,
        },
        // GQA, 8 heads, prefill TP 2 into decode TP 1, two instances of each side: each decode
        // sees both instances' pipelines of 2, of one TP rank (identical) or two (mapped).
        TpCase {
            backend: "ucx",
            flags: TWO_INTO_ONE_INSTANCES.to_vec(),
            connected: (4, 8),
            requests: 8,
            etcd: false,
        },
        // The same through etcd on NIXL: the decode TP rank admits both prefill TP ranks of each
        // instance's PP ranks as their records appear (two sources per PP rank).
        TpCase {
            backend: "nixl",
            flags: TWO_INTO_ONE_INSTANCES.to_vec(),
            connected: (4, 8),
            requests: 8,
            etcd: true,
        },
    ];
    for TpCase {
        backend,
        flags,
        connected: (identical, mapped),
        requests,
        etcd,
    } in runs
    {
        // Whole pages of 16 and of 32 tokens.
        let mut args = workload_with(&[("--pp", "2"), ("--prompt-tokens", "1024")]);
        if flags.contains(&"mla") {
            let model = args.iter().position(|a| *a == "--model").unwrap();
            args.drain(model..model + 2);
        }
        args.extend(&flags);
        args.extend(["--requests", "4", "--backend", backend, "--no-baseline"]);
        if etcd {
            args.extend(["--etcd", "auto"]);
        }
        let (stdout, rows) = processes_json(&args, &format!("{backend} {flags:?} etcd {etcd}"));
        let text = rows.to_string();
        let rows = rows.as_array().unwrap();
        assert_eq!(rows.len(), 2, "{text}");
        let tp = |i: usize| {
            let at = flags
                .iter()
                .position(|f| *f == ["--prefill-tp", "--decode-tp"][i]);
            flags[at.unwrap() + 1].parse::<u64>().unwrap()
        };
        for (r, (prefill_tp, ranks)) in rows.iter().zip([(tp(1), identical), (tp(0), mapped)]) {
            for (key, want) in [
                ("prefill_tp", prefill_tp),
                ("decode_tp", tp(1)),
                ("requests", requests),
                ("failed", 0),
                ("verified_requests", requests),
                ("registrations_per_process", 1),
                ("connections_per_decode", ranks),
            ] {
                assert_eq!(r[key], want, "{backend}: {key} in {text}");
            }
            assert_eq!(r["verified"], true, "{backend}: {text}");
            assert!(r["writes_per_request"].as_u64().unwrap_or(0) > 0, "{text}");
        }
        assert!(
            stdout.contains(&format!(
                "kvbench: {backend} TP {} into {}, each rank a process",
                tp(0),
                tp(1)
            )),
            "{stdout}"
        );
    }
}

/// A `kvbench --processes` killed by a signal (SIGKILL, which it cannot catch) takes its role
/// processes with it: none is left running on its own.
#[test]
fn a_killed_kvbench_leaves_no_role_process_behind() {
    let mut kvbench = std::process::Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(WORKLOAD)
        .args([
            "--requests",
            "100000",
            "--backend",
            "ucx",
            "--no-baseline",
            "--processes",
        ])
        .env_remove("KVX_TOKEN")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = kvbench.id();
    let children = || -> Vec<u32> {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    };
    // Decode and the four prefill ranks.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut roles = children();
    while roles.len() < 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "kvbench started {roles:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
        roles = children();
    }
    // Let them connect and run a little.
    std::thread::sleep(std::time::Duration::from_secs(2));
    kvbench.kill().unwrap();
    kvbench.wait().unwrap();
    let alive = |p: &u32| {
        std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|t| !t.trim_start().starts_with('Z'))
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while roles.iter().any(alive) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let left: Vec<u32> = roles.iter().copied().filter(alive).collect();
    for p in &left {
        let _ = std::process::Command::new("kill")
            .args(["-9", &p.to_string()])
            .status();
    }
    assert!(left.is_empty(), "role processes {left:?} outlived kvbench");
}

/// CPU time (user + system) of process `pid` so far, in clock ticks (`/proc/PID/stat`).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = read(&std::path::PathBuf::from(format!("/proc/{pid}/stat")));
    let after = stat.rsplit(')').next().unwrap_or_default();
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of the line; `after` starts at field 3.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// A decode whose descriptor table is full (its limit lowered to a few above what it holds, then a
/// flood of connections) fails every accept; it pauses instead of spinning, so it takes little CPU,
/// and once the flood is gone it admits a real prefill and the run completes.
#[test]
fn a_full_descriptor_table_pauses_accepts_and_recovers() {
    let mut kids = Children::new("fdlimit");
    let addr = free_addrs(1).unwrap()[0];
    let mut workload: Vec<String> = WORKLOAD.iter().map(|s| s.to_string()).collect();
    let at = workload.iter().position(|a| a == "--pp").unwrap();
    workload[at + 1] = "1".into();
    workload.extend(["--backend".into(), "ucx".into()]);
    let mut args: Vec<String> = vec!["decode".into(), "--listen".into(), addr.to_string()];
    args.extend(workload.iter().cloned());
    kids.spawn("decode", &[], &args, &[]);
    assert!(
        kids.wait_stderr(0, Instant::now() + DECODE_BOUND, |e| e
            .contains("listening on")),
        "decode did not listen\n{}",
        kids.logs()
    );
    let pid = kids.procs[0].1.id();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    let limit = |soft: &str| {
        let ok = std::process::Command::new("prlimit")
            .args(["--pid", &pid.to_string(), &format!("--nofile={soft}:")])
            .status()
            .unwrap()
            .success();
        assert!(ok, "prlimit failed");
    };
    let before = read(&std::path::PathBuf::from(format!("/proc/{pid}/limits")));
    let soft = before
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .unwrap()
        .to_string();
    limit(&(open + 4).to_string());
    let flood: Vec<std::net::TcpStream> = (0..32)
        .filter_map(|_| std::net::TcpStream::connect(addr).ok())
        .collect();
    assert!(flood.len() >= 16, "only {} connections", flood.len());
    std::thread::sleep(Duration::from_millis(500));
    let (t0, c0) = (Instant::now(), cpu_ticks(pid));
    std::thread::sleep(Duration::from_secs(2));
    let ticks = cpu_ticks(pid) - c0;
    let secs = t0.elapsed().as_secs_f64();
    // SAFETY: sysconf(3) with a valid name has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let share = ticks as f64 / hz / secs;
    assert!(
        kids.stderr(0).contains("accept failed; pausing"),
        "the flood never filled the descriptor table\n{}",
        kids.logs()
    );
    assert!(
        share < 0.25,
        "decode took {:.0} % of a core while its accepts failed",
        share * 100.0
    );
    drop(flood);
    limit(&soft);
    let mut prefill: Vec<String> = vec!["prefill".into(), "--connect".into(), addr.to_string()];
    prefill.extend(["--pp-rank", "0", "--pp-size", "1"].map(String::from));
    prefill.extend(workload.iter().cloned());
    kids.spawn("prefill", &[], &prefill, &[]);
    let Some(status) = kids.wait(0, Instant::now() + DECODE_BOUND) else {
        panic!("decode did not finish after the flood\n{}", kids.logs());
    };
    assert!(
        status.success(),
        "decode exited with {status}\n{}",
        kids.logs()
    );
    println!(
        "decode took {:.1} % of a core while its accepts failed",
        share * 100.0
    );
}
