"""`dgr consumer`'s options, generated from `ConsumerConfig` (consumer/config.py): a field `name` of any part is
the option `--name` of the field's type and default, with the environment variable `DGR_NAME` and the help its
`setting` gives. A new setting is a field there and nothing here; this module lists only the settings whose
option has another name or shape (kept as they were: tests/test_config.py), and the options that are no setting.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any

import typer

from .cli_options import EngineOpt, HmacKeyFile, Model, RecipeOpt, WorkerId
from .config import DEFAULTS, ConsumerConfig
from .redis_options import (
    RedisClusterFlag,
    RedisSentinel,
    RedisUrl,
    SentinelMaster,
    SentinelPassword,
    SentinelUsername,
)

__all__ = ["config_from", "consumer_options"]

_Threads = Annotated[int, typer.Option("--threads", envvar="DGR_THREADS", help="CPU threads (0: llama.cpp default).")]
_Weights = Annotated[str, typer.Option(envvar="DGR_WEIGHTS", help="WRR weights decode:prefill.")]
_OnLeaseHeld = Annotated[str, typer.Option(
    envvar="DGR_ON_LEASE_HELD", help="Another live consumer has this worker id: 'wait' as a standby and take over "
                                     "when its lease lapses, or 'refuse' (exit 3).")]

# Settings whose option has a name or annotation of its own (shared with other commands); None: set by an option
# of another shape below (the weights, the lease policy) or by the worker's option of the same name.
RENAMED: dict[str, tuple[str, Any] | None] = {
    "service.redis_url": ("redis_url", RedisUrl), "service.redis_sentinel": ("redis_sentinel", RedisSentinel),
    "service.sentinel_master": ("sentinel_master", SentinelMaster),
    "service.sentinel_username": ("sentinel_username", SentinelUsername),
    "service.sentinel_password": ("sentinel_password", SentinelPassword),
    "service.redis_cluster": ("redis_cluster", RedisClusterFlag), "worker.worker_id": ("worker_id", WorkerId),
    "engine.model": ("model", Model), "engine.kind": ("engine", EngineOpt), "engine.recipe": ("recipe", RecipeOpt),
    "engine.threads": ("n_threads", _Threads),
    "worker.w_decode": None, "worker.w_prefill": None, "worker.standby": None,
    "transport.block_ms": None, "transport.gather_ms": None,  # the worker's --block-ms / --gather-ms set both
}
# Options that are no field: (name, annotation, default).
EXTRA: tuple[tuple[str, Any, Any], ...] = (
    ("weights", _Weights, f"{DEFAULTS.worker.w_decode}:{DEFAULTS.worker.w_prefill}"),
    ("on_lease_held", _OnLeaseHeld, "wait" if DEFAULTS.worker.standby else "refuse"),
    ("hmac_key_file", HmacKeyFile, None),
)


def _parts() -> list[tuple[str, type]]:
    return [(part.name, type(getattr(DEFAULTS, part.name))) for part in fields(ConsumerConfig)]


def consumer_options() -> list[inspect.Parameter]:
    """Every option of `dgr consumer`, as the parameters of its command."""
    out: list[inspect.Parameter] = []
    for part, cls in _parts():
        hints = typing.get_type_hints(cls)
        default = getattr(DEFAULTS, part)
        for f in fields(cls):
            key = f"{part}.{f.name}"
            value = getattr(default, f.name)
            if isinstance(value, tuple):
                value = list(value)  # a repeated option's default is a list
            if key in RENAMED:
                named = RENAMED[key]
                if named is not None:
                    out.append(inspect.Parameter(named[0], inspect.Parameter.KEYWORD_ONLY, default=value,
                                                 annotation=named[1]))
                continue
            option = typer.Option(envvar=f"DGR_{f.name.upper()}", help=f.metadata.get("help"),
                                  **f.metadata.get("option", {}))
            out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=value,
                                         annotation=Annotated[hints[f.name], option]))
    out += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a) for name, a, d in EXTRA]
    return out


def config_from(values: dict[str, Any]) -> tuple[ConsumerConfig, Path | None]:
    """The ConsumerConfig the options' values say, and the HMAC key file; BadParameter for values no setting
    takes."""
    if values["on_lease_held"] not in ("wait", "refuse"):
        raise typer.BadParameter("must be 'wait' or 'refuse'", param_hint="--on-lease-held")
    try:
        w_decode, w_prefill = (int(x) for x in values["weights"].split(":"))
    except ValueError:
        raise typer.BadParameter("must be DECODE:PREFILL, two integers", param_hint="--weights") from None
    derived: dict[str, Any] = {
        "worker.w_decode": w_decode, "worker.w_prefill": w_prefill, "worker.standby": values["on_lease_held"] == "wait",
        "worker.heartbeat_s": min(values["heartbeat_s"], values["lease_ms"] / 4000),  # renewed well inside the lease
        "transport.block_ms": values["block_ms"], "transport.gather_ms": values["gather_ms"],
    }
    parts: dict[str, Any] = {}
    for part, cls in _parts():
        kw: dict[str, Any] = {}
        for f in fields(cls):
            key = f"{part}.{f.name}"
            if key in derived:
                kw[f.name] = derived[key]
                continue
            named = RENAMED.get(key)
            value = values[named[0] if named is not None else f.name]
            kw[f.name] = tuple(value) if isinstance(value, list) else value
        parts[part] = cls(**kw)
    return ConsumerConfig(**parts), values["hmac_key_file"]


def with_consumer_options(run: Callable[[ConsumerConfig, Path | None], None]) -> Callable[..., None]:
    """`run(config, hmac_key_file)` as a typer command whose options are `consumer_options()`."""
    params = consumer_options()

    def command(**values: Any) -> None:
        run(*config_from(values))

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__, command.__name__ = run.__doc__, run.__name__
    return command
