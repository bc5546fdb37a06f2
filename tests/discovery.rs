//! Discovery against a real etcd server (Debian's `etcd`, started by each test on free ports):
//! records and their leases, clusters kept apart by name, a restart of etcd under registered
//! engines, and what 64 engines registering and watching cost.
//!
//! A missing `etcd` binary fails these tests (`scripts/provision` installs it).
#![allow(clippy::unwrap_used)]

use kvbench::etcd_server::EtcdServer;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use transfer_engine::control::Secret;
use transfer_engine::discovery::{
    Directory, DirectoryEvent, EngineRecord, EtcdConfig, RecordRole, Registration, sealed_value,
};

/// Bound on every wait for etcd to show a change.
const BOUND: Duration = Duration::from_secs(15);

fn record(role: RecordRole, pp_rank: u16, port: u16, incarnation: u64) -> EngineRecord {
    EngineRecord {
        role,
        engine_id: format!("{role:?}-{pp_rank}"),
        address: SocketAddr::from(([127, 0, 0, 1], port)),
        tp_rank: 0,
        tp_size: 1,
        pp_rank,
        pp_size: 4,
        total_layers: 8,
        page_tokens: 16,
        first_layer: 2 * u32::from(pp_rank),
        num_layers: 2,
        incarnation,
        instance: String::new(),
    }
}

fn cfg(server: &EtcdServer, cluster: &str, ttl: u64) -> EtcdConfig {
    let mut c = EtcdConfig::new(server.url(), cluster);
    c.lease_ttl = Duration::from_secs(ttl);
    c.secret = Secret::new(b"discovery-test secret, 32 bytes.");
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusters_under_different_names_do_not_see_each_other() {
    let server = EtcdServer::start().unwrap();
    // "a" is a prefix of "ab" as a string: the key layout must still keep them apart.
    let (a, ab) = (cfg(&server, "a", 5), cfg(&server, "ab", 5));
    let dir_a = Directory::open(&a).await.unwrap();
    let dir_ab = Directory::open(&ab).await.unwrap();
    let _ra = Registration::register(&a, record(RecordRole::Decode, 0, 1000, 1))
        .await
        .unwrap();
    let _rab = Registration::register(&ab, record(RecordRole::Decode, 0, 2000, 1))
        .await
        .unwrap();
    let _rab2 = Registration::register(&ab, record(RecordRole::Prefill, 1, 2001, 1))
        .await
        .unwrap();
    dir_ab
        .wait_for("both of ab's records", BOUND, |r| {
            (r.len() == 2).then_some(())
        })
        .await
        .unwrap();
    dir_a
        .wait_for("a's record", BOUND, |r| (!r.is_empty()).then_some(()))
        .await
        .unwrap();
    // A fresh listing too, not only what the watch delivered.
    let fresh_a = Directory::open(&a).await.unwrap();
    for d in [&dir_a, &fresh_a] {
        let rs = d.records();
        assert_eq!(rs.len(), 1, "{rs:?}");
        assert_eq!(rs[0].address.port(), 1000);
    }
    assert!(dir_ab.records().iter().all(|r| r.address.port() >= 2000));
    assert!(EtcdConfig::new(server.url(), "a/b").prefix().is_err());
    assert!(EtcdConfig::new(server.url(), "").prefix().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_registration_is_deleted_and_an_unrenewed_one_expires() {
    let server = EtcdServer::start().unwrap();
    let c = cfg(&server, "leases", 2);
    let dir = Directory::open(&c).await.unwrap();
    let mut events = dir.events();
    let reg = Registration::register(&c, record(RecordRole::Prefill, 2, 3000, 7))
        .await
        .unwrap();
    let ev = tokio::time::timeout(BOUND, events.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(ev, DirectoryEvent::Put(ref r) if r.incarnation == 7),
        "{ev:?}"
    );
    // Dropping revokes the lease: the record is gone at once, not a lease later.
    let t = Instant::now();
    drop(reg);
    let ev = tokio::time::timeout(BOUND, events.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(ev, DirectoryEvent::Deleted(ref r) if r.pp_rank == 2),
        "{ev:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());

    // A lease nobody renews (a stopped engine) ends within its TTL, and the record with it.
    let mut client = etcd_client::Client::connect([server.url()], None)
        .await
        .unwrap();
    let lease = client.lease_grant(2, None).await.unwrap().id();
    let r = record(RecordRole::Prefill, 3, 3001, 9);
    let key = r.key(&c.prefix().unwrap()).unwrap();
    let opts = etcd_client::PutOptions::new().with_lease(lease);
    client
        .put(key, sealed_value(&c, &r, lease).unwrap(), Some(opts))
        .await
        .unwrap();
    let put_at = Instant::now();
    let mut deleted = None;
    while deleted.is_none() {
        match tokio::time::timeout(BOUND, events.recv())
            .await
            .unwrap()
            .unwrap()
        {
            DirectoryEvent::Deleted(r) => deleted = Some(r),
            DirectoryEvent::Put(_) => {}
        }
    }
    let took = put_at.elapsed();
    assert_eq!(deleted.unwrap().incarnation, 9);
    // etcd's expiry is the TTL plus its own check interval (about half a second).
    assert!(took < Duration::from_secs(4), "expired after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_record_is_put_back_by_its_registration() {
    let server = EtcdServer::start().unwrap();
    let c = cfg(&server, "deleted", 3);
    let dir = Directory::open(&c).await.unwrap();
    let mut events = dir.events();
    let reg = Registration::register(&c, record(RecordRole::Prefill, 1, 3500, 4))
        .await
        .unwrap();
    let ev = tokio::time::timeout(BOUND, events.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(ev, DirectoryEvent::Put(_)), "{ev:?}");
    let mut client = etcd_client::Client::connect([server.url()], None)
        .await
        .unwrap();
    let key = record(RecordRole::Prefill, 1, 3500, 4)
        .key(&c.prefix().unwrap())
        .unwrap();
    client.delete(key, None).await.unwrap();
    let deleted_at = Instant::now();
    let ev = tokio::time::timeout(BOUND, events.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(ev, DirectoryEvent::Deleted(_)), "{ev:?}");
    // Back within a renewal period (a third of the lease) and its check.
    let ev = tokio::time::timeout(BOUND, events.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(ev, DirectoryEvent::Put(ref r) if r.incarnation == 4),
        "{ev:?}"
    );
    let took = deleted_at.elapsed();
    assert!(took < Duration::from_secs(3), "put back after {took:?}");
    // The registration counts it once its put returned, which may be after the watch saw it.
    let t = Instant::now();
    while reg.state().reregistered == 0 && t.elapsed() < BOUND {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(reg.state().reregistered, 1);
}

/// Records someone wrote into etcd without the deployment's secret (plain, sealed with another
/// secret, or a real record moved to another key or put under another lease) are ignored and
/// counted, by a directory that follows and by one that lists afresh; a key whose record was
/// replaced so is taken as deleted until its registration puts the record back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_not_sealed_with_the_secret_for_their_key_and_lease_are_ignored() {
    let server = EtcdServer::start().unwrap();
    let c = cfg(&server, "sealed", 5);
    let dir = Directory::open(&c).await.unwrap();
    let real = record(RecordRole::Decode, 0, 5000, 1);
    let reg = Registration::register(&c, real.clone()).await.unwrap();
    let mut client = etcd_client::Client::connect([server.url()], None)
        .await
        .unwrap();
    let prefix = c.prefix().unwrap();
    let lease = client.lease_grant(30, None).await.unwrap().id();
    let opts = || Some(etcd_client::PutOptions::new().with_lease(lease));
    let mut other = c.clone();
    other.secret = Secret::new(b"someone else's secret..........");
    let forged = [
        // The record as JSON, unsealed.
        (record(RecordRole::Prefill, 0, 6000, 1), None),
        // Sealed with another secret.
        (record(RecordRole::Prefill, 1, 6001, 1), Some(&other)),
    ];
    for (r, with) in &forged {
        let key = r.key(&prefix).unwrap();
        let value = match with {
            None => serde_json::to_vec(r).unwrap(),
            Some(o) => sealed_value(o, r, lease).unwrap(),
        };
        client.put(key, value, opts()).await.unwrap();
    }
    // The real decode record, moved to a prefill key.
    let held = client.get(real.key(&prefix).unwrap(), None).await.unwrap();
    let value = held.kvs()[0].value().to_vec();
    let moved = record(RecordRole::Prefill, 2, 5000, 1)
        .key(&prefix)
        .unwrap();
    client.put(moved, value.clone(), opts()).await.unwrap();
    // And put again at its own key, under another lease: refused, and the decode's record taken
    // as gone until its registration puts it back.
    let mut events = dir.events();
    client
        .put(real.key(&prefix).unwrap(), value, opts())
        .await
        .unwrap();
    let t = Instant::now();
    while dir.refused_records() < 4 {
        assert!(t.elapsed() < BOUND, "{}", dir.refused_records());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut seen = Vec::new();
    while seen.len() < 2 {
        match tokio::time::timeout(BOUND, events.recv())
            .await
            .unwrap()
            .unwrap()
        {
            DirectoryEvent::Deleted(r) => seen.push(("deleted", r)),
            DirectoryEvent::Put(r) => seen.push(("put", r)),
        }
    }
    assert_eq!(seen, vec![("deleted", real.clone()), ("put", real.clone())]);
    // The registration counts its put once it returned, which may be after the watch saw it.
    while reg.state().reregistered == 0 {
        assert!(t.elapsed() < BOUND, "{:?}", reg.state());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(dir.records(), vec![real.clone()]);
    let fresh = Directory::open(&c).await.unwrap();
    assert_eq!(fresh.records(), vec![real.clone()]);
    assert_eq!(fresh.refused_records(), 3);
    // A directory of another secret takes only what was sealed with that secret.
    let outsider = Directory::open(&other).await.unwrap();
    assert!(outsider.records().len() == 1 && outsider.records()[0].address.port() == 6001);
    assert!(!reg.state().superseded);
}

/// A record with a later incarnation that someone without the secret puts at a live engine's key
/// does not supersede it: its registration puts its own record back, and directories never take
/// the forged one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_later_start_does_not_supersede_an_engine() {
    let server = EtcdServer::start().unwrap();
    let c = cfg(&server, "forged", 3);
    let dir = Directory::open(&c).await.unwrap();
    let reg = Registration::register(&c, record(RecordRole::Prefill, 1, 7000, 5))
        .await
        .unwrap();
    let mut client = etcd_client::Client::connect([server.url()], None)
        .await
        .unwrap();
    let forged = record(RecordRole::Prefill, 1, 7999, 99);
    let key = forged.key(&c.prefix().unwrap()).unwrap();
    let mut other = c.clone();
    other.secret = Secret::new(b"not the deployment's secret.....");
    let value = sealed_value(&other, &forged, 0).unwrap();
    client.put(key.clone(), value, None).await.unwrap();
    let t = Instant::now();
    while reg.state().reregistered == 0 {
        assert!(t.elapsed() < BOUND, "{:?}", reg.state());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!reg.state().superseded, "{:?}", reg.state());
    while dir.refused_records() == 0 {
        assert!(t.elapsed() < BOUND);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rs = Directory::open(&c).await.unwrap().records();
    assert_eq!(
        rs.iter()
            .map(|r| (r.incarnation, r.address.port()))
            .collect::<Vec<_>>(),
        vec![(5, 7000)]
    );
    assert_eq!(dir.records(), rs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_start_never_overwrites_its_successor() {
    let server = EtcdServer::start().unwrap();
    let c = cfg(&server, "owners", 3);
    let stale = Registration::register(&c, record(RecordRole::Prefill, 1, 4000, 5))
        .await
        .unwrap();
    // The stale start loses its lease (stopped past its TTL, say), and its successor, a later
    // incarnation, takes the key before the stale one notices.
    let mut client = etcd_client::Client::connect([server.url()], None)
        .await
        .unwrap();
    client.lease_revoke(stale.state().lease).await.unwrap();
    let next = Registration::register(&c, record(RecordRole::Prefill, 1, 4001, 6))
        .await
        .unwrap();
    // The stale start's renewal finds its lease gone and the key a later start's: it stops.
    let t = Instant::now();
    while !stale.state().superseded {
        assert!(t.elapsed() < BOUND, "{:?}", stale.state());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Two renewal periods later the key still holds the successor's record.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rs = Directory::open(&c).await.unwrap().records();
    assert_eq!(rs.len(), 1, "{rs:?}");
    assert_eq!(
        (rs[0].incarnation, rs[0].address.port()),
        (6, 4001),
        "{rs:?}"
    );
    assert!(!next.state().superseded && next.state().reregistered == 0);
    // A stale start that registers after its successor is refused outright.
    let err = Registration::register(&c, record(RecordRole::Prefill, 1, 4002, 4))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            transfer_engine::discovery::DiscoveryError::Superseded {
                theirs: 6,
                ours: 4,
                ..
            }
        ),
        "{err:?}"
    );
    let rs = Directory::open(&c).await.unwrap().records();
    assert_eq!(rs[0].incarnation, 6, "{rs:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_of_etcd_keeps_records_and_registrations_renew() {
    let mut server = EtcdServer::start().unwrap();
    let c = cfg(&server, "restart", 3);
    let reg = Registration::register(&c, record(RecordRole::Decode, 0, 4000, 1))
        .await
        .unwrap();
    let dir = Directory::open(&c).await.unwrap();
    assert_eq!(dir.records().len(), 1);
    server.stop();
    // Down for longer than the lease: etcd keeps leases across a restart and renews them from it.
    std::thread::sleep(Duration::from_secs(4));
    assert!(reg.state().unreachable, "{:?}", reg.state());
    server.resume().unwrap();
    let t = Instant::now();
    while reg.state().unreachable && t.elapsed() < BOUND {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !reg.state().unreachable,
        "the registration did not reconnect"
    );
    // Past another lease: still registered (renewed), and the directory follows again.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let fresh = Directory::open(&c).await.unwrap();
    assert_eq!(fresh.records().len(), 1, "the record did not survive");
    let _r2 = Registration::register(&c, record(RecordRole::Prefill, 0, 4001, 1))
        .await
        .unwrap();
    dir.wait_for("the new record", BOUND, |r| (r.len() == 2).then_some(()))
        .await
        .unwrap();
}

/// Registration and watch cost with 64 engines in one process against one etcd: every engine
/// registers and opens a directory of the cluster (as every prefill rank does). Prints what it
/// took; asserts that every directory saw every record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_engines_register_and_watch() {
    const N: u16 = 64;
    let server = EtcdServer::start().unwrap();
    let c = cfg(&server, "scale", 10);
    let t0 = Instant::now();
    let mut dirs = Vec::new();
    for _ in 0..N {
        dirs.push(Directory::open(&c).await.unwrap());
    }
    let opened = t0.elapsed();
    let t1 = Instant::now();
    let mut regs = Vec::new();
    for i in 0..N {
        let mut r = record(RecordRole::Prefill, i, 5000 + i, 1);
        r.pp_size = N;
        regs.push(Registration::register(&c, r).await.unwrap());
    }
    let registered = t1.elapsed();
    for d in &dirs {
        d.wait_for("every record", BOUND, |r| {
            (r.len() == usize::from(N)).then_some(())
        })
        .await
        .unwrap();
    }
    let seen = t1.elapsed();
    // One restart of a rank: every directory sees its new incarnation.
    let t2 = Instant::now();
    regs.swap_remove(5);
    let mut r = record(RecordRole::Prefill, 5, 6005, 2);
    r.pp_size = N;
    regs.push(Registration::register(&c, r).await.unwrap());
    for d in &dirs {
        d.wait_for("rank 5's new start", BOUND, |r| {
            r.iter()
                .any(|r| r.pp_rank == 5 && r.incarnation == 2)
                .then_some(())
        })
        .await
        .unwrap();
    }
    let rejoin = t2.elapsed();
    eprintln!(
        "{N} engines: {N} directories opened in {opened:?}, {N} registrations in {registered:?} \
         ({:?} each), every directory saw all {N} records {seen:?} after the first registration \
         ({} watch events); one rank's restart reached all {N} directories in {rejoin:?}",
        registered / u32::from(N),
        u32::from(N) * u32::from(N),
    );
}

/// Two prefill instances, each a pipeline of two ranks, and one decode engine find each other
/// through one etcd cluster name: the records' keys carry the instance, so nothing collides; each
/// rank's mesh peers are its own instance's ranks; decode serves each instance as soon as its
/// records appear (a session each) and both instances' requests complete with their own bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_prefill_instances_and_one_decode_share_a_cluster_name() {
    use transfer_engine::core::RequestId;
    use transfer_engine::core::planner::{KvLayout, RegionKind};
    use transfer_engine::discovery::{find_prefill_cluster, join_decode, join_prefill};
    use transfer_engine::engine::{
        DecodeConfig, DecodeEngine, Expected, Outcome, Pool, PrefillConfig, PrefillEngine,
    };
    use transfer_engine::mem::{HostBuffer, HostOptions};
    const PAGE: u64 = 256;
    let server = EtcdServer::start().unwrap();
    let c = cfg(&server, "instances", 5);
    let secret = transfer_engine::control::Secret::new(b"instances-test secret, 32 bytes.");
    let dlayout = KvLayout::packed(0, 4, RegionKind::Fused, PAGE, 16);
    let mut dcfg = DecodeConfig::new(4, 16, dlayout.clone(), 0);
    dcfg.token = Some(secret.clone());
    let mut dbuf = HostBuffer::new(dlayout.buffer_len as usize, HostOptions::default()).unwrap();
    dbuf.as_mut_slice().fill(0xEE);
    let decode = DecodeEngine::start(dcfg, Pool::Owned(dbuf)).await.unwrap();
    let mut drec = record(RecordRole::Decode, 0, decode.local_addr().port(), 1);
    drec.address = decode.local_addr();
    drec.instance = "decode-a".into();
    let _dm = join_decode(&c, &decode, drec).await.unwrap();
    let mut starts = Vec::new();
    for (name, fill) in [("alpha", 0x11u8), ("beta", 0x22u8)] {
        for rank in 0..2u16 {
            let (c, secret) = (c.clone(), secret.clone());
            starts.push(tokio::spawn(async move {
                let layout = KvLayout::packed(u32::from(rank) * 2, 2, RegionKind::Fused, PAGE, 16);
                let mut cfg = PrefillConfig::new(
                    SocketAddr::from(([127, 0, 0, 1], 0)),
                    rank,
                    2,
                    4,
                    16,
                    layout.clone(),
                );
                cfg.instance = name.into();
                cfg.engine_id = format!("{name}-{rank}");
                cfg.token = Some(secret);
                let (reg, dir) = find_prefill_cluster(
                    &c,
                    &mut cfg,
                    std::net::IpAddr::from([127, 0, 0, 1]),
                    BOUND,
                )
                .await
                .unwrap();
                let mut buf =
                    HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
                buf.as_mut_slice().fill(fill + rank as u8);
                let engine = PrefillEngine::start(cfg, Pool::Owned(buf)).await.unwrap();
                let m = join_prefill(&engine, reg, dir);
                (name, rank, engine, m)
            }));
        }
    }
    let mut ranks = Vec::new();
    for s in starts {
        ranks.push(s.await.unwrap());
    }
    for name in ["alpha", "beta"] {
        decode.wait_for_instance(name, BOUND).await.unwrap();
    }
    assert_eq!(
        decode.instances(),
        vec![("alpha".into(), 2), ("beta".into(), 2)]
    );
    for (n, (name, dst)) in [("alpha", [0u32, 1]), ("beta", [5, 6])]
        .into_iter()
        .enumerate()
    {
        let request = RequestId(40 + n as u64);
        let done = decode
            .expect_request(
                request,
                Expected {
                    instance: name.into(),
                    prefix_tokens: 0,
                    prompt_tokens: 32,
                    chunk_tokens: 32,
                    dst_pages: dst.to_vec(),
                    timeout: BOUND,
                },
            )
            .unwrap();
        for (_, _, e, _) in ranks.iter().filter(|r| r.0 == name) {
            e.send_chunk(request, 0, &[3, 4], true).await.unwrap();
        }
        assert_eq!(
            tokio::time::timeout(BOUND, done).await.unwrap(),
            Outcome::Complete
        );
        // Each layer's pages hold the bytes of the rank that holds it, of this instance.
        let fill = if name == "alpha" { 0x11u8 } else { 0x22 };
        for layer in 0..4u64 {
            let mut page = vec![0u8; PAGE as usize];
            decode
                .read_pool((layer * 16 + u64::from(dst[0])) * PAGE, &mut page)
                .unwrap();
            let want = fill + (layer / 2) as u8;
            assert!(page.iter().all(|&b| b == want), "{name} layer {layer}");
        }
    }
}

fn signal(server: &EtcdServer, sig: &str) {
    let pid = server.pid().unwrap().to_string();
    let ok = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

async fn until(what: &str, bound: Duration, cond: impl Fn() -> bool) -> Duration {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < bound, "{what}: not within {bound:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t0.elapsed()
}

/// An etcd that stops answering without closing anything (SIGSTOP: its sockets stay open) is
/// noticed by a directory within two of its liveness bounds (`is_live` turns false); once etcd
/// answers again the directory lists afresh and follows new records. Here the directory's watch is
/// established before etcd stops (two workers: the follower runs at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_notices_a_silent_etcd_and_follows_again_when_it_answers() {
    silent_etcd_noticed("silent").await;
}

/// The same when etcd stops between the directory's listing and its watch: on one thread the
/// follower has not run when `open` returns, so its watch request meets a stopped etcd. That
/// request is bounded by the liveness bound too, not by the client's own 5 s timeout.
#[tokio::test(flavor = "current_thread")]
async fn a_directory_notices_an_etcd_that_went_silent_before_its_watch_began() {
    silent_etcd_noticed("silent-early").await;
}

async fn silent_etcd_noticed(cluster: &str) {
    let server = EtcdServer::start().unwrap();
    let mut c = cfg(&server, cluster, 30);
    c.watch_liveness = Duration::from_millis(300);
    let dir = Directory::open(&c).await.unwrap();
    assert!(dir.is_live());
    signal(&server, "-STOP");
    let noticed = until("the silent etcd noticed", BOUND, || !dir.is_live()).await;
    // Two bounds of silence, and the slack of a busy host.
    assert!(
        noticed <= Duration::from_millis(600) + Duration::from_secs(2),
        "{noticed:?}"
    );
    signal(&server, "-CONT");
    until("the directory following again", BOUND, || dir.is_live()).await;
    let _reg = Registration::register(&c, record(RecordRole::Decode, 0, 4000, 1))
        .await
        .unwrap();
    until("the new record seen", BOUND, || dir.records().len() == 1).await;
    eprintln!("{cluster}: a silent etcd noticed after {noticed:?} (liveness bound 300 ms)");
}

/// An engine that starts before etcd waits for it (within `start_deadline`) instead of failing;
/// with no deadline it fails at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_waits_for_an_etcd_that_comes_up_later() {
    let mut server = EtcdServer::start().unwrap();
    let mut c = cfg(&server, "later", 30);
    server.stop();
    c.start_deadline = Duration::ZERO;
    assert!(
        Registration::register(&c, record(RecordRole::Decode, 0, 4000, 1))
            .await
            .is_err()
    );
    c.start_deadline = Duration::from_secs(30);
    let up = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        server.resume().unwrap();
        server
    });
    let t0 = Instant::now();
    let reg = Registration::register(&c, record(RecordRole::Decode, 0, 4000, 1))
        .await
        .unwrap();
    let waited = t0.elapsed();
    let server = up.join().unwrap();
    assert!(waited >= Duration::from_millis(1400), "{waited:?}");
    let dir = Directory::open(&c).await.unwrap();
    assert_eq!(dir.records().len(), 1);
    drop((reg, server));
    eprintln!("registered {waited:?} after it started, once etcd came up");
}

/// With authentication enabled in etcd, only the configured user gets in: without credentials a
/// registration is refused, with a wrong password it is refused at once (not retried until the
/// start deadline), with the right ones it registers and a directory reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_with_authentication_admits_only_its_user() {
    use transfer_engine::discovery::EtcdUser;
    let server = EtcdServer::start().unwrap();
    let mut admin = etcd_client::Client::connect([server.url()], None)
        .await
        .unwrap();
    admin.role_add("root").await.unwrap();
    admin.user_add("root", "root-pw", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();
    let mut c = cfg(&server, "auth", 30);
    let rec = record(RecordRole::Decode, 0, 4000, 1);
    assert!(Registration::register(&c, rec.clone()).await.is_err());
    c.user = Some(EtcdUser {
        name: "root".into(),
        password: "wrong".into(),
    });
    let t0 = Instant::now();
    assert!(Registration::register(&c, rec.clone()).await.is_err());
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    c.user = Some(EtcdUser {
        name: "root".into(),
        password: "root-pw".into(),
    });
    assert!(!format!("{c:?}").contains("root-pw"), "{c:?}");
    let _reg = Registration::register(&c, rec).await.unwrap();
    let dir = Directory::open(&c).await.unwrap();
    assert_eq!(dir.records().len(), 1);
}

/// A CA, and a certificate it signed for `name` (for 127.0.0.1), in `dir`, made with `openssl`.
fn signed(dir: &std::path::Path, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl runs");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    if !dir.join("ca.pem").exists() {
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "1",
            "-subj",
            "/CN=kvx-test-ca",
        ]);
    }
    let (key, csr, pem) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.pem"),
    );
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        &key,
        "-out",
        &csr,
        "-subj",
        &format!("/CN={name}"),
    ]);
    std::fs::write(
        dir.join(format!("{name}.ext")),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        &csr,
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        &pem,
        "-days",
        "1",
        "-extfile",
        &format!("{name}.ext"),
    ]);
    (dir.join(pem), dir.join(key))
}

/// Over TLS with client certificates, only a client that trusts etcd's CA and shows a certificate
/// etcd trusts gets in: plain HTTP, TLS without a client certificate, and TLS with a certificate of
/// another CA are all refused; the right settings register and read records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_tls_admits_only_a_client_with_a_trusted_certificate() {
    use transfer_engine::discovery::EtcdTls;
    let dir = std::env::temp_dir().join(format!("kvx-etcd-tls-{}", std::process::id()));
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    let (server_cert, server_key) = signed(&dir, "server");
    let (client_cert, client_key) = signed(&dir, "client");
    let (stranger_cert, stranger_key) = signed(&other, "stranger");
    let server = EtcdServer::start_tls(kvbench::etcd_server::Tls {
        cert: server_cert,
        key: server_key,
        client_ca: dir.join("ca.pem"),
    })
    .unwrap();
    assert!(server.url().starts_with("https://"));
    let rec = record(RecordRole::Decode, 0, 4000, 1);
    let mut c = cfg(&server, "tls", 30);
    c.start_deadline = Duration::ZERO;
    let plain = {
        let mut p = c.clone();
        p.endpoints = vec![server.url().replace("https://", "http://")];
        p
    };
    assert!(Registration::register(&plain, rec.clone()).await.is_err());
    c.tls = Some(EtcdTls {
        ca: dir.join("ca.pem"),
        identity: None,
        domain: None,
    });
    assert!(Registration::register(&c, rec.clone()).await.is_err());
    c.tls = Some(EtcdTls {
        ca: dir.join("ca.pem"),
        identity: Some((stranger_cert, stranger_key)),
        domain: None,
    });
    assert!(Registration::register(&c, rec.clone()).await.is_err());
    c.tls = Some(EtcdTls {
        ca: dir.join("ca.pem"),
        identity: Some((client_cert, client_key)),
        domain: None,
    });
    let _reg = Registration::register(&c, rec).await.unwrap();
    let dir_ = Directory::open(&c).await.unwrap();
    assert_eq!(dir_.records().len(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// When a decode's directory events were missed (its queue overflowed), reconciling with the
/// records as they stand evicts a connected rank whose record is gone (its lease ended, the
/// deletion unseen) and leaves a registered one alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciling_a_decode_evicts_a_connected_rank_whose_record_is_gone() {
    use transfer_engine::core::planner::{KvLayout, RegionKind};
    use transfer_engine::discovery::reconcile_decode;
    use transfer_engine::engine::{DecodeConfig, DecodeEngine, Pool, PrefillConfig, PrefillEngine};
    use transfer_engine::mem::{HostBuffer, HostOptions};
    let server = EtcdServer::start().unwrap();
    let c = cfg(&server, "reconcile", 30);
    let layout = KvLayout::packed(0, 2, RegionKind::Fused, 256, 8);
    let buf = || HostBuffer::new(layout.buffer_len as usize, HostOptions::default()).unwrap();
    let decode = DecodeEngine::start(
        DecodeConfig::new(2, 16, layout.clone(), 1),
        Pool::Owned(buf()),
    )
    .await
    .unwrap();
    let mut pcfg = PrefillConfig::new(decode.local_addr(), 0, 1, 2, 16, layout.clone());
    pcfg.incarnation = 77;
    let _prefill = PrefillEngine::start(pcfg, Pool::Owned(buf()))
        .await
        .unwrap();
    decode.wait_for_ranks(BOUND).await.unwrap();
    let mut rec = record(RecordRole::Prefill, 0, 4001, 77);
    rec.pp_size = 1;
    let reg = Registration::register(&c, rec).await.unwrap();
    let dir = Directory::open(&c).await.unwrap();
    assert_eq!(reconcile_decode(&decode, &dir), 0);
    assert_eq!(decode.connected_ranks(), vec![(String::new(), 0, 77)]);
    reg.revoke().await.unwrap();
    until("the record gone from the directory", BOUND, || {
        dir.records().is_empty()
    })
    .await;
    assert_eq!(reconcile_decode(&decode, &dir), 1);
    assert!(decode.connected_ranks().is_empty());
}

/// Two prefill TP ranks write into one decode TP rank (2 KV heads sliced over prefill TP 2, decode
/// TP 1). Each finds decode through etcd by the TP sizes the records carry, and decode follows
/// both ranks' records: when TP rank 1's record is revoked, that start is evicted (not TP rank
/// 0's, which holds the other slot of the same PP rank); registered again, it is readmitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_follows_every_prefill_tp_rank_that_writes_into_it() {
    use transfer_engine::control::TpMode;
    use transfer_engine::core::planner::{HeadLayout, HeadOrder, KvLayout, RegionKind};
    use transfer_engine::discovery::{find_prefill_cluster, join_decode, join_prefill};
    use transfer_engine::engine::{
        DecodeConfig, DecodeEngine, Pool, PrefillConfig, PrefillEngine, TpConfig,
    };
    use transfer_engine::mem::{HostBuffer, HostOptions};
    const HEAD: u64 = 8;
    let server = EtcdServer::start().unwrap();
    let c = cfg(&server, "tp-fan-in", 30);
    let layout = |heads: u32| {
        KvLayout::packed(0, 2, RegionKind::SplitKv, u64::from(heads) * HEAD * 16, 8).with_heads(
            HeadLayout {
                num_heads: heads,
                head_bytes: HEAD,
                page_tokens: 16,
                order: HeadOrder::TokenMajor,
            },
        )
    };
    let tp = |rank, size| TpConfig {
        rank,
        size,
        mode: TpMode::HeadSliced,
        kv_heads: 2,
    };
    let buf =
        |l: &KvLayout| HostBuffer::new(l.buffer_len as usize, HostOptions::default()).unwrap();
    let dlayout = layout(2);
    let mut dcfg = DecodeConfig::new(2, 16, dlayout.clone(), 1);
    dcfg.tp = tp(0, 1);
    dcfg.prefill_tp = Some(2);
    let decode = DecodeEngine::start(dcfg, Pool::Owned(buf(&dlayout)))
        .await
        .unwrap();
    let mut drec = record(RecordRole::Decode, 0, 0, 1);
    (drec.address, drec.pp_size) = (decode.local_addr(), 1);
    let _dm = join_decode(&c, &decode, drec).await.unwrap();
    let mut prefills = Vec::new();
    for t in 0..2u16 {
        let play = layout(1);
        let mut pcfg = PrefillConfig::new(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            0,
            1,
            2,
            16,
            play.clone(),
        );
        pcfg.tp = tp(t, 2);
        pcfg.incarnation = 500 + u64::from(t);
        let (reg, dir) =
            find_prefill_cluster(&c, &mut pcfg, std::net::IpAddr::from([127, 0, 0, 1]), BOUND)
                .await
                .unwrap();
        assert_eq!(pcfg.decode, decode.local_addr(), "TP rank {t}");
        let engine = PrefillEngine::start(pcfg, Pool::Owned(buf(&play)))
            .await
            .unwrap();
        prefills.push((engine.clone(), join_prefill(&engine, reg, dir)));
    }
    decode.wait_for_ranks(BOUND).await.unwrap();
    let both = vec![(String::new(), 0, 500), (String::new(), 0, 501)];
    assert_eq!(decode.connected_ranks(), both);
    // TP rank 1's lease ends (its record revoked; its engine stays connected).
    let (engine1, m1) = prefills.pop().unwrap();
    let rec1 = {
        let dir = Directory::open(&c).await.unwrap();
        dir.records()
            .into_iter()
            .find(|r| r.role == RecordRole::Prefill && r.tp_rank == 1)
            .unwrap()
    };
    assert_eq!((rec1.tp_size, rec1.incarnation), (2, 501));
    m1.leave().await.unwrap();
    until("TP rank 1's start evicted", BOUND, || {
        decode.connected_ranks() == vec![(String::new(), 0, 500)]
    })
    .await;
    // The same start registers again: readmitted.
    let _again = Registration::register(&c, rec1).await.unwrap();
    until("TP rank 1's start readmitted", BOUND, || {
        decode.connected_ranks() == both
    })
    .await;
    drop(engine1);
}

/// An MLA prefill TP rank at or above decode's TP size writes into no decode rank: its wait for a
/// decode ends in an error that says so, not in a plain timeout. Rank 0 of the same prefill finds
/// the same decode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_rank_that_writes_into_no_decode_rank_is_told_so() {
    use transfer_engine::control::TpMode;
    use transfer_engine::discovery::DiscoveryError;
    use transfer_engine::engine::TpConfig;
    let server = EtcdServer::start().unwrap();
    let c = cfg(&server, "mla-nowhere", 30);
    let dir = Directory::open(&c).await.unwrap();
    let mut drec = record(RecordRole::Decode, 0, 3000, 1);
    drec.pp_size = 1;
    let _d = Registration::register(&c, drec.clone()).await.unwrap();
    let tp = |rank| TpConfig {
        rank,
        size: 2,
        mode: TpMode::Replicated,
        kv_heads: 1,
    };
    let mut prec = record(RecordRole::Prefill, 0, 3001, 1);
    (prec.pp_size, prec.tp_size) = (1, 2);
    let _p = Registration::register(&c, prec).await.unwrap();
    let (found, _) = dir.wait_for_cluster("", &tp(0), 1, BOUND).await.unwrap();
    assert_eq!(found.address, drec.address);
    let err = dir
        .wait_for_cluster("", &tp(1), 1, Duration::from_secs(2))
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            DiscoveryError::WritesNowhere { rank: 1, size: 2, decode_sizes } if decode_sizes == &[1]
        ),
        "{err}"
    );
    // Sizes the mapping cannot map (identical TP, 2 against decode's 1) are not a spare rank: the
    // wait stays a timeout.
    let identical = TpConfig {
        mode: TpMode::Identical,
        ..tp(1)
    };
    let err = dir
        .wait_for_cluster("", &identical, 1, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, DiscoveryError::Timeout(_)), "{err}");
}
