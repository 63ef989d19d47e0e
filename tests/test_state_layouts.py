"""The llama.cpp engine on each state layout (tiny llama "kv", tiny Mamba "recurrent", tiny Jamba
"hybrid"): what it advertises, and how a failed fused call is undone (snapshot, trim, or a slot reported
lost, never half done). Failures are real: llama.cpp aborts the graph mid-compute through its abort
callback (the recurrent state is then partly written), or rejects a batch before computing."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from consumer.batch import BatchRow, FusedBatch
from consumer.engines.base import EngineError, engine_key
from consumer.engines.llama import LlamaCppEngine
from consumer.engines.state import SnapshotPolicy, SnapshotStats
from schemas import Reason

pytestmark = pytest.mark.llama

LAYOUTS = ("kv", "recurrent", "hybrid")
PROMPTS = [[1, *range(300 + 7 * i, 300 + 7 * i + 9 + 3 * i)] for i in range(4)]


def make(path: Path, snapshots: SnapshotPolicy = "chunks", n_slots: int = 4) -> LlamaCppEngine:
    return LlamaCppEngine(path, n_slots=n_slots, ctx_per_session=128, n_batch=128, snapshots=snapshots)


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engine(layout: str, tiny_layout_paths: dict[str, Path]) -> Iterator[LlamaCppEngine]:
    e = make(tiny_layout_paths[layout])
    yield e
    e.close()


@pytest.fixture
def eng(engine: LlamaCppEngine) -> LlamaCppEngine:
    for s in range(engine.capacity.n_slots):
        engine.release(s)
    engine._states.stats = SnapshotStats()
    return engine


def prefill(e: LlamaCppEngine, slot: int, tokens: list[int], start: int = 0) -> np.ndarray:
    rows = [BatchRow(slot, start + i, t, i == len(tokens) - 1) for i, t in enumerate(tokens)]
    return e.step(FusedBatch.from_rows("prefill", rows))


def decode(e: LlamaCppEngine, toks: dict[int, int]) -> np.ndarray:
    rows = [BatchRow(s, e.next_position(s), t, True) for s, t in toks.items()]
    return e.step(FusedBatch.from_rows("decode", rows))


class Aborter:
    """llama.cpp's abort callback, armed for one llama_decode: returns True (abort) at the `at`-th graph
    node thread 0 reaches, so the call fails after part of the graph ran (recurrent states half written)."""

    def __init__(self, e: LlamaCppEngine) -> None:
        self.e, self.armed, self.at, self.seen, self.fired = e, False, 0, 0, 0
        self._cb = e._L.ggml_abort_callback(self._on)
        e._L.llama_set_abort_callback(e._ctx, self._cb, ctypes.c_void_p(0))

    def _on(self, _data: Any) -> bool:
        if not self.armed:
            return False
        self.seen += 1
        if self.seen >= self.at:
            self.armed, self.fired = False, self.fired + 1
            return True
        return False

    def arm(self, at: int) -> None:
        self.armed, self.at, self.seen = True, at, 0

    def nodes(self, call: Callable[[], Any]) -> int:
        """How many times the next call checks the callback (about one per graph node): run it unarmed."""
        self.armed, self.at, self.seen = True, 1 << 30, 0
        call()
        self.armed = False
        return self.seen

    def close(self) -> None:
        self.e._L.llama_set_abort_callback(self.e._ctx, self.e._L.ggml_abort_callback(0), ctypes.c_void_p(0))


@pytest.fixture
def aborter(eng: LlamaCppEngine) -> Iterator[Aborter]:
    a = Aborter(eng)
    yield a
    a.close()


# ---- what the engine advertises ---------------------------------------------------------------------

def test_layout_is_advertised_with_its_dimensions(eng: LlamaCppEngine, layout: str) -> None:
    sl, cap = eng.state_layout, eng.capacity
    assert sl.kind == layout and sl.positional == (layout == "kv") == eng._states.positional
    assert eng.identity.architecture == {"kv": "llama", "recurrent": "mamba", "hybrid": "jamba"}[layout]
    if layout == "kv":
        assert sl.dims == {"n_layer": 2, "n_head_kv": 2, "head_dim": 32, "n_embd_k_gqa": 64, "n_ctx_per_seq": 256}
        assert cap.state_bytes_per_token > 0
    else:
        assert {"ssm_inner_size": 256, "ssm_state_size": 16, "ssm_conv_kernel": 4}.items() <= sl.dims.items()
        # one recurrent cell per Mamba block: conv (d_conv - 1) x d_inner + ssm d_state x d_inner, f32
        n_recurrent = 2
        assert sl.dims["state_bytes"] >= n_recurrent * (3 * 256 + 16 * 256) * 4
        assert sl.dims["state_bytes"] < n_recurrent * (3 * 256 + 16 * 256) * 4 + 256  # plus a small header
    if layout == "recurrent":
        assert cap.state_bytes_per_token == 0 and cap.state_bytes_per_session == sl.dims["state_bytes"]
    if layout == "hybrid":
        assert (sl.dims["n_recurrent_layers"], sl.dims["n_attention_layers"], sl.dims["n_head_kv"]) == (2, 2, 2)
        # KV of 2 attention blocks, 2 KV heads of 32, f16 K and V: 512 bytes a position, plus cell metadata
        assert 512 <= cap.state_bytes_per_token <= 512 + 16
        assert cap.state_bytes_per_session > sl.dims["state_bytes"] + 128 * 512
    d = eng.describe()
    assert d["state_layout"] == layout and int(d["state_bytes_per_session"]) == cap.state_bytes_per_session
    assert "taken=0" in d["snapshots"]


def test_layouts_never_share_a_key(tiny_layout_paths: dict[str, Path]) -> None:
    engines = [make(tiny_layout_paths[k], n_slots=1) for k in LAYOUTS]
    try:
        digests = {engine_key(e, ph).digest for e in engines for ph in ("prefill", "decode")}
        assert len(digests) == 6
        for e in engines:  # a key names its layout: a stream of one layout is never another's
            assert engine_key(e, "decode").state == e.state_layout
    finally:
        for e in engines:
            e.close()


def test_recurrent_positions_cannot_be_removed(eng: LlamaCppEngine, layout: str) -> None:
    """Why snapshots exist: llama.cpp refuses to remove the last positions of a recurrent sequence (and
    changes nothing), while a KV cache can."""
    prefill(eng, 0, PROMPTS[0])
    n = len(PROMPTS[0])
    removed = bool(eng._L.llama_memory_seq_rm(eng._mem, 0, n - 3, -1))
    assert removed == (layout == "kv")
    if layout != "kv":
        assert int(eng._L.llama_memory_seq_pos_max(eng._mem, 0)) == n - 1


# ---- undo after a failed call ---------------------------------------------------------------------

def _reference(e: LlamaCppEngine, steps: list[dict[int, int]]) -> list[np.ndarray]:
    """The logits of prompts in slots 0..2 then `steps` decode calls, on a fresh run, no failure."""
    for s in range(3):
        e.release(s)
        prefill(e, s, PROMPTS[s])
    return [decode(e, st) for st in steps]


STEPS = [{0: 400, 1: 401, 2: 402}, {0: 410, 1: 411, 2: 412}, {0: 420, 1: 421, 2: 422}]


@pytest.mark.parametrize("where", [0.0, 0.5, 0.97])
def test_abort_in_decode_no_snapshot(eng: LlamaCppEngine, aborter: Aborter, layout: str, where: float) -> None:
    """A decode call aborted mid-graph (first node, half way, near the end), default policy (no snapshot
    in decode): a KV engine rolls back by position; a recurrent/hybrid engine reports every slot whose
    state moved as lost, empties it, and the slots it could put back go on exactly."""
    want = _reference(eng, STEPS)
    _reference(eng, STEPS[:1])
    n_nodes = aborter.nodes(lambda: decode(eng, STEPS[1]))
    _reference(eng, STEPS[:1])
    aborter.arm(1 + int(where * n_nodes))
    with pytest.raises(EngineError) as ei:
        decode(eng, STEPS[1])
    assert aborter.fired == 1
    err = ei.value
    assert eng._states.stats.taken == 0  # steady-state decode takes no snapshot
    if layout == "kv":
        assert err.lost == () and "rolled back" in str(err)
    else:
        assert err.lost == (0, 1, 2) and set(err.slots) == {0, 1, 2}  # one micro-batch: all three moved
        assert err.reason == Reason.ENGINE_ERROR and "could not be rolled back" in str(err)
        assert [eng.next_position(s) for s in range(3)] == [0, 0, 0]
        assert eng._states.stats.lost == 3
        for s in range(3):  # emptied, not half done: a replay of the session starts from nothing
            assert int(eng._L.llama_memory_seq_pos_max(eng._mem, s)) == -1
            prefill(eng, s, PROMPTS[s])
        decode(eng, STEPS[0])
    got = decode(eng, STEPS[1])
    assert np.array_equal(got, want[1])
    assert np.array_equal(decode(eng, STEPS[2]), want[2])


def test_abort_in_decode_with_snapshots_always(tiny_layout_paths: dict[str, Path], layout: str) -> None:
    """Policy "always": a snapshot before every call, so even an aborted decode is undone exactly."""
    e = make(tiny_layout_paths[layout], snapshots="always")
    a = Aborter(e)
    try:
        want = _reference(e, STEPS)
        _reference(e, STEPS[:1])
        a.arm(10)
        with pytest.raises(EngineError) as ei:
            decode(e, STEPS[1])
        assert ei.value.lost == ()
        assert [e.next_position(s) for s in range(3)] == [len(PROMPTS[s]) + 1 for s in range(3)]
        assert np.array_equal(decode(e, STEPS[1]), want[1])
        assert np.array_equal(decode(e, STEPS[2]), want[2])
        st = e._states.stats
        assert (st.taken > 0) == (layout != "kv") and st.lost == 0
    finally:
        a.close()
        e.close()


class AbortNthDecode:
    """Stands in for the llama_cpp module inside one engine: arms `aborter` for its n-th llama_decode."""

    def __init__(self, real: Any, aborter: Aborter, n: int, at: int) -> None:
        self._real, self._aborter, self._n, self._at, self.decodes = real, aborter, n, at, 0

    def llama_decode(self, ctx: Any, batch: Any) -> int:
        self.decodes += 1
        if self.decodes == self._n:
            self._aborter.arm(self._at)
        return int(self._real.llama_decode(ctx, batch))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_abort_in_a_prefill_chunk_restores_the_snapshot(eng: LlamaCppEngine, aborter: Aborter, layout: str,
                                                         nth: int) -> None:
    """One fused call: a second prefill chunk of slot 0 (13 rows), a fresh prompt in slot 1 (5 rows) and
    a decode row of slot 2. The "invariant" recipe runs it as three llama_decode calls (pieces of 1, 5
    and 13 rows); the nth is aborted mid-graph, after the earlier ones moved their slots. Every slot is
    put back (the non-empty ones from their snapshots, a hybrid's KV trimmed by position; the fresh one
    emptied): nothing lost, and the call run again gives exactly what it gives without a failure."""
    p0, p1, p2 = PROMPTS[0] + PROMPTS[1], PROMPTS[2][:5], PROMPTS[3]
    rows = [BatchRow(0, 10 + i, t, i == len(p0) - 11) for i, t in enumerate(p0[10:])]
    rows += [BatchRow(1, i, t, i == len(p1) - 1) for i, t in enumerate(p1)]
    rows += [BatchRow(2, len(p2), 77, True)]
    call = FusedBatch.from_rows("prefill", rows)

    def setup() -> None:
        for s in range(3):
            eng.release(s)
        prefill(eng, 0, p0[:10])
        prefill(eng, 2, p2)

    setup()
    want = eng.step(call)
    after = decode(eng, {0: 5, 1: 6, 2: 7})
    setup()
    eng._states.stats = SnapshotStats()
    real = eng._L
    eng._L = AbortNthDecode(real, aborter, nth, at=20)
    try:
        with pytest.raises(EngineError) as ei:
            eng.step(call)
        assert eng._L.decodes == nth == aborter.fired * nth
    finally:
        eng._L = real
    assert ei.value.lost == ()
    assert [eng.next_position(s) for s in range(3)] == [10, 0, len(p2)]
    st = eng._states.stats
    assert st.taken == (0 if layout == "kv" else 2)  # slots 0 and 2: the non-empty slots of a chunk call
    assert np.array_equal(eng.step(call), want)
    assert np.array_equal(decode(eng, {0: 5, 1: 6, 2: 7}), after)


def test_llama_rejects_the_batch_before_computing(eng: LlamaCppEngine) -> None:
    """llama_decode fails before touching memory (positions desynchronised behind the engine's back):
    every layout undoes it without a snapshot and nothing is lost."""
    prefill(eng, 0, PROMPTS[0])
    prefill(eng, 1, PROMPTS[1])
    n0, n1 = len(PROMPTS[0]), len(PROMPTS[1])
    want = decode(eng, {0: 5, 1: 6})
    eng.release(0)
    eng.release(1)
    prefill(eng, 0, PROMPTS[0])
    prefill(eng, 1, PROMPTS[1])
    eng._next[1] = n1 + 3  # llama.cpp holds 0..n1-1 for slot 1
    with pytest.raises(EngineError, match="llama_decode returned") as ei:
        eng.step(FusedBatch.from_rows("decode", [BatchRow(0, n0, 5, True), BatchRow(1, n1 + 3, 6, True)]))
    assert ei.value.lost == ()
    assert eng.next_position(0) == n0
    eng._next[1] = n1
    assert np.array_equal(decode(eng, {0: 5, 1: 6}), want)


def test_precheck_errors_carry_their_reason(eng: LlamaCppEngine) -> None:
    prefill(eng, 0, PROMPTS[0])
    cases: list[tuple[Callable[[], Any], Reason]] = [
        (lambda: eng.step(FusedBatch.from_rows("decode", [BatchRow(0, 99, 5, True)])), Reason.POSITION_GAP),
        (lambda: eng.step(FusedBatch.from_rows("decode", [BatchRow(0, len(PROMPTS[0]), 10**6, True)])),
         Reason.BAD_TOKEN),
        (lambda: eng.step(FusedBatch.from_rows("prefill", [BatchRow(1, i, 5, False) for i in range(129)])),
         Reason.TOO_LONG),
    ]
    for call, reason in cases:
        with pytest.raises(EngineError) as ei:
            call()
        assert ei.value.reason == reason and ei.value.lost == ()
    assert eng._states.stats.calls == 1  # the prefill: the three were refused before any state was touched


# ---- snapshot cost ------------------------------------------------------------------------------------

def test_steady_state_decode_takes_no_snapshot(eng: LlamaCppEngine, layout: str) -> None:
    """Snapshots are per prefill chunk of a session that holds state, never per decoded token."""
    for s in range(3):
        prefill(eng, s, PROMPTS[s][:4])  # first chunks: nothing to snapshot
    assert eng._states.stats.taken == 0
    for s in range(3):
        prefill(eng, s, PROMPTS[s][4:], start=4)  # second chunks: one snapshot each (recurrent/hybrid)
    chunks = eng._states.stats.taken
    toks = {0: 5, 1: 6, 2: 7}
    for _ in range(20):
        toks = {s: int(np.argmax(r)) for s, r in zip(toks, decode(eng, toks), strict=True)}
    st = eng._states.stats
    assert st.taken == chunks == (0 if layout == "kv" else 3)
    assert st.bytes == chunks * eng.state_layout.dims.get("state_bytes", 0)
    assert st.calls == 6 + 20 and st.calls_snapshotted == (0 if layout == "kv" else 3)


def test_slot_reuse_starts_from_nothing(eng: LlamaCppEngine) -> None:
    """A released slot reused by another session computes exactly what a fresh slot does (the recurrent
    cell is zeroed, not inherited)."""
    first = prefill(eng, 2, PROMPTS[2])
    decode(eng, {2: int(np.argmax(first))})
    eng.release(2)
    again = prefill(eng, 2, PROMPTS[3])
    eng.release(3)
    fresh = prefill(eng, 3, PROMPTS[3])
    assert np.array_equal(again, fresh)


def test_state_cost_report(layout: str, tiny_layout_paths: dict[str, Path]) -> None:
    """dgrtools/state_cost.py (the figures of docs/state-layouts.md) on a small run: bytes as advertised,
    snapshots only where a layout needs them, none in steady-state decode."""
    from dgrtools.state_cost import measure

    r = measure(tiny_layout_paths[layout], [2], steps=3, prompt_len=8, repeats=1)
    assert r["layout"] == layout
    (b,) = r["batches"]
    assert b["sessions"] == 2 and b["snapshots_in_steady_decode"] == 0
    assert b["decode_step_ms"] > 0 and b["decode_step_ms_snapshot_always"] > 0
    if layout == "kv":
        assert r["snapshot_bytes"] == 0 and r["snapshot_us"] == 0 and b["chunk_snapshot_share"] == 0
    else:
        assert r["snapshot_bytes"] > 30_000 and r["snapshot_us"] > 0 and r["restore_us"] > 0
        assert 0 < b["chunk_snapshot_share"] < 1


# ---- several engines in one worker: the EngineSet seam -------------------------------------------------

def test_engine_set_routes_streams_to_engines(tiny_layout_paths: dict[str, Path]) -> None:
    from consumer.engines.engine_set import EngineSet

    es = EngineSet({k: make(p, n_slots=2) for k, p in tiny_layout_paths.items()})
    try:
        assert list(es) == list(LAYOUTS) and len(es.all_keys()) == 6
        for name in es:
            for ph, key in es.keys_of(name).items():
                assert es.engine_for(key.digest) == name and key.phase == ph
                assert key.state.kind == name
        assert es.engine_for("0" * 16) is None
        ad = {a["engine"]: a for a in es.advertise()}
        assert ad["recurrent"]["state_bytes_per_token"] == 0
        assert ad["hybrid"]["state_bytes_per_session"] > ad["recurrent"]["state_bytes_per_session"] > 0
        assert ad["kv"]["state_bytes_all_slots"] == 2 * ad["kv"]["state_bytes_per_session"]
    finally:
        es.close()


def test_engine_set_refuses_engines_that_would_share_streams(tiny_layout_paths: dict[str, Path]) -> None:
    from consumer.engines.engine_set import EngineSet

    a, b = make(tiny_layout_paths["recurrent"], n_slots=1), make(tiny_layout_paths["recurrent"], n_slots=2)
    try:
        with pytest.raises(ValueError, match="same prefill key"):
            EngineSet({"a": a, "b": b})  # same model, recipe, layout: one engine with more slots
        with pytest.raises(ValueError, match="not an id"):
            EngineSet({"bad name": a})
        with pytest.raises(ValueError):
            EngineSet({})
    finally:
        a.close()
        b.close()
