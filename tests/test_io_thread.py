"""The worker's I/O thread (consumer/worker/io_thread.py): jobs run one at a time in the order handed over, a
result is collected by waiting for it, an error is raised in the loop's thread at the next collect or drain
(a job's own, or one handed over before it), and a close waits for the running job and drops the rest."""

from __future__ import annotations

import threading
import time

import pytest

from consumer.worker.io_thread import IOThread, Skipped


def test_jobs_run_in_order_on_one_thread_and_their_results_are_collected() -> None:
    io = IOThread("t-io")
    seen: list[tuple[int, str]] = []

    def job(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * 10

    handed = [io.submit(lambda i=i: job(i)) for i in range(20)]
    assert io.collect(handed[-1]) == 190
    assert [i for i, _ in seen] == list(range(20)) and {n for _, n in seen} == {"t-io_0"}
    assert [h.result() for h in handed] == [i * 10 for i in range(20)]
    assert not io.busy
    io.close()


def test_an_error_is_raised_at_the_next_collect_even_of_a_later_job() -> None:
    io = IOThread("t-io")

    def boom() -> None:
        raise RuntimeError("lease lost")

    io.submit(boom)
    later = io.submit(lambda: 7)
    with pytest.raises(RuntimeError, match="lease lost"):
        io.collect(later)
    assert io.collect(io.submit(lambda: 8)) == 8  # the error was raised once; the thread goes on
    io.close()


def test_drain_waits_for_every_job_then_raises_the_first_error() -> None:
    io = IOThread("t-io")
    done: list[int] = []

    def fail(i: int) -> None:
        done.append(i)
        raise ValueError(f"job {i}")

    io.submit(lambda: fail(1))
    io.submit(lambda: time.sleep(0.05) or done.append(2))
    io.submit(lambda: fail(3))
    with pytest.raises(ValueError, match="job 1"):
        io.drain()
    assert done == [1, 2, 3] and not io.busy
    io.drain()  # nothing left
    io.close()


def test_close_waits_for_the_running_job_and_drops_the_rest() -> None:
    io = IOThread("t-io")
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def running() -> str:
        started.set()
        release.wait(5)
        ran.append("running")
        return "done"

    first = io.submit(running)
    rest = [io.submit(lambda: ran.append("not started")) for _ in range(3)]
    assert started.wait(5) and io.busy
    threading.Timer(0.05, release.set).start()
    io.close()
    assert ran == ["running"] and first.result() == "done"
    for h in rest:
        with pytest.raises(Skipped):
            h.result()
    assert io.collect(io.submit(lambda: "again")) == "again"  # a submit after a close starts the thread again
    io.close()
