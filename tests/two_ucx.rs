//! One UCX library per process: a second, different libucp in the process is reported as
//! `TransportError::TwoUcxLibraries`, never a hang; and our direct UCX backend and NIXL's UCX plugin
//! really share one library.
//!
//! The negative case needs a process with two UCX libraries in it, which cannot be undone, so the test
//! re-executes its own binary, filtered to itself, with [`CHILD_ENV`] set; the child loads UCX 1.22's
//! own libucp (the `libucx` wheel that `scripts/provision` installs in `.deps/py`, a different file from
//! the NIXL-bundled one `ucx-sys` links) and checks the engine's answers. The parent bounds the child's
//! run and kills it if it hangs. Both backends are tried in the child.
#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transfer_engine::transport::nixl::{NixlConfig, NixlTransport};
use transfer_engine::transport::ucx::{
    UcxConfig, UcxTransport, check_single_ucx, loaded_ucp_libraries,
};
use transfer_engine::transport::{Incoming, Sink, TransportError};

/// Set in the child's environment: act as the process that holds two UCX libraries.
const CHILD_ENV: &str = "KVX_TWO_UCX_CHILD";
/// Printed by the child once it has seen the error, so the parent knows the child really ran.
const MARKER: &str = "KVX-TWO-UCX-DETECTED";
/// How long the child may take before it counts as hung.
const CHILD_BOUND: Duration = Duration::from_secs(30);

fn sink() -> Sink {
    Arc::new(|_: Incoming<'_>| {})
}

/// UCX 1.22's own libucp, which is not the library `ucx-sys` links.
fn other_libucp() -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(".deps/py/libucx/lib/libucp.so.0");
    if !path.is_file() {
        let overrides: Vec<_> = ["UCX_PREFIX", "NIXL_PREFIX"]
            .into_iter()
            .filter(|v| std::env::var_os(v).is_some())
            .collect();
        panic!(
            "{} is missing: this test needs the libucx wheel that ./scripts/provision installs into \
             .deps/py (it provisions even when {overrides:?} point at your own UCX or NIXL), as a \
             second UCX library to load",
            path.display()
        );
    }
    path
}

/// The child: load a second libucp, then every entry point must refuse with both paths.
fn child() {
    let before = loaded_ucp_libraries();
    assert_eq!(
        before.len(),
        1,
        "expected exactly the linked libucp before loading another: {before:?}"
    );
    let other = other_libucp();
    let (a, b) = (
        std::fs::metadata(&before[0]).unwrap(),
        std::fs::metadata(&other).unwrap(),
    );
    assert_ne!(
        (a.dev(), a.ino()),
        (b.dev(), b.ino()),
        "ucx-sys links {} itself, so there is no second library to test with",
        other.display()
    );
    let c = std::ffi::CString::new(other.to_str().unwrap()).unwrap();
    // SAFETY: c is a NUL-terminated path; the handle is never closed, so the library stays mapped for
    // the rest of this (short-lived) process.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a NUL-terminated string (or null) describing the last dl* failure.
        let err = unsafe { libc::dlerror() };
        let msg = if err.is_null() {
            "unknown".to_owned()
        } else {
            // SAFETY: non-null dlerror results are valid C strings until the next dl* call.
            unsafe { std::ffi::CStr::from_ptr(err) }
                .to_string_lossy()
                .into_owned()
        };
        panic!("dlopen({}) failed: {msg}", other.display());
    }

    let distinct = |paths: &[String]| {
        assert_eq!(paths.len(), 2, "{paths:?}");
        assert_ne!(paths[0], paths[1]);
    };
    match check_single_ucx() {
        Err(TransportError::TwoUcxLibraries(paths)) => distinct(&paths),
        other => panic!("check_single_ucx: expected TwoUcxLibraries, got {other:?}"),
    }
    let started = Instant::now();
    let err = match UcxTransport::new(UcxConfig::default(), sink()) {
        Err(e) => e,
        Ok(t) => panic!("UcxTransport started with two UCX libraries loaded: {t:?}"),
    };
    let TransportError::TwoUcxLibraries(paths) = &err else {
        panic!("UcxTransport::new: expected TwoUcxLibraries, got {err:?}");
    };
    distinct(paths);
    // The error is meant for people: it names both files and says what to do.
    let text = err.to_string();
    assert!(
        text.contains(&paths[0]) && text.contains(&paths[1]) && text.contains("scripts/provision"),
        "{text}"
    );
    // The NIXL backend refuses too, before NIXL's UCX plugin starts (which would spin in ucp_init).
    match NixlTransport::new(NixlConfig::default(), sink()) {
        Err(TransportError::TwoUcxLibraries(p)) => distinct(&p),
        Err(e) => panic!("NixlTransport::new: expected TwoUcxLibraries, got {e:?}"),
        Ok(_) => panic!("NixlTransport started with two UCX libraries loaded"),
    }
    println!("{MARKER} in {:?}: {paths:?}\n{text}", started.elapsed());
    // Leave without running the libraries' destructors. The second libucp's references to libucs
    // bind, through the global scope, to the libucs `ucx-sys` brought in (same names, other version),
    // and its `ucp_global_cleanup` then crashes at exit (SIGSEGV in `ucs_list_del`). That is UCX's own
    // teardown of a process already mixed up, and the reason the engine refuses to start in one; what
    // this test checks is that the refusal comes, promptly and clearly.
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit ends the process at once; nothing after it runs and no Rust state is observed.
    unsafe { libc::_exit(0) };
}

/// Two different UCX libraries in one process: a clear error, not a hang.
#[test]
fn a_second_ucx_library_is_an_error_not_a_hang() {
    if std::env::var_os(CHILD_ENV).is_some() {
        child();
        return;
    }
    // Fail here, in the parent, with the clear message, rather than in the child.
    other_libucp();
    let exe = std::env::current_exe().unwrap();
    let mut proc = Command::new(&exe)
        .args([
            "--exact",
            "a_second_ucx_library_is_an_error_not_a_hang",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Drain both pipes on threads, so a chatty child never blocks on a full pipe.
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = drain(proc.stdout.take().map(|r| Box::new(r) as _));
    let err = drain(proc.stderr.take().map(|r| Box::new(r) as _));
    let end = Instant::now() + CHILD_BOUND;
    let status = loop {
        if let Some(st) = proc.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() >= end {
            let _ = proc.kill();
            let _ = proc.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    let shown = format!("child stdout:\n{out}\nchild stderr:\n{err}");
    let Some(status) = status else {
        panic!(
            "hang: the child with two UCX libraries did not finish within {CHILD_BOUND:?}\n{shown}"
        );
    };
    assert!(status.success(), "child failed with {status}\n{shown}");
    assert!(
        out.contains(MARKER),
        "the child did not run the check\n{shown}"
    );
    println!("{shown}");
}

/// Our UCX backend and NIXL's UCX plugin, started in one process, map one libucp between them.
#[test]
fn ucx_and_nixl_share_one_ucx_library() {
    let ucx = UcxTransport::new(UcxConfig::default(), sink()).unwrap();
    let nixl = NixlTransport::new(NixlConfig::default(), sink()).unwrap();
    let libs = loaded_ucp_libraries();
    assert_eq!(
        libs.len(),
        1,
        "ucx-sys and NIXL's UCX plugin loaded different UCX libraries: {libs:?}"
    );
    check_single_ucx().unwrap();
    println!("one libucp: {}", libs[0]);
    nixl.shutdown();
    ucx.shutdown();
}
