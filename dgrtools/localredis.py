"""A private redis-server on a free loopback port: for the demo, the benchmarks and the tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

INSTALL_HINT = (
    "redis-server was not found on PATH. Install it with `apt-get install -y redis-server` "
    "(Debian/Ubuntu, as root), or start one with `docker compose up -d redis` and pass --redis-url."
)


class RedisNotFound(RuntimeError):
    pass


def find_redis_server() -> str | None:
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """`with LocalRedis() as r: r.url` runs redis-server with its own data dir, AOF everysec on."""

    def __init__(self, port: int | None = None, data_dir: Path | None = None, *, appendonly: bool = True,
                 extra_args: tuple[str, ...] = ()) -> None:
        exe = find_redis_server()
        if exe is None:
            raise RedisNotFound(INSTALL_HINT)
        self.exe = exe
        self.port = port or free_port()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="dgr-redis-")
        self.data_dir = data_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.appendonly = appendonly
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
                "--save", "", "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "everysec", "--daemonize", "no", "--loglevel", "warning",
                *self.extra_args]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    raise RuntimeError(f"redis-server exited at start: {err.strip()}") from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server did not answer on port {self.port}") from None
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
