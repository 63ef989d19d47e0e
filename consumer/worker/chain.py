"""Fused calls chained on the engine thread (issue 32, item 1): the loop offers the decode call that follows
the one computing (`Scheduler.successor`), and the engine thread starts it the moment the call before ends,
its input tokens the argmax of that call's rows, without waiting for the loop to sample, report and build it
(consumer/sched/chaining.py says when a call may follow and why the scheduler's bounds still hold).

One `Link` per call. The engine thread runs a link, takes the offer made for it (under the lock: from then on
the loop can no longer offer or withdraw one), fills the offered call's inputs (`Successor.fill`: not when a
token ends its session, or a row is not a plain greedy one), publishes the link's result with the next link (or
None) and goes on with it. The loop waits for each link's result in turn, so it still samples and reports every
call in order, one call behind the engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..batch import EngineOutput, FusedBatch
from ..prefix.run import forward_with_prefix
from ..sampling.stage import first_cut
from ..sched import ScheduledBatch
from ..sched.chaining import Successor

__all__ = ["Link", "LinkResult", "Ranked", "forward_ranked", "run_chain"]

# A link's result: the engine's output (or the error it raised), its time, when the engine's call ended
# (time.perf_counter(): where the engine's idle starts, before the first cut), and the link the engine thread went
# on with (None: the chain ends here).
LinkResult = tuple["EngineOutput | Exception", float, float, "Link | None"]

# A call's output after the first cut, and when the engine's call started and ended (forward_ranked).
Ranked = tuple[EngineOutput, float, float]

# What decides a link's inputs from the link before: (the offer, the link before, its output) -> whether the
# offer's tokens were written (it may run).
Fill = Callable[[Successor, "Link", EngineOutput], bool]


def forward_ranked(engine: Any, store: Any, batch: ScheduledBatch, fused: FusedBatch) -> Ranked:
    """The call (with its prefix cache's restores and saves), then the sampler's first cut of its rows on the same
    thread while they are in cache (sampling.stage.first_cut: the argmax, and the lane maxima of the rows that cut
    by them): what a chained call's inputs and the loop's sampler start from. With when the call started and ended
    (time.perf_counter()): the engine's own time, without the first cut, a hand-over between threads or a wait
    for the GIL, which are the engine's idle (EngineIdle)."""
    started = time.perf_counter()
    out = forward_with_prefix(engine, store, batch, fused)
    ended = time.perf_counter()
    return first_cut(out, batch), started, ended


class Link:
    """One fused call on the engine thread (a call handed out, or a successor: its rows are the successor's),
    and the call offered to follow it."""

    __slots__ = ("batch", "entered", "entered_at", "fused", "offer", "result", "successor", "taken")

    def __init__(self, batch: ScheduledBatch, fused: FusedBatch, successor: Successor | None = None) -> None:
        self.batch, self.fused, self.successor = batch, fused, successor
        self.result: Future[LinkResult] = Future()
        self.entered = threading.Event()
        self.entered_at = 0.0  # time.perf_counter() when the engine thread started it
        self.offer: Link | None = None
        self.taken = False  # the engine thread took the offer (or its absence): no offer from now on


def run_chain(engine: Any, store: Any, first: Link, lock: threading.Lock, fill: Fill) -> None:
    """On the engine thread: run `first`, then every link offered in time whose inputs `fill` wrote."""
    link: Link | None = first
    while link is not None:
        link.entered_at = time.perf_counter()
        link.entered.set()
        try:
            out: EngineOutput | Exception
            out, _, end = forward_ranked(engine, store, link.batch, link.fused)
        except Exception as e:  # handed back: the loop answers it as run_fused would
            out, end = e, time.perf_counter()
        with lock:
            offer, link.offer, link.taken = link.offer, None, True
        nxt = None
        if offer is not None and offer.successor is not None and not isinstance(out, Exception):
            try:
                nxt = offer if fill(offer.successor, link, out) else None
            except Exception:  # never the engine thread's end: the loop builds the next call as always
                nxt = None
        if nxt is not None and not isinstance(out, Exception):
            out = out.owned()  # the loop reads these rows while the next call overwrites the engine's buffer
        link.result.set_result((out, end - link.entered_at, end, nxt))
        link = nxt
