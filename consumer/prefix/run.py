"""The worker's side of the prefix cache: a lane's store, and one fused call with its restores and saves
(run on the thread that runs the call: the compute thread with overlap on)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas import Phase
from schemas.prefix import SCOPES, PrefixSummary, Scope

from ..batch import FusedBatch
from ..engines.base import lending_forward
from .planner import PrefixPlanner, Refill, Save
from .store import PrefixStore

if TYPE_CHECKING:
    from ..batch import EngineOutput
    from ..config import WorkerSettings
    from ..sched import ScheduledBatch, Scheduler

__all__ = ["forward_with_prefix", "prefix_store", "prefix_summary", "refill_finished", "save_finished"]

log = logging.getLogger("dgr.prefix")


def prefix_store(engine: Any, scheduler: Scheduler, keys: Mapping[Phase, Any],
                 settings: WorkerSettings) -> PrefixStore | None:
    """The lane's store, planned into its scheduler, or None: cache off (no budget), no prefill phase, or
    an engine that cannot save a slot by prefix (its reason logged in describe: `prefix_unsupported`)."""
    if settings.prefix_cache_scope not in SCOPES:
        raise ValueError(f"prefix cache scope must be one of {SCOPES}, not {settings.prefix_cache_scope!r}")
    unsupported = getattr(engine, "prefix_unsupported", None)
    if settings.prefix_cache_bytes <= 0 or "prefill" not in keys or unsupported is None or unsupported():
        return None
    scope: Scope = settings.prefix_cache_scope
    store = PrefixStore(settings.prefix_cache_bytes, scope=scope)
    window = getattr(engine, "prefix_window", None)
    key = keys["prefill"]
    # A batch-invariant recipe refills finished answers when the engine can trim a slot back to its prompt.
    refill = scheduler.config.capacity.max_tokens_per_call if hasattr(engine, "keep_prefix") else 0
    scheduler.prefix = PrefixPlanner(store, key.digest, scope, window() if window is not None else 0,
                                     decoded=not key.recipe.batch_invariant, refill=refill)
    return store


def prefix_summary(lanes: Iterable[Any], metrics: Any) -> PrefixSummary | None:
    """The heartbeat's summary: the first caching engine's bounded PrefixSummary (schemas/prefix.py, the
    input of placement); every caching engine's counters go to /metrics on the way."""
    first: PrefixSummary | None = None
    for lane in lanes:
        store: PrefixStore | None = lane.prefix
        if store is None:
            continue
        metrics.observe_prefix(lane.name, store.stats.as_dict(), store.bytes)
        if first is None:
            first = PrefixSummary.of(store.block_tokens, store.scope, store.held_ids())
    return first


def forward_with_prefix(engine: Any, store: PrefixStore | None, batch: ScheduledBatch,
                        fused: FusedBatch) -> EngineOutput:
    """Restore the call's cached prefixes into their slots, run the call, then save the slots whose prompt
    rows now cover a block the cache lacks (only after the call succeeded: never a half-written block)."""
    forward = lending_forward(engine)  # the worker reads a call's rows before the engine runs again (worker/chain.py)
    if store is None or not (batch.restores or batch.saves):
        return forward(fused)
    try:
        for r in batch.restores:
            engine.restore_prefix(r.slot, r.hit.entry.data, r.hit.n_tokens)
    finally:
        for r in batch.restores:
            store.let_go(r.hit)
    out = forward(fused)
    for s in batch.saves:
        store.put(engine.save_prefix(s.slot), s.ids, s.n_tokens, floor=engine.prefix_floor(s.slot), tokens=s.tokens)
    return out


def save_finished(engine: Any, store: PrefixStore, save: Save) -> None:
    """Save a finished session's slot before it is cleared (a recipe that caches decoded positions: the
    answer a next turn re-sends). Runs only while no call is in flight on the engine; a failure loses the
    entry, never the release."""
    try:
        store.put(engine.save_prefix(save.slot), save.ids, save.n_tokens, floor=engine.prefix_floor(save.slot),
                  tokens=save.tokens)
    except Exception as e:  # the cache is an optimisation: the slot is released regardless
        log.warning("slot %d: saving the finished session's %d positions failed: %s", save.slot, save.n_tokens, e)


def refill_finished(engine: Any, store: PrefixStore, refill: Refill) -> None:
    """Recompute a finished session's answer as one prompt piece and save the slot (a batch-invariant recipe:
    PrefixPlanner.refill_answer), before it is cleared. Runs only while no call is in flight on the engine; a
    failure loses the entry, never the release."""
    n = len(refill.tokens)
    piece = FusedBatch(phase="prefill", slots=np.full(n, refill.slot, np.int32),
                       positions=np.arange(refill.start, refill.start + n, dtype=np.int32),
                       tokens=np.asarray(refill.tokens, dtype=np.int32),
                       wants_logits=np.arange(n) == n - 1)  # one logits row, as any prompt piece that ends
    try:
        engine.keep_prefix(refill.slot, refill.start)
        engine.forward(piece)
    except Exception as e:  # the cache is an optimisation: the slot is released regardless
        log.warning("slot %d: recomputing the finished session's %d answer positions failed: %s", refill.slot, n, e)
        return
    store.stats.refilled_tokens += n
    save_finished(engine, store, refill.save)
