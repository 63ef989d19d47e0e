"""`dgr bench scale`: the worker's own time per fused decode call, by batch size and with idle sessions.

In-process, real redis-server, an engine that does no arithmetic (consumer/engines/sleep.py at 0 s), so what is
timed is the worker: read, admit, schedule, sample, complete, release.

1. Per session (issue 15's goal, <= 20 us per session at 64, 128 and 256 sessions): B sessions decode,
   nothing else is open; the worker's time per call (outside the engine and the read's waiting) / B,
   overlap off and on alternating; the intercept of a line through (B, time) is the work per call that
   does not depend on the batch. With `--profile`, one more run per B times every stage of the loop
   (wrappers on the worker's own objects) and Redis's own CPU per command (INFO commandstats).
2. Idle: 8 sessions decode, with 10,000 idle ones known to the worker (opened, holding a slot, never
   sending another step, as a paused Tracker) vs none. The two sides alternate.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis

from consumer.engines.sleep import SleepEngine
from consumer.transport import RedisTransport
from consumer.worker import Worker, WorkerSettings
from dgrtools.localredis import LocalRedis
from schemas import RouteHop, Sampling, SessionSpec, StepJob, WorkerKeys, job_to_fields, results_from_fields

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


# What --profile times: (object attribute of the worker, method names). Wrappers sit on the instances.
PROFILED: dict[str, tuple[str, ...]] = {
    "transport": ("complete", "cancellations", "checks", "inbound", "read_streams"),
    "scheduler": ("admit", "next_batch", "update_from_output", "want", "cancel"),
    "admission": ("read_and_admit", "admit_all", "admit"),
    "ledger": ("completions", "duplicate", "steps_to_check"),
    "worker": ("_housekeeping", "_release_slots", "_uncarried", "_publish"),
}


def _profile(worker: Worker, acc: defaultdict[str, float]) -> None:
    """Time every PROFILED method (and the sampler stage) of this worker into `acc` (seconds)."""
    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t
        return inner

    for owner, names in PROFILED.items():
        obj: Any = worker if owner == "worker" else getattr(worker, owner)
        for name in names:
            setattr(obj, name, timed(f"{owner}.{name}", getattr(obj, name)))
    for lane in worker.lanes:
        lane.sampler.sample = timed("sampler", lane.sampler.sample)  # type: ignore[method-assign]


def _measure(url: str, idle: int, active: int, calls: int, *, overlap: bool = False,
             profile: bool = False) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    client.flushall()
    engine = SleepEngine(0.0, n_slots=idle + active, ctx_per_session=4096)  # sleep 0: no arithmetic
    worker = Worker(engine, RedisTransport(client, WID, WID), WorkerSettings(worker_id=WID, max_batch=active,
                                                                             prefill_budget=4096, block_ms=1,
                                                                             gather_ms=0.0, overlap=overlap))
    acc: defaultdict[str, float] = defaultdict(float)
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
                r = results_from_fields(fields or {})[-1]
                job = StepJob(job_id=f"{sid}-{pos[sid]}", session_id=sid, phase="decode", compat=decode.digest,
                              start_position=pos[sid], tokens=(r.token or 0,), created_at=time.time())
                pipe.xadd(dstream, job_to_fields(job))  # type: ignore[arg-type]
                pos[sid] += 1
        pipe.execute()

    flush = not overlap
    while worker.stats.calls_by_phase["decode"] < 3:
        worker.run_once(flush=flush)
        push_next()
    if profile:
        _profile(worker, acc)
        client.config_resetstat()
    st = worker.stats
    start_calls, start_over, start_read = st.fused_calls, st.overhead_seconds, st.read_seconds
    start_sessions = st.decode_sessions
    t0 = time.perf_counter()
    while worker.stats.fused_calls - start_calls < calls:
        worker.run_once(flush=flush)
        push_next()
    wall = time.perf_counter() - t0
    worker.flush()
    n = worker.stats.fused_calls - start_calls
    out: dict[str, Any] = {"overhead_us_per_call": 1e6 * (st.overhead_seconds - start_over) / n,
                           "read_us_per_call": 1e6 * (st.read_seconds - start_read) / n,
                           "wall_us_per_call": 1e6 * wall / n, "sessions_table": len(worker.scheduler.table),
                           "mean_batch": (st.decode_sessions - start_sessions) / n}
    if profile:
        per = n * max(1, active)
        out["stages_us_per_session"] = {k: 1e6 * v / per for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}
        out["redis_us_per_session"] = {k.removeprefix("cmdstat_"): v["usec"] / per
                                       for k, v in client.info("commandstats").items() if v["usec"] / per >= 0.05}
    client.flushall()
    return out


def per_session(server_url: str, sizes: tuple[int, ...], calls: int, repeats: int,
                profile: bool) -> dict[str, Any]:
    """Issue 15's measure: worker us per session per fused decode call at each batch size, overlap off/on."""
    runs: dict[tuple[int, bool], list[dict[str, Any]]] = {(b, o): [] for b in sizes for o in (False, True)}
    for r in range(repeats):
        for b in sizes:
            for o in ((False, True) if r % 2 == 0 else (True, False)):  # alternate, and the order too
                m = _measure(server_url, 0, b, calls, overlap=o)
                runs[(b, o)].append(m)
                console.print(f"repeat {r}: {b} sessions, overlap {'on' if o else 'off'}: "
                              f"{m['overhead_us_per_call'] / b:.1f} us/session, "
                              f"wall {m['wall_us_per_call']:.0f} us/call")
    rows: list[dict[str, Any]] = []
    for b in sizes:
        row: dict[str, Any] = {"sessions": b}
        for o, tag in ((False, "off"), (True, "on")):
            ms = runs[(b, o)]
            over = statistics.median(m["overhead_us_per_call"] for m in ms)
            row[f"us_per_session_{tag}"] = over / b
            row[f"us_per_call_{tag}"] = over
            row[f"wall_us_per_call_{tag}"] = statistics.median(m["wall_us_per_call"] for m in ms)
            row[f"mean_batch_{tag}"] = statistics.median(m["mean_batch"] for m in ms)
        row["goal_us_per_session"] = 20.0
        rows.append(row)
    fits = {}
    for tag in ("off", "on"):
        xs = np.array([r["sessions"] for r in rows], float)
        ys = np.array([r[f"us_per_call_{tag}"] for r in rows], float)
        slope, intercept = np.polyfit(xs, ys, 1) if len(rows) > 1 else (ys[0] / xs[0], 0.0)
        fits[tag] = {"us_per_session": float(slope), "us_per_call_fixed": float(intercept)}
    profiles = {}
    if profile:
        for b in sizes:
            m = _measure(server_url, 0, b, calls, overlap=False, profile=True)
            profiles[b] = {"stages_us_per_session": m["stages_us_per_session"],
                           "redis_us_per_session": m["redis_us_per_session"]}
            top = ", ".join(f"{k} {v:.1f}" for k, v in list(m["stages_us_per_session"].items())[:8])
            console.print(f"profile at {b} sessions (us/session/call): {top}")
    return {"rows": rows, "fit": fits, "profiles": profiles}


def run(out_dir: Path, *, idle: int = 10_000, active: int = 8, calls: int = 300, repeats: int = 3,
        sessions: tuple[int, ...] = (64, 128, 256), session_calls: int = 100, profile: bool = False) -> dict[str, Any]:
    results: dict[int, list[dict[str, float]]] = {0: [], idle: []}
    with LocalRedis(appendonly=False) as server:
        per = per_session(server.url, sessions, session_calls, max(1, min(repeats, 2)), profile) if sessions else None
        for r in range(repeats if idle else 0):
            for n in (0, idle):  # alternate
                m = _measure(server.url, n, active, calls)
                results[n].append(m)
                console.print(f"repeat {r}: idle {n}: {m['overhead_us_per_call']:.0f} us/call worker overhead")
    rows: list[dict[str, Any]] = []
    for n, ms in results.items():
        if not ms:
            continue
        rows.append({"idle_sessions": n, "active_sessions": active,
                     "overhead_us_per_call": statistics.median(m["overhead_us_per_call"] for m in ms),
                     "read_us_per_call": statistics.median(m["read_us_per_call"] for m in ms),
                     "wall_us_per_call": statistics.median(m["wall_us_per_call"] for m in ms),
                     "runs": ms})
    base = rows[0]["overhead_us_per_call"] if rows else 0.0
    for row in rows:
        row["vs_no_idle"] = row["overhead_us_per_call"] / base if base else 0.0
    cols = ["idle sessions", "active", "worker us/call (excl. engine, read)", "read us/call",
            "loop wall us/call (incl. producer)", "vs no idle"]
    data = [[r["idle_sessions"], r["active_sessions"], r["overhead_us_per_call"], r["read_us_per_call"],
             r["wall_us_per_call"], r["vs_no_idle"]] for r in rows]
    md = markdown(cols, data) if rows else ""
    if rows:
        console.print(table("per-fused-call worker overhead vs idle sessions", cols, data))
    payload: dict[str, Any] = {"bench": "scale", "idle": idle, "active": active, "calls": calls, "repeats": repeats,
                               "rows": rows}
    if per is not None:
        pcols = ["sessions", "worker us/session (overlap off)", "(overlap on)", "goal", "worker us/call off",
                 "on", "loop wall us/call off", "on"]
        pdata = [[r["sessions"], r["us_per_session_off"], r["us_per_session_on"], r["goal_us_per_session"],
                  r["us_per_call_off"], r["us_per_call_on"], r["wall_us_per_call_off"], r["wall_us_per_call_on"]]
                 for r in per["rows"]]
        console.print(table("worker time per session per fused decode call (no-arithmetic engine)", pcols, pdata))
        fit = per["fit"]
        md = "\n\n".join(x for x in (
            "Worker time per session per fused decode call (no-arithmetic engine, nothing else open; goal <= 20 us "
            "per session, and < 1000 us per call independent of the batch):\n\n" + markdown(pcols, pdata) +
            f"\n\nLine fit over the batch sizes: overlap off {fit['off']['us_per_session']:.1f} us per session + "
            f"{fit['off']['us_per_call_fixed']:.0f} us per call; overlap on {fit['on']['us_per_session']:.1f} + "
            f"{fit['on']['us_per_call_fixed']:.0f}.", _profile_markdown(per["profiles"]),
            ("With 10,000 idle sessions (8 decoding):\n\n" + md) if md else "") if x)
        payload["per_session"] = per
    payload["markdown"] = md
    save(out_dir, "scale", payload)
    if rows:
        plot(out_dir, "scale", "worker time per fused call", "idle sessions", "us",
             {"outside the engine": ([float(r["idle_sessions"]) for r in rows],
                                     [r["overhead_us_per_call"] for r in rows])})
    return payload


def _profile_markdown(profiles: dict[int, dict[str, dict[str, float]]]) -> str:
    """Stages (us per session per call, overlap off, wrappers included) and Redis's own CPU per command."""
    if not profiles:
        return ""
    sizes = sorted(profiles)
    stages = list(dict.fromkeys(k for b in sizes for k in profiles[b]["stages_us_per_session"]))
    cmds = list(dict.fromkeys(k for b in sizes for k in profiles[b]["redis_us_per_session"]))
    cols = ["stage (nested: worker._read_and_admit holds transport.inbound...)", *(f"{b} sessions" for b in sizes)]
    data = [[k, *(profiles[b]["stages_us_per_session"].get(k, 0.0) for b in sizes)] for k in stages]
    data += [[f"redis CPU: {k}", *(profiles[b]["redis_us_per_session"].get(k, 0.0) for b in sizes)] for k in cmds]
    return "Where the time goes (us per session per fused call, `--profile`):\n\n" + markdown(cols, data)
