"""The scheduler's side of the prefix cache on a sliding-window engine (consumer/sched/prefix_plan.py), pure:
a cacheable prompt's piece ends on the window's edge, and past it where the prompt parts from one seen before,
only while that saves something. A later session whose
first job ends on the edge (the producer's chunks) restores it whole once the blocks up to it are held and
computes only the rest, in the same prefill turn."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.prefix import PrefixStore
from consumer.prefix.planner import PrefixPlanner, Refill, Save, common_prefix
from consumer.sched import ScheduledBatch, Scheduler
from schemas import StepJob
from schemas.prefix import block_ids
from tests.test_scheduler import DIGESTS, admit, make, opening, prefill, run, spec

WINDOW = 64
PROMPT = tuple(range(3, 83))  # 80 tokens: a first job of 64 (the window) and a second of 16 that samples


def _scheduler(n_slots: int = 2) -> tuple[Scheduler, PrefixStore]:
    s = make(n_slots=n_slots, ctx=256, max_tokens_per_call=128, vocab=100, prefill_budget=128)
    store = PrefixStore(1 << 20)
    s.prefix = PrefixPlanner(store, "00000000000000aa", "global", WINDOW)
    return s, store


def _open(s: Scheduler, sid: str) -> None:
    assert admit(s, opening(sid, PROMPT[:WINDOW], sample=False, max_tokens=4)) is None
    assert admit(s, prefill(sid, WINDOW, PROMPT[WINDOW:])) is None


def _call(s: Scheduler, store: PrefixStore) -> ScheduledBatch:
    """The next batch, run as the worker would: its saves stored after it."""
    b = s.next_batch()
    assert b is not None
    run(s, b)
    for save in b.saves:
        store.put(b"state", save.ids, save.n_tokens, tokens=save.tokens)
    return b


def test_a_piece_crosses_the_window_edge_once_the_blocks_up_to_it_are_held() -> None:
    s, store = _scheduler(n_slots=3)
    _open(s, "a")
    first = _call(s, store)  # a prompt no other session sent: not cut on the edge, not saved (past the window)
    assert [it.n_tokens for it in first.items] == [WINDOW, 16] and not first.saves
    _open(s, "b")
    cut = _call(s, store)  # the second session sharing its first block: cut on the edge, saved there
    assert [it.n_tokens for it in cut.items] == [WINDOW] and [x.n_tokens for x in cut.saves] == [WINDOW]
    rest = _call(s, store)  # the rest, sampled; nothing saved past the edge (the slot could not be trimmed back)
    assert [it.n_tokens for it in rest.items] == [16] and not rest.saves
    _open(s, "c")
    c = _call(s, store)
    # its first job restored whole (64: up to the edge, answered by an item of no rows), then 64..80 computed
    assert [r.hit.n_tokens for r in c.restores] == [64]
    assert [(it.n_tokens, it.completes_job) for it in c.items if it.session_id == "c"] == [(0, True), (16, True)]
    assert len(c.fused) == 16
    assert any(it.samples for it in c.items) and not c.saves


def test_a_prompt_in_pieces_is_saved_at_its_end_unless_another_session_may_share_it() -> None:
    """A prompt computed in pieces (a budget of 16 rows, no window) saves its slot once, after its last piece, while
    no other session sent a prompt with its first block: each save of the same slot covers the one before. Once one
    did (a second session of that first block opened), the pieces in between are saved too (a third one may
    restore what the first computed so far)."""
    s = make(n_slots=3, ctx=256, max_tokens_per_call=128, vocab=100, prefill_budget=16)
    store = PrefixStore(1 << 20)
    s.prefix = PrefixPlanner(store, "00000000000000aa", "global")
    prompt = tuple(3 + i % 90 for i in range(64))

    def saves_of(sid: str, tokens: tuple[int, ...]) -> list[int]:
        out = []
        assert admit(s, opening(sid, tokens, max_tokens=1)) is None
        while (b := s.next_batch()) is not None:
            run(s, b)
            for save in b.saves:
                store.put(b"state", save.ids, save.n_tokens, tokens=save.tokens)
            out += [x.n_tokens for x in b.saves]
            for slot in s.drain_released():
                s.slot_cleared(slot)
        return out

    assert saves_of("a", (*prompt, 1)) == [65]  # pieces of 16, 16, 16, 17: saved once, whole
    # another session's prompt of the same first block seen: b (its first block restored) saves each piece
    s.prefix.remember(s.prefix.root(spec("b")) or b"", [*prompt, 9], "other")
    assert saves_of("b", (*prompt[:16], *(50 + i % 40 for i in range(48)), 2)) == [32, 48, 65]


def test_a_long_prompt_nobody_else_sent_is_not_cut_on_the_window_edge() -> None:
    """Cutting on the edge costs a prefill turn; it pays only when another prompt restores the save. A prompt whose
    first block no other session sent and the store does not hold runs whole; the same session sent again (a
    replay under its id) neither; a held first block is reason enough."""
    s, store = _scheduler()
    _open(s, "a")
    assert [it.n_tokens for it in _call(s, store).items] == [WINDOW, 16]
    planner = s.prefix
    assert planner is not None
    root = planner.root(spec("x"))
    assert root is not None and not planner.shared(root, PROMPT, "a") and planner.shared(root, PROMPT, "z")
    other = tuple(range(90, 10, -1))
    assert not planner.shared(root, other, "z")
    store.put(b"state", block_ids(other[:16], root, 16), 16, tokens=other[:16])
    assert planner.shared(root, other, "z")


@settings(max_examples=80, deadline=None)
@given(sessions=st.lists(st.tuples(st.integers(1, 150), st.integers(1, 150), st.integers(1, 40)), min_size=1,
                         max_size=3),
       window=st.sampled_from([0, WINDOW]), budget=st.integers(3, 128), seed=st.integers(0, 1 << 16),
       share=st.integers(1, 4))
def test_every_save_and_restore_names_what_the_slot_holds(sessions: list[tuple[int, int, int]], window: int,
                                                          budget: int, seed: int, share: int) -> None:
    """Counterexample search for the saves (a recipe that caches decoded positions: PrefixPlanner.decoded): any
    prompts (length, producer chunk, how much of it is shared), answers (a continuation job for the rest, fed
    the session's own tokens), prefill budgets and windows (past a window, checkpoints at its multiples),
    sessions one after the other on two slots so later ones hit earlier ones.
    Against a model of each slot built from the fused calls' rows alone (slot, position, token): every save,
    after a prefill call or of a finished session's slot, is indexed by the blocks of exactly the tokens its
    slot holds, and every restore writes the tokens of the save it came from."""
    s = make(n_slots=2, ctx=256, max_tokens_per_call=128, vocab=100, prefill_budget=budget)
    store = PrefixStore(1 << 20)
    s.prefix = PrefixPlanner(store, "00000000000000aa", "global", window, decoded=True)
    rng = random.Random(seed)
    shared = [rng.randrange(3, 100) for _ in range(150)]
    slots: dict[int, list[int]] = {0: [], 1: []}
    saved: dict[int, tuple[list[int], int]] = {}  # id(entry) -> the tokens its slot held, the floor it was stored with
    root = s.prefix.root(spec("x", account="acct"))
    assert root is not None

    def check_save(save: Save) -> None:
        slot, n = save.slot, save.n_tokens
        assert list(save.ids) == block_ids(slots[slot][:n], root), (slot, n)
        assert list(save.tokens) == slots[slot][:n], (slot, n)  # the positions past the last block too
        end = len(slots[slot])  # the engine's floor (LlamaCppEngine.prefix_floor): past the window, its end
        floor = 0 if not window or end <= window else end
        # past the window only checkpoints, where the prompt parts from an earlier one
        assert not floor or n in partings, (n, partings)
        e = store.put(b"state", save.ids, n, floor=floor, tokens=save.tokens)
        if e is not None:
            saved[id(e)] = (slots[slot][:n], floor)

    earlier: list[tuple[int, ...]] = []
    for k, (length, chunk, max_tokens) in enumerate(sessions):
        sid = f"s{k}"
        common = length * share // 4  # of the prompt shared with the other sessions (4: all of it)
        prompt = tuple(shared[:common] + [rng.randrange(3, 100) for _ in range(length - common)])
        partings = {min(common_prefix(prompt, e), length - 2) // 16 * 16 for e in earlier}
        earlier.append(prompt)
        for at in range(0, length, chunk):
            part = prompt[at:at + chunk]
            job = opening(sid, part, sample=at + chunk >= length, max_tokens=max_tokens) if at == 0 else \
                prefill(sid, at, part, sample=at + chunk >= length)
            assert admit(s, job) is None
        if max_tokens > 1:
            assert admit(s, StepJob(job_id=f"c{k}", session_id=sid, phase="decode", compat=DIGESTS["decode"],
                                    start_position=length, tokens=(), n=min(64, max_tokens - 1),
                                    created_at=0.0)) is None
        while (b := s.next_batch()) is not None:
            for r in b.restores:
                held, floor = saved[id(r.hit.entry)]
                assert list(r.tokens) == held[:r.hit.n_tokens]
                assert r.hit.n_tokens >= floor, "a checkpoint is restored whole or not at all"
                slots[r.slot] = list(r.tokens)
            for slot, pos, tok in zip(b.fused.slots.tolist(), b.fused.positions.tolist(), b.fused.tokens.tolist(),
                                      strict=True):
                del slots[slot][pos:]
                assert len(slots[slot]) == pos, "a row past the slot's end"
                slots[slot].append(tok)
            run(s, b, target=lambda sid, pos: 3 + (pos * 31 + 7 * int(sid[1:]) + seed) % 97)
            for save in b.saves:
                check_save(save)
            for slot, finished in s.finished_saves(s.drain_released()):
                if finished is not None:
                    check_save(finished)
                slots[slot] = []
                s.slot_cleared(slot)


def test_where_prompts_part_past_the_window_a_checkpoint_is_saved_and_restored_whole() -> None:
    """One system prompt of 150 tokens, other questions (window 64): the first prompt runs whole, unsaved (no other
    session sent one like it: no cut on the window's edge, and past it no one is known to share it); the second
    ends a piece on the edge and saves it (64, trimmable), ends another at 144 (the last block edge before the
    two part) and saves a checkpoint there; the third restores the 144 whole and computes only the rest; a
    fourth sharing 120 cannot use it (a checkpoint is restored whole or not at all): it restores 64 and saves
    where it parts, at 112."""
    s, store = _scheduler()
    system = tuple(3 + i * 37 % 97 for i in range(150))

    def run_prompt(sid: str, prompt: tuple[int, ...]) -> tuple[list[int], list[int], list[int]]:
        assert admit(s, opening(sid, prompt, sample=True, max_tokens=1)) is None
        restores, pieces, saves = [], [], []
        while (b := s.next_batch()) is not None:
            run(s, b)
            for save in b.saves:
                store.put(b"state", save.ids, save.n_tokens, floor=0 if save.n_tokens <= WINDOW else save.n_tokens,
                          tokens=save.tokens)
            restores += [r.hit.n_tokens for r in b.restores]
            pieces += [it.n_tokens for it in b.items if it.n_tokens]
            saves += [x.n_tokens for x in b.saves]
            for slot in s.drain_released():
                s.slot_cleared(slot)
        return restores, pieces, saves

    assert run_prompt("a", (*system, *(5,) * 10)) == ([], [128, 32], [])
    assert run_prompt("b", (*system, *(6,) * 10)) == ([], [64, 80, 16], [64, 144])
    assert run_prompt("c", (*system, *(7,) * 12)) == ([144], [18], [])
    assert run_prompt("d", (*system[:120], *(8,) * 30)) == ([64], [48, 38], [112])


def test_parting_is_where_a_remembered_prompt_of_the_same_root_parts_and_memory_is_bounded() -> None:
    from consumer.prefix import planner as pl

    store = PrefixStore(1 << 20)
    p = PrefixPlanner(store, "00000000000000aa", "global", WINDOW)
    root, other_root = b"r" * 16, b"o" * 16
    system = list(range(3, 103))  # 100 tokens
    p.remember(root, [*system, 1, 1, 1])
    assert p.parting(root, [*system, 2, 2, 2], 0, 200) == 96  # they part at 100: the block edge before it
    assert p.parting(root, [*system, 2, 2, 2], 0, 95) == 0  # not within [lo, hi]
    assert p.parting(root, [*system, 1], 0, 200) == 0  # it goes on as the remembered one, as far as known
    assert p.parting(root, [*system, 1, 1, 1, 4, 4], 0, 200) == 96  # the remembered prompt ends at 103
    assert p.parting(other_root, [*system, 2, 2, 2], 0, 200) == 0  # another root learns nothing from it
    # the same prompt again, whole: the last block edge its two last rows leave
    assert p.parting(root, [*system, 1, 1, 1], 0, 200) == 0
    assert p.parting(root, [*system, 1, 1, 1], 0, 101, whole=True) == 96
    assert pl.common_prefix([1, 2, 3], (1, 2, 4)) == 2 and pl.common_prefix([1, 2], [1, 2, 3]) == 2
    for k in range(pl.FIRST_BLOCKS_KEPT + 10):  # past both bounds (~2,000 tokens each), each its own first block
        p.remember(root, [k, *system] * 20)
    assert p._prompt_tokens <= pl.PROMPT_TOKENS_KEPT and len(p._prompts) <= pl.FIRST_BLOCKS_KEPT
    assert p._prompt_tokens == sum(len(x) for kept in p._prompts.values() for _, x in kept)
    p.remember(root, [*system, 9, 9], "s1")
    assert p.parting(root, [*system, 9, 9], 0, 101, whole=True, session_id="s1") == 0  # never its own prompt
    assert p.parting(root, [*system, 9, 9], 0, 100, whole=True, session_id="s2") == 96


def _finish_together(n_sessions: int, also_decoding: bool) -> list[object]:
    """Sessions of their own 20-token prompts, 6 tokens each, run in lockstep to their end (one more, with 40
    tokens to go, when `also_decoding`): what the scheduler keeps of the finished ones at the release."""
    s = make(n_slots=n_sessions + 1, ctx=256, max_tokens_per_call=128, vocab=100, prefill_budget=128)
    store = PrefixStore(1 << 20)
    s.prefix = PrefixPlanner(store, "00000000000000aa", "global", refill=128)
    sids = [f"s{k}" for k in range(n_sessions)] + (["long"] if also_decoding else [])
    for k, sid in enumerate(sids):
        prompt = tuple(3 + (7 * k + i) % 90 for i in range(20))
        max_tokens = 40 if sid == "long" else 6
        assert admit(s, opening(sid, prompt, max_tokens=max_tokens)) is None
        assert admit(s, StepJob(job_id=f"c-{sid}", session_id=sid, phase="decode", compat=DIGESTS["decode"],
                                start_position=20, tokens=(), n=max_tokens - 1, created_at=0.0)) is None
    released: list[int] = []
    while not released and (b := s.next_batch()) is not None:
        _ = run(s, b)
        for save in b.saves:
            store.put(b"state", save.ids, save.n_tokens, tokens=save.tokens)
        released = s.drain_released()
    assert len(released) == n_sessions, released  # the short ones ended in one call
    return [kept for _, kept in s.finished_saves(released, 128)]


def test_a_release_refills_one_finished_answer_and_only_on_an_idle_engine() -> None:
    """Scheduler.finished_saves under a batch-invariant recipe: a wave of sessions ending in one call gets one
    Refill (of its answer's 5 fed positions after its 20 prompt rows), not one each; with a session still
    decoding, none (the refill would stand in front of its next call)."""
    kept = _finish_together(3, also_decoding=False)
    refills = [k for k in kept if isinstance(k, Refill)]
    assert len(refills) == 1 and (refills[0].start, len(refills[0].tokens)) == (20, 5), kept
    assert not any(isinstance(k, Refill) for k in _finish_together(3, also_decoding=True))
