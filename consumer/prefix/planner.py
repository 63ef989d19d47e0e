"""What the scheduler asks of the prefix cache (pure: no engine, no I/O) and the directives it hands the
worker with a call: restore a cached prefix into a slot before the call, save a slot's state after it.

A session's blocks are rooted in the compatibility key's prefill digest and its scope's salt
(schemas/prefix.py), so a hit is never a block of another model, recipe, hop or salt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from schemas.prefix import Scope, block_ids, prefix_root, salt_for
from schemas.session import SessionSpec

from .store import Hit, PrefixStore

__all__ = ["PrefixPlanner", "Restore", "Save", "prompt_cap"]


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


def prompt_cap(spec: SessionSpec) -> int | None:
    """Where the positions computed as prompt rows end (a replay's positions from prompt_len on were
    decoded one row each, so their KV is not what a prompt row computes: never cached nor restored)."""
    return spec.prompt_len


class PrefixPlanner:
    def __init__(self, store: PrefixStore, key_digest: str, scope: Scope, window: int = 0, *,
                 decoded: bool = False) -> None:
        self.store, self.key_digest, self.scope = store, key_digest, scope
        # Decoded positions are cached too (a recipe that is not batch-invariant: its KV of a position is the
        # same within its tolerance however it was computed), so a conversation's next turn, which re-sends
        # the answer, restores it instead of computing it (PrefixPlanning._prefix_decoded). Under a
        # batch-invariant recipe a decoded position's KV is a one-row piece's, not what the next turn's cold
        # run computes as a prompt row: never cached.
        self.decoded = decoded
        # A sliding-window engine's window, down to a block edge (0: none): the spacing of the checkpoints saved
        # past it (save; PrefixPlanning._prefix_cut).
        self.window = window // store.block_tokens * store.block_tokens
        self._window_positions = window

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

    def save(self, slot: int, root: bytes, tokens: Sequence[int], n_tokens: int) -> Save | None:
        """A save of the slot after the call, when its first n_tokens positions add a block not held."""
        if 0 < self._window_positions < n_tokens and (not self.window or n_tokens % self.window):
            # A sliding window's slot past its window cannot be trimmed back (its floor is its end): it is saved
            # only as a checkpoint at a multiple of the window (PrefixPlanning._prefix_cut ends pieces there),
            # so a prompt that shares a long prefix restores the last checkpoint in it; a slot ending anywhere
            # else would cost a save that only the very same prompt could use.
            return None
        ids = self._new_blocks(root, tokens, n_tokens)
        if ids is None:
            return None
        n = min(n_tokens, len(tokens))  # the positions past the last whole block go with their token ids
        return Save(slot, ids, n, tuple(tokens[:n]))

    def _new_blocks(self, root: bytes, tokens: Sequence[int], n_tokens: int) -> tuple[str, ...] | None:
        """The ids of the whole blocks in the first n_tokens positions, when they add a block the store lacks;
        else None."""
        bt = self.store.block_tokens
        n = n_tokens // bt * bt
        if n == 0:
            return None
        ids = tuple(block_ids(tokens[:n], root, bt))
        return ids if self.store.wants(ids, n) else None
