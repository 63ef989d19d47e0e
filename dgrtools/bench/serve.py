"""`dgr bench serve`: what the HTTP front door costs. The same sessions (same prompts as token ids, same tokens,
greedy, end-of-generation ignored) three ways, alternated per repeat:

- `producer`: AsyncProducer in this process, warm, each session opened as the gateway opens a request's (a
  SessionTemplate, `run_many` with a callback per answer, one task per session): the floor;
- `gateway`: `dgr serve` (a subprocess), S streamed `/v1/completions` requests at once over raw HTTP;
- `llama-server` (not in --quick): llama.cpp's own HTTP server, the same `/v1/completions` requests;
- `client floor`: the same requests to a server that streams its events at once (dgrtools/bench/null_http.py):
  what the HTTP client itself takes, whatever the server (`added TTFT over the client`: the gateway's time to first
  token less the producer's and less this).

Per side: time to first token (median over sessions), streamed tokens/s (wall), and for the gateway the CPU its
process spent per streamed token (from /proc: utime + stime) next to what this process spent driving the same
sessions through AsyncProducer directly. `--quick`: the tiny model, small sizes, no llama-server (a smoke run).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from dgrtools.localredis import LocalRedis, free_port
from dgrtools.process import ConsumerProcess
from producer import AsyncProducer, SessionTemplate
from schemas import Sampling

WORKER = "bench-serve"
FLOOR = "client floor"


def proc_cpu_s(pid: int) -> float:
    """A process's CPU time in seconds (Linux /proc): the nanoseconds its live threads ran (schedstat), else
    utime + stime, which count in clock ticks (10 ms: 2.4 us per token of a 4,096-token run, the size of the
    differences measured)."""
    try:
        return sum(int((t / "schedstat").read_text().split()[0]) for t in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream_one(client: Any, url: str, body: dict[str, Any], t0: float) -> tuple[float | None, int]:
    """One streamed /v1/completions request: (seconds to its first token, tokens streamed)."""
    first, n = None, 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):  # what the server says it generated (a held-back token sends no chunk)
                n = max(n, int(chunk["usage"].get("completion_tokens") or 0))
            if chunk.get("choices"):
                n += 1  # one chunk per token, unless its text is held back (then the usage above counts it)
                if first is None:
                    first = time.perf_counter() - t0
    return first, n


async def http_side(url: str, model: str, prompts: Sequence[Sequence[int]], tokens: int) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(_stream_one(client, url + "/v1/completions", {
            "model": model, "prompt": list(p), "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "cache_prompt": False,
            "stream_options": {"include_usage": True}}, t0) for p in prompts))
        wall = time.perf_counter() - t0
    ttfts = [f for f, _ in outs if f is not None]
    n = sum(k for _, k in outs)
    return {"wall_s": wall, "tokens": n, "tok_s": n / wall, "ttft_ms": 1000 * statistics.median(ttfts) if ttfts
            else None}


async def producer_side(producer: AsyncProducer, prompts: Sequence[Sequence[int]], tokens: int) -> dict[str, Any]:
    """The floor: the sessions driven by a warm AsyncProducer of this process (kept across repeats, as the gateway
    keeps its own), each opened as the gateway opens a request's (gateway/runner.py: a SessionTemplate, run_many
    with a callback per answer), so the gap measured is the HTTP side's own."""
    key = (await producer.discover(WORKER)).keys[0]

    async def one(i: int, p: Sequence[int], t0: float) -> tuple[float | None, int]:
        spec = SessionTemplate(session_id=f"bench-{time.monotonic_ns()}-{i}", account_id="bench", keys=(key,),
                               options={"max_tokens": tokens, "sampling": Sampling()})
        first: list[float] = []
        n = 0

        def on_result(h: Any, r: Any) -> None:
            nonlocal n
            if r.token is not None:
                n += 1
                if not first:
                    first.append(time.perf_counter() - t0)

        await producer.run_many([(spec, p)], on_result=on_result)
        return (first[0] if first else None), n

    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = await asyncio.gather(*(one(i, p, t0) for i, p in enumerate(prompts)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    n = sum(k for _, k in outs)
    ttfts = [f for f, _ in outs if f is not None]
    return {"wall_s": wall, "tokens": n, "tok_s": n / wall, "ttft_ms": 1000 * statistics.median(ttfts),
            "cpu_s": cpu, "cpu_us_per_token": 1e6 * cpu / max(1, n)}


async def _sides(redis_url: str, serve_url: str, pid: int, peers: dict[str, str], prompts: Sequence[Sequence[int]],
                 tokens: int, repeats: int, floor_url: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every side `repeats` times, alternated, after one warm-up of each (not recorded), in one event loop.
    `peers`: each llama-server side's URL; `floor_url`: dgrtools/bench/null_http.py's (the client's floor)."""
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in ["producer", "gateway", *peers]}
    client = aioredis.Redis.from_url(redis_url)
    producer = AsyncProducer(client)
    try:
        await producer_side(producer, prompts, tokens)
        await http_side(serve_url, "m", prompts, tokens)
        for _ in range(repeats):
            runs["producer"].append(await producer_side(producer, prompts, tokens))
            if floor_url is not None:  # the client against a server that answers at once
                runs.setdefault(FLOOR, []).append(await http_side(floor_url, "m", prompts, tokens))
            c0 = proc_cpu_s(pid)
            g = await http_side(serve_url, "m", prompts, tokens)
            g["cpu_s"] = proc_cpu_s(pid) - c0
            g["cpu_us_per_token"] = 1e6 * g["cpu_s"] / max(1, g["tokens"])
            runs["gateway"].append(g)
            for side, url in peers.items():
                runs[side].append(await http_side(url, "m", prompts, tokens))
    finally:
        await producer.aclose()
        await client.aclose()
    return runs


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def run(out_dir: Path, *, model: str = "gemma", streams: Sequence[int] = (8, 64), tokens: int = 64,
        repeats: int = 3, slots: int = 64, threads: int = 0, quick: bool = False,
        llama_server: bool = True, cache_dir: Path | None = None, recipe: str = "invariant",
        extra: Sequence[str] = (), no_repack: bool = False) -> dict[str, Any]:
    """`recipe` and `extra`: the consumer's (e.g. `--repack on`); `no_repack`: a second llama-server with
    `--no-repack` (plain weight buffers, as dgr's engine unless it repacks), alternated with the first."""
    from consumer.runtime import resolve_model
    from dgrtools.tokenizer import Tokenizer
    from gateway.stack import ServeProcess

    from .common import markdown, save
    from .llama_server import prompts_for

    if quick:
        model, streams, tokens, repeats, slots, llama_server = "tiny", (2, 4), 8, 1, 4, False
    path = resolve_model(model)
    tok = Tokenizer(path)
    logs = Path(tempfile.mkdtemp(prefix="dgr-bench-serve-"))
    results: dict[str, Any] = {}
    with LocalRedis(appendonly=False) as server, \
            ConsumerProcess(server.url, WORKER, path, logs, recipe=recipe, slots=max(slots, max(streams)),
                            threads=threads, extra=list(extra)), \
            contextlib.ExitStack() as stack:
        peers: dict[str, str] = {}  # side -> its URL
        if llama_server:
            from .llama_server import LlamaServer
            from .llamacpp_build import build_server

            binary = Path(build_server(cache_dir)["binary"])
            for side, flags in [("llama-server", [])] + ([("llama-server --no-repack", ["--no-repack"])]
                                                         if no_repack else []):
                peer = LlamaServer(binary, path, logs, threads=threads or 2, sessions=max(streams),
                                   ctx_per_session=1024, name=side.replace(" --", "-"), extra=flags)
                stack.callback(peer.stop)
                peers[side] = f"http://127.0.0.1:{peer.port}"
        floor_port = free_port()
        floor = subprocess.Popen([sys.executable, "-m", "dgrtools.bench.null_http", str(floor_port), str(tokens)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(floor.kill)
        floor_url = f"http://127.0.0.1:{floor_port}"
        with ServeProcess(server.url, [f"m={path}"], free_port(), logs) as serve:
            pid = serve.proc.pid
            for s in streams:
                prompts = [tok.encode(p, add_bos=True) for p in prompts_for(s)]
                runs = asyncio.run(_sides(server.url, serve.url, pid, peers, prompts, tokens, repeats, floor_url))
                results[str(s)] = {side: {k: _median(rs, k) for k in ("tok_s", "ttft_ms", "cpu_us_per_token")}
                                   | {"runs": rs} for side, rs in runs.items() if rs}
    cols = ["streams", "side", "tok/s", "TTFT ms", "CPU us/token", "added TTFT ms", "added TTFT over the client ms",
            "added CPU us/token"]
    rows: list[list[Any]] = []
    for n_streams, sides in results.items():
        base = sides["producer"]
        floor_ttft = sides.get(FLOOR, {}).get("ttft_ms")
        for side, m in sides.items():
            gateway = side == "gateway" and m["ttft_ms"] is not None
            added_ttft = (m["ttft_ms"] - base["ttft_ms"]) if gateway else "-"
            # what the HTTP client itself takes to its first event (against a server that answers at once) is not
            # the gateway's: every server behind that client pays it
            over = (m["ttft_ms"] - base["ttft_ms"] - floor_ttft) if gateway and floor_ttft is not None else "-"
            added_cpu = (m["cpu_us_per_token"] - base["cpu_us_per_token"]) if side == "gateway" else "-"
            rows.append([n_streams, side, m["tok_s"], m["ttft_ms"] or "-", m["cpu_us_per_token"] or "-", added_ttft,
                         over, added_cpu])
    table = markdown(cols, rows)
    consumer = " ".join([f"recipe {recipe}", *extra])
    title = f"dgr serve vs AsyncProducer{' vs llama-server' if llama_server else ''}: {model}, {tokens} tokens, " \
            f"{consumer}, median of {repeats}" + (" (quick)" if quick else "")
    print(title)
    print(table)
    payload = {"bench": "serve", "model": str(path), "recipe": recipe, "consumer_extra": list(extra),
               "tokens": tokens, "repeats": repeats, "quick": quick,
               "streams": list(streams), "results": results, "markdown": table, "logs": str(logs)}
    save(out_dir, "serve-quick" if quick else "serve", payload)
    return payload
