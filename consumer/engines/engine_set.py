"""Several engines in one worker process (docs/state-layouts.md "Several engines in one worker"): a small
and a large model, a draft model, or one model per state layout on one GPU.

Each engine keeps its own compatibility keys, hence its own input streams, and its own slots; a session
belongs to the engine whose key its opening step named. An `EngineSet` is what the worker holds to route
by stream: `engine_for(digest)` names the engine that serves a stream, so a fused call is built from one
engine's sessions only and run on that engine (the worker keeps one scheduler per engine). Two engines
whose keys are equal would share streams, and a fused call could then carry sessions of both: refused
here, when the set is made.

Plain data around the engines: importing this module loads no engine (they are passed in).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from schemas import PHASES, CompatibilityKey, Phase
from schemas.limits import ID_PATTERN, is_id

from .base import Engine, engine_key


class EngineSet:
    """Named engines, each with its own keys (streams) and slots. `weights`: each engine's share of the
    fused calls while several have work (1 each by default; the worker's lane turns, consumer/worker/lane.py)."""

    def __init__(self, engines: Mapping[str, Engine], weights: Mapping[str, int] | None = None) -> None:
        if not engines:
            raise ValueError("an engine set holds at least one engine")
        self._engines = dict(engines)
        self._weights = {name: 1 for name in self._engines}
        for name, w in (weights or {}).items():
            if name not in self._engines:
                raise ValueError(f"a weight for {name!r}, which is not an engine of the set")
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"engine {name!r}: weight {w!r} is not an integer >= 1")
            self._weights[name] = w
        self._keys: dict[str, dict[Phase, CompatibilityKey]] = {}
        self._by_digest: dict[str, str] = {}
        for name, eng in self._engines.items():
            if not is_id(name):
                raise ValueError(f"engine name {name!r} is not an id ({ID_PATTERN})")
            keys = {ph: engine_key(eng, ph) for ph in PHASES}
            for key in keys.values():
                other = self._by_digest.get(key.digest)
                if other is not None:
                    raise ValueError(f"engines {other!r} and {name!r} have the same {key.phase} key ({key.digest}): "
                                     "their sessions would share streams and fused calls; serve them as one "
                                     "engine with more slots")
                self._by_digest[key.digest] = name
            self._keys[name] = keys

    def __len__(self) -> int:
        return len(self._engines)

    def __iter__(self) -> Iterator[str]:
        return iter(self._engines)

    def __getitem__(self, name: str) -> Engine:
        return self._engines[name]

    def weight(self, name: str) -> int:
        return self._weights[name]

    def keys_of(self, name: str) -> dict[Phase, CompatibilityKey]:
        return dict(self._keys[name])

    def all_keys(self) -> list[CompatibilityKey]:
        """Every key of every engine: what the worker registers (one input stream per key)."""
        return [k for keys in self._keys.values() for k in keys.values()]

    def engine_for(self, digest: str) -> str | None:
        """The engine serving the stream of this key digest, or None (no engine here has that key: the
        step is answered `incompatible`)."""
        return self._by_digest.get(digest)

    def advertise(self) -> list[dict[str, Any]]:
        """Per engine, what the heartbeat carries and `dgr inspect` shows: its keys, layout, slots, and the
        state bytes a session holds (at ctx_per_session positions, and per position)."""
        out = []
        for name, eng in self._engines.items():
            cap = eng.capacity
            out.append({
                "engine": name, "digests": {ph: k.digest for ph, k in self._keys[name].items()},
                "architecture": eng.identity.architecture, "state_layout": eng.state_layout.kind,
                "slots": cap.n_slots, "ctx_per_session": cap.ctx_per_session,
                "max_tokens_per_call": cap.max_tokens_per_call, "vocab_size": cap.vocab_size,
                "weight": self._weights[name],
                "state_bytes_per_session": cap.state_bytes_per_session,
                "state_bytes_per_token": cap.state_bytes_per_token,
                "state_bytes_all_slots": cap.state_bytes_per_session * cap.n_slots,
            })
        return out

    def close(self) -> None:
        for eng in self._engines.values():
            eng.close()
