"""A tiny llama-architecture GGUF, generated from a seed: the test model of the whole project.

`write_tiny_model(path)` writes about 2 MB (Q8_0) of seeded random weights with the `gguf` package.
The bytes depend only on (seed, quant) and the numpy/gguf versions: the default file's sha256 is
pinned in tests/test_tiny_model.py.

Shape: vocab 512, n_embd 128, 2 layers, 4 query heads over 2 KV heads (GQA, head_dim 32), SwiGLU FFN
2048, context 4096, rope base 10000 (llama "normal" rope). The vocabulary is a SentencePiece-style
("llama") one: `<unk>`, `<s>`, `</s>`, the 256 byte tokens `<0x00>`..`<0xFF>`, then `▁`, the printable
ASCII characters and some common English pieces, so that llama.cpp's byte fallback works and any text
tokenizes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

TinyQuant = Literal["q8_0", "f32"]

SPACE = "\u2581"  # SentencePiece's "▁"

# Token types as in gguf.TokenType (kept literal so this module imports without gguf).
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_BYTE = 1, 2, 3, 6


@dataclass(frozen=True, slots=True)
class TinyConfig:
    n_vocab: int = 512
    n_embd: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 2048
    n_ctx_train: int = 4096
    rms_eps: float = 1e-5
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


TINY = TinyConfig()

# Pieces after the single characters, in priority order (earlier = higher SentencePiece score).
# Every prefix of length >= 2 of each piece is added first, so llama.cpp's bigram merging can reach it.
_WORD_TEXT = (
    "er in on an re th he ing ed es en at or is ion ly al ar ou st le nt ve ur it se ic "
    "▁the ▁of ▁and ▁to ▁a ▁in ▁is ▁it ▁that ▁was ▁for ▁on ▁with ▁as ▁he ▁be ▁at ▁by ▁this ▁from "
    "▁I ▁you ▁not ▁are ▁or ▁have ▁one ▁had ▁but ▁what ▁all ▁were ▁when ▁we ▁there ▁can ▁an ▁your "
    "▁which ▁their ▁said ▁if ▁do ▁will ▁each ▁about ▁how ▁up ▁out ▁them ▁then ▁she ▁many ▁some ▁so "
    "▁these ▁would ▁other ▁into ▁has ▁more ▁her ▁two ▁like ▁him ▁see ▁time ▁could ▁no ▁make ▁than "
    "▁first ▁been ▁its ▁who ▁now ▁people ▁my ▁made ▁over ▁did ▁down ▁only ▁way ▁find ▁use ▁may "
    "▁water ▁long ▁little ▁very ▁after ▁words ▁called ▁just ▁where ▁most ▁know ▁The ▁capital ▁France "
    "▁Paris ▁city ▁world ▁once ▁upon ▁story ▁day"
)
_WORDS = tuple(_WORD_TEXT.split(" "))


def tiny_vocab(n_vocab: int = TINY.n_vocab) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the tiny model's SentencePiece-style vocabulary."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TT_UNKNOWN, TT_CONTROL, TT_CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TT_BYTE] * 256
    pieces: list[str] = [SPACE] + [chr(c) for c in range(0x21, 0x7F)]
    seen = set(pieces)
    for word in _WORDS:
        for end in range(2, len(word) + 1):
            p = word[:end]
            if p not in seen:
                seen.add(p)
                pieces.append(p)
    room = n_vocab - len(tokens)
    if len(pieces) < room:
        raise ValueError(f"the piece list has {len(pieces)} pieces, {room} are needed")
    pieces = pieces[:room]
    tokens += pieces
    types += [TT_NORMAL] * len(pieces)
    # Control/byte tokens score 0; pieces: earlier = higher score (merged first). Single characters
    # score lowest among pieces, which does not matter: they are never produced by a merge.
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> npt.NDArray[np.float32]:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def tiny_weights(seed: int = 0, cfg: TinyConfig = TINY) -> dict[str, npt.NDArray[np.float32]]:
    """The float32 weights, numpy layout (rows = output features, as GGUFReader returns them)."""
    rng = np.random.default_rng(seed)
    d, hd = cfg.n_embd, cfg.head_dim
    w: dict[str, npt.NDArray[np.float32]] = {}
    w["token_embd.weight"] = _normal(rng, (cfg.n_vocab, d), 1.0)
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        w[b + "attn_norm.weight"] = (1.0 + _normal(rng, (d,), 0.1)).astype(np.float32)
        w[b + "attn_q.weight"] = _normal(rng, (cfg.n_head * hd, d), 1.0 / np.sqrt(d))
        w[b + "attn_k.weight"] = _normal(rng, (cfg.n_head_kv * hd, d), 1.0 / np.sqrt(d))
        w[b + "attn_v.weight"] = _normal(rng, (cfg.n_head_kv * hd, d), 1.0 / np.sqrt(d))
        w[b + "attn_output.weight"] = _normal(rng, (d, cfg.n_head * hd), 1.0 / np.sqrt(d))
        w[b + "ffn_norm.weight"] = (1.0 + _normal(rng, (d,), 0.1)).astype(np.float32)
        w[b + "ffn_gate.weight"] = _normal(rng, (cfg.n_ff, d), 1.0 / np.sqrt(d))
        w[b + "ffn_up.weight"] = _normal(rng, (cfg.n_ff, d), 1.0 / np.sqrt(d))
        w[b + "ffn_down.weight"] = _normal(rng, (d, cfg.n_ff), 1.0 / np.sqrt(cfg.n_ff))
    w["output_norm.weight"] = (1.0 + _normal(rng, (d,), 0.1)).astype(np.float32)
    # Logit scale ~3: peaked enough that greedy continuations depend on the context.
    w["output.weight"] = _normal(rng, (cfg.n_vocab, d), 3.0 / np.sqrt(d))
    return w


def write_tiny_model(path: Path, seed: int = 0, quant: TinyQuant = "q8_0", n_layer: int = TINY.n_layer) -> str:
    """Write the tiny GGUF to `path` (parents created) and return its sha256 hex digest.

    Byte-identical for equal (seed, quant, n_layer). `quant="q8_0"` stores the 2-D weights as Q8_0
    (gguf's NumPy quantizer, bit-exact with ggml's reference) and the norms as f32; `"f32"` stores all
    f32. `n_layer` > 2 makes a deeper model of the same shape (routes of three hops need >= 3 blocks).
    """
    if n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, not {n_layer}")
    cfg = TINY if n_layer == TINY.n_layer else replace(TINY, n_layer=n_layer)
    name = f"dgr-tiny-s{seed}-{quant}" + ("" if n_layer == TINY.n_layer else f"-l{n_layer}")
    writer, tmp = open_tiny_gguf(Path(path), "llama", name, cfg, quant)
    writer.add_feed_forward_length(cfg.n_ff)
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(cfg.n_head_kv)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    return close_tiny_gguf(writer, tmp, Path(path), cfg.n_vocab, quant, tiny_weights(seed, cfg))


def open_tiny_gguf(path: Path, arch: str, name: str, cfg: TinyConfig, quant: str) -> tuple[Any, Path]:
    """A `gguf.GGUFWriter` on `path`'s temporary name (parents created; `close_tiny_gguf` moves it into
    place), with the keys every tiny model starts with: name, context, embedding length, block count."""
    import gguf

    if quant not in ("q8_0", "f32"):
        raise ValueError(f"quant must be 'q8_0' or 'f32', not {quant!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_name(name)
    writer.add_context_length(cfg.n_ctx_train)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_block_count(cfg.n_layer)
    return writer, tmp


def add_tiny_tokenizer(writer: Any, n_vocab: int) -> None:
    """The tiny SentencePiece-style vocabulary and its special tokens, on a `gguf.GGUFWriter`: every
    tiny model (whatever its layout) tokenizes text the same way."""
    tokens, scores, types = tiny_vocab(n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)


def add_weight(writer: Any, name: str, arr: npt.NDArray[np.float32], quant: TinyQuant) -> None:
    """One tensor: Q8_0 (gguf's NumPy quantizer, bit-exact with ggml's reference) for a 2-D weight whose
    rows are a whole number of 32-value blocks when `quant="q8_0"`, f32 otherwise (norms, biases, and
    the recurrent kernels' own tensors, which llama.cpp's ssm ops read as f32)."""
    import gguf

    if quant == "q8_0" and arr.ndim == 2 and arr.shape[1] % 32 == 0:
        q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        writer.add_tensor(name, arr)


def close_tiny_gguf(writer: Any, tmp: Path, path: Path, n_vocab: int, quant: TinyQuant,
                    weights: dict[str, npt.NDArray[np.float32]]) -> str:
    """The keys every tiny model ends with (vocabulary size, file type, the tokenizer), then the weights;
    write the file out, move it to `path` (atomic) and return its sha256."""
    import gguf

    writer.add_vocab_size(n_vocab)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0 if quant == "q8_0" else gguf.LlamaFileType.ALL_F32))
    add_tiny_tokenizer(writer, n_vocab)
    for name, arr in weights.items():
        add_weight(writer, name, arr, quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return file_sha256(path)


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
