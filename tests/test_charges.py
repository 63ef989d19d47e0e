"""What a published answer says it charged is what the counters charged, and nothing is charged twice
or lost (docs/accounting.md), searched for counterexamples with hypothesis.

A model of the worker's answers: sessions of a random prompt length and max_tokens, each run as a random
number of attempts (an attempt ends where the worker lost the session's state, anywhere, the opening
prefill included; the next replays prompt + generated tokens as prefill in random chunks, then decodes,
some decode jobs continuations of several tokens). The answers are filed through the transport's one
primitive (`complete`) in random calls (sessions interleaved, each in its own order, as the scheduler
answers), with random re-filings of earlier answers (a twin, a redelivery, an older attempt's late
answer), completion calls re-sent whole (the reply lost), and Redis losing the tail of its data (every
key restored to a snapshot taken a few calls before), after which every answer of each session's last
attempt is filed again (the Tracker re-pushes what it did not see answered).

Checked on the data set that survives, against the records published (their rows and `c`):
* per session, account and worker: the counters equal the sums of the published rows' charges;
* no two published ok rows share (session, attempt, position);
* every answer of a session's last attempt is published;
* a finished session is charged its prompt and max_tokens exactly (prompt + generated = L + M when
  Redis lost charges, the lost generated tokens then charged as the replay's prompt), however often it
  was replayed;
* prefix cache hits (issue 31): an attempt's first prefill piece may restore its first positions from the
  cache (every attempt the same ones, as a warm cache would); those are charged as `cached_tokens`, a part
  of `prompt_tokens`, exactly once: the session, its account and the worker count exactly the restored
  positions, and the published rows' `k` sum to it.
Runs on fakeredis and on a real redis-server.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.engines.reference import NumpyReferenceEngine
from consumer.ops.sessions import session_accounting
from consumer.sched import Answer, Outcome
from consumer.transport import Filing, RedisTransport
from schemas import RouteHop, SessionSpec, Status, StepJob, WorkerKeys, job_to_fields
from schemas.step import result_job_id
from schemas.wire import decode_record
from tests.hostile_support import WID, Honest, make_worker
from tests.support import compat_key

WORKER = "wc"
ACCOUNTS = ("acct-a", "acct-b")
COUNTERS = ("prompt_tokens", "generated_tokens", "recomputed_tokens", "cached_tokens", "steps")


@dataclass(frozen=True)
class Plan:
    prompt: int  # L
    max_tokens: int  # M
    cuts: tuple[int, ...]  # per lost attempt: how many of its answers were filed before the loss
    chunk: int  # prefill chunk size
    cont: int  # tokens per decode job (1: single steps; more: continuation jobs)
    cached: int = 0  # prompt positions each attempt's first piece restores from the prefix cache (at most its own)

    @property
    def restored(self) -> int:
        return min(self.cached, self.chunk, self.prompt)


def _spec(sid: str, account: str, max_tokens: int) -> SessionSpec:
    return SessionSpec(session_id=sid, account_id=account,
                       route=(RouteHop(worker_id=WORKER, key=compat_key("prefill")),), max_tokens=max_tokens)


def _answer(job: StepJob, account: str, *, rid: str, pos: int, fed: int, token: int | None, finished: bool,
            final: bool, cached: int = 0) -> Answer:
    o = Outcome(rid, job.session_id, Status.OK, None, pos, token=token, finished=finished,
                prompt_tokens=fed - cached, engine_seconds=0.001 * (1 + fed), cached_tokens=cached)
    return Answer(ref=None, job=job, result=o, account_id=account, close="finished" if finished else None,
                  final=final)


def attempt_answers(sid: str, account: str, plan: Plan, attempt: int, generated: int) -> list[Answer]:
    """Every answer of one attempt that runs to the end: prefill of prompt + `generated` tokens, then decode."""
    L, M = plan.prompt, plan.max_tokens
    out: list[Answer] = []
    n, start, g = L + generated, 0, generated
    dig = compat_key("prefill").digest
    while start < n:
        end = min(n, start + plan.chunk)
        last = end == n
        job = StepJob(job_id=f"{sid}-p{start}-{attempt}", session_id=sid, phase="prefill", compat=dig,
                      start_position=start, tokens=tuple(range(1, end - start + 1)), created_at=time.time(),
                      attempt=attempt, sample=last, session=_spec(sid, account, M) if start == 0 else None)
        out.append(_answer(job, account, rid=job.job_id, pos=end, fed=end - start, token=100 + end if last else None,
                           finished=last and g + 1 == M, final=True, cached=plan.restored if start == 0 else 0))
        start = end
    g += 1
    dig = compat_key("decode").digest
    pos = n  # the sampled token's position: where the next decode job feeds it
    while g < M:
        k = min(plan.cont, M - g)
        job = StepJob(job_id=f"{sid}-d{pos}-{attempt}", session_id=sid, phase="decode", compat=dig,
                      start_position=pos, tokens=(100 + pos,), created_at=time.time(), attempt=attempt, n=k)
        for off in range(k):
            g += 1
            out.append(_answer(job, account, rid=result_job_id(job.job_id, off), pos=pos + off + 1, fed=0,
                               token=100 + pos + off + 1, finished=g == M, final=off == k - 1))
        pos += k
    return out


def session_filings(sid: str, account: str, plan: Plan) -> tuple[list[Answer], list[Answer]]:
    """(every answer filed, in order; the last attempt's answers)."""
    filed: list[Answer] = []
    generated = 0
    for attempt, cut in enumerate(plan.cuts):
        whole = attempt_answers(sid, account, plan, attempt, generated)
        part = whole[:min(cut, len(whole) - 1)]  # lost before its last answer (that one finished the session)
        filed += part
        generated += sum(1 for a in part if a.result.token is not None)
    last = attempt_answers(sid, account, plan, len(plan.cuts), generated)
    return filed + last, last


plans = st.builds(Plan, prompt=st.integers(1, 9), max_tokens=st.integers(1, 5),
                  cuts=st.lists(st.integers(0, 6), max_size=3).map(tuple), chunk=st.integers(1, 6),
                  cont=st.integers(1, 3), cached=st.sampled_from([0, 0, 1, 3, 9]))


@dataclass(frozen=True)
class FilingPlan:
    """How the answers are filed: per call, its size, whether its reply is lost (the call re-sent), a
    snapshot before it or a restore to the last snapshot (Redis losing its tail) before it."""

    sizes: list[int]
    resend: list[bool]
    events: list[int]  # 0 nothing, 1 snapshot, 2 restore
    dups: list[int]  # indices (mod filed so far) of answers filed again in each call


filings = st.builds(FilingPlan, sizes=st.lists(st.integers(1, 8), min_size=1, max_size=40),
                    resend=st.lists(st.booleans(), max_size=40), events=st.lists(st.sampled_from([0, 0, 0, 1, 2]),
                                                                                 max_size=40),
                    dups=st.lists(st.integers(0, 10_000), max_size=40))


def snapshot(client: redis.Redis) -> dict[bytes, tuple[bytes, int]]:
    return {k: (client.dump(k), client.pttl(k)) for k in client.keys("*")}  # type: ignore[misc]


def restore(client: redis.Redis, snap: dict[bytes, tuple[bytes, int]]) -> None:
    client.flushdb()
    for k, (blob, ttl) in snap.items():
        client.restore(k, max(ttl, 0), blob)


def interleave(per_session: list[list[Answer]], draw: Any) -> list[Answer]:
    queues = [list(q) for q in per_session if q]
    out: list[Answer] = []
    while queues:
        i = draw(st.integers(0, len(queues) - 1))
        out.append(queues[i].pop(0))
        if not queues[i]:
            queues.pop(i)
    return out


def file_all(t: RedisTransport, client: redis.Redis, answers: list[Answer], f: FilingPlan) -> None:
    snap: dict[bytes, tuple[bytes, int]] | None = None
    script = t.io.script  # the reply of a re-sent call is lost: run the call twice, answer the second
    at, call = 0, 0
    while at < len(answers):
        size = f.sizes[call % len(f.sizes)]
        batch = answers[at:at + size]
        if call < len(f.dups) and at:
            batch = [*batch, answers[f.dups[call] % at]]  # an earlier answer filed again (twin, redelivery)
        event = f.events[call] if call < len(f.events) else 0
        if event == 1:
            snap = snapshot(client)
        elif event == 2 and snap is not None:
            restore(client, snap)
        resend = call < len(f.resend) and f.resend[call]

        def twice(name: str, keys: list[str], args: list[Any]) -> Any:
            script(name, keys, args)
            return script(name, keys, args)

        t.io.script = twice if resend else script  # type: ignore[method-assign]
        try:
            t.complete(Filing(batch))
        finally:
            t.io.script = script  # type: ignore[method-assign]
        at += size
        call += 1


def published(client: redis.Redis, t: RedisTransport, sids: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Per session, its published rows with what `c` says they charged."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for sid in sids:
        for _id, fields in client.xrange(t.keys.results(sid)):
            rec, chg = decode_record(fields)
            skip = set(chg.d)
            for i in range(len(rec)):
                if i in skip:
                    continue
                out[rec.session_id[i]].append({
                    "att": rec.attempt[i], "pos": rec.position[i], "st": rec.status[i], "job": rec.job[i],
                    "off": rec.offset[i], "prompt_tokens": chg.p[i], "generated_tokens": chg.g[i],
                    "recomputed_tokens": chg.r[i], "cached_tokens": chg.k[i] if chg.k else 0,
                    "fed": rec.fed_tokens[i], "tok": rec.token[i]})
    return out


def check(client: redis.Redis, t: RedisTransport, sessions: dict[str, tuple[str, Plan, list[Answer]]],
          lost: bool) -> None:
    rows = published(client, t, list(sessions))
    per_account: dict[str, Counter[str]] = defaultdict(Counter)
    total: Counter[str] = Counter()
    for sid, (account, plan, last) in sessions.items():
        mine = rows.get(sid, [])
        acct = session_accounting(client, WORKER, sid)
        sums = Counter({c: sum(r[c] for r in mine) for c in COUNTERS[:4]})
        sums["steps"] = len(mine)
        for c in COUNTERS:
            assert int(acct.get(c, 0)) == sums[c], (sid, c, acct, mine)
        per_account[account] += sums
        total += sums
        # once: no (attempt, position) published twice
        keys = Counter((r["att"], r["pos"]) for r in mine)
        assert max(keys.values(), default=1) == 1, (sid, keys)
        # complete: every answer of the last attempt is there
        want = {(a.job.attempt, a.result.position) for a in last if a.job is not None}
        assert want <= set(keys), (sid, sorted(want - set(keys)))
        # billed: L prompt tokens and M generated tokens, once, however often replayed
        L, M = plan.prompt, plan.max_tokens
        p, g = int(acct["prompt_tokens"]), int(acct["generated_tokens"])
        if lost:
            assert p + g == L + M and p >= L, (sid, p, g, L, M)
        else:
            assert (p, g) == (L, M), (sid, p, g, L, M, mine)
        # every charge of a restored position is a cached one: each is charged once, by a first piece
        assert int(acct.get("cached_tokens", 0)) == plan.restored, (sid, acct, plan)
        fed = sum(r["fed"] + (r["tok"] >= 0) for r in mine)
        assert int(acct["recomputed_tokens"]) == fed - p - g
        assert acct.get("closed") == "finished"
    for account, sums in per_account.items():
        h = {k.decode(): int(float(v)) for k, v in client.hgetall(t.keys.billing_account(account)).items()}
        for c in COUNTERS:
            assert h.get(c, 0) == sums[c], (account, c, h, sums)
    w = {k.decode(): v for k, v in client.hgetall(t.keys.worker_account).items()}
    for c in COUNTERS:
        assert int(w.get(c, 0)) == total[c], (c, w, total)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan_list=st.lists(plans, min_size=1, max_size=4), f=filings, data=st.data())
def test_charges_equal_counters_and_nothing_doubled_or_lost(redis_client: redis.Redis, plan_list: list[Plan],
                                                            f: FilingPlan, data: st.DataObject) -> None:
    redis_client.flushdb()
    t = RedisTransport(redis_client, WORKER, "c1")
    t.register([compat_key("prefill"), compat_key("decode")], {"slots": 8})
    t.acquire_lease()  # the call guard works with a lease (its epoch names the process)
    sessions: dict[str, tuple[str, Plan, list[Answer]]] = {}
    per_session: list[list[Answer]] = []
    for i, plan in enumerate(plan_list):
        sid, account = f"s{i}", ACCOUNTS[i % 2]
        filed, last = session_filings(sid, account, plan)
        sessions[sid] = (account, plan, last)
        per_session.append(filed)
    answers = interleave(per_session, data.draw)
    file_all(t, redis_client, answers, f)
    lost = 2 in f.events
    if lost:  # the Tracker re-pushes what it did not see answered: the worker re-files its last attempts
        again = interleave([last for _a, _p, last in sessions.values()], data.draw)
        file_all(t, redis_client, again, FilingPlan(sizes=[4], resend=[], events=[], dups=[]))
    check(redis_client, t, sessions, lost)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan_list=st.lists(plans.filter(lambda p: len(p.cuts) > 0), min_size=1, max_size=3), f=filings,
       data=st.data())
def test_a_fence_drops_exactly_the_moved_attempts_answers(redis_client: redis.Redis, plan_list: list[Plan],
                                                          f: FilingPlan, data: st.DataObject) -> None:
    """The Tracker fences an attempt it moved off this worker (`WorkerKeys.moved`, producer/moves.py) at any
    point of the filing: no answer of that attempt or an older one filed after the fence is published or
    charged, every answer of the later attempts is, and the counters still equal the published charges
    (each prompt position and token charged once, by whichever answer was published)."""
    redis_client.flushdb()
    t = RedisTransport(redis_client, WORKER, "c1")
    t.register([compat_key("prefill"), compat_key("decode")], {"slots": 8})
    t.acquire_lease()
    sessions: dict[str, tuple[str, Plan, list[Answer]]] = {}
    per_session: list[list[Answer]] = []
    fences: dict[str, int] = {}
    for i, plan in enumerate(plan_list):
        sid, account = f"s{i}", ACCOUNTS[i % 2]
        filed, last = session_filings(sid, account, plan)
        sessions[sid] = (account, plan, last)
        per_session.append(filed)
        fences[sid] = data.draw(st.integers(0, len(plan.cuts) - 1), label=f"fenced attempt of {sid}")
    answers = interleave(per_session, data.draw)
    cut = data.draw(st.integers(0, len(answers)), label="answers filed before the fence")
    quiet = FilingPlan(sizes=f.sizes, resend=f.resend, events=[], dups=[])  # no Redis data loss here
    file_all(t, redis_client, answers[:cut], quiet)
    redis_client.hset(t.keys.moved, mapping={sid: str(att) for sid, att in fences.items()})
    file_all(t, redis_client, answers[cut:], quiet)
    before = {(a.job.session_id, a.job.attempt, a.result.position) for a in answers[:cut] if a.job is not None}
    for sid, rows in published(redis_client, t, list(sessions)).items():
        for r in rows:
            if r["att"] <= fences[sid]:
                assert (sid, r["att"], r["pos"]) in before, (sid, r, fences[sid])
    # An attempt's fenced tokens never reach the Tracker in life; here the next attempt re-feeds them as the
    # plans say, so the prompt / generated split may move, never their sum (check's `lost` rule).
    check(redis_client, t, sessions, True)
    closed_after = {a.job.session_id for a in answers[cut:] if a.job is not None and a.close is not None}
    left = {k.decode() for k in redis_client.hkeys(t.keys.moved)}
    assert not left & closed_after, (left, closed_after)  # a field goes with its session's closure


# ------------------------------------------------------------------------------- hostile openings (issue 29)
# A live worker serving honest sessions while a writer without the key XADDs openings that name them: an
# honest session's id under another job id (a re-opening: `already_open`), its opening's own job id with
# other content (`job_id_conflict`), another account or the same one. Every honest counter stays exact:
# prompt L, generated M, steps M per session (its opening's answer and M - 1 decode answers), and each
# account's hash the sum of its honest sessions'.

HONEST_PROMPTS = ([5, 6, 7, 8], [9, 10, 11])
HONEST_M = 3


@st.composite
def hostile_openings(draw: st.DrawFn) -> list[tuple[int, str, str, int, bool]]:
    """(honest session index, account, job id kind, prompt length, before the first decode)."""
    return draw(st.lists(st.tuples(st.integers(0, len(HONEST_PROMPTS) - 1),
                                   st.sampled_from(["acct-a", "acct-b", "mallory"]),
                                   st.sampled_from(["copied", "fresh"]), st.integers(1, 6), st.booleans()),
                         min_size=1, max_size=4))


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[NumpyReferenceEngine]:
    eng = NumpyReferenceEngine(tiny_model_path, n_slots=8, ctx_per_session=128)
    yield eng
    eng.close()


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(hostile=hostile_openings())
def test_hostile_openings_land_on_no_honest_counter(redis_client: redis.Redis, engine: NumpyReferenceEngine,
                                                    hostile: list[tuple[int, str, str, int, bool]]) -> None:
    client = redis_client
    client.flushall()
    worker = make_worker(client, engine)
    h = Honest(client, worker, reply="honest-tracker")
    opened = {f"honest-{i}": h.open(f"honest-{i}", p, HONEST_M, account=ACCOUNTS[i % 2])
              for i, p in enumerate(HONEST_PROMPTS)}
    worker.run_once()  # the honest openings are admitted first

    def push(later: bool) -> None:
        for k, (i, account, kind, n, early) in enumerate(hostile):
            if early == later:
                continue
            sid = f"honest-{i}"
            jid = opened[sid] if kind == "copied" else f"forged-{k}"
            job = StepJob(job_id=jid, session_id=sid, phase="prefill", compat=h.key.digest, start_position=0,
                          tokens=tuple(range(1, n + 1)), created_at=time.time(), session=h.spec(sid, HONEST_M, account))
            client.xadd(h.keys.input_stream(h.key.digest, "prefill"), job_to_fields(job))  # type: ignore[arg-type]

    push(later=False)
    h.poll()
    push(later=True)
    h.run(list(opened))
    for _ in range(3):
        worker.run_once()
    sums: dict[str, Counter[str]] = defaultdict(Counter)
    for i, p in enumerate(HONEST_PROMPTS):
        sid = f"honest-{i}"
        assert h.results[sid][-1].finished, h.results[sid]
        acct = session_accounting(client, WID, sid)
        got = {c: int(acct.get(c, 0)) for c in COUNTERS}
        assert got == {"prompt_tokens": len(p), "generated_tokens": HONEST_M, "recomputed_tokens": 0,
                       "cached_tokens": 0, "steps": HONEST_M}, (sid, got, hostile)
        sums[ACCOUNTS[i % 2]].update(got)
    for account, want in sums.items():
        have = {k.decode(): int(float(v)) for k, v in client.hgetall(WorkerKeys(WID).billing_account(account)).items()}
        assert {c: have.get(c, 0) for c in COUNTERS} == {c: want[c] for c in COUNTERS}, (account, have)
    assert not client.exists(WorkerKeys(WID).billing_account("mallory"))
    assert worker.scheduler.table.busy_slots == 0
