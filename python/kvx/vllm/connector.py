"""``KvxConnector``: vLLM's KV connector API (``KVConnectorBase_V1``) on kvx's engines.

vLLM builds one instance per process role: the scheduler's (``KvxScheduler``, in the EngineCore
process) and one per worker (``KvxWorker``, next to the KV cache). They share nothing but the
step metadata (scheduler to workers) and the connector output (workers to scheduler)."""

from __future__ import annotations

import logging
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
)

from . import settings
from .scheduler import KvxMetadata, KvxScheduler

logger = logging.getLogger("vllm." + __name__)  # vLLM's handlers and level


class KvxHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler once its KV cache is registered: where its side channel
    listens (published in the params prefill returns)."""

    def __init__(self, address: str):
        self.address = address


def _compat(vllm_config) -> dict:
    """Facts both sides of a transfer must share, beyond the pool's own (``Pool.facts``): a
    block is opaque bytes whose arrangement depends on all of them."""
    import vllm

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    facts = {"vllm": vllm.__version__, "model": str(mc.model), "dtype": str(mc.dtype),
             "cache_dtype": str(cc.cache_dtype)}
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            facts["cpu_attn_isa"] = _get_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(),
                                                  cc.cache_dtype)
    except Exception as e:  # a vLLM that moved it: the other facts still guard
        logger.debug("kvx: CPU attention ISA unknown: %s", e)
    return facts


def _key_column_bytes(vllm_config, compat: dict) -> int:
    """The bytes of a K element where this worker's CPU attention keeps K by columns inside a
    head's part of a block (then blocks of other sizes map); 0 where it does not or is unknown."""
    isa = compat.get("cpu_attn_isa")
    if isa is None:
        return 0
    from .pool import key_columns

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    try:
        return key_columns(isa, mc.dtype, str(cc.cache_dtype), int(cc.block_size),
                           int(mc.get_head_size()))
    except Exception as e:  # a kernel that moved or refuses the probe: whole blocks only
        logger.info("kvx: could not probe the arrangement of a block (%s): blocks of other "
                    "sizes will not map", e)
        return 0


class KvxWorker:
    """A worker's connector: a prefill side (kv_producer), a decode side (kv_consumer), or both."""

    def __init__(self, vllm_config, kv_cache_config, engine_id: str, extra: dict):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        from .decode import DecodeSide
        from .prefill import PrefillSide

        ktc = vllm_config.kv_transfer_config
        pc = vllm_config.parallel_config
        self.kv_cache_config = kv_cache_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.model_kv_heads = int(vllm_config.model_config.get_total_num_kv_heads())
        tp_size = int(pc.tensor_parallel_size)
        tp_rank = int(get_tensor_model_parallel_rank())
        if int(pc.pipeline_parallel_size) != 1:
            raise ValueError("kvx.vllm: pipeline parallelism (--pipeline-parallel-size > 1) is "
                             "not supported yet")
        secret = settings.secret(extra)
        backend = settings.backend(extra)
        host = settings.host(extra)
        compat = _compat(vllm_config)
        self.key_column_bytes = _key_column_bytes(vllm_config, compat)
        dp = int(getattr(pc, "data_parallel_index", 0) or 0)
        metrics = settings.metrics(extra, dp * tp_size + tp_rank)
        self.prefill: Optional[PrefillSide] = None
        self.decode: Optional[DecodeSide] = None
        if ktc.is_kv_producer:
            base = settings.side_channel_port(extra)
            port = base + dp * tp_size + tp_rank if base else 0
            self.prefill = PrefillSide(engine_id=engine_id, tp_rank=tp_rank, tp_size=tp_size,
                                       host=host, port=port, secret=secret, backend=backend,
                                       compat=compat, metrics=metrics)
        if ktc.is_kv_consumer:
            self.decode = DecodeSide(engine_id=engine_id, tp_rank=tp_rank, tp_size=tp_size,
                                     host=host, secret=secret, backend=backend, compat=compat,
                                     request_timeout=settings.request_timeout(extra),
                                     handshake_timeout=settings.handshake_timeout(extra),
                                     metrics=metrics,
                                     progress_fifo=settings.progress_fifo(extra),
                                     progress_spin_us=settings.progress_spin_us(extra),
                                     landing_bytes=settings.landing_bytes(extra),
                                     landing_slots=settings.landing_slots(extra))

    def register_kv_caches(self, kv_caches: "dict[str, Any]") -> None:
        from .pool import Pool

        if len(self.kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("kvx.vllm: models with several KV cache groups (sliding window, "
                             "hybrid) are not supported yet")
        pool = Pool(kv_caches, self.block_size, self.kv_cache_config.num_blocks,
                    self.model_kv_heads, self.key_column_bytes)
        if self.prefill is not None:
            self.prefill.register(pool)
        if self.decode is not None:
            self.decode.register(pool)

    def handshake(self) -> Optional[KvxHandshake]:
        return KvxHandshake(self.prefill.address) if self.prefill is not None else None

    def start_load_kv(self, meta: Optional[KvxMetadata]) -> None:
        if meta is None:
            return
        if self.prefill is not None:
            self.prefill.start_load_kv(meta)
        if self.decode is not None:
            self.decode.start_load_kv(meta)

    def get_finished(self, finished_req_ids: "set[str]"):
        sending = self.prefill.get_finished() if self.prefill is not None else set()
        recving = self.decode.get_finished(finished_req_ids) if self.decode is not None else set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> "set[int]":
        return self.decode.get_block_ids_with_load_errors() if self.decode is not None else set()

    def shutdown(self) -> None:
        for side in (self.prefill, self.decode):
            if side is not None:
                side.close()


class KvxConnector(KVConnectorBase_V1):
    """vLLM KV connector over kvx (push: decode tells prefill where to write; see the package
    doc). Load it with ``kv_connector="KvxConnector"``, ``kv_connector_module_path="kvx.vllm"``."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        engine_id = str(self._kv_transfer_config.engine_id)
        self._scheduler: Optional[KvxScheduler] = None
        self._worker: Optional[KvxWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KvxScheduler(vllm_config, engine_id, extra)
        else:
            self._worker = KvxWorker(vllm_config, kv_cache_config, engine_id, extra)

    # Worker side.

    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        return self._worker.handshake() if self._worker is not None else None

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._connector_metadata
        self._worker.start_load_kv(meta if isinstance(meta, KvxMetadata) else None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads complete between steps (asynchronously), never inside a forward

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        pass  # prefill sends a finished request's blocks when decode asks, not layer by layer

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids):
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self):
        return self._worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # Scheduler side.

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KvxMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def set_xfer_handshake_metadata(self, metadata) -> None:
        if self._scheduler is not None:
            self._scheduler.set_side_channels(metadata)
