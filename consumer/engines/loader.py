"""Engine factory, and the small GGUF facts every engine needs (file hash, quantization name).

The engine modules import these helpers; the factory imports the engines lazily, so importing this
module never loads llama.cpp.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

_SHA_CACHE: dict[tuple[str, int, int], str] = {}
_SHA_LOCK = threading.Lock()

# llama_ftype values (llama.h) -> the names llama-quantize uses. gguf.LlamaFileType has the same values.
_FTYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}


def ftype_name(ftype: int) -> str:
    """The quantization name of a GGUF `general.file_type` value ("Q8_0", "Q4_K_M", "F32"...)."""
    return _FTYPE_NAMES.get(int(ftype) & ~1024, f"FTYPE_{int(ftype)}")  # 1024: LLAMA_FTYPE_GUESSED


def gguf_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 hex of a file, computed once per (path, mtime, size) in this process."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_mtime_ns, st.st_size)
    with _SHA_LOCK:
        hit = _SHA_CACHE.get(key)
    if hit is not None:
        return hit
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    digest = h.hexdigest()
    with _SHA_LOCK:
        _SHA_CACHE[key] = digest
    return digest


# ------------------------------------------------------------------------------------- hop files
# Metadata a hop file (dgrtools/split_model.py, `dgr model split`) carries: which model it was cut from
# and which ABSOLUTE blocks [first, last) of it it holds. The blocks themselves are renumbered from 0.
SPLIT_SOURCE_SHA256 = "dgr.split.source_sha256"
SPLIT_FIRST_BLOCK = "dgr.split.first_block"
SPLIT_LAST_BLOCK = "dgr.split.last_block"
SPLIT_SOURCE_BLOCK_COUNT = "dgr.split.source_block_count"


@dataclass(frozen=True, slots=True)
class SplitInfo:
    """A hop file's place in its source model."""

    source_sha256: str
    first_block: int
    last_block: int  # exclusive
    source_block_count: int

    @property
    def is_first(self) -> bool:
        return self.first_block == 0

    @property
    def is_last(self) -> bool:
        return self.last_block == self.source_block_count


def read_split_info(path: str | os.PathLike[str]) -> SplitInfo | None:
    """The `dgr.split.*` metadata of a GGUF, or None for a whole model. Raises ValueError when it is
    present but inconsistent (a hop file must say exactly where it sits)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {k: reader.get_field(k) for k in (SPLIT_SOURCE_SHA256, SPLIT_FIRST_BLOCK, SPLIT_LAST_BLOCK,
                                               SPLIT_SOURCE_BLOCK_COUNT)}
    if all(f is None for f in fields.values()):
        return None
    missing = [k for k, f in fields.items() if f is None]
    if missing:
        raise ValueError(f"{path}: hop metadata incomplete, missing {missing}")
    sha = str(fields[SPLIT_SOURCE_SHA256].contents())  # type: ignore[union-attr]
    first = int(fields[SPLIT_FIRST_BLOCK].contents())  # type: ignore[union-attr]
    last = int(fields[SPLIT_LAST_BLOCK].contents())  # type: ignore[union-attr]
    n = int(fields[SPLIT_SOURCE_BLOCK_COUNT].contents())  # type: ignore[union-attr]
    if not re.fullmatch(r"[0-9a-f]{64}", sha) or not 0 <= first < last <= n:
        raise ValueError(f"{path}: bad hop metadata sha256={sha!r} blocks [{first}, {last}) of {n}")
    return SplitInfo(source_sha256=sha, first_block=first, last_block=last, source_block_count=n)
