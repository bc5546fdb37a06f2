"""A small cluster of kvx engines in one process (one decode, PP prefill ranks), and byte patterns
unique to each request, rank, layer and page, for the tests of the kvx package."""

import os
import threading

import numpy as np
import pytest

import kvx
from kvx.bench import mesh_sockets  # noqa: F401 (vote mesh sockets for in-process ranks)

POISON = 0xEE


# The lowest port SGLang draws for a server's NCCL port (`get_free_port_below_ephemeral`).
SGLANG_NCCL_PORTS_FROM = 22000


def free_addrs(n):
    """`n` loopback addresses whose ports were free a moment ago, for servers in other processes.

    Drawn below the kernel's ephemeral range: every outgoing connection on the host takes a port
    from that range, so a port drawn from it and released can be taken before our server binds it.
    Below it only another explicit bind can take one; and below 22000, because SGLang 0.5.23 draws
    each server's NCCL port from 22000 to 29999 and binds it later (a fresh-clone run of the suite
    lost every test_sglang_servers.py test to a normal server whose port 24313, in that range,
    was bound by another process before it bound it)."""
    import random
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = min(int(f.read().split()[0]), SGLANG_NCCL_PORTS_FROM)
    found = []
    for port in random.sample(range(10000, max(low, 10002)), k=min(64 * n, max(low, 10002) - 10000)):
        if len(found) == n:
            break
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(f"127.0.0.1:{port}")
    assert len(found) == n, f"found {len(found)} of {n} free ports below {low}"
    return found


def pattern(request, rank, layer, index, n):
    """The n bytes of page `index` (position in the request) of `layer`, as rank `rank` sends them
    for `request`: different for every request, rank, layer and page."""
    return np.random.default_rng([request, rank, layer, index]).integers(
        0, 256, n, dtype=np.uint8
    )


class Cluster:
    """One decode engine and `pp` prefill ranks over numpy pools, started in this process."""

    def __init__(self, backend, layers=4, pp=2, page_tokens=16, bytes_per_token=64,
                 decode_pages=64, prefill_pages=32, secret=b"kvx-test-secret", **decode_kw):
        self.backend, self.layers, self.pp = backend, layers, pp
        self.page_tokens = page_tokens
        self.page_bytes = page_tokens * bytes_per_token
        self.dlayout = kvx.Layout(first_layer=0, num_layers=layers, page_bytes=self.page_bytes,
                                  num_pages=decode_pages)
        self.dmem = np.zeros(self.dlayout.buffer_len, dtype=np.uint8)
        tag = f"{os.getpid()}-{id(self)}"
        self.decode = kvx.DecodeEngine(
            layout=self.dlayout, total_layers=layers, page_tokens=page_tokens, pp_size=pp,
            memory=self.dmem, secret=secret, backend=backend, engine_id=f"decode-{tag}", **decode_kw)
        socks, peers = mesh_sockets(pp)
        per = layers // pp
        self.layouts = [kvx.Layout(first_layer=r * per, num_layers=per,
                                   page_bytes=self.page_bytes, num_pages=prefill_pages)
                        for r in range(pp)]
        self.mems = [np.zeros(l.buffer_len, dtype=np.uint8) for l in self.layouts]
        self.prefill = [None] * pp
        errors = []

        def start(r):
            try:
                self.prefill[r] = kvx.PrefillEngine(
                    decode=self.decode.address, pp_rank=r, pp_size=pp, layout=self.layouts[r],
                    total_layers=layers, page_tokens=page_tokens, memory=self.mems[r],
                    peers=peers, mesh_socket=socks[r], secret=secret, backend=backend,
                    engine_id=f"prefill-{r}-{tag}",
                    request_wait=2.0)
            except Exception as e:  # reported below, in the test's thread
                errors.append(e)

        # Ranks connect to each other as they start: start them side by side.
        threads = [threading.Thread(target=start, args=(r,)) for r in range(pp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self.decode.wait_for_ranks(10)

    def prepare(self, request, src_pages, dst_pages):
        """Writes `request`'s pattern into every rank's source pages and poisons the destination."""
        for r, (layout, mem) in enumerate(zip(self.layouts, self.mems)):
            for layer in range(layout.first_layer, layout.first_layer + layout.num_layers):
                for i, p in enumerate(src_pages):
                    at = layout.offset(layer, p)
                    mem[at:at + self.page_bytes] = pattern(request, r, layer, i, self.page_bytes)
        for layer in range(self.layers):
            for p in dst_pages:
                at = self.dlayout.offset(layer, p)
                self.dmem[at:at + self.page_bytes] = POISON

    def mismatches(self, request, dst_pages, dmem=None):
        """(layer, page) pairs of `request` whose bytes in decode's pool (or `dmem`, a pool of
        the same layout) are not its pattern."""
        dmem = self.dmem if dmem is None else dmem
        bad = []
        per = self.layers // self.pp
        for layer in range(self.layers):
            rank = layer // per
            for i, p in enumerate(dst_pages):
                at = self.dlayout.offset(layer, p)
                want = pattern(request, rank, layer, i, self.page_bytes)
                if not np.array_equal(dmem[at:at + self.page_bytes], want):
                    bad.append((layer, p))
        return bad

    def send_all(self, request, src_pages, ranks=None, skip_last_of=()):
        """Every chunk of `request` from each rank in `ranks` (all by default), except the last chunk
        of the ranks in `skip_last_of`."""
        for r in (range(self.pp) if ranks is None else ranks):
            p = self.prefill[r]
            req = p.next_request(10)
            assert req is not None and req.request == request, req
            for c in range(req.chunks):
                last = c + 1 == req.chunks
                if last and r in skip_last_of:
                    break
                p.send_chunk(request, c, src_pages, last)

    def close(self):
        for p in self.prefill:
            if p is not None:
                p.close()
        try:
            self.decode.shutdown(5)
        except kvx.ShutdownError:
            pass


@pytest.fixture(params=["ucx", "nixl"])
def backend(request):
    return request.param


@pytest.fixture
def cluster(backend):
    c = Cluster(backend)
    yield c
    c.close()
