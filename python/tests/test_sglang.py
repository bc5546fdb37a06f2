"""kvx.sglang under SGLang 0.5.23's own classes: prefill PP ranks 0 and 1 and decode in three
processes (tests/sglang_role.py), MLA and GQA pools in host memory, every byte checked against
patterns unique to each request, rank, layer and page on poisoned pages; a rank's lost last chunk,
aborts on either side and a prefill process killed mid-request fail their requests, never
complete them, and the requests after them complete.

SGLang comes from the provisioned ``.deps/sglang`` (or ``KVX_SGLANG_PATH``): without it this test
fails."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import free_addrs

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SGLANG = os.environ.get("KVX_SGLANG_PATH", str(REPO / ".deps" / "sglang"))


def test_sglang_backend_in_three_processes(tmp_path):
    assert (Path(SGLANG) / "sglang").is_dir(), f"SGLang is not provisioned at {SGLANG}"
    ports = [int(a.rsplit(":", 1)[1]) for a in free_addrs(2)]
    plan = {
        "pp": 2,
        "prefill_pages": 64,
        "decode_pages": 64,
        # SGLang's chunked prefill: 6 pages per send; kvx chunks (KVX_CHUNK_TOKENS) are 4 pages.
        "sglang_chunk_tokens": 96,
        "phases": [
            {"name": "mla", "model": "mla", "port": ports[0], "requests": [
                {"room": 101, "tokens": 200},
                {"room": 102, "tokens": 256},
                {"room": 103, "tokens": 200, "fault": "skip_last"},
                {"room": 104, "tokens": 150},
                {"room": 105, "tokens": 200, "fault": "abort_decode"},
                {"room": 106, "tokens": 200, "fault": "abort_prefill"},
                {"room": 107, "tokens": 300},
                {"room": 108, "tokens": 300, "fault": "early_event"},
                # Decode's radix cache holds a prefix: 4 of 13 pages, then the whole prompt.
                {"room": 109, "tokens": 200, "prefix": 64},
                {"room": 110, "tokens": 128, "prefix": 128},
                {"room": 111, "tokens": 200, "fault": "abort_decode_early"},
            ]},
            {"name": "gqa", "model": "gqa", "port": ports[1], "requests": [
                {"room": 201, "tokens": 200},
                {"room": 202, "tokens": 64},
                {"room": 203, "tokens": 300, "fault": "kill"},
            ]},
        ],
    }
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [SGLANG, str(HERE), env.get("PYTHONPATH")] if p)
    env.update({"KVX_SECRET": "sglang-test-secret", "KVX_CHUNK_TOKENS": "64",
                "KVX_REQUEST_TIMEOUT": "3", "PYTHONWARNINGS": "ignore",
                "SGLANG_HOST_IP": "127.0.0.1"})
    role = HERE / "sglang_role.py"
    out = {name: tmp_path / f"{name}.json" for name in ("p0", "p1", "d")}
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in out}
    procs = {
        "p0": subprocess.Popen([sys.executable, str(role), "prefill", str(plan_path), "0", str(out["p0"])],
                               env=env, stdout=logs["p0"], stderr=subprocess.STDOUT),
        "p1": subprocess.Popen([sys.executable, str(role), "prefill", str(plan_path), "1", str(out["p1"])],
                               env=env, stdout=logs["p1"], stderr=subprocess.STDOUT),
        "d": subprocess.Popen([sys.executable, str(role), "decode", str(plan_path), "0", str(out["d"])],
                              env=env, stdout=logs["d"], stderr=subprocess.STDOUT),
    }

    def log(name):
        return (tmp_path / f"{name}.log").read_text()[-4000:]

    try:
        rc = procs["d"].wait(timeout=600)
        assert rc == 0, f"decode exited {rc}\n{log('d')}\n--- p0\n{log('p0')}\n--- p1\n{log('p1')}"
        # Rank 1 killed itself mid-request 203.
        assert procs["p1"].wait(timeout=30) == -signal.SIGKILL, log("p1")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    d = json.loads(out["d"].read_text())
    p0 = json.loads(out["p0"].read_text())
    p1 = json.loads(out["p1"].read_text())
    context = json.dumps({"decode": d, "p0": p0, "p1": p1}, indent=1)

    for phase, rooms in (("mla", [101, 102, 104, 107, 108, 109, 110]), ("gqa", [201, 202])):
        for room in rooms:
            r = d[phase][str(room)]
            assert r["state"] == "success" and r["verified"] is True, context
            assert p0[phase][str(room)]["state"] == "success", context
            assert p1[phase][str(room)]["state"] == "success", context
    # The early send waited for the forward's event: nothing went before it fired.
    for p in (p0, p1):
        early = p["mla"]["108"]
        assert early["event_fired"] and early["posted_before_event"] == 0, context
        assert early["posted_after_event"] > 0, context
    # Every rank learnt decode's prefix before it sent (rank 1 is never polled, so it waits).
    for p in (p0, p1):
        assert (p["mla"]["109"]["prefix"], p["mla"]["110"]["prefix"]) == (64, 128), context
        assert p["mla"]["101"]["prefix"] == 0, context
    # Rank 1 never sent its last chunk: decode's deadline fails the request, and both ranks learn.
    assert d["mla"]["103"]["state"] == "failed" and d["mla"]["103"]["reason"] == "TransferFailed:timeout", context
    assert p0["mla"]["103"]["state"] == "failed" and p1["mla"]["103"]["state"] == "failed", context
    # Decode aborted.
    assert d["mla"]["105"]["reason"] == "TransferFailed:aborted", context
    assert p0["mla"]["105"]["state"] == "failed" and p1["mla"]["105"]["state"] == "failed", context
    # Decode gave the room up before it allocated pages: prefill's sender, waiting for the
    # allocation, fails at once, not at SGLang's bootstrap timeout (300 s; the harness stops
    # waiting at 60 s).
    assert d["mla"]["111"]["reason"] == "TransferFailed:aborted", context
    assert p0["mla"]["111"]["state"] == "failed", context
    assert p0["mla"]["111"]["reason"].startswith("TransferFailed:"), context
    assert p0["mla"]["111"]["bootstrap_s"] < 10, context
    # Prefill rank 0 aborted after its first chunk.
    assert d["mla"]["106"]["reason"] == "TransferFailed:peer_failed", context
    assert p1["mla"]["106"]["state"] == "failed", context
    # Rank 1's process died mid-request.
    assert d["gqa"]["203"]["state"] == "failed", context
    assert d["gqa"]["203"]["reason"] == "TransferFailed:peer_lost", context
    assert p0["gqa"]["203"]["state"] == "failed", context
    # Every failed request's pages were released only once no write could land.
    for phase, room in (("mla", 103), ("mla", 105), ("mla", 106), ("gqa", 203)):
        assert d[phase][str(room)]["release_safe"] is True, context


def test_sglang_loads_kvx_as_a_plugin():
    """SGLang's own argument parsing accepts `--disaggregation-transfer-backend kvx` once its plugin
    loader ran (as launch_server and every scheduler process do), and resolves kvx's classes."""
    assert (Path(SGLANG) / "sglang").is_dir(), f"SGLang is not provisioned at {SGLANG}"
    code = (
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "a = prepare_server_args(['--model-path', 'none', '--disaggregation-mode', 'decode',\n"
        "                         '--disaggregation-transfer-backend', 'kvx'])\n"
        "from sglang.srt.disaggregation import utils as u\n"
        "b = u.TransferBackend(a.disaggregation_transfer_backend)\n"
        "print([u.get_kv_class(b, t).__qualname__ for t in (u.KVClassType.MANAGER,\n"
        "       u.KVClassType.SENDER, u.KVClassType.RECEIVER, u.KVClassType.BOOTSTRAP_SERVER)])\n"
    )
    env = dict(os.environ, PYTHONPATH=SGLANG, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == (
        "['KvxKVManager', 'KvxKVSender', 'KvxKVReceiver', 'KvxBootstrapServer']"), r.stdout
