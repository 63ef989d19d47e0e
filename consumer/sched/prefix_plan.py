"""The scheduler's side of the prefix cache (consumer/prefix/, docs/prefix-cache.md): a session opening
on an empty slot is looked up once, before its first prefill piece; a hit's tokens are taken from its
queue as restored (counted as cached, never against the prefill budget, the pacer or the round-robin),
and the call that carries the session's first computed piece restores them first. After a prefill call a
slot whose prompt rows now cover a block the cache does not hold is saved, so a block is filled by the
first session that computes it, and only once the call that computed it succeeded (never half-written).
Under a recipe that caches decoded positions (PrefixPlanner.decoded), a session that finishes has its slot
saved before it is cleared, so a conversation's next turn restores the answer it re-sends; under a
batch-invariant one its answer is first recomputed as prompt rows (PrefixPlanner.refill_answer).

What keeps the tokens bit-identical to the cold run (docs/invariance.md): the restored KV is what a prompt
piece of two or more rows computed (flash attention off: any such split gives the same KV); at least two
prompt rows are always computed after a restore (the sampled position is computed, and no prompt row is
computed alone at the block edge); positions a replay computes one row each (from prompt_len on) are never
saved nor restored.
"""

from __future__ import annotations

from dataclasses import replace

from ..prefix.planner import PrefixPlanner, Refill, Restore, Save
from .outputs import ScheduledBatch
from .session_table import CloseKind
from .state import SchedulerState, SessionQueue, _Queued

__all__ = ["PrefixPlanning"]

MIN_COMPUTED = 2  # prompt rows always computed after a restore (the sampled one, never one alone)


class PrefixPlanning(SchedulerState):
    prefix: PrefixPlanner | None = None

    def _prefix_open(self, lane: SessionQueue) -> None:
        """At the start of each of the lane's prompt jobs (nothing of it handed out yet, everything before
        it computed as prompt rows): look the prompt so far up, and take the blocks a hit covers beyond
        what the slot holds as restored. Restoring over positions the slot already computed is exact: the
        cached KV of a position is bit for bit what computing it as a prompt row gives."""
        planner = self.prefix
        if planner is None:
            return
        head = lane.jobs[0]
        start = head.job.start_position
        if head.job.phase != "prefill" or lane.entry.position != start or len(lane.cacheable) != start:
            return
        spec = lane.entry.spec
        if not lane.prefix_checked:
            lane.prefix_checked = True
            lane.prefix_root = planner.root(spec)
        root = lane.prefix_root
        if root is None:
            return
        # The restore may cover whole jobs of the prompt queued after this one (a prompt longer than the
        # producer's chunk, a shared prefix of 512 tokens ending one): each such job is answered with no row of
        # its own in the call that computes the rows after the hit (batching: an item of 0 rows), so only the
        # last queued job needs its two computed rows.
        run = self._prompt_run(lane)
        # Looked up again only when an entry was stored since or more of the prompt is queued: a lane taken
        # from the queue and put back (the shortest-first turns of batching.py look at every waiting prompt)
        # would otherwise hash its whole prompt again for the same answer.
        looked = (head.seq, run[-1].job.end_position, planner.store.stats.saved)
        if lane.prefix_looked == looked:
            return
        lane.prefix_looked = looked
        tokens = [*lane.cacheable, *(t for q in run for t in q.job.tokens)]
        if run[-1].job.sample and planner.window:  # the whole prompt: a later one may part from it (_prefix_cut)
            planner.remember(root, tokens[:spec.prompt_len] if spec.prompt_len is not None else tokens,
                             spec.session_id)
        cap = run[-1].job.end_position - MIN_COMPUTED
        if spec.prompt_len is not None:
            cap = min(cap, spec.prompt_len - MIN_COMPUTED)
        if cap < start + planner.store.block_tokens:
            return
        hit = planner.lookup(root, tokens, cap, have=start)
        if hit is None:
            return
        k = left = hit.n_tokens - start
        for q in run:  # each job charged the cached tokens of its own positions
            q.consumed = min(left, len(q.job.tokens))
            q.cached_tokens += q.consumed
            left -= q.consumed
        self._queues["prefill"].take(k, job_done=False)
        lane.cacheable = tokens[:hit.n_tokens]
        lane.pending_restore = Restore(lane.entry.slot, hit, tuple(tokens[:hit.n_tokens]))

    def _prefix_cut(self, lane: SessionQueue, start: int, n: int, prompt_end: int | None) -> int:
        """The rows of a cacheable session's prefill piece on a sliding-window engine: a piece that would
        cross the window's edge, or past it the block edge where the prompt parts from one seen before
        (PrefixPlanner.parting: one system prompt, other questions), ends there. At the window's edge the
        saved slot holds no more positions than the window, so its blocks up to the edge are stored
        trimmable; past it a save is a checkpoint, restored whole (a slot past the window cannot be trimmed
        back exactly: LlamaCppEngine.prefix_floor, PrefixPlanner.save), so it is made only where a later
        prompt is likely to part too. Cutting at every multiple of the window instead cost long prompts that
        share nothing a third more time to first token under load (docs/benchmarks.md: each cut is one more
        prefill turn). Both sides keep two or more rows (any such split gives the same KV: docs/invariance.md),
        and only prompt positions are cut."""
        planner = self.prefix
        w = planner.window if planner is not None else 0
        root = lane.prefix_root
        if planner is None or not w or root is None:
            return n
        last = start + n - 1  # a cut leaves two rows before it and two to the prompt's end
        if prompt_end is not None:
            last = min(last, prompt_end - 2)
        known = [*lane.cacheable, *self._queued_tokens(lane, start, n)] if len(lane.cacheable) == start else []
        # The window's edge only for a prompt another session may share (its first block seen from another session
        # or held): a long prompt nobody else sent paid one more prefill turn for a save nobody restored (2,016-token
        # prompts sharing nothing: 0.955-0.989 of the cache-off throughput, TTFT 1.06-1.09x, docs/benchmarks.md).
        edge = start + 2 <= w <= last and (not known or planner.shared(root, known, lane.session_id))
        cuts = [w] if edge else []
        prompt_len = lane.entry.spec.prompt_len  # a replay's positions from there on are not prompt rows
        if prompt_len is not None:
            last = min(last, prompt_len - 2)
        whole = prompt_end is not None and start + n >= prompt_end and prompt_len is None
        parting = planner.parting(root, known, max(start + 2, w + 1), last, whole=whole,
                                  session_id=lane.session_id) if known else 0
        if parting:
            cuts.append(parting)
        for cut in sorted(cuts):
            # Already held up to the cut (a session that restored a shared prefix short of it): it would save
            # nothing and cost the session another prefill turn.
            if len(known) >= cut and not planner.wants(root, known[:cut], cut):
                continue
            if cut == parting:
                lane.parting = cut
            return cut - start
        return n

    @staticmethod
    def _prompt_run(lane: SessionQueue) -> list[_Queued]:
        """The lane's head prefill job and the untouched prefill jobs queued after it that follow on, up to
        and with the first that samples."""
        out: list[_Queued] = []
        at = lane.jobs[0].job.start_position
        for q in lane.jobs:
            if q.job.phase != "prefill" or q.job.start_position != at or (out and q.consumed):
                break
            out.append(q)
            at = q.job.end_position
            if q.job.sample:
                break
        return out

    @staticmethod
    def _queued_tokens(lane: SessionQueue, start: int, k: int) -> list[int]:
        """Up to k token ids of the lane's queued prefill jobs from position `start` on (fewer: not queued)."""
        out: list[int] = []
        for q in lane.jobs:
            if q.restored_whole:
                continue  # answered with no row of its own
            at = q.job.start_position + q.consumed
            if q.job.phase != "prefill" or at != start + len(out):
                break
            out.extend(q.job.tokens[q.consumed:q.consumed + k - len(out)])
            if len(out) >= k:
                break
        return out

    def _prefix_directives(self, batch: ScheduledBatch) -> ScheduledBatch:
        """The prefill call with its restores (before) and saves (after)."""
        planner = self.prefix
        if planner is None:
            return batch
        restores: list[Restore] = []
        saves: list[Save] = []
        ends: dict[str, int] = {}
        whole: set[str] = set()  # sessions whose prompt this call ends
        for it in batch.items:
            lane = self._lanes.get(it.job.session_id)
            if lane is None or lane.prefix_root is None:
                continue
            if lane.pending_restore is not None:
                restores.append(lane.pending_restore)
                lane.pending_restore = None
            spec = lane.entry.spec
            cap = spec.prompt_len if spec.prompt_len is not None else it.first_position + it.n_tokens
            seen = lane.cacheable
            if len(seen) == it.first_position and it.first_position < cap:
                seen.extend(it.job.tokens[it.offset:it.offset + min(it.n_tokens, cap - it.first_position)])
            ends[it.job.session_id] = len(seen)
            if it.samples or (spec.prompt_len is not None and len(seen) >= spec.prompt_len):
                whole.add(it.job.session_id)
        saving: set[tuple[str, ...]] = set()
        for sid, n in ends.items():
            lane = self._lanes[sid]
            assert lane.prefix_root is not None
            # A piece that ends neither the prompt, nor on the window's edge, nor where it parts from another is
            # saved only when another session may share the prompt (a later save of the same slot covers it
            # otherwise): a 2,016-token prompt paced in 32-row pieces saved its slot after each of its first 16.
            if (sid not in whole and n not in (planner.window, lane.parting)
                    and not planner.shared(lane.prefix_root, lane.cacheable, sid)):
                continue
            save = planner.save(lane.entry.slot, lane.prefix_root, lane.cacheable, n, parting=n == lane.parting)
            if save is not None and save.ids not in saving:  # sessions of one prompt in one call: saved once
                saving.add(save.ids)
                saves.append(save)
        if not (restores or saves):
            return batch
        return replace(batch, restores=tuple(restores), saves=tuple(saves))

    def _prefix_decoded(self, batch: ScheduledBatch) -> None:
        """A decode call under a recipe that caches decoded positions: each row's input token joins its
        session's cacheable tokens (while they are contiguous from position 0: a replay's one-row positions
        past prompt_len stop them). Under one that refills answers instead it joins the session's answer, while
        that follows the cacheable tokens without a gap (up to the most a refill computes)."""
        planner = self.prefix
        if planner is None or not (planner.decoded or planner.refill):
            return
        for it in batch.items:
            lane = self._lanes.get(it.job.session_id)
            if lane is None or lane.prefix_root is None:
                continue
            token = it.token if it.token is not None else it.job.tokens[it.offset]
            seen = lane.cacheable
            if planner.decoded:
                if len(seen) == it.first_position:
                    seen.append(token)
            elif len(seen) + len(lane.answer) == it.first_position and len(lane.answer) < planner.refill:
                lane.answer.append(token)

    def _prefix_closed(self, lane: SessionQueue, kind: CloseKind, busy: bool) -> None:
        """A session that finished with no call in flight: under a recipe that caches decoded positions its
        slot (prompt and answer, all but the last sampled token, which was never fed) is saved before it is
        cleared when that adds a block; under one that refills answers, its answer is kept for
        `_prefix_finished` (both run by Scheduler.finished_saves). A cancelled or failed session's slot is
        not: what it holds was not answered in full."""
        planner = self.prefix
        if planner is None or kind != "finished" or busy or lane.prefix_root is None:
            return
        if planner.decoded:
            seen = lane.cacheable
            save = planner.save(lane.entry.slot, lane.prefix_root, seen, len(seen), tail=True)
            if save is not None:
                self._finished_saves[save.slot] = save
        elif len(lane.answer) >= MIN_COMPUTED:
            self._finished_saves[lane.entry.slot] = lane

    def _prefix_finished(self, slot: int, max_rows: int) -> Save | Refill | None:
        """What to keep of the finished session on `slot` before it is cleared, its answer refilled in at most
        max_rows (the size of a prefill call now: the worker's pacer)."""
        kept = self._finished_saves.pop(slot, None)
        if not isinstance(kept, SessionQueue):
            return kept
        planner = self.prefix
        assert planner is not None and kept.prefix_root is not None
        return planner.refill_answer(slot, kept.prefix_root, kept.cacheable, kept.answer, max_rows)
