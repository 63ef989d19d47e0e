"""A llama-server subprocess and its HTTP/SSE client: the command line, the request body, the event
stream parsed, S streamed `/completion` requests at once.
"""


import contextlib
import http.client
import json
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dgrtools.localredis import free_port
from schemas import Sampling

from .cpu_probe import server_system_info
from .rates import SideResult, wall_rate, window_rate

# ----------------------------------------------------------------------------------- llama-server
PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "List three uses of a paperclip:",
    "Once upon a time, in a village at the edge of a forest,",
    "The quick brown fox",
    "Translate to German: The weather is nice today.",
    "def fibonacci(n):",
    "A recipe for pancakes needs",
    "The three laws of thermodynamics are",
    "In 1969, the first humans",
    "Dear hiring manager, I am writing to",
    "Q: What is the boiling point of water at sea level? A:",
    "Summer holidays are best spent",
    "import numpy as np\n",
    "The most important thing about distributed systems is",
)


def prompts_for(n: int) -> list[str]:
    """n distinct prompts: the list above, numbered past its end."""
    return [PROMPTS[i] if i < len(PROMPTS) else f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(n)]


def server_cmd(binary: Path, model: Path, *, port: int, threads: int, sessions: int, ctx_per_session: int,
               help_text: str = "", extra: Sequence[str] = ()) -> list[str]:
    """llama-server on loopback: S parallel slots, continuous batching, one KV stream per slot, no prompt
    cache. Flags missing from this build's `--help` (when given) are left out."""
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(sessions), "-c", str(sessions * ctx_per_session)]
    optional: list[tuple[str, list[str]]] = [
        ("--cont-batching", ["--cont-batching"]), ("--no-kv-unified", ["--no-kv-unified"]),
        ("--no-webui", ["--no-webui"]), ("--cache-ram", ["--cache-ram", "0"]),
        ("--flash-attn", ["-fa", "on"]),  # dgr's engine: flash attention on, KV f16 (the defaults here)
    ]
    for flag, args in optional:
        if not help_text or flag in help_text:
            cmd += args
    return cmd + list(extra)


def completion_body(prompt: Sequence[int], tokens: int, *, stream: bool = True,
                    sampling: Sampling | None = None) -> dict[str, Any]:
    """A fixed number of tokens, no prompt cache; the prompt goes as token ids: exactly dgr's. Greedy by
    default; with `sampling`, dgr's settings (temperature, top_k with 0 = off, top_p, seed) and every other
    llama.cpp sampler neutral (min_p 0, typical_p 1, no penalties, no DRY, no XTC), so both sides run the
    same sampler stages."""
    body: dict[str, Any] = {"prompt": list(prompt), "n_predict": tokens, "temperature": 0.0, "top_k": 1,
                            "ignore_eos": True, "cache_prompt": False, "stream": stream, "return_tokens": True}
    if sampling is not None and not sampling.greedy:
        body |= {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                 "seed": sampling.seed, "min_p": sampling.min_p, "typical_p": 1.0,
                 "repeat_penalty": sampling.repetition_penalty, "repeat_last_n": sampling.penalty_last_n,
                 "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
                 "dry_multiplier": 0.0, "xtc_probability": 0.0, "top_n_sigma": -1.0}
    if sampling is not None and sampling.logprobs is not None:
        body["n_probs"] = sampling.logprobs  # llama-server's top-N log-probabilities per token
    if sampling is not None and sampling.json_schema is not None:
        # the grammar ends the output: the end of generation must be allowed (as dgr's session stops there)
        body |= {"json_schema": json.loads(sampling.json_schema), "ignore_eos": False}
    return body


def parse_sse_line(line: bytes) -> dict[str, Any] | None:
    """One `data: {...}` line of llama-server's event stream; None for blank lines, comments, [DONE]."""
    s = line.decode("utf-8", errors="replace").strip()
    if not s.startswith("data:"):
        return None
    s = s[5:].strip()
    if not s or s == "[DONE]":
        return None
    out: dict[str, Any] = json.loads(s)
    return out




class LlamaServer:
    """A llama-server subprocess on a free loopback port; `complete_many` runs S streamed requests at once."""

    def __init__(self, binary: Path, model: Path, log_dir: Path, *, threads: int, sessions: int,
                 ctx_per_session: int, name: str = "llama-server", extra: Sequence[str] = (),
                 ready_timeout_s: float = 300.0) -> None:
        self.name = name
        self.help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                                        check=False).stdout
        v = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False)
        self.version = (v.stdout + v.stderr).strip()
        self.port = free_port()
        self.cmd = server_cmd(binary, model, port=self.port, threads=threads, sessions=sessions,
                              ctx_per_session=ctx_per_session, help_text=self.help_text, extra=extra)
        # The server runs llama.cpp's defaults: GGML_CPU_TILED_MM is not inherited from this process
        # (an "invariant" raw engine here sets it).
        env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
        self.log_path = log_dir / f"{name}-{self.port}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                try:
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        return
                finally:
                    conn.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout_s} s:\n{self.log()}")
            time.sleep(0.2)

    def system_info(self) -> str | None:
        return server_system_info(self.log_path.read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def _one(self, body: bytes, barrier: threading.Barrier, out: dict[str, Any]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        stamps: list[float] = []
        toks: list[int] = []
        try:
            conn.connect()
            barrier.wait()
            out["t_send"] = time.perf_counter()
            conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {resp.status}: {resp.read()[:500]!r}")
            while True:
                line = resp.readline()
                if not line:
                    break
                ev = parse_sse_line(line)
                if ev is None:
                    continue
                now = time.perf_counter()
                toks.extend(int(t) for t in ev.get("tokens") or [])
                # A token that ends inside a UTF-8 character is not streamed (no event, its id is lost):
                # `tokens_predicted` (the running count) still counts it, at the next event's time.
                done = int(ev.get("tokens_predicted", len(toks)))
                stamps.extend([now] * max(0, done - len(stamps)))
                if ev.get("stop"):
                    out["timings"] = ev.get("timings") or {}
                    break
        except BaseException as e:  # reported by the caller
            out["error"] = e
        finally:
            conn.close()
            out["stamps"], out["tokens"] = stamps, toks

    def complete_many(self, prompts: Sequence[Sequence[int]], tokens: int,
                      sampling: Sampling | None = None) -> SideResult:
        """S streamed requests at once; with `sampling`, request i is seeded i (as dgr's session i)."""
        # the start is stamped as the barrier releases the requests: stamped after wait() in this thread, a request
        # thread could send and read its first token first (a negative time to first token, seen against a fast
        # fake server on a loaded machine)
        started: list[float] = []
        barrier = threading.Barrier(len(prompts) + 1, action=lambda: started.append(time.perf_counter()))
        outs: list[dict[str, Any]] = [{} for _ in prompts]
        bodies = [completion_body(p, tokens, sampling=sampling.model_copy(update={"seed": i}) if sampling else None)
                  for i, p in enumerate(prompts)]
        threads = [threading.Thread(target=self._one, args=(json.dumps(b).encode(), barrier, o), daemon=True)
                   for b, o in zip(bodies, outs, strict=True)]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = started[0]
        for t in threads:
            t.join()
        for o in outs:
            if "error" in o:
                raise RuntimeError(f"{self.name} request failed: {o['error']!r}\n{self.log()}") from o["error"]
        stamps = [o["stamps"] for o in outs]
        n = sum(len(s) for s in stamps)
        ends_early = sampling is not None and sampling.constrained  # the grammar's end of generation
        if n != tokens * len(prompts) and not (ends_early and 0 < n <= tokens * len(prompts)):
            raise RuntimeError(f"{self.name}: {n} tokens streamed, {tokens * len(prompts)} asked")
        timings = [o.get("timings", {}) for o in outs]
        return SideResult(
            wall_tok_s=wall_rate(n, t0, stamps), decode_tok_s=window_rate(stamps),
            ttft_ms=1e3 * statistics.median(s[0] - t0 for s in stamps),
            tokens=[o["tokens"] for o in outs],
            extra={"timings_decode_tok_s": sum(float(t.get("predicted_per_second", 0.0)) for t in timings),
                   "timings_prompt_ms_median": statistics.median(float(t.get("prompt_ms", 0.0)) for t in timings)})
