"""A live in-process worker with honest sessions, and what a hostile writer pushes next to them."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping

import redis

from consumer.engines.base import Engine
from consumer.transport import RedisTransport, TransportSettings
from consumer.worker import Worker, WorkerSettings
from schemas import (
    RouteHop,
    Sampling,
    SessionSpec,
    Signer,
    StepJob,
    StepResult,
    WireError,
    WorkerKeys,
    cancel_from_fields,
    job_from_fields,
    job_to_fields,
    results_from_fields,
)
from schemas.wire import decode_record

WID = "hostile-w"


def make_worker(client: redis.Redis, engine: Engine, *, signer: Signer | None = None,
                transport_settings: TransportSettings = TransportSettings(),
                clock: Callable[[], float] = time.monotonic, **kw: object) -> Worker:
    settings = WorkerSettings(worker_id=WID, block_ms=1, gather_ms=0.0, await_ms=0, **kw)  # type: ignore[arg-type]
    transport = RedisTransport(client, WID, consumer_name=WID, settings=transport_settings, signer=signer)
    worker = Worker(engine, transport, settings, clock=clock)
    worker.start()
    return worker


class Honest:
    """The Tracker's part by hand, for sessions it owns: it reads only the answers to its own job ids
    (a hostile entry naming its session may be answered into the same stream)."""

    def __init__(self, client: redis.Redis, worker: Worker, signer: Signer | None = None,
                 reply: str | None = None) -> None:
        """`reply`: the result stream its jobs name (`reply_to`, as a Tracker's do); None: each session's own."""
        self.client, self.worker, self.signer, self.reply = client, worker, signer, reply
        self.key = worker.keys["prefill"]
        self.keys = WorkerKeys(WID)
        self.ids = itertools.count()
        self.jobs: set[str] = set()
        self.last: dict[str, bytes] = {}
        self.position: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.results: dict[str, list[StepResult]] = {}

    def spec(self, sid: str, max_tokens: int, account: str = "honest-acct", sampling: Sampling | None = None,
             stop_tokens: tuple[int, ...] = ()) -> SessionSpec:
        return SessionSpec(session_id=sid, account_id=account, route=(RouteHop(worker_id=WID, key=self.key),),
                           sampling=sampling or Sampling(), max_tokens=max_tokens, stop_tokens=stop_tokens)

    def open(self, sid: str, prompt: list[int], max_tokens: int, account: str = "honest-acct",
             sampling: Sampling | None = None, stop_tokens: tuple[int, ...] = ()) -> str:
        jid = f"honest-j{next(self.ids)}"
        spec = self.spec(sid, max_tokens, account, sampling, stop_tokens)
        self.push(StepJob(job_id=jid, session_id=sid, phase="prefill", compat=self.key.digest, start_position=0,
                          tokens=tuple(prompt), created_at=time.time(), session=spec))
        self.position[sid] = len(prompt)
        self.tokens[sid], self.results[sid], self.last[sid] = [], [], b"0-0"
        return jid

    def push(self, job: StepJob) -> None:
        if self.reply is not None:
            job = job.replace(reply_to=self.reply)
        key = self.key.for_phase(job.phase)
        stream = self.keys.input_stream(key.digest, job.phase)
        fields = job_to_fields(job)
        if self.signer is not None:
            fields = self.signer.signed(stream, fields)
        self.client.xadd(stream, fields)  # type: ignore[arg-type]
        self.jobs.add(job.job_id)

    def poll(self, *, push_next: bool = True) -> None:
        """Read new answers to own jobs; push the next decode step of every session that got a token."""
        for sid in list(self.last):
            for entry_id, fields in self.client.xrange(self.keys.results(self.reply or sid), min=b"(" + self.last[sid]):
                self.last[sid] = entry_id
                for r in results_from_fields(fields):
                    if r.job_id not in self.jobs or r.session_id != sid:
                        continue
                    self.results[sid].append(r)
                    if r.token is not None:
                        self.tokens[sid].append(r.token)
                        if not r.finished and push_next:
                            self.decode(sid, r.token)

    def decode(self, sid: str, token: int) -> None:
        pos = self.position[sid]
        self.push(StepJob(job_id=f"honest-j{next(self.ids)}", session_id=sid, phase="decode",
                          compat=self.key.for_phase("decode").digest, start_position=pos, tokens=(token,),
                          created_at=time.time()))
        self.position[sid] = pos + 1

    def done(self, sid: str) -> bool:
        rs = self.results.get(sid, [])
        return bool(rs) and (rs[-1].finished or rs[-1].status.value != "ok")

    def run(self, sids: Iterable[str], max_iterations: int = 400) -> int:
        """run_once + poll until every session is done; returns the iterations it took."""
        sids = list(sids)
        for i in range(max_iterations):
            self.worker.run_once()
            self.poll()
            if all(self.done(s) for s in sids):
                return i + 1
        raise AssertionError(f"sessions not done after {max_iterations} iterations: "
                             f"{[(s, self.results[s][-1:]) for s in sids]}")


def dead_letters(client: redis.Redis) -> list[dict[bytes, bytes]]:
    return [f for _id, f in client.xrange(WorkerKeys(WID).dead_letters)]


def accounted(client: redis.Redis, stream: str, entry_id: str, fields: Mapping[bytes, bytes],
              dlq: list[dict[bytes, bytes]]) -> str:
    """How the worker answered one entry: 'dead letter', 'answered' (a result record for its job id),
    'cancellation' (a valid cancel entry, applied) or '' when nothing shows for it."""
    if any(d.get(b"entry_id") == entry_id.encode() and d.get(b"stream") == stream.encode() for d in dlq):
        return "dead letter"
    keys = WorkerKeys(WID)
    if stream == keys.cancellations:
        try:
            cancel_from_fields(fields)
            return "cancellation"
        except WireError:
            return ""
    try:
        job = job_from_fields(fields)
    except WireError:
        return ""
    # A refusal has its once-only marker; an ok answer is a row of a record published to its reply stream.
    if client.exists(keys.result_record(job.job_id)):
        return "answered"
    for _id, f in client.xrange(keys.results(job.reply)):
        if job.job_id in decode_record(f)[0].job:
            return "answered"
    return ""
