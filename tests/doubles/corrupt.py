"""An engine wrapper that corrupts fused batches on purpose: proof that the concurrency checks bite.

Only batches with rows of at least two sessions are touched (a solo run stays clean, so "batched
equals solo" must fail), and only the `at`-th such batch (then every `every`-th one, if set). Modes:
- "swap_tokens": two sessions' last rows swap their input tokens (each reads the other's token: its
  KV and logits now continue the wrong text);
- "swap_logits": two sessions' logits rows come back swapped (a result delivered to the wrong
  session, as a wrong index into the logits buffer would);
- "swap_slots": two sessions' rows at the same position swap slots (each writes into and attends to
  the other's KV); falls back to "swap_tokens" when no two sessions share a position.
`corruptions` counts what was done, so a test can assert that the corruption really happened.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

from consumer.batch import FusedBatch
from consumer.engines.base import Engine, LogitsEngine

Mode = Literal["swap_tokens", "swap_logits", "swap_slots"]


class CorruptingEngine(LogitsEngine):
    def __init__(self, inner: Engine, mode: Mode = "swap_tokens", *, at: int = 2, every: int = 0) -> None:
        self.inner = inner
        self.mode: Mode = mode
        self.at, self.every = at, every
        self.multi_calls = 0
        self.corruptions = 0
        self.identity = inner.identity
        self.recipe = inner.recipe
        self.boundary = inner.boundary
        self.state_layout = inner.state_layout
        self.capacity = inner.capacity

    @property
    def batch_invariant(self) -> bool:
        return self.inner.batch_invariant

    def _due(self, batch: FusedBatch) -> bool:
        if batch.n_sessions < 2:
            return False
        k = self.multi_calls
        self.multi_calls += 1
        return k == self.at or (self.every > 0 and k > self.at and (k - self.at) % self.every == 0)

    @staticmethod
    def _last_rows(batch: FusedBatch) -> list[int]:
        """Index of each session's last row, in order of first appearance."""
        last: dict[int, int] = {}
        for i, s in enumerate(batch.slots.tolist()):
            last[s] = i
        return list(last.values())

    def step(self, batch: FusedBatch) -> npt.NDArray[np.float32]:
        if not self._due(batch):
            return self.inner.forward(batch).rows
        rows = self._last_rows(batch)
        i, j = rows[0], rows[1]
        if self.mode == "swap_logits":
            out = self.inner.forward(batch).rows
            wanted = np.flatnonzero(batch.wants_logits)
            li, lj = int(np.searchsorted(wanted, i)), int(np.searchsorted(wanted, j))
            if batch.wants_logits[i] and batch.wants_logits[j]:
                out[[li, lj]] = out[[lj, li]]
                self.corruptions += 1
            return out
        slots, tokens = batch.slots.copy(), batch.tokens.copy()
        if self.mode == "swap_slots":
            pos = batch.positions
            pair = next(((a, b) for a in rows for b in rows if a < b and pos[a] == pos[b]), None)
            if pair is not None:
                a, b = pair
                slots[[a, b]] = slots[[b, a]]
                self.corruptions += 1
                return self.inner.forward(FusedBatch(batch.phase, slots, batch.positions.copy(), tokens,
                                                     batch.wants_logits.copy())).rows
        if tokens[i] != tokens[j]:
            tokens[[i, j]] = tokens[[j, i]]
            self.corruptions += 1
        return self.inner.forward(FusedBatch(batch.phase, slots, batch.positions.copy(), tokens,
                                             batch.wants_logits.copy())).rows

    def release(self, slot: int) -> None:
        self.inner.release(slot)

    def describe(self) -> dict[str, str]:
        return {**self.inner.describe(), "corrupting": f"{self.mode} at multi-session call {self.at}"
                + (f", then every {self.every}" if self.every else "")}

    def close(self) -> None:
        self.inner.close()
