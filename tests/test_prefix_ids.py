"""schemas/prefix.py: block ids shared exactly by the leading full blocks two prompts have in common, never
across roots (model, recipe, hop, salt); the heartbeat summary bounded and parsed defensively."""

import hashlib
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

import schemas.prefix as prefix
from schemas.prefix import (
    ID_HEX,
    SUMMARY_MAX_IDS,
    BlockIdMemo,
    PrefixSummary,
    block_ids,
    cached_blocks,
    prefix_root,
    salt_for,
)

tokens = st.lists(st.integers(0, 2**31 - 1), max_size=80)


@settings(max_examples=200, deadline=None)
@given(a=tokens, b=tokens, bt=st.integers(1, 8))
def test_ids_match_exactly_the_common_full_blocks(a, b, bt):
    root = prefix_root("0123456789abcdef")
    ia, ib = block_ids(a, root, bt), block_ids(b, root, bt)
    assert len(ia) == len(a) // bt and len(ib) == len(b) // bt
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    shared = cached_blocks(ib, set(ia))
    assert shared == min(common // bt, len(ib))
    assert all(len(i) == ID_HEX for i in ia)


@settings(max_examples=200, deadline=None)
@given(bases=st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=3),
       picks=st.lists(st.tuples(st.integers(0, 2), st.one_of(st.just(40), st.integers(0, 40)),
                                st.lists(st.integers(0, 3), max_size=24),
                                st.sampled_from([b"r" * 16, b"s" * 16]), st.integers(1, 6)), min_size=1, max_size=12),
       budget=st.sampled_from([1, 24, 1 << 20]))
def test_memo_gives_block_ids(bases, picks, budget):
    """Prompts that share prefixes of any length with earlier ones (a small alphabet: many equal blocks, prompts
    equal up to any point), other roots and block sizes, the memo under budgets that keep one prompt or all:
    always block_ids' ids, and the memo within its budget whenever it keeps more than one prompt."""
    memo = BlockIdMemo(max_tokens=budget)
    for which, cut, own, root, bt in picks:
        base = bases[which % len(bases)]
        prompt = base[:cut] + own
        assert memo(prompt, root, bt) == block_ids(prompt, root, bt)
        assert memo(tuple(prompt), root, bt) == block_ids(prompt, root, bt)
        assert memo.tokens == sum(map(_kept, memo.chains.values()))
        assert memo.tokens <= budget or len(memo.chains) == 1


@settings(max_examples=300, deadline=None)
@given(system=st.lists(st.integers(0, 3), min_size=1, max_size=60),
       turns=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), max_size=30)), min_size=1,
                      max_size=24),
       bt=st.integers(1, 6), budget=st.sampled_from([8, 60, 1 << 20]))
def test_memo_gives_block_ids_to_chats_sharing_a_system_prompt(system, turns, bt, budget):
    """Chats of one system prompt, their turns interleaved (each turn: the chat's prompt so far + new tokens):
    siblings of the trunk, chat turns going on from the last sibling or from an earlier one, the memo under
    budgets that keep one chain or all: always block_ids' ids, its kept tokens counted."""
    memo, root, chats = BlockIdMemo(max_tokens=budget), prefix_root("k"), {}
    for chat, new in turns:
        prompt = chats[chat] = chats.get(chat, system) + new
        assert memo(prompt, root, bt) == block_ids(prompt, root, bt)
        assert memo.tokens == sum(map(_kept, memo.chains.values()))


def _kept(chain):
    """The tokens a chain keeps, by definition: its trunk's and its last sibling's own part's (what it counts)."""
    assert chain[6] == len(chain[0]) + (len(chain[5][0]) if chain[5] is not None else 0)
    return chain[6]


def test_ids_are_chained_sha256_of_little_endian_int64_blocks():
    """The definition, written out apart from schemas/prefix.py (the worker's cache and every Tracker must agree
    on it): block i's id is SHA-256(parent digest + its tokens as <q), truncated to 16 bytes, as hex."""
    root = prefix_root("0123456789abcdef", "a:acct")
    assert root == hashlib.sha256(b"dgr-prefix-v1\0" + b"0123456789abcdef" + b"\0" + b"a:acct").digest()[:16]
    tokens = [5, 70000, 3, 2**40, 9, 8, 7]
    parent, want = root, []
    for i in range(0, 6, 3):
        h = hashlib.sha256(parent)
        for t in tokens[i:i + 3]:
            h.update(t.to_bytes(8, "little", signed=True))
        parent = h.digest()[:16]
        want.append(parent.hex())
    assert block_ids(tokens, root, 3) == want
    assert BlockIdMemo()(tokens, root, 3) == want


def test_siblings_keep_the_trunk_and_a_chat_turn_hashes_only_its_new_blocks():
    """One system prompt, other suffixes: the prompt that first shared the system prompt stays the trunk and only
    the last sibling's own part is kept besides; the next turn of that sibling's chat (its prompt + answer + a new
    message) takes every id it shares and hashes only its new blocks; the ids always block_ids'."""
    root, system = prefix_root("k"), list(range(100, 148))  # 3 blocks of 16
    memo = BlockIdMemo()
    prompts = [system + [i] * 20 for i in range(1, 6)]
    for p in prompts:
        assert memo(p, root) == block_ids(p, root)
    ((trunk, _, _, hint, _, last, _),) = memo.chains.values()
    assert trunk == prompts[1][:64] and hint == 3 and last is not None and last[0] == prompts[4][48:64]
    hashed: list[int] = []
    real = prefix._hashed

    def counting(tokens: Sequence[int], start: int, end: int, parent: bytes, bt: int
                 ) -> tuple[list[bytes], list[str]]:
        hashed.append((end - start) // bt)
        return real(tokens, start, end, parent, bt)

    turn = prompts[4] + [9] * 40  # the last sibling's 4 blocks, then 2 new ones
    prefix._hashed = counting
    try:
        assert memo(turn, root) == block_ids(turn, root)
        other = prompts[2] + [8] * 40  # an earlier sibling's turn: its own part hashed again, ids still right
        assert memo(other, root) == block_ids(other, root)
        on = prompts[1] + [7] * 32  # the trunk's own chat goes on: past the hint, only its 2 new blocks hashed
        assert memo(on, root) == block_ids(on, root)
    finally:
        prefix._hashed = real
    assert hashed[0] == 2 and hashed[4] == 2, hashed  # the memo's calls: 0, 2, 4 (block_ids' between)


@given(t=st.lists(st.integers(0, 1000), min_size=4, max_size=40))
def test_other_roots_share_nothing(t):
    ids = {prefix_root("k1"), prefix_root("k2"), prefix_root("k1", "salt"), prefix_root("k1", "salt2")}
    assert len(ids) == 4
    sets = [set(block_ids(t, r, 4)) for r in ids]
    for i, s in enumerate(sets):
        for other in sets[i + 1:]:
            assert not s & other


def test_summary_bounded_and_parsed_defensively():
    s = PrefixSummary.of(16, "global", (f"{i:032x}" for i in range(SUMMARY_MAX_IDS + 10)))
    assert len(s.ids) == SUMMARY_MAX_IDS
    back = PrefixSummary.parse(s.as_json())
    assert back == s
    assert PrefixSummary.parse(None) is None
    assert PrefixSummary.parse({"block_tokens": True, "ids": []}) is None
    assert PrefixSummary.parse({"block_tokens": 16, "ids": "x"}) is None
    assert PrefixSummary.parse({"block_tokens": 16, "scope": "nope", "ids": []}) is None
    assert PrefixSummary.parse({"block_tokens": 16, "scope": "salt", "ids": ["short", 5, "f" * 32]}).ids == ["f" * 32]


def test_salt_for_scopes():
    assert salt_for("global", None, "acct") == ""
    assert salt_for("account", None, "acct") == "a:acct"
    assert salt_for("salt", None, "acct") is None
    for scope in ("global", "account", "salt"):
        assert salt_for(scope, "x", "acct") == "s:x"
    # a salt can never pose as an account (or the reverse)
    assert salt_for("account", None, "x") != salt_for("global", "x", "y")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**40), max_size=120), st.sampled_from([1, 3, 16]))
def test_ids_are_the_chained_hash_of_each_block(t, bt):
    """The definition (docs/prefix-cache.md), block by block, whatever the implementation packs at once:
    block i's id is SHA-256(block i-1's id + its token ids as little-endian int64)[:16]."""
    import hashlib
    import struct

    want, parent = [], b"r" * 16
    for s in range(0, len(t) - bt + 1, bt):
        parent = hashlib.sha256(parent + struct.pack(f"<{bt}q", *t[s:s + bt])).digest()[:16]
        want.append(parent.hex())
    assert block_ids(t, b"r" * 16, bt) == want
