"""Every session the Tracker ends is closed on the worker (issue 29): rejected, failed, timed out, cancelled by
its caller, ended by a callback's exception. The producer cancels it on every worker of its route, one hop or
several, through the durable cancel path (kept to send again after an outage), and the worker frees the slot at
once: each test asserts the worker's busy slots return to zero without the reaper, on a real redis-server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from consumer.engines.sleep import SleepEngine
from consumer.worker import Worker
from producer import AsyncProducer, Producer, ResultTimeout, SessionHandle
from producer.commands import Batch, Set, XAdd
from producer.session import end
from schemas import RouteHop, SessionSpec, WorkerKeys

from .hostile_support import WID, make_worker
from .producer_drivers import async_client_for
from .support import compat_key

PROMPT = [3, 4, 5, 6]


def spec_for(worker: Worker, sid: str = "s-0", max_tokens: int = 40) -> SessionSpec:
    return SessionSpec(session_id=sid, account_id="a", max_tokens=max_tokens,
                       route=(RouteHop(worker_id=WID, key=worker.keys["prefill"]),))  # type: ignore[index]


@pytest.fixture
def worker(real_redis: redis.Redis) -> Worker:
    return make_worker(real_redis, SleepEngine(0.002, n_slots=4))


@pytest.fixture
def running(worker: Worker) -> Iterator[Worker]:
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    yield worker
    worker.request_stop()
    t.join(30)


def eventually(cond: Callable[[], bool], what: str, limit_s: float = 20.0) -> None:
    """Wait for a condition a worker thread makes true (no time is asserted: the limit only ends a hang)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(0.01)


def test_a_rejected_session_is_cancelled_on_its_one_hop(real_redis: redis.Redis, worker: Worker) -> None:
    """A malformed entry carrying the job id of the session's continuation job queued on the worker, and its
    Tracker's reply stream, is answered `rejected` under that id (what a writer without the key can do): the
    Tracker ends the session, and cancels it on the worker, which still held it."""
    p = Producer(real_redis, decode_n=4)
    h = p.open(spec_for(worker), PROMPT)
    stream = WorkerKeys(WID).input_stream(worker.keys["decode"].digest, "decode")  # type: ignore[index]
    forged = False
    for _ in range(100):
        worker.run_once()
        p.poll([h])
        if h.finished:
            break
        if not forged and len(h.generated) >= 2 and len(h.sent) == 2:  # the second job is queued on the worker
            jid = list(h.sent)[-1]
            real_redis.xadd(stream, {"v": "2", "j": f'{{"job_id":"{jid}","session_id":"{h.session_id}",'
                                                    f'"reply_to":"{h.reply}","pos":"not an int"}}'})
            forged = True
    assert h.status == "rejected" and h.reason == "malformed", (h, h.detail)
    for _ in range(3):
        worker.run_once()
    assert worker.scheduler.table.busy_slots == 0


def test_a_failed_one_hop_session_is_cancelled() -> None:
    """The Tracker ends a one-hop session `failed` (an answer it cannot use) while its worker holds it: the
    release is the cancel (marker and event), kept with the cancels sent to send again after an outage."""
    p = Producer(redis.Redis(), decode_n=1, verify_route=False)  # no I/O: the core's decision only
    spec = SessionSpec(session_id="s-f", account_id="a", route=(RouteHop(worker_id=WID, key=compat_key("prefill")),))
    h = SessionHandle(spec=spec, prompt=tuple(PROMPT), worker_id=WID)
    end(h, "failed", "the last hop's sampling answer carried no token")
    batch = Batch()
    assert p.core.advance(batch, h, True)
    keys = WorkerKeys(WID)
    assert [type(op) for op in batch.ops] == [Set, XAdd]
    assert batch.ops[0].key == keys.cancel_marker("s-f")  # type: ignore[attr-defined]
    assert batch.ops[1].stream == keys.cancellations  # type: ignore[attr-defined]
    assert [(w, s) for _, w, s in p.core.cancels] == [(WID, "s-f")]
    assert not p.core.advance(Batch(), h, True), "released once"


def test_a_session_timed_out_is_cancelled_before_its_worker_opens_it(real_redis: redis.Redis,
                                                                      worker: Worker) -> None:
    p = Producer(real_redis, decode_n=1, timeout_s=0.2, read_block_ms=50)
    with pytest.raises(ResultTimeout):
        p.run_many([(spec_for(worker), PROMPT)])
    for _ in range(3):  # the worker comes back: the opening it reads now is answered cancelled
        worker.run_once()
    assert worker.scheduler.table.busy_slots == 0
    assert real_redis.exists(WorkerKeys(WID).cancel_marker("s-0"))


def test_a_session_whose_callback_raises_is_cancelled(real_redis: redis.Redis, running: Worker) -> None:
    p = Producer(real_redis, decode_n=4)

    def boom(h: SessionHandle, r: object) -> None:
        raise RuntimeError("the caller's callback")

    with pytest.raises(RuntimeError, match="callback"):
        p.run_many([(spec_for(running), PROMPT)], on_result=boom)
    eventually(lambda: running.scheduler.table.busy_slots == 0, "the slot was not freed")


def test_a_session_its_caller_stops_reading_is_cancelled(real_redis: redis.Redis, running: Worker) -> None:
    p = Producer(real_redis, decode_n=1)
    tokens = p.generate(spec_for(running), PROMPT)
    next(tokens)
    tokens.close()  # the caller stops iterating
    eventually(lambda: running.scheduler.table.busy_slots == 0, "the slot was not freed")


def test_an_async_run_cancelled_by_its_caller_is_cancelled(real_redis: redis.Redis, running: Worker) -> None:
    async def main() -> None:
        client = async_client_for(real_redis)
        async with AsyncProducer(client, decode_n=1) as p:
            got = asyncio.Event()
            task = asyncio.create_task(p.run_many([(spec_for(running), PROMPT)],
                                                  on_result=lambda h, r: got.set()))
            await asyncio.wait_for(got.wait(), 20)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await client.aclose()

    asyncio.run(main())
    eventually(lambda: running.scheduler.table.busy_slots == 0, "the slot was not freed")


def test_async_answers_closed_early_are_cancelled_and_read_to_the_end_give_the_handles(
        real_redis: redis.Redis, running: Worker) -> None:
    """AsyncProducer.stream_many: its answers as they come; closed after the first, the session is cancelled on
    the worker (as a cancelled run_many); read to the end, `handles` are run_many's."""
    async def main() -> None:
        client = async_client_for(real_redis)
        async with AsyncProducer(client, decode_n=1) as p:
            answers = p.stream_many([(spec_for(running, "s-early"), PROMPT)])
            async for h, r in answers:
                assert h.session_id == "s-early" and r.session_id == "s-early"
                break
            await answers.aclose()
            eventually(lambda: running.scheduler.table.busy_slots == 0, "the slot was not freed")
            whole = p.stream_many([(spec_for(running, "s-whole", max_tokens=5), PROMPT)])
            seen = [r.token async for _, r in whole if r.token is not None]
            (h,) = whole.handles.values()
            assert h.status == "finished" and h.generated == seen and len(seen) == 5
        await client.aclose()

    asyncio.run(main())
