"""`dgr bench peer`: dgr end to end next to llama.cpp's own `llama-server`, same model, same prompts.

Three figures, one run, measured alternately so the noise of a shared machine falls on every side:
- raw fused: B sessions decoded by one fused `engine.step()` per token in this process (the ceiling);
- dgr: B sessions through the whole service (producer here, consumer subprocess, real redis-server);
- llama-server: B concurrent `/completion` requests to llama.cpp's continuous-batching HTTP server
  (and, with `no_repack`, a second one started with `--no-repack`: plain weight buffers, as dgr's engine).

For dgr and llama-server two rates are reported:
- wall: B * tokens / (time from releasing the requests to the last token), prefill included;
- decode: steady-state decode only: tokens in the window where all B sessions decode (as `bench/e2e.py`),
  from client-side token timestamps on both sides (llama-server streams, one event per token, as dgr
  publishes one result per token). The server's own view is reported too ("timings"): the sum of each
  request's `timings.predicted_per_second`.

llama-server is built once from the llama.cpp sources vendored in the llama-cpp-python sdist (the same
commit as our binding), with explicit CPU flags and no AMX (some VMs advertise AMX but cannot run it).
The build is cached (default `~/.cache/dgr/llama-server-<version>/`) with a `build.json` saying how.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from consumer.cpuinfo import cpu_flags
from dgrtools.localredis import free_port

SDIST_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{SDIST_VERSION}"
SDIST_FALLBACK = Path("/tmp/sdist") / f"{SDIST_NAME}.tar.gz"  # a pre-fetched copy, used when present
SERVER_TARGET = "llama-server"

# ggml's x86 feature options, each switched on when /proc/cpuinfo lists every flag it needs. Explicit
# features instead of -march=native (GGML_NATIVE=ON): reproducible, and AMX stays off (some VMs advertise
# AMX but cannot execute it: SIGILL). Notes from another VM listed AVX_VNNI ON; an AMD EPYC without the
# VEX-encoded AVX-VNNI would SIGILL on it, hence the derivation from the CPU flags.
GGML_CPU_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)
FIXED_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
)


def cmake_flags(flags: set[str]) -> list[str]:
    """cmake -D options: the fixed ones, then each ggml CPU feature ON iff the CPU has all it needs."""
    out = list(FIXED_FLAGS)
    for opt, need in GGML_CPU_OPTIONS:
        out.append(f"-D{opt}={'ON' if flags and all(f in flags for f in need) else 'OFF'}")
    return out


Progress = Callable[[str], None]


def _say(msg: str) -> None:
    from .common import console

    console.print(f"peer: {msg}", markup=False)


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "dgr" / f"llama-server-{SDIST_VERSION}"


# ------------------------------------------------------------------------------------------ build
def configure_cmd(src: Path, build: Path, flags: Sequence[str], *, generator: str | None = None) -> list[str]:
    cmd = ["cmake", "-S", str(src), "-B", str(build)]
    if generator:
        cmd += ["-G", generator]
    return cmd + list(flags)


def build_cmd(build: Path, *, jobs: int = 2, target: str = SERVER_TARGET) -> list[str]:
    return ["cmake", "--build", str(build), "-j", str(jobs), "--target", target]


def sdist_download_cmd(dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"llama-cpp-python=={SDIST_VERSION}", "-d", str(dest)]


def fetch_sdist(cache: Path, progress: Progress = _say) -> Path:
    """The sdist tarball: in the cache, else the pre-fetched copy, else `pip download`."""
    cache.mkdir(parents=True, exist_ok=True)
    mine = cache / f"{SDIST_NAME}.tar.gz"
    if mine.is_file():
        return mine
    if SDIST_FALLBACK.is_file():
        progress(f"using the sdist at {SDIST_FALLBACK}")
        shutil.copyfile(SDIST_FALLBACK, mine)
        return mine
    progress(f"downloading the llama-cpp-python {SDIST_VERSION} sdist (pip download)")
    subprocess.run(sdist_download_cmd(cache), check=True)
    if not mine.is_file():
        raise FileNotFoundError(f"pip download did not produce {mine}")
    return mine


def unpack_sdist(tarball: Path, dest: Path) -> Path:
    root = dest / SDIST_NAME
    if not (root / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        with tarfile.open(tarball) as tf:
            tf.extractall(dest, filter="data")
    return root


def vendored_commit(sdist_root: Path) -> str | None:
    """The commit of vendor/llama.cpp: its `.git` file points at the submodule's gitdir (kept in the sdist)."""
    sub = sdist_root / "vendor" / "llama.cpp"
    dotgit = sub / ".git"
    try:
        if dotgit.is_file():
            m = re.match(r"gitdir:\s*(.+)", dotgit.read_text().strip())
            if not m:
                return None
            gitdir = (sub / m.group(1).strip()).resolve()
        elif dotgit.is_dir():
            gitdir = dotgit
        else:
            return None
        return resolve_head(gitdir)
    except OSError:
        return None


def resolve_head(gitdir: Path) -> str | None:
    head = (gitdir / "HEAD").read_text().strip()
    if re.fullmatch(r"[0-9a-f]{40}", head):
        return head
    m = re.match(r"ref:\s*(\S+)", head)
    if not m:
        return None
    ref = m.group(1)
    loose = gitdir / ref
    if loose.is_file():
        return loose.read_text().strip()
    packed = gitdir / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None


_PCT_RE = re.compile(r"\[\s*(\d+)%\]|\[(\d+)/(\d+)\]")


def build_percent(log_text: str) -> int | None:
    """The last progress mark in a make ("[ 42%]") or ninja ("[12/80]") log."""
    last: int | None = None
    for m in _PCT_RE.finditer(log_text):
        last = int(m.group(1)) if m.group(1) else int(100 * int(m.group(2)) / max(1, int(m.group(3))))
    return last


def server_binary(cache: Path) -> Path:
    return cache / "build" / "bin" / SERVER_TARGET


def build_server(cache: Path | None = None, *, jobs: int = 2, progress: Progress = _say,
                 poll_s: float = 15.0) -> dict[str, Any]:
    """Build llama-server once into `cache`; return the build record (reused when the binary exists)."""
    cache = (cache or default_cache_dir()).expanduser()
    binary = server_binary(cache)
    record_path = cache / "build.json"
    if binary.is_file():
        record: dict[str, Any] = json.loads(record_path.read_text()) if record_path.is_file() else {}
        record.update({"binary": str(binary), "reused": True})
        return record
    tarball = fetch_sdist(cache, progress)
    src_root = unpack_sdist(tarball, cache / "src")
    src = src_root / "vendor" / "llama.cpp"
    build = cache / "build"
    gen = "Ninja" if shutil.which("ninja") else None
    conf = configure_cmd(src, build, cmake_flags(cpu_flags()), generator=gen)
    bld = build_cmd(build, jobs=jobs)
    log_path = cache / "build.log"
    t0 = time.time()
    with log_path.open("w") as log:
        progress(f"configuring: {' '.join(conf)}")
        subprocess.run(conf, check=True, stdout=log, stderr=subprocess.STDOUT)
        progress(f"building ({' '.join(bld)}), about 9 minutes on 2 cores; log {log_path}")
        proc = subprocess.Popen(bld, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(poll_s)
            with contextlib.suppress(OSError):
                pct = build_percent(log_path.read_text(errors="replace")[-4000:])
                progress(f"building llama-server: {pct if pct is not None else '?'}% after {time.time() - t0:.0f} s")
    if proc.returncode != 0 or not binary.is_file():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"llama-server build failed (rc {proc.returncode}):\n{tail}")
    record = {"sdist": tarball.name, "llama_cpp_commit": vendored_commit(src_root),
              "configure_cmd": conf, "build_cmd": bld, "build_seconds": round(time.time() - t0, 1),
              "built_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "jobs": jobs}
    record_path.write_text(json.dumps(record, indent=1))
    progress(f"built {binary} in {record['build_seconds']:.0f} s")
    return {**record, "binary": str(binary), "reused": False}


# ------------------------------------------------------------------------------------ CPU features
_FEATURE_RE = re.compile(r"\b([A-Z][A-Z0-9_]*) = 1\b")


def parse_system_info(line: str) -> list[str]:
    """Features switched on in a llama.cpp system-info text ("... | AVX2 = 1 | AVX512 = 1 | ...").

    Only upper-case names count: the server's line starts with "n_threads = 2 (n_threads_batch = 2)"."""
    return _FEATURE_RE.findall(line)


def server_system_info(log_text: str) -> str | None:
    """The `system_info:` line of a llama-server startup log."""
    for line in log_text.splitlines():
        i = line.find("system_info:")
        if i >= 0:
            return line[i + len("system_info:"):].strip()
    return None


def probe_system_info(binary: Path, threads: int, timeout_s: float = 60.0) -> str | None:
    """llama-server prints `system_info:` only at log verbosity >= 4 (trace), before it loads the model: ask
    a throwaway instance for it (a missing model file makes it exit right after), so the measured servers
    keep the default verbosity."""
    with tempfile.TemporaryDirectory(prefix="dgr-peer-probe-") as tmp:
        cmd = [str(binary), "-lv", "4", "-t", str(threads), "-tb", str(threads), "-m", str(Path(tmp) / "none.gguf"),
               "--host", "127.0.0.1", "--port", str(free_port())]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            return server_system_info(text)
        return server_system_info(out.stdout + out.stderr)


def compare_features(ours: Sequence[str], theirs: Sequence[str]) -> dict[str, list[str]]:
    return {"only_dgr": sorted(set(ours) - set(theirs)), "only_server": sorted(set(theirs) - set(ours))}


# --------------------------------------------------------------------------------------- rates
def window_rate(stamps: Sequence[Sequence[float]]) -> float:
    """Tokens/s over the window where every session is decoding: from the last first token to the first
    last token (as bench/e2e.py), so prefill and ramp-down do not blur the steady state."""
    live = [s for s in stamps if s]
    if not live:
        return 0.0
    t_start = max(s[0] for s in live)
    t_end = min(s[-1] for s in live)
    if t_end <= t_start:
        return 0.0
    n = sum(1 for s in live for t in s if t_start < t <= t_end)
    return n / (t_end - t_start)


def wall_rate(n_tokens: int, t0: float, stamps: Sequence[Sequence[float]]) -> float:
    """Tokens/s from releasing the requests to the last token, prefill included."""
    ends = [s[-1] for s in stamps if s]
    return n_tokens / (max(ends) - t0) if ends and max(ends) > t0 else 0.0


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


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


def completion_body(prompt: Sequence[int], tokens: int, *, stream: bool = True) -> dict[str, Any]:
    """Greedy, a fixed number of tokens, no prompt cache. The prompt goes as token ids: exactly dgr's."""
    return {"prompt": list(prompt), "n_predict": tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": False, "stream": stream, "return_tokens": True}


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


@dataclass
class SideResult:
    wall_tok_s: float
    decode_tok_s: float  # window rate (all sessions decoding)
    ttft_ms: float  # median over sessions, from release to first token
    tokens: list[list[int]]
    extra: dict[str, float]


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

    def complete_many(self, prompts: Sequence[Sequence[int]], tokens: int) -> SideResult:
        barrier = threading.Barrier(len(prompts) + 1)
        outs: list[dict[str, Any]] = [{} for _ in prompts]
        threads = [threading.Thread(target=self._one, args=(json.dumps(completion_body(p, tokens)).encode(),
                                                            barrier, o), daemon=True)
                   for p, o in zip(prompts, outs, strict=True)]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        for o in outs:
            if "error" in o:
                raise RuntimeError(f"{self.name} request failed: {o['error']!r}\n{self.log()}") from o["error"]
        stamps = [o["stamps"] for o in outs]
        n = sum(len(s) for s in stamps)
        if n != tokens * len(prompts):
            raise RuntimeError(f"{self.name}: {n} tokens streamed, {tokens * len(prompts)} asked")
        timings = [o.get("timings", {}) for o in outs]
        return SideResult(
            wall_tok_s=wall_rate(n, t0, stamps), decode_tok_s=window_rate(stamps),
            ttft_ms=1e3 * statistics.median(s[0] - t0 for s in stamps),
            tokens=[o["tokens"] for o in outs],
            extra={"timings_decode_tok_s": sum(float(t.get("predicted_per_second", 0.0)) for t in timings),
                   "timings_prompt_ms_median": statistics.median(float(t.get("prompt_ms", 0.0)) for t in timings)})


# ---------------------------------------------------------------------------------------- dgr
def dgr_complete_many(producer: Any, consumer: Any, prompts: Sequence[Sequence[int]], tokens: int,
                      tag: str) -> SideResult:
    """S sessions through the whole service, greedy, exactly `tokens` each (no stop tokens)."""
    from schemas import RouteHop, Sampling, SessionSpec, StepResult

    info = producer.discover(consumer.worker_id)
    hop = RouteHop(worker_id=consumer.worker_id, key=info.keys[0])
    specs = [(SessionSpec(session_id=f"{tag}-{i}", account_id="bench", route=(hop,), sampling=Sampling(),
                          max_tokens=tokens, stop_tokens=()), list(p)) for i, p in enumerate(prompts)]
    stamps: dict[str, list[float]] = {s.session_id: [] for s, _ in specs}
    toks: dict[str, list[int]] = {s.session_id: [] for s, _ in specs}

    def on_result(_h: object, r: StepResult) -> None:
        if r.token is not None:
            stamps[r.session_id].append(time.perf_counter())
            toks[r.session_id].append(int(r.token))

    before = consumer.wait_heartbeat(since=time.time())["stats"]
    t0 = time.perf_counter()
    producer.run_many(specs, on_result=on_result)
    after = consumer.wait_heartbeat(since=time.time())["stats"]
    series = [stamps[s.session_id] for s, _ in specs]
    n = sum(len(s) for s in series)
    if n != tokens * len(prompts):
        raise RuntimeError(f"dgr: {n} tokens, {tokens * len(prompts)} asked")
    calls = after["calls_by_phase"]["decode"] - before["calls_by_phase"]["decode"]
    sessions = after["decode_sessions"] - before["decode_sessions"]
    fused = after["fused_calls"] - before["fused_calls"]

    def per_call(key: str) -> float:
        return 1e3 * (after[key] - before[key]) / fused if fused else 0.0

    return SideResult(wall_tok_s=wall_rate(n, t0, series), decode_tok_s=window_rate(series),
                      ttft_ms=1e3 * statistics.median(s[0] - t0 for s in series),
                      tokens=[toks[s.session_id] for s, _ in specs],
                      extra={"mean_batch": sessions / calls if calls else 0.0, "fused_calls": float(fused),
                             # per fused call: in the engine; the loop's own work; waiting in reads (mostly
                             # for the producer's next steps: the per-token round trip through Redis)
                             "engine_ms_per_call": per_call("engine_seconds"),
                             "overhead_ms_per_call": per_call("overhead_seconds"),
                             "read_ms_per_call": per_call("read_seconds")})


# ---------------------------------------------------------------------------------------- run
def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def summarize(runs: dict[str, list[SideResult]]) -> dict[str, dict[str, Any]]:
    """Median figures per side, with the individual runs."""
    out: dict[str, dict[str, Any]] = {}
    for side, rs in runs.items():
        keys = sorted({k for r in rs for k in r.extra})
        out[side] = {"wall_tok_s": _median([r.wall_tok_s for r in rs]),
                     "decode_tok_s": _median([r.decode_tok_s for r in rs]),
                     "ttft_ms": _median([r.ttft_ms for r in rs]),
                     **{k: _median([r.extra[k] for r in rs if k in r.extra]) for k in keys},
                     "wall_runs": [r.wall_tok_s for r in rs], "decode_runs": [r.decode_tok_s for r in rs],
                     "extra_runs": [r.extra for r in rs]}
    return out


def token_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, float]:
    """How far two sides' greedy outputs agree, session by session."""
    pre = [common_prefix(x, y) for x, y in zip(a, b, strict=True)]
    same = sum(1 for x, y in zip(a, b, strict=True) if list(x) == list(y))
    return {"identical_sessions": same, "sessions": len(pre),
            "mean_common_prefix": sum(pre) / len(pre) if pre else 0.0}


def bar_plot(out_dir: Path, name: str, title: str, groups: dict[str, dict[str, float]]) -> Path:
    """Grouped bars: one group per side, one bar per figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import save_figure

    sides = list(groups)
    figures = list(next(iter(groups.values()))) if groups else []
    fig, ax = plt.subplots(figsize=(7.0, 4.0), dpi=110)
    w = 0.8 / max(1, len(figures))
    for j, fname in enumerate(figures):
        xs = [i + (j - (len(figures) - 1) / 2) * w for i in range(len(sides))]
        ys = [groups[s].get(fname, float("nan")) for s in sides]
        bars = ax.bar(xs, ys, width=w, label=fname)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(sides)), sides)
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return save_figure(fig, out_dir, name)


def run(out_dir: Path, *, cache_dir: Path | None = None, sessions: int = 8, tokens: int = 64, repeats: int = 3,
        recipe: str = "fast", threads: int = 2, build: bool = True, no_repack: bool = True) -> dict[str, Any]:
    """dgr vs llama-server (and the raw fused engine), same Gemma file, same prompts, alternated.

    `no_repack`: also run a second llama-server with `--no-repack`, i.e. plain CPU weight buffers as dgr's
    engine uses (`use_extra_bufts=False`), to tell the weight layout apart from the serving loop."""
    import redis

    from consumer.engines.llama import system_features
    from consumer.runtime import make_engine
    from dgrtools.gemma import assemble_gemma
    from dgrtools.localredis import LocalRedis
    from dgrtools.process import ConsumerProcess
    from dgrtools.tokenizer import Tokenizer
    from producer import Producer

    from .common import console, markdown, save, table
    from .e2e import raw_fused_rate

    if recipe not in ("fast", "invariant"):
        raise ValueError(f"recipe must be 'fast' or 'invariant', not {recipe!r}")
    cache = (cache_dir or default_cache_dir()).expanduser()
    binary = server_binary(cache)
    if not binary.is_file() and not build:
        raise FileNotFoundError(f"{binary} is missing and build=False")
    build_info = build_server(cache)  # reuses the cached binary when present
    model = assemble_gemma()
    tok = Tokenizer(model)
    prompts = [tok.encode(p, add_bos=True) for p in prompts_for(sessions)]
    ctx = 256 * -(-(max(len(p) for p in prompts) + tokens + 1) // 256)
    ours = system_features()
    load_before = _loadavg()
    runs: dict[str, list[SideResult]] = {"raw fused": [], "dgr": [], "llama-server": []}
    if no_repack:
        runs["llama-server --no-repack"] = []
    servers: dict[str, LlamaServer] = {}
    with tempfile.TemporaryDirectory(prefix="dgr-bench-peer-") as tmp, LocalRedis() as rs, \
            contextlib.ExitStack() as stack:
        log_dir = Path(out_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        _say(f"starting llama-server ({sessions} slots, {threads} threads, ctx {ctx}/slot)")
        servers["llama-server"] = LlamaServer(binary, model, log_dir, threads=threads, sessions=sessions,
                                              ctx_per_session=ctx)
        stack.callback(servers["llama-server"].stop)
        if no_repack:
            srv = LlamaServer(binary, model, log_dir, threads=threads, sessions=sessions, ctx_per_session=ctx,
                              name="llama-server-no-repack", extra=["--no-repack"])
            stack.callback(srv.stop)
            servers["llama-server --no-repack"] = srv
        _say(f"starting the dgr consumer (recipe {recipe})")
        consumer = ConsumerProcess(rs.url, "bench-peer", model, Path(tmp), recipe=recipe, slots=sessions,
                                   threads=threads, extra=["--heartbeat-s", "0.2", "--ctx-per-session", str(ctx)])
        stack.callback(consumer.stop)
        engine = make_engine(model, recipe=recipe, n_slots=sessions, ctx_per_session=ctx,  # type: ignore[arg-type]
                             n_threads=threads)
        stack.callback(engine.close)
        producer = Producer(redis.Redis.from_url(rs.url))

        _say("warming up every side")
        dgr_complete_many(producer, consumer, prompts, 8, "warm")
        for srv in servers.values():
            srv.complete_many(prompts, 8)
        raw_fused_rate(engine, sessions, 8)
        loads: list[list[float]] = []
        for r in range(repeats):  # alternate: every side sees the same noise; the others sit idle
            raw = raw_fused_rate(engine, sessions, tokens, seed=r)  # no prefill in its timing: wall = decode
            runs["raw fused"].append(SideResult(raw, raw, float("nan"), [], {}))
            runs["dgr"].append(dgr_complete_many(producer, consumer, prompts, tokens, f"r{r}"))
            for side, srv in servers.items():
                runs[side].append(srv.complete_many(prompts, tokens))
            loads.append(_loadavg()[:1])
            _say(f"repeat {r + 1}/{repeats} (load {loads[-1]}): " + ", ".join(
                f"{s} {rs_[-1].wall_tok_s:.1f}/{rs_[-1].decode_tok_s:.1f}" for s, rs_ in runs.items())
                + " tok/s (wall/decode)")
        probed = probe_system_info(binary, threads)
        server_info: dict[str, dict[str, Any]] = {
            name: {"cmd": srv.cmd, "system_info": srv.system_info() or probed, "version": srv.version}
            for name, srv in servers.items()}
        engine_desc = engine.describe() if hasattr(engine, "describe") else {}
    load_after = _loadavg()

    warnings: list[str] = []
    theirs = parse_system_info(server_info["llama-server"]["system_info"] or "")
    diff = compare_features(ours, theirs)
    if not theirs:
        warnings.append("llama-server's system_info was not found: CPU features not compared")
    elif diff["only_dgr"] or diff["only_server"]:
        warnings.append(f"CPU features differ: only in dgr's llama-cpp-python {diff['only_dgr']}, "
                        f"only in llama-server {diff['only_server']}")
    engine_ms = [r.extra["engine_ms_per_call"] for r in runs["dgr"] if r.extra.get("engine_ms_per_call")]
    if engine_ms and max(engine_ms) > 1.5 * min(engine_ms):
        warnings.append(f"dgr's fused decode calls took {min(engine_ms):.0f} to {max(engine_ms):.0f} ms across "
                        "repeats with the same batch: look at the per-run figures, not only the medians (rows out "
                        "of slot order split llama.cpp's non-unified-KV batch into several ubatches)")
    summary = summarize(runs)
    dgr, peer = summary["dgr"], summary["llama-server"]
    ratios: dict[str, Any] = {"wall_dgr_over_server": ratio(dgr["wall_tok_s"], peer["wall_tok_s"]),
              "decode_dgr_over_server": ratio(dgr["decode_tok_s"], peer["decode_tok_s"]),
              "decode_dgr_over_server_timings": ratio(dgr["decode_tok_s"], peer["timings_decode_tok_s"]),
              "decode_dgr_over_raw": ratio(dgr["decode_tok_s"], summary["raw fused"]["decode_tok_s"]),
              "decode_server_over_raw": ratio(peer["decode_tok_s"], summary["raw fused"]["decode_tok_s"])}
    # Per repeat, dgr against the server run right after it (same noise); their median and spread.
    for side in [k for k in summary if k.startswith("llama-server")]:
        key = "server" if side == "llama-server" else "server_no_repack"
        for fig in ("wall", "decode"):
            paired = [ratio(getattr(a, f"{fig}_tok_s"), getattr(b, f"{fig}_tok_s"))
                      for a, b in zip(runs["dgr"], runs[side], strict=True)]
            ratios[f"paired_{fig}_dgr_over_{key}"] = paired
    if no_repack:
        nr = summary["llama-server --no-repack"]
        ratios["wall_dgr_over_server_no_repack"] = ratio(dgr["wall_tok_s"], nr["wall_tok_s"])
        ratios["decode_dgr_over_server_no_repack"] = ratio(dgr["decode_tok_s"], nr["decode_tok_s"])
    agreement = {side: token_agreement(runs["dgr"][-1].tokens, rs_[-1].tokens)
                 for side, rs_ in runs.items() if side.startswith("llama-server")}

    raw_decode = summary["raw fused"]["decode_tok_s"]
    cols = ["side", "wall tok/s", "decode tok/s", "timings tok/s", "TTFT ms", "decode/raw", "dgr/side wall",
            "dgr/side decode"]
    data = [[side, s["wall_tok_s"], s["decode_tok_s"], s.get("timings_decode_tok_s", "-"),
             s["ttft_ms"] if side != "raw fused" else "-", ratio(s["decode_tok_s"], raw_decode),
             ratio(dgr["wall_tok_s"], s["wall_tok_s"]) if side != "raw fused" else "-",
             ratio(dgr["decode_tok_s"], s["decode_tok_s"])] for side, s in summary.items()]
    title = f"dgr vs llama-server: Gemma 270M Q4_K_M, {sessions} sessions x {tokens} tokens, recipe {recipe}, " \
            f"{threads} threads, median of {repeats}"
    console.print(table(title, cols, data))
    for w in warnings:
        console.print(f"warning: {w}", style="yellow", markup=False)
    console.print(f"dgr/llama-server: wall {ratios['wall_dgr_over_server']:.3f}, "
                  f"decode {ratios['decode_dgr_over_server']:.3f}; dgr per fused call (median): engine "
                  f"{dgr['engine_ms_per_call']:.1f} ms, loop {dgr['overhead_ms_per_call']:.1f} ms, reads "
                  f"{dgr['read_ms_per_call']:.1f} ms; mean decode batch {dgr['mean_batch']:.2f}", markup=False)
    console.print("dgr/llama-server per repeat (wall): "
                  + ", ".join(f"{x:.2f}" for x in ratios["paired_wall_dgr_over_server"]), markup=False)
    payload: dict[str, Any] = {
        "bench": "peer", "model": str(model), "recipe": recipe, "sessions": sessions, "tokens": tokens,
        "repeats": repeats, "threads": threads, "ctx_per_session": ctx,
        "prompt_tokens": [len(p) for p in prompts], "prompts": prompts_for(sessions),
        "build": build_info, "server": server_info, "dgr_engine": engine_desc,
        "cpu_features": {"dgr_llama_cpp_python": ours, "llama_server": theirs, **diff,
                         "differ": bool(diff["only_dgr"] or diff["only_server"])},
        "ggml_cpu_tiled_mm": {"dgr": "0 (set by the consumer)" if recipe == "invariant" else "unset",
                              "llama_server": "unset (llama.cpp default: tiled matmul on)"},
        "loadavg_before": load_before, "loadavg_after": load_after, "loadavg_1min_per_repeat": loads,
        "summary": summary, "ratios": ratios, "warnings": warnings, "token_agreement_last_repeat": agreement,
        "markdown": markdown(cols, data),
    }
    save(out_dir, f"peer-{recipe}", payload)
    bar_plot(out_dir, f"peer-{recipe}", f"Gemma 270M, {sessions} sessions x {tokens} tokens ({recipe})",
             {side: {"wall (incl. prefill)": s["wall_tok_s"], "decode window": s["decode_tok_s"]}
              for side, s in summary.items()})
    return payload
