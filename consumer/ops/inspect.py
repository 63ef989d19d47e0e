"""`dgr inspect`: the fleet at a glance (like `rq info`), as Rich tables or JSON.

Per worker (ids from `dgr:workers`):
* its advertisement (`dgr:{W}:spec`): compatibility keys (phase, digest, architecture, quantization,
  runtime) and capacity (slots, max batch);
* heartbeat age (`dgr:{W}:hb`, JSON with `ts`; the key expires a few seconds after the last beat, so
  a missing one means the worker is gone or stuck);
* every advertised input stream: length, consumer-group lag (XINFO GROUPS `lag`, Redis >= 7) and
  pending (delivered, not acked) counts, consumers;
* dead letters (XLEN `dgr:{W}:dlq`);
* active sessions: `busy_slots` from the heartbeat (or the advertisement), else the number of
  session accounting hashes that are neither closed nor reaped;
* accounting totals (`dgr:{W}:acct:worker`);
* its engines, when it serves several (docs/state-layouts.md, "Several engines in one worker"): one row
  each (name, state layout, slots busy / total, state bytes a session holds), from the heartbeat's
  `engines` (or the advertisement's). A worker of one engine shows no such row, as before.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from rich.console import Console
from rich.table import Table

from schemas import CompatibilityKey
from schemas.heartbeat import heartbeat_age
from schemas.keys import WorkerKeys, parse_input_stream
from schemas.lag import stream_lag

from .common import Client, s, scan_worker, sdict, workers
from .reaper import open_sessions

TOTAL_FIELDS = ("steps", "prompt_tokens", "generated_tokens", "fused_calls", "engine_seconds", "dead_letters")


@dataclass
class StreamReport:
    stream: str
    phase: str
    digest: str
    length: int
    lag: int | None
    pending: int
    consumers: int
    last_delivered_id: str


@dataclass
class WorkerReport:
    worker_id: str
    advertised: bool
    alive: bool
    heartbeat_age_s: float | None
    keys: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    streams: list[StreamReport] = field(default_factory=list)
    dead_letters: int = 0
    active_sessions: int | None = None
    active_source: str = ""
    accounting: dict[str, float] = field(default_factory=dict)
    engines: list[dict[str, Any]] = field(default_factory=list)  # one per engine: see _engine_summary
    draining: bool = False  # `dgr ops drain` set its drain key (consumer/ops/drain.py)
    placement: dict[str, Any] = field(default_factory=dict)  # the placement score's inputs (docs/placement.md)
    # the worker's clock less this host's, read by when it beat on Redis' clock (schemas/heartbeat.py): None when
    # its heartbeat gives no TTL to read that by
    clock_skew_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _num(v: str) -> float:
    try:
        return float(v)
    except ValueError:
        return 0.0


def _key_summary(raw: dict[str, Any]) -> dict[str, Any]:
    try:
        k = CompatibilityKey.model_validate(raw)
    except ValueError:
        return {"phase": raw.get("phase", "?"), "digest": "invalid"}
    out = {"phase": k.phase, "digest": k.digest, "architecture": k.engine.architecture,
           "quantization": k.recipe.quantization, "kv_cache_type": k.recipe.kv_cache_type,
           "ctx_per_session": k.recipe.ctx_per_session, "batch_invariant": k.recipe.batch_invariant,
           "runtime": k.recipe.runtime, "boundary": f"{k.boundary.name}/{k.boundary.version}",
           "state": k.state.kind}
    if "state_bytes" in k.state.dims:  # recurrent / hybrid: one session's recurrent cells
        out["state_bytes"] = k.state.dims["state_bytes"]
    return out


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _engine_summary(raw: Any) -> dict[str, Any] | None:
    """One engine of a worker's heartbeat (`engines`: EngineSet.advertise() and the worker's per-engine
    fields), reduced to what inspect shows; None for anything that is not such an entry."""
    if not isinstance(raw, dict) or not isinstance(raw.get("engine"), str):
        return None
    counts = ("slots", "busy_slots", "state_bytes_per_session", "state_bytes_per_token", "fused_calls")
    return {"engine": raw["engine"], "architecture": str(raw.get("architecture", "?")),
            "state_layout": str(raw.get("state_layout", "?")), **{c: _int(raw.get(c)) for c in counts},
            "digests": raw.get("digests") if isinstance(raw.get("digests"), dict) else {},
            "prefix_cache": {k: v for k, v in pc.items() if isinstance(k, str) and _int(v) is not None}
            if isinstance(pc := raw.get("prefix_cache"), dict) else None}


def _json(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        out = json.loads(raw)
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def inspect_worker(client: Client, worker_id: str, *, now: float | None = None) -> WorkerReport:
    k = WorkerKeys(worker_id)
    pipe = client.pipeline(transaction=False)
    pipe.get(k.spec)
    pipe.get(k.heartbeat)
    pipe.pttl(k.heartbeat)
    pipe.xlen(k.dead_letters)
    pipe.hgetall(k.worker_account)
    pipe.exists(k.drain)
    spec_raw, hb_raw, hb_pttl, dlq_len, acct, drain = pipe.execute()
    spec, hb = _json(spec_raw), _json(hb_raw)
    # on Redis' clock (the key's PTTL), not this host's against the worker's (schemas/heartbeat.py)
    now = time.time() if now is None else now
    age = heartbeat_age(hb, hb_pttl, now) if hb_raw is not None else None
    info = dict(spec.get("info") or {})
    rep = WorkerReport(worker_id=worker_id, advertised=spec_raw is not None, alive=hb_raw is not None,
                       heartbeat_age_s=age, keys=[_key_summary(x) for x in spec.get("keys", [])], info=info,
                       dead_letters=int(dlq_len),
                       accounting={f: _num(v) for f, v in sdict(cast(dict[Any, Any], acct)).items()},
                       draining=bool(drain))
    rep.placement = _placement_inputs(hb, info, rep.draining)
    ts = hb.get("ts")
    if age is not None and "ttl_s" in hb and isinstance(hb_pttl, int) and hb_pttl >= 0 \
            and isinstance(ts, int | float) and not isinstance(ts, bool):
        rep.clock_skew_s = ts - (now - age)  # when it beat by its clock, less when it beat by this one
    engines = hb.get("engines") if hb_raw is not None else None
    if not isinstance(engines, list):
        engines = info.get("engines")
    rep.engines = [e for e in map(_engine_summary, engines if isinstance(engines, list) else []) if e is not None]
    streams = [str(x) for x in spec.get("streams", [])]
    if not streams and spec_raw is None:  # never advertised: look for its streams
        streams = sorted(scan_worker(client, worker_id, k.input_pattern, type_="stream"))
    rep.streams = _streams(client, streams)
    busy = hb.get("busy_slots", info.get("busy_slots"))
    if isinstance(busy, int) and hb_raw is not None:
        rep.active_sessions, rep.active_source = busy, "busy_slots"
    else:
        rep.active_sessions, rep.active_source = len(open_sessions(client, worker_id)), "open_sessions"
    return rep


def _placement_inputs(hb: dict[str, Any], info: dict[str, Any], draining: bool) -> dict[str, Any]:
    """What a Tracker's placement reads of this worker (producer/placement.py `candidate`; its heartbeat age
    is the report's `heartbeat_age_s`)."""
    prefix = hb.get("prefix")
    sched = hb.get("scheduler") if isinstance(hb.get("scheduler"), dict) else None  # openings refused: full
    summary = None
    if isinstance(prefix, dict):
        ids, n = prefix.get("ids"), prefix.get("n")  # the ids themselves (an older worker), or their count
        summary = {"block_tokens": prefix.get("block_tokens"), "scope": prefix.get("scope"),
                   "ids": len(ids) if isinstance(ids, list) else _int(n) if n is not None else None,
                   "version": prefix.get("version")}
    return {"slots": _int(hb.get("slots", info.get("slots"))), "busy_slots": _int(hb.get("busy_slots")),
            "queued": _int(hb.get("queued")), "stopped": bool(hb.get("stopped")),
            "draining": draining or bool(hb.get("draining")), "advertises_draining": bool(hb.get("draining")),
            "prefix": summary, "refused_capacity": _int(sched.get("rejected_capacity")) if sched else None}


def _streams(client: Client, names: list[str]) -> list[StreamReport]:
    if not names:
        return []
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.xlen(name)
        pipe.xinfo_groups(name)
    replies = pipe.execute(raise_on_error=False)
    out: list[StreamReport] = []
    for i, name in enumerate(names):
        sl = stream_lag(replies[2 * i], replies[2 * i + 1])
        parsed = parse_input_stream(name)
        phase, digest = (parsed[2], parsed[1]) if parsed else ("?", "?")
        rep = StreamReport(name, phase, digest, sl.length, sl.lag, 0, 0, "")
        if sl.group is not None:
            g = sl.group
            rep.pending = int(g.get("pending") or 0)
            rep.consumers = int(g.get("consumers") or 0)
            rep.last_delivered_id = s(g.get("last-delivered-id", ""))
        out.append(rep)
    return out


def inspect_fleet(client: Client, worker_ids: Iterable[str] | None = None) -> list[WorkerReport]:
    return [inspect_worker(client, w) for w in workers(client, worker_ids)]


def _fmt_age(age: float | None, alive: bool) -> str:
    if not alive:
        return "[red]gone[/red]" if age is None else f"[red]{age:.1f}s[/red]"
    return "?" if age is None else (f"{age:.1f}s" if age < 5 else f"[yellow]{age:.1f}s[/yellow]")


def _fmt_num(x: float) -> str:
    return f"{x:.3f}" if x != int(x) else f"{int(x)}"


# Every column a worker row can show, by header; a layout picks and orders them. Left-aligned: text.
TEXT_COLUMNS = ("worker", "keys", "phase", "digest", "last delivered", "engine", "layout")
WIDE_WORKERS = ("worker", "heartbeat", "keys", "slots", "active", "input lag", "pending", "dead letters",
                "steps", "prompt tok", "generated tok", "fused calls", "engine s")
WIDE_STREAMS = ("worker", "phase", "digest", "length", "lag", "pending", "consumers", "last delivered")
# 80 columns: the workers' state, their accounting, their streams (the advertised keys are the streams'
# phase and digest; the last delivered id is in --json).
NARROW = (("dgr workers", ("worker", "heartbeat", "slots", "active", "input lag", "pending", "dead letters")),
          ("accounting (dgr:{W}:acct:worker)", ("worker", "steps", "prompt tok", "generated tok", "fused calls",
                                                 "engine s")))
NARROW_STREAMS = ("worker", "phase", "digest", "length", "lag", "pending", "consumers")
# A worker of several engines: one row per engine (80 columns wide at most).
ENGINE_COLUMNS = ("worker", "engine", "layout", "slots busy/total", "state B/session")
# Engines with a prefix cache (docs/prefix-cache.md): its counters since start and the bytes it holds.
PREFIX_COLUMNS = ("worker", "engine", "hits", "misses", "hit tokens", "cached bytes", "evictions")


def _worker_row(w: WorkerReport) -> dict[str, str]:
    a = w.accounting
    active = "?" if w.active_sessions is None else str(w.active_sessions)
    if w.active_source == "open_sessions":
        active += "*"
    keys = ", ".join(f"{k['phase']}:{k['digest']}" for k in w.keys) or ("-" if w.advertised else "[red]none[/red]")
    name = f"{w.worker_id} [yellow](draining)[/yellow]" if w.draining else w.worker_id
    beat = _fmt_age(w.heartbeat_age_s, w.alive)
    if w.clock_skew_s is not None and abs(w.clock_skew_s) >= 1.0:  # a host whose clock is off: say by how much
        beat += f" [yellow](clock {w.clock_skew_s:+.0f}s)[/yellow]"
    return {"worker": name, "heartbeat": beat, "keys": keys,
            "slots": str(w.info.get("slots", "?")), "active": active,
            "input lag": str(sum(x.lag if x.lag is not None else x.length for x in w.streams)),
            "pending": str(sum(x.pending for x in w.streams)),
            "dead letters": f"[red]{w.dead_letters}[/red]" if w.dead_letters else "0",
            "steps": _fmt_num(a.get("steps", 0)), "prompt tok": _fmt_num(a.get("prompt_tokens", 0)),
            "generated tok": _fmt_num(a.get("generated_tokens", 0)),
            "fused calls": _fmt_num(a.get("fused_calls", 0)), "engine s": f"{a.get('engine_seconds', 0.0):.3f}"}


def _stream_rows(reports: list[WorkerReport]) -> list[dict[str, str]]:
    return [{"worker": w.worker_id, "phase": x.phase, "digest": x.digest, "length": str(x.length),
             "lag": "?" if x.lag is None else str(x.lag), "pending": str(x.pending), "consumers": str(x.consumers),
             "last delivered": x.last_delivered_id or "-"} for w in reports for x in w.streams]


def _engine_rows(reports: list[WorkerReport]) -> list[dict[str, str]]:
    """One row per engine of every worker that serves several (a worker of one engine: none, as before)."""
    def num(x: int | None) -> str:
        return "?" if x is None else f"{x:,}"

    return [{"worker": w.worker_id, "engine": e["engine"], "layout": e["state_layout"],
             "slots busy/total": f"{num(e['busy_slots'])}/{num(e['slots'])}",
             "state B/session": num(e["state_bytes_per_session"])}
            for w in reports if len(w.engines) > 1 for e in w.engines]


def _table(title: str, columns: tuple[str, ...], rows: list[dict[str, str]]) -> Table:
    t = Table(title=title, title_justify="left")
    for col in columns:
        # A header is never cut (min_width); a long worker id or key list wraps in its cell instead.
        t.add_column(col, justify="left" if col in TEXT_COLUMNS else "right", min_width=len(col),
                     overflow="fold", no_wrap=col not in ("worker", "keys"))
    for row in rows:
        t.add_row(*(row[c] for c in columns))
    return t


def _fits(console: Console, table: Table) -> bool:
    """The table's natural width (unbounded) is within the terminal's."""
    from rich.measure import Measurement

    return Measurement.get(console, console.options.update_width(1 << 16), table).maximum <= console.width


def render(reports: list[WorkerReport], console: Console | None = None) -> None:
    """The fleet as tables: one wide table of workers and one of streams when the terminal holds them,
    else (an 80-column terminal) narrower tables split by concern, none of whose headers is cut."""
    console = console or Console()
    if not reports:
        console.print("no workers in dgr:workers")
        return
    workers = [_worker_row(w) for w in reports]
    streams = _stream_rows(reports)
    wide = [_table("dgr workers", WIDE_WORKERS, workers)]
    if streams:
        wide.append(_table("input streams", WIDE_STREAMS, streams))
    if all(_fits(console, t) for t in wide):
        tables = wide
    else:
        tables = [_table(title, cols, workers) for title, cols in NARROW]
        if streams:
            tables.append(_table("input streams", NARROW_STREAMS, streams))
    prefix = [{"worker": w.worker_id, "engine": e["engine"], "hits": _fmt_num(pc.get("hits", 0)),
               "misses": _fmt_num(pc.get("misses", 0)), "hit tokens": _fmt_num(pc.get("hit_tokens", 0)),
               "cached bytes": _fmt_num(pc.get("bytes", 0)), "evictions": _fmt_num(pc.get("evictions", 0))}
              for w in reports for e in w.engines if (pc := e.get("prefix_cache"))]
    if prefix:
        tables.append(_table("prefix cache", PREFIX_COLUMNS, prefix))
    engines = _engine_rows(reports)
    if engines:
        tables.append(_table("engines (workers of several)", ENGINE_COLUMNS, engines))
    for t in tables:
        console.print(t)
    if any(w.active_source == "open_sessions" for w in reports):
        console.print("* active sessions counted from open session accounting hashes (no heartbeat busy_slots)")


def to_json(reports: list[WorkerReport]) -> str:
    return json.dumps({"workers": [w.as_dict() for w in reports], "at": time.time()}, indent=2, default=str)
