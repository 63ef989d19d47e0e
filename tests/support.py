"""Helpers shared by the tests: a compatibility key, solo reference runs, prompts, a consumer subprocess."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from rq import SimpleWorker

from consumer.batch import BatchRow, FusedBatch
from consumer.engines.base import Engine
from dgrtools.process import ConsumerProcess as _ConsumerProcess
from schemas import (
    CompatibilityKey,
    EngineIdentity,
    Phase,
    Recipe,
    StateLayout,
    StepResult,
    WorkerKeys,
    results_from_fields,
    whole_model_boundary,
)

ROOT = Path(__file__).resolve().parents[1]
# The tests run the NumPy reference engine unless they ask for llama.cpp.
ConsumerProcess = partial(_ConsumerProcess, engine="reference", threads=2)


def compat_key(phase: Phase = "decode", *, architecture: str = "llama", sha: str = "ab" * 32, ctx: int = 256,
               runtime: str = "numpy-reference/1") -> CompatibilityKey:
    """A whole-model, batch-invariant f32 key: what most tests need, with the fields they vary."""
    return CompatibilityKey(
        engine=EngineIdentity(architecture=architecture, gguf_sha256=sha),
        recipe=Recipe(quantization="F32", kv_cache_type="f32", ctx_per_session=ctx, flash_attention=False,
                      batch_invariant=True, runtime=runtime),
        phase=phase, boundary=whole_model_boundary(2), state=StateLayout(kind="kv", dims={"n_layer": 2}),
    )


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, int(rng.integers(lo, hi + 1)))] for _ in range(n)]


def solo_generate(engine: Engine, prompt: Sequence[int], max_tokens: int, slot: int = 0,
                  chunk: int = 512) -> list[int]:
    """Greedy generation of one session alone, straight on the engine (no Redis, no scheduler)."""
    engine.release(slot)
    logits = None
    for start in range(0, len(prompt), chunk):
        part = prompt[start:start + chunk]
        last = start + len(part) == len(prompt)
        rows = [BatchRow(slot, start + i, t, last and i == len(part) - 1) for i, t in enumerate(part)]
        out = engine.step(FusedBatch.from_rows("prefill", rows))
        if last:
            logits = out[0]
    assert logits is not None
    tokens = [int(np.argmax(logits))]
    pos = len(prompt)
    while len(tokens) < max_tokens:
        out = engine.step(FusedBatch.from_rows("decode", [BatchRow(slot, pos, tokens[-1], True)]))
        pos += 1
        tokens.append(int(np.argmax(out[0])))
    engine.release(slot)
    return tokens


def session_results(client: Any, worker: str, session_id: str) -> list[StepResult]:
    """Every answer published to a session, in order: the rows of its worker's result records (wire
    version 2) that name it, wherever its jobs' `reply_to` sent them (its own stream, or a Tracker's)."""
    keys = WorkerKeys(worker)
    own = keys.results(session_id)
    others = sorted(k.decode() for k in client.scan_iter(match=keys.results_pattern, count=1000))
    streams = [own, *(k for k in others if k != own)]
    out: list[StepResult] = []
    for name in streams:
        for _id, fields in client.xrange(name):
            out.extend(r for r in results_from_fields(fields) if r.session_id == session_id)
    return out


def entry_results(entries: Sequence[tuple[Any, Any]]) -> list[StepResult]:
    """The rows of result entries (an XRANGE / XREAD page of one result stream), in order."""
    return [r for _id, fields in entries for r in results_from_fields(fields)]


class BurstWorker(SimpleWorker):
    """rq's SimpleWorker (no fork) without its command channel: a burst that ends at once can race the pubsub
    thread it starts (subscribed or not yet), and closing it then waits for that thread's 60 s read (a 60 s
    test seen in the suite). The tests drive jobs, never worker commands."""

    def subscribe(self) -> None:
        pass
