"""Plain counters of the worker loop that the benchmarks read (the Prometheus metrics carry the same,
labelled)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from schemas import PHASES, Phase

__all__ = ["LoopStats"]


@dataclass
class LoopStats:
    fused_calls: int = 0
    sessions_in_calls: int = 0
    calls_by_phase: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    engine_seconds: float = 0.0
    overhead_seconds: float = 0.0  # loop time outside the engine and outside its own reads, on iterations with a call
    read_seconds: float = 0.0  # time in reads (blocking, gathering: mostly waiting for producers; prefetched ones too)
    round_trips: int = 0
    decode_sessions: int = 0  # sessions summed over decode calls (mean decode batch = this / decode calls)
    reads: int = 0  # reads the loop made itself (a burst read past in one iteration counts each read)
    refused: int = 0  # entries answered or dead-lettered at admission without being queued
    early_held: int = 0  # continuation jobs read before their session's prompt and held for it (early.py)
    early_expired: int = 0  # of those, admitted unreleased after early_hold_s (their prompt never came)
    sessions_idle_cancelled: int = 0
    # The critical path (issue 32): from a fused call's end on the engine thread to the start of the next one, when
    # the loop started that one right after taking the first (work was ready): the engine idle on the worker.
    engine_gaps: int = 0
    engine_gap_seconds: float = 0.0
    # Fused calls by where the iteration ran them (Worker._mode): on the engine thread (overlap, short calls), in
    # the loop's thread with the Redis round trips on the I/O thread (long calls), or everything in order: what a
    # process was told (--overlap-max-call-ms, --no-overlap-io) is seen from outside in its heartbeat; `chained`:
    # started by the engine thread itself right after the call before (worker/chain.py).
    calls_by_iteration: dict[str, int] = field(
        default_factory=lambda: {"engine_thread": 0, "loop_thread": 0, "in_order": 0, "chained": 0})
    recent_calls: deque[tuple[Phase, int]] = field(default_factory=lambda: deque(maxlen=4096))  # (phase, sessions)

    def count_call(self, phase: Phase, sessions: int, seconds: float) -> None:
        self.fused_calls += 1
        self.sessions_in_calls += sessions
        self.calls_by_phase[phase] += 1
        self.recent_calls.append((phase, sessions))
        if phase == "decode":
            self.decode_sessions += sessions
        self.engine_seconds += seconds

    def snapshot(self) -> dict[str, object]:
        return {"fused_calls": self.fused_calls, "sessions_in_calls": self.sessions_in_calls,
                "calls_by_phase": dict(self.calls_by_phase), "engine_seconds": self.engine_seconds,
                "overhead_seconds": self.overhead_seconds, "read_seconds": self.read_seconds,
                "round_trips": self.round_trips,
                "decode_sessions": self.decode_sessions, "reads": self.reads, "refused": self.refused,
                "early_held": self.early_held, "early_expired": self.early_expired,
                "sessions_idle_cancelled": self.sessions_idle_cancelled,
                "engine_gaps": self.engine_gaps, "engine_gap_seconds": self.engine_gap_seconds,
                "calls_by_iteration": dict(self.calls_by_iteration)}

    @property
    def mean_batch(self) -> float:
        return self.sessions_in_calls / self.fused_calls if self.fused_calls else 0.0
