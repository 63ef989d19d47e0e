"""`python -m dgrtools.bench.serve_app` runs `dgr serve`'s app in-process against its stub answers: every request
answered 200 with its stream, and the requests leave the garbage collector nothing (no object in a cycle: a
request's objects are freed by their counts)."""

from __future__ import annotations

from dgrtools.bench.serve_app import measure


def test_the_app_alone_answers_and_leaves_no_garbage() -> None:
    r = measure(streams=16, rounds=10, repeats=2)
    assert r["requests"] == 320 and r["us_per_request"] > 0
    assert r["collections"] == [0, 0, 0] and r["unreachable"] == 0, (r["collections"], r["unreachable"])
