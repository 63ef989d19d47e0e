"""Drain (consumer/ops/drain.py): `dgr ops drain` takes a worker out of placement at once, the worker
advertises it in its heartbeat, finishes what it holds, and with --exit-when-drained exits 0 once empty; a
drain during load loses nothing (real consumers, the tiny model, a real redis-server)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import redis
from typer.testing import CliRunner

from consumer.ops.drain import drain, drain_state, undrain
from consumer.transport import RedisTransport
from dgrtools.localredis import LocalRedis
from producer import Producer, SessionHandle, SessionTemplate
from schemas import StepResult, WorkerKeys
from tests.chaos_support import FAST, check_exact, consumer
from tests.support import prompts
from tests.test_inspect import make_app
from tests.test_producer import FakeWorker
from tests.test_transport import make_key


def test_drain_takes_a_worker_out_of_placement_and_undrain_brings_it_back(redis_client: redis.Redis) -> None:
    a, b = FakeWorker(redis_client, worker_id="da"), FakeWorker(redis_client, worker_id="db")
    for w in (a, b):
        w.t.heartbeat({"slots": 8, "busy_slots": 0})
    st = drain(redis_client, "da", "ops@test")
    assert st.draining and st.by == "ops@test" and st.advertised is False  # its next heartbeat says so
    p = Producer(redis_client, discover_cache_s=0.0)
    assert {w.worker_id: w.draining for w in p.workers()} == {"da": True, "db": False}
    tmpl = [(SessionTemplate(session_id=f"q{i}", account_id="acct", keys=(make_key("prefill"),),
                             options={"max_tokens": 2}), [1, 2]) for i in range(4)]
    with a, b:
        out = p.run_many(tmpl)
        assert {h.worker_id for h in out.values()} == {"db"}
        assert not undrain(redis_client, "da").draining
        back = p.run_many([(SessionTemplate(session_id=f"r{i}", account_id="acct", keys=(make_key("prefill"),),
                                            options={"max_tokens": 2}), [1, 2]) for i in range(4)])
    # db still counts the 4 it took (no beat since): the 4 new ones balance onto da
    assert {h.worker_id for h in back.values()} == {"da"}


def test_the_worker_reads_its_drain_key_and_advertises_it(redis_client: redis.Redis) -> None:
    t = RedisTransport(redis_client, "dw", "c0")
    t.register([make_key("prefill"), make_key("decode")], {"slots": 4})
    t.input_lag()
    t.heartbeat()
    assert json.loads(redis_client.get(WorkerKeys("dw").heartbeat))["draining"] is False
    drain(redis_client, "dw", "me")
    t.input_lag()
    t.heartbeat()
    hb = json.loads(redis_client.get(WorkerKeys("dw").heartbeat))
    assert hb["draining"] is True and hb["queued"] == 0 and t.draining
    assert drain_state(redis_client, "dw").advertised is True


def test_ops_drain_and_undrain_on_the_command_line(redis_server: LocalRedis) -> None:
    wid = f"cli-{uuid.uuid4().hex[:6]}"
    env = {"DGR_REDIS_URL": redis_server.url}
    runner = CliRunner()
    res = runner.invoke(make_app(), ["ops", "drain", wid, "--who", "alice", "--json"], env=env)
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["draining"] is True and json.loads(res.output)["by"] == "alice"
    res = runner.invoke(make_app(), ["ops", "undrain", wid], env=env)
    assert res.exit_code == 0 and "not draining" in res.output, res.output
    assert runner.invoke(make_app(), ["ops", "drain", "not an id"], env=env).exit_code != 0


def test_a_drain_during_load_loses_nothing_and_the_drained_worker_exits_0(redis_server: LocalRedis,
                                                                         tiny_model_path: Path,
                                                                         tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    wa, wb = f"dra-{tag}", f"drb-{tag}"
    ca = consumer(redis_server.url, wa, tiny_model_path, tmp_path, slots=4, extra=["--exit-when-drained"])
    cb = consumer(redis_server.url, wb, tiny_model_path, tmp_path, slots=4)
    client = redis.Redis.from_url(redis_server.url)
    try:
        key = Producer(client).discover(wa).keys[0]
        ps = prompts(10, 300, seed=7, lo=3, hi=30)
        sessions = [(SessionTemplate(session_id=f"dl-{tag}-{i}", account_id=f"acct-{i % 2}", keys=(key,),
                                     options={"max_tokens": 24}), list(p)) for i, p in enumerate(ps)]
        drained_at: list[float] = []

        def on_result(h: SessionHandle, r: StepResult) -> None:
            if h.worker_id == wa and not drained_at:  # wa holds sessions mid-decode: drain it now
                drain(client, wa, "test")
                drained_at.append(time.monotonic())

        p = Producer(client, discover_cache_s=0.05, prefill_chunk=8, timeout_s=45)
        # 6 at once (3 on each), 4 more a second later: those must all go to wb
        out = p.run_many(sessions, on_result=on_result, start_times=[0.0] * 6 + [1.0] * 4)
        assert drained_at
        late = {out[s.session_id].worker_id for s, _ in sessions[6:]}
        assert late == {wb}, late
        assert {out[s.session_id].worker_id for s, _ in sessions[:6]} == {wa, wb}
        for w in (wa, wb):
            mine = [(out[t.session_id].spec, pr) for t, pr in sessions if out[t.session_id].worker_id == w]
            summary = check_exact(client, w, mine, {s.session_id: out[s.session_id] for s, _ in mine},
                                  tiny_model_path)
            assert summary["finished"] == len(mine), summary
        assert ca.proc.wait(30) == 0, ca.log()  # drained and empty: it exits on its own
        assert cb.proc.poll() is None  # the other goes on
    finally:
        ca.kill()
        assert cb.stop() == 0


__all__ = ["FAST"]
