//! The metrics endpoint, scraped over HTTP from a live run over real loopback UCX: the counts it
//! serves are the ones the run made (requests by outcome, a request waiting for its rank, bytes and
//! writes into the decode, registrations, durations, the process's leaked pools), a decode and a
//! prefill engine share one endpoint, and the endpoint goes once its engines are gone.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;
use transfer_engine::control::Secret;
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::{KvLayout, RegionKind};
use transfer_engine::engine::{
    DecodeConfig, DecodeEngine, Outcome, Pool, PrefillConfig, PrefillEngine,
};
use transfer_engine::mem::{HostBuffer, HostOptions};

const LAYERS: u32 = 4;
const PAGE_TOKENS: u32 = 16;
const PAGE_BYTES: u64 = 512;
const DECODE_PAGES: u32 = 64;
const PREFILL_PAGES: u32 = 16;
const PROMPT: u32 = 64;
const CHUNK: u32 = 32;
const SECRET: &[u8] = b"metrics-test secret, 32 bytes...";
const BOUND: Duration = Duration::from_secs(10);

fn pattern(layer: u32, page: u32, at: u64) -> u8 {
    (u64::from(layer) * 31 + u64::from(page) * 7 + at) as u8
}

/// `GET path` on `addr`: the status line and the body.
fn get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(BOUND)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: kvx\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// The value of the sample whose line starts with `name{` and holds every label of `labels`.
fn sample(text: &str, name: &str, labels: &[&str]) -> f64 {
    let found: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(found.len(), 1, "{name} {labels:?}: {found:?} in\n{text}");
    found[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_counts_what_the_run_did() {
    let layout = KvLayout::packed(0, LAYERS, RegionKind::Fused, PAGE_BYTES, DECODE_PAGES);
    let mut dcfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout.clone(), 1);
    dcfg.engine_id = "metrics-decode".into();
    dcfg.token = Some(Secret::new(SECRET));
    dcfg.metrics = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    let buf = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
    let d = DecodeEngine::start(dcfg, Pool::Owned(buf)).await.unwrap();
    let endpoint = d.metrics_addr().unwrap();
    let dec = [
        "role=\"decode\"",
        "engine=\"metrics-decode\"",
        "backend=\"ucx\"",
    ];
    let pre = ["role=\"prefill\"", "engine=\"metrics-prefill\""];
    let scrape = || async move {
        tokio::task::spawn_blocking(move || get(endpoint, "/metrics"))
            .await
            .unwrap()
    };

    // The first request is expected before its rank connected: it waits for the rank.
    const COMPLETE: u64 = 6;
    let src: Vec<u32> = (0..PROMPT / PAGE_TOKENS).collect();
    let last = PROMPT.div_ceil(CHUNK) - 1;
    let dst_of = |n: u64| -> Vec<u32> { src.iter().map(|s| s + 4 * n as u32).collect() };
    let mut first = Some(
        d.expect(RequestId(100), PROMPT, CHUNK, dst_of(0), BOUND)
            .unwrap(),
    );
    let (_, text) = scrape().await;
    assert_eq!(sample(&text, "kvx_requests_waiting_for_rank", &dec), 1.0);

    let (play, pbuf) = common::patterned_rank(LAYERS, 1, 0, PAGE_BYTES, PREFILL_PAGES, pattern);
    let mut pcfg = PrefillConfig::new(d.local_addr(), 0, 1, LAYERS, PAGE_TOKENS, play);
    pcfg.engine_id = "metrics-prefill".into();
    pcfg.token = Some(Secret::new(SECRET));
    // The decode's endpoint, by its bound address: one endpoint for both engines.
    pcfg.metrics = Some(endpoint);
    let p = PrefillEngine::start(pcfg, Pool::Owned(pbuf)).await.unwrap();
    assert_eq!(p.metrics_addr(), Some(endpoint));
    d.wait_for_ranks(BOUND).await.unwrap();

    for n in 0..COMPLETE {
        let request = RequestId(100 + n);
        let done = match first.take() {
            Some(done) => done,
            None => d.expect(request, PROMPT, CHUNK, dst_of(n), BOUND).unwrap(),
        };
        assert_eq!(p.next_request().await.unwrap().request, request);
        for chunk in 0..=last {
            p.send_chunk(request, chunk, &src, chunk == last)
                .await
                .unwrap();
        }
        assert_eq!(
            tokio::time::timeout(BOUND, done).await.unwrap(),
            Outcome::Complete
        );
    }
    // One request aborted by decode before any chunk.
    let aborted = RequestId(900);
    let done = d
        .expect(aborted, PROMPT, CHUNK, vec![40, 41, 42, 43], BOUND)
        .unwrap();
    assert_eq!(p.next_request().await.unwrap().request, aborted);
    d.abort(aborted);
    assert!(matches!(
        tokio::time::timeout(BOUND, done).await.unwrap(),
        Outcome::Failed(_)
    ));

    let (status, text) = scrape().await;
    assert!(status.contains(" 200 "), "{status}");
    let with = |base: &[&'static str], more: &[&'static str]| -> Vec<&'static str> {
        base.iter().chain(more).copied().collect()
    };
    assert_eq!(
        sample(
            &text,
            "kvx_requests_total",
            &with(&dec, &["outcome=\"complete\""])
        ),
        COMPLETE as f64
    );
    assert_eq!(
        sample(
            &text,
            "kvx_requests_total",
            &with(&dec, &["cause=\"aborted\""])
        ),
        1.0
    );
    assert_eq!(
        sample(
            &text,
            "kvx_requests_total",
            &with(&dec, &["cause=\"timeout\""])
        ),
        0.0
    );
    assert_eq!(
        sample(
            &text,
            "kvx_request_duration_seconds_count",
            &with(&dec, &["outcome=\"complete\""])
        ),
        COMPLETE as f64
    );
    // Each completed request's time from the last post its rank stamped (the prefill's wall
    // clock, in the notification) to its Complete: one sample each, none for the aborted one, and
    // within its expect-to-Complete time (the posts came after expect; the stamp keeps whole
    // microseconds, so each may read up to 1 µs long).
    assert_eq!(
        sample(&text, "kvx_last_post_to_complete_seconds_count", &dec),
        COMPLETE as f64
    );
    let last_post = sample(&text, "kvx_last_post_to_complete_seconds_sum", &dec);
    let expect_to_complete = sample(
        &text,
        "kvx_request_duration_seconds_sum",
        &with(&dec, &["outcome=\"complete\""]),
    );
    assert!(
        last_post > 0.0 && last_post <= expect_to_complete + COMPLETE as f64 * 1e-6,
        "last post to Complete {last_post} s, expect to Complete {expect_to_complete} s"
    );
    assert_eq!(sample(&text, "kvx_last_post_ahead_total", &dec), 0.0);
    // Every layer of every moved page, for each completed request, landed in this decode.
    let moved = COMPLETE * u64::from(LAYERS) * src.len() as u64 * PAGE_BYTES;
    let peer = format!("peer=\"{}\"", d.local_addr());
    let written = text
        .lines()
        .find(|l| l.starts_with("kvx_written_bytes_total{") && l.contains(&peer))
        .unwrap_or_else(|| panic!("no bytes written into {peer} in\n{text}"));
    assert!(pre.iter().all(|l| written.contains(l)), "{written}");
    assert_eq!(
        written.rsplit(' ').next().unwrap().parse::<u64>().unwrap(),
        moved
    );
    assert_eq!(p.stats().bytes, moved);
    // Every write went into that decode, and the request that waited is no longer waiting.
    let writes = sample(&text, "kvx_writes_total", &pre);
    assert!(
        writes >= (COMPLETE * u64::from(last + 1)) as f64,
        "{writes} writes"
    );
    assert_eq!(
        sample(&text, "kvx_peer_writes_total", &[pre[0], pre[1], &peer]),
        writes
    );
    assert_eq!(sample(&text, "kvx_requests_waiting_for_rank", &dec), 0.0);
    // The process's leaked pools, once, without engine labels.
    assert_eq!(
        sample(&text, "kvx_leaked_pools_total", &[]),
        transfer_engine::transport::leaked_pools() as f64
    );
    assert!(!text.contains("kvx_leaked_pools_total{role"), "{text}");
    assert_eq!(sample(&text, "kvx_registrations", &dec), 1.0);
    assert_eq!(sample(&text, "kvx_registrations", &pre), 1.0);
    assert_eq!(
        sample(
            &text,
            "kvx_requests_decided_total",
            &with(&pre, &["decision=\"complete\""])
        ),
        COMPLETE as f64
    );
    assert_eq!(sample(&text, "kvx_auth_failures_total", &dec), 0.0);
    assert!(
        text.trim_end().ends_with("# EOF"),
        "not OpenMetrics:\n{text}"
    );

    let (status, _) = tokio::task::spawn_blocking(move || get(endpoint, "/other"))
        .await
        .unwrap();
    assert!(status.contains(" 404 "), "{status}");

    // Both engines gone: the endpoint goes with them.
    drop(p);
    d.shutdown(BOUND).await;
    let mut closed = false;
    for _ in 0..50 {
        if TcpStream::connect(endpoint).is_err() {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(closed, "the endpoint still answers with no engine left");
}
