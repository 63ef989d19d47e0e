"""Every Redis key name dgr uses, built in one place.

All keys of one worker share the hash tag `{<worker-id>}`, so a multi-stream read or a Lua script
over them stays in one Redis Cluster slot. Scripts get every key they touch through KEYS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from .compat import Phase

PREFIX: Final = "dgr"
GROUP: Final = "dgr-workers"  # the consumer group on every input stream
WORKERS_INDEX: Final = f"{PREFIX}:workers"  # set of worker ids that ever advertised (not hash-tagged)
# worker -> when a look of `dgr ops forget-gone` first found it gone (ms, Redis' clock: consumer/ops/forget.py)
WORKERS_GONE: Final = f"{PREFIX}:workers:gone"
ALL_KEYS: Final = f"{PREFIX}:*"  # every dgr key (the control plane's ACL pattern)

# The cross-worker ledger (written by the control plane's roll-up): one hash per billing account plus an
# index. They share the `{ledger}` hash tag (one Cluster slot), never a worker's tag: the roll-up reads
# each worker's slot, then writes the ledger slot, one slot per call.
LEDGER_TAG: Final = "{ledger}"
LEDGER_INDEX: Final = f"{PREFIX}:{LEDGER_TAG}:accounts"


def ledger_key(account_id: str) -> str:
    return f"{PREFIX}:{LEDGER_TAG}:account:{account_id}"


@dataclass(frozen=True, slots=True)
class WorkerKeys:
    worker_id: str
    # f"{PREFIX}:{{worker_id}}", made once: every key below starts with it, several per answer filed
    base: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "base", f"{PREFIX}:{{{self.worker_id}}}")

    @property
    def all_pattern(self) -> str:
        """Every key of this worker (its ACL pattern)."""
        return f"{self.base}:*"

    def input_stream(self, digest: str, phase: Phase) -> str:
        return f"{self.base}:in:{digest}:{phase}"

    @property
    def input_pattern(self) -> str:
        return f"{self.base}:in:*"

    def results(self, reply: str) -> str:
        """The result stream named by a job's `reply_to` (one per Tracker), or by its session id when the
        job names none: one result record per completion call (schemas/wire.py)."""
        return f"{self.base}:out:{reply}"

    @property
    def results_pattern(self) -> str:
        return f"{self.base}:out:*"

    def result_record(self, job_id: str) -> str:
        """The once-only marker of an answer that is not ok (SET NX, with its record): ok answers are
        made once-only by the session's ledger entry (docs/accounting.md)."""
        return f"{self.base}:res:{job_id}"

    @property
    def call_guard(self) -> str:
        """String '<lease epoch> <sequence>' of the last completion call filed (consumer/lua/complete.lua):
        a completion re-sent after a reconnect whose first send ran is refused whole."""
        return f"{self.base}:guard"

    @property
    def moved(self) -> str:
        """Hash: session id -> the attempt the Tracker moved off this worker when it declared the worker lost
        (producer/moves.py). complete.lua neither publishes nor charges an answer of that attempt or an
        older one, so a worker that was only paused and comes back charges nothing the session's new
        worker charges again (docs/accounting.md); the field goes when the session closes here."""
        return f"{self.base}:moved"

    @property
    def tally(self) -> str:
        """Hash: one field per session this worker charges and has not closed (docs/accounting.md): what
        it charged since the field was made, and the positions answered and charged so far."""
        return f"{self.base}:tally"

    def activations_in(self, job_id: str) -> str:
        """String (EX ACTIVATION_TTL_S): the input activations of job `job_id` on this worker, written by
        the Tracker (a prefill chunk's rows; a decode step's travel inline). Deleted when the job is
        answered."""
        return f"{self.base}:act:in:{job_id}"

    def activations_out(self, job_id: str) -> str:
        """String (EX ACTIVATION_TTL_S): the output activations this worker answered job `job_id` with,
        written by its completion script; the Tracker reads it and relays the rows to the next hop."""
        return f"{self.base}:act:out:{job_id}"

    @property
    def activations_pattern(self) -> str:
        return f"{self.base}:act:*"

    @property
    def dead_letters(self) -> str:
        return f"{self.base}:dlq"

    @property
    def cancellations(self) -> str:
        return f"{self.base}:cancel"

    def session_account(self, session_id: str) -> str:
        return f"{self.base}:acct:session:{session_id}"

    @property
    def session_account_pattern(self) -> str:
        """SCAN MATCH for every session accounting hash of this worker."""
        return self.session_account("*")

    def session_id_of(self, session_account_key: str) -> str:
        """The session id of a `session_account` key."""
        return session_account_key[len(self.session_account("")):]

    def billing_account(self, account_id: str) -> str:
        return f"{self.base}:acct:account:{account_id}"

    @property
    def worker_account(self) -> str:
        return f"{self.base}:acct:worker"

    @property
    def accounts_index(self) -> str:
        """Set of billing account ids this worker has charged (for roll-ups)."""
        return f"{self.base}:acct:accounts"

    @property
    def spec(self) -> str:
        """The advertised compatibility keys and capacity (JSON)."""
        return f"{self.base}:spec"

    @property
    def heartbeat(self) -> str:
        return f"{self.base}:hb"

    @property
    def prefix_summary(self) -> str:
        """The prefix cache's summary (JSON PrefixSummary with its version), written when it changes; the
        heartbeat names its version, so a Tracker reads it only when that changed (docs/wire-format.md)."""
        return f"{self.base}:prefix"

    @property
    def lease(self) -> str:
        """'<epoch>:<instance>' of the one consumer process serving this worker id (SET NX PX)."""
        return f"{self.base}:lease"

    @property
    def lease_epoch(self) -> str:
        """Counts lease acquisitions: a holder whose epoch is no longer current is fenced."""
        return f"{self.base}:lease:epoch"

    def cancel_marker(self, session_id: str) -> str:
        """Set (with a TTL) by whoever cancels the session: a cancellation as state, not only an event."""
        return f"{self.base}:cancelled:{session_id}"

    def session_record(self, session_id: str) -> str:
        """The Tracker's record of a session (spec, prompt, attempt): rebuilds a handle in any process."""
        return f"{self.base}:sess:{session_id}"

    # Written by the control plane (consumer/ops), same hash tag as the worker's own keys.
    @property
    def dlq_audit(self) -> str:
        """Stream: one entry per dead-letter replay (who, when, which, into what)."""
        return f"{self.base}:dlq:audit"

    def dlq_replayed(self, dlq_id: str) -> str:
        """String, SET NX: the id the dead letter `dlq_id` was replayed as (never twice)."""
        return f"{self.base}:dlq:replayed:{dlq_id}"

    @property
    def drain(self) -> str:
        """String (JSON {at, by}), set by `dgr ops drain`: place no new session here (docs/placement.md)."""
        return f"{self.base}:drain"


# Every worker's keys as glob patterns (`dgr:{*}:...`): what ACL rules over all workers name.
ANY_WORKER: Final = WorkerKeys("*")


def parse_input_stream(name: str) -> tuple[str, str, Phase] | None:
    """(worker_id, digest, phase) of an input stream key, or None if it is not one."""
    try:
        head, rest = name.split(":{", 1)
        worker, tail = rest.split("}:", 1)
        kind, digest, phase = tail.split(":")
    except ValueError:
        return None
    if head != PREFIX or kind != "in" or phase not in ("prefill", "decode"):
        return None
    return worker, digest, phase  # type: ignore[return-value]
