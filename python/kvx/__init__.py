"""kvx: KV-cache transfer between prefill and decode servers, over UCX or NIXL.

A decode server runs one ``DecodeEngine`` over its KV pool; each prefill PP rank runs one
``PrefillEngine`` over its own layers' pool. Decode ``expect``s a request with the pages it
allocated; every rank sends its layers of each chunk (``post_chunk`` / ``send_chunk``); decode's
``Pending`` ends with the request's ``Outcome`` once every rank's bytes arrived. Engines authenticate
each other with a shared ``secret`` before anything else travels.
"""

from ._kvx import (
    DecodeEngine,
    IncomingRequest,
    Layout,
    MeshSocket,
    Outcome,
    Pending,
    PrefillEngine,
    tp_sources,
    tp_targets,
    version,
)
from .errors import (
    AuthError,
    ConfigError,
    ControlError,
    KvxError,
    PageHeld,
    ProtocolError,
    RequestFailed,
    ShutdownError,
    Timeout,
    TransferFailed,
    TransportError,
    UnknownRequest,
)

__version__ = version()

__all__ = [
    "AuthError",
    "ConfigError",
    "ControlError",
    "DecodeEngine",
    "IncomingRequest",
    "KvxError",
    "Layout",
    "MeshSocket",
    "Outcome",
    "PageHeld",
    "Pending",
    "PrefillEngine",
    "ProtocolError",
    "RequestFailed",
    "ShutdownError",
    "Timeout",
    "TransferFailed",
    "TransportError",
    "UnknownRequest",
    "tp_sources",
    "tp_targets",
    "version",
]
