"""`dgr demo`: a private redis-server, one consumer process, N concurrent sessions streamed live."""

from __future__ import annotations

import tempfile
import time
from contextlib import ExitStack, suppress
from pathlib import Path

import redis
from rich.console import Console
from rich.live import Live
from rich.table import Table

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
# its own seed, so a run is reproducible; `--temperature 0` gives greedy sessions.
DEMO_TEMPERATURE = 0.8
DEMO_TOP_P = 0.95


def demo_sampling(i: int, temperature: float, top_p: float) -> Sampling:
    """Session i's sampling: temperature / top_p as given, seed i (greedy when temperature is 0)."""
    return Sampling(temperature=temperature, top_p=top_p, seed=i)


def run_demo(*, model: str, sessions: int, max_tokens: int, redis_url: str | None, recipe: str,
             n_threads: int, worker_id: str = WORKER_ID, external: bool = False,
             temperature: float = DEMO_TEMPERATURE, top_p: float = DEMO_TOP_P) -> int:
    from consumer.runtime import resolve_model
    from producer import Producer

    from .tokenizer import Tokenizer

    console = Console()
    try:
        server = None if redis_url or external else LocalRedis()
    except RedisNotFound:
        console.print(f"[red]{INSTALL_HINT}[/red]")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="dgr-demo-"))
    try:
        if server is not None:
            server.start()
            redis_url = server.url
        assert redis_url is not None
        with console.status(f"model {model!r}: preparing"):
            model_path = resolve_model(model)
        console.print(f"model: {model_path} ({model_path.stat().st_size / 1e6:.1f} MB)   redis: {redis_url}")
        client = redis.Redis.from_url(redis_url)
        with ExitStack() as stack:
            with console.status(f"consumer {worker_id!r}: loading the model"):
                if external:
                    wait_for_worker(client, worker_id)
                else:
                    stack.enter_context(ConsumerProcess(redis_url, worker_id, model_path, workdir, recipe=recipe,
                                                        slots=max(sessions, 1), threads=n_threads))
            producer = Producer(client)
            info = producer.discover(worker_id)
            tok = Tokenizer(model_path)
            key = info.keys[0]
            specs = []
            for i in range(sessions):
                prompt = PROMPTS[i % len(PROMPTS)]
                spec = SessionSpec(session_id=f"demo-{i}", account_id=f"acct-{i % 2}",
                                   route=(RouteHop(worker_id=worker_id, key=key),),
                                   sampling=demo_sampling(i, temperature, top_p),
                                   max_tokens=max_tokens, stop_tokens=tuple(tok.stop_tokens))
                specs.append((spec, tok.encode(prompt, add_bos=True)))
            texts = {s.session_id: "" for s, _ in specs}
            generated: dict[str, list[int]] = {s.session_id: [] for s, _ in specs}
            prompts = {s.session_id: PROMPTS[i % len(PROMPTS)] for i, (s, _) in enumerate(specs)}
            first: dict[str, float] = {}
            last: dict[str, float] = {}

            def render() -> Table:
                t = Table(title=f"dgr demo: {sessions} sessions, one fused call per step, "
                                 f"{'greedy' if temperature == 0 else f'temperature {temperature}, top_p {top_p}'}",
                          expand=True)
                t.add_column("session", no_wrap=True)
                t.add_column("text (prompt + generated)", overflow="fold")
                for sid, text in texts.items():
                    t.add_row(sid, f"[dim]{prompts[sid]}[/dim][bold]{text}[/bold]"[-400:])
                return t

            def on_result(h: object, r: StepResult) -> None:
                now = time.perf_counter()
                first.setdefault(r.session_id, now)
                last[r.session_id] = now
                if r.token is not None:  # decode the whole run: a character may span several tokens
                    generated[r.session_id].append(r.token)
                    texts[r.session_id] = tok.decode(generated[r.session_id])

            t0 = time.perf_counter()
            with Live(render(), console=console, refresh_per_second=8) as live:
                def on_result_live(h: object, r: StepResult) -> None:
                    on_result(h, r)
                    live.update(render())

                handles = producer.run_many(specs, on_result=on_result_live)
            wall = time.perf_counter() - t0
            console.print()
            console.print(summary_table(client, worker_id, handles, first, last, t0, wall))
        return 0
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the consumer and redis-server[/yellow]")
        return 130
    finally:
        if server is not None:
            with suppress(Exception):
                server.stop()


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
