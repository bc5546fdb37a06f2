"""kvx.vllm.KvxConnector through real vLLM 0.32 instances on this CPU-only machine: a kvx prefill +
decode pair answers like one normal instance, token for token (greedy), and so does vLLM's own
NixlConnector pair on the same prompts; a corrupted moved block changes its request's tokens; a
prefill killed while decode waits for a request's KV leaves decode recomputing it within a bound,
never hanging; a request decode's vLLM aborts while it waits for its KV ends on both sides.

Five instances (one normal, a kvx pair, a NixlConnector pair), each a ``vllm.LLM`` in its own
process group with vLLM's engine core and worker processes (see ``vllm_instances``), start
together once for the module. Run with the provisioned vLLM (``scripts/provision-vllm``, kvx
installed into it): ``.deps/vllm/bin/python -m pytest python/tests/test_vllm.py``."""

import threading
import time
import urllib.request

import pytest

# Without vLLM this module fails to import, and the run fails: it never passes silently.
import vllm  # noqa: F401
import proc_threads as T
import vllm_instances as V

MAX_TOKENS = 16
# Prompts of 4 blocks of 32 tokens (the last one partial), and fresh ones for the tests that must
# move every block (a prompt decode already saw is partly in its prefix cache).
PROMPTS = V.prompts(8, 100)
CORRUPT_PROMPTS = V.prompts(4, 130, seed=11)
KILL_PROMPT = V.prompts(1, 140, seed=13)[0]
ABORT_PROMPT = V.prompts(1, 150, seed=17)[0]
CORRUPT, STALL, LATE = "corrupt", "stall", "late"
LATE_PROMPT = V.prompts(1, 170, seed=23)[0]
# How long decode may take to give up on a killed prefill and answer: the kvx control
# connection's loss is seen at once, kvx's heartbeat bounds a silent peer at 15 s.
KILL_BOUND_S = 45


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
    d = tmp_path_factory.mktemp("vllm")
    model = V.make_model(d / "model")
    secret = V.secret_file(d)
    # Drawn in one call, so no two are the same.
    nixl_p, nixl_d, metrics_p, metrics_d = V.free_ports(4)
    # The kvx pair's engines serve their metrics (KVX_METRICS, TP rank 0 on the port itself).
    made = {"metrics": {"prefill": metrics_p, "decode": metrics_d}}
    test_hooks = {"KVX_TEST_CORRUPT_TAG": CORRUPT, "KVX_TEST_STALL_TAG": STALL,
                  "KVX_TEST_LATE_TAG": LATE,
                  "KVX_METRICS": f"127.0.0.1:{made['metrics']['prefill']}"}
    try:
        # The reference runs its engine in-process (one process instead of three: it only
        # answers); the pairs run vLLM's default, engine core and worker in processes of their
        # own, as servers do.
        made["ref"] = V.Instance("single", model, d, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        made["kvx_p"] = V.Instance("kvx-prefill", model, d,
                                   kv=V.kvx_config("kv_producer", secret), env=test_hooks)
        # Its engine's progress thread under SCHED_FIFO without spinning (KVX_PROGRESS_FIFO,
        # KVX_PROGRESS_SPIN_US), the prefill's not.
        made["kvx_d"] = V.Instance("kvx-decode", model, d,
                                   kv=V.kvx_config("kv_consumer", secret),
                                   env={"KVX_METRICS":
                                        f"127.0.0.1:{made['metrics']['decode']}",
                                        "KVX_PROGRESS_FIFO": "1",
                                        "KVX_PROGRESS_SPIN_US": "0"})
        made["nixl_p"] = V.Instance("nixl-prefill", model, d, kv=V.nixl_config("kv_producer"),
                                    env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_p),
                                         "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"})
        made["nixl_d"] = V.Instance("nixl-decode", model, d, kv=V.nixl_config("kv_consumer"),
                                    env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_d),
                                         "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"})
        V.start_all([i for i in made.values() if isinstance(i, V.Instance)], timeout=420)
        ref = made["ref"].generate(PROMPTS + CORRUPT_PROMPTS + [KILL_PROMPT], MAX_TOKENS)
        tokens = [o["tokens"] for o in ref["outputs"]]
        made["expected"] = tokens[:len(PROMPTS)]
        made["expected_corrupt"] = tokens[len(PROMPTS):-1]
        made["expected_kill"] = tokens[-1]
        # The reference is only one if it answers alike whatever the batch: asked again, in
        # another order, it must give the same tokens.
        again = made["ref"].generate(PROMPTS[::-1], MAX_TOKENS)["outputs"]
        assert [o["tokens"] for o in again][::-1] == made["expected"]
        assert all(len(t) == MAX_TOKENS for t in tokens)
        yield made
    finally:
        for inst in made.values():
            if isinstance(inst, V.Instance):
                inst.close()


def scrape(port, name, label=""):
    """The sum of metric `name`'s samples (those whose labels hold `label`) on a kvx engine's
    metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def test_a_kvx_pair_answers_like_one_instance(cluster):
    """Eight prompts of 4 and 5 blocks, prefilled and decoded concurrently: decode loads every
    block through kvx (no load failure, nothing recomputed) and generates the single instance's
    tokens; decode's engine counts eight more complete requests on its metrics endpoint
    (KVX_METRICS)."""
    p_log, d_log = Log(cluster["kvx_p"]), Log(cluster["kvx_d"])
    port = cluster["metrics"]["decode"]
    complete = scrape(port, "kvx_requests_total", 'outcome="complete"')
    failed = scrape(port, "kvx_requests_total", 'outcome="failed"')
    p, d = V.pair_generate(cluster["kvx_p"], cluster["kvx_d"], PROMPTS, MAX_TOKENS)
    for o in p["outputs"]:
        params = o["kv_transfer_params"]
        assert params["transfer_mode"] == "kvx_push" and params["do_remote_prefill"], params
        assert len(params["remote_block_ids"]) >= 4, params
    got = [o["tokens"] for o in d["outputs"]]
    assert got == cluster["expected"]
    assert scrape(port, "kvx_requests_total", 'outcome="complete"') == complete + len(PROMPTS)
    assert scrape(port, "kvx_requests_total", 'outcome="failed"') == failed
    assert "KV load failed" not in d_log.text() and "Recovered from KV load failure" \
        not in d_log.text(), d_log.text()[-4000:]
    assert "kvx: request" not in p_log.text(), p_log.text()[-4000:]


def test_the_kvx_decode_runs_its_progress_thread_realtime_as_configured(cluster):
    """The kvx decode instance was started with ``KVX_PROGRESS_FIFO=1``: its worker's engine
    progress thread runs under SCHED_FIFO at priority 1 (read from /proc across the instance's
    processes); the prefill's, not asked, under the normal policy."""
    # Both engines are running once a request went through.
    _, d = V.pair_generate(cluster["kvx_p"], cluster["kvx_d"], PROMPTS[:1], MAX_TOKENS)
    assert [o["tokens"] for o in d["outputs"]] == cluster["expected"][:1]
    decode = T.threads_named(cluster["kvx_d"].proc.pid, "ucx-vllm-decode")
    prefill = T.threads_named(cluster["kvx_p"].proc.pid, "ucx-vllm-prefil")
    assert decode and all(t[1:] == (T.SCHED_FIFO, 1) for t in decode), decode
    assert prefill and all(t[1:] == (T.SCHED_OTHER, 0) for t in prefill), prefill


def test_a_nixl_pair_answers_like_one_instance(cluster):
    """The baseline: vLLM's NixlConnector pair (pull over UCX on loopback) on the same prompts."""
    d_log = Log(cluster["nixl_d"])
    p, d = V.pair_generate(cluster["nixl_p"], cluster["nixl_d"], PROMPTS, MAX_TOKENS)
    assert all(o["kv_transfer_params"].get("remote_block_ids") for o in p["outputs"])
    assert [o["tokens"] for o in d["outputs"]] == cluster["expected"]
    assert "Recovered from KV load failure" not in d_log.text(), d_log.text()[-4000:]


def test_a_decode_prefix_hit_moves_only_the_blocks_after_it(cluster):
    """The same prompts again: decode's prefix cache holds their full blocks from the first run,
    so prefill is asked for the blocks after that prefix only, and must send those (its blocks
    from the prefix on), not its first ones. Its engine runs since the first test, so each
    finished request's blocks are offered to it and it posts them itself when decode's
    allocation comes: prefill's engine counts eight more offers posted (KVX_METRICS)."""
    d_log = Log(cluster["kvx_d"])
    port = cluster["metrics"]["prefill"]
    offered = scrape(port, "kvx_offers_posted_total")
    _, d = V.pair_generate(cluster["kvx_p"], cluster["kvx_d"], PROMPTS, MAX_TOKENS)
    assert [o["tokens"] for o in d["outputs"]] == cluster["expected"]
    assert "KV load failed" not in d_log.text(), d_log.text()[-4000:]
    assert scrape(port, "kvx_offers_posted_total") == offered + len(PROMPTS)


def test_a_corrupted_moved_block_changes_that_requests_tokens(cluster):
    """The prefill flips bits in the first block it sends of one request (its own copy, just
    before the write): that request's tokens change, the others' do not. Decode's tokens come
    from the moved bytes."""
    tags = [{"kvx_test_tag": CORRUPT} if i == 1 else None for i in range(len(CORRUPT_PROMPTS))]
    p_log = Log(cluster["kvx_p"])
    _, d = V.pair_generate(cluster["kvx_p"], cluster["kvx_d"], CORRUPT_PROMPTS, MAX_TOKENS,
                           extra_params=tags)
    got = [o["tokens"] for o in d["outputs"]]
    want = cluster["expected_corrupt"]
    assert "KVX_TEST_CORRUPT_TAG: corrupted block" in p_log.text()
    assert got[1] != want[1]
    assert got[:1] + got[2:] == want[:1] + want[2:]


def test_a_request_decode_aborts_while_its_kv_is_awaited_ends_on_both_sides(cluster):
    """The prefill takes decode's allocation for a request and never writes it (the stall hook);
    decode's vLLM aborts the request meanwhile, as a server does when its client goes away. The
    request ends within seconds; kvx's failed decision reaches the prefill within 20 s (not at
    decode's 60 s bound on the wait), which gives its blocks back to vLLM then; both instances
    then serve the next requests of the pair with the normal tokens."""
    prefill, decode = cluster["kvx_p"], cluster["kvx_d"]
    p_log, d_log = Log(prefill), Log(decode)
    prompt = ABORT_PROMPT
    p = prefill.generate([prompt], 1, [{"do_remote_decode": True, "kvx_test_tag": STALL}])
    params = p["outputs"][0]["kv_transfer_params"]
    got = decode.generate_abort([prompt], MAX_TOKENS, [params], abort_after_s=3.0)
    assert "KVX_TEST_STALL_TAG" in p_log.text(), p_log.text()[-4000:]
    # vLLM hands no output back for a request its caller aborted; none finished otherwise.
    assert got["outputs"] == [{"finish_reason": None, "tokens": None}], got
    assert got["after_abort_s"] < 10, got
    failed = f"kvx: request {params['remote_request_id']} failed:"
    deadline = time.monotonic() + 20
    while failed not in p_log.text():
        assert time.monotonic() < deadline, p_log.text()[-4000:]
        time.sleep(0.2)
    assert "within the lease" not in p_log.text()
    # Neither side is harmed: the pair answers the next requests as the single instance does.
    _, d = V.pair_generate(prefill, decode, PROMPTS[:2], MAX_TOKENS)
    assert [o["tokens"] for o in d["outputs"]] == cluster["expected"][:2]


def test_a_release_that_reaches_the_prefill_before_its_blocks_frees_them_when_they_come(cluster):
    """Decode refuses a request's load (its params name a prefill of PP 2, which kvx.vllm does not
    map), recomputes it, and tells the prefill to release the blocks, while the prefill worker
    has not taken them yet (the late hook: it takes the tagged request's blocks 5 s after vLLM
    hands them over, as a slow step would). The release is kept, and the blocks go back to vLLM
    as soon as they come, not when their lease ends (120 s); the pair then serves the next
    request."""
    prefill, decode = cluster["kvx_p"], cluster["kvx_d"]
    p_log = Log(prefill)
    prompt = LATE_PROMPT
    expected = cluster["ref"].generate([prompt], MAX_TOKENS)["outputs"][0]["tokens"]
    p = prefill.generate([prompt], 1, [{"do_remote_decode": True, "kvx_test_tag": LATE}])
    params = {**p["outputs"][0]["kv_transfer_params"], "pp_size": 2}
    got = decode.generate([prompt], MAX_TOKENS, [params])["outputs"][0]
    assert got["tokens"] == expected, got
    released = f"request {params['remote_request_id']}: decode gave it up before its blocks came"
    deadline = time.monotonic() + 20
    while released not in p_log.text():
        assert time.monotonic() < deadline, p_log.text()[-4000:]
        time.sleep(0.2)
    assert "KVX_TEST_LATE_TAG" in p_log.text(), p_log.text()[-4000:]
    assert "within the lease" not in p_log.text()
    _, d = V.pair_generate(prefill, decode, PROMPTS[4:5], MAX_TOKENS)
    assert [o["tokens"] for o in d["outputs"]] == cluster["expected"][4:5]


def test_kv_transfer_params_that_do_not_parse_are_computed_here_not_the_end_of_decode(cluster):
    """A client's kv_transfer_params that name kvx but do not parse (a TP size that is not a
    number, or an infinite one, as JSON's 1e400 reads): decode counts none of the request's tokens
    as loadable, so vLLM computes it (no load is tried, none fails) and answers the single
    instance's tokens, and decode serves the next request of the pair. (Parsed inside vLLM's
    scheduler, each error once ended decode's engine core; later each was a load error, which
    vLLM's default policy turns into a failed request.)"""
    prefill, decode = cluster["kvx_p"], cluster["kvx_d"]
    d_log = Log(decode)
    prompt = V.prompts(1, 160, seed=19)[0]
    expected = cluster["ref"].generate([prompt], MAX_TOKENS)["outputs"][0]["tokens"]
    for tp_size in ("two", float("inf")):
        bad = {"do_remote_prefill": True, "transfer_mode": "kvx_push", "remote_engine_id": "x",
               "remote_request_id": "y", "kvx_side_channels": ["127.0.0.1:1"],
               "tp_size": tp_size}
        got = decode.generate([prompt], MAX_TOKENS, [bad])["outputs"][0]
        assert got["tokens"] == expected, (tp_size, got)
    assert d_log.text().count("do not parse") >= 2, d_log.text()[-4000:]
    assert "KV load failed" not in d_log.text(), d_log.text()[-4000:]
    assert "Recovered from KV load failure" not in d_log.text(), d_log.text()[-4000:]
    _, d = V.pair_generate(prefill, decode, PROMPTS[3:4], MAX_TOKENS)
    assert [o["tokens"] for o in d["outputs"]] == cluster["expected"][3:4]


def test_a_prefill_killed_mid_request_leaves_decode_recomputing_within_a_bound(cluster):
    """The prefill takes decode's page allocation for one request and never writes it (a test
    hook); it is then killed with its engine core and worker. Decode's kvx engine sees the
    prefill rank lost and fails the load; vLLM (kv_load_failure_policy=recompute) recomputes the
    prompt: decode answers the single instance's tokens within the bound, never hangs; and decode's
    engine then forgets the instance that went away."""
    prefill, decode = cluster["kvx_p"], cluster["kvx_d"]
    p_log, d_log = Log(prefill), Log(decode)
    prompt = KILL_PROMPT
    p = prefill.generate([prompt], 1, [{"do_remote_decode": True, "kvx_test_tag": STALL}])
    params = p["outputs"][0]["kv_transfer_params"]
    got = {}

    def run_decode():
        try:
            got["out"] = decode.generate([prompt], MAX_TOKENS, [params], timeout=KILL_BOUND_S + 30)
        except AssertionError as e:
            got["error"] = e

    t = threading.Thread(target=run_decode)
    t.start()
    deadline = time.monotonic() + 30
    while "KVX_TEST_STALL_TAG" not in p_log.text():
        assert time.monotonic() < deadline, p_log.text()[-4000:]
        time.sleep(0.1)
    prefill.kill()
    killed = time.monotonic()
    t.join(KILL_BOUND_S + 35)
    took = time.monotonic() - killed
    assert "out" in got, got.get("error", "decode never answered")
    out = got["out"]["outputs"][0]
    assert took < KILL_BOUND_S, took
    assert "KV load failed" in d_log.text(), d_log.text()[-4000:]
    # Failed ("error") or recomputed, never hung; recomputed, it answers the normal tokens.
    if out["finish_reason"] != "error":
        assert out["tokens"] == cluster["expected_kill"]
    # Decode still serves: a plain request after it.
    again = decode.generate([PROMPTS[0]], MAX_TOKENS)["outputs"][0]["tokens"]
    assert again == cluster["expected"][0]
    # The killed instance stops being a session of decode's engine once its ranks stayed away
    # for kvx.vllm's GONE_AFTER_S (15 s), as no load of it is left.
    removed = f"kvx: prefill instance {params['remote_engine_id']} removed"
    deadline = killed + 15 + 30
    while removed not in d_log.text():
        assert time.monotonic() < deadline, d_log.text()[-4000:]
        time.sleep(0.5)
