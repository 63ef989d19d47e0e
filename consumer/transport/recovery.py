"""Recovery by ownership: entries to hand out again, in one script call for all input streams.

* the pending entries of every other consumer name of the group are claimed into this one (the lease
  holder is the only live consumer of this worker id);
* this consumer's own pending entries are never claimed by idle time; those the worker does not hold
  (handed out, not yet completed) are handed out again: a read whose reply was lost in a reconnect, or
  a fenced predecessor's read under the same consumer name. Streams whose start-up pending re-read is
  not finished are left to it.

Entries delivered more than max_deliveries times (the claim counts) are dead-lettered (reason
too_many_deliveries, original fields kept) and acked in the same script, and returned as such (their
`given_up` set: the worker answers their sessions); the rest are returned as deliveries, in stream order
per stream.
"""

from __future__ import annotations

import logging
from typing import Any

from schemas import GROUP, Reason
from schemas.replies import as_str, entry_fields, flat_pairs

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
            kept_out += _orphans(intake, s, held)
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


def _orphans(intake: Intake, stream: str, held: set[str]) -> list[Delivery]:
    """Own pending entries of `stream` that the worker does not hold, handed out again."""
    io = intake.io
    count = io.settings.claim_count
    io.round_trips += 1
    pending: Any = io.io(lambda: io.client.xpending_range(stream, GROUP, "-", "+", count,
                                                          consumername=io.consumer_name))
    ids: list[Any] = [as_str(p["message_id"]) for p in pending if as_str(p["message_id"]) not in held]
    if not ids:
        return []
    io.round_trips += 1
    claimed: Any = io.io(lambda: io.client.xclaim(stream, GROUP, io.consumer_name, 0, ids))
    out: list[Delivery] = []
    for entry in claimed:
        if entry and entry[0] is not None:
            out.append(intake.delivery(stream, entry[0], entry_fields(entry[1])))
    if out:
        log.warning("own pending entries the worker did not hold: handed out again", extra={
            "worker": io.worker_id, "stream": stream, "entries": len(out)})
    return out
