"""Grammar-constrained decoding through llama.cpp's own grammar sampler (docs/sampling.md, section 4).

No grammar engine of ours: a GBNF grammar (or a JSON schema, converted to GBNF by llama-cpp-python's
`json_schema_to_gbnf`, the converter llama-server uses) is compiled by `llama_sampler_init_grammar` on
the model's `llama_vocab`. The sampler asks it which candidate ids it admits (`llama_sampler_apply` on a
`llama_token_data_array`, reading which logits it set to -inf) and feeds it the session's tokens
(`llama_sampler_accept`). Both are ctypes calls: the GIL is released while llama.cpp works, so rows of
different sessions query their grammars in parallel threads.

A token is accepted only once the grammar admitted it: llama.cpp aborts the process on an inadmissible
end-of-generation token and throws (through C) on any other.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from schemas import Sampling

from .pieces import PRUNE_MIN
from .vocab import Vocabulary

__all__ = ["Grammar", "GrammarInvalid", "GrammarRefused", "GrammarView", "gbnf_of"]

# llama_token_data {int32 id; float logit; float p}: 12 bytes, no padding.
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class GrammarInvalid(ValueError):
    """The grammar (or the JSON schema) does not compile."""


class GrammarRefused(ValueError):
    """A token fed to the session is one its grammar does not admit."""


class GrammarView(Protocol):
    """What the row sampler asks of a session's grammar state (tests give simple stand-ins)."""

    def admitted(self, ids: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
        """For each id (distinct, any order), whether the grammar admits it as the next token."""
        ...


@functools.lru_cache(maxsize=256)
def _schema_gbnf(schema: str) -> str:
    from llama_cpp.llama_grammar import json_schema_to_gbnf  # deferred: loads llama.cpp

    try:
        return str(json_schema_to_gbnf(schema))
    except Exception as e:  # the converter raises anything from KeyError to RecursionError
        raise GrammarInvalid(f"json_schema: {type(e).__name__}: {e}"[:200]) from None


def gbnf_of(sampling: Sampling) -> str | None:
    """The GBNF text of a session's constraint (None: unconstrained). GrammarInvalid if the JSON schema
    does not convert."""
    if sampling.grammar is not None:
        return sampling.grammar
    if sampling.json_schema is not None:
        return _schema_gbnf(sampling.json_schema)
    return None


class Grammar:
    """One session's grammar state: llama.cpp's grammar sampler, after the tokens accepted so far."""

    def __init__(self, vocab: Vocabulary, gbnf: str) -> None:
        self._ptr: Any = None
        self._lock = threading.Lock()
        if vocab.llama_vocab is None:
            raise GrammarInvalid("this vocabulary has no llama.cpp vocab: grammars need one")
        from consumer.engines.llama import llama_cpp_module  # deferred: loads llama.cpp

        self._L = llama_cpp_module()
        self._vocab = vocab  # keeps the llama_vocab (and its owner) alive as long as the sampler
        ptr = self._L.llama_sampler_init_grammar(vocab.llama_vocab, gbnf.encode("utf-8"), b"root")
        if not ptr:
            raise GrammarInvalid("llama.cpp refused the grammar (see the dgr.llama log)")
        self._ptr = ptr
        self.accepted = 0  # tokens accepted since compiled
        vocab.piece_tree()  # starts building the vocabulary's piece tree, once, without waiting for it

    def admitted(self, ids: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
        if ids.shape[0] >= PRUNE_MIN:  # many ids (the whole vocabulary, at worst): along the piece tree
            tree = self._vocab.piece_tree()
            if tree is not None:
                return tree.admitted(ids, self.asked)
        return self.asked(ids)

    def asked(self, ids: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
        """llama.cpp's verdicts for ids, every one of them asked."""
        n = int(ids.shape[0])
        if n == 0:
            return np.zeros(0, dtype=np.bool_)
        data = np.zeros(n, dtype=TOKEN_DATA)
        data["id"] = ids
        arr = self._L.llama_token_data_array(data=data.ctypes.data_as(self._L.llama_token_data_p), size=n,
                                             selected=-1, sorted=False)
        self._L.llama_sampler_apply(self._live(), ctypes.byref(arr))
        return np.asarray(data["logit"] != -np.inf)

    def admits(self, token: int) -> bool:
        return bool(self.admitted(np.array([token], dtype=np.intp))[0])

    def accept(self, token: int) -> None:
        """Advance by one token; GrammarRefused (state unchanged) if the grammar does not admit it."""
        if not self.admits(token):
            raise GrammarRefused(f"the grammar does not admit token {token} here")
        self._L.llama_sampler_accept(self._live(), int(token))
        self.accepted += 1

    def _live(self) -> Any:
        if self._ptr is None:
            raise RuntimeError("grammar used after close()")
        return self._ptr

    def close(self) -> None:
        with self._lock:
            if self._ptr is not None:
                self._L.llama_sampler_free(self._ptr)
                self._ptr = None

    def __del__(self) -> None:
        self.close()
