"""Chaos on a route of three hops, real redis-server and real worker processes (reference engine, the tiny model
cut in three), every session checked against the whole model (one hop):

* kill -9 of the middle hop mid-run, a fresh process takes its worker id. Its KV dies with it: its restarted
  process answers the steps it finds (pending entries, new ones) state_lost / unknown_session, the Tracker
  replays EVERY hop of the route (attempt + 1: hop 0 and hop 2 re-open the session, dropping the attempt they
  held), and every session ends with its whole-model tokens;
* Redis restarted mid-run (every hop's keys with it): the Tracker and the three workers ride through, and
  nothing is lost or doubled on any hop.

The fault point is drawn at random (the seed is in the failure message; DGR_CHAOS_SEED=N replays one).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from consumer.ops.sessions import session_accounting
from dgrtools.process import ConsumerProcess
from producer import Producer
from schemas import CompatibilityKey, RouteHop, Sampling, SessionSpec, WorkerKeys

from .chaos_support import Drive, RestartableRedis, consumer, tiny_blocks, wait_idle_heartbeat
from .support import prompts, session_results

pytestmark = pytest.mark.timeout(240)
SEED = int(os.environ.get("DGR_CHAOS_SEED", str(time.time_ns() % 2**31)))
ROUTE = ("c0", "c1", "c2")
TOKENS = 24


@dataclass
class Hops:
    srv: RestartableRedis
    client: redis.Redis
    files: dict[str, Path]
    procs: dict[str, ConsumerProcess]
    keys: dict[str, CompatibilityKey]
    logs: Path

    def producer(self) -> Producer:
        return Producer(self.client, prefill_chunk=48, timeout_s=60, outage_max_s=60)

    def specs(self, route: tuple[str, ...], prefix: str, ps: list[list[int]]) -> list[tuple[SessionSpec, list[int]]]:
        hops = tuple(RouteHop(worker_id=w, key=self.keys[w]) for w in route)
        return [(SessionSpec(session_id=f"{prefix}-{i}", account_id="a", route=hops, max_tokens=TOKENS,
                             sampling=Sampling(temperature=0.8, top_p=0.95, seed=i) if i % 3 == 1 else Sampling()),
                 q) for i, q in enumerate(ps)]


@pytest.fixture
def hops(tmp_path: Path) -> Iterator[Hops]:
    srv = RestartableRedis(tmp_path / "redis")
    srv.start()
    src, blocks = tiny_blocks(tmp_path)
    files = dict(zip(ROUTE, blocks, strict=True))
    files["whole"] = src
    logs = tmp_path / "logs"
    client = redis.Redis.from_url(srv.url)
    procs = {w: consumer(srv.url, w, f, logs) for w, f in files.items()}
    try:
        p = Producer(client)
        yield Hops(srv, client, files, procs, {w: p.discover(w).keys[0] for w in files}, logs)
    finally:
        for proc in procs.values():
            proc.kill()
        srv.stop()


def test_kill_9_of_the_middle_hop_then_every_session_completes_exactly(hops: Hops) -> None:
    rng = random.Random(SEED)
    ps = [q if i % 2 else q[:5] for i, q in enumerate(prompts(6, 512, SEED % 1000, 40, 120))]
    whole = hops.producer().run_many(hops.specs(("whole",), "w", ps))
    kill_after = rng.randrange(8, 60)  # results of any hop seen before the kill
    drive = Drive(hops.producer(), hops.specs(ROUTE, "r", ps)).start()
    drive.wait_results(kill_after)
    early = kill_after < 30  # early kills land while every session is still running
    if early:
        # ... on hop 1 too: it has answered a step (its tally names the sessions it charges and has not closed).
        # Killed before any relay reached it, it held nothing to replay (kill_after 8: 0 replays, its tally
        # empty at the kill in 3 of 3 reruns of that seed).
        deadline = time.monotonic() + 30
        while not hops.client.hlen(WorkerKeys("c1").tally):
            assert time.monotonic() < deadline, (SEED, kill_after, "hop 1 answered nothing")
            time.sleep(0.005)
    hops.procs["c1"].kill()  # SIGKILL: the KV of every session on hop 1 is gone
    hops.procs["c1"] = consumer(hops.srv.url, "c1", hops.files["c1"], hops.logs)  # takes the worker id
    got = drive.join(180)
    replayed = 0
    for i in range(len(ps)):
        h = got[f"r-{i}"]
        assert h.status == "finished", (SEED, kill_after, i, h.status, h.reason, h.detail)
        assert h.generated == whole[f"w-{i}"].generated, (SEED, kill_after, i)
        replayed += h.attempt > 0
    for w in ROUTE:
        wait_idle_heartbeat(hops.client, w)  # no hop holds a slot of a dead attempt
    if early:
        assert replayed > 0, (SEED, kill_after)


def test_a_redis_restart_mid_route_loses_and_doubles_nothing(hops: Hops) -> None:
    """Redis shuts down and comes back on the same port and data dir mid-run (the Tracker's reads, pushes and
    relays and the three workers' completions in flight): every session ends with its whole-model tokens, every
    job is answered once on every hop, the last hop bills each prompt token and generated token once."""
    rng = random.Random(SEED)
    ps = [q if i % 2 else q[:5] for i, q in enumerate(prompts(6, 512, SEED % 1000 + 1, 40, 120))]
    whole = hops.producer().run_many(hops.specs(("whole",), "w", ps))
    at = rng.randrange(6, 80)
    producer = hops.producer()
    drive = Drive(producer, hops.specs(ROUTE, "x", ps)).start()
    drive.wait_results(at)
    hops.srv.shutdown()
    time.sleep(1.5)  # longer than redis-py's own retries: the drivers' ride-through is what is tested
    hops.srv.start()
    got = drive.join(180)
    assert producer.outages >= 1, "the Tracker never saw the outage: the test did not test it"
    for i, p in enumerate(ps):
        h = got[f"x-{i}"]
        assert h.status == "finished", (SEED, at, i, h.status, h.reason, h.detail)
        assert h.generated == whole[f"w-{i}"].generated, (SEED, at, i)
        for w in ROUTE:
            ids = [r.job_id for r in session_results(hops.client, w, h.session_id)]
            assert len(ids) == len(set(ids)), (SEED, at, i, w)
        billed = session_accounting(hops.client, ROUTE[-1], h.session_id)  # however often it was replayed
        assert (int(billed["prompt_tokens"]), int(billed["generated_tokens"])) == (len(p), TOKENS), (SEED, at, i)
    for w in ROUTE:
        wait_idle_heartbeat(hops.client, w)
