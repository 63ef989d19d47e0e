"""The serving path (consumer.sampling.sample_rows) is EQUAL to the oracle (consumer.sampling.sample_row,
docs/sampling.md as code), row for row, and a row's result does not depend on its place.

Hypothesis draws every control at once (temperature incl. tiny ones, top_k, top_p, min_p, penalties and
their window, logit_bias, min_tokens, allowed / banned ids, special tokens, log-probabilities), a
session context, a vocabulary's special and end-of-generation sets and a grammar stand-in (a set of
admitted ids: it drives the same prefix, widening and bounds logic as llama.cpp's grammar;
tests/test_grammar.py runs the real one), over rows with ties, +-inf, NaN and rows with no finite
logit. Vocabularies up to Gemma's 262,144: a few examples by default (each oracle row sorts the whole
vocabulary), many more under DGR_SOAK=1.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from consumer.sampling import (
    RowContext,
    RowInput,
    RowStatus,
    SampledCall,
    Vocabulary,
    raw_logprobs,
    sample_row,
    sample_rows,
    top_logprobs,
    uniform,
)
from schemas import Sampling
from tests.sampling_support import draw_ids, samplings

SOAK = os.environ.get("DGR_SOAK") == "1"
GEMMA_VOCAB = 262_144
F32 = np.float32


class SetGrammar:
    """A grammar state that admits a fixed set of ids (counts what it is asked)."""

    def __init__(self, ok: np.ndarray) -> None:
        self.ok = ok
        self.asked = 0

    def admitted(self, ids: np.ndarray) -> np.ndarray:
        assert ids.size == np.unique(ids).size, "ids asked twice in one query"
        self.asked += int(ids.size)
        return self.ok[ids]


# ---- strategies ----------------------------------------------------------------------------------------


def _row(draw: st.DrawFn, rng: np.random.Generator, vocab: int) -> np.ndarray:
    kind = draw(st.sampled_from(["normal", "ties", "peaked", "special", "all_ninf", "flat", "lm"]))
    if kind == "normal":
        row = rng.normal(scale=draw(st.sampled_from([0.1, 1.0, 5.0, 30.0])), size=vocab)
    elif kind == "ties":  # a handful of distinct values: ties at every cut
        row = rng.integers(-3, 3, size=vocab).astype(np.float64)
    elif kind == "peaked":  # a few dominant tokens over a long flat tail
        row = rng.normal(size=vocab)
        row[rng.integers(0, vocab, size=3)] += 12.0
    elif kind == "flat":
        row = np.zeros(vocab)
    elif kind == "all_ninf":
        row = np.where(rng.random(vocab) < 0.5, -np.inf, np.nan)
    elif kind == "lm":  # a language model's shape: a heavy head over a long tail
        row = rng.gumbel(size=vocab) * rng.uniform(1.0, 3.0)
    else:  # -inf, NaN, +inf sprinkled over normal values
        row = rng.normal(size=vocab)
        u = rng.random(vocab)
        row[u < 0.3] = -np.inf
        row[(u >= 0.3) & (u < 0.4)] = np.nan
        if draw(st.booleans()):
            row[u > 0.97] = np.inf
    return row.astype(F32)


@st.composite
def _call(draw: st.DrawFn, max_vocab: int, max_rows: int = 4, min_vocab: int = 1,
          ) -> tuple[np.ndarray, list[RowInput], Vocabulary]:
    vocab = draw(st.integers(min_vocab, max_vocab) | st.sampled_from([v for v in (1000, 32_000, 151_936, GEMMA_VOCAB)
                                                                      if min_vocab <= v <= max_vocab] or [max_vocab]))
    event(f"vocab {'>= 100k' if vocab >= 100_000 else '>= 4096' if vocab >= 4096 else '< 4096'}")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, max_rows))
    logits = np.stack([_row(draw, rng, vocab) for _ in range(n)])
    special = np.flatnonzero(rng.random(vocab) < draw(st.sampled_from([0.0, 0.05, 0.5]))).astype(np.int32)
    eog = np.flatnonzero(rng.random(vocab) < 0.02).astype(np.int32)
    voc = Vocabulary(n_vocab=vocab, special=np.setdiff1d(special, eog).astype(np.int32), eog=eog)
    rows = []
    for r in range(n):
        s = draw(samplings(vocab))
        length = draw(st.integers(0, 80))
        ctx = None if draw(st.integers(0, 9)) == 0 else RowContext(
            tokens=rng.integers(0, vocab, size=length).astype(np.int32), prompt_end=draw(st.integers(0, length)),
            stop_tokens=draw_ids(draw, vocab, 3))
        best = int(np.argmax(np.nan_to_num(logits[r], nan=-np.inf)))
        if s.allowed_token_ids is not None and best not in s.allowed_token_ids and draw(st.booleans()):
            s = s.model_copy(update={"allowed_token_ids": (*s.allowed_token_ids, best)})  # the row's best allowed
        grammar = None
        if draw(st.integers(0, 3)) == 0:
            share = draw(st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]))
            ok = rng.random(vocab) < share
            if draw(st.booleans()):  # admit the row's best token or not: both paths of every shortcut
                ok[best] = draw(st.booleans())
            grammar = SetGrammar(ok)
        rows.append(RowInput(sampling=s, position=draw(st.integers(0, 1 << 20)), context=ctx, grammar=grammar))
    return logits, rows, voc


# ---- the check -----------------------------------------------------------------------------------------


def _expected(logits: np.ndarray, rows: list[RowInput], vocab: Vocabulary) -> SampledCall:
    width = max((r.sampling.logprobs or 0 for r in rows), default=0)
    out = SampledCall.empty(len(rows), width)
    for r, inp in enumerate(rows):
        token, status = sample_row(logits[r], inp.sampling, inp.position, context=inp.context, vocab=vocab,
                                   grammar=inp.grammar)
        out.tokens[r], out.status[r] = token, status
        if inp.sampling.logprobs is not None:
            ids, lps = top_logprobs(logits[r], inp.sampling.logprobs)
            out.top_ids[r, :ids.size], out.top_logprobs[r, :ids.size] = ids, lps
            if status == RowStatus.OK:
                out.logprob[r] = raw_logprobs(logits[r])[token]
    return out


def _same(got: SampledCall, want: SampledCall) -> None:
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.status.tolist() == want.status.tolist()
    assert np.array_equal(got.logprob, want.logprob, equal_nan=True)
    assert np.array_equal(got.top_ids, want.top_ids)
    assert np.array_equal(got.top_logprobs, want.top_logprobs, equal_nan=True)


@settings(max_examples=300 if not SOAK else 3000, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(call=_call(max_vocab=300))
def test_equals_the_oracle_small_vocabularies(call: tuple[np.ndarray, list[RowInput], Vocabulary]) -> None:
    logits, rows, vocab = call
    _same(sample_rows(logits, rows, vocab), _expected(logits, rows, vocab))


@settings(max_examples=60 if not SOAK else 600, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(call=_call(min_vocab=4096, max_vocab=40_000, max_rows=2))
def test_equals_the_oracle_prefix_paths(call: tuple[np.ndarray, list[RowInput], Vocabulary]) -> None:
    """Vocabularies large enough for the lane-maxima prefixes and their widening."""
    logits, rows, vocab = call
    _same(sample_rows(logits, rows, vocab), _expected(logits, rows, vocab))


@pytest.mark.skipif(not SOAK, reason="DGR_SOAK=1: Gemma-size vocabularies under hypothesis")
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(call=_call(min_vocab=4096, max_vocab=GEMMA_VOCAB, max_rows=2))
def test_soak_equals_the_oracle_big_vocabularies(call: tuple[np.ndarray, list[RowInput], Vocabulary]) -> None:
    logits, rows, vocab = call
    _same(sample_rows(logits, rows, vocab), _expected(logits, rows, vocab))


# ---- Gemma's vocabulary, explicit ----------------------------------------------------------------------


def _gemma_like(rng: np.random.Generator, n: int, vocab: int = GEMMA_VOCAB) -> np.ndarray:
    return (rng.gumbel(size=(n, vocab)) * rng.uniform(1.0, 3.0, size=(n, 1))).astype(F32)


BIG = {
    "greedy": Sampling(),
    "typical": Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=1),
    "top_p": Sampling(temperature=0.8, top_p=0.95, seed=2),
    "temperature": Sampling(temperature=1.0, seed=3),
    "top_p_0.5": Sampling(temperature=0.7, top_p=0.5, seed=4),
    "min_p_rep": Sampling(temperature=0.8, min_p=0.05, repetition_penalty=1.3, seed=5),
    "logprobs": Sampling(logprobs=5),
    "everything": Sampling(temperature=0.9, top_k=500, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                           presence_penalty=0.3, frequency_penalty=0.1, logit_bias=((17, 3.0), (99, -50.0)),
                           min_tokens=3, banned_token_ids=(5,), logprobs=3, seed=6),
}
GEMMA_SPECIAL = np.arange(6, 6249, dtype=np.int32)


@pytest.mark.parametrize("name", list(BIG))
@pytest.mark.parametrize("grammar", [False, True])
def test_gemma_vocabulary(name: str, grammar: bool) -> None:
    rng = np.random.default_rng(7)
    logits = _gemma_like(rng, 3)
    logits[1, rng.integers(0, GEMMA_VOCAB, size=1000)] = np.nan
    logits[2, :] = np.round(logits[2, :])  # ties everywhere
    vocab = Vocabulary(n_vocab=GEMMA_VOCAB, special=GEMMA_SPECIAL, eog=np.array([1, 106], np.int32))
    ctx = RowContext(tokens=rng.integers(0, GEMMA_VOCAB, 200).astype(np.int32), prompt_end=150)
    rows = []
    for r, pos in enumerate([5, 1 << 19, 77]):
        # a JSON-like grammar admits a sliver of the vocabulary; refuse the best token so prefixes widen
        g = SetGrammar(rng.random(GEMMA_VOCAB) < (0.02, 0.3, 0.001)[r]) if grammar else None
        if g is not None:
            g.ok[int(np.nanargmax(logits[r]))] = False
        rows.append(RowInput(BIG[name], pos, ctx, g))
    _same(sample_rows(logits, rows, vocab), _expected(logits, rows, vocab))


def test_rounding_at_the_end_of_the_cumulative() -> None:
    """One token of weight 1 and a long tail of 5e-8 each: the running sum never moves past 1.0 (each
    tail weight is below half an ulp) while the lane sum gathers the tail (Z ~ 1.002). Draws with
    u * Z >= 1 find no cumulative above the target and take the last weighted token; a top_p above
    1 / Z is never reached and keeps everything. Both paths agree, draw for draw."""
    logits = np.full((1, 40_000), np.log(5e-8), F32)
    logits[0, 0] = 0.0
    tail = 0
    for s in (Sampling(temperature=1.0, seed=11), Sampling(temperature=1.0, top_p=0.9999, seed=11)):
        edge = [p for p in range(20_000) if uniform(11, p) > 0.997][:20]  # draws past the running sum
        for pos in edge + list(range(30)):
            got = sample_rows(logits, [RowInput(s, pos)])
            assert got.tokens[0] == sample_row(logits[0], s, pos)[0]
            tail += int(got.tokens[0] != 0)
    assert tail > 0  # the fallback ran (the last id of the tail)


@pytest.mark.parametrize("vocab", [8, 6000])
def test_exact_ties_at_the_cuts(vocab: int) -> None:
    """Hand-made ties the random rows rarely build: a biased token equal to the raw max at a lower id
    (greedy: the lowest id wins), a nucleus whose running sum hits top_p * Z exactly (flat rows: the
    cut is the first prefix that reaches it)."""
    row = np.zeros((1, vocab), F32)
    row[0, 5] = 2.0
    greedy = Sampling(logit_bias=((3, 2.0),))
    assert sample_rows(row, [RowInput(greedy, 0)]).tokens[0] == sample_row(row[0], greedy, 0)[0] == 3
    flat = np.zeros((1, vocab), F32)
    for top_p in (0.25, 0.5, 0.75):
        s = Sampling(temperature=1.0, top_p=top_p, seed=5)
        for pos in range(40):
            assert sample_rows(flat, [RowInput(s, pos)]).tokens[0] == sample_row(flat[0], s, pos)[0]


def test_typical_grammar_row_asks_about_a_prefix_only() -> None:
    rng = np.random.default_rng(9)
    logits = _gemma_like(rng, 1)
    g = SetGrammar(rng.random(GEMMA_VOCAB) < 0.5)
    sample_rows(logits, [RowInput(BIG["typical"], 3, None, g)])
    assert 0 < g.asked < 20_000


# ---- a row's place does not matter ---------------------------------------------------------------------


@settings(max_examples=40 if not SOAK else 400, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(call=_call(max_vocab=5000, max_rows=6), data=st.data())
def test_a_row_does_not_depend_on_its_place(call: tuple[np.ndarray, list[RowInput], Vocabulary],
                                            data: st.DataObject) -> None:
    """Each row alone, the call in another order, the matrix at another memory offset (misaligned), with
    0, 1 or 3 sampler threads: the same token, status and log-probabilities for every row."""
    logits, rows, vocab = call
    n, v = logits.shape
    base = sample_rows(logits, rows, vocab)
    width = base.top_ids.shape[1]
    for r in range(n):
        alone = sample_rows(logits[r:r + 1], rows[r:r + 1], vocab)
        assert (alone.tokens[0], alone.status[0]) == (base.tokens[r], base.status[r])
        k = rows[r].sampling.logprobs or 0
        assert np.array_equal(alone.top_ids[0, :k], base.top_ids[r, :k])
        assert np.array_equal(alone.logprob[:1], base.logprob[r:r + 1], equal_nan=True)
    perm = data.draw(st.permutations(range(n)))
    offset = data.draw(st.integers(1, 15))
    buf = np.empty(n * v + offset, F32)[offset:].reshape(n, v)  # rows at an odd float offset
    buf[:] = logits[perm]
    threads = data.draw(st.sampled_from([1, 3]))
    with ThreadPoolExecutor(threads) as pool:
        moved = sample_rows(buf, [rows[i] for i in perm], vocab, pool=pool)
    assert moved.tokens.tolist() == base.tokens[perm].tolist()
    assert moved.status.tolist() == base.status[perm].tolist()
    assert np.array_equal(moved.top_ids[:, :width], base.top_ids[perm])
    assert np.array_equal(moved.top_logprobs, base.top_logprobs[perm], equal_nan=True)
    assert np.array_equal(moved.logprob, base.logprob[perm], equal_nan=True)


def test_the_input_is_left_as_it_was() -> None:
    rng = np.random.default_rng(2)
    logits = _gemma_like(rng, 2, 5000)
    logits[0, 3] = np.nan
    before = logits.copy()
    rows = [RowInput(BIG["everything"], 9, RowContext(np.arange(20, dtype=np.int32), 10)),
            RowInput(BIG["typical"], 9)]
    sample_rows(logits, rows, Vocabulary.plain(5000))
    assert np.array_equal(logits, before, equal_nan=True)


def test_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        sample_rows(np.zeros(3), [RowInput(Sampling(), 0)])
    with pytest.raises(ValueError):
        sample_rows(np.zeros((2, 3)), [RowInput(Sampling(), 0)])
    with pytest.raises(ValueError):
        sample_rows(np.zeros((1, 0)), [RowInput(Sampling(), 0)])
    with pytest.raises(ValueError):
        sample_rows(np.zeros((1, 3)), [RowInput(Sampling(), 0)], Vocabulary.plain(4))
