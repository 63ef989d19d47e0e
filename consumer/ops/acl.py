"""Redis ACL rules for the three kinds of dgr clients (see docs/acl.md).

* a worker (consumer) may touch only its own `dgr:{W}:*` keys, plus SADD itself to `dgr:workers`;
* the Tracker's producer may read the advertisements and heartbeats, write step jobs and
  cancellations, read result streams and the input-stream lag, relay a route's activation blobs
  (read and delete a hop's output blob, write the next hop's input blob), of every worker, and nothing
  else (no accounting, no stored results, no dead letters);
* the control plane (`dgr inspect`, `dgr ops`, `rq worker dgr-ops`) reads and writes `dgr:*`
  and RQ's `rq:*` keys.

`dgr ops acl worker W` / `producer` / `ops` print the `ACL SETUSER` line to paste (or to put in
an ACL file). The key patterns are built from schemas/keys.py. Every command a script runs is checked
against the caller's ACL too, so the worker's list covers what consumer/lua/*.lua call.
"""

from __future__ import annotations

from schemas.keys import ALL_KEYS, ANY_WORKER, WORKERS_INDEX, WorkerKeys

# Connection upkeep every client needs (HELLO for RESP3). redis-py also sends CLIENT SETINFO on
# connect and ignores a refusal; Redis 7.0 has no such command (7.2+ does: add "+client|setinfo").
CONNECTION = ("+ping", "+hello", "+client|setname", "+client|id", "+select")

WORKER_COMMANDS = (
    # streams: group setup, reads, acks, recovery, dead letters, results, lag
    "+xgroup|create", "+xgroup|delconsumer", "+xreadgroup", "+xread", "+xack", "+xadd", "+xautoclaim", "+xclaim",
    "+xpending",
    "+xinfo|groups", "+xinfo|stream", "+xlen", "+xtrim", "+xrange",
    # once-only markers, advertisement, heartbeat, accounting (the tally: hmget, hset, hdel)
    "+set", "+get", "+del", "+expire", "+ttl", "+hincrby", "+hincrbyfloat", "+hset", "+hget", "+hgetall", "+hmget",
    "+hdel", "+sadd",
    # the lease (incr: its epoch), cancel markers and result records checked, closures (hsetnx)
    "+incr", "+pexpire", "+exists", "+hsetnx",
    # durable completions (--durable-replicas): WAIT after the completion script
    "+wait",
    # the completion / pending / recovery scripts (time: the tally's clock)
    "+evalsha", "+eval", "+script|load", "+script|exists", "+time",
    # at start, the memory policy (INFO memory: a Redis that evicts loses dgr's keys, transport/memory.py)
    "+info",
)

PRODUCER_COMMANDS = (
    "+smembers", "+get", "+exists", "+xadd", "+xread", "+xrange", "+xlen", "+xinfo|groups", "+multi", "+exec",
    "+discard",
    # a heartbeat's age on Redis' clock (schemas/heartbeat.py): PTTL of the heartbeat keys it may read; every
    # heartbeat of a fleet read in one MGET (producer/validate.py `workers`)
    "+pttl", "+mget",
)
# A selector (Redis 7): these commands on these keys only, so the Tracker cannot SET over a stream.
# Cancel markers (set with a TTL, checked by a replay) and the session record `resume()` rebuilds from.
PRODUCER_STATE_SELECTOR = (f"(~{ANY_WORKER.cancel_marker('*')} ~{ANY_WORKER.session_record('*')} "
                           "+set +exists +hset +hgetall +expire)")
# A session moved off a lost worker (producer/moves.py): the Tracker carries the charged high-water mark `hw`
# into the new worker's session hash (docs/accounting.md), HSET only: it still reads no accounting.
PRODUCER_MOVE_SELECTOR = f"(%W~{ANY_WORKER.session_account('*')} +hset)"
# Routes of several hops (docs/routes.md): the Tracker relays a prefill chunk's rows, reading and deleting
# a hop's output blob and writing the next hop's input blob, and nothing else on those keys.
PRODUCER_RELAY_SELECTORS = (f"(~{ANY_WORKER.activations_out('*')} +get +del)",
                            f"(~{ANY_WORKER.activations_in('*')} +set)")


def worker_rules(worker_id: str) -> list[str]:
    """Own keys read/write (`~dgr:{W}:*`), `dgr:workers` write-only (SADD on register)."""
    return ["resetkeys", f"~{WorkerKeys(worker_id).all_pattern}", f"%W~{WORKERS_INDEX}", "resetchannels", "-@all",
            *CONNECTION, *WORKER_COMMANDS]


def producer_rules() -> list[str]:
    w = ANY_WORKER
    return ["resetkeys", f"%R~{WORKERS_INDEX}", f"%R~{w.spec}", f"%R~{w.heartbeat}", f"%R~{w.prefix_summary}",
            f"%R~{w.drain}",
            f"~{w.input_pattern}",
            f"%R~{w.results('*')}", f"%W~{w.cancellations}", "resetchannels", "-@all", *CONNECTION, *PRODUCER_COMMANDS,
            PRODUCER_STATE_SELECTOR, PRODUCER_MOVE_SELECTOR, *PRODUCER_RELAY_SELECTORS]


def ops_rules() -> list[str]:
    """The control plane and its RQ worker: every dgr and rq key, no admin commands."""
    return ["resetkeys", f"~{ALL_KEYS}", "~rq:*", "resetchannels", "&rq:*", "+@all", "-@dangerous",
            "+info", "+client|list", "+client|getname", "+client|setname", "+time"]


def setuser(name: str, password: str, rules: list[str]) -> list[str]:
    """ACL SETUSER argv: `reset` first, so re-running it leaves exactly these rules."""
    return ["ACL", "SETUSER", name, "reset", "on", f">{password}", *rules]


def render(argv: list[str]) -> str:
    """One line for redis-cli (rules with braces or globs quoted)."""
    return " ".join(a if all(ch.isalnum() or ch in "-_.:+@" for ch in a) else f"'{a}'" for a in argv)
