"""`dgr ops capacity`: what one Redis sustains on the step path, measured.

Each client process plays one worker (`captest-<run>-<i>`) with B sessions and loops the Redis side
of a decode step cycle, with the real transport and completion script:

1. the producer side XADDs B step jobs (one pipeline), each naming the Tracker's result stream,
2. the worker reads them (`RedisTransport.read`: one XREADGROUP COUNT B),
3. the worker completes them (`RedisTransport.complete`: ONE EVALSHA of consumer/lua/complete.lua:
   one XACK, the sessions' tally read and written once, ONE result record XADDed for the B answers,
   account and worker counters),
4. the producer side XREADs its one result stream (one XREAD).

No engine and no blocking: this is the Redis cost per session-step. Reported: session-steps/s over
all clients, and from the server's own accounting (INFO cpu, INFO commandstats) the Redis CPU per
session-step, hence the ceiling of one Redis core (1 / CPU per step) — the number that says when a
fleet needs more Redis nodes. Clients and server share the machine's cores, so the client rate is a
floor; the per-step CPU is the figure to plan with. Keys are removed afterwards.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import redis

from schemas.keys import WORKERS_INDEX

from .common import r, s


@dataclass
class CapacityResult:
    clients: int
    batch: int
    seconds: float
    steps: int
    cycles: int
    steps_per_s: float
    cycle_ms_median: float
    redis_cpu_s: float
    redis_cpu_us_per_step: float
    one_core_steps_per_s: float
    evalsha_us_per_call: float
    evalsha_us_per_step: float
    redis_version: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_path_key(phase: str) -> Any:
    """The compatibility key of the made-up model a step-path measurement registers (a CompatibilityKey)."""
    from schemas import CompatibilityKey, EngineIdentity, Recipe, StateLayout, whole_model_boundary

    return CompatibilityKey(
        engine=EngineIdentity(architecture="llama", gguf_sha256="ef" * 32),
        recipe=Recipe(quantization="Q8_0", kv_cache_type="f16", ctx_per_session=4096, flash_attention=False,
                      batch_invariant=True, runtime="capacity-test/1"),
        phase=phase, boundary=whole_model_boundary(2),  # type: ignore[arg-type]
        state=StateLayout(kind="kv", dims={"n_layer": 2}))


def _client_loop(url: str, worker_id: str, batch: int, seconds: float, out: Any) -> None:
    from consumer.sched import Answer, Outcome
    from consumer.transport import Filing, RedisTransport
    from schemas import Status, StepJob, job_from_fields, job_to_fields

    key = step_path_key
    client = redis.Redis.from_url(url)
    t = RedisTransport(client, worker_id, consumer_name=worker_id)
    t.register([key("prefill"), key("decode")], {"slots": batch})
    decode_key = key("decode")
    stream = t.keys.input_stream(decode_key.digest, "decode")
    sessions = [f"s{i}" for i in range(batch)]
    tracker = "tracker"
    results = {t.keys.results(tracker): "$"}
    cycles: list[float] = []
    steps = 0
    n = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        c0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for sid in sessions:
            job = StepJob(job_id=f"{sid}-{n}", session_id=sid, phase="decode", compat=decode_key.digest,
                          start_position=16 + n, tokens=(42,), created_at=time.time(), reply_to=tracker)
            pipe.xadd(stream, job_to_fields(job), maxlen=10_000, approximate=True)  # type: ignore[arg-type]
        pipe.execute()
        got = t.read_streams({stream: batch}, block_ms=0, gather_ms=0)
        answers = []
        for d in got:
            job = job_from_fields(d.fields)
            o = Outcome(job.job_id, job.session_id, Status.OK, None, 17 + n, token=7, engine_seconds=0.01,
                        batch_size=len(got))
            answers.append(Answer(ref=d, job=job, result=o, account_id=f"acct-{hash(job.session_id) % 4}", close=None))
        t.complete(Filing(answers))
        resp: Any = client.xread(results, count=batch)  # type: ignore[arg-type]
        for name, entries in resp or []:
            results[s(name)] = s(entries[-1][0])
        cycles.append(time.perf_counter() - c0)
        steps += len(answers)
        n += 1
    out.put((steps, cycles))
    client.close()


def _redis_cpu(client: redis.Redis) -> float:
    info: dict[str, Any] = r(client.info("cpu"))
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _evalsha(client: redis.Redis) -> tuple[int, int]:
    stats: dict[str, Any] = r(client.info("commandstats"))
    e = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    return int(e["calls"]), int(e["usec"])


def _cleanup(client: redis.Redis, prefix: str) -> None:
    for k in client.scan_iter(match=f"dgr:{{{prefix}*", count=1000):
        client.delete(k)
    for w in list(r(client.smembers(WORKERS_INDEX))):
        if s(w).startswith(prefix):
            client.srem(WORKERS_INDEX, w)


def measure(url: str, *, clients: int = 4, batch: int = 8, seconds: float = 10.0) -> CapacityResult:
    """Run `clients` processes for `seconds` against the Redis at `url` (not a Cluster)."""
    admin = redis.Redis.from_url(url)
    prefix = f"captest-{os.getpid()}-"
    ctx = mp.get_context("fork")
    q: Any = ctx.Queue()
    procs = [ctx.Process(target=_client_loop, args=(url, f"{prefix}{i}", batch, seconds, q)) for i in range(clients)]
    cpu0, (calls0, usec0) = _redis_cpu(admin), _evalsha(admin)
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    rows = [q.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    wall = time.perf_counter() - t0
    cpu1, (calls1, usec1) = _redis_cpu(admin), _evalsha(admin)
    version = str(r(admin.info("server")).get("redis_version", "?"))
    _cleanup(admin, prefix)
    admin.close()
    steps = sum(row[0] for row in rows)
    cycles = sorted(c for row in rows for c in row[1])
    cpu = cpu1 - cpu0
    per_step = cpu / steps if steps else 0.0
    ecalls, eusec = calls1 - calls0, usec1 - usec0
    return CapacityResult(
        clients=clients, batch=batch, seconds=round(wall, 2), steps=steps, cycles=len(cycles),
        steps_per_s=round(steps / seconds, 1),
        cycle_ms_median=round(1000 * cycles[len(cycles) // 2], 3) if cycles else 0.0,
        redis_cpu_s=round(cpu, 3), redis_cpu_us_per_step=round(1e6 * per_step, 2),
        one_core_steps_per_s=round(1 / per_step) if per_step else 0.0,
        evalsha_us_per_call=round(eusec / ecalls, 1) if ecalls else 0.0,
        evalsha_us_per_step=round(eusec / steps, 2) if steps else 0.0, redis_version=version)
