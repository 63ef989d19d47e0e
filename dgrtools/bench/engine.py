"""`dgr bench engine`: fused decode tokens/s at batch 1..16 next to the same sessions decoded one call
at a time (the batching gain), per model and llama.cpp recipe.

Each (model, recipe) runs in its own process: ggml reads GGML_CPU_TILED_MM once per process, and the
`invariant` recipe sets it, so a `fast` engine in the same process would not be llama.cpp's default.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from consumer.runtime import resolve_model

from .common import console, markdown, plot, save, table


def _measure_here(model_path: str, recipe: str, batch_sizes: list[int], steps: int, threads: int,
                  n_gpu_layers: int, repeats: int) -> dict[str, Any]:
    from consumer.engines.llama import LlamaCppEngine, bench_engine_decode

    engine = LlamaCppEngine(model_path, recipe=recipe,  # type: ignore[arg-type]
                            n_slots=max(batch_sizes), ctx_per_session=max(PREFILL_TOKENS + 8, 8 + steps),
                            n_threads=threads or None, n_gpu_layers=n_gpu_layers)
    try:
        bench_engine_decode(engine, [max(batch_sizes)], 2)  # warm-up: first calls allocate and page in
        rows = bench_engine_decode(engine, batch_sizes, steps, repeats=repeats)
        return {"describe": engine.describe(), "batch_invariant": engine.batch_invariant, "rows": rows,
                "prefill_tok_s": _prefill_tok_s(engine, PREFILL_TOKENS, repeats)}
    finally:
        engine.close()


PREFILL_TOKENS = 512


def _prefill_tok_s(engine: Any, n: int, repeats: int) -> float:
    """One session's prompt of n random tokens in one fused call (the engine cuts it into micro-batches);
    best of `repeats`."""
    import time

    import numpy as np

    from consumer.batch import BatchRow, FusedBatch

    prompt = np.random.default_rng(0).integers(3, engine.capacity.vocab_size, n)
    best = float("inf")
    for _ in range(max(1, repeats)):
        engine.release(0)
        rows = [BatchRow(0, i, int(t), i == n - 1) for i, t in enumerate(prompt)]
        t0 = time.perf_counter()
        engine.step(FusedBatch.from_rows("prefill", rows))
        best = min(best, time.perf_counter() - t0)
    engine.release(0)
    return n / best


def _recipe_cost(results: list[dict[str, Any]], batch: int) -> list[list[Any]]:
    """invariant / fast per model: decode tok/s at `batch` sessions and prefill tok/s (same run)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in results):
        by = {r["recipe"]: r for r in results if r["model"] == model}
        if not {"fast", "invariant"} <= by.keys():
            continue
        dec = {k: next((row["fused_tok_s"] for row in v["rows"] if int(row["batch"]) == batch), None)
               for k, v in by.items()}
        pre = {k: v["prefill_tok_s"] for k, v in by.items()}
        out.append([model, batch, dec["fast"], dec["invariant"],
                    dec["invariant"] / dec["fast"] if dec["fast"] and dec["invariant"] else None,
                    pre["fast"], pre["invariant"], pre["invariant"] / pre["fast"]])
    return out


def run(out_dir: Path, *, models: tuple[str, ...] = ("tiny", "gemma"), recipes: tuple[str, ...] = ("fast", "invariant"),
        batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16), steps: int = 32, threads: int = 0,
        n_gpu_layers: int = 0, repeats: int = 3) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    for model in models:
        path = resolve_model(model)
        for recipe in recipes:
            console.print(f"[bold]{model} / {recipe}[/bold]: fused vs one call per session, {steps} steps")
            args = [sys.executable, "-m", "dgrtools.bench.engine", str(path), recipe, ",".join(map(str, batch_sizes)),
                    str(steps), str(threads), str(n_gpu_layers), str(repeats)]
            out = subprocess.run(args, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"engine bench {model}/{recipe} failed:\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            results.append({"model": model, "recipe": recipe, "model_path": str(path), **res})
    cols = ["model", "recipe", "batch", "fused tok/s", "one call each tok/s", "gain", "fused step ms"]
    data = [[r["model"], r["recipe"], int(row["batch"]), row["fused_tok_s"], row["serial_tok_s"], row["speedup"],
             row["fused_step_ms"]] for r in results for row in r["rows"]]
    console.print(table("fused decode vs one call per session", cols, data))
    cost_cols = ["model", "batch", "fast decode tok/s", "invariant decode tok/s", "invariant/fast decode",
                 f"fast prefill tok/s ({PREFILL_TOKENS})", "invariant prefill tok/s", "invariant/fast prefill"]
    cost = _recipe_cost(results, 8 if 8 in batch_sizes else max(batch_sizes))
    if cost:
        console.print(table("what the invariant recipe costs (same run)", cost_cols, cost))
    payload = {"bench": "engine", "steps": steps, "threads": threads, "n_gpu_layers": n_gpu_layers,
               "repeats (best of)": repeats,
               "results": results, "markdown": markdown(cols, data),
               "recipe_cost": cost, "recipe_cost_markdown": markdown(cost_cols, cost) if cost else ""}
    save(out_dir, "engine", payload)
    series: dict[str, tuple[Sequence[float], Sequence[float]]] = {}
    for r in results:
        bs = [row["batch"] for row in r["rows"]]
        series[f"{r['model']}/{r['recipe']} fused"] = (bs, [row["fused_tok_s"] for row in r["rows"]])
        series[f"{r['model']}/{r['recipe']} one call each"] = (bs, [row["serial_tok_s"] for row in r["rows"]])
    plot(out_dir, "engine", "decode tokens/s", "sessions", "tokens/s", series, logx=True)
    return payload


if __name__ == "__main__":  # one (model, recipe) in this process; prints one JSON line
    path, recipe, sizes, steps, threads, ngl, reps = sys.argv[1:8]
    print(json.dumps(_measure_here(path, recipe, [int(x) for x in sizes.split(",")], int(steps), int(threads),
                                   int(ngl), int(reps))))
