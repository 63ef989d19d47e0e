"""The Tracker's prompt check (producer/validate.py check_tokens): its fast path for plain ints answers as the
definition, one check_token per id, does: the same tuple of plain ints, or the same error naming the same token."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.validate import check_token, check_tokens
from schemas.limits import MAX_TOKEN_ID


def _definition(values: list[object], vocab: int | None) -> tuple[int, ...] | tuple[type, str]:
    try:
        return tuple(check_token(v, vocab, f"prompt tokens[{i}]") for i, v in enumerate(values))
    except (TypeError, ValueError) as e:
        return type(e), str(e)


def _fast(values: list[object], vocab: int | None) -> tuple[int, ...] | tuple[type, str]:
    try:
        return check_tokens(values, vocab)
    except (TypeError, ValueError) as e:
        return type(e), str(e)


token = st.one_of(st.integers(-3, MAX_TOKEN_ID + 3), st.integers(0, 300), st.integers(-2, 2), st.booleans(),
                  st.integers(0, 300).map(np.int32), st.integers(0, 300).map(np.int64), st.just(2.0))


@settings(max_examples=400, deadline=None)
@given(values=st.lists(token, max_size=40), vocab=st.one_of(st.none(), st.integers(1, 400)))
def test_check_tokens_answers_as_one_check_token_per_id(values: list[object], vocab: int | None) -> None:
    got, want = _fast(values, vocab), _definition(values, vocab)
    assert got == want
    if isinstance(got, tuple) and not (len(got) == 2 and isinstance(got[0], type)):
        assert all(type(t) is int for t in got)  # numpy integers come back as plain ints


@pytest.mark.parametrize("values, vocab", [([5, -1], 10), ([0, 9, 10], 10), ([MAX_TOKEN_ID + 1], None),
                                           ([0, MAX_TOKEN_ID], None), ([3, 9], 10)])
def test_the_edges_of_the_range(values: list[object], vocab: int | None) -> None:
    assert _fast(values, vocab) == _definition(values, vocab)


@pytest.mark.parametrize("values", [iter([1, 2, 3]), (1, 2, 3), [1, 2, 3], range(1, 4)])
def test_any_iterable_of_ids(values: object) -> None:
    assert check_tokens(values, 10) == (1, 2, 3)  # type: ignore[arg-type]


def test_text_is_refused() -> None:
    for text in ("abc", b"abc"):
        with pytest.raises(TypeError, match="sequence of token ids"):
            check_tokens(text, None)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(token, max_size=40), vocabs=st.lists(st.one_of(st.none(), st.integers(1, 400)), min_size=1,
                                                             max_size=4), other=st.lists(token, max_size=5))
def test_a_tuple_checked_again_answers_as_the_definition(values: list[object], vocabs: list[int | None],
                                                        other: list[object]) -> None:
    """An opening passes the tuple check_tokens returned back to it (the checks of its shape, the worker's
    vocabulary): each answer is still the definition's, whatever vocabulary, and whatever was checked between."""
    first = _fast(values, vocabs[0])
    assert first == _definition(values, vocabs[0])
    again: list[object] = list(first) if not (len(first) == 2 and isinstance(first[0], type)) else values
    held = tuple(again)
    for vocab in vocabs:
        assert _fast(held, vocab) == _definition(again, vocab)  # type: ignore[arg-type]
        _fast(other, vocab)
        assert _fast(held, vocab) == _definition(again, vocab)  # type: ignore[arg-type]
