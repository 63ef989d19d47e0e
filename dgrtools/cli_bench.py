"""`dgr bench ...`: every benchmark command. Each imports its tool (dgrtools/bench/) only when it runs, so
the service never loads the tools (tests/test_service_imports.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from consumer.cli_options import Batches, Models, Out, RecipeOpt, ints

bench_app = typer.Typer(help="Benchmarks: each prints a table and writes JSON + PNG.", no_args_is_help=True)

@bench_app.command("scheduler")
def bench_scheduler(out: Out = Path("bench-out/scheduler"), repeats: int = 60) -> None:
    """One scheduling round for 8, 64 and 1024 active sessions, with and without 10,000 idle ones."""
    from dgrtools.bench.scheduler import run

    run(out, repeats=repeats)


@bench_app.command("rows")
def bench_rows(out: Out = Path("bench-out/rows"), rows: Batches = "8,64,256", calls: int = 96,
               decode_n: Annotated[int, typer.Option("--decode-n")] = 16) -> None:
    """The worker's Python per decode row, stage by stage (chained steady state on continuation jobs, no I/O)."""
    from dgrtools.bench.rows import run

    run(out, rows=tuple(ints(rows)), calls=calls, decode_n=decode_n)


@bench_app.command("requests")
def bench_requests(out: Out = Path("bench-out/requests"), rounds: int = 400) -> None:
    """The CPU of the Redis requests each side makes every fused call, through redis-py's client and on a kept
    connection, and of the worker's hand-over to its I/O thread; alternated in one process, a private redis-server."""
    from dgrtools.bench.requests import run

    run(out, rounds=rounds)


@bench_app.command("pacing")
def bench_pacing(out: Out = Path("bench-out/pacing"), sessions: int = 8,
                 prompt_len: Annotated[int, typer.Option("--prompt-len")] = 528, tokens: int = 16) -> None:
    """Prefill pacing policies on a virtual clock (the real scheduler, a Gemma-like cost model): the last first
    token of a wave against the raw engine's, time to first token, and the decoders' p99 inter-token gap."""
    from dgrtools.bench.pacing import run

    run(out, sessions=sessions, prompt_len=prompt_len, tokens=tokens)


@bench_app.command("engine")
def bench_engine(out: Out = Path("bench-out/engine"), models: Models = "tiny,gemma",
                 recipes: str = "fast,invariant", batches: Batches = "1,2,4,8,16", steps: int = 32, repeats: int = 3,
                 threads: Annotated[int, typer.Option("--threads")] = 0,
                 n_gpu_layers: Annotated[int, typer.Option("--n-gpu-layers")] = 0) -> None:
    """Fused decode tokens/s vs the same sessions one call at a time, per model and recipe."""
    from dgrtools.bench.engine import run

    run(out, models=tuple(models.split(",")), recipes=tuple(recipes.split(",")), batch_sizes=ints(batches),
        steps=steps, threads=threads, n_gpu_layers=n_gpu_layers, repeats=repeats)


@bench_app.command("e2e")
def bench_e2e(out: Out = Path("bench-out/e2e"), model: str = "gemma", batches: Batches = "1,2,4,8,16",
              tokens: int = 64, repeats: int = 2,
              recipe: Annotated[str, typer.Option(help="fast, invariant, or both comma-separated (one run, "
                                                       "invariant/fast reported).")] = "invariant",
              threads: Annotated[int, typer.Option("--threads")] = 0,
              n_gpu_layers: Annotated[int, typer.Option("--n-gpu-layers")] = 0,
              sampling: Annotated[str, typer.Option(help="The sessions' sampling: greedy, typical "
                                                         "(t0.8/k40/p0.95) or top-p (t0.8/p0.95); several "
                                                         "comma-separated: alternated in one run.")] = "greedy",
              decode_n: Annotated[int, typer.Option("--decode-n", min=1, max=64,
                                                    help="Tokens per decode job (the producer's continuation "
                                                         "jobs, default the producer's; 1: one job per token).")
                                  ] = 16,
              engine: Annotated[str, typer.Option(help="llama, or sleep:<time> (e.g. sleep:2ms): an engine that "
                                                       "only sleeps per fused call, a stand-in for a GPU step.")
                                ] = "llama",
              overlap: Annotated[str, typer.Option(help="The consumer's overlap: on, off, both (two consumers, "
                                                        "alternated in one run) or io (on against "
                                                        "--no-overlap-io).")] = "on",
              compare: Annotated[str, typer.Option(help="Options of a second consumer (e.g. \"--sampler-threads "
                                                        "1\"), alternated with the first in this run.")] = "",
              ) -> None:
    """Decode tokens/s through Redis next to the raw fused engine at the same batch, alternating; and the
    prefill tok/s of a 512-token prompt through the service."""
    from dgrtools.bench.e2e import SAMPLINGS, run, run_recipes

    names = tuple(x for x in sampling.split(",") if x)
    if not names or any(x not in SAMPLINGS for x in names):
        raise typer.BadParameter(f"sampling must be among {', '.join(SAMPLINGS)}, not {sampling!r}")
    recipes = tuple(r for r in recipe.split(",") if r)
    if not recipes or any(r not in ("fast", "invariant") for r in recipes):
        raise typer.BadParameter(f"recipes must be fast and/or invariant, not {recipe!r}")
    if engine != "llama":
        from consumer.engines.sleep import parse_sleep_spec

        try:
            parse_sleep_spec(engine)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    if overlap not in ("on", "off", "both", "io"):
        raise typer.BadParameter(f"overlap must be on, off, both or io, not {overlap!r}")
    if compare and overlap not in ("on", "off"):
        raise typer.BadParameter(f"--compare takes --overlap on or off, not {overlap!r}")
    if len(recipes) > 1:
        run_recipes(out, recipes, model=model, batch_sizes=ints(batches), tokens=tokens, repeats=repeats,
                    threads=threads, n_gpu_layers=n_gpu_layers, sampling=sampling, decode_n=decode_n)
        return
    run(out, model=model, batch_sizes=ints(batches), tokens=tokens, repeats=repeats, recipe=recipes[0],
        threads=threads, n_gpu_layers=n_gpu_layers, sampling=sampling, decode_n=decode_n, engine_kind=engine,
        overlap=overlap, compare=tuple(compare.split()))


@bench_app.command("sampler")
def bench_sampler(out: Out = Path("bench-out/sampler"), rows: Batches = "8,64", repeats: int = 5,
                  sampling: Annotated[str, typer.Option(help="Comma-separated: greedy, typical, top-p, min-p-rep, "
                                                             "logprobs, json (json needs --model).")]
                  = "greedy,typical,top-p,min-p-rep,logprobs",
                  threads: Annotated[int, typer.Option(help="Sampler threads of the threaded side.")] = 2,
                  model: Annotated[str, typer.Option(help="A GGUF (or 'gemma') whose vocabulary to use; "
                                                          "default: Gemma's special ids, no grammars.")] = "") -> None:
    """Sampler stage per fused call at Gemma's vocabulary: the serving path (one thread, a pool) vs the oracle."""
    from dgrtools.bench.sampler import SETTINGS, run

    names = tuple(s for s in sampling.split(",") if s)
    if not names or any(s not in SETTINGS for s in names):
        raise typer.BadParameter(f"sampling must be among {', '.join(SETTINGS)}, not {sampling!r}")
    path = None
    if model:
        from consumer.runtime import resolve_model

        path = resolve_model(model)
    run(out, rows=ints(rows), settings=names, repeats=repeats, threads=threads, model=path)


@bench_app.command("interference")
def bench_interference(out: Out = Path("bench-out/interference"), model: str = "gemma", decoders: int = 4,
                       tokens: int = 96, prompt_len: int = 2000, recipe: RecipeOpt = "invariant",
                       threads: Annotated[int, typer.Option("--threads")] = 0) -> None:
    """Decode p50/p99 inter-token latency with and without a steady stream of long prompts."""
    from dgrtools.bench.interference import run

    run(out, model=model, decoders=decoders, tokens=tokens, prompt_len=prompt_len, recipe=recipe, threads=threads)


@bench_app.command("peer")
def bench_peer(out: Out = Path("bench-out/peer"), sessions: int = 8, tokens: int = 64, repeats: int = 3,
               recipe: RecipeOpt = "fast", threads: Annotated[int, typer.Option("--threads")] = 2,
               cache_dir: Annotated[Path | None, typer.Option(help="Where llama-server is built (once).")] = None,
               sampling: Annotated[str, typer.Option(help="Both sides' sampling: greedy, typical (t0.8/k40/p0.95) "
                                                          "or top-p (t0.8/p0.95); request/session i seeded i.")
                                   ] = "greedy",
               no_repack: Annotated[bool, typer.Option("--with-no-repack/--without-no-repack",
                                                       help="Also run a llama-server with --no-repack.")] = True,
               ) -> None:
    """llama.cpp's llama-server (-np, continuous batching) vs dgr on Gemma: same prompts, same tokens."""
    from dgrtools.bench.e2e import SAMPLINGS
    from dgrtools.bench.peer import run

    if sampling not in SAMPLINGS:
        raise typer.BadParameter(f"sampling must be one of {', '.join(SAMPLINGS)}, not {sampling!r}")
    run(out, cache_dir=cache_dir, sessions=sessions, tokens=tokens, repeats=repeats, recipe=recipe,
        threads=threads, sampling=sampling, no_repack=no_repack)


@bench_app.command("serve")
def bench_serve(out: Out = Path("bench-out/serve"), model: str = "gemma", streams: Batches = "8,64", tokens: int = 64,
                repeats: int = 3, threads: Annotated[int, typer.Option("--threads")] = 0,
                llama_server: Annotated[bool, typer.Option("--llama-server/--no-llama-server")] = True,
                quick: Annotated[bool, typer.Option(help="Tiny model, 2 and 4 streams, no llama-server.")] = False,
                recipe: RecipeOpt = "invariant",
                extra: Annotated[str, typer.Option(help="Extra `dgr consumer` options, space-separated "
                                                        "(e.g. \"--repack on\").")] = "",
                no_repack: Annotated[bool, typer.Option("--with-no-repack/--without-no-repack",
                                                        help="Also run a llama-server with --no-repack.")] = False,
                ) -> None:
    """dgr serve's CPU per streamed token and added time to first token against AsyncProducer, and llama-server."""
    from dgrtools.bench.serve import run

    run(out, model=model, streams=ints(streams), tokens=tokens, repeats=repeats, threads=threads,
        llama_server=llama_server, quick=quick, recipe=recipe, extra=extra.split(), no_repack=no_repack)


@bench_app.command("prefill")
def bench_prefill(out: Out = Path("bench-out/prefill"), model: str = "gemma", sessions: int = 8,
                  prompt_len: Annotated[int, typer.Option("--prompt-len")] = 528, tokens: int = 16,
                  repeats: int = 3, recipe: RecipeOpt = "fast", threads: Annotated[int, typer.Option("--threads")] = 2,
                  llama_server: Annotated[bool, typer.Option("--llama-server/--no-llama-server")] = True,
                  extra: Annotated[str, typer.Option(help="Extra `dgr consumer` options, space-separated.")] = "",
                  quick: Annotated[bool, typer.Option(help="Smoke test: tiny model, 4 x 64 tokens, 4 tokens "
                                                           "each, 1 repeat, no llama-server.")] = False,
                  cache_dir: Annotated[Path | None, typer.Option(help="Where llama-server is built (once).")] = None,
                  ) -> None:
    """N concurrent prompts of L tokens through the service, against the raw engine's prefill of the same
    prompts and llama-server (-np N) on the same token ids, in one run."""
    from dgrtools.bench.prefill import run

    if quick:
        model, sessions, prompt_len, tokens, repeats, llama_server = "tiny", 4, 64, 4, 1, False
    run(out, model=model, sessions=sessions, prompt_len=prompt_len, tokens=tokens, repeats=repeats, recipe=recipe,
        threads=threads, llama_server=llama_server, consumer_extra=tuple(extra.split()), cache_dir=cache_dir)


@bench_app.command("report")
def bench_report(root: Annotated[Path, typer.Option(help="Where the benchmark JSON is.")] = Path("bench-out"),
                 out: Annotated[Path, typer.Option(help="The Markdown to write.")] = Path("docs/benchmarks.md"),
                 command: Annotated[str, typer.Option(help="The commands that produced the JSON.")] = "",
                 ) -> None:
    """Write docs/benchmarks.md from the JSON of one benchmark run."""
    from dgrtools.bench.report import write

    typer.echo(str(write(root, out, command or "dgr bench ... --out bench-out/<name>")))


@bench_app.command("scale")
def bench_scale(out: Out = Path("bench-out/scale"), idle: int = 10_000, active: int = 8, calls: int = 300,
                repeats: int = 3,
                sessions: Annotated[str, typer.Option(help="Batch sizes for the worker's time per session per "
                                                           "fused call ('' to skip).")] = "64,128,256",
                session_calls: Annotated[int, typer.Option(help="Fused calls timed per batch size.")] = 100,
                profile: Annotated[bool, typer.Option(help="Also time every stage of the loop and Redis's "
                                                           "CPU per command, per batch size.")] = False) -> None:
    """Worker time per session per fused decode call at 64-256 sessions (overlap off/on), and per call with
    10,000 idle sessions known to it vs none (--idle 0 skips that part)."""
    from dgrtools.bench.scale import run

    run(out, idle=idle, active=active, calls=calls, repeats=repeats, sessions=ints(sessions) if sessions else (),
        session_calls=session_calls, profile=profile)


@bench_app.command("lanes")
def bench_lanes(out: Out = Path("bench-out/lanes"), sessions: int = 8, calls: int = 300, repeats: int = 5) -> None:
    """The worker's own time per fused decode call serving one engine vs three (the same sessions per call),
    and the lane choice alone (docs/state-layouts.md, "Several engines in one worker")."""
    from dgrtools.bench.lanes import run

    run(out, sessions=sessions, calls=calls, repeats=repeats)


@bench_app.command("replay")
def bench_replay(out: Out = Path("bench-out/replay"), model: str = "tiny", sessions: int = 4, generated: int = 64,
                 prompt_len: int = 64,
                 others: Annotated[int, typer.Option(help="Sessions decoding beside the replays.")] = 4) -> None:
    """A replay after a crash: the time to each session's next new token with its generated tokens sampled again in
    decode calls (an invariant recipe, the default), re-fed one row per prefill call (`regenerate=False`), and re-fed
    as one prompt (`fast`)."""
    from dgrtools.bench.replay import main

    main(["--out", str(out), "--model", model, "--sessions", str(sessions), "--generated", str(generated),
          "--prompt-len", str(prompt_len), "--others", str(others)])


@bench_app.command("prefix")
def bench_prefix(out: Out = Path("bench-out/prefix"), sessions: int = 8, waves: int = 3, tokens: int = 16,
                 suffix: int = 16, turns: int = 6, recipe: RecipeOpt = "invariant",
                 quick: Annotated[bool, typer.Option(help="Tiny model, small sizes, no llama-server.")] = False,
                 only: Annotated[str, typer.Option(help="Comma-separated workloads to run (shared-512, "
                                                        "shared-2000, systems-1, systems-4, systems-16, none, "
                                                        "none-2000, chat); all by default.")] = "",
                 llama_server: Annotated[bool, typer.Option("--llama-server/--no-llama-server",
                                                            help="Run llama-server too (built once, cached)."
                                                            )] = True,
                 ) -> None:
    """The prefix cache (docs/prefix-cache.md): shared prefixes of 512 and 2,000 tokens, 1/4/16 system prompts,
    no sharing and a 6-turn conversation; dgr with the cache on and off and llama-server, in one run."""
    from dgrtools.bench.prefix import run

    run(out, quick=quick, sessions=sessions, waves=waves, tokens=tokens, suffix=suffix, turns=turns, recipe=recipe,
        only=[w for w in only.split(",") if w], llama_server=llama_server)


@bench_app.command("producer")
def bench_producer(out: Out = Path("bench-out/producer"), sessions: int = 1000, prompt_len: int = 8, tokens: int = 16,
                   repeats: int = 2,
                   engine: Annotated[str, typer.Option(help="sleep:<t> (a GPU step's stand-in), reference or "
                                                            "llama")] = "sleep:20ms",
                   model: str = "tiny",
                   scale: Annotated[int, typer.Option(help="The CPU runs at N and scale x N sessions.")] = 10,
                   rate: Annotated[float, typer.Option(help="Tokens/s per session of the paced runs.")] = 50.0,
                   paced: Annotated[str, typer.Option(help="Comma-separated sessions of the paced runs.")]
                   = "250,1000,4000") -> None:
    """The Tracker's CPU per token at N and scale x N sessions (sync and async drivers), sessions held at
    `rate` tok/s each, and inter-token latency: AsyncProducer (a task per session) vs run_many."""
    from dgrtools.bench.producer import run

    run(out, sessions=sessions, prompt_len=prompt_len, tokens=tokens, repeats=repeats, engine=engine, model=model,
        scale=scale, rate=rate, paced=ints(paced))


@bench_app.command("wire")
def bench_wire(out: Out = Path("bench-out/wire"), sessions: Batches = "8,64,256",
               step_ms: Annotated[str, typer.Option(help="Comma-separated fused call times of the sleep engine "
                                                         "(ms; 0: no sleep).")] = "0,2,10",
               tokens: int = 128,
               tracker: Annotated[str, typer.Option(help="Comma-separated: sync, async.")] = "sync,async",
               extra: Annotated[str, typer.Option(help="Extra `dgr consumer` options, space-separated.")] = "") -> None:
    """CPU per generated token of the Tracker, Redis and the worker (measured from outside), and e2e tok/s
    against the engine-bound rate, over a sleep engine that stands in for a GPU step (issue 21)."""
    from dgrtools.bench.wire import run

    run(out, ints(sessions), tuple(float(x) for x in step_ms.split(",") if x), tokens,
        tuple(t for t in tracker.split(",") if t), tuple(extra.split()))


@bench_app.command("completion")
def bench_completion(out: Out = Path("bench-out/completion"), rows: Batches = "1,8,64,256", calls: int = 40) -> None:
    """Redis CPU of one completion call per answer (row), in steady state: the completion script alone,
    from Redis' own command statistics."""
    from dgrtools.bench.completion import run

    run(out, ints(rows), calls)


@bench_app.command("durable")
def bench_durable(out: Out = Path("bench-out/durable"), sessions: Batches = "8,64",
                  calls: Annotated[int, typer.Option(help="Completion calls timed per setting and batch size.")] = 2000,
                  ) -> None:
    """What `--durable-replicas 1` (EVALSHA + WAIT 1) costs per completion call against a local replica."""
    from dgrtools.bench.durable import run

    run(out, ints(sessions), calls=calls)


@bench_app.command("fleet")
def bench_fleet(out: Out = Path("bench-out/fleet"),
                cost: Annotated[bool, typer.Option(help="Only what placing a session costs the Tracker (100 workers "
                                                        "x 64 slots, a 512-token prompt; no processes).")] = False,
                quick: Annotated[bool, typer.Option(help="A small fleet and workload (a smoke test).")] = False,
                workers: Annotated[int, typer.Option(help="Workers of the fleet (--cost: of the fleet read).")] = 0,
                row_us: Annotated[float, typer.Option(help="The sleep engine's cost per computed row (0: the "
                                                           "workload's own, 50 µs).")] = 0.0,
                cache_prompts: Annotated[int, typer.Option(help="A worker's prefix cache holds this many saved "
                                                                "prompts (0: no limit).")] = 0,
                sessions: Annotated[int, typer.Option(help="Sessions of the workload (0: its own, 96).")] = 0,
                span_s: Annotated[float, typer.Option(help="Seconds they arrive over (0: its own, 6).")] = 0.0,
                system_len: Annotated[int, typer.Option(help="Tokens of each system prompt (0: its own, 448).")] = 0,
                invariant: Annotated[bool, typer.Option("--invariant/--fast", help="The workers' engine says it is "
                                                        "batch-invariant (exact replays: a replay's generated tokens "
                                                        "sampled again in decode calls) or not, as `fast`.")] = True,
                ) -> None:
    """Placement vs load only vs round-robin vs random on N sleep-engine workers (prefix hit rate, time to first
    token, load balance), the time from a worker's kill -9 to its sessions decoding again; --cost: placement's µs
    per session."""
    from dataclasses import replace

    from dgrtools.bench.fleet import QUICK, Load, run, run_cost

    if cost:
        run_cost(out, workers=workers or 100, repeats=2 if quick else 5)
        return
    load = QUICK if quick else Load()
    load = replace(load, workers=workers or load.workers, row_us=row_us or load.row_us,
                   sessions=sessions or load.sessions, span_s=span_s or load.span_s,
                   system_len=system_len or load.system_len, invariant=invariant)
    if cache_prompts:  # 64 KiB a saved prompt
        load = replace(load, state_bytes=1 << 16, cache_bytes=cache_prompts << 16)
    run(out, load)
