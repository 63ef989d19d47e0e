"""Text <-> tokens for a GGUF model.

`Tokenizer.from_gguf(path)` uses llama.cpp's own vocabulary (a `vocab_only` model load) when
llama_cpp is importable, else a pure-Python SentencePiece ("llama" tokenizer model) implementation
that reproduces llama.cpp's bigram-merge algorithm with byte fallback; it is exact for the tiny test
model (tests/test_tiny_model.py compares the two) and good for any SPM vocabulary without special
pre-tokenization.
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import os
from pathlib import Path
from typing import Any, Literal, Protocol

Backend = Literal["auto", "llama", "python"]
SPACE = "\u2581"
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_BYTE = 1, 2, 3, 4, 6


class _Backend(Protocol):
    bos_id: int
    eos_id: int
    vocab_size: int
    backend: str
    stop_tokens: tuple[int, ...]

    def encode(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]: ...

    def piece_bytes(self, token: int) -> bytes: ...

    def decode(self, tokens: list[int]) -> str: ...

    def piece(self, token: int) -> str: ...

    def control_tokens(self) -> dict[str, int]: ...

    def longest_token_bytes(self) -> int: ...


class Tokenizer:
    """`Tokenizer(path)`: encode/decode/piece for a GGUF, llama.cpp's vocabulary when available."""

    def __init__(self, path: str | os.PathLike[str], backend: Backend = "auto") -> None:
        impl: _Backend
        if backend == "python":
            impl = SpmTokenizer.from_gguf(path)
        else:
            try:
                impl = LlamaTokenizer(path)
            except ImportError:
                if backend == "llama":
                    raise
                impl = SpmTokenizer.from_gguf(path)
        self._impl = impl
        self.backend = impl.backend
        self.bos_id = impl.bos_id
        self.eos_id = impl.eos_id
        self.vocab_size = impl.vocab_size
        self.stop_tokens: tuple[int, ...] = impl.stop_tokens  # end-of-generation tokens (eos, eot)
        # A token's bytes never change: kept once asked (at most the vocabulary), so that streaming a token costs
        # a dictionary lookup, not a call into llama.cpp with a buffer made for it (dgr serve, per token)
        self._pieces: dict[int, bytes] = {}
        self._texts: dict[int, str | None] = {}
        self._control: dict[str, int] | None = None
        self._longest: int | None = None

    def encode(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """`special`: text naming a control token (`<start_of_turn>`) becomes that token, as a chat template's
        output needs (llama.cpp's backend only; the pure-Python one reads every text as text)."""
        return self._impl.encode(text, add_bos, special)

    def piece_bytes(self, token: int) -> bytes:
        """One token's bytes (a byte token: its one byte; control tokens: none): what an incremental
        detokenizer joins, so that a character split over tokens is never cut."""
        got = self._pieces.get(token)
        if got is None:
            got = self._pieces[token] = self._impl.piece_bytes(token)
        return got

    def piece_text(self, token: int) -> str | None:
        """One token's bytes as text when they are whole UTF-8 on their own (most tokens), else None (a piece of a
        character, stray bytes): what an incremental detokenizer with nothing pending sends as it is."""
        try:
            return self._texts[token]
        except KeyError:
            pass
        try:
            text: str | None = self.piece_bytes(token).decode("utf-8")
        except UnicodeDecodeError:
            text = None
        self._texts[token] = text
        return text

    def decode(self, tokens: list[int]) -> str:
        """As llama_detokenize(remove_special=True): a leading BOS is dropped, control tokens print nothing."""
        return self._impl.decode(tokens)

    def piece(self, token: int) -> str:
        """One token's text (a lone byte token of a multi-byte character decodes to U+FFFD)."""
        return self._impl.piece(token)

    @property
    def longest_token_bytes(self) -> int:
        """The most bytes of text one token stands for (its text in the vocabulary, UTF-8; a space written as `▁`
        counts 3): a text of more than n times this many bytes cannot be n tokens or fewer. Read once."""
        if self._longest is None:
            self._longest = self._impl.longest_token_bytes()
        return self._longest

    @property
    def control_tokens(self) -> dict[str, int]:
        """The text of each control token (`<start_of_turn>`, `<s>`) and its id: what `encode(special=True)` turns
        into that token (none with the pure-Python backend, which reads every text as text). Read once."""
        if self._control is None:
            self._control = self._impl.control_tokens()
        return self._control

    def grammar_compiles(self, gbnf: str) -> bool | None:
        """Whether llama.cpp's grammar sampler compiles `gbnf` on this vocabulary, as a worker will
        (consumer/sampling/grammar.py); None with the pure-Python backend (no llama.cpp to ask)."""
        if not isinstance(self._impl, LlamaTokenizer):
            return None
        return self._impl.grammar_compiles(gbnf)


def load_tokenizer(path: str | os.PathLike[str], backend: Backend = "auto") -> Tokenizer:
    """llama.cpp's vocabulary when available ("auto"), or the pure-Python SPM one ("python")."""
    return Tokenizer(path, backend)


class LlamaTokenizer:
    """llama.cpp's tokenizer (llama_tokenize / llama_detokenize) over a vocab-only model load."""

    backend = "llama.cpp"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from consumer.engines.llama import llama_cpp_module

        L = llama_cpp_module()
        self._L = L
        mp = L.llama_model_default_params()
        mp.vocab_only = True
        mp.use_extra_bufts = False
        self._model: Any = L.llama_model_load_from_file(str(Path(path)).encode(), mp)
        if not self._model:
            raise ValueError(f"llama.cpp could not load the vocabulary of {path}")
        self._vocab = L.llama_model_get_vocab(self._model)
        self.vocab_size = int(L.llama_vocab_n_tokens(self._vocab))
        self.bos_id = int(L.llama_vocab_bos(self._vocab))
        self.eos_id = int(L.llama_vocab_eos(self._vocab))
        eot = int(L.llama_vocab_eot(self._vocab))
        self.stop_tokens: tuple[int, ...] = tuple(sorted({t for t in (self.eos_id, eot) if t >= 0}))

    def longest_token_bytes(self) -> int:
        L = self._L
        return max((len(L.llama_vocab_get_text(self._vocab, i) or b"") for i in range(self.vocab_size)), default=1)

    def control_tokens(self) -> dict[str, int]:
        L, out = self._L, dict[str, int]()
        for i in range(self.vocab_size):
            if L.llama_vocab_get_attr(self._vocab, i) & L.LLAMA_TOKEN_ATTR_CONTROL:
                text = (L.llama_vocab_get_text(self._vocab, i) or b"").decode("utf-8", "replace")
                if text:
                    out.setdefault(text, i)
        return out

    def grammar_compiles(self, gbnf: str) -> bool:
        ptr = self._L.llama_sampler_init_grammar(self._vocab, gbnf.encode("utf-8"), b"root")
        if not ptr:
            return False
        self._L.llama_sampler_free(ptr)
        return True

    def encode(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        raw = text.encode("utf-8")
        n_max = len(raw) + 8
        buf = (ctypes.c_int32 * n_max)()
        n = self._L.llama_tokenize(self._vocab, raw, len(raw), buf, n_max, add_bos, special)
        if n < 0:  # buffer too small: -n is the size needed
            n_max = -n
            buf = (ctypes.c_int32 * n_max)()
            n = self._L.llama_tokenize(self._vocab, raw, len(raw), buf, n_max, add_bos, special)
        return list(buf[:n])

    def decode(self, tokens: list[int]) -> str:
        arr = (ctypes.c_int32 * max(1, len(tokens)))(*tokens)
        size = 16 * len(tokens) + 16
        out = ctypes.create_string_buffer(size)
        n = self._L.llama_detokenize(self._vocab, arr, len(tokens), out, size, True, False)
        if n < 0:
            size = -n
            out = ctypes.create_string_buffer(size)
            n = self._L.llama_detokenize(self._vocab, arr, len(tokens), out, size, True, False)
        return out.raw[:n].decode("utf-8", errors="replace")

    def piece_bytes(self, token: int) -> bytes:
        out = ctypes.create_string_buffer(64)
        n = self._L.llama_token_to_piece(self._vocab, token, out, 64, 0, False)
        if n < 0:
            out = ctypes.create_string_buffer(-n)
            n = self._L.llama_token_to_piece(self._vocab, token, out, -n, 0, False)
        return out.raw[:n]

    def piece(self, token: int) -> str:
        return self.piece_bytes(token).decode("utf-8", errors="replace")

    def close(self) -> None:
        if self._model:
            self._L.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class SpmTokenizer:
    """Pure-Python llama.cpp SPM tokenizer: bigram merges by score, byte fallback, '▁' for spaces."""

    backend = "python-spm"

    def __init__(self, tokens: list[str], scores: list[float], types: list[int], *, bos_id: int = 1,
                 eos_id: int = 2, add_bos: bool = True, add_space_prefix: bool = True) -> None:
        self._tokens = tokens
        self._scores = scores
        self._types = types
        self._ids = {t: i for i, t in enumerate(tokens)}
        self._byte_ids = [self._ids.get(f"<0x{b:02X}>", 0) for b in range(256)]
        self.vocab_size = len(tokens)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.stop_tokens: tuple[int, ...] = (eos_id,)
        self._add_bos, self._add_space_prefix = add_bos, add_space_prefix

    def control_tokens(self) -> dict[str, int]:
        return {}  # `encode` reads every text as text

    def longest_token_bytes(self) -> int:
        return max((len(t.encode("utf-8")) for t in self._tokens), default=1)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> SpmTokenizer:
        import gguf

        r = gguf.GGUFReader(str(path))

        def get(key: str, default: Any) -> Any:
            f = r.get_field(key)
            return default if f is None else f.contents()

        model = get("tokenizer.ggml.model", "")
        if model != "llama":
            raise ValueError(f"the pure-Python tokenizer handles tokenizer.ggml.model 'llama', not {model!r}")
        tokens = list(get("tokenizer.ggml.tokens", []))
        return cls(tokens, [float(s) for s in get("tokenizer.ggml.scores", [0.0] * len(tokens))],
                   [int(t) for t in get("tokenizer.ggml.token_type", [TT_NORMAL] * len(tokens))],
                   bos_id=int(get("tokenizer.ggml.bos_token_id", 1)),
                   eos_id=int(get("tokenizer.ggml.eos_token_id", 2)),
                   add_bos=bool(get("tokenizer.ggml.add_bos_token", True)),
                   add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", True)))

    def encode(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        out: list[int] = [self.bos_id] if (add_bos and self._add_bos) else []
        if not text:
            return out
        if self._add_space_prefix:
            text = " " + text
        text = text.replace(" ", SPACE)
        out.extend(self._spm(text))
        return out

    def _spm(self, text: str) -> list[int]:
        # Symbols are UTF-8 characters (kept as str; merged text looked up in the vocabulary).
        syms = list(text)
        n = len(syms)
        prev = [i - 1 for i in range(n)]
        nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
        alive = [True] * n
        # llama.cpp's queue pops the highest score, ties to the leftmost symbol.
        heap: list[tuple[float, int, int, int, str]] = []
        pieces = syms[:]

        def try_add(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            t = pieces[left] + pieces[right]
            tid = self._ids.get(t)
            if tid is None:
                return
            heapq.heappush(heap, (-self._scores[tid], left, right, len(t), t))

        for i in range(1, n):
            try_add(i - 1, i)
        while heap:
            _, left, right, size, t = heapq.heappop(heap)
            if not (alive[left] and alive[right]) or len(pieces[left]) + len(pieces[right]) != size \
                    or pieces[left] + pieces[right] != t:
                continue
            pieces[left] = t
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add(prev[left], left)
            try_add(left, nxt[left])
        out: list[int] = []
        i = 0
        while i != -1:
            self._resegment(pieces[i], out)
            i = nxt[i]
        return out

    def _resegment(self, text: str, out: list[int]) -> None:
        tid = self._ids.get(text)
        if tid is not None:
            out.append(tid)
            return
        out.extend(self._byte_ids[b] for b in text.encode("utf-8"))

    def piece_bytes(self, token: int, lstrip: bool = False) -> bytes:
        tt = self._types[token]
        if tt in (TT_NORMAL, TT_USER_DEFINED):
            b = self._tokens[token].replace(SPACE, " ").encode("utf-8")
        elif tt == TT_BYTE:
            b = bytes([int(self._tokens[token][3:5], 16)])
        else:  # control and unknown tokens print nothing (llama.cpp, special=False)
            b = b""
        if lstrip and b.startswith(b" "):
            b = b[1:]
        return b

    def piece(self, token: int) -> str:
        return self.piece_bytes(token).decode("utf-8", errors="replace")

    def decode(self, tokens: list[int]) -> str:
        # As llama_detokenize(remove_special=True): a leading BOS is dropped; the space prefix is
        # stripped from the first token only when there was no BOS.
        toks = list(tokens)
        strip = self._add_space_prefix
        if self._add_bos and toks and toks[0] == self.bos_id:
            toks = toks[1:]
            strip = False
        raw = b"".join(self.piece_bytes(t, lstrip=(i == 0 and strip)) for i, t in enumerate(toks))
        return raw.decode("utf-8", errors="replace")
