"""llama.cpp engine (llama-cpp-python==0.3.36, low-level API): one `llama_decode` per fused batch.

One context holds `n_slots` sequences (`n_seq_max = n_slots`, `kv_unified = False`: each slot has its
own KV stream of `ctx_per_session` cells, rounded up by llama.cpp to a multiple of 256). Slot i is
seq_id i. One `llama_batch`, allocated once from NumPy arrays, is refilled per step through NumPy
views; `step()` makes exactly one `llama_decode` call whatever the number of sessions.

Recipes (why each setting: docs/invariance.md):
- "invariant" (default): a session's logits are bit-identical alone or in any batch, however its prompt
  was cut. `kv_unified=False`, `use_extra_bufts=False` (no repacked/AMX weight buffers), flash
  attention off (CPU flash attention sums in an order that depends on the query rows of the call and on
  the KV length the whole micro-batch attends over), and the environment variable `GGML_CPU_TILED_MM=0`
  (llama.cpp's tiled K-quant matmul picks another kernel when a micro-batch has >= 8 rows). ggml reads
  that variable ONCE per process, at the first K-quant matmul: the engine sets it if unset and no decode
  has run yet in this process; a worker that mixes recipes in one process should export
  `GGML_CPU_TILED_MM=0` before starting. Prefill rows keep their session's piece whole: llama.cpp
  computes a row with another kernel when its session has one row in a micro-batch than with two or
  more, and with a per-sequence KV it cuts a call's rows into micro-batches of equal rows per sequence,
  so a call carrying unequal pieces is run as one `llama_decode` per group of equal pieces (decode calls,
  one row per session, stay one `llama_decode`). The scheduler sizes the pieces
  (consumer/sched/prefill_shape.py).
- "fast": llama.cpp's defaults (flash attention on, tiled matmul allowed), still `use_extra_bufts=False`
  on CPU: llama.cpp builds with `-march=native` pick AMX kernels on CPUs that advertise AMX, and some VMs
  advertise it but cannot execute it (SIGILL in `ggml_backend_amx_mul_mat`). `extra_bufts=True` opts into
  the repacked weight buffers (llama-server's default) on a machine known to be safe; `"auto"` repacks a
  fast engine unless an AMX build meets a CPU advertising AMX (`dgr consumer --repack`). Through the
  service on this 2-core AVX-512 machine repacking measured no faster (docs/benchmarks.md), hence off by
  default. `describe()["cpu_path"]` says which and why.

Route hops (a GGUF written by dgrtools/split_model.py, `dgr model split`, holding blocks [a, b) of a
source model; docs/hops.md): the engine reads the file's `dgr.split.*` metadata and becomes that hop.
Its identity names the SOURCE model's sha256, its boundary the absolute range, n_embd and dtype f32.
- A hop after the first consumes `batch.hidden`: the llama_batch carries `embd` (n_batch x n_embd floats)
  and no token array, positions and seq ids as usual.
- A hop before the last produces hidden rows: the residual stream leaving its last block, the graph
  tensor `l_out-<n_blocks-1>`, copied out by the context's `cb_eval` callback with
  `ggml_backend_tensor_get` (libggml-base). Every row of the call is marked for output (llama.cpp keeps
  only the output rows in the last block otherwise), and the callback stops the graph right after that
  tensor, so the output norm and head (vocab x n_embd per row) are never computed. Such a hop always
  runs whole pieces (`_plan`): each `llama_decode` is then one micro-batch per run of sequences, in
  (slot, position) order, which is the order the captured rows come in.
- The last hop returns logits for the rows that want them, like a whole model.
The invariance rules below hold per hop: each hop is a llama.cpp model of its own, run with the recipe.

State layouts (consumer/engines/state.py, docs/state-layouts.md): a KV model ("kv"), a recurrent one
(Mamba, RWKV: "recurrent") or both in one ("hybrid"); the layout, its dimensions and the bytes a session
holds are advertised, and a failed call is undone by position, from a snapshot, or reported lost.

Positions are checked here before llama.cpp sees them (llama.cpp silently accepts a first token at
p > 0 on an empty sequence). llama.cpp's log goes to Python logging, logger "dgr.llama".
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from schemas import BoundarySchema, EngineIdentity, Reason, Recipe, StateLayout
from schemas.compat import hop_boundary

from ..batch import BatchRow, EngineOutput, FusedBatch
from ..cpuinfo import cpu_flags
from .base import Engine, EngineCapacity, EngineError, LogitsEngine, check_hidden
from .cpu_wait import apply_cpu_wait
from .loader import SplitInfo, ftype_name, gguf_sha256, read_split_info
from .state import Checkpoint, SlotStates, SnapshotPolicy, layout_dims, state_kind

LLAMA_CPP_PIN = "0.3.36"
RUNTIME = f"llama-cpp-python=={LLAMA_CPP_PIN}"
RecipeName = Literal["fast", "invariant"]

log = logging.getLogger("dgr.llama")

# ggml_log_level (ggml.h): NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the last message).
# llama-cpp-python's own callback uses an older, shifted enum; this one is checked against ggml.h.
GGML_LOG_LEVELS: dict[int, int] = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING,
                                   4: logging.ERROR}
GGML_LOG_CONT = 5

_lock = threading.Lock()
_llama_mod: ModuleType | None = None
_log_cb: Any = None  # the ctypes callback object: must stay referenced while llama.cpp may call it
_log_buf: list[str] = []
_log_level = logging.INFO
_decoded_in_process = False  # a llama_decode ran: ggml's once-per-process env reads are done
_ggml_base: Any = None  # libggml-base (ctypes): tensor names and reads for the hop capture


def _on_llama_log(level: int, text: bytes | None, _user: Any) -> None:
    """llama.cpp/ggml log callback: whole lines to `dgr.llama`, CONT chunks joined to their message."""
    global _log_level
    try:
        s = (text or b"").decode("utf-8", errors="replace")
        if level != GGML_LOG_CONT:
            if _log_buf:  # a new message starts: flush an unterminated previous one
                log.log(_log_level, "%s", "".join(_log_buf).rstrip("\n"))
                _log_buf.clear()
            _log_level = GGML_LOG_LEVELS.get(level, logging.INFO)
        _log_buf.append(s)
        if s.endswith("\n"):
            msg = "".join(_log_buf).rstrip("\n")
            _log_buf.clear()
            if msg:
                log.log(_log_level, "%s", msg)
    except Exception:  # never raise into C
        pass


def llama_cpp_module() -> ModuleType:
    """Import llama_cpp once: routes its log to logging ("dgr.llama") and initialises the backend."""
    global _llama_mod, _log_cb
    with _lock:
        if _llama_mod is None:
            import llama_cpp

            if llama_cpp.__version__ != LLAMA_CPP_PIN:
                log.warning("llama-cpp-python %s found, %s pinned: low-level names may differ",
                            llama_cpp.__version__, LLAMA_CPP_PIN)
            _log_cb = llama_cpp.llama_log_callback(_on_llama_log)
            llama_cpp.llama_log_set(_log_cb, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _llama_mod = llama_cpp
        return _llama_mod


def ggml_base() -> Any:
    """libggml-base from llama-cpp-python's wheel, with the three functions the hop capture calls."""
    global _ggml_base
    with _lock:
        if _ggml_base is None:
            import llama_cpp

            lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
            lib.ggml_get_name.restype = ctypes.c_char_p
            lib.ggml_get_name.argtypes = [ctypes.c_void_p]
            lib.ggml_nbytes.restype = ctypes.c_size_t
            lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
            lib.ggml_backend_tensor_get.restype = None
            lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                    ctypes.c_size_t]
            _ggml_base = lib
        return _ggml_base


class _Capture:
    """The `cb_eval` callback of a hop that produces hidden rows: copies each micro-batch's
    `l_out-<n-1>` into `buf` (rows appended in compute order), then stops the graph (returns False):
    nothing after the boundary (output norm, head) is needed."""

    def __init__(self, name: str, n_embd: int, n_rows: int) -> None:
        self._name = name.encode()
        self._lib = ggml_base()
        self.buf = np.zeros((n_rows, n_embd), dtype=np.float32)
        self.row = 0  # rows captured in the current call
        self.error: str | None = None
        self._row_bytes = n_embd * 4
        self.callback = llama_cpp_module().ggml_backend_sched_eval_callback(self._on_eval)

    def _on_eval(self, tensor: Any, ask: bool, _user: Any) -> bool:
        try:
            if self._lib.ggml_get_name(tensor) != self._name:
                return True  # not ours: compute on
            if ask:
                return True
            nbytes = int(self._lib.ggml_nbytes(tensor))
            rows = nbytes // self._row_bytes
            if nbytes % self._row_bytes or self.row + rows > self.buf.shape[0]:
                self.error = f"{self._name.decode()} of {nbytes} bytes does not fit the call's rows"
                return False
            dst = self.buf.ctypes.data + self.row * self._row_bytes
            self._lib.ggml_backend_tensor_get(tensor, ctypes.c_void_p(dst), 0, nbytes)
            self.row += rows
            return False  # the boundary is all this hop gives: skip the output norm and the head
        except Exception as e:  # never raise into C
            self.error = repr(e)
            return False


def cpu_amx() -> dict[str, bool]:
    """Does the CPU advertise AMX (/proc/cpuinfo), and was llama.cpp built with AMX kernels?"""
    flags = cpu_flags()
    info = ""
    if _llama_mod is not None:
        info = _llama_mod.llama_print_system_info().decode(errors="replace")
    return {"cpu_advertises_amx": any(f.startswith("amx") for f in flags),
            "build_has_amx": "AMX" in info}


def _extra_bufts(asked: bool | Literal["auto"], recipe: str, amx: dict[str, bool]) -> tuple[bool, str]:
    """Whether the model loads into llama.cpp's extra (repacked, AMX) weight buffers, and why."""
    if asked != "auto":
        return bool(asked), "asked"
    if recipe == "invariant":
        return False, "auto, recipe invariant: a repacked matmul picks its kernel by the call's rows"
    if amx["cpu_advertises_amx"] and amx["build_has_amx"]:
        return False, "auto, recipe fast, but an AMX build on a CPU advertising AMX may SIGILL"
    return True, "auto, recipe fast"


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _disable_tiled_mm() -> str:
    """Recipe "invariant": make sure ggml's tiled K-quant matmul is off. Returns what happened."""
    cur = os.environ.get("GGML_CPU_TILED_MM")
    if cur is not None and cur.strip() == "0":
        return "GGML_CPU_TILED_MM=0 (set in the environment)"
    if _decoded_in_process:
        return (f"GGML_CPU_TILED_MM={cur!r} and a decode already ran in this process: ggml read it then; "
                "export GGML_CPU_TILED_MM=0 before starting the worker")
    os.environ["GGML_CPU_TILED_MM"] = "0"
    return "GGML_CPU_TILED_MM=0 (set by the engine before the first decode)"


class LlamaCppEngine(LogitsEngine):
    """The Engine protocol over llama.cpp: `n_slots` sessions, one `llama_decode` per step."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        recipe: RecipeName = "invariant",
        n_slots: int = 8,
        ctx_per_session: int = 1024,
        n_batch: int = 2048,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        kv_cache_type: Literal["f16", "f32"] = "f16",
        flash_attention: bool | None = None,
        extra_bufts: bool | Literal["auto"] = False,
        snapshots: SnapshotPolicy = "chunks",
        cpu_wait: str = "auto",
    ) -> None:
        if recipe not in ("fast", "invariant"):
            raise ValueError(f"recipe must be 'fast' or 'invariant', not {recipe!r}")
        if n_slots < 1 or ctx_per_session < 1 or n_batch < 1:
            raise ValueError("n_slots, ctx_per_session and n_batch must be >= 1")
        if flash_attention is None:  # the recipe's choice
            flash_attention = recipe == "fast"
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise FileNotFoundError(self.model_path)
        self._recipe_name = recipe
        self._tiled_mm = _disable_tiled_mm() if recipe == "invariant" else \
            f"GGML_CPU_TILED_MM={os.environ.get('GGML_CPU_TILED_MM', 'unset (tiled matmul allowed)')}"
        # An "invariant" engine that could not switch the tiled matmul off, or was asked for flash
        # attention, does not claim invariance.
        invariant = recipe == "invariant" and self._tiled_mm.startswith("GGML_CPU_TILED_MM=0") \
            and not flash_attention
        if recipe == "invariant" and not invariant:
            log.warning("recipe 'invariant' with %s, flash_attention=%s; batch_invariant=False",
                        self._tiled_mm, flash_attention)
        # Keep each session's prefill piece in one micro-batch (see the module docstring).
        self._whole_pieces = recipe == "invariant"
        # How its CPU threads wait at barriers: chosen before llama.cpp's libraries load (cpu_wait.py).
        self._cpu_wait = apply_cpu_wait(cpu_wait) if n_gpu_layers == 0 else f"not applied (n_gpu_layers={n_gpu_layers})"
        L = llama_cpp_module()
        self._L = L
        self._n_threads = n_threads or _default_threads()
        amx = cpu_amx()
        extra_bufts, why = _extra_bufts(extra_bufts, recipe, amx)
        if extra_bufts and n_gpu_layers == 0 and amx["build_has_amx"]:
            log.warning("extra_bufts=True with a build that has AMX kernels: SIGILL if the CPU cannot run them")
        self._cpu_path = (
            f"use_extra_bufts={extra_bufts} ("
            + ("repacked/AMX weight buffers allowed" if extra_bufts else
               "plain CPU weight buffers: no repack, no AMX kernels")
            + f": {why}); CPU advertises AMX: {amx['cpu_advertises_amx']}; build has AMX kernels: "
            f"{amx['build_has_amx']}; {self._tiled_mm}"
        )

        self._model: Any = None
        self._ctx: Any = None
        self._capture: _Capture | None = None
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers
        mp.use_extra_bufts = extra_bufts
        model = L.llama_model_load_from_file(str(self.model_path).encode(), mp)
        if not model:
            raise EngineError(f"llama.cpp could not load {self.model_path}")
        self._model = model
        try:  # after llama.cpp accepted the file: a file that is no GGUF is its "could not load"
            sp: SplitInfo | None = read_split_info(self.model_path)
        except ValueError as e:
            self.close()
            raise EngineError(f"{self.model_path}: {e}") from e
        self._split = sp
        self._consumes_hidden = sp is not None and not sp.is_first
        self._produces_hidden = sp is not None and not sp.is_last
        self._n_embd = int(L.llama_model_n_embd(model))
        if self._produces_hidden:
            # Every llama_decode must be one micro-batch per run of sequences, rows in order (see the
            # module docstring), whatever the recipe; the capture buffer holds one call's rows.
            self._whole_pieces = True
            n_blk = int(L.llama_model_n_layer(model))
            self._capture = _Capture(f"l_out-{n_blk - 1}", self._n_embd, n_batch)
        try:
            self._init_context(n_slots, ctx_per_session, n_batch, kv_cache_type, flash_attention)
            self._states = SlotStates(L, self._ctx, self._mem, state_kind(L, model), snapshots)
        except BaseException:
            self.close()
            raise

        arch = self._meta("general.architecture") or "unknown"
        ftype = self._meta("general.file_type")
        quant = ftype_name(int(ftype)) if ftype and ftype.isdigit() else ftype_name(L.llama_model_ftype(model))
        n_layer = int(L.llama_model_n_layer(model))
        n_head = int(L.llama_model_n_head(model))
        n_head_kv = int(L.llama_model_n_head_kv(model))
        n_embd = int(L.llama_model_n_embd(model))
        key_len = self._meta(f"{arch}.attention.key_length")
        head_dim = int(key_len) if key_len and key_len.isdigit() else n_embd // max(1, n_head)
        self._arch, self._quant, self._n_layer = arch, quant, n_layer
        self._kv_type, self._flash = kv_cache_type, flash_attention
        if invariant and n_gpu_layers == 0 and quant in ("F32", "F16", "BF16"):
            # Float weights: ggml's one-row matmul and llamafile's tinyBLAS (two rows or more) sum in
            # different orders, so one row alone and in a batch differ (docs/state-layouts.md).
            log.warning("recipe 'invariant' with %s weights on CPU: batch_invariant=False (use Q8_0)", quant)
            invariant = False

        # A hop names its SOURCE model; the block range is in the boundary.
        source_sha = sp.source_sha256 if sp is not None else gguf_sha256(self.model_path)
        self.identity = EngineIdentity(architecture=arch, gguf_sha256=source_sha)
        self.recipe = Recipe(quantization=quant, kv_cache_type=kv_cache_type, ctx_per_session=ctx_per_session,
                             flash_attention=flash_attention, batch_invariant=invariant,
                             runtime=RUNTIME)
        self._first, self._last = (sp.first_block, sp.last_block) if sp is not None else (0, n_layer)
        self.boundary: BoundarySchema = hop_boundary(self._first, self._last,
                                                     sp.source_block_count if sp is not None else n_layer, n_embd)
        # What one session's state weighs, measured on slot 0 (two one-row calls, then released).
        hidden = np.zeros((1, self._n_embd), np.float32) if self._consumes_hidden else None
        try:
            size = self._states.measure(
                lambda pos: self.forward(FusedBatch.from_rows("prefill", [BatchRow(0, pos, 1, True)], hidden)),
                lambda: self.release(0))
        except BaseException:
            self.close()
            raise
        self.state_layout = StateLayout(kind=self._states.kind, dims=layout_dims(
            self.model_path, arch, self._states.kind, n_layer=n_layer, n_head_kv=n_head_kv, head_dim=head_dim,
            n_ctx_per_seq=int(self._n_ctx_seq), snapshot_bytes=size.snapshot))
        self.capacity = EngineCapacity(n_slots=n_slots, ctx_per_session=ctx_per_session,
                                       max_tokens_per_call=self._n_batch, vocab_size=self._n_vocab,
                                       state_bytes_per_session=size.per_session(ctx_per_session),
                                       state_bytes_per_token=size.per_token)

    # --------------------------------------------------------------------------------- set-up
    def _init_context(self, n_slots: int, ctx_per_session: int, n_batch: int,
                      kv_cache_type: str, flash_attention: bool) -> None:
        L = self._L
        cp = L.llama_context_default_params()
        cp.n_ctx = n_slots * ctx_per_session
        cp.n_batch = n_batch
        cp.n_ubatch = min(n_batch, 512)
        cp.n_seq_max = n_slots
        cp.kv_unified = False
        cp.n_threads = self._n_threads
        cp.n_threads_batch = self._n_threads
        cp.no_perf = True
        kv_type = L.GGML_TYPE_F32 if kv_cache_type == "f32" else L.GGML_TYPE_F16
        cp.type_k = kv_type
        cp.type_v = kv_type
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attention else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if self._capture is not None:
            cp.cb_eval = self._capture.callback
            cp.cb_eval_user_data = None
        ctx = L.llama_init_from_model(self._model, cp)
        if not ctx:
            raise EngineError("llama_init_from_model failed (see the dgr.llama log)")
        self._ctx = ctx
        if int(L.llama_n_seq_max(ctx)) != n_slots:
            raise EngineError(f"llama.cpp gave n_seq_max {L.llama_n_seq_max(ctx)}, {n_slots} asked")
        self._mem = L.llama_get_memory(ctx)
        self._n_ctx_seq = int(L.llama_n_ctx_seq(ctx))
        if self._n_ctx_seq < ctx_per_session:
            raise EngineError(f"llama.cpp gives {self._n_ctx_seq} positions per sequence, {ctx_per_session} asked")
        self._vocab = L.llama_model_get_vocab(self._model)
        self._n_vocab = int(L.llama_vocab_n_tokens(self._vocab))
        # llama.cpp caps n_batch at n_ctx: a call may carry no more rows than llama.cpp accepts.
        self._n_slots, self._ctx_per_session = n_slots, ctx_per_session
        self._n_batch = min(n_batch, int(L.llama_n_batch(ctx)))
        self._n_ubatch = int(L.llama_n_ubatch(ctx))
        self._next = np.zeros(n_slots, dtype=np.int64)  # each slot's next position

        # The one llama_batch, backed by NumPy arrays this object owns (never llama_batch_free'd).
        self._tok = np.zeros(n_batch, dtype=np.int32)
        self._pos = np.zeros(n_batch, dtype=np.int32)
        self._nseq = np.ones(n_batch, dtype=np.int32)
        self._seq = np.zeros(n_batch, dtype=np.int32)
        self._out_flags = np.zeros(n_batch, dtype=np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self._seq.ctypes.data
        self._seq_ptrs = (i32p * n_batch)(*[ctypes.cast(base + 4 * i, i32p) for i in range(n_batch)])
        b = L.llama_batch()
        b.n_tokens = 0
        # llama.cpp reads `token` when it is set, `embd` otherwise: a hop after the first sets only embd.
        self._embd: npt.NDArray[np.float32] | None = None
        if self._consumes_hidden:
            self._embd = np.zeros((n_batch, self._n_embd), dtype=np.float32)
            b.token = ctypes.POINTER(ctypes.c_int32)()
            b.embd = self._embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        else:
            b.token = self._tok.ctypes.data_as(i32p)
            b.embd = ctypes.POINTER(ctypes.c_float)()
        b.pos = self._pos.ctypes.data_as(i32p)
        b.n_seq_id = self._nseq.ctypes.data_as(i32p)
        b.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32p))
        b.logits = self._out_flags.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = b

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = self._L.llama_model_meta_val_str(self._model, key.encode(), buf, 256)
        return buf.value.decode(errors="replace") if n >= 0 else None

    # ------------------------------------------------------------------------------- protocol
    @property
    def batch_invariant(self) -> bool:
        return self.recipe.batch_invariant

    def step(self, batch: FusedBatch) -> npt.NDArray[np.float32]:
        """forward()'s rows: logits for a whole model or a last hop, hidden rows for an earlier hop."""
        return self.forward(batch).rows

    def forward(self, batch: FusedBatch) -> EngineOutput:
        return self._forward(batch, lend=False)

    def forward_lent(self, batch: FusedBatch) -> EngineOutput:
        """`forward`, but the logits rows of a call whose rows llama.cpp wrote in the caller's order are given in
        place, not copied (EngineOutput.borrowed: valid until this engine's next call). For a caller that reads
        them before the engine runs again or takes `owned()` first (the worker: consumer/worker/chain.py), where a
        copy costs more than their argmax: 8 rows of Gemma 3's 262,144 logits, 0.7 ms of a 50 ms decode call. A
        subclass that overrides `forward` (a fault injector) keeps its own, copied rows."""
        if type(self).forward is not LlamaCppEngine.forward:
            return self.forward(batch)
        return self._forward(batch, lend=True)

    def _forward(self, batch: FusedBatch, *, lend: bool) -> EngineOutput:
        global _decoded_in_process
        if self._ctx is None:
            raise EngineError("engine is closed")
        n = len(batch)
        if n == 0:
            raise EngineError("empty batch")
        if n > self._n_batch:
            raise EngineError(f"batch of {n} rows exceeds n_batch {self._n_batch}: split it", reason=Reason.TOO_LONG)
        slots = np.asarray(batch.slots, dtype=np.int64)
        positions = np.asarray(batch.positions, dtype=np.int64)
        tokens = np.asarray(batch.tokens, dtype=np.int64)
        wants = np.asarray(batch.wants_logits, dtype=np.bool_)
        hidden_in = check_hidden(batch, self.boundary)
        self._validate(slots, positions, tokens)

        # llama.cpp splits a batch for a per-sequence KV cache into sub-batches of *consecutive*
        # increasing seq ids (split_equal, sequential): rows in any other order cost one forward pass
        # per run of ids (measured: 8 sessions in descending slot order ran at 0.42x). Fill the batch
        # sorted by (slot, position); the logits come back in the caller's row order below.
        order = np.lexsort((positions, slots))
        s_slots, s_pos, s_tok, s_wants = slots[order], positions[order], tokens[order], wants[order]
        where = np.empty(n, dtype=np.int64)
        where[order] = np.arange(n)  # caller's row i sits at sorted row where[i]
        out_row = np.full(n, -1, dtype=np.int64)  # sorted row -> row of `out`
        wanted_sorted = where[np.flatnonzero(wants)]
        out_row[wanted_sorted] = np.arange(wanted_sorted.shape[0])
        cap = self._capture
        if cap is not None:  # a hop that is not the last: one hidden row per batch row
            out = np.empty((n, self._n_embd), dtype=np.float32)
            s_hidden_out = np.empty((n, self._n_embd), dtype=np.float32)
        s_hidden = hidden_in[order] if hidden_in is not None else None
        _decoded_in_process = True
        cp = self._states.checkpoint(slots, positions)
        plan = self._plan(s_slots)
        # Lent: one llama_decode whose logits rows come in the caller's order (a decode call whose rows are in slot
        # order): the rows are read where llama.cpp wrote them, not copied (EngineOutput.borrowed)
        borrow = lend and cap is None and len(plan) == 1 and wanted_sorted.shape[0] > 0 \
            and bool(np.all(wanted_sorted[1:] > wanted_sorted[:-1]))
        if cap is None and not borrow:
            out = np.empty((wanted_sorted.shape[0], self._n_vocab), dtype=np.float32)
        for rows in plan:
            m = rows.shape[0]
            self._tok[:m] = s_tok[rows]
            self._pos[:m] = s_pos[rows]
            self._seq[:m] = s_slots[rows]
            if s_hidden is not None:
                assert self._embd is not None
                self._embd[:m] = s_hidden[rows]
            # A boundary hop marks every row: llama.cpp keeps only output rows in the last block.
            self._out_flags[:m] = 1 if cap is not None else s_wants[rows]
            self._batch.n_tokens = m
            if cap is not None:
                cap.row, cap.error = 0, None
            rc = int(self._L.llama_decode(self._ctx, self._batch))
            if rc != 0:
                what = {1: "no KV cell free for the batch", 2: "aborted"}.get(rc, "error")
                raise self._undo(cp, f"llama_decode returned {rc} ({what})")
            if cap is not None:
                if cap.error is not None or cap.row != m:
                    raise self._undo(cp, f"boundary capture got {cap.row} of {m} rows ({cap.error})")
                s_hidden_out[rows] = cap.buf[:m]
                continue
            if borrow:
                out = self._logits_rows(cp, wanted_sorted.shape[0])
                continue
            for i in np.flatnonzero(s_wants[rows]).tolist():
                ptr = self._L.llama_get_logits_ith(self._ctx, int(i))
                if not ptr:
                    raise self._undo(cp, f"llama.cpp has no logits for row {i}")
                out[out_row[rows[i]]] = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
        np.maximum.at(self._next, slots, positions + 1)
        if cap is not None:
            out[:] = s_hidden_out[where]  # back to the caller's row order
            return EngineOutput.hidden(out)
        return EngineOutput.logits(out, borrowed=borrow)

    def _logits_rows(self, cp: Checkpoint, n: int) -> npt.NDArray[np.float32]:
        """The last llama_decode's n logits rows, in its batch's order, as llama.cpp holds them (valid until the
        next call). Left writeable: numpy 2.4's argmax of a read-only array runs 3x slower (0.55 against 0.17 ms
        for 8 rows of 262,144, `timeit`)."""
        ptr = self._L.llama_get_logits(self._ctx)
        if not ptr:
            raise self._undo(cp, "llama.cpp has no logits for the call")
        return np.ctypeslib.as_array(ptr, shape=(n, self._n_vocab))

    def _plan(self, s_slots: npt.NDArray[np.int64]) -> list[npt.NDArray[np.int64]]:
        """The llama_decode calls for rows sorted by (slot, position): lists of sorted-row indices.

        One call when every session has the same number of rows and they fit a micro-batch (every
        decode call), or for the "fast" recipe. Otherwise ("invariant" prefill) each session's rows are
        cut into pieces of at most n_ubatch rows, never leaving a piece of one row, and pieces of equal
        length are run together, so llama.cpp keeps each piece in one micro-batch: a row's kernel then
        depends only on its own session's piece (see the module docstring)."""
        n = s_slots.shape[0]
        starts = np.flatnonzero(np.r_[True, s_slots[1:] != s_slots[:-1]])
        counts = np.diff(np.r_[starts, n])
        u = self._n_ubatch
        if not self._whole_pieces or (counts.min() == counts.max() and n <= u):
            return [np.arange(n)]
        pieces: list[list[tuple[int, int]]] = []  # per session: (first sorted row, rows) in order
        for b, c in zip(starts.tolist(), counts.tolist(), strict=True):
            sizes = [u] * (c // u) + ([c % u] if c % u else [])
            if len(sizes) > 1 and sizes[-1] == 1:
                sizes[-2:] = [u - 1, 2]
            cut = np.cumsum([0, *sizes]).tolist()
            pieces.append([(b + cut[k], sizes[k]) for k in range(len(sizes))])
        calls: list[npt.NDArray[np.int64]] = []
        for k in range(max(len(p) for p in pieces)):  # a session's k-th piece runs after its (k-1)-th
            by_len: dict[int, list[int]] = {}
            for p in pieces:
                if k < len(p):
                    by_len.setdefault(p[k][1], []).append(p[k][0])
            for length, firsts in sorted(by_len.items()):
                per_call = max(1, u // length)
                for i in range(0, len(firsts), per_call):
                    calls.append(np.concatenate([np.arange(f, f + length) for f in firsts[i:i + per_call]]))
        return calls

    def release(self, slot: int) -> None:
        if self._ctx is None:
            return
        if not 0 <= slot < self._n_slots:
            raise EngineError(f"slot {slot} out of range [0, {self._n_slots})", (slot,))
        self._L.llama_memory_seq_rm(self._mem, slot, -1, -1)
        self._next[slot] = 0

    def next_position(self, slot: int) -> int:
        return int(self._next[slot])

    # ---- prefix cache (consumer/prefix/, docs/prefix-cache.md): kept apart from the call path ----------
    def prefix_unsupported(self) -> str | None:
        """None when this engine's slots can be saved and restored by prefix, else the reason code why not:
        a recurrent or hybrid state is the state of exactly the position it was taken at and cannot be
        trimmed back to a block edge ("recurrent_state"); a hop after the first computes from activations,
        not from token ids alone ("hidden_input")."""
        if not self._states.positional:
            return "recurrent_state"
        if self._consumes_hidden:
            return "hidden_input"
        return None

    def save_prefix(self, slot: int) -> bytes:
        """The slot's whole sequence state (`llama_state_seq_get_data`: its KV cells and their positions),
        as bytes that restore_prefix can write into any slot of a context of the same model and layout."""
        if self._ctx is None:
            raise EngineError("engine is closed")
        L = self._L
        n = int(L.llama_state_seq_get_size(self._ctx, slot))
        buf = (ctypes.c_uint8 * n)()
        got = int(L.llama_state_seq_get_data(self._ctx, buf, n, slot))
        if got <= 0:
            raise EngineError(f"slot {slot}: llama_state_seq_get_data copied nothing", (slot,))
        return bytes(memoryview(buf)[:got])

    def prefix_window(self) -> int:
        """The sliding window's positions (Gemma 3: 512), 0 for a full KV cache: a slot saved while it holds
        at most this many positions restores exactly (prefix_floor), so the scheduler ends a cacheable
        prompt's piece at the window's edge (consumer/sched/prefix_plan.py)."""
        return max(0, int(self._L.llama_model_n_swa(self._model)))

    def prefix_floor(self, slot: int) -> int:
        """The fewest positions the slot's state, saved now, can be trimmed back to exactly. 0 for a full
        KV cache, and for a sliding-window cache (Gemma 3) while the slot holds at most n_swa positions
        (no cell is masked yet, so none was dropped). Past that, the saved window lacks the cells a trim
        needs: measured on Gemma 3, a 2,000-token slot restored and trimmed to 16 positions held none of
        them in its window (while the live slot's seq_pos_min said 0), trimmed to 1,990 it differs, and
        untrimmed it is exact (docs/prefix-cache.md). So the floor is its end: such a state is a
        checkpoint, restored whole or not at all."""
        n_swa = int(self._L.llama_model_n_swa(self._model))
        end = int(self._next[slot])
        return 0 if n_swa <= 0 or end <= n_swa else end

    def keep_prefix(self, slot: int, n_tokens: int) -> None:
        """Keep the slot's first n_tokens positions, drop the rest (a finished answer recomputed as prompt rows:
        consumer/prefix/run.py refill_finished). Exact while prefix_floor(slot) <= n_tokens."""
        if self._ctx is None:
            raise EngineError("engine is closed")
        if not 0 <= n_tokens <= self._next[slot] or self.prefix_floor(slot) > n_tokens:
            raise EngineError(f"slot {slot}: cannot keep {n_tokens} of its {int(self._next[slot])} positions", (slot,))
        if not self._L.llama_memory_seq_rm(self._mem, slot, n_tokens, -1):
            raise EngineError(f"slot {slot}: llama_memory_seq_rm from {n_tokens} refused", (slot,))
        self._next[slot] = n_tokens

    def restore_prefix(self, slot: int, data: bytes, n_tokens: int) -> None:
        """Write a saved state into the (empty) slot and keep its first n_tokens positions (seq_rm of the
        rest): the KV of positions < n_tokens is byte for byte what the saving session computed."""
        if self._ctx is None:
            raise EngineError("engine is closed")
        L = self._L
        L.llama_memory_seq_rm(self._mem, slot, -1, -1)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        ok = int(L.llama_state_seq_set_data(self._ctx, buf, len(data), slot)) > 0
        if ok:
            ok = bool(L.llama_memory_seq_rm(self._mem, slot, n_tokens, -1))
        if not ok or int(L.llama_memory_seq_pos_max(self._mem, slot)) != n_tokens - 1:
            L.llama_memory_seq_rm(self._mem, slot, -1, -1)
            self._next[slot] = 0
            raise EngineError(f"slot {slot}: a cached prefix of {n_tokens} tokens could not be restored", (slot,))
        self._next[slot] = n_tokens

    def llama_vocab(self) -> Any:
        """The model's `llama_vocab*` (valid until close()): the sampler reads the token types and runs
        grammars on it (consumer/sampling/vocab.py)."""
        return self._vocab

    def describe(self) -> dict[str, str]:
        L = self._L
        return {
            "backend": RUNTIME,
            "recipe": self._recipe_name,
            "cpu_path": self._cpu_path,
            "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
            "model": str(self.model_path),
            "blocks": f"[{self._first}, {self._last}) ({self.boundary.consumes} -> {self.boundary.produces})",
            "architecture": self._arch,
            "gguf_sha256": self.identity.gguf_sha256,
            "quantization": self._quant,
            "kv_cache_type": self._kv_type,
            "flash_attention": str(self._flash),
            "kv_unified": "False",
            "n_slots": str(self._n_slots),
            "ctx_per_session": str(self._ctx_per_session),
            "n_ctx_seq": str(self._n_ctx_seq),
            "n_batch": str(self._n_batch),
            "n_threads": str(self._n_threads),
            "cpu_wait": self._cpu_wait,
            "batch_invariant": str(self.recipe.batch_invariant),
            "state_bytes_per_session": str(self.capacity.state_bytes_per_session),
            **self._states.describe(),
        }

    def close(self) -> None:
        L = self._L
        if self._ctx is not None:
            L.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            L.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -------------------------------------------------------------------------------- helpers
    def _validate(self, slots: npt.NDArray[np.int64], positions: npt.NDArray[np.int64],
                  tokens: npt.NDArray[np.int64]) -> None:
        bad = np.unique(slots[(slots < 0) | (slots >= self._n_slots)])
        if bad.size:
            raise EngineError(f"slots {bad.tolist()} out of range [0, {self._n_slots})", tuple(int(s) for s in bad))
        # A hop after the first ignores the tokens (its input is batch.hidden).
        bad = np.unique(slots[(tokens < 0) | (tokens >= self._n_vocab)]) if not self._consumes_hidden \
            else np.empty(0, np.int64)
        if bad.size:
            raise EngineError(f"token out of vocabulary [0, {self._n_vocab}) in slots {bad.tolist()}",
                              tuple(int(s) for s in bad), reason=Reason.BAD_TOKEN)
        if np.unique(slots).shape[0] == slots.shape[0]:  # one row per slot (decode): vectorised check
            expect = self._next[slots]
            wrong = positions != expect
            if wrong.any():
                i = int(np.flatnonzero(wrong)[0])
                s = int(slots[i])
                raise EngineError(f"slot {s}: position {int(positions[i])} given, next position is {int(expect[i])}",
                                  tuple(int(x) for x in np.unique(slots[wrong])), reason=Reason.POSITION_GAP)
            over = positions >= self._ctx_per_session
        else:
            nxt: dict[int, int] = {}
            for s_, p_ in zip(slots.tolist(), positions.tolist(), strict=True):
                want = nxt.get(s_, int(self._next[s_]))
                if p_ != want:
                    raise EngineError(f"slot {s_}: position {p_} given, next position is {want}", (s_,),
                                      reason=Reason.POSITION_GAP)
                nxt[s_] = p_ + 1
            over = positions >= self._ctx_per_session
        if over.any():
            bad = np.unique(slots[over])
            raise EngineError(f"slots {bad.tolist()}: position beyond ctx_per_session {self._ctx_per_session}",
                              tuple(int(s) for s in bad), reason=Reason.TOO_LONG)

    def _undo(self, cp: Checkpoint, what: str) -> EngineError:
        """A call failed inside llama.cpp (or after it): every slot put back where it was (state.py says
        how), or emptied and named lost; returns the error to raise."""
        err = self._states.undo(cp, what)
        for s, start in cp.starts.items():
            self._next[s] = 0 if s in err.lost else start
        return err


# ------------------------------------------------------------------------------------ benchmark
def bench_engine_decode(engine: Engine, batch_sizes: Sequence[int], steps: int, *,
                        prompt_len: int = 8, repeats: int = 1, seed: int = 0) -> list[dict[str, float]]:
    """Decode throughput: fused (one step() for B sessions) vs one step() per session, per batch size.

    For each B: prefill B random prompts of `prompt_len` tokens in slots 0..B-1 (not timed), time
    `steps` greedy decode steps fused; re-prefill, time the same steps one step() per session. With
    `repeats` > 1 the two alternate and each keeps its fastest run (shared machines are noisy: compare
    the ratio of one run, not absolute figures across runs). Slots 0..B-1 are released afterwards.
    Returns one dict per B: batch, steps, fused_tok_s, serial_tok_s, speedup, fused_step_ms.
    """
    rng = np.random.default_rng(seed)
    vocab = engine.capacity.vocab_size
    results: list[dict[str, float]] = []
    for b in batch_sizes:
        if b > engine.capacity.n_slots:
            raise ValueError(f"batch {b} > n_slots {engine.capacity.n_slots}")
        if prompt_len + steps > engine.capacity.ctx_per_session:
            raise ValueError("prompt_len + steps exceeds ctx_per_session")
        prompts = rng.integers(3, vocab, size=(b, prompt_len))
        fused = serial = float("inf")
        for _ in range(max(1, repeats)):
            fused = min(fused, _time_decode(engine, prompts, steps, fused=True))
            serial = min(serial, _time_decode(engine, prompts, steps, fused=False))
        for s in range(b):
            engine.release(s)
        results.append({
            "batch": float(b), "steps": float(steps),
            "fused_tok_s": b * steps / fused, "serial_tok_s": b * steps / serial,
            "speedup": serial / fused, "fused_step_ms": 1000.0 * fused / steps,
        })
    return results


def _time_decode(engine: Engine, prompts: npt.NDArray[np.int64], steps: int, *, fused: bool) -> float:
    b, n = prompts.shape
    nxt = _bench_prefill(engine, prompts)
    t0 = time.perf_counter()
    for k in range(steps):
        if fused:
            rows = [BatchRow(s, n + k, int(nxt[s]), True) for s in range(b)]
            nxt = np.argmax(engine.forward(FusedBatch.from_rows("decode", rows)).rows, axis=1)
        else:
            for s in range(b):
                lg = engine.forward(FusedBatch.from_rows("decode", [BatchRow(s, n + k, int(nxt[s]), True)])).rows
                nxt[s] = int(np.argmax(lg[0]))
    return time.perf_counter() - t0


def _bench_prefill(engine: Engine, prompts: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    b, n = prompts.shape
    for s in range(b):
        engine.release(s)
    rows = [BatchRow(s, p, int(prompts[s, p]), p == n - 1) for s in range(b) for p in range(n)]
    return np.argmax(engine.forward(FusedBatch.from_rows("prefill", rows)).rows, axis=1)


_SYSINFO_RE = re.compile(r"(\w+) = 1")


def system_features() -> list[str]:
    """CPU features llama.cpp was built with ("AVX2", "AVX512", "AMX_INT8"...)."""
    info = llama_cpp_module().llama_print_system_info().decode(errors="replace")
    return _SYSINFO_RE.findall(info)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m consumer.engines.llama MODEL [--recipe R] [--batch 1,2,4,8,16] [--steps N]`:
    print describe() and the fused-vs-serial decode table (the seed of `dgr bench engine`)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m consumer.engines.llama")
    ap.add_argument("model")
    ap.add_argument("--recipe", choices=["fast", "invariant"], default="invariant")
    ap.add_argument("--batch", default="1,2,4,8,16")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--extra-bufts", action="store_true", help="allow repacked/AMX weight buffers (see above)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.batch.split(",")]
    engine = LlamaCppEngine(args.model, recipe=args.recipe, n_slots=max(sizes),
                            ctx_per_session=max(256, args.prompt_len + args.steps), n_threads=args.threads,
                            extra_bufts=args.extra_bufts)
    try:
        print(json.dumps(engine.describe(), indent=1))
        print(f"{'batch':>5} {'fused tok/s':>12} {'serial tok/s':>13} {'speedup':>8} {'fused step ms':>14}")
        for r in bench_engine_decode(engine, sizes, args.steps, prompt_len=args.prompt_len,
                                     repeats=args.repeats):
            print(f"{int(r['batch']):>5} {r['fused_tok_s']:>12.1f} {r['serial_tok_s']:>13.1f} "
                  f"{r['speedup']:>8.2f} {r['fused_step_ms']:>14.2f}")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
