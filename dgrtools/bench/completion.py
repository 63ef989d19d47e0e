"""`dgr bench completion`: the Redis CPU one completion call costs per answer (row), in steady state.

A private redis-server, one worker's transport, N sessions decoding (continuation jobs, one Tracker
stream, each session's tally entry already there): each call files one token of every session, as a
fused decode call of N sessions does. Reported from Redis' own `INFO commandstats`: microseconds of
EVALSHA per call and per row, and every command the script ran, per row. This is the Redis half of
`dgr bench wire`'s figure, alone and without the process noise (the script runs inside Redis: its
time is Redis CPU). Runs alone on the machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from consumer.sched import Answer, Outcome
from consumer.transport import Filing, RedisTransport
from dgrtools.localredis import LocalRedis
from schemas import CompatibilityKey, Phase, Status, StepJob

from .common import console, markdown, save, table

COLUMNS = ("rows", "calls", "evalsha us/call", "evalsha us/row", "commands/row", "hset us/row", "hmget us/row",
           "xadd us/row")


def _key(phase: Phase) -> CompatibilityKey:
    from consumer.engines.base import engine_key
    from consumer.engines.sleep import SleepEngine

    return engine_key(SleepEngine(0.0), phase)


def measure(client: redis.Redis, rows: int, calls: int) -> dict[str, Any]:
    worker = f"bench-{rows}"
    t = RedisTransport(client, worker)
    pk, dk = _key("prefill"), _key("decode")
    t.register([pk, dk], {})
    jobs = [StepJob(job_id=f"{i:040x}", session_id=f"s-{i}", phase="decode", compat=dk.digest, start_position=10,
                    tokens=(), created_at=1.0, n=64, reply_to="tracker") for i in range(rows)]
    k = [0]

    def call() -> None:
        k[0] += 1
        off = k[0] % 64
        answers = [Answer(ref=None, job=j.replace(start_position=10 + k[0] - off) if off == 0 else j,
                          result=Outcome(f"{j.job_id}.{off}" if off else j.job_id, j.session_id, Status.OK, None,
                                         11 + k[0], token=1234, engine_seconds=0.0123, batch_size=rows),
                          account_id=f"acct-{i % 4}", close=None, final=off == 63) for i, j in enumerate(jobs)]
        t.complete(Filing(answers))

    call()  # the tally entries exist from here on: the steady state
    client.config_resetstat()
    for _ in range(calls):
        call()
    st = client.info("commandstats")
    ev = st["cmdstat_evalsha"]
    n_cmds = sum(v["calls"] for name, v in st.items() if name not in ("cmdstat_evalsha", "cmdstat_config",
                                                                        "cmdstat_info"))
    per_row = rows * calls

    def us(name: str) -> float:
        v = st.get(f"cmdstat_{name}")
        return round(v["usec"] / per_row, 3) if v else 0.0

    return {"rows": rows, "calls": calls, "evalsha us/call": round(ev["usec_per_call"], 1),
            "evalsha us/row": round(ev["usec_per_call"] / rows, 3), "commands/row": round(n_cmds / per_row, 3),
            "hset us/row": us("hset"), "hmget us/row": us("hmget"), "xadd us/row": us("xadd")}


def run(out: Path, rows: tuple[int, ...], calls: int) -> str:
    results = []
    with LocalRedis(appendonly=False) as server:
        client = redis.Redis.from_url(server.url)
        for n in rows:
            results.append(measure(client, n, calls))
    body = [[r[c] for c in COLUMNS] for r in results]
    console.print(table("dgr bench completion: Redis CPU of the completion script", COLUMNS, body))
    path = save(out, "completion", {"rows": results, "calls": calls})
    console.print(f"wrote {path}")
    return markdown(COLUMNS, body)
