"""What the scheduler asks of the prefix cache (pure: no engine, no I/O) and the directives it hands the
worker with a call: restore a cached prefix into a slot before the call, save a slot's state after it.

A session's blocks are rooted in the compatibility key's prefill digest and its scope's salt
(schemas/prefix.py), so a hit is never a block of another model, recipe, hop or salt.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from schemas.prefix import Scope, block_ids, prefix_root, salt_for
from schemas.session import SessionSpec

from .store import Hit, PrefixStore

__all__ = ["PrefixPlanner", "Refill", "Restore", "Save", "common_prefix", "prompt_cap"]

# Prompts remembered to find where a new one parts from them (PrefixPlanner.parting): the last few per first
# block, for so many first blocks and so many tokens in all (the oldest first block dropped first).
PROMPTS_PER_FIRST_BLOCK = 4
FIRST_BLOCKS_KEPT = 256
PROMPT_TOKENS_KEPT = 1 << 18


@dataclass(frozen=True, slots=True)
class Restore:
    """Before the call: write `hit.entry` into `slot` and keep its first `hit.n_tokens` positions."""

    slot: int
    hit: Hit
    tokens: tuple[int, ...]  # the restored positions' token ids (the sampler's context: penalties)


@dataclass(frozen=True, slots=True)
class Save:
    """After the call succeeded: save `slot`'s state, valid (and indexed) for its first `n_tokens`."""

    slot: int
    ids: tuple[str, ...]
    n_tokens: int
    tokens: tuple[int, ...]  # the token ids of those positions (a hit compares the ones past the last block)


@dataclass(frozen=True, slots=True)
class Refill:
    """A finished session's answer under a batch-invariant recipe, before its slot is cleared: keep the slot's
    first `start` positions (its prompt rows), compute `tokens` (the answer's decoded positions) there as one
    prompt piece of two or more rows, then run `save`. A decoded position's KV is a one-row piece's, which the
    next turn's cold run does not compute; recomputed as a prompt piece it is what that run computes (any
    split into pieces of two or more rows gives the same KV: docs/invariance.md)."""

    slot: int
    start: int
    tokens: tuple[int, ...]
    save: Save


def prompt_cap(spec: SessionSpec) -> int | None:
    """Where the positions computed as prompt rows end (a replay's positions from prompt_len on were
    decoded one row each, so their KV is not what a prompt row computes: never cached nor restored)."""
    return spec.prompt_len


class PrefixPlanner:
    def __init__(self, store: PrefixStore, key_digest: str, scope: Scope, window: int = 0, *,
                 decoded: bool = False, refill: int = 0) -> None:
        self.store, self.key_digest, self.scope = store, key_digest, scope
        # Decoded positions are cached too (a recipe that is not batch-invariant: its KV of a position is the
        # same within its tolerance however it was computed), so a conversation's next turn, which re-sends
        # the answer, restores it instead of computing it (PrefixPlanning._prefix_decoded). Under a
        # batch-invariant recipe a decoded position's KV is a one-row piece's, not what the next turn's cold
        # run computes as a prompt row: never cached.
        self.decoded = decoded
        # Under a batch-invariant recipe instead: a finished session's answer, up to so many positions, is
        # recomputed as prompt rows and saved (Refill; 0: never, an engine that cannot trim a slot).
        self.refill = 0 if decoded else refill
        # A sliding-window engine's window, down to a block edge (0: none): where a piece is cut so that the
        # slot is saved trimmable; past it, checkpoints where prompts part (save; PrefixPlanning._prefix_cut).
        self.window = window // store.block_tokens * store.block_tokens
        self._window_positions = window
        # (root, first block's tokens) -> the last prompts seen starting so, with their sessions (parting)
        self._prompts: OrderedDict[tuple[bytes, tuple[int, ...]], deque[tuple[str, list[int]]]] = OrderedDict()
        self._prompt_tokens = 0

    def root(self, spec: SessionSpec) -> bytes | None:
        """The session's block root, or None when its scope does not cache it."""
        salt = salt_for(self.scope, getattr(spec, "cache_salt", None), spec.account_id)
        return None if salt is None or not self.store.enabled else prefix_root(self.key_digest, salt)

    def lookup(self, root: bytes, tokens: Sequence[int], max_tokens: int, have: int = 0) -> Hit | None:
        """The cached blocks the prompt starts with, restoring at most max_tokens positions, more than the
        `have` the slot holds."""
        bt = self.store.block_tokens
        cap = max(0, min(max_tokens, len(tokens)))
        n = cap // bt * bt
        return self.store.lookup(block_ids(tokens[:n], root, bt), cap, have, tokens[:cap])

    def wants(self, root: bytes, tokens: Sequence[int], n_tokens: int) -> bool:
        """Whether a save of the first n_tokens positions would add a block not held."""
        return self._new_blocks(root, tokens, n_tokens) is not None

    def save(self, slot: int, root: bytes, tokens: Sequence[int], n_tokens: int, *,
             parting: bool = False, tail: bool = False) -> Save | None:
        """A save of the slot after the call, when its first n_tokens positions add a block not held.
        `parting`: n_tokens is where the prompt parts from one seen before (a checkpoint past a window);
        `tail`: or positions past the last whole block (a finished session: PrefixStore.wants)."""
        if 0 < self._window_positions < n_tokens and not parting:
            # A sliding window's slot past its window cannot be trimmed back (its floor is its end): it is saved
            # only as a checkpoint where the prompt parts from one seen before (PrefixPlanning._prefix_cut ends
            # a piece there), so a prompt that shares as much restores it; a slot ending anywhere else would
            # cost a save (up to 36 ms on Gemma) that only the very same prompt could use.
            return None
        ids = self._new_blocks(root, tokens, n_tokens, tail=tail)
        if ids is None:
            return None
        n = min(n_tokens, len(tokens))  # the positions past the last whole block go with their token ids
        return Save(slot, ids, n, tuple(tokens[:n]))

    def refill_answer(self, slot: int, root: bytes, prompt: Sequence[int], answer: Sequence[int],
                      max_rows: int) -> Refill | None:
        """The Refill of a finished session whose slot holds `prompt` as prompt rows then `answer` decoded,
        computing at most max_rows of the answer, when that adds positions the store lacks (a block, or a longer
        tail past the last one). None under two rows (a prompt row is never computed alone) and past a sliding
        window (a slot there cannot be trimmed back exactly)."""
        n = min(len(answer), max_rows, self.refill)
        end = len(prompt) + n
        if n < 2 or 0 < self._window_positions < end:
            return None
        tokens = [*prompt, *answer[:n]]
        save = self.save(slot, root, tokens, end, tail=True)
        return Refill(slot, len(prompt), tuple(answer[:n]), save) if save is not None else None

    def remember(self, root: bytes, prompt: Sequence[int], session_id: str = "") -> None:
        """A whole prompt (its positions computed as prompt rows) that a later one may part from, and whose."""
        bt = self.store.block_tokens
        if len(prompt) <= bt:
            return
        key = (root, tuple(prompt[:bt]))
        kept = self._prompts.pop(key, None) or deque()
        p = list(prompt)
        if all(other != p for _, other in kept):
            kept.append((session_id, p))
            self._prompt_tokens += len(p)
            if len(kept) > PROMPTS_PER_FIRST_BLOCK:
                self._prompt_tokens -= len(kept.popleft()[1])
        self._prompts[key] = kept  # the newest last
        while len(self._prompts) > 1 and (len(self._prompts) > FIRST_BLOCKS_KEPT
                                          or self._prompt_tokens > PROMPT_TOKENS_KEPT):
            self._prompt_tokens -= sum(len(x) for _, x in self._prompts.popitem(last=False)[1])

    def shared(self, root: bytes, tokens: Sequence[int], session_id: str = "") -> bool:
        """Whether a prompt that starts as `tokens` may be shared: another session's prompt with the same first
        block is remembered, or the store holds that block (a prompt of fewer tokens: cannot tell, so yes)."""
        bt = self.store.block_tokens
        if len(tokens) < bt:
            return True
        kept = self._prompts.get((root, tuple(tokens[:bt])))
        if kept and any(owner != session_id for owner, _ in kept):
            return True
        return self.store.holds(block_ids(tokens[:bt], root, bt)[0])

    def parting(self, root: bytes, tokens: Sequence[int], lo: int, hi: int, *, whole: bool = False,
                session_id: str = "") -> int:
        """The first block edge in [lo, hi] at or before which `tokens` (a prompt's positions from 0, as far as
        they are known; `whole`: all of it) parts from a prompt remembered under the same root: that prompt
        differs there or ends there, or this one ends within it (the same prompt again: the last edge before
        its end); never its own (`session_id`'s). 0: none. Where two prompts part is where the next one sharing
        as much with either parts too (one system prompt, different questions), so a checkpoint there is what
        it restores."""
        bt = self.store.block_tokens
        kept = self._prompts.get((root, tuple(tokens[:bt]))) if len(tokens) > bt else None
        best = 0
        for owner, other in kept or ():
            if session_id and owner == session_id:
                continue  # its own prompt
            n = common_prefix(tokens, other)
            if n >= len(tokens) and not whole:
                continue  # it goes on as this one does, as far as this one is known
            if n > hi and not whole:
                continue  # they part past this piece
            edge = min(n, hi) // bt * bt  # whole: its last two rows stay computed
            if lo <= edge and (not best or edge < best):
                best = edge
        return best

    def _new_blocks(self, root: bytes, tokens: Sequence[int], n_tokens: int, *,
                    tail: bool = False) -> tuple[str, ...] | None:
        """The ids of the whole blocks in the first n_tokens positions, when they add a block the store lacks
        (`tail`: or positions past the last one); else None."""
        bt = self.store.block_tokens
        n = n_tokens // bt * bt
        if n == 0:
            return None
        ids = tuple(block_ids(tokens[:n], root, bt))
        return ids if self.store.wants(ids, min(n_tokens, len(tokens)) if tail else n, tail=tail) else None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share: a binary search of slice comparisons (each in C)."""
    x, y = (a if isinstance(a, list) else list(a)), (b if isinstance(b, list) else list(b))
    hi = min(len(x), len(y))
    if x[:hi] == y[:hi]:
        return hi
    lo = 0  # x[:lo] == y[:lo]; they differ before hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x[lo:mid] == y[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
