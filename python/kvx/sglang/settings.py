"""What kvx.sglang reads of its environment and of SGLang's own settings."""

from __future__ import annotations

import logging
import os
from typing import Optional

import kvx
from kvx import _address, _secret

logger = logging.getLogger(__name__)

# How long a complete request waits for its metadata row, which travels on the control connection.
AUX_WAIT_S = 10.0


def secret() -> Optional[bytes]:
    """The deployment's shared secret (``KVX_SECRET_FILE`` or ``KVX_SECRET``), or None when neither is
    set; see ``kvx._secret.load``."""
    return _secret.load(logger)


def device(args) -> str:
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


def _sglang_env(name: str, default: float) -> float:
    """One of SGLang's own ``SGLANG_DISAGGREGATION_*`` settings, as SGLang reads it."""
    try:
        from sglang.srt.environ import envs

        return float(getattr(envs, name).get())
    except (ImportError, AttributeError, TypeError, ValueError):
        return float(os.environ.get(name, default))


def bootstrap_timeout() -> float:
    """SGLang's bound on a request waiting for its peer's bootstrap (prefill: decode's page
    allocation; decode: the prefill instance's ranks)."""
    return _sglang_env("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)


def request_timeout() -> float:
    """How long decode waits for a request's KV once its pages were sent (``KVX_REQUEST_TIMEOUT``,
    else SGLang's ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``)."""
    v = os.environ.get("KVX_REQUEST_TIMEOUT")
    return float(v) if v else _sglang_env("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300)


def heartbeat() -> "tuple[float, int]":
    """SGLang's heartbeat of prefill instances: (interval, misses before an instance is lost), with
    SGLang's own floors (2 s, 1 miss)."""
    return (max(_sglang_env("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5.0), 2.0),
            max(int(_sglang_env("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2)), 1))


def model_kv_heads(server_args, tp_size: int) -> "tuple[int, int]":
    """(KV heads per TP rank, KV heads of the model) by SGLang's own model config: what SGLang's
    decode leaves out of ``KVArgs`` (it fills them in only for its staging buffers)."""
    from sglang.srt.configs.model_config import ModelConfig

    config = ModelConfig.from_server_args(server_args)
    return config.get_num_kv_heads(tp_size), config.get_total_num_kv_heads()


def decode_stage_layers(server_args, pp_rank: int, pp_size: int) -> "tuple[int, int, int]":
    """(first layer, layers, the model's layers) of decode PP stage ``pp_rank`` of ``pp_size``,
    split by SGLang's own rule (``get_pp_indices``, which reads ``SGLANG_PP_LAYER_PARTITION``):
    SGLang's decode leaves its stage's first layer out of ``KVArgs``."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.utils import get_pp_indices

    total = int(ModelConfig.from_server_args(server_args).num_hidden_layers)
    start, end = get_pp_indices(total, pp_rank, pp_size)
    return int(start), int(end - start), total


def state_log_interval() -> Optional[float]:
    """``KVX_STATE_LOG_S``: every that many seconds each manager logs what it holds per room
    (``kvx: state {...}``); unset or 0, never."""
    v = os.environ.get("KVX_STATE_LOG_S")
    return float(v) if v and float(v) > 0 else None


def metrics_address(rank: int) -> Optional[str]:
    """``KVX_METRICS=HOST:PORT``: where the kvx engine of scheduler rank ``rank`` (its PP rank
    times the TP size plus its TP rank) serves Prometheus metrics: ``HOST:PORT+rank``, so a
    server's ranks on one host never share a port. Unset or empty: nowhere. A value that is not
    ``HOST:PORT``, or a port past 65535 for this rank, is a ``ConfigError``."""
    try:
        return _address.rank_address(os.environ.get("KVX_METRICS"), rank, "kvx: KVX_METRICS")
    except ValueError as e:
        raise kvx.ConfigError(str(e)) from None


def progress_fifo() -> Optional[int]:
    """``KVX_PROGRESS_FIFO``: a decode rank's engine runs its progress thread (the thread that sees
    prefill's notifications arrive) under ``SCHED_FIFO`` at this priority, 1 to 99 (see
    ``kvx.DecodeEngine``). Unset or empty: the default policy. Anything else is a ``ConfigError``."""
    try:
        return _address.realtime_priority(os.environ.get("KVX_PROGRESS_FIFO"), "kvx: KVX_PROGRESS_FIFO")
    except ValueError as e:
        raise kvx.ConfigError(str(e)) from None


def progress_spin_us() -> Optional[int]:
    """``KVX_PROGRESS_SPIN_US``: how long a decode rank's engine progress thread polls after its
    last event before it sleeps, in microseconds (see ``kvx.DecodeEngine``). Unset or empty: the
    backend's default. Anything but a whole number of microseconds up to a second is a
    ``ConfigError``."""
    try:
        return _address.spin_us(os.environ.get("KVX_PROGRESS_SPIN_US"), "kvx: KVX_PROGRESS_SPIN_US")
    except ValueError as e:
        raise kvx.ConfigError(str(e)) from None


def landing_bytes() -> Optional[int]:
    """``KVX_LANDING_BYTES``: the landing memory a decode rank's NIXL engine lends prefill ranks
    whose rows land strided in its pages (prefill TP above decode's; see ``kvx.DecodeEngine``).
    Unset or empty: the engine's default (256 MiB). Anything but a whole number of bytes up to
    2**40 is a ``ConfigError``."""
    try:
        return _address.byte_count(os.environ.get("KVX_LANDING_BYTES"), "kvx: KVX_LANDING_BYTES")
    except ValueError as e:
        raise kvx.ConfigError(str(e)) from None


def landing_slots() -> Optional[int]:
    """``KVX_LANDING_SLOTS``: how many chunks of one prefill rank's share of a request a decode
    rank's landing memory holds at once (see ``kvx.DecodeEngine``). Unset or empty: the engine's
    default (2). Anything but a whole number from 1 to 1024 is a ``ConfigError``."""
    try:
        return _address.slot_count(os.environ.get("KVX_LANDING_SLOTS"), "kvx: KVX_LANDING_SLOTS")
    except ValueError as e:
        raise kvx.ConfigError(str(e)) from None


def local_ip() -> str:
    """The address this host's engines listen on and publish: SGLang's own choice for its transfer
    backends (``SGLANG_HOST_IP`` / ``HOST_IP``, else the host's routable address), never a
    wildcard."""
    from sglang.srt.utils.network import get_local_ip_auto

    ip = get_local_ip_auto()
    if ip in ("0.0.0.0", "::", ""):
        raise kvx.ConfigError(f"kvx: the local address resolved to {ip!r}: set SGLANG_HOST_IP")
    return ip


def bootstrap_host(server_args) -> str:
    """Where a prefill rank reaches its instance's bootstrap directory, by SGLang's rule:
    ``dist_init_addr``'s host where it is set (several nodes), else ``--host`` (a wildcard listener is reached
    on loopback)."""
    dist = getattr(server_args, "dist_init_addr", None)
    if dist:
        from sglang.srt.utils.network import NetworkAddress

        return NetworkAddress.parse(dist).resolved().host
    host = getattr(server_args, "host", None) or "127.0.0.1"
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def failed(cause: str, message: str) -> "kvx.TransferFailed":
    e = kvx.TransferFailed(message)
    e.cause = e.reason = cause
    return e
