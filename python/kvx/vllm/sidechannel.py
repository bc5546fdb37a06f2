"""The side channel between a decode worker and a prefill worker: how decode tells prefill where to
write (its kvx control address) and which held requests it gave up.

vLLM's proxy hands decode the prefill instance's side-channel address (``remote_host``,
``remote_port`` in ``kv_transfer_params``); kvx's prefill engine needs decode's control address to
connect. One short TCP connection per message carries it, over the channel kvx's engines use
(``kvx._kvx.ChannelHandshake``: Noise ``NNpsk0`` keyed from the deployment's secret, with this
protocol's own label), so nothing but two nonces and the handshake crosses before both peers
proved the secret, and nothing crosses in clear after:

1. the server (prefill) sends its 32-byte nonce;
2. the client (decode) sends its nonce and the handshake's first message;
3. the server checks it (a peer without the secret, or one that relays another connection's
   nonces, fails here and is dropped, counted in ``refused``) and sends the second;
4. the client checks it; then one sealed request and one sealed reply travel. A frame changed,
   replayed from another connection or cut fails to open.

Frames are a 4-byte big-endian length and the bytes. Without a secret the channel is still
encrypted, but anyone can complete it (a warning says so at start, as kvx's engines do)."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Callable, Optional

import kvx
from kvx._kvx import Channel, ChannelHandshake, HandshakePlaces

logger = logging.getLogger("vllm." + __name__)  # vLLM's handlers and level

MAX_FRAME = 1 << 20
# The largest frame before the peer proved the secret: a nonce and a handshake message.
AUTH_MAX_FRAME = 1024
# The bound on a whole handshake, however the peer paces its bytes.
HANDSHAKE_TIMEOUT_S = 5.0
# Connections a server runs the handshake of at once, so clients that connect and stall cannot
# take its threads and memory; once every place is taken, a new connection takes the place of the
# oldest handshake of the address holding the most (closed and counted), the engines' own rule
# (kvx._kvx.HandshakePlaces). A peer that proved the secret gives its place back.
MAX_CONNECTIONS = 64
# The handshake's label: a handshake of this protocol never completes with another kvx protocol.
# v3: each sealed message carries its length; a peer of another label never completes the
# handshake.
LABEL = "vllm-side-channel/v3"
NONCE = 32


class SideChannelError(ConnectionError):
    """The peer could not be reached, did not prove the secret, or broke the protocol."""


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SideChannelError("the side-channel handshake took too long")
            sock.settimeout(left)
        got = sock.recv(n - len(out))
        if not got:
            raise SideChannelError("the peer closed the side channel")
        out += got
    return bytes(out)


def _recv(sock: socket.socket, max_frame: int = MAX_FRAME,
          deadline: Optional[float] = None) -> bytes:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if n > max_frame:
        raise SideChannelError(f"a side-channel frame of {n} bytes (at most {max_frame})")
    return _recv_exact(sock, n, deadline)


def _send_sealed(sock: socket.socket, channel: Channel, obj: Any) -> None:
    _send(sock, channel.seal(json.dumps(obj).encode()))


def _recv_sealed(sock: socket.socket, channel: Channel) -> Any:
    try:
        plain = channel.open(_recv(sock))
    except kvx.ProtocolError as e:
        raise SideChannelError(f"a side-channel frame failed to open: {e}") from e
    msg = json.loads(plain)
    if not isinstance(msg, dict):
        raise SideChannelError("a side-channel message that is not an object")
    return msg


class SideChannelServer:
    """Listens on ``(host, port)`` (port 0: any) and answers each authenticated request with
    ``handler(request) -> reply`` (a dict; an exception becomes ``{"error": str}``)."""

    def __init__(self, host: str, port: int, key: Optional[bytes],
                 handler: Callable[[dict], dict]):
        self._key = key
        self._handler = handler
        self.refused = 0  # connections that did not prove the secret
        # Handshakes closed because a newer connection took their place.
        self.refused_connections = 0
        self._places = HandshakePlaces(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._pending: dict[int, socket.socket] = {}  # place -> its connection, in handshake
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True,
                                        name="kvx-vllm-side-channel")
        self._thread.start()

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            with self._lock:
                place, taken = self._places.admit(peer[0])
                old = self._pending.pop(taken, None) if taken is not None else None
                self._pending[place] = conn
            if taken is not None:
                self.refused_connections += 1
                if old is not None:
                    # Its thread's next read fails and it ends.
                    try:
                        old.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            try:
                threading.Thread(target=self._serve, args=(conn, place), daemon=True,
                                 name="kvx-vllm-side-channel-conn").start()
            except RuntimeError as e:  # no thread to be had: this one is dropped, not the server
                self._give_back(place)
                conn.close()
                logger.warning("kvx: side-channel connection dropped: %s", e)

    def _give_back(self, place: int) -> None:
        with self._lock:
            self._places.release(place)
            self._pending.pop(place, None)

    def _serve(self, conn: socket.socket, place: int) -> None:
        try:
            self._serve_one(conn, place)
        finally:
            self._give_back(place)

    def _serve_one(self, conn: socket.socket, place: int) -> None:
        with conn:
            try:
                deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                mine = os.urandom(NONCE)
                _send(conn, mine)
                first = _recv(conn, AUTH_MAX_FRAME, deadline)
                theirs, msg = first[:NONCE], first[NONCE:]
                if len(theirs) != NONCE:
                    raise SideChannelError("a handshake without the client's nonce")
                hs = ChannelHandshake(self._key, "listener", LABEL, theirs, mine)
                if not hs.read(msg):
                    self.refused += 1
                    logger.warning("kvx: a side-channel peer did not prove the shared secret")
                    return
                # A peer that holds the secret: its place goes to the next handshake, and no
                # newer connection takes it from now on.
                self._give_back(place)
                _send(conn, hs.write())
                channel = hs.finish()
                # The handler may start a prefill engine, which connects to decode: no short bound.
                conn.settimeout(120.0)
                request = _recv_sealed(conn, channel)
                try:
                    reply = self._handler(request)
                except Exception as e:  # reported to the peer, which fails its request with it
                    logger.warning("kvx: side-channel request %s refused: %s",
                                   request.get("op"), e)
                    reply = {"error": str(e)}
                _send_sealed(conn, channel, reply)
            except (OSError, ValueError, KeyError, TypeError, SideChannelError,
                    kvx.KvxError) as e:
                logger.debug("kvx: side-channel connection dropped: %s", e)

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass


def call(host: str, port: int, key: Optional[bytes], request: dict,
         timeout: float = 60.0) -> dict:
    """Sends one request to a side-channel server and returns its reply. Raises
    `SideChannelError` (a `ConnectionError`) when the server is not reachable, does not prove the
    secret or answers with an error."""
    try:
        # The caller's bound, for the handshake too: a server whose process is busy (a worker
        # that just started, on loaded cores) may take longer than a server's bound on a silent
        # client (HANDSHAKE_TIMEOUT_S) to answer (seen: 5 s passed, a first request failed).
        with socket.create_connection((host, port), timeout=timeout) as sock:
            theirs = _recv(sock, AUTH_MAX_FRAME)
            if len(theirs) != NONCE:
                raise SideChannelError(f"the side channel at {host}:{port} sent no nonce")
            mine = os.urandom(NONCE)
            hs = ChannelHandshake(key, "dialer", LABEL, mine, theirs)
            _send(sock, mine + hs.write())
            if not hs.read(_recv(sock, AUTH_MAX_FRAME)):
                raise SideChannelError(f"the side channel at {host}:{port} did not prove the "
                                       "shared secret")
            channel = hs.finish()
            _send_sealed(sock, channel, request)
            sock.settimeout(timeout)
            reply = _recv_sealed(sock, channel)
    except SideChannelError:
        raise
    except (OSError, ValueError, KeyError, TypeError, kvx.KvxError) as e:
        raise SideChannelError(f"side channel {host}:{port}: {e!r}") from e
    if "error" in reply:
        raise SideChannelError(f"side channel {host}:{port}: {reply['error']}")
    return reply
