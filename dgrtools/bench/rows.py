"""`dgr bench rows`: the worker's Python per decode row, stage by stage (issue 32, item 2: "the per-session Python
that is left is measured and named").

The steady state of `wire_cost.py`'s decode: N sessions on continuation jobs of `decode_n` tokens (the Tracker's
default: 16), every row plain greedy, each call chained after the one before. One call's stages, in the order the
worker runs them, on the real objects and nothing else in the process (no Redis, no engine: fake logits of the
sleep engine's vocabulary), timed one by one over many calls:

- `rank`: the row argmax after the forward pass (EngineOutput.with_top, the engine thread);
- `fill`: the successor's inputs from it (Successor.fill, the engine thread);
- `sample`: the loop's sampler (BatchSampler.sample, every row a plain greedy one);
- `report`: the sampled tokens applied (apply_sampled: update_from_output), one answer per row;
- `adopt`: the successor handed out (Scheduler.adopt), the call now in flight;
- `successor`: the next call built ahead (Scheduler.successor);
- `ledger`: the answers through the delivery ledger (DeliveryLedger.completions: remembered for a re-send);
- `metrics`: the iteration's metrics (observe_iteration);
- `file`: the answers encoded into the completion call (encode_filing, the I/O thread's; no round trip);
- `admit`: the continuation jobs the Tracker pushes meanwhile (Scheduler.admit, one per session every decode_n
  calls).

The per-row column divides each stage by the rows of the call: a stage whose cost is per call shows a per-row
figure that falls as N grows; one that is per row stays flat.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from consumer.batch import EngineCapacity, EngineOutput
from consumer.metrics import Metrics
from consumer.sampling import BatchSampler
from consumer.sampling.stage import plain
from consumer.sched import Answer, ScheduledBatch, Scheduler, SchedulerConfig
from consumer.transport.protocol import Delivery, Filing, FusedCallStats
from consumer.transport.publish import encode_filing
from consumer.worker.delivery import DeliveryLedger
from consumer.worker.hop_steps import HopSteps
from consumer.worker.observe import observe_iteration
from consumer.worker.sampled import apply_sampled
from schemas import PHASES, Phase, RouteHop, SessionSpec, StepJob, WorkerKeys

from .common import console, save, table
from .scheduler import FILING_HEAD, VOCAB, _key

NAME = "rows"
STAGES = ("rank", "fill", "sample", "report", "adopt", "successor", "ledger", "metrics", "file", "admit")


class SteadyDecode:
    """N sessions decoding on continuation jobs, each call chained after the one before, as the worker runs them
    (consumer/worker/calls.py, loop.py), with each stage timed."""

    def __init__(self, n: int, decode_n: int = 16, calls: int = 64) -> None:
        keys = {p: _key(p) for p in PHASES}
        self.digests: dict[Phase, str] = {p: k.digest for p, k in keys.items()}
        self.decode_n = decode_n
        ctx = 4 + decode_n * (calls // decode_n + 4)
        cap = EngineCapacity(n_slots=n, ctx_per_session=ctx, max_tokens_per_call=max(n, 512), vocab_size=VOCAB)
        self.sched = Scheduler(SchedulerConfig(capacity=cap, max_batch=n, prefill_budget=4096), "bench", self.digests)
        self.sampler = BatchSampler(VOCAB)
        self.ledger = DeliveryLedger(self.sched, HopSteps(keys["prefill"].boundary, lambda d, j: f"{d}:{j}"),
                                     262_144)
        self.metrics = Metrics("bench")
        self.keys = WorkerKeys("bench")
        self.rng = np.random.default_rng(7)
        self._drawn: dict[int, list[np.ndarray]] = {}
        self._turn = 0
        route = (RouteHop(worker_id="bench", key=keys["prefill"]),)
        self.sessions = [f"s{i}" for i in range(n)]
        self.next_at: dict[str, int] = {}  # session -> the start of the continuation job to push next
        self.jobs = 0
        for i, sid in enumerate(self.sessions):
            spec = SessionSpec(session_id=sid, account_id="bench", route=route, max_tokens=ctx - 4)
            self._admit(StepJob(job_id=f"open-{i}", session_id=sid, phase="prefill", compat=self.digests["prefill"],
                                start_position=0, tokens=(1, 2), created_at=0.0, session=spec, reply_to="bench-t"))
            self.next_at[sid] = 2
        batch = self.sched.next_batch()
        assert batch is not None and batch.phase == "prefill"
        self._push_continuations(lambda: None)  # the first continuation goes with the opening (the ramp)
        out = self._logits(batch.fused.n_logit_rows)
        apply_sampled(self.sched, batch, self.sampler.sample(batch, out), 0.001)
        self._push_continuations(lambda: None)
        nxt = self.sched.next_batch()
        assert nxt is not None and nxt.phase == "decode" and len(nxt.fused) == n, "not every session decodes"
        self.batch: ScheduledBatch = nxt
        self.times: dict[str, list[float]] = {s: [] for s in STAGES}

    def _logits(self, rows: int) -> EngineOutput:
        """Rows of random logits: four sets drawn once, taken in turn (drawing them is not the worker's cost)."""
        got = self._drawn.get(rows)
        if got is None:
            got = self._drawn[rows] = [self.rng.normal(size=(rows, VOCAB)).astype(np.float32) for _ in range(4)]
        self._turn += 1
        return EngineOutput.logits(got[self._turn % 4])

    def _admit(self, job: StepJob) -> None:
        d = self.digests[job.phase]
        self.jobs += 1
        ref = Delivery(f"stream-{d[:8]}", f"{self.jobs}-0", {}, d, job.phase)
        if self.sched.admit(job, d, ref) is not None:
            raise RuntimeError(f"job {job.job_id} refused")
        self.ledger.admitted(job)

    def _push_continuations(self, clock: Callable[[], object]) -> None:
        """Each session's next continuation job, once it holds none queued beside the one in flight (the Tracker
        keeps one ahead)."""
        d = self.digests["decode"]
        for sid in self.sessions:
            if self.sched.is_awaiting(sid) or self._queued(sid) < 1:
                at = self.next_at[sid]
                self._admit(StepJob(job_id=f"{sid}-c{at}", session_id=sid, phase="decode", compat=d,
                                    start_position=at, tokens=(), n=self.decode_n, created_at=0.0,
                                    reply_to="bench-t"))
                self.next_at[sid] = at + self.decode_n

    def _queued(self, sid: str) -> int:
        lane = self.sched._lanes.get(sid)  # a bench's look inside: jobs queued behind the one in flight
        return 0 if lane is None else len(lane.jobs) - (1 if lane.jobs and lane.jobs[0].consumed else 0)

    def call(self) -> int:
        """One chained call's stages, timed; its rows."""
        t = self.times
        batch = self.batch
        c0 = time.perf_counter()
        successor = self.sched.successor(batch, plain)
        c1 = time.perf_counter()
        if successor is None:
            raise RuntimeError("the steady state has no successor")
        raw = self._logits(batch.fused.n_logit_rows)
        c2 = time.perf_counter()
        out = raw.with_top()
        c3 = time.perf_counter()
        assert out.top is not None
        if not successor.fill(out.top):
            raise RuntimeError("a successor refused its tokens")
        c4 = time.perf_counter()
        sampled = self.sampler.sample(batch, out)
        c5 = time.perf_counter()
        answers: list[Answer] = apply_sampled(self.sched, batch, sampled, 0.002)
        c6 = time.perf_counter()
        adopted = self.sched.adopt(successor)
        c7 = time.perf_counter()
        latencies: list[tuple[Phase, float]] = []
        done = self.ledger.completions(answers + adopted.answers, latencies)
        c8 = time.perf_counter()
        stats = FusedCallStats(phase="decode", batch_size=len(batch.session_ids), tokens=len(batch.fused),
                               engine_seconds=0.002)
        observe_iteration(self.metrics, "bench", stats, done, (), latencies, len(self.sessions))
        c9 = time.perf_counter()
        encode_filing(Filing(answers=done, call=stats), self.keys, FILING_HEAD, worker_id="bench",
                      call_id=f"1:{self.jobs}", consumer_name="bench")
        c10 = time.perf_counter()
        self._push_continuations(time.perf_counter)
        c11 = time.perf_counter()
        for name, dt in zip(STAGES, (c3 - c2, c4 - c3, c5 - c4, c6 - c5, c7 - c6, c1 - c0, c8 - c7, c9 - c8,
                                     c10 - c9, c11 - c10), strict=True):
            t[name].append(dt)
        if adopted.batch is None or len(adopted.rows) != len(batch.fused):
            raise RuntimeError("a row was dropped in the steady state")
        self.batch = adopted.batch
        return len(batch.fused)


def measure(n: int, calls: int, decode_n: int = 16) -> dict[str, Any]:
    run = SteadyDecode(n, decode_n, calls)
    for _ in range(calls):
        run.call()
    per_call = {s: statistics.median(v) * 1e6 for s, v in run.times.items()}
    # the admissions come every decode_n calls: their mean, not their median (which is 0 most calls)
    per_call["admit"] = statistics.fmean(run.times["admit"]) * 1e6
    total = sum(per_call.values())
    return {"rows": n, "calls": calls, "decode_n": decode_n, "us_per_call": per_call, "total_us_per_call": total,
            "us_per_row": {s: v / n for s, v in per_call.items()}, "total_us_per_row": total / n}


def run(out: Path, rows: tuple[int, ...] = (8, 64, 256), calls: int = 96, decode_n: int = 16) -> list[dict[str, Any]]:
    results = [measure(n, calls, decode_n) for n in rows]
    cols = ["stage", *[f"{r['rows']} rows µs/call" for r in results], *[f"{r['rows']} rows µs/row" for r in results]]
    body = [[s, *[r["us_per_call"][s] for r in results], *[r["us_per_row"][s] for r in results]] for s in STAGES]
    body.append(["total", *[r["total_us_per_call"] for r in results], *[r["total_us_per_row"] for r in results]])
    console.print(table(f"The worker's Python per decode call, stage by stage (chained steady state, continuation "
                        f"jobs of {decode_n}; medians of {calls} calls, admit: mean)", cols, body))
    save(out, NAME, {"results": results})
    return results
