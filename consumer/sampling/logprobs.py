"""Log-probabilities (docs/sampling.md, section 3): the raw row's log-softmax at the chosen token and at
the n most likely tokens (a candidate prefix, not a sort)."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from .arith import F32, lane_sum_dense
from .prefixes import at_least, ranked, threshold

__all__ = ["row_logprobs"]

NEG_INF = F32(-np.inf)


def row_logprobs(row: npt.NDArray[np.float32], a: int, n: int, token: int,
                 maxima: npt.NDArray[np.float32] | None = None,
                 ) -> tuple[float, npt.NDArray[np.intp], npt.NDArray[np.float32]]:
    """(the token's raw log-probability or NaN, the n most likely ids, theirs): section 3. `maxima`: the row's
    lane maxima when already taken (prefixes.lane_maxima)."""
    if np.isnan(row[a]):
        row = np.where(np.isnan(row), NEG_INF, row)
        a = int(np.argmax(row))
        maxima = None  # those of the row with its NaNs
    m = row[a]
    n = min(n, row.shape[0])
    top = ranked(at_least(row, threshold(row, n, maxima)), row)[:n] if n else np.zeros(0, np.intp)
    if top.shape[0] < n:  # fewer finite logits than n: the rest of the order is -inf, by id
        rest = np.setdiff1d(np.arange(row.shape[0]), top)[:n - top.shape[0]]
        top = np.concatenate([top, rest])
    if m == -np.inf:
        lp = np.full(top.shape, NEG_INF)
        return (float(NEG_INF) if token >= 0 else math.nan), top, lp
    if m == np.inf:
        count = int(np.count_nonzero(row == np.inf))
        share = F32(-math.log(count))

        def at(ids: npt.NDArray[np.intp]) -> npt.NDArray[np.float32]:
            return np.where(row[ids] == np.inf, share, NEG_INF)
    else:
        log_z = F32(math.log(float(lane_sum_dense(np.exp(row - m)))))

        def at(ids: npt.NDArray[np.intp]) -> npt.NDArray[np.float32]:
            return (row[ids] - m) - log_z
    chosen = float(at(np.array([token], np.intp))[0]) if token >= 0 else math.nan
    return chosen, top, at(top)
