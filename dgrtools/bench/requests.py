"""`dgr bench requests`: the CPU of the Redis requests each side makes every fused call, through redis-py's client
and on a kept connection (schemas/direct.py), and of the worker's hand-over to its I/O thread (issue 32: a
fused call's fixed costs). Both ways alternated request by request in one process against a private
redis-server, so the host's drift hits both; each figure the median of the CPU (`time.process_time`: every thread
of this process, the system calls included) a request took. The replies of the two ways are checked equal.

- `ping`: PING (the floor of a round trip);
- `read ahead (16)`, `read ahead (1)`: the worker's read while the engine computes (`Transport.read_ahead`: the
  cancel stream and both input streams in one pipeline), 16 or 1 continuation jobs waiting;
- `completion script`: an EVALSHA of 20 keys and 15 arguments (`RedisIO.script`; the script returns at once);
- `tracker read`: the Tracker's lone XREAD of one result entry (producer/tracker.py `execute`);
- `tracker pushes (16)`: a loop turn's pushes, 16 XADDs outside MULTI (the same);
- `hand-over`: a job handed to the worker's I/O thread and waited for (`IOThread`), against a
  `ThreadPoolExecutor`'s submit and result (no Redis).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis

from consumer.transport import RedisTransport
from consumer.worker.io_thread import IOThread
from dgrtools.localredis import LocalRedis
from producer import commands as c
from producer.tracker import execute
from schemas import StepJob, job_to_fields
from schemas.direct import Direct

from .common import console, save, table
from .scheduler import _key

NAME = "requests"
WORKER = "bench-req"


def _alternated(rounds: int, ways: dict[str, Callable[[], Any]], before: Callable[[], None] = lambda: None
                ) -> dict[str, float]:
    """Each way's median CPU (µs) over `rounds`, the ways' order swapped every round; their replies equal."""
    took: dict[str, list[float]] = {w: [] for w in ways}
    names = list(ways)
    for r in range(rounds):
        replies = []
        for w in names if r % 2 else names[::-1]:
            before()
            t = time.process_time()
            replies.append(ways[w]())
            took[w].append(time.process_time() - t)
        if any(x != replies[0] for x in replies[1:]):
            raise AssertionError(f"the ways answered differently: {replies}")
    return {w: statistics.median(v) * 1e6 for w, v in took.items()}


def measure(rounds: int = 400) -> dict[str, dict[str, float]]:
    """Per request: {"redis-py": µs, "kept": µs} (the hand-over: {"redis-py": the pool's, "kept": the I/O
    thread's})."""
    out: dict[str, dict[str, float]] = {}
    with LocalRedis() as srv:
        client = redis.Redis.from_url(srv.url)
        direct = Direct(client)
        out["ping"] = _alternated(rounds, {"redis-py": lambda: client.ping() and b"PONG",
                                           "kept": lambda: direct(("PING",))[0]})
        t = RedisTransport(client, WORKER, WORKER)
        pre, dec = t.register([_key("prefill"), _key("decode")], {"slots": 256})
        t.read_streams({pre: 1, dec: 1}, block_ms=0, gather_ms=0)  # its own pending entries re-read: none
        kept = t.io._direct
        for n in (16, 1):
            jobs = [job_to_fields(StepJob(job_id=f"j{i}", session_id=f"s{i}", phase="decode",
                                          compat=_key("decode").digest, start_position=9, tokens=(), n=16,
                                          created_at=0.0, reply_to="t")) for i in range(n)]

            def fill(jobs: list[dict[str, str]] = jobs) -> None:
                pipe = client.pipeline(transaction=False)
                for f in jobs:
                    pipe.xadd(dec, f)  # type: ignore[arg-type]
                pipe.execute()

            def read(way: Any, n: int = n) -> Any:
                t.io._direct = way
                got, cancels, _ = t.read_ahead({dec: n, pre: 256})
                return sorted(d.fields[b"j"] for d in got), cancels

            out[f"read ahead ({n})"] = _alternated(rounds, {"redis-py": lambda: read(None), "kept": lambda: read(kept)},
                                                   fill)
        t.io.scripts["bench"] = client.register_script("return {KEYS[1], ARGV[1]}")
        keys, args = [f"{t.keys.base}:k{i}" for i in range(20)], ["x" * 40] * 12 + ['{"a":1}' * 60] * 3

        def script(way: Any) -> Any:
            t.io._direct = way
            return t.io.script("bench", keys, args)

        out["completion script"] = _alternated(rounds, {"redis-py": lambda: script(None), "kept": lambda: script(kept)})
        t.io._direct = kept
        results = f"{t.keys.base}:out:bench"
        last = client.xadd(results, {"v": "2", "r": "r" * 300, "c": "c" * 60}).decode()  # type: ignore[union-attr]
        client.xadd(results, {"v": "2", "r": "r" * 300, "c": "c" * 60})
        req = c.Read((c.XRead(streams=((results, last),), limit=64),))
        out["tracker read"] = _alternated(rounds, {"redis-py": lambda: execute(client, req),
                                                   "kept": lambda: execute(client, req, None, direct)})
        push = c.Batch(ops=[c.XAdd(f"{t.keys.base}:in:bench:{i % 4}", {"v": "2", "j": "j" * 180}, 10_000)
                            for i in range(16)])
        out["tracker pushes (16)"] = _alternated(rounds, {"redis-py": lambda: execute(client, push),
                                                          "kept": lambda: execute(client, push, None, direct)})
    pool, io = ThreadPoolExecutor(max_workers=1), IOThread("bench-io")
    try:
        out["hand-over"] = _alternated(rounds, {"redis-py": lambda: pool.submit(int).result(),
                                                "kept": lambda: io.collect(io.submit(int))})
    finally:
        pool.shutdown()
        io.close()
    return out


def run(out_dir: Path, rounds: int = 400) -> dict[str, Any]:
    got = measure(rounds)
    rows = [(name, round(v["redis-py"], 1), round(v["kept"], 1), round(v["kept"] / v["redis-py"], 2))
            for name, v in got.items()]
    console.print(table(f"CPU of a request, µs (medians of {rounds}, alternated; the hand-over: ThreadPoolExecutor "
                        "against the worker's I/O thread)", ["request", "redis-py", "kept connection", "ratio"], rows))
    payload = {"bench": NAME, "rounds": rounds, "us": got}
    save(out_dir, NAME, payload)
    return payload
