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


def realtime_priority(value: Optional[str], setting: str) -> Optional[int]:
    """The ``SCHED_FIFO`` priority ``value`` names, 1 to 99; None where it is unset or empty.
    Anything else is a ``ValueError`` naming ``setting``."""
    v = (value or "").strip()
    if not v:
        return None
    try:
        p = int(v)
    except ValueError:
        p = 0
    if not 1 <= p <= 99:
        raise ValueError(f"{setting}={v!r} is not a realtime priority from 1 to 99")
    return p


def byte_count(value: Optional[str], setting: str) -> Optional[int]:
    """A number of bytes ``value`` names, 0 to 2**40; None where it is unset or empty. Anything else
    is a ``ValueError`` naming ``setting``."""
    v = (value or "").strip()
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        n = -1
    if not 0 <= n <= 1 << 40:
        raise ValueError(f"{setting}={v!r} is not a whole number of bytes up to 2**40")
    return n


def slot_count(value: Optional[str], setting: str) -> Optional[int]:
    """A count of landing slots ``value`` names, 1 to 1024; None where it is unset or empty.
    Anything else is a ``ValueError`` naming ``setting``."""
    v = (value or "").strip()
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        n = 0
    if not 1 <= n <= 1024:
        raise ValueError(f"{setting}={v!r} is not a whole number of slots from 1 to 1024")
    return n


def spin_us(value: Optional[str], setting: str) -> Optional[int]:
    """Microseconds of polling ``value`` names, 0 to 1,000,000; None where it is unset or empty.
    Anything else is a ``ValueError`` naming ``setting``."""
    v = (value or "").strip()
    if not v:
        return None
    try:
        us = int(v)
    except ValueError:
        us = -1
    if not 0 <= us <= 1_000_000:
        raise ValueError(f"{setting}={v!r} is not a whole number of microseconds up to 1000000")
    return us
