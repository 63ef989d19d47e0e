"""`dgr bench report`: docs/benchmarks.md from the JSON the benchmarks wrote (one full run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ORDER = ("engine", "e2e", "e2e-recipes", "interference", "peer", "scale", "scheduler", "producer", "sampler")
TITLES = {
    "engine": "Engine: fused decode vs one call per session",
    "e2e": "End to end through Redis vs the raw fused engine",
    "e2e-recipes": "What the invariant recipe costs, end to end (both recipes in one run)",
    "interference": "Decode inter-token latency under long prompts",
    "peer": "Peer: llama.cpp's llama-server (continuous batching) vs dgr",
    "scale": "Scale: worker time per fused call vs idle sessions",
    "scheduler": "Scheduler: one scheduling round",
    "producer": "Producer: AsyncProducer vs the synchronous driver, many sessions at once",
    "sampler": "Sampler stage: the serving path vs the oracle, vocabulary 262,144",
}


def _load(root: Path) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(root.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        name = data.get("bench") or path.stem.split("-")[0]
        if name in TITLES:
            found.setdefault(name, []).append({**data, "_path": str(path)})
    return found


def _headline(found: dict[str, list[dict[str, Any]]]) -> list[str]:
    out = []
    for run in found.get("e2e", []):
        for row in run.get("rows", []):
            if row.get("batch") == 8:
                out.append(f"- e2e/raw at 8 sessions ({run.get('model')}, {run.get('recipe')}): "
                           f"**{row['efficiency']:.3f}** (e2e {row['e2e_tok_s']:.1f} tok/s, "
                           f"raw {row['raw_tok_s']:.1f}); "
                           f"batch fill {row['batch_fill']:.3f}; {row['round_trips_per_call']:.2f} Redis round trips "
                           f"per fused call; worker {row['overhead_us_per_call']:.0f} us per call "
                           "outside engine and reads")
    for run in found.get("engine", []):
        for model, batch, fast_d, inv_d, r_d, fast_p, inv_p, r_p in run.get("recipe_cost", []):
            out.append(f"- invariant / fast, engine, {model}: decode at {batch} sessions **{r_d:.2f}** "
                       f"({inv_d:.1f} vs {fast_d:.1f} tok/s), prefill of a 512-token prompt **{r_p:.2f}** "
                       f"({inv_p:.0f} vs {fast_p:.0f} tok/s)")
    for run in found.get("peer", []):
        r = run.get("ratios", {})
        if "wall_dgr_over_server" in r:
            out.append(f"- dgr / llama-server, {run.get('sessions')} sessions x {run.get('tokens')} tokens, Gemma "
                       f"({run.get('recipe')}): **{r['wall_dgr_over_server']:.3f}** aggregate (wall), "
                       f"{r['decode_dgr_over_server']:.3f} decode-only; vs llama-server --no-repack "
                       f"{r.get('wall_dgr_over_server_no_repack', float('nan')):.3f}; llama-server reaches "
                       f"{r['decode_server_over_raw']:.3f} of raw fused decode, dgr {r['decode_dgr_over_raw']:.3f}")
    for run in found.get("interference", []):
        rows = run.get("rows", [])
        if rows:
            r = rows[0]
            out.append(f"- decode p99 with {run.get('prompt_len')}-token prompts / without, at the defaults "
                       f"({run.get('model')}): **{r['p99_ratio']:.2f}x** ({r['quiet_p99_ms']:.0f} -> "
                       f"{r['loaded_p99_ms']:.0f} ms)")
    for run in found.get("scale", []):
        rows = run.get("rows", [])
        if len(rows) > 1:
            out.append(f"- worker time per fused call with {rows[1]['idle_sessions']:,} idle sessions vs none: "
                       f"**{rows[1]['vs_no_idle']:.2f}x**")
    return out or ["- (no benchmark results found)"]


def _at(run: dict[str, Any], batch: int) -> dict[str, Any] | None:
    return next((r for r in run.get("rows", []) if r.get("batch") == batch), None)


def _side(row: dict[str, Any] | None, label: str) -> dict[str, Any] | None:
    if row is None:
        return None
    return row.get("sides", {}).get(label) or (row if label in ("e2e", "") else None)


def goals(found: dict[str, list[dict[str, Any]]]) -> list[list[Any]]:
    """Issue 15's goals next to what this run measured: [figure, goal, measured, met?, source]."""
    out: list[list[Any]] = []

    def add(figure: str, goal: str, value: float | None, ok: bool | None, source: str) -> None:
        out.append([figure, goal, "not measured" if value is None else f"{value:.3g}",
                    "-" if ok is None or value is None else ("yes" if ok else "NO"), source])

    e2e = found.get("e2e", [])
    gemma = [r for r in e2e if r.get("model") == "gemma" and len(r.get("sides", [])) > 1
             and "greedy" in str(r.get("sampling"))]
    g = gemma[-1] if gemma else None
    row = _at(g, 8) if g else None
    src = "bench e2e --model gemma --sampling greedy,typical,top-p"
    for label, figure in (("greedy", "e2e / raw, Gemma, 8 sessions, greedy"),
                          ("typical", "e2e / raw, Gemma, 8 sessions, typical")):
        s = _side(row, label)
        add(figure, ">= 0.97", s["efficiency"] if s else None, s is not None and s["efficiency"] >= 0.97, src)
    for label, goal in (("typical", 0.95), ("top-p", 0.9)):
        s = _side(row, label)
        add(f"{label} / greedy, Gemma, 8 sessions (same run)", f">= {goal}", s["vs_first"] if s else None,
            s is not None and s["vs_first"] >= goal, src)
    for engine, batch in (("sleep:2ms", 8), ("sleep:2ms", 32), ("sleep:10ms", 256)):
        runs = [r for r in e2e if r.get("engine") == engine]
        row = _at(runs[-1], batch) if runs else None
        eff = row["efficiency"] if row else None
        add(f"e2e / engine-bound, {engine} engine, {batch} sessions (overlap on)", ">= 0.9", eff,
            eff is not None and eff >= 0.9, f"bench e2e --engine {engine}")
        off = _side(row, "overlap off")
        if off is not None and eff is not None:
            gain = f" (on / off {eff / off['efficiency']:.2f}x)" if off["efficiency"] else ""
            add(f"... overlap off{gain}", "-", off["efficiency"], None, f"bench e2e --engine {engine}")
    scale = [r for r in found.get("scale", []) if r.get("per_session")]
    per = scale[-1]["per_session"] if scale else None
    for b in (64, 128, 256):
        prow = next((r for r in per["rows"] if r["sessions"] == b), None) if per else None
        for tag in ("on", "off"):
            v = prow[f"us_per_session_{tag}"] if prow else None
            add(f"worker us per session per fused decode call, {b} sessions, overlap {tag}", "<= 20", v,
                v is not None and v <= 20, "bench scale --sessions 64,128,256")
    if per:
        for tag in ("on", "off"):
            v = per["fit"][tag]["us_per_call_fixed"]
            add(f"worker us per call independent of the batch (line fit), overlap {tag}", "< 1000", v, v < 1000,
                "bench scale")
    for sampling, goal in (("greedy", 1.05), ("typical", 1.0)):
        runs = [r for r in found.get("peer", []) if r.get("sampling", "greedy") == sampling]
        v = runs[-1].get("ratios", {}).get("wall_dgr_over_server") if runs else None
        add(f"dgr / llama-server, Gemma, 8 sessions, {sampling} (wall)", f">= {goal}", v,
            v is not None and v >= goal, f"bench peer --sampling {sampling}")
    tiny = [r for r in e2e if r.get("model") == "tiny"]
    row = _at(tiny[-1], 8) if tiny else None
    add("e2e / raw, tiny model, 8 sessions (no goal)", "-", row["efficiency"] if row else None, None,
        "bench e2e --model tiny")
    off = _side(row, "overlap off")
    if off is not None:
        add("... overlap off", "-", off["efficiency"], None, "bench e2e --model tiny --overlap both")
    return out


HAND_MARKER = "<!-- written by hand: dgr bench report keeps everything from here on -->"


def write(root: Path, out: Path, command: str) -> Path:
    found = _load(root)
    any_run = next((r for runs in found.values() for r in runs), {})
    m = any_run.get("machine", {})
    lines = ["# Benchmarks", "",
             "Written by `dgr bench report` from the JSON of one benchmark run; every figure below was measured "
             "by the command shown. These machines are noisy (15-30 % between runs): compare the ratios measured "
             "within one run, not absolute figures across runs.", "",
             f"- commands: `{command}`", f"- commit: `{m.get('commit', '?')}`, date: {m.get('date', '?')}",
             f"- machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('mem_gib', '?')} GiB, "
             f"Python {m.get('python', '?')}; no GPU", "", "## Headline", "", "<!-- headline -->"]
    lines += _headline(found)
    lines += ["<!-- /headline -->", ""]
    from .common import markdown

    lines += ["## Goals of issue 15", "", "Each goal next to this run's measurement (`yes`/`NO`: met or not; the "
              "notes below the tables say what limits a missed one).", "",
              markdown(["figure", "goal", "measured", "met", "command"], goals(found)), ""]
    for name in ORDER:
        for run in found.get(name, []):
            settings = {k: v for k, v in run.items()
                        if k not in ("rows", "results", "markdown", "machine", "_path", "bench") and
                        not isinstance(v, (dict, list))}
            lines += [f"## {TITLES[name]}", "", f"Settings: `{json.dumps(settings)}`; raw data: `{run['_path']}`", "",
                      run.get("markdown", "(no table)"), ""]
            if run.get("recipe_cost_markdown"):
                lines += ["What the invariant recipe costs (same run):", "", run["recipe_cost_markdown"], ""]
    # What follows HAND_MARKER in the file was written by hand (goals of later issues, one-off measurements,
    # each with its command and commit): kept as it is.
    if out.exists():
        old = out.read_text()
        at = old.find(HAND_MARKER)
        if at >= 0:
            lines += [old[at:].rstrip("\n"), ""]
    out.write_text("\n".join(lines))
    return out
