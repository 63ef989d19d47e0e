"""An in-memory Transport (consumer/transport/protocol.py) for worker unit tests: no Redis, no wire.

Jobs are pushed as decoded StepJobs (or as refusals, standing in for entries the wire refused); what
the worker files comes back in `answers`, `dead` and `calls`. A job id's first answer is the one that
counts, as with the completion script.

One stream per registered key, as a Redis transport: `mem:<phase>` for the first key of each phase (a
worker of one engine), `mem:<digest>:<phase>` for the others (a worker of several engines, which reads
them with `read_streams`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from consumer.sched.outputs import Answer
from consumer.transport.protocol import DeadLetter, Delivery, Filing, FusedCallStats, Inbound, Refusal
from schemas import CompatibilityKey, Phase, StepJob, WorkerKeys
from schemas.prefix import PrefixSummary
from schemas.step import end_job_id, result_job_id


class MemoryTransport:
    def __init__(self, worker_id: str = "worker-0") -> None:
        self.worker_id = worker_id  # names the activation keys as a Redis transport of this worker would
        self.digests: dict[Phase, str] = {}  # the first key registered per phase
        self.streams: dict[tuple[str, Phase], str] = {}  # (digest, phase) -> stream name
        self.queues: dict[str, deque[Inbound]] = {"mem:decode": deque(), "mem:prefill": deque()}
        self._read: dict[tuple[str, str], Inbound] = {}  # (stream, entry id) -> the entry read, for inbound()
        self.answers: list[Answer] = []
        self.dead: list[DeadLetter] = []
        self.calls: list[FusedCallStats] = []
        self.closed: list[tuple[str, str]] = []
        self.acked: list[Delivery] = []  # deliveries acked without an answer (answered by an earlier process)
        self.cancel_markers: set[str] = set()
        self.pending_cancels: list[str] = []
        self.answered: set[str] = set()
        self.blobs: dict[str, bytes] = {}  # activations blobs (input: the test writes them; output: complete())
        self.info: dict[str, object] = {}  # what the worker registered or beat last
        self.round_trips = 0
        self.outages = 0
        self._n = 0

    # ---- the test's side ----------------------------------------------------------------------
    def push(self, job: StepJob, phase: Phase | None = None, digest: str | None = None) -> Delivery:
        """Queue a job on the stream of its key (its `compat` when registered, else the first key of the
        phase), or of another phase or key (`phase`, `digest`: as a misrouted entry would arrive)."""
        phase = phase or job.phase
        if digest is None:
            digest = job.compat if (job.compat, phase) in self.streams else self.digests[phase]
        return self._push(phase, job, None, digest)

    def push_refused(self, phase: Phase, refusal: Refusal, digest: str | None = None) -> Delivery:
        return self._push(phase, None, refusal, digest or self.digests[phase])

    def cancel(self, session_id: str) -> None:
        self.cancel_markers.add(session_id)
        self.pending_cancels.append(session_id)

    def _push(self, phase: Phase, job: StepJob | None, refusal: Refusal | None, digest: str) -> Delivery:
        self._n += 1
        stream = self.streams[(digest, phase)]
        d = Delivery(stream=stream, entry_id=str(self._n), fields={}, digest=digest, phase=phase)
        self.queues[stream].append(Inbound(d, phase, d.digest, f"{phase}.{self._n}", job, refusal))
        return d

    # ---- the Transport ------------------------------------------------------------------------
    def acquire_lease(self, *, wait: bool = True, stop: Callable[[], bool] | None = None) -> str:
        return "1:mem"

    def renew_lease(self) -> None:
        pass

    def release_lease(self) -> None:
        pass

    def register(self, keys: Sequence[CompatibilityKey], info: Mapping[str, object]) -> Sequence[str]:
        self.info = dict(info)
        names = []
        for k in keys:
            first = self.digests.setdefault(k.phase, k.digest) == k.digest
            name = f"mem:{k.phase}" if first else f"mem:{k.digest}:{k.phase}"
            name = self.streams.setdefault((k.digest, k.phase), name)
            self.queues.setdefault(name, deque())
            names.append(name)
        return names

    def heartbeat(self, info: Mapping[str, object] | None = None, summary: PrefixSummary | None = None) -> None:
        if info is not None:  # the summary as a Tracker reads it back (consumer/transport/upkeep.py)
            self.info = {**info, **({"prefix": summary.as_json()} if summary is not None else {})}

    def read(self, want: Mapping[Phase, int], *, block_ms: int | None = None, gather_ms: float | None = None,
             more: Callable[[Mapping[Phase, int]], bool] | None = None) -> list[Inbound]:
        ds = self.read_streams({self.streams[(self.digests[p], p)]: n for p, n in want.items() if p in self.digests})
        return [self.inbound(d) for d in ds]

    def read_streams(self, want: Mapping[str, int], *, block_ms: int | None = None, gather_ms: float | None = None,
                     more: Callable[[list[Delivery]], bool] | None = None) -> list[Delivery]:
        self.round_trips += 1
        out: list[Delivery] = []
        for stream, n in want.items():
            q = self.queues[stream]
            for _ in range(min(n, len(q))):
                inb = q.popleft()
                self._read[(stream, inb.ref.entry_id)] = inb
                out.append(inb.ref)
        return out

    def inbound(self, d: Delivery) -> Inbound:
        return self._read.pop((d.stream, d.entry_id))

    def recover(self) -> tuple[list[Inbound], list[DeadLetter]]:
        return [], []

    def checks(self, steps: Sequence[StepJob], session_ids: Sequence[str]) -> tuple[set[str], set[str]]:
        self.round_trips += 1
        # answered: every answer the step can have (its last token's, or its ending one), as the Redis
        # transport's checks find from the session's last published position
        done = self.answered
        return ({j.job_id for j in steps if (j.job_id if j.n == 1 else result_job_id(j.job_id, j.n - 1)) in done
                 or (j.n > 1 and end_job_id(j.job_id) in done)},
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

    def complete(self, filing: Filing) -> list[bool]:
        self.round_trips += 1
        self.closed.extend((c.session_id, c.kind) for c in filing.closures)
        self.acked.extend(filing.acks)
        first: list[bool] = []
        for a in filing.answers:
            fresh = a.result.job_id not in self.answered
            first.append(fresh)
            self.answered.add(a.result.job_id)
            self.answers.append(a)
            if a.job is not None and a.job.hidden is not None and a.job.hidden.blob is not None:
                self.blobs.pop(a.job.hidden.blob, None)  # the job is answered: its input rows are dropped
            if fresh and a.blob is not None and a.result.hidden is not None and a.result.hidden.blob:
                self.blobs[a.result.hidden.blob] = a.blob
        self.dead.extend(filing.dead_letters)
        if filing.call is not None:
            self.calls.append(filing.call)
        return first

    def input_lag(self) -> dict[str, dict[str, int]]:
        return {s: {"length": len(q), "lag": len(q), "pending": 0} for s, q in self.queues.items()}

    def trim(self) -> None:
        pass
