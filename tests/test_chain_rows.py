"""A chained call never writes the rows of the call before it while the loop reads them: an engine may return its
own output buffer (EngineOutput.borrowed: llama.cpp's logits, read in place), which its next call overwrites, so
the engine thread owns a call's rows before it goes on with the next (consumer/worker/chain.py)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from consumer.batch import BatchRow, EngineOutput, FusedBatch
from consumer.sched import ScheduledBatch
from consumer.worker.chain import Link, run_chain


class BufferEngine:
    """Like llama.cpp: every call writes its logits into one buffer and returns it read-only, in place."""

    def __init__(self, vocab: int = 16) -> None:
        self.buf = np.zeros((1, vocab), np.float32)
        self.calls = 0

    def forward(self, fused: FusedBatch) -> EngineOutput:
        self.calls += 1
        self.buf[:] = 0.0
        self.buf[0, self.calls] = 1.0  # call k peaks at token k
        view = self.buf.view()
        view.flags.writeable = False
        return EngineOutput.logits(view, borrowed=True)


def _call(position: int) -> tuple[ScheduledBatch, FusedBatch]:
    fused = FusedBatch.from_rows("decode", [BatchRow(0, position, 3, True)])
    return ScheduledBatch("decode", fused, ()), fused


def test_a_chained_call_leaves_the_rows_of_the_call_before_as_they_were() -> None:
    engine = BufferEngine()
    first, second = Link(*_call(4)), Link(*_call(5), successor=object())  # type: ignore[arg-type]
    first.offer = second

    def fill(successor: Any, before: Link, out: EngineOutput) -> bool:
        return True

    run_chain(engine, None, first, threading.Lock(), fill)
    out1, out2 = first.result.result()[0], second.result.result()[0]
    assert engine.calls == 2
    assert isinstance(out1, EngineOutput) and isinstance(out2, EngineOutput)
    assert int(np.argmax(out1.rows[0])) == 1 and int(out1.top[0]) == 1  # type: ignore[index]
    assert not out1.borrowed and out1.rows.flags.owndata
    # the chain's last call: the loop reads it before any other
    assert out2.borrowed and int(np.argmax(out2.rows[0])) == 2


def test_a_call_not_followed_keeps_the_engines_rows() -> None:
    """No copy when the engine does not go on (the loop reads them before it starts the next call)."""
    engine = BufferEngine()
    only = Link(*_call(4))
    run_chain(engine, None, only, threading.Lock(), lambda *a: True)
    out = only.result.result()[0]
    assert isinstance(out, EngineOutput) and out.borrowed and np.shares_memory(out.rows, engine.buf)
