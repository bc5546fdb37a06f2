"""kvx as a transfer backend of SGLang 0.5.23's prefill/decode disaggregation.

``kvx.sglang.install()`` (SGLang's plugin entry point ``sglang.srt.plugins``, so every SGLang
process that resolves a transfer backend runs it) adds ``kvx`` to SGLang at run time: a
``TransferBackend.KVX`` member, its classes in ``get_kv_class``, and the
``--disaggregation-transfer-backend`` choice, without changing SGLang's files. The classes
subclass SGLang's own bases, so Python refuses any abstract method left out.

- ``directory``: the prefill instance's bootstrap server, every ``/kvx/`` call proving the shared
  secret;
- ``manager``: one per scheduler rank, the engines (decode: one ``DecodeEngine`` per prefill
  instance, with a heartbeat; prefill: one ``PrefillEngine`` for every decode that announced
  itself, started with the first and each later one added to it);
- ``sender`` / ``receiver``: one request on a prefill / decode rank.

Settings (environment): ``KVX_SECRET`` / ``KVX_SECRET_FILE`` (the deployment's shared secret; a file
others may read, or an empty setting, is refused),
``KVX_BACKEND`` (``ucx``, default, or ``nixl``), ``KVX_CHUNK_TOKENS`` (decode's chunk size in tokens,
rounded to pages; default 1024), ``KVX_REQUEST_TIMEOUT`` (seconds; default SGLang's
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``), ``KVX_DEVICE`` (``cpu`` or ``cuda:N``; default
``cuda:<gpu_id>`` where torch sees CUDA, else ``cpu``). SGLang's own
``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``, ``..._HEARTBEAT_INTERVAL`` and
``..._HEARTBEAT_MAX_FAILURE`` apply as they do to SGLang's backends; engines listen on SGLang's
local address (``SGLANG_HOST_IP``, else the host's routable address).

A rank's KV buffers (one per layer, then per K and V, in SGLang's order) are registered one by one
(or as one region when they happen to be adjacent); writes never cross a buffer. The metadata rows
(``aux_index``: the first output token, logprobs...) travel on kvx's control connection
(``send_aux``) before the last chunk. A decode-side radix cache's prefix (``decode_prefix_len``) travels
with the page allocation. Limits: models with state beside their KV pages (Mamba, SWA, DSA...)
are refused at start, and so is DP attention. TP sizes may differ (heads sliced over the ranks),
and so may page sizes; a pipelined decode (``--pp-size`` equal to its prefill's) runs one engine
per stage, each taking its layers from the prefill PP rank of its stage.
"""

from __future__ import annotations

from .directory import KvxBootstrapServer
from .manager import KvxKVManager
from .receiver import KvxKVReceiver
from .sender import KvxKVSender

__all__ = [
    "KvxBootstrapServer",
    "KvxKVManager",
    "KvxKVReceiver",
    "KvxKVSender",
    "install",
]


def install() -> None:
    """Makes ``--disaggregation-transfer-backend kvx`` select these classes, in this process.
    Idempotent. Call it before SGLang parses its arguments (in every process that runs a
    scheduler, since SGLang's schedulers resolve the backend themselves)."""
    import os
    import sys

    from sglang.srt.disaggregation import utils

    # TokenizerWorker processes import the HTTP app without loading plugins (see http_app).
    os.environ.setdefault("SGLANG_HTTP_SERVER_APP_PATH", "kvx.sglang.http_app:app")

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
