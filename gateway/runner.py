"""Sessions for HTTP requests over ONE AsyncProducer: which key serves a model (`choose_key`, the one place), the
SessionTemplates a request becomes (the producer places each on a worker by load and cached prefix, and moves it
off a worker lost mid-answer: docs/placement.md), and a stream of (choice, token result) events; a caller that
stops listening (a client gone, a stop string met) cancels its unfinished sessions on the worker each runs on
now (the cancel marker)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

from producer import AsyncProducer, Backpressure, ProducerError, SessionHandle, SessionTemplate
from producer.validate import WorkerInfo
from schemas import CompatibilityKey, Sampling, StepResult
from schemas.limits import MAX_GENERATE

from .api import Generation
from .errors import ApiError, bad_request, overloaded, unavailable
from .text import TextModel


@dataclass(frozen=True)
class Placement:
    """The key a model's sessions are opened with, and the live workers advertising it (the producer's
    placement picks one of them per session)."""

    key: CompatibilityKey
    workers: tuple[str, ...]

    @property
    def ctx(self) -> int:
        return self.key.recipe.ctx_per_session


def serving(info: WorkerInfo, model: TextModel) -> CompatibilityKey | None:
    """The worker's key for the model's weights (its GGUF's sha256), whole model (tokens in, logits out)."""
    return next((k for k in info.keys if k.engine.gguf_sha256 == model.sha256 and k.boundary.consumes == "tokens"
                 and k.boundary.produces == "logits"), None)


def choose_key(fleet: Sequence[WorkerInfo], model: TextModel) -> Placement:
    """THE choice of the key a model's sessions use: the one most live workers advertise for its weights (ties:
    the lowest worker id), so placement has the most workers to choose from. 503 when workers advertise the
    model but none is up. The worker itself is placement's choice, per session (SessionTemplate)."""
    advertising = [(w, k) for w in sorted(fleet, key=lambda w: w.worker_id) if (k := serving(w, model)) is not None]
    by_key: dict[tuple[str, str], tuple[CompatibilityKey, list[str]]] = {}  # by the digests placement matches
    for w, k in advertising:
        if w.alive:
            by_key.setdefault((k.for_phase("prefill").digest, k.for_phase("decode").digest), (k, []))[1].append(
                w.worker_id)
    if not by_key:
        raise unavailable(f"no worker is up for model {model.name!r}"
                          + (f" ({len(advertising)} advertise it, none has a heartbeat)" if advertising else ""))
    key, workers = max(by_key.values(), key=lambda kw: len(kw[1]))  # the first of equals: by worker id
    return Placement(key, tuple(workers))


def cached_tokens(handles: Sequence[SessionHandle]) -> int:
    """Prompt tokens the workers charged as restored from their prefix cache (a part of prompt_tokens): the one
    place it is read."""
    return sum(h.cached_tokens for h in handles)


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
    discover_cache_s (ProducerSettings), by placement."""

    def __init__(self, producer: AsyncProducer) -> None:
        self.producer = producer
        # model name -> (the fleet read it was chosen from, its Placement): choose_key passes over every worker id
        # ever registered, once per fleet read, not once per request
        self._placed: dict[str, tuple[list[WorkerInfo], Placement]] = {}

    async def fleet(self) -> list[WorkerInfo]:
        """The fleet as placement read it last (AsyncProducer.fleet_now: one read a discover_cache_s, shared with
        the sessions' placement, which read it apart before: twice the heartbeats and advertisements parsed)."""
        return cast("list[WorkerInfo]", await self.producer.fleet_now())  # the list itself: `place` keys on it

    async def place(self, model: TextModel) -> Placement:
        fleet = await self.fleet()
        got = self._placed.get(model.name)
        if got is None or got[0] is not fleet:  # a refusal (no worker up) is not kept: asked again next time
            got = self._placed[model.name] = (fleet, choose_key(fleet, model))
        return got[1]

    def sessions(self, req: Generation, model: TextModel, prompt: list[int], where: Placement,
                 account: str) -> Sessions:
        """The request's sessions (n of them, seeds derived), refused before any work when the prompt does not
        fit the key's context or a field does not make a valid SessionSpec."""
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
        if sampling["json_schema"] is not None:
            _check_schema(model, str(sampling["json_schema"]))
        rid = uuid.uuid4().hex[:20]
        stop_tokens = () if req.ignore_eos else model.tokenizer.stop_tokens
        try:
            templates = [SessionTemplate(session_id=f"srv-{rid}-{i}", account_id=account, keys=(where.key,),
                                         options={"sampling": Sampling(**sampling, seed=seed + i),  # type: ignore[arg-type]
                                                  "max_tokens": asked or room, "stop_tokens": stop_tokens})
                         for i in range(req.n)]
            for t in templates:  # the SessionSpec's own checks, here: before placement opens anything
                t.spec(where.workers[:1])
        except ValueError as e:
            raise bad_request(str(e).splitlines()[-1] if str(e) else "invalid sampling", param="response_format"
                              if "schema" in str(e) else None) from None
        return Sessions(self.producer, templates, prompt, stop_tokens)


class Sessions:
    """One request's sessions: opened from templates (placed by the producer), their handles as their answers
    come (`handles`, by choice index: a handle's worker_id is where the session runs now, after any move)."""

    def __init__(self, producer: AsyncProducer, templates: list[SessionTemplate], prompt: list[int],
                 stop_tokens: tuple[int, ...]) -> None:
        self.producer, self.templates, self.prompt, self.stop_tokens = producer, templates, prompt, stop_tokens
        self.handles: dict[int, SessionHandle] = {}
        self._cancelling: set[asyncio.Future[None]] = set()

    async def events(self) -> AsyncIterator[tuple[int, StepResult] | dict[str, SessionHandle]]:
        """(choice index, result) for each answer as it comes, then the handles by session id. The answers are
        driven in the task that streams them (AsyncProducer.stream_many: no queue and no second task per
        answer). Leaving early (the iterator closed or cancelled) cancels every unfinished session on its
        worker."""
        index = {t.session_id: i for i, t in enumerate(self.templates)}
        answers = self.producer.stream_many([(t, self.prompt) for t in self.templates])
        done = False
        try:
            try:
                async for h, r in answers:
                    i = index[h.session_id]
                    self.handles[i] = h
                    yield i, r
            except Exception as e:
                raise _api_error(e) from None
            done = True
            yield answers.handles
        finally:
            if not done:
                # the answers, closed, cancel what they opened (release_abandoned); the cancels below name the
                # workers the answers came from, in case a session moved after its last answer
                with contextlib.suppress(BaseException):
                    await asyncio.shield(answers.aclose())
                await asyncio.shield(self._cancel_all())

    def stop(self, i: int) -> None:
        """Choice i is complete (a stop string): cancel its session where it runs now, without waiting."""
        task = asyncio.ensure_future(self._cancel(self.handles[i]))
        self._cancelling.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._cancelling.discard)

    async def _cancel(self, h: SessionHandle) -> None:
        for w in sorted({leg.worker_id for leg in h.legs}):
            with contextlib.suppress(Exception):
                await self.producer.cancel(w, h.session_id)

    async def _cancel_all(self) -> None:
        for h in self.handles.values():
            if not h.finished:
                await self._cancel(h)


def _api_error(e: BaseException) -> BaseException:
    """What the producer raised, as the HTTP error it is."""
    if isinstance(e, Backpressure):
        return overloaded(str(e))
    if isinstance(e, ApiError):
        return e
    if isinstance(e, (ValueError, TypeError)):  # the producer's checks (a token outside the vocab)
        return bad_request(str(e))
    if isinstance(e, ProducerError):  # a worker lost or silent past the timeout, and no other to move to
        return ApiError(502, f"the session failed on the worker: {e}", type="server_error", code="worker_failed")
    if isinstance(e, LookupError):  # placement found no eligible worker (all draining, or stale)
        return unavailable(str(e))
    return e


def _bias(logit_bias: dict[str, float] | None, vocab: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for k, v in (logit_bias or {}).items():
        if not k.isdigit() or not 0 <= int(k) < vocab:
            raise bad_request(f"logit_bias key {k[:40]!r} is not a token id in [0, {vocab})", param="logit_bias")
        if not -100.0 <= float(v) <= 100.0:
            raise bad_request(f"logit_bias value {v} is outside [-100, 100]", param="logit_bias")
        out[int(k)] = float(v)
    return out


def _check_schema(model: TextModel, schema: str) -> None:
    """A JSON schema the workers could not run is refused here, before any session starts (a worker would
    refuse the opening: grammar_invalid): converted to GBNF as they convert it, compiled on the model's own
    vocabulary by llama.cpp as they compile it."""
    from consumer.sampling.grammar import GrammarInvalid, gbnf_of

    try:
        gbnf = gbnf_of(Sampling(json_schema=schema))
    except GrammarInvalid as e:
        raise bad_request(f"response_format: the JSON schema does not convert to a grammar ({e})"[:300],
                          param="response_format", code="invalid_value") from None
    if gbnf is not None and model.tokenizer.grammar_compiles(gbnf) is False:
        raise bad_request("response_format: the JSON schema's grammar does not compile", param="response_format",
                          code="invalid_value")


def _schema(req: Generation) -> str | None:
    import json

    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return json.dumps({"type": "object"})
    assert rf.json_schema is not None
    return json.dumps(rf.json_schema.schema_)
