"""The worker's prefix cache: saved sequence states in host RAM, indexed by content-addressed block id
(schemas/prefix.py), within a byte budget, least recently used evicted first (docs/prefix-cache.md).

An entry is one slot's whole saved state (the engine's `save_prefix`) after a prefill call, valid for its
first `n_tokens` positions; it is indexed under the ids of the blocks it covers and keeps those positions'
token ids. A hit on block k of an entry restores the entry and trims it (`restore_prefix`) to (k + 1) *
block_tokens positions and then past them while the prompt's tokens equal the entry's, so one long entry
serves every shorter prompt that shares its leading tokens. An id points to the most recently
saved entry that covers it. Entries are pinned (`hold` / `let_go`) while a restore uses them: eviction
skips a pinned entry (a Hit keeps its bytes alive in any case). An entry whose blocks a newer, longer one
all covers is dropped when that one is stored. Pure Python, no engine: the scheduler asks it (loop thread),
the worker fills it (the compute thread): one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

from schemas.prefix import BLOCK_TOKENS, Scope

__all__ = ["CacheStats", "Entry", "Hit", "PrefixStore"]


@dataclass(eq=False, slots=True)
class Entry:
    data: bytes
    n_tokens: int  # positions of `data` that are cacheable (whole blocks of them are indexed)
    ids: tuple[str, ...]  # ids of the blocks it is indexed under (those it can be trimmed to), in order
    # The token ids of its cacheable positions: a hit on its blocks extends token by token past the last block
    # the prompt shares whole (a conversation's next turn re-sends the answer's last, partial block).
    tokens: tuple[int, ...] = ()
    pins: int = 0


@dataclass(frozen=True, slots=True)
class Hit:
    """A restore: write `entry.data` into the slot, keep `n_tokens` positions (`blocks` whole blocks, then the
    tokens past them that the prompt shares with the entry)."""

    entry: Entry
    blocks: int
    n_tokens: int


@dataclass(slots=True)
class CacheStats:
    lookups: int = 0  # prompts looked up
    hits: int = 0  # lookups that restored at least one block
    misses: int = 0
    hit_tokens: int = 0  # prompt tokens restored instead of computed
    saved: int = 0  # entries stored
    evictions: int = 0  # entries evicted for the budget
    too_big: int = 0  # entries refused: larger than the whole budget
    refilled_tokens: int = 0  # finished answers' positions recomputed as prompt rows to be saved (Refill)

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("lookups", "hits", "misses", "hit_tokens", "saved", "evictions",
                                              "too_big", "refilled_tokens")}


class PrefixStore:
    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS, scope: Scope = "account") -> None:
        if budget_bytes < 0 or block_tokens < 1:
            raise ValueError("budget_bytes must be >= 0 and block_tokens >= 1")
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self.scope: Scope = scope
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # id(entry) -> entry, least recent first
        self._by_block: dict[str, Entry] = {}
        self.bytes = 0
        self.stats = CacheStats()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: Sequence[str], max_tokens: int, have: int = 0, tokens: Sequence[int] = ()) -> Hit | None:
        """The longest run of the prompt's leading blocks held, then as many of the prompt's `tokens` past them
        as the entry holds too, restoring at most `max_tokens` positions (the caller keeps the rows that must
        be computed) and more than the `have` its slot holds, pinned: the caller must `let_go(hit)` once the
        restore ran or was dropped. None: a miss."""
        with self._lock:
            return self._lookup(ids, max_tokens, have, tokens)

    def _lookup(self, ids: Sequence[str], max_tokens: int, have: int, tokens: Sequence[int]) -> Hit | None:
        self.stats.lookups += 1
        best: Hit | None = None
        # The deepest block held wins: an entry indexed under block k's id holds blocks < k too (ids are
        # chained hashes), even where it is not indexed under them (a sliding window's floor).
        for k in range(min(len(ids), max_tokens // self.block_tokens) - 1, -1, -1):
            e = self._by_block.get(ids[k])
            if e is not None:
                best = Hit(e, k + 1, _common_end(e.tokens, tokens, (k + 1) * self.block_tokens,
                                                 min(max_tokens, e.n_tokens)))
                break
        if best is None or best.n_tokens <= have:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.hit_tokens += best.n_tokens - have
        best.entry.pins += 1
        self._entries.move_to_end(id(best.entry))
        return best

    def holds(self, block_id: str) -> bool:
        """Whether an entry is indexed under the block (no pin, no counters: a question, not a lookup)."""
        with self._lock:
            return block_id in self._by_block

    def let_go(self, hit: Hit) -> None:
        with self._lock:
            hit.entry.pins = max(0, hit.entry.pins - 1)

    def wants(self, ids: Sequence[str], n_tokens: int, *, tail: bool = False) -> bool:
        """Whether an entry of `n_tokens` positions would add a block not held (worth saving); with `tail`, also
        when it holds more positions past its last whole block than the entry held there (a finished answer:
        the next turn restores them token by token)."""
        n = min(len(ids), n_tokens // self.block_tokens)
        with self._lock:
            held = self._by_block.get(ids[n - 1]) if self.enabled and n > 0 else None
            return self.enabled and n > 0 and (held is None or (tail and held.n_tokens < n_tokens))

    def put(self, data: bytes, ids: Sequence[str], n_tokens: int, floor: int = 0,
            tokens: Sequence[int] = ()) -> Entry | None:
        """Store a saved state valid for its first n_tokens positions (whose token ids are `tokens`, when
        given: a hit may then restore past its last whole block), under the ids of the whole blocks in them
        that end at or past `floor` (the fewest positions it can be trimmed to exactly); evict least recently
        used unpinned entries to stay within the budget. None when nothing was stored (no whole block, or
        larger than the budget)."""
        with self._lock:
            return self._put(data, ids, n_tokens, floor, tuple(tokens[:n_tokens]))

    def _put(self, data: bytes, ids: Sequence[str], n_tokens: int, floor: int,
             tokens: tuple[int, ...]) -> Entry | None:
        n = min(len(ids), n_tokens // self.block_tokens)
        lo = max(0, -(-floor // self.block_tokens) - 1)  # first block k with (k + 1) * block_tokens >= floor
        if n == 0 or lo >= n or not self.enabled:
            return None
        if len(data) > self.budget_bytes:
            self.stats.too_big += 1
            return None
        # Positions past the last whole block count only with their token ids (what a hit compares).
        e = Entry(data=data, n_tokens=max(n * self.block_tokens, len(tokens)), ids=tuple(ids[lo:n]), tokens=tokens)
        # Entries every block of which is in e are redundant once e is stored (no id points at them any more):
        # their bytes count as free room, so a re-save of the same prefix never evicts another entry to make
        # room for itself.
        covered = set(e.ids)
        redundant = [old for old in {self._by_block[i] for i in e.ids if i in self._by_block}
                     if not old.pins and covered.issuperset(old.ids)]
        self._make_room(len(data) - sum(len(old.data) for old in redundant), spare={id(old) for old in redundant})
        if self.bytes - sum(len(old.data) for old in redundant) + len(data) > self.budget_bytes:
            self.stats.too_big += 1  # everything left is pinned
            return None
        for old in redundant:
            del self._entries[id(old)]
            self.bytes -= len(old.data)
        self._entries[id(e)] = e
        self.bytes += len(data)
        for i in e.ids:
            self._by_block[i] = e
        self.stats.saved += 1
        return e

    def held_ids(self) -> Iterator[str]:
        """Block ids held, most recently used entry first (each entry's ids deepest first)."""
        seen: set[str] = set()
        with self._lock:
            entries = list(reversed(self._entries.values()))
        for e in entries:
            for i in reversed(e.ids):
                if i not in seen and self._by_block.get(i) is e:
                    seen.add(i)
                    yield i

    def _make_room(self, need: int, spare: Collection[int] = ()) -> None:
        """Evict least recently used entries (not pinned, not in `spare`) until `need` more bytes fit."""
        for key in list(self._entries):
            if self.bytes + need <= self.budget_bytes:
                return
            e = self._entries[key]
            if e.pins or key in spare:
                continue
            self._evict(key, e)

    def _evict(self, key: int, e: Entry) -> None:
        del self._entries[key]
        self.bytes -= len(e.data)
        for i in e.ids:
            if self._by_block.get(i) is e:
                # Another entry may cover the same block: point at the most recent one that does.
                del self._by_block[i]
        for other in reversed(self._entries.values()):
            for i in other.ids:
                self._by_block.setdefault(i, other)
        self.stats.evictions += 1


def _common_end(held: Sequence[int], prompt: Sequence[int], start: int, limit: int) -> int:
    """How far from `start` (the end of the whole blocks a hit shares) the entry's tokens and the prompt's
    agree, up to `limit` positions: a position restored past a block edge is one whose token is the same."""
    n = start
    end = min(limit, len(held), len(prompt))
    while n < end and held[n] == prompt[n]:
        n += 1
    return n
