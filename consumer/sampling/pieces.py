"""A vocabulary's pieces as a tree, so that a grammar is asked about many ids without asking about each
(docs/sampling.md, section 4, "asking about the whole vocabulary").

llama.cpp's grammar sampler judges a token (not ending generation) by its piece alone: the bytes of
`token_to_piece(id, special=True)` up to the first NUL, decoded as UTF-8 after the grammar's pending
partial sequence. Its verdicts are closed under prefixes: if a piece T = P + R is admitted, where P and T
are both valid UTF-8 and P ends on a code point boundary, then P is admitted. From a state with no
partial sequence, T's code points are P's followed by R's, and the stack path that matches T matches P's
code points first; P is then exhausted on a stack that T continued from, which the sampler accepts. From
a state inside a partial sequence, T's first byte (valid UTF-8 starts with no continuation byte) aborts
the decode, and P starts with the same byte: both refused. So a token whose parent (the token whose
piece is the longest proper such prefix of its own) is refused is refused too, and is not asked.

Tokens outside the tree (roots asked directly, never a parent): those that end generation (judged by the
grammar's completion, not by their piece), pieces that are empty or not valid UTF-8 (byte tokens, which
only a partial sequence may continue). Two tokens with the same piece get the same verdict: the later one
hangs under the first.

Asking along the tree gives exactly the verdicts of asking about every id (tests/test_grammar_pieces.py,
against llama.cpp's own answers); at a position where a grammar admits a few characters (JSON's
structure), it asks about a few thousand of Gemma's 262,144 ids instead of all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["PRUNE_MIN", "PieceTree"]

# Fewer ids than this are asked directly: llama.cpp answers about 0.1 µs an id, and a walk costs ~1 ms of
# numpy whatever it asks (Gemma: 16,384 random ids asked 1.4 ms, walked 1.8 ms; all 262,144 asked 30 ms,
# walked 1.2-4 ms).
PRUNE_MIN = 65536

Ask = Callable[[npt.NDArray[np.intp]], npt.NDArray[np.bool_]]


@dataclass(frozen=True, eq=False)
class PieceTree:
    parent: npt.NDArray[np.int32]  # -1: a root (asked directly)
    depth: npt.NDArray[np.uint16]  # 0 for roots
    order: npt.NDArray[np.intp]  # every id, by depth (stable)
    level_starts: npt.NDArray[np.intp]  # order[level_starts[d]:level_starts[d + 1]] has depth d

    @classmethod
    def from_pieces(cls, pieces: Sequence[bytes | None]) -> PieceTree:
        """pieces[id]: the token's piece as the grammar reads it, None for a token outside the tree (one
        that ends generation)."""
        n = len(pieces)
        texts: list[str | None] = []
        first: dict[str, int] = {}
        for i, raw in enumerate(pieces):
            text = _text(raw)
            texts.append(text)
            if text is not None and text not in first:
                first[text] = i
        parent = np.full(n, -1, np.int32)
        for i, text in enumerate(texts):
            if text is None:
                continue
            owner = first[text]
            if owner != i:
                parent[i] = owner
                continue
            for k in range(len(text) - 1, 0, -1):
                j = first.get(text[:k])
                if j is not None:
                    parent[i] = j
                    break
        return cls.from_parents(parent)

    @classmethod
    def from_parents(cls, parent: npt.NDArray[np.int32]) -> PieceTree:
        n = parent.shape[0]
        depth = np.zeros(n, np.int32)
        has = parent >= 0
        for _ in range(n + 1):  # a chain is at most n long; parents are proper prefixes, so no cycle
            new = np.where(has, depth[np.maximum(parent, 0)] + 1, 0).astype(np.int32)
            if np.array_equal(new, depth):
                break
            depth = new
        else:
            raise ValueError("the parent links have a cycle")
        if depth.max(initial=0) > np.iinfo(np.uint16).max:
            raise ValueError("pieces nested deeper than 65,535 levels")
        order = np.argsort(depth, kind="stable").astype(np.intp)
        starts = np.searchsorted(depth[order], np.arange(int(depth.max(initial=0)) + 2)).astype(np.intp)
        return cls(parent=parent, depth=depth.astype(np.uint16), order=order, level_starts=starts)

    @property
    def size(self) -> int:
        return int(self.parent.shape[0])

    def admitted(self, ids: npt.NDArray[np.intp], ask: Ask) -> npt.NDArray[np.bool_]:
        """ask's verdicts for ids (distinct), asking it only about ids whose parent it admitted (and about
        the ancestors of ids, level by level from the roots)."""
        if 2 * ids.shape[0] >= self.size:  # most of the vocabulary: walking all of it costs less than closing
            wanted, bounds = self.order, self.level_starts
        else:
            need = np.zeros(self.size, np.bool_)
            need[ids] = True
            parts, frontier = [ids], ids
            while frontier.size:  # close ids under parents
                up = self.parent[frontier]
                up = up[up >= 0]
                up = np.unique(up[~need[up]])  # siblings share a parent
                need[up] = True
                frontier = up.astype(np.intp)
                parts.append(frontier)
            wanted = np.concatenate(parts)
            depth = self.depth[wanted]
            by_depth = np.argsort(depth, kind="stable")  # a radix sort: depths are 16-bit
            wanted = wanted[by_depth]
            bounds = np.searchsorted(depth[by_depth], np.arange(self.level_starts.shape[0]))
        ok = np.zeros(self.size, np.bool_)
        for d in range(bounds.shape[0] - 1):
            level = wanted[bounds[d]:bounds[d + 1]]
            if d > 0:
                level = level[ok[self.parent[level]]]
            if level.size == 0:  # a parent is one level up: nothing deeper can be admitted
                break
            ok[level] = ask(level)
        return ok[ids]


def _text(raw: bytes | None) -> str | None:
    """The piece as code points, None where it cannot join the tree (empty, not valid UTF-8)."""
    if raw is None:
        return None
    raw = raw.split(b"\0", 1)[0]  # the grammar reads the piece as a C string
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text or None
