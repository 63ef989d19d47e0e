"""Both drivers place sessions opened from a SessionTemplate (producer/placement.py) on the workers that
advertise the key, by load; a draining or stale worker gets none; a named worker works as before."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis

from producer import AsyncProducer, Producer, SessionHandle, SessionTemplate
from producer.commands import Plan
from producer.validate import WorkerInfo
from schemas import WorkerKeys
from tests.producer_drivers import MakeProducer, async_client_for, make_producer
from tests.test_producer import FakeWorker, expected_tokens
from tests.test_transport import make_key, make_spec

__all__ = ["make_producer"]


def template(sid: str, max_tokens: int = 3) -> SessionTemplate:
    return SessionTemplate(session_id=sid, account_id="acct-1", keys=(make_key("prefill"),),
                           options={"max_tokens": max_tokens})


def test_templates_are_spread_over_the_fleet_by_load(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    workers = [FakeWorker(redis_client, worker_id=f"w{i}") for i in range(3)]
    for w in workers:
        w.t.heartbeat({"slots": 4, "busy_slots": 0})
    p = make_producer(redis_client)
    still_pending: list[str] = []

    def on_result(h: object, r: object) -> None:  # at a session's first token its rows are no longer pending
        if r.token is not None and r.position == 2 and r.session_id in p.core.fleet.prefilling:  # type: ignore[attr-defined]
            still_pending.append(r.session_id)  # type: ignore[attr-defined]

    with workers[0], workers[1], workers[2]:
        sessions = [(template(f"s{i}"), [1, 2]) for i in range(9)]
        out = p.run_many(sessions, on_result=on_result)
    assert still_pending == []
    per: dict[str, int] = {}
    for sid, h in out.items():
        assert h.status == "finished" and h.generated == expected_tokens(sid, 2, 3)
        per[h.worker_id] = per.get(h.worker_id, 0) + 1
    assert per == {"w0": 3, "w1": 3, "w2": 3}  # 4 slots each, 9 sessions: balanced, none full
    stats = p.fleet()
    assert {w: s["placed"] for w, s in stats.items()} == per
    # each session's prompt rows counted as pending on its worker until its first token, none left after the run
    view = p.core.fleet
    assert view.prefilling == {} and view.pending == {}
    assert all(c.pending == 0 for c in view.candidates.values())


def test_a_draining_or_stale_worker_gets_no_session(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    live, draining, _stale = (FakeWorker(redis_client, worker_id=w) for w in ("live", "drain", "stale"))
    live.t.heartbeat({"slots": 1, "busy_slots": 1})  # full: still the only one eligible
    draining.t.heartbeat({"slots": 8, "busy_slots": 0, "draining": True})
    old = {"ts": time.time() - 60, "worker_id": "stale", "slots": 8, "busy_slots": 0}
    redis_client.set(WorkerKeys("stale").heartbeat, json.dumps(old))
    p = make_producer(redis_client)
    with live:
        out = p.run_many([(template(f"d{i}"), [3]) for i in range(3)])
    assert {h.worker_id for h in out.values()} == {"live"}
    assert all(h.status == "finished" for h in out.values())


def test_generate_and_open_take_a_template_and_a_named_worker_still_works(redis_client: redis.Redis,
                                                                          make_producer: MakeProducer) -> None:
    a, b = FakeWorker(redis_client, worker_id="a"), FakeWorker(redis_client, worker_id="b")
    a.t.heartbeat({"slots": 2, "busy_slots": 2})
    b.t.heartbeat({"slots": 2, "busy_slots": 0})
    p = make_producer(redis_client)
    with a, b:
        assert list(p.generate(template("g1"), [5, 6])) == expected_tokens("g1", 2, 3)
        named = p.run_many([(make_spec("n1", worker="a", max_tokens=2), [5])])
    assert named["n1"].worker_id == "a" and named["n1"].status == "finished"
    assert p.fleet()["b"]["placed"] == 1 and p.fleet()["a"]["refused_full"] == 1


def test_no_worker_for_the_key_is_a_lookup_error(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    FakeWorker(redis_client, worker_id="other").t.heartbeat({"slots": 2, "draining": True})
    p = make_producer(redis_client)
    with pytest.raises(LookupError, match="no worker to place"):
        p.run_many([(template("x1"), [1])])


def test_a_session_a_full_worker_refuses_waits_for_room_and_finishes(real_redis: redis.Redis,
                                                                     make_producer: MakeProducer) -> None:
    """Found by tests/test_fleet_chaos.py under DGR_SOAK=1 (18 sessions on 3 x 4 slots, one worker killed): when
    every worker is full, placement names the least costly one, whose worker refuses the opening for a slot; the
    session ended `rejected`. Now it waits for room and is placed again (producer/moves.py `place_waiting`): two
    real workers of one slot each, six sessions at once: every one finishes with its tokens alone, billed once,
    and the attempts that placed a session again cost no max_attempts."""
    import threading

    from consumer.transport import RedisTransport
    from consumer.worker import Worker, WorkerSettings
    from producer import PlacementPolicy
    from tests.test_continuation import HistoryEngine, Sess, oracle

    tag = f"{time.time_ns() % 10**9}"
    wids = [f"room{i}-{tag}" for i in range(2)]
    workers = [Worker(HistoryEngine(1), RedisTransport(real_redis, w, consumer_name=w),
                      WorkerSettings(worker_id=w, block_ms=5, await_ms=2, gather_ms=1.0, heartbeat_s=0.1))
               for w in wids]
    for w in workers:
        w.start()
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        _beating(real_redis, wids)
        key = workers[0].keys["prefill"]
        ss = {f"r{i}-{tag}": Sess(prompt=(3, 1 + i, 4), max_tokens=12, n=4) for i in range(6)}
        p = make_producer(real_redis, timeout_s=30, decode_n=4, discover_cache_s=0.05,
                          placement=PlacementPolicy(lost_check_s=0.02))
        out = p.run_many([(SessionTemplate(session_id=sid, account_id="acct-room", keys=(key,),
                                           options={"max_tokens": s.max_tokens}), list(s.prompt))
                          for sid, s in ss.items()])
    finally:
        for w in workers:
            w.request_stop()
        for t in threads:
            t.join(timeout=30)
    for sid, s in ss.items():
        h = out[sid]
        assert (h.status, h.generated) == ("finished", oracle(s)), (sid, h.status, h.reason, h.detail)
        assert h.attempt == h.room_waits  # every attempt after the first placed it again after a refusal
        charged = sum(int(real_redis.hget(WorkerKeys(w).session_account(sid), "generated_tokens") or 0) for w in wids)
        assert charged == s.max_tokens
    stats = p.fleet()
    assert sum(h.room_waits for h in out.values()) == sum(stats[w]["refused_slot"] for w in wids) > 0, stats


def test_a_session_that_finds_no_room_within_timeout_s_ends_rejected(real_redis: redis.Redis,
                                                                     make_producer: MakeProducer) -> None:
    """The other end of the wait: the only worker's one slot is held (a session opened by hand and left), so the
    placed session is refused, waits room_wait_s for room and ends `rejected` (capacity), not ResultTimeout
    (timeout_s is as short: a session waiting for room awaits no answer)."""
    import threading

    from consumer.transport import RedisTransport
    from consumer.worker import Worker, WorkerSettings
    from producer import PlacementPolicy, Producer
    from schemas import RouteHop, SessionSpec
    from tests.test_continuation import HistoryEngine

    wid = f"noroom-{time.time_ns() % 10**9}"
    worker = Worker(HistoryEngine(1), RedisTransport(real_redis, wid, consumer_name=wid),
                    WorkerSettings(worker_id=wid, block_ms=5, await_ms=2, gather_ms=1.0, heartbeat_s=0.1))
    worker.start()
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        _beating(real_redis, [wid])
        key = worker.keys["prefill"]
        holder = Producer(real_redis, timeout_s=30)
        held = holder.open(SessionSpec(session_id=f"{wid}-held", account_id="acct-room",
                                       route=(RouteHop(worker_id=wid, key=key),), max_tokens=100), [5, 6])
        while not held.generated:  # open on the slot, then left there
            holder.read_results([held], block_ms=200)
        p = make_producer(real_redis, timeout_s=1.0, discover_cache_s=0.05,
                          placement=PlacementPolicy(lost_check_s=0.02, room_wait_s=1.0))
        t0 = time.monotonic()
        out = p.run_many([(SessionTemplate(session_id=f"{wid}-late", account_id="acct-room", keys=(key,),
                                           options={"max_tokens": 4}), [7, 8])])
        waited = time.monotonic() - t0
    finally:
        worker.request_stop()
        thread.join(timeout=30)
    h = out[f"{wid}-late"]
    assert (h.status, h.reason, h.generated) == ("rejected", "capacity", []), (h.status, h.reason, h.detail)
    assert "no worker with room within 1.0 s" in h.detail and waited >= 1.0
    assert p.fleet()[wid]["refused_slot"] >= 1


def _beating(client: redis.Redis, wids: list[str]) -> None:
    """Until every worker's first heartbeat is written (its loop beats from its I/O thread: not yet when start()
    returns, and placement takes only workers that beat)."""
    deadline = time.monotonic() + 10
    while not all(client.exists(WorkerKeys(w).heartbeat) for w in wids):
        assert time.monotonic() < deadline, "a worker never beat"
        time.sleep(0.01)


def test_a_session_cancelled_while_it_waits_for_room_is_never_opened(real_redis: redis.Redis,
                                                                     make_producer: MakeProducer) -> None:
    """The caller's cancel while its session waits for room sets the marker on the worker that refused it; a
    worker with room that joins later must not open it (the look for room reads the markers first)."""
    import threading

    from consumer.transport import RedisTransport
    from consumer.worker import Worker, WorkerSettings
    from producer import PlacementPolicy, Producer
    from schemas import RouteHop, SessionSpec
    from tests.test_continuation import HistoryEngine

    tag = f"{time.time_ns() % 10**9}"
    wids = [f"cw{i}-{tag}" for i in range(2)]
    workers = [Worker(HistoryEngine(1), RedisTransport(real_redis, w, consumer_name=w),
                      WorkerSettings(worker_id=w, block_ms=5, await_ms=2, gather_ms=1.0, heartbeat_s=0.1))
               for w in wids]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    workers[0].start()
    threads[0].start()
    try:
        _beating(real_redis, wids[:1])
        key = workers[0].keys["prefill"]
        holder = Producer(real_redis, timeout_s=30)
        held = holder.open(SessionSpec(session_id=f"{tag}-held", account_id="acct-room",
                                       route=(RouteHop(worker_id=wids[0], key=key),), max_tokens=100), [5, 6])
        while not held.generated:
            holder.read_results([held], block_ms=200)
        late = f"{tag}-late"

        def meanwhile() -> None:  # once it waits: cancelled, then a worker with room comes
            deadline = time.monotonic() + 10
            while not workers[0].scheduler.stats.rejected_capacity and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)  # the refusal read by the Tracker: it waits
            holder.cancel(wids[0], late)
            time.sleep(0.1)
            workers[1].start()
            threads[1].start()

        p = make_producer(real_redis, timeout_s=10.0, discover_cache_s=0.05,
                          placement=PlacementPolicy(lost_check_s=0.05, room_wait_s=10.0))
        helper = threading.Thread(target=meanwhile)
        helper.start()
        out = p.run_many([(SessionTemplate(session_id=late, account_id="acct-room", keys=(key,),
                                           options={"max_tokens": 4}), [7, 8])])
        helper.join()
    finally:
        for w, t in zip(workers, threads, strict=True):
            w.request_stop()
            if t.is_alive():
                t.join(timeout=30)
    h = out[late]
    assert (h.status, h.reason, h.generated) == ("cancelled", "cancelled", []), (h.status, h.reason, h.detail)
    assert not real_redis.exists(WorkerKeys(wids[1]).session_account(late))  # never opened on the newcomer


@pytest.mark.parametrize("read_before", [True, False], ids=["stale", "never-read"])
def test_openings_of_one_loop_turn_read_the_fleet_once(redis_client: redis.Redis, read_before: bool) -> None:
    """AsyncProducer: tasks each opening a template session in one loop turn (`dgr serve`'s requests at once) find
    the fleet stale together; one of them reads it, and the others take it (each read it before: 24 reads of every
    heartbeat and advertisement), and none asks for its worker's advertisement again (`discover`)."""
    workers = [FakeWorker(redis_client, worker_id=f"w{i}") for i in range(2)]
    for w in workers:
        w.t.heartbeat({"slots": 32, "busy_slots": 0})
    reads = discovered = 0

    async def main() -> list[dict[str, SessionHandle]]:
        nonlocal reads, discovered
        p = AsyncProducer(async_client_for(redis_client))
        real = p.core.workers

        def counted() -> Plan[list[WorkerInfo]]:
            nonlocal reads
            reads += 1
            return (yield from real())

        real_discover = p.core.discover

        def discover(worker_id: str) -> Plan[WorkerInfo]:
            nonlocal discovered
            discovered += 1
            return (yield from real_discover(worker_id))

        p.core.workers = counted  # type: ignore[method-assign]
        p.core.discover = discover  # type: ignore[method-assign]
        try:
            if read_before:
                await p.run_many([(template("first"), [1, 2])])
                p.core.fleet.read_at -= 100.0  # older than discover_cache_s
                reads = discovered = 0
            return await asyncio.gather(*(p.run_many([(template(f"s{i}"), [1, 2])]) for i in range(24)))
        finally:
            await p.aclose()

    with workers[0], workers[1]:
        outs = asyncio.run(main())
    assert (reads, discovered) == (1, 0)
    assert [h.status for out in outs for h in out.values()] == ["finished"] * 24


def test_runs_leave_no_garbage_cycles(redis_client: redis.Redis) -> None:
    """A run and its handles held each other (`h.run`, `run.handles`): some 25 objects a session that only the
    cyclic collector freed, in the Tracker of every caller. Both drivers, run_many and stream_many: no run, handle
    or hop leg is among what the collector finds. Whatever else it finds there varies with the host's timing (186
    objects in one CI run under load, none here) and is not counted."""
    import gc

    from producer.session import HopLeg, Run

    ours = (Run, SessionHandle, HopLeg)
    worker = FakeWorker(redis_client, worker_id="w0")
    worker.t.heartbeat({"slots": 64, "busy_slots": 0})

    def left_in_cycles() -> int:
        """Runs, handles and legs the collector finds unreachable (kept aside to be counted, then let go)."""
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            return sum(isinstance(o, ours) for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()

    async def both_async(p: AsyncProducer, k: int) -> None:
        await asyncio.gather(*(p.run_many([(template(f"a{k}-{i}"), [1, 2])]) for i in range(4)))
        for i in range(4):
            async for _ in p.stream_many([(template(f"b{k}-{i}"), [1, 2])]):
                pass

    async def in_async() -> int:
        p = AsyncProducer(async_client_for(redis_client))
        try:
            await both_async(p, 0)
            await asyncio.sleep(0.01)
            gc.collect()
            gc.disable()
            for k in range(1, 4):
                await both_async(p, k)
            await asyncio.sleep(0.01)
            return left_in_cycles()
        finally:
            gc.enable()
            await p.aclose()

    with worker:
        found_async = asyncio.run(in_async())
        p = Producer(redis_client)
        p.run_many([(template("s0"), [1, 2])])
        gc.collect()
        gc.disable()
        try:
            for k in range(1, 4):
                p.run_many([(template(f"s{k}-{i}"), [1, 2]) for i in range(4)])
            found_sync = left_in_cycles()
        finally:
            gc.enable()
    assert (found_async, found_sync) == (0, 0)


@pytest.mark.parametrize("reader", ["fails", "is cancelled"])
def test_a_fleet_read_that_ends_unfinished_holds_no_other_opening(redis_client: redis.Redis, reader: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The one opening reading the fleet for the others (none read before) fails on Redis, or its caller goes
    away mid-read: the others, waiting for that read, read it themselves (one of them) and open at once (not
    after the wait's bound: set out of reach here); only the reader's own session fails."""
    from producer import placement
    from producer.commands import Sleep

    monkeypatch.setattr(placement, "FLEET_READ_WAIT_S", 1e9)

    workers = [FakeWorker(redis_client, worker_id=f"w{i}") for i in range(2)]
    for w in workers:
        w.t.heartbeat({"slots": 32, "busy_slots": 0})
    reads = 0

    async def main() -> list[BaseException | dict[str, SessionHandle]]:
        nonlocal reads
        p = AsyncProducer(async_client_for(redis_client))
        real = p.core.workers

        def first_unfinished() -> Plan[list[WorkerInfo]]:
            nonlocal reads
            reads += 1
            if reads == 1:
                yield Sleep(0.05)  # in flight while the others arrive
                raise ConnectionError("Redis went away mid-read")
            return (yield from real())

        p.core.workers = first_unfinished  # type: ignore[method-assign]
        try:
            tasks = [asyncio.ensure_future(p.run_many([(template(f"s{i}"), [1, 2])])) for i in range(12)]
            if reader == "is cancelled":
                await asyncio.sleep(0.02)
                tasks[0].cancel()
            return list(await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30))
        finally:
            await p.aclose()

    with workers[0], workers[1]:
        outs = asyncio.run(main())
    assert reads == 2
    first = outs[0]
    assert isinstance(first, asyncio.CancelledError if reader == "is cancelled" else ConnectionError), first
    assert [h.status for out in outs[1:] for h in out.values()] == ["finished"] * 11  # type: ignore[union-attr]
