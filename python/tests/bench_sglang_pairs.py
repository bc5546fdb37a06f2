"""Side by side, in one run: one normal SGLang server, SGLang's own ``mooncake_tcp`` pair, and kvx
pairs over UCX and NIXL, all real servers of the same tiny model on this host, all started before
any request. The same prompts (1 to 792 tokens, greedy, 8 new tokens) go through each, first one
warm-up round, then ``--rounds`` measured rounds at concurrency ``--concurrency``; within a round
the servers take turns in an order drawn anew for each round, so no backend always follows
another. Every answer is checked against the normal server's tokens outside the timed window (a
wrong answer fails the run). Prints, per backend, the per-request time and the time to first
token (p50, p99), and each pair's p50s over mooncake_tcp's.

    .deps/venv/bin/python python/tests/bench_sglang_pairs.py [--rounds 10] [--concurrency 1]
        [--json out.json]

Times are the client's. Per-request time: from the request to both servers of a pair at once (as
SGLang's load balancer sends it) until both answered. Time to first token: until the first output
token of decode's streamed answer (the normal server's, for it), which on a pair is the first token
prefill computed, delivered by decode once its KV arrived."""

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sglang_servers as S  # noqa: E402
from conftest import free_addrs  # noqa: E402

LENGTHS = [1, 2, 15, 16, 17, 64, 65, 200, 401, 792]
NEW_TOKENS = 8


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvx-sglang-bench-"))
    model = S.make_model(work / "model")
    rng = random.Random(23)
    prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in LENGTHS]
    backends = {
        "mooncake_tcp": ("mooncake_tcp", {}),
        "kvx-ucx": ("kvx", {"KVX_BACKEND": "ucx"}),
        "kvx-nixl": ("kvx", {"KVX_BACKEND": "nixl"}),
    }
    free = [int(x.rsplit(":", 1)[1]) for x in free_addrs(1 + 3 * len(backends))]
    normal = S.Server("normal", model, free.pop(), work)
    pairs = {}
    for name, (backend, extra) in backends.items():
        env = {"KVX_SECRET": "bench-secret", "KVX_CHUNK_TOKENS": "64", "UCX_MODULES": "^efa",
               **extra}
        p_port, d_port, b_port = free.pop(), free.pop(), free.pop()
        pairs[name] = (S.Server(f"{name}-prefill", model, p_port, work, [
            "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", backend,
            "--disaggregation-bootstrap-port", str(b_port)], env), S.Server(
            f"{name}-decode", model, d_port, work, [
                "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", backend,
                "--disaggregation-decode-retraction-backup", "cpu_tensor"], env), b_port)
    servers = [normal] + [s for p, d, _ in pairs.values() for s in (p, d)]
    times = {name: [] for name in ["normal", *pairs]}
    ttfts = {name: [] for name in ["normal", *pairs]}

    def timed_normal(ids):
        t = time.monotonic()
        status, ttft, last = S.http_stream(f"{normal.url}/generate", S.body(ids, NEW_TOKENS), 120)
        assert status == 200, f"normal: HTTP {status}: {last}"
        return last["output_ids"], ttft, time.monotonic() - t

    def run(name, measured):
        if name == "normal":
            with ThreadPoolExecutor(a.concurrency) as pool:
                got = list(pool.map(timed_normal, prompts))
            assert [g for g, _, _ in got] == want, "normal: streamed tokens differ"
            if measured:
                ttfts[name] += [t for _, t, _ in got]
                times[name] += [s for _, _, s in got]
            return
        pre, dec, bport = pairs[name]
        rooms = [rng.randrange(1 << 62) for _ in prompts]
        with ThreadPoolExecutor(a.concurrency) as pool:
            got = list(pool.map(lambda ids, room: S.pair_generate(
                pre, dec, bport, ids, NEW_TOKENS, room, stream=True), prompts, rooms))
        for ids, w, g in zip(prompts, want, got):
            ok = g["prefill"][0] == 200 and g["decode"][0] == 200 and \
                g["decode"][1]["output_ids"] == w and g["ttft"] is not None
            assert ok, f"{name}: {len(ids)} tokens: {g}"
        if measured:
            times[name] += [g["seconds"] for g in got]
            ttfts[name] += [g["ttft"] for g in got]

    try:
        S.start_all(servers, timeout=600)
        want = [S.generate(normal, p, NEW_TOKENS) for p in prompts]
        for r in range(a.rounds + 1):
            order = list(times)
            rng.shuffle(order)
            for name in order:
                run(name, measured=r > 0)
    finally:
        for s in servers:
            s.kill()
    rows = {k: {"p50_ms": 1e3 * percentile(v, 0.5), "p99_ms": 1e3 * percentile(v, 0.99),
                "ttft_p50_ms": 1e3 * percentile(ttfts[k], 0.5),
                "ttft_p99_ms": 1e3 * percentile(ttfts[k], 0.99), "requests": len(v)}
            for k, v in times.items()}
    base = rows["mooncake_tcp"]
    print(f"{'backend':<14}{'requests':>9}{'p50 ms':>9}{'p99 ms':>9}{'ttft p50':>10}"
          f"{'ttft p99':>10}{'p50/mc':>8}{'ttft/mc':>9}")
    for k, v in rows.items():
        r1 = "" if k == "normal" else f"{v['p50_ms'] / base['p50_ms']:.2f}"
        r2 = "" if k == "normal" else f"{v['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}"
        print(f"{k:<14}{v['requests']:>9}{v['p50_ms']:>9.1f}{v['p99_ms']:>9.1f}"
              f"{v['ttft_p50_ms']:>10.1f}{v['ttft_p99_ms']:>10.1f}{r1:>8}{r2:>9}")
    if a.json:
        a.json.write_text(json.dumps({"concurrency": a.concurrency, "rounds": a.rounds,
                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
