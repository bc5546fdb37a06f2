"""What kvx.vllm reads of ``kv_connector_extra_config`` and the environment.

Keys of ``kv_connector_extra_config`` (each also an environment variable, which the config key
overrides):

- ``secret_file`` / ``KVX_SECRET_FILE``, else ``KVX_SECRET``: the deployment's shared secret (a
  file others may read, or an empty setting, is refused);
- ``backend`` / ``KVX_BACKEND``: ``ucx`` (default) or ``nixl``;
- ``side_channel_host`` / ``KVX_SIDE_CHANNEL_HOST``: where a prefill worker's side channel listens
  and decode's engine listens (default ``VLLM_HOST_IP``, else 127.0.0.1);
- ``side_channel_port`` / ``KVX_SIDE_CHANNEL_PORT``: the prefill side channel's base port (TP rank
  r listens on base + dp_index * tp_size + r); 0 (default): any free port, published through
  vLLM's handshake metadata;
- ``kv_lease_duration`` / ``KVX_LEASE_S``: how long prefill holds a finished request's blocks for
  a decode that has not asked for them (default 120 s);
- ``request_timeout`` / ``KVX_REQUEST_TIMEOUT``: how long decode waits for a request's KV once it
  sent its pages (default 60 s);
- ``handshake_timeout`` / ``KVX_HANDSHAKE_TIMEOUT``: how long decode waits for a prefill
  instance's ranks to connect (default 30 s);
- ``metrics`` / ``KVX_METRICS``: ``HOST:PORT``; each worker's kvx engine serves its Prometheus
  metrics on ``HOST:PORT + dp_index * tp_size + tp_rank`` (default: nowhere);
- ``progress_fifo`` / ``KVX_PROGRESS_FIFO``: decode workers run their engine's progress thread
  under ``SCHED_FIFO`` at this priority, 1 to 99 (default: the normal policy; see
  ``kvx.DecodeEngine``);
- ``progress_spin_us`` / ``KVX_PROGRESS_SPIN_US``: how long that thread polls after its last event
  before it sleeps, in microseconds (default: a decode engine's, 10 with UCX, 200 with NIXL);
- ``landing_bytes`` / ``KVX_LANDING_BYTES``: the landing memory a decode worker's NIXL engine lends
  prefill ranks whose rows land strided in its blocks (prefill TP above decode's), in bytes
  (default: the engine's, 256 MiB; 0: none);
- ``landing_slots`` / ``KVX_LANDING_SLOTS``: how many chunks of one prefill rank's share of a
  request that landing memory holds at once, 1 to 1024 (default: the engine's, 2)."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from kvx import _address, _secret

logger = logging.getLogger("vllm." + __name__)  # vLLM's handlers and level


def _get(extra: dict, key: str, env: str, default: Any) -> Any:
    if key in extra and extra[key] is not None:
        return extra[key]
    v = os.environ.get(env)
    return v if v not in (None, "") else default


def secret(extra: dict) -> Optional[bytes]:
    """The shared secret: the file ``secret_file`` names, else as ``kvx._secret.load`` reads the
    environment; None (with a warning) when nothing sets one."""
    path = extra.get("secret_file")
    return _secret.load(logger, None if path is None else str(path),
                        "kv_connector_extra_config['secret_file']")


def backend(extra: dict) -> str:
    return str(_get(extra, "backend", "KVX_BACKEND", "ucx"))


def host(extra: dict) -> str:
    h = _get(extra, "side_channel_host", "KVX_SIDE_CHANNEL_HOST", None)
    if h is None:
        h = os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
    return str(h)


def side_channel_port(extra: dict) -> int:
    return int(_get(extra, "side_channel_port", "KVX_SIDE_CHANNEL_PORT", 0))


def lease_s(extra: dict) -> float:
    return float(_get(extra, "kv_lease_duration", "KVX_LEASE_S", 120.0))


def request_timeout(extra: dict) -> float:
    return float(_get(extra, "request_timeout", "KVX_REQUEST_TIMEOUT", 60.0))


def handshake_timeout(extra: dict) -> float:
    return float(_get(extra, "handshake_timeout", "KVX_HANDSHAKE_TIMEOUT", 30.0))


def metrics(extra: dict, rank: int) -> Optional[str]:
    """Where the worker of rank ``rank`` (its DP index times the TP size plus its TP rank) serves
    its engine's metrics: ``HOST:PORT+rank`` of ``metrics`` / ``KVX_METRICS``, or None. A value
    that is not ``HOST:PORT``, or leaves no port for the rank, is a ``ValueError``."""
    v = _get(extra, "metrics", "KVX_METRICS", None)
    return _address.rank_address(None if v is None else str(v), rank, "kvx.vllm: metrics")


def progress_fifo(extra: dict) -> Optional[int]:
    """The realtime priority of a decode worker's progress thread (``progress_fifo`` /
    ``KVX_PROGRESS_FIFO``), or None for the normal policy. Anything but an integer from 1 to 99 is
    a ``ValueError``."""
    v = _get(extra, "progress_fifo", "KVX_PROGRESS_FIFO", None)
    return _address.realtime_priority(None if v is None else str(v), "kvx.vllm: progress_fifo")


def progress_spin_us(extra: dict) -> Optional[int]:
    """How long a decode worker's progress thread polls before sleeping (``progress_spin_us`` /
    ``KVX_PROGRESS_SPIN_US``), or None for a decode engine's default. Anything but a whole number of
    microseconds up to a second is a ``ValueError``."""
    v = _get(extra, "progress_spin_us", "KVX_PROGRESS_SPIN_US", None)
    return _address.spin_us(None if v is None else str(v), "kvx.vllm: progress_spin_us")


def landing_bytes(extra: dict) -> Optional[int]:
    """Landing memory of a decode worker's NIXL engine (``landing_bytes`` / ``KVX_LANDING_BYTES``),
    or None for the engine's default. Anything but a whole number of bytes up to 2**40 is a
    ``ValueError``."""
    v = _get(extra, "landing_bytes", "KVX_LANDING_BYTES", None)
    return _address.byte_count(None if v is None else str(v), "kvx.vllm: landing_bytes")


def landing_slots(extra: dict) -> Optional[int]:
    """Chunks per prefill rank and request that a decode worker's landing memory holds at once
    (``landing_slots`` / ``KVX_LANDING_SLOTS``), or None for the engine's default. Anything but a
    whole number from 1 to 1024 is a ``ValueError``."""
    v = _get(extra, "landing_slots", "KVX_LANDING_SLOTS", None)
    return _address.slot_count(None if v is None else str(v), "kvx.vllm: landing_slots")


def corrupt_request() -> Optional[str]:
    """Test only: ``KVX_TEST_CORRUPT_REQUEST``, a prefix of the vLLM request ids whose first
    moved block the prefill side corrupts before writing it (see the worker)."""
    return os.environ.get("KVX_TEST_CORRUPT_REQUEST") or None
