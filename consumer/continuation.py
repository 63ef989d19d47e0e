"""Continuation jobs on the worker side: what the loop does differently for a job that asks for n > 1
tokens (schemas/step.py StepJob.n). The scheduler decides (consumer/scheduler.py: one offset per decode
call, one answer per token); this module holds the two delivery rules the worker applies to answers.

* A continuation's token that is not its last is published without acking the job's entry: the entry
  stays pending until the job ends (its last token, a stop, max_tokens, a cancellation, a failure). So a
  worker that dies mid-job leaves the entry to be redelivered, and its successor answers it state_lost
  (under the job's end id, schemas/step.py end_job_id), which makes the producer replay exactly.
* A delivery answered again from memory (a redelivered job already answered) is always acked.
"""

from __future__ import annotations

from dataclasses import replace

from .schedule_output import Answer
from .transport_protocol import Delivery

# XACK of this id acks nothing: no stream entry can have it (Redis refuses XADD with the id 0-0).
NO_ENTRY = "0-0"


def without_ack(a: Answer) -> Answer:
    """The answer published with its result but acking no entry (a continuation's non-final token)."""
    d = a.ref
    if a.final or not isinstance(d, Delivery):
        return a
    return replace(a, ref=replace(d, entry_id=NO_ENTRY))


def acking(a: Answer, ref: object) -> Answer:
    """A remembered answer re-sent for a new delivery of its job: it acks that delivery."""
    return replace(a, ref=ref, final=True)


__all__ = ["NO_ENTRY", "acking", "without_ack"]
