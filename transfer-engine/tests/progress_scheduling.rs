//! A backend's progress thread runs under the scheduling its config asks for: `SCHED_FIFO` at the
//! priority given, read back from `/proc` for that thread; the default policy otherwise; and a
//! priority outside 1..=99 is refused with a typed error before anything starts. Both backends, over
//! real UCX and NIXL. (Refusal without the privilege is `tests/kvbench_scheduling.rs`.)
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};
use transfer_engine::transport::nixl::{NixlConfig, NixlTransport};
use transfer_engine::transport::ucx::{UcxConfig, UcxTransport};
use transfer_engine::transport::{ProgressScheduling, Sink, Transport, TransportError};

/// `SCHED_FIFO` in `sched_setscheduler(2)`'s numbering, as `/proc/<pid>/stat` reports it.
const SCHED_FIFO: u64 = 1;

fn noop_sink() -> Sink {
    Arc::new(|_| {})
}

/// (policy, realtime priority) of every thread of this process whose name is `name` (names are cut
/// at 15 bytes by the kernel).
fn threads_named(name: &str) -> Vec<(u64, u64)> {
    let name = &name[..name.len().min(15)];
    let mut found = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let Ok(stat) = std::fs::read_to_string(task.unwrap().path().join("stat")) else {
            continue; // the thread ended while we looked
        };
        // `tid (comm) state ...`: comm may hold spaces, so fields are counted after its last ')'.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if &stat[open + 1..close] != name {
            continue;
        }
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // Fields 40 (rt_priority) and 41 (policy) of proc(5); the first after comm is field 3.
        found.push((fields[38].parse().unwrap(), fields[37].parse().unwrap()));
    }
    found
}

fn ucx(name: &str, scheduling: ProgressScheduling) -> Result<Arc<dyn Transport>, TransportError> {
    let cfg = UcxConfig {
        name: name.into(),
        scheduling,
        ..UcxConfig::default()
    };
    Ok(Arc::new(UcxTransport::new(cfg, noop_sink())?))
}

fn nixl(name: &str, scheduling: ProgressScheduling) -> Result<Arc<dyn Transport>, TransportError> {
    let cfg = NixlConfig {
        name: name.into(),
        scheduling,
        ..NixlConfig::default()
    };
    Ok(Arc::new(NixlTransport::new(cfg, noop_sink())?))
}

#[test]
fn a_realtime_ucx_progress_thread_runs_fifo_at_its_priority() {
    let t = ucx("sfifo7", ProgressScheduling::Fifo(7)).unwrap();
    assert_eq!(threads_named("ucx-sfifo7"), [(SCHED_FIFO, 7)]);
    let normal = ucx("snormal", ProgressScheduling::Normal).unwrap();
    assert_eq!(threads_named("ucx-snormal"), [(0, 0)]);
    drop((t, normal));
}

#[test]
fn a_realtime_nixl_progress_thread_runs_fifo_at_its_priority() {
    let t = nixl("nfifo5", ProgressScheduling::Fifo(5)).unwrap();
    assert_eq!(threads_named("nixl-nfifo5"), [(SCHED_FIFO, 5)]);
    let normal = nixl("nnormal", ProgressScheduling::Normal).unwrap();
    assert_eq!(threads_named("nixl-nnormal"), [(0, 0)]);
    drop((t, normal));
}

#[test]
fn priorities_outside_the_realtime_range_are_refused_before_anything_starts() {
    for p in [0, 100, 255] {
        let asked = ProgressScheduling::Fifo(p);
        for (backend, r) in [("ucx", ucx("sbad", asked)), ("nixl", nixl("nbad", asked))] {
            match r {
                Err(TransportError::Scheduling { asked: a, .. }) => assert_eq!(a, asked),
                Err(e) => panic!("{backend} at priority {p}: another error: {e}"),
                Ok(_) => panic!("{backend} started at priority {p}"),
            }
        }
    }
    // The refused threads ended: nothing of theirs is left running. A joined thread can still be
    // listed for a moment while the kernel finishes its exit, so each gets a bound to leave the list.
    assert!(gone_within("ucx-sbad", Duration::from_secs(10)));
    assert!(gone_within("nixl-nbad", Duration::from_secs(10)));
}

/// Whether no thread named `name` is listed any more within `bound`.
fn gone_within(name: &str, bound: Duration) -> bool {
    let until = Instant::now() + bound;
    while !threads_named(name).is_empty() {
        if Instant::now() > until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}
