"""The sleep engine (consumer/engines/sleep.py), the benchmarks' stand-in for a GPU step: its thread's timer slack
is set to 1 ns the first time it sleeps, so a step ends when asked (the default 50 us slack overran a 2 ms sleep by
75-80 us here). Checked through the kernel's own answer, never a timing."""

from __future__ import annotations

import ctypes
import sys
import threading

import numpy as np
import pytest

from consumer.batch import FusedBatch
from consumer.engines.sleep import SleepEngine

PR_SET_TIMERSLACK, PR_GET_TIMERSLACK = 29, 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl timer slack is Linux's")
def test_a_step_leaves_its_thread_with_a_timer_slack_of_one_nanosecond() -> None:
    prctl = ctypes.CDLL(None).prctl
    got: list[int] = []
    batch = FusedBatch(phase="decode", slots=np.arange(2, dtype=np.int32), positions=np.zeros(2, np.int32),
                       tokens=np.ones(2, np.int32), wants_logits=np.ones(2, np.bool_))

    def run() -> None:
        prctl(PR_SET_TIMERSLACK, 50_000, 0, 0, 0)  # Linux's default (a thread inherits its creator's)
        got.append(prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0))
        rows = SleepEngine(0.001, n_slots=2).step(batch)
        assert rows.shape == (2, 256)
        got.append(prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0))

    t = threading.Thread(target=run)  # a thread of its own: the test process's threads keep their slack
    t.start()
    t.join()
    assert got == [50_000, 1], got
