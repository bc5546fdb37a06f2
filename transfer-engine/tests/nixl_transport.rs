//! The NIXL backend on its own, over real NIXL and its UCX plugin on loopback (never skipped): a
//! chunk's writes land before its notification, notifications carry our bytes unchanged and the
//! sender's agent name, deregistration waits for in-flight writes, bad writes and bad metadata are
//! refused with typed errors, counters return to their baseline, and a UCX transport and a NIXL
//! transport share one UCX library in one process.
#![allow(clippy::unwrap_used)]

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use transfer_engine::mem::{HostBuffer, HostOptions, Pool};
use transfer_engine::transport::nixl::{NixlConfig, NixlTransport, STAGING_BYTES};
use transfer_engine::transport::ucx::{self, UcxConfig, UcxTransport};
use transfer_engine::transport::{
    BackendKind, Done, Incoming, PeerId, Registration, Sender, Sink, Transport, TransportError,
    TransportStats, WriteOp,
};

const BOUND: Duration = Duration::from_secs(10);

/// What a receiver's sink saw: sender, bytes, whether the expected bytes were in place then, and when
/// it arrived.
type Seen = Arc<Mutex<Vec<(Sender, Vec<u8>, bool, Instant)>>>;
/// The destination a sink checks when a notification arrives, and the byte every one of it must be.
/// Cleared before the registration goes: the sink's copy would otherwise keep the receiving
/// transport alive through the registration's handle on it.
type Expect = Arc<Mutex<Option<(Arc<Registration>, u8)>>>;

/// Whether every byte is `val` (slice comparisons, which stay fast in debug builds).
fn all_eq(b: &[u8], val: u8) -> bool {
    let block = [val; 4096];
    b.chunks(block.len()).all(|c| c == &block[..c.len()])
}

/// Whether every byte of the registration is `val`, read by copies (peers write into it).
fn all_bytes(reg: &Registration, val: u8) -> bool {
    let len = reg.desc().map_or(0, |d| d.len());
    let mut ok = true;
    reg.read_pieces(0, len, |p| ok &= all_eq(p, val)).unwrap();
    ok
}

fn host(len: usize) -> Pool {
    Pool::Owned(HostBuffer::new(len, HostOptions::default()).unwrap())
}

fn prefaulted(len: usize) -> Pool {
    let opts = HostOptions {
        prefault: true,
        ..Default::default()
    };
    Pool::Owned(HostBuffer::new(len, opts).unwrap())
}

fn nixl(name: &str, sink: Sink) -> Arc<NixlTransport> {
    Arc::new(NixlTransport::new(config(name), sink).unwrap())
}

/// The trait object a [`Registration`] holds.
fn dynamic<T: Transport>(t: &Arc<T>) -> Arc<dyn Transport> {
    t.clone()
}

fn config(name: &str) -> NixlConfig {
    NixlConfig {
        name: format!("{name}-{}", std::process::id()),
        ..NixlConfig::default()
    }
}

/// A sink recording each notification and whether the bytes were already in place when it arrived.
fn recording_sink(expect: Expect) -> (Sink, Seen) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let sink: Sink = Arc::new(move |ev| {
        if let Incoming::Notification { sender, bytes } = ev {
            let at = Instant::now();
            // The check the engine relies on: when the notification is here, so are the bytes.
            let ok = expect
                .lock()
                .unwrap()
                .as_ref()
                .is_some_and(|(reg, val)| all_bytes(reg, *val));
            s.lock().unwrap().push((sender, bytes.to_vec(), ok, at));
        }
    });
    (sink, seen)
}

fn receiver(name: &str, expect: Expect) -> (Arc<NixlTransport>, Seen) {
    let (sink, seen) = recording_sink(expect);
    (nixl(name, sink), seen)
}

fn noop_sink() -> Sink {
    Arc::new(|_| {})
}

fn wait_done() -> (Done, mpsc::Receiver<Result<(), TransportError>>) {
    let (tx, rx) = mpsc::channel();
    (Box::new(move |r| tx.send(r).unwrap()), rx)
}

/// Polls `cond` until it holds, failing the test after [`BOUND`].
#[track_caller]
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + BOUND;
    while !cond() {
        assert!(Instant::now() < deadline, "{what} not within {BOUND:?}");
        std::thread::yield_now();
    }
}

fn post_and_wait(
    t: &dyn Transport,
    peer: PeerId,
    writes: Vec<WriteOp>,
    notification: Vec<u8>,
) -> Result<(), TransportError> {
    let (done, rx) = wait_done();
    t.post(peer, writes, notification, done);
    rx.recv_timeout(BOUND).expect("done not called")
}

fn mib_writes(src: transfer_engine::transport::RegionId, count: u64) -> Vec<WriteOp> {
    (0..count)
        .map(|i| WriteOp {
            local: src,
            local_offset: i << 20,
            remote: 0,
            remote_offset: i << 20,
            len: 1 << 20,
            rows: 1,
            local_stride: 0,
            remote_stride: 0,
        })
        .collect()
}

#[test]
fn notification_follows_its_bytes_with_our_bytes_and_the_sender_name() {
    let len = 8 << 20;
    let expect: Expect = Arc::default();
    let (rx_t, seen) = receiver("follow-rx", expect.clone());
    let tx_t = nixl("follow-tx", noop_sink());
    assert_eq!(tx_t.kind(), BackendKind::Nixl);
    assert_eq!(tx_t.name(), config("follow-tx").name);
    let dst = Arc::new(Registration::new(&dynamic(&rx_t), host(len)).unwrap());
    let remote = dst.remote().clone();
    assert!(remote.rkey.is_empty());
    let dst_addr = dst.desc().unwrap().addr();
    assert_eq!((remote.addr, remote.len), (dst_addr, len as u64));
    let src = Registration::new(&dynamic(&tx_t), host(len)).unwrap();
    let src_id = src.id();
    // Metadata is fetched after the destination is registered: NIXL's metadata carries registrations.
    let peer = tx_t
        .connect(&rx_t.metadata().unwrap(), &[remote], 0)
        .unwrap();

    for round in 1..=3u8 {
        src.fill_at(0, len, round).unwrap();
        *expect.lock().unwrap() = Some((dst.clone(), round));
        // Eight writes of 1 MiB, scattered in reverse order, then the notification: raw bytes with a
        // NUL and no prefix of ours, as a Python NIXL peer must see them.
        let mut writes = mib_writes(src_id, 8);
        writes.reverse();
        let note = vec![b'k', round, 0, b'v', 0xff];
        post_and_wait(&*tx_t, peer, writes, note.clone()).unwrap();
        wait_until(&format!("notification {round}"), || {
            seen.lock().unwrap().len() >= round as usize
        });
        let (sender, bytes, in_place, _) = seen.lock().unwrap()[round as usize - 1].clone();
        assert_eq!(sender, Sender::Agent(tx_t.name()));
        assert_eq!(bytes, note);
        assert!(in_place, "notification {round} arrived before its bytes");
    }
    *expect.lock().unwrap() = None;
    assert!(all_bytes(&dst, 3));
    assert_eq!(tx_t.stats().in_flight, 0);
    assert_eq!(tx_t.stats().bytes_posted, 3 * len as u64);
    assert_eq!(rx_t.stats().notifications, 3);
    assert_eq!(seen.lock().unwrap().len(), 3, "one notification per chunk");
}

#[test]
fn notification_only_posts() {
    let (rx_t, seen) = receiver("notify-rx", Arc::default());
    let tx_t = nixl("notify-tx", noop_sink());
    let dst = Registration::new(&dynamic(&rx_t), host(1 << 16)).unwrap();
    let src = Registration::new(&dynamic(&tx_t), host(1 << 16)).unwrap();
    let src_id = src.id();
    let peer = tx_t
        .connect(&rx_t.metadata().unwrap(), &[dst.remote().clone()], 0)
        .unwrap();

    // No writes at all: the notification goes alone (gen_notif), before any connection exists.
    post_and_wait(&*tx_t, peer, vec![], b"only\0a note".to_vec()).unwrap();
    // Zero-length writes move nothing, so they too send just the notification.
    let empty = WriteOp {
        local: src_id,
        local_offset: 0,
        remote: 0,
        remote_offset: 0,
        len: 0,
        rows: 1,
        local_stride: 0,
        remote_stride: 0,
    };
    post_and_wait(&*tx_t, peer, vec![empty, empty], b"zero-length".to_vec()).unwrap();
    // Nothing to move and nothing to say: done at once, nothing sent.
    post_and_wait(&*tx_t, peer, vec![], vec![]).unwrap();
    post_and_wait(&*tx_t, peer, vec![], b"last".to_vec()).unwrap();

    wait_until("three notifications", || seen.lock().unwrap().len() >= 3);
    let got: Vec<(Sender, Vec<u8>)> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|(s, b, _, _)| (s.clone(), b.clone()))
        .collect();
    let me = Sender::Agent(tx_t.name());
    assert_eq!(
        got,
        vec![
            (me.clone(), b"only\0a note".to_vec()),
            (me.clone(), b"zero-length".to_vec()),
            (me, b"last".to_vec())
        ]
    );
    assert_eq!(tx_t.stats().bytes_posted, 0);
    assert_eq!(tx_t.stats().in_flight, 0);
    assert!(all_bytes(&dst, 0));
}

/// A write of many rows is one descriptor per row for NIXL, or, where the rows are contiguous at
/// the peer and strided here, one descriptor from staging memory the rows were copied into: each
/// row lands where its stride says, and nothing between the rows. With the default staging, with
/// staging too small for one of the writes (it goes row by row, the other through staging), and
/// with none.
#[test]
fn rows_land_at_their_strides() {
    for staging in [STAGING_BYTES, 64 << 10, 0] {
        rows_land_with_staging(staging);
    }
}

fn rows_land_with_staging(staging_bytes: u64) {
    let len: usize = 1 << 20;
    let (rx_t, _seen) = receiver(&format!("rows-rx-{staging_bytes}"), Arc::default());
    let tx_t = Arc::new(
        NixlTransport::new(
            NixlConfig {
                staging_bytes,
                ..config(&format!("rows-tx-{staging_bytes}"))
            },
            noop_sink(),
        )
        .unwrap(),
    );
    let dst = Registration::new(&dynamic(&rx_t), host(len)).unwrap();
    dst.fill_at(0, len, 0xEE).unwrap();
    let src = Registration::new(&dynamic(&tx_t), host(len)).unwrap();
    let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
    src.write_at(0, &pattern).unwrap();
    let peer = tx_t
        .connect(&rx_t.metadata().unwrap(), &[dst.remote().clone()], 0)
        .unwrap();
    // (source offset, source stride, destination offset, destination stride, row length, rows);
    // the first and the last two are contiguous at the destination (staged: 28,800, 40,000 and
    // 204,800 bytes; in 64 KiB of staging only the first fits).
    let shapes: [(u64, u64, u64, u64, u64, u64); 5] = [
        (64, 256, 0, 96, 96, 300),
        (40_000, 80, 100_001, 512, 80, 200),
        (200_000, 1000, 300_003, 700, 333, 128),
        (430_000, 300, 400_000, 100, 100, 400),
        (520_000, 2048, 760_000, 1024, 1024, 200),
    ];
    let writes = shapes
        .iter()
        .map(|&(s, ss, d, ds, n, rows)| WriteOp {
            local: src.id(),
            local_offset: s,
            remote: 0,
            remote_offset: d,
            len: n,
            rows,
            local_stride: ss,
            remote_stride: ds,
        })
        .collect();
    post_and_wait(&*tx_t, peer, writes, b"rows".to_vec()).unwrap();
    let mut want = vec![0xEEu8; len];
    for &(s, ss, d, ds, n, rows) in &shapes {
        for i in 0..rows {
            let (s, d, n) = ((s + i * ss) as usize, (d + i * ds) as usize, n as usize);
            want[d..d + n].copy_from_slice(&pattern[s..s + n]);
        }
    }
    let mut back = vec![0u8; len];
    dst.read_at(0, &mut back).unwrap();
    let first_bad = back.iter().zip(&want).position(|(a, b)| a != b);
    assert_eq!(
        first_bad, None,
        "staging {staging_bytes}: wrong byte at this offset"
    );
    let moved: u64 = shapes.iter().map(|s| s.4 * s.5).sum();
    assert_eq!(tx_t.stats().bytes_posted, moved);
    // The rows that went through staging: all three writes contiguous at the destination, the
    // first alone, or none.
    let staged = match staging_bytes {
        0 => 0,
        b if b < 100_000 => 28_800,
        _ => 28_800 + 40_000 + 204_800,
    };
    assert_eq!(tx_t.stats().staged_bytes, staged, "staging {staging_bytes}");
}

#[test]
fn bad_writes_are_refused_before_posting() {
    let (rx_t, seen) = receiver("bad-rx", Arc::default());
    let tx_t = nixl("bad-tx", noop_sink());
    let dst = Registration::new(&dynamic(&rx_t), host(1 << 16)).unwrap();
    let src = Registration::new(&dynamic(&tx_t), host(1 << 16)).unwrap();
    let src_id = src.id();
    let peer = tx_t
        .connect(&rx_t.metadata().unwrap(), &[dst.remote().clone()], 0)
        .unwrap();
    let good = WriteOp {
        local: src_id,
        local_offset: 0,
        remote: 0,
        remote_offset: 0,
        len: 16,
        rows: 1,
        local_stride: 0,
        remote_stride: 0,
    };
    let bad = [
        WriteOp {
            local_offset: 1 << 16,
            len: 1,
            ..good
        },
        WriteOp {
            remote_offset: (1 << 16) - 1,
            len: 2,
            ..good
        },
        WriteOp {
            remote: 1,
            len: 1,
            ..good
        },
        WriteOp {
            local_offset: u64::MAX,
            len: 2,
            ..good
        },
        WriteOp {
            remote_offset: u64::MAX,
            len: 2,
            ..good
        },
    ];
    for w in bad {
        // A good write ahead of the bad one must not go out either.
        let res = post_and_wait(&*tx_t, peer, vec![good, w], vec![1]);
        assert!(
            matches!(res, Err(TransportError::OutOfBounds(_))),
            "{w:?}: {res:?}"
        );
    }
    let unknown = transfer_engine::transport::RegionId(9999);
    let res = post_and_wait(
        &*tx_t,
        peer,
        vec![WriteOp {
            local: unknown,
            ..good
        }],
        vec![1],
    );
    assert_eq!(res, Err(TransportError::UnknownRegion(unknown)));
    let res = post_and_wait(&*tx_t, PeerId(9999), vec![good], vec![1]);
    assert_eq!(res, Err(TransportError::UnknownPeer(PeerId(9999))));
    assert_eq!(tx_t.stats().bytes_posted, 0);
    assert_eq!(tx_t.stats().in_flight, 0);

    // A marker sent after the refused posts arrives alone: none of them sent anything.
    post_and_wait(&*tx_t, peer, vec![], b"marker".to_vec()).unwrap();
    wait_until("the marker", || !seen.lock().unwrap().is_empty());
    let got: Vec<Vec<u8>> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|(_, b, _, _)| b.clone())
        .collect();
    assert_eq!(
        got,
        vec![b"marker".to_vec()],
        "a refused post still sent its notification"
    );
    assert!(all_bytes(&dst, 0), "a refused post still wrote");
}

#[test]
fn garbage_metadata_is_a_typed_error() {
    let (rx_t, _) = receiver("garbage-rx", Arc::default());
    let tx_t = nixl("garbage-tx", noop_sink());
    let res = tx_t.connect(b"this is not NIXL metadata", &[], 0);
    assert!(
        matches!(res, Err(TransportError::BadMetadata(_))),
        "{res:?}"
    );
    let res = tx_t.connect(b"", &[], 0);
    assert!(
        matches!(res, Err(TransportError::BadMetadata(_))),
        "{res:?}"
    );

    // Metadata fetched before the region was registered does not cover it: refused at connect, not at
    // the first write.
    let early = rx_t.metadata().unwrap();
    let dst = Registration::new(&dynamic(&rx_t), host(1 << 16)).unwrap();
    let remote = dst.remote().clone();
    let res = tx_t.connect(&early, std::slice::from_ref(&remote), 0);
    assert!(
        matches!(res, Err(TransportError::BadMetadata(_))),
        "{res:?}"
    );
    // Fresh metadata covers it, but not a region the peer never registered.
    let fresh = rx_t.metadata().unwrap();
    let mut beyond = remote.clone();
    beyond.len += 1;
    let res = tx_t.connect(&fresh, &[remote.clone(), beyond], 0);
    assert!(
        matches!(res, Err(TransportError::BadMetadata(_))),
        "{res:?}"
    );
    assert_eq!(tx_t.stats().peers, 0);
    let peer = tx_t.connect(&fresh, &[remote], 0).unwrap();
    assert_eq!(tx_t.stats().peers, 1);
    tx_t.disconnect(peer);
    wait_until("disconnect", || tx_t.stats().peers == 0);
    let res = post_and_wait(&*tx_t, peer, vec![], b"x".to_vec());
    assert_eq!(res, Err(TransportError::UnknownPeer(peer)));
    // SAFETY: the only peer given `dst`'s registration, `tx_t`, disconnected with nothing posted.
    unsafe { dst.assume_quiesced() };
    dst.into_inner().unwrap();
}

#[test]
fn deregistration_waits_for_in_flight_writes_and_counters_return_to_baseline() {
    let len = 64 << 20;
    let (rx_t, seen) = receiver("dereg-rx", Arc::default());
    let tx_t = nixl("dereg-tx", noop_sink());
    let baseline = TransportStats::default();
    assert_eq!(tx_t.stats(), baseline);
    let dst = Registration::new(&dynamic(&rx_t), host(len)).unwrap();
    let remote = dst.remote().clone();
    let src = Registration::new(&dynamic(&tx_t), host(len)).unwrap();
    let src_id = src.id();
    assert_eq!(tx_t.stats().registered_bytes, len as u64);
    assert_eq!(tx_t.stats().regions, 1);
    let peer = tx_t
        .connect(&rx_t.metadata().unwrap(), &[remote], 0)
        .unwrap();
    let mut rxs = Vec::new();
    for i in 0..4u8 {
        let (done, rx) = wait_done();
        let w = WriteOp {
            local: src_id,
            local_offset: 0,
            remote: 0,
            remote_offset: 0,
            len: len as u64,
            rows: 1,
            local_stride: 0,
            remote_stride: 0,
        };
        tx_t.post(peer, vec![w], vec![i], done);
        rxs.push(rx);
    }
    // Returns only once the writes from it are over, and their Done callbacks ran first
    // (`into_inner` is the transport's deregister, then hands the memory back).
    let _src = src.into_inner().unwrap();
    for rx in rxs {
        rx.try_recv()
            .expect("deregister returned before a write from it was over")
            .unwrap();
    }
    // SAFETY: `src_id` was deregistered above (`into_inner`): the call only looks it up.
    let again = unsafe { tx_t.deregister(src_id) };
    assert!(matches!(again, Err(TransportError::UnknownRegion(_))));
    wait_until("four notifications", || seen.lock().unwrap().len() == 4);
    tx_t.disconnect(peer);
    // SAFETY: the only peer given `dst`'s registration, `tx_t`, disconnected and its four posts
    // are over (their notifications arrived, and notifications follow their writes).
    unsafe { dst.assume_quiesced() };
    let _dst = dst.into_inner().unwrap();
    wait_until("disconnect", || tx_t.stats().peers == 0);
    let after = TransportStats {
        bytes_posted: 0,
        ..tx_t.stats()
    };
    assert_eq!(after, baseline);
    assert_eq!(tx_t.stats().bytes_posted, 4 * len as u64);
    assert_eq!(
        TransportStats {
            notifications: 0,
            ..rx_t.stats()
        },
        baseline
    );
    assert_eq!(rx_t.stats().notifications, 4);
}

#[test]
fn a_failed_peer_is_reported_once_and_refused_after() {
    let len = 1 << 20;
    let failures = Arc::new(Mutex::new(Vec::new()));
    let f = failures.clone();
    let sink: Sink = Arc::new(move |ev| {
        if let Incoming::PeerFailed { peer, reason } = ev {
            f.lock().unwrap().push((peer, reason));
        }
    });
    let (rx_t, _) = receiver("fail-rx", Arc::default());
    let tx_t = nixl("fail-tx", sink);
    let dst = Registration::new(&dynamic(&rx_t), host(len)).unwrap();
    let src = Registration::new(&dynamic(&tx_t), host(len)).unwrap();
    let src_id = src.id();
    let peer = tx_t
        .connect(&rx_t.metadata().unwrap(), &[dst.remote().clone()], 0)
        .unwrap();
    post_and_wait(&*tx_t, peer, mib_writes(src_id, 1), b"alive".to_vec()).unwrap();

    // The peer's agent goes away. Its memory stays: `dst` handed out its registration to `tx_t`,
    // which is never declared quiet, so dropping `dst` leaks the memory rather than freeing it under
    // a write.
    rx_t.shutdown();
    let deadline = Instant::now() + BOUND;
    let first = loop {
        match post_and_wait(&*tx_t, peer, mib_writes(src_id, 1), b"anyone?".to_vec()) {
            Ok(()) => assert!(
                Instant::now() < deadline,
                "posts to a dead peer keep succeeding"
            ),
            Err(e) => break e,
        }
    };
    assert!(matches!(first, TransportError::Library { .. }), "{first:?}");
    let res = post_and_wait(&*tx_t, peer, mib_writes(src_id, 1), b"again".to_vec());
    assert!(
        matches!(res, Err(TransportError::PeerFailed { peer: p, .. }) if p == peer),
        "{res:?}"
    );
    let res = post_and_wait(&*tx_t, peer, vec![], b"note".to_vec());
    assert!(
        matches!(res, Err(TransportError::PeerFailed { .. })),
        "{res:?}"
    );
    let failures = failures.lock().unwrap().clone();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].0, peer);
    assert_eq!(tx_t.stats().in_flight, 0);
    tx_t.disconnect(peer);
    wait_until("disconnect", || tx_t.stats().peers == 0);
}

/// Moves `len` bytes in 1 MiB writes plus one notification from `tx` to `rx`, `rounds` times; returns
/// the fastest round (post to notification seen).
fn move_bytes(
    tx: &Arc<dyn Transport>,
    rx: &Arc<dyn Transport>,
    seen: &Seen,
    expect: &Expect,
    len: usize,
    rounds: u8,
) -> Duration {
    let dst = Arc::new(Registration::new(rx, prefaulted(len)).unwrap());
    let src = Registration::new(tx, prefaulted(len)).unwrap();
    let src_id = src.id();
    let peer = tx
        .connect(&rx.metadata().unwrap(), &[dst.remote().clone()], 7)
        .unwrap();
    let mut best = Duration::MAX;
    for round in 1..=rounds {
        src.fill_at(0, len, round).unwrap();
        *expect.lock().unwrap() = Some((dst.clone(), round));
        let before = seen.lock().unwrap().len();
        let start = Instant::now();
        let (done, done_rx) = wait_done();
        tx.post(
            peer,
            mib_writes(src_id, (len >> 20) as u64),
            vec![round; 16],
            done,
        );
        wait_until("notification", || seen.lock().unwrap().len() > before);
        done_rx.recv_timeout(BOUND).unwrap().unwrap();
        let (_, bytes, in_place, at) = seen.lock().unwrap()[before].clone();
        best = best.min(at - start);
        assert_eq!(bytes, vec![round; 16]);
        assert!(
            in_place,
            "{:?}: notification {round} arrived before its bytes",
            tx.kind()
        );
    }
    *expect.lock().unwrap() = None;
    assert!(all_bytes(&dst, rounds));
    tx.disconnect(peer);
    src.into_inner().unwrap();
    let dst = Arc::into_inner(dst).unwrap();
    // SAFETY: the only peer given `dst`'s registration, `tx`, disconnected after every post ended.
    unsafe { dst.assume_quiesced() };
    dst.into_inner().unwrap();
    best
}

#[test]
fn ucx_and_nixl_transports_share_one_ucx_library() {
    const LEN: usize = 64 << 20;
    // UCX first, then NIXL's UCX plugin: NixlTransport::new itself refuses a second libucp.
    let ucx_expect: Expect = Arc::default();
    let (ucx_sink, ucx_seen) = recording_sink(ucx_expect.clone());
    let ucx_rx: Arc<dyn Transport> =
        Arc::new(UcxTransport::new(UcxConfig::default(), ucx_sink).unwrap());
    let ucx_tx: Arc<dyn Transport> =
        Arc::new(UcxTransport::new(UcxConfig::default(), noop_sink()).unwrap());
    let nixl_expect: Expect = Arc::default();
    let (nixl_rx, nixl_seen) = receiver("shared-rx", nixl_expect.clone());
    let nixl_tx = nixl("shared-tx", noop_sink());
    let (nixl_rx, nixl_tx) = (dynamic(&nixl_rx), dynamic(&nixl_tx));
    let libs = ucx::loaded_ucp_libraries();
    assert_eq!(libs.len(), 1, "{libs:?}");
    ucx::check_single_ucx().unwrap();

    // Interleaved, so both libraries' users are live at once.
    let ucx_time = move_bytes(&ucx_tx, &ucx_rx, &ucx_seen, &ucx_expect, LEN, 3);
    let nixl_time = move_bytes(&nixl_tx, &nixl_rx, &nixl_seen, &nixl_expect, LEN, 3);
    let ucx_again = move_bytes(&ucx_tx, &ucx_rx, &ucx_seen, &ucx_expect, 1 << 20, 1);
    assert!(ucx_again < BOUND);
    let gib_s = |d: Duration| LEN as f64 / d.as_secs_f64() / f64::from(1u32 << 30);
    println!(
        "64 MiB in 1 MiB writes + 1 notification, best of 3: UCX {:?} ({:.2} GiB/s), NIXL {:?} ({:.2} GiB/s)",
        ucx_time,
        gib_s(ucx_time),
        nixl_time,
        gib_s(nixl_time)
    );
    assert_eq!(
        nixl_seen.lock().unwrap()[0].0,
        Sender::Agent(nixl_tx.name())
    );
    assert_eq!(ucx_seen.lock().unwrap()[0].0, Sender::Key(7));
}

#[test]
fn two_peer_ids_for_one_agent_are_independent() {
    let (rx_t, seen) = receiver("twice-rx", Arc::default());
    let tx_t = nixl("twice-tx", noop_sink());
    let dst = Registration::new(&dynamic(&rx_t), host(2 << 20)).unwrap();
    let remote = dst.remote().clone();
    let src = Registration::new(&dynamic(&tx_t), host(2 << 20)).unwrap();
    src.fill_at(0, 2 << 20, 9).unwrap();
    let src_id = src.id();
    let md = rx_t.metadata().unwrap();
    let a = tx_t.connect(&md, std::slice::from_ref(&remote), 0).unwrap();
    let b = tx_t.connect(&md, &[remote], 0).unwrap();
    assert_ne!(a, b);
    assert_eq!(tx_t.stats().peers, 2);
    post_and_wait(&*tx_t, a, mib_writes(src_id, 1), b"a".to_vec()).unwrap();
    // Forgetting one id keeps the agent's metadata for the other.
    tx_t.disconnect(a);
    wait_until("disconnect", || tx_t.stats().peers == 1);
    let w = WriteOp {
        local: src_id,
        local_offset: 1 << 20,
        remote: 0,
        remote_offset: 1 << 20,
        len: 1 << 20,
        rows: 1,
        local_stride: 0,
        remote_stride: 0,
    };
    post_and_wait(&*tx_t, b, vec![w], b"b".to_vec()).unwrap();
    wait_until("two notifications", || seen.lock().unwrap().len() == 2);
    assert!(all_bytes(&dst, 9));
    tx_t.disconnect(b);
    wait_until("disconnect", || tx_t.stats().peers == 0);
}
