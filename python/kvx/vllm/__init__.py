"""kvx as a KV connector of vLLM 0.32's prefill/decode disaggregation.

Load it in both instances::

    --kv-transfer-config '{"kv_connector": "KvxConnector", "kv_connector_module_path": "kvx.vllm",
                           "kv_role": "kv_producer",   # decode: "kv_consumer"
                           "kv_connector_extra_config": {"secret_file": "/etc/kvx/secret"}}'

It follows NixlConnector's request protocol, so vLLM's disaggregation proxies work unchanged:
prefill is called with ``kv_transfer_params={"do_remote_decode": True}`` and returns the params
decode needs; decode is called with them and loads the KV before it generates. The transfer is a
push: decode's worker tells the prefill worker where to write (its kvx control address, over an
authenticated side channel, see ``sidechannel``), prefill's ``kvx.PrefillEngine`` writes the
request's whole blocks, and decode's ``kvx.DecodeEngine.expect`` completes.

- ``connector``: ``KvxConnector`` (vLLM's class), split by role;
- ``scheduler``: the EngineCore side (which requests load, which blocks prefill holds);
- ``prefill`` / ``decode``: a worker's two sides;
- ``pool``: the KV cache tensors as a kvx layout; ``settings``: configuration.

Importing this package starts nothing and imports neither vLLM nor torch: vLLM imports it in
every process when it resolves the connector class, and ``KvxConnector`` is loaded on first
access."""

from __future__ import annotations

__all__ = ["KvxConnector"]


def __getattr__(name: str):
    if name == "KvxConnector":
        from .connector import KvxConnector

        return KvxConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
