"""Content-addressed prompt blocks: the one definition the worker's prefix cache and the Tracker's placement
share (docs/prefix-cache.md, docs/placement.md).

A prompt is cut into blocks of `block_tokens` token ids; only full blocks have ids. Block i's id hashes block
i-1's id, block i's token ids, and (for block 0, through the root) everything that changes its KV: the
compatibility key's prefill digest (engine, recipe, boundary schema with the hop's block range, state layout)
and the sharing scope's salt. So two prompts share exactly the leading blocks whose ids match, and never a
block of another model, recipe, hop or salt. SHA-256 as vLLM (Python's `hash()` is salted per process and
collides), truncated to 16 bytes: a collision needs ~2^64 blocks.

A worker advertises a bounded summary of the ids it holds (`PrefixSummary`, in its heartbeat under
`prefix`, one per engine lane or for its first engine); the Tracker computes a prompt's ids with the same
function (`prefix_root(key digest, salt_for(scope, spec.cache_salt, account))`) and counts the leading ones a
worker holds (`cached_blocks`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

BLOCK_TOKENS = 16  # vLLM's default block size; a worker advertises its own in its summary
SUMMARY_MAX_IDS = 4096  # ids in one heartbeat summary at most (16 bytes each as hex: ~135 kB)
ID_HEX = 32  # an id's length as hex

Scope = Literal["account", "salt", "global"]
SCOPES: tuple[Scope, ...] = ("account", "salt", "global")


def salt_for(scope: Scope, cache_salt: str | None, account_id: str) -> str | None:
    """The salt a session's blocks are rooted in: its own `cache_salt` when set; otherwise its account under
    scope `account`, "" (shared by every session without a salt) under scope `global`, and None (not cached
    at all) under scope `salt`, which shares only between sessions that name the same salt."""
    if cache_salt:
        return "s:" + cache_salt
    if scope == "account":
        return "a:" + account_id
    if scope == "global":
        return ""
    return None


def prefix_root(key_digest: str, salt: str = "") -> bytes:
    """The parent of block 0: the compatibility key's prefill-phase digest and the scope's salt (the
    session's `cache_salt`, its account under scope `account`, "" under scope `global`)."""
    return hashlib.sha256(b"dgr-prefix-v1\0" + key_digest.encode() + b"\0" + salt.encode()).digest()[:16]


def block_ids(tokens: Sequence[int], root: bytes, block_tokens: int = BLOCK_TOKENS) -> list[str]:
    """The ids (hex) of the prompt's full blocks, in order; block i's id covers tokens[: (i + 1) * block_tokens]."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    n = len(tokens) - len(tokens) % block_tokens
    return _hashed(tokens, 0, n, root, block_tokens)[1]


Chain = tuple[list[int], list[bytes], list[str], int, list[int], "tuple[list[int], list[bytes], list[str]] | None", int]


class BlockIdMemo:
    """`block_ids` for a caller that sees the same leading blocks again and again (the Tracker's placement: one
    system prompt on every chat, earlier turns re-sent): it keeps a prompt per (root, block size, first block)
    with its ids, and a prompt that starts as that one takes the ids of the blocks they share and hashes only
    the rest. The kept prompt (the trunk) is replaced by the last one seen, unless that one is a sibling (it
    parts from the trunk where the trunk parted from the one before it: one system prompt, another suffix):
    then only the sibling's own part is kept (a small copy, not the whole prompt's: a placement 30-33 µs against
    28-29, docs/placement.md), as the last sibling, so that the next
    turn of its chat (its prompt, answer and a new message) also hashes only its new blocks. The same ids as
    `block_ids` (tests/test_prefix_ids.py); bounded by `max_tokens` (the tokens kept, the least recently used
    chain dropped first)."""

    def __init__(self, max_tokens: int = 1 << 20) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        # (root, block size, first block) -> the trunk: its tokens, block digests and ids, how many blocks it
        # shared with the prompt before it (where the next is likely to part from it too) and those blocks' tokens
        # (a copy, so that a sibling is compared with one slice of its own, not two); and the last sibling's own
        # part (from that block on): its tokens, digests and ids, or None; and the tokens it keeps (trunk and sibling)
        self.chains: dict[tuple[bytes, int, tuple[int, ...]], Chain] = {}

    def __call__(self, tokens: Sequence[int], root: bytes, block_tokens: int = BLOCK_TOKENS) -> list[str]:
        bt = block_tokens
        if bt < 1:
            raise ValueError(f"block_tokens must be >= 1, got {bt}")
        n = len(tokens) - len(tokens) % bt
        if n == 0:
            return []
        # slices of a list compare in C (a tuple never equals a list)
        toks = tokens if isinstance(tokens, list) else list(tokens)
        key = (root, bt, tuple(toks[:bt]))
        chain = self.chains.pop(key, None)
        if chain is not None:
            self.tokens -= chain[6]
            k = _shared_blocks(toks, chain[0], bt, chain[3], chain[4])
            if k == chain[3] and k * bt < min(n, len(chain[0])):  # a sibling
                chain, ids = self._sibling(chain, toks, n, bt, k)
                self._keep(key, chain)
                return ids
            parents, ids = chain[1][:k], chain[2][:k]
        else:
            k, parents, ids = 0, [], []
        new_parents, new_ids = _hashed(toks, k * bt, n, parents[-1] if parents else root, bt)
        parents += new_parents
        ids += new_ids
        trunk = toks[:n]  # a copy: the caller's list is its own
        self._keep(key, (trunk, parents, ids, k, trunk[:k * bt], None, n))
        return list(ids)

    @staticmethod
    def _sibling(chain: Chain, toks: list[int], n: int, bt: int, k: int) -> tuple[Chain, list[str]]:
        """A sibling's ids: the trunk's first k, then those it shares with the last sibling's own part (a chat's
        earlier turn), then its own blocks hashed; the chain with it as the last sibling."""
        at = k * bt
        own = toks[at:n]  # a copy, kept as the last sibling
        last = chain[5]
        j = _shared_blocks(own, last[0], bt) if last is not None and own[0] == last[0][0] \
            and own[:bt] == last[0][:bt] else 0
        if j:
            assert last is not None
            parents, ids = last[1][:j], last[2][:j]
            new_parents, new_ids = _hashed(own, j * bt, len(own), parents[-1], bt)
            parents += new_parents
            ids += new_ids
        else:
            parents, ids = _hashed(own, 0, len(own), chain[1][k - 1], bt)
        return (*chain[:5], (own, parents, ids), len(chain[0]) + len(own)), chain[2][:k] + ids

    def _keep(self, key: tuple[bytes, int, tuple[int, ...]], chain: Chain) -> None:
        self.chains[key] = chain  # the newest last: the oldest is dropped first
        self.tokens += chain[6]
        while self.tokens > self.max_tokens and len(self.chains) > 1:
            self.tokens -= self.chains.pop(next(iter(self.chains)))[6]


def _hashed(tokens: Sequence[int], start: int, end: int, parent: bytes, bt: int) -> tuple[list[bytes], list[str]]:
    """The digests and ids of the blocks tokens[start:end] (whole blocks), the first one's parent `parent`: each
    block's id is SHA-256 of its parent's digest and its token ids as little-endian int64, truncated to 16 bytes."""
    # The range packed once, each block a slice of it: half the cost of a pack per block (placement hashes every
    # prompt it places, docs/placement.md); one buffer per hash, a third cheaper than two updates; the ids mapped
    # in C once the chain is hashed.
    data = struct.pack(f"<{end - start}q", *(tokens if start == 0 and end == len(tokens) else tokens[start:end]))
    step = 8 * bt
    sha256 = hashlib.sha256
    parents: list[bytes] = []
    for s in range(0, len(data), step):
        parent = sha256(parent + data[s:s + step]).digest()[:16]
        parents.append(parent)
    return parents, list(map(bytes.hex, parents))


def _shared_blocks(a: list[int], b: list[int], bt: int, hint: int = 0, head: list[int] | None = None) -> int:
    """The number of leading blocks of `bt` tokens a and b have in common, the first known equal: `hint` (where
    b parted from the prompt before it: one system prompt, other suffixes; `head`: b's first `hint` blocks'
    tokens) tried first, then a binary search of slice comparisons (each in C)."""
    m = min(len(a), len(b)) // bt
    h = hint * bt
    if 0 < hint < m and (a[h] != b[h] or a[h:h + bt] != b[h:h + bt]) and a[:h] == (b[:h] if head is None else head):
        return hint
    if a[:m * bt] == b[:m * bt]:
        return m
    lo, hi = 1, m - 1  # blocks [0, lo) equal; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo * bt:mid * bt] == b[lo * bt:mid * bt]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def cached_blocks(ids: Sequence[str], held: set[str] | frozenset[str]) -> int:
    """How many of the prompt's leading blocks are in `held` (a prefix match: the first miss ends it)."""
    n = 0
    for i in ids:
        if i not in held:
            break
        n += 1
    return n


class PrefixSummary(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a worker advertises of its prefix cache: its block size and the ids of the blocks it holds,
    most recently used first, at most SUMMARY_MAX_IDS (a bounded input for placement, not an exact view)."""

    block_tokens: int
    scope: Scope
    ids: list[str]

    @staticmethod
    def of(block_tokens: int, scope: Scope, ids: Iterable[str], limit: int = SUMMARY_MAX_IDS) -> PrefixSummary:
        out: list[str] = []
        for i in ids:
            if len(out) >= limit:
                break
            out.append(i)
        return PrefixSummary(block_tokens=block_tokens, scope=scope, ids=out)

    def as_json(self) -> dict[str, object]:
        return {"block_tokens": self.block_tokens, "scope": self.scope, "ids": list(self.ids)}

    def version(self) -> str:
        """A digest of what the summary says: equal summaries, equal versions."""
        h = hashlib.sha256(f"{self.block_tokens}\0{self.scope}\0".encode())
        h.update("\n".join(self.ids).encode())
        return h.hexdigest()[:ID_HEX]

    def ref(self) -> dict[str, object]:
        """What the heartbeat carries in place of the ids (they are at WorkerKeys.prefix_summary): a few
        bytes a beat instead of up to ~135 kB, parsed by every Tracker at every read of the fleet."""
        return {"block_tokens": self.block_tokens, "scope": self.scope, "n": len(self.ids), "version": self.version()}

    @staticmethod
    def ref_version(raw: object) -> str | None:
        """The version a heartbeat's `prefix` names when it is a ref (`ref()`), else None."""
        if isinstance(raw, dict) and "ids" not in raw:
            v = raw.get("version")
            return v if isinstance(v, str) and len(v) == ID_HEX else None
        return None

    @staticmethod
    def parse(raw: object) -> PrefixSummary | None:
        """From a heartbeat's `prefix` value; None when absent or malformed (a worker's summary is advisory:
        placement without it falls back to load alone)."""
        if not isinstance(raw, dict):
            return None
        bt, scope, ids = raw.get("block_tokens"), raw.get("scope"), raw.get("ids")
        if not isinstance(bt, int) or isinstance(bt, bool) or bt < 1 or not isinstance(ids, list):
            return None
        if scope not in SCOPES:
            return None
        good = [i for i in ids[:SUMMARY_MAX_IDS] if isinstance(i, str) and len(i) == ID_HEX]
        return PrefixSummary(block_tokens=bt, scope=scope, ids=good)
