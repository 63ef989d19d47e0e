"""`dgr serve`'s check of a parsed body's shape (gateway/app.py `_shape_fault`): nesting deeper than MAX_BODY_DEPTH
first, then a lone UTF-16 surrogate in any key or value, by its definition (a walk of the value written here);
what the text's escapes let it skip never changes the answer."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gateway.app as app
from gateway.app import MAX_BODY_DEPTH, _shape_fault

# strings as json.loads can make them: any code point, lone surrogates included (from a \\uD800 escape)
strings = st.lists(st.characters() | st.integers(0xD800, 0xDFFF).map(chr), max_size=6).map("".join)
leaves = st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False) | strings
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(strings, inner, max_size=4), max_leaves=24)


@st.composite
def bodies(draw: st.DrawFn) -> Any:
    """A value, sometimes put at the bottom of a chain of containers around the depth bound."""
    v = draw(values)
    for _ in range(draw(st.sampled_from([0, 0, MAX_BODY_DEPTH - 2, MAX_BODY_DEPTH - 1, MAX_BODY_DEPTH,
                                         MAX_BODY_DEPTH + 1]))):
        v = [v] if draw(st.booleans()) else {draw(strings): v}
    return v


def depth(v: Any) -> int:
    """Containers nested, the outermost counted (a scalar: 0)."""
    if isinstance(v, dict):
        return 1 + max((depth(x) for x in [*v, *v.values()]), default=0)
    if isinstance(v, list):
        return 1 + max((depth(x) for x in v), default=0)
    return 0


def lone_surrogate(v: Any) -> bool:
    if isinstance(v, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in v)
    if isinstance(v, dict):
        return any(lone_surrogate(x) for x in [*v, *v.values()])
    return isinstance(v, list) and any(lone_surrogate(x) for x in v)


@settings(max_examples=250, deadline=None)
@given(bodies(), st.booleans(), st.sampled_from([None, 1]), st.booleans())
@example(["\udfff"], True, None, False)  # the ends of the range a lone surrogate's escape is in, either case
@example(["\udfff"], True, None, True)
@example({"a": "x\ud800"}, True, None, True)
@example({"a": "\udbff"}, True, None, False)
def test_a_body_is_refused_by_its_definition(value: Any, ascii_only: bool, indent: int | None, upper: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a raw surrogate: no text decoded from UTF-8 holds one (refused before)
        text = json.dumps(value, indent=indent)
    obj = json.loads(text)  # the body as parsed (an escaped surrogate pair is one character then)
    if upper:  # escapes as a client may write them: \uD800
        shouted = re.sub(r"\\u([0-9a-f]{4})", lambda m: "\\u" + m[1].upper(), text)
        text = shouted if json.loads(shouted) == obj else text  # not where it changed a string's own text
    want = "depth" if depth(obj) > MAX_BODY_DEPTH else "surrogate" if lone_surrogate(obj) else None
    assert _shape_fault(text.encode(), text, obj) == want


def test_a_prompt_of_token_ids_is_not_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The common body (a prompt of ids, a few fields) answers from its text alone."""
    walked: list[Any] = []

    def walk(obj: Any) -> bool:
        walked.append(obj)
        return False

    monkeypatch.setattr(app, "_lone_surrogate", walk)
    obj = {"model": "m", "prompt": list(range(520)), "stream": True, "stream_options": {"include_usage": True}}
    text = json.dumps(obj)
    assert _shape_fault(text.encode(), text, obj) is None and not walked
    assert _shape_fault(b'{"p": "\\ud800"}', '{"p": "\\ud800"}', {"p": "\ud800"}) is None and walked
