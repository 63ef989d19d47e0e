"""The minimal reproductions behind docs/invariance.md, at engine level (no Redis, no scheduler).

`python -m dgrtools.invariance_probe tiny|gemma|PATH [--flash-attention]` prints, for two random prompts,
the largest |logit difference| of each case against its reference shape. 0 means bit-identical. Each case
is one of the causes (or non-causes) the document lists:

- split A+B: one 100-token prompt cut into calls of A and B rows vs one call (causes 1 and 2);
- 2 sessions A/B: two prompts of A and B rows in one step() vs the first one alone (cause 3; the engine
  now runs unequal pieces as separate llama_decode calls, so this is 0 with the invariant recipe);
- replay in 1 call / replay 1 row each: prompt + 20 decoded tokens re-prefilled at once, or the decoded
  ones one row per call, vs the original run (cause 4);
- decode next to a long co-tenant, long contexts, slot history: the non-causes.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

os.environ.setdefault("GGML_CPU_TILED_MM", "0")  # before llama.cpp's first matmul, as the recipe does

from consumer.batch import BatchRow, FusedBatch
from consumer.engines.llama import LlamaCppEngine
from consumer.runtime import resolve_model

Logits = npt.NDArray[np.float32]


class Probe:
    def __init__(self, model: str, flash_attention: bool) -> None:
        self.eng = LlamaCppEngine(resolve_model(model), recipe="invariant", n_slots=4, ctx_per_session=1280,
                                  flash_attention=flash_attention)
        self.vocab = self.eng.capacity.vocab_size

    def prompt(self, seed: int, n: int) -> list[int]:
        return [int(t) for t in np.random.default_rng(seed).integers(3, self.vocab, n)]

    def prefill(self, pieces: Sequence[tuple[int, Sequence[int], int]]) -> Logits:
        """One step(): (slot, tokens, first position) per session; the last row of each wants logits."""
        rows = [BatchRow(slot, start + i, t, i == len(toks) - 1) for slot, toks, start in pieces
                for i, t in enumerate(toks)]
        return self.eng.step(FusedBatch.from_rows("prefill", rows))

    def split(self, tokens: Sequence[int], cuts: Sequence[int], slot: int = 0, release: bool = True) -> Logits:
        if release:
            self.eng.release(slot)
        pos, out = 0, None
        for c in cuts:
            out = self.prefill([(slot, tokens[pos:pos + c], pos)])
            pos += c
        assert out is not None
        return out[0].copy()

    def decode(self, slot: int, logits: Logits, start: int, n: int,
               others: Sequence[tuple[int, int]] = ()) -> list[Logits]:
        """n greedy decode steps of `slot`; `others` (slot, first position) decode beside it."""
        outs, pos = [logits], start
        for k in range(n):
            rows = [BatchRow(slot, pos, int(np.argmax(logits)), True)]
            rows += [BatchRow(s, p0 + k, 7, True) for s, p0 in others]
            logits = self.eng.step(FusedBatch.from_rows("decode", rows))[0].copy()
            outs.append(logits)
            pos += 1
        return outs


def _d(a: Logits, b: Logits) -> float:
    return float(np.abs(a - b).max())


def run(model: str, flash_attention: bool, seeds: Sequence[int] = (5, 7)) -> dict[str, list[float]]:
    p = Probe(model, flash_attention)
    res: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        res.setdefault(name, []).append(value)

    for seed in seeds:
        prompt = p.prompt(seed, 300)
        base = p.split(prompt[:100], [100])
        for cuts in ([64, 36], [99, 1], [2, 98], [1, 99], [50, 49, 1], [98, 2]):
            add("split " + "+".join(map(str, cuts)), _d(base, p.split(prompt[:100], cuts)))
        for a, b in ((31, 30), (64, 20), (100, 99)):
            alone = p.split(prompt[:a], [a])
            p.eng.release(0)
            p.eng.release(1)
            add(f"2 sessions {a}/{b}", _d(alone, p.prefill([(0, prompt[:a], 0), (1, prompt[100:100 + b], 0)])[0]))
        p.eng.release(0)
        outs = p.decode(0, p.split(prompt[:50], [50]), 50, 20)
        generated = [int(np.argmax(o)) for o in outs[:20]]
        add("replay in 1 call", _d(outs[20], p.split(prompt[:50] + generated, [70])))
        p.split(prompt[:50], [50])
        last = None
        for i, t in enumerate(generated):
            last = p.prefill([(0, [t], 50 + i)])[0]
        assert last is not None
        add("replay 1 row each", _d(outs[20], last))
        alone_steps = p.decode(0, p.split(prompt[:50], [50]), 50, 10)
        long_prompt = p.prompt(seed + 100, 600)
        first = p.split(prompt[:50], [50])
        p.split(long_prompt, [300, 300], slot=1)
        beside = p.decode(0, first, 50, 10, others=[(1, 600)])
        add("decode beside a 600-token co-tenant", max(_d(a, b) for a, b in zip(alone_steps, beside, strict=True)))
        p.eng.release(1)
        alone_steps = p.decode(0, p.split(prompt[:280], [280]), 280, 6)
        first = p.split(prompt[:280], [280])
        p.split(prompt[:10], [10], slot=1)
        beside = p.decode(0, first, 280, 6, others=[(1, 10)])
        add("decode at 280 beside a short co-tenant", max(_d(a, b) for a, b in zip(alone_steps, beside, strict=True)))
        long_prompt = p.prompt(seed + 200, 1000)
        whole = p.split(long_prompt, [1000])
        add("1000 tokens: 512+488", _d(whole, p.split(long_prompt, [512, 488])))
        add("1000 tokens: 64-token calls", _d(whole, p.split(long_prompt, [64] * 15 + [40])))
        p.split(long_prompt, [500, 500], slot=2)
        p.eng.release(2)
        reused = p.split(prompt[:100], [100], slot=2)
        add("slot that held 1000 tokens", _d(reused, p.split(prompt[:100], [100], slot=3)))
    p.eng.close()
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgrtools.invariance_probe", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="tiny, gemma or a GGUF path")
    ap.add_argument("--flash-attention", action="store_true", help="the setting the invariant recipe turns off")
    args = ap.parse_args(argv)
    for name, values in run(args.model, args.flash_attention).items():
        print(f"{args.model} flash_attention={args.flash_attention} {name:40s} "
              + "  ".join(f"{v:.3g}" for v in values))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
