"""How step jobs and results travel as Redis stream entries: flat maps of short ASCII fields.

Decoding never raises anything but `WireError`, whose `reason` says what was wrong and whose
`session_id`/`job_id` are set when they could be read, so a consumer can answer the session
(`rejected`) instead of dead-lettering the entry. Parsing is strict (docs/wire-format.md, "Lexical
rules"): ids by full match, integers in plain ASCII decimal, booleans exactly `0`/`1`, no unknown
field. Whatever the producer writes passes; anything else is refused by name, never read leniently.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final, TypeVar

from pydantic import ValidationError

from .activations import Activations
from .limits import MAX_FIELD_BYTES, MAX_TOKENS_PER_JOB, SCHEMA_VERSION, is_id
from .session import SessionSpec
from .signing import SIGNATURE_FIELD
from .step import Accounting, Reason, Status, StepJob, StepResult

Fields = Mapping[bytes, bytes] | Mapping[str, str] | Mapping[bytes | str, bytes | str]
_SUPPORTED = str(SCHEMA_VERSION)
E = TypeVar("E", Status, Reason)

MAX_FIELDS: Final = 32  # more fields than any entry has: refused before anything is decoded
# Plain ASCII decimal: no sign, no spaces, no "_", no leading zero, no other script's digits.
_UINT: Final = re.compile(r"0|[1-9][0-9]{0,18}")
_TOKENS: Final = re.compile(r"(?:0|[1-9][0-9]{0,9})(?:,(?:0|[1-9][0-9]{0,9}))*")
# What repr(float) writes for a finite, non-negative float: digits, an optional fraction, an exponent.
_UFLOAT: Final = re.compile(r"[0-9]{1,20}(?:\.[0-9]{1,20})?(?:e[+-]?[0-9]{1,3})?")
_BOOL: Final = {"0": False, "1": True}
_JOB_FIELDS: Final = frozenset({"v", "job_id", "session_id", "hop", "phase", "compat", "pos", "tokens", "sample",
                                "attempt", "created_at", "session", "hidden", "n", SIGNATURE_FIELD})
_CANCEL_FIELDS: Final = frozenset({"session_id", SIGNATURE_FIELD})
_RESULT_FIELDS: Final = frozenset({"v", "job_id", "session_id", "status", "reason", "detail", "pos", "token",
                                   "finished", "prompt_tokens", "generated_tokens", "engine_seconds", "worker_id",
                                   "batch_size", "hidden", SIGNATURE_FIELD})


class WireError(ValueError):
    def __init__(self, reason: Reason, message: str, *, session_id: str | None = None,
                 job_id: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.session_id = session_id
        self.job_id = job_id


def _text(fields: Fields) -> dict[str, str]:
    """Field names (ASCII) and values (UTF-8) as str; every problem a WireError naming the ids if it can."""
    if len(fields) > MAX_FIELDS:
        raise WireError(Reason.MALFORMED, f"{len(fields)} fields, more than {MAX_FIELDS}")
    out: dict[str, str] = {}
    problem: str | None = None
    for k, val in fields.items():
        try:
            key = k.decode("ascii") if isinstance(k, bytes) else str(k)
        except UnicodeDecodeError:
            problem = problem or f"field name {k[:32]!r} is not ASCII"
            continue
        if len(val) > MAX_FIELD_BYTES:
            problem = problem or f"field {key!r} is {len(val)} bytes, over {MAX_FIELD_BYTES}"
            continue
        try:
            out[key] = val.decode("utf-8") if isinstance(val, bytes) else str(val)
        except UnicodeDecodeError:
            problem = problem or f"field {key!r} is not UTF-8"
    if problem:  # the ids may still be readable: then the session can be told
        raise WireError(Reason.MALFORMED, problem, **_ids(out))
    return out


def _ids(f: Mapping[str, str]) -> dict[str, str | None]:
    """The entry's ids, each only when it is a whole valid id (a full match, see limits.is_id)."""
    sid, jid = f.get("session_id"), f.get("job_id")
    return {"session_id": sid if is_id(sid) else None, "job_id": jid if is_id(jid) else None}


def _known(f: dict[str, str], known: frozenset[str], what: str) -> None:
    extra = sorted(set(f) - known)
    if extra:
        raise WireError(Reason.MALFORMED, f"unknown {what} fields {[x[:32] for x in extra[:4]]}", **_ids(f))


def _version(f: dict[str, str], what: str) -> None:
    v = f.get("v")
    if v is None:
        raise WireError(Reason.MALFORMED, f"{what} entry has no schema version field 'v'", **_ids(f))
    if v != _SUPPORTED:
        raise WireError(Reason.SCHEMA_VERSION,
                        f"{what} schema version {v[:16]!r} is not supported (supported: {_SUPPORTED})", **_ids(f))


def _field(f: dict[str, str], name: str) -> str:
    try:
        return f[name]
    except KeyError:
        raise WireError(Reason.MALFORMED, f"missing field {name!r}", **_ids(f)) from None


def _int(f: dict[str, str], name: str) -> int:
    raw = _field(f, name)
    if not _UINT.fullmatch(raw):
        raise WireError(Reason.MALFORMED, f"field {name!r} is not a plain decimal integer", **_ids(f))
    return int(raw)


def _float(f: dict[str, str], name: str) -> float:
    raw = _field(f, name)
    if not _UFLOAT.fullmatch(raw):
        raise WireError(Reason.MALFORMED, f"field {name!r} is not a plain decimal number", **_ids(f))
    return float(raw)


def _bool(f: dict[str, str], name: str) -> bool:
    value = _BOOL.get(_field(f, name))
    if value is None:
        raise WireError(Reason.MALFORMED, f"field {name!r} is not '0' or '1'", **_ids(f))
    return value


def _id(f: dict[str, str], name: str) -> str:
    raw = _field(f, name)
    if not is_id(raw):
        raise WireError(Reason.MALFORMED, f"field {name!r} is not an id (see docs/wire-format.md)", **_ids(f))
    return raw


def _validation(e: ValidationError, f: dict[str, str], what: str) -> WireError:
    first = e.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(entry)"
    reason = Reason.TOO_LONG if loc == "tokens" and first["type"].startswith("too_long") else Reason.MALFORMED
    return WireError(reason, f"invalid {what}: {loc}: {first['msg']}", **_ids(f))


def job_to_fields(job: StepJob) -> dict[str, str]:
    out = {
        "v": str(job.v), "job_id": job.job_id, "session_id": job.session_id, "hop": str(job.hop),
        "phase": job.phase, "compat": job.compat, "pos": str(job.start_position),
        "tokens": ",".join(map(str, job.tokens)), "sample": "1" if job.sample else "0",
        "attempt": str(job.attempt), "created_at": repr(job.created_at),
    }
    if job.session is not None:
        out["session"] = job.session.model_dump_json()
    if job.hidden is not None:
        out["hidden"] = job.hidden.model_dump_json(exclude_none=True)
    if job.n != 1:  # absent means 1: a job with n = 1 is the same entry as before continuation jobs
        out["n"] = str(job.n)
    return out


def _hidden(f: dict[str, str], rows: int | None) -> Activations | None:
    """The `hidden` field (an Activations header, strict JSON), or None; a bad one is `bad_activations`."""
    raw = f.get("hidden")
    if raw is None:
        return None
    try:
        acts = Activations.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "(header)"
        raise WireError(Reason.BAD_ACTIVATIONS, f"invalid activations: {loc}: {first['msg']}"[:200],
                        **_ids(f)) from None
    if rows is not None and acts.rows != rows:
        raise WireError(Reason.BAD_ACTIVATIONS, f"activations have {acts.rows} rows for {rows} tokens", **_ids(f))
    return acts


def job_from_fields(fields: Fields) -> StepJob:
    """A StepJob from a stream entry, by the rules of docs/wire-format.md. A `sig` field is ignored here
    (schemas/signing.py checks it)."""
    f = _text(fields)
    _version(f, "StepJob")  # before the field names: a newer version may add fields
    _known(f, _JOB_FIELDS, "StepJob")
    job_id, session_id = _id(f, "job_id"), _id(f, "session_id")
    tok = _field(f, "tokens")
    if tok.count(",") >= MAX_TOKENS_PER_JOB:
        raise WireError(Reason.TOO_LONG, f"more than {MAX_TOKENS_PER_JOB} tokens in one job", **_ids(f))
    if tok and not _TOKENS.fullmatch(tok):
        raise WireError(Reason.MALFORMED, "field 'tokens' is not a comma-separated list of plain decimal integers",
                        **_ids(f))
    tokens = tuple(int(t) for t in tok.split(",")) if tok else ()  # none: a continuation (decode only)
    hop, pos, attempt = _int(f, "hop"), _int(f, "pos"), _int(f, "attempt")
    sample, created_at = _bool(f, "sample"), _float(f, "created_at")
    n = _int(f, "n") if "n" in f else 1
    try:
        session = SessionSpec.model_validate_json(f["session"]) if "session" in f else None
    except ValidationError as e:
        raise WireError(Reason.MALFORMED, f"invalid StepJob: session: {e.errors()[0]['msg']}", **_ids(f)) from None
    hidden = _hidden(f, len(tokens))
    try:
        return StepJob(
            job_id=job_id, session_id=session_id, hop=hop,
            phase=_field(f, "phase"),  # type: ignore[arg-type]
            compat=_field(f, "compat"), start_position=pos, tokens=tokens, sample=sample, attempt=attempt,
            created_at=created_at, session=session, hidden=hidden, n=n,
        )
    except ValidationError as e:
        raise _validation(e, f, "StepJob") from None


def result_to_fields(r: StepResult) -> dict[str, str]:
    out = {
        "v": str(r.v), "job_id": r.job_id, "session_id": r.session_id, "status": r.status.value,
        "pos": str(r.position), "finished": "1" if r.finished else "0",
        "prompt_tokens": str(r.accounting.prompt_tokens),
        "generated_tokens": str(r.accounting.generated_tokens),
        "engine_seconds": repr(r.accounting.engine_seconds), "worker_id": r.worker_id,
        "batch_size": str(r.batch_size),
    }
    if r.reason is not None:
        out["reason"] = r.reason.value
    if r.detail:
        out["detail"] = r.detail
    if r.token is not None:
        out["token"] = str(r.token)
    if r.hidden is not None:
        out["hidden"] = r.hidden.model_dump_json(exclude_none=True)
    return out


def _enum(cls: type[E], f: dict[str, str], name: str) -> E:
    try:
        return cls(f[name])
    except (KeyError, ValueError):
        raise WireError(Reason.MALFORMED, f"field {name!r} is not one of {[m.value for m in cls]}", **_ids(f)) from None


def result_from_fields(fields: Fields) -> StepResult:
    f = _text(fields)
    _version(f, "StepResult")
    _known(f, _RESULT_FIELDS, "StepResult")
    try:
        return StepResult(
            job_id=_id(f, "job_id"), session_id=_id(f, "session_id"),
            status=_enum(Status, f, "status"),
            reason=_enum(Reason, f, "reason") if "reason" in f else None,
            detail=f.get("detail", ""), position=_int(f, "pos"),
            token=_int(f, "token") if "token" in f else None, finished=_bool(f, "finished"),
            accounting=Accounting(prompt_tokens=_int(f, "prompt_tokens"),
                                  generated_tokens=_int(f, "generated_tokens"),
                                  engine_seconds=_float(f, "engine_seconds")),
            worker_id=_id(f, "worker_id"), batch_size=_int(f, "batch_size"), hidden=_hidden(f, None),
        )
    except ValidationError as e:
        raise _validation(e, f, "StepResult") from None


def cancel_to_fields(session_id: str) -> dict[str, str]:
    """A cancellation entry (the worker's cancel stream)."""
    if not is_id(session_id):
        raise ValueError(f"session id {session_id[:80]!r} is not an id (see docs/wire-format.md)")
    return {"session_id": session_id}


def cancel_from_fields(fields: Fields) -> str:
    """The session id of a cancellation entry: exactly one field `session_id` (and `sig`), a whole id."""
    f = _text(fields)
    _known(f, _CANCEL_FIELDS, "cancellation")
    return _id(f, "session_id")
