"""Batch invariance on the recurrent (tiny Mamba) and hybrid (tiny Jamba) layouts, engine level: a
session's logits are bit-identical alone, in any batch of 1/2/4/8, under any prefill chunking, after slot
reuse and after a replay ("invariant" recipe, Q8_0 weights). Hypothesis searches prompt lengths, chunk
cuts and arrival orders for a counterexample. Float weights are not invariant on CPU (ggml's one-row
matmul and llamafile's tinyBLAS round differently): measured, bounded, and not claimed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("llama_cpp")

from consumer.batch import BatchRow, FusedBatch
from consumer.engines.llama import LlamaCppEngine
from dgrtools.tiny_recurrent import write_tiny
from tests.fixtures.models import SessionPlan, compare_runs, make_plans, run_schedule, run_solo

pytestmark = pytest.mark.llama

SOAK = os.environ.get("DGR_SOAK") == "1"
LAYOUTS = ("recurrent", "hybrid")
CTX = 256


@pytest.fixture(scope="module")
def engines(tiny_layout_paths: dict[str, Path]) -> Iterator[dict[str, LlamaCppEngine]]:
    es = {k: LlamaCppEngine(tiny_layout_paths[k], n_slots=8, ctx_per_session=CTX, n_batch=512) for k in LAYOUTS}
    yield es
    for e in es.values():
        e.close()


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1, *map(int, rng.integers(3, 512, int(rng.integers(lo, hi))))] for _ in range(n)]


def _reset(e: LlamaCppEngine) -> None:
    for s in range(e.capacity.n_slots):
        e.release(s)


# ---- deterministic: 1/2/4/8 sessions, staggered, a cancel and a slot reused ---------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_batched_equals_alone(engines: dict[str, LlamaCppEngine], layout: str, n: int) -> None:
    e = engines[layout]
    assert e.batch_invariant and e.state_layout.kind == layout
    _reset(e)
    if n < 8:  # s0 is cancelled at tick 5 and "late" takes its slot: slot reuse inside the batched run
        plans = make_plans(_prompts(n + 1, seed=n), n, n_gen=16)
    else:
        plans = [SessionPlan(f"s{i}", tuple(p), 16, start=i % 3) for i, p in enumerate(_prompts(8, seed=8))]
    sizes: list[int] = []
    batched = run_schedule(e, plans, on_batch=lambda b: sizes.append(b.n_sessions))
    assert max(sizes) == n  # the schedule really batched n sessions at once
    solo = run_solo(e, plans, lengths={k: len(v.tokens) for k, v in batched.items()})
    problems, worst = compare_runs(batched, solo, exact=True)
    assert problems == [] and worst == 0.0


def test_three_layouts_in_one_process(engines: dict[str, LlamaCppEngine], tiny_model_path: Path) -> None:
    """What a worker holding one engine per layout runs: the kv engine's schedule (staggered sessions,
    a cancel, a slot reused) with, before each of its fused calls, one fused decode call on the recurrent
    and on the hybrid engine (two sessions each). Every session of every engine equals itself alone."""
    kv = LlamaCppEngine(tiny_model_path, n_slots=8, ctx_per_session=CTX)
    try:
        plans = make_plans(_prompts(5, seed=11), 4, n_gen=12)
        background = {k: _prompts(2, seed=12 + i, lo=10, hi=30) for i, k in enumerate(LAYOUTS)}
        traces: dict[str, list[list[np.ndarray]]] = {k: [[], []] for k in LAYOUTS}
        nxt: dict[str, list[int]] = {}
        for k, e in engines.items():
            _reset(e)
            out = e.step(FusedBatch.from_rows("prefill", [BatchRow(s, i, t, i == len(p) - 1)
                                                          for s, p in enumerate(background[k])
                                                          for i, t in enumerate(p)]))
            nxt[k] = [int(np.argmax(r)) for r in out]

        def other_engines(_b: FusedBatch) -> None:
            for k, e in engines.items():
                rows = [BatchRow(s, e.next_position(s), nxt[k][s], True) for s in range(2)]
                out = e.step(FusedBatch.from_rows("decode", rows))
                for s in range(2):
                    traces[k][s].append(out[s].copy())
                nxt[k] = [int(np.argmax(r)) for r in out]

        batched = run_schedule(kv, plans, on_batch=other_engines)
        solo = run_solo(kv, plans, lengths={k: len(v.tokens) for k, v in batched.items()})
        problems, _ = compare_runs(batched, solo, exact=True)
        assert problems == []
        for k, e in engines.items():
            for s, p in enumerate(background[k]):
                alone = _play(e, [Arrival(tuple(p), (), 0, len(traces[k][s]) + 1)])[0]
                assert all(np.array_equal(x, y) for x, y in zip(traces[k][s], alone[1:], strict=True)), (k, s)
    finally:
        kv.close()


# ---- prefill chunking and replay ---------------------------------------------------------------------

def _chunked(e: LlamaCppEngine, slot: int, prompt: list[int], cuts: list[int]) -> np.ndarray:
    """Logits of every prompt row, the prompt fed in chunks ending at `cuts`."""
    e.release(slot)
    rows_out, pos = [], 0
    for end in [*cuts, len(prompt)]:
        if end <= pos:
            continue
        rows = [BatchRow(slot, p, prompt[p], True) for p in range(pos, end)]
        rows_out.append(e.step(FusedBatch.from_rows("prefill", rows)))
        pos = end
    return np.concatenate(rows_out)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replay_reproduces_the_run(engines: dict[str, LlamaCppEngine], layout: str) -> None:
    """A replay after lost state prefills prompt + generated tokens in one call on another slot: the
    decode that follows is bit-identical to the original run's."""
    e = engines[layout]
    _reset(e)
    prompt = _prompts(1, seed=3, lo=20, hi=21)[0]
    logits = e.step(FusedBatch.from_rows("prefill", [BatchRow(0, i, t, i == len(prompt) - 1)
                                                      for i, t in enumerate(prompt)]))
    gen, trace = [], []
    for k in range(20):
        gen.append(int(np.argmax(logits[-1])))
        logits = e.step(FusedBatch.from_rows("decode", [BatchRow(0, len(prompt) + k, gen[-1], True)]))
        trace.append(logits[0].copy())
    cut = 12  # the state was lost after 12 generated tokens: replay prompt + those 12, then decode on
    full = prompt + gen[:cut]
    got = e.step(FusedBatch.from_rows("prefill", [BatchRow(5, i, t, i == len(full) - 1) for i, t in enumerate(full)]))
    assert np.array_equal(got[0], trace[cut - 1])
    for k in range(cut, 20):
        got = e.step(FusedBatch.from_rows("decode", [BatchRow(5, len(prompt) + k, gen[k], True)]))
        assert np.array_equal(got[0], trace[k]), k


@dataclass(frozen=True)
class Arrival:
    prompt: tuple[int, ...]
    cuts: tuple[int, ...]  # prompt chunk ends (each chunk is one job: one fused call)
    start: int  # tick it arrives
    n_gen: int


@st.composite
def arrivals(draw: st.DrawFn) -> list[Arrival]:
    out = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(1, 90))
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4)))) if n > 1 else []
        seed = draw(st.integers(0, 2**16))
        out.append(Arrival(tuple(_prompts(1, seed, lo=n, hi=n + 1)[0][:n]), tuple(c for c in cuts if c < n),
                           draw(st.integers(0, 6)), draw(st.integers(1, 8))))
    return out


def _play(e: LlamaCppEngine, sessions: list[Arrival]) -> list[list[np.ndarray]]:
    """Every session joins at its tick, feeds its prompt one chunk per tick (chunks of several sessions
    and decode rows of others share each fused call), then decodes greedily; lowest free slot first."""
    _reset(e)
    slot_of: dict[int, int] = {}
    fed = [0] * len(sessions)
    gen: list[list[int]] = [[] for _ in sessions]
    logits: list[list[np.ndarray]] = [[] for _ in sessions]
    free = list(range(e.capacity.n_slots))
    for tick in range(500):
        for i, a in enumerate(sessions):
            if a.start <= tick and i not in slot_of and len(gen[i]) < a.n_gen and free:
                slot_of[i] = free.pop(0)
        rows, owners = [], []
        for i, s in sorted(slot_of.items(), key=lambda kv: -kv[0]):  # rows in descending session order
            a = sessions[i]
            if fed[i] < len(a.prompt):
                end = next((c for c in a.cuts if c > fed[i]), len(a.prompt))
                rows += [BatchRow(s, p, a.prompt[p], p == end - 1) for p in range(fed[i], end)]
                fed[i] = end
                if end == len(a.prompt):
                    owners.append(i)
            else:
                rows.append(BatchRow(s, len(a.prompt) + len(gen[i]) - 1, gen[i][-1], True))
                owners.append(i)
        if not rows:
            if len(slot_of) == 0 and all(len(g) >= a.n_gen for g, a in zip(gen, sessions, strict=True)):
                return logits
            continue
        out = e.step(FusedBatch.from_rows("prefill", rows))
        wanted = [r.slot for r in rows if r.wants_logits]
        for row, s in zip(out, wanted, strict=True):
            i = next(j for j, t in slot_of.items() if t == s)
            if i not in owners:
                continue
            logits[i].append(row.copy())
            gen[i].append(int(np.argmax(row)))
            if len(gen[i]) >= sessions[i].n_gen:
                e.release(s)
                free.append(s)
                free.sort()
                del slot_of[i]
    raise AssertionError("schedule did not finish")


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=300 if SOAK else 20, deadline=None, derandomize=not SOAK, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sessions=arrivals())
def test_any_chunking_and_arrival_equals_alone(engines: dict[str, LlamaCppEngine], layout: str,
                                              sessions: list[Arrival]) -> None:
    """Searched: prompt lengths, chunk cuts, arrival ticks, generation lengths; every session against
    itself alone (prompt in one call, one row per decode step), bit for bit."""
    e = engines[layout]
    batched = _play(e, sessions)
    for i, a in enumerate(sessions):
        alone = _play(e, [Arrival(a.prompt, (), 0, a.n_gen)])[0]
        assert len(alone) == len(batched[i])
        for k, (x, y) in enumerate(zip(batched[i], alone, strict=True)):
            assert np.array_equal(x, y), f"session {i} step {k}: max diff {float(np.abs(x - y).max()):.3g}"


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=200 if SOAK else 20, deadline=None, derandomize=not SOAK, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 120), cuts=st.lists(st.integers(1, 119), max_size=6), seed=st.integers(0, 2**16))
def test_prefill_rows_do_not_depend_on_the_cuts(engines: dict[str, LlamaCppEngine], layout: str, n: int,
                                               cuts: list[int], seed: int) -> None:
    e = engines[layout]
    prompt = _prompts(1, seed, lo=n, hi=n + 1)[0][:n]
    whole = _chunked(e, 0, prompt, [])
    assert np.array_equal(_chunked(e, 1, prompt, sorted({c for c in cuts if c < n})), whole)


# ---- float weights: not invariant, and not claimed ------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_float_weights_differ_and_are_not_claimed_invariant(tmp_path: Path, layout: str) -> None:
    """The same model in f32: the engine does not claim invariance, and batched vs alone differ by
    rounding only (teacher-forced: both runs fed the same tokens). Measured here: recurrent 1.9e-6, hybrid
    9.4e-4; a corrupted row would move logits by whole units."""
    path = tmp_path / f"{layout}-f32.gguf"
    write_tiny(path, layout, quant="f32")  # type: ignore[arg-type]
    e = LlamaCppEngine(path, n_slots=4, ctx_per_session=CTX)
    try:
        assert e.recipe.quantization == "F32" and not e.batch_invariant
        prompts = _prompts(4, seed=5)
        forced = tuple(range(300, 316))
        plans = [SessionPlan(f"s{i}", tuple(p), 16, start=i, forced=forced) for i, p in enumerate(prompts)]
        batched = run_schedule(e, plans)
        problems, worst = compare_runs(batched, run_solo(e, plans), exact=False, atol=1e-2)
        assert problems == [], problems
        assert worst > 0  # not bit-exact: if this ever holds exactly, the recipe may claim invariance
    finally:
        e.close()
