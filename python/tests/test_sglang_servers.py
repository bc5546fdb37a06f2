"""Real SGLang 0.5.23 servers over kvx: a prefill server and a decode server
(``--disaggregation-transfer-backend kvx``, over UCX and over NIXL) answer every prompt exactly as
one normal server of the same model does, token for token, with both servers answering 200; and
the same check fails for the one request whose moved KV had one byte corrupted on decode
(``KVX_TEST_CORRUPT_ROOM``), so the check reads the moved pages.

Requests go to the pair as SGLang's own load balancer sends them (``sglang_servers.pair_generate``).
Prompts run from 1 token to 792 (13 chunks of SGLang's chunked prefill of 64 at page size 16), one
at a time and four at a time. SGLang and its server packages come from ``scripts/provision-sglang``;
without them these tests fail."""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

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


@pytest.fixture(scope="module")
def normal(model, logs, prompts):
    """One normal server, and its greedy tokens for every prompt."""
    (port,) = ports(1)
    server = S.Server("normal", model, port, logs)
    try:
        S.start_all([server])
        server.expected = [S.generate(server, p, NEW_TOKENS) for p in prompts]
        yield server
    finally:
        server.kill()


class Pair:
    """A prefill and a decode server on one transfer backend."""

    def __init__(self, name, model, logs, backend, env):
        prefill_port, decode_port, self.bootstrap_port = ports(3)
        self.prefill = S.Server(f"{name}-prefill", model, prefill_port, logs, [
            "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", backend,
            "--disaggregation-bootstrap-port", str(self.bootstrap_port)], env)
        self.decode = S.Server(f"{name}-decode", model, decode_port, logs, [
            "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", backend,
            "--disaggregation-decode-retraction-backup", "cpu_tensor"], env)

    def __enter__(self):
        try:
            S.start_all([self.prefill, self.decode])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        self.prefill.kill()
        self.decode.kill()

    def generate(self, ids, room):
        return S.pair_generate(self.prefill, self.decode, self.bootstrap_port, ids, NEW_TOKENS, room)

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


@pytest.mark.parametrize("backend", ["ucx", "nixl"])
def test_a_kvx_pair_answers_like_one_server(backend, model, logs, normal, prompts):
    rng = random.Random(backend)
    corrupt_room = rng.randrange(1 << 62)
    env = {"KVX_SECRET": SECRET, "KVX_BACKEND": backend, "KVX_CHUNK_TOKENS": "64",
           "KVX_TEST_CORRUPT_ROOM": str(corrupt_room), "UCX_MODULES": "^efa"}
    with Pair(f"kvx-{backend}", model, logs, "kvx", env) as pair:
        for concurrency in (1, 4):
            rooms = [rng.randrange(1 << 62) for _ in prompts]
            results = run_prompts(pair, prompts, rooms, concurrency)
            check(pair, normal, prompts, results, f"{backend}, concurrency {concurrency}")
        # One byte of one moved page flipped on decode: that request's tokens differ, both servers
        # still answer, and the requests around it are intact.
        victim = LENGTHS.index(200)
        got = pair.generate(prompts[victim], corrupt_room)
        assert got["prefill"][0] == 200 and got["decode"][0] == 200, pair.logs()
        assert got["decode"][1]["output_ids"] != normal.expected[victim], (
            "a corrupted page did not change decode's tokens: the check does not read moved KV")
        after = run_prompts(pair, prompts[:3], [rng.randrange(1 << 62) for _ in range(3)], 1)
        check(pair, normal, prompts[:3], after, f"{backend}, after the corrupted request")
