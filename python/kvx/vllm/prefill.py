"""The prefill side of a ``KvxConnector`` worker: the side channel that decodes announce themselves
on, the one ``kvx.PrefillEngine`` that writes into every decode, and the blocks held for them.

A finished request's blocks come in the step metadata (``send``) and are offered to the engine
(``offer``): when decode's page allocation comes through kvx, the engine posts the blocks after
decode's prefix itself, on a task of its own, with no Python thread to wake in between. Before
the engine runs (no decode said HELLO yet), or where the allocation came first, the serve thread
takes the allocation (``next_request``) and posts them. Either way the request
is reported in ``finished_sending``, and vLLM may reuse its blocks, only once kvx decided it
(every write over, or the request failed on both sides). A request nobody asked for within its
lease is taken back (``withdraw``) and reported then; a decode that asks later is failed at
once."""

from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

import kvx

from .pool import Pool
from .sidechannel import SideChannelServer

logger = logging.getLogger("vllm." + __name__)  # vLLM's handlers and level

# How long an allocation for a request this worker has not heard of yet waits: the step metadata
# that carries a finished request's blocks can reach the worker after decode's allocation.
UNKNOWN_GRACE_S = 10.0
# How many requests decode gave up before this worker held their blocks are remembered.
RELEASED_KEPT = 4096
# Test only (KVX_TEST_LATE_TAG): how late a tagged request's blocks are taken.
LATE_S = 5.0


def request_key(request_id: str) -> int:
    """The kvx request id (u64) of a vLLM request id, alike on both sides."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(),
                          "little") & ((1 << 63) - 1)


@dataclass
class _Held:
    req_id: str
    rid: int
    blocks: list
    deadline: float
    tag: Optional[str]
    # held -> sending (the serve thread posts), or offered -> (the engine posts); then reported
    # on kvx's decision; or, unsent, expired | released
    state: str = "held"


class PrefillSide:
    def __init__(self, *, engine_id: str, tp_rank: int, tp_size: int, host: str, port: int,
                 secret: Optional[bytes], backend: str, compat: dict,
                 metrics: Optional[str] = None):
        self.engine_id = engine_id
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.host, self.port = host, port
        self.secret, self.backend = secret, backend
        self.compat = compat
        self.metrics = metrics
        self.pool: Optional[Pool] = None
        self.engine: Optional[kvx.PrefillEngine] = None
        self.server: Optional[SideChannelServer] = None
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._held: dict = {}  # vLLM request id -> _Held
        self._by_rid: dict = {}  # kvx id -> vLLM request id
        self._gone: dict = {}  # kvx id -> when its blocks were handed back unsent
        # vLLM request id -> when decode gave it up before this worker held its blocks (the
        # RELEASE came first): its blocks go back as soon as they come. At most RELEASED_KEPT.
        self._released_early: collections.OrderedDict = collections.OrderedDict()
        self._parked: dict = {}  # kvx id -> (IncomingRequest, give-up time)
        self._done: set = set()  # request ids for the next finished_sending
        self._closed = threading.Event()
        self._corrupt_tag = os.environ.get("KVX_TEST_CORRUPT_TAG") or None
        self._stall_tag = os.environ.get("KVX_TEST_STALL_TAG") or None
        # Test only: a tagged request's blocks are taken LATE_S after vLLM hands them over, as
        # if this worker's step came that much later.
        self._late_tag = os.environ.get("KVX_TEST_LATE_TAG") or None
        self._late: list = []  # (due, vLLM request id, its step metadata entry)

    # Start.

    def register(self, pool: Pool) -> None:
        self.pool = pool
        self.server = SideChannelServer(self.host, self.port, self.secret, self._on_message)
        logger.info("kvx: prefill worker (TP rank %d) side channel on %s", self.tp_rank,
                    self.address)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.server.port}"

    def _on_message(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "hello":
            return self._on_hello(msg)
        if op == "release":
            self._on_release([str(r) for r in msg.get("requests", [])])
            return {}
        raise ValueError(f"unknown side-channel op {op!r}")

    def _on_hello(self, msg: dict) -> dict:
        """A decode worker tells where its engine listens: serve it from this rank's engine."""
        # Both sides' TP sizes may differ (heads sliced); everything else must agree.
        mine = {**self.compat, **self.pool.facts()}
        theirs = msg.get("compat", {})
        # Block sizes may differ where both sides keep K by columns (the planner maps runs of
        # tokens); otherwise a block is opaque and moves whole.
        free = {"block_size"} if mine["key_column_bytes"] else set()
        diff = [f"{k}: prefill {mine[k]!r}, decode {theirs.get(k)!r}"
                for k in sorted(mine) if k not in free and theirs.get(k) != mine[k]]
        try:
            if self.tp_rank not in kvx.tp_sources(self.tp_size, int(theirs["tp_size"]),
                                                  self.pool.model_kv_heads,
                                                  int(theirs["tp_rank"])):
                diff.append(f"this prefill TP rank {self.tp_rank} of {self.tp_size} holds none "
                            f"of decode TP rank {theirs['tp_rank']}'s heads")
        except (KeyError, TypeError, ValueError) as e:
            diff.append(f"decode's TP rank and size: {e}")
        if diff:
            raise kvx.ConfigError("kvx: decode's KV cache does not match this prefill's ("
                                  + "; ".join(diff) + ")")
        t0 = time.monotonic()
        logger.info("kvx: decode %s (TP rank %s of %s) asks prefill TP rank %d to write into it",
                    msg.get("instance"), theirs.get("tp_rank"), theirs.get("tp_size"), self.tp_rank)
        with self._start_lock:
            if self.engine is None:
                self.engine = kvx.PrefillEngine(
                    decode=str(msg["decode"]), pp_rank=0, pp_size=1, layout=self.pool.layout,
                    total_layers=self.pool.first_layer + self.pool.num_layers,
                    page_tokens=self.pool.block_size, memory=self.pool.memory,
                    instance=self.engine_id, keep_open=True, secret=self.secret,
                    backend=self.backend, tp_rank=self.tp_rank, tp_size=self.tp_size,
                    tp_mode="head_sliced", kv_heads=self.pool.model_kv_heads,
                    metrics=self.metrics,
                    engine_id=f"vllm-prefill-{self.engine_id}-{self.tp_rank}-{os.getpid()}")
                threading.Thread(target=self._serve, args=(self.engine,), daemon=True,
                                 name="kvx-vllm-prefill").start()
                logger.info("kvx: prefill engine started (TP rank %d) for decode %s in %.3f s",
                            self.tp_rank, msg.get("instance"), time.monotonic() - t0)
            else:
                link = self.engine.add_decode(str(msg["decode"]))
                logger.info("kvx: prefill engine (TP rank %d) serves decode %s too (link %d)",
                            self.tp_rank, msg.get("instance"), link)
        return {"engine_id": self.engine_id, "tp_size": self.tp_size}

    def _on_release(self, req_ids: list) -> None:
        """Decode gave these requests up before asking for them: their blocks go back, now or,
        for a request whose blocks the step metadata has not brought yet, when they come."""
        with self._lock:
            for req_id in req_ids:
                h = self._held.get(req_id)
                if h is None:
                    self._released_early[req_id] = time.monotonic()
                    self._released_early.move_to_end(req_id)
                    while len(self._released_early) > RELEASED_KEPT:
                        self._released_early.popitem(last=False)
                    continue
                if h is not None and h.state == "offered" and not self._withdrawn(h):
                    continue
                if h is not None and h.state in ("held", "offered"):
                    logger.info("kvx: request %s: decode gave it up: blocks released", req_id)
                    h.state = "released"
                    self._hand_back(h)

    def _hand_back(self, h: _Held) -> None:
        """Holds `_lock`: reports `h` in the next finished_sending, no transfer having started."""
        self._held.pop(h.req_id, None)
        self._by_rid.pop(h.rid, None)
        self._gone[h.rid] = time.monotonic()
        self._done.add(h.req_id)

    # Steps (the model runner's thread).

    def start_load_kv(self, meta) -> None:
        now = time.monotonic()
        ready, offers = [], []
        engine = self.engine
        send = list(meta.send.items())
        if self._late_tag is not None:
            self._late += [(now + LATE_S, r, s) for r, s in send if s.get("tag") == self._late_tag]
            send = [(r, s) for r, s in send if s.get("tag") != self._late_tag]
            for late in [x for x in self._late if x[0] <= now]:
                self._late.remove(late)
                logger.warning("kvx: KVX_TEST_LATE_TAG: request %s's blocks taken now", late[1])
                send.append(late[1:])
        with self._lock:
            for req_id, s in send:
                rid = request_key(req_id)
                h = _Held(req_id, rid, list(s["blocks"]), now + float(s["lease_s"]),
                          s.get("tag"))
                self._held[req_id] = h
                self._by_rid[rid] = req_id
                self._gone.pop(rid, None)
                if self._released_early.pop(req_id, None) is not None:
                    logger.info("kvx: request %s: decode gave it up before its blocks came: "
                                "blocks released", req_id)
                    h.state = "released"
                    self._hand_back(h)
                    continue
                # Decode's allocation came before these blocks did: send it now rather than
                # when the serve thread next looks (up to its poll interval later).
                parked = self._parked.pop(rid, None)
                if parked is not None:
                    ready.append(parked)
                elif engine is not None and (self._stall_tag is None
                                             or h.tag != self._stall_tag):
                    # Under the lock, so that the serve thread, a RELEASE or a lease sees the
                    # offer made (or not) as a whole.
                    if self._offer(engine, h):
                        offers.append(h)
        for h in offers:
            # The engine keeps a decision until it is released, so none is missed here; a
            # callback that finds it made runs at once, so this is outside the lock.
            decision = engine.decided(h.rid)
            decision.add_done_callback(
                lambda h=h, decision=decision: self._decided(engine, h, decision))
        for inc, until in ready:
            self._take(self.engine, inc, until)

    def _offer(self, engine, h: _Held) -> bool:
        """Holds `_lock`: hands `h`'s blocks to the engine, which posts them when decode's
        allocation comes; False (the serve thread's to send) where it would not take them."""
        if self._corrupt_tag is not None and h.tag == self._corrupt_tag:
            # The request's first block: the first sent unless decode holds a prefix.
            self._corrupt(h.blocks[0], h.req_id)
        try:
            engine.offer(h.rid, h.blocks)
        except kvx.KvxError as e:
            logger.warning("kvx: request %s: the engine did not take its blocks (%s): they wait "
                           "for the serve thread", h.req_id, e)
            return False
        h.state = "offered"
        return True

    def _withdrawn(self, h: _Held) -> bool:
        """Holds `_lock`: takes an offer back from the engine; False where the engine posts it
        already (its blocks then come back with kvx's decision)."""
        try:
            if self.engine.withdraw(h.rid):
                return True
        except kvx.KvxError:
            pass
        h.state = "sending"
        return False

    def get_finished(self) -> set:
        now = time.monotonic()
        with self._lock:
            for h in list(self._held.values()):
                if h.state in ("held", "offered") and now > h.deadline:
                    if h.state == "offered" and not self._withdrawn(h):
                        continue
                    logger.warning("kvx: request %s: no decode asked for its blocks within the "
                                   "lease: released", h.req_id)
                    h.state = "expired"
                    self._hand_back(h)
            # A decode asking for a request forgotten here waits UNKNOWN_GRACE_S, then fails.
            for rid in [r for r, t in self._gone.items() if now - t > 6 * UNKNOWN_GRACE_S]:
                del self._gone[rid]
            # A RELEASE for blocks that never came (vLLM finished the request otherwise).
            while self._released_early and \
                    now - next(iter(self._released_early.values())) > 6 * UNKNOWN_GRACE_S:
                self._released_early.popitem(last=False)
            done, self._done = self._done, set()
        return done

    # The serve thread.

    def _serve(self, engine: "kvx.PrefillEngine") -> None:
        while not self._closed.is_set():
            try:
                inc = engine.next_request(0.2)
            except kvx.KvxError as e:
                logger.warning("kvx: prefill engine stopped serving: %s", e)
                return
            if inc is not None:
                self._take(engine, inc, time.monotonic() + UNKNOWN_GRACE_S)
            # Each parked allocation is taken once: here, or by start_load_kv when its blocks come.
            with self._lock:
                parked, self._parked = self._parked, {}
            for waiting, until in parked.values():
                self._take(engine, waiting, until)
            if inc is None and engine.closed:
                return

    def _take(self, engine, inc, until: float) -> None:
        rid = int(inc.request)
        with self._lock:
            req_id = self._by_rid.get(rid)
            h = self._held.get(req_id) if req_id is not None else None
            gone = rid in self._gone
            if h is None and not gone and time.monotonic() < until:
                self._parked[rid] = (inc, until)
                return
            if h is not None:
                if h.state == "offered":
                    return  # the engine posts it: its allocation was complete before the offer
                if h.state != "held":
                    h = None
                else:
                    h.state = "sending"
        if h is None:
            logger.warning("kvx: decode asked for request %d, whose blocks this prefill does not "
                           "hold (%s): failed", rid, "released" if gone else "unknown")
            self._fail(engine, rid)
            return
        self._send(engine, inc, h)

    def _fail(self, engine, rid: int) -> None:
        try:
            engine.fail(rid, "aborted")
            engine.decided(rid).add_done_callback(lambda: self._release_quietly(engine, rid))
        except kvx.KvxError:
            pass

    @staticmethod
    def _release_quietly(engine, rid: int) -> None:
        try:
            engine.release(rid)
        except kvx.KvxError:
            pass

    def _send(self, engine, inc, h: _Held) -> None:
        bs = self.pool.block_size
        rid = h.rid
        decision = engine.decided(rid)
        decision.add_done_callback(lambda: self._decided(engine, h, decision))
        if inc.prefix_tokens % bs:
            logger.error("kvx: request %s: decode's prefix of %d tokens is not whole blocks",
                         h.req_id, inc.prefix_tokens)
            engine.fail(rid, "aborted")
            return
        src = h.blocks[inc.prefix_tokens // bs:]
        want = -(-int(inc.prompt_tokens) // bs)
        if want > len(src):
            logger.error("kvx: request %s: decode asks for %d blocks after its prefix, this "
                         "prefill holds %d", h.req_id, want, len(src))
            engine.fail(rid, "aborted")
            return
        src = src[:want]
        if self._stall_tag is not None and h.tag == self._stall_tag:
            logger.warning("kvx: KVX_TEST_STALL_TAG: request %s is never sent", h.req_id)
            return
        if self._corrupt_tag is not None and h.tag == self._corrupt_tag:
            self._corrupt(src[0], h.req_id)
        try:
            for c in range(int(inc.chunks)):
                engine.post_chunk(rid, c, src, c + 1 == int(inc.chunks))
        except kvx.KvxError as e:
            logger.warning("kvx: request %s: posting failed: %s", h.req_id, e)
            try:
                engine.fail(rid, "write_failed")
            except kvx.KvxError:
                pass

    def _corrupt(self, block: int, req_id: str) -> None:
        """Test only (``KVX_TEST_CORRUPT_TAG``): flips bits in the first 64 bytes of `block` in
        every layer of this prefill's own cache before it is written, so a test sees that decode's
        tokens come from the moved bytes."""
        for ptr, _ in self.pool.memory:
            buf = (ctypes.c_uint8 * 64).from_address(ptr + block * self.pool.page_bytes)
            for i in range(64):
                buf[i] ^= 0x40
        logger.warning("kvx: KVX_TEST_CORRUPT_TAG: corrupted block %d of request %s", block,
                       req_id)

    def _decided(self, engine, h: _Held, decision) -> None:
        """kvx decided: no write of this request can still run; vLLM may reuse its blocks."""
        with self._lock:
            handed_back = self._held.get(h.req_id) is not h
        if handed_back:
            # Handed back unsent already (its offer was taken back): the engine still keeps the
            # decision until told to forget it.
            self._release_quietly(engine, h.rid)
            return
        try:
            outcome = decision.wait(0)
            if not outcome.complete:
                logger.warning("kvx: request %s failed: %s", h.req_id, outcome.reason)
        except kvx.KvxError as e:
            logger.warning("kvx: request %s: no decision: %s", h.req_id, e)
        self._release_quietly(engine, h.rid)
        with self._lock:
            self._held.pop(h.req_id, None)
            self._by_rid.pop(h.rid, None)
            self._done.add(h.req_id)

    def close(self) -> None:
        self._closed.set()
        if self.engine is not None:
            # Offers still waiting go back first: nothing will post them, and their decisions'
            # waiters (each holding the engine) hear now.
            with self._lock:
                for h in list(self._held.values()):
                    if h.state == "offered":
                        self._withdrawn(h)
        if self.server is not None:
            self.server.close()
        if self.engine is not None:
            try:
                self.engine.close()
            except kvx.KvxError as e:
                logger.warning("kvx: closing the prefill engine: %s", e)
