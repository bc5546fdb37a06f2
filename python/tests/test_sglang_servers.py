"""Real SGLang 0.5.23 servers over kvx: a prefill server and a decode server
(``--disaggregation-transfer-backend kvx``, over UCX and over NIXL) answer every prompt exactly as
one normal server of the same model does, token for token, with both servers answering 200; and
the same check fails for the one request whose moved KV had one byte corrupted on decode
(``KVX_TEST_CORRUPT_ROOM``), so the check reads the moved pages.

The UCX pair's prefill is a pipeline of two PP ranks (``--pp-size 2``), its decode runs two
TokenizerWorker processes (``--tokenizer-worker-num 2``), and its second decode server two TP ranks
(``--tp-size 2``) with pages of 8 tokens (``--page-size 8``), each taking one of the two KV heads
from the prefill's one TP rank and its pages of 16; its third decode server is a pipeline of two PP
stages (``--pp-size 2``), each taking its layer from the prefill PP rank of its stage. The NIXL pair's decode serves a second
prefill server too, through the same kvx engine: one of two TP ranks (``--tp-size 2``) with pages
of 8 tokens whose heads both land in the decode's one rank and its pages of 16.

Requests go to the pair as SGLang's own load balancer sends them (``sglang_servers.pair_generate``).
Prompts run from 1 token to 792 (13 chunks of SGLang's chunked prefill of 64 at page size 16), one
at a time and four at a time. SGLang and its server packages come from ``scripts/provision-sglang``;
without them these tests fail."""

import random
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

import proc_threads as T
import sglang_servers as S
from conftest import free_addrs

LENGTHS = [1, 2, 15, 16, 17, 64, 65, 200, 401, 792]
NEW_TOKENS = 8
SECRET = "sglang-servers-test-secret"


def ports(n):
    return [int(a.rsplit(":", 1)[1]) for a in free_addrs(n)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return S.make_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(19)
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in LENGTHS]


class Pair:
    """A prefill and a decode server on one transfer backend."""

    def __init__(self, name, model, logs, backend, env, three_ports, decode_args=(),
                 second_prefill=None, second_decode=None, prefill_args=(), prefill2_args=(),
                 decode2_args=(), third_decode=None, decode3_args=(), metrics=None):
        prefill_port, decode_port, self.bootstrap_port = three_ports
        # Ports where the prefill's and the decode's kvx engines serve metrics (KVX_METRICS).
        self.metrics = metrics
        p_env, d_env = env, env
        if metrics is not None:
            p_env = {**env, "KVX_METRICS": f"127.0.0.1:{metrics[0]}"}
            # The same decode runs its engine's progress thread under SCHED_FIFO, without spinning.
            d_env = {**env, "KVX_METRICS": f"127.0.0.1:{metrics[1]}", "KVX_PROGRESS_FIFO": "1",
                     "KVX_PROGRESS_SPIN_US": "0"}
        # Servers of several ranks (PP or TP 2) need S.MULTI_RANK_ENV on SGLang's CPU engine.
        self.prefill = S.Server(f"{name}-prefill", model, prefill_port, logs, [
            "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", backend,
            "--disaggregation-bootstrap-port", str(self.bootstrap_port), *prefill_args],
            {**p_env, **S.MULTI_RANK_ENV} if prefill_args else p_env)
        self.decode = S.Server(f"{name}-decode", model, decode_port, logs, [
            "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", backend,
            "--disaggregation-decode-retraction-backup", "cpu_tensor", *decode_args], d_env)
        # A second prefill server (its port and bootstrap port) beside the first, for the same
        # decode server, as a load balancer with several prefill servers uses it.
        self.prefill2 = None
        if second_prefill is not None:
            port, self.bootstrap_port2 = second_prefill
            self.prefill2 = S.Server(f"{name}-prefill2", model, port, logs, [
                "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", backend,
                "--disaggregation-bootstrap-port", str(self.bootstrap_port2), *prefill2_args],
                {**env, **S.MULTI_RANK_ENV} if prefill2_args else env)
        # A second decode server (its port) for the same prefill server.
        self.decode2 = None
        if second_decode is not None:
            self.decode2 = S.Server(f"{name}-decode2", model, second_decode, logs, [
                "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", backend,
                "--disaggregation-decode-retraction-backup", "cpu_tensor", *decode2_args],
                {**env, **S.MULTI_RANK_ENV} if decode2_args else env)
        # A third decode server (its port) for the same prefill server.
        self.decode3 = None
        if third_decode is not None:
            self.decode3 = S.Server(f"{name}-decode3", model, third_decode, logs, [
                "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", backend,
                "--disaggregation-decode-retraction-backup", "cpu_tensor", *decode3_args],
                {**env, **S.MULTI_RANK_ENV} if decode3_args else env)

    def servers(self):
        return [self.prefill, self.decode] + [
            s for s in (self.prefill2, self.decode2, self.decode3) if s]

    def generate(self, ids, room, **extra):
        return S.pair_generate(self.prefill, self.decode, self.bootstrap_port, ids, NEW_TOKENS, room,
                               **extra)

    def generate2(self, ids, room):
        return S.pair_generate(self.prefill2, self.decode, self.bootstrap_port2, ids, NEW_TOKENS,
                               room)

    def generate_d2(self, ids, room):
        return S.pair_generate(self.prefill, self.decode2, self.bootstrap_port, ids, NEW_TOKENS,
                               room)

    def generate_d3(self, ids, room):
        return S.pair_generate(self.prefill, self.decode3, self.bootstrap_port, ids, NEW_TOKENS,
                               room)

    def logs(self):
        return self.prefill.log() + "\n" + self.decode.log()


def run_prompts(pair, prompts, rooms, concurrency):
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(pair.generate, prompts, rooms))


def check(pair, normal, prompts, results, label):
    for n, (ids, want, got) in enumerate(zip(prompts, normal.expected, results)):
        what = f"{label}: prompt {n} ({len(ids)} tokens)"
        assert got["prefill"][0] == 200, f"{what}: prefill {got['prefill']}\n{pair.logs()}"
        assert got["decode"][0] == 200, f"{what}: decode {got['decode']}\n{pair.logs()}"
        assert got["decode"][1]["output_ids"] == want, f"{what}: {got['decode'][1]} != {want}"


BACKENDS = ["ucx", "nixl"]
RELEASE_TIMEOUT_S = 2
# kvx's bound for a prefill rank's confirmation of an abort, after which the outcome goes out and
# the pages stay quarantined (DecodeConfig::abort_ack_timeout).
ABORT_ACK_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def servers(model, logs, prompts):
    """One normal server and a kvx pair per backend, all started at once (their start is CPU-bound
    imports: together they are ready sooner than one after another); the normal server's greedy
    tokens for every prompt."""
    # Drawn in one call, so no two servers are given the same port.
    free = ports(1 + 3 * len(BACKENDS) + 2 + 1 + 1 + 2)
    normal = S.Server("normal", model, free.pop(), logs)
    pairs = {}
    try:
        for backend in BACKENDS:
            env = {"KVX_SECRET": SECRET, "KVX_BACKEND": backend, "KVX_CHUNK_TOKENS": "64",
                   "KVX_TEST_CORRUPT_ROOM": str(corrupt_room(backend)), "UCX_MODULES": "^efa",
                   # uvicorn's 10 s for a worker to come up is too short on 2 busy cores.
                   "SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT": "300",
                   # SGLang reuses a failed room's pages after this, acknowledged or not: short
                   # here, so a test sees whether kvx's rooms wait for kvx's decision instead.
                   "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT":
                       str(RELEASE_TIMEOUT_S),
                   # Each manager logs what it holds per room every second (the last test
                   # reads it).
                   "KVX_STATE_LOG_S": "1"}
            # The UCX pair's decode runs two TokenizerWorker processes, which resolve the transfer
            # backend without loading plugins (kvx.sglang.http_app).
            # The NIXL pair's decode keeps a radix cache of its own: a prompt it saw before moves
            # only the pages after its cached prefix (decode_prefix_len).
            decode_args = ["--tokenizer-worker-num", "2"] if backend == "ucx" else [
                "--disaggregation-decode-enable-radix-cache"]
            # The UCX pair's prefill is a pipeline of two PP ranks, and it has a second decode
            # server of two TP ranks, each taking one of the prefill rank's two KV heads, with
            # pages of 8 tokens (the prefill's hold 16). The NIXL pair has a second prefill server
            # of two TP ranks with pages of 8, whose heads both land in its decode's one rank
            # (pages of 16: its radix cache's prefixes are whole pages of 8 too).
            second = (free.pop(), free.pop()) if backend == "nixl" else None
            decode2 = free.pop() if backend == "ucx" else None
            # The UCX pair's third decode server is a pipeline of two PP stages, like its prefill:
            # each stage takes its layer from the prefill PP rank of its stage.
            decode3 = free.pop() if backend == "ucx" else None
            pairs[backend] = Pair(
                f"kvx-{backend}", model, logs, "kvx", env, [free.pop() for _ in range(3)],
                decode_args, second, decode2,
                prefill_args=["--pp-size", "2"] if backend == "ucx" else [],
                prefill2_args=["--tp-size", "2", "--page-size", "8"] if backend == "nixl" else [],
                decode2_args=["--tp-size", "2", "--page-size", "8"] if backend == "ucx" else [],
                third_decode=decode3,
                decode3_args=["--pp-size", "2"] if backend == "ucx" else [],
                # The NIXL pair's prefill and decode serve kvx's metrics.
                metrics=(free.pop(), free.pop()) if backend == "nixl" else None)
        S.start_all([normal] + [s for p in pairs.values() for s in p.servers()])
        normal.expected = [S.generate(normal, p, NEW_TOKENS) for p in prompts]
        yield normal, pairs
    finally:
        for server in [normal] + [s for p in pairs.values() for s in p.servers()]:
            server.kill()


def corrupt_room(backend):
    return random.Random(f"corrupt-{backend}").randrange(1 << 62)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_kvx_pair_answers_like_one_server(backend, servers, prompts):
    normal, pairs = servers
    pair = pairs[backend]
    rng = random.Random(backend)
    for concurrency in (1, 4):
        rooms = [rng.randrange(1 << 62) for _ in prompts]
        results = run_prompts(pair, prompts, rooms, concurrency)
        check(pair, normal, prompts, results, f"{backend}, concurrency {concurrency}")
    # One byte of one moved page flipped on decode: that request's tokens differ, both servers
    # still answer, and the requests after it are intact.
    victim = LENGTHS.index(200)
    got = pair.generate(prompts[victim], corrupt_room(backend))
    assert got["prefill"][0] == 200 and got["decode"][0] == 200, pair.logs()
    assert got["decode"][1]["output_ids"] != normal.expected[victim], (
        "a corrupted page did not change decode's tokens: the check does not read moved KV")
    after = run_prompts(pair, prompts[:3], [rng.randrange(1 << 62) for _ in range(3)], 1)
    check(pair, normal, prompts[:3], after, f"{backend}, after the corrupted request")


def scrape(port, name, label=""):
    """The sum of metric `name`'s samples (those whose labels hold `label`) on a kvx engine's
    metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_servers_kvx_metrics_count_what_it_moved(servers):
    """The NIXL pair's prefill and decode serve their kvx engines' Prometheus metrics
    (``KVX_METRICS``): after eight new prompts, decode counts eight more complete requests and no
    more failed ones, and the prefill more bytes written into decode."""
    _, pairs = servers
    pair = pairs["nixl"]
    rng = random.Random("metrics")
    new = [[rng.randrange(1, 1000) for _ in range(n)] for n in (3, 17, 40, 65, 100, 200, 300, 401)]
    # One request first, so both engines run (they start with a server's first request).
    warm = pair.generate([rng.randrange(1, 1000) for _ in range(20)], rng.randrange(1 << 62))
    assert warm["decode"][0] == 200, pair.logs()
    d_port, p_port = pair.metrics[1], pair.metrics[0]
    complete = scrape(d_port, "kvx_requests_total", 'outcome="complete"')
    failed = scrape(d_port, "kvx_requests_total", 'outcome="failed"')
    written = scrape(p_port, "kvx_written_bytes_total")
    results = run_prompts(pair, new, [rng.randrange(1 << 62) for _ in new], 4)
    assert all(r["decode"][0] == 200 for r in results), pair.logs()
    assert scrape(d_port, "kvx_requests_total", 'outcome="complete"') == complete + len(new)
    assert scrape(d_port, "kvx_requests_total", 'outcome="failed"') == failed
    assert scrape(p_port, "kvx_written_bytes_total") > written


def test_a_decode_server_asked_for_it_runs_its_progress_thread_realtime(servers):
    """The NIXL pair's decode server was started with ``KVX_PROGRESS_FIFO=1``: its kvx engine's
    progress thread runs under SCHED_FIFO at priority 1 (read from /proc across the server's
    processes); the prefill's, not asked, under the normal policy."""
    _, pairs = servers
    pair = pairs["nixl"]
    rng = random.Random("fifo")
    # Both engines run once a request went through (they start with a server's first).
    r = pair.generate([rng.randrange(1, 1000) for _ in range(20)], rng.randrange(1 << 62))
    assert r["decode"][0] == 200, pair.logs()
    decode = T.threads_named(pair.decode.proc.pid, "nixl-sglang-dec")
    prefill = T.threads_named(pair.prefill.proc.pid, "nixl-sglang-pre")
    assert decode and all(t[1:] == (T.SCHED_FIFO, 1) for t in decode), decode
    assert prefill and all(t[1:] == (T.SCHED_OTHER, 0) for t in prefill), prefill


@pytest.mark.parametrize("concurrency", [1, 4])
def test_two_prefill_tp_ranks_into_one_decode_rank_answer_like_one_server(concurrency, servers,
                                                                        prompts):
    """The NIXL pair's second prefill server runs two TP ranks (``--tp-size 2``) with pages of 8
    tokens, its decode one with pages of 16: each prefill rank writes its KV head into decode's
    token rows (packed, into landing memory decode lends it, which decode copies into the rows),
    two of its pages into each of decode's, and decode's tokens equal the normal server's for
    every prompt, one at a time and four at a time."""
    normal, pairs = servers
    pair = pairs["nixl"]
    rng = random.Random(f"tp2-{concurrency}")
    rooms = [rng.randrange(1 << 62) for _ in prompts]
    # Decode's engine starts with its server's first request: one first, so its metrics are served.
    warm = pair.generate2([rng.randrange(1, 1000) for _ in range(20)], rng.randrange(1 << 62))
    assert warm["decode"][0] == 200, pair.logs()
    landed = scrape(pair.metrics[1], "kvx_landing_chunks_total")
    full = scrape(pair.metrics[1], "kvx_landing_full_total")
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(pair.generate2, prompts, rooms))
    check(pair, normal, prompts, results, f"TP 2 prefill into TP 1, concurrency {concurrency}")
    # Each prefill rank's rows are strided in decode's pages: decode lent both ranks landing
    # memory (NIXL would take every row as a descriptor) and copied their chunks into the pages,
    # none refused for want of room. Not every request moves rows in runs of several tokens (a
    # one-token prompt's are single rows), so the count is not a multiple of the prompts.
    assert scrape(pair.metrics[1], "kvx_landing_chunks_total") >= landed + 2
    assert scrape(pair.metrics[1], "kvx_landing_full_total") == full
    text = pair.prefill2.log_path.read_text()
    for rank in (0, 1):
        assert f"kvx: prefill engine started (DP 0, TP {rank}, PP 0)" in text, pair.prefill2.log()


def test_one_decode_server_serves_two_prefill_servers(servers, prompts):
    """Requests of one decode server come from two prefill servers (alternately, four at a time):
    every answer is the normal server's, and the decode scheduler rank serves both prefill
    instances from one kvx engine (one transport, one registration of its pool), each a session
    of its own."""
    normal, pairs = servers
    pair = pairs["nixl"]
    rng = random.Random("two-prefills")
    rooms = [rng.randrange(1 << 62) for _ in prompts]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(
            lambda i: (pair.generate if i % 2 == 0 else pair.generate2)(prompts[i], rooms[i]),
            range(len(prompts))))
    check(pair, normal, prompts, results, "two prefill servers into one decode")
    text = pair.decode.log_path.read_text()
    assert text.count("kvx: decode engine started") == 1, pair.decode.log()
    for port in (pair.bootstrap_port, pair.bootstrap_port2):
        assert f"serves prefill instance 127.0.0.1:{port} " in text, (
            f"decode never served the prefill instance on bootstrap port {port}\n"
            f"{pair.decode.log()}")
    assert_clean_logs(pair)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_one_prefill_rank_into_two_decode_tp_ranks_answers_like_one_server(concurrency, servers,
                                                                          prompts):
    """The UCX pair's second decode server runs two TP ranks (``--tp-size 2``) with pages of 8
    tokens, its prefill one (in each of its two PP ranks) with pages of 16: each prefill rank
    writes one KV head into each decode rank, each of its pages into two of decode's, from its
    one engine, and decode's tokens equal the normal server's for every prompt, one at a time
    and four at a time."""
    normal, pairs = servers
    pair = pairs["ucx"]
    rng = random.Random(f"decode-tp2-{concurrency}")
    rooms = [rng.randrange(1 << 62) for _ in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(pair.generate_d2, prompts, rooms))
    check(pair, normal, prompts, results, f"TP 1 prefill into TP 2, concurrency {concurrency}")


def test_one_prefill_server_serves_two_decode_servers(servers, prompts):
    """Requests of one prefill server go to two decode servers (alternately, four at a time):
    every answer is the normal server's, and the prefill scheduler rank serves both decode servers
    from one kvx engine (one transport, one registration of its pool), started with the first and
    the second added to it."""
    normal, pairs = servers
    pair = pairs["ucx"]
    rng = random.Random("two-decodes")
    rooms = [rng.randrange(1 << 62) for _ in prompts]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(
            lambda i: (pair.generate if i % 2 == 0 else pair.generate_d2)(prompts[i], rooms[i]),
            range(len(prompts))))
    check(pair, normal, prompts, results, "one prefill server into two decodes")
    # One engine per scheduler rank (the prefill is a pipeline of two PP ranks), each serving the
    # other decode server's ranks too (three decode ranks in all: one, and two TP ranks).
    text = pair.prefill.log_path.read_text()
    assert text.count("kvx: prefill engine started") == 2, pair.prefill.log()
    assert text.count("serves decode ") == 2 * 2, pair.prefill.log()
    assert "kvx: decode engine started" in pair.decode2.log_path.read_text(), pair.decode2.log()
    assert_clean_logs(pair)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_pipelined_decode_answers_like_one_server(concurrency, servers, prompts):
    """The UCX pair's third decode server is a pipeline of two PP stages (``--pp-size 2``), as its
    prefill is: each decode stage holds one of the model's two layers, and takes it from the
    prefill PP rank of its stage, into an engine of its own; decode's tokens equal the normal
    server's for every prompt, one at a time and four at a time."""
    normal, pairs = servers
    pair = pairs["ucx"]
    rng = random.Random(f"decode-pp2-{concurrency}")
    rooms = [rng.randrange(1 << 62) for _ in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(pair.generate_d3, prompts, rooms))
    check(pair, normal, prompts, results, f"PP 2 prefill into PP 2 decode, concurrency {concurrency}")
    text = pair.decode3.log_path.read_text()
    assert text.count("kvx: decode engine started") == 2, pair.decode3.log()


# How long a request through a pair may take to end, in any way, once a server is aborted or killed
# (kvx's request timeout is set well above it, so only the failure path can meet it).
FAULT_BOUND_S = 30


def in_background(fn, *args, **kw):
    out = {}
    t = threading.Thread(target=lambda: out.update(result=fn(*args, **kw)), daemon=True)
    t.start()
    return t, out


# What SGLang logs when a backend breaks its contract (a missing method, a failed release).
# SGLang's idle check of its page pools (strict by default: the scheduler raises) is what says that
# every page went back.
CONTRACT_ERRORS = ("AttributeError", "Deferred KV release failed", "NotImplementedError",
                   "memory leak detected")


def assert_clean_logs(pair):
    for server in pair.servers():
        text = server.log_path.read_text()
        for needle in CONTRACT_ERRORS:
            assert needle not in text, f"{server.name} logged {needle!r}\n{server.log()}"


def fresh_prompt(rng, n=792):
    """A prompt no server saw (prefill's radix cache would otherwise make its prefill, and so its
    transfer, over in an instant)."""
    return [rng.randrange(1, 1000) for _ in range(n)]


def kill_mid_request(pair, victim, ids, rng):
    """Three requests of `ids` through `pair`; `victim` (one of its servers) is killed with SIGKILL
    while they move. Returns their results, once each ended within the bound."""
    calls = [in_background(pair.generate, ids, rng.randrange(1 << 62)) for _ in range(3)]
    time.sleep(0.3)
    victim.kill()
    for t, _ in calls:
        t.join(FAULT_BOUND_S)
        assert not t.is_alive(), f"a request outlived {victim.name}\n{pair.logs()}"
    return [out["result"] for _, out in calls]


def test_aborts_on_either_server_mid_transfer(servers, prompts):
    """SGLang's /abort_request on prefill, then on decode, while a 13-chunk prompt moves: both
    calls end within the bound, an aborted request never answers with wrong tokens, and the
    requests after it are intact."""
    normal, pairs = servers
    pair = pairs["ucx"]
    rng = random.Random("aborts")
    for side in ("prefill", "decode"):
        server = getattr(pair, side)
        rid = f"abort-on-{side}-{rng.randrange(1 << 30)}"
        ids = fresh_prompt(rng)
        t, out = in_background(pair.generate, ids, rng.randrange(1 << 62), rid=rid)
        time.sleep(0.2)
        status, reply = S.http("POST", f"{server.url}/abort_request", {"rid": rid})
        assert status == 200, reply
        t.join(FAULT_BOUND_S)
        assert not t.is_alive(), f"abort on {side}: the request did not end\n{pair.logs()}"
        got = out["result"]
        if got["decode"][0] == 200 and "output_ids" in got["decode"][1]:
            aborted = got["decode"][1]["meta_info"]["finish_reason"]["type"] == "abort"
            assert aborted or got["decode"][1]["output_ids"] == S.generate(normal, ids, NEW_TOKENS), got
        after = run_prompts(pair, prompts[:3], [rng.randrange(1 << 62) for _ in range(3)], 2)
        check(pair, normal, prompts[:3], after, f"after an abort on {side}")
    assert_clean_logs(pair)


def test_a_request_decode_drops_before_it_has_pages_ends_on_prefill_at_once(servers, prompts):
    """SGLang's /abort_request on decode for a request still in its prealloc queue: another
    request holds decode's KV memory (1000 prompt tokens and room kept for 3000 more, of 4096),
    so the new one has no pages yet and kvx was never asked for it. Decode tells the prefill
    instance's ranks (``kvx_abandoned_total``), and the prefill server's request ends within the
    bound instead of waiting out SGLang's bootstrap timeout (300 s) for an allocation that never
    comes; the requests after it are right."""
    normal, pairs = servers
    pair = pairs["nixl"]
    rng = random.Random("drop-before-pages")
    d_port = pair.metrics[1]
    # One request first, so decode's engine (and its metrics endpoint) runs.
    warm = pair.generate([rng.randrange(1, 1000) for _ in range(20)], rng.randrange(1 << 62))
    assert warm["decode"][0] == 200, pair.logs()
    complete = scrape(d_port, "kvx_requests_total", 'outcome="complete"')
    hog_rid = f"hog-{rng.randrange(1 << 30)}"
    hog, _ = in_background(S.pair_generate, pair.prefill, pair.decode, pair.bootstrap_port,
                           fresh_prompt(rng, 1000), 3000, rng.randrange(1 << 62), timeout=600,
                           rid=hog_rid)
    try:
        # The hog's pages arrived: decode runs it, holding its memory.
        deadline = time.monotonic() + FAULT_BOUND_S
        while scrape(d_port, "kvx_requests_total", 'outcome="complete"') == complete:
            assert time.monotonic() < deadline, f"the long request never reached decode\n{pair.logs()}"
            time.sleep(0.2)
        abandoned = scrape(d_port, "kvx_abandoned_total")
        room = rng.randrange(1 << 62)
        rid = f"drop-before-pages-{room}"
        t, out = in_background(pair.generate, fresh_prompt(rng), room, rid=rid)
        time.sleep(2)
        status, reply = S.http("POST", f"{pair.decode.url}/abort_request", {"rid": rid})
        assert status == 200, reply
        t.join(FAULT_BOUND_S)
        assert not t.is_alive(), (f"the request decode dropped before it had pages did not end "
                                  f"on prefill\n{pair.logs()}")
        assert scrape(d_port, "kvx_abandoned_total") == abandoned + 1, (
            f"decode had pages for the request: it was not dropped in its prealloc queue\n"
            f"{out['result']}\n{pair.decode.log()}")
        assert out["result"]["prefill"][0] is not None, out["result"]
    finally:
        S.http("POST", f"{pair.decode.url}/abort_request", {"rid": hog_rid})
        hog.join(FAULT_BOUND_S)
    assert not hog.is_alive(), f"the long request did not end\n{pair.logs()}"
    after = run_prompts(pair, prompts[:3], [rng.randrange(1 << 62) for _ in range(3)], 2)
    check(pair, normal, prompts[:3], after, "after a request dropped before it had pages")
    assert_clean_logs(pair)


def test_a_stopped_prefill_keeps_decodes_pages_until_it_confirms(servers, prompts):
    """The prefill server stopped (SIGSTOP, sockets open) before a request reaches it; decode asks
    its ranks for the pages, then SGLang's /abort_request on decode. The stopped ranks cannot
    confirm that no write of theirs can still land, so kvx quarantines the room's pages and decode
    keeps them past SGLang's deferred-release deadline (2 s here) instead of reusing them; after
    SIGCONT the ranks confirm, the pages are released, and the requests after it are right."""
    normal, pairs = servers
    pair = pairs["ucx"]
    rng = random.Random("stop-prefill")
    # Decode knows the instance and its engine is up (a request through the pair), so the stopped
    # prefill is asked for the pages rather than for its directory.
    check(pair, normal, prompts[:1], [pair.generate(prompts[0], rng.randrange(1 << 62))],
          "before prefill is stopped")
    room = rng.randrange(1 << 62)
    rid = f"stopped-prefill-{room}"
    pair.prefill.signal(signal.SIGSTOP)
    try:
        t, out = in_background(pair.generate, fresh_prompt(rng), room, rid=rid)
        time.sleep(1)
        status, reply = S.http("POST", f"{pair.decode.url}/abort_request", {"rid": rid})
        assert status == 200, reply
        time.sleep(ABORT_ACK_TIMEOUT_S + RELEASE_TIMEOUT_S + 3)
        text = pair.decode.log_path.read_text()
        assert "without a full drain ack" not in text, (
            f"SGLang reused pages kvx still held\n{pair.decode.log()}")
        assert f"kvx: room {room}: quarantined" in text, (
            f"the room was not quarantined: decode never asked the stopped ranks\n"
            f"{pair.decode.log()}")
    finally:
        pair.prefill.signal(signal.SIGCONT)
    t.join(FAULT_BOUND_S)
    assert not t.is_alive(), f"the aborted request did not end\n{pair.logs()}"
    deadline = time.monotonic() + FAULT_BOUND_S
    while f"kvx: room {room}: its prefill ranks confirmed" not in pair.decode.log_path.read_text():
        assert time.monotonic() < deadline, f"the pages were never released\n{pair.decode.log()}"
        time.sleep(0.5)
    after = run_prompts(pair, prompts[:3], [rng.randrange(1 << 62) for _ in range(3)], 2)
    check(pair, normal, prompts[:3], after, "after a stopped prefill resumed")
    assert "without a full drain ack" not in pair.decode.log_path.read_text()
    assert_clean_logs(pair)


def test_a_killed_prefill_fails_its_requests_and_its_restart_serves(servers, prompts):
    """kill -9 of the prefill server while requests move: decode ends each of them within the
    bound (through SGLang's own failure path; none answers wrong tokens), stays up, and once the
    prefill server is started again on the same ports, new requests succeed, decode untouched."""
    normal, pairs = servers
    pair = pairs["ucx"]
    rng = random.Random("kill-prefill")
    ids = fresh_prompt(rng)
    want = S.generate(normal, ids, NEW_TOKENS)
    decode_pid = pair.decode.proc.pid
    for got in kill_mid_request(pair, pair.prefill, ids, rng):
        assert got["decode"][0] is not None, got
        if got["decode"][0] == 200 and "output_ids" in got["decode"][1]:
            finish = got["decode"][1]["meta_info"]["finish_reason"]["type"]
            assert finish == "abort" or got["decode"][1]["output_ids"] == want, got
    assert pair.decode.alive() and pair.decode.proc.pid == decode_pid
    pair.prefill.start()
    S.start_all([pair.prefill])
    after = run_prompts(pair, prompts[:4], [rng.randrange(1 << 62) for _ in range(4)], 2)
    check(pair, normal, prompts[:4], after, "after prefill's restart")
    assert pair.decode.proc.pid == decode_pid
    assert_clean_logs(pair)


def test_a_killed_decode_fails_prefills_requests(servers, prompts):
    """kill -9 of the decode server while requests move: prefill ends each of them within the
    bound and stays up; a decode server started again on the same ports is served."""
    normal, pairs = servers
    pair = pairs["nixl"]
    rng = random.Random("kill-decode")
    kill_mid_request(pair, pair.decode, fresh_prompt(rng), rng)
    # Idle now: SGLang's idle check finds every page of the failed requests back in its pool (it
    # raises in the scheduler otherwise, and the server stops).
    time.sleep(3)
    assert pair.prefill.alive(), pair.prefill.log()
    assert "memory leak detected" not in pair.prefill.log_path.read_text(), pair.prefill.log()
    pair.decode.start()
    S.start_all([pair.decode])
    after = run_prompts(pair, prompts[:4], [rng.randrange(1 << 62) for _ in range(4)], 2)
    check(pair, normal, prompts[:4], after, "after decode's restart")
    assert_clean_logs(pair)


def last_state(server):
    """The last ``kvx: state`` line in `server`'s log (its one scheduler rank's manager), or None if
    it logged none."""
    import json
    import re

    found = re.findall(r"kvx: state (\{[^\n]*\})", server.log_path.read_text())
    return json.loads(found[-1]) if found else None


def test_per_room_state_is_back_to_zero_after_the_faults(servers):
    """After every request above (aborted, failed by a killed or stopped server, corrupted, or
    complete), each kvx server's managers and engines hold nothing per room any more: SGLang
    cleared its senders and receivers, kvx released every request and every quarantined room."""
    _, pairs = servers
    kvx_servers = [s for p in pairs.values() for s in p.servers()]
    deadline = time.monotonic() + FAULT_BOUND_S
    while True:
        states = {s.name: last_state(s) for s in kvx_servers}
        held = {name: {k: v for k, v in (st or {"no state logged": 1}).items() if v}
                for name, st in states.items()}
        held = {name: h for name, h in held.items() if h}
        if not held:
            break
        assert time.monotonic() < deadline, f"per-room state left after the faults: {held}"
        time.sleep(1)
    # Prefill servers logged a prefill manager's state, decode servers a decode manager's.
    assert all("allocations" in states[s.name] for p in pairs.values()
               for s in (p.prefill, p.prefill2) if s), states
    assert all("rooms" in states[s.name] for p in pairs.values()
               for s in (p.decode, p.decode2, p.decode3) if s), states
