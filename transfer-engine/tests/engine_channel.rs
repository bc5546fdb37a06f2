//! The control channel through a byte relay between a real prefill and a real decode engine (UCX on
//! loopback): the relay sees no plaintext and the run works; a byte it changes after the handshake
//! closes the connection with a typed, counted error, and never yields a write into pages decode
//! handed back; a relay that goes silent (a half-open link: both TCP connections stay up, nothing
//! passes) has the rank declared lost within three heartbeat intervals, and a new start of it is
//! admitted. Every wait is bounded; every byte is checked on poisoned pages.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use transfer_engine::control::channel::refused_records;
use transfer_engine::control::{self, Connection, Listener, Msg, Secret};
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::{KvLayout, RegionKind};
use transfer_engine::engine::{
    ChunkJobHook, DecodeConfig, DecodeEngine, EngineError, Outcome, Pool, PrefillConfig,
    PrefillEngine, PrefillLimits, probe_decode,
};
use transfer_engine::mem::{HostBuffer, HostOptions};

const LAYERS: u32 = 2;
const PAGE_TOKENS: u32 = 16;
const PAGE_BYTES: u64 = 256;
const PAGES: u32 = 16;
const PROMPT: u32 = 64;
const CHUNK: u32 = 32;
const POISON: u8 = 0xC3;
const SECRET: &[u8] = b"channel-test secret, 32 bytes...";
const DECODE_ID: &str = "decode-7f3a-seen-only-in-its-hello";
const PREFILL_ID: &str = "prefill-9c2e-seen-only-in-its-hello";
const BOUND: Duration = Duration::from_secs(10);

fn layout() -> KvLayout {
    KvLayout::packed(0, LAYERS, RegionKind::Fused, PAGE_BYTES, PAGES)
}

fn byte(layer: u32, page: u32, at: u64) -> u8 {
    (u64::from(layer) * 131 + u64::from(page) * 17 + at) as u8 ^ 0x5C
}

/// Which way the relay changes a byte, once armed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Toward {
    Prefill,
    Decode,
}

/// A byte relay on loopback in front of `target`: it records every byte each way and, once
/// `armed`, flips the last byte of the next read going `toward`.
struct Relay {
    addr: SocketAddr,
    to_prefill: Arc<Mutex<Vec<u8>>>,
    to_decode: Arc<Mutex<Vec<u8>>>,
    armed: Arc<AtomicBool>,
    /// Once set, nothing passes either way; both connections stay open.
    mute: Arc<AtomicBool>,
}

async fn relay(target: SocketAddr, toward: Toward) -> Relay {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (to_prefill, to_decode) = (Arc::default(), Arc::default());
    let armed = Arc::new(AtomicBool::new(false));
    let mute = Arc::new(AtomicBool::new(false));
    let r = Relay {
        addr,
        to_prefill: Arc::clone(&to_prefill),
        to_decode: Arc::clone(&to_decode),
        armed: Arc::clone(&armed),
        mute: Arc::clone(&mute),
    };
    tokio::spawn(async move {
        let (prefill, _) = listener.accept().await.unwrap();
        let decode = TcpStream::connect(target).await.unwrap();
        let (pr, pw) = prefill.into_split();
        let (dr, dw) = decode.into_split();
        let (a, m) = (armed.clone(), mute.clone());
        tokio::spawn(pump(pr, dw, to_decode, a, m, toward == Toward::Decode));
        tokio::spawn(pump(
            dr,
            pw,
            to_prefill,
            armed,
            mute,
            toward == Toward::Prefill,
        ));
    });
    r
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    seen: Arc<Mutex<Vec<u8>>>,
    armed: Arc<AtomicBool>,
    mute: Arc<AtomicBool>,
    flips: bool,
) {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if mute.load(Ordering::SeqCst) {
            continue;
        }
        seen.lock().unwrap().extend_from_slice(&buf[..n]);
        // The last byte of a read is a record's last byte (a tag's), so the change lands inside
        // a record and not in a length.
        if flips && armed.swap(false, Ordering::SeqCst) {
            buf[n - 1] ^= 0x01;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

async fn decode() -> DecodeEngine {
    decode_with(Some(Duration::from_secs(5))).await
}

async fn decode_with(heartbeat: Option<Duration>) -> DecodeEngine {
    decode_hooked(heartbeat, None).await
}

async fn decode_hooked(heartbeat: Option<Duration>, hook: Option<ChunkJobHook>) -> DecodeEngine {
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout(), 1);
    cfg.heartbeat = heartbeat;
    cfg.chunk_job_hook = hook;
    cfg.engine_id = DECODE_ID.into();
    cfg.token = Some(Secret::new(SECRET));
    cfg.abort_ack_timeout = Duration::from_millis(500);
    let mut b = HostBuffer::new(layout().buffer_len as usize, HostOptions::default()).unwrap();
    b.as_mut_slice().fill(POISON);
    DecodeEngine::start(cfg, Pool::Owned(b)).await.unwrap()
}

async fn prefill(decode: SocketAddr) -> PrefillEngine {
    prefill_with(decode, Some(Duration::from_secs(5))).await
}

async fn prefill_with(decode: SocketAddr, heartbeat: Option<Duration>) -> PrefillEngine {
    prefill_start(decode, heartbeat, None).await.unwrap()
}

async fn prefill_start(
    decode: SocketAddr,
    heartbeat: Option<Duration>,
    incarnation: Option<u64>,
) -> Result<PrefillEngine, EngineError> {
    prefill_of(decode, heartbeat, incarnation, PAGES).await
}

/// A prefill rank whose pool holds `pages` pages of each layer.
async fn prefill_of(
    decode: SocketAddr,
    heartbeat: Option<Duration>,
    incarnation: Option<u64>,
    pages: u32,
) -> Result<PrefillEngine, EngineError> {
    prefill_limited(
        decode,
        heartbeat,
        incarnation,
        pages,
        PrefillLimits::default(),
    )
    .await
}

/// [`prefill_of`] under `limits`.
async fn prefill_limited(
    decode: SocketAddr,
    heartbeat: Option<Duration>,
    incarnation: Option<u64>,
    pages: u32,
    limits: PrefillLimits,
) -> Result<PrefillEngine, EngineError> {
    let layout = KvLayout::packed(0, LAYERS, RegionKind::Fused, PAGE_BYTES, pages);
    let mut cfg = PrefillConfig::new(decode, 0, 1, LAYERS, PAGE_TOKENS, layout.clone());
    cfg.limits = limits;
    cfg.heartbeat = heartbeat;
    if let Some(n) = incarnation {
        cfg.incarnation = n;
    }
    cfg.engine_id = PREFILL_ID.into();
    cfg.token = Some(Secret::new(SECRET));
    cfg.connect_timeout = Duration::from_secs(5);
    cfg.request_wait = Duration::from_secs(2);
    let mut b = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
    for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
        let i = i as u64;
        let per_layer = u64::from(pages) * PAGE_BYTES;
        *x = byte(
            (i / per_layer) as u32,
            ((i % per_layer) / PAGE_BYTES) as u32,
            i % PAGE_BYTES,
        );
    }
    PrefillEngine::start(cfg, Pool::Owned(b)).await
}

fn landed(d: &DecodeEngine, src: &[u32], dst: &[u32]) -> bool {
    let mut page = vec![0u8; PAGE_BYTES as usize];
    (0..LAYERS).all(|layer| {
        src.iter().zip(dst).all(|(&s, &t)| {
            let off = (u64::from(layer) * u64::from(PAGES) + u64::from(t)) * PAGE_BYTES;
            d.read_pool(off, &mut page).unwrap();
            page.iter()
                .enumerate()
                .all(|(at, &b)| b == byte(layer, s, at as u64))
        })
    })
}

fn poisoned(d: &DecodeEngine, dst: &[u32]) -> bool {
    let mut page = vec![0u8; PAGE_BYTES as usize];
    (0..LAYERS).all(|layer| {
        dst.iter().all(|&t| {
            let off = (u64::from(layer) * u64::from(PAGES) + u64::from(t)) * PAGE_BYTES;
            d.read_pool(off, &mut page).unwrap();
            page.iter().all(|&b| b == POISON)
        })
    })
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("did not finish within the bound")
}

/// Starts a rank that decode must have within `within`, and serves one request through it, every
/// byte landed.
async fn served_within(d: &DecodeEngine, within: Duration, r: RequestId) -> PrefillEngine {
    let started = std::time::Instant::now();
    let p = bounded(prefill(d.local_addr())).await;
    bounded(d.wait_for_ranks(BOUND)).await.unwrap();
    assert!(started.elapsed() < within, "{:?}", started.elapsed());
    let (src, dst) = ([0, 1, 2, 3], [4, 5, 6, 7]);
    let done = d.expect(r, PROMPT, CHUNK, dst.to_vec(), BOUND).unwrap();
    bounded(send(&p, r, &src)).await.unwrap();
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert!(landed(d, &src, &dst));
    p
}

/// Serves request `r` from `p`'s pages 0..4 into `d`'s pages 4..8, taking its allocation from
/// `next_request`: it completes and every byte landed.
async fn serve_one(d: &DecodeEngine, p: &PrefillEngine, r: RequestId) {
    let (src, dst) = ([0, 1, 2, 3], [4, 5, 6, 7]);
    let done = d.expect(r, PROMPT, CHUNK, dst.to_vec(), BOUND).unwrap();
    assert_eq!(bounded(p.next_request()).await.unwrap().request, r);
    bounded(send(p, r, &src)).await.unwrap();
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert!(landed(d, &src, &dst));
}

async fn send(p: &PrefillEngine, r: RequestId, src: &[u32]) -> Result<(), EngineError> {
    let last = PROMPT.div_ceil(CHUNK) - 1;
    for c in 0..=last {
        p.send_chunk(r, c, src, c == last).await?;
    }
    Ok(())
}

/// A chunk goes once, and the prompt's last chunk goes with LAST: a second post of a chunk (it
/// could write into a landing range a later chunk holds by then) and the last chunk without LAST
/// (this rank would vote complete while decode never sees the request end) are refused, and the
/// request still completes with every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_posted_twice_or_the_last_without_last_is_refused() {
    let d = decode().await;
    let p = prefill(d.local_addr()).await;
    bounded(d.wait_for_ranks(BOUND)).await.unwrap();
    let (r, src, dst) = (RequestId(21), [0, 1, 2, 3], [4, 5, 6, 7]);
    let done = d.expect(r, PROMPT, CHUNK, dst.to_vec(), BOUND).unwrap();
    let last = PROMPT.div_ceil(CHUNK) - 1;
    assert!(last >= 1);
    bounded(p.send_chunk(r, 0, &src, false)).await.unwrap();
    let again = bounded(p.send_chunk(r, 0, &src, false)).await;
    assert!(
        matches!(&again, Err(EngineError::Config(m)) if m.contains("posted on this rank already")),
        "{again:?}"
    );
    let unmarked = bounded(p.send_chunk(r, last, &src, false)).await;
    assert!(
        matches!(&unmarked, Err(EngineError::Config(m)) if m.contains("goes with LAST")),
        "{unmarked:?}"
    );
    for c in 1..=last {
        bounded(p.send_chunk(r, c, &src, c == last)).await.unwrap();
    }
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert!(landed(&d, &src, &dst));
    d.shutdown(BOUND).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_relay_sees_no_plaintext_and_the_run_still_works() {
    let d = decode().await;
    let relay = relay(d.local_addr(), Toward::Decode).await;
    let p = prefill(relay.addr).await;
    bounded(d.wait_for_ranks(BOUND)).await.unwrap();
    let (r, src, dst) = (RequestId(5), [0, 1, 2, 3], [8, 9, 10, 11]);
    let done = d.expect(r, PROMPT, CHUNK, dst.to_vec(), BOUND).unwrap();
    bounded(send(&p, r, &src)).await.unwrap();
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert!(landed(&d, &src, &dst));
    let (to_p, to_d) = (
        relay.to_prefill.lock().unwrap().clone(),
        relay.to_decode.lock().unwrap().clone(),
    );
    // Both Hellos, the Ready and the page allocation crossed the relay...
    assert!(
        to_p.len() > 500 && to_d.len() > 200,
        "{} {}",
        to_p.len(),
        to_d.len()
    );
    // ...and none of them in clear.
    for (what, bytes) in [("to prefill", &to_p), ("to decode", &to_d)] {
        assert!(!contains(bytes, DECODE_ID.as_bytes()), "decode's id {what}");
        assert!(
            !contains(bytes, PREFILL_ID.as_bytes()),
            "prefill's id {what}"
        );
    }
    d.shutdown(BOUND).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_byte_toward_prefill_closes_the_connection_and_nothing_is_written() {
    let d = decode().await;
    let relay = relay(d.local_addr(), Toward::Prefill).await;
    let p = prefill(relay.addr).await;
    bounded(d.wait_for_ranks(BOUND)).await.unwrap();
    let before = refused_records();
    // The page allocation is the next thing decode sends: the relay changes its last byte.
    relay.armed.store(true, Ordering::SeqCst);
    let (r, dst) = (RequestId(6), [4, 5, 6, 7]);
    let done = d.expect(r, PROMPT, CHUNK, dst.to_vec(), BOUND).unwrap();
    let outcome = bounded(done).await;
    assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
    assert!(
        refused_records() > before,
        "the changed record was not refused"
    );
    // Prefill never took the changed allocation: nothing of it was posted or written.
    assert!(matches!(
        send(&p, r, &[0, 1, 2, 3]).await,
        Err(EngineError::UnknownRequest(_) | EngineError::Shutdown)
    ));
    assert!(poisoned(&d, &dst));
    d.shutdown(BOUND).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_byte_toward_decode_keeps_the_pages_of_a_rank_that_may_still_write() {
    let d = decode().await;
    let relay = relay(d.local_addr(), Toward::Decode).await;
    let p = prefill(relay.addr).await;
    bounded(d.wait_for_ranks(BOUND)).await.unwrap();
    let (r, src, dst) = (RequestId(7), [0, 1, 2, 3], [12, 13, 14, 15]);
    let done = d.expect(r, PROMPT, CHUNK, dst.to_vec(), BOUND).unwrap();
    assert_eq!(bounded(p.next_request()).await.unwrap().request, r);
    // Chunk 0 lands; then the relay changes a byte of the next control message from prefill.
    p.send_chunk(r, 0, &src, false).await.unwrap();
    relay.armed.store(true, Ordering::SeqCst);
    p.send_aux(r, b"the first token".to_vec()).unwrap();
    let outcome = bounded(done).await;
    assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
    let until = tokio::time::Instant::now() + BOUND;
    while d.stats().tampered == 0 {
        assert!(tokio::time::Instant::now() < until, "{:?}", d.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The rank's process is alive and may still write: its request's pages are not handed back.
    assert_eq!(d.quarantined(), vec![r]);
    assert!(matches!(
        d.expect(RequestId(8), PROMPT, CHUNK, dst.to_vec(), BOUND),
        Err(EngineError::PageHeld { .. })
    ));
    // Once the operator knows it stopped, they are.
    d.confirm_stopped(0, r);
    bounded(d.released(r)).await;
    assert!(d.quarantined().is_empty());
    drop(p);
    d.shutdown(BOUND).await;
}

/// A relay in front of `target` that, once `cut` is set, resets its connection to decode (as a
/// reset injected on the way would: linger 0, no FIN before it) and keeps its connection to prefill
/// open, passing nothing more.
async fn resetting_relay(target: SocketAddr) -> (SocketAddr, tokio::sync::watch::Sender<bool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (cut, mut cut_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let (mut prefill, _) = listener.accept().await.unwrap();
        let mut decode = TcpStream::connect(target).await.unwrap();
        socket2::SockRef::from(&decode)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        let (mut up, mut down) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
        {
            // Borrowed halves: dropping them shuts nothing down.
            let (mut pr, mut pw) = prefill.split();
            let (mut dr, mut dw) = decode.split();
            loop {
                tokio::select! {
                    n = pr.read(&mut up) => match n {
                        Ok(n) if n > 0 => {
                            if dw.write_all(&up[..n]).await.is_err() {
                                return;
                            }
                        }
                        _ => return,
                    },
                    n = dr.read(&mut down) => match n {
                        Ok(n) if n > 0 => {
                            if pw.write_all(&down[..n]).await.is_err() {
                                return;
                            }
                        }
                        _ => return,
                    },
                    _ = cut_rx.changed() => break,
                }
            }
        }
        drop(decode);
        // Prefill's side stays open: what it sends goes nowhere.
        while matches!(prefill.read(&mut up).await, Ok(n) if n > 0) {}
    });
    (addr, cut)
}

/// A reset toward decode cuts off a prefill rank that is alive and does not know: decode fails
/// its request at once but keeps the pages, which the rank still writes into, until the rank
/// must have noticed (decode's heartbeats stopped for three intervals) and its posts are over
/// (`abort_ack_timeout`); then the pages come back and the pool is freed at shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_toward_decode_keeps_the_pages_of_a_live_rank_until_it_must_have_noticed() {
    let beat = Duration::from_secs(1);
    let d = decode_with(Some(beat)).await;
    let (addr, cut) = resetting_relay(d.local_addr()).await;
    let p = prefill_with(addr, Some(beat)).await;
    bounded(d.wait_for_ranks(BOUND)).await.unwrap();
    let (r, src, dst) = (RequestId(41), [0, 1, 2, 3], [8, 9, 10, 11]);
    let done = d.expect(r, PROMPT, CHUNK, dst.to_vec(), BOUND).unwrap();
    assert_eq!(bounded(p.next_request()).await.unwrap().request, r);
    p.send_chunk(r, 0, &src, false).await.unwrap();
    let reset_at = std::time::Instant::now();
    cut.send(true).unwrap();
    let outcome = bounded(done).await;
    assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
    assert_eq!(d.stats().unclean_ends, 1, "{:?}", d.stats());
    // The rank has not noticed: the pages stay held, and its next chunk still lands in them.
    assert_eq!(d.quarantined(), vec![r], "{:?}", d.stats());
    assert!(matches!(
        d.expect(RequestId(42), PROMPT, CHUNK, dst.to_vec(), BOUND),
        Err(EngineError::PageHeld { .. })
    ));
    p.send_chunk(r, 1, &src, true).await.unwrap();
    assert!(landed(&d, &src, &dst));
    // Three heartbeat intervals and `abort_ack_timeout` (500 ms) after the reset, they come back.
    bounded(d.released(r)).await;
    let held = reset_at.elapsed();
    assert!(held >= beat * 3 + Duration::from_millis(500), "{held:?}");
    assert!(d.quarantined().is_empty());
    eprintln!("pages held {held:?} after the reset (heartbeat {beat:?})");
    // About then the rank noticed, and let decode go.
    until_prefill(&p, "the rank let decode go", |s| s.decodes == 0).await;
    let next = d.expect(RequestId(43), PROMPT, CHUNK, dst.to_vec(), BOUND);
    assert!(next.is_ok(), "{:?}", next.err());
    d.abort(RequestId(43));
    let report = d.shutdown(BOUND).await;
    assert!(report.pool_freed, "{report:?}");
}

/// The same change of a byte while the checksum job of the request's landed chunk still waits on
/// decode's chunk worker (held there by the test): the rank's loss is not deferred behind that
/// job, so the failure finds the rank in its slot and keeps the pages held, before the job runs
/// and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_byte_toward_decode_behind_a_queued_chunk_keeps_the_pages() {
    let r = RequestId(17);
    let (hook, held_rx, go_tx) = common::hold_first_job(r, BOUND);
    let d = decode_hooked(Some(Duration::from_secs(5)), Some(hook)).await;
    let relay = relay(d.local_addr(), Toward::Decode).await;
    let p = prefill(relay.addr).await;
    bounded(d.wait_for_ranks(BOUND)).await.unwrap();
    let (src, dst) = ([0, 1, 2, 3], [12, 13, 14, 15]);
    let done = d.expect(r, PROMPT, CHUNK, dst.to_vec(), BOUND).unwrap();
    assert_eq!(bounded(p.next_request()).await.unwrap().request, r);
    p.send_chunk(r, 0, &src, false).await.unwrap();
    common::until_held(held_rx, BOUND).await;
    relay.armed.store(true, Ordering::SeqCst);
    p.send_aux(r, b"the first token".to_vec()).unwrap();
    let outcome = bounded(done).await;
    assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
    let until = tokio::time::Instant::now() + BOUND;
    while d.stats().tampered == 0 {
        assert!(tokio::time::Instant::now() < until, "{:?}", d.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(d.quarantined(), vec![r], "{:?}", d.stats());
    // The held job runs; the pages stay held.
    go_tx.send(()).unwrap();
    while d.stats().jobs_queued != 0 {
        assert!(tokio::time::Instant::now() < until, "{:?}", d.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(d.quarantined(), vec![r], "{:?}", d.stats());
    assert!(matches!(
        d.expect(RequestId(18), PROMPT, CHUNK, dst.to_vec(), BOUND),
        Err(EngineError::PageHeld { .. })
    ));
    d.confirm_stopped(0, r);
    bounded(d.released(r)).await;
    drop(p);
    d.shutdown(BOUND).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_behind_a_silent_link_is_lost_within_three_intervals_and_its_new_start_admitted() {
    // 500 ms: a 1.5 s silence bound, which a loaded machine's late wake-up does not reach.
    let beat = Duration::from_millis(500);
    let d = decode_with(Some(beat)).await;
    let relay = relay(d.local_addr(), Toward::Decode).await;
    let p = prefill_with(relay.addr, Some(beat)).await;
    bounded(d.wait_for_ranks(BOUND)).await.unwrap();
    // Idle for six intervals: the heartbeats keep the connection.
    tokio::time::sleep(beat * 6).await;
    assert_eq!(d.stats().connected_ranks, 1, "{:?}", d.stats());
    assert_eq!(p.stats().decodes, 1, "{:?}", p.stats());
    let (r, src, dst) = (RequestId(9), [0, 1, 2, 3], [4, 5, 6, 7]);
    let done = d.expect(r, PROMPT, CHUNK, dst.to_vec(), BOUND).unwrap();
    assert_eq!(bounded(p.next_request()).await.unwrap().request, r);
    p.send_chunk(r, 0, &src, false).await.unwrap();
    // The link goes half-open: nothing passes, no connection ends.
    relay.mute.store(true, Ordering::SeqCst);
    let cut = tokio::time::Instant::now();
    let outcome = bounded(done).await;
    assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
    while d.stats().connected_ranks != 0 || p.stats().decodes != 0 {
        assert!(cut.elapsed() < BOUND, "{:?} {:?}", d.stats(), p.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let lost_after = cut.elapsed();
    // Three intervals of silence, and the scheduling slack of a busy host.
    assert!(
        lost_after <= beat * 3 + Duration::from_secs(2),
        "lost after {lost_after:?}"
    );
    assert_eq!(d.stats().silent, 1, "{:?}", d.stats());
    // It may still be writing: the request's pages stay held.
    assert_eq!(d.quarantined(), vec![r]);
    // A new start of the rank takes the freed slot and is served.
    drop(p);
    let p2 = prefill_with(d.local_addr(), Some(beat)).await;
    bounded(d.wait_for_ranks(BOUND)).await.unwrap();
    let (r2, dst2) = (RequestId(10), [8, 9, 10, 11]);
    let done = d.expect(r2, PROMPT, CHUNK, dst2.to_vec(), BOUND).unwrap();
    bounded(send(&p2, r2, &src)).await.unwrap();
    assert_eq!(bounded(done).await, Outcome::Complete);
    assert!(landed(&d, &src, &dst2));
    // The new start closes cleanly: that confirms its own writes, not the silent start's.
    drop(p2);
    while d.stats().connected_ranks != 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(d.quarantined(), vec![r], "{:?}", d.stats());
    eprintln!("declared lost {lost_after:?} after the link went silent (heartbeat {beat:?})");
    // The silent start may still write: the pool is not handed back.
    let report = d.shutdown(BOUND).await;
    assert!(!report.pool_freed, "{report:?}");
}

/// Sides configured with different heartbeat intervals, or one with none, never take each other for
/// silent: each waits three of the interval the other announced in its Hello. Idle for seven of the
/// shorter interval, both links stay up and a request then completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sides_with_different_heartbeat_intervals_never_take_each_other_for_silent() {
    // 500 ms: a 1.5 s bound, which a loaded machine's late wake-up does not reach.
    let short = Duration::from_millis(500);
    for (decode_beat, prefill_beat) in [
        (Some(short), None),
        (Some(short), Some(short * 10)),
        (None, Some(short)),
    ] {
        let d = decode_with(decode_beat).await;
        let p = prefill_with(d.local_addr(), prefill_beat).await;
        bounded(d.wait_for_ranks(BOUND)).await.unwrap();
        tokio::time::sleep(short * 7).await;
        let what = format!("decode {decode_beat:?}, prefill {prefill_beat:?}");
        assert_eq!(d.stats().connected_ranks, 1, "{what}: {:?}", d.stats());
        assert_eq!(d.stats().silent, 0, "{what}: {:?}", d.stats());
        assert_eq!(p.stats().decodes, 1, "{what}: {:?}", p.stats());
        let (r, src, dst) = (RequestId(20), [0, 1, 2, 3], [4, 5, 6, 7]);
        let done = d.expect(r, PROMPT, CHUNK, dst.to_vec(), BOUND).unwrap();
        assert_eq!(bounded(p.next_request()).await.unwrap().request, r);
        bounded(send(&p, r, &src)).await.unwrap();
        assert_eq!(bounded(done).await, Outcome::Complete, "{what}");
        assert!(landed(&d, &src, &dst), "{what}");
        drop(p);
        d.shutdown(BOUND).await;
    }
}

/// An evicted start (its lease ended while its connection stays up, as for a process that is
/// stopped) gives its slot to a later start of the rank at once: the later one is admitted and
/// serves, and the evicted one's connection is cut. (Before, the later start was refused as long as
/// the evicted connection stayed up.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_start_takes_the_slot_of_an_evicted_one_whose_connection_is_cut() {
    let d = decode().await;
    let beat = Some(Duration::from_secs(5));
    let p = prefill_start(d.local_addr(), beat, Some(100))
        .await
        .unwrap();
    bounded(d.wait_for_ranks(BOUND)).await.unwrap();
    assert!(d.evict(0, 100));
    let started = tokio::time::Instant::now();
    let p2 = prefill_start(d.local_addr(), beat, Some(200))
        .await
        .unwrap();
    let admitted_after = started.elapsed();
    bounded(d.wait_for_ranks(BOUND)).await.unwrap();
    while p.stats().decodes != 0 {
        assert!(
            started.elapsed() < BOUND,
            "the evicted start's connection stayed up"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(d.stats().connected_ranks, 1, "{:?}", d.stats());
    assert_eq!(d.stats().rejoins, 1, "{:?}", d.stats());
    serve_one(&d, &p2, RequestId(30)).await;
    eprintln!("a later start took the evicted start's slot {admitted_after:?} after it asked");
    drop((p, p2));
    d.shutdown(BOUND).await;
}

/// An evicted start that is stopped (behind a relay gone silent, so it cannot confirm) whose
/// request still has a landed chunk's checksum job waiting on decode's chunk worker (held there by
/// the test), and a later start that takes its slot before the job runs: the request fails, and
/// its pages stay held, since the evicted start may still write when it resumes (its failure did
/// not wait for the job, and so found it in its slot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_start_behind_a_queued_chunk_keeps_its_pages_when_a_later_start_takes_the_slot()
{
    let r = RequestId(31);
    let (hook, held_rx, go_tx) = common::hold_first_job(r, BOUND);
    let beat = Some(Duration::from_secs(5));
    let d = decode_hooked(beat, Some(hook)).await;
    let relay = relay(d.local_addr(), Toward::Decode).await;
    let p = prefill_start(relay.addr, beat, Some(100)).await.unwrap();
    bounded(d.wait_for_ranks(BOUND)).await.unwrap();
    let (src, dst) = ([0, 1, 2, 3], [4, 5, 6, 7]);
    let done = d.expect(r, PROMPT, CHUNK, dst.to_vec(), BOUND).unwrap();
    assert_eq!(bounded(p.next_request()).await.unwrap().request, r);
    p.send_chunk(r, 0, &src, false).await.unwrap();
    common::until_held(held_rx, BOUND).await;
    relay.mute.store(true, Ordering::SeqCst);
    assert!(d.evict(0, 100));
    let p2 = prefill_start(d.local_addr(), beat, Some(200))
        .await
        .unwrap();
    bounded(d.wait_for_ranks(BOUND)).await.unwrap();
    let until = tokio::time::Instant::now() + BOUND;
    while p.stats().decodes != 0 {
        assert!(tokio::time::Instant::now() < until, "{:?}", d.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    go_tx.send(()).unwrap();
    let outcome = bounded(done).await;
    assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
    while d.stats().jobs_queued != 0 {
        assert!(tokio::time::Instant::now() < until, "{:?}", d.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Long enough for an abort to the later start and its answer, were one sent; the later start
    // never heard of the request (it would have voted it failed).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(p2.stats().decided_failed, 0, "{:?}", p2.stats());
    assert_eq!(d.quarantined(), vec![r], "{:?}", d.stats());
    assert!(matches!(
        d.expect(RequestId(32), PROMPT, CHUNK, dst.to_vec(), BOUND),
        Err(EngineError::PageHeld { .. })
    ));
    drop((p, p2));
    d.shutdown(BOUND).await;
}

/// A decode that says what it likes on an authenticated control connection: a prefill rank of
/// `pages` pages connects to it, and it answers with the Hello of the real decode `d` (so the
/// prefill's transport reaches real UCX).
async fn rogue_decode(d: &DecodeEngine, pages: u32) -> (Connection, PrefillEngine) {
    rogue_decode_limited(d, pages, PrefillLimits::default()).await
}

/// [`rogue_decode`] with the rank under `limits`.
async fn rogue_decode_limited(
    d: &DecodeEngine,
    pages: u32,
    limits: PrefillLimits,
) -> (Connection, PrefillEngine) {
    let (mut conns, mut ranks) = rogue_decode_of(d, |addr| {
        vec![prefill_limited(
            addr,
            Some(Duration::from_secs(5)),
            None,
            pages,
            limits,
        )]
    })
    .await;
    (conns.remove(0), ranks.remove(0))
}

/// [`rogue_decode`] for the prefill ranks that `start` starts against the address it is given:
/// their connections in PP rank order, and the engines in `start`'s order.
async fn rogue_decode_of<F>(
    d: &DecodeEngine,
    start: impl FnOnce(SocketAddr) -> Vec<F>,
) -> (Vec<Connection>, Vec<PrefillEngine>)
where
    F: std::future::Future<Output = Result<PrefillEngine, EngineError>> + Send + 'static,
{
    let secret = Secret::new(SECRET);
    let hello = probe_decode(d.local_addr(), Some(&secret), BOUND)
        .await
        .unwrap();
    let listener = Listener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    let starts: Vec<_> = start(addr).into_iter().map(tokio::spawn).collect();
    let mut conns = Vec::new();
    for _ in 0..starts.len() {
        let mut conn = bounded(listener.accept()).await.unwrap();
        let deadline = tokio::time::Instant::now() + BOUND;
        let theirs = control::handshake(&mut conn, &hello, &secret, deadline)
            .await
            .unwrap();
        conns.push((theirs.pp_rank, conn));
    }
    conns.sort_by_key(|(rank, _)| *rank);
    let mut ranks = Vec::new();
    for s in starts {
        ranks.push(bounded(s).await.unwrap().unwrap());
    }
    (conns.into_iter().map(|(_, c)| c).collect(), ranks)
}

/// The next message from the prefill that is not a heartbeat or a readiness word.
async fn next_answer(conn: &mut Connection) -> Msg {
    loop {
        match bounded(conn.recv()).await.unwrap() {
            Some(Msg::Heartbeat | Msg::Ready | Msg::NotReady) => {}
            Some(m) => return m,
            None => panic!("the prefill closed the connection"),
        }
    }
}

/// Sends an abort of each of `ids` and waits for every answer (passing over the prefill's own
/// aborts, of requests that failed there).
async fn abort_all(conn: &mut Connection, ids: std::ops::RangeInclusive<u64>) {
    let n = ids.clone().count();
    for id in ids {
        conn.send(&Msg::Abort(control::Abort {
            request: id,
            reason: 1,
        }))
        .await
        .unwrap();
    }
    let mut acks = 0;
    while acks < n {
        match next_answer(conn).await {
            Msg::AbortAck(_) => acks += 1,
            Msg::Abort(_) => {}
            m => panic!("{m:?}"),
        }
    }
}

/// An allocation of `request` whose `prompt_tokens` go to `dst_pages`, in chunks of
/// `chunk_tokens`.
fn allocation(request: u64, prompt_tokens: u32, chunk_tokens: u32, dst_pages: Vec<u32>) -> Msg {
    Msg::TransferRequest(control::TransferRequest {
        request,
        prompt_tokens,
        chunk_tokens,
        dst_pages,
        prefix_tokens: 0,
        deadline_ms: 10_000,
        landing: None,
    })
}

/// A decode that aborts many requests the prefill rank never held: each abort is answered and
/// decided failed, but the rank keeps only so many of those decisions; an allocation that comes
/// for an aborted request afterwards is refused, not served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborts_of_requests_a_rank_never_held_keep_bounded_state_and_refuse_them_later() {
    use transfer_engine::engine::MAX_FOREIGN_DECISIONS;
    let d = decode().await;
    let (mut conn, p) = rogue_decode(&d, PAGES).await;
    let n = MAX_FOREIGN_DECISIONS as u64 + 100;
    abort_all(&mut conn, 1000..=1000 + n - 1).await;
    // Each abort is answered before its vote is cast: the last vote may come a moment later.
    let s = until_prefill(&p, "every abort decided", |s| s.decided_failed == n).await;
    assert_eq!(s.decisions_held, MAX_FOREIGN_DECISIONS as u64, "{s:?}");
    assert_eq!(s.unknown_aborts, 0, "{s:?}");
    // The last aborted request's allocation comes after all: refused.
    let last = 1000 + n - 1;
    conn.send(&allocation(last, PROMPT, CHUNK, vec![0, 1, 2, 3]))
        .await
        .unwrap();
    match next_answer(&mut conn).await {
        Msg::TransferReject(r) => assert_eq!(r.request, last, "{r:?}"),
        m => panic!("{m:?}"),
    }
    assert_eq!(p.stats().requests, 0, "{:?}", p.stats());
    drop((conn, p));
    d.shutdown(BOUND).await;
}

/// A decode that sends kinds of message no decode sends once connected (a Hello again, a Vote, a
/// readiness word, an aux payload): each is counted and dropped, and the connection goes on to
/// serve an allocation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_a_kind_no_decode_sends_are_counted_and_dropped() {
    let d = decode().await;
    let (mut conn, p) = rogue_decode(&d, PAGES).await;
    let hello = probe_decode(d.local_addr(), Some(&Secret::new(SECRET)), BOUND)
        .await
        .unwrap();
    let unexpected = [
        Msg::Hello(hello),
        Msg::Vote(control::Vote { bytes: vec![0; 8] }),
        Msg::Ready,
        Msg::Aux(control::AuxData {
            request: 5,
            data: b"not from decode".to_vec(),
        }),
    ];
    let n = unexpected.len() as u64;
    for m in unexpected {
        conn.send(&m).await.unwrap();
    }
    until_prefill(&p, "every unexpected message counted", |s| s.refused == n).await;
    conn.send(&allocation(6, PROMPT, CHUNK, vec![0, 1, 2, 3]))
        .await
        .unwrap();
    let got = bounded(p.next_request()).await.unwrap();
    assert_eq!(got.request, RequestId(6));
    assert_eq!(p.stats().refused, n, "{:?}", p.stats());
    drop((conn, p));
    d.shutdown(BOUND).await;
}

/// A prefill rank that dials decode's address and finds a listener of another role there, which
/// holds the secret, speaks decode's protocol and passes the Hello's checks (the other PP rank of
/// the rank's pipeline, as a relay or a wrong record could present it): the rank refuses it for
/// its role, and does not start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_rank_refuses_a_listener_that_is_not_a_decode() {
    let d = decode().await;
    let secret = Secret::new(SECRET);
    let mut hello = probe_decode(d.local_addr(), Some(&secret), BOUND)
        .await
        .unwrap();
    hello.role = control::Role::Prefill;
    (hello.pp_rank, hello.pp_size) = (1, 2);
    (hello.layout.first_layer, hello.layout.layers) = (1, 1);
    let listener = Listener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    let server = tokio::spawn(async move {
        let mut conn = listener.accept().await.unwrap();
        let deadline = tokio::time::Instant::now() + BOUND;
        control::handshake(&mut conn, &hello, &secret, deadline).await
    });
    // PP rank 0 of 2: it dials decode before it forms its vote mesh.
    let layout = KvLayout::packed(0, 1, RegionKind::Fused, PAGE_BYTES, PAGES);
    let mut cfg = PrefillConfig::new(addr, 0, 2, LAYERS, PAGE_TOKENS, layout.clone());
    let (sockets, peers) = common::mesh_sockets(2);
    cfg.peers = peers;
    cfg.mesh_socket = sockets.first().cloned();
    cfg.token = Some(Secret::new(SECRET));
    cfg.connect_timeout = Duration::from_secs(5);
    let buf = HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
    let err = match PrefillEngine::start(cfg, Pool::Owned(buf)).await {
        Ok(_) => panic!("a rank started against a listener that is no decode"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("dialed a decode at this address, found a prefill"),
        "{err}"
    );
    let theirs = bounded(server).await.unwrap();
    assert!(
        matches!(
            theirs,
            Err(control::ControlError::PeerRejected {
                reason: control::RejectReason::RoleMismatch(_),
                ..
            })
        ),
        "{theirs:?}"
    );
    d.shutdown(BOUND).await;
}

/// A decode whose undecided allocations name `PAGES_PER_DECODE_POOL` times its pool's pages gets
/// the next one refused, with a typed reason and a count, while another decode the rank serves
/// goes on; once one of its requests is decided, its next allocation is taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_decodes_undecided_allocations_are_bounded_by_its_pool_and_others_go_on() {
    use transfer_engine::engine::PAGES_PER_DECODE_POOL;
    // Every allocation names the same four pages, as a decode that reuses them before this rank
    // decided would.
    let cap = u64::from(PAGES) * PAGES_PER_DECODE_POOL / 4;
    one_decode_is_capped(
        PrefillLimits::default(),
        &[0, 1, 2, 3],
        cap,
        "times its pool",
    )
    .await;
}

/// As above, for the cap on one decode's undecided requests (3 here), well within the page cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_decodes_undecided_requests_are_bounded_in_number_and_others_go_on() {
    let limits = PrefillLimits {
        requests_per_decode: 3,
        ..PrefillLimits::default()
    };
    one_decode_is_capped(limits, &[0, 1, 2, 3], 3, "undecided requests here already").await;
}

/// A decode sends `cap` allocations of `pages`, each handed out; the next is refused with a
/// reason that says `why`, and counted, while another decode is served by the same rank; once one
/// of the first decode's requests is decided, its next allocation is taken.
async fn one_decode_is_capped(limits: PrefillLimits, pages: &[u32], cap: u64, why: &str) {
    let d = decode().await;
    let (mut conn, p) = rogue_decode_limited(&d, PAGES, limits).await;
    for id in 1..=cap {
        conn.send(&allocation(id, PROMPT, CHUNK, pages.to_vec()))
            .await
            .unwrap();
        assert_eq!(bounded(p.next_request()).await.unwrap().request.0, id);
    }
    conn.send(&allocation(cap + 1, PROMPT, CHUNK, pages.to_vec()))
        .await
        .unwrap();
    match next_answer(&mut conn).await {
        Msg::TransferReject(r) => {
            assert_eq!(r.request, cap + 1, "{r:?}");
            assert!(r.reason.to_string().contains(why), "{r:?}");
        }
        m => panic!("{m:?}"),
    }
    assert_eq!(p.stats().rejected_requests, 1, "{:?}", p.stats());
    // Another decode is served by the same rank meanwhile, every byte landed.
    let d2 = decode().await;
    bounded(p.add_decode(d2.local_addr())).await.unwrap();
    bounded(d2.wait_for_ranks(BOUND)).await.unwrap();
    serve_one(&d2, &p, RequestId(500)).await;
    // One of the first decode's requests is decided: its share is free again.
    p.fail(RequestId(1), transfer_engine::core::FailureCode::Aborted);
    bounded(p.decided(RequestId(1))).await;
    conn.send(&allocation(cap + 2, PROMPT, CHUNK, pages.to_vec()))
        .await
        .unwrap();
    assert_eq!(bounded(p.next_request()).await.unwrap().request.0, cap + 2);
    assert_eq!(p.stats().rejected_requests, 1, "{:?}", p.stats());
    drop((conn, p));
    d.shutdown(BOUND).await;
    d2.shutdown(BOUND).await;
}

/// A caller that does not read `next_request`: past `PrefillLimits::unread` (2 here) waiting
/// there, a ready allocation is not queued but counted, and its request is forgotten once decided
/// (nobody would release it); once the caller reads, allocations are queued again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocations_past_the_unread_bound_are_counted_and_forgotten_once_decided() {
    let d = decode().await;
    let limits = PrefillLimits {
        unread: 2,
        ..PrefillLimits::default()
    };
    let (mut conn, p) = rogue_decode_limited(&d, PAGES, limits).await;
    for id in 1..=3 {
        conn.send(&allocation(id, PROMPT, CHUNK, vec![0, 1, 2, 3]))
            .await
            .unwrap();
    }
    let s = until_prefill(&p, "the third allocation dropped", |s| {
        s.unread_dropped == 1
    })
    .await;
    assert_eq!(s.requests, 3, "{s:?}");
    // Decode aborts the third: decided, and forgotten, since the caller never had it.
    abort_all(&mut conn, 3..=3).await;
    until_prefill(&p, "the third forgotten", |s| s.requests == 2).await;
    assert_eq!(bounded(p.next_request()).await.unwrap().request.0, 1);
    assert_eq!(bounded(p.next_request()).await.unwrap().request.0, 2);
    // Read: the next is queued.
    conn.send(&allocation(4, PROMPT, CHUNK, vec![0, 1, 2, 3]))
        .await
        .unwrap();
    assert_eq!(bounded(p.next_request()).await.unwrap().request.0, 4);
    assert_eq!(p.stats().unread_dropped, 1, "{:?}", p.stats());
    drop((conn, p));
    d.shutdown(BOUND).await;
}

/// Both sides refuse a heartbeat interval of 0 (a writer's interval timer cannot run at 0;
/// `None` sends none) or longer than a Hello can announce, at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_of_zero_or_past_what_a_hello_carries_are_refused_at_start() {
    let d = decode().await;
    for beat in [
        Duration::ZERO,
        Duration::from_millis(u64::from(u32::MAX) + 1),
    ] {
        let e = prefill_start(d.local_addr(), Some(beat), None).await;
        assert!(matches!(e, Err(EngineError::Config(_))), "{beat:?}: {e:?}");
        let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout(), 1);
        cfg.heartbeat = Some(beat);
        let b = HostBuffer::new(layout().buffer_len as usize, HostOptions::default()).unwrap();
        let e = DecodeEngine::start(cfg, Pool::Owned(b)).await;
        assert!(matches!(e, Err(EngineError::Config(_))), "{beat:?}: {e:?}");
    }
    d.shutdown(BOUND).await;
}

/// A rank refuses limits of 0, and a request cap its counters cannot hold, at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_limits_out_of_range_are_refused_at_start() {
    let d = decode().await;
    for limits in [
        PrefillLimits {
            requests_per_decode: 0,
            ..PrefillLimits::default()
        },
        PrefillLimits {
            pages_per_decode_pool: 0,
            ..PrefillLimits::default()
        },
        PrefillLimits {
            unread: 0,
            ..PrefillLimits::default()
        },
        PrefillLimits {
            requests_per_decode: u32::MAX as usize + 1,
            ..PrefillLimits::default()
        },
    ] {
        let e = prefill_limited(d.local_addr(), None, None, PAGES, limits).await;
        assert!(
            matches!(e, Err(EngineError::Config(_))),
            "{limits:?}: {e:?}"
        );
    }
    d.shutdown(BOUND).await;
}

/// A decode that keeps sending (its heartbeats) but reads nothing, while the rank has more for it
/// than the socket's buffers hold (aux payloads of its request): the rank cuts the connection (a
/// message not taken within three of decode's heartbeat intervals; the test waits up to its bound)
/// and counts it, and what it queues for that decode is refused from then on instead of piling up
/// without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_that_reads_nothing_is_cut_and_counted() {
    // 16 MiB: more than loopback's socket buffers take.
    a_decode_that_does_not_keep_up_is_cut(0, 64 << 10, 256).await;
}

/// As above, for a decode that reads 100 messages of 4 KiB every 100 ms, about 4 MB/s, while the
/// rank queues 64 MiB for it: each send is taken within a few reads, but what waits behind it grows
/// older, and the rank cuts the connection once a message has waited past the bound (draining it
/// all at that pace would take longer than the test's bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_that_reads_more_slowly_than_the_rank_sends_is_cut_and_counted() {
    a_decode_that_does_not_keep_up_is_cut(100, 4 << 10, 16 << 10).await;
}

/// A decode (heartbeats at 500 ms) that reads `reads` messages every 100 ms while the rank queues
/// `count` aux payloads of `len` bytes for it: cut, counted, and refused after.
async fn a_decode_that_does_not_keep_up_is_cut(reads: usize, len: usize, count: usize) {
    let d = decode_with(Some(Duration::from_millis(500))).await;
    let (mut conn, p) = rogue_decode(&d, PAGES).await;
    let r = RequestId(61);
    conn.send(&allocation(r.0, PROMPT, CHUNK, vec![0, 1, 2, 3]))
        .await
        .unwrap();
    assert_eq!(bounded(p.next_request()).await.unwrap().request, r);
    for _ in 0..count {
        // Refused once the rank cut the connection (a loaded machine may stall this loop).
        if p.send_aux(r, vec![0xA5; len]).is_err() {
            break;
        }
    }
    let until = tokio::time::Instant::now() + BOUND;
    while p.stats().stalled_connections == 0 {
        assert!(tokio::time::Instant::now() < until, "{:?}", p.stats());
        // Never silent.
        let _ = conn.send(&Msg::Heartbeat).await;
        for _ in 0..reads {
            let _ = tokio::time::timeout(Duration::from_millis(1), conn.recv()).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let s = until_prefill(&p, "the decode gone", |s| s.decodes == 0).await;
    assert_eq!(s.stalled_connections, 1, "{s:?}");
    // Refused because its connection is gone (the request itself is still the caller's).
    assert!(
        matches!(p.send_aux(r, vec![0xA5; len]), Err(EngineError::Shutdown)),
        "{:?}",
        p.stats()
    );
    drop((conn, p));
    d.shutdown(BOUND).await;
}

/// Waits (bounded) until `f` holds of the prefill rank's stats, and returns them.
async fn until_prefill(
    p: &PrefillEngine,
    what: &str,
    f: impl Fn(&transfer_engine::engine::PrefillStats) -> bool,
) -> transfer_engine::engine::PrefillStats {
    let until = tokio::time::Instant::now() + BOUND;
    loop {
        let s = p.stats();
        if f(&s) {
            return s;
        }
        assert!(tokio::time::Instant::now() < until, "never {what}: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A request that failed on the prefill rank and was released there, then decode's own abort of
/// it (decode aborts every request that fails, whatever failed it): the abort of a request the
/// rank no longer holds finds it decided, and is not counted against the decode as an undecided
/// vote (each such echo once stayed counted for good, until the decode's aborts were refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decodes_abort_of_a_request_failed_and_released_here_is_not_counted_as_undecided() {
    let d = decode().await;
    let (mut conn, p) = rogue_decode(&d, PAGES).await;
    let r = RequestId(41);
    conn.send(&allocation(r.0, PROMPT, CHUNK, vec![0, 1, 2, 3]))
        .await
        .unwrap();
    assert_eq!(bounded(p.next_request()).await.unwrap().request, r);
    p.fail(r, transfer_engine::core::FailureCode::Aborted);
    assert!(matches!(
        bounded(p.decided(r)).await,
        transfer_engine::core::vote::Decision::Failed { .. }
    ));
    p.release(r);
    abort_all(&mut conn, r.0..=r.0).await;
    // The ack goes out before the vote is cast: the vote has a moment.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let s = p.stats();
    assert_eq!(s.unknown_aborts, 0, "{s:?}");
    assert_eq!(s.requests, 0, "{s:?}");
    drop((conn, p));
    d.shutdown(BOUND).await;
}

/// Rank 0 of a pipeline of two whose other rank hears no abort: its failed votes for requests it
/// never held stay undecided (until the vote deadline), so one decode gets only
/// `MAX_UNKNOWN_ABORTS` of them outstanding; the aborts beyond are answered, counted and cast no
/// vote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_decode_gets_a_bounded_number_of_votes_for_requests_a_rank_never_held() {
    use transfer_engine::engine::MAX_UNKNOWN_ABORTS;
    let d = decode().await;
    let (sockets, peers) = common::mesh_sockets(2);
    let (mut conns, ranks) = rogue_decode_of(&d, move |addr| {
        (0..2u16)
            .map(|rank| {
                let (layout, buf) =
                    common::patterned_rank(LAYERS, 2, rank, PAGE_BYTES, PAGES, |_, _, _| 1);
                let mut cfg = PrefillConfig::new(addr, rank, 2, LAYERS, PAGE_TOKENS, layout);
                cfg.engine_id = format!("pipeline-{rank}");
                cfg.peers = peers.clone();
                cfg.mesh_socket = sockets.get(usize::from(rank)).cloned();
                cfg.token = Some(Secret::new(SECRET));
                cfg.connect_timeout = Duration::from_secs(5);
                PrefillEngine::start(cfg, Pool::Owned(buf))
            })
            .collect()
    })
    .await;
    // Only rank 0 hears the aborts: rank 1 never votes on them.
    let (conn, p) = (&mut conns[0], &ranks[0]);
    let extra = 10;
    abort_all(conn, 1..=(MAX_UNKNOWN_ABORTS + extra) as u64).await;
    until_prefill(p, "the aborts beyond refused", |s| {
        s.refused == extra as u64
    })
    .await;
    let s = until_prefill(p, "the votes cast", |s| {
        s.unknown_aborts == MAX_UNKNOWN_ABORTS as u64
    })
    .await;
    assert_eq!(s.undecided, MAX_UNKNOWN_ABORTS as u64, "{s:?}");
    assert_eq!(s.refused, extra as u64, "{s:?}");
    drop((conns, ranks));
    d.shutdown(BOUND).await;
}

/// An allocation whose prompt needs more pages than the prefill rank's pool holds is refused when
/// it comes (decode's pool is larger here), not taken and failed later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocation_larger_than_the_ranks_pool_is_refused_at_once() {
    let d = decode().await;
    let (mut conn, p) = rogue_decode(&d, 4).await;
    // 8 pages of 16 tokens; the rank holds 4.
    conn.send(&allocation(77, 8 * PAGE_TOKENS, 1, (0..8).collect()))
        .await
        .unwrap();
    match next_answer(&mut conn).await {
        Msg::TransferReject(r) => {
            assert_eq!(r.request, 77, "{r:?}");
            assert!(r.reason.to_string().contains("pool"), "{r:?}");
        }
        m => panic!("{m:?}"),
    }
    assert_eq!(p.stats().requests, 0, "{:?}", p.stats());
    assert_eq!(p.stats().rejected_requests, 1, "{:?}", p.stats());
    drop((conn, p));
    d.shutdown(BOUND).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_reset_before_they_are_set_up_do_not_stall_the_listener() {
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout(), 1);
    cfg.token = Some(Secret::new(SECRET));
    let mut b = HostBuffer::new(layout().buffer_len as usize, HostOptions::default()).unwrap();
    b.as_mut_slice().fill(POISON);
    let d = DecodeEngine::start(cfg, Pool::Owned(b)).await.unwrap();
    // Clients that connect and reset at once (RST: linger 0), in bursts: those the listener
    // accepts after the reset cannot be set up (their peer address is gone).
    let addr = d.local_addr();
    let until = tokio::time::Instant::now() + BOUND;
    while d.stats().refused_connections < 8 {
        assert!(tokio::time::Instant::now() < until, "{:?}", d.stats());
        tokio::task::spawn_blocking(move || {
            for _ in 0..200 {
                let s = std::net::TcpStream::connect(addr).unwrap();
                socket2::SockRef::from(&s)
                    .set_linger(Some(Duration::ZERO))
                    .unwrap();
            }
        })
        .await
        .unwrap();
    }
    // The listener took each as that connection's failure, not its own: a real rank's handshake
    // right after is not held back by pauses (eight in a row paused 2.5 s).
    let _p = served_within(&d, Duration::from_millis(1500), RequestId(12)).await;
    d.shutdown(BOUND).await;
}

/// Silent clients hold every handshake place for longer than the test, the oldest from the rank's
/// own address and the rest from another: the rank still gets a place at once, the oldest of the
/// address holding the most (not the oldest of all), and is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_from_one_address_do_not_keep_a_rank_from_another_out() {
    use transfer_engine::engine::MAX_PENDING_HANDSHAKES;
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout(), 1);
    cfg.token = Some(Secret::new(SECRET));
    cfg.handshake_timeout = Duration::from_secs(120);
    let mut b = HostBuffer::new(layout().buffer_len as usize, HostOptions::default()).unwrap();
    b.as_mut_slice().fill(POISON);
    let d = DecodeEngine::start(cfg, Pool::Owned(b)).await.unwrap();
    // One from 127.0.0.1, the rank's address, then the rest from 127.0.0.2 (loopback answers the
    // whole of 127/8).
    let mut silent = Vec::new();
    for i in 0..MAX_PENDING_HANDSHAKES {
        let from: SocketAddr = if i == 0 { "127.0.0.1:0" } else { "127.0.0.2:0" }
            .parse()
            .unwrap();
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(from).unwrap();
        silent.push(bounded(socket.connect(d.local_addr())).await.unwrap());
    }
    // Each has its place once decode's first handshake message reaches it.
    for s in &mut silent {
        let mut buf = [0u8; 4096];
        assert!(bounded(s.read(&mut buf)).await.unwrap() > 0);
    }
    assert_eq!(d.stats().refused_connections, 0, "{:?}", d.stats());
    let _p = served_within(&d, Duration::from_secs(5), RequestId(13)).await;
    // 127.0.0.2's oldest gave way, and only it: the oldest of all, from 127.0.0.1, is still open.
    assert_eq!(d.stats().refused_connections, 1, "{:?}", d.stats());
    let mut buf = [0u8; 4096];
    loop {
        match bounded(silent[1].read(&mut buf)).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {} // the rest of our challenge
        }
    }
    let open = tokio::time::timeout(Duration::from_millis(300), silent[0].read(&mut buf)).await;
    assert!(open.is_err(), "{open:?}");
    d.shutdown(BOUND).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_handshake_bound_are_closed_and_the_engine_serves_afterwards() {
    use transfer_engine::engine::MAX_PENDING_HANDSHAKES;
    let mut cfg = DecodeConfig::new(LAYERS, PAGE_TOKENS, layout(), 1);
    cfg.token = Some(Secret::new(SECRET));
    cfg.handshake_timeout = Duration::from_secs(1);
    let mut b = HostBuffer::new(layout().buffer_len as usize, HostOptions::default()).unwrap();
    b.as_mut_slice().fill(POISON);
    let d = DecodeEngine::start(cfg, Pool::Owned(b)).await.unwrap();
    // Clients that connect and never say a word, more than the bound.
    let extra = 16;
    let mut silent = Vec::new();
    for _ in 0..MAX_PENDING_HANDSHAKES + extra {
        silent.push(TcpStream::connect(d.local_addr()).await.unwrap());
    }
    let until = tokio::time::Instant::now() + BOUND;
    while d.stats().refused_connections < extra as u64 {
        assert!(tokio::time::Instant::now() < until, "{:?}", d.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Every one ends: the oldest as newer ones took their places, the others at their handshake's
    // deadline.
    for s in &mut silent {
        let mut buf = [0u8; 4096];
        loop {
            match bounded(s.read(&mut buf)).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {} // our challenge
            }
        }
    }
    assert_eq!(
        d.stats().refused_connections,
        extra as u64,
        "{:?}",
        d.stats()
    );
    // A real rank is served once they are gone.
    let _p = served_within(&d, BOUND, RequestId(11)).await;
    d.shutdown(BOUND).await;
}
