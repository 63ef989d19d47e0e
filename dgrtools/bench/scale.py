"""`dgr bench scale`: the worker's own time per fused call with 10,000 idle sessions known to it vs none.

In-process, real redis-server, an engine that does no arithmetic (tests/doubles/null.py), so what is
timed is the worker: read, admit, schedule, sample, complete, release. 8 sessions decode; the idle
ones were opened (prefilled, holding a slot) and then never sent another step, as a paused Tracker
would. The two sides alternate.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import redis

from consumer.transport import RedisTransport
from consumer.worker import Worker, WorkerSettings
from dgrtools.localredis import LocalRedis
from schemas import RouteHop, Sampling, SessionSpec, StepJob, WorkerKeys, job_to_fields, result_from_fields
from tests.doubles.null import NullEngine

from .common import console, markdown, plot, save, table

WID = "bench-scale"


def _spec(worker: Worker, sid: str) -> SessionSpec:
    return SessionSpec(session_id=sid, account_id="bench", route=(RouteHop(worker_id=WID, key=worker.keys["prefill"]),),
                       sampling=Sampling(), max_tokens=32_768)


def _open_all(client: redis.Redis, worker: Worker, sids: list[str]) -> None:
    key = worker.keys["prefill"]
    stream = WorkerKeys(WID).input_stream(key.digest, "prefill")
    pipe = client.pipeline(transaction=False)
    for sid in sids:
        job = StepJob(job_id=f"{sid}-0", session_id=sid, phase="prefill", compat=key.digest, start_position=0,
                      tokens=(1,), created_at=time.time(), session=_spec(worker, sid))
        pipe.xadd(stream, job_to_fields(job))  # type: ignore[arg-type]
    pipe.execute()


def _measure(url: str, idle: int, active: int, calls: int) -> dict[str, float]:
    client = redis.Redis.from_url(url)
    client.flushall()
    engine = NullEngine(n_slots=idle + active, ctx_per_session=4096)
    worker = Worker(engine, RedisTransport(client, WID, WID), WorkerSettings(worker_id=WID, max_batch=active,
                                                                             prefill_budget=4096, block_ms=1,
                                                                             gather_ms=0.0))
    worker.start()
    keys = WorkerKeys(WID)
    for i in range(0, idle, 1000):
        _open_all(client, worker, [f"idle-{j}" for j in range(i, min(idle, i + 1000))])
    while worker.scheduler.table.busy_slots < idle:
        worker.run_once()
    actives = [f"act-{i}" for i in range(active)]
    _open_all(client, worker, actives)
    decode = worker.keys["decode"]
    dstream = keys.input_stream(decode.digest, "decode")
    pos = {sid: 1 for sid in actives}
    last = {sid: b"0-0" for sid in actives}

    def push_next() -> None:
        pipe = client.pipeline(transaction=False)
        for sid in actives:
            for entry_id, fields in client.xrange(keys.results(sid), min=b"(" + last[sid]) or []:
                last[sid] = entry_id  # type: ignore[assignment]
                r = result_from_fields(fields)  # type: ignore[arg-type]
                job = StepJob(job_id=f"{sid}-{pos[sid]}", session_id=sid, phase="decode", compat=decode.digest,
                              start_position=pos[sid], tokens=(r.token or 0,), created_at=time.time())
                pipe.xadd(dstream, job_to_fields(job))  # type: ignore[arg-type]
                pos[sid] += 1
        pipe.execute()

    while worker.stats.calls_by_phase["decode"] == 0:
        worker.run_once()
        push_next()
    st = worker.stats
    start_calls, start_over, start_read = st.fused_calls, st.overhead_seconds, st.read_seconds
    t0 = time.perf_counter()
    while worker.stats.fused_calls - start_calls < calls:
        worker.run_once()
        push_next()
    wall = time.perf_counter() - t0
    n = worker.stats.fused_calls - start_calls
    client.flushall()
    return {"overhead_us_per_call": 1e6 * (st.overhead_seconds - start_over) / n,
            "read_us_per_call": 1e6 * (st.read_seconds - start_read) / n,
            "wall_us_per_call": 1e6 * wall / n, "sessions_table": len(worker.scheduler.table)}


def run(out_dir: Path, *, idle: int = 10_000, active: int = 8, calls: int = 300, repeats: int = 3) -> dict[str, Any]:
    results: dict[int, list[dict[str, float]]] = {0: [], idle: []}
    with LocalRedis(appendonly=False) as server:
        for r in range(repeats):
            for n in (0, idle):  # alternate
                m = _measure(server.url, n, active, calls)
                results[n].append(m)
                console.print(f"repeat {r}: idle {n}: {m['overhead_us_per_call']:.0f} us/call worker overhead")
    rows: list[dict[str, Any]] = []
    for n, ms in results.items():
        rows.append({"idle_sessions": n, "active_sessions": active,
                     "overhead_us_per_call": statistics.median(m["overhead_us_per_call"] for m in ms),
                     "read_us_per_call": statistics.median(m["read_us_per_call"] for m in ms),
                     "wall_us_per_call": statistics.median(m["wall_us_per_call"] for m in ms),
                     "runs": ms})
    base = rows[0]["overhead_us_per_call"]
    for row in rows:
        row["vs_no_idle"] = row["overhead_us_per_call"] / base if base else 0.0
    cols = ["idle sessions", "active", "worker us/call (excl. engine, read)", "read us/call",
            "loop wall us/call (incl. producer)", "vs no idle"]
    data = [[r["idle_sessions"], r["active_sessions"], r["overhead_us_per_call"], r["read_us_per_call"],
             r["wall_us_per_call"], r["vs_no_idle"]] for r in rows]
    console.print(table("per-fused-call worker overhead vs idle sessions", cols, data))
    payload = {"bench": "scale", "idle": idle, "active": active, "calls": calls, "repeats": repeats, "rows": rows,
               "markdown": markdown(cols, data)}
    save(out_dir, "scale", payload)
    plot(out_dir, "scale", "worker time per fused call", "idle sessions", "us",
         {"outside the engine": ([float(r["idle_sessions"]) for r in rows],
                                 [r["overhead_us_per_call"] for r in rows])})
    return payload
