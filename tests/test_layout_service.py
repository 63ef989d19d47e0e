"""The invariance property through the whole service path (producer, real Redis, worker, llama.cpp), with
the state layout drawn: the tiny llama ("kv"), the tiny Mamba ("recurrent") or the tiny Jamba ("hybrid").
Hypothesis draws sessions, arrivals, settings, cancellations and a worker crash (kill -9 and a fresh
worker, which answers `state_lost` and the producer replays) as in tests/test_invariance_property.py;
every session must end with the tokens it gets alone. Pinned: kill -9 mid-decode on recurrent sessions."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import Sampling
from tests.invariance_harness import Conditions, Session, random_prompt, run_scenario
from tests.test_invariance_property import Engines, scenarios

pytestmark = pytest.mark.llama

SOAK = os.environ.get("DGR_SOAK") == "1"
LAYOUTS = ("kv", "recurrent", "hybrid")


@pytest.fixture(scope="module")
def by_layout(tiny_layout_paths: dict[str, Path]) -> dict[str, Engines]:
    return {k: Engines(p, probe=False) for k, p in tiny_layout_paths.items()}


@pytest.fixture(scope="module")
def client(redis_server: object) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_server.url)  # type: ignore[attr-defined]
    yield c
    c.close()


@pytest.mark.timeout(0 if SOAK else 300)
@settings(max_examples=60 if SOAK else 12, deadline=None, derandomize=not SOAK, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(LAYOUTS), scenario=scenarios(max_prompt=300))
def test_service_tokens_equal_solo_any_layout(by_layout: dict[str, Engines], client: redis.Redis, layout: str,
                                              scenario: tuple[list[Session], Conditions]) -> None:
    engines = by_layout[layout]
    ss, c = scenario
    out = run_scenario(client, ss, c, engines.make, engines.solo)
    assert out.mismatches == [], f"{layout} {c}\n" + "\n".join(out.mismatches)


@pytest.mark.parametrize("layout", ["recurrent", "hybrid"])
@pytest.mark.parametrize("before_lua", [True, False])
def test_kill_mid_decode_replays_exactly(by_layout: dict[str, Engines], client: redis.Redis, layout: str,
                                         before_lua: bool) -> None:
    """The worker dies (kill -9) mid-decode with three recurrent/hybrid sessions open; a fresh worker with
    a fresh engine answers their steps `state_lost`, the producer replays prompt + generated tokens, and
    every session ends with exactly its uncrashed tokens."""
    engines = by_layout[layout]
    rng = np.random.default_rng(7)
    ss = [Session(prompt=random_prompt(rng, 20 + 9 * i, 512), sampling=Sampling(temperature=0.8, seed=i),
                  max_tokens=14) for i in range(3)]
    out = run_scenario(client, ss, Conditions(crash_at=10, crash_before_lua=before_lua, prefill_chunk=16),
                       engines.make, engines.solo)
    assert out.crashed and out.replays >= 1
    assert out.mismatches == []
