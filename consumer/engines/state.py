"""A llama.cpp context's session state by layout: what it is, what it costs, and how a failed fused call
is undone (docs/state-layouts.md).

Three layouts, from the model (`llama_model_is_recurrent` / `llama_model_is_hybrid`):
- "kv": a KV cache that grows by position. Undo a call: remove the positions it added
  (`llama_memory_seq_rm(seq, start, -1)`), always possible.
- "recurrent" (Mamba, RWKV): one fixed-size cell per sequence, overwritten by every token. llama.cpp
  cannot remove a recurrent sequence's last positions (`seq_rm` returns False and changes nothing); the
  whole sequence can always be removed.
- "hybrid" (Jamba, Granite 4.0-H, LFM2...): a recurrent cell and a KV cache per sequence. `seq_rm` of the
  last positions fails as a whole when the recurrent part moved (llama.cpp tries that part first).

So to undo a call, a slot is put back in one of three ways, chosen per slot:
1. it was empty before the call (start 0): remove the whole sequence;
2. a snapshot of its recurrent part was taken before the call (`llama_state_seq_get_data_ext` with
   LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: for a hybrid only the recurrent cells, not the KV): write it back,
   then remove the positions >= start (the KV part of a hybrid; nothing for a pure recurrent model);
3. no snapshot: `seq_rm(seq, start, -1)`; llama.cpp accepts it exactly when the recurrent part did not
   move (the call failed before touching that slot), and then the KV part is trimmed as for "kv".
When none works the slot's state is dropped (the whole sequence removed, next position 0) and the slot
is reported *lost*: the session must be replayed. Never half done: a slot is either exactly where it
was before the call, or empty.

When snapshots are taken (`SnapshotPolicy`): "chunks" (default) before a call that carries more than
one row for some slot (a prefill chunk, a replay), for every slot of that call that is not empty; never
for a decode call (one row per slot): steady-state decode takes no snapshot. "always": before every
call, for every non-empty slot (exact undo of any failure, at a cost per token). The "kv" layout never
takes one.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from schemas.limits import MAX_DIMS

from .base import EngineError

StateKind = Literal["kv", "recurrent", "hybrid"]
SnapshotPolicy = Literal["chunks", "always"]
SNAPSHOT_POLICIES: tuple[SnapshotPolicy, ...] = ("chunks", "always")


def state_kind(L: Any, model: Any) -> StateKind:
    if L.llama_model_is_hybrid(model):
        return "hybrid"
    if L.llama_model_is_recurrent(model):
        return "recurrent"
    return "kv"


@dataclass
class SnapshotStats:
    """What snapshots cost so far (the engine's describe() and the benchmark report them)."""

    taken: int = 0  # slot snapshots taken
    bytes: int = 0  # bytes copied out, in all
    seconds: float = 0.0  # time spent copying out
    restored: int = 0  # slots put back from a snapshot
    restore_seconds: float = 0.0
    lost: int = 0  # slots whose state could not be put back (dropped: the session replays)
    calls: int = 0  # fused calls seen
    calls_snapshotted: int = 0  # fused calls that took at least one snapshot

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


@dataclass(frozen=True, slots=True)
class StateSize:
    """One session's state, measured: `fixed` bytes plus `per_token` bytes a position (KV), of which
    `snapshot` bytes are what a snapshot copies (the recurrent cells; 0 for "kv")."""

    fixed: int = 0
    per_token: int = 0
    snapshot: int = 0

    def per_session(self, positions: int) -> int:
        return self.fixed + self.per_token * positions


@dataclass
class Checkpoint:
    """A call's rows (slot, position), and the snapshots taken before it. `starts` (each slot's first
    position: where it stood before the call) is worked out only when needed: on a failure, or to snapshot."""

    slots: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    snapshots: dict[int, npt.NDArray[np.uint8]] = field(default_factory=dict)
    _starts: dict[int, int] | None = None

    @property
    def starts(self) -> dict[int, int]:
        if self._starts is None:  # the engine checked that each slot's rows come in position order
            uniq, first = np.unique(self.slots, return_index=True)
            self._starts = dict(zip(uniq.tolist(), self.positions[first].tolist(), strict=True))
        return self._starts


class SlotStates:
    """Snapshots and undo for the sequences (slots) of one llama.cpp context."""

    def __init__(self, L: Any, ctx: Any, mem: Any, kind: StateKind, policy: SnapshotPolicy = "chunks") -> None:
        if policy not in SNAPSHOT_POLICIES:
            raise ValueError(f"snapshot policy must be one of {SNAPSHOT_POLICIES}, not {policy!r}")
        self._L, self._ctx, self._mem = L, ctx, mem
        self.kind: StateKind = kind
        self.policy: SnapshotPolicy = policy
        # For a hybrid only the recurrent part is snapshotted: its KV part is undone by position.
        self._flags = int(L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        self._bufs: dict[int, npt.NDArray[np.uint8]] = {}  # per slot, reused from call to call
        self.stats = SnapshotStats()
        self.size = StateSize()  # set by measure()

    @property
    def positional(self) -> bool:
        """Can the last positions of a sequence be removed (a KV cache only)?"""
        return self.kind == "kv"

    def checkpoint(self, slots: npt.NDArray[np.int64], positions: npt.NDArray[np.int64]) -> Checkpoint:
        """Before a fused call: the snapshots the policy asks for (none for "kv", none for a decode call
        under "chunks": nothing is computed for them on the hot path)."""
        cp = Checkpoint(slots, positions)
        self.stats.calls += 1
        if self.positional or (self.policy == "chunks" and np.unique(slots).shape[0] == slots.shape[0]):
            return cp
        t = time.perf_counter()
        for s, start in cp.starts.items():
            if start > 0:
                cp.snapshots[s] = self._save(s)
        if cp.snapshots:
            self.stats.calls_snapshotted += 1
            self.stats.seconds += time.perf_counter() - t
        return cp

    def rollback(self, cp: Checkpoint) -> list[int]:
        """Put every slot of a failed call back where it was; return the slots that could not be (their
        state dropped: now empty)."""
        L, mem = self._L, self._mem
        lost: list[int] = []
        for s, start in cp.starts.items():
            if start == 0:
                L.llama_memory_seq_rm(mem, s, -1, -1)
                continue
            snap = cp.snapshots.get(s)
            ok = True
            if snap is not None:
                t = time.perf_counter()
                ok = self._load(s, snap)
                self.stats.restore_seconds += time.perf_counter() - t
                self.stats.restored += ok
            if ok:
                ok = bool(L.llama_memory_seq_rm(mem, s, start, -1))
            if not ok:
                L.llama_memory_seq_rm(mem, s, -1, -1)
                lost.append(s)
        self.stats.lost += len(lost)
        return lost

    def undo(self, cp: Checkpoint, what: str) -> EngineError:
        """`rollback`, and the error the engine raises for the failed call (`what` happened): the lost
        slots named in it (`EngineError.lost`)."""
        lost = self.rollback(cp)
        if not lost:
            return EngineError(f"{what}; slots rolled back, see the dgr.llama log")
        return EngineError(f"{what}; slots {lost} could not be rolled back ({self.kind} state, no snapshot): "
                           "their state was dropped", tuple(lost), lost=tuple(lost))

    def measure(self, run_one: Callable[[int], object], release: Callable[[], object]) -> StateSize:
        """What one session's state weighs: `run_one(pos)` runs a one-row call at position `pos` on slot
        0; the slot's `llama_state_seq_get_size` after positions 0 and 0..1 gives the fixed part and the
        part that grows per position (a KV cache grows, a recurrent cell does not); then `release()`."""
        sizes = []
        for pos in (0, 1):
            run_one(pos)
            sizes.append(self.state_bytes(0))
        snap = self.snapshot_bytes(0)
        release()
        self.stats = SnapshotStats()  # the probe is no session's cost
        self.size = StateSize(fixed=2 * sizes[0] - sizes[1], per_token=sizes[1] - sizes[0], snapshot=snap)
        return self.size

    def describe(self) -> dict[str, str]:
        """The engine's describe() lines about state: layout, bytes, snapshot policy and cost so far."""
        return {
            "state_layout": self.kind,
            "state_bytes_per_token": str(self.size.per_token),
            "snapshot_policy": "none (rollback by position)" if self.positional else self.policy,
            "snapshot_bytes_per_session": str(self.size.snapshot),
            "snapshots": " ".join(f"{k}={v:g}" for k, v in self.stats.as_dict().items()),
        }

    def snapshot_bytes(self, slot: int) -> int:
        """Bytes a snapshot of the slot takes now (0 for "kv": none is ever taken)."""
        if self.positional:
            return 0
        return int(self._L.llama_state_seq_get_size_ext(self._ctx, slot, self._flags))

    def state_bytes(self, slot: int) -> int:
        """Bytes of the slot's whole state now (KV and recurrent cells): what a full copy would take."""
        return int(self._L.llama_state_seq_get_size(self._ctx, slot))

    # ------------------------------------------------------------------------------ helpers
    def _save(self, slot: int) -> npt.NDArray[np.uint8]:
        L = self._L
        n = int(L.llama_state_seq_get_size_ext(self._ctx, slot, self._flags))
        buf = self._bufs.get(slot)
        if buf is None or buf.shape[0] < n:
            buf = self._bufs[slot] = np.empty(n, dtype=np.uint8)
        ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        got = int(L.llama_state_seq_get_data_ext(self._ctx, ptr, n, slot, self._flags))
        self.stats.taken += 1
        self.stats.bytes += got
        return buf[:got]

    def _load(self, slot: int, snap: npt.NDArray[np.uint8]) -> bool:
        L = self._L
        ptr = snap.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        try:
            return int(L.llama_state_seq_set_data_ext(self._ctx, ptr, snap.shape[0], slot, self._flags)) > 0
        except Exception:  # llama.cpp reports a bad state by returning 0; be safe with the binding too
            return False


def layout_dims(path: str | os.PathLike[str], arch: str, kind: StateKind, *, n_layer: int, n_head_kv: int,
                head_dim: int, n_ctx_per_seq: int, snapshot_bytes: int) -> dict[str, int]:
    """The StateLayout dimensions of a model (part of the compatibility key: sessions share a stream and
    a fused call only with equal dimensions).

    "kv": n_layer, n_head_kv, head_dim, n_embd_k_gqa, n_ctx_per_seq (unchanged since the first release,
    so a KV model's stream names stay what they were). "recurrent": n_layer, the recurrent block's
    dimensions the GGUF states (`<arch>.ssm.*`, `<arch>.wkv.*`, as ssm_inner_size...) and state_bytes
    (the snapshot of one session: its recurrent cells). "hybrid": the same, plus n_recurrent_layers,
    n_attention_layers and the attention's n_head_kv, head_dim and n_ctx_per_seq."""
    if kind == "kv":
        return {"n_layer": n_layer, "n_head_kv": n_head_kv, "head_dim": head_dim,
                "n_embd_k_gqa": n_head_kv * head_dim, "n_ctx_per_seq": n_ctx_per_seq}
    import gguf

    reader = gguf.GGUFReader(str(path))
    dims: dict[str, int] = {"n_layer": n_layer, "state_bytes": snapshot_bytes}
    for name, f in sorted(reader.fields.items()):
        sub = name.removeprefix(f"{arch}.")
        if sub.split(".")[0] in ("ssm", "wkv") and len(f.types) == 1 and isinstance(f.contents(), int):
            dims[sub.replace(".", "_")] = int(f.contents())
    if kind == "hybrid":
        kv = reader.get_field(f"{arch}.attention.head_count_kv")
        per_layer = kv.contents() if kv is not None else []
        heads = [int(h) for h in per_layer] if isinstance(per_layer, list) else [int(per_layer)] * n_layer
        attn = [h for h in heads if h > 0]
        dims |= {"n_recurrent_layers": n_layer - len(attn), "n_attention_layers": len(attn),
                 "n_head_kv": max(attn, default=0), "head_dim": head_dim, "n_ctx_per_seq": n_ctx_per_seq}
    return dict(list(dims.items())[:MAX_DIMS])
