"""``python -m kvx.bench``: kvbench's workload driven through the Python API.

It runs the MLA default of ``kvbench`` (61 layers of 576 B per token, 64-token pages, 8192-token
prompts in 1024-token chunks, PP=4, 32 requests two at a time) with one decode engine and one
prefill engine per PP rank in this process, each rank driven by a Python thread of its own, and
prints kvbench's columns. With ``--kvbench PATH`` (or a ``kvbench`` found on PATH or in
``target/release``) it first runs kvbench itself on the same workload, so the table shows both rows
and ``vs kvbench``: the Python path's GB/s over kvbench's. ``py us/chunk`` is the time a chunk spends
in Python calls (``post_chunk`` and the wait for its writes' completion report, interpreter held).

Timed windows hold the transfers only: patterns are written, pages poisoned and bytes checked in a
final wave of one request per destination slot, outside them.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import kvx

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mesh_sockets(n):
    """Vote mesh sockets for `n` PP ranks, bound before any rank starts, and the `peers` list of
    their addresses (empty for one rank)."""
    if n < 2:
        return [None] * n, []
    socks = [kvx.MeshSocket("127.0.0.1:0") for _ in range(n)]
    return socks, [s.address for s in socks]


def words(request, rank, layers, pages, n_words):
    """The pattern of `request` as `rank` sends it: shape (len(layers), pages, n_words) of uint64,
    different for every request, rank, layer, page position and word."""
    l = np.asarray(layers, dtype=np.uint64)[:, None, None]
    i = np.arange(pages, dtype=np.uint64)[None, :, None]
    w = np.arange(n_words, dtype=np.uint64)[None, None, :]
    with np.errstate(over="ignore"):
        seed = (np.uint64(request) * np.uint64(0x100000001B3)
                + np.uint64(rank + 1) * np.uint64(0xC2B2AE3D27D4EB4F))
        return seed + l * np.uint64(0x165667B19E3779F9) + i * np.uint64(0x27D4EB2F165667C5) + w * GOLDEN


class Workload:
    def __init__(self, a):
        self.layers, self.bytes_per_token, self.page_tokens = a.layers, a.bytes_per_token, a.page_tokens
        self.pp, self.prompt, self.chunk = a.pp, a.prompt_tokens, a.chunk_tokens
        self.requests, self.concurrency = a.requests, max(1, a.concurrency)
        self.page_bytes = self.page_tokens * self.bytes_per_token
        self.pages = -(-self.prompt // self.page_tokens)
        self.chunks = -(-self.prompt // self.chunk)
        self.request_bytes = self.layers * self.bytes_per_token * self.prompt

    def rank_layers(self, r):
        # SGLang's even split: the first (layers % pp) ranks take one layer more.
        base, extra = divmod(self.layers, self.pp)
        first = r * base + min(r, extra)
        return first, base + (1 if r < extra else 0)

    def kvbench_args(self):
        return ["--model", "mla", "--layers", str(self.layers), "--bytes-per-token",
                str(self.bytes_per_token), "--page-tokens", str(self.page_tokens), "--pp",
                str(self.pp), "--prompt-tokens", str(self.prompt), "--chunk-tokens",
                str(self.chunk), "--requests", str(self.requests), "--concurrency",
                str(self.concurrency)]


def run(w, backend, secret):
    """One backend's row: a timed stream of `requests` requests, then a checked wave."""
    slots_d = w.concurrency
    slots_p = w.concurrency + 1  # a rank holds a request's source pages until every rank decided
    dlayout = kvx.Layout(first_layer=0, num_layers=w.layers, page_bytes=w.page_bytes,
                         num_pages=w.pages * slots_d)
    dmem = np.zeros(dlayout.buffer_len, dtype=np.uint8)
    tag = f"{os.getpid()}-{backend}"
    decode = kvx.DecodeEngine(layout=dlayout, total_layers=w.layers, page_tokens=w.page_tokens,
                              pp_size=w.pp, memory=dmem, secret=secret, backend=backend,
                              engine_id=f"bench-decode-{tag}")
    socks, peers = mesh_sockets(w.pp)
    layouts, mems, ranks = [], [], [None] * w.pp
    for r in range(w.pp):
        first, n = w.rank_layers(r)
        layouts.append(kvx.Layout(first_layer=first, num_layers=n, page_bytes=w.page_bytes,
                                  num_pages=w.pages * slots_p))
        mems.append(np.zeros(layouts[-1].buffer_len, dtype=np.uint8))
    errors = []

    def start(r):
        try:
            ranks[r] = kvx.PrefillEngine(
                decode=decode.address, pp_rank=r, pp_size=w.pp, layout=layouts[r],
                total_layers=w.layers, page_tokens=w.page_tokens, memory=mems[r], peers=peers,
                mesh_socket=socks[r],
                secret=secret, backend=backend, engine_id=f"bench-prefill-{r}-{tag}")
        except Exception as e:
            errors.append(e)

    ts = [threading.Thread(target=start, args=(r,)) for r in range(w.pp)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    decode.wait_for_ranks(60)

    py_time = [0.0] * w.pp
    rank_errors = []
    # Requests each rank saw decided (its vote board's answer), whatever the answer.
    decided = [0] * w.pp

    def serve(r):
        p, k = ranks[r], 0
        try:
            while True:
                req = p.next_request()
                if req is None:
                    return
                slot = k % slots_p
                k += 1
                src = list(range(slot * w.pages, (slot + 1) * w.pages))
                t0 = time.perf_counter()
                posted = [p.post_chunk(req.request, c, src, c + 1 == w.chunks) for c in range(w.chunks)]
                py_time[r] += time.perf_counter() - t0
                for ch in posted:
                    ch.wait(120)
                if not p.decided(req.request).wait(120).complete:
                    rank_errors.append(f"rank {r}: request {req.request} failed")
                p.release(req.request)
                decided[r] += 1
        except Exception as e:
            rank_errors.append(f"rank {r}: {e!r}")

    servers = [threading.Thread(target=serve, args=(r,), daemon=True) for r in range(w.pp)]
    for t in servers:
        t.start()

    def dst(slot):
        return list(range(slot * w.pages, (slot + 1) * w.pages))

    def stream(ids, timeout=120):
        """Runs `ids`, `concurrency` at a time; returns (seconds, latencies, failures)."""
        lat, failed = [], 0
        live = {}
        ids = list(ids)
        t0 = time.perf_counter()
        nxt = 0
        free = list(range(slots_d))
        while nxt < len(ids) or live:
            while free and nxt < len(ids):
                slot = free.pop()
                live[ids[nxt]] = (slot, time.perf_counter(),
                                  decode.expect(ids[nxt], w.prompt, w.chunk, dst(slot), timeout))
                nxt += 1
            done = None
            while done is None:
                for rid, (slot, ts0, pend) in live.items():
                    if pend.done():
                        done = rid
                        break
                else:
                    # The oldest live request's end, waited for with the interpreter detached.
                    oldest = min(live.items(), key=lambda kv: kv[1][1])
                    try:
                        oldest[1][2].wait(0.05)
                    except kvx.Timeout:
                        pass
            slot, ts0, pend = live.pop(done)
            outcome = pend.wait(0)
            lat.append((time.perf_counter() - ts0) * 1e6)
            if not outcome.complete:
                failed += 1
            free.append(slot)
        return time.perf_counter() - t0, lat, failed

    secs, lat, failed = stream(range(1, w.requests + 1))
    # The checked wave, outside the timed window: one request per destination slot. Every rank
    # serves requests in arrival order from its own slot sequence, so the source slot it will use
    # is known: the pattern goes into that slot before decode issues the request.
    served = w.requests
    checked = list(range(w.requests + 1, w.requests + 1 + slots_d))
    verified = 0
    mismatched = 0
    for n, rid in enumerate(checked):
        slot_p = (served + n) % slots_p
        for r in range(w.pp):
            first, count = w.rank_layers(r)
            view = mems[r].view(np.uint64).reshape(count, w.pages * slots_p, -1)
            view[:, slot_p * w.pages:(slot_p + 1) * w.pages, :] = words(
                rid, r, range(first, first + count), w.pages, w.page_bytes // 8)
    dview = dmem.view(np.uint64).reshape(w.layers, w.pages * slots_d, -1)
    dview[:] = np.uint64(0xEEEEEEEEEEEEEEEE)
    # One request at a time, each in slot 0 of decode: its pages are poisoned, then checked.
    for n, rid in enumerate(checked):
        dview[:, :w.pages, :] = np.uint64(0xEEEEEEEEEEEEEEEE)
        outcome = decode.expect(rid, w.prompt, w.chunk, dst(0), 120).wait(180)
        if not outcome.complete:
            failed += 1
            continue
        ok = True
        for r in range(w.pp):
            first, count = w.rank_layers(r)
            want = words(rid, r, range(first, first + count), w.pages, w.page_bytes // 8)
            ok &= bool(np.array_equal(dview[first:first + count, :w.pages, :], want))
        verified += ok
        mismatched += not ok
    report_stats = decode.stats()
    # Decode's Complete can come before every rank has the other ranks' votes: closing decode
    # then would fail the decisions still open on a rank. So every rank's last decision first.
    total = w.requests + len(checked)
    deadline = time.monotonic() + 60
    while min(decided) < total and not rank_errors and time.monotonic() < deadline:
        time.sleep(0.01)
    # Decode closes every rank (their next_request returns None and their threads end), then the
    # ranks stop.
    decode.shutdown(10)
    for t in servers:
        t.join(10)
    for p in ranks:
        p.close()
    if rank_errors:
        print(f"kvx.bench {backend}: {rank_errors[:3]}", file=sys.stderr)
    ok = w.requests - failed if failed <= w.requests else 0
    lat.sort()
    chunks_total = w.pp * w.chunks * (w.requests + len(checked))
    return {
        "backend": backend,
        "gbps": ok * w.request_bytes / secs / 1e9,
        "requests_per_s": ok / secs,
        "latency_p50_us": lat[len(lat) // 2] if lat else 0.0,
        "latency_p99_us": lat[min(len(lat) - 1, round((len(lat) - 1) * 0.99))] if lat else 0.0,
        "chunks_per_s": ok * w.chunks * w.pp / secs,
        # As kvbench counts them: one coalesced write per layer of each chunk.
        "writes_per_s": ok * w.chunks * w.layers / secs,
        "py_us_per_chunk": sum(py_time) / chunks_total * 1e6,
        "requests": w.requests + len(checked),
        "failed": failed + len(rank_errors),
        "verified": verified == len(checked) and mismatched == 0 and failed == 0 and not rank_errors,
        "verified_requests": verified,
        "decode_completed": report_stats["completed"],
    }


def find_kvbench(given):
    if given:
        return given
    for c in (os.environ.get("KVBENCH"), shutil.which("kvbench"), "target/release/kvbench"):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def kvbench_rows(path, w, backend):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "kvbench.json")
        cmd = [path, *w.kvbench_args(), "--backend", backend, "--json", out]
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)


def print_table(w, rows):
    print(f"kvx.bench: {w.layers} layers x {w.bytes_per_token} B/token/layer, {w.page_tokens}-token "
          f"pages, PP={w.pp}, {w.prompt}-token prompts in {w.chunk}-token chunks, "
          f"{w.requests} requests {w.concurrency} at a time")
    head = ("backend", "GB/s", "base GB/s", "ratio", "strm r", "vs nixl", "req/s", "lat p50us",
            "lat p99us", "cmpl p50us", "cmpl p99us", "chunks/s", "writes/s", "verified",
            "py us/chunk", "vs kvbench")
    print(f"{head[0]:<12} {head[1]:>8} {head[2]:>9} {head[3]:>6} {head[4]:>7} {head[5]:>7} "
          f"{head[6]:>9} {head[7]:>10} {head[8]:>10} {head[9]:>11} {head[10]:>11} {head[11]:>10} "
          f"{head[12]:>10} {head[13]:>8} {head[14]:>11} {head[15]:>10}")

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in rows:
        print(f"{r['backend']:<12} {r['gbps']:>8.2f} {f(r.get('baseline_gbps'), '.2f'):>9} "
              f"{f(r.get('ratio'), '.3f'):>6} {f(r.get('stream_ratio'), '.3f'):>7} "
              f"{f(r.get('vs_nixl') or None, '.2f'):>7} {r['requests_per_s']:>9.2f} "
              f"{r['latency_p50_us']:>10.0f} {r['latency_p99_us']:>10.0f} "
              f"{f(r.get('complete_p50_us'), '.1f'):>11} {f(r.get('complete_p99_us'), '.1f'):>11} "
              f"{r['chunks_per_s']:>10.0f} {r['writes_per_s']:>10.0f} "
              f"{'yes' if r['verified'] else 'no':>8} {f(r.get('py_us_per_chunk'), '.1f'):>11} "
              f"{f(r.get('vs_kvbench'), '.3f'):>10}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvx.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["ucx", "nixl", "all"], default="all")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--bytes-per-token", type=int, default=576)
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--chunk-tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--kvbench", help="kvbench binary to compare with (default: KVBENCH, PATH, "
                    "target/release/kvbench)")
    ap.add_argument("--no-kvbench", action="store_true", help="do not run kvbench")
    ap.add_argument("--json", help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    if min(a.layers, a.bytes_per_token, a.page_tokens, a.pp, a.prompt_tokens, a.chunk_tokens,
           a.requests) <= 0 or a.pp > a.layers or a.bytes_per_token * a.page_tokens % 8:
        ap.error("sizes must be positive, --pp at most --layers, pages a multiple of 8 bytes")
    w = Workload(a)
    backends = ["ucx", "nixl"] if a.backend == "all" else [a.backend]
    secret = os.urandom(32)
    kvbench = None if a.no_kvbench else find_kvbench(a.kvbench)
    if not a.no_kvbench and kvbench is None:
        print("kvx.bench: no kvbench binary found (give --kvbench PATH or --no-kvbench)",
              file=sys.stderr)
        return 2
    rows = []
    for b in backends:
        ref = None
        if kvbench:
            ref = kvbench_rows(kvbench, w, b)[0]
            ref["backend"] = f"{b} kvbench"
            rows.append(ref)
        row = run(w, b, secret)
        row["backend"] = f"{b} python"
        if ref:
            row["baseline_gbps"] = ref.get("baseline_gbps")
            if row["baseline_gbps"]:
                row["ratio"] = row["gbps"] / row["baseline_gbps"]
            row["vs_kvbench"] = row["gbps"] / ref["gbps"] if ref["gbps"] else None
        rows.append(row)
    print_table(w, rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    bad = [r for r in rows if r.get("failed") or not r.get("verified")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
