"""The lexical rules of docs/wire-format.md, one rejection test each, and the round trip they must keep."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
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
    result_from_fields,
    result_to_fields,
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
                   start_position=pos, tokens=(42,), created_at=1796007616.08)


def fields_with(job: StepJob, **change: str) -> dict[str, str]:
    f = job_to_fields(job)
    f.update(change)
    return f


@pytest.mark.parametrize("value", ["s-1\n", "s-1\r\n", " s-1", "s-1 ", "", "-s", "a}{b", "a*", "s/1", "é",
                                   "x" * 65, "s\x00", "ｓ-1"])
@pytest.mark.parametrize("name", ["session_id", "job_id"])
def test_ids_match_in_full(name: str, value: str) -> None:
    with pytest.raises(WireError, match=name) as e:
        job_from_fields(fields_with(decode(), **{name: value}))
    assert e.value.reason == Reason.MALFORMED
    # the other id is still handed back (so the session can be told), the bad one never
    assert getattr(e.value, name) is None
    other = "job_id" if name == "session_id" else "session_id"
    assert getattr(e.value, other) == job_to_fields(decode())[other]


@pytest.mark.parametrize("value", [" 12", "12 ", "1_2", "+12", "-1", "０１", "٣", "012", "1e3", "0x1", "12.0",
                                   "", "1" * 20, "12\n"])
@pytest.mark.parametrize("name", ["pos", "hop", "attempt"])
def test_integers_are_plain_ascii_decimal(name: str, value: str) -> None:
    with pytest.raises(WireError, match=f"'{name}' is not a plain decimal integer") as e:
        job_from_fields(fields_with(decode(), **{name: value}))
    assert e.value.reason == Reason.MALFORMED and e.value.session_id == "s-1" and e.value.job_id == "j-2"


@pytest.mark.parametrize("value", ["5, 17", " 5,17", "5,,17", "5,17,", ",5", "+5", "05", "5_1", "５", "-1",
                                   "5;17", "", "99999999999"])
def test_tokens_are_plain_decimal_separated_by_commas(value: str) -> None:
    with pytest.raises(WireError, match="tokens") as e:
        job_from_fields(fields_with(opening(), tokens=value))
    assert e.value.reason == Reason.MALFORMED


@pytest.mark.parametrize("value", ["true", "True", "yes", "", "2", " 1", "1\n", "00", "on"])
def test_booleans_are_exactly_0_or_1(value: str) -> None:
    with pytest.raises(WireError, match="'sample' is not '0' or '1'"):
        job_from_fields(fields_with(opening(), sample=value))


def test_sample_is_required() -> None:
    f = job_to_fields(opening())
    del f["sample"]
    with pytest.raises(WireError, match="missing field 'sample'"):
        job_from_fields(f)


@pytest.mark.parametrize("value", ["nan", "inf", "-1.0", " 1.5", "1,5", "1.5.2", "0x1p3", "１.0", "1_0.0"])
def test_created_at_is_a_plain_decimal_number(value: str) -> None:
    with pytest.raises(WireError, match="'created_at' is not a plain decimal number"):
        job_from_fields(fields_with(decode(), created_at=value))


@pytest.mark.parametrize("mutate, message", [
    (lambda f: f.update({"v": "1 "}), "schema version"),
    (lambda f: f.update({"phase": "Prefill"}), "phase"),
    (lambda f: f.update({"compat": "EC717CD4BB14A369"}), "compat"),
    (lambda f: f.update({"hop": "16"}), "hop"),
])
def test_other_fields_by_their_rule(mutate: Callable[[dict[str, str]], None], message: str) -> None:
    f = job_to_fields(opening())
    mutate(f)
    with pytest.raises(WireError, match=message):
        job_from_fields(f)


def test_non_utf8_and_non_ascii_names_are_malformed_and_keep_readable_ids() -> None:
    f: dict[bytes, bytes] = {k.encode(): v.encode() for k, v in job_to_fields(decode()).items()}
    with pytest.raises(WireError, match="not UTF-8") as e:
        job_from_fields({**f, b"pos": b"\xff\xfe"})
    assert (e.value.session_id, e.value.job_id) == ("s-1", "j-2")
    with pytest.raises(WireError, match="not ASCII"):
        job_from_fields({**f, b"\xc3\xa9": b"1"})
    with pytest.raises(WireError, match="fields, more than"):
        job_from_fields({**f, **{f"x{i}".encode(): b"1" for i in range(40)}})


def test_a_newer_version_is_refused_by_version_even_with_new_fields() -> None:
    with pytest.raises(WireError) as e:
        job_from_fields(fields_with(decode(), v="2", brand_new="1"))
    assert e.value.reason == Reason.SCHEMA_VERSION


@pytest.mark.parametrize("fields, message", [
    ({b"session_id": b"\xff\xfe"}, "not UTF-8"),
    ({b"session_id": b"s-1\n"}, "not an id"),
    ({b"session_id": b"a}{b"}, "not an id"),
    ({}, "missing field 'session_id'"),
    ({b"session_id": b"s-1", b"extra": b"1"}, "unknown cancellation fields"),
])
def test_cancellation_entries(fields: dict[bytes, bytes], message: str) -> None:
    with pytest.raises(WireError, match=message):
        cancel_from_fields(fields)


def test_cancellation_round_trip_and_refusal_to_write_a_bad_id() -> None:
    assert cancel_from_fields({k.encode(): v.encode() for k, v in cancel_to_fields("s-1").items()}) == "s-1"
    with pytest.raises(ValueError):
        cancel_to_fields("s-1\n")


def test_results_are_parsed_as_strictly() -> None:
    r = StepResult(job_id="j-1", session_id="s-1", status=Status.OK, position=4, token=9, worker_id="w1")
    assert result_from_fields(result_to_fields(r)) == r
    for change in ({"finished": "yes"}, {"pos": "+4"}, {"token": " 9"}, {"worker_id": "w1\n"}, {"x": "1"}):
        with pytest.raises(WireError):
            result_from_fields({**result_to_fields(r), **change})


def test_is_id_is_a_full_match() -> None:
    assert is_id("a") and is_id("A.b_c-9") and is_id("x" * 64)
    assert not any(is_id(v) for v in ("a\n", "", "x" * 65, "_a", "a b", 5, None, b"a"))


ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,20}", fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(sid=ids, jid=ids, pos=st.integers(1, 1 << 20), tok=st.integers(0, 2**31 - 1), hop=st.integers(0, 15),
       attempt=st.integers(0, 1000), created=st.floats(0, 4e9, allow_nan=False, allow_infinity=False))
def test_everything_the_producer_writes_is_read_back_exactly(sid: str, jid: str, pos: int, tok: int, hop: int,
                                                             attempt: int, created: float) -> None:
    job = StepJob(job_id=jid, session_id=sid, hop=hop, phase="decode", compat=KEY.digest, start_position=pos,
                  tokens=(tok,), attempt=attempt, created_at=created)
    assert job_from_fields(job_to_fields(job)) == job
    raw = {k.encode(): v.encode() for k, v in job_to_fields(job).items()}
    assert job_from_fields(raw) == job
