"""The scheduler side of ``KvxConnector`` (vLLM's EngineCore process): which requests load their
KV from a prefill instance (decode), which finished requests hold their blocks for a decode
(prefill), and what each step's metadata tells the workers.

The request protocol is NixlConnector's, so vLLM's disaggregation proxies drive kvx unchanged:

- prefill is called with ``kv_transfer_params={"do_remote_decode": True}`` (and ``max_tokens=1``);
  when the request finishes, its blocks are held (``request_finished`` returns True) and the
  params for decode are returned: ``do_remote_prefill``, ``remote_engine_id``,
  ``remote_request_id``, ``remote_host``/``remote_port`` (the side channel of TP rank 0),
  ``kvx_side_channels`` (one per TP rank), ``tp_size``, ``remote_block_ids`` (informational),
  ``remote_num_tokens`` and ``transfer_mode="kvx_push"``;
- decode is called with those params: it loads ``len(prompt) - local prefix hit`` tokens
  asynchronously into the blocks vLLM allocated, which its workers tell prefill to write (push).

Prefill frees a request's blocks when its workers report it in ``finished_sending``: after kvx
decided it (every write over, or failed), or after ``kv_lease_duration`` with no decode asking
for it, or when decode said it gave the request up."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

import kvx

from . import settings

logger = logging.getLogger("vllm." + __name__)  # vLLM's handlers and level

TRANSFER_MODE = "kvx_push"
_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "kvx_side_channels")


@dataclass
class KvxMetadata(KVConnectorMetadata):
    """One step's news for the workers; plain data (vLLM serializes it to the workers)."""

    # prefill: request id -> {"blocks", "tokens", "lease_s", "tag"}: finished requests now held.
    send: dict = field(default_factory=dict)
    # decode: request id -> {"dst", "prefix_tokens", "remote", "refused"}: loads to start.
    recv: dict = field(default_factory=dict)
    # decode: [{"side_channels", "requests"}]: held prefill requests this decode gave up.
    release: list = field(default_factory=list)


# What a client's kv_transfer_params that do not parse raise here (a number that is infinite, as
# JSON's 1e400 reads, raises OverflowError in int()): a refusal, never an exception in vLLM's
# scheduler, which would end the engine.
UNPARSABLE = (TypeError, ValueError, OverflowError, AttributeError, KeyError)


def remote_of(params: dict) -> dict:
    """What a decode worker needs of a prefill request's params."""
    return {"engine_id": str(params["remote_engine_id"]),
            "request_id": str(params["remote_request_id"]),
            "side_channels": [str(a) for a in params["kvx_side_channels"]],
            "tp_size": int(params.get("tp_size", 1) or 1)}


class KvxScheduler:
    def __init__(self, vllm_config, engine_id: str, extra: dict):
        self.engine_id = engine_id
        self.block_size = int(vllm_config.cache_config.block_size)
        pc = vllm_config.parallel_config
        self.tp_size = int(pc.tensor_parallel_size)
        self.pp_size = int(pc.pipeline_parallel_size)
        self.model_kv_heads = int(vllm_config.model_config.get_total_num_kv_heads())
        self.lease_s = settings.lease_s(extra)
        base = settings.side_channel_port(extra)
        host = settings.host(extra)
        dp = int(getattr(pc, "data_parallel_index", 0) or 0)
        # With a fixed base port the addresses are known now; with port 0 the workers publish
        # theirs through vLLM's handshake metadata (set_xfer_handshake_metadata).
        self.side_channels: Optional[list] = (
            [f"{host}:{base + dp * self.tp_size + r}" for r in range(self.tp_size)] if base else None)
        self._send: dict = {}
        self._recv: dict = {}
        self._release: list = []
        self._held: dict = {}  # request id -> time it was held (monotonic)
        # request id -> why its KV cannot be loaded, from get_num_new_matched_tokens until its
        # allocation (or its end, if it never gets one).
        self._refused: dict = {}
        self._test_hooks = bool(os.environ.get("KVX_TEST_CORRUPT_TAG")
                                or os.environ.get("KVX_TEST_STALL_TAG")
                                or os.environ.get("KVX_TEST_LATE_TAG"))

    # Handshake metadata from the workers (after they registered their KV caches).

    def set_side_channels(self, by_rank: "dict[int, Any]") -> None:
        addrs = [getattr(by_rank[r], "address", None) for r in sorted(by_rank)]
        if len(addrs) == self.tp_size and all(addrs):
            self.side_channels = addrs

    # Decode.

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                # Tokens that cannot be loaded are not counted (vLLM's contract): vLLM computes
                # the request here, whatever kv_load_failure_policy says of loads that fail.
                refused = self._refusal(params) or self._prefix_refusal(params,
                                                                        num_computed_tokens)
                if refused:
                    self._refused[request.request_id] = refused
                    return 0, False
                self._refused.pop(request.request_id, None)
                return count, True
            self._refused.pop(request.request_id, None)
        return 0, False

    def _refusal(self, params: dict) -> Optional[str]:
        """Why this decode cannot load a request with these params, or None. The params are a
        client's: any that do not parse are a refusal (the request's load fails and vLLM
        recomputes it), never an exception in vLLM's scheduler, which would end the engine."""
        try:
            return self._refusal_of(params)
        except UNPARSABLE as e:
            return f"kv_transfer_params that do not parse: {type(e).__name__}: {e}"

    def _refusal_of(self, params: dict) -> Optional[str]:
        if params.get("transfer_mode") != TRANSFER_MODE:
            return (f"the prefill instance's transfer_mode is {params.get('transfer_mode')!r}, "
                    f"not {TRANSFER_MODE!r}: it does not run KvxConnector")
        missing = [k for k in _REMOTE_KEYS if not params.get(k)]
        if missing:
            return f"kv_transfer_params lack {', '.join(missing)}"
        tp = int(params.get("tp_size", 1) or 1)
        if len(params["kvx_side_channels"]) != tp:
            return f"prefill TP size {tp} with {len(params['kvx_side_channels'])} side channels"
        try:
            # Each prefill rank hands its blocks back once it sent them: a rank that writes into
            # no decode rank (heads replicated over more prefill ranks than decode takes from)
            # would hold them until its lease ends.
            used = {s for r in range(self.tp_size)
                    for s in kvx.tp_sources(tp, self.tp_size, self.model_kv_heads, r)}
        except kvx.KvxError as e:
            return f"prefill TP size {tp}, decode TP size {self.tp_size}: {e}"
        if len(used) != tp:
            return (f"prefill TP size {tp}, decode TP size {self.tp_size}, {self.model_kv_heads} "
                    f"KV heads: prefill ranks {sorted(set(range(tp)) - used)} would write into "
                    "no decode rank; kvx.vllm does not map that yet")
        if int(params.get("pp_size", 1) or 1) != 1:
            return "a prefill instance with PP > 1: not supported by kvx.vllm yet"
        return None

    def _prefix_refusal(self, params: dict, prefix: int) -> Optional[str]:
        """Why a load after a local prefix hit of `prefix` tokens cannot be served, or None: the
        moved tokens must start a block on both sides."""
        try:
            theirs = int(params.get("kvx_block_size", 0) or 0) or self.block_size
        except UNPARSABLE as e:
            return f"kvx_block_size that does not parse: {type(e).__name__}: {e}"
        if theirs <= 0:
            return f"a prefill block size of {theirs} tokens"
        if prefix % theirs:
            return (f"a local prefix hit of {prefix} tokens is not whole blocks of the prefill's "
                    f"{theirs} tokens: kvx.vllm does not map that yet")
        return None

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        refused = self._refusal(params)
        if num_external_tokens > 0:
            dst = [int(b) for b in blocks.get_unhashed_block_ids()]
            prefix = len(request.prompt_token_ids or ()) - num_external_tokens
            refused = refused or self._prefix_refusal(params, prefix)
            try:
                remote = remote_of(params)
            except UNPARSABLE:
                remote = None  # refused: nothing to tell a prefill
            self._recv[request.request_id] = {"dst": dst, "prefix_tokens": prefix,
                                              "tokens": int(num_external_tokens),
                                              "refused": refused, "remote": remote}
            if refused:
                logger.error("kvx: request %s: %s; its blocks are reported as load errors",
                             request.request_id, refused)
        else:
            refused = self._refused.pop(request.request_id, None) or refused
            if refused:
                logger.error("kvx: request %s: %s; computed here", request.request_id, refused)
            # Nothing to load (a full local prefix hit, or params this decode refuses): a kvx
            # prefill may drop its blocks now.
            if params.get("transfer_mode") == TRANSFER_MODE:
                self._queue_release(params)
        params["do_remote_prefill"] = False

    def _queue_release(self, params: dict) -> None:
        try:
            remote = remote_of(params)
        except UNPARSABLE:
            return
        self._release.append({"side_channels": remote["side_channels"],
                              "requests": [remote["request_id"]]})

    # Prefill.

    def request_finished(self, request, block_ids: "list[int]"):
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        self._refused.pop(request.request_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Decode never allocated for it (aborted before, or refused): a kvx prefill may drop
            # the blocks now.
            if params.get("transfer_mode") == TRANSFER_MODE:
                self._queue_release(params)
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED) or not block_ids:
            return False, None
        if not self.side_channels:
            logger.error("kvx: request %s: no side channel address from the workers: its blocks "
                         "are not held for a decode", request.request_id)
            return False, None
        tag = params.get("kvx_test_tag") if self._test_hooks else None
        self._send[request.request_id] = {"blocks": [int(b) for b in block_ids],
                                          "tokens": int(request.num_computed_tokens),
                                          "lease_s": self.lease_s, "tag": tag}
        self._held[request.request_id] = time.monotonic()
        host, _, port = self.side_channels[0].rpartition(":")
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
            "remote_host": host, "remote_port": int(port),
            "kvx_side_channels": list(self.side_channels),
            "remote_block_ids": [int(b) for b in block_ids],
            "remote_num_tokens": int(request.num_computed_tokens),
            "tp_size": self.tp_size, "pp_size": self.pp_size,
            "kvx_block_size": self.block_size, "transfer_mode": TRANSFER_MODE}

    def update_connector_output(self, output) -> None:
        for req_id in output.finished_sending or ():
            self._held.pop(req_id, None)

    def has_pending_push_work(self) -> bool:
        return bool(self._held)

    def build_connector_meta(self, scheduler_output) -> KvxMetadata:
        meta = KvxMetadata(send=self._send, recv=self._recv, release=self._release)
        self._send, self._recv, self._release = {}, {}, []
        return meta
