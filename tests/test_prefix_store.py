"""The prefix store alone (consumer/prefix/store.py): the budget holds, least recently used goes first,
a lookup finds the deepest block held of the prompt's own chain, pinned entries are not evicted, an entry
with a floor (a sliding window) is not found below it."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from consumer.prefix import PrefixStore
from schemas.prefix import block_ids, prefix_root

ROOT = prefix_root("digest", "")
B = 4


def _ids(tokens: list[int]) -> list[str]:
    return block_ids(tokens, ROOT, B)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=0, max_size=20), st.integers(1, 60),
                              st.booleans()), max_size=30),
       budget=st.integers(1, 200))
# Found by hypothesis: a re-save of a prefix evicted another entry to make room for itself.
@example(ops=[([0, 0, 0, 0], 31, True), ([1, 0, 0, 1], 1, True), ([1, 0, 0, 1], 1, True)], budget=32)
def test_budget_lru_and_longest_match(ops: list[tuple[list[int], int, bool]], budget: int) -> None:
    store = PrefixStore(budget, block_tokens=B, scope="global")
    model: list[tuple[tuple[str, ...], int]] = []  # (ids, size), least recent first: what the store should hold
    for tokens, size, is_put in ops:
        ids = _ids(tokens)
        if is_put:
            e = store.put(b"x" * size, ids, len(tokens), tokens=tokens)
            if e is not None:
                assert e.n_tokens == len(tokens) and e.tokens == tuple(tokens)
                model = [m for m in model if not set(e.ids).issuperset(m[0])]
                model.append((e.ids, size))
                while sum(s for _, s in model) > budget:
                    model.pop(0)
            else:
                assert not ids or size > budget
        else:
            hit = store.lookup(ids, len(tokens), tokens=tokens)
            want = max((k + 1 for k in range(len(ids)) for m in model if ids[k] in m[0]), default=0)
            assert (hit.blocks if hit else 0) == want
            if hit is not None:
                assert ids[hit.blocks - 1] in hit.entry.ids
                # past its whole blocks, a hit restores exactly the positions whose tokens the entry shares
                held = hit.entry.tokens
                shared = next((i for i in range(min(len(held), len(tokens))) if held[i] != tokens[i]),
                              min(len(held), len(tokens)))
                assert hit.n_tokens == shared >= hit.blocks * B
                store.let_go(hit)
                m = next(m for m in reversed(model) if ids[hit.blocks - 1] in m[0])
                model.remove(m)
                model.append(m)
        assert store.bytes <= budget
        assert store.bytes == sum(s for _, s in model)


def test_a_hit_extends_past_its_last_block_only_over_shared_tokens() -> None:
    """A conversation's next turn re-sends the answer's last, partial block: the positions past the last whole
    block are restored while their tokens match, never past max_tokens or the entry's positions, and an entry
    stored without its token ids restores whole blocks only."""
    store = PrefixStore(100, block_tokens=B)
    held = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # two blocks and two positions
    assert store.put(b"x", _ids(held), len(held), tokens=held) is not None

    def restored(prompt: list[int], max_tokens: int) -> int:
        hit = store.lookup(_ids(prompt[:max_tokens]), max_tokens, tokens=prompt[:max_tokens])
        assert hit is not None
        store.let_go(hit)
        return hit.n_tokens

    assert restored([*held, 1, 2, 3], 11) == 10  # all it holds
    assert restored([*held[:9], 1, 2, 3], 11) == 9  # up to the first token that differs
    assert restored([*held[:8], 1, 2, 3], 11) == 8  # the block edge
    assert restored([*held, 1, 2, 3], 9) == 9  # the rows that must be computed stay computed
    plain = PrefixStore(100, block_tokens=B)
    assert plain.put(b"x", _ids(held), len(held)) is not None
    hit = plain.lookup(_ids(held), len(held), tokens=held)
    assert hit is not None and hit.n_tokens == 8


def test_a_finished_answer_is_worth_saving_for_its_tail_alone() -> None:
    """A finished session's save (`tail`: its answer, restored token by token past the last whole block) is
    wanted when it holds more positions past the block than the entry held there, never for fewer or the
    same; a prefill save (no tail) only for a new block. And the planner's Refill: two rows or more, within
    a sliding window, and only when the save adds something."""
    from consumer.prefix.planner import PrefixPlanner

    store = PrefixStore(1 << 20, block_tokens=B, scope="global")
    prompt = [1, 2, 3, 4, 5, 6]
    store.put(b"x", _ids(prompt[:4]), 6, tokens=prompt)  # the prompt: one block and 2 tokens past it
    ids = _ids([*prompt, 7, 8][:4])
    assert not store.wants(ids, 7) and not store.wants(ids, 6, tail=True)
    assert store.wants(ids, 7, tail=True)
    planner, root = PrefixPlanner(store, "digest", "global", refill=64), ROOT  # scope global: no salt
    assert planner.refill_answer(0, root, prompt, [7], 64) is None  # one row: never computed alone
    r = planner.refill_answer(3, root, prompt, [7, 8, 9], 2)  # at most 2 rows now (the pacer's budget)
    assert r is not None and (r.slot, r.start, r.tokens, r.save.n_tokens) == (3, 6, (7, 8), 8)
    store.put(b"x", r.save.ids, r.save.n_tokens, tokens=r.save.tokens)
    assert planner.refill_answer(3, root, prompt, [7, 8], 64) is None  # held already
    windowed = PrefixPlanner(store, "digest", "global", window=8, refill=64)
    assert windowed.refill_answer(3, root, prompt, [7, 8, 9], 64) is None  # 9 positions: past the window
    assert PrefixPlanner(store, "digest", "global", decoded=True, refill=64).refill == 0


def test_a_refill_that_fails_stores_nothing_and_raises_nothing() -> None:
    """The refill runs on the release path: an engine that refuses the trim or fails the piece loses the
    entry (logged), never the release (consumer/prefix/run.py refill_finished)."""
    from consumer.engines.base import EngineError
    from consumer.prefix.planner import PrefixPlanner
    from consumer.prefix.run import refill_finished

    class Failing:
        def __init__(self, where: str) -> None:
            self.where, self.saved = where, 0

        def keep_prefix(self, slot: int, n_tokens: int) -> None:
            if self.where == "trim":
                raise EngineError("refused", (slot,))

        def forward(self, batch: object) -> None:
            raise EngineError("failed", (0,))

        def save_prefix(self, slot: int) -> bytes:
            self.saved += 1
            return b"x"

    store = PrefixStore(1 << 20, block_tokens=B, scope="global")
    refill = PrefixPlanner(store, "digest", "global", refill=64).refill_answer(1, ROOT, [1, 2, 3], [4, 5, 6], 64)
    assert refill is not None
    for where in ("trim", "forward"):
        engine = Failing(where)
        refill_finished(engine, store, refill)
        assert engine.saved == 0 and len(store) == 0 and store.stats.refilled_tokens == 0


def test_pinned_entry_survives_and_is_not_overfilled() -> None:
    store = PrefixStore(10, block_tokens=B)
    a = _ids([1, 1, 1, 1])
    assert store.put(b"x" * 8, a, 4) is not None
    hit = store.lookup(a, 4)
    assert hit is not None
    assert store.put(b"y" * 8, _ids([2, 2, 2, 2]), 4) is None  # the pinned one stays; no room
    store.let_go(hit)
    assert store.put(b"y" * 8, _ids([2, 2, 2, 2]), 4) is not None
    assert store.lookup(a, 4) is None
    assert store.stats.evictions == 1


def test_floor_hides_blocks_below_it() -> None:
    store = PrefixStore(100, block_tokens=B)
    toks = list(range(16))
    store.put(b"z", _ids(toks), 16, floor=9)  # exact only when trimmed to 12 or 16 positions
    assert store.lookup(_ids(toks[:8]), 8) is None
    hit = store.lookup(_ids(toks), 16)
    assert hit is not None and hit.n_tokens == 16
    hit = store.lookup(_ids(toks), 15)
    assert hit is not None and hit.n_tokens == 12


def test_another_root_never_hits() -> None:
    store = PrefixStore(100, block_tokens=B)
    toks = list(range(8))
    store.put(b"z", _ids(toks), 8)
    assert store.lookup(block_ids(toks, prefix_root("digest", "a:other"), B), 8) is None
    assert store.lookup(block_ids(toks, prefix_root("other-digest", ""), B), 8) is None


def test_a_cancelled_sessions_pending_restore_unpins() -> None:
    """A session cancelled after its lookup hit and before its restore ran leaves no pinned entry."""
    from consumer.prefix.planner import PrefixPlanner, Restore
    from consumer.sched.state import SessionQueue

    store = PrefixStore(100, block_tokens=B)
    toks = list(range(8))
    store.put(b"z", _ids(toks), 8)
    hit = store.lookup(_ids(toks), 8)
    assert hit is not None and hit.entry.pins == 1

    class _S:
        prefix = PrefixPlanner(store, "digest", "global")

    lane = SessionQueue.__new__(SessionQueue)
    lane.pending_restore = Restore(0, hit, tuple(toks))
    from consumer.sched.state import SchedulerState

    SchedulerState._drop_restore(_S(), lane)  # type: ignore[arg-type]
    assert hit.entry.pins == 0 and lane.pending_restore is None


def test_inspect_shows_an_engines_prefix_cache() -> None:
    """dgr inspect: a heartbeat engine's `prefix_cache` counters become a 'prefix cache' table; junk dropped."""
    import io

    from rich.console import Console

    from consumer.ops.inspect import WorkerReport, _engine_summary, render

    raw = {"engine": "tiny", "prefix_cache": {"hits": 3, "misses": 1, "hit_tokens": 96, "bytes": 4096,
                                               "evictions": 2, "bogus": "x"}}
    e = _engine_summary(raw)
    assert e is not None and e["prefix_cache"] == {"hits": 3, "misses": 1, "hit_tokens": 96, "bytes": 4096,
                                                   "evictions": 2}
    assert _engine_summary({"engine": "tiny", "prefix_cache": "junk"})["prefix_cache"] is None  # type: ignore[index]
    buf = io.StringIO()
    render([WorkerReport("w1", True, True, 0.1, engines=[e])], Console(file=buf, width=200))
    out = buf.getvalue()
    assert "prefix cache" in out and "4096" in out and "96" in out
