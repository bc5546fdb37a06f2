//! Control plane over real loopback TCP: handshakes, rejections, hostile bytes, connect retry,
//! every message kind, split halves and cancel safety. Every wait is bounded.
#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout};
use transfer_engine::control::channel::Handshake;
use transfer_engine::control::{
    Abort, BackendInfo, BackendKind, Connection, ControlError, DEFAULT_MAX_FRAME_LEN, FrameDecoder,
    FrameError, HEADER_LEN, Hello, HelloAck, LayoutInfo, Listener, MAGIC, Msg, MsgKind,
    PROTOCOL_VERSION, Reject, RejectReason, RemoteRegion, Role, Secret, Side, TpMode,
    TransferReject, TransferRejectReason, TransferRequest, Vote, encode_to_vec, handshake,
    handshake_serving_probes, handshake_with, probe, validate_transfer_request,
};

/// Upper bound on any single wait; generous so a loaded CI machine never flakes.
const BOUND: Duration = Duration::from_secs(10);

async fn bounded<T>(f: impl Future<Output = T>) -> T {
    timeout(BOUND, f)
        .await
        .expect("operation did not finish within the bound")
}

fn deadline() -> Instant {
    Instant::now() + BOUND
}

/// The secret most tests share on both sides.
fn secret() -> Secret {
    Secret::new(b"the deployment's shared secret")
}

fn layout(first_layer: u32, layers: u32) -> LayoutInfo {
    LayoutInfo {
        num_layers: 61,
        first_layer,
        layers,
        kv_regions: 1,
        page_tokens: 64,
        bytes_per_token_per_layer: 576,
        pages: 256,
        kv_heads: 0,
        tp_mode: TpMode::Replicated,
        model_kv_heads: 0,
        token_major: false,
        key_column_bytes: 0,
    }
}

fn backend() -> BackendInfo {
    BackendInfo {
        kind: BackendKind::Ucx,
        worker_or_agent: vec![7; 200],
        agent_name: String::new(),
        regions: vec![RemoteRegion {
            addr: 0x1000,
            len: 1 << 20,
            rkey: vec![9; 32],
        }],
        landing: None,
    }
}

fn decode_hello() -> Hello {
    Hello::new("decode-0", Role::Decode, layout(0, 61), backend())
}

fn prefill_hello(rank: u16, size: u16) -> Hello {
    let per = 61 / u32::from(size);
    let first = per * u32::from(rank);
    let layers = if rank + 1 == size { 61 - first } else { per };
    Hello::new(
        format!("prefill-{rank}"),
        Role::Prefill,
        layout(first, layers),
        backend(),
    )
    .with_pp(rank, size)
}

/// A connected pair: (accepted side, connecting side).
async fn pair() -> (Connection, Connection) {
    let listener = Listener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    let (a, b) =
        bounded(async { tokio::join!(listener.accept(), Connection::connect(addr, deadline())) })
            .await;
    (a.unwrap(), b.unwrap())
}

/// Runs the handshake on both sides at once, both holding [`secret`].
async fn handshake_both(
    server: Hello,
    client: Hello,
) -> (Result<Hello, ControlError>, Result<Hello, ControlError>) {
    handshake_both_with(server, &secret(), client, &secret()).await
}

/// Runs the handshake on both sides at once, each with its own secret.
async fn handshake_both_with(
    server: Hello,
    server_secret: &Secret,
    client: Hello,
    client_secret: &Secret,
) -> (Result<Hello, ControlError>, Result<Hello, ControlError>) {
    let (mut s, mut c) = pair().await;
    bounded(async {
        tokio::join!(
            handshake(&mut s, &server, server_secret, deadline()),
            handshake(&mut c, &client, client_secret, deadline())
        )
    })
    .await
}

/// The decode side of a handshake on `server`, bounded.
async fn decode_side(server: &mut Connection) -> Result<Hello, ControlError> {
    bounded(handshake(server, &decode_hello(), &secret(), deadline())).await
}

/// A listener and a raw TCP client that speaks bytes, not frames.
async fn raw_pair() -> (Connection, TcpStream) {
    let listener = Listener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    let (a, b) = bounded(async { tokio::join!(listener.accept(), TcpStream::connect(addr)) }).await;
    (a.unwrap(), b.unwrap())
}

fn header(len: u32, version: u16, kind: MsgKind) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend(len.to_le_bytes());
    h.extend(version.to_le_bytes());
    h.extend([kind.as_u8(), 0]);
    h
}

#[tokio::test]
async fn handshake_success_both_sides_learn_the_peer() {
    let (s, c) = handshake_both(decode_hello(), prefill_hello(2, 4)).await;
    let (s, c) = (s.unwrap(), c.unwrap());
    assert_eq!(s.role, Role::Prefill);
    assert_eq!((s.pp_rank, s.pp_size), (2, 4));
    assert_eq!(s.backend, backend());
    assert_eq!(c.engine_id, "decode-0");
}

#[tokio::test]
async fn handshake_without_a_secret_on_either_side() {
    let (s, c) = handshake_both_with(
        decode_hello(),
        &Secret::none(),
        prefill_hello(0, 1),
        &Secret::none(),
    )
    .await;
    s.unwrap();
    c.unwrap();
}

fn rejected_peer(r: Result<Hello, ControlError>) -> RejectReason {
    match r {
        Err(ControlError::RejectedPeer { reason, .. }) => reason,
        other => panic!("expected RejectedPeer, got {other:?}"),
    }
}

fn peer_rejected(r: Result<Hello, ControlError>) -> RejectReason {
    match r {
        Err(ControlError::PeerRejected { reason, .. }) => reason,
        other => panic!("expected PeerRejected, got {other:?}"),
    }
}

#[tokio::test]
async fn layout_mismatch_is_explained_on_both_sides() {
    let mut p = prefill_hello(0, 1);
    p.layout.num_layers = 32;
    p.layout.layers = 32;
    let (s, c) = handshake_both(decode_hello(), p).await;
    // Both sides see the mismatch and each reports its own words for it.
    let (s, c) = (rejected_peer(s), rejected_peer(c));
    for r in [s, c] {
        let RejectReason::LayoutMismatch(text) = r else {
            panic!("{r:?}")
        };
        assert!(text.contains("61") && text.contains("32"), "{text}");
    }
}

/// A listener that serves probes (decode's) takes a probe as one; any other (a vote mesh's, a plain
/// handshake's) refuses it as a protocol error.
#[tokio::test]
async fn only_a_listener_that_serves_probes_answers_one() {
    let hello = decode_hello().with_app(b"workload".to_vec());
    let (ss, cs) = (secret(), secret());
    let (mut s, mut c) = pair().await;
    let (served, read) = bounded(async {
        tokio::join!(
            handshake_serving_probes(&mut s, &hello, &ss, deadline(), |_| Ok(())),
            probe(&mut c, Role::Prefill, &cs, deadline())
        )
    })
    .await;
    assert!(
        matches!(served, Err(ControlError::Probed { .. })),
        "{served:?}"
    );
    assert_eq!(read.unwrap().app, b"workload");

    let (mut s, mut c) = pair().await;
    let (plain, read) = bounded(async {
        tokio::join!(
            handshake_with(&mut s, &hello, &ss, deadline(), |_| Ok(())),
            probe(&mut c, Role::Prefill, &cs, deadline())
        )
    })
    .await;
    assert!(
        matches!(rejected_peer(plain), RejectReason::Protocol(ref t) if t.contains("Probe")),
        "a listener that does not serve probes answered one"
    );
    // Its Hello went out before it read the probe, as it goes to any dialer that proved the
    // secret: the probe learns no more than such a dialer, and the listener counts a failure.
    assert_eq!(read.unwrap().app, b"workload");
}

#[tokio::test]
async fn pp_mismatch() {
    let (s, c) = handshake_both(prefill_hello(0, 4), prefill_hello(1, 2)).await;
    assert!(matches!(rejected_peer(s), RejectReason::PpMismatch(_)));
    assert!(matches!(rejected_peer(c), RejectReason::PpMismatch(_)));
}

#[tokio::test]
async fn application_rejects_a_duplicate_rank() {
    let (mut s, mut c) = pair().await;
    let (d, p) = (decode_hello(), prefill_hello(1, 2));
    let key = secret();
    let (sr, cr) = bounded(async {
        tokio::join!(
            handshake_with(&mut s, &d, &key, deadline(), |h| Err(
                RejectReason::DuplicateRank {
                    pp_rank: h.pp_rank,
                    tp_rank: h.tp_rank
                }
            )),
            handshake(&mut c, &p, &key, deadline())
        )
    })
    .await;
    let expected = RejectReason::DuplicateRank {
        pp_rank: 1,
        tp_rank: 0,
    };
    assert_eq!(rejected_peer(sr), expected);
    assert_eq!(peer_rejected(cr), expected);
}

#[tokio::test]
async fn a_missing_or_wrong_secret_fails_authentication_on_both_sides() {
    for (what, client_secret) in [
        ("missing", Secret::none()),
        ("wrong", Secret::new(b"a guess")),
    ] {
        let (s, c) = handshake_both_with(
            decode_hello(),
            &secret(),
            prefill_hello(0, 1),
            &client_secret,
        )
        .await;
        // The listener checks the dialer's proof first, refuses it, and tells the dialer.
        assert_eq!(rejected_peer(s), RejectReason::AuthFailed, "{what}");
        assert_eq!(peer_rejected(c), RejectReason::AuthFailed, "{what}");
    }
}

#[tokio::test]
async fn a_vote_mesh_handshake_completes_only_with_a_vote_mesh_listener() {
    use transfer_engine::control::channel::MESH_LABEL;
    // (listener's label, dialer's label): a dial meant for a rank's vote mesh that reaches a
    // decode's listener, and one meant for decode that reaches a vote mesh, fail authentication
    // on both sides, though both hold the secret; two mesh ends complete.
    for (listen, dial, ok) in [
        (None, Some(MESH_LABEL), false),
        (Some(MESH_LABEL), None, false),
        (Some(MESH_LABEL), Some(MESH_LABEL), true),
    ] {
        let (mut s, mut c) = pair().await;
        if let Some(l) = listen {
            s.set_label(l);
        }
        if let Some(l) = dial {
            c.set_label(l);
        }
        let (server, client, key) = (prefill_hello(0, 2), prefill_hello(1, 2), secret());
        let (rs, rc) = bounded(async {
            tokio::join!(
                handshake(&mut s, &server, &key, deadline()),
                handshake(&mut c, &client, &key, deadline())
            )
        })
        .await;
        if ok {
            assert_eq!(rs.unwrap().pp_rank, 1);
            assert_eq!(rc.unwrap().pp_rank, 0);
        } else {
            assert_eq!(
                rejected_peer(rs),
                RejectReason::AuthFailed,
                "{listen:?} {dial:?}"
            );
            assert_eq!(
                peer_rejected(rc),
                RejectReason::AuthFailed,
                "{listen:?} {dial:?}"
            );
        }
    }
}

/// Reads every frame a peer sends within `for_`, without sending anything.
async fn frames_from(raw: &mut TcpStream, for_: Duration) -> (Vec<u8>, Vec<Msg>) {
    let mut bytes = Vec::new();
    let _ = timeout(for_, raw.read_to_end(&mut bytes)).await;
    let mut d = FrameDecoder::default();
    d.extend(&bytes);
    let mut msgs = Vec::new();
    while let Ok(Some(m)) = d.decode_next() {
        msgs.push(m);
    }
    (bytes, msgs)
}

/// Writes messages as frames on a raw stream.
async fn send_frames(raw: &mut TcpStream, msgs: impl IntoIterator<Item = Msg>) {
    for m in msgs {
        raw.write_all(&encode_to_vec(&m, DEFAULT_MAX_FRAME_LEN).unwrap())
            .await
            .unwrap();
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test]
async fn before_authentication_a_peer_gets_only_a_challenge() {
    let (mut server, mut raw) = raw_pair().await;
    let hello = decode_hello();
    let run =
        tokio::spawn(async move { handshake(&mut server, &hello, &secret(), deadline()).await });
    // A client that says nothing: it gets the challenge and nothing else.
    let (bytes, msgs) = frames_from(&mut raw, Duration::from_millis(300)).await;
    assert_eq!(msgs.len(), 1, "{msgs:?}");
    let Msg::Challenge(challenge) = &msgs[0] else {
        panic!("{msgs:?}")
    };
    assert_eq!(
        (challenge.role, challenge.side),
        (Role::Decode, Side::Listener)
    );
    let b = backend();
    assert!(
        !contains(&bytes, &b.worker_or_agent[..16]),
        "worker address leaked"
    );
    assert!(!contains(&bytes, &b.regions[0].rkey[..16]), "rkey leaked");
    assert!(
        !contains(&bytes, b"the deployment's shared secret"),
        "secret leaked"
    );
    // A client that answers with a challenge and a made-up proof is refused, and still learns
    // nothing more.
    let mine = transfer_engine::control::Challenge::fresh(Role::Prefill, Side::Dialer);
    send_frames(
        &mut raw,
        [
            Msg::Challenge(mine),
            Msg::Proof(transfer_engine::control::Proof {
                msg: vec![0x5a; 48],
            }),
        ],
    )
    .await;
    let r = bounded(run).await.unwrap();
    assert_eq!(rejected_peer(r), RejectReason::AuthFailed);
    let (bytes, msgs) = frames_from(&mut raw, BOUND).await;
    assert!(
        // Not even the listener's handshake message: it answers only a dialer whose message
        // authenticated, so nothing here lets the client guess the secret offline.
        matches!(
            msgs.as_slice(),
            [Msg::Reject(Reject {
                reason: RejectReason::AuthFailed
            })]
        ),
        "{msgs:?}"
    );
    assert!(
        !contains(&bytes, &b.worker_or_agent[..16]),
        "worker address leaked"
    );
    assert!(!contains(&bytes, &b.regions[0].rkey[..16]), "rkey leaked");
}

/// Sends challenge `mine` and the dialer's first Noise message built over `first` and `second`
/// (the prologue's dialer and listener challenges) with the right secret.
async fn open_as_dialer(
    raw: &mut TcpStream,
    mine: transfer_engine::control::Challenge,
    first: &transfer_engine::control::Challenge,
    second: &transfer_engine::control::Challenge,
) {
    let msg = Handshake::new(&secret(), Side::Dialer, first, second)
        .unwrap()
        .write()
        .unwrap();
    send_frames(
        raw,
        [
            Msg::Challenge(mine),
            Msg::Proof(transfer_engine::control::Proof { msg }),
        ],
    )
    .await;
}

/// Drives the client side of the authentication by hand: the right secret, but (with `swap`) the
/// two challenges in each other's place in the Noise prologue, and (with `reflect`) the server's
/// own nonce in our challenge.
async fn hand_made_client(swap: bool, reflect: bool) -> (RejectReason, Vec<Msg>) {
    let (mut server, mut raw) = raw_pair().await;
    let hello = decode_hello();
    let run =
        tokio::spawn(async move { handshake(&mut server, &hello, &secret(), deadline()).await });
    let mut d = FrameDecoder::default();
    let theirs = loop {
        let mut buf = [0u8; 256];
        let n = bounded(raw.read(&mut buf)).await.unwrap();
        d.extend(&buf[..n]);
        if let Ok(Some(Msg::Challenge(c))) = d.decode_next() {
            break c;
        }
    };
    let mut mine = transfer_engine::control::Challenge::fresh(Role::Prefill, Side::Dialer);
    if reflect {
        mine.nonce = theirs.nonce;
    }
    let (first, second) = if swap {
        (&theirs, &mine)
    } else {
        (&mine, &theirs)
    };
    let (first, second) = (first.clone(), second.clone());
    open_as_dialer(&mut raw, mine, &first, &second).await;
    let reason = rejected_peer(bounded(run).await.unwrap());
    let (_, msgs) = frames_from(&mut raw, BOUND).await;
    (reason, msgs)
}

#[tokio::test]
async fn a_handshake_message_is_bound_to_both_challenges_and_a_reflected_nonce_is_refused() {
    // The right secret over the right challenges, but in each other's place: the message of
    // another connection (where the sides were the other way round), so it must not authenticate.
    let (reason, msgs) = hand_made_client(true, false).await;
    assert_eq!(reason, RejectReason::AuthFailed);
    assert!(!msgs.iter().any(|m| matches!(m, Msg::Hello(_))), "{msgs:?}");
    // Our own nonce sent back.
    let (reason, msgs) = hand_made_client(false, true).await;
    assert!(matches!(reason, RejectReason::Protocol(_)), "{reason:?}");
    assert!(!msgs.iter().any(|m| matches!(m, Msg::Hello(_))), "{msgs:?}");
    // The control: done right, the same hand-made client gets the Hello.
    let (mut server, mut raw) = raw_pair().await;
    let hello = decode_hello();
    let run =
        tokio::spawn(async move { handshake(&mut server, &hello, &secret(), deadline()).await });
    let (_, msgs) = frames_from(&mut raw, Duration::from_millis(200)).await;
    let Some(Msg::Challenge(theirs)) = msgs.first() else {
        panic!("{msgs:?}")
    };
    let mine = transfer_engine::control::Challenge::fresh(Role::Prefill, Side::Dialer);
    let theirs = theirs.clone();
    open_as_dialer(&mut raw, mine.clone(), &mine, &theirs).await;
    let (bytes, msgs) = frames_from(&mut raw, Duration::from_millis(500)).await;
    // The listener's answer, then its Hello, sealed: no frame and nothing of it in clear.
    assert!(matches!(msgs.as_slice(), [Msg::Proof(_)]), "{msgs:?}");
    let b = backend();
    assert!(
        bytes.len() > 200,
        "no Hello after the answer: {} bytes",
        bytes.len()
    );
    assert!(
        !contains(&bytes, &b.worker_or_agent[..16]),
        "worker address in clear"
    );
    assert!(!contains(&bytes, &b.regions[0].rkey[..16]), "rkey in clear");
    run.abort();
}

#[tokio::test]
async fn a_large_frame_before_authentication_is_refused_from_its_header() {
    let (mut server, mut raw) = raw_pair().await;
    // 2 KiB claimed: far below the connection's cap, above what authentication allows.
    raw.write_all(&header(2048, PROTOCOL_VERSION, MsgKind::Hello))
        .await
        .unwrap();
    let r = decode_side(&mut server).await;
    assert!(
        matches!(
            r,
            Err(ControlError::Frame {
                source: FrameError::TooLarge {
                    len: 2048,
                    max: 1024,
                    ..
                },
                ..
            })
        ),
        "{r:?}"
    );
}

#[tokio::test]
async fn version_mismatch_in_hello() {
    let mut p = prefill_hello(0, 1);
    p.protocol_version = PROTOCOL_VERSION + 1;
    let (s, c) = handshake_both(decode_hello(), p).await;
    assert_eq!(
        rejected_peer(s),
        RejectReason::VersionMismatch {
            local: PROTOCOL_VERSION,
            remote: PROTOCOL_VERSION + 1
        }
    );
    assert_eq!(
        rejected_peer(c),
        RejectReason::VersionMismatch {
            local: PROTOCOL_VERSION + 1,
            remote: PROTOCOL_VERSION
        }
    );
}

#[tokio::test]
async fn version_mismatch_in_frame_header_is_answered_with_a_reject() {
    let (mut server, mut raw) = raw_pair().await;
    // A peer of the next version: the header layout is frozen, only the version differs.
    let mut frame = header(3, PROTOCOL_VERSION + 1, MsgKind::Hello);
    frame.extend([1, 2, 3]);
    raw.write_all(&frame).await.unwrap();
    let err = decode_side(&mut server).await;
    assert_eq!(
        rejected_peer(err),
        RejectReason::VersionMismatch {
            local: PROTOCOL_VERSION,
            remote: PROTOCOL_VERSION + 1
        }
    );
    drop(server);
    // The raw peer reads our Challenge (nothing more before authentication), then our Reject, then
    // the end of the stream.
    let mut bytes = Vec::new();
    bounded(raw.read_to_end(&mut bytes)).await.unwrap();
    let mut d = FrameDecoder::default();
    d.extend(&bytes);
    assert!(matches!(d.decode_next(), Ok(Some(Msg::Challenge(_)))));
    let Ok(Some(Msg::Reject(Reject { reason }))) = d.decode_next() else {
        panic!("no reject")
    };
    assert_eq!(
        reason,
        RejectReason::VersionMismatch {
            local: PROTOCOL_VERSION,
            remote: PROTOCOL_VERSION + 1
        }
    );
}

#[tokio::test]
async fn unexpected_message_during_handshake() {
    let (mut s, mut c) = pair().await;
    let client = async {
        c.send(&Msg::Abort(Abort {
            request: 1,
            reason: 0,
        }))
        .await
        .unwrap();
        // Read what the server sends: its Challenge, then its Reject.
        let first = c.recv().await.unwrap();
        let second = c.recv().await.unwrap();
        (first, second)
    };
    let (d, key) = (decode_hello(), secret());
    let (sr, (first, second)) =
        bounded(async { tokio::join!(handshake(&mut s, &d, &key, deadline()), client) }).await;
    assert!(matches!(rejected_peer(sr), RejectReason::Protocol(_)));
    assert!(matches!(first, Some(Msg::Challenge(_))));
    assert!(matches!(
        second,
        Some(Msg::Reject(Reject {
            reason: RejectReason::Protocol(_)
        }))
    ));
}

#[tokio::test]
async fn handshake_times_out_on_a_silent_peer() {
    let (mut server, _raw) = raw_pair().await;
    let start = Instant::now();
    let r = bounded(handshake(
        &mut server,
        &decode_hello(),
        &secret(),
        Instant::now() + Duration::from_millis(200),
    ))
    .await;
    assert!(
        matches!(r, Err(ControlError::HandshakeTimeout { .. })),
        "{r:?}"
    );
    assert!(start.elapsed() < BOUND);
}

#[tokio::test]
async fn oversize_frame_is_refused_from_its_header() {
    let (mut server, mut raw) = raw_pair().await;
    // Claim 1 GiB and send nothing of it; keep the connection open so only the header can decide.
    raw.write_all(&header(1 << 30, PROTOCOL_VERSION, MsgKind::Vote))
        .await
        .unwrap();
    let r = bounded(server.recv()).await;
    match r {
        Err(ControlError::Frame {
            source: FrameError::TooLarge { len, max, kind },
            ..
        }) => {
            assert_eq!(
                (len, max, kind),
                (1 << 30, DEFAULT_MAX_FRAME_LEN, MsgKind::Vote)
            );
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    // The stream is out of step now; the reader says so instead of guessing.
    assert!(matches!(
        bounded(server.recv()).await,
        Err(ControlError::Broken { .. })
    ));
}

#[tokio::test]
async fn configured_cap_applies_both_ways() {
    let (s, mut c) = pair().await;
    let mut s = s.with_max_frame_len(64);
    let big = Msg::Vote(Vote {
        bytes: vec![1; 100],
    });
    // Our own sender refuses, and the connection stays usable.
    let e = bounded(s.send(&big)).await.unwrap_err();
    assert!(
        matches!(
            e,
            ControlError::Frame {
                source: FrameError::TooLarge { .. },
                ..
            }
        ),
        "{e:?}"
    );
    bounded(s.send(&Msg::Close)).await.unwrap();
    assert!(matches!(bounded(c.recv()).await.unwrap(), Some(Msg::Close)));
    // And our receiver refuses the peer's.
    bounded(c.send(&big)).await.unwrap();
    let e = bounded(s.recv()).await.unwrap_err();
    assert!(
        matches!(
            e,
            ControlError::Frame {
                source: FrameError::TooLarge { len: 101, .. },
                ..
            }
        ),
        "{e:?}"
    );
}

#[tokio::test]
async fn garbage_bytes_give_a_typed_error() {
    let (mut server, mut raw) = raw_pair().await;
    raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let r = bounded(server.recv()).await;
    assert!(
        matches!(
            r,
            Err(ControlError::Frame {
                source: FrameError::BadMagic { .. },
                ..
            })
        ),
        "{r:?}"
    );
    assert!(matches!(
        bounded(server.recv()).await,
        Err(ControlError::Broken { .. })
    ));
}

#[tokio::test]
async fn garbage_during_handshake_gives_a_typed_error() {
    let (mut server, mut raw) = raw_pair().await;
    raw.write_all(&[0xFF; 64]).await.unwrap();
    let r = decode_side(&mut server).await;
    assert!(
        matches!(
            r,
            Err(ControlError::Frame {
                source: FrameError::BadMagic { .. },
                ..
            })
        ),
        "{r:?}"
    );
}

#[tokio::test]
async fn truncated_stream_is_typed_and_clean_eof_is_none() {
    let (mut server, mut raw) = raw_pair().await;
    let wire = encode_to_vec(
        &Msg::Vote(Vote { bytes: vec![5; 40] }),
        DEFAULT_MAX_FRAME_LEN,
    )
    .unwrap();
    raw.write_all(&wire[..20]).await.unwrap();
    raw.shutdown().await.unwrap();
    let r = bounded(server.recv()).await;
    assert!(
        matches!(
            r,
            Err(ControlError::Frame {
                source: FrameError::Truncated { got: 20, .. },
                ..
            })
        ),
        "{r:?}"
    );

    let (mut server, mut raw) = raw_pair().await;
    raw.write_all(&wire).await.unwrap();
    raw.shutdown().await.unwrap();
    assert!(matches!(
        bounded(server.recv()).await.unwrap(),
        Some(Msg::Vote(_))
    ));
    assert!(bounded(server.recv()).await.unwrap().is_none());
}

#[tokio::test]
async fn recv_is_cancel_safe() {
    let (mut server, mut raw) = raw_pair().await;
    let wire = encode_to_vec(
        &Msg::Vote(Vote {
            bytes: vec![77; 40],
        }),
        DEFAULT_MAX_FRAME_LEN,
    )
    .unwrap();
    // Half the header, then a cancelled recv; half the rest, another cancelled recv.
    for part in [
        &wire[..HEADER_LEN / 2],
        &wire[HEADER_LEN / 2..HEADER_LEN + 2],
    ] {
        raw.write_all(part).await.unwrap();
        raw.flush().await.unwrap();
        let early = timeout(Duration::from_millis(50), server.recv()).await;
        assert!(early.is_err(), "recv returned early: {early:?}");
    }
    raw.write_all(&wire[HEADER_LEN + 2..]).await.unwrap();
    let got = bounded(server.recv()).await.unwrap();
    assert!(
        matches!(&got, Some(Msg::Vote(v)) if v.bytes == [77; 40]),
        "{got:?}"
    );
}

/// A loopback port free now, drawn below the kernel's range for ephemeral ports: a port the kernel
/// handed out and took back may be handed out again at once (to another test's connection, or to
/// the connecting socket itself), one below the range only to a test that binds it.
fn unused_port() -> u16 {
    let range: Vec<u16> = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let (low, high) = match range[..] {
        [low, high] => (low, high),
        _ => (32768, 60999),
    };
    // Below the range where it leaves room, else above it.
    let ports = if low > 11_000 {
        10_000..low
    } else if high < 64_000 {
        high + 1..u16::MAX
    } else {
        panic!("the ephemeral range {low}..={high} leaves no port outside it to draw");
    };
    for _ in 0..1000 {
        let port = rand::random_range(ports.clone());
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {ports:?}");
}

#[tokio::test]
async fn connect_retries_until_the_listener_appears() {
    // A port nobody listens on, so the first attempts are refused.
    let port = unused_port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let server = tokio::spawn(async move {
        // The delay is the scenario (a peer that starts late), not a wait for a result.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let listener = Listener::bind(addr).await.unwrap();
        let mut conn = listener.accept().await.unwrap();
        handshake(&mut conn, &decode_hello(), &secret(), deadline()).await
    });
    let mut conn = bounded(Connection::connect(addr, deadline()))
        .await
        .unwrap();
    let remote = bounded(handshake(
        &mut conn,
        &prefill_hello(0, 1),
        &secret(),
        deadline(),
    ))
    .await
    .unwrap();
    assert_eq!(remote.role, Role::Decode);
    bounded(server).await.unwrap().unwrap();
}

#[tokio::test]
async fn connect_times_out_when_nobody_listens() {
    let port = unused_port();
    let start = Instant::now();
    let r = bounded(Connection::connect(
        format!("127.0.0.1:{port}"),
        Instant::now() + Duration::from_millis(300),
    ))
    .await;
    match r {
        Err(ControlError::ConnectTimeout { attempts, last, .. }) => {
            assert!(attempts > 1, "only {attempts} attempt(s)");
            assert_eq!(last.unwrap().kind(), std::io::ErrorKind::ConnectionRefused);
        }
        other => panic!("expected ConnectTimeout, got {other:?}"),
    }
    assert!(start.elapsed() >= Duration::from_millis(300));
}

#[tokio::test]
async fn connect_fails_at_once_on_an_unresolvable_name() {
    let r = bounded(Connection::connect("no-such-host.invalid:1", deadline())).await;
    assert!(matches!(r, Err(ControlError::Connect { .. })), "{r:?}");
}

fn every_message() -> Vec<Msg> {
    vec![
        Msg::Hello(prefill_hello(1, 4).with_tp(1, 2)),
        Msg::HelloAck(HelloAck {
            engine_id: "d".into(),
        }),
        Msg::Reject(Reject {
            reason: RejectReason::PpMismatch("x".into()),
        }),
        Msg::TransferRequest(TransferRequest {
            request: 1,
            prompt_tokens: 8192,
            chunk_tokens: 1024,
            dst_pages: (0..128).collect(),
            prefix_tokens: 0,
            deadline_ms: 5000,
            landing: None,
        }),
        Msg::TransferReject(TransferReject {
            request: 1,
            reason: TransferRejectReason::UnknownRequest { request: 1 },
        }),
        Msg::Abort(Abort {
            request: 2,
            reason: 1,
        }),
        Msg::Vote(Vote { bytes: vec![3; 64] }),
        // A large one, to cross many reads.
        Msg::Vote(Vote {
            bytes: (0..=255u8).cycle().take(3 << 20).collect(),
        }),
        Msg::Close,
        Msg::Challenge(transfer_engine::control::Challenge {
            nonce: [8; 32],
            role: Role::Decode,
            side: Side::Listener,
        }),
        Msg::Proof(transfer_engine::control::Proof { msg: vec![4; 48] }),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_round_trips_over_split_halves() {
    let (s, c) = pair().await;
    let (s_rx, mut s_tx) = s.into_split();
    let (c_rx, mut c_tx) = c.into_split();
    // Both directions at once, each half in its own task.
    let send_c = tokio::spawn(async move {
        for m in every_message() {
            c_tx.send(&m).await.unwrap();
        }
        c_tx.close().await.unwrap();
    });
    let send_s = tokio::spawn(async move {
        for m in every_message() {
            s_tx.send(&m).await.unwrap();
        }
        s_tx.close().await.unwrap();
    });
    let recv_all = |mut rx: transfer_engine::control::ControlReader| async move {
        let mut got = Vec::new();
        while let Some(m) = rx.recv().await.unwrap() {
            got.push(m);
        }
        got
    };
    let (a, b) =
        bounded(async { tokio::join!(tokio::spawn(recv_all(s_rx)), tokio::spawn(recv_all(c_rx))) })
            .await;
    bounded(send_c).await.unwrap();
    bounded(send_s).await.unwrap();
    let mut expected = every_message();
    expected.push(Msg::Close);
    for got in [a.unwrap(), b.unwrap()] {
        // Not assert_eq: a failure would print a 3 MiB vote.
        assert_eq!(got.len(), expected.len());
        let first = got.iter().zip(&expected).position(|(g, e)| g != e);
        assert!(
            first.is_none(),
            "message {first:?} differs: {:?}",
            first.map(|i| got[i].kind())
        );
    }
}

#[tokio::test]
async fn out_of_range_pages_get_a_typed_rejection_and_nothing_else_is_disturbed() {
    let (mut prefill, mut decode) = pair().await;
    let registered = decode_hello().layout.pages;
    let page_tokens = decode_hello().layout.page_tokens;
    // The prefill side's loop: validate each request against the decode side's registration,
    // reject the bad ones, echo the good ones as "accepted" via a Vote for the test to see.
    let server = async move {
        while let Some(msg) = prefill.recv().await.unwrap() {
            let Msg::TransferRequest(req) = msg else {
                break;
            };
            let expected = req.prompt_tokens.div_ceil(page_tokens) as usize;
            let reply = match validate_transfer_request(&req, registered, expected) {
                Ok(()) => Msg::Vote(Vote {
                    bytes: req.request.to_le_bytes().to_vec(),
                }),
                Err(reason) => Msg::TransferReject(TransferReject {
                    request: req.request,
                    reason,
                }),
            };
            prefill.send(&reply).await.unwrap();
        }
    };
    let client = async move {
        let mk = |request, dst_pages| TransferRequest {
            request,
            prompt_tokens: 128,
            chunk_tokens: 64,
            dst_pages,
            prefix_tokens: 0,
            deadline_ms: 1000,
            landing: None,
        };
        decode
            .send(&Msg::TransferRequest(mk(1, vec![0, 1])))
            .await
            .unwrap();
        decode
            .send(&Msg::TransferRequest(mk(2, vec![5, registered])))
            .await
            .unwrap();
        decode
            .send(&Msg::TransferRequest(mk(3, vec![2, 3])))
            .await
            .unwrap();
        let mut replies = Vec::new();
        for _ in 0..3 {
            replies.push(decode.recv().await.unwrap().unwrap());
        }
        decode.close().await.unwrap();
        replies
    };
    let ((), replies) = bounded(async { tokio::join!(server, client) }).await;
    assert!(matches!(&replies[0], Msg::Vote(v) if v.bytes == 1u64.to_le_bytes()));
    assert!(matches!(
        &replies[1],
        Msg::TransferReject(TransferReject {
            request: 2,
            reason: TransferRejectReason::PageOutOfRange { position: 1, page, registered: r },
        }) if *page == registered && *r == registered
    ));
    assert!(matches!(&replies[2], Msg::Vote(v) if v.bytes == 3u64.to_le_bytes()));
}
