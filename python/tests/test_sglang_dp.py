"""Real SGLang 0.5.23 servers of several DP groups over kvx (UCX): a prefill server and a decode
server of two DP ranks each (``--dp-size 2``: two scheduler replicas, each holding the pages of its
own rooms), beside a prefill and a decode server of one rank. Every pairing of them answers every
prompt exactly as one normal server does, token for token; a request whose moved KV had one byte
corrupted on decode (``KVX_TEST_CORRUPT_ROOM``) answers otherwise, so the check reads the moved
pages.

The module runs twice. First the DP prefill server routes rooms SGLang's default way
(``follow_bootstrap_room``: DP rank ``room % 2``), which decode follows without asking. Then it
routes them round robin (``--load-balance-method round_robin``) and every room is even: half of
them land on DP rank 1, which ``room % 2`` would never name, so each request finds its prefill
group only through the directory (each sender registers its room's group, SGLang's decode asks
``/query_dp_ranks``). SGLang's decode gives requests to its DP ranks in turn. kvx.sglang takes DP attention's groups (``--enable-dp-attention``) by the same path, but
SGLang's CPU engine does not run DP attention correctly here: with the torch-native backend it
fails on its first batch, and with two of its gaps filled a normal server of two attention-DP
ranks answered other tokens than a normal server of one rank or of two TP ranks (which agree), so
no token check can be made with it.

Its own module, after ``test_sglang_servers.py`` has stopped its servers: both sets at once do not
fit in this machine's 24 GiB (a server failed to start, short of memory for its KV pool)."""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

import sglang_servers as S
from conftest import free_addrs
from test_sglang_servers import CONTRACT_ERRORS, LENGTHS, NEW_TOKENS, SECRET

DP = ["--dp-size", "2"]
CORRUPT_ROOM = random.Random("corrupt-dp").randrange(1 << 61) * 2 + 1


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return S.make_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(23)
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module", params=["follow_bootstrap_room", "round_robin"])
def servers(model, tmp_path_factory, prompts, request):
    """A normal server (its greedy tokens for every prompt), and kvx servers: prefill and decode
    of one rank, and of two DP ranks (the prefill routing rooms by `request.param`); both prefill
    servers' bootstrap ports, and the routing under ``method``."""
    method = request.param
    logs = tmp_path_factory.mktemp("server-logs")
    free = [int(a.rsplit(":", 1)[1]) for a in free_addrs(7)]
    env = {"KVX_SECRET": SECRET, "KVX_BACKEND": "ucx", "KVX_CHUNK_TOKENS": "64",
           "KVX_TEST_CORRUPT_ROOM": str(CORRUPT_ROOM), "UCX_MODULES": "^efa",
           "SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT": "300", "KVX_STATE_LOG_S": "1"}
    dp_env = {**env, **S.MULTI_RANK_ENV}
    normal = S.Server("normal", model, free.pop(), logs)
    kvx = {}
    for name, mode, args, e in (("prefill", "prefill", [], env),
                                ("prefill_dp", "prefill",
                                 DP + ["--load-balance-method", method], dp_env),
                                ("decode", "decode", [], env),
                                ("decode_dp", "decode", DP, dp_env)):
        extra = ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", "kvx", *args]
        if mode == "prefill":
            kvx[f"{name}_bootstrap"] = free.pop()
            extra += ["--disaggregation-bootstrap-port", str(kvx[f"{name}_bootstrap"])]
        else:
            extra += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        kvx[name] = S.Server(f"kvx-{name}", model, free.pop(), logs, extra, e)
    all_servers = [normal] + [s for s in kvx.values() if isinstance(s, S.Server)]
    try:
        S.start_all(all_servers)
        normal.expected = [S.generate(normal, p, NEW_TOKENS) for p in prompts]
        kvx["method"] = method
        yield normal, kvx
    finally:
        for server in all_servers:
            server.kill()


def dp_rooms(rng, n, kvx):
    """`n` rooms for the DP prefill's routing. Following the room, rooms of both parities in turn
    (it gives each to rank room % 2, so both ranks hold some); round robin, even rooms only (both
    ranks hold some all the same, and decode cannot place those of rank 1 by their number)."""
    odd = kvx["method"] == "follow_bootstrap_room"
    return [rng.randrange(1 << 61) * 2 + (i % 2 if odd else 0) for i in range(n)]


def run(kvx, prefill, decode, prompts, rooms, concurrency):
    def one(ids, room):
        return S.pair_generate(kvx[prefill], kvx[decode], kvx[f"{prefill}_bootstrap"], ids,
                               NEW_TOKENS, room)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts, rooms))


def logs(kvx, *names):
    return "\n".join(kvx[n].log() for n in names)


def check(kvx, prefill, decode, normal, prompts, results, label):
    for n, (ids, want, got) in enumerate(zip(prompts, normal.expected, results)):
        what = f"{label}: prompt {n} ({len(ids)} tokens)"
        assert got["prefill"][0] == 200, f"{what}: prefill {got['prefill']}\n" + logs(
            kvx, prefill, decode)
        assert got["decode"][0] == 200, f"{what}: decode {got['decode']}\n" + logs(
            kvx, prefill, decode)
        assert got["decode"][1]["output_ids"] == want, f"{what}: {got['decode'][1]} != {want}"


PAIRINGS = [("prefill_dp", "decode"), ("prefill", "decode_dp"), ("prefill_dp", "decode_dp")]


@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("prefill,decode", PAIRINGS)
def test_dp_servers_answer_like_one_server(prefill, decode, concurrency, servers, prompts):
    """Each pairing with a DP server answers every prompt as the normal server, one at a time and
    four at a time, with rooms on both of a DP prefill's ranks."""
    normal, kvx = servers
    rng = random.Random(f"{prefill}-{decode}-{concurrency}")
    results = run(kvx, prefill, decode, prompts, dp_rooms(rng, len(prompts), kvx), concurrency)
    check(kvx, prefill, decode, normal, prompts, results,
          f"{prefill} into {decode}, concurrency {concurrency}")


def test_each_dp_rank_runs_its_engine_and_is_a_session_of_its_own(servers, prompts):
    """After the pairings: each DP rank of the DP prefill server started an engine of its own; the
    single-rank decode served each of them as a session of its one engine (``ADDR#dp0``,
    ``ADDR#dp1``); both DP ranks of the DP decode server served the single-rank prefill."""
    normal, kvx = servers
    rng = random.Random("sessions")
    # The pairings above ran before this test; one more round of each, in case it runs alone.
    for prefill, decode in PAIRINGS:
        results = run(kvx, prefill, decode, prompts[:4], dp_rooms(rng, 4, kvx), 4)
        check(kvx, prefill, decode, normal, prompts[:4], results, f"{prefill} into {decode}")
    text = kvx["prefill_dp"].log_path.read_text()
    for rank in (0, 1):
        assert f"kvx: prefill engine started (DP {rank}, TP 0, PP 0)" in text, logs(kvx,
                                                                                  "prefill_dp")
    text = kvx["decode"].log_path.read_text()
    assert text.count("kvx: decode engine started") == 1, logs(kvx, "decode")
    for rank in (0, 1):
        assert f"as session 127.0.0.1:{kvx['prefill_dp_bootstrap']}#dp{rank} " in text, logs(
            kvx, "decode")
    lines = [line for line in kvx["decode_dp"].log_path.read_text().splitlines()
             if f"serves prefill instance 127.0.0.1:{kvx['prefill_bootstrap']} " in line]
    for rank in (0, 1):
        assert any(f" DP{rank}]" in line for line in lines), logs(kvx, "decode_dp")


def test_a_corrupted_page_changes_the_tokens_through_dp_servers(servers, prompts):
    """One byte of one moved page flipped on the DP decode (the room is odd: following the room,
    the DP prefill's rank 1 sent it): that request's tokens differ from the normal server's, both servers answer, and
    the requests after it are intact."""
    normal, kvx = servers
    victim = LENGTHS.index(200)
    got = run(kvx, "prefill_dp", "decode_dp", [prompts[victim]], [CORRUPT_ROOM], 1)[0]
    assert got["prefill"][0] == 200 and got["decode"][0] == 200, logs(kvx, "prefill_dp",
                                                                      "decode_dp")
    assert got["decode"][1]["output_ids"] != normal.expected[victim], (
        "a corrupted page did not change decode's tokens: the check does not read moved KV")
    rng = random.Random("after-corrupt")
    after = run(kvx, "prefill_dp", "decode_dp", prompts[:4], dp_rooms(rng, 4, kvx), 2)
    check(kvx, "prefill_dp", "decode_dp", normal, prompts[:4], after, "after the corrupted one")


def last_states(server):
    """The last ``kvx: state`` of each scheduler rank in `server`'s log, by the rank's tag in
    SGLang's log prefix (``DP1 TP1``; empty for a server of one rank)."""
    import json
    import re

    found = {}
    for tag, state in re.findall(r"((?:DP\d+)?(?: ?TP\d+)?)\] kvx: state (\{[^\n]*\})",
                                 server.log_path.read_text()):
        found[tag] = json.loads(state)
    return found


def test_nothing_is_held_per_room_and_no_contract_error_was_logged(servers):
    """After every request above, each kvx server's managers and engines hold nothing per room
    (each DP rank logs its own state), and no server logged a broken contract."""
    import time

    _, kvx = servers
    names = ["prefill", "prefill_dp", "decode", "decode_dp"]
    deadline = time.monotonic() + 30
    while True:
        states = {n: last_states(kvx[n]) for n in names}
        # Every scheduler rank logged its state: two of each DP server.
        assert [len(states[n]) for n in names] == [1, 2, 1, 2], states
        held = {(n, tag): {k: v for k, v in st.items() if v}
                for n, ranks in states.items() for tag, st in ranks.items()}
        held = {n: h for n, h in held.items() if h}
        if not held:
            break
        assert time.monotonic() < deadline, f"per-room state left: {held}"
        time.sleep(1)
    for n in names:
        text = kvx[n].log_path.read_text()
        for needle in CONTRACT_ERRORS:
            assert needle not in text, f"{n} logged {needle!r}\n{kvx[n].log()}"
