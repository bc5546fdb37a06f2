//! The UCX backend on its own, over real loopback UCX: a chunk's writes land before its notification,
//! deregistration waits for in-flight writes, and bad writes are refused before anything is posted.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;
use transfer_engine::mem::{HostBuffer, HostOptions, Pool};
use transfer_engine::transport::ucx::{UcxConfig, UcxTransport};
use transfer_engine::transport::{
    Done, Incoming, Registration, Sender, Sink, Transport, TransportError, WriteOp,
};

const BOUND: Duration = Duration::from_secs(10);

type Seen = Arc<Mutex<Vec<(Sender, Vec<u8>, bool)>>>;
/// The destination a sink checks when a notification arrives, and the byte every one of it must be.
/// Cleared before the registration is dropped: the sink's copy would otherwise keep the receiving
/// transport alive through the registration's handle on it.
type Expect = Arc<Mutex<Option<(Arc<Registration>, u8)>>>;

/// Whether every byte of the registration is `val`, read by copies (peers write into it).
fn all_bytes(reg: &Registration, val: u8) -> bool {
    let len = reg.desc().map_or(0, |d| d.len());
    let mut ok = true;
    reg.read_pieces(0, len, |p| ok &= p.iter().all(|&b| b == val))
        .unwrap();
    ok
}

fn transport(sink: Sink) -> Arc<dyn Transport> {
    Arc::new(UcxTransport::new(UcxConfig::default(), sink).unwrap())
}

fn host(len: usize) -> Pool {
    Pool::Owned(HostBuffer::new(len, HostOptions::default()).unwrap())
}

/// A receiving transport whose sink records each notification and whether the bytes were already
/// in place when it arrived.
fn receiver(dst: Expect) -> (Arc<dyn Transport>, Seen) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let sink: Sink = Arc::new(move |ev| {
        if let Incoming::Notification { sender, bytes } = ev {
            // The check the engine relies on: when the notification is here, so are the bytes.
            let ok = dst
                .lock()
                .unwrap()
                .as_ref()
                .is_some_and(|(reg, val)| all_bytes(reg, *val));
            s.lock().unwrap().push((sender, bytes.to_vec(), ok));
        }
    });
    (transport(sink), seen)
}

fn noop_sink() -> Sink {
    Arc::new(|_| {})
}

fn wait_done() -> (Done, std::sync::mpsc::Receiver<Result<(), TransportError>>) {
    let (tx, rx) = std::sync::mpsc::channel();
    (Box::new(move |r| tx.send(r).unwrap()), rx)
}

#[test]
fn notification_follows_its_bytes_through_puts() {
    notification_follows_its_bytes(false);
}

#[test]
fn notification_follows_its_bytes_through_direct_copies() {
    notification_follows_its_bytes(true);
}

/// Into private memory (UCX puts) or into memory UCX allocated (our own copies into its mapping).
fn notification_follows_its_bytes(shared: bool) {
    let len = 8 << 20;
    let expect: Expect = Arc::default();
    let (rx_t, seen) = receiver(expect.clone());
    let tx_t = transport(noop_sink());
    let pool = if shared {
        Pool::Shared(len as u64)
    } else {
        host(len)
    };
    let dst = Arc::new(Registration::new(&rx_t, pool).unwrap());
    let src = Registration::new(&tx_t, host(len)).unwrap();
    let src_id = src.id();
    let peer = tx_t
        .connect(&rx_t.metadata().unwrap(), &[dst.remote().clone()], 0xfeed)
        .unwrap();
    assert_eq!(tx_t.stats().direct_regions, u64::from(shared));

    for round in 1..=3u8 {
        src.fill_at(0, len, round).unwrap();
        *expect.lock().unwrap() = Some((dst.clone(), round));
        // Eight writes of 1 MiB, scattered in reverse order, then the notification.
        let writes: Vec<WriteOp> = (0..8u64)
            .rev()
            .map(|i| WriteOp {
                local: src_id,
                local_offset: i << 20,
                remote: 0,
                remote_offset: i << 20,
                len: 1 << 20,
                rows: 1,
                local_stride: 0,
                remote_stride: 0,
            })
            .collect();
        let (done, rx) = wait_done();
        tx_t.post(peer, writes, vec![round; 5], done);
        rx.recv_timeout(BOUND).unwrap().unwrap();
        let deadline = std::time::Instant::now() + BOUND;
        while seen.lock().unwrap().len() < round as usize {
            assert!(
                std::time::Instant::now() < deadline,
                "notification {round} not received"
            );
            std::thread::yield_now();
        }
        let (sender, bytes, in_place) = seen.lock().unwrap()[round as usize - 1].clone();
        assert_eq!(sender, Sender::Key(0xfeed));
        assert_eq!(bytes, vec![round; 5]);
        assert!(in_place, "notification {round} arrived before its bytes");
    }
    *expect.lock().unwrap() = None;
    assert!(all_bytes(&dst, 3));
    assert_eq!(tx_t.stats().in_flight, 0);
    assert_eq!(tx_t.stats().bytes_posted, 3 * len as u64);
    tx_t.disconnect(peer);
    let deadline = std::time::Instant::now() + BOUND;
    while tx_t.stats().direct_regions != 0 {
        assert!(std::time::Instant::now() < deadline, "mapping not released");
        std::thread::yield_now();
    }
    // SAFETY: the only peer given `dst`, `tx_t`, disconnected after its posts ended.
    unsafe { dst.assume_quiesced() };
}

/// Direct copies of every size class, at odd offsets: small plain copies, streaming copies with an
/// unaligned head and a tail, each landing exactly on its range of a poisoned destination.
#[test]
fn direct_copies_land_exactly_at_odd_offsets_and_lengths() {
    let len: usize = 4 << 20;
    let rx = transport(noop_sink());
    let tx = transport(noop_sink());
    let dst = Registration::new(&rx, Pool::Shared(len as u64)).unwrap();
    dst.fill_at(0, len, 0xEE).unwrap();
    let src = Registration::new(&tx, host(len)).unwrap();
    // Each source byte differs from its neighbours, so a shifted copy shows.
    let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
    src.write_at(0, &pattern).unwrap();
    let peer = tx
        .connect(&rx.metadata().unwrap(), &[dst.remote().clone()], 5)
        .unwrap();
    assert_eq!(tx.stats().direct_regions, 1, "UCX's memory was not mapped");
    // (source offset, destination offset, length)
    let pieces: [(u64, u64, u64); 6] = [
        (0, 0, 1),
        (3, 17, 4093),
        (1 << 20, (1 << 20) + 5, (16 << 10) - 1),
        ((2 << 20) + 1, (2 << 20) + 9, 16 << 10),
        (11, (3 << 20) + 3, 100_003),
        (64, 640 << 10, 64 << 10),
    ];
    let writes = pieces
        .iter()
        .map(|&(s, d, n)| WriteOp {
            local: src.id(),
            local_offset: s,
            remote: 0,
            remote_offset: d,
            len: n,
            rows: 1,
            local_stride: 0,
            remote_stride: 0,
        })
        .collect();
    let (done, got) = wait_done();
    tx.post(peer, writes, vec![1], done);
    got.recv_timeout(BOUND).unwrap().unwrap();
    let mut want = vec![0xEEu8; len];
    for &(s, d, n) in &pieces {
        let (s, d, n) = (s as usize, d as usize, n as usize);
        want[d..d + n].copy_from_slice(&pattern[s..s + n]);
    }
    let mut back = vec![0u8; len];
    dst.read_at(0, &mut back).unwrap();
    let first_bad = back.iter().zip(&want).position(|(a, b)| a != b);
    assert_eq!(first_bad, None, "wrong byte at this offset");
    tx.disconnect(peer);
    std::thread::sleep(Duration::from_millis(100));
    // SAFETY: the only peer given `dst`, `tx`, disconnected after its one post ended.
    unsafe { dst.assume_quiesced() };
}

#[test]
fn rows_land_at_their_strides_through_direct_copies() {
    rows_land_at_their_strides(true);
}

#[test]
fn rows_land_at_their_strides_through_puts() {
    rows_land_at_their_strides(false);
}

/// Writes of many rows (sliced heads in token-major pages are such writes) put each row where
/// its stride says, and nothing between the rows.
fn rows_land_at_their_strides(shared: bool) {
    let len: usize = 1 << 20;
    let rx = transport(noop_sink());
    let tx = transport(noop_sink());
    let pool = if shared {
        Pool::Shared(len as u64)
    } else {
        host(len)
    };
    let dst = Registration::new(&rx, pool).unwrap();
    dst.fill_at(0, len, 0xEE).unwrap();
    let src = Registration::new(&tx, host(len)).unwrap();
    let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
    src.write_at(0, &pattern).unwrap();
    let peer = tx
        .connect(&rx.metadata().unwrap(), &[dst.remote().clone()], 5)
        .unwrap();
    assert_eq!(tx.stats().direct_regions, u64::from(shared));
    // (source offset, source stride, destination offset, destination stride, row length, rows):
    // a strided source into packed rows, packed rows into a strided destination, both strided,
    // and rows long enough for streaming copies.
    let shapes: [(u64, u64, u64, u64, u64, u64); 4] = [
        (64, 256, 0, 96, 96, 300),
        (40_000, 80, 100_001, 512, 80, 200),
        (200_000, 1000, 300_003, 700, 333, 128),
        (500_000, 5000, 600_000, 4096, 4096, 16),
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
    let (done, got) = wait_done();
    tx.post(peer, writes, vec![1], done);
    got.recv_timeout(BOUND).unwrap().unwrap();
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
    assert_eq!(first_bad, None, "wrong byte at this offset");
    tx.disconnect(peer);
    std::thread::sleep(Duration::from_millis(100));
    // SAFETY: the only peer given `dst`, `tx`, disconnected after its one post ended.
    unsafe { dst.assume_quiesced() };
}

/// Posts made together to two peers, each a slice of every source row (a prefill rank's legs
/// into two decode TP ranks), with rows copied in turn: each peer gets exactly its slices; a bad
/// post among them is refused alone.
#[test]
fn posts_made_together_put_each_peers_rows_and_refuse_a_bad_one_alone() {
    let len: usize = 1 << 20;
    let tx = transport(noop_sink());
    let src = Registration::new(&tx, host(len)).unwrap();
    let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
    src.write_at(0, &pattern).unwrap();
    let (rows, row, half) = (256u64, 1024u64, 512u64);
    let mut receivers = Vec::new();
    let mut posts = Vec::new();
    let mut waits = Vec::new();
    for k in 0..2u64 {
        let rx = transport(noop_sink());
        let dst = Registration::new(&rx, Pool::Shared(len as u64 / 2)).unwrap();
        dst.fill_at(0, len / 2, 0xEE).unwrap();
        let peer = tx
            .connect(&rx.metadata().unwrap(), &[dst.remote().clone()], k)
            .unwrap();
        let (done, got) = wait_done();
        posts.push(transfer_engine::transport::Post {
            peer,
            writes: vec![WriteOp {
                local: src.id(),
                local_offset: k * half,
                remote: 0,
                remote_offset: 64,
                len: half,
                rows,
                local_stride: row,
                remote_stride: half,
            }],
            notification: vec![1],
            done,
        });
        waits.push(got);
        receivers.push((rx, dst, peer));
    }
    assert_eq!(tx.stats().direct_regions, 2, "UCX's memory was not mapped");
    // A third post, to the first peer, whose rows run past its region.
    let (done, bad) = wait_done();
    posts.push(transfer_engine::transport::Post {
        peer: receivers[0].2,
        writes: vec![WriteOp {
            local: src.id(),
            local_offset: 0,
            remote: 0,
            remote_offset: 0,
            len: half,
            rows: 2048,
            local_stride: half,
            remote_stride: half,
        }],
        notification: vec![2],
        done,
    });
    tx.post_many(posts);
    for got in &waits {
        got.recv_timeout(BOUND).unwrap().unwrap();
    }
    assert!(matches!(
        bad.recv_timeout(BOUND).unwrap(),
        Err(TransportError::OutOfBounds(_))
    ));
    for (k, (_, dst, _)) in receivers.iter().enumerate() {
        let mut want = vec![0xEEu8; len / 2];
        for i in 0..rows {
            let s = (i * row + k as u64 * half) as usize;
            let d = (64 + i * half) as usize;
            want[d..d + half as usize].copy_from_slice(&pattern[s..s + half as usize]);
        }
        let mut back = vec![0u8; len / 2];
        dst.read_at(0, &mut back).unwrap();
        let first_bad = back.iter().zip(&want).position(|(a, b)| a != b);
        assert_eq!(first_bad, None, "peer {k}: wrong byte at this offset");
    }
    for (_, dst, peer) in receivers {
        tx.disconnect(peer);
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: the only peer given `dst`, `tx`, disconnected after its posts ended.
        unsafe { dst.assume_quiesced() };
    }
}

/// A region whose claimed length runs past the memory UCX mapped for it is never written by our
/// own copies (which would write past the mapping); private memory is not mapped at all.
#[test]
fn a_region_longer_than_its_mapping_or_private_is_written_through_puts() {
    let len: u64 = 1 << 20;
    let rx = transport(noop_sink());
    let tx = transport(noop_sink());
    let shared = Registration::new(&rx, Pool::Shared(len)).unwrap();
    let private = Registration::new(&rx, host(len as usize)).unwrap();
    let mut lying = shared.remote().clone();
    lying.len += 1 << 30;
    let peer = tx
        .connect(
            &rx.metadata().unwrap(),
            &[lying, private.remote().clone(), shared.remote().clone()],
            6,
        )
        .unwrap();
    assert_eq!(
        tx.stats().direct_regions,
        1,
        "only the honest shared region is mapped"
    );
    tx.disconnect(peer);
    std::thread::sleep(Duration::from_millis(100));
    // SAFETY: the only peer given these registrations, `tx`, disconnected and posted nothing.
    unsafe {
        shared.assume_quiesced();
        private.assume_quiesced();
    }
}

#[test]
fn bad_writes_are_refused_before_posting() {
    let (rx_t, seen) = receiver(Arc::default());
    let tx_t = transport(noop_sink());
    let dst = Registration::new(&rx_t, host(1 << 16)).unwrap();
    let src = Registration::new(&tx_t, host(1 << 16)).unwrap();
    let src_id = src.id();
    let peer = tx_t
        .connect(&rx_t.metadata().unwrap(), &[dst.remote().clone()], 1)
        .unwrap();
    let bad = [
        WriteOp {
            local: src_id,
            local_offset: 1 << 16,
            remote: 0,
            remote_offset: 0,
            len: 1,
            rows: 1,
            local_stride: 0,
            remote_stride: 0,
        },
        WriteOp {
            local: src_id,
            local_offset: 0,
            remote: 0,
            remote_offset: (1 << 16) - 1,
            len: 2,
            rows: 1,
            local_stride: 0,
            remote_stride: 0,
        },
        WriteOp {
            local: src_id,
            local_offset: 0,
            remote: 1,
            remote_offset: 0,
            len: 1,
            rows: 1,
            local_stride: 0,
            remote_stride: 0,
        },
        WriteOp {
            local: src_id,
            local_offset: u64::MAX,
            remote: 0,
            remote_offset: 0,
            len: 2,
            rows: 1,
            local_stride: 0,
            remote_stride: 0,
        },
        // The last row of many ends past the destination.
        WriteOp {
            local: src_id,
            local_offset: 0,
            remote: 0,
            remote_offset: 0,
            len: 16,
            rows: 1 << 11,
            local_stride: 16,
            remote_stride: 64,
        },
        // Rows that overlap each other in the destination.
        WriteOp {
            local: src_id,
            local_offset: 0,
            remote: 0,
            remote_offset: 0,
            len: 16,
            rows: 4,
            local_stride: 16,
            remote_stride: 8,
        },
        // A stride whose product with the rows overflows.
        WriteOp {
            local: src_id,
            local_offset: 0,
            remote: 0,
            remote_offset: 0,
            len: 1,
            rows: 3,
            local_stride: u64::MAX / 2,
            remote_stride: 1,
        },
    ];
    for w in bad {
        let (done, rx) = wait_done();
        tx_t.post(peer, vec![w], vec![1], done);
        assert!(
            matches!(
                rx.recv_timeout(BOUND).unwrap(),
                Err(TransportError::OutOfBounds(_))
            ),
            "{w:?}"
        );
    }
    assert!(
        seen.lock().unwrap().is_empty(),
        "a refused post still sent its notification"
    );
    assert!(all_bytes(&dst, 0));
    assert!(rx_t.connect(b"", &[], 0).is_err());
}

#[test]
fn deregistration_waits_for_in_flight_writes_and_counters_return_to_baseline() {
    let len = 64 << 20;
    let (rx_t, _seen) = receiver(Arc::default());
    let tx_t = transport(noop_sink());
    let dst = Registration::new(&rx_t, host(len)).unwrap();
    let src = Registration::new(&tx_t, host(len)).unwrap();
    let (dst_id, src_id) = (dst.id(), src.id());
    assert_eq!(tx_t.stats().registered_bytes, len as u64);
    let peer = tx_t
        .connect(&rx_t.metadata().unwrap(), &[dst.remote().clone()], 1)
        .unwrap();
    let mut rxs = Vec::new();
    for _ in 0..4 {
        let (done, rx) = wait_done();
        tx_t.post(
            peer,
            vec![WriteOp {
                local: src_id,
                local_offset: 0,
                remote: 0,
                remote_offset: 0,
                len: len as u64,
                rows: 1,
                local_stride: 0,
                remote_stride: 0,
            }],
            vec![],
            done,
        );
        rxs.push(rx);
    }
    // Returns only once the writes from it are over (`into_inner` is the transport's deregister,
    // then hands the memory back).
    let _src = src.into_inner().unwrap();
    for rx in rxs {
        // Each post finished before (or as) the region went away, never after.
        rx.try_recv()
            .expect("deregister returned before a write from it was over")
            .unwrap();
    }
    assert_eq!(tx_t.stats().regions, 0);
    assert_eq!(tx_t.stats().registered_bytes, 0);
    assert_eq!(tx_t.stats().in_flight, 0);
    // SAFETY: `src_id` was deregistered above (`into_inner`): the call only looks it up.
    let again = unsafe { tx_t.deregister(src_id) };
    assert!(matches!(again, Err(TransportError::UnknownRegion(_))));
    tx_t.disconnect(peer);
    // Memory whose registration a peer was given is not handed back until the peer is declared
    // quiet.
    let dst = match dst.into_inner() {
        Err(b) if matches!(b.1, TransportError::MayBeWritten) => b.0,
        other => panic!(
            "handed back while a peer may write: {:?}",
            other.map(|_| ())
        ),
    };
    // SAFETY: the only peer given `dst`'s registration, `tx_t`, disconnected after all its posts
    // ended (each one's Done was received above).
    unsafe { dst.assume_quiesced() };
    let _dst = dst.into_inner().unwrap();
    // SAFETY: `dst_id` was deregistered above (`into_inner`): the call only looks it up.
    let again = unsafe { rx_t.deregister(dst_id) };
    assert!(matches!(again, Err(TransportError::UnknownRegion(_))));
    let deadline = std::time::Instant::now() + BOUND;
    while tx_t.stats().peers != 0 {
        assert!(std::time::Instant::now() < deadline);
        std::thread::yield_now();
    }
}

#[test]
fn a_pool_ucx_allocates_takes_writes_and_is_freed_with_its_registration() {
    let len = 4 << 20;
    let rx = transport(noop_sink());
    let tx = transport(noop_sink());
    let dst = Registration::new(&rx, Pool::Shared(len as u64)).unwrap();
    // UCX allocated it: the registration holds the transport's memory, not a buffer of ours.
    assert!(matches!(
        dst.desc().map(|d| d.len()),
        Some(l) if l == len as u64
    ));
    assert_eq!(rx.stats().registered_bytes, len as u64);
    dst.fill_at(0, len, 0xEE).unwrap();
    let src = Registration::new(&tx, host(len)).unwrap();
    src.fill_at(0, len, 0x42).unwrap();
    let peer = tx
        .connect(&rx.metadata().unwrap(), &[dst.remote().clone()], 3)
        .unwrap();
    let (done, got) = wait_done();
    tx.post(
        peer,
        vec![WriteOp {
            local: src.id(),
            local_offset: 0,
            remote: 0,
            remote_offset: 0,
            len: len as u64 / 2,
            rows: 1,
            local_stride: 0,
            remote_stride: 0,
        }],
        vec![],
        done,
    );
    got.recv_timeout(BOUND).unwrap().unwrap();
    let mut back = vec![0u8; len];
    dst.read_at(0, &mut back).unwrap();
    assert!(
        back[..len / 2].iter().all(|&b| b == 0x42),
        "the write did not land"
    );
    assert!(
        back[len / 2..].iter().all(|&b| b == 0xEE),
        "the write overran"
    );
    tx.disconnect(peer);
    // SAFETY: the only peer given `dst`'s registration, `tx`, disconnected after its one post ended.
    unsafe { dst.assume_quiesced() };
    // Deregistration frees UCX's memory; what comes back is the request.
    assert!(matches!(dst.into_inner(), Ok(Pool::Shared(l)) if l == len as u64));
    assert_eq!(rx.stats().registered_bytes, 0);
}

/// The nice value of this process's thread named `comm`, from `/proc/self/task/*/stat`. A thread
/// that ends while the list is read (other tests of this binary run beside this one) is skipped.
fn thread_nice(comm: &str) -> Option<i64> {
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let Ok(task) = task else { continue };
        let dir = task.path();
        let Ok(name) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if name.trim_end() != comm {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
        // Fields after the parenthesised name: state is field 3, nice is field 19.
        let rest = &stat[stat.rfind(')')? + 2..];
        return rest.split_whitespace().nth(16)?.parse().ok();
    }
    None
}

/// A sender's progress thread takes `sender_nice` at its first post; a receiver's keeps its own.
#[test]
fn a_senders_progress_thread_lowers_its_priority_at_its_first_post() {
    let named = |name: &str| -> Arc<dyn Transport> {
        Arc::new(
            UcxTransport::new(
                UcxConfig {
                    name: name.into(),
                    ..UcxConfig::default()
                },
                noop_sink(),
            )
            .unwrap(),
        )
    };
    let rx = named("nice-rx");
    let tx = named("nice-tx");
    let dst = Registration::new(&rx, Pool::Shared(1 << 16)).unwrap();
    let src = Registration::new(&tx, host(1 << 16)).unwrap();
    let peer = tx
        .connect(&rx.metadata().unwrap(), &[dst.remote().clone()], 9)
        .unwrap();
    let before = thread_nice("ucx-nice-tx").expect("the sender's thread");
    assert_eq!(before, 0, "niced before posting anything");
    let (done, got) = wait_done();
    tx.post(
        peer,
        vec![WriteOp {
            local: src.id(),
            local_offset: 0,
            remote: 0,
            remote_offset: 0,
            len: 4096,
            rows: 1,
            local_stride: 0,
            remote_stride: 0,
        }],
        vec![1],
        done,
    );
    got.recv_timeout(BOUND).unwrap().unwrap();
    assert_eq!(
        thread_nice("ucx-nice-tx"),
        Some(i64::from(transfer_engine::transport::ucx::SENDER_NICE))
    );
    assert_eq!(
        thread_nice("ucx-nice-rx"),
        Some(0),
        "the receiver was niced"
    );
    tx.disconnect(peer);
    std::thread::sleep(Duration::from_millis(100));
    // SAFETY: the only peer given `dst`, `tx`, disconnected after its one post ended.
    unsafe { dst.assume_quiesced() };
}

/// An idle receiver that sleeps on UCX's event fd is woken by what arrives, not by a timer: with
/// its sleep bounded only at 30 s, each chunk posted after the receiver fell asleep (into private
/// memory, through puts, and into memory UCX allocated, through direct copies) is seen within the
/// bound below, and a call into its thread (a registration) is answered while it sleeps. With the
/// event fd not armed or not polled, each would wait out the 30 s.
#[test]
fn an_idle_receiver_is_woken_by_arriving_notifications_and_by_calls() {
    let len = 1 << 20;
    let asleep = Duration::from_secs(30);
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let sink: Sink = Arc::new(move |ev| {
        if let Incoming::Notification { sender, bytes } = ev {
            s.lock().unwrap().push((sender, bytes.to_vec(), true));
        }
    });
    let config = UcxConfig {
        events: true,
        event_timeout: asleep,
        spin: Duration::ZERO,
        // Without events, the idle thread would nap this long: a missed wake-up shows as a wait.
        min_sleep: asleep,
        max_sleep: asleep,
        ..UcxConfig::default()
    };
    let rx_t: Arc<dyn Transport> = Arc::new(UcxTransport::new(config, sink).unwrap());
    let tx_t = transport(noop_sink());
    let private = Registration::new(&rx_t, host(len)).unwrap();
    let shared = Registration::new(&rx_t, Pool::Shared(len as u64)).unwrap();
    let src = Registration::new(&tx_t, host(len)).unwrap();
    let peer = tx_t
        .connect(
            &rx_t.metadata().unwrap(),
            &[private.remote().clone(), shared.remote().clone()],
            7,
        )
        .unwrap();
    // Well under the 30 s a missed wake-up costs, well over a loaded host's scheduling delays.
    let woken_within = Duration::from_secs(3);
    for (round, remote) in [(1u8, 0u32), (2, 1), (3, 0), (4, 1)] {
        // Long enough for the receiver's thread to be asleep in poll(2).
        std::thread::sleep(Duration::from_millis(300));
        let t0 = std::time::Instant::now();
        let writes = vec![WriteOp {
            local: src.id(),
            local_offset: 0,
            remote,
            remote_offset: 4096,
            len: 64 << 10,
            rows: 1,
            local_stride: 0,
            remote_stride: 0,
        }];
        let (done, done_rx) = wait_done();
        tx_t.post(peer, writes, vec![round; 3], done);
        done_rx.recv_timeout(BOUND).unwrap().unwrap();
        while seen.lock().unwrap().len() < usize::from(round) {
            assert!(
                t0.elapsed() < woken_within,
                "notification {round} not seen within {woken_within:?}: the sleeping receiver \
                 was not woken by it"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            seen.lock().unwrap()[usize::from(round) - 1].1,
            vec![round; 3]
        );
    }
    std::thread::sleep(Duration::from_millis(300));
    let t0 = std::time::Instant::now();
    let extra = Registration::new(&rx_t, host(4096)).unwrap();
    assert!(
        t0.elapsed() < woken_within,
        "a registration waited {:?} for the sleeping thread",
        t0.elapsed()
    );
    drop(extra);
    tx_t.disconnect(peer);
    // SAFETY: the only peer given these regions, `tx_t`, disconnected after its posts ended.
    unsafe {
        private.assume_quiesced();
        shared.assume_quiesced();
    }
}
