"""Engine factory, and the small GGUF facts every engine needs (file hash, quantization name).

The engine modules import these helpers; the factory imports the engines lazily, so importing this
module never loads llama.cpp.
"""

from __future__ import annotations

import hashlib
import os
import threading
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
