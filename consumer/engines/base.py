"""What the consumer needs from an engine, and nothing more."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from schemas import BoundarySchema, CompatibilityKey, EngineIdentity, Phase, Recipe, StateLayout

from ..batch import EngineCapacity, EngineOutput, FusedBatch

__all__ = ["Engine", "EngineCapacity", "EngineError", "EngineOutput", "LogitsEngine", "engine_key"]


class EngineError(RuntimeError):
    """One fused call failed. The engine has rolled every slot back to where it was before the call.

    `slots` names the slots known to be at fault (empty when the engine cannot tell); the worker then
    retries without them, or bisects the batch.
    """

    def __init__(self, message: str, slots: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.slots = slots


@runtime_checkable
class Engine(Protocol):
    identity: EngineIdentity
    recipe: Recipe
    boundary: BoundarySchema
    state_layout: StateLayout
    capacity: EngineCapacity

    @property
    def batch_invariant(self) -> bool: ...

    def forward(self, batch: FusedBatch) -> EngineOutput:
        """Exactly one fused forward pass over all rows. Returns one output row per row that asked for
        one, in row order (logits today: shape (batch.n_logit_rows, vocab_size))."""
        ...

    def release(self, slot: int) -> None:
        """Forget the slot's state, so a new session can use it."""
        ...

    def describe(self) -> dict[str, str]:
        """Human-readable facts: backend, CPU path chosen, model file, settings."""
        ...

    def close(self) -> None: ...


class LogitsEngine:
    """Mixin for a whole-model engine whose `step(batch)` returns the logits rows (what tests and
    benchmarks call directly): `forward` wraps them as the worker's EngineOutput."""

    def step(self, batch: FusedBatch) -> npt.NDArray[np.float32]:
        raise NotImplementedError

    def forward(self, batch: FusedBatch) -> EngineOutput:
        return EngineOutput.logits(self.step(batch))


def engine_key(engine: Engine, phase: Phase) -> CompatibilityKey:
    return CompatibilityKey(engine=engine.identity, recipe=engine.recipe, phase=phase,
                            boundary=engine.boundary, state=engine.state_layout)
