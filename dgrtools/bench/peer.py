"""`dgr bench peer`: dgr end to end next to llama.cpp's own `llama-server`, same model, same prompts.

Three figures, one run, measured alternately so the noise of a shared machine falls on every side:
- raw fused: B sessions decoded by one fused `engine.step()` per token in this process (the ceiling);
- dgr: B sessions through the whole service (producer here, consumer subprocess, real redis-server);
- llama-server: B concurrent `/completion` requests to llama.cpp's continuous-batching HTTP server
  (and, with `no_repack`, a second one started with `--no-repack`: plain weight buffers, as dgr's engine).

For dgr and llama-server two rates are reported:
- wall: B * tokens / (time from releasing the requests to the last token), prefill included;
- decode: steady-state decode only: tokens in the window where all B sessions decode (as `bench/e2e.py`),
  from client-side token timestamps on both sides (llama-server streams, one event per token, as dgr
  publishes one result per token). The server's own view is reported too ("timings"): the sum of each
  request's `timings.predicted_per_second`.

llama-server is built once from the llama.cpp sources vendored in the llama-cpp-python sdist (the same
commit as our binding), with explicit CPU flags and no AMX (some VMs advertise AMX but cannot run it).
The build is cached (default `~/.cache/dgr/llama-server-<version>/`) with a `build.json` saying how.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cpu_probe import compare_features, parse_system_info, probe_system_info
from .llama_server import LlamaServer, prompts_for
from .llamacpp_build import (
    build_server,
    default_cache_dir,
    say,
    server_binary,
)
from .rates import SideResult, peer_ratios, ratio, summarize, token_agreement, wall_rate, window_rate


# ---------------------------------------------------------------------------------------- dgr
def dgr_complete_many(producer: Any, consumer: Any, prompts: Sequence[Sequence[int]], tokens: int,
                      tag: str, sampling: Any = None) -> SideResult:
    """S sessions through the whole service, exactly `tokens` each (no stop tokens); greedy, or `sampling`
    with session i seeded i."""
    from schemas import RouteHop, Sampling, SessionSpec, StepResult

    info = producer.discover(consumer.worker_id)
    hop = RouteHop(worker_id=consumer.worker_id, key=info.keys[0])
    base = sampling or Sampling()
    specs = [(SessionSpec(session_id=f"{tag}-{i}", account_id="bench", route=(hop,),
                          sampling=base.model_copy(update={"seed": i}),
                          max_tokens=tokens, stop_tokens=()), list(p)) for i, p in enumerate(prompts)]
    stamps: dict[str, list[float]] = {s.session_id: [] for s, _ in specs}
    toks: dict[str, list[int]] = {s.session_id: [] for s, _ in specs}

    def on_result(_h: object, r: StepResult) -> None:
        if r.token is not None:
            stamps[r.session_id].append(time.perf_counter())
            toks[r.session_id].append(int(r.token))

    before = consumer.wait_heartbeat(since=time.time())["stats"]
    t0 = time.perf_counter()
    producer.run_many(specs, on_result=on_result)
    after = consumer.wait_heartbeat(since=time.time())["stats"]
    series = [stamps[s.session_id] for s, _ in specs]
    n = sum(len(s) for s in series)
    ends_early = base.constrained  # a grammar ends a session when its output is complete
    if n != tokens * len(prompts) and not (ends_early and 0 < n <= tokens * len(prompts)):
        raise RuntimeError(f"dgr: {n} tokens, {tokens * len(prompts)} asked")
    calls = after["calls_by_phase"]["decode"] - before["calls_by_phase"]["decode"]
    sessions = after["decode_sessions"] - before["decode_sessions"]
    fused = after["fused_calls"] - before["fused_calls"]

    def per_call(key: str) -> float:
        return 1e3 * (after[key] - before[key]) / fused if fused else 0.0

    return SideResult(wall_tok_s=wall_rate(n, t0, series), decode_tok_s=window_rate(series),
                      ttft_ms=1e3 * statistics.median(s[0] - t0 for s in series),
                      tokens=[toks[s.session_id] for s, _ in specs],
                      extra={"mean_batch": sessions / calls if calls else 0.0, "fused_calls": float(fused),
                             # per fused call: in the engine; the loop's own work; waiting in reads (mostly
                             # for the producer's next steps: the per-token round trip through Redis)
                             "engine_ms_per_call": per_call("engine_seconds"),
                             "overhead_ms_per_call": per_call("overhead_seconds"),
                             "read_ms_per_call": per_call("read_seconds")})


# ---------------------------------------------------------------------------------------- run
def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []








def bar_plot(out_dir: Path, name: str, title: str, groups: dict[str, dict[str, float]]) -> Path:
    """Grouped bars: one group per side, one bar per figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import save_figure

    sides = list(groups)
    figures = list(next(iter(groups.values()))) if groups else []
    fig, ax = plt.subplots(figsize=(7.0, 4.0), dpi=110)
    w = 0.8 / max(1, len(figures))
    for j, fname in enumerate(figures):
        xs = [i + (j - (len(figures) - 1) / 2) * w for i in range(len(sides))]
        ys = [groups[s].get(fname, float("nan")) for s in sides]
        bars = ax.bar(xs, ys, width=w, label=fname)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(sides)), sides)
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return save_figure(fig, out_dir, name)


@dataclass
class _Measured:
    """What the alternating runs produced, read before the sides are stopped."""

    runs: dict[str, list[SideResult]]
    loads: list[list[float]]
    server_info: dict[str, dict[str, Any]]
    engine_desc: dict[str, Any]


def _measure(out_dir: Path, binary: Path, model: Path, prompts: list[list[int]], *, sessions: int, tokens: int,
             repeats: int, recipe: str, threads: int, ctx: int, no_repack: bool,
             sampling: Any = None) -> _Measured:
    """Start every side (llama-server, optionally a --no-repack one, a dgr consumer, the raw engine), warm
    them up, then run `repeats` rounds, alternating sides so that every one sees the same noise."""
    import redis

    from consumer.runtime import make_engine
    from dgrtools.localredis import LocalRedis
    from dgrtools.process import ConsumerProcess
    from producer import Producer

    from .e2e import raw_fused_rate

    runs: dict[str, list[SideResult]] = {"raw fused": [], "dgr": [], "llama-server": []}
    if no_repack:
        runs["llama-server --no-repack"] = []
    servers: dict[str, LlamaServer] = {}
    with tempfile.TemporaryDirectory(prefix="dgr-bench-peer-") as tmp, LocalRedis() as rs, \
            contextlib.ExitStack() as stack:
        log_dir = Path(out_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        say(f"starting llama-server ({sessions} slots, {threads} threads, ctx {ctx}/slot)")
        servers["llama-server"] = LlamaServer(binary, model, log_dir, threads=threads, sessions=sessions,
                                              ctx_per_session=ctx)
        stack.callback(servers["llama-server"].stop)
        if no_repack:
            srv = LlamaServer(binary, model, log_dir, threads=threads, sessions=sessions, ctx_per_session=ctx,
                              name="llama-server-no-repack", extra=["--no-repack"])
            stack.callback(srv.stop)
            servers["llama-server --no-repack"] = srv
        say(f"starting the dgr consumer (recipe {recipe})")
        consumer = ConsumerProcess(rs.url, "bench-peer", model, Path(tmp), recipe=recipe, slots=sessions,
                                   threads=threads, extra=["--heartbeat-s", "0.2", "--ctx-per-session", str(ctx)])
        stack.callback(consumer.stop)
        engine = make_engine(model, recipe=recipe, n_slots=sessions, ctx_per_session=ctx,  # type: ignore[arg-type]
                             n_threads=threads)
        stack.callback(engine.close)
        producer = Producer(redis.Redis.from_url(rs.url))

        say("warming up every side")
        dgr_complete_many(producer, consumer, prompts, 8, "warm", sampling)
        for srv in servers.values():
            srv.complete_many(prompts, 8, sampling)
        raw_fused_rate(engine, sessions, 8)
        loads: list[list[float]] = []
        for r in range(repeats):  # alternate: every side sees the same noise; the others sit idle
            raw = raw_fused_rate(engine, sessions, tokens, seed=r)  # no prefill in its timing: wall = decode
            runs["raw fused"].append(SideResult(raw, raw, float("nan"), [], {}))
            runs["dgr"].append(dgr_complete_many(producer, consumer, prompts, tokens, f"r{r}", sampling))
            for side, srv in servers.items():
                runs[side].append(srv.complete_many(prompts, tokens, sampling))
            loads.append(_loadavg()[:1])
            say(f"repeat {r + 1}/{repeats} (load {loads[-1]}): " + ", ".join(
                f"{s} {rs_[-1].wall_tok_s:.1f}/{rs_[-1].decode_tok_s:.1f}" for s, rs_ in runs.items())
                + " tok/s (wall/decode)")
        probed = probe_system_info(binary, threads)
        server_info: dict[str, dict[str, Any]] = {
            name: {"cmd": srv.cmd, "system_info": srv.system_info() or probed, "version": srv.version}
            for name, srv in servers.items()}
        engine_desc = engine.describe() if hasattr(engine, "describe") else {}
    return _Measured(runs, loads, server_info, engine_desc)


def _warnings(theirs: Sequence[str], diff: dict[str, list[str]], runs: dict[str, list[SideResult]]) -> list[str]:
    warnings: list[str] = []
    if not theirs:
        warnings.append("llama-server's system_info was not found: CPU features not compared")
    elif diff["only_dgr"] or diff["only_server"]:
        warnings.append(f"CPU features differ: only in dgr's llama-cpp-python {diff['only_dgr']}, "
                        f"only in llama-server {diff['only_server']}")
    engine_ms = [r.extra["engine_ms_per_call"] for r in runs["dgr"] if r.extra.get("engine_ms_per_call")]
    if engine_ms and max(engine_ms) > 1.5 * min(engine_ms):
        warnings.append(f"dgr's fused decode calls took {min(engine_ms):.0f} to {max(engine_ms):.0f} ms across "
                        "repeats with the same batch: look at the per-run figures, not only the medians (rows out "
                        "of slot order split llama.cpp's non-unified-KV batch into several ubatches)")
    return warnings


def _print(title: str, cols: list[str], data: list[list[Any]], warnings: list[str], ratios: dict[str, Any],
           dgr: dict[str, Any]) -> None:
    from .common import console, table

    console.print(table(title, cols, data))
    for w in warnings:
        console.print(f"warning: {w}", style="yellow", markup=False)
    console.print(f"dgr/llama-server: wall {ratios['wall_dgr_over_server']:.3f}, "
                  f"decode {ratios['decode_dgr_over_server']:.3f}; dgr per fused call (median): engine "
                  f"{dgr['engine_ms_per_call']:.1f} ms, loop {dgr['overhead_ms_per_call']:.1f} ms, reads "
                  f"{dgr['read_ms_per_call']:.1f} ms; mean decode batch {dgr['mean_batch']:.2f}", markup=False)
    console.print("dgr/llama-server per repeat (wall): "
                  + ", ".join(f"{x:.2f}" for x in ratios["paired_wall_dgr_over_server"]), markup=False)


def run(out_dir: Path, *, cache_dir: Path | None = None, sessions: int = 8, tokens: int = 64, repeats: int = 3,
        recipe: str = "fast", threads: int = 2, build: bool = True, no_repack: bool = True,
        sampling: str = "greedy") -> dict[str, Any]:
    """dgr vs llama-server (and the raw fused engine), same Gemma file, same prompts, alternated.

    `no_repack`: also run a second llama-server with `--no-repack`, i.e. plain CPU weight buffers as dgr's
    engine uses (`use_extra_bufts=False`), to tell the weight layout apart from the serving loop."""
    from consumer.engines.llama import system_features
    from dgrtools.gemma import assemble_gemma
    from dgrtools.tokenizer import Tokenizer

    from .common import markdown, save
    from .e2e import SAMPLINGS

    if recipe not in ("fast", "invariant"):
        raise ValueError(f"recipe must be 'fast' or 'invariant', not {recipe!r}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {', '.join(SAMPLINGS)}, not {sampling!r}")
    cache = (cache_dir or default_cache_dir()).expanduser()
    binary = server_binary(cache)
    if not binary.is_file() and not build:
        raise FileNotFoundError(f"{binary} is missing and build=False")
    build_info = build_server(cache)  # reuses the cached binary when present
    model = assemble_gemma()
    tok = Tokenizer(model)
    prompts = [tok.encode(p, add_bos=True) for p in prompts_for(sessions)]
    ctx = 256 * -(-(max(len(p) for p in prompts) + tokens + 1) // 256)
    ours = system_features()
    load_before = _loadavg()
    m = _measure(out_dir, binary, model, prompts, sessions=sessions, tokens=tokens, repeats=repeats,
                 recipe=recipe, threads=threads, ctx=ctx, no_repack=no_repack, sampling=SAMPLINGS[sampling])
    load_after = _loadavg()
    runs = m.runs

    theirs = parse_system_info(m.server_info["llama-server"]["system_info"] or "")
    diff = compare_features(ours, theirs)
    warnings = _warnings(theirs, diff, runs)
    summary = summarize(runs)
    ratios = peer_ratios(summary, runs, no_repack=no_repack)
    dgr = summary["dgr"]
    agreement = {side: token_agreement(runs["dgr"][-1].tokens, rs_[-1].tokens)
                 for side, rs_ in runs.items() if side.startswith("llama-server")}

    raw_decode = summary["raw fused"]["decode_tok_s"]
    cols = ["side", "wall tok/s", "decode tok/s", "timings tok/s", "TTFT ms", "decode/raw", "dgr/side wall",
            "dgr/side decode"]
    data = [[side, s["wall_tok_s"], s["decode_tok_s"], s.get("timings_decode_tok_s", "-"),
             s["ttft_ms"] if side != "raw fused" else "-", ratio(s["decode_tok_s"], raw_decode),
             ratio(dgr["wall_tok_s"], s["wall_tok_s"]) if side != "raw fused" else "-",
             ratio(dgr["decode_tok_s"], s["decode_tok_s"])] for side, s in summary.items()]
    title = f"dgr vs llama-server: Gemma 270M Q4_K_M, {sessions} sessions x {tokens} tokens, recipe {recipe}, " \
            f"{sampling} sampling, {threads} threads, median of {repeats}"
    _print(title, cols, data, warnings, ratios, dgr)
    payload: dict[str, Any] = {
        "bench": "peer", "model": str(model), "recipe": recipe, "sampling": sampling, "sessions": sessions,
        "tokens": tokens,
        "repeats": repeats, "threads": threads, "ctx_per_session": ctx,
        "prompt_tokens": [len(p) for p in prompts], "prompts": prompts_for(sessions),
        "build": build_info, "server": m.server_info, "dgr_engine": m.engine_desc,
        "cpu_features": {"dgr_llama_cpp_python": ours, "llama_server": theirs, **diff,
                         "differ": bool(diff["only_dgr"] or diff["only_server"])},
        "ggml_cpu_tiled_mm": {"dgr": "0 (set by the consumer)" if recipe == "invariant" else "unset",
                              "llama_server": "unset (llama.cpp default: tiled matmul on)"},
        "loadavg_before": load_before, "loadavg_after": load_after, "loadavg_1min_per_repeat": m.loads,
        "summary": summary, "ratios": ratios, "warnings": warnings, "token_agreement_last_repeat": agreement,
        "markdown": markdown(cols, data),
    }
    name = f"peer-{recipe}" if sampling == "greedy" else f"peer-{recipe}-{sampling}"
    save(out_dir, name, payload)
    bar_plot(out_dir, name, f"Gemma 270M, {sessions} sessions x {tokens} tokens ({recipe}, {sampling})",
             {side: {"wall (incl. prefill)": s["wall_tok_s"], "decode window": s["decode_tok_s"]}
              for side, s in summary.items()})
    return payload
