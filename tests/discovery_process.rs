//! `kvbench decode` and four `kvbench prefill` processes that find each other through a real etcd
//! server (started by each test) instead of addresses: discovery, a rank killed and started again
//! (it comes back on a new port), etcd restarted under running transfers, and a stopped rank whose
//! lease ends.
//!
//! Every wait is bounded; children and the etcd server are killed on drop. A missing `etcd` binary
//! fails these tests (`scripts/provision` installs it).
#![allow(clippy::unwrap_used)]

mod common;

use common::procs::{Children, read, strings, without_colors};
use kvbench::etcd_server::EtcdServer;
use std::time::{Duration, Instant};

/// One test at a time: each runs five processes and an etcd server, and the stopped-rank test times
/// an eviction against the lease, which twenty processes on two cores would blur.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// From spawn until decode has every rank connected (debug builds, five processes, two cores).
const UP_BOUND: Duration = Duration::from_secs(45);
/// How long a run goes on before the fault (the scenario, so requests are in flight).
const RUN_BEFORE_FAULT: Duration = Duration::from_millis(700);
/// Bound on a process's exit once its run is over.
const EXIT_BOUND: Duration = Duration::from_secs(30);

/// The workload: GQA-shaped pages, PP 4, two requests in flight, streaming for `secs` seconds (at
/// least 8 requests), then a last wave checked byte for byte; checksums on.
fn workload(secs: &str) -> Vec<String> {
    strings(&[
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
        "8",
        "--duration",
        secs,
        "--concurrency",
        "2",
        "--verify",
        "last",
        "--checksums",
        "true",
        "--backend",
        "ucx",
        "--no-baseline",
    ])
}

fn etcd_args(server: &EtcdServer, cluster: &str, ttl: &str) -> Vec<String> {
    strings(&[
        "--etcd",
        &server.url(),
        "--cluster",
        cluster,
        "--lease-ttl",
        ttl,
    ])
}

fn prefill(kids: &mut Children, name: &str, rank: u16, w: &[String], etcd: &[String]) {
    let mut args = strings(&["prefill", "--pp-rank", &rank.to_string()]);
    args.extend(w.iter().cloned());
    args.extend(etcd.iter().cloned());
    kids.spawn(name, &[], &args, &[]);
}

/// Starts decode (child 0, its report in `decode.json`) and ranks 0..4 (children 1..=4) with no
/// address but etcd's; returns once decode has all four connected and the run went on a moment.
fn start(kids: &mut Children, w: &[String], etcd: &[String]) -> std::path::PathBuf {
    let json = kids.dir.join("decode.json");
    let mut args = strings(&["decode"]);
    args.extend(w.iter().cloned());
    args.extend(etcd.iter().cloned());
    args.extend(["--json".into(), json.display().to_string()]);
    let started = Instant::now();
    kids.spawn("decode", &[], &args, &[]);
    for rank in 0..4 {
        prefill(kids, &format!("prefill-{rank}"), rank, w, etcd);
    }
    assert!(
        kids.wait_stderr(0, started + UP_BOUND, |e| e
            .matches("prefill rank connected")
            .count()
            == 4),
        "decode did not see four ranks connected within {UP_BOUND:?}\n{}",
        kids.logs()
    );
    json
}

/// Waits for decode's exit and returns its report's first row.
fn finish(kids: &mut Children, json: &std::path::Path, run_ends: Instant) -> serde_json::Value {
    let Some(status) = kids.wait(0, run_ends + EXIT_BOUND) else {
        panic!("decode did not finish its run\n{}", kids.logs());
    };
    let report: serde_json::Value = serde_json::from_str(&read(json))
        .unwrap_or_else(|e| panic!("decode wrote no report ({e})\n{}", kids.logs()));
    let row = report[0].clone();
    assert!(
        status.success(),
        "decode exited with {status}\n{row}\n{}",
        kids.logs()
    );
    assert_eq!(row["verified"], serde_json::Value::Bool(true), "{row}");
    row
}

/// Every prefill child but `skip` exits 0 once decode is done.
fn prefills_exit_cleanly(kids: &mut Children, skip: &[usize]) {
    let from = Instant::now();
    for i in 1..kids.procs.len() {
        if skip.contains(&i) {
            continue;
        }
        let Some(status) = kids.wait(i, from + EXIT_BOUND) else {
            panic!("{} did not exit\n{}", kids.procs[i].0, kids.logs());
        };
        assert!(
            status.success(),
            "{} exited with {status}\n{}",
            kids.procs[i].0,
            kids.logs()
        );
    }
}

fn n(r: &serde_json::Value, k: &str) -> u64 {
    r[k].as_u64().unwrap_or_else(|| panic!("no {k} in {r}"))
}

#[test]
fn one_decode_and_four_prefill_ranks_find_each_other_through_etcd() {
    let _one = one_at_a_time();
    let server = EtcdServer::start().unwrap();
    let mut kids = Children::new("etcd-discovery");
    let w = workload("2");
    let etcd = etcd_args(&server, "find", "5");
    let json = start(&mut kids, &w, &etcd);
    let row = finish(&mut kids, &json, Instant::now() + Duration::from_secs(2));
    assert_eq!(n(&row, "failed"), 0, "{row}");
    assert!(n(&row, "verified_requests") >= 2, "{row}");
    prefills_exit_cleanly(&mut kids, &[]);
    // The engines revoked their records as they ended.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (left, refused) = rt.block_on(async {
        let mut c = transfer_engine::discovery::EtcdConfig::new(server.url(), "find");
        c.lease_ttl = Duration::from_secs(5);
        // The roles' secret: their records are sealed with it.
        c.secret = transfer_engine::control::Secret::new(kids.token.as_bytes());
        let dir = transfer_engine::discovery::Directory::open(&c)
            .await
            .unwrap();
        (dir.records(), dir.refused_records())
    });
    assert!(left.is_empty(), "records left behind: {left:?}");
    assert_eq!(refused, 0, "records that did not check");
}

#[test]
fn a_killed_rank_restarts_on_a_new_port_and_serves_again() {
    let _one = one_at_a_time();
    let server = EtcdServer::start().unwrap();
    let mut kids = Children::new("etcd-restart");
    let w = workload("10");
    let etcd = etcd_args(&server, "restart", "5");
    let started = Instant::now();
    let json = start(&mut kids, &w, &etcd);
    std::thread::sleep(RUN_BEFORE_FAULT);
    kids.sigkill(3); // prefill rank 2
    assert!(
        kids.wait(3, Instant::now() + Duration::from_secs(5))
            .is_some()
    );
    std::thread::sleep(Duration::from_secs(1));
    prefill(&mut kids, "prefill-2-again", 2, &w, &etcd); // child 5
    assert!(
        kids.wait_stderr(0, Instant::now() + UP_BOUND, |e| without_colors(e)
            .contains("prefill rank rejoined rank=2")),
        "decode did not admit rank 2 again\n{}",
        kids.logs()
    );
    let row = finish(&mut kids, &json, started + Duration::from_secs(10));
    // Whatever failed, failed while rank 2 was away; requests waited for it and completed.
    assert_eq!(n(&row, "failed"), n(&row, "failed_during_absence"), "{row}");
    assert!(n(&row, "completed_across_absence") >= 1, "{row}");
    assert!(n(&row, "completed_after_last_failure") >= 4, "{row}");
    prefills_exit_cleanly(&mut kids, &[3]);
}

#[test]
fn transfers_go_on_while_etcd_restarts() {
    let _one = one_at_a_time();
    let mut server = EtcdServer::start().unwrap();
    let mut kids = Children::new("etcd-down");
    let w = workload("10");
    let etcd = etcd_args(&server, "down", "3");
    let started = Instant::now();
    let json = start(&mut kids, &w, &etcd);
    std::thread::sleep(RUN_BEFORE_FAULT);
    server.stop();
    // Down for longer than a lease: etcd keeps leases across its restart and renews them from it.
    std::thread::sleep(Duration::from_secs(4));
    server.resume().unwrap();
    let row = finish(&mut kids, &json, started + Duration::from_secs(10));
    // Nothing failed and nobody was evicted: engine-to-engine connections never went through etcd.
    assert_eq!(n(&row, "failed"), 0, "{row}");
    assert!(
        !kids.stderr(0).contains("evicted"),
        "decode evicted a rank\n{}",
        kids.logs()
    );
    prefills_exit_cleanly(&mut kids, &[]);
}

#[test]
fn a_stopped_rank_is_evicted_within_its_lease_and_readmitted_when_it_resumes() {
    let _one = one_at_a_time();
    const TTL: u64 = 2;
    let server = EtcdServer::start().unwrap();
    let mut kids = Children::new("etcd-stop");
    let w = workload("12");
    let etcd = etcd_args(&server, "stop", &TTL.to_string());
    let started = Instant::now();
    let json = start(&mut kids, &w, &etcd);
    std::thread::sleep(RUN_BEFORE_FAULT);
    let pid = libc::pid_t::try_from(kids.procs[3].1.id()).unwrap();
    // SAFETY: kill(2) of our own, not yet reaped, child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let stopped_at = Instant::now();
    assert!(
        kids.wait_stderr(0, stopped_at + UP_BOUND, |e| e.contains("evicted")),
        "decode did not evict the stopped rank\n{}",
        kids.logs()
    );
    let evicted_after = stopped_at.elapsed();
    // The lease's TTL, etcd's expiry check (about half a second) and our polling of the log.
    assert!(
        evicted_after <= Duration::from_secs(TTL + 2),
        "evicted {evicted_after:?} after the stop"
    );
    // Decode keeps two requests in flight, and a stopped rank finishes none: the requests it held
    // fail at its eviction, not at their deadline (60 s).
    assert!(
        kids.wait_stderr(0, stopped_at + Duration::from_secs(TTL + 3), |e| e
            .contains("request failed: PeerLost { rank: 2,")),
        "no request failed with PeerLost naming rank 2 within the lease bound\n{}",
        kids.logs()
    );
    let failed_after = stopped_at.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert!(
        kids.wait_stderr(0, Instant::now() + UP_BOUND, |e| e.contains("readmitted")),
        "decode did not readmit rank 2 after it resumed\n{}",
        kids.logs()
    );
    let row = finish(&mut kids, &json, started + Duration::from_secs(12));
    assert_eq!(n(&row, "failed"), n(&row, "failed_during_absence"), "{row}");
    assert!(n(&row, "completed_after_last_failure") >= 4, "{row}");
    prefills_exit_cleanly(&mut kids, &[]);
    eprintln!(
        "evicted {evicted_after:?} after SIGSTOP (lease {TTL} s), its requests failed \
         {failed_after:?} after it; {} failed in all, {} waited and completed",
        n(&row, "failed"),
        n(&row, "completed_across_absence")
    );
}
