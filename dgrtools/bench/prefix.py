"""`dgr bench prefix`: the prefix cache's workloads, dgr with the cache on and off and llama-server
(`cache_prompt: true`) on the same token ids, in one run (docs/prefix-cache.md, issue 31).

Workloads (W waves of S concurrent sessions, T greedy tokens each, suffix of Q own tokens):
- `shared-P`: one shared prefix of P tokens (512 and 2,000) + each session's own suffix;
- `systems-K`: K distinct 512-token system prompts (1, 4, 16), session i uses prompt i mod K;
- `none`: nothing shared (prompts of 512 + Q random tokens): what the cache costs;
- `chat`: one 6-turn conversation, each turn's prompt = the previous prompt + its answer + Q new tokens;
  the prompt tokens dgr (cache on) computed per turn are reported beside the turn's length (from the
  worker's `prefix_cache.hit_tokens` in its heartbeat).
Per side and workload: wall seconds and median time to first token per wave; the ratios of waves 2+.
`--quick`: the tiny model, small sizes, no llama-server (a smoke test). The machine is shared: read the
ratios of one run, not absolute figures across runs.
"""

from __future__ import annotations

import http.client
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
import redis

CACHE_BYTES = 2 << 30  # per engine: room for every workload here (Gemma: ~9.4 MB per 512-token entry)


def _dgr_wave(producer: Any, wid: str, key: Any, prompts: list[list[int]], tokens: int, tag: str) -> dict[str, Any]:
    from schemas import RouteHop, Sampling, SessionSpec

    hop = RouteHop(worker_id=wid, key=key)
    specs = [(SessionSpec(session_id=f"{tag}-{i}", account_id="bench", route=(hop,), sampling=Sampling(),
                          max_tokens=tokens), p) for i, p in enumerate(prompts)]
    first: dict[str, float] = {}
    toks: dict[str, list[int]] = {s.session_id: [] for s, _ in specs}

    last: dict[str, str] = {}

    def on_result(_h: Any, r: Any) -> None:
        last[r.session_id] = f"{r.job_id} {r.status} {r.reason} {r.detail} at {r.position}"
        if r.token is not None:
            first.setdefault(r.session_id, time.perf_counter())
            toks[r.session_id].append(int(r.token))

    t0 = time.perf_counter()
    handles = producer.run_many(specs, on_result=on_result)
    wall = time.perf_counter() - t0
    ended = {sid: (h.status, last.get(sid)) for sid, h in handles.items() if h.status != "finished"}
    if ended:
        raise RuntimeError(f"{tag}: sessions that did not finish: {ended}")
    return {"wall": wall, "ttft": statistics.median(first[s.session_id] - t0 for s, _ in specs),
            "tokens": [toks[s.session_id] for s, _ in specs]}


def _llama_request(port: int, prompt: list[int], tokens: int, out: dict[str, Any],
                   barrier: threading.Barrier) -> None:
    from dgrtools.bench.llama_server import parse_sse_line

    body = json.dumps({"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                       "cache_prompt": True, "stream": True, "return_tokens": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.connect()
    barrier.wait()
    conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    toks: list[int] = []
    while True:
        line = resp.readline()
        if not line:
            break
        ev = parse_sse_line(line)
        if ev is None:
            continue
        if ev.get("tokens") and "first" not in out:
            out["first"] = time.perf_counter()
        toks.extend(int(t) for t in ev.get("tokens") or [])
        if ev.get("stop"):
            out["prompt_n"] = int((ev.get("timings") or {}).get("prompt_n", -1))
            break
    conn.close()
    out.update(end=time.perf_counter(), tokens=toks)


def _llama_wave(srv: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """The same prompts to llama-server at once (`cache_prompt: true`): its slots reuse their own last prompt."""
    outs: list[dict[str, Any]] = [{} for _ in prompts]
    started: list[float] = []  # stamped as the barrier releases the requests (llama_server.complete_many)
    barrier = threading.Barrier(len(prompts) + 1, action=lambda: started.append(time.perf_counter()))
    ths = [threading.Thread(target=_llama_request, args=(srv.port, p, tokens, o, barrier))
           for p, o in zip(prompts, outs, strict=True)]
    for t in ths:
        t.start()
    barrier.wait()
    t0 = started[0]
    for t in ths:
        t.join()
    return {"wall": max(o["end"] for o in outs) - t0, "ttft": statistics.median(o["first"] - t0 for o in outs),
            "tokens": [o["tokens"] for o in outs], "prompt_n": sum(o.get("prompt_n", -1) for o in outs)}


def workloads(rng: np.random.Generator, vocab: int, quick: bool, sessions: int, waves: int,
              suffix: int) -> dict[str, list[list[list[int]]]]:
    def rand(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, vocab, n)]

    sizes = (64, 160) if quick else (512, 2000)
    system = 64 if quick else 512
    out: dict[str, list[list[list[int]]]] = {}
    for p in sizes:
        shared = rand(p)
        out[f"shared-{p}"] = [[shared + rand(suffix) for _ in range(sessions)] for _ in range(waves)]
    for k in ((1, 2) if quick else (1, 4, 16)):
        systems = [rand(system) for _ in range(k)]
        out[f"systems-{k}"] = [[systems[i % k] + rand(suffix) for i in range(sessions)] for _ in range(waves)]
    out["none"] = [[rand(system + suffix) for _ in range(sessions)] for _ in range(waves)]
    # long prompts that share nothing: what saving checkpoints past a sliding window costs when no one reuses them
    out[f"none-{sizes[1]}"] = [[rand(sizes[1] + suffix) for _ in range(sessions)] for _ in range(waves)]
    return out


def _cache_counts(cons: Any) -> tuple[int, int]:
    """The worker's restored prompt tokens and refilled answer positions so far (a fresh heartbeat)."""
    stats = cons.wait_heartbeat(since=time.time())["engines"][0].get("prefix_cache", {})
    return int(stats.get("hit_tokens", 0)), int(stats.get("refilled_tokens", 0))


def chat(producer: Any, cons: Any, key: Any, rng: np.random.Generator, vocab: int, turns: int, suffix: int,
         tokens: int) -> list[dict[str, Any]]:
    """One conversation: each turn re-sends the whole history; what the cache-on worker computed of it, and
    (`refilled`) the answer positions it recomputed as prompt rows after the turn finished (a batch-invariant
    recipe: consumer/prefix/planner.py Refill), off the next turn's critical path."""
    prompt: list[int] = []
    out = []
    hit0, refilled0 = _cache_counts(cons)
    for t in range(turns):
        prompt = prompt + [int(x) for x in rng.integers(3, vocab, suffix)]
        r = _dgr_wave(producer, cons.worker_id, key, [prompt], tokens, f"chat{t}-{time.monotonic_ns()}")
        hit, refilled = _cache_counts(cons)  # the refill runs when the finished session's slot is released
        out.append({"turn": t + 1, "prompt_tokens": len(prompt), "computed": len(prompt) - (hit - hit0),
                    "refilled": refilled - refilled0, "ttft": r["ttft"], "wall": r["wall"]})
        hit0, refilled0 = hit, refilled
        prompt = prompt + r["tokens"][0]
    return out


def _summary(res: list[dict[str, Any]], work: int) -> dict[str, float]:
    """The waves after the first (all when there is one): their wall time, median time to first token and
    `work` (prompt + generated tokens of one wave) per second."""
    later = res[1:] or res
    wall = sum(r["wall"] for r in later)
    return {"wall_later": wall, "ttft_later": statistics.median(r["ttft"] for r in later),
            "speed": work * len(later) / wall}


def run(out: Path, *, quick: bool = False, sessions: int = 8, waves: int = 3, tokens: int = 16, suffix: int = 16,
        turns: int = 6, threads: int = 2, recipe: str = "invariant", only: Collection[str] = (),
        llama_server: bool = True, echo: Callable[[str], object] = print) -> dict[str, Any]:
    """`only`: the workloads to run (their names, "chat" for the conversation); empty: all."""
    from consumer.runtime import resolve_model
    from dgrtools.localredis import LocalRedis
    from dgrtools.process import ConsumerProcess
    from producer import Producer

    if quick:
        sessions, waves, tokens, turns = min(sessions, 3), 2, 4, 3
    model = resolve_model("tiny" if quick else "gemma")
    vocab = 384 if quick else 262_144
    rng = np.random.default_rng(7)
    loads = workloads(rng, vocab, quick, sessions, waves, suffix)
    unknown = set(only) - {*loads, "chat"}
    if unknown:
        raise ValueError(f"unknown workloads {sorted(unknown)}: choose from {[*loads, 'chat']}")
    if only:
        loads = {name: w for name, w in loads.items() if name in only}
    longest = max((len(p) for w in loads.values() for wave in w for p in wave), default=0)
    ctx = max(1024, 1024 * ((longest + tokens + 6 * (suffix + tokens)) // 1024 + 1))
    report: dict[str, Any] = {"model": str(model), "recipe": recipe, "sessions": sessions, "waves": waves,
                              "tokens": tokens, "suffix": suffix, "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as rs:
        common = ["--ctx-per-session", str(ctx), "--heartbeat-s", "0.5"]
        on = ConsumerProcess(rs.url, "pfx-on", model, Path(tmp), recipe=recipe, slots=sessions, threads=threads,
                             extra=[*common, "--prefix-cache-bytes", str(CACHE_BYTES)])
        off = ConsumerProcess(rs.url, "pfx-off", model, Path(tmp), recipe=recipe, slots=sessions, threads=threads,
                              extra=common)
        srv = None
        if not quick and loads and llama_server:
            from dgrtools.bench.llama_server import LlamaServer
            from dgrtools.bench.llamacpp_build import build_server, default_cache_dir

            srv = LlamaServer(Path(build_server(default_cache_dir())["binary"]), model, Path(tmp), threads=threads,
                              sessions=sessions, ctx_per_session=ctx, extra=[])
        producer = Producer(redis.Redis.from_url(rs.url))
        keys = {w: producer.discover(w).keys[0] for w in ("pfx-on", "pfx-off")}
        try:
            for name, wave_prompts in loads.items():
                res: dict[str, list[dict[str, Any]]] = {"dgr-cache": [], "dgr-nocache": [], "llama-server": []}
                for w, prompts in enumerate(wave_prompts):
                    for side in ("dgr-cache", "dgr-nocache", "llama-server"):
                        if side == "llama-server" and srv is None:
                            continue
                        wid = "pfx-on" if side == "dgr-cache" else "pfx-off"
                        r = _llama_wave(srv, prompts, tokens) if side == "llama-server" else \
                            _dgr_wave(producer, wid, keys[wid], prompts, tokens, f"{name}-{side}-{w}")
                        res[side].append(r)
                        echo(f"{name} wave {w} {side:12s} wall {r['wall']:.3f} s ttft {1e3 * r['ttft']:.0f} ms")
                same = all(a == b for x, y in zip(res["dgr-cache"], res["dgr-nocache"], strict=True)
                           for a, b in zip(x["tokens"], y["tokens"], strict=True))
                work = sum(len(p) + tokens for p in wave_prompts[-1])
                summ = {side: _summary(rs_, work) for side, rs_ in res.items() if rs_}
                entry: dict[str, Any] = {"sides": summ, "cache_tokens_equal_nocache": same}
                base = summ["dgr-cache"]
                entry["speed_vs_nocache"] = summ["dgr-nocache"]["wall_later"] / base["wall_later"]
                entry["ttft_over_nocache"] = base["ttft_later"] / summ["dgr-nocache"]["ttft_later"]
                if "llama-server" in summ:
                    entry["speed_vs_llama_server"] = summ["llama-server"]["wall_later"] / base["wall_later"]
                report["workloads"][name] = entry
                echo(f"{name}: {json.dumps({k: v for k, v in entry.items() if k != 'sides'})}")
            report["chat"] = chat(producer, on, keys["pfx-on"], rng, vocab, turns, suffix, tokens) \
                if not only or "chat" in only else []
            for t in report["chat"]:
                echo(f"chat turn {t['turn']}: prompt {t['prompt_tokens']} tokens, computed {t['computed']}, then "
                     f"{t['refilled']} answer positions refilled")
        finally:
            on.stop()
            off.stop()
            if srv is not None:
                srv.stop()
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix.json").write_text(json.dumps(report, indent=1))
    if report["workloads"] or report["chat"]:
        echo(f"plot: {plot_report(out, report)}")
    return report


def plot_report(out: Path, report: dict[str, Any]) -> Path:
    """prefix.png: per workload the waves after the first in prompt + generated tokens per second of wall
    time, per side; beside it the conversation's prompt tokens per turn and what the cache-on worker computed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import save_figure

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.0, 4.2), dpi=110, gridspec_kw={"width_ratios": [2, 1]})
    names = list(report["workloads"])
    sides = ("dgr-cache", "dgr-nocache", "llama-server")
    w = 0.8 / len(sides)
    for j, side in enumerate(sides):
        ys = [report["workloads"][n]["sides"].get(side, {}).get("speed", float("nan")) for n in names]
        bars = ax.bar([i + (j - 1) * w for i in range(len(names))], ys, width=w, label=side)
        ax.bar_label(bars, fmt="%.0f", fontsize=6)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("tokens/s, waves after the first (prompt + generated)")
    ax.set_title(f"prefix cache, {report['sessions']} sessions a wave, recipe {report['recipe']}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    turns = report["chat"]
    bx.plot([t["turn"] for t in turns], [t["prompt_tokens"] for t in turns], marker="o", label="prompt tokens")
    bx.plot([t["turn"] for t in turns], [t["computed"] for t in turns], marker="o", label="computed (cache on)")
    if any(t.get("refilled") for t in turns):
        bx.plot([t["turn"] for t in turns], [t.get("refilled", 0) for t in turns], marker="o", linestyle=":",
                label="answer refilled after the turn")
    bx.set_xticks([t["turn"] for t in turns])
    bx.set_xlabel("turn")
    bx.set_title("a conversation re-sending its turns")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=8)
    return save_figure(fig, out, "prefix")
