"""Every operational setting of a consumer, in one nested object, `ConsumerConfig`.

The defaults written here are the only ones: `dgr consumer` reads each option's default (and so the
default of its DGR_* environment variable) from `DEFAULTS`, the worker and the transport take their
part of the object as it is. A new setting is a field here plus one option in consumer/cli.py that
names it.

Stream lengths and TTLs several writers share come from schemas/limits.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from schemas.limits import CANCEL_MAXLEN, DLQ_MAXLEN, OUTAGE_MAX_S, RESULT_MAXLEN


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


SAMPLER_THREADS = max(1, min(4, _usable_cores()))  # the sampler's default (WorkerSettings.sampler_threads)

__all__ = ["DEFAULTS", "ConsumerConfig", "EngineSettings", "ServiceSettings", "TransportSettings", "WorkerSettings"]

@dataclass(frozen=True)
class TransportSettings:
    """The client's socket_timeout (if set) must exceed block_ms, or a blocked read times out."""

    block_ms: int = 50  # idle blocking read (<= 0: never block)
    gather_ms: float = 2.0  # bounded gather window after a wake-up (<= 0: no gather)
    max_deliveries: int = 5  # past this, dead-letter
    result_ttl_s: int = 86_400  # TTL of stored results (SET NX EX) and of the result streams
    # TTL of what an answer to a session this worker does not hold leaves behind (its result record;
    # its result stream, unless that lives longer): long enough for a caller to read it.
    reject_ttl_s: int = 300
    result_maxlen: int = RESULT_MAXLEN  # MAXLEN ~ of each result stream
    dlq_maxlen: int = DLQ_MAXLEN
    cancel_maxlen: int = CANCEL_MAXLEN
    heartbeat_ttl_s: int = 10
    claim_count: int = 1_000  # entries claimed per stream per recover()
    cancel_count: int = 10_000  # cancellations read per check
    # The lease: keep it well above the longest fused call plus the heartbeat period (it is renewed
    # with the heartbeat); a standby takes over this long after the holder stopped renewing.
    lease_ms: int = 10_000
    outage_max_s: float = OUTAGE_MAX_S  # give up (re-raise) after Redis was unreachable this long
    retry_base_s: float = 0.05  # first retry delay; doubles up to retry_cap_s, with jitter
    retry_cap_s: float = 2.0
    # WAIT-based durability (docs/failover.md): a completion counts only once this many replicas have it
    # (0: off, Redis' asynchronous replication as is). Fewer within durable_timeout_ms: the completion is
    # re-sent (a no-op where it was filed) under the outage policy until they have it.
    durable_replicas: int = 0
    durable_timeout_ms: int = 200


@dataclass(frozen=True)
class WorkerSettings:
    worker_id: str = "worker-0"
    max_batch: int = 16
    prefill_budget: int = 512  # the most tokens one prefill call may carry
    prefill_ratio: float = 0.8  # size prefill calls to this fraction of a decode call's time; 0: fixed budget
    # ... but never below this many tokens: with it a prompt's first token comes within a bounded number
    # of fused calls however long decode calls get (consumer/pacing.py states the bound)
    prefill_floor: int = 32
    # The prefix cache (docs/prefix-cache.md): host-RAM bytes of saved prompt states per engine (0: off)
    # and who shares cached blocks by default (schemas/prefix.py salt_for: account, salt, global).
    prefix_cache_bytes: int = 0
    prefix_cache_scope: str = "account"
    w_decode: int = 4
    w_prefill: int = 1
    block_ms: int = TransportSettings.block_ms  # idle wait for the first entry
    gather_ms: float = TransportSettings.gather_ms  # after a wake-up, wait this long for the decode steps expected
    # How long to wait for the next steps of the sessions the last call answered, even with prefill
    # work queued: without it a prefill chunk slips into every gap while the Tracker turns a result
    # into its next step (a few ms), and decode gets one call in two instead of its weighted share.
    await_ms: int = 5
    heartbeat_s: float = 2.0  # heartbeat and lease renewal period (keep it well under the lease)
    recover_every_s: float = 5.0  # ownership sweep: entries of dead consumer names, own entries not held
    standby: bool = True  # lease held by another live process: wait for it (False: refuse to start)
    # Answers remembered by result id (one per token), re-sent for a late duplicate of their job (a Tracker's
    # re-push after an outage): ~250 bytes each, so the default holds 1,024 tokens of 256 sessions (~64 MB).
    answered_memory: int = 262_144
    # Entries one iteration may read in all. When entries read are refused at admission (malformed,
    # forged, for unknown sessions), the worker reads past them at once, doubling the read each time,
    # until the steps it wanted are admitted, the streams are empty or this many were read: a burst
    # of junk in front of honest steps costs one iteration, not one per `want` entries.
    max_read_entries: int = 1024
    max_slots_per_account: int = 0  # most open sessions per billing account (0: no limit)
    idle_session_s: float = 0.0  # cancel an open session with no step for this long (0: never)
    # Publish fused call k's results (one Lua call, on a helper thread) while the loop reads, admits and
    # runs call k+1 (the engine releases the GIL); one publish in flight at a time, so a session's
    # results stay in order. docs/benchmarks.md has what it buys on 2 cores.
    overlap: bool = True
    # ... but only while fused calls are shorter than this (ms; 0: whatever their length): a long CPU call
    # has little to gain (the publish is a small share of it) and its spinning threads lose a core to the
    # publish (Gemma on 2 cores measured slower with it, the tiny model and the sleep engines faster).
    overlap_max_call_ms: float = 20.0
    # Threads sampling the rows of a call that need more than an argmax (numpy and llama.cpp's grammar
    # calls release the GIL). The engine waits for the sampled tokens (one call in flight), so its cores
    # are free while the loop samples, on a CPU worker too: up to 4, no more than this process may use.
    # Gemma, 8 JSON-schema sessions on 2 cores: json / greedy 0.73 with 1, 0.89 with 2 (docs/benchmarks.md).
    sampler_threads: int = SAMPLER_THREADS


@dataclass(frozen=True)
class EngineSettings:
    # 'tiny', 'gemma' or a GGUF path; several: one engine each in this worker, `[NAME=]MODEL[,slots=N][,ctx=N]
    # [,recipe=R][,weight=W]` (consumer/runtime.py `model_choice`, docs/state-layouts.md)
    model: tuple[str, ...] = ("tiny",)
    kind: str = "llama"  # 'llama' (llama.cpp) or 'reference' (NumPy)
    recipe: str = "invariant"  # 'invariant' (bit-identical in any batch) or 'fast'
    slots: int = 16  # sequence slots (concurrent sessions)
    ctx_per_session: int = 1024
    threads: int = 0  # CPU threads (0: llama.cpp default)
    n_gpu_layers: int = 0
    # How llama.cpp's CPU threads wait at barriers: 'spin' (fastest alone), 'sleep' (robust beside other
    # busy processes), 'auto' (sleep when the machine is busy at start): consumer/engines/cpu_wait.py
    cpu_wait: str = "auto"


@dataclass(frozen=True)
class ServiceSettings:
    """The process around the worker: Redis, metrics, logs, when to stop."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    # Sentinel (consumer/connect.py): the master `sentinel_master` those sentinels watch, reached with the
    # URL's user, password, db and TLS; the sentinels' own credentials apart.
    redis_sentinel: str = ""  # host:port[,host:port...]; empty: the URL's host
    sentinel_master: str = ""
    sentinel_username: str = ""
    sentinel_password: str = ""
    redis_cluster: bool = False  # the URL names a Redis Cluster node
    metrics_port: int = 0  # Prometheus port (0: off)
    metrics_addr: str = "127.0.0.1"
    max_idle_s: float = 0.0  # exit after this long idle (0: never)
    log_level: str = "INFO"
    log_format: str = "json"  # 'json' or 'text'


@dataclass(frozen=True)
class ConsumerConfig:
    """One consumer process's settings: `dgr consumer`'s options, nested by the part that reads them."""

    service: ServiceSettings = field(default_factory=ServiceSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    transport: TransportSettings = field(default_factory=TransportSettings)


DEFAULTS = ConsumerConfig()
