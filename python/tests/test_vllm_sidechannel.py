"""kvx.vllm's side channel (decode tells a prefill worker its engine's address), without vLLM: only a
peer that proves the secret gets an answer, nothing of a message crosses in clear, and a frame
changed on the way is refused before the handler sees it."""

import socket
import struct
import time

import pytest
from relay import Relay

from kvx.vllm import sidechannel

SECRET = b"side channel secret"
ADDRESS = "10.9.8.7:45678"  # what decode's hello carries: it must never cross in clear


@pytest.fixture
def server():
    calls = []
    srv = sidechannel.SideChannelServer(
        "127.0.0.1", 0, SECRET, lambda m: calls.append(m) or {"ok": m["op"], "echo": m})
    srv.calls = calls
    yield srv
    srv.close()


def test_only_a_peer_that_proves_the_secret_gets_an_answer(server):
    with pytest.raises(sidechannel.SideChannelError):
        sidechannel.call("127.0.0.1", server.port, b"wrong secret", {"op": "hello"}, timeout=5)
    with pytest.raises(sidechannel.SideChannelError):
        sidechannel.call("127.0.0.1", server.port, None, {"op": "hello"}, timeout=5)
    assert server.calls == [] and server.refused == 2
    reply = sidechannel.call("127.0.0.1", server.port, SECRET, {"op": "hello"}, timeout=5)
    assert reply["ok"] == "hello"
    assert server.calls == [{"op": "hello"}]


def test_nothing_of_a_message_crosses_in_clear(server):
    """A relay sees both directions: neither the request (decode's address) nor the reply (which
    echoes it) appears in what it saw, yet both ends got them."""
    relay = Relay(server.port)
    msg = {"op": "hello", "decode": ADDRESS, "instance": "decode-A"}
    reply = sidechannel.call("127.0.0.1", relay.port, SECRET, msg, timeout=5)
    assert reply["echo"] == msg and server.calls == [msg]
    seen = relay.seen
    assert len(relay.up) > 100 and len(relay.down) > 100
    for clear in (ADDRESS.encode(), b"decode-A", b"hello", b'"op"'):
        assert clear not in seen, clear


def test_a_frame_changed_on_the_way_is_refused_before_the_handler(server):
    """One bit of the sealed request flipped by the relay: the server drops the connection without
    running the handler, and the client gets an error, never a reply."""
    # Client to server: a 4-byte length, its nonce (32) and the handshake's first message (48),
    # then the sealed request's frame: flip a byte inside that frame's body.
    relay = Relay(server.port, flip_at=4 + 32 + 48 + 4 + 10)
    with pytest.raises(sidechannel.SideChannelError):
        sidechannel.call("127.0.0.1", relay.port, SECRET, {"op": "hello", "decode": ADDRESS},
                         timeout=5)
    assert server.calls == []
    # The handshake went through (the flip was after it): not counted as a wrong secret.
    assert server.refused == 0


def test_a_flipped_handshake_byte_fails_like_a_wrong_secret(server):
    relay = Relay(server.port, flip_at=4 + 32 + 5)
    with pytest.raises(sidechannel.SideChannelError):
        sidechannel.call("127.0.0.1", relay.port, SECRET, {"op": "hello"}, timeout=5)
    assert server.calls == [] and server.refused == 1


def test_a_client_that_paces_its_bytes_is_dropped_at_the_handshake_bound(server):
    """A client that sends one byte a second never lets a read wait out its own bound: the server
    ends the connection once the whole handshake took HANDSHAKE_TIMEOUT_S, and serves others."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        assert len(s.recv(64)) == 4 + sidechannel.NONCE  # the server's nonce
        start, closed = time.monotonic(), False
        s.settimeout(1.0)
        for b in struct.pack(">I", 80) + b"x" * 80:  # a frame header, then its bytes
            try:
                s.sendall(bytes([b]))
                if s.recv(1) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except OSError:
                closed = True
                break
            if time.monotonic() - start > sidechannel.HANDSHAKE_TIMEOUT_S + 3:
                break
        assert closed, "the server kept a client that paced its bytes"
        assert time.monotonic() - start < sidechannel.HANDSHAKE_TIMEOUT_S + 3
    assert sidechannel.call("127.0.0.1", server.port, SECRET, {"op": "hello"}, timeout=5)["ok"]


def _silent(port, n, source="127.0.0.1"):
    """n clients from `source` that connect and say nothing, each once the server sent it its
    nonce (its handshake holds a place)."""
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
        (size,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
        assert len(s.recv(size, socket.MSG_WAITALL)) == size
        out.append(s)
    return out


def _closed(s):
    """Whether the server closed `s` (within 5 s)."""
    s.settimeout(5)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


def test_connections_past_the_bound_take_the_oldest_places_and_are_counted(server):
    """MAX_CONNECTIONS clients that connect and say nothing hold every place; each next one takes
    the place of the oldest, which is closed and counted, and a real call is served meanwhile."""
    silent = _silent(server.port, sidechannel.MAX_CONNECTIONS)
    try:
        extra = _silent(server.port, 4)
        assert server.refused_connections == 4
        assert all(_closed(s) for s in silent[:4])
        reply = sidechannel.call("127.0.0.1", server.port, SECRET, {"op": "hello"}, timeout=5)
        assert reply["ok"] == "hello"
        assert server.refused_connections == 5
        assert _closed(silent[4])
        for s in extra:
            s.close()
    finally:
        for s in silent:
            s.close()


def test_silent_connections_from_one_address_do_not_keep_a_peer_from_another_out(server):
    """Every place held by silent clients from 127.0.0.2: a call from 127.0.0.1 takes the oldest
    one's place at once and is served."""
    silent = _silent(server.port, sidechannel.MAX_CONNECTIONS, source="127.0.0.2")
    try:
        started = time.monotonic()
        reply = sidechannel.call("127.0.0.1", server.port, SECRET, {"op": "hello"}, timeout=5)
        assert reply["ok"] == "hello"
        assert time.monotonic() - started < 2
        assert server.refused_connections == 1
        assert _closed(silent[0])
    finally:
        for s in silent:
            s.close()
