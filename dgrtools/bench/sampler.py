"""`dgr bench sampler`: per-call time of the sampler stage at Gemma's vocabulary (262,144).

For 8 and 64 rows and each setting: the serving path `consumer.sampling.sample_rows` on one thread and
on a thread pool, and the oracle (`consumer.sampling.sample_row`, the specification as code) on up to 8
rows for reference, best of N calls each, alternating. Every side must give the same tokens (checked).

The logits are float32 with a language model's shape: Gumbel noise times a per-row scale in [1, 3] (a
heavy head over a long tail), so top_p 0.95 keeps tens to thousands of tokens, as with a real model.
The vocabulary masks Gemma's 6,243 special ids (as a real Gemma vocabulary does) unless `--model`
gives a GGUF, whose own vocabulary is then read (and the `json` setting, a JSON-schema grammar through
llama.cpp, becomes possible). With random logits the grammar refuses the best token almost always,
which real models rarely make it do: the `json` figure is an upper bound of the grammar's cost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from consumer.sampling import RowContext, RowInput, Vocabulary, sample_row, sample_rows, top_logprobs
from consumer.sampling.grammar import Grammar, gbnf_of
from schemas import Sampling

from .common import console, machine, markdown, save, table

VOCAB = 262_144
ORACLE_ROWS = 8  # the oracle sorts the whole vocabulary per row: timed on this many rows at most
JSON_SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                          "required": ["name", "age"]})
SETTINGS: dict[str, Sampling] = {
    "greedy": Sampling(),
    "typical": Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=1),
    "top-p": Sampling(temperature=0.8, top_p=0.95, seed=1),
    "min-p-rep": Sampling(temperature=0.8, min_p=0.05, repetition_penalty=1.1, seed=1),
    "logprobs": Sampling(logprobs=5),
    "json": Sampling(json_schema=JSON_SCHEMA),
}


def logits_like_a_model(rows: int, vocab: int = VOCAB, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.gumbel(size=(rows, vocab)) * rng.uniform(1.0, 3.0, size=(rows, 1))).astype(np.float32)


def gemma_like_vocabulary(vocab: int) -> Vocabulary:
    """Gemma 3's special ids (6 .. 6248 control/unused) and end-of-generation ids, cut to `vocab`."""
    special = np.arange(6, min(6249, vocab), dtype=np.int32)
    return Vocabulary(n_vocab=vocab, special=special, eog=np.array([t for t in (1, 106) if t < vocab], np.int32))


def _best(fn: Callable[[], list[int]], repeats: int) -> tuple[float, list[int]]:
    best, out = float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _inputs(sampling: Sampling, n: int, vocab: Vocabulary, rng: np.random.Generator) -> list[RowInput]:
    gbnf = gbnf_of(sampling)
    rows = []
    for i in range(n):
        ctx = RowContext(tokens=rng.integers(0, vocab.n_vocab, 300).astype(np.int32), prompt_end=100)
        grammar = Grammar(vocab, gbnf) if gbnf is not None else None
        rows.append(RowInput(sampling.model_copy(update={"seed": i}), 1000 + i, ctx, grammar))
    return rows


def _oracle(logits: np.ndarray, rows: Sequence[RowInput], vocab: Vocabulary) -> list[int]:
    out = []
    for r, inp in enumerate(rows):
        out.append(sample_row(logits[r], inp.sampling, inp.position, context=inp.context, vocab=vocab,
                              grammar=inp.grammar)[0])
        if inp.sampling.logprobs is not None:
            top_logprobs(logits[r], inp.sampling.logprobs)
    return out


def _batched(logits: np.ndarray, rows: Sequence[RowInput], vocab: Vocabulary, pool: Executor | None) -> list[int]:
    return [int(t) for t in sample_rows(logits, rows, vocab, pool=pool).tokens]


def run(out_dir: Path, *, rows: Sequence[int] = (8, 64), settings: Sequence[str] = tuple(SETTINGS),
        repeats: int = 5, vocab: int = VOCAB, threads: int = 2, model: Path | None = None) -> dict[str, Any]:
    voc = Vocabulary.load(model) if model is not None else gemma_like_vocabulary(vocab)
    rng = np.random.default_rng(0)
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for n in rows:
            logits = logits_like_a_model(n, voc.n_vocab, seed=n)
            for name in settings:
                if gbnf_of(SETTINGS[name]) is not None and not voc.grammars:
                    console.print(f"{name}: skipped (a grammar needs a GGUF vocabulary: --model)")
                    continue
                inputs = _inputs(SETTINGS[name], n, voc, rng)
                k = min(n, ORACLE_ROWS)
                sides: dict[str, Callable[[], list[int]]] = {
                    "oracle": partial(_oracle, logits, inputs[:k], voc),
                    "batched": partial(_batched, logits, inputs, voc, None),
                    "threads": partial(_batched, logits, inputs, voc, pool),
                }
                best = dict.fromkeys(sides, float("inf"))
                for _ in range(repeats):  # alternate the sides: shared machines are noisy
                    got = {}
                    for side, fn in sides.items():
                        t, got[side] = _best(fn, 1)
                        best[side] = min(best[side], t)
                    if got["batched"] != got["threads"] or got["batched"][:k] != got["oracle"]:
                        raise AssertionError(f"{name}, {n} rows: the sides give different tokens")
                oracle_ms = best["oracle"] * 1e3 / k
                results.append({"rows": n, "sampling": name, "oracle_ms_per_row": oracle_ms,
                                "batched_ms": best["batched"] * 1e3, "threads_ms": best["threads"] * 1e3,
                                "threads": threads})
                console.print(f"{n} rows, {name}: oracle {oracle_ms:.2f} ms/row, batched {best['batched'] * 1e3:.2f} "
                              f"ms/call, {threads} threads {best['threads'] * 1e3:.2f} ms/call")
    cols = ["rows", "sampling", "oracle ms/row", "batched ms/call", f"{threads} threads ms/call", "batched us/row"]
    data = [[r["rows"], r["sampling"], r["oracle_ms_per_row"], r["batched_ms"], r["threads_ms"],
             r["batched_ms"] * 1e3 / r["rows"]] for r in results]
    console.print(table(f"Sampler stage per fused call, vocabulary {voc.n_vocab:,} (best of {repeats})", cols, data))
    payload = {"bench": "sampler", "vocab": voc.n_vocab, "repeats": repeats, "threads": threads,
               "model": str(model) if model else None, "machine": machine(), "rows": results,
               "markdown": markdown(cols, data)}
    save(out_dir, "sampler", payload)
    return payload
