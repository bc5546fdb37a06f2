//! Traces: every request is one `kvx.request` span on decode (from `expect` to its outcome, which
//! it records) and one on each prefill rank (from its allocation to the PP decision, which it
//! records), and a prefill rank's chunk spans are children of its request span; over real loopback
//! UCX, seen by a tracing layer of the test's own (what an OpenTelemetry layer would be given).
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
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
const PROMPT: u32 = 64;
const CHUNK: u32 = 32;
const SECRET: &[u8] = b"traces-test secret, 32 bytes....";
const BOUND: Duration = Duration::from_secs(10);

/// A span as the layer saw it: its name, fields (as recorded, last value wins), the serial of
/// its parent and whether it closed. Serials, not ids: the registry reuses ids of closed spans.
#[derive(Debug, Clone, Default)]
struct Seen {
    name: String,
    fields: HashMap<String, String>,
    parent: Option<u64>,
    closed: bool,
}

#[derive(Default)]
struct Book {
    spans: Vec<Seen>,
    /// Open span id to its serial (index in `spans`).
    open: HashMap<u64, usize>,
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Book>>);

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().into(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Recorder {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut seen = Seen {
            name: attrs.metadata().name().into(),
            ..Seen::default()
        };
        attrs.record(&mut Fields(&mut seen.fields));
        let parent = if attrs.is_root() {
            None
        } else if let Some(p) = attrs.parent() {
            Some(p.clone())
        } else {
            ctx.current_span().id().cloned()
        };
        let mut book = self.0.lock().unwrap();
        seen.parent = parent.and_then(|p| book.open.get(&p.into_u64()).map(|&s| s as u64));
        let serial = book.spans.len();
        book.spans.push(seen);
        book.open.insert(id.into_u64(), serial);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let mut book = self.0.lock().unwrap();
        if let Some(&s) = book.open.get(&id.into_u64()) {
            values.record(&mut Fields(&mut book.spans[s].fields));
        }
    }

    fn on_close(&self, id: Id, _: Context<'_, S>) {
        let mut book = self.0.lock().unwrap();
        if let Some(s) = book.open.remove(&id.into_u64()) {
            book.spans[s].closed = true;
        }
    }
}

fn pattern(layer: u32, page: u32, at: u64) -> u8 {
    (u64::from(layer) * 13 + u64::from(page) * 5 + at) as u8
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_is_one_span_on_each_side_with_its_outcome_and_chunks() {
    let recorder = Recorder::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(recorder.clone()))
        .unwrap();

    let layout = KvLayout::packed(0, LAYERS, RegionKind::Fused, PAGE_BYTES, 32);
    let mut dcfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout.clone(), 1);
    dcfg.token = Some(Secret::new(SECRET));
    let buf = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
    let d = DecodeEngine::start(dcfg, Pool::Owned(buf)).await.unwrap();
    let (play, pbuf) = common::patterned_rank(LAYERS, 1, 0, PAGE_BYTES, 8, pattern);
    let mut pcfg = PrefillConfig::new(d.local_addr(), 0, 1, LAYERS, PAGE_TOKENS, play);
    pcfg.token = Some(Secret::new(SECRET));
    let p = PrefillEngine::start(pcfg, Pool::Owned(pbuf)).await.unwrap();
    d.wait_for_ranks(BOUND).await.unwrap();

    let src: Vec<u32> = (0..PROMPT / PAGE_TOKENS).collect();
    let chunks = PROMPT.div_ceil(CHUNK);
    let completed = [RequestId(71), RequestId(72)];
    for (n, &request) in completed.iter().enumerate() {
        let dst: Vec<u32> = src.iter().map(|s| s + 4 * n as u32).collect();
        let done = d.expect(request, PROMPT, CHUNK, dst, BOUND).unwrap();
        assert_eq!(p.next_request().await.unwrap().request, request);
        for chunk in 0..chunks {
            p.send_chunk(request, chunk, &src, chunk + 1 == chunks)
                .await
                .unwrap();
        }
        assert_eq!(
            tokio::time::timeout(BOUND, done).await.unwrap(),
            Outcome::Complete
        );
        p.decided(request).await;
    }
    let aborted = RequestId(79);
    let done = d
        .expect(aborted, PROMPT, CHUNK, vec![20, 21, 22, 23], BOUND)
        .unwrap();
    assert_eq!(p.next_request().await.unwrap().request, aborted);
    d.abort(aborted);
    assert!(matches!(
        tokio::time::timeout(BOUND, done).await.unwrap(),
        Outcome::Failed(_)
    ));
    drop(p);
    d.shutdown(BOUND).await;

    let book = recorder.0.lock().unwrap();
    let requests = |role: &str, id: RequestId| -> Vec<(usize, Seen)> {
        book.spans
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                s.name == "kvx.request"
                    && s.fields.get("role").map(String::as_str) == Some(role)
                    && s.fields.get("request") == Some(&id.0.to_string())
            })
            .map(|(i, s)| (i, s.clone()))
            .collect()
    };
    for &request in &completed {
        let dec = requests("decode", request);
        assert_eq!(dec.len(), 1, "decode spans of {request:?}: {dec:?}");
        assert!(dec[0].1.closed, "{dec:?}");
        assert_eq!(dec[0].1.fields["outcome"], "complete");
        let pre = requests("prefill", request);
        assert_eq!(pre.len(), 1, "prefill spans of {request:?}: {pre:?}");
        assert!(pre[0].1.closed, "{pre:?}");
        assert_eq!(pre[0].1.fields["decision"], "complete");
        // The rank's chunks are children of its request span.
        let children = book
            .spans
            .iter()
            .filter(|s| s.name == "chunk" && s.parent == Some(pre[0].0 as u64))
            .count();
        assert_eq!(children, chunks as usize, "chunk spans of {request:?}");
    }
    let dec = requests("decode", aborted);
    assert_eq!(dec.len(), 1, "{dec:?}");
    assert!(
        dec[0].1.fields["outcome"].contains("Aborted"),
        "{:?}",
        dec[0].1
    );
}
