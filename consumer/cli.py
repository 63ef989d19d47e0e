"""`dgr`: one console script, one subcommand per job. Imports are lazy so `dgr --help` is instant.

`main` is the console script: a user's mistake (a bad option value, a model file missing, unreadable or not a
GGUF, a malformed Redis URL) is one line on stderr and exit status 2, without a traceback; `--debug`, anywhere
on the line, shows it."""

from __future__ import annotations

import gc
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import fields
from functools import cache, partial
from pathlib import Path
from typing import Annotated, Literal

import typer

from .cli_config import with_consumer_options
from .config import DEFAULTS, ConsumerConfig, ServiceSettings
from .engines.compute import on_compute_thread
from .redis_options import (
    RedisUrl,
    target,
)

app = typer.Typer(help="dgr: continuous decode batching for GGUF workers over Redis Streams. "
                       "Add --debug anywhere to see the traceback of an error.",
                  no_args_is_help=True, pretty_exceptions_enable=False)

_S, _E, _W, _T = DEFAULTS.service, DEFAULTS.engine, DEFAULTS.worker, DEFAULTS.transport
_GC_YOUNG = next(f for f in fields(ServiceSettings) if f.name == "gc_young")  # dgr serve's option: the same setting
# --repack: the engine's `extra_bufts`
REPACK: dict[str, bool | Literal["auto"]] = {"off": False, "on": True, "auto": "auto"}



def _logging(level: str, fmt: str, llama_log: str = "debug") -> None:
    from .logs import setup_logging

    setup_logging(level, fmt)
    if llama_log.lower() != "info":
        logging.getLogger("dgr.llama").addFilter(_llama_info_at_debug)


def _llama_info_at_debug(record: logging.LogRecord) -> bool:
    """llama.cpp's INFO lines (~60 loader lines at every start) logged at DEBUG: shown with --log-level DEBUG
    (or --llama-log info); its warnings and errors as they are."""
    if record.levelno == logging.INFO:
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)
    return True


def _redis_url(url: str) -> None:
    """A malformed --redis-url is a usage error here, not a traceback at the first connection."""
    from redis.connection import parse_url

    try:
        parse_url(url)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--redis-url") from None


def young_gc(threshold: int) -> None:
    """The youngest generation collected every `threshold` allocations (0: left as Python set it), the startup's
    garbage collected first. Process-wide: the commands that serve (`dgr consumer`, `dgr serve`) call it, never
    the library."""
    if threshold > 0:
        gc.collect()
        gc.set_threshold(threshold, *gc.get_threshold()[1:])


def consumer(config: ConsumerConfig, hmac_key_file: Path | None) -> None:
    """Run one batching consumer (one per GPU): read step jobs, run fused calls, publish results."""
    from schemas import EngineError, Signer

    from .connect import connect
    from .engines.cpu_wait import CPU_WAITS
    from .metrics import Metrics
    from .runtime import make_engines, model_choices
    from .transport import EvictingRedis, LeaseHeld, LeaseLost, RedisTransport
    from .worker import Worker

    if config.engine.cpu_wait not in CPU_WAITS:
        raise typer.BadParameter(f"must be one of {', '.join(CPU_WAITS)}", param_hint="--cpu-wait")
    if config.engine.repack not in REPACK:
        raise typer.BadParameter(f"must be one of {', '.join(REPACK)}", param_hint="--repack")
    repack = REPACK[config.engine.repack]
    from schemas.prefix import SCOPES

    if config.worker.prefix_cache_scope not in SCOPES:
        raise typer.BadParameter(f"must be one of {', '.join(SCOPES)}", param_hint="--prefix-cache-scope")
    svc, eng_s = config.service, config.engine
    if svc.llama_log.lower() not in ("debug", "info"):
        raise typer.BadParameter("must be 'debug' or 'info'", param_hint="--llama-log")
    _redis_url(svc.redis_url)
    redis_target = target(svc.redis_url, svc.redis_sentinel, svc.sentinel_master, svc.sentinel_username,
                          svc.sentinel_password, svc.redis_cluster)
    _logging(svc.log_level, svc.log_format, svc.llama_log)
    try:
        signer = Signer.from_file(hmac_key_file) if hmac_key_file else None
    except (OSError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--hmac-key-file") from None
    try:
        choices = model_choices(eng_s.model)
        if "invariant" in {c.recipe or eng_s.recipe for c in choices}:
            os.environ.setdefault("GGML_CPU_TILED_MM", "0")  # ggml reads it once, at the first K-quant matmul
        # One engine per --model, each with its own slots; the worker serves them all (one lane each).
        # Built on the thread that runs the fused calls (overlap on): llama.cpp's threads then form one
        # OpenMP team, not two (consumer/engines/compute.py).
        build = partial(make_engines, choices, kind=eng_s.kind, recipe=eng_s.recipe,  # type: ignore[arg-type]
                        n_slots=eng_s.slots, ctx_per_session=eng_s.ctx_per_session, n_threads=eng_s.threads or None,
                        n_gpu_layers=eng_s.n_gpu_layers, cpu_wait=eng_s.cpu_wait, extra_bufts=repack)
        eng = on_compute_thread(build) if config.worker.overlap else build()
    except (ValueError, OSError, EngineError) as e:
        # a bad --model (missing, unreadable, not a GGUF llama.cpp loads), two models with the same keys (EngineSet)
        raise typer.BadParameter(str(e), param_hint="--model") from None
    metrics = Metrics(config.worker.worker_id)
    if svc.metrics_port:
        metrics.serve(svc.metrics_port, svc.metrics_addr)
    # Timeouts so that a dead or unreachable Redis is noticed (and ridden through) instead of hanging
    # a socket; the read timeout stays far above the blocking read's BLOCK.
    client = connect(redis_target, socket_connect_timeout=5, socket_timeout=30)
    # A RedisCluster client too (every key of a worker is in one slot: tests/test_cluster.py)
    worker_id = config.worker.worker_id
    transport = RedisTransport(client, worker_id, consumer_name=worker_id,  # type: ignore[arg-type]
                               settings=config.transport, signer=signer, listener=metrics)
    worker = Worker(eng, transport, config.worker, metrics)
    worker.install_signal_handlers()
    young_gc(svc.gc_young)
    try:
        worker.run(max_idle_s=svc.max_idle_s or None)
    except (LeaseHeld, EvictingRedis) as e:
        logging.getLogger("dgr.worker").error("refusing to start: %s", e, extra={"worker": config.worker.worker_id})
        raise typer.Exit(3) from None
    except LeaseLost as e:
        logging.getLogger("dgr.worker").error("stopped: %s", e, extra={"worker": config.worker.worker_id})
        raise typer.Exit(3) from None
    finally:
        eng.close()


app.command("consumer")(with_consumer_options(consumer))


@app.command()
def serve(
    model: Annotated[list[str], typer.Option(envvar="DGR_MODEL", help="[NAME=]MODEL served by that name: 'tiny', "
                                             "'gemma' or a GGUF path (the workers' file). Repeat for several.")],
    redis_url: RedisUrl = _S.redis_url,
    host: Annotated[str, typer.Option(envvar="DGR_SERVE_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="DGR_SERVE_PORT")] = 8000,
    chat_template: Annotated[str, typer.Option(help="A built-in template (gemma, chatml, tiny) or a jinja file, "
                                                    "instead of the GGUF's.")] = "",
    api_keys: Annotated[Path | None, typer.Option(envvar="DGR_API_KEYS_FILE", help="Lines `KEY ACCOUNT`: "
                                                  "bearer keys required, each billing its account.")] = None,
    max_body_bytes: Annotated[int, typer.Option(help="Larger request bodies are refused (413).")] = 1 << 20,
    max_lag: Annotated[int, typer.Option(help="A worker's prefill lag past this answers 429.")] = 10_000,
    head_timeout_s: Annotated[float, typer.Option(help="A request's head must arrive within this of the connection's "
                                                  "start or last answer (else closed; 408 if part came).")] = 10.0,
    max_head_bytes: Annotated[int, typer.Option(help="Larger request heads (URL and headers) are refused (431).")
                              ] = 64 << 10,
    body_timeout_s: Annotated[float, typer.Option(help="A request's body must arrive within this (408).")] = 30.0,
    write_timeout_s: Annotated[float, typer.Option(help="A client that reads nothing of its answer for this long "
                                                   "is dropped (its sessions cancelled).")] = 60.0,
    max_connections: Annotated[int, typer.Option(help="Connections past this many are answered 503 and closed "
                                                 "(0: the descriptor limit less 256).", min=0)] = 0,
    gc_young: Annotated[int, typer.Option(envvar="DGR_GC_YOUNG", min=0, help=_GC_YOUNG.metadata["help"])
                        ] = _S.gc_young,
) -> None:
    """An OpenAI-compatible HTTP API over the fleet (docs/serve.md; the `serve` extra)."""
    from gateway.guard import ClientBounds
    from gateway.main import serve as run_serve

    young_gc(gc_young)
    bounds = ClientBounds(head_timeout_s=head_timeout_s, max_head_bytes=max_head_bytes, body_timeout_s=body_timeout_s,
                          write_timeout_s=write_timeout_s, max_connections=max_connections or None)
    run_serve(redis_url, model, host=host, port=port, chat_template=chat_template or None, api_keys_file=api_keys,
              max_body_bytes=max_body_bytes, max_lag=max_lag, bounds=bounds)


def _register_ops() -> None:
    from .ops.cli import register

    register(app)


_register_ops()


@cache
def command_line() -> typer.Typer:
    """The whole `dgr` command: the service's commands (this module, consumer/ops/cli.py) and the tools'
    (demo, model, bench, tracker-sim, evidence: dgrtools/cli.py), added on first use (once) so that importing
    the service loads no tool (tests/test_service_imports.py)."""
    try:
        from dgrtools.cli import register
    except ImportError:  # pragma: no cover  (a service-only install)
        return app
    register(app)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    """The console script `dgr`: a usage error is one line on stderr and exit status 2 (`--debug`: with its
    traceback); the command's own exit status otherwise."""
    try:  # typer >= 0.24 carries its own click
        from typer._click import exceptions as cx
    except ImportError:  # pragma: no cover
        from click import exceptions as cx  # type: ignore[no-redef]

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    try:
        rc = command_line()(args=args, prog_name="dgr", standalone_mode=False)
    except cx.NoArgsIsHelpError as e:
        e.show()
        return 2
    except cx.UsageError as e:
        if debug:
            traceback.print_exc()
        where = e.ctx.command_path if e.ctx is not None else "dgr"
        print(f"{where}: error: {' '.join(e.format_message().split())}", file=sys.stderr)
        return 2
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
