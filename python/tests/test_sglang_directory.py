"""kvx.sglang's bootstrap directory and its start-time checks, in this process, with SGLang's own
classes (SGLang from the provisioned ``.deps/sglang``; without it these tests fail).

The directory holds addresses (decode engines' control addresses, vote-mesh addresses), so every
``/kvx/`` call, read or write, must prove the shared secret; a relay or a stranger gets 401 and a
count, and what it sent is not stored. Models whose state kvx does not carry are refused at start
with their state types named, never served with that state dropped."""

import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SGLANG = os.environ.get("KVX_SGLANG_PATH", str(HERE.parent.parent / ".deps" / "sglang"))
assert (Path(SGLANG) / "sglang").is_dir(), f"SGLang is not provisioned at {SGLANG}"
sys.path.insert(0, SGLANG)

from conftest import free_addrs  # noqa: E402

SECRET = b"directory-test-secret"


@pytest.fixture
def directory(monkeypatch):
    monkeypatch.setenv("KVX_SECRET", SECRET.decode())
    from kvx.sglang.directory import KvxBootstrapServer

    port = int(free_addrs(1)[0].rsplit(":", 1)[1])
    server = KvxBootstrapServer("127.0.0.1", port)
    yield server
    server.close()


def raw(method, url, body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


RANK = {"tp_rank": 0, "pp_rank": 0, "pp_size": 1, "first_layer": 0, "num_layers": 2}



def test_a_prefill_rank_waits_for_decode_announcements_in_one_long_poll(directory):
    """An idle prefill rank asks for new decode engines once per long poll, not in a loop: the
    GET waits until an announcement arrives and answers at once when one does."""
    import threading

    from kvx.sglang.directory import http

    url = f"http://127.0.0.1:{directory.port}"
    # Nothing announced: the poll waits out its `wait`.
    t0 = time.monotonic()
    got = http("GET", f"{url}/kvx/decode?since=0&wait=0.5", timeout=5, key=SECRET)
    assert got["decodes"] == [] and time.monotonic() - t0 >= 0.45
    announced = {"decode_id": "d0", "tp_rank": 0, "address": "127.0.0.1:1", "total_layers": 2,
                 "instance": "x"}
    threading.Timer(0.3, lambda: http("PUT", f"{url}/kvx/decode", announced, key=SECRET)).start()
    t0 = time.monotonic()
    got = http("GET", f"{url}/kvx/decode?since=0&wait=20", timeout=25, key=SECRET)
    waited = time.monotonic() - t0
    assert got["decodes"] == [announced]
    assert 0.25 <= waited < 5, f"the long poll answered after {waited:.2f} s"
    # Already there: no wait.
    t0 = time.monotonic()
    assert http("GET", f"{url}/kvx/decode?since=0&wait=20", timeout=25,
                key=SECRET)["decodes"] == [announced]
    assert time.monotonic() - t0 < 2

def test_an_address_that_is_no_directory_is_an_oserror_for_every_caller():
    """A bootstrap address comes from a client's request: whatever answers there (a server that
    does not speak HTTP, an address that is no URL), the call raises OSError, which every caller
    of it (SGLang's scheduler thread among them) takes as "not there yet", never another error
    that would end the scheduler. (urllib raised http.client's BadStatusLine and InvalidURL,
    which are not OSErrors.)"""
    import socket
    import threading

    from kvx.sglang.directory import http

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def answer():
        for _ in range(2):
            conn, _ = listener.accept()
            conn.recv(4096)
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            conn.close()

    threading.Thread(target=answer, daemon=True).start()
    port = listener.getsockname()[1]
    for url in (f"http://127.0.0.1:{port}/kvx/prefill", "http://127.0.0.1 :1/kvx/prefill"):
        with pytest.raises(OSError):
            http("GET", url, timeout=5, key=SECRET)
    listener.close()


def test_a_requests_mac_is_keyed_from_the_stretched_secret_not_the_secret():
    """The header's MAC is seen on the network: keyed with the secret itself, each guess at a short
    secret would cost one HMAC. It is keyed with the key kvx derives from the secret (stretched with
    Argon2id, as the engines' keys are)."""
    import hashlib
    import hmac

    from kvx._kvx import mac_key
    from kvx.sglang.directory import MAC_LABEL, sign

    body = json.dumps(RANK).encode()
    stamp, mac = sign(SECRET, "PUT", "/kvx/prefill", body)["X-Kvx-Auth"].split(":")
    msg = b"\n".join([stamp.encode(), b"PUT", b"/kvx/prefill", body])
    assert mac != hmac.new(SECRET, msg, hashlib.sha256).hexdigest()
    key = mac_key(SECRET, MAC_LABEL)
    assert len(key) == 32 and key != mac_key(b"another secret", MAC_LABEL)
    assert mac == hmac.new(key, msg, hashlib.sha256).hexdigest()


def test_the_directory_serves_only_callers_that_prove_the_secret(directory):
    from kvx.sglang.directory import http, sign

    url = f"http://127.0.0.1:{directory.port}"
    # The secret's holder writes and reads.
    http("PUT", f"{url}/kvx/prefill", RANK, key=SECRET)
    got = http("GET", f"{url}/kvx/prefill", key=SECRET)
    assert got["ranks"] == [RANK] and got["instance"] == directory.instance
    # No proof, a wrong secret, a proof for another path, a stale proof: refused, nothing stored.
    poisoned = dict(RANK, tp_rank=0, first_layer=99)
    body = json.dumps(poisoned).encode()
    wrong = sign(b"not-the-secret", "PUT", "/kvx/prefill", body)
    other_path = sign(SECRET, "PUT", "/kvx/decode", body)
    stamp = str(int(time.time()) - 3600)
    from kvx.sglang.directory import _mac

    stale = {"X-Kvx-Auth": f"{stamp}:{_mac(SECRET, stamp, 'PUT', '/kvx/prefill', body)}"}
    for headers in ({}, wrong, other_path, stale, {"X-Kvx-Auth": "garbage"}):
        assert raw("PUT", f"{url}/kvx/prefill", poisoned, headers)[0] == 401, headers
    for path in ("/kvx/prefill", "/kvx/decode", "/kvx/mesh?decode_id=x&tp_rank=0"):
        assert raw("GET", url + path)[0] == 401, path
    assert directory.refused == 5 + 3
    assert http("GET", f"{url}/kvx/prefill", key=SECRET)["ranks"] == [RANK]
    # A proof binds the body: the same header with another body is refused.
    good = sign(SECRET, "PUT", "/kvx/prefill", json.dumps(RANK).encode())
    assert raw("PUT", f"{url}/kvx/prefill", poisoned, good)[0] == 401
    # Health stays open (SGLang and load balancers probe it).
    assert raw("GET", f"{url}/health")[0] == 200


def test_no_address_crosses_the_directory_in_clear(directory):
    """A decode's announcement, a mesh address and the replies that hand them out go through a
    relay that records them: the addresses are nowhere in its bytes, yet the callers got them. A
    body signed correctly but not sealed is refused and not stored."""
    from kvx.sglang.directory import http, sign

    from relay import Relay

    relay = Relay(directory.port)
    url = f"http://127.0.0.1:{relay.port}"
    decode = {"decode_id": "d-1", "addr": "10.11.12.13:40001", "tp_rank": 0}
    http("PUT", f"{url}/kvx/decode", decode, key=SECRET)
    http("PUT", f"{url}/kvx/mesh", {"tp_rank": 0, "pp_rank": 1, "addr": "10.11.12.14:40002"},
         key=SECRET)
    got = http("GET", f"{url}/kvx/decode?since=0", key=SECRET)
    assert got["decodes"] == [decode]
    assert http("GET", f"{url}/kvx/mesh?tp_rank=0", key=SECRET)["mesh"] == {
        "1": "10.11.12.14:40002"}
    assert b"/kvx/decode" in relay.seen  # the relay did see the calls
    for clear in (b"10.11.12.1", b"40001", b"40002", b"decode_id", b"d-1"):
        assert clear not in relay.seen, clear
    before = directory.refused
    body = json.dumps(dict(decode, decode_id="d-2")).encode()
    status, _ = raw("PUT", f"http://127.0.0.1:{directory.port}/kvx/decode",
                    dict(decode, decode_id="d-2"), sign(SECRET, "PUT", "/kvx/decode", body))
    assert status == 400 and directory.refused == before + 1
    assert http("GET", f"{url}/kvx/decode?since=0", key=SECRET)["decodes"] == [decode]


def test_the_directory_keeps_the_ranks_and_meshes_of_dp_groups_apart(directory):
    """Two DP groups of one prefill server have ranks of the same TP and PP ranks: the directory
    lists both, and each group's pipeline finds its own vote mesh; a rank that names no group is
    group 0's."""
    from kvx.sglang.directory import http

    url = f"http://127.0.0.1:{directory.port}"
    for dp in (0, 1):
        http("PUT", f"{url}/kvx/prefill", dict(RANK, dp_rank=dp, dp_size=2), key=SECRET)
        for pp in (0, 1):
            http("PUT", f"{url}/kvx/mesh", {"tp_rank": 0, "pp_rank": pp, "dp_rank": dp,
                                            "addr": f"10.0.{dp}.{pp}:1"}, key=SECRET)
    ranks = http("GET", f"{url}/kvx/prefill", key=SECRET)["ranks"]
    assert sorted(r["dp_rank"] for r in ranks) == [0, 1], ranks
    for dp in (0, 1):
        got = http("GET", f"{url}/kvx/mesh?tp_rank=0&dp_rank={dp}", key=SECRET)["mesh"]
        assert got == {"0": f"10.0.{dp}.0:1", "1": f"10.0.{dp}.1:1"}, got
    assert http("GET", f"{url}/kvx/mesh?tp_rank=0", key=SECRET)["mesh"]["0"] == "10.0.0.0:1"


def test_sglangs_decode_finds_the_dp_group_a_prefill_sender_registered(directory):
    """A prefill sender registers its room's DP group with the secret; SGLang's own decode-side
    query (``CommonKVReceiver.query_prefill_dp_ranks``, its client, no secret) gets the groups of
    the rooms it names that were registered, and nothing else. A registration without the secret
    is refused and changes nothing; a body that is not SGLang's query is a 400."""
    from kvx.sglang.directory import http
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    addr = f"127.0.0.1:{directory.port}"
    url = f"http://{addr}"
    rooms = [(1 << 62) + 7, 12345, 99]
    http("PUT", f"{url}/kvx/dp_rank", {"bootstrap_room": rooms[0], "dp_rank": 1}, key=SECRET)
    http("PUT", f"{url}/kvx/dp_rank", {"bootstrap_room": rooms[1], "dp_rank": 0}, key=SECRET)
    got = CommonKVReceiver.query_prefill_dp_ranks(addr, rooms)
    assert got == {str(rooms[0]): 1, str(rooms[1]): 0}, got
    # A stranger cannot move a room to another group.
    status, _ = raw("PUT", f"{url}/kvx/dp_rank", {"bootstrap_room": rooms[0], "dp_rank": 0})
    assert status == 401
    assert CommonKVReceiver.query_prefill_dp_ranks(addr, rooms[:1]) == {str(rooms[0]): 1}
    assert raw("POST", f"{url}/query_dp_ranks", {"rooms": rooms})[0] == 400
    assert raw("POST", f"{url}/query_dp_ranks", {"bootstrap_rooms": "x"})[0] == 400


def test_rooms_are_forgotten_after_their_time_and_past_the_cap(directory, monkeypatch):
    """A room's group is kept ROOM_TTL_S, and at most MAX_ROOMS rooms are kept (the oldest go)."""
    import kvx.sglang.directory as d
    from kvx.sglang.directory import http

    url = f"http://127.0.0.1:{directory.port}"
    monkeypatch.setattr(d, "MAX_ROOMS", 3)
    for room in range(5):
        http("PUT", f"{url}/kvx/dp_rank", {"bootstrap_room": room, "dp_rank": room % 2},
             key=SECRET)
    body = {"bootstrap_rooms": list(range(5))}
    assert raw("POST", f"{url}/query_dp_ranks", body) == (200, {"2": 0, "3": 1, "4": 0})
    monkeypatch.setattr(d, "ROOM_TTL_S", 0.0)
    time.sleep(0.01)
    assert raw("POST", f"{url}/query_dp_ranks", body) == (200, {})


def test_each_start_of_a_directory_has_its_own_instance(monkeypatch):
    monkeypatch.setenv("KVX_SECRET", SECRET.decode())
    from kvx.sglang.directory import KvxBootstrapServer

    a_port, b_port = (int(a.rsplit(":", 1)[1]) for a in free_addrs(2))
    a, b = KvxBootstrapServer("127.0.0.1", a_port), KvxBootstrapServer("127.0.0.1", b_port)
    try:
        assert a.instance != b.instance
    finally:
        a.close()
        b.close()


def test_state_beside_the_kv_pages_is_refused_at_start():
    import kvx
    from kvx.sglang.manager import _refuse_unsupported
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType

    args, server_args = KVArgs(), type("ServerArgs", (), {})()
    args.state_types = [StateType.MAMBA, StateType.SWA]
    with pytest.raises(kvx.ConfigError, match="mamba, swa"):
        _refuse_unsupported(args, server_args)
    args.state_types = []
    _refuse_unsupported(args, server_args)
    # A decode-side radix cache is carried (decode_prefix_len: test_sglang_servers.py).
    server_args.disaggregation_decode_enable_radix_cache = True
    _refuse_unsupported(args, server_args)
    # Pipelined prefill and decode, and DP attention, are carried (test_sglang_servers.py).
    server_args.pp_size = 2
    _refuse_unsupported(args, server_args)
    server_args.pp_size, server_args.enable_dp_attention = 1, True
    _refuse_unsupported(args, server_args)


def test_dp_groups_are_sglangs_and_what_kvx_cannot_route_is_refused():
    import kvx
    from kvx.sglang.manager import _topology, session_name
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import DisaggregationMode

    prefill, decode = DisaggregationMode.PREFILL, DisaggregationMode.DECODE
    args, server_args = KVArgs(), type("ServerArgs", (), {"tp_size": 4})()
    args.engine_rank, args.system_dp_rank = 3, 0

    def parallel(**kw):
        p = dict(attn_tp_size=2, attn_tp_rank=1, attn_dp_size=2, attn_dp_rank=1, dp_size=1,
                 attn_cp_size=1)
        return type("Parallel", (), {**p, **kw})()

    # DP attention: the group is the attention-DP rank, its TP the attention TP.
    t = _topology(args, server_args, prefill, parallel())
    assert (t.dp_rank, t.dp_size, t.tp_rank, t.tp_size) == (1, 2, 1, 2)
    # DP replicas (no DP attention): the group is the replica.
    args.system_dp_rank = 2
    t = _topology(args, server_args, decode, parallel(attn_dp_size=1, attn_dp_rank=0, dp_size=3,
                                                      attn_tp_size=4, attn_tp_rank=3))
    assert (t.dp_rank, t.dp_size, t.tp_rank, t.tp_size) == (2, 3, 3, 4)
    # No parallel state published (outside a scheduler): one group of --tp-size.
    t = _topology(args, server_args, decode, object())
    assert (t.dp_rank, t.dp_size, t.tp_rank, t.tp_size) == (0, 1, 3, 4)
    # A prefill server that routes rooms otherwise than by their number: its senders register
    # each room's group, and decode asks for it.
    server_args.load_balance_method = "round_robin"
    assert not _topology(args, server_args, prefill, parallel()).follow_room
    for method in ("auto", "follow_bootstrap_room"):
        server_args.load_balance_method = method
        assert _topology(args, server_args, prefill, parallel()).follow_room
    with pytest.raises(kvx.ConfigError, match="context parallelism"):
        _topology(args, server_args, prefill, parallel(attn_cp_size=2))
    # One group keeps the instance's address as its session's name.
    assert session_name("h:1", 0, 1) == "h:1"
    assert session_name("h:1", 1, 2) == "h:1#dp1"


def test_a_layout_kvx_cannot_map_fails_each_request_at_once(directory):
    """A prefill instance whose pages kvx cannot map onto this decode (pages of twice the tokens
    of half the heads' bytes: another size per head and token):
    decode's scheduler is told the instance is there, and the receiver fails at once naming both
    values, instead of waiting out the bootstrap timeout for ranks that never come."""
    import types

    import kvx
    import sglang_role as R
    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.base.conn import KVPoll

    KVX = utils.TransferBackend("kvx")
    shape = R.SHAPES["gqa"]

    def args():
        return types.SimpleNamespace(pp_size=1, tp_size=1, host="127.0.0.1",
                                     disaggregation_bootstrap_port=directory.port)

    manager = utils.get_kv_class(KVX, utils.KVClassType.MANAGER)
    pool = R.Pool(shape, 0, shape["layers"], 16)
    prefill = manager(pool.kv_args(shape["page"], 0), utils.DisaggregationMode.PREFILL, args(),
                      False)
    dpool = R.Pool(shape, 0, shape["layers"], 16)
    # The same bytes per page, read as pages of twice the tokens of half the heads' bytes.
    decode = manager(dpool.kv_args(2 * shape["page"], 0), utils.DisaggregationMode.DECODE, args(),
                     False)
    try:
        addr = f"127.0.0.1:{directory.port}"
        assert decode.try_ensure_parallel_info(addr)
        receiver = utils.get_kv_class(KVX, utils.KVClassType.RECEIVER)(
            mgr=decode, bootstrap_addr=addr, bootstrap_room=7)
        receiver.init(0)
        assert receiver.poll() == KVPoll.Failed
        with pytest.raises(kvx.ConfigError, match=r"bytes per head and token \d+, this decode \d+"):
            receiver.failure_exception()
    finally:
        decode.close()
        prefill.close()


def test_silent_clients_holding_a_decodes_listener_do_not_keep_the_prefill_rank_out(directory,
                                                                                   caplog):
    """A decode engine announced while silent clients hold all 64 of its listener's handshake
    places (and more wait): the prefill rank's link takes the place of the oldest and succeeds
    while they still hold the rest. (Until 2026-12-07 the listener turned every new connection
    away, so the rank's first link failed here and it linked only once they were gone; this test
    then covered its retries, which have no test now.)"""
    import logging
    import socket
    import types

    import sglang_role as R
    from sglang.srt.disaggregation import utils

    caplog.set_level(logging.WARNING, logger="kvx.sglang.manager")
    KVX = utils.TransferBackend("kvx")
    shape = R.SHAPES["gqa"]
    args = types.SimpleNamespace(pp_size=1, tp_size=1, host="127.0.0.1",
                                 disaggregation_bootstrap_port=directory.port)
    manager = utils.get_kv_class(KVX, utils.KVClassType.MANAGER)
    receiver = utils.get_kv_class(KVX, utils.KVClassType.RECEIVER)
    pool = R.Pool(shape, 0, shape["layers"], 16)
    prefill = manager(pool.kv_args(shape["page"], 0), utils.DisaggregationMode.PREFILL, args,
                      False)
    pools = [R.Pool(shape, 0, shape["layers"], 16) for _ in range(2)]
    decodes = [manager(p.kv_args(shape["page"], 0), utils.DisaggregationMode.DECODE, args, False)
               for p in pools]
    flood = []

    def linked(n):
        deadline = time.monotonic() + 20
        while True:
            engine = prefill.prefill_engine()
            if engine is not None and len(engine.decodes) == n:
                return engine
            assert time.monotonic() < deadline, f"the prefill rank did not link {n} decodes"
            time.sleep(0.05)

    try:
        addr = f"127.0.0.1:{directory.port}"
        for d in decodes:
            assert d.try_ensure_parallel_info(addr)
        # The first decode starts the prefill rank's engine.
        receiver(mgr=decodes[0], bootstrap_addr=addr, bootstrap_room=1).init(0)
        linked(1)
        # The second decode's engine is up (SGLang's first receiver would start it) and every
        # handshake place of its listener is held before it announces itself.
        host, port = decodes[1]._decode().address.rsplit(":", 1)
        for _ in range(70):
            flood.append(socket.create_connection((host, int(port))))
        # Each has a place once decode's first handshake message reached it (the oldest six
        # gave theirs up to the newest: they read that message, or the end).
        for s in flood:
            s.settimeout(10)
            s.recv(1)
        receiver(mgr=decodes[1], bootstrap_addr=addr, bootstrap_room=2).init(0)
        engine = linked(2)
        assert decodes[1]._decode().address in [a for _, a in engine.decodes]
        assert "cannot serve decode" not in caplog.text, caplog.text
    finally:
        for s in flood:
            s.close()
        for d in decodes:
            d.close()
        prefill.close()


def test_a_pipelined_decode_beside_a_pipeline_of_another_size_fails_at_once(directory,
                                                                            monkeypatch):
    """Decode in two PP stages, prefill in one: no prefill rank is of decode stage 1's stage, yet
    each stage's scheduler is told the instance is there and each receiver fails at once naming
    both sizes, instead of waiting out the bootstrap timeout for ranks that never come."""
    import types

    import kvx
    import sglang_role as R
    from kvx.sglang import settings
    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.base.conn import KVPoll

    KVX = utils.TransferBackend("kvx")
    shape = R.SHAPES["gqa"]
    half = shape["layers"] // 2
    # SGLang's split of the model's layers (ModelConfig reads a model; the real servers' test runs
    # it): stage r holds layers r*half .. (r+1)*half.
    monkeypatch.setattr(settings, "decode_stage_layers",
                        lambda _args, rank, size: (rank * half, half, shape["layers"]))

    def args(pp_size):
        return types.SimpleNamespace(pp_size=pp_size, tp_size=1, host="127.0.0.1",
                                     disaggregation_bootstrap_port=directory.port)

    manager = utils.get_kv_class(KVX, utils.KVClassType.MANAGER)
    pool = R.Pool(shape, 0, shape["layers"], 16)
    prefill = manager(pool.kv_args(shape["page"], 0), utils.DisaggregationMode.PREFILL, args(1),
                      False)
    stages = []
    try:
        addr = f"127.0.0.1:{directory.port}"
        for rank in range(2):
            dpool = R.Pool(shape, rank * half, half, 16)
            decode = manager(dpool.kv_args(shape["page"], rank), utils.DisaggregationMode.DECODE,
                             args(2), False)
            stages.append((decode, dpool))
            assert decode.try_ensure_parallel_info(addr)
            receiver = utils.get_kv_class(KVX, utils.KVClassType.RECEIVER)(
                mgr=decode, bootstrap_addr=addr, bootstrap_room=7)
            receiver.init(0)
            assert receiver.poll() == KVPoll.Failed
            with pytest.raises(kvx.ConfigError, match="has PP size 1, this decode 2 stages"):
                receiver.failure_exception()
    finally:
        for decode, _ in stages:
            decode.close()
        prefill.close()


def test_each_rank_of_a_server_serves_metrics_on_a_port_of_its_own(monkeypatch):
    import kvx
    from kvx.sglang import settings

    monkeypatch.delenv("KVX_METRICS", raising=False)
    assert settings.metrics_address(3) is None
    monkeypatch.setenv("KVX_METRICS", "127.0.0.1:9400")
    assert [settings.metrics_address(r) for r in (0, 3)] == ["127.0.0.1:9400", "127.0.0.1:9403"]
    monkeypatch.setenv("KVX_METRICS", "[::1]:9400")
    assert settings.metrics_address(1) == "[::1]:9401"
    for bad in ("9400", "host:port", "127.0.0.1:65535"):
        monkeypatch.setenv("KVX_METRICS", bad)
        with pytest.raises(kvx.ConfigError, match="KVX_METRICS"):
            settings.metrics_address(1)


def test_a_decode_rank_takes_its_progress_threads_realtime_priority_from_the_environment(
        monkeypatch):
    import kvx
    from kvx.sglang import settings

    monkeypatch.delenv("KVX_PROGRESS_FIFO", raising=False)
    assert settings.progress_fifo() is None
    monkeypatch.setenv("KVX_PROGRESS_FIFO", "")
    assert settings.progress_fifo() is None
    for good in ("1", " 99 "):
        monkeypatch.setenv("KVX_PROGRESS_FIFO", good)
        assert settings.progress_fifo() == int(good)
    for bad in ("0", "100", "-1", "high", "1.5"):
        monkeypatch.setenv("KVX_PROGRESS_FIFO", bad)
        with pytest.raises(kvx.ConfigError, match="KVX_PROGRESS_FIFO"):
            settings.progress_fifo()
    monkeypatch.delenv("KVX_PROGRESS_SPIN_US", raising=False)
    assert settings.progress_spin_us() is None
    for good in ("0", "200", "1000000"):
        monkeypatch.setenv("KVX_PROGRESS_SPIN_US", good)
        assert settings.progress_spin_us() == int(good)
    for bad in ("-1", "1000001", "fast", "0.5"):
        monkeypatch.setenv("KVX_PROGRESS_SPIN_US", bad)
        with pytest.raises(kvx.ConfigError, match="KVX_PROGRESS_SPIN_US"):
            settings.progress_spin_us()


def test_a_decode_rank_takes_its_landing_memory_from_the_environment(monkeypatch):
    import kvx
    from kvx.sglang import settings

    monkeypatch.delenv("KVX_LANDING_BYTES", raising=False)
    assert settings.landing_bytes() is None
    for good in ("0", "268435456", str(1 << 40)):
        monkeypatch.setenv("KVX_LANDING_BYTES", good)
        assert settings.landing_bytes() == int(good)
    for bad in ("-1", str((1 << 40) + 1), "256M", "0.5"):
        monkeypatch.setenv("KVX_LANDING_BYTES", bad)
        with pytest.raises(kvx.ConfigError, match="KVX_LANDING_BYTES"):
            settings.landing_bytes()


def test_a_decode_rank_takes_its_landing_slots_from_the_environment(monkeypatch):
    import kvx
    from kvx.sglang import settings

    monkeypatch.delenv("KVX_LANDING_SLOTS", raising=False)
    assert settings.landing_slots() is None
    for good in ("1", "2", " 16 ", "1024"):
        monkeypatch.setenv("KVX_LANDING_SLOTS", good)
        assert settings.landing_slots() == int(good)
    for bad in ("0", "-1", "1025", "two", "1.5"):
        monkeypatch.setenv("KVX_LANDING_SLOTS", bad)
        with pytest.raises(kvx.ConfigError, match="KVX_LANDING_SLOTS"):
            settings.landing_slots()


def test_engines_publish_sglangs_local_address_never_a_wildcard(monkeypatch):
    import kvx
    from kvx.sglang import settings

    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.7")
    assert settings.local_ip() == "127.0.0.7"
    monkeypatch.setenv("SGLANG_HOST_IP", "0.0.0.0")
    with pytest.raises(kvx.ConfigError):
        settings.local_ip()
    ns = type("ServerArgs", (), {})
    wildcard = ns()
    wildcard.host, wildcard.dist_init_addr = "0.0.0.0", None
    assert settings.bootstrap_host(wildcard) == "127.0.0.1"
    multi = ns()
    multi.host, multi.dist_init_addr = "0.0.0.0", "127.0.0.9:5000"
    assert settings.bootstrap_host(multi) == "127.0.0.9"


def test_a_secret_setting_that_is_there_but_unusable_is_refused(monkeypatch, tmp_path):
    """An empty setting or file, or a file others may read, never turns authentication off or hands
    the secret around quietly: it raises. A private file's secret is read without its newline."""
    from kvx.sglang import settings

    monkeypatch.delenv("KVX_SECRET", raising=False)
    f = tmp_path / "secret"
    f.write_bytes(b"")
    os.chmod(f, 0o600)
    monkeypatch.setenv("KVX_SECRET_FILE", str(f))
    with pytest.raises(ValueError, match="is empty"):
        settings.secret()
    f.write_bytes(b"file-secret\n")
    os.chmod(f, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        settings.secret()
    os.chmod(f, 0o600)
    assert settings.secret() == b"file-secret"
    monkeypatch.setenv("KVX_SECRET_FILE", "")
    with pytest.raises(ValueError, match="set but empty"):
        settings.secret()
    monkeypatch.delenv("KVX_SECRET_FILE")
    monkeypatch.setenv("KVX_SECRET", "")
    with pytest.raises(ValueError, match="set but empty"):
        settings.secret()
    monkeypatch.delenv("KVX_SECRET")
    assert settings.secret() is None


def test_page_sizes_that_differ_are_mapped_where_a_tokens_bytes_are_known():
    """Which prefill layouts decode's manager takes (without I/O): other page sizes where heads
    are known (MHA/GQA) or the latent is one row per token (MLA); not K/V pages without head
    counts, not a token's bytes that differ, not a decode radix cache whose prefixes could end
    inside a prefill page."""
    import kvx
    from kvx.sglang.manager import _refuse_other_layout as check

    gqa = {"tp_size": 1, "page_size": 16, "page_bytes": 16 * 2 * 64, "split_kv": True,
           "kv_heads": 2, "head_bytes": 64, "radix_cache": False}
    for ps in (8, 32, 48):
        check(gqa, dict(gqa, page_size=ps, page_bytes=ps * 2 * 64), "p")
    radix = dict(gqa, radix_cache=True)
    check(radix, dict(gqa, page_size=8, page_bytes=8 * 2 * 64), "p")
    with pytest.raises(kvx.ConfigError, match="page size 32, this decode 16 with a radix cache"):
        check(radix, dict(gqa, page_size=32, page_bytes=32 * 2 * 64), "p")
    with pytest.raises(kvx.ConfigError, match="bytes per head and token 32, this decode 64"):
        check(gqa, dict(gqa, page_size=32, head_bytes=32), "p")
    bare = dict(gqa, kv_heads=0, head_bytes=0)
    check(bare, dict(bare), "p")
    with pytest.raises(kvx.ConfigError, match="without head counts"):
        check(bare, dict(bare, page_size=32, page_bytes=32 * 2 * 64), "p")
    mla = {"tp_size": 1, "page_size": 16, "page_bytes": 16 * 576, "split_kv": False,
           "kv_heads": 0, "head_bytes": 0, "radix_cache": False}
    check(mla, dict(mla, page_size=64, page_bytes=64 * 576), "p")
    with pytest.raises(kvx.ConfigError, match="bytes per page of 64 tokens"):
        check(mla, dict(mla, page_size=64, page_bytes=64 * 512), "p")
