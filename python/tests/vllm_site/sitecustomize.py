"""Loaded by every Python process of the tests' vLLM instances (``vllm_instances.base_env`` puts
this folder first on ``PYTHONPATH``): where vLLM busy-waits, it polls with ``time.sleep(0)``
instead of ``os.sched_yield()`` (``vllm.distributed.utils.USE_SCHED_YIELD``, which vLLM turns on
for Python 3.11.1 and later). Nothing else of vLLM changes: it still busy-waits for a second
after each read of its shared-memory broadcast, as shipped.

Why: on this 2-core machine (kernel 6.18) the ``sched_yield`` loops of one instance starve the
other threads of the machine. A decode TP 2 instance whose requests waited for their KV kept
its two workers and its engine core in those loops (their stacks in ``sched_yield``). A watcher at
``SCHED_FIFO`` priority 99 saw those three threads take 1839 of 2000 CPU ticks over 10 s while a
normal thread that sleeps 10 ms at a time stayed runnable and unscheduled for up to 16 s.
Prefill's side-channel thread then answered decode's HELLO 34 s late, past decode's 30 s bound,
and the request fell back to recompute: the stall of kvx engines in TP 2 workers that kept
``test_vllm_tp.py`` out of the test command. Loops of ``time.sleep(0)`` share the CPUs fairly:
with them the watcher's normal thread never went a second unscheduled and ``test_vllm_tp.py``
passed (docs/vllm.md has the runs).

A vLLM without ``USE_SCHED_YIELD`` in that module fails to start here, rather than running the
tests under other conditions than these."""

import importlib.abc
import importlib.util
import sys

_MODULE = "vllm.distributed.utils"


class _PollWithSleep(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            if not hasattr(module, "USE_SCHED_YIELD") or not callable(
                    getattr(module, "sched_yield", None)):
                raise ImportError(f"vllm_site: {_MODULE} has no USE_SCHED_YIELD and "
                                  "sched_yield: the tests' vLLM settings need a look")
            module.USE_SCHED_YIELD = False

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PollWithSleep())
