//! kvbench's `--metrics`, scraped from a live run: with `--metrics-linger` the engines stay up after
//! the last request, and the endpoint then serves the run's final counts, equal to what the run
//! reports in its JSON. In one process the endpoint carries decode and every prefill rank; with
//! `--processes`, the decode process's engine.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

const ARGS: &str = "--model gqa --layers 4 --pp 2 --prompt-tokens 256 --chunk-tokens 128 \
                    --requests 6 --backend ucx --no-baseline --metrics 127.0.0.1:0 \
                    --metrics-linger 5";
const REQUESTS: f64 = 6.0;

/// `GET /metrics` on `addr`: the body.
fn scrape(addr: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("the endpoint answers during the linger");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("a timeout");
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: kvx\r\nConnection: close\r\n\r\n"
    )
    .expect("the request is sent");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("the answer is read");
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// The sum of every sample of `name` whose line holds all of `labels`, and how many there were.
fn sum(text: &str, name: &str, labels: &[&str]) -> (f64, usize) {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .map(|l| {
            l.rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("not a sample: {l}"))
        })
        .collect();
    (values.iter().sum(), values.len())
}

/// Runs kvbench with `extra`, scrapes its endpoint once it says the run is over, and returns the
/// scrape and the run's JSON report.
fn run(extra: &str, tag: &str) -> (String, serde_json::Value) {
    let json =
        std::env::temp_dir().join(format!("kvbench-metrics-{tag}-{}.json", std::process::id()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(ARGS.split_whitespace())
        .args(extra.split_whitespace())
        .arg("--json")
        .arg(&json)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvbench starts");
    let stderr = child.stderr.take().expect("stderr is piped");
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = String::new();
    let addr = loop {
        let line = match lines.next() {
            Some(Ok(line)) => line,
            _ => {
                let _ = child.kill();
                panic!("kvbench ended without saying the run was over:\n{seen}");
            }
        };
        seen.push_str(&line);
        seen.push('\n');
        if let Some(rest) = line.split("metrics stay on http://").nth(1) {
            break rest.split('/').next().unwrap_or_default().to_string();
        }
    };
    let text = scrape(&addr);
    // The rest of stderr, so the process never blocks on a full pipe.
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().expect("kvbench ends");
    assert!(
        status.success(),
        "kvbench failed:\n{seen}{}",
        rest.join("\n")
    );
    let report: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&json).expect("kvbench wrote its JSON report"),
    )
    .expect("the report is JSON");
    let _ = std::fs::remove_file(&json);
    let row = report
        .as_array()
        .and_then(|rows| rows.first())
        .cloned()
        .unwrap_or(report);
    (text, row)
}

#[test]
fn an_in_process_run_serves_what_it_did_until_its_linger_ends() {
    let (text, row) = run("", "local");
    assert_eq!(row["requests"].as_f64(), Some(REQUESTS), "{row}");
    assert_eq!(row["verified"].as_bool(), Some(true), "{row}");
    let dec = ["role=\"decode\""];
    assert_eq!(
        sum(
            &text,
            "kvx_requests_total",
            &["role=\"decode\"", "outcome=\"complete\""]
        ),
        (REQUESTS, 1),
        "{text}"
    );
    assert_eq!(
        sum(
            &text,
            "kvx_requests_total",
            &["role=\"decode\"", "outcome=\"failed\""]
        )
        .0,
        0.0
    );
    assert_eq!(sum(&text, "kvx_registrations", &dec), (1.0, 1));
    // Two PP ranks, each one registration, each deciding every request, and their writes all
    // into the one decode.
    let pre = ["role=\"prefill\""];
    assert_eq!(sum(&text, "kvx_registrations", &pre), (2.0, 2));
    assert_eq!(
        sum(
            &text,
            "kvx_requests_decided_total",
            &["role=\"prefill\"", "decision=\"complete\""]
        ),
        (2.0 * REQUESTS, 2)
    );
    let writes = sum(&text, "kvx_writes_total", &pre).0;
    let per_request = row["writes_per_request"].as_f64().unwrap_or_default();
    assert!(per_request > 0.0, "{row}");
    assert_eq!(writes, per_request * REQUESTS, "{text}");
    assert_eq!(sum(&text, "kvx_peer_writes_total", &pre).0, writes);
    assert_eq!(sum(&text, "kvx_leaked_pools_total", &[]), (0.0, 1));
}

#[test]
fn the_decode_process_of_a_processes_run_serves_what_decode_did() {
    let (text, row) = run("--processes", "processes");
    assert_eq!(row["requests"].as_f64(), Some(REQUESTS), "{row}");
    assert_eq!(
        sum(
            &text,
            "kvx_requests_total",
            &["role=\"decode\"", "outcome=\"complete\""]
        ),
        (REQUESTS, 1),
        "{text}"
    );
    assert_eq!(
        sum(&text, "kvx_connected_ranks", &["role=\"decode\""]),
        (2.0, 1)
    );
    // The prefill ranks are processes of their own: not on decode's endpoint.
    assert_eq!(
        sum(&text, "kvx_writes_total", &["role=\"prefill\""]),
        (0.0, 0)
    );
}
