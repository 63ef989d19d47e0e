"""Three state layouts served by one worker process at once (issue 24; docs/state-layouts.md, "Several
engines in one worker"): the tiny llama ("kv"), the tiny Mamba ("recurrent") and the tiny Jamba
("hybrid") as three engines of one worker, sessions of all three interleaved through the real producer
and a real redis-server.

* every session's tokens are its tokens alone on its engine (1/2/4/8 sessions per engine, deterministic),
  and the engines' calls interleave (one lane per engine, taken in turn);
* a step keyed for one layout, pushed on another engine's stream, is answered `incompatible`;
* kill -9 of that consumer process (`dgr consumer --model kv=... --model recurrent=... --model hybrid=...`)
  mid-decode of a recurrent session: a fresh consumer takes over, every session ends with its uncrashed
  tokens and the accounting holds exactly (tests/chaos_support.py `check_exact`).

DGR_SOAK=1 runs more sessions and kills."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from consumer.batch import EngineOutput, FusedBatch
from consumer.engines.base import Engine
from consumer.engines.engine_set import EngineSet
from consumer.engines.llama import LlamaCppEngine
from consumer.transport import RedisTransport
from consumer.worker import Worker, WorkerSettings
from dgrtools.localredis import LocalRedis
from dgrtools.process import ConsumerProcess
from dgrtools.tiny_recurrent import LAYOUTS
from producer import Producer, SessionHandle
from schemas import Reason, RouteHop, Sampling, SessionSpec, Status, StepJob, StepResult, WorkerKeys, job_to_fields
from tests.chaos_support import FAST, Drive, check_exact, wait_idle_heartbeat
from tests.invariance_harness import Conditions, Session, oracle, random_prompt, run_scenario
from tests.support import session_results
from tests.test_invariance_property import Engines

pytestmark = pytest.mark.llama

SOAK = os.environ.get("DGR_SOAK") == "1"


class Logged:
    """An engine that notes its name in `log` at every fused call (which engine ran when)."""

    def __init__(self, inner: Engine, name: str, log: list[str]) -> None:
        self.inner, self.name, self.log = inner, name, log

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def forward(self, batch: FusedBatch) -> EngineOutput:
        self.log.append(self.name)
        return self.inner.forward(batch)


_SAMPLINGS = (Sampling(), Sampling(temperature=0.8, seed=5), Sampling(temperature=0.7, top_k=40, top_p=0.9, seed=9))


def _sessions(per_engine: int, seed: int) -> list[Session]:
    """per_engine sessions on each engine, interleaved (kv, recurrent, hybrid, kv, ...), prompts 3..60
    tokens, staggered starts, one token per job or continuation jobs of 3."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(per_engine * len(LAYOUTS)):
        out.append(Session(prompt=random_prompt(rng, int(rng.integers(3, 61)), 512), sampling=_SAMPLINGS[i % 3],
                           max_tokens=int(rng.integers(6, 15)), start_s=float(rng.choice([0.0, 0.0, 0.01, 0.03])),
                           n=(1, 3)[i % 2], engine=LAYOUTS[i % len(LAYOUTS)]))
    return out


@pytest.mark.parametrize("per_engine", [1, 2, 4, 8])
def test_three_layouts_in_one_worker_give_each_session_its_solo_tokens(
        by_layout: dict[str, Engines], real_redis: redis.Redis, per_engine: int) -> None:
    log: list[str] = []

    def make(n_slots: int) -> EngineSet:
        return EngineSet({k: Logged(by_layout[k].make(n_slots), k, log) for k in LAYOUTS})  # type: ignore[misc]

    rounds = 3 if SOAK else 1
    for r in range(rounds):
        log.clear()
        ss = _sessions(per_engine, seed=100 * per_engine + r)
        c = Conditions(n_slots=per_engine, max_batch=8, prefill_budget=64, prefill_chunk=16)
        out = run_scenario(real_redis, ss, c, make, lambda s, stops: by_layout[s.engine].solo(s, stops))
        assert out.mismatches == [], "\n".join(out.mismatches)
        calls = {k: log.count(k) for k in LAYOUTS}
        switches = sum(a != b for a, b in itertools.pairwise(log))
        # Every engine ran, and their calls interleaved (not one engine's sessions after another's).
        assert min(calls.values()) > 0 and switches >= min(calls.values()), (calls, switches, log)


def test_a_step_for_one_layout_on_another_engines_stream_is_incompatible(
        by_layout: dict[str, Engines], real_redis: redis.Redis) -> None:
    """Three engines in one worker. Openings keyed for one layout, pushed on each other engine's stream,
    are answered `incompatible` (the layout is in the key, and a stream is one engine's); sessions of all
    three layouts around them get their solo tokens."""
    wid = "tri-incompat"
    engines = EngineSet({k: by_layout[k].make(4) for k in LAYOUTS})
    worker = Worker(engines, RedisTransport(real_redis, wid, consumer_name=wid),
                    WorkerSettings(worker_id=wid, block_ms=5, await_ms=2, gather_ms=1.0))
    worker.start()
    keys = {k: engines.keys_of(k) for k in LAYOUTS}
    strays = []
    for k, other in itertools.permutations(LAYOUTS, 2):
        sid = f"x-{k}-{other}"
        key = keys[other]["prefill"]
        job = StepJob(job_id=f"{sid}.j", session_id=sid, phase="prefill", start_position=0, tokens=(1, 5),
                      compat=key.digest, created_at=1.0,
                      session=SessionSpec(session_id=sid, account_id="acct", route=(RouteHop(worker_id=wid, key=key),),
                                          max_tokens=4))
        real_redis.xadd(WorkerKeys(wid).input_stream(keys[k]["prefill"].digest, "prefill"), job_to_fields(job))  # type: ignore[arg-type]
        strays.append(sid)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        ss = _sessions(2, seed=7)
        specs = [(SessionSpec(session_id=f"s{i}", account_id="acct", sampling=s.sampling, max_tokens=s.max_tokens,
                              route=(RouteHop(worker_id=wid, key=keys[s.engine]["prefill"]),)), list(s.prompt))
                 for i, s in enumerate(ss)]
        handles = Producer(real_redis, timeout_s=60).run_many(specs)
    finally:
        worker.request_stop()
        thread.join(30)
        engines.close()
    assert not thread.is_alive()
    for sid in strays:
        assert [(r.status, r.reason) for r in session_results(real_redis, wid, sid)] == [
            (Status.REJECTED, Reason.INCOMPATIBLE)], sid
    for i, s in enumerate(ss):
        h = handles[f"s{i}"]
        assert h.status == "finished" and h.generated == by_layout[s.engine].solo(s, ()), (s.engine, h.generated)


def test_kill_9_mid_decode_of_a_recurrent_session_then_a_fresh_consumer(
        redis_server: LocalRedis, real_redis: redis.Redis, tiny_layout_paths: dict[str, Path], tmp_path: Path) -> None:
    """One consumer process serving the three layouts (`--model NAME=PATH` three times) is killed -9 once
    a recurrent session is mid-decode; a fresh consumer takes the worker id over (the lease lapses), the
    steps it finds are answered `state_lost`, the producer replays them, and every session ends with its
    uncrashed tokens, its results and its accounting exact."""
    wid = "tri-kill"
    paths = tiny_layout_paths
    models = [f"{k}={paths[k]}" for k in LAYOUTS]
    extra = [*FAST, "--model", models[1], "--model", models[2], "--max-batch", "8"]
    logs = tmp_path / "logs"

    def start() -> ConsumerProcess:
        return ConsumerProcess(redis_server.url, wid, models[0], logs, slots=4, threads=1, extra=extra)

    proc = start()
    procs = [proc]
    kills = 3 if SOAK else 1
    try:
        advertised = {k.state.kind: k for k in Producer(real_redis).discover(wid).keys if k.phase == "prefill"}
        assert set(advertised) == set(LAYOUTS)
        rng = np.random.default_rng(11)
        per_engine = 4 if SOAK else 2
        specs: list[tuple[SessionSpec, list[int]]] = []
        for i in range(per_engine * len(LAYOUTS)):
            layout = LAYOUTS[i % len(LAYOUTS)]
            specs.append((SessionSpec(session_id=f"{layout}-{i}", account_id=f"acct-{i % 2}",
                                      route=(RouteHop(worker_id=wid, key=advertised[layout]),),
                                      max_tokens=24 if layout == "recurrent" else 16),
                          [int(t) for t in random_prompt(rng, 8 + 5 * i, 512)]))
        killed = threading.Event()
        victim = next(spec.session_id for spec, _ in specs if spec.session_id.startswith("recurrent"))
        kill_at = [3, 9, 15][:kills]  # the victim's tokens so far at each kill
        k = [0]

        def on_result(h: SessionHandle, r: StepResult) -> None:
            # In the producer's thread, before it pushes the session's next step: the kill lands mid-decode.
            if (k[0] < len(kill_at) and not killed.is_set() and h.session_id == victim
                    and len(h.generated) >= kill_at[k[0]]):
                procs[-1].kill()
                killed.set()

        drive = Drive(Producer(real_redis, timeout_s=60, backpressure="wait", max_attempts=5), specs,
                      on_result=on_result).start()
        for _ in range(kills):
            assert killed.wait(60), "the recurrent session never reached the kill point"
            procs.append(start())  # a standby until the dead one's lease lapses, then it takes over
            k[0] += 1
            killed.clear()
        handles = drive.join(120)
        solo = {k: LlamaCppEngine(p, n_slots=1, ctx_per_session=256, n_threads=1) for k, p in paths.items()}
        try:
            def solo_of(spec: SessionSpec, prompt: list[int]) -> list[int]:
                layout = spec.session_id.split("-")[0]
                return oracle(solo[layout], Session(prompt=tuple(prompt), sampling=spec.sampling,
                                                    max_tokens=spec.max_tokens))

            summary = check_exact(real_redis, wid, specs, handles, None, solo_of=solo_of)
        finally:
            for e in solo.values():
                e.close()
        assert handles[victim].attempt >= 1 and summary["replays"] >= 1  # it was replayed after the kill
        hb = wait_idle_heartbeat(real_redis, wid)
        assert [(e["engine"], e["busy_slots"]) for e in hb["engines"]] == [(k, 0) for k in LAYOUTS]
    finally:
        for p in procs:
            p.stop()
