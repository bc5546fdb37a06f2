"""kvx.vllm's side channel (decode tells a prefill worker its engine's address), without vLLM: only a
peer that proves the secret gets an answer, nothing of a message crosses in clear, and a frame
changed on the way is refused before the handler sees it."""

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
