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


def split_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str], first: int, last: int) -> HopFile:
    """Write the hop file of blocks [first, last) of `src` to `dst` (atomically); return its facts."""
    import gguf

    src, dst = Path(src), Path(dst)
    if read_split_info(src) is not None:
        raise ValueError(f"{src} is already a hop file: split the source model")
    r = gguf.GGUFReader(str(src))
    arch = str(r.get_field("general.architecture").contents())  # type: ignore[union-attr]
    n = int(r.get_field(f"{arch}.block_count").contents())  # type: ignore[union-attr]
    if not 0 <= first < last <= n:
        raise ValueError(f"blocks [{first}, {last}) are not a non-empty range inside [0, {n})")
    period = _INDEX_PATTERN_PERIOD.get(arch)
    if period is not None and first % period:
        raise ValueError(f"{arch}: llama.cpp derives sliding-window blocks from the block index (period "
                         f"{period}); a hop must start at a multiple of {period}, not {first}")
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
    out = Path(out_dir)
    return [split_gguf(src, out / f"hop-{a}-{b}.gguf", a, b) for a, b in pairwise(bounds)]
