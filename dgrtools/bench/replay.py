"""How long a replay takes: N sessions on one in-process worker (llama.cpp, a private redis-server), each
crashed (a new worker on the same id, the engine's slots released) after G generated tokens, and the time
from the crash to each one's next new token, alone and with `--others` sessions decoding beside them, in one
run, three ways: on the `invariant` recipe the tokens sampled again in decode calls (the Tracker's default,
producer/steps.py `regenerates`) or re-fed as prompt one row per prefill call (`Producer(regenerate=False)`:
the exact replay of docs/invariance.md); on `fast`, re-fed as one prompt. An `invariant` engine that is not
batch-invariant on this model (Gemma's Q4_K weights: consumer/engines/llama.py) replays as `fast` does: the
table says which it was.
`python -m dgrtools.bench.replay [--model tiny|gemma] [--sessions 4] [--generated 64] [--others 4]`."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import redis

from .common import console, save, table


def replay_once(model: Path, *, recipe: Literal["fast", "invariant"], regenerate: bool, sessions: int, generated: int,
                prompt_len: int, others: int = 0) -> dict[str, Any]:
    """`others`: sessions opened on the new worker at the crash, decoding while the replays run (the weights
    then give prefill one call in five)."""
    from consumer.engines.llama import LlamaCppEngine
    from consumer.transport import RedisTransport
    from consumer.worker import Worker, WorkerSettings
    from dgrtools.localredis import LocalRedis
    from producer import Producer
    from schemas import RouteHop, Sampling, SessionSpec

    eng = LlamaCppEngine(model, recipe=recipe, n_slots=max(2, sessions + others), ctx_per_session=1024)
    try:
        with LocalRedis(appendonly=False) as rs:
            client = redis.Redis.from_url(rs.url)

            def worker() -> Worker:
                w = Worker(eng, RedisTransport(client, "w", consumer_name="w"),
                           WorkerSettings(worker_id="w", block_ms=0, gather_ms=0.0, await_ms=0))
                w.start()
                return w

            w, producer = worker(), Producer(client, regenerate=regenerate)
            key = producer.discover("w").keys[0]
            rng = np.random.default_rng(1)

            def open_one(sid: str, max_tokens: int, n: int) -> Any:
                route = (RouteHop(worker_id="w", key=key),)
                return producer.open(SessionSpec(session_id=sid, account_id="a", route=route, sampling=Sampling(),
                                                 max_tokens=max_tokens), [int(t) for t in rng.integers(3, 200, n)])

            handles = [open_one(f"s{i}", generated + 8, prompt_len) for i in range(sessions)]
            while min(len(h.generated) for h in handles) < generated:
                w.run_once()
                producer.poll([h for h in handles if not h.finished], block_ms=0)
            at = [len(h.generated) for h in handles]
            w = worker()  # the crash: a new worker on the id, the old one's state gone
            for s in range(eng.capacity.n_slots):
                eng.release(s)
            busy = [open_one(f"o{i}", 1000, 8) for i in range(others)]  # decoding until the replays are back
            t0, back = time.perf_counter(), dict[int, float]()
            while len(back) < sessions:
                w.run_once()
                producer.poll([h for h in handles + busy if not h.finished], block_ms=0)
                for i, h in enumerate(handles):
                    if i not in back and h.attempt >= 1 and len(h.generated) > at[i]:
                        back[i] = time.perf_counter() - t0
            return {"recipe": recipe, "batch_invariant": eng.batch_invariant,
                    "replay": "sampled again" if regenerate and eng.batch_invariant else
                    "re-fed, a row a call" if eng.batch_invariant else "re-fed as prompt",
                    "others": others, "generated_at_crash": at,
                    "back_s_median": statistics.median(back.values()), "back_s_max": max(back.values()),
                    "prefill_calls": w.scheduler.stats.calls_prefill,
                    "decode_calls": w.scheduler.stats.calls_decode}
    finally:
        eng.close()


def main(argv: list[str] | None = None) -> None:
    from consumer.runtime import resolve_model

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--generated", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--others", type=int, default=4, help="Sessions decoding on the worker during the replays.")
    ap.add_argument("--out", type=Path, default=Path("bench-out/replay"))
    a = ap.parse_args(argv)
    path = resolve_model(a.model)
    ways: list[tuple[Literal["fast", "invariant"], bool]] = [("invariant", True), ("invariant", False),
                                                              ("fast", False)]
    rows = [replay_once(path, recipe=recipe, regenerate=regen, sessions=a.sessions, generated=a.generated,
                        prompt_len=a.prompt_len, others=others)
            for others in sorted({0, a.others}) for recipe, regen in ways]
    console.print(table(f"replay after a crash: {a.model}, {a.sessions} sessions, {a.prompt_len} prompt + "
                        f"{a.generated} generated tokens", ["others decoding", "recipe", "its generated tokens",
                                                           "back p50 s", "back max s", "prefill calls",
                                                           "decode calls"],
                        [[r["others"], r["recipe"], r["replay"], r["back_s_median"], r["back_s_max"],
                          r["prefill_calls"], r["decode_calls"]] for r in rows]))
    save(a.out, "replay", {"model": a.model, "sessions": a.sessions, "generated": a.generated,
                           "prompt_len": a.prompt_len, "runs": rows})


if __name__ == "__main__":
    main()
