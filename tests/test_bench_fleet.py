"""`dgr bench fleet` (dgrtools/bench/fleet.py): its measures (best hit rate, balance, solo tokens), its engine's
prefix contract, `--cost` on a small fleet, and (DGR_SLOW=1) the `--quick` run end to end: three sleep-engine
consumer processes, the three sides, a worker killed -9."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from consumer.batch import FusedBatch
from consumer.cli import command_line
from dgrtools.bench import fleet
from dgrtools.bench.fleet_worker import PrefillSleepEngine


def test_best_hit_rate_counts_full_blocks_shared_with_an_earlier_session_of_the_same_system() -> None:
    a, b = [5] * 40, [6] * 40
    prompts = [[*a, 1], [*a, 2], [*b, 1], [*a, 3], [*b, 2]]
    which = [0, 0, 1, 0, 1]
    # sessions 2, 4 and 5 each share 40 tokens: 32 in full blocks of 16
    assert fleet.best_hit_rate(prompts, which) == pytest.approx(3 * 32 / (5 * 41))
    assert fleet.best_hit_rate([a, b], [0, 1]) == 0.0


def test_balance_counts_workers_given_nothing() -> None:
    assert fleet.balance({"w0": 3, "w1": 3}, ["w0", "w1"]) == 1.0
    assert fleet.balance({"w0": 6}, ["w0", "w1", "w2"]) == pytest.approx(3.0)


def test_workload_uses_each_prompt_system_and_arrives_in_order() -> None:
    load = fleet.QUICK
    prompts, which, starts = fleet.workload(load)
    assert len(prompts) == len(which) == len(starts) == load.sessions
    assert starts[0] == 0.0 and starts == sorted(starts)
    for p, k in zip(prompts, which, strict=True):
        assert len(p) == load.system_len + load.suffix and all(3 <= t < fleet.VOCAB for t in p)
        twin = prompts[which.index(k)]
        assert p[:load.system_len] == twin[:load.system_len]


def test_solo_tokens_are_the_engines_greedy_tokens_and_a_restore_changes_none() -> None:
    eng = PrefillSleepEngine(0.0, 0.0, n_slots=2, vocab_size=fleet.VOCAB)
    prompt = [7, 9, 11, 13]
    tok, got = prompt[-1], []
    assert eng.prefix_unsupported() is None
    eng.restore_prefix(0, eng.save_prefix(1), 3)
    for j in range(5):
        b = FusedBatch(phase="decode", slots=np.zeros(1, np.int32), positions=np.array([3 + j], np.int32),
                       tokens=np.array([tok], np.int32), wants_logits=np.ones(1, np.bool_))
        tok = int(np.argmax(eng.step(b)[0]))
        got.append(tok)
    assert fleet.solo_tokens(prompt, 5) == got


def test_cost_on_a_small_fleet_places_every_session(tmp_path: Path) -> None:
    r = fleet.cost(workers=6, slots=4, prompt_len=96, sessions=20, repeats=1)
    assert min(r["place_loaded_us"], r["named_spec_us"], r["choice_us"], r["choose_us"], r["block_ids_us"],
               r["block_ids_memo_us"]) > 0
    res = CliRunner().invoke(command_line(), ["bench", "fleet", "--cost", "--quick", "--workers", "5",
                                              "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "fleet-cost.json").exists()


@pytest.mark.skipif(os.environ.get("DGR_SLOW") != "1", reason="three consumer processes, ~10 s: DGR_SLOW=1")
def test_quick_run_places_by_prefix_and_loses_nothing_to_a_kill(tmp_path: Path) -> None:
    r = fleet.run(tmp_path, fleet.QUICK)
    sides = {s["side"]: s for s in r["sides"]}
    for s in sides.values():
        assert s["answered"] == s["sessions"] and s["tokens_solo"], s
    assert sides["placement"]["hit_rate"] >= sides["round-robin"]["hit_rate"]
    loss = r["loss"]
    assert loss["moved"] >= 1 and loss["lost"] == 0 and loss["not_back"] == 0 and loss["tokens_solo"], loss
    assert (tmp_path / "fleet.json").exists()
