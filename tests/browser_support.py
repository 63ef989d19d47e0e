"""A page in headless Chromium, read in real time through the DevTools protocol over a pipe (`--remote-debugging-pipe`:
JSON messages ended by NUL on fds 3 and 4, no port, no websocket library).

`--dump-dom --virtual-time-budget` is not used: virtual time runs on while a streamed fetch waits for its next chunk,
so the page was dumped mid-answer once `dgr serve` streamed its tokens as they came (a stream sent at once had
passed)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any


class _Pipe:
    def __init__(self, write_fd: int, read_fd: int) -> None:
        self.write_fd, self.read_fd, self.buf, self.n = write_fd, read_fd, b"", 0

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        self.n += 1
        msg: dict[str, Any] = {"id": self.n, "method": method, "params": params or {}}
        if session is not None:
            msg["sessionId"] = session
        os.write(self.write_fd, json.dumps(msg).encode() + b"\0")
        while True:  # events and other replies are skipped: the caller waits on this one
            while b"\0" not in self.buf:
                got = os.read(self.read_fd, 1 << 16)
                if not got:
                    raise RuntimeError(f"chromium closed its pipe before answering {method}")
                self.buf += got
            raw, self.buf = self.buf.split(b"\0", 1)
            reply: dict[str, Any] = json.loads(raw)
            if reply.get("id") == self.n:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]  # type: ignore[no-any-return]


def page_when(browser: str, url: str, ready: str, profile: Path, timeout_s: float = 60.0) -> str:
    """The page at `url`'s HTML once the JavaScript expression `ready` is true (or at `timeout_s`)."""
    to_chrome, from_test = os.pipe()
    from_chrome, to_test = os.pipe()

    # bash puts the pipe ends on fds 3 (commands in) and 4 (replies out) and execs chromium: a preexec_fn could do
    # it too, but is not safe in a process with threads (and dash takes no fd number past 9)
    spare = " ".join(f"{fd}<&-" for fd in (to_chrome, to_test) if fd not in (3, 4))  # the copies left
    remap = f'exec "$0" "$@" 3<&{to_chrome} 4>&{to_test} {spare}'
    proc = subprocess.Popen(["bash", "-c", remap, browser, "--headless", "--no-sandbox", "--disable-gpu",
                             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-pipe", url],
                            pass_fds=(to_chrome, to_test), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(to_chrome)
    os.close(to_test)
    pipe = _Pipe(from_test, from_chrome)
    deadline = time.monotonic() + timeout_s
    try:
        page = None
        while page is None and time.monotonic() < deadline:
            targets = pipe.call("Target.getTargets")["targetInfos"]
            page = next((t for t in targets if t["type"] == "page" and t["url"].startswith(url)), None)
            time.sleep(0.05)
        if page is None:
            raise RuntimeError(f"no page for {url} in chromium")
        session = pipe.call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]
        expression = f"({ready}) ? document.documentElement.outerHTML : ''"
        while True:
            html = pipe.call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                             session)["result"].get("value")
            if html or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if not html:
            html = pipe.call("Runtime.evaluate", {"expression": "document.documentElement.outerHTML",
                                                  "returnByValue": True}, session)["result"].get("value")
        return str(html or "")
    finally:
        proc.kill()
        proc.wait()
        os.close(from_test)
        os.close(from_chrome)
