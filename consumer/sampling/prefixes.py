"""Candidate prefixes of the rank order (docs/sampling.md, "why this is fast"): `{v >= tau}` is a prefix
of the order (v descending, id ascending) for any tau, and a tau from lane maxima holds at least n ids.
A grammar is asked only about the candidates, each id once per row."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .arith import F32
from .grammar import GrammarView

__all__ = ["GRAMMAR_WIDTHS", "LANE_MAX", "WIDTHS", "Prefixes", "Verdicts", "at_least", "lane_maxima", "ranked",
           "threshold"]

NEG_INF = F32(-np.inf)
WIDTHS = (64, 1024, 16384)  # candidate prefix sizes tried before the whole vocabulary
# ... under a grammar, whose whole-vocabulary answer along the piece tree (pieces.py) costs about what
# asking 16,384 ids does
GRAMMAR_WIDTHS = (64, 1024)
LANE_MAX = 1024  # lane maxima for a prefix threshold (a column max of a (V/1024, 1024) view: one fast pass)


def lane_maxima(v: npt.NDArray[np.float32]) -> npt.NDArray[np.float32] | None:
    """The LANE_MAX lane maxima `threshold` takes of a row (a (rows, V) matrix: of each row, in one pass), or None
    for rows too short to take them (under 4 * LANE_MAX)."""
    size = v.shape[-1]
    if size < 4 * LANE_MAX:
        return None
    cut = size - size % LANE_MAX
    return v[..., :cut].reshape(*v.shape[:-1], -1, LANE_MAX).max(axis=-2)


def threshold(v: npt.NDArray[np.float32], n: int, maxima: npt.NDArray[np.float32] | None = None) -> np.float32:
    """A threshold with at least min(n, len) entries of v at or above it (from lane maxima: the n-th
    largest of 1024 >= n lane maxima is at most the n-th largest value); -inf when n covers everything.
    `maxima`: v's lane maxima when already taken (`lane_maxima`: the sampler's first cut, after the forward
    pass)."""
    size = v.shape[0]
    if n >= size:
        return NEG_INF
    if n > LANE_MAX or size < 4 * LANE_MAX:
        return F32(np.partition(v, size - n)[size - n])
    if maxima is None:
        maxima = lane_maxima(v)
        assert maxima is not None  # size >= 4 * LANE_MAX
    return F32(np.partition(maxima, LANE_MAX - n)[LANE_MAX - n])


def at_least(v: npt.NDArray[np.float32], tau: np.float32) -> npt.NDArray[np.intp]:
    return np.flatnonzero(v >= tau) if tau > NEG_INF else np.flatnonzero(v > NEG_INF)


def ranked(ids: npt.NDArray[np.intp], v: npt.NDArray[np.float32]) -> npt.NDArray[np.intp]:
    """ids in rank order: v descending, id ascending."""
    return ids[np.lexsort((ids, -v[ids]))]


class Verdicts:
    """The grammar's answers for one row, asked once per id."""

    def __init__(self, grammar: GrammarView | None, size: int) -> None:
        self.grammar = grammar
        if grammar is not None:
            self.known = np.zeros(size, np.bool_)
            self.ok = np.zeros(size, np.bool_)

    def admitted(self, ids: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
        if self.grammar is None:
            return np.ones(ids.shape[0], np.bool_)
        new = ids[~self.known[ids]]
        if new.size:
            self.ok[new] = self.grammar.admitted(new)
            self.known[new] = True
        return self.ok[ids]


class Prefixes:
    """The rank order of v (admitted ids only), revealed a prefix at a time."""

    def __init__(self, v: npt.NDArray[np.float32], verdicts: Verdicts) -> None:
        self.v, self.verdicts = v, verdicts
        self.tau = F32(np.inf)

    def widths(self, first: int = 1) -> list[int]:
        tried = WIDTHS if self.verdicts.grammar is None else GRAMMAR_WIDTHS
        return [*[w for w in tried if w >= first][:3], self.v.shape[0]]

    def take(self, n: int) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp], bool]:
        """(admitted ids of a prefix holding >= n ids, in rank order; the refused ones; whether the
        prefix is every id above -inf). Prefixes only grow."""
        self.tau = min(self.tau, threshold(self.v, n))
        cand = at_least(self.v, self.tau)
        ok = self.verdicts.admitted(cand)
        return ranked(cand[ok], self.v), cand[~ok], bool(self.tau == NEG_INF)
