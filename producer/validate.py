"""What is checked before anything is written: the arguments of the public methods (wrong input fails here, with a
message that says what is wrong: an id that is not an id could build a key outside the worker's hash tag; a token
past the vocabulary only comes back as a rejection), what the route's workers advertise (`TrackerAdmission.discover`),
and backpressure (`TrackerAdmission.admit`). The core is a `TrackerAdmission`."""

from __future__ import annotations

import json
import logging
import numbers
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from schemas import CompatibilityKey, Reason, SessionSpec, WireError, WorkerKeys
from schemas.heartbeat import heartbeat_age, spec_version
from schemas.keys import WORKERS_INDEX
from schemas.lag import stream_lag
from schemas.limits import MAX_POSITION, MAX_TOKEN_ID, WIRE_VERSION, is_id
from schemas.prefix import PrefixSummary

from .commands import Exists, Get, MGet, Plan, PTtl, Read, Sleep, SMembers, XInfoGroups, XLen
from .errors import Backpressure
from .session import SessionHandle

log = logging.getLogger("dgr.producer")

if TYPE_CHECKING:
    from .settings import ProducerSettings

__all__ = ["TrackerAdmission", "WorkerInfo", "check_id", "check_joins", "check_token", "check_tokens", "vocab_size"]


def check_id(value: object, what: str) -> str:
    """`value` if it is a whole id (schemas.limits.is_id), else ValueError (TypeError if not a str)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if not is_id(value):
        raise ValueError(f"{what} {value[:80]!r} is not an id: 1-64 ASCII letters, digits, '_', '.', '-', "
                         "starting with a letter or digit")
    return value


def check_token(value: object, vocab: int | None, what: str = "token") -> int:
    """A token id as a plain int: any integer type (numpy's included, bool not), in [0, vocab)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}")
    t = int(value)
    top = min(MAX_TOKEN_ID + 1, vocab) if vocab else MAX_TOKEN_ID + 1
    if not 0 <= t < top:
        raise ValueError(f"{what} {t} is outside [0, {top})" + (" (the worker's vocabulary)" if vocab else ""))
    return t


# The last tuple of plain ints check_tokens passed, with its least and greatest: an opening checks its prompt four
# times (placement, its shape twice, the worker's vocabulary), and the three passes in C over 512 ids cost about
# 30 µs each time. A tuple cannot change, and the one held here cannot be another's while it is held.
_last_checked: tuple[tuple[int, ...], int, int] = ((), 0, 0)


def check_tokens(values: Iterable[object], vocab: int | None, what: str = "prompt") -> tuple[int, ...]:
    """check_token of each, as a tuple. Plain ints (what a tokenizer gives) are checked in C: their types, their
    least and greatest; a prompt of 512 took 400 µs one by one. The tuple returned, checked again, is not passed
    over again (`_last_checked`)."""
    global _last_checked
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of token ids, not {type(values).__name__}")
    toks = values if isinstance(values, tuple) else tuple(values)
    if not toks:
        return ()
    checked = _last_checked
    if checked[0] is toks or list(map(type, toks)).count(int) == len(toks):  # 13 us for 512, a set of types 19
        ints = cast("tuple[int, ...]", toks)
        if checked[0] is not ints:
            checked = _last_checked = (ints, min(ints), max(ints))
        if checked[1] >= 0 and checked[2] < (min(MAX_TOKEN_ID + 1, vocab) if vocab else MAX_TOKEN_ID + 1):
            return ints
    # anything else (numpy integers, a bool, a token out of range): one by one, the first bad one named
    return tuple(check_token(v, vocab, f"{what} tokens[{i}]") for i, v in enumerate(toks))


def vocab_size(info: dict[str, Any] | None, digest: str | None = None) -> int | None:
    """The vocabulary a worker advertises (its spec's info), when it does: of the engine whose keys
    include `digest` when the worker holds several (`engines`, docs/state-layouts.md), else its own."""
    info = info or {}
    engines = info.get("engines")
    if digest is not None and isinstance(engines, list):
        info = next((e for e in engines if isinstance(e, dict) and digest in (e.get("digests") or {}).values()), info)
    v = info.get("vocab_size")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def check_joins(spec: SessionSpec) -> None:
    """Hop 0 takes tokens, every later hop the previous hop's activations (same blocks boundary, hidden size,
    dtype); only the last produces logits."""
    for k, rh in enumerate(spec.route):
        b = rh.key.boundary
        if k > 0 and b.consumes != "hidden":
            raise ValueError(f"hop {k} of the route must consume hidden activations, not {b.consumes}")
        if (b.produces == "logits") != (k == len(spec.route) - 1):
            raise ValueError(f"hop {k} produces {b.produces}: only the last hop may produce logits")
        if k > 0:
            prev = spec.route[k - 1].key.boundary
            if prev.last_layer != b.first_layer or prev.hidden_size != b.hidden_size or prev.dtype != b.dtype:
                raise ValueError(f"hop {k - 1} and hop {k} do not join (blocks, hidden size or dtype differ)")


@dataclass
class WorkerInfo:
    """A worker's advertisement: its compatibility keys and info, and its heartbeat."""

    worker_id: str
    keys: list[CompatibilityKey]
    info: dict[str, Any]
    alive: bool  # the heartbeat key exists (it expires ~10 s after the last beat)
    heartbeat_age_s: float | None
    heartbeat: dict[str, Any] = field(default_factory=dict)
    draining: bool = False  # `dgr ops drain` set its drain key (read by workers(): placement skips it)

    @cached_property
    def digests(self) -> frozenset[str]:
        """Its keys' digests, once (an opening checks its route against them; a fleet read makes new infos)."""
        return frozenset(k.digest for k in self.keys)

    def check_wire(self) -> WorkerInfo:
        """Itself, when it speaks this producer's wire version; a worker advertising another (or none) is refused
        by name (reason schema_version), never driven silently."""
        v = self.info.get("wire_version")
        if v != WIRE_VERSION:
            raise WireError(Reason.SCHEMA_VERSION, f"worker {self.worker_id!r} speaks wire version {v!r}, this "
                                                   f"producer {WIRE_VERSION} (docs/wire-format.md)")
        return self

    @staticmethod
    def parse(worker_id: str, spec_raw: bytes | str | None, hb_raw: bytes | str | None,
              hb_pttl: object = None) -> WorkerInfo | None:
        """From the worker's `spec` and heartbeat keys (and the heartbeat key's PTTL reply: its age on Redis'
        clock, schemas/heartbeat.py); None when it never advertised. The heartbeat's `ts` is put on this
        process's clock (now - its age), so that what compares it with this clock (placement's sessions placed
        since that beat, a lost worker beating again) never compares two hosts' clocks."""
        if spec_raw is None:
            return None
        spec = json.loads(spec_raw)
        keys = [CompatibilityKey.model_validate_json(json.dumps(k)) for k in spec.get("keys", [])]
        hb, age = beat_on_this_clock(hb_raw, hb_pttl)
        return WorkerInfo(worker_id=worker_id, keys=keys, info=dict(spec.get("info", {})),
                          alive=hb_raw is not None, heartbeat_age_s=age, heartbeat=hb)


def beat_on_this_clock(hb_raw: bytes | str | None, hb_pttl: object,
                       now: float | None = None) -> tuple[dict[str, Any], float | None]:
    """The heartbeat JSON (an object; {} when absent or not one) with its `ts` as this process's wall clock reads
    the moment it beat (the worker's own in `worker_ts`; no `ts` when its age cannot be told), and that age
    (schemas/heartbeat.py)."""
    try:
        hb = json.loads(hb_raw) if hb_raw is not None else {}
    except ValueError:
        hb = {}
    if not isinstance(hb, dict):
        hb = {}
    now = time.time() if now is None else now
    age = heartbeat_age(hb, hb_pttl, now)
    if "ts" in hb:
        hb["worker_ts"] = hb.pop("ts")
    if age is not None:
        hb["ts"] = now - age
    return hb, age


@dataclass(frozen=True)
class Advertisement:
    version: str  # schemas/heartbeat.py spec_version of the value it was parsed from
    keys: list[CompatibilityKey]
    info: dict[str, Any]


class Advertisements:
    """Each worker's advertisement (its `spec` key) as last read and parsed. A fleet read asks again only for the
    advertisements of workers that beat naming another version (or none: a worker from before) and of workers
    it never read; a worker that stopped beating keeps the one read last. So a fleet read costs O(workers that
    beat) in bytes and parsing, not O(every worker id ever registered), which only grows as workers come and go
    (1,000 gone beside 100 live: 166 ms a read before, 11 ms after; docs/placement.md)."""

    def __init__(self) -> None:
        self.last: dict[str, Advertisement | None] = {}  # None: the key is absent (never advertised)

    def to_read(self, ids: Sequence[str], beating: Sequence[bool], named: Sequence[object]) -> list[int]:
        """The indexes of the ids whose advertisement to read."""
        out = []
        for i, w in enumerate(ids):
            got = self.last.get(w)
            if w not in self.last or (beating[i] and (got is None or named[i] != got.version)):
                out.append(i)
        return out

    def take(self, worker_id: str, raw: bytes | str | None) -> None:
        if raw is None:
            self.last[worker_id] = None
            return
        version = spec_version(raw)
        got = self.last.get(worker_id)
        if got is None or got.version != version:
            try:
                spec = json.loads(raw)
                keys = [CompatibilityKey.model_validate_json(json.dumps(k)) for k in spec.get("keys", [])]
                self.last[worker_id] = Advertisement(version, keys, dict(spec.get("info", {})))
            except (ValueError, TypeError, AttributeError) as e:  # one worker's garbage never stops a fleet read
                log.warning("an unreadable advertisement: the worker advertises no key", extra={
                    "worker": worker_id, "error": str(e)[:200]})
                self.last[worker_id] = Advertisement(version, [], {})  # not parsed again until it changes

    def keep(self, worker_ids: Iterable[str]) -> None:
        """Only these (the index as read): an id taken out of it is forgotten."""
        keep = set(worker_ids)
        if len(keep) != len(self.last):  # every id read is in `last` by now (to_read, take): equal sizes, equal sets
            self.last = {w: v for w, v in self.last.items() if w in keep}


def _json_object(raw: bytes | str | None) -> dict[str, Any] | None:
    try:
        doc = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class TrackerAdmission:
    """The advertisement and backpressure checks: state (`discovered`, `lag`, `prefix_summaries`) and plans."""

    settings: ProducerSettings
    discovered: dict[str, tuple[float, WorkerInfo]]
    advertised: Advertisements
    prefix_summaries: dict[str, tuple[str, dict[str, Any]]]  # worker -> (version, its summary as read)
    lag: dict[str, tuple[float, int]]  # stream -> (monotonic time asked, lag)

    def discover(self, worker_id: str) -> Plan[WorkerInfo]:
        k = WorkerKeys(check_id(worker_id, "worker_id"))
        spec_raw, hb_raw, hb_pttl = yield Read((Get(k.spec), Get(k.heartbeat), PTtl(k.heartbeat)))
        info = WorkerInfo.parse(worker_id, spec_raw, hb_raw, hb_pttl)
        if info is None:
            raise LookupError(f"worker {worker_id!r} has not advertised (no {k.spec})")
        self.remember(info.check_wire())
        return info

    def workers(self) -> Plan[list[WorkerInfo]]:
        """Every worker that ever advertised, with its heartbeat. The index only grows as workers come and go (a
        new id per pod): every heartbeat in one MGET, then only for the workers that beat their heartbeat's TTL
        and drain key, then only the advertisements that changed (`Advertisements`). A fleet read of 100
        workers beside 5,000 gone for good: 892 ms before, 37 ms after (docs/placement.md)."""
        (ids,) = yield Read((SMembers(WORKERS_INDEX),))
        if not ids:
            return []
        keys = [WorkerKeys(w) for w in ids]
        (raw,) = yield Read((MGet(tuple(k.heartbeat for k in keys)),))
        live = [i for i, hb in enumerate(raw) if hb is not None]
        more = (yield Read(tuple(c for i in live for c in (PTtl(keys[i].heartbeat), Exists(keys[i].drain))))) \
            if live else []
        beats: dict[int, tuple[dict[str, Any], float | None, bool]] = {}
        for j, i in enumerate(live):
            hb, age = beat_on_this_clock(raw[i], more[2 * j])
            beats[i] = hb, age, bool(more[2 * j + 1])
        ask = self.advertised.to_read(ids, [i in beats for i in range(len(ids))],
                                      [beats[i][0].get("spec") if i in beats else None for i in range(len(ids))])
        if ask:
            specs = yield Read(tuple(Get(keys[i].spec) for i in ask))
            for i, spec in zip(ask, specs, strict=True):
                self.advertised.take(ids[i], spec)
        self.advertised.keep(ids)
        infos = []
        for i, w in enumerate(ids):
            got = self.advertised.last.get(w)
            if got is not None:
                hb, age, draining = beats.get(i, ({}, None, False))
                infos.append(WorkerInfo(worker_id=w, keys=list(got.keys), info=dict(got.info), alive=i in beats,
                                        heartbeat_age_s=age, heartbeat=hb, draining=draining))
        yield from self.prefix_summaries_of(infos)
        return infos

    def prefix_summaries_of(self, infos: list[WorkerInfo]) -> Plan[None]:
        """Each worker's prefix summary put in its heartbeat (`prefix`), read from its own key only when the
        version its heartbeat names is not the one last read (docs/wire-format.md): a fleet read of 100
        workers is 100 small heartbeats, not 100 summaries of up to ~135 kB. A version not found (the key
        lost, or a newer one written since the heartbeat) leaves the worker without one until a later read."""
        cache = self.prefix_summaries
        here = {i.worker_id for i in infos}
        for gone in [w for w in cache if w not in here]:
            del cache[gone]
        named = {i.worker_id: v for i in infos if (v := PrefixSummary.ref_version(i.heartbeat.get("prefix")))}
        need = [w for w, v in named.items() if cache.get(w, ("", {}))[0] != v]
        if need:
            raws = yield Read(tuple(Get(WorkerKeys(w).prefix_summary) for w in need))
            for w, raw in zip(need, raws, strict=True):
                doc = _json_object(raw)
                if doc is not None and doc.get("version") == named[w]:
                    cache[w] = (named[w], doc)
        for i in infos:
            if i.worker_id in named:
                got = cache.get(i.worker_id)
                if got is not None and got[0] == named[i.worker_id]:
                    i.heartbeat["prefix"] = got[1]  # the same object while unchanged (SummaryCache compares it)
                else:
                    del i.heartbeat["prefix"]

    def remember(self, info: WorkerInfo) -> None:
        self.discovered[info.worker_id] = (time.monotonic(), info)

    def to_discover(self, spec: SessionSpec) -> list[str]:
        """The route's workers whose advertisement must be (re)read before opening."""
        if not self.settings.verify_route:
            return []
        now = time.monotonic()
        stale = (rh.worker_id for rh in spec.route if rh.worker_id not in self.discovered
                 or now - self.discovered[rh.worker_id][0] > self.settings.discover_cache_s)
        return list(dict.fromkeys(stale))

    def opening(self, spec: SessionSpec, prompt: Sequence[int], hop: int = 0) -> Plan[SessionHandle]:
        """`new_handle`, the shape checked first, then the workers `to_discover` discovered."""
        toks = self.check_shape(spec, prompt, hop)
        for w in self.to_discover(spec):
            yield from self.discover(w)
        return self.new_handle(spec, toks, hop)

    def check_shape(self, spec: SessionSpec, prompt: Sequence[int], hop: int) -> tuple[int, ...]:
        """What can be checked without the workers' advertisements: types, hop, prompt, context, joins."""
        if not isinstance(spec, SessionSpec):
            raise TypeError(f"spec must be a SessionSpec, not {type(spec).__name__}")
        if isinstance(hop, bool) or not isinstance(hop, int) or not 0 <= hop < len(spec.route):
            raise ValueError(f"hop {hop!r} is not on the route ({len(spec.route)} hops)")
        toks = check_tokens(prompt, None)
        if not toks:
            raise ValueError("empty prompt")
        if spec.route[hop].key.boundary.consumes != "tokens":
            raise ValueError("this producer drives token-consuming hops only")
        check_joins(spec)
        ctx = spec.route[hop].key.recipe.ctx_per_session
        if len(toks) + spec.max_tokens > ctx:
            raise ValueError(f"prompt ({len(toks)}) + max_tokens ({spec.max_tokens}) over the context per session "
                             f"({ctx})")
        if len(toks) + spec.max_tokens > MAX_POSITION:
            raise ValueError("session longer than MAX_POSITION")
        return toks

    def new_handle(self, spec: SessionSpec, prompt: Sequence[int], hop: int = 0) -> SessionHandle:
        """A handle, once the prompt and route are checked (with verify_route, against the advertisements of
        every hop's worker, discovered first: `to_discover`)."""
        toks = self.check_shape(spec, prompt, hop)
        if self.settings.verify_route:
            for k, rh in enumerate(spec.route):
                digests = self.discovered[rh.worker_id][1].digests
                for phase in ("prefill", "decode"):
                    d = rh.key.for_phase(phase).digest
                    if d not in digests:
                        what = f"the route's {phase} key" if len(spec.route) == 1 else f"hop {k}'s {phase} key"
                        raise ValueError(f"worker {rh.worker_id!r} does not advertise {what} {d}")
        worker = spec.route[hop].worker_id
        toks = check_tokens(toks, self.vocab(worker, spec.route[hop].key.for_phase("prefill").digest))
        return SessionHandle(spec=spec, prompt=toks, worker_id=worker, hop=hop, reply=self.settings.tracker_id)

    def vocab(self, worker_id: str, digest: str | None = None) -> int | None:
        cached = self.discovered.get(worker_id)
        return vocab_size(cached[1].info, digest) if cached is not None else None

    @staticmethod
    def check_handles(handles: Iterable[object]) -> None:
        for h in handles:
            if not isinstance(h, SessionHandle):
                raise TypeError(f"handles must be SessionHandles, not {type(h).__name__}")

    # ---------------------------------------------------------------- backpressure

    def input_lag(self, stream: str) -> Plan[int]:
        cached = self.lag.get(stream)
        if cached is not None and time.monotonic() - cached[0] < self.settings.lag_cache_s:
            return cached[1]
        length, groups = yield Read((XLen(stream), XInfoGroups(stream)), errors=True)
        lag = stream_lag(length, groups).behind
        self.lag[stream] = (time.monotonic(), lag)
        return lag

    def admit(self, stream: str, *, wait: bool) -> Plan[bool]:
        """True when the stream's lag is within max_lag. wait=False: answer at once; wait=True: apply the policy
        (raise Backpressure, or wait up to timeout_s then raise)."""
        st = self.settings
        if st.max_lag is None or (yield from self.input_lag(stream)) <= st.max_lag:
            return True
        if not wait:
            return False
        if st.backpressure == "wait":
            deadline = time.monotonic() + st.timeout_s
            while time.monotonic() < deadline:
                yield Sleep(max(st.lag_cache_s, 0.01))
                if (yield from self.input_lag(stream)) <= st.max_lag:
                    return True
        raise Backpressure(f"input lag of {stream} over max_lag={st.max_lag}"
                           + (f" for {st.timeout_s} s" if st.backpressure == "wait" else ""))
