"""`dgr bench wire`: the CPU one generated token costs across the whole wire, per process, measured from
outside (issue 21): the Tracker (the public `Producer.run_many`, or `AsyncProducer.run_many` with
`--async`), Redis and the worker.

Per (sessions, step) pair: a private redis-server (no persistence: the wire's own cost, not the disk's),
one `dgr consumer --engine sleep:<step>` process (its fused call sleeps `step` with the GIL released, as a
GPU step would, and computes nothing) and the Tracker in this process, with the producer's default
continuation jobs. Counted over the run: the CPU time of each process (/proc for the worker, Redis' own
`INFO cpu`, `getrusage` for this process), divided by the tokens generated; wall tokens/s against the
engine-bound rate (sessions / step). Also reported: Redis round trips the Tracker's reads cost per fused
call of the worker, from the server's command counters (XREAD calls / the worker's fused calls).

Runs alone on the machine, or its figures mean nothing: every process here shares the same cores.
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from dgrtools.localredis import free_port
from schemas import RouteHop, Sampling, SessionSpec, WorkerKeys

from .common import console, markdown, save, table

TICK = os.sysconf("SC_CLK_TCK")
COLUMNS = ("tracker", "sessions", "step ms", "tokens", "wall s", "tok/s", "e2e / engine-bound", "worker us/tok",
           "redis us/tok", "tracker us/tok", "tracker reads / call", "redis cmds / tok")


@dataclass
class WireRun:
    tracker: str  # "sync" or "async"
    sessions: int
    step_ms: float
    tokens: int
    wall_s: float
    tok_s: float
    ratio: float | None  # e2e / engine-bound (None: step 0)
    worker_us: float
    redis_us: float
    tracker_us: float
    reads_per_call: float  # the Tracker's XREAD (and XRANGE) commands per fused call of the worker
    redis_cmds_per_token: float  # every command Redis ran (scripts' inner calls included), per token

    def row(self) -> tuple[Any, ...]:
        return (self.tracker, self.sessions, self.step_ms, self.tokens, round(self.wall_s, 2), round(self.tok_s),
                "n/a" if self.ratio is None else round(self.ratio, 3), round(self.worker_us, 1),
                round(self.redis_us, 1), round(self.tracker_us, 1), round(self.reads_per_call, 2),
                round(self.redis_cmds_per_token, 2))


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / TICK  # utime + stime


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _redis_cpu(c: redis.Redis) -> float:
    i: Any = c.info("cpu")
    return float(i["used_cpu_sys"]) + float(i["used_cpu_user"])


def _stats(c: redis.Redis) -> dict[str, int]:
    s: Any = c.info("commandstats")
    return {k[len("cmdstat_"):]: int(v["calls"]) for k, v in s.items()}


def _specs(key: Any, wid: str, sessions: int, tokens: int) -> list[tuple[SessionSpec, list[int]]]:
    return [(SessionSpec(session_id=f"s{i}", account_id=f"a{i % 4}", max_tokens=tokens,
                         route=(RouteHop(worker_id=wid, key=key),), sampling=Sampling()), [1 + i % 7, 2, 3, 4])
            for i in range(sessions)]


def run_one(sessions: int, step_ms: float, tokens: int, *, use_async: bool, extra: list[str]) -> WireRun:
    from producer import Producer

    port = free_port()
    tmp = tempfile.mkdtemp(prefix="dgr-wire-")
    rs = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                           "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    c = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            c.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    wid = f"wire{port}"
    log = open(os.path.join(tmp, "consumer.log"), "w")  # noqa: SIM115 - closed in finally
    cons = subprocess.Popen([sys.executable, "-m", "consumer", "consumer", "--redis-url", url, "--worker-id", wid,
                             "--engine", f"sleep:{step_ms}ms", "--slots", str(sessions), "--max-batch",
                             str(sessions), "--log-level", "WARNING", *extra], stdout=log, stderr=subprocess.STDOUT)
    try:
        p = Producer(c, timeout_s=120)
        deadline = time.monotonic() + 60
        while True:
            if cons.poll() is not None:
                raise RuntimeError(f"consumer exited {cons.returncode}: {Path(log.name).read_text()[-2000:]}")
            try:
                key = p.discover(wid).keys[0]
                break
            except LookupError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        specs = _specs(key, wid, sessions, tokens)
        s0, w0, r0, t0_cpu, t0 = _stats(c), _proc_cpu(cons.pid), _redis_cpu(c), _self_cpu(), time.perf_counter()
        if use_async:
            import redis.asyncio as aredis

            from producer.aio import AsyncProducer

            async def go() -> dict[str, Any]:
                ac = aredis.Redis.from_url(url)
                try:
                    return dict(await AsyncProducer(ac, timeout_s=120).run_many(specs))
                finally:
                    await ac.aclose()

            handles: dict[str, Any] = asyncio.run(go())
        else:
            handles = dict(Producer(c, timeout_s=120).run_many(specs))
        t1, w1, r1, t1_cpu = time.perf_counter(), _proc_cpu(cons.pid), _redis_cpu(c), _self_cpu()
        s1 = _stats(c)
        gen = sum(len(h.generated) for h in handles.values())
        calls = int(c.hget(WorkerKeys(wid).worker_account, "fused_calls") or 0)
        wall = t1 - t0
        reads = sum(s1.get(k, 0) - s0.get(k, 0) for k in ("xread", "xrange"))
        cmds = sum(s1.values()) - sum(s0.values())
        return WireRun(tracker="async" if use_async else "sync", sessions=sessions, step_ms=step_ms, tokens=gen,
                       wall_s=wall, tok_s=gen / wall, ratio=(gen / wall) / (sessions / (step_ms / 1e3)) if step_ms
                       else None, worker_us=(w1 - w0) / gen * 1e6, redis_us=(r1 - r0) / gen * 1e6,
                       tracker_us=(t1_cpu - t0_cpu) / gen * 1e6, reads_per_call=reads / max(1, calls),
                       redis_cmds_per_token=cmds / gen)
    finally:
        cons.terminate()
        try:
            cons.wait(15)
        except subprocess.TimeoutExpired:
            cons.kill()
        log.close()
        c.close()
        rs.terminate()
        rs.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def run(out: Path, sessions: tuple[int, ...] = (8, 64, 256), steps_ms: tuple[float, ...] = (0.0, 2.0, 10.0),
        tokens: int = 128, trackers: tuple[str, ...] = ("sync", "async"), extra: tuple[str, ...] = ()) -> list[WireRun]:
    runs: list[WireRun] = []
    for tracker in trackers:
        for s in sessions:
            for st in steps_ms:
                r = run_one(s, st, tokens, use_async=tracker == "async", extra=list(extra))
                console.print(table("", COLUMNS, [r.row()]))
                runs.append(r)
    console.print(table("dgr bench wire: CPU per generated token, per process", COLUMNS, [r.row() for r in runs]))
    path = save(out, "wire", {"runs": [asdict(r) for r in runs], "tokens": tokens})
    console.print(f"written {path}")
    return runs


def report_section(payload: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of one `dgr bench wire` run."""
    runs = [WireRun(**r) for r in payload["runs"]]
    return markdown(COLUMNS, [r.row() for r in runs])
