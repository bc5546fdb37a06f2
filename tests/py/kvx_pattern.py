"""The byte pattern the Rust tests check against (``kvbench::cluster::pattern``), in numpy.

``pattern(rank, offset)`` names every byte of a rank's source pool: with ``x = offset * 0x9E3779B97F4A7C15
^ (rank << 56) ^ (offset >> 13)`` (wrapping 64-bit arithmetic), the byte is ``(x >> 32) ^ x`` truncated to
8 bits.
"""

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def pattern(rank: int, length: int, start: int = 0) -> np.ndarray:
    """Bytes ``start .. start + length`` of rank ``rank``'s pattern, as a uint8 array."""
    i = np.arange(start, start + length, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (i * _GOLDEN) ^ (np.uint64(rank) << np.uint64(56)) ^ (i >> np.uint64(13))
    return ((x >> np.uint64(32)) ^ x).astype(np.uint8)
