"""The deployment's shared secret, as every kvx integration reads it (``kvx.sglang``,
``kvx.vllm``): a file named by the caller's own setting or ``KVX_SECRET_FILE``, else
``KVX_SECRET``, else none (with a warning: engines and side channels then accept any peer)."""

from __future__ import annotations

import logging
import os
from typing import Optional


def load(logger: logging.Logger, secret_file: Optional[str] = None,
         what: str = "KVX_SECRET_FILE") -> Optional[bytes]:
    """The secret, or None when nothing sets one. `secret_file` (named `what` in messages), when
    given, overrides ``KVX_SECRET_FILE``. A setting that is there but empty, or a file that is
    empty or that others may read or change, raises: each would turn authentication off, or hand
    the secret around, while looking configured."""
    path = secret_file
    if path is None:
        path = os.environ.get("KVX_SECRET_FILE")
        what = "KVX_SECRET_FILE"
    if path is not None:
        if not path:
            raise ValueError(f"kvx: {what} is set but empty")
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode & 0o777
            if mode & 0o077:
                raise PermissionError(
                    f"kvx: {what} {path} has mode {mode:o}: others may read or change the "
                    "secret; chmod 600 it")
            key = f.read().rstrip(b"\r\n")
        if not key:
            raise ValueError(f"kvx: {what} {path} is empty")
        return key
    s = os.environ.get("KVX_SECRET")
    if s is not None:
        if not s:
            raise ValueError("kvx: KVX_SECRET is set but empty")
        return s.encode()
    logger.warning("kvx: no secret (KVX_SECRET or KVX_SECRET_FILE): engines and side channels "
                   "accept any peer")
    return None
