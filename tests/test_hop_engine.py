"""Route hops on the tiny model: a route cut from a model equals the whole model bit for bit.

Both engines (llama.cpp with the "invariant" recipe, and the NumPy reference) run 2- and 3-hop routes of
a 4-block tiny model (and the 2-block default one), one fused call per hop per tick, against the whole
model on the same schedule (and, in the property test, each session alone on the whole model).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.batch import BatchRow, FusedBatch
from consumer.engines import Engine, EngineError, engine_key
from consumer.engines.llama import LlamaCppEngine
from consumer.engines.reference import NumpyReferenceEngine
from dgrtools.split_model import split_route
from dgrtools.tiny_model import TINY, file_sha256, write_tiny_model
from tests.hop_support import Session, differences, play_route, run_hops

N_LAYER = 4  # a deeper tiny model, so that a route can have three hops
SLOTS = 8
CTX = 256
SOAK = os.environ.get("DGR_SOAK") == "1"


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hop-models") / "tiny4.gguf"
    write_tiny_model(path, n_layer=N_LAYER)
    return path


def make(kind: str, path: Path) -> Engine:
    if kind == "llama":
        return LlamaCppEngine(path, recipe="invariant", n_slots=SLOTS, ctx_per_session=CTX, n_threads=1)
    return NumpyReferenceEngine(path, n_slots=SLOTS, ctx_per_session=CTX)


class Routes:
    """The whole model and its routes for every cut, built once per module and engine kind."""

    def __init__(self, kind: str, model: Path, out: Path) -> None:
        self.kind, self.model, self.out = kind, model, out
        self.whole = make(kind, model)
        self._routes: dict[tuple[int, ...], list[Engine]] = {}

    def route(self, cuts: tuple[int, ...]) -> list[Engine]:
        if cuts not in self._routes:
            hops = split_route(self.model, self.out / "-".join(map(str, cuts)), cuts)
            self._routes[cuts] = [make(self.kind, h.path) for h in hops]
        return self._routes[cuts]

    def close(self) -> None:
        for eng in [self.whole, *(e for r in self._routes.values() for e in r)]:
            eng.close()


@pytest.fixture(scope="module", params=["llama", "reference"])
def routes(request: pytest.FixtureRequest, tiny4: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routes]:
    r = Routes(request.param, tiny4, tmp_path_factory.mktemp(f"routes-{request.param}"))
    yield r
    r.close()


def prompts(n: int, seed: int, long_every: int = 2) -> list[tuple[int, ...]]:
    """Short (2-9 tokens) and long (50-90) prompts, alternating."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(50, 91)) if i % long_every == 0 else int(rng.integers(2, 10))
        out.append(tuple(int(t) for t in rng.integers(3, TINY.n_vocab, length)))
    return out


# ----------------------------------------------------------------------------------- identity


def test_hop_identity_boundary_and_keys(routes: Routes, tmp_path: Path) -> None:
    src_sha = file_sha256(routes.model)
    whole = routes.whole
    assert whole.boundary.model_dump() == {"name": "tokens->logits", "version": 1, "consumes": "tokens",
                                           "produces": "logits", "first_layer": 0, "last_layer": N_LAYER}
    hops = routes.route((1, 3))
    want = [("tokens", "hidden", 0, 1), ("hidden", "hidden", 1, 3), ("hidden", "logits", 3, 4)]
    for eng, (c, p, a, b) in zip(hops, want, strict=True):
        assert eng.identity.gguf_sha256 == src_sha  # the SOURCE model, not the hop file
        assert eng.identity == whole.identity and eng.recipe == whole.recipe
        bd = eng.boundary
        assert (bd.consumes, bd.produces, bd.first_layer, bd.last_layer, bd.hidden_size, bd.dtype, bd.version) == \
            (c, p, a, b, TINY.n_embd, "f32", 1)
        assert eng.state_layout.dims["n_layer"] == b - a
        assert eng.describe()["blocks"].startswith(f"[{a}, {b})")
    digests = {engine_key(e, ph).digest for e in [whole, *hops] for ph in ("prefill", "decode")}
    assert len(digests) == 8  # no two hops (nor the whole model) share a stream
    # the same range cut again, elsewhere, is the same engine key
    again = split_route(routes.model, tmp_path, (1, 3))[1]
    eng = make(routes.kind, again.path)
    try:
        assert engine_key(eng, "decode") == engine_key(hops[1], "decode")
    finally:
        eng.close()


def test_reference_layer_range_equals_hop_file(tiny4: Path, tmp_path: Path) -> None:
    """NumpyReferenceEngine(whole, layers=(a, b)) is the same hop as the engine on the split file."""
    hop = split_route(tiny4, tmp_path, (1, 3))[1]
    a = NumpyReferenceEngine(tiny4, n_slots=2, ctx_per_session=64, layers=(1, 3))
    b = NumpyReferenceEngine(hop.path, n_slots=2, ctx_per_session=64)
    assert engine_key(a, "prefill") == engine_key(b, "prefill")
    h = np.random.default_rng(0).standard_normal((5, TINY.n_embd)).astype(np.float32)
    rows = [BatchRow(0, i, 7, True) for i in range(5)]
    assert np.array_equal(a.forward(FusedBatch.from_rows("prefill", rows, h)).rows,
                          b.forward(FusedBatch.from_rows("prefill", rows, h)).rows)
    with pytest.raises(ValueError):
        NumpyReferenceEngine(hop.path, layers=(1, 2))
    with pytest.raises(ValueError):
        NumpyReferenceEngine(tiny4, layers=(2, 2))


# --------------------------------------------------------------------- bit-exact against the whole


@pytest.mark.parametrize("cuts", [(2,), (1, 3)], ids=["2-hop", "3-hop"])
@pytest.mark.parametrize("n_sessions", [1, 2, 4, 8])
def test_route_equals_whole_model(routes: Routes, cuts: tuple[int, ...], n_sessions: int) -> None:
    """Long and short prompts, staggered joins (prefill fused with decodes), prompts in chunks and in one
    call, then decode steps: every logits row of every session equals the whole model's."""
    ps = prompts(n_sessions, seed=n_sessions * 10 + len(cuts))
    sessions = [Session(f"s{i}", p, n_gen=6, start=i % 3, chunks=(16, 2, 30) if i % 4 == 0 else ()) for i, p in
                enumerate(ps)]
    calls: list[tuple[int, str, int]] = []
    got = play_route(routes.route(cuts), sessions, on_output=lambda k, o: calls.append((k, o.kind, o.rows.shape[0])))
    want = play_route([routes.whole], sessions)
    assert differences(got, want) == []
    n_hops = len(cuts) + 1
    assert {k for k, _, _ in calls} == set(range(n_hops))
    assert all(kind == ("logits" if k == n_hops - 1 else "hidden") for k, kind, _ in calls)


def test_decode_is_one_llama_decode_per_hop(tiny4: Path, tmp_path: Path) -> None:
    """8 sessions' decode step: exactly one llama_decode on every hop (a fused call, not one per session)."""
    hops = [make("llama", h.path) for h in split_route(tiny4, tmp_path, (1, 3))]
    ps = prompts(8, seed=3)
    for s, p in enumerate(ps):
        run_hops(hops, FusedBatch.from_rows("prefill", [BatchRow(s, i, t, i == len(p) - 1) for i, t in enumerate(p)]))

    counts = [0] * len(hops)

    class Counting:
        """The engine's llama_cpp module, counting llama_decode calls."""

        def __init__(self, k: int, lib: Any) -> None:
            self.k, self.lib = k, lib

        def __getattr__(self, name: str) -> Any:
            return getattr(self.lib, name)

        def llama_decode(self, ctx: Any, batch: Any) -> int:
            counts[self.k] += 1
            return int(self.lib.llama_decode(ctx, batch))

    for k, eng in enumerate(hops):
        eng._L = Counting(k, eng._L)  # type: ignore[attr-defined]
    rows = [BatchRow(s, len(p), 5, True) for s, p in enumerate(ps)]
    out = run_hops(hops, FusedBatch.from_rows("decode", rows))
    assert out.rows.shape == (8, TINY.n_vocab)
    assert counts == [1, 1, 1]
    for eng in hops:
        eng.close()


# ------------------------------------------------------------------------------- property search

_EXAMPLES = {"llama": 60 if SOAK else 8, "reference": 30 if SOAK else 4}
_MAX_PROMPT = {"llama": 150, "reference": 150 if SOAK else 60}


@st.composite
def schedules(draw: st.DrawFn, max_prompt: int) -> tuple[tuple[int, ...], list[Session]]:
    first = draw(st.integers(1, N_LAYER - 1))
    cuts: tuple[int, ...] = (first,)
    if first < N_LAYER - 1 and draw(st.booleans()):
        cuts = (first, draw(st.integers(first + 1, N_LAYER - 1)))
    n = draw(st.integers(1, SLOTS))
    sessions = []
    for i in range(n):
        length = draw(st.one_of(st.integers(1, 8), st.integers(9, max_prompt)))
        prompt = tuple(draw(st.lists(st.integers(3, TINY.n_vocab - 1), min_size=length, max_size=length)))
        # chunks of >= 2 rows that never leave a single row behind (the invariant recipe's piece rule,
        # consumer/prefill_shape.py): the oracle is each session alone
        chunks: list[int] = []
        left = length
        while left > 3 and draw(st.booleans()):
            k = draw(st.integers(2, left - 2))
            chunks.append(k)
            left -= k
        sessions.append(Session(f"s{i}", prompt, n_gen=draw(st.integers(1, 5)), start=draw(st.integers(0, 6)),
                                chunks=tuple(chunks)))
    return cuts, sessions


@pytest.mark.parametrize("kind", ["llama", "reference"])
def test_property_route_equals_each_session_alone(kind: str, tiny4: Path,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """Search split points, session counts, prompt lengths, chunkings and arrival orders for a session
    whose tokens or logits on the route differ from the whole model running that session alone."""
    r = Routes(kind, tiny4, tmp_path_factory.mktemp(f"prop-{kind}"))

    @settings(max_examples=_EXAMPLES[kind], deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                               HealthCheck.data_too_large])
    @given(schedules(_MAX_PROMPT[kind]))
    def check(case: tuple[tuple[int, ...], list[Session]]) -> None:
        cuts, sessions = case
        got = play_route(r.route(cuts), sessions)
        for s in sessions:
            alone = play_route([r.whole], [Session(s.name, s.prompt, s.n_gen)])
            assert differences({s.name: got[s.name]}, alone) == [], (cuts, s)

    try:
        check()
    finally:
        r.close()


# ------------------------------------------------------------------------------ malformed input


def _middle_hop_with_history(routes: Routes) -> tuple[Engine, Engine]:
    hop0, hop1 = routes.route((1, 3))[:2]
    for s in range(2):
        hop0.release(s)
        hop1.release(s)
    return hop0, hop1


@pytest.mark.parametrize("bad", ["none", "narrow", "short", "float64", "nan", "inf", "list"])
def test_malformed_hidden_is_an_engine_error(routes: Routes, bad: str) -> None:
    """A hop that consumes hidden refuses wrong shapes, dtypes and non-finite values with EngineError,
    leaves every slot where it was, and then runs the good batch exactly as if nothing happened."""
    hop0, hop1 = _middle_hop_with_history(routes)
    p0, p1 = (5, 9, 11, 300), (7, 8, 400)
    rows = [BatchRow(0, i, t, True) for i, t in enumerate(p0)] + [BatchRow(1, i, t, True) for i, t in enumerate(p1)]
    batch = FusedBatch.from_rows("prefill", rows)
    good = hop0.forward(batch).rows
    h: Any = {"none": None, "narrow": good[:, :-1], "short": good[:-1], "float64": good.astype(np.float64),
              "list": good.tolist()}.get(bad, good.copy())
    if bad in ("nan", "inf"):
        h[5, 3] = np.nan if bad == "nan" else np.inf  # a row of slot 1
    with pytest.raises(EngineError) as ei:
        hop1.forward(FusedBatch.from_rows("prefill", rows, h))
    if bad in ("nan", "inf"):
        assert ei.value.slots == (1,)
    assert (hop1.next_position(0), hop1.next_position(1)) == (0, 0)  # type: ignore[attr-defined]
    after = hop1.forward(FusedBatch.from_rows("prefill", rows, good)).rows
    fresh = make(routes.kind, routes.out / "1-3" / "hop-1-3.gguf")
    try:
        assert np.array_equal(after, fresh.forward(FusedBatch.from_rows("prefill", rows, good)).rows)
    finally:
        fresh.close()


def test_first_hop_refuses_hidden_and_last_hop_needs_it(routes: Routes) -> None:
    hop0, _, hop2 = routes.route((1, 3))
    rows = [BatchRow(3, 0, 5, True), BatchRow(3, 1, 6, True)]
    h = np.zeros((2, TINY.n_embd), np.float32)
    with pytest.raises(EngineError, match="consumes tokens"):
        hop0.forward(FusedBatch.from_rows("prefill", rows, h))
    with pytest.raises(EngineError, match="carries none"):
        hop2.forward(FusedBatch.from_rows("prefill", rows))
    with pytest.raises(EngineError, match="consumes tokens"):
        routes.whole.forward(FusedBatch.from_rows("prefill", rows, h))
    # a later hop ignores the token ids (out of vocabulary here): its input is the hidden rows
    odd = [BatchRow(3, 0, 10**6, True), BatchRow(3, 1, -4, True)]
    assert hop2.forward(FusedBatch.from_rows("prefill", odd, h)).rows.shape == (2, TINY.n_vocab)
    hop2.release(3)


def test_default_two_block_model_splits_in_two(tiny_model_path: Path, tmp_path: Path) -> None:
    """The project's default tiny model (2 blocks) as a 1+1 route, both engines."""
    for kind in ("llama", "reference"):
        hops = [make(kind, h.path) for h in split_route(tiny_model_path, tmp_path / kind, (1,))]
        whole = make(kind, tiny_model_path)
        sessions = [Session(f"s{i}", p, n_gen=4, start=i) for i, p in enumerate(prompts(4, seed=7))]
        assert differences(play_route(hops, sessions), play_route([whole], sessions)) == []
        for e in [*hops, whole]:
            e.close()


def test_fast_recipe_boundary_rows_keep_their_order(tiny4: Path, tmp_path: Path) -> None:
    """The "fast" recipe lets llama.cpp cut a call into micro-batches as it likes, which would reorder
    the captured boundary rows (with consecutive slots, llama.cpp's split_equal takes the same number of
    rows from each sequence per micro-batch): a boundary hop runs whole pieces whatever the recipe.
    Unequal prompts in one call, against the whole model (flash attention off, so that only the row
    order could make a difference larger than rounding)."""
    kw: dict[str, Any] = dict(recipe="fast", flash_attention=False, n_slots=SLOTS, ctx_per_session=CTX, n_threads=1)
    hops = [LlamaCppEngine(h.path, **kw) for h in split_route(tiny4, tmp_path, (2,))]
    whole = LlamaCppEngine(tiny4, **kw)
    try:
        ps = {1: prompts(1, seed=1)[0], 2: (9, 10, 11), 3: prompts(1, seed=2)[0][:33], 6: (5, 6, 7, 8)}
        rows = [BatchRow(s, i, t, True) for s, p in ps.items() for i, t in enumerate(p)]
        rows.sort(key=lambda r: (r.position, -r.slot))  # interleaved, slots descending
        got = run_hops(hops, FusedBatch.from_rows("prefill", rows)).rows
        want = whole.forward(FusedBatch.from_rows("prefill", rows)).rows
        assert got.shape == want.shape
        assert float(np.abs(got - want).max()) < 1e-3
        assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))
    finally:
        for e in [*hops, whole]:
            e.close()


def test_boundary_schema_rules() -> None:
    """hop_boundary names what a hop consumes and produces; hidden needs a size; a whole model's
    canonical form has no hidden fields (its digest predates hops), a hop's always has both."""

    from schemas.compat import BoundarySchema, hop_boundary, whole_model_boundary

    assert hop_boundary(0, 4, 4, 128) == whole_model_boundary(4)
    assert "hidden_size" not in whole_model_boundary(4).model_dump()
    mid = hop_boundary(1, 3, 4, 128, "f16")
    assert mid.model_dump()["hidden_size"] == 128 and mid.model_dump()["dtype"] == "f16"
    assert BoundarySchema.model_validate(mid.model_dump()) == mid
    assert hop_boundary(1, 3, 4, 128) != mid  # the wire dtype is part of the key
    for a, b in [(2, 2), (3, 1), (0, 5), (-1, 2)]:
        with pytest.raises(ValueError):
            hop_boundary(a, b, 4, 128)
    base = mid.model_dump()
    for bad in ({"hidden_size": 0}, {"first_layer": 0}, {"first_layer": 3, "last_layer": 1}, {"dtype": "bf16"}):
        with pytest.raises(ValueError):
            BoundarySchema.model_validate({**base, **bad})
