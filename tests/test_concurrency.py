"""Deterministic concurrency: a session's tokens and logits in a fused batch equal the same session alone.

Schedules (tests/fixtures/models.py `make_plans`): 1, 2, 4, 8 sessions with different text prompts,
staggered starts (prefill fused with other sessions' decode rows), session s0 released mid-run and a
late session reusing its slot. Checks:
- reference engine and llama.cpp "invariant" recipe: EXACT (np.array_equal on logits, equal tokens);
- llama.cpp "fast" recipe: teacher forcing (solo run fed the batched run's tokens), logits within
  FAST_ATOL (on the tiny f32 model batched-vs-solo moves logits by ~1.8e-3 on defaults, on Q8_0 by 0);
- the corrupting engine must FAIL the same checks, in every mode, on every engine.
Gemma 3 270M Q4_K_M: the same on opt-in (DGR_SLOW=1, marker slow).
"""

from __future__ import annotations

import pytest

from consumer.engines.reference import NumpyReferenceEngine
from dgrtools.tokenizer import SpmTokenizer, load_tokenizer
from tests.doubles.corrupt import CorruptingEngine
from tests.fixtures.models import (
    SessionPlan,
    compare_runs,
    iter_texts,
    make_plans,
    run_schedule,
    run_solo,
)

N_SESSIONS = (1, 2, 4, 8)
FAST_ATOL = 1e-2  # logits are O(10); a corrupted row moves them by whole units
CTX = 256


def _prompts(path, n, use_llama=False):
    tok = load_tokenizer(path) if use_llama else SpmTokenizer.from_gguf(path)
    return [tok.encode(t) for t in iter_texts(n)]


def _check(engine, solo_engine, plans, *, exact, atol=0.0, teacher_forcing=False):
    batched = run_schedule(engine, plans)
    lengths = {k: len(v.tokens) for k, v in batched.items()}
    forced = {k: v.tokens for k, v in batched.items()} if teacher_forcing else None
    solo = run_solo(solo_engine, plans, lengths=lengths, forced=forced)
    problems, worst = compare_runs(batched, solo, exact=exact, atol=atol, compare_tokens=not teacher_forcing)
    return batched, problems, worst


def _assert_schedule_shape(batched, plans):
    n = len(plans) - 1
    assert batched["late"].slot == batched["s0"].slot  # the released slot was reused
    assert 0 < len(batched["s0"].tokens) < plans[0].n_gen  # s0 really was cut mid-run
    for p in plans:
        if p.name != "s0":
            assert len(batched[p.name].tokens) == p.n_gen
    assert len({b.slot for k, b in batched.items() if k != "late"}) == n


# ------------------------------------------------------------------------------- reference


@pytest.fixture(scope="module")
def ref_engines(tiny_model_path):
    return (NumpyReferenceEngine(tiny_model_path, n_slots=8, ctx_per_session=CTX),
            NumpyReferenceEngine(tiny_model_path, n_slots=1, ctx_per_session=CTX))


@pytest.mark.parametrize("n", N_SESSIONS)
def test_reference_batched_equals_solo_exactly(ref_engines, tiny_model_path, n):
    eng, solo = ref_engines
    plans = make_plans(_prompts(tiny_model_path, n + 1), n)
    batched, problems, worst = _check(eng, solo, plans, exact=True)
    _assert_schedule_shape(batched, plans)
    assert problems == [] and worst == 0.0


# --------------------------------------------------------------------------------- llama.cpp


@pytest.fixture(scope="module")
def llama_engines(tiny_model_path, tiny_f32_model_path):
    pytest.importorskip("llama_cpp")
    from consumer.engines.llama import LlamaCppEngine

    made = {
        "invariant": LlamaCppEngine(tiny_model_path, recipe="invariant", n_slots=8, ctx_per_session=CTX),
        "invariant_solo": LlamaCppEngine(tiny_model_path, recipe="invariant", n_slots=1, ctx_per_session=CTX),
        "fast": LlamaCppEngine(tiny_model_path, recipe="fast", n_slots=8, ctx_per_session=CTX),
        "fast_solo": LlamaCppEngine(tiny_model_path, recipe="fast", n_slots=1, ctx_per_session=CTX),
        "fast_f32": LlamaCppEngine(tiny_f32_model_path, recipe="fast", n_slots=8, ctx_per_session=CTX),
        "fast_f32_solo": LlamaCppEngine(tiny_f32_model_path, recipe="fast", n_slots=1, ctx_per_session=CTX),
    }
    yield made
    for e in made.values():
        e.close()


@pytest.mark.llama
@pytest.mark.parametrize("n", N_SESSIONS)
def test_llama_invariant_batched_equals_solo_exactly(llama_engines, tiny_model_path, n):
    plans = make_plans(_prompts(tiny_model_path, n + 1, use_llama=True), n)
    batched, problems, worst = _check(llama_engines["invariant"], llama_engines["invariant_solo"], plans, exact=True)
    _assert_schedule_shape(batched, plans)
    print(f"llama invariant, {n} sessions: max abs diff batched vs solo {worst:.3g}")
    assert problems == [] and worst == 0.0


@pytest.mark.llama
@pytest.mark.parametrize("model", ["", "_f32"])
@pytest.mark.parametrize("n", N_SESSIONS)
def test_llama_fast_teacher_forced_within_tolerance(llama_engines, tiny_model_path, model, n):
    plans = make_plans(_prompts(tiny_model_path, n + 1), n)
    batched, problems, worst = _check(llama_engines[f"fast{model}"], llama_engines[f"fast{model}_solo"], plans,
                                      exact=False, atol=FAST_ATOL, teacher_forcing=True)
    _assert_schedule_shape(batched, plans)
    print(f"llama fast{model}, {n} sessions, teacher forced: max abs diff {worst:.3g} (tolerance {FAST_ATOL})")
    assert problems == []


# ------------------------------------------------------------------------------- corruption

MODES = ("swap_tokens", "swap_logits", "swap_slots")


def _lockstep_plans(prompts, n):
    """Equal-length prompts starting together: rows at equal positions, so swap_slots can bite."""
    L = min(len(p) for p in prompts[:n])
    return [SessionPlan(f"s{i}", tuple(prompts[i][:L]), 10, 0) for i in range(n)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", (2, 8))
def test_corruption_is_detected_on_reference(ref_engines, tiny_model_path, mode, n):
    eng, solo = ref_engines
    prompts = _prompts(tiny_model_path, n + 1)
    plans = _lockstep_plans(prompts, n) if mode == "swap_slots" else make_plans(prompts, n)
    bad = CorruptingEngine(eng, mode, at=2)
    _, problems, worst = _check(bad, solo, plans, exact=True)
    for s in range(eng.capacity.n_slots):
        eng.release(s)
    assert bad.corruptions >= 1
    assert problems, "the batched-vs-solo check missed a corrupted batch"
    print(f"reference, corrupt {mode}, {n} sessions: detected ({len(problems)} problems), max diff {worst:.3g}")


@pytest.mark.llama
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", ["invariant", "fast"])
def test_corruption_is_detected_on_llama(llama_engines, tiny_model_path, mode, recipe):
    n = 4
    prompts = _prompts(tiny_model_path, n + 1)
    plans = _lockstep_plans(prompts, n) if mode == "swap_slots" else make_plans(prompts, n)
    bad = CorruptingEngine(llama_engines[recipe], mode, at=3)
    if recipe == "invariant":
        _, problems, worst = _check(bad, llama_engines["invariant_solo"], plans, exact=True)
    else:
        _, problems, worst = _check(bad, llama_engines["fast_solo"], plans, exact=False, atol=FAST_ATOL,
                                    teacher_forcing=True)
    for s in range(8):
        llama_engines[recipe].release(s)
    assert bad.corruptions >= 1
    assert problems, f"{recipe}: the check missed a corrupted batch ({mode})"
    assert worst > FAST_ATOL  # corruption is not a rounding-sized effect
    print(f"llama {recipe}, corrupt {mode}: detected, max diff {worst:.3g}")


def test_corrupting_engine_leaves_single_sessions_alone(ref_engines, tiny_model_path):
    eng, solo = ref_engines
    plans = [SessionPlan("only", tuple(_prompts(tiny_model_path, 1)[0]), 8, 0)]
    bad = CorruptingEngine(eng, "swap_tokens", at=0, every=1)
    _, problems, _ = _check(bad, solo, plans, exact=True)
    assert bad.corruptions == 0 and problems == []


# ------------------------------------------------------------------------------------ Gemma


@pytest.fixture(scope="module")
def gemma_engines(gemma_model_path):
    pytest.importorskip("llama_cpp")
    from consumer.engines.llama import LlamaCppEngine

    made = {
        "invariant": LlamaCppEngine(gemma_model_path, recipe="invariant", n_slots=8, ctx_per_session=CTX),
        "invariant_solo": LlamaCppEngine(gemma_model_path, recipe="invariant", n_slots=1, ctx_per_session=CTX),
    }
    yield made
    for e in made.values():
        e.close()


@pytest.mark.slow
@pytest.mark.llama
@pytest.mark.parametrize("n", (2, 8))
def test_gemma_invariant_batched_equals_solo_exactly(gemma_engines, gemma_model_path, n):
    plans = make_plans(_prompts(gemma_model_path, n + 1, use_llama=True), n, n_gen=10)
    batched, problems, worst = _check(gemma_engines["invariant"], gemma_engines["invariant_solo"], plans, exact=True)
    _assert_schedule_shape(batched, plans)
    print(f"gemma invariant, {n} sessions: max abs diff {worst:.3g}")
    assert problems == [] and worst == 0.0


@pytest.mark.slow
@pytest.mark.llama
def test_gemma_corruption_is_detected(gemma_engines, gemma_model_path):
    plans = make_plans(_prompts(gemma_model_path, 5, use_llama=True), 4, n_gen=8)
    bad = CorruptingEngine(gemma_engines["invariant"], "swap_tokens", at=3)
    _, problems, _ = _check(bad, gemma_engines["invariant_solo"], plans, exact=True)
    for s in range(8):
        gemma_engines["invariant"].release(s)
    assert bad.corruptions >= 1 and problems


@pytest.mark.slow
@pytest.mark.llama
def test_gemma_greedy_is_coherent(gemma_engines, gemma_model_path):
    tok = load_tokenizer(gemma_model_path, backend="llama")
    plans = [SessionPlan("france", tuple(tok.encode("The capital of France is")), 8, 0)]
    out = run_schedule(gemma_engines["invariant_solo"], plans)["france"]
    text = tok.decode(out.tokens)
    print("gemma:", repr(text))
    assert "France" in text or "Paris" in text or "capital" in text
