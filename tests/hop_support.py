"""Test driver for routes of hops straight on engines (no Redis, no scheduler).

`play_route` plays a continuous-batching schedule on a route (a list of engines, one per hop): every
tick makes ONE FusedBatch of all active sessions' rows (a prefill chunk or one decode row each), runs it
through hop 0, hands each hop's hidden rows to the next as `batch.hidden`, and samples greedily from
the last hop's logits. A route of one engine (the whole model) is the oracle: the same schedule must
give bit-identical logits on every route cut from that model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from consumer.batch import BatchRow, EngineOutput, FusedBatch
from consumer.engines.base import Engine


@dataclass(frozen=True)
class Session:
    name: str
    prompt: tuple[int, ...]
    n_gen: int
    start: int = 0  # tick at which it joins
    chunks: tuple[int, ...] = ()  # prefill chunk sizes (the rest in one piece); () = the prompt in one call


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    logits: list[npt.NDArray[np.float32]] = field(default_factory=list)


def run_hops(route: Sequence[Engine], batch: FusedBatch,
             on_output: Callable[[int, EngineOutput], None] | None = None) -> EngineOutput:
    """One fused call per hop: hop k's hidden rows are hop k+1's batch.hidden."""
    out: EngineOutput | None = None
    hidden: npt.NDArray[np.float32] | None = None
    for k, eng in enumerate(route):
        b = FusedBatch(batch.phase, batch.slots, batch.positions, batch.tokens, batch.wants_logits, hidden)
        out = eng.forward(b)
        if on_output is not None:
            on_output(k, out)
        if k < len(route) - 1:
            assert out.kind == "hidden", f"hop {k} of {len(route)} produced {out.kind}"
            assert out.rows.shape == (len(batch), eng.boundary.hidden_size)
            hidden = out.rows
    assert out is not None and out.kind == "logits"
    return out


def play_route(route: Sequence[Engine], sessions: Sequence[Session], *, max_ticks: int = 10_000,
               on_output: Callable[[int, EngineOutput], None] | None = None) -> dict[str, Run]:
    """Play the schedule; slots are taken lowest-free-first and released when a session ends."""
    n_slots = route[0].capacity.n_slots
    free = list(range(n_slots))
    waiting = sorted(sessions, key=lambda s: (s.start, s.name))
    # name -> (session, slot, next position, chunk sizes still to send)
    active: dict[str, tuple[Session, int, int, list[int]]] = {}
    runs = {s.name: Run() for s in sessions}
    for tick in range(max_ticks):
        while waiting and waiting[0].start <= tick and free:
            s = waiting.pop(0)
            sizes: list[int] = []
            for c in s.chunks:  # the chunks that fit, then the rest in one piece
                if sum(sizes) + c < len(s.prompt):
                    sizes.append(c)
            sizes.append(len(s.prompt) - sum(sizes))
            active[s.name] = (s, free.pop(0), 0, sizes)
        if not active and not waiting:
            return runs
        if not active:
            continue
        rows: list[BatchRow] = []
        owners: list[str] = []  # session of each logits row
        any_prefill = False
        for name, (s, slot, pos, sizes) in active.items():
            if pos < len(s.prompt):
                k = sizes[0]
                rows += [BatchRow(slot, pos + i, s.prompt[pos + i], pos + i == len(s.prompt) - 1) for i in range(k)]
                any_prefill = True
                if pos + k == len(s.prompt):
                    owners.append(name)
            else:
                rows.append(BatchRow(slot, pos, runs[name].tokens[-1], True))
                owners.append(name)
        out = run_hops(route, FusedBatch.from_rows("prefill" if any_prefill else "decode", rows), on_output)
        assert out.rows.shape[0] == len(owners)
        j = 0
        for name in list(active):
            s, slot, pos, sizes = active[name]
            if pos < len(s.prompt):
                k = sizes.pop(0)
                pos += k
                if pos < len(s.prompt):
                    active[name] = (s, slot, pos, sizes)
                    continue
            else:
                pos += 1
            assert owners[j] == name
            r = runs[name]
            r.logits.append(out.rows[j].copy())
            r.tokens.append(int(np.argmax(out.rows[j])))
            j += 1
            if len(r.tokens) >= s.n_gen:
                for eng in route:
                    eng.release(slot)
                free.append(slot)
                free.sort()
                del active[name]
            else:
                active[name] = (s, slot, pos, sizes)
    raise AssertionError("schedule did not finish")


def differences(got: dict[str, Run], want: dict[str, Run]) -> list[str]:
    """Every session whose tokens or logits are not bit-identical to the oracle's."""
    out: list[str] = []
    for name, w in want.items():
        g = got[name]
        if g.tokens != w.tokens:
            out.append(f"{name}: tokens {g.tokens} != {w.tokens}")
        elif not all(np.array_equal(a, b) for a, b in zip(g.logits, w.logits, strict=True)):
            worst = max(float(np.abs(a - b).max()) for a, b in zip(g.logits, w.logits, strict=True))
            out.append(f"{name}: logits differ (max abs {worst:.3g})")
    return out
