"""Turning command-line choices into a model file and an engine (shared by the CLI, demo and benches), or
into several engines for one worker (`--model` given more than once: `model_choices`, `make_engines`)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from schemas.limits import is_id

from .engines.base import Engine
from .engines.engine_set import EngineSet

EngineKind = str  # "llama", "reference" or "sleep:<time>" (e.g. sleep:2ms)
RecipeName = Literal["fast", "invariant"]


def model_dir() -> Path:
    return Path(os.environ.get("DGR_MODEL_DIR") or Path.home() / ".cache" / "dgr" / "models")


TINY_LAYOUTS = {"tiny": "kv", "tiny-recurrent": "recurrent", "tiny-hybrid": "hybrid"}


def resolve_model(model: str) -> Path:
    """'tiny' (generated here, seeded; 'tiny-recurrent', 'tiny-hybrid': the tiny Mamba and Jamba of
    docs/state-layouts.md), 'gemma' (assembled from its PyPI package, sha256-checked), or a path."""
    layout = TINY_LAYOUTS.get(model)
    if layout is not None:
        from dgrtools.tiny_recurrent import write_tiny

        path = model_dir() / ("tiny-q8_0-seed0.gguf" if layout == "kv" else f"tiny-{layout}-q8_0-seed0.gguf")
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            write_tiny(tmp, layout)  # type: ignore[arg-type]
            tmp.replace(path)
        return path
    if model == "gemma":
        from dgrtools.gemma import assemble_gemma

        return assemble_gemma()
    path = Path(model)
    if not path.is_file():
        raise FileNotFoundError(f"model {model!r}: not 'tiny', 'gemma' or an existing GGUF file")
    return path


@dataclass(frozen=True)
class ModelChoice:
    """One engine of a worker, as `--model` names it: `[NAME=]MODEL[,slots=N][,ctx=N][,recipe=R][,weight=W]`.
    Unset fields take the command's own options (`--slots`, `--ctx-per-session`, `--recipe`)."""

    name: str
    model: str
    slots: int | None = None
    ctx_per_session: int | None = None
    recipe: RecipeName | None = None
    weight: int = 1


_FIELDS = {"slots": "slots", "ctx": "ctx_per_session", "weight": "weight", "recipe": "recipe"}


def model_choice(text: str) -> ModelChoice:
    """Parse one `--model` value (ValueError saying what is wrong). The name defaults to the model's
    ('tiny', 'gemma', a file's stem); a path holding ',' cannot be named here (link it elsewhere)."""
    head, *opts = text.strip().split(",")
    name, sep, model = head.partition("=")
    if not sep or not is_id(name):  # no name, or a path holding '='
        name, model = _default_name(head), head
    if not model:
        raise ValueError(f"--model {text!r}: no model")
    fields: dict[str, object] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if key not in _FIELDS or not sep:
            raise ValueError(f"--model {text!r}: {opt!r} is not slots=N, ctx=N, recipe=invariant|fast or weight=W")
        if key == "recipe":
            if value not in ("invariant", "fast"):
                raise ValueError(f"--model {text!r}: recipe must be 'invariant' or 'fast'")
            fields["recipe"] = value
        elif not value.isdigit() or int(value) < 1:
            raise ValueError(f"--model {text!r}: {key} must be an integer >= 1")
        else:
            fields[_FIELDS[key]] = int(value)
    return ModelChoice(name=name, model=model, **fields)  # type: ignore[arg-type]


def _default_name(model: str) -> str:
    stem = Path(model).name.removesuffix(".gguf") if model not in TINY_LAYOUTS and model != "gemma" else model
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", stem)[:64].lstrip("_.-") or "model"


def model_choices(values: Sequence[str]) -> list[ModelChoice]:
    """Every `--model` value, names checked unique (ValueError)."""
    choices = [model_choice(v) for v in values]
    if not choices:
        raise ValueError("no --model given")
    names = [c.name for c in choices]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"two engines named {dup[0]!r}: name them (--model NAME=MODEL)")
    return choices


def make_engines(choices: Sequence[ModelChoice], *, kind: EngineKind = "llama", recipe: RecipeName = "invariant",
                 n_slots: int = 16, ctx_per_session: int = 1024, n_threads: int | None = None,
                 n_gpu_layers: int = 0, cpu_wait: str = "auto",
                 extra_bufts: bool | Literal["auto"] = False) -> EngineSet:
    """One engine per choice, each with its own slots (`EngineSet` refuses two with the same keys). An
    engine already made is closed when a later one fails."""
    made: dict[str, Engine] = {}
    try:
        for c in choices:
            made[c.name] = make_engine(resolve_model(c.model), kind=kind, recipe=c.recipe or recipe,
                                       n_slots=c.slots or n_slots, ctx_per_session=c.ctx_per_session or ctx_per_session,
                                       n_threads=n_threads, n_gpu_layers=n_gpu_layers, cpu_wait=cpu_wait,
                                       extra_bufts=extra_bufts)
        return EngineSet(made, {c.name: c.weight for c in choices})
    except BaseException:
        for eng in made.values():
            eng.close()
        raise


def make_engine(model_path: Path, *, kind: EngineKind = "llama", recipe: RecipeName = "invariant",
                n_slots: int = 16, ctx_per_session: int = 1024, n_batch: int = 2048,
                n_threads: int | None = None, n_gpu_layers: int = 0, cpu_wait: str = "auto",
                extra_bufts: bool | Literal["auto"] = False) -> Engine:
    """`extra_bufts`: llama.cpp's repacked weight buffers; "auto": the recipe's choice (consumer/engines/llama.py)."""
    if kind.startswith("sleep:"):  # a stand-in for a GPU step (benchmarks): consumer/engines/sleep.py
        from .engines.sleep import SleepEngine, parse_sleep_spec

        return SleepEngine(parse_sleep_spec(kind), n_slots=n_slots, ctx_per_session=ctx_per_session)
    if kind == "reference":
        from .engines.reference import NumpyReferenceEngine

        return NumpyReferenceEngine(model_path, n_slots=n_slots, ctx_per_session=ctx_per_session)
    from .engines.llama import LlamaCppEngine

    return LlamaCppEngine(model_path, recipe=recipe, n_slots=n_slots, ctx_per_session=ctx_per_session,
                          n_batch=n_batch, n_threads=n_threads, n_gpu_layers=n_gpu_layers, cpu_wait=cpu_wait,
                          extra_bufts=extra_bufts)
