"""An asyncio Tracker in a few lines: an aiohttp handler streaming a session's tokens as server-sent events.

Needs the `tracker` extra (`pip install -e ".[tracker]"`: aiohttp). Against a running worker, e.g.:

    redis-server --port 6379 --save '' &
    dgr consumer --redis-url redis://127.0.0.1:6379/0 --worker-id demo --model tiny &
    python examples/sse_tracker.py --redis-url redis://127.0.0.1:6379/0 --worker-id demo
    curl -N 'http://127.0.0.1:8080/generate?prompt=5,6,7&max_tokens=16'

Every request is one session; all of them are driven by one AsyncProducer (one result stream per worker for all
of them, one read per fused call of the worker). A client that goes away cancels its session on the worker.
"""

from __future__ import annotations

import argparse
import uuid

import redis.asyncio as aioredis
from aiohttp import web

from producer import AsyncProducer, ResultTimeout, SessionFailed
from schemas import RouteHop, Sampling, SessionSpec

PRODUCER = web.AppKey("producer", AsyncProducer)
WORKER = web.AppKey("worker_id", str)


async def generate(request: web.Request) -> web.StreamResponse:
    producer, worker_id = request.app[PRODUCER], request.app[WORKER]
    try:
        prompt = [int(t) for t in request.query["prompt"].split(",")]
        max_tokens = int(request.query.get("max_tokens", "32"))
    except (KeyError, ValueError):
        raise web.HTTPBadRequest(text="prompt=<comma-separated token ids>[&max_tokens=N]") from None
    key = (await producer.discover(worker_id)).keys[0]
    spec = SessionSpec(session_id=f"sse-{uuid.uuid4().hex}", account_id=request.query.get("account", "sse"),
                       route=(RouteHop(worker_id=worker_id, key=key),), sampling=Sampling(), max_tokens=max_tokens)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    finished = False
    try:
        async for token in producer.generate(spec, prompt):
            await resp.write(f"data: {token}\n\n".encode())
        finished = True
        await resp.write(b"event: end\ndata: finished\n\n")
    except (SessionFailed, ResultTimeout) as e:
        finished = True
        await resp.write(f"event: error\ndata: {e}\n\n".encode())
    finally:
        if not finished:  # the client went away (or the server is stopping): free the worker's slot
            await producer.cancel(worker_id, spec.session_id)
    return resp


def make_app(producer: AsyncProducer, worker_id: str) -> web.Application:
    app = web.Application()
    app[PRODUCER], app[WORKER] = producer, worker_id
    app.router.add_get("/generate", generate)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--worker-id", default="demo")
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args()

    async def app() -> web.Application:
        producer = AsyncProducer(aioredis.Redis.from_url(args.redis_url))
        application = make_app(producer, args.worker_id)

        async def close(_: web.Application) -> None:
            await producer.aclose()
            await producer.client.aclose()

        application.on_cleanup.append(close)
        return application

    web.run_app(app(), port=args.port)


if __name__ == "__main__":
    main()
