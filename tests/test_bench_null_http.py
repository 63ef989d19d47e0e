"""dgrtools/bench/null_http.py, `dgr bench serve`'s client floor: a server that streams N server-sent events at once
to every POST. The bench's own client (`http_side`) reads N tokens from each of several concurrent streams and a
first token from each (so the floor it measures is a time to first token like the other sides')."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx

from dgrtools.bench.serve import http_side
from dgrtools.localredis import free_port


def test_the_client_floor_streams_every_event_to_every_request() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dgrtools.bench.null_http", str(port), "5"])
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):  # up within a few seconds
            try:
                httpx.post(url + "/v1/completions", json={}, timeout=1.0)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        got = asyncio.run(http_side(url, "m", [[1, 2, 3]] * 6, 5))
        assert got["tokens"] == 6 * 5 and got["ttft_ms"] is not None and got["ttft_ms"] > 0
    finally:
        proc.kill()
        proc.wait()
