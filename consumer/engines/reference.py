"""An exact, slow NumPy engine for llama-architecture GGUFs: the yardstick for batch invariance.

Every row of a fused batch is computed on its own (one matrix-vector product per weight, attention
over its own slot's cache), so a row's float operations are the same whatever else is in the batch,
and also whatever way a prompt is chunked: the engine is batch-invariant by construction.

The model is split into three parts that a multi-hop route runs separately:
`embed` (tokens -> hidden), `run_layers(first, last)` (hidden -> hidden, the KV of those layers
only) and `head` (hidden -> logits). An engine holds the block range [first_layer, last_layer) of its
boundary: the whole model by default, `layers=(a, b)` of a whole model, or the range a hop file
(dgrtools/split_model.py) names. `forward()` embeds the tokens when the range starts at block 0 (else
takes `batch.hidden`), runs the range, and returns logits when it ends at the last block (else the
hidden rows, one per batch row): the oracle of the llama.cpp hop engine.

Matches llama.cpp's llama graph: RMSNorm (sum of squares in float64), "normal" rope (adjacent pairs,
theta_i = pos * base^(-2i/n_rot) built by repeated float32 multiplication), GQA (query head h reads
KV head h // (n_head / n_head_kv)), softmax(q.k / sqrt(head_dim)), SwiGLU FFN.
Options that bring it closer to llama.cpp's arithmetic: `kv_dtype="f16"` (llama.cpp's default KV
type) and `emulate_q8_activations=True` (llama.cpp quantizes a matmul's activations to Q8_0 blocks
when the weights are Q8_0).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from schemas import BoundarySchema, EngineIdentity, Recipe, StateLayout
from schemas.compat import hop_boundary

from ..batch import EngineOutput, FusedBatch
from .base import EngineCapacity, EngineError, LogitsEngine, check_hidden
from .loader import ftype_name, gguf_sha256, read_split_info

F32 = npt.NDArray[np.float32]
RUNTIME = "numpy-reference/1"


@dataclass(frozen=True, slots=True)
class LlamaHParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_ff: int
    rms_eps: float
    rope_base: float
    n_ctx_train: int


@dataclass(frozen=True, slots=True)
class _Layer:
    attn_norm: F32
    wq: F32  # (n_head*head_dim, n_embd)
    wk: F32
    wv: F32
    wo: F32
    ffn_norm: F32
    w_gate: F32
    w_up: F32
    w_down: F32
    q8: bool  # weights were Q8_0 in the file (for activation emulation)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.get_field(key)
    if f is None:
        if default is None:
            raise ValueError(f"GGUF is missing {key}")
        return default
    v = f.contents()
    return v


class NumpyReferenceEngine(LogitsEngine):
    """The Engine protocol in NumPy, for arch "llama" GGUFs (any quantization gguf can dequantize)."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        n_slots: int = 8,
        ctx_per_session: int = 1024,
        max_tokens_per_call: int = 2048,
        kv_dtype: Literal["f32", "f16"] = "f32",
        emulate_q8_activations: bool = False,
        layers: tuple[int, int] | None = None,
    ) -> None:
        import gguf

        if n_slots < 1 or ctx_per_session < 1 or max_tokens_per_call < 1:
            raise ValueError("n_slots, ctx_per_session and max_tokens_per_call must be >= 1")
        self.model_path = Path(model_path)
        reader = gguf.GGUFReader(str(self.model_path))
        arch = str(_field(reader, "general.architecture"))
        if arch != "llama":
            raise ValueError(f"NumpyReferenceEngine runs arch 'llama' only, {self.model_path} is {arch!r}")
        tensors = {t.name: t for t in reader.tensors}
        split = read_split_info(self.model_path)
        n_file_layers = int(_field(reader, f"{arch}.block_count"))
        if split is not None:  # a hop file: its blocks 0.. are the source's first_block..
            if layers is not None:
                raise ValueError(f"{self.model_path} is a hop file of blocks [{split.first_block}, "
                                 f"{split.last_block}): layers= applies to a whole model only")
            first, last, n_source = split.first_block, split.last_block, split.source_block_count
            offset = first
        else:
            first, last = layers if layers is not None else (0, n_file_layers)
            n_source, offset = n_file_layers, 0
            if not 0 <= first < last <= n_source:
                raise ValueError(f"layers [{first}, {last}) not inside [0, {n_source})")
        self._first, self._last, self._offset = first, last, offset

        def mat(name: str) -> tuple[F32, bool]:
            t = tensors[name]
            qt = gguf.GGMLQuantizationType(int(t.tensor_type))
            arr = np.array(gguf.quants.dequantize(np.asarray(t.data), qt), dtype=np.float32, order="C", copy=True)
            return arr, qt == gguf.GGMLQuantizationType.Q8_0

        n_embd = int(_field(reader, f"{arch}.embedding_length"))
        n_head = int(_field(reader, f"{arch}.attention.head_count"))
        tok_embd, _ = mat("token_embd.weight")
        self.hp = LlamaHParams(
            n_vocab=int(tok_embd.shape[0]),
            n_embd=n_embd,
            n_layer=last - first,  # blocks this engine holds
            n_head=n_head,
            n_head_kv=int(_field(reader, f"{arch}.attention.head_count_kv", n_head)),
            head_dim=n_embd // n_head,
            n_rot=int(_field(reader, f"{arch}.rope.dimension_count", n_embd // n_head)),
            n_ff=int(_field(reader, f"{arch}.feed_forward_length")),
            rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
            rope_base=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            n_ctx_train=int(_field(reader, f"{arch}.context_length")),
        )
        hp = self.hp
        if hp.n_head % hp.n_head_kv:
            raise ValueError("n_head must be a multiple of n_head_kv")
        ftype_field = reader.get_field("general.file_type")
        quant = ftype_name(int(ftype_field.contents())) if ftype_field is not None else "UNKNOWN"

        self._tok_embd = tok_embd
        self._layers: list[_Layer] = []
        for i in range(first, last):
            b = f"blk.{i - offset}."
            wq, q8 = mat(b + "attn_q.weight")
            self._layers.append(_Layer(
                attn_norm=mat(b + "attn_norm.weight")[0], wq=wq, wk=mat(b + "attn_k.weight")[0],
                wv=mat(b + "attn_v.weight")[0], wo=mat(b + "attn_output.weight")[0],
                ffn_norm=mat(b + "ffn_norm.weight")[0], w_gate=mat(b + "ffn_gate.weight")[0],
                w_up=mat(b + "ffn_up.weight")[0], w_down=mat(b + "ffn_down.weight")[0], q8=q8,
            ))
        self._out_norm = mat("output_norm.weight")[0]
        self._out, self._out_q8 = mat("output.weight") if "output.weight" in tensors else mat("token_embd.weight")

        self._emulate_q8 = emulate_q8_activations
        self._kv_dtype = np.float16 if kv_dtype == "f16" else np.float32
        self._kv_dtype_name = kv_dtype
        self._n_slots = n_slots
        self._ctx = ctx_per_session
        kv_shape = (n_slots, hp.n_layer, ctx_per_session, hp.n_head_kv, hp.head_dim)
        self._k = np.zeros(kv_shape, dtype=self._kv_dtype)
        self._v = np.zeros(kv_shape, dtype=self._kv_dtype)
        self._n_past = np.zeros(n_slots, dtype=np.int64)  # next position of each slot
        self._cos, self._sin = self._rope_tables(ctx_per_session)

        # A hop names its SOURCE model (the range is in the boundary): hop files cut from one model at one
        # range, and this engine on the whole model with layers=(a, b), share one identity.
        source_sha = split.source_sha256 if split is not None else gguf_sha256(self.model_path)
        self.identity = EngineIdentity(architecture=arch, gguf_sha256=source_sha)
        self.recipe = Recipe(quantization=quant, kv_cache_type=kv_dtype, ctx_per_session=ctx_per_session,
                             flash_attention=False, batch_invariant=True, runtime=RUNTIME)
        self.boundary: BoundarySchema = hop_boundary(first, last, n_source, n_embd)
        self.state_layout = StateLayout(kind="kv", dims={
            "n_layer": hp.n_layer, "n_head_kv": hp.n_head_kv, "head_dim": hp.head_dim,
            "n_embd_k_gqa": hp.n_head_kv * hp.head_dim, "n_ctx_per_seq": ctx_per_session,
        })
        self.capacity = EngineCapacity(n_slots=n_slots, ctx_per_session=ctx_per_session,
                                       max_tokens_per_call=max_tokens_per_call, vocab_size=hp.n_vocab)

    # ----------------------------------------------------------------------------------- protocol
    @property
    def batch_invariant(self) -> bool:
        return True

    def forward(self, batch: FusedBatch) -> EngineOutput:
        n = len(batch)
        slots = np.asarray(batch.slots, dtype=np.int64)
        positions = np.asarray(batch.positions, dtype=np.int64)
        tokens = np.asarray(batch.tokens, dtype=np.int64)
        wants = np.asarray(batch.wants_logits, dtype=np.bool_)
        hidden_in = check_hidden(batch, self.boundary)
        self._validate(n, slots, positions, tokens)
        saved = self._n_past.copy()
        emits_hidden = self.boundary.produces == "hidden"
        if emits_hidden:
            out = np.empty((n, self.hp.n_embd), dtype=np.float32)
        else:
            out = np.empty((int(wants.sum()), self.hp.n_vocab), dtype=np.float32)
        try:
            j = 0
            for i in range(n):
                s, p = int(slots[i]), int(positions[i])
                h = hidden_in[i] if hidden_in is not None else self.embed(int(tokens[i]))
                h = self.run_layers(s, p, h, self._first, self._last)
                self._n_past[s] = p + 1
                if emits_hidden:
                    out[i] = h
                elif wants[i]:
                    out[j] = self.head(h)
                    j += 1
        except Exception as e:  # roll every slot of this call back (cache rows past n_past are ignored)
            self._n_past[:] = saved
            raise EngineError(f"reference forward failed: {e!r}", tuple(sorted({int(s) for s in slots}))) from e
        return EngineOutput.hidden(out) if emits_hidden else EngineOutput.logits(out)

    def step(self, batch: FusedBatch) -> F32:
        """forward()'s rows: logits for a whole model or a last hop, hidden rows for an earlier hop."""
        return self.forward(batch).rows

    def release(self, slot: int) -> None:
        if not 0 <= slot < self._n_slots:
            raise EngineError(f"slot {slot} out of range [0, {self._n_slots})", (slot,))
        self._n_past[slot] = 0
        self._k[slot] = 0
        self._v[slot] = 0

    def next_position(self, slot: int) -> int:
        return int(self._n_past[slot])

    # ---- prefix cache (consumer/prefix/): the same contract as LlamaCppEngine's -------------------
    def prefix_unsupported(self) -> str | None:
        return None if self.boundary.consumes == "tokens" else "hidden_input"

    def prefix_floor(self, slot: int) -> int:
        return 0

    def save_prefix(self, slot: int) -> bytes:
        n = int(self._n_past[slot])
        return n.to_bytes(8, "little") + self._k[slot, :, :n].tobytes() + self._v[slot, :, :n].tobytes()

    def keep_prefix(self, slot: int, n_tokens: int) -> None:
        if not 0 <= n_tokens <= self._n_past[slot]:
            raise EngineError(f"slot {slot}: cannot keep {n_tokens} of {int(self._n_past[slot])} positions", (slot,))
        self._n_past[slot] = n_tokens  # cache rows past n_past are ignored

    def restore_prefix(self, slot: int, data: bytes, n_tokens: int) -> None:
        n = int.from_bytes(data[:8], "little")
        if not 0 < n_tokens <= n:
            raise EngineError(f"slot {slot}: a saved state of {n} positions has no prefix of {n_tokens}", (slot,))
        self.release(slot)
        shape = (self._k.shape[1], n, *self._k.shape[3:])
        half = (len(data) - 8) // 2
        k = np.frombuffer(data, dtype=self._kv_dtype, count=half // self._k.itemsize, offset=8).reshape(shape)
        v = np.frombuffer(data, dtype=self._kv_dtype, offset=8 + half).reshape(shape)
        self._k[slot, :, :n_tokens] = k[:, :n_tokens]
        self._v[slot, :, :n_tokens] = v[:, :n_tokens]
        self._n_past[slot] = n_tokens

    def describe(self) -> dict[str, str]:
        hp = self.hp
        return {
            "backend": RUNTIME,
            "cpu_path": "numpy (one matrix-vector product per row; BLAS: numpy's)",
            "model": str(self.model_path),
            "architecture": self.identity.architecture,
            "gguf_sha256": self.identity.gguf_sha256,
            "quantization": self.recipe.quantization,
            "blocks": f"[{self._first}, {self._last}) ({self.boundary.consumes} -> {self.boundary.produces})",
            "dims": f"vocab {hp.n_vocab}, n_embd {hp.n_embd}, layers {hp.n_layer}, heads {hp.n_head}/"
                    f"{hp.n_head_kv} kv, head_dim {hp.head_dim}, ffn {hp.n_ff}",
            "kv_cache_type": self._kv_dtype_name,
            "emulate_q8_activations": str(self._emulate_q8),
            "n_slots": str(self._n_slots),
            "ctx_per_session": str(self._ctx),
            "max_tokens_per_call": str(self.capacity.max_tokens_per_call),
            "batch_invariant": "true (by construction: rows are computed independently)",
        }

    def close(self) -> None:
        self._n_past[:] = 0

    # ------------------------------------------------------------------------------- model parts
    def embed(self, token: int) -> F32:
        return self._tok_embd[token].copy()

    def run_layers(self, slot: int, pos: int, h: F32, first: int, last: int) -> F32:
        """Layers [first, last) (absolute block indices, inside the engine's range) for one row; writes
        that row's K/V of those layers into the slot."""
        if not self._first <= first <= last <= self._last:
            raise ValueError(f"layers [{first}, {last}) outside this engine's [{self._first}, {self._last})")
        hp = self.hp
        r = hp.n_head // hp.n_head_kv
        scale = np.float32(1.0 / np.sqrt(hp.head_dim))
        x = h.astype(np.float32, copy=True)
        for li in range(first - self._first, last - self._first):
            L = self._layers[li]
            a = self._act(self._rms(x, L.attn_norm), L.q8)
            q = (L.wq @ a).reshape(hp.n_head, hp.head_dim)
            k = (L.wk @ a).reshape(hp.n_head_kv, hp.head_dim)
            v = (L.wv @ a).reshape(hp.n_head_kv, hp.head_dim)
            q = self._rope(q, pos)
            k = self._rope(k, pos)
            self._k[slot, li, pos] = k
            self._v[slot, li, pos] = v
            keys = self._k[slot, li, : pos + 1].astype(np.float32)  # (T, n_kv, hd)
            vals = self._v[slot, li, : pos + 1].astype(np.float32)
            if self._kv_dtype is np.float16:
                q = q.astype(np.float16).astype(np.float32)
            att = np.empty((hp.n_head, hp.head_dim), dtype=np.float32)
            for g in range(hp.n_head_kv):
                qg = q[g * r:(g + 1) * r]  # (r, hd)
                scores = (qg @ keys[:, g, :].T) * scale  # (r, T)
                scores = scores - scores.max(axis=1, keepdims=True)
                w = np.exp(scores)
                w /= w.sum(axis=1, keepdims=True, dtype=np.float32)
                att[g * r:(g + 1) * r] = w @ vals[:, g, :]
            x = x + L.wo @ self._act(att.reshape(-1), L.q8)
            f = self._act(self._rms(x, L.ffn_norm), L.q8)
            g_ = L.w_gate @ f
            u = L.w_up @ f
            silu = g_ / (np.float32(1.0) + np.exp(-g_))
            x = x + L.w_down @ self._act((silu * u).astype(np.float32), L.q8)
        return x.astype(np.float32, copy=False)

    def head(self, h: F32) -> F32:
        return (self._out @ self._act(self._rms(h, self._out_norm), self._out_q8)).astype(np.float32)

    # ----------------------------------------------------------------------------------- helpers
    def _validate(self, n: int, slots: npt.NDArray[np.int64], positions: npt.NDArray[np.int64],
                  tokens: npt.NDArray[np.int64]) -> None:
        if n == 0:
            raise EngineError("empty batch")
        if n > self.capacity.max_tokens_per_call:
            raise EngineError(f"batch of {n} rows exceeds max_tokens_per_call {self.capacity.max_tokens_per_call}")
        bad = sorted({int(s) for s in slots if not 0 <= s < self._n_slots})
        if bad:
            raise EngineError(f"slots {bad} out of range [0, {self._n_slots})", tuple(bad))
        bad_tok = [] if self.boundary.consumes == "hidden" else \
            sorted({int(s) for s, t in zip(slots, tokens, strict=True) if not 0 <= t < self.hp.n_vocab})
        if bad_tok:
            raise EngineError(f"token out of vocabulary [0, {self.hp.n_vocab}) in slots {bad_tok}", tuple(bad_tok))
        nxt: dict[int, int] = {}
        for s_, p_ in zip(slots, positions, strict=True):
            s, p = int(s_), int(p_)
            want = nxt.get(s, int(self._n_past[s]))
            if p != want:
                raise EngineError(f"slot {s}: position {p} given, next position is {want}", (s,))
            if p >= self._ctx:
                raise EngineError(f"slot {s}: position {p} beyond ctx_per_session {self._ctx}", (s,))
            nxt[s] = p + 1

    def _rms(self, x: F32, w: F32) -> F32:
        ss = np.dot(x.astype(np.float64), x.astype(np.float64)) / x.shape[0]
        scale = np.float32(1.0 / np.sqrt(np.float32(ss) + np.float32(self.hp.rms_eps)))
        return (x * scale) * w

    def _act(self, x: F32, q8: bool) -> F32:
        """Activations as a Q8_0 matmul sees them (quantized to 8-bit blocks of 32) when emulating."""
        if not (self._emulate_q8 and q8) or x.shape[0] % 32:
            return x
        blocks = x.reshape(-1, 32)
        d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127.0)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0.0), np.float32(1.0) / d).astype(np.float32)
        qs = np.clip(np.floor(np.abs(blocks * inv) + np.float32(0.5)) * np.sign(blocks), -127, 127)
        return (qs * d.astype(np.float16).astype(np.float32)).reshape(-1).astype(np.float32)

    def _rope_tables(self, n_pos: int) -> tuple[F32, F32]:
        half = self.hp.n_rot // 2
        theta_scale = np.float32(self.hp.rope_base ** (-2.0 / self.hp.n_rot))
        theta = np.empty((n_pos, half), dtype=np.float32)
        theta[:, 0] = np.arange(n_pos, dtype=np.float32)
        for i in range(1, half):
            theta[:, i] = theta[:, i - 1] * theta_scale
        return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)

    def _rope(self, x: F32, pos: int) -> F32:
        """llama.cpp rope mode 0 ("normal"): rotate adjacent pairs (x[2i], x[2i+1])."""
        n_rot = self.hp.n_rot
        c, s = self._cos[pos], self._sin[pos]
        out = x.copy()
        x0 = x[:, 0:n_rot:2]
        x1 = x[:, 1:n_rot:2]
        out[:, 0:n_rot:2] = x0 * c - x1 * s
        out[:, 1:n_rot:2] = x0 * s + x1 * c
        return out
