"""Exactly one real answer per step: the worker's memory of the jobs it holds and answered.

A job delivered again while the worker still holds it (queued or in a call: a producer retry,
`open()` twice, a re-push after an outage) is held as a *twin* and completed with the original's answer;
one delivered again after it was answered gets the same answers re-sent (the completion script publishes
each answer once, so a re-send shows only when Redis lost the first). A twin is the same job, not only
the same id (`same_job`: session, hop, phase, position, attempt, n, tokens, sampling, reply stream,
spec, activations): job ids are deterministic, so anyone who may write the input streams can write
another job under a session's next id. Such a delivery is refused `job_id_conflict`, answered to the
stream it named and charged to nobody, and changes nothing of the job that holds the id. The check
costs nothing per delivery: the held job is kept by reference and compared only when an id repeats.

A step of a session this worker does not hold is checked first against Redis (one round trip per read
that has any: `Transport.checks`): an opening already answered by an earlier process is acked, no ghost
session; a cancel marker is answered CANCELLED without taking a slot (not state_lost: a cancelled session
is not replayed).

Continuation jobs (StepJob.n > 1): a token that is not the job's last is published without acking the
job's entry (`Answer.final` False): the entry stays pending until the job ends, so a worker that dies
mid-job leaves it to be redelivered and answered state_lost by its successor. A twin delivered while a
continuation runs re-sends the tokens published so far (acking nothing): the producer pushes a job again
when Redis lost results, and a lost token must not wait for a job that never re-sends it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from msgspec.structs import replace

from schemas import Phase, Reason, Status, StepJob
from schemas.step import end_job_id, result_job_id

from ..sched import Answer, Outcome, Scheduler
from ..transport.protocol import Delivery, Inbound
from .hop_steps import HopSteps

__all__ = ["DeliveryLedger", "acking", "without_ack"]


def without_ack(a: Answer) -> Answer:
    """The answer published with its result but acking no entry (a continuation's non-final token)."""
    return a if not a.final else replace(a, final=False)


def acking(a: Answer, ref: object) -> Answer:
    """A remembered answer re-sent for a new delivery of its job: it acks that delivery."""
    return replace(a, ref=ref, final=True)


class DeliveryLedger:
    """What the worker holds and answered, by job id. Only the loop thread touches it."""

    def __init__(self, scheduler: Scheduler, hops: HopSteps, answered_memory: int) -> None:
        self.scheduler = scheduler
        self.hops = hops
        self.answered_memory = answered_memory
        # job id -> the job admitted under it, while queued or in a call
        self.held: dict[str, StepJob] = {}
        # job id -> more deliveries of it while held (with their created_at, for the latency metric)
        self.twins: dict[str, list[tuple[Delivery, float]]] = {}
        self.answered: OrderedDict[str, Answer] = OrderedDict()  # result id -> its answer (LRU)
        self.precheck: tuple[set[str], set[str]] = (set(), set())  # (answered steps, cancelled sessions)

    def steps_to_check(self, inbound: Sequence[Inbound]) -> tuple[list[StepJob], list[str]]:
        """The steps of sessions this worker does not hold: (those steps, their session ids), to ask the
        transport about in one round trip (`Transport.checks`): an earlier process may have answered
        them (a Tracker re-pushes what it has not read after an outage), and a session's cancel may wait."""
        jobs: list[StepJob] = []
        sids: list[str] = []
        table = self.scheduler.table
        for inb in inbound:
            job = inb.job
            if job is None:
                continue  # not a job: admission answers it
            jid, sid = job.job_id, job.session_id
            if jid in self.held or jid in self.answered or table.get(sid) is not None:
                continue
            jobs.append(job)
            sids.append(sid)
        return jobs, sids

    def duplicate(self, job: StepJob, inb: Inbound, out: list[Answer], acks: list[Delivery]) -> bool:
        """Handle a delivery of a job id seen before (or answered by an earlier process, or of a
        session cancelled before it opened). True when the job must not reach the scheduler."""
        jid = job.job_id
        held = self.held.get(jid)
        if held is not None:
            if not same_job(held, job):
                out.append(self.conflict(job, inb.ref))
                return True
            self.twins.setdefault(jid, []).append((inb.ref, job.created_at))
            if job.n > 1:
                out.extend(without_ack(replace(a, ref=inb.ref)) for a in self.remembered(job))
            return True
        done = self.remembered(job)
        if done and done[0].job is not None and not same_job(done[0].job, job):
            out.append(self.conflict(job, inb.ref))
            return True
        if done:  # answered: re-send the same answers (no-op unless Redis lost them), the last one acks
            out.extend(without_ack(replace(a, ref=inb.ref)) for a in done[:-1])
            out.append(acking(done[-1], inb.ref))
            return True
        answered, cancelled = self.precheck
        if jid in answered:  # answered by an earlier process (its published answers stand): ack this one, so
            # neither a ghost session opens nor a second answer (state_lost) is published for the job
            acks.append(inb.ref)
            return True
        table = self.scheduler.table
        if job.session_id in cancelled and table.get(job.session_id) is None and table.closed(job.session_id) is None:
            out.append(self.remember(self.scheduler.refuse_cancelled(job, inb.ref)))
            return True
        return False

    def conflict(self, job: StepJob, ref: object) -> Answer:
        """A delivery under the id of another job held or answered: REJECTED job_id_conflict to the stream
        it names, under its own result id, with no billing account (it charges no session nor account)
        and no close (the session holding the id goes on). Not remembered: the id's answers stay the
        other job's."""
        a = self.scheduler.refuse(job, ref, Reason.JOB_ID_CONFLICT,
                                  "another job was received under this job id (docs/security.md)")
        return replace(a, account_id=None, close=None)

    def remembered(self, job: StepJob) -> list[Answer]:
        """The answers this worker remembers for the job, in offset order. A continuation job (n > 1) has
        one per token and maybe an ending one: a redelivery after it ended (the producer re-pushes it when
        Redis lost some of its results) re-sends them all, so every lost one is published again."""
        jid = job.job_id
        ids = [jid] if job.n == 1 else [result_job_id(jid, 0), *[f"{jid}.{k}" for k in range(1, job.n)],
                                         end_job_id(jid)]  # result_job_id's ids, inline: asked of every job read
        answered = self.answered
        if answered.keys().isdisjoint(ids):  # a new job, the usual case: one pass in C
            return []
        out: list[Answer] = []
        for rid in ids:
            a = self.answered.get(rid)
            if a is not None:
                self.answered.move_to_end(rid)
                out.append(a)
        return out

    def admitted(self, job: StepJob) -> None:
        self.held[job.job_id] = job

    def completions(self, answers: Sequence[Answer], latencies: list[tuple[Phase, float]]) -> list[Answer]:
        """Every answer (through the hop's output rows), plus one per twin delivery of its job (same
        result); the step latency of every OK one is added to `latencies`."""
        out: list[Answer] = []
        now = time.time()
        remember = self.remember
        finish = None if self.hops.idle else self.hops.finish  # nothing below adds rows for it to finish
        ok_status = Status.OK  # read once: an enum's member read from its class costs a lookup through the metaclass
        for a in answers:
            a = remember(a if finish is None else finish(a))
            out.append(a)
            job = a.job
            if job is None:
                continue
            ok = a.result.status == ok_status
            if ok and job.created_at and a.result.job_id == job.job_id:  # a continuation's first token only
                latencies.append((job.phase, max(0.0, now - job.created_at)))
            if not a.final:  # a continuation goes on: still held, its twins acked with its last answer
                continue
            self.held.pop(job.job_id, None)
            for twin, created_at in self.twins.pop(job.job_id, ()):
                out.append(replace(a, ref=twin))
                if ok and created_at:
                    latencies.append((job.phase, max(0.0, now - created_at)))
        return out

    def remember(self, a: Answer) -> Answer:
        """Keep the answer by result id (bounded LRU), for a re-send to a later delivery of its job: without a
        hop's output rows (the first completion wrote them) nor its delivery (the entry's fields: a prompt chunk's
        tokens), except a continuation's token: its delivery is the job's one entry, shared by its n answers, and
        a re-send names its own delivery anyway (`acking`; the re-sent earlier tokens replace it), so it is kept
        as it is: a copy per token cost more than the rest of this."""
        rid = a.result.job_id
        answered = self.answered
        if rid in answered:
            answered.move_to_end(rid)
        job = a.job
        answered[rid] = a if a.blob is None and job is not None and job.n > 1 else Answer(
            None, job, a.result, a.account_id, a.close, None, a.final, a.reply)
        if len(answered) > self.answered_memory:
            answered.popitem(last=False)
        return a


def same_job(a: StepJob, b: StepJob) -> bool:
    """Whether two deliveries under one job id are the same job (a twin), whatever their `created_at`
    (a producer's `open()` twice builds its jobs again). Fields compared cheapest first; the spec and
    the activations header only when the rest agree (an opening's twin)."""
    return (a.session_id == b.session_id and a.start_position == b.start_position and a.attempt == b.attempt
            and a.n == b.n and a.phase == b.phase and a.hop == b.hop and a.tokens == b.tokens
            and a.reply_to == b.reply_to and a.sample == b.sample and a.compat == b.compat
            and a.session == b.session and a.hidden == b.hidden)


def wire_reject_outcome(inb: Inbound, position: int) -> Outcome:
    """The outcome of an undecodable entry that names its session: REJECTED with the entry's reason,
    under its job id, or under `<phase>.<entry id>` when the job id itself is not valid."""
    refusal = inb.refusal
    assert refusal is not None and refusal.session_id is not None
    return Outcome(refusal.job_id or inb.name, refusal.session_id, Status.REJECTED, refusal.reason or Reason.MALFORMED,
                   position, refusal.detail[:256])
