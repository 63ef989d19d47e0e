"""Every public producer method refuses bad arguments with a clear error, before writing anything."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import redis

from consumer.transport import RedisTransport
from producer import Producer, job_id
from tests.producer_drivers import DRIVERS, SyncOverAsync
from tests.test_transport import WORKER, make_key, make_spec

VOCAB = 100


@pytest.fixture(params=DRIVERS)
def producer(fake_redis: redis.Redis, request: pytest.FixtureRequest) -> Iterator[Producer]:
    """Both drivers check the same way (the checks are the core's): each test runs against each."""
    t = RedisTransport(fake_redis, WORKER, "c0")
    t.register([make_key("prefill"), make_key("decode")], {"vocab_size": VOCAB})
    t.heartbeat()
    if request.param == "sync":
        yield Producer(fake_redis)
        return
    p = SyncOverAsync(fake_redis)
    yield p  # type: ignore[misc]
    p.close()


def written(client: redis.Redis) -> int:
    return sum(int(client.xlen(k)) for k in client.keys("*") if client.type(k) == b"stream")


@pytest.mark.parametrize("worker_id", ["a}{b", "w1\n", "", "*", "w 1", "x" * 65])
def test_cancel_refuses_worker_ids_that_are_not_ids(producer: Producer, worker_id: str) -> None:
    before = producer.client.dbsize()
    with pytest.raises(ValueError, match="worker_id"):
        producer.cancel(worker_id, "s-1")
    assert producer.client.dbsize() == before  # no key built from it


@pytest.mark.parametrize("session_id", ["s-1\n", "a}{b", "", "é"])
def test_cancel_refuses_session_ids_that_are_not_ids(producer: Producer, session_id: str) -> None:
    with pytest.raises(ValueError, match="session_id"):
        producer.cancel(WORKER, session_id)
    with pytest.raises(TypeError):
        producer.cancel(WORKER, b"s-1")  # type: ignore[arg-type]


def test_tokens_must_be_in_the_advertised_vocabulary(producer: Producer) -> None:
    before = written(producer.client)
    with pytest.raises(ValueError, match=rf"outside \[0, {VOCAB}\)"):
        producer.open(make_spec("s-1"), [1, 2, VOCAB])
    with pytest.raises(TypeError, match="integer"):
        producer.open(make_spec("s-1"), [1, 2.0])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="integer"):
        producer.open(make_spec("s-1"), [True])
    with pytest.raises(TypeError, match="sequence"):
        producer.open(make_spec("s-1"), "123")  # type: ignore[arg-type]
    assert written(producer.client) == before
    h = producer.open(make_spec("s-1"), [1, 2, 3])
    with pytest.raises(ValueError, match="token"):
        producer.push_decode(h, VOCAB + 1)
    with pytest.raises(TypeError):
        producer.push_decode(h, "7")  # type: ignore[arg-type]


def test_numpy_integer_tokens_are_accepted(producer: Producer) -> None:
    h = producer.open(make_spec("s-np"), np.array([4, 5, 6], dtype=np.int64))  # type: ignore[arg-type]
    assert h.prompt == (4, 5, 6) and all(type(t) is int for t in h.prompt)
    producer.open(make_spec("s-np2"), [np.int32(4), np.uint16(5)])  # type: ignore[list-item]
    producer.push_decode(h, np.int64(9))  # type: ignore[arg-type]
    assert h.position == 4


def test_other_entry_points(producer: Producer) -> None:
    with pytest.raises(ValueError, match="worker_id"):
        producer.discover("a}{b")
    with pytest.raises(TypeError, match="SessionSpec"):
        producer.open({"session_id": "s"}, [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hop"):
        producer.open(make_spec("s"), [1], hop=True)
    with pytest.raises(TypeError, match="SessionHandle"):
        producer.read_results(["s-1"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="SessionHandle"):
        producer.replay("s-1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="session_id"):
        job_id("s\n", 0, "decode", 1, 0)


def test_errors_have_one_root_and_come_from_the_package() -> None:
    import producer
    from schemas import DgrError, ProducerError

    for name in ("Backpressure", "ResultTimeout", "SessionFailed"):
        err = getattr(producer, name)
        assert issubclass(err, ProducerError) and issubclass(err, DgrError) and issubclass(err, RuntimeError), name
        assert err.__module__ == "producer.errors"
    assert issubclass(producer.ResultTimeout, TimeoutError) and producer.ProducerError is ProducerError


def test_the_vocabulary_checked_is_the_engine_of_the_key() -> None:
    """A worker of several engines advertises each engine's vocabulary (`engines`): a session's tokens are
    checked against its own engine's, found by its key's digest; a one-engine worker's top-level one."""
    from producer.validate import vocab_size

    info = {"vocab_size": 512, "engines": [
        {"engine": "small", "digests": {"prefill": "aa" * 8, "decode": "bb" * 8}, "vocab_size": 512},
        {"engine": "big", "digests": {"prefill": "cc" * 8, "decode": "dd" * 8}, "vocab_size": 262_144}]}
    assert vocab_size(info, "dd" * 8) == 262_144 and vocab_size(info, "aa" * 8) == 512
    assert vocab_size(info, "ee" * 8) == 512 and vocab_size(info) == 512  # unknown key: the worker's own
    assert vocab_size({"vocab_size": 300}, "aa" * 8) == 300 and vocab_size(None) is None
