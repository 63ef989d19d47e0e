"""What a prefix-cache hit costs against computing the prefix (docs/prefix-cache.md).

`python -m dgrtools.prefix_cost tiny|gemma [--prefix 512,2000] [--repeats 3]` builds an `invariant`
LlamaCppEngine of 2 slots and, per prefix length P, prints one JSON object (medians of `repeats`):
- recompute_s: prefilling P tokens into an empty slot (what a miss costs);
- seq_cp_s: `llama_memory_seq_cp` of slot 0 (holding P) into slot 1 plus the 2-row call on slot 1 at P
  that makes llama.cpp copy the per-slot buffer (kv_unified=False), minus that same call alone;
- state_bytes: `llama_state_seq_get_size` of a slot holding P;
- get_s / set_s: `save_prefix` (state bytes out to host RAM) / `restore_prefix` (bytes into slot 1,
  trimmed to P - 16 by seq_rm);
- exact: the logits of a 2-row call after the restore equal those after recomputing (max |diff|);
- floor / trims: `prefix_floor` of the saved slot, and a restore trimmed to the first block edge at or past
  it (and 256 below it, when the floor is not 0) against recomputing that many positions.
The machine is shared: compare the ratios within one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from schemas.errors import EngineError


def _rows(slot: int, start: int, tokens: Sequence[int], last_logits: bool = True) -> Any:
    from consumer.batch import BatchRow, FusedBatch

    n = len(tokens)
    return FusedBatch.from_rows("prefill", [BatchRow(slot, start + i, int(t), last_logits and i == n - 1)
                                            for i, t in enumerate(tokens)])


def _median(f: Callable[[], float], repeats: int) -> float:
    return statistics.median(f() for _ in range(repeats))


def measure(engine: Any, prefix: int, repeats: int, rng: np.random.Generator) -> dict[str, object]:
    L, ctx, mem = engine._L, engine._ctx, engine._mem
    vocab = engine.capacity.vocab_size
    toks = rng.integers(0, vocab, size=prefix + 2).tolist()
    head, tail = toks[:prefix], toks[prefix:]

    def recompute() -> float:
        engine.release(1)
        t = time.perf_counter()
        engine.step(_rows(1, 0, head))
        return time.perf_counter() - t

    recompute_s = _median(recompute, repeats)
    engine.release(0)
    engine.step(_rows(0, 0, head))
    cold = engine.step(_rows(1, prefix, tail))  # slot 1 holds the recomputed prefix: the reference

    def tail_alone() -> float:
        L.llama_memory_seq_rm(mem, 1, prefix, -1)
        engine._next[1] = prefix
        t = time.perf_counter()
        engine.step(_rows(1, prefix, tail))
        return time.perf_counter() - t

    def seq_cp() -> float:
        engine.release(1)
        t = time.perf_counter()
        L.llama_memory_seq_cp(mem, 0, 1, -1, -1)
        engine._next[1] = prefix
        engine.step(_rows(1, prefix, tail))
        return time.perf_counter() - t

    alone_s = _median(tail_alone, repeats)
    seq_cp_s = max(0.0, _median(seq_cp, repeats) - alone_s)
    saved = engine.save_prefix(0)

    def get() -> float:
        t = time.perf_counter()
        engine.save_prefix(0)
        return time.perf_counter() - t

    def put() -> float:
        t = time.perf_counter()
        engine.restore_prefix(1, saved, prefix - 16)
        return time.perf_counter() - t

    get_s, set_s = _median(get, repeats), _median(put, repeats)
    engine.restore_prefix(1, saved, prefix)
    warm = engine.step(_rows(1, prefix, tail))
    trims = {}
    floor = engine.prefix_floor(0)
    # A trimmed restore against recomputing that many positions: at the first block edge at or past the
    # floor (what the store allows) and, when there is one, a block edge below it (what it refuses).
    edge = -(-max(floor, 16) // 16) * 16
    for name, n in (("at_floor", edge), ("below_floor", edge - 256 if floor > 0 else 0)):
        if not 16 <= n < prefix:
            continue
        engine.release(1)
        engine.step(_rows(1, 0, toks[:n]))
        cold_n = engine.step(_rows(1, n, toks[n:n + 2]))
        try:
            engine.restore_prefix(1, saved, n)
        except EngineError as e:  # a sliding window's cache may not hold the trimmed positions
            trims[name] = {"n": n, "error": str(e)}
            continue
        warm_n = engine.step(_rows(1, n, toks[n:n + 2]))
        trims[name] = {"n": n, "max_abs_diff": float(np.max(np.abs(warm_n - cold_n)))}
    del ctx
    return {"prefix": prefix, "recompute_s": round(recompute_s, 5), "seq_cp_s": round(seq_cp_s, 5),
            "state_bytes": len(saved), "get_s": round(get_s, 5), "set_s": round(set_s, 5),
            "hit_over_recompute": round(set_s / recompute_s, 4),
            "seq_cp_over_recompute": round(seq_cp_s / recompute_s, 4),
            "exact_max_abs_diff": float(np.max(np.abs(warm - cold))), "floor": floor, "trims": trims}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgrtools.prefix_cost", description=__doc__.split("\n")[0])
    ap.add_argument("model", choices=("tiny", "gemma"))
    ap.add_argument("--prefix", default="512,2000")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    from consumer.engines.llama import LlamaCppEngine

    prefixes = [int(x) for x in a.prefix.split(",")]
    with tempfile.TemporaryDirectory() as d:
        if a.model == "tiny":
            from .tiny_model import write_tiny_model

            path = Path(d) / "tiny.gguf"
            write_tiny_model(path)
        else:
            from .gemma import assemble_gemma

            path = assemble_gemma()
        engine = LlamaCppEngine(path, n_slots=2, ctx_per_session=max(prefixes) + 64, recipe="invariant")
        rng = np.random.default_rng(0)
        for p in prefixes:
            print(json.dumps({"model": a.model, **measure(engine, p, a.repeats, rng)}), flush=True)
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
