"""`dgr bench scheduler`: the cost of one scheduling round, and that it does not grow with idle sessions.

A round is what the worker asks of the scheduler per fused decode call: admit one decode step per
active session, `next_batch()` (one call holding every active session), and the sampler plus
`update_from_output()` with fake
logits of a small vocabulary. It is timed for 8, 64 and 1024 active sessions, alone in the table
and with 10,000 idle sessions (open, decoding, nothing queued) beside them. The step jobs are built
before the clock starts (parsing is the transport's cost, not the scheduler's). Beside the round, column `file
ms`: the call's answers encoded into the completion call that files them (`encode_filing`: its KEYS and ARGV,
no I/O), every job replying to one Tracker's stream as the producer's do (one record per call).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from consumer.batch import EngineCapacity, EngineOutput
from consumer.sampler import BatchSampler
from consumer.sched import Scheduler, SchedulerConfig
from consumer.transport.protocol import Delivery, Filing
from consumer.transport.publish import COMPLETE_ARGV, encode_filing
from schemas import (
    PHASES,
    BoundarySchema,
    CompatibilityKey,
    EngineIdentity,
    Phase,
    Recipe,
    RouteHop,
    SessionSpec,
    StateLayout,
    StepJob,
    WorkerKeys,
)

from .common import console, markdown, plot, save, table

NAME = "scheduler"
VOCAB = 256
ACTIVE = (8, 64, 1024)
IDLE = (0, 10_000)
# The completion script's fixed ARGV head, values as a worker sends them (the control follows it)
_HEAD = {"group": "dgr-workers", "result_ttl_s": 3600, "result_maxlen": 10_000, "dlq_maxlen": 10_000,
         "reject_ttl_s": 60, "lease_token": "lease-token", "lease_epoch": 1, "lease_ms": 5000, "act_ttl_s": 60,
         "call_seq": 1}
FILING_HEAD = [_HEAD[name] for name in COMPLETE_ARGV[:-1]]


def _key(phase: Phase) -> CompatibilityKey:
    return CompatibilityKey(
        engine=EngineIdentity(architecture="bench", gguf_sha256="0" * 64),
        recipe=Recipe(quantization="F32", kv_cache_type="f32", ctx_per_session=4096, flash_attention=False,
                      batch_invariant=True, runtime="bench"),
        phase=phase,
        boundary=BoundarySchema(name="tokens->logits", version=1, consumes="tokens", produces="logits",
                                last_layer=1),
        state=StateLayout(kind="kv", dims={"n_layer": 1}),
    )


class _Setup:
    def __init__(self, n_active: int, n_idle: int, repeats: int) -> None:
        keys = {p: _key(p) for p in PHASES}
        self.digests: dict[Phase, str] = {p: k.digest for p, k in keys.items()}
        n = n_active + n_idle
        cap = EngineCapacity(n_slots=n, ctx_per_session=repeats + 16, max_tokens_per_call=max(n_active, 4096),
                             vocab_size=VOCAB)
        self.sampler = BatchSampler(VOCAB)
        self.keys = WorkerKeys("bench")
        self.sched = Scheduler(SchedulerConfig(capacity=cap, max_batch=n_active, prefill_budget=4096),
                               "bench", self.digests)
        route = (RouteHop(worker_id="bench", key=keys["prefill"]),)
        self.active = [f"a{i}" for i in range(n_active)]
        for i, sid in enumerate(self.active + [f"i{j}" for j in range(n_idle)]):
            spec = SessionSpec(session_id=sid, account_id="bench", route=route, max_tokens=repeats + 8)
            job = StepJob(job_id=f"open-{i}", session_id=sid, phase="prefill", compat=self.digests["prefill"],
                          start_position=0, tokens=(1, 2), created_at=0.0, session=spec)
            if self.sched.admit(job, self.digests["prefill"], None) is not None:
                raise RuntimeError(f"could not open {sid}")
        while (batch := self.sched.next_batch()) is not None:
            rows = EngineOutput.logits(np.zeros((batch.fused.n_logit_rows, VOCAB), np.float32))
            self.sched.update_from_output(batch, self.sampler(batch, rows), 0.0)
        if self.sched.awaiting_decode() != n:
            raise RuntimeError("setup did not leave every session decoding")
        self.position = 2
        logits = np.zeros((n_active, VOCAB), dtype=np.float32)
        logits[:, 3] = 1.0
        self.logits = EngineOutput.logits(logits)

    def jobs(self, round_no: int) -> list[StepJob]:
        d = self.digests["decode"]
        return [StepJob(job_id=f"r{round_no}-{i}", session_id=sid, phase="decode", compat=d,
                        start_position=self.position, tokens=(3,), created_at=0.0, reply_to="bench-tracker")
                for i, sid in enumerate(self.active)]

    def round(self, jobs: Sequence[StepJob]) -> tuple[float, float, float, float]:
        s, d = self.sched, self.digests["decode"]
        refs = [Delivery(f"stream-{d[:8]}", f"{self.position}-{i}", {}, d, "decode") for i in range(len(jobs))]
        t0 = time.perf_counter()
        for job, ref in zip(jobs, refs, strict=True):
            if s.admit(job, d, ref) is not None:
                raise RuntimeError("decode step rejected")
        t1 = time.perf_counter()
        batch = s.next_batch()
        t2 = time.perf_counter()
        if batch is None or len(batch.items) != len(jobs):
            raise RuntimeError("the round's call does not hold every active session")
        out = s.update_from_output(batch, self.sampler(batch, self.logits), 0.001)  # sampling counts, as in the worker
        t3 = time.perf_counter()
        encode_filing(Filing(answers=out), self.keys, FILING_HEAD, worker_id="bench", call_id=f"1:{self.position}",
                      consumer_name="bench")
        t4 = time.perf_counter()
        if len(out) != len(jobs):
            raise RuntimeError("not every step was answered")
        self.position += 1
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3


def _summary(n_active: int, n_idle: int, samples: list[tuple[float, float, float, float]]) -> dict[str, Any]:
    totals = [a + b + c for a, b, c, _ in samples]
    med = statistics.median(totals)
    return {
        "active": n_active, "idle": n_idle, "rounds": len(samples),
        "round_ms_median": med * 1e3,
        "round_ms_p90": float(np.percentile(totals, 90)) * 1e3,
        "per_session_us": med / n_active * 1e6,
        "admit_ms": statistics.median(t[0] for t in samples) * 1e3,
        "next_batch_ms": statistics.median(t[1] for t in samples) * 1e3,
        "complete_ms": statistics.median(t[2] for t in samples) * 1e3,
        "file_ms": statistics.median(t[3] for t in samples) * 1e3,
    }


def measure(n_active: int, idle: Sequence[int], repeats: int) -> list[dict[str, Any]]:
    """Rounds for one active count, alternating between the idle variants so that machine noise
    (other processes, frequency changes) falls on all of them alike."""
    setups = {i: _Setup(n_active, i, repeats) for i in idle}
    samples: dict[int, list[tuple[float, float, float, float]]] = {i: [] for i in idle}
    warmup = min(5, repeats)
    for r in range(repeats + warmup):
        for i, setup in setups.items():
            jobs = setup.jobs(r)
            timing = setup.round(jobs)
            if r >= warmup:
                samples[i].append(timing)
    return [_summary(n_active, i, samples[i]) for i in idle]


def run(out_dir: Path, repeats: int = 60, active: Sequence[int] = ACTIVE, idle: Sequence[int] = IDLE,
        ) -> dict[str, Any]:
    """Time scheduling rounds; print a table; write scheduler.json and scheduler.png under out_dir."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    per_active = [measure(a, idle, repeats) for a in active]
    results = [r for i in range(len(idle)) for r in (rows[i] for rows in per_active)]
    by = {(r["active"], r["idle"]): r for r in results}
    base_idle = min(idle)
    for r in results:
        base = by[(r["active"], base_idle)]["round_ms_median"]
        r["vs_no_idle"] = r["round_ms_median"] / base if base > 0 else float("nan")
    columns = ["active", "idle", "round ms", "p90 ms", "µs/session", "admit ms", "next_batch ms", "complete ms",
               "× no idle", "file ms"]
    rows = [[r["active"], r["idle"], r["round_ms_median"], r["round_ms_p90"], r["per_session_us"], r["admit_ms"],
             r["next_batch_ms"], r["complete_ms"], r["vs_no_idle"], r["file_ms"]] for r in results]
    console.print(table("Scheduling round (medians): admit + next_batch + complete, one decode call", columns,
                        rows))
    worst = max(r["vs_no_idle"] for r in results)
    console.print(f"worst slowdown with idle sessions: ×{worst:.2f}")
    json_path = save(out_dir, NAME, {"repeats": repeats, "vocab": VOCAB, "results": results,
                                     "worst_idle_slowdown": worst, "markdown": markdown(columns, rows)})
    series: dict[str, tuple[Sequence[float], Sequence[float]]] = {
        f"{i:,} idle sessions": ([float(a) for a in active], [float(by[(a, i)]["round_ms_median"]) for a in active])
        for i in idle}
    png_path = plot(out_dir, NAME, "Scheduling round (median)", "active sessions", "ms per round", series,
                    logx=True)
    return {"results": results, "worst_idle_slowdown": worst, "json": str(json_path), "png": str(png_path)}


if __name__ == "__main__":  # pragma: no cover
    import sys

    run(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-results"))
