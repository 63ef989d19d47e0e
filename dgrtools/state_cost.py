"""What a session's state costs on each layout: bytes, snapshot and restore time, and what snapshots add
to a fused decode step (docs/state-layouts.md "Costs").

`python -m dgrtools.state_cost [--sessions 1,4,8] [--steps 32] [--prompt-len 64] [--repeats 3]` writes
the tiny model of each layout (kv, recurrent, hybrid; Q8_0) to a temporary directory and prints, per
layout, one JSON object:
- state_bytes_per_session / per_token / snapshot_bytes: as the engine advertises them (measured);
- snapshot_us / restore_us: one slot's snapshot copied out / written back and trimmed (median of 200);
- per batch size B: the fused decode step time with the default policy ("chunks": no snapshot in decode,
  counted) and with "always" (every slot snapshotted before every call), and the snapshots the
  default policy took in steady-state decode (0 expected);
- chunk_snapshot_share: a second prefill chunk of `prompt-len` rows on B sessions, the snapshot time
  over the whole call's time.
Both policies run the same work, alternating, `repeats` times; each keeps its fastest run. On a shared
machine compare ratios within one run, never absolute figures across runs.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .tiny_recurrent import LAYOUTS, write_tiny


def _engine(path: Path, sessions: int, ctx: int, snapshots: str) -> Any:
    from consumer.engines.llama import LlamaCppEngine

    return LlamaCppEngine(path, n_slots=sessions, ctx_per_session=ctx, snapshots=snapshots)  # type: ignore[arg-type]


def _prefill(e: Any, prompts: np.ndarray, start: int = 0) -> np.ndarray:
    from consumer.batch import BatchRow, FusedBatch

    b, n = prompts.shape
    rows = [BatchRow(s, start + p, int(prompts[s, p]), p == n - 1) for s in range(b) for p in range(n)]
    return np.argmax(e.step(FusedBatch.from_rows("prefill", rows)), axis=1)


def _decode_steps(e: Any, nxt: np.ndarray, start: int, steps: int) -> float:
    from consumer.batch import BatchRow, FusedBatch

    t0 = time.perf_counter()
    for k in range(steps):
        rows = [BatchRow(s, start + k, int(nxt[s]), True) for s in range(nxt.shape[0])]
        nxt = np.argmax(e.step(FusedBatch.from_rows("decode", rows)), axis=1)
    return time.perf_counter() - t0


def _copy_times(e: Any, reps: int = 200) -> tuple[float, float]:
    """Median microseconds to snapshot slot 0 and to put it back (restore + trim), slot 0 holding state."""
    st = e._states
    if st.positional:
        return 0.0, 0.0
    from consumer.engines.state import Checkpoint

    pos = e.next_position(0)
    save, restore = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        cp = Checkpoint(np.zeros(1, np.int64), np.full(1, pos, np.int64), {0: st._save(0)})
        t1 = time.perf_counter()
        lost = st.rollback(cp)
        t2 = time.perf_counter()
        assert not lost
        save.append(t1 - t0)
        restore.append(t2 - t1)
    return 1e6 * statistics.median(save), 1e6 * statistics.median(restore)


def measure(path: Path, sessions: Sequence[int], steps: int, prompt_len: int, repeats: int,
            seed: int = 0) -> dict[str, Any]:
    ctx = 2 * prompt_len + steps + 8
    rng = np.random.default_rng(seed)
    n = max(sessions)
    engines = {p: _engine(path, n, ctx, p) for p in ("chunks", "always")}
    try:
        e = engines["chunks"]
        cap = e.capacity
        out: dict[str, Any] = {
            "layout": e.state_layout.kind, "architecture": e.identity.architecture,
            "state_bytes_per_session": cap.state_bytes_per_session, "ctx_per_session": cap.ctx_per_session,
            "state_bytes_per_token": cap.state_bytes_per_token,
            "snapshot_bytes": int(e.describe()["snapshot_bytes_per_session"]), "batches": [],
        }
        _prefill(e, rng.integers(3, cap.vocab_size, size=(1, prompt_len)))
        out["snapshot_us"], out["restore_us"] = _copy_times(e)
        for b in sessions:
            prompts = rng.integers(3, cap.vocab_size, size=(b, 2 * prompt_len))
            best = {p: float("inf") for p in engines}
            chunk_share = 0.0
            taken_in_decode = 0
            for _ in range(max(1, repeats)):
                for policy, eng in engines.items():
                    for s in range(n):
                        eng.release(s)
                    _prefill(eng, prompts[:, :prompt_len])
                    before = eng._states.stats.seconds
                    t0 = time.perf_counter()
                    nxt = _prefill(eng, prompts[:, prompt_len:], start=prompt_len)  # a second chunk: snapshots
                    chunk = time.perf_counter() - t0
                    if policy == "chunks":
                        chunk_share = max(chunk_share, (eng._states.stats.seconds - before) / chunk)
                        taken = eng._states.stats.taken
                    best[policy] = min(best[policy], _decode_steps(eng, nxt, 2 * prompt_len, steps))
                    if policy == "chunks":
                        taken_in_decode += eng._states.stats.taken - taken
            out["batches"].append({
                "sessions": b, "decode_step_ms": 1000 * best["chunks"] / steps,
                "decode_step_ms_snapshot_always": 1000 * best["always"] / steps,
                "always_over_chunks": best["always"] / best["chunks"],
                "snapshots_in_steady_decode": taken_in_decode,
                "chunk_snapshot_share": chunk_share,
            })
        return out
    finally:
        for eng in engines.values():
            eng.close()


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dgrtools.state_cost")
    ap.add_argument("--sessions", default="1,4,8")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args(argv)
    os.environ.setdefault("GGML_CPU_TILED_MM", "0")
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts.split(","):
            path = Path(tmp) / f"tiny-{layout}.gguf"
            write_tiny(path, layout)
            res = measure(path, [int(x) for x in args.sessions.split(",")], args.steps, args.prompt_len,
                          args.repeats)
            print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
