"""`dgr bench prefill`: prefill-heavy traffic, N concurrent prompts of L tokens that share nothing and T
greedy tokens each, through the service, against the raw engine's prefill of the same prompts and against
llama.cpp's `llama-server` (-np N, continuous batching) on the same token ids, alternated in one run.

Sides, per repeat (fresh prompts each repeat, the same ones on every side, so no prompt cache helps):
- raw engine: the prompts prefilled in this process in fused calls of up to the engine's n_batch rows
  (the prompts packed in order, as the service's burst packs a wave), each prompt's last row sampled;
  its prefill rate is N * L / the time to the last prompt's logits;
- dgr: the N sessions through the whole service (producer here, consumer subprocess, real redis-server);
- llama-server: N concurrent streamed `/completion` requests (skipped in the quick mode).

For dgr and llama-server, the prefill rate is N * L / the time from releasing the requests to the last
session's first token (what a user of the wave waits for), and wall is the time to the last token.
The quick mode (`--quick`: the tiny model, 4 x 64 tokens, no llama-server) is the smoke test.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .common import console, markdown, save, table

__all__ = ["Wave", "raw_prefill", "run"]


@dataclass
class Wave:
    """One side's run of one wave: seconds from the release of the requests."""

    first: list[float]  # each session's first token
    wall: float  # the last token
    tokens: list[list[int]] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)

    def prefill_tok_s(self, prompt_tokens: int) -> float:
        return prompt_tokens / max(self.first) if self.first else float("nan")


def wave_prompts(sessions: int, length: int, vocab: int, seed: int, bos: int | None) -> list[list[int]]:
    """Random token ids that share nothing (bos first when the model has one)."""
    rng = np.random.default_rng(seed)
    lo, hi = (300, min(vocab, 200_000)) if vocab > 1000 else (3, vocab)
    head = [bos] if bos is not None else []
    return [head + [int(t) for t in rng.integers(lo, hi, length - len(head))] for _ in range(sessions)]


def raw_prefill(engine: Any, prompts: Sequence[Sequence[int]]) -> Wave:
    """The prompts through the engine in this process, packed in order into calls of up to n_batch rows;
    the greedy first token of each prompt. No Redis, no scheduler: the engine's own prefill rate."""
    from consumer.batch import BatchRow, FusedBatch

    cap = engine.capacity.max_tokens_per_call
    for s in range(len(prompts)):
        engine.release(s)
    rows = [BatchRow(s, i, int(t), i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
    first: list[float] = []
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    calls = 0
    for k in range(0, len(rows), cap):
        out = engine.forward(FusedBatch.from_rows("prefill", rows[k:k + cap]))
        calls += 1
        now = time.perf_counter() - t0
        for tok in np.argmax(out.rows, axis=1):
            first.append(now)
            tokens.append([int(tok)])
    for s in range(len(prompts)):
        engine.release(s)
    return Wave(first=first, wall=max(first), tokens=tokens, extra={"calls": float(calls)})


def dgr_wave(producer: Any, consumer: Any, prompts: Sequence[Sequence[int]], tokens: int, tag: str) -> Wave:
    from schemas import RouteHop, Sampling, SessionSpec, StepResult

    key = producer.discover(consumer.worker_id).keys[0]
    hop = RouteHop(worker_id=consumer.worker_id, key=key)
    specs = [(SessionSpec(session_id=f"{tag}-{i}", account_id="bench", route=(hop,), sampling=Sampling(),
                          max_tokens=tokens, stop_tokens=()), list(p)) for i, p in enumerate(prompts)]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    toks: dict[str, list[int]] = {s.session_id: [] for s, _ in specs}

    def on_result(_h: object, r: StepResult) -> None:
        if r.token is not None:
            now = time.perf_counter()
            first.setdefault(r.session_id, now)
            last[r.session_id] = now
            toks[r.session_id].append(int(r.token))

    before = consumer.wait_heartbeat(since=time.time())["stats"]
    t0 = time.perf_counter()
    producer.run_many(specs, on_result=on_result)
    after = consumer.wait_heartbeat(since=time.time())["stats"]
    n = sum(len(v) for v in toks.values())
    if n != tokens * len(prompts):
        raise RuntimeError(f"dgr: {n} tokens, {tokens * len(prompts)} asked")
    calls = {p: after["calls_by_phase"][p] - before["calls_by_phase"][p] for p in ("prefill", "decode")}
    return Wave(first=[first[s.session_id] - t0 for s, _ in specs], wall=max(last.values()) - t0,
                tokens=[toks[s.session_id] for s, _ in specs],
                extra={"prefill_calls": float(calls["prefill"]), "decode_calls": float(calls["decode"])})


def llama_wave(port: int, prompts: Sequence[Sequence[int]], tokens: int) -> Wave:
    """N streamed greedy requests at once (no prompt cache); first and last token seen per request."""
    from .llama_server import completion_body, parse_sse_line

    outs: list[dict[str, Any]] = [{} for _ in prompts]
    started: list[float] = []  # stamped as the barrier releases the requests (llama_server.complete_many)
    barrier = threading.Barrier(len(prompts) + 1, action=lambda: started.append(time.perf_counter()))

    def one(body: bytes, out: dict[str, Any]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        toks: list[int] = []
        try:
            conn.connect()
            barrier.wait()
            conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            while line := resp.readline():
                ev = parse_sse_line(line)
                if ev is None:
                    continue
                if ev.get("tokens"):
                    out.setdefault("first", time.perf_counter())
                    toks.extend(int(t) for t in ev["tokens"])
                if ev.get("stop"):
                    break
        except BaseException as e:  # reported below
            out["error"] = e
        finally:
            conn.close()
            out["end"], out["tokens"] = time.perf_counter(), toks

    threads = [threading.Thread(target=one, args=(json.dumps(completion_body(p, tokens)).encode(), o), daemon=True)
               for p, o in zip(prompts, outs, strict=True)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = started[0]
    for t in threads:
        t.join()
    for o in outs:
        if "error" in o or "first" not in o:
            raise RuntimeError(f"llama-server request failed: {o.get('error')!r}")
    return Wave(first=[o["first"] - t0 for o in outs], wall=max(o["end"] for o in outs) - t0,
                tokens=[o["tokens"] for o in outs])


def _summary(waves: list[Wave], prompt_tokens: int) -> dict[str, float]:
    return {"prefill_tok_s": statistics.median(w.prefill_tok_s(prompt_tokens) for w in waves),
            "last_first_token_s": statistics.median(max(w.first) for w in waves),
            "median_ttft_s": statistics.median(statistics.median(w.first) for w in waves),
            "wall_s": statistics.median(w.wall for w in waves)}


def run(out_dir: Path, *, model: str = "gemma", sessions: int = 8, prompt_len: int = 528, tokens: int = 16,
        repeats: int = 3, recipe: str = "fast", threads: int = 2, llama_server: bool = True,
        consumer_extra: Sequence[str] = (), cache_dir: Path | None = None) -> dict[str, Any]:
    import redis

    from consumer.runtime import make_engine, resolve_model
    from dgrtools.localredis import LocalRedis
    from dgrtools.process import ConsumerProcess
    from producer import Producer

    if prompt_len < 2 or sessions < 1 or tokens < 1:
        raise ValueError("prompt_len >= 2, sessions >= 1 and tokens >= 1")
    path = resolve_model(model)
    ctx = 256 * -(-(prompt_len + tokens + 1) // 256)
    runs: dict[str, list[Wave]] = {"raw engine": [], "dgr": []}
    server_cmd: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dgr-bench-prefill-") as tmp, LocalRedis() as rs, \
            contextlib.ExitStack() as stack:
        logs = Path(tmp)
        srv = None
        if llama_server:
            from .llama_server import LlamaServer
            from .llamacpp_build import build_server, default_cache_dir

            binary = Path(build_server((cache_dir or default_cache_dir()).expanduser())["binary"])
            srv = LlamaServer(binary, path, logs, threads=threads, sessions=sessions, ctx_per_session=ctx)
            stack.callback(srv.stop)
            server_cmd = srv.cmd
            runs["llama-server"] = []
        consumer = ConsumerProcess(rs.url, "bench-prefill", path, logs, recipe=recipe, slots=sessions,
                                   threads=threads, extra=["--heartbeat-s", "0.2", "--ctx-per-session", str(ctx),
                                                           *consumer_extra])
        stack.callback(consumer.stop)
        engine = make_engine(path, recipe=recipe, n_slots=sessions, ctx_per_session=ctx,  # type: ignore[arg-type]
                             n_threads=threads or None)
        stack.callback(engine.close)
        producer = Producer(redis.Redis.from_url(rs.url))
        vocab = engine.capacity.vocab_size
        bos = 2 if model == "gemma" else None
        warm = wave_prompts(sessions, min(prompt_len, 16), vocab, 10_000, bos)
        raw_prefill(engine, warm)
        dgr_wave(producer, consumer, warm, 2, "warm")
        if srv is not None:
            llama_wave(srv.port, warm, 2)
        for r in range(repeats):  # alternate: every side sees the same noise
            prompts = wave_prompts(sessions, prompt_len, vocab, r, bos)
            runs["raw engine"].append(raw_prefill(engine, prompts))
            runs["dgr"].append(dgr_wave(producer, consumer, prompts, tokens, f"r{r}"))
            if srv is not None:
                runs["llama-server"].append(llama_wave(srv.port, prompts, tokens))
            console.print(f"repeat {r + 1}/{repeats}: " + ", ".join(
                f"{s} {w[-1].prefill_tok_s(sessions * prompt_len):.0f} prompt tok/s" for s, w in runs.items()),
                markup=False)
        n_batch = engine.capacity.max_tokens_per_call
    prompt_tokens = sessions * prompt_len
    summary = {side: _summary(w, prompt_tokens) for side, w in runs.items()}
    dgr, raw = summary["dgr"], summary["raw engine"]
    ratios: dict[str, float] = {"dgr_prefill_over_raw": dgr["prefill_tok_s"] / raw["prefill_tok_s"]}
    if "llama-server" in summary:
        ls = summary["llama-server"]
        ratios |= {"dgr_over_server_wall": ls["wall_s"] / dgr["wall_s"],
                   "dgr_over_server_prefill": dgr["prefill_tok_s"] / ls["prefill_tok_s"],
                   "last_first_token_dgr_minus_server_s": dgr["last_first_token_s"] - ls["last_first_token_s"],
                   "server_prefill_over_raw": ls["prefill_tok_s"] / raw["prefill_tok_s"]}
    cols = ["side", "prompt tok/s", "last first token s", "median TTFT s", "wall s", "prefill / raw"]
    data = [[side, s["prefill_tok_s"], s["last_first_token_s"], s["median_ttft_s"], s["wall_s"],
             s["prefill_tok_s"] / raw["prefill_tok_s"]] for side, s in summary.items()]
    title = (f"prefill-heavy: {sessions} prompts x {prompt_len} tokens, {tokens} greedy tokens each, {model}, "
             f"recipe {recipe}, {threads} threads, median of {repeats}")
    console.print(table(title, cols, data))
    console.print("ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()), markup=False)
    console.print("dgr calls per wave: " + ", ".join(
        f"{k} {statistics.median(w.extra[k] for w in runs['dgr']):.0f}" for k in ("prefill_calls", "decode_calls")),
        markup=False)
    payload: dict[str, Any] = {
        "bench": "prefill", "model": str(path), "recipe": recipe, "sessions": sessions, "prompt_len": prompt_len,
        "tokens": tokens, "repeats": repeats, "threads": threads, "ctx_per_session": ctx, "engine_n_batch": n_batch,
        "consumer_extra": list(consumer_extra), "llama_server_cmd": server_cmd, "summary": summary,
        "ratios": ratios, "markdown": markdown(cols, data),
        "runs": {side: [{"first": w.first, "wall": w.wall, **w.extra} for w in ws] for side, ws in runs.items()},
        "tokens_agree_dgr_raw_first": [a[:1] == b[:1] for a, b in zip(runs["dgr"][-1].tokens,
                                                                      runs["raw engine"][-1].tokens, strict=True)],
    }
    save(out_dir, f"prefill-{Path(str(model)).stem}-{recipe}", payload)
    return payload
