"""Sessions for HTTP requests over ONE AsyncProducer: which worker (`choose_worker`, the one place), the
SessionSpecs a request becomes, and a stream of (choice, token result) events; a caller that stops listening
(a client gone, a stop string met) cancels its unfinished sessions on the worker (the cancel marker)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from producer import AsyncProducer, Backpressure, ProducerError, SessionHandle
from producer.validate import WorkerInfo
from schemas import CompatibilityKey, RouteHop, Sampling, SessionSpec, StepResult
from schemas.limits import MAX_GENERATE

from .api import Generation
from .errors import ApiError, bad_request, overloaded, unavailable
from .text import TextModel

FLEET_CACHE_S = 1.0


@dataclass(frozen=True)
class Placement:
    worker_id: str
    key: CompatibilityKey

    @property
    def ctx(self) -> int:
        return self.key.recipe.ctx_per_session


def serving(info: WorkerInfo, model: TextModel) -> CompatibilityKey | None:
    """The worker's key for the model's weights (its GGUF's sha256), whole model (tokens in, logits out)."""
    return next((k for k in info.keys if k.engine.gguf_sha256 == model.sha256 and k.boundary.consumes == "tokens"
                 and k.boundary.produces == "logits"), None)


def choose_worker(fleet: Sequence[WorkerInfo], model: TextModel) -> Placement:
    """THE worker choice (issue 33's placement replaces this body): the first live worker, by id, advertising the
    model. 503 when workers advertise it but none is up."""
    advertising = [(w, k) for w in sorted(fleet, key=lambda w: w.worker_id) if (k := serving(w, model)) is not None]
    live = [(w, k) for w, k in advertising if w.alive]
    if not live:
        raise unavailable(f"no worker is up for model {model.name!r}"
                          + (f" ({len(advertising)} advertise it, none has a heartbeat)" if advertising else ""))
    w, k = live[0]
    return Placement(w.worker_id, k)


def cached_tokens(handles: Sequence[SessionHandle]) -> int:
    """Prompt tokens the workers charged as read from their prefix cache: the one place it is read (issue 31 adds
    the `cached_tokens` charge; 0 until a handle carries it)."""
    return sum(int(getattr(h, "cached_tokens", 0) or 0) for h in handles)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def usage_of(handles: Sequence[SessionHandle]) -> Usage:
    """What the workers charged (the accounting counters' charges each answer carries), not counted here. The
    prompt is charged once per session: n choices of one prompt are n sessions, each charged."""
    return Usage(sum(h.prompt_tokens for h in handles), sum(h.billed_generated for h in handles),
                 cached_tokens(handles))


class Runner:
    """The sessions of every request, on one AsyncProducer; the fleet's advertisements read at most once a
    FLEET_CACHE_S."""

    def __init__(self, producer: AsyncProducer) -> None:
        self.producer = producer
        self._fleet: tuple[float, list[WorkerInfo]] | None = None
        self._asking: asyncio.Future[list[WorkerInfo]] | None = None

    async def fleet(self) -> list[WorkerInfo]:
        now = time.monotonic()
        if self._fleet is not None and now - self._fleet[0] < FLEET_CACHE_S:
            return self._fleet[1]
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self.producer.workers())
        infos = list(await asyncio.shield(self._asking))
        self._fleet = (time.monotonic(), infos)
        return infos

    async def place(self, model: TextModel) -> Placement:
        return choose_worker(await self.fleet(), model)

    def specs(self, req: Generation, model: TextModel, prompt: list[int], where: Placement,
              account: str) -> list[SessionSpec]:
        """The request's sessions (n of them, seeds derived), refused before any work when the prompt does not
        fit the worker's context."""
        if len(prompt) >= where.ctx:
            raise bad_request(f"This model's maximum context length is {where.ctx} tokens; the prompt has "
                              f"{len(prompt)} tokens", param="messages" if hasattr(req, "messages") else "prompt",
                              code="context_length_exceeded")
        room = min(where.ctx - len(prompt), MAX_GENERATE)
        asked = req.limit()
        if asked is not None and asked > room:
            raise bad_request(f"This model's maximum context length is {where.ctx} tokens; the prompt has "
                              f"{len(prompt)} tokens and {asked} were asked for (at most {room})",
                              param="max_tokens", code="context_length_exceeded")
        seed = req.seed if req.seed is not None else secrets.randbits(62)
        bias = tuple(sorted(_bias(req.logit_bias, model.tokenizer.vocab_size).items()))
        sampling = dict(temperature=float(req.temperature), top_p=float(req.top_p), top_k=req.top_k,
                        min_p=float(req.min_p), presence_penalty=float(req.presence_penalty),
                        frequency_penalty=float(req.frequency_penalty), repetition_penalty=float(req.repeat_penalty),
                        logit_bias=bias, logprobs=req.logprobs_n(), json_schema=_schema(req))
        rid = uuid.uuid4().hex[:20]
        try:
            return [SessionSpec(session_id=f"srv-{rid}-{i}", account_id=account,
                                route=(RouteHop(worker_id=where.worker_id, key=where.key),),
                                sampling=Sampling(**sampling, seed=seed + i),  # type: ignore[arg-type]
                                max_tokens=asked or room,
                                stop_tokens=() if req.ignore_eos else model.tokenizer.stop_tokens)
                    for i in range(req.n)]
        except ValueError as e:
            raise bad_request(str(e).splitlines()[-1] if str(e) else "invalid sampling", param="response_format"
                              if "schema" in str(e) else None) from None

    async def events(self, specs: list[SessionSpec], prompt: list[int]
                     ) -> AsyncIterator[tuple[int, StepResult] | dict[str, SessionHandle]]:
        """(choice index, result) for each answer as it comes, then the handles by session id. Leaving early
        (the iterator closed or cancelled) cancels every unfinished session on its worker."""
        index = {s.session_id: i for i, s in enumerate(specs)}
        queue: asyncio.Queue[tuple[int, StepResult] | dict[str, SessionHandle] | BaseException] = asyncio.Queue()

        def on_result(h: SessionHandle, r: StepResult) -> None:
            queue.put_nowait((index[h.session_id], r))

        async def run() -> None:
            try:
                queue.put_nowait(await self.producer.run_many([(s, prompt) for s in specs], on_result=on_result))
            except BaseException as e:
                queue.put_nowait(e)
                raise

        task = asyncio.ensure_future(run())
        done = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Backpressure):
                    raise overloaded(str(item)) from None
                if isinstance(item, ApiError):
                    raise item
                if isinstance(item, (ValueError, TypeError)):  # the producer's checks (a token outside the vocab)
                    raise bad_request(str(item)) from None
                if isinstance(item, ProducerError):  # a worker lost or silent past the timeout: an error event
                    raise ApiError(502, f"the session failed on the worker: {item}", type="server_error",
                                   code="worker_failed") from None
                if isinstance(item, LookupError):
                    raise unavailable(str(item)) from None
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, dict):
                    done = True
                    yield item
                    return
                yield item
        finally:
            if not done:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                await asyncio.shield(self._cancel(specs))

    async def _cancel(self, specs: list[SessionSpec]) -> None:
        for s in specs:
            with contextlib.suppress(Exception):
                await self.producer.cancel(s.route[0].worker_id, s.session_id)


def _bias(logit_bias: dict[str, float] | None, vocab: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for k, v in (logit_bias or {}).items():
        if not k.isdigit() or not 0 <= int(k) < vocab:
            raise bad_request(f"logit_bias key {k[:40]!r} is not a token id in [0, {vocab})", param="logit_bias")
        if not -100.0 <= float(v) <= 100.0:
            raise bad_request(f"logit_bias value {v} is outside [-100, 100]", param="logit_bias")
        out[int(k)] = float(v)
    return out


def _schema(req: Generation) -> str | None:
    import json

    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return json.dumps({"type": "object"})
    assert rf.json_schema is not None
    return json.dumps(rf.json_schema.schema_)
