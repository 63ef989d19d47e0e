"""One engine's part of a worker (docs/state-layouts.md, "Several engines in one worker").

A worker holds one `Lane` per engine: the engine, its compatibility keys (so its own input streams), its
own scheduler (session table, slots, the decode/prefill round-robin, prefill budget), its sampler on the
engine's own vocabulary, its route hops' activations, its prefill pacer and its delivery ledger. A
session lives in one lane all its life (the lane whose stream its opening came on), and every fused call
is built by one lane's scheduler and run on that lane's engine: **one call never mixes engines**, by
construction. A worker of one engine has one lane and behaves as it always did.

`Lanes.turns` chooses the lane of the next fused call: smooth weighted round-robin among the lanes with
work (consumer/sched/round_robin.py), the rule the scheduler chooses a phase by one level down.
`read_lanes` reads every lane's streams in one read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, overload

from schemas import CompatibilityKey, Phase

from ..config import WorkerSettings
from ..engines.base import Engine
from ..engines.engine_set import EngineSet
from ..prefix.planner import Refill
from ..prefix.run import prefix_store, refill_finished, save_finished
from ..sampler import BatchSampler, Vocabulary
from ..sched import Answer, PrefillPacer, ScheduledBatch, Scheduler, SchedulerConfig
from ..sched.round_robin import SmoothRoundRobin
from ..transport.protocol import DeadLetter, Delivery, Inbound, Transport
from .delivery import DeliveryLedger
from .hop_steps import HopSteps

__all__ = ["Lane", "Lanes", "Want", "mark_answered", "read_lanes", "read_lanes_ahead"]

# Entries to read per (lane index, phase).
Want = dict[tuple[int, Phase], int]


class Lane:
    """One engine and everything a worker keeps per engine. `streams` (phase -> the transport's name of
    the input stream) is set when the worker registers."""

    def __init__(self, index: int, name: str, engine: Engine, keys: Mapping[Phase, CompatibilityKey], weight: int,
                 settings: WorkerSettings, activation_key: Callable[[Literal["in", "out"], str], str]) -> None:
        self.index, self.name, self.engine, self.weight = index, name, engine, weight
        self.keys = dict(keys)
        cap = engine.capacity
        self.scheduler = Scheduler(
            SchedulerConfig(capacity=cap, max_batch=min(settings.max_batch, cap.n_slots),
                            prefill_budget=min(settings.prefill_budget, cap.max_tokens_per_call),
                            w_decode=settings.w_decode, w_prefill=settings.w_prefill,
                            max_slots_per_account=settings.max_slots_per_account,
                            exact_replay=engine.batch_invariant),
            settings.worker_id, {p: k.digest for p, k in self.keys.items()})
        # The engine's own vocabulary when it has one (special tokens masked, grammars), else its size.
        self.sampler = BatchSampler(Vocabulary.for_engine(engine, cap.vocab_size), threads=settings.sampler_threads)
        self.hops = HopSteps(engine.boundary, activation_key)  # route hops: activations in/out
        self.pacer = PrefillPacer(max_tokens=self.scheduler.config.prefill_budget, ratio=settings.prefill_ratio,
                                  min_tokens=settings.prefill_floor,
                                  idle_tokens=min(settings.prefill_burst, cap.max_tokens_per_call))
        self.ledger = DeliveryLedger(self.scheduler, self.hops, settings.answered_memory)
        self.prefix = prefix_store(engine, self.scheduler, self.keys, settings)  # None: no prefix cache
        self.streams: dict[Phase, str] = {}
        # What to read (consumer/worker/admission.py): sessions the last call answered that hold no credit
        # (their next step is on its way), and prefill entries to read past refused ones.
        self.hot: set[str] = set()
        self.more_prefill = 0
        self.fused_calls = 0
        self._saves_after_publish: list[int] = []  # released slots whose finished save waits (release_slots)

    def holds(self, session_id: str) -> bool:
        return self.scheduler.table.get(session_id) is not None

    def decoding(self) -> bool:
        """Sessions decode here (waiting for their next step, or with one ready: a continuation queued behind
        its session's prompt is not decoding yet, so a wave of openings still gets the burst)."""
        return self.scheduler.awaiting_decode() > 0 or self.scheduler.ready("decode") > 0

    def release_slots(self, *, defer_saves: bool = False) -> None:
        """Clear the slots closed sessions gave back (only while no call computes on the engine); a finished
        session's is saved into the prefix cache first when the scheduler asks (Scheduler.finished_saves: its
        answer as decoded under a recipe that is not batch-invariant, else recomputed as prompt rows in at most
        `--prefill-budget` rows, so a prompt arriving meanwhile waits no longer than for a prefill call while
        sessions decode). `defer_saves`: the answers of the call that closed them are not filed yet; a slot
        with a save to run is kept until the next release (its session's last answer is not held back by it:
        55 ms on Gemma)."""
        sched, engine = self.scheduler, self.engine
        drained = sched.drain_released()
        kept = [s for s in drained if sched.saves_finished(s)] if defer_saves else []
        slots, self._saves_after_publish = [*self._saves_after_publish, *(s for s in drained if s not in kept)], kept
        for slot, finished in sched.finished_saves(slots, self.pacer.max_tokens):
            if finished is not None and self.prefix is not None:
                if isinstance(finished, Refill):
                    refill_finished(engine, self.prefix, finished)
                else:
                    save_finished(engine, self.prefix, finished)
            engine.release(slot)
            sched.slot_cleared(slot)

    @property
    def deferred_saves(self) -> bool:
        """Slots kept by a release with `defer_saves`, whose saves the next release runs."""
        return bool(self._saves_after_publish)

    def info(self) -> dict[str, Any]:
        """What the heartbeat says of this engine besides `EngineSet.advertise()`."""
        prefix = {"prefix_cache": {**self.prefix.stats.as_dict(), "bytes": self.prefix.bytes,
                                   "budget_bytes": self.prefix.budget_bytes, "entries": len(self.prefix)}
                  } if self.prefix is not None else {}
        return {**prefix, "busy_slots": self.scheduler.table.busy_slots, "fused_calls": self.fused_calls,
                "scheduler": self.scheduler.stats.as_dict(), "describe": self.engine.describe()}


def read_lanes(transport: Transport, streams: Sequence[Mapping[Phase, str]], want: Want, *,
               block_ms: int | None = None, gather_ms: float | None = None,
               more: Callable[[Mapping[Phase, int]], bool] | None = None) -> list[Inbound]:
    """Up to want[(lane, phase)] entries of each lane's stream of that phase, in one read; `more` sees the
    counts read so far per phase, over all lanes. With one lane this is `Transport.read`. Touches no
    worker state: the I/O thread runs it."""
    if len(streams) == 1:
        return transport.read({p: n for (_, p), n in want.items()}, block_ms=block_ms, gather_ms=gather_ms,
                              more=more)
    counts = {streams[i][p]: n for (i, p), n in want.items() if n > 0}

    def gather(ds: list[Delivery]) -> bool:
        assert more is not None
        return more(Counter(d.phase for d in ds))

    got = transport.read_streams(counts, block_ms=block_ms, gather_ms=gather_ms,
                                 more=gather if more is not None else None)
    return [transport.inbound(d) for d in got]


def read_lanes_ahead(transport: Transport, streams: Sequence[Mapping[Phase, str]], want: Want
                     ) -> tuple[list[Inbound], list[str], list[DeadLetter]]:
    """`read_lanes(transport, streams, want, block_ms=0, gather_ms=0)` and the cancellations, in one round trip
    (Transport.read_ahead): the read while the engine computes. Touches no worker state: the I/O thread runs it."""
    got, cancels, refused = transport.read_ahead({streams[i][p]: n for (i, p), n in want.items() if n > 0})
    return [transport.inbound(d) for d in got], cancels, refused


class Lanes(Sequence[Lane]):
    """A worker's lanes, one per engine of its `EngineSet`, in the set's order (the first is the one a
    one-engine worker always had)."""

    def __init__(self, engines: EngineSet, settings: WorkerSettings, transport: Transport) -> None:
        self._lanes = [Lane(i, name, engines[name], engines.keys_of(name), engines.weight(name), settings,
                            transport.activation_key) for i, name in enumerate(engines)]
        self._by_digest = {k.digest: lane for lane in self._lanes for k in lane.keys.values()}
        self.turns = SmoothRoundRobin([lane.weight for lane in self._lanes])

    @overload
    def __getitem__(self, i: int) -> Lane: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Lane]: ...

    def __getitem__(self, i: int | slice) -> Lane | Sequence[Lane]:
        return self._lanes[i]

    def __len__(self) -> int:
        return len(self._lanes)

    def __iter__(self) -> Iterator[Lane]:
        return iter(self._lanes)

    # ---- streams and entries --------------------------------------------------------------------
    def keys(self) -> list[CompatibilityKey]:
        """Every lane's keys, lane by lane in phase order: what the worker registers."""
        return [k for lane in self._lanes for k in lane.keys.values()]

    def bind(self, names: Sequence[str]) -> None:
        """The transport's stream names for `keys()`, in that order: each lane's streams."""
        keys = [(lane, p) for lane in self._lanes for p in lane.keys]
        if len(names) == len(keys):
            for (lane, p), name in zip(keys, names, strict=True):
                lane.streams[p] = name
        elif len(self._lanes) > 1:
            raise RuntimeError(f"the transport named {len(names)} streams for {len(keys)} keys")

    @property
    def streams(self) -> list[dict[Phase, str]]:
        """Per lane, its input stream of each phase."""
        return [lane.streams for lane in self._lanes]

    def stream_lane(self, digest: str) -> Lane:
        """The lane whose stream has this key digest (the first lane for a digest no lane has: its
        scheduler answers the entry `incompatible`)."""
        return self._by_digest.get(digest, self._lanes[0])

    def holding(self, session_id: str) -> Lane | None:
        for lane in self._lanes:
            if lane.holds(session_id):
                return lane
        return None

    def for_entry(self, inb: Inbound) -> Lane:
        """Where an entry is admitted: the lane holding its session (a session is bound to its lane: a
        step of it on another engine's stream is answered there, `incompatible`), else its stream's."""
        if len(self._lanes) > 1:
            sid = inb.job.session_id if inb.job is not None else inb.refusal.session_id if inb.refusal else None
            held = self.holding(sid) if sid is not None else None
            if held is not None:
                return held
        return self.stream_lane(inb.digest)

    def fetch_blobs(self, transport: Transport, inbound: Sequence[Inbound]) -> dict[str, bytes | None]:
        """The input activation blobs of the entries (one round trip; none when no lane takes
        activations). Touches no lane state: the I/O thread runs it."""
        for lane in self._lanes:
            if lane.hops.consumes_hidden:
                return lane.hops.fetch(transport, inbound)
        return {}

    # ---- the next fused call --------------------------------------------------------------------
    def next_call(self) -> tuple[Lane, ScheduledBatch] | None:
        """The next fused call: the only lane's, else that of the lane whose turn it is among those with
        work (a lane that has work but no call to build now, a prompt waiting for its next chunk, is
        passed over and its turn given back). A lane's prefill budget is paced against the decode calls
        of every lane that decodes (the shortest): their sessions wait for it too."""
        lanes = self._lanes
        if len(lanes) == 1:
            lane = lanes[0]
            lane.scheduler.set_prefill_budget(lane.pacer.budget(lane.decoding()))
            batch = lane.scheduler.next_batch()
            return (lane, batch) if batch is not None else None
        ready = [lane.index for lane in lanes if lane.scheduler.has_work()]
        if not ready:
            return None
        decoding = [lane for lane in lanes if lane.decoding()]
        times = [x for x in (lane.pacer.decode_s for lane in decoding) if x is not None]
        decode_s = min(times) if times else None
        while ready:
            before = list(self.turns.current)
            i = self.turns.pick(ready)
            assert i is not None
            lane = lanes[i]
            lane.scheduler.set_prefill_budget(lane.pacer.budget(bool(decoding), decode_s))
            batch = lane.scheduler.next_batch()
            if batch is not None:
                return lane, batch
            self.turns.current = before
            ready.remove(i)
        return None

    def completions(self, answers: Sequence[list[Answer]], latencies: list[tuple[Phase, float]]) -> list[Answer]:
        """Every lane's answers (`answers[lane.index]`) through its own delivery ledger, lane by lane (a
        session's answers are all one lane's, in their order)."""
        if len(self._lanes) == 1:  # the usual worker: its ledger's list as it is, not copied answer by answer
            return self._lanes[0].ledger.completions(answers[0], latencies)
        return [a for lane in self._lanes for a in lane.ledger.completions(answers[lane.index], latencies)]

    # ---- slots ----------------------------------------------------------------------------------
    def slots(self) -> int:
        return sum(lane.engine.capacity.n_slots for lane in self._lanes)

    def busy_slots(self) -> int:
        return sum(lane.scheduler.table.busy_slots for lane in self._lanes)

    def release_slots(self, *, defer_saves: bool = False) -> None:
        for lane in self._lanes:
            lane.release_slots(defer_saves=defer_saves)

    def deferred_saves(self) -> bool:
        return any(lane.deferred_saves for lane in self._lanes)


def mark_answered(lane: Lane, outcomes: Sequence[Answer]) -> None:
    """After a fused call: the sessions whose next step the Tracker sends now (one-hop sessions that got a
    token and hold no credit: a continuation needs no read), which the next read waits for (admission.py)."""
    sched = lane.scheduler
    if not sched.awaiting_decode():  # every session holds credit (the chained steady state): none to wait for
        return
    lane.hot.update(o.result.session_id for o in outcomes if o.result.token is not None and not o.result.finished
                    and o.job is not None and o.job.hop == 0 and sched.is_awaiting(o.result.session_id))
