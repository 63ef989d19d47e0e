"""An index over the eligible workers of one pool (the workers advertising a hop's keys), kept by FleetView for
one fleet read: it gives the same Choice as `choose()` (producer/placement_choice.py, the definition) without a
pass of Python arithmetic over every candidate per session (docs/placement.md, "Cost").

Why it is the same choice: a candidate that does not hold the first block of the prompt (as its block size and
scope root it) has miss 1, so its cost is `cost0 = overlap_weight x (1 + pending / pending_rows) + load / slots
+ queue_weight x queued / slots`, computed as choose computes it (none of it depends on the prompt); with
overlap_weight >= 0 a candidate holding blocks costs at most its cost0. So the lowest rank (cost, load, worker
id) is the lowest of the sorted cost0 ranks' first and of the holders' own ranks, and the guard's (load, worker
id) is the sorted loads' first. Both orders are kept per room class (room, full): choose's pool is the workers
with room, or every eligible one when none has room. Only a placement (its load + 1, its pending rows + the
prompt's) or a session's first token (its rows no longer pending) changes a candidate between two reads:
`update` moves its two entries.

Per session the holders of the prompt's first block are visited cheapest floor first (their rank holding every
block), up to the first floor not below the best so far, and each one's leading run is counted on from the run
counted for the last prompt of the same chain (`runs`): a system prompt's next session costs a holder a lookup or
two for its own suffix, not a pass over the system prompt's blocks.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Mapping, Sequence, Set
from itertools import islice, takewhile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .placement_inputs import Candidate, Choice, PlacementPolicy

__all__ = ["PoolIndex", "holds", "leading"]

Group = tuple[int, str | None]


def leading(ids: Sequence[str], held: Set[str], sent: Set[str] = frozenset(), start: int = 0) -> int:
    """schemas.prefix.cached_blocks(ids, held | sent) without building the union, the loops in C (takewhile of
    each set's own membership test): it runs for every worker holding a prompt's first block, per session
    (tests/test_placement_choose.py checks choose against the choice as first written, with cached_blocks).
    Most prompts stop in `held` (the worker's summary) at an id not in `sent` either: one lookup more.
    `start`: the first `start` ids are known to be held (PoolIndex.runs)."""
    n = start + len(list(takewhile(held.__contains__, islice(ids, start, None) if start else ids)))
    if not sent:
        return n
    end = len(ids)
    while n < end and ids[n] in sent:  # a run of blocks sent since the summary, then maybe a held one, and so on
        n += len(list(takewhile(sent.__contains__, islice(ids, n, None))))
        if n < end and ids[n] in held:
            n += len(list(takewhile(held.__contains__, islice(ids, n, None))))
    return n


def holds(c: Candidate, block_id: str) -> bool:
    """The candidate holds the block: in its summary or sent to it since."""
    return block_id in c.held or block_id in c.sent


class PoolIndex:
    """The eligible candidates of one pool, ordered by cost0 and by load within each room class."""

    def __init__(self, candidates: Sequence[Candidate], digests: Sequence[str], policy: PlacementPolicy) -> None:
        from .placement_choice import eligible  # it imports this module
        from .placement_inputs import Choice

        self.policy, self.choice = policy, Choice
        self.ok: dict[str, Candidate] = {}
        self.by_cost: dict[bool, list[tuple[float, int, str]]] = {True: [], False: []}
        self.by_load: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
        self.groups: dict[Group, list[str]] = {}
        # group -> a prompt's first block id -> the members holding it, found once per fleet read by a pass over
        # the group and then kept by `gained`: a session's choice looks at the few holders, not the whole pool
        self.holders: dict[Group, dict[str, list[str]]] = {}
        # group -> first block id -> holder -> (its summary's set and its sent set as counted, its leading run h >= 1,
        # the prompt's id h - 1): a prompt of the same chain to that id (an id chains its parents: equal ids, equal
        # blocks before them) has at least that run while the candidate keeps those two sets (a fleet read makes
        # new ones; a placement only adds to the sent set), so the next session of a system prompt is counted
        # from there (its own suffix: a lookup or two), not from its first block
        self.runs: dict[Group, dict[str, dict[str, tuple[Set[str], Set[str], int, str]]]] = {}
        # worker -> the rank it would have holding every block (its floor: miss 0), and (load / slots, the queue
        # term, whether it has room, its pending rows' term): what the choice reads of a holder, computed when the
        # candidate changes
        self.floor: dict[str, tuple[float, int, str]] = {}
        self.entries: dict[str, tuple[bool, tuple[float, int, str], tuple[int, str]]] = {}  # its two, by room
        self.terms: dict[str, tuple[float, float, bool, float]] = {}
        for c in candidates:
            if eligible(c, digests, policy):
                self.ok[c.worker_id] = c
                self.groups.setdefault((c.block_tokens or 0, c.scope), []).append(c.worker_id)
                self._add(c)

    def _add(self, c: Candidate) -> None:
        p, w = self.policy, c.worker_id
        roomy = c.slots > c.load
        s = c.slots if c.slots > 1 else 1
        per_slot, queue = c.load / s, p.queue_weight * c.queued / s
        wait = c.pending / p.pending_rows
        # summed left to right as choose() sums its cost: the same floats
        by_cost, by_load = (p.overlap_weight * (1.0 + wait) + per_slot + queue, c.load, w), (c.load, w)
        insort(self.by_cost[roomy], by_cost)
        insort(self.by_load[roomy], by_load)
        self.entries[w] = (roomy, by_cost, by_load)
        self.floor[w] = (p.overlap_weight * (0.0 + wait) + per_slot + queue, c.load, w)
        self.terms[w] = (per_slot, queue, roomy, wait)

    def update(self, new: Candidate) -> None:
        """The candidate changed (a session placed on it, or its pending rows computed): its entries follow."""
        w = new.worker_id
        if w in self.ok:
            roomy, by_cost, by_load = self.entries[w]
            costs, loads = self.by_cost[roomy], self.by_load[roomy]
            del costs[bisect_left(costs, by_cost)]
            del loads[bisect_left(loads, by_load)]
            self.ok[w] = new
            self._add(new)

    def gained(self, worker_id: str, group: Group, first: str) -> None:
        """The worker (of `group`) now holds the blocks of a prompt whose first block is `first` (this Tracker sent
        it that prompt). Only its first id can be another prompt's first: a later block's id hashes its parent's,
        not the root (equal ids, equal blocks before them)."""
        firsts = self.holders.get(group)
        if firsts:
            got = firsts.get(first)
            if got is not None and worker_id not in got:
                got.append(worker_id)

    def _holders(self, group: Group, first: str) -> list[str]:
        firsts = self.holders.setdefault(group, {})
        got = firsts.get(first)
        if got is None:  # holds() inlined: a pass over the group per first block and fleet read
            ok = self.ok
            got = firsts[first] = [w for w in self.groups[group] if first in (c := ok[w]).held or first in c.sent]
        return got

    def full(self) -> list[str]:
        """The eligible workers with no room (choose passes them over while another has room)."""
        full = self.by_load[False]
        return [w for _, w in full] if full else []

    def choose(self, ids_for: Mapping[Group, Sequence[str]]) -> Choice | None:
        """choose(pool, digests, policy, ids_for) of the same candidates, in a few operations."""
        if not self.ok:
            return None
        p = self.policy
        roomy = bool(self.by_load[True])
        by_load = self.by_load[roomy]
        lo, hi = by_load[0][0], by_load[-1][0]
        guarded = hi - lo > p.balance_abs and hi > p.balance_rel * lo
        if guarded:
            return self._choice(self.ok[by_load[0][1]], ids_for, guarded)
        best: tuple[Any, ...] = self.by_cost[roomy][0]
        best_hit = -1  # not counted yet: the pool's cheapest by cost0 (it may hold blocks of another group)
        ow, ok, floor, terms = p.overlap_weight, self.ok, self.floor, self.terms
        for group in self.groups:
            ids = ids_for.get(group)
            if not ids:
                continue
            n = len(ids)
            runs = self.runs.setdefault(group, {}).setdefault(ids[0], {})
            # A holder's rank is no lower than its floor (the float operations being monotone), so the holders
            # are visited cheapest floor first (sorted in place: one placement moved one of them since) and the
            # visit ends at the first floor not below the best so far: a few holders, not all, per session.
            holders = self._holders(group, ids[0])
            holders.sort(key=floor.__getitem__)
            for w in holders:
                if floor[w] >= best:
                    break
                per_slot, queue, room, wait = terms[w]
                if room != roomy:
                    continue
                c = ok[w]
                held, sent = c.held, c.sent
                run = runs.get(w)
                if run is not None and run[0] is held and run[1] is sent and run[2] <= n and ids[run[2] - 1] == run[3]:
                    k = run[2]
                    hit = k if k == n or (ids[k] not in held and ids[k] not in sent) else leading(ids, held, sent, k)
                else:
                    hit = leading(ids, held, sent)
                    if hit:
                        runs[w] = (held, sent, hit, ids[hit - 1])
                rank = (ow * ((n - hit) / n + wait) + per_slot + queue, c.load, c.worker_id)  # as _rank computes it
                if rank < best:
                    best, best_hit = rank, hit
        return self._choice(ok[best[-1]], ids_for, guarded, best_hit, best[0] if best_hit >= 0 else None)

    def _rank(self, c: Candidate, n: int, hit: int) -> tuple[float, int, str]:
        s = c.slots if c.slots > 1 else 1
        cost = self.policy.overlap_weight * (((n - hit) / n if n else 1.0) + c.pending / self.policy.pending_rows) \
            + c.load / s + self.policy.queue_weight * c.queued / s
        return cost, c.load, c.worker_id

    def _choice(self, c: Candidate, ids_for: Mapping[Group, Sequence[str]], guarded: bool, hit: int = -1,
                cost: float | None = None) -> Choice:
        """`hit` and `cost`: as counted and ranked in choose (a holder), or (-1, None) to count and rank here."""
        ids = ids_for.get((c.block_tokens or 0, c.scope), ())
        if hit < 0:
            hit = leading(ids, c.held, c.sent) if ids and holds(c, ids[0]) else 0
        if cost is None:
            cost = self._rank(c, len(ids), hit)[0]
        return self.choice(c.worker_id, cost, hit, len(ids), c.load, c.slots - c.load, guarded, len(self.ok))
