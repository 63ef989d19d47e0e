"""The choice of a worker as defined: one pass over the candidates (`choose`). The Tracker places through its
pools' indexes (producer/pool_index.py), which give the same Choice (tests/test_placement_choose.py); this is what
they are tested against, and what docs/placement.md's score is."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .placement_inputs import Candidate, Choice, PlacementPolicy
from .pool_index import leading

__all__ = ["choose", "eligible"]


def eligible(c: Candidate, digests: Iterable[str], policy: PlacementPolicy) -> bool:
    """Advertises every digest, beats recently, is not draining, has slots at all."""
    age = c.heartbeat_age_s
    return (age is not None and age <= policy.stale_s and not c.draining and c.slots > 0
            and c.digests.issuperset(digests))


def choose(candidates: Sequence[Candidate], digests: Sequence[str], policy: PlacementPolicy,
           ids_for: Mapping[tuple[int, str | None], Sequence[str]] | None = None) -> Choice | None:
    """The worker to place on, or None when none is eligible. `digests`: the hop's prefill and decode keys;
    `ids_for[(block_tokens, scope)]`: the prompt's block ids as a worker of that block size and scope roots
    them (absent: nothing is cached there). Pure: the same inputs give the same worker (ties: fewest load,
    then worker id)."""
    # Written for the Tracker's time per session (docs/placement.md, "Cost"): one pass per list, no object per
    # candidate; the rank is (cost, load, worker id), or (load, worker id) when the guard holds.
    need, stale = frozenset(digests), policy.stale_s
    ok = [c for c in candidates if c.heartbeat_age_s is not None and c.heartbeat_age_s <= stale and not c.draining
          and c.slots > 0 and need <= c.digests]
    if not ok:
        return None
    pool = [c for c in ok if c.slots > c.load] or ok  # never a full worker while another has room
    loads = [c.load for c in pool]
    lo, hi = min(loads), max(loads)
    guarded = hi - lo > policy.balance_abs and hi > policy.balance_rel * lo
    get = (ids_for or {}).get
    ow, qw, pr = policy.overlap_weight, policy.queue_weight, policy.pending_rows
    best: tuple[tuple[Any, ...], Candidate, float, int, int] | None = None
    for c in pool:
        ids = get((c.block_tokens or 0, c.scope), ())
        n = len(ids)
        hit = leading(ids, c.held, c.sent) if n and (ids[0] in c.held or ids[0] in c.sent) else 0
        s = c.slots if c.slots > 1 else 1
        cost = ow * (((n - hit) / n if n else 1.0) + c.pending / pr) + c.load / s + qw * c.queued / s
        rank = (c.load, c.worker_id) if guarded else (cost, c.load, c.worker_id)
        if best is None or rank < best[0]:
            best = rank, c, cost, hit, n
    assert best is not None
    _, c, cost, hit, n = best
    return Choice(c.worker_id, cost, hit, n, c.load, c.slots - c.load, guarded, len(ok))
