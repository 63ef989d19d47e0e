"""The whole service path under drawn conditions, checked against each session run alone.

`run_scenario` drives producer -> real Redis -> worker loop (in a thread) -> engine -> results for a
drawn set of sessions, consumer settings, producer chunk size, arrival times, cancellations and a
worker crash (the worker and its engine are dropped at a drawn completion, before or after its Lua
call, and a fresh worker with a fresh engine takes over the same consumer name, as after kill -9). It
returns every session whose tokens differ from `oracle`: the session alone on an engine of its own,
prompt in one call, one row per decode step. Used by tests/test_invariance_property.py.

`make_engine` may return an `EngineSet` (a worker of several engines, docs/state-layouts.md): each
session then names its engine (`Session.engine`), is routed on that engine's key, and `solo` is asked
for it on that engine.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis

from consumer.batch import BatchRow, FusedBatch
from consumer.engines.base import Engine
from consumer.engines.engine_set import EngineSet
from consumer.prefix.run import prefix_summary
from consumer.sampling import RowContext, RowStatus, Vocabulary, sample_row
from consumer.sampling.grammar import Grammar, gbnf_of
from consumer.transport import RedisTransport
from consumer.worker import Worker, WorkerSettings
from producer import Producer
from schemas import CompatibilityKey, RouteHop, Sampling, SessionSpec
from schemas.prefix import PrefixSummary

_worker_ids = itertools.count()


@dataclass(frozen=True)
class Session:
    prompt: tuple[int, ...]
    sampling: Sampling
    max_tokens: int
    stop_at: int | None = None  # stop on the oracle's token number stop_at (a stop token that is hit)
    start_s: float = 0.0
    cancel_after: int | None = None  # cancel once this many tokens arrived
    n: int = 1  # tokens per decode job (the producer's decode_n for this session: a continuation job)
    engine: str = ""  # the worker's engine that serves it (a worker of several engines); "": the first


@dataclass(frozen=True)
class Conditions:
    n_slots: int = 8
    max_batch: int = 16
    prefill_budget: int = 512
    prefill_ratio: float = 0.8
    w_decode: int = 4
    w_prefill: int = 1
    prefill_chunk: int = 512
    crash_at: int | None = None  # crash at this completion of the first worker
    crash_before_lua: bool = True
    prefix_cache_bytes: int = 0  # the prefix cache (docs/prefix-cache.md): 0 off
    prefix_cache_scope: str = "account"


@dataclass
class Outcome:
    mismatches: list[str] = field(default_factory=list)
    crashed: bool = False
    replays: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens the last worker restored from its prefix cache
    cached_tokens: int = 0  # prompt tokens the sessions were charged as cached (SessionHandle.cached_tokens)
    info: dict[str, Any] = field(default_factory=dict)  # the last worker's heartbeat body at the end
    summary: PrefixSummary | None = None  # and the prefix summary it beats with


class _Crash(BaseException):
    """Stands for kill -9: raised inside the worker loop, never caught by it."""


_VOCABS: dict[int, Vocabulary] = {}


def oracle(engine: Engine, s: Session, stops: tuple[int, ...] = ()) -> list[int]:
    """The session alone: prompt in one call (the engine cuts it only above a micro-batch, never to
    one row), then one decode row per call; each token by the sampler's reference (`sample_row`, row by
    row with the session's whole context, on the engine's vocabulary: special tokens masked, a grammar
    caught up on every token). A row with no token (a complete grammar) ends the session."""
    vocab = _VOCABS.get(id(engine))
    if vocab is None:
        vocab = _VOCABS[id(engine)] = Vocabulary.for_engine(engine, engine.capacity.vocab_size)
    gbnf = gbnf_of(s.sampling)
    grammar = Grammar(vocab, gbnf) if gbnf is not None else None
    engine.release(0)
    prompt = s.prompt
    rows = [BatchRow(0, i, t, i == len(prompt) - 1) for i, t in enumerate(prompt)]
    logits = engine.step(FusedBatch.from_rows("prefill", rows))[0]
    pos, tokens = len(prompt), []
    try:
        while True:
            ctx = RowContext(np.asarray([*prompt, *tokens], dtype=np.int32), len(prompt), stops)
            t, status = sample_row(logits, s.sampling, pos, context=ctx, vocab=vocab, grammar=grammar)
            if status != RowStatus.OK:
                break
            tokens.append(t)
            if grammar is not None:
                grammar.accept(t)
            if len(tokens) >= s.max_tokens or t in stops:
                break
            logits = engine.step(FusedBatch.from_rows("decode", [BatchRow(0, pos, t, True)]))[0]
            pos += 1
    finally:
        if grammar is not None:
            grammar.close()
        engine.release(0)
    return tokens


class _Supervised:
    """The worker in a thread; after a simulated crash a fresh worker and engine take over."""

    def __init__(self, client: redis.Redis, wid: str, make_engine: Callable[[int], Engine | EngineSet],
                 c: Conditions) -> None:
        self.client, self.wid, self.make_engine, self.c = client, wid, make_engine, c
        self.settings = WorkerSettings(worker_id=wid, max_batch=c.max_batch, prefill_budget=c.prefill_budget,
                                       prefill_ratio=c.prefill_ratio, w_decode=c.w_decode, w_prefill=c.w_prefill,
                                       block_ms=5, await_ms=2, gather_ms=1.0,
                                       prefix_cache_bytes=c.prefix_cache_bytes, prefix_cache_scope=c.prefix_cache_scope)
        self.crashed = False
        self._lock = threading.Lock()
        self._stopping = False
        self.worker = self._new_worker(crash_at=c.crash_at)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _new_worker(self, crash_at: int | None) -> Worker:
        transport = RedisTransport(self.client, self.wid, consumer_name=self.wid)
        if crash_at is not None:
            real = transport.complete
            n = itertools.count(1)

            def complete(*a: Any, **k: Any) -> Any:
                if next(n) >= crash_at:
                    if self.c.crash_before_lua:
                        raise _Crash
                    real(*a, **k)
                    raise _Crash
                return real(*a, **k)

            transport.complete = complete  # type: ignore[method-assign]
        w = Worker(self.make_engine(self.c.n_slots), transport, self.settings)
        w.start()
        return w

    def _run(self) -> None:
        try:
            self.worker.run()
        except _Crash:
            self.crashed = True
            self.worker.engines.close()
            with self._lock:  # stop() may have come while the dead worker was being replaced
                if self._stopping:
                    return
                self.worker = self._new_worker(crash_at=None)
            self.worker.run()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self.worker.request_stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the worker thread did not stop"
        self.worker.engines.close()


def run_scenario(client: redis.Redis, sessions: list[Session], c: Conditions,
                 make_engine: Callable[[int], Engine | EngineSet],
                 solo: Callable[[Session, tuple[int, ...]], list[int]]) -> Outcome:
    wid = f"inv{next(_worker_ids)}"
    sup = _Supervised(client, wid, make_engine, c)
    engines = sup.worker.engines

    def key_of(s: Session) -> CompatibilityKey:
        return engines.keys_of(s.engine or next(iter(engines)))["prefill"]

    specs: list[tuple[SessionSpec, list[int]]] = []
    stops: dict[str, tuple[int, ...]] = {}
    for i, s in enumerate(sessions):
        sid = f"s{i}"
        stop: tuple[int, ...] = ()
        if s.stop_at is not None:
            full = solo(s, ())
            if s.stop_at < len(full):
                stop = (full[s.stop_at],)
        stops[sid] = stop
        specs.append((SessionSpec(session_id=sid, account_id=f"acct{i % 2}",
                                  route=(RouteHop(worker_id=wid, key=key_of(s)),), sampling=s.sampling,
                                  max_tokens=s.max_tokens, stop_tokens=stop), list(s.prompt)))
    producer = Producer(client, prefill_chunk=c.prefill_chunk, timeout_s=60, backpressure="wait",
                        max_attempts=5)
    cancelled: set[str] = set()
    by_sid = {f"s{i}": s for i, s in enumerate(sessions)}
    # n per session: the producer fixes a session's n when it opens it (producer/steps.py `tokens_per_job`), from
    # decode_n
    queue_prefill = producer.core.queue_prefill

    def per_session_n(batch: Any, h: Any, **kw: Any) -> None:
        h.credit.n = h.credit.n or by_sid[h.session_id].n
        queue_prefill(batch, h, **kw)

    producer.core.queue_prefill = per_session_n  # type: ignore[method-assign]

    def on_result(h: Any, _r: Any) -> None:
        s = by_sid[h.session_id]
        if s.cancel_after is not None and h.session_id not in cancelled and len(h.generated) >= s.cancel_after:
            cancelled.add(h.session_id)
            producer.cancel(wid, h.session_id)

    sup.thread.start()
    try:
        handles = producer.run_many(specs, on_result=on_result, start_times=[s.start_s for s in sessions])
    finally:
        sup.stop()
    out = Outcome(crashed=sup.crashed, prefix_hit_tokens=sum(
        lane.prefix.stats.hit_tokens for lane in sup.worker.lanes if lane.prefix is not None),
        info=sup.worker._info(), summary=prefix_summary(sup.worker.lanes, sup.worker.metrics))
    out.cached_tokens = sum(h.cached_tokens for h in handles.values())
    for sid, h in handles.items():
        s = by_sid[sid]
        want = solo(s, stops[sid])
        got = list(h.generated)
        out.replays += h.attempt
        if h.credit.n != s.n:
            out.mismatches.append(f"{sid}: ran with n = {h.credit.n}, not the drawn {s.n}")
        if sid in cancelled:
            if got != want[:len(got)]:
                out.mismatches.append(f"{sid} (cancelled): {got} is not a prefix of {want}")
        elif h.status != "finished" or got != want:
            out.mismatches.append(f"{sid}: status {h.status} ({h.reason} {h.detail}), tokens {got}, alone {want}")
        elif h.prompt_tokens != len(s.prompt):  # every prompt position charged once, cached or computed
            out.mismatches.append(f"{sid}: {h.prompt_tokens} prompt tokens charged, prompt of {len(s.prompt)}")
    return out


def random_prompt(rng: np.random.Generator, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(3, vocab, n))
