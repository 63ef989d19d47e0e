"""What the consumer needs from an engine, and nothing more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from schemas import BoundarySchema, CompatibilityKey, EngineIdentity, Phase, Recipe, StateLayout

from ..batch import FusedBatch


@dataclass(frozen=True, slots=True)
class EngineCapacity:
    n_slots: int  # sequence slots (llama.cpp seq ids 0..n_slots-1)
    ctx_per_session: int  # positions a slot can hold
    max_tokens_per_call: int  # rows one fused call may carry (llama.cpp n_batch)
    vocab_size: int


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

    def step(self, batch: FusedBatch) -> npt.NDArray[np.float32]:
        """Exactly one fused forward pass over all rows. Returns logits, shape
        (batch.n_logit_rows, vocab_size), in the order of the rows that asked for them."""
        ...

    def release(self, slot: int) -> None:
        """Forget the slot's state, so a new session can use it."""
        ...

    def describe(self) -> dict[str, str]:
        """Human-readable facts: backend, CPU path chosen, model file, settings."""
        ...

    def close(self) -> None: ...


def engine_key(engine: Engine, phase: Phase) -> CompatibilityKey:
    return CompatibilityKey(engine=engine.identity, recipe=engine.recipe, phase=phase,
                            boundary=engine.boundary, state=engine.state_layout)
