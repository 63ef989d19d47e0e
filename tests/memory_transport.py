"""An in-memory Transport (consumer/transport/protocol.py) for worker unit tests: no Redis, no wire.

Jobs are pushed as decoded StepJobs (or as refusals, standing in for entries the wire refused); what
the worker files comes back in `answers`, `dead` and `calls`. A job id's first answer is the one that
counts, as with the completion script.

One stream per registered key, as a Redis transport: `mem:<phase>` for the first key of each phase (a
worker of one engine), `mem:<digest>:<phase>` for the others (a worker of several engines, which reads
them with `read_streams`).

`checks` answers as the Redis transport's (consumer/transport/upkeep.py) from what `complete` filed, kept
as the completion script keeps it (consumer/lua/complete_*.lua, docs/accounting.md): per session with a
billing account its last ok answer published, (attempt, position), in its open tally entry (`tally`) or,
once closed, in its session hash (`hashes`, with how it closed), and the result ids answered not ok (their
`res:` markers, `markers`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from consumer.sched.outputs import Answer
from consumer.transport.protocol import DeadLetter, Delivery, Filing, FusedCallStats, Inbound, Refusal
from schemas import CompatibilityKey, Phase, Status, StepJob, WorkerKeys
from schemas.prefix import PrefixSummary

AttPub = tuple[int, int]  # (attempt, position) of a session's last ok answer published; (-1, -1): none yet


@dataclass(slots=True)
class SessionHash:
    """What `checks` reads of a session hash (`dgr:{W}:acct:session:<sid>`): its (att, pub), written when
    its tally entry is folded in, and `closed` (finished, cancelled, failed; None: not closed)."""

    last: AttPub
    closed: str | None = None


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
        self.answered: set[str] = set()  # every result id filed (the first filing of one is fresh)
        # What the completion script keeps and `checks` reads (see the module's docstring):
        self.tally: dict[str, AttPub] = {}  # open sessions with a billing account: the tally's (att, pub)
        self.hashes: dict[str, SessionHash] = {}  # sessions closed with a tally entry or answered since
        self.markers: set[str] = set()  # result ids answered not ok (`res:` markers)
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

    def recover(self) -> list[Inbound]:
        return []

    def checks(self, steps: Sequence[StepJob], session_ids: Sequence[str]) -> tuple[set[str], set[str]]:
        """As the Redis transport's (consumer/transport/upkeep.py `checks`): a step is answered when its
        session's last ok answer published (its tally entry's, else its session hash's) is at or past the
        step's last result position (its attempt, `end_position`), or at or past its first one when the
        session is closed (not cancelled) and has no tally entry (a continuation that finished early), or
        when its job id or a continuation job's ending answer was answered not ok (its marker)."""
        self.round_trips += 1
        answered: set[str] = set()
        for j in steps:
            led = self.tally.get(j.session_id)
            hashed = self.hashes.get(j.session_id)
            last = led if led is not None else hashed.last if hashed is not None else None
            first = j.start_position + 1 if j.phase == "decode" else j.end_position  # its first result's position
            closed_early = led is None and hashed is not None and hashed.closed not in (None, "cancelled")
            marked = j.job_id in self.markers or j.answer_id(0, ok=False) in self.markers
            if marked or (last is not None and (last >= (j.attempt, j.end_position)
                                                 or (closed_early and last >= (j.attempt, first)))):
                answered.add(j.job_id)
        return answered, {s for s in session_ids if s in self.cancel_markers}

    def activation_key(self, direction: Literal["in", "out"], job_id: str) -> str:
        keys = WorkerKeys(self.worker_id)
        return keys.activations_in(job_id) if direction == "in" else keys.activations_out(job_id)

    def fetch_activations(self, blobs: Sequence[str]) -> list[bytes | None]:
        self.round_trips += 1
        return [self.blobs.get(b) for b in blobs]

    def cancellations(self) -> tuple[list[str], list[DeadLetter]]:
        out, self.pending_cancels = self.pending_cancels, []
        return out, []

    def read_ahead(self, want: Mapping[str, int]) -> tuple[list[Delivery], list[str], list[DeadLetter]]:
        got = self.read_streams(want)
        return (got, *self.cancellations())

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
        self._account(filing)
        self.dead.extend(filing.dead_letters)
        if filing.call is not None:
            self.calls.append(filing.call)
        return first

    def _account(self, filing: Filing) -> None:
        """What the completion script writes that `checks` reads (consumer/lua/complete_tally.lua,
        complete_publish.lua, complete_close.lua), in its order: the rows, grouped by result stream as
        publish.py groups them, then the closures (the answers' own, then the filing's). Not modelled: the
        moved fence, gaps (a re-sent answer inside one is published but moves no (att, pub)), hashes the
        Tracker writes (a carried `hw`) and keys' expiry."""
        entries: dict[str, AttPub] = {}  # sessions this call touched or closes: L in the script
        late: set[str] = set()  # whose session hash is closed: their counts go straight into it
        dirty: set[str] = set()  # changed by a fresh row

        def entry(sid: str) -> AttPub:
            e = entries.get(sid)
            if e is None:
                h = self.hashes.get(sid)
                e = self.tally.get(sid) or (h.last if h is not None else (-1, -1))
                if sid not in self.tally and h is not None and h.closed is not None:
                    late.add(sid)
                entries[sid] = e
            return e

        streams: dict[str, list[Answer]] = {}
        for a in filing.answers:
            reply = a.reply or (a.job.reply if a.job is not None else a.result.session_id)
            streams.setdefault(reply, []).append(a)
        for rows in streams.values():
            for a in rows:
                o, sid = a.result, a.result.session_id
                e = entry(sid) if a.account_id else None
                if o.status == Status.OK:
                    at = (a.job.attempt if a.job is not None else 0, o.position)
                    if e is not None and at > e:
                        entries[sid] = at
                        dirty.add(sid)
                elif o.job_id not in self.markers:
                    self.markers.add(o.job_id)
                    if e is not None:
                        dirty.add(sid)
        closing: dict[str, str] = {}
        closures = [(a.result.session_id, a.close) for a in filing.answers if a.close is not None]
        for sid, kind in closures + [(c.session_id, c.kind) for c in filing.closures]:
            if sid in entries or sid in self.tally:
                entry(sid)
                closing[sid] = kind
            elif sid in self.hashes and self.hashes[sid].closed is None:
                self.hashes[sid].closed = kind  # HSETNX: nothing charged since it closed
        for sid, e in entries.items():
            if sid in closing or sid in late:
                if sid in dirty or sid in closing:
                    h = self.hashes.setdefault(sid, SessionHash(e))
                    h.last = e
                    if h.closed is None and sid in closing:
                        h.closed = closing[sid]
                self.tally.pop(sid, None)
            elif sid in dirty:
                self.tally[sid] = e

    def input_lag(self) -> dict[str, dict[str, int]]:
        return {s: {"length": len(q), "lag": len(q), "pending": 0} for s, q in self.queues.items()}

    def trim(self) -> None:
        pass
