"""What the sampler needs to know about a model's vocabulary: its size, which tokens are special (never
sampled unless a session allows them), which end generation, and llama.cpp's `llama_vocab` for grammars.

Read from llama.cpp (`llama_vocab_get_attr`, `llama_vocab_is_eog`), which reads the GGUF's
`tokenizer.ggml.token_type`: a token marked CONTROL or UNUSED that does not end generation is special
(docs/sampling.md, section 5). llama_cpp is imported only when a vocabulary is read from llama.cpp: the
sampler stage itself loads no engine (tests/test_layering.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .pieces import PieceTree

__all__ = ["Vocabulary"]

_TREE_LOCK = threading.Lock()

_EMPTY = np.zeros(0, dtype=np.int32)


class _VocabModel:
    """A GGUF loaded vocab-only (no weights): owns the llama_model the vocab pointer lives in."""

    def __init__(self, path: Path) -> None:
        from consumer.engines.llama import llama_cpp_module  # deferred: loads llama.cpp

        self._L = llama_cpp_module()
        params = self._L.llama_model_default_params()
        params.vocab_only = True
        self._lock = threading.Lock()
        self.model = self._L.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp could not read the vocabulary of {path}")
        self.vocab = self._L.llama_model_get_vocab(self.model)

    def close(self) -> None:
        with self._lock:
            if self.model:
                self._L.llama_model_free(self.model)
                self.model = None

    def __del__(self) -> None:
        self.close()


@dataclass(frozen=True, eq=False)
class Vocabulary:
    n_vocab: int
    special: npt.NDArray[np.int32] = field(default_factory=lambda: _EMPTY)  # sorted ids, masked by default
    eog: npt.NDArray[np.int32] = field(default_factory=lambda: _EMPTY)  # sorted end-of-generation ids
    llama_vocab: Any = None  # const llama_vocab*, for grammars; None: grammars unsupported
    owner: Any = None  # keeps whatever owns llama_vocab (a model, an engine) alive

    def __post_init__(self) -> None:
        if self.n_vocab < 1:
            raise ValueError(f"n_vocab must be >= 1, not {self.n_vocab}")
        for name in ("special", "eog"):
            ids = getattr(self, name)
            if ids.size and (ids.min() < 0 or ids.max() >= self.n_vocab or (np.diff(ids) <= 0).any()):
                raise ValueError(f"{name} must be sorted unique ids in [0, {self.n_vocab})")

    @functools.cached_property
    def special_ids(self) -> npt.NDArray[np.intp]:
        return self.special.astype(np.intp)

    @functools.cached_property
    def special_mask(self) -> npt.NDArray[np.bool_]:
        """Per token id, whether it is special: a lookup per row (np.isin against Gemma's 6,247 special ids
        took 0.8 ms per call of 8 rows, on the path between two engine calls)."""
        mask = np.zeros(self.n_vocab, np.bool_)
        mask[self.special] = True
        return mask

    @functools.cached_property
    def eog_ids(self) -> npt.NDArray[np.intp]:
        return self.eog.astype(np.intp)

    @property
    def grammars(self) -> bool:
        return self.llama_vocab is not None

    def piece_tree(self, wait: bool = False) -> PieceTree | None:
        """The pieces as a tree (consumer/sampling/pieces.py), for grammars; built once per vocabulary on
        a thread started by the first call (about a second for Gemma's 262,144 ids), None until it is
        there (unless `wait`) or where there are no grammars."""
        if self.llama_vocab is None:
            return None
        state: dict[str, Any] = self.__dict__.setdefault("_piece_tree", {})
        with _TREE_LOCK:
            if "thread" not in state:
                state["thread"] = threading.Thread(target=self._build_piece_tree, args=(state,),
                                                   name="dgr-piece-tree", daemon=True)
                state["thread"].start()
        if wait:
            state["thread"].join()
        return state.get("tree")

    def settle(self) -> None:
        """Wait for what runs on llama.cpp's vocab in the background (the piece tree's build): called
        before whatever owns the vocab frees it."""
        thread = self.__dict__.get("_piece_tree", {}).get("thread")
        if thread is not None:
            thread.join()

    def _build_piece_tree(self, state: dict[str, Any]) -> None:
        try:
            self._read_piece_tree(state)
        except Exception:  # grammars still work, asking llama.cpp about every id: say why they are slow
            logging.getLogger("dgr.sampler").exception("the vocabulary's piece tree could not be built")

    def _read_piece_tree(self, state: dict[str, Any]) -> None:
        from consumer.engines.llama import llama_cpp_module  # deferred: loads llama.cpp

        L = llama_cpp_module()
        buf = ctypes.create_string_buffer(256)
        eog = set(self.eog.tolist())
        pieces: list[bytes | None] = []
        for i in range(self.n_vocab):
            if i in eog:
                pieces.append(None)
                continue
            n = int(L.llama_token_to_piece(self.llama_vocab, i, buf, len(buf), 0, True))
            pieces.append(buf.raw[:n] if 0 <= n <= len(buf) else None)  # longer than 256 bytes: a root
        state["tree"] = PieceTree.from_pieces(pieces)

    @classmethod
    def plain(cls, n_vocab: int) -> Vocabulary:
        """A vocabulary known only by its size: nothing special, no end-of-generation token, no grammars
        (the reference and sleep engines)."""
        return cls(n_vocab=n_vocab)

    @classmethod
    def from_llama(cls, llama_vocab: Any, owner: Any = None) -> Vocabulary:
        """From a live `llama_vocab*` (an engine's: `LlamaCppEngine.llama_vocab()`); `owner` is kept
        referenced so the pointer outlives nothing it depends on."""
        from consumer.engines.llama import llama_cpp_module  # deferred: loads llama.cpp

        L = llama_cpp_module()
        n = int(L.llama_vocab_n_tokens(llama_vocab))
        attrs = np.fromiter((L.llama_vocab_get_attr(llama_vocab, i) for i in range(n)), dtype=np.int64, count=n)
        eog = np.fromiter((L.llama_vocab_is_eog(llama_vocab, i) for i in range(n)), dtype=np.bool_, count=n)
        marked = (attrs & (L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_UNUSED)) != 0
        return cls(n_vocab=n, special=np.flatnonzero(marked & ~eog).astype(np.int32),
                   eog=np.flatnonzero(eog).astype(np.int32), llama_vocab=llama_vocab, owner=owner)

    @classmethod
    def load(cls, path: Path | str) -> Vocabulary:
        """A GGUF's vocabulary, loaded vocab-only (no weights, a fraction of a second)."""
        model = _VocabModel(Path(path))
        return cls.from_llama(model.vocab, owner=model)

    @classmethod
    def for_engine(cls, engine: Any, n_vocab: int) -> Vocabulary:
        """The worker's vocabulary: from the engine's llama.cpp model when it has one, else plain."""
        get = getattr(engine, "llama_vocab", None)
        ptr = get() if callable(get) else None
        if ptr is None:
            return cls.plain(n_vocab)
        vocab = cls.from_llama(ptr, owner=engine)
        if vocab.n_vocab != n_vocab:
            raise ValueError(f"the engine's vocabulary has {vocab.n_vocab} tokens, its capacity says {n_vocab}")
        return vocab
