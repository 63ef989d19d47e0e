"""What `dgr serve`'s app costs a request, alone (`python -m dgrtools.bench.serve_app`).

`dgr bench serve` measures the whole gateway process against the producer floor; on a shared host its time to first
token swings by more than the gateway's part. This runs the ASGI app in this process (no uvicorn, no socket, no
producer work): `streams` streamed /v1/completions requests at once, each a prompt of 27 token ids and one token,
through make_app as `dgr serve` builds it (the tiny model's vocabulary; a real redis-server and a tiny-model consumer
give the fleet its advertisement), the producer's `stream_many` answered by a stub one loop turn later. The CPU of
this process per request (medians of `repeats` rounds of `rounds` bursts) is the app's own: parsing, validation,
the sessions' templates, the client's watch and the event stream. Also the garbage collector's collections in
the timed rounds, at `dgr serve`'s young threshold (--gc-young, 20,000), and the objects the requests left in
cycles (found by a collection after the rounds): what a request leaves for the collector."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .common import console, save, table

PROMPT = list(range(1, 28))


class StubAnswers:
    """AsyncProducer.stream_many's Answers for the request's sessions: each `tokens` tokens, one a loop turn, then
    its end; `log` (when given) says whether they were run to their end or closed (tests/test_serve_leaving.py)."""

    def __init__(self, sessions: list[tuple[Any, Any]], tokens: int, log: list[str] | None = None) -> None:
        self.tokens, self.log = tokens, log
        self.hs = {t.session_id: types.SimpleNamespace(
            session_id=t.session_id, status="finished", reason=None, detail="", prompt_tokens=len(p),
            billed_generated=tokens, cached_tokens=0, generated=[7] * tokens, legs=[], finished=True)
            for t, p in sessions}

    def __aiter__(self) -> Any:
        return self._answers()

    async def _answers(self) -> Any:
        from schemas import Status, StepResult

        for k in range(self.tokens):
            await asyncio.sleep(0)  # each answer comes a loop turn later, as the pump's do
            for sid, h in self.hs.items():
                yield h, StepResult(job_id=f"{sid}:1.{k}" if k else f"{sid}:0", session_id=sid, status=Status.OK,
                                    position=len(PROMPT) + 1 + k, worker_id="bench", token=7 + k % 50,
                                    finished=k == self.tokens - 1)
        if self.log is not None:
            self.log.append("ran to its end")

    async def aclose(self) -> None:
        if self.log is not None:
            self.log.append("closed")

    @property
    def handles(self) -> dict[str, Any]:
        return self.hs


def asgi_scope(body: bytes) -> dict[str, Any]:
    """A POST /v1/completions of `body`, as uvicorn gives it to the app."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
            "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())], "state": {}}


async def _measure(app: Any, streams: int, rounds: int, repeats: int, tokens: int) -> dict[str, Any]:
    body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    forever = asyncio.Event()

    async def one() -> None:
        sent: list[dict[str, Any]] = []
        first = [True]

        async def receive() -> dict[str, Any]:
            if first[0]:
                first[0] = False
                return {"type": "http.request", "body": body, "more_body": False}
            await forever.wait()  # the client stays
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(asgi_scope(body), receive, send)
        if sent[0].get("status") != 200:
            raise RuntimeError(f"the app answered {sent[:2]}")

    for _ in range(3):
        await asyncio.gather(*(one() for _ in range(streams)))
    await asyncio.sleep(0)
    gc.collect()
    collections = [0, 0, 0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            collections[info["generation"]] += 1

    per_request = []
    gc.callbacks.append(count)
    try:
        for _ in range(repeats):
            t = time.process_time()
            for _ in range(rounds):
                await asyncio.gather(*(one() for _ in range(streams)))
            per_request.append(1e6 * (time.process_time() - t) / (rounds * streams))
    finally:
        gc.callbacks.remove(count)
    await asyncio.sleep(0)  # the last listeners' cancels delivered
    return {"streams": streams, "rounds": rounds, "repeats": repeats, "us_per_request": statistics.median(per_request),
            "runs": per_request, "collections": collections, "requests": repeats * rounds * streams, "tokens": tokens,
            "unreachable": gc.collect()}  # the cycles left since the last collection (none ran: all of them)


def measure(streams: int = 64, rounds: int = 40, repeats: int = 5, young: int = 20_000, tokens: int = 1
            ) -> dict[str, Any]:
    from consumer.runtime import resolve_model
    from dgrtools.localredis import LocalRedis
    from dgrtools.process import ConsumerProcess
    from gateway.app import ServeConfig, make_app
    from gateway.text import TextModel

    path = resolve_model("tiny")
    with LocalRedis(appendonly=False) as server, \
            ConsumerProcess(server.url, "bench", path, Path(tempfile.mkdtemp(prefix="dgr-serve-app-")), slots=8):
        async def run() -> dict[str, Any]:
            app = make_app(ServeConfig(redis_url=server.url, models=[TextModel.load("m", path)]))
            async with app.router.lifespan_context(app):
                producer = app.state.gateway.runner.producer
                for _ in range(100):  # the consumer's advertisement and heartbeat, read as the gateway reads them
                    if any(w.alive for w in await producer.fleet_now()):
                        break
                    producer.core.fleet.read_at = float("-inf")
                    await asyncio.sleep(0.1)
                fleet = await producer.fleet_now()

                async def fleet_now() -> Any:
                    return fleet

                producer.fleet_now = fleet_now
                producer.stream_many = lambda sessions, *a, **k: StubAnswers(sessions, tokens)
                return await _measure(app, streams, rounds, repeats, tokens)

        gc.collect()
        threshold = gc.get_threshold()
        gc.set_threshold(young, *threshold[1:])
        try:
            return asyncio.run(run())
        finally:
            gc.set_threshold(*threshold)


def _rows(r: dict[str, Any]) -> Iterator[list[Any]]:
    yield [r["streams"], r["us_per_request"], " ".join(f"{x:.0f}" for x in r["runs"]),
           "/".join(map(str, r["collections"])), r["unreachable"], r["requests"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64, help="Requests at once.")
    ap.add_argument("--rounds", type=int, default=40, help="Bursts per repeat.")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1, help="Tokens each request streams.")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    a = ap.parse_args()
    r = measure(a.streams, a.rounds, a.repeats, tokens=a.tokens)
    console.print(table(f"dgr serve's app alone: CPU per request of {a.tokens} token(s) (this process)",
                        ["streams", "µs / request", "runs", "collections (young/middle/full)", "left in cycles",
                         "requests"],
                        list(_rows(r))))
    save(a.out, "serve-app", r)


if __name__ == "__main__":
    main()
