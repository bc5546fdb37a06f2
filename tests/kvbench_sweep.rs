//! `kvbench sweep`: every point of a small grid runs on both backends with its requests verified,
//! and the sweep writes `sweep.json` (one row per point) and `sweep.svg` (both panels, a line per
//! backend). A grid with a zero page size is refused.

use std::process::Command;

#[test]
fn a_sweep_writes_every_point_and_its_plot() {
    let dir = std::env::temp_dir().join(format!("kvbench-sweep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(
            "--model gqa --layers 4 --pp 2 --prompt-tokens 512 --chunk-tokens 256 --requests 4 \
             sweep --pages 16,64 --concurrencies 1,2 --out"
                .split_whitespace(),
        )
        .arg(&dir)
        .output()
        .expect("kvbench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "sweep failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = std::fs::read_to_string(dir.join("sweep.json")).expect("sweep.json written");
    let rows: serde_json::Value = serde_json::from_str(&json).expect("sweep.json is JSON");
    let rows = rows.as_array().expect("an array of points");
    // 2 page sizes x 2 concurrencies x 2 backends.
    assert_eq!(rows.len(), 8, "{json}");
    let mut seen = Vec::new();
    for r in rows {
        assert_eq!(r["verified"], true, "{r}");
        assert_eq!(r["failed"], 0, "{r}");
        assert!(r["gbps"].as_f64().is_some_and(|g| g > 0.0), "{r}");
        assert!(r["latency_p99_us"].as_f64().is_some_and(|l| l > 0.0), "{r}");
        seen.push((
            r["backend"].as_str().unwrap_or_default().to_string(),
            r["page_tokens"].as_u64().unwrap_or(0),
            r["concurrency"].as_u64().unwrap_or(0),
        ));
    }
    seen.sort();
    let mut want = Vec::new();
    for b in ["nixl", "ucx"] {
        for c in [1, 2] {
            for p in [16, 64] {
                want.push((b.to_string(), p, c));
            }
        }
    }
    want.sort();
    assert_eq!(seen, want);
    let svg = std::fs::read_to_string(dir.join("sweep.svg")).expect("sweep.svg written");
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
    for text in [
        "Transfer bandwidth",
        "Request latency p99",
        "tokens per page",
        "ucx c=1 prompt=512",
        "nixl c=2 prompt=512",
    ] {
        assert!(svg.contains(text), "no {text:?} in the plot");
    }
    assert!(stdout.contains("sweep.svg"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_zero_page_size_is_refused() {
    let dir = std::env::temp_dir().join(format!("kvbench-sweep0-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args("--requests 1 sweep --pages 0,16 --out".split_whitespace())
        .arg(&dir)
        .output()
        .expect("kvbench runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(!dir.join("sweep.json").exists());
}
