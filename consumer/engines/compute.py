"""The one thread of a worker process that runs its engines' compute (docs/architecture.md).

llama.cpp's CPU backend runs a graph with OpenMP, and libgomp keeps a team of threads per thread that
starts a parallel region. Once the process holds more such threads than it has cores (a second team:
the engine built on one thread, its calls made on another), libgomp stops spinning at barriers and its
threads sleep and wake at every op: measured with Gemma on 2 cores, ~4,000 sleeps a second per compute
thread against 17 context switches a second in all with one team, and e2e / raw 0.83 against 0.93. So
the consumer builds its engines on this thread and, with `overlap` on, runs every fused call on it,
whether the call overlaps the loop or not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["THREAD_PREFIX", "compute_thread", "on_compute_thread"]

T = TypeVar("T")
THREAD_PREFIX = "dgr-engine"
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def compute_thread() -> ThreadPoolExecutor:
    """The process's compute thread (one worker), started on first use and kept for the process's life."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_PREFIX)
        return _pool


def on_compute_thread(fn: Callable[..., T], /, *args: object, **kwargs: object) -> T:
    """fn(*args, **kwargs) on the compute thread, waited for (at once when already there)."""
    if threading.current_thread().name.startswith(THREAD_PREFIX):
        return fn(*args, **kwargs)
    return compute_thread().submit(fn, *args, **kwargs).result()
