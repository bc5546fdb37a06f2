"""A Python NIXL agent that our Rust NixlTransport writes into (tests/nixl_python_interop.rs).

Usage: ``nixl_receiver.py CONFIG.json``. It registers a zeroed buffer, publishes
``[addr u64 LE][len u64 LE][agent metadata]`` in ``md_file`` (atomically), then polls its notifications
until the Rust agent ``sender`` has sent two: chunk 0 as our binary v1 record (docs/wire-format.md)
and chunk 1 as SGLang's text ``{room}_kv_1_1_{pp_rank}`` (or, with ``all_text``, both chunks as text,
as our PrefillEngine sends them in SGLang mode). It decodes them, checks every byte of the buffer
against ``expected_file`` (written by the Rust side) and exits 0; 1 on any mismatch or timeout.
"""

import json
import os
import struct
import sys
import time

import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config


# The binary v1 chunk notification: magic, version, flags, request_id, chunk_id, chunk_count,
# checksum, pp_rank, failure_code, reserved; all little-endian, 40 bytes.
RECORD = struct.Struct("<4sHHQIIQHHI")
MAGIC = b"\xc7KVN"
FLAG_LAST, FLAG_FAILURE, FLAG_HAS_CHECKSUM = 1, 2, 4


def log(msg: str) -> None:
    print(f"[nixl_receiver] {msg}", flush=True)


def expected_bytes(cfg: dict, length: int) -> np.ndarray:
    """What the buffer must hold: written by the Rust side with ``kvbench::verify``."""
    expected = np.fromfile(cfg["expected_file"], dtype=np.uint8)
    if expected.size != length:
        raise ValueError(f"{cfg['expected_file']} holds {expected.size} bytes, expected {length}")
    return expected


def main() -> int:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    length = cfg["len"]
    room = cfg["request"]
    rank = cfg["pp_rank"]
    deadline = time.monotonic() + cfg["timeout_s"]

    agent = nixl_agent(
        cfg["agent_name"], nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
    )
    buf = np.zeros(length, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, length, 0, "")], "DRAM")
    md = agent.get_agent_metadata()
    tmp = cfg["md_file"] + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<QQ", buf.ctypes.data, length) + md)
    os.replace(tmp, cfg["md_file"])

    got: list[bytes] = []
    while len(got) < 2:
        if time.monotonic() > deadline:
            log(f"timed out with notifications {got!r}")
            return 1
        for sender, msgs in agent.get_new_notifs().items():
            if sender != cfg["sender"]:
                log(f"notification from unexpected agent {sender!r}: {msgs!r}")
                return 1
            got.extend(msgs)
        time.sleep(0.001)
    if len(got) != 2:
        log(f"expected two notifications, got {got!r}")
        return 1

    if cfg.get("all_text"):
        # From our PrefillEngine in SGLang mode: both chunks as text, in any order.
        want = {f"{room}_kv_0_0_{rank}".encode(), f"{room}_kv_1_1_{rank}".encode()}
        if set(got) != want:
            log(f"text notifications {got!r}, expected {sorted(want)!r}")
            return 1
        expected = expected_bytes(cfg, length)
        bad = np.flatnonzero(buf != expected)
        if bad.size:
            log(f"{bad.size} bytes differ, first at offset {bad[0]}")
            return 1
        agent.deregister_memory(reg)
        log(f"text notifications {sorted(got)!r} received; {length} bytes match")
        return 0

    binary = [m for m in got if m[:4] == MAGIC]
    text = [m for m in got if m[:4] != MAGIC]
    if len(binary) != 1 or len(text) != 1:
        log(f"expected one binary and one text notification, got {got!r}")
        return 1
    rec = binary[0]
    if len(rec) != RECORD.size:
        log(f"binary record is {len(rec)} bytes, expected {RECORD.size}")
        return 1
    magic, version, flags, request, chunk, count, checksum, pp_rank, code, reserved = RECORD.unpack(rec)
    fields = (version, flags, request, chunk, count, checksum, pp_rank, code, reserved)
    if fields != (1, 0, room, 0, 0, 0, rank, 0, 0):
        log(f"binary record fields {fields!r}")
        return 1
    want = f"{room}_kv_1_1_{rank}".encode()
    if text[0] != want:
        log(f"text notification {text[0]!r}, expected {want!r}")
        return 1

    # NIXL delivers a transfer's notification after its writes, so the bytes are in place.
    expected = expected_bytes(cfg, length)
    bad = np.flatnonzero(buf != expected)
    if bad.size:
        log(f"{bad.size} bytes differ, first at offset {bad[0]}")
        return 1
    agent.deregister_memory(reg)
    log(f"binary {rec.hex()} and text {text[0]!r} received; {length} bytes match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
