"""`dgr inspect` reads in an 80-column terminal (no header cut or wrapped, no line past 80), keeps the
one wide table where the terminal holds it, and `--json` is the same at any width."""

from __future__ import annotations

import io
import json

import redis
from rich.console import Console
from typer.testing import CliRunner

from consumer.ops.inspect import NARROW, NARROW_STREAMS, WIDE_STREAMS, WIDE_WORKERS, StreamReport, WorkerReport, render
from dgrtools.localredis import LocalRedis
from tests.test_inspect import make_app
from tests.test_ops_support import dead_letter, register, serve


def _reports(worker_ids: tuple[str, ...] = ("gpu-0", "gpu-1")) -> list[WorkerReport]:
    out = []
    for i, w in enumerate(worker_ids):
        rep = WorkerReport(worker_id=w, advertised=True, alive=i == 0, heartbeat_age_s=0.4 if i == 0 else 12.5,
                           keys=[{"phase": "prefill", "digest": "fcf8c26af0af4f92"},
                                 {"phase": "decode", "digest": "f17ddcfe9ad07252"}],
                           info={"slots": 16}, dead_letters=3 * i, active_sessions=12, active_source="busy_slots",
                           accounting={"steps": 123456, "prompt_tokens": 9876543, "generated_tokens": 1234567,
                                       "fused_calls": 45678, "engine_seconds": 12345.678})
        rep.streams = [StreamReport(f"dgr:{{{w}}}:in:fcf8c26af0af4f92:prefill", "prefill", "fcf8c26af0af4f92",
                                    10_000, 1234, 12, 1, "1796008631956-3"),
                       StreamReport(f"dgr:{{{w}}}:in:f17ddcfe9ad07252:decode", "decode", "f17ddcfe9ad07252",
                                    10_000, 0, 16, 1, "1796008632101-0")]
        out.append(rep)
    return out


def _render(reports: list[WorkerReport], width: int) -> str:
    buf = io.StringIO()
    render(reports, Console(file=buf, width=width, color_system=None, force_terminal=False))
    return buf.getvalue()


def test_80_columns_cut_no_header_and_no_line() -> None:
    for ids in (("gpu-0", "gpu-1"), ("gpu-node-17-worker-3", "w")):
        text = _render(_reports(ids), 80)
        assert max(len(line) for line in text.splitlines()) <= 80, text
        for _title, columns in NARROW:
            for header in columns:
                assert f" {header} " in text, f"header {header!r} cut or wrapped:\n{text}"
        for header in NARROW_STREAMS:
            assert f" {header} " in text, f"header {header!r} cut or wrapped:\n{text}"
        assert "…" not in text, text
        assert "fcf8c26af0af4f92" in text and "9876543" in text and "12345.678" in text


def test_a_wide_terminal_keeps_the_one_table() -> None:
    text = _render(_reports(), 220)
    for header in (*WIDE_WORKERS, *WIDE_STREAMS):
        assert f" {header} " in text, header
    assert "prefill:fcf8c26af0af4f92" in text and "1796008632101-0" in text
    assert "accounting" not in text  # the narrow layout's second table


def test_inspect_json_is_the_same_at_80_columns(redis_server: LocalRedis, real_redis: redis.Redis) -> None:
    t = register(real_redis, "w1", busy_slots=1)
    serve(t, {"s1": ("acct-a", 0)})
    dead_letter(t, {"junk": "1"})
    runner = CliRunner()
    outs = []
    for cols in ("80", "250"):
        res = runner.invoke(make_app(), ["inspect", "--json"], env={"DGR_REDIS_URL": redis_server.url, "COLUMNS": cols})
        assert res.exit_code == 0, res.output
        data = json.loads(res.output)
        data.pop("at")
        for w in data["workers"]:
            w.pop("heartbeat_age_s")  # both read by the clocks at the time: not a layout's
            w.pop("clock_skew_s")
        outs.append(data)
    assert outs[0] == outs[1]
    (w,) = outs[0]["workers"]
    assert w["worker_id"] == "w1" and w["dead_letters"] == 1 and w["accounting"]["steps"] == 1
    assert {s["phase"] for s in w["streams"]} == {"prefill", "decode"} and w["keys"][0]["digest"]
    res = runner.invoke(make_app(), ["inspect"], env={"DGR_REDIS_URL": redis_server.url, "COLUMNS": "80"})
    assert res.exit_code == 0 and " dead letters " in res.output and " generated tok " in res.output, res.output


def test_a_worker_of_several_engines_shows_one_row_per_engine(real_redis: redis.Redis) -> None:
    """A real worker's heartbeat (three engines, sessions on one): `dgr inspect` reads one row per engine
    (name, layout, slots busy/total, state bytes per session) in 80 columns; a worker of one engine shows
    none, as before."""
    from consumer.engines.engine_set import EngineSet
    from consumer.ops.inspect import ENGINE_COLUMNS, inspect_fleet
    from consumer.transport import RedisTransport
    from consumer.worker import Worker, WorkerSettings
    from schemas import RouteHop, SessionSpec, StepJob, WorkerKeys, job_to_fields
    from tests.doubles.null import NullEngine

    engines = {f"e{i}": NullEngine(n_slots=2 + i, vocab_size=32, model=i) for i in range(3)}
    multi = Worker(EngineSet(engines), RedisTransport(real_redis, "multi", consumer_name="multi"),
                   WorkerSettings(worker_id="multi", block_ms=0, gather_ms=0.0, await_ms=0, heartbeat_s=0.0))
    single = Worker(NullEngine(n_slots=4, vocab_size=32), RedisTransport(real_redis, "single", consumer_name="single"),
                    WorkerSettings(worker_id="single", block_ms=0, gather_ms=0.0, await_ms=0))
    for w in (multi, single):
        w.start()
    key = multi.engines.keys_of("e1")["prefill"]
    spec = SessionSpec(session_id="s1", account_id="a", route=(RouteHop(worker_id="multi", key=key),), max_tokens=9)
    job = StepJob(job_id="s1.0", session_id="s1", phase="prefill", compat=key.digest, start_position=0,
                  tokens=(1, 2, 3), created_at=1.0, session=spec)
    real_redis.xadd(WorkerKeys("multi").input_stream(key.digest, "prefill"), job_to_fields(job))  # type: ignore[arg-type]
    multi.run_once()
    multi.run_once()  # its heartbeat (every iteration here) says the session it holds
    single.run_once()
    reports = {r.worker_id: r for r in inspect_fleet(real_redis)}
    assert [(e["engine"], e["busy_slots"], e["slots"]) for e in reports["multi"].engines] == [
        ("e0", 0, 2), ("e1", 1, 3), ("e2", 0, 4)]
    assert reports["multi"].active_sessions == 1 and reports["multi"].info["slots"] == 9
    assert [e["engine"] for e in reports["single"].engines] == ["main"]
    text = _render(list(reports.values()), 80)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for header in ENGINE_COLUMNS:
        assert f" {header} " in text, f"header {header!r} cut or wrapped:\n{text}"
    rows = [line for line in text.splitlines() if " e1 " in line or " main " in line]
    assert len(rows) == 1 and "1/3" in rows[0] and " kv " in rows[0], text  # the single worker has no row
    assert "engines" not in _render([reports["single"]], 80)
