"""Smooth weighted round-robin (nginx's): the one rule that shares fused calls, between the two phases of a
scheduler (consumer/sched/batching.py) and between the engines' lanes of a worker (consumer/worker/lane.py).

Each round every ready party adds its weight to its current weight; the largest wins (the lowest index on a
tie) and loses the sum of the ready parties' weights. A party with no work keeps its current weight, and a
round with one party (or none) ready does not happen. While a set of parties stays backlogged each gets
rounds in proportion to its weight, and never waits more than the others' weights' sum of rounds
(tests/test_scheduler_properties.py and tests/test_worker_lanes.py bound the waits)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SmoothRoundRobin"]


class SmoothRoundRobin:
    """Rounds among parties 0 .. len(weights) - 1."""

    __slots__ = ("current", "weights")

    def __init__(self, weights: Sequence[int]) -> None:
        if not weights or any(w < 0 for w in weights):
            raise ValueError(f"weights must be one or more non-negative integers, not {list(weights)}")
        self.weights = list(weights)
        self.current = [0] * len(self.weights)

    def pick(self, ready: Sequence[int]) -> int | None:
        """The party that gets this round among the ready ones (in increasing order), None if none is."""
        if len(ready) <= 1:
            return ready[0] if ready else None
        cur, w = self.current, self.weights
        total = 0
        best = ready[0]
        for i in ready:
            cur[i] += w[i]
            total += w[i]
            if cur[i] > cur[best]:
                best = i
        cur[best] -= total
        return best

    def state(self) -> tuple[int, ...]:
        return tuple(self.current)

    def restore(self, state: Sequence[int]) -> None:
        """Undo rounds since `state` (a round whose winner turned out to have nothing to run)."""
        self.current[:] = state
