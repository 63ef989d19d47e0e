"""The canonical sampler's specification (docs/sampling.md), checked on the oracle `consumer.sampling.sample`:
greedy, the random draw and its distribution, every control by hand, log-probabilities, the shared
primitives against their literal definitions, and strict validation of `Sampling` at the edge."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from consumer.sampling import (
    RowContext,
    RowStatus,
    Vocabulary,
    argmax_rows,
    raw_logprobs,
    sample,
    sample_row,
    top_logprobs,
    uniform,
)
from consumer.sampling.arith import LANES, lane_sum, lane_sum_dense, splitmix64
from schemas import Sampling

GREEDY = Sampling()
F32 = np.float32


def _draws(logits: np.ndarray, sampling: Sampling, n: int, start: int = 0, **kw: object) -> np.ndarray:
    return np.array([sample(logits, sampling, p, **kw) for p in range(start, start + n)])  # type: ignore[arg-type]


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _ctx(tokens: list[int], prompt_end: int, stop: tuple[int, ...] = ()) -> RowContext:
    return RowContext(tokens=np.array(tokens, dtype=np.int32), prompt_end=prompt_end, stop_tokens=stop)


# ---- primitives against their literal definitions -------------------------------------------------


def test_splitmix64_known_values() -> None:
    # SplitMix64's reference outputs for the state sequence starting at 0 (Vigna's splitmix64.c: the first
    # three numbers of a generator seeded with 0).
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    assert splitmix64((2 * 0x9E3779B97F4A7C15) % 2**64) == 0x06C45D188009454F


def test_uniform_is_a_pure_function_of_seed_and_position() -> None:
    assert uniform(5, 9) == uniform(5, 9)
    assert uniform(5, 9) != uniform(5, 10) and uniform(5, 9) != uniform(6, 9)
    us = np.array([uniform(7, p) for p in range(20_000)])
    assert us.min() >= 0.0 and us.max() < 1.0
    assert abs(us.mean() - 0.5) < 0.01  # roughly uniform (fixed seeds: a fixed number)
    assert uniform(2**63 - 1, (1 << 20)) < 1.0


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 5000), seed=st.integers(0, 2**32 - 1))
def test_lane_sums_are_the_literal_lane_order(size: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    e = (rng.random(size) * 10.0 ** rng.integers(-8, 8, size)).astype(F32)  # wide range: order shows
    lanes = [F32(0)] * LANES
    for i, v in enumerate(e):  # the definition, one element at a time
        lanes[i % LANES] = F32(lanes[i % LANES] + v)
    total = F32(0)
    for v in lanes:
        total = F32(total + v)
    assert lane_sum_dense(e) == total
    ids = rng.permutation(size)[: max(1, size // 3)]
    sparse = np.zeros(size, F32)
    sparse[ids] = e[ids]
    assert lane_sum(ids, e[ids]) == lane_sum_dense(sparse)


def test_cumsum_and_exp_are_elementwise() -> None:
    """What the spec leans on: numpy's float32 cumsum adds one by one; its exp gives each element the same
    bits whatever the array's length, offset or alignment."""
    rng = np.random.default_rng(3)
    v = (rng.random(3000) * 10.0 ** rng.integers(-6, 6, 3000)).astype(F32)
    acc, out = F32(0), []
    for x in v:
        acc = F32(acc + x)
        out.append(acc)
    assert np.array_equal(np.cumsum(v, dtype=F32), np.array(out, dtype=F32))
    z = (rng.normal(size=70_000) * 10).astype(F32)
    full = np.exp(z)
    for off in range(1, 9):
        buf = np.empty(z.shape[0] + off, F32)[off:]
        buf[:] = z
        assert np.array_equal(np.exp(buf), full)
    for n in (1, 2, 7, 15, 16, 17, 63, 1000):
        idx = rng.integers(0, z.shape[0], n)
        assert np.array_equal(np.exp(z[idx]), full[idx])


# ---- greedy ---------------------------------------------------------------------------------------


def test_greedy_is_argmax_lowest_id_on_ties() -> None:
    assert sample(np.array([0.1, 3.0, -2.0, 2.9], dtype=F32), GREEDY, 0) == 1
    logits = np.array([1.0, 5.0, 2.0, 5.0, 5.0])
    assert sample(logits, GREEDY, 7) == 1
    assert int(argmax_rows(logits[None, :])[0]) == 1


def test_top_k_one_and_tiny_temperatures_are_greedy() -> None:
    logits = np.array([0.0, 0.5, 0.4, 0.5])
    assert {sample(logits, Sampling(temperature=5.0, top_k=1, seed=3), p) for p in range(200)} == {1}
    assert Sampling(temperature=1e-6).greedy and not Sampling(temperature=1e-4).greedy


def test_greedy_treats_nan_as_minus_infinity() -> None:
    logits = np.array([np.nan, 1.0, np.nan, 0.5])
    assert sample(logits, GREEDY, 0) == 1
    assert argmax_rows(np.stack([logits, logits[::-1]])).tolist() == [1, 2]


def test_a_row_with_no_finite_logit_has_no_token() -> None:
    for s in (GREEDY, Sampling(temperature=1.0)):
        assert sample_row(np.full(4, -np.inf), s, 0) == (-1, RowStatus.NO_TOKEN)
        assert sample_row(np.full(4, np.nan), s, 0) == (-1, RowStatus.NO_TOKEN)


def test_rejects_matrices_and_empty_rows() -> None:
    with pytest.raises(ValueError):
        sample(np.zeros((2, 3)), GREEDY, 0)
    with pytest.raises(ValueError):
        sample(np.zeros(0), GREEDY, 0)
    with pytest.raises(ValueError):
        argmax_rows(np.zeros(3))
    with pytest.raises(ValueError):
        sample(np.zeros(3), GREEDY, 0, vocab=Vocabulary.plain(4))


# ---- the random draw ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), position=st.integers(0, 1 << 20),
       temperature=st.floats(0.05, 5.0), top_k=st.integers(0, 40), top_p=st.floats(0.05, 1.0),
       min_p=st.sampled_from([0.0, 0.1]))
def test_same_seed_and_position_same_token(seed: int, position: int, temperature: float, top_k: int,
                                          top_p: float, min_p: float) -> None:
    logits = np.random.default_rng(position % 97).normal(size=32).astype(F32)
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    first = sample(logits, s, position)
    assert 0 <= first < 32
    for _ in range(3):  # nothing else feeds the draw: not other rows, not earlier draws, not the dtype
        sample(np.random.default_rng().normal(size=32), s, position + 1)
        assert sample(logits.astype(np.float64), s, position) == first


def test_tokens_vary_across_positions_and_seeds() -> None:
    s = Sampling(temperature=1.0, seed=1)
    assert len(set(_draws(np.zeros(16), s, 200).tolist())) == 16
    assert _draws(np.zeros(16), s, 50).tolist() != _draws(np.zeros(16), Sampling(temperature=1.0, seed=2), 50).tolist()


def test_top_k_restricts_the_support_to_the_k_largest() -> None:
    logits = np.array([0.0, 2.0, 0.5, 1.9, -1.0, 1.8, 0.3, 0.2])
    assert set(_draws(logits, Sampling(temperature=1.0, top_k=3, seed=4), 600).tolist()) == {1, 3, 5}


def test_top_k_ties_at_the_cut_keep_the_lowest_ids() -> None:
    logits = np.array([1.0, 2.0, 1.0, 1.0, 2.0])
    assert set(_draws(logits, Sampling(temperature=1.0, top_k=3, seed=4), 600).tolist()) == {0, 1, 4}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = np.log(np.array([0.05, 0.5, 0.3, 0.1, 0.05]))
    # 0.5 + 0.3 = 0.8 < 0.85 -> the nucleus needs the 0.1 token as well.
    assert set(_draws(logits, Sampling(temperature=1.0, top_p=0.85, seed=9), 1000).tolist()) == {1, 2, 3}
    assert set(_draws(logits, Sampling(temperature=1.0, top_p=0.5, seed=9), 200).tolist()) == {1}


def test_top_k_and_top_p_compose() -> None:
    # top-3 renormalised: 4/9, 3/9, 2/9 -> 7/9 >= 0.7 with two tokens.
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    assert set(_draws(logits, Sampling(temperature=1.0, top_k=3, top_p=0.7, seed=2), 500).tolist()) == {0, 1}


def test_min_p_keeps_tokens_within_a_factor_of_the_best_after_temperature() -> None:
    probs = np.array([0.5, 0.2, 0.04, 0.26])
    logits = np.log(probs)
    # min_p 0.1: p >= 0.05 -> {0, 1, 3}; at T=0.5, p ~ probs^2: 0.2^2/0.5^2 = 0.16 >= 0.1, 0.04 -> 0.0064 no.
    assert set(_draws(logits, Sampling(temperature=1.0, min_p=0.1, seed=1), 800).tolist()) == {0, 1, 3}
    assert set(_draws(logits, Sampling(temperature=0.5, min_p=0.2, seed=1), 800).tolist()) == {0, 3}
    assert set(_draws(logits, Sampling(temperature=1.0, min_p=1.0, seed=1), 100).tolist()) == {0}


def test_distribution_follows_the_softmax() -> None:
    probs = np.array([0.3, 0.25, 0.15, 0.1, 0.08, 0.06, 0.04, 0.02])
    counts = np.bincount(_draws(np.log(probs), Sampling(temperature=1.0, seed=123), 20_000), minlength=8)
    # Fixed seed: a fixed statistic. 7 degrees of freedom, 24.3 the 0.999 quantile; a biased one fails.
    assert _chi2(counts, probs) < 24.3
    assert _chi2(counts, np.full(8, 1 / 8)) > 1000


def test_top_k_distribution_is_the_renormalised_softmax() -> None:
    probs = np.array([0.05, 0.4, 0.05, 0.3, 0.2])
    counts = np.bincount(_draws(np.log(probs), Sampling(temperature=1.0, top_k=3, seed=77), 10_000), minlength=5)
    assert counts[[0, 2]].sum() == 0
    assert _chi2(counts[[1, 3, 4]], np.array([0.4, 0.3, 0.2]) / 0.9) < 13.8  # 2 dof, 0.999 quantile


def test_temperature_sharpens_and_flattens() -> None:
    probs = np.array([0.5, 0.2, 0.2, 0.1])
    logits, n = np.log(probs), 4000
    cold = np.bincount(_draws(logits, Sampling(temperature=0.25, seed=5), n), minlength=4)
    hot = np.bincount(_draws(logits, Sampling(temperature=4.0, seed=5), n), minlength=4)
    cold_p, hot_p = probs**4 / (probs**4).sum(), probs**0.25 / (probs**0.25).sum()
    assert _chi2(hot, hot_p) < 16.3  # 3 dof, 0.999 quantile
    assert abs(cold[0] / n - cold_p[0]) < 0.02


def test_infinite_logits_do_not_break_sampling() -> None:
    s = Sampling(temperature=1.0, seed=1)
    assert set(_draws(np.array([0.0, np.inf, 1.0, np.inf]), s, 200).tolist()) == {1, 3}
    assert sample(np.array([np.nan, -np.inf, 2.0]), s, 0) == 2


# ---- controls by hand ---------------------------------------------------------------------------------


def test_penalties_follow_llama_cpp_formulas() -> None:
    logits = np.array([2.0, -1.0, 1.5, 0.5], dtype=F32)
    ctx = _ctx([0, 0, 1, 3], prompt_end=2)
    s = Sampling(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5, penalty_last_n=-1)
    from consumer.sampling.reference import processed_logits

    x, status = processed_logits(logits, s, context=ctx)
    assert status == RowStatus.OK
    # token 0 (twice): 2 / 2 - (2 * 0.25 + 0.5) = 0; token 1 (once): -1 * 2 - 0.75; 3: 0.5 / 2 - 0.75.
    assert x.tolist() == [0.0, -2.75, 1.5, -0.5]
    assert sample(logits, Sampling(repetition_penalty=2.0), 4, context=ctx) == 2  # greedy moves off token 0


def test_penalty_window_and_prompt() -> None:
    logits = np.array([1.0, 0.9, 0.5], dtype=F32)
    ctx = _ctx([0, 1, 1, 1], prompt_end=1)  # token 0 only in the prompt, token 1 generated three times
    big = Sampling(repetition_penalty=10.0)
    assert sample(logits, big, 4, context=ctx) == 2
    assert sample(logits, big.model_copy(update={"penalize_prompt": False}), 4, context=ctx) == 0
    assert sample(logits, big.model_copy(update={"penalty_last_n": 0}), 4, context=ctx) == 0  # off
    assert sample(logits, big.model_copy(update={"penalty_last_n": 2}), 4, context=ctx) == 0  # window [1, 1]
    assert sample_row(logits, big, 4) == (-1, RowStatus.NO_CONTEXT)


def test_logit_bias_banned_and_allowed() -> None:
    logits = np.array([3.0, 2.0, 1.0, 0.0], dtype=F32)
    assert sample(logits, Sampling(logit_bias=((3, 5.0),)), 0) == 3
    assert sample(logits, Sampling(logit_bias=((99, 4.0),)), 0) == 0  # an id outside the vocabulary: ignored
    assert sample(logits, Sampling(banned_token_ids=(0, 1)), 0) == 2
    assert sample(logits, Sampling(allowed_token_ids=(2, 3)), 0) == 2
    assert set(_draws(logits, Sampling(temperature=2.0, allowed_token_ids=(1, 3), seed=3), 300).tolist()) == {1, 3}
    assert sample_row(logits, Sampling(allowed_token_ids=(7,)), 0) == (-1, RowStatus.NO_TOKEN)  # outside V


def test_logit_bias_arithmetic() -> None:
    logits = np.array([3.0, 2.0], dtype=F32)
    assert sample(logits, Sampling(logit_bias=((0, -1.5),)), 0) == 1  # 3 - 1.5 = 1.5 < 2
    assert sample(logits, Sampling(logit_bias=((0, -1.0),)), 0) == 0  # 2 == 2: lowest id


def test_min_tokens_holds_back_end_of_generation_and_stop_tokens() -> None:
    vocab = Vocabulary(n_vocab=4, eog=np.array([0], np.int32))
    logits = np.array([5.0, 4.0, 3.0, 0.0], dtype=F32)
    s = Sampling(min_tokens=2)
    assert sample(logits, s, 3, context=_ctx([3, 3, 3], 2, stop=(1,)), vocab=vocab) == 2  # 1 generated < 2
    assert sample(logits, s, 4, context=_ctx([3, 3, 3, 2], 2, stop=(1,)), vocab=vocab) == 0  # 2 generated
    assert sample_row(logits, s, 3, vocab=vocab)[1] == RowStatus.NO_CONTEXT


def test_special_tokens_are_masked_unless_allowed_and_eog_stays() -> None:
    vocab = Vocabulary(n_vocab=4, special=np.array([1], np.int32), eog=np.array([2], np.int32))
    logits = np.array([0.0, 9.0, 5.0, 1.0], dtype=F32)
    assert sample(logits, GREEDY, 0, vocab=vocab) == 2
    assert sample(logits, Sampling(allow_special=True), 0, vocab=vocab) == 1
    assert sample(logits, GREEDY, 0) == 1  # a plain vocabulary marks nothing


# ---- log-probabilities --------------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax() -> None:
    rng = np.random.default_rng(4)
    logits = rng.normal(scale=3, size=5000).astype(F32)
    lp = raw_logprobs(logits)
    exact = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    assert np.abs(lp - exact).max() < 1e-4
    assert abs(np.exp(lp.astype(np.float64)).sum() - 1) < 1e-4
    ids, top = top_logprobs(logits, 5)
    assert ids.tolist() == np.argsort(-logits, kind="stable")[:5].tolist()
    assert np.array_equal(top, lp[ids])


def test_logprobs_edge_rows() -> None:
    assert raw_logprobs(np.array([np.inf, 0.0, np.inf])).tolist() == [F32(-math.log(2)), -np.inf, F32(-math.log(2))]
    assert np.isneginf(raw_logprobs(np.full(3, np.nan))).all()
    ids, lp = top_logprobs(np.array([np.nan, 1.0, -np.inf, 1.0]), 4)
    assert ids.tolist() == [1, 3, 0, 2] and np.isneginf(lp[2:]).all()


# ---- Sampling at the edge ------------------------------------------------------------------------------


def test_defaults_are_greedy_and_unconstrained() -> None:
    s = Sampling()
    assert s.greedy and not s.penalized and not s.constrained and s.logprobs is None and not s.allow_special


@pytest.mark.parametrize("bad", [
    {"min_p": 1.5}, {"min_p": -0.1}, {"repetition_penalty": 0.0}, {"repetition_penalty": 11.0},
    {"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"penalty_last_n": -2}, {"logprobs": 21},
    {"logprobs": -1}, {"min_tokens": -1}, {"logit_bias": [[1, 101.0]]}, {"logit_bias": [[1, 1.0], [1, 2.0]]},
    {"logit_bias": [[-1, 1.0]]}, {"banned_token_ids": [3, 3]}, {"allowed_token_ids": []},
    {"allowed_token_ids": [2], "banned_token_ids": [2]}, {"grammar": "root ::= \"a\"", "json_schema": "{}"},
    {"grammar": "   "}, {"grammar": "root ::= \"\x00\""}, {"json_schema": "not json"}, {"json_schema": "[1]"},
    {"grammar": "x" * 40_000}, {"temperature": float("nan")}, {"unknown": 1}, {"allow_special": 1},
])
def test_sampling_rejects_bad_controls(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Sampling.model_validate_json(json.dumps(bad))


def test_a_session_spec_with_the_largest_sampling_fits_one_stream_field() -> None:
    from schemas import RouteHop, SessionSpec
    from schemas.limits import MAX_FIELD_BYTES
    from schemas.session import MAX_SAMPLING_BYTES, MAX_TOKEN_LIST
    from tests.support import compat_key

    big = list(range(2**31 - MAX_TOKEN_LIST, 2**31))
    with pytest.raises(ValidationError, match="bytes as JSON"):
        Sampling(banned_token_ids=tuple(big[1:]), allowed_token_ids=tuple(big),
                 logit_bias=tuple((t, -99.123456789) for t in big))
    with pytest.raises(ValidationError, match="bytes as JSON"):
        Sampling(grammar='root ::= "' + '\\n' * 16_000 + '"')  # escapes double in JSON
    s = Sampling(banned_token_ids=tuple(big[:1500]), grammar="root ::= " + '"a" ' * 4000)
    assert len(s.model_dump_json()) <= MAX_SAMPLING_BYTES
    hops = tuple(RouteHop(worker_id=f"w{i}", key=compat_key("prefill")) for i in range(16))
    spec = SessionSpec(session_id="s" * 64, account_id="a" * 64, route=hops, sampling=s, stop_tokens=tuple(range(16)))
    assert len(spec.model_dump_json()) <= MAX_FIELD_BYTES


def test_sampling_round_trips_through_json() -> None:
    s = Sampling(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=3, repetition_penalty=1.1,
                 presence_penalty=0.2, frequency_penalty=-0.1, penalty_last_n=-1, penalize_prompt=False,
                 logit_bias=((5, -2.0), (9, 1.5)), min_tokens=4, allowed_token_ids=(1, 2, 3), banned_token_ids=(2,),
                 allow_special=True, logprobs=5, json_schema='{"type": "object"}')
    assert Sampling.model_validate_json(s.model_dump_json()) == s
