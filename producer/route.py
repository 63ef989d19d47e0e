"""What only routes of several hops need (docs/routes.md; the checks that a route's hops join: validate.py): the
relay of a hop's output rows as the next hop's input. The Tracker relays, as Petals' client does: every hop
answers into its own hash tag (its result stream; a prefill chunk's rows in a blob `act:out:<job>` of its tag),
and the next hop's job carries the rows inline (a decode step) or in a blob the Tracker writes into that hop's
tag (`act:in:<job>`) in the pipeline that pushes the job. Workers never write another worker's tag (Redis
Cluster safe, per-worker ACLs), only the Tracker signs jobs, and cancel, replay and billing stay in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas import Reason, WorkerKeys

from .commands import Batch, Delete
from .session import RouteHandle, SessionHandle, lose
from .steps import job_id

if TYPE_CHECKING:
    from .steps import Steps

__all__ = ["RouteHandle", "relay"]


def relay(core: Steps, batch: Batch, h: SessionHandle, blobs: dict[str, bytes | None], *,
          assume_sent: bool = False) -> None:
    """Push the next hop's job for each answer whose rows are at hand (`blobs`: the output blobs fetched, None
    when gone), then DEL the output blob (the Tracker keeps the bytes until the next hop answers). A hop's jobs
    reach the next hop in position order: a relay waits behind an earlier one of its hop whose blob was not
    fetched. A blob that is gone is a lost state (the route is replayed). `assume_sent` (resume()): the bytes
    of a relay are unknown; the job is taken as pushed (its blob named as its source, for a re-push)."""
    relays, h.relays = h.relays, []
    blocked: set[int] = set()
    for rl in relays:
        blob, prev = rl.blob, rl.job
        if prev.hop in blocked or (blob is not None and blob not in blobs and not assume_sent):
            blocked.add(prev.hop)
            h.relays.append(rl)
            continue
        raw = blobs.get(blob) if blob is not None else None
        if blob is not None and raw is None and not assume_sent:
            h.reason, h.detail = Reason.BAD_ACTIVATIONS.value, f"hop {prev.hop}: output blob {blob} is gone"
            lose(h)
            return
        hop = prev.hop + 1
        into = WorkerKeys(h.legs[hop].worker_id).activations_in(job_id(h.session_id, hop, prev.phase,
                                                                       prev.start_position, h.attempt))
        nxt = core.job(h, hop, prev.phase, prev.start_position, prev.tokens, sample=prev.sample, session=prev.session,
                       hidden=rl.acts if blob is None else rl.acts.moved(into), created_at=prev.created_at)
        core.push(batch, h, nxt, hop=hop, raw=raw, src=blob)
        h.legs[hop].bytes_in += rl.acts.nbytes
        h.legs[hop].blobs_in += blob is not None
        if raw is not None and blob is not None:
            batch.add(Delete(blob))
