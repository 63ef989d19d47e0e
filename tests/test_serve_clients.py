"""Clients that hold `dgr serve` without sending a request (gateway/guard.py): silent connections, heads and bodies
sent a byte at a time, heads without end, readers that stop reading. Raw sockets against a started `dgr serve`
(a real redis-server and a tiny-model consumer behind it), with its bounds set low; the reader that stalls against
uvicorn running the guarded protocol in process (filling the kernel's buffers needs more output than a tiny-model
session gives)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from dgrtools.localredis import LocalRedis, free_port  # noqa: E402
from gateway.guard import RESERVED_FDS, ClientBounds, guarded_protocol  # noqa: E402
from gateway.stack import ServeProcess  # noqa: E402
from tests.serve_support import serving_alone  # noqa: E402

HEAD_S, BODY_S, MAX_HEAD, CAP = 1.0, 1.0, 4096, 100
SLACK_S = 8.0  # what a loaded 2-core host may add to a deadline; the bounds are asserted, not timed


@pytest.fixture(scope="module")
def serve(redis_server: LocalRedis, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("clients-logs")
    extra = ["--head-timeout-s", str(HEAD_S), "--max-head-bytes", str(MAX_HEAD), "--body-timeout-s", str(BODY_S),
             "--max-connections", str(CAP)]
    with serving_alone(redis_server.url, "w-clients", tiny_model_path, logs, slots=2), \
            ServeProcess(redis_server.url, [f"tiny={tiny_model_path}"], free_port(), logs, extra=extra) as s:
        yield s.url


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=HEAD_S + SLACK_S)
    return s


def answer(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout here fails the test)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def chat_ok(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop")
    return r.choices[0].message.content or ""


def test_a_silent_connection_is_closed_at_the_head_deadline(serve: str) -> None:
    s = connect(serve)
    t = time.monotonic()
    assert answer(s) == b""  # closed, nothing said: no request was begun
    assert time.monotonic() - t >= HEAD_S * 0.9
    s.close()


def test_a_head_sent_a_byte_at_a_time_is_answered_408(serve: str) -> None:
    """Bytes keep coming, but the head is not complete at the deadline: the connection is closed anyway."""
    s = connect(serve)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 2000
    stop = threading.Event()

    def trickle() -> None:
        for b in head:
            if stop.is_set():
                return
            try:
                s.send(bytes([b]))
            except OSError:
                return
            time.sleep(0.02)

    th = threading.Thread(target=trickle, daemon=True)
    th.start()
    got = answer(s)
    stop.set()
    th.join(5)
    assert got.startswith(b"HTTP/1.1 408 "), got[:80]
    s.close()


def test_a_kept_alive_connection_must_send_its_next_head_in_time(serve: str) -> None:
    """After an answer the deadline is armed again: uvicorn's keep-alive timer alone is cancelled by the first byte
    of the next head, however slowly the rest comes."""
    s = connect(serve)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = b""
    while b"\r\n\r\n" not in first:
        first += s.recv(65536)
    assert first.startswith(b"HTTP/1.1 200 "), first[:80]
    head, _, body = first.partition(b"\r\n\r\n")
    length = next(int(v) for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                  if k.lower() == b"content-length")
    while len(body) < length:  # the whole answer read: what comes next is the answer to the next head
        body += s.recv(65536)
    s.sendall(b"GET /health HTT")
    got = answer(s)
    assert got.startswith(b"HTTP/1.1 408 "), got[:80]
    s.close()


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * MAX_HEAD + b"\r\n\r\n",
    b"GET /" + b"a" * MAX_HEAD + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"a: \r\n" * (MAX_HEAD // 4) + b"\r\n",  # many empty headers
], ids=["one header", "the url", "many empty headers"])
def test_a_head_over_the_bound_is_431(serve: str, head: bytes) -> None:
    s = connect(serve)
    s.sendall(head)
    got = answer(s)
    assert got.startswith(b"HTTP/1.1 431 "), got[:80]
    s.close()


def test_a_head_without_end_is_not_kept(serve: str) -> None:
    """64 MB of headers: the server stops reading them (the connection is closed well before the client has sent
    them all), where uvicorn alone keeps every byte (gateway/guard.py)."""
    s = connect(serve)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    sent = 0
    line = b"X-A: " + b"a" * 8000 + b"\r\n"
    with pytest.raises(OSError):
        while sent < 64 << 20:
            s.sendall(line)
            sent += len(line)
    assert sent < 32 << 20, sent
    s.close()


def test_a_body_sent_too_slowly_is_408_in_openai_shape(serve: str) -> None:
    s = connect(serve)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"model\": ")
    got = answer(s)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), got[:200]
    assert json.loads(body)["error"]["code"] == "request_timeout"
    s.close()


def test_hostile_clients_do_not_keep_others_waiting_and_are_all_closed(serve: str) -> None:
    """60 silent connections and 20 heads sent a byte at a time: a request beside them is served, and every one of
    them is closed by the deadline."""
    silent = [connect(serve) for _ in range(60)]
    slow = [connect(serve) for _ in range(20)]
    for s in slow:
        s.sendall(b"GET /health HTT")
    assert chat_ok(serve) is not None
    for s in silent:
        assert answer(s) == b""
        s.close()
    for s in slow:
        assert answer(s).startswith(b"HTTP/1.1 408 ")
        s.close()
    assert chat_ok(serve) is not None


def test_connections_past_the_cap_are_answered_503_and_service_resumes(serve: str) -> None:
    """CAP + 10 connections at once: the ones past the cap are answered 503 and closed at once (the server's own
    descriptors stay free), the others closed silently at the head deadline; then requests are served again."""
    conns = [connect(serve) for _ in range(CAP + 10)]
    got = [answer(s) for s in conns]
    for s in conns:
        s.close()
    refused = [g for g in got if g]
    assert all(g.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in g for g in refused), refused[:1]
    assert 10 <= len(refused) <= 15, len(refused)  # a few more where the server still held others' connections
    assert chat_ok(serve) is not None


def test_the_connection_cap_follows_the_descriptor_limit() -> None:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    want = max(64, soft - RESERVED_FDS) if soft != resource.RLIM_INFINITY else (1 << 20) - RESERVED_FDS
    assert ClientBounds().connection_cap() == want
    assert ClientBounds(max_connections=7).connection_cap() == 7
    with pytest.raises(ValueError):
        ClientBounds(max_connections=0)


@pytest.fixture
def streaming_server() -> Iterator[tuple[int, dict[str, Any]]]:
    """uvicorn with the guarded protocol (write_timeout_s 1) serving an answer of 6.4 GB, in process."""
    seen: dict[str, Any] = {"ended": None, "sent": 0}

    async def big(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                for _ in range(100_000):
                    seen["sent"] += 1
                    yield b"x" * 65536
                    await asyncio.sleep(0)  # as the gateway's answers wait on their tokens
            finally:
                seen["ended"] = time.monotonic()
        return StreamingResponse(chunks())

    port = free_port()
    config = uvicorn.Config(Starlette(routes=[Route("/big", big)]), host="127.0.0.1", port=port, log_level="warning",
                            http=guarded_protocol(ClientBounds(write_timeout_s=1.0)))
    server = uvicorn.Server(config)
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and th.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port, seen
    finally:
        server.should_exit = True
        th.join(10)


def test_a_reader_that_stops_reading_is_dropped(streaming_server: tuple[int, dict[str, Any]]) -> None:
    port, seen = streaming_server
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    t = time.monotonic()
    while seen["ended"] is None:  # the answer's generator is closed: the app saw the client go
        assert time.monotonic() - t < 1.0 + SLACK_S, f"still streaming ({seen['sent']} chunks)"
        time.sleep(0.05)
    assert seen["sent"] < 100_000
    s.close()
