//! Multi-process faults over real UCX: a prefill PP process SIGKILLed mid-request and started again, the decode process
//! SIGKILLed mid-run, and decode and prefill on separate "hosts": two network namespaces joined by a
//! veth pair, UCX over TCP. The namespace tests need root, iproute2 and iptables; where they cannot
//! run they fail, unless `KVX_SKIP_NETNS=1` asks to skip them (they then print `SKIPPED` and pass).
//!
//! Every wait is bounded; children are killed (SIGKILL) and reaped when a test fails or panics, and the
//! namespaces are deleted whatever happens.
#![allow(clippy::unwrap_used)]

mod common;

use common::procs::{Children, read, strings, without_colors};
use kvbench::cluster::free_addrs;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A small per-request workload that never runs out on its own: 8 GQA-shaped layers at 512 B per token
/// per layer, PP=4, two requests always in flight, no byte checks (the process is killed mid-run).
const ENDLESS: &[&str] = &[
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
    "--requests",
    "1000000",
    "--concurrency",
    "2",
    "--verify",
    "none",
    "--backend",
    "ucx",
];

/// The separate-hosts workload: four requests, every byte verified, checksums on.
const SMALL: &[&str] = &[
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
    "--requests",
    "4",
    "--concurrency",
    "2",
    "--verify",
    "all",
    "--checksums",
    "true",
    "--backend",
    "ucx",
];

/// From spawn until decode has logged every rank connected (debug builds, five processes, two cores).
const UP_BOUND: Duration = Duration::from_secs(30);
/// How long the run goes on before the kill, so requests are in flight (not a result's wait: nothing
/// is asserted on after it but what the kill causes).
const RUN_BEFORE_KILL: Duration = Duration::from_millis(700);
/// Bound on the decode process's exit once a prefill rank is killed.
const DECODE_EXIT_BOUND: Duration = Duration::from_secs(30);
/// Bound on each prefill process's exit once the decode process is gone.
const PREFILL_EXIT_BOUND: Duration = Duration::from_secs(20);

fn decode_args(listen: &str, workload: &[&str]) -> Vec<String> {
    let mut args = strings(&["decode", "--listen", listen]);
    args.extend(strings(workload));
    args
}

fn prefill_args(connect: &str, rank: u16, peers: &str, workload: &[&str]) -> Vec<String> {
    let mut args = strings(&["prefill", "--connect", connect, "--pp-rank"]);
    args.extend([rank.to_string(), "--pp-size".into(), "4".into()]);
    args.extend(["--peers".into(), peers.to_string()]);
    args.extend(strings(workload));
    args
}

fn connected_ranks(stderr: &str) -> usize {
    stderr
        .lines()
        .filter(|l| l.contains("prefill rank connected"))
        .count()
}

/// Decode (child 0) and four prefill ranks (children 1..=4) on loopback, running `ENDLESS`; returns
/// once decode has logged all four ranks connected and the run has gone on for `RUN_BEFORE_KILL`.
fn start_endless(kids: &mut Children) {
    let addrs = free_addrs(5).unwrap();
    let decode = addrs[0].to_string();
    let peers = addrs[1..]
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let started = Instant::now();
    kids.spawn("decode", &[], &decode_args(&decode, ENDLESS), &[]);
    for rank in 0..4 {
        let args = prefill_args(&decode, rank, &peers, ENDLESS);
        kids.spawn(&format!("prefill-{rank}"), &[], &args, &[]);
    }
    assert!(
        kids.wait_stderr(0, started + UP_BOUND, |e| connected_ranks(e) == 4),
        "decode did not see four ranks connected within {UP_BOUND:?}\n{}",
        kids.logs()
    );
    std::thread::sleep(RUN_BEFORE_KILL);
    for i in 0..kids.procs.len() {
        assert!(
            kids.procs[i].1.try_wait().unwrap().is_none(),
            "{} exited before the kill\n{}",
            kids.procs[i].0,
            kids.logs()
        );
    }
}

/// Waits for every prefill process (children 1..=4 but `skip`) to exit within `PREFILL_EXIT_BOUND`
/// of now, and returns their statuses.
fn prefills_exit(kids: &mut Children, skip: Option<usize>, after: &str) -> Vec<ExitStatus> {
    let from = Instant::now();
    let mut statuses = Vec::new();
    for i in 1..kids.procs.len() {
        if Some(i) == skip {
            continue;
        }
        let Some(status) = kids.wait(i, from + PREFILL_EXIT_BOUND) else {
            panic!(
                "{} did not exit within {PREFILL_EXIT_BOUND:?} of {after}\n{}",
                kids.procs[i].0,
                kids.logs()
            );
        };
        // A clean exit or an error exit; never a crash (signal) on the way out.
        assert!(
            status.code().is_some(),
            "{} died of a signal ({status}) after {after}\n{}",
            kids.procs[i].0,
            kids.logs()
        );
        statuses.push(status);
    }
    statuses
}

/// A run that lasts `RESTART_RUN` seconds whatever happens: requests stream (two always in flight,
/// so the kill finds some), then a final wave of checked requests, with checksums on throughout.
const RESTART_RUN: &str = "12";
const RESTARTABLE: &[&str] = &[
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
    "--requests",
    "1",
    "--duration",
    RESTART_RUN,
    "--concurrency",
    "2",
    "--verify",
    "last",
    "--checksums",
    "true",
    "--backend",
    "ucx",
    "--no-baseline",
];

/// How long rank 2 stays dead before it is started again (the scenario, not a wait for a result).
const DEAD_FOR: Duration = Duration::from_secs(1);

/// Prefill rank 2 is SIGKILLed while requests are in flight and started again a second later with
/// the same rank and address. Decode fails the requests the old process had not delivered with
/// PeerLost naming rank 2, holds those it is asked for meanwhile until the new start is admitted
/// (its log says so), and keeps driving: requests complete again and the last wave's bytes verify. Every failure happened while rank 2 was away, so decode exits 0, and so does
/// every prefill process when decode closes the run.
#[test]
fn a_killed_prefill_rank_rejoins_and_serves_again() {
    let mut kids = Children::new("restart-prefill");
    let addrs = free_addrs(5).unwrap();
    let decode = addrs[0].to_string();
    let peers = addrs[1..]
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let json = kids.dir.join("decode.json");
    let mut dargs = decode_args(&decode, RESTARTABLE);
    dargs.extend(["--json".into(), json.display().to_string()]);
    let started = Instant::now();
    kids.spawn("decode", &[], &dargs, &[]);
    for rank in 0..4 {
        let args = prefill_args(&decode, rank, &peers, RESTARTABLE);
        kids.spawn(&format!("prefill-{rank}"), &[], &args, &[]);
    }
    assert!(
        kids.wait_stderr(0, started + UP_BOUND, |e| connected_ranks(e) == 4),
        "decode did not see four ranks connected within {UP_BOUND:?}\n{}",
        kids.logs()
    );
    std::thread::sleep(RUN_BEFORE_KILL);
    kids.sigkill(3); // child 3 is prefill rank 2
    let killed_at = Instant::now();
    assert!(kids.wait(3, killed_at + Duration::from_secs(5)).is_some());
    std::thread::sleep(DEAD_FOR);
    let args = prefill_args(&decode, 2, &peers, RESTARTABLE);
    kids.spawn("prefill-2-again", &[], &args, &[]); // child 5
    assert!(
        kids.wait_stderr(0, Instant::now() + UP_BOUND, |e| e
            .contains("prefill rank rejoined")),
        "decode did not admit rank 2 again within {UP_BOUND:?}\n{}",
        kids.logs()
    );

    let run: u64 = RESTART_RUN.parse().unwrap();
    let Some(status) = kids.wait(0, started + Duration::from_secs(run) + DECODE_EXIT_BOUND) else {
        panic!("decode did not finish its run\n{}", kids.logs());
    };
    let err = kids.stderr(0);
    let report: serde_json::Value = serde_json::from_str(&read(&json))
        .unwrap_or_else(|e| panic!("decode wrote no report ({e})\n{}", kids.logs()));
    let r = &report[0];
    let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("no {k} in {r}"));
    assert!(
        status.success(),
        "decode exited with {status}: failures outside rank 2's absence?\n{r}\n{}",
        kids.logs()
    );
    let plain = without_colors(&err);
    assert!(
        plain.contains("prefill rank lost rank=2"),
        "decode did not log rank 2 lost\n{}",
        kids.logs()
    );
    assert!(
        plain.contains("prefill rank rejoined rank=2"),
        "decode did not log rank 2 rejoined\n{}",
        kids.logs()
    );
    // A request rank 2 had not delivered its part of when it died fails with PeerLost naming it
    // (one whose part it had delivered still completes); nothing fails for another reason.
    let failures: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("request failed:"))
        .collect();
    assert!(
        failures
            .iter()
            .all(|l| l.contains("PeerLost { rank: 2,") || l.contains("RankUnavailable { rank: 2 }")),
        "requests failed for other reasons: {failures:#?}\n{}",
        kids.logs()
    );
    assert_eq!(n("failed"), failures.len() as u64, "{r}");
    assert_eq!(n("failed"), n("failed_during_absence"), "{r}");
    // Requests expected while rank 2 was away waited for it and completed.
    assert!(n("completed_across_absence") >= 1, "{r}");
    // Requests after the rejoin completed, and the final wave's bytes verified.
    assert!(n("completed_after_last_failure") >= 4, "{r}");
    assert!(n("verified_requests") >= 2, "{r}");
    assert_eq!(r["verified"], serde_json::Value::Bool(true), "{r}");

    let from = Instant::now();
    for i in [1, 2, 4, 5] {
        let Some(status) = kids.wait(i, from + PREFILL_EXIT_BOUND) else {
            panic!(
                "{} did not exit after the run\n{}",
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
    eprintln!(
        "{} requests, {} failed while rank 2 was away, {} waited for it and completed, {} \
         completed after the last failure",
        n("requests"),
        n("failed"),
        n("completed_across_absence"),
        n("completed_after_last_failure")
    );
}

/// The decode process is SIGKILLed mid-run: every prefill process sees its control connection close
/// and exits within its bound.
#[test]
fn sigkill_decode_mid_run() {
    let mut kids = Children::new("kill-decode");
    start_endless(&mut kids);
    let killed_at = Instant::now();
    kids.sigkill(0);
    assert!(kids.wait(0, killed_at + Duration::from_secs(5)).is_some());
    let statuses = prefills_exit(&mut kids, None, "decode's SIGKILL");
    eprintln!(
        "all four prefills exited within {:?} of decode's SIGKILL: {statuses:?}",
        killed_at.elapsed()
    );
}

/// Set to `1` to skip the namespace tests on purpose (a machine without root or iproute2).
const SKIP_NETNS: &str = "KVX_SKIP_NETNS";

/// Whether the namespace tests were asked to skip; says so (stdout and stderr) when they were.
fn netns_skip_requested(test: &str) -> bool {
    let skip = std::env::var(SKIP_NETNS).is_ok_and(|v| v == "1");
    if skip {
        eprintln!("SKIPPED: {test}: {SKIP_NETNS}=1");
        println!("SKIPPED: {test}: {SKIP_NETNS}=1");
    }
    skip
}

/// Fails `test`, which cannot run here, saying why and how to skip it on purpose.
fn cannot_run(test: &str, reason: &str) -> ! {
    panic!(
        "{test} cannot run here: {reason}. It needs root, iproute2 and iptables; set \
         {SKIP_NETNS}=1 to skip it on purpose"
    )
}

/// Runs `ip args..`; the error names the command and what it printed.
fn ip(args: &[&str]) -> Result<(), String> {
    run_cmd("ip", args)
}

/// Runs `prog args..`; the error names the command and what it printed.
fn run_cmd(prog: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run `{prog}`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{prog} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two network namespaces, deleted (with the veth pair inside them) on drop.
struct Netns {
    names: Vec<String>,
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// `(decode's namespace, prefill's namespace)`, joined by a veth pair: `kvxd` at 10.77.0.1/24 in the
/// first, `kvxp` at 10.77.0.2/24 in the second, loopback up in both.
fn two_hosts(guard: &mut Netns) -> Result<(String, String), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root: cannot create network namespaces".into());
    }
    ip(&["-V"]).map_err(|e| format!("no usable `ip` binary (iproute2): {e}"))?;
    let tag = format!("{}{}", std::process::id(), rand::random::<u16>());
    let (d, p) = (format!("kvxd{tag}"), format!("kvxp{tag}"));
    for n in [&d, &p] {
        ip(&["netns", "add", n])?;
        guard.names.push(n.clone());
    }
    ip(&[
        "link", "add", "kvxd", "netns", &d, "type", "veth", "peer", "name", "kvxp", "netns", &p,
    ])?;
    for (ns, dev, addr) in [(&d, "kvxd", "10.77.0.1/24"), (&p, "kvxp", "10.77.0.2/24")] {
        ip(&["-n", ns, "addr", "add", addr, "dev", dev])?;
        ip(&["-n", ns, "link", "set", dev, "up"])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
    }
    // A veth end gets its carrier asynchronously; UCX ignores an interface that is not running yet.
    let deadline = Instant::now() + Duration::from_secs(10);
    for (ns, dev) in [(&d, "kvxd"), (&p, "kvxp")] {
        loop {
            let out = Command::new("ip")
                .args(["-n", ns, "-o", "link", "show", "dev", dev])
                .output()
                .map_err(|e| format!("cannot run `ip`: {e}"))?;
            if String::from_utf8_lossy(&out.stdout).contains("state UP") {
                break;
            }
            if Instant::now() >= deadline {
                return Err(format!("{dev} in {ns} did not come up within 10 s"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok((d, p))
}

/// Separate hosts: decode in one network namespace, the four prefill ranks in another, UCX over TCP on
/// the veth pair between them; every byte verified. Fails where namespaces cannot be made (not root,
/// no `ip`), unless [`SKIP_NETNS`] asks to skip it.
#[test]
fn separate_hosts_netns_ucx_tcp() {
    const NAME: &str = "separate_hosts_netns_ucx_tcp";
    if netns_skip_requested(NAME) {
        return;
    }
    let mut guard = Netns { names: Vec::new() };
    let (dns, pns) = two_hosts(&mut guard).unwrap_or_else(|reason| cannot_run(NAME, &reason));
    // Declared after the guard, so dropped (children killed and reaped) before the namespaces go.
    let mut kids = Children::new("netns");
    // Fresh namespaces: every port is free in them.
    let decode = "10.77.0.1:47100";
    let peers = "127.0.0.1:47101,127.0.0.1:47102,127.0.0.1:47103,127.0.0.1:47104";
    let json = kids.dir.join("report.json");
    let mut args = decode_args(decode, SMALL);
    args.extend(["--json".into(), json.display().to_string()]);
    let started = Instant::now();
    let denv = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "kvxd")];
    kids.spawn("decode", &["ip", "netns", "exec", &dns], &args, &denv);
    let penv = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "kvxp")];
    for rank in 0..4 {
        let args = prefill_args(decode, rank, peers, SMALL);
        let name = format!("prefill-{rank}");
        kids.spawn(&name, &["ip", "netns", "exec", &pns], &args, &penv);
    }

    let bound = Duration::from_secs(60);
    let Some(status) = kids.wait(0, started + bound) else {
        panic!("decode did not finish within {bound:?}\n{}", kids.logs());
    };
    assert!(
        status.success(),
        "decode exited with {status}\nstdout:\n{}\n{}",
        kids.stdout(0),
        kids.logs()
    );
    let report: serde_json::Value = serde_json::from_str(&read(&json)).unwrap();
    let r = &report[0];
    assert_eq!(r["backend"], "ucx", "{r}");
    assert_eq!(r["verified"], true, "{r}");
    assert_eq!(r["failed"], 0, "{r}");
    assert_eq!(r["requests"], 4, "{r}");
    let statuses = prefills_exit(&mut kids, None, "decode's exit");
    assert!(
        statuses.iter().all(ExitStatus::success),
        "a prefill failed: {statuses:?}\n{}",
        kids.logs()
    );
    eprintln!(
        "separate hosts: 4 requests verified over UCX/TCP between namespaces in {:?}",
        started.elapsed()
    );
}

/// Requests in the partition test: enough that, after the heal, far more run than the few before it.
const PARTITION_REQUESTS: u32 = 60;
/// Each request's deadline in the partition test, seconds.
const PARTITION_REQUEST_TIMEOUT_S: u64 = 3;
/// Requests that must have completed before the partition (the run is demonstrably under way).
const COMPLETED_BEFORE_PARTITION: usize = 3;
/// How long the veth drops everything: longer than a request's deadline, so in-flight requests fail.
const PARTITION_FOR: Duration = Duration::from_secs(4);
/// Decode's abort_ack_timeout (engine default; docs/engine.md).
const ABORT_ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// Slack on top of the deadline and the abort-ack wait before the first failure must be reported
/// (debug build, two cores, TCP retransmission backoff after the heal).
const FAILURE_SLACK: Duration = Duration::from_secs(10);
/// Bound on decode's exit once the partition is healed.
const HEALED_EXIT_BOUND: Duration = Duration::from_secs(120);
/// Requests that must complete after the last failure: the run recovered, not merely ended.
const MIN_COMPLETED_AFTER_HEAL: u64 = 20;

/// The partition workload: `SMALL`'s shape, many requests, short deadlines, every byte verified.
fn partition_workload() -> Vec<String> {
    let mut w = strings(SMALL);
    let at = w.iter().position(|a| a == "--requests").unwrap();
    w[at + 1] = PARTITION_REQUESTS.to_string();
    w.extend([
        "--request-timeout".into(),
        PARTITION_REQUEST_TIMEOUT_S.to_string(),
    ]);
    w
}

fn completed(stderr: &str) -> usize {
    stderr
        .lines()
        .filter(|l| l.contains("request complete"))
        .count()
}

/// [`two_hosts`] for test `name`, with iptables (binary, kernel support) probed in both namespaces
/// before anything runs; the test fails where either cannot be had.
fn hosts_with_iptables(name: &str, guard: &mut Netns) -> (String, String) {
    let (dns, pns) = two_hosts(guard).unwrap_or_else(|reason| cannot_run(name, &reason));
    for ns in [&dns, &pns] {
        if let Err(reason) = run_cmd("ip", &["netns", "exec", ns, "iptables", "-L", "-n"]) {
            cannot_run(name, &format!("iptables unusable in a namespace: {reason}"));
        }
    }
    (dns, pns)
}

/// `iptables` rules in namespace `ns` dropping everything in and out of `dev` (`-A` adds, `-D` deletes).
fn partition_rules(ns: &str, dev: &str, op: &str) -> Result<(), String> {
    for (chain, dir) in [("INPUT", "-i"), ("OUTPUT", "-o")] {
        run_cmd(
            "ip",
            &[
                "netns", "exec", ns, "iptables", op, chain, dir, dev, "-j", "DROP",
            ],
        )?;
    }
    Ok(())
}

/// A network partition between decode and its four prefill ranks (separate namespaces, UCX over TCP,
/// as above): once requests complete, decode's veth drops every packet for `PARTITION_FOR`, then heals.
///
/// What the engine does (observed, and asserted): the TCP connections (control plane and UCX's) do
/// not break in a few seconds of silence, so no rank is lost. The requests in flight miss their
/// deadline and fail with `Timeout`; decode's Abort and the ranks' AbortAck go through once the link
/// is back (TCP retransmits), or the abort-ack timeout delivers the outcome anyway; either way the
/// first failure is reported within deadline + abort_ack_timeout + slack of the partition. Decode
/// keeps issuing requests, and every request after the heal completes and verifies; decode then
/// exits non-zero (some requests failed) within its bound, and the prefills exit cleanly.
///
/// Fails where namespaces or iptables cannot be used, unless [`SKIP_NETNS`] asks to skip it.
#[test]
fn partition_fails_affected_requests_within_bound_then_heals() {
    const NAME: &str = "partition_fails_affected_requests_within_bound_then_heals";
    if netns_skip_requested(NAME) {
        return;
    }
    let mut guard = Netns { names: Vec::new() };
    let (dns, pns) = hosts_with_iptables(NAME, &mut guard);
    // Declared after the guard, so dropped (children killed and reaped) before the namespaces go
    // (and the rules with them).
    let mut kids = Children::new("partition");
    let workload = partition_workload();
    let decode = "10.77.0.1:47100";
    let peers = "127.0.0.1:47101,127.0.0.1:47102,127.0.0.1:47103,127.0.0.1:47104";
    let json = kids.dir.join("report.json");
    let wl: Vec<&str> = workload.iter().map(String::as_str).collect();
    let mut args = decode_args(decode, &wl);
    args.extend(["--json".into(), json.display().to_string()]);
    let started = Instant::now();
    let denv = [
        ("UCX_TLS", "tcp"),
        ("UCX_NET_DEVICES", "kvxd"),
        // Per-request progress lines ("request complete") to partition on.
        ("KVBENCH_LOG", "info,kvbench::roles=debug"),
    ];
    kids.spawn("decode", &["ip", "netns", "exec", &dns], &args, &denv);
    let penv = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "kvxp")];
    for rank in 0..4 {
        let args = prefill_args(decode, rank, peers, &wl);
        let name = format!("prefill-{rank}");
        kids.spawn(&name, &["ip", "netns", "exec", &pns], &args, &penv);
    }

    // Up, and a few requests through (not a result's wait: the partition's trigger).
    let up = Duration::from_secs(60);
    assert!(
        kids.wait_stderr(0, started + up, |e| completed(e)
            >= COMPLETED_BEFORE_PARTITION),
        "decode did not complete {COMPLETED_BEFORE_PARTITION} requests within {up:?} of spawn\n{}",
        kids.logs()
    );
    let before = kids.stderr(0);
    assert!(
        !before.contains("request failed"),
        "a request failed before the partition\n{}",
        kids.logs()
    );
    assert!(
        kids.procs[0].1.try_wait().unwrap().is_none(),
        "decode finished before the partition: raise PARTITION_REQUESTS\n{}",
        kids.logs()
    );

    let cut_at = Instant::now();
    partition_rules(&dns, "kvxd", "-A")
        .unwrap_or_else(|e| panic!("partition: {e}\n{}", kids.logs()));
    let done_before = completed(&kids.stderr(0));
    std::thread::sleep(PARTITION_FOR); // the fault itself
    partition_rules(&dns, "kvxd", "-D").unwrap_or_else(|e| panic!("heal: {e}\n{}", kids.logs()));
    let healed_at = Instant::now();

    // Watch for the first failure while waiting for decode's exit.
    let deadline = healed_at + HEALED_EXIT_BOUND;
    let mut first_failure: Option<Duration> = None;
    let status = loop {
        if first_failure.is_none() && kids.stderr(0).contains("request failed:") {
            first_failure = Some(cut_at.elapsed());
        }
        if let Some(s) = kids.procs[0].1.try_wait().unwrap() {
            break s;
        }
        if Instant::now() >= deadline {
            panic!(
                "decode did not exit within {HEALED_EXIT_BOUND:?} of the heal\n{}",
                kids.logs()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let exited_after = cut_at.elapsed();
    let err = kids.stderr(0);
    let first_failure = first_failure.unwrap_or(exited_after);
    assert!(
        status.code().is_some() && !status.success(),
        "decode exited with {status}, expected a non-zero exit (requests failed)\nstdout:\n{}\n{}",
        kids.stdout(0),
        kids.logs()
    );
    let failures: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("request failed:"))
        .collect();
    assert!(
        !failures.is_empty(),
        "no request failed across a {PARTITION_FOR:?} partition\n{}",
        kids.logs()
    );
    assert!(
        failures
            .iter()
            .all(|l| l.contains("request failed: Timeout")),
        "requests failed for other reasons than their deadline: {failures:#?}\n{}",
        kids.logs()
    );
    // (a) Bounded: the first failure came within deadline + abort-ack timeout + slack of the cut.
    let bound =
        Duration::from_secs(PARTITION_REQUEST_TIMEOUT_S) + ABORT_ACK_TIMEOUT + FAILURE_SLACK;
    assert!(
        first_failure <= bound,
        "the first failure was reported {first_failure:?} after the partition, over {bound:?}\n{}",
        kids.logs()
    );
    assert!(
        !err.contains("verification failed") && !err.contains("prefill rank lost"),
        "a completed request's bytes were wrong, or a rank was lost\n{}",
        kids.logs()
    );

    let report: serde_json::Value = serde_json::from_str(&read(&json))
        .unwrap_or_else(|e| panic!("no JSON report ({e})\n{}", kids.logs()));
    let r = &report[0];
    let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("no {k} in {r}"));
    assert_eq!(r["backend"], "ucx", "{r}");
    assert_eq!(n("requests"), u64::from(PARTITION_REQUESTS), "{r}");
    assert_eq!(n("failed"), failures.len() as u64, "{r}");
    // Not verified only because requests failed (no "verification failed" above).
    assert_eq!(r["verified"], false, "{r}");
    // (b) Healed: requests completed after the last failure, far more than could have run before.
    assert!(
        n("completed_after_last_failure") >= MIN_COMPLETED_AFTER_HEAL,
        "only {} requests completed after the last failure (want >= {MIN_COMPLETED_AFTER_HEAL}; \
         {done_before} had completed before the partition)\n{r}\n{}",
        n("completed_after_last_failure"),
        kids.logs()
    );

    let statuses = prefills_exit(&mut kids, None, "decode's exit");
    assert!(
        statuses.iter().all(ExitStatus::success),
        "a prefill failed: {statuses:?}\n{}",
        kids.logs()
    );
    eprintln!(
        "partition: {done_before} requests done before the cut; {} failed (Timeout), first reported \
         {first_failure:?} after the cut; {} completed after the last failure; decode exited ({status}) \
         {exited_after:?} after the cut, {:?} after spawn",
        failures.len(),
        n("completed_after_last_failure"),
        started.elapsed()
    );
}

/// The half-open workload: `RESTARTABLE`'s stream at PP 1, with heartbeats every 0.5 s.
const HALF_OPEN_HEARTBEAT_S: f64 = 0.5;

fn half_open_workload() -> Vec<String> {
    let mut w = strings(RESTARTABLE);
    let at = w.iter().position(|a| a == "--pp").unwrap();
    w[at + 1] = "1".into();
    w.extend(["--heartbeat".into(), HALF_OPEN_HEARTBEAT_S.to_string()]);
    w
}

/// A prefill rank's host vanishes without a word: its veth drops every packet from then on (a
/// half-open link: no FIN, no RST, both TCP connections stay established). Decode declares the rank
/// lost within three heartbeat intervals (and the slack of a loaded two-core host), frees its slot,
/// and a replacement start of the rank (on another "host": decode's namespace) is admitted and
/// serves: the run's last wave verifies, and every failure happened while the rank was away.
///
/// Fails where namespaces or iptables cannot be used, unless [`SKIP_NETNS`] asks to skip it.
#[test]
fn a_half_open_rank_is_lost_within_three_heartbeats_and_replaced() {
    const NAME: &str = "a_half_open_rank_is_lost_within_three_heartbeats_and_replaced";
    if netns_skip_requested(NAME) {
        return;
    }
    let mut guard = Netns { names: Vec::new() };
    let (dns, pns) = hosts_with_iptables(NAME, &mut guard);
    let mut kids = Children::new("half-open");
    let workload = half_open_workload();
    let decode = "10.77.0.1:47100";
    let json = kids.dir.join("decode.json");
    let mut dargs = strings(&["decode", "--listen", decode]);
    dargs.extend(workload.iter().cloned());
    dargs.extend(["--json".into(), json.display().to_string()]);
    let started = Instant::now();
    let denv = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "kvxd")];
    kids.spawn("decode", &["ip", "netns", "exec", &dns], &dargs, &denv);
    let mut pargs = strings(&[
        "prefill",
        "--connect",
        decode,
        "--pp-rank",
        "0",
        "--pp-size",
        "1",
    ]);
    pargs.extend(workload.iter().cloned());
    let penv = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "kvxp")];
    kids.spawn("prefill", &["ip", "netns", "exec", &pns], &pargs, &penv);
    assert!(
        kids.wait_stderr(0, started + UP_BOUND, |e| connected_ranks(e) == 1),
        "decode did not see the rank connect within {UP_BOUND:?}\n{}",
        kids.logs()
    );
    std::thread::sleep(RUN_BEFORE_KILL);
    partition_rules(&pns, "kvxp", "-A").unwrap_or_else(|e| cannot_run(NAME, &e));
    let cut = Instant::now();
    let lost_bound = Duration::from_secs_f64(HALF_OPEN_HEARTBEAT_S * 3.0) + Duration::from_secs(2);
    assert!(
        kids.wait_stderr(0, cut + lost_bound, |e| without_colors(e)
            .contains("prefill rank lost rank=0")),
        "decode did not declare the half-open rank lost within {lost_bound:?}\n{}",
        kids.logs()
    );
    let lost_after = cut.elapsed();
    // The replacement: a new start of rank 0 on decode's side of the partition.
    let renv = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "kvxd")];
    kids.spawn(
        "prefill-again",
        &["ip", "netns", "exec", &dns],
        &pargs,
        &renv,
    );
    assert!(
        kids.wait_stderr(0, Instant::now() + UP_BOUND, |e| without_colors(e)
            .contains("prefill rank rejoined rank=0")),
        "decode did not admit the replacement within {UP_BOUND:?}\n{}",
        kids.logs()
    );
    let replaced_after = cut.elapsed();
    let run: u64 = RESTART_RUN.parse().unwrap();
    let Some(status) = kids.wait(0, started + Duration::from_secs(run) + DECODE_EXIT_BOUND) else {
        panic!("decode did not finish its run\n{}", kids.logs());
    };
    let report: serde_json::Value = serde_json::from_str(&read(&json))
        .unwrap_or_else(|e| panic!("decode wrote no report ({e})\n{}", kids.logs()));
    let r = &report[0];
    let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("no {k} in {r}"));
    assert!(
        status.success(),
        "decode exited with {status}: failures outside the rank's absence?\n{r}\n{}",
        kids.logs()
    );
    assert_eq!(n("failed"), n("failed_during_absence"), "{r}");
    assert!(n("completed_after_last_failure") >= 4, "{r}");
    assert_eq!(r["verified"], serde_json::Value::Bool(true), "{r}");
    // The replacement exits cleanly when decode closes the run.
    let Some(status) = kids.wait(2, Instant::now() + PREFILL_EXIT_BOUND) else {
        panic!(
            "the replacement did not exit after the run\n{}",
            kids.logs()
        );
    };
    assert!(
        status.success(),
        "the replacement exited with {status}\n{}",
        kids.logs()
    );
    eprintln!(
        "half-open rank lost {lost_after:?} after its link went dark (heartbeat \
         {HALF_OPEN_HEARTBEAT_S} s), replaced {replaced_after:?} after; {} requests, {} failed \
         during the absence",
        n("requests"),
        n("failed")
    );
}
