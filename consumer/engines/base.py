"""What the consumer needs from an engine, and nothing more."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from schemas import BoundarySchema, CompatibilityKey, EngineIdentity, Phase, Reason, Recipe, StateLayout
from schemas.errors import EngineError  # one error root (schemas/errors.py); engines raise it from here

from ..batch import EngineCapacity, EngineOutput, FusedBatch

__all__ = ["Engine", "EngineCapacity", "EngineError", "EngineOutput", "LogitsEngine", "check_hidden", "engine_key",
           "lending_forward"]


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
        """Exactly one fused forward pass over all rows. "logits": one row per row that asked for one,
        in row order, (batch.n_logit_rows, vocab_size). "hidden" (a hop that is not the last): one row
        per batch row, (len(batch), boundary.hidden_size). The rows are the caller's: no later call may
        write them (a chained call computes while the loop samples the call before: consumer/worker/chain.py).
        An engine's class may also offer `forward_lent(batch)`, whose rows may be its own buffer
        (EngineOutput.borrowed, valid until its next call): the worker's calls use it (prefix/run.py)."""
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


def lending_forward(engine: Any) -> Callable[[FusedBatch], EngineOutput]:
    """The engine's `forward_lent` when its class offers one (rows possibly its own buffer, valid until its next
    call: EngineOutput.borrowed), else its `forward`: for a caller that reads a call's rows before the engine runs
    again. Asked of the class, so a wrapper that delegates its attributes to such an engine is called through its
    own `forward`."""
    return engine.forward_lent if hasattr(type(engine), "forward_lent") else engine.forward


def check_hidden(batch: FusedBatch, boundary: BoundarySchema) -> npt.NDArray[np.float32] | None:
    """The batch's input activations, checked against what the hop consumes: None for a hop that takes
    tokens, else a C-contiguous float32 (len(batch), hidden_size) array of finite values. Anything else
    is an EngineError (naming the slots of non-finite rows), never a crash inside the engine."""
    h = batch.hidden
    if boundary.consumes != "hidden":
        if h is not None:
            raise EngineError(f"this hop consumes tokens (blocks [{boundary.first_layer}, {boundary.last_layer})), "
                              "the batch carries hidden activations", reason=Reason.BAD_ACTIVATIONS)
        return None
    if h is None:
        raise EngineError(f"this hop consumes hidden activations (blocks [{boundary.first_layer}, "
                          f"{boundary.last_layer})), the batch carries none", reason=Reason.BAD_ACTIVATIONS)
    if not isinstance(h, np.ndarray) or h.dtype != np.float32:
        raise EngineError(f"hidden activations must be a float32 array, not {getattr(h, 'dtype', type(h))}",
                          reason=Reason.BAD_ACTIVATIONS)
    want = (len(batch), boundary.hidden_size)
    if h.shape != want:
        raise EngineError(f"hidden activations of shape {h.shape}, {want} expected", reason=Reason.BAD_ACTIVATIONS)
    finite = np.isfinite(h).all(axis=1)
    if not finite.all():
        bad = tuple(sorted({int(s) for s in np.asarray(batch.slots)[~finite]}))
        raise EngineError(f"hidden activations not finite (NaN/inf) in slots {list(bad)}", bad,
                          reason=Reason.BAD_ACTIVATIONS)
    return np.ascontiguousarray(h)


def engine_key(engine: Engine, phase: Phase) -> CompatibilityKey:
    return CompatibilityKey(engine=engine.identity, recipe=engine.recipe, phase=phase,
                            boundary=engine.boundary, state=engine.state_layout)
