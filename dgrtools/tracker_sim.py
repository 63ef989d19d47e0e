"""`dgr tracker-sim`: a load generator on the producer API against a running consumer."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from consumer.connect import RedisTarget, connect, connect_async
from producer import DECODE_N, SessionHandle
from schemas import RouteHop, Sampling, SessionSpec, Signer, StepResult


def run_tracker_sim(*, redis_target: RedisTarget, worker_id: str, sessions: int, prompt_len: str, max_tokens: int,
                    rate: float, cancel_fraction: float, temperature: float, top_k: int, top_p: float, seed: int,
                    json_out: Path | None, hmac_key_file: Path | None = None, use_async: bool = False,
                    decode_n: int | None = None) -> int:
    """Drive `sessions` sessions with the sync Producer's run_many, or (`use_async`) with one
    AsyncProducer on asyncio: one task per session (`generate`-style, through run_many's tasks).
    `worker_id` "w0,w1,...": every session on the route of those hops (docs/routes.md), in order.
    `decode_n`: tokens per decode job (None: the producer's default). With n > 1 the worker runs ahead
    of the Tracker, so a cancel decided at token k may arrive after the session finished."""
    from producer import Producer
    from schemas import Signer

    console = Console()
    signer = Signer.from_file(hmac_key_file) if hmac_key_file else None
    per_job = DECODE_N if decode_n is None else decode_n
    producer = Producer(connect(redis_target), signer=signer, decode_n=per_job)  # type: ignore[arg-type]
    hop_ids = worker_id.split(",")
    infos = [producer.discover(w) for w in hop_ids]
    for w, hop_info in zip(hop_ids, infos, strict=True):
        if not hop_info.alive:
            console.print(f"[red]worker {w!r} has no live heartbeat at {redis_target.describe()}[/red]")
            return 2
    info = infos[0]
    route = tuple(RouteHop(worker_id=w, key=i.keys[0]) for w, i in zip(hop_ids, infos, strict=True))
    rng = np.random.default_rng(seed)
    lo, hi = (int(x) for x in prompt_len.split(":"))
    vocab = int(info.info.get("vocab_size", 256))
    specs = []
    for i in range(sessions):
        n = int(rng.integers(lo, hi + 1))
        prompt = [int(t) for t in rng.integers(3, vocab, n)]
        spec = SessionSpec(session_id=f"sim-{seed}-{i}", account_id=f"sim-acct-{i % 3}",
                           route=route,
                           sampling=Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed * 1000 + i),
                           max_tokens=max_tokens)
        specs.append((spec, prompt))
    starts = list(np.cumsum(rng.exponential(1.0 / rate, sessions))) if rate > 0 else [0.0] * sessions
    n_cancel = round(cancel_fraction * sessions)
    cancel_at = {specs[i][0].session_id: max(1, max_tokens // 2)
                 for i in rng.choice(sessions, n_cancel, replace=False)} if n_cancel else {}
    latencies: dict[str, list[float]] = {s.session_id: [] for s, _ in specs}
    last: dict[str, float] = {}
    tokens: dict[str, int] = dict.fromkeys(latencies, 0)

    def observe(h: SessionHandle, r: StepResult) -> bool:
        """Record the inter-token latency; True when this session is to be cancelled now: at its token number
        cancel_at, counted here (an AsyncProducer calls back after its pump moved on: the handle may hold more)."""
        if r.token is None:  # a hop that is not last: rows, no token
            return False
        now = time.perf_counter()
        if r.session_id in last:
            latencies[r.session_id].append(now - last[r.session_id])
        last[r.session_id] = now
        tokens[r.session_id] += 1
        return cancel_at.get(r.session_id) == tokens[r.session_id]

    def on_result(h: SessionHandle, r: StepResult) -> None:
        if observe(h, r):
            producer.cancel_route(h)  # on every hop of its route

    t0 = time.perf_counter()
    if use_async:
        handles = asyncio.run(_run_async(redis_target, signer, worker_id, specs, starts, observe, per_job))
    else:
        handles = producer.run_many(specs, on_result=on_result, start_times=starts)
    wall = time.perf_counter() - t0
    where = worker_id if len(hop_ids) == 1 else f"the route {' -> '.join(hop_ids)}"
    table = Table(title=f"tracker-sim: {sessions} sessions on {where}" + (" (asyncio)" if use_async else ""))
    for col in ("session", "status", "prompt", "generated", "p50 ms", "p99 ms"):
        table.add_column(col)
    rows = []
    for (spec, prompt), h in zip(specs, handles.values(), strict=True):
        lat = np.array(latencies[spec.session_id]) * 1e3
        p50, p99 = (float(np.percentile(lat, q)) for q in (50, 99)) if lat.size else (0.0, 0.0)
        rows.append({"session": spec.session_id, "status": str(h.status), "prompt_tokens": len(prompt),
                     "generated": list(h.generated), "itl_p50_ms": p50, "itl_p99_ms": p99})
        table.add_row(spec.session_id, str(h.status), str(len(prompt)), str(len(h.generated)), f"{p50:.1f}",
                      f"{p99:.1f}")
    total = sum(len(h.generated) for h in handles.values())
    table.caption = f"{total} tokens in {wall:.2f} s = {total / wall:.1f} tok/s; {n_cancel} cancelled on purpose"
    console.print(table)
    if json_out:
        json_out.write_text(json.dumps({"wall_s": wall, "sessions": rows}, indent=1))
    return 0


async def _run_async(redis_target: RedisTarget, signer: Signer | None, worker_id: str,
                     specs: Sequence[tuple[SessionSpec, list[int]]], starts: Sequence[float],
                     observe: Callable[[SessionHandle, StepResult], bool],
                     decode_n: int) -> dict[str, SessionHandle]:
    from producer import AsyncProducer

    client = connect_async(redis_target)
    async with AsyncProducer(client, signer=signer, decode_n=decode_n) as producer:  # type: ignore[arg-type]
        async def on_result(h: SessionHandle, r: StepResult) -> None:
            if observe(h, r):
                await producer.cancel_route(h)  # on every hop of its route

        handles = await producer.run_many(specs, on_result=on_result, start_times=starts)
    await client.aclose()
    return handles
