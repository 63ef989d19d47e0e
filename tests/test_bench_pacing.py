"""`dgr bench pacing` (dgrtools/bench/pacing.py): the real scheduler and pacer on a virtual clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgrtools.bench.pacing import BUDGET, FLOOR, POLICIES, CostModel, run, simulate

COST = CostModel()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_session_gets_its_tokens_and_no_policy_beats_the_raw_engine(policy: str) -> None:
    r = simulate([(0.0, f"p{i}", 300, 6) for i in range(5)], policy)
    assert all(len(r.times[f"p{i}"]) == 7 for i in range(5))
    s = r.summary([f"p{i}" for i in range(5)], [f"p{i}" for i in range(5)], COST, 1500)
    assert 0.5 < s["raw_over_last_first"] <= 1.0
    assert r.calls["prefill"] >= 1 and r.calls["decode"] >= 5


def test_paced_gaps_stay_within_a_decode_call_and_a_floor_sized_prefill_call() -> None:
    """While a long prompt waits, the worker's pacing keeps each decoder's gap to about one decode call plus
    one prefill call of the floor; the whole budget (fixed) lets a gap grow to a 512-token call."""
    decoders = [f"d{i}" for i in range(4)]
    arrivals = [(0.0, d, 8, 40) for d in decoders] + [(0.3, "long", 1500, 1)]
    decode_call = COST.decode_fixed + COST.decode_row * 4
    floor_call = COST.prefill_fixed + COST.prefill_token * FLOOR
    paced = simulate(arrivals, "paced").summary(decoders, ["long"], COST, None)
    fixed = simulate(arrivals, "fixed").summary(decoders, ["long"], COST, None)
    assert paced["gap_p99_ms"] <= 1e3 * (decode_call + floor_call) * 1.01
    assert fixed["gap_p99_ms"] >= 1e3 * (COST.prefill_fixed + COST.prefill_token * BUDGET) * 0.99
    assert fixed["median_ttft_s"] < paced["median_ttft_s"]  # what the gaps buy


def test_the_bench_writes_its_table(tmp_path: Path) -> None:
    payload = run(tmp_path, sessions=3, prompt_len=200, tokens=4, policies=("paced", "fixed"))
    assert len(payload["rows"]) == 3 * 2 and (tmp_path / "pacing.json").exists()
    assert "| wave 3 x 200 | paced |" in payload["markdown"]
