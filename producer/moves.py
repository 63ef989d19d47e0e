"""Sessions outlive their worker (docs/placement.md, "Worker loss"): a worker whose heartbeat is older than
`PlacementPolicy.lost_s` (or gone: the key expires) is out; every placed session (opened from a
SessionTemplate) with a hop on it is placed again, hop by hop, on a worker that advertises the same key, and
replayed there as after `state_lost`: a new attempt, prompt + generated as prefill, the generated part charged
as `recomputed_tokens` by the new worker (docs/accounting.md). What the lost worker charged stays charged; its
answers to the old attempt are ignored (job ids carry the attempt), and a cancel and a fence of the attempt
are left on it, so a worker that was only paused and comes back frees the session instead of decoding it on,
and what it computes before it reads the cancel is neither published nor charged (consumer/lua/complete.lua).

A placed session whose opening a worker refuses for want of a slot (the fleet is full, as after a worker's loss,
or the worker was fuller than the Tracker's view of it) waits for room the same way: every `lost_check_s` it is
placed again on a worker with room and replayed there (a new attempt, which costs no `max_attempts`), or ends
`rejected` (capacity) once it waited `PlacementPolicy.room_wait_s`.

Only sessions the Tracker placed move: a SessionSpec naming its workers is the caller's choice, and still ends
with ResultTimeout when its worker goes silent. Sessions move away from a worker that is out, never back, so a
flapping worker cannot make them bounce; a worker declared out is not placed on again until it beats anew.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from schemas import PHASES, Reason, WorkerKeys
from schemas.accounting import parse_tally

from .commands import Batch, Exists, Expire, Get, HGet, HSet, Plan, PTtl, Read
from .placement import FleetView, PlacementPolicy, SessionTemplate
from .session import HopLeg, SessionHandle, end, lose, restore
from .validate import beat_on_this_clock

if TYPE_CHECKING:
    from .settings import ProducerSettings

__all__ = ["HighWater", "Mover", "worker_out"]

log = logging.getLogger("dgr.producer")


def worker_out(hb_raw: bytes | str | None, hb_pttl: object, now: float, lost_s: float) -> bool:
    """A heartbeat that is gone, unreadable, or older than lost_s (its age on Redis' clock when the heartbeat says
    its TTL: schemas/heartbeat.py)."""
    if hb_raw is None:
        return True
    _, age = beat_on_this_clock(hb_raw, hb_pttl, now)
    return age is None or age > lost_s


@dataclass(frozen=True)
class HighWater:
    """A moved session's charged high-water mark as the Tracker knows it, the lost workers it left (`off`) and
    the workers its new hops run on (`to`)."""

    session_id: str
    hw: int
    off: tuple[str, ...]
    to: tuple[str, ...]


class Mover:
    """The worker-loss plan of the core (a mixin of ProducerCore)."""

    settings: ProducerSettings
    fleet: FleetView
    policy: PlacementPolicy
    driven: dict[str, SessionHandle]
    touched: dict[str, SessionHandle]
    checked_at: float
    waiting: dict[str, float]
    waited_at: float

    def fleet_now(self) -> Plan[Any]:
        raise NotImplementedError

    def place_hops(self, template: SessionTemplate, prompt: Any, *, need_room: bool = False,
                   hops: Any = None) -> list[str | None]:
        raise NotImplementedError

    def retire(self, h: SessionHandle) -> None:
        raise NotImplementedError

    def drive(self, h: SessionHandle, run: Any) -> None:
        raise NotImplementedError

    def cancel_ops(self, batch: Batch, worker_id: str, session_id: str) -> None:
        raise NotImplementedError

    def move_lost(self) -> Plan[list[SessionHandle]]:
        """Every `lost_check_s`: read the heartbeats of the workers placed sessions run on; move the sessions of
        those that are out (queued as touched: the advance that follows replays them). The sessions moved."""
        now = time.monotonic()
        if now - self.checked_at < self.policy.lost_check_s:
            return []
        self.checked_at = now
        placed = [h for h in self.driven.values() if h.template is not None and not h.finished]
        watched = sorted({leg.worker_id for h in placed for leg in h.legs})
        if not watched:
            return []
        beats = yield Read(tuple(c for w in watched for c in (Get(WorkerKeys(w).heartbeat),
                                                              PTtl(WorkerKeys(w).heartbeat))))
        wall = time.time()
        out = {w for i, w in enumerate(watched) if worker_out(beats[2 * i], beats[2 * i + 1], wall, self.policy.lost_s)}
        if not out:
            return []
        for w in out:
            self.fleet.lose(w, wall)
        self.fleet.read_at = float("-inf")  # read the fleet again before placing anywhere
        yield from self.fleet_now()
        for w in out:
            self.fleet.lose(w, wall)
        moved: list[SessionHandle] = []
        marks: list[HighWater] = []
        fence = Batch()
        # A session waiting for room never opened on the worker that refused it: place_waiting places it, not a move
        # (no cancel, fence or moved_out there); a hop it did open on a lost worker still moves it.
        on_out = [h for h in placed if any(leg.worker_id in out for leg in h.legs
                                           if not (h.status == "awaiting_room" and leg.hop == h.waiting_hop))]
        cancelled = yield from self.cancel_marked(on_out)  # a cancel sent to the lost worker: not moved, ended
        for k, h in enumerate(on_out):
            if k in cancelled:
                self.end_now(h, "cancelled", Reason.CANCELLED, "cancelled on a worker that was lost")
                continue
            mark = self.move(h, out, fence)
            if mark is not None:
                moved.append(h)
                marks.append(mark)
        if fence:
            yield fence
        if marks:
            yield from self.carry_high_water(marks)
        if moved:
            log.warning("sessions moved off lost workers", extra={"workers": sorted(out), "sessions": len(moved)})
        return moved

    def move(self, h: SessionHandle, out: set[str], fence: Batch) -> HighWater | None:
        """Place the session's hops on lost workers again and mark it lost (the next advance replays it); a cancel
        and a fence of its attempt for each lost worker go in `fence`. Its high-water mark for the new hops, or
        None when no worker with room can take a hop: it waits for the next look (and ends with ResultTimeout if
        none comes within timeout_s)."""
        template: SessionTemplate = h.template
        hops = [leg.hop for leg in h.legs if leg.worker_id in out]
        try:  # a worker with room only (a full one would refuse the replay): else it waits for the next look
            placed = self.place_hops(template, h.prompt, need_room=True, hops=hops)
        except LookupError as e:
            log.info("a session of a lost worker waits for room", extra={"session": h.session_id,
                                                                         "detail": str(e)[:200]})
            return None
        keep = [w if w is not None else leg.worker_id for leg, w in zip(h.legs, placed, strict=True)]
        spec = template.spec(keep)
        keep_workers = {leg.worker_id for leg in h.legs if leg.worker_id not in out}
        lost_legs = {leg.worker_id for leg in h.legs if leg.worker_id in out}
        run = h.run
        self.retire(h)
        for leg in h.legs:
            if leg.worker_id in out:
                self.fleet.moved_out[leg.worker_id] = self.fleet.moved_out.get(leg.worker_id, 0) + 1
                self.cancel_ops(fence, leg.worker_id, h.session_id)
                # Fences the attempt it ran there: should the worker only have paused, what it computes for the
                # session before it reads the cancel is neither published nor charged (docs/accounting.md).
                moved_key = WorkerKeys(leg.worker_id).moved
                fence.add(HSet(moved_key, {h.session_id: str(h.attempt)}))
                fence.add(Expire(moved_key, self.settings.cancel_ttl_s))
        for w in _rehome(h, spec):
            self.fleet.moved_in[w] = self.fleet.moved_in.get(w, 0) + 1
        legs = h.legs
        # The new hops charge nothing the lost one charged: their high-water mark starts where its ended (every
        # token the Tracker holds was charged when sampled; with none, the prompt positions charged so far), or
        # higher where the lost worker charged answers the Tracker has not read (carry_high_water).
        tokens = restore(h)  # a replay decoding them again may be amid them: the caller had them all
        hw = len(h.prompt) + len(tokens) if tokens else h.prompt_tokens
        mark = HighWater(h.session_id, hw, off=tuple(sorted(w for w in out if w in lost_legs)),
                         to=tuple(leg.worker_id for leg in legs if leg.worker_id not in keep_workers))
        h.reason, h.detail = "worker_lost", f"moved off {', '.join(sorted(out))}"
        h.carried = mark
        lose(h)
        self.drive(h, run)
        self.touched[h.session_id] = h
        return mark

    def place_waiting(self) -> Plan[None]:
        """Every `lost_check_s`: each session refused for want of a slot placed again on a worker with room (the
        hop refused), then replayed (queued as touched); ended cancelled when its caller cancelled it meanwhile,
        or rejected once it waited room_wait_s. A moved session's high-water mark goes to its new hop too (so a
        position its lost worker charged is charged nowhere else)."""
        now = time.monotonic()
        if not self.waiting or now - self.waited_at < self.policy.lost_check_s:
            return
        self.waited_at = now
        yield from self.fleet_now()
        for sid in [sid for sid in self.waiting if (h := self.driven.get(sid)) is None or h.status != "awaiting_room"]:
            del self.waiting[sid]  # ended, retired, or moved off a lost worker meanwhile
        hs = [self.driven[sid] for sid in self.waiting]
        marked = yield from self.cancel_marked(hs)
        marks: list[HighWater] = []
        for k, h in enumerate(hs):
            since = self.waiting.pop(h.session_id)
            if k in marked:
                self.end_now(h, "cancelled", Reason.CANCELLED, "cancelled while it waited for room")
                continue
            try:
                placed = self.place_hops(h.template, h.prompt, need_room=True, hops=[h.waiting_hop])
            except LookupError as e:
                if now - since < self.policy.room_wait_s:
                    self.waiting[h.session_id] = since
                else:
                    self.end_now(h, "rejected", Reason.CAPACITY,
                                 f"no worker with room within {self.policy.room_wait_s} s: {e}"[:300])
                continue
            mark = self.place_again(h, placed)
            if mark is not None:
                marks.append(mark)
        if marks:
            yield from self.carry_high_water(marks)

    def place_again(self, h: SessionHandle, placed: list[str | None]) -> HighWater | None:
        """A waiting session on the workers `placed` names (None: the hop stays), to be replayed there on a new
        attempt that costs no max_attempts; the high-water mark a move gave it, for its new hops."""
        run = h.run
        self.retire(h)
        new = _rehome(h, h.template.spec([w if w is not None else leg.worker_id
                                          for leg, w in zip(h.legs, placed, strict=True)]))
        h.room_waits += 1
        lose(h)
        self.drive(h, run)
        self.touched[h.session_id] = h
        c = h.carried
        return HighWater(h.session_id, c.hw, c.off, tuple(new)) if c is not None and new else None

    def end_now(self, h: SessionHandle, status: str, reason: Reason, detail: str) -> None:
        """End a session the Tracker decided about (no worker answered it so): queued as touched, released."""
        end(h, status, detail)
        h.reason = reason.value
        self.touched[h.session_id] = h

    def cancel_marked(self, hs: list[SessionHandle]) -> Plan[set[int]]:
        """The indexes of the sessions whose cancel marker is set on a worker they were placed on (a cancel while
        one waited for room names those workers, not the one it goes to next). One pipeline."""
        asked = [(k, WorkerKeys(w).cancel_marker(h.session_id)) for k, h in enumerate(hs)
                 for w in sorted({leg.worker_id for leg in h.legs})]
        if not asked:
            return set()
        replies = yield Read(tuple(Exists(key) for _, key in asked))
        return {k for (k, _), m in zip(asked, replies, strict=True) if m}

    def carry_high_water(self, marks: list[HighWater]) -> Plan[None]:
        """Each moved session's high-water mark on its new hops: the higher of what the Tracker holds and what a
        lost worker's tally says it charged. Read after the fence is written, so every completion of a lost
        worker either ran before (its charges are in the tally read here) or after (fenced: it charged nothing),
        and no position is charged on two workers (docs/accounting.md, "Across workers")."""
        reads = [(m, w) for m in marks for w in m.off]
        tallies = yield Read(tuple(HGet(WorkerKeys(w).tally, m.session_id) for m, w in reads), errors=True)
        hw = {m.session_id: m.hw for m in marks}
        for (m, _), raw in zip(reads, tallies, strict=True):
            entry = parse_tally(raw) if isinstance(raw, bytes | str) else None
            if entry is not None:
                hw[m.session_id] = max(hw[m.session_id], int(entry["hw"]))
        batch = Batch()
        for m in marks:
            for w in m.to:
                batch.add(HSet(WorkerKeys(w).session_account(m.session_id), {"hw": str(hw[m.session_id])}))
        if batch:
            yield batch


def _rehome(h: SessionHandle, spec: Any) -> list[str]:
    """The session's hops on the workers `spec` routes it to (a hop on the same worker keeps its leg); the workers
    of the hops that changed."""
    legs, new = [], []
    for k, (leg, rh) in enumerate(zip(h.legs, spec.route, strict=True)):
        if leg.worker_id == rh.worker_id:
            legs.append(leg)
        else:
            new.append(rh.worker_id)
            legs.append(HopLeg(k, rh.worker_id, {p: rh.key.for_phase(p).digest for p in PHASES}))
    h.spec, h.legs, h.worker_id = spec, legs, spec.route[0].worker_id
    return new
