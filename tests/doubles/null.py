"""An engine that does no arithmetic: it measures everything around the engine (benchmarks only)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from consumer.batch import FusedBatch
from consumer.engines.base import EngineCapacity, LogitsEngine
from schemas import EngineIdentity, Recipe, StateLayout, whole_model_boundary


class NullEngine(LogitsEngine):
    """Logits are a fixed row (argmax = `token`); positions are tracked per slot like a real engine."""

    def __init__(self, n_slots: int = 64, ctx_per_session: int = 4096, vocab_size: int = 256,
                 token: int = 7, model: int = 0) -> None:
        # `model`: engines of different numbers are different models (their own keys, streams)
        self.identity = EngineIdentity(architecture="null", gguf_sha256=f"{model:064x}")
        self.recipe = Recipe(quantization="none", kv_cache_type="none", ctx_per_session=ctx_per_session,
                             flash_attention=False, batch_invariant=True, runtime="null/1")
        self.boundary = whole_model_boundary(1)  # a block range is never empty (schemas/compat.py)
        self.state_layout = StateLayout(kind="kv", dims={})
        self.capacity = EngineCapacity(n_slots=n_slots, ctx_per_session=ctx_per_session,
                                       max_tokens_per_call=4096, vocab_size=vocab_size)
        self._row = np.zeros(vocab_size, np.float32)
        self._row[token] = 1.0
        self.calls = 0

    @property
    def batch_invariant(self) -> bool:
        return True

    def step(self, batch: FusedBatch) -> npt.NDArray[np.float32]:
        self.calls += 1
        return np.broadcast_to(self._row, (batch.n_logit_rows, self._row.shape[0])).copy()

    def release(self, slot: int) -> None:
        pass

    def describe(self) -> dict[str, str]:
        return {"backend": "null (no arithmetic)"}

    def close(self) -> None:
        pass
