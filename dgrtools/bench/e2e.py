"""`dgr bench e2e`: decode tokens/s through Redis next to the raw fused engine, same batch, same run.

For each batch size B the two sides alternate `repeats` times:
- raw: B sessions decoded by one fused `engine.step()` per token in this process (no Redis);
- e2e: B sessions through the whole service: producer here, consumer in a subprocess, real redis-server.
e2e tokens/s is counted over the window where all B sessions are decoding (after the last first token,
until the first session finishes), so prefill and ramp-down do not blur the steady state. Per session the gap
from its first token to its second against its later gaps (medians) shows the ramp: a session's second token
should come at the call after its first, as every later one does.

`--sampling` sets the e2e sessions' Sampling (greedy by default; typical = t0.8/k40/p0.95, top-p = t0.8/p0.95,
min-p-rep = t0.8/min_p 0.05/repetition 1.1 over 64, logprobs = greedy with the top 5 log-probabilities,
json = t0.7 constrained to a small JSON schema (a session ends with its object); session i seeded i). The
raw side is the engine alone and always takes the argmax: e2e / raw then shows what sampling costs through
the service.

`--engine sleep:2ms` (consumer/engines/sleep.py) stands in for a GPU step: the raw side is then the
engine-bound rate (B tokens per sleep), and e2e / raw is the loop's efficiency at that step time.
`--overlap on|off|both|io`: the consumer's overlap setting; `both` runs two consumers (one each) in the same
Redis and alternates them, so the two sides are measured within one run (the on side then overlaps
whatever the fused call's length: --overlap-max-call-ms 0); `io` the same with the default against
`--no-overlap-io` (a long call's reads and filing in the loop's thread, in order). `--compare "OPTIONS"`: a
second consumer with these `dgr consumer` options too (e.g. "--sampler-threads 1"), alternated with the first in
the same run (a tuning measured within one run: these machines drift more between runs than most changes).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

from consumer.batch import BatchRow, FusedBatch
from consumer.engines.base import Engine, lending_forward
from consumer.runtime import make_engine, resolve_model
from dgrtools.localredis import LocalRedis
from dgrtools.process import ConsumerProcess
from producer import Producer
from producer.core import DECODE_N
from schemas import RouteHop, Sampling, SessionSpec, StepResult

from .common import console, markdown, plot, save, table

PROMPT_LEN = 8
# A JSON object of two fields: the grammar case of issue 23's goals (a session ends when its object does).
JSON_SCHEMA = ('{"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, '
               '"count": {"type": "integer"}}, "required": ["name", "count"]}')
SAMPLINGS: dict[str, Sampling] = {
    "greedy": Sampling(),
    "typical": Sampling(temperature=0.8, top_k=40, top_p=0.95),
    "top-p": Sampling(temperature=0.8, top_p=0.95),
    "min-p-rep": Sampling(temperature=0.8, min_p=0.05, repetition_penalty=1.1, penalty_last_n=64),
    "logprobs": Sampling(logprobs=5),
    "json": Sampling(temperature=0.7, json_schema=JSON_SCHEMA),
}


def result_name(model: str, recipe: str, sampling: str = "greedy", decode_n: int = DECODE_N) -> str:
    """The JSON's name: as before for greedy, the sampling appended otherwise (and `-n<decode_n>` when the
    producer's decode jobs ask for another number of tokens than its default)."""
    name = f"e2e-{model}-{recipe}" if sampling == "greedy" else f"e2e-{model}-{recipe}-{sampling}"
    return name if decode_n == DECODE_N else f"{name}-n{decode_n}"


def raw_fused_rate(engine: Engine, b: int, steps: int, seed: int = 0) -> float:
    """Aggregate decode tokens/s of B sessions, one fused call per step, greedy."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, engine.capacity.vocab_size, size=(b, PROMPT_LEN))
    for s in range(b):
        engine.release(s)
    rows = [BatchRow(s, p, int(prompts[s, p]), p == PROMPT_LEN - 1) for s in range(b) for p in range(PROMPT_LEN)]
    forward = lending_forward(engine)  # as the worker calls it (each call's argmax taken before the next)
    nxt = np.argmax(forward(FusedBatch.from_rows("prefill", rows)).rows, axis=1)
    t0 = time.perf_counter()
    for k in range(steps):
        batch = FusedBatch.from_rows("decode", [BatchRow(s, PROMPT_LEN + k, int(nxt[s]), True) for s in range(b)])
        nxt = np.argmax(forward(batch).rows, axis=1)
    dt = time.perf_counter() - t0
    for s in range(b):
        engine.release(s)
    return b * steps / dt


def e2e_rate(producer: Producer, consumer: ConsumerProcess, b: int, tokens: int, tag: str,
             seed: int = 0, sampling: Sampling = SAMPLINGS["greedy"]) -> dict[str, float]:
    info = producer.discover(consumer.worker_id)
    key = info.keys[0]
    vocab = int(info.info.get("vocab_size", 256))
    rng = np.random.default_rng(seed)
    specs = [(SessionSpec(session_id=f"{tag}-{i}", account_id="bench", route=(RouteHop(worker_id=consumer.worker_id,
                                                                                     key=key),),
                          sampling=sampling.model_copy(update={"seed": i}), max_tokens=tokens),
              [int(t) for t in rng.integers(3, vocab, PROMPT_LEN)]) for i in range(b)]
    stamps: dict[str, list[float]] = {s.session_id: [] for s, _ in specs}

    def on_result(h: object, r: StepResult) -> None:
        if r.token is not None:
            stamps[r.session_id].append(time.perf_counter())

    before = consumer.wait_heartbeat(since=time.time())["stats"]
    producer.run_many(specs, on_result=on_result)
    after = consumer.wait_heartbeat(since=time.time())["stats"]
    t_start = max(ts[0] for ts in stamps.values())
    t_end = min(ts[-1] for ts in stamps.values())
    n = sum(1 for ts in stamps.values() for t in ts if t_start < t <= t_end)
    calls = after["calls_by_phase"]["decode"] - before["calls_by_phase"]["decode"]
    sessions = after["decode_sessions"] - before["decode_sessions"]
    fused = after["fused_calls"] - before["fused_calls"]
    if t_end <= t_start:  # 0.0 below is no measurement: the run needs more tokens per session
        console.print(f"[yellow]{tag}: no window where all {b} sessions decode (the first finished before the "
                      "last one's first token): give more --tokens[/yellow]")
    first_gap, later_gap = token_gaps(list(stamps.values()))
    return {
        "tok_s": n / (t_end - t_start) if t_end > t_start else 0.0,
        "first_gap_ms": first_gap, "later_gap_ms": later_gap,
        "mean_batch": sessions / calls if calls else 0.0,
        "round_trips_per_call": (after["round_trips"] - before["round_trips"]) / fused if fused else 0.0,
        "overhead_us_per_call": (1e6 * (after["overhead_seconds"] - before["overhead_seconds"]) / fused
                                 if fused else 0.0),
        "engine_gap_us": _engine_gap_us(before, after),
    }


def _engine_gap_us(before: dict[str, Any], after: dict[str, Any]) -> float:
    """The engine's mean idle between two calls the worker had ready (its critical path), µs; 0: none counted."""
    gaps = after.get("engine_gaps", 0) - before.get("engine_gaps", 0)
    return 1e6 * (after.get("engine_gap_seconds", 0.0) - before.get("engine_gap_seconds", 0.0)) / gaps if gaps else 0.0


def token_gaps(stamps: list[list[float]]) -> tuple[float, float]:
    """(median over sessions of the gap from a session's first token to its second, median of its later gaps), ms:
    the ramp (issue 32: the first continuation pushed with the opening) makes the first equal the others, where a
    Tracker that waits for the first token before it pushes the next step adds one round trip to it."""
    firsts = [1e3 * (ts[1] - ts[0]) for ts in stamps if len(ts) >= 2]
    later = [statistics.median(np.diff(ts[1:]).tolist()) * 1e3 for ts in stamps if len(ts) >= 3]
    return (statistics.median(firsts) if firsts else 0.0, statistics.median(later) if later else 0.0)


PREFILL_PROMPT = 512


def e2e_prefill_rate(producer: Producer, consumer: ConsumerProcess, tag: str, seed: int = 0) -> float:
    """Prompt tokens/s of one PREFILL_PROMPT-token prompt through the whole service: from open() until
    its first token arrives (the worker cuts the prompt by its budget; nothing else runs)."""
    info = producer.discover(consumer.worker_id)
    vocab = int(info.info.get("vocab_size", 256))
    prompt = [int(t) for t in np.random.default_rng(seed).integers(3, vocab, PREFILL_PROMPT)]
    spec = SessionSpec(session_id=f"{tag}-prefill", account_id="bench",
                       route=(RouteHop(worker_id=consumer.worker_id, key=info.keys[0]),), max_tokens=1)
    t0 = time.perf_counter()
    for _ in producer.generate(spec, prompt):
        break
    return PREFILL_PROMPT / (time.perf_counter() - t0)


OVERLAPS = ("on", "off", "both", "io")


def _overlap_args(side: str, overlap: str, compare: tuple[str, ...] = ()) -> list[str]:
    """The consumer's flags for one side. With `both`, the on side overlaps whatever the call length
    (--overlap-max-call-ms 0): the comparison is then the overlap itself, not its length rule. With `io`, the
    default (on) against `in-order`: calls longer than overlap_max_call_ms with their reads and filing in the
    loop's thread too (--no-overlap-io). The `compare` side: the first side's flags and `compare`."""
    if side == "compare":
        return [*_overlap_args(overlap, overlap), *compare]
    if side == "off":
        return ["--no-overlap"]
    if side == "in-order":
        return ["--overlap", "--no-overlap-io"]
    return ["--overlap", "--overlap-max-call-ms", "0"] if overlap == "both" else ["--overlap"]


def _side_label(sampling: str, overlap: str, samplings: tuple[str, ...], overlaps: tuple[str, ...],
                compare: tuple[str, ...] = ()) -> str:
    consumer = " ".join(compare) if overlap == "compare" else f"overlap {overlap}"
    parts = ([sampling] if len(samplings) > 1 else []) + ([consumer] if len(overlaps) > 1 else [])
    return ", ".join(parts) or "e2e"


def run(out_dir: Path, *, model: str = "tiny", batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16), tokens: int = 64,
        repeats: int = 2, recipe: str = "invariant", threads: int = 0, n_gpu_layers: int = 0,
        sampling: str = "greedy", engine_kind: str = "llama", overlap: str = "on",
        decode_n: int = DECODE_N, compare: tuple[str, ...] = ()) -> dict[str, Any]:
    """`sampling` may name several (comma-separated) and `overlap` may be `both` (or `compare` given): every
    (sampling, consumer)
    side is measured in this run, alternating with the raw side and with each other (the order reversed
    every other repeat); ratios to the first side are reported. The first side's figures keep the
    single-side names (e2e_tok_s, efficiency...); every side's are in row["sides"]."""
    samplings = tuple(x for x in sampling.split(",") if x)
    bad = [x for x in samplings if x not in SAMPLINGS]
    if bad or not samplings:
        raise ValueError(f"sampling must be among {', '.join(SAMPLINGS)}, not {sampling!r}")
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap must be one of {', '.join(OVERLAPS)}, not {overlap!r}")
    if compare and overlap not in ("on", "off"):
        raise ValueError(f"compare takes one overlap side (on or off), not {overlap!r}")
    sleep = engine_kind.startswith("sleep:")
    path = resolve_model("tiny" if sleep else model)  # the sleep engine reads no model
    if sleep:
        model = engine_kind
    slots = max(batch_sizes)
    ctx = 1024  # the prefill measurement's prompt needs PREFILL_PROMPT + 1 positions
    overlaps = {"both": ("on", "off"), "io": ("on", "in-order")}.get(overlap, (overlap, "compare") if compare
                                                                     else (overlap,))
    sides = [(smp, ov) for smp in samplings for ov in overlaps]
    labels = {side: _side_label(*side, samplings, overlaps, compare) for side in sides}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dgr-bench-") as tmp, LocalRedis() as server:
        extra = ["--heartbeat-s", "0.2", "--ctx-per-session", str(ctx), "--n-gpu-layers", str(n_gpu_layers)]
        consumers = {ov: ConsumerProcess(server.url, f"bench-e2e-{ov}" if len(overlaps) > 1 else "bench-e2e",
                                         path, Path(tmp), engine=engine_kind, recipe=recipe, slots=slots,
                                         threads=threads, extra=[*extra, *_overlap_args(ov, overlap, compare)])
                     for ov in overlaps}
        engine = make_engine(path, kind=engine_kind, recipe=recipe,  # type: ignore[arg-type]
                             n_slots=slots, ctx_per_session=ctx, n_threads=threads or None, n_gpu_layers=n_gpu_layers)
        producer = Producer(redis.Redis.from_url(server.url), decode_n=decode_n)  # tokens per decode job
        try:
            for c in consumers.values():  # first-call costs out of the way
                e2e_rate(producer, c, 1, 4, f"warm-{c.worker_id}", sampling=SAMPLINGS[samplings[-1]])
            raw_fused_rate(engine, 1, 4)
            for b in batch_sizes:
                raws: list[float] = []
                e2es: dict[tuple[str, str], list[dict[str, float]]] = {side: [] for side in sides}
                for r in range(repeats):  # alternate the sides: these machines are noisy
                    raws.append(raw_fused_rate(engine, b, tokens, seed=r))
                    for smp, ov in (sides if r % 2 == 0 else sides[::-1]):
                        e2es[(smp, ov)].append(e2e_rate(producer, consumers[ov], b, tokens, f"b{b}r{r}{smp}{ov}",
                                                        seed=r, sampling=SAMPLINGS[smp]))
                raw = statistics.median(raws)
                row: dict[str, Any] = {"batch": b, "raw_tok_s": raw, "raw_runs": raws, "sides": {}}
                for side in sides:
                    es = e2es[side]
                    e2e = statistics.median(e["tok_s"] for e in es)
                    fig = {"e2e_tok_s": e2e, "efficiency": e2e / raw,
                           "batch_fill": statistics.median(e["mean_batch"] for e in es) / b,
                           "round_trips_per_call": statistics.median(e["round_trips_per_call"] for e in es),
                           "overhead_us_per_call": statistics.median(e["overhead_us_per_call"] for e in es),
                           "first_gap_ms": statistics.median(e["first_gap_ms"] for e in es),
                           "engine_gap_us": statistics.median(e["engine_gap_us"] for e in es),
                           "later_gap_ms": statistics.median(e["later_gap_ms"] for e in es),
                           "e2e_runs": [e["tok_s"] for e in es], "sampling": side[0], "overlap": side[1]}
                    first = row["sides"].get(labels[sides[0]])
                    fig["vs_first"] = e2e / first["e2e_tok_s"] if first and first["e2e_tok_s"] else 1.0
                    row["sides"][labels[side]] = fig
                    console.print(f"B={b} {labels[side]}: raw {raw:.1f} tok/s, e2e {e2e:.1f} tok/s, "
                                  f"efficiency {e2e / raw:.3f}, batch fill {fig['batch_fill']:.3f}")
                row |= {k: v for k, v in row["sides"][labels[sides[0]]].items() if k not in ("sampling", "overlap")}
                rows.append(row)
            first_c = consumers[overlaps[0]]
            prefill = statistics.median(e2e_prefill_rate(producer, first_c, f"p{r}", seed=r)
                                        for r in range(max(1, repeats)))
            console.print(f"prefill of a {PREFILL_PROMPT}-token prompt through the service: {prefill:.1f} tok/s")
        finally:
            engine.close()
            for c in consumers.values():
                c.stop()
    raw_name = "engine-bound tok/s" if sleep else "raw tok/s"
    cols = ["batch", raw_name, "e2e tok/s", "e2e/raw", "batch fill", "round trips/call", "overhead us/call",
            "1st-2nd token ms", "later gaps ms", "engine idle us/call"]
    data: list[list[Any]] = [[r["batch"], r["raw_tok_s"], r["e2e_tok_s"], r["efficiency"], r["batch_fill"],
                              r["round_trips_per_call"], r["overhead_us_per_call"], r["first_gap_ms"],
                              r["later_gap_ms"], r["engine_gap_us"]] for r in rows]
    first_label = labels[sides[0]]
    if len(sides) > 1:
        cols[2:4] = [f"e2e tok/s ({first_label})", f"e2e/raw ({first_label})"]
        for side in sides[1:]:
            lab = labels[side]
            cols += [f"e2e/raw ({lab})", f"{lab} / {first_label}"]
            for res, d in zip(rows, data, strict=True):
                d += [res["sides"][lab]["efficiency"], res["sides"][lab]["vs_first"]]
    console.print(table(f"e2e vs raw fused decode ({model}, {recipe}, {sampling} sampling, overlap {overlap})",
                        cols, data))
    payload = {"bench": "e2e", "model": model, "model_path": str(path), "recipe": recipe, "sampling": sampling,
               "engine": engine_kind, "overlap": overlap, "decode_n": decode_n, "sides": [labels[x] for x in sides],
               "tokens": tokens,
               "repeats": repeats, "threads": threads, "n_gpu_layers": n_gpu_layers, "rows": rows,
               "prefill_prompt": PREFILL_PROMPT, "prefill_tok_s": prefill,
               "markdown": markdown(cols, data)}
    name = result_name(model.replace(":", "-"), recipe, sampling.replace(",", "+"), decode_n)
    if overlap in ("both", "io"):
        name += "-overlap" if overlap == "both" else "-overlap-io"
    if compare:
        name += "-compare"
    save(out_dir, name, payload)
    bs = [float(r["batch"]) for r in rows]
    plot(out_dir, name, f"decode tokens/s, {model} ({recipe}, {sampling} sampling)", "concurrent sessions",
         "tokens/s", {"raw fused engine": (bs, [r["raw_tok_s"] for r in rows]),
                      "end to end through Redis": (bs, [r["e2e_tok_s"] for r in rows])}, logx=True)
    return payload


def run_recipes(out_dir: Path, recipes: tuple[str, ...], *, model: str, batch_sizes: tuple[int, ...], tokens: int,
                repeats: int, threads: int, n_gpu_layers: int, sampling: str = "greedy",
                decode_n: int = DECODE_N) -> dict[str, Any]:
    """`dgr bench e2e --recipe fast,invariant`: the bench once per recipe, each in its own process (ggml
    reads GGML_CPU_TILED_MM once per process), one after the other in this run; then invariant / fast."""
    import json
    import subprocess
    import sys

    payloads: dict[str, dict[str, Any]] = {}
    for recipe in recipes:
        sub = out_dir / recipe
        args = [sys.executable, "-m", "consumer", "bench", "e2e", "--recipe", recipe, "--model", model,
                "--batches", ",".join(map(str, batch_sizes)), "--tokens", str(tokens), "--repeats", str(repeats),
                "--threads", str(threads), "--n-gpu-layers", str(n_gpu_layers), "--sampling", sampling,
                "--decode-n", str(decode_n), "--out", str(sub)]
        subprocess.run(args, check=True)
        payloads[recipe] = json.loads((sub / f"{result_name(model, recipe, sampling, decode_n)}.json").read_text())
    cols = ["batch", *(f"{r} e2e tok/s" for r in recipes)]
    data = [[b, *(next(row["e2e_tok_s"] for row in payloads[r]["rows"] if row["batch"] == b) for r in recipes)]
            for b in batch_sizes]
    data.append([f"prefill {PREFILL_PROMPT}", *(payloads[r]["prefill_tok_s"] for r in recipes)])
    if {"fast", "invariant"} <= set(recipes):
        cols.append("invariant/fast")
        for row in data:
            row.append(row[1 + recipes.index("invariant")] / row[1 + recipes.index("fast")])
    console.print(table(f"e2e by recipe ({model}, same run)", cols, data))
    payload = {"bench": "e2e-recipes", "model": model, "recipes": list(recipes), "sampling": sampling,
               "runs": payloads,
               "markdown": markdown(cols, data)}
    save(out_dir, f"e2e-recipes-{model}", payload)
    return payload
