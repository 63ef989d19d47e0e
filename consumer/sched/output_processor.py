"""What a fused call's report does (vLLM v1's `update_from_output`, SGLang's output processor): the
sampled tokens advance positions, finish sessions and become answers; a failed call fails its sessions."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import ClassVar

from msgspec.structs import replace

from schemas import Reason, Status, TokenLogprobs

from .outputs import Answer, BatchItem, Outcome, ScheduledBatch
from .session_table import SessionEntry, SessionState
from .state import SchedulerState, SessionQueue, _Queued

__all__ = ["OutputProcessor"]


class OutputProcessor(SchedulerState):
    # Decode rows taken in one block (update_from_output): the general path is the definition, and
    # tests/test_decode_rows.py compares the two with this off on one of two schedulers.
    inline_decode: ClassVar[bool] = True

    def update_from_output(self, batch: ScheduledBatch, tokens: Sequence[int | None], engine_seconds: float,
                           *, logprobs: Sequence[TokenLogprobs | None] | None = None,
                           ended: Collection[int] = ()) -> list[Answer]:
        """Apply a successful call. `tokens`: the sampler's token for every item that samples, in item
        order (consumer/sampler.py: keyed by the session's seed and the position the token takes).
        None for every item on a route hop that is not last (it answers activations, the last hop
        samples): the step counts as the one the last hop samples at (so the hop finishes the session
        at max_tokens, as the last hop does; a stop token only the last hop sees), no token, nothing
        generated is charged.

        Positions advance; engine_seconds is split over the items by n_tokens. A job's result carries
        its whole accounting: prompt_tokens = its tokens processed in prefill calls, generated_tokens =
        1 when a token was sampled. A session finishes when its generated count reaches max_tokens or
        the token is a stop token: result.finished, close='finished', slot released, and any step
        still queued for it answered REJECTED FINISHED. Items that do not finish their job produce no
        answer.

        `logprobs` (per sampling item, when given): what each answer carries back. `ended`: sampling
        items (their index among them) whose session the sampler ended without a token (its grammar
        admits nothing more, its output is complete): the answer is OK, finished, with no token.
        """
        n_sampling = len(batch.sampling_items)
        if len(tokens) != n_sampling:
            raise ValueError(f"{len(tokens)} tokens for {n_sampling} sampling items")
        seconds = engine_seconds if math.isfinite(engine_seconds) and engine_seconds > 0 else 0.0
        total_rows = max(1, len(batch.fused))
        batch_size = len(batch.session_ids)
        touched: dict[int, SessionQueue] = {}
        if batch.phase == "decode" and self.inline_decode and not ended \
                and len(batch.sampling_items) == len(batch.items):  # a decode call of the last hop, the usual one
            out, inline = self._decode_rows(batch, tokens, logprobs, seconds, batch_size, touched)
        else:
            out, inline = [], 0
            sampled = -1
            for it in batch.items:
                if it.samples:
                    sampled += 1
                out += self._general_row(it, batch.phase, tokens, sampled, ended, logprobs, seconds, total_rows,
                                         batch_size, touched)
        self._settle(touched)
        self.stats.tokens_sampled += inline
        self.stats.jobs_ok += inline
        return out

    def _general_row(self, it: BatchItem, phase: str, tokens: Sequence[int | None], sampled: int,
                     ended: Collection[int], logprobs: Sequence[TokenLogprobs | None] | None, seconds: float,
                     total_rows: int, batch_size: int, touched: dict[int, SessionQueue]) -> list[Answer]:
        """One item of a successful call, any kind (the definition: _decode_rows short-cuts the common decode
        row): positions advance, its share of the engine time is charged, a job it completes is answered."""
        lane, q = self._claim(it)
        if lane is None or q is None:
            return []
        touched[it.slot] = lane
        share = seconds * it.n_tokens / total_rows
        # a decode job's answer carries its own call's share (one answer per offset)
        q.engine_seconds = share if phase == "decode" else q.engine_seconds + share
        if phase == "prefill":
            q.prompt_tokens += it.n_tokens
            q.prefill_calls += 1
        if lane.closed is not None:  # closed while the call ran: answered where it stood before these rows, as
            # a job closed before its call (cancel) or after (a failed call) is, whenever the cancel was read
            return [self._closed_answer(lane, q, lane.entry.position, batch_size)] \
                if it.completes_job and not q.answered else []
        reached = it.first_position + it.n_tokens
        entry = lane.entry
        entry.position = reached
        entry.engine_seconds += share
        if phase == "prefill":
            entry.prompt_tokens += it.n_tokens
        if not it.completes_job:
            return []
        token, finished, lp = self._take_token(it, entry, tokens, sampled, ended, logprobs, phase)
        return self._answer_ok(it, lane, q, reached, token, finished, lp, phase, batch_size)

    def _decode_rows(self, batch: ScheduledBatch, tokens: Sequence[int | None],
                     logprobs: Sequence[TokenLogprobs | None] | None, seconds: float, batch_size: int,
                     touched: dict[int, SessionQueue]) -> tuple[list[Answer], int]:
        """A decode call whose every item samples, none ended by the sampler: the common row, a token of an open
        session that goes on (its one item in flight, not finished), in one block inside the loop: the same steps as
        the general path (_claim, _take_token, _answer_ok, _result, _settle) without their calls and keywords, which
        cost about as much as the steps themselves (docs/benchmarks.md, issue 32); any other row by the general
        path. The answers, and how many rows the block answered (each a token sampled and a job answered OK)."""
        out: list[Answer] = []
        inline = 0
        total_rows = max(1, len(batch.fused))
        share = seconds / total_rows  # a decode row's share of the engine time (one row each)
        inflight, lanes, awaiting, queues = self._inflight, self._lanes, self._awaiting, self._queues
        ok, decoding = Status.OK, SessionState.DECODING  # read once, not per row
        lps = logprobs if logprobs is not None else [None] * len(tokens)
        for sampled, (it, got, lp) in enumerate(zip(batch.items, tokens, lps, strict=True)):
            lane = inflight.get(it.slot)
            if got is not None and lane is not None and lane.closed is None and len(lane.inflight) == 1 \
                    and it.n_tokens == 1:
                q, entry, token, job = lane.inflight[0], lane.entry, int(got), it.job
                spec = entry.spec
                if q.job is job and q.in_flight == (it.offset, 1) and entry.generated + 1 < spec.max_tokens \
                        and token not in spec.stop_tokens:
                    q.in_flight = None
                    lane.inflight.clear()
                    # settled here, as _settle settles a lane with nothing left in flight after the loop: out of
                    # flight and, the usual case, its head job back in its phase's ready queue (a lane in flight is
                    # never among those awaiting a job); else _refresh decides. Sooner changes no order: a ready
                    # queue is a heap by the head's admission seq.
                    del inflight[it.slot]
                    sid = lane.session_id
                    if lane.jobs and lanes.get(sid) is lane:
                        awaiting.discard(sid)
                        if lane.ready_phase is None:
                            head = lane.jobs[0]
                            queues[head.job.phase].push(lane, head.seq)
                    else:
                        self._refresh(lane)
                    reached = job.start_position + it.offset + 1
                    entry.position = reached
                    entry.engine_seconds += share
                    entry.generated += 1
                    entry.generated_tokens += 1
                    entry.last_token = token
                    entry.state = decoding  # counted in stats by the caller, once per call
                    final = q.answered = it.offset + 1 >= job.n
                    q.engine_seconds = 0.0  # as the general path leaves it: this answer carries its own share
                    # the result id is schemas.step.result_job_id's, inline (tests/test_decode_rows.py compares)
                    out.append(Answer(q.ref, job, Outcome(
                        job.job_id if it.offset == 0 else f"{job.job_id}.{it.offset}", sid, ok, None, reached,
                        "", token, False, q.prompt_tokens, share, batch_size, None, lp, q.cached_tokens,
                        q.prefill_calls), spec.account_id, None, None, final))
                    inline += 1
                    continue
            out += self._general_row(it, "decode", tokens, sampled, (), logprobs, seconds, total_rows, batch_size,
                                     touched)
        return out, inline

    def _take_token(self, it: BatchItem, entry: SessionEntry, tokens: Sequence[int | None], sampled: int,
                    ended: Collection[int], logprobs: Sequence[TokenLogprobs | None] | None, phase: str
                    ) -> tuple[int | None, bool, TokenLogprobs | None]:
        """The token an item that completes its job takes (None: none sampled, or a hop's), whether it
        finishes the session, its logprobs; the session's counts move."""
        token: int | None = None
        finished = False
        lp: TokenLogprobs | None = None
        if it.samples and sampled in ended:
            finished = True  # no token: the sampler ended the session (its grammar is complete)
            entry.state = SessionState.DECODING
        elif it.samples:
            got = tokens[sampled]
            token = None if got is None else int(got)
            entry.generated += 1
            entry.last_token = token
            entry.state = SessionState.DECODING
            if token is not None:
                entry.generated_tokens += 1
                self.stats.tokens_sampled += 1
                if logprobs is not None:
                    lp = logprobs[sampled]
            finished = entry.generated >= entry.spec.max_tokens or (
                token is not None and token in entry.spec.stop_tokens)
        elif phase == "prefill":
            entry.state = SessionState.PREFILLING
        return token, finished, lp

    def _answer_ok(self, it: BatchItem, lane: SessionQueue, q: _Queued, reached: int, token: int | None,
                   finished: bool, lp: TokenLogprobs | None, phase: str, batch_size: int) -> list[Answer]:
        """The OK answer of an item that completes its job (or its continuation's token), and what a
        finished session answers besides."""
        entry = lane.entry
        final = finished or phase != "decode" or it.offset + 1 >= q.job.n
        if final and finished and lane.jobs and lane.jobs[0] is q:
            # A stop or max_tokens ends a continuation early: its unused offsets are dropped (no
            # answer, no charge), not answered FINISHED like a later job.
            lane.jobs.popleft()
            self._queues["decode"].drop(q.job, q.consumed)
            self._continuing.discard(lane.session_id)
        q.answered = final
        self.stats.jobs_ok += 1
        result = self._result(q.job, Status.OK, None, reached, token=token, finished=finished,
                              q=q, detail="" if token is not None or not finished or not it.samples
                              else "the session's grammar admits no further token",
                              batch_size=batch_size, offset=it.offset if phase == "decode" else 0)
        if lp is not None:
            result = replace(result, logprobs=lp)
        out = [Answer(ref=q.ref, job=q.job, result=result, account_id=entry.account_id,
                      close="finished" if finished else None, final=final)]
        if phase == "decode":
            q.engine_seconds = 0.0  # charged with this answer; a later answer carries its own
        if finished:
            out.extend(self._finish(lane, batch_size))
        return out

    def fail(self, batch: ScheduledBatch, reason_detail: str, *, status: Status = Status.FAILED,
             reason: Reason = Reason.ENGINE_ERROR) -> list[Answer]:
        """The call failed: every item's job is answered FAILED (ENGINE_ERROR) and its session closed
        (forgotten: a later step gets state_lost), since the state it holds is unreliable. Steps
        still queued for those sessions are answered FAILED too. The answers carry close=None; the
        closures (kind 'failed') show in drain_closed(). `status` / `reason` for the items' own jobs
        when the cause is known: STATE_LOST (the engine emptied the session's state: the Tracker
        replays it), or a reason the engine or the sampler gave (BAD_TOKEN, NO_TOKEN, ...)."""
        out: list[Answer] = []
        touched: dict[int, SessionQueue] = {}
        batch_size = len(batch.session_ids)
        failing: dict[int, SessionQueue] = {}
        per_lane: dict[int, list[Answer]] = {}
        for it in batch.items:
            lane, q = self._claim(it)
            if lane is None or q is None:
                continue
            touched[it.slot] = lane
            if q.answered:
                continue
            if lane.closed is not None:
                out.append(self._closed_answer(lane, q, lane.entry.position, batch_size))
                continue
            failing[it.slot] = lane
            per_lane.setdefault(it.slot, []).append(self._failed(lane, q, reason_detail, batch_size, status, reason))
        for slot, lane in failing.items():
            answers = per_lane[slot]
            for q in self._drop_queued(lane):
                answers.append(self._failed(lane, q, "session closed: an engine call failed on it",
                                            batch_size))
            self._close(lane, "failed")
            out.extend(answers)
        self._settle(touched)
        return out

    def _finish(self, lane: SessionQueue, batch_size: int) -> list[Answer]:
        answers = self._reject_queued(lane, Reason.FINISHED, "session finished before this step")
        self._close(lane, "finished")
        return answers

    def _claim(self, it: BatchItem) -> tuple[SessionQueue | None, _Queued | None]:
        """The in-flight job an item reports on, taken out of flight; (None, None) if it is not one."""
        lane = self._inflight.get(it.slot)
        if lane is not None:
            for i, q in enumerate(lane.inflight):
                if q.job is it.job or q.job.job_id == it.job.job_id:
                    if q.in_flight != (it.offset, it.n_tokens):
                        break
                    q.in_flight = None
                    del lane.inflight[i]
                    return lane, q
        self.stats.stale_items += 1
        return None, None

    def _settle(self, touched: Mapping[int, SessionQueue]) -> None:
        for slot, lane in touched.items():
            if lane.inflight:
                continue
            if self._inflight.get(slot) is lane:
                del self._inflight[slot]
            if lane.closed is not None:
                if self.table.session_at(slot) is None and not self.table.is_dirty(slot) \
                        and not self.table.is_free(slot):
                    self.table.release_slot(slot)
            else:
                self._refresh(lane)

    def _closed_answer(self, lane: SessionQueue, q: _Queued, position: int, batch_size: int) -> Answer:
        """The answer for a job of a session that was closed while its call ran."""
        q.answered = True
        entry = lane.entry
        if lane.closed == "cancelled":
            self.stats.jobs_cancelled += 1
            result = self._result(q.job, Status.CANCELLED, Reason.CANCELLED, position,
                                  detail="session cancelled while the step ran",
                                  q=q, batch_size=batch_size)
        elif lane.closed == "finished":
            self.stats.rejected += 1
            result = self._result(q.job, Status.REJECTED, Reason.FINISHED, position,
                                  detail="session finished before this step", batch_size=batch_size)
        else:
            self.stats.jobs_failed += 1
            result = self._result(q.job, Status.FAILED, Reason.ENGINE_ERROR, position,
                                  detail="session closed: an engine call failed on it", batch_size=batch_size)
        return Answer(ref=q.ref, job=q.job, result=result, account_id=entry.account_id, close=None)

    def _failed(self, lane: SessionQueue, q: _Queued, detail: str, batch_size: int, status: Status = Status.FAILED,
                reason: Reason = Reason.ENGINE_ERROR) -> Answer:
        q.answered = True
        self.stats.jobs_failed += 1
        result = self._result(q.job, status, reason, lane.entry.position, detail=detail, batch_size=batch_size)
        return Answer(ref=q.ref, job=q.job, result=result, account_id=lane.entry.account_id, close=None)
