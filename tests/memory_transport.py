"""An in-memory Transport (consumer/transport/protocol.py) for worker unit tests: no Redis, no wire.

Jobs are pushed as decoded StepJobs (or as refusals, standing in for entries the wire refused); what
the worker files comes back in `answers`, `dead` and `calls`. A job id's first answer is the one that
counts, as with the completion script.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from consumer.sched.outputs import Answer
from consumer.transport.protocol import Closure, DeadLetter, Delivery, FusedCallStats, Inbound, Refusal
from schemas import CompatibilityKey, Phase, StepJob, WorkerKeys


class MemoryTransport:
    def __init__(self, worker_id: str = "worker-0") -> None:
        self.worker_id = worker_id  # names the activation keys as a Redis transport of this worker would
        self.digests: dict[Phase, str] = {}
        self.queues: dict[Phase, deque[Inbound]] = {"decode": deque(), "prefill": deque()}
        self.answers: list[Answer] = []
        self.dead: list[DeadLetter] = []
        self.calls: list[FusedCallStats] = []
        self.closed: list[tuple[str, str]] = []
        self.acked: list[Delivery] = []  # deliveries acked without an answer (answered by an earlier process)
        self.cancel_markers: set[str] = set()
        self.pending_cancels: list[str] = []
        self.answered: set[str] = set()
        self.blobs: dict[str, bytes] = {}  # activations blobs (input: the test writes them; output: complete())
        self.round_trips = 0
        self.outages = 0
        self._n = 0

    # ---- the test's side ----------------------------------------------------------------------
    def push(self, job: StepJob, phase: Phase | None = None) -> Delivery:
        """Queue a job on its phase (or another phase's queue, as a misrouted entry would arrive)."""
        return self._push(phase or job.phase, job, None)

    def push_refused(self, phase: Phase, refusal: Refusal) -> Delivery:
        return self._push(phase, None, refusal)

    def cancel(self, session_id: str) -> None:
        self.cancel_markers.add(session_id)
        self.pending_cancels.append(session_id)

    def _push(self, phase: Phase, job: StepJob | None, refusal: Refusal | None) -> Delivery:
        self._n += 1
        d = Delivery(stream=f"mem:{phase}", entry_id=str(self._n), fields={}, digest=self.digests[phase], phase=phase)
        self.queues[phase].append(Inbound(d, phase, d.digest, f"{phase}.{self._n}", job, refusal))
        return d

    # ---- the Transport ------------------------------------------------------------------------
    def acquire_lease(self, *, wait: bool = True, stop: Callable[[], bool] | None = None) -> str:
        return "1:mem"

    def renew_lease(self) -> None:
        pass

    def release_lease(self) -> None:
        pass

    def register(self, keys: Sequence[CompatibilityKey], info: Mapping[str, object]) -> Sequence[str]:
        for k in keys:
            self.digests[k.phase] = k.digest
        return [f"mem:{k.phase}" for k in keys]

    def heartbeat(self, info: Mapping[str, object] | None = None) -> None:
        pass

    def read(self, want: Mapping[Phase, int], *, block_ms: int | None = None, gather_ms: float | None = None,
             more: Callable[[Mapping[Phase, int]], bool] | None = None) -> list[Inbound]:
        self.round_trips += 1
        out: list[Inbound] = []
        for phase, n in want.items():
            q = self.queues[phase]
            for _ in range(min(n, len(q))):
                out.append(q.popleft())
        return out

    def recover(self) -> tuple[list[Inbound], list[DeadLetter]]:
        return [], []

    def checks(self, openings: Sequence[StepJob], session_ids: Sequence[str]) -> tuple[set[str], set[str]]:
        self.round_trips += 1
        return ({j.job_id for j in openings if j.job_id in self.answered},
                {s for s in session_ids if s in self.cancel_markers})

    def activation_key(self, direction: Literal["in", "out"], job_id: str) -> str:
        keys = WorkerKeys(self.worker_id)
        return keys.activations_in(job_id) if direction == "in" else keys.activations_out(job_id)

    def fetch_activations(self, blobs: Sequence[str]) -> list[bytes | None]:
        self.round_trips += 1
        return [self.blobs.get(b) for b in blobs]

    def cancellations(self) -> tuple[list[str], list[DeadLetter]]:
        out, self.pending_cancels = self.pending_cancels, []
        return out, []

    def complete(self, answers: Sequence[Answer], dead_letters: Sequence[DeadLetter] = (),
                 call: FusedCallStats | None = None, *, closures: Sequence[Closure] = (),
                 acks: Sequence[Delivery] = ()) -> list[bool]:
        self.round_trips += 1
        self.closed.extend((c.session_id, c.kind) for c in closures)
        self.acked.extend(acks)
        first: list[bool] = []
        for a in answers:
            fresh = a.result.job_id not in self.answered
            first.append(fresh)
            self.answered.add(a.result.job_id)
            self.answers.append(a)
            if a.job is not None and a.job.hidden is not None and a.job.hidden.blob is not None:
                self.blobs.pop(a.job.hidden.blob, None)  # the job is answered: its input rows are dropped
            if fresh and a.blob is not None and a.result.hidden is not None and a.result.hidden.blob:
                self.blobs[a.result.hidden.blob] = a.blob
        self.dead.extend(dead_letters)
        if call is not None:
            self.calls.append(call)
        return first

    def input_lag(self) -> dict[str, dict[str, int]]:
        return {f"mem:{p}": {"length": len(q), "lag": len(q), "pending": 0} for p, q in self.queues.items()}

    def trim(self) -> None:
        pass
