"""The fused batch: what the scheduler hands the engine for exactly one forward pass.

Columnar (one numpy array per field) so an engine can copy it into its own batch struct without a
Python loop per row. Row i is (slots[i], positions[i], tokens[i], wants_logits[i]).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from schemas import Phase


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
