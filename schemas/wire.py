"""How step jobs and results travel as Redis stream entries (wire version 2, docs/wire-format.md).

A job entry is `v` (`2`), `j` (the job as strict JSON) and, with signing on, `sig`. A result entry is
one *record* per completion call and result stream: `v`, `r` (the worker's columnar record: one row
per answer, as SGLang's `BatchTokenIDOutput`) and `c` (what the completion script charged for each row,
written by the script itself, so a reader sees exactly what the counters moved). Cancellation entries
are one `session_id` field (and `sig`).

Decoding never raises anything but `WireError`, whose `reason` says what was wrong and whose
`session_id` / `job_id` / `reply_to` are set when they could be read, so a consumer can answer the
session (`rejected`) instead of only dead-lettering the entry. One strict codec (msgspec): JSON types
exactly as written (an int is never a float nor a string, a bool is `true`/`false`), no unknown key,
every value checked once (`StepJob.__post_init__`). Another version is refused by name
(`schema_version`), before anything else is read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec
from pydantic import ValidationError

from .activations import Activations
from .compat import Phase
from .errors import ActivationError, WireError
from .limits import (
    MAX_FIELD_BYTES,
    MAX_JSON_DEPTH,
    MAX_RECORD_BYTES,
    MAX_TOKENS_PER_JOB,
    WIRE_VERSION,
    is_id,
    json_too_deep,
)
from .reasons import Reason, Status
from .session import SessionSpec
from .signing import SIGNATURE_FIELD
from .step import END_OFFSET, Accounting, StepJob, StepResult, TokenLogprobs, row_result_id, split_result_id

__all__ = [
    "END_OFFSET", "OPTIONAL_COLUMNS", "STATUSES", "Charges", "ResultRecord", "RowExtra", "WireError",
    "cancel_from_fields", "cancel_to_fields", "decode_record", "encode_record", "job_from_fields", "job_to_fields",
    "record_fields", "results_from_fields", "results_to_fields", "row_extra", "row_result_id", "row_to_result",
    "split_result_id",
]

Fields = Mapping[bytes, bytes] | Mapping[str, str] | Mapping[bytes | str, bytes | str]
_VERSION: Final = str(WIRE_VERSION).encode()
_JOB_FIELDS: Final = frozenset({b"v", b"j", SIGNATURE_FIELD.encode()})
_RESULT_FIELDS: Final = frozenset({b"v", b"r", b"c"})
_CANCEL_FIELDS: Final = frozenset({"session_id", SIGNATURE_FIELD})
MAX_FIELDS: Final = 32  # more fields than any entry has: refused before anything is decoded
# A row's status travels as its index in this tuple.
STATUSES: Final[tuple[Status, ...]] = (Status.OK, Status.CANCELLED, Status.REJECTED, Status.STATE_LOST,
                                       Status.FAILED)
STATUS_CODE: Final[dict[Status, int]] = {s: i for i, s in enumerate(STATUSES)}


def _b(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


def _bytes_fields(fields: Fields, known: frozenset[bytes], what: str, limit: int = MAX_FIELD_BYTES
                  ) -> dict[bytes, bytes]:
    """The entry as bytes -> bytes, its version checked first (another version: schema_version, naming
    the v1 ids when they are there), then the field names and sizes."""
    if len(fields) > MAX_FIELDS:
        body = fields.get(b"j", fields.get("j")) if what == "job" else None  # type: ignore[call-overload]
        ids = _body_ids(_b(body)) if isinstance(body, bytes | str) and len(body) <= 4 * limit else {}
        raise WireError(Reason.MALFORMED, f"{len(fields)} fields, more than {MAX_FIELDS}", **ids)
    f = {k if type(k) is bytes else _b(k): v if type(v) is bytes else _b(v) for k, v in fields.items()}
    v = f.get(b"v")
    if v is None:
        raise WireError(Reason.MALFORMED, f"{what} entry has no version field 'v'", **_entry_ids(f, limit))
    if v != _VERSION:
        raise WireError(Reason.SCHEMA_VERSION,
                        f"{what} wire version {v[:16]!r} is not supported (this side speaks {WIRE_VERSION})",
                        **_entry_ids(f, limit))
    if not known.issuperset(f):
        extra = sorted(set(f) - known)
        # Whatever else is wrong, an entry whose session can be read is answered (docs/wire-format.md).
        raise WireError(Reason.MALFORMED, f"unknown {what} fields {[x[:32] for x in extra[:4]]}",
                        **_entry_ids(f, limit))
    for k, val in f.items():
        if len(val) > limit:
            # A job body over the limit still names its session when it is small enough to read for that.
            ids = _body_ids(val) if k == b"j" and len(val) <= 4 * limit else {}
            raise WireError(Reason.MALFORMED, f"field {k[:32]!r} is {len(val)} bytes, over {limit}", **ids)
    return f


def _entry_ids(f: Mapping[bytes, bytes], limit: int) -> dict[str, str | None]:
    """The ids of an entry refused before its body is decoded: its job body's (when small enough to read for
    them), else those of a version-1 entry's own fields."""
    body = f.get(b"j")
    return _body_ids(body) if body is not None and len(body) <= 4 * limit else _v1_ids(f)


def _v1_ids(f: Mapping[bytes, bytes]) -> dict[str, str | None]:
    """The ids a version-1 entry carried as fields of their own (so its session can be told)."""
    out: dict[str, str | None] = {}
    for name in ("session_id", "job_id"):
        raw = f.get(name.encode())
        try:
            value = raw.decode("ascii") if raw is not None else None
        except UnicodeDecodeError:
            value = None
        out[name] = value if is_id(value) else None
    return out


# ---------------------------------------------------------------------------------------------- jobs


class _JobBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The JSON of a job entry's `j` field. `session` and `hidden` stay raw here: a bad one has a reason
    of its own, and the SessionSpec is a pydantic model (decoded once per session)."""

    job_id: str
    session_id: str
    phase: str
    compat: str
    pos: int
    tokens: list[int]
    created_at: float | int
    hop: int = 0
    sample: bool = True
    attempt: int = 0
    n: int = 1
    with_opening: bool = False
    reply_to: str | msgspec.UnsetType = msgspec.UNSET  # absent: left out, never null
    # Raw JSON (empty: absent); `null` is refused: the producer leaves an absent field out.
    session: msgspec.Raw = msgspec.Raw()
    hidden: msgspec.Raw = msgspec.Raw()


class _Ids(msgspec.Struct):
    """What can still be read of a job body that is not valid: its ids, to tell its session."""

    job_id: Any = None
    session_id: Any = None
    reply_to: Any = None


def _shallow_ids(raw: bytes) -> _Ids:
    """The ids of a body nested too deep to parse: its top-level fields before the first nested value, when
    they are there (a producer writes job_id and session_id first), so its session can still be told."""
    cut = min((i for i in (raw.find(b"[", 1), raw.find(b"{", 1)) if i > 0), default=-1)
    head = raw[:cut] if cut > 0 else raw
    head = head[:head.rfind(b",")] + b"}" if b"," in head else head
    return _IDS.decode(head)


_BODY: Final = msgspec.json.Decoder(_JobBody)
_IDS: Final = msgspec.json.Decoder(_Ids)
_ENCODER: Final = msgspec.json.Encoder()


def _body_ids(raw: bytes) -> dict[str, str | None]:
    try:
        ids = _IDS.decode(raw) if not json_too_deep(raw) else _shallow_ids(raw)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return {}
    return {name: value if is_id(value) else None
            for name, value in (("session_id", ids.session_id), ("job_id", ids.job_id), ("reply_to", ids.reply_to))}


def job_to_fields(job: StepJob) -> dict[str, str]:
    """A job's stream entry (without `sig`: the signer adds it over these fields)."""
    body: dict[str, Any] = {
        "job_id": job.job_id, "session_id": job.session_id, "phase": job.phase, "compat": job.compat,
        "pos": job.start_position, "tokens": job.tokens, "created_at": float(job.created_at),
    }
    # Fields at their defaults are left out: the entry a producer wrote is the one the worker reads.
    for name, value, default in (("hop", job.hop, 0), ("sample", job.sample, True), ("attempt", job.attempt, 0),
                                 ("n", job.n, 1), ("with_opening", job.with_opening, False)):
        if value != default:
            body[name] = value
    if job.reply_to is not None:
        body["reply_to"] = job.reply_to
    if job.session is not None:
        body["session"] = msgspec.Raw(job.session.model_dump_json().encode())
    if job.hidden is not None:
        body["hidden"] = job.hidden
    return {"v": str(WIRE_VERSION), "j": _ENCODER.encode(body).decode()}


def job_from_fields(fields: Fields) -> StepJob:
    """A StepJob from a stream entry, by the rules of docs/wire-format.md. A `sig` field is ignored here
    (schemas/signing.py checks it)."""
    f = _bytes_fields(fields, _JOB_FIELDS, "job")
    raw = f.get(b"j")
    if raw is None:
        raise WireError(Reason.MALFORMED, "job entry has no field 'j'")
    if json_too_deep(raw):
        raise WireError(Reason.MALFORMED, f"job JSON nests deeper than {MAX_JSON_DEPTH}", **_body_ids(raw))
    try:
        body = _BODY.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
        raise WireError(Reason.MALFORMED, f"invalid job: {e}"[:200], **_body_ids(raw)) from None
    reply_to = None if body.reply_to is msgspec.UNSET else body.reply_to
    if len(body.tokens) > MAX_TOKENS_PER_JOB:
        raise WireError(Reason.TOO_LONG, f"more than {MAX_TOKENS_PER_JOB} tokens in one job", **_ids(body))
    try:
        session = SessionSpec.model_validate_json(bytes(body.session)) if body.session else None
    except ValidationError as e:
        raise WireError(Reason.MALFORMED, f"invalid job: session: {e.errors()[0]['msg']}"[:200], **_ids(body)) from None
    try:
        hidden = Activations.from_json(bytes(body.hidden)) if body.hidden else None
        if hidden is not None and hidden.rows != len(body.tokens):
            raise ActivationError(f"activations have {hidden.rows} rows for {len(body.tokens)} tokens")
    except ActivationError as e:
        raise WireError(Reason.BAD_ACTIVATIONS, str(e)[:200], **_ids(body)) from None
    phase: Phase = body.phase  # type: ignore[assignment]  # StepJob checks it
    try:
        return StepJob(job_id=body.job_id, session_id=body.session_id, phase=phase, compat=body.compat,
                       start_position=body.pos, tokens=tuple(body.tokens), created_at=body.created_at,
                       hop=body.hop, sample=body.sample, attempt=body.attempt, session=session, hidden=hidden,
                       n=body.n, reply_to=reply_to, with_opening=body.with_opening)
    except (ValueError, TypeError) as e:
        raise WireError(Reason.MALFORMED, f"invalid job: {e}"[:200], **_ids(body)) from None


def _ids(body: _JobBody) -> dict[str, str | None]:
    """The ids a refused job names where valid (its refusal goes there): made when a job is refused, not per job."""
    ids = {"session_id": body.session_id, "job_id": body.job_id, "reply_to": body.reply_to}
    return {k: v if isinstance(v, str) and is_id(v) else None for k, v in ids.items()}


# ------------------------------------------------------------------------------------------- results


class RowExtra(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """What a row carries besides its columns (rare): why it is not ok, and a hop's output activations."""

    reason: Reason | None = None
    detail: str = ""
    hidden: Activations | None = None
    logprobs: TokenLogprobs | None = None


class ResultRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The worker's answers of one completion call to one result stream, as columns under full names (row i
    is one answer; on the wire each column keeps its short name, docs/wire-format.md). A row's result id is
    `job[i]` for offset 0, `<job>.<off>` for a continuation's token `off`, `<job>.end` for `off ==
    END_OFFSET`. `fed_tokens`: positions the answer's job processed in prefill (the positions `pos - fed ..
    pos - 1`), before the charging rules (`Charges` says what was charged). `engine_seconds`: its share of
    engine seconds. `status`: index into STATUSES; `token` -1: no token; `finished` 1: finished.
    `first_position`: the first position the answer's step computed (the completion script sees a gap in a
    session's answers by it: docs/accounting.md).

    An *optional column* (default UNSET) is on the wire only when a row of the record has a value other
    than 0; its full name is also a field of `StepResult` and of the scheduler's `Outcome`, and every writer
    and reader carries it by that name (`OPTIONAL_COLUMNS`): adding one is this field, the `StepResult` field,
    and the scheduler setting its `Outcome`'s (docs/architecture.md, "What a change touches")."""

    worker_id: str = msgspec.field(name="worker")
    call: str  # "<lease epoch>:<sequence>": unique per completion call of a worker
    batch_size: int = msgspec.field(name="batch")  # sessions in the fused call (0: answers without one)
    session_id: list[str] = msgspec.field(name="sid")
    job: list[str]  # the job id (with offset: the row's result id)
    offset: list[int] = msgspec.field(name="off")
    attempt: list[int] = msgspec.field(name="att")
    status: list[int] = msgspec.field(name="st")
    position: list[int] = msgspec.field(name="pos")
    first_position: list[int] = msgspec.field(name="frm")
    token: list[int] = msgspec.field(name="tok")
    finished: list[int] = msgspec.field(name="fin")
    fed_tokens: list[int] = msgspec.field(name="fed")
    engine_seconds: list[float] = msgspec.field(name="es")
    extra: dict[str, RowExtra] = msgspec.field(default_factory=dict, name="x")  # row index (decimal) -> extra
    # Optional columns (see the docstring).
    prefill_calls: list[int] | msgspec.UnsetType = msgspec.field(default=msgspec.UNSET, name="pc")

    def __post_init__(self) -> None:
        n = len(self.session_id)
        if not all(len(getattr(self, c)) == n for c in _ROW_COLUMNS) \
                or not all(len(col) == n for c in OPTIONAL_COLUMNS if (col := getattr(self, c)) is not msgspec.UNSET):
            raise ValueError("columns of unequal length")
        if n and (min(self.status) < 0 or max(self.status) >= len(STATUSES)):
            raise ValueError("a status code out of range")
        for k in self.extra:
            if not k.isdigit() or int(k) >= n:
                raise ValueError(f"extra for a row that does not exist: {k[:16]!r}")

    def __len__(self) -> int:
        return len(self.session_id)

    def optional(self) -> dict[str, list[Any]]:
        """The optional columns this record has, by full name."""
        return {c: col for c in OPTIONAL_COLUMNS if (col := getattr(self, c)) is not msgspec.UNSET}


_FIELDS: Final = msgspec.structs.fields(ResultRecord)
# Per-row columns every record has, and the optional ones (by full name, in wire order).
_ROW_COLUMNS: Final = tuple(f.name for f in _FIELDS if f.name not in ("worker_id", "call", "batch_size", "extra")
                            and f.default is not msgspec.UNSET)
OPTIONAL_COLUMNS: Final = tuple(f.name for f in _FIELDS if f.default is msgspec.UNSET)


class Charges(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What the completion script charged for each row of a record (docs/accounting.md): prompt tokens,
    generated tokens, recomputed positions (not charged); `d` lists the rows it did not publish (an
    answer already published: a re-sent completion, a twin delivery); those charge nothing. `k`: of each
    row's prompt tokens, those restored from the worker's prefix cache (a part of `p`, billed at a
    Tracker's own rate); empty when no row of the record has any."""

    p: list[int]
    g: list[int]
    r: list[int]
    d: list[int]
    k: list[int] = msgspec.field(default_factory=list)


_RECORD: Final = msgspec.json.Decoder(ResultRecord)
_CHARGES: Final = msgspec.json.Decoder(Charges)


def encode_record(record: ResultRecord) -> bytes:
    return _ENCODER.encode(record)


def record_fields(record: bytes, charges: bytes | str) -> dict[str, bytes | str]:
    """A result entry as the completion script writes it (for tests and tools that write one)."""
    return {"v": str(WIRE_VERSION), "r": record, "c": charges}


def decode_record(fields: Fields) -> tuple[ResultRecord, Charges]:
    """The record and its charges of a result entry; WireError for anything else."""
    f = _bytes_fields(fields, _RESULT_FIELDS, "result", MAX_RECORD_BYTES)
    try:
        rec = _RECORD.decode(f[b"r"])
        chg = _CHARGES.decode(f[b"c"])
    except KeyError as e:
        raise WireError(Reason.MALFORMED, f"result entry has no field {e.args[0]!r}") from None
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise WireError(Reason.MALFORMED, f"invalid result record: {e}"[:200]) from None
    n = len(rec)
    if len(chg.p) != n or len(chg.g) != n or len(chg.r) != n or (chg.d and (min(chg.d) < 0 or max(chg.d) >= n)) \
            or (chg.k and (len(chg.k) != n or any(not 0 <= k <= p for k, p in zip(chg.k, chg.p, strict=True)))):
        raise WireError(Reason.MALFORMED, "charges do not match the record's rows")
    return rec, chg


def results_to_fields(results: Sequence[StepResult], *, call: str = "0:0") -> dict[bytes, bytes]:
    """A result entry holding `results` as rows, charged as their accounting says (what a worker's
    completion writes for fresh answers). For tests, tools and test doubles of a worker: a worker builds
    its records from its own answers (consumer/transport/publish.py)."""
    if not results:
        raise ValueError("a result entry holds at least one row")
    cols: dict[str, list[Any]] = {k: [] for k in _ROW_COLUMNS}
    x: dict[str, RowExtra] = {}
    for i, r in enumerate(results):
        job, off = split_result_id(r.job_id)
        cols["session_id"].append(r.session_id)
        cols["job"].append(job)
        cols["offset"].append(off)
        cols["attempt"].append(0)
        cols["status"].append(STATUS_CODE[r.status])
        cols["position"].append(r.position)
        cols["first_position"].append(max(0, r.position - 1))
        cols["token"].append(-1 if r.token is None else r.token)
        cols["finished"].append(int(r.finished))
        cols["fed_tokens"].append(r.accounting.prompt_tokens + r.accounting.recomputed_tokens)
        cols["engine_seconds"].append(r.accounting.engine_seconds)
        extra = row_extra(r)
        if extra is not None:
            x[str(i)] = extra
    for c in OPTIONAL_COLUMNS:
        values = [getattr(r, c) for r in results]
        if any(values):
            cols[c] = values
    rec = ResultRecord(worker_id=results[0].worker_id, call=call, batch_size=results[0].batch_size, extra=x, **cols)
    cached = [r.accounting.cached_tokens for r in results]
    chg = Charges(p=[r.accounting.prompt_tokens for r in results], g=[r.accounting.generated_tokens for r in results],
                  r=[r.accounting.recomputed_tokens for r in results], d=[], k=cached if any(cached) else [])
    return {b"v": _VERSION, b"r": encode_record(rec), b"c": _ENCODER.encode(chg)}


def row_to_result(rec: ResultRecord, chg: Charges, i: int) -> StepResult:
    """Row i of a record as a StepResult: the one conversion, used by every reader (`results_from_fields`,
    the producer's callbacks and `read_results`). Every column and extra reaches the result (tested:
    tests/test_result_rows.py). ValueError for a row StepResult refuses."""
    extra = rec.extra.get(str(i)) if rec.extra else None
    tok = rec.token[i]
    optional = {c: col[i] for c, col in rec.optional().items()}
    return StepResult(
        job_id=row_result_id(rec.job[i], rec.offset[i]), session_id=rec.session_id[i],
        status=STATUSES[rec.status[i]], position=rec.position[i], worker_id=rec.worker_id,
        reason=extra.reason if extra else None, detail=extra.detail if extra else "", token=None if tok < 0 else tok,
        finished=rec.finished[i] == 1,
        accounting=Accounting(prompt_tokens=chg.p[i], generated_tokens=chg.g[i], recomputed_tokens=chg.r[i],
                              engine_seconds=rec.engine_seconds[i], cached_tokens=chg.k[i] if chg.k else 0),
        batch_size=rec.batch_size, hidden=extra.hidden if extra else None,
        logprobs=extra.logprobs if extra else None, **optional)


def row_extra(r: StepResult) -> RowExtra | None:
    """What of `r` travels in a row's extra (None: nothing but its columns)."""
    if r.status == Status.OK and not r.detail and r.hidden is None and r.logprobs is None:
        return None
    return RowExtra(reason=r.reason, detail=r.detail, hidden=r.hidden, logprobs=r.logprobs)


def results_from_fields(fields: Fields) -> list[StepResult]:
    """Every published row of a result entry as a StepResult (rows the script did not publish, `d`,
    are left out). For tools, tests and callbacks: a Tracker's hot path reads the columns."""
    rec, chg = decode_record(fields)
    skip = set(chg.d)
    try:
        return [row_to_result(rec, chg, i) for i in range(len(rec)) if i not in skip]
    except ValueError as e:
        raise WireError(Reason.MALFORMED, f"invalid result row: {e}"[:200]) from None


# ------------------------------------------------------------------------------------- cancellations


def cancel_to_fields(session_id: str) -> dict[str, str]:
    """A cancellation entry (the worker's cancel stream)."""
    if not is_id(session_id):
        raise ValueError(f"session id {session_id[:80]!r} is not an id (see docs/wire-format.md)")
    return {"session_id": session_id}


def cancel_from_fields(fields: Fields) -> str:
    """The session id of a cancellation entry: exactly one field `session_id` (and `sig`), a whole id."""
    if len(fields) > MAX_FIELDS:
        raise WireError(Reason.MALFORMED, f"{len(fields)} fields, more than {MAX_FIELDS}")
    f: dict[str, bytes] = {}
    for k, v in fields.items():
        try:
            name = k.decode("ascii") if isinstance(k, bytes) else str(k)
        except UnicodeDecodeError:
            raise WireError(Reason.MALFORMED, "a field name is not ASCII") from None
        f[name] = _b(v)
    extra = sorted(set(f) - _CANCEL_FIELDS)
    if extra:
        raise WireError(Reason.MALFORMED, f"unknown cancellation fields {[x[:32] for x in extra[:4]]}")
    raw = f.get("session_id")
    try:
        sid = raw.decode("ascii") if raw is not None else None
    except UnicodeDecodeError:
        sid = None
    if not is_id(sid):
        raise WireError(Reason.MALFORMED, "field 'session_id' is not an id (see docs/wire-format.md)")
    assert sid is not None
    return sid
