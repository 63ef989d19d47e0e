"""Recovery by ownership: entries to hand out again, in one script call for all input streams.

* the pending entries of every other consumer name of the group are claimed into this one (the lease
  holder is the only live consumer of this worker id);
* this consumer's own pending entries are never claimed by idle time; those the worker does not hold
  (handed out, not yet completed) are handed out again (`Intake.unheld_pending`): a fenced predecessor's read
  under the same consumer name, or a read whose reply was lost that its own retry missed (the read itself
  hands those out first: `Intake.unreplied`). Streams whose start-up pending re-read is not finished are left
  to it.

Entries delivered more than max_deliveries times (the claim counts) are dead-lettered (reason
too_many_deliveries, original fields kept) and acked in the same script, and returned as such (their
`given_up` set: the worker answers their sessions); the rest are returned as deliveries, in stream order
per stream.
"""

from __future__ import annotations

import logging

from schemas import GROUP, Reason
from schemas.replies import as_str, flat_pairs

from .intake import MAX_DEAD_LETTER_FIELDS, Intake
from .protocol import DeadLetter, Delivery

__all__ = ["recover_streams"]

log = logging.getLogger("dgr.transport")


def recover_streams(intake: Intake) -> tuple[list[Delivery], list[DeadLetter]]:
    """See the module docstring."""
    io = intake.io
    streams = list(intake.streams)
    if not streams:
        return [], []
    st = io.settings
    args: list[str | int] = [GROUP, io.consumer_name, st.claim_count, st.max_deliveries, st.dlq_maxlen,
                             MAX_DEAD_LETTER_FIELDS]
    reply = intake.call_script("recover", [io.keys.dead_letters, *streams], args, streams)
    kept_out: list[Delivery] = []
    dead_out: list[DeadLetter] = []
    for s, (kept, dead, own) in zip(streams, reply, strict=True):
        held = intake.outstanding.get(s, set())
        if s in intake.drained and int(own) > len(held):
            kept_out += intake.unheld_pending(s)
        for entry_id, _n, flat in kept:
            d = intake.delivery(s, entry_id, flat_pairs(flat))
            kept_out.append(d)
            if s not in intake.drained:
                intake.recovered.setdefault(s, set()).add(d.entry_id)
        for entry_id, n, flat in dead:
            why = f"delivered {as_str(n)} times (max {st.max_deliveries})"
            d = intake.delivery(s, entry_id, flat_pairs(flat), held=False, given_up=why)
            dead_out.append(DeadLetter(d, Reason.TOO_MANY_DELIVERIES, why))
    return kept_out, dead_out
