"""A user's mistake on the command line is one line on stderr and exit status 2, with no traceback (`--debug`
shows it), and llama.cpp's loader lines are logged at DEBUG unless asked (issue 30)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumer import cli


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """`dgr consumer` sets up the process's logging: put it back for the next test."""
    root, llama = logging.getLogger(), logging.getLogger("dgr.llama")
    handlers, level, filters = root.handlers[:], root.level, llama.filters[:]
    yield
    root.handlers[:], llama.filters[:] = handlers, filters
    root.setLevel(level)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = cli.main(["consumer", "--log-format", "text", *args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("args, says", [
    (("--model", "/missing/model.gguf"), "not 'tiny', 'gemma' or an existing GGUF file"),
    (("--slots", "many"), "--slots"),
    (("--weights", "4"), "--weights"),
    (("--redis-url", "http://host:6379"), "--redis-url"),
    (("--on-lease-held", "fight"), "--on-lease-held"),
    (("--hmac-key-file", "/missing/keys"), "--hmac-key-file"),
    (("--llama-log", "loud"), "--llama-log"),
    (("--repack", "maybe"), "--repack"),
    (("--gc-young", "-1"), "--gc-young"),
])
def test_a_user_error_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
                                             says: str) -> None:
    rc, err = _run(capsys, *args)
    assert rc == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dgr consumer: error: ") and says in lines[0], err


def test_a_file_that_is_not_a_gguf(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model\n")
    rc, err = _run(capsys, "--model", str(bad))
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"dgr consumer: error: Invalid value for --model: llama.cpp could not " \
                                           f"load {bad}"


def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _run(capsys, "--model", "/missing/model.gguf", "--debug")
    assert rc == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("dgr consumer: error: ")


def test_llama_info_lines_are_debug_unless_asked(caplog: pytest.LogCaptureFixture) -> None:
    rec = logging.LogRecord("dgr.llama", logging.INFO, "", 0, "llama_model_loader: loaded meta data", None, None)
    root = logging.getLogger()
    old = root.level
    try:
        root.setLevel(logging.INFO)
        assert not cli._llama_info_at_debug(rec) and rec.levelname == "DEBUG"
        root.setLevel(logging.DEBUG)
        assert cli._llama_info_at_debug(rec)
    finally:
        root.setLevel(old)
    warn = logging.LogRecord("dgr.llama", logging.WARNING, "", 0, "a warning", None, None)
    assert cli._llama_info_at_debug(warn) and warn.levelno == logging.WARNING


def test_a_serving_process_collects_its_young_generation_less_often() -> None:
    """`dgr consumer --gc-young N` (default 20,000): the youngest generation's threshold, the older ones kept; 0
    leaves Python's own."""
    before = gc.get_threshold()
    try:
        cli.young_gc(0)
        assert gc.get_threshold() == before
        cli.young_gc(20_000)
        assert gc.get_threshold() == (20_000, *before[1:])
        assert cli.DEFAULTS.service.gc_young == 20_000
    finally:
        gc.set_threshold(*before)


def test_serve_refuses_a_negative_gc_threshold(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["serve", "--model", "tiny", "--gc-young", "-1"])
    err = capsys.readouterr().err
    assert rc == 2 and "--gc-young" in err and len(err.strip().splitlines()) == 1
