"""kvdisagg's I/O threads, free of the core binding vLLM gives its worker.

vLLM's CPU backend binds each worker's main thread to the cores of its OpenMP binding, and every
thread started from it inherits that. With the default binding, instances on one host can all
land on one core, where a worker spinning between steps starves the threads that move KV until
timeouts run out (docs/operations.md). Ours only move bytes and wait on sockets: they may run on
any core the process may use.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any


def host_cpus() -> set[int]:
    """Every CPU the process's cgroup allows (not the calling thread's binding)."""
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as f:
            text = f.read().strip()
        cpus: set[int] = set()
        for part in filter(None, text.split(",")):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
        if cpus:
            return cpus
    except (OSError, ValueError):
        pass
    return set(range(os.cpu_count() or 1))


def unbind_current_thread() -> None:
    """Let the calling thread run on any allowed CPU (best effort: not every OS can)."""
    try:
        os.sched_setaffinity(0, host_cpus())
    except (AttributeError, OSError):
        pass


def start_thread(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """A daemon thread running ``target(*args)`` unbound from the worker's cores."""
    def run() -> None:
        unbind_current_thread()
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
