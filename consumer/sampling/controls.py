"""A row's processing (docs/sampling.md, section 1), sparse: the ids penalties and biases patch, with
their values, and the ids masks remove. The serving path applies them to a few candidates, or to a
whole row when it must."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from schemas import Sampling

from .arith import F32, RowContext
from .vocab import Vocabulary

__all__ = ["Controls", "member", "member_of", "row_controls"]

NEG_INF = F32(-np.inf)


def member(ids: npt.NDArray[np.intp], token: int) -> bool:
    i = int(np.searchsorted(ids, token))
    return i < ids.shape[0] and int(ids[i]) == token


def member_of(ids: npt.NDArray[np.intp], values: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
    """values' membership in the sorted ids (binary search: a few values against thousands of ids)."""
    if ids.shape[0] == 0:
        return np.zeros(values.shape[0], np.bool_)
    at = np.minimum(np.searchsorted(ids, values), ids.shape[0] - 1)
    return np.asarray(ids[at] == values)


@dataclass(frozen=True, slots=True)
class Controls:
    """A row's section 1, sparse: patched ids (sorted) and their values, masked ids, allowed ids."""

    patch_ids: npt.NDArray[np.intp]
    patch_vals: npt.NDArray[np.float32]
    masked: tuple[npt.NDArray[np.intp], ...]  # each sorted and unique
    allowed: npt.NDArray[np.intp] | None  # sorted, unique

    def untouched(self, token: int) -> bool:
        """Whether section 1 leaves the token's raw logit as it is."""
        if member(self.patch_ids, token) or any(member(ids, token) for ids in self.masked):
            return False
        return self.allowed is None or member(self.allowed, token)

    def patched_values(self) -> npt.NDArray[np.float32]:
        """The patched ids' processed values, -inf where a mask or the allowed list removes them."""
        return self.masks_at(self.patch_ids, self.patch_vals.copy())

    def masks_at(self, ids: npt.NDArray[np.intp], vals: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """vals (ids' values, ours to write) with the masks and the allowed list applied."""
        for masked in self.masked:
            vals[member_of(masked, ids)] = NEG_INF
        if self.allowed is not None:
            vals[~member_of(self.allowed, ids)] = NEG_INF
        return vals

    def processed_at(self, ids: npt.NDArray[np.intp], row: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The processed logits of the sorted ids, which include every patched id."""
        vals = row[ids]
        vals[np.searchsorted(ids, self.patch_ids)] = self.patch_vals
        return self.masks_at(ids, vals)

    def dense(self, row: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The processed row, a new array (row: NaN-free)."""
        x = row.copy()
        x[self.patch_ids] = self.patch_vals
        return self.mask_row(x)

    def mask_row(self, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """A whole row (ours to write) with the masks and the allowed list applied."""
        for ids in self.masked:
            x[ids] = NEG_INF
        if self.allowed is not None:
            y = np.full_like(x, NEG_INF)
            y[self.allowed] = x[self.allowed]
            x = y
        return x


@functools.lru_cache(maxsize=4096)
def sorted_ids(values: tuple[int, ...], v: int) -> npt.NDArray[np.intp]:
    """Sorted unique ids below v (cached: the same session's lists come back every step)."""
    a = np.array(sorted({t for t in values if 0 <= t < v}), dtype=np.intp)
    a.flags.writeable = False
    return a


@functools.lru_cache(maxsize=4096)
def bias_arrays(logit_bias: tuple[tuple[int, float], ...], v: int,
                ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.float32]]:
    pairs = sorted((t, b) for t, b in logit_bias if t < v)
    return np.array([t for t, _ in pairs], dtype=np.intp), np.array([b for _, b in pairs], dtype=F32)


def row_controls(row: npt.NDArray[np.float32], s: Sampling, ctx: RowContext | None, vocab: Vocabulary) -> Controls:
    v = row.shape[0]
    pen_ids = np.zeros(0, np.intp)
    pen_vals = np.zeros(0, F32)
    if s.penalized:
        assert ctx is not None
        fed = ctx.window(s.penalty_last_n, s.penalize_prompt)
        window = np.sort(fed[(fed >= 0) & (fed < v)]).astype(np.intp)
        first = np.flatnonzero(np.r_[True, window[1:] != window[:-1]]) if window.size else np.zeros(0, np.intp)
        pen_ids = window[first]
        counts = np.diff(np.r_[first, window.shape[0]])
        pen_vals = row[pen_ids]  # a copy (fancy indexing)
        rep = F32(s.repetition_penalty)
        if rep != 1:
            pen_vals = np.where(pen_vals <= 0, pen_vals * rep, pen_vals / rep)
        pen_vals = pen_vals - (counts.astype(F32) * F32(s.frequency_penalty) + F32(s.presence_penalty))
    if s.logit_bias:
        b_ids, b_vals = bias_arrays(s.logit_bias, v)
        ids = np.union1d(pen_ids, b_ids)
        vals = row[ids]
        vals[np.searchsorted(ids, pen_ids)] = pen_vals
        at = np.searchsorted(ids, b_ids)
        vals[at] = vals[at] + b_vals
        pen_ids, pen_vals = ids, vals
    masked = [sorted_ids(s.banned_token_ids, v)] if s.banned_token_ids else []
    if not s.allow_special and vocab.special.size:
        masked.append(vocab.special_ids)
    if s.min_tokens > 0:
        assert ctx is not None
        if ctx.generated < s.min_tokens:
            masked += [vocab.eog_ids, sorted_ids(ctx.stop_tokens, v)]
    allowed = None if s.allowed_token_ids is None else sorted_ids(s.allowed_token_ids, v)
    return Controls(pen_ids, pen_vals.astype(F32, copy=False), tuple(masked), allowed)
