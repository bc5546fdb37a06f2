"""The kvx package against real UCX and NIXL: bytes, outcomes, aborts, the interpreter lock."""

import asyncio
import threading
import time

import numpy as np
import pytest

import kvx
from conftest import POISON, Cluster, mesh_sockets, pattern


def test_requests_arrive_byte_for_byte(cluster):
    src = list(range(8))  # 128 tokens of 16-token pages
    for n, request in enumerate([11, 12, 13]):
        dst = [40 - 8 * n + i for i in range(8)]
        cluster.prepare(request, src, dst)
        assert cluster.mismatches(request, dst), "the poisoned pages already match"
        pending = cluster.decode.expect(request, 128, 32, dst, timeout=10)
        cluster.send_all(request, src)
        outcome = pending.wait(10)
        assert outcome.complete and outcome.reason is None, outcome
        assert cluster.mismatches(request, dst) == []
        for p in cluster.prefill:
            assert p.decided(request).wait(10).complete
            p.release(request)
    assert cluster.decode.stats()["completed"] == 3


def test_missing_last_chunk_of_one_rank_never_completes(cluster):
    src, dst = list(range(8)), list(range(8, 16))
    cluster.prepare(21, src, dst)
    # 3 s: longer than sending the other chunks takes on a loaded machine.
    pending = cluster.decode.expect(21, 128, 32, dst, timeout=3.0)
    cluster.send_all(21, src, skip_last_of={1})
    outcome = pending.wait(10)
    assert not outcome.complete
    assert outcome.reason == "timeout", outcome
    with pytest.raises(kvx.TransferFailed) as e:
        outcome.raise_for_failure()
    assert e.value.reason == "timeout" and e.value.request == 21


def test_decode_abort_fails_the_request_on_both_sides(cluster):
    src, dst = list(range(8)), list(range(16, 24))
    pending = cluster.decode.expect(31, 128, 32, dst, timeout=10)
    for p in cluster.prefill:
        assert p.next_request(10).request == 31
    cluster.decode.abort(31)
    outcome = pending.wait(10)
    assert outcome.reason == "aborted", outcome
    for p in cluster.prefill:
        decision = p.decided(31).wait(10)
        assert not decision.complete, decision
        with pytest.raises(kvx.KvxError):
            p.send_chunk(31, 0, src, False)


def test_prefill_failure_is_typed_on_decode(cluster):
    src, dst = list(range(8)), list(range(24, 32))
    pending = cluster.decode.expect(41, 128, 32, dst, timeout=10)
    for p in cluster.prefill:
        assert p.next_request(10).request == 41
    cluster.prefill[1].fail(41, "out_of_resources")
    outcome = pending.wait(10)
    assert (outcome.reason, outcome.rank, outcome.code) == ("peer_failed", 1, "out_of_resources")
    assert isinstance(outcome.error(), kvx.TransferFailed)


def test_await_resolves_in_the_event_loop(cluster):
    src, dst = list(range(8)), list(range(32, 40))
    cluster.prepare(51, src, dst)

    async def run():
        pending = cluster.decode.expect(51, 128, 32, dst, timeout=10)
        await asyncio.get_running_loop().run_in_executor(None, cluster.send_all, 51, src)
        return await pending

    outcome = asyncio.run(run())
    assert outcome.complete
    assert cluster.mismatches(51, dst) == []


class Counting:
    """A thread that records the instants it runs at, from `with` until its end."""

    def __enter__(self):
        self.ticks, self.stop = [], threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.is_set():
            self.ticks.append(time.monotonic())

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        return False


def longest_gap(ticks, t0, t1):
    """The longest time in [t0, t1] during which the counting thread did not run."""
    inside = [t0] + [x for x in ticks if t0 < x < t1] + [t1]
    return max(b - a for a, b in zip(inside, inside[1:]))


def test_waits_release_the_interpreter(cluster):
    """Another Python thread runs while this one waits on the engine."""
    with Counting() as counter:
        pending = cluster.decode.expect(61, 128, 32, list(range(40, 48)), timeout=10)
        time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(kvx.Timeout):
            pending.wait(2.0)  # nothing is sent: the wait runs to its bound
        t1 = time.monotonic()
    ticks = counter.ticks
    assert t1 - t0 >= 2.0
    # Held for the whole wait, the lock would stop the counter for about 2 s; detached, it counts
    # all along (a gap is a switch interval or a scheduling delay; the bound, half the wait, leaves
    # room for a slow one on a busy machine and none for the lock).
    assert longest_gap(ticks, t0, t1) < 1.0
    cluster.decode.abort(61)


def test_long_transfer_releases_the_interpreter(backend):
    """Requests of 256 MiB per rank: a counting thread keeps running while this one waits for their
    chunks and outcomes. (Four requests of 64 MiB per rank once took 0.08 s over NIXL, too short to
    tell; at 256 MiB, six runs here took 0.23 to 1.9 s.)"""
    c = Cluster(backend, layers=16, pp=2, page_tokens=256, bytes_per_token=2048,
                decode_pages=64, prefill_pages=64)
    counter = Counting().__enter__()
    try:
        src = dst = list(range(64))
        t0 = time.monotonic()
        for request in range(71, 75):
            pending = c.decode.expect(request, 64 * 256, 4096, dst, timeout=60)
            for p in c.prefill:
                assert p.next_request(10).request == request
            chunks = [p.post_chunk(request, k, src, k == 3) for k in range(4) for p in c.prefill]
            for ch in chunks:
                ch.wait(60)
            assert pending.wait(60).complete
            for p in c.prefill:
                assert p.decided(request).wait(10).complete
                p.release(request)
        t1 = time.monotonic()
    finally:
        counter.__exit__(None, None, None)
        c.close()
    ticks = counter.ticks
    assert t1 - t0 >= 0.1, ("too short to tell", t1 - t0)
    assert longest_gap(ticks, t0, t1) < 0.5 * (t1 - t0), (longest_gap(ticks, t0, t1), t1 - t0)


def test_a_hello_refused_for_good_is_told_apart_from_a_failed_connection(backend):
    """A prefill rank whose pages decode cannot map (another size per token) is refused in the
    handshake for good: its ControlError's cause is "refused", which callers that try again
    (kvx.sglang's link to an announced decode) take as final; a decode that is not there is a
    plain "control" failure."""
    c = Cluster(backend, pp=1)
    try:
        layout = kvx.Layout(first_layer=0, num_layers=4, page_bytes=2 * c.page_bytes, num_pages=8)
        with pytest.raises(kvx.ControlError) as e:
            kvx.PrefillEngine(decode=c.decode.address, pp_rank=0, pp_size=1, layout=layout,
                              total_layers=4, page_tokens=16,
                              memory=np.zeros(layout.buffer_len, np.uint8),
                              secret=b"kvx-test-secret", backend=backend, connect_timeout=5)
        assert e.value.cause == "refused", (e.value.cause, e.value)
        gone = c.decode.address
    finally:
        c.close()
    with pytest.raises(kvx.ControlError) as e:
        kvx.PrefillEngine(decode=gone, pp_rank=0, pp_size=1, layout=layout, total_layers=4,
                          page_tokens=16, memory=np.zeros(layout.buffer_len, np.uint8),
                          secret=b"kvx-test-secret", backend=backend, connect_timeout=1)
    assert e.value.cause == "control", (e.value.cause, e.value)


def test_wrong_secret_is_refused(backend):
    c = Cluster(backend, pp=1)
    try:
        layout = kvx.Layout(first_layer=0, num_layers=4, page_bytes=c.page_bytes, num_pages=8)
        with pytest.raises(kvx.ControlError) as e:
            kvx.PrefillEngine(decode=c.decode.address, pp_rank=0, pp_size=1, layout=layout,
                              total_layers=4, page_tokens=16, memory=np.zeros(layout.buffer_len, np.uint8),
                              secret=b"not the secret", backend=backend, connect_timeout=5)
        assert e.value.cause in ("auth", "control"), e.value.cause
        # Decode counts the refusal once its Reject is out, which the prefill may read first.
        deadline = time.monotonic() + 10
        while c.decode.stats()["auth_failures"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.decode.stats()["auth_failures"] >= 1
    finally:
        c.close()


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(kvx.ConfigError, match="positive"):
        kvx.Layout(first_layer=0, num_layers=0, page_bytes=1024, num_pages=4)
    layout = kvx.Layout(first_layer=0, num_layers=2, page_bytes=1024, num_pages=4)
    kw = dict(layout=layout, total_layers=2, page_tokens=16, pp_size=1)
    with pytest.raises(ValueError, match="backend"):
        kvx.DecodeEngine(memory=np.zeros(layout.buffer_len, np.uint8), backend="rdma", **kw)
    with pytest.raises(kvx.ConfigError, match="memory holds"):
        kvx.DecodeEngine(memory=np.zeros(100, np.uint8), **kw)
    with pytest.raises(kvx.ConfigError, match="read-only"):
        kvx.DecodeEngine(memory=bytes(layout.buffer_len), **kw)
    # Separate regions must split the layout (8 KiB) into equal segments, each long enough.
    with pytest.raises(kvx.ConfigError, match="shorter than"):
        kvx.DecodeEngine(memory=[(0x10000, 6144), (0x30000, 2048)], **kw)
    with pytest.raises(kvx.ConfigError, match="equal regions"):
        kvx.DecodeEngine(memory=[(0x10000, 4096), (0x30000, 4096), (0x50000, 4096)], **kw)
    with pytest.raises(kvx.ConfigError, match="contiguous"):
        kvx.DecodeEngine(memory=np.zeros((layout.buffer_len, 2), np.uint8)[:, 0], **kw)
    with pytest.raises(kvx.ConfigError, match="listen"):
        kvx.DecodeEngine(memory=np.zeros(layout.buffer_len, np.uint8), listen="nowhere", **kw)
    with pytest.raises(kvx.ConfigError, match="landing_slots"):
        kvx.DecodeEngine(memory=np.zeros(layout.buffer_len, np.uint8), landing_slots=0, **kw)
    with pytest.raises(kvx.ConfigError, match="seconds"):
        kvx.DecodeEngine(memory=np.zeros(layout.buffer_len, np.uint8), abort_ack_timeout=-1, **kw)
    with pytest.raises(kvx.ConfigError, match="pp_rank"):
        kvx.PrefillEngine(decode="127.0.0.1:1", pp_rank=2, pp_size=2, layout=layout, total_layers=2,
                          page_tokens=16, memory=np.zeros(layout.buffer_len, np.uint8))



def test_a_decode_engine_runs_its_progress_thread_realtime_when_asked(backend):
    """``progress_fifo`` puts the engine's progress thread under SCHED_FIFO at that priority (read
    back from /proc for that thread); without it the thread keeps the normal policy; a priority
    outside 1..=99 is refused and nothing starts."""
    from proc_threads import SCHED_FIFO, SCHED_OTHER, own_threads_named

    layout = kvx.Layout(first_layer=0, num_layers=2, page_bytes=1024, num_pages=4)
    kw = dict(layout=layout, total_layers=2, page_tokens=16, pp_size=1, backend=backend)
    thread = f"{backend}-pyfifo"
    fifo = kvx.DecodeEngine(memory=np.zeros(layout.buffer_len, np.uint8), engine_id="pyfifo4",
                            progress_fifo=4, progress_spin_us=0, **kw)
    normal = kvx.DecodeEngine(memory=np.zeros(layout.buffer_len, np.uint8), engine_id="pyfifon",
                              **kw)
    try:
        assert own_threads_named(f"{thread}4") == [(f"{thread}4", SCHED_FIFO, 4)]
        assert own_threads_named(f"{thread}n") == [(f"{thread}n", SCHED_OTHER, 0)]
    finally:
        fifo.shutdown(5)
        normal.shutdown(5)
    for bad in (0, 100):
        with pytest.raises(kvx.TransportError, match="progress thread"):
            kvx.DecodeEngine(memory=np.zeros(layout.buffer_len, np.uint8), engine_id="pyfifob",
                             progress_fifo=bad, **kw)
    # The refused threads were joined; the kernel may list an exiting thread a moment longer.
    deadline = time.monotonic() + 10
    while own_threads_named(f"{thread}b") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert own_threads_named(f"{thread}b") == []


def test_a_mesh_socket_holds_its_port_and_must_be_the_ranks_own_entry():
    import socket

    mine, other = kvx.MeshSocket(), kvx.MeshSocket("127.0.0.1:0")
    host, port = mine.address.rsplit(":", 1)
    with socket.socket() as s, pytest.raises(OSError):
        s.bind((host, int(port)))
    layout = kvx.Layout(first_layer=0, num_layers=2, page_bytes=1024, num_pages=4)
    with pytest.raises(kvx.ConfigError, match="mesh socket is on port"):
        kvx.PrefillEngine(decode="127.0.0.1:1", pp_rank=0, pp_size=2, layout=layout,
                          total_layers=4, page_tokens=16, memory=np.zeros(layout.buffer_len, np.uint8),
                          peers=[mine.address, other.address], mesh_socket=other)
    with pytest.raises(kvx.ConfigError, match="resolve"):
        kvx.MeshSocket("no-such-host.invalid:0")



def test_a_request_waits_for_an_absent_rank_then_fails_naming_it():
    layout = kvx.Layout(first_layer=0, num_layers=2, page_bytes=1024, num_pages=4)
    d = kvx.DecodeEngine(layout=layout, total_layers=2, page_tokens=16, pp_size=2,
                         memory=np.zeros(layout.buffer_len, np.uint8), rank_wait=0.2)
    t = time.monotonic()
    outcome = d.expect(1, 32, 16, [0, 1], timeout=30).wait(10)
    assert not outcome.complete
    with pytest.raises(kvx.TransferFailed) as e:
        outcome.raise_for_failure()
    assert (e.value.reason, e.value.rank) == ("rank_unavailable", 0)
    assert 0.2 <= time.monotonic() - t < 5
    s = d.stats()
    assert (s["failed"], s["failed_rank_unavailable"]) == (1, 1)
    # Its pages were never asked for: free again at once.
    d.expect(2, 32, 16, [0, 1], timeout=0.1)
    d.shutdown(1.0)


def test_page_lists_are_checked(cluster):
    with pytest.raises(kvx.ConfigError):
        cluster.decode.expect(81, 128, 32, list(range(1000, 1008)), timeout=5)
    with pytest.raises(kvx.ConfigError):
        cluster.decode.expect(82, 128, 32, [1, 1, 2, 3, 4, 5, 6, 7], timeout=5)
    pending = cluster.decode.expect(83, 128, 32, list(range(8)), timeout=5)
    with pytest.raises(kvx.PageHeld) as e:
        cluster.decode.expect(84, 128, 32, list(range(4, 12)), timeout=5)
    assert e.value.by == 83
    cluster.decode.abort(83)
    assert pending.wait(10).reason == "aborted"


def test_a_decode_prefix_reaches_every_rank(cluster):
    """Decode already holds the first 64 tokens (a prefix cache of its own): it asks for the 128
    after them, and every rank is told where they start; a prefix that is not whole pages is
    refused."""
    src, dst = list(range(8)), list(range(32, 40))
    cluster.prepare(85, src, dst)
    pending = cluster.decode.expect(85, 128, 32, dst, timeout=10, prefix_tokens=64)
    for p in cluster.prefill:
        got = p.next_request(10)
        assert (got.request, got.prompt_tokens, got.prefix_tokens) == (85, 128, 64), got
        for c in range(got.chunks):
            p.send_chunk(85, c, src, c + 1 == got.chunks)
    assert pending.wait(10).complete
    assert cluster.mismatches(85, dst) == []
    with pytest.raises(kvx.ConfigError, match="whole pages"):
        cluster.decode.expect(86, 128, 32, list(range(40, 48)), timeout=5, prefix_tokens=24)
    # Decode holds the whole prompt: one chunk of no pages, whose notification (and the aux
    # payload before it) ends the request.
    pending = cluster.decode.expect(87, 0, 32, [], timeout=10, prefix_tokens=128)
    for r, p in enumerate(cluster.prefill):
        got = p.next_request(10)
        assert (got.request, got.prompt_tokens, got.prefix_tokens, got.chunks) == (87, 0, 128, 1)
        p.send_aux(87, b"first token %d" % r)
        p.send_chunk(87, 0, [], True)
    assert pending.wait(10).complete
    # The payload travels on the control connection, beside the pages: it may come just after
    # the completion (as SGLang's receiver allows for).
    deadline = time.monotonic() + 5
    got = cluster.decode.aux(87, 1)
    while got is None and time.monotonic() < deadline:
        time.sleep(0.01)
        got = cluster.decode.aux(87, 1)
    assert got == b"first token 1"
    with pytest.raises(kvx.ConfigError):
        cluster.decode.expect(88, 0, 32, [], timeout=5)


def test_unknown_request_on_prefill(cluster):
    with pytest.raises(kvx.UnknownRequest):
        cluster.prefill[0].send_chunk(999, 0, list(range(8)), False)


def test_shutdown_hands_memory_back_only_when_ranks_confirm(backend):
    c = Cluster(backend)
    report = c.decode.shutdown(5)
    assert report["pool_freed"] is True and sorted(report["confirmed"] + report["gone"]) == [("", 0), ("", 1)], report
    with pytest.raises(kvx.ShutdownError):
        c.decode.expect(1, 128, 32, list(range(8)))
    for p in c.prefill:
        p.close()


def test_bench_runs_and_verifies(tmp_path):
    """python -m kvx.bench on a small workload: exit 0, both rows verified."""
    import json
    import subprocess
    import sys

    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "kvx.bench", "--no-kvbench", "--requests", "3",
                        "--prompt-tokens", "1024", "--chunk-tokens", "256", "--layers", "8",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert [x["backend"] for x in rows] == ["ucx python", "nixl python"]
    assert all(x["verified"] and x["verified_requests"] == 2 and x["failed"] == 0 for x in rows), rows


def test_one_registration_per_layer_and_kv(backend):
    """Pools given as one buffer per layer and per K and V (as SGLang allocates them), not adjacent:
    each is registered on its own and every byte lands in the right buffer."""
    layers, pp, page_tokens, pages, page_bytes = 4, 2, 16, 16, 1024
    dl = kvx.Layout(first_layer=0, num_layers=layers, page_bytes=page_bytes, num_pages=pages,
                    split_kv=True)
    # K of every layer, then V of every layer; a spacer between buffers keeps them apart.
    spacers, dbufs = [], []
    for _ in range(2 * layers):
        dbufs.append(np.full((pages, page_bytes), POISON, np.uint8))
        spacers.append(np.zeros(4096, np.uint8))
    regions = [(b.ctypes.data, b.nbytes) for b in dbufs]
    assert any(regions[i + 1][0] != regions[i][0] + regions[i][1] for i in range(len(regions) - 1))
    decode = kvx.DecodeEngine(layout=dl, total_layers=layers, page_tokens=page_tokens, pp_size=pp,
                              memory=regions, secret=b"s", backend=backend,
                              engine_id=f"regions-decode-{backend}")
    socks, peers = mesh_sockets(pp)
    per = layers // pp
    ranks, pbufs = [None] * pp, []
    for r in range(pp):
        pbufs.append([np.zeros((8, page_bytes), np.uint8) for _ in range(2 * per)])

    def start(r):
        pl = kvx.Layout(first_layer=r * per, num_layers=per, page_bytes=page_bytes, num_pages=8,
                        split_kv=True)
        ranks[r] = kvx.PrefillEngine(
            decode=decode.address, pp_rank=r, pp_size=pp, layout=pl, total_layers=layers,
            page_tokens=page_tokens, memory=[(b.ctypes.data, b.nbytes) for b in pbufs[r]],
            peers=peers, mesh_socket=socks[r], secret=b"s", backend=backend,
            engine_id=f"regions-prefill-{r}-{backend}")

    threads = [threading.Thread(target=start, args=(r,)) for r in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        decode.wait_for_ranks(10)
        src, dst = [7, 3, 5, 1], [12, 2, 9, 4]
        for r in range(pp):
            for k in range(2):
                for l in range(per):
                    for i, p in enumerate(src):
                        pbufs[r][k * per + l][p] = pattern(91, r, r * per + l + 100 * k, i, page_bytes)
        pending = decode.expect(91, 64, 32, dst, timeout=10)
        for p in ranks:
            assert p.next_request(10).request == 91
            for c in range(2):
                p.send_chunk(91, c, src, c == 1)
        assert pending.wait(10).complete
        for k in range(2):
            for l in range(layers):
                buf = dbufs[k * layers + l]
                for i, p in enumerate(dst):
                    want = pattern(91, l // per, l + 100 * k, i, page_bytes)
                    assert np.array_equal(buf[p], want), (k, l, p)
                for p in set(range(pages)) - set(dst):
                    assert (buf[p] == POISON).all(), (k, l, p)
    finally:
        for p in ranks:
            if p is not None:
                p.close()
        decode.shutdown(5)


def test_aux_payload_travels_beside_the_pages(cluster):
    src, dst = list(range(8)), list(range(48, 56))
    cluster.prepare(95, src, dst)
    pending = cluster.decode.expect(95, 128, 32, dst, timeout=10)
    rows = {}
    for r, p in enumerate(cluster.prefill):
        assert p.next_request(10).request == 95
        rows[r] = bytes(pattern(95, r, 1000, 0, 200))
        p.send_aux(95, rows[r])
        for c in range(4):
            p.send_chunk(95, c, src, c == 3)
    assert pending.wait(10).complete
    deadline = time.monotonic() + 5
    got = {}
    while len(got) < len(rows) and time.monotonic() < deadline:
        for r in rows:
            if r not in got:
                d = cluster.decode.aux(95, r)
                if d is not None:
                    got[r] = d
        time.sleep(0.01)
    assert got == rows
    assert cluster.decode.aux(95, 0) is None  # taken once
    with pytest.raises(kvx.ConfigError):
        cluster.prefill[0].send_aux(96, bytes(64 * 1024 + 1))


def test_one_prefill_rank_serves_a_second_decode_engine(cluster):
    """Each rank links a second decode engine (its own pool) to its one engine: requests of both
    decodes arrive on it, named by decode, and land byte for byte in their own decode's pool."""
    dmem2 = np.full(cluster.dlayout.buffer_len, POISON, dtype=np.uint8)
    d2 = kvx.DecodeEngine(
        layout=cluster.dlayout, total_layers=cluster.layers, page_tokens=cluster.page_tokens,
        pp_size=cluster.pp, memory=dmem2, secret=b"kvx-test-secret", backend=cluster.backend,
        engine_id=f"decode2-{id(dmem2)}")
    try:
        for p in cluster.prefill:
            assert p.add_decode(d2.address) == 1
            assert p.add_decode(d2.address) == 1  # already served: the same link
            assert sorted(n for n, _ in p.decodes) == [0, 1]
            assert p.stats()["decodes"] == 2
        d2.wait_for_ranks(10)
        src, dst1, dst2 = list(range(8)), list(range(8)), list(range(16, 24))
        cluster.prepare(61, src, dst1)
        one = cluster.decode.expect(61, 128, 32, dst1, timeout=10)
        two = d2.expect(62, 128, 32, dst2, timeout=10)
        for p in cluster.prefill:
            got = sorted((r.request, r.decode) for r in (p.next_request(10), p.next_request(10)))
            assert got == [(61, 0), (62, 1)], got
        # The same source pages (request 61's pattern) go to both decodes.
        for p in cluster.prefill:
            for c in range(4):
                p.send_chunk(61, c, src, c == 3)
                p.send_chunk(62, c, src, c == 3)
        assert one.wait(10).complete and two.wait(10).complete
        assert cluster.mismatches(61, dst1) == []
        assert cluster.mismatches(61, dst2, dmem=dmem2) == []
        assert cluster.mismatches(61, dst2) != [], "decode 1's pages were written for decode 2"
    finally:
        d2.shutdown(5)
    for p in cluster.prefill:
        deadline = time.monotonic() + 10
        while p.stats()["decodes"] != 1:
            assert time.monotonic() < deadline, p.stats()
            time.sleep(0.01)
        assert not p.closed


def test_a_closed_rank_keeps_its_source_memory_while_a_posted_chunk_may_read_it(backend):
    """A chunk posted before decode allocated the request waits for the allocation; the rank is
    closed and every reference of ours to its source array dropped meanwhile. The pool holds the
    array until the chunk's writes are over: decode receives exactly the pattern, and the array goes
    only after that."""
    import gc
    import weakref

    c = Cluster(backend, pp=1, layers=2)
    try:
        request, src, dst = 91, list(range(4)), list(range(10, 14))
        c.prepare(request, src, dst)
        rank = c.prefill[0]
        gone = weakref.ref(c.mems[0])
        chunk = rank.post_chunk(request, 0, src, True)
        rank.close()
        c.mems[0] = None
        gc.collect()
        assert gone() is not None, "the source array was released under a posted chunk"
        pending = c.decode.expect(request, 64, 64, dst, timeout=10)
        assert chunk.wait(10) is None
        assert pending.wait(10).complete
        assert c.mismatches(request, dst) == []
        del chunk, rank
        c.prefill[0] = None
        deadline = time.monotonic() + 10
        while gone() is not None and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.05)
        assert gone() is None, "the source array outlived every handle to its engine"
    finally:
        c.close()


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1)])
def test_head_sliced_tp_writes_each_head_from_the_rank_that_holds_it(backend, prefill_tp,
                                                                     decode_tp):
    """Prefill TP 2 into decode TP 1 (GQA, 2 KV heads, token-major pages as SGLang keeps them):
    each decode page's token rows hold head 0 from prefill TP rank 0 and head 1 from rank 1, byte
    for byte, on poisoned pages; one engine per side, the decode serving the instance's two TP
    ranks as its sources."""
    layers, page_tokens, head_bytes, kv_heads = 2, 16, 64, 2
    secret = b"tp-test-secret"
    dheads = kv_heads // decode_tp
    dlayout = kvx.Layout(first_layer=0, num_layers=layers, page_bytes=page_tokens * dheads * head_bytes,
                         num_pages=16, split_kv=True, heads=dheads, head_bytes=head_bytes)
    dmem = np.full(dlayout.buffer_len, POISON, dtype=np.uint8)
    decode = kvx.DecodeEngine(layout=dlayout, total_layers=layers, page_tokens=page_tokens,
                              pp_size=0, memory=dmem, secret=secret, backend=backend,
                              tp_rank=0, tp_size=decode_tp, tp_mode="head_sliced",
                              kv_heads=kv_heads)
    decode.add_instance("p", 1, tp_size=prefill_tp)
    pheads = kv_heads // prefill_tp
    playout = kvx.Layout(first_layer=0, num_layers=layers,
                         page_bytes=page_tokens * pheads * head_bytes, num_pages=16, split_kv=True,
                         heads=pheads, head_bytes=head_bytes)
    pmems = [np.zeros(playout.buffer_len, dtype=np.uint8) for _ in range(prefill_tp)]
    ranks = []
    try:
        ranks = [kvx.PrefillEngine(decode=decode.address, pp_rank=0, pp_size=1, layout=playout,
                                   total_layers=layers, page_tokens=page_tokens, memory=pmems[r],
                                   secret=secret, backend=backend, instance="p", tp_rank=r,
                                   tp_size=prefill_tp, tp_mode="head_sliced", kv_heads=kv_heads,
                                   engine_id=f"tp-prefill-{r}-{backend}")
                 for r in range(prefill_tp)]
        decode.wait_for_ranks(10, instance="p")
        src, dst = [1, 2, 3], [7, 4, 9]
        # Each prefill rank's pages: a pattern unique to its rank, layer, region and page.
        for r, mem in enumerate(pmems):
            for layer in range(layers):
                for region in range(2):
                    for i, p in enumerate(src):
                        at = playout.offset(layer, p, region)
                        mem[at:at + playout.page_bytes] = pattern(71, r, layer * 2 + region, i,
                                                                  playout.page_bytes)
        pending = decode.expect(71, 48, 16, dst, timeout=10, instance="p")
        for p in ranks:
            req = p.next_request(10)
            assert req.request == 71, req
            for c in range(req.chunks):
                p.send_chunk(71, c, src, c + 1 == req.chunks)
        assert pending.wait(10).complete
        bad = []
        for layer in range(layers):
            for region in range(2):
                for i, p in enumerate(dst):
                    at = dlayout.offset(layer, p, region)
                    page = dmem[at:at + dlayout.page_bytes].reshape(page_tokens, dheads, head_bytes)
                    for h in range(kv_heads):
                        r = h // pheads
                        want = pattern(71, r, layer * 2 + region, i, playout.page_bytes).reshape(
                            page_tokens, pheads, head_bytes)[:, h % pheads]
                        if not np.array_equal(page[:, h], want):
                            bad.append((layer, region, p, h))
        assert bad == [], bad
    finally:
        for p in ranks:
            p.close()
        decode.shutdown(5)


def test_a_scrape_of_the_metrics_endpoint_counts_the_requests(backend):
    """An engine given `metrics` serves Prometheus text on it: after two completed requests and
    one aborted, the decode's counters there say so."""
    import urllib.request

    c = Cluster(backend, metrics="127.0.0.1:0")
    try:
        addr = c.decode.metrics_address
        assert addr and not addr.endswith(":0"), addr
        src = list(range(4))
        for n, request in enumerate([21, 22]):
            dst = [8 * n + i for i in range(4)]
            c.prepare(request, src, dst)
            pending = c.decode.expect(request, 64, 32, dst, timeout=10)
            c.send_all(request, src)
            assert pending.wait(10).complete
        pending = c.decode.expect(23, 64, 32, [40, 41, 42, 43], timeout=10)
        c.decode.abort(23)
        assert not pending.wait(10).complete
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
            assert r.status == 200
            text = r.read().decode()

        def value(name, *labels):
            rows = [l for l in text.splitlines()
                    if l.startswith(name + "{") and 'role="decode"' in l
                    and all(x in l for x in labels)]
            assert len(rows) == 1, (name, labels, text)
            return float(rows[0].rsplit(" ", 1)[1])

        assert value("kvx_requests_total", 'outcome="complete"') == 2
        assert value("kvx_requests_total", 'cause="aborted"') == 1
        assert value("kvx_request_duration_seconds_count", 'outcome="complete"') == 2
        assert value("kvx_registrations", f'backend="{backend}"') == 1
    finally:
        c.close()


@pytest.mark.parametrize("kvx_log,shown", [(None, True), ("off", False)])
def test_the_engines_warnings_reach_stderr_unless_kvx_log_says_otherwise(kvx_log, shown):
    """A prefill rank of two started without a secret warns that its votes can be forged: the
    warning reaches the process's stderr (where a server keeps its log), and `KVX_LOG=off`
    silences it."""
    import os
    import subprocess
    import sys

    script = (
        "import numpy as np, kvx\n"
        "a, b = kvx.MeshSocket(), kvx.MeshSocket()\n"
        "layout = kvx.Layout(first_layer=0, num_layers=2, page_bytes=1024, num_pages=4)\n"
        "try:\n"
        "    kvx.PrefillEngine(decode='127.0.0.1:1', pp_rank=0, pp_size=2, layout=layout,\n"
        "                      total_layers=4, page_tokens=16,\n"
        "                      memory=np.zeros(layout.buffer_len, np.uint8),\n"
        "                      peers=[a.address, b.address], mesh_socket=a, connect_timeout=1)\n"
        "except kvx.KvxError as e:\n"
        "    print('refused:', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "KVX_LOG"}
    if kvx_log is not None:
        env["KVX_LOG"] = kvx_log
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "refused:" in run.stdout, run.stdout + run.stderr
    assert ("no shared secret configured" in run.stderr) == shown, run.stderr
