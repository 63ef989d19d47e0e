"""`dgr bench interference`: decode inter-token latency with and without a steady stream of long prompts.

For each scheduler setting a fresh consumer runs two phases, measured with the same decoders:
`quiet` (only the decoding sessions) and `loaded` (the same, while another producer keeps one long
prompt in flight at all times). p50/p99 of the decoders' inter-token gaps are compared; the goal at
the defaults is p99 loaded <= 2x p99 quiet. Counted from the first decode step, so prefill is excluded.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

from consumer.runtime import resolve_model
from dgrtools.localredis import LocalRedis
from dgrtools.process import ConsumerProcess
from producer import Producer
from schemas import RouteHop, Sampling, SessionSpec, StepResult

from .common import console, markdown, plot, save, table

# (label, weights decode:prefill, prefill budget in tokens, prefill ratio; 0 = fixed token budget)
SETTINGS: tuple[tuple[str, str, int, float], ...] = (
    ("default (4:1, 512, paced 0.8)", "4:1", 512, 0.8),
    ("fixed budget 512", "4:1", 512, 0.0),
    ("fixed budget 64", "4:1", 64, 0.0),
    ("weights 1:1, paced 0.8", "1:1", 512, 0.8),
)


def _decoders(producer: Producer, worker: str, n: int, tokens: int, vocab: int, tag: str) -> list[float]:
    key = producer.discover(worker).keys[0]
    rng = np.random.default_rng(0)
    specs = [(SessionSpec(session_id=f"{tag}-d{i}", account_id="bench", route=(RouteHop(worker_id=worker, key=key),),
                          sampling=Sampling(), max_tokens=tokens), [int(t) for t in rng.integers(3, vocab, 8)])
             for i in range(n)]
    last: dict[str, float] = {}
    gaps: list[float] = []

    def on_result(h: object, r: StepResult) -> None:
        now = time.perf_counter()
        if r.token is None:
            return
        if r.session_id in last:
            gaps.append(now - last[r.session_id])
        last[r.session_id] = now

    producer.run_many(specs, on_result=on_result)
    return gaps


def _prompt_stream(producer: Producer, worker: str, prompt_len: int, vocab: int, stop: threading.Event,
                   tag: str, done: list[float]) -> None:
    key = producer.discover(worker).keys[0]
    rng = np.random.default_rng(1)
    i = 0
    while not stop.is_set():  # one long prompt in flight at all times, each answered by one token
        spec = SessionSpec(session_id=f"{tag}-p{i}", account_id="bench", route=(RouteHop(worker_id=worker, key=key),),
                           sampling=Sampling(), max_tokens=1)
        producer.run_many([(spec, [int(t) for t in rng.integers(3, vocab, prompt_len)])])
        done.append(time.perf_counter())  # when this prompt's prefill finished
        i += 1


def _pcts(gaps: list[float]) -> tuple[float, float]:
    a = np.array(gaps) * 1e3
    return (float(np.percentile(a, 50)), float(np.percentile(a, 99))) if a.size else (0.0, 0.0)


def run(out_dir: Path, *, model: str = "gemma", decoders: int = 4, tokens: int = 96, prompt_len: int = 2000,
        recipe: str = "invariant", threads: int = 0, settings: tuple[tuple[str, str, int, float], ...] = SETTINGS,
        ) -> dict[str, Any]:
    path = resolve_model(model)
    ctx = 1 << max(8, (prompt_len + 16).bit_length())
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dgr-bench-") as tmp, LocalRedis() as server:
        for n, (label, weights, budget, ratio) in enumerate(settings):
            worker = f"bench-int-{n}"
            extra = ["--weights", weights, "--prefill-budget", str(budget), "--prefill-ratio", str(ratio),
                     "--ctx-per-session", str(ctx)]
            with ConsumerProcess(server.url, worker, path, Path(tmp), recipe=recipe, slots=decoders + 1,
                                 threads=threads, extra=extra) as consumer:
                client = redis.Redis.from_url(server.url)
                producer = Producer(client, timeout_s=600)
                vocab = int(producer.discover(worker).info.get("vocab_size", 256))
                _decoders(producer, worker, decoders, 4, vocab, f"{worker}-warm")
                quiet = _decoders(producer, worker, decoders, tokens, vocab, f"{worker}-q")
                stop, done = threading.Event(), list[float]()
                feeder = threading.Thread(target=_prompt_stream, args=(Producer(redis.Redis.from_url(server.url),
                                                                                timeout_s=600),
                                                                       worker, prompt_len, vocab, stop,
                                                                       f"{worker}-l", done))
                feeder.start()
                time.sleep(0.5)  # the first long prompt is being prefilled
                t0 = time.perf_counter()
                loaded = _decoders(producer, worker, decoders, tokens, vocab, f"{worker}-l")
                wall = time.perf_counter() - t0
                stop.set()
                feeder.join()
                hb = consumer.wait_heartbeat(since=time.time())
            q50, q99 = _pcts(quiet)
            l50, l99 = _pcts(loaded)
            row = {"setting": label, "weights": weights, "budget": budget, "ratio": ratio, "quiet_p50_ms": q50,
                   "quiet_p99_ms": q99, "loaded_p50_ms": l50, "loaded_p99_ms": l99,
                   "p99_ratio": l99 / q99 if q99 else 0.0,
                   "prompt_tokens_per_s": prompt_len * len([t for t in done if t0 < t <= t0 + wall]) / wall,
                   "calls_by_phase": hb["stats"]["calls_by_phase"]}
            rows.append(row)
            console.print(f"{label}: p99 quiet {q99:.1f} ms, loaded {l99:.1f} ms ({row['p99_ratio']:.2f}x); "
                          f"prompts {row['prompt_tokens_per_s']:.0f} tok/s")
    cols = ["setting", "p50 quiet ms", "p99 quiet ms", "p50 loaded ms", "p99 loaded ms", "p99 loaded/quiet",
            "prompt tok/s while decoding"]
    data = [[r["setting"], r["quiet_p50_ms"], r["quiet_p99_ms"], r["loaded_p50_ms"], r["loaded_p99_ms"],
             r["p99_ratio"], r["prompt_tokens_per_s"]] for r in rows]
    console.print(table(f"decode inter-token latency with {prompt_len}-token prompts ({model})", cols, data))
    payload = {"bench": "interference", "model": model, "decoders": decoders, "tokens": tokens,
               "prompt_len": prompt_len, "recipe": recipe, "threads": threads, "rows": rows,
               "markdown": markdown(cols, data)}
    save(out_dir, f"interference-{model}", payload)
    xs = [float(i) for i in range(len(rows))]
    plot(out_dir, f"interference-{model}", "decode p99 inter-token latency (x: setting index)", "setting",
         "ms", {"quiet p99": (xs, [r["quiet_p99_ms"] for r in rows]),
                "with long prompts p99": (xs, [r["loaded_p99_ms"] for r in rows])})
    return payload
