"""One real vLLM instance (``vllm.LLM``, vLLM 0.32 on CPU) in its own process, driven by the test
harness (``vllm_instances.Instance``) over a ``multiprocessing.connection`` pipe.

``python vllm_role.py '<json config>'``: builds the ``LLM`` (with the config's
``kv_transfer_config``, if any), says ``ready``, then answers ``generate`` calls until ``exit``.
vLLM runs its engine core and its worker in processes of their own
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``, vLLM's default): the shape servers run in, and the one in
which a prefill's engine keeps stepping while it holds blocks for a decode, between ``generate``
calls (in-process, it would step only inside them)."""

import json
import os
import sys
import time


def generate_abort(llm, msg):
    """Adds the requests to the engine, aborts them (``LLMEngine.abort_request``, as a server does
    when its client goes away) once ``abort_after_s`` passed, and steps the engine until every one
    finished: each request's finish reason and tokens, and the seconds from the abort to the
    last of them."""
    import threading

    from vllm import SamplingParams

    engine = llm.llm_engine
    ids = [f"abort-{os.getpid()}-{i}" for i in range(len(msg["prompts"]))]
    for rid, prompt, p in zip(ids, msg["prompts"], msg["params"]):
        engine.add_request(rid, {"prompt_token_ids": list(prompt)},
                           SamplingParams(max_tokens=msg["max_tokens"], temperature=0.0,
                                          ignore_eos=True,
                                          extra_args={"kv_transfer_params": dict(p)}))
    aborted = {}

    def abort():
        aborted["at"] = time.monotonic()
        engine.abort_request(ids)

    # The engine's step blocks while no request makes progress (they wait for their KV): the
    # abort comes from beside it.
    timer = threading.Timer(msg["abort_after_s"], abort)
    timer.start()
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    timer.join()
    return {"after_abort_s": time.monotonic() - aborted["at"], "outputs": [
        {"finish_reason": done[r].outputs[0].finish_reason if r in done else None,
         "tokens": list(done[r].outputs[0].token_ids) if r in done else None} for r in ids]}


def main():
    cfg = json.loads(sys.argv[1])
    from multiprocessing.connection import Client

    conn = Client(tuple(cfg["address"]), authkey=bytes.fromhex(cfg["authkey"]))
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        kw = dict(model=cfg["model"], tokenizer=cfg["model"], dtype="float32",
                  block_size=cfg["block_size"], max_model_len=cfg["max_model_len"],
                  kv_cache_memory_bytes=cfg["kv_cache_bytes"], enforce_eager=True, seed=0,
                  max_num_seqs=16, disable_log_stats=False)
        if cfg.get("tp", 1) > 1:
            # Its TP ranks in worker processes of their own.
            kw.update(tensor_parallel_size=cfg["tp"], distributed_executor_backend="mp")
        if cfg.get("kv"):
            kw["kv_transfer_config"] = KVTransferConfig(**cfg["kv"])
        start = time.monotonic()
        llm = LLM(**kw)
        conn.send({"ready": True, "pid": os.getpid(), "start_s": time.monotonic() - start})
    except BaseException as e:  # reported to the harness, which shows the log
        conn.send({"ready": False, "error": repr(e)})
        raise
    while True:
        msg = conn.recv()
        if msg["op"] == "exit":
            break
        if msg["op"] == "generate_abort":
            conn.send(generate_abort(llm, msg))
            continue
        if msg["op"] == "generate":
            params = msg.get("params") or [None] * len(msg["prompts"])
            sps = []
            for p in params:
                extra = {"kv_transfer_params": dict(p)} if p is not None else None
                sps.append(SamplingParams(max_tokens=msg["max_tokens"], temperature=0.0,
                                          ignore_eos=True, extra_args=extra))
            start = time.monotonic()
            outs = llm.generate([{"prompt_token_ids": list(t)} for t in msg["prompts"]], sps,
                                use_tqdm=False)
            wall = time.monotonic() - start
            conn.send({"wall_s": wall, "outputs": [{
                "tokens": list(o.outputs[0].token_ids),
                "finish_reason": o.outputs[0].finish_reason,
                "kv_transfer_params": o.kv_transfer_params,
                "ttft_s": getattr(o.metrics, "first_token_latency", None),
                # Engine-core timestamps (monotonic): queued, first scheduled (for a request
                # that loads its KV: once the load is over), first token.
                "queued_ts": getattr(o.metrics, "queued_ts", None),
                "scheduled_ts": getattr(o.metrics, "scheduled_ts", None),
                "first_token_ts": getattr(o.metrics, "first_token_ts", None),
                "num_cached_tokens": o.num_cached_tokens} for o in outs]})
    conn.close()
    # NIXL's UCX leaves a handler that crashes (libnl) at interpreter exit: leave at once.
    os._exit(0)


if __name__ == "__main__":
    main()
