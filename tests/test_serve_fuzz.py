"""Hostile requests into `dgr serve`, drawn by hypothesis: any JSON value in any field the endpoints read (and
in fields they do not), nesting past any parser's recursion limit, bytes that are not JSON. Whatever comes in,
the answer is never a 5xx: a refusal has OpenAI's error shape and starts nothing on a worker; an accepted
request answers in OpenAI's shape (streamed: chunks, then `[DONE]`). A real redis-server and a tiny-model
consumer; the app in process (httpx's ASGI transport), one app for every example."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

from dgrtools.localredis import LocalRedis  # noqa: E402
from gateway.app import ServeConfig, make_app  # noqa: E402
from gateway.text import TextModel  # noqa: E402
from schemas import WorkerKeys  # noqa: E402
from tests.serve_support import serving_alone  # noqa: E402

WORKER = "w-fuzz"
KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
          "stop", "presence_penalty", "frequency_penalty", "logit_bias", "n", "stream", "stream_options",
          "response_format", "user", "top_k", "min_p", "repeat_penalty", "ignore_eos", "logprobs", "top_logprobs",
          "echo", "tools", "suffix", "best_of"]


class App:
    """One app (one producer, one lifespan) on its own event loop, for every example."""

    def __init__(self, config: ServeConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.app = make_app(config)
        self.lifespan = self.app.router.lifespan_context(self.app)
        self.loop.run_until_complete(self.lifespan.__aenter__())
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://t",
                                        timeout=60)

    def post(self, path: str, content: bytes, headers: dict[str, str] = AUTH) -> httpx.Response:
        return self.loop.run_until_complete(self.client.post(path, content=content, headers=headers))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self.lifespan.__aexit__(None, None, None))
        self.loop.close()


@pytest.fixture(scope="module")
def worker(redis_server: LocalRedis, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[redis.Redis]:
    with serving_alone(redis_server.url, WORKER, tiny_model_path, tmp_path_factory.mktemp("fuzz-logs"),
                       slots=4) as client:
        yield client


@pytest.fixture(scope="module")
def app(worker: redis.Redis, redis_server: LocalRedis, tiny_model_path: Path) -> Iterator[App]:
    a = App(ServeConfig(redis_url=redis_server.url, models=[TextModel.load("tiny", tiny_model_path)],
                        api_keys={KEY: "acct-fuzz"}, max_body_bytes=256 * 1024))
    yield a
    a.close()


def started(client: redis.Redis) -> int:
    """Session records on the worker: what any session opened writes (a refusal leaves their count)."""
    return sum(1 for _ in client.scan_iter(match=WorkerKeys(WORKER).session_record("*")))


# Values a client could mean (half the draws of a field that has some), so that accepted requests are drawn too
PLAUSIBLE: dict[str, list[Any]] = {
    "temperature": [0, 0.7, 2], "top_p": [0.5, 1], "seed": [0, 7, 2**62], "stop": ["x", ["a", "b"], None],
    "n": [1, 2], "stream": [True, False], "stream_options": [{"include_usage": True}],
    "logprobs": [True, 2, None], "top_logprobs": [0, 3], "top_k": [0, 40], "min_p": [0.05], "ignore_eos": [True],
    "repeat_penalty": [1.1], "presence_penalty": [0.5, -2], "logit_bias": [{"5": 10}, {}], "user": ["u1"],
    "response_format": [{"type": "json_object"}, {"type": "text"},
                        {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
                            "a": {"type": "integer"}}}}}],
    "messages": [[{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text",
                                                                                        "text": "hi"}]}]],
    "prompt": [[5, 6, 7], ["one"], "x" * 40],
    "best_of": [1, 2, 3],
    "suffix": ["", "tail"],
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)


def _bounded(body: dict[str, Any]) -> dict[str, Any]:
    """Keep an accepted request short (a few tokens, a few choices): the fuzz is in the shapes, not the load."""
    for k, cap in (("max_tokens", 3), ("max_completion_tokens", 3), ("n", 2)):
        v = body.get(k)
        if type(v) is int and v > cap:
            body[k] = cap
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 3
    return body


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    chat = draw(st.booleans())
    base: dict[str, Any] = {"model": "tiny", "max_tokens": 3}
    if chat:
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    fields = draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True))
    changed = {f: draw(st.sampled_from(PLAUSIBLE[f]) if f in PLAUSIBLE and draw(st.booleans()) else json_values)
               for f in fields}  # a strategy either way, then drawn
    dropped = draw(st.sets(st.sampled_from(sorted(base)), max_size=1))
    body = {k: v for k, v in {**base, **changed}.items() if k not in dropped}
    return ("/v1/chat/completions" if chat else "/v1/completions"), _bounded(body)


def check(r: httpx.Response, before: int, client: redis.Redis, stream: bool) -> None:
    assert r.status_code < 500, r.text[:500]
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        if r.status_code != 429:
            assert started(client) == before, r.text[:300]
        return
    if stream:
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-300:]
        for e in events[:-1]:
            assert "choices" in json.loads(e) or "error" in json.loads(e)
    else:
        assert r.json()["choices"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(bodies())
def test_any_json_in_any_field_is_answered_in_openai_shape(app: App, worker: redis.Redis,
                                                           case: tuple[str, dict[str, Any]]) -> None:
    path, body = case
    before = started(worker)
    r = app.post(path, json.dumps(body).encode())  # json.dumps writes NaN and Infinity as a hostile client would
    event(f"status {r.status_code}")
    check(r, before, worker, body.get("stream") is True)


NESTED = [
    ("nested arrays past the parser's depth", b"[" * 50_000 + b"]" * 50_000),
    ("nested objects past the parser's depth", b'{"a":' * 30_000 + b"1" + b"}" * 30_000),
    ("deep value in a known field", b'{"model":"tiny","prompt":"hi","logit_bias":' + b"[" * 50_000 + b"]" * 50_000
     + b"}"),
    ("deep json_schema", b'{"model":"tiny","prompt":"hi","max_tokens":2,"response_format":{"type":"json_schema",'
     b'"json_schema":{"schema":' + b'{"type":"object","properties":{"a":' * 300 + b'{"type":"string"}'
     + b"}}" * 300 + b"}}}"),
    ("huge integer", b'{"model":"tiny","prompt":"hi","max_tokens":' + b"9" * 5000 + b"}"),
    ("lone surrogate", b'{"model":"tiny","prompt":"\\ud800"}'),
    ("NUL in the model", b'{"model":"ti\\u0000ny","prompt":"hi"}'),
]


@pytest.mark.parametrize(("name", "raw"), NESTED, ids=[n for n, _ in NESTED])
def test_nesting_and_odd_values_are_refused_or_served(app: App, worker: redis.Redis, name: str, raw: bytes) -> None:
    before = started(worker)
    r = app.post("/v1/completions", raw)
    check(r, before, worker, False)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_any_bytes_are_refused_in_openai_shape(app: App, worker: redis.Redis, raw: bytes) -> None:
    before = started(worker)
    r = app.post("/v1/chat/completions", raw)
    check(r, before, worker, False)


@pytest.mark.parametrize(("levels", "code"), [(64, "invalid_value"), (65, "invalid_json")])
def test_the_depth_limit_is_64_levels(app: App, worker: redis.Redis, levels: int, code: str) -> None:
    """The body object is a level: 63 arrays inside it pass the depth check (and are then refused as the
    wrong type for `user`), 64 are refused as too deep."""
    inner = levels - 1
    raw = b'{"model":"tiny","prompt":"hi","user":' + b"[" * inner + b"]" * inner + b"}"
    r = app.post("/v1/completions", raw)
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text[:300]
