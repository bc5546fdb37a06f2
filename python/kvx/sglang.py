"""kvx as a transfer backend of SGLang 0.5.23's prefill/decode disaggregation.

``kvx.sglang.install()`` adds ``kvx`` to SGLang at run time (a ``TransferBackend.KVX`` member, its
classes in ``get_kv_class``, and the ``--disaggregation-transfer-backend`` choice), without changing
SGLang's files. The classes subclass SGLang's own bases, so Python refuses any abstract method left
out.

How it maps onto kvx:

- The prefill server's bootstrap server (``KvxBootstrapServer``, plain HTTP) is a directory: each
  prefill rank publishes its PP/TP rank and layer range; each decode rank publishes the control
  address of the ``kvx.DecodeEngine`` it runs for that prefill instance; each prefill rank publishes,
  per decode, the address its PP vote mesh listens on. Nothing secret or addressable in UCX/NIXL
  terms travels there: worker addresses, rkeys and agent metadata cross only kvx's authenticated
  control connections, which prove the shared secret (``KVX_SECRET`` or ``KVX_SECRET_FILE``) first.
- A decode rank runs one ``DecodeEngine`` per prefill instance over its KV pool. A receiver's
  ``send_metadata(kv_indices)`` is ``expect(room, pages * page_size, chunk, kv_indices)``; its poll
  follows the request's ``Pending``.
- A prefill rank runs one ``PrefillEngine`` per decode that announced itself. A sender's poll says
  ``WaitingForInput`` once decode's page allocation for its room arrived; ``send(kv_indices)`` is
  called once per prefill chunk with that chunk's pages, and the sender posts kvx chunks (decode's
  chunk size) as soon as their pages are known, the last with the final send. The request
  succeeds only when every PP rank's every chunk arrived (decode) and every rank voted complete
  (prefill); a rank that never sends its last chunk fails the request, never completes it.
- Aborts go through kvx's abort path: the ranks stop and acknowledge, so
  ``is_abort_release_safe`` (deferred KV release) says true only once no write can still land.

Settings (environment): ``KVX_SECRET`` / ``KVX_SECRET_FILE`` (the deployment's shared secret),
``KVX_BACKEND`` (``ucx``, default, or ``nixl``), ``KVX_CHUNK_TOKENS`` (decode's chunk size in tokens,
rounded to pages; default 1024), ``KVX_REQUEST_TIMEOUT`` (seconds, default 300), ``KVX_DEVICE``
(``cpu`` or ``cuda:N``; default ``cuda:<gpu_id>`` where torch sees CUDA, else ``cpu``).

A rank's KV buffers (one per layer, then per K and V, in SGLang's order) are registered one by one
(or as one region when they happen to be adjacent); writes never cross a buffer. The metadata rows (``aux_index``: the first output token, logprobs...) travel on kvx's control
connection (``send_aux``) before the last chunk; a receiver reports ``Success`` once the pages and
the last PP rank's row are in place. Limits: extra state buffers (Mamba, SWA) are not carried;
identical TP on both sides; one decode PP rank.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional
from urllib.parse import parse_qs, urlparse

import numpy as np

import kvx
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

logger = logging.getLogger(__name__)

__all__ = [
    "KvxBootstrapServer",
    "KvxKVManager",
    "KvxKVReceiver",
    "KvxKVSender",
    "install",
]


# --- settings -------------------------------------------------------------------------------------


def _secret() -> Optional[bytes]:
    path = os.environ.get("KVX_SECRET_FILE")
    if path:
        with open(path, "rb") as f:
            return f.read().rstrip(b"\n")
    s = os.environ.get("KVX_SECRET")
    if s:
        return s.encode()
    logger.warning("kvx: no KVX_SECRET or KVX_SECRET_FILE: engines accept any peer")
    return None


def _device(args: KVArgs) -> str:
    d = os.environ.get("KVX_DEVICE")
    if d:
        return d
    try:
        import torch

        if torch.cuda.is_available():
            return f"cuda:{getattr(args, 'gpu_id', 0)}"
    except ImportError:
        pass
    return "cpu"


# How long a complete request waits for its metadata row, which travels on the control connection.
_AUX_WAIT_S = 10.0


def _request_timeout() -> float:
    return float(os.environ.get("KVX_REQUEST_TIMEOUT", "300"))


def _failed(cause: str, message: str) -> "kvx.TransferFailed":
    e = kvx.TransferFailed(message)
    e.cause = e.reason = cause
    return e


def _http(method: str, url: str, body: Optional[dict] = None, timeout: float = 5.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read()
    return json.loads(text) if text else None


# --- the bootstrap server -------------------------------------------------------------------------


class KvxBootstrapServer(BaseKVBootstrapServer):
    """The prefill instance's directory: prefill ranks, the decode engines that announced
    themselves, and each prefill rank's vote-mesh address per decode engine (HTTP, JSON)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self._prefill: dict = {}  # "tp/pp" -> info
        self._decodes: list = []  # announcements, in order
        self._mesh: dict = {}  # (decode_id, tp) -> {pp: addr}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _reply(self, code, obj=None):
                body = b"" if obj is None else json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                if n > 1 << 20:
                    raise ValueError("body too large")
                return json.loads(self.rfile.read(n) or b"{}")

            def do_GET(self):
                u = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(u.query).items()}
                with server._lock:
                    if u.path == "/health":
                        return self._reply(200, {"ok": True})
                    if u.path == "/kvx/prefill":
                        return self._reply(200, {"ranks": list(server._prefill.values())})
                    if u.path == "/kvx/decode":
                        since = int(q.get("since", 0))
                        return self._reply(200, {"decodes": server._decodes[since:]})
                    if u.path == "/kvx/mesh":
                        key = (q.get("decode_id", ""), int(q.get("tp_rank", 0)))
                        return self._reply(200, {"mesh": server._mesh.get(key, {})})
                return self._reply(404)

            def do_PUT(self):
                try:
                    b = self._body()
                    with server._lock:
                        if self.path == "/kvx/prefill":
                            server._prefill[f"{int(b['tp_rank'])}/{int(b['pp_rank'])}"] = b
                        elif self.path == "/kvx/decode":
                            if not any(d["decode_id"] == b["decode_id"] for d in server._decodes):
                                server._decodes.append(b)
                        elif self.path == "/kvx/mesh":
                            key = (str(b["decode_id"]), int(b["tp_rank"]))
                            server._mesh.setdefault(key, {})[str(int(b["pp_rank"]))] = str(b["addr"])
                        else:
                            return self._reply(404)
                    return self._reply(200, {})
                except (KeyError, ValueError, TypeError) as e:
                    return self._reply(400, {"error": str(e)})

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="kvx-bootstrap")
        self._thread.start()

    @property
    def address(self) -> str:
        h, p = self._server.server_address[:2]
        return f"{h}:{p}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --- the manager ----------------------------------------------------------------------------------


class _Pool:
    """A rank's KV pool as kvx sees it, from SGLang's KVArgs."""

    def __init__(self, args: KVArgs, is_mla: bool, first_layer: int):
        ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
        if not ptrs or len(ptrs) != len(lens) or len(lens) != len(items):
            raise kvx.ConfigError("kvx: KVArgs has no KV buffers, or mismatched lists")
        if len(set(lens)) != 1 or len(set(items)) != 1:
            raise kvx.ConfigError("kvx: every KV buffer must have the same length and page size")
        split = not is_mla
        if split and len(ptrs) % 2:
            raise kvx.ConfigError("kvx: an MHA pool needs K and V buffers for every layer")
        self.num_layers = len(ptrs) // (2 if split else 1)
        self.page_bytes = items[0]
        self.num_pages = lens[0] // items[0]
        self.split = split
        self.first_layer = first_layer
        self.memory = [(p, l) for p, l in zip(ptrs, lens)]
        self.layout = kvx.Layout(first_layer=first_layer, num_layers=self.num_layers,
                                 page_bytes=self.page_bytes, num_pages=self.num_pages, split_kv=split)


class KvxKVManager(BaseKVManager):
    """One per scheduler rank. Prefill: publishes the rank and starts a PrefillEngine for every
    decode engine that announces itself. Decode: one DecodeEngine per prefill instance."""

    supports_deferred_decode_kv_release = True
    enable_deferred_decode_kv_release = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args,
                 is_mla_backend: Optional[bool] = False):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.tp_rank = int(args.engine_rank)
        self.pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        self.pp_size = int(getattr(server_args, "pp_size", 1) or 1)
        self.page_size = int(args.page_size)
        self.host = getattr(server_args, "host", "127.0.0.1") or "127.0.0.1"
        self.backend = os.environ.get("KVX_BACKEND", "ucx")
        self.secret = _secret()
        self.device = _device(args)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.failures: dict = {}
        corrupt = os.environ.get("KVX_TEST_CORRUPT_ROOM")
        self.corrupt_room: Optional[int] = int(corrupt) if corrupt else None
        # The metadata buffers (first output token, logprobs...): one row per request slot.
        self.aux = [(int(p), int(n), int(i)) for p, n, i in zip(
            getattr(args, "aux_data_ptrs", None) or [], getattr(args, "aux_data_lens", None) or [],
            getattr(args, "aux_item_lens", None) or [])]
        if disaggregation_mode == DisaggregationMode.PREFILL:
            first = int(getattr(args, "prefill_start_layer", 0) or 0)
            self.pool = _Pool(args, self.is_mla_backend, first)
            port = getattr(server_args, "disaggregation_bootstrap_port", None)
            self.bootstrap_url = f"http://{self.host}:{port}"
            self._prefills: dict = {}  # decode_id -> PrefillEngine
            self._allocations: dict = {}  # room -> (PrefillEngine, IncomingRequest)
            self._alloc_cv = threading.Condition(self._lock)
            # SGLang's scheduler never calls register_to_bootstrap(): a backend registers its
            # prefill rank when the manager is made, as SGLang's own managers do.
            self.register_to_bootstrap()
        else:
            self.pool = _Pool(args, self.is_mla_backend, 0)
            self._decodes: dict = {}  # bootstrap_addr -> DecodeEngine
            self._pp: dict = {}  # bootstrap_addr -> that prefill instance's PP size
            self._rooms: dict = {}  # room -> DecodeEngine
            # What the decode scheduler reads of each prefill instance (one DP rank each).
            self.prefill_info_table: dict = {}
            self.id = f"{os.getpid()}-{self.tp_rank}-{id(self):x}"

    # Prefill side.

    def register_to_bootstrap(self):
        if self.disaggregation_mode != DisaggregationMode.PREFILL:
            return
        info = {"tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "pp_size": self.pp_size,
                "first_layer": self.pool.first_layer, "num_layers": self.pool.num_layers,
                "page_size": self.page_size, "page_bytes": self.pool.page_bytes,
                "split_kv": self.pool.split, "backend": self.backend}
        deadline = time.monotonic() + 60
        while True:
            try:
                _http("PUT", f"{self.bootstrap_url}/kvx/prefill", info)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        threading.Thread(target=self._watch_decodes, daemon=True, name="kvx-watch").start()

    def _watch_decodes(self):
        seen = 0
        while not self._closed.is_set():
            try:
                got = _http("GET", f"{self.bootstrap_url}/kvx/decode?since={seen}")["decodes"]
            except OSError:
                got = []
            for d in got:
                seen += 1
                if int(d.get("tp_rank", -1)) == self.tp_rank:
                    threading.Thread(target=self._connect, args=(d,), daemon=True).start()
            self._closed.wait(0.05)

    def _connect(self, d: dict):
        """A PrefillEngine for the decode engine `d` announced, with this decode's vote mesh."""
        decode_id = d["decode_id"]
        try:
            peers, mesh_socket = [], None
            if self.pp_size > 1:
                # Bound now and held, so the port published below stays ours until the rank starts.
                mesh_socket = kvx.MeshSocket(f"{self.host}:0")
                mine = mesh_socket.address
                _http("PUT", f"{self.bootstrap_url}/kvx/mesh", {
                    "decode_id": decode_id, "tp_rank": self.tp_rank, "pp_rank": self.pp_rank,
                    "addr": mine})
                deadline = time.monotonic() + 60
                while True:
                    mesh = _http("GET", f"{self.bootstrap_url}/kvx/mesh?decode_id={decode_id}"
                                        f"&tp_rank={self.tp_rank}")["mesh"]
                    if len(mesh) == self.pp_size:
                        peers = [mesh[str(r)] for r in range(self.pp_size)]
                        break
                    if time.monotonic() > deadline:
                        raise kvx.Timeout(f"PP ranks of decode {decode_id} never all published")
                    time.sleep(0.02)
            engine = kvx.PrefillEngine(
                decode=d["address"], pp_rank=self.pp_rank, pp_size=self.pp_size,
                layout=self.pool.layout, total_layers=int(d["total_layers"]),
                page_tokens=self.page_size, memory=self.pool.memory, peers=peers,
                mesh_socket=mesh_socket,
                secret=self.secret, backend=self.backend, device=self.device,
                engine_id=f"sglang-prefill-{self.tp_rank}-{self.pp_rank}-{os.getpid()}-{decode_id}")
        except Exception:
            logger.exception("kvx: cannot connect to decode %s", decode_id)
            return
        with self._lock:
            self._prefills[decode_id] = engine
        while not self._closed.is_set():
            req = engine.next_request(0.5)
            if req is None:
                if engine.closed:
                    return
                continue
            with self._alloc_cv:
                self._allocations[req.request] = (engine, req)
                self._alloc_cv.notify_all()

    def allocation(self, room: int):
        with self._lock:
            return self._allocations.get(room)

    def forget(self, room: int):
        with self._lock:
            self._allocations.pop(room, None)

    # Decode side.

    def decode_engine(self, bootstrap_addr: str) -> "kvx.DecodeEngine":
        """The DecodeEngine for the prefill instance at `bootstrap_addr`, started (and announced to
        it) on first use."""
        with self._lock:
            e = self._decodes.get(bootstrap_addr)
            if e is not None:
                return e
        url = f"http://{bootstrap_addr}"
        ranks = _http("GET", f"{url}/kvx/prefill")["ranks"]
        mine = [r for r in ranks if int(r["tp_rank"]) == self.tp_rank]
        if not mine:
            raise kvx.ConfigError(f"kvx: no prefill rank of TP rank {self.tp_rank} at {bootstrap_addr}")
        pp_size = int(mine[0]["pp_size"])
        e = kvx.DecodeEngine(
            layout=self.pool.layout, total_layers=self.pool.num_layers, page_tokens=self.page_size,
            pp_size=pp_size, memory=self.pool.memory, listen=f"{self.host}:0",
            secret=self.secret, backend=self.backend, device=self.device,
            engine_id=f"sglang-decode-{self.id}-{len(self._decodes)}")
        with self._lock:
            if bootstrap_addr in self._decodes:  # another receiver won the race
                e.shutdown(1)
                return self._decodes[bootstrap_addr]
            self._decodes[bootstrap_addr] = e
            self._pp[bootstrap_addr] = pp_size
        decode_id = f"{self.id}-{bootstrap_addr}"
        _http("PUT", f"{url}/kvx/decode", {"decode_id": decode_id, "tp_rank": self.tp_rank,
                                            "address": e.address,
                                            "total_layers": self.pool.num_layers})
        return e

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Whether the prefill instance at `bootstrap_addr` registered its ranks (without
        blocking the scheduler for long)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        try:
            ranks = _http("GET", f"http://{bootstrap_addr}/kvx/prefill", timeout=1.0)["ranks"]
        except OSError:
            return False
        mine = [r for r in ranks if int(r["tp_rank"]) == self.tp_rank]
        if not mine or len(mine) < int(mine[0]["pp_size"]):
            return False
        import types

        self.prefill_info_table[bootstrap_addr] = types.SimpleNamespace(
            dp_size=1, follow_bootstrap_room=True, pp_size=int(mine[0]["pp_size"]))
        return True

    def aux_row(self, index: int) -> bytes:
        """The metadata row `index` of every aux buffer, concatenated."""
        import ctypes

        out = bytearray()
        for ptr, length, item in self.aux:
            if (index + 1) * item > length:
                raise kvx.ConfigError(f"kvx: aux row {index} is outside its buffer")
            out += ctypes.string_at(ptr + index * item, item)
        return bytes(out)

    def write_aux_row(self, index: int, data: bytes) -> None:
        """Writes `data` (as `aux_row` reads it) into metadata row `index`."""
        import ctypes

        if len(data) != sum(item for _, _, item in self.aux):
            raise kvx.ConfigError(
                f"kvx: aux payload of {len(data)} bytes does not match this side's metadata rows")
        at = 0
        for ptr, length, item in self.aux:
            if (index + 1) * item > length:
                raise kvx.ConfigError(f"kvx: aux row {index} is outside its buffer")
            ctypes.memmove(ptr + index * item, data[at:at + item], item)
            at += item

    def corrupt_first_page(self, pages: List[int]) -> None:
        """Test only (``KVX_TEST_CORRUPT_ROOM``): flips one bit of the top byte of the first value
        of the request's first page in the first buffer, after it arrived, so a test can see that
        decode's tokens come from the moved pages."""
        import ctypes

        if not pages:
            return
        ptr, _ = self.pool.memory[0]
        at = ptr + pages[0] * self.pool.page_bytes + 3
        byte = ctypes.c_uint8.from_address(at)
        byte.value ^= 0x40
        logger.warning("kvx: KVX_TEST_CORRUPT_ROOM: corrupted page %d of room %d", pages[0],
                       self.corrupt_room)

    def chunk_tokens(self) -> int:
        want = int(os.environ.get("KVX_CHUNK_TOKENS", "1024"))
        return max(1, want // self.page_size) * self.page_size

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """True once no write of any prefill rank can still land in the room's pages."""
        with self._lock:
            e = self._rooms.get(bootstrap_room)
        if e is None:
            return True
        return e.is_released(bootstrap_room)

    def record_failure(self, room: int, reason: str):
        with self._lock:
            self.failures[room] = reason

    def close(self):
        self._closed.set()
        with self._lock:
            prefills = list(getattr(self, "_prefills", {}).values())
            decodes = list(getattr(self, "_decodes", {}).values())
        for p in prefills:
            p.close()
        for d in decodes:
            d.shutdown(5)

    teardown = close


# --- sender ---------------------------------------------------------------------------------------


class KvxKVSender(BaseKVSender):
    """One request on one prefill rank."""

    def __init__(self, mgr: KvxKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.num_pages: Optional[int] = None
        self.aux_index = None
        self.pages: List[int] = []
        self.posted: list = []
        self.next_chunk = 0
        self.decision = None
        self.failed: Optional[BaseException] = None
        self.started: Optional[float] = None
        self.finished: Optional[float] = None
        self.bytes = 0
        self.engine = None
        self.request = None

    def _fail(self, e: BaseException):
        if self.failed is None:
            self.failed = e
            if self.finished is None:
                self.finished = time.monotonic()

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        self.num_pages = int(num_kv_indices)
        self.aux_index = aux_index

    def _bind(self) -> bool:
        if self.engine is None:
            got = self.kv_mgr.allocation(self.bootstrap_room)
            if got is None:
                return False
            self.engine, self.request = got
            # Every rank's vote: it also ends (failed) when decode or a PP peer fails the request.
            self.decision = self.engine.decided(self.bootstrap_room)
        return True

    def send(self, kv_indices, state_indices=None, num_kv_tokens: Optional[int] = None):
        if self.failed is not None:
            return
        if not self._bind():
            self._fail(kvx.UnknownRequest(
                f"kvx: decode's page allocation for room {self.bootstrap_room} has not arrived"))
            return
        if self.started is None:
            self.started = time.monotonic()
        self.pages.extend(int(p) for p in np.asarray(kv_indices).reshape(-1))
        total = self.num_pages if self.num_pages is not None else len(self.pages)
        per = max(1, self.request.chunk_tokens // self.kv_mgr.page_size)
        chunks = self.request.chunks
        src = self.pages + [self.pages[0] if self.pages else 0] * max(0, total - len(self.pages))
        try:
            while self.next_chunk < chunks:
                end = min((self.next_chunk + 1) * per, total)
                if len(self.pages) < end:
                    break
                last = self.next_chunk + 1 == chunks
                if last and self.kv_mgr.aux and self.aux_index is not None:
                    # The metadata row goes first, on the control connection.
                    self.engine.send_aux(self.bootstrap_room, self.kv_mgr.aux_row(int(self.aux_index)))
                self.posted.append(self.engine.post_chunk(self.bootstrap_room, self.next_chunk,
                                                          src, last))
                self.bytes += (end - self.next_chunk * per) * self.kv_mgr.pool.page_bytes * \
                    self.kv_mgr.pool.num_layers * (2 if self.kv_mgr.pool.split else 1)
                self.next_chunk += 1
        except kvx.KvxError as e:
            self._fail(e)

    def poll(self) -> KVPoll:
        if self.failed is not None:
            return KVPoll.Failed
        if self.engine is None and not self._bind():
            return KVPoll.Bootstrapping
        if self.decision.done():
            # The decision is the answer: it needs this rank's own vote, cast once its writes were
            # over, so no post of ours is still in flight; a local completion not yet reported to
            # its Pending says nothing more.
            outcome = self.decision.wait(0)
            if not outcome.complete:
                self._fail(outcome.error())
                return KVPoll.Failed
            if self.finished is None:
                self.finished = time.monotonic()
            return KVPoll.Success
        for p in self.posted:
            if p.done():
                try:
                    p.wait(0)
                except kvx.KvxError as e:
                    self._fail(e)
                    return KVPoll.Failed
        return KVPoll.Transferring if self.posted else KVPoll.WaitingForInput

    def poll_pp_consensus(self) -> KVPoll:
        # Success already means every PP rank voted complete (kvx's vote board).
        return self.poll()

    def mark_prefill_complete(self) -> None:
        pass

    def failure_exception(self):
        raise self.failed or _failed("other", f"room {self.bootstrap_room}: failed")

    def abort(self):
        if self.engine is not None:
            try:
                self.engine.fail(self.bootstrap_room, "aborted")
            except kvx.KvxError:
                pass
        self._fail(_failed("aborted", f"room {self.bootstrap_room}: aborted on prefill"))

    def clear(self):
        if self.engine is not None:
            try:
                self.engine.release(self.bootstrap_room)
            except kvx.KvxError:
                pass
        self.kv_mgr.forget(self.bootstrap_room)

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None
        if self.started is not None and self.finished is not None:
            latency = self.finished - self.started
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=self.bytes)


# --- receiver -------------------------------------------------------------------------------------


class KvxKVReceiver(BaseKVReceiver):
    """One request on one decode rank."""

    def __init__(self, mgr: KvxKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room) if bootstrap_room is not None else None
        self.engine = None
        self.pending = None
        self.failed: Optional[BaseException] = None
        self.succeeded = False
        self.abort_notified = False
        self.require_staging = False
        self.aux_index: Optional[int] = None
        self.aux_deadline: Optional[float] = None
        # The prefill ranks that may write this room's pages (their count is what SGLang's deferred
        # release waits for; kvx's own acknowledgements decide it).
        self.bootstrap_infos: list = []
        self.pages: List[int] = []

    def init(self, prefill_dp_rank: int = 0):
        try:
            self.engine = self.kv_mgr.decode_engine(self.bootstrap_addr)
            info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
            self.bootstrap_infos = list(range(info.pp_size if info else 1))
        except (OSError, kvx.KvxError) as e:
            self.failed = e

    def send_metadata(self, kv_indices, aux_index: Optional[int] = None, state_indices=None,
                      decode_prefix_len: Optional[int] = None, destination=None, **_):
        if self.failed is not None:
            return
        self.aux_index = aux_index
        pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        self.pages = pages
        try:
            self.pending = self.engine.expect(self.bootstrap_room, len(pages) * self.kv_mgr.page_size,
                                              self.kv_mgr.chunk_tokens(), pages, _request_timeout())
            with self.kv_mgr._lock:
                self.kv_mgr._rooms[self.bootstrap_room] = self.engine
        except (kvx.KvxError, AttributeError) as e:
            self.failed = e

    @property
    def conclude_state(self) -> Optional[int]:
        if self.failed is not None:
            return KVPoll.Failed
        return KVPoll.Success if self.succeeded else None

    def poll(self) -> KVPoll:
        if self.failed is not None:
            return KVPoll.Failed
        if self.succeeded:
            return KVPoll.Success
        if self.engine is None:
            return KVPoll.Bootstrapping
        if self.pending is None:
            try:
                self.engine.wait_for_ranks(0)
            except kvx.Timeout:
                return KVPoll.Bootstrapping
            return KVPoll.WaitingForInput
        if not self.pending.done():
            return KVPoll.Transferring
        outcome = self.pending.wait(0)
        if outcome.complete:
            if self.kv_mgr.aux and self.aux_index is not None:
                # The last PP rank's metadata row (its first output token) must be in place too.
                last_rank = self.kv_mgr._pp.get(self.bootstrap_addr, 1) - 1
                data = self.engine.aux(self.bootstrap_room, last_rank)
                if data is None:
                    now = time.monotonic()
                    if self.aux_deadline is None:
                        self.aux_deadline = now + _AUX_WAIT_S
                    if now < self.aux_deadline:
                        return KVPoll.Transferring
                    self.failed = _failed("aux_missing", f"room {self.bootstrap_room}: no metadata row "
                                                         f"from PP rank {last_rank}")
                    return KVPoll.Failed
                try:
                    self.kv_mgr.write_aux_row(int(self.aux_index), data)
                except kvx.KvxError as e:
                    self.failed = e
                    return KVPoll.Failed
            if self.kv_mgr.corrupt_room == self.bootstrap_room:
                self.kv_mgr.corrupt_first_page(self.pages)
            self.succeeded = True
            return KVPoll.Success
        self.failed = outcome.error()
        return KVPoll.Failed

    def failure_exception(self):
        raise self.failed or _failed("other", f"room {self.bootstrap_room}: failed")

    def abort(self):
        if self.failed is None and not self.succeeded:
            self.failed = _failed("aborted", f"room {self.bootstrap_room}: aborted on decode")
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        if not self.abort_notified and self.engine is not None and self.bootstrap_room is not None:
            self.engine.abort(self.bootstrap_room)
            self.abort_notified = True

    def is_abort_release_safe(self) -> bool:
        return self.kv_mgr.is_abort_release_safe(self.bootstrap_room, 0)

    def clear(self):
        # SGLang clears a receiver once its pages are released (after a failure, once
        # is_abort_release_safe said so): the manager forgets the room.
        with self.kv_mgr._lock:
            self.kv_mgr._rooms.pop(self.bootstrap_room, None)


# --- installing into SGLang -----------------------------------------------------------------------


def install() -> None:
    """Makes ``--disaggregation-transfer-backend kvx`` select these classes, in this process.
    Idempotent. Call it before SGLang parses its arguments (in every process that runs a
    scheduler, since SGLang's schedulers resolve the backend themselves)."""
    import sys

    from sglang.srt.disaggregation import utils

    TB = utils.TransferBackend
    if "KVX" not in TB.__members__:
        member = object.__new__(TB)
        member._name_, member._value_ = "KVX", "kvx"
        member.__objclass__ = TB
        TB._member_map_["KVX"] = member
        TB._value2member_map_["kvx"] = member
        TB._member_names_.append("KVX")
        type.__setattr__(TB, "KVX", member)
    original = getattr(utils.get_kv_class, "_kvx_original", utils.get_kv_class)
    classes = {
        utils.KVClassType.MANAGER: KvxKVManager,
        utils.KVClassType.SENDER: KvxKVSender,
        utils.KVClassType.RECEIVER: KvxKVReceiver,
        utils.KVClassType.BOOTSTRAP_SERVER: KvxBootstrapServer,
    }

    def get_kv_class(transfer_backend, class_type):
        if transfer_backend is TB.KVX and class_type != utils.KVClassType.KVARGS:
            return classes[class_type]
        return original(transfer_backend, class_type)

    get_kv_class._kvx_original = original
    # Modules that imported the function by name hold their own reference.
    for mod in list(sys.modules.values()):
        if getattr(mod, "get_kv_class", None) is original:
            mod.get_kv_class = get_kv_class
    utils.get_kv_class = get_kv_class
    try:
        from sglang.srt.arg_groups import choices

        if "kvx" not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
            choices.add_disagg_transfer_backend_choices(["kvx"])
    except ImportError:
        pass
