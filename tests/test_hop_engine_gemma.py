"""Gemma 3 270M as routes of hops (DGR_SLOW=1): split at 6, and at 6 and 12, the llama.cpp
"invariant" recipe, equal to the whole model bit for bit; prompts longer than Gemma's 512-token sliding
window, so a hop that lost the sliding-window pattern of its blocks would show."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.engines.llama import LlamaCppEngine
from dgrtools.split_model import split_gguf
from tests.hop_support import Session, differences, play_route

SLOTS = 8
CTX = 1024
CUTS = [(6,), (6, 12)]  # split at 6 (6+12), and at 6 and 12 (6+6+6): four hop files
pytestmark = pytest.mark.timeout(1800)  # Gemma hop files are ~207 MB each; a shared 2-core machine


def make(path: Path) -> LlamaCppEngine:
    return LlamaCppEngine(path, recipe="invariant", n_slots=SLOTS, ctx_per_session=CTX, n_threads=1)


class GemmaRoutes:
    def __init__(self, model: Path, out: Path) -> None:
        self.model, self.out = model, out
        self.engines: GemmaRoutes = {(): [make(model)]}
        self._files: dict[tuple[int, int], Path] = {}

    def __getitem__(self, cuts: tuple[int, ...]) -> list[LlamaCppEngine]:
        if cuts not in self.engines:
            bounds = (0, *cuts, 18)
            self.engines[cuts] = [make(self._file(a, b)) for a, b in pairwise(bounds)]
        return self.engines[cuts]

    def _file(self, a: int, b: int) -> Path:
        if (a, b) not in self._files:
            self._files[(a, b)] = split_gguf(self.model, self.out / f"hop-{a}-{b}.gguf", a, b).path
        return self._files[(a, b)]

    def close(self) -> None:
        for r in self.engines.values():
            for e in r:
                e.close()


@pytest.fixture(scope="module")
def gemma_routes(gemma_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GemmaRoutes]:
    r = GemmaRoutes(gemma_model_path, tmp_path_factory.mktemp("gemma-hops"))
    yield r
    r.close()


def _prompt(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(3, 20_000, n))


@pytest.mark.parametrize("cuts", CUTS, ids=["6+12", "6+6+6"])
@pytest.mark.parametrize("n_sessions", [1, 2, 4, 8])
def test_gemma_route_equals_whole_model(gemma_routes: GemmaRoutes,
                                        cuts: tuple[int, ...], n_sessions: int) -> None:
    rng = np.random.default_rng(n_sessions)
    sessions = []
    for i in range(n_sessions):
        # one long prompt past the 512-token window (in chunks), the rest short
        long = i == 0
        sessions.append(Session(f"s{i}", _prompt(rng, 560 if long else int(rng.integers(2, 40))), n_gen=4,
                                start=i % 3, chunks=(256, 200) if long else ()))
    got = play_route(gemma_routes[cuts], sessions)
    want = play_route(gemma_routes[()], sessions)
    assert differences(got, want) == []


def test_gemma_pattern_is_what_makes_it_exact(gemma_routes: GemmaRoutes,
                                              gemma_model_path: Path, tmp_path: Path) -> None:
    """The check above can fail: a route cut at block 3 is refused by split_gguf; written anyway, its
    second hop computes blocks 8 and 14 as global-attention blocks (and 5, 11, 17 as sliding-window
    ones, with the other rope base), and its logits differ from the whole model's."""
    with pytest.raises(ValueError, match="multiple of 6"):
        split_gguf(gemma_model_path, tmp_path / "bad.gguf", 3, 18)
    bad = [make(split_gguf(gemma_model_path, tmp_path / f"h{a}.gguf", a, b, allow_pattern_shift=True).path)
           for a, b in ((0, 3), (3, 18))]
    try:
        sessions = [Session("s0", _prompt(np.random.default_rng(5), 40), n_gen=2)]
        assert differences(play_route(bad, sessions), play_route(gemma_routes[()], sessions)) != []
    finally:
        for e in bad:
            e.close()


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_gemma_property_route_equals_whole(gemma_routes: GemmaRoutes,
                                           data: st.DataObject) -> None:
    cuts = data.draw(st.sampled_from(CUTS))
    n = data.draw(st.integers(1, 4))
    sessions = [Session(f"s{i}", tuple(data.draw(st.lists(st.integers(3, 20_000), min_size=1, max_size=120))),
                        n_gen=data.draw(st.integers(1, 4)), start=data.draw(st.integers(0, 4))) for i in range(n)]
    assert differences(play_route(gemma_routes[cuts], sessions), play_route(gemma_routes[()], sessions)) == []
