"""`dgr inspect` and the `dgr ops` commands, through the Typer app (CliRunner) and directly."""

from __future__ import annotations

import json

import redis
import typer
from typer.testing import CliRunner

from consumer.ops.cli import register as register_cli
from consumer.ops.inspect import inspect_fleet, inspect_worker
from dgrtools.localredis import LocalRedis
from schemas import job_to_fields
from tests.test_ops_support import close, dead_letter, make_key, push, register, serve, step_job


def make_app() -> typer.Typer:
    app = typer.Typer()

    @app.command()
    def consumer() -> None:  # a second command, so Typer keeps subcommand names (as in consumer/cli.py)
        pass

    register_cli(app)
    return app


def test_inspect_worker_reports_everything(redis_client: redis.Redis) -> None:
    t = register(redis_client, "w1", busy_slots=2)
    serve(t, {"s1": ("a", 0), "s2": ("b", 0)})
    dead_letter(t, {"junk": "1"})
    push(redis_client, "w1", [step_job("s1", 1), step_job("s2", 1), step_job("s3", 0)])
    t.read_streams({t.streams[1]: 1}, block_ms=0, gather_ms=0)  # one decode step delivered, not acked
    rep = inspect_worker(redis_client, "w1")
    assert rep.advertised and rep.alive and rep.heartbeat_age_s is not None and rep.heartbeat_age_s < 5
    assert {(k["phase"], k["digest"]) for k in rep.keys} == {(p, make_key(p).digest) for p in ("prefill", "decode")}
    by_phase = {x.phase: x for x in rep.streams}
    assert by_phase["prefill"].length == 3 and by_phase["prefill"].lag == 1 and by_phase["prefill"].pending == 0
    assert by_phase["decode"].length == 3 and by_phase["decode"].lag == 1 and by_phase["decode"].pending == 1
    assert rep.dead_letters == 1
    assert rep.active_sessions == 2 and rep.active_source == "busy_slots"
    assert rep.accounting["steps"] == 2 and rep.accounting["prompt_tokens"] == 6
    assert rep.accounting["dead_letters"] == 1


def test_a_workers_clock_off_is_shown_by_how_much(redis_client: redis.Redis) -> None:
    """Its heartbeat's age is read on Redis' clock (schemas/heartbeat.py), so its `ts` against that says how far
    its host's clock is from this one's."""
    import time

    t = register(redis_client, "w1")
    for skew, ttl in ((30.0, 10), (-3600.0, 10), (0.0, None)):
        hb = {"ts": time.time() + skew, "slots": 2, **({"ttl_s": ttl} if ttl else {})}
        redis_client.set(t.keys.heartbeat, json.dumps(hb), ex=10)
        rep = inspect_worker(redis_client, "w1")
        if ttl is None:  # a worker from before: nothing to tell it by
            assert rep.clock_skew_s is None and rep.heartbeat_age_s is not None and rep.heartbeat_age_s < 5
        else:
            assert rep.clock_skew_s is not None and abs(rep.clock_skew_s - skew) < 1.5, rep.clock_skew_s
            assert rep.heartbeat_age_s is not None and rep.heartbeat_age_s < 1.5


def test_without_heartbeat_sessions_are_counted_from_accounting(redis_client: redis.Redis) -> None:
    t = register(redis_client, "w1")
    serve(t, {"s1": ("a", 0), "s2": ("a", 0)})
    close(t, "s2", "finished", "a")
    redis_client.delete(t.keys.heartbeat)
    (rep,) = inspect_fleet(redis_client)
    assert not rep.alive and rep.heartbeat_age_s is None
    assert rep.active_sessions == 1 and rep.active_source == "open_sessions"


def test_cli_inspect_and_ops(redis_server: LocalRedis, real_redis: redis.Redis) -> None:
    t = register(real_redis, "w1", busy_slots=1)
    serve(t, {"s1": ("acct-a", 0)})
    dlq_id = dead_letter(t, dict(job_to_fields(step_job("s9", 1))))
    app = make_app()
    runner = CliRunner()
    env = {"DGR_REDIS_URL": redis_server.url, "COLUMNS": "200"}

    out = runner.invoke(app, ["inspect", "--json"], env=env)
    assert out.exit_code == 0, out.output
    (w,) = json.loads(out.output)["workers"]
    assert w["worker_id"] == "w1" and w["dead_letters"] == 1 and w["accounting"]["steps"] == 1

    out = runner.invoke(app, ["inspect"], env=env)
    assert out.exit_code == 0 and "w1" in out.output and "input streams" in out.output

    out = runner.invoke(app, ["ops", "rollup", "--json"], env=env)
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["ledger"][0]["totals"]["steps"] == 1
    out = runner.invoke(app, ["ops", "rollup"], env=env)
    assert "folded 0, unchanged 1" in out.output
    out = runner.invoke(app, ["ops", "ledger", "--json"], env=env)
    assert json.loads(out.output)[0]["account_id"] == "acct-a"

    out = runner.invoke(app, ["ops", "dlq", "list", "--json"], env=env)
    assert json.loads(out.output)[0]["ref"] == f"w1/{dlq_id}"
    out = runner.invoke(app, ["ops", "dlq", "replay", f"w1/{dlq_id}"], env={**env, "DGR_OPS_WHO": "carol"})
    assert out.exit_code == 0 and "replayed as" in out.output, out.output
    out = runner.invoke(app, ["ops", "dlq", "replay", dlq_id, "--worker", "w1"], env=env)
    assert out.exit_code == 0 and ": already" in out.output
    out = runner.invoke(app, ["ops", "dlq", "replay", "1-1", "-w", "w1"], env=env)
    assert out.exit_code == 1 and "missing" in out.output
    out = runner.invoke(app, ["ops", "dlq", "audit", "--json"], env=env)
    assert json.loads(out.output)[0]["who"] == "carol"

    out = runner.invoke(app, ["ops", "reap", "--dry-run"], env={**env, "DGR_REAP_TTL_S": "3600"})
    assert out.exit_code == 0 and "1 open sessions looked at, 0 idle" in out.output, out.output

    out = runner.invoke(app, ["ops", "enqueue-rollup", "--sync"], env=env)
    assert out.exit_code == 0 and "finished" in out.output, out.output
    out = runner.invoke(app, ["ops", "enqueue-rollup"], env=env)
    assert out.exit_code == 0 and "on dgr-ops" in out.output
    assert real_redis.llen("rq:queue:dgr-ops") == 1  # waits for `rq worker dgr-ops`
    # ... which never comes here: left queued on the shared server, the next test's burst worker would run it
    # against this test's address (a 60 s outage retry in tests/test_ops_jobs.py)
    from consumer.ops.jobs import queue

    queue(env["DGR_REDIS_URL"]).empty()
