//! `kvbench register`: a decode engine's registration of a pool, timed for each backend and each
//! kind of pool, with the JSON rows the table prints.

#![allow(clippy::unwrap_used)]

use std::process::Command;

#[test]
fn register_times_both_kinds_of_pool_on_both_backends() {
    let json = std::env::temp_dir().join(format!("kvbench-register-{}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(["register", "--gib", "0.25", "--backend", "all", "--json"])
        .arg(&json)
        .env("UCX_MODULES", "^efa")
        .output()
        .expect("kvbench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON is written")).unwrap();
    let _ = std::fs::remove_file(&json);
    let rows = rows.as_array().expect("a list of rows");
    let seen: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| (r["backend"].as_str().unwrap(), r["pool"].as_str().unwrap()))
        .collect();
    assert_eq!(
        seen,
        [
            ("ucx", "caller"),
            ("ucx", "shared"),
            ("nixl", "caller"),
            ("nixl", "shared")
        ]
    );
    for r in rows {
        assert_eq!(r["bytes"].as_u64(), Some(256 << 20), "{r}");
        let (alloc, reg) = (
            r["caller_alloc_ms"].as_f64().unwrap(),
            r["register_ms"].as_f64().unwrap(),
        );
        assert!(reg > 0.0, "{r}");
        // A prefill engine connected to each decode engine.
        assert!(r["prefill_connect_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert!((r["register_ms_per_gib"].as_f64().unwrap() - reg * 4.0).abs() < 1e-6);
        // A caller's pool is faulted in by the caller; a shared one is allocated by the engine.
        match r["pool"].as_str() {
            Some("caller") => assert!(alloc > 0.0, "{r}"),
            _ => assert_eq!(alloc, 0.0, "{r}"),
        }
        let line = format!(
            "{:<8} {:<7}",
            r["backend"].as_str().unwrap(),
            r["pool"].as_str().unwrap()
        );
        assert!(stdout.contains(&line), "no row {line:?} in\n{stdout}");
    }
}

#[test]
fn a_pool_of_no_size_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(["register", "--gib", "0"])
        .output()
        .expect("kvbench runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("must be above 0"), "{stderr}");
}
