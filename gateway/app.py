"""The HTTP side of `dgr serve`: routes, the request's path to its sessions, server-sent events, body limits, API
keys, /health and /metrics. Every refusal is decided before a session opens (nothing starts on a worker)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from producer import AsyncProducer, PlacementPolicy, ProducerSettings, SessionHandle
from schemas import Reason, Status, StepResult
from schemas.limits import json_too_deep

from .api import ChatRequest, CompletionRequest, Generation
from .chat_tokens import TooLong
from .errors import (
    ApiError,
    bad_request,
    from_validation,
    internal,
    not_found_model,
    overloaded,
    queue_down,
    unauthorized,
)
from .responses import Choice, Kind, Shape
from .runner import Placement, Runner, Sessions, serving, usage_of
from .text import TextModel
from .watch import DONE, ClientWatch, EventStream

log = logging.getLogger("dgr.serve")
PLAYGROUND = Path(__file__).with_name("static") / "index.html"
MAX_BODY_BYTES = 1 << 20
# A prompt's text longer than this is tokenized on a thread (a few ms of llama.cpp at Gemma's vocabulary): shorter
# ones are tokenized on the event loop, where a thread's hand-over would cost about as much as the work
INLINE_TEXT = 16_384
MAX_BODY_DEPTH = 64  # JSON nesting levels of a request body: a response_format schema of ~30 nested objects fits


_JSON = msgspec.json.Encoder()


def serve_producer(**options: Any) -> ProducerSettings:
    """The Tracker's settings under `dgr serve`: a session a worker refuses for want of a slot is placed once more
    where there is room, else its request is answered 429 with Retry-After at once (the HTTP client retries)
    rather than held for PlacementPolicy.room_wait_s (producer/moves.py)."""
    return ProducerSettings(placement=PlacementPolicy(room_wait_s=0.0), **options)

@dataclass
class ServeConfig:
    redis_url: str
    models: list[TextModel]
    api_keys: dict[str, str] = field(default_factory=dict)  # bearer key -> account id
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = 30.0  # a request's body read within this (408): gateway/guard.py bounds the rest
    account: str = "serve"  # the account billed when no keys are configured
    producer: ProducerSettings = field(default_factory=serve_producer)


class Tally:
    """A counter the hot path adds to as a plain int (`n += 1`), read when /metrics is scraped: a prometheus_client
    Counter's `inc` takes a lock and four calls, about 210 Python opcodes, per streamed token."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.n = name, documentation, 0
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, value=self.n)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("dgr_serve_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.tokens = Tally("dgr_serve_completion_tokens", "Completion tokens answered", self.registry)
        self.ttft = Histogram("dgr_serve_time_to_first_token_seconds", "Request to its first token",
                              registry=self.registry)


class Gateway:
    def __init__(self, config: ServeConfig, producer: AsyncProducer) -> None:
        self.config, self.runner, self.metrics = config, Runner(producer), Metrics()
        self.models = {m.name: m for m in config.models}

    def account(self, request: Request) -> str:
        if not self.config.api_keys:
            return self.config.account
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        account = self.config.api_keys.get(key.strip()) if scheme.lower() == "bearer" else None
        if account is None:
            raise unauthorized()
        return account

    async def body(self, request: Request) -> dict[str, Any]:
        """The JSON object sent, read at most max_body_bytes (413 past it, before any of it is parsed)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        raw = bytearray()
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                async for part in request.stream():
                    raw += part
                    if len(raw) > limit:
                        raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        except TimeoutError:
            raise ApiError(408, f"the request's body did not arrive within {self.config.body_timeout_s:g} s",
                           code="request_timeout", headers={"Connection": "close"}) from None
        data = bytes(raw)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise bad_request(f"the body is not UTF-8 (byte {e.start})", code="invalid_encoding") from None
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise bad_request(f"the body is not JSON: {e}", code="invalid_json") from None
        except RecursionError:  # nesting past the parser's own limit: the same refusal as any nesting too deep
            fault: _Fault | None = "depth"
        else:
            fault = _shape_fault(data, text, obj)
        if fault == "depth":
            raise bad_request(f"the body nests deeper than {MAX_BODY_DEPTH} levels", code="invalid_json")
        if fault == "surrogate":
            raise bad_request("the body holds an unpaired UTF-16 surrogate (\\uD800-\\uDFFF)", code="invalid_encoding")
        if not isinstance(obj, dict):
            raise bad_request("the body must be a JSON object", code="invalid_json")
        return obj

    def model(self, name: str) -> TextModel:
        m = self.models.get(name)
        if m is None:
            raise not_found_model(name, sorted(self.models))
        return m

    async def generate(self, request: Request, kind: Kind) -> Response:
        account = self.account(request)
        obj = await self.body(request)
        try:
            req: Generation = (ChatRequest if kind == "chat" else CompletionRequest).model_validate(obj)
        except ValidationError as e:
            raise from_validation(e) from None
        model = self.model(req.model)
        try:  # first: its context bounds the text worth tokenizing
            where: Placement | None = await self.runner.place(model)
            refused = None
        except ApiError as e:  # no worker up: the request's own faults are answered first, as ever
            where, refused = None, e
        prompt = await self.encode(req, model, None if where is None else where.ctx)
        if refused is not None:
            raise refused
        assert where is not None
        sessions = self.runner.sessions(req, model, prompt, where, account)
        shape = Shape(kind, f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", model,
                      req.logprobs_n() is not None)
        choices = [Choice.new(i, model, req.stops, sessions.stop_tokens) for i in range(req.n)]
        events = sessions.events().__aiter__()
        t0 = time.monotonic()
        watch, streaming = ClientWatch(request.receive), False
        try:
            first = await watch.until_gone(anext(events))  # a 429 (backpressure) is still a status
            if isinstance(first, tuple) and no_room(first[1]):  # refused before any token: still a status
                await events.aclose()  # type: ignore[attr-defined]  # the other choices' sessions cancelled
                raise overloaded(f"no free slot for choice {first[0]} on the worker: {first[1].detail}".strip())
            self.metrics.ttft.observe(time.monotonic() - t0)
            if req.stream:  # the stream is sent under the same watch, which it closes
                streaming = True
                return EventStream(self.sse(shape, choices, first, events, sessions, req.include_usage), watch,
                                   events.aclose)  # type: ignore[attr-defined]
            handles = await watch.until_gone(self.collect(choices, first, events, sessions))
        except ClientDisconnect:
            await events.aclose()  # type: ignore[attr-defined]  # cancels the sessions on their workers
            raise
        finally:
            if not streaming:
                watch.close()
        failed = self.failure(handles, choices)
        if failed is not None:
            raise failed
        return JSONResponse(shape.body(choices, usage_of(list(handles.values())).body()))

    async def collect(self, choices: list[Choice], item: Any, events: AsyncIterator[Any],
                      sessions: Sessions) -> dict[str, SessionHandle]:
        """A whole answer (not streamed): every event taken, then the handles."""
        while not isinstance(item, dict):
            self.take(choices, item, sessions)
            item = await anext(events)
        return item

    async def encode(self, req: Generation, model: TextModel, ctx: int | None) -> list[int]:
        """The prompt's ids: on a thread when its text is long (llama.cpp's tokenizer lets go of the GIL; a chat of
        1 MB took Gemma's vocabulary seconds, every other stream waiting on the event loop meanwhile), and a text
        too long for `ctx` tokens refused before it is tokenized (docs/serve.md)."""
        if size_of(req) < INLINE_TEXT:
            return self.prompt(req, model, ctx)
        return await asyncio.to_thread(self.prompt, req, model, ctx)

    def prompt(self, req: Generation, model: TextModel, ctx: int | None = None) -> list[int]:
        try:
            if isinstance(req, ChatRequest):
                try:
                    return model.encode_chat([{"role": m.role, "content": m.text} for m in req.messages], ctx)
                except LookupError as e:
                    raise bad_request(str(e), param="model", code="no_chat_template") from None
                except TooLong:
                    raise
                except Exception as e:  # a template's raise_exception, or a template that fails to render
                    raise bad_request(f"the chat template refused the messages: {e}", param="messages") from None
            assert isinstance(req, CompletionRequest)
            prompt = model.encode_prompt(req.prompt, ctx)
        except TooLong as e:
            raise bad_request(f"This model's maximum context length is {ctx} tokens; the prompt cannot fit ({e})",
                              param="messages" if isinstance(req, ChatRequest) else "prompt",
                              code="context_length_exceeded") from None
        vocab = model.tokenizer.vocab_size
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab:  # in C: a generator resumed per token costs µs
            raise bad_request(f"the prompt must be text or token ids in [0, {vocab})", param="prompt")
        return prompt

    def take(self, choices: list[Choice], item: tuple[int, StepResult], sessions: Sessions
             ) -> tuple[Choice, str, list[Any]]:
        i, r = item
        c = choices[i]
        text, lps, hit = c.take(r)
        if r.token is not None:
            self.metrics.tokens.n += 1
        if hit:  # a stop string: the worker's session is not needed any more
            sessions.stop(i)
        return c, text, lps

    @staticmethod
    def failure(handles: dict[str, SessionHandle], choices: list[Choice]) -> ApiError | None:
        """A choice the worker ended before it finished: 429 when it was refused for a slot before any token
        (the client retries: `Retry-After`), else 502."""
        for c, h in zip(choices, handles.values(), strict=False):
            if c.finish_reason is None and h.status not in ("finished", "cancelled"):
                if h.status == "rejected" and h.reason == Reason.CAPACITY.value and not h.generated:
                    return overloaded(f"no free slot for choice {c.index} on the worker: {h.detail}".strip())
                return ApiError(502, f"the worker ended the session: {h.status} ({h.reason or ''} {h.detail})".strip(),
                                type="server_error", code="worker_failed")
        return None

    async def sse(self, shape: Shape, choices: list[Choice], first: Any, events: AsyncIterator[Any],
                  sessions: Sessions, include_usage: bool) -> AsyncIterator[bytes]:
        def data(obj: dict[str, Any]) -> bytes:
            return b"data: " + _JSON.encode(obj) + b"\n\n"  # msgspec: a chunk per token, ~5x json.dumps

        if shape.kind == "chat":
            for c in choices:
                yield data(shape.chunk(c.index, "", usage=include_usage))
        item = first
        try:
            while not isinstance(item, dict):
                c, text, lps = self.take(choices, item, sessions)
                if text or lps or c.finish_reason is not None:
                    offsets = c.text_offsets[-len(lps):] if lps else None
                    yield data(shape.chunk(c.index, text, c.finish_reason, lps, offsets, usage=include_usage))
                item = await anext(events)
            failed = self.failure(item, choices)
            last = data(failed.body()) if failed is not None \
                else data(shape.usage_chunk(usage_of(list(item.values())).body())) if include_usage else b""
            yield last + DONE  # the last events in one send, which ends the body (EventStream)
        except Exception as e:  # after the headers: the stream ends with an error event
            yield data(_api_answer(e, "stream").body()) + DONE
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def models_body(self) -> dict[str, Any]:
        fleet = await self.runner.fleet()
        data = []
        for m in self.models.values():
            workers = [w.worker_id for w in fleet if w.alive and serving(w, m) is not None]
            data.append({"id": m.name, "object": "model", "created": 0, "owned_by": "dgr",
                         "workers": workers, "chat_template": m.template.source if m.template else None})
        return {"object": "list", "data": data}


_Fault = Literal["depth", "surrogate"]
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _shape_fault(raw: bytes, text: str, obj: Any) -> _Fault | None:
    """What no later stage could take in the body parsed from `text` (None: nothing): nesting deeper than
    MAX_BODY_DEPTH (pydantic, the JSON schema's encoding and its grammar all recurse over what they are given),
    told from the bytes as the workers tell a job's (`json_too_deep`: two counts in C, a scan only past the bound);
    else a string (key or value) holding a UTF-16 surrogate json.loads left unpaired (no character: no tokenizer,
    template or Redis write takes it). json.loads makes one only of a \\uD800-\\uDFFF escape (text decoded from
    UTF-8 holds none), so the values are walked (about 0.3 us each: 140 us for a prompt of 520 token ids) only
    where the text has such an escape."""
    if json_too_deep(raw, MAX_BODY_DEPTH):
        return "depth"
    if _SURROGATE_ESCAPE.search(text) is not None and _lone_surrogate(obj):
        return "surrogate"
    return None


def _lone_surrogate(obj: Any) -> bool:
    """Whether a string in `obj` (a key or a value) holds a lone surrogate: a walk without recursion."""
    stack: list[Any] = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(v, dict):
            stack += v.keys()
            stack += v.values()
        elif isinstance(v, list):
            stack += v
    return False


def size_of(req: Generation) -> int:
    """The characters of text a request's prompt holds (0 for token ids)."""
    if isinstance(req, ChatRequest):
        return sum(len(m.text) for m in req.messages)
    assert isinstance(req, CompletionRequest)
    return sum(len(x) for x in ([req.prompt] if isinstance(req.prompt, str) else req.prompt) if isinstance(x, str))


def _api_answer(e: Exception, where: str) -> ApiError:
    """The answer to what a request raised: itself when it is one; Redis unavailable past the producer's outage
    bound: 503; anything else (a bug): 500, logged with its traceback."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RedisError):
        log.warning("redis unavailable past the outage bound: %s", e, extra={"endpoint": where})
        return queue_down()
    log.exception("request failed", extra={"endpoint": where})
    return internal()


def _endpoint(name: str, fn: Callable[[Gateway, Request], Awaitable[Response]]
              ) -> Callable[[Request], Awaitable[Response]]:
    async def handler(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        try:
            resp = await fn(gw, request)
        except ClientDisconnect:
            resp = Response(status_code=499)
        except Exception as e:  # an answer in OpenAI's shape, whatever went wrong (never Starlette's plain 500)
            resp = _api_answer(e, name).response()
        gw.metrics.requests.labels(name, str(resp.status_code)).inc()
        return resp

    return handler


async def _models(gw: Gateway, request: Request) -> Response:
    gw.account(request)
    return JSONResponse(await gw.models_body())


async def _health(gw: Gateway, request: Request) -> Response:
    fleet = await gw.runner.fleet()
    return JSONResponse({"status": "ok", "workers_up": sum(w.alive for w in fleet),
                         "models": sorted(gw.models)})


async def _metrics(gw: Gateway, request: Request) -> Response:
    return Response(generate_latest(gw.metrics.registry), media_type="text/plain; version=0.0.4")


async def _playground(gw: Gateway, request: Request) -> Response:
    return HTMLResponse(PLAYGROUND.read_text())


async def _completions(gw: Gateway, request: Request) -> Response:
    return await gw.generate(request, "completion")


async def _chat(gw: Gateway, request: Request) -> Response:
    return await gw.generate(request, "chat")


def make_app(config: ServeConfig, client: aioredis.Redis | None = None) -> Starlette:
    """The ASGI app: one AsyncProducer (on `client`, or one made from config.redis_url) for every request."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        redis_client = client or aioredis.Redis.from_url(config.redis_url)
        producer = AsyncProducer(redis_client, config.producer)
        app.state.gateway = Gateway(config, producer)
        try:
            yield
        finally:
            await producer.aclose()
            if client is None:
                await redis_client.aclose()

    routes = [Route("/", _endpoint("playground", _playground)), Route("/health", _endpoint("health", _health)),
              Route("/metrics", _endpoint("metrics", _metrics)), Route("/v1/models", _endpoint("models", _models)),
              Route("/v1/completions", _endpoint("completions", _completions), methods=["POST"]),
              Route("/v1/chat/completions", _endpoint("chat", _chat), methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan)


def no_room(r: StepResult) -> bool:
    """A session refused at its opening for want of a slot (before any token)."""
    return r.status == Status.REJECTED and r.reason == Reason.CAPACITY and r.token is None
