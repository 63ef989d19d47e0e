"""The scheduler's side of the prefix cache on a sliding-window engine (consumer/sched/prefix_plan.py), pure:
a cacheable prompt's piece ends on the window's edge only while that saves something. A later session whose
first job ends on the edge (the producer's chunks) restores it whole once the blocks up to it are held and
computes only the rest, in the same prefill turn."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.prefix import PrefixStore
from consumer.prefix.planner import PrefixPlanner, Save
from consumer.sched import ScheduledBatch, Scheduler
from schemas import StepJob
from schemas.prefix import block_ids
from tests.test_scheduler import DIGESTS, admit, make, opening, prefill, run, spec

WINDOW = 64
PROMPT = tuple(range(3, 83))  # 80 tokens: a first job of 64 (the window) and a second of 16 that samples


def _scheduler() -> tuple[Scheduler, PrefixStore]:
    s = make(n_slots=2, ctx=256, max_tokens_per_call=128, vocab=100, prefill_budget=128)
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
    s, store = _scheduler()
    _open(s, "a")
    first = _call(s, store)  # the first session: cut on the edge, saved there
    assert [it.n_tokens for it in first.items] == [WINDOW] and [x.n_tokens for x in first.saves] == [WINDOW]
    rest = _call(s, store)  # the rest, sampled; nothing saved past the edge (the slot could not be trimmed back)
    assert [it.n_tokens for it in rest.items] == [16] and not rest.saves
    _open(s, "b")
    b = _call(s, store)
    # its first job restored whole (64: up to the edge, answered by an item of no rows), then 64..80 computed
    assert [r.hit.n_tokens for r in b.restores] == [64]
    assert [(it.n_tokens, it.completes_job) for it in b.items if it.session_id == "b"] == [(0, True), (16, True)]
    assert len(b.fused) == 16
    assert any(it.samples for it in b.items) and not b.saves


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
        assert not floor or n % window == 0, "past the window only checkpoints at its multiples are saved"
        e = store.put(b"state", save.ids, n, floor=floor, tokens=save.tokens)
        if e is not None:
            saved[id(e)] = (slots[slot][:n], floor)

    for k, (length, chunk, max_tokens) in enumerate(sessions):
        sid = f"s{k}"
        common = length * share // 4  # of the prompt shared with the other sessions (4: all of it)
        prompt = tuple(shared[:common] + [rng.randrange(3, 100) for _ in range(length - common)])
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
            for slot in s.drain_released():
                finished = s.finished_save(slot)
                if finished is not None:
                    check_save(finished)
                slots[slot] = []
                s.slot_cleared(slot)


def test_past_the_window_checkpoints_at_its_multiples_are_restored_whole() -> None:
    """A 160-token prompt on a window of 64: its pieces end at 64 and 128 and are saved there (64 trimmable, 128
    a checkpoint whose floor is its end); a later prompt sharing 150 tokens restores the checkpoint whole (128),
    never trimmed to a block edge below it, and a prompt sharing 120 restores only the trimmable 64."""
    s, store = _scheduler()
    long = tuple(3 + i * 37 % 97 for i in range(160))  # token ids within the vocabulary of 100

    def run_prompt(sid: str, prompt: tuple[int, ...]) -> list[ScheduledBatch]:
        assert admit(s, opening(sid, prompt, sample=True, max_tokens=1)) is None
        out = []
        while (b := s.next_batch()) is not None:
            run(s, b)
            for save in b.saves:
                floor = 0 if save.n_tokens <= WINDOW else save.n_tokens
                store.put(b"state", save.ids, save.n_tokens, floor=floor, tokens=save.tokens)
            out.append(b)
            for slot in s.drain_released():
                s.slot_cleared(slot)
        return out

    first = run_prompt("a", long)
    assert [it.n_tokens for b in first for it in b.items] == [64, 64, 32]
    assert [x.n_tokens for b in first for x in b.saves] == [64, 128]
    later = run_prompt("b", (*long[:150], 1, 2))
    assert [r.hit.n_tokens for b in later for r in b.restores] == [128]
    other = run_prompt("c", long[:120] + (2,) * 32)
    assert [r.hit.n_tokens for b in other for r in b.restores] == [64]
