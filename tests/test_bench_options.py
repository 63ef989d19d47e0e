"""Issue 15's bench options: the sleep engine, `bench peer --sampling`'s request bodies, the CLI's checks
of --engine/--overlap/--sampling, and the report's goals table. No server, no model, no subprocess."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from consumer.batch import BatchRow, FusedBatch
from consumer.cli import command_line
from consumer.engines.sleep import SleepEngine, parse_sleep_spec
from consumer.runtime import make_engine
from dgrtools.bench import report
from dgrtools.bench.e2e import SAMPLINGS, _overlap_args, token_gaps
from dgrtools.bench.llama_server import completion_body


def test_sleep_spec_units_and_refusals() -> None:
    assert parse_sleep_spec("sleep:2ms") == pytest.approx(0.002)
    assert parse_sleep_spec("sleep:2") == pytest.approx(0.002)  # ms by default
    assert parse_sleep_spec("sleep:250us") == pytest.approx(0.00025)
    assert parse_sleep_spec("sleep:0.5s") == pytest.approx(0.5)
    for bad in ("sleep:", "sleep:-1ms", "sleep:2 ms", "sleep:2min", "sleepy:2ms", "llama"):
        with pytest.raises(ValueError):
            parse_sleep_spec(bad)


rows = st.lists(st.tuples(st.integers(0, 15), st.integers(0, 1000), st.integers(0, 255)), min_size=1, max_size=24,
                unique_by=lambda r: r[0])


@settings(max_examples=60, deadline=None)
@given(rows=rows, perm=st.randoms(use_true_random=False))
def test_sleep_engine_tokens_depend_on_neither_slot_nor_batch(rows: list[tuple[int, int, int]], perm: object) -> None:
    """A row's greedy token is the same alone, in any batch, in any order and in any slot."""
    eng = SleepEngine(0.0, n_slots=16, vocab_size=97)
    batch = FusedBatch.from_rows("decode", [BatchRow(s, p, t, True) for s, p, t in rows])
    together = np.argmax(eng.step(batch), axis=1)
    shuffled = list(rows)
    perm.shuffle(shuffled)  # type: ignore[attr-defined]
    moved = [((s + 5) % 16, p, t) for s, p, t in shuffled]
    again = np.argmax(eng.step(FusedBatch.from_rows("decode", [BatchRow(s, p, t, True) for s, p, t in moved])), axis=1)
    by_row = {(p, t): int(x) for (_, p, t), x in zip(rows, together, strict=True)}
    assert {(p, t): int(x) for (_, p, t), x in zip(moved, again, strict=True)} == by_row
    for (s, p, t), x in zip(rows, together, strict=True):
        alone = eng.step(FusedBatch.from_rows("decode", [BatchRow(s, p, t, True)]))
        assert alone.shape == (1, 97) and int(np.argmax(alone[0])) == x and 3 <= x < 97


def test_sleep_engine_sleeps_with_the_gil_released() -> None:
    eng = make_engine(None, kind="sleep:60ms", n_slots=2)  # type: ignore[arg-type]
    assert isinstance(eng, SleepEngine) and eng.capacity.n_slots == 2
    ticks = [0]
    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            ticks[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    t0 = time.perf_counter()
    out = eng.forward(FusedBatch.from_rows("decode", [BatchRow(0, 3, 9, True), BatchRow(1, 3, 9, True)]))
    took = time.perf_counter() - t0
    before = ticks[0]
    done.set()
    t.join()
    assert took >= 0.06 and out.rows.shape == (2, 256)
    assert before > 1000  # the other thread ran during the call


def test_token_gaps_split_the_first_gap_from_the_later_ones() -> None:
    # a session whose second token waits one round trip (5 ms) more than its later 2 ms gaps, one that does not,
    # and one with a single token (no gap)
    late = [0.0, 0.007, 0.009, 0.011, 0.013]
    ramped = [0.0, 0.002, 0.004, 0.006]
    first, later = token_gaps([late, late, ramped, [0.5]])
    assert first == pytest.approx(7.0) and later == pytest.approx(2.0)
    assert token_gaps([[0.0]]) == (0.0, 0.0)


def test_peer_request_bodies_carry_dgrs_sampling() -> None:
    greedy = completion_body([1, 2], 16)
    assert (greedy["temperature"], greedy["top_k"]) == (0.0, 1) and "seed" not in greedy
    assert completion_body([1, 2], 16, sampling=SAMPLINGS["greedy"]) == greedy
    typical = completion_body([1, 2], 16, sampling=SAMPLINGS["typical"].model_copy(update={"seed": 5}))
    assert (typical["temperature"], typical["top_k"], typical["top_p"], typical["seed"]) == (0.8, 40, 0.95, 5)
    # every other llama.cpp sampler stage neutral, so both sides run the same stages
    assert (typical["min_p"], typical["typical_p"], typical["repeat_penalty"], typical["dry_multiplier"],
            typical["xtc_probability"]) == (0.0, 1.0, 1.0, 0.0, 0.0)
    top_p = completion_body([1], 4, sampling=SAMPLINGS["top-p"])
    assert (top_p["top_k"], top_p["top_p"]) == (0, 0.95)  # 0: no top-k cut on both sides
    assert typical["prompt"] == [1, 2] and typical["n_predict"] == 16 and typical["ignore_eos"]


def test_each_e2e_side_starts_its_consumer_with_its_own_options() -> None:
    """The sides `dgr bench e2e` alternates in one run: --overlap both / io, and --compare's second consumer (the
    first one's flags and the options compared)."""
    assert _overlap_args("on", "on") == ["--overlap"]
    assert _overlap_args("off", "both") == ["--no-overlap"]
    assert _overlap_args("on", "both") == ["--overlap", "--overlap-max-call-ms", "0"]
    assert _overlap_args("in-order", "io") == ["--overlap", "--no-overlap-io"]
    compare = ("--sampler-threads", "1")
    assert _overlap_args("compare", "on", compare) == ["--overlap", "--sampler-threads", "1"]
    assert _overlap_args("compare", "off", compare) == ["--no-overlap", "--sampler-threads", "1"]


@pytest.mark.parametrize("args", [
    ["bench", "e2e", "--engine", "sleep:fast"],
    ["bench", "e2e", "--overlap", "sometimes"],
    ["bench", "e2e", "--sampling", "greedy,nucleus"],
    ["bench", "peer", "--sampling", "warm"],
    ["bench", "e2e", "--overlap", "io", "--compare", "--sampler-threads 1"],
])
def test_bench_options_refused_before_anything_runs(args: list[str]) -> None:
    res = CliRunner().invoke(command_line(), [*args, "--out", "/nonexistent/never-written"])
    assert res.exit_code == 2, res.output


def test_report_puts_each_goal_next_to_its_measurement() -> None:
    def side(eff: float, vs: float) -> dict[str, float]:
        return {"efficiency": eff, "vs_first": vs, "e2e_tok_s": 1.0}

    found = {
        "e2e": [{"model": "gemma", "sampling": "greedy,typical,top-p", "sides": ["greedy", "typical", "top-p"],
                 "rows": [{"batch": 8, "efficiency": 0.98, "sides": {"greedy": side(0.98, 1.0),
                                                                     "typical": side(0.9, 0.92),
                                                                     "top-p": side(0.9, 0.91)}}]},
                {"model": "sleep:2ms", "engine": "sleep:2ms",
                 "rows": [{"batch": 8, "efficiency": 0.95, "sides": {"overlap off": side(0.5, 0.53)}},
                          {"batch": 32, "efficiency": 0.5, "sides": {}}]}],
        "scale": [{"per_session": {"rows": [{"sessions": b, "us_per_session_on": 15.0, "us_per_session_off": 30.0}
                                            for b in (64, 128, 256)],
                                   "fit": {"on": {"us_per_call_fixed": 500.0}, "off": {"us_per_call_fixed": 2000.0}}}}],
        "peer": [{"sampling": "greedy", "ratios": {"wall_dgr_over_server": 1.1}}],
    }
    got = {r[0]: (r[2], r[3]) for r in report.goals(found)}
    assert got["e2e / raw, Gemma, 8 sessions, greedy"] == ("0.98", "yes")
    assert got["e2e / raw, Gemma, 8 sessions, typical"] == ("0.9", "NO")
    assert got["typical / greedy, Gemma, 8 sessions (same run)"] == ("0.92", "NO")
    assert got["top-p / greedy, Gemma, 8 sessions (same run)"] == ("0.91", "yes")
    assert got["e2e / engine-bound, sleep:2ms engine, 8 sessions (overlap on)"] == ("0.95", "yes")
    assert got["e2e / engine-bound, sleep:2ms engine, 32 sessions (overlap on)"] == ("0.5", "NO")
    assert got["e2e / engine-bound, sleep:10ms engine, 256 sessions (overlap on)"] == ("not measured", "-")
    assert got["worker us per session per fused decode call, 128 sessions, overlap on"] == ("15", "yes")
    assert got["worker us per session per fused decode call, 128 sessions, overlap off"] == ("30", "NO")
    assert got["worker us per call independent of the batch (line fit), overlap on"] == ("500", "yes")
    assert got["dgr / llama-server, Gemma, 8 sessions, greedy (wall)"] == ("1.1", "yes")
    assert got["dgr / llama-server, Gemma, 8 sessions, typical (wall)"] == ("not measured", "-")


def test_report_keeps_what_was_written_by_hand(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text(f"# old generated part\n\n{report.HAND_MARKER}\n\n## Goals of issue 99\n\nmeasured by hand\n")
    report.write(tmp_path / "no-runs", out, "dgr bench nothing")
    text = out.read_text()
    assert "old generated part" not in text and "## Headline" in text
    assert text.index("## Headline") < text.index(report.HAND_MARKER) < text.index("## Goals of issue 99")
    report.write(tmp_path / "no-runs", out, "dgr bench nothing")  # written again: kept once, not twice
    assert out.read_text().count("## Goals of issue 99") == 1
