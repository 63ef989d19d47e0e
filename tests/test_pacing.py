from __future__ import annotations

import pytest

from consumer.sched.pacing import PrefillPacer


def simulate(pacer: PrefillPacer, fixed: float, per_token: float, decode: float, rounds: int = 40) -> int:
    budget = pacer.max_tokens
    for _ in range(rounds):
        pacer.observe("decode", 4, decode)
        budget = pacer.budget(decoding=True)
        pacer.observe("prefill", budget, fixed + per_token * budget)
    return budget


@pytest.mark.parametrize("fixed, per_token, decode", [(0.0, 0.003, 0.05), (0.01, 0.001, 0.05),
                                                      (0.001, 0.0001, 0.004)])
def test_prefill_call_converges_to_ratio_of_decode_call(fixed: float, per_token: float, decode: float) -> None:
    pacer = PrefillPacer(max_tokens=4096, ratio=0.8, min_tokens=1)  # the ratio alone, no floor
    k = simulate(pacer, fixed, per_token, decode)
    assert (fixed + per_token * k) == pytest.approx(0.8 * decode, rel=0.05)


def test_full_budget_when_nothing_decodes_or_fixed_mode() -> None:
    pacer = PrefillPacer(max_tokens=512, ratio=0.8, min_tokens=1)
    assert pacer.budget(decoding=True) == 512  # nothing learned yet
    simulate(pacer, 0.0, 0.003, 0.05)
    assert pacer.budget(decoding=False) == 512
    assert pacer.budget(decoding=True) < 20
    assert PrefillPacer(max_tokens=512, ratio=0).budget(decoding=True) == 512


def test_budget_bounds() -> None:
    pacer = PrefillPacer(max_tokens=64, ratio=0.8, min_tokens=8)
    simulate(pacer, 0.0, 1.0, 0.05)  # a very slow prefill: floor
    assert pacer.budget(decoding=True) == 8
    pacer = PrefillPacer(max_tokens=64, ratio=0.8)
    simulate(pacer, 0.0, 1e-6, 0.05)  # a very fast prefill: ceiling
    assert pacer.budget(decoding=True) == 64


def test_default_floor_holds_whatever_the_decode_load() -> None:
    pacer = PrefillPacer(max_tokens=512, ratio=0.8)
    simulate(pacer, 0.0, 1.0, 0.001)  # prefill 1000x slower per token than a decode call
    assert pacer.budget(decoding=True) == 32
    assert PrefillPacer(max_tokens=16, ratio=0.8, min_tokens=32).budget(decoding=True) == 16  # capped by B
