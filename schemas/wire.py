"""How step jobs and results travel as Redis stream entries: flat maps of short ASCII fields.

Decoding never raises anything but `WireError`, whose `reason` says what was wrong and whose
`session_id`/`job_id` are set when they could be read, so a consumer can answer the session
(`rejected`) instead of dead-lettering the entry. See docs/wire-format.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TypeVar

from pydantic import ValidationError

from .limits import ID_PATTERN, MAX_FIELD_BYTES, MAX_TOKENS_PER_JOB, SCHEMA_VERSION
from .session import SessionSpec
from .step import Accounting, Reason, Status, StepJob, StepResult

Fields = Mapping[bytes, bytes] | Mapping[str, str] | Mapping[bytes | str, bytes | str]
_ID = re.compile(ID_PATTERN)
_SUPPORTED = str(SCHEMA_VERSION)
E = TypeVar("E", Status, Reason)


class WireError(ValueError):
    def __init__(self, reason: Reason, message: str, *, session_id: str | None = None,
                 job_id: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.session_id = session_id
        self.job_id = job_id


def _text(fields: Fields) -> dict[str, str]:
    out: dict[str, str] = {}
    problem: str | None = None
    for k, val in fields.items():
        key = k.decode("ascii", "replace") if isinstance(k, bytes) else str(k)
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


def _ids(f: dict[str, str]) -> dict[str, str | None]:
    sid, jid = f.get("session_id"), f.get("job_id")
    return {"session_id": sid if sid and _ID.match(sid) else None,
            "job_id": jid if jid and _ID.match(jid) else None}


def _version(f: dict[str, str], what: str) -> None:
    v = f.get("v")
    if v is None:
        raise WireError(Reason.MALFORMED, f"{what} entry has no schema version field 'v'", **_ids(f))
    if v != _SUPPORTED:
        raise WireError(Reason.SCHEMA_VERSION,
                        f"{what} schema version {v[:16]!r} is not supported (supported: {_SUPPORTED})", **_ids(f))


def _int(f: dict[str, str], name: str) -> int:
    try:
        return int(f[name])
    except KeyError:
        raise WireError(Reason.MALFORMED, f"missing field {name!r}", **_ids(f)) from None
    except ValueError:
        raise WireError(Reason.MALFORMED, f"field {name!r} is not an integer", **_ids(f)) from None


def _float(f: dict[str, str], name: str) -> float:
    try:
        return float(f[name])
    except KeyError:
        raise WireError(Reason.MALFORMED, f"missing field {name!r}", **_ids(f)) from None
    except ValueError:
        raise WireError(Reason.MALFORMED, f"field {name!r} is not a number", **_ids(f)) from None


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
    return out


def job_from_fields(fields: Fields) -> StepJob:
    f = _text(fields)
    _version(f, "StepJob")
    tok = f.get("tokens", "")
    if tok.count(",") >= MAX_TOKENS_PER_JOB:
        raise WireError(Reason.TOO_LONG, f"more than {MAX_TOKENS_PER_JOB} tokens in one job", **_ids(f))
    try:
        tokens = tuple(int(t) for t in tok.split(",")) if tok else ()
    except ValueError:
        raise WireError(Reason.MALFORMED, "field 'tokens' is not a comma-separated list of integers",
                        **_ids(f)) from None
    known = {"v", "job_id", "session_id", "hop", "phase", "compat", "pos", "tokens", "sample", "attempt",
             "created_at", "session"}
    extra = set(f) - known
    if extra:
        raise WireError(Reason.MALFORMED, f"unknown fields {sorted(extra)[:4]}", **_ids(f))
    try:
        session = SessionSpec.model_validate_json(f["session"]) if "session" in f else None
    except ValidationError as e:
        raise WireError(Reason.MALFORMED, f"invalid StepJob: session: {e.errors()[0]['msg']}", **_ids(f)) from None
    try:
        return StepJob(
            job_id=f.get("job_id", ""), session_id=f.get("session_id", ""), hop=_int(f, "hop"),
            phase=f.get("phase", ""),  # type: ignore[arg-type]
            compat=f.get("compat", ""), start_position=_int(f, "pos"), tokens=tokens,
            sample=f.get("sample") == "1", attempt=_int(f, "attempt"),
            created_at=_float(f, "created_at"), session=session,
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
    return out


def _enum(cls: type[E], f: dict[str, str], name: str) -> E:
    try:
        return cls(f[name])
    except (KeyError, ValueError):
        raise WireError(Reason.MALFORMED, f"field {name!r} is not one of {[m.value for m in cls]}", **_ids(f)) from None


def result_from_fields(fields: Fields) -> StepResult:
    f = _text(fields)
    _version(f, "StepResult")
    try:
        return StepResult(
            job_id=f.get("job_id", ""), session_id=f.get("session_id", ""),
            status=_enum(Status, f, "status"),
            reason=_enum(Reason, f, "reason") if "reason" in f else None,
            detail=f.get("detail", ""), position=_int(f, "pos"),
            token=_int(f, "token") if "token" in f else None, finished=f.get("finished") == "1",
            accounting=Accounting(prompt_tokens=_int(f, "prompt_tokens"),
                                  generated_tokens=_int(f, "generated_tokens"),
                                  engine_seconds=_float(f, "engine_seconds")),
            worker_id=f.get("worker_id", ""), batch_size=_int(f, "batch_size"),
        )
    except ValidationError as e:
        raise _validation(e, f, "StepResult") from None
