"""consumer.sampler.sample_rows gives exactly consumer.sampling.sample's token, row for row.

`sample` (the per-row oracle) is unchanged; the batched sampler cuts the candidate set before any sort
(module doc of consumer/sampler.py), and these tests check that the cut never changes a token: random
float32 logits with ties, -inf, NaN and all -inf rows, every parameter combination, small candidate
sets that force the widening path. Big vocabularies (Gemma's 262,144) in a few explicit cases here and
many more under DGR_SOAK=1.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.sampler import sample_rows
from consumer.sampling import sample
from schemas import Sampling

SOAK = os.environ.get("DGR_SOAK") == "1"
GEMMA_VOCAB = 262_144


def _oracle(logits: np.ndarray, samplings: list[Sampling], positions: list[int]) -> list[int]:
    return [sample(row, s, p) for row, s, p in zip(logits, samplings, positions, strict=True)]


@st.composite
def _samplings(draw: st.DrawFn, vocab: int) -> Sampling:
    temperature = draw(st.sampled_from([0.0, 0.0, 1.0]) | st.floats(0.01, 10.0))
    top_k = draw(st.sampled_from([0, 0, 1, vocab, vocab + 7]) | st.integers(1, max(1, vocab - 1)))
    top_p = draw(st.sampled_from([1.0, 1.0]) | st.floats(0.01, 1.0, exclude_min=True))
    seed = draw(st.integers(0, 2**63 - 1))
    return Sampling(temperature=temperature, top_k=min(top_k, 1 << 20), top_p=top_p, seed=seed)


@st.composite
def _rows(draw: st.DrawFn, max_vocab: int) -> np.ndarray:
    vocab = draw(st.integers(1, max_vocab))
    n = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = []
    for _ in range(n):
        kind = draw(st.sampled_from(["normal", "ties", "peaked", "special", "all_ninf", "flat"]))
        if kind == "normal":
            row = rng.normal(scale=draw(st.sampled_from([0.1, 1.0, 5.0, 30.0])), size=vocab)
        elif kind == "ties":  # a handful of distinct values: many ties at every cut
            row = rng.integers(-3, 3, size=vocab).astype(np.float64)
        elif kind == "peaked":  # a few dominant tokens, a long flat tail (a small nucleus)
            row = rng.normal(size=vocab)
            row[rng.integers(0, vocab, size=3)] += 12.0
        elif kind == "flat":
            row = np.zeros(vocab)
        elif kind == "all_ninf":
            row = np.where(rng.random(vocab) < 0.5, -np.inf, np.nan)
        else:  # -inf, NaN, +inf sprinkled over normal values
            row = rng.normal(size=vocab)
            u = rng.random(vocab)
            row[u < 0.3] = -np.inf
            row[(u >= 0.3) & (u < 0.4)] = np.nan
            if draw(st.booleans()):
                row[u > 0.97] = np.inf
        rows.append(row.astype(np.float32))
    return np.stack(rows)


@settings(max_examples=300 if not SOAK else 3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), nucleus_start=st.sampled_from([1, 2, 3, 8, 256]))
def test_equals_the_oracle_row_for_row(data: st.DataObject, nucleus_start: int) -> None:
    logits = data.draw(_rows(max_vocab=300))
    vocab = logits.shape[1]
    samplings = [data.draw(_samplings(vocab)) for _ in range(logits.shape[0])]
    positions = [data.draw(st.integers(0, 1 << 20)) for _ in samplings]
    got = sample_rows(logits, samplings, positions, nucleus_start=nucleus_start).tolist()
    assert got == _oracle(logits, samplings, positions)


def _gemma_like(rng: np.random.Generator, n: int, vocab: int = GEMMA_VOCAB) -> np.ndarray:
    """Logits with a language model's shape: a heavy head over a long tail (a nucleus of tens to
    thousands of tokens at t0.8/p0.95)."""
    return (rng.gumbel(size=(n, vocab)) * rng.uniform(1.0, 3.0, size=(n, 1))).astype(np.float32)


BIG = [Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=1), Sampling(temperature=0.8, top_p=0.95, seed=2),
       Sampling(temperature=1.0, seed=3), Sampling(temperature=0.7, top_p=0.5, seed=4), Sampling()]


@pytest.mark.parametrize("sampling", BIG, ids=["typical", "top_p", "temperature", "top_p_0.5", "greedy"])
def test_gemma_vocabulary(sampling: Sampling) -> None:
    rng = np.random.default_rng(7)
    logits = _gemma_like(rng, 3)
    logits[1, rng.integers(0, GEMMA_VOCAB, size=1000)] = np.nan
    logits[2, :] = np.round(logits[2, :])  # ties everywhere
    positions = [5, 1 << 19, 77]
    assert sample_rows(logits, [sampling] * 3, positions).tolist() == _oracle(logits, [sampling] * 3, positions)


def test_gemma_vocabulary_mixed_call_and_widening() -> None:
    """One call, every kind of row; then a start of 1 that must widen several times on a flat row."""
    rng = np.random.default_rng(8)
    logits = _gemma_like(rng, len(BIG))
    positions = list(range(100, 100 + len(BIG)))
    assert sample_rows(logits, BIG, positions).tolist() == _oracle(logits, BIG, positions)
    flat = rng.normal(scale=0.05, size=(1, GEMMA_VOCAB)).astype(np.float32)  # nucleus ~ 95% of the vocabulary
    s = [Sampling(temperature=1.0, top_p=0.95, seed=9)]
    assert sample_rows(flat, s, [3], nucleus_start=1).tolist() == _oracle(flat, s, [3])


@pytest.mark.skipif(not SOAK, reason="DGR_SOAK=1: big vocabularies under hypothesis")
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), vocab=st.sampled_from([1000, 32_000, 151_936, GEMMA_VOCAB]),
       nucleus_start=st.sampled_from([1, 64, 256]))
def test_soak_big_vocabularies(data: st.DataObject, vocab: int, nucleus_start: int) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = _gemma_like(rng, 2, vocab)
    if data.draw(st.booleans()):
        logits[0] = np.round(logits[0] * 2)  # ties
    if data.draw(st.booleans()):
        logits[1, rng.random(vocab) < 0.2] = -np.inf
        logits[1, rng.random(vocab) < 0.01] = np.nan
    samplings = [data.draw(_samplings(vocab)) for _ in range(2)]
    positions = [data.draw(st.integers(0, 1 << 20)) for _ in range(2)]
    got = sample_rows(logits, samplings, positions, nucleus_start=nucleus_start).tolist()
    assert got == _oracle(logits, samplings, positions)


def test_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        sample_rows(np.zeros(3), [Sampling()], [0])
    with pytest.raises(ValueError):
        sample_rows(np.zeros((2, 3)), [Sampling()], [0])
    with pytest.raises(ValueError):
        sample_rows(np.zeros((1, 0)), [Sampling()], [0])
