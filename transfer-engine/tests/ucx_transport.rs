//! The UCX backend on its own, over real loopback UCX: a chunk's writes land before its notification,
//! deregistration waits for in-flight writes, and bad writes are refused before anything is posted.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;
use transfer_engine::mem::{HostBuffer, HostOptions};
use transfer_engine::transport::ucx::{UcxConfig, UcxTransport};
use transfer_engine::transport::{
    Done, Incoming, Sender, Sink, Transport, TransportError, WriteOp,
};

const BOUND: Duration = Duration::from_secs(10);

type Seen = Arc<Mutex<Vec<(Sender, Vec<u8>, bool)>>>;

/// A receiving transport whose sink records each notification and whether the bytes were already
/// in place when it arrived.
fn receiver(dst: Arc<Mutex<Option<(u64, usize, u8)>>>) -> (UcxTransport, Seen) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let sink: Sink = Arc::new(move |ev| {
        if let Incoming::Notification { sender, bytes } = ev {
            // The check the engine relies on: when the notification is here, so are the bytes.
            let ok = dst.lock().unwrap().is_some_and(|(addr, len, val)| {
                // SAFETY: the test keeps the destination buffer alive until the transports are dropped.
                let b = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
                b.iter().all(|&x| x == val)
            });
            s.lock().unwrap().push((sender, bytes.to_vec(), ok));
        }
    });
    (UcxTransport::new(UcxConfig::default(), sink).unwrap(), seen)
}

fn noop_sink() -> Sink {
    Arc::new(|_| {})
}

fn wait_done() -> (Done, std::sync::mpsc::Receiver<Result<(), TransportError>>) {
    let (tx, rx) = std::sync::mpsc::channel();
    (Box::new(move |r| tx.send(r).unwrap()), rx)
}

#[test]
fn notification_follows_its_bytes() {
    let len = 8 << 20;
    let mut dst = HostBuffer::new(len, HostOptions::default()).unwrap();
    let mut src = HostBuffer::new(len, HostOptions::default()).unwrap();
    let expect = Arc::new(Mutex::new(None));
    let (rx_t, seen) = receiver(expect.clone());
    let tx_t = UcxTransport::new(UcxConfig::default(), noop_sink()).unwrap();
    let (_dst_id, remote) = rx_t.register(dst.desc()).unwrap();
    let (src_id, _) = tx_t.register(src.desc()).unwrap();
    let peer = tx_t
        .connect(&rx_t.metadata().unwrap(), &[remote], 0xfeed)
        .unwrap();

    for round in 1..=3u8 {
        src.as_mut_slice().fill(round);
        *expect.lock().unwrap() = Some((dst.desc().addr(), len, round));
        // Eight writes of 1 MiB, scattered in reverse order, then the notification.
        let writes: Vec<WriteOp> = (0..8u64)
            .rev()
            .map(|i| WriteOp {
                local: src_id,
                local_offset: i << 20,
                remote: 0,
                remote_offset: i << 20,
                len: 1 << 20,
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
    assert!(dst.as_mut_slice().iter().all(|&b| b == 3));
    assert_eq!(tx_t.stats().in_flight, 0);
    assert_eq!(tx_t.stats().bytes_posted, 3 * len as u64);
}

#[test]
fn bad_writes_are_refused_before_posting() {
    let mut dst = HostBuffer::new(1 << 16, HostOptions::default()).unwrap();
    let src = HostBuffer::new(1 << 16, HostOptions::default()).unwrap();
    let (rx_t, seen) = receiver(Arc::default());
    let tx_t = UcxTransport::new(UcxConfig::default(), noop_sink()).unwrap();
    let (_, remote) = rx_t.register(dst.desc()).unwrap();
    let (src_id, _) = tx_t.register(src.desc()).unwrap();
    let peer = tx_t
        .connect(&rx_t.metadata().unwrap(), &[remote], 1)
        .unwrap();
    let bad = [
        WriteOp {
            local: src_id,
            local_offset: 1 << 16,
            remote: 0,
            remote_offset: 0,
            len: 1,
        },
        WriteOp {
            local: src_id,
            local_offset: 0,
            remote: 0,
            remote_offset: (1 << 16) - 1,
            len: 2,
        },
        WriteOp {
            local: src_id,
            local_offset: 0,
            remote: 1,
            remote_offset: 0,
            len: 1,
        },
        WriteOp {
            local: src_id,
            local_offset: u64::MAX,
            remote: 0,
            remote_offset: 0,
            len: 2,
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
    assert!(dst.as_mut_slice().iter().all(|&b| b == 0));
    assert!(rx_t.connect(b"", &[], 0).is_err());
}

#[test]
fn deregistration_waits_for_in_flight_writes_and_counters_return_to_baseline() {
    let len = 64 << 20;
    let dst = HostBuffer::new(len, HostOptions::default()).unwrap();
    let src = HostBuffer::new(len, HostOptions::default()).unwrap();
    let (rx_t, _seen) = receiver(Arc::default());
    let tx_t = UcxTransport::new(UcxConfig::default(), noop_sink()).unwrap();
    let (dst_id, remote) = rx_t.register(dst.desc()).unwrap();
    let (src_id, _) = tx_t.register(src.desc()).unwrap();
    assert_eq!(tx_t.stats().registered_bytes, len as u64);
    let peer = tx_t
        .connect(&rx_t.metadata().unwrap(), &[remote], 1)
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
            }],
            vec![],
            done,
        );
        rxs.push(rx);
    }
    // Returns only once the writes from it are over.
    tx_t.deregister(src_id).unwrap();
    for rx in rxs {
        // Each post finished before (or as) the region went away, never after.
        rx.try_recv()
            .expect("deregister returned before a write from it was over")
            .unwrap();
    }
    assert_eq!(tx_t.stats().regions, 0);
    assert_eq!(tx_t.stats().registered_bytes, 0);
    assert_eq!(tx_t.stats().in_flight, 0);
    tx_t.disconnect(peer);
    rx_t.deregister(dst_id).unwrap();
    assert!(matches!(
        rx_t.deregister(dst_id),
        Err(TransportError::UnknownRegion(_))
    ));
    let deadline = std::time::Instant::now() + BOUND;
    while tx_t.stats().peers != 0 {
        assert!(std::time::Instant::now() < deadline);
        std::thread::yield_now();
    }
}
