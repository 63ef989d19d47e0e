"""What passes between the scheduler and an engine: the engine's capacity, the fused batch of one
forward pass, and what the pass returns. Plain data, no engine code: the scheduler imports this
module and must load no engine (tests/test_layering.py).

Columnar (one numpy array per field) so an engine can copy it into its own batch struct without a
Python loop per row. Row i is (slots[i], positions[i], tokens[i], wants_logits[i]), plus hidden[i] for
a hop that consumes activations.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from schemas import Phase


@dataclass(frozen=True, slots=True)
class EngineCapacity:
    """What one engine can hold; the scheduler sizes every call to fit it."""

    n_slots: int  # sequence slots (llama.cpp seq ids 0..n_slots-1)
    ctx_per_session: int  # positions a slot can hold
    max_tokens_per_call: int  # rows one fused call may carry (llama.cpp n_batch)
    vocab_size: int
    # Bytes of one session's state at ctx_per_session positions (KV cache and recurrent cells), and how
    # much of it grows per position (0 for a recurrent model: a fixed cell). 0 when the engine does not
    # say (docs/state-layouts.md).
    state_bytes_per_session: int = 0
    state_bytes_per_token: int = 0


# What an engine's rows are: "logits" (a whole model or a route's last hop: rows go to the sampler) or
# "hidden" (a hop that stops at a block boundary: rows are the next hop's input activations).
OutputKind = Literal["logits", "hidden"]


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """What one forward pass returns.

    "logits": one row per batch row that wants logits, in row order, shape (batch.n_logit_rows, vocab_size).
    "hidden": one row per batch row (every row, whatever wants_logits says), in row order, shape
    (len(batch), hidden_size) float32: the residual stream leaving the hop's last block.
    """

    kind: OutputKind
    rows: npt.NDArray[np.float32]
    # Each logits row's argmax (np.argmax: the first maximum, or the first NaN), taken on the thread that ran the
    # forward pass right after it (`with_top`): the sampler's first cut, shared by a chained call's inputs and
    # the loop's sampler (issue 32, item 3). None: not taken (hidden rows, or rows from elsewhere).
    top: npt.NDArray[np.intp] | None = None
    # By row: the raw row's lane maxima, for the rows whose sampling cuts the raw row by them (a top-k row, a row
    # that asks for log-probabilities), taken with `top` (consumer/sampling/stage.py first_cut). None: not taken.
    cuts: Mapping[int, npt.NDArray[np.float32]] | None = None
    # The rows are the engine's own output buffer, valid until the engine's next call: a copy of a
    # large vocabulary's rows costs more than their argmax (Gemma 3, 8 rows of 262,144: 0.7 ms of a 50 ms
    # decode call). Whoever lets the engine run again while the rows are still read takes `owned()` first (a
    # chained call: worker/chain.py).
    borrowed: bool = False

    @classmethod
    def logits(cls, rows: npt.NDArray[np.float32], *, borrowed: bool = False) -> EngineOutput:
        return cls(kind="logits", rows=rows, borrowed=borrowed)

    def owned(self) -> EngineOutput:
        """The output with rows of its own: a copy of borrowed rows, else itself."""
        if not self.borrowed:
            return self
        return EngineOutput(self.kind, np.array(self.rows), self.top, self.cuts)

    def with_top(self) -> EngineOutput:
        """The output with its rows' argmax taken (one vectorised pass while the rows are in cache)."""
        if self.kind != "logits" or self.top is not None:
            return self
        rows = np.asarray(self.rows)
        if rows.ndim != 2 or rows.shape[1] == 0:
            return self
        return EngineOutput(self.kind, self.rows, rows.argmax(axis=1), self.cuts, self.borrowed)

    def take(self, rows: Sequence[int]) -> EngineOutput:
        """These rows only (in this order), with their first cut if taken."""
        idx = np.asarray(rows, dtype=np.intp)
        cuts = None if self.cuts is None else {i: self.cuts[r] for i, r in enumerate(rows) if r in self.cuts}
        return EngineOutput(self.kind, np.asarray(self.rows)[idx], None if self.top is None else self.top[idx], cuts)

    @classmethod
    def hidden(cls, rows: npt.NDArray[np.float32]) -> EngineOutput:
        return cls(kind="hidden", rows=rows)


@dataclass(frozen=True, slots=True)
class BatchRow:
    slot: int
    position: int
    token: int
    wants_logits: bool


@dataclass(frozen=True, slots=True)
class FusedBatch:
    phase: Phase
    slots: npt.NDArray[np.int32]
    positions: npt.NDArray[np.int32]
    tokens: npt.NDArray[np.int32]
    wants_logits: npt.NDArray[np.bool_]
    # (len(batch), hidden_size) float32, row i = the input activation of row i. Present exactly when the
    # engine consumes "hidden" (a hop after the first); tokens then still carry the session's token ids
    # at those positions and the engine ignores them.
    hidden: npt.NDArray[np.float32] | None = None

    @classmethod
    def from_rows(cls, phase: Phase, rows: Sequence[BatchRow],
                  hidden: npt.NDArray[np.float32] | None = None) -> FusedBatch:
        return cls(
            phase=phase,
            slots=np.fromiter((r.slot for r in rows), np.int32, len(rows)),
            positions=np.fromiter((r.position for r in rows), np.int32, len(rows)),
            tokens=np.fromiter((r.token for r in rows), np.int32, len(rows)),
            wants_logits=np.fromiter((r.wants_logits for r in rows), np.bool_, len(rows)),
            hidden=hidden,
        )

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_logit_rows(self) -> int:
        return int(self.wants_logits.sum())

    @property
    def n_sessions(self) -> int:
        return int(np.unique(self.slots).shape[0])

    def rows(self) -> Iterator[BatchRow]:
        for s, p, t, w in zip(self.slots, self.positions, self.tokens, self.wants_logits, strict=True):
            yield BatchRow(int(s), int(p), int(t), bool(w))
