"""Real SGLang 0.5.23 servers on this CPU-only machine, for the tests that compare a disaggregated
pair's tokens with one normal server's.

- ``make_model(dir)``: a tiny Qwen2 (hidden 256, 2 layers, 4 heads, 2 KV heads, vocab 1024), its
  tokenizer trained locally with the ``tokenizers`` library, weights from a seeded random init saved
  as safetensors: every server loads the same weights, nothing comes from a model hub.
- ``Server``: one ``python -m sglang.launch_server`` process with the CPU flags, its log in a file.
- ``pair_generate``: a request sent the way SGLang's own load balancer sends it to a disaggregated
  pair: the same body, with ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``, to
  prefill's and decode's ``/generate`` at once.

SGLang comes from the provisioned ``.deps/sglang`` with the server packages of
``.deps/sglang-server`` (``scripts/provision-sglang``)."""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SGLANG = os.environ.get("KVX_SGLANG_PATH", str(REPO / ".deps" / "sglang"))
SGLANG_SERVER = os.environ.get("KVX_SGLANG_SERVER_PATH", str(REPO / ".deps" / "sglang-server"))
# The sgl_kernel stand-in and the reference pair's CPU plugin.
CPU_SHIMS = str(HERE / "sglang_cpu")

PAGE_SIZE = 16
CHUNKED_PREFILL = 64

# What SGLang's CPU engine needs to run several ranks in one server (--tp-size or --pp-size 2):
# its PP and TP groups make a NCCL communicator unless loading libnccl fails (this torch is a CUDA
# build, whose NCCL loads and then refuses the CPU device), and it binds each rank to a NUMA node
# unless told which cores each rank takes.
MULTI_RANK_ENV = {"SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2",
                  "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}

MODEL_SCRIPT = r"""
import json, os, sys
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
corpus = [" ".join(f"w{(i * 7 + j * 13) % 997}" for j in range(40)) for i in range(300)]
corpus += ["the quick brown fox jumps over the lazy dog", "pages of a kv cache move from prefill to decode"]
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(corpus, trainers.BpeTrainer(
    vocab_size=1000, special_tokens=["<|endoftext|>"], show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok.save(os.path.join(out, "tokenizer.json"))
with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump({"model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast",
               "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, f)
cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
       "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
       "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
       "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu",
       "use_sliding_window": False}
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
torch.manual_seed(20261202)
model = Qwen2ForCausalLM(Qwen2Config(**cfg))
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.5 if p.dim() > 1 else 0.1)
model.save_pretrained(out, safe_serialization=True)
"""


def sglang_env(extra=None):
    """The environment of a server process: SGLang, its server packages, the CPU shims and kvx."""
    for path, what in ((SGLANG, "SGLang"), (SGLANG_SERVER, "SGLang's server packages")):
        assert Path(path).is_dir(), f"{what} not provisioned at {path} (run scripts/provision-sglang)"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [CPU_SHIMS, SGLANG_SERVER, SGLANG, env.get("PYTHONPATH")] if p)
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                # SGLang's transfer backends (kvx and mooncake) publish this host address.
                "SGLANG_HOST_IP": "127.0.0.1"})
    env.update(extra or {})
    return env


def make_model(out: Path) -> Path:
    out = Path(out)
    if not (out / "model.safetensors").exists():
        r = subprocess.run([sys.executable, "-c", MODEL_SCRIPT, str(out)], env=sglang_env(),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    return out


def http(method, url, body=None, timeout=60.0):
    """(status, parsed JSON or text) of one HTTP call; never raises on an HTTP error status."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class Server:
    """One real SGLang server process (CPU engine, torch-native attention)."""

    def __init__(self, name, model, port, log_dir, args=(), env=None):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_dir) / f"{name}.log"
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
               "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
               "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
               "--disable-cuda-graph", "--skip-server-warmup", "--dtype", "float32",
               "--max-total-tokens", "4096",
               # The KV pool is capped by --max-total-tokens; a low fraction fails the start when
               # other servers load at the same time (their memory looks like this one's weights).
               "--mem-fraction-static", "0.5",
               "--page-size", str(PAGE_SIZE), "--chunked-prefill-size", str(CHUNKED_PREFILL),
               "--disable-overlap-schedule", "--random-seed", "1",
               # Idle schedulers otherwise poll without rest: five of them starve 2 cores.
               "--sleep-on-idle", *args]
        self._cmd, self._env, self._log = cmd, sglang_env(env), None
        self.start()

    def start(self):
        """Starts the process (again, after ``kill``: same ports, same arguments)."""
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self._cmd, env=self._env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, tail=6000):
        try:
            return f"--- {self.name} ({self.log_path})\n" + self.log_path.read_text()[-tail:]
        except OSError:
            return f"--- {self.name}: no log"

    def wait_ready(self, deadline):
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}\n{self.log()}")
            try:
                status, _ = http("GET", f"{self.url}/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{self.name} not ready in time\n{self.log()}")

    def kill(self, sig=9):
        """Kills the server and every process it started (its own session)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=30)
        self._log.close()

    def signal(self, sig):
        """Sends `sig` to the server and every process it started."""
        os.killpg(self.proc.pid, sig)

    def alive(self):
        return self.proc.poll() is None


def start_all(servers, timeout=420):
    deadline = time.monotonic() + timeout
    for s in servers:
        s.wait_ready(deadline)


def body(input_ids, max_new_tokens, **extra):
    return {"input_ids": list(input_ids), "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}, **extra}


def http_stream(url, body, timeout=60.0):
    """A streaming POST (``"stream": true``): ``(status, seconds to the first output token, last
    output)``, timed from the call; never raises on an HTTP error status."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    start, first, last = time.monotonic(), None, None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status = r.status
            for line in r:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                last = json.loads(line[len(b"data: "):])
                if first is None and last.get("output_ids"):
                    first = time.monotonic() - start
    except urllib.error.HTTPError as e:
        return e.code, None, e.read().decode(errors="replace")
    return status, first, last


def generate(server, input_ids, max_new_tokens, timeout=120):
    status, out = http("POST", f"{server.url}/generate", body(input_ids, max_new_tokens),
                       timeout=timeout)
    assert status == 200, f"{server.name}: HTTP {status}: {out}\n{server.log()}"
    return out["output_ids"]


def pair_generate(prefill, decode, bootstrap_port, input_ids, max_new_tokens, room, timeout=120,
                  stream=False, **extra):
    """One request through a disaggregated pair, as SGLang's load balancer sends it. Returns
    ``{"prefill": (status, reply), "decode": (status, reply), "seconds": wall time}``; a call
    that got no answer (connection refused or reset) has status None. With ``stream``, decode's
    answer is streamed and ``"ttft"`` is the time to its first output token (None if none came)."""
    b = body(input_ids, max_new_tokens, bootstrap_host="127.0.0.1",
             bootstrap_port=bootstrap_port, bootstrap_room=room, **extra)
    got = {}

    def call(role, server):
        try:
            if stream and role == "decode":
                status, got["ttft"], last = http_stream(f"{server.url}/generate", b, timeout)
                got[role] = (status, last)
            else:
                got[role] = http("POST", f"{server.url}/generate", b, timeout=timeout)
        except OSError as e:
            got[role] = (None, repr(e))

    start = time.monotonic()
    threads = [threading.Thread(target=call, args=(r, s)) for r, s in
               (("prefill", prefill), ("decode", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got["seconds"] = time.monotonic() - start
    return got
