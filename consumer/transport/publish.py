"""Filing a completion call: a fused call's answers become one columnar result record per result stream
(schemas/wire.py), sent with everything else the call settles (acks, closures, dead letters, the call's
counters) in ONE EVALSHA of consumer/lua/complete.lua, which publishes each answer once and charges it
once (docs/accounting.md).

Per answer this module appends a few values to columns (a run of plain decode tokens: whole columns at once,
`_runs`); the record is encoded once (msgspec) and the script reads it with Redis' own JSON decoder. Nothing per
answer is a Redis argument of its own, so the Redis work of a call does not grow with arguments per token.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, groupby, repeat
from operator import attrgetter, itemgetter
from typing import Any, Final

import msgspec
import redis

from schemas import GROUP, StepJob, WorkerKeys
from schemas.limits import ACTIVATION_TTL_S, MAX_FIELD_BYTES
from schemas.replies import as_bytes
from schemas.wire import OPTIONAL_COLUMNS, STATUS_CODE, ResultRecord, RowExtra, encode_record, split_result_id

from ..sched.outputs import Answer, Outcome
from .connection import LeaseLost, RedisIO
from .durable import DurableScripts
from .intake import Intake
from .lease import Lease
from .protocol import Closure, DeadLetter, Delivery, Filing

__all__ = ["COMPLETE_ARGV", "FIXED_KEYS", "MAX_DEAD_LETTER_BYTES", "CompletionCall", "Publisher", "dead_letter_fields",
           "encode_filing"]

# The completion script's layout (consumer/lua/complete.lua's header; tests/test_lua.py checks that both
# say the same): the fixed KEYS, then the fixed ARGV head; records, blob bytes and dead letters follow,
# referred to by the control's ARGV indices.
FIXED_KEYS: Final = ("worker", "accounts_index", "dead_letters", "lease", "lease_epoch", "tally", "call_guard",
                     "moved")
COMPLETE_ARGV: Final = ("group", "result_ttl_s", "result_maxlen", "dlq_maxlen", "reject_ttl_s", "lease_token",
                        "lease_epoch", "lease_ms", "act_ttl_s", "call_seq", "control")
DEAD_LETTER_ARGV: Final = ("stream_k", "entry_id", "nf")  # then nf field/value pairs

MAX_DEAD_LETTER_FIELDS: Final = 64
# Bytes of the original entry a dead letter keeps, all fields together: more than any valid entry (4096
# tokens + a SessionSpec), so a dead letter can still be replayed, yet a flood of huge malformed entries
# costs the dead-letter stream at most this much per entry.
MAX_DEAD_LETTER_BYTES: Final = 2 * MAX_FIELD_BYTES
_DETAIL_MAX: Final = 1024
_ENC: Final = msgspec.json.Encoder()


@dataclass(slots=True)
class _Keys:
    """KEYS of one script call, each once; the control refers to them by 1-based index."""

    keys: list[str] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)

    def __call__(self, key: str) -> int:
        i = self.index.get(key)
        if i is None:
            self.keys.append(key)
            i = self.index[key] = len(self.keys)
        return i


@dataclass(slots=True)
class _Rows:
    """One result stream's rows of a call, as the record's columns (full names: schemas/wire.py
    ResultRecord), and what the script needs per row besides."""

    session_id: list[str] = field(default_factory=list)
    job: list[str] = field(default_factory=list)
    offset: list[int] = field(default_factory=list)
    attempt: list[int] = field(default_factory=list)
    status: list[int] = field(default_factory=list)
    position: list[int] = field(default_factory=list)
    first_position: list[int] = field(default_factory=list)
    token: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    fed_tokens: list[int] = field(default_factory=list)
    engine_seconds: list[float] = field(default_factory=list)
    extra: dict[str, RowExtra] = field(default_factory=dict)
    optional: dict[str, list[Any]] = field(default_factory=dict)  # the record's optional columns present
    cached: list[int] = field(default_factory=list)  # of fed, positions restored from the prefix cache
    acct: list[int] = field(default_factory=list)  # per row: the call's account number (0: none)
    skey: list[int] = field(default_factory=list)  # per row: KEYS index of its session hash (0: none)
    res: dict[str, int] = field(default_factory=dict)  # row -> KEYS index of its once-only marker (not ok)
    blob: dict[str, list[int]] = field(default_factory=dict)  # row -> [KEYS index, ARGV index] of output rows

    def add(self, o: Outcome, job: StepJob | None) -> int:
        """The outcome's columns as row i (returned); the script's per-row lists are the caller's."""
        i = len(self.session_id)
        rid = o.job_id
        self.session_id.append(o.session_id)
        if job is not None:
            # a job's first answer is under its own id (the same object: StepJob.answer_id), a later token's
            # under "<job>.<offset>"
            off = 0 if rid is job.job_id else split_result_id(rid, job.job_id)[1]
            self.job.append(job.job_id)
            self.offset.append(off)
            self.attempt.append(job.attempt)
            self.first_position.append(job.start_position + off if off > 0 else job.start_position)
        else:
            self.job.append(rid)
            self.offset.append(0)
            self.attempt.append(0)
            self.first_position.append(o.position)
        code = STATUS_CODE[o.status]
        self.status.append(code)
        self.position.append(o.position)
        self.token.append(-1 if o.token is None else o.token)
        self.finished.append(1 if o.finished else 0)
        # Restored prompt positions (prefix cache) are fed positions too: charged once, never owed.
        self.fed_tokens.append(o.prompt_tokens + o.cached_tokens)
        self.cached.append(o.cached_tokens)
        self.engine_seconds.append(o.engine_seconds)
        if code or o.hidden is not None or o.logprobs is not None or o.detail:
            self.extra[str(i)] = RowExtra(reason=o.reason, detail=o.detail, hidden=o.hidden, logprobs=o.logprobs)
        for c in OPTIONAL_COLUMNS:  # the Outcome's field of the column's name; 0 rows before its first value
            v = getattr(o, c)
            col = self.optional.get(c)
            if col is not None:
                col.append(v)
            elif v:
                self.optional[c] = [0] * i + [v]
        return i

    def record(self, worker_id: str, call_id: str, batch: int) -> ResultRecord:
        return ResultRecord(worker_id=worker_id, call=call_id, batch_size=batch, session_id=self.session_id,
                            job=self.job, offset=self.offset, attempt=self.attempt, status=self.status,
                            position=self.position, first_position=self.first_position, token=self.token,
                            finished=self.finished, fed_tokens=self.fed_tokens, engine_seconds=self.engine_seconds,
                            extra=self.extra, **self.optional)

    def script_columns(self) -> dict[str, Any]:
        """What the script reads of the rows (the record itself is only published): the columns it charges and checks
        by, not the job ids and texts. Status, attempt, fed and engine seconds are one value where every row has the
        same (a call of decode rows: all ok, one attempt, nothing fed, the time shared alike), parsed once."""
        cols: dict[str, Any] = {"sid": self.session_id, "st": one_value(self.status), "att": one_value(self.attempt),
                                "pos": self.position, "frm": self.first_position, "fed": one_value(self.fed_tokens),
                                "tok": self.token, "es": one_value(self.engine_seconds)}
        if any(self.cached):  # a prefix cache hit: rare, so the script reads it only then
            cols["kc"] = self.cached
        return cols


def one_value(column: list[Any]) -> Any:
    """The column, or its one value where every row has it (consumer/lua/complete_publish.lua reads either)."""
    return column[0] if column and column.count(column[0]) == len(column) else column


# A plain answer: a decode token, OK, that goes on (no close, no blob, no extra column, no activations in or out),
# to a Tracker's stream (`reply_to`), billed. A call of decode rows is made of them, and a run of them in a row
# (one stream, any accounts: the sessions of one Tracker interleave its callers' accounts, and a run cut at each
# change of account would be a row long) is filed as whole columns (`_CallBuilder.plain_run`): its rows read in one
# comprehension and turned into columns by zip in C, not appended value by value with a dozen checks each
# (tests/test_filing_runs.py checks that the calls are byte for byte the ones answer by answer gives). Attributes
# are read in Python, not by operator.attrgetter: Python 3.11's specialised attribute loads are faster (0.19 against
# 0.68 us a row for the plain test, timed). PLAIN_RUN: the shortest run worth it.
PLAIN_RUN: Final = 8


def _runs(answers: Sequence[Answer], fast: bool = True) -> Iterator[tuple[bool, str, list[Answer]]]:
    """The answers in order, as runs: (plain, stream, answers); plain runs of PLAIN_RUN or more only."""
    if not fast or len(answers) < PLAIN_RUN:
        yield False, "", list(answers)
        return
    keyed = [((a.close is None and a.blob is None and not a.reply and bool(a.account_id) and j is not None
               and j.hidden is None and j.phase == "decode" and j.reply_to is not None and r.status == "ok"
               and not r.finished and r.token is not None and r.hidden is None and r.logprobs is None
               and not r.detail), None if j is None else j.reply_to, a)
             for a in answers for r, j in ((a.result, a.job),)]
    for (plain, reply), group in groupby(keyed, key=_RUN_KEY):
        run = list(map(_ANSWER, group))
        yield plain and len(run) >= PLAIN_RUN, reply or "", run


_RUN_KEY, _ANSWER = itemgetter(0, 1), itemgetter(2)


@dataclass
class _CallBuilder:
    """One completion call's KEYS, control and ARGV tail, built answer by answer (no I/O): each answer a row
    of its result stream's record, its account, session hash, marker and blobs by KEYS index."""

    k: WorkerKeys
    dropped: set[tuple[str, str]]  # (stream, entry id) acked as dead letters: not acked again
    keys: _Keys = field(default_factory=_Keys)
    argv_tail: list[Any] = field(default_factory=list)  # ARGV after the fixed head: records, blobs, dead letters
    rows: dict[str, _Rows] = field(default_factory=dict)
    accounts: dict[str, int] = field(default_factory=dict)
    acct_list: list[list[Any]] = field(default_factory=list)
    ack_ids: dict[str, list[str]] = field(default_factory=dict)
    in_blobs: list[int] = field(default_factory=list)
    close: list[list[Any]] = field(default_factory=list)
    settled: list[Delivery] = field(default_factory=list)
    head: int = len(COMPLETE_ARGV)

    def __post_init__(self) -> None:
        k = self.k
        for key in (k.worker_account, k.accounts_index, k.dead_letters, k.lease, k.lease_epoch, k.tally, k.call_guard,
                    k.moved):
            self.keys(key)
        self.own_act = k.base + ":act:"

    def account(self, account_id: str) -> int:
        """The account's number in the control (1-based), added on first use."""
        n = self.accounts.get(account_id)
        if n is None:
            self.acct_list.append([self.keys(self.k.billing_account(account_id)), account_id])
            n = self.accounts[account_id] = len(self.acct_list)
        return n

    def answer(self, a: Answer) -> None:
        o, job, k, keys = a.result, a.job, self.k, self.keys
        sid = o.session_id
        reply = a.reply or (job.reply if job is not None else sid)
        r = self.rows.get(reply)
        if r is None:
            r = self.rows[reply] = _Rows()
        i = r.add(o, job)
        account = a.account_id
        if account:
            r.acct.append(self.account(account))
            r.skey.append(keys(k.session_account(sid)))
        else:
            r.acct.append(0)
            r.skey.append(0)
        if r.status[i]:
            r.res[str(i)] = keys(k.result_record(o.job_id))
        if a.blob is not None:
            hidden = o.hidden
            if hidden is None or hidden.blob != k.activations_out(o.job_id):
                raise ValueError(f"output rows of {o.job_id} need result.hidden.blob = its activations_out key")
            self.argv_tail.append(a.blob)
            r.blob[str(i)] = [keys(hidden.blob), self.head + len(self.argv_tail)]
        if job is not None and job.hidden is not None and job.hidden.blob is not None \
                and job.hidden.blob.startswith(self.own_act):
            # a key outside this worker's tag (a job naming another worker's key) is never touched
            self.in_blobs.append(keys(job.hidden.blob))
        if a.final and isinstance(a.ref, Delivery):
            self.ack(a.ref)
        if a.close is not None:
            self.close.append([sid, keys(k.session_account(sid)), a.close, self.accounts.get(account or "", 0)])

    def plain_run(self, reply: str, run: list[Answer]) -> None:
        """`answer` for each of a run of plain answers (see _runs), column by column."""
        r = self.rows.get(reply)
        if r is None:
            r = self.rows[reply] = _Rows()
        i0, n = len(r.session_id), len(run)
        outs: list[Outcome] = [a.result for a in run]
        job_of: list[StepJob] = [a.job for a in run]  # type: ignore[misc]  # a plain answer has its job
        # a token's offset read from its result id (`<job>` or `<job>.<k>`: schemas/step.py result_job_id), as `add`
        # reads it (split_result_id, less its checks: the answers are this worker's own)
        rows = [(o.session_id, jid, off, j.attempt, j.start_position + off, o.position, o.token,
                 o.prompt_tokens + o.cached_tokens, o.cached_tokens, o.engine_seconds)
                for o, j in zip(outs, job_of, strict=True)
                for jid, rid in ((j.job_id, o.job_id),)
                for off in (0 if rid == jid else int(rid[len(jid) + 1:]),)]
        sids, jobs, offs, attempts, firsts, pos, tokens, fed, cached, seconds = zip(*rows, strict=True)
        r.session_id += sids
        r.job += jobs
        r.offset += offs
        r.attempt += attempts
        r.first_position += firsts
        r.status += repeat(0, n)
        r.position += pos
        r.token += tokens
        r.finished += repeat(0, n)
        r.fed_tokens += fed
        r.cached += cached
        r.engine_seconds += seconds
        for c in OPTIONAL_COLUMNS:  # as `add`: a column appears at its first value, 0 in the rows before
            vals = list(map(attrgetter(c), outs))
            col = r.optional.get(c)
            if col is not None:
                col += vals
            elif (k := next(compress(count(), vals), None)) is not None:
                r.optional[c] = [0] * (i0 + k) + vals[k:]
        keys = self.keys
        sks = list(map(self.k.session_account("").__add__, sids))
        accounts: list[str] = [a.account_id for a in run]  # type: ignore[misc]  # a plain answer is billed
        if len(set(sks)) == n and keys.index.keys().isdisjoint(sks):
            # every session's key a new KEYS entry (a call answers a session once): the entries in the order `answer`
            # adds them, each account first met here right before the session key of its first row
            r.skey += self._session_keys(sks, accounts)
            r.acct += map(self.accounts.__getitem__, accounts)
        else:
            for account, sk in zip(accounts, sks, strict=True):
                r.acct.append(self.account(account))
                r.skey.append(keys(sk))
        for a in run:
            if a.final and isinstance(a.ref, Delivery):
                self.ack(a.ref)

    def _session_keys(self, sks: list[str], accounts: list[str]) -> list[int]:
        """The KEYS indices of a run's session keys `sks`, each entered new; an account first met here is numbered
        and its billing key entered right before the session key of its first row."""
        keys = self.keys
        new = [a for a in dict.fromkeys(accounts) if a not in self.accounts]  # in the order of their first rows
        first_rows = [accounts.index(a) for a in new]
        added: list[str] = []
        at = 0
        for account, row in zip(new, first_rows, strict=True):
            added += sks[at:row]
            added.append(self.k.billing_account(account))
            at = row
        added += sks[at:]
        first = len(keys.keys) + 1
        keys.keys += added
        keys.index.update(zip(added, count(first)))
        for account in new:  # numbered in order; each finds its billing key entered above
            self.account(account)
        out: list[int] = []
        at = 0
        for shift, row in enumerate([*first_rows, len(sks)]):  # rows from `at` to `row` come after `shift` accounts
            out += range(first + at + shift, first + row + shift)
            at = row
        return out

    def ack(self, d: Delivery) -> None:
        if (d.stream, d.entry_id) not in self.dropped:
            self.ack_ids.setdefault(d.stream, []).append(d.entry_id)
            self.settled.append(d)

    def closure(self, c: Closure) -> None:
        n = self.account(c.account_id) if c.account_id else 0
        self.close.append([c.session_id, self.keys(self.k.session_account(c.session_id)), c.kind, n])

    def control(self, worker_id: str, call_id: str, batch: int) -> dict[str, Any]:
        """The records (encoded into the ARGV tail) and the control that names them."""
        records: list[dict[str, Any]] = []
        for reply, r in self.rows.items():
            self.argv_tail.append(encode_record(r.record(worker_id, call_id, batch)))
            self.argv_tail.append(_ENC.encode(r.script_columns()))
            n = self.head + len(self.argv_tail)
            records.append({"out": self.keys(self.k.results(reply)), "r": n - 1, "c": n, "acct": r.acct,
                            "skey": r.skey, "res": r.res, "blob": r.blob})
        return {"records": records, "accounts": self.acct_list,
                "acks": [[self.keys(s), ids] for s, ids in self.ack_ids.items()], "del": self.in_blobs,
                "close": self.close}


@dataclass(frozen=True, slots=True)
class CompletionCall:
    """One EVALSHA of consumer/lua/complete.lua, ready to send, and the deliveries it settles."""

    keys: list[str]
    args: list[Any]
    settled: list[Delivery]


def encode_filing(filing: Filing, k: WorkerKeys, head: Sequence[Any], *, worker_id: str, call_id: str,
                  consumer_name: str, fast_runs: bool = True) -> CompletionCall:
    """The completion call that files `filing` (no I/O): `head` is the fixed ARGV before the control
    (COMPLETE_ARGV), `call_id` the record's call ("<lease epoch>:<sequence>"). `fast_runs`: plain answers in runs
    (_runs); off, answer by answer (the definition, for tests)."""
    dead_letters, call = filing.dead_letters, filing.call
    b = _CallBuilder(k, dropped={(d.delivery.stream, d.delivery.entry_id) for d in dead_letters})
    for plain, reply, run in _runs(filing.answers, fast_runs):
        if plain:
            b.plain_run(reply, run)
        else:
            for a in run:
                b.answer(a)
    for d in filing.acks:
        b.ack(d)
    for c in filing.closures:
        b.closure(c)
    ctl = b.control(worker_id, call_id, call.batch_size if call is not None else 0)
    ctl["nd"] = len(dead_letters)
    if dead_letters:
        ctl["dead"] = b.head + len(b.argv_tail) + 1
        for dl in dead_letters:
            flat = dead_letter_fields(dl, consumer_name)
            sk = 0 if dl.delivery.stream == k.cancellations else b.keys(dl.delivery.stream)
            b.argv_tail += [sk, dl.delivery.entry_id, len(flat) // 2, *flat]
            b.settled.append(dl.delivery)
    if call is not None:
        if not math.isfinite(call.engine_seconds) or call.engine_seconds < 0:
            raise ValueError(f"engine_seconds must be finite and >= 0, not {call.engine_seconds}")
        ctl["call"] = [call.phase, int(call.batch_size), int(call.tokens), repr(float(call.engine_seconds))]
    return CompletionCall(b.keys.keys, [*head, _ENC.encode(ctl), *b.argv_tail], b.settled)


def dead_letter_fields(d: DeadLetter, consumer_name: str) -> list[str | bytes]:
    """A dead letter's fields: why, where from, and as much of the original entry as MAX_DEAD_LETTER_BYTES
    keeps (`truncated` when not all of it)."""
    out: list[str | bytes] = [
        "reason", d.reason.value, "detail", d.detail[:_DETAIL_MAX], "stream", d.delivery.stream,
        "entry_id", d.delivery.entry_id, "consumer", consumer_name,
    ]
    room = MAX_DEAD_LETTER_BYTES
    cut = False
    for i, (key, v) in enumerate(d.delivery.fields.items()):
        if i >= MAX_DEAD_LETTER_FIELDS or room <= 0:
            cut = True
            break
        raw = as_bytes(v)
        name, value = b"f:" + as_bytes(key)[:256], raw[:min(MAX_FIELD_BYTES, room)]
        cut = cut or len(value) < len(raw) or len(name) < len(as_bytes(key)) + 2
        room -= len(name) + len(value)
        out += [name, value]
    if cut:  # the copy is not the whole entry: never replay it as if it were
        out += ["truncated", "1"]
    return out


class Publisher:
    """Sends completion calls. One thread at a time (the worker's I/O thread, or its loop)."""

    def __init__(self, io: RedisIO, intake: Intake, lease: Lease) -> None:
        self.io = io
        self.intake = intake
        self.lease = lease
        self.seq = 0  # completion calls sent by this process (the script's call guard)
        st = io.settings
        # WAIT-based durability: a call counts once that many replicas have it (durable.py)
        self.durable = DurableScripts(io, st.durable_replicas, st.durable_timeout_ms) if st.durable_replicas > 0 \
            else None

    def complete(self, filing: Filing) -> list[str]:
        """File one completion call (consumer/lua/complete.lua): returns the charges of each record
        written, [] when there was nothing to file or the call had been filed already (a re-send)."""
        if not filing:
            return []
        io, st = self.io, self.io.settings
        head = [GROUP, st.result_ttl_s, st.result_maxlen, st.dlq_maxlen, st.reject_ttl_s, self.lease.token or "",
                self.lease.epoch, st.lease_ms, ACTIVATION_TTL_S, self.seq + 1]
        c = encode_filing(filing, io.keys, head, worker_id=io.worker_id, call_id=f"{self.lease.epoch}:{self.seq + 1}",
                          consumer_name=io.consumer_name)
        self.seq += 1
        try:
            # re-sent as is after a reconnect (or too few replicas): the call guard makes it a no-op
            reply_: Any = io.script("complete", c.keys, c.args) if self.durable is None else \
                self.durable.run("complete", c.keys, c.args)
        except redis.ResponseError as e:
            if str(e).startswith("DGRFENCED"):
                raise LeaseLost(f"worker {io.worker_id}: {e}") from None
            raise
        self.intake.settled(c.settled)
        if isinstance(reply_, bytes | str):  # 'DUP': filed by the first send
            return []
        return [as_bytes(x).decode() for x in reply_]
