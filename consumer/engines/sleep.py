"""An engine that only sleeps a fixed time per fused call: a stand-in for a GPU step (benchmarks).

`--engine sleep:2ms` measures the loop's efficiency at GPU step times on any machine: the sleep
releases the GIL (as ctypes does around `llama_decode`), so whatever the worker overlaps with the
engine runs while it "computes". The logits are cheap and deterministic: each logit row peaks at one
token, a hash of (position, input token): never of the slot, so a session's tokens are the same
whichever slot and batch it lands in (batch-invariant by construction), and replay is exact.

Its sleep is as short as Linux makes it: a thread's default timer slack (50 us) let a 2 ms sleep overrun by
75-80 us (median and mean of 300, this machine; 25-31 us with a slack of 1 ns), 4 % of the step a bench counts
as the worker's. So the thread that calls `step` asks for 1 ns (prctl PR_SET_TIMERSLACK: that thread only).
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import sys
import threading
import time

import numpy as np
import numpy.typing as npt

from schemas import EngineIdentity, Recipe, StateLayout, whole_model_boundary

from ..batch import EngineCapacity, FusedBatch
from .base import LogitsEngine

__all__ = ["SleepEngine", "parse_sleep_spec"]

_SPEC = re.compile(r"^sleep:(\d+(?:\.\d+)?)(ms|us|s)?$")
_UNIT_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


_PR_SET_TIMERSLACK = 29
_slack = threading.local()


def _precise_sleeps() -> None:
    """This thread's timer slack at 1 ns (Linux; elsewhere nothing): its sleeps end when asked, not up to 50 us
    later. Once per thread."""
    if getattr(_slack, "set", False):
        return
    _slack.set = True
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)


def parse_sleep_spec(spec: str) -> float:
    """'sleep:2ms' -> 0.002 (seconds). Units: s, ms (the default), us."""
    m = _SPEC.match(spec.strip())
    if m is None:
        raise ValueError(f"engine {spec!r}: expected sleep:<time>[ms|us|s], e.g. sleep:2ms")
    return float(m.group(1)) * _UNIT_S[m.group(2) or "ms"]


class SleepEngine(LogitsEngine):
    """Sleeps `step_s` per fused call; row i's logits are 0 except 1.0 at its next token."""

    def __init__(self, step_s: float, n_slots: int = 16, ctx_per_session: int = 1024, vocab_size: int = 256,
                 max_tokens_per_call: int = 2048) -> None:
        if step_s < 0 or vocab_size < 4:
            raise ValueError("sleep engine: step_s >= 0 and vocab_size >= 4")
        self.step_s = step_s
        digest = f"{round(step_s * 1e9):016x}{vocab_size:08x}".rjust(64, "0")
        self.identity = EngineIdentity(architecture="sleep", gguf_sha256=digest)
        self.recipe = Recipe(quantization="none", kv_cache_type="none", ctx_per_session=ctx_per_session,
                             flash_attention=False, batch_invariant=True, runtime="sleep/1")
        self.boundary = whole_model_boundary(1)  # no layers, but a block range may not be empty
        self.state_layout = StateLayout(kind="kv", dims={})
        self.capacity = EngineCapacity(n_slots=n_slots, ctx_per_session=ctx_per_session,
                                       max_tokens_per_call=max_tokens_per_call, vocab_size=vocab_size)
        self.calls = 0

    @property
    def batch_invariant(self) -> bool:
        return self.recipe.batch_invariant  # its rows are computed apart: True, unless a bench says otherwise

    def next_tokens(self, batch: FusedBatch) -> npt.NDArray[np.int64]:
        """The token each logit row peaks at (what greedy sampling returns): a hash of the row, never
        0..2 (kept clear of the usual special tokens)."""
        keep = batch.wants_logits
        p = batch.positions[keep].astype(np.int64)
        t = batch.tokens[keep].astype(np.int64)
        h = (p * 7_919 + t * 104_729) % (self.capacity.vocab_size - 3)
        return h + 3

    def step(self, batch: FusedBatch) -> npt.NDArray[np.float32]:
        self.calls += 1
        t_end = time.perf_counter() + self.step_s
        peaks = self.next_tokens(batch)
        rows = np.zeros((peaks.shape[0], self.capacity.vocab_size), np.float32)
        rows[np.arange(peaks.shape[0]), peaks] = 1.0
        left = t_end - time.perf_counter()
        if left > 0:
            _precise_sleeps()
            time.sleep(left)  # releases the GIL, like ctypes around llama_decode
        return rows

    def release(self, slot: int) -> None:
        pass

    def describe(self) -> dict[str, str]:
        return {"backend": f"sleep ({1e3 * self.step_s:g} ms per fused call, no arithmetic)",
                "vocab_size": str(self.capacity.vocab_size)}

    def close(self) -> None:
        pass
