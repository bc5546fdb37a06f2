"""``KvxKVManager``: one per SGLang scheduler rank.

Prefill: registers the rank in its instance's directory when it is made (SGLang's scheduler never
calls ``register_to_bootstrap``), and runs one ``PrefillEngine`` for every decode engine that
announces itself there (one transport, one registration of the pool, one vote mesh for the
pipeline; started with the first decode, each later one added to it). Decode: one
``DecodeEngine`` for every prefill instance (one transport, one registration of the pool; each DP
group of each instance a session of it, named by its bootstrap address and group),
announced in each instance's directory, and a heartbeat of every instance it knows: an instance
that stops answering is forgotten by SGLang's table (SGLang asks for it again), and one that comes
back, or restarted on the same address, is told of the decode engine again, so its new ranks
rejoin their session."""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import json
import logging
import math
import os
import threading
import time
import types
from typing import List, Optional

from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs
from sglang.srt.disaggregation.utils import DisaggregationMode

import kvx

from . import settings
from .directory import http

logger = logging.getLogger(__name__)

# How long one long poll of the directory for new decode engines waits.
DECODE_POLL_S = 10.0
# A decode engine a prefill rank could not link is tried again after this, doubling up to the
# second bound.
LINK_RETRY_S = 0.5
LINK_RETRY_MAX_S = 10.0


class _Pool:
    """A rank's KV pool as kvx sees it, from SGLang's KVArgs."""

    def __init__(self, args: KVArgs, is_mla: bool, first_layer: int, heads=None):
        ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
        if not ptrs or len(ptrs) != len(lens) or len(lens) != len(items):
            raise kvx.ConfigError("kvx: KVArgs has no KV buffers, or mismatched lists")
        if len(set(lens)) != 1 or len(set(items)) != 1:
            raise kvx.ConfigError("kvx: every KV buffer must have the same length and page size")
        split = not is_mla
        if split and len(ptrs) % 2:
            raise kvx.ConfigError("kvx: an MHA pool needs K and V buffers for every layer")
        self.num_layers = len(ptrs) // (2 if split else 1)
        self.page_bytes = items[0]
        self.num_pages = lens[0] // items[0]
        self.split = split
        self.first_layer = first_layer
        self.memory = [(p, n) for p, n in zip(ptrs, lens)]
        # MHA/GQA pages are [token][head][head_dim], SGLang's token-major layout: heads are sliced
        # over TP ranks (replicated where the model has fewer KV heads than ranks). MLA's latent is
        # whole on every rank.
        # `heads`: (per rank, model) where KVArgs does not carry them.
        per_rank, total = heads or (getattr(args, "kv_head_num", 0),
                                    getattr(args, "total_kv_head_num", 0))
        self.heads = 0 if is_mla else int(per_rank or 0)
        self.kv_heads = 0 if is_mla else int(total or 0)
        page_size = int(args.page_size)
        self.head_bytes = 0
        if self.heads:
            if self.page_bytes % (page_size * self.heads):
                raise kvx.ConfigError(f"kvx: a page of {self.page_bytes} bytes is not {page_size} "
                                      f"tokens of {self.heads} heads")
            self.head_bytes = self.page_bytes // (page_size * self.heads)
        # Without head counts (SGLang gives them for every MHA pool) pages map whole, rank to rank.
        self.tp_mode = "replicated" if is_mla else ("head_sliced" if self.heads else "identical")
        self.layout = kvx.Layout(first_layer=first_layer, num_layers=self.num_layers,
                                 page_bytes=self.page_bytes, num_pages=self.num_pages, split_kv=split,
                                 heads=self.heads, head_bytes=self.head_bytes)


def _refuse_unsupported(args: KVArgs, server_args) -> None:
    """What kvx does not carry yet is refused at start, by name, never dropped or left to hang:
    state beside the KV pages (decode would run on uninitialised state)."""
    states = [getattr(s, "value", str(s)) for s in (getattr(args, "state_types", None) or [])]
    if states:
        raise kvx.ConfigError(
            f"kvx: this model keeps state beside its KV pages ({', '.join(states)}); kvx carries "
            "KV pages and metadata rows only: use another --disaggregation-transfer-backend")


def _topology(args: KVArgs, server_args, mode, parallel=None) -> types.SimpleNamespace:
    """Where this scheduler rank sits, as the KV pages see it: its DP group (``dp_rank`` of
    ``dp_size``) and its rank in the group's TP (``tp_rank`` of ``tp_size``), over which the KV
    heads are split. With DP attention a group is an attention-DP rank and its TP the attention TP;
    with several DP replicas (``--dp-size`` without it) a replica and its TP; SGLang's own backends
    number the groups so (attention DP unless there are replicas). Each group holds its own
    requests' pages: a request is written by the prefill group that holds it, into the decode
    group that took it. `parallel` is SGLang's parallel state (``get_parallel()`` by default);
    outside a scheduler (none published), one group of ``--tp-size``."""
    tp_size = int(getattr(server_args, "tp_size", 1) or 1)
    engine_rank = int(args.engine_rank)
    try:
        if parallel is None:
            from sglang.srt.runtime_context import get_parallel

            parallel = get_parallel()
        p = parallel
        attn_tp, attn_tp_rank = int(p.attn_tp_size), int(p.attn_tp_rank)
        attn_dp, attn_dp_rank = int(p.attn_dp_size), int(p.attn_dp_rank)
        replicas, cp = int(p.dp_size), int(p.attn_cp_size)
    except (ImportError, AttributeError, ValueError, RuntimeError):
        return types.SimpleNamespace(tp_rank=engine_rank, tp_size=tp_size, dp_rank=0, dp_size=1,
                                     follow_room=True)
    if cp > 1:
        raise kvx.ConfigError("kvx: attention context parallelism (attn_cp_size > 1) is not mapped "
                              "by kvx: use another --disaggregation-transfer-backend")
    if replicas > 1:
        dp_rank, dp_size = int(getattr(args, "system_dp_rank", 0) or 0), replicas
    else:
        dp_rank, dp_size = attn_dp_rank, attn_dp
    # Whether a prefill server's DP ranks take rooms by room modulo DP size, so that decode knows a
    # room's group without asking; otherwise each sender registers its room's group in the
    # directory, and decode asks it (SGLang's /query_dp_ranks), as SGLang's own backends do.
    method = getattr(server_args, "load_balance_method", None) or "auto"
    method = str(getattr(method, "value", method))
    follow = method in ("auto", "follow_bootstrap_room") and not _force_query()
    return types.SimpleNamespace(tp_rank=attn_tp_rank, tp_size=attn_tp, dp_rank=dp_rank,
                                 dp_size=dp_size, follow_room=follow)


def _force_query() -> bool:
    """SGLang's ``SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK``: register and ask every
    room's DP group even where rooms follow the modulo."""
    try:
        from sglang.srt.environ import envs

        return bool(envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get())
    except (ImportError, AttributeError):
        return False


def _dp_size(ranks: list) -> int:
    """The DP groups of a prefill instance, as its registered ranks say."""
    return max([int(r.get("dp_size", 1)) for r in ranks] or [1])


def session_name(bootstrap_addr: str, dp_rank: int, dp_size: int) -> str:
    """How decode names one DP group of a prefill instance (a session of its engine): the
    instance's bootstrap address, with the group where it has several."""
    return bootstrap_addr if dp_size <= 1 else f"{bootstrap_addr}#dp{dp_rank}"


def _refuse_other_layout(mine: dict, theirs: dict, addr: str) -> None:
    """A prefill instance whose ranks kvx cannot map onto this decode rank fails each request at
    once, naming what differs. TP sizes may differ (heads are sliced over the ranks, MLA's latent
    is whole on each), and so may page sizes where a token's bytes are known on both sides (the
    heads of an MHA/GQA page, the latent row of an MLA page): per-head bytes, the model's KV heads
    and the K/V split must agree."""
    for key, what in (("head_bytes", "bytes per head and token"), ("kv_heads", "model KV heads"),
                      ("split_kv", "K/V split")):
        if key in theirs and theirs[key] != mine[key]:
            raise kvx.ConfigError(
                f"kvx: prefill instance {addr} has {what} {theirs[key]}, this decode "
                f"{mine[key]}: kvx does not map that, so far")
    page_size = int(theirs.get("page_size", mine["page_size"]))
    page_bytes = int(theirs.get("page_bytes", mine["page_bytes"]))
    if mine.get("radix_cache") and mine["page_size"] % page_size:
        # Decode's cached prefix is whole pages of its size, and prefill sends from there: a
        # prefix that ends inside one of prefill's pages cannot be sent from.
        raise kvx.ConfigError(
            f"kvx: prefill instance {addr} has page size {page_size}, this decode "
            f"{mine['page_size']} with a radix cache: its prefixes must be whole prefill pages "
            "(a decode page size that is a multiple of prefill's)")
    if mine["kv_heads"]:
        return
    if mine["split_kv"] and page_size != mine["page_size"]:
        # K and V pages without head counts: kvx cannot tell where a token's bytes lie.
        raise kvx.ConfigError(
            f"kvx: prefill instance {addr} has page size {page_size}, this decode "
            f"{mine['page_size']}: kvx does not map that without head counts, so far")
    if page_bytes * mine["page_size"] != mine["page_bytes"] * page_size:
        raise kvx.ConfigError(f"kvx: prefill instance {addr} has {page_bytes} bytes per page of "
                              f"{page_size} tokens, this decode {mine['page_bytes']} of "
                              f"{mine['page_size']}")


def _release_failed_rooms_on_kvx_decision() -> None:
    """SGLang holds a failed room's pages until the manager's ``is_abort_release_safe`` says no
    write can land, or until ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s)
    passes, and then reuses them. kvx keeps a room whose prefill rank is connected and has not
    confirmed the abort quarantined for as long as that lasts (a stopped process can still write
    when it resumes), so for kvx's rooms the deadline is dropped: the pages go back to SGLang
    exactly when kvx releases them. Patched on the class (the queue is made before the manager);
    rooms of other backends keep their deadline."""
    from sglang.srt.disaggregation.decode import DecodeTransferQueue

    from .receiver import KvxKVReceiver

    original = DecodeTransferQueue._defer_release
    if getattr(original, "_kvx", False):
        return

    def _defer_release(self, decode_req):
        original(self, decode_req)
        if not isinstance(decode_req.kv_receiver, KvxKVReceiver):
            return
        held = self._deferred_releases
        if held and held[-1][0] is decode_req and len(held[-1]) == 5:
            req, start, _, idx, acks = held[-1]
            held[-1] = (req, start, math.inf, idx, acks)
        else:
            logger.error("kvx: SGLang's deferred release entry has an unknown shape: room %s "
                         "keeps SGLang's deadline", decode_req.req.bootstrap_room)

    _defer_release._kvx = True
    DecodeTransferQueue._defer_release = _defer_release


# Rooms aborted before their allocation came that a prefill rank remembers (see `_aborted`).
ABORTED_ROOMS_KEPT = 4096


def release_when_decided(engine, room: int, decision=None) -> None:
    """Releases the engine's bookkeeping of `room` once its PP ranks decided it (the engine keeps
    it until then); `decision` is the room's `decided` Pending where the caller holds one."""

    def release():
        try:
            engine.release(room)
        except kvx.KvxError:
            pass

    try:
        decision = decision if decision is not None else engine.decided(room)
        if decision.done():
            release()
        else:
            decision.add_done_callback(release)
    except kvx.KvxError:
        pass


class KvxKVManager(BaseKVManager):
    """One per scheduler rank (see the module's doc)."""

    supports_deferred_decode_kv_release = True
    enable_deferred_decode_kv_release = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args,
                 is_mla_backend: Optional[bool] = False):
        _refuse_unsupported(args, server_args)
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        self.pp_size = int(getattr(server_args, "pp_size", 1) or 1)
        # The rank's DP group, and its TP rank and size in the group (over which heads split).
        where = _topology(args, server_args, disaggregation_mode)
        self.tp_rank, self.tp_size = where.tp_rank, where.tp_size
        self.dp_rank, self.dp_size = where.dp_rank, where.dp_size
        # Prefill: whether decode finds a room's DP group by the modulo (else it asks).
        self.follow_room = where.follow_room
        self.page_size = int(args.page_size)
        self.local_ip = settings.local_ip()
        self.backend = os.environ.get("KVX_BACKEND", "ucx")
        self.secret = settings.secret()
        self.device = settings.device(args)
        # Where this rank's engine serves Prometheus metrics (KVX_METRICS), checked at start.
        self.metrics = settings.metrics_address(
            (self.pp_rank * self.dp_size + self.dp_rank) * self.tp_size + self.tp_rank)
        self._lock = threading.Lock()
        # Prefill: notified whenever a page allocation arrives.
        self._arrived = threading.Condition(self._lock)
        self._closed = threading.Event()
        corrupt = os.environ.get("KVX_TEST_CORRUPT_ROOM")
        self.corrupt_room: Optional[int] = int(corrupt) if corrupt else None
        # The metadata buffers (first output token, logprobs...): one row per request slot.
        self.aux = [(int(p), int(n), int(i)) for p, n, i in zip(
            getattr(args, "aux_data_ptrs", None) or [], getattr(args, "aux_data_lens", None) or [],
            getattr(args, "aux_item_lens", None) or [])]
        if disaggregation_mode == DisaggregationMode.PREFILL:
            first = int(getattr(args, "prefill_start_layer", 0) or 0)
            self.pool = _Pool(args, self.is_mla_backend, first)
            port = getattr(server_args, "disaggregation_bootstrap_port", None)
            host = settings.url_host(settings.bootstrap_host(server_args))
            self.bootstrap_url = f"http://{host}:{port}"
            # The rank's one PrefillEngine, for every decode, started with the first one.
            self._prefill: Optional[kvx.PrefillEngine] = None
            self._instance = ""  # how the decodes name this prefill instance
            # The rank's vote-mesh socket (PP > 1), bound and published once: a start tried again
            # keeps the address the other PP ranks read.
            self._mesh_socket = None
            self._start_lock = threading.Lock()
            self._allocations: dict = {}  # room -> (PrefillEngine, IncomingRequest)
            # Rooms SGLang aborted before their allocation came (the latest ones): an allocation
            # of one that still arrives is dropped and released, not kept for a sender gone.
            self._aborted: "collections.OrderedDict[int, None]" = collections.OrderedDict()
            self._registered = False
            self.register_to_bootstrap()
        else:
            heads = None
            if not self.is_mla_backend and not getattr(args, "kv_head_num", 0):
                heads = settings.model_kv_heads(server_args, self.tp_size)
            # A pipelined decode: this rank is one stage, holding its layers only, which it takes
            # from the prefill PP rank of its stage (SGLang pairs stages of equal PP sizes so).
            first, self.total_layers = 0, 0
            if self.pp_size > 1:
                first, layers, self.total_layers = settings.decode_stage_layers(
                    server_args, self.pp_rank, self.pp_size)
            self.pool = _Pool(args, self.is_mla_backend, first, heads)
            if self.pp_size == 1:
                self.total_layers = self.pool.num_layers
            elif layers != self.pool.num_layers:
                raise kvx.ConfigError(
                    f"kvx: decode PP stage {self.pp_rank} of {self.pp_size} holds "
                    f"{self.pool.num_layers} layers, SGLang's split gives it {layers}")
            self._engine: Optional[kvx.DecodeEngine] = None  # every prefill instance's sessions
            # Each DP group of a prefill instance is a session of the engine, named by
            # session_name (the instance's bootstrap address where it has one group).
            self._pp: dict = {}  # session -> its PP size
            self._fan_in: dict = {}  # session -> prefill TP ranks writing into this rank
            self._instances: dict = {}  # session -> directory instance we announced it to
            self._sessions: dict = {}  # bootstrap_addr -> {session: its DP group}
            self._dp_sizes: dict = {}  # bootstrap_addr -> the instance's DP groups
            self._misses: dict = {}  # bootstrap_addr -> heartbeats missed in a row
            self._rooms: dict = {}  # room -> DecodeEngine
            self._quarantined: set = set()  # failed rooms whose pages kvx still holds
            # What the decode scheduler reads of each prefill instance (one DP rank each).
            self.prefill_info_table: dict = {}
            self.id = f"{os.getpid()}-{self.tp_rank}-{id(self):x}"
            # SGLang's decode scheduler asks a prefill's directory for rooms' DP groups
            # (/query_dp_ranks) on a pool it takes from the manager, made on first use.
            self._queries: Optional[concurrent.futures.ThreadPoolExecutor] = None
            _release_failed_rooms_on_kvx_decision()
            threading.Thread(target=self._heartbeat, daemon=True, name="kvx-heartbeat").start()
        if settings.state_log_interval() is not None:
            threading.Thread(target=self._log_state, daemon=True, name="kvx-state").start()

    def state(self) -> dict:
        """What this rank holds per room, in the manager and in its engine: every count is back to
        zero once its rooms are over, failed ones included (SGLang cleared them, kvx released
        their pages)."""
        with self._lock:
            if self.disaggregation_mode == DisaggregationMode.PREFILL:
                held = {"allocations": len(self._allocations)}
                engine, keys = self._prefill, ("requests", "undecided")
            else:
                held = {"rooms": len(self._rooms), "quarantined_rooms": len(self._quarantined)}
                engine = self._engine
                keys = ("requests", "in_flight", "awaiting_abort_ack", "quarantined")
        if engine is not None:
            stats = engine.stats()
            held.update({f"engine_{k}": stats[k] for k in keys})
        return held

    def _log_state(self):
        interval = settings.state_log_interval()
        while not self._closed.wait(interval):
            try:
                logger.info("kvx: state %s", json.dumps(self.state(), sort_keys=True))
            except kvx.KvxError as e:  # a closed engine
                logger.info("kvx: state unavailable: %s", e)

    def _get(self, url: str, timeout: float = 5.0):
        return http("GET", url, timeout=timeout, key=self.secret)

    def _put(self, url: str, body: dict, timeout: float = 5.0):
        return http("PUT", url, body, timeout=timeout, key=self.secret)

    # Prefill side.

    def register_room(self, room: int) -> None:
        """Tells the directory that this rank's DP group took `room`, where decode cannot know it
        from the room (a prefill of several DP groups that does not route by the modulo).

        Raises OSError when the directory cannot be told (decode would wait for the room in vain)."""
        if self.dp_size <= 1 or self.follow_room:
            return
        self._put(f"{self.bootstrap_url}/kvx/dp_rank",
                  {"bootstrap_room": int(room), "dp_rank": self.dp_rank})

    def register_to_bootstrap(self):
        """Publishes this prefill rank in its instance's directory (once; called from __init__)."""
        if self.disaggregation_mode != DisaggregationMode.PREFILL or self._registered:
            return
        info = {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "pp_rank": self.pp_rank,
                "pp_size": self.pp_size, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "first_layer": self.pool.first_layer, "num_layers": self.pool.num_layers,
                "page_size": self.page_size, "page_bytes": self.pool.page_bytes,
                "split_kv": self.pool.split, "backend": self.backend,
                "kv_heads": self.pool.kv_heads, "head_bytes": self.pool.head_bytes,
                "follow_bootstrap_room": self.follow_room}
        deadline = time.monotonic() + settings.bootstrap_timeout()
        while True:
            try:
                self._put(f"{self.bootstrap_url}/kvx/prefill", info)
                break
            except OSError:
                # Rank 0's server starts the directory; other ranks may get here first.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self._registered = True
        threading.Thread(target=self._watch_decodes, daemon=True, name="kvx-watch").start()

    def _watch_decodes(self):
        """Serves each decode engine announced in the directory, waiting for announcements in a
        long poll (an idle prefill rank asks once every ``DECODE_POLL_S``)."""
        seen = 0
        while not self._closed.is_set():
            try:
                got = self._get(f"{self.bootstrap_url}/kvx/decode?since={seen}"
                                f"&wait={DECODE_POLL_S}", timeout=DECODE_POLL_S + 5)["decodes"]
            except OSError:
                got = None
            for d in got or []:
                seen += 1
                if self._writes_into(d):
                    threading.Thread(target=self._serve, args=(d,), daemon=True).start()
            if got is None:
                # The directory is not up (yet) or went away: ask again soon, not in a hot loop.
                self._closed.wait(0.2)

    def _writes_into(self, d: dict) -> bool:
        """Whether this prefill rank writes into the decode rank `d` announced (its TP rank holds
        heads, or for MLA the latent, that decode rank takes from this one)."""
        try:
            if int(d.get("dp_rank", 0)) != self.dp_rank:
                return False  # it takes the rooms of another DP group of this prefill server
            stages = int(d.get("pp_size", 1))
            if stages > 1 and (stages, int(d.get("pp_rank", 0))) != (self.pp_size, self.pp_rank):
                # A pipelined decode takes each stage from the prefill PP rank of its stage.
                if stages != self.pp_size:
                    logger.error("kvx: decode %s has %d PP stages, this prefill %d: not served",
                                 d.get("decode_id"), stages, self.pp_size)
                return False
            return self.tp_rank in kvx.tp_sources(self.tp_size, int(d.get("tp_size", self.tp_size)),
                                                  self.pool.kv_heads, int(d["tp_rank"]))
        except (kvx.ConfigError, KeyError, ValueError) as e:
            logger.error("kvx: decode %s cannot be mapped onto this prefill: %s",
                         d.get("decode_id"), e)
            return False

    def _serve(self, d: dict):
        """Serves the decode engine `d` announced, trying again while it cannot be reached or
        linked (it is still starting, its listener turns connections away, the pipeline's vote
        mesh is not up yet): every LINK_RETRY_S, doubling to LINK_RETRY_MAX_S, for as long as
        SGLang's bootstrap timeout from the announcement. A decode this rank can never serve (its
        layout, the secret) is given up at once."""
        deadline = time.monotonic() + settings.bootstrap_timeout()
        wait = LINK_RETRY_S
        while not self._closed.is_set():
            try:
                self._link(d)
                return
            except (kvx.ConfigError, kvx.AuthError, kvx.ShutdownError, KeyError, ValueError):
                logger.exception("kvx: cannot serve decode %s", d.get("decode_id"))
                return
            except Exception as e:
                if isinstance(e, kvx.ControlError) and getattr(e, "cause", None) == "refused":
                    # A Hello refused for good: another layout, configuration or version.
                    logger.error("kvx: cannot serve decode %s: %s", d.get("decode_id"), e)
                    return
                if time.monotonic() + wait > deadline:
                    logger.exception("kvx: cannot serve decode %s: gave up", d.get("decode_id"))
                    return
                logger.warning("kvx: cannot serve decode %s yet (%s): trying again in %.1f s",
                               d.get("decode_id"), e, wait)
            self._closed.wait(wait)
            wait = min(2 * wait, LINK_RETRY_MAX_S)

    def _link(self, d: dict) -> None:
        """Links decode `d` once: the rank's one PrefillEngine starts with the first decode (its
        vote mesh is the pipeline's), every later one is added to it."""
        with self._start_lock:
            started = self._prefill is None
            if started:
                self._prefill = self._start_prefill(d)
            engine = self._prefill
        instance = str(d.get("instance", ""))
        if instance != self._instance:
            # The rank names its pipeline once, in every handshake: a decode that calls it
            # otherwise cannot be served by this engine.
            logger.error("kvx: decode %s names this prefill instance %r, not %r: not served",
                         d["decode_id"], instance, self._instance)
            return
        if not started:
            n = engine.add_decode(d["address"])
            logger.info("kvx: prefill rank (TP %d, PP %d) serves decode %s too (link %d)",
                        self.tp_rank, self.pp_rank, d["decode_id"], n)

    def _start_prefill(self, d: dict) -> "kvx.PrefillEngine":
        """The rank's PrefillEngine, started against decode `d`, with the pipeline's vote mesh."""
        peers, mesh_socket = [], None
        if self.pp_size > 1:
            # Bound once and held, so the port published below stays ours until the rank starts,
            # however many times its start is tried.
            if self._mesh_socket is None:
                mesh_socket = kvx.MeshSocket(f"{settings.url_host(self.local_ip)}:0")
                self._put(f"{self.bootstrap_url}/kvx/mesh", {
                    "tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "dp_rank": self.dp_rank,
                    "addr": mesh_socket.address})
                self._mesh_socket = mesh_socket
            mesh_socket = self._mesh_socket
            deadline = time.monotonic() + 60
            while True:
                mesh = self._get(f"{self.bootstrap_url}/kvx/mesh?tp_rank={self.tp_rank}"
                                 f"&dp_rank={self.dp_rank}")["mesh"]
                if len(mesh) == self.pp_size:
                    peers = [mesh[str(r)] for r in range(self.pp_size)]
                    break
                if time.monotonic() > deadline:
                    raise kvx.Timeout(f"PP ranks of TP rank {self.tp_rank} never all published")
                time.sleep(0.02)
        self._instance = str(d.get("instance", ""))
        engine = kvx.PrefillEngine(
            decode=d["address"], pp_rank=self.pp_rank, pp_size=self.pp_size,
            layout=self.pool.layout, total_layers=int(d["total_layers"]),
            page_tokens=self.page_size, memory=self.pool.memory, peers=peers,
            mesh_socket=mesh_socket, instance=self._instance, keep_open=True,
            secret=self.secret, backend=self.backend, device=self.device,
            tp_rank=self.tp_rank, tp_size=self.tp_size, tp_mode=self.pool.tp_mode,
            kv_heads=self.pool.kv_heads,
            metrics=self.metrics,
            engine_id=f"sglang-prefill-{self.dp_rank}-{self.tp_rank}-{self.pp_rank}-{os.getpid()}")
        logger.info("kvx: prefill engine started (DP %d, TP %d, PP %d): one engine for every "
                    "decode", self.dp_rank, self.tp_rank, self.pp_rank)
        threading.Thread(target=self._take_allocations, args=(engine,), daemon=True,
                         name="kvx-allocations").start()
        return engine

    def _take_allocations(self, engine: "kvx.PrefillEngine"):
        """Hands every page allocation, from whichever decode, to the room's sender."""
        while not self._closed.is_set():
            req = engine.next_request(0.5)
            if req is None:
                if engine.closed:
                    return
                continue
            with self._lock:
                gone = req.request in self._aborted
                if gone:
                    del self._aborted[req.request]
                else:
                    self._allocations[req.request] = (engine, req)
                    self._arrived.notify_all()
            if gone:
                release_when_decided(engine, req.request)

    def allocation(self, room: int):
        with self._lock:
            return self._allocations.get(room)

    def await_allocation(self, room: int, timeout: float):
        """`room`'s allocation, waiting for it at most `timeout` seconds; None if it did not come,
        or if the pipeline decided the room failed meanwhile (decode gave it up: ``given_up``)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while room not in self._allocations:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set() or self._decided_failed(room) is not None:
                    return None
                self._arrived.wait(min(left, 0.5))
            return self._allocations[room]

    def _decided_failed(self, room: int):
        """The failed decision this rank's engine keeps on `room`, if any (it registers
        nothing, so a scheduler may ask on every poll)."""
        engine = self._prefill
        try:
            outcome = engine.decision(room) if engine is not None else None
        except kvx.KvxError:  # the engine closed (the manager is closing)
            return None
        return None if outcome is None or outcome.complete else outcome

    def given_up(self, room: int) -> Optional[BaseException]:
        """Why `room` failed before its allocation reached this rank (decode gave it up, or a PP
        peer failed it), or None: a sender that waits for the allocation fails with it at once
        instead of at SGLang's bootstrap timeout."""
        outcome = self._decided_failed(room)
        return None if outcome is None else outcome.error()

    def forget(self, room: int):
        with self._lock:
            self._allocations.pop(room, None)

    def forget_aborted(self, room: int, engine: "kvx.PrefillEngine") -> None:
        """`room` was aborted before its allocation reached its sender: the allocation, now here
        or still to come, is dropped and the engine's bookkeeping of it released once decided."""
        with self._lock:
            got = self._allocations.pop(room, None)
            if got is None:
                self._aborted[room] = None
                while len(self._aborted) > ABORTED_ROOMS_KEPT:
                    self._aborted.popitem(last=False)
        if got is not None:
            release_when_decided(engine, room)

    def prefill_engine(self) -> "Optional[kvx.PrefillEngine]":
        """This rank's prefill engine, if it started."""
        with self._lock:
            return self._prefill

    # Decode side.

    def _decode(self) -> "kvx.DecodeEngine":
        """This rank's one DecodeEngine, started on first use, with no instance yet."""
        with self._lock:
            if self._engine is not None:
                return self._engine
        e = kvx.DecodeEngine(
            layout=self.pool.layout, total_layers=self.total_layers, page_tokens=self.page_size,
            pp_stage=(self.pp_rank, self.pp_size),
            pp_size=0, memory=self.pool.memory,
            listen=f"{settings.url_host(self.local_ip)}:0",
            secret=self.secret, backend=self.backend, device=self.device,
            engine_id=f"sglang-decode-{self.id}", tp_rank=self.tp_rank, tp_size=self.tp_size,
            tp_mode=self.pool.tp_mode, kv_heads=self.pool.kv_heads,
            metrics=self.metrics, progress_fifo=settings.progress_fifo(),
            progress_spin_us=settings.progress_spin_us(),
            landing_bytes=settings.landing_bytes(), landing_slots=settings.landing_slots(),
            # Alike on every TP rank of this server: a prefill rank writing into several of them
            # serves a request's allocations as one.
            decode_instance=f"sglang-decode-{settings.url_host(self.local_ip)}:"
                            f"{getattr(self.server_args, 'port', 0)}"
                            + (f"#dp{self.dp_rank}" if self.dp_size > 1 else ""))
        with self._lock:
            if self._engine is None:
                self._engine = e
                logger.info("kvx: decode engine started on %s (TP rank %d): one engine for every "
                            "prefill instance", e.address, self.tp_rank)
                return e
            won = self._engine
        e.shutdown(1)  # another receiver won the race; nobody knew this one
        return won

    def session(self, bootstrap_addr: str, dp_rank: int) -> str:
        """The session that DP group `dp_rank` of the prefill instance at `bootstrap_addr` is."""
        with self._lock:
            dp_size = self._dp_sizes.get(bootstrap_addr, 1)
        return session_name(bootstrap_addr, dp_rank, dp_size)

    def decode_engine(self, bootstrap_addr: str, dp_rank: int = 0) -> "kvx.DecodeEngine":
        """The DecodeEngine, serving DP group `dp_rank` of the prefill instance at
        `bootstrap_addr` (added as a session named ``session(bootstrap_addr, dp_rank)``, and
        announced to the group's ranks, on first use)."""
        name = self.session(bootstrap_addr, dp_rank)
        with self._lock:
            if name in self._pp and self._engine is not None:
                return self._engine
        url = f"http://{bootstrap_addr}"
        got = self._get(f"{url}/kvx/prefill")
        if got["ranks"]:
            self._refuse_other_instance(got["ranks"][0], bootstrap_addr)
        dp_size = _dp_size(got["ranks"])
        if not 0 <= dp_rank < dp_size:
            raise kvx.ConfigError(f"kvx: prefill instance {bootstrap_addr} has {dp_size} DP "
                                  f"groups; SGLang asked for DP rank {dp_rank}")
        with self._lock:
            self._dp_sizes[bootstrap_addr] = dp_size
        name = session_name(bootstrap_addr, dp_rank, dp_size)
        mine = self._sources(got["ranks"], dp_rank)
        if not mine:
            raise kvx.ConfigError(f"kvx: no prefill rank of DP group {dp_rank} writes into TP "
                                  f"rank {self.tp_rank} at {bootstrap_addr}")
        pp_size = int(mine[0]["pp_size"])
        prefill_tp = int(mine[0].get("tp_size", self.tp_size))
        e = self._decode()
        e.add_instance(name, pp_size, tp_size=prefill_tp)
        with self._lock:
            if name in self._pp:  # another receiver won the race
                return e
            self._pp[name] = pp_size
            self._fan_in[name] = len(mine) // self._stages_in(pp_size)
            self._sessions.setdefault(bootstrap_addr, {})[name] = dp_rank
        logger.info("kvx: decode engine serves prefill instance %s as session %s (DP group %d of "
                    "%d, PP size %d)", bootstrap_addr, name, dp_rank, dp_size, pp_size)
        self._announce(bootstrap_addr, name, dp_rank, got["instance"])
        return e

    def _layout_info(self) -> dict:
        """What a prefill instance must match to be mapped onto this decode rank."""
        return {"tp_size": self.tp_size, "page_size": self.page_size,
                "page_bytes": self.pool.page_bytes, "split_kv": self.pool.split,
                "kv_heads": self.pool.kv_heads, "head_bytes": self.pool.head_bytes,
                "radix_cache": bool(getattr(self.server_args,
                                            "disaggregation_decode_enable_radix_cache", False))}

    def _sources(self, ranks: list, dp_rank: int = 0) -> list:
        """The registered prefill ranks of DP group `dp_rank` that write into this decode rank
        (every PP rank, or on a pipelined decode the one of its stage, of each TP rank of the
        group that holds heads, or the latent, this rank takes)."""
        ranks = [r for r in ranks if int(r.get("dp_rank", 0)) == dp_rank]
        if not ranks:
            return []
        prefill_tp = int(ranks[0].get("tp_size", self.tp_size))
        writers = set(kvx.tp_sources(prefill_tp, self.tp_size, self.pool.kv_heads, self.tp_rank))
        return [r for r in ranks if int(r["tp_rank"]) in writers
                and (self.pp_size == 1 or int(r["pp_rank"]) == self.pp_rank)]

    def _refuse_other_instance(self, rank: dict, addr: str) -> None:
        """A prefill instance kvx cannot map into this decode rank, refused naming what differs:
        its layout, or on a pipelined decode a pipeline of another size (whose stages are not
        this decode's)."""
        _refuse_other_layout(self._layout_info(), rank, addr)
        theirs = int(rank.get("pp_size", 1))
        if self.pp_size > 1 and theirs != self.pp_size:
            raise kvx.ConfigError(f"kvx: prefill instance {addr} has PP size {theirs}, this decode "
                                  f"{self.pp_size} stages: a pipelined decode takes pipelines of "
                                  "as many stages")

    def _stages_in(self, pp_size: int) -> int:
        """How many PP ranks of a pipeline of `pp_size` write into this decode rank."""
        return 1 if self.pp_size > 1 else max(pp_size, 1)

    def aux_slot(self, session: str) -> int:
        """The rank slot whose metadata row decode reads for a request of that session: the
        first source of the last PP rank writing into this rank (every source of it sends the
        same row; on a pipelined decode, its stage's rank)."""
        pp, fan_in = self._pp.get(session, 1), self._fan_in.get(session, 1)
        return (self._stages_in(pp) - 1) * fan_in

    def _announce(self, bootstrap_addr: str, session: str, dp_rank: int, instance: str) -> None:
        """Tells the ranks of DP group `dp_rank` at `bootstrap_addr` (directory `instance`) of
        this decode engine, for `session`."""
        self._put(f"http://{bootstrap_addr}/kvx/decode", {
            "decode_id": f"{self.id}-{session}", "tp_rank": self.tp_rank,
            "tp_size": self.tp_size, "dp_rank": dp_rank,
            "address": self._decode().address, "total_layers": self.total_layers,
            "pp_rank": self.pp_rank, "pp_size": self.pp_size, "instance": session})
        with self._lock:
            self._instances[session] = instance

    def _heartbeat(self):
        interval, max_misses = settings.heartbeat()
        while not self._closed.wait(interval):
            with self._lock:
                addrs = {a: dict(s) for a, s in self._sessions.items()}
            for addr, sessions in addrs.items():
                try:
                    self._beat(addr, sessions, interval, max_misses)
                except Exception:  # one instance's answer must not end the heartbeat
                    logger.exception("kvx: heartbeat to prefill instance %s failed", addr)

    def _beat(self, addr: str, sessions: dict, interval: float, max_misses: int) -> None:
        """One heartbeat to prefill instance `addr`, whose sessions are `sessions`."""
        try:
            got = self._get(f"http://{addr}/kvx/prefill", timeout=interval)
        except OSError:
            got = None
        with self._lock:
            misses = 0 if got is not None else self._misses.get(addr, 0) + 1
            self._misses[addr] = misses
            known = {name: self._instances.get(name) for name in sessions}
        if got is None:
            if misses >= max_misses and any(v is not None for v in known.values()):
                # Lost: SGLang fetches the instance again before its next request; the
                # engine has failed the requests of the ranks whose connections ended.
                logger.warning("kvx: prefill instance %s lost (%d heartbeats missed)",
                               addr, misses)
                with self._lock:
                    self.prefill_info_table.pop(addr, None)
                    for name in sessions:
                        self._instances[name] = None
            return
        for name, dp_rank in sessions.items():
            if got.get("instance") == known[name]:
                continue
            pp = [int(r["pp_size"]) for r in self._sources(got.get("ranks", []), dp_rank)]
            if pp and pp[0] != self._pp.get(name):
                logger.error("kvx: prefill instance %s came back with PP size %d, not %d: "
                             "not served", addr, pp[0], self._pp.get(name))
                continue
            again = "back" if known[name] is None else "a new start"
            logger.info("kvx: prefill instance %s (session %s) is %s: announcing decode "
                        "again", addr, name, again)
            try:
                self._announce(addr, name, dp_rank, got["instance"])
            except OSError:
                logger.warning("kvx: cannot announce decode to %s yet", addr)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Whether the prefill instance at `bootstrap_addr` registered the ranks of every DP group
        (without blocking the scheduler for long)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        try:
            ranks = self._get(f"http://{bootstrap_addr}/kvx/prefill", timeout=1.0)["ranks"]
        except OSError:
            return False
        dp_size = _dp_size(ranks)
        pp_size = 1
        for group in range(dp_size):
            try:
                if ranks:
                    self._refuse_other_instance(ranks[0], bootstrap_addr)
                mine = self._sources(ranks, group)
                writers = len({int(r["tp_rank"]) for r in mine})
            except kvx.ConfigError:
                # kvx cannot map it: the instance is reported there, and each receiver fails at
                # once naming what differs (decode_engine), rather than waiting for ranks that
                # never come.
                mine, writers = ranks, 0
            if not mine or (writers and
                            len(mine) < self._stages_in(int(mine[0]["pp_size"])) * writers):
                return False
            pp_size = int(mine[0]["pp_size"])
        with self._lock:
            self._dp_sizes[bootstrap_addr] = dp_size
        # Where prefill routes rooms by the modulo, SGLang's decode takes a room's DP group as
        # the room modulo dp_size; otherwise it asks the directory (/query_dp_ranks), where each
        # prefill sender registered its room (register_room).
        follow = all(bool(r.get("follow_bootstrap_room", True)) for r in ranks)
        self.prefill_info_table[bootstrap_addr] = types.SimpleNamespace(
            dp_size=dp_size, follow_bootstrap_room=follow, pp_size=pp_size)
        return True

    def aux_row(self, index: int) -> bytes:
        """The metadata row `index` of every aux buffer, concatenated."""
        out = bytearray()
        for ptr, length, item in self.aux:
            if (index + 1) * item > length:
                raise kvx.ConfigError(f"kvx: aux row {index} is outside its buffer")
            out += ctypes.string_at(ptr + index * item, item)
        return bytes(out)

    def write_aux_row(self, index: int, data: bytes) -> None:
        """Writes `data` (as `aux_row` reads it) into metadata row `index`."""
        if len(data) != sum(item for _, _, item in self.aux):
            raise kvx.ConfigError(
                f"kvx: aux payload of {len(data)} bytes does not match this side's metadata rows")
        at = 0
        for ptr, length, item in self.aux:
            if (index + 1) * item > length:
                raise kvx.ConfigError(f"kvx: aux row {index} is outside its buffer")
            ctypes.memmove(ptr + index * item, data[at:at + item], item)
            at += item

    def corrupt_first_page(self, pages: List[int]) -> None:
        """Test only (``KVX_TEST_CORRUPT_ROOM``): flips one bit of the top byte of the first value
        of the request's first page in the first buffer, after it arrived, so a test can see that
        decode's tokens come from the moved pages."""
        if not pages:
            return
        ptr, _ = self.pool.memory[0]
        byte = ctypes.c_uint8.from_address(ptr + pages[0] * self.pool.page_bytes + 3)
        byte.value ^= 0x40
        logger.warning("kvx: KVX_TEST_CORRUPT_ROOM: corrupted page %d of room %d", pages[0],
                       self.corrupt_room)

    def chunk_tokens(self) -> int:
        want = int(os.environ.get("KVX_CHUNK_TOKENS", "1024"))
        return max(1, want // self.page_size) * self.page_size

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """True once no write of any prefill rank can still land in the room's pages."""
        with self._lock:
            e = self._rooms.get(bootstrap_room)
        if e is None:
            return True
        if e.is_released(bootstrap_room):
            if bootstrap_room in self._quarantined:
                self._quarantined.discard(bootstrap_room)
                logger.info("kvx: room %d: its prefill ranks confirmed; its pages are released",
                            bootstrap_room)
            return True
        if bootstrap_room not in self._quarantined and bootstrap_room in e.quarantined():
            self._quarantined.add(bootstrap_room)
            logger.warning("kvx: room %d: quarantined: a prefill rank has not confirmed that its "
                           "writes into the room's pages are over; they stay held until it does",
                           bootstrap_room)
        return False

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """SGLang releases a failed room's pages: this rank forgets the room."""
        with self._lock:
            self._rooms.pop(bootstrap_room, None)
            self._quarantined.discard(bootstrap_room)

    def _ensure_prefill_recompute_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The decode manager's thread pool on which SGLang's decode scheduler runs its queries of
        a prefill's directory for the DP group of rooms (``prefetch_prefill_dp_rank_queries``, for a
        prefill whose rooms do not follow the modulo). SGLang's own managers name it for their
        other use of it, re-running a retracted request's prefill (`submit_prefill_recompute`),
        which kvx's manager does not offer."""
        with self._lock:
            if self._queries is None:
                self._queries = concurrent.futures.ThreadPoolExecutor(
                    max_workers=2, thread_name_prefix="kvx-dp-query")
            return self._queries

    def close(self):
        self._closed.set()
        self._mesh_socket = None  # its port goes with the engine that holds it
        with self._lock:
            prefills = [p for p in [getattr(self, "_prefill", None)] if p is not None]
            decode = getattr(self, "_engine", None)
            queries, self._queries = getattr(self, "_queries", None), None
        if queries is not None:
            queries.shutdown(wait=False, cancel_futures=True)
        for p in prefills:
            p.close()
        if decode is not None:
            decode.shutdown(5)

    teardown = close
