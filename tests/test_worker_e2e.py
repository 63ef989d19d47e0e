"""The service end to end: real redis-server, a consumer in a subprocess, the producer in the test.

Every session's tokens are compared with the same session run alone on the engine (greedy), so any
cross-session corruption (a swapped slot, position or output row) shows up as a token mismatch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from consumer.runtime import make_engine
from dgrtools.localredis import LocalRedis
from producer import Producer
from schemas import (
    RouteHop,
    Sampling,
    SessionSpec,
    Status,
    WorkerKeys,
)

from .support import ConsumerProcess, prompts, session_results, solo_generate

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 10
ENGINES = ["reference", "llama"]


@pytest.fixture(scope="module")
def solo_cache(tiny_model_path: Path) -> dict[tuple[str, tuple[int, ...], int], list[int]]:
    return {}


def solo(kind: str, model: Path, prompt: list[int], n: int, cache: dict) -> list[int]:  # type: ignore[type-arg]
    key = (kind, tuple(prompt), n)
    if key not in cache:
        if kind == "llama":
            pytest.importorskip("llama_cpp")
        eng = make_engine(model, kind=kind, recipe="invariant", n_slots=2, ctx_per_session=1024)  # type: ignore[arg-type]
        try:
            cache[key] = solo_generate(eng, prompt, n)
        finally:
            eng.close()
    return cache[key]


@pytest.fixture(scope="module", params=ENGINES)
def service(request: pytest.FixtureRequest, redis_server: LocalRedis, tiny_model_path: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ConsumerProcess]]:
    kind = request.param
    if kind == "llama":
        pytest.importorskip("llama_cpp")
    worker_id = f"e2e-{kind}"
    proc = ConsumerProcess(redis_server.url, worker_id, tiny_model_path, tmp_path_factory.mktemp("logs"),
                           engine=kind, slots=8)
    yield kind, proc
    assert proc.stop() == 0, proc.log()


def specs_for(producer: Producer, worker_id: str, prefix: str, ps: list[list[int]], max_tokens: int = MAX_TOKENS,
              sampling: Sampling | None = None) -> list[tuple[SessionSpec, list[int]]]:
    key = producer.discover(worker_id).keys[0]
    return [(SessionSpec(session_id=f"{prefix}-{i}", account_id=f"acct-{i % 2}",
                         route=(RouteHop(worker_id=worker_id, key=key),), sampling=sampling or Sampling(),
                         max_tokens=max_tokens), p) for i, p in enumerate(ps)]


def ok_results(client: redis.Redis, worker_id: str, session_id: str) -> list:  # type: ignore[type-arg]
    return session_results(client, worker_id, session_id)  # on the stream its jobs' reply_to names


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_concurrent_sessions_equal_their_solo_runs(service: tuple[str, ConsumerProcess], n: int,
                                                   tiny_model_path: Path, solo_cache: dict) -> None:  # type: ignore[type-arg]
    kind, proc = service
    client = redis.Redis.from_url(proc.redis_url)
    producer = Producer(client, prefill_chunk=16)
    ps = prompts(n, 300, seed=100 + n)
    specs = specs_for(producer, proc.worker_id, f"c{n}", ps)
    handles = producer.run_many(specs, start_times=[0.03 * i for i in range(n)])  # staggered arrivals
    for (spec, prompt), h in zip(specs, handles.values(), strict=True):
        assert h.status == "finished", (spec.session_id, h.status)
        assert h.generated == solo(kind, tiny_model_path, prompt, MAX_TOKENS, solo_cache), spec.session_id
        acct = client.hgetall(WorkerKeys(proc.worker_id).session_account(spec.session_id))
        assert int(acct[b"generated_tokens"]) == MAX_TOKENS
        assert int(acct[b"prompt_tokens"]) == len(prompt)
        results = ok_results(client, proc.worker_id, spec.session_id)
        assert [r.token for r in results if r.token is not None] == h.generated  # in order, none twice


def test_cancellation_mid_prefill_and_mid_decode_then_slot_reuse(redis_server: LocalRedis, tiny_model_path: Path,
                                                                  tmp_path: Path, solo_cache: dict) -> None:  # type: ignore[type-arg]
    proc = ConsumerProcess(redis_server.url, "e2e-cancel", tiny_model_path, tmp_path, slots=2,
                           extra=("--prefill-budget", "8"))
    try:
        client = redis.Redis.from_url(redis_server.url)
        producer = Producer(client, prefill_chunk=8)
        long_prompt, short_prompt = prompts(1, 300, seed=7, lo=200, hi=200)[0], prompts(1, 300, seed=8)[0]
        (spec_a, pa), (spec_b, pb) = specs_for(producer, "e2e-cancel", "cx", [long_prompt, short_prompt],
                                               max_tokens=40)
        seen: dict[str, list] = {"cx-0": [], "cx-1": []}  # type: ignore[type-arg]

        def on_result(h: object, r) -> None:  # type: ignore[no-untyped-def]
            seen[r.session_id].append(r)
            if r.session_id == "cx-1" and r.token is not None and len([x for x in seen["cx-1"] if x.token]) == 3:
                producer.cancel("e2e-cancel", "cx-1")  # mid-decode

        def cancel_a_soon() -> None:
            time.sleep(0.05)
            producer.cancel("e2e-cancel", "cx-0")  # mid-prefill: 200 tokens at 8 per call

        t = threading.Thread(target=cancel_a_soon)
        t.start()
        handles = producer.run_many([(spec_a, pa), (spec_b, pb)], on_result=on_result)
        t.join()
        for sid in ("cx-0", "cx-1"):
            statuses = [r.status for r in seen[sid]]
            assert Status.CANCELLED in statuses, (sid, statuses)
            after = statuses[statuses.index(Status.CANCELLED):]
            assert set(after) == {Status.CANCELLED}, f"{sid}: a result after the cancellation: {after}"
            assert handles[sid].status == "cancelled"
            # accounting stops at the cancel: exactly the tokens that were produced before it
            acct = client.hgetall(WorkerKeys("e2e-cancel").session_account(sid))
            produced = sum(1 for r in seen[sid] if r.status == Status.OK and r.token is not None)
            assert int(acct.get(b"generated_tokens", 0)) == produced
        assert 3 <= len(handles["cx-1"].generated) < 40
        # both slots were freed: two new sessions fit and still equal their solo runs
        again = specs_for(producer, "e2e-cancel", "re", prompts(2, 300, seed=9))
        handles = producer.run_many(again)
        for (_spec, prompt), h in zip(again, handles.values(), strict=True):
            assert h.generated == solo("reference", tiny_model_path, prompt, MAX_TOKENS, solo_cache)
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.mark.parametrize("extra", [(), ("--overlap-max-call-ms", "0.001")], ids=["default", "calls-in-the-loop"])
def test_kill_9_then_restart_every_session_completes_exactly(redis_server: LocalRedis, tiny_model_path: Path,
                                                             tmp_path: Path, solo_cache: dict,  # type: ignore[type-arg]
                                                             extra: tuple[str, ...]) -> None:
    """`calls-in-the-loop`: every call counts as long, so it runs in the loop's thread with its reads, filings and
    heartbeats on the I/O thread (Worker._mode), the path of a CPU engine's long calls (Gemma's)."""
    worker = f"e2e-crash{len(extra)}"
    proc = ConsumerProcess(redis_server.url, worker, tiny_model_path, tmp_path, slots=4, extra=extra)
    client = redis.Redis.from_url(redis_server.url)
    producer = Producer(client, prefill_chunk=16, timeout_s=120)
    n_tokens = 24
    specs = specs_for(producer, worker, "k9", prompts(4, 300, seed=11), max_tokens=n_tokens)
    got: dict[str, int] = {}
    box: dict[str, object] = {}
    killed = threading.Event()

    def on_result(h: object, r) -> None:  # type: ignore[no-untyped-def]
        got[r.session_id] = got.get(r.session_id, 0) + (r.token is not None)
        if not killed.is_set() and sum(got.values()) >= 20:
            killed.set()
            proc.kill()  # kill -9 in the middle of the run

    def drive() -> None:
        box["handles"] = producer.run_many(specs, on_result=on_result, replay_state_lost=True)

    t = threading.Thread(target=drive)
    t.start()
    assert killed.wait(120), proc.log()
    restarted = ConsumerProcess(redis_server.url, worker, tiny_model_path, tmp_path, slots=4, extra=extra)
    t.join(300)
    assert not t.is_alive()
    try:
        handles = box["handles"]
        keys = WorkerKeys(worker)
        for spec, prompt in specs:
            h = handles[spec.session_id]  # type: ignore[index]
            assert h.status == "finished"
            assert h.generated == solo("reference", tiny_model_path, prompt, n_tokens, solo_cache)
            results = ok_results(client, worker, spec.session_id)
            steps = [(r.job_id) for r in results]
            assert len(steps) == len(set(steps)), "a step was published twice"
            # a replay samples the session's tokens again (an invariant engine): each position answered the same
            by_position: dict[int, int] = {}
            for r in results:
                if r.status == Status.OK and r.token is not None:
                    assert by_position.setdefault(r.position, r.token) == r.token, (spec.session_id, r.position)
            acct = client.hgetall(keys.session_account(spec.session_id))
            assert int(acct[b"generated_tokens"]) == len(by_position)  # accounting == tokens produced
        # the iteration the restarted process ran its calls in, as its heartbeat says (Worker._mode): its first two
        # calls run on the engine thread (no call measured when the mode is chosen), every later one in the loop's
        # thread in `calls-in-the-loop`; on the engine thread, greedy decode calls chained (worker/chain.py)
        where = restarted.wait_heartbeat(since=time.time())["stats"]["calls_by_iteration"]
        if extra:
            assert where["loop_thread"] >= 1 and where["engine_thread"] <= 2 and where["in_order"] == 0, where
            assert where["chained"] == 0, where
        else:
            assert where["engine_thread"] >= 1 and where["chained"] >= 1 and where["in_order"] == 0, where
    finally:
        assert restarted.stop() == 0, restarted.log()


def test_sigterm_exits_zero_and_leaves_unread_entries(redis_server: LocalRedis, tiny_model_path: Path,
                                                      tmp_path: Path) -> None:
    proc = ConsumerProcess(redis_server.url, "e2e-term", tiny_model_path, tmp_path)
    assert proc.stop() == 0, proc.log()
    client = redis.Redis.from_url(redis_server.url)
    producer = Producer(client, max_lag=None)
    (spec, prompt), = specs_for(producer, "e2e-term", "term", prompts(1, 300, seed=3))
    producer.open(spec, prompt)
    stream = WorkerKeys("e2e-term").input_stream(spec.route[0].key.for_phase("prefill").digest, "prefill")
    time.sleep(0.2)
    assert client.xlen(stream) >= 1
    groups = client.xinfo_groups(stream)
    assert groups[0]["pending"] == 0  # nobody took it: it waits for the next start


def test_bad_input_is_answered_while_other_sessions_run(redis_server: LocalRedis, tiny_model_path: Path,
                                                        tmp_path: Path, solo_cache: dict) -> None:  # type: ignore[type-arg]
    from schemas import Reason, StepJob, job_to_fields

    worker = "e2e-bad"
    proc = ConsumerProcess(redis_server.url, worker, tiny_model_path, tmp_path, slots=8)
    try:
        client = redis.Redis.from_url(redis_server.url)
        producer = Producer(client, prefill_chunk=16)
        good = specs_for(producer, worker, "good", prompts(2, 300, seed=21), max_tokens=30)
        box: dict[str, object] = {}
        t = threading.Thread(target=lambda: box.update(h=producer.run_many(good)))
        t.start()
        keys = WorkerKeys(worker)
        key = producer.discover(worker).keys[0]
        pre = keys.input_stream(key.for_phase("prefill").digest, "prefill")
        dec = keys.input_stream(key.for_phase("decode").digest, "decode")
        (victim, vprompt), = specs_for(producer, worker, "victim", prompts(1, 300, seed=22), max_tokens=30)
        now = time.time()

        def job(sid: str, **kw: object) -> dict[str, str]:
            base: dict[str, object] = dict(job_id=f"bad-{sid}-{len(kw)}-{kw.get('start_position', 0)}",
                                           session_id=sid, phase="prefill", compat=key.for_phase("prefill").digest,
                                           start_position=0, tokens=(5, 6, 7), created_at=now,
                                           session=victim.model_copy(update={"session_id": sid}))
            base.update(kw)
            if "compat" not in kw:
                base["compat"] = key.for_phase(base["phase"]).digest  # type: ignore[arg-type]
            return job_to_fields(StepJob(**base))  # type: ignore[arg-type]

        opening = job("victim", tokens=tuple(vprompt), job_id="victim-open")
        client.xadd(pre, opening)  # a fine session, to aim bad steps at
        time.sleep(0.3)
        bad: dict[str, tuple[str, dict[str, str]]] = {
            "garbage": (pre, {"hello": "\u00ff not a job"}),
            "version": (pre, {**job("s-version"), "v": "9"}),
            "incompatible": (pre, job("s-incompat", compat="0" * 16)),
            "gap": (dec, job("victim", phase="decode", session=None, start_position=len(vprompt) + 5, tokens=(3,),
                              job_id="victim-gap")),
            "duplicate": (dec, job("victim", phase="decode", session=None, start_position=len(vprompt) - 1,
                                   tokens=(3,), job_id="victim-dup")),
            "same-job-again": (pre, opening),
            "bad-token": (pre, job("s-token", tokens=(1, 10**6))),
            "too-long": (pre, job("s-long", tokens=tuple([5] * 1100))),
            "unknown": (dec, job("s-unknown", phase="decode", session=None, start_position=4, tokens=(3,))),
            "oversized": (pre, {**job("s-big"), "j": job("s-big")["j"][:-1] + ',"pad":"' + "1" * (70 * 1024) + '"}'}),
        }
        for stream, fields in bad.values():
            client.xadd(stream, fields)  # type: ignore[arg-type]
        t.join(120)
        handles = box["h"]
        for spec, prompt in good:  # the others are untouched
            h = handles[spec.session_id]  # type: ignore[index]
            assert h.generated == solo("reference", tiny_model_path, prompt, 30, solo_cache)

        def reasons(sid: str) -> list[tuple[str, str | None]]:
            return [(r.status.value, r.reason.value if r.reason else None) for r in ok_results(client, worker, sid)]

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(reasons("victim")) < 3:
            time.sleep(0.1)
        assert reasons("s-version") == [("rejected", Reason.SCHEMA_VERSION.value)]
        assert reasons("s-incompat") == [("rejected", Reason.INCOMPATIBLE.value)]
        assert reasons("s-token") == [("rejected", Reason.BAD_TOKEN.value)]
        assert reasons("s-long") == [("rejected", Reason.TOO_LONG.value)]
        assert reasons("s-unknown") == [("state_lost", Reason.UNKNOWN_SESSION.value)]
        assert reasons("s-big") == [("rejected", Reason.MALFORMED.value)]
        victim_answers = reasons("victim")
        assert victim_answers[0] == ("ok", None)  # its opening, once: the re-sent same job id adds nothing
        assert sorted(victim_answers[1:]) == sorted([("rejected", Reason.POSITION_GAP.value),
                                                     ("rejected", Reason.DUPLICATE.value)])
        dead = client.xrange(keys.dead_letters)
        dead_reasons = sorted(f[b"reason"].decode() for _, f in dead)
        assert dead_reasons == sorted([Reason.MALFORMED.value, Reason.SCHEMA_VERSION.value, Reason.MALFORMED.value])
        assert proc.proc.poll() is None, "the worker died"
    finally:
        assert proc.stop() == 0, proc.log()


def test_tracker_sim_drives_a_consumer_and_cancels_on_purpose(redis_server: LocalRedis, tiny_model_path: Path,
                                                              tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    # one slot per session: no capacity refusal however the openings overlap on a loaded machine
    proc = ConsumerProcess(redis_server.url, "e2e-sim", tiny_model_path, tmp_path, slots=6)
    try:
        out = tmp_path / "sim.json"
        run = subprocess.run([sys.executable, "-m", "consumer", "tracker-sim", "--redis-url", redis_server.url,
                              "--worker-id", "e2e-sim", "--sessions", "6", "--prompt-len", "4:20", "--max-tokens", "8",
                              "--rate", "50", "--cancel-fraction", "0.34", "--temperature", "0.8", "--top-k", "20",
                              # one job per token: with continuation credit the worker may finish a session
                              # (8 tokens) before the Tracker's cancel on purpose reaches it
                              "--decode-n", "1",
                              "--seed", "3", "--json-out", str(out)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "tok/s" in run.stdout
        sessions = json.loads(out.read_text())["sessions"]
        statuses = sorted(s["status"] for s in sessions)
        assert statuses == ["cancelled"] * 2 + ["finished"] * 4
        assert all(len(s["generated"]) == 8 for s in sessions if s["status"] == "finished")
    finally:
        assert proc.stop() == 0, proc.log()
