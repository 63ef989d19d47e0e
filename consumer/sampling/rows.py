"""The serving path: every row of one fused call, by docs/sampling.md, EQUAL to the oracle
(consumer/sampling/reference.py; tests/test_sampler_exact.py) and doing much less.

Where it saves (the page's "why this is fast and still exact"):
- A greedy row is the raw row's argmax unless a control touches that token or a patched token beats it
  (checked on the few patched ids), or the grammar refuses it.
- A row is processed sparsely: penalties and biases are a handful of patched ids, masks a list of ids;
  a dense float32 copy is made only for the rows that need one.
- Cuts work on candidate prefixes `{z >= tau}` of the rank order, `tau` from lane maxima, widened only
  when a prefix cannot decide; a grammar is asked only about the candidates (`Verdicts` remembers).
- Rows run in a thread pool when one is given: numpy and the grammar's ctypes calls release the GIL,
  and no row reads anything another row writes, so the thread count changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from schemas import Sampling

from .arith import F32, RowContext, RowStatus, lane_sum, lane_sum_dense, uniform
from .controls import Controls, row_controls
from .grammar import GrammarView
from .logprobs import row_logprobs
from .prefixes import LANE_MAX, Prefixes, Verdicts, ranked, threshold
from .reference import draw_kept, needs_context
from .vocab import Vocabulary

__all__ = ["RowInput", "SampledCall", "sample_rows"]

NEG_INF = F32(-np.inf)


@dataclass(frozen=True, slots=True)
class RowInput:
    """One sampling row: its session's sampling, the position its token takes, the session's context
    (None: not known) and grammar state (None: unconstrained)."""

    sampling: Sampling
    position: int
    context: RowContext | None = None
    grammar: GrammarView | None = None


@dataclass(frozen=True, slots=True)
class SampledCall:
    """The sampler's answer for one call, one entry per sampling row, columnar.

    tokens: int32, -1 where status is not OK. status: uint8 RowStatus. logprob: float32, the chosen
    token's raw log-probability (NaN where not asked or no token). top_ids / top_logprobs: (rows, N)
    with N the largest `logprobs` asked in the call, padded -1 / NaN (a row asking n < N fills n)."""

    tokens: npt.NDArray[np.int32]
    status: npt.NDArray[np.uint8]
    logprob: npt.NDArray[np.float32]
    top_ids: npt.NDArray[np.int32]
    top_logprobs: npt.NDArray[np.float32]

    @classmethod
    def empty(cls, n: int, width: int) -> SampledCall:
        return cls(tokens=np.full(n, -1, np.int32), status=np.zeros(n, np.uint8),
                   logprob=np.full(n, np.nan, np.float32), top_ids=np.full((n, width), -1, np.int32),
                   top_logprobs=np.full((n, width), np.nan, np.float32))

    @classmethod
    def of_tokens(cls, tokens: npt.NDArray[np.integer]) -> SampledCall:
        """Every row's token given (status OK), no log-probabilities: `empty(n, 0)` with the tokens written."""
        n = tokens.shape[0]
        return cls(tokens=tokens.astype(np.int32), status=np.zeros(n, np.uint8), logprob=np.full(n, np.nan, np.float32),
                   top_ids=np.empty((n, 0), np.int32), top_logprobs=np.empty((n, 0), np.float32))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def token_list(self) -> list[int | None]:
        """The tokens as Python ints, None where a row has none."""
        return [int(t) if s == RowStatus.OK else None for t, s in zip(self.tokens, self.status, strict=True)]


# ---- one row --------------------------------------------------------------------------------------


def _greedy_shortcut(row: npt.NDArray[np.float32], a: int, c: Controls, grammar: GrammarView | None) -> int | None:
    """The processed argmax from the raw argmax a when no control touches a (None: cannot tell)."""
    if not c.untouched(a):
        return None
    token, best = a, row[a]
    if c.patch_ids.size:
        vals = c.patched_values()
        j = int(np.argmax(vals))  # lowest id among the patched maxima (patch_ids ascending)
        if vals[j] > best or (vals[j] == best and c.patch_ids[j] < a):
            token, best = int(c.patch_ids[j]), vals[j]
    if best == NEG_INF:
        return None
    if grammar is not None and not grammar.admitted(np.array([token], np.intp))[0]:
        return None
    return token


def _grammar_max(x: npt.NDArray[np.float32], verdicts: Verdicts) -> int | None:
    """The lowest admitted id among the admitted maxima of x (None: nothing admitted)."""
    a = int(np.argmax(x))
    if verdicts.admitted(np.array([a], np.intp))[0]:
        return a
    prefixes = Prefixes(x, verdicts)
    for n in prefixes.widths():
        adm, _, everything = prefixes.take(n)
        if adm.size or everything:
            break
    return int(adm[0]) if adm.size else None


def _draw_prefixes(z: npt.NDArray[np.float32], s: Sampling, position: int, verdicts: Verdicts) -> int:
    """The kept set decided on prefixes of the rank order (module doc). Exact as soon as a prefix holds
    the whole kept set (top_k admitted ids, or every admitted id). Until then the kept set's normaliser
    lies between the admitted prefix's and that plus every id outside the prefix (float32 sums of
    non-negative terms only grow), and the prefix's running sums are the kept set's first ones: the
    nucleus and the draw are decided unless one of those sums falls between the bounds."""
    if s.min_p > 0:  # the ids a min_p cut keeps: the rest cannot be kept
        z = np.where(z >= F32(math.log(s.min_p)), z, NEG_INF)
    with np.errstate(over="ignore"):  # a refused id may score above the admitted max: inf, an upper bound
        e = np.exp(z)
    exact = lane_sum_dense(e) if verdicts.grammar is None and s.top_k <= 0 else None
    prefixes = Prefixes(z, verdicts)
    u = uniform(s.seed, position)
    top_p = F32(s.top_p)
    refused: list[npt.NDArray[np.intp]] = []
    for n in prefixes.widths(max(1, s.top_k)):
        order, rejected, everything = prefixes.take(n)
        if 0 < s.top_k <= order.shape[0]:
            order, everything = order[:s.top_k], True
        w = e[order]
        if everything:
            return draw_kept(order, w, lane_sum(order, w), s, position)
        c = np.cumsum(w, dtype=F32)
        if exact is not None:
            lo = hi = exact
        else:
            refused.append(rejected)
            lo = lane_sum(order, w)
            e_hi = e.copy()
            e_hi[np.concatenate(refused)] = 0
            hi = lane_sum_dense(e_hi)
        if s.top_p < 1.0:
            j_lo = int(np.searchsorted(c, F32(top_p * lo), side="left"))
            j_hi = int(np.searchsorted(c, F32(top_p * hi), side="left"))
            if j_hi < c.shape[0] and j_lo == j_hi:
                return _pick(order[:j_hi + 1], w[:j_hi + 1], c[:j_hi + 1], float(c[j_hi]), u)
        else:
            c64 = c.astype(np.float64)
            j_lo = int(np.searchsorted(c64, u * float(lo), side="right"))
            j_hi = int(np.searchsorted(c64, u * float(hi), side="right"))
            if j_hi < c.shape[0] and j_lo == j_hi:
                return int(order[j_hi])
    raise AssertionError("unreachable: the last prefix is the whole vocabulary")


def _pick(kept: npt.NDArray[np.intp], e: npt.NDArray[np.float32], c: npt.NDArray[np.float32], mass: float,
          u: float) -> int:
    above = np.flatnonzero(c.astype(np.float64) > u * mass)
    return int(kept[above[0]]) if above.size else int(kept[np.flatnonzero(e > 0)[-1]])


def _untouched_max(row: npt.NDArray[np.float32], a: int, c: Controls) -> np.float32 | None:
    """The max of the processed row, known without it when the raw argmax a is untouched by the controls
    (then it is row[a] or a patched value above it); None otherwise, or when it is not finite."""
    if not c.untouched(a):
        return None
    m = row[a]
    if c.patch_ids.size:
        m = max(m, c.patched_values().max())
    return F32(m) if np.isfinite(m) else None


def _scores(row: npt.NDArray[np.float32], m: np.float32, c: Controls, temperature: float,
            ) -> npt.NDArray[np.float32]:
    """z = (x - m) / T over the whole row, straight from the raw row (no processed copy)."""
    t = F32(temperature)
    z = np.subtract(row, m)
    np.divide(z, t, out=z)
    if c.patch_ids.size:
        z[c.patch_ids] = (c.patch_vals - m) / t
    return c.mask_row(z)


def _cut_from_raw(row: npt.NDArray[np.float32], m: np.float32, c: Controls, s: Sampling,
                  maxima: npt.NDArray[np.float32] | None = None,
                  ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.float32]] | None:
    """The kept set of a top_k / min_p row (rank order) and its scores, from candidates of the raw row:
    every id outside {raw >= tau} and the patched ids has a processed logit below tau (masks only lower
    it), so a score at most zb = (tau - m) / T; the cut is decided when the set's last kept score is
    above zb. None: not decided here (the caller scores the whole row)."""
    t = F32(s.temperature)
    c_min = F32(math.log(s.min_p)) if s.min_p > 0 else None
    if s.top_k > 0:
        if s.top_k > LANE_MAX // 2:
            return None
        tau = threshold(row, 2 * s.top_k, maxima)  # room: the k-th kept score then lies above zb, not on it
    else:
        assert c_min is not None
        slack = 1e-3 * (abs(float(m)) + float(t) * abs(float(c_min)) + 1.0)
        tau = F32(float(m) + float(t) * float(c_min) - slack)
    if tau == NEG_INF:
        return None
    ids = np.union1d(np.flatnonzero(row >= tau), c.patch_ids)
    z = (c.processed_at(ids, row) - m) / t
    live = z > NEG_INF
    ids, z = ids[live], z[live]
    order = np.lexsort((ids, -z))
    ids, z = ids[order], z[order]
    zb = (tau - m) / t
    if s.top_k > 0:
        if ids.shape[0] < s.top_k or not z[s.top_k - 1] > zb:
            return None
        ids, z = ids[:s.top_k], z[:s.top_k]
    elif c_min is None or not zb < c_min:
        return None
    if c_min is not None:
        keep = z >= c_min
        ids, z = ids[keep], z[keep]
    return ids, z


def _random(z: npt.NDArray[np.float32], s: Sampling, position: int, verdicts: Verdicts) -> int:
    """A random row from its scores z = (x - m) / T, m the max admitted processed logit."""
    if verdicts.grammar is not None or (s.top_k <= 0 and s.min_p <= 0):
        return _draw_prefixes(z, s, position, verdicts)
    if s.top_k > 0:  # no grammar: the first prefix holds the top k
        prefixes = Prefixes(z, verdicts)
        for n in prefixes.widths(s.top_k):
            kept, _, everything = prefixes.take(n)
            if kept.shape[0] >= s.top_k or everything:
                break
        kept = kept[:s.top_k]
        if s.min_p > 0:
            kept = kept[z[kept] >= F32(math.log(s.min_p))]
    else:
        kept = ranked(np.flatnonzero(z >= F32(math.log(s.min_p))), z)
    e = np.exp(z[kept])
    return draw_kept(kept, e, lane_sum(kept, e), s, position)


def _sample_one(row: npt.NDArray[np.float32], a: int, inp: RowInput, vocab: Vocabulary,
                maxima: npt.NDArray[np.float32] | None = None) -> tuple[int, RowStatus]:
    s = inp.sampling
    if needs_context(s) and inp.context is None:
        return -1, RowStatus.NO_CONTEXT
    if np.isnan(row[a]):  # np.argmax stops at the first NaN: the row has some
        row = np.where(np.isnan(row), NEG_INF, row)
        a = int(np.argmax(row))
        maxima = None  # those of the row with its NaNs
    c = row_controls(row, s, inp.context, vocab)
    if s.greedy:
        token = _greedy_shortcut(row, a, c, inp.grammar)
        if token is not None:
            return token, RowStatus.OK
    if not s.greedy and inp.grammar is None:
        m = _untouched_max(row, a, c)
        if m is not None:
            cut = _cut_from_raw(row, m, c, s, maxima) if s.top_k > 0 or s.min_p > 0 else None
            if cut is not None:
                e = np.exp(cut[1])
                return draw_kept(cut[0], e, lane_sum(cut[0], e), s, inp.position), RowStatus.OK
            return _random(_scores(row, m, c, s.temperature), s, inp.position, Verdicts(None, 0)), RowStatus.OK
    x = c.dense(row)
    if x.max() == NEG_INF:
        return -1, RowStatus.NO_TOKEN
    verdicts = Verdicts(inp.grammar, x.shape[0])
    if inp.grammar is None:
        top = int(np.argmax(x))
    else:
        found = _grammar_max(x, verdicts)
        if found is None:
            return -1, RowStatus.GRAMMAR_END
        top = found
    if s.greedy:
        return top, RowStatus.OK
    m = x[top]
    if m == np.inf:
        z = np.where(x == np.inf, F32(0), NEG_INF)
    else:
        z = np.subtract(x, m, out=x)
        np.divide(z, F32(s.temperature), out=z)
    return _random(z, s, inp.position, verdicts), RowStatus.OK


# ---- the call -------------------------------------------------------------------------------------


def sample_rows(logits: npt.ArrayLike, rows: Sequence[RowInput], vocab: Vocabulary | None = None, *,
                pool: Executor | None = None, argmax: npt.NDArray[np.intp] | None = None,
                cuts: Mapping[int, npt.NDArray[np.float32]] | None = None) -> SampledCall:
    """Row r of the (rows, vocab) matrix sampled by rows[r]: equal, row for row, to
    `reference.sample_row(logits[r], ...)` and `reference.top_logprobs`, whatever the other rows. The sampler's
    first cut when already taken (after the forward pass, on its thread: EngineOutput.top and .cuts): `argmax`,
    each row's np.argmax; `cuts`, by row, the lane maxima of the rows that cut the raw row by them."""
    arr = np.asarray(logits)
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise ValueError(f"expected a (rows, vocab) matrix, got shape {arr.shape}")
    if arr.dtype != F32:
        arr, argmax, cuts = arr.astype(F32), None, None
    n, v = arr.shape
    if len(rows) != n:
        raise ValueError(f"{n} rows of logits, {len(rows)} sampling rows")
    vocab = vocab if vocab is not None else Vocabulary.plain(v)
    if vocab.n_vocab != v:
        raise ValueError(f"rows of {v} logits for a vocabulary of {vocab.n_vocab}")
    width = max((r.sampling.logprobs or 0 for r in rows), default=0)
    out = SampledCall.empty(n, width)
    if argmax is None or argmax.shape != (n,):
        argmax = np.argmax(arr, axis=1)

    def one(r: int) -> None:
        row, inp = arr[r], rows[r]
        maxima = cuts.get(r) if cuts else None
        token, status = _sample_one(row, int(argmax[r]), inp, vocab, maxima)
        out.tokens[r], out.status[r] = token, status
        k = inp.sampling.logprobs
        if k is not None:
            lp, top, top_lp = row_logprobs(row, int(argmax[r]), k, token, maxima)
            out.logprob[r] = lp
            out.top_ids[r, :top.shape[0]] = top
            out.top_logprobs[r, :top.shape[0]] = top_lp

    # A greedy row with nothing else asked is one argmax and a few lookups: not worth a thread.
    heavy = [r for r, inp in enumerate(rows)
             if not inp.sampling.greedy or inp.sampling.logprobs is not None or inp.grammar is not None]
    light = sorted(set(range(n)) - set(heavy))
    for r in light:
        one(r)
    if pool is None or len(heavy) < 2:
        for r in heavy:
            one(r)
    else:
        for f in [pool.submit(one, r) for r in heavy]:
            f.result()
    return out
