"""llama.cpp's `llama-server`, built once from the sources vendored in the llama-cpp-python sdist
(the same commit as our binding), with explicit CPU flags (consumer/cpuinfo.py) and no AMX. The build is
cached (default `~/.cache/dgr/llama-server-<version>/`) with a `build.json` saying how.
"""


import contextlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from consumer.cpuinfo import cpu_flags

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


def say(msg: str) -> None:
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


def fetch_sdist(cache: Path, progress: Progress = say) -> Path:
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


def build_server(cache: Path | None = None, *, jobs: int = 2, progress: Progress = say,
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
