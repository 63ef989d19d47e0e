"""Token sampling from one row of logits: greedy, or temperature / top-k / top-p.

The random stream of a draw is derived from (session seed, position) only
(`np.random.default_rng([seed, position])`), so a session's token never depends on which other
sessions shared the fused call, on the order of rows, nor on how often a job was delivered.

All arithmetic is float64 whatever the logits' dtype. NaN logits count as -inf. A row whose
logits are all -inf (or NaN) yields token 0 rather than raising: the engine's numbers are not the
sampler's to police.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from schemas import Sampling

__all__ = ["argmax_rows", "rng_for", "sample"]


def rng_for(seed: int, position: int) -> np.random.Generator:
    """The random generator of one draw: a pure function of (seed, position)."""
    return np.random.default_rng([seed, position])


def _clean(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    x = np.array(logits, dtype=np.float64)  # always a copy: we write into it
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"expected one non-empty row of logits, got shape {x.shape}")
    nan = np.isnan(x)
    if nan.any():
        x[nan] = -np.inf
    return x


def argmax_rows(logits: npt.NDArray[np.floating]) -> npt.NDArray[np.intp]:
    """Greedy token of every row of a (rows, vocab) matrix; lowest index on ties, NaN as -inf.

    Equal to `sample(row, greedy_sampling, position)` for each row, in one numpy call.
    """
    if logits.ndim != 2:
        raise ValueError(f"expected a (rows, vocab) matrix, got shape {logits.shape}")
    nan = np.isnan(logits)
    if nan.any():
        logits = np.where(nan, -np.inf, logits)
    return np.argmax(logits, axis=1)


def sample(logits: npt.ArrayLike, sampling: Sampling, position: int) -> int:
    """One token id from one row of logits (shape (vocab,)).

    Greedy (argmax, lowest index on ties) when `sampling.temperature == 0` or `top_k == 1`.
    Otherwise: logits / temperature, keep the top_k largest (0: all), softmax in float64, keep the
    smallest set of most likely tokens whose mass reaches top_p, draw one from what is left with
    the generator of (seed, position).
    """
    x = _clean(logits)
    if sampling.greedy:
        return int(np.argmax(x))
    vocab = x.shape[0]
    x /= sampling.temperature
    k = sampling.top_k
    if 0 < k < vocab:
        # The k largest, unordered; ids keep their vocabulary index.
        ids = np.argpartition(-x, k - 1)[:k]
        vals = x[ids]
    else:
        ids = None
        vals = x
    top = float(vals.max())
    if top == -np.inf:
        return int(np.argmax(x))
    probs = (vals == np.inf).astype(np.float64) if top == np.inf else np.exp(vals - top)
    probs /= probs.sum()
    if sampling.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_p = probs[order]
        cum = np.cumsum(sorted_p)
        keep = min(int(np.searchsorted(cum, sampling.top_p, side="left")) + 1, sorted_p.shape[0])
        order = order[:keep]
        probs = sorted_p[:keep] / cum[keep - 1]
        ids = order if ids is None else ids[order]
    return draw(probs, ids, sampling.seed, position)


def draw(probs: npt.NDArray[np.float64], ids: npt.NDArray[np.intp] | None, seed: int, position: int) -> int:
    """The one random draw of a sampled token from the kept candidates' probabilities (ids: their
    vocabulary indices, None when probs covers the whole vocabulary in order). Shared by `sample()` and
    the batched sampler (consumer/sampler.py), which must land on the same token."""
    u = rng_for(seed, position).random()
    cum = np.cumsum(probs)
    pick = min(int(np.searchsorted(cum, u * cum[-1], side="right")), probs.shape[0] - 1)
    # Never land on a zero-probability token (possible only through rounding at the edges).
    while probs[pick] == 0.0 and pick > 0:
        pick -= 1
    return int(pick if ids is None else ids[pick])
