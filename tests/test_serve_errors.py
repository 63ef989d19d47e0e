"""Every refusal of `dgr serve` in OpenAI's error shape, by raw HTTP (httpx on the app in process), against a
real redis-server and a tiny-model consumer; after each, nothing started on a worker (no session record, no
prefill job)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

from dgrtools.localredis import LocalRedis  # noqa: E402
from dgrtools.tiny_model import write_tiny_model  # noqa: E402
from gateway.app import ServeConfig, make_app  # noqa: E402
from gateway.text import TextModel  # noqa: E402
from producer import ProducerSettings  # noqa: E402
from schemas import WorkerKeys  # noqa: E402
from schemas.keys import WORKERS_INDEX  # noqa: E402
from tests.serve_support import serving_alone  # noqa: E402

WORKER, STUCK = "w-err", "w-stuck"
KEY = "sk-good"


@pytest.fixture(scope="module")
def worker(redis_server: LocalRedis, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[redis.Redis]:
    with serving_alone(redis_server.url, WORKER, tiny_model_path, tmp_path_factory.mktemp("err-logs"),
                       slots=2) as client:
        yield client


@pytest.fixture(scope="module")
def models(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[TextModel]:
    other = tmp_path_factory.mktemp("other") / "tiny-s1.gguf"
    write_tiny_model(other, seed=1)  # advertised by nobody
    return [TextModel.load("tiny", tiny_model_path), TextModel.load("other", other)]


def started(client: redis.Redis, worker_id: str = WORKER) -> tuple[int, int]:
    """Session records and prefill jobs on the worker: what any session opened would have written."""
    k = WorkerKeys(worker_id)
    records = sum(1 for _ in client.scan_iter(match=k.session_record("*")))
    jobs = sum(client.xlen(s) for s in client.scan_iter(match=k.input_pattern) if s.endswith(b":prefill"))
    return records, jobs


def call(config: ServeConfig, method: str, path: str, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        app = make_app(config)
        async with app.router.lifespan_context(app), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def config(redis_server: LocalRedis, models: list[TextModel], **kw: Any) -> ServeConfig:
    return ServeConfig(redis_url=redis_server.url, models=models, api_keys={KEY: "acct-a"}, max_body_bytes=8192, **kw)


AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CASES: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("wrong type max_tokens", {**CHAT, "max_tokens": 1.5}, 400, "max_tokens"),
    ("negative max_tokens", {**CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ("temperature -1", {**CHAT, "temperature": -1}, 400, "temperature"),
    ("temperature text", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("top_p 2", {**CHAT, "top_p": 2}, 400, "top_p"),
    ("n 0", {**CHAT, "n": 0}, 400, "n"),
    ("empty messages", {**CHAT, "messages": []}, 400, "messages"),
    ("bad role", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("stream not bool", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("logit_bias key", {**CHAT, "logit_bias": {"cat": 1}}, 400, "logit_bias"),
    ("logit_bias value", {**CHAT, "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("top_logprobs without logprobs", {**CHAT, "top_logprobs": 2}, 400, None),
    ("unknown model", {**CHAT, "model": "nope"}, 404, "model"),
    # a schema the workers could not run: refused here, not a 502 after a session started (found by a probe)
    ("json_schema that does not convert", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, 400, "response_format"),
    ("json_schema whose grammar does not compile", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}}}, 400, "response_format"),
]


@pytest.mark.parametrize(("name", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_refusals_in_openai_shape(worker: redis.Redis, redis_server: LocalRedis, models: list[TextModel],
                                  name: str, body: dict[str, Any], status: int, param: str | None) -> None:
    before = started(worker)
    r = call(config(redis_server, models), "POST", "/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    assert started(worker) == before


COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
COMPLETION_CASES: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("echo", {**COMPLETION, "echo": True}, 400, "echo"),
    ("suffix", {**COMPLETION, "suffix": "and then"}, 400, "suffix"),
    ("best_of above n", {**COMPLETION, "best_of": 3}, 400, "best_of"),
    ("best_of above n of 2", {**COMPLETION, "n": 2, "best_of": 3}, 400, "best_of"),
    ("two prompts", {**COMPLETION, "prompt": ["a", "b"]}, 400, "prompt"),
    ("a token outside the vocabulary", {**COMPLETION, "prompt": [1, 2, 10**9]}, 400, "prompt"),
]


@pytest.mark.parametrize(("name", "body", "status", "param"), COMPLETION_CASES, ids=[c[0] for c in COMPLETION_CASES])
def test_completion_refusals_in_openai_shape(worker: redis.Redis, redis_server: LocalRedis, models: list[TextModel],
                                             name: str, body: dict[str, Any], status: int, param: str | None) -> None:
    """Fields of OpenAI's completions that would change the answer dgr gives are refused, not ignored (a probe
    found suffix and best_of served as if absent); nothing starts on a worker."""
    before = started(worker)
    r = call(config(redis_server, models), "POST", "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    assert started(worker) == before


@pytest.mark.parametrize("extra", [{"best_of": 1}, {"best_of": 2, "n": 2}, {"suffix": ""}, {"suffix": None}])
def test_best_of_as_n_and_an_empty_suffix_are_served(worker: redis.Redis, redis_server: LocalRedis,
                                                     models: list[TextModel], extra: dict[str, Any]) -> None:
    r = call(config(redis_server, models), "POST", "/v1/completions", json={**COMPLETION, **extra}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == extra.get("n", 1)


RAW: list[tuple[str, bytes, int, str]] = [
    ("malformed JSON", b'{"model": "tiny", "messages": [', 400, "invalid_json"),
    ("invalid UTF-8", b'{"model": "tiny\xff\xfe", "messages": []}', 400, "invalid_encoding"),
    ("not an object", b'[1, 2]', 400, "invalid_json"),
    ("too big", b'{"model": "tiny", "pad": "' + b"x" * 20000 + b'"}', 413, "request_too_large"),
]


@pytest.mark.parametrize(("name", "raw", "status", "code"), RAW, ids=[c[0] for c in RAW])
def test_hostile_bodies(worker: redis.Redis, redis_server: LocalRedis, models: list[TextModel],
                        name: str, raw: bytes, status: int, code: str) -> None:
    before = started(worker)
    r = call(config(redis_server, models), "POST", "/v1/completions", content=raw,
             headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert started(worker) == before


def test_keys_bill_their_account_and_a_bad_key_gets_401(worker: redis.Redis, redis_server: LocalRedis,
                                                        models: list[TextModel]) -> None:
    cfg = config(redis_server, models)
    before = started(worker)
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = call(cfg, "POST", "/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert call(cfg, "GET", "/v1/models").status_code == 401
    assert started(worker) == before
    r = call(cfg, "POST", "/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.status_code == 200, r.text
    assert started(worker) != before  # the probe sees a session that did start
    billed = worker.hgetall(WorkerKeys(WORKER).billing_account("acct-a"))
    assert billed, "the key's account was not charged"


def test_prompt_over_the_context_names_the_limit(worker: redis.Redis, redis_server: LocalRedis,
                                                 models: list[TextModel]) -> None:
    before = started(worker)
    r = call(config(redis_server, models), "POST", "/v1/completions", headers=AUTH,
             json={"model": "tiny", "prompt": [5] * 1100, "max_tokens": 4})
    assert r.status_code == 400 and "1024" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = call(config(redis_server, models), "POST", "/v1/completions", headers=AUTH,
             json={"model": "tiny", "prompt": [5] * 1000, "max_tokens": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert started(worker) == before


def test_no_worker_up_is_503(worker: redis.Redis, redis_server: LocalRedis, models: list[TextModel]) -> None:
    r = call(config(redis_server, models), "POST", "/v1/chat/completions", headers=AUTH,
             json={**CHAT, "model": "other"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    # the request's own fault is answered first, as when the prompt was read before the fleet
    r = call(config(redis_server, models), "POST", "/v1/completions", headers=AUTH,
             json={"model": "other", "prompt": [1, 10**6], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_backpressure_is_429_with_retry_after(worker: redis.Redis, redis_server: LocalRedis,
                                              models: list[TextModel]) -> None:
    """A worker (advertising the real worker's keys, in another database) whose prefill stream holds one job no
    one reads, and max_lag 0: the gateway answers 429 and pushes nothing."""
    stuck = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/1")
    stuck.flushdb()
    spec = worker.get(WorkerKeys(WORKER).spec)
    stuck.set(WorkerKeys(STUCK).spec, spec)
    stuck.set(WorkerKeys(STUCK).heartbeat, json.dumps({"ts": 1e12}))
    stuck.sadd(WORKERS_INDEX, STUCK)
    key_json = json.loads(spec)["keys"]
    from schemas import CompatibilityKey

    prefill = next(CompatibilityKey.model_validate_json(json.dumps(k)) for k in key_json if k["phase"] == "prefill")
    stuck.xadd(WorkerKeys(STUCK).input_stream(prefill.digest, "prefill"), {"x": "1"})
    before = started(stuck, STUCK)
    cfg = ServeConfig(redis_url=redis_server.url.rsplit("/", 1)[0] + "/1", models=models,
                      producer=ProducerSettings(max_lag=0))
    r = call(cfg, "POST", "/v1/chat/completions", json=CHAT)
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "backpressure"
    assert started(stuck, STUCK) == before
    stuck.flushdb()


def test_more_choices_than_free_slots_is_429_and_frees_what_it_took(worker: redis.Redis, redis_server: LocalRedis,
                                                                   models: list[TextModel]) -> None:
    """n = 3 on a worker of 2 slots: the third session is refused for a slot (reason capacity), so the request
    is 429 with Retry-After (the client retries), not a 502; the two sessions it got end, and the next
    request is served."""
    body = {**CHAT, "n": 3, "max_tokens": 32}
    r = call(config(redis_server, models), "POST", "/v1/chat/completions", headers=AUTH, json=body)
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "backpressure"
    r = call(config(redis_server, models), "POST", "/v1/chat/completions", headers=AUTH, json={**CHAT, "n": 2})
    assert r.status_code == 200, r.text


def test_health_metrics_playground(worker: redis.Redis, redis_server: LocalRedis, models: list[TextModel]) -> None:
    cfg = ServeConfig(redis_url=redis_server.url, models=models)
    assert call(cfg, "GET", "/health").json()["workers_up"] >= 1
    assert "dgr_serve_requests" in call(cfg, "GET", "/metrics").text
    page = call(cfg, "GET", "/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text


def test_worker_packages_never_import_the_gateway() -> None:
    root = Path(__file__).resolve().parents[1]
    for pkg in ("consumer", "producer", "schemas"):
        for f in (root / pkg).rglob("*.py"):
            text = f.read_text()
            bad = [ln for ln in text.splitlines() if ln.strip().startswith(("import gateway", "from gateway"))]
            # consumer/cli.py's `dgr serve` imports it inside the command only (run time, not import time)
            if f.name == "cli.py" and pkg == "consumer":
                assert all(ln.startswith("    ") for ln in bad), bad
            else:
                assert not bad, f"{f} imports the gateway"


def test_redis_unreachable_past_the_bound_is_503_in_openai_shape(models: list[TextModel]) -> None:
    """No Redis at the URL: every endpoint answers, once the producer's outage bound is spent, 503 in OpenAI's
    shape with Retry-After; the Redis address is not in the answer (it goes to the log)."""
    from dgrtools.localredis import free_port

    down = ServeConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0", models=models,
                       producer=ProducerSettings(outage_max_s=0.3))
    for method, path, body in [("POST", "/v1/chat/completions", CHAT),
                               ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
                               ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
                               ("GET", "/v1/models", None), ("GET", "/health", None)]:
        r = call(down, method, path, json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "5", (path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "queue_unavailable" and err["type"] == "server_error", err
        assert "127.0.0.1" not in r.text


def test_a_failure_of_the_server_itself_is_500_in_openai_shape(worker: redis.Redis, redis_server: LocalRedis,
                                                                models: list[TextModel],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug (here: one made to raise) answers 500 in OpenAI's shape, never Starlette's plain text; one after a
    stream's headers ends the stream with an error event and [DONE]."""
    from gateway.app import Gateway

    def broken(*_: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Gateway, "models_body", broken)
    r = call(config(redis_server, models), "GET", "/v1/models", headers=AUTH)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
    monkeypatch.setattr(Gateway, "take", broken)
    r = call(config(redis_server, models), "POST", "/v1/chat/completions", headers=AUTH, json={**CHAT, "stream": True})
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "internal_error", events
    r = call(config(redis_server, models), "POST", "/v1/chat/completions", headers=AUTH, json=CHAT)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text


def test_a_text_too_long_for_the_context_is_refused_before_it_is_tokenized(
        worker: redis.Redis, redis_server: LocalRedis, models: list[TextModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt's text longer than the worker's context could hold (ctx x the vocabulary's longest token in bytes)
    is answered 400 before llama.cpp reads it (a 1 MB chat took Gemma's vocabulary seconds), nothing started."""
    import threading

    from dgrtools.tokenizer import Tokenizer

    read: list[int] = []
    real = Tokenizer.encode

    def encode(self: Tokenizer, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        read.append(len(text))
        return real(self, text, add_bos, special)

    monkeypatch.setattr(Tokenizer, "encode", encode)
    before = started(worker)
    cfg = ServeConfig(redis_url=redis_server.url, models=models, api_keys={KEY: "acct-a"}, max_body_bytes=1 << 20)
    big = "word " * 100_000
    for path, body in (("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": big}]}),
                       ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "w"}] * 5000}),
                       ("/v1/completions", {"model": "tiny", "prompt": big, "max_tokens": 2})):
        r = call(cfg, "POST", path, headers=AUTH, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert not read or max(read) < 10_000, read  # never tokenized
    after = started(worker)  # no record opened, no prefill job pushed (the worker trims answered ones meanwhile)
    assert after[0] == before[0] and after[1] <= before[1], (before, after)
    # a long text that may fit is tokenized on a thread, a short one on the event loop
    from gateway.api import ChatRequest
    from gateway.app import Gateway

    where: list[bool] = []
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, add_bos=True, special=False: (
        where.append(threading.current_thread() is threading.main_thread()) or real(self, text, add_bos, special)))
    gw = Gateway(cfg, None)  # type: ignore[arg-type]  # encode() needs no producer
    for text in ("short", "x" * 20_000):
        req = ChatRequest.model_validate({**CHAT, "messages": [{"role": "user", "content": text}]})
        assert asyncio.run(gw.encode(req, models[0], None))
    assert where == [True, False], where


def test_metrics_count_the_tokens_answered(worker: redis.Redis, redis_server: LocalRedis,
                                          models: list[TextModel]) -> None:
    """dgr_serve_completion_tokens_total: every token answered, streamed or not, as /metrics is scraped."""
    cfg = ServeConfig(redis_url=redis_server.url, models=models)

    async def go() -> list[str]:
        app = make_app(cfg)
        async with app.router.lifespan_context(app), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            seen = []
            for stream in (False, True, False):
                r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3,
                                                           "ignore_eos": True, "stream": stream})
                assert r.status_code == 200, r.text
                metrics = (await c.get("/metrics")).text
                seen += [line for line in metrics.splitlines() if line.startswith("dgr_serve_completion_tokens")]
            return seen

    assert asyncio.run(go()) == ["dgr_serve_completion_tokens_total 3.0", "dgr_serve_completion_tokens_total 6.0",
                                 "dgr_serve_completion_tokens_total 9.0"]
