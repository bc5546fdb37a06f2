"""kvx.vllm.KvxConnector between real vLLM 0.32 instances of two TP ranks each
(``tensor_parallel_size=2``, each rank a worker process of its own with one of the two KV heads):
the pair answers like one normal instance of one rank, token for token (greedy), every block loaded
through kvx by both decode ranks; a corrupted moved block changes its request's tokens. And TP
sizes that differ: the TP 2 prefill into a decode of one rank (both prefill ranks write their
head's part of each block into it), a prefill of one rank into the TP 2 decode (its one rank
writes one head into each decode rank), both answering like the normal instance. And the
blocks prefill holds for decode: released at once when decode refuses the request, handed back
when the lease ends with no decode asking (a later decode then fails and recomputes). And block
sizes that differ (64 tokens into 32 and back, and with TP sizes that differ too), with and
without decode's prefix hits.

Its own module, after ``test_vllm.py`` has stopped its instances. Run with the provisioned vLLM
(``scripts/provision-vllm``): ``.deps/vllm/bin/python -m pytest python/tests/test_vllm_tp.py``."""

import time
import urllib.request

import pytest

# Without vLLM this module fails to import, and the run fails: it never passes silently.
import vllm  # noqa: F401
import vllm_instances as V

MAX_TOKENS = 16
PROMPTS = V.prompts(8, 100, seed=17)
CORRUPT_PROMPTS = V.prompts(4, 130, seed=19)
# Fresh prompts for each pairing of block sizes (a decode's prefix cache holds what it loaded).
BLOCK_PROMPTS = {"p64_d32": V.prompts(8, 100, seed=23), "p32_d64": V.prompts(8, 100, seed=29),
                 "tp2_d64": V.prompts(8, 100, seed=31)}
CORRUPT = "corrupt"
TP = 2
LEASE_S = 30


class Log:
    """What an instance logged since the mark."""

    def __init__(self, inst):
        self.inst, self.at = inst, inst.log_path.stat().st_size

    def text(self):
        with open(self.inst.log_path, errors="replace") as f:
            f.seek(self.at)
            return f.read()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-tp")
    model = V.make_model(d / "model")
    secret = V.secret_file(d)
    (metrics,) = V.free_ports(1)
    made = {"metrics": metrics}
    try:
        made["ref"] = V.Instance("single", model, d, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        made["kvx_p"] = V.Instance("kvx-prefill-tp2", model, d, tp=TP,
                                   kv=V.kvx_config("kv_producer", secret),
                                   env={"KVX_TEST_CORRUPT_TAG": CORRUPT})
        # Decode's TP ranks serve their engines' metrics on METRICS and METRICS + 1.
        made["kvx_d"] = V.Instance("kvx-decode-tp2", model, d, tp=TP,
                                   kv=V.kvx_config("kv_consumer", secret),
                                   env={"KVX_METRICS": f"127.0.0.1:{metrics}"})
        # Its lease is short enough for a test to see it end.
        made["kvx_p1"] = V.Instance("kvx-prefill-tp1", model, d,
                                    kv=V.kvx_config("kv_producer", secret,
                                                    kv_lease_duration=LEASE_S))
        made["kvx_d1"] = V.Instance("kvx-decode-tp1", model, d,
                                    kv=V.kvx_config("kv_consumer", secret))
        # Blocks of 64 tokens against the others' 32.
        made["kvx_p64"] = V.Instance("kvx-prefill-b64", model, d, block_size=64,
                                     kv=V.kvx_config("kv_producer", secret))
        made["kvx_d64"] = V.Instance("kvx-decode-b64", model, d, block_size=64,
                                     kv=V.kvx_config("kv_consumer", secret))
        V.start_all([i for i in made.values() if isinstance(i, V.Instance)], timeout=420)
        ref = made["ref"].generate(PROMPTS + CORRUPT_PROMPTS, MAX_TOKENS)
        tokens = [o["tokens"] for o in ref["outputs"]]
        made["expected"], made["expected_corrupt"] = tokens[:len(PROMPTS)], tokens[len(PROMPTS):]
        assert all(len(t) == MAX_TOKENS for t in tokens)
        made["expected_blocks"] = {
            k: [o["tokens"] for o in made["ref"].generate(v, MAX_TOKENS)["outputs"]]
            for k, v in BLOCK_PROMPTS.items()}
        yield made
    finally:
        for inst in made.values():
            if isinstance(inst, V.Instance):
                inst.close()


def scrape(port, name, label=""):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def test_a_tp2_kvx_pair_answers_like_one_instance(cluster):
    """Eight prompts of 4 and 5 blocks, prefilled and decoded concurrently by two TP ranks on each
    side: decode generates the single instance's tokens, each decode rank's engine counts eight
    more complete requests (each rank loads its heads of every block), and nothing failed or was
    recomputed."""
    d_log = Log(cluster["kvx_d"])
    ports = [cluster["metrics"] + r for r in range(TP)]
    # The engines start with the first request: counts are read after one.
    V.pair_generate(cluster["kvx_p"], cluster["kvx_d"], PROMPTS[:1], MAX_TOKENS)
    before = [scrape(p, "kvx_requests_total", 'outcome="complete"') for p in ports]
    failed = [scrape(p, "kvx_requests_total", 'outcome="failed"') for p in ports]
    p, d = V.pair_generate(cluster["kvx_p"], cluster["kvx_d"], PROMPTS, MAX_TOKENS)
    for o in p["outputs"]:
        params = o["kv_transfer_params"]
        assert params["transfer_mode"] == "kvx_push" and params["tp_size"] == TP, params
    assert [o["tokens"] for o in d["outputs"]] == cluster["expected"]
    after = [scrape(p, "kvx_requests_total", 'outcome="complete"') for p in ports]
    assert after == [b + len(PROMPTS) for b in before], (before, after)
    assert [scrape(p, "kvx_requests_total", 'outcome="failed"') for p in ports] == failed
    text = d_log.text()
    assert "KV load failed" not in text and "Recovered from KV load failure" not in text, \
        text[-4000:]


def test_a_corrupted_moved_block_changes_that_requests_tokens(cluster):
    """Each prefill rank flips bits in the first block it sends of one request: that request's
    tokens change, the others' do not."""
    tags = [{"kvx_test_tag": CORRUPT} if i == 1 else None for i in range(len(CORRUPT_PROMPTS))]
    p_log = Log(cluster["kvx_p"])
    _, d = V.pair_generate(cluster["kvx_p"], cluster["kvx_d"], CORRUPT_PROMPTS, MAX_TOKENS,
                           extra_params=tags)
    got = [o["tokens"] for o in d["outputs"]]
    want = cluster["expected_corrupt"]
    assert "KVX_TEST_CORRUPT_TAG: corrupted block" in p_log.text()
    assert got[1] != want[1]
    assert got[:1] + got[2:] == want[:1] + want[2:]


@pytest.mark.parametrize("prefill,decode,sessions", [
    ("kvx_p", "kvx_d1", ["(TP 2, ranks [0, 1] write into this one)"]),
    ("kvx_p1", "kvx_d", ["(TP 1, ranks [0] write into this one)"] * TP)])
def test_tp_sizes_that_differ_answer_like_one_instance(prefill, decode, sessions, cluster):
    """TP 2 prefill into TP 1 decode, and TP 1 into TP 2: heads sliced over the ranks, each
    head's part of a block moved whole; every decode rank connects the prefill ranks that hold
    its heads, and decode generates the single instance's tokens, with no load failure."""
    d_log = Log(cluster[decode])
    p, d = V.pair_generate(cluster[prefill], cluster[decode], PROMPTS, MAX_TOKENS)
    assert [o["tokens"] for o in d["outputs"]] == cluster["expected"]
    text = d_log.text()
    assert "KV load failed" not in text and "Recovered from KV load failure" not in text, \
        text[-4000:]
    served = [line[line.rindex("(TP "):] for line in text.splitlines()
              if "serves prefill instance" in line]
    assert served == sessions, text[-4000:]


@pytest.mark.parametrize("prefill,decode,prompts", [
    ("kvx_p64", "kvx_d1", "p64_d32"), ("kvx_p1", "kvx_d64", "p32_d64"),
    ("kvx_p", "kvx_d64", "tp2_d64")])
def test_block_sizes_that_differ_answer_like_one_instance(prefill, decode, prompts, cluster):
    """Blocks of 64 tokens into blocks of 32 and back, and a TP 2 prefill of 32-token blocks into
    a decode of one rank and 64-token blocks: vLLM's CPU blocks keep K by columns inside a head's
    part (both sides probe their kernel and say so at HELLO), so each run of tokens moves as a
    strided write of K's columns and one of V's rows. Decode generates the single instance's
    tokens with no load failure."""
    d_log = Log(cluster[decode])
    _, d = V.pair_generate(cluster[prefill], cluster[decode], BLOCK_PROMPTS[prompts], MAX_TOKENS)
    assert [o["tokens"] for o in d["outputs"]] == cluster["expected_blocks"][prompts]
    text = d_log.text()
    assert "KV load failed" not in text and "Recovered from KV load failure" not in text, \
        text[-4000:]


def test_a_prefix_hit_across_block_sizes(cluster):
    """The same prompts again: a decode of 64-token blocks holds their first 64 tokens, whole
    blocks of its 32-token prefill, and loads only the rest; a decode of 32-token blocks holds
    96 tokens, not whole blocks of its 64-token prefill: it refuses the load (the prefill's
    blocks are released) and vLLM recomputes. Both answer with the single instance's tokens."""
    d_log = Log(cluster["kvx_d64"])
    prompts, want = BLOCK_PROMPTS["p32_d64"], cluster["expected_blocks"]["p32_d64"]
    _, d = V.pair_generate(cluster["kvx_p1"], cluster["kvx_d64"], prompts, MAX_TOKENS)
    assert [o["tokens"] for o in d["outputs"]] == want
    text = d_log.text()
    assert "KV load failed" not in text and "Recovered from KV load failure" not in text, \
        text[-4000:]
    d_log, p_log = Log(cluster["kvx_d1"]), Log(cluster["kvx_p64"])
    prompts, want = BLOCK_PROMPTS["p64_d32"], cluster["expected_blocks"]["p64_d32"]
    _, d = V.pair_generate(cluster["kvx_p64"], cluster["kvx_d1"], prompts, MAX_TOKENS)
    assert [o["tokens"] for o in d["outputs"]] == want
    assert "not whole blocks of the prefill's 64 tokens" in d_log.text(), d_log.text()[-4000:]
    deadline = time.monotonic() + LEASE_S / 2
    while "decode gave it up: blocks released" not in p_log.text():
        assert time.monotonic() < deadline, p_log.text()[-4000:]
        time.sleep(0.5)


def test_a_request_decode_refuses_is_released_by_prefill_at_once(cluster):
    """Decode refuses params it cannot serve (here a prefill with PP 2): it counts none of the
    request's tokens as loadable, vLLM computes it (the normal tokens; no load is tried, none
    fails), and decode tells prefill to release the blocks it holds for it, long before their
    lease ends."""
    p_log, d_log = Log(cluster["kvx_p1"]), Log(cluster["kvx_d1"])
    p = cluster["kvx_p1"].generate(PROMPTS[:2], 1, [{"do_remote_decode": True}] * 2)
    params = [dict(o["kv_transfer_params"], pp_size=2) for o in p["outputs"]]
    d = cluster["kvx_d1"].generate(PROMPTS[:2], MAX_TOKENS, params)
    assert [o["tokens"] for o in d["outputs"]] == cluster["expected"][:2]
    assert "a prefill instance with PP > 1" in d_log.text()
    assert "KV load failed" not in d_log.text(), d_log.text()[-4000:]
    assert "Recovered from KV load failure" not in d_log.text(), d_log.text()[-4000:]
    want = {f"kvx: request {q['remote_request_id']}: decode gave it up: blocks released"
            for q in params}
    deadline = time.monotonic() + LEASE_S / 2
    while not all(w in p_log.text() for w in want):
        assert time.monotonic() < deadline, p_log.text()[-4000:]
        time.sleep(0.5)
    assert "within the lease" not in p_log.text()


def test_blocks_no_decode_asked_for_go_back_after_the_lease(cluster):
    """A prefilled request no decode asks for within the lease: prefill hands its blocks back to
    vLLM; a decode that asks later gets a failure (never blocks vLLM may have reused), and
    recomputes: the normal tokens."""
    p_log, d_log = Log(cluster["kvx_p1"]), Log(cluster["kvx_d1"])
    p = cluster["kvx_p1"].generate(PROMPTS[2:3], 1, [{"do_remote_decode": True}])
    params = p["outputs"][0]["kv_transfer_params"]
    expired = (f"kvx: request {params['remote_request_id']}: no decode asked for its blocks "
               "within the lease: released")
    deadline = time.monotonic() + LEASE_S + 30
    while expired not in p_log.text():
        assert time.monotonic() < deadline, p_log.text()[-4000:]
        time.sleep(0.5)
    d = cluster["kvx_d1"].generate(PROMPTS[2:3], MAX_TOKENS, [params])
    assert [o["tokens"] for o in d["outputs"]] == cluster["expected"][2:3]
    assert "whose blocks this prefill does not hold (released): failed" in p_log.text()
    assert "Recovered from KV load failure" in d_log.text() or "KV load failed" in d_log.text(), \
        d_log.text()[-4000:]
