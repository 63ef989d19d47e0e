"""The invariance property through the whole service path (producer, real Redis, worker, llama.cpp), with
the state layouts drawn: one worker serves one, two or all three of the tiny llama ("kv"), the tiny Mamba
("recurrent") and the tiny Jamba ("hybrid"), one engine each, and each session is drawn onto one of them.
Hypothesis draws sessions, arrivals, settings, cancellations and a worker crash (kill -9 and a fresh
worker, which answers `state_lost` and the producer replays) as in tests/test_invariance_property.py;
every session must end with the tokens it gets alone. Pinned: kill -9 mid-decode on recurrent sessions."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.engines.engine_set import EngineSet
from schemas import Sampling
from tests.invariance_harness import Conditions, Session, random_prompt, run_scenario
from tests.test_invariance_property import Engines, scenarios

pytestmark = pytest.mark.llama

SOAK = os.environ.get("DGR_SOAK") == "1"
LAYOUTS = ("kv", "recurrent", "hybrid")


@pytest.fixture(scope="module")
def client(redis_server: object) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_server.url)  # type: ignore[attr-defined]
    yield c
    c.close()


@pytest.mark.timeout(0 if SOAK else 300)
@settings(max_examples=60 if SOAK else 12, deadline=None, derandomize=not SOAK, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(layouts=st.lists(st.sampled_from(LAYOUTS), min_size=1, max_size=3, unique=True),
       scenario=scenarios(max_prompt=300), data=st.data())
def test_service_tokens_equal_solo_any_layout(by_layout: dict[str, Engines], client: redis.Redis, layouts: list[str],
                                              scenario: tuple[list[Session], Conditions], data: st.DataObject) -> None:
    """One worker, one engine per drawn layout (the engine set drawn too), each session on a drawn one."""
    ss, c = scenario
    ss = [replace(s, engine=data.draw(st.sampled_from(layouts), label=f"engine of s{i}")) for i, s in enumerate(ss)]

    def make(n_slots: int) -> EngineSet:
        return EngineSet({k: by_layout[k].make(n_slots) for k in layouts})

    out = run_scenario(client, ss, c, make, lambda s, stops: by_layout[s.engine].solo(s, stops))
    assert out.mismatches == [], f"{layouts} {[s.engine for s in ss]} {c}\n" + "\n".join(out.mismatches)


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


def test_a_step_of_one_layout_on_another_layouts_stream_is_incompatible(
        real_redis: redis.Redis, tiny_layout_paths: dict[str, Path]) -> None:
    """One worker per layout, serving sessions; a step whose key names another layout, pushed onto each
    worker's own stream, is answered `incompatible` (the layout is in the key), and the sessions around it
    get their solo tokens."""
    from consumer.engines.llama import LlamaCppEngine
    from schemas import Reason, SessionSpec, Status, StepJob, WorkerKeys, job_to_fields
    from tests.hop_driver import RouteDriver, make_hop_worker
    from tests.support import prompts, solo_generate

    paths = tiny_layout_paths
    engines = {k: LlamaCppEngine(p, n_slots=4, ctx_per_session=256, n_threads=1) for k, p in paths.items()}
    solo = {k: LlamaCppEngine(p, n_slots=1, ctx_per_session=256, n_threads=1) for k, p in paths.items()}
    try:
        drivers = {k: RouteDriver(real_redis, [make_hop_worker(real_redis, e, f"layout-{k}")])
                   for k, e in engines.items()}
        ps = prompts(2, 500, seed=5, lo=5, hi=40)
        for k, d in drivers.items():
            w = d.workers[0]
            for other in LAYOUTS:
                if other == k:
                    continue
                sid = f"x-{other}"
                job = StepJob(job_id=f"{sid}.j", session_id=sid, phase="prefill", start_position=0, tokens=(1, 5),
                              compat=drivers[other].workers[0].keys["prefill"].digest, created_at=1.0,
                              session=SessionSpec(session_id=sid, account_id="acct", route=drivers[other].route(),
                                                  max_tokens=4))
                stream = WorkerKeys(w.settings.worker_id).input_stream(w.keys["prefill"].digest, "prefill")
                real_redis.xadd(stream, job_to_fields(job))  # type: ignore[arg-type]
                d.last[(0, sid)], d.results[sid] = b"0-0", []
            for i, p in enumerate(ps):
                d.open(f"s{i}", p, max_tokens=6)
        for _ in range(300):
            if all(d.done(f"s{i}") for d in drivers.values() for i in range(len(ps))):
                break
            for d in drivers.values():
                d.workers[0].run_once()
                d.poll()
        for k, d in drivers.items():
            stray = [(r.status, r.reason) for sid, rs in d.results.items() if sid.startswith("x-") for _, r in rs]
            assert stray == [(Status.REJECTED, Reason.INCOMPATIBLE)] * 2, k
            assert not d.failures()
            for i, p in enumerate(ps):
                assert d.tokens[f"s{i}"] == solo_generate(solo[k], p, 6), (k, i)
    finally:
        for e in (*engines.values(), *solo.values()):
            e.close()
