"""A forged job under a session's own job id (issue 29), on a real redis-server: a writer without the key
copies the victim's next job id (ids are deterministic: `producer.job_id`) and XADDs another job under it
(another n, another token, no `reply_to`), before, during or after the genuine job. Twins are the same job,
not the same id: the other job is refused `job_id_conflict` to the stream it named, and the victim's Tracker
(the real `Producer`, stepped by hand with the worker) finishes with its solo tokens, every slot free after.

Decode jobs (n = 1), continuation jobs (n = 4; `ramped`: the session opened with its first continuation, so
its replay re-opens with one too: consumer/worker/early.py holds it for the new attempt's prompt, never against
the attempt the worker still holds) and the opening prefill, each forged before (the forger's job is computed
first: the genuine one is refused, its Tracker replays), during (the genuine job is held) and after (it was
answered).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from consumer.engines.reference import NumpyReferenceEngine
from consumer.worker import Worker
from producer import Producer, SessionHandle, job_id
from schemas import Reason, RouteHop, SessionSpec, StepJob, WorkerKeys, job_to_fields, results_from_fields

from .hostile_support import WID, make_worker
from .support import prompts, solo_generate

VOCAB = 300
TOKENS = 12


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[NumpyReferenceEngine]:
    eng = NumpyReferenceEngine(tiny_model_path, n_slots=4, ctx_per_session=256)
    yield eng
    eng.close()


PROMPT = prompts(1, VOCAB, seed=29, lo=9, hi=9)[0]


@pytest.fixture(scope="module")
def solo(engine: NumpyReferenceEngine) -> list[int]:
    return solo_generate(engine, PROMPT, TOKENS)


def forge(client: redis.Redis, worker: Worker, job: StepJob) -> None:
    """XADD a job as a writer without the key can (no signature, whatever it names)."""
    stream = WorkerKeys(WID).input_stream(job.compat, job.phase)
    client.xadd(stream, job_to_fields(job))  # type: ignore[arg-type]


def replies(client: redis.Redis, sid: str) -> list[tuple[str, str, str]]:
    """(result id, status, reason) of every row published to the session's own stream (where a job without
    `reply_to` is answered)."""
    out = []
    for _id, f in client.xrange(WorkerKeys(WID).results(sid)):
        out += [(r.job_id, r.status.value, r.reason.value if r.reason else "") for r in results_from_fields(f)]
    return out


def victim_spec(worker: Worker, account: str = "honest") -> SessionSpec:
    return SessionSpec(session_id="victim", account_id=account, max_tokens=TOKENS,
                       route=(RouteHop(worker_id=WID, key=worker.keys["prefill"]),))  # type: ignore[index]


def forged_next(h: SessionHandle, worker: Worker) -> StepJob:
    """The job a forger writes under the id of the victim's next decode job (not pushed yet): one token, no
    token of its own (the worker feeds the session's last one), answered to the session's own stream."""
    pos = h.position
    return StepJob(job_id=job_id(h.session_id, 0, "decode", pos, h.attempt), session_id=h.session_id,
                   phase="decode", compat=worker.keys["decode"].digest, start_position=pos, tokens=(),  # type: ignore[index]
                   created_at=time.time())


def forged_copy(job: StepJob) -> StepJob:
    """Another job under a genuine job's id: one token, answered to the session's own stream, and for an
    opening billed to the forger."""
    changes: dict[str, object] = {"reply_to": None, "n": 1, "created_at": time.time()}
    if job.session is not None:
        changes["session"] = job.session.model_copy(update={"account_id": "mallory"})
    elif job.phase == "decode":
        changes["tokens"] = ()
    return job.replace(**changes)


def open_ramped(p: Producer, spec: SessionSpec) -> SessionHandle:
    """Open as run_many does: the first continuation pushed with the opening (the handle keeps it for a replay)."""
    core, queue_prefill = p.core, p.core.queue_prefill
    core.queue_prefill = lambda batch, h, **kw: queue_prefill(batch, h, **{**kw, "ramp": True})  # type: ignore[method-assign]
    try:
        h = p.open(spec, PROMPT)
    finally:
        del core.queue_prefill
    assert h.ramp and any(s.job.with_opening for s in h.sent.values())
    return h


@pytest.mark.parametrize("when", ["before", "during", "after"])
@pytest.mark.parametrize("kind", ["decode", "continuation", "ramped", "prefill"])
def test_a_forged_job_under_the_victims_job_id_costs_it_nothing(
        real_redis: redis.Redis, engine: NumpyReferenceEngine, solo: list[int], kind: str, when: str) -> None:
    worker = make_worker(real_redis, engine)
    p = Producer(real_redis, decode_n=4 if kind in ("continuation", "ramped") else 1, timeout_s=30.0)
    spec = victim_spec(worker)
    forged: list[StepJob] = []
    if kind == "prefill" and when == "before":
        opening = StepJob(job_id=job_id("victim", 0, "prefill", 0, 0), session_id="victim", phase="prefill",
                          compat=worker.keys["prefill"].digest, start_position=0,  # type: ignore[index]
                          tokens=tuple(PROMPT[:3]), created_at=time.time(),
                          session=spec.model_copy(update={"account_id": "mallory"}))
        forge(real_redis, worker, opening)
        forged.append(opening)
        worker.run_once()  # the forger's opening is computed before the Tracker's arrives
    h = open_ramped(p, spec) if kind == "ramped" else p.open(spec, PROMPT)
    answered: list[StepJob] = []
    for _ in range(300):
        if h.finished:
            break
        if not forged:
            target = None
            if kind == "prefill" and when == "during":
                target = next(s.job for s in h.sent.values() if s.job.phase == "prefill")
            elif kind == "prefill" and when == "after" and h.generated:
                target = next(j for j in answered if j.phase == "prefill")
            elif kind != "prefill" and len(h.generated) >= 2:
                decodes = [s.job for s in h.sent.values() if s.job.phase == "decode"]
                if when == "during" and decodes:
                    target = decodes[0]
                elif when == "after":
                    target = next((j for j in answered if j.phase == "decode"), None)
                elif when == "before":
                    job = forged_next(h, worker)
                    forge(real_redis, worker, job)
                    forged.append(job)
            if target is not None:
                job = forged_copy(target)
                forge(real_redis, worker, job)
                forged.append(job)
        worker.run_once()
        before = dict(h.sent)
        p.poll([h])
        answered += [s.job for jid, s in before.items() if jid not in h.sent]
    assert forged, "the forger never wrote"
    assert h.status == "finished", (h, h.detail)
    assert h.generated == solo
    for _ in range(3):
        worker.run_once()
    assert worker.scheduler.table.busy_slots == 0
    if when != "before":  # the forged job was refused where it asked, under the id it named
        conflicts = [r for r in replies(real_redis, "victim") if r[2] == Reason.JOB_ID_CONFLICT.value]
        assert conflicts and all(r[1] == "rejected" for r in conflicts), replies(real_redis, "victim")
        assert h.attempt == 0  # the genuine job was never refused: no replay
    else:  # the forger's job was computed first: the genuine one was refused job_id_conflict, and replayed
        assert h.attempt == 1
        if kind == "ramped":  # the replay re-opened with its first continuation, held for its prompt
            assert worker.stats.early_held >= 1
