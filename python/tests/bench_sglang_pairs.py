"""Side by side, in one run: one normal SGLang server, SGLang's own ``mooncake_tcp`` pair, and kvx
pairs over UCX and NIXL, all real servers of the same tiny model on this host, all started before
any request. The same prompts (1 to 792 tokens, greedy, 8 new tokens) go through each, first one
warm-up round, then ``--rounds`` measured rounds at concurrency ``--concurrency``; every answer is
checked against the normal server's tokens outside the timed window (a wrong answer fails the
run). Prints per-request wall time (p50, p99) per backend and each pair's p50 over mooncake_tcp's.

    .deps/venv/bin/python python/tests/bench_sglang_pairs.py [--rounds 5] [--concurrency 1]
        [--json out.json]

Times are the client's: the request to both servers of a pair at once (as SGLang's load balancer
sends it) until both answered."""

import argparse
import json
import random
import sys
import tempfile
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
    ap.add_argument("--rounds", type=int, default=5)
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
    try:
        S.start_all(servers, timeout=600)
        want = [S.generate(normal, p, NEW_TOKENS) for p in prompts]
        times = {"normal": []}

        def timed_normal(ids):
            import time

            t = time.monotonic()
            out = S.generate(normal, ids, NEW_TOKENS)
            return out, time.monotonic() - t

        for name in pairs:
            times[name] = []
        for r in range(a.rounds + 1):
            with ThreadPoolExecutor(a.concurrency) as pool:
                got = list(pool.map(timed_normal, prompts))
            assert [g for g, _ in got] == want
            if r:
                times["normal"] += [t for _, t in got]
            for name, (pre, dec, bport) in pairs.items():
                rooms = [rng.randrange(1 << 62) for _ in prompts]
                with ThreadPoolExecutor(a.concurrency) as pool:
                    got = list(pool.map(lambda ids, room: S.pair_generate(
                        pre, dec, bport, ids, NEW_TOKENS, room), prompts, rooms))
                for ids, w, g in zip(prompts, want, got):
                    ok = g["prefill"][0] == 200 and g["decode"][0] == 200 and \
                        g["decode"][1]["output_ids"] == w
                    assert ok, f"{name}: {len(ids)} tokens: {g}"
                if r:
                    times[name] += [g["seconds"] for g in got]
    finally:
        for s in servers:
            s.kill()
    rows = {k: {"p50_ms": 1e3 * percentile(v, 0.5), "p99_ms": 1e3 * percentile(v, 0.99),
                "requests": len(v)} for k, v in times.items()}
    base = rows["mooncake_tcp"]["p50_ms"]
    print(f"{'backend':<14}{'requests':>9}{'p50 ms':>10}{'p99 ms':>10}{'p50 / mooncake':>16}")
    for k, v in rows.items():
        ratio = "" if k == "normal" else f"{v['p50_ms'] / base:.2f}"
        print(f"{k:<14}{v['requests']:>9}{v['p50_ms']:>10.1f}{v['p99_ms']:>10.1f}{ratio:>16}")
    if a.json:
        a.json.write_text(json.dumps({"concurrency": a.concurrency, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
