"""What a Tracker's fleet read costs beside workers gone for good (`python -m dgrtools.bench.fleet_read`).

`dgr:workers` keeps every worker id that ever advertised; where each pod has its own id it grows with every
rollout. On a private redis-server: `live` workers advertising and beating (their heartbeats naming their
advertisement, as `dgr consumer` writes them), and `gone` more advertised without a heartbeat; `Producer.workers()`
and `FleetView.load` of its answer timed, medians of `repeats` (docs/placement.md, "The fleet read")."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import redis

from .common import console, save, table


def fleet_read(live: int = 100, gone: tuple[int, ...] = (0, 1000, 5000), repeats: int = 15) -> list[dict[str, Any]]:
    from consumer.engines.base import engine_key
    from consumer.engines.sleep import SleepEngine
    from dgrtools.localredis import LocalRedis
    from producer import Producer
    from schemas import WorkerKeys
    from schemas.heartbeat import spec_version
    from schemas.keys import WORKERS_INDEX
    from schemas.limits import WIRE_VERSION

    key = engine_key(SleepEngine(0.0), "prefill")
    keys = [key.for_phase(p).model_dump(mode="json") for p in ("prefill", "decode")]
    out = []
    with LocalRedis(appendonly=False) as srv:
        client = redis.Redis.from_url(srv.url)

        def advertise(w: str, beats: bool) -> None:
            k = WorkerKeys(w)
            body = json.dumps({"worker_id": w, "keys": keys, "streams": [],
                               "info": {"wire_version": WIRE_VERSION, "slots": 64}}, separators=(",", ":"))
            client.set(k.spec, body)
            client.sadd(WORKERS_INDEX, w)
            if beats:
                hb = {"ts": time.time(), "ttl_s": 600, "slots": 64, "busy_slots": 3, "spec": spec_version(body)}
                client.set(k.heartbeat, json.dumps(hb), ex=600)

        for i in range(live):
            advertise(f"live-{i:05d}", True)
        made = 0
        for n in gone:
            for i in range(made, n):
                advertise(f"gone-{i:05d}", False)
            made = max(made, n)
            producer = Producer(client)
            reads, loads = [], []
            for _ in range(repeats):
                t = time.perf_counter()
                infos = producer.workers()
                reads.append(time.perf_counter() - t)
                t = time.perf_counter()
                producer.core.fleet.load(infos, time.monotonic())
                loads.append(time.perf_counter() - t)
            out.append({"live": live, "gone": n, "workers_ms": 1e3 * statistics.median(reads),
                        "load_ms": 1e3 * statistics.median(loads), "listed": len(infos)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("bench-out/fleet"))
    ap.add_argument("--live", type=int, default=100)
    ap.add_argument("--gone", default="0,1000,5000", help="Workers gone for good, comma-separated (cumulative).")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args(argv)
    rows = fleet_read(a.live, tuple(int(x) for x in a.gone.split(",")), a.repeats)
    console.print(table(f"a fleet read: {a.live} live workers beside N gone for good",
                        ["gone", "workers() ms", "FleetView.load ms", "listed"],
                        [[r["gone"], r["workers_ms"], r["load_ms"], r["listed"]] for r in rows]))
    save(a.out, "fleet-read", {"rows": rows})


if __name__ == "__main__":
    main()
