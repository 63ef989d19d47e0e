"""No import cycle in the service packages (issue 30): the module graph of every module-level import,
those under `if TYPE_CHECKING:` included (a cycle there is still two modules that cannot be read apart), a
name imported from a package's __init__ followed to the submodule that defines it. Function-level imports
are left out: they are how the CLI defers heavy imports, not a dependency of the module.

None is known: producer/'s last two (credit <-> session <-> steps, core <-> route) went when the credit window's
state moved into session.py and its steps into steps.py, and a relay took the `Steps` it uses."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("consumer", "producer", "schemas", "gateway")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def top_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    out: list[ast.Import | ast.ImportFrom] = []
    for n in body:
        if isinstance(n, ast.Import | ast.ImportFrom):
            out.append(n)
        elif isinstance(n, ast.If):
            out += top_imports(n.body) + top_imports(n.orelse)
        elif isinstance(n, ast.Try):
            out += top_imports(n.body) + top_imports(n.orelse) + top_imports(n.finalbody)
    return out


def absolute(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def graph() -> dict[str, set[str]]:
    mods = modules()
    trees = {m: ast.parse(f.read_text()) for m, f in mods.items()}
    reexport: dict[tuple[str, str], str] = {}
    for m, t in trees.items():
        if mods[m].name == "__init__.py":
            for n in top_imports(t.body):
                if isinstance(n, ast.ImportFrom):
                    for a in n.names:
                        reexport[(m, a.asname or a.name)] = absolute(m, True, n.level, n.module)

    def target(src: str, attr: str) -> str:
        for _ in range(10):
            if f"{src}.{attr}" in mods:
                return f"{src}.{attr}"
            if (src, attr) not in reexport:
                break
            src = reexport[(src, attr)]
        return src

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, t in trees.items():
        is_pkg = mods[m].name == "__init__.py"
        for n in top_imports(t.body):
            if isinstance(n, ast.Import):
                edges[m] |= {a.name for a in n.names if a.name in mods}
                continue
            src = absolute(m, is_pkg, n.level, n.module)
            for a in n.names:
                tgt = target(src, a.name)
                # a package's __init__ re-exporting its own submodules is not a dependency of theirs
                if tgt in mods and tgt != m and not (is_pkg and tgt.startswith(m + ".")):
                    edges[m].add(tgt)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected sets of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def test_the_finder_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    found = cycles(graph())
    assert found == [], sorted(sorted(c) for c in found)
