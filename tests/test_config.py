"""One source for configuration: every setting of ConsumerConfig is an option of `dgr consumer` (and so a
DGR_* environment variable), and every option's default is the one consumer/config.py states."""

from __future__ import annotations

from dataclasses import fields

import pytest
import typer.main

from consumer.cli import app
from consumer.config import DEFAULTS, ConsumerConfig

# Settings whose option has another name or shape (one option may set two fields).
RENAMED = {"engine.kind": "engine", "engine.threads": "n_threads", "worker.standby": "on_lease_held",
           "worker.w_decode": "weights", "worker.w_prefill": "weights",
           "transport.block_ms": "block_ms", "transport.gather_ms": "gather_ms"}


def _options() -> dict[str, object]:
    command = typer.main.get_command(app).commands["consumer"]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params}


def _settings() -> dict[str, object]:
    out: dict[str, object] = {}
    for part in fields(ConsumerConfig):
        value = getattr(DEFAULTS, part.name)
        for f in fields(value):
            out[f"{part.name}.{f.name}"] = getattr(value, f.name)
    return out


def test_every_setting_is_an_option_with_an_environment_variable() -> None:
    options = _options()
    for key in _settings():
        name = RENAMED.get(key, key.split(".", 1)[1])
        assert name in options, f"{key} cannot be set from the command line"
        assert options[name].envvar, f"--{name} has no environment variable"  # type: ignore[attr-defined]


def test_every_default_is_the_config_default() -> None:
    options = _options()
    for key, default in _settings().items():
        if key in RENAMED and RENAMED[key] != key.split(".", 1)[1]:
            continue
        want = list(default) if isinstance(default, tuple) else default  # a repeated option's default: a list
        assert options[key.split(".", 1)[1]].default == want, key  # type: ignore[attr-defined]
    assert options["weights"].default == f"{DEFAULTS.worker.w_decode}:{DEFAULTS.worker.w_prefill}"  # type: ignore[attr-defined]
    assert options["on_lease_held"].default == ("wait" if DEFAULTS.worker.standby else "refuse")  # type: ignore[attr-defined]
    assert options["engine"].default == DEFAULTS.engine.kind  # type: ignore[attr-defined]
    assert options["n_threads"].default == DEFAULTS.engine.threads  # type: ignore[attr-defined]


def test_the_worker_and_the_transport_share_their_read_defaults() -> None:
    assert DEFAULTS.worker.block_ms == DEFAULTS.transport.block_ms
    assert DEFAULTS.worker.gather_ms == DEFAULTS.transport.gather_ms


def test_model_choices_name_each_engine_and_its_own_settings() -> None:
    from consumer.runtime import ModelChoice, model_choice, model_choices

    assert model_choice("tiny") == ModelChoice("tiny", "tiny")
    assert model_choice("/m/Mamba 2.8B.Q8_0.gguf") == ModelChoice("Mamba-2.8B.Q8_0", "/m/Mamba 2.8B.Q8_0.gguf")
    assert model_choice("/m/a=b.gguf").model == "/m/a=b.gguf"  # not a name: a path holding '='
    assert model_choice("draft=tiny,slots=32,ctx=512,recipe=fast,weight=3") == ModelChoice(
        "draft", "tiny", slots=32, ctx_per_session=512, recipe="fast", weight=3)
    for bad in ("x=tiny,slots=0", "x=tiny,threads=2", "x=tiny,recipe=slow", "x=", "x=tiny,weight"):
        with pytest.raises(ValueError):
            model_choice(bad)
    assert [c.name for c in model_choices(["tiny", "tiny-recurrent", "big=gemma"])] == [
        "tiny", "tiny-recurrent", "big"]
    with pytest.raises(ValueError, match="two engines named 'tiny'"):
        model_choices(["tiny", "/models/tiny.gguf"])


def test_a_bad_model_choice_is_a_usage_error() -> None:
    from typer.testing import CliRunner

    wide = {"COLUMNS": "250"}
    res = CliRunner().invoke(app, ["consumer", "--model", "a=tiny,slots=0", "--log-format", "text"], env=wide)
    assert res.exit_code == 2 and "slots must be an integer" in res.output, res.output
    res = CliRunner().invoke(app, ["consumer", "--model", "tiny", "--model", "tiny,slots=2"], env=wide)
    assert res.exit_code == 2 and "two engines named" in res.output, res.output
