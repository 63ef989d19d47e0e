"""`dgr inspect` and `dgr ops ...`: the control plane on the command line.

`register(app)` adds them to the `dgr` Typer app. Every option is also a DGR_* environment variable.
Imports of the ops modules are lazy, so `dgr --help` stays instant.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from .common import Client

from ..redis_options import RedisClusterFlag as Cluster
from ..redis_options import RedisSentinel, RedisUrl, SentinelMaster, SentinelPassword, SentinelUsername, target

Workers = Annotated[list[str] | None, typer.Option("--worker", "-w", envvar="DGR_OPS_WORKERS",
                                                   help="Only these workers (repeat; default: all in dgr:workers).")]
Json = Annotated[bool, typer.Option("--json", envvar="DGR_OPS_JSON", help="Print JSON instead of tables.")]
Who = Annotated[str, typer.Option(envvar="DGR_OPS_WHO", help="Operator name for audit records (default user@host).")]

DEFAULT_URL = "redis://127.0.0.1:6379/0"

ops_app = typer.Typer(help="Control plane: accounting roll-up, dead letters, idle-session reaper, RQ jobs.",
                      no_args_is_help=True)
dlq_app = typer.Typer(help="Dead letters: list, replay (at most once each, audited), audit log.",
                      no_args_is_help=True)
ops_app.add_typer(dlq_app, name="dlq")


def _client(url: str, cluster: bool, sentinel: str, master: str, sentinel_username: str,
            sentinel_password: str) -> Client:
    """Every command's client: a URL, a Cluster node's URL, or the master the sentinels name
    (consumer/connect.py)."""
    from ..connect import connect

    return connect(target(url, sentinel, master, sentinel_username, sentinel_password, cluster))


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """These environment variables set for the block (the DGR_* variables a job reads), then restored."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


def inspect_cmd(redis_url: RedisUrl = DEFAULT_URL, cluster: Cluster = False, redis_sentinel: RedisSentinel = "",
                sentinel_master: SentinelMaster = "", sentinel_username: SentinelUsername = "",
                sentinel_password: SentinelPassword = "", worker: Workers = None, as_json: Json = False) -> None:
    """Per worker: advertised keys, heartbeat age, input lag/pending, dead letters, sessions, totals."""
    from .inspect import inspect_fleet, render, to_json

    client = _client(redis_url, cluster, redis_sentinel, sentinel_master, sentinel_username, sentinel_password)
    reports = inspect_fleet(client, worker)
    if as_json:
        typer.echo(to_json(reports))
    else:
        render(reports)


@ops_app.command("rollup")
def rollup_cmd(redis_url: RedisUrl = DEFAULT_URL, cluster: Cluster = False, redis_sentinel: RedisSentinel = "",
               sentinel_master: SentinelMaster = "", sentinel_username: SentinelUsername = "",
               sentinel_password: SentinelPassword = "", worker: Workers = None,
               account: Annotated[list[str] | None, typer.Option("--account", "-a", envvar="DGR_OPS_ACCOUNTS",
                                                                 help="Only these billing accounts.")] = None,
               as_json: Json = False) -> None:
    """Fold every worker's per-account counters into the ledger, exactly once (safe to rerun)."""
    from rich.console import Console
    from rich.table import Table

    from .rollup import read_ledger, rollup

    client = _client(redis_url, cluster, redis_sentinel, sentinel_master, sentinel_username, sentinel_password)
    rep = rollup(client, worker_ids=worker, account_ids=account)
    touched = sorted({f.account_id for f in rep.folds})
    entries = [read_ledger(client, a) for a in touched]
    if as_json:
        _print_json({**rep.as_dict(), "ledger": [e.as_dict() for e in entries]})
        return
    c = Console()
    c.print(f"folded {rep.count('folded')}, unchanged {rep.count('unchanged')}, "
            f"regressed {rep.count('regressed')} (worker, account) pairs")
    for f in rep.folds:
        if f.status == "regressed":
            c.print(f"[yellow]not folded[/yellow] {f.worker_id}/{f.account_id}: {f.detail}")
    c.print(_ledger_table(entries, Table))


def _ledger_table(entries: list[Any], table_cls: Any) -> Any:
    t = table_cls(title="ledger (dgr:{ledger}:account:*)", title_justify="left")
    for col in ("account", "workers", "steps", "prompt tok", "generated tok", "engine s", "folds", "folded at"):
        t.add_column(col, justify="left" if col == "account" else "right")
    import datetime as dt

    for e in entries:
        tot = e.totals
        when = dt.datetime.fromtimestamp(e.folded_at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if e.folded_at else "-"
        t.add_row(e.account_id, str(len(e.by_worker)), f"{int(tot.get('steps', 0))}",
                  f"{int(tot.get('prompt_tokens', 0))}", f"{int(tot.get('generated_tokens', 0))}",
                  f"{tot.get('engine_seconds', 0.0):.3f}", str(e.folds), when)
    return t


@ops_app.command("ledger")
def ledger_cmd(accounts: Annotated[list[str] | None, typer.Argument(help="Accounts (default: all).")] = None,
               redis_url: RedisUrl = DEFAULT_URL, cluster: Cluster = False, redis_sentinel: RedisSentinel = "",
               sentinel_master: SentinelMaster = "", sentinel_username: SentinelUsername = "",
               sentinel_password: SentinelPassword = "", as_json: Json = False) -> None:
    """Show the rolled-up ledger (totals per billing account, with each worker's share)."""
    from rich.console import Console
    from rich.table import Table

    from .rollup import ledger_accounts, read_ledger

    client = _client(redis_url, cluster, redis_sentinel, sentinel_master, sentinel_username, sentinel_password)
    entries = [read_ledger(client, a) for a in (accounts or ledger_accounts(client))]
    if as_json:
        _print_json([e.as_dict() for e in entries])
    else:
        Console().print(_ledger_table(entries, Table))


@dlq_app.command("list")
def dlq_list_cmd(redis_url: RedisUrl = DEFAULT_URL, cluster: Cluster = False, redis_sentinel: RedisSentinel = "",
                 sentinel_master: SentinelMaster = "", sentinel_username: SentinelUsername = "",
                 sentinel_password: SentinelPassword = "", worker: Workers = None,
                 count: Annotated[int, typer.Option(envvar="DGR_OPS_COUNT", help="Newest N per worker.")] = 50,
                 reason: Annotated[str, typer.Option(envvar="DGR_OPS_REASON", help="Only this reason.")] = "",
                 as_json: Json = False) -> None:
    """List dead letters (newest first): ref, reason, detail, original stream and fields, replay status."""
    from rich.console import Console
    from rich.table import Table

    from .deadletters import list_dead_letters

    client = _client(redis_url, cluster, redis_sentinel, sentinel_master, sentinel_username, sentinel_password)
    items = list_dead_letters(client, worker, count=count, reason=reason or None)
    if as_json:
        _print_json([d.as_dict() for d in items])
        return
    t = Table(title="dead letters", title_justify="left")
    for col in ("ref", "reason", "detail", "stream", "entry", "fields", "replayed as"):
        t.add_column(col, overflow="fold")
    for d in items:
        fields = " ".join(f"{k}={v[:40]}" for k, v in d.fields.items() if k != "session")
        t.add_row(d.ref, d.reason, d.detail[:120], d.stream, d.entry_id, fields, d.replayed_as or "-")
    Console().print(t)


@dlq_app.command("replay")
def dlq_replay_cmd(refs: Annotated[list[str], typer.Argument(help="<worker>/<id> (or <id> with --worker).")],
                   redis_url: RedisUrl = DEFAULT_URL, cluster: Cluster = False, redis_sentinel: RedisSentinel = "",
                   sentinel_master: SentinelMaster = "", sentinel_username: SentinelUsername = "",
                   sentinel_password: SentinelPassword = "",
                   worker: Annotated[str, typer.Option("--worker", "-w", envvar="DGR_WORKER_ID",
                                                       help="Worker of bare ids.")] = "",
                   who: Who = "",
                   note: Annotated[str, typer.Option(help="Why (kept in the audit record).")] = "",
                   marker_ttl_s: Annotated[int, typer.Option(envvar="DGR_OPS_MARKER_TTL_S",
                                                             help="TTL of the replayed-once marker (0: none).")] = 0,
                   as_json: Json = False) -> None:
    """Replay dead letters into their original input streams: each at most once, with an audit record."""
    from .common import operator
    from .deadletters import Replay, parse_ref, replay

    client = _client(redis_url, cluster, redis_sentinel, sentinel_master, sentinel_username, sentinel_password)
    by_worker: dict[str, list[str]] = {}
    for ref in refs:
        try:
            w, i = parse_ref(ref, worker or None)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        by_worker.setdefault(w, []).append(i)
    out: list[Replay] = []
    for w, ids in by_worker.items():
        out += replay(client, w, ids, who=who or operator(), note=note, marker_ttl_s=marker_ttl_s)
    if as_json:
        _print_json([x.as_dict() for x in out])
    else:
        for x in out:
            typer.echo(f"{x.worker_id}/{x.dlq_id}: {x.status}" + (f" as {x.new_id}" if x.new_id else "")
                       + (f" ({x.detail})" if x.detail else ""))
    if any(x.status not in ("replayed", "already") for x in out):
        raise typer.Exit(1)


@dlq_app.command("audit")
def dlq_audit_cmd(redis_url: RedisUrl = DEFAULT_URL, cluster: Cluster = False, redis_sentinel: RedisSentinel = "",
                  sentinel_master: SentinelMaster = "", sentinel_username: SentinelUsername = "",
                  sentinel_password: SentinelPassword = "", worker: Workers = None,
                  count: Annotated[int, typer.Option(envvar="DGR_OPS_COUNT")] = 50, as_json: Json = False) -> None:
    """The replay audit log (dgr:{W}:dlq:audit), newest first."""
    from .common import workers
    from .deadletters import audit_log

    client = _client(redis_url, cluster, redis_sentinel, sentinel_master, sentinel_username, sentinel_password)
    rows = [{"worker_id": w, **a} for w in workers(client, worker) for a in audit_log(client, w, count)]
    if as_json:
        _print_json(rows)
    else:
        for a in rows:
            typer.echo(f"{a['worker_id']} {a.get('at', '')} {a.get('who', '')}: {a.get('dlq_id', '')} -> "
                       f"{a.get('stream', '')} {a.get('new_id', '')} ({a.get('reason', '')}) {a.get('note', '')}")


@ops_app.command("reap")
def reap_cmd(ttl: Annotated[float, typer.Option("--ttl", envvar="DGR_REAP_TTL_S",
                                                help="Cancel sessions with no result for this many seconds.")],
             redis_url: RedisUrl = DEFAULT_URL, cluster: Cluster = False, redis_sentinel: RedisSentinel = "",
             sentinel_master: SentinelMaster = "", sentinel_username: SentinelUsername = "",
             sentinel_password: SentinelPassword = "", worker: Workers = None,
             dry_run: Annotated[bool, typer.Option("--dry-run", envvar="DGR_OPS_DRY_RUN",
                                                   help="List, do not cancel.")] = False,
             who: Who = "", as_json: Json = False) -> None:
    """Cancel sessions idle past --ttl through the normal cancellation stream (the worker frees the slot)."""
    from .common import operator
    from .reaper import reap

    client = _client(redis_url, cluster, redis_sentinel, sentinel_master, sentinel_username, sentinel_password)
    rows = reap(client, ttl, worker_ids=worker, dry_run=dry_run, who=who or operator())
    if as_json:
        _print_json([x.as_dict() for x in rows])
        return
    hit = [x for x in rows if x.status in ("cancelled", "idle")]
    for x in hit:
        idle = "result stream gone" if x.idle_s is None else f"idle {x.idle_s:.1f}s"
        typer.echo(f"{x.worker_id}/{x.session_id}: {'would cancel' if x.status == 'idle' else 'cancelled'} ({idle})")
    typer.echo(f"{len(rows)} open sessions looked at, {len(hit)} {'idle' if dry_run else 'cancelled'}")


@ops_app.command("forget-gone")
def forget_gone_cmd(gone_for: Annotated[float, typer.Option(
        "--gone-for-s", envvar="DGR_FORGET_AFTER_S",
        help="Take out of the fleet index workers that no process holds since this many seconds.")] = 86_400.0,
        redis_url: RedisUrl = DEFAULT_URL, cluster: Cluster = False, redis_sentinel: RedisSentinel = "",
        sentinel_master: SentinelMaster = "", sentinel_username: SentinelUsername = "",
        sentinel_password: SentinelPassword = "", worker: Workers = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", envvar="DGR_OPS_DRY_RUN",
                                              help="List, take nothing out (notes nothing either).")] = False,
        as_json: Json = False) -> None:
    """Take workers gone for good out of `dgr:workers` (their keys stay; consumer/ops/forget.py says when)."""
    from .forget import forget_gone

    client = _client(redis_url, cluster, redis_sentinel, sentinel_master, sentinel_username, sentinel_password)
    rows = forget_gone(client, gone_for, worker_ids=worker, dry_run=dry_run)
    if as_json:
        _print_json([x.as_dict() for x in rows])
        return
    for x in rows:
        if x.status != "up":
            gone = "" if x.gone_s is None else f", gone {x.gone_s:.0f} s"
            typer.echo(f"{x.worker_id}: {x.status}{gone}{f' ({x.detail})' if x.detail else ''}")
    typer.echo(f"{len(rows)} workers looked at, {sum(x.status == 'forgotten' for x in rows)} "
               f"{'to take out' if dry_run else 'taken out'}")


WorkerArg = Annotated[str, typer.Argument(help="The worker id.")]


@ops_app.command("drain")
def drain_cmd(worker_id: WorkerArg, redis_url: RedisUrl = DEFAULT_URL, cluster: Cluster = False,
              redis_sentinel: RedisSentinel = "", sentinel_master: SentinelMaster = "",
              sentinel_username: SentinelUsername = "", sentinel_password: SentinelPassword = "", who: Who = "",
              as_json: Json = False) -> None:
    """Place no new session on WORKER; it finishes those it holds (with --exit-when-drained it then exits 0)."""
    from schemas.limits import is_id

    from .common import operator
    from .drain import drain

    if not is_id(worker_id):
        raise typer.BadParameter(f"{worker_id!r} is not a worker id")
    client = _client(redis_url, cluster, redis_sentinel, sentinel_master, sentinel_username, sentinel_password)
    _drain_out(drain(client, worker_id, who or operator()), as_json)


@ops_app.command("undrain")
def undrain_cmd(worker_id: WorkerArg, redis_url: RedisUrl = DEFAULT_URL, cluster: Cluster = False,
                redis_sentinel: RedisSentinel = "", sentinel_master: SentinelMaster = "",
                sentinel_username: SentinelUsername = "", sentinel_password: SentinelPassword = "",
                as_json: Json = False) -> None:
    """Place sessions on WORKER again."""
    from schemas.limits import is_id

    from .drain import undrain

    if not is_id(worker_id):
        raise typer.BadParameter(f"{worker_id!r} is not a worker id")
    client = _client(redis_url, cluster, redis_sentinel, sentinel_master, sentinel_username, sentinel_password)
    _drain_out(undrain(client, worker_id), as_json)


def _drain_out(state: Any, as_json: bool) -> None:
    if as_json:
        _print_json(state.as_dict())
        return
    said = ("no heartbeat" if state.advertised is None else "its heartbeat agrees"
            if state.advertised == state.draining else "its next heartbeat will say so")
    typer.echo(f"{state.worker_id}: {'draining' if state.draining else 'not draining'} ({said}, "
               f"busy slots {state.busy_slots if state.busy_slots is not None else '?'})")


@ops_app.command("enqueue-rollup")
def enqueue_rollup_cmd(
        redis_url: RedisUrl = DEFAULT_URL,
        queue_url: Annotated[str, typer.Option(envvar="DGR_OPS_QUEUE_URL",
                                               help="A plain Redis for the RQ queue (default: the Redis the other "
                                                    "options name; needed with --cluster).")] = "",
        target_url: Annotated[str, typer.Option(envvar="DGR_OPS_TARGET_URL",
                                                help="Redis the job rolls up (default: the RQ worker's "
                                                     "DGR_* variables; a URL given here is stored in the job).")] = "",
        cluster: Cluster = False, redis_sentinel: RedisSentinel = "", sentinel_master: SentinelMaster = "",
        sentinel_username: SentinelUsername = "", sentinel_password: SentinelPassword = "",
        sync: Annotated[bool, typer.Option("--sync", help="Run it here, now (RQ is_async=False).")] = False) -> None:
    """Enqueue an accounting roll-up on the RQ queue `dgr-ops` (run by `rq worker dgr-ops`).

    The queue is on the Redis the connection options name (a Sentinel group's master included), or on
    --queue-url. With --sync the job rolls up that Redis, here; otherwise the RQ worker's own unless
    --target-url names another (sentinels and their master's name travel in the job, passwords never)."""
    from .jobs import QUEUE, enqueue_rollup, queue

    t = target(redis_url, redis_sentinel, sentinel_master, sentinel_username, sentinel_password, cluster)
    if queue_url:
        q = queue(queue_url, is_async=not sync)
    elif cluster:
        raise typer.BadParameter("RQ has no Redis Cluster support: give --queue-url (a plain Redis) with --cluster")
    else:
        from ..connect import connect

        q = queue("", is_async=not sync, connection=connect(t))
    if sync:  # runs here, as an RQ worker with these options as its DGR_* variables would: no URL in the job
        with _environ(t.env()):
            job = enqueue_rollup(q, target_url, cluster and bool(target_url))
    else:
        job = enqueue_rollup(q, target_url, cluster and bool(target_url))
    status = job.get_status()
    typer.echo(f"enqueued {job.id} on {QUEUE}: {getattr(status, 'value', status)}")
    if sync:
        _print_json(job.return_value())


@ops_app.command("acl")
def acl_cmd(kind: Annotated[str, typer.Argument(help="'worker', 'producer' or 'ops'.")],
            worker: Annotated[str, typer.Option("--worker", "-w", envvar="DGR_WORKER_ID",
                                                help="The worker id (kind 'worker').")] = "",
            user: Annotated[str, typer.Option(help="ACL user name (default dgr-<kind>[-<worker>]).")] = "",
            password: Annotated[str, typer.Option(envvar="DGR_ACL_PASSWORD",
                                                  help="Password to set (default: a placeholder).")] = "") -> None:
    """Print the `ACL SETUSER` line for a worker, the Tracker's producer, or the control plane (docs/acl.md)."""
    from .acl import ops_rules, producer_rules, render, setuser, worker_rules

    if kind == "worker":
        if not worker:
            raise typer.BadParameter("kind 'worker' needs --worker")
        rules, name = worker_rules(worker), f"dgr-worker-{worker}"
    elif kind == "producer":
        rules, name = producer_rules(), "dgr-tracker"
    elif kind == "ops":
        rules, name = ops_rules(), "dgr-ops"
    else:
        raise typer.BadParameter("kind must be 'worker', 'producer' or 'ops'")
    typer.echo(render(setuser(user or name, password or "CHANGE-ME", rules)))


@ops_app.command("capacity")
def capacity_cmd(redis_url: RedisUrl = DEFAULT_URL,
                 clients: Annotated[int, typer.Option(envvar="DGR_CAP_CLIENTS", help="Client processes.")] = 4,
                 batch: Annotated[int, typer.Option(envvar="DGR_CAP_BATCH", help="Sessions per fused call.")] = 8,
                 seconds: Annotated[float, typer.Option(envvar="DGR_CAP_SECONDS")] = 10.0,
                 as_json: Json = False) -> None:
    """Measure what this Redis sustains on the step path (XADD, XREADGROUP, completion EVALSHA, XREAD)."""
    from .capacity import measure

    res = measure(redis_url, clients=clients, batch=batch, seconds=seconds)
    if as_json:
        _print_json(res.as_dict())
        return
    for k, v in res.as_dict().items():
        typer.echo(f"{k:>24}: {v}")


def register(app: typer.Typer) -> None:
    """Add `dgr inspect` and the `dgr ops` group to the dgr app."""
    app.command("inspect")(inspect_cmd)
    app.add_typer(ops_app, name="ops")
