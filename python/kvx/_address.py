"""Addresses (and a priority) the server adapters derive from one setting."""

from __future__ import annotations

from typing import Optional


def rank_address(value: Optional[str], rank: int, setting: str) -> Optional[str]:
    """``HOST:PORT+rank`` of ``value`` (``HOST:PORT``), so that a server's ranks on one host never
    share a port; None where ``value`` is unset or empty. A value that is not ``HOST:PORT``, or
    leaves no port for ``rank``, is a ``ValueError`` naming ``setting``."""
    v = (value or "").strip()
    if not v:
        return None
    host, sep, port = v.rpartition(":")
    try:
        base = int(port)
    except ValueError:
        base = -1
    if not sep or not host or base < 0 or base + rank > 65535:
        raise ValueError(f"{setting}={v!r} is not HOST:PORT with room for rank {rank}")
    return f"{host}:{base + rank}"


def _whole(value: Optional[str], low: int, high: int, setting: str, what: str) -> Optional[int]:
    """The whole number ``value`` names, ``low`` to ``high``; None where it is unset or empty.
    Anything else is a ``ValueError`` naming ``setting`` and saying it is not ``what``."""
    v = (value or "").strip()
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        n = low - 1
    if not low <= n <= high:
        raise ValueError(f"{setting}={v!r} is not {what}")
    return n


def realtime_priority(value: Optional[str], setting: str) -> Optional[int]:
    """The ``SCHED_FIFO`` priority ``value`` names, 1 to 99; None where it is unset or empty.
    Anything else is a ``ValueError`` naming ``setting``."""
    return _whole(value, 1, 99, setting, "a realtime priority from 1 to 99")


def byte_count(value: Optional[str], setting: str) -> Optional[int]:
    """A number of bytes ``value`` names, 0 to 2**40; None where it is unset or empty. Anything else
    is a ``ValueError`` naming ``setting``."""
    return _whole(value, 0, 1 << 40, setting, "a whole number of bytes up to 2**40")


def slot_count(value: Optional[str], setting: str) -> Optional[int]:
    """A count of landing slots ``value`` names, 1 to 1024; None where it is unset or empty.
    Anything else is a ``ValueError`` naming ``setting``."""
    return _whole(value, 1, 1024, setting, "a whole number of slots from 1 to 1024")


def spin_us(value: Optional[str], setting: str) -> Optional[int]:
    """Microseconds of polling ``value`` names, 0 to 1,000,000; None where it is unset or empty.
    Anything else is a ``ValueError`` naming ``setting``."""
    return _whole(value, 0, 1_000_000, setting, "a whole number of microseconds up to 1000000")
