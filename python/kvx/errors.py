"""The exceptions kvx raises. Each carries ``cause``, a stable name of what went wrong."""


class KvxError(Exception):
    """Base of every kvx error. ``cause`` names the engine's typed cause."""

    cause: str = "other"


class ConfigError(KvxError, ValueError):
    """A bad argument, layout, page list or configuration (``cause``: config, plan, tracker, memory,
    sender_taken)."""


class TransportError(KvxError):
    """The UCX or NIXL backend failed (``cause``: transport, or write with ``request`` and ``chunk``)."""


class ControlError(KvxError, ConnectionError):
    """The control plane failed: a connection, a handshake, a peer that broke the protocol."""


class AuthError(ControlError):
    """A peer did not prove the shared secret, or refused our proof."""


class Timeout(KvxError, TimeoutError):
    """A bound passed before what was waited for happened."""


class ShutdownError(KvxError):
    """The engine is shut down."""


class PageHeld(KvxError):
    """A destination page is held by another request (``page``, ``by``)."""


class RequestFailed(KvxError):
    """The request had already failed on this rank (``request``, ``code``)."""


class UnknownRequest(KvxError):
    """Decode sent no page allocation for ``request`` in time."""


class ProtocolError(KvxError):
    """A peer broke the PP vote protocol."""


class TransferFailed(KvxError):
    """A request failed: ``reason`` is aborted, timeout, peer_failed, peer_lost, protocol_violation,
    rank_unavailable or closed_without_vote; ``rank`` and ``code`` say which PP rank and what it sent, where known."""

    request: int
    reason: str
    rank: "int | None" = None
    code: "str | None" = None
