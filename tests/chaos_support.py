"""The chaos suite's harness: a restartable redis-server, consumers as real processes, the producer
in a thread, and THE check every scenario ends with (`check_exact`).

Every scenario runs sessions through real faults and then asserts, per session: it ended finished or
cancelled; its tokens are its solo tokens (a cancelled one: a prefix of them); its result stream
answers every job id at most once and its ok tokens, in stream order, are exactly the tokens the
producer holds (no gap, no duplicate); its accounting hash is closed and counts exactly those
tokens (prompt tokens once, by docs/accounting.md); per account, every counter equals the sum over
its sessions; and the worker's last heartbeat shows no busy slot.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from consumer.runtime import make_engine
from dgrtools.localredis import LocalRedis, free_port
from dgrtools.process import ConsumerProcess as _ConsumerProcess
from dgrtools.split_model import split_route
from dgrtools.tiny_model import write_tiny_model
from producer import Producer, SessionHandle
from schemas import GROUP, RouteHop, Sampling, SessionSpec, Status, StepResult, WorkerKeys

from .support import ConsumerProcess, session_results, solo_generate

# Short lease and sweep so that the default suite stays short; the soak runs the real durations.
FAST = ("--lease-ms", "1000", "--recover-every-s", "0.3", "--heartbeat-s", "0.2", "--outage-max-s", "60")
SOAK = os.environ.get("DGR_SOAK") == "1"
SEED = int(os.environ.get("DGR_CHAOS_SEED", str(time.time_ns() % 2**31)))  # in every failure message


class RestartableRedis(LocalRedis):
    """A redis-server on a fixed port and data dir that survives stop/kill and restarts on both."""

    # appendfsync no: Redis writes its AOF buffer to the file (the page cache) before it replies, every event loop,
    # so a kill -9 of the process loses nothing it acknowledged, which THE check needs. With everysec, a background
    # fsync slow under the suite's disk load postpones those writes for up to 2 s while Redis goes on replying,
    # and a kill -9 then lost an answer the producer had read ("stream tokens != handle", 1 run of 7 at -n 4).
    # Losing acknowledged writes is tests/test_failover.py's case (DGR_SOAK=1), with checks that allow for it.
    def __init__(self, data_dir: Path, *, appendfsync: str = "no") -> None:
        super().__init__(port=free_port(), data_dir=data_dir, appendonly=True,
                         extra_args=("--appendfsync", appendfsync))

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def shutdown(self) -> None:
        """`redis-cli shutdown`: the server saves and exits on its own."""
        with __import__("contextlib").suppress(redis.ConnectionError):
            redis.Redis.from_url(self.url).shutdown(nosave=False)
        assert self.proc is not None
        self.proc.wait(10)
        self.proc = None


def consumer(url: str, worker: str, model: Path, logs: Path, *, slots: int = 8,
             extra: Sequence[str] = ()) -> _ConsumerProcess:
    """A reference-engine consumer with the short lease settings, once it has beaten its heartbeat."""
    return ConsumerProcess(url, worker, model, logs, slots=slots, extra=[*FAST, *extra])  # type: ignore[no-any-return]


def tiny_blocks(tmp_path: Path) -> tuple[Path, list[Path]]:
    """The tiny model with 4 layers, and its three blocks (layers 0, 1-2, 3) for a route of three hops."""
    src = tmp_path / "tiny4.gguf"
    write_tiny_model(src, seed=0, quant="q8_0", n_layer=4)
    return src, [h.path for h in split_route(src, tmp_path / "hops", (1, 3))]


def bare_consumer(url: str, worker: str, model: Path, logs: Path, *, slots: int = 8,
                  extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """The same, not waited for (a standby, a consumer started before Redis); its output goes to
    logs/bare-<worker>-<n>.log."""
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "consumer", "consumer", "--redis-url", url, "--worker-id", worker,
           "--model", str(model), "--engine", "reference", "--slots", str(slots), "--max-batch", str(slots),
           "--log-format", "text", "--threads", "2", *FAST, *extra]
    with open(logs / f"bare-{worker}-{time.monotonic_ns()}.log", "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def bare_log(logs: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("bare-*.log")))


_SOLO: dict[tuple[tuple[int, ...], int], list[int]] = {}


def solo(model: Path, prompt: Sequence[int], n: int) -> list[int]:
    key = (tuple(prompt), n)
    if key not in _SOLO:
        eng = make_engine(model, kind="reference", recipe="invariant", n_slots=1, ctx_per_session=1024)
        try:
            _SOLO[key] = solo_generate(eng, list(prompt), n)
        finally:
            eng.close()
    return _SOLO[key]


def specs_for(client: redis.Redis, worker: str, prefix: str, ps: Sequence[Sequence[int]],
              max_tokens: int) -> list[tuple[SessionSpec, list[int]]]:
    key = Producer(client).discover(worker).keys[0]
    return [(SessionSpec(session_id=f"{prefix}-{i}", account_id=f"acct-{i % 2}",
                         route=(RouteHop(worker_id=worker, key=key),), sampling=Sampling(), max_tokens=max_tokens),
             list(p)) for i, p in enumerate(ps)]


@dataclass
class Drive:
    """run_many in a thread; `results` counts the results seen, for triggering faults."""

    producer: Producer
    specs: list[tuple[SessionSpec, list[int]]]
    on_result: Callable[[SessionHandle, StepResult], None] | None = None
    start_times: list[float] | None = None
    results: int = 0
    handles: dict[str, SessionHandle] = field(default_factory=dict)
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self) -> Drive:
        def seen(h: SessionHandle, r: StepResult) -> None:
            self.results += 1
            if self.on_result is not None:
                self.on_result(h, r)

        def run() -> None:
            try:
                self.handles = self.producer.run_many(self.specs, on_result=seen, start_times=self.start_times)
            except BaseException as e:  # reported by join()
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return self

    def wait_results(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.results < n:
            assert self.thread is not None
            if not self.thread.is_alive():
                # Done with fewer results than a drawn fault point (a schedule drawn past the run's end,
                # continuation jobs answering ahead): the fault hits a finished run; join() judges it.
                assert self.error is None, f"producer ended early: {self.error!r}"
                return
            assert time.monotonic() < deadline, f"only {self.results} results"
            time.sleep(0.005)

    def join(self, timeout_s: float = 120.0) -> dict[str, SessionHandle]:
        assert self.thread is not None
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the producer did not finish"
        if self.error is not None:
            raise self.error
        return self.handles


def stream_results(client: redis.Redis, worker: str, sid: str) -> list[StepResult]:
    return session_results(client, worker, sid)


def _num(x: bytes | None) -> float:
    return float(x) if x is not None else 0.0


# the fields of a session hash that are not counters
NOT_COUNTERS = (b"account", b"closed", b"reaped", b"reaped_by", b"att", b"pub", b"hw", b"gaps", b"owed")


def check_exact(client: redis.Redis, worker: str, specs: Sequence[tuple[SessionSpec, list[int]]],
                handles: dict[str, SessionHandle], model: Path | None, *, allow_cancel: set[str] = frozenset(),  # type: ignore[assignment]
                must_cancel: set[str] = frozenset(),  # type: ignore[assignment]
                solo_of: Callable[[SessionSpec, list[int]], list[int]] | None = None) -> dict[str, Any]:
    """THE check (see the module docstring). Returns a summary for the report. A session's solo tokens
    come from the reference engine on `model`, or from `solo_of(spec, prompt)` (a worker of several
    engines: each session's own model)."""
    keys = WorkerKeys(worker)
    summary: dict[str, Any] = {"sessions": len(specs), "finished": 0, "cancelled": 0, "recomputed": 0,
                               "replays": sum(h.attempt for h in handles.values()), "results": 0}
    by_account: dict[str, dict[str, float]] = {}
    for spec, prompt in specs:
        sid = spec.session_id
        h = handles[sid]
        if solo_of is not None:
            want = solo_of(spec, prompt)
        else:
            assert model is not None
            want = solo(model, prompt, spec.max_tokens)
        if sid in must_cancel:
            assert h.status == "cancelled", (sid, h.status, h.reason, h.detail)
        if h.status == "cancelled":
            assert sid in allow_cancel | must_cancel, f"{sid} cancelled unasked"
            assert h.generated == want[:len(h.generated)], sid
            summary["cancelled"] += 1
        else:
            assert h.status == "finished", (sid, h.status, h.reason, h.detail)
            assert h.generated == want, (sid, h.generated, want)
            summary["finished"] += 1
        results = stream_results(client, worker, sid)
        summary["results"] += len(results)
        ids = [r.job_id for r in results]
        assert len(ids) == len(set(ids)), f"{sid}: a job answered twice in its result stream"
        # by position: a replay that samples the session's tokens again answers them again (a later attempt), and
        # must answer the same token at each (producer/steps.py `regenerates`)
        by_position: dict[int, int] = {}
        for r in results:
            if r.status == Status.OK and r.token is not None:
                had = by_position.setdefault(r.position, r.token)
                assert had == r.token, f"{sid}: tokens {had} and {r.token} answered at position {r.position}"
        ok_tokens = [by_position[p] for p in sorted(by_position)]
        assert ok_tokens == h.generated, f"{sid}: stream tokens {ok_tokens} != handle {h.generated}"
        assert not any(r.status == Status.REJECTED for r in results), \
            f"{sid}: rejected answers {[(r.reason, r.detail) for r in results if r.status == Status.REJECTED]}"
        acct = client.hgetall(keys.session_account(sid))
        assert acct.get(b"closed") in (b"finished", b"cancelled"), (sid, acct)
        assert int(_num(acct.get(b"generated_tokens"))) == len(ok_tokens), (sid, acct)
        if h.status == "finished":
            assert int(_num(acct.get(b"prompt_tokens"))) == len(prompt), (sid, acct)  # each prompt position once
        else:
            assert int(_num(acct.get(b"prompt_tokens"))) <= len(prompt), (sid, acct)
        summary["recomputed"] += int(_num(acct.get(b"recomputed_tokens")))
        tally = by_account.setdefault(spec.account_id, {})
        for k, v in acct.items():
            if k not in NOT_COUNTERS:
                tally[k.decode()] = tally.get(k.decode(), 0.0) + float(v)
    for account, tally in by_account.items():
        got = {k.decode(): float(v) for k, v in client.hgetall(keys.billing_account(account)).items()}
        for counter, total in tally.items():
            assert abs(got.get(counter, 0.0) - total) <= 1e-6 * max(1.0, total), (account, counter, got, tally)
        assert set(got) <= set(tally) | {"engine_seconds"}, (account, got, tally)
    report(summary)
    return summary


def report(summary: dict[str, Any]) -> None:
    """With DGR_CHAOS_REPORT=path: append the scenario's measured outcome (JSON line) there."""
    path = os.environ.get("DGR_CHAOS_REPORT")
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], **summary}) + "\n")


def wait_idle_heartbeat(client: redis.Redis, worker: str, timeout_s: float = 20.0) -> dict[str, Any]:
    """The worker's heartbeat once it shows no busy slot (a leaked slot fails here)."""
    import json

    deadline = time.monotonic() + timeout_s
    hb: dict[str, Any] = {}
    while time.monotonic() < deadline:
        raw = client.get(WorkerKeys(worker).heartbeat)
        hb = json.loads(raw) if raw else {}
        if hb and hb.get("busy_slots") == 0:
            return hb
        time.sleep(0.05)
    raise AssertionError(f"busy slots left: {hb.get('busy_slots')} ({hb})")


def stall_report(client: redis.Redis, worker: str, session_ids: Sequence[str]) -> str:
    """What a stalled run leaves in Redis, for its failure message: the worker's heartbeat, each input stream's
    length and pending entries (the step jobs read and not answered, with their fields), and each session's
    last result."""
    hb = client.get(WorkerKeys(worker).heartbeat)
    lines = [f"heartbeat: {hb.decode(errors='replace') if hb else None}"]
    for raw in client.scan_iter(match=f"dgr:{{{worker}}}:in:*", count=1000):
        stream = raw.decode()
        try:
            pending = client.xpending_range(stream, GROUP, "-", "+", 50)
        except redis.ResponseError as e:
            lines.append(f"{stream}: {e}")
            continue
        lines.append(f"{stream}: length {client.xlen(stream)}, pending {len(pending)}")
        for p in pending:
            got = client.xrange(stream, p["message_id"], p["message_id"])
            fields = {k.decode(errors="replace"): v[:200] for k, v in got[0][1].items()} if got else None
            lines.append(f"  {p['message_id']!r} {p['consumer']!r} x{p['times_delivered']}: {fields}")
    for sid in session_ids:
        try:
            res = stream_results(client, worker, sid)
        except Exception as e:  # a result the parser refuses is itself worth seeing
            lines.append(f"{sid}: {e!r}")
            continue
        last = repr(res[-1])[:400] if res else None
        lines.append(f"{sid}: {len(res)} results, last {last}")
    return "\n".join(lines)


def pause(proc: _ConsumerProcess | subprocess.Popen[bytes], seconds: float) -> None:
    p = proc.proc if isinstance(proc, _ConsumerProcess) else proc
    p.send_signal(signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        p.send_signal(signal.SIGCONT)
