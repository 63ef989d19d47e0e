"""consumer.sampling: greedy, temperature / top-k / top-p, keyed by (seed, position) only."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.sampling import argmax_rows, rng_for, sample
from schemas import Sampling

GREEDY = Sampling()


def _draws(logits: np.ndarray, sampling: Sampling, n: int, start: int = 0) -> np.ndarray:
    return np.array([sample(logits, sampling, p) for p in range(start, start + n)])


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---- greedy -----------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = np.array([0.1, 3.0, -2.0, 2.9], dtype=np.float32)
    assert sample(logits, GREEDY, 0) == 1


def test_greedy_ties_take_lowest_index() -> None:
    logits = np.array([1.0, 5.0, 2.0, 5.0, 5.0])
    assert sample(logits, GREEDY, 7) == 1
    assert int(argmax_rows(logits[None, :])[0]) == 1


def test_top_k_one_is_greedy_whatever_the_temperature() -> None:
    logits = np.array([0.0, 0.5, 0.4, 0.5])
    s = Sampling(temperature=5.0, top_k=1, seed=3)
    assert {sample(logits, s, p) for p in range(200)} == {1}


def test_greedy_treats_nan_as_minus_infinity() -> None:
    logits = np.array([np.nan, 1.0, np.nan, 0.5])
    assert sample(logits, GREEDY, 0) == 1
    assert argmax_rows(np.stack([logits, logits[::-1]])).tolist() == [1, 2]


def test_argmax_rows_matches_sample_row_by_row() -> None:
    rng = np.random.default_rng(11)
    m = rng.integers(-3, 4, size=(40, 9)).astype(np.float32)  # many ties
    assert argmax_rows(m).tolist() == [sample(row, GREEDY, i) for i, row in enumerate(m)]


def test_rejects_matrices_and_empty_rows() -> None:
    with pytest.raises(ValueError):
        sample(np.zeros((2, 3)), GREEDY, 0)
    with pytest.raises(ValueError):
        sample(np.zeros(0), GREEDY, 0)
    with pytest.raises(ValueError):
        argmax_rows(np.zeros(3))


# ---- random sampling ----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), position=st.integers(0, 1 << 20),
       temperature=st.floats(0.05, 5.0), top_k=st.integers(0, 40), top_p=st.floats(0.05, 1.0))
def test_same_seed_and_position_same_token(seed: int, position: int, temperature: float, top_k: int,
                                          top_p: float) -> None:
    logits = np.random.default_rng(position % 97).normal(size=32).astype(np.float32)
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    first = sample(logits, s, position)
    assert 0 <= first < 32
    # Nothing else feeds the draw: not the other rows of a call, not earlier draws, not the dtype.
    for _ in range(3):
        sample(np.random.default_rng().normal(size=32), s, position + 1)
        assert sample(logits.astype(np.float64), s, position) == first


def test_rng_depends_on_seed_and_position_only() -> None:
    assert rng_for(5, 9).random() == rng_for(5, 9).random()
    assert rng_for(5, 9).random() != rng_for(5, 10).random()
    assert rng_for(5, 9).random() != rng_for(6, 9).random()


def test_tokens_vary_across_positions_and_seeds() -> None:
    logits = np.zeros(16)
    s = Sampling(temperature=1.0, seed=1)
    assert len(set(_draws(logits, s, 200).tolist())) == 16
    other = Sampling(temperature=1.0, seed=2)
    assert _draws(logits, s, 50).tolist() != _draws(logits, other, 50).tolist()


def test_top_k_restricts_the_support_to_the_k_largest() -> None:
    logits = np.array([0.0, 2.0, 0.5, 1.9, -1.0, 1.8, 0.3, 0.2])
    s = Sampling(temperature=1.0, top_k=3, seed=4)
    assert set(_draws(logits, s, 600).tolist()) == {1, 3, 5}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = np.array([0.05, 0.5, 0.3, 0.1, 0.05])
    logits = np.log(probs)
    # 0.5 + 0.3 = 0.8 < 0.85 -> the nucleus needs the 0.1 token as well.
    s = Sampling(temperature=1.0, top_p=0.85, seed=9)
    assert set(_draws(logits, s, 1000).tolist()) == {1, 2, 3}
    s = Sampling(temperature=1.0, top_p=0.5, seed=9)
    assert set(_draws(logits, s, 200).tolist()) == {1}


def test_top_k_and_top_p_compose() -> None:
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    s = Sampling(temperature=1.0, top_k=3, top_p=0.7, seed=2)
    # top-3 renormalised: 4/9, 3/9, 2/9 -> 7/9 >= 0.7 with two tokens.
    assert set(_draws(np.log(probs), s, 500).tolist()) == {0, 1}


def test_distribution_follows_the_softmax() -> None:
    probs = np.array([0.3, 0.25, 0.15, 0.1, 0.08, 0.06, 0.04, 0.02])
    n = 20_000
    counts = np.bincount(_draws(np.log(probs), Sampling(temperature=1.0, seed=123), n), minlength=8)
    # Fixed seed: the statistic is a fixed number, no flakiness. 7 degrees of freedom; 24.3 is the
    # 0.999 quantile, so a correct sampler passes with room, and a biased one (below) does not.
    assert _chi2(counts, probs) < 24.3
    assert _chi2(counts, np.full(8, 1 / 8)) > 1000


def test_top_k_distribution_is_the_renormalised_softmax() -> None:
    probs = np.array([0.05, 0.4, 0.05, 0.3, 0.2])
    n = 10_000
    counts = np.bincount(_draws(np.log(probs), Sampling(temperature=1.0, top_k=3, seed=77), n), minlength=5)
    kept = np.array([0.4, 0.3, 0.2]) / 0.9
    assert counts[[0, 2]].sum() == 0
    assert _chi2(counts[[1, 3, 4]], kept) < 13.8  # 2 dof, 0.999 quantile


def test_temperature_sharpens_and_flattens() -> None:
    probs = np.array([0.5, 0.2, 0.2, 0.1])
    logits = np.log(probs)
    n = 4000
    cold = np.bincount(_draws(logits, Sampling(temperature=0.25, seed=5), n), minlength=4)
    hot = np.bincount(_draws(logits, Sampling(temperature=4.0, seed=5), n), minlength=4)
    # T=0.25: p ∝ probs**4 -> token 0 has ~0.96 of the mass; T=4: p ∝ probs**0.25, close to flat.
    cold_p = probs**4 / (probs**4).sum()
    hot_p = probs**0.25 / (probs**0.25).sum()
    assert _chi2(hot, hot_p) < 16.3  # 3 dof, 0.999 quantile
    assert cold[0] > 0.93 * n
    assert abs(cold[0] / n - cold_p[0]) < 0.02


def test_infinite_logits_do_not_break_sampling() -> None:
    s = Sampling(temperature=1.0, seed=1)
    inf = np.array([0.0, np.inf, 1.0, np.inf])
    assert set(_draws(inf, s, 200).tolist()) == {1, 3}
    assert sample(np.full(4, -np.inf), s, 0) == 0
    assert sample(np.array([np.nan, -np.inf, 2.0]), s, 0) == 2
