"""Routes of several hops, worker side, on a real redis-server: layer-range workers relayed by a small
test Tracker (tests/hop_driver.py) give the whole model's tokens bit for bit; hop steps never share a
fused call with whole-model steps; cancellation reaches a hop; activations blobs do not outlive their
jobs; accounting charges billable tokens on the last hop only."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.engines.llama import LlamaCppEngine
from consumer.engines.reference import NumpyReferenceEngine
from dgrtools.split_model import split_route
from dgrtools.tiny_model import write_tiny_model
from schemas import Reason, Sampling, Status, StepJob, WorkerKeys, job_to_fields
from schemas.activations import encode

from .hop_driver import RouteDriver, make_hop_worker
from .support import prompts, solo_generate

SOAK = os.environ.get("DGR_SOAK") == "1"  # DGR_SOAK=1: the long searches

N_LAYER = 4
_ids = itertools.count()


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hops") / "tiny-l4.gguf"
    write_tiny_model(path, seed=0, quant="q8_0", n_layer=N_LAYER)
    return path


@pytest.fixture(scope="module")
def whole(deep_model: Path) -> Iterator[NumpyReferenceEngine]:
    eng = NumpyReferenceEngine(deep_model, n_slots=1, ctx_per_session=512)
    yield eng
    eng.close()


def _route(client: redis.Redis, model: Path, cuts: tuple[int, ...], n_slots: int = 8,
           **kw: object) -> RouteDriver:
    bounds = [0, *cuts, N_LAYER]
    tag = next(_ids)
    workers = []
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        eng = NumpyReferenceEngine(model, n_slots=n_slots, ctx_per_session=512, layers=(a, b))
        workers.append(make_hop_worker(client, eng, f"r{tag}-hop{k}", **kw))
    return RouteDriver(client, workers)


def _check_exact(d: RouteDriver, whole: NumpyReferenceEngine, ps: list[list[int]], max_tokens: int) -> None:
    assert not d.failures(), d.failures()[:3]
    for i, p in enumerate(ps):
        assert d.tokens[f"s{i}"] == solo_generate(whole, p, max_tokens), f"s{i} (prompt of {len(p)})"


@pytest.mark.parametrize("cuts", [(2,), (1, 3)], ids=["2-hop", "3-hop"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_a_route_of_hops_equals_the_whole_model(real_redis: redis.Redis, deep_model: Path,
                                                whole: NumpyReferenceEngine, cuts: tuple[int, ...], n: int) -> None:
    d = _route(real_redis, deep_model, cuts)
    # long (several prefill chunks, blobs) and short (inline) prompts, together
    longs = prompts(n - n // 2, 500, seed=n, lo=70, hi=140)
    shorts = prompts(n // 2, 500, seed=n + 1, lo=3, hi=12)
    ps = [p for i in range(n) for p in ([longs[i // 2]] if i % 2 == 0 else [shorts[i // 2]])]
    for i, p in enumerate(ps):
        d.open(f"s{i}", p, max_tokens=6, chunk=48)
    d.run([f"s{i}" for i in range(len(ps))])
    _check_exact(d, whole, ps, 6)
    if any(len(p) > 32 for p in ps):
        assert d.blob_bytes > 0  # prefill chunks went through blobs
    assert d.inline_bytes > 0  # decode steps inline
    # every hop batched: some fused call held several sessions (from 2 up)
    if n >= 2:
        for w in d.workers:
            assert max(s for _, s in w.stats.recent_calls) >= 2
    # nothing held, no input blob left behind
    for w in d.workers:
        assert w.hops.held() == 0
        assert not list(real_redis.scan_iter(match=WorkerKeys(w.settings.worker_id).activations_in("*")))


@settings(max_examples=60 if SOAK else 6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hops_equal_the_whole_model_for_any_split_prompt_and_arrival_order(
        real_redis: redis.Redis, deep_model: Path, whole: NumpyReferenceEngine, data: st.DataObject) -> None:
    """Property: split points, prompt lengths, chunking, sessions and arrival orders drawn at random."""
    real_redis.flushall()
    n_hops = data.draw(st.integers(2, 3), label="hops")
    cuts = tuple(sorted(data.draw(st.lists(st.integers(1, N_LAYER - 1), min_size=n_hops - 1, max_size=n_hops - 1,
                                           unique=True), label="cuts")))
    n = data.draw(st.integers(1, 4), label="sessions")
    lens = data.draw(st.lists(st.integers(1, 100), min_size=n, max_size=n), label="prompt lengths")
    chunk = data.draw(st.sampled_from([5, 16, 33, 64]), label="chunk")
    seed = data.draw(st.integers(0, 2**16), label="order seed")
    budget = data.draw(st.sampled_from([8, 32, 512]), label="prefill budget")
    d = _route(real_redis, deep_model, cuts, prefill_budget=budget)
    d.shuffle, d.rng = True, random.Random(seed)
    rng = np.random.default_rng(seed)
    ps = [[int(t) for t in rng.integers(3, 500, k)] for k in lens]
    for i, p in enumerate(ps):
        d.open(f"s{i}", p, max_tokens=4, chunk=chunk)
    d.run([f"s{i}" for i in range(n)])
    _check_exact(d, whole, ps, 4)


def test_sampled_sessions_on_hops_equal_one_hop(real_redis: redis.Redis, deep_model: Path) -> None:
    """Seeded sampling: the same tokens on a 3-hop route as on a one-hop route (the last hop samples,
    keyed by the session's seed and position, as a whole model does)."""
    one = _route(real_redis, deep_model, ())
    three = _route(real_redis, deep_model, (1, 2))
    ps = prompts(4, 500, seed=3, lo=5, hi=60)
    for d in (one, three):
        for i, p in enumerate(ps):
            d.open(f"s{i}", p, max_tokens=8, sampling=Sampling(temperature=0.9, top_p=0.95, seed=11 + i))
        d.run([f"s{i}" for i in range(4)])
        assert not d.failures()
    assert one.tokens == three.tokens


def test_hop_and_whole_model_steps_never_share_a_fused_call(real_redis: redis.Redis, deep_model: Path) -> None:
    d = _route(real_redis, deep_model, (2,))
    solo = _route(real_redis, deep_model, ())
    hop1, whole_w = d.workers[1], solo.workers[0]
    # every hop has its own key, so its own stream; and none is the whole model's
    digests = {w.keys["decode"].digest for w in (*d.workers, whole_w)}
    assert len(digests) == 3
    # a whole-model session's step on a hop worker's stream: incompatible (the boundary is in the key)
    job = StepJob(job_id="x1", session_id="one-hop", phase="decode", compat=whole_w.keys["decode"].digest,
                  start_position=0, tokens=(5,), created_at=1.0)
    keys1 = WorkerKeys(hop1.settings.worker_id)
    real_redis.xadd(keys1.input_stream(hop1.keys["decode"].digest, "decode"), job_to_fields(job))  # type: ignore[arg-type]
    # a hop-1 step (activations) sent to the whole-model worker with its key: this hop takes tokens
    acts, _ = encode(np.ones((1, 128), np.float32))
    job2 = StepJob(job_id="x2", session_id="two-hop", hop=0, phase="decode", compat=whole_w.keys["decode"].digest,
                   start_position=0, tokens=(5,), created_at=1.0, hidden=acts)
    keys0 = WorkerKeys(whole_w.settings.worker_id)
    real_redis.xadd(keys0.input_stream(whole_w.keys["decode"].digest, "decode"), job_to_fields(job2))  # type: ignore[arg-type]
    # ... while both workers serve real sessions
    ps = prompts(2, 500, seed=4, lo=5, hi=40)
    for dd in (d, solo):
        for i, p in enumerate(ps):
            dd.open(f"s{i}", p, max_tokens=4)
    d.last[(1, "one-hop")] = b"0-0"
    solo.last[(0, "two-hop")] = b"0-0"
    d.results["one-hop"], solo.results["two-hop"] = [], []
    for _ in range(200):
        if all(dd.done(f"s{i}") for dd in (d, solo) for i in range(2)):
            break
        for w in (*d.workers, whole_w):
            w.run_once()
        d.poll()
        solo.poll()
    r1 = [r for _, r in d.results["one-hop"]]
    r2 = [r for _, r in solo.results["two-hop"]]
    assert [(r.status, r.reason) for r in r1] == [(Status.REJECTED, Reason.INCOMPATIBLE)]
    assert [(r.status, r.reason) for r in r2] == [(Status.REJECTED, Reason.BAD_ACTIVATIONS)]
    assert d.tokens == solo.tokens  # the sessions around them are unaffected


@pytest.mark.parametrize("lost", [0, 1, 2], ids=["first", "middle", "last"])
def test_a_hop_that_loses_its_state_is_replayed_on_every_hop(real_redis: redis.Redis, deep_model: Path,
                                                             whole: NumpyReferenceEngine, lost: int) -> None:
    """One hop of a 3-hop route restarts empty mid-run (its KV is gone; a fresh process takes its worker
    id): it answers state_lost, the Tracker replays every hop (attempt + 1), the hops that still hold the
    older attempt drop it for the newer one (Scheduler.supersede), and every session ends with its
    whole-model tokens; no slot of the dead attempt stays taken."""
    d = _route(real_redis, deep_model, (1, 3), n_slots=4)  # full: a re-open must reuse the dropped slot
    ps = prompts(4, 500, seed=lost, lo=5, hi=70)
    for i, p in enumerate(ps):
        d.open(f"s{i}", p, max_tokens=10, chunk=32)
    for _ in range(8):
        for w in d.workers:
            w.run_once()
        d.poll()
    assert not all(d.done(f"s{i}") for i in range(4))
    old = d.workers[lost]
    old.transport.release_lease()
    eng = NumpyReferenceEngine(deep_model, n_slots=4, ctx_per_session=512,
                               layers=((0, 1), (1, 3), (3, 4))[lost])
    workers = list(d.workers)
    workers[lost] = make_hop_worker(real_redis, eng, old.settings.worker_id)
    d.workers = workers
    d.run([f"s{i}" for i in range(4)])
    _check_exact(d, whole, ps, 10)
    assert d.replays > 0
    for w in d.workers:  # only the live attempt held, and nothing once finished
        assert w.scheduler.table.busy_slots == 0, w.settings.worker_id
        assert w.hops.held() == 0


@pytest.mark.parametrize("cuts", [(2,), (1, 3)], ids=["2-hop", "3-hop"])
def test_llama_cpp_hop_files_through_workers_equal_the_whole_model(
        real_redis: redis.Redis, deep_model: Path, tmp_path: Path, cuts: tuple[int, ...]) -> None:
    """The llama.cpp hop engine (split GGUF files, "invariant" recipe) behind real workers and the relay:
    4 sessions (long and short prompts) give the whole model's tokens bit for bit."""
    hops = split_route(deep_model, tmp_path / "hops", cuts)
    tag = next(_ids)
    engines = [LlamaCppEngine(h.path, recipe="invariant", n_slots=8, ctx_per_session=512, n_threads=1)
               for h in hops]
    whole_ll = LlamaCppEngine(deep_model, recipe="invariant", n_slots=1, ctx_per_session=512, n_threads=1)
    try:
        d = RouteDriver(real_redis, [make_hop_worker(real_redis, e, f"ll{tag}-hop{k}") for k, e in enumerate(engines)])
        longs = prompts(2, 500, seed=21, lo=60, hi=120)
        shorts = prompts(2, 500, seed=22, lo=2, hi=9)
        ps = [longs[0], shorts[0], longs[1], shorts[1]]
        _assert_route_equals_whole(d, whole_ll, ps, max_tokens=8, chunk=48)
        assert d.blob_bytes > 0 and d.inline_bytes > 0
        for w in d.workers:
            assert max(s for _, s in w.stats.recent_calls) >= 2
    finally:
        for e in (*engines, whole_ll):
            e.close()


def test_a_hop_engine_answering_bad_rows_fails_only_its_sessions(real_redis: redis.Redis, deep_model: Path,
                                                                 whole: NumpyReferenceEngine) -> None:
    """Hop 0's engine answers NaN rows for one session and too few rows for another: those two sessions
    fail (engine_error; nothing is relayed that the next hop would compute on), the worker keeps serving
    and the other sessions give the whole model's tokens."""
    from consumer.batch import EngineOutput

    class Faulty:
        def __init__(self, inner: NumpyReferenceEngine) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        def forward(self, batch):  # type: ignore[no-untyped-def]
            out = self.inner.forward(batch)
            rows = out.rows.copy()
            nan = np.asarray(batch.tokens) == 499
            rows[nan] = np.nan
            if (np.asarray(batch.tokens) == 498).any():
                rows = rows[:-1]  # a row short: the call fails as a whole, then bisects
            return EngineOutput.hidden(rows)

    d = _route(real_redis, deep_model, (2,))
    eng0 = NumpyReferenceEngine(deep_model, n_slots=8, ctx_per_session=512, layers=(0, 2))
    d.workers[0].transport.release_lease()
    workers = list(d.workers)
    workers[0] = make_hop_worker(real_redis, Faulty(eng0), d.workers[0].settings.worker_id)  # type: ignore[arg-type]
    d.workers = workers
    ps = prompts(4, 400, seed=8, lo=5, hi=20)
    ps[1] = [*ps[1][:2], 499, *ps[1][2:]]
    for i, p in enumerate(ps):
        d.open(f"s{i}", p, max_tokens=5)
    d.run([f"s{i}" for i in range(4)])
    failed = {r.session_id: r for _, r in d.failures()}
    assert set(failed) == {"s1"} and failed["s1"].reason == Reason.ENGINE_ERROR
    for i in (0, 2, 3):
        assert d.tokens[f"s{i}"] == solo_generate(whole, ps[i], 5)
    # too few rows: the call's sessions fail (the engine's state moved, no retry), the worker goes on
    d.open("t0", [5, 6, 498, 7], max_tokens=3)
    d.run(["t0"])
    assert [r.reason for _, r in d.failures() if r.session_id == "t0"] == [Reason.ENGINE_ERROR]
    d.open("t1", ps[0], max_tokens=5)
    d.run(["t1"])
    assert d.tokens["t1"] == solo_generate(whole, ps[0], 5)
    assert d.workers[0].hops.held() == 0


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("cuts", [(6,), (6, 12)], ids=["2-hop", "3-hop"])
def test_gemma_hops_through_workers_equal_the_whole_model(real_redis: redis.Redis, gemma_model_path: Path,
                                                          tmp_path: Path, cuts: tuple[int, ...]) -> None:
    """Gemma 3 270M cut at block 6 (and 12), llama.cpp "invariant" hops behind workers, relayed: 3 sessions
    (long and short prompts, fused per call) equal the whole model bit for bit (DGR_SLOW=1)."""
    hops = split_route(gemma_model_path, tmp_path / "hops", cuts)
    tag = next(_ids)
    engines = [LlamaCppEngine(h.path, recipe="invariant", n_slots=4, ctx_per_session=512) for h in hops]
    whole_ll = LlamaCppEngine(gemma_model_path, recipe="invariant", n_slots=1, ctx_per_session=512)
    try:
        d = RouteDriver(real_redis, [make_hop_worker(real_redis, e, f"g{tag}-hop{k}") for k, e in enumerate(engines)])
        ps = [*prompts(1, 20000, seed=31, lo=40, hi=40), *prompts(2, 20000, seed=32, lo=3, hi=9)]
        _assert_route_equals_whole(d, whole_ll, ps, max_tokens=4, chunk=32)
    finally:
        for e in (*engines, whole_ll):
            e.close()


def _assert_route_equals_whole(d: RouteDriver, whole: LlamaCppEngine, ps: list[list[int]], *, max_tokens: int,
                               chunk: int) -> None:
    """Open every prompt on the route, run them together, and require each session's tokens to equal the
    whole model's run alone."""
    for i, p in enumerate(ps):
        d.open(f"s{i}", p, max_tokens=max_tokens, chunk=chunk)
    d.run([f"s{i}" for i in range(len(ps))])
    assert not d.failures(), d.failures()[:3]
    for i, p in enumerate(ps):
        assert d.tokens[f"s{i}"] == solo_generate(whole, p, max_tokens), f"s{i}"
