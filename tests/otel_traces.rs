//! The engines' request spans through OpenTelemetry: with `tracing-opentelemetry`'s layer and the
//! SDK's in-memory exporter (where a deployment would put its OTLP exporter), a request moved over
//! real loopback UCX comes out as a `kvx.request` span from decode (with its outcome) and one from
//! the prefill rank (with its decision) whose chunk spans are its children.
#![allow(clippy::unwrap_used)]

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use std::time::Duration;
use tracing_subscriber::layer::SubscriberExt;
use transfer_engine::control::Secret;
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::{KvLayout, RegionKind};
use transfer_engine::engine::{
    DecodeConfig, DecodeEngine, Outcome, Pool, PrefillConfig, PrefillEngine,
};
use transfer_engine::mem::{HostBuffer, HostOptions};

const LAYERS: u32 = 2;
const PAGE_TOKENS: u32 = 16;
const PROMPT: u32 = 64;
const CHUNK: u32 = 32;
const BOUND: Duration = Duration::from_secs(10);
const SECRET: &[u8] = b"otel-test secret, 32 bytes long!";

fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_spans_reach_an_opentelemetry_exporter() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("kvx-test"));
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer)).unwrap();

    let layout = KvLayout::packed(0, LAYERS, RegionKind::Fused, 1024, 16);
    let mut dcfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout.clone(), 1);
    dcfg.token = Some(Secret::new(SECRET));
    let dbuf = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
    let d = DecodeEngine::start(dcfg, Pool::Owned(dbuf)).await.unwrap();
    let mut pcfg = PrefillConfig::new(d.local_addr(), 0, 1, LAYERS, PAGE_TOKENS, layout.clone());
    pcfg.token = Some(Secret::new(SECRET));
    let pbuf = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
    let p = PrefillEngine::start(pcfg, Pool::Owned(pbuf)).await.unwrap();
    d.wait_for_ranks(BOUND).await.unwrap();

    let request = RequestId(4242);
    let pages: Vec<u32> = (0..PROMPT / PAGE_TOKENS).collect();
    let done = d
        .expect(request, PROMPT, CHUNK, pages.clone(), BOUND)
        .unwrap();
    assert_eq!(p.next_request().await.unwrap().request, request);
    let chunks = PROMPT.div_ceil(CHUNK);
    for c in 0..chunks {
        p.send_chunk(request, c, &pages, c + 1 == chunks)
            .await
            .unwrap();
    }
    assert_eq!(
        tokio::time::timeout(BOUND, done).await.unwrap(),
        Outcome::Complete
    );
    p.decided(request).await;
    drop(p);
    d.shutdown(BOUND).await;
    provider.force_flush().unwrap();

    let spans = exporter.get_finished_spans().unwrap();
    let of = |role: &str| -> Vec<&SpanData> {
        spans
            .iter()
            .filter(|s| {
                s.name == "kvx.request"
                    && attr(s, "role").as_deref() == Some(role)
                    && attr(s, "request").as_deref() == Some("4242")
            })
            .collect()
    };
    let (dec, pre) = (of("decode"), of("prefill"));
    assert_eq!(dec.len(), 1, "{spans:#?}");
    assert_eq!(attr(dec[0], "outcome").as_deref(), Some("complete"));
    assert_eq!(pre.len(), 1, "{spans:#?}");
    assert_eq!(attr(pre[0], "decision").as_deref(), Some("complete"));
    let id = pre[0].span_context.span_id();
    let children = spans
        .iter()
        .filter(|s| s.name == "chunk" && s.parent_span_id == id)
        .count();
    assert_eq!(children, chunks as usize, "{spans:#?}");
}
