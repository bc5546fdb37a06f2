//! `kvbench --progress-fifo`: decode's progress thread under `SCHED_FIFO`, in one process and with
//! every engine in its own. With the privilege the runs verify every request; without it (this
//! test's own `CAP_SYS_NICE` dropped by `setpriv`, util-linux) they fail at the start naming why,
//! which also shows the flag reaches decode's engine. That the thread really runs FIFO at the
//! priority asked is `transfer-engine/tests/progress_scheduling.rs`.

use std::process::Command;

fn kvbench(privileged: bool, args: &[&str], json: &std::path::Path) -> std::process::Output {
    let bin = env!("CARGO_BIN_EXE_kvbench");
    let mut c = if privileged {
        Command::new(bin)
    } else {
        let mut c = Command::new("setpriv");
        c.args(["--bounding-set=-sys_nice", bin]);
        c
    };
    c.args(args)
        .args([
            "--requests",
            "6",
            "--prompt-tokens",
            "2048",
            "--no-baseline",
        ])
        .args(["--progress-fifo", "2", "--json"])
        .arg(json);
    c.output().expect("kvbench (or setpriv) runs")
}

#[test]
fn decode_runs_realtime_where_permitted_and_fails_naming_why_where_not() {
    for (args, backends) in [
        (&["--backend", "ucx", "--processes"][..], &["ucx"][..]),
        (&[][..], &["ucx", "nixl"][..]),
    ] {
        let json = std::env::temp_dir().join(format!("kvbench-fifo-{}.json", std::process::id()));
        let out = kvbench(true, args, &json);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{args:?} failed: {text}");
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON is written"))
                .expect("JSON");
        let _ = std::fs::remove_file(&json);
        let rows = doc.as_array().expect("an array of rows");
        let seen: Vec<&str> = rows.iter().filter_map(|r| r["backend"].as_str()).collect();
        assert_eq!(seen, backends, "{doc}");
        for r in rows {
            assert_eq!(r["requests"], 6, "{r}");
            assert_eq!(r["failed"], 0, "{r}");
            assert_eq!(r["verified"], true, "{r}");
        }

        let out = kvbench(false, args, &json);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{args:?} ran without the privilege: {stderr}"
        );
        assert!(
            stderr.contains("cannot schedule the progress thread as Fifo(2): not permitted"),
            "{args:?}: {stderr}"
        );
        assert!(
            !json.exists(),
            "{args:?} wrote a report for a run that did not start"
        );
    }
}
