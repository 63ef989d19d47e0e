"""Hostile job entries (issue 29): the decoder's own errors are `WireError`s (bounded nesting depth and size
before parsing; a property over byte strings), and an entry whose session can be read is answered whatever else
is wrong with it, for every reason a job entry is refused on the wire (docs/wire-format.md), on fakeredis and
a real redis-server."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.engines.reference import NumpyReferenceEngine
from schemas import Reason, StepJob, WireError, WorkerKeys, job_from_fields, job_to_fields, results_from_fields
from schemas.limits import MAX_FIELD_BYTES, MAX_TOKENS_PER_JOB
from schemas.wire import MAX_FIELDS, MAX_JSON_DEPTH, json_too_deep

from .hostile_support import WID, Honest, dead_letters, make_worker

COMPAT = "0123456789abcdef"


def valid_body() -> dict[str, object]:
    job = StepJob(job_id="jn", session_id="named", phase="decode", compat=COMPAT, start_position=4, tokens=(5,),
                  created_at=1.0)
    body: dict[str, object] = json.loads(job_to_fields(job)["j"])
    return body


def deep(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


# ------------------------------------------------------------------------------------ the decoder


@pytest.mark.parametrize("where", ["session", "hidden", "tokens", "job_id", "unknown", "top"])
def test_json_nested_past_the_bound_is_a_wire_error_that_names_the_session(where: str) -> None:
    body = json.dumps(valid_body())
    nested = deep(20_000) if where != "hidden" else deep(20_000, '{"a":', "}")
    raw = nested if where == "top" else body[:-1] + f', "{where}": {nested}}}'
    with pytest.raises(WireError) as e:
        job_from_fields({b"v": b"2", b"j": raw.encode()})
    assert e.value.reason == Reason.MALFORMED
    if where != "top":
        assert e.value.session_id == "named" and e.value.job_id == "jn"


def test_the_depth_bound_ignores_brackets_in_strings_and_counts_exactly() -> None:
    assert not json_too_deep(json.dumps({"g": "[" * 500, "h": ["]" * 9, '\\"['], "t": [1, 2]}).encode())
    assert not json_too_deep(deep(MAX_JSON_DEPTH).encode() + b" " + b"[]" * 100)
    assert json_too_deep(deep(MAX_JSON_DEPTH + 1).encode())


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                      max_size=3), max_leaves=12)
FIELD_NAMES = sorted(valid_body())


@st.composite
def job_bytes(draw: st.DrawFn) -> bytes:
    """Job bodies a hostile writer would try: raw bytes, a valid body with one field replaced by any JSON value
    (nested deep, or not), bracket runs cut anywhere."""
    kind = draw(st.sampled_from(["bytes", "field", "deep", "cut"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    body = valid_body()
    if kind == "field":
        body[draw(st.sampled_from([*FIELD_NAMES, "session", "hidden", "extra"]))] = draw(json_values)
        return json.dumps(body).encode()
    text = json.dumps(body)
    if kind == "deep":
        n = draw(st.integers(MAX_JSON_DEPTH - 2, 5_000))
        value = draw(st.sampled_from(["[", '{"a":', '["x",'])) * n
        return (text[:-1] + f', "{draw(st.sampled_from(FIELD_NAMES))}": {value}').encode()
    cut = draw(st.integers(0, len(text)))
    return (text[:cut] + "[" * draw(st.integers(0, 3000)) + text[cut:]).encode()


entry_maps = st.dictionaries(st.sampled_from([b"v", b"j", b"sig"]) | st.binary(max_size=6),
                             st.sampled_from([b"2", b"1", b""]) | st.binary(max_size=20), max_size=6)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=job_bytes(), extra=entry_maps)
def test_no_byte_string_makes_the_job_decoder_raise_anything_but_a_wire_error(body: bytes,
                                                                             extra: dict[bytes, bytes]) -> None:
    for fields in ({b"v": b"2", b"j": body}, {**extra, b"j": body}, extra):
        with contextlib.suppress(WireError):  # anything else fails the test
            job_from_fields(fields)


# ------------------------------------------------------------------------------------ answered when named


def _named(**changes: object) -> Callable[[], dict[bytes, bytes]]:
    def make() -> dict[bytes, bytes]:
        body = valid_body()
        body.update(changes)
        return {b"v": b"2", b"j": json.dumps(body).encode()}
    return make


def _with(make: Callable[[], dict[bytes, bytes]], **fields: bytes) -> Callable[[], dict[bytes, bytes]]:
    def with_fields() -> dict[bytes, bytes]:
        f = make()
        for k, v in fields.items():
            if v == b"-":
                f.pop(k.encode(), None)
            else:
                f[k.encode()] = v
        return f
    return with_fields


_BIG = "x" * (MAX_FIELD_BYTES + 10)
REFUSALS: dict[str, tuple[Callable[[], dict[bytes, bytes]], Reason]] = {
    "unknown entry field": (_with(_named(), extra=b"1"), Reason.MALFORMED),
    "no version field": (_with(_named(), v=b"-"), Reason.MALFORMED),
    "another version": (_with(_named(), v=b"3"), Reason.SCHEMA_VERSION),
    "too many fields": (_with(_named(), **{f"f{i}": b"1" for i in range(MAX_FIELDS)}), Reason.MALFORMED),
    "a field over the size limit": (_named(pad=_BIG), Reason.MALFORMED),
    "nested too deep": (_named(pad=json.loads(deep(MAX_JSON_DEPTH + 2))), Reason.MALFORMED),
    "unknown body field": (_named(pad=1), Reason.MALFORMED),
    "a value of the wrong type": (_named(pos="4"), Reason.MALFORMED),
    "a value out of range": (_named(pos=-1), Reason.MALFORMED),
    "too many tokens": (_named(phase="prefill", tokens=[1] * (MAX_TOKENS_PER_JOB + 1)), Reason.TOO_LONG),
    "bad activations": (_named(hidden={"rows": "x"}), Reason.BAD_ACTIVATIONS),
    "a spec that is not one": (_named(phase="prefill", pos=0, session={"session_id": "named"}), Reason.MALFORMED),
}


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[NumpyReferenceEngine]:
    eng = NumpyReferenceEngine(tiny_model_path, n_slots=4, ctx_per_session=256)
    yield eng
    eng.close()


def test_every_refusal_reason_is_one_a_named_entry_is_answered_with(redis_client: redis.Redis,
                                                                    engine: NumpyReferenceEngine) -> None:
    """Each entry names session `named` (and job `jn`) and is wrong in one way: the session is answered
    `rejected` with the entry's reason under its job id (so its Tracker is not left waiting), and the entry is
    dead-lettered too."""
    worker = make_worker(redis_client, engine)
    keys = WorkerKeys(WID)
    decode = worker.keys["decode"]  # type: ignore[index]
    prefill = worker.keys["prefill"]  # type: ignore[index]
    sent: dict[bytes, tuple[str, Reason]] = {}
    for case, (make, reason) in REFUSALS.items():
        fields = make()
        body = fields.get(b"j", b"")
        phase = "prefill" if b'"prefill"' in body else "decode"
        key = prefill if phase == "prefill" else decode
        sent[redis_client.xadd(keys.input_stream(key.digest, phase), fields)] = (case, reason)  # type: ignore[arg-type]
        for _ in range(2):
            worker.run_once()
        rows = [r for _id, f in redis_client.xrange(keys.results("named")) for r in results_from_fields(f)]
        assert rows, f"{case}: its session was not answered"
        last = rows[-1]
        assert (last.job_id, last.status.value, last.reason) == ("jn", "rejected", reason), (case, last)
        redis_client.delete(keys.results("named"), keys.result_record("jn"))
    assert {d[b"entry_id"] for d in dead_letters(redis_client)} == {e for e in sent}
    assert worker.scheduler.table.busy_slots == 0
    h = Honest(redis_client, worker)  # and the worker serves on
    h.open("honest-0", [1, 2, 3], 3)
    h.run(["honest-0"])
    assert len(h.tokens["honest-0"]) == 3


# ------------------------------------------------------------------------------------ what it still can do


def test_without_signing_a_writer_can_cancel_and_steer_a_session(redis_client: redis.Redis,
                                                                 engine: NumpyReferenceEngine) -> None:
    """docs/security.md, what a writer without the key can do: a cancel entry naming a session cancels it; a
    decode step at a session's next position under a job id of its own, before the Tracker's, is computed with
    the writer's token (the worker cannot tell the two apart)."""
    worker = make_worker(redis_client, engine)
    h = Honest(redis_client, worker)
    h.open("cancelled", [1, 2, 3], 5)
    h.open("steered", [1, 2, 3], 5)
    worker.run_once()
    h.poll(push_next=False)
    redis_client.xadd(WorkerKeys(WID).cancellations, {"session_id": "cancelled"})
    decode = worker.keys["decode"]  # type: ignore[index]
    token = (h.tokens["steered"][-1] + 1) % 300
    redis_client.xadd(WorkerKeys(WID).input_stream(decode.digest, "decode"), job_to_fields(StepJob(  # type: ignore[arg-type]
        job_id="steer-1", session_id="steered", phase="decode", compat=decode.digest, start_position=3,
        tokens=(token,), created_at=1.0)))
    h.decode("cancelled", h.tokens["cancelled"][-1])
    h.decode("steered", h.tokens["steered"][-1])
    for _ in range(3):
        worker.run_once()
    h.poll(push_next=False)
    assert h.results["cancelled"][-1].status.value == "cancelled"
    assert "cancelled" not in worker.scheduler.table
    assert h.results["steered"][-1].reason == Reason.DUPLICATE  # the forger's step took position 3
    rows = [r for _id, f in redis_client.xrange(WorkerKeys(WID).results("steered")) for r in results_from_fields(f)]
    assert any(r.job_id == "steer-1" and r.token is not None for r in rows)
