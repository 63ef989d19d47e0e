"""The completion script's block for the steady decode token (consumer/lua/complete_publish.lua, STEADY) against
the general path it short-cuts: the same answers filed through the script as it is and through the script with
STEADY false leave every key the same (records, charges, tally entries, session hashes, accounts, the worker's
counters); so do the script's columns of one value (publish.py `one_value`) against the columns sent whole; for
histories drawn as test_charges.py draws them (lost attempts, replays, twins, re-sent calls, Redis
losing its tail, prefix cache hits), with longer decodes, attempts fenced after any answer and answers bent off the
honest history (`_bent`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.lua import script_source
from consumer.sched import Answer
from consumer.transport import RedisTransport, publish
from schemas import Reason, Status, WorkerKeys
from schemas.accounting import parse_tally
from schemas.activations import encode
from tests.support import compat_key
from tests.test_charges import ACCOUNTS, WORKER, FilingPlan, Plan, file_all, filings, interleave, session_filings

STEADY_ON = "local STEADY = true"


def test_the_switch_is_in_the_script() -> None:
    assert script_source("complete").count(STEADY_ON) == 1


def _transport(client: redis.Redis, steady: bool) -> RedisTransport:
    t = RedisTransport(client, WORKER, "c1")
    if not steady:
        t.io.scripts["complete"] = client.register_script(
            script_source("complete").replace(STEADY_ON, "local STEADY = false"))
    t.register([compat_key("prefill"), compat_key("decode")], {"slots": 8})
    t.acquire_lease()
    return t


def _state(client: redis.Redis, t: RedisTransport) -> dict[bytes, Any]:
    """Every key's content but the process's own (its lease's token, its registration's time); stream entries
    without their ids and tally entries without their time stamp `t` (the server's clock)."""
    out: dict[bytes, Any] = {}
    own = {t.keys.lease.encode(), t.keys.spec.encode()}
    for key in sorted(set(client.keys("*")) - own):
        kind = client.type(key)
        if kind == b"stream":
            out[key] = [fields for _id, fields in client.xrange(key)]
        elif kind == b"hash":
            h = client.hgetall(key)
            if key.endswith(b":tally"):
                h = {f: {k: v for k, v in (parse_tally(v) or {}).items() if k != "t"} for f, v in h.items()}
            out[key] = h
        elif kind == b"string":
            out[key] = client.get(key)
        elif kind == b"set":
            out[key] = client.smembers(key)
        else:
            out[key] = kind
    return out


def _filed_both_ways(real_redis: redis.Redis, file: Callable[[RedisTransport, redis.Redis], None],
                     other: str = "general") -> list[Any]:
    """The state `file` leaves, filed as it is (db 1) and the other way (db 2): `general`, through the script with
    STEADY false; `columns`, every script column sent whole (publish.py `one_value` never taking one value)."""
    states = []
    for db in (1, 2):
        client = redis.Redis(connection_pool=redis.ConnectionPool(**{**real_redis.connection_pool.connection_kwargs,
                                                                      "db": db}))
        client.flushdb()
        with pytest.MonkeyPatch.context() as mp:
            if db == 2 and other == "columns":
                mp.setattr(publish, "one_value", lambda column: column)
            t = _transport(client, steady=db == 1 or other != "general")
            file(t, client)
        states.append(_state(client, t))
        client.flushdb()
        client.close()
    return states


# test_charges.py's plans with longer decodes: more steady rows, each a chance for the block to differ
long_plans = st.builds(Plan, prompt=st.integers(1, 9), max_tokens=st.integers(1, 14),
                       cuts=st.lists(st.integers(0, 12), max_size=3).map(tuple), chunk=st.integers(1, 6),
                       cont=st.integers(1, 4), cached=st.sampled_from([0, 0, 1, 3, 9]))


def _bent(answers: list[Answer], draw: Any) -> list[Answer]:
    """Some answers bent off the honest history: not ok (failed, rejected, cancelled; with or without their token:
    such a row charges what it fed and sampled without being published as ok, so the high-water mark runs ahead of
    the last ok answer), or with their position or attempt moved by one or two (a position the session's entry does
    not expect), or without their token, or with output rows to write beside them. The block must file every one of
    them as the general path does."""
    out = []
    for a in answers:
        how = draw(st.sampled_from(["as is"] * 12 + ["not ok", "no token", "position", "attempt", "blob"]))
        o, job, blob = a.result, a.job, a.blob
        if how == "no token":  # an ok row without a token (a grammar that ended the session, a hop's rows)
            o = msgspec.structs.replace(o, token=None)
        elif how == "blob":  # output rows written beside it (a hop's), its token kept
            hidden, blob = encode(np.zeros((1, 8), np.float32), blob=WorkerKeys(WORKER).activations_out(o.job_id),
                                  inline_max=0)
            o = msgspec.structs.replace(o, hidden=hidden)
        elif how == "not ok":
            o = msgspec.structs.replace(o, status=draw(st.sampled_from([Status.FAILED, Status.REJECTED,
                                                                        Status.CANCELLED])),
                                        reason=Reason.ENGINE_ERROR, detail="x", token=draw(st.sampled_from([None,
                                                                                                           o.token])))
        elif how == "position":
            o = msgspec.structs.replace(o, position=max(1, o.position + draw(st.sampled_from([-2, -1, 1, 2]))))
        elif how == "attempt" and job is not None:
            job = job.replace(attempt=max(0, job.attempt + draw(st.sampled_from([-1, 1]))))
        out.append(msgspec.structs.replace(a, result=o, job=job, blob=blob))
    return out


@pytest.mark.parametrize("other", ["general", "columns"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan_list=st.lists(long_plans, min_size=1, max_size=4), f=filings, fenced=st.booleans(), data=st.data())
def test_the_steady_block_files_as_the_general_path(real_redis: redis.Redis, other: str, plan_list: list[Plan],
                                                   f: FilingPlan, fenced: bool, data: st.DataObject) -> None:
    """`general`: the block against the rows' general path; `columns`: the script's columns of one value against
    the same columns sent whole."""
    per_session = [session_filings(f"s{i}", ACCOUNTS[i % 2], plan)[0] for i, plan in enumerate(plan_list)]
    answers = _bent(interleave(per_session, data.draw), data.draw)
    # the Tracker moving sessions off this worker after `cut` answers: an attempt of each, fenced (test_charges.py)
    fences = {f"s{i}": data.draw(st.integers(0, len(plan.cuts))) for i, plan in enumerate(plan_list)} if fenced else {}
    cut = data.draw(st.integers(0, len(answers)))

    def file(t: RedisTransport, client: redis.Redis) -> None:
        file_all(t, client, answers[:cut], f)
        if fences:
            client.hset(t.keys.moved, mapping={sid: str(att) for sid, att in fences.items()})
        file_all(t, client, answers[cut:], f)

    states = _filed_both_ways(real_redis, file, other)
    assert states[0] == states[1]


def test_a_row_at_the_last_published_position_is_not_steady(real_redis: redis.Redis) -> None:
    """A prefill piece that samples nothing leaves the high-water mark at its position, the last published one: a
    token answered there again (a stale row) is neither published nor charged, with the block as without it."""
    answers = session_filings("s0", ACCOUNTS[0], Plan(prompt=4, max_tokens=3, cuts=(), chunk=2, cont=1))[0]
    first, decode = answers[0], answers[2]
    assert first.result.position == 2 and first.result.token is None and decode.job.phase == "decode"
    # its first position at or below the last published one, as a decode token that follows it has
    stale = msgspec.structs.replace(decode, job=decode.job.replace(start_position=1),
                                    result=msgspec.structs.replace(decode.result, position=2))
    one_by_one = FilingPlan(sizes=[1], resend=[], events=[], dups=[])
    states = _filed_both_ways(real_redis, lambda t, client: file_all(t, client, [first, stale, *answers[1:]],
                                                                     one_by_one))
    assert states[0] == states[1]


def test_a_call_of_more_sessions_than_one_write_takes(real_redis: redis.Redis) -> None:
    """1,500 sessions in one call: the tally is read in parts of 1,000 and written in parts of 1,000 fields (Lua's
    unpack has a bound), every entry written, with the block as without it."""
    n = 1500
    per_session = [session_filings(f"s{i}", ACCOUNTS[i % 2], Plan(prompt=1, max_tokens=3, cuts=(), chunk=1,
                                                                  cont=1))[0] for i in range(n)]
    calls = [[a[k] for a in per_session] for k in range(3)]  # the openings, then two decode tokens each
    assert all(a.job.phase == "decode" for a in calls[2])

    def file(t: RedisTransport, client: redis.Redis) -> None:
        for answers in calls[:2]:
            file_all(t, client, answers, FilingPlan(sizes=[n], resend=[], events=[], dups=[]))
        tally = {k.decode(): parse_tally(v) for k, v in client.hgetall(t.keys.tally).items()}
        assert len(tally) == n and {e["generated_tokens"] for e in tally.values() if e} == {"2"}
        file_all(t, client, calls[2], FilingPlan(sizes=[n], resend=[], events=[], dups=[]))  # each session's last

    states = _filed_both_ways(real_redis, file)
    assert states[0] == states[1]
    worker = states[0][WorkerKeys(WORKER).worker_account.encode()]
    assert (worker[b"prompt_tokens"], worker[b"generated_tokens"]) == (b"1500", b"4500")
