"""`dgr demo`: a private redis-server, one consumer process, N concurrent sessions streamed live."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import redis
from rich.console import Console
from rich.live import Live
from rich.table import Table

from consumer.connect import RedisTarget, connect, master_url
from consumer.ops.common import sdict
from producer import SessionHandle
from schemas import RouteHop, Sampling, SessionSpec, StepResult, WorkerKeys

from .localredis import INSTALL_HINT, LocalRedis, RedisNotFound
from .process import ConsumerProcess

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "The three laws of thermodynamics are",
    "A good way to learn a new programming language is",
    "Once upon a time, in a small village,",
    "The main difference between a list and a tuple in Python is",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "Photosynthesis is the process by which",
    "The best advice I ever received was",
    "In 1969, the first humans to walk on the Moon",
    "A recipe for pancakes: mix",
    "The key idea behind continuous batching is",
    "My favourite book is",
    "The weather forecast for tomorrow says",
    "To fix a flat bicycle tyre,",
]
WORKER_ID = "demo"


def wait_for_worker(client: redis.Redis, worker_id: str, timeout_s: float = 300.0) -> None:
    keys = WorkerKeys(worker_id)
    deadline = time.monotonic() + timeout_s
    while not (client.exists(keys.heartbeat) and client.exists(keys.spec)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {worker_id!r} did not advertise within {timeout_s:.0f} s")
        time.sleep(0.1)


# The demo samples (issue 15): greedy text of a 270M model loops and reads badly. Each session draws from
# its own seed, so a run is reproducible; `--temperature 0` gives greedy sessions. A repetition penalty
# over the last 64 tokens keeps the texts from repeating whole sentences, and Gemma's image and HTML tag
# tokens (USER_DEFINED in its vocabulary, so not masked as special: docs/sampling.md) are banned: measured
# on 16 demo prompts x 64 tokens, seeds 0 and 100, the repeated 4-grams fall from 0.04-0.12 to 0.00 and the
# three <start_of_image> tokens are gone.
DEMO_TEMPERATURE = 0.8
DEMO_TOP_P = 0.95
DEMO_REPETITION_PENALTY = 1.15


def markup_tokens(model_path: Path) -> tuple[int, ...]:
    """The ids a reader does not want in plain text: USER_DEFINED tokens that are a `<tag>` or
    `[multimodal]` (Gemma 3: `<start_of_image>`, `<end_of_image>`, its HTML tags). None in the tiny model."""
    import gguf

    reader = gguf.GGUFReader(str(model_path))
    types, tokens = reader.fields.get("tokenizer.ggml.token_type"), reader.fields.get("tokenizer.ggml.tokens")
    if types is None or tokens is None:
        return ()
    out = []
    for i, (t, p) in enumerate(zip(types.data, tokens.data, strict=True)):
        text = bytes(tokens.parts[p]).decode("utf-8", errors="replace")
        if int(types.parts[t][0]) == 4 and (text == "[multimodal]" or (text.startswith("<") and text.endswith(">"))):
            out.append(i)
    return tuple(out)


def demo_sampling(i: int, temperature: float, top_p: float, banned: Sequence[int] = ()) -> Sampling:
    """Session i's sampling: temperature / top_p as given, seed i (greedy when temperature is 0), the demo's
    repetition penalty, `banned` never sampled."""
    return Sampling(temperature=temperature, top_p=top_p, seed=i, repetition_penalty=DEMO_REPETITION_PENALTY,
                    banned_token_ids=tuple(banned))


def sampling_statement(temperature: float, top_p: float, banned: Sequence[int]) -> str:
    mode = "greedy" if temperature == 0 else f"temperature {temperature}, top_p {top_p}"
    return (f"{mode}, repetition penalty {DEMO_REPETITION_PENALTY} over the last 64 tokens"
            + (f", {len(banned)} image/markup tokens banned" if banned else ""))


def run_demo(*, model: str, sessions: int, max_tokens: int, redis_url: str | None, recipe: str,
             n_threads: int, redis_target: RedisTarget | None = None, worker_id: str = WORKER_ID,
             external: bool = False, temperature: float = DEMO_TEMPERATURE, top_p: float = DEMO_TOP_P, route: int = 1,
             cut: int = 0, engine: str = "llama", rounds: int = 1) -> int:
    """The demo. `route` 2: the model also runs as two hops (blocks [0, cut) and [cut, n), cut files
    cached next to the model) on two more consumers, with greedy sessions, and the texts are compared.
    `redis_target`: a Redis to use instead of `redis_url` (a Sentinel-watched master): the consumers
    started follow its failovers too."""
    from consumer.runtime import resolve_model
    from producer import Producer

    from .tokenizer import Tokenizer

    console = Console()
    if route not in (1, 2):
        console.print("[red]--route takes 1 or 2[/red]")
        return 2
    if route == 2 and external:
        console.print("[red]--route 2 starts its own consumers: not with --external[/red]")
        return 2
    try:
        server = None if redis_url or redis_target or external else LocalRedis()
    except RedisNotFound:
        console.print(f"[red]{INSTALL_HINT}[/red]")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="dgr-demo-"))
    try:
        if server is not None:
            server.start()
            redis_url = server.url
        if redis_target is None:
            assert redis_url is not None
            redis_target = RedisTarget(url=redis_url)
        redis_url = master_url(redis_target)  # what the consumer processes' readiness checks read
        with console.status(f"model {model!r}: preparing"):
            model_path = resolve_model(model)
        console.print(f"model: {model_path} ({model_path.stat().st_size / 1e6:.1f} MB)   "
                      f"redis: {redis_target.describe()}")
        client = cast(CountingRedis, connect(redis_target, redis_class=CountingRedis))  # never a Cluster here
        if route == 2:
            temperature = 0.0  # the comparison is between greedy sessions: the texts must be equal
        with ExitStack() as stack:
            def start(wid: str, path: Path) -> None:
                with console.status(f"consumer {wid!r}: loading {path.name}"):
                    stack.enter_context(ConsumerProcess(redis_url, wid, path, workdir, recipe=recipe, engine=engine,
                                                        slots=max(sessions, 1), threads=n_threads,
                                                        env=redis_target.env()))

            if external:
                with console.status(f"consumer {worker_id!r}: waiting for it"):
                    wait_for_worker(client, worker_id)
            else:
                start(worker_id, model_path)
            producer = Producer(client)
            tok = Tokenizer(model_path)
            prompts = [tok.encode(PROMPTS[i % len(PROMPTS)], add_bos=True) for i in range(sessions)]
            texts = [PROMPTS[i % len(PROMPTS)] for i in range(sessions)]
            hops = (RouteHop(worker_id=worker_id, key=producer.discover(worker_id).keys[0]),)
            banned = markup_tokens(model_path)
            mode = sampling_statement(temperature, top_p, banned)
            title = f"dgr demo: {sessions} sessions, one hop, one fused call per step, {mode}"
            if route == 1:
                one = live_run(console, producer, demo_specs("demo", hops, prompts, max_tokens, temperature, top_p,
                                                             tok.stop_tokens, banned), tok, texts, title)
                console.print(summary_table(client, worker_id, one.handles, one.first, one.last, one.t0, one.wall))
                return 0
            files = hop_files(model_path, cut, console)
            ids = [f"{worker_id}-hop{k}" for k in range(len(files))]
            for wid, f in zip(ids, files, strict=True):
                start(wid, f)
            two_hops = tuple(RouteHop(worker_id=w, key=producer.discover(w).keys[0]) for w in ids)
            same = True
            for r in range(max(1, rounds)):  # one hop, then two hops, alternating: ratios within one run
                tag = "" if r == 0 else f"-r{r}"
                one = live_run(console, producer, demo_specs(f"demo{tag}", hops, prompts, max_tokens, temperature,
                                                             top_p, tok.stop_tokens, banned), tok, texts, title)
                console.print(summary_table(client, worker_id, one.handles, one.first, one.last, one.t0, one.wall))
                two = live_run(console, producer, demo_specs(f"demo2{tag}", two_hops, prompts, max_tokens, temperature,
                                                             top_p, tok.stop_tokens, banned), tok, texts,
                               f"dgr demo: the same {sessions} sessions on two hops ({files[0].name} -> "
                               f"{files[1].name}), {mode}")
                console.print(compare_table(client, tok, ids, one, two))
                same = same and all(a.generated == b.generated
                                    for a, b in zip(one.handles.values(), two.handles.values(), strict=True))
            console.print("[green]two hops give the same text as one hop[/green]" if same
                          else "[red]two hops give a different text than one hop[/red]")
            return 0 if same else 1
        return 0
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the consumer and redis-server[/yellow]")
        return 130
    finally:
        if server is not None:
            with suppress(Exception):
                server.stop()


def demo_specs(prefix: str, hops: tuple[RouteHop, ...], prompts: list[list[int]], max_tokens: int,
               temperature: float, top_p: float, stop_tokens: Sequence[int], banned: Sequence[int] = (),
               ) -> list[tuple[SessionSpec, list[int]]]:
    return [(SessionSpec(session_id=f"{prefix}-{i}", account_id=f"acct-{i % 2}", route=hops,
                         sampling=demo_sampling(i, temperature, top_p, banned), max_tokens=max_tokens,
                         stop_tokens=tuple(stop_tokens)), p) for i, p in enumerate(prompts)]


def default_cut(path: Path) -> int:
    """Where to cut a model in two: Gemma 3 at the multiple of 6 nearest half its blocks (its attention
    pattern repeats every 6 blocks: dgrtools/split_model.py), any other model at half."""
    import gguf

    from .split_model import source_block_count

    n = source_block_count(path)
    arch = str(gguf.GGUFReader(str(path)).get_field("general.architecture").contents())  # type: ignore[union-attr]
    if arch == "gemma3" and n > 6:
        return max(6, min(n - 1, 6 * round(n / 12)))
    return max(1, n // 2)


def hop_files(model_path: Path, cut: int, console: Console) -> list[Path]:
    """The two hop files of the model cut at `cut` (0: default_cut), written once into a cache directory
    next to the model (`<model>.hops/`) and reused while the model's size and time are unchanged."""
    from .split_model import split_route

    cut = cut or default_cut(model_path)
    st = model_path.stat()
    cache = model_path.parent / f"{model_path.name}.hops" / f"{st.st_size}-{st.st_mtime_ns}-cut{cut}"
    files = sorted(cache.glob("hop-*.gguf"), key=lambda p: int(p.stem.split("-")[1]))
    if len(files) != 2:
        with console.status(f"cutting {model_path.name} at block {cut} into {cache}"):
            files = [h.path for h in split_route(model_path, cache, (cut,))]
    console.print(f"hops: {files[0]} and {files[1]}")
    return files


class CountingRedis(redis.Redis):
    """A client that counts its round trips (pipelines and direct calls the producer makes per loop)."""

    round_trips = 0

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        self.round_trips += 1
        return super().pipeline(*args, **kwargs)

    def xread(self, *args: Any, **kwargs: Any) -> Any:
        self.round_trips += 1
        return super().xread(*args, **kwargs)


def fused_calls(client: redis.Redis, workers: Sequence[str]) -> float:
    return sum(float(sdict(client.hgetall(WorkerKeys(w).worker_account)).get("fused_calls", 0)) for w in workers)


@dataclass
class Run:
    handles: dict[str, SessionHandle]
    first: dict[str, float]
    last: dict[str, float]
    t0: float
    wall: float
    round_trips: float = 0.0  # the producer's round trips per fused call (all hops)

    @property
    def tokens(self) -> int:
        return sum(len(h.generated) for h in self.handles.values())


def live_run(console: Console, producer: Any, specs: list[tuple[SessionSpec, list[int]]], tok: Any,
             prompt_texts: list[str], title: str) -> Run:
    """Drive the sessions, their texts streamed live in a table; the handles and their timings."""
    client = producer.client
    workers = sorted({hop.worker_id for s, _ in specs for hop in s.route})
    calls0, trips0 = fused_calls(client, workers), getattr(client, "round_trips", 0)
    ids = [s.session_id for s, _ in specs]
    texts = dict.fromkeys(ids, "")
    generated: dict[str, list[int]] = {sid: [] for sid in ids}
    prompts = dict(zip(ids, prompt_texts, strict=True))
    first: dict[str, float] = {}
    last: dict[str, float] = {}

    def render() -> Table:
        t = Table(title=title, expand=True)
        t.add_column("session", no_wrap=True)
        t.add_column("text (prompt + generated)", overflow="fold")
        for sid, text in texts.items():
            t.add_row(sid, f"[dim]{prompts[sid]}[/dim][bold]{text}[/bold]"[-400:])
        return t

    t0 = time.perf_counter()
    with Live(render(), console=console, refresh_per_second=8) as live:
        def on_result(h: object, r: StepResult) -> None:
            now = time.perf_counter()
            first.setdefault(r.session_id, now)
            last[r.session_id] = now
            if r.token is not None:  # decode the whole run: a character may span several tokens
                generated[r.session_id].append(r.token)
                texts[r.session_id] = tok.decode(generated[r.session_id])
                live.update(render())

        handles = producer.run_many(specs, on_result=on_result)
    wall = time.perf_counter() - t0
    calls = fused_calls(client, workers) - calls0
    trips = (getattr(client, "round_trips", 0) - trips0) / calls if calls else 0.0
    return Run(handles=handles, first=first, last=last, t0=t0, wall=wall, round_trips=trips)


def compare_table(client: redis.Redis, tok: Any, hop_ids: list[str], one: Run, two: Run) -> Table:
    """Session by session: one hop's text, two hops' text, equal or not; the caption: rates, each hop's
    engine time (from its worker's accounting), the activation bytes relayed per decode step."""
    from producer.route import RouteHandle

    t = Table(title="one hop vs two hops (greedy: the texts must be equal)", expand=True)
    for col in ("session", "same", "one hop", "two hops"):
        t.add_column(col, overflow="fold", no_wrap=col in ("session", "same"))
    for (sid, a), b in zip(one.handles.items(), two.handles.values(), strict=True):
        same = a.generated == b.generated
        t.add_row(sid, "[green]yes[/green]" if same else "[red]NO[/red]", tok.decode(a.generated),
                  tok.decode(b.generated))
    engine = [sum(float(sdict(client.hgetall(WorkerKeys(w).session_account(sid))).get("engine_seconds", 0))
                  for sid in two.handles) for w in hop_ids]
    legs = [h.legs[1] for h in two.handles.values() if isinstance(h, RouteHandle) and len(h.legs) > 1]
    rows = sum(len(h.prompt) + max(len(h.generated) - 1, 0) for h in two.handles.values())
    per_row = sum(leg.bytes_in for leg in legs) / rows if rows else 0.0
    r1, r2 = one.tokens / one.wall, two.tokens / two.wall
    t.caption = (f"one hop {r1:.1f} tok/s, two hops {r2:.1f} tok/s (ratio {r2 / r1:.2f}); engine seconds: "
                 + ", ".join(f"{w} {e:.2f}" for w, e in zip(hop_ids, engine, strict=True))
                 + f"; activations relayed per decode step: {per_row:.0f} bytes (one row, f32); Tracker round trips "
                 f"per fused call: one hop {one.round_trips:.2f}, two hops {two.round_trips:.2f}")
    return t


def worker_batch_stats(client: redis.Redis, worker_id: str) -> dict[str, float]:
    acct = {k: float(v) for k, v in sdict(client.hgetall(WorkerKeys(worker_id).worker_account)).items()}
    calls = acct.get("calls:decode", 0.0)
    return {"decode_calls": calls, "mean_batch": acct.get("sessions:decode", 0.0) / calls if calls else 0.0,
            "fused_calls": acct.get("fused_calls", 0.0), "engine_seconds": acct.get("engine_seconds", 0.0)}


def summary_table(client: redis.Redis, worker_id: str, handles: dict[str, SessionHandle], first: dict[str, float],
                  last: dict[str, float], t0: float, wall: float) -> Table:
    keys = WorkerKeys(worker_id)
    t = Table(title="per session (accounting read back from Redis)")
    for col in ("session", "status", "tok", "tok/s", "prompt", "gen", "engine s", "account"):
        t.add_column(col, justify="right" if col not in ("session", "status", "account") else "left", no_wrap=True)
    total = 0
    for sid, h in handles.items():
        a = sdict(client.hgetall(keys.session_account(sid)))
        n = len(h.generated)
        total += n
        span = last.get(sid, t0) - t0
        t.add_row(sid, str(h.status), str(n), f"{n / span:.1f}" if span > 0 else "-", a.get("prompt_tokens", "0"),
                  a.get("generated_tokens", "0"), f"{float(a.get('engine_seconds', 0)):.3f}", a.get("account", "?"))
    s = worker_batch_stats(client, worker_id)
    t.caption = (f"{total} tokens in {wall:.2f} s = {total / wall:.1f} tok/s aggregate; "
                 f"mean decode batch {s['mean_batch']:.2f} sessions over {int(s['decode_calls'])} decode calls "
                 f"({int(s['fused_calls'])} fused calls in all)")
    return t
