"""Workers on hosts whose clocks disagree with the Tracker's (schemas/heartbeat.py): a heartbeat's age is read on
Redis' clock (the key's PTTL against the TTL the worker set), so a worker whose clock is behind is placed on like
any other, and one whose clock is ahead is found lost within the bound after it dies, not when its key expires."""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from pathlib import Path

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from dgrtools.localredis import LocalRedis
from producer import PlacementPolicy, Producer, SessionHandle, SessionTemplate
from producer.moves import worker_out
from schemas import Status, StepResult, WorkerKeys
from schemas.heartbeat import TTL_MAX_S, heartbeat_age
from schemas.keys import WORKERS_INDEX
from schemas.limits import WIRE_VERSION
from tests.chaos_support import FAST, solo
from tests.support import ConsumerProcess, prompts
from tests.test_fleet_chaos import fleet_charges
from tests.test_transport import make_key

JSONISH = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=3))


@given(ttl=JSONISH, pttl=st.one_of(st.none(), st.booleans(), st.integers(-3, 10**7), st.floats()), ts=JSONISH,
       now=st.floats(0, 2e9))
def test_an_age_is_finite_and_never_negative_whatever_a_heartbeat_says(ttl: object, pttl: object, ts: object,
                                                                        now: float) -> None:
    age = heartbeat_age({"ttl_s": ttl, "ts": ts}, pttl, now)
    assert age is None or (math.isfinite(age) and age >= 0)
    by_ttl = isinstance(ttl, int | float) and not isinstance(ttl, bool) and 0 < ttl <= TTL_MAX_S \
        and isinstance(pttl, int) and not isinstance(pttl, bool) and pttl >= 0
    if by_ttl:  # Redis' clock: the worker's `ts` does not count
        assert age == max(0.0, float(ttl) - pttl / 1000)  # type: ignore[arg-type, operator]
    elif isinstance(ts, int | float) and not isinstance(ts, bool) and math.isfinite(ts):
        assert age == max(0.0, now - ts)
    else:
        assert age is None


def _beat(client: redis.Redis, worker: str, ctx: int, *, skew_s: float, written_s_ago: float, ttl_s: int = 10
          ) -> None:
    """Advertise `worker` (make_key's keys for `ctx`) and write its heartbeat as a worker whose clock is `skew_s`
    off would have `written_s_ago` seconds ago (the key's TTL is what is left of ttl_s)."""
    k = WorkerKeys(worker)
    spec = {"worker_id": worker, "keys": [make_key(p, ctx).model_dump(mode="json") for p in ("prefill", "decode")],
            "info": {"wire_version": WIRE_VERSION, "slots": 4}}
    client.set(k.spec, json.dumps(spec))
    client.sadd(WORKERS_INDEX, worker)
    hb = {"ts": time.time() + skew_s - written_s_ago, "ttl_s": ttl_s, "slots": 4, "busy_slots": 0}
    client.set(k.heartbeat, json.dumps(hb), px=int((ttl_s - written_s_ago) * 1000))


def test_the_tracker_reads_a_beats_age_on_redis_clock(redis_client: redis.Redis) -> None:
    tag = uuid.uuid4().hex[:6]
    ctx = 1000 + int(tag, 16) % 1000  # keys no other test's worker advertises
    behind, ahead, old = f"behind-{tag}", f"ahead-{tag}", f"old-{tag}"
    _beat(redis_client, behind, ctx, skew_s=-30, written_s_ago=0)  # fresh, its clock 30 s behind
    _beat(redis_client, ahead, ctx, skew_s=3600, written_s_ago=7)  # beat 7 s ago, its clock an hour ahead
    _beat(redis_client, old, ctx, skew_s=0, written_s_ago=0)
    redis_client.set(WorkerKeys(old).heartbeat, json.dumps({"ts": time.time() - 8, "slots": 4}), ex=10)  # no ttl_s
    p = Producer(redis_client)
    infos = {w.worker_id: w for w in p.workers() if w.worker_id in (behind, ahead, old)}
    assert infos[behind].heartbeat_age_s is not None and infos[behind].heartbeat_age_s < 1.0
    assert infos[ahead].heartbeat_age_s is not None and 6.5 < infos[ahead].heartbeat_age_s < 8.0
    assert infos[old].heartbeat_age_s is not None and 7.5 < infos[old].heartbeat_age_s < 9.0  # a worker from before
    # placement: the worker behind is fresh (stale_s 6), the one ahead is not
    t = SessionTemplate(session_id=f"s-{tag}", account_id="a", keys=(make_key("prefill", ctx),))
    spec = p.place(t, [1, 2, 3])
    assert spec.route[0].worker_id == behind
    # worker loss: the one ahead is out at lost_s 6 (its `ts` says it beat in the future)
    k = WorkerKeys(ahead)
    assert worker_out(redis_client.get(k.heartbeat), redis_client.pttl(k.heartbeat), time.time(), 6.0)
    kb = WorkerKeys(behind)
    assert not worker_out(redis_client.get(kb.heartbeat), redis_client.pttl(kb.heartbeat), time.time(), 6.0)


def test_workers_with_skewed_clocks_are_placed_on_and_found_lost_in_time(redis_server: LocalRedis,
                                                                         tiny_model_path: Path,
                                                                         tmp_path: Path) -> None:
    """Opt-in (DGR_SLOW=1, ~10 s). Two consumers, one 30 s behind the Tracker's clock and one an hour ahead;
    sessions placed from templates go to both, then the one ahead is killed -9 mid-decode: its sessions decode
    again on the other well before its heartbeat key would have expired (10 s), all with their solo tokens,
    charged once."""
    if os.environ.get("DGR_SLOW") != "1":
        pytest.skip("opt-in: DGR_SLOW=1")
    tag = uuid.uuid4().hex[:6]
    behind, ahead = f"cb-{tag}", f"ca-{tag}"
    procs = {w: ConsumerProcess(redis_server.url, w, tiny_model_path, tmp_path, slots=4, extra=list(FAST),
                                clock_skew_s=skew) for w, skew in ((behind, -30.0), (ahead, 3600.0))}
    client = redis.Redis.from_url(redis_server.url)
    n, tokens = 6, 24
    killed: list[float] = []
    back: list[float] = []
    try:
        key = Producer(client).discover(behind).keys[0]
        sessions = [(SessionTemplate(session_id=f"ck-{tag}-{i}", account_id="acct-ck", keys=(key,),
                                     options={"max_tokens": tokens}), list(pr))
                    for i, pr in enumerate(prompts(n, 300, seed=17, lo=3, hi=30))]
        told: dict[str, list[int]] = {}

        def on_result(h: SessionHandle, r: StepResult) -> None:
            if r.status == Status.OK and r.token is not None:
                told.setdefault(h.session_id, []).append(r.token)
            if not killed and h.worker_id == ahead and 3 <= len(h.generated) < tokens - 4:
                procs[ahead].kill()  # never restarted
                killed.append(time.monotonic())
            elif killed and not back and h.attempt > h.room_waits and r.token is not None:
                back.append(time.monotonic())

        p = Producer(client, prefill_chunk=8, timeout_s=60, placement=PlacementPolicy(lost_s=1.5, lost_check_s=0.1))
        out = p.run_many(sessions, on_result=on_result)
        stats = p.fleet()
        assert stats[behind]["placed"] > 0 and stats[ahead]["placed"] > 0, stats  # both placed on
        assert killed and back, "the kill landed after every session of the worker ahead ended"
        assert back[0] - killed[0] < 6.0, f"decoding again {back[0] - killed[0]:.2f} s after the kill"
        for t, prompt in sessions:
            h = out[t.session_id]
            assert h.status == "finished", (t.session_id, h.status, h.reason, h.detail)
            assert h.generated == solo(tiny_model_path, prompt, tokens), t.session_id
            assert told[t.session_id] == h.generated, t.session_id
        got = fleet_charges(client, [behind, ahead], "acct-ck")
        assert got["prompt_tokens"] == sum(len(pr) for _, pr in sessions), got
        assert got["generated_tokens"] == tokens * n, got
        print(f"moved sessions decoding again {back[0] - killed[0]:.2f} s after the kill (lost_s 1.5)")
    finally:
        for c in procs.values():
            c.kill()
