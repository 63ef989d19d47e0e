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
            w.pop("heartbeat_age_s")
        outs.append(data)
    assert outs[0] == outs[1]
    (w,) = outs[0]["workers"]
    assert w["worker_id"] == "w1" and w["dead_letters"] == 1 and w["accounting"]["steps"] == 1
    assert {s["phase"] for s in w["streams"]} == {"prefill", "decode"} and w["keys"][0]["digest"]
    res = runner.invoke(make_app(), ["inspect"], env={"DGR_REDIS_URL": redis_server.url, "COLUMNS": "80"})
    assert res.exit_code == 0 and " dead letters " in res.output and " generated tok " in res.output, res.output
