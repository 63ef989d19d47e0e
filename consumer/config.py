"""Every operational setting of a consumer, in one nested object, `ConsumerConfig`.

The defaults written here are the only ones, and so are the settings: `dgr consumer`'s options are
generated from these fields (consumer/cli_config.py: `--field-name`, environment variable
`DGR_FIELD_NAME`, the field's type and default, the help given to `setting`), the worker and the
transport take their part of the object as it is. A new setting is one field here, nothing else.

Stream lengths and TTLs several writers share come from schemas/limits.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from schemas.limits import CANCEL_MAXLEN, DLQ_MAXLEN, OUTAGE_MAX_S, RESULT_MAXLEN


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


SAMPLER_THREADS = max(1, min(4, _usable_cores()))  # the sampler's default (WorkerSettings.sampler_threads)

__all__ = ["DEFAULTS", "ConsumerConfig", "EngineSettings", "ServiceSettings", "TransportSettings", "WorkerSettings",
           "setting"]


def setting(default: Any, help: str, **option: Any) -> Any:
    """A setting's default and its one-line help (the `dgr consumer --help` text of its option); `option`: more
    of typer.Option's arguments (min, max)."""
    return field(default=default, metadata={"help": help, "option": option})


@dataclass(frozen=True)
class TransportSettings:
    """The client's socket_timeout (if set) must exceed block_ms, or a blocked read times out."""

    block_ms: int = setting(50, 'Idle blocking read (0: never block).')
    gather_ms: float = setting(2.0, 'After a wake-up, wait this long (ms) for the decode steps expected.')
    max_deliveries: int = setting(5, 'Dead-letter an entry delivered more than this many times.')
    result_ttl_s: int = setting(86_400, 'TTL of stored results and of the result streams.')
    # TTL of what an answer to a session this worker does not hold leaves behind (its result record;
    # its result stream, unless that lives longer): long enough for a caller to read it.
    reject_ttl_s: int = setting(300, 'How long answers to sessions this worker does not hold are kept.')
    result_maxlen: int = setting(RESULT_MAXLEN, 'MAXLEN ~ of each result stream.')
    dlq_maxlen: int = setting(DLQ_MAXLEN, 'MAXLEN ~ of the dead-letter stream.')
    cancel_maxlen: int = setting(CANCEL_MAXLEN, 'MAXLEN ~ the cancellation stream is trimmed to.')
    heartbeat_ttl_s: int = setting(10, 'TTL of the heartbeat key.')
    claim_count: int = setting(1_000, 'Entries claimed per stream per ownership sweep.')
    cancel_count: int = setting(10_000, 'Cancellations read per check.')
    # The lease: keep it well above the longest fused call plus the heartbeat period (it is renewed
    # with the heartbeat); a standby takes over this long after the holder stopped renewing.
    lease_ms: int = setting(10_000,
                            'Worker-id lease; a standby takes over this long after the holder stops renewing.')
    outage_max_s: float = setting(OUTAGE_MAX_S,
        "Ride through a Redis outage (and wait for Redis at start) this long, then exit 1.")
    retry_base_s: float = setting(0.05, 'First retry delay in an outage (doubles, with jitter).')
    retry_cap_s: float = setting(2.0, 'Longest retry delay in an outage.')
    # WAIT-based durability (docs/failover.md): a completion counts only once this many replicas have it
    # (0: off, Redis' asynchronous replication as is). Fewer within durable_timeout_ms: the completion is
    # re-sent (a no-op where it was filed) under the outage policy until they have it.
    durable_replicas: int = setting(0, min=0, help=
        "A completion counts only once this many replicas have it (WAIT; re-sent until they do, as in an outage). 0: "
        "off (docs/failover.md).")
    durable_timeout_ms: int = setting(200, min=1, help=
        "How long one completion waits for the replicas before it is re-sent (WAIT's timeout).")
    # consumer/transport/memory.py: a Redis that evicts at maxmemory loses jobs, answers, counters and leases
    allow_eviction: bool = setting(False, "Start even though Redis' maxmemory-policy is not noeviction (it may "
                                          "evict dgr's keys; docs/operations.md).")


@dataclass(frozen=True)
class WorkerSettings:
    worker_id: str = "worker-0"
    max_batch: int = setting(16, 'Decode sessions per fused call.')
    prefill_budget: int = setting(512, 'Most tokens per prefill call while sessions decode.')
    # No one waits for a call while no session decodes, so it takes what the engine runs in one call
    # (llama-server's batch), capped by the engine's n_batch.
    prefill_burst: int = setting(2048,
        "Most tokens per prefill call while no session decodes (0 or below the budget: the budget), capped by the "
        "engine's n_batch.")
    prefill_ratio: float = setting(0.8,
        "While sessions decode, size a prefill call to this fraction of a decode call's time (0: always the full "
        "budget).")
    # consumer/pacing.py states the bound
    prefill_floor: int = setting(32,
        "The pacer never sizes a prefill call below this many tokens, so a prompt's first token comes within a "
        "bounded number of fused calls (docs/operations.md).")
    # The prefix cache (docs/prefix-cache.md): who shares cached blocks by default is schemas/prefix.py salt_for.
    prefix_cache_bytes: int = setting(
        0, "Host-RAM budget of the prefix cache per engine, in bytes (0: off; docs/prefix-cache.md).")
    prefix_cache_scope: str = setting(
        "account", "Who shares cached prompt blocks by default: account, salt or global (docs/security.md).")
    w_decode: int = 4
    w_prefill: int = 1
    block_ms: int = TransportSettings.block_ms  # idle wait for the first entry
    gather_ms: float = TransportSettings.gather_ms  # after a wake-up, wait this long for the decode steps expected
    # How long to wait for the next steps of the sessions the last call answered, even with prefill
    # work queued: without it a prefill chunk slips into every gap while the Tracker turns a result
    # into its next step (a few ms), and decode gets one call in two instead of its weighted share.
    await_ms: int = setting(5, 'Wait this long for the next steps of the sessions just answered.')
    # also the lease's renewal period (kept under a quarter of the lease)
    heartbeat_s: float = setting(2.0, 'Heartbeat + stats period.')
    # the sweep: entries of dead consumer names, own entries not held
    recover_every_s: float = setting(5.0, 'Ownership sweep period.')
    standby: bool = True  # lease held by another live process: wait for it (False: refuse to start)
    exit_when_drained: bool = setting(
        False, "Drained (`dgr ops drain`) and holding nothing: stop, exit 0 (rolling upgrades).")
    # Answers remembered by result id (one per token), re-sent for a late duplicate of their job (a Tracker's
    # re-push after an outage): ~250 bytes each, so the default holds 1,024 tokens of 256 sessions (~64 MB).
    # consumer/worker/early.py: continuation jobs read before their session's prompt wait this long for it
    early_hold_s: float = setting(10.0, "Hold a continuation job read before its session's prompt this long (s).")
    # ... and up to this long while its prompt may still be unread (no read since got fewer prompt entries than it
    # asked for, or its session is open with the prompt short of it): a wave of long prompts keeps the reader from
    # the prefill stream.
    early_hold_max_s: float = setting(120.0, "Hold it up to this long while its prompt may still be unread (s).")
    answered_memory: int = setting(262_144, 'Answers remembered by job id, re-sent for a late duplicate.')
    # Entries one iteration may read in all. When entries read are refused at admission (malformed,
    # forged, for unknown sessions), the worker reads past them at once, doubling the read each time,
    # until the steps it wanted are admitted, the streams are empty or this many were read: a burst
    # of junk in front of honest steps costs one iteration, not one per `want` entries.
    max_read_entries: int = setting(1024, 'Most entries one loop iteration reads past refused ones.')
    max_slots_per_account: int = setting(0, 'Most open sessions one billing account may hold (0: no limit).')
    idle_session_s: float = setting(0.0, 'Cancel an open session with no step for this long (0: never).')
    # Publish fused call k's results (one Lua call, on a helper thread) while the loop reads, admits and
    # runs call k+1 (the engine releases the GIL); one publish in flight at a time, so a session's
    # results stay in order. docs/benchmarks.md has what it buys on 2 cores.
    overlap: bool = setting(True, "Publish a fused call's results while the next call runs.")
    # ... but only while fused calls are shorter than this (ms; 0: whatever their length): a long CPU call
    # has little to gain (the publish is a small share of it) and its spinning threads lose a core to the
    # publish (Gemma on 2 cores measured slower with it, the tiny model and the sleep engines faster).
    overlap_max_call_ms: float = setting(20.0,
                                         'Overlap only while fused calls take less than this (ms; 0: always).')
    # A longer call runs in the loop's thread (its cores are the engine's), but its Redis round trips still go
    # to the I/O thread: the next read while it computes, its filing while the loop builds the next call. What
    # the engine then waits for between two calls is the sampling and the scheduler, not Redis
    # (docs/benchmarks.md, issue 32: Gemma's idle per call, 1.5 ms of it the filing and 0.55 the read).
    overlap_io: bool = setting(True, "With overlap on, a call longer than overlap_max_call_ms still has its "
                                     "reads and filing on the I/O thread.")
    # With overlap on (calls on the engine thread), the decode call after the one computing is built while it
    # computes and the engine thread starts it at once, its inputs the argmax of the call before (plain greedy
    # rows only; consumer/sched/chaining.py): the engine waits neither for the loop's sampling and report nor
    # for the next batch and its hand-over.
    chain: bool = setting(True, "Start the next decode call on the engine thread as soon as the one before "
                                "ends (plain greedy sessions, overlap on).")
    # Threads sampling the rows of a call that need more than an argmax (numpy and llama.cpp's grammar
    # calls release the GIL). The engine waits for the sampled tokens (one call in flight), so its cores
    # are free while the loop samples, on a CPU worker too: up to 4, no more than this process may use.
    # Gemma, 8 JSON-schema sessions on 2 cores: json / greedy 0.73 with 1, 0.89 with 2 (docs/benchmarks.md).
    sampler_threads: int = setting(SAMPLER_THREADS,
                                   "Threads sampling rows with controls (1: in the loop's thread).")


@dataclass(frozen=True)
class EngineSettings:
    # 'tiny', 'gemma' or a GGUF path; several: one engine each in this worker, `[NAME=]MODEL[,slots=N][,ctx=N]
    # [,recipe=R][,weight=W]` (consumer/runtime.py `model_choice`, docs/state-layouts.md)
    model: tuple[str, ...] = ("tiny",)
    kind: str = "llama"  # 'llama' (llama.cpp) or 'reference' (NumPy)
    recipe: str = "invariant"  # 'invariant' (bit-identical in any batch) or 'fast'
    slots: int = setting(16, 'Sequence slots (concurrent sessions).')
    ctx_per_session: int = setting(1024, 'Context positions per session.')
    threads: int = setting(0, 'CPU threads (0: llama.cpp default).')
    n_gpu_layers: int = setting(0, 'Layers offloaded to the GPU.')
    # consumer/engines/cpu_wait.py
    cpu_wait: str = setting("auto",
        "llama.cpp's CPU threads at barriers: spin (alone), sleep (beside other busy processes), auto (sleep if the "
        "machine is busy at start).")
    # consumer/engines/llama.py `_extra_bufts`
    repack: str = setting("off",
        "llama.cpp's repacked weight buffers (llama-server's default): off, on, or auto (recipe fast repacks "
        "unless an AMX build meets a CPU advertising AMX; invariant never).")


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
    metrics_port: int = setting(0, 'Prometheus port (0: off).')
    metrics_addr: str = setting("127.0.0.1", 'Address the Prometheus endpoint listens on.')
    max_idle_s: float = setting(0.0, 'Exit after this long idle (0: never).')
    log_level: str = setting("INFO", 'DEBUG, INFO, WARNING or ERROR.')
    log_format: str = setting("json", "'json' or 'text'.")
    # Python's cyclic GC runs a young collection every gc_young allocations (700 by default): a worker allocates
    # a few objects per token, nearly all freed by reference counting, and the collections (older passes over the
    # whole heap among them) ran between two calls. docs/benchmarks.md (issue 32) counted and measured them.
    gc_young: int = setting(20_000, min=0, help=
        "Allocations between two young-generation garbage collections in this process (0: Python's default).")
    llama_log: str = setting("debug",
        "The level llama.cpp's INFO lines (the loader's) are logged at: 'debug' (seen with --log-level DEBUG) or "
        "'info'.")


@dataclass(frozen=True)
class ConsumerConfig:
    """One consumer process's settings: `dgr consumer`'s options, nested by the part that reads them."""

    service: ServiceSettings = field(default_factory=ServiceSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    transport: TransportSettings = field(default_factory=TransportSettings)


DEFAULTS = ConsumerConfig()
