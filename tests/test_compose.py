"""No Docker engine runs here: check the compose file against the CLI it drives."""

from __future__ import annotations

from pathlib import Path

import typer.main
import yaml

from consumer.cli import command_line

ROOT = Path(__file__).resolve().parents[1]


def cli_envvars(command: object) -> set[str]:
    out: set[str] = set()
    for p in command.params:  # type: ignore[attr-defined]
        env = getattr(p, "envvar", None)
        if isinstance(env, str):
            out.add(env)
        elif env:
            out.update(env)
    return out


def test_compose_services_match_the_cli() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "consumer", "demo"} <= set(services)
    assert "--appendonly" in services["redis"]["command"] and "healthcheck" in services["redis"]
    group = typer.main.get_command(command_line())
    commands = group.commands  # type: ignore[attr-defined]
    for name in ("consumer", "demo"):
        svc = services[name]
        sub = commands[svc["command"][0]]  # KeyError: the command is not in the CLI
        env = svc.get("environment", {})
        unknown = {k for k in env if k.startswith("DGR_")} - cli_envvars(sub)
        assert not unknown, f"{name}: {sorted(unknown)} are not options of `dgr {svc['command'][0]}`"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"


def test_dockerfile_builds_portable_cpu_code() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "-DGGML_NATIVE=OFF" in text and "-DGGML_AMX_INT8=OFF" in text
