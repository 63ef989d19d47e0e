"""Cut a GGUF model into route hops: a hop file holds blocks [first, last) of its source model.

The hop file is the source with every metadata key and every non-block tensor kept, only the tensors
`blk.first` .. `blk.(last-1)` kept and renumbered from `blk.0`, `<arch>.block_count` set to last - first,
and `dgr.split.*` keys saying where it sits (consumer/engines/loader.py reads them). Stock llama.cpp
loads it as a model of last - first blocks (notes: ../shared/notes/hops.md).

Per-block metadata must survive the renumbering:
- arrays under `<arch>.` with one entry per source block (per-layer head counts, a per-layer
  sliding-window pattern) are sliced to [first, last);
- Gemma 3 (`gemma3`): llama.cpp derives which blocks use sliding-window attention from the block index
  (every 6th block, 5, 11, 17..., is global), and the pattern also picks the block's rope base. A hop
  starting at a multiple of 6 keeps it; any other cut is refused (ValueError) rather than run wrong.

Recurrent and hybrid models (docs/state-layouts.md "Route hops"): a block's recurrent state belongs to
the block, so a hop keeps the cells of its own blocks and the cut is exact at any block boundary.
- Recurrent archs (Mamba, Mamba-2, RWKV): any cut.
- Hybrids whose block i is recurrent when `<arch>.attention.head_count_kv[i] == 0` (Jamba, Granite 4.0-H,
  LFM2, PLaMo 2...): llama.cpp builds a hybrid context with a KV cache AND recurrent cells, and aborts
  the process (GGML_ASSERT) when a hop holds no block of one kind. Such a cut is refused (ValueError);
  every hop must hold at least one attention and one recurrent block.
- Falcon-H1 (every block has both): any cut. Other hybrids (their block kinds come from an index
  interval or other keys dgr does not read): refused, whatever the cut.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from consumer.engines.loader import (
    SPLIT_FIRST_BLOCK,
    SPLIT_LAST_BLOCK,
    SPLIT_SOURCE_BLOCK_COUNT,
    SPLIT_SOURCE_SHA256,
    gguf_sha256,
    read_split_info,
)

# Architectures whose per-block attention kind llama.cpp derives from the block index, with the period
# (llama_hparams::set_swa_pattern(n): block il is sliding-window unless il % n == n - 1).
_INDEX_PATTERN_PERIOD: dict[str, int] = {"gemma3": 6}

# llama.cpp (0.3.36) llm_arch_is_hybrid, by how src/models/<arch>.cpp marks a block recurrent.
_HYBRID_BY_KV_HEADS = frozenset({"jamba", "granitehybrid", "lfm2", "lfm2moe", "plamo2", "bailingmoe3",
                                 "kimi-linear", "kimi-k3", "glm5-next"})  # recurrent: head_count_kv[i] == 0
_HYBRID_EVERY_BLOCK = frozenset({"falcon-h1"})  # attention and a Mamba-2 mixer in every block
_HYBRID_OTHER = frozenset({"nemotron_h", "nemotron_h_moe", "qwen3next", "qwen35", "qwen35moe", "qwen4exp",
                           "deepseek4", "minimax-01"})  # index intervals, or n_ff too: not split


def check_hybrid_cut(arch: str, head_count_kv: int | list[int], n: int, first: int, last: int) -> None:
    """Raise ValueError when blocks [first, last) of a hybrid model would not load as a hop."""
    if arch in _HYBRID_OTHER:
        raise ValueError(f"{arch}: a hybrid whose recurrent blocks llama.cpp finds from more than the KV head "
                         "counts; dgr does not split it")
    if arch in _HYBRID_EVERY_BLOCK or arch not in _HYBRID_BY_KV_HEADS:
        return
    kv = list(head_count_kv) if isinstance(head_count_kv, list) else [head_count_kv] * n
    kinds = {"recurrent" if h == 0 else "attention" for h in kv[first:last]}
    if kinds != {"recurrent", "attention"}:
        missing = ({"recurrent", "attention"} - kinds).pop()
        raise ValueError(f"{arch}: blocks [{first}, {last}) hold no {missing} block; llama.cpp's hybrid "
                         "memory needs both kinds in every hop (it aborts creating the context): cut so that "
                         "each hop holds at least one attention and one recurrent block")


@dataclass(frozen=True, slots=True)
class HopFile:
    path: Path
    sha256: str  # of the hop file itself
    source_sha256: str
    first_block: int
    last_block: int  # exclusive
    source_block_count: int


def source_block_count(path: str | os.PathLike[str]) -> int:
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = str(r.get_field("general.architecture").contents())  # type: ignore[union-attr]
    return int(r.get_field(f"{arch}.block_count").contents())  # type: ignore[union-attr]


def check_cut(r: Any, src: Path, first: int, last: int, *, allow_pattern_shift: bool = False) -> tuple[str, int]:
    """(arch, source block count) when blocks [first, last) of the model `r` (a GGUFReader of `src`) make
    a hop that runs right; ValueError (saying why) otherwise."""
    if read_split_info(src) is not None:
        raise ValueError(f"{src} is already a hop file: split the source model")
    arch = str(r.get_field("general.architecture").contents())
    n = int(r.get_field(f"{arch}.block_count").contents())
    if not 0 <= first < last <= n:
        raise ValueError(f"blocks [{first}, {last}) are not a non-empty range inside [0, {n})")
    kv_field = r.get_field(f"{arch}.attention.head_count_kv")
    check_hybrid_cut(arch, kv_field.contents() if kv_field is not None else 0, n, first, last)
    period = _INDEX_PATTERN_PERIOD.get(arch)
    if period is not None and first % period and not allow_pattern_shift:
        raise ValueError(f"{arch}: llama.cpp derives sliding-window blocks from the block index (period "
                         f"{period}); a hop must start at a multiple of {period}, not {first}")
    return arch, n


def split_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str], first: int, last: int, *,
               allow_pattern_shift: bool = False) -> HopFile:
    """Write the hop file of blocks [first, last) of `src` to `dst` (atomically); return its facts.

    `allow_pattern_shift=True` writes a cut that shifts an index-derived attention pattern anyway: a
    wrong model, for the test that shows the refusal matters."""
    import gguf

    src, dst = Path(src), Path(dst)
    r = gguf.GGUFReader(str(src))
    arch, n = check_cut(r, src, first, last, allow_pattern_shift=allow_pattern_shift)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    try:
        w = gguf.GGUFWriter(str(tmp), arch)
        for name, f in r.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            if name == f"{arch}.block_count":
                w.add_uint32(name, last - first)
                continue
            vtype = f.types[0]
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            value: Any = f.contents()
            if sub is not None and sub != gguf.GGUFValueType.STRING and name.startswith(f"{arch}.") \
                    and isinstance(value, list) and len(value) == n:
                value = value[first:last]  # one entry per block
            w.add_key_value(name, value, vtype, sub_type=sub)
        w.add_string(SPLIT_SOURCE_SHA256, gguf_sha256(src))
        w.add_uint32(SPLIT_FIRST_BLOCK, first)
        w.add_uint32(SPLIT_LAST_BLOCK, last)
        w.add_uint32(SPLIT_SOURCE_BLOCK_COUNT, n)
        for t in r.tensors:
            tname = t.name
            if tname.startswith("blk."):
                i = int(tname.split(".")[1])
                if not first <= i < last:
                    continue
                tname = f"blk.{i - first}." + tname.split(".", 2)[2]
            w.add_tensor(tname, t.data, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
    info = read_split_info(dst)
    assert info is not None
    return HopFile(path=dst, sha256=gguf_sha256(dst), source_sha256=info.source_sha256,
                   first_block=first, last_block=last, source_block_count=n)


def split_route(src: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                cuts: tuple[int, ...]) -> list[HopFile]:
    """Every hop of a route cut at `cuts` (e.g. (6, 12) gives [0,6), [6,12), [12,n)), written to
    `out_dir/hop-<first>-<last>.gguf`. The helper tests use to build 2- and 3-hop routes."""
    n = source_block_count(src)
    bounds = (0, *cuts, n)
    if any(b >= c for b, c in pairwise(bounds)):
        raise ValueError(f"cuts {cuts} must be increasing inside (0, {n})")
    import gguf

    r = gguf.GGUFReader(str(src))
    for a, b in pairwise(bounds):  # every hop checked before any is written
        check_cut(r, Path(src), a, b)
    out = Path(out_dir)
    return [split_gguf(src, out / f"hop-{a}-{b}.gguf", a, b) for a, b in pairwise(bounds)]


# ------------------------------------------------------------------------------------- benchmark
def bench_route_decode(model: str | os.PathLike[str], cuts: tuple[int, ...], *, sessions: int = 8,
                       steps: int = 16, prompt_len: int = 32, repeats: int = 3, n_threads: int | None = None,
                       out_dir: str | os.PathLike[str] | None = None, seed: int = 0) -> dict[str, Any]:
    """Decode engine time per step at `sessions` sessions: the whole model (one hop) vs the route cut at
    `cuts` (each hop's own engine time), llama.cpp "invariant" recipe, one fused call per hop per step.

    The two sides alternate `repeats` times on identical work (same prompts, greedy tokens of the whole
    model fed to both) and each keeps its fastest run: on a shared machine compare the ratio of one run.
    Also checks that every step's logits are bit-identical on both sides.
    """
    import tempfile
    import time

    import numpy as np

    from consumer.batch import BatchRow, FusedBatch
    from consumer.engines.llama import LlamaCppEngine

    tmp = tempfile.TemporaryDirectory() if out_dir is None else None
    where = Path(out_dir) if out_dir is not None else Path(tmp.name)  # type: ignore[union-attr]
    hops = split_route(model, where, cuts)
    ctx = max(256, prompt_len + steps + 1)
    kw: dict[str, Any] = dict(recipe="invariant", n_slots=sessions, ctx_per_session=ctx, n_threads=n_threads)
    whole = LlamaCppEngine(model, **kw)
    route = [LlamaCppEngine(h.path, **kw) for h in hops]
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, whole.capacity.vocab_size, size=(sessions, prompt_len))

    def run(engines: list[LlamaCppEngine], rows: list[BatchRow], phase: str, clock: list[float]) -> Any:
        hidden = None
        for k, eng in enumerate(engines):
            t0 = time.perf_counter()
            out = eng.forward(FusedBatch.from_rows(phase, rows, hidden))  # type: ignore[arg-type]
            clock[k] += time.perf_counter() - t0
            hidden = out.rows
        return hidden

    def play(engines: list[LlamaCppEngine],
             tokens: list[list[int]] | None) -> tuple[list[float], list[Any], list[list[int]]]:
        for eng in engines:
            for s in range(sessions):
                eng.release(s)
        rows = [BatchRow(s, p, int(prompts[s, p]), p == prompt_len - 1) for s in range(sessions)
                for p in range(prompt_len)]
        nxt = np.argmax(run(engines, rows, "prefill", [0.0] * len(engines)), axis=1)
        clock = [0.0] * len(engines)
        logits, fed = [], []
        for k in range(steps):
            feed = tokens[k] if tokens is not None else [int(t) for t in nxt]
            fed.append(feed)
            rows = [BatchRow(s, prompt_len + k, feed[s], True) for s in range(sessions)]
            lg = run(engines, rows, "decode", clock)
            logits.append(lg)
            nxt = np.argmax(lg, axis=1)
        return clock, logits, fed

    best_whole, best_route = [float("inf")], [float("inf")] * len(route)
    exact = True
    try:
        for _ in range(max(1, repeats)):
            cw, lw, fed = play([whole], None)
            cr, lr, _ = play(route, fed)
            exact = exact and all(np.array_equal(a, b) for a, b in zip(lw, lr, strict=True))
            best_whole = [min(best_whole[0], cw[0])]
            if sum(cr) < sum(best_route):
                best_route = cr
    finally:
        for eng in [whole, *route]:
            eng.close()
        if tmp is not None:
            tmp.cleanup()
    n_embd = whole.boundary.hidden_size or int(route[0].boundary.hidden_size)
    return {
        "sessions": sessions, "steps": steps, "cuts": list(cuts),
        "whole_step_ms": 1000 * best_whole[0] / steps,
        "hop_step_ms": [1000 * c / steps for c in best_route],
        "route_step_ms": 1000 * sum(best_route) / steps,
        "route_over_whole": sum(best_route) / best_whole[0],
        "boundary_bytes_per_session_step": n_embd * 4,  # f32 activations, per hop boundary crossed
        "boundaries": len(cuts),
        "logits_bit_identical": exact,
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m dgrtools.split_model MODEL --cuts 6[,12] [--sessions 8] [--steps 16]`: the decode
    benchmark above, printed as JSON."""
    import argparse
    import json

    from consumer.runtime import resolve_model

    ap = argparse.ArgumentParser(prog="python -m dgrtools.split_model")
    ap.add_argument("model", help="'tiny', 'gemma' or a GGUF path")
    ap.add_argument("--cuts", required=True, help="block indices where the route is cut, e.g. 6 or 6,12")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("GGML_CPU_TILED_MM", "0")
    res = bench_route_decode(resolve_model(args.model), tuple(int(x) for x in args.cuts.split(",")),
                             sessions=args.sessions, steps=args.steps, prompt_len=args.prompt_len,
                             repeats=args.repeats, n_threads=args.threads)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
