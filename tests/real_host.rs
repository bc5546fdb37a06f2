//! On a host that looks like an RDMA host (rdma-core's verbs library and providers installed, as
//! `scripts/provision` installs them), `kvbench` on both backends exits 0. There UCX loads its EFA
//! module, which crashed every process at exit (SIGSEGV in its bundled libnl) until the engine kept it
//! out; the control run, with UCX's own default module list, shows the crash this guards against.
#![allow(clippy::unwrap_used)]

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output};

/// A small workload on both backends, no baselines (they spawn UCX's own tools).
fn kvbench(modules: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvbench"));
    c.args(["--model", "gqa", "--layers", "4", "--pp", "2"])
        .args(["--prompt-tokens", "256", "--chunk-tokens", "128"])
        .args(["--requests", "2", "--backend", "all", "--no-baseline"]);
    match modules {
        Some(m) => c.env("UCX_MODULES", m),
        None => c.env_remove("UCX_MODULES"),
    };
    c.output().unwrap()
}

fn verbs_installed() -> bool {
    [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ]
    .iter()
    .any(|d| std::path::Path::new(d).join("libibverbs.so.1").exists())
}

#[test]
fn kvbench_exits_cleanly_where_rdma_core_is_installed() {
    assert!(
        verbs_installed(),
        "libibverbs.so.1 is not installed: run scripts/provision (this test must run on an RDMA-like host)"
    );
    let out = kvbench(None);
    assert!(
        out.status.success(),
        "kvbench ended with {:?} (signal {:?})\n{}",
        out.status.code(),
        out.status.signal(),
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.lines().any(|l| l.starts_with("ucx "))
            && stdout.lines().any(|l| l.starts_with("nixl ")),
        "{stdout}"
    );
    // The control: with every module allowed, the same run dies at exit.
    let control = kvbench(Some("all"));
    assert_eq!(
        control.status.signal(),
        Some(libc::SIGSEGV),
        "with the EFA module loaded kvbench ended with {:?}; if UCX no longer crashes there, the \
         module exclusion in transport::ucx::prepare_process may be dropped",
        control.status
    );
}
