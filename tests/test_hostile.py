"""A hostile writer next to honest sessions, on a live in-process worker (fakeredis and a real
redis-server): known crashers, the hop rules, random bytes on every stream, bursts, slot fairness.

No timing is asserted: bursts are measured in fused calls and reads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.engines.reference import NumpyReferenceEngine
from consumer.transport import Filing
from dgrtools.localredis import LocalRedis
from schemas import Reason, RouteHop, SessionSpec, Status, StepJob, WorkerKeys, job_to_fields, results_from_fields

from .hostile_support import WID, Honest, accounted, dead_letters, make_worker
from .support import prompts, solo_generate

VOCAB = 300


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[NumpyReferenceEngine]:
    eng = NumpyReferenceEngine(tiny_model_path, n_slots=8, ctx_per_session=512)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def solo(engine: NumpyReferenceEngine) -> dict[int, list[int]]:
    """Solo greedy tokens of the honest prompts (index -> 6 tokens)."""
    return {i: solo_generate(engine, p, 6) for i, p in enumerate(prompts(3, VOCAB, seed=13))}


def honest_prompt(i: int) -> list[int]:
    return prompts(3, VOCAB, seed=13)[i]


def results_of(client: redis.Redis, sid: str) -> list[tuple[str, str, str]]:
    """(job_id, status, reason) of every result in a session's stream."""
    out = []
    for _id, f in client.xrange(WorkerKeys(WID).results(sid)):
        for r in results_from_fields(f):
            out.append((r.job_id, r.status.value, r.reason.value if r.reason else ""))
    return out


# ------------------------------------------------------------------------------------ known crashers


def test_non_utf8_cancellation_is_dead_lettered_once_even_across_restarts(
        redis_client: redis.Redis, engine: NumpyReferenceEngine, solo: dict[int, list[int]]) -> None:
    worker = make_worker(redis_client, engine)
    h = Honest(redis_client, worker)
    h.open("honest-0", honest_prompt(0), 6)
    cancel = WorkerKeys(WID).cancellations
    bad = redis_client.xadd(cancel, {b"session_id": b"\xff\xfe\xfd"}).decode()
    newline = redis_client.xadd(cancel, {b"session_id": b"honest-0\n"}).decode()
    h.run(["honest-0"])
    assert h.tokens["honest-0"] == solo[0], "the cancel with a trailing newline must not name honest-0"
    dlq = dead_letters(redis_client)
    assert sorted(d[b"entry_id"].decode() for d in dlq) == sorted([bad, newline])
    assert all(d[b"reason"] == b"malformed" and d[b"stream"] == cancel.encode() for d in dlq)
    # a restart re-reads the cancel stream from the start: no crash, and no second dead letter
    again = make_worker(redis_client, engine)
    for _ in range(3):
        again.run_once()
    assert len(dead_letters(redis_client)) == 2


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_ids_ending_in_a_newline_are_refused_not_fatal(redis_client: redis.Redis, engine: NumpyReferenceEngine,
                                                       solo: dict[int, list[int]], phase: str) -> None:
    worker = make_worker(redis_client, engine)
    h = Honest(redis_client, worker)
    h.open("honest-0", honest_prompt(0), 6)
    key = worker.keys[phase]  # type: ignore[index]
    stream = WorkerKeys(WID).input_stream(key.digest, phase)  # type: ignore[arg-type]
    fields = job_to_fields(StepJob(job_id="j-nl", session_id="named-1", phase=phase,  # type: ignore[arg-type]
                                   compat=key.digest, start_position=0 if phase == "prefill" else 3, tokens=(5,),
                                   created_at=time.time(),
                                   session=h.spec("named-1", 4) if phase == "prefill" else None))
    body = json.loads(fields["j"])
    both = redis_client.xadd(stream, {**fields, "j": json.dumps({**body, "session_id": "victim\n",
                                                                 "job_id": "j-nl\n"})}).decode()
    job_only = redis_client.xadd(stream, {**fields, "j": json.dumps({**body, "job_id": "j-nl\n"})}).decode()
    h.run(["honest-0"])
    assert h.tokens["honest-0"] == solo[0]
    reasons = {d[b"entry_id"].decode(): d[b"reason"] for d in dead_letters(redis_client)}
    assert reasons == {both: b"malformed", job_only: b"malformed"}
    # the nameable session is told under the entry's own id; the one with no valid id is not
    assert results_of(redis_client, "named-1") == [(f"{phase}.{job_only}", "rejected", "malformed")]
    assert not redis_client.exists(WorkerKeys(WID).results("victim"))
    # and no entry is left pending to crash a restarted worker
    assert redis_client.xpending(stream, "dgr-workers")["pending"] == 0


def test_an_exception_anywhere_in_admission_is_contained(redis_client: redis.Redis, engine: NumpyReferenceEngine,
                                                         solo: dict[int, list[int]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """'Anything added later': whatever raises while one entry is admitted costs that entry only."""
    worker = make_worker(redis_client, engine)
    h = Honest(redis_client, worker)
    real_admit = worker.scheduler.admit

    def admit(job: StepJob, digest: str, ref: object) -> object:
        if job.session_id == "boom":
            raise RuntimeError("a bug this entry reaches")
        return real_admit(job, digest, ref)

    monkeypatch.setattr(worker.scheduler, "admit", admit)
    h.open("boom", [1, 2, 3], 4)
    h.open("honest-0", honest_prompt(0), 6)
    h.run(["honest-0"])
    assert h.tokens["honest-0"] == solo[0]
    (d,) = dead_letters(redis_client)
    assert d[b"reason"] == b"malformed" and b"RuntimeError" in d[b"detail"]


# ------------------------------------------------------------------------------------ hop rules


def test_hop_must_be_on_the_route_and_name_this_worker(redis_client: redis.Redis,
                                                       engine: NumpyReferenceEngine) -> None:
    worker = make_worker(redis_client, engine)
    h = Honest(redis_client, worker)
    key = worker.keys["prefill"]
    elsewhere = SessionSpec(session_id="elsewhere", account_id="a", route=(RouteHop(worker_id="other-w", key=key),))
    h.push(StepJob(job_id="j-else", session_id="elsewhere", phase="prefill", compat=key.digest, start_position=0,
                   tokens=(1, 2), created_at=time.time(), session=elsewhere))
    h.push(StepJob(job_id="j-hop", session_id="off-route", hop=1, phase="prefill", compat=key.digest,
                   start_position=0, tokens=(1, 2), created_at=time.time(), session=h.spec("off-route", 4)))
    h.open("honest-0", [1, 2, 3], 6)
    for _ in range(3):
        worker.run_once()
    # a later step of an open session on another hop
    h.push(StepJob(job_id="j-late", session_id="honest-0", hop=2, phase="decode",
                   compat=key.for_phase("decode").digest, start_position=3, tokens=(4,), created_at=time.time()))
    for _ in range(3):
        worker.run_once()
    assert results_of(redis_client, "elsewhere") == [("j-else", "rejected", "wrong_hop")]
    assert results_of(redis_client, "off-route") == [("j-hop", "rejected", "wrong_hop")]
    assert ("j-late", "rejected", "wrong_hop") in results_of(redis_client, "honest-0")
    # rejected before they opened: no per-session accounting key, nothing billed
    assert not redis_client.exists(WorkerKeys(WID).session_account("elsewhere"))


# ------------------------------------------------------------------------------------ random bytes

NAMES = [b"v", b"job_id", b"session_id", b"hop", b"phase", b"compat", b"pos", b"tokens", b"sample", b"attempt",
         b"created_at", b"session", b"sig"]
ODD = [b"1", b"0", b"", b"decode", b"prefill", b" 12", b"1_2", b"+3", b"\xff\xfe", b"x-1\n", b"x-1", b"x-2",
       b"\xef\xbc\x91", b"-1", b"1e3", b"nan", b"{}", b'{"v":1}', b"a}{b", b"*", b"0" * 70]
field_names = st.sampled_from(NAMES) | st.binary(max_size=10)
field_values = st.sampled_from(ODD) | st.binary(max_size=30)
random_map = st.dictionaries(field_names, field_values, min_size=1, max_size=14)


@st.composite
def mutated_job(draw: st.DrawFn) -> dict[bytes, bytes]:
    """A valid job of a made-up session, with a few fields replaced or dropped (reaches deeper checks)."""
    n = draw(st.integers(1, 3))
    phase = draw(st.sampled_from(["prefill", "decode"]))
    opening = phase == "prefill" and draw(st.booleans())
    sid = f"x-{draw(st.integers(0, 5))}"
    key = _KEYS[phase]
    spec = SessionSpec(session_id=sid, account_id="mallory", route=(RouteHop(worker_id=WID, key=key),), max_tokens=2)
    job = StepJob(job_id=f"xj-{draw(st.integers(0, 10**6))}", session_id=sid, phase=phase,  # type: ignore[arg-type]
                  compat=key.digest, start_position=0 if opening else draw(st.integers(1, 8)),
                  tokens=tuple(draw(st.lists(st.integers(0, VOCAB + 5), min_size=1, max_size=1 if phase == "decode"
                                             else 6))), created_at=time.time(), session=spec if opening else None)
    f = {k.encode(): v.encode() for k, v in job_to_fields(job).items()}
    for _ in range(n):
        name = draw(st.sampled_from(NAMES))
        if draw(st.booleans()):
            f.pop(name, None)
        else:
            f[name] = draw(field_values)
    return f


_KEYS: dict[str, object] = {}
cancel_map = st.fixed_dictionaries({b"session_id": st.sampled_from([b"x-1", b"x-2\n", b"\xff", b"", b"x-3"])}) \
    | random_map
entries = st.lists(st.one_of(st.tuples(st.sampled_from(["prefill", "decode"]), random_map | mutated_job()),
                             st.tuples(st.just("cancel"), cancel_map)), min_size=1, max_size=20)


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    from dgrtools.localredis import find_redis_server
    if find_redis_server() is None:
        pytest.skip("redis-server not installed")
    with LocalRedis(appendonly=False) as server:
        yield server


MUTATED = ("job_id", "session_id", "phase", "compat", "pos", "tokens", "created_at", "hop", "sample", "attempt", "n",
           "session", "drop")


def derived_entries(client: redis.Redis, streams: dict[str, str], data: st.DataObject) -> list[tuple[str, dict]]:
    """Entries built from the honest traffic seen so far (issue 29: hunt the class): a copy of an honest job entry
    (its ids copied) with one field of its body changed or dropped, answered to the session's own stream (the
    Tracker's `reply_to` left out: a forger naming it makes the Tracker replay, tests/test_forged_job_ids.py)."""
    seen = [(where, json.loads(f[b"j"])) for where in ("prefill", "decode")
            for _id, f in client.xrange(streams[where]) if b"j" in f and b"honest-j" in f[b"j"]]
    if not seen:
        return []
    out: list[tuple[str, dict]] = []
    for _ in range(data.draw(st.integers(1, 6), label="derived")):
        where, body = data.draw(st.sampled_from(seen), label="copied")
        body = dict(body)
        body.pop("reply_to", None)
        name = data.draw(st.sampled_from(MUTATED), label="field")
        old = body.get(name)
        if name == "drop":
            body.pop(data.draw(st.sampled_from(sorted(body)), label="dropped"), None)
        elif isinstance(old, bool) or name == "sample":
            body[name] = not old if isinstance(old, bool) else False
        elif isinstance(old, int | float) or name in ("hop", "attempt", "n"):
            body[name] = data.draw(st.sampled_from([0, 1, 2, 5, -1]).map(lambda d, o=old or 0: o + d if d else 0),
                                   label="number")
        elif name == "tokens":
            body[name] = data.draw(st.sampled_from([[], [0], [VOCAB - 1], [7, 7], old[:1] if old else [1]]),
                                   label="tokens")
        elif name == "session":
            if old is None:
                continue
            body[name] = {**old, "account_id": data.draw(st.sampled_from(["mallory", "honest-acct"]), label="acct")}
        else:
            body[name] = data.draw(st.sampled_from(["honest-0", "honest-1", "x-1", "honest-j0", "prefill", "decode"]),
                                   label="text")
        out.append((where, {b"v": b"2", b"j": json.dumps(body).encode()}))
    return out


@pytest.mark.parametrize("backend", ["fake", "real"])
def test_random_entries_on_every_stream_leave_honest_sessions_unchanged(
        backend: str, engine: NumpyReferenceEngine, solo: dict[int, list[int]],
        request: pytest.FixtureRequest) -> None:
    server: LocalRedis | None = request.getfixturevalue("live_server") if backend == "real" else None

    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(hostile=entries, before=st.booleans(), data=st.data())
    def check(hostile: list[tuple[str, dict[bytes, bytes]]], before: bool, data: st.DataObject) -> None:
        client = (redis.Redis.from_url(server.url) if server is not None
                  else fakeredis.FakeRedis(server=fakeredis.FakeServer()))
        client.flushall()
        worker = make_worker(client, engine)
        _KEYS.update({p: worker.keys[p] for p in ("prefill", "decode")})  # type: ignore[index]
        # a forged job is answered to its session's own stream, which a Tracker naming its own does not read
        h = Honest(client, worker, reply="honest-tracker")
        keys = WorkerKeys(WID)
        streams = {p: keys.input_stream(worker.keys[p].digest, p) for p in ("prefill", "decode")}  # type: ignore[index]
        streams["cancel"] = keys.cancellations
        pushed: list[tuple[str, str, dict[bytes, bytes]]] = []

        def push_hostile() -> None:
            for where, fields in hostile:
                eid = client.xadd(streams[where], fields).decode()  # type: ignore[arg-type]
                pushed.append((streams[where], eid, fields))

        if before:
            push_hostile()
        h.open("honest-0", honest_prompt(0), 6)
        h.open("honest-1", honest_prompt(1), 6)
        worker.run_once()
        if not before:
            push_hostile()
        for _ in range(data.draw(st.integers(0, 4), label="steps before the copies")):
            worker.run_once()
            h.poll()
        for where, fields in derived_entries(client, streams, data):
            eid = client.xadd(streams[where], fields).decode()  # type: ignore[arg-type]
            pushed.append((streams[where], eid, fields))
        h.run(["honest-0", "honest-1"])
        for _ in range(3):  # hostile sessions that opened may still have a step to answer
            worker.run_once()
        assert h.tokens["honest-0"] == solo[0] and h.tokens["honest-1"] == solo[1]
        # the honest sessions ended: none holds a slot (no reaper), whatever was forged under their ids
        assert "honest-0" not in worker.scheduler.table and "honest-1" not in worker.scheduler.table
        dlq = dead_letters(client)
        missing = [(s, e, f) for s, e, f in pushed if not accounted(client, s, e, f, dlq)]
        assert not missing, missing
        for s in (streams["prefill"], streams["decode"]):
            assert client.xpending(s, "dgr-workers")["pending"] == 0
        client.close()

    check()


# ------------------------------------------------------------------------------------ bursts


@pytest.mark.parametrize("where", ["decode", "prefill", "cancel"])
def test_a_burst_of_junk_delays_honest_decode_by_at_most_one_fused_call(
        redis_client: redis.Redis, engine: NumpyReferenceEngine, solo: dict[int, list[int]], where: str) -> None:
    worker = make_worker(redis_client, engine, max_batch=4, prefill_budget=64)
    h = Honest(redis_client, worker)
    h.open("honest-0", honest_prompt(0), 6)
    h.open("honest-1", honest_prompt(1), 6)
    honest = ("honest-0", "honest-1")

    def waiting_for_a_step(sid: str) -> bool:  # answered, and its next step not pushed yet
        return bool(h.tokens[sid]) and h.position[sid] == len(honest_prompt(int(sid[-1]))) + len(h.tokens[sid]) - 1

    while not all(len(h.tokens[s]) >= 2 and waiting_for_a_step(s) for s in honest):  # both decoding
        worker.run_once()
        h.poll(push_next=False)
        for sid in honest:
            if waiting_for_a_step(sid) and len(h.tokens[sid]) < 2:
                h.decode(sid, h.tokens[sid][-1])
    # a long prompt keeps prefill work queued, so decode has a competitor for every call
    h.open("long", list(range(1, 250)), 1)
    keys = WorkerKeys(WID)
    stream = keys.cancellations if where == "cancel" else keys.input_stream(worker.keys[where].digest, where)  # type: ignore[index]
    junk = {b"v": b"1", b"session_id": b"x-1", b"job_id": b"junk", b"pos": b" 1"}
    pipe = redis_client.pipeline(transaction=False)
    for _ in range(1000):
        pipe.xadd(stream, junk if where != "cancel" else {b"session_id": b"\xff"})
    pipe.execute()
    # the honest sessions' next steps arrive behind the burst
    for sid in honest:
        h.decode(sid, h.tokens[sid][-1])
    served_before = {sid: len(h.tokens[sid]) for sid in honest}
    calls_before, reads_before = worker.stats.fused_calls, worker.stats.reads
    calls = 0
    while any(len(h.tokens[s]) == served_before[s] for s in served_before):
        worker.run_once()
        h.poll(push_next=False)
        calls = worker.stats.fused_calls - calls_before
        assert calls <= 2, "honest decode waited more than one fused call behind the burst"
    print(f"\n1000 junk entries on {where}: honest decode served after {calls} fused calls, "
          f"{worker.stats.reads - reads_before} reads")
    assert worker.stats.refused >= (0 if where == "cancel" else 1000)
    assert len(dead_letters(redis_client)) == 1000
    # reading past 1000 refused entries: a few doubling reads, not 1000 / want of them
    assert worker.stats.reads - reads_before <= 2 * (calls + 1) + 12
    for sid in honest:
        if waiting_for_a_step(sid) and not h.results[sid][-1].finished:
            h.decode(sid, h.tokens[sid][-1])
    h.run(["honest-0", "honest-1", "long"])
    assert h.tokens["honest-0"] == solo[0] and h.tokens["honest-1"] == solo[1]


def test_refusals_never_stand_in_front_of_honest_answers_in_time(
        real_redis: redis.Redis, engine: NumpyReferenceEngine, solo: dict[int, list[int]]) -> None:
    """1,000 steps the worker answers `rejected` (sessions it does not hold) and 300 malformed entries
    (dead letters) queued ahead of two honest sessions' next decode steps: the honest tokens are filed
    before any refusal of the burst, and the time they wait is measured (real redis-server)."""
    worker = make_worker(real_redis, engine, max_batch=4)
    h = Honest(real_redis, worker)
    honest = ("honest-0", "honest-1")
    for sid in honest:
        h.open(sid, honest_prompt(int(sid[-1])), 6)
    while not all(h.tokens[s] for s in honest):
        worker.run_once()
        h.poll(push_next=False)
    filed: list[tuple[float, int, int]] = []  # per completion: when it was filed, honest tokens, refusals
    complete = worker.transport.complete

    def recording(filing: Filing) -> object:
        out = complete(filing)
        answers = filing.answers
        ok = sum(1 for a in answers if a.result.session_id in honest and a.result.token is not None)
        filed.append((time.perf_counter(), ok, len(answers) - ok + len(filing.dead_letters)))
        return out

    worker.transport.complete = recording  # type: ignore[method-assign]

    def step_ms() -> tuple[float, int]:
        """Push both sessions' next decode steps, serve them: ms until their tokens were filed, and the worker's
        iterations until then."""
        t0 = time.perf_counter()
        for sid in honest:
            h.decode(sid, h.tokens[sid][-1])
        served = {sid: len(h.tokens[sid]) for sid in honest}
        iterations = until_filed = 0
        while any(len(h.tokens[s]) == served[s] for s in honest):
            worker.run_once()
            iterations += 1
            until_filed = until_filed or (iterations if any(f[1] for f in filed) else 0)
            h.poll(push_next=False)
        return 1e3 * (next(f[0] for f in filed if f[1]) - t0), until_filed

    baseline_ms, baseline_iterations = step_ms()
    filed.clear()
    keys = WorkerKeys(WID)
    pre = worker.keys["prefill"]  # type: ignore[index]
    stream = keys.input_stream(pre.digest, "prefill")
    pipe = real_redis.pipeline(transaction=False)
    for i in range(1000):
        job = StepJob(job_id=f"burst-{i}", session_id="x-0", phase="prefill", compat=pre.digest, start_position=4,
                      tokens=(1, 2), created_at=time.time())
        pipe.xadd(stream, job_to_fields(job))  # type: ignore[arg-type]
        if i % 10 == 0:
            pipe.xadd(stream, {b"v": b"2", b"j": b"{not json"})
    pipe.execute()
    waited_ms, iterations = step_ms()
    first_honest = next(i for i, f in enumerate(filed) if f[1])
    first_refusal = next(i for i, f in enumerate(filed) if f[2])
    assert first_honest < first_refusal, filed
    refusals_ms = 1e3 * (filed[first_refusal][0] - filed[first_honest][0])
    print(f"\nhonest tokens filed {waited_ms:.1f} ms after their steps were pushed behind 1,100 refused entries "
          f"({baseline_ms:.1f} ms without them, iterations {iterations} against {baseline_iterations}); the "
          f"refusals' completion took {refusals_ms:.1f} ms after that")
    # What is left of the burst's cost in front of honest work: reading and admitting the entries read past
    # (~25 us each, max_read_entries 1,024 per iteration: 60-95 ms alone, 122 and 297 ms seen in the whole suite
    # on 2 loaded cores; 167-243 ms before, when the refusals were filed first). Filing them first again would
    # add only their completion (7-9 ms) here: the order assertion above is what catches it. The burst costs
    # one iteration's reading, not more: counted in the worker's iterations, not in time (a loaded machine's
    # milliseconds say nothing of it); the time is a loose bound against a pathological case only.
    assert iterations <= baseline_iterations + 1, (iterations, baseline_iterations)
    assert waited_ms <= baseline_ms + 2000, (waited_ms, baseline_ms)
    for sid in honest:
        if not h.results[sid][-1].finished:
            h.decode(sid, h.tokens[sid][-1])
    h.run(list(honest))
    for _ in range(3):
        worker.run_once()
    assert sum(f[2] for f in filed) == 1100  # every refusal and dead letter was filed, after
    assert len(dead_letters(real_redis)) == 100
    assert h.tokens["honest-0"] == solo[0] and h.tokens["honest-1"] == solo[1]


# ------------------------------------------------------------------------------------ fair use of slots


def test_an_account_holds_at_most_its_share_of_slots(redis_client: redis.Redis,
                                                     engine: NumpyReferenceEngine) -> None:
    worker = make_worker(redis_client, engine, max_slots_per_account=2)
    h = Honest(redis_client, worker)
    for i in range(3):
        h.open(f"greedy-{i}", [1, 2, 3], 2 if i == 0 else 50, account="greedy")
    h.open("fair-0", [4, 5, 6], 3, account="fair")
    h.run(["greedy-0", "greedy-2", "fair-0"])
    assert h.results["greedy-2"][-1].reason == Reason.ACCOUNT_LIMIT
    assert h.results["fair-0"][-1].finished and h.results["greedy-0"][-1].finished
    # greedy-0 finished: the account is under its limit again
    h.open("greedy-3", [1, 2, 3], 2, account="greedy")
    h.run(["greedy-3"])
    assert h.results["greedy-3"][-1].finished and h.results["greedy-3"][-1].status == Status.OK
    assert worker.scheduler.table.account_sessions("greedy") == 1  # greedy-1 still open


def test_idle_sessions_are_cancelled_through_the_normal_path(redis_client: redis.Redis,
                                                             engine: NumpyReferenceEngine) -> None:
    now = [1000.0]
    worker = make_worker(redis_client, engine, idle_session_s=30.0, clock=lambda: now[0])
    h = Honest(redis_client, worker)
    h.open("idle", [1, 2, 3], 50)
    h.open("busy", [4, 5, 6], 50)
    for _ in range(3):
        worker.run_once()
        h.poll(push_next=False)  # nobody continues either session
    assert "idle" in worker.scheduler.table and "busy" in worker.scheduler.table
    now[0] += 29.0
    worker.run_once()
    assert "idle" in worker.scheduler.table
    h.decode("busy", h.tokens["busy"][-1])  # busy sends a step just in time
    worker.run_once()
    h.poll(push_next=False)
    now[0] += 2.0
    worker.run_once()
    assert "idle" not in worker.scheduler.table and "busy" in worker.scheduler.table
    assert worker.stats.sessions_idle_cancelled == 1 and worker.scheduler.table.n_free == 8 - 1
    # the idle session's late step is answered as for any cancelled session
    h.decode("idle", h.tokens["idle"][-1])
    worker.run_once()
    h.poll(push_next=False)
    assert h.results["idle"][-1].status == Status.CANCELLED


def test_a_dead_letter_keeps_at_most_128_kib_of_a_huge_entry(redis_client: redis.Redis,
                                                             engine: NumpyReferenceEngine) -> None:
    worker = make_worker(redis_client, engine)
    stream = WorkerKeys(WID).input_stream(worker.keys["decode"].digest, "decode")
    redis_client.xadd(stream, {f"f{i}": "x" * 60_000 for i in range(5)})  # 300 KB, no version
    redis_client.xadd(stream, {"v": "3"})
    for _ in range(2):
        worker.run_once()
    big, small = dead_letters(redis_client)
    copied = sum(len(v) for k, v in big.items() if k.startswith(b"f:"))
    assert 128 * 1024 - 60_000 < copied <= 128 * 1024 and big[b"truncated"] == b"1"
    assert small[b"reason"] == b"schema_version" and b"truncated" not in small and small[b"f:v"] == b"3"
