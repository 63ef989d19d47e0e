"""`dgr bench pacing`: how prefill pacing trades the decoders' inter-token gaps against time to first token,
on a virtual clock: the real Scheduler and PrefillPacer, an engine that costs what a cost model says.

No engine, no Redis, no wall clock: every call advances the clock by `prefill_fixed + prefill_token * rows`
(prefill) or `decode_fixed + decode_row * rows` (decode), the defaults measured on Gemma 3 270M here
(docs/benchmarks.md, issue 32). The producer answers at once: a session's next decode step is admitted as
soon as its token is known. So what differs between policies is only the scheduling.

Policies: `paced` is the worker's (consumer/sched/pacing.py); the others are what-ifs sized here, each held to
the configured budget while sessions decode (the decode bound of consumer/sched/scheduler.py):
- `fixed`: the whole budget in every prefill call;
- `scaled`: the pacing ratio times max(1, waiting / decoding sessions);
- `share`: prefill's share of time = waiting / (waiting + decoding sessions) under the 4:1 weights.

Workloads: a wave of N prompts of L tokens at once (T tokens each), the same prompts arriving every 0.5 s, and
`interference` (4 decoders of 96 tokens while one 2,000-token prompt is always waiting: `dgr bench
interference`'s shape). Per run: the last first token against the raw engine's time for the same prompts
(all prompt tokens at the prefill rate in 2,048-row calls), median time to first token, wall, and the
decoders' p99 inter-token gap.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from consumer.batch import EngineCapacity
from consumer.sched import PrefillPacer, ScheduledBatch, Scheduler, SchedulerConfig
from schemas import PHASES, Phase, RouteHop, SessionSpec, StepJob

from .common import console, markdown, save, table
from .scheduler import _key

__all__ = ["POLICIES", "CostModel", "Run", "run", "simulate"]

BUDGET, BURST, FLOOR = 512, 2048, 32


@dataclass(frozen=True)
class CostModel:
    prefill_fixed: float = 0.010
    prefill_token: float = 0.0019
    decode_fixed: float = 0.025
    decode_row: float = 0.004

    def seconds(self, batch: ScheduledBatch) -> float:
        n = len(batch.fused)
        if batch.phase == "prefill":
            return self.prefill_fixed + self.prefill_token * n
        return self.decode_fixed + self.decode_row * n

    def raw_prefill(self, tokens: int) -> float:
        return tokens * self.prefill_token + self.prefill_fixed * math.ceil(tokens / BURST)


def _paced(p: PrefillPacer, waiting: int, decoding: int) -> int:
    return p.budget(decoding > 0)


def _sized(ratio: Callable[[PrefillPacer, int, int], float]) -> Callable[[PrefillPacer, int, int], int]:
    def budget(p: PrefillPacer, waiting: int, decoding: int) -> int:
        if decoding == 0 or p.decode_s is None or p.prefill_s_per_token is None:
            return p.budget(decoding > 0)
        tokens = int(ratio(p, waiting, decoding) * p.decode_s / p.prefill_s_per_token)
        return max(FLOOR, min(BUDGET, tokens))
    return budget


POLICIES: dict[str, Callable[[PrefillPacer, int, int], int]] = {
    "paced": _paced,
    "fixed": lambda p, w, d: p.budget(False) if d == 0 else BUDGET,
    "scaled": _sized(lambda p, w, d: p.ratio * max(1.0, w / d)),
    "share": _sized(lambda p, w, d: max(p.ratio, 4.0 * w / d)),
}


@dataclass
class Run:
    """Per session: arrival, then the virtual time of each token."""

    times: dict[str, list[float]]
    calls: dict[Phase, int]

    def summary(self, decoders: Sequence[str], prompts: Sequence[str], cost: CostModel,
                wave_tokens: int | None) -> dict[str, float]:
        """`decoders`: whose inter-token gaps count; `prompts`: whose first tokens count; `wave_tokens`: the
        prompt tokens of a wave released at once (its last first token against the raw engine's)."""
        t = self.times
        gaps = [b - a for s in decoders for a, b in zip(t[s][1:], t[s][2:], strict=False)]
        done = [s for s in prompts if len(t[s]) > 1]
        last_first = max(t[s][1] for s in done)
        raw = cost.raw_prefill(wave_tokens) / last_first if wave_tokens else float("nan")
        return {"last_first_s": last_first, "raw_over_last_first": raw, "prompts": len(done),
                "median_ttft_s": statistics.median(t[s][1] - t[s][0] for s in done),
                "wall_s": max(t[s][-1] for s in t),
                "gap_p99_ms": 1e3 * float(np.percentile(gaps, 99)) if gaps else 0.0,
                "prefill_calls": self.calls["prefill"], "decode_calls": self.calls["decode"]}


def simulate(arrivals: Sequence[tuple[float, str, int, int]], policy: str, *, cost: CostModel = CostModel(),
             slots: int = 16, refill: str | None = None, refill_until: Callable[[Run], bool] | None = None) -> Run:
    """arrivals: (time, session, prompt tokens, max tokens). `refill`: a session-id prefix whose sessions are
    replaced by a new one of the same shape when they finish, while `refill_until(run)` is False."""
    keys = {p: _key(p) for p in PHASES}
    digests: dict[Phase, str] = {p: k.digest for p, k in keys.items()}
    sched = Scheduler(SchedulerConfig(capacity=EngineCapacity(n_slots=slots, ctx_per_session=4096,
                                                              max_tokens_per_call=BURST, vocab_size=16),
                                      prefill_budget=BUDGET), "sim", digests)
    pacer = PrefillPacer(max_tokens=BUDGET, idle_tokens=BURST, min_tokens=FLOOR)
    route = (RouteHop(worker_id="sim", key=keys["prefill"]),)
    out = Run(times={}, calls={"prefill": 0, "decode": 0})
    shape: dict[str, tuple[int, int]] = {}
    pending, clock, made = sorted(arrivals), 0.0, 0

    def admit(job: StepJob) -> None:
        if sched.admit(job, digests[job.phase], None) is not None:
            raise RuntimeError(f"{job.session_id}: refused")

    while True:
        while pending and pending[0][0] <= clock:
            at, sid, n, t = pending.pop(0)
            shape[sid], out.times[sid] = (n, t), [at]
            admit(StepJob(job_id=f"{sid}-open", session_id=sid, phase="prefill", compat=digests["prefill"],
                          start_position=0, tokens=(3,) * n, created_at=0.0,
                          session=SessionSpec(session_id=sid, account_id="sim", route=route, max_tokens=t)))
        decoding = sched.awaiting_decode() + sched.queued("decode")
        sched.set_prefill_budget(POLICIES[policy](pacer, sched.queued("prefill"), decoding))
        batch = sched.next_batch()
        if batch is None:
            if not pending:
                return out
            clock = pending[0][0]
            continue
        dt = cost.seconds(batch)
        clock += dt
        pacer.observe(batch.phase, len(batch.fused), dt)
        out.calls[batch.phase] += 1
        for answer in sched.update_from_output(batch, [7 for it in batch.items if it.samples], dt):
            r = answer.result
            if r.token is None:
                continue
            sid = r.session_id
            out.times[sid].append(clock)
            done = len(out.times[sid]) - 1
            if not r.finished:
                admit(StepJob(job_id=f"{sid}-{done}", session_id=sid, phase="decode", compat=digests["decode"],
                              start_position=shape[sid][0] + done - 1, tokens=(int(r.token),), created_at=0.0))
            elif refill and sid.startswith(refill) and not (refill_until and refill_until(out)):
                made += 1
                pending.append((clock, f"{refill}{made}", *shape[sid]))
        for slot in sched.drain_released():
            sched.slot_cleared(slot)


def workloads(sessions: int, prompt_len: int, tokens: int) -> dict[str, dict[str, Any]]:
    def decoders_done(r: Run) -> bool:
        return all(len(r.times[f"d{i}"]) > 96 for i in range(4))

    return {
        f"wave {sessions} x {prompt_len}": {"arrivals": [(0.0, f"p{i}", prompt_len, tokens) for i in range(sessions)]},
        f"every 0.5 s, {sessions} x {prompt_len}": {
            "arrivals": [(0.5 * i, f"p{i}", prompt_len, tokens) for i in range(sessions)]},
        "interference (4 decoders, 2,000-token prompts)": {
            "arrivals": [(0.0, f"d{i}", 8, 97) for i in range(4)] + [(0.5, "long0", 2000, 1)],
            "refill": "long", "refill_until": decoders_done, "measured": [f"d{i}" for i in range(4)]},
        # (interference: the gaps are the decoders', the times to first token the long prompts')
    }


def run(out_dir: Path, *, sessions: int = 8, prompt_len: int = 528, tokens: int = 16,
        policies: Sequence[str] = tuple(POLICIES), cost: CostModel = CostModel()) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for name, w in workloads(sessions, prompt_len, tokens).items():
        for policy in policies:
            r = simulate(w["arrivals"], policy, cost=cost, slots=max(16, sessions + 1), refill=w.get("refill"),
                         refill_until=w.get("refill_until"))
            everyone = [a[1] for a in w["arrivals"]]
            prefix = w.get("refill")
            prompts = [s for s in r.times if s.startswith(prefix)] if prefix else everyone
            wave = sum(a[2] for a in w["arrivals"]) if name.startswith("wave") else None
            rows.append({"workload": name, "policy": policy,
                         **r.summary(w.get("measured") or everyone, prompts, cost, wave)})
    cols = ["workload", "policy", "raw / last first", "prompts", "median TTFT s", "wall s", "p99 gap ms",
            "prefill calls", "decode calls"]
    data = [[r["workload"], r["policy"], r["raw_over_last_first"], r["prompts"], r["median_ttft_s"], r["wall_s"],
             r["gap_p99_ms"], r["prefill_calls"], r["decode_calls"]] for r in rows]
    console.print(table("prefill pacing on a virtual clock", cols, data, width=160))
    payload = {"bench": "pacing", "cost_model": cost.__dict__, "rows": rows, "markdown": markdown(cols, data)}
    save(out_dir, "pacing", payload)
    return payload
