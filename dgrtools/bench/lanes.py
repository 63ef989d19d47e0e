"""`dgr bench lanes`: what serving several engines in one worker costs the worker per fused call.

In-process, real redis-server, engines that do no arithmetic (consumer/engines/sleep.py at 0 s; engines of
different vocabulary sizes are different models, so each has its own keys and streams). The same decode
load per call on one engine and on three (each call is one engine's: `sessions` per call either way):

* the worker's own time per fused decode call (outside the engine and the read's waiting: LoopStats
  `overhead_seconds`; the heartbeat and ownership sweep, every few seconds, kept out), one engine vs
  three, alternating;
* the lane choice alone (`Lanes.next_call`, which builds the call: the scheduler's `next_batch` included),
  per call.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path
from typing import Any

import redis

from consumer.engines.engine_set import EngineSet
from consumer.engines.sleep import SleepEngine
from consumer.transport import RedisTransport
from consumer.worker import Worker, WorkerSettings
from dgrtools.localredis import LocalRedis
from schemas import RouteHop, Sampling, SessionSpec, StepJob, WorkerKeys, job_to_fields, results_from_fields

from .common import console, markdown, save, table

WID = "bench-lanes"


def _measure(url: str, engines: int, sessions: int, calls: int) -> dict[str, float]:
    client = redis.Redis.from_url(url)
    client.flushall()
    es = EngineSet({f"e{k}": SleepEngine(0.0, n_slots=sessions, ctx_per_session=8192, vocab_size=256 + k)
                    for k in range(engines)})
    # The heartbeat and the ownership sweep (every few seconds; their cost grows with the streams) are kept
    # out of the timed window: what is timed is each call's own work.
    worker = Worker(es, RedisTransport(client, WID, WID),
                    WorkerSettings(worker_id=WID, max_batch=sessions, block_ms=1, gather_ms=0.0, overlap=False,
                                   heartbeat_s=3600.0, recover_every_s=3600.0))
    worker.start()
    keys = WorkerKeys(WID)
    lane_of: dict[str, Any] = {}
    pipe = client.pipeline(transaction=False)
    for lane in worker.lanes:
        key = lane.keys["prefill"]
        for i in range(sessions):
            sid = f"{lane.name}-{i}"
            lane_of[sid] = lane
            spec = SessionSpec(session_id=sid, account_id="bench", route=(RouteHop(worker_id=WID, key=key),),
                               sampling=Sampling(), max_tokens=8000)
            job = StepJob(job_id=f"{sid}-0", session_id=sid, phase="prefill", compat=key.digest, start_position=0,
                          tokens=(5,), created_at=time.time(), session=spec)
            pipe.xadd(keys.input_stream(key.digest, "prefill"), job_to_fields(job))  # type: ignore[arg-type]
    pipe.execute()
    pos = dict.fromkeys(lane_of, 1)
    last = dict.fromkeys(lane_of, b"0-0")

    def push_next() -> None:  # the Tracker's part: each answered session's next step (one job per token)
        p = client.pipeline(transaction=False)
        for sid, lane in lane_of.items():
            for entry_id, fields in client.xrange(keys.results(sid), min=b"(" + last[sid]) or []:
                last[sid] = entry_id  # type: ignore[assignment]
                r = results_from_fields(fields or {})[-1]
                dec = lane.keys["decode"]
                job = StepJob(job_id=f"{sid}-{pos[sid]}", session_id=sid, phase="decode", compat=dec.digest,
                              start_position=pos[sid], tokens=(r.token or 0,), created_at=time.time())
                p.xadd(keys.input_stream(dec.digest, "decode"), job_to_fields(job))  # type: ignore[arg-type]
                pos[sid] += 1
        p.execute()

    while worker.stats.calls_by_phase["decode"] < 3 * engines:
        worker.run_once()
        push_next()
    choice = [0.0]
    inner = worker.lanes.next_call

    @functools.wraps(inner)
    def timed() -> Any:
        t = time.perf_counter()
        try:
            return inner()
        finally:
            choice[0] += time.perf_counter() - t

    worker.lanes.next_call = timed  # type: ignore[method-assign]
    st = worker.stats
    calls0, over0, batch0 = st.fused_calls, st.overhead_seconds, st.decode_sessions
    while st.fused_calls - calls0 < calls:
        worker.run_once()
        push_next()
    n = st.fused_calls - calls0
    client.flushall()
    return {"overhead_us_per_call": 1e6 * (st.overhead_seconds - over0) / n, "next_call_us": 1e6 * choice[0] / n,
            "mean_batch": (st.decode_sessions - batch0) / n}


def run(out_dir: Path, *, sessions: int = 8, calls: int = 300, repeats: int = 5) -> dict[str, Any]:
    runs: dict[int, list[dict[str, float]]] = {1: [], 3: []}
    with LocalRedis(appendonly=False) as server:
        for r in range(repeats):
            for engines in ((1, 3) if r % 2 == 0 else (3, 1)):  # alternate, and the order too
                m = _measure(server.url, engines, sessions, calls)
                runs[engines].append(m)
                console.print(f"repeat {r}: {engines} engine(s): {m['overhead_us_per_call']:.0f} us/call worker, "
                              f"{m['next_call_us']:.1f} us/call lane choice, batch {m['mean_batch']:.1f}")
    rows = [{"engines": e, "sessions_per_call": sessions,
             "worker_us_per_call": statistics.median(m["overhead_us_per_call"] for m in ms),
             "next_call_us_per_call": statistics.median(m["next_call_us"] for m in ms),
             "mean_batch": statistics.median(m["mean_batch"] for m in ms)} for e, ms in runs.items()]
    result = {"rows": rows, "runs": {str(k): v for k, v in runs.items()}, "calls": calls, "repeats": repeats}
    save(out_dir, "lanes", result)
    cols = list(rows[0])
    values = [[row[c] for c in cols] for row in rows]
    (out_dir / "lanes.md").write_text(markdown(cols, values) + "\n")
    console.print(table("dgr bench lanes: the worker per fused decode call", cols, values))
    return result
