"""What placement decides from and on (docs/placement.md), as plain data: a session's route template, the score's
weights, one worker's advertised inputs (a Candidate) and the choice; and what the Tracker keeps of the fleet
between two reads to build Candidates from (the parsed summaries, the prompts sent). Its own module so that the
settings, the session handle and the placement index can name these types without importing placement itself."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import msgspec

from schemas import CompatibilityKey, RouteHop, SessionSpec
from schemas.prefix import SUMMARY_MAX_IDS, PrefixSummary

__all__ = ["Candidate", "Choice", "PlacementPolicy", "SentPrompts", "SessionTemplate", "SummaryCache"]


@dataclass(frozen=True, kw_only=True)
class SessionTemplate:
    """A session whose route names keys, not workers: hop k runs `keys[k]` (its block range is the key's
    boundary) on a worker the producer places it on. `options`: every other SessionSpec field (sampling,
    max_tokens, stop_tokens, ...), passed through as is."""

    session_id: str
    account_id: str
    keys: tuple[CompatibilityKey, ...]
    options: Mapping[str, Any] = field(default_factory=dict)

    def spec(self, workers: Sequence[str], hop: Callable[[str, CompatibilityKey], RouteHop] | None = None
             ) -> SessionSpec:
        """The SessionSpec with hop k on workers[k]; `hop(worker, key)` makes (or gives a kept) RouteHop."""
        if len(workers) != len(self.keys):
            raise ValueError(f"{len(self.keys)} hops, {len(workers)} workers")
        make = hop or (lambda w, k: RouteHop(worker_id=w, key=k))
        route = tuple(map(make, workers, self.keys))  # as long as each other (above)
        return SessionSpec(session_id=self.session_id, account_id=self.account_id, route=route, **self.options)


@dataclass(frozen=True, kw_only=True)
class PlacementPolicy:
    """The score's weights (docs/placement.md). `stale_s`: a heartbeat older than this is out (3 beats of the
    consumer's default heartbeat_s = 2 s). `overlap_weight`: what a whole prompt's prefill weighs against a
    full worker's decode load. The imbalance guard: when the most and least loaded candidates differ by more
    than `balance_abs` sessions and by more than `balance_rel` times, the least loaded is chosen."""

    stale_s: float = 6.0
    # Worker loss (producer/moves.py): a worker whose heartbeat is older than lost_s is out and its placed
    # sessions move; the Tracker looks every lost_check_s (one pipeline of GETs).
    lost_s: float = 6.0
    lost_check_s: float = 0.25
    # A session whose opening a worker refused for want of a slot waits up to room_wait_s, placed again every
    # lost_check_s on a worker with room, before it ends rejected (capacity); 0: one more look only.
    room_wait_s: float = 30.0
    overlap_weight: float = 1.0
    # A worker's prompt rows still to compute for sessions placed there (Candidate.pending) weigh overlap_weight x
    # pending / pending_rows: this many rows pending cost as much as a whole prompt not cached (the time to first
    # token of the next session placed there waits for them).
    pending_rows: int = 2048
    queue_weight: float = 1.0
    balance_abs: int = 8
    balance_rel: float = 1.5

    def __post_init__(self) -> None:
        if self.pending_rows < 1:
            raise ValueError(f"pending_rows must be >= 1, got {self.pending_rows}")


class Candidate(msgspec.Struct, gc=False):  # never changed once made (placed_one makes another): made in C
    """One worker's advertised inputs, as placement sees them. `load`: sessions it holds (its heartbeat's
    busy_slots) plus those this Tracker placed on it since that beat; `queued`: steps waiting on its input
    streams (its heartbeat's `queued`, when it says); `held`: prefix block ids its summary says it holds (the
    parsed summary's own set, shared, never written); `sent`: the block ids of the prompts this Tracker sent it
    that the summary may not show yet (its own set, added to as sessions are placed). A block counts as held
    when it is in either (pool_index.leading): no copy of a 4,096-id summary per worker and fleet read.
    `pending`: the prompt rows it has still to compute for this Tracker's sessions (those not cached there when
    placed, until the session's first token): a worker amid a long prompt makes the next prompt wait for it."""

    worker_id: str
    digests: frozenset[str]
    slots: int
    load: int
    queued: int = 0
    heartbeat_age_s: float | None = 0.0
    draining: bool = False
    block_tokens: int | None = None
    scope: str | None = None
    held: Set[str] = frozenset()
    sent: Set[str] = frozenset()
    pending: int = 0  # prompt rows to compute of the sessions this Tracker placed on it that have no token yet

    @property
    def room(self) -> int:
        return self.slots - self.load

    def placed_one(self, sent: Set[str], rows: int = 0) -> Candidate:
        """This candidate with one session more placed on it, sending it `sent` and `rows` prompt rows to compute
        (one per placement: a Struct's constructor runs in C, where a dataclass's __init__ is a Python call)."""
        return Candidate(self.worker_id, self.digests, self.slots, self.load + 1, self.queued, self.heartbeat_age_s,
                         self.draining, self.block_tokens, self.scope, self.held, sent, self.pending + rows)


class Choice(msgspec.Struct, gc=False):  # never changed once made; made in C, as Candidate
    """The worker chosen and why (its score's inputs: what `dgr inspect --json` and the bench show)."""

    worker_id: str
    cost: float
    cached_blocks: int
    prompt_blocks: int
    load: int
    room: int
    guarded: bool  # the imbalance guard chose (least loaded), not the cost
    eligible: int  # candidates that could take it


class SummaryCache:
    """Each worker's prefix summary as last parsed, with the raw value it came from: a heartbeat that says the
    same (the common case between two reads a second apart) costs one comparison in C, not a parse and a set
    of up to SUMMARY_MAX_IDS ids (100 workers of full summaries: 19 ms a fleet read parsing, 30 building)."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[object, PrefixSummary | None, frozenset[str]]] = {}

    def get(self, worker_id: str, raw: object) -> tuple[PrefixSummary | None, frozenset[str]]:
        prev = self.last.get(worker_id)
        if prev is not None and prev[0] == raw:
            return prev[1], prev[2]
        parsed = PrefixSummary.parse(raw)
        ids = frozenset(parsed.ids) if parsed is not None else frozenset()
        if parsed is not None:  # its block size and scope kept, its ids in the set only
            parsed = PrefixSummary(block_tokens=parsed.block_tokens, scope=parsed.scope, ids=[])
        self.last[worker_id] = (raw, parsed, ids)
        return parsed, ids

    def keep(self, worker_ids: Iterable[str]) -> None:
        """Only these workers' (the fleet as read): a worker gone is forgotten."""
        keep = set(worker_ids)
        self.last = {w: v for w, v in self.last.items() if w in keep}


class SentPrompts:
    """The block ids of the prompts this Tracker sent one worker, the last sent first kept: at most `limit` ids
    counted per prompt (a system prompt sent again stays while its prompts are recent). By prompt, not by id,
    so that noting a session is one dictionary operation, not one per block."""

    def __init__(self, limit: int = SUMMARY_MAX_IDS) -> None:
        self.limit, self.count = limit, 0
        self.prompts: OrderedDict[str, Sequence[str]] = OrderedDict()  # by the prompt's last block id

    def add(self, ids: Sequence[str]) -> None:
        if not ids:
            return
        old = self.prompts.pop(ids[-1], None)  # the same last id: the same prompt (ids chain their parents)
        self.count += len(ids) - (len(old) if old is not None else 0)
        self.prompts[ids[-1]] = ids
        while self.count > self.limit and len(self.prompts) > 1:
            self.count -= len(self.prompts.popitem(last=False)[1])

    def ids(self) -> set[str]:
        return set().union(*self.prompts.values())
