"""The worker's sampler stage, by its historical import path: see consumer/sampling/ (docs/sampling.md)."""

from .sampling import BatchSampler, RowInput, RowStatus, SampledCall, Vocabulary, sample_rows

__all__ = ["BatchSampler", "RowInput", "RowStatus", "SampledCall", "Vocabulary", "sample_rows"]
