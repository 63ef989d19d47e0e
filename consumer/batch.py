"""What passes between the scheduler and an engine: the engine's capacity, the fused batch of one
forward pass, and what the pass returns. Plain data, no engine code: the scheduler imports this
module and must load no engine (tests/test_layering.py).

Columnar (one numpy array per field) so an engine can copy it into its own batch struct without a
Python loop per row. Row i is (slots[i], positions[i], tokens[i], wants_logits[i]).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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


# What an engine's rows are. Only "logits" today (a whole-model engine, rows go to the sampler); an engine
# that stops at a layer boundary would answer "hidden" rows for the next hop instead of tokens.
OutputKind = Literal["logits"]


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """What one forward pass returns: one row per batch row that wants output, in row order."""

    kind: OutputKind
    rows: npt.NDArray[np.float32]  # (batch.n_logit_rows, vocab_size) for "logits"

    @classmethod
    def logits(cls, rows: npt.NDArray[np.float32]) -> EngineOutput:
        return cls(kind="logits", rows=rows)


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

    @classmethod
    def from_rows(cls, phase: Phase, rows: Sequence[BatchRow]) -> FusedBatch:
        return cls(
            phase=phase,
            slots=np.fromiter((r.slot for r in rows), np.int32, len(rows)),
            positions=np.fromiter((r.position for r in rows), np.int32, len(rows)),
            tokens=np.fromiter((r.token for r in rows), np.int32, len(rows)),
            wants_logits=np.fromiter((r.wants_logits for r in rows), np.bool_, len(rows)),
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
