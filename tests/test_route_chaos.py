"""Chaos on a route of three hops: kill -9 of the middle hop mid-run, a fresh process takes its worker id.

Real redis-server, real worker processes (reference engine, the tiny model cut in three). The middle hop's
KV dies with it: its restarted process answers the steps it finds (pending entries, new ones) state_lost /
unknown_session, the Tracker replays EVERY hop of the route (attempt + 1: hop 0 and hop 2 re-open the
session, dropping the attempt they held), and every session ends with its whole-model tokens. The kill
point is drawn at random (the seed is in the failure message; DGR_CHAOS_SEED=N replays one).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import redis

from dgrtools.split_model import split_route
from dgrtools.tiny_model import write_tiny_model
from producer import Producer
from schemas import RouteHop, Sampling, SessionSpec

from .chaos_support import Drive, RestartableRedis, consumer, wait_idle_heartbeat
from .support import prompts

pytestmark = pytest.mark.timeout(240)
SEED = int(os.environ.get("DGR_CHAOS_SEED", str(time.time_ns() % 2**31)))
ROUTE = ("c0", "c1", "c2")


@pytest.fixture
def redis_srv(tmp_path: Path) -> RestartableRedis:
    srv = RestartableRedis(tmp_path / "redis")
    srv.start()
    yield srv  # type: ignore[misc]
    srv.stop()


def test_kill_9_of_the_middle_hop_then_every_session_completes_exactly(redis_srv: RestartableRedis,
                                                                      tmp_path: Path) -> None:
    rng = random.Random(SEED)
    src = tmp_path / "tiny4.gguf"
    write_tiny_model(src, seed=0, quant="q8_0", n_layer=4)
    files = dict(zip(ROUTE, (h.path for h in split_route(src, tmp_path / "hops", (1, 3))), strict=True))
    files["whole"] = src
    logs = tmp_path / "logs"
    client = redis.Redis.from_url(redis_srv.url)
    procs = {w: consumer(redis_srv.url, w, f, logs) for w, f in files.items()}
    try:
        p = Producer(client, prefill_chunk=48, timeout_s=60, outage_max_s=60)
        keys = {w: p.discover(w).keys[0] for w in files}
        ps = [q if i % 2 else q[:5] for i, q in enumerate(prompts(6, 512, SEED % 1000, 40, 120))]
        tokens = 24

        def specs(route: tuple[str, ...], prefix: str) -> list[tuple[SessionSpec, list[int]]]:
            hops = tuple(RouteHop(worker_id=w, key=keys[w]) for w in route)
            return [(SessionSpec(session_id=f"{prefix}-{i}", account_id="a", route=hops, max_tokens=tokens,
                                 sampling=Sampling(temperature=0.8, top_p=0.95, seed=i) if i % 3 == 1 else Sampling()),
                     q) for i, q in enumerate(ps)]

        whole = p.run_many(specs(("whole",), "w"))
        kill_after = rng.randrange(8, 60)  # results of any hop seen before the kill
        drive = Drive(Producer(client, prefill_chunk=48, timeout_s=60, outage_max_s=60), specs(ROUTE, "r")).start()
        drive.wait_results(kill_after)
        procs["c1"].kill()  # SIGKILL: the KV of every session on hop 1 is gone
        procs["c1"] = consumer(redis_srv.url, "c1", files["c1"], logs)  # takes the worker id (lease expiry)
        got = drive.join(180)
        replayed = 0
        for i in range(len(ps)):
            h = got[f"r-{i}"]
            assert h.status == "finished", (SEED, kill_after, i, h.status, h.reason, h.detail)
            assert h.generated == whole[f"w-{i}"].generated, (SEED, kill_after, i)
            replayed += h.attempt > 0
        for w in ROUTE:
            wait_idle_heartbeat(client, w)  # no hop holds a slot of a dead attempt
        if kill_after < 30:  # early kills land while every session is still running
            assert replayed > 0, (SEED, kill_after)
    finally:
        for proc in procs.values():
            proc.kill()
