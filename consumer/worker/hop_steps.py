"""The worker's part of a route hop (issue 17): input activations in, output activations out.

A hop that consumes "hidden" takes each step's input rows from the job (inline, or a blob in this
worker's hash tag that the transport fetches for all jobs of one read in one round trip), checks them
against its boundary schema (hidden size, dtype, version, digest, finite), and keeps them until the
job is answered; each fused call gets the rows of its items as `FusedBatch.hidden`. A hop that
produces "hidden" answers each job with one output row per token (collected over the calls a prefill
job was cut into) instead of a sampled token: inline when small (a decode step), else a blob
`activations_out(job_id)` that the completion script writes with the answer.

Billing (docs/accounting.md, "Routes of several hops"): a hop that is not last charges its
engine-seconds and steps, never billable tokens (prompt_tokens 0): the last hop, which samples,
charges those once per session. Nothing here speaks Redis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Literal

import numpy as np
import numpy.typing as npt
from msgspec.structs import replace as struct_replace

from schemas import ActivationError, BoundarySchema, Reason, Status, StepJob
from schemas.activations import decode, encode
from schemas.limits import ACTIVATIONS_VERSION, MAX_REASON_LEN

from ..batch import EngineOutput, FusedBatch
from ..sched import Answer, Outcome, ScheduledBatch
from ..transport.protocol import Inbound, Transport

__all__ = ["HopSteps"]

F32 = npt.NDArray[np.float32]


class HopSteps:
    """Activations of the jobs a worker holds, for one engine's boundary schema."""

    def __init__(self, boundary: BoundarySchema, blob_key: Callable[[Literal["in", "out"], str], str]) -> None:
        """`blob_key(direction, job_id)`: the key of a job's input ("in") or output ("out") activations on
        this worker (the transport names keys: `Transport.activation_key`)."""
        self.boundary = boundary
        self.blob_key = blob_key
        self.consumes_hidden = boundary.consumes == "hidden"
        self.produces_hidden = boundary.produces == "hidden"
        self.hidden_size = boundary.hidden_size
        self.dtype = boundary.dtype
        self._fetched: dict[str, bytes | None] = {}  # blob key -> bytes, for the entries of the last read
        self._inputs: dict[str, F32] = {}  # job id -> its input rows, while the job is held
        self._outputs: dict[str, list[F32]] = {}  # job id -> output rows so far (a prefill cut over calls)

    # ---- reading ----------------------------------------------------------------------------
    def prefetch(self, transport: Transport, inbound: Sequence[Inbound]) -> None:
        """Fetch the input blobs of every job just read, in one round trip (none when no job has one)."""
        self.use_fetched(self.fetch(transport, inbound))

    def fetch(self, transport: Transport, inbound: Sequence[Inbound]) -> dict[str, bytes | None]:
        """The input blobs of the jobs read (blob key -> bytes), fetched in one round trip. Touches no
        state of this object: the worker's I/O thread runs it next to the read."""
        if not self.consumes_hidden:
            return {}
        blobs = [inb.job.hidden.blob for inb in inbound
                 if inb.job is not None and inb.job.hidden is not None and inb.job.hidden.blob is not None]
        return dict(zip(blobs, transport.fetch_activations(blobs), strict=True)) if blobs else {}

    def use_fetched(self, fetched: dict[str, bytes | None]) -> None:
        """The blobs the next admissions read their rows from (those of the last read)."""
        self._fetched = fetched

    def admit(self, job: StepJob, stream_digest: str, engine_digest: str | None, position: int,
              worker_id: str, ref: object) -> Answer | None:
        """None: the job's activations (or their absence) are right for this hop, and its input rows are
        kept for its calls. Else the REJECTED bad_activations answer. A job on the wrong stream is left
        to the scheduler (answered incompatible: the boundary is in the key)."""
        if not (job.compat == stream_digest == engine_digest):
            return None
        try:
            rows = self._rows(job)
        except ActivationError as e:
            result = Outcome(job.job_id, job.session_id, Status.REJECTED, Reason.BAD_ACTIVATIONS, position,
                             str(e)[:MAX_REASON_LEN])
            return Answer(ref=ref, job=job, result=result, account_id=None, close=None)
        if rows is not None:
            self._inputs[job.job_id] = rows
        return None

    def _rows(self, job: StepJob) -> F32 | None:
        acts = job.hidden
        if not self.consumes_hidden:
            if acts is not None:
                raise ActivationError("this hop takes tokens, not activations")
            return None
        if acts is None:
            raise ActivationError("this hop takes activations: the step carries none")
        if acts.v != ACTIVATIONS_VERSION or self.boundary.version != ACTIVATIONS_VERSION:
            raise ActivationError(f"activation format {acts.v}, this hop reads {self.boundary.version}")
        raw: bytes | None = None
        if acts.blob is not None:
            if acts.blob != self.blob_key("in", job.job_id):
                raise ActivationError(f"blob {acts.blob[:80]} is not this job's input key on this worker")
            raw = self._fetched.get(acts.blob)
        return decode(acts, raw, hidden_size=self.hidden_size or None, dtype=self.dtype)

    # ---- a fused call -----------------------------------------------------------------------
    def fused(self, batch: ScheduledBatch) -> FusedBatch:
        """The engine's batch: with `hidden` (one input row per batch row) when this hop consumes it."""
        if not self.consumes_hidden:
            return batch.fused
        parts = [self._inputs[it.job.job_id][it.offset:it.offset + it.n_tokens] for it in batch.items]
        hidden = np.ascontiguousarray(np.concatenate(parts, axis=0), dtype=np.float32)
        return replace(batch.fused, hidden=hidden)

    def collect(self, batch: ScheduledBatch, output: EngineOutput) -> list[int | None]:
        """Keep each item's output rows (one per batch row); the 'tokens' of the sampling items: none."""
        rows = output.rows
        if rows.shape[0] != len(batch.fused):
            raise ValueError(f"{rows.shape[0]} activation rows for a call of {len(batch.fused)} rows")
        for it in batch.items:
            self._outputs.setdefault(it.job.job_id, []).append(
                np.array(rows[it.row_start:it.row_start + it.n_tokens], dtype=np.float32))
        return [None for it in batch.items if it.samples]

    # ---- answers ----------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """`finish` changes nothing, whatever the answer: a last hop holding no job's rows (the whole model)."""
        return not (self.produces_hidden or self._inputs or self._outputs)

    def finish(self, a: Answer) -> Answer:
        """Every answer passes here once: the job's rows are dropped; an OK answer of a hop that produces
        activations gets them (inline, or a blob with its bytes), and charges no billable tokens."""
        job = a.job
        if job is None or not (self.produces_hidden or self._inputs or self._outputs):  # a last hop's token
            return a
        self._inputs.pop(job.job_id, None)
        parts = self._outputs.pop(job.job_id, None)
        if not self.produces_hidden or a.result.status != Status.OK or a.result.hidden is not None:
            return a
        r = a.result
        rows = np.concatenate(parts, axis=0) if parts else np.zeros((0, 1), np.float32)
        if rows.shape[0] != len(job.tokens) or not np.isfinite(rows).all():
            # Never an answer the next hop would compute on: the step fails (a bug, said loudly).
            detail = (f"hop output of {rows.shape[0]} rows for {len(job.tokens)} tokens" if rows.shape[0] !=
                      len(job.tokens) else "hop output holds NaN or inf")
            failed = struct_replace(r, status=Status.FAILED, reason=Reason.ENGINE_ERROR, detail=detail, prompt_tokens=0,
                             engine_seconds=0.0, token=None)
            return struct_replace(a, result=failed)
        acts, blob = encode(rows, self.dtype, blob=self.blob_key("out", job.job_id))
        # A hop that is not last charges no billable tokens (docs/accounting.md): only its engine seconds.
        result = struct_replace(r, hidden=acts, prompt_tokens=0, token=None)
        return struct_replace(a, result=result, blob=blob)

    def held(self) -> int:
        """Jobs whose rows are kept (for tests: 0 once every job is answered)."""
        return len(self._inputs) + len(self._outputs)

    def forget(self, job_ids: Sequence[str]) -> None:
        for j in job_ids:
            self._inputs.pop(j, None)
            self._outputs.pop(j, None)
