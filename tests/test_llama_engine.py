"""LlamaCppEngine on the tiny Q8_0 model: one decode per step, position checks, rollback, recipes,
logging, and the reference-vs-llama.cpp logits cross-check."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from consumer.batch import BatchRow, EngineOutput, FusedBatch
from consumer.engines import Engine, EngineError
from consumer.engines import llama as llama_mod
from consumer.engines.llama import LlamaCppEngine, _extra_bufts, bench_engine_decode
from consumer.engines.reference import NumpyReferenceEngine
from dgrtools.tiny_model import TINY, file_sha256

pytestmark = pytest.mark.llama

PROMPT = [1, 300, 301, 302, 400, 401]


class CountingLlama:
    """Stands in for the llama_cpp module inside one engine and counts llama_decode calls."""

    def __init__(self, real):
        self._real = real
        self.decodes = 0
        self.batch_sizes: list[int] = []

    def llama_decode(self, ctx, batch):
        self.decodes += 1
        self.batch_sizes.append(batch.n_tokens)
        self.seq_ids = [batch.seq_id[i][0] for i in range(batch.n_tokens)]
        return self._real.llama_decode(ctx, batch)

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    e = LlamaCppEngine(tiny_model_path, n_slots=8, ctx_per_session=256, n_batch=64)
    yield e
    e.close()


@pytest.fixture
def eng(engine):
    for s in range(engine.capacity.n_slots):
        engine.release(s)
    yield engine
    engine._L = llama_mod.llama_cpp_module()


def prefill(engine, slot, tokens, start=0, all_logits=False):
    rows = [BatchRow(slot, start + i, t, all_logits or i == len(tokens) - 1) for i, t in enumerate(tokens)]
    return engine.step(FusedBatch.from_rows("prefill", rows))


def test_contract_fields(eng, tiny_model_path):
    assert isinstance(eng, Engine)
    assert eng.identity.architecture == "llama"
    assert eng.identity.gguf_sha256 == file_sha256(tiny_model_path)
    r = eng.recipe
    assert (r.quantization, r.kv_cache_type, r.ctx_per_session, r.flash_attention, r.batch_invariant, r.runtime) == \
        ("Q8_0", "f16", 256, False, True, "llama-cpp-python==0.3.36")
    assert eng.batch_invariant
    assert eng.state_layout.kind == "kv"
    assert eng.state_layout.dims == {"n_layer": 2, "n_head_kv": 2, "head_dim": 32, "n_embd_k_gqa": 64,
                                     "n_ctx_per_seq": 256}
    assert (eng.boundary.first_layer, eng.boundary.last_layer) == (0, TINY.n_layer)
    assert (eng.capacity.n_slots, eng.capacity.ctx_per_session, eng.capacity.max_tokens_per_call,
            eng.capacity.vocab_size) == (8, 256, 64, TINY.n_vocab)
    d = eng.describe()
    for key in ("backend", "recipe", "cpu_path", "system_info", "model", "quantization", "kv_cache_type",
                "flash_attention", "n_threads", "n_ctx_seq"):
        assert d[key], key
    assert "use_extra_bufts=False" in d["cpu_path"] and "AMX" in d["cpu_path"]
    assert "GGML_CPU_TILED_MM=0" in d["cpu_path"]
    print("describe():", d)


def test_fast_recipe_is_labelled(tiny_model_path):
    e = LlamaCppEngine(tiny_model_path, recipe="fast", n_slots=2, ctx_per_session=256, kv_cache_type="f32",
                       flash_attention=False)
    try:
        assert e.capacity.max_tokens_per_call == 512  # llama.cpp caps n_batch (2048) at n_ctx = 2 x 256
        assert e.recipe.batch_invariant is False and not e.batch_invariant
        assert (e.recipe.kv_cache_type, e.recipe.flash_attention) == ("f32", False)
        assert e.describe()["recipe"] == "fast"
        assert "use_extra_bufts=False" in e.describe()["cpu_path"]  # plain buffers unless asked
    finally:
        e.close()


@pytest.mark.parametrize("asked, recipe, cpu, build, want", [
    ("auto", "invariant", False, False, False), ("auto", "fast", False, False, True),
    ("auto", "fast", True, False, True), ("auto", "fast", False, True, True), ("auto", "fast", True, True, False),
    (True, "fast", True, True, True), (True, "invariant", False, False, True), (False, "fast", False, False, False)])
def test_repacked_weights_only_where_they_are_safe_and_leave_invariance_alone(asked, recipe, cpu, build, want):
    """auto: fast repacks as llama-server does, unless an AMX build meets a CPU advertising AMX (a VM may
    advertise it and SIGILL); invariant never does (a repacked matmul's kernel depends on the call's rows);
    an explicit choice wins."""
    got, why = _extra_bufts(asked, recipe, {"cpu_advertises_amx": cpu, "build_has_amx": build})
    assert got is want and why


def test_one_decode_per_step_whatever_the_sessions(eng):
    counter = CountingLlama(eng._L)
    eng._L = counter
    rows = []
    for s in range(8):
        rows += [BatchRow(s, i, 300 + s + i, i == 2) for i in range(3)]
    out = eng.step(FusedBatch.from_rows("prefill", rows))
    assert out.shape == (8, TINY.n_vocab)
    assert counter.decodes == 1 and counter.batch_sizes == [24]
    nxt = out.argmax(axis=1)
    for k in range(3):
        out = eng.step(FusedBatch.from_rows("decode", [BatchRow(s, 3 + k, int(nxt[s]), True) for s in range(8)]))
        nxt = out.argmax(axis=1)
    assert counter.decodes == 4 and counter.batch_sizes[1:] == [8, 8, 8]


def test_logit_rows_in_row_order(eng):
    out = prefill(eng, 0, PROMPT, all_logits=True)
    assert out.shape == (len(PROMPT), TINY.n_vocab) and out.dtype == np.float32
    eng.release(0)
    rows = [BatchRow(0, i, t, i in (1, 4)) for i, t in enumerate(PROMPT)]
    sel = eng.step(FusedBatch.from_rows("prefill", rows))
    assert np.array_equal(sel, out[[1, 4]])


def test_a_calls_rows_are_its_own_unless_lent(eng):
    """Engine.forward's contract: the rows are the caller's, no later call writes them. `forward_lent` (the worker's
    calls) gives a call's logits rows in place when llama.cpp wrote them in the caller's order (EngineOutput.borrowed,
    valid until the next call); `owned()` is a copy no later call writes (a chained call: the loop samples call k
    while k + 1 computes, consumer/worker/chain.py)."""
    out = eng.forward(FusedBatch.from_rows("prefill", [BatchRow(0, i, t, True) for i, t in enumerate(PROMPT)]))
    assert not out.borrowed and out.rows.flags.owndata
    kept_own = np.array(out.rows)
    eng.release(0)
    lent = eng.forward_lent(FusedBatch.from_rows("prefill", [BatchRow(0, i, t, True) for i, t in enumerate(PROMPT)]))
    assert lent.borrowed and not lent.rows.flags.owndata
    kept = lent.owned()
    assert not kept.borrowed and kept.owned() is kept and kept.rows.flags.owndata
    copy = np.array(lent.rows)
    eng.forward(FusedBatch.from_rows("decode", [BatchRow(0, len(PROMPT), 7, True)]))
    eng.forward_lent(FusedBatch.from_rows("prefill", [BatchRow(1, i, t, True) for i, t in enumerate(PROMPT[::-1])]))
    assert np.array_equal(kept.rows, copy) and np.array_equal(out.rows, kept_own) and np.array_equal(copy, kept_own)


def test_lent_rows_equal_the_copied_rows(eng):
    """The rows read in place are the rows the engine copies out row by row when the caller's order is not
    llama.cpp's (the same call state: the two sessions' prompts, then one decode row each, in both orders)."""
    for s, prompt in ((0, PROMPT), (1, PROMPT[::-1])):
        prefill(eng, s, prompt)
    n = len(PROMPT)
    ordered = eng.forward_lent(FusedBatch.from_rows("decode", [BatchRow(0, n, 7, True), BatchRow(1, n, 9, True)]))
    assert ordered.borrowed
    in_place = ordered.owned().rows
    for s in (0, 1):
        eng.release(s)
    for s, prompt in ((0, PROMPT), (1, PROMPT[::-1])):
        prefill(eng, s, prompt)
    swapped = eng.forward_lent(FusedBatch.from_rows("decode", [BatchRow(1, n, 9, True), BatchRow(0, n, 7, True)]))
    assert not swapped.borrowed and swapped.rows.flags.owndata
    assert np.array_equal(in_place, swapped.rows[::-1])


def test_an_engine_that_wraps_or_overrides_forward_is_called_as_it_says(eng, tiny_model_path):
    """The worker's calls (prefix.run.forward_with_prefix) lend rows only from the engine's own class: a subclass
    overriding `forward` (a fault injector) and a wrapper delegating its attributes are called through their own
    `forward`, whose rows are theirs."""
    from consumer.prefix.run import forward_with_prefix
    from consumer.sched import ScheduledBatch

    class Marked(LlamaCppEngine):
        def forward(self, batch):
            return EngineOutput.logits(np.array(super().forward(batch).rows) + 1.0)

    class Wrapper:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def forward(self, batch):
            self.calls += 1
            return self.inner.forward(batch)

    fused = FusedBatch.from_rows("decode", [BatchRow(0, 0, 7, True)])
    wrapper = Wrapper(eng)
    out = forward_with_prefix(wrapper, None, ScheduledBatch("decode", fused, ()), fused)
    assert wrapper.calls == 1 and not out.borrowed
    marked = Marked(tiny_model_path, n_slots=1, ctx_per_session=256)
    try:
        got = forward_with_prefix(marked, None, ScheduledBatch("decode", fused, ()), fused)
        assert not got.borrowed and np.array_equal(got.rows, out.rows + 1.0)
    finally:
        marked.close()


def test_rows_in_any_slot_order_come_back_in_row_order(eng):
    """The engine sorts rows by slot for llama.cpp (one sub-batch per run of consecutive seq ids);
    the caller still gets logits in its own row order."""
    for s in (0, 1, 2):
        eng.release(s)
    prompts = {0: PROMPT[:4], 1: PROMPT[2:7], 2: PROMPT[1:3]}
    descending = sorted(prompts.items(), reverse=True)
    interleaved = [BatchRow(s, i, p[i], i == len(p) - 1) for i in range(5) for s, p in descending if i < len(p)]
    counter = CountingLlama(eng._L)
    eng._L = counter
    mixed = eng.step(FusedBatch.from_rows("prefill", interleaved))
    assert counter.seq_ids == sorted(counter.seq_ids)  # llama.cpp saw the rows grouped by slot
    wanted = [r.slot for r in interleaved if r.wants_logits]
    assert wanted != sorted(wanted) and [r.slot for r in interleaved][:3] == [2, 1, 0]  # really out of order
    for s in (0, 1, 2):
        eng.release(s)
    alone = {s: prefill(eng, s, p)[-1] for s, p in prompts.items()}
    for row, s in zip(mixed, wanted, strict=True):
        assert np.allclose(row, alone[s], atol=1e-3), s


def test_oversized_batch_is_rejected_before_llama(eng):
    counter = CountingLlama(eng._L)
    eng._L = counter
    with pytest.raises(EngineError, match="n_batch"):
        eng.step(FusedBatch.from_rows("prefill", [BatchRow(0, i, 5, False) for i in range(65)]))
    with pytest.raises(EngineError):
        eng.step(FusedBatch.from_rows("prefill", []))
    assert counter.decodes == 0
    assert eng.next_position(0) == 0


def test_position_checks_happen_before_llama(eng):
    counter = CountingLlama(eng._L)
    eng._L = counter
    # llama.cpp itself would accept a first token at p > 0 on an empty sequence: we must not
    with pytest.raises(EngineError) as ei:
        eng.step(FusedBatch.from_rows("prefill", [BatchRow(3, 5, 7, True)]))
    assert ei.value.slots == (3,) and "slot 3" in str(ei.value)
    prefill(eng, 0, PROMPT[:3])
    prefill(eng, 1, PROMPT[:2])
    n = counter.decodes
    with pytest.raises(EngineError) as ei:  # slot 1 skips a position
        eng.step(FusedBatch.from_rows("decode", [BatchRow(0, 3, 5, True), BatchRow(1, 3, 5, True)]))
    assert ei.value.slots == (1,)
    with pytest.raises(EngineError):  # a gap inside one slot's rows
        eng.step(FusedBatch.from_rows("prefill", [BatchRow(2, 0, 7, False), BatchRow(2, 2, 7, True)]))
    with pytest.raises(EngineError) as ei:
        eng.step(FusedBatch.from_rows("decode", [BatchRow(8, 0, 7, True)]))
    assert ei.value.slots == (8,)
    with pytest.raises(EngineError) as ei:
        eng.step(FusedBatch.from_rows("decode", [BatchRow(0, 3, TINY.n_vocab, True)]))
    assert ei.value.slots == (0,)
    assert counter.decodes == n
    assert [eng.next_position(s) for s in range(3)] == [3, 2, 0]


def _solo_logits(engine, slot, tokens):
    engine.release(slot)
    return prefill(engine, slot, tokens, all_logits=True)


def test_llama_failure_becomes_engine_error_and_rolls_back(tiny_model_path, eng):
    """Make llama_decode itself fail (positions desynchronised behind our back, then a full KV
    stream): EngineError, every slot of the call rolled back, the engine goes on exactly."""
    want = _solo_logits(eng, 0, PROMPT)
    eng.release(0)
    prefill(eng, 0, PROMPT[:4])
    prefill(eng, 1, PROMPT[:2])
    eng._next[1] = 5  # desync: llama.cpp has positions 0..1 for slot 1
    with pytest.raises(EngineError, match="llama_decode returned"):
        eng.step(FusedBatch.from_rows("decode", [BatchRow(0, 4, PROMPT[4], True), BatchRow(1, 5, 9, True)]))
    assert eng.next_position(0) == 4
    eng._next[1] = 2
    got = eng.step(FusedBatch.from_rows("decode", [BatchRow(0, 4, PROMPT[4], True), BatchRow(1, 2, 9, True)]))
    got2 = eng.step(FusedBatch.from_rows("decode", [BatchRow(0, 5, PROMPT[5], True)]))
    assert np.array_equal(got[0], want[4]) and np.array_equal(got2[0], want[5])

    # no KV room (return 1): our ctx check is bypassed so llama.cpp's own limit is hit mid-batch
    small = LlamaCppEngine(tiny_model_path, n_slots=2, ctx_per_session=256, n_batch=512)
    try:
        prefill(small, 0, [(300 + i) % 500 for i in range(256)])
        prefill(small, 1, PROMPT[:4])
        small._ctx_per_session = 10**6
        with pytest.raises(EngineError, match="returned 1"):
            small.step(FusedBatch.from_rows("decode", [BatchRow(1, 4, PROMPT[4], True), BatchRow(0, 256, 5, True)]))
        assert (small.next_position(0), small.next_position(1)) == (256, 4)
        out = small.step(FusedBatch.from_rows("decode", [BatchRow(1, 4, PROMPT[4], True)]))
        assert np.array_equal(out[0], want[4])
    finally:
        small.close()


def test_release_and_reuse(eng):
    first = _solo_logits(eng, 5, PROMPT)
    prefill(eng, 5, [9, 9, 9], start=len(PROMPT))
    eng.release(5)
    assert eng.next_position(5) == 0
    with pytest.raises(EngineError):
        eng.step(FusedBatch.from_rows("decode", [BatchRow(5, len(PROMPT) + 3, 5, True)]))
    assert np.array_equal(prefill(eng, 5, PROMPT, all_logits=True), first)
    with pytest.raises(EngineError):
        eng.release(99)


def test_llama_log_goes_to_python_logging(tiny_model_path, caplog, monkeypatch):
    # llama.cpp's levels as Python's; `dgr consumer` adds a filter that demotes INFO (tested in
    # test_cli_errors.py), which an in-process CLI test on this xdist worker may have left on the logger.
    monkeypatch.setattr(logging.getLogger("dgr.llama"), "filters", [])
    caplog.set_level(logging.DEBUG, logger="dgr.llama")
    llama_mod._on_llama_log(3, b"first part ", None)
    llama_mod._on_llama_log(5, b"continued\n", None)
    llama_mod._on_llama_log(4, b"an error\n", None)
    llama_mod._on_llama_log(1, b"debug line\n", None)
    llama_mod._on_llama_log(2, b"info line\n", None)
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "dgr.llama"]
    assert got == [(logging.WARNING, "first part continued"), (logging.ERROR, "an error"),
                   (logging.DEBUG, "debug line"), (logging.INFO, "info line")]
    caplog.clear()
    e = LlamaCppEngine(tiny_model_path, n_slots=1, ctx_per_session=256)
    e.close()
    assert any(r.name == "dgr.llama" for r in caplog.records)  # llama.cpp's own load log arrived
    assert llama_mod._log_cb is not None  # the ctypes callback stays referenced


def test_reference_matches_llama_cpp(tiny_model_path, tiny_f32_model_path):
    """Teacher-forced logits, reference vs llama.cpp, on three configurations.

    1. Q8_0, llama.cpp with f32 KV and no flash attention vs the reference emulating llama.cpp's Q8_0
       activation quantization: the same arithmetic up to summation order. Measured 1.4e-6.
    2. f32 model, f32 KV, no flash attention, plain reference: measured 4.6e-6.
    3. The shipped "invariant" recipe (f16 KV, flash attention) vs the plain reference: f16 keys and
       8-bit activations move logits of magnitude ~12 by up to ~0.2 (measured), argmax mostly agrees.
    """
    toks = [1, 300, 301, 302, 44, 358, 257, 434, 325, 245, 189, 271, 21, 8, 90, 22]
    rows = [BatchRow(0, p, t, True) for p, t in enumerate(toks)]
    batch = FusedBatch.from_rows("prefill", rows)
    diffs = {}
    cases: list[tuple[str, Path, dict[str, Any], dict[str, Any], float]] = [
        ("q8_exact", tiny_model_path, dict(kv_cache_type="f32", flash_attention=False),
         dict(emulate_q8_activations=True), 1e-4),
        ("f32_exact", tiny_f32_model_path, dict(kv_cache_type="f32", flash_attention=False), {}, 1e-4),
        ("q8_invariant_recipe", tiny_model_path, {}, {}, 0.5),
    ]
    for name, path, lkw, rkw, tol in cases:
        e = LlamaCppEngine(path, n_slots=1, ctx_per_session=256, **lkw)
        try:
            a = e.step(batch)
        finally:
            e.close()
        b = NumpyReferenceEngine(path, n_slots=1, ctx_per_session=64, **rkw).step(batch)
        d = float(np.abs(a - b).max())
        agree = float((a.argmax(1) == b.argmax(1)).mean())
        diffs[name] = (d, agree)
        print(f"reference vs llama.cpp [{name}]: max abs logit diff {d:.3g}, argmax agreement {agree:.2f}")
        assert d < tol, (name, d)
        assert agree >= 0.8, (name, agree)
    assert diffs["q8_exact"][0] < diffs["q8_invariant_recipe"][0]


def test_bench_engine_decode_reports(eng):
    res = bench_engine_decode(eng, [1, 2], steps=3, prompt_len=4)
    assert [r["batch"] for r in res] == [1.0, 2.0]
    for r in res:
        assert r["fused_tok_s"] > 0 and r["serial_tok_s"] > 0 and r["speedup"] > 0
    assert all(eng.next_position(s) == 0 for s in range(2))


def test_closed_engine_refuses(tiny_model_path):
    e = LlamaCppEngine(tiny_model_path, n_slots=1, ctx_per_session=256)
    e.close()
    with pytest.raises(EngineError, match="closed"):
        e.step(FusedBatch.from_rows("prefill", [BatchRow(0, 0, 1, True)]))
    e.close()  # idempotent


def test_bad_arguments(tiny_model_path, tmp_path):
    with pytest.raises(ValueError):
        LlamaCppEngine(tiny_model_path, recipe="quick")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        LlamaCppEngine(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(EngineError, match="could not load"):
        LlamaCppEngine(tmp_path / "junk.gguf")


def test_invariant_recipe_refuses_to_claim_without_tiled_mm_off(tiny_model_path, monkeypatch, caplog):
    """ggml reads GGML_CPU_TILED_MM once per process: too late to set it after a decode ran."""
    monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    monkeypatch.setattr(llama_mod, "_decoded_in_process", True)
    e = LlamaCppEngine(tiny_model_path, n_slots=1, ctx_per_session=256)
    try:
        assert e.recipe.batch_invariant is False
        assert "export GGML_CPU_TILED_MM=0" in e.describe()["cpu_path"]
        assert any("batch_invariant=False" in r.getMessage() for r in caplog.records if r.name == "dgr.llama")
    finally:
        e.close()
    monkeypatch.setattr(llama_mod, "_decoded_in_process", False)
    e = LlamaCppEngine(tiny_model_path, n_slots=1, ctx_per_session=256)
    try:
        assert e.recipe.batch_invariant is True
        assert "set by the engine" in e.describe()["cpu_path"]
    finally:
        e.close()


def test_gpu_layers_pass_through_on_a_cpu_build(tiny_model_path):
    """n_gpu_layers reaches llama.cpp; a CPU-only build ignores it and the engine still runs exactly."""
    a = LlamaCppEngine(tiny_model_path, n_slots=1, ctx_per_session=256, n_gpu_layers=99)
    b = LlamaCppEngine(tiny_model_path, n_slots=1, ctx_per_session=256)
    try:
        assert np.array_equal(prefill(a, 0, PROMPT, all_logits=True), prefill(b, 0, PROMPT, all_logits=True))
    finally:
        a.close()
        b.close()


@pytest.mark.slow
def test_gemma_contract_fields(gemma_model_path):
    from dgrtools.gemma import GEMMA_SHA256

    e = LlamaCppEngine(gemma_model_path, n_slots=2, ctx_per_session=512)
    try:
        assert e.identity.architecture == "gemma3"
        assert e.identity.gguf_sha256 == GEMMA_SHA256
        assert e.recipe.quantization == "Q4_K_M"
        assert e.state_layout.dims["n_layer"] == 18 == e.boundary.last_layer
        assert e.capacity.vocab_size == 262144
        print("gemma describe():", e.describe())
    finally:
        e.close()
