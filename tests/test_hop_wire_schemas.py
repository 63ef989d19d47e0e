"""Boundary activations on the wire (schemas/activations.py, the `hidden` fields of schemas/wire.py):
round trips exact for every shape and dtype, and every malformation refused by name, never computed on."""

from __future__ import annotations

import base64
import hashlib
import json
import os

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import Reason, Status, StepJob, StepResult, WireError, WorkerKeys
from schemas.activations import ActivationError, Activations, decode, encode, raw_bytes
from schemas.limits import INLINE_MAX_BYTES
from schemas.wire import job_from_fields, job_to_fields, results_from_fields, results_to_fields

SOAK = os.environ.get("DGR_SOAK") == "1"  # DGR_SOAK=1: the long searches

KEY = "dgr:{w1}:act:in:j-1"


def _job(tokens: tuple[int, ...], hidden: Activations | None, phase: str = "prefill", pos: int = 3) -> StepJob:
    return StepJob(job_id="j-1", session_id="s-1", hop=1, phase=phase, compat="0" * 16,  # type: ignore[arg-type]
                   start_position=pos, tokens=tokens, sample=True, created_at=1.0, hidden=hidden)


@settings(max_examples=300 if SOAK else 30, deadline=None)
@given(rows=st.integers(1, 64), hidden=st.integers(1, 300), dtype=st.sampled_from(["f32", "f16"]),
       seed=st.integers(0, 2**32 - 1))
def test_encode_decode_round_trip_is_exact(rows: int, hidden: int, dtype: str, seed: int) -> None:
    a = np.random.default_rng(seed).standard_normal((rows, hidden)).astype(np.float32)
    acts, blob = encode(a, dtype, blob=KEY)  # type: ignore[arg-type]
    want = a if dtype == "f32" else a.astype(np.float16).astype(np.float32)
    assert acts.inline == (rows * hidden * (4 if dtype == "f32" else 2) <= INLINE_MAX_BYTES)
    assert (blob is None) == acts.inline
    got = decode(acts, blob, hidden_size=hidden, dtype=dtype)  # type: ignore[arg-type]
    assert got.dtype == np.float32 and got.shape == (rows, hidden)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bit for bit
    # ... and through a job entry and a result entry (the Tracker's relay moves the header)
    job = _job(tuple(range(rows)), acts)
    back = job_from_fields(job_to_fields(job))
    assert back == job
    res = StepResult(job_id="j-1", session_id="s-1", status=Status.OK, position=rows, worker_id="w1", hidden=acts)
    assert results_from_fields(results_to_fields([res])) == [res]
    moved = acts.moved("dgr:{w2}:act:in:j-2") if blob is not None else acts.moved(None, raw_bytes(a, dtype))  # type: ignore[arg-type]
    assert np.array_equal(decode(moved, blob), got)


def test_inline_and_blob_exclusive_and_sized() -> None:
    a, _ = encode(np.ones((1, 4), np.float32))
    with pytest.raises(ValueError):
        Activations(dtype="f32", hidden_size=4, rows=1, sha256=a.sha256)  # neither
    with pytest.raises(ValueError):
        Activations(dtype="f32", hidden_size=4, rows=1, sha256=a.sha256, data=a.data, blob=KEY)  # both
    big = INLINE_MAX_BYTES // 4 + 1
    with pytest.raises(ValueError):  # too large to go inline
        Activations(dtype="f32", hidden_size=big, rows=1, sha256=a.sha256, data="AAAA")
    with pytest.raises(ValueError):
        encode(np.ones((2, big), np.float32))  # needs a blob key
    with pytest.raises(ValueError):  # a job's rows are its tokens
        _job((1, 2), a)


def _refused(acts: Activations, raw: bytes | None, **expect: object) -> str:
    with pytest.raises(ActivationError) as e:
        decode(acts, raw, **expect)  # type: ignore[arg-type]
    return str(e.value)


def test_decode_refuses_each_malformation_by_name() -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    blob_acts, raw = encode(a, blob=KEY, inline_max=0)
    assert raw is not None
    assert "missing" in _refused(blob_acts, None)
    assert "bytes" in _refused(blob_acts, raw[:-4])
    assert "bytes" in _refused(blob_acts, raw + b"\0\0\0\0")
    assert "sha256" in _refused(blob_acts, raw[::-1])
    assert "hidden_size" in _refused(blob_acts, raw, hidden_size=8)
    assert "dtype" in _refused(blob_acts, raw, dtype="f16")
    for bad in (np.nan, np.inf, -np.inf):
        b = a.copy()
        b[1, 2] = bad
        acts, _ = encode(b)
        assert "NaN" in _refused(acts, None)
    inline, _ = encode(a)
    notb64 = msgspec.structs.replace(inline, data="!!" + (inline.data or "")[2:])
    assert "base64" in _refused(notb64, None)
    # an f16 header over f32 bytes: the size differs
    f16 = Activations(dtype="f16", hidden_size=4, rows=2, data=inline.data, sha256=inline.sha256)
    assert "bytes" in _refused(f16, None)


@settings(max_examples=1000 if SOAK else 80, deadline=None)
@given(st.binary(max_size=200), st.integers(1, 8), st.integers(1, 8), st.sampled_from(["f32", "f16"]))
def test_random_bytes_never_decode_silently(body: bytes, rows: int, hidden: int, dtype: str) -> None:
    """Random bytes under a header: decoded only when size, digest and finiteness all hold."""
    acts = Activations(dtype=dtype, hidden_size=hidden, rows=rows,  # type: ignore[arg-type]
                       blob=KEY, sha256=hashlib.sha256(body).hexdigest())
    try:
        out = decode(acts, body)
    except ActivationError:
        return
    assert len(body) == acts.nbytes and np.isfinite(out).all() and out.shape == (rows, hidden)


def _job_fields_with(hidden_json: str, tokens: str = "1,2") -> dict[str, str]:
    f = job_to_fields(_job((1, 2), None))
    body = json.loads(f["j"])
    body["tokens"] = [int(t) for t in tokens.split(",")]
    body["hidden"] = json.loads(hidden_json)
    return {**f, "j": json.dumps(body)}


@settings(max_examples=1500 if SOAK else 100, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "dtype", "hidden_size", "rows", "data", "blob", "sha256", "x"]),
                       st.one_of(st.none(), st.integers(-3, 70000), st.text(max_size=40),
                                 st.sampled_from(["f32", "f16", "f64", 1, 2, "AAAA" * 2, "a" * 64])),
                       max_size=8))
def test_fuzzed_activation_headers_are_refused_as_bad_activations(header: dict[str, object]) -> None:
    """Any header that is not a valid one for the job is refused with reason bad_activations and the
    job's ids (so its session can be told), never another exception."""
    f = _job_fields_with(json.dumps(header))
    try:
        job = job_from_fields(f)
    except WireError as e:
        assert e.reason == Reason.BAD_ACTIVATIONS
        assert e.session_id == "s-1" and e.job_id == "j-1"
        return
    assert job.hidden is not None and job.hidden.rows == 2


def test_wrong_version_rows_and_unknown_fields_refused() -> None:
    a, _ = encode(np.ones((2, 4), np.float32))
    good = json.loads(a.json())
    for bad in ({**good, "v": 2}, {**good, "rows": 3}, {**good, "extra": 1}, {**good, "dtype": "bf16"},
                {k: v for k, v in good.items() if k != "sha256"}):
        with pytest.raises(WireError) as e:
            job_from_fields(_job_fields_with(json.dumps(bad)))
        assert e.value.reason == Reason.BAD_ACTIVATIONS
    with pytest.raises(WireError) as e:  # rows must equal the job's tokens
        job_from_fields(_job_fields_with(json.dumps(good), tokens="1,2,3"))
    assert e.value.reason == Reason.BAD_ACTIVATIONS
    with pytest.raises(ValueError):  # activations come only with an OK answer and no token
        StepResult(job_id="j", session_id="s", status=Status.OK, position=1, worker_id="w", token=3, hidden=a)


def test_blob_keys_live_in_the_workers_tag() -> None:
    k = WorkerKeys("w1")
    assert k.activations_in("j-1") == "dgr:{w1}:act:in:j-1"
    assert k.activations_out("j-1") == "dgr:{w1}:act:out:j-1"
    assert k.activations_in("j") != k.activations_out("j")
    assert k.activations_pattern == "dgr:{w1}:act:*"


def test_inline_data_is_base64_of_raw_bytes() -> None:
    a = np.array([[1.5, -2.0]], np.float32)
    acts, _ = encode(a)
    assert acts.data is not None
    assert base64.b64decode(acts.data) == a.astype("<f4").tobytes()
    assert acts.sha256 == hashlib.sha256(a.astype("<f4").tobytes()).hexdigest()
