"""Sampling: the canonical sampler of docs/sampling.md.

- `reference`: the specification as code (the oracle: `sample`, `sample_row`, `top_logprobs`).
- `rows`: the serving path over a call's rows (`sample_rows` -> `SampledCall`), proven equal to it.
- `stage`: `BatchSampler`, the worker's sampler stage, which keeps each session's context and grammar.
- `vocab`, `grammar`: the vocabulary's special tokens, llama.cpp's grammar sampler.
- `pieces`: the vocabulary's pieces as a tree, so a grammar is asked about the whole vocabulary cheaply.
"""

from .arith import RowContext, RowStatus, uniform
from .reference import argmax_rows, raw_logprobs, sample, sample_row, top_logprobs
from .rows import RowInput, SampledCall, sample_rows
from .stage import BatchSampler
from .vocab import Vocabulary

__all__ = [
    "BatchSampler",
    "RowContext",
    "RowInput",
    "RowStatus",
    "SampledCall",
    "Vocabulary",
    "argmax_rows",
    "raw_logprobs",
    "sample",
    "sample_row",
    "sample_rows",
    "top_logprobs",
    "uniform",
]
