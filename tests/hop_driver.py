"""A small Tracker for routes of several hops, by hand (tests only): the relay of docs/routes.md.

Workers run in-process, one per hop, each with its own worker id (its own hash tag) on one Redis. The
driver pushes hop 0's prefill chunks, reads every hop's result streams, relays a hop's output
activations to the next hop (an inline header as is; a blob GET from hop k's tag, then SET into hop
k+1's tag with the XADD, in one pipeline), and sends the last hop's sampled token back to hop 0 as the
next decode step. `shuffle` relays the results of one poll in a random order across sessions (arrival
orders), and runs the workers in a random order.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from consumer.engines.base import Engine
from consumer.transport import RedisTransport
from consumer.worker import Worker, WorkerSettings
from schemas import RouteHop, Sampling, SessionSpec, Status, StepJob, StepResult, WorkerKeys, job_to_fields
from schemas.limits import ACTIVATION_TTL_S
from schemas.wire import results_from_fields


def make_hop_worker(client: redis.Redis, engine: Engine, worker_id: str, **kw: object) -> Worker:
    settings = WorkerSettings(worker_id=worker_id, block_ms=0, gather_ms=0.0, await_ms=0, **kw)  # type: ignore[arg-type]
    worker = Worker(engine, RedisTransport(client, worker_id, consumer_name="c0"), settings)
    worker.start()
    return worker


@dataclass
class _Sent:
    """A job as the driver sent it to one hop (what the next hop's job repeats)."""

    job: StepJob
    hop: int


@dataclass
class RouteDriver:
    client: redis.Redis
    workers: Sequence[Worker]
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    shuffle: bool = False
    sent: dict[str, _Sent] = field(default_factory=dict)
    last: dict[tuple[int, str], bytes] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    results: dict[str, list[tuple[int, StepResult]]] = field(default_factory=dict)
    position: dict[str, int] = field(default_factory=dict)
    specs: dict[str, SessionSpec] = field(default_factory=dict)
    prompts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    attempt: dict[str, int] = field(default_factory=dict)
    replays: int = 0
    chunk: int = 64
    blob_bytes: int = 0  # activation bytes the relay moved through blobs
    inline_bytes: int = 0  # ... and inline (the JSON headers, base64 data included)

    @property
    def ids(self) -> list[str]:
        return [w.settings.worker_id for w in self.workers]

    def keys(self, hop: int) -> WorkerKeys:
        return WorkerKeys(self.ids[hop])

    def route(self) -> tuple[RouteHop, ...]:
        return tuple(RouteHop(worker_id=w.settings.worker_id, key=w.keys["prefill"]) for w in self.workers)

    def open(self, sid: str, prompt: Sequence[int], max_tokens: int, chunk: int = 64,
             sampling: Sampling = Sampling()) -> None:
        spec = SessionSpec(session_id=sid, account_id="acct", route=self.route(), sampling=sampling,
                           max_tokens=max_tokens, prompt_len=len(prompt))
        self.specs[sid], self.prompts[sid], self.attempt[sid], self.chunk = spec, tuple(prompt), 0, chunk
        self.tokens[sid], self.results[sid] = [], []
        for k in range(len(self.workers)):
            self.last[(k, sid)] = b"0-0"
        pipe = self.client.pipeline(transaction=False)
        self._prefill(pipe, sid)
        pipe.execute()

    def _prefill(self, pipe: redis.client.Pipeline, sid: str) -> None:
        """The current attempt's opening on hop 0: prompt + the tokens generated so far (a replay)."""
        tokens = self.prompts[sid] + tuple(self.tokens[sid])
        chunk = self.chunk
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            self._push(pipe, 0, sid, "prefill", start, part, start + len(part) == len(tokens), None, None)
        self.position[sid] = len(tokens)

    def replay(self, pipe: redis.client.Pipeline, sid: str) -> None:
        """After state_lost on any hop: attempt + 1 on every hop, prompt + generated as prefill."""
        self.attempt[sid] += 1
        self.replays += 1
        self._prefill(pipe, sid)

    def _push(self, pipe: redis.client.Pipeline, hop: int, sid: str, phase: str, start: int,
              tokens: tuple[int, ...], sample: bool, hidden: object, blob: bytes | None) -> None:
        w = self.workers[hop]
        key = w.keys[phase]  # type: ignore[index]
        a = self.attempt[sid]
        spec = None
        if phase == "prefill" and start == 0:
            spec = self.specs[sid]
            if a:  # a replay re-feeds the generated tokens: max_tokens counts from there
                spec = SessionSpec.model_validate({**spec.model_dump(),
                                                   "max_tokens": spec.max_tokens - len(self.tokens[sid])})
        job = StepJob(job_id=f"{sid}.h{hop}.{phase[0]}{start}.a{a}", session_id=sid, hop=hop,
                      phase=phase, compat=key.digest, start_position=start, tokens=tokens,  # type: ignore[arg-type]
                      sample=sample, attempt=a, created_at=time.time(), session=spec,
                      hidden=hidden)  # type: ignore[arg-type]
        self.sent[job.job_id] = _Sent(job, hop)
        if blob is not None and job.hidden is not None and job.hidden.blob is not None:
            pipe.set(job.hidden.blob, blob, ex=ACTIVATION_TTL_S)
        pipe.xadd(self.keys(hop).input_stream(key.digest, phase), job_to_fields(job))  # type: ignore[arg-type]

    def poll(self) -> int:
        """Read every hop's new results and relay them. Returns how many results were read."""
        got: list[tuple[int, StepResult]] = []
        for (hop, sid), after in list(self.last.items()):
            for entry_id, fields in self.client.xrange(self.keys(hop).results(sid), min=b"(" + after):
                self.last[(hop, sid)] = entry_id
                got.extend((hop, r) for r in results_from_fields(fields))
        if self.shuffle:
            # Sessions' results interleave in any order; one session's stay in order (a Tracker relays
            # each session's steps in position order: a worker answers a gap position_gap).
            by_sid: dict[str, list[tuple[int, StepResult]]] = {}
            for hop, r in got:
                by_sid.setdefault(r.session_id, []).append((hop, r))
            lanes = [lane for lane in by_sid.values() for _ in lane]
            self.rng.shuffle(lanes)
            got = [lane.pop(0) for lane in lanes]
        # one GET pipeline for the blobs of this poll's results
        blobs = [r.hidden.blob for _, r in got if r.hidden is not None and r.hidden.blob is not None]
        fetched: dict[str, bytes | None] = {}
        if blobs:  # GETs in one pipeline (not one MGET: the blobs are in several workers' hash tags)
            get = self.client.pipeline(transaction=False)
            for b in blobs:
                get.get(b)
            fetched = dict(zip(blobs, get.execute(), strict=True))
        pipe = self.client.pipeline(transaction=False)
        for hop, r in got:
            self.results[r.session_id].append((hop, r))
            sent = self.sent.get(r.job_id)
            if sent is None or sent.job.attempt != self.attempt[r.session_id]:
                continue  # an older attempt's answer
            if r.status == Status.STATE_LOST:
                self.replay(pipe, r.session_id)
                continue
            if r.status != Status.OK:
                continue
            job = sent.job
            if hop < len(self.workers) - 1:
                acts = r.hidden
                assert acts is not None, r
                raw = fetched.get(acts.blob) if acts.blob is not None else None
                nxt_id = f"{job.session_id}.h{hop + 1}.{job.phase[0]}{job.start_position}.a{job.attempt}"
                if acts.blob is not None:
                    assert raw is not None, f"blob {acts.blob} missing"
                    moved = acts.moved(self.keys(hop + 1).activations_in(nxt_id))
                    self.blob_bytes += len(raw)
                else:
                    moved = acts
                    self.inline_bytes += len(moved.json())
                self._push(pipe, hop + 1, job.session_id, job.phase, job.start_position, job.tokens, job.sample,
                           moved, raw)
            elif r.token is not None:
                self.tokens[r.session_id].append(r.token)
                if not r.finished:
                    pos = self.position[r.session_id]
                    self._push(pipe, 0, r.session_id, "decode", pos, (r.token,), True, None, None)
                    self.position[r.session_id] = pos + 1
        pipe.execute()
        return len(got)

    def _current(self, sid: str) -> list[tuple[int, StepResult]]:
        a = self.attempt.get(sid, 0)
        return [(h, r) for h, r in self.results.get(sid, [])
                if r.job_id in self.sent and self.sent[r.job_id].job.attempt == a]

    def done(self, sid: str) -> bool:
        rs = [r for hop, r in self._current(sid) if hop == len(self.workers) - 1 or
              r.status not in (Status.OK, Status.STATE_LOST)]
        return bool(rs) and (rs[-1].finished or rs[-1].status != Status.OK)

    def failures(self) -> list[tuple[int, StepResult]]:
        """Answers of the current attempts that are not OK (a state_lost that was replayed is not one)."""
        return [(h, r) for sid in self.results for h, r in self._current(sid)
                if r.status not in (Status.OK, Status.STATE_LOST)]

    def run(self, sessions: Sequence[str], max_rounds: int = 2000) -> None:
        """Run every worker once (in a random order when shuffling) and poll, until every session is done."""
        order = list(range(len(self.workers)))
        for _ in range(max_rounds):
            if all(self.done(s) for s in sessions):
                return
            if self.shuffle:
                self.rng.shuffle(order)
            for k in order:
                self.workers[k].run_once()
                self.poll()
        raise AssertionError(f"sessions not done after {max_rounds} rounds: "
                             f"{[s for s in sessions if not self.done(s)]}")
