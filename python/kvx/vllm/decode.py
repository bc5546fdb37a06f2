"""The decode side of a ``KvxConnector`` worker: one ``kvx.DecodeEngine`` over the worker's KV cache
for every prefill instance (each a session of it, named by the instance's engine id), and the
loads vLLM is waiting for.

A load comes in the step metadata (``recv``): the destination blocks vLLM allocated and the
prefill request's params. Where the prefill instance's ranks are all connected, the
model runner's thread ``expect``s the request at once; otherwise a background thread makes sure
they are (the first time: ``add_instance``, then the side channel's HELLO with this engine's
address, then ``wait_for_ranks``) and ``expect``s it; ``get_finished`` reports each
load once it is over. A load that failed (refused, unreachable prefill, kvx failure, timeout,
abort) reports its blocks in ``get_block_ids_with_load_errors`` in the same pass as its
``finished_recving``, so vLLM recomputes or fails it by ``kv_load_failure_policy``; a failed
load whose blocks kvx keeps quarantined (a prefill rank did not confirm that its writes are
over) is reported only once kvx released them.

A prefill instance whose ranks stay disconnected for ``GONE_AFTER_S`` while no load of it is in
progress is removed from the engine (``remove_instance``), so a deployment whose prefill
instances come and go keeps no session per instance that left; a later request of that instance
announces this rank to it again."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import kvx

from . import sidechannel
from .pool import Pool
from .prefill import request_key

logger = logging.getLogger("vllm." + __name__)  # vLLM's handlers and level

# How often the background thread looks for prefill instances that went away, and how long an
# instance's ranks must stay disconnected (kvx's own bound on a silent rank is three 5 s
# heartbeats) before it is removed.
GONE_CHECK_S = 1.0
GONE_AFTER_S = 15.0


@dataclass
class _Load:
    req_id: str
    rid: int
    dst: list
    prefix_tokens: int
    tokens: int
    remote: Optional[dict]
    error: Optional[str] = None
    pending: Any = None
    aborted: bool = False
    warned: bool = False
    checked: bool = False
    started: float = 0.0


class DecodeSide:
    def __init__(self, *, engine_id: str, tp_rank: int, tp_size: int, host: str,
                 secret: Optional[bytes], backend: str, compat: dict, request_timeout: float,
                 handshake_timeout: float, metrics: Optional[str] = None,
                 progress_fifo: Optional[int] = None, progress_spin_us: Optional[int] = None,
                 landing_bytes: Optional[int] = None, landing_slots: Optional[int] = None):
        self.engine_id = engine_id
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.host = host
        self.secret, self.backend = secret, backend
        self.compat = compat
        self.metrics = metrics
        self.progress_fifo = progress_fifo
        self.progress_spin_us = progress_spin_us
        self.landing_bytes = landing_bytes
        self.landing_slots = landing_slots
        self.request_timeout = request_timeout
        self.handshake_timeout = handshake_timeout
        self.pool: Optional[Pool] = None
        self.engine: Optional[kvx.DecodeEngine] = None
        self._lock = threading.Lock()
        self._loads: dict = {}  # vLLM request id -> _Load
        self._invalid: set = set()
        self._queue: "queue.Queue" = queue.Queue()
        self._away: dict = {}  # prefill instance -> since when its ranks are not all connected
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvx-vllm-decode")

    def register(self, pool: Pool) -> None:
        self.pool = pool
        self.engine = kvx.DecodeEngine(
            layout=pool.layout, total_layers=pool.first_layer + pool.num_layers,
            page_tokens=pool.block_size, pp_size=0, memory=pool.memory,
            listen=f"{self.host}:0", secret=self.secret, backend=self.backend,
            engine_id=f"vllm-decode-{self.engine_id}-{self.tp_rank}-{os.getpid()}",
            tp_rank=self.tp_rank, tp_size=self.tp_size, tp_mode="head_sliced",
            kv_heads=pool.model_kv_heads, decode_instance=self.engine_id, metrics=self.metrics,
            progress_fifo=self.progress_fifo, progress_spin_us=self.progress_spin_us,
            landing_bytes=self.landing_bytes, landing_slots=self.landing_slots)
        self._thread.start()
        logger.info("kvx: decode engine (TP rank %d) listens on %s", self.tp_rank,
                    self.engine.address)

    # Steps (the model runner's thread).

    def start_load_kv(self, meta) -> None:
        now = []
        with self._lock:
            for req_id, r in meta.recv.items():
                remote = r.get("remote")
                rid = request_key(remote["request_id"]) if remote else 0
                load = _Load(req_id, rid, list(r["dst"]), int(r["prefix_tokens"]),
                             int(r.get("tokens") or 0), remote,
                             error=r.get("refused"))
                self._loads[req_id] = load
                if load.error is None:
                    now.append(load)
                elif remote is not None:
                    self._queue.put(("release", remote))
        for load in now:
            if not self._start_now(load):
                self._queue.put(("load", load))
        for rel in meta.release:
            self._queue.put(("release_many", rel))

    def _start_now(self, load: _Load) -> bool:
        """Expects `load` here, on the model runner's thread, where every rank of its prefill
        instance is connected already: `expect` only hands the request to the engine, and the
        background thread would add its wake-up (tens of milliseconds, more with the model
        runner holding the GIL) to the request's wait. False where the background thread must
        start it (a first request of an instance: its handshake may take seconds)."""
        remote = load.remote
        try:
            self.engine.wait_for_ranks(0, instance=remote["engine_id"])
        except kvx.KvxError:
            return False
        try:
            pending = self._expect(load)
        except Exception as e:  # any failure fails the load, never leaves it waiting
            with self._lock:
                load.error = f"{type(e).__name__}: {e}"
            # The prefill may hold the blocks still: the background thread tells it.
            self._queue.put(("release", remote))
            return True
        with self._lock:
            load.pending = pending
        return True

    def _expect(self, load: _Load):
        """Hands `load` to the engine: its `Pending`."""
        bs = self.pool.block_size
        # The prompt's tokens after the prefix (in blocks of either size), or whole blocks.
        tokens = min(load.tokens, len(load.dst) * bs) or len(load.dst) * bs
        load.started = time.monotonic()
        return self.engine.expect(
            load.rid, prompt_tokens=tokens, chunk_tokens=tokens,
            dst_pages=load.dst[:-(-tokens // bs)], timeout=self.request_timeout,
            prefix_tokens=load.prefix_tokens, instance=load.remote["engine_id"])

    def get_finished(self, finished_req_ids: "set[str]") -> set:
        done: set = set()
        with self._lock:
            for req_id in finished_req_ids:
                load = self._loads.get(req_id)
                if load is not None and not load.aborted:
                    # Finished (aborted) while loading: kvx stops the ranks; the blocks come back
                    # once no write can land in them.
                    load.aborted = True
                    if load.pending is not None and not load.pending.done():
                        try:
                            self.engine.abort(load.rid)
                        except kvx.KvxError:
                            pass
            for load in list(self._loads.values()):
                if load.pending is not None and load.pending.done():
                    if not load.checked:
                        load.checked = True
                        try:
                            outcome = load.pending.wait(0)
                            if not outcome.complete:
                                load.error = f"{outcome.reason}"
                        except kvx.KvxError as e:
                            load.error = str(e)
                    if load.error is None:
                        logger.debug("kvx: request %s: %d blocks loaded in %.2f ms", load.req_id,
                                     len(load.dst), 1e3 * (time.monotonic() - load.started))
                        done.add(load.req_id)
                        del self._loads[load.req_id]
                        continue
                    if self._quarantined(load):
                        continue
                elif load.error is None or load.pending is not None:
                    continue  # still loading, or the thread is still on it
                # Failed: the blocks hold nothing valid; vLLM recomputes or fails the request.
                if not load.aborted:
                    logger.warning("kvx: request %s: KV load failed (%s): %d blocks reported as "
                                   "load errors", load.req_id, load.error, len(load.dst))
                self._invalid.update(load.dst)
                done.add(load.req_id)
                del self._loads[load.req_id]
        return done

    def _quarantined(self, load: _Load) -> bool:
        """Whether kvx still keeps the failed load's blocks: a prefill rank may still write."""
        try:
            held = load.rid in self.engine.quarantined() and not self.engine.is_released(load.rid)
        except kvx.KvxError:
            return False
        if held and not load.warned:
            load.warned = True
            logger.warning("kvx: request %s: failed (%s), its blocks quarantined until the "
                           "prefill rank confirms that its writes are over", load.req_id,
                           load.error)
        return held

    def get_block_ids_with_load_errors(self) -> set:
        with self._lock:
            out, self._invalid = self._invalid, set()
        return out

    # The background thread: handshakes and expects, off the model runner's thread.

    def _run(self) -> None:
        next_check = time.monotonic() + GONE_CHECK_S
        while not self._closed.is_set():
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + GONE_CHECK_S
                try:
                    self._forget_gone(time.monotonic())
                except Exception:  # never lose the thread
                    logger.exception("kvx: looking for prefill instances that left failed")
            try:
                kind, item = self._queue.get(timeout=GONE_CHECK_S / 2)
            except queue.Empty:
                continue
            try:
                if kind == "load":
                    self._start(item)
                elif kind == "release":
                    self._release(item["side_channels"], [item["request_id"]])
                else:
                    self._release(item["side_channels"], item["requests"])
            except Exception:  # never lose the thread
                logger.exception("kvx: decode background step failed")

    def _start(self, load: _Load) -> None:
        remote = load.remote
        with self._lock:
            aborted = load.aborted
            if aborted:
                load.error = "aborted before its transfer started"
        if aborted:
            # The prefill holds the blocks until told (or until its lease ends).
            self._release(remote["side_channels"], [remote["request_id"]])
            return
        try:
            self._ensure_session(remote)
            pending = self._expect(load)
        except Exception as e:  # any failure fails the load, never leaves it waiting
            with self._lock:
                load.error = f"{type(e).__name__}: {e}"
            # The prefill may hold the blocks still: tell it (best effort).
            self._release(remote["side_channels"], [remote["request_id"]])
            return
        with self._lock:
            load.pending = pending
            abort = load.aborted
        if abort:
            try:
                self.engine.abort(load.rid)
            except kvx.KvxError:
                pass

    def sources(self, prefill_tp: int) -> list:
        """The prefill TP ranks that write into this rank: those holding its heads (one source
        per head where prefill replicates them)."""
        return kvx.tp_sources(prefill_tp, self.tp_size, self.pool.model_kv_heads, self.tp_rank)

    def _forget_gone(self, now: float) -> None:
        """Removes each prefill instance whose ranks were not all connected for `GONE_AFTER_S`
        and that no load in progress is from (the background thread, which alone adds them)."""
        with self._lock:
            busy = {load.remote["engine_id"] for load in self._loads.values()
                    if load.remote is not None}
        for instance, _ in self.engine.instances():
            try:
                self.engine.wait_for_ranks(0, instance=instance)
                self._away.pop(instance, None)
                continue
            except kvx.KvxError:
                pass
            since = self._away.setdefault(instance, now)
            if instance in busy or now - since < GONE_AFTER_S:
                continue
            del self._away[instance]
            if self.engine.remove_instance(instance):
                logger.warning("kvx: prefill instance %s removed: its ranks were disconnected "
                               "for %.0f s", instance, now - since)

    def _ensure_session(self, remote: dict) -> None:
        """The prefill instance's ranks that write into this rank are connected to this engine
        (announcing it to each if not)."""
        instance = remote["engine_id"]
        try:
            self.engine.wait_for_ranks(0, instance=instance)
            return
        except kvx.KvxError:
            pass
        prefill_tp = int(remote["tp_size"])
        self.engine.add_instance(instance, 1, tp_size=prefill_tp)
        compat = {**self.compat, **self.pool.facts(), "tp_size": self.tp_size,
                  "tp_rank": self.tp_rank}
        sources = self.sources(prefill_tp)
        for r in sources:
            host, _, port = remote["side_channels"][r].rpartition(":")
            sidechannel.call(host, int(port), self.secret, {
                "op": "hello", "decode": self.engine.address, "instance": self.engine_id,
                "compat": compat}, timeout=self.handshake_timeout)
        self.engine.wait_for_ranks(self.handshake_timeout, instance=instance)
        logger.info("kvx: decode engine (TP rank %d) serves prefill instance %s (TP %d, ranks "
                    "%s write into this one)", self.tp_rank, instance, prefill_tp, sources)

    def _release(self, side_channels: list, requests: list) -> None:
        """Tells the prefill ranks this rank would have taken `requests` from that it will not."""
        try:
            ranks = self.sources(len(side_channels))
        except kvx.KvxError as e:
            logger.info("kvx: could not tell prefill to release %s: %s", requests, e)
            return
        for r in ranks:
            try:
                host, _, port = side_channels[r].rpartition(":")
                sidechannel.call(host, int(port), self.secret, {"op": "release",
                                                                "requests": list(requests)},
                                 timeout=5.0)
            except (IndexError, ValueError, sidechannel.SideChannelError) as e:
                logger.info("kvx: could not tell prefill rank %d to release %s: %s", r,
                            requests, e)

    def close(self) -> None:
        self._closed.set()
        if self.engine is not None:
            try:
                self.engine.shutdown(5)
            except kvx.KvxError as e:
                logger.warning("kvx: decode engine shutdown: %s", e)
