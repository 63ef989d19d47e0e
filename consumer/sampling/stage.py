"""The sampler stage: one fused call's logits rows -> one token per item that samples, plus what the
session's controls need, kept per slot (docs/sampling.md, section 6).

It sits between the engine and the scheduler (as vLLM v1's sampler between model runner and
`update_from_output`). It owns the per-session state the controls need (the tokens fed at each
position, where the prompt ends, the grammar state) and builds it only from what it is shown: every
fused call that ran (`observe`, or `sample`, which observes first). A slot fed position 0 starts over
(a new session, or a replay's new attempt), so a replay rebuilds exactly the state the first attempt
had, and nothing of a previous session leaks. The worker may `release(slot)` to free a grammar early.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, is_not

import numpy as np
import numpy.typing as npt

from schemas import Sampling

from ..batch import EngineOutput
from ..sched.outputs import BatchItem, ScheduledBatch
from .arith import RowContext, RowStatus
from .grammar import Grammar, GrammarInvalid, GrammarRefused, gbnf_of
from .prefixes import LANE_MAX, lane_maxima
from .reference import argmax_rows, needs_context
from .rows import RowInput, SampledCall, sample_rows
from .vocab import Vocabulary

__all__ = ["BatchSampler", "first_cut", "plain"]

log = logging.getLogger("dgr.sampler")


_SLOT, _PLAIN = attrgetter("slot"), attrgetter("plain")


@dataclass
class _Slot:
    """What the stage knows of the session in one slot since it was fed position 0."""

    prompt_len: int | None = None
    stop_tokens: tuple[int, ...] = ()
    tokens: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(256, np.int32))
    length: int = 0  # positions 0 .. length-1 are known
    broken: bool = False  # a gap in the positions seen: the context is not known
    prompt_end: int | None = None
    grammar: Grammar | None = None
    gbnf: str | None = None
    grammar_failed: RowStatus | None = None  # sticky until the grammar is rebuilt
    plain: bool = False  # its sampling is plain greedy (the row's argmax: no context kept, no per-row work)

    def write(self, first: int, tokens: npt.NDArray[np.int32]) -> None:
        if first > self.length:
            self.broken = True
        end = first + tokens.shape[0]
        if end > self.tokens.shape[0]:
            grown = np.zeros(max(end, 2 * self.tokens.shape[0]), np.int32)
            grown[:self.length] = self.tokens[:self.length]
            self.tokens = grown
        self.tokens[first:end] = tokens
        if self.grammar is not None and self.prompt_end is not None and first < self.prompt_end + self.grammar.accepted:
            self.drop_grammar()  # positions the grammar accepted were rewritten: rebuilt on the next row
        self.length = end

    def drop_grammar(self) -> None:
        if self.grammar is not None:
            self.grammar.close()
        self.grammar, self.gbnf, self.grammar_failed = None, None, None


@functools.lru_cache(maxsize=4096)
def _plain_sampling(s: Sampling) -> bool:
    return (s.greedy and not s.penalized and not s.logit_bias and not s.banned_token_ids
            and s.allowed_token_ids is None and s.min_tokens == 0 and s.logprobs is None and not s.constrained)


def plain(s: Sampling | None) -> bool:
    """Whether a row of this sampling is a plain greedy one: its token is the row's argmax (docs/sampling.md)."""
    return s is not None and _plain_sampling(s)


@functools.lru_cache(maxsize=4096)
def _cuts_raw(s: Sampling) -> bool:
    """Whether a row of this sampling may cut the raw row by its lane maxima: a top-k row (rows.py
    _cut_from_raw), or one that asks for log-probabilities (logprobs.py)."""
    return (not s.greedy and 0 < s.top_k <= LANE_MAX // 2) or bool(s.logprobs)


def first_cut(output: EngineOutput, batch: ScheduledBatch) -> EngineOutput:
    """The sampler's first cut of a call's logits rows, for the thread that ran the call to take right after it
    (issue 32, item 3): every row's argmax (EngineOutput.with_top) and, for the rows whose sampling cuts the raw
    row by them, its lane maxima (prefixes.lane_maxima: one pass over those rows when all of them do). What
    `sample` then does not take again; the same numbers, so nothing sampled changes."""
    out = output.with_top()
    rows = np.asarray(out.rows)
    items = batch.sampling_items
    if out.kind != "logits" or rows.ndim != 2 or rows.shape[1] < 4 * LANE_MAX or len(items) != rows.shape[0]:
        return out
    want = [r for r, it in enumerate(items) if it.sampling is not None and _cuts_raw(it.sampling)]
    if not want:
        return out
    if len(want) == rows.shape[0]:
        lanes = lane_maxima(rows)
        assert lanes is not None
        cuts = dict(enumerate(lanes))
    else:
        cuts = {r: m for r in want if (m := lane_maxima(rows[r])) is not None}
    return EngineOutput(out.kind, out.rows, out.top, cuts, out.borrowed)


def _given_top(arr: npt.NDArray[np.float32], top: npt.NDArray[np.intp] | None) -> npt.NDArray[np.intp] | None:
    """The rows' argmax as the engine's output carries it (EngineOutput.top), when it fits these rows."""
    return top if top is not None and top.shape == (arr.shape[0],) and arr.dtype == np.float32 else None


def _argmax(arr: npt.NDArray[np.float32], special: npt.NDArray[np.bool_],
            samplings: Callable[[], Sequence[Sampling | None]], taken: npt.NDArray[np.intp] | None = None,
            ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.bool_]]:
    """Each row's argmax (`taken`: after the forward pass, EngineOutput.top), and whether it is the row's
    plain greedy token: not NaN (argmax stops at a row's first NaN), and not a special token unless its
    session's sampling allows them (`samplings()`, asked only then)."""
    n = arr.shape[0]
    top = arr.argmax(axis=1) if taken is None else taken
    ok = ~np.isnan(arr[np.arange(n), top])
    hit = special[top]
    if hit.any():
        given = samplings()
        allowed = np.fromiter((s is not None and s.allow_special for s in given), np.bool_, len(given))
        ok &= ~hit | allowed if allowed.shape[0] == n else np.zeros(n, np.bool_)
    return top, ok


class BatchSampler:
    """`sample(batch, output)` for every fused call with logits output; `observe(batch)` for one
    without (a route hop that is not last needs neither)."""

    def __init__(self, vocab: Vocabulary | int, *, threads: int = 1) -> None:
        self.vocab = vocab if isinstance(vocab, Vocabulary) else Vocabulary.plain(vocab)
        self.vocab_size = self.vocab.n_vocab
        self._slots: dict[int, _Slot] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dgr-sampler") if threads > 1 else None

    # ---- state -------------------------------------------------------------------------------------
    def observe(self, batch: ScheduledBatch) -> bool:
        """Record the tokens one fused call fed, slot by slot. True: nothing to record, every row being a plain
        greedy session's seen before (`_keeps_nothing`: its token is its row's argmax, unless NaN or special)."""
        if batch.phase == "decode" and not batch.restores and self._keeps_nothing(batch):
            return True
        fed = batch.fused.tokens
        restored = {r.slot: r.tokens for r in batch.restores}  # prefix cache: positions 0.. restored, not fed
        for it in batch.items:
            first = it.first_position
            slot = self._slots.get(it.slot)
            if first == 0 or it.slot in restored:
                if slot is not None:
                    slot.drop_grammar()
                spec = it.job.session
                slot = _Slot(prompt_len=spec.prompt_len if spec else None, stop_tokens=spec.stop_tokens if spec else (),
                             plain=spec is not None and plain(spec.sampling))
                self._slots[it.slot] = slot
                if it.slot in restored and not slot.plain:
                    slot.write(0, np.asarray(restored.pop(it.slot), dtype=np.int32))
                restored.pop(it.slot, None)
            elif slot is None:
                slot = self._slots[it.slot] = _Slot(broken=True)
            # a plain greedy session needs no context: nothing to keep; a job restored whole fed no row (and a
            # write at its first position would cut the restored context there)
            if not slot.plain and it.n_tokens:
                slot.write(first, np.asarray(fed[it.row_start:it.row_start + it.n_tokens], dtype=np.int32))
        return False

    def _keeps_nothing(self, batch: ScheduledBatch) -> bool:
        """Every row is a plain greedy session's, seen before and past position 0 (a decode call, the usual case):
        the loop of `observe` keeps nothing for any of them. Checked in C, not item by item."""
        got = list(map(self._slots.get, map(_SLOT, batch.items)))
        positions = batch.fused.positions
        return all(map(is_not, got, repeat(None))) and all(map(_PLAIN, got)) \
            and (positions.size == 0 or int(positions.min()) > 0)

    def release(self, slot: int) -> None:
        state = self._slots.pop(slot, None)
        if state is not None:
            state.drop_grammar()

    def close(self) -> None:
        for slot in list(self._slots):
            self.release(slot)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.vocab.settle()  # the piece tree's build reads the engine's vocab: done before the engine closes

    def check(self, sampling: Sampling) -> RowStatus:
        """Whether this worker can serve a session's sampling (OK), or why not: a grammar it cannot
        compile or run. For admission, before the session takes a slot."""
        if not sampling.constrained:
            return RowStatus.OK
        if not self.vocab.grammars:
            return RowStatus.GRAMMAR_UNSUPPORTED
        try:
            gbnf = gbnf_of(sampling)
            assert gbnf is not None
            Grammar(self.vocab, gbnf).close()
        except GrammarInvalid:
            return RowStatus.GRAMMAR_INVALID
        return RowStatus.OK

    # ---- sampling ----------------------------------------------------------------------------------
    def sample(self, batch: ScheduledBatch, output: EngineOutput) -> SampledCall:
        """Every sampling item's token (in item order) with its status and log-probabilities. Each draw
        is keyed by the session's seed and the position its token takes; nothing else of the call
        feeds it. ValueError when the rows do not fit the call."""
        if output.kind != "logits":
            raise ValueError(f"cannot sample from {output.kind!r} rows")
        plain_call = self.observe(batch)
        items = batch.sampling_items
        arr = np.asarray(output.rows)
        n_logit = batch.fused.n_logit_rows
        if len(items) != n_logit:
            raise ValueError(f"{len(items)} sampling items, {n_logit} logit rows")
        if n_logit == 0 and arr.size == 0:
            return SampledCall.empty(0, 0)
        if arr.shape != (n_logit, self.vocab_size):
            raise ValueError(f"logits shape {arr.shape}, expected ({n_logit}, {self.vocab_size})")
        top = _given_top(arr, output.top)
        if plain_call:  # every row a plain greedy session's (observe found it): no array of which ones are
            tokens, fast = _argmax(arr, self.vocab.special_mask, lambda: [it.sampling for it in items], top)
        else:
            fast, tokens = self._plain_greedy(items, arr, top)
        if fast.all():  # every row is a plain greedy one: its argmax, nothing else to compute
            return SampledCall.of_tokens(tokens)
        slow = np.flatnonzero(~fast)
        inputs: list[RowInput] = []
        early: dict[int, RowStatus] = {}
        for k, r in enumerate(slow.tolist()):
            inp = self._row(items[r])
            if isinstance(inp, RowStatus):
                early[k] = inp
                inp = RowInput(sampling=Sampling(), position=items[r].end_position)  # sampled, then overwritten
            inputs.append(inp)
        # Every row sampled (a call of one sampling setting): the engine's rows as they are, not a copy
        # (8 MB for 8 rows of Gemma's vocabulary); sample_rows only reads them.
        whole = slow.shape[0] == n_logit
        cuts = output.cuts if top is not None else None  # taken with the argmax, of these rows
        if cuts and not whole:
            cuts = {k: cuts[r] for k, r in enumerate(slow.tolist()) if r in cuts}
        part = sample_rows(arr if whole else arr[slow], inputs, self.vocab, pool=self._pool,
                           argmax=None if top is None else top if whole else top[slow], cuts=cuts)
        for k, status in early.items():
            part.tokens[k], part.status[k] = -1, status
            part.logprob[k] = np.nan
            part.top_ids[k] = -1
            part.top_logprobs[k] = np.nan
        if whole:
            return part
        out = SampledCall.empty(n_logit, part.top_ids.shape[1])
        out.tokens[:] = tokens
        out.tokens[slow], out.status[slow], out.logprob[slow] = part.tokens, part.status, part.logprob
        out.top_ids[slow], out.top_logprobs[slow] = part.top_ids, part.top_logprobs
        return out

    def _plain_greedy(self, items: Sequence[BatchItem], arr: npt.NDArray[np.float32], top: npt.NDArray[np.intp] | None
                      ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.intp]]:
        """Which rows are plain greedy ones (greedy, no control, no log-probabilities: their token is the
        row's argmax, docs/sampling.md) and that argmax, for all rows at once. A row whose argmax is a
        special token it may not sample, or NaN, is left to the full path (which is exact for it)."""
        n = len(items)
        slots = self._slots
        plain = np.array([slots[it.slot].plain for it in items], np.bool_)  # a list: no generator per row
        if not plain.any():
            return plain, np.zeros(n, np.intp)
        top, ok = _argmax(arr, self.vocab.special_mask, lambda: [it.sampling for it in items], top)
        return plain & ok, top

    def greedy_tokens(self, rows: npt.NDArray[np.float32], samplings: Callable[[], Sequence[Sampling | None]],
                      top: npt.NDArray[np.intp] | None = None) -> npt.NDArray[np.intp] | None:
        """The tokens `sample` gives rows of plain greedy sessions (their argmax), unless one is NaN or a special
        token its session may not sample (`samplings()`: each row's sampling, asked only then): None then. For
        the engine thread (a chained call's inputs, consumer/worker/chain.py): it reads only the rows, the
        vocabulary's special mask and the sessions' sampling, nothing `observe` or `sample` change, so it may
        run while the loop samples another call."""
        arr = np.asarray(rows)
        if arr.ndim != 2 or arr.shape[1] != self.vocab_size:
            return None
        got, ok = _argmax(arr, self.vocab.special_mask, samplings, _given_top(arr, top))
        return got if ok.all() else None

    def __call__(self, batch: ScheduledBatch, output: EngineOutput) -> list[int]:
        """Today's worker seam (a list of tokens). A row without a token gets the raw row's argmax, as
        before statuses existed; `sample()` says why (the worker maps it once the wire carries it)."""
        out = self.sample(batch, output)
        tokens = [int(t) for t in out.tokens]
        bad = np.flatnonzero(out.status != RowStatus.OK)
        if bad.size:
            fallback = argmax_rows(np.asarray(output.rows)[bad])
            for r, t in zip(bad.tolist(), fallback.tolist(), strict=True):
                log.warning("sampling row without a token (%s): the raw argmax stands in",
                            RowStatus(int(out.status[r])).name)
                tokens[r] = int(t)
        return tokens

    def _row(self, it: BatchItem) -> RowInput | RowStatus:
        s = it.sampling
        if s is None:
            raise ValueError(f"item of job {it.job.job_id} samples but carries no sampling parameters")
        slot = self._slots[it.slot]
        p = it.end_position
        if slot.prompt_end is None:
            slot.prompt_end = slot.prompt_len if slot.prompt_len is not None else p
        known = not slot.broken and slot.length == p
        ctx = RowContext(slot.tokens[:p], slot.prompt_end, slot.stop_tokens) if known else None
        if not s.constrained:
            return RowInput(sampling=s, position=p, context=ctx)
        if not self.vocab.grammars:
            return RowStatus.GRAMMAR_UNSUPPORTED
        if ctx is None:
            return RowStatus.NO_CONTEXT
        grammar = self._grammar(slot, s, ctx)
        if isinstance(grammar, RowStatus):
            return grammar
        return RowInput(sampling=s, position=p, context=ctx if needs_context(s) else None, grammar=grammar)

    def _grammar(self, slot: _Slot, s: Sampling, ctx: RowContext) -> Grammar | RowStatus:
        """The slot's grammar, caught up with the session's generated tokens."""
        try:
            gbnf = gbnf_of(s)
        except GrammarInvalid:
            return RowStatus.GRAMMAR_INVALID
        if slot.gbnf != gbnf:
            slot.drop_grammar()
            slot.gbnf = gbnf
            try:
                assert gbnf is not None
                slot.grammar = Grammar(self.vocab, gbnf)
            except GrammarInvalid:
                slot.grammar_failed = RowStatus.GRAMMAR_INVALID
        if slot.grammar_failed is not None:
            return slot.grammar_failed
        grammar = slot.grammar
        assert grammar is not None
        try:
            for t in ctx.tokens[ctx.prompt_end + grammar.accepted:]:
                grammar.accept(int(t))
        except GrammarRefused:
            slot.grammar_failed = RowStatus.GRAMMAR_END
            return RowStatus.GRAMMAR_END
        return grammar
