"""Lua in one place: every script a file under consumer/lua/, and the completion's ARGV layout, named once
in Python, agrees with the header of complete.lua and with the offsets its body reads."""

from __future__ import annotations

import re
from importlib import resources

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.lua import SCRIPTS, load_lua, script_source
from consumer.transport import COMPLETE_ARGV, FIXED_KEYS
from consumer.transport.publish import DEAD_LETTER_ARGV


def _names(text: str) -> list[str]:
    """`a, b ('x', y), c` -> [a, b, c]: the names of a comma list, parentheticals dropped."""
    text = re.sub(r"\([^)]*\)", "", text)
    text = re.sub(r"\s+", " ", text.replace("--", " "))
    return [n.strip() for n in text.split(",") if n.strip()]


def _header() -> str:
    lines = [ln for ln in load_lua("complete").splitlines() if ln.startswith("--")]
    return "\n".join(lines)


def test_every_lua_file_is_part_of_a_script() -> None:
    files = {p.name[:-4] for p in resources.files("consumer.lua").iterdir() if p.name.endswith(".lua")}
    used = {part for parts in SCRIPTS.values() for part in parts}
    assert files == used
    for name in SCRIPTS:
        assert script_source(name).strip()


def test_completion_head_matches_the_header() -> None:
    head = re.search(r"-- ARGV\[1\](.*?), then the records", _header(), re.S)
    assert head is not None
    slots = re.findall(r"\[(\d+)\] ([^,\[]+?)(?=,|$|\s*\n)", "[1]" + head.group(1))
    assert [int(i) for i, _ in slots] == list(range(1, len(COMPLETE_ARGV) + 1))
    assert tuple(re.sub(r"\s*\(.*", "", n).strip() for _, n in slots) == COMPLETE_ARGV


def test_completion_keys_and_dead_letters_match_the_header() -> None:
    header = _header()
    keys = re.search(r"-- KEYS\[1\](.*?), \[9\.\.\]", header, re.S)
    assert keys is not None
    names = [re.sub(r"^\[\d+\] ", "", n) for n in _names("[1]" + keys.group(1))]
    expected = ("worker hash", "billing accounts index set", "dead-letter stream", "lease", "lease epoch", "tally",
                "call guard", "moved")
    assert tuple(names) == expected and len(FIXED_KEYS) == len(expected)
    m = re.search(r"-- Dead letter \((\d+) \+ 2\*nf ARGV\): (.*?)(, then nf field/value pairs)\.\n", header, re.S)
    assert m is not None
    assert int(m.group(1)) == len(DEAD_LETTER_ARGV)
    assert tuple(_names(m.group(2))) == DEAD_LETTER_ARGV


def test_the_body_reads_what_the_layout_names() -> None:
    body = "\n".join(ln for ln in script_source("complete").splitlines() if not ln.startswith("--"))
    head = {int(i) for i in re.findall(r"ARGV\[(\d+)\]", body)}
    assert head == set(range(1, len(COMPLETE_ARGV) + 1))
    # A dead letter's fields are read at offsets 0..len-1 of its place.
    offsets = {int(k) for k in re.findall(r"ARGV\[i \+ (\d+)\]", body)}
    assert offsets == set(range(1, len(DEAD_LETTER_ARGV)))


def test_fakeredis_answers_like_redis_where_the_scripts_rely_on_it(redis_client: redis.Redis) -> None:
    """tests/fixtures/fakeredis_compat.py: the workarounds live there, not in consumer/."""
    with pytest.raises(redis.ResponseError, match="NOGROUP"):
        redis_client.xreadgroup("g", "c", {"missing": ">"})
    redis_client.xadd("s", {"a": "1"})
    redis_client.xgroup_create("s", "g", id="0")
    redis_client.xreadgroup("g", "c", {"s": ">"})
    shape = redis_client.eval(
        "local r = redis.call('XREADGROUP', 'GROUP', 'g', 'c', 'STREAMS', 's', '0')\n"
        "return {type(r[1]), r[1][1], #r[1][2]}", 0)
    assert shape == [b"table", b"s", 1]


_TALLY_VALUES = st.tuples(*[st.integers(-(2**53), 2**53) for _ in range(7)],
                          st.floats(allow_nan=False, width=64) | st.sampled_from([0.0, -0.0, 5e-324, 1e308]),
                          st.integers(0, 2**40), st.text("0123456789:,-", max_size=40),
                          st.text("abcdefghij-_.", max_size=30), st.text("0123456789:,-", max_size=40))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=_TALLY_VALUES)
def test_the_tally_layout_reads_back_the_same_in_python_and_in_lua(redis_client: redis.Redis,
                                                                   values: tuple) -> None:  # type: ignore[type-arg]
    """The tally entry (schemas/accounting.py) packed by the scripts' `struct` (a real redis-server's, and
    tests/fixtures/lua_struct.py's on fakeredis) is byte for byte what Python packs, and reads back."""
    from schemas.accounting import TALLY_FIELDS, TALLY_LUA_FORMAT, pack_tally, parse_tally

    *nums, es, t, gaps, account, owed = values
    fields = dict(zip(TALLY_FIELDS, [*nums, es, t, gaps, account, owed], strict=True))
    want = pack_tally(fields)
    got = redis_client.eval(
        "return struct.pack(ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), "
        "tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]), "
        "#ARGV[11], ARGV[11], #ARGV[12], ARGV[12], #ARGV[13], ARGV[13])", 0, TALLY_LUA_FORMAT,
        *[str(n) for n in nums], repr(es), str(t), gaps, account, owed)
    assert got == want
    back = redis_client.eval("local t = {struct.unpack(ARGV[1], ARGV[2])} for i = 1, #t do "
                             "t[i] = type(t[i]) == 'number' and string.format('%.17g', t[i]) or t[i] end return t",
                             0, TALLY_LUA_FORMAT, want)
    assert [x.decode() for x in back[:12]] == [*[str(n) for n in nums], _g(es), str(t), gaps, account, owed]
    assert int(back[12]) == len(want) + 1  # unpack's next position
    parsed = parse_tally(want)
    assert parsed is not None and float(parsed["engine_seconds"]) == es and parsed["owed"] == owed


def _g(x: float) -> str:
    return f"{x:.17g}"
