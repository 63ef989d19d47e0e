"""Two hop workers on the in-memory Transport (tests/memory_transport.py): no Redis, the relay by hand.
A long prefill's rows leave hop 0 through a blob (kept by the transport under activations_out), a decode
step's inline; hop 1 reads the blob through fetch_activations and samples the whole model's token; the
input blob is dropped once answered; a twin delivery of an answered hop step writes no second blob."""

from __future__ import annotations

from pathlib import Path

from consumer.engines.reference import NumpyReferenceEngine
from consumer.worker import Worker, WorkerSettings
from schemas import RouteHop, SessionSpec, Status, StepJob, WorkerKeys
from tests.memory_transport import MemoryTransport

from .support import prompts, solo_generate


def _worker(engine: NumpyReferenceEngine, wid: str) -> tuple[Worker, MemoryTransport]:
    t = MemoryTransport(wid)
    w = Worker(engine, t, WorkerSettings(worker_id=wid, block_ms=0, gather_ms=0.0))  # type: ignore[arg-type]
    w.start()
    return w, t


def test_two_hops_in_memory(tiny_model_path: Path) -> None:
    w0, t0 = _worker(NumpyReferenceEngine(tiny_model_path, n_slots=2, ctx_per_session=256, layers=(0, 1)), "m0")
    w1, t1 = _worker(NumpyReferenceEngine(tiny_model_path, n_slots=2, ctx_per_session=256, layers=(1, 2)), "m1")
    route = (RouteHop(worker_id="m0", key=w0.keys["prefill"]), RouteHop(worker_id="m1", key=w1.keys["prefill"]))
    spec = SessionSpec(session_id="s", account_id="a", route=route, max_tokens=3)
    (prompt,) = prompts(1, 500, seed=3, lo=50, hi=50)  # 50 rows x 128 x 4 bytes: a blob

    def job(hop: int, phase: str, start: int, tokens: tuple[int, ...], hidden: object = None) -> StepJob:
        w = (w0, w1)[hop]
        return StepJob(job_id=f"s.h{hop}.{phase[0]}{start}", session_id="s", hop=hop, phase=phase,  # type: ignore[arg-type]
                       compat=w.keys[phase].digest, start_position=start, tokens=tokens,  # type: ignore[index]
                       created_at=1.0, session=spec if start == 0 else None, hidden=hidden)  # type: ignore[arg-type]

    t0.push(job(0, "prefill", 0, tuple(prompt)))
    w0.run_once()
    (a0,) = t0.answers
    acts = a0.result.hidden
    assert a0.result.status == Status.OK and a0.result.token is None and acts is not None
    assert acts.blob == WorkerKeys("m0").activations_out("s.h0.p0") and acts.rows == 50
    assert t0.blobs[acts.blob] == a0.blob and a0.result.accounting.prompt_tokens == 0
    # the relay: hop 1's job names its own input key, the bytes are put there
    j1 = job(1, "prefill", 0, tuple(prompt), acts.moved(WorkerKeys("m1").activations_in("s.h1.p0")))
    assert j1.hidden is not None and j1.hidden.blob is not None
    t1.blobs[j1.hidden.blob] = t0.blobs[acts.blob]
    t1.push(j1)
    t1.push(j1)  # a twin delivery: one answer computed, the same filed twice
    w1.run_once()
    assert j1.hidden.blob not in t1.blobs  # dropped once answered
    toks = [a.result.token for a in t1.answers if a.result.job_id == j1.job_id]
    assert len(toks) == 2 and toks[0] == toks[1] is not None
    generated = [toks[0]]
    pos = len(prompt)
    while len(generated) < 3:
        t0.push(job(0, "decode", pos, (generated[-1],)))
        w0.run_once()
        a = t0.answers[-1]
        assert a.result.hidden is not None and a.result.hidden.inline and a.blob is None  # a decode step: inline
        t1.push(job(1, "decode", pos, (generated[-1],), a.result.hidden))
        w1.run_once()
        generated.append(t1.answers[-1].result.token)
        pos += 1
    whole = NumpyReferenceEngine(tiny_model_path, n_slots=1, ctx_per_session=256)
    assert generated == solo_generate(whole, prompt, 3)
    assert t0.answers[-1].result.finished  # hop 0 finishes with the last hop, at max_tokens
    assert w0.scheduler.table.get("s") is None and w1.scheduler.table.get("s") is None
