"""Activations through Redis against a real redis-server: malformed input answered `bad_activations`
while the worker keeps serving (a hypothesis fuzz of the header and the bytes), a missing or foreign
blob refused, the output blob written once by the completion script with its TTL, input blobs fetched in
one round trip per read, and cancellation on a hop."""

from __future__ import annotations

import base64
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.engines.reference import NumpyReferenceEngine
from consumer.worker import Worker
from dgrtools.tiny_model import write_tiny_model
from schemas import Reason, RouteHop, SessionSpec, Status, StepJob, WorkerKeys, job_to_fields
from schemas.activations import Activations, encode
from schemas.limits import ACTIVATION_TTL_S, ACTIVATIONS_VERSION
from schemas.wire import results_from_fields

from .hop_driver import RouteDriver, make_hop_worker
from .support import prompts, solo_generate

HIDDEN = 128  # the tiny model's n_embd
_ids = itertools.count()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hopwire") / "tiny.gguf"
    write_tiny_model(path, seed=0, quant="q8_0")
    return path


@pytest.fixture(scope="module")
def hop1_engine(model: Path) -> Iterator[NumpyReferenceEngine]:
    eng = NumpyReferenceEngine(model, n_slots=4, ctx_per_session=256, layers=(1, 2))
    yield eng
    eng.close()


def _worker(client: redis.Redis, engine: NumpyReferenceEngine) -> Worker:
    for s in range(engine.capacity.n_slots):
        engine.release(s)
    return make_hop_worker(client, engine, f"w{next(_ids)}")


def _opening(w: Worker, sid: str, hidden: Activations | None, n: int = 3, jid: str | None = None) -> StepJob:
    key = w.keys["prefill"]
    spec = SessionSpec(session_id=sid, account_id="acct", max_tokens=2,
                       route=(RouteHop(worker_id="elsewhere", key=key),
                              RouteHop(worker_id=w.settings.worker_id, key=key)))
    return StepJob(job_id=jid or f"{sid}.h1.p0", session_id=sid, hop=1, phase="prefill", compat=key.digest,
                   start_position=0, tokens=tuple(range(5, 5 + n)), sample=True, created_at=1.0, session=spec,
                   hidden=hidden)


def _push(client: redis.Redis, w: Worker, job: StepJob, fields: dict[str, str] | None = None,
          blob: bytes | None = None) -> None:
    keys = WorkerKeys(w.settings.worker_id)
    pipe = client.pipeline(transaction=False)
    if blob is not None:  # at the job's input key, whatever its header says
        pipe.set(keys.activations_in(job.job_id), blob, ex=ACTIVATION_TTL_S)
    pipe.xadd(keys.input_stream(w.keys["prefill"].digest, "prefill"), fields or job_to_fields(job))  # type: ignore[arg-type]
    pipe.execute()


def _hidden_of(f: dict[str, str]) -> dict[str, object]:
    """The activations header in a job entry's JSON body."""
    return json.loads(f["j"])["hidden"]  # type: ignore[no-any-return]


def _with_hidden(f: dict[str, str], header: object) -> dict[str, str]:
    """The job entry with another activations header in its JSON body (as a writer could put there)."""
    body = json.loads(f["j"])
    body["hidden"] = header
    return {**f, "j": json.dumps(body)}


def _answers(client: redis.Redis, w: Worker, sid: str) -> list[tuple[Status, Reason | None, str]]:
    out = client.xrange(WorkerKeys(w.settings.worker_id).results(sid))
    return [(r.status, r.reason, r.detail) for _, f in out for r in results_from_fields(f)]


def _serve(w: Worker, rounds: int = 5) -> None:
    for _ in range(rounds):
        w.run_once()


def _good(w: Worker, client: redis.Redis, sid: str, n: int = 3) -> np.ndarray:
    """A valid opening on the hop worker, served: its output rows, compared with a direct engine run."""
    rows = np.random.default_rng(len(sid)).standard_normal((n, HIDDEN)).astype(np.float32)
    jid = f"{sid}.h1.p0"
    acts, blob = encode(rows, blob=WorkerKeys(w.settings.worker_id).activations_in(jid))
    _push(client, w, _opening(w, sid, acts, n, jid), blob=blob)
    _serve(w)
    (status, reason, _detail), = _answers(client, w, sid)
    assert (status, reason) == (Status.OK, None)
    return rows


def test_malformed_activations_are_answered_and_the_worker_keeps_serving(
        real_redis: redis.Redis, hop1_engine: NumpyReferenceEngine) -> None:
    w = _worker(real_redis, hop1_engine)
    keys = WorkerKeys(w.settings.worker_id)
    good = np.ones((3, HIDDEN), np.float32)
    blob_acts, raw = encode(good, blob=keys.activations_in("c-missing.h1.p0"), inline_max=0)
    assert raw is not None
    nan = good.copy()
    nan[1, 7] = np.nan
    cases: dict[str, tuple[StepJob, dict[str, str] | None, bytes | None]] = {}

    def job(sid: str, hidden: Activations | None, n: int = 3) -> StepJob:
        return _opening(w, sid, hidden, n)

    cases["c-none"] = (job("c-none", None), None, None)  # a hop that takes activations gets none
    nan_acts, nan_raw = encode(nan, blob=keys.activations_in("c-nan.h1.p0"), inline_max=0)
    cases["c-nan"] = (job("c-nan", nan_acts), None, nan_raw)
    small, _ = encode(np.ones((3, 64), np.float32))  # wrong hidden size
    cases["c-size"] = (job("c-size", small), None, None)
    f16, _ = encode(good, "f16")  # wrong dtype for an f32 hop
    cases["c-dtype"] = (job("c-dtype", f16), None, None)
    cases["c-missing"] = (job("c-missing", blob_acts.moved(keys.activations_in("c-missing.h1.p0"))), None, None)
    cases["c-digest"] = (job("c-digest", blob_acts.moved(keys.activations_in("c-digest.h1.p0"))), None,
                         raw[::-1])
    cases["c-random"] = (job("c-random", blob_acts.moved(keys.activations_in("c-random.h1.p0"))), None,
                         np.random.default_rng(1).bytes(len(raw)))
    foreign = blob_acts.moved(WorkerKeys("other").activations_in("c-foreign.h1.p0"))
    cases["c-foreign"] = (job("c-foreign", foreign), None, None)
    own_other = blob_acts.moved(keys.lease)  # a key of its own tag that is not this job's input
    cases["c-lease"] = (job("c-lease", own_other), None, None)
    v2 = job("c-version", blob_acts.moved(keys.activations_in("c-version.h1.p0")))
    f = job_to_fields(v2)
    f = _with_hidden(f, {**_hidden_of(f), "v": 2})
    cases["c-version"] = (v2, f, raw)
    rows_f = job_to_fields(job("c-rows", blob_acts.moved(keys.activations_in("c-rows.h1.p0"))))
    rows_f = _with_hidden(rows_f, {**_hidden_of(rows_f), "rows": 2})
    cases["c-rows"] = (job("c-rows", None), rows_f, raw)
    for jb, fields, blob in cases.values():
        _push(real_redis, w, jb, fields, blob)
    _serve(w, 6)
    for sid in cases:
        got = _answers(real_redis, w, sid)
        assert [(s, r) for s, r, _ in got] == [(Status.REJECTED, Reason.BAD_ACTIVATIONS)], (sid, got)
    # the lease key was never touched, no slot is held, and a good step is still served
    assert real_redis.get(keys.lease) is not None
    assert w.scheduler.table.busy_slots == 0 and w.hops.held() == 0
    out = _good(w, real_redis, "after")
    assert out.shape == (3, HIDDEN)


@settings(max_examples=200 if os.environ.get("DGR_SOAK") == "1" else 25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_activations_never_stop_the_worker(real_redis: redis.Redis, hop1_engine: NumpyReferenceEngine,
                                                  data: st.DataObject) -> None:
    """Random mutations of a valid step's activations (header fields, bytes, blob presence): each step
    is answered exactly once (OK only when the rows are intact), and a valid step after it is served."""
    real_redis.flushall()
    w = _worker(real_redis, hop1_engine)
    keys = WorkerKeys(w.settings.worker_id)
    n = data.draw(st.integers(1, 40), label="rows")
    rows = np.random.default_rng(n).standard_normal((n, HIDDEN)).astype(np.float32)
    jid = "fz.h1.p0"
    acts, blob = encode(rows, blob=keys.activations_in(jid))
    raw = blob if blob is not None else base64.b64decode(acts.data or "")
    header = json.loads(acts.json())
    field = data.draw(st.sampled_from(["none", "v", "dtype", "hidden_size", "rows", "sha256", "data", "bytes",
                                       "drop_blob", "extra"]), label="mutate")
    value = data.draw(st.one_of(st.integers(-2, 70000), st.text(max_size=12), st.none(),
                                st.sampled_from(["f16", "f32", "bf16", "0" * 64])), label="value")
    intact = field == "none"
    if field in ("v", "dtype", "hidden_size", "rows", "sha256", "extra"):
        header[field if field != "extra" else "zz"] = value
        # the header omits its defaults (v): a mutation that writes the default value changes nothing
        default = {"v": ACTIVATIONS_VERSION}
        intact = {**default, **header} == {**default, **json.loads(acts.json())}
    elif field == "data" and acts.data is not None:
        header["data"] = base64.b64encode(raw[:-1] + bytes([raw[-1] ^ 1])).decode()
    elif field == "bytes" and blob is not None:
        cut = data.draw(st.integers(0, len(blob)), label="cut")
        blob = blob[:cut] + data.draw(st.binary(max_size=8), label="tail")
        intact = blob == raw
    elif field == "drop_blob":
        blob = None
        intact = acts.data is not None
    else:
        intact = True
    job = _opening(w, "fz", None, n, jid)
    f = _with_hidden(job_to_fields(job), header)
    _push(real_redis, w, job, f, blob)
    _serve(w, 4)
    got = _answers(real_redis, w, "fz")
    assert len(got) == 1, got
    status, reason, _ = got[0]
    if intact:
        assert (status, reason) == (Status.OK, None), got
    else:
        assert status == Status.REJECTED and reason in (Reason.BAD_ACTIVATIONS, Reason.MALFORMED), got
    _good(w, real_redis, "fz-after")


def test_output_blob_written_once_with_ttl_and_inputs_fetched_in_one_round_trip(
        real_redis: redis.Redis, model: Path) -> None:
    """Hop 0 of a 2-hop route: the chunk's rows go to act:out:<job> (EX), a decode step's inline; the
    worker's fetches of input blobs on hop 1 are one MGET per read that has any."""
    eng0 = NumpyReferenceEngine(model, n_slots=4, ctx_per_session=256, layers=(0, 1))
    eng1 = NumpyReferenceEngine(model, n_slots=4, ctx_per_session=256, layers=(1, 2))
    d = RouteDriver(real_redis, [make_hop_worker(real_redis, eng0, f"o{next(_ids)}"),
                                 make_hop_worker(real_redis, eng1, f"o{next(_ids)}")])
    fetches = []
    t1 = d.workers[1].transport
    orig = t1.fetch_activations

    def counted(blobs: list[str]) -> list[bytes | None]:
        fetches.append(len(blobs))
        return orig(blobs)

    t1.fetch_activations = counted  # type: ignore[method-assign]
    ps = prompts(3, 500, seed=2, lo=60, hi=80)
    for i, p in enumerate(ps):
        d.open(f"s{i}", p, max_tokens=3, chunk=64)
    d.workers[0].run_once()
    k0 = WorkerKeys(d.workers[0].settings.worker_id)
    outs = list(real_redis.scan_iter(match=k0.activations_out("*")))
    assert outs, "a prefill chunk's rows go to a blob"
    for key in outs:
        assert 0 < real_redis.ttl(key) <= ACTIVATION_TTL_S
        assert real_redis.strlen(key) % (4 * HIDDEN) == 0
    d.poll()
    d.run([f"s{i}" for i in range(3)])
    assert not d.failures()
    assert fetches and all(n >= 1 for n in fetches)
    assert len(fetches) <= d.workers[1].stats.reads  # at most one fetch per read
    assert max(fetches) >= 2  # several sessions' blobs in one round trip
    whole = NumpyReferenceEngine(model, n_slots=1, ctx_per_session=256)
    for i, p in enumerate(ps):
        assert d.tokens[f"s{i}"] == solo_generate(whole, p, 3)
    # accounting: billable tokens once per session, by the last hop; each hop charges its engine time
    for i, p in enumerate(ps):
        h0 = real_redis.hgetall(k0.session_account(f"s{i}"))
        h1 = real_redis.hgetall(WorkerKeys(d.workers[1].settings.worker_id).session_account(f"s{i}"))
        assert int(h0[b"prompt_tokens"]) == 0 and int(h0[b"generated_tokens"]) == 0
        assert int(h1[b"prompt_tokens"]) == len(p) and int(h1[b"generated_tokens"]) == 3
        assert float(h0[b"engine_seconds"]) > 0 and float(h1[b"engine_seconds"]) > 0
        assert int(h0[b"steps"]) == int(h1[b"steps"])  # the same steps ran on both hops
    # a re-sent completion writes no blob twice: replay hop 0's first answer
    a0 = next(iter(d.workers[0].ledger.answered.values()))
    assert a0.blob is None  # the worker keeps no output rows once filed


def test_cancellation_reaches_a_hop(real_redis: redis.Redis, model: Path) -> None:
    eng0 = NumpyReferenceEngine(model, n_slots=4, ctx_per_session=256, layers=(0, 1))
    eng1 = NumpyReferenceEngine(model, n_slots=4, ctx_per_session=256, layers=(1, 2))
    d = RouteDriver(real_redis, [make_hop_worker(real_redis, eng0, f"x{next(_ids)}"),
                                 make_hop_worker(real_redis, eng1, f"x{next(_ids)}")])
    ps = prompts(3, 500, seed=6, lo=20, hi=40)
    for i, p in enumerate(ps):
        d.open(f"s{i}", p, max_tokens=30)
    for _ in range(6):
        for w in d.workers:
            w.run_once()
        d.poll()
    assert not d.done("s1")
    for k in range(2):  # the Tracker cancels on every hop of the route
        keys = d.keys(k)
        real_redis.set(keys.cancel_marker("s1"), 1, ex=60)
        real_redis.xadd(keys.cancellations, {"session_id": "s1"})
    for w in d.workers:
        w.run_once()
    d.poll()
    d.run(["s0", "s2"])
    whole = NumpyReferenceEngine(model, n_slots=1, ctx_per_session=256)
    for i in (0, 2):
        assert d.tokens[f"s{i}"] == solo_generate(whole, ps[i], 30)
    for w in d.workers:
        assert w.scheduler.table.get("s1") is None  # released on both hops
        assert w.hops.held() == 0
    assert len(d.tokens["s1"]) < 30
    # a step relayed after the cancel is answered cancelled, never computed
    statuses = {r.status for _, r in d.results["s1"][-2:]}
    assert statuses <= {Status.OK, Status.CANCELLED}
