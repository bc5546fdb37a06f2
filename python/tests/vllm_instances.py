"""Real vLLM 0.32 instances on this CPU-only machine, for the tests and the bench that compare a
disaggregated pair's greedy tokens with one normal instance's.

- ``make_model(dir)``: a tiny Qwen2 (hidden 256, 4 layers, 4 heads, 2 KV heads, vocab 1024) with a
  WordLevel tokenizer made with the ``tokenizers`` library and weights from a seeded random init
  saved as safetensors: every instance loads the same weights, nothing comes from a model hub.
- ``Instance``: one ``vllm.LLM`` in its own process (``vllm_role.py``, its own session so that a
  kill takes its engine core and worker too), its log in a file; ``generate`` sends token-id
  prompts with one ``kv_transfer_params`` each.
- ``kvx_config`` / ``nixl_config``: the ``kv_transfer_config`` of a kvx or NixlConnector
  prefill or decode; ``pair_generate``: what vLLM's disaggregation proxy does (prefill with
  ``do_remote_decode`` and ``max_tokens=1``, then decode with prefill's params).

vLLM comes from the provisioned ``.deps/vllm`` (``scripts/provision-vllm``), with the kvx package
installed into it; tests run with ``.deps/vllm/bin/python -m pytest``."""

import atexit
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROLE = HERE / "vllm_role.py"
SITE = HERE / "vllm_site"

BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 64 << 20

MODEL_SCRIPT = r"""
import json, os, sys
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
from tokenizers import Tokenizer, models, pre_tokenizers
vocab = {"<unk>": 0, "<eos>": 1}
vocab.update({f"w{i}": i for i in range(2, 1024)})
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.save(os.path.join(out, "tokenizer.json"))
with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump({"model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast",
               "unk_token": "<unk>", "eos_token": "<eos>", "pad_token": "<eos>"}, f)
cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
       "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
       "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
       "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 1, "hidden_act": "silu",
       "use_sliding_window": False}
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
torch.manual_seed(20261203)
model = Qwen2ForCausalLM(Qwen2Config(**cfg))
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.5 if p.dim() > 1 else 0.1)
model.save_pretrained(out, safe_serialization=True)
"""


def base_env(extra=None):
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
                "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOGGING_LEVEL": "INFO",
                # 2 cores, up to 5 instances: no core pinning, one compute thread each.
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                # NIXL on loopback; the EFA module of UCX crashes processes at exit (libnl).
                "UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo", "UCX_MODULES": "^efa"})
    env.update(extra or {})
    # vLLM busy-waits with time.sleep(0), not sched_yield: see vllm_site/sitecustomize.py.
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(SITE), env.get("PYTHONPATH")] if p)
    return env


def make_model(out):
    out = Path(out)
    if not (out / "model.safetensors").exists():
        r = subprocess.run([sys.executable, "-c", MODEL_SCRIPT, str(out)], env=base_env(),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    return out


def free_ports(n):
    """`n` loopback ports free a moment ago (``conftest.free_addrs``'s, drawn below the kernel's
    ephemeral range)."""
    from conftest import free_addrs

    return [int(a.rsplit(":", 1)[1]) for a in free_addrs(n)]


def secret_file(dir_):
    path = Path(dir_) / "kvx-secret"
    if not path.exists():
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return str(path)


def kvx_config(role, secret, **extra):
    return {"kv_connector": "KvxConnector", "kv_connector_module_path": "kvx.vllm",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"secret_file": secret, **extra}}


def nixl_config(role):
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "recompute"}


_STARTED = []


def session_pids(sid):
    """The live vLLM processes of session `sid` (an instance's process and every process it
    started: its engine core and worker), read from /proc: killed by their ids, never by a group
    id that may have been handed to another program since."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command: state, ppid, pgrp, session... The command line must be ours too
        # (vllm_role.py, VLLM::EngineCore, VLLM::Worker, .deps/vllm's python): a session id is
        # free for another program once all of ours are gone.
        if int(fields[3]) != sid or fields[0] == "Z":
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().lower()
        except OSError:
            continue
        if b"vllm" in cmd:
            found.append(int(entry))
    return found


def _kill_session(sid, sig=9):
    for pid in session_pids(sid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill_all(*_):
    """Kills every instance this process started, with its engine core and worker processes
    (they do not die with their instance by themselves)."""
    for inst in _STARTED:
        _kill_session(inst.proc.pid)


def _on_sigterm(signum, frame):
    _kill_all()
    raise SystemExit(128 + signum)


atexit.register(_kill_all)
if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _on_sigterm)


class Instance:
    """One ``vllm.LLM`` in its own process (and session)."""

    def __init__(self, name, model, log_dir, kv=None, env=None, tp=1, block_size=BLOCK_SIZE):
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self._listener = Listener(("127.0.0.1", 0), authkey=(key := secrets.token_bytes(16)))
        cfg = {"address": list(self._listener.address), "authkey": key.hex(),
               "model": str(model), "block_size": block_size, "max_model_len": MAX_MODEL_LEN,
               "kv_cache_bytes": KV_CACHE_BYTES, "kv": kv, "tp": tp}
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen([sys.executable, str(ROLE), json.dumps(cfg)],
                                     env=base_env(env), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        _STARTED.append(self)
        self.conn = None
        self.start_s = None
        # Accepted at once, so that instances start side by side (the role's Client waits for
        # the challenge until it is accepted).
        self._accepted = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        try:
            self._accepted["conn"] = self._listener.accept()
        except (OSError, EOFError) as e:
            self._accepted["error"] = e

    def log(self, tail=8000):
        try:
            return f"--- {self.name} ({self.log_path})\n" + self.log_path.read_text()[-tail:]
        except OSError:
            return f"--- {self.name}: no log"

    def wait_ready(self, deadline):
        while "conn" not in self._accepted:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} never connected (exit {self.proc.poll()}, "
                                     f"{self._accepted.get('error')!r})\n{self.log()}")
            time.sleep(0.2)
        self.conn = self._accepted["conn"]
        while not self.conn.poll(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not ready (exit {self.proc.poll()})\n"
                                     f"{self.log()}")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise AssertionError(f"{self.name} went away (exit {self.proc.poll()})\n"
                                 f"{self.log()}") from None
        assert msg.get("ready"), f"{self.name}: {msg}\n{self.log()}"
        self.start_s = msg["start_s"]

    def generate(self, prompts, max_tokens, params=None, timeout=120):
        """Greedy outputs of `prompts` (token-id lists), batched in one ``LLM.generate``: a dict
        with ``wall_s`` and ``outputs`` (``tokens``, ``finish_reason``, ``kv_transfer_params``,
        ``ttft_s`` per prompt). Raises AssertionError when the instance does not answer within
        `timeout` seconds, or died."""
        return self._call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                           "params": params}, timeout)

    def generate_abort(self, prompts, max_tokens, params, abort_after_s, timeout=120):
        """Sends `prompts` with `params` and aborts them after `abort_after_s` seconds, as a server
        does for a client that went away (see ``vllm_role.generate_abort``)."""
        return self._call({"op": "generate_abort", "prompts": prompts, "max_tokens": max_tokens,
                           "params": params, "abort_after_s": abort_after_s}, timeout)

    def _call(self, msg, timeout):
        """Sends `msg` to the instance and returns its answer; AssertionError when it does not
        answer within `timeout` seconds, or died."""
        self.conn.send(msg)
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} died ({self.proc.returncode})\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no answer in {timeout} s\n{self.log()}")
        return self.conn.recv()

    def alive(self):
        return self.proc.poll() is None

    def kill(self, sig=9):
        """Kills the instance and every process it started (its own session)."""
        _kill_session(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _kill_session(self.proc.pid, 9)
            self.proc.wait(timeout=30)

    def close(self):
        if self.conn is not None and self.alive():
            try:
                self.conn.send({"op": "exit"})
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                pass
        # The instance, and its engine core and worker processes if they outlived it.
        self.kill()
        _kill_session(self.proc.pid, 9)
        self._listener.close()
        self._log.close()


def start_all(instances, timeout=300):
    deadline = time.monotonic() + timeout
    for i in instances:
        i.wait_ready(deadline)


def prompts(n, length, seed=7):
    """`n` distinct prompts of `length` token ids each (ids 2..1023: no unknown, no EOS)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, 1024) for _ in range(length + 3 * i)] for i in range(n)]


def pair_generate(prefill, decode, prompt_list, max_tokens, extra_params=None, timeout=120):
    """What vLLM's disaggregation proxy does, for a batch: prefill with ``do_remote_decode`` and
    ``max_tokens=1``, then decode with the params prefill returned. `extra_params` (one dict or
    None per prompt) is merged into prefill's params (a test tag, say)."""
    extra_params = extra_params or [None] * len(prompt_list)
    p_params = [{"do_remote_decode": True, **(e or {})} for e in extra_params]
    p = prefill.generate(prompt_list, 1, p_params, timeout=timeout)
    d_params = [o["kv_transfer_params"] for o in p["outputs"]]
    assert all(d_params), f"prefill returned no kv_transfer_params: {p}"
    d = decode.generate(prompt_list, max_tokens, d_params, timeout=timeout)
    return p, d
