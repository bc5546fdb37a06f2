"""The scheduling of a server's threads, read from ``/proc`` (proc(5)) across its process tree."""

from __future__ import annotations

import os
from pathlib import Path

# sched_setscheduler(2)'s numbering, as /proc/<pid>/stat reports a thread's policy.
SCHED_OTHER, SCHED_FIFO = 0, 1


def _stat(path: Path):
    """(comm, fields after comm) of one stat file, or None if the task is gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    # `pid (comm) state ...`: comm may hold spaces and parentheses, so fields follow its last ')'.
    return text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 1:].split()


def tree(pid: int) -> "list[int]":
    """``pid`` and every process descended from it."""
    parents = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and (st := _stat(p / "stat")) is not None:
            parents[int(p.name)] = int(st[1][1])  # field 4, ppid
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(c for c, parent in parents.items() if parent == p)
    return found


def threads_named(pid: int, prefix: str) -> "list[tuple[str, int, int]]":
    """(name, policy, realtime priority) of every thread in ``pid``'s process tree whose name
    (cut at 15 bytes by the kernel) starts with ``prefix``."""
    return _threads(tree(pid), prefix)


def own_threads_named(prefix: str) -> "list[tuple[str, int, int]]":
    """``threads_named`` for this process alone."""
    return _threads([os.getpid()], prefix)


def _threads(pids: "list[int]", prefix: str) -> "list[tuple[str, int, int]]":
    found = []
    for p in pids:
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for t in tasks:
            st = _stat(t / "stat")
            if st is not None and st[0].startswith(prefix):
                # Fields 40 (rt_priority) and 41 (policy); the first field after comm is field 3.
                found.append((st[0], int(st[1][38]), int(st[1][37])))
    return found

