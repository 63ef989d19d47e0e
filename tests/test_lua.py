"""Lua in one place: every script a file under consumer/lua/, and the completion's ARGV layout, named once
in Python, agrees with the header of complete.lua and with the offsets its body reads."""

from __future__ import annotations

import re
from importlib import resources

import pytest
import redis

from consumer.lua import SCRIPTS, load_lua, script_source
from consumer.transport import COMPLETE_ARGV, COMPLETION_ARGV, DEAD_LETTER_ARGV, FUSED_CALL_ARGV


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
    head = re.search(r"-- ARGV\[1\](.*?)\.\n-- Completion", _header(), re.S)
    assert head is not None
    slots = re.findall(r"\[(\d+)\] ([^,\[]+?)(?=,|\.?$|\s*\n)", "[1]" + head.group(1))
    assert [int(i) for i, _ in slots] == list(range(1, len(COMPLETE_ARGV) + 1))
    assert tuple(re.sub(r"\s*\(.*", "", n).strip() for _, n in slots) == COMPLETE_ARGV


def test_completion_records_match_the_header() -> None:
    header = _header()
    for title, layout in (("Completion", COMPLETION_ARGV), ("Dead letter", DEAD_LETTER_ARGV),
                          ("Fused call", FUSED_CALL_ARGV)):
        m = re.search(rf"-- {title} \((\d+)( \+ 2\*nf)?\): (.*?)(, then nf field/value pairs)?\.\n", header, re.S)
        assert m is not None, title
        assert int(m.group(1)) == len(layout), title
        assert tuple(_names(m.group(3))) == layout, title


def test_the_body_reads_what_the_layout_names() -> None:
    body = "\n".join(ln for ln in load_lua("complete").splitlines() if not ln.startswith("--"))
    head = {int(i) for i in re.findall(r"ARGV\[(\d+)\]", body)}
    assert head == set(range(1, len(COMPLETE_ARGV) + 1))
    offsets = [int(k) for k in re.findall(r"ARGV\[i \+ (\d+)\]", body)]
    # The three loops read offsets 0..n-1 of their record (the completion's is the longest).
    assert max(offsets) == len(COMPLETION_ARGV) - 1
    assert set(range(1, len(COMPLETION_ARGV))) <= set(offsets)


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
