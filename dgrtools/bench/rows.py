"""`dgr bench rows`: the worker's Python per decode row, stage by stage (issue 32, item 2: "the per-session Python
that is left is measured and named").

The steady state of `wire_cost.py`'s decode: N sessions on continuation jobs of `decode_n` tokens (the Tracker's
default: 16), every row plain greedy, each call chained after the one before. One call's stages, in the order the
worker runs them, on the real objects and nothing else in the process (no Redis, no engine: fake logits of the
sleep engine's vocabulary), timed one by one over many calls:

- `rank`: the sampler's first cut after the forward pass (sampling.stage.first_cut on the batch the engine thread
  ran: the successor's, as worker/chain.py runs it);
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
figure that falls as N grows; one that is per row stays flat. Beside the times, each stage's Python opcodes per
row over a few more calls (`sys.settrace` with opcode events; numpy's and msgspec's C work is not counted): the
same count on any machine and in any run. It does not weigh what C does per row: a pass of `map(attrgetter(...))`
over a call's answers counts no opcode a row and ran slower than the Python loop it replaced (docs/benchmarks.md,
issue 32, a sixth session), so a change is judged by its time against the code before, both in one process.
"""

from __future__ import annotations

import gc
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any, TypeVar

import numpy as np

from consumer.batch import EngineCapacity, EngineOutput
from consumer.metrics import Metrics
from consumer.sampling import BatchSampler
from consumer.sampling.stage import first_cut, plain
from consumer.sched import Answer, ScheduledBatch, Scheduler, SchedulerConfig
from consumer.transport.protocol import Delivery, Filing, FusedCallStats
from consumer.transport.publish import encode_filing
from consumer.worker import observe
from consumer.worker.delivery import DeliveryLedger
from consumer.worker.hop_steps import HopSteps
from consumer.worker.observe import observe_iteration
from consumer.worker.sampled import apply_sampled
from schemas import PHASES, Phase, RouteHop, SessionSpec, StepJob, WorkerKeys

from .common import console, save, table
from .scheduler import FILING_HEAD, VOCAB, _key

T = TypeVar("T")
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
        self._push(self.sessions)  # the first continuation goes with the opening (the ramp)
        out = self._logits(batch.fused.n_logit_rows)
        apply_sampled(self.sched, batch, self.sampler.sample(batch, out), 0.001)
        self._push(self.sessions)  # and the second once the first token is back
        nxt = self.sched.next_batch()
        assert nxt is not None and nxt.phase == "decode" and len(nxt.fused) == n, "not every session decodes"
        self.batch: ScheduledBatch = nxt
        self.link = nxt  # the batch the engine thread runs for it (a chained call's: the successor's)
        self.times: dict[str, list[float]] = {s: [] for s in STAGES}
        self.count = False  # count each stage's Python opcodes rather than time it

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

    def _push(self, sessions: Iterable[str]) -> None:
        """These sessions' next continuation jobs, as the Tracker pushes them: one queued ahead of the one in
        flight, sent when that one's first token comes back (producer/steps.py keeps one job of credit ahead)."""
        d = self.digests["decode"]
        for sid in sessions:
            at = self.next_at[sid]
            self._admit(StepJob(job_id=f"{sid}-c{at}", session_id=sid, phase="decode", compat=d, start_position=at,
                                tokens=(), n=self.decode_n, created_at=0.0, reply_to="bench-t"))
            self.next_at[sid] = at + self.decode_n

    def _stage(self, name: str, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args), its time (or, counting, the Python opcodes it ran) added to the stage's figures."""
        if not self.count:
            t = time.perf_counter()
            out = fn(*args)
            self.times[name].append(time.perf_counter() - t)
            return out
        before = _Opcodes.n
        sys.settrace(_Opcodes.trace)
        try:
            out = fn(*args)
        finally:
            sys.settrace(None)
        self.times[name].append(_Opcodes.n - before)
        return out

    def call(self) -> int:
        """One chained call's stages, each timed (or counted); its rows."""
        batch, stage = self.batch, self._stage
        successor = stage("successor", self.sched.successor, batch, plain)
        if successor is None:
            raise RuntimeError("the steady state has no successor")
        out = stage("rank", first_cut, self._logits(batch.fused.n_logit_rows), self.link)
        assert out.top is not None
        if not stage("fill", successor.fill, out.top):
            raise RuntimeError("a successor refused its tokens")
        sampled = stage("sample", self.sampler.sample, batch, out)
        answers: list[Answer] = stage("report", apply_sampled, self.sched, batch, sampled, 0.002)
        adopted = stage("adopt", self.sched.adopt, successor)
        latencies: list[tuple[Phase, float]] = []
        done = stage("ledger", self.ledger.completions, answers + adopted.answers, latencies)
        stats = FusedCallStats(phase="decode", batch_size=len(batch.session_ids), tokens=len(batch.fused),
                               engine_seconds=0.002)
        stage("metrics", observe_iteration, self.metrics, "bench", stats, done, (), latencies, len(self.sessions))
        stage("file", partial(encode_filing, worker_id="bench", call_id=f"1:{self.jobs}", consumer_name="bench"),
              Filing(answers=done, call=stats), self.keys, FILING_HEAD)
        firsts = [a.result.session_id for a in done if a.job is not None and a.result.job_id is a.job.job_id]
        stage("admit", self._push, firsts)
        if adopted.batch is None or len(adopted.rows) != len(batch.fused):
            raise RuntimeError("a row was dropped in the steady state")
        self.batch, self.link = adopted.batch, successor.batch
        return len(batch.fused)


class _Opcodes:
    """Python opcodes run while a stage is traced (sys.settrace with f_trace_opcodes): the same count on any
    machine and in any run, where a time is not (numpy's and msgspec's C work is not counted)."""

    n = 0

    @staticmethod
    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            _Opcodes.n += 1
        return _Opcodes.trace


def measure(n: int, calls: int, decode_n: int = 16, counted: int = 0) -> dict[str, Any]:
    """Stage medians over `calls` timed calls (the admissions: their mean, as they come every decode_n calls), and
    the Python opcodes per row of each stage, means over `counted` more calls (0: not counted)."""
    run = SteadyDecode(n, decode_n, calls + counted)
    for _ in range(calls):
        run.call()
    per_call = {s: statistics.median(v) * 1e6 for s, v in run.times.items()}
    per_call["admit"] = statistics.fmean(run.times["admit"]) * 1e6
    total = sum(per_call.values())
    out = {"rows": n, "calls": calls, "decode_n": decode_n, "us_per_call": per_call, "total_us_per_call": total,
           "us_per_row": {s: v / n for s, v in per_call.items()}, "total_us_per_row": total / n}
    if counted:
        run.times, run.count = {s: [] for s in STAGES}, True
        # the metrics' histograms search their buckets by the value: a clock of 2 ms a call while counting, so that
        # the count does not depend on the host's speed
        clock = SimpleNamespace(time=itertools.count(1e9, 0.002).__next__)
        real, observe.time = observe.time, clock  # type: ignore[assignment]
        gc.collect()  # nor on the garbage earlier work left: a collection runs finalizers' Python in a stage
        gc.disable()
        try:
            for _ in range(counted):
                run.call()
        finally:
            observe.time = real
            gc.enable()
        ops = {s: statistics.fmean(v) / n for s, v in run.times.items()}
        out |= {"counted": counted, "opcodes_per_row": ops, "total_opcodes_per_row": sum(ops.values())}
    return out


def run(out: Path, rows: tuple[int, ...] = (8, 64, 256), calls: int = 96, decode_n: int = 16,
        counted: int = 16) -> list[dict[str, Any]]:
    results = [measure(n, calls, decode_n, counted) for n in rows]
    cols = ["stage", *[f"{r['rows']} rows µs/call" for r in results], *[f"{r['rows']} rows µs/row" for r in results],
            *([f"{r['rows']} rows opcodes/row" for r in results] if counted else [])]
    body = [[s, *[r["us_per_call"][s] for r in results], *[r["us_per_row"][s] for r in results],
             *([r["opcodes_per_row"][s] for r in results] if counted else [])] for s in STAGES]
    body.append(["total", *[r["total_us_per_call"] for r in results], *[r["total_us_per_row"] for r in results],
                 *([r["total_opcodes_per_row"] for r in results] if counted else [])])
    console.print(table(f"The worker's Python per decode call, stage by stage (chained steady state, continuation "
                        f"jobs of {decode_n}; medians of {calls} calls, admit: mean)", cols, body))
    save(out, NAME, {"results": results})
    return results
