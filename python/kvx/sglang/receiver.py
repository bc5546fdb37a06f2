"""``KvxKVReceiver``: one request on one decode rank.

``init(prefill_dp_rank)`` picks the prefill instance's DP group that holds the room (SGLang gives
it: the room modulo the instance's DP groups), a session of the rank's ``DecodeEngine`` (named by
the bootstrap address, and the group where there are several). ``send_metadata(kv_indices)`` is
``expect(room, pages * page_size, chunk, kv_indices)`` from that session; poll follows the
request's ``Pending``, and reports
``Success`` once the pages and the last PP rank's metadata row are in place. Aborts go through
kvx's abort path: the ranks stop and acknowledge, so ``is_abort_release_safe`` says true only
once no write can still land."""

from __future__ import annotations

import time
from typing import List, Optional

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll

import kvx

from . import settings


class KvxKVReceiver(BaseKVReceiver):
    """One request on one decode rank."""

    def __init__(self, mgr, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room) if bootstrap_room is not None else None
        self.engine = None
        self.session = bootstrap_addr  # the session of the room's prefill DP group (init)
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
        self.created = time.monotonic()

    def init(self, prefill_dp_rank: int = 0):
        try:
            self.engine = self.kv_mgr.decode_engine(self.bootstrap_addr, int(prefill_dp_rank))
            self.session = self.kv_mgr.session(self.bootstrap_addr, int(prefill_dp_rank))
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
            # Pages and tokens after decode's own prefix (its radix cache), which prefill is told.
            self.pending = self.engine.expect(self.bootstrap_room, len(pages) * self.kv_mgr.page_size,
                                              self.kv_mgr.chunk_tokens(), pages,
                                              settings.request_timeout(),
                                              prefix_tokens=int(decode_prefix_len or 0),
                                              instance=self.session)
            with self.kv_mgr._lock:
                self.kv_mgr._rooms[self.bootstrap_room] = self.engine
        except (kvx.KvxError, AttributeError) as e:
            self.failed = e
            self._give_up()

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
            return self._bootstrapping()
        if self.pending is None:
            try:
                self.engine.wait_for_ranks(0, instance=self.session)
            except kvx.Timeout:
                return self._bootstrapping()
            return KVPoll.WaitingForInput
        if not self.pending.done():
            return KVPoll.Transferring
        outcome = self.pending.wait(0)
        if outcome.complete:
            if self.kv_mgr.aux and self.aux_index is not None:
                # The last PP rank's metadata row (its first output token) must be in place too.
                last_rank = self.kv_mgr.aux_slot(self.session)
                data = self.engine.aux(self.bootstrap_room, last_rank)
                if data is None:
                    now = time.monotonic()
                    if self.aux_deadline is None:
                        self.aux_deadline = now + settings.AUX_WAIT_S
                    if now < self.aux_deadline:
                        return KVPoll.Transferring
                    self.failed = settings.failed("aux_missing", f"room {self.bootstrap_room}: no metadata row "
                                                         f"from rank slot {last_rank}")
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

    def _bootstrapping(self) -> KVPoll:
        if time.monotonic() - self.created > settings.bootstrap_timeout():
            self.failed = settings.failed(
                "timeout", f"room {self.bootstrap_room}: the prefill instance's ranks were not all "
                           "there within SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
            self._give_up()
            return KVPoll.Failed
        return KVPoll.Bootstrapping

    def _give_up(self) -> None:
        """Tells the room's prefill ranks that decode gave it up before asking them for it: the
        prefill's sender, waiting for the allocation, fails now instead of at SGLang's bootstrap
        timeout (300 s by default)."""
        if self.engine is None or self.bootstrap_room is None or self.abort_notified:
            return
        self.abort_notified = True
        try:
            self.engine.abandon(self.bootstrap_room, self.session)
        except kvx.KvxError:
            pass  # the session is gone (or the engine shut down): no rank to tell

    def failure_exception(self):
        raise self.failed or settings.failed("other", f"room {self.bootstrap_room}: failed")

    def abort(self):
        if self.failed is None and not self.succeeded:
            self.failed = settings.failed("aborted", f"room {self.bootstrap_room}: aborted on decode")
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        if self.pending is None:
            # Aborted before send_metadata (SGLang's prealloc queue, say): the ranks never heard
            # of the room, yet the prefill's sender waits for its allocation.
            self._give_up()
            return
        if not self.abort_notified and self.engine is not None and self.bootstrap_room is not None:
            self.abort_notified = True
            try:
                self.engine.abort(self.bootstrap_room)
            except kvx.KvxError:
                # Already over (failed or never expected): nothing can still be written for it.
                pass

    def is_abort_release_safe(self) -> bool:
        return self.kv_mgr.is_abort_release_safe(self.bootstrap_room, 0)

    def clear(self):
        # SGLang clears a receiver once its pages are released (after a failure, once
        # is_abort_release_safe said so): the manager forgets the room.
        with self.kv_mgr._lock:
            self.kv_mgr._rooms.pop(self.bootstrap_room, None)
