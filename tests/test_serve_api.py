"""`dgr serve` driven by the official `openai` client (sync and async, streaming and not, both endpoints) against
a started redis-server, a tiny-model consumer and `dgr serve` (one stack for the module)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from dgrtools.localredis import LocalRedis, free_port  # noqa: E402
from dgrtools.process import ConsumerProcess  # noqa: E402
from dgrtools.tokenizer import Tokenizer  # noqa: E402
from gateway.stack import ServeProcess  # noqa: E402
from producer import Producer  # noqa: E402
from schemas import RouteHop, Sampling, SessionSpec, WorkerKeys  # noqa: E402
from tests.serve_support import tiny_worker  # noqa: E402

WORKER = "w-serve"


@dataclass
class Stack:
    redis_url: str
    url: str
    model_path: Path
    consumer: ConsumerProcess

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def stack(redis_server: LocalRedis, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("serve-logs")
    redis.Redis.from_url(redis_server.url).flushall()
    with tiny_worker(redis_server.url, WORKER, tiny_model_path, logs, slots=4,
                     extra=["--prefix-cache-bytes", str(16 << 20)]) as consumer, \
            ServeProcess(redis_server.url, [f"tiny={tiny_model_path}"], free_port(), logs) as serve:
        yield Stack(redis_server.url, serve.url, tiny_model_path, consumer)


def alone(stack: Stack, prompt: list[int], max_tokens: int, sampling: Sampling) -> list[int]:
    """The same tokens as one session straight through the producer: the oracle."""
    client = redis.Redis.from_url(stack.redis_url)
    p = Producer(client)
    key = p.discover(WORKER).keys[0]
    spec = SessionSpec(session_id=f"alone-{time.monotonic_ns()}", account_id="oracle", max_tokens=max_tokens,
                       route=(RouteHop(worker_id=WORKER, key=key),), sampling=sampling, stop_tokens=(2,))
    return list(p.generate(spec, prompt))


def text_of(tok: Tokenizer, tokens: list[int]) -> str:
    return b"".join(tok.piece_bytes(t) for t in tokens if t != 2).decode("utf-8", errors="replace")


def test_models_lists_the_served_model(stack: Stack) -> None:
    models = stack.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_text_equals_the_model_alone(stack: Stack) -> None:
    tok = Tokenizer(stack.model_path, "llama")
    prompt = "The capital of France is"
    r = stack.client().completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    ids = tok.encode(prompt)
    want = alone(stack, ids, 12, Sampling())
    assert r.choices[0].text == text_of(tok, want)
    assert r.usage.prompt_tokens == len(ids)  # what the worker charged: every prompt position once
    assert r.usage.completion_tokens == len(want)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.choices[0].finish_reason in ("length", "stop")


def test_streamed_completion_equals_the_whole(stack: Stack) -> None:
    c = stack.client()
    whole = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, seed=7, temperature=0.9)
    parts, usage = [], None
    for chunk in c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, seed=7,
                                      temperature=0.9, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        parts.extend(ch.text for ch in chunk.choices)
    assert "".join(parts) == whole.choices[0].text
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_chat_sync_and_streaming(stack: Stack) -> None:
    c = stack.client()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "The capital of France"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, seed=3)
    assert r.choices[0].message.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=10, seed=3, stream=True) if ch.choices)
    assert streamed == r.choices[0].message.content
    # the documented tiny template: "role: content" lines, then "assistant:"
    tok = Tokenizer(stack.model_path, "llama")
    ids = tok.encode("system: be brief\nuser: The capital of France\nassistant:")
    assert r.usage.prompt_tokens == len(ids)
    want = alone(stack, ids, 10, Sampling(temperature=1.0, seed=3))
    assert r.choices[0].message.content == text_of(tok, want)


def test_async_client_streams_concurrently(stack: Stack) -> None:
    async def one(c: openai.AsyncOpenAI, seed: int) -> tuple[str, str]:
        kw = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, seed=seed)
        whole = await c.chat.completions.create(**kw)
        parts = [ch.choices[0].delta.content or "" async for ch in await c.chat.completions.create(**kw, stream=True)
                 if ch.choices]
        return whole.choices[0].message.content, "".join(parts)

    async def main() -> list[tuple[str, str]]:
        c = stack.aclient()
        try:
            return await asyncio.gather(*(one(c, s) for s in range(4)))
        finally:
            await c.close()

    for whole, streamed in asyncio.run(main()):
        assert whole == streamed


def test_logprobs_both_shapes(stack: Stack) -> None:
    c = stack.client()
    r = c.completions.create(model="tiny", prompt="hello", max_tokens=5, logprobs=2, seed=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    ch = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                   logprobs=True, top_logprobs=3, seed=1)
    content = ch.choices[0].logprobs.content
    assert len(content) == ch.usage.completion_tokens
    assert all(len(t.top_logprobs) <= 3 and t.logprob <= 0 for t in content)


def test_streamed_text_offsets_count_the_text_before(stack: Stack) -> None:
    """A streamed completion's logprobs.text_offset: where each chunk's text starts in the whole text (as OpenAI's
    legacy completions), equal to the non-streamed answer's offsets."""
    c = stack.client()
    args: dict[str, Any] = dict(model="tiny", prompt="Once upon a time", max_tokens=24, seed=3, temperature=0.9,
                                logprobs=1)
    whole = c.completions.create(**args)
    text, offsets = "", []
    for chunk in c.completions.create(**args, stream=True):
        for ch in chunk.choices:
            if ch.logprobs is not None and ch.logprobs.text_offset:
                assert ch.logprobs.text_offset[0] == len(text)
                offsets.extend(ch.logprobs.text_offset)
            text += ch.text
    assert text == whole.choices[0].text
    assert offsets == whole.choices[0].logprobs.text_offset


def test_json_schema_answers_parse(stack: Stack) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "enum": ["yes", "no"]}}, "required": ["a"],
              "additionalProperties": False}
    r = stack.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "answer"}], max_tokens=64, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert json.loads(r.choices[0].message.content)["a"] in ("yes", "no")


def test_stop_string_is_never_sent(stack: Stack) -> None:
    c = stack.client()
    kw = dict(model="tiny", prompt="The world", max_tokens=24, temperature=0)
    full = c.completions.create(**kw).choices[0].text
    printable = [i for i in range(2, len(full) - 2) if full[i:i + 2].isprintable() and full[i:i + 2].strip()]
    assert printable, full
    stop = full[printable[0]:printable[0] + 2]
    want = full[:full.find(stop)]
    r = c.completions.create(**kw, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(**kw, stop=stop, stream=True) if ch.choices)
    assert streamed == want


def test_n_choices_are_sessions_with_derived_seeds(stack: Stack) -> None:
    c = stack.client()
    r = c.completions.create(model="tiny", prompt="hello", max_tokens=6, n=3, seed=11)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    for ch in r.choices:
        one = c.completions.create(model="tiny", prompt="hello", max_tokens=6, seed=11 + ch.index)
        assert one.choices[0].text == ch.text
    single = c.completions.create(model="tiny", prompt="hello", max_tokens=6, seed=11)
    assert r.usage.prompt_tokens == 3 * single.usage.prompt_tokens  # each session's prompt is charged


def test_cached_tokens_are_the_prefix_cache_charge(stack: Stack) -> None:
    """The worker runs a prefix cache: a prompt of several 16-token blocks sent again is restored but for the two
    rows always computed (whole blocks, then token by token), and usage says how much (what the worker charged
    as cached, a part of prompt_tokens); the text is the same."""
    prompt = " ".join(f"word{i}" for i in range(40))  # a prompt no other test sends: nothing cached yet
    c = stack.client()
    first = c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    again = c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens >= 48
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == again.usage.prompt_tokens - 2, cached
    assert again.choices[0].text == first.choices[0].text


def test_disconnect_cancels_the_session_on_the_worker(stack: Stack) -> None:
    client = redis.Redis.from_url(stack.redis_url)
    keys = WorkerKeys(WORKER)
    before = set(client.scan_iter(match=keys.cancel_marker("*")))
    stream = stack.client().completions.create(model="tiny", prompt="hello", max_tokens=900, stream=True, seed=1,
                                               extra_body={"ignore_eos": True})  # it cannot end on its own
    for _ in zip(range(3), stream, strict=False):
        pass
    stream.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        new = set(client.scan_iter(match=keys.cancel_marker("*"))) - before
        if new:
            break
        time.sleep(0.05)
    assert new, "no cancel marker was set for the abandoned session"
    (marker,) = new
    sid = marker.decode().rsplit(":", 1)[1]
    acct = client.hgetall(keys.session_account(sid))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the worker stops it well before 900 tokens
        hb = stack.consumer.heartbeat() or {}
        if hb.get("busy_slots") == 0:
            break
        time.sleep(0.1)
    assert (stack.consumer.heartbeat() or {}).get("busy_slots") == 0
    assert acct is not None


def test_clients_leaving_mid_stream_leave_the_other_streams_whole(stack: Stack) -> None:
    """Streams closed mid-answer, one after another, while two others stream on (the worker has 4 slots): each
    leaving cancels its own session (the producer's abandoned cancels, sent from the leaving request's task while
    the pump sends others), and every stream that stays gets all its tokens, the text of the same request alone."""
    from concurrent.futures import ThreadPoolExecutor

    c = stack.client()
    alone = {k: c.completions.create(model="tiny", prompt=f"stay {k}", max_tokens=40, seed=k,
                                     extra_body={"ignore_eos": True}).choices[0].text for k in range(2)}

    def stay(k: int) -> str:
        stream = c.completions.create(model="tiny", prompt=f"stay {k}", max_tokens=40, stream=True, seed=k,
                                      extra_body={"ignore_eos": True})
        return "".join(ch.choices[0].text for ch in stream if ch.choices)

    def leave(k: int) -> None:
        for j in range(8):
            stream = c.completions.create(model="tiny", prompt=f"leave {k} {j}", max_tokens=900, stream=True,
                                          seed=j, extra_body={"ignore_eos": True})
            for _ in zip(range(1 + j % 3), stream, strict=False):
                pass
            stream.close()

    with ThreadPoolExecutor(3) as pool:
        stays = [pool.submit(stay, k) for k in range(2)]
        leaves = [pool.submit(leave, 0)]
        for f in leaves:
            f.result(60)
        assert {k: f.result(60) for k, f in enumerate(stays)} == alone


def test_a_non_streaming_client_that_disconnects_cancels_its_session(stack: Stack) -> None:
    """Raw HTTP: a socket sends a whole (not streamed) request and closes once its session is open; the gateway,
    watching for `http.disconnect`, cancels the session (no reaper): the cancel marker is set, the session ends
    `cancelled` (900 tokens asked, ignore_eos: it could not end on its own that soon), and the worker's slot is
    freed."""
    client = redis.Redis.from_url(stack.redis_url)
    keys = WorkerKeys(WORKER)
    before = set(client.scan_iter(match=keys.session_record("srv-*")))
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 900, "ignore_eos": True, "seed": 2}).encode()
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 20
        while not (new := set(client.scan_iter(match=keys.session_record("srv-*"))) - before):
            assert time.monotonic() < deadline, "the request opened no session"
            time.sleep(0.002)
    # the socket is closed: the client went away before its answer
    (record,) = new
    sid = record.decode().rsplit(":", 1)[1]
    acct = keys.session_account(sid)
    deadline = time.monotonic() + 20
    while not client.hexists(acct, "closed") or (stack.consumer.heartbeat() or {}).get("busy_slots") != 0:
        assert time.monotonic() < deadline, f"the worker still holds the session: {client.hgetall(acct)}"
        time.sleep(0.05)
    assert client.exists(keys.cancel_marker(sid)), "no cancel marker was set for the abandoned session"
    assert client.hget(acct, "closed") == b"cancelled", client.hgetall(acct)
    assert int(client.hget(acct, "generated_tokens") or 0) < 900
