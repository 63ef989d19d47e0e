"""The specification as code (docs/sampling.md): one row, dense, in the order the page states it.

This is the oracle the serving path (consumer/sampling/rows.py) is proven equal to. It is written to be
obviously right, not fast: dense masks, a full sort of the vocabulary for the rank order, the grammar
asked about every finite id. Never on the serving path.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import numpy.typing as npt

from schemas import Sampling

from .arith import F32, RowContext, RowStatus, lane_sum, lane_sum_dense, uniform
from .grammar import GrammarView
from .vocab import Vocabulary

__all__ = ["argmax_rows", "draw_kept", "needs_context", "processed_logits", "raw_logprobs", "sample", "sample_row",
           "top_logprobs"]

NEG_INF = F32(-np.inf)


def needs_context(s: Sampling) -> bool:
    """Whether a row of this sampling needs the session's context (its tokens, where its prompt ends)."""
    return s.penalized or s.min_tokens > 0


def _row(logits: npt.ArrayLike) -> npt.NDArray[np.float32]:
    x = np.array(logits, dtype=F32)  # always a copy: we write into it
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"expected one non-empty row of logits, got shape {x.shape}")
    x[np.isnan(x)] = NEG_INF
    return x


def processed_logits(logits: npt.ArrayLike, sampling: Sampling, *, context: RowContext | None = None,
                     vocab: Vocabulary | None = None, grammar: GrammarView | None = None,
                     ) -> tuple[npt.NDArray[np.float32], RowStatus]:
    """Section 1: the processed row, and OK or why the row has no token."""
    x = _row(logits)
    v = x.shape[0]
    vocab = vocab if vocab is not None else Vocabulary.plain(v)
    if vocab.n_vocab != v:
        raise ValueError(f"a row of {v} logits for a vocabulary of {vocab.n_vocab}")
    if needs_context(sampling) and context is None:
        return x, RowStatus.NO_CONTEXT
    s = sampling
    if s.penalized:
        assert context is not None
        counts = Counter(int(t) for t in context.window(s.penalty_last_n, s.penalize_prompt) if 0 <= t < v)
        rep, freq, pres = F32(s.repetition_penalty), F32(s.frequency_penalty), F32(s.presence_penalty)
        for t in sorted(counts):
            val = x[t]
            if rep != 1:
                val = val * rep if val <= 0 else val / rep
            x[t] = val - (F32(counts[t]) * freq + pres)
    for t, b in s.logit_bias:
        if t < v:
            x[t] = x[t] + F32(b)
    mask = np.zeros(v, dtype=np.bool_)
    for t in s.banned_token_ids:
        if t < v:
            mask[t] = True
    if s.allowed_token_ids is not None:
        allow = np.zeros(v, dtype=np.bool_)
        for t in s.allowed_token_ids:
            if t < v:
                allow[t] = True
        mask |= ~allow
    if not s.allow_special:
        mask[vocab.special] = True
    if s.min_tokens > 0:
        assert context is not None
        if context.generated < s.min_tokens:
            mask[vocab.eog] = True
            for t in context.stop_tokens:
                if t < v:
                    mask[t] = True
    x[mask] = NEG_INF
    finite = np.flatnonzero(x > NEG_INF)
    if finite.size == 0:
        return x, RowStatus.NO_TOKEN
    if grammar is not None:
        ok = grammar.admitted(finite)
        x[finite[~ok]] = NEG_INF
        if not ok.any():
            return x, RowStatus.GRAMMAR_END
    return x, RowStatus.OK


def sample_row(logits: npt.ArrayLike, sampling: Sampling, position: int, *, context: RowContext | None = None,
               vocab: Vocabulary | None = None, grammar: GrammarView | None = None) -> tuple[int, RowStatus]:
    """(token, OK), or (-1, why not) for one row of logits (shape (vocab,)), by docs/sampling.md."""
    x, status = processed_logits(logits, sampling, context=context, vocab=vocab, grammar=grammar)
    if status != RowStatus.OK:
        return -1, status
    if sampling.greedy:
        return int(np.argmax(x)), RowStatus.OK  # numpy's argmax: the first (lowest) id among the maxima
    m = x.max()
    z = np.where(x == np.inf, F32(0), NEG_INF) if m == np.inf else (x - m) / F32(sampling.temperature)
    ids = np.flatnonzero(z > NEG_INF)
    kept = ids[np.lexsort((ids, -z[ids]))]  # the rank order: z descending, id ascending
    if 0 < sampling.top_k < kept.shape[0]:
        kept = kept[:sampling.top_k]
    if sampling.min_p > 0:
        kept = kept[z[kept] >= F32(math.log(sampling.min_p))]
    e = np.exp(z[kept])
    return draw_kept(kept, e, lane_sum(kept, e), sampling, position), RowStatus.OK


def draw_kept(kept: npt.NDArray[np.intp], e: npt.NDArray[np.float32], total: np.float32, sampling: Sampling,
              position: int) -> int:
    """Section 2, steps 6-8: the top_p cut and the draw over the kept ids in rank order, their weights e
    and normaliser total."""
    c = np.cumsum(e, dtype=F32)  # one by one along the rank order
    if sampling.top_p < 1.0:
        reach = np.flatnonzero(c >= F32(F32(sampling.top_p) * total))
        keep = int(reach[0]) + 1 if reach.size else kept.shape[0]
        mass = float(c[keep - 1])
    else:
        keep, mass = kept.shape[0], float(total)
    target = uniform(sampling.seed, position) * mass
    above = np.flatnonzero(c[:keep].astype(np.float64) > target)
    j = int(above[0]) if above.size else int(np.flatnonzero(e[:keep] > 0)[-1])
    return int(kept[j])


def sample(logits: npt.ArrayLike, sampling: Sampling, position: int, *, context: RowContext | None = None,
           vocab: Vocabulary | None = None, grammar: GrammarView | None = None) -> int:
    """The token of one row (-1 when it has none: `sample_row` says why)."""
    return sample_row(logits, sampling, position, context=context, vocab=vocab, grammar=grammar)[0]


def argmax_rows(logits: npt.NDArray[np.floating]) -> npt.NDArray[np.intp]:
    """Greedy token of every row of a (rows, vocab) matrix with no control: lowest id on ties, NaN as
    -inf (a row with no finite logit gives 0). Equal to `sample(row, Sampling(), p)` on every row that
    has a finite logit."""
    if logits.ndim != 2:
        raise ValueError(f"expected a (rows, vocab) matrix, got shape {logits.shape}")
    nan = np.isnan(logits)
    if nan.any():
        logits = np.where(nan, -np.inf, logits)
    return np.argmax(logits, axis=1)


def raw_logprobs(logits: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Section 3: the log-softmax of the raw row, every id."""
    x = _row(logits)
    m = x.max()
    if m == -np.inf:
        return np.full(x.shape, NEG_INF)
    if m == np.inf:
        top = x == np.inf
        return np.where(top, F32(-math.log(int(top.sum()))), NEG_INF)
    d = x - m
    log_z = F32(math.log(float(lane_sum_dense(np.exp(d)))))
    return d - log_z


def top_logprobs(logits: npt.ArrayLike, n: int) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.float32]]:
    """The n most likely ids (raw logit descending, id ascending) and their log-probabilities."""
    x = _row(logits)
    ids = np.arange(x.shape[0])
    top = ids[np.lexsort((ids, -x))][:n]
    return top, raw_logprobs(logits)[top]
