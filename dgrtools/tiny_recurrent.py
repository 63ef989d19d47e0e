"""Tiny recurrent and hybrid GGUFs, generated from a seed: the test models of the two other state layouts.

- "recurrent": a Mamba (llama.cpp arch `mamba`, Mamba-1 selective scan): vocab 512 (the tiny llama's
  tokenizer), n_embd 128, 2 blocks, d_inner 256, d_state 16, d_conv 4, dt_rank 8. A session's state is
  one fixed-size cell per block (conv state (d_conv - 1) x d_inner and ssm state d_state x d_inner, f32),
  whatever its length: nothing grows by position, and nothing can be removed by position.
- "hybrid": a Jamba (arch `jamba`): the same Mamba blocks interleaved with attention blocks (4 query
  heads over 2 KV heads, no RoPE, as Jamba), every block followed by a SwiGLU FFN (512). 4 blocks:
  Mamba, attention, Mamba, attention (`HYBRID_ATTENTION_BLOCKS`). Its state is a recurrent cell per
  Mamba block plus a KV cache per attention block.

`quant="q8_0"` (the default) stores every 2-D weight whose rows are whole 32-value blocks as Q8_0 (the
projections in and out of the scan, the attention and FFN weights, the embeddings and the head) and the
rest f32: the conv kernel, A, D, the norms and biases (llama.cpp's ssm ops read them as f32), and
`ssm_dt` (rows of dt_rank = 8 values). Why Q8_0: docs/state-layouts.md ("Batch invariance"): an f32
matmul takes ggml's one-row kernel for a call of one row and llamafile's tinyBLAS for two or more, which
round differently; Q8_0 sums integer products, identical either way.

Bytes depend only on (layout, seed, quant) and the numpy/gguf versions; the sha256 of each default file
is pinned in tests/test_tiny_layouts.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from .tiny_model import TinyConfig, TinyQuant, close_tiny_gguf, open_tiny_gguf, write_tiny_model

Layout = Literal["kv", "recurrent", "hybrid"]
LAYOUTS: tuple[Layout, ...] = ("kv", "recurrent", "hybrid")


@dataclass(frozen=True, slots=True)
class TinySsmConfig(TinyConfig):
    """The tiny llama's shape (vocabulary, n_embd, the attention of a hybrid's attention blocks) plus the
    Mamba block's. The FFN (n_ff) exists only in a hybrid's blocks."""

    d_inner: int = 256  # llama.cpp supports an expansion factor of 2 only
    d_state: int = 16
    d_conv: int = 4
    dt_rank: int = 8
    attention_blocks: tuple[int, ...] = ()  # hybrid only: the blocks that are attention, not Mamba


TINY_MAMBA = TinySsmConfig(n_ff=512)
HYBRID_ATTENTION_BLOCKS = (1, 3)
TINY_JAMBA = TinySsmConfig(n_layer=4, n_ff=512, attention_blocks=HYBRID_ATTENTION_BLOCKS)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> npt.NDArray[np.float32]:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def _norm(rng: np.random.Generator, n: int) -> npt.NDArray[np.float32]:
    return (1.0 + _normal(rng, (n,), 0.1)).astype(np.float32)


def ssm_weights(seed: int = 0, cfg: TinySsmConfig = TINY_MAMBA) -> dict[str, npt.NDArray[np.float32]]:
    """The float32 weights, numpy layout (rows = output features, as GGUFReader returns them).

    A Mamba block: in-projection to x and the gate z (2 d_inner), a causal depthwise conv of d_conv taps,
    x -> (dt, B, C), dt through dt_rank, A = -exp(.) (a decaying state), D, out-projection. In a hybrid
    model, Mamba blocks also carry Jamba's RMS norms on dt, B and C, and every block an FFN."""
    rng = np.random.default_rng(seed)
    d, di, ds, r = cfg.n_embd, cfg.d_inner, cfg.d_state, cfg.dt_rank
    hybrid = bool(cfg.attention_blocks)
    w: dict[str, npt.NDArray[np.float32]] = {"token_embd.weight": _normal(rng, (cfg.n_vocab, d), 1.0)}
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        w[b + "attn_norm.weight"] = _norm(rng, d)
        if i in cfg.attention_blocks:
            hd = cfg.head_dim
            w[b + "attn_q.weight"] = _normal(rng, (cfg.n_head * hd, d), 1.0 / np.sqrt(d))
            w[b + "attn_k.weight"] = _normal(rng, (cfg.n_head_kv * hd, d), 1.0 / np.sqrt(d))
            w[b + "attn_v.weight"] = _normal(rng, (cfg.n_head_kv * hd, d), 1.0 / np.sqrt(d))
            w[b + "attn_output.weight"] = _normal(rng, (d, cfg.n_head * hd), 1.0 / np.sqrt(d))
        else:
            w[b + "ssm_in.weight"] = _normal(rng, (2 * di, d), 1.0 / np.sqrt(d))
            w[b + "ssm_conv1d.weight"] = _normal(rng, (di, cfg.d_conv), 0.5)
            w[b + "ssm_conv1d.bias"] = _normal(rng, (di,), 0.1)
            w[b + "ssm_x.weight"] = _normal(rng, (r + 2 * ds, di), 1.0 / np.sqrt(di))
            if hybrid:
                w[b + "ssm_dt_norm.weight"] = _norm(rng, r)
                w[b + "ssm_b_norm.weight"] = _norm(rng, ds)
                w[b + "ssm_c_norm.weight"] = _norm(rng, ds)
            w[b + "ssm_dt.weight"] = _normal(rng, (di, r), 1.0 / np.sqrt(r))
            w[b + "ssm_dt.bias"] = _normal(rng, (di,), 0.5) - np.float32(2.0)  # softplus -> dt ~ 0.1
            # A: per channel, state decay rates 1..d_state (Mamba's S4D-real init), jittered
            a = np.tile(np.arange(1, ds + 1, dtype=np.float32), (di, 1))
            w[b + "ssm_a"] = (-(a * np.exp(_normal(rng, (di, ds), 0.2)))).astype(np.float32)
            w[b + "ssm_d"] = _norm(rng, di)
            w[b + "ssm_out.weight"] = _normal(rng, (d, di), 1.0 / np.sqrt(di))
        if hybrid:
            w[b + "ffn_norm.weight"] = _norm(rng, d)
            w[b + "ffn_gate.weight"] = _normal(rng, (cfg.n_ff, d), 1.0 / np.sqrt(d))
            w[b + "ffn_up.weight"] = _normal(rng, (cfg.n_ff, d), 1.0 / np.sqrt(d))
            w[b + "ffn_down.weight"] = _normal(rng, (d, cfg.n_ff), 1.0 / np.sqrt(cfg.n_ff))
    w["output_norm.weight"] = _norm(rng, d)
    # Logit scale ~3, as the tiny llama: peaked enough that greedy continuations depend on the context.
    w["output.weight"] = _normal(rng, (cfg.n_vocab, d), 3.0 / np.sqrt(d))
    return w


def write_tiny_ssm_model(path: Path, layout: Literal["recurrent", "hybrid"] = "recurrent", seed: int = 0,
                         quant: TinyQuant = "q8_0") -> str:
    """Write the tiny Mamba ("recurrent") or Jamba ("hybrid") GGUF to `path`; return its sha256."""
    if layout not in ("recurrent", "hybrid"):
        raise ValueError(f"layout must be 'recurrent' or 'hybrid', not {layout!r}")
    cfg = TINY_MAMBA if layout == "recurrent" else TINY_JAMBA
    arch = "mamba" if layout == "recurrent" else "jamba"
    writer, tmp = open_tiny_gguf(Path(path), arch, f"dgr-tiny-{arch}-s{seed}-{quant}", cfg, quant)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_ssm_conv_kernel(cfg.d_conv)
    writer.add_ssm_inner_size(cfg.d_inner)
    writer.add_ssm_state_size(cfg.d_state)
    writer.add_ssm_time_step_rank(cfg.dt_rank)
    if layout == "recurrent":
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
    else:
        writer.add_feed_forward_length(cfg.n_ff)
        writer.add_head_count(cfg.n_head)
        # Jamba marks a block recurrent by its KV head count: 0 for a Mamba block.
        writer.add_head_count_kv([cfg.n_head_kv if i in cfg.attention_blocks else 0 for i in range(cfg.n_layer)])
    return close_tiny_gguf(writer, tmp, Path(path), cfg.n_vocab, quant, ssm_weights(seed, cfg))


def write_tiny(path: Path, layout: Layout = "kv", seed: int = 0, quant: TinyQuant = "q8_0") -> str:
    """The tiny model of a state layout: "kv" (the tiny llama), "recurrent" (Mamba) or "hybrid" (Jamba)."""
    if layout == "kv":
        return write_tiny_model(path, seed=seed, quant=quant)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    return write_tiny_ssm_model(path, layout, seed=seed, quant=quant)
