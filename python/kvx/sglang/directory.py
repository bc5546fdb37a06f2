"""The prefill instance's bootstrap directory (SGLang's bootstrap server, for kvx) and its client.

Each prefill rank publishes its DP group, its PP/TP rank in it and its layer range; each decode rank
publishes the control address of its ``kvx.DecodeEngine`` for the DP group it takes rooms from;
each prefill rank publishes the address its PP vote mesh listens on (one mesh per pipeline, that is
per DP group and TP rank, for every decode). Those are addresses, so every ``/kvx/``
request, read or write, proves the deployment's shared secret: an HMAC-SHA256 (keyed with a key kvx
derives from the secret, ``kvx._kvx.mac_key``, stretched as the engines' keys are) over a timestamp,
the method, the path and the body (header ``X-Kvx-Auth: <unix seconds>:<hex>``), checked in
constant time and refused (401) when wrong, missing or more than ``MAX_SKEW_S`` old. And no body
crosses in clear: a request's body and every ``/kvx/`` reply are sealed boxes
(``kvx._kvx.seal_box``: XChaCha20-Poly1305 under a key derived from the secret), the request's
bound to its method and path, the reply's to the request's method, path and query and to a fresh
nonce the caller sends (``X-Kvx-Nonce``), so an old reply does not open as the answer to a new
request. Without a secret the directory is open, as the engines are (they warn): anyone can then
open the boxes. Worker addresses, rkeys and agent metadata never travel here: only kvx's
authenticated control connections carry them.

One path answers without the secret: ``POST /query_dp_ranks``, SGLang's own (its decode scheduler
asks it with its own client, for a prefill whose DP groups do not take rooms by the modulo): the DP
group of each room named in the body that a prefill sender registered. Rooms are random 63-bit
numbers the caller must already know, and the answer is a group index, neither secret nor an
address; registering a room's group takes the secret (``PUT /kvx/dp_rank``), so nobody else can
send a room to the wrong group.

Every directory draws an ``instance`` token at start: decode tells a prefill instance that
restarted on the same address from one that stayed up, and announces itself again."""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
import urllib.request
from http.client import HTTPException
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import parse_qs, urlparse

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from kvx import ProtocolError
from kvx._kvx import mac_key, open_box, seal_box

from .settings import secret

logger = logging.getLogger(__name__)

MAX_SKEW_S = 120
MAX_BODY = 1 << 20
# The longest a GET of /kvx/decode waits for a new announcement (its `wait` parameter).
MAX_WAIT_S = 30.0
# How long a room's registered DP group is kept (SGLang's bootstrap server keeps its entries 120 s
# by default), and the most rooms kept at once: the oldest go first.
ROOM_TTL_S = 120.0
MAX_ROOMS = 1 << 16


# The label of the requests' MAC key, derived from the secret in kvx (stretched as the engines' keys
# are, so that a guess at the secret checked against a header seen on the network costs as much).
MAC_LABEL = "kvx/sglang-directory/v1"


@functools.lru_cache(maxsize=8)
def _mac_key(secret: bytes) -> bytes:
    return mac_key(secret, MAC_LABEL)


def _mac(key: bytes, stamp: str, method: str, path: str, body: bytes) -> str:
    msg = b"\n".join([stamp.encode(), method.encode(), path.encode(), body])
    return hmac.new(_mac_key(key), msg, hashlib.sha256).hexdigest()


def sign(key: Optional[bytes], method: str, path: str, body: bytes) -> dict:
    if key is None:
        return {}
    stamp = str(int(time.time()))
    return {"X-Kvx-Auth": f"{stamp}:{_mac(key, stamp, method, path, body)}"}


def verify(key: Optional[bytes], header: Optional[str], method: str, path: str, body: bytes,
           now: Optional[float] = None) -> bool:
    """Whether `header` proves `key` for this request (always true without a key)."""
    if key is None:
        return True
    if not header or ":" not in header:
        return False
    stamp, mac = header.split(":", 1)
    try:
        age = abs((time.time() if now is None else now) - int(stamp))
    except ValueError:
        return False
    return age <= MAX_SKEW_S and hmac.compare_digest(mac, _mac(key, stamp, method, path, body))


# The sealed boxes' label: a box of the directory opens nowhere else.
BOX_LABEL = "sglang-directory/v1"


def request_aad(method: str, path: str) -> bytes:
    return b"request\n" + method.encode() + b"\n" + path.encode()


def reply_aad(method: str, path_and_query: str, nonce: str) -> bytes:
    return b"reply\n" + "\n".join([method, path_and_query, nonce]).encode()


def http(method: str, url: str, body: Optional[dict] = None, timeout: float = 5.0,
         key: Optional[bytes] = None):
    """One signed, sealed call to a directory; raises OSError on every failure: urllib's own
    errors, and ConnectionError for an answer that is not HTTP, not a directory's or does not
    open (the address may come from a client's request)."""
    try:
        return _http(method, url, body, timeout, key)
    except (HTTPException, ValueError) as e:
        raise ConnectionError(f"{method} {url}: {type(e).__name__}: {e}") from e


def _http(method: str, url: str, body: Optional[dict], timeout: float, key: Optional[bytes]):
    u = urlparse(url)
    data = b"" if body is None else seal_box(key, BOX_LABEL, request_aad(method, u.path),
                                               json.dumps(body).encode())
    nonce = secrets.token_hex(16)
    headers = {"Content-Type": "application/octet-stream", "X-Kvx-Nonce": nonce,
               **sign(key, method, u.path, data)}
    req = urllib.request.Request(url, data=data if body is not None else None, method=method,
                                 headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        sealed = r.read()
    target = u.path + (f"?{u.query}" if u.query else "")
    try:
        text = open_box(key, BOX_LABEL, reply_aad(method, target, nonce), sealed)
    except ProtocolError as e:
        raise ConnectionError(f"the directory's reply to {method} {u.path} did not open: {e}") from e
    return json.loads(text) if text else None


class KvxBootstrapServer(BaseKVBootstrapServer):
    """The prefill instance's directory (HTTP, JSON), started by SGLang on the prefill server."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.instance = secrets.token_hex(8)
        self.key = secret()
        self.refused = 0  # requests that did not prove the secret
        self._lock = threading.Lock()
        self._prefill: dict = {}  # "dp/tp/pp" -> info
        self._decodes: list = []  # announcements, in order
        self._mesh: dict = {}  # (dp, tp) -> {pp: addr}
        self._rooms: dict = {}  # room -> (dp_rank, when registered), oldest first
        # Wakes the prefill ranks' long polls of /kvx/decode when a decode announces itself.
        self._announced = threading.Condition(self._lock)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _reply(self, code, obj=None):
                body = b"" if obj is None else json.dumps(obj).encode()
                self._send(code, body)

            def _sealed(self, method: str, obj) -> None:
                """A 200 reply to an authentic request, sealed for its caller."""
                nonce = self.headers.get("X-Kvx-Nonce") or ""
                aad = reply_aad(method, self.path, nonce)
                self._send(200, seal_box(server.key, BOX_LABEL, aad, json.dumps(obj).encode()))

            def _send(self, code, body: bytes):
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the caller went away (a heartbeat that timed out)
                    pass

            def _authentic(self, method: str, path: str, body: bytes) -> bool:
                if verify(server.key, self.headers.get("X-Kvx-Auth"), method, path, body):
                    return True
                with server._lock:
                    server.refused += 1
                self._reply(401, {"error": "the request did not prove the shared secret"})
                return False

            def do_GET(self):
                u = urlparse(self.path)
                if u.path == "/health":
                    return self._reply(200, {"ok": True})
                if not u.path.startswith("/kvx/"):
                    return self._reply(404)
                if not self._authentic("GET", u.path, b""):
                    return
                q = {k: v[0] for k, v in parse_qs(u.query).items()}
                try:
                    with server._lock:
                        if u.path == "/kvx/prefill":
                            return self._sealed("GET", {"instance": server.instance,
                                                        "ranks": list(server._prefill.values())})
                        if u.path == "/kvx/decode":
                            # A long poll: answers once there is an announcement after `since`,
                            # or after `wait` seconds (at most MAX_WAIT_S) with none.
                            since = int(q.get("since", 0))
                            wait = min(float(q.get("wait", 0)), MAX_WAIT_S)
                            if wait > 0:
                                server._announced.wait_for(
                                    lambda: len(server._decodes) > since, timeout=wait)
                            return self._sealed("GET", {"instance": server.instance,
                                                        "decodes": server._decodes[since:]})
                        if u.path == "/kvx/mesh":
                            key = (int(q.get("dp_rank", 0)), int(q.get("tp_rank", 0)))
                            return self._sealed("GET", {"mesh": server._mesh.get(key, {})})
                except ValueError as e:
                    return self._reply(400, {"error": str(e)})
                return self._reply(404)

            def do_POST(self):
                u = urlparse(self.path)
                if u.path != "/query_dp_ranks":
                    return self._reply(404)
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                    if n < 0 or n > MAX_BODY:
                        return self._reply(413, {"error": "body too large"})
                    rooms = json.loads(self.rfile.read(n))["bootstrap_rooms"]
                    if not isinstance(rooms, list):
                        raise TypeError("bootstrap_rooms is not a list")
                    with server._lock:
                        server._expire_rooms()
                        found = {str(int(r)): server._rooms[int(r)][0] for r in rooms
                                 if int(r) in server._rooms}
                except (KeyError, ValueError, TypeError) as e:
                    return self._reply(400, {"error": str(e)})
                return self._reply(200, found)

            def do_PUT(self):
                u = urlparse(self.path)
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    return self._reply(400, {"error": "bad Content-Length"})
                if n < 0 or n > MAX_BODY:
                    return self._reply(413, {"error": "body too large"})
                raw = self.rfile.read(n)
                if not self._authentic("PUT", u.path, raw):
                    return
                try:
                    plain = open_box(server.key, BOX_LABEL, request_aad("PUT", u.path), raw)
                except ProtocolError:
                    with server._lock:
                        server.refused += 1
                    return self._reply(400, {"error": "the request's body did not open"})
                try:
                    b = json.loads(plain or b"{}")
                    with server._lock:
                        if u.path == "/kvx/prefill":
                            key = "/".join(str(int(b.get(k, 0)))
                                           for k in ("dp_rank", "tp_rank", "pp_rank"))
                            server._prefill[key] = b
                        elif u.path == "/kvx/decode":
                            if not any(d["decode_id"] == b["decode_id"] for d in server._decodes):
                                server._decodes.append(b)
                                server._announced.notify_all()
                        elif u.path == "/kvx/mesh":
                            key = (int(b.get("dp_rank", 0)), int(b["tp_rank"]))
                            server._mesh.setdefault(key, {})[str(int(b["pp_rank"]))] = str(b["addr"])
                        elif u.path == "/kvx/dp_rank":
                            room, dp = int(b["bootstrap_room"]), int(b["dp_rank"])
                            server._rooms.pop(room, None)
                            server._rooms[room] = (dp, time.monotonic())
                            server._expire_rooms()
                        else:
                            return self._reply(404)
                    return self._sealed("PUT", {})
                except (KeyError, ValueError, TypeError, AttributeError) as e:
                    return self._reply(400, {"error": str(e)})

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="kvx-bootstrap")
        self._thread.start()

    def _expire_rooms(self) -> None:
        """Forgets rooms registered more than ROOM_TTL_S ago, and the oldest past MAX_ROOMS (under
        the lock)."""
        now = time.monotonic()
        while self._rooms:
            room, (_, when) = next(iter(self._rooms.items()))
            if now - when <= ROOM_TTL_S and len(self._rooms) <= MAX_ROOMS:
                break
            del self._rooms[room]

    @property
    def address(self) -> str:
        h, p = self._server.server_address[:2]
        return f"{h}:{p}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
