"""``KvxKVSender``: one request on one prefill rank.

Its poll says ``WaitingForInput`` once decode's page allocation for its room arrived; ``send`` is
called once per prefill chunk with that chunk's pages, and the sender posts kvx chunks (decode's
chunk size) as soon as their pages are known, the last with the final send. SGLang polls only PP
rank 0 during bootstrap; every rank then asks ``pop_decode_prefix_len`` before ``init``, and a
higher rank whose allocation has not arrived waits for it there. Success means every PP rank voted
complete on kvx's vote board."""

from __future__ import annotations

import threading
import time
from typing import List, Optional

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVSender, KVPoll, KVTransferMetric

import kvx

from . import settings
from .manager import release_when_decided


class KvxKVSender(BaseKVSender):
    """One request on one prefill rank."""

    def __init__(self, mgr, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.num_pages: Optional[int] = None
        self.aux_index = None
        self.pages: List[int] = []
        self.posted: list = []
        self.next_chunk = 0
        # Our pages the posted chunks cover (for the transfer metric's bytes).
        self.posted_pages = 0
        self.decision = None
        self.failed: Optional[BaseException] = None
        self.created = time.monotonic()
        self.started: Optional[float] = None
        self.finished: Optional[float] = None
        self.bytes = 0
        self.engine = None
        self.request = None
        # send() runs on the scheduler's thread, flush() on the early-send gate's.
        self._lock = threading.Lock()
        # SGLang sets this (a CUDA event) before the early send of a cached prefix under overlap
        # scheduling: the previous forward may still be writing those pages.
        self._early_send_wait_event = None
        # Set while such an event has not fired: nothing is posted meanwhile.
        self._gate = None
        if not req_has_disagg_prefill_dp_rank:
            # Decode learns this room's DP group from the directory, where it does not follow
            # from the room.
            try:
                mgr.register_room(self.bootstrap_room)
            except OSError as e:
                self._fail(settings.failed("bootstrap", f"room {self.bootstrap_room}: cannot "
                                                        f"register its DP group: {e}"))

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
        with self._lock:
            if self.failed is not None:
                return
            if self.started is None:
                self.started = time.monotonic()
            self.pages.extend(int(p) for p in np.asarray(kv_indices).reshape(-1))
            event, self._early_send_wait_event = self._early_send_wait_event, None
            if event is not None and self._gate is None:
                self._gate = event
                threading.Thread(target=self._open_gate, args=(event,), daemon=True,
                                 name="kvx-early-send").start()
            if not self._bind():
                # SGLang sends only after finalize_bootstrap, whose pop_decode_prefix_len bound
                # the sender (or failed it).
                self._fail(settings.failed("other", f"room {self.bootstrap_room}: send before "
                                                    "decode's page allocation arrived"))
                return
            self._post_ready()

    def _open_gate(self, event) -> None:
        """Waits (off the scheduler's thread) until the forward that writes the early-sent pages
        is over, then posts what waited for it."""
        try:
            event.synchronize()
        except Exception as e:  # a failed device wait: the pages cannot be trusted
            with self._lock:
                self._fail(settings.failed("other", f"room {self.bootstrap_room}: waiting for "
                                                    f"the prefix's forward failed: {e}"))
            return
        with self._lock:
            self._gate = None
        self.flush()

    def flush(self) -> None:
        """Posts what `send` was given before the allocation arrived."""
        with self._lock:
            if self.failed is None and self._bind():
                self._post_ready()

    def _post_ready(self) -> None:
        """Posts every kvx chunk whose pages are all known, unless the pages wait for a forward
        (``_gate``). Holds `_lock`, is bound."""
        if self._gate is not None:
            return
        total = self.num_pages if self.num_pages is not None else len(self.pages)
        # kvx's chunks are decode's (its chunk size, in its pages, whose size may differ from
        # ours): chunk c moves at most the tokens up to (c + 1) * chunk_tokens, so it goes once our
        # pages holding them are known; the last one needs every page.
        ps = self.kv_mgr.page_size
        chunk_tokens = self.request.chunk_tokens
        chunks = self.request.chunks
        # Decode's pages may end past our last page (its last page is larger, or ends further):
        # the engine reads as many of our pages as decode's pages span, so the list is padded
        # with our last page; those bytes land in decode's last page after the prompt's end,
        # where decode writes its own tokens later.
        need = max(total, -(-int(self.request.prompt_tokens) // ps))
        pool = self.kv_mgr.pool
        known = self.pages if self.pages else [0]
        # The engine reads a chunk's pages at their places in the request's whole list; pages not
        # known yet are never read (a chunk goes only once its pages are all known).
        src = self.pages + [known[-1] if len(self.pages) >= total else known[0]] * \
            max(0, need - len(self.pages))
        try:
            while self.next_chunk < chunks:
                last = self.next_chunk + 1 == chunks
                end = total if last else min(-(-(self.next_chunk + 1) * chunk_tokens // ps), total)
                if len(self.pages) < end:
                    break
                if last and self.kv_mgr.aux and self.aux_index is not None:
                    # The metadata row goes first, on the control connection.
                    self.engine.send_aux(self.bootstrap_room, self.kv_mgr.aux_row(int(self.aux_index)))
                self.posted.append(self.engine.post_chunk(self.bootstrap_room, self.next_chunk,
                                                          src, last))
                self.bytes += (end - self.posted_pages) * pool.page_bytes * pool.num_layers * \
                    (2 if pool.split else 1)
                self.posted_pages = end
                self.next_chunk += 1
        except kvx.KvxError as e:
            self._fail(e)

    def poll(self) -> KVPoll:
        if self.failed is not None:
            return KVPoll.Failed
        if self.engine is None and not self._bind():
            given_up = self.kv_mgr.given_up(self.bootstrap_room)
            if given_up is not None:
                self._fail(given_up)
                return KVPoll.Failed
            if time.monotonic() - self.created > settings.bootstrap_timeout():
                self._fail(settings.failed("timeout", f"room {self.bootstrap_room}: decode's page "
                                                      "allocation did not arrive within "
                                                      "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"))
                return KVPoll.Failed
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

    def pop_decode_prefix_len(self) -> int:
        """The tokens decode already holds (its radix cache): SGLang sends from that token on, and
        ``init`` gets the pages after it. SGLang asks every PP rank right after rank 0's poll saw
        the allocation; a higher rank's may still be on its way, so it is waited for (it left
        decode with rank 0's): a rank that sent from token 0 would fill decode's pages with the
        wrong tokens."""
        if self.engine is None:
            got = self.kv_mgr.await_allocation(self.bootstrap_room, settings.bootstrap_timeout())
            if got is None:
                self._fail(self.kv_mgr.given_up(self.bootstrap_room) or settings.failed(
                    "timeout", f"room {self.bootstrap_room}: decode's page allocation did not "
                               "arrive within SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"))
                return 0
            with self._lock:
                self._bind()
        return int(self.request.prefix_tokens)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # The last send goes even when empty, as for SGLang's own senders: it may be the one
        # that completes the request.
        return num_pages > 0 or last_chunk

    def failure_exception(self):
        # SGLang calls only this on a failed request, never clear(): the room is cleared here.
        self.clear()
        raise self.failed or settings.failed("other", f"room {self.bootstrap_room}: failed")

    def abort(self):
        # SGLang drops an aborted request without polling it again (no failure_exception, no
        # clear): the room is failed and cleared here.
        with self._lock:
            self._bind()  # an allocation that came meanwhile
        room = self.bootstrap_room
        if self.engine is not None:
            try:
                self.engine.fail(room, "aborted")
            except kvx.KvxError:
                pass
        self._fail(settings.failed("aborted", f"room {room}: aborted on prefill"))
        # Unbound, it is failed in the engine too: decode hears, the pipeline decides it failed,
        # and an allocation the engine took before may still reach the manager, which drops it.
        self.clear()

    def clear(self):
        with self._lock:
            self._bind()  # an allocation that came meanwhile
        if self.engine is None:
            # SGLang is done with a room whose allocation never reached this rank (it failed
            # here, or on a peer rank SGLang's poll reduced over): decode is told, and an
            # allocation that still comes is dropped and released, not kept for a sender gone.
            self._give_up()
            return
        self.kv_mgr.forget(self.bootstrap_room)
        release_when_decided(self.engine, self.bootstrap_room, self.decision)

    def _give_up(self) -> None:
        """Fails this unbound room in the rank's engine, so decode hears and the pipeline decides
        it (a later allocation is refused), and has the manager drop one that still arrives."""
        room = self.bootstrap_room
        engine = self.kv_mgr.prefill_engine()
        if engine is None:
            self.kv_mgr.forget(room)
            return
        try:
            engine.fail(room, "aborted")
        except kvx.KvxError:
            pass
        self.kv_mgr.forget_aborted(room, engine)

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None
        if self.started is not None and self.finished is not None:
            latency = self.finished - self.started
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=self.bytes)
