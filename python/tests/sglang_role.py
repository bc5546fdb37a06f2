"""One SGLang scheduler rank using kvx.sglang, in the order SGLang 0.5.23's scheduler calls the
transfer backend (disaggregation/prefill.py and decode.py): the manager over the rank's KV pool
(which registers a prefill rank itself: the scheduler never calls ``register_to_bootstrap``);
decode: ``try_ensure_parallel_info`` until the prefill instance is there; per request, prefill:
sender, poll until ``WaitingForInput`` (PP rank 0 only, as SGLang polls only rank 0 while
bootstrapping), ``init``,
``send`` per prefill chunk with that chunk's pages, poll until terminal, ``clear``; decode: receiver,
``init``, poll until ``WaitingForInput``, ``send_metadata``, poll until terminal, ``clear``.

Usage: ``sglang_role.py prefill|decode PLAN.json RANK OUT.json``. Host-memory pools (numpy), SGLang's
own ``KVArgs``, ``KVPoll``, ``DisaggregationMode`` and ``get_kv_class``; the bootstrap server is the
one ``get_kv_class`` gives for ``kvx``, started by prefill rank 0. Each plan phase is one model shape
on its own bootstrap port; requests run one after another. Faults a request may carry:
``skip_last`` (PP rank 1 never sends its last chunk), ``abort_decode``, ``abort_decode_early``
(decode aborts the room before it allocated pages, as SGLang does for a request in its prealloc
queue), ``abort_prefill`` (rank 0
aborts after its first chunk), ``kill`` (rank 1 kills itself with SIGKILL after its first chunk),
``early_event`` (the first send is the early send of a cached prefix under overlap scheduling:
SGLang sets the sender's ``_early_send_wait_event``, here an object whose ``synchronize`` returns
after 0.5 s as a CUDA event does once the previous forward is over; nothing on this CPU-only
machine records a real one). A request's ``prefix`` is a decode-side prefix (decode's radix cache):
decode allocates and sends the pages after it and passes ``decode_prefix_len``; prefill asks
``pop_decode_prefix_len`` on every rank in ``finalize_bootstrap``, as SGLang does.
Writes ``{room: {"state", "reason", "verified"}}`` per phase to OUT.json as it goes.
"""

import json
import os
import signal
import sys
import threading
import time
import types

import numpy as np

import kvx.sglang

kvx.sglang.install()

from sglang.srt.disaggregation import utils  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402

SHAPES = {
    # layers, bytes per token per layer (K and V together for gqa), tokens per page
    "mla": dict(layers=6, bpt=576, page=16, mla=True),
    "gqa": dict(layers=6, bpt=1024, page=16, mla=False),
}
POISON = 0xEE
AUX_ROWS = 8
TERMINAL = (KVPoll.Success, KVPoll.Failed)
EARLY_EVENT_S = 0.5


class HeldEvent:
    """What the sender is given of SGLang's CUDA event: ``synchronize()`` returns once the forward
    that writes the early-sent pages is over: here once the role has looked at what was posted
    meanwhile (``over``), and EARLY_EVENT_S later."""

    def __init__(self):
        self.fired = None
        self.over = threading.Event()

    def synchronize(self):
        self.over.wait(60)
        time.sleep(EARLY_EVENT_S)
        self.fired = time.monotonic()


def pattern(room, rank, layer, region, index, n):
    return np.random.default_rng([room, rank, layer, region, index]).integers(0, 256, n, dtype=np.uint8)


class Pool:
    """A rank's KV pool as SGLang lays it out: one buffer per layer (and per K/V). MLA pools here are
    adjacent slices of one numpy array (one registration); GQA pools are separate arrays, one per
    buffer, as SGLang allocates them (one registration each)."""

    def __init__(self, shape, first_layer, num_layers, num_pages):
        self.regions = 1 if shape["mla"] else 2
        self.page_bytes = shape["page"] * shape["bpt"] // self.regions
        self.first, self.layers, self.pages = first_layer, num_layers, num_pages
        n = self.regions * num_layers
        if shape["mla"]:
            mem = np.zeros(n * num_pages * self.page_bytes, np.uint8)
            self.buffers = list(mem.reshape(n, num_pages, self.page_bytes))
        else:
            self.buffers = [np.zeros((num_pages, self.page_bytes), np.uint8) for _ in range(n)]
        self.view = _Buffers(self.buffers, num_layers)
        # SGLang's metadata buffers: one row per request slot (output token ids, logprob-like rows).
        self.aux = [np.zeros((AUX_ROWS, 32), np.uint8), np.zeros((AUX_ROWS, 96), np.uint8)]

    def kv_args(self, page_size, pp_rank):
        a = KVArgs()
        layer_len = self.pages * self.page_bytes
        a.engine_rank = 0
        a.pp_rank = pp_rank
        a.kv_data_ptrs = [b.ctypes.data for b in self.buffers]
        a.kv_data_lens = [layer_len] * (self.regions * self.layers)
        a.kv_item_lens = [self.page_bytes] * (self.regions * self.layers)
        a.aux_data_ptrs = [b.ctypes.data for b in self.aux]
        a.aux_data_lens = [b.nbytes for b in self.aux]
        a.aux_item_lens = [b.shape[1] for b in self.aux]
        a.page_size = page_size
        if self.regions == 2:
            # SGLang's MHA pools carry their heads: four per rank here, of equal bytes.
            a.kv_head_num = a.total_kv_head_num = 4
        a.prefill_start_layer = self.first
        a.gpu_id = 0
        a.ib_device = ""
        a.system_dp_rank = 0
        return a


class _Buffers:
    """view[k, l, p] (a page) and view[:, :, pages] = byte over a list of per-buffer arrays."""

    def __init__(self, buffers, layers):
        self.buffers, self.layers = buffers, layers

    def __getitem__(self, key):
        k, l, p = key
        return self.buffers[k * self.layers + l][p]

    def __setitem__(self, key, value):
        k, l, p = key
        if isinstance(k, slice) and isinstance(l, slice):
            for b in self.buffers:
                b[p] = value
        else:
            self.buffers[k * self.layers + l][p] = value


def pages_for(room, n, total, salt):
    return [int(p) for p in np.random.default_rng([room, salt]).permutation(total)[:n]]


def wait_poll(obj, until, deadline_s=60.0):
    deadline = time.monotonic() + deadline_s
    while True:
        state = obj.poll()
        if state in until or state == KVPoll.Failed:
            return state
        if time.monotonic() > deadline:
            return None
        time.sleep(0.002)


def failure(obj):
    try:
        obj.failure_exception()
    except Exception as e:  # the backend's typed cause
        return f"{type(e).__name__}:{getattr(e, 'cause', '')}"
    return "no exception"


def layers_of(shape, pp, rank):
    base, extra = divmod(shape["layers"], pp)
    first = rank * base + min(rank, extra)
    return first, base + (1 if rank < extra else 0)


def main():
    role, plan_path, rank, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with open(plan_path) as f:
        plan = json.load(f)
    KVX = utils.TransferBackend("kvx")
    results = {}

    def save():
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, out_path)

    keep = []  # bootstrap servers and managers live until the process ends
    for phase in plan["phases"]:
        shape = SHAPES[phase["model"]]
        pp, port, page = plan["pp"], phase["port"], shape["page"]
        server_args = types.SimpleNamespace(pp_size=pp if role == "prefill" else 1,
                                            host="127.0.0.1", disaggregation_bootstrap_port=port)
        bootstrap_addr = f"127.0.0.1:{port}"
        res = results.setdefault(phase["name"], {})
        if role == "prefill":
            first, count = layers_of(shape, pp, rank)
            pool = Pool(shape, first, count, plan["prefill_pages"])
            if rank == 0:
                server_cls = utils.get_kv_class(KVX, utils.KVClassType.BOOTSTRAP_SERVER)
                keep.append(server_cls(host="127.0.0.1", port=port))
            mgr_cls = utils.get_kv_class(KVX, utils.KVClassType.MANAGER)
            # The manager registers the rank itself, as SGLang's scheduler expects.
            mgr = mgr_cls(pool.kv_args(page, rank), utils.DisaggregationMode.PREFILL, server_args,
                          shape["mla"])
            keep.append((mgr, pool))
            sender_cls = utils.get_kv_class(KVX, utils.KVClassType.SENDER)
            for req in phase["requests"]:
                room, tokens, fault = req["room"], req["tokens"], req.get("fault")
                n = -(-(tokens - req.get("prefix", 0)) // page)
                src = pages_for(room, n, pool.pages, 1)
                for k in range(pool.regions):
                    for l in range(count):
                        for i, p in enumerate(src):
                            pool.view[k, l, p] = pattern(room, rank, first + l, k, i, pool.page_bytes)
                for j, b in enumerate(pool.aux):
                    b[room % AUX_ROWS] = pattern(room, rank, 1000, j, 0, b.shape[1])
                sender = sender_cls(mgr=mgr, bootstrap_addr=bootstrap_addr, bootstrap_room=room)
                # SGLang polls only PP rank 0 while bootstrapping; the other ranks take its answer,
                # so a higher rank may send before its own allocation arrived. Decode gives the
                # room up before it allocates pages: rank 0's answer is Failed.
                began = time.monotonic()
                state = wait_poll(sender, (KVPoll.WaitingForInput,)) if rank == 0 else \
                    KVPoll.Failed if fault == "abort_decode_early" else KVPoll.WaitingForInput
                extra = {"bootstrap_s": time.monotonic() - began} if rank == 0 else {}
                if state == KVPoll.WaitingForInput:
                    # finalize_bootstrap, on every rank.
                    extra["prefix"] = sender.pop_decode_prefix_len()
                    sender.init(n, room % AUX_ROWS)
                    chunk_pages = plan["sglang_chunk_tokens"] // page
                    if n == 0:
                        # Decode holds the whole prompt: the last send is made, empty.
                        sender.send(np.array([], dtype=np.int32), None, num_kv_tokens=0)
                    for c0 in range(0, n, chunk_pages):
                        if c0 == 0 and fault == "early_event":
                            event = HeldEvent()
                            sender._early_send_wait_event = event
                        last = c0 + chunk_pages >= n
                        if last and fault == "skip_last" and rank == 1:
                            break
                        sender.send(np.array(src[c0:c0 + chunk_pages], dtype=np.int32), None,
                                    num_kv_tokens=min(tokens, (c0 + chunk_pages) * page) - c0 * page)
                        if c0 == 0 and fault == "early_event":
                            # Posted before the forward that writes them was over: none may be.
                            extra["posted_before_event"] = len(sender.posted)
                            event.over.set()
                        sender.poll()  # the scheduler polls between chunks
                        if c0 == 0 and fault == "abort_prefill" and rank == 0:
                            sender.abort()
                            break
                        if c0 == 0 and fault == "abort_decode":
                            # Decode aborts meanwhile: the rest is sent only once it did (a fixed
                            # wait here let a slow decode's abort come after the last chunk).
                            wait_poll(sender, TERMINAL, 30)
                        if c0 == 0 and fault == "kill" and rank == 1:
                            time.sleep(0.2)
                            os.kill(os.getpid(), signal.SIGKILL)
                    state = wait_poll(sender, TERMINAL)
                if fault == "early_event" and extra:
                    extra["posted_after_event"] = len(sender.posted)
                    extra["event_fired"] = event.fired is not None
                res[str(room)] = {
                    "state": {KVPoll.Success: "success", KVPoll.Failed: "failed"}.get(state, str(state)),
                    "reason": failure(sender) if state == KVPoll.Failed else None,
                    **extra,
                }
                sender.clear()
                save()
        else:
            pool = Pool(shape, 0, shape["layers"], plan["decode_pages"])
            mgr_cls = utils.get_kv_class(KVX, utils.KVClassType.MANAGER)
            mgr = mgr_cls(pool.kv_args(page, 0), utils.DisaggregationMode.DECODE, server_args,
                          shape["mla"])
            keep.append((mgr, pool))
            receiver_cls = utils.get_kv_class(KVX, utils.KVClassType.RECEIVER)
            # As SGLang's decode scheduler does before it makes a receiver (the prefill side's
            # directory may still be starting).
            deadline = time.monotonic() + 120
            while not mgr.try_ensure_parallel_info(bootstrap_addr):
                if time.monotonic() > deadline:
                    raise SystemExit("prefill ranks never registered")
                time.sleep(0.1)
            for req in phase["requests"]:
                room, tokens, fault = req["room"], req["tokens"], req.get("fault")
                prefix = req.get("prefix", 0)
                n = -(-(tokens - prefix) // page)
                dst = pages_for(room, n, pool.pages, 2)
                receiver = receiver_cls(mgr=mgr, bootstrap_addr=bootstrap_addr, bootstrap_room=room)
                receiver.init(0)
                state = wait_poll(receiver, (KVPoll.WaitingForInput,))
                verified = None
                if state == KVPoll.WaitingForInput and fault == "abort_decode_early":
                    # SGLang's /abort_request of a request in its prealloc queue: no pages yet,
                    # no send_metadata.
                    receiver.abort()
                    state = receiver.poll()
                elif state == KVPoll.WaitingForInput:
                    pool.view[:, :, dst] = POISON
                    for b in pool.aux:
                        b[room % AUX_ROWS] = POISON
                    receiver.send_metadata(np.array(dst, dtype=np.int32), room % AUX_ROWS,
                                           decode_prefix_len=prefix)
                    if fault == "abort_decode":
                        wait_poll(receiver, (KVPoll.Transferring,), 0.2)
                        receiver.abort()
                    state = wait_poll(receiver, TERMINAL)
                    if state == KVPoll.Success:
                        verified = True
                        for k in range(pool.regions):
                            for l in range(shape["layers"]):
                                r, _ = next((r, c) for r in range(pp)
                                            for f, c in [layers_of(shape, pp, r)] if f <= l < f + c)
                                for i, p in enumerate(dst):
                                    want = pattern(room, r, l, k, i, pool.page_bytes)
                                    verified &= bool(np.array_equal(pool.view[k, l, p], want))
                        # The metadata row is the last PP rank's.
                        for j, b in enumerate(pool.aux):
                            want = pattern(room, pp - 1, 1000, j, 0, b.shape[1])
                            verified &= bool(np.array_equal(b[room % AUX_ROWS], want))
                    elif state == KVPoll.Failed:
                        # Deferred KV release: the pages are reused only once no write can land.
                        deadline = time.monotonic() + 30
                        while not receiver.is_abort_release_safe() and time.monotonic() < deadline:
                            time.sleep(0.01)
                        req["release_safe"] = receiver.is_abort_release_safe()
                res[str(room)] = {
                    "state": {KVPoll.Success: "success", KVPoll.Failed: "failed"}.get(state, str(state)),
                    "reason": failure(receiver) if state == KVPoll.Failed else None,
                    "verified": verified,
                    "release_safe": req.get("release_safe"),
                }
                receiver.clear()
                save()
    save()
    # Prefill ranks stay up until decode is done with them (the test ends them).
    if role == "prefill":
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main()
