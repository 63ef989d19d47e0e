"""A fleet of real consumers (the tiny model, invariant recipe) on one real redis-server, sessions placed from
templates: kill -9 one mid-decode and never restart it: every session finishes with its solo tokens, and the
fleet's counters charge each prompt position and generated token once; a SIGSTOPped worker gets no new
session while stale and keeps its own within the bound (nothing moves)."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import redis

from dgrtools.localredis import LocalRedis
from producer import PlacementPolicy, Producer, SessionHandle, SessionTemplate
from schemas import StepResult, WorkerKeys
from tests.chaos_support import consumer, solo
from tests.support import prompts

SOAK = os.environ.get("DGR_SOAK") == "1"


def fleet_charges(client: redis.Redis, workers: list[str], account: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for w in workers:
        for k, v in client.hgetall(WorkerKeys(w).billing_account(account)).items():
            out[k.decode()] = out.get(k.decode(), 0.0) + float(v)
    return out


def test_kill_9_of_one_of_three_mid_decode_loses_nothing(redis_server: LocalRedis, tiny_model_path: Path,
                                                         tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    names = [f"fk{i}-{tag}" for i in range(3)]
    procs = {w: consumer(redis_server.url, w, tiny_model_path, tmp_path, slots=4) for w in names}
    client = redis.Redis.from_url(redis_server.url)
    n, tokens = (18, 48) if SOAK else (9, 24)
    try:
        key = Producer(client).discover(names[0]).keys[0]
        ps = prompts(n, 300, seed=11, lo=3, hi=30)
        sessions = [(SessionTemplate(session_id=f"fk-{tag}-{i}", account_id="acct-fk", keys=(key,),
                                     options={"max_tokens": tokens}), list(p)) for i, p in enumerate(ps)]
        killed: list[tuple[str, float]] = []
        back: list[float] = []

        def on_result(h: SessionHandle, r: StepResult) -> None:
            if not killed and 3 <= len(h.generated) < tokens - 4:
                procs[h.worker_id].kill()  # SIGKILL, mid-decode; never restarted
                killed.append((h.worker_id, time.monotonic()))
            elif killed and h.attempt > 0 and r.token is not None and not back:
                back.append(time.monotonic())

        p = Producer(client, prefill_chunk=8, timeout_s=60,
                     placement=PlacementPolicy(lost_s=1.5, lost_check_s=0.1))
        out = p.run_many(sessions, on_result=on_result)
        assert killed
        dead = killed[0][0]
        moved = [h for h in out.values() if h.attempt > 0]
        assert moved, "the kill landed after every session of the victim ended"
        for t, prompt in sessions:
            h = out[t.session_id]
            assert h.status == "finished", (t.session_id, h.status, h.reason, h.detail)
            assert h.worker_id != dead or h.attempt == 0
            assert h.generated == solo(tiny_model_path, prompt, tokens), t.session_id
        got = fleet_charges(client, names, "acct-fk")
        assert got["prompt_tokens"] == sum(len(pr) for _, pr in sessions), got
        assert got["generated_tokens"] == tokens * n, got
        stats = p.fleet()
        assert stats[dead]["moved_out"] == len(moved), stats
        if back:  # measured, not asserted (docs/placement.md): kill -> the first token of a moved session
            print(f"moved sessions decoding again {back[0] - killed[0][1]:.2f} s after the kill (lost_s 1.5)")
    finally:
        for w, c in procs.items():
            c.kill() if w in {k for k, _ in killed} else c.stop()


def test_a_sigstopped_worker_gets_no_new_session_and_keeps_its_own(redis_server: LocalRedis,
                                                                     tiny_model_path: Path, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    names = [f"fs{i}-{tag}" for i in range(2)]
    # 8 slots each: the 2 it holds and the 4 placed on it while the other is stale fit whatever the timing
    # (with 4, a slow machine still held its first 2 when the next 4 came, and the 6th was refused for a slot)
    procs = {w: consumer(redis_server.url, w, tiny_model_path, tmp_path, slots=8) for w in names}
    client = redis.Redis.from_url(redis_server.url)
    try:
        key = Producer(client).discover(names[0]).keys[0]
        ps = prompts(8, 300, seed=12, lo=3, hi=20)
        sessions = [(SessionTemplate(session_id=f"fs-{tag}-{i}", account_id="acct-fs", keys=(key,),
                                     options={"max_tokens": 16}), list(p)) for i, p in enumerate(ps)]
        stopped: list[str] = []

        def on_result(h: SessionHandle, r: StepResult) -> None:
            if not stopped:
                stopped.append(h.worker_id)
                proc = procs[h.worker_id].proc
                proc.send_signal(signal.SIGSTOP)  # its heartbeat stalls for 2.5 s: stale (1 s), not lost (5 s)
                threading.Timer(2.5, proc.send_signal, (signal.SIGCONT,)).start()

        p = Producer(client, prefill_chunk=8, timeout_s=60, discover_cache_s=0.1,
                     placement=PlacementPolicy(stale_s=1.0, lost_s=5.0, lost_check_s=0.1))
        # 4 at once (2 each), 4 more 1.8 s later, while the paused one is stale: all to the other
        out = p.run_many(sessions, on_result=on_result, start_times=[0.0] * 4 + [1.8] * 4)
        paused = stopped[0]
        assert {out[t.session_id].worker_id for t, _ in sessions[4:]} == set(names) - {paused}
        for t, prompt in sessions:
            h = out[t.session_id]
            # nothing moved
            assert h.status == "finished" and h.attempt == 0, (t.session_id, h.status, h.reason, h.detail, h.attempt)
            assert h.generated == solo(tiny_model_path, prompt, 16), t.session_id
        assert not any(s.get("moved_out") for s in p.fleet().values())
    finally:
        for c in procs.values():
            c.proc.send_signal(signal.SIGCONT)
            c.stop()
