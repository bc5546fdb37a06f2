//! `kvbench latency`: single 4 KiB writes timed from post to decode's Complete on both backends,
//! beside `ucx_perftest -t ucp_put_lat` measured in the same run; without the tool there is no
//! baseline and the run fails rather than print a ratio to nothing.

use std::process::Command;

fn latency(json: &std::path::Path, env: &[(&str, &str)]) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvbench"));
    c.args(["latency", "--writes", "300", "--json"]).arg(json);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("kvbench runs")
}

#[test]
fn single_writes_are_timed_beside_ucx_perftests_put_latency() {
    let json = std::env::temp_dir().join(format!("kvbench-latency-{}.json", std::process::id()));
    let out = latency(&json, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "latency failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON is written"))
            .expect("JSON");
    let _ = std::fs::remove_file(&json);
    assert_eq!(doc["write_bytes"], 4096, "{doc}");
    let put = doc["put_lat_p50_us"].as_f64().unwrap_or(0.0);
    assert!(put > 0.0, "no ucp_put_lat baseline: {doc}");
    let rows = doc["rows"].as_array().expect("rows");
    let backends: Vec<&str> = rows.iter().filter_map(|r| r["backend"].as_str()).collect();
    assert_eq!(backends, ["ucx", "nixl"], "{doc}");
    for r in rows {
        assert_eq!(r["requests"], 300, "{r}");
        assert_eq!(r["failed"], 0, "{r}");
        assert_eq!(r["verified"], true, "{r}");
        let p50 = r["post_p50_us"].as_f64().unwrap_or(0.0);
        let p99 = r["post_p99_us"].as_f64().unwrap_or(0.0);
        assert!(p50 > 0.0 && p99 >= p50, "{r}");
        let ratio = r["ratio_to_put_lat_p50"].as_f64().unwrap_or(0.0);
        assert!((ratio - p50 / put).abs() <= 1e-6 * ratio.max(1.0), "{r}");
        // The post comes after decode's expect, so its time to Complete is within expect's.
        let expect = r["latency_p50_us"].as_f64().unwrap_or(0.0);
        assert!(p50 <= expect, "{r}");
    }
    assert!(stdout.contains("ucp_put_lat"), "{stdout}");
}

#[test]
fn without_the_baseline_tool_the_run_fails() {
    let json = std::env::temp_dir().join(format!("kvbench-latency-no-{}.json", std::process::id()));
    let out = latency(
        &json,
        &[("KVBENCH_UCX_PERFTEST", "/nonexistent/ucx_perftest")],
    );
    assert!(!out.status.success(), "a run without its baseline passed");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ucp_put_lat could not be run"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!json.exists(), "a JSON without a baseline was written");
}
