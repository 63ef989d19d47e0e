"""`dgr bench durable`: what WAIT-based durability (`dgr consumer --durable-replicas 1`) costs per fused
call, measured on a private master + replica on this machine (docs/failover.md, "Durable completions").

One worker (the real `RedisTransport`, lease held, so the completion script's call guard is on) with B
decode sessions loops the Redis side of a decode step: the jobs are XADDed (one pipeline), read (one
XREADGROUP), then the B answers are filed in one completion call, which is what is timed: one EVALSHA,
or with durability EVALSHA + WAIT 1 in one pipeline. The two settings alternate in blocks of calls, so a
busy neighbour on a shared machine slows both alike; reported per setting: median and p90 µs per
completion call, and per answer. No engine and no Tracker: the WAIT's cost is the replica's
acknowledgement, which this measures (a replica on another host adds the network's round trip).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from consumer.config import TransportSettings
from consumer.ops.capacity import step_path_key
from consumer.sched import Answer, Outcome
from consumer.transport import Filing, RedisTransport
from dgrtools.localredis import LocalRedis
from schemas import Status, StepJob, job_from_fields, job_to_fields

from .common import console, markdown, save, table

COLUMNS = ("sessions", "setting", "calls", "median us / call", "p90 us / call", "median us / answer",
           "WAIT adds us / call (median)", "shortfalls")


@dataclass
class DurableRun:
    sessions: int
    setting: str  # "off" or "wait 1"
    calls: int
    median_us: float
    p90_us: float
    added_us: float | None  # median of this setting minus median of "off" (None for "off")
    shortfalls: int

    def row(self) -> tuple[Any, ...]:
        return (self.sessions, self.setting, self.calls, f"{self.median_us:.0f}", f"{self.p90_us:.0f}",
                f"{self.median_us / self.sessions:.1f}", "-" if self.added_us is None else f"{self.added_us:.0f}",
                self.shortfalls)


class _Worker:
    """One transport and its B sessions, stepping decode jobs through Redis."""

    def __init__(self, client: redis.Redis, worker_id: str, sessions: int, replicas: int) -> None:
        self.t = RedisTransport(client, worker_id, consumer_name=worker_id,
                                settings=TransportSettings(durable_replicas=replicas))
        self.t.acquire_lease(wait=False)
        self.t.register([step_path_key("prefill"), step_path_key("decode")], {"slots": sessions})
        self.key = step_path_key("decode")
        self.stream = self.t.keys.input_stream(self.key.digest, "decode")
        self.sessions = [f"s{i}" for i in range(sessions)]
        self.n = 0

    def step(self) -> float:
        """One decode step of every session; the seconds its completion call took."""
        t, n = self.t, self.n
        pipe = t.client.pipeline(transaction=False)
        for sid in self.sessions:
            job = StepJob(job_id=f"{sid}-{n}", session_id=sid, phase="decode", compat=self.key.digest,
                          start_position=16 + n, tokens=(42,), created_at=time.time(), reply_to="tracker")
            pipe.xadd(self.stream, job_to_fields(job), maxlen=10_000, approximate=True)  # type: ignore[arg-type]
        pipe.execute()
        got = t.read_streams({self.stream: len(self.sessions)}, block_ms=0, gather_ms=0)
        answers = []
        for d in got:
            job = job_from_fields(d.fields)
            o = Outcome(job.job_id, job.session_id, Status.OK, None, 17 + n, token=7, engine_seconds=0.001,
                        batch_size=len(got))
            answers.append(Answer(ref=d, job=job, result=o, account_id="acct-bench", close=None))
        c0 = time.perf_counter()
        t.complete(Filing(answers))
        elapsed = time.perf_counter() - c0
        self.n += 1
        if self.n % 200 == 0:  # keep the result stream short (MAXLEN would, later)
            t.client.delete(t.keys.results("tracker"))
        return elapsed

    @property
    def shortfalls(self) -> int:
        d = self.t.publisher.durable
        return 0 if d is None else d.shortfalls


def _pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def run(out: Path, sessions: tuple[int, ...] = (8, 64), calls: int = 2000, block: int = 50,
        warmup: int = 100) -> list[DurableRun]:
    runs: list[DurableRun] = []
    with tempfile.TemporaryDirectory(prefix="dgr-durable-") as tmp:
        master = LocalRedis(data_dir=Path(tmp) / "master", appendonly=False,
                            extra_args=("--repl-diskless-sync-delay", "0")).start()
        replica = LocalRedis(data_dir=Path(tmp) / "replica", appendonly=False,
                             extra_args=("--replicaof", "127.0.0.1", str(master.port))).start()
        try:
            rc = redis.Redis.from_url(replica.url)
            deadline = time.monotonic() + 30
            while rc.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise TimeoutError("the replica did not sync")
                time.sleep(0.05)
            client = redis.Redis.from_url(master.url)
            for b in sessions:
                workers = {"off": _Worker(client, f"bench-off-{b}", b, 0),
                           "wait 1": _Worker(client, f"bench-wait-{b}", b, 1)}
                times: dict[str, list[float]] = {name: [] for name in workers}
                for w in workers.values():
                    for _ in range(warmup):
                        w.step()
                done = 0
                while done < calls:  # alternating blocks: both settings see the same machine
                    for name, w in workers.items():
                        times[name] += [w.step() for _ in range(block)]
                    done += block
                off = statistics.median(times["off"])
                for name, w in workers.items():
                    med = statistics.median(times[name])
                    runs.append(DurableRun(sessions=b, setting=name, calls=len(times[name]), median_us=1e6 * med,
                                           p90_us=1e6 * _pct(times[name], 0.9),
                                           added_us=None if name == "off" else 1e6 * (med - off),
                                           shortfalls=w.shortfalls))
            client.close()
            rc.close()
        finally:
            replica.stop()
            master.stop()
    console.print(table("dgr bench durable: one completion call, without and with WAIT 1 (local replica)", COLUMNS,
                        [r.row() for r in runs]))
    path = save(out, "durable", {"runs": [asdict(r) for r in runs], "calls": calls, "block": block})
    console.print(f"written {path}")
    print(markdown(COLUMNS, [r.row() for r in runs]))  # for docs/benchmarks.md, unwrapped
    return runs
