//! kvbench's progress bar: drawn on a terminal, absent where stderr is not one (a pipe, CI logs)
//! and absent with `--json`. The terminal is a real pseudo-terminal from `script` (util-linux).

use std::process::Command;

const ARGS: &str = "--model gqa --layers 4 --pp 2 --prompt-tokens 256 --chunk-tokens 128 \
                    --requests 6 --backend ucx --no-baseline";
/// What the bar prints and nothing else does.
const BAR: &str = "6/6 requests,";

/// kvbench with `args` on a pseudo-terminal: everything the terminal received.
fn on_terminal(args: &str) -> String {
    let cmd = format!("{} {args}", env!("CARGO_BIN_EXE_kvbench"));
    let out = Command::new("script")
        .args(["-qefc", &cmd, "/dev/null"])
        .output()
        .expect("`script` (util-linux) runs; scripts/provision installs it");
    assert!(
        out.status.success(),
        "kvbench on a terminal failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_bar_is_drawn_on_a_terminal_only() {
    let seen = on_terminal(ARGS);
    assert!(seen.contains(BAR), "no progress bar on a terminal: {seen}");
    assert!(seen.contains("verified"), "no table: {seen}");

    let out = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(ARGS.split_whitespace())
        .output()
        .expect("kvbench runs");
    assert!(out.status.success());
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(stdout.contains("verified"), "{stdout}");
    assert!(
        !stdout.contains("/6 requests") && !stderr.contains("/6 requests"),
        "a bar where stderr is a pipe: {stderr}"
    );
}

#[test]
fn tp_runs_and_sweeps_draw_bars_on_a_terminal() {
    let seen = on_terminal(&format!("{ARGS} --prefill-tp 2 --decode-tp 1"));
    assert!(seen.contains(BAR), "no progress bar for a TP run: {seen}");
    assert!(
        seen.contains("ucx 2>1"),
        "no bar named for the TP run: {seen}"
    );
    let dir = std::env::temp_dir().join(format!("kvbench-progress-sweep-{}", std::process::id()));
    let seen = on_terminal(&format!(
        "{ARGS} sweep --pages 16,32 --concurrencies 1 --out {}",
        dir.display()
    ));
    assert!(
        seen.contains("2/2 points"),
        "no progress bar for a sweep: {seen}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_engine_in_its_own_process_draws_decodes_bar() {
    let seen = on_terminal(&format!("{ARGS} --processes"));
    assert!(
        seen.contains(BAR),
        "no progress bar for a --processes run: {seen}"
    );
    assert!(seen.contains("verified"), "no table: {seen}");
}

#[test]
fn json_output_keeps_the_terminal_free_of_the_bar() {
    let dir = std::env::temp_dir().join(format!("kvbench-progress-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json = dir.join("rows.json");
    let seen = on_terminal(&format!("{ARGS} --json {}", json.display()));
    assert!(!seen.contains("/6 requests"), "a bar with --json: {seen}");
    let rows = std::fs::read_to_string(&json).expect("--json wrote its file");
    assert!(rows.contains("\"backend\""), "{rows}");
    let _ = std::fs::remove_dir_all(&dir);
}
