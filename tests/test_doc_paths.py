"""The docs stay true to the tree (issue 30): every path the README's layout table and docs/architecture.md
name exists, and every file a layout row names by its bare name (`broker.py` in the row of
`consumer/transport/`) is in one of the folders that row names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/architecture.md")
_PATH = re.compile(r"(?<![\w./-])((?:consumer|producer|schemas|dgrtools|docs|tests|scripts|deploy|examples)/"
                   r"[\w./-]*[\w/])")
_BARE = re.compile(r"`([\w-]+\.(?:py|lua|sh))`")


def _paths(text: str) -> set[str]:
    return {m.split(":", 1)[0] for m in _PATH.findall(text)}


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_doc_names_exists(doc: str) -> None:
    text = (ROOT / doc).read_text()
    named = _paths(text)
    assert named, f"{doc} names no path: the pattern is wrong"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_a_layout_row_names_is_in_its_folders(doc: str) -> None:
    rows = [ln for ln in (ROOT / doc).read_text().splitlines() if ln.startswith("| `")]
    assert rows
    for row in rows:
        first = row.split("|")[1]
        dirs = {p if p.endswith("/") else p.rsplit("/", 1)[0] + "/" for p in _paths(first)}
        if not dirs:
            continue
        for name in _BARE.findall(row):
            found = [d for d in dirs if any((ROOT / d).rglob(name))]
            assert found, f"{doc}: {name!r} (row {first.strip()}) is in none of {sorted(dirs)}"


def test_the_check_fails_on_a_missing_path() -> None:
    assert _paths("see `consumer/transport.py` and consumer/sched/") == {"consumer/transport.py", "consumer/sched/"}
    assert not (ROOT / "consumer/transport.py").exists()
