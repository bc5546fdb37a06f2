"""NIXL's own Python agent as kvx's peer: a kvx prefill rank writes into memory a NIXL agent
registered, and the agent receives kvx's notifications."""

import os
import time

import numpy as np
import pytest

import kvx
from conftest import POISON, pattern



def nixl_agent_class():
    # The NIXL wheel is provisioned into .deps/py; without it this test fails, never skips.
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    return nixl_agent, nixl_agent_config


@pytest.mark.parametrize("notify", ["sglang", "binary"])
def test_kvx_prefill_writes_into_a_nixl_python_agent(notify):
    nixl_agent, nixl_agent_config = nixl_agent_class()
    agent = nixl_agent(f"kvx-test-agent-{os.getpid()}-{notify}",
                       nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    layers, page_tokens, bpt, pages = 2, 16, 64, 8
    page_bytes = page_tokens * bpt
    dlayout = kvx.Layout(first_layer=0, num_layers=layers, page_bytes=page_bytes, num_pages=pages)
    buf = np.full(dlayout.buffer_len, POISON, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    slayout = kvx.Layout(first_layer=0, num_layers=layers, page_bytes=page_bytes, num_pages=4)
    src = np.zeros(slayout.buffer_len, dtype=np.uint8)
    name = f"kvx-test-prefill-{os.getpid()}-{notify}"
    prefill = kvx.PrefillEngine.external(
        decode_metadata=agent.get_agent_metadata(), decode_region=(buf.ctypes.data, buf.nbytes),
        decode_layout=dlayout, pp_rank=0, pp_size=1, layout=slayout, total_layers=layers,
        page_tokens=page_tokens, memory=src, backend="nixl", engine_id=name, notify=notify)
    request, src_pages, dst_pages = 5, [0, 1, 2, 3], [6, 7, 2, 3]
    for layer in range(layers):
        for i, p in enumerate(src_pages):
            at = slayout.offset(layer, p)
            src[at:at + page_bytes] = pattern(request, 0, layer, i, page_bytes)
    prefill.add_request(request, 64, 32, dst_pages)
    for c in range(2):
        prefill.send_chunk(request, c, src_pages, c == 1)
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        for sender, msgs in agent.get_new_notifs().items():
            assert sender == name, sender
            got.extend(msgs)
        time.sleep(0.001)
    if notify == "sglang":
        assert sorted(got) == [b"5_kv_0_0_0", b"5_kv_1_1_0"], got
    else:
        assert len(got) == 2 and all(m[:4] == b"\xc7KVN" for m in got), got
    for layer in range(layers):
        for i, p in enumerate(dst_pages):
            at = dlayout.offset(layer, p)
            assert np.array_equal(buf[at:at + page_bytes], pattern(request, 0, layer, i, page_bytes)), (layer, p)
    untouched = [p for p in range(pages) if p not in dst_pages]
    for layer in range(layers):
        for p in untouched:
            at = dlayout.offset(layer, p)
            assert (buf[at:at + page_bytes] == POISON).all(), (layer, p)
    # An allocation that does not fit the prompt is refused.
    with pytest.raises(kvx.ConfigError):
        prefill.add_request(6, 64, 32, [0, 1])
    prefill.close()
    agent.deregister_memory(reg)
