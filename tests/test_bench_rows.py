"""`dgr bench rows` (dgrtools/bench/rows.py): its steady state is the worker's, so its stage figures mean
what they say: every call after the first is chained and adopted whole, each session answered once per call
with its next token, and the continuation jobs pushed as the Tracker does keep every session in the call."""

from __future__ import annotations

from dgrtools.bench.rows import STAGES, SteadyDecode, measure


def test_the_steady_state_answers_every_session_once_a_call_in_order() -> None:
    run = SteadyDecode(8, decode_n=4, calls=24)
    seen: dict[str, list[int]] = {}
    for _ in range(24):
        assert run.call() == 8  # every session in every call (a dropped row raises)
    for rid, answer in run.ledger.answered.items():
        r = answer.result
        assert r.status.value == "ok" and r.token is not None and not r.finished, rid
        seen.setdefault(r.session_id, []).append(r.position)
    # one answer per call and session (the first call was the prompts': 3 positions on), each at the next position
    assert sorted(seen) == sorted(run.sessions)
    assert all(pos == list(range(3, 3 + len(pos))) and len(pos) >= 24 for pos in seen.values())


def test_every_stage_is_timed_and_counted() -> None:
    """Each stage is timed over the calls and its Python counted: every stage that runs Python each call counts
    some (a stage left out of the run, or run outside its timer, counts none)."""
    got = measure(8, calls=12, decode_n=4, counted=4)
    assert set(got["us_per_call"]) == set(got["opcodes_per_row"]) == set(STAGES)
    assert got["total_us_per_row"] > 0
    assert all(got["opcodes_per_row"][s] > 0 for s in STAGES if s != "admit")  # admit: one call in four


def test_the_opcode_counts_are_the_same_in_every_run() -> None:
    """The counted figures (Python opcodes per row and stage) do not depend on the machine nor the run: what
    docs/benchmarks.md names as the per-row Python left compares across runs and commits."""
    a, b = (measure(8, 2, decode_n=4, counted=6) for _ in range(2))
    assert a["opcodes_per_row"] == b["opcodes_per_row"]
    assert all(a["opcodes_per_row"][s] > 0 for s in ("report", "adopt", "successor", "file", "ledger"))
