"""The core's route decisions (producer/core.py, steps.py, route.py) without Redis or engines: simulated hops
that answer the core's plans (typed commands), the composed model as the oracle.

Each simulated hop keeps per-session state the way a KV cache does (a running sum over the positions it
computed), so a hop that was given a wrong row, a row twice, a row out of order or a stale attempt's row
answers differently from the oracle. The hops answer in random orders (hypothesis), prefill rows travel
in blobs and decode rows inline exactly as schemas.activations encodes them, and a hop may lose every
session at any moment (a crash): every session must still end with the oracle's tokens.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer import ProducerCore, SessionHandle, WorkerInfo
from producer.commands import Batch, Delete, Exists, Get, HGetAll, HSet, Read, Set, Sleep, XAdd, XRange, XRead
from producer.route import relay
from producer.session import known
from schemas import (
    Accounting,
    CompatibilityKey,
    Reason,
    RouteHop,
    SessionSpec,
    Status,
    StepJob,
    StepResult,
    WorkerKeys,
    cancel_from_fields,
    job_from_fields,
    results_to_fields,
)
from schemas.activations import decode, encode
from schemas.compat import EngineIdentity, Recipe, StateLayout, hop_boundary
from schemas.keys import parse_input_stream

SOAK = os.environ.get("DGR_SOAK") == "1"  # DGR_SOAK=1: the long searches

VOCAB = 97
HIDDEN = 3
MOD = 10007.0


def hop_key(first: int, last: int, n_layers: int, phase: str = "prefill") -> CompatibilityKey:
    return CompatibilityKey(
        engine=EngineIdentity(architecture="sim", gguf_sha256="cd" * 32),
        recipe=Recipe(quantization="F32", kv_cache_type="f32", ctx_per_session=4096, flash_attention=False,
                      batch_invariant=True, runtime="sim/1"),
        phase=phase,  # type: ignore[arg-type]
        boundary=hop_boundary(first, last, n_layers, HIDDEN), state=StateLayout(kind="kv", dims={"n_layer": 1}))


def route_spec(sid: str, cuts: Sequence[int], workers: Sequence[str], max_tokens: int,
               stop: tuple[int, ...] = ()) -> SessionSpec:
    n = cuts[-1]
    hops = tuple(RouteHop(worker_id=w, key=hop_key(a, b, n)) for w, a, b in zip(workers, cuts, cuts[1:], strict=False))
    return SessionSpec(session_id=sid, account_id="acct", route=hops, max_tokens=max_tokens, stop_tokens=stop)


# ------------------------------------------------------------------------------------------ the model


def layer(k: int, x: np.ndarray, acc: float) -> tuple[np.ndarray, float]:
    """Hop k on one row, with its running state: exact in f32 (small integers)."""
    acc = (acc + x[0] * (k + 2) + x[1] + x[2]) % MOD
    return np.array([(x[0] * 3 + acc) % MOD, (x[1] + x[0] * k) % MOD, acc], dtype=np.float32), acc


def embed(token: int, pos: int) -> np.ndarray:
    return np.array([token * 31 % MOD, pos % MOD, 1.0], dtype=np.float32)


def head(x: np.ndarray) -> int:
    return int(x[0] * 7 + x[1] * 3 + x[2]) % VOCAB


def oracle(prompt: Sequence[int], n_hops: int, max_tokens: int, stop: tuple[int, ...]) -> list[int]:
    accs = [0.0] * n_hops
    out: list[int] = []
    seq = list(prompt)
    pos = 0
    while True:
        x = None
        while pos < len(seq):
            x = embed(seq[pos], pos)
            for k in range(n_hops):
                x, accs[k] = layer(k, x, accs[k])
            pos += 1
        assert x is not None
        t = head(x)
        out.append(t)
        if len(out) >= max_tokens or t in stop:
            return out
        seq.append(t)


# ------------------------------------------------------------------------------------------ the hops


@dataclass
class Answer:
    """One answer as a hop files it: a record of one row, with the attempt of the job it answers."""

    result: StepResult
    attempt: int

    def fields(self) -> dict[bytes, bytes]:
        f = results_to_fields([self.result])
        rec = msgspec.json.decode(f[b"r"])
        rec["att"] = [self.attempt]
        return {**f, b"r": msgspec.json.encode(rec)}


@dataclass
class SimSession:
    attempt: int
    next_pos: int
    acc: float = 0.0
    closed: str | None = None  # "cancelled" | "finished"
    generated: int = 0
    spec: SessionSpec | None = None


@dataclass
class SimHop:
    """One worker holding hop k: input jobs queued, sessions' state, answers into its result streams."""

    worker: str
    hop: int
    last: bool
    queue: list[StepJob] = field(default_factory=list)
    sessions: dict[str, SimSession] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    answered: set[str] = field(default_factory=set)
    inline_max: int = 0  # rows up to this many bytes answered inline

    def crash(self) -> None:
        """A kill -9 and a fresh process: every session's state is gone; queued jobs stay in the stream."""
        self.sessions.clear()

    def run_one(self, rng: random.Random, store: dict[str, bytes], streams: dict[str, list[Answer]]) -> None:
        # any queued job of any session may go first, but one session's jobs stay in stream order
        firsts: dict[str, int] = {}
        for i, j in enumerate(self.queue):
            firsts.setdefault(j.session_id, i)
        job = self.queue.pop(rng.choice(sorted(firsts.values())))
        if job.job_id in self.answered:
            return
        r = self.serve(job, store)
        self.answered.add(job.job_id)
        streams.setdefault(WorkerKeys(self.worker).results(job.reply), []).append(Answer(r, job.attempt))

    def _res(self, job: StepJob, status: Status, reason: Reason | None = None, **kw: object) -> StepResult:
        return StepResult(job_id=job.job_id, session_id=job.session_id, status=status, reason=reason,
                          position=job.end_position, worker_id=self.worker, **kw)  # type: ignore[arg-type]

    def serve(self, job: StepJob, store: dict[str, bytes]) -> StepResult:
        assert job.hop == self.hop
        # the job's input blob is deleted once the job is answered, whatever the answer (rcons' worker does)
        raw = store.pop(job.hidden.blob, None) if job.hidden is not None and job.hidden.blob is not None else None
        sid = job.session_id
        s = self.sessions.get(sid)
        if sid in self.cancelled:
            return self._res(job, Status.CANCELLED, Reason.CANCELLED)
        opening = job.phase == "prefill" and job.start_position == 0
        if opening and (s is None or job.attempt > s.attempt):  # a newer attempt re-opens (the route's replay)
            assert job.session is not None
            s = self.sessions[sid] = SimSession(attempt=job.attempt, next_pos=0, spec=job.session)
        if s is None:
            return self._res(job, Status.STATE_LOST, Reason.UNKNOWN_SESSION)
        assert job.attempt == s.attempt, (job.attempt, s.attempt)  # the Tracker never mixes attempts
        assert job.start_position == s.next_pos, (job.start_position, s.next_pos)
        if s.closed:
            return self._res(job, Status.REJECTED, Reason.FINISHED)
        if self.hop == 0:
            assert job.hidden is None
            xs = [embed(t, job.start_position + i) for i, t in enumerate(job.tokens)]
        else:
            assert job.hidden is not None
            xs = list(decode(job.hidden, raw, hidden_size=HIDDEN))
        outs = []
        for x in xs:
            y, s.acc = layer(self.hop, x, s.acc)
            outs.append(y)
        s.next_pos = job.end_position
        if not self.last:
            # a prefill chunk's rows go to a blob (however small here), a decode step's inline: both paths
            # a chunk's rows go to a blob when over inline_max (drawn per hop: blobs and inline rows mix
            # within one prompt, so a later chunk's inline rows can arrive before an earlier chunk's blob)
            acts, raw = encode(np.stack(outs), blob=WorkerKeys(self.worker).activations_out(job.job_id),
                               inline_max=self.inline_max if job.phase == "prefill" else 1 << 14)
            if raw is not None:
                store[WorkerKeys(self.worker).activations_out(job.job_id)] = raw
            return self._res(job, Status.OK, hidden=acts, accounting=Accounting(engine_seconds=0.001))
        if not job.sample:
            return self._res(job, Status.OK, accounting=Accounting(prompt_tokens=len(job.tokens)))
        token = head(outs[-1])
        s.generated += 1
        assert s.spec is not None
        done = s.generated >= s.spec.max_tokens or token in s.spec.stop_tokens
        if done:
            s.closed = "finished"
        return self._res(job, Status.OK, token=token, finished=done,
                         accounting=Accounting(generated_tokens=1, engine_seconds=0.002))


class SimCluster:
    """Answers the core's requests for the simulated hops: writes (XADD to input streams, SET/DEL of blobs,
    cancels) and reads (XREAD of result streams, GET of blobs, EXISTS of cancel markers)."""

    def __init__(self, hops: list[SimHop]) -> None:
        self.hops = hops
        self.store: dict[str, bytes] = {}
        self.streams: dict[str, list[Answer]] = {}
        self.markers: set[str] = set()
        self.records: dict[str, dict[str, str]] = {}  # the session records (HSET) the Tracker wrote

    def send(self, batch: Batch) -> None:
        for op in batch.ops:
            if isinstance(op, XAdd):
                fields = {k.encode(): v.encode() for k, v in op.fields.items()}
                parsed = parse_input_stream(op.stream)
                if parsed is None:  # the cancel stream
                    worker = op.stream.split("{")[1].split("}")[0]
                    for hop in self.hops:
                        if hop.worker == worker:
                            hop.cancelled.add(cancel_from_fields(fields))
                    continue
                job = job_from_fields(fields)
                next(h for h in self.hops if h.worker == parsed[0] and h.hop == job.hop).queue.append(job)
            elif isinstance(op, Set):
                if "act:in:" in op.key:
                    assert op.ex, "every blob has a TTL"
                    self.store[op.key] = op.value  # type: ignore[assignment]
                else:
                    self.markers.add(op.key)
            elif isinstance(op, Delete):
                self.store.pop(op.key, None)
            elif isinstance(op, HSet):
                self.records[op.key] = dict(op.mapping)

    def answer(self, req: Read) -> list[object]:
        out: list[object] = []
        for c in req.cmds:
            if isinstance(c, XRead):  # one record per answer (one completion call each), ids by index
                out.append([(s, [(f"{i + 1}-0", r.fields()) for i, r in
                                 enumerate(self.streams.get(s, [])) if i + 1 > int(after.split("-")[0])])
                            for s, after in c.streams])
            elif isinstance(c, Get):
                out.append(self.store.get(c.key))
            elif isinstance(c, HGetAll):
                out.append(self.records.get(c.key, {}))
            elif isinstance(c, XRange):  # one page holds everything here
                out.append([(f"{i + 1}-0", r.fields()) for i, r in enumerate(self.streams.get(c.stream, []))])
            else:
                assert isinstance(c, Exists)
                out.append(c.key in self.markers)
        return out

    def run(self, plan: Any) -> Any:
        """Step one of the core's plans against the simulated hops."""
        reply = None
        try:
            while True:
                req = plan.send(reply)
                if isinstance(req, Batch):
                    self.send(req)
                    reply = None
                else:
                    assert not isinstance(req, Sleep)
                    reply = self.answer(req)
        except StopIteration as stop:
            return stop.value


def drive(core: ProducerCore, cluster: SimCluster, handles: list[SessionHandle], rng: random.Random,
          crash_at: dict[int, int]) -> None:
    """The driver's loop, by hand: run some queued jobs somewhere, then one turn of the core (read, fetch,
    relay, advance, push)."""
    run = core.start([], resume=handles)
    step = 0
    while any(not h.finished for h in handles) or any(h.queue for h in cluster.hops):
        for _ in range(rng.choice((1, 1, 2, 4))):  # several answers may arrive in one read
            busy = [h for h in cluster.hops if h.queue]
            if busy:
                rng.choice(busy).run_one(rng, cluster.store, cluster.streams)
        step += 1
        if step in crash_at:
            cluster.hops[crash_at[step] % len(cluster.hops)].crash()
        cluster.run(core.turn(0))
        assert step < 100_000
    assert run.done


def make(n_hops: int, same_worker: bool, inline_max: int = 0,
         **kw: object) -> tuple[ProducerCore, SimCluster, list[str], list[int]]:
    cuts = list(range(n_hops + 1))
    workers = ["w0"] * n_hops if same_worker else [f"w{k}" for k in range(n_hops)]
    core = ProducerCore(verify_route=False, max_attempts=50, **kw)  # type: ignore[arg-type]
    hops = [SimHop(worker=w, hop=k, last=k == n_hops - 1, inline_max=inline_max) for k, w in enumerate(workers)]
    return core, SimCluster(hops), workers, cuts


def opened(core: ProducerCore, cluster: SimCluster, spec: SessionSpec, prompt: list[int]) -> SessionHandle:
    h = core.new_handle(spec, prompt)
    b = Batch()
    core.queue_prefill(b, h)
    cluster.send(b)
    return h


@settings(max_examples=300 if SOAK else 25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_hops=st.integers(1, 3), same_worker=st.booleans(), n_sessions=st.integers(1, 4),
       lens=st.lists(st.integers(1, 40), min_size=4, max_size=4), chunk=st.integers(1, 16),
       max_tokens=st.integers(1, 8), seed=st.integers(0, 2**32 - 1),
       crashes=st.dictionaries(st.integers(1, 400), st.integers(0, 2), max_size=3),
       inline_rows=st.integers(0, 16))
def test_routes_give_the_composed_model_tokens_whatever_the_order_and_crashes(
        n_hops: int, same_worker: bool, n_sessions: int, lens: list[int], chunk: int, max_tokens: int, seed: int,
        crashes: dict[int, int], inline_rows: int) -> None:
    rng = random.Random(seed)
    core, cluster, workers, cuts = make(n_hops, same_worker, inline_rows * HIDDEN * 4, prefill_chunk=chunk)
    stop = (5,)
    prompts = [[rng.randrange(VOCAB) for _ in range(lens[i])] for i in range(n_sessions)]
    handles = [opened(core, cluster, route_spec(f"s{i}", cuts, workers, max_tokens, stop), p)
               for i, p in enumerate(prompts)]
    drive(core, cluster, handles, rng, crashes)
    for h, p in zip(handles, prompts, strict=True):
        assert h.status == "finished", (h.status, h.reason, h.detail)
        assert h.generated == oracle(p, n_hops, max_tokens, stop)
        assert h.billed_generated >= len(h.generated)
    assert not any("act:in:" in k for k in cluster.store), "every input blob was consumed"
    if not crashes:  # nothing was lost: no replay (a spurious state_lost would be healed by one)
        assert all(h.attempt == 0 for h in handles), [(h.attempt, h.reason, h.detail) for h in handles]
    if not crashes and n_hops > 1:  # every hop released or finished: no session left held anywhere
        for hop in cluster.hops[:-1]:
            for sid in hop.sessions:
                assert sid in hop.cancelled


def test_a_crash_of_the_middle_hop_replays_every_hop() -> None:
    rng = random.Random(1)
    core, cluster, workers, cuts = make(3, False, prefill_chunk=4)
    prompt = [rng.randrange(VOCAB) for _ in range(10)]
    h = opened(core, cluster, route_spec("s", cuts, workers, 6), prompt)
    drive(core, cluster, [h], rng, {12: 1})  # mid-decode: 9 prefill jobs ran by then
    assert h.status == "finished" and h.attempt >= 1
    assert h.generated == oracle(prompt, 3, 6, ())
    assert all(leg.engine_seconds > 0 for leg in h.legs[:-1]) and h.legs[-1].engine_seconds > 0


def test_cancel_ops_reach_every_worker_and_relayed_jobs_name_the_next_hops_blob() -> None:
    core, cluster, workers, cuts = make(3, False, prefill_chunk=64)
    h = opened(core, cluster, route_spec("s", cuts, workers, 4), list(range(1, 40)))
    run = core.start([], resume=[h])
    core.touched.clear()
    cluster.hops[0].run_one(random.Random(0), cluster.store, cluster.streams)
    (stream,) = [s for s in cluster.streams if s.startswith("dgr:{w0}")]
    assert core.ingest(stream, [("1-0", cluster.streams[stream][0].fields())])
    (rl,) = h.relays
    assert rl.blob == WorkerKeys("w0").activations_out(rl.job.job_id)
    b = Batch()
    relay(core, b, h, {rl.blob: cluster.store[rl.blob]})
    (sent,) = [s for s in h.sent.values() if s.hop == 1]
    assert sent.job.hidden is not None and sent.job.hidden.blob == WorkerKeys("w1").activations_in(sent.job.job_id)
    assert [type(op) for op in b.ops] == [Set, XAdd, Delete]  # the input blob before its job, in one pipeline
    assert b.ops[0][0] == sent.job.hidden.blob and b.ops[-1][0] == rl.blob
    batches = core.cancel_batches([leg.worker_id for leg in h.legs], "s")
    assert [batch.tag for batch in batches] == workers and all(batch.transaction for batch in batches)
    for w, batch in zip(workers, batches, strict=True):
        assert {op[0] for op in batch.ops} == {WorkerKeys(w).cancel_marker("s"), WorkerKeys(w).cancellations}
    # an outage: the unanswered relayed job goes again with the same bytes
    again = Batch()
    assert core.queue_unanswered(again, h) == 1
    assert again.ops[:2] == b.ops[:2]
    core.stop(run)


def test_routes_that_do_not_join_are_refused() -> None:
    core = ProducerCore(verify_route=False)
    spec = route_spec("s", [0, 1, 2], ["a", "b"], 4)
    core.new_handle(spec, [1, 2])
    bad = SessionSpec.model_validate({**spec.model_dump(), "route": (spec.route[1], spec.route[0])})
    with pytest.raises(ValueError, match="hop"):
        core.new_handle(bad, [1, 2])
    checked = ProducerCore()
    for w in ("a", "b"):  # both advertise hop 0's keys only
        checked.remember(WorkerInfo(w, [spec.route[0].key.for_phase(p) for p in ("prefill", "decode")], {}, True, 0.0))
    with pytest.raises(ValueError, match="hop 1"):
        checked.new_handle(spec, [1, 2])


def test_the_step_by_step_flow_refuses_a_route_of_several_hops() -> None:
    """open() of a 2-hop route would push to hop 0 and wait for a token that never comes: run_many drives it."""
    core = ProducerCore(verify_route=False)
    spec = route_spec("s", [0, 1, 2], ["a", "b"], 4)
    with pytest.raises(ValueError, match="run_many"):
        next(core.open(spec, [1, 2]))
    h = core.new_handle(spec, [1, 2])
    with pytest.raises(ValueError, match="run_many"):
        core.queue_decode(Batch(), h, 3)


@settings(max_examples=300 if SOAK else 30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_hops=st.integers(1, 3), turns=st.integers(0, 80), chunk=st.integers(1, 8), inline_rows=st.integers(0, 6),
       crashes=st.dictionaries(st.integers(1, 80), st.integers(0, 2), max_size=2), seed=st.integers(0, 2**32 - 1))
def test_a_route_resumed_in_another_tracker_finishes_with_the_composed_models_tokens(
        n_hops: int, turns: int, chunk: int, inline_rows: int, crashes: dict[int, int], seed: int) -> None:
    """A Tracker drives routes part way (hops crashing meanwhile: replays) and goes away; another rebuilds every
    session from its record and the answers on every hop's stream (one scan each), then drives them to the end:
    the oracle's tokens, whatever point the first one stopped at."""
    from producer.resume import resume

    rng = random.Random(seed)
    core, cluster, workers, cuts = make(n_hops, False, inline_rows * HIDDEN * 4, prefill_chunk=chunk)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 14)]
    handles = [opened(core, cluster, route_spec(f"s{i}", cuts, workers, 6), p) for i, p in enumerate(prompts)]
    run = core.start([], resume=handles)
    for step in range(turns):  # part way: prefill relays (blobs and inline), decode steps, replays
        for hop in cluster.hops:
            if hop.queue:
                hop.run_one(rng, cluster.store, cluster.streams)
        if step in crashes:
            cluster.hops[crashes[step] % n_hops].crash()
        cluster.run(core.turn(0))
    core.stop(run)  # the first Tracker is gone
    other, _, _, _ = make(n_hops, False, prefill_chunk=chunk)
    rebuilt = cluster.run(resume(other, "w0", [h.session_id for h in handles]))
    for h in handles:
        r = rebuilt[h.session_id]
        # the tokens each caller had (a replay sampling them again may be amid them: `known`) and the attempt
        assert (known(r), r.attempt) == (known(h), h.attempt), h.session_id
    drive(other, cluster, list(rebuilt.values()), rng, {})
    for i, p in enumerate(prompts):
        assert rebuilt[f"s{i}"].status == "finished"
        assert rebuilt[f"s{i}"].generated == oracle(p, n_hops, 6, ())
