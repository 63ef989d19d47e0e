"""Options several `dgr` subcommands share (typer annotations), written once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["Batches", "EngineOpt", "HmacKeyFile", "Model", "Models", "Out", "RecipeOpt", "WorkerId", "ints"]

WorkerId = Annotated[str, typer.Option(envvar="DGR_WORKER_ID", help="Worker id: the hash tag of all its keys.")]
Model = Annotated[list[str], typer.Option(
    envvar="DGR_MODEL",
    help="'tiny', 'gemma' or a GGUF path. Give it more than once for one engine per model in this worker, each "
         "with its own streams and slots: [NAME=]MODEL[,slots=N][,ctx=N][,recipe=R][,weight=W] (docs/operations.md).")]
EngineOpt = Annotated[str, typer.Option(envvar="DGR_ENGINE", help="'llama' (llama.cpp) or 'reference' (NumPy).")]
RecipeOpt = Annotated[str, typer.Option(envvar="DGR_RECIPE",
                                        help="'invariant' (bit-identical in any batch) or 'fast'.")]
HmacKeyFile = Annotated[Path | None, typer.Option(
    envvar="DGR_HMAC_KEY_FILE",
    help="HMAC keys, one per line (docs/security.md): sign every entry written / require it on every entry read.")]
Out = Annotated[Path, typer.Option("--out", help="Directory for the JSON and PNG results.")]
Models = Annotated[str, typer.Option(help="Comma-separated: tiny, gemma or GGUF paths.")]
Batches = Annotated[str, typer.Option(help="Comma-separated batch sizes.")]


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)
