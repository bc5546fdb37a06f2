"""One SGLang-style prefill PP rank, written with NIXL's own Python API only.

Driven by tests/nixl_python_interop.rs: it writes this rank's KV pages into the Rust DecodeEngine's pool
and attaches SGLang's text notification ``{room}_kv_{chunk_id}_{is_last}_{pp_rank}`` to each chunk's
transfer, as SGLang's NIXL connector does after its PP fix.

Usage: ``sglang_prefill.py CONFIG.json``. The config (written by the Rust test) carries the decode
agent's metadata file, its pool address, both layouts, this rank's layer range, the request's page
lists and, for each chunk, the positions of the pages it sends (computed by the Rust planner, so this
script needs no chunking logic). The source pool is packed ``[region][local layer][page]`` and loaded
from ``src_file``, which the Rust side wrote with the request's pattern (``kvbench::verify``); the
destination pool is packed ``[region][layer][page]`` over all layers.

Exit status: 0 done; 1 a NIXL transfer failed or timed out; 2 bad setup; 3 the Rust side never said
it was done with us (linger file) within the timeout.
"""

import json
import os
import sys
import time

import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config


def log(msg: str) -> None:
    print(f"[sglang_prefill] {msg}", flush=True)


def main() -> int:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    rank = cfg["pp_rank"]
    room = cfg["request"]
    deadline = time.monotonic() + cfg["timeout_s"]

    regions = cfg["regions"]
    page_bytes = cfg["page_bytes"]
    total_layers = cfg["total_layers"]
    first_layer = cfg["first_layer"]
    num_layers = cfg["num_layers"]
    src_pool_pages = cfg["src_pool_pages"]
    decode_pages = cfg["decode_pages"]
    src_pages = cfg["src_pages"]
    dst_pages = cfg["dst_pages"]
    chunks = cfg["chunks"]
    send = cfg["send_chunks"]

    src_len = regions * num_layers * src_pool_pages * page_bytes
    # The source pool: this rank's layers, holding the pattern the Rust side checks against.
    src = np.fromfile(cfg["src_file"], dtype=np.uint8)
    if src.size != src_len:
        log(f"{cfg['src_file']} holds {src.size} bytes, expected {src_len}")
        return 2
    src_addr = src.ctypes.data

    # NIXL's progress thread stays on, so the Rust agent makes progress on our requests without us
    # polling between transfers.
    agent = nixl_agent(
        cfg["agent_name"], nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
    )
    reg = agent.register_memory([(src_addr, src_len, 0, "")], "DRAM")
    with open(cfg["decode_md"], "rb") as f:
        decode_md = f.read()
    remote = agent.add_remote_agent(decode_md)
    if isinstance(remote, bytes):
        remote = remote.decode()
    if remote != cfg["decode_name"]:
        log(f"decode metadata names agent {remote!r}, expected {cfg['decode_name']!r}")
        return 2
    decode_addr = cfg["decode_addr"]
    decode_len = cfg["decode_len"]

    for chunk in send:
        first, end = chunks[chunk]
        is_last = chunk == len(chunks) - 1
        local_rows, remote_rows = [], []
        for region in range(regions):
            for local in range(num_layers):
                layer = first_layer + local
                for pos in range(first, end):
                    s = ((region * num_layers + local) * src_pool_pages + src_pages[pos]) * page_bytes
                    d = ((region * total_layers + layer) * decode_pages + dst_pages[pos]) * page_bytes
                    if s + page_bytes > src_len or d + page_bytes > decode_len:
                        log(f"page {pos} of layer {layer} falls outside a pool")
                        return 2
                    local_rows.append((src_addr + s, page_bytes, 0))
                    remote_rows.append((decode_addr + d, page_bytes, 0))
        local_descs = agent.get_xfer_descs(np.array(local_rows, dtype=np.uint64), "DRAM")
        remote_descs = agent.get_xfer_descs(np.array(remote_rows, dtype=np.uint64), "DRAM")
        # SGLang's form after its PP fix: str(int(is_last)), then the PP rank.
        notif = f"{room}_kv_{chunk}_{int(is_last)}_{rank}".encode()
        handle = agent.initialize_xfer("WRITE", local_descs, remote_descs, remote, notif)
        state = agent.transfer(handle)
        while state == "PROC":
            if time.monotonic() > deadline:
                log(f"chunk {chunk}: transfer still in progress at the deadline")
                return 1
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            log(f"chunk {chunk}: transfer state {state}")
            return 1
        agent.release_xfer_handle(handle)
        log(f"chunk {chunk} pages {first}..{end} sent ({len(local_rows)} descriptors) with {notif!r}")

    # Tell the Rust side everything is sent, then stay alive (so no notification can be lost to our
    # exit) until it says it is done with us.
    tmp = cfg["sent_file"] + ".tmp"
    with open(tmp, "w") as f:
        f.write("sent\n")
    os.replace(tmp, cfg["sent_file"])
    while not os.path.exists(cfg["linger_file"]):
        if time.monotonic() > deadline:
            log("the Rust side never wrote the linger file")
            return 3
        time.sleep(0.01)

    agent.remove_remote_agent(remote)
    agent.deregister_memory(reg)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
