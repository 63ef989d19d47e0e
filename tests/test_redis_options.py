"""The Redis connection options reach every command that connects: options and DGR_* variables alike,
and a contradiction is a usage error before anything is loaded."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from consumer.cli import command_line
from consumer.connect import RedisTarget

SENT = ["--redis-sentinel", "s1:26379,s2:26380", "--sentinel-master", "dgr", "--sentinel-password", "spw"]


def _captured(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> dict[str, Any]:
    got: dict[str, Any] = {}

    def fake(**kw: Any) -> int:
        got.update(kw)
        return 0

    monkeypatch.setattr(f"{module}.{name}", fake)
    return got


def test_tracker_sim_takes_sentinel_options_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    got = _captured(monkeypatch, "dgrtools.tracker_sim", "run_tracker_sim")
    res = CliRunner().invoke(command_line(), ["tracker-sim", "--redis-url", "rediss://u:p@x:1/2", *SENT])
    assert res.exit_code == 0, res.output
    assert got["redis_target"] == RedisTarget(url="rediss://u:p@x:1/2", sentinel="s1:26379,s2:26380",
                                              sentinel_master="dgr", sentinel_password="spw")
    got.clear()
    env = {"DGR_REDIS_SENTINEL": "a:1", "DGR_SENTINEL_MASTER": "m", "DGR_REDIS_URL": "redis://h:1/0"}
    assert CliRunner().invoke(command_line(), ["tracker-sim"], env=env).exit_code == 0
    assert (got["redis_target"].sentinel, got["redis_target"].sentinel_master) == ("a:1", "m")
    got.clear()
    env = {"DGR_REDIS_URL": "redis://h:1/0"}
    assert CliRunner().invoke(command_line(), ["tracker-sim", "--cluster"], env=env).exit_code == 0
    assert got["redis_target"].cluster


def test_demo_takes_sentinel_options(monkeypatch: pytest.MonkeyPatch) -> None:
    got = _captured(monkeypatch, "dgrtools.demo", "run_demo")
    assert CliRunner().invoke(command_line(), ["demo", "--model", "tiny"]).exit_code == 0
    assert got["redis_target"] is None and got["redis_url"] is None  # a private redis-server
    res = CliRunner().invoke(command_line(), ["demo", "--model", "tiny", *SENT])
    assert res.exit_code == 0, res.output
    assert got["redis_target"].sentinel == "s1:26379,s2:26380" and got["redis_target"].sentinel_password == "spw"


@pytest.mark.parametrize("args", [["--redis-sentinel", "a:1"], ["--sentinel-master", "m"],
                                  ["--redis-sentinel", "a:1", "--sentinel-master", "m", "--cluster"],
                                  ["--redis-sentinel", "nohostport", "--sentinel-master", "m"]])
def test_contradictions_are_usage_errors(args: list[str]) -> None:
    for command in (["consumer", "--model", "/nonexistent.gguf"], ["inspect"], ["ops", "rollup"], ["tracker-sim"]):
        res = CliRunner().invoke(command_line(), [*command, *args])
        assert res.exit_code == 2, (command, args, res.output)
        assert "sentinel" in res.output.lower(), res.output  # refused for this reason, not another
