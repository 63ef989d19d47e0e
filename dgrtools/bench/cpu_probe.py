"""What CPU features a llama.cpp build uses: its `system_info` line, parsed, and compared with ours.
(/proc/cpuinfo itself is read by consumer/cpuinfo.py.)
"""


import re
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from dgrtools.localredis import free_port

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
