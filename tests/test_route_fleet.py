"""A shared block lost for good: a route of three hops placed on a fleet (producer/placement.py `place_hops`), the
middle block served by two workers, and one of them killed -9 mid-prefill and never started again. Every session
ends with its whole-model tokens (the tiny model cut in three, reference engine, real redis-server and worker
processes); those that held a hop on the lost worker moved that hop to its twin (the other hops stay), and each
prompt and generated token is billed once on the last hop, however often it was replayed."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from consumer.ops.sessions import session_accounting
from dgrtools.process import ConsumerProcess
from producer import PlacementPolicy, Producer, SessionHandle, SessionTemplate
from schemas import CompatibilityKey, RouteHop, SessionSpec, WorkerKeys

from .chaos_support import Drive, RestartableRedis, consumer, tiny_blocks, wait_idle_heartbeat
from .support import prompts

pytestmark = pytest.mark.timeout(240)
SEED = int(os.environ.get("DGR_CHAOS_SEED", str(time.time_ns() % 2**31)))
TOKENS = 16
WORKERS = {"h0": 0, "h1a": 1, "h1b": 1, "h2": 2}  # worker -> the block it serves
LOST_S = 1.5


@dataclass
class Fleet:
    srv: RestartableRedis
    client: redis.Redis
    procs: dict[str, ConsumerProcess]
    keys: list[CompatibilityKey]  # the route's key per hop
    whole: CompatibilityKey


def route_of(h: SessionHandle) -> list[str]:
    return [leg.worker_id for leg in h.legs]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    srv = RestartableRedis(tmp_path / "redis")
    srv.start()
    src, blocks = tiny_blocks(tmp_path)
    logs = tmp_path / "logs"
    client = redis.Redis.from_url(srv.url)
    procs: dict[str, ConsumerProcess] = {}
    try:
        for w, b in WORKERS.items():
            procs[w] = consumer(srv.url, w, blocks[b], logs)
        procs["whole"] = consumer(srv.url, "whole", src, logs)
        p = Producer(client)
        keys = [p.discover(w).keys[0] for w in ("h0", "h1a", "h2")]
        assert p.discover("h1b").keys[0] == keys[1]  # the twin: the same block, the same key
        yield Fleet(srv, client, procs, keys, p.discover("whole").keys[0])
    finally:
        for proc in procs.values():
            proc.kill()
        srv.stop()


def test_a_middle_block_lost_for_good_moves_to_its_twin_exactly(fleet: Fleet) -> None:
    rng = random.Random(SEED)
    ps = prompts(8, 512, SEED % 1000, 40, 120)
    alone = Producer(fleet.client, prefill_chunk=48, timeout_s=60)
    whole = alone.run_many([(SessionSpec(session_id=f"w-{i}", account_id="a", route=(
        RouteHop(worker_id="whole", key=fleet.whole),), max_tokens=TOKENS), q) for i, q in enumerate(ps)])
    producer = Producer(fleet.client, prefill_chunk=48, timeout_s=90, outage_max_s=60,
                        placement=PlacementPolicy(lost_s=LOST_S, lost_check_s=0.1))
    templates: list[Any] = [(SessionTemplate(session_id=f"r-{i}", account_id="a", keys=tuple(fleet.keys),
                                             options={"max_tokens": TOKENS}), q) for i, q in enumerate(ps)]
    drive = Drive(producer, templates).start()
    drive.wait_results(rng.randrange(4, 16))
    # mid-prefill: the lost block has answered a step it charges, and has sessions placed on it
    deadline = time.monotonic() + 30
    while not fleet.client.hlen(WorkerKeys("h1a").tally):
        assert time.monotonic() < deadline, (SEED, "h1a answered nothing")
        time.sleep(0.005)
    on_lost = {sid for sid, h in producer.core.driven.items() if "h1a" in route_of(h)}
    fleet.procs.pop("h1a").kill()  # SIGKILL, never started again: its heartbeat ages past lost_s
    got = drive.join(200)
    assert on_lost, (SEED, "no session was placed on the lost block")
    for i, p in enumerate(ps):
        h = got[f"r-{i}"]
        assert h.status == "finished", (SEED, i, h.status, h.reason, h.detail)
        assert h.generated == whole[f"w-{i}"].generated, (SEED, i)
        assert route_of(h) == ["h0", "h1b", "h2"], (SEED, i, route_of(h))  # only the lost hop moved
        billed = session_accounting(fleet.client, "h2", h.session_id)
        assert (int(billed["prompt_tokens"]), int(billed["generated_tokens"])) == (len(p), TOKENS), (SEED, i, billed)
    assert all(got[sid].attempt > 0 for sid in on_lost), [(sid, got[sid].attempt) for sid in on_lost]
    assert producer.fleet()["h1a"]["moved_out"] >= len(on_lost)
    for w in ("h0", "h1b", "h2"):
        wait_idle_heartbeat(fleet.client, w)  # no hop holds a slot of a dead attempt
