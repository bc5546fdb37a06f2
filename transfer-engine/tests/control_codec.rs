//! Control plane, without sockets: frame codec, message round trips, Hello compatibility rules and
//! the transfer-request bounds check.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use transfer_engine::control::{
    Abort, AbortAck, AuxData, BackendInfo, BackendKind, DEFAULT_MAX_FRAME_LEN, FrameDecoder,
    FrameError, FrameHeader, HEADER_LEN, Hello, HelloAck, Landed, Landing, LayoutInfo, MAGIC, Msg,
    MsgKind, PROTOCOL_VERSION, Reject, RejectReason, RemoteRegion, Role, Secret, Side, TpMode,
    TransferReject, TransferRejectReason, TransferRequest, Vote, check_hello, encode_to_vec,
    validate_landing, validate_prefix, validate_transfer_request,
};

fn layout(first_layer: u32, layers: u32) -> LayoutInfo {
    LayoutInfo {
        num_layers: 61,
        first_layer,
        layers,
        kv_regions: 1,
        page_tokens: 64,
        bytes_per_token_per_layer: 576,
        pages: 4096,
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
        worker_or_agent: vec![0xAB; 300],
        agent_name: String::new(),
        regions: vec![RemoteRegion {
            addr: 0x7f00_0000_0000,
            len: 1 << 30,
            rkey: vec![1, 2, 3, 4],
        }],
        landing: Some(RemoteRegion {
            addr: 0x7e00_0000_0000,
            len: 256 << 20,
            rkey: Vec::new(),
        }),
    }
}

fn decode_hello() -> Hello {
    Hello::new("decode-0", Role::Decode, layout(0, 61), backend())
}

fn prefill_hello(rank: u16, size: u16) -> Hello {
    // An uneven split, as real PP splits are: 61 layers over `size` ranks.
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
    .with_incarnation(0x1234_5678_9abc_def0 + u64::from(rank))
}

fn every_message() -> Vec<Msg> {
    vec![
        Msg::Hello(prefill_hello(1, 4).with_tp(1, 2)),
        Msg::Hello(decode_hello().with_app(b"{\"prompt_tokens\":8192}".to_vec())),
        Msg::Challenge(transfer_engine::control::Challenge {
            nonce: [0xc4; 32],
            role: Role::Prefill,
            side: Side::Dialer,
        }),
        Msg::Proof(transfer_engine::control::Proof {
            msg: vec![0x9f; 48],
        }),
        Msg::HelloAck(HelloAck {
            engine_id: "decode-0".into(),
        }),
        Msg::Reject(Reject {
            reason: RejectReason::LayoutMismatch("61 vs 32 layers".into()),
        }),
        Msg::Reject(Reject {
            reason: RejectReason::VersionMismatch {
                local: 1,
                remote: 2,
            },
        }),
        Msg::TransferRequest(TransferRequest {
            request: u64::MAX,
            prompt_tokens: 8192,
            chunk_tokens: 1024,
            dst_pages: (0..128).collect(),
            prefix_tokens: 4096,
            deadline_ms: 30_000,
            landing: Some(Landing {
                offset: 1 << 20,
                chunk_stride: 16 << 20,
                slots: 2,
            }),
        }),
        Msg::TransferReject(TransferReject {
            request: 9,
            reason: TransferRejectReason::PageOutOfRange {
                position: 3,
                page: 5000,
                registered: 4096,
            },
        }),
        Msg::Abort(Abort {
            request: 42,
            reason: 3,
        }),
        Msg::Vote(Vote {
            bytes: vec![1, 2, 3, 4, 5],
        }),
        Msg::Close,
        Msg::AbortAck(AbortAck { request: 42 }),
        Msg::Aux(AuxData {
            request: 42,
            data: vec![7; 300],
        }),
        Msg::Ready,
        Msg::Heartbeat,
        Msg::NotReady,
        Msg::Probe,
        Msg::Landed(Landed {
            request: u64::MAX,
            chunk: 7,
        }),
    ]
}

fn same(a: &Msg, b: &Msg) -> bool {
    a == b
}

#[test]
fn every_kind_round_trips_whole_and_byte_by_byte() {
    let msgs = every_message();
    let mut wire = Vec::new();
    for m in &msgs {
        wire.extend(encode_to_vec(m, DEFAULT_MAX_FRAME_LEN).unwrap());
    }
    // All at once.
    let mut d = FrameDecoder::default();
    d.extend(&wire);
    for m in &msgs {
        assert!(same(&d.decode_next().unwrap().unwrap(), m));
    }
    assert!(d.decode_next().unwrap().is_none());
    assert!(d.finish().is_none());
    // One byte at a time.
    let mut d = FrameDecoder::default();
    let mut got = Vec::new();
    for b in &wire {
        d.extend(std::slice::from_ref(b));
        while let Some(m) = d.decode_next().unwrap() {
            got.push(m);
        }
    }
    assert_eq!(got.len(), msgs.len());
    assert!(got.iter().zip(&msgs).all(|(a, b)| same(a, b)));
}

#[test]
fn handshake_messages_depend_on_secret_sides_roles_and_both_nonces_and_the_secret_is_never_printed()
{
    use transfer_engine::control::Challenge;
    use transfer_engine::control::channel::Handshake;
    let key = Secret::new(b"hunter2");
    let dialer = Challenge {
        nonce: [1; 32],
        role: Role::Prefill,
        side: Side::Dialer,
    };
    let listener = Challenge {
        nonce: [2; 32],
        role: Role::Decode,
        side: Side::Listener,
    };
    // The dialer's first message, read by a listener with `secret` that saw `d` and `l`.
    let first = Handshake::new(&key, Side::Dialer, &dialer, &listener)
        .unwrap()
        .write()
        .unwrap();
    let accepts = |secret: &Secret, d: &Challenge, l: &Challenge| {
        Handshake::new(secret, Side::Listener, d, l)
            .unwrap()
            .read(&first)
    };
    assert!(accepts(&key, &dialer, &listener));
    // Every input changes what authenticates.
    assert!(!accepts(&Secret::new(b"hunter3"), &dialer, &listener));
    assert!(!accepts(&Secret::none(), &dialer, &listener));
    let mut other = dialer.clone();
    other.nonce[31] ^= 1;
    assert!(!accepts(&key, &other, &listener));
    let mut other = listener.clone();
    other.nonce[0] ^= 1;
    assert!(!accepts(&key, &dialer, &other));
    let mut other = listener.clone();
    other.role = Role::Prefill;
    assert!(!accepts(&key, &dialer, &other));
    let mut other = dialer.clone();
    other.side = Side::Listener;
    assert!(!accepts(&key, &other, &listener));
    // Swapping the challenges is a different transcript.
    assert!(!accepts(&key, &listener, &dialer));
    // A changed byte of the message.
    let mut flipped = first.clone();
    flipped[40] ^= 1;
    assert!(
        !Handshake::new(&key, Side::Listener, &dialer, &listener)
            .unwrap()
            .read(&flipped)
    );
    assert!(!format!("{key:?}").contains("hunter2"));
    assert!(Secret::none().is_none());
    assert!(!key.is_none());
}

#[test]
fn header_layout_is_as_documented() {
    let wire = encode_to_vec(&Msg::Close, DEFAULT_MAX_FRAME_LEN).unwrap();
    assert_eq!(wire.len(), HEADER_LEN);
    assert_eq!(&wire[0..4], &MAGIC);
    assert_eq!(&wire[4..8], &0u32.to_le_bytes());
    assert_eq!(&wire[8..10], &PROTOCOL_VERSION.to_le_bytes());
    assert_eq!(wire[10], MsgKind::Close.as_u8());
    assert_eq!(wire[11], 0);
}

fn header(len: u32, version: u16, kind: u8, reserved: u8) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend(len.to_le_bytes());
    h.extend(version.to_le_bytes());
    h.extend([kind, reserved]);
    h
}

fn decode_err(bytes: &[u8], max: u32) -> FrameError {
    let mut d = FrameDecoder::new(max);
    d.extend(bytes);
    let e = d.decode_next().unwrap_err();
    assert!(d.is_poisoned() == e.is_fatal());
    e
}

#[test]
fn garbage_is_refused_at_the_first_byte() {
    assert!(matches!(
        decode_err(b"G", 1024),
        FrameError::BadMagic { .. }
    ));
    assert!(matches!(
        decode_err(b"GET / HTTP/1.1\r\n\r\n", 1024),
        FrameError::BadMagic { .. }
    ));
}

#[test]
fn header_errors_are_typed() {
    assert!(matches!(
        decode_err(&header(0, 99, 1, 0), 1024),
        FrameError::UnsupportedVersion {
            got: 99,
            supported: PROTOCOL_VERSION
        }
    ));
    assert!(matches!(
        decode_err(&header(0, PROTOCOL_VERSION, 200, 0), 1024),
        FrameError::UnknownKind { kind: 200, .. }
    ));
    assert!(matches!(
        decode_err(&header(0, PROTOCOL_VERSION, 8, 1), 1024),
        FrameError::ReservedByte { got: 1 }
    ));
}

#[test]
fn oversize_header_is_refused_from_the_header_alone() {
    // Only the 12 header bytes exist: the refusal cannot depend on reading the body.
    let e = decode_err(
        &header(1 << 30, PROTOCOL_VERSION, MsgKind::Vote.as_u8(), 0),
        DEFAULT_MAX_FRAME_LEN,
    );
    assert!(
        matches!(
            e,
            FrameError::TooLarge {
                kind: MsgKind::Vote,
                len: 0x4000_0000,
                max: DEFAULT_MAX_FRAME_LEN
            }
        ),
        "{e:?}"
    );
    let mut d = FrameDecoder::new(100);
    let big = encode_to_vec(
        &Msg::Vote(Vote {
            bytes: vec![0; 200],
        }),
        DEFAULT_MAX_FRAME_LEN,
    )
    .unwrap();
    d.extend(&big[..HEADER_LEN]);
    assert!(matches!(d.decode_next(), Err(FrameError::TooLarge { .. })));
    // And it stays refused.
    assert!(matches!(d.decode_next(), Err(FrameError::TooLarge { .. })));
}

#[test]
fn encoder_refuses_what_the_receiver_would() {
    let mut out = vec![9, 9];
    let e = transfer_engine::control::encode_frame(
        &Msg::Vote(Vote {
            bytes: vec![0; 200],
        }),
        100,
        &mut out,
    )
    .unwrap_err();
    assert!(matches!(
        e,
        FrameError::TooLarge {
            kind: MsgKind::Vote,
            max: 100,
            ..
        }
    ));
    assert_eq!(out, [9, 9], "a refused encode leaves the buffer as it was");
}

#[test]
fn truncation_is_typed() {
    let wire = encode_to_vec(
        &Msg::Abort(Abort {
            request: 1,
            reason: 2,
        }),
        DEFAULT_MAX_FRAME_LEN,
    )
    .unwrap();
    for cut in 1..wire.len() {
        let mut d = FrameDecoder::default();
        d.extend(&wire[..cut]);
        assert!(d.decode_next().unwrap().is_none());
        assert!(
            matches!(d.finish(), Some(FrameError::Truncated { got, .. }) if got == cut),
            "cut at {cut}"
        );
    }
}

#[test]
fn payload_errors_consume_the_frame_and_keep_the_stream() {
    let mut d = FrameDecoder::default();
    // An Abort payload cut short: valid header, one byte of a varint that never ends.
    let mut bad = header(1, PROTOCOL_VERSION, MsgKind::Abort.as_u8(), 0);
    bad.push(0xFF);
    d.extend(&bad);
    // Close with a body, and a Vote with bytes after its end.
    let mut close = header(2, PROTOCOL_VERSION, MsgKind::Close.as_u8(), 0);
    close.extend([0, 0]);
    d.extend(&close);
    let mut vote =
        encode_to_vec(&Msg::Vote(Vote { bytes: vec![7] }), DEFAULT_MAX_FRAME_LEN).unwrap();
    vote[4] += 1;
    vote.push(0);
    d.extend(&vote);
    d.extend(&encode_to_vec(&Msg::Close, DEFAULT_MAX_FRAME_LEN).unwrap());
    assert!(matches!(
        d.decode_next(),
        Err(FrameError::Payload {
            kind: MsgKind::Abort,
            ..
        })
    ));
    assert!(matches!(
        d.decode_next(),
        Err(FrameError::TrailingBytes {
            kind: MsgKind::Close,
            extra: 2
        })
    ));
    assert!(matches!(
        d.decode_next(),
        Err(FrameError::TrailingBytes {
            kind: MsgKind::Vote,
            extra: 1
        })
    ));
    assert!(matches!(d.decode_next(), Ok(Some(Msg::Close))));
    assert!(!d.is_poisoned());
}

#[test]
fn frame_header_encode_decode() {
    let h = FrameHeader {
        len: 5,
        version: PROTOCOL_VERSION,
        kind: MsgKind::Hello,
    };
    assert_eq!(FrameHeader::decode(&h.encode(), 5).unwrap(), h);
    assert!(FrameHeader::decode(&h.encode(), 4).is_err());
}

// ---- Hello compatibility ----

fn reject(local: &Hello, remote: &Hello) -> RejectReason {
    check_hello(local, remote).unwrap_err()
}

#[test]
fn prefill_and_decode_accept_each_other() {
    for r in 0..4 {
        let p = prefill_hello(r, 4);
        check_hello(&decode_hello(), &p).unwrap();
        check_hello(&p, &decode_hello()).unwrap();
    }
}

#[test]
fn pp_peers_accept_each_other() {
    check_hello(&prefill_hello(0, 4), &prefill_hello(3, 4)).unwrap();
}

#[test]
fn version_mismatch() {
    let mut p = prefill_hello(0, 1);
    p.protocol_version = PROTOCOL_VERSION + 1;
    assert_eq!(
        reject(&decode_hello(), &p),
        RejectReason::VersionMismatch {
            local: PROTOCOL_VERSION,
            remote: PROTOCOL_VERSION + 1
        }
    );
}

#[test]
fn layout_mismatch_is_explained() {
    let mut p = prefill_hello(0, 1);
    p.layout.num_layers = 32;
    p.layout.layers = 32;
    let r = reject(&decode_hello(), &p);
    assert!(matches!(r, RejectReason::LayoutMismatch(_)));
    let text = r.to_string();
    assert!(
        text.contains("61") && text.contains("32") && text.contains("layers"),
        "{text}"
    );

    // Prefill and decode pages may differ in size (the planner maps them); the ranks of one
    // pipeline may not.
    let mut p = prefill_hello(0, 1);
    p.layout.page_tokens = 16;
    assert_eq!(check_hello(&decode_hello(), &p), Ok(()));
    let mut p1 = prefill_hello(1, 2);
    p1.layout.page_tokens = 16;
    let text = reject(&prefill_hello(0, 2), &p1).to_string();
    assert!(text.contains("64 tokens") && text.contains("16"), "{text}");

    let mut p = prefill_hello(0, 1);
    p.layout.kv_regions = 2;
    assert!(matches!(
        reject(&decode_hello(), &p),
        RejectReason::LayoutMismatch(_)
    ));

    let mut p = prefill_hello(0, 1);
    p.layout.bytes_per_token_per_layer = 512;
    let text = reject(&decode_hello(), &p).to_string();
    assert!(text.contains("576") && text.contains("512"), "{text}");

    // A prefill rank holding layers the decode side does not.
    let mut d = decode_hello();
    d.layout.first_layer = 10;
    d.layout.layers = 51;
    let text = reject(&d, &prefill_hello(0, 4)).to_string();
    assert!(text.contains("0..15") && text.contains("10..61"), "{text}");
}

#[test]
fn role_pp_tp_and_rank_mismatches() {
    assert!(matches!(
        reject(&decode_hello(), &decode_hello()),
        RejectReason::RoleMismatch(_)
    ));
    let r = reject(&prefill_hello(0, 4), &prefill_hello(1, 2));
    assert!(matches!(r, RejectReason::PpMismatch(_)));
    assert!(r.to_string().contains('4') && r.to_string().contains('2'));
    assert_eq!(
        reject(&prefill_hello(1, 4), &prefill_hello(1, 4)),
        RejectReason::DuplicateRank {
            pp_rank: 1,
            tp_rank: 0
        }
    );
    let mut overlapping = prefill_hello(1, 4);
    overlapping.layout.first_layer = 10;
    assert!(matches!(
        reject(&prefill_hello(0, 4), &overlapping),
        RejectReason::PpMismatch(_)
    ));
    assert!(matches!(
        reject(&prefill_hello(0, 4), &prefill_hello(1, 4).with_tp(0, 2)),
        RejectReason::TpMismatch(_)
    ));
}

#[test]
fn self_contradictory_hello_is_invalid() {
    let mut p = prefill_hello(0, 4);
    p.pp_rank = 4;
    assert!(matches!(
        reject(&decode_hello(), &p),
        RejectReason::InvalidHello(_)
    ));
    let p = prefill_hello(0, 1).with_tp(2, 2);
    assert!(matches!(
        reject(&decode_hello(), &p),
        RejectReason::InvalidHello(_)
    ));
    let mut p = prefill_hello(0, 1);
    p.layout.first_layer = 60;
    assert!(matches!(
        reject(&decode_hello(), &p),
        RejectReason::InvalidHello(_)
    ));
    let mut p = prefill_hello(0, 1);
    p.layout.kv_regions = 3;
    assert!(matches!(
        reject(&decode_hello(), &p),
        RejectReason::InvalidHello(_)
    ));
    // An application part past its bound, from either side.
    let big = vec![0u8; transfer_engine::control::MAX_APP_INFO + 1];
    let p = prefill_hello(0, 1).with_app(big.clone());
    assert!(matches!(
        reject(&decode_hello(), &p),
        RejectReason::InvalidHello(_)
    ));
    let d = decode_hello().with_app(big);
    assert!(matches!(
        reject(&prefill_hello(0, 1), &d),
        RejectReason::InvalidHello(_)
    ));
}

#[test]
fn backend_mismatch() {
    let mut p = prefill_hello(0, 1);
    p.backend.kind = BackendKind::Nixl;
    assert_eq!(
        reject(&decode_hello(), &p),
        RejectReason::BackendMismatch {
            local: BackendKind::Ucx,
            remote: BackendKind::Nixl
        }
    );
}

#[test]
fn tp_mappings() {
    let gqa = |tp_rank: u16, tp_size: u16, mode: TpMode, role: Role| {
        let heads = 8 / u32::from(tp_size);
        let l = LayoutInfo {
            num_layers: 32,
            first_layer: 0,
            layers: 32,
            kv_regions: 2,
            page_tokens: 16,
            bytes_per_token_per_layer: 4096 / u64::from(tp_size),
            pages: 100,
            kv_heads: heads,
            tp_mode: mode,
            model_kv_heads: 8,
            token_major: true,
            key_column_bytes: 0,
        };
        Hello::new("x", role, l, backend()).with_tp(tp_rank, tp_size)
    };
    // Head-sliced: prefill TP 2, decode TP 4.
    check_hello(
        &gqa(0, 4, TpMode::HeadSliced, Role::Decode),
        &gqa(1, 2, TpMode::HeadSliced, Role::Prefill),
    )
    .unwrap();
    // Identical mapping needs equal TP sizes.
    assert!(matches!(
        reject(
            &gqa(0, 4, TpMode::Identical, Role::Decode),
            &gqa(0, 2, TpMode::Identical, Role::Prefill)
        ),
        RejectReason::TpMismatch(_)
    ));
    // Modes must agree.
    assert!(matches!(
        reject(
            &gqa(0, 2, TpMode::Identical, Role::Decode),
            &gqa(0, 2, TpMode::HeadSliced, Role::Prefill)
        ),
        RejectReason::TpMismatch(_)
    ));
    // Head-sliced totals must agree.
    let mut p = gqa(0, 2, TpMode::HeadSliced, Role::Prefill);
    p.layout.bytes_per_token_per_layer = 1024;
    assert!(matches!(
        reject(&gqa(0, 4, TpMode::HeadSliced, Role::Decode), &p),
        RejectReason::LayoutMismatch(_)
    ));
    // GQA with fewer KV heads than decode ranks: 2 heads, prefill TP 1 holds both, each of
    // decode's 4 ranks one replica.
    let few = |tp_size: u16, role: Role| {
        let held = if tp_size >= 2 { 1 } else { 2 };
        let mut h = gqa(0, tp_size, TpMode::HeadSliced, role);
        h.layout.model_kv_heads = 2;
        h.layout.kv_heads = held;
        h.layout.bytes_per_token_per_layer = 256 * u64::from(held);
        h
    };
    check_hello(&few(4, Role::Decode), &few(1, Role::Prefill)).unwrap();
    // ... but not a rank that claims another share of the heads than its TP size gives it,
    let mut wrong = few(1, Role::Prefill);
    wrong.layout.kv_heads = 1;
    assert!(matches!(
        reject(&few(4, Role::Decode), &wrong),
        RejectReason::LayoutMismatch(_)
    ));
    // another model,
    let mut other = few(1, Role::Prefill);
    other.layout.model_kv_heads = 4;
    assert!(matches!(
        reject(&few(4, Role::Decode), &other),
        RejectReason::LayoutMismatch(_)
    ));
    // or another order of heads and tokens in a page.
    let mut order = few(1, Role::Prefill);
    order.layout.token_major = false;
    assert!(matches!(
        reject(&few(4, Role::Decode), &order),
        RejectReason::LayoutMismatch(_)
    ));
    // Head-major with K by columns (vLLM's CPU blocks) on both sides maps; on one side only it
    // does not, and a column element that does not divide a head's K and V is malformed.
    let columns = |tp_size: u16, role: Role, bytes: u32| {
        let mut h = few(tp_size, role);
        h.layout.token_major = false;
        h.layout.key_column_bytes = bytes;
        h
    };
    check_hello(&columns(4, Role::Decode, 4), &columns(1, Role::Prefill, 4)).unwrap();
    assert!(matches!(
        reject(&columns(4, Role::Decode, 4), &columns(1, Role::Prefill, 0)),
        RejectReason::LayoutMismatch(_)
    ));
    assert!(matches!(
        reject(&columns(4, Role::Decode, 4), &columns(1, Role::Prefill, 2)),
        RejectReason::LayoutMismatch(_)
    ));
    assert!(matches!(
        reject(
            &columns(4, Role::Decode, 256),
            &columns(1, Role::Prefill, 256)
        ),
        RejectReason::InvalidHello(_)
    ));
    let mut token_major = columns(1, Role::Prefill, 4);
    token_major.layout.token_major = true;
    assert!(matches!(
        reject(&columns(4, Role::Decode, 4), &token_major),
        RejectReason::InvalidHello(_)
    ));
}

// ---- transfer request bounds ----

#[test]
fn a_landing_grant_lies_inside_the_landing_memory_announced() {
    let grant = |offset, chunk_stride| TransferRequest {
        landing: Some(Landing {
            offset,
            chunk_stride,
            slots: 2,
        }),
        ..req(vec![0, 1])
    };
    let slots = |slots| TransferRequest {
        landing: Some(Landing {
            offset: 50,
            chunk_stride: 100,
            slots,
        }),
        ..req(vec![0, 1])
    };
    let out = |announced: u64| TransferRejectReason::LandingOutOfRange { announced };
    // No grant: nothing to check, announced or not.
    assert_eq!(validate_landing(&req(vec![0, 1]), None, 2), Ok(()));
    // Two chunks of 100 bytes from 50: the last byte is 249.
    assert_eq!(validate_landing(&grant(50, 100), Some(250), 2), Ok(()));
    assert_eq!(
        validate_landing(&grant(50, 100), Some(249), 2),
        Err(out(249))
    );
    assert_eq!(validate_landing(&grant(0, 100), None, 1), Err(out(0)));
    assert_eq!(
        validate_landing(&grant(u64::MAX - 10, 100), Some(u64::MAX), 1),
        Err(out(u64::MAX))
    );
    assert_eq!(
        validate_landing(&grant(0, u64::MAX), Some(u64::MAX), 2),
        Err(out(u64::MAX))
    );
    assert!(matches!(
        validate_landing(&grant(0, 0), Some(1 << 20), 2),
        Err(TransferRejectReason::Invalid(_))
    ));
    // Ranges reused: only `slots` of them (or the chunks, if fewer) must fit.
    assert_eq!(validate_landing(&slots(1), Some(150), 8), Ok(()));
    assert_eq!(validate_landing(&slots(1), Some(149), 8), Err(out(149)));
    assert_eq!(validate_landing(&slots(4), Some(250), 2), Ok(()));
    assert_eq!(validate_landing(&slots(4), Some(449), 8), Err(out(449)));
    assert!(matches!(
        validate_landing(&slots(0), Some(1 << 20), 2),
        Err(TransferRejectReason::Invalid(_))
    ));
}

fn req(pages: Vec<u32>) -> TransferRequest {
    TransferRequest {
        request: 5,
        prompt_tokens: 256,
        chunk_tokens: 128,
        dst_pages: pages,
        prefix_tokens: 0,
        deadline_ms: 1000,
        landing: None,
    }
}

#[test]
fn transfer_request_bounds() {
    validate_transfer_request(&req(vec![0, 1, 2, 99]), 100, 4).unwrap();
    assert_eq!(
        validate_transfer_request(&req(vec![0, 1, 100, 2]), 100, 4),
        Err(TransferRejectReason::PageOutOfRange {
            position: 2,
            page: 100,
            registered: 100
        })
    );
    assert_eq!(
        validate_transfer_request(&req(vec![u32::MAX, 0, 1, 2]), 100, 4),
        Err(TransferRejectReason::PageOutOfRange {
            position: 0,
            page: u32::MAX,
            registered: 100
        })
    );
    assert_eq!(
        validate_transfer_request(&req(vec![0, 1]), 100, 4),
        Err(TransferRejectReason::PageCountMismatch {
            expected: 4,
            got: 2
        })
    );
    assert_eq!(
        validate_transfer_request(&req(vec![3, 1, 2, 3]), 100, 4),
        Err(TransferRejectReason::DuplicatePage { page: 3 })
    );
    let mut zero = req(vec![0]);
    zero.chunk_tokens = 0;
    assert!(matches!(
        validate_transfer_request(&zero, 100, 1),
        Err(TransferRejectReason::Invalid(_))
    ));
    assert!(matches!(
        validate_transfer_request(&req(vec![0]), 0, 1),
        Err(TransferRejectReason::PageOutOfRange { .. })
    ));
    // Nothing to move is a request only after a prefix that decode holds.
    let mut none = req(vec![]);
    none.prompt_tokens = 0;
    assert!(matches!(
        validate_transfer_request(&none, 100, 0),
        Err(TransferRejectReason::Invalid(_))
    ));
    none.prefix_tokens = 256;
    validate_transfer_request(&none, 100, 0).unwrap();
    let mut long = req(vec![0, 1]);
    long.prefix_tokens = u32::MAX - 255;
    assert!(matches!(
        validate_transfer_request(&long, 100, 2),
        Err(TransferRejectReason::Invalid(_))
    ));
}

#[test]
fn a_decode_prefix_must_be_whole_pages() {
    let mut r = req(vec![0, 1]);
    for (prefix, ok) in [
        (0, true),
        (16, true),
        (4096, true),
        (1, false),
        (15, false),
        (17, false),
    ] {
        r.prefix_tokens = prefix;
        assert_eq!(validate_prefix(&r, 16).is_ok(), ok, "prefix {prefix}");
    }
    r.prefix_tokens = 0;
    assert!(validate_prefix(&r, 0).is_err(), "no page size");
}

// ---- never a panic on any bytes ----

fn feed_all(bytes: &[u8], splits: &[usize], max: u32) {
    let mut d = FrameDecoder::new(max);
    let mut at = 0;
    for &s in splits.iter().chain(std::iter::once(&bytes.len())) {
        let end = s.clamp(at, bytes.len());
        d.extend(&bytes[at..end]);
        at = end;
        // Drain; stop on a fatal error as a reader would.
        loop {
            match d.decode_next() {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) if e.is_fatal() => return,
                Err(_) => {}
            }
        }
    }
    let _ = d.finish();
}

fn arb_kind() -> impl Strategy<Value = u8> {
    prop_oneof![1u8..=17, any::<u8>()]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512),
                                   splits in proptest::collection::vec(0usize..512, 0..8)) {
        let mut splits = splits;
        splits.sort_unstable();
        feed_all(&bytes, &splits, 256);
    }

    #[test]
    fn valid_header_with_arbitrary_payload_never_panics(kind in arb_kind(),
                                                          payload in proptest::collection::vec(any::<u8>(), 0..300),
                                                          version in prop_oneof![Just(PROTOCOL_VERSION), any::<u16>()]) {
        let len = u32::try_from(payload.len()).unwrap();
        let mut bytes = header(len, version, kind, 0);
        bytes.extend(&payload);
        feed_all(&bytes, &[], DEFAULT_MAX_FRAME_LEN);
        feed_all(&bytes, &[5, 13], 64);
    }

    #[test]
    fn transfer_requests_round_trip_any_split(request in any::<u64>(), prompt in any::<u32>(), chunk in any::<u32>(),
                                              pages in proptest::collection::vec(any::<u32>(), 0..200),
                                              prefix in any::<u32>(), deadline in any::<u32>(), split in 0usize..2000,
                                              landing in proptest::option::of((any::<u64>(), any::<u64>(), any::<u32>()))) {
        let landing = landing.map(|(offset, chunk_stride, slots)| Landing { offset, chunk_stride, slots });
        let m = Msg::TransferRequest(TransferRequest { request, prompt_tokens: prompt, chunk_tokens: chunk, dst_pages: pages, prefix_tokens: prefix, deadline_ms: deadline, landing });
        let wire = encode_to_vec(&m, DEFAULT_MAX_FRAME_LEN).unwrap();
        let split = split.min(wire.len());
        let mut d = FrameDecoder::default();
        d.extend(&wire[..split]);
        let first = d.decode_next().unwrap();
        d.extend(&wire[split..]);
        let got = match first { Some(x) => x, None => d.decode_next().unwrap().unwrap() };
        prop_assert!(same(&got, &m));
    }

    #[test]
    fn validate_never_accepts_out_of_range(pages in proptest::collection::vec(0u32..300, 0..50), registered in 0u32..300) {
        let n = pages.len();
        let ok = validate_transfer_request(&req(pages.clone()), registered, n).is_ok();
        let in_range = pages.iter().all(|&p| p < registered);
        let mut s = pages.clone();
        s.sort_unstable();
        s.dedup();
        prop_assert_eq!(ok, in_range && s.len() == n);
    }
}
