"""Size limits and lexical rules every wire model enforces. One place, so producer and consumer agree."""

import re
from typing import Final

SCHEMA_VERSION: Final = 1  # the compatibility key's and the SessionSpec's version (golden digests pin it)
# The version of what travels on the streams: job entries and result records (docs/wire-format.md). Both
# sides refuse another one by name (Reason.SCHEMA_VERSION); a worker advertises its own in its info.
WIRE_VERSION: Final = 2

MAX_ID_LEN: Final = 64  # session, job, account and worker ids
# Pydantic (Rust regex) reads `$` as the end of the text. Python's `re` lets `$` match before a final
# "\n": never use this pattern with re.match/re.search, use `is_id` (a full match) instead.
ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"
MAX_TOKENS_PER_JOB: Final = 4096  # one prefill chunk at most; a decode job carries one (or none: a continuation)
# Most tokens one decode job may ask for (StepJob.n, a continuation job): the worker decodes the session
# at every decode call until n tokens, a stop token, max_tokens or a cancellation.
MAX_CONTINUATION: Final = 64
MAX_TOKEN_ID: Final = 2**31 - 1
MAX_POSITION: Final = 1 << 20
MAX_GENERATE: Final = 32768  # max_tokens of a session
MAX_STOP_TOKENS: Final = 16
MAX_ROUTE_HOPS: Final = 16
MAX_NAME_LEN: Final = 128  # architecture, quantization, runtime pin and other short names
MAX_REASON_LEN: Final = 256  # free-text detail of a rejection
MAX_DIMS: Final = 16  # entries of a state layout's dimension map
MAX_FIELD_BYTES: Final = 64 * 1024  # any one stream field on the wire, but a result record's
# A result record (one entry per completion call: every answer of a fused call, a hop's inline rows among
# them) is written by the worker alone (ACLs), and grows with the batch: bounded apart.
MAX_RECORD_BYTES: Final = 32 * 1024 * 1024

# Stream lengths (XADD MAXLEN ~, XTRIM) and TTLs of what several writers touch: one number each.
CANCEL_MAXLEN: Final = 100_000  # a worker's cancellation stream: the producer, the reaper and the worker's trim
RESULT_MAXLEN: Final = 10_000  # each result stream (one entry per completion call; the worker's default)
DLQ_MAXLEN: Final = 100_000  # a worker's dead-letter stream (the worker's default)
DLQ_AUDIT_MAXLEN: Final = 100_000  # a worker's dead-letter replay audit stream (dgr ops dlq replay)
CANCEL_MARKER_TTL_S: Final = 86_400  # a session's cancel marker: the producer's and the reaper's
SESSION_RECORD_TTL_S: Final = 86_400  # the producer's session record (what resume() rebuilds a handle from)
OUTAGE_MAX_S: Final = 120.0  # how long a worker or a producer rides through an unreachable Redis

# Boundary activations between route hops (schemas/activations.py, docs/wire-format.md "Activations").
ACTIVATIONS_VERSION: Final = 1  # the activation wire format (BoundarySchema.version of a hop)
INLINE_MAX_BYTES: Final = 16 * 1024  # raw rows up to this travel inline in the entry (a decode step)
MAX_HIDDEN_SIZE: Final = 1 << 16  # n_embd of any model dgr serves
MAX_ACTIVATION_BYTES: Final = 256 * 1024 * 1024  # one step's rows (4096 tokens x 16k f32), below Redis' 512 MiB
ACTIVATION_TTL_S: Final = 600  # a blob lives this long: the relay and the next hop's read happen well within

_ID_FULL: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


def is_id(value: object) -> bool:
    """Whether `value` is a str that is a whole id (session, job, account, worker): ASCII letters,
    digits, `_`, `.`, `-`, starting with a letter or digit, at most 64 characters. Nothing else: no
    trailing newline, no glob or hash-tag characters (`*`, `{`, `}`), so an id can never build a key
    outside its worker's hash tag or widen an ACL pattern."""
    return isinstance(value, str) and _ID_FULL.fullmatch(value) is not None


# Deeper JSON than any job has (a job body nests 4 levels: body, spec, route, hop key): refused before parsing,
# so a parser's recursion limit is never what stops an entry.
MAX_JSON_DEPTH: Final = 32
_JSON_SYNTAX: Final = re.compile(rb'\\.|["\[\]{}]', re.DOTALL)  # an escape (skipped whole), a quote, a bracket


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests arrays and objects deeper than `limit` (brackets inside strings do not
    count). A text with at most `limit` opening brackets cannot be: two C-speed counts on the hot path; only
    an entry with more (an opening with a long spec, a hostile one) is scanned, over its syntax characters."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth, in_string = 0, False
    for m in _JSON_SYNTAX.finditer(raw):
        c = m.group()
        if c == b'"':
            in_string = not in_string
        elif in_string or len(c) > 1:
            continue
        elif c in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False
