"""consumer/prefill_shape.py: whatever the budgets and however the prompt arrives, no prompt row is
computed alone (a 1-token prompt excepted), every replayed generated row is, and nothing waits forever."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.sched.prefill_shape import MIN_BUDGET, piece_rows


@settings(max_examples=400, deadline=None)
@given(prompt=st.integers(1, 200), generated=st.integers(0, 20), known=st.booleans(),
       arrivals=st.lists(st.integers(1, 64), min_size=1, max_size=40),
       budgets=st.lists(st.integers(1, 80), min_size=1, max_size=40))
def test_pieces_follow_the_rule_and_finish(prompt: int, generated: int, known: bool, arrivals: list[int],
                                           budgets: list[int]) -> None:
    total = prompt + generated
    prompt_end_spec = prompt if known else None
    queued, pos, calls = 0, 0, 0
    pieces: list[tuple[int, int]] = []
    a = iter(arrivals)
    while pos < total:
        calls += 1
        assert calls < 10_000, "stuck"
        if queued < total:  # more of the prefill arrives (the last chunk samples: the end is then known)
            queued = min(total, queued + next(a, total))
        prompt_end = prompt_end_spec
        if queued == total:  # the sampling job is queued
            prompt_end = total if prompt_end is None else min(prompt_end, total)
        budget = max(MIN_BUDGET, budgets[calls % len(budgets)])
        n = piece_rows(pos, budget, queued, prompt_end)
        assert 0 <= n <= max(budget, 1) and pos + n <= queued
        if n:
            pieces.append((pos, n))
            pos += n
    # what the rule promises, given where the prompt really ends (the spec's prompt_len when it had one)
    real_end = prompt if known else total
    for start, n in pieces:
        if start < real_end:
            assert start + n <= real_end, "a piece crosses from the prompt into generated tokens"
            assert n >= 2 or real_end == 1, f"prompt row {start} computed alone"
        else:
            assert n == 1, f"generated rows {start}..{start + n} computed together"


def test_unknown_end_keeps_one_token_back() -> None:
    assert piece_rows(0, 512, 10, None) == 9
    assert piece_rows(9, 512, 10, None) == 0  # one token left and the end unknown: wait
    assert piece_rows(9, 512, 11, 11) == 2


def test_never_leaves_one_prompt_row() -> None:
    assert piece_rows(0, 99, 100, 100) == 98  # 99 would leave one row
    assert piece_rows(0, 64, 64, 65) == 63  # the producer's last chunk is one token
    assert piece_rows(0, 3, 3, 3) == 3
    assert piece_rows(0, 512, 1, 1) == 1  # a 1-token prompt
    assert piece_rows(50, 512, 70, 50) == 1  # a replayed generated token
