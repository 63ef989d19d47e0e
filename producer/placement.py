"""Placement: which worker a session opened from a route *template* goes to (docs/placement.md).

Decided once, in the sans-I/O core: `choose()` is a pure function of what the candidates advertise (their keys,
slots and busy slots, the steps queued on their input streams, heartbeat age, draining, the prefix summary) and
of what this Tracker placed on them since their last heartbeat; `Placer.place()` is the plan that reads the
fleet (`workers()`, cached `discover_cache_s`) and turns a `SessionTemplate` into a `SessionSpec`, hop by hop.

The score is Dynamo's KV router's cost (overlap weight x prefill blocks still to compute + decode load) with
SGLang's imbalance guard (when loads are far apart, the least loaded wins whatever it holds): routing by cache
alone piles sessions on the hot worker (sglang #14305).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import msgspec

from schemas import CompatibilityKey, RouteHop, SessionSpec
from schemas.limits import WIRE_VERSION
from schemas.prefix import (
    BLOCK_TOKENS,
    SCOPES,
    BlockIdMemo,
    PrefixSummary,
    Scope,
    prefix_root,
    salt_for,
)

from .commands import Plan, Sleep
from .placement_choice import choose, eligible
from .placement_inputs import Candidate, Choice, PlacementPolicy, SentPrompts, SessionTemplate, SummaryCache
from .pool_index import PoolIndex

if TYPE_CHECKING:
    from .settings import ProducerSettings
    from .validate import WorkerInfo

__all__ = ["Candidate", "Choice", "FleetView", "PlacementPolicy", "Placer", "SessionTemplate", "candidate", "choose"]

# A session placed this long ago whose first token was never read here no longer counts as pending prefill.
PENDING_MAX_S = 60.0
# A plan that finds another's fleet read in flight and no fleet read before waits for it this long at most, looking
# every FLEET_READ_POLL_S (a read is a few round trips); past it, it reads the fleet itself.
FLEET_READ_WAIT_S = 5.0
FLEET_READ_POLL_S = 0.002


def candidate(w: WorkerInfo, placed: int, sent: Iterable[str], now: float | None = None,
              summary: tuple[PrefixSummary | None, frozenset[str]] | None = None, pending: int = 0) -> Candidate:
    """A Candidate from a worker's advertisement and heartbeat (absent fields: no slots, no summary), `placed`
    sessions this Tracker put on it since its beat, the prompt ids it sent there (`sent`) and the prompt rows
    it has still to compute for them (`pending`); `summary`: its heartbeat's prefix summary already parsed
    (SummaryCache), else parsed here."""
    hb = w.heartbeat
    now = time.time() if now is None else now
    ts = hb.get("ts")
    age = max(0.0, now - float(ts)) if isinstance(ts, int | float) and w.alive else None
    if hb.get("stopped") or w.info.get("wire_version") != WIRE_VERSION:
        age = None  # a worker that said it stopped, or speaks another wire, is out
    slots = _int(hb.get("slots"), _int(w.info.get("slots"), 0))
    if summary is None:
        parsed = PrefixSummary.parse(hb.get("prefix"))
        summary = parsed, frozenset(parsed.ids) if parsed is not None else frozenset()
    summary_of = summary[0]
    return Candidate(worker_id=w.worker_id, digests=frozenset(w.digests), slots=slots,
                     load=_int(hb.get("busy_slots"), 0) + placed, queued=_int(hb.get("queued"), 0),
                     heartbeat_age_s=age, draining=w.draining or bool(hb.get("draining")),
                     block_tokens=summary_of.block_tokens if summary_of is not None else None,
                     scope=summary_of.scope if summary_of is not None else None, held=summary[1],
                     sent=sent if isinstance(sent, set | frozenset) else set(sent), pending=pending)


def _salt(scope: str | None, cache_salt: object, account_id: str) -> str | None:
    """salt_for, a worker without a summary taken as scope `account` (the prefix cache's default)."""
    sc: Scope = scope if scope in SCOPES else "account"
    return salt_for(sc, cache_salt if isinstance(cache_salt, str) else None, account_id)


def _int(v: object, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default


@dataclass
class FleetView:
    """What this Tracker knows of the fleet between two reads of it (`read_at`, monotonic): the workers, their
    Candidates (built once per read: heartbeat ages as of the read, so a worker goes stale at most
    discover_cache_s late), and per worker the wall times of the sessions placed there (load until a heartbeat
    newer than them: the next read counts them again), the prompt block ids sent there (SentPrompts,
    the last prompts of SUMMARY_MAX_IDS ids: the next session with the same system prompt follows it before the
    worker's summary says so) and the counters `dgr inspect` and the bench show."""

    workers: list[WorkerInfo] = field(default_factory=list)
    by_id: dict[str, WorkerInfo] = field(default_factory=dict)  # the same, by worker id
    read_at: float = -math.inf
    # When a plan of this Tracker began the fleet read in flight (None: none): the asynchronous driver's openings
    # of one loop turn all find the fleet stale at once, and each read it (64 requests of `dgr serve` at once: 64
    # reads of every heartbeat and advertisement where one serves them all).
    reading: float | None = None
    candidates: dict[str, Candidate] = field(default_factory=dict)
    pools: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # digests -> worker ids advertising
    placed_at: dict[str, list[float]] = field(default_factory=dict)
    sent: dict[str, SentPrompts] = field(default_factory=dict)  # per worker
    process: dict[str, tuple[object, object]] = field(default_factory=dict)  # per worker: (pid, started_at) it beat
    placed: dict[str, int] = field(default_factory=dict)  # sessions placed, per worker
    refused_full: dict[str, int] = field(default_factory=dict)  # eligible, but passed over: full
    refused_slot: dict[str, int] = field(default_factory=dict)  # openings it refused for want of a slot (re-placed)
    last: dict[str, Choice] = field(default_factory=dict)  # per worker: the last choice of it
    lost: dict[str, float] = field(default_factory=dict)  # worker -> wall time it was found out (producer/moves.py)
    moved_in: dict[str, int] = field(default_factory=dict)
    moved_out: dict[str, int] = field(default_factory=dict)
    # A hop key's (prefill, decode) digests, by the key object (held, so its id is not reused): a digest is a
    # JSON dump and a SHA-256, the most of a placement's cost after choose() when taken per session.
    key_digests: dict[int, tuple[CompatibilityKey, tuple[str, str]]] = field(default_factory=dict)
    # digests -> the (block_tokens, scope) of the pool's workers that may hold a prompt's blocks (a summary, or
    # ids this Tracker sent a worker without one: (0, None)); kept up to date by note(), cleared by load().
    groups: dict[tuple[str, str], set[tuple[int, str | None]]] = field(default_factory=dict)
    indexes: dict[tuple[str, str], PoolIndex] = field(default_factory=dict)  # digests -> its pool's index
    # A prompt's block ids, its shared leading blocks taken from the last prompt that started the same way: the
    # most of a placement's cost when hashed whole each time (docs/placement.md, "Cost").
    block_ids: BlockIdMemo = field(default_factory=BlockIdMemo)
    summaries: SummaryCache = field(default_factory=SummaryCache)  # the workers' prefix summaries, parsed
    roots: dict[tuple[str, str], bytes] = field(default_factory=dict)  # (key digest, salt) -> prefix_root
    hops: dict[tuple[str, int], RouteHop] = field(default_factory=dict)  # (worker, id(key)) -> route_hop
    # (pool digests, cache salt, account) -> group_roots: cleared with the groups
    group_roots_of: dict[tuple[tuple[str, str], str | None, str],
                         list[tuple[tuple[int, str | None], bytes | None]]] = field(default_factory=dict)
    # Prompt rows placed and not computed yet (Candidate.pending): session -> (monotonic time placed, its hops'
    # (worker, rows not cached there)), until its first token (`started`); per worker, their sum.
    prefilling: dict[str, tuple[float, list[tuple[str, int]]]] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)

    def digests(self, key: CompatibilityKey) -> tuple[str, str]:
        got = self.key_digests.get(id(key))
        if got is not None and got[0] is key:
            return got[1]
        if len(self.key_digests) >= 256:
            self.key_digests.clear()
        d = (key.for_phase("prefill").digest, key.for_phase("decode").digest)
        self.key_digests[id(key)] = (key, d)
        return d

    def route_hop(self, worker_id: str, key: CompatibilityKey) -> RouteHop:
        """RouteHop(worker_id, key), kept (immutable: one per worker and key, not a validation per session)."""
        got = self.hops.get((worker_id, id(key)))
        if got is None or got.key is not key:
            if len(self.hops) >= 4096:
                self.hops.clear()
            got = self.hops[(worker_id, id(key))] = RouteHop(worker_id=worker_id, key=key)
        return got

    def root(self, key_digest: str, salt: str) -> bytes:
        """prefix_root(key_digest, salt), kept (a SHA-256 and two encodes per session otherwise; bounded: one
        salt per account under scope `account`)."""
        got = self.roots.get((key_digest, salt))
        if got is None:
            if len(self.roots) >= 4096:
                self.roots.clear()
            got = self.roots[(key_digest, salt)] = prefix_root(key_digest, salt)
        return got

    def load(self, workers: list[WorkerInfo], read_at: float, now: float | None = None) -> None:
        self.workers, self.read_at, self.pools, self.groups, self.indexes = workers, read_at, {}, {}, {}
        self.by_id = {w.worker_id: w for w in workers}
        self.group_roots_of = {}
        self.summaries.keep(w.worker_id for w in workers if w.alive)
        self._forget_sent(workers)
        self._forget_prefilling(time.monotonic() - PENDING_MAX_S)
        # a worker without a heartbeat is never eligible: no candidate (the index keeps every id that ever
        # advertised, thousands gone for good where each pod has its own)
        self.candidates = {w.worker_id: candidate(w, self.since_beat(w), self._sent_ids(w.worker_id), now,
                                                  self.summaries.get(w.worker_id, w.heartbeat.get("prefix")),
                                                  self.pending.get(w.worker_id, 0))
                           for w in workers if w.alive}
        for w in workers:
            ts = w.heartbeat.get("ts")
            if w.worker_id in self.lost and not (isinstance(ts, int | float) and ts > self.lost[w.worker_id]):
                self.lose(w.worker_id, self.lost[w.worker_id])  # out until it beats again
            elif w.worker_id in self.lost:
                del self.lost[w.worker_id]

    def _forget_sent(self, workers: list[WorkerInfo]) -> None:
        """The prompts sent to a worker are held there only by the process they were sent to: forgotten when its
        heartbeat names another (pid, started_at: a restart, its prefix cache empty) and when it beats no more
        (a process gone; and a Tracker's memory bounded by the workers that beat, not every id ever placed on)."""
        process = {w.worker_id: (w.heartbeat.get("pid"), w.heartbeat.get("started_at")) for w in workers if w.alive}
        for w in [w for w in self.sent if process.get(w) != self.process.get(w) or w not in process]:
            del self.sent[w]
        self.process = process

    def _forget_prefilling(self, before: float) -> None:
        """Sessions placed before `before` whose first token was never read here (a session driven by hand whose
        caller stopped reading): no longer counted as pending."""
        for sid in [sid for sid, (at, _) in self.prefilling.items() if at < before]:
            self.started(sid)

    def started(self, session_id: str) -> None:
        """The session's prompt is computed (its first token was read), or it ended or moved: its rows are no
        longer pending on its workers."""
        got = self.prefilling.pop(session_id, None)
        if got is None:
            return
        for w, rows in got[1]:
            left = self.pending.get(w, 0) - rows
            if left > 0:
                self.pending[w] = left
            else:
                self.pending.pop(w, None)
            c = self.candidates.get(w)
            if c is not None:
                self.candidates[w] = new = msgspec.structs.replace(c, pending=max(0, left))
                for index in self.indexes.values():
                    index.update(new)

    def _sent_ids(self, worker_id: str) -> set[str]:
        sent = self.sent.get(worker_id)
        return sent.ids() if sent is not None else set()

    def lose(self, worker_id: str, at: float) -> None:
        """The worker is out (no placement on it) until a heartbeat newer than `at`."""
        self.lost[worker_id] = at
        c = self.candidates.get(worker_id)
        if c is not None:
            self.candidates[worker_id] = msgspec.structs.replace(c, heartbeat_age_s=None)
            self.indexes = {}  # it is no longer eligible: built again on the next placement

    def pool(self, digests: tuple[str, str]) -> list[Candidate]:
        ids = self.pools.get(digests)
        if ids is None:
            ids = self.pools[digests] = [w for w, c in self.candidates.items()
                                         if digests[0] in c.digests and digests[1] in c.digests]
        return [self.candidates[w] for w in ids]

    def pool_groups(self, digests: tuple[str, str]) -> set[tuple[int, str | None]]:
        got = self.groups.get(digests)
        if got is None:
            got = self.groups[digests] = {(c.block_tokens, c.scope) if c.block_tokens is not None else (0, None)
                                          for c in self.pool(digests) if c.block_tokens is not None or c.held or c.sent}
        return got

    def group_roots(self, digests: tuple[str, str], cache_salt: object,
                    account_id: str) -> list[tuple[tuple[int, str | None], bytes | None]]:
        """Each of the pool's groups (pool_groups) with the root a session's blocks hash from there (None: not
        cached under its scope), kept per (pool, cache salt, account) until the groups change: a salt and a dictionary
        lookup per group and session otherwise."""
        k = (digests, cache_salt if isinstance(cache_salt, str) else None, account_id)
        got = self.group_roots_of.get(k)
        if got is None:
            if len(self.group_roots_of) >= 4096:
                self.group_roots_of.clear()
            got = []
            for bt, scope in self.pool_groups(digests):
                # a worker without a summary yet: what this Tracker sent it, at the default block size and scope
                salt = _salt(scope, k[1], account_id)
                got.append(((bt, scope), None if salt is None else self.root(digests[0], salt)))
            self.group_roots_of[k] = got
        return got

    def choose(self, digests: tuple[str, str], policy: PlacementPolicy,
               ids_for: Mapping[tuple[int, str | None], Sequence[str]]) -> tuple[Choice | None, list[str]]:
        """choose() over the pool (through its index: the same Choice), and the eligible full workers."""
        if policy.overlap_weight < 0:  # the index needs a held block never to cost more (producer/pool_index.py)
            cands = self.pool(digests)
            return choose(cands, digests, policy, ids_for), [c.worker_id for c in cands if c.load >= c.slots
                                                              and eligible(c, digests, policy)]
        index = self.indexes.get(digests)
        if index is None or index.policy is not policy:
            index = self.indexes[digests] = PoolIndex(self.pool(digests), digests, policy)
        return index.choose(ids_for), index.full()

    def since_beat(self, w: WorkerInfo) -> int:
        ts = w.heartbeat.get("ts")
        beat = float(ts) if isinstance(ts, int | float) else -math.inf
        times = [t for t in self.placed_at.get(w.worker_id, ()) if t > beat]
        self.placed_at[w.worker_id] = times
        return len(times)

    def note(self, choice: Choice, ids: Sequence[str], passed_full: Iterable[str], session_id: str = "",
             rows: int = 0) -> None:
        """A session placed on the choice's worker: its load, the prompt's block ids sent there, and `rows` of its
        prompt to compute there (pending until `started(session_id)`)."""
        w = choice.worker_id
        if session_id and rows > 0:
            got = self.prefilling.setdefault(session_id, (time.monotonic(), []))
            got[1].append((w, rows))
            self.pending[w] = self.pending.get(w, 0) + rows
        else:
            rows = 0
        self.placed_at.setdefault(w, []).append(time.time())
        self.placed[w] = self.placed.get(w, 0) + 1
        self.last[w] = choice
        sent_to = self.sent.get(w)
        if sent_to is None:
            sent_to = self.sent[w] = SentPrompts()
        sent_to.add(ids)
        c = self.candidates.get(w)
        if c is not None:
            sent = c.sent
            if ids:  # the candidate's own set (load() made it), or a new one for a candidate made without
                sent = sent if isinstance(sent, set) else set(sent)
                # its first cached_blocks ids it holds already (in its summary or sent before): the rest
                sent.update(ids[choice.cached_blocks:] if choice.cached_blocks else ids)
            self.candidates[w] = new = c.placed_one(sent, rows)
            own = (c.block_tokens or 0, c.scope)
            for index in self.indexes.values():
                index.update(new)
                if ids:
                    index.gained(w, own, ids[0])
            if c.block_tokens is None and ids:  # it may hold what it was sent now
                for digests, group in self.groups.items():
                    if w in self.pools.get(digests, ()) and (0, None) not in group:
                        group.add((0, None))
                        self.group_roots_of = {}
        for o in passed_full:
            self.refused_full[o] = self.refused_full.get(o, 0) + 1

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per worker: sessions placed, passed over because full, openings it refused for want of a slot, moved in
        and out, the last choice's score inputs."""
        out: dict[str, dict[str, Any]] = {}
        for w in sorted(set(self.placed) | set(self.refused_full) | set(self.refused_slot) | set(self.moved_in)
                        | set(self.moved_out)):
            last = self.last.get(w)
            out[w] = {"placed": self.placed.get(w, 0), "refused_full": self.refused_full.get(w, 0),
                      "refused_slot": self.refused_slot.get(w, 0),
                      "moved_in": self.moved_in.get(w, 0), "moved_out": self.moved_out.get(w, 0),
                      "lost": w in self.lost,
                      "last": None if last is None else {
                          "cost": round(last.cost, 4), "cached_blocks": last.cached_blocks,
                          "prompt_blocks": last.prompt_blocks, "load": last.load, "room": last.room,
                          "guarded": last.guarded}}
        return out


class Placer:
    """The placement plans of the core (a mixin of ProducerCore, which owns `workers()`)."""

    settings: ProducerSettings
    fleet: FleetView
    policy: PlacementPolicy

    def workers(self) -> Plan[list[WorkerInfo]]:
        raise NotImplementedError

    def fleet_now(self) -> Plan[list[WorkerInfo]]:
        """The fleet, read again when older than discover_cache_s: by one plan at a time. The others meanwhile take
        the fleet as last read (older by the read's round trip), or, before any, wait for that read (up to
        FLEET_READ_WAIT_S, then read it themselves: a read whose plan was dropped unfinished holds no one)."""
        fleet = self.fleet
        now = time.monotonic()
        if now - fleet.read_at <= self.settings.discover_cache_s:
            return fleet.workers
        if fleet.reading is not None and now - fleet.reading < FLEET_READ_WAIT_S:
            while fleet.read_at == -math.inf and fleet.reading is not None \
                    and time.monotonic() - fleet.reading < FLEET_READ_WAIT_S:
                yield Sleep(FLEET_READ_POLL_S)
            if fleet.read_at > -math.inf:
                return fleet.workers
        fleet.reading = began = time.monotonic()
        try:
            workers = yield from self.workers()
        finally:
            if fleet.reading == began:
                fleet.reading = None
        fleet.load(workers, time.monotonic())
        return fleet.workers

    def place(self, template: SessionTemplate, prompt: Sequence[int]) -> Plan[SessionSpec]:
        """The template's SessionSpec, each hop on the worker `choose()` picks among those advertising its
        keys. LookupError when a hop has no eligible worker (none advertises the key, or every one that does is
        stale or draining)."""
        if not isinstance(template, SessionTemplate):
            raise TypeError(f"template must be a SessionTemplate, not {type(template).__name__}")
        yield from self.fleet_now()
        return self.place_loaded(template, prompt)

    def place_loaded(self, template: SessionTemplate, prompt: Sequence[int]) -> SessionSpec:
        """`place` on the fleet as last read (no I/O; the micro-benchmark times this)."""
        workers = cast("list[str]", self.place_hops(template, prompt))  # every hop placed (hops=None): no None
        return template.spec(workers, self.fleet.route_hop)

    def place_hops(self, template: SessionTemplate, prompt: Sequence[int], *, need_room: bool = False,
                   hops: Iterable[int] | None = None) -> list[str | None]:
        """The worker of each hop (`hops`: only these; None for the others). LookupError when a hop has no
        eligible worker, or (`need_room`) none with room. Counted as placed only once every hop has one."""
        chosen: list[str | None] = []
        cache_salt = template.options.get("cache_salt")
        only = None if hops is None else set(hops)
        choices: list[tuple[Choice, list[str], list[str], int]] = []
        for k, key in enumerate(template.keys):
            if only is not None and k not in only:
                chosen.append(None)
                continue
            digests = self.fleet.digests(key)
            # a loop, not a comprehension: in Python 3.11 that is a function made and called per session
            ids_for: dict[tuple[int, str | None], list[str]] = {}
            for group, root in self.fleet.group_roots(digests, cache_salt, template.account_id):
                ids_for[group] = [] if root is None else self.fleet.block_ids(prompt, root, group[0] or BLOCK_TOKENS)
            choice, full_now = self.fleet.choose(digests, self.policy, ids_for)
            if choice is None:
                hop = "" if len(template.keys) == 1 else f" for hop {k}"
                raise LookupError(f"no worker to place session {template.session_id!r} on{hop}: none that beats "
                                  f"within {self.policy.stale_s} s, is not draining and advertises {digests[0]}")
            picked = self.fleet.candidates[choice.worker_id]
            bt, scope = (picked.block_tokens, picked.scope) if picked.block_tokens is not None else (0, None)
            ids = ids_for.get((bt, scope))
            if ids is None:
                salt = _salt(scope, cache_salt, template.account_id)
                root = self.fleet.root(digests[0], salt) if salt is not None else b""
                ids = self.fleet.block_ids(prompt, root, bt or BLOCK_TOKENS) if salt is not None else []
            if need_room and choice.room <= 0:
                raise LookupError(f"no worker with room for session {template.session_id!r}")
            full = [w for w in full_now if w != choice.worker_id] if full_now else full_now
            # the rows the worker computes: the prompt past the blocks it holds
            rows = len(prompt) - choice.cached_blocks * (picked.block_tokens or BLOCK_TOKENS)
            choices.append((choice, ids, full, rows))
            chosen.append(choice.worker_id)
        if template.session_id in self.fleet.prefilling:  # placed again (a move): its rows pending before are not
            self.fleet.started(template.session_id)
        for choice, ids, full, rows in choices:  # counted once every hop found its worker
            self.fleet.note(choice, ids, full, template.session_id, rows)
        return chosen
