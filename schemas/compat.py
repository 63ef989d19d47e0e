"""The compatibility key: what must be equal for two sessions' steps to share one fused engine call.

A key is engine identity + recipe + phase + boundary schema + state layout. Two keys are compatible
exactly when every field is equal; the digest (sha256 of the canonical JSON, 16 hex chars) names the
input stream a step job travels on, so the stream partition already promises compatibility and the
consumer only re-checks it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from .limits import MAX_DIMS, MAX_NAME_LEN, SCHEMA_VERSION

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")

# The activation wire-format version a hop's BoundarySchema names (schemas/activations.py encodes it).
ACTIVATIONS_VERSION = 1

Name = Field(min_length=1, max_length=MAX_NAME_LEN, pattern=r"^[A-Za-z0-9_.:=+<>\-/ ]+$")


class _Frozen(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")


class EngineIdentity(_Frozen):
    """Which weights: the GGUF architecture and the file's sha256."""

    architecture: str = Name
    gguf_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Recipe(_Frozen):
    """How the weights are run. Anything that changes a session's numbers belongs here."""

    quantization: str = Name  # e.g. "Q4_K_M", "Q8_0", "F32"
    kv_cache_type: str = Name  # e.g. "f16", "f32"
    ctx_per_session: int = Field(ge=1, le=1 << 20)
    flash_attention: bool
    batch_invariant: bool  # True: a session's output is bit-identical alone or in any batch
    runtime: str = Name  # e.g. "llama-cpp-python==0.3.36", "numpy-reference/1"


class BoundarySchema(_Frozen):
    """What a route hop consumes and produces. A whole-model hop: tokens in, logits/token out.

    A hop of a split model holds the ABSOLUTE block range [first_layer, last_layer) of its source model;
    it consumes "hidden" unless it starts at block 0 and produces "hidden" unless it ends at the last
    block. `hidden_size` (n_embd) and `dtype` (the wire dtype of the activations) say what the
    activations are; `version` is the activation wire-format version. A whole model has hidden_size 0.
    """

    name: str = Name
    version: int = Field(ge=1, le=1 << 16)
    consumes: Literal["tokens", "hidden"]
    produces: Literal["logits", "hidden"]
    first_layer: int = Field(default=0, ge=0, le=1 << 12)
    last_layer: int = Field(ge=0, le=1 << 12)  # exclusive
    hidden_size: int = Field(default=0, ge=0, le=1 << 20)
    dtype: Literal["f32", "f16"] = "f32"

    @model_validator(mode="after")
    def _consistent(self) -> BoundarySchema:
        if self.last_layer < self.first_layer:
            raise ValueError(f"block range [{self.first_layer}, {self.last_layer}) runs backwards")
        if "hidden" in (self.consumes, self.produces) and self.hidden_size == 0:
            raise ValueError("a boundary that consumes or produces hidden needs hidden_size > 0")
        if self.consumes == "hidden" and self.first_layer == 0:
            raise ValueError("a hop starting at block 0 consumes tokens, not hidden")
        return self

    @model_serializer(mode="wrap")
    def _canonical(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # Fields at their whole-model values are left out, so that every key made before hops existed
        # keeps its digest (its stream name). Every hop has hidden_size > 0, so both always appear there.
        out: dict[str, object] = handler(self)
        if self.hidden_size == 0 and self.dtype == "f32":
            out.pop("hidden_size", None)
            out.pop("dtype", None)
        return out


class StateLayout(_Frozen):
    """What a session's state looks like; states are interchangeable only with equal layouts.

    kind "kv": a KV cache that grows by position (its last positions can be removed); "recurrent" (Mamba,
    RWKV): a fixed-size cell per block, overwritten by every token (a session's state can only be
    emptied, or restored from a snapshot); "hybrid": both in one model (docs/state-layouts.md). For
    recurrent and hybrid layouts `dims` includes "state_bytes", the bytes of one session's recurrent cells.
    """

    kind: Literal["kv", "recurrent", "hybrid"]
    dims: dict[str, int] = Field(max_length=MAX_DIMS)  # e.g. {"n_layer": 2, "n_head_kv": 2, "head_dim": 32}

    @property
    def positional(self) -> bool:
        """Can a session's last positions be removed (a rollback by position)? Only with a KV cache."""
        return self.kind == "kv"


class CompatibilityKey(_Frozen):
    v: Literal[1] = SCHEMA_VERSION
    engine: EngineIdentity
    recipe: Recipe
    phase: Phase
    boundary: BoundarySchema
    state: StateLayout

    def canonical_json(self) -> str:
        """Sorted keys, no whitespace: the byte string the digest is taken over."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    # The digest and the other phase's key are kept on the key (it is frozen): a Tracker asks for them several
    # times per session it opens (a dump, a JSON encoding and a SHA-256 each: a tenth of dgr serve's CPU per
    # request on the tiny model). model_copy drops them from a copy, whose fields may differ.
    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    @cached_property
    def phase_keys(self) -> dict[str, CompatibilityKey]:
        """The keys of the other phases asked for so far (for_phase)."""
        return {}

    def for_phase(self, phase: Phase) -> CompatibilityKey:
        if phase == self.phase:
            return self
        got = self.phase_keys.get(phase)
        if got is None:  # re-validated, not model_copy(update=...): a copy must never carry stale derived state
            got = self.phase_keys[phase] = CompatibilityKey.model_validate({**self.model_dump(), "phase": phase})
        return got

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> CompatibilityKey:
        copy = super().model_copy(update=update, deep=deep)
        for derived in ("digest", "phase_keys"):
            copy.__dict__.pop(derived, None)
        return copy

    def compatible(self, other: CompatibilityKey) -> bool:
        return self == other


def whole_model_boundary(n_layer: int) -> BoundarySchema:
    return BoundarySchema(name="tokens->logits", version=1, consumes="tokens", produces="logits",
                          first_layer=0, last_layer=n_layer)


def hop_boundary(first: int, last: int, n_source_layers: int, hidden_size: int,
                 dtype: Literal["f32", "f16"] = "f32") -> BoundarySchema:
    """The boundary of a hop holding blocks [first, last) of a model of `n_source_layers` blocks."""
    if not 0 <= first < last <= n_source_layers:
        raise ValueError(f"block range [{first}, {last}) is not inside [0, {n_source_layers})")
    if first == 0 and last == n_source_layers:
        return whole_model_boundary(n_source_layers)
    consumes: Literal["tokens", "hidden"] = "tokens" if first == 0 else "hidden"
    produces: Literal["logits", "hidden"] = "logits" if last == n_source_layers else "hidden"
    return BoundarySchema(name=f"{consumes}->{produces}", version=ACTIVATIONS_VERSION, consumes=consumes,
                          produces=produces, first_layer=first, last_layer=last, hidden_size=hidden_size,
                          dtype=dtype)
