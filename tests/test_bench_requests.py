"""`dgr bench requests` (dgrtools/bench/requests.py): every request it times answers the same both ways (the
bench checks the replies of the two ways equal, round by round), and each way's figure is a time it took."""

from __future__ import annotations

import pytest

from dgrtools.bench import requests as bench


def test_each_request_answers_the_same_both_ways_and_is_timed() -> None:
    got = bench.measure(rounds=6)
    assert set(got) == {"ping", "read ahead (16)", "read ahead (1)", "completion script", "tracker read",
                        "tracker pushes (16)", "hand-over"}
    assert all(v["redis-py"] > 0 and v["kept"] > 0 for v in got.values())


def test_two_ways_that_answer_differently_are_refused() -> None:
    with pytest.raises(AssertionError, match="answered differently"):
        bench._alternated(2, {"a": lambda: 1, "b": lambda: 2})
