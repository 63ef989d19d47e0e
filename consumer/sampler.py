"""The sampler stage: one fused call's output rows -> one token per item that samples.

It sits between the engine and the scheduler (as vLLM v1's sampler between model runner and
`update_from_output`): the engine computes rows, this turns them into tokens, the scheduler only
takes tokens. Per-row arithmetic is consumer/sampling.py's; this module batches it (greedy rows in one
argmax) and checks the output's shape against the call.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .batch import EngineOutput
from .sampling import argmax_rows, sample
from .schedule_output import ScheduledBatch

__all__ = ["BatchSampler"]


class BatchSampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, batch: ScheduledBatch, output: EngineOutput) -> list[int]:
        """The token of every item of `batch` that samples, in item order. Each draw is keyed by the
        session's seed and the position the token takes (the item's end position), so a token never
        depends on the other rows of the call. ValueError when the rows do not fit the call."""
        if output.kind != "logits":
            raise ValueError(f"cannot sample from {output.kind!r} rows")
        n_logit = batch.fused.n_logit_rows
        arr = np.asarray(output.rows)
        if n_logit == 0 and arr.size == 0:
            return []
        if arr.shape != (n_logit, self.vocab_size):
            raise ValueError(f"logits shape {arr.shape}, expected ({n_logit}, {self.vocab_size})")
        greedy: npt.NDArray[np.intp] | None = None
        tokens: list[int] = []
        row = -1
        for it in batch.items:
            if not it.samples:
                continue
            row += 1
            sampling = it.sampling
            if sampling is None:
                raise ValueError(f"item of job {it.job.job_id} samples but carries no sampling parameters")
            if sampling.greedy:
                if greedy is None:
                    greedy = argmax_rows(arr)
                tokens.append(int(greedy[row]))
            else:
                tokens.append(sample(arr[row], sampling, it.end_position))
        return tokens
