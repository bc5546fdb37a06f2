//! Memory that a registration holds stays memory while it does, over real loopback UCX: a transport
//! shut down under a live pool leaks that pool rather than freeing it, and a pool whose pages
//! cannot be had fails at allocation with a typed error, not later by SIGBUS.
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::sync::Arc;
use transfer_engine::mem::Pool;
use transfer_engine::transport::ucx::{UcxConfig, UcxTransport};
use transfer_engine::transport::{Registration, Sink, Transport, TransportError};

fn noop_sink() -> Sink {
    Arc::new(|_| {})
}

#[test]
fn a_shut_down_transport_never_frees_a_pool_a_registration_still_holds() {
    let ucx = Arc::new(UcxTransport::new(UcxConfig::default(), noop_sink()).unwrap());
    let t: Arc<dyn Transport> = ucx.clone();
    let len = 4 << 20;
    let pool = Registration::new(&t, Pool::Shared(len as u64)).unwrap();
    pool.fill_at(0, len, 0x5a).unwrap();
    // Safe code shuts the transport down while the registration (and its memory) lives on.
    ucx.shutdown();
    let mut back = vec![0u8; len];
    pool.read_at(0, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0x5a),
        "the pool changed under its registration"
    );
    pool.write_at(0, &[7; 64]).unwrap();
    assert!(t.stats().leaked_handles >= 1, "{:?}", t.stats());
    // Its owner's deregistration hears that the transport is gone (asked again from a helper
    // thread, as for a call from the transport's own thread) and leaks its side too.
    let before = transfer_engine::transport::leaked_pools();
    drop(pool);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while transfer_engine::transport::leaked_pools() != before + 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the pool was not leaked"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Set in the child below, which runs in a mount namespace of its own.
const SMALL_MOUNT_ENV: &str = "KVX_TEST_SMALL_SHM";

/// Run by `a_pool_larger_than_its_shared_memory_mount_fails_at_allocation` in a mount namespace of
/// its own, whose `/dev/shm` (where UCX's POSIX shared memory lives) is a 64 MiB tmpfs.
#[test]
#[ignore = "run by a_pool_larger_than_its_shared_memory_mount_fails_at_allocation"]
fn child_allocates_on_a_small_mount() {
    assert!(
        std::env::var_os(SMALL_MOUNT_ENV).is_some(),
        "{SMALL_MOUNT_ENV} is not set: run the parent test"
    );
    let t: Arc<dyn Transport> =
        Arc::new(UcxTransport::new(UcxConfig::default(), noop_sink()).unwrap());
    // Fits: taken, and every byte can be written.
    let small = Registration::new(&t, Pool::Shared(2 << 20)).unwrap();
    small.fill_at(0, 2 << 20, 1).unwrap();
    // Four times the mount: refused now, with a typed error, rather than a pool whose first write
    // past the mount's room raises SIGBUS. (UCX 1.22's POSIX allocation writes the whole file to
    // test for room, so it is UCX that refuses here; our own check, a failed MADV_POPULATE_WRITE, is
    // `TransportError::Populate`.)
    match Registration::new(&t, Pool::Shared(256 << 20)) {
        Err(TransportError::Populate { bytes, .. }) => assert_eq!(bytes, 256 << 20),
        Err(TransportError::Library { op, .. }) => assert_eq!(op, "ucp_mem_map(ALLOCATE)"),
        other => panic!("a pool larger than /dev/shm was not refused: {other:?}"),
    }
    assert_eq!(t.stats().regions, 1, "the refused pool stayed registered");
    small.fill_at(0, 2 << 20, 2).unwrap();
    println!("refused as it should be");
}

#[test]
fn a_pool_larger_than_its_shared_memory_mount_fails_at_allocation() {
    let exe = std::env::current_exe().unwrap();
    let script = format!(
        "mount -t tmpfs -o size=64m kvx-small-shm /dev/shm && exec '{exe}' --exact \
         child_allocates_on_a_small_mount --include-ignored --nocapture",
        exe = exe.display()
    );
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .env(SMALL_MOUNT_ENV, "1")
        // POSIX shared memory only (UCX tries System V first), so the pool lives on that mount.
        .env("UCX_ALLOC_PRIO", "md:posix")
        .output()
        .expect("unshare (util-linux) runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("refused as it should be"),
        "the child failed ({}):\n{text}",
        out.status
    );
}
