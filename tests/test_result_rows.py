"""Every column of a result record reaches the caller's StepResult (issue 30): through both drivers' `on_result`
callbacks (run_many, decode_n 1 and 16: one job per token, and continuation jobs of 16), and through
`read_results` of a session driven by hand, as through `schemas.results_from_fields`. A real worker (the tiny
model, sampling with logprobs) in a thread, on a real redis-server. The oracle reads the raw records of the result
streams column by column, so a reader that drops one (as the producer's own copy of the conversion dropped
`logprobs`) fails here; a record column no check names fails too."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from consumer.engines.llama import LlamaCppEngine
from consumer.transport import RedisTransport
from consumer.worker import Worker, WorkerSettings
from schemas import RouteHop, Sampling, SessionSpec, StepResult, WorkerKeys
from schemas.wire import (
    END_OFFSET,
    OPTIONAL_COLUMNS,
    STATUSES,
    Charges,
    ResultRecord,
    decode_record,
    results_from_fields,
)
from tests.producer_drivers import MakeProducer, make_producer

__all__ = ["make_producer"]

WID = "rows"
SAMPLING = Sampling(temperature=0.8, seed=5, logprobs=2)
MAX_TOKENS = 20
# Each record column and the StepResult field(s) it reaches: a new column must be named here.
COLUMNS = {"worker_id": "worker_id", "call": None, "batch_size": "batch_size", "session_id": "session_id",
           "job": "job_id", "offset": "job_id", "attempt": None, "status": "status", "position": "position",
           "first_position": None, "token": "token", "finished": "finished", "fed_tokens": None,
           "engine_seconds": "accounting.engine_seconds", "extra": "reason detail hidden logprobs",
           **{c: c for c in OPTIONAL_COLUMNS}}  # an optional column reaches the StepResult field of its name
CHARGES = {"p": "accounting.prompt_tokens", "g": "accounting.generated_tokens", "r": "accounting.recomputed_tokens",
           "k": "accounting.cached_tokens", "d": None}


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> LlamaCppEngine:
    return LlamaCppEngine(tiny_model_path, recipe="invariant", n_slots=4, ctx_per_session=128)


@pytest.fixture
def worker(real_redis: redis.Redis, engine: LlamaCppEngine) -> Iterator[Worker]:
    for slot in range(engine.capacity.n_slots):
        engine.release(slot)
    w = Worker(engine, RedisTransport(real_redis, WID, consumer_name=WID),
               WorkerSettings(worker_id=WID, block_ms=5, await_ms=1, gather_ms=0.0, max_batch=4))
    w.start()
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    yield w
    w.request_stop()
    t.join(30)
    w.sampler.close()


def specs(w: Worker, tag: str, n: int = 2) -> list[tuple[SessionSpec, list[int]]]:
    key = w.keys["prefill"]
    return [(SessionSpec(session_id=f"{tag}-{i}", account_id="acct", route=(RouteHop(worker_id=WID, key=key),),
                         sampling=SAMPLING, max_tokens=MAX_TOKENS), [1, 5 + i, 9, 12]) for i in range(n)]


def expected(client: redis.Redis) -> dict[str, list[dict[str, Any]]]:
    """Every published row of every result stream, column by column (the oracle), by session."""
    out: dict[str, list[dict[str, Any]]] = {}
    for stream in client.scan_iter(match=WorkerKeys(WID).results_pattern):
        for _eid, fields in client.xrange(stream):
            rec, chg = decode_record(fields)
            assert set(ResultRecord.__struct_fields__) == set(COLUMNS), "a record column no check names"
            assert set(Charges.__struct_fields__) == set(CHARGES), "a charges column no check names"
            for i in range(len(rec)):
                if i in chg.d:
                    continue
                x = rec.extra.get(str(i))
                optional = {c: col[i] if col is not msgspec.UNSET else 0
                            for c in OPTIONAL_COLUMNS for col in (getattr(rec, c),)}
                off = rec.offset[i]
                rid = rec.job[i] if off == 0 else f"{rec.job[i]}.end" if off == END_OFFSET else f"{rec.job[i]}.{off}"
                out.setdefault(rec.session_id[i], []).append({
                    "job_id": rid, "session_id": rec.session_id[i], "status": STATUSES[rec.status[i]],
                    "position": rec.position[i],
                    "worker_id": rec.worker_id, "token": None if rec.token[i] < 0 else rec.token[i],
                    "finished": rec.finished[i] == 1, "batch_size": rec.batch_size,
                    "accounting": (chg.p[i], chg.g[i], chg.r[i], rec.engine_seconds[i], chg.k[i] if chg.k else 0),
                    "reason": x.reason if x else None, "detail": x.detail if x else "",
                    "hidden": x.hidden if x else None, "logprobs": x.logprobs if x else None, **optional})
    return out


def seen(r: StepResult) -> dict[str, Any]:
    a = r.accounting
    return {"job_id": r.job_id, "session_id": r.session_id, "status": r.status, "position": r.position,
            "worker_id": r.worker_id, "token": r.token, "finished": r.finished, "batch_size": r.batch_size,
            "accounting": (a.prompt_tokens, a.generated_tokens, a.recomputed_tokens, a.engine_seconds,
                           a.cached_tokens),
            "reason": r.reason, "detail": r.detail, "hidden": r.hidden, "logprobs": r.logprobs,
            **{c: getattr(r, c) for c in OPTIONAL_COLUMNS}}


def check(client: redis.Redis, got: dict[str, list[StepResult]], sessions: int) -> None:
    want = expected(client)
    assert len(want) == sessions and set(got) == set(want)
    for sid, rows in want.items():
        assert [seen(r) for r in got[sid]] == rows, sid
        tokens = [r for r in got[sid] if r.token is not None]
        assert len(tokens) == MAX_TOKENS
        # the optional column: the prompt (4 tokens) was computed in one prefill call, decode answers in none
        assert [r.prefill_calls for r in got[sid]] == [1] + [0] * (len(got[sid]) - 1), sid
        # asked for: every sampled token carries its logprob and the top 2
        assert all(r.logprobs is not None and len(r.logprobs.top) == 2 and r.logprobs.lp <= 0 for r in tokens), sid
    # the stream's own reader agrees
    from_fields: dict[str, list[StepResult]] = {}
    for stream in client.scan_iter(match=WorkerKeys(WID).results_pattern):
        for _eid, fields in client.xrange(stream):
            for r in results_from_fields(fields):
                from_fields.setdefault(r.session_id, []).append(r)
    assert {s: [seen(r) for r in rs] for s, rs in from_fields.items()} == want


@pytest.mark.parametrize("decode_n", [1, 16])
def test_every_column_reaches_on_result(real_redis: redis.Redis, worker: Worker, make_producer: MakeProducer,
                                        decode_n: int) -> None:
    p = make_producer(real_redis, decode_n=decode_n, timeout_s=60)
    got: dict[str, list[StepResult]] = {}

    def on_result(h: Any, r: StepResult) -> None:
        got.setdefault(r.session_id, []).append(r)

    handles = p.run_many(specs(worker, f"cb{decode_n}"), on_result=on_result)
    assert all(h.status == "finished" for h in handles.values())
    check(real_redis, got, 2)
    for sid, h in handles.items():
        assert msgspec.structs.asdict(h.last_result) == msgspec.structs.asdict(got[sid][-1])


def test_every_column_reaches_read_results(real_redis: redis.Redis, worker: Worker,
                                           make_producer: MakeProducer) -> None:
    p = make_producer(real_redis, timeout_s=60)
    got: dict[str, list[StepResult]] = {}
    ((spec, prompt),) = specs(worker, "rr", 1)
    h = p.open(spec, prompt)
    while not h.finished:
        for sid, rs in p.read_results([h], block_ms=200).items():
            got.setdefault(sid, []).extend(rs)
            if not h.finished and rs[-1].token is not None:
                p.push_decode(h, rs[-1].token)
    check(real_redis, got, 1)
