"""The lexical rules of docs/wire-format.md (wire version 2), one rejection test each, and the round trip
they must keep."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    Accounting,
    Reason,
    RouteHop,
    SessionSpec,
    Status,
    StepJob,
    StepResult,
    WireError,
    cancel_from_fields,
    cancel_to_fields,
    job_from_fields,
    job_to_fields,
    results_from_fields,
    results_to_fields,
)
from schemas.limits import is_id
from tests.support import compat_key

KEY = compat_key("prefill")


def opening(sid: str = "s-1", jid: str = "j-1") -> StepJob:
    spec = SessionSpec(session_id=sid, account_id="acct", route=(RouteHop(worker_id="w1", key=KEY),))
    return StepJob(job_id=jid, session_id=sid, phase="prefill", compat=KEY.digest, start_position=0,
                   tokens=(5, 17, 300), created_at=time.time(), session=spec)


def decode(pos: int = 3) -> StepJob:
    return StepJob(job_id="j-2", session_id="s-1", phase="decode", compat=compat_key("decode").digest,
                   start_position=pos, tokens=(42,), created_at=1796007616.08, reply_to="t-1")


def body_with(job: StepJob, **change: Any) -> dict[str, str]:
    """The job's entry with keys of its JSON body changed (a value of DELETE: the key removed)."""
    f = job_to_fields(job)
    body = json.loads(f["j"])
    for k, v in change.items():
        if v is DELETE:
            body.pop(k, None)
        else:
            body[k] = v
    return {**f, "j": json.dumps(body)}


DELETE = object()


@pytest.mark.parametrize("value", ["s-1\n", "s-1\r\n", " s-1", "s-1 ", "", "-s", "a}{b", "a*", "s/1", "é",
                                   "x" * 65, "s\x00", "ｓ-1", 5, None])
@pytest.mark.parametrize("name", ["session_id", "job_id", "reply_to"])
def test_ids_match_in_full(name: str, value: object) -> None:
    with pytest.raises(WireError) as e:
        job_from_fields(body_with(decode(), **{name: value}))
    assert e.value.reason == Reason.MALFORMED
    # the other ids are still handed back (so the session can be told), the bad one never
    assert getattr(e.value, name) is None
    for other in {"job_id", "session_id", "reply_to"} - {name}:
        assert getattr(e.value, other) == getattr(decode(), other)


@pytest.mark.parametrize("value", ["12", 12.0, 1e3, True, -1, None, [12], 1 << 21])
@pytest.mark.parametrize("name", ["pos", "hop", "attempt", "n"])
def test_integers_are_json_integers_in_range(name: str, value: object) -> None:
    with pytest.raises(WireError) as e:
        job_from_fields(body_with(decode(), **{name: value}))
    assert e.value.reason == Reason.MALFORMED and e.value.session_id == "s-1" and e.value.job_id == "j-2"


@pytest.mark.parametrize("value", ["5,17", [5, "17"], [5, 17.0], [5, -1], [2**31], [True], {"0": 5}, None])
def test_tokens_are_a_list_of_token_ids(value: object) -> None:
    with pytest.raises(WireError) as e:
        job_from_fields(body_with(opening(), tokens=value))
    assert e.value.reason == Reason.MALFORMED


def test_too_many_tokens_is_too_long() -> None:
    with pytest.raises(WireError) as e:
        job_from_fields(body_with(opening(), tokens=[1] * 4097))
    assert e.value.reason == Reason.TOO_LONG


@pytest.mark.parametrize("value", ["true", 1, 0, "1", None])
def test_booleans_are_json_booleans(value: object) -> None:
    with pytest.raises(WireError):
        job_from_fields(body_with(opening(), sample=value))


@pytest.mark.parametrize("value", ["1.5", -1.0, None, "nan", [1.0]])
def test_created_at_is_a_finite_number(value: object) -> None:
    with pytest.raises(WireError):
        job_from_fields(body_with(decode(), created_at=value))


def test_nan_and_infinity_are_not_json() -> None:
    f = job_to_fields(decode())
    for bad in ("NaN", "Infinity", "-Infinity", "1e999"):
        j = f["j"].replace('"created_at":1796007616.08', f'"created_at":{bad}')
        assert j != f["j"]
        with pytest.raises(WireError):
            job_from_fields({**f, "j": j})


@pytest.mark.parametrize("mutate, reason", [
    (lambda f: f.update({"v": "1"}), Reason.SCHEMA_VERSION),
    (lambda f: f.update({"v": "2 "}), Reason.SCHEMA_VERSION),
    (lambda f: f.update({"v": "3"}), Reason.SCHEMA_VERSION),
    (lambda f: f.pop("v"), Reason.MALFORMED),
    (lambda f: f.pop("j"), Reason.MALFORMED),
    (lambda f: f.update({"extra": "1"}), Reason.MALFORMED),
    (lambda f: f.update({"j": f["j"] + " x"}), Reason.MALFORMED),
    (lambda f: f.update({"j": "[]"}), Reason.MALFORMED),
    (lambda f: f.update({"j": json.dumps({**json.loads(f["j"]), "phase": "Prefill"})}), Reason.MALFORMED),
    (lambda f: f.update({"j": json.dumps({**json.loads(f["j"]), "compat": "EC717CD4BB14A369"})}), Reason.MALFORMED),
    (lambda f: f.update({"j": json.dumps({**json.loads(f["j"]), "hop": 16})}), Reason.MALFORMED),
    (lambda f: f.update({"j": json.dumps({**json.loads(f["j"]), "brand_new": 1})}), Reason.MALFORMED),
])
def test_other_fields_by_their_rule(mutate: Callable[[dict[str, str]], None], reason: Reason) -> None:
    f = job_to_fields(opening())
    mutate(f)
    with pytest.raises(WireError) as e:
        job_from_fields(f)
    assert e.value.reason == reason


def test_a_version_1_entry_is_refused_by_version_and_its_session_told() -> None:
    v1 = {b"v": b"1", b"job_id": b"j-9", b"session_id": b"s-9", b"phase": b"decode", b"tokens": b"5"}
    with pytest.raises(WireError) as e:
        job_from_fields(v1)
    assert e.value.reason == Reason.SCHEMA_VERSION and (e.value.session_id, e.value.job_id) == ("s-9", "j-9")


def test_non_utf8_bodies_and_too_many_fields_are_malformed() -> None:
    f: dict[bytes, bytes] = {k.encode(): v.encode() for k, v in job_to_fields(decode()).items()}
    with pytest.raises(WireError) as e:
        job_from_fields({**f, b"j": f[b"j"].replace(b'"pos":3', b'"pos":"\xff\xfe"')})
    assert e.value.reason == Reason.MALFORMED
    with pytest.raises(WireError, match="fields, more than"):
        job_from_fields({**f, **{f"x{i}".encode(): b"1" for i in range(40)}})
    with pytest.raises(WireError, match="over"):
        job_from_fields({**f, b"j": b" " * (64 * 1024 + 1)})


def test_the_cross_field_rules_of_a_job() -> None:
    for change in ({"tokens": [1, 2]}, {"sample": False}, {"session": opening().session.model_dump(mode="json")},
                   {"hidden": {"v": 1}}):
        with pytest.raises(WireError):
            job_from_fields(body_with(decode(), **change))
    with pytest.raises(WireError):
        job_from_fields(body_with(opening(), session=DELETE))
    with pytest.raises(WireError):
        job_from_fields(body_with(opening(), session=None))  # an absent field is left out, never null


@pytest.mark.parametrize("fields, message", [
    ({b"session_id": b"\xff\xfe"}, "not an id"),
    ({b"session_id": b"s-1\n"}, "not an id"),
    ({b"session_id": b"a}{b"}, "not an id"),
    ({}, "not an id"),
    ({b"session_id": b"s-1", b"extra": b"1"}, "unknown cancellation fields"),
    ({b"\xc3\xa9": b"s-1"}, "not ASCII"),
])
def test_cancellation_entries(fields: dict[bytes, bytes], message: str) -> None:
    with pytest.raises(WireError, match=message):
        cancel_from_fields(fields)


def test_cancellation_round_trip_and_refusal_to_write_a_bad_id() -> None:
    assert cancel_from_fields({k.encode(): v.encode() for k, v in cancel_to_fields("s-1").items()}) == "s-1"
    with pytest.raises(ValueError):
        cancel_to_fields("s-1\n")


def _record(change: dict[str, Any] | None = None, charges: dict[str, Any] | None = None) -> dict[bytes, bytes]:
    r = StepResult(job_id="j-1", session_id="s-1", status=Status.OK, position=4, token=9, worker_id="w1",
                   accounting=Accounting(generated_tokens=1))
    f = results_to_fields([r])
    rec, chg = json.loads(f[b"r"]), json.loads(f[b"c"])
    rec.update(change or {})
    chg.update(charges or {})
    return {b"v": b"2", b"r": json.dumps(rec).encode(), b"c": json.dumps(chg).encode()}


def test_results_are_parsed_as_strictly() -> None:
    r = StepResult(job_id="j-1", session_id="s-1", status=Status.OK, position=4, token=9, worker_id="w1")
    assert results_from_fields(results_to_fields([r])) == [r]
    assert results_from_fields(_record())[0].token == 9
    for change in ({"fin": ["yes"]}, {"pos": ["4"]}, {"tok": [9.0]}, {"st": [7]}, {"st": [-1]}, {"x": {"5": {}}},
                   {"sid": ["s-1", "s-2"]}, {"extra": 1}, {"off": [True]}):
        with pytest.raises(WireError):
            results_from_fields(_record(change))
    # k (cached, a part of p): one per row, never above the row's prompt charge
    assert results_from_fields(_record(charges={"p": [3], "k": [2]}))[0].accounting.cached_tokens == 2
    for charges in ({"p": [0, 0]}, {"d": [3]}, {"g": ["1"]}, {"z": []}, {"p": [3], "k": [4]}, {"k": [0, 0]},
                    {"p": [3], "k": [-1]}):
        with pytest.raises(WireError):
            results_from_fields(_record(charges=charges))
    with pytest.raises(WireError) as e:
        results_from_fields({**_record(), b"v": b"1"})
    assert e.value.reason == Reason.SCHEMA_VERSION


def test_the_record_keeps_the_short_names_of_wire_version_2() -> None:
    """Columns have full names in code (schemas/wire.py ResultRecord); the bytes are those of wire version 2,
    and an optional column travels only when a row has a value (`pc`: prefill_calls)."""
    r = StepResult(job_id="j-1.3", session_id="s-1", status=Status.OK, position=4, token=9, worker_id="w1",
                   batch_size=2, accounting=Accounting(prompt_tokens=1, engine_seconds=0.5))
    raw = results_to_fields([r], call="3:7")[b"r"]
    assert raw == (b'{"worker":"w1","call":"3:7","batch":2,"sid":["s-1"],"job":["j-1"],"off":[3],"att":[0],"st":[0],'
                   b'"pos":[4],"frm":[3],"tok":[9],"fin":[0],"fed":[1],"es":[0.5],"x":{}}')
    rows = [r, msgspec.structs.replace(r, job_id="j-2", prefill_calls=3)]
    fields = results_to_fields(rows)
    assert json.loads(fields[b"r"])["pc"] == [0, 3]
    assert [x.prefill_calls for x in results_from_fields(fields)] == [0, 3]
    for pc in ([1], ["1"], [1, 2, 3]):
        with pytest.raises(WireError):
            results_from_fields(_record({"sid": ["s-1", "s-2"], "job": ["j-1", "j-2"], "off": [0, 0], "att": [0, 0],
                                         "st": [0, 0], "pos": [4, 4], "frm": [3, 3], "tok": [9, 9], "fin": [0, 0],
                                         "fed": [1, 1], "es": [0.0, 0.0], "pc": pc},
                                        charges={"p": [0, 0], "g": [1, 1], "r": [0, 0]}))


@settings(max_examples=150, deadline=None)
@given(d=st.lists(st.integers(-3, 3) | st.integers(-(2**62), 2**62), max_size=4))
def test_rows_not_published_are_refused_exactly_when_one_names_no_row(d: list[int]) -> None:
    """A record of one row: its charges' `d` (rows the script did not publish) is refused when any entry is not a
    row index (the definition, entry by entry), and otherwise leaves the row out."""
    ok = all(0 <= i < 1 for i in d)
    try:
        got = results_from_fields(_record(charges={"d": d}))
    except WireError:
        assert not ok, d
    else:
        assert ok and got == ([] if d else results_from_fields(_record())), d


def test_rows_the_script_did_not_publish_are_left_out() -> None:
    assert results_from_fields(_record(charges={"d": [0]})) == []


def test_is_id_is_a_full_match() -> None:
    assert is_id("a") and is_id("A.b_c-9") and is_id("x" * 64)
    assert not any(is_id(v) for v in ("a\n", "", "x" * 65, "_a", "a b", 5, None, b"a"))


ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,20}", fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(sid=ids, jid=ids, pos=st.integers(1, 1 << 20), tok=st.integers(0, 2**31 - 1), hop=st.integers(0, 15),
       attempt=st.integers(0, 1000), created=st.floats(0, 4e9, allow_nan=False, allow_infinity=False),
       n=st.integers(1, 64), reply=st.none() | ids)
def test_everything_the_producer_writes_is_read_back_exactly(sid: str, jid: str, pos: int, tok: int, hop: int,
                                                             attempt: int, created: float, n: int,
                                                             reply: str | None) -> None:
    job = StepJob(job_id=jid, session_id=sid, hop=hop, phase="decode", compat=KEY.digest, start_position=pos,
                  tokens=(tok,), attempt=attempt, created_at=created, n=n, reply_to=reply)
    assert job_from_fields(job_to_fields(job)) == job
    raw = {k.encode(): v.encode() for k, v in job_to_fields(job).items()}
    assert job_from_fields(raw) == job


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=300), v=st.sampled_from([b"2", b"1", b"", b"\xff"]))
def test_random_bytes_never_raise_anything_but_wire_error(data: bytes, v: bytes) -> None:
    for fields in ({b"v": v, b"j": data}, {b"v": v, b"r": data, b"c": data}):
        with contextlib.suppress(WireError):
            job_from_fields(fields)
        with contextlib.suppress(WireError):
            results_from_fields(fields)


def _outcome(fields: Any) -> object:
    try:
        return job_from_fields(fields)
    except WireError as e:
        return (e.reason, str(e), e.session_id, e.job_id, e.reply_to)


@settings(max_examples=200, deadline=None)
@given(sid=ids, jid=ids, pos=st.integers(1, 1 << 20),
       extra=st.lists(st.binary(min_size=1, max_size=6).filter(lambda b: b not in (b"v", b"j", b"sig")), max_size=3),
       as_str=st.lists(st.booleans(), min_size=8, max_size=8), data=st.data())
def test_a_job_entry_reads_the_same_whatever_its_fields_types_and_refuses_exactly_unknown_names(
        sid: str, jid: str, pos: int, extra: list[bytes], as_str: list[bool], data: st.DataObject) -> None:
    """job_from_fields takes Redis' bytes as they are and encodes a str key or value (a test's, a decoding
    client's): either way, any mix, the same job or the same refusal; an entry is refused `unknown job fields`
    exactly when it has a name besides `v`, `j` and `sig`, and names its ids then (the oracle: the set difference
    and the ids checked one by one, as before schemas/wire.py took them only for a refusal)."""
    job = StepJob(job_id=jid, session_id=sid, phase="decode", compat=KEY.digest, start_position=pos, tokens=(),
                  n=4, created_at=1.0, reply_to=sid)
    raw: dict[bytes, bytes] = {k.encode(): v.encode() for k, v in job_to_fields(job).items()}
    for name in extra:
        raw[name] = data.draw(st.binary(max_size=8))
    printable = all(x.isascii() for k, v in raw.items() for x in (k, v))
    mixed: dict[Any, Any] = {(k.decode() if printable and as_str[i % 8] else k): (v.decode() if printable and
                             as_str[(i + 3) % 8] else v) for i, (k, v) in enumerate(raw.items())}
    assert _outcome(mixed) == _outcome(raw)
    unknown = set(raw) - {b"v", b"j", b"sig"}
    got = _outcome(raw)
    if unknown:
        assert isinstance(got, tuple) and got[0] == Reason.MALFORMED and "unknown job fields" in got[1], got
        assert got[2:] == (sid if is_id(sid) else None, jid if is_id(jid) else None, sid), got
    else:
        assert got == job
