"""`dgr bench sampler`: per-call time of the sampler stage at Gemma's vocabulary (262,144).

For 8 and 64 rows and three settings (greedy, typical t0.8/k40/p0.95, top-p only t0.8/p0.95): today's
per-row loop over `consumer.sampling.sample` vs the batched `consumer.sampler.sample_rows`, best of N
calls each, alternating. Both sides must give the same tokens (checked on every call).

The logits are float32 with a language model's shape: Gumbel noise times a per-row scale in [1, 3]
(a heavy head over a long tail), so top_p 0.95 keeps tens to thousands of tokens, as with a real model;
normal(0, 1) logits would put most of the vocabulary in the nucleus, which real models do not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from consumer.sampler import sample_rows
from consumer.sampling import sample
from schemas import Sampling

from .common import console, machine, markdown, save, table

VOCAB = 262_144
SETTINGS: dict[str, Sampling] = {
    "greedy": Sampling(),
    "typical": Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=1),
    "top-p": Sampling(temperature=0.8, top_p=0.95, seed=1),
}


def logits_like_a_model(rows: int, vocab: int = VOCAB, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.gumbel(size=(rows, vocab)) * rng.uniform(1.0, 3.0, size=(rows, 1))).astype(np.float32)


def _per_row(logits: np.ndarray, samplings: list[Sampling], positions: list[int]) -> list[int]:
    return [sample(row, s, p) for row, s, p in zip(logits, samplings, positions, strict=True)]


def _batched(logits: np.ndarray, samplings: list[Sampling], positions: list[int]) -> list[int]:
    return [int(t) for t in sample_rows(logits, samplings, positions)]


def _best(fn: Callable[[], list[int]], repeats: int) -> tuple[float, list[int]]:
    best, out = float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(out_dir: Path, *, rows: Sequence[int] = (8, 64), settings: Sequence[str] = tuple(SETTINGS),
        repeats: int = 5, vocab: int = VOCAB) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    for n in rows:
        logits = logits_like_a_model(n, vocab, seed=n)
        positions = list(range(1000, 1000 + n))
        for name in settings:
            sampling = SETTINGS[name]
            samplings = [sampling.model_copy(update={"seed": i}) for i in range(n)]

            old = partial(_per_row, logits, samplings, positions)
            new = partial(_batched, logits, samplings, positions)
            t_old, t_new = float("inf"), float("inf")
            for _ in range(repeats):  # alternate the sides: these machines are noisy
                a, tok_old = _best(old, 1)
                b, tok_new = _best(new, 1)
                if tok_old != tok_new:
                    raise AssertionError(f"{name}, {n} rows: batched tokens differ from sample()'s")
                t_old, t_new = min(t_old, a), min(t_new, b)
            results.append({"rows": n, "sampling": name, "old_ms": t_old * 1e3, "new_ms": t_new * 1e3,
                            "speedup": t_old / t_new})
            console.print(f"{n} rows, {name}: per-row sample() {t_old * 1e3:.2f} ms, "
                          f"sample_rows {t_new * 1e3:.2f} ms, x{t_old / t_new:.1f}")
    cols = ["rows", "sampling", "per-row sample() ms/call", "batched ms/call", "speedup"]
    data = [[r["rows"], r["sampling"], r["old_ms"], r["new_ms"], r["speedup"]] for r in results]
    console.print(table(f"Sampler stage per fused call, vocabulary {vocab:,} (best of {repeats})", cols, data))
    payload = {"bench": "sampler", "vocab": vocab, "repeats": repeats, "machine": machine(), "rows": results,
               "markdown": markdown(cols, data)}
    save(out_dir, "sampler", payload)
    return payload
