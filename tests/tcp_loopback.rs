//! The whole engine over UCX's TCP transport (`UCX_TLS=tcp,self`) with native put, in one process,
//! two requests in flight, 100 requests verified: the configuration that crashed UCX's receiving
//! worker until endpoints resolved their remote id at creation. Runs `kvbench` as a child process,
//! since UCX reads `UCX_TLS` once per process.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn engine_over_tcp_in_one_process_completes_and_verifies() {
    let json = std::env::temp_dir().join(format!("kvx-tcp-{}.json", std::process::id()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args([
            "--model",
            "gqa",
            "--layers",
            "8",
            "--bytes-per-token",
            "512",
            "--pp",
            "4",
        ])
        .args([
            "--prompt-tokens",
            "1000",
            "--chunk-tokens",
            "256",
            "--requests",
            "100",
        ])
        .args([
            "--concurrency",
            "2",
            "--verify",
            "all",
            "--checksums",
            "true",
        ])
        .args(["--backend", "ucx", "--no-baseline", "--json"])
        .arg(&json)
        .env("UCX_TLS", "tcp,self")
        .env("UCX_TCP_PUT_ENABLE", "y")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvbench over TCP did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        status.success(),
        "kvbench over TCP failed ({status}): {stderr}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    let r = &report[0];
    assert_eq!(r["backend"], "ucx");
    assert_eq!(r["requests"], 100);
    assert_eq!(r["failed"], 0);
    assert_eq!(r["verified"], true, "{report}");
}
