"""Routes of several hops end to end: real redis-server, real worker processes, the whole model as oracle.

The tiny model is built with 4 blocks and cut into a 2-hop route ([0,2), [2,4)) and a 3-hop route
([0,1), [1,3), [3,4)); every hop is its own worker process (reference engine). A session's tokens on a
route must equal, bit for bit, its tokens on the whole model (one hop), for greedy and sampled sessions,
short prompts (one prefill chunk, inline rows) and long ones (several chunks: rows through blobs), 1 to 8
concurrent sessions, any arrival order. Billing: the last hop charges the session's tokens once; every
hop charges its engine time; no hop holds a slot afterwards (the Tracker releases the non-last hops).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.ops.sessions import session_accounting
from dgrtools.localredis import LocalRedis
from dgrtools.split_model import split_route
from dgrtools.tiny_model import write_tiny_model
from producer import AsyncProducer, Producer, RouteHandle
from schemas import CompatibilityKey, RouteHop, Sampling, SessionSpec, StepResult, WorkerKeys

from .producer_drivers import DRIVERS, SyncOverAsync
from .support import ConsumerProcess, prompts, session_results

SOAK = os.environ.get("DGR_SOAK") == "1"  # DGR_SOAK=1: the long searches

pytestmark = pytest.mark.timeout(300)
N_LAYER = 4
ROUTES = {1: ("whole",), 2: ("r2-0", "r2-1"), 3: ("r3-0", "r3-1", "r3-2")}
CUTS = {2: (2,), 3: (1, 3)}
CHUNK = 48  # x 128 floats x 4 bytes = 24 KiB: a full chunk's rows go through a blob, a short prompt's inline


@dataclass
class Fleet:
    url: str
    client: redis.Redis
    keys: dict[str, CompatibilityKey]
    procs: dict[str, ConsumerProcess]
    model: Path
    logs: Path

    def producer(self, **kw: object) -> Producer:
        return Producer(self.client, prefill_chunk=CHUNK, timeout_s=60, **kw)  # type: ignore[arg-type]

    def specs(self, n_hops: int, prefix: str, ps: Sequence[Sequence[int]], max_tokens: int,
              sampled: Sequence[bool] = ()) -> list[tuple[SessionSpec, list[int]]]:
        route = tuple(RouteHop(worker_id=w, key=self.keys[w]) for w in ROUTES[n_hops])
        out = []
        for i, p in enumerate(ps):
            sampling = Sampling(temperature=0.9, top_p=0.95, seed=i) if i < len(sampled) and sampled[i] else Sampling()
            out.append((SessionSpec(session_id=f"{prefix}-{i}", account_id=f"acct-{i % 2}", route=route,
                                    sampling=sampling, max_tokens=max_tokens), list(p)))
        return out

    def account(self, worker: str, sid: str) -> dict[str, str]:
        return session_accounting(self.client, worker, sid)

    def busy(self, worker: str) -> int:
        raw = self.client.get(WorkerKeys(worker).heartbeat)
        return int(json.loads(raw).get("busy_slots", -1)) if raw else -1


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    d = tmp_path_factory.mktemp("routes")
    src = d / "tiny4.gguf"
    write_tiny_model(src, seed=0, quant="q8_0", n_layer=N_LAYER)
    files = {"whole": src}
    for n, cuts in CUTS.items():
        for w, hop in zip(ROUTES[n], split_route(src, d / f"r{n}", cuts), strict=True):
            files[w] = hop.path
    with LocalRedis(appendonly=False) as srv:
        client = redis.Redis.from_url(srv.url)
        procs: dict[str, ConsumerProcess] = {}
        try:
            for w, f in files.items():
                procs[w] = ConsumerProcess(srv.url, w, f, d / "logs", slots=8)
            p = Producer(client)
            keys = {w: p.discover(w).keys[0] for w in files}
            yield Fleet(srv.url, client, keys, procs, src, d / "logs")
        finally:
            for proc in procs.values():
                proc.stop()


def wait_released(fleet: Fleet, workers: Sequence[str], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(fleet.busy(w) != 0 for w in workers):
        if time.monotonic() > deadline:
            raise AssertionError({w: fleet.busy(w) for w in workers})
        time.sleep(0.05)


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    """Short prompts (one chunk, rows inline) and long ones (several chunks, rows in blobs), alternating."""
    short, long = prompts(n, 512, seed, 1, 6), prompts(n, 512, seed + 1, 60, 150)
    return [short[i] if i % 2 == 0 else long[i] for i in range(n)]


def whole_tokens(fleet: Fleet, prefix: str, ps: Sequence[Sequence[int]], max_tokens: int,
                 sampled: Sequence[bool] = ()) -> list[list[int]]:
    """The oracle: every session on the whole model, one hop."""
    hs = fleet.producer().run_many(fleet.specs(1, prefix, ps, max_tokens, sampled))
    return [hs[f"{prefix}-{i}"].generated for i in range(len(ps))]


@pytest.mark.parametrize("n_hops", [2, 3])
# 1 and 8 sessions through real processes by default (2 and 4 under DGR_SOAK=1): tests/test_hop_worker.py
# and tests/test_hop_engine.py check 1/2/4/8 on every run, a layer below.
@pytest.mark.parametrize("n_sessions", [1, 2, 4, 8] if SOAK else [1, 8])
@pytest.mark.parametrize("driver", DRIVERS)
def test_route_tokens_equal_the_whole_model(fleet: Fleet, n_hops: int, n_sessions: int, driver: str) -> None:
    ps = mixed_prompts(n_sessions, seed=n_sessions * 10 + n_hops)
    sampled = [i % 3 == 2 for i in range(n_sessions)]
    want = whole_tokens(fleet, f"w{n_hops}-{n_sessions}{driver}", ps, 12, sampled)
    prefix = f"r{n_hops}-{n_sessions}{driver}"
    if driver == "sync":
        got = fleet.producer().run_many(fleet.specs(n_hops, prefix, ps, 12, sampled))
    else:  # the asyncio driver, the same body (tests/producer_drivers.py)
        p = SyncOverAsync(fleet.client, prefill_chunk=CHUNK, timeout_s=60)
        try:
            got = p.run_many(fleet.specs(n_hops, prefix, ps, 12, sampled))
        finally:
            p.close()
    if n_sessions > 1:  # the long prompts' rows went through blobs, each deleted once relayed / read
        assert not list(fleet.client.scan_iter("dgr:*:act:*")), "a blob outlived its relay"
    for i, p in enumerate(ps):
        h = got[f"{prefix}-{i}"]
        assert isinstance(h, RouteHandle)
        assert h.status == "finished", (h.status, h.reason, h.detail)
        assert h.generated == want[i], f"session {i} (prompt {len(p)} tokens)"
        last = fleet.account(ROUTES[n_hops][-1], h.session_id)
        assert int(last["prompt_tokens"]) == len(p) and int(last["generated_tokens"]) == 12
        for k, w in enumerate(ROUTES[n_hops][:-1]):  # a hop that is not last bills no token, only its time
            a = fleet.account(w, h.session_id)
            assert int(a.get("prompt_tokens", 0)) == 0 and int(a.get("generated_tokens", 0)) == 0
            assert float(a["engine_seconds"]) > 0 and h.legs[k].engine_seconds > 0
        assert h.billed_generated == 12 and h.prompt_tokens == len(p)
        for leg in h.legs[1:]:  # rows of every token but the last sampled one, blobs for full chunks
            assert leg.bytes_in == (len(p) + 11) * 128 * 4
            assert leg.blobs_in == (len(p) - 32 - 1) // CHUNK + 1 if len(p) > 32 else leg.blobs_in == 0
    wait_released(fleet, ROUTES[n_hops])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                               HealthCheck.too_slow])
@given(n_hops=st.sampled_from([2, 3]), lens=st.lists(st.integers(1, 130), min_size=1, max_size=5),
       starts=st.lists(st.floats(0, 0.3), min_size=5, max_size=5), max_tokens=st.integers(1, 10),
       sampled=st.lists(st.booleans(), min_size=5, max_size=5), seed=st.integers(0, 1000))
def test_route_property_prompt_lengths_and_arrival_orders(fleet: Fleet, n_hops: int, lens: list[int],
                                                         starts: list[float], max_tokens: int, sampled: list[bool],
                                                         seed: int) -> None:
    ps = [prompts(1, 512, seed + i, n, n)[0] for i, n in enumerate(lens)]
    tag = f"p{time.monotonic_ns()}"
    want = whole_tokens(fleet, f"{tag}w", ps, max_tokens, sampled)
    got = fleet.producer().run_many(fleet.specs(n_hops, f"{tag}r", ps, max_tokens, sampled),
                                    start_times=starts[:len(ps)])
    assert [got[f"{tag}r-{i}"].generated for i in range(len(ps))] == want


def test_stop_token_on_the_last_hop_releases_every_other_hop(fleet: Fleet) -> None:
    ps = mixed_prompts(4, seed=7)
    want = whole_tokens(fleet, "stopw", ps, 16)
    stop = want[0][3]  # the 4th token of session 0: a stop token only the last hop ever sees
    route = tuple(RouteHop(worker_id=w, key=fleet.keys[w]) for w in ROUTES[3])
    specs = [(SessionSpec(session_id=f"stop-{i}", account_id="a", route=route, max_tokens=16, stop_tokens=(stop,)),
              p) for i, p in enumerate(ps)]
    got = fleet.producer().run_many(specs)
    for i in range(4):
        cut = next((j + 1 for j, t in enumerate(want[i]) if t == stop), 16)
        assert got[f"stop-{i}"].generated == want[i][:cut]
        assert got[f"stop-{i}"].status == "finished"
    wait_released(fleet, ROUTES[3])


def test_generate_streams_a_route(fleet: Fleet) -> None:
    ps = mixed_prompts(2, seed=3)
    want = whole_tokens(fleet, "genw", ps, 9)
    (spec, p), _ = fleet.specs(2, "gen", ps, 9)
    assert list(fleet.producer().generate(spec, p)) == want[0]


def test_cancel_mid_route_reaches_every_hop(fleet: Fleet) -> None:
    ps = mixed_prompts(4, seed=11)
    producer = fleet.producer()
    seen: dict[str, int] = {}

    def on_result(h: object, r: StepResult) -> None:
        assert isinstance(h, RouteHandle)
        if r.token is not None:
            seen[h.session_id] = seen.get(h.session_id, 0) + 1
            if seen[h.session_id] == 3 and h.session_id.endswith(("-0", "-2")):
                producer.cancel_route(h)

    got = producer.run_many(fleet.specs(3, "cx", ps, 200), on_result=on_result)
    for i in range(4):
        h = got[f"cx-{i}"]
        if i in (0, 2):
            assert h.status == "cancelled", (h.status, h.detail)
            assert 3 <= len(h.generated) < 200
            for w in ROUTES[3]:  # the cancel is state on every hop's worker
                assert fleet.client.exists(WorkerKeys(w).cancel_marker(h.session_id))
        else:
            assert h.status == "finished" and len(h.generated) == 200
    wait_released(fleet, ROUTES[3])


def test_async_driver_gives_the_same_tokens(fleet: Fleet) -> None:
    ps = mixed_prompts(4, seed=5)
    want = whole_tokens(fleet, "aw", ps, 8, [False, True, False, True])

    async def go() -> tuple[dict[str, RouteHandle], list[int], dict[str, RouteHandle]]:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(fleet.url)
        async with AsyncProducer(client, prefill_chunk=CHUNK, timeout_s=60) as p:
            seen: list[str] = []

            async def on_result(h: object, r: StepResult) -> None:  # a coroutine callback is awaited
                seen.append(r.job_id)

            many = await p.run_many(fleet.specs(2, "ar", ps, 8, [False, True, False, True]), on_result=on_result,
                                    start_times=[0.0, 0.05, 0.0, 0.1])
            assert len(seen) == len(set(seen)) >= 4 * 8
            (spec, prompt), *_ = fleet.specs(3, "ag", ps, 8, [False, True, False, True])
            streamed = [t async for t in p.generate(spec, prompt)]
            direct = await p.run_many(fleet.specs(3, "ad", ps[2:3], 8))
            return many, streamed, direct  # type: ignore[return-value]

    many, streamed, direct = asyncio.run(go())
    assert [many[f"ar-{i}"].generated for i in range(4)] == want
    assert streamed == want[0] and direct["ad-0"].generated == want[2]
    wait_released(fleet, ROUTES[2])


def test_demo_route_2_shows_the_same_text_as_one_hop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dgr demo --route 2` on the tiny model (reference engine here; the demo's own is llama.cpp)."""
    from dgrtools.demo import run_demo

    model = tmp_path / "tiny4.gguf"
    write_tiny_model(model, seed=0, quant="q8_0", n_layer=N_LAYER)
    rc = run_demo(model=str(model), sessions=3, max_tokens=6, redis_url=None, recipe="invariant", n_threads=1,
                  route=2, engine="reference")
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "two hops give the same text as one hop" in out
    assert len(list((tmp_path / "tiny4.gguf.hops").glob("*/hop-*.gguf"))) == 2  # cut once, cached by the model


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("cuts", [(6,), (12,), (6, 12)])
def test_gemma_routes_equal_the_whole_model(gemma_model_path: Path, tmp_path: Path, cuts: tuple[int, ...]) -> None:
    """Gemma 3 270M on llama.cpp, cut in two or three hops: 8 sessions, short and long prompts, greedy and
    sampled, equal to the whole model bit for bit (DGR_SLOW=1)."""
    from dgrtools.process import ConsumerProcess as LlamaConsumer
    from dgrtools.tokenizer import Tokenizer

    files = {"g": gemma_model_path}
    ids = [f"g{k}" for k in range(len(cuts) + 1)]
    for w, hop in zip(ids, split_route(gemma_model_path, tmp_path / "hops", cuts), strict=True):
        files[w] = hop.path
    tok = Tokenizer(gemma_model_path)
    texts = ["The capital of France is", "Once upon a time, " * 30, "To make a cup of tea, first",
             "The key idea behind continuous batching is " * 12, "A recipe for pancakes: mix", "My favourite book is",
             "Photosynthesis is the process by which " * 20, "In 1969, the first humans"]
    ps = [tok.encode(t, add_bos=True) for t in texts]
    with LocalRedis(appendonly=False) as srv:
        client = redis.Redis.from_url(srv.url)
        procs = []
        try:
            for w, f in files.items():
                procs.append(LlamaConsumer(srv.url, w, f, tmp_path / "logs", slots=8, threads=2))
            p = Producer(client, prefill_chunk=64, timeout_s=300)
            keys = {w: p.discover(w).keys[0] for w in files}

            def specs(route: Sequence[str], prefix: str) -> list[tuple[SessionSpec, list[int]]]:
                hops = tuple(RouteHop(worker_id=w, key=keys[w]) for w in route)
                return [(SessionSpec(session_id=f"{prefix}-{i}", account_id="a", route=hops, max_tokens=16,
                                     sampling=Sampling(temperature=0.8, top_p=0.95, seed=i) if i % 2 else Sampling()),
                         q) for i, q in enumerate(ps)]

            whole = p.run_many(specs(["g"], "w"))
            got = p.run_many(specs(ids, "r"))
            for i in range(len(ps)):
                assert got[f"r-{i}"].generated == whole[f"w-{i}"].generated, i
        finally:
            for proc in procs:
                proc.stop()


@pytest.mark.parametrize("use_async", [False, True])
def test_tracker_sim_drives_a_route_and_cancels_on_every_hop(fleet: Fleet, tmp_path: Path, use_async: bool) -> None:
    import subprocess
    import sys

    out = tmp_path / "sim.json"
    seed = 4 + use_async  # distinct session ids per run
    run = subprocess.run([sys.executable, "-m", "consumer", "tracker-sim", "--redis-url", fleet.url,
                          "--worker-id", ",".join(ROUTES[3]), "--sessions", "6", "--prompt-len", "4:90",
                          "--max-tokens", "8", "--rate", "50", "--cancel-fraction", "0.34", "--temperature", "0.8",
                          "--seed", str(seed), "--json-out", str(out), *(["--async"] if use_async else [])],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "r3-0 -> r3-1 -> r3-2" in run.stdout
    sessions = json.loads(out.read_text())["sessions"]
    assert sorted(s["status"] for s in sessions) == ["cancelled"] * 2 + ["finished"] * 4
    assert all(len(s["generated"]) == 8 for s in sessions if s["status"] == "finished")
    for s in sessions:
        if s["status"] == "cancelled":
            assert all(fleet.client.exists(WorkerKeys(w).cancel_marker(s["session"])) for w in ROUTES[3])
    wait_released(fleet, ROUTES[3])


class _Gone:
    """A Redis client whose every call fails for good: the Tracker that held it died."""

    def __getattr__(self, name: str) -> object:
        raise RuntimeError("this Tracker is gone")


@pytest.mark.parametrize("use_async,die_at", [(False, 8), (False, 40), (True, 20)])
def test_a_tracker_restarted_mid_route_resumes_its_sessions_from_redis(fleet: Fleet, use_async: bool,
                                                                      die_at: int) -> None:
    """A Tracker drives 3-hop routes and dies mid-way (in their prompts' relays, or decoding);
    another process rebuilds every session from Redis with ONE scan per hop's result stream (`resume_many`) and
    finishes them: the whole model's tokens, every job answered once on every hop, billed once by the last."""
    import threading

    ps = mixed_prompts(6, seed=17)
    want = whole_tokens(fleet, f"rzw{int(use_async)}{die_at}", ps, 24)
    prefix = f"rz{int(use_async)}{die_at}"
    specs = fleet.specs(3, prefix, ps, 24)
    first = fleet.producer()
    seen: list[int] = []
    box: dict[str, BaseException] = {}

    def on_result(h: object, r: StepResult) -> None:
        seen.append(1)
        if len(seen) == die_at:  # the Tracker's process dies (its client fails for good)
            first.client = _Gone()  # type: ignore[assignment]

    def drive() -> None:
        try:
            first.run_many(specs, on_result=on_result)
        except RuntimeError as e:
            box["died"] = e

    t = threading.Thread(target=drive)
    t.start()
    t.join(120)
    assert "died" in box, "the first Tracker finished before it could die: the test did not test resume"
    sids = [spec.session_id for spec, _ in specs]
    if use_async:
        async def go() -> dict[str, RouteHandle]:
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(fleet.url)
            async with AsyncProducer(client, prefill_chunk=CHUNK, timeout_s=60) as p:
                resumed = await p.resume_many(ROUTES[3][0], sids)
                out = await p.drive(list(resumed.values()))
            await client.aclose()
            return out  # type: ignore[no-any-return]

        got = asyncio.run(go())
    else:
        other = fleet.producer()
        resumed = other.resume_many(ROUTES[3][0], sids)
        assert all(h.reply == first.tracker_id for h in resumed.values())  # the stream its jobs name
        got = other.drive(list(resumed.values()))
    for i, p in enumerate(ps):
        h = got[f"{prefix}-{i}"]
        assert h.status == "finished", (h.status, h.reason, h.detail)
        assert h.generated == want[i], i
        last = fleet.account(ROUTES[3][-1], h.session_id)
        assert int(last["prompt_tokens"]) == len(p) and int(last["generated_tokens"]) == 24
        for w in ROUTES[3]:  # nothing answered twice on any hop
            ids = [r.job_id for r in session_results(fleet.client, w, h.session_id)]
            assert len(ids) == len(set(ids)), (w, i)
    wait_released(fleet, ROUTES[3])
