"""Side by side, in one run: a kvx pair (``kvx.vllm.KvxConnector``) against vLLM's NixlConnector
pair, real vLLM 0.32 instances on this CPU-only machine, the same prompts through both.

Each request goes as vLLM's disaggregation proxy sends it: prefill with ``max_tokens=1`` and
``do_remote_decode``, then decode with prefill's params and ``max_tokens=1`` (its first token).
Per request:

- ``ttft``: the client's time to first token through the pair (prefill's ``generate`` plus
  decode's, as the proxy waits for one then the other), and each of the two (``prefill``,
  ``decode``);
- ``kv_wait``: on decode, from the request being queued in the engine core to its first
  scheduling, which for a request that loads its KV happens once the load is over: the transfer
  as vLLM sees it (side-channel message, writes or reads, completion, the next engine step);
- ``step``: on decode, from that scheduling to the first token (the one-token forward).

Rounds alternate which pair goes first, every prompt is new to both pairs (nothing from a prefix
cache), and a concurrent phase sends a batch of prompts at once to each pair.

    .deps/vllm/bin/python python/tests/bench_vllm_pairs.py --requests 20 --tokens 512
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_instances as V  # noqa: E402


def summary(xs):
    xs = sorted(xs)
    if not xs:
        return {}
    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": xs[len(xs) // 2],
            "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))], "min": xs[0], "max": xs[-1]}


def one_batch(prefill, decode, prompts):
    """Per prompt: (ttft, kv_wait, step) in seconds; tokens."""
    p, d = V.pair_generate(prefill, decode, prompts, 1, timeout=300)
    rows = []
    for o in d["outputs"]:
        kv_wait = o["scheduled_ts"] - o["queued_ts"] if o["scheduled_ts"] else None
        step = o["first_token_ts"] - o["scheduled_ts"] if o["scheduled_ts"] else None
        rows.append({"ttft": p["wall_s"] + d["wall_s"], "prefill": p["wall_s"],
                     "decode": d["wall_s"], "kv_wait": kv_wait, "step": step,
                     "tokens": o["tokens"]})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20, help="sequential requests per pair")
    ap.add_argument("--tokens", type=int, default=512, help="prompt length")
    ap.add_argument("--batch", type=int, default=8, help="prompts of the concurrent phase")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args()
    before = f"{os.getloadavg()[0]:.1f}"
    with tempfile.TemporaryDirectory(prefix="vllm-pairs-") as d:
        d = Path(d)
        model = V.make_model(d / "model")
        secret = V.secret_file(d)
        nixl_p, nixl_d = V.free_ports(2)
        pairs = {}
        made = []
        try:
            for name, kv_p, kv_d, env_p, env_d in (
                    ("kvx", V.kvx_config("kv_producer", secret),
                     V.kvx_config("kv_consumer", secret), None, None),
                    ("nixl", V.nixl_config("kv_producer"), V.nixl_config("kv_consumer"),
                     {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_p)},
                     {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_d)})):
                p = V.Instance(f"{name}-prefill", model, d, kv=kv_p, env=env_p)
                made.append(p)
                q = V.Instance(f"{name}-decode", model, d, kv=kv_d, env=env_d)
                made.append(q)
                pairs[name] = (p, q)
            start = time.monotonic()
            V.start_all(made, timeout=600)
            print(f"4 instances ready in {time.monotonic() - start:.0f} s", flush=True)
            # Warm-up: handshakes, first allocations.
            for name, (p, q) in pairs.items():
                one_batch(p, q, V.prompts(2, args.tokens, seed=1))
            results = {name: [] for name in pairs}
            mismatches = 0
            for i in range(args.requests):
                prompt = V.prompts(1, args.tokens, seed=1000 + i)
                order = list(pairs) if i % 2 == 0 else list(pairs)[::-1]
                got = {}
                for name in order:
                    row = one_batch(*pairs[name], prompt)[0]
                    results[name].append(row)
                    got[name] = row["tokens"]
                mismatches += got["kvx"] != got["nixl"]
            conc = {}
            for k, name in enumerate(list(pairs) * 2):
                rows = one_batch(*pairs[name], V.prompts(args.batch, args.tokens,
                                                         seed=5000 + k))
                conc.setdefault(name, []).extend(rows)
        finally:
            for inst in made:
                inst.close()
    print(f"\n{args.requests} sequential requests of {args.tokens} tokens per pair "
          f"({-(-args.tokens // V.BLOCK_SIZE)} blocks of {V.BLOCK_SIZE} tokens, 4 layers; "
          f"first tokens differing between the pairs: {mismatches})")
    print(f"load average before: {before}, after: {os.getloadavg()[0]:.1f}")
    print(f"{'metric':<10}{'pair':<6}{'mean ms':>10}{'p50 ms':>10}{'p90 ms':>10}{'min ms':>10}")
    out = {"args": vars(args), "sequential": {}, "concurrent": {}}
    for phase, data in (("sequential", results), ("concurrent", conc)):
        if phase == "concurrent":
            print(f"\nconcurrent: 2 batches of {args.batch} prompts at once per pair")
        for metric in ("ttft", "prefill", "decode", "kv_wait", "step"):
            for name in pairs:
                s = summary([r[metric] for r in data[name] if r[metric] is not None])
                out[phase].setdefault(metric, {})[name] = s
                print(f"{metric:<10}{name:<6}{1e3 * s['mean']:>10.1f}{1e3 * s['p50']:>10.1f}"
                      f"{1e3 * s['p90']:>10.1f}{1e3 * s['min']:>10.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
