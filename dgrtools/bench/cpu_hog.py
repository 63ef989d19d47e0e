"""A competing busy process for shared-CPU measurements (docs/operations.md, "A shared CPU"): the tiny
model decoding 8 sessions in a loop with llama.cpp (threads = cores, spinning at its barriers as any
llama.cpp process does), until killed.

    python -m dgrtools.bench.cpu_hog &      # one competitor
"""

from __future__ import annotations

from consumer.batch import BatchRow, FusedBatch
from consumer.engines.llama import LlamaCppEngine
from consumer.runtime import resolve_model


def main() -> None:
    eng = LlamaCppEngine(resolve_model("tiny"), recipe="fast", n_slots=8, ctx_per_session=1024, cpu_wait="spin")
    while True:
        for s in range(8):
            eng.release(s)
        eng.step(FusedBatch.from_rows("prefill", [BatchRow(s, i, 5 + i, i == 63) for s in range(8) for i in range(64)]))
        for p in range(64, 900):
            eng.step(FusedBatch.from_rows("decode", [BatchRow(s, p, 7, True) for s in range(8)]))


if __name__ == "__main__":
    main()
