"""Wire contracts: golden digests, round trips, and clean rejection of bad input."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    Accounting,
    CompatibilityKey,
    EngineIdentity,
    Reason,
    Recipe,
    RouteHop,
    Sampling,
    SessionSpec,
    StateLayout,
    Status,
    StepJob,
    StepResult,
    WireError,
    WorkerKeys,
    job_from_fields,
    job_to_fields,
    parse_input_stream,
    results_from_fields,
    results_to_fields,
    whole_model_boundary,
)
from schemas.limits import MAX_FIELD_BYTES, MAX_STOP_TOKENS, MAX_TOKEN_ID, MAX_TOKENS_PER_JOB


def make_key(phase: str = "prefill", sha: str = "ab" * 32, quant: str = "Q8_0", invariant: bool = True,
             kind: str = "kv") -> CompatibilityKey:
    return CompatibilityKey(
        engine=EngineIdentity(architecture="llama", gguf_sha256=sha),
        recipe=Recipe(quantization=quant, kv_cache_type="f16", ctx_per_session=1024, flash_attention=False,
                      batch_invariant=invariant, runtime="llama-cpp-python==0.3.36"),
        phase=phase,  # type: ignore[arg-type]
        boundary=whole_model_boundary(2),
        state=StateLayout(kind=kind, dims={"n_layer": 2, "n_head_kv": 2, "head_dim": 32}),  # type: ignore[arg-type]
    )


def make_spec(sid: str = "s1", key: CompatibilityKey | None = None) -> SessionSpec:
    return SessionSpec(session_id=sid, account_id="acct-1",
                       route=(RouteHop(worker_id="w1", key=key or make_key()),),
                       sampling=Sampling(temperature=0.7, top_k=40, top_p=0.9, seed=7), max_tokens=32,
                       stop_tokens=(2,))


@settings(max_examples=200, deadline=None)
@given(stops=st.lists(st.integers(-(2**33), 2**33) | st.sampled_from([-1, 0, MAX_TOKEN_ID, MAX_TOKEN_ID + 1]),
                      max_size=MAX_STOP_TOKENS))
def test_stop_tokens_are_accepted_exactly_when_each_is_a_token_id(stops: list[int]) -> None:
    """A SessionSpec takes stop tokens in [0, MAX_TOKEN_ID] and refuses a tuple holding any other int, wherever
    it stands in the tuple (the check is the definition's, one stop at a time)."""
    ok = all(0 <= t <= MAX_TOKEN_ID for t in stops)
    try:
        spec = SessionSpec(session_id="s1", account_id="acct-1", route=(RouteHop(worker_id="w1", key=make_key()),),
                           stop_tokens=tuple(stops))
    except ValueError as e:
        assert not ok and "stop_tokens must be in" in str(e), e
    else:
        assert ok and spec.stop_tokens == tuple(stops)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(-(2**33), 2**33) | st.sampled_from([-1, 0, 5, MAX_TOKEN_ID, MAX_TOKEN_ID + 1]),
                    max_size=6),
       field=st.sampled_from(["banned_token_ids", "logit_bias"]))
def test_sampling_token_ids_are_accepted_exactly_when_each_is_a_distinct_token_id(ids: list[int], field: str) -> None:
    """banned_token_ids and logit_bias's ids: accepted when each is in [0, MAX_TOKEN_ID] and none repeats, refused
    otherwise, wherever the bad one stands (the definition, one id at a time)."""
    ok = all(0 <= t <= MAX_TOKEN_ID for t in ids) and len(set(ids)) == len(ids)
    value: object = tuple(ids) if field == "banned_token_ids" else tuple((t, 1.0) for t in ids)
    try:
        Sampling(**{field: value})  # type: ignore[arg-type]
    except ValueError as e:
        assert not ok and ("must be token ids in" in str(e) or "must not repeat" in str(e)), e
    else:
        assert ok


def make_job(**kw: object) -> StepJob:
    base: dict[str, object] = dict(job_id="j1", session_id="s1", phase="prefill", compat=make_key().digest,
                                   start_position=0, tokens=(1, 5, 9), created_at=1700000000.25,
                                   session=make_spec())
    base.update(kw)
    return StepJob(**base)  # type: ignore[arg-type]


# Pinned so that an accidental change of the canonical form (a renamed field, a new default) is caught.
# Changing them is a deliberate contract change: bump the schema version and update these together.
GOLDEN = {
    "prefill": "ec717cd4bb14a369",
    "decode": "25b09ae9ef7216cb",
}


def test_golden_digests() -> None:
    assert make_key("prefill").digest == GOLDEN["prefill"]
    assert make_key("decode").digest == GOLDEN["decode"]


def test_canonical_json_is_sorted_and_compact() -> None:
    text = make_key().canonical_json()
    assert " " not in text.replace("llama-cpp-python==0.3.36", "")
    assert text.index('"boundary"') < text.index('"engine"') < text.index('"phase"')


@pytest.mark.parametrize("change", [
    {"phase": "decode"}, {"sha": "cd" * 32}, {"quant": "Q4_K_M"}, {"invariant": False}, {"kind": "hybrid"},
])
def test_every_field_separates_keys(change: dict[str, object]) -> None:
    a, b = make_key(), make_key(**change)  # type: ignore[arg-type]
    assert not a.compatible(b)
    assert a.digest != b.digest


def test_for_phase_round_trips() -> None:
    k = make_key("prefill")
    assert k.for_phase("decode").phase == "decode"
    assert k.for_phase("decode").for_phase("prefill") == k
    assert k.for_phase("decode").digest == make_key("decode").digest


def test_job_round_trip_through_bytes() -> None:
    job = make_job()
    fields = {k.encode(): v.encode() for k, v in job_to_fields(job).items()}
    assert job_from_fields(fields) == job


def test_result_round_trip() -> None:
    r = StepResult(job_id="j1", session_id="s1", status=Status.OK, position=4, token=17, finished=True,
                   accounting=Accounting(prompt_tokens=3, generated_tokens=1, engine_seconds=0.0125),
                   worker_id="w1", batch_size=8)
    assert results_from_fields(results_to_fields([r])) == [r]
    rej = StepResult(job_id="j2", session_id="s1", status=Status.REJECTED, reason=Reason.POSITION_GAP,
                     detail="expected 4, got 9", position=4, worker_id="w1")
    assert results_from_fields(results_to_fields([rej])) == [rej]


def test_reason_exactly_when_not_ok() -> None:
    with pytest.raises(ValueError, match="reason"):
        StepResult(job_id="j", session_id="s", status=Status.OK, reason=Reason.CAPACITY, position=0, worker_id="w")
    with pytest.raises(ValueError, match="reason"):
        StepResult(job_id="j", session_id="s", status=Status.FAILED, position=0, worker_id="w")


def test_unknown_wire_version_rejected_by_name() -> None:
    fields = job_to_fields(make_job())
    fields["v"] = "3"
    with pytest.raises(WireError, match="wire version b'3' is not supported") as e:
        job_from_fields(fields)
    assert e.value.reason == Reason.SCHEMA_VERSION


@pytest.mark.parametrize("mutate, reason, message", [
    (lambda f: f.pop("v"), Reason.MALFORMED, "no version"),
    (lambda f: f.update(j=f["j"].replace('"pos":0', '"pos":"x"')), Reason.MALFORMED, "pos"),
    (lambda f: f.update(j=f["j"].replace('"tokens":[1,5,9]', '"tokens":[1,"a"]')), Reason.MALFORMED, "tokens"),
    (lambda f: f.update(j=f["j"].replace('"phase":"prefill"', '"phase":"train"', 1)), Reason.MALFORMED, "phase"),
    (lambda f: f.update(j=f["j"].replace('"tokens":[1,5,9]', '"tokens":[' + ",".join(["1"] * (MAX_TOKENS_PER_JOB + 1))
                                         + "]")), Reason.TOO_LONG, "tokens"),
    (lambda f: f.update(extra="1"), Reason.MALFORMED, "unknown job fields"),
    (lambda f: f.update(j=f["j"].replace('"session_id":"s1"', '"session_id":"bad id!"', 1)), Reason.MALFORMED,
     "session_id"),
    (lambda f: f.update(j=f["j"].replace('"tokens":[1,5,9]', '"tokens":[-1]')), Reason.MALFORMED, "tokens"),
    (lambda f: f.update(j=f["j"].replace('"session":{', '"session":{"x":1,')), Reason.MALFORMED, "session"),
    (lambda f: f.update(j="x" * (MAX_FIELD_BYTES + 1)), Reason.MALFORMED, "over"),
])
def test_malformed_job_fields(mutate, reason: Reason, message: str) -> None:  # type: ignore[no-untyped-def]
    fields = job_to_fields(make_job())
    mutate(fields)
    with pytest.raises(WireError, match=message) as e:
        job_from_fields(fields)
    assert e.value.reason == reason


def test_job_invariants() -> None:
    with pytest.raises(ValueError, match="exactly one token"):
        make_job(phase="decode", start_position=3, session=None, tokens=(1, 2))
    with pytest.raises(ValueError, match="opening prefill"):
        make_job(session=None)
    with pytest.raises(ValueError, match="opening prefill"):
        make_job(start_position=5)
    with pytest.raises(ValueError, match="differs"):
        make_job(session=make_spec("other"))


def test_strict_types() -> None:
    with pytest.raises(ValueError):
        StepJob(job_id="j", session_id="s", phase="decode", compat="0" * 16, start_position="3",  # type: ignore[arg-type]
                tokens=(1,), created_at=time.time())


def test_keys_share_one_hash_tag() -> None:
    k = WorkerKeys("gpu-7")
    names = [k.input_stream("ab" * 8, "decode"), k.results("s1"), k.result_record("j"), k.dead_letters,
             k.cancellations, k.session_account("s1"), k.billing_account("a"), k.worker_account, k.spec,
             k.heartbeat, k.accounts_index]
    assert all("{gpu-7}" in n and n.count("{") == 1 for n in names)
    assert parse_input_stream(k.input_stream("ab" * 8, "decode")) == ("gpu-7", "ab" * 8, "decode")
    assert parse_input_stream(k.results("s1")) is None


ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,20}", fullmatch=True)


@settings(max_examples=60, deadline=None)
@given(sid=ids, jid=ids, pos=st.integers(0, 100_000), toks=st.lists(st.integers(0, 2**31 - 1), min_size=1,
       max_size=64), decode=st.booleans(), attempt=st.integers(0, 1000), ts=st.floats(0, 2e9))
def test_job_round_trip_property(sid: str, jid: str, pos: int, toks: list[int], decode: bool, attempt: int,
                                 ts: float) -> None:
    job = StepJob(job_id=jid, session_id=sid, phase="decode" if decode else "prefill", compat="0123456789abcdef",
                  start_position=pos + (0 if decode else 1), tokens=tuple(toks[:1] if decode else toks),
                  attempt=attempt, created_at=ts)
    assert job_from_fields(job_to_fields(job)) == job


@settings(max_examples=60, deadline=None)
@given(quant=st.sampled_from(["Q8_0", "Q4_K_M", "F32"]), ctx=st.integers(1, 1 << 20), fa=st.booleans(),
       dims=st.dictionaries(st.sampled_from(["n_layer", "n_head_kv", "head_dim", "d_state"]), st.integers(0, 1 << 16)))
def test_digest_stable_under_reconstruction(quant: str, ctx: int, fa: bool, dims: dict[str, int]) -> None:
    k = make_key()
    k2 = k.model_copy(update={"recipe": k.recipe.model_copy(update={"quantization": quant, "ctx_per_session": ctx,
                                                                      "flash_attention": fa}),
                              "state": StateLayout(kind="kv", dims=dims)})
    rebuilt = CompatibilityKey.model_validate_json(k2.model_dump_json())
    assert rebuilt == k2
    assert rebuilt.digest == CompatibilityKey.model_validate(dict(reversed(list(k2.model_dump().items())))).digest


@settings(max_examples=60, deadline=None)
@given(quant=st.sampled_from(["Q8_0", "Q4_K_M", "F32"]), ctx=st.integers(1, 1 << 20),
       phase=st.sampled_from(["prefill", "decode"]))
def test_a_keys_kept_digest_and_phase_keys_are_its_own(quant: str, ctx: int, phase: str) -> None:
    """The digest and for_phase's keys are kept on a key once asked for: a copy with other fields computes its
    own (not the original's), and every kept value is what a key validated afresh gives."""
    k = make_key()
    first, other = k.digest, k.for_phase("decode" if k.phase == "prefill" else "prefill")
    assert k.for_phase(other.phase) is other and k.digest == first  # kept
    k2 = k.model_copy(update={"recipe": k.recipe.model_copy(update={"quantization": quant, "ctx_per_session": ctx}),
                              "phase": phase})
    fresh = CompatibilityKey.model_validate(k2.model_dump())
    assert k2.digest == fresh.digest
    assert (k2.digest == first) == (k2.model_dump() == k.model_dump())
    for p in ("prefill", "decode"):
        assert k2.for_phase(p) == fresh.for_phase(p) and k2.for_phase(p).digest == fresh.for_phase(p).digest
        assert k2.for_phase(p).phase == p


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "job_id", "session_id", "hop", "phase", "compat", "pos", "tokens",
                                        "sample", "attempt", "created_at", "session", "junk"]),
                       st.one_of(st.text(max_size=40), st.binary(max_size=40).map(lambda b: b.hex()),
                                 st.integers().map(str)), max_size=13))
def test_malformed_entries_always_rejected_cleanly(fields: dict[str, str]) -> None:
    try:
        job = job_from_fields(fields)
    except WireError as e:
        assert isinstance(e.reason, Reason)
        assert str(e)
    else:  # hypothesis found a valid job: it must survive a round trip
        assert job_from_fields(job_to_fields(job)) == job


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64), st.binary(max_size=64))
def test_raw_bytes_never_crash(k: bytes, v: bytes) -> None:
    base = {key.encode(): val.encode() for key, val in job_to_fields(make_job()).items()}
    base[k] = v
    with contextlib.suppress(WireError):
        job_from_fields(base)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(-(2**33), 2**33) | st.sampled_from([-1, 0, MAX_TOKEN_ID, MAX_TOKEN_ID + 1])
                       | st.sampled_from([True, False, 2.0, "3", None]) | st.integers(0, 9).map(np.int64),
                       min_size=1, max_size=40))
def test_a_jobs_tokens_are_accepted_exactly_when_each_is_an_int_token_id(tokens: list[object]) -> None:
    """A StepJob's tokens: plain ints in [0, MAX_TOKEN_ID] (not a bool, not a numpy integer), wherever the bad one
    stands (the definition, one token at a time)."""
    ok = all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens)  # type: ignore[operator]
    try:
        job = make_job(tokens=tuple(tokens))
    except (ValueError, TypeError) as e:
        assert not ok and "tokens must be ints" in str(e), e
    else:
        assert ok and job.tokens == tuple(tokens)
