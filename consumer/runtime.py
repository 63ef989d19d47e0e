"""Turning command-line choices into a model file and an engine (shared by the CLI, demo and benches)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from .engines.base import Engine

EngineKind = str  # "llama", "reference" or "sleep:<time>" (e.g. sleep:2ms)
RecipeName = Literal["fast", "invariant"]


def model_dir() -> Path:
    return Path(os.environ.get("DGR_MODEL_DIR") or Path.home() / ".cache" / "dgr" / "models")


def resolve_model(model: str) -> Path:
    """'tiny' (generated here, seeded), 'gemma' (assembled from its PyPI package, sha256-checked), or a path."""
    if model == "tiny":
        from dgrtools.tiny_model import write_tiny_model

        path = model_dir() / "tiny-q8_0-seed0.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            write_tiny_model(tmp)
            tmp.replace(path)
        return path
    if model == "gemma":
        from dgrtools.gemma import assemble_gemma

        return assemble_gemma()
    path = Path(model)
    if not path.is_file():
        raise FileNotFoundError(f"model {model!r}: not 'tiny', 'gemma' or an existing GGUF file")
    return path


def make_engine(model_path: Path, *, kind: EngineKind = "llama", recipe: RecipeName = "invariant",
                n_slots: int = 16, ctx_per_session: int = 1024, n_batch: int = 2048,
                n_threads: int | None = None, n_gpu_layers: int = 0) -> Engine:
    if kind.startswith("sleep:"):  # a stand-in for a GPU step (benchmarks): consumer/engines/sleep.py
        from .engines.sleep import SleepEngine, parse_sleep_spec

        return SleepEngine(parse_sleep_spec(kind), n_slots=n_slots, ctx_per_session=ctx_per_session)
    if kind == "reference":
        from .engines.reference import NumpyReferenceEngine

        return NumpyReferenceEngine(model_path, n_slots=n_slots, ctx_per_session=ctx_per_session)
    from .engines.llama import LlamaCppEngine

    return LlamaCppEngine(model_path, recipe=recipe, n_slots=n_slots, ctx_per_session=ctx_per_session,
                          n_batch=n_batch, n_threads=n_threads, n_gpu_layers=n_gpu_layers)
