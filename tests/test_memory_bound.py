"""Hostile entries leave no lasting trace in Redis: key count and used_memory return to a bound.

A real redis-server (expiry and memory are Redis's own). N hostile entries are pipelined into the
worker's streams: made-up sessions with malformed entries (answered: a result stream and a result
record each, living `reject_ttl_s`), openings refused before the session exists, entries naming
nothing, cancellations that are not. The worker answers or dead-letters them all; once the reject
ttl has passed and the streams were trimmed, the keys are back to what an idle worker holds and
used_memory is back within the dead-letter stream's cap of the baseline. N is 5,000 by default,
100,000 with DGR_SOAK=1.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from consumer.engines.reference import NumpyReferenceEngine
from consumer.transport import TransportSettings
from schemas import RouteHop, SessionSpec, StepJob, WorkerKeys, job_to_fields

from .hostile_support import WID, Honest, make_worker

N = 100_000 if os.environ.get("DGR_SOAK") else 5_000
DLQ_MAXLEN = 1_000
CANCEL_MAXLEN = 1_000


@pytest.fixture
def engine(tiny_model_path: Path) -> Iterator[NumpyReferenceEngine]:
    eng = NumpyReferenceEngine(tiny_model_path, n_slots=4, ctx_per_session=256)
    yield eng
    eng.close()


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def test_hostile_entries_leave_keys_and_memory_bounded(real_redis: redis.Redis,
                                                       engine: NumpyReferenceEngine) -> None:
    client = real_redis
    worker = make_worker(client, engine, heartbeat_s=0.0,
                         transport_settings=TransportSettings(reject_ttl_s=1, dlq_maxlen=DLQ_MAXLEN,
                                                              cancel_maxlen=CANCEL_MAXLEN))
    h = Honest(client, worker)
    h.open("honest-0", [1, 2, 3], 4)
    h.run(["honest-0"])
    for _ in range(3):
        worker.run_once()
    keys_before = set(client.keys("*"))
    mem_before = used_memory(client)

    keys = WorkerKeys(WID)
    pre = keys.input_stream(worker.keys["prefill"].digest, "prefill")
    dec = keys.input_stream(worker.keys["decode"].digest, "decode")
    route = (RouteHop(worker_id=WID, key=worker.keys["prefill"]),)
    big = SessionSpec(session_id="x", account_id="mallory", route=route)
    refused_open = job_to_fields(StepJob(job_id="o", session_id="x", phase="prefill", compat="0" * 16,
                                         start_position=0, tokens=(1,), created_at=1.0, session=big))
    pipe = client.pipeline(transaction=False)
    for i in range(N):
        kind = i % 4
        if kind == 0:  # malformed, naming a new session: answered
            pipe.xadd(dec, {"v": "1", "session_id": f"m-{i}", "job_id": f"j-{i}", "pos": " 1"})
        elif kind == 1:  # a well-formed opening for the wrong key, under a new session and account
            body = json.loads(refused_open["j"])
            body.update(session_id=f"o-{i}", job_id=f"oj-{i}")
            body["session"].update(session_id=f"o-{i}", account_id=f"acct-{i}")
            pipe.xadd(pre, {**refused_open, "j": json.dumps(body)})
        elif kind == 2:  # nothing nameable: dead-lettered only
            pipe.xadd(dec, {b"\xff": b"\xfe" * 50})
        else:
            pipe.xadd(keys.cancellations, {"session_id": f"bad {i}"})
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()
    peak_keys = client.dbsize()
    t0 = time.monotonic()
    for _ in range(N):  # drain: each iteration reads past up to max_read_entries refused entries
        worker.run_once()
        if all(client.xinfo_groups(s)[0]["lag"] == 0 for s in (pre, dec)):
            break
    drain_s = time.monotonic() - t0
    mem_peak = used_memory(client)
    peak_keys = max(peak_keys, client.dbsize())
    assert all(client.xpending(s, "dgr-workers")["pending"] == 0 for s in (pre, dec))
    time.sleep(1.5)  # the reject ttl
    for _ in range(3):
        worker.run_once()  # heartbeat_s 0: every iteration trims the streams
    # what may stay: the worker's own capped streams (dead letters, cancellations), one key each
    allowed = {keys.dead_letters.encode(), keys.cancellations.encode()}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and set(client.keys("*")) - keys_before - allowed:
        time.sleep(0.2)  # active expiry takes a moment over many keys
    leftover = set(client.keys("*")) - keys_before - allowed
    assert not leftover, sorted(leftover)[:10]
    # no per-session or per-account key for anything refused before it opened
    assert client.scard(keys.accounts_index) == 1
    mem_after = used_memory(client)
    # the dead-letter stream (capped at DLQ_MAXLEN ~) is what remains; every other byte came back
    dlq_bytes = int(client.memory_usage(keys.dead_letters) or 0)
    assert client.xlen(keys.dead_letters) <= DLQ_MAXLEN + 200
    assert client.xlen(dec) <= 200 and client.xlen(pre) <= 200
    assert client.xlen(keys.cancellations) <= CANCEL_MAXLEN + 200
    assert mem_after <= mem_before + dlq_bytes + 2_000_000, (mem_before, mem_peak, mem_after, dlq_bytes)
    print(f"\n{N} hostile entries: keys {len(keys_before)} -> peak {peak_keys} -> {client.dbsize()}; "
          f"used_memory {mem_before} -> peak {mem_peak} -> {mem_after} (dead-letter stream {dlq_bytes}); "
          f"drained in {drain_s:.1f} s, {worker.stats.reads} reads")
