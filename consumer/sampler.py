"""The sampler stage: one fused call's output rows -> one token per item that samples.

It sits between the engine and the scheduler (as vLLM v1's sampler between model runner and
`update_from_output`): the engine computes rows, this turns them into tokens, the scheduler only
takes tokens. `sample_rows` samples every row of a call at once and gives, row for row, exactly the
token `consumer.sampling.sample` (the per-row oracle, kept unchanged) gives for the same
(logits, sampling, seed, position); tests/test_sampler_exact.py proves it with hypothesis.

How it stays exact while doing less work (`sample` is the reference for every step below):
- The per-element work is the oracle's, in float64 and in the oracle's order (convert, NaN -> -inf,
  divide by the temperature), one row at a time (a (64, 262144) float64 matrix would not stay in cache;
  measured slower). Elementwise IEEE operations give the same bits whatever the layout.
- top_k (0 < k < vocab): the oracle's candidates are `np.argpartition(-x, k - 1)[:k]` in the order
  that call returns them, and every later sum depends on that order. So the same call runs on the same
  contiguous float64 row (bit-identical input, deterministic algorithm: identical ids in identical
  order); everything after it works on k values, with the oracle's own arithmetic. That O(vocab)
  partition is the price of exactness here: this path saves passes, not the partition.
- top_p < 1 without a top_k cut: the oracle sorts the whole vocabulary (stable, by descending
  probability) and keeps the shortest prefix whose cumulative mass reaches top_p. Here the
  probabilities are computed exactly as the oracle does (the normaliser is the sum over the whole row
  in vocabulary order, so the same bits), then only a candidate set is sorted: C = {i : p_i >= t},
  t the m-th largest probability (np.partition, O(vocab)). Every token ahead of a member of C in the
  oracle's order has a probability >= its own, so C, taken in increasing index order and sorted
  stably, IS the oracle's sorted order's first |C| entries (ties at t are all in C, so tie order by
  index is the same). np.cumsum adds left to right, so the cumulative sums of that prefix are the
  oracle's first |C| cumulative sums, bit for bit. If the last of them reaches top_p, the oracle's
  searchsorted stops inside the prefix: same cut, same renormalisation, same draw. If it does not, the
  cut could change the result, so m grows (x8) until it does or covers the vocabulary (the oracle's
  full sort).
- temperature only (no top_k, top_p 1): the draw's cumulative sum runs over the whole row in
  vocabulary order; nothing can be cut, the oracle's arithmetic runs on the row as is.
- A row whose largest kept logit is +inf or -inf takes the oracle's own branches (indicator
  probabilities; token 0 for an all -inf row).
Greedy rows stay one argmax over the matrix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from schemas import Sampling

from .batch import EngineOutput
from .sampling import argmax_rows, draw
from .sched.outputs import ScheduledBatch

__all__ = ["BatchSampler", "sample_rows"]

# First size of the top_p candidate set; grows by NUCLEUS_GROWTH while its mass is short of top_p.
NUCLEUS_START = 256
NUCLEUS_GROWTH = 8


def _nucleus(probs: npt.NDArray[np.float64], top_p: float, start: int
             ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.float64]]:
    """The oracle's top_p cut of a full row of probabilities (vocabulary order): (ids, renormalised
    probabilities) in the oracle's sorted order. Sorts only a candidate prefix (see the module doc)."""
    vocab = probs.shape[0]
    m = start
    while m < vocab:
        t = np.partition(probs, vocab - m)[vocab - m]  # the m-th largest probability
        cand = np.flatnonzero(probs >= t)  # increasing index; every tie at t included
        cp = probs[cand]
        order = np.argsort(-cp, kind="stable")
        sorted_p = cp[order]
        cum = np.cumsum(sorted_p)
        if cum[-1] >= top_p:  # the oracle's searchsorted stops inside this prefix
            keep = int(np.searchsorted(cum, top_p, side="left")) + 1
            return cand[order[:keep]], sorted_p[:keep] / cum[keep - 1]
        m *= NUCLEUS_GROWTH
    # The whole vocabulary: the oracle's own computation.
    order = np.argsort(-probs, kind="stable")
    sorted_p = probs[order]
    cum = np.cumsum(sorted_p)
    keep = min(int(np.searchsorted(cum, top_p, side="left")) + 1, vocab)
    return order[:keep], sorted_p[:keep] / cum[keep - 1]


def _sample_row(row: npt.NDArray[np.floating], sampling: Sampling, position: int, nucleus_start: int) -> int:
    """One non-greedy row of logits (any float dtype)."""
    vocab = row.shape[0]
    x = row.astype(np.float64)  # a copy, as the oracle's; one row at a time stays in cache
    nan = np.isnan(row)
    if nan.any():
        x[nan] = -np.inf
    k = sampling.top_k
    ids: npt.NDArray[np.intp] | None
    if 0 < k < vocab:
        # x / -T is -(x / T) bit for bit (IEEE division is sign-symmetric): the oracle's `-x`, built in
        # one pass; the oracle's argpartition on it gives the oracle's ids in the oracle's order.
        np.divide(x, -sampling.temperature, out=x)
        ids = np.argpartition(x, k - 1)[:k]
        vals = -x[ids]
    else:
        ids = None
        x /= sampling.temperature
        vals = x
    top = float(vals.max())
    if top == -np.inf:
        return 0  # the oracle's argmax of an all -inf row
    probs = (vals == np.inf).astype(np.float64) if top == np.inf else np.exp(vals - top)
    probs /= probs.sum()
    if sampling.top_p < 1.0:
        if ids is None:
            ids, probs = _nucleus(probs, sampling.top_p, nucleus_start)
        else:  # k values: the oracle's code as is
            order = np.argsort(-probs, kind="stable")
            sorted_p = probs[order]
            cum = np.cumsum(sorted_p)
            keep = min(int(np.searchsorted(cum, sampling.top_p, side="left")) + 1, sorted_p.shape[0])
            probs = sorted_p[:keep] / cum[keep - 1]
            ids = ids[order[:keep]]
    return draw(probs, ids, sampling.seed, position)


def sample_rows(logits: npt.ArrayLike, samplings: Sequence[Sampling], positions: Sequence[int], *,
                nucleus_start: int = NUCLEUS_START) -> npt.NDArray[np.intp]:
    """The token of every row of a (rows, vocab) matrix: row r with samplings[r] at positions[r].
    Row for row equal to `consumer.sampling.sample(logits[r], samplings[r], positions[r])`."""
    arr = np.asarray(logits)
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise ValueError(f"expected a (rows, vocab) matrix, got shape {arr.shape}")
    n = arr.shape[0]
    if len(samplings) != n or len(positions) != n:
        raise ValueError(f"{n} rows, {len(samplings)} samplings, {len(positions)} positions")
    if nucleus_start < 1:
        raise ValueError("nucleus_start must be >= 1")
    out = np.zeros(n, dtype=np.intp)
    rand = [r for r, s in enumerate(samplings) if not s.greedy]
    if len(rand) < n:
        out[:] = argmax_rows(arr)
    for r in rand:
        out[r] = _sample_row(arr[r], samplings[r], positions[r], nucleus_start)
    return out


class BatchSampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, batch: ScheduledBatch, output: EngineOutput) -> list[int]:
        """The token of every item of `batch` that samples, in item order. Each draw is keyed by the
        session's seed and the position the token takes (the item's end position), so a token never
        depends on the other rows of the call. ValueError when the rows do not fit the call."""
        if output.kind != "logits":
            raise ValueError(f"cannot sample from {output.kind!r} rows")
        n_logit = batch.fused.n_logit_rows
        arr = np.asarray(output.rows)
        if n_logit == 0 and arr.size == 0:
            return []
        if arr.shape != (n_logit, self.vocab_size):
            raise ValueError(f"logits shape {arr.shape}, expected ({n_logit}, {self.vocab_size})")
        samplings: list[Sampling] = []
        positions: list[int] = []
        for it in batch.items:
            if not it.samples:
                continue
            if it.sampling is None:
                raise ValueError(f"item of job {it.job.job_id} samples but carries no sampling parameters")
            samplings.append(it.sampling)
            positions.append(it.end_position)
        if len(samplings) != n_logit:
            raise ValueError(f"{len(samplings)} sampling items, {n_logit} logit rows")
        return [int(t) for t in sample_rows(arr, samplings, positions)]
