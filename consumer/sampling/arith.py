"""The primitives of docs/sampling.md that both the oracle and the serving path use: the random draw's
uniform number, the 64-lane sum, the status codes, a row's context. Each is tested against its literal
definition (tests/test_sampling.py), so sharing them does not hide a difference between the two paths.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["LANES", "RowContext", "RowStatus", "lane_sum", "lane_sum_dense", "splitmix64", "uniform"]

LANES = 1024  # lanes of the normaliser's sum (docs/sampling.md, 2.5)
F32 = np.float32
_MASK = (1 << 64) - 1


class RowStatus(enum.IntEnum):
    """Why a sampling row has a token or not (`SampledCall.status`)."""

    OK = 0
    NO_TOKEN = 1  # no logit above -inf after the masks (every id banned, or the engine's row is -inf/NaN)
    GRAMMAR_END = 2  # the session's grammar admits no token (or refused a token fed to the session)
    GRAMMAR_INVALID = 3  # the grammar (or JSON schema) does not compile
    GRAMMAR_UNSUPPORTED = 4  # the engine has no llama.cpp vocabulary: no grammars here
    NO_CONTEXT = 5  # the row needs the session's context (penalties, min_tokens, a grammar), not all seen


@dataclass(frozen=True, slots=True)
class RowContext:
    """A session's context at a sampling row: its tokens at positions 0 .. len(tokens) - 1 (the token
    sampled takes position len(tokens)); positions below prompt_end are prompt."""

    tokens: npt.NDArray[np.int32]
    prompt_end: int
    stop_tokens: tuple[int, ...] = ()

    @property
    def generated(self) -> int:
        return max(0, int(self.tokens.shape[0]) - self.prompt_end)

    def window(self, last_n: int, prompt: bool) -> npt.NDArray[np.int32]:
        """The penalty window (docs/sampling.md 1.2): the last `last_n` tokens (-1: all), the prompt's
        included only if `prompt`."""
        p = int(self.tokens.shape[0])
        start = 0 if prompt else min(self.prompt_end, p)
        if last_n > 0:
            start = max(start, p - last_n)
        return self.tokens[start:p]


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """The draw's number in [0, 1): a pure function of (seed, position)."""
    return (splitmix64(splitmix64(seed) ^ position) >> 11) * 2.0**-53


def _add_lanes(lanes: npt.NDArray[np.float32]) -> np.float32:
    return F32(np.cumsum(lanes, dtype=F32)[-1])  # cumsum: one by one, lane 0 first


def lane_sum_dense(e: npt.NDArray[np.float32]) -> np.float32:
    """The lane sum of a whole row (docs/sampling.md, 2.5): lane j adds e[j], e[j + LANES], ... one by one
    (the column sum of the (V/LANES, LANES) view adds row after row), then the lanes one by one."""
    n = e.shape[0] - e.shape[0] % LANES
    lanes = e[:n].reshape(-1, LANES).sum(axis=0, dtype=F32) if n else np.zeros(LANES, dtype=F32)
    tail = e[n:]
    lanes[:tail.shape[0]] += tail
    return _add_lanes(lanes)


def lane_sum(ids: npt.NDArray[np.intp], e: npt.NDArray[np.float32]) -> np.float32:
    """The lane sum of the values e at ids (any order): the same number as lane_sum_dense of the row
    that holds them and zeros elsewhere (adding +0.0 changes nothing)."""
    order = np.argsort(ids, kind="stable")
    lanes = np.zeros(LANES, dtype=F32)
    np.add.at(lanes, ids[order] % LANES, e[order])  # unbuffered, in the order given: increasing id
    return _add_lanes(lanes)
